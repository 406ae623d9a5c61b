/* AsyncPrefetcher: a native producer thread that pulls items from any Python iterable, stages
 * their array leaves into a pinned region with several threads, copies each batch to one device
 * block on a high-priority copy stream, and hands the batches out in order as DeviceArrays.
 *
 * Note [producer and the GIL]
 * The producer takes the GIL only to call next() on the source and to read the item's leaves
 * (pointers, shapes, strides, owners) and build the output structure. Everything else (the
 * pinned reservation, staging, device allocation, copies, event records) runs without it.
 * Objects it must drop (source arrays, capsules) go to a graveyard that it empties the next
 * time it holds the GIL; sources copied directly by DMA (already pinned) stay there until the
 * batch's ready event has completed.
 *
 * Note [epochs]
 * iter(prefetcher) starts a new epoch: a fresh iterator over the source, tagged with a new epoch
 * number. The iterator and its epoch are read and written only under the GIL, together, so a
 * batch always carries the epoch of the iterator it came from; the consumer drops batches of an
 * older epoch. An epoch that has not handed out anything yet is reused rather than restarted,
 * so the eager first epoch started by the constructor is not wasted by the `for` loop's iter().
 *
 * Locking: `mu` guards the queue, the flow-control counters, `stop` and the stats; it is never
 * held while taking the GIL, and the consumer releases the GIL before waiting on it. */
#include "module.h"

#include "block.h"
#include "np.h"
#include "pool.h"
#include "stager.h"
#include "util.h"

#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <string.h>
#include <structmember.h>

#ifdef PL_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#define NVTX_PUSH(name) nvtxRangePushA(name)
#define NVTX_POP() nvtxRangePop()
#else
#define NVTX_PUSH(name) ((void)0)
#define NVTX_POP() ((void)0)
#endif

#define CHUNK_BYTES ((size_t)8 << 20)
#define DIRECT_MIN_BYTES ((size_t)64 << 10)
#define CONSUMER_SLICE_NS ((int64_t)50 * 1000 * 1000)
#define WAIT_SAMPLES 4096
#define MAX_NEST 256

/* ---- batches ---- */

typedef enum { B_READY, B_END, B_ERROR } batch_kind;

typedef struct leaf_plan {
    pl_leaf_copy copy;
    size_t off;   /* region/device offset (staged) or offset in the direct area */
    int direct;   /* already pinned and contiguous: DMA straight from the source */
} leaf_plan;

typedef struct batch {
    struct batch *next;
    batch_kind kind;
    uint64_t epoch;
    uint64_t index;       /* position in the epoch */
    PyObject *output;     /* B_READY: the structure of DeviceArrays */
    PyObject *exc;        /* B_ERROR with a Python exception (source or bad leaf) */
    int err_code;         /* B_ERROR from the backend */
    char err_what[160];
    pl_block *blk;        /* the batch's reference */
    size_t bytes;
} batch;

typedef struct grave {
    struct grave *next;
    PyObject **objs;
    Py_ssize_t n;
    pl_block *blk; /* non-NULL: keep objs until blk's ready event completes */
} grave;

struct pl_prefetcher_obj {
    PyObject_HEAD
    PyObject *weakreflist;
    pl_prefetcher_obj *live_prev, *live_next; /* GIL */
    pl_state *st;

    /* configuration: set in tp_new, read-only afterwards */
    PyObject *source;
    PyObject *pool_obj;
    pl_pool *pool;
    int own_pool;
    size_t max_pinned;
    const pl_backend *b;
    int device;
    int depth;
    int high_priority;
    int capsule_output;
    PyObject *capsule_stream;
    pl_stager *stager;
    pl_stream *copy_stream;
    pthread_t thread;
    int thread_started;

    /* GIL-protected */
    int in_source;      /* the producer is inside the source's next() */
    int detached;       /* close() left a producer stuck in the source; it cleans up on exit */
    int orphaned;       /* ... and the object was deallocated meanwhile: the producer frees it */
    int resources_freed;
    pl_block *last_direct; /* producer only: the last batch copied straight from the source */
    PyObject *it;
    uint64_t it_epoch;
    uint64_t consumer_epoch;
    uint64_t consumed_in_epoch;
    int consumer_done;
    int failed;
    int closed;
    grave *graves;

    atomic_int gil_wanted; /* the producer is waiting for the GIL (see Note [GIL handoff]) */

    /* mu-protected */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    batch *head, *tail;
    int queued;
    uint64_t requested_epoch;
    uint64_t finished_epoch;
    int stop;
    /* stats */
    uint64_t n_batches;
    uint64_t n_bytes;
    int64_t first_batch_ns, last_batch_ns;
    int64_t next_ns, staging_ns, copy_issue_ns;
    int64_t wait_ns_total;
    uint64_t n_waits;
    double wait_samples[WAIT_SAMPLES];
    size_t device_peak;
    int64_t stall_ns;
    uint64_t stalls;
};

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

static void empty_graves(pl_prefetcher_obj *self, int wait)
{
    grave **link = &self->graves;
    while (*link) {
        grave *g = *link;
        if (g->blk && !wait && g->blk->b->event_query(g->blk->ready) == PL_ERR_NOT_READY) {
            link = &g->next;
            continue;
        }
        if (g->blk && wait) {
            Py_BEGIN_ALLOW_THREADS
            pl_block_sync_ready(g->blk);
            Py_END_ALLOW_THREADS
        }
        *link = g->next;
        for (Py_ssize_t i = 0; i < g->n; i++)
            Py_DECREF(g->objs[i]);
        PyMem_RawFree(g->objs);
        if (g->blk)
            pl_block_decref(g->blk);
        PyMem_Free(g);
    }
}

/* ---- flatten (GIL held) ---- */

typedef struct {
    pl_prefetcher_obj *pf;
    pl_block *blk;
    leaf_plan *leaves;
    int n_leaves, cap_leaves;
    PyObject **owners;
    Py_ssize_t n_owners, cap_owners;
    PyObject **direct_arrays; /* DeviceArrays of direct leaves: offsets patched after layout */
    int n_direct, cap_direct;
    size_t staged, direct;
    char path[512];
    size_t path_len;
} flat;

static int grow(void **arr, int *cap, int need, size_t elem)
{
    if (need <= *cap)
        return 0;
    int nc = *cap ? *cap * 2 : 8;
    while (nc < need)
        nc *= 2;
    void *p = PyMem_RawRealloc(*arr, (size_t)nc * elem); /* freed without the GIL too */
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    *arr = p;
    *cap = nc;
    return 0;
}

static int add_owner(flat *f, PyObject *o)
{
    if (f->n_owners == f->cap_owners) {
        Py_ssize_t nc = f->cap_owners ? f->cap_owners * 2 : 8;
        PyObject **p = PyMem_RawRealloc(f->owners, (size_t)nc * sizeof(*p));
        if (!p) {
            PyErr_NoMemory();
            return -1;
        }
        f->owners = p;
        f->cap_owners = nc;
    }
    f->owners[f->n_owners++] = Py_NewRef(o);
    return 0;
}

static size_t path_push(flat *f, const char *fmt, ...)
{
    size_t old = f->path_len;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(f->path + old, sizeof f->path - old, fmt, ap);
    va_end(ap);
    if (n > 0)
        f->path_len = PL_MIN(sizeof f->path - 1, old + (size_t)n);
    return old;
}

static void path_pop(flat *f, size_t old)
{
    f->path_len = old;
    f->path[old] = 0;
}

static size_t path_push_key(flat *f, PyObject *key)
{
    PyObject *r = PyObject_Repr(key);
    const char *s = r ? PyUnicode_AsUTF8(r) : NULL;
    size_t old = path_push(f, "[%s]", s ? s : "?");
    Py_XDECREF(r);
    PyErr_Clear();
    return old;
}

static PyObject *leaf_error(flat *f, PyObject *type, const char *why)
{
    PyErr_Format(type, "%s: %s", f->path, why);
    return NULL;
}

/* Add an array leaf (already validated) and return its DeviceArray. */
static PyObject *add_array(flat *f, const char *data, int ndim, const npy_intp *shape,
                           const int64_t *strides_bytes, DLDataType dt, int pinned)
{
    pl_prefetcher_obj *pf = f->pf;
    if (ndim > PL_MAX_DIMS)
        return leaf_error(f, PyExc_ValueError, "too many dimensions");
    if (grow((void **)&f->leaves, &f->cap_leaves, f->n_leaves + 1, sizeof(leaf_plan)) < 0)
        return NULL;
    leaf_plan *L = &f->leaves[f->n_leaves];
    memset(L, 0, sizeof(*L));
    size_t itemsize = dt.bits / 8;
    size_t nbytes = itemsize;
    int64_t shape64[PL_MAX_DIMS];
    int contiguous = 1;
    int64_t expect = (int64_t)itemsize;
    for (int i = ndim - 1; i >= 0; i--) {
        shape64[i] = shape[i];
        nbytes *= (size_t)shape[i];
        if (shape[i] != 1 && strides_bytes[i] != expect)
            contiguous = 0;
        expect *= shape[i];
    }
    L->copy.src = data;
    L->copy.ndim = ndim;
    L->copy.itemsize = itemsize;
    L->copy.nbytes = nbytes;
    memcpy(L->copy.shape, shape64, (size_t)ndim * sizeof(int64_t));
    memcpy(L->copy.strides, strides_bytes, (size_t)ndim * sizeof(int64_t));
    L->direct = pinned && contiguous && nbytes >= DIRECT_MIN_BYTES;
    if (L->direct) {
        L->off = f->direct;
        f->direct += PL_ALIGN_UP(nbytes, PL_ALIGN);
    } else {
        L->off = f->staged;
        f->staged += PL_ALIGN_UP(nbytes, PL_ALIGN);
    }
    f->n_leaves++;
    int dev_type = pf->b->kind == PL_BACKEND_CUDA ? kDLCUDA : kDLCPU;
    PyObject *arr = pl_device_array_new(pf->st, f->blk, L->off, ndim, shape64, dt, dev_type,
                                        pf->b->kind == PL_BACKEND_CUDA ? pf->device : 0);
    if (arr && L->direct) {
        if (grow((void **)&f->direct_arrays, &f->cap_direct, f->n_direct + 1, sizeof(PyObject *)) < 0) {
            Py_DECREF(arr);
            return NULL;
        }
        f->direct_arrays[f->n_direct++] = arr; /* borrowed: the output holds it */
    }
    return arr;
}

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

static int query_pinned(pl_prefetcher_obj *pf, const void *p, size_t nbytes)
{
    if (pf->b->kind != PL_BACKEND_CUDA || nbytes < DIRECT_MIN_BYTES)
        return 0;
    int pinned = 0;
    pf->b->host_is_pinned(p, &pinned);
    return pinned;
}

static PyObject *numpy_leaf(flat *f, PyArrayObject *a)
{
    PyArray_Descr *d = PyArray_DESCR(a);
    DLDataType dt;
    const char *why = NULL;
    if (pl_dtype_from_numpy(d->kind, (int)PyDataType_ELSIZE(d), d->type_num, d->byteorder, &dt, &why) < 0) {
        PyObject *dr = PyObject_Str((PyObject *)d);
        PyErr_Format(PyExc_TypeError, "%s: %s (dtype %s)", f->path, why, dr ? PyUnicode_AsUTF8(dr) : "?");
        Py_XDECREF(dr);
        return NULL;
    }
    int nd = PyArray_NDIM(a);
    int64_t strides[PL_MAX_DIMS];
    for (int i = 0; i < nd && i < PL_MAX_DIMS; i++)
        strides[i] = PyArray_STRIDES(a)[i];
    size_t nbytes = (size_t)PyArray_NBYTES(a);
    int pinned = PyArray_IS_C_CONTIGUOUS(a) &&
                 (base_is_pinned_buffer(f->pf->st, a) || query_pinned(f->pf, PyArray_DATA(a), nbytes));
    PyObject *out = add_array(f, PyArray_DATA(a), nd, PyArray_DIMS(a), strides, dt, pinned);
    if (out && add_owner(f, (PyObject *)a) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *call_dlpack(PyObject *obj)
{
    PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__");
    if (!meth)
        return NULL;
    PyObject *kw = Py_BuildValue("{s:(ii)}", "max_version", DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION);
    PyObject *empty = PyTuple_New(0);
    PyObject *cap = kw && empty ? PyObject_Call(meth, empty, kw) : NULL;
    if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear(); /* an exporter older than max_version */
        cap = PyObject_CallNoArgs(meth);
    }
    Py_XDECREF(kw);
    Py_XDECREF(empty);
    Py_DECREF(meth);
    return cap;
}

static PyObject *dlpack_leaf(flat *f, PyObject *obj, PyObject *devobj)
{
    pl_prefetcher_obj *pf = f->pf;
    int dev_type = -1, dev_id = -1;
    if (!PyArg_ParseTuple(devobj, "ii", &dev_type, &dev_id)) {
        PyErr_Clear();
        return leaf_error(f, PyExc_TypeError, "__dlpack_device__() did not return (device_type, device_id)");
    }
    if (dev_type == kDLCUDA) {
        if (pf->b->kind == PL_BACKEND_CUDA && dev_id == pf->device)
            return Py_NewRef(obj); /* already where it is going */
        char why[160];
        if (pf->b->kind == PL_BACKEND_CUDA)
            snprintf(why, sizeof why, "array is on cuda:%d, but this prefetcher delivers to cuda:%d "
                     "(move it to the host or use a prefetcher for that device)", dev_id, pf->device);
        else
            snprintf(why, sizeof why, "array is on cuda:%d, but this prefetcher uses the host backend", dev_id);
        return leaf_error(f, PyExc_ValueError, why);
    }
    if (dev_type != kDLCPU && dev_type != kDLCUDAHost) {
        char why[128];
        snprintf(why, sizeof why, "arrays on DLPack device type %d cannot be copied (only CPU and "
                 "pinned host memory)", dev_type);
        return leaf_error(f, PyExc_ValueError, why);
    }
    PyObject *cap = call_dlpack(obj);
    if (!cap) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyObject *s = value ? PyObject_Str(value) : NULL;
        PyErr_Format(PyExc_TypeError, "%s: __dlpack__() failed: %s", f->path, s ? PyUnicode_AsUTF8(s) : "?");
        Py_XDECREF(s);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return NULL;
    }
    DLTensor *t;
    int versioned;
    if (pl_capsule_tensor(cap, &t, &versioned) < 0) {
        Py_DECREF(cap);
        PyErr_Clear();
        return leaf_error(f, PyExc_TypeError, "__dlpack__() did not return a usable DLPack capsule");
    }
    const char *why = NULL;
    if (pl_dtype_valid(t->dtype, &why) < 0) {
        Py_DECREF(cap);
        char msg[128];
        snprintf(msg, sizeof msg, "%s (code %u, bits %u, lanes %u)", why, t->dtype.code, t->dtype.bits, t->dtype.lanes);
        return leaf_error(f, PyExc_TypeError, msg);
    }
    if (t->ndim < 0 || t->ndim > PL_MAX_DIMS) {
        Py_DECREF(cap);
        return leaf_error(f, PyExc_ValueError, "too many dimensions");
    }
    npy_intp shape[PL_MAX_DIMS];
    int64_t strides[PL_MAX_DIMS];
    size_t isz = t->dtype.bits / 8;
    int64_t acc = 1;
    size_t nbytes = isz;
    for (int i = t->ndim - 1; i >= 0; i--) {
        shape[i] = (npy_intp)t->shape[i];
        strides[i] = t->strides ? t->strides[i] * (int64_t)isz : acc * (int64_t)isz;
        acc *= t->shape[i];
        nbytes *= (size_t)t->shape[i];
    }
    const char *data = (const char *)t->data + t->byte_offset;
    int pinned = dev_type == kDLCUDAHost || query_pinned(pf, data, nbytes);
    PyObject *out = add_array(f, data, t->ndim, shape, strides, t->dtype, pinned);
    /* The capsule stays unconsumed in the graveyard; dropping it there runs the exporter's
     * deleter with the GIL held. */
    if (out && add_owner(f, cap) < 0) {
        Py_CLEAR(out);
    }
    Py_DECREF(cap);
    return out;
}

static PyObject *flatten(flat *f, PyObject *obj, int level);

static PyObject *flatten_seq(flat *f, PyObject *obj, int level, int is_list)
{
    Py_ssize_t n = is_list ? PyList_GET_SIZE(obj) : PyTuple_GET_SIZE(obj);
    PyObject *out = is_list ? PyList_New(n) : PyTuple_New(n);
    if (!out)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* a strong reference: flatten may run user code (__dlpack__) that changes the list */
        PyObject *item = Py_NewRef(is_list ? PyList_GET_ITEM(obj, i) : PyTuple_GET_ITEM(obj, i));
        size_t mark = path_push(f, "[%zd]", i);
        PyObject *o = flatten(f, item, level + 1);
        path_pop(f, mark);
        Py_DECREF(item);
        if (!o) {
            Py_DECREF(out);
            return NULL;
        }
        if (is_list)
            PyList_SET_ITEM(out, i, o);
        else
            PyTuple_SET_ITEM(out, i, o);
        if (is_list && PyList_GET_SIZE(obj) != n) {
            Py_DECREF(out);
            return leaf_error(f, PyExc_RuntimeError, "list changed size while being read");
        }
    }
    return out;
}

static PyObject *flatten(flat *f, PyObject *obj, int level)
{
    if (level > MAX_NEST)
        return leaf_error(f, PyExc_RecursionError, "nesting deeper than 256 levels");
    if (PyArray_CheckExact(obj) || PyArray_Check(obj))
        return numpy_leaf(f, (PyArrayObject *)obj);
    if (obj == Py_None || PyUnicode_Check(obj) || PyBytes_Check(obj) || PyLong_Check(obj) ||
        PyFloat_Check(obj) || PyBool_Check(obj) || PyComplex_Check(obj) || PyArray_IsScalar(obj, Generic))
        return Py_NewRef(obj);
    if (PyTuple_CheckExact(obj))
        return flatten_seq(f, obj, level, 0);
    if (PyList_Check(obj))
        return flatten_seq(f, obj, level, 1);
    if (PyTuple_Check(obj)) {
        /* namedtuple (or another tuple subclass): rebuild with type(obj)(*items) */
        PyObject *fields = PyObject_GetAttrString(obj, "_fields");
        PyErr_Clear();
        Py_ssize_t n = PyTuple_GET_SIZE(obj);
        PyObject *items = PyTuple_New(n);
        if (!items) {
            Py_XDECREF(fields);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            size_t mark;
            PyObject *name = fields && PyTuple_Check(fields) && i < PyTuple_GET_SIZE(fields)
                                 ? PyTuple_GET_ITEM(fields, i) : NULL;
            if (name && PyUnicode_Check(name))
                mark = path_push(f, ".%s", PyUnicode_AsUTF8(name));
            else
                mark = path_push(f, "[%zd]", i);
            PyObject *o = flatten(f, PyTuple_GET_ITEM(obj, i), level + 1);
            path_pop(f, mark);
            if (!o) {
                Py_DECREF(items);
                Py_XDECREF(fields);
                return NULL;
            }
            PyTuple_SET_ITEM(items, i, o);
        }
        Py_XDECREF(fields);
        PyObject *out = PyObject_Call((PyObject *)Py_TYPE(obj), items, NULL);
        Py_DECREF(items);
        return out;
    }
    if (PyDict_Check(obj)) {
        PyObject *out = PyDict_New();
        if (!out)
            return NULL;
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(obj, &pos, &key, &value)) {
            Py_INCREF(key);
            Py_INCREF(value);
            size_t mark = path_push_key(f, key);
            PyObject *o = flatten(f, value, level + 1);
            path_pop(f, mark);
            int rc = o ? PyDict_SetItem(out, key, o) : -1;
            Py_DECREF(key);
            Py_DECREF(value);
            Py_XDECREF(o);
            if (rc < 0) {
                Py_DECREF(out);
                return NULL;
            }
        }
        if (PyDict_CheckExact(obj))
            return out;
        /* OrderedDict, defaultdict and other dict subclasses: a shallow copy keeps the type and
         * its extra state (default_factory...); then the values are replaced. */
        PyObject *copy_mod = PyImport_ImportModule("copy");
        PyObject *r = copy_mod ? PyObject_CallMethod(copy_mod, "copy", "O", obj) : NULL;
        Py_XDECREF(copy_mod);
        if (r && PyDict_Check(r)) {
            PyDict_Clear(r);
            if (PyDict_Update(r, out) == 0) {
                Py_DECREF(out);
                return r;
            }
        }
        Py_XDECREF(r);
        Py_DECREF(out);
        PyErr_Clear();
        return leaf_error(f, PyExc_TypeError, "cannot rebuild this dict subclass (copy.copy failed)");
    }
    PyObject *dcf = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__dataclass_fields__");
    if (dcf) {
        /* dataclass: rebuild with type(obj)(**{field: value}) over its init fields */
        PyObject *kwargs = PyDict_New(), *out = NULL;
        PyObject *key, *field;
        Py_ssize_t pos = 0;
        int ok = kwargs != NULL;
        if (ok && !PyDict_Check(dcf)) {
            ok = 0;
            PyErr_Format(PyExc_TypeError, "%s: __dataclass_fields__ is not a dict", f->path);
        }
        while (ok && PyDict_Next(dcf, &pos, &key, &field)) {
            PyObject *init = PyObject_GetAttrString(field, "init");
            int is_init = init ? PyObject_IsTrue(init) : 0;
            Py_XDECREF(init);
            if (is_init <= 0) {
                PyErr_Clear();
                continue;
            }
            PyObject *value = PyObject_GetAttr(obj, key);
            if (!value) {
                ok = 0;
                break;
            }
            size_t mark = path_push(f, ".%s", PyUnicode_AsUTF8(key));
            PyObject *o = flatten(f, value, level + 1);
            path_pop(f, mark);
            Py_DECREF(value);
            if (!o || PyDict_SetItem(kwargs, key, o) < 0)
                ok = 0;
            Py_XDECREF(o);
        }
        if (ok) {
            PyObject *empty = PyTuple_New(0);
            out = empty ? PyObject_Call((PyObject *)Py_TYPE(obj), empty, kwargs) : NULL;
            Py_XDECREF(empty);
        }
        Py_XDECREF(kwargs);
        Py_DECREF(dcf);
        return out;
    }
    PyErr_Clear();
    if (PyObject_HasAttrString(obj, "__dlpack_device__") && PyObject_HasAttrString(obj, "__dlpack__")) {
        PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
        if (!dev)
            return NULL;
        PyObject *out = dlpack_leaf(f, obj, dev);
        Py_DECREF(dev);
        return out;
    }
    if (PyObject_CheckBuffer(obj)) {
        PyObject *arr = PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
        if (!arr) {
            PyErr_Clear();
            return leaf_error(f, PyExc_TypeError, "buffer-protocol object could not be read as an array");
        }
        PyObject *out = numpy_leaf(f, (PyArrayObject *)arr);
        Py_DECREF(arr);
        return out;
    }
    return Py_NewRef(obj); /* any other object passes through unchanged */
}

static void flat_clear(flat *f)
{
    for (Py_ssize_t i = 0; i < f->n_owners; i++)
        Py_DECREF(f->owners[i]);
    PyMem_RawFree(f->owners);
    PyMem_RawFree(f->leaves);
    PyMem_RawFree(f->direct_arrays);
    memset(f, 0, sizeof(*f));
}

/* ---- the producer thread ---- */

typedef struct {
    pl_prefetcher_obj *pf;
    pl_block *blk;
    pl_region *region;
    int rc;
} chunk_ctx;

static int issue_chunk(void *arg, size_t off, size_t len)
{
    chunk_ctx *c = arg;
    NVTX_PUSH("pinloader.copy");
    int rc = c->pf->b->memcpy_h2d_async((char *)c->blk->ptr + off, (char *)c->region->ptr + off, len,
                                        c->pf->copy_stream);
    NVTX_POP();
    return rc;
}

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
        size_t live = pl_block_live_bytes(self->b);
        if (live > self->device_peak)
            self->device_peak = live;
    }
    pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
}

static void fail_batch(batch *bt, int code, const char *what)
{
    bt->kind = B_ERROR;
    bt->err_code = code;
    snprintf(bt->err_what, sizeof bt->err_what, "%s", what);
}

/* A copy failed after others were queued: the block's free and the sources' release must
 * still come after them. Record the ready event behind them, or wait for the stream. */
static void mark_ready_after_failure(pl_prefetcher_obj *self, batch *bt)
{
    if (!bt->blk->ready_recorded && self->b->event_record(bt->blk->ready, self->copy_stream) != PL_OK)
        self->b->stream_synchronize(self->copy_stream);
    bt->blk->ready_recorded = 1;
}

/* Everything after the item is read: no GIL. Returns 0 or fills bt as an error. */
static void transfer(pl_prefetcher_obj *self, flat *f, batch *bt)
{
    const pl_backend *b = self->b;
    pl_region *region = NULL;
    int rc;
    if (f->staged) {
        if (self->own_pool && !self->max_pinned) {
            size_t want = (size_t)(self->depth + 2) * (f->staged + f->staged / 8 + PL_ALIGN);
            pl_pool_raise_cap(self->pool, PL_MIN(want, PL_MAX(pl_pool_default_cap(), f->staged * 2)));
        }
        int64_t t0 = pl_now_ns();
        pl_pool_stats before;
        pl_pool_get_stats(self->pool, &before);
        rc = pl_pool_reserve(self->pool, f->staged, -1, &self->stop, &region);
        pl_pool_stats after;
        pl_pool_get_stats(self->pool, &after);
        if (after.waits != before.waits) {
            pthread_mutex_lock(&self->mu);
            self->stalls++;
            self->stall_ns += pl_now_ns() - t0;
            pthread_mutex_unlock(&self->mu);
        }
        if (rc != PL_OK) {
            char what[160];
            if (rc == PL_ERR_OVER_CAP)
                snprintf(what, sizeof what, "item %llu: a batch of %zu bytes to stage can never fit "
                         "under the pinned cap of %zu bytes (max_pinned_bytes or the pool's max_bytes)",
                         (unsigned long long)bt->index, f->staged, pl_pool_cap(self->pool));
            else if (rc == PL_ERR_INVALID_VALUE)
                snprintf(what, sizeof what, "item %llu: the shared PinnedPool was closed",
                         (unsigned long long)bt->index);
            else
                snprintf(what, sizeof what, "reserving %zu pinned bytes", f->staged);
            fail_batch(bt, rc, what);
            return;
        }
    }
    rc = b->set_device(self->device);
    if (rc == PL_OK)
        rc = pl_block_alloc(bt->blk, f->staged + f->direct, self->copy_stream);
    if (rc != PL_OK) {
        if (region)
            pl_pool_release(self->pool, region);
        fail_batch(bt, rc, "allocating device memory for the batch");
        return;
    }
    if (f->staged) {
        chunk_ctx c = {self, bt->blk, region, PL_OK};
        int64_t t0 = pl_now_ns();
        NVTX_PUSH("pinloader.stage");
        /* The stager wants the staged leaves' copies side by side, in region order. */
        pl_leaf_copy *copies = PyMem_RawMalloc((size_t)f->n_leaves * sizeof(pl_leaf_copy));
        if (!copies) {
            NVTX_POP();
            pl_pool_release(self->pool, region);
            fail_batch(bt, PL_ERR_NO_MEMORY, "staging");
            return;
        }
        int staged = 0;
        for (int i = 0; i < f->n_leaves; i++)
            if (!f->leaves[i].direct) {
                copies[staged] = f->leaves[i].copy;
                copies[staged].dst = (char *)region->ptr + f->leaves[i].off;
                staged++;
            }
        size_t chunk = f->staged >= 2 * CHUNK_BYTES ? CHUNK_BYTES : 0;
        rc = pl_stager_run(self->stager, copies, staged, region->ptr, f->staged, chunk, issue_chunk, &c);
        PyMem_RawFree(copies);
        NVTX_POP();
        pthread_mutex_lock(&self->mu);
        self->staging_ns += pl_now_ns() - t0;
        pthread_mutex_unlock(&self->mu);
        if (rc != PL_OK) {
            /* Some copies may be queued: release only after the stream passes them. */
            mark_ready_after_failure(self, bt);
            pl_pool_release_after(self->pool, region, self->copy_stream);
            fail_batch(bt, rc, "cudaMemcpyAsync of a staged chunk");
            return;
        }
    }
    int64_t t1 = pl_now_ns();
    for (int i = 0; rc == PL_OK && i < f->n_leaves; i++) {
        leaf_plan *L = &f->leaves[i];
        if (L->direct)
            rc = b->memcpy_h2d_async((char *)bt->blk->ptr + f->staged + L->off, L->copy.src,
                                     L->copy.nbytes, self->copy_stream);
    }
    if (rc == PL_OK) {
        rc = b->event_record(bt->blk->ready, self->copy_stream);
        bt->blk->ready_recorded = rc == PL_OK;
    }
    if (region)
        pl_pool_release_after(self->pool, region, self->copy_stream);
    pthread_mutex_lock(&self->mu);
    self->copy_issue_ns += pl_now_ns() - t1;
    pthread_mutex_unlock(&self->mu);
    if (rc != PL_OK) {
        mark_ready_after_failure(self, bt);
        fail_batch(bt, rc, "queuing the batch copy");
    }
}

/* Wait (no GIL) until there is room and work; returns 0 to go on, -1 to exit. */
static int producer_wait(pl_prefetcher_obj *self)
{
    pthread_mutex_lock(&self->mu);
    while (!self->stop && (self->queued >= self->depth || self->finished_epoch == self->requested_epoch))
        pthread_cond_wait(&self->cv, &self->mu);
    int stop = self->stop;
    pthread_mutex_unlock(&self->mu);
    return stop ? -1 : 0;
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

static void pf_free_resources(pl_prefetcher_obj *self);

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
static PyGILState_STATE producer_take_gil(pl_prefetcher_obj *self)
{
    atomic_store(&self->gil_wanted, 1);
    PyGILState_STATE g = PyGILState_Ensure();
    atomic_store(&self->gil_wanted, 0);
    return g;
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

static int stopping(pl_prefetcher_obj *self)
{
    pthread_mutex_lock(&self->mu);
    int stop = self->stop;
    pthread_mutex_unlock(&self->mu);
    return stop;
}

static void *producer_main(void *arg)
{
    pl_prefetcher_obj *self = arg;
    uint64_t index = 0, last_epoch = 0;
    /* The previous batch's source objects, dropped at the next GIL acquisition (one per
     * batch, see Note [GIL handoff]). */
    PyObject **prev_owners = NULL;
    Py_ssize_t prev_n = 0;
    pl_block *prev_blk = NULL;
    self->b->set_device(self->device);
    for (;;) {
        if (producer_wait(self) < 0)
            break;
        wait_direct_copy(self);
        if (pl_py_finalizing())
            return NULL; /* the interpreter is going away: touch nothing of it */
        PyGILState_STATE g = producer_take_gil(self);
        bury(self, prev_owners, prev_n, prev_blk);
        if (prev_blk)
            pl_block_decref(prev_blk);
        prev_owners = NULL;
        prev_n = 0;
        prev_blk = NULL;
        if (stopping(self)) {
            PyGILState_Release(g);
            break;
        }
        empty_graves(self, 0);
        uint64_t epoch = self->it_epoch;
        if (epoch != last_epoch) {
            last_epoch = epoch;
            index = 0;
        }
        batch *bt = PyMem_RawCalloc(1, sizeof(*bt));
        if (!bt) {
            PyGILState_Release(g);
            pl_sleep_ns(1000000);
            continue;
        }
        bt->epoch = epoch;
        bt->index = index++;
        flat f;
        memset(&f, 0, sizeof f);
        f.pf = self;
        PyObject *it = Py_XNewRef(self->it);
        int64_t t0 = pl_now_ns();
        self->in_source = 1;
        PyObject *item = it ? PyIter_Next(it) : NULL;
        self->in_source = 0;
        int64_t t_next = pl_now_ns() - t0;
        Py_XDECREF(it);
        if (stopping(self)) {
            /* closed while the source was running: what it gave is not wanted */
            Py_XDECREF(item);
            PyErr_Clear();
            PyMem_RawFree(bt);
            PyGILState_Release(g);
            break;
        }
        if (!item) {
            if (PyErr_Occurred()) {
                bt->kind = B_ERROR;
                bt->exc = fetch_exception();
                add_source_note(bt->exc, bt->index);
            } else {
                bt->kind = B_END;
            }
            PyGILState_Release(g);
            push_batch(self, bt);
            continue;
        }
        int rc = pl_block_create(self->b, self->device, &bt->blk);
        if (rc != PL_OK) {
            Py_DECREF(item);
            fail_batch(bt, rc, "creating the batch's ready event");
            PyGILState_Release(g);
            push_batch(self, bt);
            continue;
        }
        f.blk = bt->blk;
        path_push(&f, "item");
        bt->output = flatten(&f, item, 0);
        Py_DECREF(item);
        if (!bt->output) {
            bt->kind = B_ERROR;
            bt->exc = fetch_exception();
            flat_clear(&f);
            PyGILState_Release(g);
            push_batch(self, bt);
            continue;
        }
        for (int i = 0; i < f.n_direct; i++)
            pl_device_array_add_offset(f.direct_arrays[i], f.staged);
        PyGILState_Release(g);

        bt->kind = B_READY;
        bt->bytes = f.staged + f.direct;
        pthread_mutex_lock(&self->mu);
        self->next_ns += t_next;
        pthread_mutex_unlock(&self->mu);
        transfer(self, &f, bt);

        /* The owners go to the graveyard at the next GIL acquisition; sources read by DMA
         * stay there until the copy is done. */
        if (f.n_direct && bt->kind == B_READY) {
            pl_block_incref(bt->blk);
            self->last_direct = bt->blk;
        }
        prev_owners = f.owners;
        prev_n = f.n_owners;
        if (f.n_direct) {
            pl_block_incref(bt->blk);
            prev_blk = bt->blk;
        }
        f.owners = NULL;
        f.n_owners = 0;
        PyMem_RawFree(f.leaves);
        PyMem_RawFree(f.direct_arrays);
        push_batch(self, bt);
    }

    /* Exit. A producer that close() left behind (stuck in the source) cleans up here. */
    wait_direct_copy(self);
    if (pl_py_finalizing())
        return NULL;
    PyGILState_STATE g = PyGILState_Ensure();
    bury(self, prev_owners, prev_n, prev_blk);
    if (prev_blk)
        pl_block_decref(prev_blk);
    if (self->detached) {
        pf_free_resources(self);
        if (self->orphaned) {
            PyTypeObject *tp = Py_TYPE(self);
            pthread_mutex_destroy(&self->mu);
            pthread_cond_destroy(&self->cv);
            tp->tp_free((PyObject *)self);
            Py_DECREF(tp);
        } else {
            Py_DECREF(self); /* the reference close() gave this thread */
        }
    }
    PyGILState_Release(g);
    return NULL;
}

/* ---- consumer side (GIL held) ---- */

static void batch_free(batch *bt)
{
    Py_XDECREF(bt->output);
    Py_XDECREF(bt->exc);
    if (bt->blk)
        pl_block_decref(bt->blk);
    PyMem_RawFree(bt);
}

static int start_epoch(pl_prefetcher_obj *self)
{
    PyObject *it = PyObject_GetIter(self->source);
    if (!it)
        return -1;
    Py_XSETREF(self->it, it);
    self->it_epoch++;
    self->consumer_epoch = self->it_epoch;
    self->consumed_in_epoch = 0;
    self->consumer_done = 0;
    pthread_mutex_lock(&self->mu);
    self->requested_epoch = self->it_epoch;
    pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
    return 0;
}

static int check_usable(pl_prefetcher_obj *self)
{
    if (pl_forked_child) {
        PyErr_SetString(PyExc_RuntimeError, "this AsyncPrefetcher was created before fork(): it "
                        "cannot be used in the child process (its threads and CUDA state stay in "
                        "the parent); start worker processes with the 'spawn' method");
        return -1;
    }
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "AsyncPrefetcher is closed");
        return -1;
    }
    return 0;
}

static PyObject *pf_iter(PyObject *op)
{
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    if (check_usable(self) < 0)
        return NULL;
    if (self->failed || (self->consumed_in_epoch == 0 && !self->consumer_done))
        return Py_NewRef(op); /* finished for good, or the current epoch is still fresh */
    PyObject *it = PyObject_GetIter(self->source);
    if (!it)
        return NULL;
    int same = it == self->it;
    Py_DECREF(it);
    if (same && !self->consumer_done) {
        /* A one-shot iterator (a generator): iter() gives the same object, so this is the same
         * stream of items; keep what is already prefetched rather than dropping it. */
        return Py_NewRef(op);
    }
    if (start_epoch(self) < 0)
        return NULL;
    return Py_NewRef(op);
}

static double percentile(double *v, size_t n, double q);

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

static PyObject *to_capsules(pl_prefetcher_obj *self, PyObject *obj);

static PyObject *pf_next(PyObject *op)
{
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    if (check_usable(self) < 0)
        return NULL;
    if (self->failed || self->consumer_done)
        return NULL; /* StopIteration */
    lend_gil_to_producer(self);
    empty_graves(self, 0);
    int64_t t0 = pl_now_ns();
    int waited = 0;
    batch *bt = NULL;
    for (;;) {
        pthread_mutex_lock(&self->mu);
        bt = self->head;
        if (bt) {
            self->head = bt->next;
            if (!self->head)
                self->tail = NULL;
            self->queued--;
            pthread_cond_broadcast(&self->cv);
        }
        pthread_mutex_unlock(&self->mu);
        if (bt) {
            if (bt->epoch != self->consumer_epoch) {
                batch_free(bt); /* from an abandoned epoch */
                continue;
            }
            break;
        }
        if (self->closed || self->consumer_done || self->failed) {
            /* another thread closed it, or took the end of the epoch */
            if (self->closed)
                PyErr_SetString(PyExc_ValueError, "AsyncPrefetcher was closed while waiting for a batch");
            return NULL;
        }
        waited = 1;
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&self->mu);
        if (!self->head) {
            struct timespec ts;
            pl_deadline(&ts, CONSUMER_SLICE_NS);
            pthread_cond_timedwait(&self->cv, &self->mu, &ts);
        }
        pthread_mutex_unlock(&self->mu);
        Py_END_ALLOW_THREADS
        if (PyErr_CheckSignals() < 0)
            return NULL;
    }
    int64_t wait = pl_now_ns() - t0;
    pthread_mutex_lock(&self->mu);
    self->wait_samples[self->n_waits % WAIT_SAMPLES] = (double)(waited ? wait : 0) / 1e6;
    self->n_waits++;
    self->wait_ns_total += waited ? wait : 0;
    pthread_mutex_unlock(&self->mu);

    if (bt->kind == B_END) {
        self->consumer_done = 1;
        batch_free(bt);
        return NULL;
    }
    if (bt->kind == B_ERROR) {
        self->failed = 1;
        self->consumer_done = 1;
        raise_batch_error(self, bt);
        batch_free(bt);
        return NULL;
    }
    self->consumed_in_epoch++;
    PyObject *out = bt->output;
    bt->output = NULL;
    batch_free(bt);
    if (self->capsule_output) {
        PyObject *caps = to_capsules(self, out);
        Py_DECREF(out);
        return caps;
    }
    return out;
}

/* output="capsule": the same structure with each DeviceArray exported for capsule_stream, for
 * every container type (pinloader._tree.to_capsules). */
static PyObject *to_capsules(pl_prefetcher_obj *self, PyObject *obj)
{
    PyObject *mod = PyImport_ImportModule("pinloader._tree");
    if (!mod)
        return NULL;
    PyObject *r = PyObject_CallMethod(mod, "to_capsules", "OO", obj, self->capsule_stream);
    Py_DECREF(mod);
    return r;
}

/* ---- lifecycle ---- */

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

/* Free the pipeline's resources (GIL held; the producer has exited or is this thread). */
static void pf_free_resources(pl_prefetcher_obj *self)
{
    if (self->resources_freed)
        return;
    self->resources_freed = 1;
    int forked = pl_forked_child;
    int prev_device = -1;
    if (!forked)
        device_push(self->b, self->device, &prev_device);
    if (self->copy_stream && !forked) {
        pl_stream *stream = self->copy_stream;
        const pl_backend *b = self->b;
        Py_BEGIN_ALLOW_THREADS
        b->stream_synchronize(stream);
        Py_END_ALLOW_THREADS
    }
    if (!forked)
        pthread_mutex_lock(&self->mu);
    batch *bt = self->head;
    self->head = self->tail = NULL;
    self->queued = 0;
    if (!forked)
        pthread_mutex_unlock(&self->mu);
    while (bt) {
        batch *next = bt->next;
        batch_free(bt);
        bt = next;
    }
    if (!forked)
        empty_graves(self, 1);
    Py_CLEAR(self->it);
    pl_stager *stager = self->stager;
    pl_stream *stream = self->copy_stream;
    self->stager = NULL; /* before the GIL is released: other threads may read them */
    self->copy_stream = NULL;
    if (!forked) {
        const pl_backend *b = self->b;
        Py_BEGIN_ALLOW_THREADS
        if (stager)
            pl_stager_destroy(stager);
        if (stream)
            b->stream_destroy(stream);
        Py_END_ALLOW_THREADS
        device_pop(self->b, self->device, prev_device);
    }
    if (self->pool) {
        pl_pool *p = self->pool;
        int own = self->own_pool;
        self->pool = NULL;
        if (!forked) {
            Py_BEGIN_ALLOW_THREADS
            if (own)
                pl_pool_close(p);
            pl_pool_decref(p);
            Py_END_ALLOW_THREADS
        }
    }
}

/* Stop the producer. Returns 1 if it was joined, 0 if it is stuck in the source and was left
 * to clean up after itself (see Note [stuck sources]). */
static int stop_producer(pl_prefetcher_obj *self)
{
    if (pl_forked_child) {
        /* The producer does not exist in this process, and the parent's threads may have held
         * our mutexes at fork time: touch none of them. */
        self->thread_started = 0;
        return 1;
    }
    pthread_mutex_lock(&self->mu);
    self->stop = 1;
    pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
    if (!self->thread_started) {
        self->thread_started = 0;
        return 1;
    }
    /* Note [stuck sources]
     * A source can block in next() for ever (a hung reader, a dead worker). close() gives it
     * a moment, then detaches the producer instead of joining it: the producer sees `stop`
     * whenever next() returns, frees the pipeline and drops its reference. */
    int on_producer = pthread_equal(self->thread, pthread_self());
    for (int i = 0; i < 20 && self->in_source && !on_producer; i++) {
        Py_BEGIN_ALLOW_THREADS
        pl_sleep_ns(10 * 1000 * 1000);
        Py_END_ALLOW_THREADS
    }
    self->thread_started = 0;
    /* Closed (or collected) on the producer thread itself, from code the producer ran (a leaf's
     * __dlpack__, a __del__, the cycle collector): it cannot join itself; it finishes the
     * current item, sees stop and cleans up as a detached producer. */
    if (self->in_source || on_producer) {
        pthread_detach(self->thread);
        self->detached = 1;
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
    if (self->closed)
        return;
    self->closed = 1;
    live_unlink(self);
    if (stop_producer(self))
        pf_free_resources(self);
    else
        Py_INCREF(self); /* the detached producer's reference */
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

static int pf_traverse(PyObject *op, visitproc visit, void *arg)
{
    pl_prefetcher_obj *self = (pl_prefetcher_obj *)op;
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(self->source);
    Py_VISIT(self->pool_obj);
    Py_VISIT(self->it);
    Py_VISIT(self->capsule_stream);
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
    Py_CLEAR(self->capsule_stream);
    if (self->st) {
        if (!self->closed) {
            self->closed = 1;
            live_unlink(self);
            if (!stop_producer(self)) {
                /* The producer is stuck in the source and still uses this object: it frees it
                 * when the source returns (see Note [stuck sources]). */
                self->orphaned = 1;
                return;
            }
            pf_free_resources(self);
        }
        if (!pl_forked_child) {
            /* In a forked child the parent's producer may have been waiting on cv: destroying
             * it would wait for a thread that does not exist here. */
            pthread_mutex_destroy(&self->mu);
            pthread_cond_destroy(&self->cv);
        }
    }
    tp->tp_free(op);
    Py_DECREF(tp);
}

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

static PyObject *pf_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"iterable", "device", "depth", "pool", "max_pinned_bytes",
                             "staging_threads", "copy_stream_priority", "output", "stream", NULL};
    PyObject *iterable, *device = Py_None, *depth_obj = NULL, *pool_obj = Py_None,
             *max_pinned_obj = Py_None, *threads_obj = Py_None, *stream_obj = Py_None;
    const char *priority = "high", *output = "array";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OOOOOssO:AsyncPrefetcher", kwlist, &iterable,
                                     &device, &depth_obj, &pool_obj, &max_pinned_obj, &threads_obj,
                                     &priority, &output, &stream_obj))
        return NULL;
    pl_state *st = pl_state_of_type(type);
    if (!st)
        return NULL;
    if (pl_forked_child) {
        /* The backend state belongs to the parent. */
        PyErr_SetString(PyExc_RuntimeError, "pinloader cannot start a prefetcher in a child process "
                        "forked after pinloader was used; start the child with 'spawn'");
        return NULL;
    }
    long depth = 2, threads = 0;
    if (depth_obj && parse_positive(depth_obj, "depth", 1, 64, &depth) < 0)
        return NULL;
    if (threads_obj != Py_None && parse_positive(threads_obj, "staging_threads", 1, 256, &threads) < 0)
        return NULL;
    int high;
    if (strcmp(priority, "high") == 0)
        high = 1;
    else if (strcmp(priority, "normal") == 0 || strcmp(priority, "low") == 0)
        high = 0;
    else
        return PyErr_Format(PyExc_ValueError, "copy_stream_priority must be 'high' or 'normal', got '%s'", priority);
    int capsule;
    if (strcmp(output, "array") == 0)
        capsule = 0;
    else if (strcmp(output, "capsule") == 0)
        capsule = 1;
    else
        return PyErr_Format(PyExc_ValueError, "output must be 'array' or 'capsule', got '%s'", output);
    size_t max_pinned = 0;
    if (max_pinned_obj != Py_None) {
        long long v = PyLong_AsLongLong(max_pinned_obj);
        if (v == -1 && PyErr_Occurred())
            return NULL;
        if (v <= 0)
            return PyErr_Format(PyExc_ValueError, "max_pinned_bytes must be > 0, got %lld", v);
        max_pinned = (size_t)v;
    }
    pl_pool *shared = NULL;
    if (pool_obj != Py_None) {
        if (!(shared = pl_pinned_pool_get(st, pool_obj)))
            return PyErr_Format(PyExc_TypeError, "pool must be a pinloader.PinnedPool, not %.100s",
                                Py_TYPE(pool_obj)->tp_name);
        if (max_pinned)
            return PyErr_Format(PyExc_ValueError, "give either pool or max_pinned_bytes, not both "
                                "(the pool's own cap applies)");
        if (pl_pool_closed(shared))
            return PyErr_Format(PyExc_ValueError, "pool is closed");
    }
    PyObject *probe = PyObject_GetIter(iterable);
    if (!probe) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "AsyncPrefetcher needs an iterable source, got %.100s",
                         Py_TYPE(iterable)->tp_name);
        }
        return NULL;
    }
    const pl_backend *b;
    int dev;
    if (pl_resolve_device(st, device, &b, &dev) < 0) {
        Py_DECREF(probe);
        return NULL;
    }
    if (shared && pl_pool_backend(shared) != b) {
        Py_DECREF(probe);
        return PyErr_Format(PyExc_ValueError, "pool uses the %s backend but the prefetcher the %s "
                            "backend", pl_pool_backend(shared)->name, b->name);
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
    self->source = Py_NewRef(iterable);
    self->b = b;
    self->device = dev;
    self->depth = (int)depth;
    self->high_priority = high;
    self->capsule_output = capsule;
    self->capsule_stream = Py_NewRef(stream_obj);
    self->max_pinned = max_pinned;
    if (!threads)
        threads = PL_MIN(8, pl_cpu_count()); /* host memcpy bandwidth scales to ~8 threads */

    int rc, prev_device = -1;
    Py_BEGIN_ALLOW_THREADS
    rc = device_push(b, dev, &prev_device);
    if (rc == PL_OK)
        rc = b->stream_create(high, &self->copy_stream);
    device_pop(b, dev, prev_device);
    Py_END_ALLOW_THREADS
    if (rc != PL_OK) {
        Py_DECREF(probe);
        Py_DECREF(self);
        return pl_raise_backend(st, b, rc, "creating the copy stream");
    }
    if (shared) {
        pl_pool_incref(shared);
        self->pool = shared;
        self->pool_obj = Py_NewRef(pool_obj);
    } else {
        /* Own pool: the cap grows to (depth + 2) batches as batches are seen, unless fixed. */
        rc = pl_pool_create(b, dev, max_pinned ? max_pinned : ((size_t)1 << 20), &self->pool);
        self->own_pool = 1;
        if (rc != PL_OK) {
            Py_DECREF(probe);
            Py_DECREF(self);
            return pl_raise_backend(st, b, rc, "creating the pinned pool");
        }
    }
    if ((rc = pl_stager_create((int)threads, &self->stager)) != PL_OK) {
        Py_DECREF(probe);
        Py_DECREF(self);
        return pl_raise_backend(st, b, rc, "starting staging threads");
    }
    /* The first epoch starts now, so the first batch is in flight before the loop begins. */
    self->it = probe;
    self->it_epoch = 1;
    self->consumer_epoch = 1;
    self->requested_epoch = 1;
    if (pthread_create(&self->thread, NULL, producer_main, self) != 0) {
        Py_DECREF(self);
        return PyErr_Format(PyExc_RuntimeError, "could not start the producer thread");
    }
    self->thread_started = 1;
    self->live_next = st->live;
    if (st->live)
        st->live->live_prev = self;
    st->live = self;
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
    if (pl_forked_child)
        return PyErr_Format(PyExc_RuntimeError, "this AsyncPrefetcher was created before fork(): "
                            "its state stays in the parent");
    double samples[WAIT_SAMPLES];
    pthread_mutex_lock(&self->mu);
    size_t ns = (size_t)PL_MIN(self->n_waits, (uint64_t)WAIT_SAMPLES);
    memcpy(samples, self->wait_samples, ns * sizeof(double));
    uint64_t batches = self->n_batches, bytes = self->n_bytes, waits = self->n_waits, stalls = self->stalls;
    int64_t span = self->last_batch_ns - self->first_batch_ns;
    int64_t next_ns = self->next_ns, staging_ns = self->staging_ns, issue_ns = self->copy_issue_ns;
    int64_t wait_total = self->wait_ns_total, stall_ns = self->stall_ns;
    size_t dev_peak = self->device_peak;
    int queued = self->queued;
    pthread_mutex_unlock(&self->mu);
    pl_pool_stats ps;
    memset(&ps, 0, sizeof ps);
    if (self->pool)
        pl_pool_get_stats(self->pool, &ps);
    double p99 = percentile(samples, ns, 0.99);
    double gbps = span > 0 && batches > 1 ? (double)bytes * (double)(batches - 1) / (double)batches / (double)span : 0.0;
    return Py_BuildValue(
        "{s:K,s:K,s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:n,s:n,s:n,s:n,s:n,s:K,s:d,s:i,s:s}",
        "batches", (unsigned long long)batches, "bytes", (unsigned long long)bytes,
        "h2d_gbps", gbps, "wait_s_total", (double)wait_total / 1e9,
        "wait_ms_mean", waits ? (double)wait_total / 1e6 / (double)waits : 0.0, "wait_ms_p99", p99,
        "next_s_total", (double)next_ns / 1e9, "staging_s_total", (double)staging_ns / 1e9,
        "copy_issue_s_total", (double)issue_ns / 1e9,
        "pinned_bytes_in_use", (Py_ssize_t)ps.in_use_bytes, "pinned_bytes_reserved", (Py_ssize_t)ps.reserved_bytes,
        "pinned_bytes_peak", (Py_ssize_t)ps.peak_reserved_bytes, "pinned_cap", (Py_ssize_t)ps.max_bytes,
        "device_bytes_peak", (Py_ssize_t)dev_peak,
        "pinned_stalls", (unsigned long long)stalls, "pinned_stall_s", (double)stall_ns / 1e9,
        "queued", queued, "backend", self->b->name);
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
    if (pl_forked_child)
        return PyUnicode_FromString("<pinloader.AsyncPrefetcher inherited through fork(): unusable>");
    pthread_mutex_lock(&self->mu);
    unsigned long long batches = self->n_batches;
    int queued = self->queued;
    pthread_mutex_unlock(&self->mu);
    if (self->b->kind == PL_BACKEND_CUDA)
        return PyUnicode_FromFormat("<pinloader.AsyncPrefetcher device=cuda:%d depth=%d batches=%llu "
                                    "queued=%d%s>", self->device, self->depth, batches, queued,
                                    self->closed ? " closed" : "");
    return PyUnicode_FromFormat("<pinloader.AsyncPrefetcher device=cpu (host backend) depth=%d "
                                "batches=%llu queued=%d%s>", self->depth, batches, queued,
                                self->closed ? " closed" : "");
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
    return PyBool_FromLong(((pl_prefetcher_obj *)op)->closed);
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
     "stats($self, /)\n--\n\nCounters: batches, bytes, h2d_gbps (delivered), consumer wait (total, mean, p99),\n"
     "time in the source's next(), staging time, pinned and device bytes, stalls on the pinned cap."},
    {"__enter__", pf_enter, METH_NOARGS, NULL},
    {"__exit__", pf_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pf_getset[] = {
    {"device", pf_get_device, NULL, "'cuda:N' or 'cpu'.", NULL},
    {"depth", pf_get_depth, NULL, "Batches in flight or waiting, at most.", NULL},
    {"closed", pf_get_closed, NULL, "Whether close() ran.", NULL},
    {"source", pf_get_source, NULL, "The source iterable.", NULL},
    {"staging_threads", pf_get_staging_threads, NULL, "Threads staging into pinned memory.", NULL},
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
     "waiting. max_pinned_bytes: cap on pinned memory (default (depth + 2) batches). output:\n"
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
