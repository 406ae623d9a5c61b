/* DLPack in both directions. Export, shared by every exporter in pinloader (PinnedBuffer in
 * pinned_buffer.c, DeviceArray in device_array.c): parsing of the __dlpack__ keywords, the capsule,
 * its destructor and the managed tensor's deleters (legacy and versioned). Import (flat_leaves.c
 * reads leaves with it): the dtype map between NumPy and DLPack, the call of an exporter's
 * __dlpack__, and the reading of the capsule it returns.
 *
 * Note [export deleters]
 * A capsule made here owns one export context: the managed tensor (legacy or versioned), its
 * shape and strides, and a copy of the exporter's "owner" bytes (the block or region
 * references it took). The context is freed exactly once, by one of:
 *   - the consumer calling the managed tensor's deleter (torch, NumPy, CuPy, JAX do so when
 *     their tensor dies; the capsule was renamed "used_dltensor[_versioned]" on import), or
 *   - the capsule's destructor, when the capsule is dropped while still named
 *     "dltensor[_versioned]" (never consumed).
 * Deleters run on any thread, with or without the GIL, possibly during interpreter shutdown
 * and after the CUDA runtime began unloading. So nothing on that path touches Python: the
 * context is allocated with malloc (not a Python allocator), and the owner's release function
 * calls only pinloader's own C layers, which tolerate backend failure by leaking rather than
 * crashing (see Note [device lifetime] in block.c and Note [pinned buffer lifetime] in
 * pinned_buffer.c). */
#include "dlpack.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- argument parsing ---- */

/* DLPack's integers are Python ints; bool is refused rather than read as 0 or 1. */
static int is_int(PyObject *o)
{
    return PyLong_Check(o) && !PyBool_Check(o);
}

/* max_version and dl_device entries may also be integer-like (an IntEnum, a NumPy integer):
 * anything with __index__, except bool. */
static int is_index(PyObject *o)
{
    return PyIndex_Check(o) && !PyBool_Check(o);
}

/* An is_index() object as a long long; *overflow as PyLong_AsLongLongAndOverflow sets it. */
static int index_value(PyObject *o, long long *v, int *overflow)
{
    PyObject *i = PyNumber_Index(o);
    if (!i)
        return -1;
    *v = PyLong_AsLongLongAndOverflow(i, overflow);
    Py_DECREF(i);
    return *v == -1 && PyErr_Occurred() ? -1 : 0;
}

/* max_version: None, or a (major, minor) tuple. Only the major matters to pinloader; any int
 * is accepted (a consumer of DLPack 2**70 still gets our 1.x versioned capsule). */
static int parse_max_version(PyObject *max_version, int *versioned)
{
    *versioned = 0;
    if (max_version == Py_None)
        return 0;
    if (!PyTuple_Check(max_version) || PyTuple_GET_SIZE(max_version) != 2 ||
        !is_index(PyTuple_GET_ITEM(max_version, 0)) || !is_index(PyTuple_GET_ITEM(max_version, 1))) {
        PyErr_Format(PyExc_TypeError, "max_version must be None or a (major, minor) tuple of "
                     "ints, not %.100s", Py_TYPE(max_version)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long major;
    if (index_value(PyTuple_GET_ITEM(max_version, 0), &major, &overflow) < 0)
        return -1;
    *versioned = overflow > 0 || (overflow == 0 && major >= 1);
    return 0;
}

/* One entry of dl_device: an int; values beyond int32 name no device anyone can serve. */
static int device_field(PyObject *o, int32_t *out, int *out_of_range)
{
    int overflow = 0;
    long long v;
    if (index_value(o, &v, &overflow) < 0)
        return -1;
    if (overflow || v < INT32_MIN || v > INT32_MAX)
        *out_of_range = 1;
    else
        *out = (int32_t)v;
    return 0;
}

static int parse_dl_device(PyObject *dl_device, pl_dlpack_request *req)
{
    req->has_device = 0;
    if (dl_device == Py_None)
        return 0;
    if (!PyTuple_Check(dl_device) || PyTuple_GET_SIZE(dl_device) != 2 ||
        !is_index(PyTuple_GET_ITEM(dl_device, 0)) || !is_index(PyTuple_GET_ITEM(dl_device, 1))) {
        PyErr_Format(PyExc_TypeError, "dl_device must be None or a (device_type, device_id) "
                     "tuple of ints, not %.100s", Py_TYPE(dl_device)->tp_name);
        return -1;
    }
    int out_of_range = 0;
    if (device_field(PyTuple_GET_ITEM(dl_device, 0), &req->device.device_type, &out_of_range) < 0 ||
        device_field(PyTuple_GET_ITEM(dl_device, 1), &req->device.device_id, &out_of_range) < 0)
        return -1;
    if (out_of_range) {
        PyErr_SetString(PyExc_BufferError, "dl_device names no DLPack device (its device_type or "
                        "device_id does not fit an int32)");
        return -1;
    }
    req->has_device = 1;
    return 0;
}

static int parse_copy(PyObject *copy, int *out)
{
    if (copy == Py_None)
        *out = -1;
    else if (copy == Py_True)
        *out = 1;
    else if (copy == Py_False)
        *out = 0;
    else {
        PyErr_Format(PyExc_TypeError, "copy must be None, True or False, not %.100s",
                     Py_TYPE(copy)->tp_name);
        return -1;
    }
    return 0;
}

int pl_dlpack_parse_request(PyObject *max_version, PyObject *dl_device, PyObject *copy,
                            pl_dlpack_request *req)
{
    if (parse_max_version(max_version, &req->versioned) < 0 || parse_dl_device(dl_device, req) < 0 ||
        parse_copy(copy, &req->copy) < 0)
        return -1;
    return 0;
}

static int same_device(DLDevice a, DLDevice b)
{
    return a.device_type == b.device_type && a.device_id == b.device_id;
}

int pl_dlpack_check_request(const pl_dlpack_request *req, DLDevice here, DLDevice alias,
                            const char *who)
{
    if (req->has_device && !same_device(req->device, here) &&
        !(alias.device_type != 0 && same_device(req->device, alias))) {
        PyErr_Format(PyExc_BufferError, "%s on device (%d, %d) cannot be exported to device "
                     "(%d, %d): that needs a copy, which the consumer can make itself", who,
                     (int)here.device_type, (int)here.device_id, (int)req->device.device_type,
                     (int)req->device.device_id);
        return -1;
    }
    if (req->copy == 1) {
        PyErr_Format(PyExc_BufferError, "%s.__dlpack__(copy=True) is not supported: pinloader "
                     "exports without copying; the consumer can copy the array itself", who);
        return -1;
    }
    return 0;
}

int pl_dlpack_parse_stream(PyObject *stream, int cuda, const char *who, pl_dlpack_stream *out)
{
    out->kind = PL_DLPACK_SYNC;
    out->handle = cuda ? (void *)(uintptr_t)1 : NULL; /* cudaStreamLegacy */
    if (stream == Py_None)
        return 0;
    if (!is_int(stream)) {
        PyErr_Format(PyExc_TypeError, "stream must be an int or None, not %.100s",
                     Py_TYPE(stream)->tp_name);
        return -1;
    }
    /* Range first, for every exporter: what names no stream at all is a ValueError. */
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(stream, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow < 0 || (overflow == 0 && v < -1)) {
        PyErr_SetString(PyExc_ValueError, "invalid DLPack stream: negative values other than -1 "
                        "name no stream");
        return -1;
    }
    unsigned long long u = (unsigned long long)v;
    if (overflow > 0) {
        u = PyLong_AsUnsignedLongLong(stream);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError))
                return -1;
            PyErr_Clear();
            u = 0;
            overflow = 2; /* beyond 64 bits */
        }
    }
    if (overflow == 2 || u > UINTPTR_MAX) {
        PyErr_SetString(PyExc_ValueError, "invalid DLPack stream: too large for a stream handle");
        return -1;
    }
    if (overflow == 0 && v == -1) {
        out->kind = PL_DLPACK_NO_SYNC;
        return 0;
    }
    if (!cuda) {
        PyErr_Format(PyExc_BufferError, "%s is host memory: stream must be None or -1", who);
        return -1;
    }
    if (u == 0) {
        PyErr_SetString(PyExc_ValueError, "stream=0 is ambiguous for CUDA in DLPack: pass 1 for the "
                        "legacy default stream, 2 for the per-thread default stream, or a cudaStream_t");
        return -1;
    }
    out->handle = (void *)(uintptr_t)u;
    return 0;
}

/* ---- capsules ---- */

typedef struct {
    union {
        DLManagedTensor legacy;
        DLManagedTensorVersioned versioned;
    } t;
    pl_dlpack_release_fn release;
    void *owner;    /* points into this allocation, after dims */
    int64_t dims[]; /* shape[ndim], strides[ndim], then the owner's bytes */
} export_ctx;

/* Any thread, no GIL: see Note [export deleters]. */
static void export_free(export_ctx *ctx)
{
    ctx->release(ctx->owner);
    free(ctx);
}

static void deleter_legacy(DLManagedTensor *t)
{
    if (t)
        export_free((export_ctx *)t->manager_ctx);
}

static void deleter_versioned(DLManagedTensorVersioned *t)
{
    if (t)
        export_free((export_ctx *)t->manager_ctx);
}

/* Runs with the GIL when the capsule dies; a consumed capsule was renamed, and its deleter
 * belongs to the consumer now. */
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

/* One allocation: the context, dims, and the owner's bytes at a max_align_t boundary. */
static export_ctx *ctx_alloc(int ndim, const void *owner, size_t owner_size, pl_dlpack_release_fn release)
{
    size_t align = _Alignof(max_align_t);
    size_t owner_off = sizeof(export_ctx) + 2 * (size_t)ndim * sizeof(int64_t);
    owner_off = (owner_off + align - 1) / align * align;
    export_ctx *ctx = calloc(1, owner_off + (owner_size ? owner_size : 1));
    if (!ctx)
        return NULL;
    ctx->release = release;
    ctx->owner = (char *)ctx + owner_off;
    memcpy(ctx->owner, owner, owner_size);
    return ctx;
}

/* Explicit C-contiguous strides (canonical 1 for size-1 dimensions), computed with checked
 * arithmetic: an empty array may have other dimensions whose product overflows int64. */
static int write_dims(int64_t *shape, int64_t *strides, const int64_t *src, int ndim)
{
    int64_t acc = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        if (src[i] < 0)
            return -1;
        shape[i] = src[i];
        strides[i] = src[i] == 1 ? 1 : acc;
        if (src[i] > 1 && __builtin_mul_overflow(acc, src[i], &acc))
            return -1;
    }
    return 0;
}

static void fill_tensor(DLTensor *t, const pl_dlpack_view *v, int64_t *shape, int64_t *strides)
{
    t->data = v->data;
    t->device = v->device;
    t->ndim = v->ndim;
    t->dtype = v->dtype;
    t->shape = v->ndim ? shape : NULL;
    t->strides = v->ndim ? strides : NULL;
    t->byte_offset = 0;
}

PyObject *pl_dlpack_export(const pl_dlpack_view *view, int versioned, const void *owner,
                           size_t owner_size, pl_dlpack_release_fn release)
{
    if (view->ndim < 0 || (view->ndim > 0 && !view->shape)) {
        release((void *)owner);
        PyErr_SetString(PyExc_SystemError, "pl_dlpack_export: bad view");
        return NULL;
    }
    export_ctx *ctx = ctx_alloc(view->ndim, owner, owner_size, release);
    if (!ctx) {
        release((void *)owner);
        return PyErr_NoMemory();
    }
    int64_t *shape = ctx->dims, *strides = ctx->dims + view->ndim;
    if (write_dims(shape, strides, view->shape, view->ndim) < 0) {
        export_free(ctx);
        PyErr_SetString(PyExc_BufferError, "the array's shape cannot be described with int64 strides");
        return NULL;
    }
    PyObject *cap;
    if (versioned) {
        DLManagedTensorVersioned *m = &ctx->t.versioned;
        fill_tensor(&m->dl_tensor, view, shape, strides);
        m->version = (DLPackVersion){DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
        m->manager_ctx = ctx;
        m->deleter = deleter_versioned;
        m->flags = view->flags;
        cap = PyCapsule_New(m, "dltensor_versioned", capsule_destructor);
    } else {
        DLManagedTensor *m = &ctx->t.legacy;
        fill_tensor(&m->dl_tensor, view, shape, strides);
        m->manager_ctx = ctx;
        m->deleter = deleter_legacy;
        cap = PyCapsule_New(m, "dltensor", capsule_destructor);
    }
    if (!cap)
        export_free(ctx);
    return cap;
}

/* ---- import: dtypes, the exporter's call, capsules ---- */

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

PyObject *pl_dlpack_call(PyObject *obj)
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

/* Note [consumed imports]
 * A capsule that __dlpack__ returned is consumed as the protocol says: renamed
 * "used_dltensor[_versioned]", its managed tensor now owned by the importer, who calls its
 * deleter when done. Left unconsumed among a leaf's owners, it could be consumed by someone
 * else that kept it (an exporter that hands the same capsule to two consumers), whose deleter
 * would free the memory while the staging threads still read it. The owner object is a capsule
 * of pinloader's own name whose destructor calls the deleter, with the GIL held, as dropping
 * the exporter's capsule did. */
static void consumed_destructor(PyObject *owner)
{
    DLManagedTensor *m = PyCapsule_GetPointer(owner, "pinloader.dltensor");
    if (m && m->deleter)
        m->deleter(m);
}

static void consumed_versioned_destructor(PyObject *owner)
{
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(owner, "pinloader.dltensor_versioned");
    if (m && m->deleter)
        m->deleter(m);
}

PyObject *pl_capsule_consume(PyObject *capsule, int versioned)
{
    const char *name = versioned ? "dltensor_versioned" : "dltensor";
    void *m = PyCapsule_GetPointer(capsule, name);
    if (!m)
        return NULL;
    PyObject *owner = versioned ? PyCapsule_New(m, "pinloader.dltensor_versioned", consumed_versioned_destructor)
                                : PyCapsule_New(m, "pinloader.dltensor", consumed_destructor);
    if (!owner)
        return NULL;
    if (PyCapsule_SetName(capsule, versioned ? "used_dltensor_versioned" : "used_dltensor") < 0) {
        /* not consumed: the exporter's capsule keeps the tensor; ours must not free it */
        PyCapsule_SetDestructor(owner, NULL);
        Py_DECREF(owner);
        return NULL;
    }
    return owner;
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
