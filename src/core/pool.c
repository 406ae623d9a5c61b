/* The pinned slab pool: slabs and their extents, polling of pending releases, reserve and
 * release, stats, trim and close, and the clients that a reserve charges and a release
 * uncharges (Note [pool clients] in pool.h). The default pools are in pool_default.c, debug
 * mode (report, canaries, quarantine) in pool_debug.c; the structs they share in
 * pool_impl.h.
 *
 * Note [region sizes]
 * A request of n bytes is rounded up to a multiple of max(256, 2^floor(log2 n) / 8): regions
 * stay 256-byte aligned, waste is at most 1/8 of the request (not the up-to-1/2 of
 * power-of-two buckets), and a steady stream of same-sized batches asks for identical sizes, so
 * best-fit hands back the very extents the previous batches used: no new slab after the first
 * few batches.
 *
 * Note [slab reuse]
 * A region released "after stream s" gets an event recorded on s and joins the pending list,
 * which is kept in release order, oldest first. Pending regions are polled out of order (not
 * only the oldest), so one slow copy never holds back the others; but a stream completes its
 * work in order, so once one region's event on stream s is found not ready, the later regions
 * on s are not asked (an event per pending region queried on every reserve cost a producer that
 * runs ahead of its copies tens of microseconds per batch). A region found out of order (two
 * pollers interleaving) is only freed later, never early. A
 * reservation that must wait for one sleeps on the oldest's event: on one copy stream that is
 * the copy that finishes first, so the waiter wakes while the later copies still run and issues
 * its batch behind them (waiting on the newest, it would find the GPU idle). A region returns to
 * its slab's free extents only once its event has completed: pinned memory is never
 * overwritten while a copy still reads it.
 *
 * Note [pool locking]
 * One mutex, `mu`, guards every mutable field of the pool, its slabs and their extents. It is
 * held only for list and counter updates: no backend (CUDA) call and no OS allocation happens
 * under it. Slab creation reserves its bytes under mu (so the cap holds while the slab is being
 * made), then allocates and registers outside, then inserts under mu. Polling detaches the
 * pending list under mu, queries the events outside, and re-attaches what is not ready.
 *
 * Note [pool after fork]
 * A pool records the process generation it was made in (Note [fork generations] in util.h). In
 * a fork() child an inherited pool is dead: reserve and release_after fail with PL_ERR_FORKED,
 * poll, trim, close and release do nothing, stats read zero, and the last reference frees only
 * the pool struct. None of them takes mu (a parent thread may have held it at fork time) or
 * calls the backend (the slabs and events belong to the parent's runtime; CUDA marks pinned
 * memory not to be inherited). Its slabs are leaked in the child. A pool made in the child is
 * an ordinary pool. The pool's process-wide state (the debug report and quarantine mutexes of
 * pool_debug.c, and defaults_mu of the default pools in pool_default.c) is re-made by
 * pl_pool_atfork_child (pool_default.c); the inherited default pools themselves are replaced
 * on first use (pl_pool_default). */
#include "pool_impl.h"
#include "util.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define REGION_MAGIC 0x9e6b1a11u
#define REGION_DEAD 0xdeadbeefu
#define DEFAULT_SLAB_BYTES ((size_t)64 << 20)
/* A waiting reservation polls the pending releases (and its stop flag) this often. */
#define POLL_SLICE_NS ((int64_t)1000000)
/* Note [expected waits]: the shortest expectation a client's waits are told (a polling backend's
 * naps grow to 0.2 ms: a shorter wait takes a few wake-ups anyway) */
#define EXPECT_MIN_NS ((int64_t)250000)

typedef struct extent {
    struct extent *next;
    size_t off, size;
} extent;

typedef struct pl_slab {
    struct pl_slab *next;
    char *base;
    size_t size;
    extent *free; /* address-ordered, coalesced; guarded by the pool's mu */
    size_t live;  /* regions carved from it and not yet back; guarded by mu */
} pl_slab;

/* ---- sizes (see Note [checked sizes] in util.h) ---- */

/* The size class of a request (Note [region sizes]); 0 when rounding would overflow. */
static size_t round_request(size_t n)
{
    if (n <= PL_ALIGN)
        return PL_ALIGN;
    size_t top = (size_t)1 << (63 - __builtin_clzll((unsigned long long)n));
    size_t g = PL_MAX((size_t)PL_ALIGN, top / 8);
    size_t r;
    if (__builtin_add_overflow(n, g - 1, &r))
        return 0;
    return r / g * g;
}

size_t pl_pool_default_cap(void)
{
    /* A quarter of physical memory, and no more than half of RLIMIT_MEMLOCK where that binds
     * (root and CUDA's own pinning are not limited by it, but an ordinary user's
     * cudaHostRegister is). */
    size_t cap = pl_physical_memory() / 4;
    size_t lim = pl_memlock_limit();
    if (lim != SIZE_MAX && lim / 2 < cap && lim >= ((size_t)64 << 20))
        cap = lim / 2;
    return cap;
}

/* ---- lifecycle ---- */

int pl_pool_create(const pl_backend *b, int device, size_t max_bytes, pl_pool **out)
{
    pl_pool *p = calloc(1, sizeof(*p));
    if (!p)
        return PL_ERR_NO_MEMORY;
    if (pthread_mutex_init(&p->mu, NULL) != 0 || pl_cond_init(&p->cv) != 0) {
        free(p);
        return PL_ERR_NO_MEMORY;
    }
    atomic_init(&p->refcount, 1);
    p->b = b;
    p->device = device;
    p->pending_tail = &p->pending;
    p->gen = pl_generation();
    p->max_bytes = max_bytes ? max_bytes : pl_pool_default_cap();
    p->st.max_bytes = p->max_bytes;
    p->numa_node = NUMA_UNKNOWN;
    p->st.numa_node = -1;
    *out = p;
    return PL_OK;
}

void pl_pool_incref(pl_pool *p)
{
    atomic_fetch_add(&p->refcount, 1);
}

size_t pl_pool_cap(const pl_pool *p)
{
    return p->max_bytes;
}

const pl_backend *pl_pool_backend(const pl_pool *p)
{
    return p->b;
}

int pl_pool_inherited(const pl_pool *p)
{
    return pl_inherited(p->gen);
}

static void free_extents(extent *e)
{
    while (e) {
        extent *n = e->next;
        free(e);
        e = n;
    }
}

static void free_slab(const pl_backend *b, pl_slab *s)
{
    b->host_free(s->base, s->size);
    free_extents(s->free);
    free(s);
}

static int slab_is_free(const pl_slab *s)
{
    return s->live == 0;
}

/* Detach (under mu) every slab with no live region; the caller frees them outside the lock. */
static pl_slab *detach_free_slabs(pl_pool *p)
{
    pl_slab *out = NULL, **link = &p->slabs;
    while (*link) {
        pl_slab *s = *link;
        if (slab_is_free(s)) {
            *link = s->next;
            s->next = out;
            out = s;
            p->st.reserved_bytes -= s->size;
            p->st.slabs--;
            p->st.slabs_freed++;
        } else {
            link = &s->next;
        }
    }
    return out;
}

static size_t free_slab_list(const pl_backend *b, pl_slab *s)
{
    size_t n = 0;
    while (s) {
        pl_slab *next = s->next;
        n += s->size;
        free_slab(b, s);
        s = next;
    }
    return n;
}

/* ---- extents (under mu) ---- */

/* Best fit. Extents start on PL_ALIGN boundaries, and splits keep them there: a request whose
 * size is not a multiple of PL_ALIGN (only a request clipped to the cap, see
 * pl_pool_reserve) takes a whole extent when the aligned split does not fit. */
static int carve(pl_pool *p, size_t size, pl_slab **slab_out, size_t *off_out, size_t *taken)
{
    extent **best = NULL;
    pl_slab *best_slab = NULL;
    for (pl_slab *s = p->slabs; s; s = s->next)
        for (extent **e = &s->free; *e; e = &(*e)->next)
            if ((*e)->size >= size && (!best || (*e)->size < (*best)->size)) {
                best = e;
                best_slab = s;
            }
    if (!best)
        return 0;
    extent *e = *best;
    size_t take = PL_ALIGN_UP(size, PL_ALIGN);
    if (take >= e->size)
        take = e->size;
    *off_out = e->off;
    *slab_out = best_slab;
    *taken = take;
    if (e->size == take) {
        *best = e->next;
        free(e);
    } else {
        e->off += take;
        e->size -= take;
    }
    best_slab->live++;
    return 1;
}

/* Returns 0 on success, -1 if the extent node could not be allocated (the bytes are then lost
 * to this slab until it is freed whole, which trim still does). */
static int give_back(pl_slab *s, size_t off, size_t size)
{
    s->live--;
    extent **link = &s->free;
    while (*link && (*link)->off < off)
        link = &(*link)->next;
    extent *next = *link;
    extent *prev = link == &s->free ? NULL : (extent *)((char *)link - offsetof(extent, next));
    if (prev && prev->off + prev->size == off) {
        prev->size += size;
        if (next && prev->off + prev->size == next->off) {
            prev->size += next->size;
            prev->next = next->next;
            free(next);
        }
        return 0;
    }
    if (next && off + size == next->off) {
        next->off = off;
        next->size += size;
        return 0;
    }
    extent *e = malloc(sizeof(*e));
    if (!e)
        return -1;
    *e = (extent){next, off, size};
    *link = e;
    return 0;
}


/* Return a region to its slab (under mu). */
static void region_free_locked(pl_pool *p, pl_region *r)
{
    if (pl_debug_enabled())
        pl_pool_canary_check(r);
    give_back(r->slab, (size_t)((char *)r->ptr - r->slab->base), r->size);
    p->st.in_use_bytes -= r->size;
    p->st.regions--;
    pl_pool_client *c = r->client;
    if (c) {
        c->st.in_use -= r->size;
        if (c->closed && c->st.in_use == 0)
            free(c); /* see Note [pool clients] */
    }
    r->magic = REGION_DEAD;
    if (pl_debug_enabled()) {
        pl_pool_quarantine(r);
        return;
    }
    free(r);
}

/* ---- pending releases ---- */

void pl_pool_poll(pl_pool *p)
{
    if (pl_inherited(p->gen))
        return;
    pthread_mutex_lock(&p->mu);
    pl_region *list = p->pending;
    p->pending = NULL;
    p->pending_tail = &p->pending;
    pthread_mutex_unlock(&p->mu);
    if (!list)
        return;

    pl_region *ready = NULL, *waiting = NULL, **wtail = &waiting;
    enum { MAX_BLOCKED = 8 };
    pl_stream *blocked[MAX_BLOCKED]; /* streams with a release found not ready (Note [slab reuse]) */
    int n_blocked = 0;
    while (list) {
        pl_region *r = list;
        list = r->next;
        int rc = PL_ERR_NOT_READY, skip = 0;
        for (int i = 0; i < n_blocked && !skip; i++)
            skip = blocked[i] == r->stream;
        if (!skip) {
            rc = p->b->event_query(r->event);
            /* A query that failed proves nothing about the copy (an error need not be sticky):
             * wait for the release; only if that fails too is the runtime taken as dead. */
            if (rc != PL_OK && rc != PL_ERR_NOT_READY)
                rc = p->b->event_synchronize(r->event);
            if (rc == PL_ERR_NOT_READY && n_blocked < MAX_BLOCKED)
                blocked[n_blocked++] = r->stream;
        }
        if (rc == PL_ERR_NOT_READY) {
            r->next = NULL;
            *wtail = r;
            wtail = &r->next;
        } else {
            /* Complete, or the runtime failed: an error here (a dead context) means no copy
             * can still be reading the region. */
            r->next = ready;
            ready = r;
        }
    }

    pthread_mutex_lock(&p->mu);
    if (waiting) {
        /* the older ones first, then anything released meanwhile */
        *wtail = p->pending;
        if (!p->pending)
            p->pending_tail = wtail;
        p->pending = waiting;
    }
    int freed = 0;
    while (ready) {
        pl_region *r = ready;
        ready = r->next;
        /* Room is guaranteed: see Note [event free list]. */
        p->events[p->n_events++] = r->event;
        p->st.pending--;
        region_free_locked(p, r);
        freed = 1;
    }
    if (freed)
        pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static int take_event(pl_pool *p, pl_event **out)
{
    pthread_mutex_lock(&p->mu);
    pl_event *e = p->n_events ? p->events[--p->n_events] : NULL;
    pthread_mutex_unlock(&p->mu);
    if (e) {
        *out = e;
        return PL_OK;
    }
    int rc = p->b->event_create(&e);
    if (rc == PL_OK)
        *out = e;
    return rc;
}

/* ---- reserve ---- */

static int check_region(pl_region *r, const char *what)
{
    if (r->magic == REGION_MAGIC)
        return 0;
    if (pl_debug_enabled())
        pl_debug_report("%s of pinned region %p that is not live (double release?)", what, (void *)r);
    return -1;
}

/* The bytes to carve for a request of n (under mu), or 0 when it can never fit under the cap.
 * A request that fits under the cap is never refused because of its rounding or of the debug
 * canary: both are dropped when they would not fit. */
static size_t request_size_locked(const pl_pool *p, const pl_pool_client *c, size_t n)
{
    size_t limit = c ? PL_MIN(p->max_bytes, c->st.cap) : p->max_bytes;
    size_t want = n;
    if (pl_debug_enabled() && limit >= CANARY_BYTES && n <= limit - CANARY_BYTES)
        want = n + CANARY_BYTES;
    size_t size = round_request(want ? want : 1);
    if ((size == 0 || size > limit) && want <= limit)
        size = PL_MAX(want, (size_t)1);
    return size <= limit ? size : 0;
}

/* One reserve in progress. */
typedef struct {
    pl_pool_client *client; /* charged for the region; may be NULL */
    size_t n, size;       /* bytes asked for; bytes to carve */
    int64_t timeout_ns;   /* negative: no limit */
    int64_t start;        /* when the reserve began */
    int64_t wait_start;   /* when it first had to wait; 0 while it has not */
    int on_copy;          /* it waited for a pending release's copy (not only for room) */
    int learn;            /* its first wait for a copy polled untold: the client learns from it */
    int made_slab;
} reserve_state;

/* The internal "try again" answer of the steps below (no backend uses it). */
#define AGAIN (-1000)

/* The only read of the caller's stop flag. */
static int stop_requested(const atomic_int *stop)
{
    return stop && atomic_load_explicit(stop, memory_order_acquire);
}

/* Count the wait (if there was one) and drop mu; returns rc. */
static int finish_locked(pl_pool *p, reserve_state *rs, int rc)
{
    if (rs->wait_start) {
        int64_t waited = pl_now_ns() - rs->wait_start;
        p->st.waiting--;
        p->st.waits++;
        p->st.wait_ns += waited;
        if (rs->client) {
            pl_pool_client *c = rs->client;
            c->st.waits++;
            c->st.wait_ns += waited;
            /* Note [expected waits]: learnt from untold waits only (a told wait lasts at least
             * the sleep it was told to take, so an average of those climbs to the bound, at 8x
             * the poller's oversleep, whatever the copies take); a shorter wait is taken as it
             * is (oversleeping is what costs), a longer one moves it a quarter of the way;
             * bounded by one polling slice. */
            if (rc == PL_OK && rs->learn) {
                int64_t w = PL_MIN(waited, POLL_SLICE_NS);
                c->expect_ns = c->expect_ns && w > c->expect_ns ? c->expect_ns + (w - c->expect_ns) / 4 : w;
            }
        }
        rs->wait_start = 0;
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* Carve the region from an existing slab (under mu); 1 if done. */
static int take_from_slabs_locked(pl_pool *p, reserve_state *rs, pl_region *r)
{
    pl_slab *slab;
    size_t off, taken;
    if (!carve(p, rs->size, &slab, &off, &taken))
        return 0;
    *r = (pl_region){slab->base + off, taken, rs->n, slab, NULL, NULL, REGION_MAGIC, rs->client, NULL};
    if (rs->client) {
        pl_pool_client_stats *cs = &rs->client->st;
        cs->in_use += taken;
        cs->peak_in_use = PL_MAX(cs->peak_in_use, cs->in_use);
    }
    p->st.in_use_bytes += taken;
    p->st.peak_in_use_bytes = PL_MAX(p->st.peak_in_use_bytes, p->st.in_use_bytes);
    p->st.regions++;
    if (!rs->made_slab)
        p->st.allocs_cached++;
    return 1;
}

/* Bytes a new slab may still take under the cap (under mu). */
static size_t room_locked(const pl_pool *p)
{
    size_t committed = pl_sat_add(p->st.reserved_bytes, p->creating);
    return committed < p->max_bytes ? p->max_bytes - committed : 0;
}

/* The size of a new slab for a request of `size` with `room` left under the cap: the first
 * batch sizes it, at least DEFAULT_SLAB_BYTES, PL_ALIGN-rounded where that still fits. */
static size_t slab_size_for(size_t size, size_t room)
{
    size_t s = PL_MIN(PL_MAX(size, DEFAULT_SLAB_BYTES), room), up;
    if (pl_align_up_checked(s, PL_ALIGN, &up) == 0 && up <= room)
        s = up;
    return s;
}

/* Make a slab of slab_size outside the lock and add it (entered with mu held, returns with it
 * released). The bytes count against the cap while they are being made (p->creating). */
static int grow_unlocks(pl_pool *p, reserve_state *rs, size_t slab_size)
{
    p->creating += slab_size;
    int node = p->numa_node;
    pthread_mutex_unlock(&p->mu);

    pl_slab *s = calloc(1, sizeof(*s));
    extent *e = malloc(sizeof(*e));
    void *base = NULL;
    int rc = (s && e) ? PL_OK : PL_ERR_NO_MEMORY;
    if (rc == PL_OK && node == NUMA_UNKNOWN)
        node = p->b->numa_node(p->device); /* a backend call: not under mu */
    if (rc == PL_OK)
        rc = p->b->host_alloc(slab_size, node, &base);

    pthread_mutex_lock(&p->mu);
    if (node != NUMA_UNKNOWN)
        p->numa_node = p->st.numa_node = node;
    p->creating -= slab_size;
    pthread_cond_broadcast(&p->cv);
    if (rc != PL_OK) {
        free(s);
        free(e);
        return finish_locked(p, rs, rc);
    }
    *e = (extent){NULL, 0, slab_size};
    *s = (pl_slab){p->slabs, base, slab_size, e, 0};
    p->slabs = s;
    p->st.reserved_bytes += slab_size;
    p->st.peak_reserved_bytes = PL_MAX(p->st.peak_reserved_bytes, p->st.reserved_bytes);
    p->st.slabs++;
    p->st.slabs_created++;
    p->st.allocs_new++;
    rs->made_slab = 1;
    pthread_mutex_unlock(&p->mu);
    return AGAIN;
}

/* Wait one slice for regions to come back (entered with mu held, returns with it released):
 * AGAIN, or PL_ERR_TIMEOUT / PL_ERR_STOPPED. */
static int wait_unlocks(pl_pool *p, reserve_state *rs, const atomic_int *stop)
{
    int64_t now = pl_now_ns();
    if (!rs->wait_start) {
        rs->wait_start = now;
        p->st.waiting++;
    }
    int64_t slice = POLL_SLICE_NS;
    if (rs->timeout_ns >= 0) {
        int64_t left = rs->timeout_ns - (now - rs->start);
        if (left <= 0)
            return finish_locked(p, rs, PL_ERR_TIMEOUT);
        slice = PL_MIN(slice, left);
    }
    if (stop_requested(stop))
        return finish_locked(p, rs, PL_ERR_STOPPED);
    pl_event *oldest = p->pending ? p->pending->event : NULL; /* Note [slab reuse] */
    if (oldest) {
        /* The first slice of a client's wait sleeps through most of the time its waits
         * usually take (Note [expected waits] in backend_cuda.c). */
        int64_t expect = 0;
        if (!rs->on_copy && rs->client) {
            /* every fourth wait polls untold, to learn from; waits shorter than EXPECT_MIN_NS
             * are not told at all (the first sleep's overshoot would exceed what it saves) */
            pl_pool_client *c = rs->client;
            rs->learn = c->expect_ns < EXPECT_MIN_NS || (c->st.waits & 3) == 0;
            expect = rs->learn ? 0 : c->expect_ns;
        }
        rs->on_copy = 1;
        pthread_mutex_unlock(&p->mu);
        /* Events are never destroyed before the pool, so a racing poller recycling this one
         * only shortens or lengthens this bounded wait. */
        p->b->event_wait(oldest, slice, expect);
    } else {
        struct timespec ts;
        pl_deadline(&ts, slice);
        pthread_cond_timedwait(&p->cv, &p->mu, &ts);
        pthread_mutex_unlock(&p->mu);
    }
    return AGAIN;
}

/* One attempt (entered with mu held, returns with it released): PL_OK with *r filled, AGAIN,
 * or an error. */
static int reserve_once(pl_pool *p, reserve_state *rs, pl_region *r, const atomic_int *stop)
{
    if (p->closed)
        return finish_locked(p, rs, PL_ERR_INVALID_VALUE);
    pl_pool_client *c = rs->client;
    if (c && rs->size > c->st.cap)
        return finish_locked(p, rs, PL_ERR_OVER_CAP);
    if (c && c->st.in_use > 0 && rs->size > c->st.cap - PL_MIN(c->st.cap, c->st.in_use))
        return wait_unlocks(p, rs, stop); /* over the client's own cap: wait for its regions */
    if (take_from_slabs_locked(p, rs, r))
        return finish_locked(p, rs, PL_OK);
    if (rs->size > p->max_bytes)
        return finish_locked(p, rs, PL_ERR_OVER_CAP);
    size_t room = room_locked(p);
    if (rs->size <= room) /* a client's slabs are no larger than its cap: it bounds pinning too */
        return grow_unlocks(p, rs, slab_size_for(rs->size, c ? PL_MIN(room, c->st.cap) : room));
    /* Fragmented but idle slabs: give them back so one big enough can be made. */
    pl_slab *idle = detach_free_slabs(p);
    if (idle) {
        pthread_mutex_unlock(&p->mu);
        free_slab_list(p->b, idle);
        return AGAIN;
    }
    return wait_unlocks(p, rs, stop);
}

int pl_pool_reserve(pl_pool *p, size_t n, int64_t timeout_ns, const atomic_int *stop,
                    pl_region **out)
{
    return pl_pool_reserve_for(p, NULL, n, timeout_ns, stop, out);
}

int pl_pool_reserve_for(pl_pool *p, pl_pool_client *c, size_t n, int64_t timeout_ns,
                        const atomic_int *stop, pl_region **out)
{
    if (pl_inherited(p->gen))
        return PL_ERR_FORKED;
    pthread_mutex_lock(&p->mu);
    size_t size = request_size_locked(p, c, n);
    pthread_mutex_unlock(&p->mu);
    if (size == 0)
        return PL_ERR_OVER_CAP;
    pl_region *r = malloc(sizeof(*r));
    if (!r)
        return PL_ERR_NO_MEMORY;
    reserve_state rs = {.client = c, .n = n, .size = size, .timeout_ns = timeout_ns, .start = pl_now_ns()};
    int rc;
    do {
        pl_pool_poll(p);
        pthread_mutex_lock(&p->mu);
        rc = reserve_once(p, &rs, r, stop);
    } while (rc == AGAIN);
    if (rc != PL_OK) {
        free(r);
        return rc;
    }
    if (pl_debug_enabled())
        pl_pool_canary_fill(r);
    *out = r;
    return PL_OK;
}

/* ---- release ---- */

static void maybe_free_closed(pl_pool *p)
{
    /* After close, slabs go back to the OS as soon as they empty. */
    pthread_mutex_lock(&p->mu);
    pl_slab *idle = p->closed ? detach_free_slabs(p) : NULL;
    pthread_mutex_unlock(&p->mu);
    if (idle) { /* the last buffer of a closed pool may die in a capture: Note [releases during a
                 * capture] in backend.h */
        const int mode = pl_captures_relax(p->b);
        free_slab_list(p->b, idle);
        pl_captures_restore(p->b, mode);
    }
}

void pl_pool_release(pl_pool *p, pl_region *r)
{
    if (pl_inherited(p->gen))
        return; /* see Note [pool after fork] */
    if (!r || check_region(r, "release") != 0)
        return;
    pthread_mutex_lock(&p->mu);
    region_free_locked(p, r);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    maybe_free_closed(p);
}

/* Note [event free list]
 * Every event the pool owns is either on the free list (events[0..n_events)) or attached to a
 * pending region, and the list's capacity always covers both: pending + n_events <= cap_events.
 * release_after grows the list before it adds a pending region, and falls back to a synchronous
 * release when growing fails; so polling always has room to recycle an event, and never
 * destroys (or leaks) one. */
int pl_pool_release_after(pl_pool *p, pl_region *r, pl_stream *s)
{
    if (pl_inherited(p->gen))
        return PL_ERR_FORKED;
    if (!r || check_region(r, "release_after") != 0)
        return PL_ERR_INVALID_VALUE;
    pl_event *e = NULL;
    int rc = take_event(p, &e);
    if (rc == PL_OK)
        rc = p->b->event_record(e, s);
    if (rc == PL_OK) {
        pthread_mutex_lock(&p->mu);
        size_t need = p->st.pending + p->n_events + 1;
        if (p->cap_events < need) {
            size_t cap = PL_MAX(pl_sat_mul(p->cap_events, 2), (size_t)16);
            pl_event **ev = cap < SIZE_MAX / sizeof(*ev) ? realloc(p->events, cap * sizeof(*ev)) : NULL;
            if (ev) {
                p->events = ev;
                p->cap_events = cap;
            }
        }
        if (p->cap_events >= need) {
            r->event = e;
            r->stream = s;
            r->next = NULL;
            *p->pending_tail = r;
            p->pending_tail = &r->next;
            p->st.pending++;
            pthread_mutex_unlock(&p->mu);
            return PL_OK;
        }
        pthread_mutex_unlock(&p->mu);
        rc = PL_ERR_NO_MEMORY;
    }
    /* No event, or no room to keep it: wait for the stream, then release now (a wait that
     * fails means a dead runtime, as in pl_pool_poll: nothing reads the region any more). */
    if (e)
        p->b->event_destroy(e);
    p->b->stream_synchronize(s);
    pl_pool_release(p, r);
    return rc;
}

/* ---- stats, trim, close ---- */

void pl_pool_get_stats(pl_pool *p, pl_pool_stats *st)
{
    if (pl_inherited(p->gen)) {
        memset(st, 0, sizeof(*st));
        st->numa_node = -1;
        return;
    }
    pl_pool_poll(p);
    pthread_mutex_lock(&p->mu);
    *st = p->st;
    pthread_mutex_unlock(&p->mu);
}

size_t pl_pool_trim(pl_pool *p)
{
    if (pl_inherited(p->gen))
        return 0;
    pl_pool_poll(p);
    pthread_mutex_lock(&p->mu);
    pl_slab *idle = detach_free_slabs(p);
    pthread_mutex_unlock(&p->mu);
    return free_slab_list(p->b, idle);
}

/* Wait for every pending release (their copies are bounded: they finish). */
static void drain_pending(pl_pool *p)
{
    for (;;) {
        pthread_mutex_lock(&p->mu);
        pl_event *e = p->pending ? p->pending->event : NULL;
        pthread_mutex_unlock(&p->mu);
        if (!e)
            return;
        p->b->event_wait(e, POLL_SLICE_NS * 10, 0);
        pl_pool_poll(p);
    }
}

void pl_pool_close(pl_pool *p)
{
    if (pl_inherited(p->gen))
        return;
    const int mode = pl_captures_relax(p->b); /* Note [releases during a capture] in backend.h */
    drain_pending(p);
    pthread_mutex_lock(&p->mu);
    p->closed = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    maybe_free_closed(p);
    pl_captures_restore(p->b, mode);
}

int pl_pool_closed(pl_pool *p)
{
    if (pl_inherited(p->gen))
        return 1;
    pthread_mutex_lock(&p->mu);
    int c = p->closed;
    pthread_mutex_unlock(&p->mu);
    return c;
}

void pl_pool_decref(pl_pool *p)
{
    if (!p || atomic_fetch_sub(&p->refcount, 1) != 1)
        return;
    if (pl_inherited(p->gen)) {
        /* Slabs and events belong to the parent (Note [pool after fork]): leak them. */
        free(p->events);
        free(p);
        return;
    }
    const int mode = pl_captures_relax(p->b); /* Note [releases during a capture] in backend.h */
    pl_pool_close(p);
    pthread_mutex_lock(&p->mu);
    pl_slab *all = p->slabs;
    p->slabs = NULL;
    pthread_mutex_unlock(&p->mu);
    free_slab_list(p->b, all);
    for (size_t i = 0; i < p->n_events; i++)
        p->b->event_destroy(p->events[i]);
    pl_captures_restore(p->b, mode);
    free(p->events);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}

/* ---- clients (Note [pool clients] in pool.h) ---- */

int pl_pool_client_open(pl_pool *p, size_t cap, pl_pool_client **out)
{
    if (pl_inherited(p->gen))
        return PL_ERR_FORKED;
    pl_pool_client *c = calloc(1, sizeof(*c));
    if (!c)
        return PL_ERR_NO_MEMORY;
    c->st.cap = cap ? cap : SIZE_MAX;
    *out = c;
    return PL_OK;
}

void pl_pool_client_set_cap(pl_pool *p, pl_pool_client *c, size_t cap)
{
    if (pl_inherited(p->gen))
        return;
    pthread_mutex_lock(&p->mu);
    c->st.cap = cap ? cap : SIZE_MAX;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

void pl_pool_client_raise_cap(pl_pool *p, pl_pool_client *c, size_t cap)
{
    if (pl_inherited(p->gen))
        return;
    pthread_mutex_lock(&p->mu);
    if (cap > c->st.cap) {
        c->st.cap = cap;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
}

void pl_pool_client_get_stats(pl_pool *p, pl_pool_client *c, pl_pool_client_stats *st)
{
    if (pl_inherited(p->gen)) {
        memset(st, 0, sizeof(*st));
        return;
    }
    pl_pool_poll(p);
    pthread_mutex_lock(&p->mu);
    *st = c->st;
    pthread_mutex_unlock(&p->mu);
}

void pl_pool_client_waits(pl_pool *p, pl_pool_client *c, uint64_t *waits, int64_t *wait_ns)
{
    *waits = 0;
    *wait_ns = 0;
    if (pl_inherited(p->gen))
        return;
    pthread_mutex_lock(&p->mu);
    *waits = c->st.waits;
    *wait_ns = c->st.wait_ns;
    pthread_mutex_unlock(&p->mu);
}

void pl_pool_client_close(pl_pool *p, pl_pool_client *c)
{
    if (!c || pl_inherited(p->gen))
        return;
    pl_pool_poll(p);
    pthread_mutex_lock(&p->mu);
    int idle = c->st.in_use == 0;
    c->closed = 1;
    pthread_mutex_unlock(&p->mu);
    if (idle)
        free(c); /* else region_free_locked (pool.c) frees it with its last region */
}
