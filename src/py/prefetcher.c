/* AsyncPrefetcher: a native producer thread that pulls items from any Python iterable, reads
 * them with flatten.c, copies each batch to one device block with transfer.c, and hands the
 * batches out in order as DeviceArrays. This file holds the type: epochs, the object's
 * lifecycle, its construction, stats and getters. The batch queue with both its ends (the
 * producer thread, the consumer's next()) and the graveyard are in pf_producer.c, the pipeline
 * (made and freed: copy stream, pool policy, stager) in pf_pipeline.c, the constructor's
 * options in pf_options.c, the object's struct and the methods' checks in prefetcher_impl.h.
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
 * an inherited object fails fast and touches neither its mutex, its threads nor its memory. */
#include "prefetcher_impl.h"

#include "util.h"

#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <structmember.h>

/* ---- epochs (GIL held) ---- */

/* Start the next epoch over `it`, a new iterator of the source (stolen). */
static void start_epoch(pl_prefetcher_obj *self, PyObject *it)
{
    Py_XSETREF(self->it, it);
    self->it_epoch++;
    self->consumer_epoch = self->it_epoch;
    self->consumed_in_epoch = 0;
    Py_CLEAR(self->stash); /* a batch of the epoch before (Note [interrupted handout] in pf_producer.c) */
    self->state = PF_OPEN;
    pthread_mutex_lock(&self->mu);
    self->requested_epoch = self->it_epoch;
    pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
}

static PyObject *pf_iter(PyObject *op)
{
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    if (pl_pf_check_usable(self) < 0 ||
        pl_pf_check_not_producer(self, "iter()", "it would restart the epoch being read") < 0)
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
    if (pl_pf_is_closed(self))
        return;
    self->state = PF_CLOSED; /* no other caller gets past the check above from here on */
    live_unlink(self);
    if (stop_producer(self)) {
        pl_pf_free_resources(self);
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
    Py_VISIT(self->stash);
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
        if (!pl_pf_is_closed(self)) {
            self->state = PF_CLOSED;
            live_unlink(self);
            if (!stop_producer(self)) {
                /* The producer is inside user code and still uses this object: it frees it
                 * when that code returns (see Note [stuck producers]). */
                self->state = PF_ORPHANED;
                return;
            }
            pl_pf_free_resources(self);
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

/* ---- construction (the options: pf_options.c; the pipeline: pf_pipeline.c) ---- */

/* Start the first epoch and the producer; link into the live list. */
static int start_producer(pl_prefetcher_obj *self, PyObject *probe)
{
    /* The first epoch starts now, so the first batch is in flight before the loop begins. */
    self->it = probe;
    self->it_epoch = 1;
    self->consumer_epoch = 1;
    self->requested_epoch = 1;
    if (pthread_create(&self->thread, NULL, pl_pf_producer_main, self) != 0) {
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

static PyObject *pf_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    pl_state *st = pl_state_of_type(type);
    pf_options o;
    if (!st || pl_pf_parse_options(st, args, kwds, &o) < 0)
        return NULL;
    PyObject *probe = pl_pf_first_iterator(o.iterable);
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
    self->handout.static_rows = o.static_rows;
    if (o.out && !self->handout.out) {
        Py_DECREF(probe);
        Py_DECREF(self);
        return NULL;
    }
    if (o.structure != Py_None && pl_pf_capture_structure(self, o.structure) < 0) {
        Py_DECREF(probe);
        Py_DECREF(self);
        return NULL;
    }
    self->max_pinned = o.max_pinned;
    if (pl_pf_setup_pipeline(self, &o) < 0 || start_producer(self, probe) < 0) {
        if (!self->it)
            Py_DECREF(probe);
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* ---- stats, getters and the type ---- */

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
    if (pl_pf_check_inherited(self) < 0)
        return NULL;
    double samples[WAIT_SAMPLES];
    pthread_mutex_lock(&self->mu);
    size_t ns = (size_t)PL_MIN(self->n_waits, (uint64_t)WAIT_SAMPLES);
    memcpy(samples, self->wait_samples, ns * sizeof(double));
    uint64_t batches = self->n_batches, bytes = self->n_bytes, padding = self->n_padding, waits = self->n_waits, stalls = self->stalls;
    int64_t span = self->last_batch_ns - self->first_batch_ns;
    int64_t next_ns = self->next_ns, staging_ns = self->staging_ns, issue_ns = self->copy_issue_ns;
    int64_t sort_ns = self->sort_ns, gil_wait_ns = self->gil_wait_ns, producer_ns = self->producer_ns;
    uint64_t gil_holds = self->gil_holds;
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
        "s:n,s:n,s:n,s:n,s:K,s:K,s:d,s:d,s:d,s:K}",
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
        "pool_waits", (unsigned long long)ps.waits,
        "sort_s_total", (double)sort_ns / 1e9, "gil_wait_s_total", (double)gil_wait_ns / 1e9,
        "producer_s_total", (double)producer_ns / 1e9, "producer_gil_holds", (unsigned long long)gil_holds);
}

static PyObject *pf_enter(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    if (pl_pf_check_usable((pl_prefetcher_obj *)op) < 0)
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
                                    pl_pf_is_closed(self) ? " closed" : "");
    return PyUnicode_FromFormat("<pinloader.AsyncPrefetcher device=cpu (host backend) depth=%d "
                                "batches=%llu queued=%d%s>", self->depth, batches, queued,
                                pl_pf_is_closed(self) ? " closed" : "");
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
    return PyBool_FromLong(pl_pf_is_closed((pl_prefetcher_obj *)op));
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
    {"valid_rows", pf_get_valid_rows, NULL, "With static=True, the real rows of the last batch "
     "handed out (the fewest over its leaves; the rest of each static buffer is zeros); else None.", NULL},
    {"static_arrays", pf_get_static_arrays, NULL, "With static=True, a tuple of the static buffers "
     "(DeviceArrays in leaf order); None before the first batch, and after close().", NULL},
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
    {Py_tp_iternext, pl_pf_next},
    {Py_tp_methods, pf_methods},
    {Py_tp_getset, pf_getset},
    {Py_tp_members, pf_members},
    {Py_tp_repr, pf_repr},
    {Py_mp_length, pf_len},
    {Py_tp_doc,
     "AsyncPrefetcher(iterable, device=None, depth=2, pool=None, max_pinned_bytes=None,\n"
     "                staging_threads=None, copy_stream_priority='high', output='array', stream=None,\n"
     "                *, convert=None, static=False, out=None, structure=None, static_rows=None)\n"
     "--\n\n"
     "Prefetch batches from any iterable to a device, off the GIL.\n"
     "\n"
     "Items may nest tuple, list, dict (and their subclasses), namedtuple and dataclass; array\n"
     "leaves (NumPy arrays, CPU DLPack exporters, buffer-protocol objects) arrive as DeviceArray\n"
     "views of one device block per batch; other leaves (NumPy scalars too) pass through\n"
     "unchanged. Each batch is walked once, on the producer thread, and built once.\n"
     "\n"
     "Parameters\n"
     "----------\n"
     "iterable\n"
     "    The source of batches: any iterable (a DataLoader, a generator, a list). Re-iterable\n"
     "    sources give a new epoch per ``iter()``.\n"
     "device\n"
     "    None (the current CUDA device, else the host backend), 'cpu', 'cuda', 'cuda:N' or an\n"
     "    int.\n"
     "depth\n"
     "    Batches in flight or waiting, at most.\n"
     "pool\n"
     "    The PinnedPool to draw from (default: ``default_pool(device)``, whose slabs outlive the\n"
     "    prefetcher).\n"
     "max_pinned_bytes\n"
     "    This prefetcher's bound on pinned memory within the pool (default: (depth + 2) times the\n"
     "    largest batch, at most the pool's cap).\n"
     "staging_threads\n"
     "    Threads that copy leaves into pinned memory (default: the CPUs this process may use,\n"
     "    divided among the local ranks, at least 1, at most 32).\n"
     "copy_stream_priority\n"
     "    'high' (the copy stream gets the device's greatest priority, so its copies are not queued\n"
     "    behind compute work) or 'normal' (CUDA's default priority, which is also its least).\n"
     "    No effect on the host backend.\n"
     "output\n"
     "    'array' (DeviceArray leaves) or 'capsule' (DLPack capsules exported for ``stream``, which\n"
     "    waits on the batch's copy once).\n"
     "stream\n"
     "    The consumer's stream: a DLPack stream handle (None: the legacy default stream) or a\n"
     "    callable returning one, called once per batch.\n"
     "convert\n"
     "    A callable applied to each leaf as it is handed out (to its capsule with\n"
     "    output='capsule', else to its DeviceArray): a framework's DLPack import.\n"
     "static\n"
     "    Deliver every batch in the same device buffers, one per array leaf, laid out from the\n"
     "    first batch and refilled on ``stream`` when a batch is taken (for CUDA graphs). A batch is\n"
     "    valid until the next one; a shorter batch fills the first rows, zeros the rest and sets\n"
     "    ``valid_rows``; any other layout is a ValueError naming the leaf.\n"
     "out\n"
     "    A list of your own C-contiguous buffers on the device (DLPack exporters) to deliver\n"
     "    into; implies ``static``.\n"
     "structure\n"
     "    An object whose structure every item's leaves are placed in (each item is then a tuple of\n"
     "    its leaves, in walk order), captured once (ArrayLoader's batches).\n"
     "static_rows\n"
     "    Lay the static buffers out for at least this many rows (an ArrayLoader passes its\n"
     "    batch_size: a resumed epoch may begin with a short batch).\n"
     "\n"
     "out= buffers must not overlap in memory; a 0-d leaf has no rows (``valid_rows`` is the\n"
     "fewest rows over the leaves with rows, None for a batch of 0-d leaves only)."},
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
