/* AsyncPrefetcher's batch queue, both ends. The producer thread waits for room in the queue,
 * asks the epoch's source for a batch (Note [sources] in source.h) -- a Python iterable with the
 * GIL (Note [GIL handoff]), a native source opened once with the GIL and then without it --
 * then, without the GIL, copies the batch with transfer.c and queues it. A producer that close()
 * left inside user code frees the pipeline itself when it comes back (Note [stuck producers] in
 * prefetcher.c). The consumer's next() (the type's tp_iternext, at the end) takes the batch and
 * hands it out with handout.c. Also the producer's graveyard, the objects it drops at its next
 * GIL hold (Note [producer and the GIL] in prefetcher.c). The object and its batches are in
 * prefetcher_impl.h. */
#include "prefetcher_impl.h"

#include "source.h"
#include "transfer.h"
#include "util.h"

#include <sched.h>
#include <signal.h>
#include <string.h>

/* ---- a batch's errors ---- */

static void fail_batch(batch *bt, int code, const char *what)
{
    bt->kind = B_ERROR;
    bt->err_code = code;
    snprintf(bt->err_what, sizeof bt->err_what, "item %llu: %s", (unsigned long long)bt->index, what);
}

/* A source's batch is bad (found without the GIL): ValueError(what) for the consumer. */
static void fail_source(batch *bt, const char *what)
{
    bt->kind = B_ERROR;
    bt->err_value = 1;
    snprintf(bt->err_what, sizeof bt->err_what, "%s", what);
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
    int64_t round_start_ns; /* this round's start (after the wait for room), for the stats */
    int64_t gil_wait_ns;    /* this round's wait for the GIL */
    /* The previous batch's source objects, dropped at the next GIL acquisition (one per batch,
     * see Note [GIL handoff]); with prev_blk, kept until its copy is done. */
    PyObject **prev_owners;
    Py_ssize_t prev_n;
    pl_block *prev_blk;
    /* See Note [producer thread state]. */
    PyThreadState *ts;
    int ts_failed;           /* PyThreadState_New failed: PyGILState per hold instead */
    PyGILState_STATE gstate; /* only then */
    /* The native source this producer opened and its reader's state (Note [sources] in source.h),
     * held until its last batch is copied: then buried with prev_blk, that batch's block. */
    struct {
        const pl_source_ops *ops;
        PyObject *obj;
        void *state;
        uint64_t epoch;
    } native;
    uint64_t want_epoch;            /* the epoch asked for, as producer_wait last saw it */
} producer;

/* Wait (no GIL) until there is room and work; returns 0 to go on, -1 to exit. */
static int producer_wait(pl_prefetcher_obj *self, producer *p)
{
    pthread_mutex_lock(&self->mu);
    while (!atomic_load(&self->stop) &&
           (self->queued >= self->depth || self->finished_epoch == self->requested_epoch))
        pthread_cond_wait(&self->cv, &self->mu);
    p->want_epoch = self->requested_epoch;
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
 * The producer needs the GIL once per batch of a Python source (next() on the source, reading
 * the leaves; a native source needs it once per epoch, Note [sources] in source.h). A
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

/* The consumer's side of Note [GIL handoff] (GIL held). */
static void lend_gil_to_producer(pl_prefetcher_obj *self)
{
    if (!atomic_load(&self->gil_wanted))
        return;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < 2000 && atomic_load(&self->gil_wanted); i++)
        sched_yield();
    Py_END_ALLOW_THREADS
}

/* GIL held: the native source goes to the graveyard with the last batch made from it (copies
 * finish in order on the copy stream, so that one finishes last); unless `keep` and it is still
 * the epoch's iterator. */
static void retire_native(pl_prefetcher_obj *self, producer *p, int keep)
{
    PyObject *obj = p->native.obj;
    if (!obj || (keep && obj == self->it))
        return;
    if (p->native.ops->close)
        p->native.ops->close(p->native.state);
    memset(&p->native, 0, sizeof p->native);
    PyObject **objs = PyMem_RawMalloc(sizeof(PyObject *));
    if (objs) {
        objs[0] = obj;
        pl_pf_bury(self, objs, 1, p->prev_blk);
    } else {
        if (p->prev_blk) {
            Py_BEGIN_ALLOW_THREADS
            pl_block_sync_ready(p->prev_blk);
            Py_END_ALLOW_THREADS
        }
        Py_DECREF(obj);
    }
}

/* GIL held: the previous batch's owners go to the graveyard (and, at the producer's end, the
 * native source: `all`). */
static void release_previous(pl_prefetcher_obj *self, producer *p, int all)
{
    retire_native(self, p, !all);
    pl_pf_bury(self, p->prev_owners, p->prev_n, p->prev_blk);
    if (p->prev_blk)
        pl_block_decref(p->prev_blk);
    p->prev_owners = NULL;
    p->prev_n = 0;
    p->prev_blk = NULL;
}

/* GIL held: open `obj`, a native source read with `ops`, for this producer (Note [sources] in
 * source.h). 0, or -1 with an exception. */
static int open_native(pl_prefetcher_obj *self, producer *p, const pl_source_ops *ops, PyObject *obj)
{
    void *state = NULL;
    int n;
    if (ops->open(obj, &p->flat, &state, &n) < 0)
        return -1;
    if (n != self->templ.n_leaves) {
        if (ops->close)
            ops->close(state);
        PyErr_Format(PyExc_TypeError, "AsyncPrefetcher(structure=...): the source's batches have %d "
                     "leaves, the structure %zd", n, self->templ.n_leaves);
        return -1;
    }
    p->native.ops = ops;
    p->native.obj = Py_NewRef(obj);
    p->native.state = state;
    return 0;
}

/* bt (its epoch and index set) from a source, its next batch: B_READY with its output, B_END
 * or B_ERROR. A batch with no tree of its own goes out as leaf views, which the consumer places
 * in the captured structure (Note [batch leaves] in flatten.h). The GIL is held for a source
 * that needs it (and may be for one that does not). Returns -1 when close() came while user
 * code ran (bt then holds nothing to hand out), else 0. */
static int make_batch(pl_prefetcher_obj *self, producer *p, batch *bt, const pl_source_ops *ops,
                      PyObject *obj, void *state, int64_t *t_next)
{
    char why[sizeof bt->err_what];
    pl_source_ctx ctx = {&self->stop, self->templ.n_nodes ? self->templ.n_leaves : 0, bt->index, 0};
    int r = ops->next(obj, state, &p->flat, &ctx, why, sizeof why);
    *t_next = ctx.next_ns;
    if (r == PL_SOURCE_STOPPED)
        return -1;
    if (r == PL_SOURCE_END) {
        bt->kind = B_END;
        return 0;
    }
    if (r != PL_SOURCE_BATCH) {
        if (ops->needs_gil) {
            bt->kind = B_ERROR;
            bt->exc = fetch_exception();
        } else {
            fail_source(bt, why);
        }
        return 0;
    }
    pl_flat *f = &p->flat;
    int rc = pl_block_create(self->b, self->device, &bt->blk);
    if (rc != PL_OK) {
        if (ops->needs_gil)
            pl_flat_clear(f); /* the walked item's owners and nodes */
        fail_batch(bt, rc, "creating the batch's ready event");
        return 0;
    }
    if (!ops->needs_gil) { /* leaves only, and maybe no GIL */
        if (!(bt->leaves = pl_flat_leaf_views_raw(f, bt->blk))) {
            fail_batch(bt, PL_ERR_NO_MEMORY, "the batch's leaf views");
            return 0;
        }
        bt->kind = B_READY;
        return atomic_load(&self->stop) ? -1 : 0;
    }
    if (pl_handout_active(&self->handout)) {
        if ((bt->leaves = pl_flat_leaf_views(f, bt->blk)) && !self->templ.n_nodes) /* Note [batch leaves] */
            pl_flat_take_tree(f, &bt->tree);
    } else if (self->templ.n_nodes) {
        if ((bt->output = pl_flat_device_arrays(f, bt->blk)))
            Py_SETREF(bt->output, pl_tree_build(&self->templ, bt->output));
    } else {
        bt->output = pl_flat_rebuild(f, bt->blk);
    }
    if (!bt->output && !bt->leaves) {
        bt->kind = B_ERROR;
        bt->exc = fetch_exception();
        pl_flat_clear(f);
    } else {
        bt->kind = B_READY;
    }
    if (atomic_load(&self->stop)) {
        /* closed by user code the item ran (a __dlpack__, a constructor) */
        pl_flat_clear(f);
        return -1;
    }
    return 0;
}

/* GIL held: the epoch's next batch into bt, from its iterator read as a native source when it
 * is one and the prefetcher has a structure to place its leaves in, else as a Python iterable.
 * The native sources are the types registered with pl_source_register (ArrayLoader's epochs,
 * RowBatches: row_batches.c). Returns 0, or -1 when close() came meanwhile. */
static int read_item(pl_prefetcher_obj *self, producer *p, batch *bt, int64_t *t_next)
{
    const pl_source_ops *ops = self->it && self->templ.n_nodes ? pl_source_ops_of(self->st, self->it) : NULL;
    if (!ops)
        return make_batch(self, p, bt, &pl_py_source, self->it, NULL, t_next);
    /* opened already when an epoch restarted with the same iterator */
    if (self->it != p->native.obj && open_native(self, p, ops, self->it) < 0) {
        bt->kind = B_ERROR;
        bt->exc = fetch_exception();
        return atomic_load(&self->stop) ? -1 : 0;
    }
    p->native.epoch = bt->epoch;
    return make_batch(self, p, bt, p->native.ops, p->native.obj, p->native.state, t_next);
}

/* A round of an opened native source, without the GIL: 1 with *out a batch to ship, 0 to try
 * again. */
static int native_batch(pl_prefetcher_obj *self, producer *p, batch **out, int64_t *t_next)
{
    p->gil_wait_ns = 0;
    batch *bt = PyMem_RawCalloc(1, sizeof(*bt));
    if (!bt) {
        pl_sleep_ns(1000000);
        return 0;
    }
    bt->epoch = p->native.epoch;
    bt->index = p->index++;
    /* stop is seen by producer_wait before the next round; this batch is queued and dropped */
    (void)make_batch(self, p, bt, p->native.ops, p->native.obj, p->native.state, t_next);
    *out = bt;
    return 1;
}

/* The GIL part of one round. Returns 1 with *out a batch to ship, 0 to try again, -1 to exit. */
static int pull_batch(pl_prefetcher_obj *self, producer *p, batch **out, int64_t *t_next)
{
    int64_t t0 = pl_now_ns();
    producer_take_gil(self, p);
    p->gil_wait_ns = pl_now_ns() - t0;
    pthread_mutex_lock(&self->mu);
    self->gil_holds++;
    pthread_mutex_unlock(&self->mu);
    self->producer_in_user = 1;
    release_previous(self, p, 0);
    int r = atomic_load(&self->stop) ? -1 : 1;
    if (r > 0)
        pl_pf_empty_graves(self, 0, 0); /* thread-local mode already */
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
            pl_pf_batch_free(bt);
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
        self->sort_ns += tm.sort_ns;
        self->gil_wait_ns += p->gil_wait_ns;
        self->producer_ns += pl_now_ns() - p->round_start_ns;
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
            /* A GIL round buried the previous block with its owners already; a native
             * source's batches have no owners, and their block is needed only until the next
             * one that reads the sources replaces it: retire_native buries the source with
             * the last of them (a round that makes no such batch, the epoch's end or an error,
             * keeps the one before). */
            if (p->prev_blk)
                pl_block_decref(p->prev_blk);
            pl_block_incref(bt->blk);
            p->prev_blk = bt->blk;
        }
        /* the leaf buffers stay for the next item (pl_flat_begin), freed when the thread ends */
    }
    pl_pf_push_batch(self, bt);
}

/* A producer that close() left behind (stuck in user code) cleans up here. */
static void producer_exit(pl_prefetcher_obj *self, producer *p)
{
    wait_direct_copy(self);
    if (pl_py_finalizing())
        return; /* the interpreter is going away: touch nothing of it */
    producer_take_gil(self, p);
    release_previous(self, p, 1);
    if (self->state == PF_DETACHED || self->state == PF_ORPHANED) {
        pl_pf_free_resources(self);
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

/* Note [the producer and graph captures]
 * A step captured in a CUDA graph is usually captured while the loader runs: the training
 * thread captures (torch.cuda.graph, jax, CuPy) between two batches, and the producer goes on
 * making the next ones, querying events (the pool's regions, deferred frees) and allocating.
 * By default a capture begun in cudaStreamCaptureModeGlobal, torch's default, forbids every
 * other thread of the process the "potentially unsafe" calls, cudaEventQuery among them: one
 * query by the producer during the capture invalidates the user's graph ("operation not
 * permitted when stream is capturing"), at a moment that depends on timing. So the producer
 * puts itself in cudaStreamCaptureModeThreadLocal once, on start: its calls then ignore other
 * threads' captures, and since the producer never works on a capturing stream (its copy and
 * release streams are its own), nothing it does can be part of a graph. The user's source
 * iterator runs on this thread too, so its CUDA calls also ignore other threads' captures.
 * On the user's threads, next()'s own work keeps the user's mode (take batches outside a
 * capture), except the query and wait for the copy of sources about to be dropped (the graves,
 * below), which lift the ban for themselves, as releases (close(), a batch or a prefetcher
 * dropped or collected) do for their calls: Note [releases during a capture] in
 * src/core/backend.h. Should the call fail, the thread keeps the default (global) mode. Checked
 * by test_a_graph_captured_in_global_mode_while_the_producer_works in tests/test_static_cuda.py. */
void *pl_pf_producer_main(void *arg)
{
    pl_prefetcher_obj *self = arg;
    producer p;
    memset(&p, 0, sizeof p);
    pl_thread_name("pl-producer");
    pl_flat_init(&p.flat, self->st, self->b, self->device);
    self->b->set_device(self->device);
    (void)self->b->thread_ignore_other_captures(); /* see the Note above */
    for (;;) {
        if (producer_wait(self, &p) < 0)
            break;
        wait_direct_copy(self);
        if (pl_py_finalizing()) {
            pl_flat_release_leaves(&p.flat); /* PyMem_Raw, not the interpreter's */
            if (p.native.obj && p.native.ops->close)
                p.native.ops->close(p.native.state);
            return NULL; /* the interpreter is going away: touch nothing of it */
        }
        batch *bt = NULL;
        int64_t t_next = 0;
        p.round_start_ns = pl_now_ns();
        /* a native source's batches need no GIL, and carry no source objects (prev_n 0) */
        int r = p.native.obj && p.native.epoch == p.want_epoch && !p.prev_n
                    ? native_batch(self, &p, &bt, &t_next)
                    : pull_batch(self, &p, &bt, &t_next);
        if (r < 0)
            break;
        if (r > 0)
            ship_batch(self, &p, bt, t_next);
    }
    producer_exit(self, &p);
    pl_flat_release_leaves(&p.flat); /* PyMem_Raw: no GIL needed */
    if (p.native.obj && p.native.ops->close) /* left by a finalizing interpreter */
        p.native.ops->close(p.native.state);
    return NULL;
}

/* ---- graveyard (GIL held) ---- */

/* The graves are emptied by the producer (in thread-local mode for good: Note [the producer and
 * graph captures] in pf_producer.c), on the consumer's thread and in a release (the collector's,
 * inside a user's capture maybe). On a user's thread (relax) the CUDA calls on a batch's copy
 * lift the capture ban for this thread around themselves only (Note [releases during a capture]
 * in src/core/backend.h): the sources' finalizers run in the thread's own mode, unless the
 * caller relaxed the whole release (pl_pf_free_resources, pf_pipeline.c says why). */
static int query_copy(pl_block *blk, int relax)
{
    const int mode = relax ? pl_captures_relax(blk->b) : -1;
    int rc = blk->b->event_query(blk->ready);
    pl_captures_restore(blk->b, mode);
    return rc;
}

/* GIL held; released for the wait. */
static void sync_copy(pl_block *blk, int relax)
{
    Py_BEGIN_ALLOW_THREADS
    const int mode = relax ? pl_captures_relax(blk->b) : -1;
    pl_block_sync_ready(blk);
    pl_captures_restore(blk->b, mode);
    Py_END_ALLOW_THREADS
}

void pl_pf_bury(pl_prefetcher_obj *self, PyObject **objs, Py_ssize_t n, pl_block *blk)
{
    if (n == 0) {
        PyMem_RawFree(objs);
        return;
    }
    grave *g = PyMem_Malloc(sizeof(*g));
    if (!g) {
        /* Cannot defer: wait for the copy (if any) and drop now (the producer buries) */
        if (blk)
            sync_copy(blk, 0);
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
void pl_pf_empty_graves(pl_prefetcher_obj *self, int wait, int relax)
{
    grave *list = self->graves, *keep = NULL, **keep_tail = &keep;
    self->graves = NULL;
    while (list) {
        grave *g = list;
        list = g->next;
        int q = g->blk && !wait ? query_copy(g->blk, relax) : PL_OK;
        if (q == PL_ERR_NOT_READY) {
            g->next = NULL;
            *keep_tail = g;
            keep_tail = &g->next;
            continue;
        }
        /* A query that failed proves nothing about the copy that reads these sources (an error
         * need not be sticky): wait for it, as pl_pool_poll does; if the wait fails too, the
         * runtime is gone and nothing reads them any more. */
        if (g->blk && (wait || q != PL_OK))
            sync_copy(g->blk, relax);
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

/* Put a batch the consumer took back at the head of the queue (Note [interrupted handout]): it
 * is the next one handed out. */
static void requeue_batch(pl_prefetcher_obj *self, batch *bt)
{
    pthread_mutex_lock(&self->mu);
    bt->next = self->head;
    self->head = bt;
    if (!self->tail)
        self->tail = bt;
    self->queued++;
    pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
}

void pl_pf_push_batch(pl_prefetcher_obj *self, batch *bt)
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
            pl_pf_batch_free(bt); /* from an abandoned epoch */
            continue;
        }
        if (self->state != PF_OPEN) {
            /* another thread closed it, or took the end of the epoch */
            if (pl_pf_is_closed(self))
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

void pl_pf_batch_free(batch *bt)
{
    pl_tree_clear(&bt->tree);
    Py_XDECREF(bt->output);
    PyMem_RawFree(bt->leaves);
    Py_XDECREF(bt->exc);
    if (bt->blk)
        pl_block_decref(bt->blk);
    PyMem_RawFree(bt);
}

/* ---- the consumer's end: next() (GIL held) ---- */

/* A StopIteration raised by user code while a batch is made or handed out (a convert=, a
 * structure's constructor, the stream callable) would end the consumer's for loop silently and
 * lose the epoch's other batches: as PEP 479 does for generators, it becomes a RuntimeError
 * whose cause it is. */
static void stop_iteration_to_runtime_error(void)
{
    if (!PyErr_ExceptionMatches(PyExc_StopIteration))
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb && value)
        PyException_SetTraceback(value, tb);
    PyErr_SetString(PyExc_RuntimeError, "user code raised StopIteration while a batch was made or "
                    "handed out (a convert=, a structure's constructor, the stream callable)");
    PyObject *t2, *v2, *tb2;
    PyErr_Fetch(&t2, &v2, &tb2);
    PyErr_NormalizeException(&t2, &v2, &tb2);
    if (v2 && value) {
        PyException_SetCause(v2, Py_NewRef(value));
        PyException_SetContext(v2, Py_NewRef(value));
    }
    PyErr_Restore(t2, v2, tb2);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

static PyObject *raise_batch_error(pl_prefetcher_obj *self, batch *bt)
{
    if (bt->exc) {
        PyObject *exc = bt->exc;
        bt->exc = NULL;
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
        stop_iteration_to_runtime_error();
        return NULL;
    }
    if (bt->err_value) {
        PyErr_SetString(PyExc_ValueError, bt->err_what);
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

/* Note [interrupted handout]
 * A Ctrl-C (or any signal whose handler raises) that lands while a batch is handed out must not
 * lose the batch:
 *   - The handout fails with it (a wait, a convert= callback: a KeyboardInterrupt or
 *     SystemExit, not an Exception): the batch goes back to the head of the queue, not counted
 *     as handed out, and the next next() hands it out again (a convert= callback sees it
 *     twice). An Exception from the handout (a convert= that raises ValueError) is that
 *     batch's error, raised by this next().
 *   - It arrives during C code that does not look (the static copy, freeing the batch's
 *     block), and CPython would raise it as soon as next() returns, in the caller, dropping the
 *     batch next() returned. The signal is checked once the batch is out: next() raises, and
 *     keeps what it made (`stash`) for the next next(). A new epoch or close() drops it.
 * A signal that lands after that check, in the few instructions before the caller stores the
 * batch (more with a Python wrapper such as ArrayLoader.__next__), can still drop it: only
 * CPython could close that window. The tests raise the signal from C where the check finds it
 * (the switch below) rather than by timer, which would hit the window now and then. */

/* A test switch (pinloader._C._testing.debug_signal_after_handout): the next handout ends with
 * this signal raised from C, as one that lands during the static copy would be, so the second case
 * above runs every time instead of by chance. 0: off. Never on a data path. */
static atomic_int signal_after_handout;

PyObject *pl_pf_debug_signal_after_handout(PyObject *m, PyObject *arg)
{
    (void)m;
    long sig = PyLong_AsLong(arg);
    if (sig == -1 && PyErr_Occurred())
        return NULL;
    if (sig < 0 || sig >= NSIG)
        return PyErr_Format(PyExc_ValueError, "debug_signal_after_handout: %ld is not a signal number", sig);
    atomic_store(&signal_after_handout, (int)sig);
    Py_RETURN_NONE;
}

PyObject *pl_pf_next(PyObject *op)
{
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    if (pl_pf_check_usable(self) < 0 ||
        pl_pf_check_not_producer(self, "next()", "it would wait for a batch only this thread can make") < 0)
        return NULL;
    if (self->state != PF_OPEN)
        return NULL; /* StopIteration */
    if (self->stash) { /* Note [interrupted handout] */
        PyObject *out = self->stash;
        self->stash = NULL;
        self->consumed_in_epoch++;
        return out;
    }
    lend_gil_to_producer(self);
    pl_pf_empty_graves(self, 0, 1); /* the consumer: a user's thread */
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
        pl_pf_batch_free(bt);
        return NULL;
    }
    if (bt->kind == B_ERROR) {
        self->state = PF_FAILED;
        raise_batch_error(self, bt);
        pl_pf_batch_free(bt);
        return NULL;
    }
    self->consumed_in_epoch++;
    PyObject *out = bt->output;
    bt->output = NULL;
    if (bt->leaves) {
        /* bt (its block reference, which the views borrow) lives until the handout is done */
        const pl_tree *tree = self->templ.n_nodes ? &self->templ : &bt->tree;
        out = pl_handout_batch(self->st, self->b, self->device, &self->handout, tree, bt->leaves);
    }
    if (!out && !PyErr_ExceptionMatches(PyExc_Exception) && self->state == PF_OPEN) {
        /* Note [interrupted handout] (closed meanwhile, by user code: the batch is freed) */
        self->consumed_in_epoch--;
        requeue_batch(self, bt);
        return NULL;
    }
    if (!out)
        stop_iteration_to_runtime_error();
    pl_pf_batch_free(bt);
    int sig = out && atomic_load_explicit(&signal_after_handout, memory_order_relaxed)
                  ? atomic_exchange(&signal_after_handout, 0) : 0;
    if (sig)
        raise(sig);
    if (out && PyErr_CheckSignals() < 0) {
        if (self->state == PF_OPEN) {
            self->stash = out;
            self->consumed_in_epoch--;
        } else {
            Py_DECREF(out);
        }
        return NULL;
    }
    return out;
}
