/* The host backend: the CUDA stream and event model, emulated on the host.
 *
 * A stream is a worker thread that runs its queued operations strictly in order. Each
 * event_record makes a new record (queued as a RECORD operation, done when the stream's worker
 * reaches it) and makes it the event's latest; an event is complete when its latest record is
 * done, so an event never recorded is complete, as in CUDA. stream_wait_event captures the
 * latest record and queues a WAIT that holds the worker until that record is done: later work
 * on the waiting stream is held back, and a later record of the same event does not change
 * what the wait waits for, as in CUDA.
 *
 * "Device" memory is ordinary host memory; device_free on a stream frees it when the worker
 * reaches the free, so frees are stream ordered too. Nothing here is a mock: CPU-only users get a
 * real background pipeline from it, and the test suite runs all pool and prefetcher logic
 * through it with real concurrency. */
#include "backend.h"
#include "devgather.h"
#include "host_faults.h"
#include "util.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One record of an event. A wait captures the record current at the time of the call, so a
 * later record of the same event (maybe on another stream, maybe completing first) neither
 * releases nor extends it, as in CUDA. Records are refcounted and guarded by one process-wide
 * mutex, ev_mu: a queued WAIT holds its record, never the event, so an event may be destroyed
 * while waits on it are still queued (as cudaEventDestroy allows). */
typedef struct rec {
    int refs; /* guarded by ev_mu */
    int done; /* guarded by ev_mu */
} rec;

struct pl_event {
    rec *latest; /* guarded by ev_mu; NULL: never recorded (complete) */
};

static pthread_mutex_t ev_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ev_cv;      /* broadcast whenever a record completes; CLOCK_MONOTONIC */
static pthread_once_t ev_once = PTHREAD_ONCE_INIT;
static atomic_int ev_cv_made;     /* ev_cv was initialised (re-made in a fork child) */

static void ev_init(void)
{
    pl_cond_init(&ev_cv);
    atomic_store(&ev_cv_made, 1);
}

/* Note [held copies]
 * A test switch (pinloader._C._testing.debug_hold_copies): while it is on, every host-backend
 * stream's worker holds before running its next queued operation, and fresh "device" blocks are
 * filled with HOLD_POISON. A batch handed out meanwhile has its copy queued but not run, so a
 * consumer that reads the memory without waiting for the ready event (DLPack's __dlpack__ waits)
 * reads the poison every time instead of racing the copy. Turning it off lets the streams run on.
 * While it is on, anything that waits for a stream (close(), stream destruction, __dlpack__)
 * waits until it is turned off. Never on a data path. */
#define HOLD_POISON 0xcd
static atomic_int hold_all; /* the switch; read by every worker before each operation */

void pl_host_hold_streams(int on)
{
    atomic_store(&hold_all, on ? 1 : 0);
}

typedef enum { OP_COPY, OP_ZERO, OP_RECORD, OP_WAIT, OP_FREE, OP_HOLD, OP_GATHER, OP_STOP } op_kind;

typedef struct op {
    struct op *next;
    op_kind kind;
    void *dst;
    const void *src;
    size_t n;
    pl_event *event;
    rec *record;
    unsigned long long epoch; /* pl_fault_epoch when it was queued */
} op;

struct pl_stream {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;  /* signalled when an op is queued (worker) or completed (sync) */
    op *head, *tail;    /* guarded by mu */
    uint64_t queued;    /* guarded by mu: operations queued so far */
    uint64_t completed; /* guarded by mu: operations finished so far */
};

static void device_block_free(void *user);
static void run_gather(const pl_gather_args *g);

/* ---- events ---- */

static int host_event_create(pl_event **out)
{
    pthread_once(&ev_once, ev_init);
    pl_event *e = calloc(1, sizeof(*e));
    if (!e)
        return PL_ERR_NO_MEMORY;
    *out = e;
    return PL_OK;
}

static void rec_unref_locked(rec *r)
{
    if (r && --r->refs == 0)
        free(r);
}

static int host_event_destroy(pl_event *e)
{
    if (!e)
        return PL_OK;
    pthread_mutex_lock(&ev_mu);
    rec_unref_locked(e->latest);
    pthread_mutex_unlock(&ev_mu);
    free(e);
    return PL_OK;
}

static void rec_mark_done(rec *r)
{
    pthread_mutex_lock(&ev_mu);
    r->done = 1;
    rec_unref_locked(r);
    pthread_cond_broadcast(&ev_cv);
    pthread_mutex_unlock(&ev_mu);
}

/* The current record with a reference taken (NULL if never recorded). */
static rec *event_capture(pl_event *e)
{
    pthread_mutex_lock(&ev_mu);
    rec *r = e->latest;
    if (r)
        r->refs++;
    pthread_mutex_unlock(&ev_mu);
    return r;
}

/* Wait until record r completes, at most timeout_ns (negative: forever); drops the reference. */
static int rec_wait(rec *r, int64_t timeout_ns)
{
    if (!r)
        return PL_OK;
    int rc = PL_OK;
    struct timespec deadline;
    if (timeout_ns >= 0)
        pl_deadline(&deadline, timeout_ns);
    pthread_mutex_lock(&ev_mu);
    while (!r->done) {
        if (timeout_ns < 0) {
            pthread_cond_wait(&ev_cv, &ev_mu);
        } else if (pthread_cond_timedwait(&ev_cv, &ev_mu, &deadline) == ETIMEDOUT) {
            if (!r->done)
                rc = PL_ERR_TIMEOUT;
            break;
        }
    }
    rec_unref_locked(r);
    pthread_mutex_unlock(&ev_mu);
    return rc;
}

static int host_event_query(pl_event *e)
{
    pthread_mutex_lock(&ev_mu);
    int ready = !e->latest || e->latest->done;
    pthread_mutex_unlock(&ev_mu);
    return ready ? PL_OK : PL_ERR_NOT_READY;
}

static int host_event_synchronize(pl_event *e)
{
    return rec_wait(event_capture(e), -1);
}

static int host_event_wait(pl_event *e, int64_t timeout_ns, int64_t expect_ns)
{
    (void)expect_ns; /* a condition variable wakes exactly at completion */
    return rec_wait(event_capture(e), timeout_ns);
}

/* ---- streams ---- */

/* A dead runtime (Note [injected faults] in host_faults.c): a sticky failure has struck, or the
 * op was queued in a lifetime that has ended. */
static int op_is_dead(const op *o)
{
    return atomic_load(&pl_fault_dead) || o->epoch != atomic_load(&pl_fault_epoch);
}

/* An OP_WAIT begun while the runtime lived: until the record is done or the runtime dies (the
 * injector wakes the waiters when it does: fault_wake). Drops the reference. */
static void rec_wait_live(rec *r, const op *o)
{
    if (!r)
        return;
    pthread_mutex_lock(&ev_mu);
    while (!r->done && !op_is_dead(o))
        pthread_cond_wait(&ev_cv, &ev_mu);
    rec_unref_locked(r);
    pthread_mutex_unlock(&ev_mu);
}

static void *stream_main(void *arg)
{
    pl_stream *s = arg;
    pl_thread_name("pl-host-stream");
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->head)
            pthread_cond_wait(&s->cv, &s->mu);
        op *o = s->head;
        pthread_mutex_unlock(&s->mu);
        while (atomic_load(&hold_all)) /* see Note [held copies] */
            pl_sleep_ns(100000);
        if (atomic_load_explicit(&pl_fault_delay, memory_order_relaxed))
            pl_sleep_ns(FAULT_OP_DELAY_NS); /* Note [injected faults] in host_faults.c */
        /* Counted first, then the flag and the lifetime read, in that order (all sequentially
         * consistent): a sticky failure this op does not see waits for it to finish, and a
         * cleared flag implies the new lifetime (pl_host_fail_after) is seen. */
        atomic_fetch_add(&pl_fault_ops_running, 1);
        int dead = op_is_dead(o);

        /* The op stays at the head while it runs: stream_synchronize counts completions. A dead
         * runtime (Note [injected faults] in host_faults.c) copies, gathers, waits and holds no
         * more; records still complete (no waiter is left hanging) and frees are still done. */
        switch (o->kind) {
        case OP_COPY:
            if (!dead)
                memcpy(o->dst, o->src, o->n);
            break;
        case OP_ZERO:
            if (!dead)
                memset(o->dst, 0, o->n);
            break;
        case OP_RECORD:
            rec_mark_done(o->record);
            break;
        case OP_WAIT:
            if (dead)
                rec_wait(o->record, 0); /* drops the reference */
            else
                rec_wait_live(o->record, o);
            break;
        case OP_FREE:
            device_block_free(o->dst);
            break;
        case OP_HOLD:
            /* the flag read again: a hold begun before a sticky failure ends with it */
            while (!dead && !op_is_dead(o) && !__atomic_load_n((int *)o->dst, __ATOMIC_ACQUIRE))
                pl_sleep_ns(100000);
            break;
        case OP_GATHER:
            if (!dead)
                run_gather(o->dst);
            free(o->dst);
            break;
        case OP_STOP:
            break;
        }
        op_kind kind = o->kind;
        atomic_fetch_sub(&pl_fault_ops_running, 1);

        pthread_mutex_lock(&s->mu);
        s->head = o->next;
        if (!s->head)
            s->tail = NULL;
        s->completed++;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        free(o);
        if (kind == OP_STOP)
            return NULL;
    }
}

static int enqueue(pl_stream *s, op_kind kind, void *dst, const void *src, size_t n, pl_event *e,
                   rec *r)
{
    op *o = malloc(sizeof(*o));
    if (!o)
        return PL_ERR_NO_MEMORY;
    *o = (op){NULL, kind, dst, src, n, e, r,
              atomic_load_explicit(&pl_fault_epoch, memory_order_relaxed)};
    pthread_mutex_lock(&s->mu);
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
    s->queued++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return PL_OK;
}

static int host_stream_create(int high_priority, pl_stream **out)
{
    (void)high_priority; /* one worker per stream: nothing to prioritise against */
    pl_stream *s = calloc(1, sizeof(*s));
    if (!s)
        return PL_ERR_NO_MEMORY;
    if (pthread_mutex_init(&s->mu, NULL) != 0 || pthread_cond_init(&s->cv, NULL) != 0) {
        free(s);
        return PL_ERR_NO_MEMORY;
    }
    if (pthread_create(&s->thread, NULL, stream_main, s) != 0) {
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv);
        free(s);
        return PL_ERR_NO_MEMORY;
    }
    *out = s;
    return PL_OK;
}

static int host_stream_synchronize(pl_stream *s)
{
    if (!s)
        return PL_OK;
    pthread_mutex_lock(&s->mu);
    uint64_t target = s->queued;
    while (s->completed < target)
        pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return PL_OK;
}

static int host_stream_destroy(pl_stream *s)
{
    if (!s)
        return PL_OK;
    /* Like cudaStreamDestroy, queued work still runs; the worker exits after it. */
    int rc = enqueue(s, OP_STOP, NULL, NULL, 0, NULL, NULL);
    if (rc != PL_OK)
        return rc;
    pthread_join(s->thread, NULL);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
    return PL_OK;
}

static int host_event_record(pl_event *e, pl_stream *s)
{
    rec *r = calloc(1, sizeof(*r));
    if (!r)
        return PL_ERR_NO_MEMORY;
    r->refs = 2; /* the event's and the RECORD operation's */
    pthread_mutex_lock(&ev_mu);
    rec *old = e->latest;
    e->latest = r;
    rec_unref_locked(old);
    pthread_mutex_unlock(&ev_mu);
    if (!s) { /* the "default stream" runs synchronously on the caller */
        rec_mark_done(r);
        return PL_OK;
    }
    int rc = enqueue(s, OP_RECORD, NULL, NULL, 0, NULL, r);
    if (rc != PL_OK)
        rec_mark_done(r);
    return rc;
}

static int host_stream_wait_event(pl_stream *s, pl_event *e)
{
    rec *r = event_capture(e);
    if (!r)
        return PL_OK;
    if (!s)
        return rec_wait(r, -1);
    int rc = enqueue(s, OP_WAIT, NULL, NULL, 0, NULL, r);
    if (rc != PL_OK)
        rec_wait(r, 0); /* drops the reference */
    return rc;
}

/* ---- device gather (Note [device gather] in devgather.h) ---- */

/* What the kernel does, on the stream's worker: the same table, read from the "device" block
 * after the staged copy put it there, the same slots. */
static void run_gather(const pl_gather_args *g)
{
    const size_t span = g->span;
    for (int64_t i = 0; i < g->n; i++) {
        const pl_gather_pair p = g->table[i];
        const char *from = p.row >= 0 ? g->src + p.row * g->row_stride : g->edge + (size_t)(-1 - p.row) * span;
        memcpy(g->dst + (size_t)p.slot * span, from, span);
    }
}

static int host_gather_launch(const pl_gather_args *g, pl_stream *s)
{
    pl_gather_args *copy = malloc(sizeof(*copy));
    if (!copy)
        return PL_ERR_NO_MEMORY;
    *copy = *g;
    if (!s) {
        run_gather(copy);
        free(copy);
        return PL_OK;
    }
    int rc = enqueue(s, OP_GATHER, copy, NULL, 0, NULL, NULL);
    if (rc != PL_OK)
        free(copy);
    return rc;
}

static int host_gather_ready(int device, const char **why)
{
    (void)device;
    (void)why;
    return PL_OK;
}

/* "Registering" pins nothing on the host backend: the registry still counts the bytes against
 * the budget, so the policy (budget, sharing, release) is the one CUDA runs. */
static int host_host_register(int device, void *p, size_t n, int prefer_read_only, void **dev, int *read_only)
{
    (void)device;
    (void)n;
    (void)prefer_read_only;
    *dev = p;
    *read_only = 1;
    return PL_OK;
}

static int host_host_unregister(void *p)
{
    (void)p;
    return PL_OK;
}

static int host_host_mapped(const void *p, size_t n, void **dev)
{
    (void)p;
    (void)n;
    *dev = NULL;
    return PL_OK;
}

static int host_host_device_ptr(void *p, void **dev)
{
    *dev = p; /* the host backend's device is the host */
    return PL_OK;
}

/* ---- memory ---- */

static int host_host_alloc(size_t n, int numa_node, void **out)
{
    return pl_os_alloc(n, numa_node, out);
}

static int host_numa_node(int device)
{
    (void)device; /* the host backend's "device" is the host itself: no placement to ask for */
    return -1;
}

static int host_host_free(void *p, size_t n)
{
    pl_os_free(p, n);
    return PL_OK;
}

static int host_host_is_pinned(const void *p, int *pinned)
{
    (void)p;
    *pinned = 0;
    return PL_OK;
}

/* Note [host device cache]
 * "Device" blocks are host memory. Freshly mapped memory costs a page fault per page on first
 * touch (a 10 MB batch: ~5 ms), so freed blocks are kept, by exact size, for reuse, up to
 * CACHE_BYTES in all: like the CUDA backend's pool, steady-state batches of the same size then
 * reuse memory that is already mapped. Frees are stream ordered (OP_FREE). */
#define CACHE_BYTES ((size_t)1 << 30)
#define CACHE_SLOTS 64

typedef struct {
    void *p;
    size_t n;
} cached_block;

static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static cached_block cache[CACHE_SLOTS]; /* guarded by cache_mu */
static int n_cached;                    /* guarded by cache_mu */
static size_t cached_bytes;             /* guarded by cache_mu */

/* Sizes are recorded in a header in front of each block. */
#define HDR PL_ALIGN

static int host_device_alloc(int device, size_t n, pl_stream *s, void **out)
{
    (void)device;
    (void)s;
    size_t total;
    if (pl_align_up_checked(n ? n : 1, PL_ALIGN, &n) != 0 || __builtin_add_overflow(n, HDR, &total))
        return PL_ERR_NO_MEMORY; /* see Note [checked sizes] in util.h */
    void *p = NULL;
    pthread_mutex_lock(&cache_mu);
    for (int i = 0; i < n_cached; i++)
        if (cache[i].n == n) {
            p = cache[i].p;
            cached_bytes -= n;
            cache[i] = cache[--n_cached];
            break;
        }
    pthread_mutex_unlock(&cache_mu);
    if (!p) {
        if (posix_memalign(&p, PL_ALIGN, total) != 0)
            return PL_ERR_NO_MEMORY;
        *(size_t *)p = n;
    }
    *out = (char *)p + HDR;
    if (atomic_load(&hold_all))
        memset(*out, HOLD_POISON, n);
    return PL_OK;
}

static void device_block_free(void *user)
{
    void *p = (char *)user - HDR;
    size_t n = *(size_t *)p;
    pthread_mutex_lock(&cache_mu);
    if (n_cached < CACHE_SLOTS && n <= CACHE_BYTES - cached_bytes) {
        cache[n_cached++] = (cached_block){p, n};
        cached_bytes += n;
        p = NULL;
    }
    pthread_mutex_unlock(&cache_mu);
    free(p);
}

static int host_device_free(int device, void *p, pl_stream *s)
{
    (void)device;
    if (!s) {
        device_block_free(p);
        return PL_OK;
    }
    return enqueue(s, OP_FREE, p, NULL, 0, NULL, NULL);
}

static int host_memcpy_h2d_async(void *dst, const void *src, size_t n, pl_stream *s)
{
    if (!s) {
        memcpy(dst, src, n);
        return PL_OK;
    }
    return enqueue(s, OP_COPY, dst, src, n, NULL, NULL);
}

static int host_memzero_async(void *dst, size_t n, pl_stream *s)
{
    if (!s) {
        memset(dst, 0, n);
        return PL_OK;
    }
    return enqueue(s, OP_ZERO, dst, NULL, n, NULL, NULL);
}

static int host_memcpy_d2h(void *dst, const void *src, size_t n)
{
    memcpy(dst, src, n);
    return PL_OK;
}

static int host_stream_hold(pl_stream *s, volatile int *gate)
{
    if (!s)
        return PL_ERR_INVALID_VALUE;
    return enqueue(s, OP_HOLD, (void *)gate, NULL, 0, NULL, NULL);
}

/* ---- fork ---- */

void pl_host_atfork_child(void)
{
    /* Only this thread exists now: the process-wide locks are re-made (a parent thread may have
     * held them), the condition variable too (its waiters are gone), and the block cache is
     * forgotten (it may have been mid-update); its blocks are the parent's copies, leaked.
     * Streams and events of the parent are reached only through inherited objects, which do
     * not use them (Note [fork generations] in util.h). */
    pl_mutex_reset_in_child(&ev_mu);
    if (atomic_load(&ev_cv_made))
        pl_cond_init(&ev_cv);
    pl_mutex_reset_in_child(&cache_mu);
    n_cached = 0;
    cached_bytes = 0;
    pl_mutex_reset_in_child(&pl_fault_mu);
    atomic_store(&pl_fault_ops_running, 0); /* the parent's workers are not here */
}

/* ---- misc ---- */

static int host_set_device(int device)
{
    return device == 0 ? PL_OK : PL_ERR_INVALID_DEVICE;
}

static int host_get_device(int *device)
{
    *device = 0;
    return PL_OK;
}

static int host_thread_ignore_other_captures(void)
{
    return PL_OK; /* no graphs to capture */
}

static int host_thread_relax_captures(int *saved)
{
    *saved = -1; /* nothing to put back */
    return PL_OK;
}

static void host_thread_restore_captures(int saved)
{
    (void)saved;
}

static const char *host_error_name(int code)
{
    switch (code) {
    case PL_OK: return "success";
    case PL_ERR_INVALID_VALUE: return "invalidValue";
    case PL_ERR_NO_MEMORY: return "memoryAllocation";
    case PL_ERR_INVALID_DEVICE: return "invalidDevice";
    case PL_ERR_NOT_READY: return "notReady";
    default: return "unknown";
    }
}

static const char *host_error_string(int code)
{
    switch (code) {
    case PL_OK: return "no error";
    case PL_ERR_INVALID_VALUE: return "invalid argument";
    case PL_ERR_NO_MEMORY: return "out of host memory";
    case PL_ERR_INVALID_DEVICE: return "the host backend has only device 0";
    case PL_ERR_NOT_READY: return "work not complete yet";
    default: return "unknown error";
    }
}

/* ---- the fault injector's calls (Note [injected faults] in host_faults.c) ---- */

/* Wake the streams' workers that wait for a record: the runtime they wait in may have died. */
static void fault_wake(void)
{
    pthread_once(&ev_once, ev_init);
    pthread_mutex_lock(&ev_mu);
    pthread_cond_broadcast(&ev_cv);
    pthread_mutex_unlock(&ev_mu);
}

long long pl_host_fail_after(long long n, int sticky)
{
    int was_dead = 0;
    long long counted = pl_fault_arm(n, sticky, &was_dead);
    if (was_dead)
        fault_wake();
    return counted;
}

static int fault_hit_armed(const char *name)
{
    int hit = pl_fault_decide(name);
    if (hit == PL_FAULT_DEAD) {
        /* Then the operations begun before it end: a waiting one is woken and stops, every later
         * one sees the flag and does nothing, so this is short. Bounded all the same (a test
         * switch must not hang a run), and said if the bound is reached. */
        fault_wake();
        const int64_t deadline = pl_now_ns() + 10 * 1000000000LL;
        while (atomic_load(&pl_fault_ops_running) > 0) {
            if (pl_now_ns() > deadline) {
                fprintf(stderr, "pinloader host backend: a stream operation still runs 10 s after "
                                "an injected sticky failure (%s)\n", name);
                break;
            }
            pl_sleep_ns(100000);
        }
    }
    return hit != 0;
}

/* 1 if the backend call `name` is to fail (the switch armed and this call its target). */
static inline int fault_hit(const char *name)
{
    /* acquire: a call that finds the switch off sees the lifetime pl_host_fail_after set */
    if (__builtin_expect(!atomic_load_explicit(&pl_fault_armed, memory_order_acquire), 1))
        return 0;
    return fault_hit_armed(name);
}

/* faulty_f: host_f behind the switch, failing with `code`. */
#define FAULTY(f, code, params, args)                                                              \
    static int faulty_##f params                                                                   \
    {                                                                                              \
        return fault_hit(#f) ? (code) : host_##f args;                                          \
    }
#define NOMEM PL_ERR_NO_MEMORY
#define FAIL PL_ERR_UNKNOWN
FAULTY(set_device, FAIL, (int device), (device))
FAULTY(get_device, FAIL, (int *device), (device))
FAULTY(thread_ignore_other_captures, FAIL, (void), ())
FAULTY(thread_relax_captures, FAIL, (int *saved), (saved))
FAULTY(stream_create, NOMEM, (int high_priority, pl_stream **out), (high_priority, out))
FAULTY(stream_destroy, FAIL, (pl_stream *s), (s))
FAULTY(stream_synchronize, FAIL, (pl_stream *s), (s))
FAULTY(stream_wait_event, FAIL, (pl_stream *s, pl_event *e), (s, e))
FAULTY(event_create, NOMEM, (pl_event **out), (out))
FAULTY(event_destroy, FAIL, (pl_event *e), (e))
FAULTY(event_record, FAIL, (pl_event *e, pl_stream *s), (e, s))
FAULTY(event_query, FAIL, (pl_event *e), (e))
FAULTY(event_synchronize, FAIL, (pl_event *e), (e))
FAULTY(event_wait, FAIL, (pl_event *e, int64_t timeout_ns, int64_t expect_ns), (e, timeout_ns, expect_ns))
FAULTY(host_alloc, NOMEM, (size_t n, int numa_node, void **out), (n, numa_node, out))
FAULTY(host_free, FAIL, (void *p, size_t n), (p, n))
FAULTY(host_is_pinned, FAIL, (const void *p, int *pinned), (p, pinned))
FAULTY(device_alloc, NOMEM, (int device, size_t n, pl_stream *s, void **out), (device, n, s, out))
FAULTY(device_free, FAIL, (int device, void *p, pl_stream *s), (device, p, s))
FAULTY(memcpy_h2d_async, FAIL, (void *dst, const void *src, size_t n, pl_stream *s), (dst, src, n, s))
/* all of it is host memory: the same copy, counted under its own name */
static int faulty_memcpy_d2d_async(void *dst, const void *src, size_t n, pl_stream *s)
{
    return fault_hit("memcpy_d2d_async") ? PL_ERR_UNKNOWN
                                            : host_memcpy_h2d_async(dst, src, n, s);
}
FAULTY(memzero_async, FAIL, (void *dst, size_t n, pl_stream *s), (dst, n, s))
FAULTY(memcpy_d2h, FAIL, (void *dst, const void *src, size_t n), (dst, src, n))
FAULTY(stream_hold, FAIL, (pl_stream *s, volatile int *gate), (s, gate))
FAULTY(host_register, FAIL, (int device, void *p, size_t n, int prefer_read_only, void **dev, int *read_only),
       (device, p, n, prefer_read_only, dev, read_only))
FAULTY(host_unregister, FAIL, (void *p), (p))
FAULTY(host_mapped, FAIL, (const void *p, size_t n, void **dev), (p, n, dev))
FAULTY(host_device_ptr, FAIL, (void *p, void **dev), (p, dev))
static int faulty_gather_ready(int device, const char **why)
{
    if (fault_hit("gather_ready")) {
        *why = "a fault injected by a test (Note [injected faults] in host_faults.c)";
        return FAIL;
    }
    return host_gather_ready(device, why);
}
FAULTY(gather_launch, NOMEM, (const pl_gather_args *g, pl_stream *s), (g, s))
#undef FAULTY
#undef NOMEM
#undef FAIL

static const pl_backend host_backend = {
    .name = "host",
    .kind = PL_BACKEND_HOST,
    .set_device = faulty_set_device,
    .get_device = faulty_get_device,
    .thread_ignore_other_captures = faulty_thread_ignore_other_captures,
    .thread_relax_captures = faulty_thread_relax_captures,
    .thread_restore_captures = host_thread_restore_captures,
    .stream_create = faulty_stream_create,
    .stream_destroy = faulty_stream_destroy,
    .stream_synchronize = faulty_stream_synchronize,
    .stream_wait_event = faulty_stream_wait_event,
    .event_create = faulty_event_create,
    .event_destroy = faulty_event_destroy,
    .event_record = faulty_event_record,
    .event_query = faulty_event_query,
    .event_synchronize = faulty_event_synchronize,
    .event_wait = faulty_event_wait,
    .host_alloc = faulty_host_alloc,
    .numa_node = host_numa_node,
    .host_free = faulty_host_free,
    .host_is_pinned = faulty_host_is_pinned,
    .device_alloc = faulty_device_alloc,
    .device_free = faulty_device_free,
    .memcpy_h2d_async = faulty_memcpy_h2d_async,
    .memcpy_d2d_async = faulty_memcpy_d2d_async,
    .memzero_async = faulty_memzero_async,
    .memcpy_d2h = faulty_memcpy_d2h,
    .stream_hold = faulty_stream_hold,
    .host_register = faulty_host_register,
    .host_unregister = faulty_host_unregister,
    .host_mapped = faulty_host_mapped,
    .host_device_ptr = faulty_host_device_ptr,
    .gather_ready = faulty_gather_ready,
    .gather_launch = faulty_gather_launch,
    .error_name = host_error_name,
    .error_string = host_error_string,
};

const pl_backend *pl_backend_host(void)
{
    return &host_backend;
}
