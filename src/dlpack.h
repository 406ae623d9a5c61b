/* The DLPack ABI (version 1.3), written from the public specification.
 *
 * Only the declarations pinloader uses; layout checked by static assertions below so a
 * mismatch with the specification fails the build rather than a consumer. */
#ifndef PL_DLPACK_H
#define PL_DLPACK_H

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

#endif
