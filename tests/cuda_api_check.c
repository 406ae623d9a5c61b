/* Compile-time check of src/core/cuda_api.h against a CUDA toolkit's own headers (see
 * Note [our own CUDA declarations] in src/core/cuda_api.h). It has no run-time part: compiling it is
 * the test. tests/test_packaging.py and .ci/run compile it wherever a toolkit exists:
 *
 *   cc -std=gnu11 -fsyntax-only -Isrc -I$CUDA_HOME/include tests/cuda_api_check.c
 *
 * Checked: every enum value and #define the project uses, the size and signedness of each enum
 * type, the size and every field offset of each struct, and that every function in
 * PL_CUDA_API has the toolkit's exact signature (with the project's types standing in for the
 * toolkit's, whose layouts the first checks establish). */
#include <cuda_runtime_api.h>
#include <stddef.h>

#include "cuda_api.h"

/* Comparing two enums' values, and an unsigned enum with 0, is the point here. */
#pragma GCC diagnostic ignored "-Wtype-limits"
#define SAME(a, b) _Static_assert((long long)(a) == (long long)(b), #a " != " #b)
#define SAME_VALUE(name) SAME(pl_##name, name)
#define SAME_ENUM_TYPE(ours, theirs)                                                               \
    SAME(sizeof(ours), sizeof(theirs));                                                            \
    SAME((ours)-1 < (ours)0, (theirs)-1 < (theirs)0)
#define SAME_FIELD(tag, field)                                                                     \
    SAME(offsetof(struct pl_##tag, field), offsetof(struct tag, field));                           \
    SAME(sizeof(((struct pl_##tag *)0)->field), sizeof(((struct tag *)0)->field))

/* enum values and flags */
SAME_VALUE(cudaSuccess);
SAME_VALUE(cudaErrorInvalidValue);
SAME_VALUE(cudaErrorMemoryAllocation);
SAME_VALUE(cudaErrorCudartUnloading);
SAME_VALUE(cudaErrorNoDevice);
SAME_VALUE(cudaErrorInvalidDevice);
SAME_VALUE(cudaErrorNotReady);
SAME_VALUE(cudaErrorUnknown);
SAME_VALUE(cudaHostAllocPortable);
SAME_VALUE(cudaHostAllocMapped);
SAME_VALUE(cudaHostRegisterPortable);
SAME_VALUE(cudaHostRegisterMapped);
SAME_VALUE(cudaHostRegisterReadOnly);
SAME_VALUE(cudaErrorHostMemoryAlreadyRegistered);
SAME_VALUE(cudaJitMaxRegisters);
SAME_VALUE(cudaLibraryHostUniversalFunctionAndDataTable);
SAME_VALUE(cudaDevAttrMultiProcessorCount);
SAME_VALUE(cudaDevAttrHostRegisterReadOnlySupported);
SAME_VALUE(cudaStreamNonBlocking);
SAME_VALUE(cudaStreamCaptureModeGlobal);
SAME_VALUE(cudaStreamCaptureModeThreadLocal);
SAME_VALUE(cudaStreamCaptureModeRelaxed);
SAME_VALUE(cudaEventDisableTiming);
SAME_VALUE(cudaMemcpyHostToHost);
SAME_VALUE(cudaMemcpyHostToDevice);
SAME_VALUE(cudaMemcpyDeviceToHost);
SAME_VALUE(cudaMemcpyDeviceToDevice);
SAME_VALUE(cudaMemcpyDefault);
SAME_VALUE(cudaMemoryTypeUnregistered);
SAME_VALUE(cudaMemoryTypeHost);
SAME_VALUE(cudaMemoryTypeDevice);
SAME_VALUE(cudaMemoryTypeManaged);
SAME_VALUE(cudaMemPoolReuseFollowEventDependencies);
SAME_VALUE(cudaMemPoolReuseAllowOpportunistic);
SAME_VALUE(cudaMemPoolReuseAllowInternalDependencies);
SAME_VALUE(cudaMemPoolAttrReleaseThreshold);
SAME_VALUE(cudaMemPoolAttrReservedMemCurrent);
SAME_VALUE(cudaMemAllocationTypeInvalid);
SAME_VALUE(cudaMemAllocationTypePinned);
SAME_VALUE(cudaMemHandleTypeNone);
SAME_VALUE(cudaMemLocationTypeInvalid);
SAME_VALUE(cudaMemLocationTypeDevice);

/* enum types: same size and signedness, so they pass the same way through a call */
SAME_ENUM_TYPE(pl_cudaError_t, cudaError_t);
SAME_ENUM_TYPE(enum pl_cudaMemcpyKind, enum cudaMemcpyKind);
SAME_ENUM_TYPE(enum pl_cudaMemoryType, enum cudaMemoryType);
SAME_ENUM_TYPE(enum pl_cudaMemPoolAttr, enum cudaMemPoolAttr);
SAME_ENUM_TYPE(enum pl_cudaMemAllocationType, enum cudaMemAllocationType);
SAME_ENUM_TYPE(enum pl_cudaMemAllocationHandleType, enum cudaMemAllocationHandleType);
SAME_ENUM_TYPE(enum pl_cudaMemLocationType, enum cudaMemLocationType);
SAME_ENUM_TYPE(enum pl_cudaJitOption, enum cudaJitOption);
SAME_ENUM_TYPE(enum pl_cudaLibraryOption, enum cudaLibraryOption);
SAME_ENUM_TYPE(enum pl_cudaDeviceAttr, enum cudaDeviceAttr);
SAME_ENUM_TYPE(enum pl_cudaStreamCaptureMode, enum cudaStreamCaptureMode);

/* handles */
SAME(sizeof(pl_cudaStream_t), sizeof(cudaStream_t));
SAME(sizeof(pl_cudaEvent_t), sizeof(cudaEvent_t));
SAME(sizeof(pl_cudaMemPool_t), sizeof(cudaMemPool_t));
SAME(sizeof(pl_cudaLibrary_t), sizeof(cudaLibrary_t));
SAME(sizeof(pl_cudaKernel_t), sizeof(cudaKernel_t));
SAME(sizeof(struct pl_dim3), sizeof(struct dim3));
SAME_FIELD(dim3, x);
SAME_FIELD(dim3, y);
SAME_FIELD(dim3, z);

/* structs: size and every field */
SAME(sizeof(struct pl_cudaPointerAttributes), sizeof(struct cudaPointerAttributes));
SAME_FIELD(cudaPointerAttributes, type);
SAME_FIELD(cudaPointerAttributes, device);
SAME_FIELD(cudaPointerAttributes, devicePointer);
SAME_FIELD(cudaPointerAttributes, hostPointer);
#if CUDART_VERSION >= 13000
SAME_FIELD(cudaPointerAttributes, reserved);
#endif
SAME(sizeof(struct pl_cudaMemLocation), sizeof(struct cudaMemLocation));
SAME_FIELD(cudaMemLocation, type);
SAME_FIELD(cudaMemLocation, id);
SAME(sizeof(struct pl_cudaMemPoolProps), sizeof(struct cudaMemPoolProps));
SAME_FIELD(cudaMemPoolProps, allocType);
SAME_FIELD(cudaMemPoolProps, handleTypes);
SAME_FIELD(cudaMemPoolProps, location);
SAME_FIELD(cudaMemPoolProps, win32SecurityAttributes);
#if CUDART_VERSION >= 12030
SAME_FIELD(cudaMemPoolProps, maxSize);
SAME_FIELD(cudaMemPoolProps, usage);
SAME_FIELD(cudaMemPoolProps, reserved);
#endif

/* functions: the list in cuda_api.h, with the toolkit's type names, against the toolkit's
 * declarations (parameter count, order, pointer levels, constness, integer widths). */
#define REAL(name) name
#define CHECK_SIGNATURE(ret, name, params)                                                         \
    _Static_assert(__builtin_types_compatible_p(__typeof__(&name), ret(*) params),                 \
                   "the signature of " #name " differs from the toolkit's");
PL_CUDA_API(CHECK_SIGNATURE, REAL, REAL)
PL_CUDA_API_OPTIONAL(CHECK_SIGNATURE, REAL, REAL)
_Static_assert(__builtin_types_compatible_p(pl_cudaHostFn_t, void (*)(void *)), "cudaHostFn_t");
_Static_assert(__builtin_types_compatible_p(cudaHostFn_t, void (*)(void *)), "cudaHostFn_t");

/* and the same list with the project's own types is what backend_cuda.c calls through */
#define OURS(ret, name, params) ret(*ours_##name) params;
struct ours {
    PL_CUDA_API(OURS, PL_CU_T, PL_CU_TS)
    PL_CUDA_API_OPTIONAL(OURS, PL_CU_T, PL_CU_TS)
};
