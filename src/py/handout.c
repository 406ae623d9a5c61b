/* Handing a batch to the consumer: exports, framework conversion, static buffers, and the one
 * rebuild of the structure. See Note [handout] in handout.h. GIL held throughout.
 *
 * Note [static batches]
 * With static=True every batch is delivered in the same device buffers, one per array leaf,
 * for a step captured in a CUDA graph (which reads its inputs from fixed addresses). The copy
 * from host memory still runs on the copy stream into the batch's own block, overlapping the
 * previous step as usual. When the consumer takes the batch, on the consumer's stream (the
 * `stream` option, resolved then): a wait on the batch's ready event, one device-to-device
 * copy per leaf into its static buffer (and zeros after a short leaf), a record of the static
 * block's ready event, and the batch's block is let go in stream order. So the static buffers
 * are overwritten after the stream's earlier work (the previous step's reads) and before its
 * later work (the next step), and the host never waits. On the host backend the CPU is the
 * consumer: it waits for the batch's copy and copies.
 *   - The layout is the first batch's: each leaf's dtype and shape (with static_rows, at least
 *     that many rows: an ArrayLoader resumed near an epoch's end starts with a short batch). A
 *     later leaf with the same dtype and trailing dimensions and at most as many rows fills
 *     the first rows, the rest are zeroed, and valid_rows says how many rows are real (the
 *     fewest over the leaves with rows: a 0-d leaf, a scalar, has none; a batch of 0-d leaves
 *     only has valid_rows None); any other difference, or another number of array leaves, is
 *     a ValueError naming the leaf.
 *   - out= buffers must not overlap in memory (the same array twice, views of one array):
 *     the leaves would overwrite each other. A ValueError names both.
 *   - A static batch is valid until the next batch is taken.
 *   - The static block never memoizes consumer waits (pl_block.no_memo): an export of a static
 *     DeviceArray to another stream waits on the latest fill, every time.
 *   - With convert=, each static buffer is converted once (the framework's tensor over it) and
 *     the same objects are delivered every batch. */
#include "handout.h"

#include "block.h"
#include "device_array.h"
#include "dlpack.h"
#include "util.h"

#include <string.h>

typedef struct static_leaf {
    char *ptr;            /* device address of the buffer */
    size_t off, nbytes;
    int ndim;
    int64_t *shape; /* PyMem_Raw; NULL when ndim is 0 */
    DLDataType dtype;
} static_leaf;

struct pl_static {
    pl_block *blk;        /* the static buffers, one block laid out like a batch (NULL: out=) */
    Py_ssize_t n;
    static_leaf *leaf;
    PyObject *arrays;     /* tuple: a DeviceArray over blk per leaf (out=: the user's objects) */
    PyObject *converted;  /* tuple: convert() of each, made once; NULL without convert */
    PyObject *capsules;   /* out=: their DLPack capsules, kept unconsumed while in use */
};

static void static_free(pl_static *S)
{
    if (!S)
        return;
    Py_XDECREF(S->converted);
    Py_XDECREF(S->arrays);
    Py_XDECREF(S->capsules);
    for (Py_ssize_t i = 0; S->leaf && i < S->n; i++)
        PyMem_RawFree(S->leaf[i].shape);
    PyMem_RawFree(S->leaf);
    if (S->blk)
        pl_block_decref(S->blk);
    PyMem_RawFree(S);
}

/* An empty pl_static for n leaves, or NULL with MemoryError. */
static pl_static *static_new(Py_ssize_t n)
{
    pl_static *S = PyMem_RawCalloc(1, sizeof(*S));
    if (S)
        S->leaf = PyMem_RawCalloc(n ? (size_t)n : 1, sizeof(static_leaf));
    if (!S || !S->leaf) {
        static_free(S);
        PyErr_NoMemory();
        return NULL;
    }
    S->n = n;
    return S;
}

/* L's dtype and shape (a copy). 0, or -1 with MemoryError. */
static int leaf_set_layout(static_leaf *L, int ndim, const int64_t *shape, DLDataType dtype)
{
    L->ndim = ndim;
    L->dtype = dtype;
    if (!ndim)
        return 0;
    if (!(L->shape = PyMem_RawMalloc((size_t)ndim * sizeof(int64_t)))) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(L->shape, shape, (size_t)ndim * sizeof(int64_t));
    return 0;
}

/* Note [closed during a handout]
 * A handout runs user code and releases the GIL: the stream= callable, the wait for the
 * batch's copy on the host backend, an out= buffer's own __dlpack__ (Python code for a torch
 * tensor), convert=. Any of them, or another thread meanwhile, may close the prefetcher, which
 * frees the static layout (pl_handout_drop_static) and sets h->closed. So after each such call
 * the handout checks h->closed before it reads h->statics again, and static buffers are never
 * made on a closed prefetcher (they would stay allocated past its close()). The batch itself
 * stays alive: the caller holds it until the handout returns. */
static int closed_during(const pl_handout *h)
{
    if (!h->closed)
        return 0;
    PyErr_SetString(PyExc_ValueError, "AsyncPrefetcher is closed (closed while the batch was "
                    "handed out)");
    return -1;
}

/* Bytes of one row of a leaf of n rows, nbytes in all, trailing dimensions shape[1:]. */
static int row_bytes(const pl_da_view *v, size_t *out)
{
    if (v->shape[0] > 0) {
        *out = v->nbytes / (size_t)v->shape[0];
        return 0;
    }
    size_t r = ((size_t)v->dtype.bits * v->dtype.lanes + 7) / 8;
    for (int d = 1; d < v->ndim; d++)
        if (v->shape[d] < 0 || __builtin_mul_overflow(r, (size_t)v->shape[d], &r))
            return -1;
    *out = r;
    return 0;
}

/* The static buffers, laid out from the first batch's leaves (Note [static batches]). */
static pl_static *static_make(pl_state *st, const pl_backend *b, int device, const pl_leaves *leaves,
                              pl_stream *s, int64_t static_rows)
{
    Py_ssize_t n = leaves->n;
    pl_static *S = static_new(n);
    if (!S)
        return NULL;
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const pl_da_view *v = &leaves->v[i];
        static_leaf *L = &S->leaf[i];
        size_t nbytes = v->nbytes, row;
        int grow = v->ndim >= 1 && static_rows > v->shape[0];
        if (grow && (row_bytes(v, &row) < 0 || __builtin_mul_overflow(row, (size_t)static_rows, &nbytes)))
            goto too_large;
        if (pl_align_up_checked(total, PL_ALIGN, &L->off) != 0 ||
            __builtin_add_overflow(L->off, nbytes, &total))
            goto too_large;
        L->nbytes = nbytes;
        if (leaf_set_layout(L, v->ndim, v->shape, v->dtype) < 0)
            goto fail;
        if (grow)
            L->shape[0] = static_rows;
    }
    int rc = pl_block_create(b, device, &S->blk), prev = -1;
    if (rc == PL_OK) {
        S->blk->no_memo = 1;
        if ((rc = pl_device_push(b, device, &prev)) == PL_OK)
            rc = pl_block_alloc(S->blk, total, s, 0); /* s: the consumer's stream */
        pl_device_pop(b, device, prev);
    }
    if (rc != PL_OK) {
        pl_raise_backend(st, b, rc, "AsyncPrefetcher(static=True): allocating the static buffers");
        goto fail;
    }
    int cuda = b->kind == PL_BACKEND_CUDA;
    if (!(S->arrays = PyTuple_New(n)))
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        static_leaf *L = &S->leaf[i];
        L->ptr = S->blk->ptr ? (char *)S->blk->ptr + L->off : NULL;
        PyObject *a = pl_device_array_new(st, S->blk, L->off, L->ndim, L->shape, L->dtype,
                                          cuda ? kDLCUDA : kDLCPU, cuda ? device : 0);
        if (!a)
            goto fail;
        PyTuple_SET_ITEM(S->arrays, i, a);
    }
    return S;
too_large:
    PyErr_SetString(PyExc_OverflowError, "AsyncPrefetcher(static=True): the static buffers' size "
                    "overflows");
fail:
    static_free(S);
    return NULL;
}

typedef struct span {
    const char *lo;
    size_t n;
    Py_ssize_t i;
} span;

static int span_cmp(const void *a, const void *b)
{
    const span *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo ? 1 : (x->i > y->i) - (x->i < y->i);
}

/* ValueError naming two out= buffers whose memory overlaps (the same array twice, views of one
 * array): each would overwrite the other. 0 if none do, -1 with an exception. */
static int out_overlap(const pl_static *S)
{
    span *v = PyMem_RawMalloc((size_t)(S->n ? S->n : 1) * sizeof(span));
    if (!v) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < S->n; i++)
        if (S->leaf[i].nbytes)
            v[m++] = (span){S->leaf[i].ptr, S->leaf[i].nbytes, i};
    qsort(v, (size_t)m, sizeof(span), span_cmp);
    Py_ssize_t far = -1; /* the span reaching furthest so far */
    for (Py_ssize_t k = 0; k < m; k++) {
        if (far >= 0 && (size_t)(v[k].lo - v[far].lo) < v[far].n) {
            Py_ssize_t a = v[far].i < v[k].i ? v[far].i : v[k].i, c = v[far].i < v[k].i ? v[k].i : v[far].i;
            PyMem_RawFree(v);
            PyErr_Format(PyExc_ValueError, "AsyncPrefetcher(out=...): out[%zd] and out[%zd] overlap "
                         "in memory (the same array twice, or views of one array): each leaf needs a "
                         "buffer of its own, or the leaves overwrite each other", a, c);
            return -1;
        }
        if (far < 0 || v[k].lo + v[k].n > v[far].lo + v[far].n)
            far = k;
    }
    PyMem_RawFree(v);
    return 0;
}

/* The static buffers given by the user (out=): each object's DLPack export, read once. They
 * must be C-contiguous, writable, on the prefetcher's device; the delivered leaves are the
 * objects themselves. */
static pl_static *static_from_out(const pl_backend *b, int device, PyObject *out)
{
    Py_ssize_t n = PyTuple_GET_SIZE(out);
    pl_static *S = static_new(n);
    if (!S)
        return NULL;
    S->arrays = Py_NewRef(out);
    if (!(S->capsules = PyTuple_New(n)))
        goto fail;
    int cuda = b->kind == PL_BACKEND_CUDA;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *cap = pl_dlpack_call(PyTuple_GET_ITEM(out, i));
        if (!cap) {
            if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "AsyncPrefetcher(out=...): out[%zd] (%.100s) does "
                             "not export DLPack", i, Py_TYPE(PyTuple_GET_ITEM(out, i))->tp_name);
            }
            goto fail;
        }
        PyTuple_SET_ITEM(S->capsules, i, cap);
        DLTensor *t;
        int versioned;
        if (pl_capsule_tensor(cap, &t, &versioned) < 0)
            goto fail;
        if (versioned) {
            DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
            if (m->flags & DLPACK_FLAG_BITMASK_READ_ONLY) {
                PyErr_Format(PyExc_ValueError, "AsyncPrefetcher(out=...): out[%zd] is read-only", i);
                goto fail;
            }
        }
        int want_type = cuda ? kDLCUDA : kDLCPU, want_id = cuda ? device : 0;
        if (t->device.device_type != want_type || t->device.device_id != want_id) {
            PyErr_Format(PyExc_ValueError, "AsyncPrefetcher(out=...): out[%zd] is on DLPack device "
                         "(%d, %d), not the prefetcher's (%d, %d)", i, (int)t->device.device_type,
                         (int)t->device.device_id, want_type, want_id);
            goto fail;
        }
        static_leaf *L = &S->leaf[i];
        size_t item = ((size_t)t->dtype.bits * t->dtype.lanes + 7) / 8, count = 1, expect = 1;
        int contiguous = 1;
        if (t->ndim < 0 || t->ndim > 64) {
            PyErr_Format(PyExc_ValueError, "AsyncPrefetcher(out=...): out[%zd] has ndim %d", i, (int)t->ndim);
            goto fail;
        }
        for (int d = t->ndim - 1; d >= 0; d--) {
            if (t->shape[d] < 0 || __builtin_mul_overflow(count, (size_t)t->shape[d], &count)) {
                PyErr_Format(PyExc_ValueError, "AsyncPrefetcher(out=...): out[%zd] has a bad shape", i);
                goto fail;
            }
            if (t->strides && t->shape[d] != 1 && t->strides[d] != (int64_t)expect)
                contiguous = 0;
            expect *= (size_t)(t->shape[d] ? t->shape[d] : 1);
        }
        if (!contiguous) {
            PyErr_Format(PyExc_ValueError, "AsyncPrefetcher(out=...): out[%zd] is not C-contiguous", i);
            goto fail;
        }
        if (__builtin_mul_overflow(count, item, &L->nbytes)) {
            PyErr_Format(PyExc_ValueError, "AsyncPrefetcher(out=...): out[%zd] is too large", i);
            goto fail;
        }
        L->ptr = L->nbytes ? (char *)t->data + t->byte_offset : NULL;
        if (leaf_set_layout(L, t->ndim, t->shape, t->dtype) < 0)
            goto fail;
    }
    if (out_overlap(S) < 0)
        goto fail;
    return S;
fail:
    static_free(S);
    return NULL;
}

static int same_dtype(DLDataType a, DLDataType b)
{
    return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

/* out= buffers are exported again for every batch (Note [static batches]): an export keeps
 * its object, not always its memory (torch's keeps the tensor: `set_`, `.data =` or a growing
 * `resize_` give it new memory and free the old), and a capsule kept unconsumed can be consumed
 * by someone else. A buffer that moved or changed since the first batch is a ValueError naming
 * it (a captured graph would read the old address anyway); otherwise the fresh exports replace
 * the previous ones. -1 with an exception, else 0. */
static int out_moved(const pl_backend *b, int device, pl_handout *h)
{
    pl_static *fresh = static_from_out(b, device, h->out);
    if (!fresh)
        return -1;
    if (h->closed) { /* by an out= buffer's own __dlpack__, or meanwhile */
        static_free(fresh);
        return closed_during(h);
    }
    pl_static *S = h->statics;
    for (Py_ssize_t i = 0; i < S->n; i++) {
        const static_leaf *a = &S->leaf[i], *c = &fresh->leaf[i];
        int same = a->ptr == c->ptr && a->nbytes == c->nbytes && a->ndim == c->ndim &&
                   same_dtype(a->dtype, c->dtype);
        for (int d = 0; same && d < a->ndim; d++)
            same = a->shape[d] == c->shape[d];
        if (!same) {
            static_free(fresh);
            PyErr_Format(PyExc_ValueError, "AsyncPrefetcher(out=...): out[%zd] moved or changed since "
                         "the first batch (re-allocated, re-pointed with set_() or .data =, or "
                         "resized): the static buffers must stay where they are", i);
            return -1;
        }
    }
    PyObject *keep = S->capsules;
    S->capsules = fresh->capsules;
    fresh->capsules = keep;
    static_free(fresh);
    return 0;
}

/* Whether batch leaf i fits static leaf L; its real rows in *rows (-1: a 0-d leaf has none).
 * ValueError naming it if not. */
static int check_fits(pl_state *st, Py_ssize_t i, const pl_da_view *v, const static_leaf *L, int out,
                      int64_t *rows)
{
    int ok = same_dtype(v->dtype, L->dtype) && v->ndim == L->ndim;
    for (int d = 1; ok && d < v->ndim; d++)
        ok = v->shape[d] == L->shape[d];
    if (ok && v->ndim)
        ok = v->shape[0] <= L->shape[0];
    *rows = v->ndim ? v->shape[0] : -1;
    if (ok)
        return 0;
    char got[160], want[160];
    pl_shape_text(got, sizeof got, v->ndim, v->shape);
    pl_shape_text(want, sizeof want, L->ndim, L->shape);
    PyObject *gd = pl_dtype_to_python(st, v->dtype), *wd = gd ? pl_dtype_to_python(st, L->dtype) : NULL;
    if (wd && out)
        PyErr_Format(PyExc_ValueError, "AsyncPrefetcher(out=...): batch leaf %zd is %s %S, but "
                     "its buffer out[%zd] is %s %S: a batch may only have fewer rows (see "
                     "valid_rows)", i, got, gd, i, want, wd);
    else if (wd)
        PyErr_Format(PyExc_ValueError, "AsyncPrefetcher(static=True): batch leaf %zd is %s %S, "
                     "but the static buffer (laid out from the first batch) is %s %S: a later "
                     "batch may only have fewer rows (see valid_rows)", i, got, gd, want, wd);
    Py_XDECREF(gd);
    Py_XDECREF(wd);
    return -1;
}

/* Wait until blk's copy is done before the consumer's stream s (CUDA: queued) or the CPU (host
 * backend: blocks, GIL released in slices, Ctrl-C works) reads it. */
static int wait_batch(pl_state *st, pl_block *blk, pl_stream *s)
{
    const pl_backend *b = blk->b;
    int rc;
    if (b->kind == PL_BACKEND_CUDA) {
        rc = pl_block_wait_ready(blk, s);
    } else {
        for (;;) {
            Py_BEGIN_ALLOW_THREADS
            rc = b->event_wait(blk->ready, PL_SIGNAL_SLICE_NS, 0);
            Py_END_ALLOW_THREADS
            if (rc != PL_ERR_TIMEOUT)
                break;
            if (PyErr_CheckSignals() < 0)
                return -1;
        }
    }
    if (rc != PL_OK) {
        pl_raise_backend(st, b, rc, "AsyncPrefetcher(static=True): waiting for the batch's copy");
        return -1;
    }
    return 0;
}

/* Copy the batch's leaves into the static buffers on the consumer's stream (see Note [static
 * batches]). */
static int static_fill(pl_state *st, const pl_backend *b, int device, pl_handout *h,
                       const pl_leaves *leaves, PyObject *stream)
{
    int cuda = b->kind == PL_BACKEND_CUDA;
    pl_dlpack_stream ps;
    if (pl_dlpack_parse_stream(stream, cuda, "AsyncPrefetcher(static=True)", &ps) < 0)
        return -1;
    if (ps.kind == PL_DLPACK_NO_SYNC) {
        PyErr_SetString(PyExc_ValueError, "AsyncPrefetcher(static=True): stream=-1 names no "
                        "stream, but the copy into the static buffers must be queued on the "
                        "consumer's stream; pass its handle (or None for the default stream)");
        return -1;
    }
    pl_stream *s = cuda ? (pl_stream *)ps.handle : NULL;
    Py_ssize_t n = leaves->n;
    int prev = -1, rc = cuda ? pl_device_push(b, device, &prev) : PL_OK;
    if (rc != PL_OK) {
        pl_raise_backend(st, b, rc, "AsyncPrefetcher(static=True): making the device current");
        return -1;
    }
    /* First the wait for the batch's copy: on the host backend it releases the GIL, and
     * nothing of h is held across it (another thread may close the prefetcher meanwhile). */
    pl_block *waited = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        pl_block *blk = leaves->v[i].blk;
        if (blk != waited && wait_batch(st, blk, s) < 0) {
            if (cuda)
                pl_device_pop(b, device, prev);
            return -1;
        }
        waited = blk; /* the leaves of a batch share one block */
    }
    /* Note [closed during a handout]: an out= buffer's __dlpack__ is user code too. */
    int failed = closed_during(h) < 0;
    if (!failed && !h->statics) {
        pl_static *made = h->out ? static_from_out(b, device, h->out)
                                 : static_make(st, b, device, leaves, s, h->static_rows);
        if (made && h->closed) {
            static_free(made);
            made = NULL;
            closed_during(h);
        }
        h->statics = made;
        failed = !made;
    } else if (!failed && h->out) {
        failed = out_moved(b, device, h) < 0;
    }
    /* From here on the GIL is held throughout. */
    pl_static *S = failed ? NULL : h->statics;
    int64_t valid = -1;
    if (S && n != S->n) {
        if (h->out)
            PyErr_Format(PyExc_ValueError, "AsyncPrefetcher(out=...): the batch has %zd array "
                         "leaves, out= has %zd buffers", n, S->n);
        else
            PyErr_Format(PyExc_ValueError, "AsyncPrefetcher(static=True): the batch has %zd array "
                         "leaves, the static batch (laid out from the first batch) %zd", n, S->n);
    }
    for (Py_ssize_t i = 0; S && n == S->n && i < n && !PyErr_Occurred(); i++) {
        int64_t rows; /* the fewest rows over the leaves with rows (Note [static batches]) */
        if (check_fits(st, i, &leaves->v[i], &S->leaf[i], h->out != NULL, &rows) == 0 && rows >= 0 &&
            (valid < 0 || rows < valid))
            valid = rows;
    }
    if (!S || PyErr_Occurred()) {
        if (cuda)
            pl_device_pop(b, device, prev);
        return -1;
    }
    const char *what = "";
    for (Py_ssize_t i = 0; rc == PL_OK && i < n; i++) {
        const pl_da_view *v = &leaves->v[i];
        const static_leaf *L = &S->leaf[i];
        char *dst = L->ptr;
        what = "copying a leaf into its static buffer";
        if (v->nbytes)
            rc = b->memcpy_d2d_async(dst, (const char *)v->blk->ptr + v->offset, v->nbytes, s);
        if (rc == PL_OK && v->nbytes < L->nbytes) {
            what = "zeroing the rows after a short batch's";
            rc = b->memzero_async(dst + v->nbytes, L->nbytes - v->nbytes, s);
        }
    }
    if (rc == PL_OK && cuda && S->blk) {
        what = "recording the static buffers' ready event";
        if ((rc = b->event_record(S->blk->ready, s)) == PL_OK) {
            S->blk->ready_recorded = 1;
            pl_block_note_use(S->blk, s); /* freed only after this stream's work so far */
        }
    }
    if (rc == PL_OK && cuda && waited)
        pl_block_note_use(waited, s); /* the batch's block too */
    if (cuda)
        pl_device_pop(b, device, prev);
    if (rc != PL_OK) {
        char msg[160];
        snprintf(msg, sizeof msg, "AsyncPrefetcher(static=True): %s", what);
        pl_raise_backend(st, b, rc, msg);
        return -1;
    }
    h->valid_rows = valid;
    return 0;
}

/* convert() of each of xs (a tuple, consumed): a new tuple, or NULL with an exception. */
static PyObject *convert_all(const pl_handout *h, PyObject *xs)
{
    if (!xs || !h->convert)
        return xs;
    Py_ssize_t n = PyTuple_GET_SIZE(xs);
    PyObject *out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *r = PyObject_CallOneArg(h->convert, PyTuple_GET_ITEM(xs, i));
        if (!r)
            Py_CLEAR(out);
        else
            PyTuple_SET_ITEM(out, i, r);
    }
    Py_DECREF(xs);
    return out;
}

/* The delivered leaves for `items` (the static buffers' DeviceArrays): capsules for `stream`
 * and/or convert(). */
static PyObject *deliver(pl_state *st, const pl_handout *h, PyObject *items, PyObject *stream)
{
    return convert_all(h, h->capsule ? pl_export_leaves(st, items, stream) : Py_NewRef(items));
}

/* The delivered leaves of a batch, from its views (Note [batch leaves] in flatten.h): capsules
 * for `stream` or DeviceArrays, then convert(). */
static PyObject *deliver_batch(pl_state *st, const pl_backend *b, int device, const pl_handout *h,
                               const pl_leaves *leaves, PyObject *stream)
{
    int cuda = b->kind == PL_BACKEND_CUDA;
    DLDevice dev = {cuda ? kDLCUDA : kDLCPU, cuda ? device : 0};
    PyObject *xs = h->capsule ? pl_export_views(st, leaves->v, leaves->n, dev, stream)
                              : pl_device_arrays_of(st, leaves->v, leaves->n, dev);
    return convert_all(h, xs);
}

PyObject *pl_handout_batch(pl_state *st, const pl_backend *b, int device, pl_handout *h,
                           const pl_tree *tree, const pl_leaves *leaves)
{
    PyObject *out = NULL, *items = NULL, *stream = NULL;
    if (!h->stream || h->closed) {
        return PyErr_Format(PyExc_ValueError, "AsyncPrefetcher is closed");
    }
    if (PyCallable_Check(h->stream)) {
        PyObject *fn = Py_NewRef(h->stream);
        stream = PyObject_CallNoArgs(fn);
        if (stream && stream != Py_None && (!PyLong_Check(stream) || PyBool_Check(stream))) {
            PyErr_Format(PyExc_TypeError, "AsyncPrefetcher: the stream= callable (%R) returned "
                         "%.100s; it must return a DLPack stream handle (an int) or None", fn,
                         Py_TYPE(stream)->tp_name);
            Py_CLEAR(stream);
        }
        Py_DECREF(fn);
    } else {
        stream = Py_NewRef(h->stream);
    }
    if (!stream || closed_during(h) < 0) /* Note [closed during a handout] */
        goto done;
    if (h->is_static) {
        if (static_fill(st, b, device, h, leaves, stream) < 0)
            goto done;
        /* convert (user code) may close the prefetcher, dropping the static buffers: hold
         * what is used, and keep the converted leaves only if these buffers are still h's */
        pl_static *S = h->statics;
        unsigned long gen = h->static_gen;
        PyObject *arrays = Py_NewRef(S->arrays);
        if (h->out)
            items = Py_NewRef(arrays); /* the user's own objects */
        else if (h->convert && S->converted)
            items = Py_NewRef(S->converted);
        else
            items = deliver(st, h, arrays, stream); /* converted, fresh capsules, or the arrays */
        if (items && h->convert && !h->out && h->static_gen == gen && h->statics && !h->statics->converted)
            h->statics->converted = Py_NewRef(items);
        Py_DECREF(arrays);
    } else {
        items = deliver_batch(st, b, device, h, leaves, stream);
    }
    if (items)
        out = pl_tree_build(tree, items);
done:
    Py_XDECREF(items);
    Py_XDECREF(stream);
    return out;
}

PyObject *pl_handout_static_arrays(const pl_handout *h)
{
    if (!h->statics || h->out)
        Py_RETURN_NONE;
    return Py_NewRef(h->statics->arrays);
}

void pl_handout_drop_static(pl_handout *h)
{
    pl_static *S = h->statics;
    h->statics = NULL;
    h->closed = 1;
    h->static_gen++;
    static_free(S);
}

void pl_handout_clear(pl_handout *h)
{
    pl_handout_drop_static(h);
    Py_CLEAR(h->convert);
    Py_CLEAR(h->stream);
    Py_CLEAR(h->out);
}

int pl_handout_traverse(const pl_handout *h, visitproc visit, void *arg)
{
    Py_VISIT(h->convert);
    Py_VISIT(h->stream);
    Py_VISIT(h->out);
    if (h->statics) {
        Py_VISIT(h->statics->arrays);
        Py_VISIT(h->statics->converted);
        Py_VISIT(h->statics->capsules);
    }
    return 0;
}
