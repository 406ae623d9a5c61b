/* _C._testing.Prim: the backend primitives, one method each, for the test suite.
 *
 * Handles are raw addresses as ints: this is a private testing facility for exercising
 * backend_host.c and backend_cuda.c directly (ordering, events, cross-stream waits, memory
 * round trips), not an API. Blocking calls release the GIL. */
#include "prim.h"

#include <stdlib.h>

typedef struct {
    PyObject_HEAD
    const pl_backend *b;
    int device;
} PrimObject;

static PyObject *prim_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"device", NULL};
    PyObject *device = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:Prim", kwlist, &device))
        return NULL;
    pl_state *st = pl_state_of_type(type);
    if (!st)
        return NULL;
    PrimObject *self = (PrimObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    if (pl_resolve_device(st, device, &self->b, &self->device) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->b->set_device(self->device);
    return (PyObject *)self;
}

static void prim_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyObject *check(PyObject *op, int rc, const char *what)
{
    if (rc == PL_OK)
        Py_RETURN_NONE;
    pl_state *st = pl_state_of_type(Py_TYPE(op));
    return st ? pl_raise_backend(st, ((PrimObject *)op)->b, rc, what) : NULL;
}

static void *ptr_arg(PyObject *o)
{
    return PyLong_AsVoidPtr(o);
}

#define SELF PrimObject *self = (PrimObject *)op; (void)self
#define PARSE(fmt, ...) if (!PyArg_ParseTuple(args, fmt, __VA_ARGS__)) return NULL

static PyObject *p_stream(PyObject *op, PyObject *args)
{
    SELF;
    int high = 0;
    PARSE("|p", &high);
    pl_stream *s = NULL;
    self->b->set_device(self->device);
    int rc = self->b->stream_create(high, &s);
    if (rc != PL_OK)
        return check(op, rc, "stream_create");
    return PyLong_FromVoidPtr(s);
}

static PyObject *p_stream_destroy(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *s;
    PARSE("O", &s);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = self->b->stream_destroy(ptr_arg(s));
    Py_END_ALLOW_THREADS
    return check(op, rc, "stream_destroy");
}

static PyObject *p_stream_sync(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *s;
    PARSE("O", &s);
    void *sp = ptr_arg(s);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = self->b->stream_synchronize(sp);
    Py_END_ALLOW_THREADS
    return check(op, rc, "stream_synchronize");
}

static PyObject *p_event(PyObject *op, PyObject *noargs)
{
    SELF;
    (void)noargs;
    pl_event *e = NULL;
    int rc = self->b->event_create(&e);
    if (rc != PL_OK)
        return check(op, rc, "event_create");
    return PyLong_FromVoidPtr(e);
}

static PyObject *p_event_destroy(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *e;
    PARSE("O", &e);
    return check(op, self->b->event_destroy(ptr_arg(e)), "event_destroy");
}

static PyObject *p_record(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *e, *s;
    PARSE("OO", &e, &s);
    return check(op, self->b->event_record(ptr_arg(e), ptr_arg(s)), "event_record");
}

static PyObject *p_query(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *e;
    PARSE("O", &e);
    int rc = self->b->event_query(ptr_arg(e));
    if (rc == PL_ERR_NOT_READY)
        Py_RETURN_FALSE;
    if (rc != PL_OK)
        return check(op, rc, "event_query");
    Py_RETURN_TRUE;
}

static PyObject *p_event_sync(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *e;
    PARSE("O", &e);
    void *ep = ptr_arg(e);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = self->b->event_synchronize(ep);
    Py_END_ALLOW_THREADS
    return check(op, rc, "event_synchronize");
}

static PyObject *p_event_wait(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *e;
    double timeout;
    PARSE("Od", &e, &timeout);
    void *ep = ptr_arg(e);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = self->b->event_wait(ep, timeout < 0 ? -1 : (int64_t)(timeout * 1e9), 0);
    Py_END_ALLOW_THREADS
    if (rc == PL_ERR_TIMEOUT)
        Py_RETURN_FALSE;
    if (rc != PL_OK)
        return check(op, rc, "event_wait");
    Py_RETURN_TRUE;
}

static PyObject *p_wait(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *s, *e;
    PARSE("OO", &s, &e);
    return check(op, self->b->stream_wait_event(ptr_arg(s), ptr_arg(e)), "stream_wait_event");
}

/* A gate is a heap int: hold(stream) returns it, open_gate(gate) releases the stream. */
static PyObject *p_hold(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *s;
    PARSE("O", &s);
    volatile int *gate = PyMem_RawCalloc(1, sizeof(int));
    if (!gate)
        return PyErr_NoMemory();
    int rc = self->b->stream_hold(ptr_arg(s), gate);
    if (rc != PL_OK) {
        PyMem_RawFree((void *)gate);
        return check(op, rc, "stream_hold");
    }
    return PyLong_FromVoidPtr((void *)gate);
}

static PyObject *p_open_gate(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *g;
    PARSE("O", &g);
    volatile int *gate = ptr_arg(g);
    __atomic_store_n(gate, 1, __ATOMIC_RELEASE);
    Py_RETURN_NONE; /* the gate is leaked on purpose: the stream may still read it */
}

static PyObject *p_host_alloc(PyObject *op, PyObject *args)
{
    SELF;
    Py_ssize_t n;
    int node = -1;
    PARSE("n|i", &n, &node);
    void *p = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = self->b->host_alloc((size_t)n, node, &p);
    Py_END_ALLOW_THREADS
    if (rc != PL_OK)
        return check(op, rc, "host_alloc");
    return PyLong_FromVoidPtr(p);
}

static PyObject *p_host_free(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *p;
    Py_ssize_t n;
    PARSE("On", &p, &n);
    return check(op, self->b->host_free(ptr_arg(p), (size_t)n), "host_free");
}

static PyObject *p_is_pinned(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *p;
    PARSE("O", &p);
    int pinned = 0;
    int rc = self->b->host_is_pinned(ptr_arg(p), &pinned);
    if (rc != PL_OK)
        return check(op, rc, "host_is_pinned");
    return PyBool_FromLong(pinned);
}

static PyObject *p_device_alloc(PyObject *op, PyObject *args)
{
    SELF;
    Py_ssize_t n;
    PyObject *s;
    PARSE("nO", &n, &s);
    void *p = NULL;
    int rc = self->b->device_alloc(self->device, (size_t)n, ptr_arg(s), &p);
    if (rc != PL_OK)
        return check(op, rc, "device_alloc");
    return PyLong_FromVoidPtr(p);
}

static PyObject *p_device_free(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *p, *s;
    PARSE("OO", &p, &s);
    return check(op, self->b->device_free(self->device, ptr_arg(p), ptr_arg(s)), "device_free");
}

static PyObject *p_copy_h2d(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *dst, *src, *s;
    Py_ssize_t n;
    PARSE("OOnO", &dst, &src, &n, &s);
    return check(op, self->b->memcpy_h2d_async(ptr_arg(dst), ptr_arg(src), (size_t)n, ptr_arg(s)),
                 "memcpy_h2d_async");
}

static PyObject *p_copy_d2h(PyObject *op, PyObject *args)
{
    SELF;
    PyObject *dst, *src;
    Py_ssize_t n;
    PARSE("OOn", &dst, &src, &n);
    void *d = ptr_arg(dst), *sp = ptr_arg(src);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = self->b->memcpy_d2h(d, sp, (size_t)n);
    Py_END_ALLOW_THREADS
    return check(op, rc, "memcpy_d2h");
}

static PyObject *p_backend(PyObject *op, void *c)
{
    (void)c;
    return PyUnicode_FromString(((PrimObject *)op)->b->name);
}

static PyMethodDef prim_methods[] = {
    {"stream", p_stream, METH_VARARGS, NULL},
    {"stream_destroy", p_stream_destroy, METH_VARARGS, NULL},
    {"stream_synchronize", p_stream_sync, METH_VARARGS, NULL},
    {"event", p_event, METH_NOARGS, NULL},
    {"event_destroy", p_event_destroy, METH_VARARGS, NULL},
    {"record", p_record, METH_VARARGS, NULL},
    {"query", p_query, METH_VARARGS, NULL},
    {"event_synchronize", p_event_sync, METH_VARARGS, NULL},
    {"event_wait", p_event_wait, METH_VARARGS, NULL},
    {"wait", p_wait, METH_VARARGS, NULL},
    {"hold", p_hold, METH_VARARGS, NULL},
    {"open_gate", p_open_gate, METH_VARARGS, NULL},
    {"host_alloc", p_host_alloc, METH_VARARGS, NULL},
    {"host_free", p_host_free, METH_VARARGS, NULL},
    {"is_pinned", p_is_pinned, METH_VARARGS, NULL},
    {"device_alloc", p_device_alloc, METH_VARARGS, NULL},
    {"device_free", p_device_free, METH_VARARGS, NULL},
    {"copy_h2d", p_copy_h2d, METH_VARARGS, NULL},
    {"copy_d2h", p_copy_d2h, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef prim_getset[] = {
    {"backend", p_backend, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot prim_slots[] = {
    {Py_tp_new, prim_new},
    {Py_tp_dealloc, prim_dealloc},
    {Py_tp_methods, prim_methods},
    {Py_tp_getset, prim_getset},
    {0, NULL},
};

static PyType_Spec prim_spec = {
    .name = "pinloader._C._testing.Prim",
    .basicsize = sizeof(PrimObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = prim_slots,
};

int pl_prim_init(PyObject *m, pl_state *st)
{
    st->Prim_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &prim_spec, NULL);
    /* Made with m, pinloader._C, as its module (its methods find the module state through it);
     * listed in _testing only (Note [the testing submodule] in testing.c). */
    return st->Prim_Type ? 0 : -1;
}
