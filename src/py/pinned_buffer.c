/* PinnedBuffer: a region of a PinnedPool, read through the buffer protocol and exported with
 * DLPack (pinned_impl.h).
 *
 * Note [pinned buffer lifetime]
 * A region handed out by PinnedPool.alloc is owned by a small refcounted share, held by the
 * PinnedBuffer and by every DLPack capsule exported from it. The region goes back to the pool
 * when the last of them lets go, so a torch tensor made from the buffer outlives the buffer
 * object safely, and capsule deleters (any thread, no GIL, maybe at exit) never touch Python. */
#include "pinned_impl.h"

#include "dlpack.h"

#include "util.h"

#include <stdlib.h>

static void share_decref(pinned_share *sh)
{
    if (atomic_fetch_sub(&sh->refs, 1) != 1)
        return;
    pl_pool_release(sh->pool, sh->region);
    pl_pool_decref(sh->pool);
    free(sh);
}
/* ---- PinnedBuffer ---- */

static int buffer_check_live(PinnedBufferObject *self)
{
    if (self->share && pl_pool_inherited(self->share->pool))
        return pl_pinned_forked_error("PinnedBuffer");
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
int pl_pinned_buffer_init(PyObject *m, pl_state *st)
{
    st->PinnedBuffer_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &buffer_spec, NULL);
    if (!st->PinnedBuffer_Type || PyModule_AddType(m, st->PinnedBuffer_Type) < 0)
        return -1;
    return 0;
}
