/* The image kernels of src/core/image_kernel.cu run on the host: the CUDA source compiled as C++
 * with the few CUDA names it uses defined here (and tests/cuda_shim/cuda_fp16.h), each launch
 * run thread by thread over its grid. tests/test_image_kernel_host.py builds it (with ASan and
 * UBSan where the compiler has them, so an access outside a sample's image, rows or weight table
 * is an error) and checks its batches against Pillow: the kernels' logic, indexing and arithmetic,
 * on any machine. Built with -ffp-contract=off, every float operation rounds on its own, as the
 * kernels' round-to-nearest intrinsics make them round on the device; the device's scheduling is
 * the GPU tests' business (tests/test_jpeg_decoder_gpu.py).
 *
 *   image_kernel_emu IN OUT [GRID_X]
 *
 * IN, little-endian: int32 n, oh, ow, dtype (0 uint8, 1 float32, 2 float16, 3 bfloat16),
 * channels_last; float32 scale[3], bias[3]; then per sample int32 live, H, W, top, left, h, w, rh,
 * rw, oy, ox, flip, and H * W * 3 bytes of interleaved RGB when live. OUT: the batch, n * 3 * oh *
 * ow values of the dtype, as the GPU decoder lays it out. GRID_X: the launches' grid width (default:
 * the GPU decoder's, src/core/jpeg_cuda.c); the kernels loop over their work whatever it is. */
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using std::max;
using std::min;

struct pl_emu_dim3 {
    unsigned x, y, z;
};
static pl_emu_dim3 blockIdx, threadIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
/* the round-to-nearest intrinsics: one IEEE operation each (the build turns contraction off) */
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline unsigned __float2uint_rn(float v) { return (unsigned)std::nearbyint(v); }
static inline unsigned __float_as_uint(float v)
{
    unsigned u;
    std::memcpy(&u, &v, 4);
    return u;
}

#include "image_kernel.cu"

extern "C" {
#include "image_rows.h"
}

template <class F> static void launch(F kernel, unsigned grid_x, unsigned grid_y)
{
    blockDim = {256, 1, 1};
    gridDim = {grid_x, grid_y, 1};
    for (unsigned by = 0; by < grid_y; by++)
        for (unsigned bx = 0; bx < grid_x; bx++)
            for (unsigned t = 0; t < 256; t++) {
                blockIdx = {bx, by, 0};
                threadIdx = {t, 0, 0};
                kernel();
            }
}

/* the GPU decoder's grid width for `work` items (jpeg_cuda.c) */
static unsigned grid_for(long long work)
{
    long long g = (work + 255) / 256;
    return (unsigned)(g < 1 ? 1 : g > 4096 ? 4096 : g);
}

static int fail(const char *what)
{
    fprintf(stderr, "image_kernel_emu: %s\n", what);
    return 2;
}

int main(int argc, char **argv)
{
    if (argc < 3)
        return fail("usage: image_kernel_emu IN OUT [GRID_X]");
    FILE *in = fopen(argv[1], "rb");
    if (!in)
        return fail("cannot open IN");
    int32_t head[5];
    pl_img_affine a;
    if (fread(head, 4, 5, in) != 5 || fread(a.scale, 4, 3, in) != 3 || fread(a.bias, 4, 3, in) != 3)
        return fail("short header");
    const int n = head[0], oh = head[1], ow = head[2], dtype = head[3], channels_last = head[4];
    if (n < 1 || n > 65535 || oh < 1 || ow < 1 || dtype < 0 || dtype > 3)
        return fail("bad header");
    const unsigned grid_x = argc > 3 ? (unsigned)atoi(argv[3]) : 0;
    /* each image, each sample's rows and each weight table in an allocation of its own size, for ASan */
    std::vector<unsigned char *> images(n, nullptr), rows(n, nullptr);
    std::vector<int *> coefs(n, nullptr);
    std::vector<pl_img_desc> d(n);
    int max_rows = 0;
    for (int i = 0; i < n; i++) {
        int32_t s[12];
        if (fread(s, 4, 12, in) != 12)
            return fail("short sample");
        const int live = s[0], H = s[1], W = s[2];
        pl_img_desc &e = d[i];
        std::memset(&e, 0, sizeof e); /* a sample that failed: all zero, as jpeg_cuda.c leaves it */
        if (!live)
            continue;
        e.top = s[3], e.left = s[4], e.h = s[5], e.w = s[6], e.rh = s[7], e.rw = s[8], e.oy = s[9],
        e.ox = s[10], e.flip = s[11];
        if (H < 1 || W < 1 || e.top < 0 || e.left < 0 || e.h < 1 || e.w < 1 || e.top + e.h > H ||
            e.left + e.w > W || e.oy < 0 || e.ox < 0 || e.oy + oh > e.rh || e.ox + ow > e.rw)
            return fail("a sample's box is outside its image or output");
        pl_image_rows_read(e.h, e.rh, e.oy, oh, &e.y_first, &e.ny);
        /* the weight table, as jpeg_cuda.c sizes it (Note [weight tables]) */
        e.kh = pl_image_taps(e.w, e.rw);
        e.kv = pl_image_taps(e.h, e.rh);
        const size_t bytes = (size_t)H * W * 3;
        images[i] = (unsigned char *)malloc(bytes);
        rows[i] = (unsigned char *)malloc(max((size_t)e.ny * ow * 3, (size_t)1));
        coefs[i] = (int *)malloc(((size_t)ow * (2 + e.kh) + (size_t)oh * (2 + e.kv)) * sizeof(int));
        if (!images[i] || !rows[i] || !coefs[i] || fread(images[i], 1, bytes, in) != bytes)
            return fail("short image");
        e.src = images[i];
        e.tmp = rows[i];
        e.coef = coefs[i];
        e.src_pitch = (long long)W * 3;
        max_rows = max(max_rows, e.ny);
    }
    fclose(in);
    const size_t esize = dtype == 0 ? 1 : dtype == 1 ? 4 : 2;
    const size_t count = (size_t)n * 3 * oh * ow;
    void *out = malloc(count * esize);
    if (!out)
        return fail("out of memory");
    const pl_img_desc *descs = d.data();
    if (max_rows > 0) {
        launch([&] { pl_image_w(descs, oh, ow); }, grid_x ? grid_x : grid_for((long long)ow + oh), n);
        launch([&] { pl_image_h(descs, ow); },
               grid_x ? grid_x : grid_for((long long)((max_rows + PL_IMAGE_GROUP - 1) / PL_IMAGE_GROUP) * ow), n);
    }
    const unsigned gv = grid_x ? grid_x : grid_for((long long)oh * ow);
    if (dtype == 0)
        launch([&] { pl_image_v_u8(descs, (unsigned char *)out, oh, ow, channels_last, a); }, gv, n);
    else if (dtype == 1)
        launch([&] { pl_image_v_f32(descs, (float *)out, oh, ow, channels_last, a); }, gv, n);
    else if (dtype == 2)
        launch([&] { pl_image_v_f16(descs, (unsigned short *)out, oh, ow, channels_last, a); }, gv, n);
    else
        launch([&] { pl_image_v_bf16(descs, (pl_bf16 *)out, oh, ow, channels_last, a); }, gv, n);
    FILE *o = fopen(argv[2], "wb");
    if (!o || fwrite(out, esize, count, o) != count || fclose(o) != 0)
        return fail("cannot write OUT");
    for (int i = 0; i < n; i++) {
        free(images[i]);
        free(rows[i]);
        free(coefs[i]);
    }
    free(out);
    return 0;
}
