/* DeviceArray: a view of one leaf of a batch in the batch's device block, exported with
 * DLPack (and __cuda_array_interface__) to torch, CuPy, JAX and, on the host backend, NumPy.
 *
 * Note [ready handoff]
 * The data is ready once the batch's ready event (recorded on the copy stream) completes.
 * __dlpack__(stream=S) makes S wait on that event (cudaStreamWaitEvent) and returns at once:
 * the host never blocks on the GPU. On the host backend the consumer is the CPU itself, so
 * __dlpack__ waits for the event (the copy is usually long finished: the pipeline runs ahead).
 * Either way the wait is issued once per (batch, consumer stream) while exports to that stream
 * are alive: see Note [consumer waits] in block.c. export_capsules exports a whole batch's
 * leaves for one stream in one call, for doors that know the consumer stream once per
 * batch. The capsules themselves are made in dlpack.c. */
#include "device_array.h"

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

/* ---- DLPack export (capsules and deleters in dlpack.c) ---- */

/* What one export holds; released by its deleter (any thread, no GIL, maybe at exit).
 * See Note [device lifetime] and Note [consumer waits] in block.c. */
typedef struct {
    pl_block *blk;     /* a block reference */
    pl_stream *stream; /* the consumer: a stream handle (CUDA) or NULL (host backend) */
    int note_use;      /* CUDA: record the consumer's use on stream when released */
    int memo;          /* holds a count on blk's memo entry for stream */
} da_export;

/* Note [one use record per stream]
 * The exports of one batch to one stream share a memo entry (Note [consumer waits] in block.c),
 * whose count says how many are alive. Only the release that drops it to zero records the use
 * event: every earlier release on that stream happened before it, so the consumer's work for
 * those leaves was queued on the stream before this record. A batch of n leaves imported by a
 * framework costs one event record when its tensors die, not n. Without a memo entry (the
 * per-thread default stream, a static block, a full table) each release records. */
static void da_export_release(void *owner)
{
    da_export *e = owner;
    int last = e->memo ? pl_block_consumer_done(e->blk, e->stream) : 1;
    if (e->note_use && last)
        pl_block_note_use(e->blk, e->stream);
    pl_block_decref(e->blk);
}

/* Make the consumer wait for the batch's copy, once per (block, stream) while exports to that
 * stream live. CUDA: queued on the stream, GIL kept (no blocking). Host: the CPU is the
 * consumer and blocks until the copy is done, in slices with the GIL released and signals
 * checked between them (Ctrl-C works); when the copy has finished already (the usual case: the
 * pipeline runs ahead) the GIL is kept, since releasing it would only hand it to the producer
 * thread. An error names leaves[leaf] of export_capsules (leaf >= 0) or __dlpack__. */
static int consumer_wait(pl_state *st, pl_block *blk, pl_stream *s, int *memo, Py_ssize_t leaf)
{
    if (pl_block_consumer_memo(blk, s)) {
        *memo = 1;
        return 0;
    }
    int rc = PL_OK;
    while (rc == PL_OK && pl_block_consumer_wait_blocks(blk)) {
        Py_BEGIN_ALLOW_THREADS
        rc = blk->b->event_wait(blk->ready, PL_SIGNAL_SLICE_NS, 0);
        Py_END_ALLOW_THREADS
        if (rc == PL_ERR_TIMEOUT) {
            if (PyErr_CheckSignals() < 0)
                return -1;
            rc = PL_OK;
        }
    }
    if (rc == PL_OK)
        rc = pl_block_consumer_wait(blk, s, memo); /* queued (CUDA) or already done (host) */
    if (rc == PL_OK)
        return 0;
    char what[160], where[64] = "__dlpack__: ";
    if (leaf >= 0)
        snprintf(where, sizeof where, "export_capsules: leaves[%zd]: ", leaf);
    snprintf(what, sizeof what, "%s%s", where,
             blk->b->kind == PL_BACKEND_CUDA ? "cudaStreamWaitEvent on the consumer's stream"
                                             : "waiting for the batch copy");
    pl_raise_backend(st, blk->b, rc, what);
    return -1;
}

/* Export the view v (on DLPack device dev) for a parsed consumer stream: the wait, then the
 * capsule. A DeviceArray's exports and a handed-out batch's (pl_export_views) both come here. */
static PyObject *export_view(pl_state *st, const pl_da_view *v, DLDevice dev, const pl_dlpack_stream *s,
                             int versioned, Py_ssize_t leaf)
{
    pl_block *blk = v->blk;
    int cuda = blk->b->kind == PL_BACKEND_CUDA;
    da_export e = {blk, cuda ? (pl_stream *)s->handle : NULL, cuda, 0};
    /* On the host backend the CPU reads the data as soon as it has the capsule: always wait. */
    if ((!cuda || s->kind == PL_DLPACK_SYNC) && consumer_wait(st, blk, e.stream, &e.memo, leaf) < 0)
        return NULL;
    pl_block_incref(blk);
    pl_dlpack_view dv = {
        .data = v->nbytes && blk->ptr ? (char *)blk->ptr + v->offset : NULL,
        .device = dev,
        .dtype = v->dtype,
        .ndim = v->ndim,
        .shape = v->shape,
    };
    return pl_dlpack_export(&dv, versioned, &e, sizeof e, da_export_release);
}

static PyObject *da_export_capsule(pl_state *st, DeviceArrayObject *self, const pl_dlpack_stream *s,
                                   int versioned, Py_ssize_t leaf)
{
    pl_da_view v = {self->blk, self->offset, self->nbytes, self->ndim, self->shape, self->dtype};
    return export_view(st, &v, (DLDevice){self->device_type, self->device_id}, s, versioned, leaf);
}

/* What every export of a DeviceArray requires (__dlpack__, __cuda_array_interface__ and each
 * leaf of export_capsules), checked in one place:
 * - its batch has device memory: a DeviceArray that the prefetcher hands to a user constructor
 *   while it rebuilds an item has none yet (see Note [flatten in two passes] in flatten.h), so
 *   it is refused rather than exported with a null pointer;
 * - it was made in this process, not inherited through fork().
 * `leaf` (>= 0: export_capsules' leaves[leaf], -1: the array's own method) names the entry
 * point in the message. */
static int check_block_exportable(pl_block *blk, size_t nbytes, Py_ssize_t leaf)
{
    if (nbytes && !blk->ptr) {
        char where[64] = "";
        if (leaf >= 0) /* formatted only here: export_capsules runs this for every leaf */
            snprintf(where, sizeof where, "export_capsules: leaves[%zd]: ", leaf);
        PyErr_Format(PyExc_BufferError, "%sthis DeviceArray's batch is still being prepared (it "
                     "cannot be exported inside a constructor the prefetcher calls)", where);
        return -1;
    }
    if (pl_block_inherited(blk)) {
        pl_raise_forked("DeviceArray");
        return -1;
    }
    return 0;
}

static int check_exportable(DeviceArrayObject *self, Py_ssize_t leaf)
{
    return check_block_exportable(self->blk, self->nbytes, leaf);
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
    if (!st || check_exportable(self, -1) < 0)
        return NULL;
    int cuda = self->blk->b->kind == PL_BACKEND_CUDA;
    pl_dlpack_stream s;
    pl_dlpack_request req;
    if (pl_dlpack_parse_stream(stream, cuda, "a host-backend DeviceArray", &s) < 0 ||
        pl_dlpack_parse_request(max_version, dl_device, copy, &req) < 0 ||
        pl_dlpack_check_request(&req, (DLDevice){self->device_type, self->device_id},
                                (DLDevice){0, 0}, "DeviceArray") < 0)
        return NULL;
    return da_export_capsule(st, self, &s, req.versioned, -1);
}

PyObject *pl_export_leaves(pl_state *st, PyObject *items, PyObject *stream)
{
    /* Parsed once per call, for each backend met (host memory takes only None and -1). */
    pl_dlpack_stream parsed[2];
    int have[2] = {0, 0};
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    PyObject *out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *o = PyTuple_GET_ITEM(items, i);
        if (!Py_IS_TYPE(o, st->DeviceArray_Type)) {
            PyTuple_SET_ITEM(out, i, Py_NewRef(o));
            continue;
        }
        DeviceArrayObject *da = (DeviceArrayObject *)o;
        if (check_exportable(da, i) < 0) {
            Py_CLEAR(out);
            break;
        }
        int k = da->blk->b->kind == PL_BACKEND_CUDA;
        if (!have[k] && pl_dlpack_parse_stream(stream, k, "a host-backend DeviceArray", &parsed[k]) < 0) {
            Py_CLEAR(out);
            break;
        }
        have[k] = 1;
        PyObject *cap = da_export_capsule(st, da, &parsed[k], 0, i);
        if (!cap) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, i, cap);
    }
    return out;
}

PyObject *pl_export_views(pl_state *st, const pl_da_view *v, Py_ssize_t n, DLDevice dev,
                          PyObject *stream)
{
    pl_dlpack_stream parsed;
    PyObject *out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        if (check_block_exportable(v[i].blk, v[i].nbytes, i) < 0 ||
            (i == 0 && pl_dlpack_parse_stream(stream, v[i].blk->b->kind == PL_BACKEND_CUDA,
                                              "a host-backend DeviceArray", &parsed) < 0)) {
            Py_CLEAR(out);
            break;
        }
        PyObject *cap = export_view(st, &v[i], dev, &parsed, 0, i);
        if (!cap) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, i, cap);
    }
    return out;
}

PyObject *pl_device_arrays_of(pl_state *st, const pl_da_view *v, Py_ssize_t n, DLDevice dev)
{
    PyObject *out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *a = pl_device_array_new(st, v[i].blk, v[i].offset, v[i].ndim, v[i].shape,
                                          v[i].dtype, dev.device_type, dev.device_id);
        if (!a)
            Py_CLEAR(out);
        else
            PyTuple_SET_ITEM(out, i, a);
    }
    return out;
}

/* export_capsules(leaves, stream, /): see its docstring in da_module_methods. */
static PyObject *export_capsules(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "export_capsules() takes 2 positional arguments (leaves, "
                     "stream), %zd given", nargs);
        return NULL;
    }
    pl_state *st = pl_state_of_module(m);
    PyObject *leaves = args[0], *stream = args[1];
    /* A tuple snapshot: the host backend's wait releases the GIL, and a list could change. */
    PyObject *items;
    if (PyTuple_Check(leaves))
        items = Py_NewRef(leaves);
    else if (PyList_Check(leaves))
        items = PyList_AsTuple(leaves);
    else
        return PyErr_Format(PyExc_TypeError, "export_capsules: leaves must be a list or tuple, "
                            "not %.100s", Py_TYPE(leaves)->tp_name);
    if (!items)
        return NULL;
    PyObject *caps = pl_export_leaves(st, items, stream);
    Py_DECREF(items);
    PyObject *out = caps ? PySequence_List(caps) : NULL; /* the documented result: a list */
    Py_XDECREF(caps);
    return out;
}

int pl_device_array_view(pl_state *st, PyObject *o, pl_da_view *v)
{
    if (!Py_IS_TYPE(o, st->DeviceArray_Type))
        return -1;
    DeviceArrayObject *da = (DeviceArrayObject *)o;
    *v = (pl_da_view){da->blk, da->offset, da->nbytes, da->ndim, da->shape, da->dtype};
    return 0;
}

static PyMethodDef da_module_methods[] = {
    {"export_capsules", (PyCFunction)(void (*)(void))export_capsules, METH_FASTCALL,
     "export_capsules(leaves, stream, /)\n--\n\n"
     "Export a batch's leaves for one consumer stream in one call: a new list, the same length\n"
     "as leaves (a list or tuple), where each DeviceArray is replaced by a legacy \"dltensor\"\n"
     "DLPack capsule and every other object is passed through unchanged. `stream` is read as\n"
     "DeviceArray.__dlpack__(stream=...) reads it, once for the whole batch; it is made to wait\n"
     "on each distinct batch's copy once (later leaves find the wait already queued), and each\n"
     "capsule's memory is freed in stream order after that stream's use. Capsules never\n"
     "consumed release their references when they are dropped."},
    {NULL, NULL, 0, NULL},
};

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
    if (check_exportable(self, -1) < 0)
        return NULL;
    pl_stream *legacy = (pl_stream *)(uintptr_t)1;
    int rc = pl_block_consumer_wait(self->blk, legacy, NULL);
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
     "per-thread default, a cudaStream_t, -1: no synchronisation; 0 is ambiguous and refused)\n"
     "is made to wait for the batch's copy with cudaStreamWaitEvent (once per batch and stream\n"
     "while its exports live); the host does not block. The memory is freed in stream order\n"
     "after that stream's use. On the host backend stream must be None or -1. max_version >=\n"
     "(1, 0) gives a versioned capsule; dl_device may only name this array's device; copy=True\n"
     "raises BufferError (pinloader never copies on export)."},
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
    if (!st->DeviceArray_Type || PyModule_AddType(m, st->DeviceArray_Type) < 0 ||
        PyModule_AddFunctions(m, da_module_methods) < 0)
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
