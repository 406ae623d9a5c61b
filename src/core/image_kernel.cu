/* The image kernels: a decoded RGB image's box, resized with an antialiased bilinear filter,
 * flipped, scaled and cast into one sample of a batch. Built by tools/gen_gather_kernels.py into
 * src/core/image_kernel_image.h, which backend_cuda.c loads at run time; setup.py never compiles
 * this file. jpeg_cuda.c sets up the launches (Note [image resampling] there).
 *
 * Note [resampling like Pillow]
 * The filter is Pillow's (libImaging/Resample.c): a triangle of support max(scale, 1) around
 * each output pixel's centre in the box, weights normalised to sum 1 and rounded to 22-bit
 * fixed point, a horizontal pass into 8-bit rows and then a vertical pass, each rounding to 8
 * bits. torchvision's resized_crop on PIL images is this arithmetic (crop, then resize), so on
 * the same decoded pixels the GPU and the host backend agree to the bit where Pillow takes its
 * passes in this order; recent Pillow releases take first the pass that shrinks more, and where
 * that is the vertical one a value can differ by one level (tests/test_image_kernel_host.py
 * compares both ways). The
 * weights are computed in double precision with the round-to-nearest intrinsics, which keep
 * the compiler from fusing a multiply and an add into one rounding: Pillow's C, on x86-64,
 * rounds each operation, and a weight that lands on the other side of a fixed-point step would
 * change a pixel.
 *
 * Note [weight tables]
 * A tap's weight depends on the output column (horizontal pass) or row (vertical pass) only,
 * never on the other coordinate, so a first kernel (pl_image_w) computes each sample's weights
 * once, one thread per output column and row, and the two passes read them from the sample's
 * table (coef) instead of recomputing them for every pixel in double precision (which bounded
 * the vertical pass on an H100, and would cost far more on GPUs with few FP64 units). A table
 * holds, for the ow output columns, their first input column, their tap count and their weights
 * tap-major (a warp's threads, consecutive columns, read consecutive words), then for each of
 * the oh output rows its first input row, its tap count and its weights. A resize from `in` to
 * `out` has at most pl_image_taps(in, out) taps (src/core/image_rows.h, Pillow's own bound);
 * kh and kv are the sample's. A horizontal-pass thread makes PL_IMAGE_GROUP (image_rows.h) rows
 * of one column, which share its weights; every output's sum runs over its taps in order, as
 * Pillow's does. */

#include <cuda_fp16.h>

#include "image_rows.h"

struct pl_img_desc {
    const unsigned char *src; /* the decoded image, interleaved RGB; NULL: zero the sample */
    unsigned char *tmp;       /* the horizontal pass's rows: ny rows of ow pixels */
    int *coef;                /* the sample's weight table: Note [weight tables] */
    long long src_pitch;      /* bytes per row of src */
    int top, left, h, w;      /* the box in src: the image the filter sees */
    int rh, rw;               /* the box's size after the resize */
    int oy, ox;               /* the output window's corner in the resized box */
    int y_first, ny;          /* the box rows the vertical pass reads */
    int flip;                 /* mirror the output horizontally */
    int kh, kv;               /* the table's taps per output column and per output row */
    int pad;
};

struct pl_img_affine {
    float scale[3], bias[3]; /* out = value * scale[c] + bias[c] */
};

#define PL_PRECISION_BITS 22

/* Pillow's precompute_coeffs for output index xx of a resize from in_size to out_size:
 * the first input index *xmin, the count *n and the weight sum *ww. */
__device__ __forceinline__ void span(int in_size, int out_size, int xx, int *xmin, int *n,
                                     double *center_out, double *ss_out)
{
    const double scale = __ddiv_rn((double)in_size, (double)out_size);
    const double filterscale = scale < 1.0 ? 1.0 : scale;
    const double support = filterscale; /* the bilinear filter's support is 1 */
    const double center = __dmul_rn(__dadd_rn((double)xx, 0.5), scale);
    int lo = (int)__dadd_rn(__dsub_rn(center, support), 0.5);
    if (lo < 0)
        lo = 0;
    int hi = (int)__dadd_rn(__dadd_rn(center, support), 0.5);
    if (hi > in_size)
        hi = in_size;
    *xmin = lo;
    *n = hi - lo;
    *center_out = center;
    *ss_out = __ddiv_rn(1.0, filterscale);
}

__device__ __forceinline__ double tri(int x, double center, double ss)
{
    double t = __dmul_rn(__dadd_rn(__dsub_rn((double)x, center), 0.5), ss);
    if (t < 0.0)
        t = -t;
    return t < 1.0 ? __dsub_rn(1.0, t) : 0.0;
}

__device__ __forceinline__ double weight_sum(int xmin, int n, double center, double ss)
{
    double ww = 0.0;
    for (int x = 0; x < n; x++)
        ww = __dadd_rn(ww, tri(x + xmin, center, ss));
    return ww;
}

/* Pillow's normalize_coeffs_8bpc for one weight. */
__device__ __forceinline__ int fixed_weight(double w, double ww)
{
    if (ww != 0.0)
        w = __ddiv_rn(w, ww);
    const double f = __dmul_rn(w, (double)(1 << PL_PRECISION_BITS));
    return w < 0.0 ? (int)__dadd_rn(-0.5, f) : (int)__dadd_rn(0.5, f);
}

__device__ __forceinline__ unsigned char clip8(int ss)
{
    ss >>= PL_PRECISION_BITS;
    return (unsigned char)(ss < 0 ? 0 : ss > 255 ? 255 : ss);
}

/* The weight tables (Note [weight tables]): one thread per output column (i < ow) and output row
 * (ow <= i < ow + oh) of each sample; blockIdx.y is the sample. */
extern "C" __global__ void __launch_bounds__(256)
    pl_image_w(const pl_img_desc *descs, int oh, int ow)
{
    const pl_img_desc d = descs[blockIdx.y];
    if (!d.src)
        return;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)ow + oh;
         i += (long long)gridDim.x * blockDim.x) {
        const bool column = i < ow;
        int first, n;
        double center, ss;
        if (column)
            span(d.w, d.rw, (int)i + d.ox, &first, &n, &center, &ss);
        else
            span(d.h, d.rh, (int)(i - ow) + d.oy, &first, &n, &center, &ss);
        const int k = column ? d.kh : d.kv;
        if (n > k)
            n = k; /* never: n <= 2 * ceil(support) + 1 (floor(c + s + 0.5) - floor(c - s + 0.5),
                    * with a last-bit error far below a quotient's distance to an integer); it
                    * only keeps the writes inside the table */
        const double ww = weight_sum(first, n, center, ss);
        int *w; /* the first weight; consecutive weights are `step` words apart */
        long long step;
        if (column) {
            d.coef[i] = first;
            d.coef[ow + i] = n;
            w = d.coef + 2LL * ow + i;
            step = ow;
        } else {
            int *row = d.coef + (long long)ow * (2 + d.kh) + (i - ow) * (2 + d.kv);
            row[0] = first;
            row[1] = n;
            w = row + 2;
            step = 1;
        }
        for (int x = 0; x < n; x++)
            w[x * step] = fixed_weight(tri(x + first, center, ss), ww);
    }
}

/* Horizontal pass: rows r (0 <= r < ny) of tmp, output columns ox .. ox + ow - 1 of the
 * resized box. One thread per column and group of PL_IMAGE_GROUP rows; blockIdx.y is the sample. */
extern "C" __global__ void __launch_bounds__(256)
    pl_image_h(const pl_img_desc *descs, int ow)
{
    const pl_img_desc d = descs[blockIdx.y];
    if (!d.src)
        return;
    const long long total = (long long)((d.ny + PL_IMAGE_GROUP - 1) / PL_IMAGE_GROUP) * ow;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int g = (int)(i / ow), c = (int)(i - (long long)g * ow);
        const int r0 = g * PL_IMAGE_GROUP, rows = min(PL_IMAGE_GROUP, d.ny - r0);
        const int xmin = d.coef[c], n = d.coef[ow + c];
        const int *w = d.coef + 2LL * ow + c;
        const unsigned char *first =
            d.src + (long long)(d.top + d.y_first + r0) * d.src_pitch + (long long)(d.left + xmin) * 3;
        int s[PL_IMAGE_GROUP][3];
#pragma unroll
        for (int j = 0; j < PL_IMAGE_GROUP; j++)
            s[j][0] = s[j][1] = s[j][2] = 1 << (PL_PRECISION_BITS - 1);
        for (int x = 0; x < n; x++) {
            const int k = w[(long long)x * ow];
#pragma unroll
            for (int j = 0; j < PL_IMAGE_GROUP; j++) {
                if (j < rows) {
                    const unsigned char *p = first + (long long)j * d.src_pitch + 3 * x;
                    s[j][0] += p[0] * k;
                    s[j][1] += p[1] * k;
                    s[j][2] += p[2] * k;
                }
            }
        }
#pragma unroll
        for (int j = 0; j < PL_IMAGE_GROUP; j++) {
            if (j < rows) {
                unsigned char *o = d.tmp + ((long long)(r0 + j) * ow + c) * 3;
                o[0] = clip8(s[j][0]);
                o[1] = clip8(s[j][1]);
                o[2] = clip8(s[j][2]);
            }
        }
    }
}

template <typename T> __device__ __forceinline__ T cast_out(float v);
template <> __device__ __forceinline__ unsigned char cast_out<unsigned char>(float v)
{
    return (unsigned char)__float2uint_rn(fminf(fmaxf(v, 0.0f), 255.0f));
}
template <> __device__ __forceinline__ float cast_out<float>(float v) { return v; }
template <> __device__ __forceinline__ unsigned short cast_out<unsigned short>(float v)
{
    return __half_as_ushort(__float2half_rn(v));
}
struct pl_bf16 {
    unsigned short bits;
};
template <> __device__ __forceinline__ pl_bf16 cast_out<pl_bf16>(float v)
{
    /* round to nearest even, NaN kept a quiet NaN */
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return pl_bf16{(unsigned short)((u >> 16) | 0x40)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return pl_bf16{(unsigned short)(u >> 16)};
}

/* Vertical pass and the sample's output: one thread per output pixel (three channels). */
template <typename T>
__device__ __forceinline__ void vertical(const pl_img_desc *descs, T *out, int oh, int ow,
                                         int channels_last, pl_img_affine a)
{
    const pl_img_desc d = descs[blockIdx.y];
    const long long plane = (long long)oh * ow;
    T *o = out + (long long)blockIdx.y * plane * 3;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < plane;
         i += (long long)gridDim.x * blockDim.x) {
        const int y = (int)(i / ow), x = (int)(i - (long long)y * ow);
        unsigned char v[3] = {0, 0, 0};
        const bool live = d.src != 0;
        if (live) {
            const int *row = d.coef + (long long)ow * (2 + d.kh) + (long long)y * (2 + d.kv);
            const int ymin = row[0], n = row[1];
            const unsigned char *col = d.tmp + ((long long)(ymin - d.y_first) * ow + x) * 3;
            int s0 = 1 << (PL_PRECISION_BITS - 1), s1 = s0, s2 = s0;
            for (int j = 0; j < n; j++) {
                const int k = row[2 + j];
                const unsigned char *p = col + (long long)j * ow * 3;
                s0 += p[0] * k;
                s1 += p[1] * k;
                s2 += p[2] * k;
            }
            v[0] = clip8(s0);
            v[1] = clip8(s1);
            v[2] = clip8(s2);
        }
        const int xo = d.flip ? ow - 1 - x : x;
        for (int c = 0; c < 3; c++) {
            /* two roundings, as the host backend's NumPy makes them: no fused multiply-add */
            const float f = live ? __fadd_rn(__fmul_rn((float)v[c], a.scale[c]), a.bias[c]) : 0.0f;
            const T t = live ? cast_out<T>(f) : T{};
            if (channels_last)
                o[((long long)y * ow + xo) * 3 + c] = t;
            else
                o[(long long)c * plane + (long long)y * ow + xo] = t;
        }
    }
}

#define PL_IMAGE_V(name, T)                                                                        \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        name(const pl_img_desc *descs, T *out, int oh, int ow, int channels_last, pl_img_affine a) \
    {                                                                                              \
        vertical<T>(descs, out, oh, ow, channels_last, a);                                         \
    }

PL_IMAGE_V(pl_image_v_u8, unsigned char)
PL_IMAGE_V(pl_image_v_f32, float)
PL_IMAGE_V(pl_image_v_f16, unsigned short)
PL_IMAGE_V(pl_image_v_bf16, pl_bf16)
