/* PoolClient: a bounded share of a PinnedPool (Note [pool clients] in pool.h), and
 * pl_pinned_init, which adds the three pinned types to the module (pinned_impl.h). */
#include "pinned_impl.h"

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
    return pl_pinned_alloc_impl(self->pool_obj, self->client, args, kwds);
}

static PyObject *client_stats(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    PoolClientObject *self = (PoolClientObject *)op;
    PinnedPoolObject *pool = (PinnedPoolObject *)self->pool_obj;
    if (pl_pool_inherited(pool->pool))
        return pl_pinned_forked_error("PoolClient"), NULL;
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
int pl_pinned_init(PyObject *m, pl_state *st)
{
    if (pl_pinned_pool_init(m, st) < 0 || pl_pinned_buffer_init(m, st) < 0)
        return -1;
    st->PoolClient_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &client_spec, NULL);
    if (!st->PoolClient_Type || PyModule_AddType(m, st->PoolClient_Type) < 0)
        return -1;
    return 0;
}
