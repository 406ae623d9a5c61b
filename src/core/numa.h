/* The NUMA node of a GPU, and binding pinned slabs to it. No Python, no libnuma. */
#ifndef PL_NUMA_H
#define PL_NUMA_H

#include <stddef.h>

/* The node a PCI device (bus id as cudaDeviceGetPCIBusId writes it, e.g. "0000:3B:00.0") is
 * attached to, when the host has more than one NUMA node; -1 otherwise (one node, no sysfs, an
 * unknown device, a malformed id). See Note [slabs on the GPU's node] in numa.c. */
int pl_numa_node_of_pci(const char *bus_id);
/* Prefer node for the pages of [p, p + n) not yet faulted in (mbind, MPOL_PREFERRED). p is page
 * aligned. Returns 0, or -1 (errno set) when the kernel refused: the memory still works, on any
 * node. */
int pl_numa_prefer(void *p, size_t n, int node);

#endif
