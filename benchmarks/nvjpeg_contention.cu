// How long nvJPEG's hardware batched decode holds the calling thread when the GPU is busy
// (Note [the engines' call beside training] in src/core/jpeg_cuda.c).
//
//   python3 benchmarks/nvjpeg_contention_images.py /tmp/ncimg 256
//   nvcc -O2 -o /tmp/nvjpeg_contention benchmarks/nvjpeg_contention.cu -lnvjpeg
//   /tmp/nvjpeg_contention /tmp/ncimg/*.jpg
//
// Part 1, for five output formats, pageable and pinned input: the call's host time on an idle
// GPU, with one 40-ms kernel filling every SM on another stream, and with a 40-ms one-warp kernel
// queued before it on its own stream. Part 2, with and without NVJPEG_FLAGS_HW_DECODE_NO_PIPELINE,
// batches of 32/128/256 images: idle, and behind 600 kernels of 0.1 ms that fill every SM on
// another stream (a training step's kernels, queued ahead). Part 3, both ways, 256 images behind
// the same 600 kernels on a non-blocking stream, on the legacy default stream (where torch runs a
// model unless told otherwise) and on a blocking stream. Part 4 (part4() says what it does):
//   PARTS=4 ncu --profile-from-start off --print-summary per-kernel /tmp/nvjpeg_contention ...
// PARTS=23 runs parts 2 and 3 only. Run
// it with CUDA_DEVICE_MAX_CONNECTIONS unset (the driver's 8 hardware work queues) and =32: the
// pipelined call's wait is the queues' (Note [hardware work queues] in src/core/backend_cuda.c).
// Each line: the mean of 5 calls after one warm-up (min-max), and the time until the decode's
// stream is done. A stand-alone tool: it includes nvjpeg.h and links libnvjpeg, where pinloader
// loads nvJPEG at run time.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <math.h>
#include <nvjpeg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nvjpeg_check.h"

enum { MAX_IMAGES = 1024 };
enum { IDLE, SMS_BUSY, QUEUED_ON_ITS_STREAM, KERNEL_TRAIN, KERNEL_TRAIN_LEGACY, KERNEL_TRAIN_BLOCKING };
static const char *const MODE_NAME[] = {"idle", "every SM busy 40 ms on another stream",
                                        "40 ms kernel queued first on its stream",
                                        "600 x 0.1 ms kernels on another stream",
                                        "600 x 0.1 ms kernels on the legacy default stream",
                                        "600 x 0.1 ms kernels on a blocking stream"};

__global__ void spin(long long cycles)
{
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int n_images;
static const unsigned char *data[MAX_IMAGES], *pinned_data[MAX_IMAGES];
static size_t len[MAX_IMAGES];
static int widths[MAX_IMAGES][NVJPEG_MAX_COMPONENT], heights[MAX_IMAGES][NVJPEG_MAX_COMPONENT];
static int comps[MAX_IMAGES];
static void *planes[MAX_IMAGES][3];
static nvjpegHandle_t hw;
static nvjpegJpegState_t state;
static nvjpegDecodeParams_t params[MAX_IMAGES];
static cudaStream_t stream, other, blocking;
static long long cycles_per_ms;
static int sms;

static void make_decoder(unsigned flags)
{
    NK(nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, NULL, NULL, flags, &hw));
    NK(nvjpegJpegStateCreate(hw, &state));
    for (int i = 0; i < n_images; i++)
        NK(nvjpegDecodeParamsCreate(hw, &params[i]));
}

static void destroy_decoder(void)
{
    for (int i = 0; i < n_images; i++)
        NK(nvjpegDecodeParamsDestroy(params[i]));
    NK(nvjpegJpegStateDestroy(state));
    NK(nvjpegDestroy(hw));
}

/* One call of n images in format f after setting up `mode`; returns the call's host time and the
 * time until its stream is done. */
static void decode_once(nvjpegOutputFormat_t f, int n, int mode, int pinned, double *call, double *done)
{
    static nvjpegImage_t dst[MAX_IMAGES];
    for (int i = 0; i < n; i++) {
        NK(nvjpegDecodeParamsSetOutputFormat(params[i], f));
        memset(&dst[i], 0, sizeof dst[i]);
        const int interleaved = f == NVJPEG_OUTPUT_RGBI || f == NVJPEG_OUTPUT_BGRI;
        const int n_planes = interleaved || f == NVJPEG_OUTPUT_Y ? 1 : 3;
        for (int c = 0; c < n_planes; c++) {
            dst[i].channel[c] = (unsigned char *)planes[i][c];
            /* YUV keeps each component's own (subsampled) width */
            const int w = f == NVJPEG_OUTPUT_YUV && c < comps[i] ? widths[i][c] : widths[i][0];
            dst[i].pitch[c] = (size_t)w * (interleaved ? 3 : 1);
        }
    }
    CK(cudaDeviceSynchronize());
    if (mode == SMS_BUSY)
        spin<<<sms * 2, 1024, 0, other>>>(cycles_per_ms * 40);
    else if (mode == QUEUED_ON_ITS_STREAM)
        spin<<<1, 32, 0, stream>>>(cycles_per_ms * 40);
    else if (mode >= KERNEL_TRAIN) {
        /* where a training step's kernels go: a non-blocking stream; the legacy default stream
         * (torch's default: every blocking stream and every synchronous copy waits for it); a
         * stream made with cudaStreamCreate's default flags */
        cudaStream_t s = mode == KERNEL_TRAIN ? other : mode == KERNEL_TRAIN_LEGACY ? cudaStreamLegacy : blocking;
        for (int k = 0; k < 600; k++)
            spin<<<sms * 2, 1024, 0, s>>>(cycles_per_ms / 10);
    }
    CK(cudaGetLastError());
    const double t0 = now_ms();
    NK(nvjpegDecodeBatchedInitialize(hw, state, n, 1, f));
    NK(nvjpegDecodeBatchedEx(hw, state, pinned ? pinned_data : data, len, dst, params, stream));
    const double t1 = now_ms();
    CK(cudaStreamSynchronize(stream));
    *call = t1 - t0;
    *done = now_ms() - t0;
    CK(cudaDeviceSynchronize());
}

static void measure(const char *label, nvjpegOutputFormat_t f, int n, int mode, int pinned)
{
    double call, done, sum = 0, sum_done = 0, lo = 1e30, hi = 0;
    decode_once(f, n, mode, pinned, &call, &done); /* warm-up */
    for (int r = 0; r < 5; r++) {
        decode_once(f, n, mode, pinned, &call, &done);
        sum += call;
        sum_done += done;
        lo = call < lo ? call : lo;
        hi = call > hi ? call : hi;
    }
    printf("%s, %-50s: call %.2f ms (%.2f-%.2f), to stream done %.2f ms\n", label, MODE_NAME[mode], sum / 5,
           lo, hi, sum_done / 5);
}

/* Part 4: what each output format costs, and how the engines make RGB from YUV. Each format's
 * call (no pipeline, idle GPU) runs between cudaProfilerStart and cudaProfilerStop, so
 * `ncu --profile-from-start off` lists the kernels nvJPEG launches for it (its copies are not
 * kernels: benchmarks/prof_images.py shows those). Then, for up to 16 images, the RGBI output is
 * compared with RGB made here from the same images' YUV output, with nearest-neighbour chroma and
 * with a triangle (bilinear) upsampling like libjpeg's "fancy" one, in floating point
 * (benchmarks/results/h100_2026-12-06d). */
static unsigned char clamp8(double v)
{
    v = floor(v + 0.5);
    return (unsigned char)(v < 0 ? 0 : v > 255 ? 255 : v);
}

static void part4(void)
{
    destroy_decoder();
    make_decoder(NVJPEG_FLAGS_HW_DECODE_NO_PIPELINE);
    static const struct {
        nvjpegOutputFormat_t f;
        const char *name;
    } fm[] = {{NVJPEG_OUTPUT_RGBI, "RGBI"}, {NVJPEG_OUTPUT_RGB, "RGB"}, {NVJPEG_OUTPUT_YUV, "YUV"},
              {NVJPEG_OUTPUT_Y, "Y"}};
    for (size_t k = 0; k < sizeof fm / sizeof fm[0]; k++) {
        double call, done;
        decode_once(fm[k].f, n_images, IDLE, 0, &call, &done); /* warm-up */
        CK(cudaProfilerStart());
        decode_once(fm[k].f, n_images, IDLE, 0, &call, &done);
        CK(cudaProfilerStop());
        printf("part 4, %-4s, %d images: call %.2f ms, to stream done %.2f ms\n", fm[k].name, n_images, call, done);
    }
    /* conversion probe */
    const int m = n_images < 16 ? n_images : 16;
    double worst[2] = {0, 0}, sum[2] = {0, 0};
    long long count = 0, off[2] = {0, 0};
    for (int i = 0; i < m; i++) {
        if (comps[i] != 3)
            continue;
        const int W = widths[i][0], H = heights[i][0], cw = widths[i][1], ch = heights[i][1];
        unsigned char *rgb = (unsigned char *)malloc((size_t)W * H * 3), *y = (unsigned char *)malloc((size_t)W * H),
                      *u = (unsigned char *)malloc((size_t)cw * ch), *v = (unsigned char *)malloc((size_t)cw * ch);
        double call, done;
        decode_once(NVJPEG_OUTPUT_RGBI, i + 1, IDLE, 0, &call, &done);
        CK(cudaMemcpy(rgb, planes[i][0], (size_t)W * H * 3, cudaMemcpyDeviceToHost));
        decode_once(NVJPEG_OUTPUT_YUV, i + 1, IDLE, 0, &call, &done);
        CK(cudaMemcpy(y, planes[i][0], (size_t)W * H, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(u, planes[i][1], (size_t)cw * ch, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(v, planes[i][2], (size_t)cw * ch, cudaMemcpyDeviceToHost));
        const int sx = (W + cw - 1) / cw, sy = (H + ch - 1) / ch;
        if (i < 4)
            printf("part 4, image %d: %dx%d, chroma %dx%d (1/%d x 1/%d)\n", i, W, H, cw, ch, sx, sy);
        for (int r = 0; r < H; r++)
            for (int c = 0; c < W; c++) {
                double cb[2], cr[2];
                /* nearest */
                cb[0] = u[(r / sy) * cw + c / sx];
                cr[0] = v[(r / sy) * cw + c / sx];
                /* triangle: the chroma sample centres at (k + 0.5) * s - 0.5 */
                double fx = (c + 0.5) / sx - 0.5, fy = (r + 0.5) / sy - 0.5;
                int x0 = (int)floor(fx), y0 = (int)floor(fy);
                double tx = fx - x0, ty = fy - y0;
                int x1 = x0 + 1 < cw ? x0 + 1 : cw - 1, y1 = y0 + 1 < ch ? y0 + 1 : ch - 1;
                x0 = x0 < 0 ? 0 : x0;
                y0 = y0 < 0 ? 0 : y0;
                const unsigned char *P[2] = {u, v};
                double out[2];
                for (int q = 0; q < 2; q++)
                    out[q] = (1 - ty) * ((1 - tx) * P[q][y0 * cw + x0] + tx * P[q][y0 * cw + x1]) +
                             ty * ((1 - tx) * P[q][y1 * cw + x0] + tx * P[q][y1 * cw + x1]);
                cb[1] = out[0];
                cr[1] = out[1];
                const double Y = y[r * W + c];
                for (int k = 0; k < 2; k++) {
                    const unsigned char R = clamp8(Y + 1.402 * (cr[k] - 128));
                    const unsigned char G = clamp8(Y - 0.344136 * (cb[k] - 128) - 0.714136 * (cr[k] - 128));
                    const unsigned char B = clamp8(Y + 1.772 * (cb[k] - 128));
                    const unsigned char *g = rgb + ((size_t)r * W + c) * 3;
                    const int d[3] = {abs(R - g[0]), abs(G - g[1]), abs(B - g[2])};
                    for (int q = 0; q < 3; q++) {
                        worst[k] = d[q] > worst[k] ? d[q] : worst[k];
                        sum[k] += d[q];
                        off[k] += d[q] > 1;
                    }
                }
                count += 3;
            }
        free(rgb), free(y), free(u), free(v);
    }
    if (count)
        for (int k = 0; k < 2; k++)
            printf("part 4, RGBI against YUV converted here, %s chroma: max %.0f, mean %.4f, %.4f%% off by >1\n",
                   k ? "triangle" : "nearest", worst[k], sum[k] / count, 100.0 * off[k] / count);
}

int main(int argc, char **argv)
{
    n_images = argc - 1 < MAX_IMAGES ? argc - 1 : MAX_IMAGES;
    if (n_images < 1) {
        fprintf(stderr, "usage: %s IMAGE.jpg ...\n", argv[0]);
        return 2;
    }
    size_t total = 0;
    for (int i = 0; i < n_images; i++) {
        FILE *fp = fopen(argv[i + 1], "rb");
        if (!fp || fseek(fp, 0, SEEK_END) != 0) {
            fprintf(stderr, "cannot read %s\n", argv[i + 1]);
            return 1;
        }
        long size = ftell(fp);
        unsigned char *p = (unsigned char *)malloc(size > 0 ? (size_t)size : 1);
        if (size <= 0 || !p || fseek(fp, 0, SEEK_SET) != 0 || fread(p, 1, (size_t)size, fp) != (size_t)size) {
            fprintf(stderr, "cannot read %s\n", argv[i + 1]);
            return 1;
        }
        fclose(fp);
        data[i] = p;
        len[i] = (size_t)size;
        total += len[i];
    }
    CK(cudaSetDevice(0));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
    CK(cudaStreamCreate(&blocking));
    {
        /* the SM clock, from a timed spin */
        cudaEvent_t a, b;
        float ms;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        spin<<<1, 32>>>(1000);
        CK(cudaEventRecord(a));
        spin<<<1, 32>>>(20000000);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        CK(cudaEventElapsedTime(&ms, a, b));
        cycles_per_ms = (long long)(20000000 / ms);
    }
    make_decoder(0);
    unsigned engines = 0, cores = 0;
    NK(nvjpegGetHardwareDecoderInfo(hw, &engines, &cores));
    for (int i = 0; i < n_images; i++) {
        nvjpegChromaSubsampling_t ss;
        NK(nvjpegGetImageInfo(hw, data[i], len[i], &comps[i], &ss, widths[i], heights[i]));
        for (int c = 0; c < 3; c++)
            CK(cudaMalloc(&planes[i][c], (size_t)widths[i][0] * heights[i][0] * 3));
    }
    unsigned char *pin;
    CK(cudaMallocHost((void **)&pin, total));
    for (size_t i = 0, off = 0; i < (size_t)n_images; off += len[i], i++) {
        memcpy(pin + off, data[i], len[i]);
        pinned_data[i] = pin + off;
    }
    printf("SM clock %.0f MHz, %d SMs; JPEG engines %u x %u cores; %d images, %.1f KB on average\n",
           cycles_per_ms / 1e3, sms, engines, cores, n_images, total / 1024.0 / n_images);

    static const struct {
        nvjpegOutputFormat_t f;
        const char *name;
    } formats[] = {{NVJPEG_OUTPUT_RGBI, "RGBI"}, {NVJPEG_OUTPUT_RGB, "RGB"}, {NVJPEG_OUTPUT_YUV, "YUV"},
                   {NVJPEG_OUTPUT_Y, "Y"}, {NVJPEG_OUTPUT_BGRI, "BGRI"}};
    /* PARTS=23 runs parts 2 and 3 only (default: all four) */
    const char *parts = getenv("PARTS");
#define WANT(c) (!parts || strchr(parts, c))
    if (WANT('1')) {
        printf("# part 1: output formats, pipelined (flags 0), %d images a call\n", n_images);
        for (int pinned = 0; pinned < 2; pinned++)
            for (size_t k = 0; k < sizeof formats / sizeof formats[0]; k++)
                for (int mode = IDLE; mode <= QUEUED_ON_ITS_STREAM; mode++) {
                    char label[64];
                    snprintf(label, sizeof label, "%s input, %-5s", pinned ? "pinned  " : "pageable", formats[k].name);
                    measure(label, formats[k].f, n_images, mode, pinned);
                }
    }
    if (WANT('2')) {
        printf("# part 2: NVJPEG_FLAGS_HW_DECODE_NO_PIPELINE off (flags 0) and on (flags 1), RGBI, pageable\n");
        for (unsigned flags = 0; flags < 2; flags++) {
            if (flags) {
                destroy_decoder();
                make_decoder(NVJPEG_FLAGS_HW_DECODE_NO_PIPELINE);
            }
            const int sizes[] = {32, 128, 256};
            for (int z = 0; z < 3; z++) {
                const int n = sizes[z] < n_images ? sizes[z] : n_images;
                char label[64];
                snprintf(label, sizeof label, "flags %u, %3d images", flags, n);
                measure(label, NVJPEG_OUTPUT_RGBI, n, IDLE, 0);
                measure(label, NVJPEG_OUTPUT_RGBI, n, KERNEL_TRAIN, 0);
            }
        }
    }
    if (WANT('3')) {
        printf("# part 3: where the other work is queued, 256 images, RGBI, pageable\n");
        for (unsigned flags = 0; flags < 2; flags++) {
            destroy_decoder();
            make_decoder(flags ? NVJPEG_FLAGS_HW_DECODE_NO_PIPELINE : 0);
            const int n = 256 < n_images ? 256 : n_images;
            char label[64];
            snprintf(label, sizeof label, "flags %u, %3d images", flags, n);
            for (int mode = KERNEL_TRAIN; mode <= KERNEL_TRAIN_BLOCKING; mode++)
                measure(label, NVJPEG_OUTPUT_RGBI, n, mode, 0);
        }
    }
    if (WANT('4'))
        part4();
    destroy_decoder();
    return 0;
}
