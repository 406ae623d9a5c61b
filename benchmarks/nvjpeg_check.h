/* The stand-alone nvJPEG tools' checks (nvjpeg_contention.cu, nvjpeg_scale_probe.cu): a CUDA
 * runtime or nvJPEG call that fails prints the call, its line and the error, and ends the
 * program. Include after cuda_runtime.h and nvjpeg.h. */
#ifndef PL_BENCH_NVJPEG_CHECK_H
#define PL_BENCH_NVJPEG_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#define CK(x)                                                                                       \
    do {                                                                                            \
        cudaError_t e_ = (x);                                                                       \
        if (e_ != cudaSuccess) {                                                                    \
            fprintf(stderr, "%s (line %d): %s\n", #x, __LINE__, cudaGetErrorString(e_));            \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)
#define NK(x)                                                                                       \
    do {                                                                                            \
        nvjpegStatus_t s_ = (x);                                                                    \
        if (s_ != NVJPEG_STATUS_SUCCESS) {                                                          \
            fprintf(stderr, "%s (line %d): status %d\n", #x, __LINE__, (int)s_);                    \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)

#endif
