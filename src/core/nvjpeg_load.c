/* nvJPEG loaded at run time (nvjpeg_api.h): the function table, the library's status names, and
 * handles made with interpolated chroma where nvJPEG takes it. No Python. */
#include "nvjpeg_api.h"

#include "backend.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

pl_nvjpeg_fns pl_nj;

static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static int loaded;              /* guarded by load_mu; 1 once pl_nj is filled */
static char load_why[512];      /* guarded by load_mu */

static const char *const nj_sonames[] = {"libnvjpeg.so.13", "libnvjpeg.so.12", "libnvjpeg.so"};

static int fill_table(void *h)
{
#define X(ret, name, params)                                                                       \
    if (!(*(void **)&pl_nj.name = dlsym(h, #name)))                                                   \
        return -1;
    PL_NVJPEG_API(X)
#undef X
    return 0;
}

/* The first libnvjpeg already in the process (torchvision loads one), then the loader's search
 * path, then the caller's candidates. */
int pl_nvjpeg_load(const char *const *libs, int nlibs, const char **why)
{
    pthread_mutex_lock(&load_mu);
    if (loaded) {
        pthread_mutex_unlock(&load_mu);
        return PL_OK;
    }
    void *h = NULL;
    for (size_t i = 0; !h && i < sizeof nj_sonames / sizeof *nj_sonames; i++)
        h = dlopen(nj_sonames[i], RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    for (size_t i = 0; !h && i < sizeof nj_sonames / sizeof *nj_sonames; i++)
        h = dlopen(nj_sonames[i], RTLD_NOW | RTLD_LOCAL);
    for (int i = 0; !h && i < nlibs; i++)
        h = dlopen(libs[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(load_why, sizeof load_why,
                 "no nvJPEG library found (libnvjpeg.so.13 or .12: install the nvidia-nvjpeg wheel, "
                 "pip install 'pinloader[cuda]', or a CUDA toolkit)");
        *why = load_why;
        pthread_mutex_unlock(&load_mu);
        return PL_ERR_NO_RUNTIME;
    }
    if (fill_table(h) < 0) {
        snprintf(load_why, sizeof load_why, "the nvJPEG library found lacks a function pinloader uses");
        memset(&pl_nj, 0, sizeof pl_nj);
        dlclose(h);
        *why = load_why;
        pthread_mutex_unlock(&load_mu);
        return PL_ERR_NO_RUNTIME;
    }
    loaded = 1;
    pthread_mutex_unlock(&load_mu);
    return PL_OK;
}

const char *pl_nvjpeg_status_name(pl_nvjpegStatus_t s)
{
    switch (s) {
    case pl_NVJPEG_STATUS_SUCCESS: return "NVJPEG_STATUS_SUCCESS";
    case pl_NVJPEG_STATUS_NOT_INITIALIZED: return "NVJPEG_STATUS_NOT_INITIALIZED";
    case pl_NVJPEG_STATUS_INVALID_PARAMETER: return "NVJPEG_STATUS_INVALID_PARAMETER";
    case pl_NVJPEG_STATUS_BAD_JPEG: return "NVJPEG_STATUS_BAD_JPEG";
    case pl_NVJPEG_STATUS_JPEG_NOT_SUPPORTED: return "NVJPEG_STATUS_JPEG_NOT_SUPPORTED";
    case pl_NVJPEG_STATUS_ALLOCATOR_FAILURE: return "NVJPEG_STATUS_ALLOCATOR_FAILURE";
    case pl_NVJPEG_STATUS_EXECUTION_FAILED: return "NVJPEG_STATUS_EXECUTION_FAILED";
    case pl_NVJPEG_STATUS_ARCH_MISMATCH: return "NVJPEG_STATUS_ARCH_MISMATCH";
    case pl_NVJPEG_STATUS_INTERNAL_ERROR: return "NVJPEG_STATUS_INTERNAL_ERROR";
    case pl_NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED: return "NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED";
    case pl_NVJPEG_STATUS_INCOMPLETE_BITSTREAM: return "NVJPEG_STATUS_INCOMPLETE_BITSTREAM";
    }
    return "an unknown nvJPEG status";
}

/* Note [interpolated chroma]
 * In a 4:2:0 or 4:2:2 JPEG each chroma sample covers two or four pixels. libjpeg-turbo (Pillow's
 * decoder, the host backend's) interpolates between the nearest chroma samples ("fancy
 * upsampling"); nvJPEG's hardware engines repeat the nearest one unless the handle is made with
 * NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION. On an H100 the engines' images were a mean of
 * 0.14-0.94 levels and up to 34 from Pillow's without the flag, and a mean of 0.000 and at most 1
 * with it, and whole-image decodes were no slower (benchmarks/results/h100_2026-12-06g/README.md).
 * So every handle is made with the flag, and again without it where an nvJPEG refuses it; a
 * decoder made with interpolate = 0 (ImageLoader: PINLOADER_JPEG_INTERPOLATE=0) leaves it off,
 * to measure. info()["chroma_interpolated"] says whether the engines (without engines, the CUDA
 * decoder) got it, that is, that nvJPEG took a handle made with it: an nvJPEG that accepted the
 * flag and ignored it would be reported as interpolating (measured honouring it: nvJPEG 13.0 on
 * an H100). Whether nvJPEG's CUDA decoder (the images the engines refuse) honours it is not
 * measured. */
static pl_nvjpegStatus_t make_handle(pl_nvjpegBackend_t backend, unsigned flags, int interp, pl_nvjpegHandle_t *h,
                                     int *interpolated)
{
    if (interp && pl_nj.nvjpegCreateEx(backend, NULL, NULL, flags | PL_NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION, h) ==
                      pl_NVJPEG_STATUS_SUCCESS) {
        *interpolated = 1;
        return pl_NVJPEG_STATUS_SUCCESS;
    }
    *h = NULL;
    pl_nvjpegStatus_t s = pl_nj.nvjpegCreateEx(backend, NULL, NULL, flags, h);
    if (s != pl_NVJPEG_STATUS_SUCCESS)
        *h = NULL;
    return s;
}

pl_nvjpegStatus_t pl_nvjpeg_make_decoder(pl_nvjpegBackend_t backend, unsigned flags, int interp, pl_nvjpegHandle_t *h,
                                         pl_nvjpegJpegState_t *state, int *interpolated, const char **what)
{
    *h = NULL;
    *state = NULL;
    *interpolated = 0;
    pl_nvjpegStatus_t s = make_handle(backend, flags, interp, h, interpolated);
    if (s != pl_NVJPEG_STATUS_SUCCESS) {
        *what = "nvjpegCreateEx";
        return s;
    }
    if ((s = pl_nj.nvjpegJpegStateCreate(*h, state)) != pl_NVJPEG_STATUS_SUCCESS) {
        *what = "nvjpegJpegStateCreate";
        pl_nj.nvjpegDestroy(*h);
        *h = NULL;
        *state = NULL;
        *interpolated = 0;
    }
    return s;
}

void pl_nvjpeg_destroy_decoder(pl_nvjpegHandle_t h, pl_nvjpegJpegState_t state)
{
    if (state)
        pl_nj.nvjpegJpegStateDestroy(state);
    if (h)
        pl_nj.nvjpegDestroy(h);
}
