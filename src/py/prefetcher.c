/* AsyncPrefetcher: a native producer thread that pulls items from any Python iterable, reads
 * them with flatten.c, copies each batch to one device block with transfer.c, and hands the
 * batches out in order as DeviceArrays. This file holds the producer loop, epochs, the consumer
 * handoff and the object's lifecycle.
 *
 * Note [producer and the GIL]
 * The producer takes the GIL only to call next() on the source, read the item and build the
 * output structure (flatten.c). Everything else (the pinned reservation, staging, device
 * allocation, copies, event records: transfer.c) runs without it. Objects it must drop (source
 * arrays, capsules) go to a graveyard that it empties the next time it holds the GIL; sources
 * copied directly by DMA (already pinned) stay there until the batch's ready event has
 * completed.
 *
 * Note [epochs]
 * iter(prefetcher) starts a new epoch: a fresh iterator over the source, tagged with a new epoch
 * number. The iterator and its epoch are read and written only under the GIL, together, so a
 * batch always carries the epoch of the iterator it came from; the consumer drops batches of an
 * older epoch. An epoch that has not handed out anything yet is reused rather than restarted,
 * so the eager first epoch started by the constructor is not wasted by the `for` loop's iter().
 * A one-shot source (a generator) gives itself back from iter(): iterating it again after its
 * end warns (RuntimeWarning) instead of silently yielding nothing.
 *
 * Note [prefetcher lifecycle]
 * `state` (GIL-protected) is the one lifecycle variable:
 *   PF_OPEN        an epoch is being consumed.
 *   PF_EPOCH_DONE  the consumer took the end of the epoch; iter() starts the next one.
 *   PF_FAILED      the consumer raised a batch's error; finished for good (StopIteration).
 *   PF_CLOSED      close() ran (or tp_clear, or dealloc); the pipeline is freed.
 *   PF_DETACHED    close() ran while the producer was inside user code that does not return
 *                  (see Note [stuck producers]): the producer, when it comes back, frees the
 *                  pipeline, moves to PF_CLOSED and drops the reference close() gave it.
 *   PF_ORPHANED    the object's last reference went while the producer was still inside user
 *                  code: the producer frees the pipeline and then the object itself.
 * OPEN <-> EPOCH_DONE; OPEN -> FAILED; OPEN, EPOCH_DONE, FAILED -> CLOSED, DETACHED or
 * ORPHANED; DETACHED -> CLOSED. The pipeline is freed exactly once: by close() when it joined
 * the producer, or by the producer on a DETACHED or ORPHANED object.
 * `producer_in_user` (GIL-protected) is not a lifecycle state but the producer's position: set
 * while the producer holds the GIL for an item (next(), flatten's user code, finalizers of
 * dropped objects), which is where it can block for ever in code pinloader does not control.
 * `gen` is the process generation the object was made in (Note [fork generations] in util.h):
 * an inherited object fails fast and touches neither its mutex, its threads nor its memory.
 *
 * Locking: `mu` guards the queue, the flow-control counters and the stats; it is never held
 * while taking the GIL, and the consumer releases the GIL before waiting on it. `stop` is an
 * atomic written under mu (so condition waits see it) and read anywhere, including by
 * pl_pool_reserve without mu. */
#include "prefetcher.h"

#include "pinned.h"

#include "block.h"
#include "cpus.h"
#include "flatten.h"
#include "handout.h"
#include "pool.h"
#include "stager.h"
#include "transfer.h"
#include "util.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <structmember.h>

#define WAIT_SAMPLES 4096

/* ---- batches ---- */

typedef enum { B_READY, B_END, B_ERROR } batch_kind;

typedef struct batch {
    struct batch *next;
    batch_kind kind;
    uint64_t epoch;
    uint64_t index;       /* position in the epoch */
    PyObject *output;     /* B_READY: the structure of DeviceArrays, or with a handout (Note
                           * [handout] in handout.h) the tuple of the batch's DeviceArrays */
    pl_tree tree;         /* with a handout: the item's structure, built when handed out */
    PyObject *exc;        /* B_ERROR with a Python exception (source or bad leaf) */
    int err_code;         /* B_ERROR from the backend */
    char err_what[320];
    pl_block *blk;        /* the batch's reference */
    size_t bytes;         /* payload */
    size_t padding;       /* alignment padding in the device block */
} batch;

typedef struct grave {
    struct grave *next;
    PyObject **objs;
    Py_ssize_t n;
    pl_block *blk; /* non-NULL: keep objs until blk's ready event completes */
} grave;

typedef enum { PF_OPEN, PF_EPOCH_DONE, PF_FAILED, PF_CLOSED, PF_DETACHED, PF_ORPHANED } pf_state;

struct pl_prefetcher_obj {
    PyObject_HEAD
    PyObject *weakreflist;
    pl_prefetcher_obj *live_prev, *live_next; /* GIL */
    pl_state *st;
    uint32_t gen; /* see Note [prefetcher lifecycle] */

    /* configuration: set in tp_new, read-only afterwards (the pipeline pointers are cleared
     * once, under the GIL, when the pipeline is freed) */
    PyObject *source;
    PyObject *pool_obj;
    pl_pool *pool;         /* the default pool of the device, the given one, or a private one */
    pl_pool_client *client; /* this prefetcher's bound within pool (Note [pinned bound]) */
    int own_pool;          /* a private pool: max_pinned_bytes above the shared cap */
    int cap_follows;       /* no max_pinned_bytes and no pool: the bound follows the batches */
    const char *bound;     /* what sets the bound, for PoolExhausted messages */
    size_t max_pinned;
    const pl_backend *b;
    int device;
    int depth;
    pl_handout handout;    /* output, convert, stream, static (Note [handout] in handout.h) */
    pl_tree templ;         /* structure=: the items' structure, captured once (n_nodes 0: none) */
    pl_stager *stager;
    pl_stream *copy_stream;
    pthread_t thread;
    int thread_started;
    PyInterpreterState *interp; /* the producer's thread state belongs to it */

    /* GIL-protected */
    pf_state state;
    int producer_in_user;
    pl_block *last_direct; /* producer only: the last batch copied straight from the source */
    PyObject *it;
    uint64_t it_epoch;
    uint64_t consumer_epoch;
    uint64_t consumed_in_epoch;
    grave *graves;

    atomic_int gil_wanted; /* the producer is waiting for the GIL (see Note [GIL handoff]) */
    atomic_int stop;       /* written under mu */

    /* mu-protected */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    batch *head, *tail;
    int queued;
    uint64_t requested_epoch;
    uint64_t finished_epoch;
    /* stats */
    uint64_t n_batches;
    uint64_t n_bytes;
    uint64_t n_padding;
    int64_t first_batch_ns, last_batch_ns;
    int64_t next_ns, staging_ns, copy_issue_ns;
    int64_t wait_ns_total;
    uint64_t n_waits;
    double wait_samples[WAIT_SAMPLES];
    size_t device_peak;
    int64_t stall_ns;
    uint64_t stalls;
};

static int pf_is_closed(const pl_prefetcher_obj *self)
{
    return self->state >= PF_CLOSED;
}

/* ---- graveyard (GIL held) ---- */

static void bury(pl_prefetcher_obj *self, PyObject **objs, Py_ssize_t n, pl_block *blk)
{
    if (n == 0) {
        PyMem_RawFree(objs);
        return;
    }
    grave *g = PyMem_Malloc(sizeof(*g));
    if (!g) {
        /* Cannot defer: wait for the copy (if any) and drop now. */
        if (blk) {
            Py_BEGIN_ALLOW_THREADS
            pl_block_sync_ready(blk);
            Py_END_ALLOW_THREADS
        }
        for (Py_ssize_t i = 0; i < n; i++)
            Py_DECREF(objs[i]);
        PyMem_RawFree(objs);
        return;
    }
    if (blk)
        pl_block_incref(blk);
    *g = (grave){self->graves, objs, n, blk};
    self->graves = g;
}

/* Note [emptying graves]
 * Dropping a source object runs its finalizers, which may release the GIL (a __del__ that
 * sleeps, a deleter that takes a lock) and let the producer and a consumer both enter here. So
 * the list is detached from the object first: each caller walks only the graves it took, and
 * what is not ready yet is put back in front of whatever was buried meanwhile. */
static void empty_graves(pl_prefetcher_obj *self, int wait)
{
    grave *list = self->graves, *keep = NULL, **keep_tail = &keep;
    self->graves = NULL;
    while (list) {
        grave *g = list;
        list = g->next;
        if (g->blk && !wait && g->blk->b->event_query(g->blk->ready) == PL_ERR_NOT_READY) {
            g->next = NULL;
            *keep_tail = g;
            keep_tail = &g->next;
            continue;
        }
        if (g->blk && wait) {
            Py_BEGIN_ALLOW_THREADS
            pl_block_sync_ready(g->blk);
            Py_END_ALLOW_THREADS
        }
        for (Py_ssize_t i = 0; i < g->n; i++)
            Py_DECREF(g->objs[i]);
        PyMem_RawFree(g->objs);
        if (g->blk)
            pl_block_decref(g->blk);
        PyMem_Free(g);
    }
    *keep_tail = self->graves;
    self->graves = keep;
}

/* ---- queue ---- */

static void push_batch(pl_prefetcher_obj *self, batch *bt)
{
    pthread_mutex_lock(&self->mu);
    bt->next = NULL;
    if (self->tail)
        self->tail->next = bt;
    else
        self->head = bt;
    self->tail = bt;
    self->queued++;
    if (bt->kind != B_READY)
        self->finished_epoch = bt->epoch;
    if (bt->kind == B_READY) {
        int64_t now = pl_now_ns();
        if (!self->first_batch_ns)
            self->first_batch_ns = now;
        self->last_batch_ns = now;
        self->n_batches++;
        self->n_bytes += bt->bytes;
        self->n_padding += bt->padding;
        size_t live = pl_block_live_bytes(self->b);
        if (live > self->device_peak)
            self->device_peak = live;
    }
    pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
}

static void batch_free(batch *bt)
{
    pl_tree_clear(&bt->tree);
    Py_XDECREF(bt->output);
    Py_XDECREF(bt->exc);
    if (bt->blk)
        pl_block_decref(bt->blk);
    PyMem_RawFree(bt);
}

static void fail_batch(batch *bt, int code, const char *what)
{
    bt->kind = B_ERROR;
    bt->err_code = code;
    snprintf(bt->err_what, sizeof bt->err_what, "item %llu: %s", (unsigned long long)bt->index, what);
}

static void add_source_note(PyObject *exc, uint64_t index)
{
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *note = PyUnicode_FromFormat("raised by the source at item %llu of the epoch "
                                          "(pinloader producer thread)", (unsigned long long)index);
    if (note) {
        PyObject *r = PyObject_CallMethod(exc, "add_note", "O", note);
        Py_XDECREF(r);
        Py_DECREF(note);
    }
    PyErr_Clear();
#else
    (void)exc;
    (void)index;
#endif
}

static PyObject *fetch_exception(void)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value && tb)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

/* ---- the producer thread ---- */

/* What the producer carries from one batch to the next. */
typedef struct producer {
    uint64_t index, last_epoch;
    pl_flat flat;
    /* The previous batch's source objects, dropped at the next GIL acquisition (one per batch,
     * see Note [GIL handoff]); with prev_blk, kept until its copy is done. */
    PyObject **prev_owners;
    Py_ssize_t prev_n;
    pl_block *prev_blk;
    /* See Note [producer thread state]. */
    PyThreadState *ts;
    int ts_failed;           /* PyThreadState_New failed: PyGILState per hold instead */
    PyGILState_STATE gstate; /* only then */
} producer;

/* Wait (no GIL) until there is room and work; returns 0 to go on, -1 to exit. */
static int producer_wait(pl_prefetcher_obj *self)
{
    pthread_mutex_lock(&self->mu);
    while (!atomic_load(&self->stop) &&
           (self->queued >= self->depth || self->finished_epoch == self->requested_epoch))
        pthread_cond_wait(&self->cv, &self->mu);
    pthread_mutex_unlock(&self->mu);
    return atomic_load(&self->stop) ? -1 : 0;
}

/* Note [sources reusing buffers]
 * Pageable leaves are staged before the source is asked for its next item, so a source may
 * reuse or refill an array as soon as next() is called again. Leaves copied straight from
 * pinned memory are read by the DMA engine later; to keep the same guarantee the producer
 * waits for that batch's copy before calling next() again. */
static void wait_direct_copy(pl_prefetcher_obj *self)
{
    if (self->last_direct) {
        pl_block_sync_ready(self->last_direct);
        pl_block_decref(self->last_direct);
        self->last_direct = NULL;
    }
}

/* Note [GIL handoff]
 * The producer needs the GIL once per batch (next() on the source, reading the leaves). A
 * consumer loop that never blocks would make it wait for CPython's switch interval (5 ms) each
 * time. Instead the producer says it is waiting, and the consumer's __next__, which runs once
 * per step anyway, lends it the GIL right there. */
/* Note [producer thread state]
 * The producer keeps one Python thread state for its whole life instead of making and deleting
 * one per batch (PyGILState_Ensure / Release on a thread with no state): made on its first GIL
 * hold with PyThreadState_New (which also makes it this thread's PyGILState state, so C code the
 * source calls that uses PyGILState_Ensure finds it), swapped in and out with
 * PyEval_RestoreThread / PyEval_SaveThread around each hold, and cleared and deleted with the GIL
 * held when the producer ends (producer_exit). Besides the work saved per batch, a fork() never
 * catches the interpreter's list of thread states in the middle of a producer's churn. The
 * producer takes the GIL only after checking pl_py_finalizing(); once finalization has started
 * it takes nothing and leaves its state to the interpreter, which deletes every thread state as
 * it finalizes. If the state cannot be made (out of memory), each hold falls back to
 * PyGILState_Ensure / Release. */
static void producer_take_gil(pl_prefetcher_obj *self, producer *p)
{
    atomic_store(&self->gil_wanted, 1);
    if (!p->ts && !p->ts_failed && !(p->ts = PyThreadState_New(self->interp)))
        p->ts_failed = 1;
    if (p->ts)
        PyEval_RestoreThread(p->ts);
    else
        p->gstate = PyGILState_Ensure();
    atomic_store(&self->gil_wanted, 0);
}

static void producer_give_gil(producer *p)
{
    if (p->ts)
        PyEval_SaveThread();
    else
        PyGILState_Release(p->gstate);
}

/* The producer's last hold ends: its thread state goes with it (GIL held; releases it). */
static void producer_give_gil_for_good(producer *p)
{
    if (p->ts) {
        PyThreadState_Clear(p->ts);
        PyThreadState_DeleteCurrent();
        p->ts = NULL;
    } else {
        PyGILState_Release(p->gstate);
    }
}

static void lend_gil_to_producer(pl_prefetcher_obj *self)
{
    if (!atomic_load(&self->gil_wanted))
        return;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < 2000 && atomic_load(&self->gil_wanted); i++)
        sched_yield();
    Py_END_ALLOW_THREADS
}

/* GIL held: the previous batch's owners go to the graveyard. */
static void release_previous(pl_prefetcher_obj *self, producer *p)
{
    bury(self, p->prev_owners, p->prev_n, p->prev_blk);
    if (p->prev_blk)
        pl_block_decref(p->prev_blk);
    p->prev_owners = NULL;
    p->prev_n = 0;
    p->prev_blk = NULL;
}

/* GIL held: next() on the source, then flatten the item into bt. Returns 0 with bt filled (as
 * B_READY with an output, or B_END / B_ERROR), or -1 when close() came meanwhile. */
static int read_item(pl_prefetcher_obj *self, producer *p, batch *bt, int64_t *t_next)
{
    PyObject *it = Py_XNewRef(self->it);
    int64_t t0 = pl_now_ns();
    PyObject *item = it ? PyIter_Next(it) : NULL;
    *t_next = pl_now_ns() - t0;
    Py_XDECREF(it);
    if (atomic_load(&self->stop)) {
        /* closed while the source was running: what it gave is not wanted */
        Py_XDECREF(item);
        PyErr_Clear();
        return -1;
    }
    if (!item) {
        if (PyErr_Occurred()) {
            bt->kind = B_ERROR;
            bt->exc = fetch_exception();
            add_source_note(bt->exc, bt->index);
        } else {
            bt->kind = B_END;
        }
        return 0;
    }
    int rc = pl_block_create(self->b, self->device, &bt->blk);
    if (rc != PL_OK) {
        Py_DECREF(item);
        fail_batch(bt, rc, "creating the batch's ready event");
        return 0;
    }
    pl_flat *f = &p->flat;
    pl_flat_init(f, self->st, self->b, self->device);
    /* see Note [flatten in two passes] in flatten.h */
    if (self->templ.n_nodes) {
        /* structure=: the item is a tuple of the leaves, placed in the captured structure */
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != self->templ.n_leaves)
            PyErr_Format(PyExc_TypeError, "AsyncPrefetcher(structure=...): each item must be a "
                         "tuple of the structure's %zd leaves, got %.100s", self->templ.n_leaves,
                         Py_TYPE(item)->tp_name);
        else if (pl_flat_walk(f, item) == 0) {
            pl_tree walked;
            pl_flat_take_tree(f, &walked);
            pl_tree_clear(&walked);
            if (f->n_leaves != self->templ.n_leaves)
                PyErr_Format(PyExc_TypeError, "AsyncPrefetcher(structure=...): %zd of the item's "
                             "%zd entries are array leaves", (Py_ssize_t)f->n_leaves,
                             self->templ.n_leaves);
            else if ((bt->output = pl_flat_device_arrays(f, bt->blk)) &&
                     !pl_handout_active(&self->handout))
                Py_SETREF(bt->output, pl_tree_build(&self->templ, bt->output));
        }
    } else if (pl_flat_walk(f, item) == 0) {
        if (pl_handout_active(&self->handout)) {
            bt->output = pl_flat_device_arrays(f, bt->blk);
            pl_flat_take_tree(f, &bt->tree);
        } else {
            bt->output = pl_flat_rebuild(f, bt->blk);
        }
    }
    Py_DECREF(item);
    if (!bt->output) {
        bt->kind = B_ERROR;
        bt->exc = fetch_exception();
        pl_flat_clear(f);
    } else {
        bt->kind = B_READY;
    }
    if (atomic_load(&self->stop)) {
        /* closed by user code the item ran (a __dlpack__, a constructor) */
        Py_CLEAR(bt->output);
        Py_CLEAR(bt->exc);
        pl_flat_clear(f);
        return -1;
    }
    return 0;
}

/* The GIL part of one round. Returns 1 with *out a batch to ship, 0 to try again, -1 to exit. */
static int pull_batch(pl_prefetcher_obj *self, producer *p, batch **out, int64_t *t_next)
{
    producer_take_gil(self, p);
    self->producer_in_user = 1;
    release_previous(self, p);
    int r = atomic_load(&self->stop) ? -1 : 1;
    if (r > 0)
        empty_graves(self, 0);
    batch *bt = r > 0 ? PyMem_RawCalloc(1, sizeof(*bt)) : NULL;
    if (r > 0 && !bt)
        r = 0;
    if (bt) {
        uint64_t epoch = self->it_epoch;
        if (epoch != p->last_epoch) {
            p->last_epoch = epoch;
            p->index = 0;
        }
        bt->epoch = epoch;
        bt->index = p->index++;
        if (read_item(self, p, bt, t_next) < 0) {
            batch_free(bt);
            bt = NULL;
            r = -1;
        }
    }
    self->producer_in_user = 0;
    producer_give_gil(p);
    if (r == 0)
        pl_sleep_ns(1000000); /* out of memory for the batch record: try again shortly */
    *out = bt;
    return r;
}

/* The no-GIL part: copy a read batch and queue it. */
static void ship_batch(pl_prefetcher_obj *self, producer *p, batch *bt, int64_t t_next)
{
    pl_flat *f = &p->flat;
    if (bt->kind == B_READY) {
        bt->bytes = f->layout.payload;
        bt->padding = pl_layout_bytes(&f->layout) - f->layout.payload;
        pl_xfer x = {self->b, self->device, self->pool, self->client, self->cap_follows,
                     self->bound, self->depth, self->stager, self->copy_stream, &self->stop};
        pl_xfer_times tm;
        char what[256];
        int rc = pl_transfer(&x, f->leaves, f->n_leaves, &f->layout, bt->blk, &tm, what, sizeof what);
        pthread_mutex_lock(&self->mu);
        self->next_ns += t_next;
        self->staging_ns += tm.staging_ns;
        self->copy_issue_ns += tm.issue_ns;
        self->stalls += (uint64_t)tm.stalled;
        self->stall_ns += tm.stall_ns;
        pthread_mutex_unlock(&self->mu);
        if (rc != PL_OK)
            fail_batch(bt, rc, what);
        /* The owners go to the graveyard at the next GIL acquisition; sources read by DMA or by
         * the device gather stay there until the copy is done. Only sources read by DMA make the
         * producer wait before next() (Note [sources reusing buffers]): a device-gathered
         * source is a RowGather's, which no source refills. */
        if (f->layout.direct && bt->kind == B_READY) {
            pl_block_incref(bt->blk);
            self->last_direct = bt->blk;
        }
        p->prev_owners = pl_flat_take_owners(f, &p->prev_n);
        if (f->layout.direct || f->layout.gathered) {
            pl_block_incref(bt->blk);
            p->prev_blk = bt->blk;
        }
        pl_flat_release_leaves(f);
    }
    push_batch(self, bt);
}

static void pf_free_resources(pl_prefetcher_obj *self);

/* A producer that close() left behind (stuck in user code) cleans up here. */
static void producer_exit(pl_prefetcher_obj *self, producer *p)
{
    wait_direct_copy(self);
    if (pl_py_finalizing())
        return; /* the interpreter is going away: touch nothing of it */
    producer_take_gil(self, p);
    release_previous(self, p);
    if (self->state == PF_DETACHED || self->state == PF_ORPHANED) {
        pf_free_resources(self);
        if (self->state == PF_ORPHANED) {
            PyTypeObject *tp = Py_TYPE(self);
            pl_handout_clear(&self->handout);
            pl_tree_clear(&self->templ);
            pthread_mutex_destroy(&self->mu);
            pthread_cond_destroy(&self->cv);
            tp->tp_free((PyObject *)self);
            Py_DECREF(tp);
        } else {
            self->state = PF_CLOSED;
            Py_DECREF(self); /* the reference close() gave this thread */
        }
    }
    producer_give_gil_for_good(p);
}

static void *producer_main(void *arg)
{
    pl_prefetcher_obj *self = arg;
    producer p;
    memset(&p, 0, sizeof p);
    self->b->set_device(self->device);
    for (;;) {
        if (producer_wait(self) < 0)
            break;
        wait_direct_copy(self);
        if (pl_py_finalizing())
            return NULL; /* the interpreter is going away: touch nothing of it */
        batch *bt = NULL;
        int64_t t_next = 0;
        int r = pull_batch(self, &p, &bt, &t_next);
        if (r < 0)
            break;
        if (r > 0)
            ship_batch(self, &p, bt, t_next);
    }
    producer_exit(self, &p);
    return NULL;
}

/* ---- consumer side (GIL held) ---- */

/* Start the next epoch over `it`, a new iterator of the source (stolen). */
static void start_epoch(pl_prefetcher_obj *self, PyObject *it)
{
    Py_XSETREF(self->it, it);
    self->it_epoch++;
    self->consumer_epoch = self->it_epoch;
    self->consumed_in_epoch = 0;
    self->state = PF_OPEN;
    pthread_mutex_lock(&self->mu);
    self->requested_epoch = self->it_epoch;
    pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
}

static int check_inherited(pl_prefetcher_obj *self)
{
    if (pl_inherited(self->gen)) {
        PyErr_SetString(PyExc_RuntimeError, "this AsyncPrefetcher was created before fork(): it "
                        "cannot be used in the child process (its threads and CUDA state stay in "
                        "the parent); create a new one in the child, or start worker processes "
                        "with the 'spawn' method");
        return -1;
    }
    return 0;
}

static int check_usable(pl_prefetcher_obj *self)
{
    if (check_inherited(self) < 0)
        return -1;
    if (pf_is_closed(self)) {
        PyErr_SetString(PyExc_ValueError, "AsyncPrefetcher is closed");
        return -1;
    }
    return 0;
}

/* Note [re-entry from the producer]
 * The producer runs user code with the GIL: the source's next(), and what flatten calls for an
 * item (a __dlpack__, a namedtuple's or dataclass's constructor, a finalizer). That code may
 * reach this very prefetcher. next() there would wait for a batch that only the waiting thread
 * can make (for ever: signals are delivered to the main thread only, so not even Ctrl-C ends
 * it), and iter() would restart the epoch from inside it, so that each item starts a new
 * epoch. Both are refused with a RuntimeError, which reaches the consumer as that item's error.
 * What does not wait on the producer stays allowed there: stats(), and close(), which detaches
 * the producer (Note [stuck producers]). A DeviceArray of the batch being built refuses to be
 * exported (check_exportable in device_array.c). */
static int check_not_producer(pl_prefetcher_obj *self, const char *what, const char *why)
{
    if (self->thread_started && pthread_equal(self->thread, pthread_self())) {
        PyErr_Format(PyExc_RuntimeError, "AsyncPrefetcher: %s was called on the prefetcher's own "
                     "producer thread, by user code it runs for an item (the source's next(), a "
                     "__dlpack__, a container's constructor): %s", what, why);
        return -1;
    }
    return 0;
}

static PyObject *pf_iter(PyObject *op)
{
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    if (check_usable(self) < 0 || check_not_producer(self, "iter()", "it would restart the epoch "
                                                                  "being read") < 0)
        return NULL;
    if (self->state == PF_FAILED || (self->consumed_in_epoch == 0 && self->state == PF_OPEN))
        return Py_NewRef(op); /* finished for good, or the current epoch is still fresh */
    /* One iter() on the source per epoch: a DataLoader starts its workers in iter(), so the
     * iterator asked for here is the epoch's own. */
    PyObject *it = PyObject_GetIter(self->source);
    if (!it)
        return NULL;
    int same = it == self->it;
    if (same && self->state == PF_OPEN) {
        /* A one-shot iterator (a generator): iter() gives the same object, so this is the same
         * stream of items; keep what is already prefetched rather than dropping it. */
        Py_DECREF(it);
        return Py_NewRef(op);
    }
    if (same && PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                                 "AsyncPrefetcher: the source (%.100s) is a one-shot iterator that "
                                 "is already exhausted, so this new epoch yields nothing; pass a "
                                 "re-iterable source (a list, a Dataset or DataLoader) to iterate "
                                 "more than once", Py_TYPE(self->source)->tp_name) < 0) {
        Py_DECREF(it);
        return NULL;
    }
    start_epoch(self, it);
    return Py_NewRef(op);
}

static PyObject *raise_batch_error(pl_prefetcher_obj *self, batch *bt)
{
    if (bt->exc) {
        PyObject *exc = bt->exc;
        bt->exc = NULL;
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
        return NULL;
    }
    if (bt->err_code == PL_ERR_OVER_CAP) {
        PyErr_SetString(self->st->PoolExhausted, bt->err_what);
        return NULL;
    }
    if (bt->err_code == PL_ERR_INVALID_VALUE && strstr(bt->err_what, "PinnedPool was closed")) {
        PyErr_SetString(PyExc_ValueError, bt->err_what);
        return NULL;
    }
    return pl_raise_backend(self->st, self->b, bt->err_code, bt->err_what);
}

/* Take the next batch of the current epoch, waiting (GIL released, interruptible) until there
 * is one. Returns NULL with an exception, or NULL with none when the epoch is over. */
static batch *take_batch(pl_prefetcher_obj *self, int *waited)
{
    for (;;) {
        pthread_mutex_lock(&self->mu);
        batch *bt = self->head;
        if (bt) {
            self->head = bt->next;
            if (!self->head)
                self->tail = NULL;
            self->queued--;
            pthread_cond_broadcast(&self->cv);
        }
        pthread_mutex_unlock(&self->mu);
        if (bt) {
            if (bt->epoch == self->consumer_epoch)
                return bt;
            batch_free(bt); /* from an abandoned epoch */
            continue;
        }
        if (self->state != PF_OPEN) {
            /* another thread closed it, or took the end of the epoch */
            if (pf_is_closed(self))
                PyErr_SetString(PyExc_ValueError, "AsyncPrefetcher was closed while waiting for a batch");
            return NULL;
        }
        *waited = 1;
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&self->mu);
        if (!self->head) {
            struct timespec ts;
            pl_deadline(&ts, PL_SIGNAL_SLICE_NS);
            pthread_cond_timedwait(&self->cv, &self->mu, &ts);
        }
        pthread_mutex_unlock(&self->mu);
        Py_END_ALLOW_THREADS
        if (PyErr_CheckSignals() < 0)
            return NULL;
    }
}

static PyObject *pf_next(PyObject *op)
{
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    if (check_usable(self) < 0 || check_not_producer(self, "next()", "it would wait for a batch "
                                                                  "only this thread can make") < 0)
        return NULL;
    if (self->state != PF_OPEN)
        return NULL; /* StopIteration */
    lend_gil_to_producer(self);
    empty_graves(self, 0);
    int64_t t0 = pl_now_ns();
    int waited = 0;
    batch *bt = take_batch(self, &waited);
    if (!bt)
        return NULL;
    int64_t wait = waited ? pl_now_ns() - t0 : 0;
    pthread_mutex_lock(&self->mu);
    self->wait_samples[self->n_waits % WAIT_SAMPLES] = (double)wait / 1e6;
    self->n_waits++;
    self->wait_ns_total += wait;
    pthread_mutex_unlock(&self->mu);

    if (bt->kind == B_END) {
        self->state = PF_EPOCH_DONE;
        batch_free(bt);
        return NULL;
    }
    if (bt->kind == B_ERROR) {
        self->state = PF_FAILED;
        raise_batch_error(self, bt);
        batch_free(bt);
        return NULL;
    }
    self->consumed_in_epoch++;
    PyObject *out = bt->output;
    bt->output = NULL;
    if (pl_handout_active(&self->handout)) {
        PyObject *leaves = out;
        const pl_tree *tree = self->templ.n_nodes ? &self->templ : &bt->tree;
        out = pl_handout_batch(self->st, self->b, self->device, &self->handout, tree, leaves);
        Py_DECREF(leaves);
    }
    batch_free(bt);
    return out;
}

/* ---- lifecycle (see Note [prefetcher lifecycle]) ---- */

static void live_unlink(pl_prefetcher_obj *self)
{
    pl_state *st = self->st;
    if (!st)
        return;
    if (self->live_prev)
        self->live_prev->live_next = self->live_next;
    else if (st->live == self)
        st->live = self->live_next;
    if (self->live_next)
        self->live_next->live_prev = self->live_prev;
    self->live_prev = self->live_next = NULL;
}

/* Make `device` current on the calling (user's) thread for a moment, and put back what was
 * current before: pinloader must not change the device the user's framework works on. */
static int device_push(const pl_backend *b, int device, int *prev)
{
    if (b->get_device(prev) != PL_OK)
        *prev = -1;
    return *prev == device ? PL_OK : b->set_device(device);
}

static void device_pop(const pl_backend *b, int device, int prev)
{
    if (prev >= 0 && prev != device)
        b->set_device(prev);
}

/* Free the pipeline (GIL held; the producer has exited or is this thread). Called once. */
static void pf_free_resources(pl_prefetcher_obj *self)
{
    if (pl_inherited(self->gen)) {
        /* The parent's threads, streams and memory: touch none of it, drop only Python refs. */
        self->head = self->tail = NULL;
        self->graves = NULL;
        self->stager = NULL;
        self->copy_stream = NULL;
        self->pool = NULL;
        self->client = NULL;
        Py_CLEAR(self->it);
        return;
    }
    int prev_device = -1;
    device_push(self->b, self->device, &prev_device);
    if (self->copy_stream) {
        pl_stream *stream = self->copy_stream;
        const pl_backend *b = self->b;
        Py_BEGIN_ALLOW_THREADS
        b->stream_synchronize(stream);
        Py_END_ALLOW_THREADS
    }
    pthread_mutex_lock(&self->mu);
    batch *bt = self->head;
    self->head = self->tail = NULL;
    self->queued = 0;
    pthread_mutex_unlock(&self->mu);
    while (bt) {
        batch *next = bt->next;
        batch_free(bt);
        bt = next;
    }
    empty_graves(self, 1);
    Py_CLEAR(self->it);
    pl_handout_drop_static(&self->handout);
    pl_stager *stager = self->stager;
    pl_stream *stream = self->copy_stream;
    pl_pool *pool = self->pool;
    pl_pool_client *client = self->client;
    int own = self->own_pool;
    self->stager = NULL; /* before the GIL is released: other threads may read them */
    self->copy_stream = NULL;
    self->pool = NULL;
    self->client = NULL;
    const pl_backend *b = self->b;
    Py_BEGIN_ALLOW_THREADS
    if (stager)
        pl_stager_destroy(stager);
    if (stream)
        b->stream_destroy(stream);
    /* The producer is gone (or is this thread, past its last reserve): the client can go. Its
     * regions still pending come back to the pool later; a default or shared pool stays open. */
    if (pool && client)
        pl_pool_client_close(pool, client);
    if (pool && own)
        pl_pool_close(pool);
    if (pool)
        pl_pool_decref(pool);
    Py_END_ALLOW_THREADS
    device_pop(self->b, self->device, prev_device);
}

/* Stop the producer. Returns 1 if it was joined (or never ran here), 0 if it is inside user code
 * and was left to clean up after itself (see Note [stuck producers]). */
static int stop_producer(pl_prefetcher_obj *self)
{
    if (pl_inherited(self->gen)) {
        /* The producer does not exist in this process, and the parent's threads may have held
         * our mutex at fork time: touch none of them. */
        self->thread_started = 0;
        return 1;
    }
    pthread_mutex_lock(&self->mu);
    atomic_store(&self->stop, 1);
    pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
    if (!self->thread_started)
        return 1;
    /* Note [stuck producers]
     * User code can block for ever: a source's next() (a hung reader, a dead worker), but also
     * what flatten runs for an item (a __dlpack__, a dataclass __init__, a finalizer). close()
     * gives a producer inside user code a moment, then detaches it instead of joining it: the
     * producer sees `stop` whenever that code returns, frees the pipeline and drops its
     * reference. */
    int on_producer = pthread_equal(self->thread, pthread_self());
    for (int i = 0; i < 20 && self->producer_in_user && !on_producer; i++) {
        Py_BEGIN_ALLOW_THREADS
        pl_sleep_ns(10 * 1000 * 1000);
        Py_END_ALLOW_THREADS
    }
    self->thread_started = 0;
    /* Closed (or collected) on the producer thread itself, from code the producer ran (a leaf's
     * __dlpack__, a __del__, the cycle collector): it cannot join itself; it finishes the
     * current item, sees stop and cleans up as a detached producer. */
    if (self->producer_in_user || on_producer) {
        pthread_detach(self->thread);
        return 0;
    }
    /* The producer may be waiting for the GIL: let it have it, see stop, and leave. */
    Py_BEGIN_ALLOW_THREADS
    pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS
    return 1;
}

static void pf_close_impl(pl_prefetcher_obj *self)
{
    if (pf_is_closed(self))
        return;
    self->state = PF_CLOSED; /* no other caller gets past the check above from here on */
    live_unlink(self);
    if (stop_producer(self)) {
        pf_free_resources(self);
    } else {
        self->state = PF_DETACHED;
        Py_INCREF(self); /* the detached producer's reference */
    }
}

void pl_prefetcher_shutdown_all(pl_state *st)
{
    while (st->live) {
        pl_prefetcher_obj *pf = st->live;
        Py_INCREF(pf);
        pf_close_impl(pf);
        Py_DECREF(pf);
    }
}

static PyObject *pf_close(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    pf_close_impl((pl_prefetcher_obj *)op);
    Py_RETURN_NONE;
}

/* Note [prefetcher and the cycle collector]
 * Everything the prefetcher holds that can lead back to it is visited: the source, its
 * iterator, the pool object, the capsule stream, the queued batches' outputs and exceptions,
 * and the graveyard. Objects the producer holds on its own stack between two GIL acquisitions
 * are not visited; they only make the collector more conservative. tp_clear closes the
 * prefetcher (joining the producer and freeing the pipeline, the queue and the graveyard with
 * it) and drops the remaining references. */
static int pf_traverse(PyObject *op, visitproc visit, void *arg)
{
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(self->source);
    Py_VISIT(self->pool_obj);
    Py_VISIT(self->it);
    int vr = pl_handout_traverse(&self->handout, visit, arg);
    if (!vr)
        vr = pl_tree_traverse(&self->templ, visit, arg);
    if (vr)
        return vr;
    for (grave *g = self->graves; g; g = g->next)
        for (Py_ssize_t i = 0; i < g->n; i++)
            Py_VISIT(g->objs[i]);
    if (!self->st || pl_inherited(self->gen))
        return 0; /* never initialised, or the mutex belongs to the parent */
    int r = 0;
    pthread_mutex_lock(&self->mu);
    for (batch *bt = self->head; bt && !r; bt = bt->next) {
        if (bt->output)
            r = visit(bt->output, arg);
        if (!r)
            r = pl_tree_traverse(&bt->tree, visit, arg);
        if (!r && bt->exc)
            r = visit(bt->exc, arg);
    }
    pthread_mutex_unlock(&self->mu);
    return r;
}

static int pf_clear(PyObject *op)
{
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    if (self->st)
        pf_close_impl(self);
    Py_CLEAR(self->source);
    Py_CLEAR(self->pool_obj);
    pl_handout_clear(&self->handout);
    pl_tree_clear(&self->templ);
    return 0;
}

static void pf_dealloc(PyObject *op)
{
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    if (self->weakreflist)
        PyObject_ClearWeakRefs(op);
    Py_CLEAR(self->source);
    Py_CLEAR(self->pool_obj);
    if (self->st) {
        if (!pf_is_closed(self)) {
            self->state = PF_CLOSED;
            live_unlink(self);
            if (!stop_producer(self)) {
                /* The producer is inside user code and still uses this object: it frees it
                 * when that code returns (see Note [stuck producers]). */
                self->state = PF_ORPHANED;
                return;
            }
            pf_free_resources(self);
        }
        if (!pl_inherited(self->gen)) {
            /* In a forked child the parent's producer may have been waiting on cv: destroying
             * it would wait for a thread that does not exist here. */
            pthread_mutex_destroy(&self->mu);
            pthread_cond_destroy(&self->cv);
        }
    }
    pl_handout_clear(&self->handout);
    pl_tree_clear(&self->templ);
    tp->tp_free(op);
    Py_DECREF(tp);
}

/* ---- construction ---- */

static int parse_positive(PyObject *o, const char *name, long lo, long hi, long *out)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name, Py_TYPE(o)->tp_name);
        }
        return -1;
    }
    if (v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "%s must be between %ld and %ld, got %ld", name, lo, hi, v);
        return -1;
    }
    *out = v;
    return 0;
}

typedef struct pf_options {
    PyObject *iterable, *device, *pool_obj, *stream, *convert, *out, *structure;
    long depth, threads;
    int high_priority, capsule, is_static;
    size_t max_pinned;
    pl_pool *shared; /* borrowed from pool_obj */
} pf_options;

/* The constructor's arguments, checked. Returns 0 or -1 with an exception. */
static int parse_options(pl_state *st, PyObject *args, PyObject *kwds, pf_options *o)
{
    static char *kwlist[] = {"iterable", "device", "depth", "pool", "max_pinned_bytes",
                             "staging_threads", "copy_stream_priority", "output", "stream",
                             "convert", "static", "out", "structure", NULL};
    PyObject *depth_obj = NULL, *max_pinned_obj = Py_None, *threads_obj = Py_None;
    const char *priority = "high", *output = "array";
    memset(o, 0, sizeof(*o));
    o->device = o->pool_obj = o->stream = o->convert = o->out = o->structure = Py_None;
    o->depth = 2;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OOOOOssO$OpOO:AsyncPrefetcher", kwlist, &o->iterable,
                                     &o->device, &depth_obj, &o->pool_obj, &max_pinned_obj,
                                     &threads_obj, &priority, &output, &o->stream, &o->convert,
                                     &o->is_static, &o->out, &o->structure))
        return -1;
    if (o->out == Py_None) {
        o->out = NULL;
    } else if (!PyList_Check(o->out) && !PyTuple_Check(o->out)) {
        PyErr_Format(PyExc_TypeError, "out must be a list or tuple of arrays (one per array leaf "
                     "of a batch, in walk order), not %.100s", Py_TYPE(o->out)->tp_name);
        return -1;
    } else {
        o->is_static = 1;
    }
    if (o->convert == Py_None)
        o->convert = NULL;
    else if (!PyCallable_Check(o->convert)) {
        PyErr_Format(PyExc_TypeError, "convert must be a callable or None, not %.100s",
                     Py_TYPE(o->convert)->tp_name);
        return -1;
    }
    if (o->stream != Py_None && !PyCallable_Check(o->stream) &&
        (!PyLong_Check(o->stream) || PyBool_Check(o->stream))) {
        PyErr_Format(PyExc_TypeError, "stream must be None, a DLPack stream handle (int) or a "
                     "callable returning one, not %.100s", Py_TYPE(o->stream)->tp_name);
        return -1;
    }
    if (depth_obj && parse_positive(depth_obj, "depth", 1, 64, &o->depth) < 0)
        return -1;
    if (threads_obj != Py_None && parse_positive(threads_obj, "staging_threads", 1, 256, &o->threads) < 0)
        return -1;
    if (strcmp(priority, "high") == 0)
        o->high_priority = 1;
    else if (strcmp(priority, "normal") != 0 && strcmp(priority, "low") != 0) {
        PyErr_Format(PyExc_ValueError, "copy_stream_priority must be 'high', 'normal' or 'low', "
                     "got '%s'", priority);
        return -1;
    }
    if (strcmp(output, "capsule") == 0)
        o->capsule = 1;
    else if (strcmp(output, "array") != 0) {
        PyErr_Format(PyExc_ValueError, "output must be 'array' or 'capsule', got '%s'", output);
        return -1;
    }
    if (max_pinned_obj != Py_None) {
        long long v = PyLong_AsLongLong(max_pinned_obj);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v <= 0) {
            PyErr_Format(PyExc_ValueError, "max_pinned_bytes must be > 0, got %lld", v);
            return -1;
        }
        o->max_pinned = (size_t)v;
    }
    if (o->pool_obj != Py_None) {
        if (!(o->shared = pl_pinned_pool_get(st, o->pool_obj))) {
            PyErr_Format(PyExc_TypeError, "pool must be a pinloader.PinnedPool, not %.100s",
                         Py_TYPE(o->pool_obj)->tp_name);
            return -1;
        }
        if (pl_pool_closed(o->shared)) {
            PyErr_SetString(PyExc_ValueError, "pool is closed");
            return -1;
        }
    }
    return 0;
}

/* The first iterator over the source, with a clear error for a non-iterable. */
static PyObject *first_iterator(PyObject *iterable)
{
    PyObject *probe = PyObject_GetIter(iterable);
    if (!probe && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "AsyncPrefetcher needs an iterable source, got %.100s",
                     Py_TYPE(iterable)->tp_name);
    }
    return probe;
}

/* Copy stream, pinned pool and stager. Returns 0 or -1 with an exception (self is then
 * released by the caller; dealloc frees what was made). */
static int setup_pipeline(pl_prefetcher_obj *self, const pf_options *o)
{
    const pl_backend *b = self->b;
    int rc, prev_device = -1, dev = self->device, high = o->high_priority;
    Py_BEGIN_ALLOW_THREADS
    rc = device_push(b, dev, &prev_device);
    if (rc == PL_OK)
        rc = b->stream_create(high, &self->copy_stream);
    device_pop(b, dev, prev_device);
    Py_END_ALLOW_THREADS
    if (rc != PL_OK) {
        pl_raise_backend(self->st, b, rc, "creating the copy stream");
        return -1;
    }
    /* The pool (see Note [default pool] in pool.c) and this prefetcher's client in it (Note
     * [pinned bound] in transfer.c). */
    size_t client_cap = o->max_pinned;
    if (o->shared) {
        pl_pool_incref(o->shared);
        self->pool = o->shared;
        self->pool_obj = Py_NewRef(o->pool_obj);
        self->bound = o->max_pinned ? "max_pinned_bytes" : "the pool's max_bytes";
    } else if (o->max_pinned > pl_pool_shared_cap()) {
        /* More than the default pool may hold, asked for explicitly: a pool of its own. */
        rc = pl_pool_create(b, dev, o->max_pinned, &self->pool);
        self->own_pool = 1;
        self->bound = "max_pinned_bytes";
        if (rc != PL_OK) {
            pl_raise_backend(self->st, b, rc, "creating the pinned pool");
            return -1;
        }
    } else {
        rc = pl_pool_default(b, dev, &self->pool);
        if (rc != PL_OK) {
            pl_raise_backend(self->st, b, rc, "the default pinned pool");
            return -1;
        }
        self->cap_follows = !o->max_pinned;
        self->bound = o->max_pinned ? "max_pinned_bytes" :
            "the prefetcher's default bound, at most pinloader.default_pool_cap(); pass "
            "max_pinned_bytes or a PinnedPool to allow more";
        if (self->cap_follows)
            client_cap = PL_MIN((size_t)1 << 20, pl_pool_cap(self->pool));
    }
    if ((rc = pl_pool_client_open(self->pool, client_cap, &self->client)) != PL_OK) {
        self->client = NULL;
        pl_raise_backend(self->st, b, rc, "opening the prefetcher's share of the pinned pool");
        return -1;
    }
    long threads = o->threads ? o->threads : pl_default_staging_threads(); /* see Note [staging threads] in cpus.c */
    if ((rc = pl_stager_create((int)threads, &self->stager)) != PL_OK) {
        pl_raise_backend(self->st, b, rc, "starting staging threads");
        return -1;
    }
    return 0;
}

/* Start the first epoch and the producer; link into the live list. */
static int start_producer(pl_prefetcher_obj *self, PyObject *probe)
{
    /* The first epoch starts now, so the first batch is in flight before the loop begins. */
    self->it = probe;
    self->it_epoch = 1;
    self->consumer_epoch = 1;
    self->requested_epoch = 1;
    if (pthread_create(&self->thread, NULL, producer_main, self) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "could not start the producer thread");
        return -1;
    }
    self->thread_started = 1;
    pl_state *st = self->st;
    self->live_next = st->live;
    if (st->live)
        st->live->live_prev = self;
    st->live = self;
    return 0;
}

/* structure=: the structure every item's leaves are placed in (see pl_flat_structure). */
static int capture_structure(pl_prefetcher_obj *self, PyObject *structure)
{
    pl_flat f;
    PyObject *found = NULL;
    pl_flat_init(&f, self->st, self->b, self->device);
    int rc = pl_flat_structure(&f, structure, "structure", &found, NULL);
    if (rc == 0) {
        pl_flat_take_tree(&f, &self->templ);
        self->templ.n_leaves = PyList_GET_SIZE(found);
        if (!self->templ.n_leaves) {
            PyErr_SetString(PyExc_ValueError, "AsyncPrefetcher: structure= holds no array leaf");
            rc = -1;
        }
    }
    Py_XDECREF(found);
    pl_flat_clear(&f);
    return rc;
}

static PyObject *pf_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    pl_state *st = pl_state_of_type(type);
    pf_options o;
    if (!st || parse_options(st, args, kwds, &o) < 0)
        return NULL;
    PyObject *probe = first_iterator(o.iterable);
    if (!probe)
        return NULL;
    const pl_backend *b;
    int dev;
    if (pl_resolve_device(st, o.device, &b, &dev) < 0) {
        Py_DECREF(probe);
        return NULL;
    }
    if (o.shared && pl_pool_backend(o.shared) != b) {
        Py_DECREF(probe);
        return PyErr_Format(PyExc_ValueError, "pool uses the %s backend but the prefetcher the %s "
                            "backend", pl_pool_backend(o.shared)->name, b->name);
    }
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)type->tp_alloc(type, 0);
    if (!self) {
        Py_DECREF(probe);
        return NULL;
    }
    if (pthread_mutex_init(&self->mu, NULL) != 0 || pl_cond_init(&self->cv) != 0) {
        Py_DECREF(probe);
        Py_DECREF(self); /* st is not set: dealloc touches neither */
        return PyErr_NoMemory();
    }
    self->st = st;
    self->gen = pl_generation();
    self->interp = PyInterpreterState_Get();
    self->source = Py_NewRef(o.iterable);
    self->b = b;
    self->device = dev;
    self->depth = (int)o.depth;
    self->handout = (pl_handout){o.capsule, Py_XNewRef(o.convert), Py_NewRef(o.stream),
                                 o.is_static, o.out ? PySequence_Tuple(o.out) : NULL, NULL, -1};
    if (o.out && !self->handout.out) {
        Py_DECREF(probe);
        Py_DECREF(self);
        return NULL;
    }
    if (o.structure != Py_None && capture_structure(self, o.structure) < 0) {
        Py_DECREF(probe);
        Py_DECREF(self);
        return NULL;
    }
    self->max_pinned = o.max_pinned;
    if (setup_pipeline(self, &o) < 0 || start_producer(self, probe) < 0) {
        if (!self->it)
            Py_DECREF(probe);
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static Py_ssize_t pf_len(PyObject *op)
{
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    Py_ssize_t n = PyObject_Size(self->source);
    if (n < 0 && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "the source (%.100s) has no len()", Py_TYPE(self->source)->tp_name);
    }
    return n;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double percentile(double *v, size_t n, double q)
{
    if (!n)
        return 0.0;
    qsort(v, n, sizeof(double), cmp_double);
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[PL_MIN(i, n - 1)];
}

static PyObject *pf_stats(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    if (check_inherited(self) < 0)
        return NULL;
    double samples[WAIT_SAMPLES];
    pthread_mutex_lock(&self->mu);
    size_t ns = (size_t)PL_MIN(self->n_waits, (uint64_t)WAIT_SAMPLES);
    memcpy(samples, self->wait_samples, ns * sizeof(double));
    uint64_t batches = self->n_batches, bytes = self->n_bytes, padding = self->n_padding, waits = self->n_waits, stalls = self->stalls;
    int64_t span = self->last_batch_ns - self->first_batch_ns;
    int64_t next_ns = self->next_ns, staging_ns = self->staging_ns, issue_ns = self->copy_issue_ns;
    int64_t wait_total = self->wait_ns_total, stall_ns = self->stall_ns;
    size_t dev_peak = self->device_peak;
    int queued = self->queued;
    pthread_mutex_unlock(&self->mu);
    /* This prefetcher's own numbers come from its client (Note [pinned bound]); the pool's,
     * shared with other prefetchers for the default pool, under pool_* keys. */
    pl_pool_stats ps;
    pl_pool_client_stats cs;
    memset(&ps, 0, sizeof ps);
    memset(&cs, 0, sizeof cs);
    if (self->pool) {
        pl_pool_get_stats(self->pool, &ps);
        if (self->client)
            pl_pool_client_get_stats(self->pool, self->client, &cs);
    }
    size_t cap = cs.cap ? PL_MIN(cs.cap, ps.max_bytes) : ps.max_bytes;
    double p99 = percentile(samples, ns, 0.99);
    double gbps = span > 0 && batches > 1 ? (double)bytes * (double)(batches - 1) / (double)batches / (double)span : 0.0;
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:n,s:n,s:n,s:n,s:n,s:K,s:d,s:i,s:s,"
        "s:n,s:n,s:n,s:n,s:K,s:K}",
        "batches", (unsigned long long)batches, "bytes", (unsigned long long)bytes,
        "padding_bytes", (unsigned long long)padding,
        "h2d_gbps", gbps, "wait_s_total", (double)wait_total / 1e9,
        "wait_ms_mean", waits ? (double)wait_total / 1e6 / (double)waits : 0.0, "wait_ms_p99", p99,
        "next_s_total", (double)next_ns / 1e9, "staging_s_total", (double)staging_ns / 1e9,
        "copy_issue_s_total", (double)issue_ns / 1e9,
        "pinned_bytes_in_use", (Py_ssize_t)cs.in_use, "pinned_bytes_reserved", (Py_ssize_t)cs.peak_in_use,
        "pinned_bytes_peak", (Py_ssize_t)cs.peak_in_use, "pinned_cap", (Py_ssize_t)cap,
        "device_bytes_peak", (Py_ssize_t)dev_peak,
        "pinned_stalls", (unsigned long long)stalls, "pinned_stall_s", (double)stall_ns / 1e9,
        "queued", queued, "backend", self->b->name,
        "pool_bytes_reserved", (Py_ssize_t)ps.reserved_bytes, "pool_bytes_in_use", (Py_ssize_t)ps.in_use_bytes,
        "pool_bytes_peak", (Py_ssize_t)ps.peak_reserved_bytes, "pool_cap", (Py_ssize_t)ps.max_bytes,
        "pool_slabs_created", (unsigned long long)ps.slabs_created,
        "pool_waits", (unsigned long long)ps.waits);
}

static PyObject *pf_enter(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    if (check_usable((pl_prefetcher_obj *)op) < 0)
        return NULL;
    return Py_NewRef(op);
}

static PyObject *pf_exit(PyObject *op, PyObject *args)
{
    (void)args;
    return pf_close(op, NULL);
}

static PyObject *pf_repr(PyObject *op)
{
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    if (pl_inherited(self->gen))
        return PyUnicode_FromString("<pinloader.AsyncPrefetcher inherited through fork(): unusable>");
    pthread_mutex_lock(&self->mu);
    unsigned long long batches = self->n_batches;
    int queued = self->queued;
    pthread_mutex_unlock(&self->mu);
    if (self->b->kind == PL_BACKEND_CUDA)
        return PyUnicode_FromFormat("<pinloader.AsyncPrefetcher device=cuda:%d depth=%d batches=%llu "
                                    "queued=%d%s>", self->device, self->depth, batches, queued,
                                    pf_is_closed(self) ? " closed" : "");
    return PyUnicode_FromFormat("<pinloader.AsyncPrefetcher device=cpu (host backend) depth=%d "
                                "batches=%llu queued=%d%s>", self->depth, batches, queued,
                                pf_is_closed(self) ? " closed" : "");
}

static PyObject *pf_get_device(PyObject *op, void *c)
{
    (void)c;
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    if (self->b->kind == PL_BACKEND_CUDA)
        return PyUnicode_FromFormat("cuda:%d", self->device);
    return PyUnicode_FromString("cpu");
}

static PyObject *pf_get_depth(PyObject *op, void *c)
{
    (void)c;
    return PyLong_FromLong(((pl_prefetcher_obj *)op)->depth);
}

static PyObject *pf_get_closed(PyObject *op, void *c)
{
    (void)c;
    return PyBool_FromLong(pf_is_closed((pl_prefetcher_obj *)op));
}

static PyObject *pf_get_source(PyObject *op, void *c)
{
    (void)c;
    return Py_NewRef(((pl_prefetcher_obj *)op)->source);
}

static PyObject *pf_get_staging_threads(PyObject *op, void *c)
{
    (void)c;
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    return PyLong_FromLong(self->stager ? pl_stager_threads(self->stager) : 0);
}

static PyMethodDef pf_methods[] = {
    {"close", pf_close, METH_NOARGS,
     "close($self, /)\n--\n\nStop the producer, join it, wait for queued copies, free what is not handed out. Idempotent."},
    {"stats", pf_stats, METH_NOARGS,
     "stats($self, /)\n--\n\nCounters: batches, bytes (payload), padding_bytes (alignment in device blocks), h2d_gbps (delivered), consumer wait (total, mean, p99),\n"
     "time in the source's next(), staging time, pinned and device bytes, stalls on the pinned cap."},
    {"__enter__", pf_enter, METH_NOARGS, NULL},
    {"__exit__", pf_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyObject *pf_get_valid_rows(PyObject *op, void *c)
{
    (void)c;
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    if (!self->handout.is_static || self->handout.valid_rows < 0)
        Py_RETURN_NONE;
    return PyLong_FromSsize_t(self->handout.valid_rows);
}

static PyObject *pf_get_static_arrays(PyObject *op, void *c)
{
    (void)c;
    return pl_handout_static_arrays(&((pl_prefetcher_obj *)op)->handout);
}

static PyGetSetDef pf_getset[] = {
    {"device", pf_get_device, NULL, "'cuda:N' or 'cpu'.", NULL},
    {"depth", pf_get_depth, NULL, "Batches in flight or waiting, at most.", NULL},
    {"closed", pf_get_closed, NULL, "Whether close() ran.", NULL},
    {"source", pf_get_source, NULL, "The source iterable.", NULL},
    {"staging_threads", pf_get_staging_threads, NULL, "Threads staging into pinned memory.", NULL},
    {"valid_rows", pf_get_valid_rows, NULL, "static=True: the real rows of the last batch handed "
     "out (the fewest over its leaves; the rest of each static buffer is zeros), else None.", NULL},
    {"static_arrays", pf_get_static_arrays, NULL, "static=True: the static buffers, a tuple of "
     "DeviceArrays in leaf order (None before the first batch, and after close()).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef pf_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(pl_prefetcher_obj, weakreflist), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot pf_slots[] = {
    {Py_tp_new, pf_new},
    {Py_tp_dealloc, pf_dealloc},
    {Py_tp_traverse, pf_traverse},
    {Py_tp_clear, pf_clear},
    {Py_tp_iter, pf_iter},
    {Py_tp_iternext, pf_next},
    {Py_tp_methods, pf_methods},
    {Py_tp_getset, pf_getset},
    {Py_tp_members, pf_members},
    {Py_tp_repr, pf_repr},
    {Py_mp_length, pf_len},
    {Py_tp_doc,
     "AsyncPrefetcher(iterable, device=None, depth=2, pool=None, max_pinned_bytes=None,\n"
     "                staging_threads=None, copy_stream_priority='high', output='array', stream=None)\n"
     "--\n\n"
     "Prefetch batches from any iterable to a device, off the GIL.\n\n"
     "Items may nest tuple, list, dict, namedtuple and dataclass; array leaves (NumPy arrays,\n"
     "CPU DLPack exporters, buffer-protocol objects) arrive as DeviceArray views of one device\n"
     "block per batch; other leaves pass through unchanged. device: None (current CUDA device,\n"
     "else the host backend), 'cpu', 'cuda', 'cuda:N' or an int. depth: batches in flight or\n"
     "waiting. pool: the PinnedPool to draw from (default: default_pool(device), whose slabs\n"
     "outlive the prefetcher). max_pinned_bytes: this prefetcher's bound on pinned memory within\n"
     "the pool (default (depth + 2) of the largest batch, at most the pool's cap).\n"
     "copy_stream_priority: 'high' (the copy stream gets the device's greatest priority, so its\n"
     "copies are not queued behind compute work), 'normal' or 'low' (the two are the same: the\n"
     "device's least priority, which is CUDA's default); no effect on the host backend. output:\n"
     "'array' (DeviceArray leaves) or 'capsule' (DLPack capsules, `stream` made to wait first)."},
    {0, NULL},
};

static PyType_Spec pf_spec = {
    .name = "pinloader.AsyncPrefetcher",
    .basicsize = sizeof(pl_prefetcher_obj),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .slots = pf_slots,
};

int pl_prefetcher_init(PyObject *m, pl_state *st)
{
    st->AsyncPrefetcher_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &pf_spec, NULL);
    if (!st->AsyncPrefetcher_Type || PyModule_AddType(m, st->AsyncPrefetcher_Type) < 0)
        return -1;
    return 0;
}
