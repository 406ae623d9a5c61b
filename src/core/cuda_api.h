/* The subset of the CUDA runtime API that backend_cuda.c loads at run time, declared here so that
 * building pinloader needs no CUDA header: only a C compiler, Python's headers and NumPy.
 *
 * Note [our own CUDA declarations]
 * libcudart is opened with dlopen and every function is looked up with dlsym (see Note [finding
 * libcudart] in backend_cuda.c), so the build needs only the types, constants and signatures of
 * the ~30 functions used, never the library. Projects that load their driver this way declare
 * that subset themselves; so does this file. Every name carries a `pl_` prefix, so that
 * tests/cuda_api_check.c can include this file beside the toolkit's cuda_runtime_api.h and check,
 * at compile time, every enum value, every struct size and field offset, and every function
 * signature against the real header (CI compiles it wherever a toolkit exists).
 *
 * Struct layouts follow CUDA 13, which is also the largest of the versions pinloader supports:
 * cudaPointerAttributes grew `long reserved[8]` in CUDA 13 (a CUDA 12 runtime writes only the
 * first 24 bytes, a CUDA 13 runtime writes 88: ours has room for both); cudaMemPoolProps is 88
 * bytes in every version since CUDA 11.2. The symbols are the unversioned ones, as exported by
 * libcudart.so.12 and .13 (the legacy default-stream variants, not the _ptsz ones).
 *
 * Each function is listed once, in PL_CUDA_API(X, T): X(return type, name, parameters), with the
 * CUDA type names wrapped in T() (or TS() for struct tags), so that the same list builds the
 * function table here (T adds the prefix) and the signature checks in tests/cuda_api_check.c
 * (T keeps the real name). */
#ifndef PL_CUDA_API_H
#define PL_CUDA_API_H

#include <stddef.h>

/* ---- errors (enum cudaError): only the codes pinloader looks at ---- */
typedef enum pl_cudaError {
    pl_cudaSuccess = 0,
    pl_cudaErrorInvalidValue = 1,
    pl_cudaErrorMemoryAllocation = 2,
    pl_cudaErrorCudartUnloading = 4,
    pl_cudaErrorNoDevice = 100,
    pl_cudaErrorInvalidDevice = 101,
    pl_cudaErrorNotReady = 600,
    pl_cudaErrorHostMemoryAlreadyRegistered = 712,
    pl_cudaErrorUnknown = 999,
} pl_cudaError_t;

/* ---- opaque handles ---- */
typedef struct pl_CUstream_st *pl_cudaStream_t;
typedef struct pl_CUevent_st *pl_cudaEvent_t;
typedef struct pl_CUmemPoolHandle_st *pl_cudaMemPool_t;
typedef struct pl_CUlib_st *pl_cudaLibrary_t;
typedef struct pl_CUkern_st *pl_cudaKernel_t;

/* ---- flags (#defines in driver_types.h) ---- */
#define pl_cudaHostAllocPortable 0x01
#define pl_cudaHostAllocMapped 0x02
#define pl_cudaHostRegisterPortable 0x01
#define pl_cudaHostRegisterMapped 0x02
#define pl_cudaHostRegisterReadOnly 0x08
#define pl_cudaStreamNonBlocking 0x01
#define pl_cudaEventDisableTiming 0x02

/* ---- enums ---- */
enum pl_cudaMemcpyKind {
    pl_cudaMemcpyHostToHost = 0,
    pl_cudaMemcpyHostToDevice = 1,
    pl_cudaMemcpyDeviceToHost = 2,
    pl_cudaMemcpyDeviceToDevice = 3,
    pl_cudaMemcpyDefault = 4,
};

enum pl_cudaMemoryType {
    pl_cudaMemoryTypeUnregistered = 0,
    pl_cudaMemoryTypeHost = 1,
    pl_cudaMemoryTypeDevice = 2,
    pl_cudaMemoryTypeManaged = 3,
};

enum pl_cudaMemPoolAttr {
    pl_cudaMemPoolReuseFollowEventDependencies = 0x1,
    pl_cudaMemPoolReuseAllowOpportunistic = 0x2,
    pl_cudaMemPoolReuseAllowInternalDependencies = 0x3,
    pl_cudaMemPoolAttrReleaseThreshold = 0x4,
    pl_cudaMemPoolAttrReservedMemCurrent = 0x5,
};

enum pl_cudaMemAllocationType {
    pl_cudaMemAllocationTypeInvalid = 0x0,
    pl_cudaMemAllocationTypePinned = 0x1,
};

enum pl_cudaMemAllocationHandleType {
    pl_cudaMemHandleTypeNone = 0x0,
};

enum pl_cudaMemLocationType {
    pl_cudaMemLocationTypeInvalid = 0,
    pl_cudaMemLocationTypeDevice = 1,
};

/* Passed only as NULL arrays with a count of 0 (cudaLibraryLoadData). */
enum pl_cudaJitOption {
    pl_cudaJitMaxRegisters = 0,
};
enum pl_cudaLibraryOption {
    pl_cudaLibraryHostUniversalFunctionAndDataTable = 0,
};

enum pl_cudaStreamCaptureMode {
    pl_cudaStreamCaptureModeGlobal = 0,
    pl_cudaStreamCaptureModeThreadLocal = 1,
    pl_cudaStreamCaptureModeRelaxed = 2,
};

enum pl_cudaDeviceAttr {
    pl_cudaDevAttrMultiProcessorCount = 16,
    pl_cudaDevAttrHostRegisterReadOnlySupported = 113,
};

/* ---- structs ---- */
struct pl_dim3 {
    unsigned int x, y, z;
};

struct pl_cudaPointerAttributes {
    enum pl_cudaMemoryType type;
    int device;
    void *devicePointer;
    void *hostPointer;
    long reserved[8]; /* CUDA 13; must be zero */
};

struct pl_cudaMemLocation {
    enum pl_cudaMemLocationType type;
    int id;
};

struct pl_cudaMemPoolProps {
    enum pl_cudaMemAllocationType allocType;
    enum pl_cudaMemAllocationHandleType handleTypes;
    struct pl_cudaMemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;             /* CUDA 12.2; 0: the system's default */
    unsigned short usage;       /* CUDA 12.3 */
    unsigned char reserved[54]; /* must be zero */
};

typedef void (*pl_cudaHostFn_t)(void *userData);

/* ---- functions ---- */
#define PL_CUDA_API(X, T, TS)                                                                      \
    X(const char *, cudaGetErrorName, (T(cudaError_t) error))                                      \
    X(const char *, cudaGetErrorString, (T(cudaError_t) error))                                    \
    X(T(cudaError_t), cudaGetLastError, (void))                                                    \
    X(T(cudaError_t), cudaGetDeviceCount, (int *count))                                            \
    X(T(cudaError_t), cudaDriverGetVersion, (int *driverVersion))                                  \
    X(T(cudaError_t), cudaRuntimeGetVersion, (int *runtimeVersion))                                \
    X(T(cudaError_t), cudaSetDevice, (int device))                                                 \
    X(T(cudaError_t), cudaGetDevice, (int *device))                                                \
    X(T(cudaError_t), cudaDeviceGetPCIBusId, (char *pciBusId, int len, int device))                \
    X(T(cudaError_t), cudaDeviceGetStreamPriorityRange, (int *leastPriority, int *greatestPriority)) \
    X(T(cudaError_t), cudaStreamCreateWithPriority,                                                \
      (T(cudaStream_t) *pStream, unsigned int flags, int priority))                                \
    X(T(cudaError_t), cudaStreamDestroy, (T(cudaStream_t) stream))                                 \
    X(T(cudaError_t), cudaStreamSynchronize, (T(cudaStream_t) stream))                             \
    X(T(cudaError_t), cudaStreamWaitEvent,                                                         \
      (T(cudaStream_t) stream, T(cudaEvent_t) event, unsigned int flags))                          \
    X(T(cudaError_t), cudaEventCreateWithFlags, (T(cudaEvent_t) *event, unsigned int flags))       \
    X(T(cudaError_t), cudaEventDestroy, (T(cudaEvent_t) event))                                    \
    X(T(cudaError_t), cudaEventRecord, (T(cudaEvent_t) event, T(cudaStream_t) stream))             \
    X(T(cudaError_t), cudaEventQuery, (T(cudaEvent_t) event))                                      \
    X(T(cudaError_t), cudaEventSynchronize, (T(cudaEvent_t) event))                                \
    X(T(cudaError_t), cudaHostRegister, (void *ptr, size_t size, unsigned int flags))              \
    X(T(cudaError_t), cudaHostUnregister, (void *ptr))                                             \
    X(T(cudaError_t), cudaHostAlloc, (void **pHost, size_t size, unsigned int flags))              \
    X(T(cudaError_t), cudaFreeHost, (void *ptr))                                                   \
    X(T(cudaError_t), cudaPointerGetAttributes,                                                    \
      (struct TS(cudaPointerAttributes) *attributes, const void *ptr))                            \
    X(T(cudaError_t), cudaMemcpyAsync,                                                             \
      (void *dst, const void *src, size_t count, enum TS(cudaMemcpyKind) kind,                     \
       T(cudaStream_t) stream))                                                                    \
    X(T(cudaError_t), cudaMemsetAsync,                                                             \
      (void *devPtr, int value, size_t count, T(cudaStream_t) stream))                             \
    X(T(cudaError_t), cudaMemcpy,                                                                  \
      (void *dst, const void *src, size_t count, enum TS(cudaMemcpyKind) kind))                    \
    X(T(cudaError_t), cudaMemPoolCreate,                                                           \
      (T(cudaMemPool_t) *memPool, const struct TS(cudaMemPoolProps) *poolProps))                   \
    X(T(cudaError_t), cudaMemPoolSetAttribute,                                                     \
      (T(cudaMemPool_t) memPool, enum TS(cudaMemPoolAttr) attr, void *value))                      \
    X(T(cudaError_t), cudaMemPoolGetAttribute,                                                     \
      (T(cudaMemPool_t) memPool, enum TS(cudaMemPoolAttr) attr, void *value))                      \
    X(T(cudaError_t), cudaMallocFromPoolAsync,                                                     \
      (void **ptr, size_t size, T(cudaMemPool_t) memPool, T(cudaStream_t) stream))                 \
    X(T(cudaError_t), cudaFreeAsync, (void *devPtr, T(cudaStream_t) hStream))                      \
    X(T(cudaError_t), cudaLaunchHostFunc,                                                          \
      (T(cudaStream_t) stream, T(cudaHostFn_t) fn, void *userData))                               \
    X(T(cudaError_t), cudaHostGetDevicePointer, (void **pDevice, void *pHost, unsigned int flags)) \
    X(T(cudaError_t), cudaDeviceGetAttribute, (int *value, enum TS(cudaDeviceAttr) attr, int device)) \
    X(T(cudaError_t), cudaLaunchKernel,                                                            \
      (const void *func, struct TS(dim3) gridDim, struct TS(dim3) blockDim, void **args,           \
       size_t sharedMem, T(cudaStream_t) stream))                                                  \
    X(T(cudaError_t), cudaThreadExchangeStreamCaptureMode, (enum TS(cudaStreamCaptureMode) *mode))

/* Functions of newer runtimes (CUDA 12.0: library management), looked up separately: without
 * them only the device gather is unavailable (Note [device gather] in devgather.h). */
#define PL_CUDA_API_OPTIONAL(X, T, TS)                                                             \
    X(T(cudaError_t), cudaLibraryLoadData,                                                         \
      (T(cudaLibrary_t) *library, const void *code, enum TS(cudaJitOption) *jitOptions,            \
       void **jitOptionsValues, unsigned int numJitOptions,                                        \
       enum TS(cudaLibraryOption) *libraryOptions, void **libraryOptionValues,                     \
       unsigned int numLibraryOptions))                                                            \
    X(T(cudaError_t), cudaLibraryGetKernel,                                                        \
      (T(cudaKernel_t) *pKernel, T(cudaLibrary_t) library, const char *name))

/* The names this project uses: the prefixed ones. */
#define PL_CU_T(name) pl_##name
#define PL_CU_TS(name) pl_##name

#endif
