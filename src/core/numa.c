/* The NUMA node of a GPU, read from sysfs, and binding memory to it with the mbind system call.
 *
 * Note [slabs on the GPU's node]
 * On a host with more than one NUMA node, pinned slabs should sit on the node the GPU is attached
 * to: the DMA then crosses no socket link. The CUDA backend asks the runtime for the GPU's PCI
 * bus id (cudaDeviceGetPCIBusId), reads /sys/bus/pci/devices/<bus id>/numa_node, and, when
 * /sys/devices/system/node lists more than one node, the pool passes that node to host_alloc,
 * which asks the kernel to prefer it (mbind, MPOL_PREFERRED: the allocation still succeeds on
 * another node when this one is full) before the slab is prefaulted, so the pages are placed
 * there when they are first touched. On a one-node host, or when anything is unknown, nothing
 * is done (node -1). The pool reports the node in its stats (numa_node, -1 when not bound).
 *
 * PINLOADER_SYSFS_ROOT (tests only) names a directory that stands in for "/" when reading sysfs.
 * mbind is called through syscall(2): no libnuma at build or run time. */
#include "numa.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PL_MPOL_PREFERRED 1 /* <linux/mempolicy.h> */
#define MAX_NODES 1024

static const char *sysroot(void)
{
    const char *r = getenv("PINLOADER_SYSFS_ROOT");
    return r && *r ? r : "";
}

/* How many nodeN directories /sys/devices/system/node holds (0 when unreadable). */
static int count_nodes(void)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/sys/devices/system/node", sysroot());
    DIR *d = opendir(path);
    if (!d)
        return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        const char *s = e->d_name;
        if (strncmp(s, "node", 4) != 0 || !s[4])
            continue;
        int digits = 1;
        for (const char *c = s + 4; *c; c++)
            digits &= isdigit((unsigned char)*c) != 0;
        n += digits;
    }
    closedir(d);
    return n;
}

/* The bus id in sysfs spelling (lower-case hex), or -1 when it is not "DDDD:BB:DD.F"-like. */
static int normalize_bus_id(const char *in, char *out, size_t n)
{
    size_t len = strlen(in);
    if (len == 0 || len >= n || len > 32)
        return -1;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)in[i];
        if (!isxdigit(c) && c != ':' && c != '.')
            return -1;
        out[i] = (char)tolower(c);
    }
    out[len] = '\0';
    return strchr(out, ':') ? 0 : -1;
}

int pl_numa_node_of_pci(const char *bus_id)
{
    char id[40], path[4096], buf[32];
    if (!bus_id || normalize_bus_id(bus_id, id, sizeof id) < 0 || count_nodes() < 2)
        return -1;
    snprintf(path, sizeof path, "%s/sys/bus/pci/devices/%s/numa_node", sysroot(), id);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    size_t got = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[got] = '\0';
    char *end = NULL;
    errno = 0;
    long v = strtol(buf, &end, 10);
    if (end == buf || errno || (*end && *end != '\n') || v < 0 || v >= MAX_NODES)
        return -1;
    return (int)v;
}

int pl_numa_prefer(void *p, size_t n, int node)
{
#ifdef SYS_mbind
    if (node < 0 || node >= MAX_NODES) {
        errno = EINVAL;
        return -1;
    }
    enum { BITS = 8 * sizeof(unsigned long) };
    unsigned long mask[MAX_NODES / BITS];
    memset(mask, 0, sizeof mask);
    mask[node / BITS] |= 1UL << (node % BITS);
    /* maxnode counts one more than the bits the kernel reads (it decrements it first). */
    return syscall(SYS_mbind, p, n, PL_MPOL_PREFERRED, mask, (unsigned long)MAX_NODES + 1, 0UL) == 0 ? 0 : -1;
#else
    (void)p;
    (void)n;
    (void)node;
    errno = ENOSYS;
    return -1;
#endif
}
