/* pinloader._C.RowBatches: one epoch of an ArrayLoader, whose batches the prefetcher's producer
 * makes without the GIL (gather_impl.h).
 *
 * Note [native epochs]
 * An ArrayLoader batch needs no Python: its rows are a slice of the epoch table (Note [epoch
 * row tables]) and its leaves are the sources' layouts over those rows. So an epoch is a
 * RowBatches, made with the GIL when the epoch begins (pinloader/_epoch_plan.py): per leaf a
 * RowGather over no rows (the source held, its own view, its registration; its shape and dtype
 * checked against the loader's), the epoch table, whose range is checked once here against
 * every leaf, and the batch size and count. The prefetcher's producer adopts it and then makes
 * every batch without the GIL (rb_source_next, Note [sources] in source.h): the leaves' layouts over
 * the batch's slice of the table, the read-ahead of the next batch's rows for memory-mapped
 * leaves (Note [read-ahead]), and the size check of their files (Note [truncated mappings] in
 * pinloader/_epoch_plan.py) by fstat() on a descriptor of the mapped file, which the Python
 * side opened once per loader and matched to the mapping's device and inode (the RowBatches
 * holds the object that owns it). The producer holds the RowBatches,
 * and so every source, until the last batch it made from it is copied. Read from Python instead
 * (__next__), a RowBatches gives the same batches as tuples of RowGathers. Either way it has one
 * reader. Each source's view is taken once per epoch, not once per batch: a source reshaped in
 * place (a torch tensor's resize_) is reported when the next epoch begins, and the epoch in
 * flight reads the layout it began with, from memory the held export keeps alive. */
#include "gather_impl.h"

#include "source.h"
#include "util.h"

#include <string.h>
#include <errno.h>
#include <limits.h>
#include <sys/stat.h>

typedef struct {
    char *path;         /* "arrays['x']" (PyMem_Raw) */
    char *name;         /* with fd: the file's name for messages (PyMem_Raw) */
    PyObject *probe;    /* a RowGather: the held source, its view and its registration */
    pl_row_gather_leaf lay; /* the probe's layout; rows and shape[0] set per batch */
    /* read-ahead: the view's layout, copied (the view is never changed: nobody else has it) */
    int readahead, nd;
    npy_intp shape[PL_MAX_DIMS], strides[PL_MAX_DIMS];
    size_t itemsize;
    int64_t window;
    PyObject *file;     /* a file-mapped leaf: what holds a descriptor of the file, else NULL */
    int fd;             /* its descriptor (file->fileno()), else -1 */
    int64_t need;       /* the file size its mapping needs */
    int64_t advised_batches, advised_bytes; /* read-ahead so far (__atomic: read any time) */
} rb_leaf;

typedef struct {
    PyObject_HEAD
    rb_leaf *leaves;
    int n_leaves;
    PyObject *order;    /* the epoch table (array) the batches are slices of */
    PyObject *table;    /* its capsule, which owns the rows */
    const int64_t *rows;
    int64_t n_rows, batch_size, n_batches;
    int64_t next;       /* the next batch: the adopter's alone once adopted */
    int adopted;        /* GIL: a producer reads it */
    int reading;        /* GIL: __next__ is running (it releases the GIL for madvise) */
} RowBatchesObject;

static char *raw_strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = PyMem_RawMalloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

/* The file under leaf L still covers its mapping: 0, or -1 with the reason in why. */
static int rb_file_check(const rb_leaf *L, char *why, size_t n_why)
{
    struct stat s;
    char now[128];
    if (fstat(L->fd, &s) == 0) {
        if ((int64_t)s.st_size >= L->need)
            return 0;
        snprintf(now, sizeof now, "%lld bytes", (long long)s.st_size);
    } else {
        snprintf(now, sizeof now, "unreadable (%s)", strerror(errno));
    }
    snprintf(why, n_why, "%s: the memory-mapped file %s was truncated on disk while loading: it is "
             "now %s, the mapping needs %lld (the dataset was rewritten or cut short under the "
             "ArrayLoader)", L->path, L->name, now, (long long)L->need);
    return -1;
}

/* Batch b's rows: [*lo, *lo + *n) of the table. */
static void rb_span(const RowBatchesObject *rb, int64_t b, int64_t *lo, int64_t *n)
{
    *lo = b * rb->batch_size; /* n_batches * batch_size was checked against n_rows */
    *n = PL_MIN(rb->batch_size, rb->n_rows - *lo);
}

/* The rows to read ahead with batch b: the next batch's (the first batch's own too). */
static void rb_ahead(const RowBatchesObject *rb, int64_t b, int64_t *lo, int64_t *n)
{
    /* b * batch_size < n_rows (b is a batch): only the additions can overflow, so clamp */
    int64_t at = b * rb->batch_size, bs = PL_MIN(rb->batch_size, rb->n_rows);
    int64_t start = PL_MIN(at + (b ? bs : 0), rb->n_rows);
    int64_t end = PL_MIN(at + 2 * bs, rb->n_rows);
    *lo = start;
    *n = end > start ? end - start : 0;
}

static void rb_count_advice(rb_leaf *L, int64_t bytes)
{
    if (bytes > 0) {
        __atomic_fetch_add(&L->advised_batches, 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&L->advised_bytes, bytes, __ATOMIC_RELAXED);
    }
}

/* GIL held: the producer takes o for its own (0), or -1 with RuntimeError when another reader
 * already did. *n_leaves gets the leaves per batch. */
static int rb_adopt(PyObject *o, int *n_leaves)
{
    RowBatchesObject *rb = (RowBatchesObject *)o;
    if (rb->adopted || rb->reading || rb->next) {
        PyErr_SetString(PyExc_RuntimeError, "this epoch's RowBatches is already being read (an epoch "
                        "has one reader)");
        return -1;
    }
    rb->adopted = 1;
    *n_leaves = rb->n_leaves;
    return 0;
}

/* No GIL (o adopted, kept alive by the caller): the next batch's leaves into out[0..n_leaves).
 * Returns 1, 0 when the epoch is over, or -1 with the reason in why (the leaf's path first). */
static int rb_next_leaves(PyObject *o, pl_row_gather_leaf *out, char *why, size_t n_why)
{
    RowBatchesObject *rb = (RowBatchesObject *)o;
    if (rb->next >= rb->n_batches)
        return 0;
    int64_t b = rb->next++, lo, n, alo, an;
    for (int i = 0; i < rb->n_leaves; i++)
        if (rb->leaves[i].fd >= 0 && rb_file_check(&rb->leaves[i], why, n_why) < 0)
            return -1;
    rb_span(rb, b, &lo, &n);
    rb_ahead(rb, b, &alo, &an);
    for (int i = 0; i < rb->n_leaves; i++) {
        const rb_leaf *L = &rb->leaves[i];
        out[i] = L->lay;
        out[i].rows = rb->rows + lo;
        out[i].shape[0] = n;
        if (L->readahead)
            rb_count_advice(&rb->leaves[i], pl_advise_rows(L->lay.src, L->nd, L->shape, L->strides,
                                                        L->itemsize, L->window, rb->rows + alo, an));
    }
    return 1;
}

/* ---- RowBatches as a native source (Note [sources] in source.h) ---- */

/* What the producer's reader keeps: the batch's gathered leaves, n of them (PyMem_Raw). */
typedef struct {
    int n;
    pl_row_gather_leaf out[];
} rb_reader;

static int rb_source_open(PyObject *o, pl_flat *f, void **state, int *n_leaves)
{
    RowBatchesObject *rb = (RowBatchesObject *)o;
    rb_reader *r = PyMem_RawMalloc(sizeof(rb_reader) + (size_t)rb->n_leaves * sizeof(pl_row_gather_leaf));
    if (!r) {
        PyErr_NoMemory();
        return -1;
    }
    if (pl_flat_reserve_rows(f, rb->n_leaves) < 0 || rb_adopt(o, n_leaves) < 0) {
        PyMem_RawFree(r);
        return -1;
    }
    r->n = rb->n_leaves;
    *state = r;
    return 0;
}

/* No GIL: batch b's leaves are the sources' layouts over its slice of the epoch table. */
static int rb_source_next(PyObject *o, void *state, pl_flat *f, pl_source_ctx *ctx, char *why, size_t n_why)
{
    rb_reader *r = state;
    int64_t t0 = pl_now_ns();
    int rc = rb_next_leaves(o, r->out, why, n_why);
    if (rc > 0) {
        pl_flat_begin(f);
        for (int i = 0; i < r->n && rc > 0; i++)
            if (pl_flat_add_rows(f, &r->out[i], why, n_why) < 0)
                rc = -1;
        if (rc > 0)
            pl_flat_finish_rows(f);
    }
    ctx->next_ns = pl_now_ns() - t0;
    return rc > 0 ? PL_SOURCE_BATCH : rc == 0 ? PL_SOURCE_END : PL_SOURCE_ERROR;
}

static void rb_source_close(void *state)
{
    PyMem_RawFree(state);
}

static const pl_source_ops rb_source = {
    .name = "an ArrayLoader epoch (RowBatches)",
    .needs_gil = 0,
    .open = rb_source_open,
    .next = rb_source_next,
    .close = rb_source_close,
};

static void rb_clear_leaves(RowBatchesObject *rb)
{
    rb_leaf *leaves = rb->leaves;
    int n = rb->n_leaves;
    rb->leaves = NULL;
    rb->n_leaves = 0;
    for (int i = 0; i < n; i++) {
        Py_XDECREF(leaves[i].probe);
        Py_XDECREF(leaves[i].file);
        PyMem_RawFree(leaves[i].path);
        PyMem_RawFree(leaves[i].name);
    }
    PyMem_Free(leaves);
}

/* One entry of `leaves`, (path, probe, readahead, file, need, name), into L. */
static int rb_leaf_init(pl_state *st, rb_leaf *L, PyObject *entry, const epoch_table *t)
{
    const char *path, *name = NULL;
    PyObject *probe, *file;
    int readahead, fd = -1;
    long long need;
    if (!PyTuple_Check(entry)) {
        PyErr_Format(PyExc_TypeError, "RowBatches: each leaf must be a tuple, not %.100s", Py_TYPE(entry)->tp_name);
        return -1;
    }
    if (!PyArg_ParseTuple(entry, "sO!pOLz:RowBatches leaf", &path, st->RowGather_Type, &probe, &readahead,
                          &file, &need, &name))
        return -1;
    if (file != Py_None) {
        if (!name || need < 0) {
            PyErr_SetString(PyExc_ValueError, "RowBatches: a file-mapped leaf needs its file's name and size");
            return -1;
        }
        if ((fd = PyObject_AsFileDescriptor(file)) < 0)
            return -1;
    }
    RowGatherObject *g = (RowGatherObject *)probe;
    PyArrayObject *a = (PyArrayObject *)g->array;
    pl_row_gather_layout(probe, &L->lay);
    /* every row of the epoch, with its window, inside this source: checked once here */
    if (t->n && (t->lo < 0 || t->hi > L->lay.n_items - 1)) {
        PyErr_Format(PyExc_IndexError, "%s: the epoch order holds rows %lld to %lld, but the source has "
                     "%lld items", path, (long long)t->lo, (long long)t->hi, (long long)L->lay.n_items);
        return -1;
    }
    L->probe = Py_NewRef(probe);
    L->readahead = readahead;
    L->nd = PyArray_NDIM(a);
    memcpy(L->shape, PyArray_DIMS(a), (size_t)L->nd * sizeof(npy_intp));
    memcpy(L->strides, PyArray_STRIDES(a), (size_t)L->nd * sizeof(npy_intp));
    L->itemsize = (size_t)PyArray_ITEMSIZE(a);
    L->window = g->window;
    L->need = need;
    L->path = raw_strdup(path);
    L->name = name ? raw_strdup(name) : NULL;
    if (!L->path || (name && !L->name)) {
        PyErr_NoMemory();
        return -1;
    }
    if (fd >= 0) {
        L->file = Py_NewRef(file); /* owns fd: it stays open while this RowBatches lives */
        L->fd = fd;
    }
    return 0;
}

static PyObject *rb_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"leaves", "order", "batch_size", "n_batches", NULL};
    PyObject *leaves, *order;
    long long bs, nb;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OLL:RowBatches", kwlist, &PyList_Type, &leaves, &order,
                                     &bs, &nb))
        return NULL;
    pl_state *st = pl_state_of_type(type);
    PyObject *cap;
    const epoch_table *t = PyArray_Check(order) ? pl_epoch_table_of((PyArrayObject *)order, &cap) : NULL;
    if (!t)
        return PyErr_Format(PyExc_TypeError, "RowBatches: order must be an epoch table (epoch_table), "
                            "not %.100s", Py_TYPE(order)->tp_name);
    int64_t n_rows = PyArray_SIZE((PyArrayObject *)order);
    if (bs < 1 || nb < 0 || nb > n_rows / bs + (n_rows % bs != 0))
        return PyErr_Format(PyExc_ValueError, "RowBatches: %lld batches of %lld rows do not fit an "
                            "order of %lld rows", nb, bs, (long long)n_rows);
    Py_ssize_t n = PyList_GET_SIZE(leaves);
    if (n < 1 || n > INT_MAX / 2)
        return PyErr_Format(PyExc_ValueError, "RowBatches: %zd leaves", n);
    RowBatchesObject *rb = (RowBatchesObject *)type->tp_alloc(type, 0);
    if (!rb)
        return NULL;
    rb->order = Py_NewRef(order);
    rb->table = Py_NewRef(cap);
    rb->rows = PyArray_DATA((PyArrayObject *)order);
    rb->n_rows = n_rows;
    rb->batch_size = bs;
    rb->n_batches = nb;
    rb->leaves = PyMem_Calloc((size_t)n, sizeof(rb_leaf));
    if (!rb->leaves) {
        Py_DECREF(rb);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++)
        rb->leaves[i].fd = -1;
    rb->n_leaves = (int)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* the list may change under a leaf's parsing (a str subclass...): hold the entry */
        PyObject *entry = i < PyList_GET_SIZE(leaves) ? Py_NewRef(PyList_GET_ITEM(leaves, i)) : NULL;
        int rc = entry ? rb_leaf_init(st, &rb->leaves[i], entry, t) : -1;
        if (!entry)
            PyErr_SetString(PyExc_RuntimeError, "RowBatches: the leaves list changed while it was read");
        Py_XDECREF(entry);
        if (rc < 0) {
            Py_DECREF(rb);
            return NULL;
        }
    }
    if (PyList_GET_SIZE(leaves) != n) {
        Py_DECREF(rb);
        return PyErr_Format(PyExc_RuntimeError, "RowBatches: the leaves list changed while it was read");
    }
    return (PyObject *)rb;
}

/* Read from Python: the next batch as a tuple of RowGathers (Note [native epochs]). */
static PyObject *rb_next(PyObject *op)
{
    RowBatchesObject *rb = (RowBatchesObject *)op;
    if (rb->adopted || rb->reading) {
        PyErr_SetString(PyExc_RuntimeError, "this epoch's RowBatches is already being read (an epoch "
                        "has one reader)");
        return NULL;
    }
    if (rb->next >= rb->n_batches)
        return NULL;
    int64_t b = rb->next, lo, n, alo, an; /* advanced once the batch is made */
    char why[640];
    for (int i = 0; i < rb->n_leaves; i++)
        if (rb->leaves[i].fd >= 0 && rb_file_check(&rb->leaves[i], why, sizeof why) < 0)
            return PyErr_Format(PyExc_ValueError, "%s", why);
    rb_span(rb, b, &lo, &n);
    rb_ahead(rb, b, &alo, &an);
    rb->reading = 1;
    PyObject *rows = PySequence_GetSlice(rb->order, lo, lo + n);
    PyObject *ahead = rows ? PySequence_GetSlice(rb->order, alo, alo + an) : NULL;
    PyObject *out = ahead ? PyTuple_New(rb->n_leaves) : NULL;
    for (int i = 0; out && i < rb->n_leaves; i++) {
        const rb_leaf *L = &rb->leaves[i];
        RowGatherObject *g = (RowGatherObject *)L->probe;
        PyObject *w = g->window ? PyLong_FromLongLong(g->window) : Py_NewRef(Py_None);
        PyObject *leaf = w ? PyObject_CallFunction((PyObject *)Py_TYPE(L->probe), "OOOOO", g->array, rows, w,
                                                   L->readahead ? ahead : Py_None,
                                                   g->registration ? g->registration : Py_None)
                           : NULL;
        Py_XDECREF(w);
        if (!leaf) {
            Py_CLEAR(out);
        } else {
            rb_count_advice(&rb->leaves[i], ((RowGatherObject *)leaf)->advised);
            PyTuple_SET_ITEM(out, i, leaf);
        }
    }
    Py_XDECREF(rows);
    Py_XDECREF(ahead);
    rb->reading = 0;
    if (out)
        rb->next = b + 1;
    return out;
}

static int rb_traverse(PyObject *op, visitproc visit, void *arg)
{
    RowBatchesObject *rb = (RowBatchesObject *)op;
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(rb->order);
    Py_VISIT(rb->table);
    for (int i = 0; i < rb->n_leaves; i++) {
        Py_VISIT(rb->leaves[i].probe);
        Py_VISIT(rb->leaves[i].file);
    }
    return 0;
}

static void rb_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    RowBatchesObject *rb = (RowBatchesObject *)op;
    PyObject_GC_UnTrack(op);
    rb_clear_leaves(rb);
    Py_CLEAR(rb->order);
    Py_CLEAR(rb->table);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyObject *rb_len(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    RowBatchesObject *rb = (RowBatchesObject *)op;
    return PyLong_FromLongLong(rb->n_batches - (rb->adopted ? 0 : rb->next));
}

static PyObject *rb_get_adopted(PyObject *op, void *c)
{
    (void)c;
    return PyBool_FromLong(((RowBatchesObject *)op)->adopted);
}

static PyObject *rb_get_advised(PyObject *op, void *c)
{
    (void)c;
    RowBatchesObject *rb = (RowBatchesObject *)op;
    PyObject *out = PyTuple_New(rb->n_leaves);
    for (int i = 0; out && i < rb->n_leaves; i++) {
        PyObject *v = Py_BuildValue("(LL)", (long long)__atomic_load_n(&rb->leaves[i].advised_batches, __ATOMIC_RELAXED),
                                    (long long)__atomic_load_n(&rb->leaves[i].advised_bytes, __ATOMIC_RELAXED));
        if (!v)
            Py_CLEAR(out);
        else
            PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

static PyMethodDef rb_methods[] = {
    {"__length_hint__", rb_len, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef rb_getset[] = {
    {"adopted", rb_get_adopted, NULL, "True once a prefetcher's producer reads the batches (in C, without the GIL)", NULL},
    {"advised", rb_get_advised, NULL, "per leaf, (batches, bytes) of read-ahead given to madvise so far", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(rb_doc,
"RowBatches(leaves, order, batch_size, n_batches)\n--\n\n"
"One epoch of an ArrayLoader (Note [native epochs] in src/py/row_batches.c): batch b is rows\n"
"order[b*batch_size:(b+1)*batch_size] of every leaf. `leaves`: a list of (path, probe,\n"
"readahead, file, need, name): probe a RowGather over the source (its rows unused), file None\n"
"or an object with fileno() (held) of the file the source maps, named `name`, whose size must\n"
"stay >= need.\n"
"`order`: an epoch table (epoch_table). An AsyncPrefetcher makes the batches in C without\n"
"the GIL; iterated from Python it yields tuples of RowGathers. One reader per epoch.");

static PyType_Slot rb_slots[] = {
    {Py_tp_new, rb_new},
    {Py_tp_dealloc, rb_dealloc},
    {Py_tp_traverse, rb_traverse},
    {Py_tp_iter, PyObject_SelfIter},
    {Py_tp_iternext, rb_next},
    {Py_tp_methods, rb_methods},
    {Py_tp_getset, rb_getset},
    {Py_tp_doc, (void *)rb_doc},
    {0, NULL},
};

static PyType_Spec rb_spec = {
    .name = "pinloader._C.RowBatches",
    .basicsize = sizeof(RowBatchesObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = rb_slots,
};

int pl_array_types_init(PyObject *m, pl_state *st)
{
    if (pl_row_gather_init(m, st) < 0 || pl_registration_init(m, st) < 0)
        return -1;
    st->RowBatches_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &rb_spec, NULL);
    if (!st->RowBatches_Type || PyModule_AddObjectRef(m, "RowBatches", (PyObject *)st->RowBatches_Type) < 0 ||
        pl_source_register(st, st->RowBatches_Type, &rb_source) < 0)
        return -1;
    if (pl_epoch_table_init(m) < 0)
        return -1;
    return pl_epoch_order_init(m);
}
