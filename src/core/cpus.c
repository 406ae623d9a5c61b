/* The CPUs this process may use, and the default staging thread count derived from them.
 *
 * Note [staging threads]
 * Staging is a memory-bandwidth-bound copy, and host-to-pinned copy bandwidth keeps growing
 * with the thread count up to the core count on the hosts measured
 * (benchmarks/results/design_measurements.md); so the default is every CPU this process may
 * use, up to PL_STAGING_THREADS_MAX.
 *
 * "May use" is the smallest of:
 *   - the affinity mask (taskset, cpusets: sched_getaffinity);
 *   - the cgroup CPU quota, rounded up: cgroup v2 cpu.max ("max 100000" or "QUOTA PERIOD"),
 *     v1 cpu.cfs_quota_us / cpu.cfs_period_us; the smallest along the process's cgroup and
 *     its ancestors;
 * then divided among the local ranks sharing the host (LOCAL_WORLD_SIZE, set by torchrun),
 * because the ranks of one host share its cores and its memory bandwidth: two ranks staging
 * with every core each would only contend. At least 1.
 *
 * PINLOADER_CGROUP_ROOT (tests only) names a directory that stands in for "/" when reading
 * /proc/self/cgroup and /sys/fs/cgroup.
 *
 * No Python: src/py/cpu_budget.c is the Python face (default_staging_threads(), cpu_budget()). */
#include "cpus.h"
#include "util.h"

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- affinity ---- */

static int affinity_count(void)
{
    for (int ncpu = 1024; ncpu <= (1 << 16); ncpu *= 2) {
        cpu_set_t *set = CPU_ALLOC((size_t)ncpu);
        if (!set)
            return -1;
        size_t size = CPU_ALLOC_SIZE((size_t)ncpu);
        CPU_ZERO_S(size, set);
        if (sched_getaffinity(0, size, set) == 0) {
            int n = CPU_COUNT_S(size, set);
            CPU_FREE(set);
            return n;
        }
        CPU_FREE(set);
        if (errno != EINVAL)
            return -1;
    }
    return -1;
}

/* ---- cgroups ---- */

static const char *sysroot(void)
{
    const char *r = getenv("PINLOADER_CGROUP_ROOT");
    return r && *r ? r : "";
}

/* Read a small text file into buf; 0 on success. */
static int read_small(const char *path, char *buf, size_t n)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    size_t got = fread(buf, 1, n - 1, f);
    fclose(f);
    buf[got] = '\0';
    return got > 0 ? 0 : -1;
}

/* strtoll without errno surprises: -1 when out of range or absent (*end == s then). */
static long long parse_ll(const char *s, char **end)
{
    errno = 0;
    long long v = strtoll(s, end, 10);
    if (*end == s || errno)
        return -1;
    return v;
}

/* v2 cpu.max in dir: quota in CPUs, 0 for "max" or when absent/unparsable. */
static double quota_v2(const char *dir)
{
    char path[PATH_MAX + 32], buf[128];
    if (snprintf(path, sizeof(path), "%s/cpu.max", dir) >= (int)sizeof(path) ||
        read_small(path, buf, sizeof(buf)) < 0)
        return 0;
    if (strncmp(buf, "max", 3) == 0)
        return 0;
    char *end;
    long long quota = parse_ll(buf, &end), period = 100000;
    if (end != buf && (*end == ' ' || *end == '\t')) {
        char *p = end;
        period = parse_ll(p, &end);
        if (end == p)
            period = -1;
    }
    if (quota <= 0 || period <= 0)
        return 0;
    return (double)quota / (double)period;
}

static long long read_ll(const char *dir, const char *name)
{
    char path[PATH_MAX + 32], buf[64];
    char *end;
    if (snprintf(path, sizeof(path), "%s/%s", dir, name) >= (int)sizeof(path) ||
        read_small(path, buf, sizeof(buf)) < 0)
        return -1;
    return parse_ll(buf, &end);
}

/* v1 cpu.cfs_quota_us / cpu.cfs_period_us in dir; 0 when unlimited (-1) or absent. */
static double quota_v1(const char *dir)
{
    long long quota = read_ll(dir, "cpu.cfs_quota_us"), period = read_ll(dir, "cpu.cfs_period_us");
    if (quota <= 0 || period <= 0)
        return 0;
    return (double)quota / (double)period;
}

static double min_quota(double a, double b)
{
    if (a <= 0)
        return b;
    if (b <= 0)
        return a;
    return a < b ? a : b;
}

/* The smallest quota on mount/cg and its ancestors up to mount. Inside a cgroup namespace the
 * process's path may not exist under the mount (the mount root is its own cgroup): the walk
 * then simply finds the files higher up. */
static double walk_quota(const char *mount, const char *cg, double (*read)(const char *))
{
    char dir[PATH_MAX];
    if (snprintf(dir, sizeof(dir), "%s%s", mount, cg) >= (int)sizeof(dir))
        return 0;
    size_t root_len = strlen(mount);
    double q = 0;
    for (;;) {
        size_t len = strlen(dir);
        while (len > root_len && dir[len - 1] == '/')
            dir[--len] = '\0';
        q = min_quota(q, read(dir));
        char *slash = strrchr(dir, '/');
        if (len <= root_len || !slash || (size_t)(slash - dir) < root_len)
            break;
        *slash = '\0';
    }
    return q;
}

static int has_token(const char *list, const char *tok)
{
    size_t n = strlen(tok);
    for (const char *p = list; *p;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (len == n && strncmp(p, tok, n) == 0)
            return 1;
        if (!comma)
            break;
        p = comma + 1;
    }
    return 0;
}

static double cgroup_quota(void)
{
    const char *root = sysroot();
    char mount[PATH_MAX], path[PATH_MAX + 64], line[PATH_MAX + 64];
    if (snprintf(mount, sizeof(mount), "%s/sys/fs/cgroup", root) >= (int)sizeof(mount))
        return 0;
    snprintf(path, sizeof(path), "%s/cgroup.controllers", mount);
    int unified = access(path, F_OK) == 0;

    snprintf(path, sizeof(path), "%s/proc/self/cgroup", root);
    FILE *f = fopen(path, "r");
    double q = 0;
    int seen = 0;
    while (f && fgets(line, sizeof(line), f)) {
        line[strcspn(line, "\n")] = '\0';
        /* "hierarchy-id:controller-list:cgroup-path" */
        char *c1 = strchr(line, ':');
        char *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2 || c2[1] != '/')
            continue;
        *c1 = '\0';
        *c2 = '\0';
        const char *controllers = c1 + 1, *cg = c2 + 1;
        if (unified && strcmp(line, "0") == 0 && *controllers == '\0') {
            q = min_quota(q, walk_quota(mount, cg, quota_v2));
            seen = 1;
        } else if (!unified && has_token(controllers, "cpu")) {
            /* v1: the cpu controller is mounted under its controller list, or as "cpu" */
            const char *names[] = {controllers, "cpu,cpuacct", "cpuacct,cpu", "cpu"};
            for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
                char m[PATH_MAX + 64];
                if (snprintf(m, sizeof(m), "%s/%s", mount, names[i]) >= (int)sizeof(m) ||
                    access(m, F_OK) != 0)
                    continue;
                q = min_quota(q, walk_quota(m, cg, quota_v1));
                break;
            }
            seen = 1;
        }
    }
    if (f)
        fclose(f);
    if (!seen) { /* no membership file: the mount root is this process's cgroup */
        snprintf(path, sizeof(path), "%s/cpu", mount);
        q = unified ? quota_v2(mount) : quota_v1(path);
    }
    return q;
}

/* ---- the budget ---- */

void pl_cpu_budget_read(pl_cpu_budget *out)
{
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    out->online = online > 0 ? (int)PL_MIN(online, (long)INT_MAX) : 1;
    int aff = affinity_count();
    out->affinity = aff > 0 ? aff : out->online;
    out->quota = cgroup_quota();
    out->local_ranks = pl_local_world_size();

    int cpus = out->affinity;
    if (out->quota > 0 && out->quota < (double)cpus) {
        cpus = (int)out->quota; /* rounded up: 1.5 CPUs of quota run 2 threads part time */
        if ((double)cpus < out->quota - 1e-9 || cpus == 0)
            cpus++;
    }
    int threads = cpus / out->local_ranks;
    out->threads = PL_MAX(1, PL_MIN(threads, PL_STAGING_THREADS_MAX));
}

int pl_default_staging_threads(void)
{
    pl_cpu_budget b;
    pl_cpu_budget_read(&b);
    return b.threads;
}
