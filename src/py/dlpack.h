/* DLPack: the ABI (version 1.3, written from the public specification) and pinloader's export
 * side (dlpack.c), shared by every object that implements __dlpack__ (PinnedBuffer in
 * pinned_buffer.c, DeviceArray in device_array.c).
 *
 * Only the declarations pinloader uses; layout checked by static assertions below so a
 * mismatch with the specification fails the build rather than a consumer. */
#ifndef PL_DLPACK_H
#define PL_DLPACK_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <stddef.h>
#include <stdint.h>

#define DLPACK_MAJOR_VERSION 1
#define DLPACK_MINOR_VERSION 3

#define DLPACK_FLAG_BITMASK_READ_ONLY (1ULL << 0)
#define DLPACK_FLAG_BITMASK_IS_COPIED (1ULL << 1)

typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3,
    kDLROCM = 10,
    kDLROCMHost = 11,
    kDLCUDAManaged = 13,
} DLDeviceType;

typedef enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLOpaqueHandle = 3,
    kDLBfloat = 4,
    kDLComplex = 5,
    kDLBool = 6,
    kDLFloat8_e3m4 = 7,
    kDLFloat8_e4m3 = 8,
    kDLFloat8_e4m3b11fnuz = 9,
    kDLFloat8_e4m3fn = 10,
    kDLFloat8_e4m3fnuz = 11,
    kDLFloat8_e5m2 = 12,
    kDLFloat8_e5m2fnuz = 13,
    kDLFloat8_e8m0fnu = 14,
} DLDataTypeCode;

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

_Static_assert(sizeof(DLTensor) == 48, "DLTensor layout");
_Static_assert(offsetof(DLTensor, shape) == 24, "DLTensor.shape offset");
_Static_assert(offsetof(DLTensor, byte_offset) == 40, "DLTensor.byte_offset offset");
_Static_assert(sizeof(DLManagedTensor) == 64, "DLManagedTensor layout");
_Static_assert(offsetof(DLManagedTensor, deleter) == 56, "DLManagedTensor.deleter offset");
_Static_assert(sizeof(DLManagedTensorVersioned) == 80, "DLManagedTensorVersioned layout");
_Static_assert(offsetof(DLManagedTensorVersioned, flags) == 24, "flags offset");
_Static_assert(offsetof(DLManagedTensorVersioned, dl_tensor) == 32, "dl_tensor offset");

/* ---- export: argument parsing (dlpack.c) ----
 *
 * Every function below returns 0, or -1 with an exception set: TypeError for an argument of
 * the wrong type, ValueError for a value DLPack does not define, BufferError for a well-formed
 * request the exporter cannot serve (as the DLPack Python specification asks). */

/* What a consumer asked of __dlpack__ besides the stream. */
typedef struct {
    int versioned;   /* max_version's major >= 1: a "dltensor_versioned" capsule, else "dltensor" */
    int has_device;  /* dl_device was given ... */
    DLDevice device; /* ... as this (device_type, device_id) */
    int copy;        /* copy=: -1 None, 0 False, 1 True */
} pl_dlpack_request;

/* Parse max_version (None or a (major, minor) tuple of ints; any int range), dl_device (None
 * or a 2-tuple of ints; values outside int32 are BufferError: no such device can be served)
 * and copy (None or a bool). "int" here is anything with __index__ except bool (an IntEnum,
 * a NumPy integer); the stream (pl_dlpack_parse_stream) must be a plain int. */
int pl_dlpack_parse_request(PyObject *max_version, PyObject *dl_device, PyObject *copy,
                            pl_dlpack_request *req);

/* Check a parsed request against the exporter's one device: dl_device must name `here` (or
 * `alias`, when alias.device_type != 0: pinned memory answers to both kDLCUDAHost and kDLCPU),
 * and copy=True is refused (pinloader never copies on export). `who` names the exporter in
 * the BufferError. */
int pl_dlpack_check_request(const pl_dlpack_request *req, DLDevice here, DLDevice alias,
                            const char *who);

/* The stream argument of __dlpack__.
 *   kind PL_DLPACK_SYNC: make `handle` wait (CUDA: None gives the legacy default stream 1;
 *                        2 is the per-thread default stream; >2 a cudaStream_t)
 *   kind PL_DLPACK_NO_SYNC: stream=-1, the consumer synchronises itself
 * For host memory (cuda == 0) only None and -1 are accepted (BufferError otherwise) and
 * handle is NULL. stream=0 is ambiguous for CUDA and raises ValueError; so does any other
 * negative value or one that does not fit a pointer; bool and non-int types raise TypeError. */
typedef enum { PL_DLPACK_SYNC = 0, PL_DLPACK_NO_SYNC = 1 } pl_dlpack_stream_kind;
typedef struct {
    pl_dlpack_stream_kind kind;
    void *handle;
} pl_dlpack_stream;

int pl_dlpack_parse_stream(PyObject *stream, int cuda, const char *who, pl_dlpack_stream *out);

/* ---- export: capsules (dlpack.c) ---- */

/* Releases what an export holds (block or region references). Called exactly once, from the
 * consumer's deleter or the capsule's destructor: on any thread, with or without the GIL,
 * maybe during interpreter shutdown or after the CUDA runtime began unloading. It must not
 * touch Python and must tolerate backend failures. See Note [export deleters] in dlpack.c. */
typedef void (*pl_dlpack_release_fn)(void *owner);

/* A C-contiguous tensor to export. The capsule writes explicit canonical strides (1 for size-1
 * dimensions) and byte_offset 0; data points at the first element (NULL for size 0). */
typedef struct {
    void *data;
    DLDevice device; /* as written into the capsule */
    DLDataType dtype;
    int ndim;
    const int64_t *shape; /* copied; may be NULL when ndim is 0 */
    uint64_t flags;       /* DLPACK_FLAG_BITMASK_*, versioned capsules only */
} pl_dlpack_view;

/* A new "dltensor" (versioned == 0) or "dltensor_versioned" capsule over view. The export keeps
 * a copy of the owner_size bytes at `owner` (the references the caller took for it) and calls
 * release on that copy when the consumer's deleter runs, or when the capsule is dropped
 * unconsumed. On failure returns NULL with an exception set, having called release already:
 * either way the caller's references belong to the export once this is called. */
PyObject *pl_dlpack_export(const pl_dlpack_view *view, int versioned, const void *owner,
                           size_t owner_size, pl_dlpack_release_fn release);

/* ---- import: dtypes, the exporter's call, capsules (dlpack.c) ---- */

/* Map a NumPy dtype (kind, itemsize, type number, byte order) to DLPack. Returns 0, or -1 with
 * *why set (no exception). */
int pl_dtype_from_numpy(char kind, int elsize, int type_num, char byteorder, DLDataType *out,
                        const char **why);
/* 0 if pinloader can copy dt, else -1 with *why set (no exception). */
int pl_dtype_valid(DLDataType dt, const char **why);
/* obj.__dlpack__(max_version=(DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION)), or the call without
 * arguments where the exporter refuses the keyword (TypeError). New reference, or NULL with the
 * exporter's exception set. */
PyObject *pl_dlpack_call(PyObject *obj);
/* Read a DLPack capsule (either name) without consuming it (pl_capsule_consume does). */
int pl_capsule_tensor(PyObject *capsule, DLTensor **t, int *versioned);
/* Consume a capsule pl_capsule_tensor read (Note [consumed imports] in dlpack.c): rename it
 * "used_dltensor[_versioned]" and return a new object that owns its managed tensor (its
 * deleter runs when that object is dropped), or NULL with an exception. */
PyObject *pl_capsule_consume(PyObject *capsule, int versioned);

#endif
