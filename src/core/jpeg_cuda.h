/* The GPU image decoder: a batch of JPEG files decoded by nvJPEG (the GPU's hardware JPEG
 * engines where it has them, nvJPEG's CUDA decoder for the rest), then resized, flipped, scaled
 * and cast into one device block by the image kernels (image_kernel.cu). CUDA only; no Python.
 * nvJPEG is loaded with dlopen on first use, like libcudart (nvjpeg_api.h). */
#ifndef PL_JPEG_CUDA_H
#define PL_JPEG_CUDA_H

#include "backend.h"
#include "block.h"

#include <stddef.h>
#include <stdint.h>

typedef struct pl_jpeg pl_jpeg;

/* One sample: encoded bytes, or an image the host decoded already (raw != NULL: interleaved RGB,
 * raw_h x raw_w, read during the call). p: the resampling parameters (Note [image resampling] in
 * jpeg_cuda.c): top, left, height, width of the box in the image; rh, rw, the box's size after the
 * resize; oy, ox, the output window's corner in the resized box; flip. */
typedef struct pl_jpeg_item {
    const unsigned char *data;
    size_t len;
    const unsigned char *raw;
    int raw_h, raw_w;
    int32_t p[9];
} pl_jpeg_item;

enum { PL_IMG_U8 = 0, PL_IMG_F32 = 1, PL_IMG_F16 = 2, PL_IMG_BF16 = 3 };

typedef struct pl_jpeg_out {
    int oh, ow;
    int dtype; /* PL_IMG_* */
    int channels_last;
    float scale[3], bias[3]; /* value = pixel * scale[c] + bias[c] */
} pl_jpeg_out;

/* Per-sample status of a decode (0 decoded). A failed sample's output is zero. */
enum {
    PL_JPEG_DECODED = 0,
    PL_JPEG_BAD_HEADER = 1,  /* not a JPEG, or a header nvJPEG cannot parse */
    PL_JPEG_BAD_DATA = 2,    /* the header parsed, the decode failed (corrupt or truncated data) */
    PL_JPEG_UNSUPPORTED = 3, /* a JPEG nvJPEG does not decode (components other than 1 or 3) */
    PL_JPEG_BOX_OUTSIDE = 4, /* the box does not lie inside the image */
    PL_JPEG_NO_END = 5,      /* no end-of-image marker near the end (Note [truncated JPEGs] in
                                jpeg_header.c): truncated, or data after the image; the host
                                decoder judges */
};

typedef struct pl_jpeg_counts {
    unsigned long long batches, hardware, cuda, raw, failed;
    unsigned long long roi; /* hardware decodes of a region only (Note [region decode]) */
    unsigned engines, cores_per_engine; /* the hardware decoder's (0: none) */
    size_t workspace_bytes;
    /* Host time in pl_jpeg_decode by step, summed over the calls that succeeded (a failed
     * call adds nothing, nor to batches): headers_ns, the headers, the parameters and the
     * workspace (grown when a batch needs more); engines_wait_ns, the wait before the engines
     * write (the previous batch's kernels, or the whole stream after a growth or a failure:
     * Note [engines write at once]; 0 when no image goes to the engines); engines_ns, the
     * engines' call; cuda_ns, nvJPEG's CUDA decoder (with the images of a failed engines' call)
     * and the host-decoded images' copies; block_ns, the batch's device block (which may wait
     * for blocks to come back); kernels_ns, the descriptors (a ring slot may wait for its
     * copy), the kernels' launches and the events. */
    unsigned long long headers_ns, engines_wait_ns, engines_ns, cuda_ns, block_ns, kernels_ns;
    /* Note [interpolated chroma] in nvjpeg_load.c: 1 where the engines (or, without engines,
     * the CUDA decoder) interpolate chroma as libjpeg-turbo does */
    int chroma_interpolated;
} pl_jpeg_counts;

/* A decoder on `device` of CUDA backend b. libs: paths to try for libnvjpeg after the ones already
 * loaded and the loader's search path; interpolate: chroma upsampled with interpolation where
 * nvJPEG takes it (Note [interpolated chroma] in nvjpeg_load.c). Returns PL_OK, or an error with
 * *why a sentence (static or in why_buf). */
int pl_jpeg_create(const pl_backend *b, int device, const char *const *libs, int nlibs,
                   int interpolate, pl_jpeg **out, char *why_buf, size_t why_len, const char **why);
void pl_jpeg_destroy(pl_jpeg *j);

/* Decode n samples into blk (created on j's device, no memory yet): allocates blk's memory
 * (n x 3 x oh x ow elements of o->dtype, NCHW or NHWC), queues the decode and the kernels on
 * j's stream and records blk's ready event there. The host does not wait for the GPU; items'
 * bytes must stay readable until the call returns. status[i] gets each sample's PL_JPEG_*.
 * Not thread-safe: one call at a time per decoder. Returns PL_OK, or an error with *why. */
int pl_jpeg_decode(pl_jpeg *j, int n, const pl_jpeg_item *items, const pl_jpeg_out *o,
                   pl_block *blk, int32_t *status, const char **why);

/* Thread-safe: the counts as of the end of the last call (one in progress is not in them).
 * in_fork_child: j was made by the parent of this forked process (read without the lock). */
void pl_jpeg_get_counts(pl_jpeg *j, pl_jpeg_counts *c, int in_fork_child);
/* The decoder's own stream (for the test suite's stream holds). */
pl_stream *pl_jpeg_stream(const pl_jpeg *j);
/* The test suite's switch: with on = 0, no decoder waits before the engines write (Note
 * [engines write at once] in jpeg_cuda.c), to show what the waits prevent. On by default. */
void pl_jpeg_debug_engine_waits(int on);
/* The test suite's switch: with on = 1, decoders made after it use the hardware backend's
 * pipelined mode (Note [the engines' call beside training] in jpeg_cuda.c), to show what its
 * absence prevents. Off by default. */
void pl_jpeg_debug_pipelined(int on);

/* The image kernels (image_kernel.cu), launched by backend_cuda.c: which is PL_IMAGE_KERNEL_W
 * (the weight tables), PL_IMAGE_KERNEL_H (the horizontal pass) or PL_IMAGE_KERNEL_V + PL_IMG_*
 * (the vertical pass for that dtype). args as cudaLaunchKernel takes them. */
enum { PL_IMAGE_KERNEL_H = 0, PL_IMAGE_KERNEL_V = 1, PL_IMAGE_KERNEL_W = 5, PL_IMAGE_KERNELS = 6 };
int pl_cuda_image_launch(int device, int which, unsigned grid_x, unsigned grid_y, void **args,
                         pl_stream *s, const char **why);

#endif
