/* PinnedPool: page-locked host slabs carved into regions, reused, bounded, event-gated.
 * No Python here: the prefetcher's producer thread uses this API without the GIL, and
 * pinned_pool.c wraps it for Python. */
#ifndef PL_POOL_H
#define PL_POOL_H

#include "backend.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

typedef struct pl_pool pl_pool;

/* Note [pool clients]
 * Several owners (prefetchers) can share one pool, each bounded within it: a client is opened
 * on the pool with its own cap, passed to pl_pool_reserve_for, and charged for every region it
 * reserves from the reserve until the region is finally back in its slab (after its event, for
 * pl_pool_release_after). A reserve that would take the client past its cap waits for the
 * client's own regions (unless it holds none: a single request no larger than the cap always
 * proceeds), and the waits of a reserve are counted in the client's stats as well as the pool's,
 * so an owner's stall counters count only its own waits. The pool owns the client's memory:
 * pl_pool_client_close detaches it and the pool frees it once its last region is back, so
 * pending releases never touch freed memory. All fields are guarded by the pool's mutex. */
typedef struct pl_pool_client pl_pool_client;

typedef struct {
    size_t cap;        /* bytes the client may hold in regions (in use or pending) */
    size_t in_use;     /* bytes it holds now */
    size_t peak_in_use;
    uint64_t waits;    /* its reserves that had to wait */
    int64_t wait_ns;
} pl_pool_client_stats;

typedef struct pl_region {
    void *ptr;          /* PL_ALIGN-aligned start */
    size_t size;        /* bytes reserved (the request rounded up, see Note [region sizes]) */
    size_t requested;   /* bytes asked for */
    /* private */
    struct pl_slab *slab;
    struct pl_region *next; /* pending list link */
    pl_event *event;        /* the event gating reuse while pending */
    uint32_t magic;
    struct pl_pool_client *client; /* charged for it until it is back (Note [pool clients]) */
    pl_stream *stream;      /* while pending: the stream its event was recorded on */
} pl_region;

typedef struct {
    size_t reserved_bytes;  /* bytes held in slabs (page-locked) */
    size_t in_use_bytes;    /* bytes in regions handed out or pending release */
    size_t peak_in_use_bytes;
    size_t peak_reserved_bytes;
    size_t max_bytes;       /* the cap */
    size_t slabs;
    size_t regions;         /* regions handed out or pending */
    size_t pending;         /* regions waiting for their event */
    uint64_t allocs_cached; /* served from existing slabs */
    uint64_t allocs_new;    /* needed a new slab */
    uint64_t slabs_created;
    uint64_t slabs_freed;
    uint64_t waits;         /* reserves that had to wait for a region to come back */
    int64_t wait_ns;
    size_t waiting;         /* reserves waiting now (counted in waits when they end) */
    int numa_node;          /* the node new slabs are placed on (Note [slabs on the GPU's node]
                             * in numa.c), -1 when not bound */
} pl_pool_stats;

/* max_bytes 0 means the default cap, pl_pool_default_cap(). */
int pl_pool_create(const pl_backend *b, int device, size_t max_bytes, pl_pool **out);
void pl_pool_incref(pl_pool *p);
void pl_pool_decref(pl_pool *p); /* the last reference syncs pending releases and frees all */
size_t pl_pool_default_cap(void);
size_t pl_pool_cap(const pl_pool *p);
const pl_backend *pl_pool_backend(const pl_pool *p);
/* 1 in a fork() child for a pool made before the fork: see Note [pool after fork] in pool.c. */
int pl_pool_inherited(const pl_pool *p);
/* The atfork child handler of the pool's process-wide state (pool_debug.c, pool_default.c;
 * module.c installs it). */
void pl_pool_atfork_child(void);

/* Reserve a region of n bytes. Waits while the cap is reached, for at most timeout_ns
 * (negative: no limit) or until *stop becomes non-zero (stop may be NULL).
 * Returns PL_OK, PL_ERR_TIMEOUT, PL_ERR_STOPPED, PL_ERR_OVER_CAP when n can never fit under
 * the cap, PL_ERR_NO_MEMORY when the OS refused memory, PL_ERR_INVALID_VALUE after close,
 * PL_ERR_FORKED for a pool inherited through fork(), or a backend error. Any n, up to SIZE_MAX,
 * is safe: sizes are computed as Note [checked sizes] in util.h says. */
int pl_pool_reserve(pl_pool *p, size_t n, int64_t timeout_ns, const atomic_int *stop,
                    pl_region **out);
/* The same, charged to client c (NULL: no client, as pl_pool_reserve). Also PL_ERR_OVER_CAP
 * when n can never fit under the client's cap. See Note [pool clients]. */
int pl_pool_reserve_for(pl_pool *p, pl_pool_client *c, size_t n, int64_t timeout_ns,
                        const atomic_int *stop, pl_region **out);

/* Open a client with a cap of cap bytes (0: only the pool's cap binds). PL_OK,
 * PL_ERR_NO_MEMORY or PL_ERR_FORKED. */
int pl_pool_client_open(pl_pool *p, size_t cap, pl_pool_client **out);
/* Set the client's cap (0: only the pool's cap binds); wakes its waiting reserves. */
void pl_pool_client_set_cap(pl_pool *p, pl_pool_client *c, size_t cap);
/* Raise the client's cap to cap (never lowers it): the prefetcher's growing default bound. */
void pl_pool_client_raise_cap(pl_pool *p, pl_pool_client *c, size_t cap);
/* The client's stats, after taking back the regions whose releases are done (a poll: event
 * queries). */
void pl_pool_client_get_stats(pl_pool *p, pl_pool_client *c, pl_pool_client_stats *st);
/* Its wait counters as they stand, without a poll: what a reserve's own wait is measured with,
 * once per batch (transfer.c). */
void pl_pool_client_waits(pl_pool *p, pl_pool_client *c, uint64_t *waits, int64_t *wait_ns);
/* The owner lets go: no reserve for c may follow or be in progress. The pool frees c once its
 * last region is back. */
void pl_pool_client_close(pl_pool *p, pl_pool_client *c);

/* Note [default pool] is in pool_default.c. The process-wide pool of (backend, device), made on
 * first use with pl_pool_shared_cap(); returns a new reference (PL_OK), or PL_ERR_INVALID_DEVICE
 * / PL_ERR_NO_MEMORY. In a fork() child the parent's default pool is replaced by a fresh one. */
int pl_pool_default(const pl_backend *b, int device, pl_pool **out);
/* The default pools' cap: pl_pool_default_cap() divided among the local ranks (the
 * LOCAL_WORLD_SIZE environment variable torchrun sets; 1 when absent or invalid). */
size_t pl_pool_shared_cap(void);
/* Trim every default pool (interpreter exit); returns bytes freed. */
size_t pl_pool_trim_defaults(void);

/* Give the region back now. */
void pl_pool_release(pl_pool *p, pl_region *r);
/* Give the region back once all work queued so far on stream s has completed (an event is
 * recorded on s). If recording fails the region is released after synchronizing s. */
int pl_pool_release_after(pl_pool *p, pl_region *r, pl_stream *s);
/* Find completed pending releases now (they are also found by reserve and stats). */
void pl_pool_poll(pl_pool *p);
void pl_pool_get_stats(pl_pool *p, pl_pool_stats *st);
/* Free slabs with no live region back to the OS; returns bytes freed. */
size_t pl_pool_trim(pl_pool *p);
/* Wait for pending releases, free what is free, refuse new reserves. Idempotent. */
void pl_pool_close(pl_pool *p);
int pl_pool_closed(pl_pool *p);

/* Debug mode: the first invariant violation seen (NULL if none). */
const char *pl_debug_first_violation(void);
void pl_debug_report(const char *fmt, ...);

#endif
