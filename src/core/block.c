/* Device blocks and their stream-ordered release.
 *
 * Note [device lifetime]
 * A batch's device memory is read by consumer kernels on streams pinloader does not own, at
 * times it cannot see. The DLPack deleter tells it when a consumer has finished *enqueuing*
 * such work (the framework dropped its tensor); at that moment an event is recorded on the
 * stream the consumer named in __dlpack__(stream=...). When the last reference goes, pinloader's
 * own release stream waits on the ready event and on every use event, and the memory is
 * released behind those waits (Note [deferred frees]: on CUDA it is handed to the next
 * allocation once they have passed; on the host backend it is freed there). The release stream
 * is created once per device and never destroyed, so frees never depend on a consumer stream
 * still existing at free time, and the copy stream never waits on anything but its own work
 * (see Note [device pool] in backend_cuda.c).
 * Deleters may run on any thread, without the GIL, after the runtime began unloading: every
 * call here tolerates failure by leaking rather than crashing.
 *
 * Note [consumer waits]
 * Each export to a consumer stream S must order S's reads after the batch's copy: S waits on the
 * block's ready event (cudaStreamWaitEvent, queued; the host does not block). The ready event is
 * recorded once, before any DeviceArray of the block reaches user code, and never again, so one
 * wait queued on S covers every later read queued on S. A block therefore remembers, in
 * `waited` (guarded by its spin lock mu), the streams it made wait, each with the number of live
 * exports (capsules or the tensors made from them) that rely on that wait. A further export to
 * the same S while that number is non-zero skips the wait (pl_block_consumer_memo); the entry is
 * written only after the wait was queued, so a thread that finds it has the wait ordered before
 * anything it queues on S. The count keeps the memo honest about stream handles: a consumer
 * that destroys S must first let go of the tensors it used on S (their deleters record their
 * use on S), after which the count is zero and a new stream that reuses the handle is made to
 * wait again. Entries are not kept for the per-thread default stream (handle 2 is a different
 * stream on each thread); when the table is full the wait is simply issued every time. On the
 * host backend the consumer is the CPU (key NULL): the wait is a blocking event sync, and a
 * memo hit means the copy is known to have completed.
 * The memo concerns only the wait. The device-lifetime bookkeeping is unchanged by it: every
 * export still records its use on S when its deleter runs (pl_block_note_use), so the block is
 * released behind every stream's last use (Note [device lifetime]). */
#include "block.h"
#include "util.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_DEVICES = 64, EVENT_CACHE = 256, DEFERRED_MAX = 64 };

/* A block's memory whose free waits for `done` (Note [deferred frees]). */
typedef struct {
    void *ptr;
    pl_event *done;
} deferred_free;

typedef struct {
    pthread_mutex_t mu;
    int init;                   /* guarded by mu */
    pl_stream *release;         /* written once under mu; never destroyed */
    pl_event *events[EVENT_CACHE]; /* guarded by mu */
    int n_events;
    deferred_free deferred[DEFERRED_MAX]; /* oldest first; guarded by mu */
    int n_deferred;
} devctx;

static devctx ctx[2][MAX_DEVICES] = {
    [0 ... 1][0 ... MAX_DEVICES - 1] = {.mu = PTHREAD_MUTEX_INITIALIZER},
};
static atomic_size_t live_bytes[2];
static atomic_long live_count[2];
static atomic_ullong consumer_waits[2];   /* see pl_block_consumer_counters */
static atomic_ullong consumer_skipped[2];

static devctx *get_ctx(const pl_backend *b, int device)
{
    if (device < 0 || device >= MAX_DEVICES)
        return NULL;
    return &ctx[b->kind][device];
}

static void spin_lock(atomic_flag *f)
{
    while (atomic_flag_test_and_set_explicit(f, memory_order_acquire)) {
    }
}

static void spin_unlock(atomic_flag *f)
{
    atomic_flag_clear_explicit(f, memory_order_release);
}

static int note_use_on_device(pl_block *blk, pl_stream *s);

/* The release stream of a device, created on first use (the caller has made device current). */
static int release_stream(const pl_backend *b, int device, pl_stream **out)
{
    devctx *c = get_ctx(b, device);
    if (!c)
        return PL_ERR_INVALID_DEVICE;
    pthread_mutex_lock(&c->mu);
    pl_stream *s = c->release;
    pthread_mutex_unlock(&c->mu);
    if (!s) {
        int rc = b->stream_create(0, &s);
        if (rc != PL_OK)
            return rc;
        pthread_mutex_lock(&c->mu);
        if (!c->release) {
            c->release = s;
            s = NULL;
        }
        pl_stream *mine = c->release;
        pthread_mutex_unlock(&c->mu);
        if (s)
            b->stream_destroy(s); /* lost the race */
        s = mine;
    }
    *out = s;
    return PL_OK;
}

int pl_device_event_take(const pl_backend *b, int device, pl_event **out)
{
    devctx *c = get_ctx(b, device);
    if (!c)
        return PL_ERR_INVALID_DEVICE;
    pthread_mutex_lock(&c->mu);
    pl_event *e = c->n_events ? c->events[--c->n_events] : NULL;
    pthread_mutex_unlock(&c->mu);
    if (e) {
        *out = e;
        return PL_OK;
    }
    /* Events belong to the current device: deleters may run on any thread. */
    int prev = -1;
    int have_prev = b->get_device(&prev) == PL_OK;
    if (!have_prev || prev != device)
        b->set_device(device);
    int rc = b->event_create(out);
    if (have_prev && prev != device)
        b->set_device(prev);
    return rc;
}

void pl_device_event_give(const pl_backend *b, int device, pl_event *e)
{
    devctx *c = get_ctx(b, device);
    if (!e || !c)
        return;
    pthread_mutex_lock(&c->mu);
    if (c->n_events < EVENT_CACHE) {
        c->events[c->n_events++] = e;
        e = NULL;
    }
    pthread_mutex_unlock(&c->mu);
    if (e)
        b->event_destroy(e);
}

int pl_block_create(const pl_backend *b, int device, pl_block **out)
{
    pl_block *blk = calloc(1, sizeof(*blk));
    if (!blk)
        return PL_ERR_NO_MEMORY;
    atomic_init(&blk->refcount, 1);
    atomic_flag_clear(&blk->mu);
    blk->b = b;
    blk->device = device;
    blk->gen = pl_generation();
    int rc = pl_device_event_take(b, device, &blk->ready);
    if (rc != PL_OK) {
        free(blk);
        return rc;
    }
    atomic_fetch_add(&live_count[b->kind], 1);
    *out = blk;
    return PL_OK;
}

/* Note [deferred frees]
 * A block is allocated on a copy stream, and its last use is on the release stream (Note
 * [device lifetime]). Freed there with cudaFreeAsync, its memory could be reused only once the
 * device pool saw the free complete: the pool may not make the copy stream wait on a consumer
 * (Note [device pool] in backend_cuda.c), and the driver does not look between device-wide
 * synchronisations, so a loader-bound pipeline that never synchronises the device would grow
 * the pool by a batch per batch and spend producer CPU mapping the new memory (the
 * measurements: benchmarks/results/design_measurements.md).
 * So on CUDA the release stream does not free. It waits on the block's ready and use events
 * and then records `done` (under mu, so the list below is in the release stream's
 * order), and the memory is deferred: kept, with `done`, in its device's list. An allocation on
 * a copy stream first frees every deferred block whose `done` the host has seen complete, on
 * that copy stream, where the pool reuses it at once (same-stream order): nothing that reads
 * the memory is still queued, and no stream waits on another. The `done` events complete in
 * list order, so the scan stops at the first that has not. The list holds at most DEFERRED_MAX
 * blocks per device, so memory dropped while no allocation follows stays bounded; past that the
 * oldest is freed on the release stream, behind its waits (a burst of more than
 * DEFERRED_MAX dropped batches therefore still grows the pool, by at most the burst, until the
 * device is synchronised). An allocation that runs out of memory while blocks are deferred
 * waits for them (on the host), frees them all on its stream and tries once more: a wait, but
 * only where the alternative is an error. The static buffers (handout.c) are allocated on the
 * consumer's stream, which may be capturing a CUDA graph: they neither free deferred blocks nor
 * wait. Deferred memory is not live (pl_block_live_bytes) but is still held from the pool, which
 * never gives memory back to the driver anyway (its release threshold is "never").
 * The host backend frees on the release stream, behind its waits: its device_alloc takes a
 * cached block whatever stream it is on, so deferring would only hold host memory. */
static int defer_free(const pl_backend *b, int device, void *ptr, pl_stream *rs)
{
    devctx *c = get_ctx(b, device);
    pl_event *e = NULL;
    if (b->kind != PL_BACKEND_CUDA || pl_device_event_take(b, device, &e) != PL_OK)
        return b->device_free(device, ptr, rs); /* behind its waits */
    deferred_free oldest = {NULL, NULL};
    pthread_mutex_lock(&c->mu);
    int rc = b->event_record(e, rs);
    if (rc == PL_OK) {
        if (c->n_deferred == DEFERRED_MAX) {
            oldest = c->deferred[0];
            memmove(c->deferred, c->deferred + 1, (DEFERRED_MAX - 1) * sizeof c->deferred[0]);
            c->n_deferred--;
        }
        c->deferred[c->n_deferred++] = (deferred_free){ptr, e};
    }
    pthread_mutex_unlock(&c->mu);
    if (rc != PL_OK) {
        pl_device_event_give(b, device, e);
        return b->device_free(device, ptr, rs);
    }
    if (oldest.ptr) {
        /* queued on rs after its own done record, so behind its waits; on failure, leaked */
        b->device_free(device, oldest.ptr, rs);
        pl_device_event_give(b, device, oldest.done);
    }
    return PL_OK;
}

/* Free on s every deferred block of device whose uses the host has seen complete (Note
 * [deferred frees]); wait: every deferred block, after waiting for its uses (the allocation ran
 * out of memory). Returns how many were freed. */
static int free_finished(const pl_backend *b, int device, pl_stream *s, int wait)
{
    devctx *c = get_ctx(b, device);
    if (!c || b->kind != PL_BACKEND_CUDA)
        return 0;
    deferred_free done[DEFERRED_MAX];
    int n_done = 0;
    pthread_mutex_lock(&c->mu);
    pl_stream *rs = c->release;
    while (n_done < c->n_deferred && (wait || b->event_query(c->deferred[n_done].done) == PL_OK))
        n_done++; /* in the release stream's order: the first not done ends the scan */
    memcpy(done, c->deferred, (size_t)n_done * sizeof done[0]);
    memmove(c->deferred, c->deferred + n_done, (size_t)(c->n_deferred - n_done) * sizeof done[0]);
    c->n_deferred -= n_done;
    pthread_mutex_unlock(&c->mu);
    int freed = 0;
    for (int i = 0; i < n_done; i++) {
        /* waited for outside mu: deleters on other threads keep deferring meanwhile */
        if (wait && b->event_synchronize(done[i].done) != PL_OK) {
            b->device_free(device, done[i].ptr, rs); /* on the release stream, behind its waits */
        } else if (b->device_free(device, done[i].ptr, s) == PL_OK) {
            freed++;
        } /* else leaked: the runtime is unloading */
        pl_device_event_give(b, device, done[i].done);
    }
    return freed;
}

int pl_block_alloc(pl_block *blk, size_t size, pl_stream *s, int reuse_deferred)
{
    if (size == 0)
        return PL_OK;
    const pl_backend *b = blk->b;
    if (reuse_deferred)
        free_finished(b, blk->device, s, 0);
    int rc = b->device_alloc(blk->device, size, s, &blk->ptr);
    /* Out of memory with blocks deferred: wait for their consumers, free them here, try again. */
    if (rc == PL_ERR_NO_MEMORY && reuse_deferred && free_finished(b, blk->device, s, 1) > 0)
        rc = b->device_alloc(blk->device, size, s, &blk->ptr);
    if (rc == PL_OK) {
        blk->size = size;
        atomic_fetch_add(&live_bytes[blk->b->kind], size);
    }
    return rc;
}

void pl_block_incref(pl_block *blk)
{
    atomic_fetch_add_explicit(&blk->refcount, 1, memory_order_relaxed);
}

int pl_block_note_use(pl_block *blk, pl_stream *s)
{
    const pl_backend *b = blk->b;
    if (pl_inherited(blk->gen))
        return PL_ERR_FORKED; /* never freed in this process: nothing to order */
    /* The per-thread default stream (2) means the deleter's own thread's stream here, not the
     * consumer's: record on the legacy default stream instead, which every per-thread default
     * stream synchronises with. */
    if (s == (pl_stream *)(uintptr_t)2)
        s = (pl_stream *)(uintptr_t)1;
    int prev = -1;
    if (b->get_device(&prev) != PL_OK)
        prev = -1;
    if (prev != blk->device)
        b->set_device(blk->device); /* the legacy stream is per device: the block's */
    int rc = note_use_on_device(blk, s);
    if (rc != PL_OK) {
        /* Without an event the free cannot be ordered after the consumer: wait for its stream
         * now, or failing that, never free the memory (leak rather than corrupt). */
        if (b->stream_synchronize(s) != PL_OK)
            blk->leak = 1;
    }
    if (prev >= 0 && prev != blk->device)
        b->set_device(prev);
    return rc;
}

static int note_use_on_device(pl_block *blk, pl_stream *s)
{
    spin_lock(&blk->mu);
    for (int i = 0; i < blk->n_uses; i++)
        if (blk->uses[i].stream == s) {
            /* Re-recording covers everything the earlier record did, and more. */
            pl_event *e = blk->uses[i].event;
            spin_unlock(&blk->mu);
            return blk->b->event_record(e, s);
        }
    spin_unlock(&blk->mu);

    pl_event *e;
    int rc = pl_device_event_take(blk->b, blk->device, &e);
    if (rc == PL_OK && (rc = blk->b->event_record(e, s)) != PL_OK) {
        pl_device_event_give(blk->b, blk->device, e);
        return rc;
    }
    if (rc != PL_OK)
        return rc;
    spin_lock(&blk->mu);
    if (blk->n_uses == blk->cap_uses) {
        int cap = blk->cap_uses ? blk->cap_uses * 2 : 2;
        pl_block_use *u = realloc(blk->uses, (size_t)cap * sizeof(*u));
        if (!u) {
            spin_unlock(&blk->mu);
            /* Cannot remember the use: wait for it here instead (rare, out of memory). */
            blk->b->event_synchronize(e);
            pl_device_event_give(blk->b, blk->device, e);
            return PL_OK;
        }
        blk->uses = u;
        blk->cap_uses = cap;
    }
    blk->uses[blk->n_uses++] = (pl_block_use){s, e};
    spin_unlock(&blk->mu);
    return PL_OK;
}

int pl_block_inherited(const pl_block *blk)
{
    return pl_inherited(blk->gen);
}

void pl_block_atfork_child(void)
{
    /* The parent's release streams (worker threads on the host) do not exist here and its
     * events are its own: start from nothing, as a fresh process would. Inherited blocks are
     * leaked without touching these counters. */
    for (int k = 0; k < 2; k++)
        for (int d = 0; d < MAX_DEVICES; d++) {
            devctx *c = &ctx[k][d];
            pl_mutex_reset_in_child(&c->mu);
            c->init = 0;
            c->release = NULL;
            c->n_events = 0;
            c->n_deferred = 0; /* the parent's memory and events: leaked */
        }
    for (int k = 0; k < 2; k++) {
        atomic_store(&live_bytes[k], 0);
        atomic_store(&live_count[k], 0);
    }
}

int pl_block_wait_ready(pl_block *blk, pl_stream *s)
{
    if (pl_inherited(blk->gen))
        return PL_ERR_FORKED;
    return blk->b->stream_wait_event(s, blk->ready);
}

int pl_block_sync_ready(pl_block *blk)
{
    if (pl_inherited(blk->gen))
        return PL_ERR_FORKED;
    /* a caller that may run during a capture brackets this (Note [releases during a capture]
     * in backend.h); the producer, in thread-local mode for good, needs no bracket */
    return blk->b->event_synchronize(blk->ready);
}

/* ---- consumer waits: see Note [consumer waits] ---- */

static int memoizable(const pl_block *blk, pl_stream *s)
{
    /* The per-thread default stream differs per thread; a static block is refilled by every
     * batch, so one wait covers only the batch it was made for. */
    return s != (pl_stream *)(uintptr_t)2 && !blk->no_memo;
}

int pl_block_consumer_memo(pl_block *blk, pl_stream *s)
{
    if (pl_inherited(blk->gen) || !memoizable(blk, s))
        return 0; /* an inherited block's lock may have been held at fork time */
    int hit = 0;
    spin_lock(&blk->mu);
    for (int i = 0; i < PL_BLOCK_WAIT_MEMO; i++)
        if (blk->waited[i].live > 0 && blk->waited[i].stream == s) {
            blk->waited[i].live++;
            hit = 1;
            break;
        }
    spin_unlock(&blk->mu);
    if (hit)
        atomic_fetch_add_explicit(&consumer_skipped[blk->b->kind], 1, memory_order_relaxed);
    return hit;
}

/* Record that s waited, with one count for the caller; 0 when the table is full. */
static int memo_insert(pl_block *blk, pl_stream *s)
{
    int slot = -1;
    spin_lock(&blk->mu);
    for (int i = 0; i < PL_BLOCK_WAIT_MEMO; i++) {
        if (blk->waited[i].live > 0 && blk->waited[i].stream == s) {
            slot = i; /* another thread waited on s meanwhile: share its entry */
            break;
        }
        if (blk->waited[i].live == 0 && slot < 0)
            slot = i;
    }
    if (slot >= 0) {
        blk->waited[slot].stream = s;
        blk->waited[slot].live++;
    }
    spin_unlock(&blk->mu);
    return slot >= 0;
}

/* The wait itself. The default-stream handles name the stream of the current device, so the
 * block's device is made current around the call and the caller's restored. */
static int issue_wait(pl_block *blk, pl_stream *s)
{
    const pl_backend *b = blk->b;
    if (b->kind != PL_BACKEND_CUDA)
        return b->event_synchronize(blk->ready);
    int prev = -1;
    int switch_device = s == (pl_stream *)(uintptr_t)1 || s == (pl_stream *)(uintptr_t)2;
    if (switch_device) {
        int rc = b->get_device(&prev);
        if (rc != PL_OK)
            return rc;
        if (prev != blk->device && (rc = b->set_device(blk->device)) != PL_OK)
            return rc;
    }
    int rc = b->stream_wait_event(s, blk->ready);
    if (switch_device && prev != blk->device)
        b->set_device(prev);
    return rc;
}

int pl_block_consumer_wait(pl_block *blk, pl_stream *s, int *memo)
{
    if (memo)
        *memo = 0;
    if (pl_inherited(blk->gen))
        return PL_ERR_FORKED; /* the copy belongs to the parent: never wait for it here */
    int rc = issue_wait(blk, s);
    if (rc != PL_OK)
        return rc;
    atomic_fetch_add_explicit(&consumer_waits[blk->b->kind], 1, memory_order_relaxed);
    if (memo && memoizable(blk, s))
        *memo = memo_insert(blk, s);
    return PL_OK;
}

int pl_block_consumer_wait_blocks(pl_block *blk)
{
    if (blk->b->kind == PL_BACKEND_CUDA || pl_inherited(blk->gen))
        return 0;
    return blk->b->event_query(blk->ready) != PL_OK;
}

int pl_block_consumer_done(pl_block *blk, pl_stream *s)
{
    if (pl_inherited(blk->gen))
        return 1;
    int last = 1;
    spin_lock(&blk->mu);
    for (int i = 0; i < PL_BLOCK_WAIT_MEMO; i++)
        if (blk->waited[i].live > 0 && blk->waited[i].stream == s) {
            last = --blk->waited[i].live == 0;
            break;
        }
    spin_unlock(&blk->mu);
    return last;
}

void pl_block_consumer_counters(pl_backend_kind kind, unsigned long long *waits,
                                unsigned long long *skipped)
{
    *waits = atomic_load(&consumer_waits[kind]);
    *skipped = atomic_load(&consumer_skipped[kind]);
}

static void block_free(pl_block *blk)
{
    const pl_backend *b = blk->b;
    if (pl_inherited(blk->gen)) {
        free(blk->uses);
        free(blk); /* the parent's memory and events: leak them */
        return;
    }
    const int mode = pl_captures_relax(b); /* Note [releases during a capture] in backend.h */
    int prev = -1;
    int have_prev = b->get_device(&prev) == PL_OK;
    b->set_device(blk->device);
    if (blk->ptr && blk->leak) {
        atomic_fetch_sub(&live_bytes[b->kind], blk->size); /* see pl_block_note_use */
    } else if (blk->ptr) {
        pl_stream *rs = NULL;
        int rc = release_stream(b, blk->device, &rs);
        if (rc == PL_OK)
            rc = b->stream_wait_event(rs, blk->ready);
        for (int i = 0; rc == PL_OK && i < blk->n_uses; i++)
            rc = b->stream_wait_event(rs, blk->uses[i].event);
        if (rc == PL_OK)
            rc = defer_free(b, blk->device, blk->ptr, rs); /* Note [deferred frees] */
        /* On failure (the runtime is unloading at exit) the memory is leaked, not freed early. */
        atomic_fetch_sub(&live_bytes[b->kind], blk->size);
    }
    /* Events may be recycled once the waits above are queued: a wait captures the event's
     * state at the time of the call. */
    for (int i = 0; i < blk->n_uses; i++)
        pl_device_event_give(b, blk->device, blk->uses[i].event);
    pl_device_event_give(b, blk->device, blk->ready);
    if (have_prev && prev != blk->device)
        b->set_device(prev);
    pl_captures_restore(b, mode);
    atomic_fetch_sub(&live_count[b->kind], 1);
    free(blk->uses);
    free(blk);
}

void pl_block_decref(pl_block *blk)
{
    if (blk && atomic_fetch_sub_explicit(&blk->refcount, 1, memory_order_acq_rel) == 1)
        block_free(blk);
}

size_t pl_block_live_bytes(const pl_backend *b)
{
    return atomic_load(&live_bytes[b->kind]);
}

long pl_block_live_count(const pl_backend *b)
{
    return atomic_load(&live_count[b->kind]);
}
