/* Flatten: leaf classification, paths, DLPack import with validation, the checked layout, and
 * the container rebuild. See Note [flatten in two passes] in flatten.h. GIL held throughout. */
#include "flatten.h"

#include "devgather.h"
#include "device_array.h"
#include "gather.h"
#include "pinned.h"
#include "np.h"
#include "util.h"

#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#define MAX_NEST PL_FLAT_MAX_NEST

typedef enum {
    FN_PASS,       /* obj passes through unchanged */
    FN_LEAF,       /* an array leaf: a DeviceArray of leaves[leaf] */
    FN_TUPLE,      /* n children */
    FN_LIST,       /* n children */
    FN_DICT,       /* n children, each with its key; obj: an empty dict subclass copy, or NULL */
    FN_NAMEDTUPLE, /* type obj called with the n children as positional arguments */
    FN_SEQ_SUBCLASS, /* type obj (a list or tuple subclass) called with a tuple of the n children */
    FN_DATACLASS,  /* type obj called with the n children as keyword arguments (their keys) */
} fnode_kind;

struct pl_flat_node {
    fnode_kind kind;
    PyObject *obj;  /* see fnode_kind; a strong reference */
    PyObject *key;  /* the key (or field name) under which the parent holds it; strong or NULL */
    Py_ssize_t n;   /* children, which follow in preorder */
    int leaf;
};

/* ---- error helpers ---- */

/* True when the pending exception is a BaseException that is not an Exception
 * (KeyboardInterrupt, SystemExit, GeneratorExit): it must propagate unchanged. */
static int pending_is_base_only(void)
{
    return PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception);
}

/* str(o) (or repr) as UTF-8 into buf, lone surrogates and other unencodable characters escaped.
 * An Exception raised by __str__/__repr__ gives "?"; returns -1 only with a BaseException that is
 * not an Exception pending. */
static int text_of(PyObject *o, int use_repr, char *buf, size_t n)
{
    snprintf(buf, n, "?");
    PyObject *s = use_repr ? PyObject_Repr(o) : PyObject_Str(o);
    PyObject *u = s ? PyUnicode_AsEncodedString(s, "utf-8", "backslashreplace") : NULL;
    Py_XDECREF(s);
    if (!u) {
        if (pending_is_base_only())
            return -1;
        PyErr_Clear();
        return 0;
    }
    snprintf(buf, n, "%s", PyBytes_AS_STRING(u));
    Py_DECREF(u);
    return 0;
}

/* getattr(o, name) where a missing attribute is not an error: 1 and *out set, 0 when missing,
 * -1 with whatever else the lookup raised. */
static int optional_attr(PyObject *o, const char *name, PyObject **out)
{
    *out = PyObject_GetAttrString(o, name);
    if (*out)
        return 1;
    if (!PyErr_ExceptionMatches(PyExc_AttributeError))
        return -1;
    PyErr_Clear();
    return 0;
}

/* ---- paths (Note [lazy paths] in flatten.h) ---- */

typedef enum {
    PATH_ROOT,  /* text: the root's name, borrowed */
    PATH_INDEX, /* "[index]" */
    PATH_KEY,   /* "[repr(obj)]", obj an exact str or int */
    PATH_ATTR,  /* ".obj", obj an exact str */
    PATH_TEXT,  /* text, owned: a key's "[repr]" or a name's ".str" taken when walked */
} path_step_kind;

static void path_append(pl_flat *f, const char *fmt, ...)
{
    size_t old = f->path_len;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(f->path + old, sizeof f->path - old, fmt, ap);
    va_end(ap);
    if (n > 0)
        f->path_len = PL_MIN(sizeof f->path - 1, old + (size_t)n);
}

/* Room for one more step (the walk's nesting limit bounds them; SystemError past it). */
static pl_path_step *path_step(pl_flat *f, int kind, size_t *mark)
{
    if (f->n_steps >= (int)(sizeof f->steps / sizeof f->steps[0])) {
        PyErr_SetString(PyExc_SystemError, "pinloader: path deeper than the nesting limit");
        return NULL;
    }
    *mark = (size_t)f->n_steps;
    pl_path_step *p = &f->steps[f->n_steps++];
    *p = (pl_path_step){kind, NULL, 0, NULL};
    return p;
}

static void path_pop(pl_flat *f, size_t mark)
{
    while (f->n_steps > (int)mark) {
        pl_path_step *p = &f->steps[--f->n_steps];
        if (p->kind == PATH_TEXT)
            PyMem_RawFree(p->text);
    }
}

static void path_root(pl_flat *f, const char *root)
{
    size_t mark;
    pl_path_step *p = path_step(f, PATH_ROOT, &mark); /* the first: never full */
    if (p)
        p->text = (char *)root;
}

static size_t path_push_index(pl_flat *f, Py_ssize_t i)
{
    size_t mark;
    pl_path_step *p = path_step(f, PATH_INDEX, &mark);
    if (p)
        p->index = i;
    return p ? mark : (size_t)-1;
}

/* "[repr(key)]" for dict entries, ".name" for attributes. Exact str and int keys are rendered
 * when read; any other key's text is taken now (user code). -1 with an exception: a
 * BaseException from that code, or MemoryError. */
static int path_push_text(pl_flat *f, PyObject *key, int as_attr, size_t *mark)
{
    int lazy = as_attr ? PyUnicode_CheckExact(key) : PyUnicode_CheckExact(key) || PyLong_CheckExact(key);
    if (lazy) {
        pl_path_step *p = path_step(f, as_attr ? PATH_ATTR : PATH_KEY, mark);
        if (!p)
            return -1;
        p->obj = key;
        return 0;
    }
    char text[160], step[164];
    if (text_of(key, !as_attr, text, sizeof text) < 0)
        return -1;
    snprintf(step, sizeof step, as_attr ? ".%s" : "[%s]", text);
    size_t len = strlen(step);
    char *copy = PyMem_RawMalloc(len + 1);
    if (!copy) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(copy, step, len + 1);
    pl_path_step *p = path_step(f, PATH_TEXT, mark);
    if (!p) {
        PyMem_RawFree(copy);
        return -1;
    }
    p->text = copy;
    return 0;
}

/* Render the path into f->path. A pending exception is kept. -1 only with a BaseException
 * that is not an Exception pending (text_of's rule); no exact str or int repr raises one. */
static int path_render(pl_flat *f)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    f->path_len = 0;
    f->path[0] = 0;
    for (int i = 0; i < f->n_steps; i++) {
        const pl_path_step *p = &f->steps[i];
        char text[160];
        switch (p->kind) {
        case PATH_ROOT:
        case PATH_TEXT:
            path_append(f, "%s", p->text);
            break;
        case PATH_INDEX:
            path_append(f, "[%zd]", p->index);
            break;
        case PATH_KEY:
        case PATH_ATTR:
            if (text_of(p->obj, p->kind == PATH_KEY, text, sizeof text) < 0) {
                Py_XDECREF(type);
                Py_XDECREF(value);
                Py_XDECREF(tb);
                return -1;
            }
            path_append(f, p->kind == PATH_KEY ? "[%s]" : ".%s", text);
            break;
        }
    }
    PyErr_Restore(type, value, tb);
    return 0;
}

static int leaf_error(pl_flat *f, PyObject *type, const char *fmt, ...)
{
    char why[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    if (path_render(f) < 0)
        return -1;
    PyErr_Format(type, "%s: %s", f->path, why);
    return -1;
}

void pl_shape_text(char *buf, size_t n, int ndim, const int64_t *shape)
{
    size_t len = (size_t)snprintf(buf, n, "(");
    for (int i = 0; i < ndim && len < n; i++)
        len += (size_t)snprintf(buf + len, n - len, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (len < n)
        snprintf(buf + len, n - len, ndim == 1 ? ",)" : ")");
}

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
static int record_at_path(pl_flat *f, PyObject *list, PyObject *obj)
{
    if (path_render(f) < 0)
        return -1;
    PyObject *path = PyUnicode_FromStringAndSize(f->path, (Py_ssize_t)f->path_len);
    PyObject *pair = path ? PyTuple_Pack(2, path, obj) : NULL;
    int rc = pair ? PyList_Append(list, pair) : -1;
    Py_XDECREF(path);
    Py_XDECREF(pair);
    return rc;
}

/* Append a node; returns its index, or -1. obj and key are new references taken here. */
static Py_ssize_t push_node(pl_flat *f, fnode_kind kind, PyObject *obj, PyObject *key)
{
    /* structure mode: say where a non-array object is */
    if (f->passed && kind == FN_PASS && record_at_path(f, f->passed, obj) < 0)
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
        return leaf_error(f, PyExc_ValueError, "%s", why);
    Py_ssize_t node = push_node(f, FN_LEAF, NULL, key);
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
        return leaf_error(f, PyExc_ValueError, "%d dimensions (at most %d are supported)", ndim, PL_MAX_DIMS);
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

static int numpy_leaf(pl_flat *f, PyObject *key, PyArrayObject *a)
{
    PyArray_Descr *d = PyArray_DESCR(a);
    DLDataType dt;
    const char *why = NULL;
    if (pl_dtype_from_numpy(d->kind, (int)PyDataType_ELSIZE(d), d->type_num, d->byteorder, &dt, &why) < 0) {
        char dtext[128];
        if (text_of((PyObject *)d, 0, dtext, sizeof dtext) < 0)
            return -1;
        return leaf_error(f, PyExc_TypeError, "%s (dtype %s)", why, dtext);
    }
    int nd = PyArray_NDIM(a);
    if (nd > PL_MAX_DIMS)
        return leaf_error(f, PyExc_ValueError, "%d dimensions (at most %d are supported)", nd, PL_MAX_DIMS);
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

/* A RowGather leaf (src/py/row_gather.c) is gathered by the staging threads straight from its source
 * (see Note [array sources] in row_gather.c and Note [row gather] in stager.c), or, when it carries
 * a registration of the prefetcher's backend, by the device gather (Note [device gather] in
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

static int row_gather_leaf(pl_flat *f, PyObject *key, PyObject *obj)
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
    if (pending_is_base_only())
        return -1;
    PyObject *type, *cause, *tb;
    PyErr_Fetch(&type, &cause, &tb);
    PyErr_NormalizeException(&type, &cause, &tb);
    if (cause && tb)
        PyException_SetTraceback(cause, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    if (!cause)
        return leaf_error(f, PyExc_TypeError, "__dlpack__() failed");
    char text[200];
    if (text_of(cause, 0, text, sizeof text) < 0) {
        Py_DECREF(cause);
        return -1;
    }
    leaf_error(f, PyExc_TypeError, "__dlpack__() failed: %s", text);
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
        return leaf_error(f, PyExc_TypeError, "%s (code %u, bits %u, lanes %u)", why,
                          t->dtype.code, t->dtype.bits, t->dtype.lanes);
    if (t->ndim < 0 || t->ndim > PL_MAX_DIMS)
        return leaf_error(f, PyExc_ValueError, "DLPack ndim %d is out of range (0 to %d)", t->ndim, PL_MAX_DIMS);
    if (t->ndim && !t->shape)
        return leaf_error(f, PyExc_ValueError, "DLPack tensor with ndim %d has no shape", t->ndim);
    int64_t isz = t->dtype.bits / 8;
    int empty = 0;
    for (int i = 0; i < t->ndim; i++) {
        shape[i] = t->shape[i];
        if (shape[i] < 0) {
            char st[256];
            pl_shape_text(st, sizeof st, t->ndim, t->shape);
            return leaf_error(f, PyExc_ValueError, "DLPack shape %s has a negative dimension", st);
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
        return leaf_error(f, PyExc_ValueError, "DLPack shape %s with its strides is too large", st);
    }
    uintptr_t base = (uintptr_t)t->data, addr;
    if (t->byte_offset > (uint64_t)PTRDIFF_MAX || __builtin_add_overflow(base, (uintptr_t)t->byte_offset, &addr))
        return leaf_error(f, PyExc_ValueError, "DLPack byte_offset %llu is out of range",
                          (unsigned long long)t->byte_offset);
    if (!empty && (!t->data || (uintptr_t)(-lo) > addr ||
                   __builtin_add_overflow(addr, (uintptr_t)hi, &last) ||
                   __builtin_add_overflow(last, (uintptr_t)isz, &last)))
        return leaf_error(f, PyExc_ValueError, "DLPack data pointer, byte_offset and strides "
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
        if (pending_is_base_only())
            return -1;
        PyErr_Clear();
        return leaf_error(f, PyExc_TypeError, "__dlpack_device__() did not return (device_type, device_id)");
    }
    if (dev_type == kDLCUDA) {
        if (f->b->kind == PL_BACKEND_CUDA && dev_id == f->device)
            return push_node(f, FN_PASS, obj, key) < 0 ? -1 : 0; /* already where it is going */
        if (f->b->kind == PL_BACKEND_CUDA)
            return leaf_error(f, PyExc_ValueError, "array is on cuda:%d, but this prefetcher delivers "
                              "to cuda:%d (move it to the host or use a prefetcher for that device)",
                              dev_id, f->device);
        return leaf_error(f, PyExc_ValueError, "array is on cuda:%d, but this prefetcher uses the "
                          "host backend", dev_id);
    }
    if (dev_type != kDLCPU && dev_type != kDLCUDAHost)
        return leaf_error(f, PyExc_ValueError, "arrays on DLPack device type %d cannot be copied "
                          "(only CPU and pinned host memory)", dev_type);
    PyObject *cap = pl_dlpack_call(obj);
    if (!cap)
        return dlpack_call_failed(f);
    DLTensor *t;
    int versioned;
    if (pl_capsule_tensor(cap, &t, &versioned) < 0) {
        Py_DECREF(cap);
        if (pending_is_base_only())
            return -1;
        PyErr_Clear();
        return leaf_error(f, PyExc_TypeError, "__dlpack__() did not return a usable DLPack capsule");
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

/* ---- the walk ---- */

static int walk(pl_flat *f, PyObject *obj, PyObject *key, int level);

/* Walk child `item` under path suffix already pushed at `mark`. */
static int walk_child(pl_flat *f, PyObject *item, PyObject *key, int level, size_t mark)
{
    int rc = walk(f, item, key, level + 1);
    path_pop(f, mark);
    return rc;
}

/* tuple, list, namedtuple (its _fields in `fields`, borrowed, naming the children), list or tuple
 * subclass. A snapshot of the items, taken without calling user code, is walked: what the walk
 * runs (a __dlpack__) cannot change what is read. */
static int walk_seq(pl_flat *f, PyObject *obj, PyObject *key, int level, fnode_kind kind,
                    PyObject *fields)
{
    PyObject *items = PyList_Check(obj) ? PyList_AsTuple(obj) : PyTuple_GetSlice(obj, 0, PY_SSIZE_T_MAX);
    if (!items)
        return -1;
    int typed = kind == FN_NAMEDTUPLE || kind == FN_SEQ_SUBCLASS;
    Py_ssize_t node = push_node(f, kind, typed ? (PyObject *)Py_TYPE(obj) : NULL, key);
    int rc = node < 0 ? -1 : 0;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
        PyObject *name = fields && PyTuple_Check(fields) && i < PyTuple_GET_SIZE(fields)
                             ? PyTuple_GET_ITEM(fields, i) : NULL;
        size_t mark;
        if (name && PyUnicode_Check(name))
            rc = path_push_text(f, name, 1, &mark);
        else if ((mark = path_push_index(f, i)) == (size_t)-1)
            rc = -1;
        if (rc == 0)
            rc = walk_child(f, PyTuple_GET_ITEM(items, i), NULL, level, mark);
    }
    if (rc == 0)
        f->nodes[node].n = n;
    Py_DECREF(items);
    return rc;
}

/* The (key, value) pairs of a dict, walked with keys: dicts and dataclass init fields. */
static int walk_pairs(pl_flat *f, Py_ssize_t node, PyObject *pairs, int level, int as_attr)
{
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        PyObject *k = PyTuple_GET_ITEM(pair, 0), *v = PyTuple_GET_ITEM(pair, 1);
        size_t mark;
        if (path_push_text(f, k, as_attr, &mark) < 0 || walk_child(f, v, k, level, mark) < 0)
            return -1;
    }
    f->nodes[node].n = n;
    return 0;
}

static int walk_dict(pl_flat *f, PyObject *obj, PyObject *key, int level)
{
    PyObject *proto = NULL;
    if (!PyDict_CheckExact(obj)) {
        /* OrderedDict, defaultdict and other dict subclasses: a shallow copy keeps the type and
         * its extra state (default_factory...); the rebuild fills it with the outputs. */
        PyObject *copy_mod = PyImport_ImportModule("copy");
        proto = copy_mod ? PyObject_CallMethod(copy_mod, "copy", "O", obj) : NULL;
        Py_XDECREF(copy_mod);
        if (!proto || !PyDict_Check(proto)) {
            Py_XDECREF(proto);
            if (pending_is_base_only())
                return -1;
            PyErr_Clear();
            return leaf_error(f, PyExc_TypeError, "cannot rebuild this dict subclass (copy.copy failed)");
        }
        /* the type's own clear(): an OrderedDict keeps its own links beside the dict's */
        PyObject *r = PyObject_CallMethod(proto, "clear", NULL);
        if (!r) {
            Py_DECREF(proto);
            if (pending_is_base_only())
                return -1;
            PyErr_Clear();
            return leaf_error(f, PyExc_TypeError, "cannot rebuild this dict subclass (clear() failed)");
        }
        Py_DECREF(r);
    }
    PyObject *pairs = PyDict_Items(obj); /* a snapshot */
    Py_ssize_t node = pairs ? push_node(f, FN_DICT, proto, key) : -1;
    Py_XDECREF(proto);
    int rc = node < 0 ? -1 : walk_pairs(f, node, pairs, level, 0);
    Py_XDECREF(pairs);
    return rc;
}

/* dataclass: rebuilt with type(obj)(**{field: value}) over its init fields */
static int walk_dataclass(pl_flat *f, PyObject *obj, PyObject *key, PyObject *dcf, int level)
{
    if (!PyDict_Check(dcf))
        return leaf_error(f, PyExc_TypeError, "__dataclass_fields__ is not a dict");
    PyObject *fields = PyDict_Items(dcf);
    PyObject *pairs = fields ? PyList_New(0) : NULL;
    int rc = pairs ? 0 : -1;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(fields); i++) {
        PyObject *pair = PyList_GET_ITEM(fields, i);
        PyObject *name = PyTuple_GET_ITEM(pair, 0), *init = NULL;
        rc = optional_attr(PyTuple_GET_ITEM(pair, 1), "init", &init);
        int is_init = rc > 0 ? PyObject_IsTrue(init) : rc;
        Py_XDECREF(init);
        if (is_init < 0) {
            rc = -1;
            break;
        }
        rc = 0;
        if (!is_init)
            continue;
        PyObject *value = PyObject_GetAttr(obj, name);
        PyObject *entry = value ? PyTuple_Pack(2, name, value) : NULL;
        Py_XDECREF(value);
        if (!entry || PyList_Append(pairs, entry) < 0)
            rc = -1;
        Py_XDECREF(entry);
    }
    Py_ssize_t node = rc == 0 ? push_node(f, FN_DATACLASS, (PyObject *)Py_TYPE(obj), key) : -1;
    if (node >= 0)
        rc = walk_pairs(f, node, pairs, level, 1);
    else
        rc = -1;
    Py_XDECREF(fields);
    Py_XDECREF(pairs);
    return rc;
}

/* An object exporting DLPack, devfn its __dlpack_device__ (borrowed). */
static int walk_dlpack(pl_flat *f, PyObject *obj, PyObject *key, PyObject *devfn)
{
    PyObject *dev = PyObject_CallNoArgs(devfn);
    if (!dev)
        return -1;
    int rc = dlpack_leaf(f, key, obj, dev);
    Py_DECREF(dev);
    return rc < 0 ? -1 : 0;
}

/* A buffer-protocol object (not bytes), read as a NumPy array. */
static int walk_buffer(pl_flat *f, PyObject *obj, PyObject *key)
{
    /* An exporter that refuses (a closed mmap, a released memoryview) says why: NumPy would
     * read it as a 0-d object array instead. */
    Py_buffer probe;
    if (PyObject_GetBuffer(obj, &probe, PyBUF_FULL_RO) < 0) {
        if (pending_is_base_only())
            return -1;
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        char why[200];
        int rc = value ? text_of(value, 0, why, sizeof why) : (snprintf(why, sizeof why, "?"), 0);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        if (rc < 0)
            return -1;
        return leaf_error(f, PyExc_ValueError, "the %.100s cannot be read: %s", Py_TYPE(obj)->tp_name, why);
    }
    PyBuffer_Release(&probe);
    PyObject *arr = PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
    if (!arr) {
        if (pending_is_base_only())
            return -1;
        PyErr_Clear();
        return leaf_error(f, PyExc_TypeError, "buffer-protocol object could not be read as an array");
    }
    int rc = numpy_leaf(f, key, (PyArrayObject *)arr);
    Py_DECREF(arr);
    return rc;
}

/* Note [one leaf classifier]
 * Both walks -- the per-item walk (pl_flat_walk) and structure mode (pl_flat_structure, which
 * captures an ArrayLoader's or a structure='s leaves without reading them) -- ask classify()
 * what an object is, so they cannot disagree. The first rule that matches decides:
 *   1. a NumPy array (0-d included), a RowGather: an array leaf;
 *   2. None, str, bytes, int (bool), float, complex and NumPy scalars (np.float32(1.5)):
 *      values, passed through unchanged -- a NumPy scalar is a value as a Python float is;
 *   3. tuple and list: rebuilt as tuple and list;
 *   4. a tuple subclass with a tuple `_fields` (a namedtuple): rebuilt as type(obj)(*children);
 *   5. any other list or tuple subclass (torch.return_types, os.stat_result, class T(list)):
 *      rebuilt as type(obj)(children), the constructor signature of list and tuple;
 *   6. a dict or dict subclass: a shallow copy.copy of it, cleared and filled (Note [handout]);
 *   7. a dataclass instance: type(obj)(**init_fields);
 *   8. an object with both __dlpack__ and __dlpack_device__: an array leaf;
 *   9. any other buffer-protocol object (memoryview, bytearray, array.array, mmap): an array
 *      leaf;
 *  10. anything else passes through unchanged.
 * A container's children are walked in order (a dict's in insertion order, a dataclass's in
 * field order). When a rebuild's constructor raises an Exception, the error is a TypeError
 * naming the container's path in the batch ("item[0].x: ...") with the constructor's exception
 * as its cause; a BaseException that is not an Exception, and a StopIteration (which the
 * prefetcher makes a RuntimeError), propagate unchanged. */
typedef enum {
    OK_ARRAY, OK_ROWS, OK_PASS, OK_TUPLE, OK_LIST, OK_NAMEDTUPLE, OK_SEQ_SUBCLASS, OK_DICT,
    OK_DATACLASS, OK_DLPACK, OK_BUFFER,
} obj_kind;

/* What obj is (Note [one leaf classifier]), or -1 with an exception (an attribute lookup raised).
 * *attr gets a new reference for OK_NAMEDTUPLE (its _fields), OK_DATACLASS (the type's
 * __dataclass_fields__) and OK_DLPACK (its __dlpack_device__), else NULL. */
static int classify(pl_flat *f, PyObject *obj, PyObject **attr)
{
    *attr = NULL;
    if (PyArray_Check(obj))
        return OK_ARRAY;
    if (pl_row_gather_check(f->st, obj))
        return OK_ROWS;
    if (obj == Py_None || PyUnicode_Check(obj) || PyBytes_Check(obj) || PyLong_Check(obj) ||
        PyFloat_Check(obj) || PyComplex_Check(obj) || PyArray_IsScalar(obj, Generic))
        return OK_PASS;
    if (PyTuple_CheckExact(obj))
        return OK_TUPLE;
    if (PyList_CheckExact(obj))
        return OK_LIST;
    if (PyList_Check(obj))
        return OK_SEQ_SUBCLASS;
    if (PyTuple_Check(obj)) {
        PyObject *fields;
        int has = optional_attr(obj, "_fields", &fields);
        if (has < 0)
            return -1;
        if (has && PyTuple_Check(fields)) {
            *attr = fields;
            return OK_NAMEDTUPLE;
        }
        Py_XDECREF(fields);
        return OK_SEQ_SUBCLASS;
    }
    if (PyDict_Check(obj))
        return OK_DICT;
    int has = optional_attr((PyObject *)Py_TYPE(obj), "__dataclass_fields__", attr);
    if (has)
        return has < 0 ? -1 : OK_DATACLASS;
    PyObject *devfn, *fn;
    has = optional_attr(obj, "__dlpack_device__", &devfn);
    if (has < 0)
        return -1;
    if (has) {
        has = optional_attr(obj, "__dlpack__", &fn);
        Py_XDECREF(fn);
        if (has < 0) {
            Py_DECREF(devfn);
            return -1;
        }
        if (has) {
            *attr = devfn;
            return OK_DLPACK;
        }
        Py_DECREF(devfn);
    }
    return PyObject_CheckBuffer(obj) ? OK_BUFFER : OK_PASS;
}

/* Structure mode (pl_flat_structure): an array leaf becomes a leaf node and a (path, object)
 * pair in f->found, unread. */
static int structure_leaf(pl_flat *f, PyObject *obj, PyObject *key)
{
    Py_ssize_t node = push_node(f, FN_LEAF, NULL, key);
    if (node < 0 || record_at_path(f, f->found, obj) < 0)
        return -1;
    f->nodes[node].leaf = f->n_leaves++;
    return 0;
}

static int walk(pl_flat *f, PyObject *obj, PyObject *key, int level)
{
    if (level > MAX_NEST)
        return leaf_error(f, PyExc_RecursionError, "nesting deeper than %d levels", MAX_NEST);
    PyObject *attr;
    int kind = classify(f, obj, &attr);
    if (kind < 0)
        return -1;
    int rc;
    if (f->found && (kind == OK_ARRAY || kind == OK_ROWS || kind == OK_DLPACK || kind == OK_BUFFER)) {
        rc = structure_leaf(f, obj, key);
    } else {
        switch (kind) {
        case OK_ARRAY:
            rc = numpy_leaf(f, key, (PyArrayObject *)obj);
            break;
        case OK_ROWS:
            rc = row_gather_leaf(f, key, obj);
            break;
        case OK_TUPLE:
            rc = walk_seq(f, obj, key, level, FN_TUPLE, NULL);
            break;
        case OK_LIST:
            rc = walk_seq(f, obj, key, level, FN_LIST, NULL);
            break;
        case OK_NAMEDTUPLE:
            rc = walk_seq(f, obj, key, level, FN_NAMEDTUPLE, attr);
            break;
        case OK_SEQ_SUBCLASS:
            rc = walk_seq(f, obj, key, level, FN_SEQ_SUBCLASS, NULL);
            break;
        case OK_DICT:
            rc = walk_dict(f, obj, key, level);
            break;
        case OK_DATACLASS:
            rc = walk_dataclass(f, obj, key, attr, level);
            break;
        case OK_DLPACK:
            rc = walk_dlpack(f, obj, key, attr);
            break;
        case OK_BUFFER:
            rc = walk_buffer(f, obj, key);
            break;
        default: /* OK_PASS */
            rc = push_node(f, FN_PASS, obj, key) < 0 ? -1 : 0;
            break;
        }
    }
    Py_XDECREF(attr);
    return rc;
}

void pl_flat_init(pl_flat *f, pl_state *st, const pl_backend *b, int device)
{
    memset(f, 0, offsetof(pl_flat, steps)); /* n_steps 0: steps and path are written first */
    f->path_len = 0;
    f->path[0] = 0;
    f->st = st;
    f->b = b;
    f->device = device;
}

void pl_flat_begin(pl_flat *f)
{
    pl_xfer_leaf *leaves = f->leaves;
    DLDataType *dtypes = f->dtypes;
    Py_ssize_t cap = f->cap_leaves;
    pl_flat_init(f, f->st, f->b, f->device);
    f->leaves = leaves;
    f->dtypes = dtypes;
    f->cap_leaves = cap;
}

int pl_flat_structure(pl_flat *f, PyObject *obj, const char *root, PyObject **found,
                      PyObject **passed)
{
    f->found = PyList_New(0);
    f->passed = passed ? PyList_New(0) : NULL;
    int rc = f->found && (!passed || f->passed) ? 0 : -1;
    path_root(f, root);
    if (rc == 0)
        rc = walk(f, obj, NULL, 0);
    path_pop(f, 0);
    *found = f->found;
    if (passed)
        *passed = f->passed;
    f->found = f->passed = NULL;
    if (rc < 0) {
        Py_CLEAR(*found);
        if (passed)
            Py_CLEAR(*passed);
    }
    return rc;
}

int pl_flat_walk(pl_flat *f, PyObject *item)
{
    path_root(f, "item");
    int rc = walk(f, item, NULL, 0);
    path_pop(f, 0);
    if (rc < 0)
        return -1;
    pl_layout_finish(&f->layout, f->leaves, f->n_leaves);
    return 0;
}

/* ---- rebuild ---- */

/* Where build_at is, for an error naming a container it could not rebuild: the chain of
 * parents on the C stack, rendered only then (Note [one leaf classifier]). */
typedef struct build_frame {
    const struct build_frame *up;
    const pl_flat_node *parent;
    const pl_flat_node *child;
    Py_ssize_t index;
} build_frame;

static PyObject *build_at(const pl_tree *t, PyObject *leaves, Py_ssize_t *pos, const build_frame *up);

/* The path of the node below `up` ("item[0].x['k']"), into buf. -1 only with a BaseException
 * that is not an Exception pending (a key's repr() runs user code). */
static int frame_path(const build_frame *up, char *buf, size_t n)
{
    const build_frame *chain[MAX_NEST + 2];
    int depth = 0;
    for (const build_frame *fr = up; fr && depth < (int)(sizeof chain / sizeof chain[0]); fr = fr->up)
        chain[depth++] = fr;
    size_t len = (size_t)snprintf(buf, n, "item");
    for (int d = depth - 1; d >= 0 && len < n; d--) {
        const build_frame *fr = chain[d];
        char text[160];
        int w;
        PyObject *name = NULL;
        if (fr->parent->kind == FN_NAMEDTUPLE) {
            /* the field's name, as the walk wrote it; the index where the type has none */
            PyObject *fields;
            if (optional_attr(fr->parent->obj, "_fields", &fields) < 0) {
                if (pending_is_base_only())
                    return -1;
                PyErr_Clear();
            } else if (fields) {
                if (PyTuple_Check(fields) && fr->index < PyTuple_GET_SIZE(fields) &&
                    PyUnicode_Check(PyTuple_GET_ITEM(fields, fr->index)))
                    name = Py_NewRef(PyTuple_GET_ITEM(fields, fr->index));
                Py_DECREF(fields);
            }
        }
        if (fr->parent->kind == FN_DICT || fr->parent->kind == FN_DATACLASS || name) {
            int is_dict = fr->parent->kind == FN_DICT;
            int rc = text_of(name ? name : fr->child->key, is_dict, text, sizeof text);
            Py_XDECREF(name);
            if (rc < 0)
                return -1;
            w = snprintf(buf + len, n - len, is_dict ? "[%s]" : ".%s", text);
        } else {
            w = snprintf(buf + len, n - len, "[%zd]", fr->index);
        }
        len = w > 0 ? PL_MIN(n - 1, len + (size_t)w) : len;
    }
    return 0;
}

/* The constructor of container node nd raised: a TypeError naming it, with that exception as
 * its cause. A BaseException that is not an Exception propagates unchanged, and so does a
 * StopIteration, which the prefetcher turns into its own RuntimeError (a StopIteration must not
 * end the consumer's loop). Returns NULL. */
static PyObject *rebuild_failed(const build_frame *up, const pl_flat_node *nd, const char *how)
{
    if (pending_is_base_only() || PyErr_ExceptionMatches(PyExc_StopIteration))
        return NULL;
    PyObject *type, *cause, *tb;
    PyErr_Fetch(&type, &cause, &tb);
    PyErr_NormalizeException(&type, &cause, &tb);
    if (cause && tb)
        PyException_SetTraceback(cause, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    char path[512], text[200] = "?";
    if (frame_path(up, path, sizeof path) < 0 || (cause && text_of(cause, 0, text, sizeof text) < 0)) {
        Py_XDECREF(cause);
        return NULL;
    }
    const char *name = nd->obj && PyType_Check(nd->obj) ? ((PyTypeObject *)nd->obj)->tp_name
                                                        : nd->obj ? Py_TYPE(nd->obj)->tp_name : "?";
    PyErr_Format(PyExc_TypeError, "%s: cannot rebuild the %.100s with %s: %.100s: %s", path, name,
                 how, cause ? Py_TYPE(cause)->tp_name : "?", text);
    PyObject *exc;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc && cause) {
        PyException_SetCause(exc, Py_NewRef(cause));
        PyException_SetContext(exc, Py_NewRef(cause));
    }
    Py_XDECREF(cause);
    PyErr_Restore(type, exc, tb);
    return NULL;
}

static PyObject *copy_of(PyObject *proto)
{
    PyObject *mod = PyImport_ImportModule("copy");
    PyObject *out = mod ? PyObject_CallMethod(mod, "copy", "O", proto) : NULL;
    Py_XDECREF(mod);
    if (out && !PyDict_Check(out)) {
        Py_SETREF(out, NULL);
        PyErr_Format(PyExc_TypeError, "copy.copy of a %.100s did not give a dict", Py_TYPE(proto)->tp_name);
    }
    return out;
}

/* The children of a dict-like node nd into a dict (out: a new reference, filled). -1 with the
 * exception of a child's rebuild, or 1 with the exception of out's own __setitem__. */
static int build_pairs(const pl_tree *t, PyObject *leaves, Py_ssize_t *pos, const pl_flat_node *nd,
                       const build_frame *up, PyObject *out)
{
    for (Py_ssize_t i = 0; i < nd->n; i++) {
        build_frame fr = {up, nd, &t->nodes[*pos], i};
        PyObject *k = t->nodes[*pos].key;
        PyObject *v = build_at(t, leaves, pos, &fr);
        if (!v)
            return -1;
        /* a dict subclass through its own __setitem__ (an OrderedDict's order) */
        int rc = PyDict_CheckExact(out) ? PyDict_SetItem(out, k, v) : PyObject_SetItem(out, k, v);
        Py_DECREF(v);
        if (rc < 0)
            return 1;
    }
    return 0;
}

static PyObject *build_at(const pl_tree *t, PyObject *leaves, Py_ssize_t *pos, const build_frame *up)
{
    const pl_flat_node *nd = &t->nodes[(*pos)++];
    PyObject *out = NULL, *args;
    int rc;
    switch (nd->kind) {
    case FN_PASS:
        return Py_NewRef(nd->obj);
    case FN_LEAF:
        return Py_NewRef(PyTuple_GET_ITEM(leaves, nd->leaf));
    case FN_TUPLE:
    case FN_LIST:
    case FN_NAMEDTUPLE:
    case FN_SEQ_SUBCLASS:
        out = nd->kind == FN_LIST ? PyList_New(nd->n) : PyTuple_New(nd->n);
        for (Py_ssize_t i = 0; out && i < nd->n; i++) {
            build_frame fr = {up, nd, &t->nodes[*pos], i};
            PyObject *o = build_at(t, leaves, pos, &fr);
            if (!o)
                Py_CLEAR(out);
            else if (nd->kind == FN_LIST)
                PyList_SET_ITEM(out, i, o);
            else
                PyTuple_SET_ITEM(out, i, o);
        }
        if (out && nd->kind == FN_NAMEDTUPLE) {
            args = out;
            out = PyObject_Call(nd->obj, args, NULL);
            Py_DECREF(args);
            if (!out)
                return rebuild_failed(up, nd, "its fields as arguments");
        } else if (out && nd->kind == FN_SEQ_SUBCLASS) {
            args = out;
            out = PyObject_CallOneArg(nd->obj, args);
            Py_DECREF(args);
            if (!out)
                return rebuild_failed(up, nd, "a tuple of its items");
        }
        return out;
    case FN_DICT:
        /* a dict subclass: a shallow copy of the empty one the walk made (keeps its type and a
         * defaultdict's factory), so a tree builds any number of batches */
        out = nd->obj ? copy_of(nd->obj) : PyDict_New();
        if (!out)
            return nd->obj ? rebuild_failed(up, nd, "copy.copy") : NULL;
        rc = build_pairs(t, leaves, pos, nd, up, out);
        if (rc) {
            Py_DECREF(out);
            return rc > 0 ? rebuild_failed(up, nd, "its items set") : NULL;
        }
        return out;
    case FN_DATACLASS:
        out = PyDict_New();
        if (!out)
            return NULL;
        if (build_pairs(t, leaves, pos, nd, up, out) != 0) {
            Py_DECREF(out);
            return NULL;
        }
        args = PyTuple_New(0);
        if (args)
            Py_SETREF(out, PyObject_Call(nd->obj, args, out));
        else
            Py_CLEAR(out);
        Py_XDECREF(args);
        return out || !args ? out : rebuild_failed(up, nd, "its fields as keyword arguments");
    }
    return PyErr_Format(PyExc_SystemError, "pinloader: unknown flatten node");
}

PyObject *pl_tree_build(const pl_tree *t, PyObject *leaves)
{
    if (!t->n_nodes)
        return PyErr_Format(PyExc_SystemError, "pinloader: rebuild before a walk");
    if (!PyTuple_Check(leaves) || PyTuple_GET_SIZE(leaves) != t->n_leaves)
        return PyErr_Format(PyExc_SystemError, "pinloader: a batch rebuilt with %zd leaves, walked "
                            "with %zd", PyTuple_Check(leaves) ? PyTuple_GET_SIZE(leaves) : -1,
                            t->n_leaves);
    Py_ssize_t pos = 0;
    return build_at(t, leaves, &pos, NULL);
}

void pl_tree_clear(pl_tree *t)
{
    for (Py_ssize_t i = 0; i < t->n_nodes; i++) {
        Py_XDECREF(t->nodes[i].obj);
        Py_XDECREF(t->nodes[i].key);
    }
    PyMem_RawFree(t->nodes);
    t->nodes = NULL;
    t->n_nodes = t->n_leaves = 0;
}

int pl_tree_traverse(const pl_tree *t, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < t->n_nodes; i++) {
        Py_VISIT(t->nodes[i].obj);
        Py_VISIT(t->nodes[i].key);
    }
    return 0;
}

static void drop_nodes(pl_flat *f)
{
    pl_tree t = {f->nodes, f->n_nodes, 0};
    pl_tree_clear(&t);
    f->nodes = NULL;
    f->n_nodes = f->cap_nodes = 0;
}

void pl_flat_take_tree(pl_flat *f, pl_tree *out)
{
    *out = (pl_tree){f->nodes, f->n_nodes, f->n_leaves};
    f->nodes = NULL;
    f->n_nodes = f->cap_nodes = 0;
}

PyObject *pl_flat_device_arrays(pl_flat *f, pl_block *blk)
{
    PyObject *out = PyTuple_New(f->n_leaves);
    int cuda = f->b->kind == PL_BACKEND_CUDA;
    for (int i = 0; out && i < f->n_leaves; i++) {
        const pl_xfer_leaf *L = &f->leaves[i];
        PyObject *a = pl_device_array_new(f->st, blk, L->off, L->copy.ndim, L->copy.shape,
                                          f->dtypes[i], cuda ? kDLCUDA : kDLCPU, cuda ? f->device : 0);
        if (!a)
            Py_CLEAR(out);
        else
            PyTuple_SET_ITEM(out, i, a);
    }
    return out;
}

pl_leaves *pl_flat_leaf_views(pl_flat *f, pl_block *blk)
{
    pl_leaves *out = pl_flat_leaf_views_raw(f, blk);
    if (!out)
        PyErr_NoMemory();
    return out;
}

pl_leaves *pl_flat_leaf_views_raw(pl_flat *f, pl_block *blk)
{
    size_t dims = 0;
    for (int i = 0; i < f->n_leaves; i++)
        dims += (size_t)f->leaves[i].copy.ndim;
    pl_leaves *out = PyMem_RawMalloc(sizeof(pl_leaves) + (size_t)f->n_leaves * sizeof(pl_da_view) +
                                     dims * sizeof(int64_t));
    if (!out)
        return NULL;
    out->n = f->n_leaves;
    int64_t *shapes = (int64_t *)(out->v + f->n_leaves);
    for (int i = 0; i < f->n_leaves; i++) {
        const pl_xfer_leaf *L = &f->leaves[i];
        int ndim = L->copy.ndim;
        size_t nbytes = f->dtypes[i].bits / 8; /* as pl_device_array_new counts it */
        for (int d = 0; d < ndim; d++)
            nbytes *= (size_t)L->copy.shape[d];
        if (ndim)
            memcpy(shapes, L->copy.shape, (size_t)ndim * sizeof(int64_t));
        out->v[i] = (pl_da_view){blk, L->off, nbytes, ndim, ndim ? shapes : NULL, f->dtypes[i]};
        shapes += ndim;
    }
    return out;
}

PyObject *pl_flat_rebuild(pl_flat *f, pl_block *blk)
{
    PyObject *leaves = pl_flat_device_arrays(f, blk);
    pl_tree t;
    pl_flat_take_tree(f, &t);
    PyObject *out = leaves ? pl_tree_build(&t, leaves) : NULL;
    pl_tree_clear(&t);
    Py_XDECREF(leaves);
    return out;
}

PyObject **pl_flat_take_owners(pl_flat *f, Py_ssize_t *n)
{
    PyObject **o = f->owners;
    *n = f->n_owners;
    f->owners = NULL;
    f->n_owners = f->cap_owners = 0;
    return o;
}

void pl_flat_release_leaves(pl_flat *f)
{
    PyMem_RawFree(f->leaves);
    PyMem_RawFree(f->dtypes);
    f->leaves = NULL;
    f->dtypes = NULL;
    f->n_leaves = 0;
    f->cap_leaves = 0;
    memset(&f->layout, 0, sizeof f->layout);
}

void pl_flat_clear(pl_flat *f)
{
    for (Py_ssize_t i = 0; i < f->n_owners; i++)
        Py_DECREF(f->owners[i]);
    PyMem_RawFree(f->owners);
    drop_nodes(f);
    pl_flat_release_leaves(f);
    pl_flat_init(f, f->st, f->b, f->device);
}

/* pinloader._C._leaves(obj, root, /): see flatten_functions. */
static PyObject *leaves_of(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyUnicode_Check(args[1]))
        return PyErr_Format(PyExc_TypeError, "_leaves(obj, root: str)");
    const char *root = PyUnicode_AsUTF8(args[1]);
    if (!root)
        return NULL;
    pl_state *st = pl_state_of_module(m);
    pl_flat f;
    PyObject *found = NULL, *passed = NULL;
    pl_flat_init(&f, st, pl_backend_host(), 0);
    int rc = pl_flat_structure(&f, args[0], root, &found, &passed);
    pl_flat_clear(&f);
    if (rc < 0)
        return NULL;
    PyObject *out = PyTuple_Pack(2, found, passed);
    Py_DECREF(found);
    Py_DECREF(passed);
    return out;
}

static PyMethodDef flatten_functions[] = {
    {"_leaves", (PyCFunction)(void (*)(void))leaves_of, METH_FASTCALL,
     "_leaves(obj, root, /)\n--\n\n(leaves, others): the array-like leaves of obj as (path, leaf) "
     "pairs in the order the prefetcher walks it (the walk AsyncPrefetcher's structure= "
     "captures), and the other non-container objects in it, also as (path, object)."},
    {NULL, NULL, 0, NULL},
};

int pl_flatten_init(PyObject *m)
{
    return PyModule_AddFunctions(m, flatten_functions);
}
