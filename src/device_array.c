/* DeviceArray: a view of one leaf of a batch in the batch's device block, exported with
 * DLPack (and __cuda_array_interface__) to torch, CuPy, JAX and, on the host backend, NumPy.
 *
 * Note [ready handoff]
 * The data is ready once the batch's ready event (recorded on the copy stream) completes.
 * __dlpack__(stream=S) makes S wait on that event (cudaStreamWaitEvent) and returns at once:
 * the host never blocks on the GPU. On the host backend the consumer is the CPU itself, so
 * __dlpack__ waits for the event (the copy is usually long finished: the pipeline runs ahead). */
#include "module.h"

#include "block.h"
#include "np.h"

#include <string.h>

typedef struct {
    PyObject_HEAD
    pl_block *blk;
    size_t offset;
    int ndim;
    int64_t *shape; /* PyMem; NULL when ndim is 0 */
    DLDataType dtype;
    size_t nbytes;
    int device_type; /* kDLCUDA or kDLCPU */
    int device_id;
    int cai_used;    /* __cuda_array_interface__ was read: see da_get_cai */
} DeviceArrayObject;

/* ---- dtypes ---- */

int pl_dtype_from_numpy(char kind, int elsize, int type_num, char byteorder, DLDataType *out,
                        const char **why)
{
    if (byteorder == '>') {
        *why = "big-endian data cannot be exported with DLPack";
        return -1;
    }
    /* By kind and size, so that every alias (long vs long long, intc...) maps alike. */
    uint8_t bits = (uint8_t)(elsize * 8);
    switch (kind) {
    case 'b':
        *out = (DLDataType){kDLBool, 8, 1};
        return 0;
    case 'i':
    case 'u':
        if (elsize == 1 || elsize == 2 || elsize == 4 || elsize == 8) {
            *out = (DLDataType){kind == 'i' ? kDLInt : kDLUInt, bits, 1};
            return 0;
        }
        break;
    case 'f':
        if (elsize == 2 || elsize == 4 || elsize == 8) {
            *out = (DLDataType){kDLFloat, bits, 1};
            return 0;
        }
        *why = "long double has no DLPack type";
        return -1;
    case 'c':
        if (elsize == 8 || elsize == 16) {
            *out = (DLDataType){kDLComplex, bits, 1};
            return 0;
        }
        *why = "long double complex has no DLPack type";
        return -1;
    case 'O': *why = "object arrays cannot be copied"; return -1;
    case 'S':
    case 'U': *why = "string arrays cannot be copied to a device"; return -1;
    case 'V': *why = "structured/void arrays cannot be copied (copy each field as its own array)"; return -1;
    case 'M':
    case 'm': *why = "datetime64/timedelta64 arrays have no DLPack type (view them as int64)"; return -1;
    default: break;
    }
    (void)type_num;
    *why = "this dtype has no DLPack type";
    return -1;
}

int pl_dtype_valid(DLDataType dt, const char **why)
{
    if (dt.lanes != 1) {
        *why = "vector dtypes (lanes != 1) are not supported";
        return -1;
    }
    switch (dt.code) {
    case kDLInt:
    case kDLUInt:
        if (dt.bits == 8 || dt.bits == 16 || dt.bits == 32 || dt.bits == 64)
            return 0;
        break;
    case kDLFloat:
        if (dt.bits == 16 || dt.bits == 32 || dt.bits == 64)
            return 0;
        break;
    case kDLBfloat:
        if (dt.bits == 16)
            return 0;
        break;
    case kDLComplex:
        if (dt.bits == 64 || dt.bits == 128)
            return 0;
        break;
    case kDLBool:
        if (dt.bits == 8)
            return 0;
        break;
    default:
        if (dt.code >= kDLFloat8_e3m4 && dt.code <= kDLFloat8_e8m0fnu && dt.bits == 8)
            return 0;
        break;
    }
    *why = "unsupported DLPack dtype";
    return -1;
}

static const char *fp8_names[] = {"float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
                                  "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"};

PyObject *pl_dtype_to_python(pl_state *st, DLDataType dt)
{
    const char *name = NULL;
    switch (dt.code) {
    case kDLBool: name = "bool"; break;
    case kDLInt: name = dt.bits == 8 ? "int8" : dt.bits == 16 ? "int16" : dt.bits == 32 ? "int32" : "int64"; break;
    case kDLUInt: name = dt.bits == 8 ? "uint8" : dt.bits == 16 ? "uint16" : dt.bits == 32 ? "uint32" : "uint64"; break;
    case kDLFloat: name = dt.bits == 16 ? "float16" : dt.bits == 32 ? "float32" : "float64"; break;
    case kDLComplex: name = dt.bits == 64 ? "complex64" : "complex128"; break;
    case kDLBfloat: return PyUnicode_FromString("bfloat16");
    default:
        if (dt.code >= kDLFloat8_e3m4 && dt.code <= kDLFloat8_e8m0fnu)
            return PyUnicode_FromString(fp8_names[dt.code - kDLFloat8_e3m4]);
        return PyUnicode_FromString("unknown");
    }
    return PyObject_CallFunction(st->numpy_dtype_fn, "s", name);
}

static const char *typestr(DLDataType dt, char buf[8])
{
    char kind = dt.code == kDLBool ? 'b' : dt.code == kDLInt ? 'i' : dt.code == kDLUInt ? 'u'
              : dt.code == kDLComplex ? 'c' : dt.code == kDLFloat ? 'f' : 'V';
    snprintf(buf, 8, "%c%c%d", dt.bits == 8 ? '|' : '<', kind, dt.bits / 8);
    return buf;
}

int pl_capsule_tensor(PyObject *capsule, DLTensor **t, int *versioned)
{
    if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (m->version.major != DLPACK_MAJOR_VERSION) {
            PyErr_Format(PyExc_BufferError, "DLPack major version %u is not supported (need %d)",
                         m->version.major, DLPACK_MAJOR_VERSION);
            return -1;
        }
        *t = &m->dl_tensor;
        *versioned = 1;
        return 0;
    }
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *m = PyCapsule_GetPointer(capsule, "dltensor");
        *t = &m->dl_tensor;
        *versioned = 0;
        return 0;
    }
    PyErr_SetString(PyExc_TypeError, "__dlpack__() did not return a DLPack capsule");
    return -1;
}

/* ---- object ---- */

PyObject *pl_device_array_new(pl_state *st, pl_block *blk, size_t offset, int ndim,
                              const int64_t *shape, DLDataType dtype, int device_type, int device_id)
{
    DeviceArrayObject *self = PyObject_New(DeviceArrayObject, st->DeviceArray_Type);
    if (!self)
        return NULL;
    self->shape = NULL;
    if (ndim > 0) {
        self->shape = PyMem_Malloc((size_t)ndim * sizeof(int64_t));
        if (!self->shape) {
            self->blk = NULL;
            Py_DECREF(self);
            return PyErr_NoMemory();
        }
        memcpy(self->shape, shape, (size_t)ndim * sizeof(int64_t));
    }
    size_t n = dtype.bits / 8;
    for (int i = 0; i < ndim; i++)
        n *= (size_t)shape[i];
    pl_block_incref(blk);
    self->blk = blk;
    self->offset = offset;
    self->ndim = ndim;
    self->dtype = dtype;
    self->nbytes = n;
    self->device_type = device_type;
    self->device_id = device_id;
    self->cai_used = 0;
    return (PyObject *)self;
}

static void da_dealloc(PyObject *op)
{
    DeviceArrayObject *self = (DeviceArrayObject *)op;
    PyTypeObject *tp = Py_TYPE(op);
    if (self->blk) {
        if (self->cai_used) /* the consumer's work was queued by now; see da_get_cai */
            pl_block_note_use(self->blk, (pl_stream *)(uintptr_t)1);
        pl_block_decref(self->blk);
    }
    PyMem_Free(self->shape);
    PyObject_Free(op);
    Py_DECREF(tp);
}

typedef struct {
    union {
        DLManagedTensor legacy;
        DLManagedTensorVersioned versioned;
    } t;
    pl_block *blk;
    pl_stream *use_stream;
    int note_use;
    int64_t dims[]; /* shape then strides */
} export_ctx;

/* Runs on any thread, with or without the GIL, maybe at exit: no Python here.
 * See Note [device lifetime] in block.c. */
static void export_ctx_free(export_ctx *ctx)
{
    if (ctx->note_use)
        pl_block_note_use(ctx->blk, ctx->use_stream);
    pl_block_decref(ctx->blk);
    PyMem_RawFree(ctx);
}

static void deleter_legacy(DLManagedTensor *t)
{
    export_ctx_free((export_ctx *)t->manager_ctx);
}

static void deleter_versioned(DLManagedTensorVersioned *t)
{
    export_ctx_free((export_ctx *)t->manager_ctx);
}

static void capsule_destructor(PyObject *cap)
{
    if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *t = PyCapsule_GetPointer(cap, "dltensor");
        t->deleter(t);
    } else if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        DLManagedTensorVersioned *t = PyCapsule_GetPointer(cap, "dltensor_versioned");
        t->deleter(t);
    }
}

/* Parse a DLPack stream argument into a CUDA stream handle. *skip = 1 for -1. */
static int parse_stream(PyObject *stream, pl_stream **out, int *skip)
{
    *skip = 0;
    if (stream == Py_None) {
        *out = (pl_stream *)(uintptr_t)1; /* cudaStreamLegacy */
        return 0;
    }
    if (!PyLong_Check(stream)) {
        PyErr_Format(PyExc_TypeError, "stream must be an int or None, not %.100s", Py_TYPE(stream)->tp_name);
        return -1;
    }
    long long v = PyLong_AsLongLong(stream);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        unsigned long long u = PyLong_AsUnsignedLongLong(stream);
        if (u == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        *out = (pl_stream *)(uintptr_t)u;
        return 0;
    }
    if (v == -1) {
        *skip = 1;
        *out = (pl_stream *)(uintptr_t)1;
        return 0;
    }
    if (v == 0) {
        PyErr_SetString(PyExc_ValueError, "stream=0 is ambiguous for CUDA in DLPack: pass 1 for the "
                        "legacy default stream, 2 for the per-thread default stream, or a cudaStream_t");
        return -1;
    }
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "invalid DLPack stream %lld", v);
        return -1;
    }
    *out = (pl_stream *)(uintptr_t)v;
    return 0;
}

static int parse_major(PyObject *max_version, int *major)
{
    *major = 0;
    if (max_version == Py_None)
        return 0;
    if (!PyTuple_Check(max_version) || PyTuple_GET_SIZE(max_version) != 2) {
        PyErr_SetString(PyExc_TypeError, "max_version must be a (major, minor) tuple or None");
        return -1;
    }
    long m = PyLong_AsLong(PyTuple_GET_ITEM(max_version, 0));
    if (m == -1 && PyErr_Occurred())
        return -1;
    *major = (int)m;
    return 0;
}

static PyObject *da_dlpack(PyObject *op, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OOOO:__dlpack__", kwlist, &stream,
                                     &max_version, &dl_device, &copy))
        return NULL;
    DeviceArrayObject *self = (DeviceArrayObject *)op;
    pl_state *st = pl_state_of_type(Py_TYPE(op));
    if (!st)
        return NULL;
    if (dl_device != Py_None) {
        int dt = -1, di = -1;
        if (!PyArg_ParseTuple(dl_device, "ii", &dt, &di))
            return NULL;
        if (dt != self->device_type || di != self->device_id) {
            PyErr_Format(PyExc_BufferError, "DeviceArray on (%d, %d) cannot be exported to device "
                         "(%d, %d) without a copy", self->device_type, self->device_id, dt, di);
            return NULL;
        }
    }
    if (copy == Py_True) {
        PyErr_SetString(PyExc_BufferError, "DeviceArray.__dlpack__(copy=True) is not supported: "
                        "the consumer can copy the exported array itself");
        return NULL;
    }
    int major;
    if (parse_major(max_version, &major) < 0)
        return NULL;

    pl_block *blk = self->blk;
    pl_stream *s = NULL;
    int skip = 0, note_use = 0;
    if (blk->b->kind == PL_BACKEND_CUDA) {
        if (parse_stream(stream, &s, &skip) < 0)
            return NULL;
        note_use = 1;
        if (!skip) {
            int rc = pl_block_wait_ready(blk, s);
            if (rc != PL_OK)
                return pl_raise_backend(st, blk->b, rc, "__dlpack__: cudaStreamWaitEvent on the consumer's stream");
        }
    } else {
        if (stream != Py_None && !(PyLong_Check(stream) && PyLong_AsLong(stream) == -1)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_BufferError, "a host-backend DeviceArray is CPU memory: stream must be None");
            return NULL;
        }
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = pl_block_sync_ready(blk);
        Py_END_ALLOW_THREADS
        if (rc != PL_OK)
            return pl_raise_backend(st, blk->b, rc, "__dlpack__: waiting for the batch copy");
    }

    export_ctx *ctx = PyMem_RawCalloc(1, sizeof(*ctx) + 2 * (size_t)self->ndim * sizeof(int64_t));
    if (!ctx)
        return PyErr_NoMemory();
    int64_t *shape = ctx->dims, *strides = ctx->dims + self->ndim;
    int64_t acc = 1;
    for (int i = self->ndim - 1; i >= 0; i--) {
        shape[i] = self->shape[i];
        strides[i] = self->shape[i] == 1 ? 1 : acc; /* canonical for size-1 dims */
        acc *= self->shape[i] > 0 ? self->shape[i] : 1;
    }
    pl_block_incref(blk);
    ctx->blk = blk;
    ctx->use_stream = s;
    ctx->note_use = note_use;
    DLTensor *t = major >= 1 ? &ctx->t.versioned.dl_tensor : &ctx->t.legacy.dl_tensor;
    t->data = self->nbytes && blk->ptr ? (char *)blk->ptr + self->offset : NULL;
    t->device = (DLDevice){self->device_type, self->device_id};
    t->ndim = self->ndim;
    t->dtype = self->dtype;
    t->shape = self->ndim ? shape : NULL;
    t->strides = self->ndim ? strides : NULL;
    t->byte_offset = 0;
    PyObject *cap;
    if (major >= 1) {
        ctx->t.versioned.version = (DLPackVersion){DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
        ctx->t.versioned.manager_ctx = ctx;
        ctx->t.versioned.deleter = deleter_versioned;
        cap = PyCapsule_New(&ctx->t.versioned, "dltensor_versioned", capsule_destructor);
    } else {
        ctx->t.legacy.manager_ctx = ctx;
        ctx->t.legacy.deleter = deleter_legacy;
        cap = PyCapsule_New(&ctx->t.legacy, "dltensor", capsule_destructor);
    }
    if (!cap) {
        ctx->note_use = 0;
        export_ctx_free(ctx);
        return NULL;
    }
    return cap;
}

static PyObject *da_dlpack_device(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    DeviceArrayObject *self = (DeviceArrayObject *)op;
    return Py_BuildValue("(ii)", self->device_type, self->device_id);
}

static PyObject *shape_tuple(DeviceArrayObject *self)
{
    PyObject *t = PyTuple_New(self->ndim);
    if (!t)
        return NULL;
    for (int i = 0; i < self->ndim; i++) {
        PyObject *v = PyLong_FromLongLong(self->shape[i]);
        if (!v) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

static PyObject *da_get_shape(PyObject *op, void *c)
{
    (void)c;
    return shape_tuple((DeviceArrayObject *)op);
}

static PyObject *da_get_dtype(PyObject *op, void *c)
{
    (void)c;
    pl_state *st = pl_state_of_type(Py_TYPE(op));
    return st ? pl_dtype_to_python(st, ((DeviceArrayObject *)op)->dtype) : NULL;
}

static PyObject *da_get_nbytes(PyObject *op, void *c)
{
    (void)c;
    return PyLong_FromSize_t(((DeviceArrayObject *)op)->nbytes);
}

static PyObject *da_get_ndim(PyObject *op, void *c)
{
    (void)c;
    return PyLong_FromLong(((DeviceArrayObject *)op)->ndim);
}

static PyObject *da_get_device(PyObject *op, void *c)
{
    (void)c;
    DeviceArrayObject *self = (DeviceArrayObject *)op;
    if (self->device_type == kDLCPU)
        return PyUnicode_FromString("cpu");
    return PyUnicode_FromFormat("cuda:%d", self->device_id);
}

static PyObject *da_get_ptr(PyObject *op, void *c)
{
    (void)c;
    DeviceArrayObject *self = (DeviceArrayObject *)op;
    return PyLong_FromVoidPtr(self->blk->ptr ? (char *)self->blk->ptr + self->offset : NULL);
}

/* __cuda_array_interface__ v3. Its consumers name no stream to us, so the legacy default stream
 * is made to wait on the ready event and is given as the stream to synchronise with: it is
 * always valid, and waiting on it orders the consumer after the copy without blocking the
 * host. The consumer must keep this DeviceArray alive while it queues work that reads the data;
 * when it goes, the memory is freed after the legacy stream's work. */
static PyObject *da_get_cai(PyObject *op, void *c)
{
    (void)c;
    DeviceArrayObject *self = (DeviceArrayObject *)op;
    pl_state *st = pl_state_of_type(Py_TYPE(op));
    if (!st)
        return NULL;
    if (self->blk->b->kind != PL_BACKEND_CUDA) {
        PyErr_SetString(PyExc_AttributeError, "__cuda_array_interface__ exists only for CUDA device arrays");
        return NULL;
    }
    pl_stream *legacy = (pl_stream *)(uintptr_t)1;
    int rc = pl_block_wait_ready(self->blk, legacy);
    if (rc != PL_OK)
        return pl_raise_backend(st, self->blk->b, rc, "__cuda_array_interface__: cudaStreamWaitEvent");
    /* The use is noted when this DeviceArray goes (da_dealloc), once the consumer's work
     * has been queued, not now. */
    self->cai_used = 1;
    char buf[8];
    PyObject *shape = shape_tuple(self);
    if (!shape)
        return NULL;
    void *ptr = self->nbytes ? (char *)self->blk->ptr + self->offset : NULL;
    return Py_BuildValue("{s:N,s:s,s:(NO),s:i,s:O,s:i}", "shape", shape, "typestr",
                         typestr(self->dtype, buf), "data", PyLong_FromVoidPtr(ptr), Py_False,
                         "version", 3, "strides", Py_None, "stream", 1);
}

static PyObject *da_repr(PyObject *op)
{
    DeviceArrayObject *self = (DeviceArrayObject *)op;
    PyObject *shape = shape_tuple(self);
    PyObject *dtype = da_get_dtype(op, NULL);
    PyObject *device = da_get_device(op, NULL);
    PyObject *r = NULL;
    if (shape && dtype && device)
        r = PyUnicode_FromFormat("<pinloader.DeviceArray shape=%R dtype=%S device=%U>", shape, dtype, device);
    Py_XDECREF(shape);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    return r;
}

static PyMethodDef da_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))da_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__($self, /, *, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n"
     "Export as a DLPack capsule. For CUDA arrays, `stream` (None or 1: legacy default, 2:\n"
     "per-thread default, a cudaStream_t, -1: no synchronisation) is made to wait for the\n"
     "batch's copy with cudaStreamWaitEvent; the host does not block. The memory is freed in\n"
     "stream order after that stream's use. max_version >= (1, 0) gives a versioned capsule."},
    {"__dlpack_device__", da_dlpack_device, METH_NOARGS, "__dlpack_device__($self, /)\n--\n\n(device_type, device_id)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef da_getset[] = {
    {"shape", da_get_shape, NULL, "Shape tuple.", NULL},
    {"dtype", da_get_dtype, NULL, "numpy.dtype, or a str for dtypes NumPy lacks (bfloat16, float8_*).", NULL},
    {"nbytes", da_get_nbytes, NULL, "Size in bytes.", NULL},
    {"ndim", da_get_ndim, NULL, "Number of dimensions.", NULL},
    {"device", da_get_device, NULL, "'cuda:N', or 'cpu' on the host backend.", NULL},
    {"ptr", da_get_ptr, NULL, "Address of the first element.", NULL},
    {"__cuda_array_interface__", da_get_cai, NULL, "CUDA Array Interface, version 3.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot da_slots[] = {
    {Py_tp_dealloc, da_dealloc},
    {Py_tp_methods, da_methods},
    {Py_tp_getset, da_getset},
    {Py_tp_repr, da_repr},
    {Py_tp_doc, "One array of a batch delivered by AsyncPrefetcher: a C-contiguous view into the\n"
                "batch's device block, consumed with torch.from_dlpack, cupy.from_dlpack,\n"
                "jax.dlpack.from_dlpack or (host backend) numpy.from_dlpack."},
    {0, NULL},
};

static PyType_Spec da_spec = {
    .name = "pinloader.DeviceArray",
    .basicsize = sizeof(DeviceArrayObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = da_slots,
};

int pl_device_array_init(PyObject *m, pl_state *st)
{
    st->DeviceArray_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &da_spec, NULL);
    if (!st->DeviceArray_Type || PyModule_AddType(m, st->DeviceArray_Type) < 0)
        return -1;
    return 0;
}

void pl_device_array_add_offset(PyObject *o, size_t delta)
{
    ((DeviceArrayObject *)o)->offset += delta;
}

int pl_device_array_check(pl_state *st, PyObject *o)
{
    return Py_IS_TYPE(o, st->DeviceArray_Type);
}
