/* The GPU image decoder (jpeg_cuda.h): nvJPEG (loaded at run time by nvjpeg_load.c), the
 * hardware JPEG engines for the images they take, nvJPEG's CUDA decoder for the others, and the
 * image kernels for the resize into the batch.
 *
 * Note [image resampling]
 * A sample is described by a box in its image (top, left, height, width), the size the box is
 * resized to (rh, rw), the corner (oy, ox) of the output window in the resized box, and a
 * horizontal flip. Training crops are a box resized to exactly the output size (oy = ox = 0);
 * evaluation is the whole image as the box, resized on its shorter side, with the output window
 * centred. The filter treats the box as the whole image (it never reads outside it), as
 * torchvision's resized_crop does on PIL images: crop first, then resize. Note [resampling like
 * Pillow] in image_kernel.cu gives the arithmetic.
 *
 * Per batch:
 *   1. every header is parsed on the host (nvjpegJpegStreamParseHeader): the image's size, its
 *      components, and whether the hardware engines take it (nvjpegDecodeBatchedSupported);
 *   2. the workspace (each sample's decoded image, the horizontal pass's rows and the weight
 *      tables: Note [weight tables] in image_kernel.cu) is grown if this batch needs more; it
 *      is reused across batches, never shrunk, freed with the decoder;
 *   3. the hardware takes its share in one nvjpegDecodeBatched call; the rest, and every image
 *      of a hardware batch that failed as a whole, go through nvjpegDecode one by one, which
 *      tells which image is bad; host-decoded images are copied in;
 *   4. the samples' descriptors go to the device from a pinned ring slot, the image kernels
 *      run (the weight tables, then the two passes), and the block's ready event is recorded.
 * Everything is queued on the decoder's own stream, except what the hardware engines write (Note
 * [engines write at once]): before they write, the host waits for the previous batch's kernels.
 * Nothing else here waits for the GPU except a ring slot whose copy has not finished (Note
 * [descriptor ring]).
 *
 * Note [engines write at once]
 * nvjpegDecodeBatched on the hardware backend writes its output when it is called, whatever is
 * queued before it on the stream it is given: a device-side dependency (the stream's own queue,
 * or a cudaStreamWaitEvent) does not hold the write back, only a host wait does (reported on
 * H100 with nvJPEG 12.3.5, 12.4, 13.0.1 and 13.2.1; nvJPEG's CUDA decoder and its single-image
 * call keep stream order). The engines write into the workspace, which the previous batch's
 * kernels read: on a GPU busy with training those kernels can still be queued when the next
 * batch's decode is called, and they would resample the next batch's pixels. So the decoder
 * records `ws_free` after each batch's kernels and the host waits for it before the engines'
 * call. The host waits for the whole stream instead (`ws_sync_all`) when the workspace is new
 * memory (the pool, Note [device pool] in backend_cuda.c, reuses at once what was freed on this
 * stream: the old workspace, ring slots, deferred blocks, whose readers are queued here) and
 * after a batch that failed part way (its writes into the workspace may be queued after the
 * last `ws_free`). With two decoders (Note [decoder threads] in pinloader/_image_epochs.py) the
 * other decoder keeps the engines busy during such a wait.
 *
 * Note [the engines' call beside training]
 * The hardware backend is made with NVJPEG_FLAGS_HW_DECODE_NO_PIPELINE. In its default, pipelined
 * mode, nvjpegDecodeBatched returned only once the work queued on another stream before it had
 * run, with the driver's default of 8 hardware work queues; with 32
 * (CUDA_DEVICE_MAX_CONNECTIONS=32) it did not wait, most likely because the pipelined mode's
 * streams share a queue with the other stream's when there are 8 (Note [hardware work queues]
 * in backend_cuda.c). Without the pipeline the call did not wait either way, and on an idle GPU
 * it is somewhat slower. Beside a training step, whose kernels the training thread queues a
 * step ahead, the models trained faster with the flag than without it (alternating processes on
 * one machine), and ResNet-18 faster still with 32 queues. benchmarks/nvjpeg_contention.cu
 * measures the call alone, the benchmarks page what the flag and the queues gave real models;
 * tests/test_jpeg_decoder_gpu.py checks that a decode returns while another stream's work is
 * still queued, with 8 queues and with 32, and that the pipelined mode (the test suite's switch,
 * pl_jpeg_debug_pipelined) waits with 8. */
#include "jpeg_cuda.h"

#include "image_rows.h"
#include "jpeg_header.h"
#include "nvjpeg_api.h"
#include "util.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the decoder ---- */

/* Note [descriptor ring]
 * The samples' descriptors are written by the host into pinned memory and copied to the device
 * on the decoder's stream. A slot is written again only once the event recorded after its copy
 * has completed; with four slots and a pipeline a few batches deep that wait is nearly always
 * already over. */
enum { RING = 4 };

/* Must match struct pl_img_desc in image_kernel.cu. */
typedef struct img_desc {
    const unsigned char *src;
    unsigned char *tmp;
    int *coef;
    long long src_pitch;
    int top, left, h, w;
    int rh, rw;
    int oy, ox;
    int y_first, ny;
    int flip;
    int kh, kv;
    int pad;
} img_desc;

typedef struct img_affine {
    float scale[3], bias[3];
} img_affine;

struct pl_jpeg {
    const pl_backend *b;
    int device;
    pl_stream *stream;
    pl_nvjpegHandle_t hw, gen; /* hw: NULL where the GPU has no JPEG engines */
    pl_nvjpegJpegState_t hw_state, gen_state;
    int interp; /* Note [interpolated chroma] in nvjpeg_load.c: asked for */
    pl_nvjpegJpegStream_t js;
    unsigned engines, cores;
    unsigned char *ws; /* device workspace */
    size_t ws_cap;
    struct {
        img_desc *host; /* pinned */
        void *dev;
        size_t cap;     /* descriptors */
        pl_event *copied;
        int recorded;
    } ring[RING];
    int next;
    pl_nvjpegDecodeParams_t *params; /* one per hardware sample, grown to the largest batch */
    int params_cap;
    int region; /* Note [region decode] on */
    int sorted; /* Note [the engines' order]: largest first (PINLOADER_JPEG_SORT=0: off) */
    pl_event *ws_free;    /* recorded after a batch's kernels: Note [engines write at once] */
    int ws_free_recorded;
    int ws_sync_all;      /* the next engines' call waits for the whole stream (same Note) */
    pl_jpeg_counts counts; /* the decoding thread's own (one call at a time per decoder) */
    pthread_mutex_t shown_mu;
    pl_jpeg_counts shown;  /* guarded by shown_mu: counts as of the end of the last call */
};

static atomic_int pipelined; /* the test suite's switch: pl_jpeg_debug_pipelined */

void pl_jpeg_debug_pipelined(int on)
{
    atomic_store(&pipelined, on != 0);
}

static int nj_fail(pl_nvjpegStatus_t s, const char *what, const char **why)
{
    static __thread char buf[160];
    snprintf(buf, sizeof buf, "%s failed: %s", what, pl_nvjpeg_status_name(s));
    *why = buf;
    return PL_ERR_UNKNOWN;
}

void pl_jpeg_destroy(pl_jpeg *j)
{
    if (!j)
        return;
    const pl_backend *b = j->b;
    const int mode = pl_captures_relax(b); /* Note [releases during a capture] in backend.h */
    int prev = -1;
    pl_device_push(b, j->device, &prev);
    if (j->stream)
        b->stream_synchronize(j->stream);
    for (int i = 0; i < RING; i++) {
        if (j->ring[i].dev)
            b->device_free(j->device, j->ring[i].dev, j->stream);
        if (j->ring[i].host)
            b->host_free(j->ring[i].host, j->ring[i].cap * sizeof(img_desc));
        if (j->ring[i].copied)
            b->event_destroy(j->ring[i].copied);
    }
    if (j->ws)
        b->device_free(j->device, j->ws, j->stream);
    if (j->stream)
        b->stream_synchronize(j->stream);
    if (j->ws_free)
        b->event_destroy(j->ws_free);
    for (int i = 0; i < j->params_cap; i++)
        if (j->params[i])
            pl_nj.nvjpegDecodeParamsDestroy(j->params[i]);
    free(j->params);
    if (j->js)
        pl_nj.nvjpegJpegStreamDestroy(j->js);
    pl_nvjpeg_destroy_decoder(j->hw, j->hw_state);
    pl_nvjpeg_destroy_decoder(j->gen, j->gen_state);
    if (j->stream)
        b->stream_destroy(j->stream);
    pl_device_pop(b, j->device, prev);
    pl_captures_restore(b, mode);
    pthread_mutex_destroy(&j->shown_mu); /* made first in pl_jpeg_create */
    free(j);
}

int pl_jpeg_create(const pl_backend *b, int device, const char *const *libs, int nlibs,
                   int interpolate, pl_jpeg **out, char *why_buf, size_t why_len, const char **why)
{
    *out = NULL;
    if (b->kind != PL_BACKEND_CUDA) {
        *why = "the GPU image decoder needs the CUDA backend";
        return PL_ERR_INVALID_VALUE;
    }
    int rc = pl_nvjpeg_load(libs, nlibs, why);
    if (rc != PL_OK)
        return rc;
    pl_jpeg *j = calloc(1, sizeof *j);
    if (!j) {
        *why = "out of host memory";
        return PL_ERR_NO_MEMORY;
    }
    j->b = b;
    j->device = device;
    if (pthread_mutex_init(&j->shown_mu, NULL) != 0) {
        free(j);
        *why = "pthread_mutex_init failed";
        return PL_ERR_NO_MEMORY;
    }
    const char *env = getenv("PINLOADER_JPEG_REGION");
    j->region = env && strcmp(env, "1") == 0;
    env = getenv("PINLOADER_JPEG_SORT");
    j->sorted = !(env && strcmp(env, "0") == 0);
    j->interp = interpolate != 0;
    int prev = -1;
    if ((rc = pl_device_push(b, device, &prev)) != PL_OK) {
        free(j);
        *why = "cudaSetDevice failed";
        return rc;
    }
    pl_nvjpegStatus_t s;
    if ((rc = b->stream_create(0, &j->stream)) != PL_OK) {
        *why = "cudaStreamCreate failed";
        goto error;
    }
    for (int i = 0; i < RING; i++)
        if ((rc = b->event_create(&j->ring[i].copied)) != PL_OK) {
            *why = "cudaEventCreate failed";
            goto error;
        }
    if ((rc = b->event_create(&j->ws_free)) != PL_OK) {
        *why = "cudaEventCreate failed";
        goto error;
    }
    /* The hardware backend exists only on GPUs with JPEG engines (A100, H100, H200, ...):
     * elsewhere its creation fails and the CUDA decoder takes every image. Made without its
     * pipeline: Note [the engines' call beside training]. */
    const unsigned hw_flags = atomic_load(&pipelined) ? 0u : PL_NVJPEG_FLAGS_HW_DECODE_NO_PIPELINE;
    int hw_interp, gen_interp;
    const char *what;
    if (pl_nvjpeg_make_decoder(pl_NVJPEG_BACKEND_HARDWARE, hw_flags, j->interp, &j->hw, &j->hw_state, &hw_interp,
                               &what) == pl_NVJPEG_STATUS_SUCCESS &&
        pl_nj.nvjpegGetHardwareDecoderInfo(j->hw, &j->engines, &j->cores) != pl_NVJPEG_STATUS_SUCCESS)
        j->engines = j->cores = 0;
    if ((s = pl_nvjpeg_make_decoder(pl_NVJPEG_BACKEND_DEFAULT, 0u, j->interp, &j->gen, &j->gen_state, &gen_interp,
                                    &what)) != pl_NVJPEG_STATUS_SUCCESS) {
        rc = nj_fail(s, what, why);
        goto error;
    }
    if ((s = pl_nj.nvjpegJpegStreamCreate(j->hw ? j->hw : j->gen, &j->js)) != pl_NVJPEG_STATUS_SUCCESS) {
        rc = nj_fail(s, "nvjpegJpegStreamCreate", why);
        goto error;
    }
    j->counts.engines = j->engines;
    j->counts.cores_per_engine = j->cores;
    j->counts.chroma_interpolated = j->hw ? hw_interp : gen_interp;
    j->shown = j->counts;
    pl_device_pop(b, device, prev);
    *out = j;
    return PL_OK;
error:
    if (*why != why_buf && why_len) {
        snprintf(why_buf, why_len, "%s", *why);
        *why = why_buf;
    }
    pl_device_pop(b, device, prev);
    pl_jpeg_destroy(j);
    return rc;
}

pl_stream *pl_jpeg_stream(const pl_jpeg *j)
{
    return j->stream;
}

/* The counts as the last call left them: another thread's info() may read them while a call
 * runs, so each call publishes its own copy at its end (publish_counts). In a fork child the
 * lock may have been copied held by a thread the child does not have; no other thread writes
 * there, so the copy is read without it. */
void pl_jpeg_get_counts(pl_jpeg *j, pl_jpeg_counts *c, int in_fork_child)
{
    if (in_fork_child) {
        *c = j->shown;
        return;
    }
    pthread_mutex_lock(&j->shown_mu);
    *c = j->shown;
    pthread_mutex_unlock(&j->shown_mu);
}

static void publish_counts(pl_jpeg *j)
{
    j->counts.workspace_bytes = j->ws_cap;
    pthread_mutex_lock(&j->shown_mu);
    j->shown = j->counts;
    pthread_mutex_unlock(&j->shown_mu);
}

static size_t align256(size_t n)
{
    return (n + 255) & ~(size_t)255;
}

typedef struct sample {
    int kind; /* 0 failed, 1 hardware, 2 CUDA decoder, 3 raw */
    int tried; /* decode_one_cuda has decoded it, or tried to */
    int h, w; /* the image's */
    int ry, rx, rh, rw; /* the region decoded (the whole image unless Note [region decode]) */
    size_t img_off, tmp_off, coef_off;
    int kh, kv; /* the weight table's taps per column and row (Note [weight tables] in image_kernel.cu) */
} sample;

/* Note [region decode]
 * A training crop covers 8-100% of its image, and the hardware engines can decode a region only
 * (nvjpegDecodeBatchedEx with a region per image), which saves engine time in proportion. The
 * region is the crop's box widened by a pixel and rounded out to 16-pixel blocks (the largest
 * MCU), clamped to the image, so the pixels of the box come out as in a whole-image decode
 * (chroma upsampling reads a neighbour on each side). It is used when it is at most 90% of the
 * image and the engines accept it (nvjpegDecodeBatchedSupportedEx); otherwise the image is decoded
 * whole. The workspace still holds the whole image, so that an image of a failed hardware batch
 * can be decoded again, whole, by the CUDA decoder. Region decodes are off unless
 * PINLOADER_JPEG_REGION=1 is in the environment when a decoder is made: they give the same pixels
 * (tests/test_jpeg_decoder_gpu.py::test_a_region_decode_equals_the_crop_of_a_whole_decode, run
 * with it set) but no more images per second, since the engines' time is not what bounds a batch
 * (the host side of the batched call is: Note [decoder threads] in pinloader/_image_epochs.py).
 * With interpolated chroma (Note [interpolated chroma] in nvjpeg_load.c) the region decodes were
 * slower still on an H100 (benchmarks/results/h100_2026-12-06g/README.md), and nvJPEG's notes
 * report a fix, in 13.3, to the boundary of a region decoded with that flag; the region test has
 * run on nvJPEG 13.0 only. */
static void region_of(const int32_t *p, int H, int W, sample *sm)
{
    long y0 = ((long)p[0] - 1) & ~15L, x0 = ((long)p[1] - 1) & ~15L;
    long y1 = ((long)p[0] + p[2] + 1 + 15) & ~15L, x1 = ((long)p[1] + p[3] + 1 + 15) & ~15L;
    if (y0 < 0)
        y0 = 0;
    if (x0 < 0)
        x0 = 0;
    if (y1 > H)
        y1 = H;
    if (x1 > W)
        x1 = W;
    sm->ry = (int)y0;
    sm->rx = (int)x0;
    sm->rh = (int)(y1 - y0);
    sm->rw = (int)(x1 - x0);
}

/* Note [the engines' order]
 * The engines share one batched call's images out among themselves, and the call ends when the
 * last engine does. The decoder hands them a batch's images largest decoded area first (ties in
 * the batch's order), as DALI orders the images of its hardware share, so that the small ones
 * fill the engines' tails: on an H100, 1.02x the images/s on high-res JPEGs (ImageLoader as it
 * was over this order, per round: 0.98, 0.98-0.99) and 1.03x on ImageNet-like ones (0.97,
 * 0.94-1.03), at the same CPU per image (benchmarks/results/h100_2026-12-07c/README.md).
 * PINLOADER_JPEG_SORT=0 in the environment when a decoder is made keeps the batch's order. The
 * order changes only which engine decodes an image, not its pixels or where they go
 * (tests/test_jpeg_decoder_gpu.py::test_the_engines_order_changes_no_pixel). */
static void largest_first(int *idx, int n, const sample *sm)
{
    for (int a = 1; a < n; a++) { /* insertion sort: stable, n <= the batch */
        const int v = idx[a];
        const int64_t area = (int64_t)sm[v].rh * sm[v].rw;
        int k = a - 1;
        while (k >= 0 && (int64_t)sm[idx[k]].rh * sm[idx[k]].rw < area) {
            idx[k + 1] = idx[k];
            k--;
        }
        idx[k + 1] = v;
    }
}

static void whole_image(sample *sm)
{
    sm->ry = sm->rx = 0;
    sm->rh = sm->h;
    sm->rw = sm->w;
}

static int ensure_params(pl_jpeg *j, int n, const char **why)
{
    if (n <= j->params_cap)
        return PL_OK;
    pl_nvjpegDecodeParams_t *p = realloc(j->params, (size_t)n * sizeof *p);
    if (!p) {
        *why = "out of host memory";
        return PL_ERR_NO_MEMORY;
    }
    j->params = p;
    for (int i = j->params_cap; i < n; i++) {
        p[i] = NULL;
        pl_nvjpegStatus_t s = pl_nj.nvjpegDecodeParamsCreate(j->hw, &p[i]);
        if (s == pl_NVJPEG_STATUS_SUCCESS)
            s = pl_nj.nvjpegDecodeParamsSetOutputFormat(p[i], pl_NVJPEG_OUTPUT_RGBI);
        if (s != pl_NVJPEG_STATUS_SUCCESS) {
            if (p[i]) {
                pl_nj.nvjpegDecodeParamsDestroy(p[i]);
                p[i] = NULL;
            }
            j->params_cap = i;
            return nj_fail(s, "nvjpegDecodeParamsCreate", why);
        }
        j->params_cap = i + 1;
    }
    return PL_OK;
}

static int ensure_workspace(pl_jpeg *j, size_t need, const char **why)
{
    if (need <= j->ws_cap)
        return PL_OK;
    size_t cap = need + need / 4;
    if (cap < need)
        cap = need;
    if (j->ws) {
        j->b->device_free(j->device, j->ws, j->stream);
        j->ws = NULL;
        j->ws_cap = 0;
    }
    void *p = NULL;
    int rc = j->b->device_alloc(j->device, cap, j->stream, &p);
    if (rc != PL_OK) {
        *why = "the decoder's workspace could not be allocated on the device";
        return rc;
    }
    j->ws = p;
    j->ws_cap = cap;
    j->ws_sync_all = 1;
    return PL_OK;
}

static atomic_int engine_waits_off; /* the test suite's switch: pl_jpeg_debug_engine_waits */

void pl_jpeg_debug_engine_waits(int on)
{
    atomic_store(&engine_waits_off, !on);
}

/* Before the engines write into the workspace (Note [engines write at once]): the host waits for
 * the previous batch's kernels, or for the whole stream (ws_sync_all). */
static int engines_may_write(pl_jpeg *j, const char **why)
{
    const pl_backend *b = j->b;
    int rc = PL_OK;
    if (atomic_load(&engine_waits_off))
        return PL_OK;
    if (j->ws_sync_all) {
        if ((rc = b->stream_synchronize(j->stream)) != PL_OK)
            *why = "cudaStreamSynchronize before the hardware decode failed";
        else
            j->ws_sync_all = 0;
    } else if (j->ws_free_recorded) {
        /* polled with naps (Note [expected waits] in backend_cuda.c): no spinning core */
        if ((rc = b->event_wait(j->ws_free, INT64_MAX / 2, 0)) != PL_OK)
            *why = "waiting for the previous batch's kernels failed";
    }
    return rc;
}

static int ring_slot(pl_jpeg *j, int n, int *slot, const char **why)
{
    int k = j->next;
    j->next = (j->next + 1) % RING;
    const pl_backend *b = j->b;
    int rc;
    if (j->ring[k].recorded && (rc = b->event_synchronize(j->ring[k].copied)) != PL_OK) {
        *why = "cudaEventSynchronize on a descriptor slot failed";
        return rc;
    }
    j->ring[k].recorded = 0;
    if ((size_t)n > j->ring[k].cap) {
        size_t cap = (size_t)n < 256 ? 256 : (size_t)n;
        if (j->ring[k].host) {
            b->host_free(j->ring[k].host, j->ring[k].cap * sizeof(img_desc));
            j->ring[k].host = NULL;
        }
        if (j->ring[k].dev) {
            b->device_free(j->device, j->ring[k].dev, j->stream);
            j->ring[k].dev = NULL;
        }
        j->ring[k].cap = 0;
        void *h = NULL, *d = NULL;
        if ((rc = b->host_alloc(cap * sizeof(img_desc), -1, &h)) != PL_OK) {
            *why = "pinned memory for the decoder's descriptors could not be allocated";
            return rc;
        }
        if ((rc = b->device_alloc(j->device, cap * sizeof(img_desc), j->stream, &d)) != PL_OK) {
            b->host_free(h, cap * sizeof(img_desc));
            *why = "device memory for the decoder's descriptors could not be allocated";
            return rc;
        }
        j->ring[k].host = h;
        j->ring[k].dev = d;
        j->ring[k].cap = cap;
    }
    *slot = k;
    return PL_OK;
}

/* A decode call's host time by step (pl_jpeg_counts' *_ns), added to the counts only when the
 * call succeeds, with its batch. */
enum { LAP_HEADERS, LAP_ENGINES_WAIT, LAP_ENGINES, LAP_CUDA, LAP_BLOCK, LAP_KERNELS, LAPS };

/* Adds the time since t to *sum; returns now. */
static int64_t lap(int64_t *sum, int64_t t)
{
    const int64_t now = pl_now_ns();
    if (now > t)
        *sum += now - t;
    return now;
}

static void decode_one_cuda(pl_jpeg *j, const pl_jpeg_item *it, sample *sm, int32_t *status)
{
    pl_nvjpegImage_t dst;
    memset(&dst, 0, sizeof dst);
    whole_image(sm);
    dst.channel[0] = j->ws + sm->img_off;
    dst.pitch[0] = (size_t)sm->w * 3;
    sm->tried = 1;
    pl_nvjpegStatus_t s = pl_nj.nvjpegDecode(j->gen, j->gen_state, it->data, it->len, pl_NVJPEG_OUTPUT_RGBI,
                                          &dst, (pl_nvjpeg_cudaStream_t)j->stream);
    if (s == pl_NVJPEG_STATUS_SUCCESS) {
        sm->kind = 2;
        j->counts.cuda++;
    } else {
        sm->kind = 0;
        *status = s == pl_NVJPEG_STATUS_JPEG_NOT_SUPPORTED ? PL_JPEG_UNSUPPORTED : PL_JPEG_BAD_DATA;
    }
}

int pl_jpeg_decode(pl_jpeg *j, int n, const pl_jpeg_item *items, const pl_jpeg_out *o,
                   pl_block *blk, int32_t *status, const char **why)
{
    const pl_backend *b = j->b;
    if (n <= 0 || n > 65535 || o->oh <= 0 || o->ow <= 0 || o->dtype < PL_IMG_U8 || o->dtype > PL_IMG_BF16) {
        *why = "a decode with an impossible batch or output shape";
        return PL_ERR_INVALID_VALUE;
    }
    const size_t esize = o->dtype == PL_IMG_U8 ? 1 : o->dtype == PL_IMG_F32 ? 4 : 2;
    size_t out_bytes;
    if (__builtin_mul_overflow((size_t)n * 3, (size_t)o->oh, &out_bytes) ||
        __builtin_mul_overflow(out_bytes, (size_t)o->ow, &out_bytes) ||
        __builtin_mul_overflow(out_bytes, esize, &out_bytes)) {
        *why = "the batch's size overflows";
        return PL_ERR_INVALID_VALUE;
    }
    sample *sm = calloc((size_t)n, sizeof *sm);
    int *hw_idx = calloc((size_t)n, sizeof *hw_idx);
    const unsigned char **hw_data = calloc((size_t)n, sizeof *hw_data);
    size_t *hw_len = calloc((size_t)n, sizeof *hw_len);
    pl_nvjpegImage_t *hw_dst = calloc((size_t)n, sizeof *hw_dst);
    pl_nvjpegDecodeParams_t *hw_params = calloc((size_t)n, sizeof *hw_params);
    int prev = -1, pushed = 0, rc = PL_OK;
    int64_t t = pl_now_ns(), laps[LAPS] = {0};
    if (!sm || !hw_idx || !hw_data || !hw_len || !hw_dst || !hw_params) {
        *why = "out of host memory";
        rc = PL_ERR_NO_MEMORY;
        goto done;
    }
    if ((rc = pl_device_push(b, j->device, &prev)) != PL_OK) {
        *why = "cudaSetDevice failed";
        goto done;
    }
    pushed = 1;
    if (j->hw && (rc = ensure_params(j, n, why)) != PL_OK)
        goto done;

    /* 1. headers, kinds, sizes and the workspace layout */
    size_t ws = 0;
    int n_hw = 0;
    for (int i = 0; i < n; i++) {
        const pl_jpeg_item *it = &items[i];
        status[i] = PL_JPEG_DECODED;
        sm[i].kind = 0;
        if (it->raw) {
            sm[i].kind = 3;
            sm[i].h = it->raw_h;
            sm[i].w = it->raw_w;
        } else {
            unsigned w = 0, h = 0, comps = 0;
            if (!it->data || it->len == 0 ||
                pl_nj.nvjpegJpegStreamParseHeader(j->hw ? j->hw : j->gen, it->data, it->len, j->js) != pl_NVJPEG_STATUS_SUCCESS ||
                pl_nj.nvjpegJpegStreamGetFrameDimensions(j->js, &w, &h) != pl_NVJPEG_STATUS_SUCCESS ||
                pl_nj.nvjpegJpegStreamGetComponentsNum(j->js, &comps) != pl_NVJPEG_STATUS_SUCCESS ||
                w == 0 || h == 0 || w > 65535 || h > 65535) {
                status[i] = PL_JPEG_BAD_HEADER;
                continue;
            }
            if (comps != 1 && comps != 3) {
                status[i] = PL_JPEG_UNSUPPORTED;
                continue;
            }
            if (!pl_jpeg_has_end_marker(it->data, it->len)) {
                status[i] = PL_JPEG_NO_END;
                continue;
            }
            sm[i].h = (int)h;
            sm[i].w = (int)w;
            sm[i].kind = 2;
        }
        whole_image(&sm[i]);
        const int32_t *p = it->p;
        if (p[0] < 0 || p[1] < 0 || p[2] <= 0 || p[3] <= 0 || (int64_t)p[0] + p[2] > sm[i].h ||
            (int64_t)p[1] + p[3] > sm[i].w || p[4] <= 0 || p[5] <= 0 || p[6] < 0 || p[7] < 0 ||
            (int64_t)p[6] + o->oh > p[4] || (int64_t)p[7] + o->ow > p[5]) {
            status[i] = PL_JPEG_BOX_OUTSIDE;
            sm[i].kind = 0;
            continue;
        }
        if (sm[i].kind == 2 && j->hw) {
            /* the engines, with a region where it pays (Note [region decode]); j->js still
             * holds this image's header */
            pl_nvjpegDecodeParams_t dp = j->params[i];
            int unsupported = 1;
            region_of(p, sm[i].h, sm[i].w, &sm[i]);
            if (j->region && (double)sm[i].rh * sm[i].rw <= 0.9 * (double)sm[i].h * sm[i].w &&
                pl_nj.nvjpegDecodeParamsSetROI(dp, sm[i].rx, sm[i].ry, sm[i].rw, sm[i].rh) == pl_NVJPEG_STATUS_SUCCESS &&
                pl_nj.nvjpegDecodeBatchedSupportedEx(j->hw, j->js, dp, &unsupported) != pl_NVJPEG_STATUS_SUCCESS)
                unsupported = 1;
            if (unsupported) {
                whole_image(&sm[i]);
                if (pl_nj.nvjpegDecodeParamsSetROI(dp, 0, 0, -1, -1) != pl_NVJPEG_STATUS_SUCCESS ||
                    pl_nj.nvjpegDecodeBatchedSupportedEx(j->hw, j->js, dp, &unsupported) != pl_NVJPEG_STATUS_SUCCESS)
                    unsupported = 1;
            }
            if (!unsupported)
                sm[i].kind = 1;
            else
                whole_image(&sm[i]);
        }
        size_t img = align256((size_t)sm[i].h * (size_t)sm[i].w * 3);
        int first, rows;
        pl_image_rows_read(p[2], p[4], p[6], o->oh, &first, &rows);
        size_t tmp = align256((size_t)rows * (size_t)o->ow * 3);
        /* the weight table: ow * (2 + kh) + oh * (2 + kv) ints (kh, kv < 2^17: sides <= 65535) */
        sm[i].kh = pl_image_taps(p[3], p[5]);
        sm[i].kv = pl_image_taps(p[2], p[4]);
        size_t coef_ints = 0, part;
        int coef_over = __builtin_mul_overflow((size_t)o->ow, (size_t)(2 + sm[i].kh), &coef_ints) ||
                        __builtin_mul_overflow((size_t)o->oh, (size_t)(2 + sm[i].kv), &part) ||
                        __builtin_add_overflow(coef_ints, part, &coef_ints) ||
                        __builtin_mul_overflow(coef_ints, sizeof(int), &coef_ints);
        size_t coef = align256(coef_ints);
        sm[i].img_off = ws;
        if (__builtin_add_overflow(ws, img, &ws)) {
            *why = "the batch's decoded size overflows";
            rc = PL_ERR_INVALID_VALUE;
            goto done;
        }
        sm[i].tmp_off = ws;
        if (__builtin_add_overflow(ws, tmp, &ws)) {
            *why = "the batch's decoded size overflows";
            rc = PL_ERR_INVALID_VALUE;
            goto done;
        }
        sm[i].coef_off = ws;
        if (coef_over || coef < coef_ints || __builtin_add_overflow(ws, coef, &ws)) {
            *why = "the batch's decoded size overflows";
            rc = PL_ERR_INVALID_VALUE;
            goto done;
        }
    }
    if ((rc = ensure_workspace(j, ws ? ws : 256, why)) != PL_OK)
        goto done;
    t = lap(&laps[LAP_HEADERS], t);

    /* 2. decode: the hardware's share in one call (Note [the engines' order]), the rest one by one */
    for (int i = 0; i < n; i++)
        if (sm[i].kind == 1)
            hw_idx[n_hw++] = i;
    if (j->sorted)
        largest_first(hw_idx, n_hw, sm);
    for (int k = 0; k < n_hw; k++) {
        const int i = hw_idx[k];
        hw_data[k] = items[i].data;
        hw_len[k] = items[i].len;
        memset(&hw_dst[k], 0, sizeof hw_dst[k]);
        hw_dst[k].channel[0] = j->ws + sm[i].img_off;
        hw_dst[k].pitch[0] = (size_t)sm[i].rw * 3;
        hw_params[k] = j->params[i];
    }
    if (n_hw && (rc = engines_may_write(j, why)) != PL_OK)
        goto done;
    t = lap(&laps[LAP_ENGINES_WAIT], t);
    if (n_hw) {
        pl_nvjpegStatus_t s = pl_nj.nvjpegDecodeBatchedInitialize(j->hw, j->hw_state, n_hw, 1, pl_NVJPEG_OUTPUT_RGBI);
        if (s == pl_NVJPEG_STATUS_SUCCESS)
            s = pl_nj.nvjpegDecodeBatchedEx(j->hw, j->hw_state, hw_data, hw_len, hw_dst, hw_params,
                                         (pl_nvjpeg_cudaStream_t)j->stream);
        t = lap(&laps[LAP_ENGINES], t); /* a failed call's images fall to the CUDA decoder's lap */
        if (s == pl_NVJPEG_STATUS_SUCCESS) {
            j->counts.hardware += (unsigned long long)n_hw;
            for (int k = 0; k < n_hw; k++)
                if (sm[hw_idx[k]].rh != sm[hw_idx[k]].h || sm[hw_idx[k]].rw != sm[hw_idx[k]].w)
                    j->counts.roi++;
        } else {
            /* One bad image fails the whole call: the CUDA decoder names it. */
            for (int k = 0; k < n_hw; k++)
                decode_one_cuda(j, &items[hw_idx[k]], &sm[hw_idx[k]], &status[hw_idx[k]]);
        }
    }
    for (int i = 0; i < n; i++) {
        if (sm[i].kind == 2 && !sm[i].tried && status[i] == PL_JPEG_DECODED && !items[i].raw) {
            decode_one_cuda(j, &items[i], &sm[i], &status[i]);
        } else if (sm[i].kind == 3) {
            size_t nb = (size_t)sm[i].h * (size_t)sm[i].w * 3;
            if ((rc = b->memcpy_h2d_async(j->ws + sm[i].img_off, items[i].raw, nb, j->stream)) != PL_OK) {
                *why = "copying a host-decoded image to the device failed";
                goto done;
            }
            j->counts.raw++;
        }
    }

    t = lap(&laps[LAP_CUDA], t);

    /* 3. descriptors */
    int slot;
    if ((rc = ring_slot(j, n, &slot, why)) != PL_OK)
        goto done;
    img_desc *d = j->ring[slot].host;
    int max_rows = 0;
    for (int i = 0; i < n; i++) {
        const int32_t *p = items[i].p;
        memset(&d[i], 0, sizeof d[i]);
        if (status[i] != PL_JPEG_DECODED || sm[i].kind == 0) {
            if (status[i] == PL_JPEG_DECODED)
                status[i] = PL_JPEG_BAD_DATA;
            j->counts.failed++;
            continue;
        }
        d[i].src = j->ws + sm[i].img_off;
        d[i].tmp = j->ws + sm[i].tmp_off;
        d[i].coef = (int *)(void *)(j->ws + sm[i].coef_off);
        d[i].kh = sm[i].kh;
        d[i].kv = sm[i].kv;
        d[i].src_pitch = (long long)sm[i].rw * 3;
        d[i].top = p[0] - sm[i].ry;
        d[i].left = p[1] - sm[i].rx;
        d[i].h = p[2];
        d[i].w = p[3];
        d[i].rh = p[4];
        d[i].rw = p[5];
        d[i].oy = p[6];
        d[i].ox = p[7];
        d[i].flip = p[8] != 0;
        pl_image_rows_read(p[2], p[4], p[6], o->oh, &d[i].y_first, &d[i].ny);
        if (d[i].ny > max_rows)
            max_rows = d[i].ny;
    }
    if ((rc = b->memcpy_h2d_async(j->ring[slot].dev, d, (size_t)n * sizeof(img_desc), j->stream)) != PL_OK) {
        *why = "copying the decoder's descriptors failed";
        goto done;
    }
    if ((rc = b->event_record(j->ring[slot].copied, j->stream)) != PL_OK) {
        *why = "cudaEventRecord failed";
        goto done;
    }
    j->ring[slot].recorded = 1;

    /* 4. the batch's block and the kernels */
    t = lap(&laps[LAP_KERNELS], t);
    if ((rc = pl_block_alloc(blk, out_bytes, j->stream, 1)) != PL_OK) {
        *why = "the batch's device memory could not be allocated";
        goto done;
    }
    t = lap(&laps[LAP_BLOCK], t);
    void *descs = j->ring[slot].dev;
    int ow = o->ow, oh = o->oh, cl = o->channels_last;
    img_affine a;
    memcpy(a.scale, o->scale, sizeof a.scale);
    memcpy(a.bias, o->bias, sizeof a.bias);
    if (max_rows > 0) {
        /* the weight tables (Note [weight tables] in image_kernel.cu), then the horizontal pass;
         * a live sample reads at least one row (pl_image_rows_read), so whenever the vertical
         * pass reads a table, max_rows > 0 and the table was made */
        unsigned gx = (unsigned)(((long long)ow + oh + 255) / 256);
        if (gx > 4096)
            gx = 4096;
        void *wargs[] = {&descs, &oh, &ow};
        if ((rc = pl_cuda_image_launch(j->device, PL_IMAGE_KERNEL_W, gx, (unsigned)n, wargs, j->stream, why)) != PL_OK)
            goto done;
        long long work = (long long)((max_rows + PL_IMAGE_GROUP - 1) / PL_IMAGE_GROUP) * ow;
        gx = (unsigned)((work + 255) / 256);
        if (gx > 4096)
            gx = 4096;
        void *hargs[] = {&descs, &ow};
        if ((rc = pl_cuda_image_launch(j->device, PL_IMAGE_KERNEL_H, gx, (unsigned)n, hargs, j->stream, why)) != PL_OK)
            goto done;
    }
    {
        long long work = (long long)oh * ow;
        unsigned gx = (unsigned)((work + 255) / 256);
        if (gx > 4096)
            gx = 4096;
        void *out = blk->ptr;
        void *vargs[] = {&descs, &out, &oh, &ow, &cl, &a};
        if ((rc = pl_cuda_image_launch(j->device, PL_IMAGE_KERNEL_V + o->dtype, gx, (unsigned)n, vargs, j->stream, why)) != PL_OK)
            goto done;
    }
    if ((rc = b->event_record(blk->ready, j->stream)) != PL_OK) {
        *why = "cudaEventRecord of the batch's ready event failed";
        goto done;
    }
    blk->ready_recorded = 1;
    if ((rc = b->event_record(j->ws_free, j->stream)) != PL_OK) {
        *why = "cudaEventRecord after the batch's kernels failed";
        goto done;
    }
    j->ws_free_recorded = 1;
    lap(&laps[LAP_KERNELS], t);
    j->counts.batches++;
    j->counts.headers_ns += (unsigned long long)laps[LAP_HEADERS];
    j->counts.engines_wait_ns += (unsigned long long)laps[LAP_ENGINES_WAIT];
    j->counts.engines_ns += (unsigned long long)laps[LAP_ENGINES];
    j->counts.cuda_ns += (unsigned long long)laps[LAP_CUDA];
    j->counts.block_ns += (unsigned long long)laps[LAP_BLOCK];
    j->counts.kernels_ns += (unsigned long long)laps[LAP_KERNELS];
done:
    if (rc != PL_OK)
        j->ws_sync_all = 1; /* writes of this batch may be queued after ws_free (the Note) */
    publish_counts(j);
    if (pushed)
        pl_device_pop(b, j->device, prev);
    free(sm);
    free(hw_idx);
    free(hw_data);
    free(hw_len);
    free(hw_dst);
    free(hw_params);
    return rc;
}
