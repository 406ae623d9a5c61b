/* The pinned pool's private header: the pool and client structs and the functions the pool's
 * files share. pool.c holds the slabs, their extents, polling, reserve and release, stats, trim
 * and close, and the clients (Note [pool clients] in pool.h); pool_default.c the
 * default-pool registry and the shared cap (Note [default pool] there) and the atfork handler;
 * pool_debug.c the debug report, the canaries and the quarantine. The public header is
 * pool.h. */
#ifndef PL_POOL_IMPL_H
#define PL_POOL_IMPL_H

#include "pool.h"

#include <pthread.h>
#include <stdatomic.h>

/* Debug mode: bytes of canary after a region's requested bytes, when they fit. */
#define CANARY_BYTES 64u

struct pl_pool_client {
    pl_pool_client_stats st; /* guarded by the pool's mu */
    int closed;              /* guarded by the pool's mu: the owner let go */
    int64_t expect_ns;       /* guarded by the pool's mu: how long its waits for a copy take
                              * (Note [expected waits] in backend_cuda.c); 0: not known yet */
};

#define NUMA_UNKNOWN (-2)

struct pl_pool {
    atomic_long refcount;
    const pl_backend *b;
    int device;
    uint32_t gen;           /* the process generation it was made in: Note [pool after fork] in
                             * pool.c */
    pthread_mutex_t mu;
    pthread_cond_t cv;      /* broadcast when regions or slab bytes come back */
    size_t max_bytes;       /* guarded by mu */
    struct pl_slab *slabs;  /* guarded by mu (pl_slab is pool.c's own) */
    pl_region *pending;     /* guarded by mu; oldest first (Note [slab reuse] in pool.c) */
    pl_region **pending_tail; /* where the next release is appended (&pending when empty) */
    pl_event **events;      /* guarded by mu: free list of reusable events */
    size_t n_events, cap_events;
    size_t creating;        /* guarded by mu: slab bytes being made outside the lock */
    int numa_node;          /* guarded by mu: NUMA_UNKNOWN until the first slab asks the backend */
    int closed;             /* guarded by mu */
    pl_pool_stats st;       /* guarded by mu */
};

/* ---- pool_debug.c: debug mode (pl_debug_enabled()) ---- */

/* Fill the region's canary (the bytes past r->requested, at most CANARY_BYTES). */
void pl_pool_canary_fill(pl_region *r);
/* Report (pl_debug_report) a canary that was overwritten. */
void pl_pool_canary_check(pl_region *r);
/* Keep a dead region a while (REGION_DEAD in its magic) and free the oldest one kept, so that a
 * second release finds a dead region, not reused memory. */
void pl_pool_quarantine(pl_region *r);
/* Re-make debug mode's mutexes in a fork() child (pl_pool_atfork_child, pool_default.c). */
void pl_pool_debug_atfork_child(void);

#endif
