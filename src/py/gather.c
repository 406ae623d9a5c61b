/* pinloader._C.RowGather and pinloader._C.permutation: the native half of ArrayLoader
 * (pinloader/array_loader.py).
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
 *
 * Note [epoch permutation]
 * The sampling order must be the same on every machine, NumPy version and run, so it is
 * specified here, not borrowed (tests/helpers.py has a Python reference, ref_permutation, that
 * must agree bit for bit: tests/test_permutation.py). All arithmetic is modulo 2**64.
 *   GAMMA = 0x9E3779B97F4A7C15
 *   mix(z):  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9; z = (z ^ (z >> 27)) * 0x94D049BB133111EB;
 *            return z ^ (z >> 31)                                   (SplitMix64's finaliser)
 *   state  = mix(seed) ^ mix(epoch + GAMMA)    (seed, epoch taken modulo 2**64)
 *   next() : state += GAMMA; return mix(state)                      (SplitMix64)
 *   below(n), n >= 1 (Lemire's unbiased multiply-shift):
 *            m = next() * n (128-bit); if low64(m) < n: t = (2**64 - n) % n;
 *            while low64(m) < t: m = next() * n;  return m >> 64
 *   phase  = below(phase_range + 1)                                 (always drawn first)
 *   perm   = [0, 1, ..., n-1]; for i = n-1 down to 1: j = below(i + 1); swap perm[i], perm[j]
 */
#include "gather.h"

#include "devgather.h"
#include "util.h"

#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <limits.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

_Static_assert(sizeof(npy_intp) == sizeof(int64_t), "npy_intp must be 64-bit");

typedef struct {
    PyObject_HEAD
    pl_hostreg *reg;
    const pl_backend *b;
    int device;
    uint32_t gen;         /* Note [fork generations] */
    size_t span;          /* bytes per item, when registered for */
    int64_t window;
    const char *lo;       /* the source's bytes, [lo, lo + n): what RowGathers may read */
    size_t n;
    PyObject *holder;     /* a RowGather over the source, holding it until close() (Note [a
                           * registration holds its source]); NULL once closed */
} RegistrationObject;

typedef struct {
    PyObject_HEAD
    PyObject *array;      /* the ndarray rows are read from: the RowGather's own view */
    PyObject *registration; /* a Registration for the device gather, or NULL */
    pl_hostreg *reg;      /* with it: the RowGather's own handle on its range (pl_hostreg_dup),
                           * which the Registration's close() does not release */
    PyObject *source;     /* what the caller passed */
    Py_buffer held;       /* an export on the object the array views; held.obj NULL if none */
    int64_t *rows;        /* n_rows validated starts: PyMem_Malloc'd, or borrowed */
    PyObject *rows_owner; /* the capsule of the epoch table rows are borrowed from (Note [epoch
                           * row tables]), or NULL when rows is the RowGather's own */
    Py_ssize_t n_rows;
    int64_t window;       /* 0: single rows */
    int64_t advised;      /* bytes given to madvise (Note [read-ahead]) */
    int writeable;        /* NumPy says the source may be written */
    DLDataType dtype;
} RowGatherObject;

int pl_row_gather_check(pl_state *st, PyObject *o)
{
    return PyObject_TypeCheck(o, st->RowGather_Type);
}

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

/* ---- device gather eligibility (Note [device gather] in devgather.h) ---- */

/* The bytes array a spans, [*lo, *lo + *n). Sizes were checked by NumPy when a was made;
 * the sums are checked again here. Returns -1 for an empty array. */
static int array_extent(PyArrayObject *a, const char **lo, size_t *n)
{
    const int nd = PyArray_NDIM(a);
    int64_t below = 0, above = (int64_t)PyArray_ITEMSIZE(a);
    for (int d = 0; d < nd; d++) {
        int64_t dim = PyArray_DIMS(a)[d], ext;
        if (dim == 0)
            return -1;
        if (__builtin_mul_overflow(dim - 1, (int64_t)PyArray_STRIDES(a)[d], &ext))
            return -1;
        if (ext < 0 ? __builtin_add_overflow(below, ext, &below) : __builtin_add_overflow(above, ext, &above))
            return -1;
    }
    *lo = (const char *)PyArray_DATA(a) + below;
    *n = (size_t)(above - below);
    return 0;
}

/* The bytes of one item (a row, or `window` rows) if they are one contiguous span of the
 * source, else 0 with *why saying why not. */
static size_t item_span(PyArrayObject *a, int64_t window, const char **why)
{
    const int nd = PyArray_NDIM(a);
    int64_t expect = (int64_t)PyArray_ITEMSIZE(a);
    for (int d = nd - 1; d >= 1; d--) {
        if (PyArray_DIMS(a)[d] != 1 && PyArray_STRIDES(a)[d] != expect) {
            *why = "the source's rows are not contiguous (strided or Fortran-order inner dimensions)";
            return 0;
        }
        expect *= PyArray_DIMS(a)[d];
    }
    if (expect == 0) {
        *why = "the source's rows are empty";
        return 0;
    }
    if (window > 1) {
        if (PyArray_STRIDES(a)[0] != expect) {
            *why = "a window of rows is not contiguous in the source (the row stride is not the row size)";
            return 0;
        }
        expect *= window;
    }
    return (size_t)expect;
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

/* Note [epoch row tables]
 * A loader's epoch order is made once per epoch and read a batch at a time. The RowGathers of its
 * batches need not copy and check their rows (16 bytes of memory traffic per row on the producer,
 * read and written, every batch) when the order is immutable and checked once: _epoch_table(order)
 * copies it into an epoch table, memory owned by a capsule that exports no buffer, and returns a
 * read-only int64 array over it (NumPy refuses to make it or a view of it writeable, since its
 * base offers no writable buffer; only raw-pointer tools such as ctypes or a hand-made
 * __array_interface__ could write it, and those can write anything); the table records its
 * smallest and largest entry. A RowGather given such an array, or a C-contiguous slice of one
 * (found through the array's bases, its bytes checked to lie inside the table on whole entries:
 * np.lib.stride_tricks can point a view anywhere), keeps a reference to the table's capsule (not
 * to the array, which ndarray.__setstate__ can re-point elsewhere) and reads the rows in place;
 * they are checked against the source once, by the table's range. Anything else (other arrays,
 * lists, a table whose range does not fit the source) is copied and checked row by row.
 * permutation() returns an epoch table too. _epoch_table takes integers only by NumPy's safe
 * casts: floats, or uint64 that int64 cannot hold, are a TypeError, never a silently truncated
 * order. */
#define EPOCH_TABLE_CAPSULE "pinloader._epoch_table"

typedef struct epoch_table {
    int64_t n, lo, hi; /* entries, and the smallest and largest of them (0, -1 when empty) */
    int64_t data[];
} epoch_table;

static void epoch_table_free(PyObject *cap)
{
    PyMem_RawFree(PyCapsule_GetPointer(cap, EPOCH_TABLE_CAPSULE));
}

/* A read-only int64 array of n entries over a new epoch table (*out: its entries, to be
 * filled, then epoch_table_range), or NULL with an exception. */
static PyObject *epoch_table_new(int64_t n, epoch_table **out)
{
    if ((uint64_t)n > ((uint64_t)PY_SSIZE_T_MAX - sizeof(epoch_table)) / sizeof(int64_t))
        return PyErr_Format(PyExc_MemoryError, "an epoch order of %lld items is too large", (long long)n);
    epoch_table *t = PyMem_RawMalloc(sizeof(epoch_table) + (size_t)n * sizeof(int64_t));
    if (!t)
        return PyErr_Format(PyExc_MemoryError, "an epoch order of %lld items (%lld bytes) could not be "
                            "allocated", (long long)n, (long long)n * 8);
    t->n = n;
    t->lo = 0;
    t->hi = -1;
    PyObject *cap = PyCapsule_New(t, EPOCH_TABLE_CAPSULE, epoch_table_free);
    if (!cap) {
        PyMem_RawFree(t);
        return NULL;
    }
    npy_intp dim = (npy_intp)n;
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, PyArray_DescrFromType(NPY_INT64), 1, &dim, NULL,
                                         t->data, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED, NULL);
    if (!arr || PyArray_SetBaseObject((PyArrayObject *)arr, cap) < 0) { /* steals cap */
        if (!arr)
            Py_DECREF(cap);
        Py_XDECREF(arr);
        return NULL;
    }
    *out = t;
    return arr;
}

static void epoch_table_range(epoch_table *t)
{
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int64_t i = 0; i < t->n; i++) {
        lo = t->data[i] < lo ? t->data[i] : lo;
        hi = t->data[i] > hi ? t->data[i] : hi;
    }
    t->lo = t->n ? lo : 0;
    t->hi = t->n ? hi : -1;
}

/* The epoch table that array a lies inside (see the Note), or NULL (no exception); *cap gets
 * its capsule (borrowed). */
static const epoch_table *epoch_table_of(PyArrayObject *a, PyObject **cap)
{
    if (PyArray_NDIM(a) != 1 || PyArray_TYPE(a) != NPY_INT64 || !PyArray_ISNOTSWAPPED(a) ||
        !PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) || PyArray_ISWRITEABLE(a))
        return NULL;
    PyObject *base = PyArray_BASE(a);
    for (int hops = 0; base && PyArray_Check(base) && hops < 64; hops++)
        base = PyArray_BASE((PyArrayObject *)base);
    if (!base || !PyCapsule_CheckExact(base) || !PyCapsule_IsValid(base, EPOCH_TABLE_CAPSULE))
        return NULL;
    const epoch_table *t = PyCapsule_GetPointer(base, EPOCH_TABLE_CAPSULE);
    const char *p = PyArray_DATA(a), *lo = (const char *)t->data;
    size_t len = (size_t)PyArray_SIZE(a) * sizeof(int64_t);
    /* inside the table, on whole entries (not only where NumPy calls int64 aligned) */
    if (p < lo || (size_t)(p - lo) > (size_t)t->n * sizeof(int64_t) ||
        len > (size_t)t->n * sizeof(int64_t) - (size_t)(p - lo) || (size_t)(p - lo) % sizeof(int64_t))
        return NULL;
    *cap = base;
    return t;
}

/* If obj is (a slice of) an epoch table whose entries all fit [0, limit - span], borrow it:
 * *out its rows, *owner a new reference to the table's capsule, which owns the memory (not to
 * obj or any array: ndarray.__setstate__ can re-point an array at other memory and drop its
 * base, so only the capsule keeps the rows alive). Returns 1 if borrowed, else 0. */
static int borrow_rows(PyObject *obj, int64_t span, int64_t limit, int64_t **out, Py_ssize_t *n_out,
                       PyObject **owner)
{
    if (!PyArray_Check(obj))
        return 0;
    PyObject *cap;
    const epoch_table *t = epoch_table_of((PyArrayObject *)obj, &cap);
    if (!t || (t->n && (t->lo < 0 || t->hi > limit - span)))
        return 0;
    *out = PyArray_DATA((PyArrayObject *)obj);
    *n_out = PyArray_SIZE((PyArrayObject *)obj);
    *owner = Py_NewRef(cap);
    return 1;
}

/* pinloader._C._epoch_table(order): see the Note. */
static PyObject *gather_epoch_table(PyObject *m, PyObject *obj)
{
    (void)m;
    PyArrayObject *a = (PyArrayObject *)PyArray_FROM_OTF(obj, NPY_INT64, NPY_ARRAY_IN_ARRAY); /* safe casts */
    if (!a)
        return NULL;
    if (PyArray_NDIM(a) != 1) {
        PyErr_Format(PyExc_ValueError, "an epoch order must be 1-D, got %d dimensions", PyArray_NDIM(a));
        Py_DECREF(a);
        return NULL;
    }
    PyObject *cap;
    const epoch_table *whole = epoch_table_of(a, &cap);
    if (whole && whole->n == PyArray_SIZE(a) && PyArray_DATA(a) == (void *)whole->data)
        return (PyObject *)a; /* already a whole table: nothing to copy */
    epoch_table *t;
    PyObject *out = epoch_table_new(PyArray_SIZE(a), &t);
    if (out) {
        memcpy(t->data, PyArray_DATA(a), (size_t)t->n * sizeof(int64_t));
        epoch_table_range(t);
    }
    Py_DECREF(a);
    return out;
}

/* pinloader._C._epoch_view(table): a new read-only array over the same entries as `table` (an
 * epoch table, or a slice of one) whose base is the table's capsule itself. What the loader hands
 * out is such a view: `view.base` is the capsule, which user code cannot re-point or free, so
 * ndarray.__setstate__ on anything handed out never reaches the loader's own cached order (a
 * plain .view() would have the cached array as its base, and __setstate__ on that base frees
 * the table under the cache). */
static PyObject *gather_epoch_view(PyObject *m, PyObject *obj)
{
    (void)m;
    PyObject *cap;
    const epoch_table *t = PyArray_Check(obj) ? epoch_table_of((PyArrayObject *)obj, &cap) : NULL;
    if (!t)
        return PyErr_Format(PyExc_TypeError, "_epoch_view: not an epoch table (_epoch_table)");
    PyArrayObject *a = (PyArrayObject *)obj;
    npy_intp dim = PyArray_SIZE(a);
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, PyArray_DescrFromType(NPY_INT64), 1, &dim, NULL,
                                         PyArray_DATA(a), NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED, NULL);
    if (arr && PyArray_SetBaseObject((PyArrayObject *)arr, Py_NewRef(cap)) < 0) { /* steals cap */
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

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
static int64_t advise_rows(const char *data, int nd, const npy_intp *shape, const npy_intp *strides,
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

static int registration_check(PyObject *o);

/* Take reg for the device gather of g's rows: same fork generation, open, covering the view,
 * and the items one contiguous span of the size it was made for. */
static int attach_registration(RowGatherObject *g, PyObject *reg_obj)
{
    if (!registration_check(reg_obj)) {
        PyErr_Format(PyExc_TypeError, "registration must be a pinloader._C.Registration or None, not %.100s",
                     Py_TYPE(reg_obj)->tp_name);
        return -1;
    }
    RegistrationObject *r = (RegistrationObject *)reg_obj;
    if (pl_inherited(r->gen)) {
        pl_raise_forked("Registration");
        return -1;
    }
    if (!r->reg) {
        PyErr_SetString(PyExc_ValueError, "the registration is closed");
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)g->array;
    const char *lo, *why = NULL;
    size_t n;
    if (array_extent(a, &lo, &n) < 0 || lo < r->lo || n > r->n || (size_t)(lo - r->lo) > r->n - n) {
        PyErr_SetString(PyExc_ValueError, "the source does not lie inside the registered range");
        return -1;
    }
    size_t span = item_span(a, g->window, &why);
    if (!span || span != r->span || (g->window ? g->window : 1) != (r->window ? r->window : 1)) {
        PyErr_Format(PyExc_ValueError, "the registration was made for items of %zu bytes, not for "
                     "these rows (%s)", r->span, why ? why : "a different item size");
        return -1;
    }
    if (!(g->reg = pl_hostreg_dup(r->reg))) {
        PyErr_NoMemory();
        return -1;
    }
    g->registration = Py_NewRef(reg_obj);
    return 0;
}

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
    if (!borrow_rows(rows_obj, span_rows, n_src, &g->rows, &g->n_rows, &g->rows_owner) &&
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
    if (reg_obj != Py_None && attach_registration(g, reg_obj) < 0)
        goto error;
    if (ahead_obj != Py_None) {
        int64_t *ahead;
        Py_ssize_t n_ahead;
        PyObject *ahead_owner = NULL;
        if (!borrow_rows(ahead_obj, span_rows, n_src, &ahead, &n_ahead, &ahead_owner) &&
            read_rows(ahead_obj, "readahead", span_rows, n_src, &ahead, &n_ahead) < 0)
            goto error;
        const char *data = PyArray_DATA(a);
        const npy_intp *shape = PyArray_DIMS(a), *strides = PyArray_STRIDES(a);
        size_t isz = (size_t)PyDataType_ELSIZE(d);
        int64_t w = g->window, advised;
        /* the array and its owner are held by g: the mapping stays while the GIL is released */
        Py_BEGIN_ALLOW_THREADS
        advised = advise_rows(data, nd, shape, strides, isz, w, ahead, n_ahead);
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

/* ---- one epoch's batches (Note [native epochs]) ---- */

/* Note [native epochs]
 * An ArrayLoader batch needs no Python: its rows are a slice of the epoch table (Note [epoch
 * row tables]) and its leaves are the sources' layouts over those rows. So an epoch is a
 * RowBatches, made with the GIL when the epoch begins (pinloader/_epoch_plan.py): per leaf a
 * RowGather over no rows (the source held, its own view, its registration; its shape and dtype
 * checked against the loader's), the epoch table, whose range is checked once here against
 * every leaf, and the batch size and count. The prefetcher's producer adopts it and then makes
 * every batch without the GIL (pl_row_batches_next, pf_producer.c): the leaves' layouts over
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

int pl_row_batches_check(pl_state *st, PyObject *o)
{
    return PyObject_TypeCheck(o, st->RowBatches_Type);
}

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

int pl_row_batches_adopt(PyObject *o, int *n_leaves)
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

int pl_row_batches_next(PyObject *o, pl_row_gather_leaf *out, char *why, size_t n_why)
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
            rb_count_advice(&rb->leaves[i], advise_rows(L->lay.src, L->nd, L->shape, L->strides,
                                                        L->itemsize, L->window, rb->rows + alo, an));
    }
    return 1;
}

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
    const epoch_table *t = PyArray_Check(order) ? epoch_table_of((PyArrayObject *)order, &cap) : NULL;
    if (!t)
        return PyErr_Format(PyExc_TypeError, "RowBatches: order must be an epoch table (_epoch_table), "
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
"One epoch of an ArrayLoader (Note [native epochs] in src/py/gather.c): batch b is rows\n"
"order[b*batch_size:(b+1)*batch_size] of every leaf. `leaves`: a list of (path, probe,\n"
"readahead, file, need, name): probe a RowGather over the source (its rows unused), file None\n"
"or an object with fileno() (held) of the file the source maps, named `name`, whose size must\n"
"stay >= need.\n"
"`order`: an epoch table (_epoch_table). An AsyncPrefetcher makes the batches in C without\n"
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

/* ---- registrations (Note [registered sources] in devgather.h) ---- */

static int registration_check(PyObject *o)
{
    pl_state *st = pl_state_of_type(Py_TYPE(o));
    return st && PyObject_TypeCheck(o, st->Registration_Type);
}

/* Note [a registration holds its source]
 * A Registration is an address range the device reads through its own mapping of the pages
 * that were there when it was made. Were the source freed while the range stays registered, a
 * new array the allocator places at the same addresses would pass a RowGather's range check,
 * and the device gather would read the old pages through the stale mapping: silently wrong
 * rows. So a Registration holds its source until close() or its own end (the probe RowGather
 * register_rows made: it holds the source and a buffer export on it, for a CPU torch tensor
 * one on a NumPy view of it, torch_hold), and lets go of it only after the range is given
 * back. The Registration is tracked by the garbage collector, so a cycle through it and its
 * source is collected; but NumPy does not show an array's base to the collector, so a cycle
 * that runs through a view's base (a registration of arr.view() stored on arr) is not: such a
 * registration must be closed. */
static void reg_release(RegistrationObject *r)
{
    pl_hostreg *h = r->reg;
    PyObject *holder = r->holder; /* taken with the range: a close() in another thread while
                                   * this one gives the range back must not drop it first */
    r->reg = NULL;
    r->holder = NULL;
    if (h && !pl_inherited(r->gen)) { /* the parent's range: never unregistered in a child */
        Py_BEGIN_ALLOW_THREADS
        pl_hostreg_release(h);
        Py_END_ALLOW_THREADS
    }
    Py_XDECREF(holder); /* after the range is given back */
}

static int reg_traverse(PyObject *op, visitproc visit, void *arg)
{
    Py_VISIT(((RegistrationObject *)op)->holder);
    Py_VISIT(Py_TYPE(op));
    return 0;
}

static int reg_clear(PyObject *op)
{
    reg_release((RegistrationObject *)op);
    return 0;
}

static void reg_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    reg_release((RegistrationObject *)op);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyObject *reg_close(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    reg_release((RegistrationObject *)op);
    Py_RETURN_NONE;
}

static PyObject *reg_get_nbytes(PyObject *op, void *c)
{
    (void)c;
    RegistrationObject *r = (RegistrationObject *)op;
    return PyLong_FromSize_t(r->reg && !pl_inherited(r->gen) ? pl_hostreg_bytes(r->reg) : 0);
}

static PyObject *reg_get_flag(PyObject *op, void *c)
{
    RegistrationObject *r = (RegistrationObject *)op;
    if (!r->reg || pl_inherited(r->gen))
        Py_RETURN_FALSE;
    int v = c ? pl_hostreg_owned(r->reg) : pl_hostreg_read_only(r->reg);
    return PyBool_FromLong(v);
}

static PyObject *reg_get_closed(PyObject *op, void *c)
{
    (void)c;
    return PyBool_FromLong(((RegistrationObject *)op)->reg == NULL);
}

static PyObject *reg_get_span(PyObject *op, void *c)
{
    (void)c;
    return PyLong_FromSize_t(((RegistrationObject *)op)->span);
}

static PyObject *reg_get_backend(PyObject *op, void *c)
{
    (void)c;
    return PyUnicode_FromString(((RegistrationObject *)op)->b->name);
}

static PyObject *reg_repr(PyObject *op)
{
    RegistrationObject *r = (RegistrationObject *)op;
    if (!r->reg)
        return PyUnicode_FromString("<pinloader._C.Registration (closed)>");
    return PyUnicode_FromFormat("<pinloader._C.Registration %s:%d, %zu bytes, %s>", r->b->name, r->device,
                                pl_hostreg_bytes(r->reg), pl_hostreg_owned(r->reg) ? "registered by pinloader"
                                                                                    : "already page-locked");
}

static PyMethodDef reg_methods[] = {
    {"close", reg_close, METH_NOARGS, "Give the registration back; the range is unregistered when no "
     "RowGather in flight uses it any more. Idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef reg_getset[] = {
    {"nbytes", reg_get_nbytes, NULL, "bytes of the page-rounded registered range (0 once closed)", NULL},
    {"owned", reg_get_flag, NULL, "True if pinloader registered the range (False: it was already page-locked)",
     (void *)1},
    {"read_only", reg_get_flag, NULL, "True if the device maps the range read-only", NULL},
    {"closed", reg_get_closed, NULL, "True once close() ran", NULL},
    {"span", reg_get_span, NULL, "bytes per item the registration was made for", NULL},
    {"backend", reg_get_backend, NULL, "'cuda' or 'host': the backend whose kernels read the range", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot reg_slots[] = {
    {Py_tp_dealloc, reg_dealloc},
    {Py_tp_traverse, reg_traverse},
    {Py_tp_clear, reg_clear},
    {Py_tp_methods, reg_methods},
    {Py_tp_getset, reg_getset},
    {Py_tp_repr, reg_repr},
    {Py_tp_doc, (void *)"A source's host range registered for the device gather (made by register_rows)."},
    {0, NULL},
};

static PyType_Spec reg_spec = {
    .name = "pinloader._C.Registration",
    .basicsize = sizeof(RegistrationObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION |
             Py_TPFLAGS_HAVE_GC,
    .slots = reg_slots,
};

PyDoc_STRVAR(register_rows_doc,
"register_rows(source, window=None, device=None, max_bytes=None) -> (Registration | None, reason)\n--\n\n"
"Register the host memory of `source` (anything RowGather takes) so that the device gather can\n"
"read its rows (or windows of `window` rows) with a kernel on `device`'s copy stream: the\n"
"Registration, with reason '', or None with the reason it cannot be (the rows are not\n"
"contiguous spans, the range does not fit in `max_bytes` of registered memory (default: the\n"
"default pinned pool's cap), the driver refused, no gather kernel for the device...).\n"
"Memory already page-locked is used as it is. Registrations of one range are shared. A\n"
"Registration holds `source` until it is closed or dropped.");

static PyObject *gather_register_rows(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"source", "window", "device", "max_bytes", NULL};
    PyObject *src, *window_obj = Py_None, *device_obj = Py_None, *max_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OOO:register_rows", kwlist, &src, &window_obj,
                                     &device_obj, &max_obj))
        return NULL;
    pl_state *st = pl_state_of_module(m);
    const pl_backend *b;
    int device;
    if (pl_resolve_device(st, device_obj, &b, &device) < 0)
        return NULL;
    size_t budget = pl_hostreg_default_budget();
    if (max_obj != Py_None) {
        if (PyBool_Check(max_obj) || !PyLong_Check(max_obj))
            return PyErr_Format(PyExc_TypeError, "max_bytes must be an int or None, not %.100s",
                                Py_TYPE(max_obj)->tp_name);
        long long v = PyLong_AsLongLong(max_obj);
        if (v == -1 && PyErr_Occurred())
            return NULL;
        if (v < 0)
            return PyErr_Format(PyExc_ValueError, "max_bytes must be >= 0, got %lld", v);
        budget = (size_t)v;
    }
    /* the source and its layout, exactly as a RowGather over it will see them */
    PyObject *no_rows = PyTuple_New(0);
    if (!no_rows)
        return NULL;
    PyObject *kw = window_obj != Py_None ? Py_BuildValue("{s:O}", "window", window_obj) : NULL;
    PyObject *call_args = Py_BuildValue("(OO)", src, no_rows);
    Py_DECREF(no_rows);
    PyObject *probe = call_args ? PyObject_Call((PyObject *)st->RowGather_Type, call_args, kw) : NULL;
    Py_XDECREF(call_args);
    Py_XDECREF(kw);
    if (!probe)
        return NULL;
    RowGatherObject *g = (RowGatherObject *)probe;
    PyArrayObject *a = (PyArrayObject *)g->array;
    const char *why = NULL, *lo;
    size_t n, span = 0;
    char text[300];
    int rc;
    if (array_extent(a, &lo, &n) < 0) {
        why = "the source is empty";
        goto refuse;
    }
    if (!(span = item_span(a, g->window, &why)))
        goto refuse;
    if ((rc = b->gather_ready(device, &why)) != PL_OK) {
        snprintf(text, sizeof text, "%s (%s)", why, pl_error_name(b, rc));
        why = text;
        goto refuse;
    }
    /* only the whole pages inside the source (Note [registered sources] in devgather.h) */
    const uintptr_t page = (uintptr_t)pl_page_size();
    uintptr_t in_lo = ((uintptr_t)lo + page - 1) & ~(page - 1), in_hi = ((uintptr_t)lo + n) & ~(page - 1);
    if (in_hi <= in_lo) {
        why = "the source holds no whole page of memory (smaller than a page, or not aligned so)";
        goto refuse;
    }
    pl_hostreg *h = NULL;
    int err = PL_OK;
    Py_BEGIN_ALLOW_THREADS
    if ((rc = b->set_device(device)) == PL_OK)
        rc = pl_hostreg_acquire(b, (const void *)in_lo, in_hi - in_lo, budget, !g->writeable, &h, &err);
    else
        err = rc, rc = PL_REG_REFUSED;
    Py_END_ALLOW_THREADS
    if (rc == PL_REG_OVER_BUDGET) {
        snprintf(text, sizeof text, "the source's %zu bytes do not fit in the registered-memory budget "
                 "(max_registered_bytes=%zu, %zu already registered)", n, budget, pl_hostreg_total(b));
        why = text;
        goto refuse;
    }
    if (rc == PL_REG_OVERLAP) {
        why = "the source overlaps a registered range without lying inside it";
        goto refuse;
    }
    if (rc != PL_REG_OK) {
        snprintf(text, sizeof text, "cudaHostRegister refused the source: %s (%s)", pl_error_name(b, err),
                 pl_error_string(b, err));
        why = text;
        goto refuse;
    }
    RegistrationObject *r = PyObject_GC_New(RegistrationObject, st->Registration_Type);
    if (!r) {
        Py_BEGIN_ALLOW_THREADS
        pl_hostreg_release(h);
        Py_END_ALLOW_THREADS
        Py_DECREF(probe);
        return NULL;
    }
    r->reg = h;
    r->b = b;
    r->device = device;
    r->gen = pl_generation();
    r->span = span;
    r->window = g->window;
    r->lo = lo;
    r->n = n;
    r->holder = probe; /* Note [a registration holds its source] */
    PyObject_GC_Track((PyObject *)r);
    return Py_BuildValue("(Ns)", (PyObject *)r, "");

refuse:
    Py_DECREF(probe);
    return Py_BuildValue("(Os)", Py_None, why);
}

static PyObject *gather_registered_bytes(PyObject *m, PyObject *arg)
{
    (void)m;
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (!name || (strcmp(name, "host") && strcmp(name, "cuda")))
        return PyErr_Format(PyExc_ValueError, "backend must be 'host' or 'cuda'");
    const pl_backend *b = pl_backend_host();
    if (!strcmp(name, "cuda") && !(b = pl_backend_cuda(NULL, NULL)))
        return PyLong_FromLong(0);
    return PyLong_FromSize_t(pl_hostreg_total(b));
}

/* ---- the epoch permutation (Note [epoch permutation]) ---- */

#define GAMMA 0x9E3779B97F4A7C15ULL

static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline uint64_t next64(uint64_t *s)
{
    *s += GAMMA;
    return mix64(*s);
}

static inline uint64_t below(uint64_t *s, uint64_t n)
{
    unsigned __int128 m = (unsigned __int128)next64(s) * n;
    uint64_t l = (uint64_t)m;
    if (l < n) {
        uint64_t t = (0 - n) % n;
        while (l < t) {
            m = (unsigned __int128)next64(s) * n;
            l = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

static int as_u64(PyObject *o, const char *name, uint64_t *out)
{
    if (PyBool_Check(o) || !PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = (uint64_t)PyLong_AsUnsignedLongLongMask(o); /* modulo 2**64, negatives included */
    return PyErr_Occurred() ? -1 : 0;
}

PyDoc_STRVAR(permutation_doc,
"permutation(n, seed, epoch, phase_range=0) -> (phase, perm)\n--\n\n"
"The epoch's sampling order: perm is a permutation of range(n) (a read-only int64 array) and\n"
"phase an int in [0, phase_range], drawn first from the same stream. Specified in\n"
"src/py/gather.c (Note [epoch permutation]) so that it is identical on every machine and NumPy\n"
"version.");

static PyObject *gather_permutation(PyObject *m, PyObject *args, PyObject *kwds)
{
    (void)m;
    static char *kwlist[] = {"n", "seed", "epoch", "phase_range", NULL};
    long long n, phase_range = 0;
    PyObject *seed_obj, *epoch_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LOO|L:permutation", kwlist, &n, &seed_obj,
                                     &epoch_obj, &phase_range))
        return NULL;
    uint64_t seed, epoch;
    if (as_u64(seed_obj, "seed", &seed) < 0 || as_u64(epoch_obj, "epoch", &epoch) < 0)
        return NULL;
    if (n < 0 || phase_range < 0)
        return PyErr_Format(PyExc_ValueError, "n and phase_range must be >= 0, got %lld and %lld", n, phase_range);
    if ((unsigned long long)n > (unsigned long long)PY_SSIZE_T_MAX / sizeof(int64_t))
        return PyErr_Format(PyExc_MemoryError, "permutation: n = %lld is too large: it needs %lld * 8 "
                            "bytes (one int64 per item), more than the address space", n, n);
    epoch_table *t;
    PyObject *arr = epoch_table_new(n, &t); /* read-only: Note [epoch row tables] */
    if (!arr) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_MemoryError, "permutation: n = %lld is too large: it needs %lld bytes "
                         "(one int64 per item), which could not be allocated", n, n * 8);
        }
        return NULL;
    }
    t->lo = 0;
    t->hi = n - 1;
    int64_t *p = t->data;
    uint64_t s = mix64(seed) ^ mix64(epoch + GAMMA), phase;
    Py_BEGIN_ALLOW_THREADS
    phase = below(&s, (uint64_t)phase_range + 1);
    for (int64_t i = 0; i < n; i++)
        p[i] = i;
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)below(&s, (uint64_t)i + 1);
        int64_t t = p[i];
        p[i] = p[j];
        p[j] = t;
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(KN)", (unsigned long long)phase, arr);
}

static PyMethodDef gather_functions[] = {
    {"_registered_bytes", gather_registered_bytes, METH_O, "Bytes pinloader holds registered for the "
     "device gather in this process, for backend 'host' or 'cuda'."},
    {"register_rows", (PyCFunction)(void (*)(void))gather_register_rows, METH_VARARGS | METH_KEYWORDS,
     register_rows_doc},
    {"permutation", (PyCFunction)(void (*)(void))gather_permutation, METH_VARARGS | METH_KEYWORDS, permutation_doc},
    {"_epoch_view", gather_epoch_view, METH_O, "_epoch_view(table, /)\n--\n\n"
     "A read-only array over the entries of an epoch table (or a slice of one) whose base is the\n"
     "table's capsule: what ArrayLoader.indices hands out (see gather_epoch_view)."},
    {"_epoch_table", gather_epoch_table, METH_O, "_epoch_table(order, /)\n--\n\n"
     "order (1-D integers) as a read-only int64 array over an epoch table, which RowGathers of its\n"
     "slices read in place (Note [epoch row tables] in src/py/gather.c)."},
    {NULL, NULL, 0, NULL},
};

int pl_gather_init(PyObject *m, pl_state *st)
{
    st->RowGather_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &rg_spec, NULL);
    if (!st->RowGather_Type || PyModule_AddObjectRef(m, "RowGather", (PyObject *)st->RowGather_Type) < 0)
        return -1;
    st->Registration_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &reg_spec, NULL);
    if (!st->Registration_Type ||
        PyModule_AddObjectRef(m, "Registration", (PyObject *)st->Registration_Type) < 0)
        return -1;
    st->RowBatches_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &rb_spec, NULL);
    if (!st->RowBatches_Type || PyModule_AddObjectRef(m, "RowBatches", (PyObject *)st->RowBatches_Type) < 0)
        return -1;
    return PyModule_AddFunctions(m, gather_functions);
}
