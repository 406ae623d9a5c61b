/* PinnedPool and PinnedBuffer: the Python face of pool.c. */
#include "pinned.h"

#include "dlpack.h"

#include "pool.h"
#include "util.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    pl_pool *pool;
    const pl_backend *b;
    int device;
    int closed;
    int is_default; /* a process-wide default pool: never closed (Note [default pool],
                     * pool_default.c) */
} PinnedPoolObject;

/* PoolClient: a share of a pool bounded by its own cap (Note [pool clients] in pool.h). */
typedef struct {
    PyObject_HEAD
    PyObject *pool_obj; /* the PinnedPool */
    pl_pool_client *client;
} PoolClientObject;

/* Note [pinned buffer lifetime]
 * A region handed out by PinnedPool.alloc is owned by a small refcounted share, held by the
 * PinnedBuffer and by every DLPack capsule exported from it. The region goes back to the pool
 * when the last of them lets go, so a torch tensor made from the buffer outlives the buffer
 * object safely, and capsule deleters (any thread, no GIL, maybe at exit) never touch Python. */
typedef struct {
    atomic_long refs;
    atomic_long dlpack_exports; /* live capsules / tensors made from the buffer */
    pl_pool *pool;              /* a pool reference of its own */
    pl_region *region;
} pinned_share;

typedef struct {
    PyObject_HEAD
    PyObject *pool_obj;   /* the PinnedPool, for the .pool property */
    pinned_share *share;  /* NULL once released */
    pl_region *region;    /* share->region while live, else NULL */
    Py_ssize_t buffer_exports; /* guarded by the GIL */
} PinnedBufferObject;

static void share_decref(pinned_share *sh)
{
    if (atomic_fetch_sub(&sh->refs, 1) != 1)
        return;
    pl_pool_release(sh->pool, sh->region);
    pl_pool_decref(sh->pool);
    free(sh);
}

int pl_parse_nbytes(PyObject *o, const char *name, size_t min, size_t *out)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    size_t v = PyLong_AsSize_t(o);
    if (v == (size_t)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        PyObject *zero = PyLong_FromLong(0);
        int neg = zero ? PyObject_RichCompareBool(o, zero, Py_LT) : -1;
        Py_XDECREF(zero);
        if (neg < 0)
            return -1;
        if (neg)
            PyErr_Format(PyExc_ValueError, "%s must be >= %zu, got %R", name, min, o);
        else
            PyErr_Format(PyExc_OverflowError, "%s is too large: %R does not fit in 64 bits", name, o);
        return -1;
    }
    if (v < min) {
        PyErr_Format(PyExc_ValueError, "%s must be >= %zu, got %zu", name, min, v);
        return -1;
    }
    *out = v;
    return 0;
}

/* A timeout in seconds: None or +inf mean no limit (-1 ns); NaN and negatives are refused;
 * values past the int64 range of nanoseconds saturate to no limit. */
static int parse_timeout(PyObject *o, int64_t *ns)
{
    *ns = -1;
    if (o == Py_None)
        return 0;
    double t = PyFloat_AsDouble(o);
    if (t == -1.0 && PyErr_Occurred())
        return -1;
    if (isnan(t) || t < 0) {
        PyErr_Format(PyExc_ValueError, "timeout must be >= 0 or None, got %R", o);
        return -1;
    }
    if (t * 1e9 < 9.0e18)
        *ns = (int64_t)(t * 1e9);
    return 0;
}

static int forked_error(const char *what)
{
    pl_raise_forked(what);
    return -1;
}

/* ---- PinnedPool ---- */

static PyObject *pool_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"max_bytes", "device", NULL};
    PyObject *max_obj = Py_None, *device = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OO:PinnedPool", kwlist, &max_obj, &device))
        return NULL;
    pl_state *st = pl_state_of_type(type);
    if (!st)
        return NULL;
    size_t max_bytes = 0;
    if (max_obj != Py_None && pl_parse_nbytes(max_obj, "max_bytes", 1, &max_bytes) < 0)
        return NULL;
    const pl_backend *b;
    int dev;
    if (pl_resolve_device(st, device, &b, &dev) < 0)
        return NULL;
    PinnedPoolObject *self = (PinnedPoolObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    int rc = pl_pool_create(b, dev, max_bytes, &self->pool);
    if (rc != PL_OK) {
        Py_DECREF(self);
        return pl_raise_backend(st, b, rc, "PinnedPool");
    }
    self->b = b;
    self->device = dev;
    return (PyObject *)self;
}

static void pool_dealloc(PyObject *op)
{
    PinnedPoolObject *self = (PinnedPoolObject *)op;
    PyTypeObject *tp = Py_TYPE(op);
    if (self->pool) {
        Py_BEGIN_ALLOW_THREADS
        pl_pool_decref(self->pool);
        Py_END_ALLOW_THREADS
    }
    tp->tp_free(op);
    Py_DECREF(tp);
}

static int pool_check_open(PinnedPoolObject *self)
{
    if (pl_pool_inherited(self->pool))
        return forked_error("PinnedPool");
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "PinnedPool is closed");
        return -1;
    }
    return 0;
}

static PyObject *pool_exhausted(pl_state *st, pl_pool *p, size_t n, const char *why)
{
    pl_pool_stats s;
    pl_pool_get_stats(p, &s);
    PyErr_Format(st->PoolExhausted,
                 "pinned request of %zu bytes %s (cap %zu bytes, %zu bytes in use in %zu "
                 "regions, %zu pending)", n, why, s.max_bytes, s.in_use_bytes, s.regions, s.pending);
    return NULL;
}

/* PinnedPool.alloc and PoolClient.alloc (client non-NULL: charged to it). */
static PyObject *alloc_impl(PyObject *op, pl_pool_client *client, PyObject *args, PyObject *kwds)
{
    PinnedPoolObject *self = (PinnedPoolObject *)op;
    static char *kwlist[] = {"nbytes", "timeout", NULL};
    PyObject *n_obj, *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:alloc", kwlist, &n_obj, &timeout_obj))
        return NULL;
    pl_state *st = pl_state_of_type(Py_TYPE(op));
    if (!st || pool_check_open(self) < 0)
        return NULL;
    size_t n;
    int64_t timeout_ns;
    if (pl_parse_nbytes(n_obj, "nbytes", 0, &n) < 0 || parse_timeout(timeout_obj, &timeout_ns) < 0)
        return NULL;
    if (n > (size_t)PY_SSIZE_T_MAX) /* the buffer protocol's limit */
        return pool_exhausted(st, self->pool, n, "is larger than any buffer can be");
    int64_t start = pl_now_ns();
    pl_region *r = NULL;
    for (;;) {
        int64_t slice = PL_SIGNAL_SLICE_NS;
        if (timeout_ns >= 0)
            slice = PL_MAX((int64_t)0, PL_MIN(slice, timeout_ns - (pl_now_ns() - start)));
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = pl_pool_reserve_for(self->pool, client, n, slice, NULL, &r);
        Py_END_ALLOW_THREADS
        if (rc == PL_OK)
            break;
        if (rc == PL_ERR_TIMEOUT) {
            if (PyErr_CheckSignals() < 0)
                return NULL;
            if (timeout_ns >= 0 && pl_now_ns() - start >= timeout_ns)
                return pool_exhausted(st, self->pool, n, "timed out waiting for regions to come back");
            continue;
        }
        if (rc == PL_ERR_OVER_CAP)
            return pool_exhausted(st, self->pool, n, client ? "can never fit under the client's "
                                  "or the pool's cap" : "can never fit under the cap");
        if (rc == PL_ERR_INVALID_VALUE)
            return PyErr_Format(PyExc_ValueError, "PinnedPool is closed");
        if (rc == PL_ERR_FORKED)
            return forked_error("PinnedPool"), NULL;
        return pl_raise_backend(st, self->b, rc, "PinnedPool.alloc: making a pinned slab");
    }
    pinned_share *sh = malloc(sizeof(*sh));
    PinnedBufferObject *buf = sh ? PyObject_New(PinnedBufferObject, st->PinnedBuffer_Type) : NULL;
    if (!buf) {
        free(sh);
        pl_pool_release(self->pool, r);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    atomic_init(&sh->refs, 1);
    atomic_init(&sh->dlpack_exports, 0);
    pl_pool_incref(self->pool);
    sh->pool = self->pool;
    sh->region = r;
    buf->pool_obj = Py_NewRef(op);
    buf->share = sh;
    buf->region = r;
    buf->buffer_exports = 0;
    return (PyObject *)buf;
}

static PyObject *pool_alloc(PyObject *op, PyObject *args, PyObject *kwds)
{
    return alloc_impl(op, NULL, args, kwds);
}

static PyObject *pool_stats(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    PinnedPoolObject *self = (PinnedPoolObject *)op;
    if (pl_pool_inherited(self->pool))
        return forked_error("PinnedPool"), NULL;
    pl_pool_stats s;
    pl_pool_get_stats(self->pool, &s);
    return Py_BuildValue(
        "{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:K,s:K,s:K,s:K,s:K,s:d,s:n,s:i}",
        "reserved_bytes", (Py_ssize_t)s.reserved_bytes, "in_use_bytes", (Py_ssize_t)s.in_use_bytes,
        "peak_in_use_bytes", (Py_ssize_t)s.peak_in_use_bytes,
        "peak_reserved_bytes", (Py_ssize_t)s.peak_reserved_bytes, "max_bytes", (Py_ssize_t)s.max_bytes,
        "slabs", (Py_ssize_t)s.slabs, "regions", (Py_ssize_t)s.regions, "pending", (Py_ssize_t)s.pending,
        "allocs_cached", (unsigned long long)s.allocs_cached,
        "allocs_new", (unsigned long long)s.allocs_new,
        "slabs_created", (unsigned long long)s.slabs_created,
        "slabs_freed", (unsigned long long)s.slabs_freed, "waits", (unsigned long long)s.waits,
        "wait_s", (double)s.wait_ns / 1e9, "waiting", (Py_ssize_t)s.waiting, "numa_node", s.numa_node);
}

static PyObject *pool_trim(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    PinnedPoolObject *self = (PinnedPoolObject *)op;
    if (pl_pool_inherited(self->pool))
        return forked_error("PinnedPool"), NULL;
    size_t freed;
    Py_BEGIN_ALLOW_THREADS
    freed = pl_pool_trim(self->pool);
    Py_END_ALLOW_THREADS
    return PyLong_FromSize_t(freed);
}

static PyObject *pool_close(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    PinnedPoolObject *self = (PinnedPoolObject *)op;
    if (self->is_default) {
        PyErr_SetString(PyExc_ValueError, "the default pool is shared by every prefetcher made "
                        "without pool= and cannot be closed; trim() gives its idle slabs back");
        return NULL;
    }
    if (!self->closed) {
        self->closed = 1;
        Py_BEGIN_ALLOW_THREADS
        pl_pool_close(self->pool);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *pool_client(PyObject *op, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"max_bytes", NULL};
    PyObject *max_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:client", kwlist, &max_obj))
        return NULL;
    PinnedPoolObject *self = (PinnedPoolObject *)op;
    pl_state *st = pl_state_of_type(Py_TYPE(op));
    if (!st || pool_check_open(self) < 0)
        return NULL;
    size_t cap = 0;
    if (max_obj != Py_None && pl_parse_nbytes(max_obj, "max_bytes", 1, &cap) < 0)
        return NULL;
    PoolClientObject *c = PyObject_New(PoolClientObject, st->PoolClient_Type);
    if (!c)
        return NULL;
    c->pool_obj = Py_NewRef(op);
    int rc = pl_pool_client_open(self->pool, cap, &c->client);
    if (rc != PL_OK) {
        c->client = NULL;
        Py_DECREF(c);
        return pl_raise_backend(st, self->b, rc, "PinnedPool.client");
    }
    return (PyObject *)c;
}

static PyObject *pool_enter(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    return Py_NewRef(op);
}

static PyObject *pool_exit(PyObject *op, PyObject *args)
{
    (void)args;
    return pool_close(op, NULL);
}

static PyObject *pool_repr(PyObject *op)
{
    PinnedPoolObject *self = (PinnedPoolObject *)op;
    if (pl_pool_inherited(self->pool))
        return PyUnicode_FromString("<pinloader.PinnedPool inherited through fork(): unusable>");
    pl_pool_stats s;
    pl_pool_get_stats(self->pool, &s);
    return PyUnicode_FromFormat("<pinloader.PinnedPool backend=%s max_bytes=%zu reserved=%zu "
                                "in_use=%zu slabs=%zu%s>", self->b->name, s.max_bytes,
                                s.reserved_bytes, s.in_use_bytes, s.slabs,
                                self->closed ? " closed" : "");
}

static PyObject *pool_get_max_bytes(PyObject *op, void *c)
{
    (void)c;
    return PyLong_FromSize_t(pl_pool_cap(((PinnedPoolObject *)op)->pool));
}

static PyObject *pool_get_backend(PyObject *op, void *c)
{
    (void)c;
    return PyUnicode_FromString(((PinnedPoolObject *)op)->b->name);
}

struct pl_pool *pl_pinned_pool_get(pl_state *st, PyObject *o)
{
    if (!PyObject_TypeCheck(o, st->PinnedPool_Type))
        return NULL;
    return ((PinnedPoolObject *)o)->pool;
}

static PyMethodDef pool_methods[] = {
    {"alloc", (PyCFunction)(void (*)(void))pool_alloc, METH_VARARGS | METH_KEYWORDS,
     "alloc($self, /, nbytes, timeout=None)\n--\n\n"
     "Reserve a pinned region of nbytes and return it as a PinnedBuffer.\n\n"
     "When the pool is at its cap, waits (GIL released, Ctrl-C works) for regions to come\n"
     "back.\n\n"
     "Parameters\n----------\n"
     "nbytes\n    The region's size in bytes (it starts on a 256-byte boundary).\n"
     "timeout\n    Seconds to wait for room under the cap (None: as long as it takes).\n\n"
     "Raises\n------\n"
     "PoolExhausted\n    If nbytes can never fit under the cap, or timeout seconds pass."},
    {"stats", pool_stats, METH_NOARGS,
     "stats($self, /)\n--\n\nBytes reserved in slabs, in use, peak, the cap, slab and region counts, "
     "allocations served from existing slabs vs new ones, waits and wait time."},
    {"client", (PyCFunction)(void (*)(void))pool_client, METH_VARARGS | METH_KEYWORDS,
     "client($self, /, max_bytes=None)\n--\n\nA PoolClient: allocations through it are bounded by its own "
     "max_bytes within the pool's cap, and its stats count only its own waits.\n\n"
     "Parameters\n----------\n"
     "max_bytes\n    The client's own bound (None: the pool's cap)."},
    {"trim", pool_trim, METH_NOARGS, "trim($self, /)\n--\n\nGive slabs with no live region back to the OS; returns bytes freed."},
    {"close", pool_close, METH_NOARGS, "close($self, /)\n--\n\nWait for pending releases, free idle slabs, refuse new allocations. Idempotent."},
    {"__enter__", pool_enter, METH_NOARGS, NULL},
    {"__exit__", pool_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"max_bytes", pool_get_max_bytes, NULL, "The cap on pinned bytes held.", NULL},
    {"backend", pool_get_backend, NULL, "\"cuda\" or \"host\".", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot pool_slots[] = {
    {Py_tp_new, pool_new},
    {Py_tp_dealloc, pool_dealloc},
    {Py_tp_methods, pool_methods},
    {Py_tp_getset, pool_getset},
    {Py_tp_repr, pool_repr},
    {Py_tp_doc, "PinnedPool(max_bytes=None, device=None)\n--\n\n"
                "Reused page-locked host slabs carved into 256-byte aligned regions.\n\n"
                "Parameters\n----------\n"
                "max_bytes\n    The cap on pinned bytes held (default: a quarter of physical memory,\n"
                "    and at most half of RLIMIT_MEMLOCK where that binds).\n"
                "device\n    Selects the backend as for AsyncPrefetcher (None: CUDA when usable;\n"
                "    'cpu' for plain page-aligned host memory)."},
    {0, NULL},
};

static PyType_Spec pool_spec = {
    .name = "pinloader.PinnedPool",
    .basicsize = sizeof(PinnedPoolObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = pool_slots,
};

/* ---- PoolClient ---- */

static void client_dealloc(PyObject *op)
{
    PoolClientObject *self = (PoolClientObject *)op;
    PyTypeObject *tp = Py_TYPE(op);
    if (self->client)
        pl_pool_client_close(((PinnedPoolObject *)self->pool_obj)->pool, self->client);
    Py_XDECREF(self->pool_obj);
    PyObject_Free(op);
    Py_DECREF(tp);
}

static PyObject *client_alloc(PyObject *op, PyObject *args, PyObject *kwds)
{
    PoolClientObject *self = (PoolClientObject *)op;
    return alloc_impl(self->pool_obj, self->client, args, kwds);
}

static PyObject *client_stats(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    PoolClientObject *self = (PoolClientObject *)op;
    PinnedPoolObject *pool = (PinnedPoolObject *)self->pool_obj;
    if (pl_pool_inherited(pool->pool))
        return forked_error("PoolClient"), NULL;
    pl_pool_client_stats s;
    pl_pool_client_get_stats(pool->pool, self->client, &s);
    return Py_BuildValue("{s:K,s:n,s:n,s:K,s:d}", "max_bytes", (unsigned long long)s.cap,
                         "in_use_bytes", (Py_ssize_t)s.in_use, "peak_in_use_bytes",
                         (Py_ssize_t)s.peak_in_use, "waits", (unsigned long long)s.waits,
                         "wait_s", (double)s.wait_ns / 1e9);
}

static PyObject *client_get_pool(PyObject *op, void *c)
{
    (void)c;
    return Py_NewRef(((PoolClientObject *)op)->pool_obj);
}

static PyMethodDef client_methods[] = {
    {"alloc", (PyCFunction)(void (*)(void))client_alloc, METH_VARARGS | METH_KEYWORDS,
     "alloc($self, /, nbytes, timeout=None)\n--\n\nAs PinnedPool.alloc, charged to this client: waits while "
     "the client's own regions would pass its max_bytes."},
    {"stats", client_stats, METH_NOARGS,
     "stats($self, /)\n--\n\nThe client's cap, bytes in use (regions handed out or pending release), "
     "peak, and its own waits."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef client_getset[] = {
    {"pool", client_get_pool, NULL, "The PinnedPool the client draws from.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot client_slots[] = {
    {Py_tp_dealloc, client_dealloc},
    {Py_tp_methods, client_methods},
    {Py_tp_getset, client_getset},
    {Py_tp_doc, "A bounded share of a PinnedPool (made by PinnedPool.client)."},
    {0, NULL},
};

static PyType_Spec client_spec = {
    .name = "pinloader.PoolClient",
    .basicsize = sizeof(PoolClientObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = client_slots,
};

/* ---- default pools (Note [default pool] in pool_default.c) ---- */

PyObject *pl_default_pool(pl_state *st, PyObject *device)
{
    const pl_backend *b;
    int dev;
    if (pl_resolve_device(st, device, &b, &dev) < 0)
        return NULL;
    pl_pool *pool = NULL;
    int rc = pl_pool_default(b, dev, &pool);
    if (rc != PL_OK)
        return pl_raise_backend(st, b, rc, "default_pool");
    if (!st->default_pools && !(st->default_pools = PyDict_New())) {
        pl_pool_decref(pool);
        return NULL;
    }
    PyObject *key = Py_BuildValue("(si)", b->name, dev);
    PyObject *cached = key ? PyDict_GetItemWithError(st->default_pools, key) : NULL;
    if (cached && ((PinnedPoolObject *)cached)->pool == pool) {
        Py_DECREF(key);
        pl_pool_decref(pool);
        return Py_NewRef(cached);
    }
    /* First use, or the cached object wraps the parent's pool in a fork() child. */
    PinnedPoolObject *self = NULL;
    if (!PyErr_Occurred() && key)
        self = (PinnedPoolObject *)st->PinnedPool_Type->tp_alloc(st->PinnedPool_Type, 0);
    if (!self) {
        Py_XDECREF(key);
        pl_pool_decref(pool);
        return NULL;
    }
    self->pool = pool;
    self->b = b;
    self->device = dev;
    self->is_default = 1;
    int err = PyDict_SetItem(st->default_pools, key, (PyObject *)self);
    Py_DECREF(key);
    if (err < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* ---- PinnedBuffer ---- */

static int buffer_check_live(PinnedBufferObject *self)
{
    if (self->share && pl_pool_inherited(self->share->pool))
        return forked_error("PinnedBuffer");
    if (!self->region) {
        PyErr_SetString(PyExc_ValueError, "PinnedBuffer has been released");
        return -1;
    }
    return 0;
}

static void buffer_dealloc(PyObject *op)
{
    PinnedBufferObject *self = (PinnedBufferObject *)op;
    PyTypeObject *tp = Py_TYPE(op);
    if (self->share)
        share_decref(self->share);
    Py_XDECREF(self->pool_obj);
    PyObject_Free(op);
    Py_DECREF(tp);
}

static int buffer_getbuffer(PyObject *op, Py_buffer *view, int flags)
{
    PinnedBufferObject *self = (PinnedBufferObject *)op;
    if (buffer_check_live(self) < 0) {
        /* The buffer protocol's own exception, with the same message. */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_SetObject(PyExc_BufferError, value);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        view->obj = NULL;
        return -1;
    }
    if (PyBuffer_FillInfo(view, op, self->region->ptr, (Py_ssize_t)self->region->requested, 0, flags) < 0)
        return -1;
    self->buffer_exports++;
    return 0;
}

static void buffer_releasebuffer(PyObject *op, Py_buffer *view)
{
    (void)view;
    ((PinnedBufferObject *)op)->buffer_exports--;
}

static PyObject *buffer_release(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    PinnedBufferObject *self = (PinnedBufferObject *)op;
    if (!self->region)
        Py_RETURN_NONE; /* idempotent */
    long dl = atomic_load(&self->share->dlpack_exports);
    if (self->buffer_exports || dl) {
        PyErr_Format(PyExc_BufferError, "cannot release a PinnedBuffer that is still exported "
                     "(%zd buffer views, %ld DLPack tensors alive)", self->buffer_exports, dl);
        return NULL;
    }
    share_decref(self->share);
    self->share = NULL;
    self->region = NULL;
    Py_RETURN_NONE;
}

static PyObject *buffer_enter(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    if (buffer_check_live((PinnedBufferObject *)op) < 0)
        return NULL;
    return Py_NewRef(op);
}

static PyObject *buffer_exit(PyObject *op, PyObject *args)
{
    (void)args;
    return buffer_release(op, NULL);
}

/* ---- DLPack export of the raw bytes: a 1-D uint8 tensor (see dlpack.c) ---- */

/* The references an export holds: one share reference, counted in dlpack_exports too. */
typedef struct {
    pinned_share *share;
} buffer_export;

/* Any thread, no GIL needed: see Note [pinned buffer lifetime]. */
static void buffer_export_release(void *owner)
{
    pinned_share *sh = ((buffer_export *)owner)->share;
    atomic_fetch_sub(&sh->dlpack_exports, 1);
    share_decref(sh);
}

static PyObject *buffer_dlpack(PyObject *op, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OOOO:__dlpack__", kwlist, &stream,
                                     &max_version, &dl_device, &copy))
        return NULL;
    PinnedBufferObject *self = (PinnedBufferObject *)op;
    pl_dlpack_stream s;
    pl_dlpack_request req;
    if (buffer_check_live(self) < 0 || pl_dlpack_parse_stream(stream, 0, "PinnedBuffer", &s) < 0 ||
        pl_dlpack_parse_request(max_version, dl_device, copy, &req) < 0)
        return NULL;
    /* (kDLCUDAHost, 0) from __dlpack_device__ but kDLCPU in the capsule, as torch does for
     * pinned tensors (torch rejects kDLCUDAHost capsules); dl_device may name either. */
    if (pl_dlpack_check_request(&req, (DLDevice){kDLCUDAHost, 0}, (DLDevice){kDLCPU, 0},
                                "PinnedBuffer") < 0)
        return NULL;
    atomic_fetch_add(&self->share->refs, 1);
    atomic_fetch_add(&self->share->dlpack_exports, 1);
    buffer_export owner = {self->share};
    int64_t shape[1] = {(int64_t)self->region->requested};
    pl_dlpack_view v = {
        .data = self->region->ptr,
        .device = {kDLCPU, 0},
        .dtype = {kDLUInt, 8, 1},
        .ndim = 1,
        .shape = shape,
    };
    return pl_dlpack_export(&v, req.versioned, &owner, sizeof owner, buffer_export_release);
}

static PyObject *buffer_dlpack_device(PyObject *op, PyObject *noargs)
{
    (void)op;
    (void)noargs;
    return Py_BuildValue("(ii)", kDLCUDAHost, 0);
}

static PyObject *buffer_get_nbytes(PyObject *op, void *c)
{
    (void)c;
    PinnedBufferObject *self = (PinnedBufferObject *)op;
    return PyLong_FromSize_t(self->region ? self->region->requested : 0);
}

static PyObject *buffer_get_ptr(PyObject *op, void *c)
{
    (void)c;
    PinnedBufferObject *self = (PinnedBufferObject *)op;
    if (buffer_check_live(self) < 0)
        return NULL;
    return PyLong_FromVoidPtr(self->region->ptr);
}

static PyObject *buffer_get_released(PyObject *op, void *c)
{
    (void)c;
    return PyBool_FromLong(((PinnedBufferObject *)op)->region == NULL);
}

static PyObject *buffer_get_pool(PyObject *op, void *c)
{
    (void)c;
    return Py_NewRef(((PinnedBufferObject *)op)->pool_obj);
}

static Py_ssize_t buffer_len(PyObject *op)
{
    PinnedBufferObject *self = (PinnedBufferObject *)op;
    return self->region ? (Py_ssize_t)self->region->requested : 0;
}

static PyObject *buffer_repr(PyObject *op)
{
    PinnedBufferObject *self = (PinnedBufferObject *)op;
    if (!self->region)
        return PyUnicode_FromString("<pinloader.PinnedBuffer released>");
    return PyUnicode_FromFormat("<pinloader.PinnedBuffer nbytes=%zu ptr=%p>", self->region->requested,
                                self->region->ptr);
}

int pl_pinned_buffer_check(pl_state *st, PyObject *o)
{
    return PyObject_TypeCheck(o, st->PinnedBuffer_Type);
}

static PyMethodDef buffer_methods[] = {
    {"release", buffer_release, METH_NOARGS,
     "release($self, /)\n--\n\nReturn the region to its pool now. Refused while buffer views or DLPack tensors of it are alive. Idempotent."},
    {"__dlpack__", (PyCFunction)(void (*)(void))buffer_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__($self, /, *, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n"
     "Export the bytes as a 1-D uint8 DLPack tensor (kDLCPU in the capsule)."},
    {"__dlpack_device__", buffer_dlpack_device, METH_NOARGS, "__dlpack_device__($self, /)\n--\n\n(kDLCUDAHost, 0): page-locked host memory."},
    {"__enter__", buffer_enter, METH_NOARGS, NULL},
    {"__exit__", buffer_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef buffer_getset[] = {
    {"nbytes", buffer_get_nbytes, NULL, "Bytes requested (0 once released).", NULL},
    {"ptr", buffer_get_ptr, NULL, "Address of the first byte.", NULL},
    {"released", buffer_get_released, NULL, "Whether release() ran.", NULL},
    {"pool", buffer_get_pool, NULL, "The PinnedPool the region came from.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot buffer_slots[] = {
    {Py_tp_dealloc, buffer_dealloc},
    {Py_tp_methods, buffer_methods},
    {Py_tp_getset, buffer_getset},
    {Py_tp_repr, buffer_repr},
    {Py_bf_getbuffer, buffer_getbuffer},
    {Py_bf_releasebuffer, buffer_releasebuffer},
    {Py_sq_length, buffer_len},
    {Py_tp_doc, "A region of page-locked memory from a PinnedPool (made by PinnedPool.alloc).\n\n"
                "Writable through the buffer protocol (numpy.frombuffer, memoryview) and\n"
                "DLPack (torch.from_dlpack gives a CPU tensor over the pinned bytes)."},
    {0, NULL},
};

static PyType_Spec buffer_spec = {
    .name = "pinloader.PinnedBuffer",
    .basicsize = sizeof(PinnedBufferObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = buffer_slots,
};

int pl_pinned_init(PyObject *m, pl_state *st)
{
    st->PinnedPool_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &pool_spec, NULL);
    if (!st->PinnedPool_Type || PyModule_AddType(m, st->PinnedPool_Type) < 0)
        return -1;
    st->PinnedBuffer_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &buffer_spec, NULL);
    if (!st->PinnedBuffer_Type || PyModule_AddType(m, st->PinnedBuffer_Type) < 0)
        return -1;
    st->PoolClient_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &client_spec, NULL);
    if (!st->PoolClient_Type || PyModule_AddType(m, st->PoolClient_Type) < 0)
        return -1;
    return 0;
}
