/* pinloader._C.RowGather: rows of a source array as a batch leaf, the native half of
 * ArrayLoader (pinloader/array_loader.py) with row_batches.c, epoch_table.c and
 * registration.c (gather_impl.h).
 *
 * Note [array sources]
 * A RowGather names rows of a source array; it is a leaf like any array, except that the
 * prefetcher's flatten lays it out as a row-gathered leaf (see Note [row gather] in stager.c)
 * and the staging threads read the rows straight from the source into the pinned region: the
 * only host copy. Everything the gather will touch is fixed and validated here, with the GIL,
 * when the RowGather is made:
 * - the source is held for the RowGather's life: the array itself, and a buffer export on the
 *   first non-array object it views (the mmap.mmap under an np.memmap, a bytearray...), so
 *   closing or resizing that object while rows are in flight is refused by Python itself
 *   (BufferError); NumPy refuses to resize an array that others reference. A torch tensor's
 *   DLPack export keeps the tensor, not its memory: `set_`, `.data =` or a growing `resize_`
 *   would free what the view reads. The export held is then one on a NumPy view of the tensor
 *   (`tensor.detach().numpy()`), which keeps the storage alive and makes torch refuse to
 *   resize it, for good (torch_hold);
 * - the array rows are read from is the RowGather's own view of the source (a new ndarray over
 *   the same memory that nobody else references), so assigning `a.shape` or `a.dtype` on the
 *   caller's array, from any thread, cannot change the layout the staging threads or the
 *   device gather read later;
 * - the rows are copied into memory the RowGather owns (the caller's array may change after)
 *   and each one checked, with its window, against the source's first dimension;
 * - the gathered size is computed with checked arithmetic.
 * The source is never copied or pinned as a whole: a memory-mapped file larger than RAM is
 * read a batch at a time through the page cache.
 *
 * Note [read-ahead]
 * For memory-mapped sources the caller passes the next batch's rows as `readahead`: their
 * page ranges, sorted and merged, are given to madvise(MADV_WILLNEED) with the GIL released,
 * so the kernel reads them in while this batch is staged and copied. Failures of madvise are
 * ignored (it is advice: a range that is not a file mapping gains nothing and loses nothing).
 */
#include "gather_impl.h"

#include "util.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

void pl_row_gather_layout(PyObject *o, pl_row_gather_leaf *out)
{
    RowGatherObject *g = (RowGatherObject *)o;
    PyArrayObject *a = (PyArrayObject *)g->array;
    int nd = PyArray_NDIM(a), k = 0;
    out->src = PyArray_DATA(a);
    out->reg = NULL;
    out->span = 0;
    out->n_items = PyArray_DIMS(a)[0] - (g->window ? g->window - 1 : 0);
    if (g->registration) {
        out->reg = g->reg;
        out->span = ((RegistrationObject *)g->registration)->span;
    }
    out->dtype = g->dtype;
    out->rows = g->rows;
    out->shape[k] = g->n_rows;
    out->strides[k++] = PyArray_STRIDES(a)[0];
    if (g->window) {
        out->shape[k] = g->window;
        out->strides[k++] = PyArray_STRIDES(a)[0];
    }
    for (int d = 1; d < nd; d++, k++) {
        out->shape[k] = PyArray_DIMS(a)[d];
        out->strides[k] = PyArray_STRIDES(a)[d];
    }
    out->ndim = k;
}

/* ---- the source ---- */

/* Hold an export on the first non-array object that `a` views (see Note [array sources]). */
static void hold_base(RowGatherObject *g, PyArrayObject *a)
{
    PyObject *base = PyArray_BASE(a);
    for (int hops = 0; base && hops < 16; hops++) {
        if (PyArray_Check(base)) {
            base = PyArray_BASE((PyArrayObject *)base);
            continue;
        }
        if (PyObject_CheckBuffer(base) && PyObject_GetBuffer(base, &g->held, PyBUF_SIMPLE) == 0)
            return;
        PyErr_Clear(); /* not an exporter that can be held (a DLPack capsule's owner...) */
        g->held.obj = NULL;
        return;
    }
}

/* For a CPU torch tensor (duck-typed: detach() and numpy()), a buffer export on a NumPy view
 * of it, into g->held: see the note at the top of this file. 0 when it is held or src is not
 * such a tensor (an Exception from torch is not an error here: the source stays read through
 * DLPack, unheld, as any exporter), -1 with a KeyboardInterrupt or SystemExit. */
static int torch_hold(RowGatherObject *g, PyObject *src)
{
    if (g->held.obj || !PyObject_HasAttrString((PyObject *)Py_TYPE(src), "untyped_storage"))
        return 0;
    PyObject *det = PyObject_CallMethod(src, "detach", NULL);
    PyObject *view = det ? PyObject_CallMethod(det, "numpy", NULL) : NULL;
    Py_XDECREF(det);
    if (view && PyObject_GetBuffer(view, &g->held, PyBUF_FULL_RO) < 0)
        g->held.obj = NULL;
    Py_XDECREF(view);
    if (g->held.obj)
        return 0;
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception))
        return -1;
    PyErr_Clear();
    return 0;
}

/* Whether o has the attribute: 1 or 0, or -1 with a KeyboardInterrupt or SystemExit raised
 * while looking (which stay what they are); any other error reads as "no". */
static int has_attr(PyObject *o, const char *name)
{
    PyObject *v = PyObject_GetAttrString(o, name);
    if (v) {
        Py_DECREF(v);
        return 1;
    }
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return -1;
    PyErr_Clear();
    return 0;
}

/* The source as an ndarray (new reference), its owners held in g. */
static PyObject *source_array(RowGatherObject *g, PyObject *src)
{
    if (PyArray_Check(src)) {
        hold_base(g, (PyArrayObject *)src);
        return Py_NewRef(src);
    }
    int dl = has_attr(src, "__dlpack_device__");
    if (dl > 0)
        dl = has_attr(src, "__dlpack__");
    if (dl < 0)
        return NULL;
    if (dl) {
        PyObject *dev = PyObject_CallMethod(src, "__dlpack_device__", NULL);
        if (!dev)
            return NULL;
        int type = -1, id = -1;
        int ok = PyArg_ParseTuple(dev, "ii", &type, &id);
        Py_DECREF(dev);
        if (!ok) {
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return NULL; /* a KeyboardInterrupt from an __index__: as it is */
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "source: __dlpack_device__() did not return (device_type, device_id)");
            return NULL;
        }
        if (type != kDLCPU && type != kDLCUDAHost) {
            if (type == kDLCUDA || type == kDLCUDAManaged)
                PyErr_Format(PyExc_ValueError, "source is on cuda:%d: ArrayLoader reads rows from host "
                             "memory (RAM or a memory-mapped file); keep the dataset on the CPU", id);
            else
                PyErr_Format(PyExc_ValueError, "source is on DLPack device type %d: ArrayLoader reads rows "
                             "from host memory (RAM or a memory-mapped file)", type);
            return NULL;
        }
        PyObject *np = PyImport_ImportModule("numpy");
        PyObject *arr = np ? PyObject_CallMethod(np, "from_dlpack", "O", src) : NULL;
        Py_XDECREF(np);
        if (!arr && !PyErr_ExceptionMatches(PyExc_Exception))
            return NULL; /* KeyboardInterrupt, SystemExit: as they are */
        if (!arr || !PyArray_Check(arr)) {
            PyObject *type_, *value, *tb;
            PyErr_Fetch(&type_, &value, &tb);
            PyErr_NormalizeException(&type_, &value, &tb);
            PyObject *s = value ? PyObject_Str(value) : NULL;
            PyErr_Format(PyExc_TypeError, "source: could not read it through DLPack: %s",
                         s ? PyUnicode_AsUTF8(s) : "not an array");
            Py_XDECREF(s);
            Py_XDECREF(type_);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            Py_XDECREF(arr);
            return NULL;
        }
        hold_base(g, (PyArrayObject *)arr);
        if (torch_hold(g, src) < 0) {
            Py_DECREF(arr);
            return NULL;
        }
        return arr;
    }
    if (PyObject_CheckBuffer(src)) {
        /* Hold the export first, so the object cannot change between here and the array. An
         * exporter that refuses every request (a closed mmap, a released memoryview) says why:
         * NumPy would read it as a 0-d object array instead. One that refuses only a simple
         * (contiguous) export is read by NumPy through its strides, unheld. */
        if (PyObject_GetBuffer(src, &g->held, PyBUF_SIMPLE) < 0) {
            g->held.obj = NULL;
            PyErr_Clear();
            Py_buffer probe;
            if (PyObject_GetBuffer(src, &probe, PyBUF_FULL_RO) == 0) {
                PyBuffer_Release(&probe);
            } else if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError) ||
                       PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyObject *type_, *value, *tb;
                PyErr_Fetch(&type_, &value, &tb);
                PyObject *msg = value ? PyObject_Str(value) : NULL;
                const char *why = msg ? PyUnicode_AsUTF8(msg) : NULL;
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "source: the %.100s cannot be read: %s", Py_TYPE(src)->tp_name,
                             why ? why : "it exports no buffer");
                Py_XDECREF(msg);
                Py_XDECREF(type_);
                Py_XDECREF(value);
                Py_XDECREF(tb);
                return NULL;
            } else {
                return NULL;
            }
        }
        PyObject *arr = PyArray_FromAny(src, NULL, 0, 0, 0, NULL);
        if (!arr && PyErr_ExceptionMatches(PyExc_Exception)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "source: buffer-protocol object could not be read as an array");
        }
        return arr;
    }
    PyErr_Format(PyExc_TypeError, "source must be a NumPy array (or np.memmap), a CPU DLPack exporter "
                 "or a buffer-protocol object, not %.100s", Py_TYPE(src)->tp_name);
    return NULL;
}

/* ---- rows ---- */

/* Copy `obj` (1-D integers) into a new PyMem_Malloc'd table, each entry r checked:
 * 0 <= r and r + span <= limit. Returns 0, or -1 with an exception naming `what`. */
static int read_rows(PyObject *obj, const char *what, int64_t span, int64_t limit, int64_t **out,
                     Py_ssize_t *n_out)
{
    PyArrayObject *a = (PyArrayObject *)PyArray_FROM_O(obj);
    if (!a)
        return -1;
    if (PyArray_NDIM(a) != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-D sequence of row indices, got %d dimensions",
                     what, PyArray_NDIM(a));
        Py_DECREF(a);
        return -1;
    }
    char kind = PyArray_DESCR(a)->kind;
    if (PyArray_SIZE(a) > 0 && kind != 'i' && kind != 'u') {
        PyErr_Format(PyExc_TypeError, "%s must hold integers, not dtype kind '%c'", what, kind);
        Py_DECREF(a);
        return -1;
    }
    PyArray_Descr *i64 = PyArray_DescrFromType(NPY_INT64);
    PyArrayObject *c = (PyArrayObject *)PyArray_FromAny((PyObject *)a, i64, 1, 1,
                                                        NPY_ARRAY_CARRAY_RO | NPY_ARRAY_FORCECAST, NULL);
    if (!c) {
        Py_DECREF(a);
        return -1;
    }
    Py_ssize_t n = PyArray_SIZE(c);
    const int64_t *v = PyArray_DATA(c);
    int64_t *rows = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    if (!rows) {
        Py_DECREF(c);
        Py_DECREF(a);
        PyErr_NoMemory();
        return -1;
    }
    int is_unsigned = kind == 'u';
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = v[i];
        /* a uint64 above INT64_MAX reads as negative: out of range either way */
        if (r < 0 || r > limit - span) {
            if (span > 1)
                PyErr_Format(PyExc_IndexError, "%s[%zd] = %lld: a window of %lld rows starting there "
                             "does not fit in a source of %lld rows", what, i,
                             (long long)r, (long long)span, (long long)limit);
            else if (r < 0 && is_unsigned)
                PyErr_Format(PyExc_IndexError, "%s[%zd] = %llu is out of range for a source of %lld rows",
                             what, i, (unsigned long long)r, (long long)limit);
            else
                PyErr_Format(PyExc_IndexError, "%s[%zd] = %lld is out of range for a source of %lld rows",
                             what, i, (long long)r, (long long)limit);
            PyMem_Free(rows);
            Py_DECREF(c);
            Py_DECREF(a);
            return -1;
        }
        rows[i] = r;
    }
    Py_DECREF(c);
    Py_DECREF(a);
    *out = rows;
    *n_out = n;
    return 0;
}

/* ---- read-ahead (Note [read-ahead]) ---- */

typedef struct {
    uintptr_t lo, hi;
} span;

static int cmp_span(const void *a, const void *b)
{
    const span *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Bytes advised. No GIL: plain C over memory the caller keeps alive. */
int64_t pl_advise_rows(const char *data, int nd, const npy_intp *shape, const npy_intp *strides,
                       size_t itemsize, int64_t window, const int64_t *rows, Py_ssize_t n)
{
    if (n <= 0)
        return 0;
    /* extent of one row (or window) relative to its element [r, 0, ...] */
    int64_t lo = 0, hi = (int64_t)itemsize;
    for (int d = 1; d < nd; d++) {
        int64_t ext = (int64_t)(shape[d] - 1) * strides[d];
        if (shape[d] == 0)
            return 0;
        if (ext < 0)
            lo += ext;
        else
            hi += ext;
    }
    if (window > 1) {
        int64_t ext = (window - 1) * strides[0];
        if (ext < 0)
            lo += ext;
        else
            hi += ext;
    }
    span *s = malloc((size_t)n * sizeof(span));
    if (!s)
        return 0;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *p = data + rows[i] * strides[0];
        s[i].lo = (uintptr_t)(p + lo) & ~(page - 1);
        s[i].hi = ((uintptr_t)(p + hi) + page - 1) & ~(page - 1);
    }
    qsort(s, (size_t)n, sizeof(span), cmp_span);
    int64_t total = 0;
    uintptr_t a = s[0].lo, b = s[0].hi;
    for (Py_ssize_t i = 1; i <= n; i++) {
        if (i < n && s[i].lo <= b) {
            if (s[i].hi > b)
                b = s[i].hi;
            continue;
        }
        if (madvise((void *)a, b - a, MADV_WILLNEED) == 0)
            total += (int64_t)(b - a);
        if (i < n) {
            a = s[i].lo;
            b = s[i].hi;
        }
    }
    free(s);
    return total;
}

/* ---- the type ---- */

static void rg_clear_fields(RowGatherObject *g)
{
    if (g->held.obj)
        PyBuffer_Release(&g->held);
    g->held.obj = NULL;
    Py_CLEAR(g->array);
    Py_CLEAR(g->source);
    Py_CLEAR(g->registration);
    pl_hostreg *h = g->reg;
    g->reg = NULL;
    if (h) { /* a range inherited through fork() is left alone (pl_hostreg_release) */
        Py_BEGIN_ALLOW_THREADS
        pl_hostreg_release(h);
        Py_END_ALLOW_THREADS
    }
    if (g->rows_owner)
        Py_CLEAR(g->rows_owner); /* borrowed from an epoch table */
    else
        PyMem_Free(g->rows);
    g->rows = NULL;
}

static PyObject *rg_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"source", "rows", "window", "readahead", "registration", NULL};
    PyObject *src, *rows_obj, *window_obj = Py_None, *ahead_obj = Py_None, *reg_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OOO:RowGather", kwlist, &src, &rows_obj,
                                     &window_obj, &ahead_obj, &reg_obj))
        return NULL;
    RowGatherObject *g = (RowGatherObject *)type->tp_alloc(type, 0);
    if (!g)
        return NULL;
    g->held.obj = NULL;
    g->source = Py_NewRef(src);
    PyObject *arr = source_array(g, src);
    if (!arr)
        goto error;
    /* the RowGather's own view (Note [array sources]); a plain ndarray, so that no subclass
     * code (np.memmap's __array_finalize__) runs */
    Py_INCREF(PyArray_DESCR((PyArrayObject *)arr));
    g->array = PyArray_NewFromDescr(&PyArray_Type, PyArray_DESCR((PyArrayObject *)arr),
                                    PyArray_NDIM((PyArrayObject *)arr), PyArray_DIMS((PyArrayObject *)arr),
                                    PyArray_STRIDES((PyArrayObject *)arr), PyArray_DATA((PyArrayObject *)arr),
                                    PyArray_FLAGS((PyArrayObject *)arr) & ~NPY_ARRAY_WRITEABLE, NULL);
    if (!g->array || PyArray_SetBaseObject((PyArrayObject *)g->array, arr) < 0) {
        if (!g->array)
            Py_DECREF(arr);
        goto error;
    }
    PyArrayObject *a = (PyArrayObject *)g->array;
    g->writeable = PyArray_ISWRITEABLE((PyArrayObject *)arr);
    PyArray_Descr *d = PyArray_DESCR(a);
    const char *why = NULL;
    if (pl_dtype_from_numpy(d->kind, (int)PyDataType_ELSIZE(d), d->type_num, d->byteorder, &g->dtype, &why) < 0) {
        PyObject *dr = PyObject_Str((PyObject *)d);
        PyErr_Format(PyExc_TypeError, "source: %s (dtype %s)", why, dr ? PyUnicode_AsUTF8(dr) : "?");
        Py_XDECREF(dr);
        goto error;
    }
    const int nd = PyArray_NDIM(a);
    if (nd < 1) {
        PyErr_SetString(PyExc_ValueError, "source must have at least one dimension (its rows), got a 0-d array");
        goto error;
    }
    const int64_t n_src = PyArray_DIMS(a)[0];
    if (window_obj != Py_None) {
        if (PyBool_Check(window_obj) || !PyLong_Check(window_obj)) {
            PyErr_Format(PyExc_TypeError, "window must be an int or None, not %.100s", Py_TYPE(window_obj)->tp_name);
            goto error;
        }
        long long w = PyLong_AsLongLong(window_obj);
        if (w == -1 && PyErr_Occurred())
            goto error;
        if (w < 1) {
            PyErr_Format(PyExc_ValueError, "window must be >= 1, got %lld", w);
            goto error;
        }
        if (w > n_src) {
            PyErr_Format(PyExc_ValueError, "a window of %lld rows is longer than the source (%lld rows)",
                         w, (long long)n_src);
            goto error;
        }
        g->window = w;
    }
    if (nd + (g->window ? 1 : 0) > PL_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "source has too many dimensions (%d)", nd);
        goto error;
    }
    const int64_t span_rows = g->window ? g->window : 1;
    if (!pl_borrow_rows(rows_obj, span_rows, n_src, &g->rows, &g->n_rows, &g->rows_owner) &&
        read_rows(rows_obj, "rows", span_rows, n_src, &g->rows, &g->n_rows) < 0)
        goto error;
    /* the gathered size, checked: n * window * row elements * itemsize */
    int64_t total = (int64_t)PyDataType_ELSIZE(d);
    int overflow = __builtin_mul_overflow(total, (int64_t)g->n_rows, &total) ||
                   __builtin_mul_overflow(total, span_rows, &total);
    for (int i = 1; i < nd && !overflow; i++)
        overflow = __builtin_mul_overflow(total, (int64_t)PyArray_DIMS(a)[i], &total);
    if (overflow || total > PY_SSIZE_T_MAX) {
        PyErr_SetString(PyExc_OverflowError, "the gathered rows would be larger than the address space");
        goto error;
    }
    if (reg_obj != Py_None && pl_attach_registration(g, reg_obj) < 0)
        goto error;
    if (ahead_obj != Py_None) {
        int64_t *ahead;
        Py_ssize_t n_ahead;
        PyObject *ahead_owner = NULL;
        if (!pl_borrow_rows(ahead_obj, span_rows, n_src, &ahead, &n_ahead, &ahead_owner) &&
            read_rows(ahead_obj, "readahead", span_rows, n_src, &ahead, &n_ahead) < 0)
            goto error;
        const char *data = PyArray_DATA(a);
        const npy_intp *shape = PyArray_DIMS(a), *strides = PyArray_STRIDES(a);
        size_t isz = (size_t)PyDataType_ELSIZE(d);
        int64_t w = g->window, advised;
        /* the array and its owner are held by g: the mapping stays while the GIL is released */
        Py_BEGIN_ALLOW_THREADS
        advised = pl_advise_rows(data, nd, shape, strides, isz, w, ahead, n_ahead);
        Py_END_ALLOW_THREADS
        g->advised = advised;
        if (ahead_owner)
            Py_DECREF(ahead_owner);
        else
            PyMem_Free(ahead);
    }
    return (PyObject *)g;

error:
    Py_DECREF(g);
    return NULL;
}

static int rg_traverse(PyObject *op, visitproc visit, void *arg)
{
    RowGatherObject *g = (RowGatherObject *)op;
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(g->array);
    Py_VISIT(g->source);
    Py_VISIT(g->registration);
    Py_VISIT(g->rows_owner);
    return 0;
}

static void rg_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    rg_clear_fields((RowGatherObject *)op);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyObject *shape_tuple(const npy_intp *shape, int nd)
{
    PyObject *t = PyTuple_New(nd);
    for (int i = 0; t && i < nd; i++) {
        PyObject *v = PyLong_FromSsize_t(shape[i]);
        if (!v) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

static PyObject *rg_get_shape(PyObject *op, void *c)
{
    (void)c;
    pl_row_gather_leaf L;
    pl_row_gather_layout(op, &L);
    return shape_tuple(L.shape, L.ndim);
}

static PyObject *rg_get_source_shape(PyObject *op, void *c)
{
    (void)c;
    PyArrayObject *a = (PyArrayObject *)((RowGatherObject *)op)->array;
    return shape_tuple(PyArray_DIMS(a), PyArray_NDIM(a));
}

static PyObject *rg_get_dtype(PyObject *op, void *c)
{
    (void)c;
    return Py_NewRef((PyObject *)PyArray_DESCR((PyArrayObject *)((RowGatherObject *)op)->array));
}

static PyObject *rg_get_rows(PyObject *op, void *c)
{
    (void)c;
    RowGatherObject *g = (RowGatherObject *)op;
    npy_intp n = g->n_rows;
    PyObject *out = PyArray_SimpleNew(1, &n, NPY_INT64);
    if (out && n)
        memcpy(PyArray_DATA((PyArrayObject *)out), g->rows, (size_t)n * sizeof(int64_t));
    return out;
}

static PyObject *rg_get_window(PyObject *op, void *c)
{
    (void)c;
    RowGatherObject *g = (RowGatherObject *)op;
    if (!g->window)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(g->window);
}

static PyObject *rg_get_array(PyObject *op, void *c)
{
    (void)c;
    return Py_NewRef(((RowGatherObject *)op)->array);
}

static PyObject *rg_get_registration(PyObject *op, void *c)
{
    (void)c;
    RowGatherObject *g = (RowGatherObject *)op;
    return Py_NewRef(g->registration ? g->registration : Py_None);
}

static PyObject *rg_get_advised(PyObject *op, void *c)
{
    (void)c;
    return PyLong_FromLongLong(((RowGatherObject *)op)->advised);
}

static PyObject *rg_get_nbytes(PyObject *op, void *c)
{
    (void)c;
    pl_row_gather_leaf L;
    pl_row_gather_layout(op, &L);
    int64_t n = L.dtype.bits / 8;
    for (int i = 0; i < L.ndim; i++)
        n *= L.shape[i]; /* checked when the RowGather was made */
    return PyLong_FromLongLong(n);
}

static PyObject *rg_repr(PyObject *op)
{
    RowGatherObject *g = (RowGatherObject *)op;
    PyObject *shape = rg_get_shape(op, NULL);
    if (!shape)
        return NULL;
    PyObject *r = PyUnicode_FromFormat("RowGather(rows=%zd, shape=%R, dtype=%R, window=%lld)", g->n_rows,
                                       shape, (PyObject *)PyArray_DESCR((PyArrayObject *)g->array),
                                       (long long)g->window);
    Py_DECREF(shape);
    return r;
}

static PyGetSetDef rg_getset[] = {
    {"shape", rg_get_shape, NULL, "shape of the gathered leaf", NULL},
    {"source_shape", rg_get_source_shape, NULL, "shape of the source array", NULL},
    {"dtype", rg_get_dtype, NULL, "the source's dtype", NULL},
    {"rows", rg_get_rows, NULL, "the row indices (window starts), a copy", NULL},
    {"window", rg_get_window, NULL, "rows per window, or None", NULL},
    {"array", rg_get_array, NULL, "the RowGather's own read-only view of the source, which rows are read from", NULL},
    {"registration", rg_get_registration, NULL, "the Registration its rows are device-gathered through, or None", NULL},
    {"nbytes", rg_get_nbytes, NULL, "bytes of the gathered leaf", NULL},
    {"advised_bytes", rg_get_advised, NULL, "bytes of read-ahead given to madvise", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(rg_doc,
"RowGather(source, rows, window=None, readahead=None, registration=None)\n--\n\n"
"Rows of `source` as a batch leaf: AsyncPrefetcher gathers source[rows] (or, with window=L,\n"
"the windows source[r:r+L] for r in rows) straight into pinned memory with its staging\n"
"threads. `source` is a NumPy array or np.memmap, a CPU DLPack exporter or a buffer-protocol\n"
"object with at least one dimension; it is held (and cannot be closed or resized) while the\n"
"RowGather lives (a CPU torch tensor: through a NumPy view of it, so torch refuses to resize\n"
"its storage from then on). `rows` is copied and checked. `readahead`: rows to advise the kernel about\n"
"(madvise WILLNEED), for memory-mapped sources. `registration` (from register_rows): the rows\n"
"are read by the device gather instead, a kernel over the registered source.");

static PyType_Slot rg_slots[] = {
    {Py_tp_new, rg_new},
    {Py_tp_dealloc, rg_dealloc},
    {Py_tp_traverse, rg_traverse},
    {Py_tp_getset, rg_getset},
    {Py_tp_repr, rg_repr},
    {Py_tp_doc, (void *)rg_doc},
    {0, NULL},
};

static PyType_Spec rg_spec = {
    .name = "pinloader._C.RowGather",
    .basicsize = sizeof(RowGatherObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = rg_slots,
};

int pl_row_gather_init(PyObject *m, pl_state *st)
{
    st->RowGather_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &rg_spec, NULL);
    if (!st->RowGather_Type || PyModule_AddObjectRef(m, "RowGather", (PyObject *)st->RowGather_Type) < 0)
        return -1;
    return 0;
}
