/* pinloader._C.OrderJob: an epoch's sampling order (the permutation cut to a rank's shard and
 * mapped to window starts), made on a thread that never touches Python. Note [epoch orders]. */
#include "gather_impl.h"

#include "util.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

/* Note [epoch orders]
 * A loader's epoch order (pinloader/_epoch_plan.py) is the epoch permutation of its n items
 * (Note [epoch permutation] in epoch_table.c), cut to the rank's shard and mapped to window
 * starts:
 *   phase, perm = permutation(n, seed, epoch, phase_range)   (0, range(n) when not shuffled)
 *   world_size > 1 and count > 0:  order[k] = perm[(k * world_size + rank) % n], k < count
 *   otherwise:                     order = perm[:count]
 *   window L > 0:                  order[k] = phase + order[k] * L
 * tests/helpers.py's ref_order is the Python reference it must match item for item.
 *
 * OrderJob makes it with the GIL held only to take the blocks (Note [epoch table reuse] in
 * epoch_table.c) and to hand the table out. A job made with start=True makes it on a thread of
 * its own (pl-epoch-order) that never touches Python: the loader makes the next epoch's order
 * this way while the training loop runs (Note [orders made ahead] in pinloader/_epoch_plan.py),
 * and a Python thread there would wait for the GIL at every step of its way (its start, the
 * call, the return: each time up to the interpreter's switch interval while the training thread
 * holds the GIL). A job made with start=False, or whose thread could not be started, makes it in
 * result(), on the calling thread with the GIL released.
 *
 * result() waits for the thread in slices of WAIT_SLICE_NS, taking the GIL between them to run
 * signal handlers: a Ctrl-C is a KeyboardInterrupt, and the job is there for the next call.
 * result() may be called from several Python threads at once: the first to find the order made
 * hands it out and the others return that same table, and while one makes it in place (GIL
 * released) the others wait for it rather than write the same blocks. The
 * work (its parameters, its blocks, its lock) is shared by the job and its thread and freed by
 * whichever lets go last: a job dropped while its thread runs is freed by the thread, its blocks
 * freed rather than kept (keeping them needs the GIL). In a process forked while the thread
 * ran, the thread does not exist (Note [fork generations] in src/core/util.h): result() makes
 * the order itself, on the calling thread, without touching the lock, and the job is freed
 * without waiting; nor does it wait for a Python thread of the parent that was making the order
 * in place at the fork. */
#define WAIT_SLICE_NS 50000000 /* 50 ms */
#define MAKING_SLICE_NS 1000000 /* 1 ms: a second caller polls the first one's in-place making */

typedef struct {
    /* set before the thread starts, read only after */
    int64_t n, count, world, rank, window;
    uint64_t seed, epoch, phase_range;
    int shuffle;
    epoch_table *perm; /* the permutation's n entries when the order is another table (a shard) */
    epoch_table *out;  /* the order */
    atomic_int refs;   /* the job's and the thread's */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_int done; /* set once, under mu for the waiters on cv; read atomically: with the GIL
                      * held, the job never blocks on mu (the order's thread may hold it) */
} order_work;

typedef struct {
    PyObject_HEAD
    order_work *w;
    PyObject *tables; /* an EpochTables, or NULL */
    PyObject *result; /* the table, once handed out */
    uint32_t gen;     /* Note [fork generations] */
    int threaded;     /* a thread makes the order */
    int handed;       /* result() took the blocks */
    int making;       /* a result() call makes the order in place now (GIL released) */
    uint32_t making_gen; /* the generation of that call's process: a parent's never ends here */
} OrderJobObject;

/* ---- the test switch: jobs' threads wait before they begin (testing.c) ---- */

static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cv = PTHREAD_COND_INITIALIZER;
static int hold_on;
static int hold_parked; /* threads waiting at the switch now */

void pl_epoch_order_hold(int on)
{
    pthread_mutex_lock(&hold_mu);
    hold_on = on;
    pthread_cond_broadcast(&hold_cv);
    pthread_mutex_unlock(&hold_mu);
}

void pl_epoch_order_atfork_child(void)
{
    /* the parent's job threads do not exist here: the switch's lock and condition are re-made
     * (a waiter of the parent may have held the lock) and the switch is off */
    static const pthread_cond_t fresh_cv = PTHREAD_COND_INITIALIZER;
    pl_mutex_reset_in_child(&hold_mu);
    memcpy(&hold_cv, &fresh_cv, sizeof fresh_cv);
    hold_on = 0;
    hold_parked = 0;
}

/* How many job threads wait at the switch now. A test that forks while a job is held waits for
 * its thread to get here first: a thread still starting (inside the C library or a sanitizer's
 * allocator) may hold one of their locks at the fork, and the child's next thread would wait for
 * it forever. */
int pl_epoch_order_parked(void)
{
    pthread_mutex_lock(&hold_mu);
    int n = hold_parked;
    pthread_mutex_unlock(&hold_mu);
    return n;
}

static void hold_wait(void)
{
    pthread_mutex_lock(&hold_mu);
    if (hold_on) {
        hold_parked++;
        while (hold_on)
            pthread_cond_wait(&hold_cv, &hold_mu);
        hold_parked--;
    }
    pthread_mutex_unlock(&hold_mu);
}

/* ---- the work ---- */

/* Make the order into w->out (the Note's formula). No GIL. */
static void order_make(order_work *w)
{
    epoch_table *o = w->out;
    const int64_t n = w->n, L = w->window;
    const int sharded = w->world > 1 && w->count > 0;
    const int64_t m = sharded ? w->count : (w->count < n ? w->count : n);
    uint64_t phase = 0;
    if (m > 0) {
        int64_t *p = sharded ? w->perm->data : o->data;
        if (w->shuffle) {
            pl_permute(p, n, w->seed, w->epoch, w->phase_range, &phase);
        } else {
            for (int64_t i = 0; i < n; i++)
                p[i] = i;
        }
    }
    const int64_t ph = (int64_t)phase; /* <= phase_range, checked to fit with the windows */
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    if (sharded) {
        int64_t pos = w->rank % n, step = w->world % n;
        for (int64_t k = 0; k < m; k++) {
            int64_t v = w->perm->data[pos];
            if (L)
                v = ph + v * L;
            o->data[k] = v;
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
            pos += step;
            if (pos >= n)
                pos -= n;
        }
    } else {
        if (L)
            for (int64_t k = 0; k < m; k++)
                o->data[k] = ph + o->data[k] * L;
        if (m == n) { /* a whole permutation of [0, n): its range is known */
            lo = L ? ph : 0;
            hi = L ? ph + (n - 1) * L : n - 1;
        } else {
            for (int64_t k = 0; k < m; k++) {
                lo = o->data[k] < lo ? o->data[k] : lo;
                hi = o->data[k] > hi ? o->data[k] : hi;
            }
        }
    }
    o->n = m;
    o->lo = m ? lo : 0;
    o->hi = m ? hi : -1;
}

static void work_free(order_work *w, int lock_usable)
{
    PyMem_RawFree(w->perm);
    PyMem_RawFree(w->out);
    if (lock_usable) {
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv);
    }
    PyMem_RawFree(w);
}

static void work_release(order_work *w)
{
    if (atomic_fetch_sub(&w->refs, 1) == 1)
        work_free(w, 1);
}

static void *order_main(void *arg)
{
    order_work *w = arg;
    pl_thread_name("pl-epoch-order");
    hold_wait();
    order_make(w);
    pthread_mutex_lock(&w->mu);
    atomic_store(&w->done, 1);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    work_release(w);
    return NULL;
}

/* ---- the job ---- */

static int64_t arg_i64(PyObject *o, const char *name, int64_t lo, int64_t hi)
{
    if (PyBool_Check(o) || !PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "OrderJob: %s must be an int, not %.100s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "OrderJob: %s must be in [%lld, %lld], got %R", name,
                     (long long)lo, (long long)hi, o);
        return -1;
    }
    return (int64_t)v;
}

static PyObject *job_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"n", "seed", "epoch", "shuffle", "phase_range", "world_size", "rank",
                             "count", "window", "tables", "start", NULL};
    PyObject *n_o, *seed_o, *epoch_o, *phase_o = NULL, *world_o = NULL, *rank_o = NULL, *count_o = Py_None,
             *window_o = NULL, *tables = Py_None, *shuffle_o = Py_True, *start_o = Py_True;
    /* shuffle and start: bools only, not any object's truth (None is not False) */
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|$OOOOOOOO:OrderJob", kwlist, &n_o, &seed_o, &epoch_o,
                                     &shuffle_o, &phase_o, &world_o, &rank_o, &count_o, &window_o, &tables,
                                     &start_o))
        return NULL;
    if (!PyBool_Check(shuffle_o) || !PyBool_Check(start_o))
        return PyErr_Format(PyExc_TypeError, "OrderJob: %s must be a bool, not %.100s",
                            PyBool_Check(shuffle_o) ? "start" : "shuffle",
                            Py_TYPE(PyBool_Check(shuffle_o) ? start_o : shuffle_o)->tp_name);
    const int shuffle = shuffle_o == Py_True, start = start_o == Py_True;
    uint64_t seed, epoch;
    /* n entries of 8 bytes fit the address space (and every product below fits int64) */
    const int64_t n_max = (int64_t)(((uint64_t)PY_SSIZE_T_MAX - sizeof(epoch_table)) / sizeof(int64_t));
    int64_t n = arg_i64(n_o, "n", 0, n_max);
    if (n < 0 || pl_as_u64(seed_o, "seed", &seed) < 0 || pl_as_u64(epoch_o, "epoch", &epoch) < 0)
        return NULL;
    int64_t phase_range = phase_o ? arg_i64(phase_o, "phase_range", 0, INT64_MAX) : 0;
    int64_t world = world_o ? arg_i64(world_o, "world_size", 1, INT64_MAX) : 1;
    int64_t rank = rank_o ? arg_i64(rank_o, "rank", 0, INT64_MAX) : 0;
    int64_t count = count_o != Py_None ? arg_i64(count_o, "count", 0, n_max) : n;
    int64_t window = window_o ? arg_i64(window_o, "window", 0, INT64_MAX) : 0;
    if (phase_range < 0 || world < 0 || rank < 0 || count < 0 || window < 0)
        return NULL;
    if (rank >= world)
        return PyErr_Format(PyExc_ValueError, "OrderJob: rank must be < world_size, got rank=%lld, "
                            "world_size=%lld", (long long)rank, (long long)world);
    if (window && n && ((uint64_t)(n - 1) > (uint64_t)(INT64_MAX - phase_range) / (uint64_t)window))
        return PyErr_Format(PyExc_ValueError, "OrderJob: %lld windows of %lld rows after a phase of up "
                            "to %lld overflow int64", (long long)n, (long long)window, (long long)phase_range);
    if (tables == Py_None)
        tables = NULL;
    else if (!pl_is_epoch_tables(tables))
        return PyErr_Format(PyExc_TypeError, "OrderJob: tables must be an EpochTables or None, not %.100s",
                            Py_TYPE(tables)->tp_name);
    const int sharded = world > 1 && count > 0;
    if (sharded && n == 0)
        return PyErr_Format(PyExc_ValueError, "OrderJob: a shard of %lld items of no items", (long long)count);

    order_work *w = PyMem_RawCalloc(1, sizeof *w);
    if (!w)
        return PyErr_NoMemory();
    w->n = n;
    w->count = count;
    w->world = world;
    w->rank = rank;
    w->window = window;
    w->seed = seed;
    w->epoch = epoch;
    w->phase_range = (uint64_t)phase_range;
    w->shuffle = shuffle;
    const int64_t m = sharded ? count : (count < n ? count : n);
    /* the whole permutation is made in the order's own block unless the order is a shard */
    w->out = pl_epoch_table_take(tables, sharded ? count : (m ? n : 0));
    if (w->out && sharded)
        w->perm = pl_epoch_table_take(tables, n);
    if (!w->out || (sharded && !w->perm)) { /* MemoryError set */
        pl_epoch_table_give(tables, w->out);
        PyMem_RawFree(w);
        return NULL;
    }
    int mu_ok = pthread_mutex_init(&w->mu, NULL) == 0;
    if (!mu_ok || pl_cond_init(&w->cv) != 0) {
        if (mu_ok)
            pthread_mutex_destroy(&w->mu);
        pl_epoch_table_give(tables, w->out);
        pl_epoch_table_give(tables, w->perm);
        PyMem_RawFree(w);
        return PyErr_Format(PyExc_RuntimeError, "OrderJob: could not make a lock");
    }
    OrderJobObject *self = (OrderJobObject *)type->tp_alloc(type, 0);
    if (!self) {
        pl_epoch_table_give(tables, w->out);
        pl_epoch_table_give(tables, w->perm);
        w->out = w->perm = NULL;
        work_free(w, 1);
        return NULL;
    }
    self->w = w;
    self->tables = Py_XNewRef(tables);
    self->gen = pl_generation();
    atomic_store(&w->refs, 1);
    if (start) {
        pthread_t tid;
        atomic_store(&w->refs, 2);
        if (pthread_create(&tid, NULL, order_main, w) == 0) {
            pthread_detach(tid);
            self->threaded = 1;
        } else {
            atomic_store(&w->refs, 1); /* made in result(), on the caller's thread */
        }
    }
    return (PyObject *)self;
}

/* The job's thread has made the order: 1 if so (its writes to the blocks are then visible). */
static int job_done(OrderJobObject *self)
{
    if (!self->threaded || pl_inherited(self->gen))
        return 0;
    return atomic_load(&self->w->done);
}

static PyObject *job_result(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    OrderJobObject *self = (OrderJobObject *)op;
    order_work *w = self->w;
    /* Each pass starts with the GIL held: another Python thread in result() may have handed the
     * table out, or be making it in place, while this one waited without the GIL. */
    for (;;) {
        if (self->result)
            return Py_NewRef(self->result);
        if (self->handed)
            return PyErr_Format(PyExc_RuntimeError, "OrderJob: the order could not be handed out");
        if (self->making && !pl_inherited(self->making_gen)) {
            /* another Python thread makes it in place, in these blocks: wait for it */
            Py_BEGIN_ALLOW_THREADS
            struct timespec ts = {0, MAKING_SLICE_NS};
            nanosleep(&ts, NULL);
            Py_END_ALLOW_THREADS
            if (PyErr_CheckSignals() < 0)
                return NULL;
            continue;
        }
        if (!self->threaded || pl_inherited(self->gen)) {
            /* no thread makes it (here): make it now */
            self->making = 1;
            self->making_gen = pl_generation();
            Py_BEGIN_ALLOW_THREADS
            order_make(w);
            Py_END_ALLOW_THREADS
            self->making = 0;
            break;
        }
        int done;
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&w->mu);
        if (!atomic_load(&w->done)) {
            struct timespec ts;
            pl_deadline(&ts, WAIT_SLICE_NS);
            pthread_cond_timedwait(&w->cv, &w->mu, &ts);
        }
        done = atomic_load(&w->done);
        pthread_mutex_unlock(&w->mu);
        Py_END_ALLOW_THREADS
        if (done) {
            if (self->result || self->handed)
                continue; /* handed out by another caller meanwhile */
            break;
        }
        if (PyErr_CheckSignals() < 0)
            return NULL; /* the job is still there */
    }
    self->handed = 1;
    pl_epoch_table_give(self->tables, w->perm);
    w->perm = NULL;
    epoch_table *o = w->out;
    w->out = NULL;
    self->result = pl_epoch_table_array(o, self->tables);
    return Py_XNewRef(self->result);
}

static PyObject *job_get_done(PyObject *op, void *closure)
{
    (void)closure;
    OrderJobObject *self = (OrderJobObject *)op;
    return PyBool_FromLong(self->result != NULL || job_done(self));
}

static PyObject *job_get_threaded(PyObject *op, void *closure)
{
    (void)closure;
    return PyBool_FromLong(((OrderJobObject *)op)->threaded);
}

static void job_dealloc(PyObject *op)
{
    OrderJobObject *self = (OrderJobObject *)op;
    PyTypeObject *tp = Py_TYPE(op);
    order_work *w = self->w;
    if (w) {
        if (self->threaded && pl_inherited(self->gen)) {
            work_free(w, 0); /* the parent's thread is not here; its lock may be held */
        } else {
            if (!self->threaded || job_done(self)) { /* nothing writes the blocks: keep them */
                pl_epoch_table_give(self->tables, w->perm);
                pl_epoch_table_give(self->tables, w->out);
                w->perm = w->out = NULL;
            }
            work_release(w);
        }
    }
    Py_XDECREF(self->result);
    Py_XDECREF(self->tables);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyMethodDef job_methods[] = {
    {"result", job_result, METH_NOARGS,
     "result($self)\n--\n\nThe order, a read-only int64 epoch table: waits for the job's thread (a Ctrl-C "
     "interrupts the wait, not the job), or makes it here when no thread does."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef job_getset[] = {
    {"done", job_get_done, NULL, "The order is made (result() returns at once).", NULL},
    {"threaded", job_get_threaded, NULL, "A thread of the job's own makes the order.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot job_slots[] = {
    {Py_tp_doc, "OrderJob(n, seed, epoch, *, shuffle=True, phase_range=0, world_size=1, rank=0, "
                "count=None, window=0, tables=None, start=True)\n--\n\n"
                "An epoch's order, made on a thread of its own when start (Note [epoch orders] in "
                "src/py/epoch_order.c)."},
    {Py_tp_new, job_new},
    {Py_tp_dealloc, job_dealloc},
    {Py_tp_methods, job_methods},
    {Py_tp_getset, job_getset},
    {0, NULL},
};

static PyType_Spec job_spec = {
    .name = "pinloader._C.OrderJob",
    .basicsize = sizeof(OrderJobObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = job_slots,
};

int pl_epoch_order_init(PyObject *m)
{
    PyObject *tp = PyType_FromModuleAndSpec(m, &job_spec, NULL);
    int rc = tp ? PyModule_AddObjectRef(m, "OrderJob", tp) : -1;
    Py_XDECREF(tp);
    return rc;
}
