/* What the image kernels (src/core/image_kernel.cu) need room for: the rows of a sample's box
 * they read, and the taps of their weight tables. Shared by the GPU decoder (jpeg_cuda.c), which
 * lays out its workspace by them, and the kernels' host emulation in the test suite
 * (tests/image_kernel_emu.cpp). Plain C, no CUDA. */
#ifndef PL_IMAGE_ROWS_H
#define PL_IMAGE_ROWS_H

/* The rows each horizontal-pass thread makes, sharing their column's weights (the launch's grid
 * is sized by it; any grid gives the same result). */
#define PL_IMAGE_GROUP 8

/* The rows [*first, *first + *n) of a box of `in` rows that the output rows [y0, y0 + oh) of
 * its resize to `out` rows read, with a row of margin on each side (the device computes the
 * exact span with the same formula; the margin keeps a last-bit difference harmless). */
static inline void pl_image_rows_read(int in, int out, int y0, int oh, int *first, int *n)
{
    const double scale = (double)in / (double)out;
    const double support = scale < 1.0 ? 1.0 : scale;
    const double c0 = ((double)y0 + 0.5) * scale, c1 = ((double)(y0 + oh - 1) + 0.5) * scale;
    long lo = (long)(c0 - support + 0.5) - 1, hi = (long)(c1 + support + 0.5) + 1;
    if (lo < 0)
        lo = 0;
    if (hi > in)
        hi = in;
    if (hi < lo)
        hi = lo;
    *first = (int)lo;
    *n = (int)(hi - lo);
}

/* The most taps a resize from `in` to `out` pixels (both >= 1) has: Pillow's ksize,
 * 2 * ceil(support) + 1 with support = max(in / out, 1) (Note [weight tables] in image_kernel.cu).
 * The integer ceiling equals the ceiling of the kernels' double quotient here: in <= 65535, so
 * a quotient below an integer is too far below it to round up to it. */
static inline int pl_image_taps(int in, int out)
{
    const int support = in > out ? (in - 1) / out + 1 : 1;
    return 2 * support + 1;
}

#endif
