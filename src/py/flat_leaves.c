/* Flatten's leaf readers: NumPy arrays, RowGathers (an ArrayLoader's rows), DLPack exporters and
 * buffer-protocol objects, each validated and added to the batch layout as a leaf, with its node
 * and the owner that keeps its memory alive (flatten_impl.h). GIL held, except where a function
 * says otherwise. */
#include "flatten_impl.h"

#include "devgather.h"
#include "gather.h"
#include "pinned.h"
#include "np.h"
#include "util.h"

#include <stddef.h>
#include <string.h>

/* ---- nodes and leaves ---- */

static int grow(void **arr, Py_ssize_t *cap, Py_ssize_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    Py_ssize_t nc = *cap ? *cap * 2 : 8;
    while (nc < need)
        nc *= 2;
    void *p = PyMem_RawRealloc(*arr, (size_t)nc * elem); /* leaves are read without the GIL */
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    *arr = p;
    *cap = nc;
    return 0;
}

/* Structure mode: append (the current path, obj) to list. 0, or -1 with an exception. */
int pl_fl_record_at_path(pl_flat *f, PyObject *list, PyObject *obj)
{
    if (pl_fl_path_render(f) < 0)
        return -1;
    PyObject *path = PyUnicode_FromStringAndSize(f->path, (Py_ssize_t)f->path_len);
    PyObject *pair = path ? PyTuple_Pack(2, path, obj) : NULL;
    int rc = pair ? PyList_Append(list, pair) : -1;
    Py_XDECREF(path);
    Py_XDECREF(pair);
    return rc;
}

/* Append a node; returns its index, or -1. obj and key are new references taken here. */
Py_ssize_t pl_fl_push_node(pl_flat *f, fnode_kind kind, PyObject *obj, PyObject *key)
{
    /* structure mode: say where a non-array object is */
    if (f->passed && kind == FN_PASS && pl_fl_record_at_path(f, f->passed, obj) < 0)
        return -1;
    if (grow((void **)&f->nodes, &f->cap_nodes, f->n_nodes + 1, sizeof(pl_flat_node)) < 0)
        return -1;
    f->nodes[f->n_nodes] = (pl_flat_node){kind, Py_XNewRef(obj), Py_XNewRef(key), 0, -1};
    return f->n_nodes++;
}

static int add_owner(pl_flat *f, PyObject *o)
{
    if (grow((void **)&f->owners, &f->cap_owners, f->n_owners + 1, sizeof(PyObject *)) < 0)
        return -1;
    f->owners[f->n_owners++] = Py_NewRef(o);
    return 0;
}

/* Fill leaf slot f->n_leaves (its room already made, ndim checked) and add it to the layout
 * (see Note [batch layout]); `rows` and `gather` (both optional) make it row-gathered or
 * device-gathered (see Note [device gather] in devgather.h). Returns PL_LAYOUT_OK, or the
 * layout's refusal with its text in `why`. No GIL needed: the leaves of an ArrayLoader batch are
 * added here without it (pl_flat_add_rows). */
static int put_leaf(pl_flat *f, const char *data, int ndim, const int64_t *shape, const int64_t *strides,
                    DLDataType dt, int pinned, const int64_t *rows, const pl_xfer_gather *gather,
                    char *why, size_t n_why)
{
    pl_xfer_leaf *L = &f->leaves[f->n_leaves];
    memset(L, 0, sizeof(*L));
    L->copy.src = data;
    L->copy.ndim = ndim;
    L->copy.itemsize = dt.bits / 8;
    if (ndim) {
        memcpy(L->copy.shape, shape, (size_t)ndim * sizeof(int64_t));
        memcpy(L->copy.strides, strides, (size_t)ndim * sizeof(int64_t));
    }
    L->direct = pinned;
    L->copy.rows = rows;
    if (gather)
        L->gather = *gather;
    int rc = pl_layout_add(&f->layout, L);
    if (rc != PL_LAYOUT_OK) {
        char st[256];
        pl_shape_text(st, sizeof st, ndim, shape);
        if (rc == PL_LAYOUT_NEGATIVE)
            snprintf(why, n_why, "shape %s has a negative dimension", st);
        else
            snprintf(why, n_why, "shape %s is too large (%zu-byte elements; a batch holds at most "
                     "%zu bytes)", st, (size_t)L->copy.itemsize, PL_LAYOUT_MAX_BYTES);
        return rc;
    }
    f->dtypes[f->n_leaves] = dt;
    return PL_LAYOUT_OK;
}

/* Room for n more leaves (GIL held): 0, or -1 with MemoryError. */
static int reserve_leaves(pl_flat *f, Py_ssize_t n)
{
    Py_ssize_t cap = f->cap_leaves;
    if (grow((void **)&f->leaves, &cap, f->n_leaves + n, sizeof(pl_xfer_leaf)) < 0)
        return -1;
    cap = f->cap_leaves;
    if (grow((void **)&f->dtypes, &cap, f->n_leaves + n, sizeof(DLDataType)) < 0)
        return -1;
    f->cap_leaves = cap;
    return 0;
}

/* The leaf put in slot f->n_leaves (rc: what put_leaf or put_row_leaf answered, why: its
 * refusal) becomes the walk's: its node, and `owner`, which keeps its memory alive. */
static int keep_leaf(pl_flat *f, int rc, const char *why, PyObject *key, PyObject *owner)
{
    if (rc != PL_LAYOUT_OK)
        return pl_fl_leaf_error(f, PyExc_ValueError, "%s", why);
    Py_ssize_t node = pl_fl_push_node(f, FN_LEAF, NULL, key);
    if (node < 0 || add_owner(f, owner) < 0)
        return -1;
    f->nodes[node].leaf = f->n_leaves++;
    return 0;
}

/* Add an array leaf and its node. `owner` keeps the memory at `data` alive. */
static int add_leaf_rows(pl_flat *f, PyObject *key, PyObject *owner, const char *data, int ndim,
                         const int64_t *shape, const int64_t *strides, DLDataType dt, int pinned,
                         const int64_t *rows, const pl_xfer_gather *gather)
{
    if (ndim < 0 || ndim > PL_MAX_DIMS)
        return pl_fl_leaf_error(f, PyExc_ValueError, "%d dimensions (at most %d are supported)", ndim, PL_MAX_DIMS);
    if (reserve_leaves(f, 1) < 0)
        return -1;
    char why[400];
    int rc = put_leaf(f, data, ndim, shape, strides, dt, pinned, rows, gather, why, sizeof why);
    return keep_leaf(f, rc, why, key, owner);
}

static int add_leaf(pl_flat *f, PyObject *key, PyObject *owner, const char *data, int ndim,
                    const int64_t *shape, const int64_t *strides, DLDataType dt, int pinned)
{
    return add_leaf_rows(f, key, owner, data, ndim, shape, strides, dt, pinned, NULL, NULL);
}

/* ---- NumPy leaves ---- */

static int base_is_pinned_buffer(pl_state *st, PyArrayObject *a)
{
    PyObject *base = PyArray_BASE(a);
    for (int hops = 0; base && hops < 8; hops++) {
        if (pl_pinned_buffer_check(st, base))
            return 1;
        if (PyArray_Check(base))
            base = PyArray_BASE((PyArrayObject *)base);
        else if (PyMemoryView_Check(base))
            base = PyMemoryView_GET_BASE(base);
        else
            return 0;
    }
    return 0;
}

/* Whether the CUDA runtime knows p as page-locked (only asked about leaves big enough to be
 * copied directly, see PL_DIRECT_MIN_BYTES). */
static int query_pinned(pl_flat *f, const void *p, size_t nbytes)
{
    if (f->b->kind != PL_BACKEND_CUDA || nbytes < PL_DIRECT_MIN_BYTES)
        return 0;
    int pinned = 0;
    f->b->host_is_pinned(p, &pinned);
    return pinned;
}

int pl_fl_numpy_leaf(pl_flat *f, PyObject *key, PyArrayObject *a)
{
    PyArray_Descr *d = PyArray_DESCR(a);
    DLDataType dt;
    const char *why = NULL;
    if (pl_dtype_from_numpy(d->kind, (int)PyDataType_ELSIZE(d), d->type_num, d->byteorder, &dt, &why) < 0) {
        char dtext[128];
        if (pl_fl_text_of((PyObject *)d, 0, dtext, sizeof dtext) < 0)
            return -1;
        return pl_fl_leaf_error(f, PyExc_TypeError, "%s (dtype %s)", why, dtext);
    }
    int nd = PyArray_NDIM(a);
    if (nd > PL_MAX_DIMS)
        return pl_fl_leaf_error(f, PyExc_ValueError, "%d dimensions (at most %d are supported)", nd, PL_MAX_DIMS);
    int64_t shape[PL_MAX_DIMS], strides[PL_MAX_DIMS];
    for (int i = 0; i < nd; i++) {
        shape[i] = PyArray_DIMS(a)[i];
        strides[i] = PyArray_STRIDES(a)[i];
    }
    int pinned = PyArray_IS_C_CONTIGUOUS(a) &&
                 (base_is_pinned_buffer(f->st, a) || query_pinned(f, PyArray_DATA(a), (size_t)PyArray_NBYTES(a)));
    return add_leaf(f, key, (PyObject *)a, PyArray_DATA(a), nd, shape, strides, dt, pinned);
}

/* ---- ArrayLoader rows ---- */

/* A RowGather leaf (src/py/row_gather.c) is gathered by the staging threads straight from its
 * source (see Note [array sources] in row_gather.c and Note [row gather] in stager.c), or, when it
 * carries a registration of the prefetcher's backend, by the device gather (Note [device gather] in
 * devgather.h). Its rows were validated when it was made; the RowGather, kept as the owner,
 * keeps them, the registration and the source alive until the batch's copy is done. */
/* Put the row-gathered leaf g in slot f->n_leaves (room made): PL_LAYOUT_OK, or a refusal
 * with its text in why (-1: registered for another backend). No GIL needed. */
static int put_row_leaf(pl_flat *f, const pl_row_gather_leaf *g, char *why, size_t n_why)
{
    int64_t shape[PL_MAX_DIMS];
    for (int i = 0; i < g->ndim; i++)
        shape[i] = g->shape[i];
    pl_xfer_gather dg = {0};
    if (g->reg) {
        if (pl_hostreg_backend(g->reg) != f->b) {
            snprintf(why, n_why, "its source was registered for the %s backend, but the prefetcher "
                     "copies with the %s backend", pl_hostreg_backend(g->reg)->name, f->b->name);
            return -1;
        }
        /* the kernel reads rows at device addresses computed from row 0's, which need not lie
         * in the registered range (only the items that do are read there: Note [device
         * gather] in devgather.h) */
        dg.src = pl_hostreg_device_ptr(g->reg, g->src);
        dg.row_stride = g->strides[0];
        dg.span = g->span;
        dg.lo = pl_hostreg_base(g->reg);
        dg.hi = dg.lo + pl_hostreg_bytes(g->reg);
        dg.edge_items = pl_gather_edge_items(g->src, g->strides[0], g->span, g->n_items, dg.lo, dg.hi);
    }
    return put_leaf(f, g->src, g->ndim, shape, g->strides, g->dtype, 0, g->rows, g->reg ? &dg : NULL,
                    why, n_why);
}

int pl_fl_row_gather_leaf(pl_flat *f, PyObject *key, PyObject *obj)
{
    pl_row_gather_leaf g;
    pl_row_gather_layout(obj, &g);
    if (reserve_leaves(f, 1) < 0)
        return -1;
    char why[400];
    return keep_leaf(f, put_row_leaf(f, &g, why, sizeof why), why, key, obj);
}

int pl_flat_reserve_rows(pl_flat *f, Py_ssize_t n)
{
    return reserve_leaves(f, n);
}

int pl_flat_add_rows(pl_flat *f, const pl_row_gather_leaf *g, char *why, size_t n_why)
{
    if (f->n_leaves >= f->cap_leaves) {
        snprintf(why, n_why, "no room reserved for the leaf");
        return -1;
    }
    if (put_row_leaf(f, g, why, n_why) != PL_LAYOUT_OK)
        return -1;
    f->n_leaves++;
    return 0;
}

void pl_flat_finish_rows(pl_flat *f)
{
    pl_layout_finish(&f->layout, f->leaves, f->n_leaves);
}

/* ---- DLPack leaves ---- */

/* __dlpack__() raised: a TypeError naming the leaf, with the exporter's exception as its cause;
 * a BaseException that is not an Exception propagates unchanged. */
static int dlpack_call_failed(pl_flat *f)
{
    if (pl_fl_pending_is_base_only())
        return -1;
    PyObject *type, *cause, *tb;
    PyErr_Fetch(&type, &cause, &tb);
    PyErr_NormalizeException(&type, &cause, &tb);
    if (cause && tb)
        PyException_SetTraceback(cause, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    if (!cause)
        return pl_fl_leaf_error(f, PyExc_TypeError, "__dlpack__() failed");
    char text[200];
    if (pl_fl_text_of(cause, 0, text, sizeof text) < 0) {
        Py_DECREF(cause);
        return -1;
    }
    pl_fl_leaf_error(f, PyExc_TypeError, "__dlpack__() failed: %s", text);
    PyObject *exc;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc) {
        PyException_SetCause(exc, Py_NewRef(cause));
        PyException_SetContext(exc, Py_NewRef(cause));
    }
    Py_DECREF(cause);
    PyErr_Restore(type, exc, tb);
    return -1;
}

/* Validate an imported DLTensor before any of it is used: ndim, shape, dtype, strides and
 * byte_offset. Fills shape and byte strides; *data gets the address of element [0, ..., 0] and
 * *extent_hint the bytes spanned (saturated), for the pinned query. */
static int dlpack_validate(pl_flat *f, const DLTensor *t, int64_t *shape, int64_t *strides,
                           const char **data, size_t *extent_hint)
{
    const char *why = NULL;
    if (pl_dtype_valid(t->dtype, &why) < 0)
        return pl_fl_leaf_error(f, PyExc_TypeError, "%s (code %u, bits %u, lanes %u)", why,
                                t->dtype.code, t->dtype.bits, t->dtype.lanes);
    if (t->ndim < 0 || t->ndim > PL_MAX_DIMS)
        return pl_fl_leaf_error(f, PyExc_ValueError, "DLPack ndim %d is out of range (0 to %d)", t->ndim, PL_MAX_DIMS);
    if (t->ndim && !t->shape)
        return pl_fl_leaf_error(f, PyExc_ValueError, "DLPack tensor with ndim %d has no shape", t->ndim);
    int64_t isz = t->dtype.bits / 8;
    int empty = 0;
    for (int i = 0; i < t->ndim; i++) {
        shape[i] = t->shape[i];
        if (shape[i] < 0) {
            char st[256];
            pl_shape_text(st, sizeof st, t->ndim, t->shape);
            return pl_fl_leaf_error(f, PyExc_ValueError, "DLPack shape %s has a negative dimension", st);
        }
        empty |= shape[i] == 0;
    }
    /* Byte strides (C order when the exporter gives none) and the span of the elements around
     * element 0: [lo, hi + itemsize). */
    int64_t acc = isz, lo = 0, hi = 0;
    int overflow = 0;
    uintptr_t first = 0, last = 0;
    for (int i = t->ndim - 1; i >= 0; i--) {
        int64_t step, span;
        if (t->strides)
            overflow |= __builtin_mul_overflow(t->strides[i], isz, &step);
        else
            step = acc;
        strides[i] = step;
        if (!empty) {
            overflow |= __builtin_mul_overflow(step, shape[i] - 1, &span);
            overflow |= span < 0 ? __builtin_add_overflow(lo, span, &lo) : __builtin_add_overflow(hi, span, &hi);
            if (!t->strides)
                overflow |= __builtin_mul_overflow(acc, shape[i], &acc);
        }
    }
    overflow |= lo == INT64_MIN;
    if (!empty && overflow) {
        char st[256];
        pl_shape_text(st, sizeof st, t->ndim, t->shape);
        return pl_fl_leaf_error(f, PyExc_ValueError, "DLPack shape %s with its strides is too large", st);
    }
    uintptr_t base = (uintptr_t)t->data, addr;
    if (t->byte_offset > (uint64_t)PTRDIFF_MAX || __builtin_add_overflow(base, (uintptr_t)t->byte_offset, &addr))
        return pl_fl_leaf_error(f, PyExc_ValueError, "DLPack byte_offset %llu is out of range",
                                (unsigned long long)t->byte_offset);
    if (!empty && (!t->data || (uintptr_t)(-lo) > addr ||
                   __builtin_add_overflow(addr, (uintptr_t)hi, &last) ||
                   __builtin_add_overflow(last, (uintptr_t)isz, &last)))
        return pl_fl_leaf_error(f, PyExc_ValueError, "DLPack data pointer, byte_offset and strides "
                                "address memory outside the address space");
    if (!empty)
        first = addr - (uintptr_t)(-lo);
    *data = (const char *)addr;
    *extent_hint = empty ? 0 : (size_t)(last - first);
    return 0;
}

static int dlpack_leaf(pl_flat *f, PyObject *key, PyObject *obj, PyObject *devobj)
{
    int dev_type = -1, dev_id = -1;
    if (!PyTuple_Check(devobj) || !PyArg_ParseTuple(devobj, "ii", &dev_type, &dev_id)) {
        if (pl_fl_pending_is_base_only())
            return -1;
        PyErr_Clear();
        return pl_fl_leaf_error(f, PyExc_TypeError, "__dlpack_device__() did not return (device_type, device_id)");
    }
    if (dev_type == kDLCUDA) {
        if (f->b->kind == PL_BACKEND_CUDA && dev_id == f->device)
            return pl_fl_push_node(f, FN_PASS, obj, key) < 0 ? -1 : 0; /* already where it is going */
        if (f->b->kind == PL_BACKEND_CUDA)
            return pl_fl_leaf_error(f, PyExc_ValueError, "array is on cuda:%d, but this prefetcher delivers "
                                    "to cuda:%d (move it to the host or use a prefetcher for that device)",
                                    dev_id, f->device);
        return pl_fl_leaf_error(f, PyExc_ValueError, "array is on cuda:%d, but this prefetcher uses the "
                                "host backend", dev_id);
    }
    if (dev_type != kDLCPU && dev_type != kDLCUDAHost)
        return pl_fl_leaf_error(f, PyExc_ValueError, "arrays on DLPack device type %d cannot be copied "
                                "(only CPU and pinned host memory)", dev_type);
    PyObject *cap = pl_dlpack_call(obj);
    if (!cap)
        return dlpack_call_failed(f);
    DLTensor *t;
    int versioned;
    if (pl_capsule_tensor(cap, &t, &versioned) < 0) {
        Py_DECREF(cap);
        if (pl_fl_pending_is_base_only())
            return -1;
        PyErr_Clear();
        return pl_fl_leaf_error(f, PyExc_TypeError, "__dlpack__() did not return a usable DLPack capsule");
    }
    int64_t shape[PL_MAX_DIMS], strides[PL_MAX_DIMS];
    const char *data = NULL;
    size_t extent = 0;
    int rc = dlpack_validate(f, t, shape, strides, &data, &extent);
    if (rc == 0) {
        int pinned = dev_type == kDLCUDAHost || query_pinned(f, data, extent);
        /* Consumed (Note [consumed imports] in dlpack.c): its owner joins the leaf's owners;
         * dropping it runs the exporter's deleter with the GIL held. */
        PyObject *owner = pl_capsule_consume(cap, versioned);
        rc = owner ? add_leaf(f, key, owner, data, t->ndim, shape, strides, t->dtype, pinned) : -1;
        Py_XDECREF(owner);
    }
    Py_DECREF(cap);
    return rc;
}

/* ---- DLPack and buffer-protocol objects, read by the walk ---- */

/* An object exporting DLPack, devfn its __dlpack_device__ (borrowed). */
int pl_fl_walk_dlpack(pl_flat *f, PyObject *obj, PyObject *key, PyObject *devfn)
{
    PyObject *dev = PyObject_CallNoArgs(devfn);
    if (!dev)
        return -1;
    int rc = dlpack_leaf(f, key, obj, dev);
    Py_DECREF(dev);
    return rc < 0 ? -1 : 0;
}

/* A buffer-protocol object (not bytes), read as a NumPy array. */
int pl_fl_walk_buffer(pl_flat *f, PyObject *obj, PyObject *key)
{
    /* An exporter that refuses (a closed mmap, a released memoryview) says why: NumPy would
     * read it as a 0-d object array instead. */
    Py_buffer probe;
    if (PyObject_GetBuffer(obj, &probe, PyBUF_FULL_RO) < 0) {
        if (pl_fl_pending_is_base_only())
            return -1;
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        char why[200];
        int rc = value ? pl_fl_text_of(value, 0, why, sizeof why) : (snprintf(why, sizeof why, "?"), 0);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        if (rc < 0)
            return -1;
        return pl_fl_leaf_error(f, PyExc_ValueError, "the %.100s cannot be read: %s", Py_TYPE(obj)->tp_name, why);
    }
    PyBuffer_Release(&probe);
    PyObject *arr = PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
    if (!arr) {
        if (pl_fl_pending_is_base_only())
            return -1;
        PyErr_Clear();
        return pl_fl_leaf_error(f, PyExc_TypeError, "buffer-protocol object could not be read as an array");
    }
    int rc = pl_fl_numpy_leaf(f, key, (PyArrayObject *)arr);
    Py_DECREF(arr);
    return rc;
}

