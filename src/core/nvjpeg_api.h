/* The subset of nvJPEG that jpeg_cuda.c loads at run time, declared here so that building
 * pinloader needs no nvJPEG header: the same arrangement as cuda_api.h (see Note [our own CUDA
 * declarations] there). Every name carries a `pl_` prefix; the values and layouts are those of
 * nvjpeg.h of CUDA 12 and 13, which agree on everything below.
 *
 * Each function is listed once, in PL_NVJPEG_API(X, T): X(return type, name, parameters), so that
 * the same list builds the function table of jpeg_cuda.c. */
#ifndef PL_NVJPEG_API_H
#define PL_NVJPEG_API_H

#include <stddef.h>

typedef enum pl_nvjpegStatus {
    pl_NVJPEG_STATUS_SUCCESS = 0,
    pl_NVJPEG_STATUS_NOT_INITIALIZED = 1,
    pl_NVJPEG_STATUS_INVALID_PARAMETER = 2,
    pl_NVJPEG_STATUS_BAD_JPEG = 3,
    pl_NVJPEG_STATUS_JPEG_NOT_SUPPORTED = 4,
    pl_NVJPEG_STATUS_ALLOCATOR_FAILURE = 5,
    pl_NVJPEG_STATUS_EXECUTION_FAILED = 6,
    pl_NVJPEG_STATUS_ARCH_MISMATCH = 7,
    pl_NVJPEG_STATUS_INTERNAL_ERROR = 8,
    pl_NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED = 9,
    pl_NVJPEG_STATUS_INCOMPLETE_BITSTREAM = 10,
} pl_nvjpegStatus_t;

typedef enum pl_nvjpegBackend {
    pl_NVJPEG_BACKEND_DEFAULT = 0,
    pl_NVJPEG_BACKEND_HYBRID = 1,
    pl_NVJPEG_BACKEND_GPU_HYBRID = 2,
    pl_NVJPEG_BACKEND_HARDWARE = 3,
} pl_nvjpegBackend_t;

/* nvjpegCreateEx's flags (nvjpeg.h's NVJPEG_FLAGS_*) */
#define PL_NVJPEG_FLAGS_HW_DECODE_NO_PIPELINE 1u
#define PL_NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION 32u

typedef enum pl_nvjpegOutputFormat {
    pl_NVJPEG_OUTPUT_RGBI = 5, /* interleaved RGB, one plane */
} pl_nvjpegOutputFormat_t;

/* libraryPropertyType (library_types.h) */
typedef enum pl_libraryPropertyType {
    pl_MAJOR_VERSION = 0,
    pl_MINOR_VERSION = 1,
    pl_PATCH_LEVEL = 2,
} pl_libraryPropertyType;

#define PL_NVJPEG_MAX_COMPONENT 4

typedef struct pl_nvjpegImage {
    unsigned char *channel[PL_NVJPEG_MAX_COMPONENT];
    size_t pitch[PL_NVJPEG_MAX_COMPONENT];
} pl_nvjpegImage_t;

typedef struct pl_nvjpegHandle *pl_nvjpegHandle_t;
typedef struct pl_nvjpegJpegState *pl_nvjpegJpegState_t;
typedef struct pl_nvjpegJpegStream *pl_nvjpegJpegStream_t;
typedef struct pl_nvjpegDecodeParams *pl_nvjpegDecodeParams_t;
/* cudaStream_t, as nvJPEG takes it */
typedef struct pl_CUstream_st *pl_nvjpeg_cudaStream_t;

#define PL_NVJPEG_API(X)                                                                           \
    X(pl_nvjpegStatus_t, nvjpegGetProperty, (pl_libraryPropertyType type, int *value))             \
    X(pl_nvjpegStatus_t, nvjpegCreateEx,                                                           \
      (pl_nvjpegBackend_t backend, void *dev_allocator, void *pinned_allocator, unsigned int flags, \
       pl_nvjpegHandle_t *handle))                                                                 \
    X(pl_nvjpegStatus_t, nvjpegDestroy, (pl_nvjpegHandle_t handle))                                \
    X(pl_nvjpegStatus_t, nvjpegGetHardwareDecoderInfo,                                             \
      (pl_nvjpegHandle_t handle, unsigned int *num_engines, unsigned int *num_cores_per_engine))   \
    X(pl_nvjpegStatus_t, nvjpegJpegStateCreate,                                                    \
      (pl_nvjpegHandle_t handle, pl_nvjpegJpegState_t *state))                                     \
    X(pl_nvjpegStatus_t, nvjpegJpegStateDestroy, (pl_nvjpegJpegState_t state))                     \
    X(pl_nvjpegStatus_t, nvjpegDecode,                                                             \
      (pl_nvjpegHandle_t handle, pl_nvjpegJpegState_t state, const unsigned char *data,            \
       size_t length, pl_nvjpegOutputFormat_t output_format, pl_nvjpegImage_t *destination,        \
       pl_nvjpeg_cudaStream_t stream))                                                             \
    X(pl_nvjpegStatus_t, nvjpegDecodeBatchedInitialize,                                            \
      (pl_nvjpegHandle_t handle, pl_nvjpegJpegState_t state, int batch_size, int max_cpu_threads,  \
       pl_nvjpegOutputFormat_t output_format))                                                     \
    X(pl_nvjpegStatus_t, nvjpegDecodeBatched,                                                      \
      (pl_nvjpegHandle_t handle, pl_nvjpegJpegState_t state, const unsigned char *const *data,     \
       const size_t *lengths, pl_nvjpegImage_t *destinations, pl_nvjpeg_cudaStream_t stream))      \
    X(pl_nvjpegStatus_t, nvjpegJpegStreamCreate,                                                   \
      (pl_nvjpegHandle_t handle, pl_nvjpegJpegStream_t *jpeg_stream))                              \
    X(pl_nvjpegStatus_t, nvjpegJpegStreamDestroy, (pl_nvjpegJpegStream_t jpeg_stream))             \
    X(pl_nvjpegStatus_t, nvjpegJpegStreamParseHeader,                                              \
      (pl_nvjpegHandle_t handle, const unsigned char *data, size_t length,                         \
       pl_nvjpegJpegStream_t jpeg_stream))                                                         \
    X(pl_nvjpegStatus_t, nvjpegJpegStreamGetFrameDimensions,                                       \
      (pl_nvjpegJpegStream_t jpeg_stream, unsigned int *width, unsigned int *height))              \
    X(pl_nvjpegStatus_t, nvjpegJpegStreamGetComponentsNum,                                         \
      (pl_nvjpegJpegStream_t jpeg_stream, unsigned int *components_num))                           \
    X(pl_nvjpegStatus_t, nvjpegDecodeBatchedSupported,                                             \
      (pl_nvjpegHandle_t handle, pl_nvjpegJpegStream_t jpeg_stream, int *is_supported))           \
    X(pl_nvjpegStatus_t, nvjpegDecodeParamsCreate,                                                 \
      (pl_nvjpegHandle_t handle, pl_nvjpegDecodeParams_t *decode_params))                          \
    X(pl_nvjpegStatus_t, nvjpegDecodeParamsDestroy, (pl_nvjpegDecodeParams_t decode_params))       \
    X(pl_nvjpegStatus_t, nvjpegDecodeParamsSetOutputFormat,                                        \
      (pl_nvjpegDecodeParams_t decode_params, pl_nvjpegOutputFormat_t output_format))              \
    X(pl_nvjpegStatus_t, nvjpegDecodeParamsSetROI,                                                 \
      (pl_nvjpegDecodeParams_t decode_params, int offset_x, int offset_y, int roi_width,           \
       int roi_height))                                                                            \
    X(pl_nvjpegStatus_t, nvjpegDecodeBatchedSupportedEx,                                           \
      (pl_nvjpegHandle_t handle, pl_nvjpegJpegStream_t jpeg_stream,                                \
       pl_nvjpegDecodeParams_t decode_params, int *is_supported))                                  \
    X(pl_nvjpegStatus_t, nvjpegDecodeBatchedEx,                                                    \
      (pl_nvjpegHandle_t handle, pl_nvjpegJpegState_t state, const unsigned char *const *data,     \
       const size_t *lengths, pl_nvjpegImage_t *destinations,                                      \
       pl_nvjpegDecodeParams_t *decode_params, pl_nvjpeg_cudaStream_t stream))

/* The functions, filled by pl_nvjpeg_load (nvjpeg_load.c) */
typedef struct pl_nvjpeg_fns {
#define X(ret, name, params) ret(*name) params;
    PL_NVJPEG_API(X)
#undef X
} pl_nvjpeg_fns;
extern pl_nvjpeg_fns pl_nj;

/* Loads nvJPEG once per process (later calls return at once): the first libnvjpeg already in the
 * process, then the loader's search path, then libs. PL_OK (backend.h's codes), or
 * PL_ERR_NO_RUNTIME with *why a sentence. */
int pl_nvjpeg_load(const char *const *libs, int nlibs, const char **why);
const char *pl_nvjpeg_status_name(pl_nvjpegStatus_t s);
/* A decoder: a handle of backend made with flags, and with
 * NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION where interp is set and nvJPEG takes it (*interpolated
 * then 1; Note [interpolated chroma] in nvjpeg_load.c), and a decoding state of it. On failure
 * *h and *state are NULL and *what names the nvJPEG call that failed, whose status is returned. */
pl_nvjpegStatus_t pl_nvjpeg_make_decoder(pl_nvjpegBackend_t backend, unsigned flags, int interp, pl_nvjpegHandle_t *h,
                                         pl_nvjpegJpegState_t *state, int *interpolated, const char **what);
/* Destroys what pl_nvjpeg_make_decoder made; either may be NULL. */
void pl_nvjpeg_destroy_decoder(pl_nvjpegHandle_t h, pl_nvjpegJpegState_t state);

#endif
