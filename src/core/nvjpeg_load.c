/* nvJPEG loaded at run time (nvjpeg_api.h): the function table and the library's status names.
 * No Python. */
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
