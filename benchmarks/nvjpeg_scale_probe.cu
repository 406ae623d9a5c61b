// Two nvJPEG hardware-backend features the GPU decoder (src/core/jpeg_cuda.c) does not use yet,
// measured alone:
//   - the engines' own downscale (nvjpegDecodeParamsSetScaleFactor: 1/2, 1/4, 1/8), which a crop
//     much larger than the output could use;
//   - NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION: chroma upsampled by interpolation in the
//     conversion to RGB, where the engines' RGB takes the nearest chroma sample (part of the
//     documented difference between the GPU's pixels and libjpeg-turbo's).
//
//   python3 benchmarks/nvjpeg_scale_probe.py /tmp/nsp          # makes the images, builds, runs, compares
//
// For each flag setting and scale: one batched hardware call of every image (RGB interleaved,
// pageable input), one warm-up, then the mean host time of the call and the time until its stream
// is done over 5 calls; a decode that fails prints its status and the run goes on. At scale 1 and
// 1/4 the decoded pixels of the first DUMPED images are written to OUT_DIR as raw RGB for the
// comparison with Pillow (the script); at 1/2 to 1/8 every output buffer is filled with a 0xAB
// sentinel first, and the bytes of the first DUMPED images that differ from it afterwards are
// counted and printed. A stand-alone tool: it includes nvjpeg.h and links libnvjpeg, where
// pinloader loads nvJPEG at run time.
#include <cuda_runtime.h>
#include <nvjpeg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nvjpeg_check.h"

enum { MAX_IMAGES = 512, DUMPED = 3, CALLS = 5 };

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int n_images;
static const unsigned char *data[MAX_IMAGES];
static size_t len[MAX_IMAGES];
static int width[MAX_IMAGES], height[MAX_IMAGES], ow[MAX_IMAGES], oh[MAX_IMAGES];
static unsigned char *out[MAX_IMAGES]; /* room for the full-size RGB image */
static nvjpegImage_t dst[MAX_IMAGES];

static unsigned char *read_file(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        exit(1);
    }
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = (unsigned char *)malloc((size_t)sz);
    if (!b || fread(b, 1, (size_t)sz, f) != (size_t)sz) {
        fprintf(stderr, "%s: cannot read\n", path);
        exit(1);
    }
    fclose(f);
    *n = (size_t)sz;
    return b;
}

/* One setting: flags, scale (0..3); `dump` writes the first DUMPED images to dir. */
static void run(nvjpegHandle_t probe, unsigned flags, int scale, int roi, const char *dir, const char *label)
{
    nvjpegHandle_t hw;
    nvjpegStatus_t s = nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, NULL, NULL, flags, &hw);
    if (s != NVJPEG_STATUS_SUCCESS) {
        printf("%s flags=%u scale=1/%d: nvjpegCreateEx status %d\n", label, flags, 1 << scale, (int)s);
        return;
    }
    nvjpegJpegState_t state;
    NK(nvjpegJpegStateCreate(hw, &state));
    static nvjpegDecodeParams_t params[MAX_IMAGES];
    const int r = 1 << scale;
    for (int i = 0; i < n_images; i++) {
        NK(nvjpegDecodeParamsCreate(hw, &params[i]));
        NK(nvjpegDecodeParamsSetOutputFormat(params[i], NVJPEG_OUTPUT_RGBI));
        s = nvjpegDecodeParamsSetScaleFactor(params[i], (nvjpegScaleFactor_t)scale);
        if (s != NVJPEG_STATUS_SUCCESS) {
            printf("%s flags=%u scale=1/%d%s: nvjpegDecodeParamsSetScaleFactor status %d\n", label, flags, r,
                   roi ? " roi" : "", (int)s);
            goto done;
        }
        /* roi: the central half of each side, its corner on the 16-pixel grid */
        const int rx = roi ? (width[i] / 4) & ~15 : 0, ry = roi ? (height[i] / 4) & ~15 : 0;
        const int rw = roi ? width[i] / 2 : width[i], rh = roi ? height[i] / 2 : height[i];
        ow[i] = (rw + r - 1) / r;
        oh[i] = (rh + r - 1) / r;
        if (roi && (s = nvjpegDecodeParamsSetROI(params[i], rx, ry, rw, rh)) != NVJPEG_STATUS_SUCCESS) {
            printf("%s flags=%u scale=1/%d roi: nvjpegDecodeParamsSetROI status %d\n", label, flags, r, (int)s);
            goto done;
        }
        memset(&dst[i], 0, sizeof dst[i]);
        dst[i].channel[0] = out[i];
        dst[i].pitch[0] = (size_t)ow[i] * 3;
    }
    {
        cudaStream_t stream;
        CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        double call = 0, total = 0;
        int ok = 1;
        /* a sentinel in every output buffer first: the dump counts the bytes the decode wrote */
        for (int i = 0; i < n_images; i++)
            CK(cudaMemset(out[i], 0xAB, (size_t)width[i] * 3 * (size_t)height[i]));
        for (int k = 0; k <= CALLS && ok; k++) {
            CK(cudaDeviceSynchronize());
            const double t0 = now_ms();
            s = nvjpegDecodeBatchedInitialize(hw, state, n_images, 1, NVJPEG_OUTPUT_RGBI);
            if (s == NVJPEG_STATUS_SUCCESS)
                s = nvjpegDecodeBatchedEx(hw, state, data, len, dst, params, stream);
            const double t1 = now_ms();
            const cudaError_t ce = cudaStreamSynchronize(stream);
            if (s != NVJPEG_STATUS_SUCCESS || ce != cudaSuccess) {
                printf("%s flags=%u scale=1/%d%s: decode status %d, stream %s\n", label, flags, r,
                       roi ? " roi" : "", (int)s, cudaGetErrorString(ce));
                ok = 0;
                break;
            }
            if (k) {
                call += t1 - t0;
                total += now_ms() - t0;
            }
        }
        if (ok) {
            printf("%s flags=%u scale=1/%d%s: %d images, call %.2f ms, done %.2f ms, %.0f images/s\n", label,
                   flags, r, roi ? " roi" : "", n_images, call / CALLS, total / CALLS,
                   n_images / (total / CALLS) * 1e3);
            const int m = n_images < DUMPED ? n_images : DUMPED;
            for (int i = 0; i < m && scale; i++) {
                /* which bytes of the full-size buffer the reduced decode wrote: the rows and
                 * columns it covered (assumed ow x oh at pitch ow * 3) */
                const size_t all = (size_t)width[i] * 3 * (size_t)height[i];
                unsigned char *host = (unsigned char *)malloc(all);
                CK(cudaMemcpy(host, out[i], all, cudaMemcpyDeviceToHost));
                size_t written = 0, last = 0;
                for (size_t b = 0; b < all; b++)
                    if (host[b] != 0xAB) {
                        written++;
                        last = b;
                    }
                printf("%s flags=%u scale=1/%d%s image %d (%dx%d): %zu bytes differ from the sentinel, the last at %zu; "
                       "expected %dx%d x 3 = %zu\n", label, flags, r, roi ? " roi" : "", i, width[i], height[i], written,
                       last, ow[i], oh[i], (size_t)ow[i] * 3 * (size_t)oh[i]);
                free(host);
            }
            for (int i = 0; dir && i < m; i++) {
                const int w = ow[i], h = oh[i];
                const size_t bytes = (size_t)w * 3 * (size_t)h;
                unsigned char *host = (unsigned char *)malloc(bytes);
                CK(cudaMemcpy(host, out[i], bytes, cudaMemcpyDeviceToHost));
                char path[4096];
                snprintf(path, sizeof path, "%s/%s%s_f%u_s%d_%d_%dx%d.rgb", dir, label, roi ? "roi" : "", flags, r, i,
                         w, h);
                FILE *f = fopen(path, "wb");
                if (f) {
                    fwrite(host, 1, bytes, f);
                    fclose(f);
                }
                free(host);
            }
        }
        CK(cudaStreamDestroy(stream));
    }
done:
    for (int i = 0; i < n_images; i++)
        if (params[i])
            nvjpegDecodeParamsDestroy(params[i]);
    memset(params, 0, sizeof params);
    nvjpegJpegStateDestroy(state);
    nvjpegDestroy(hw);
    (void)probe;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: %s LABEL OUT_DIR FILE.jpg...\n", argv[0]);
        return 2;
    }
    const char *label = argv[1], *dir = argv[2];
    n_images = argc - 3 < MAX_IMAGES ? argc - 3 : MAX_IMAGES;
    nvjpegHandle_t probe;
    NK(nvjpegCreateSimple(&probe));
    for (int i = 0; i < n_images; i++) {
        data[i] = read_file(argv[3 + i], &len[i]);
        int nc, ws[NVJPEG_MAX_COMPONENT], hs[NVJPEG_MAX_COMPONENT];
        nvjpegChromaSubsampling_t css;
        NK(nvjpegGetImageInfo(probe, data[i], len[i], &nc, &css, ws, hs));
        width[i] = ws[0];
        height[i] = hs[0];
        CK(cudaMalloc((void **)&out[i], (size_t)ws[0] * 3 * (size_t)hs[0]));
    }
    const unsigned flag_sets[2] = {0u, NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION};
    for (int f = 0; f < 2; f++)
        for (int scale = 0; scale < 4; scale++)
            for (int roi = 0; roi < 2; roi++)
                run(probe, flag_sets[f], scale, roi, scale == 0 || scale == 2 ? dir : NULL, label);
    for (int i = 0; i < n_images; i++)
        CK(cudaFree(out[i]));
    NK(nvjpegDestroy(probe));
    return 0;
}
