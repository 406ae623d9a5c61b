/* PinnedPool: the Python face of pool.c, and PinnedPool.alloc, which makes PinnedBuffers
 * (pinned_impl.h). */
#include "pinned_impl.h"

#include "util.h"

#include <math.h>
#include <stdlib.h>

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

int pl_pinned_forked_error(const char *what)
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
        return pl_pinned_forked_error("PinnedPool");
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
PyObject *pl_pinned_alloc_impl(PyObject *op, pl_pool_client *client, PyObject *args, PyObject *kwds)
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
            return pl_pinned_forked_error("PinnedPool"), NULL;
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
    return pl_pinned_alloc_impl(op, NULL, args, kwds);
}

static PyObject *pool_stats(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    PinnedPoolObject *self = (PinnedPoolObject *)op;
    if (pl_pool_inherited(self->pool))
        return pl_pinned_forked_error("PinnedPool"), NULL;
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
        return pl_pinned_forked_error("PinnedPool"), NULL;
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

int pl_pinned_pool_init(PyObject *m, pl_state *st)
{
    st->PinnedPool_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &pool_spec, NULL);
    if (!st->PinnedPool_Type || PyModule_AddType(m, st->PinnedPool_Type) < 0)
        return -1;
    return 0;
}
