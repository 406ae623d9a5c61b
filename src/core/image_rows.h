/* Which rows of a sample's box the image kernels read (src/core/image_kernel.cu): shared by the
 * GPU decoder (jpeg_cuda.c), which sizes the horizontal pass's rows by it, and the kernels' host
 * emulation in the test suite (tests/image_kernel_emu.cpp). Plain C, no CUDA. */
#ifndef PL_IMAGE_ROWS_H
#define PL_IMAGE_ROWS_H

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

#endif
