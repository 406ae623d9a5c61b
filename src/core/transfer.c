/* Transfer of one batch: checked layout, pinned reservation, staging, DMA, ready event.
 * No Python. See transfer.h. */
#include "transfer.h"

#include "devgather.h"

#include "pl_nvtx.h"
#include "util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- layout (see Note [batch layout]) ---- */

/* Whether a C-order walk of L reads consecutive bytes. Only called once nbytes is known to fit,
 * and only for leaves with at least one element, so the running products cannot overflow. */
static int leaf_contiguous(const pl_leaf_copy *c)
{
    int64_t expect = (int64_t)c->itemsize;
    for (int i = c->ndim - 1; i >= 0; i--) {
        if (c->shape[i] != 1 && c->strides[i] != expect)
            return 0;
        expect *= c->shape[i];
    }
    return 1;
}

int pl_layout_add(pl_layout *lay, pl_xfer_leaf *L)
{
    pl_leaf_copy *c = &L->copy;
    size_t nbytes = c->itemsize;
    for (int i = 0; i < c->ndim; i++) {
        if (c->shape[i] < 0)
            return PL_LAYOUT_NEGATIVE;
        if (__builtin_mul_overflow(nbytes, (size_t)c->shape[i], &nbytes))
            return PL_LAYOUT_TOO_LARGE;
    }
    if (nbytes > PL_LAYOUT_MAX_BYTES)
        return PL_LAYOUT_TOO_LARGE;
    /* nbytes <= PTRDIFF_MAX: rounding up to PL_ALIGN cannot wrap a size_t. */
    size_t aligned = PL_ALIGN_UP(nbytes, PL_ALIGN);
    const int gathered = L->gather.src != NULL;
    int direct = !gathered && L->direct && nbytes >= PL_DIRECT_MIN_BYTES && leaf_contiguous(c);
    size_t staged = lay->staged, dir = lay->direct, gath = lay->gathered, total, payload;
    size_t table = 0, table_off = 0;
    size_t edge_off = 0, edges = 0;
    int64_t edge_cap = 0;
    if (gathered && nbytes) {
        /* the pair table and the edge items, in the staged area (Note [device gather] in
         * devgather.h) */
        edge_cap = PL_MIN(c->shape[0], L->gather.edge_items);
        if (__builtin_mul_overflow((size_t)c->shape[0], sizeof(pl_gather_pair), &table) ||
            table > PL_LAYOUT_MAX_BYTES ||
            __builtin_mul_overflow((size_t)edge_cap, L->gather.span, &edges) || edges > PL_LAYOUT_MAX_BYTES)
            return PL_LAYOUT_TOO_LARGE;
        table_off = staged;
        if (__builtin_add_overflow(staged, PL_ALIGN_UP(table, PL_ALIGN), &staged))
            return PL_LAYOUT_TOO_LARGE;
        edge_off = staged;
        if (__builtin_add_overflow(staged, PL_ALIGN_UP(edges, PL_ALIGN), &staged))
            return PL_LAYOUT_TOO_LARGE;
    }
    size_t *area = gathered ? &gath : direct ? &dir : &staged;
    size_t off = *area;
    if (__builtin_add_overflow(*area, aligned, area) ||
        __builtin_add_overflow(staged, dir, &total) || __builtin_add_overflow(total, gath, &total) ||
        total > PL_LAYOUT_MAX_BYTES || __builtin_add_overflow(lay->payload, nbytes, &payload))
        return PL_LAYOUT_TOO_LARGE;
    c->nbytes = nbytes;
    L->off = off;
    L->direct = direct;
    L->gather.table_off = table_off;
    L->gather.edge_off = edge_off;
    L->gather.edge_cap = edge_cap;
    lay->staged = staged;
    lay->direct = dir;
    lay->gathered = gath;
    lay->payload = payload;
    return PL_LAYOUT_OK;
}

void pl_layout_finish(const pl_layout *lay, pl_xfer_leaf *leaves, int n)
{
    /* staged + direct + gathered <= PL_LAYOUT_MAX_BYTES was checked leaf by leaf. */
    for (int i = 0; i < n; i++) {
        if (leaves[i].direct)
            leaves[i].off += lay->staged;
        else if (leaves[i].gather.src)
            leaves[i].off += lay->staged + lay->direct;
    }
}

/* ---- the pinned region ---- */

/* Note [pinned bound]
 * Each prefetcher reserves through its own client of its pool (Note [pool clients] in pool.h),
 * so its bound holds within a pool that other prefetchers share, and its stall counters count
 * only its own waits. A prefetcher given no max_pinned_bytes has a bound that follows its
 * batches: (depth + 2) times the largest staged batch seen, plus the pool's rounding slack (at
 * most 1/8, see Note [region sizes] in pool.c), so that depth batches in flight and the next
 * one being staged fit without waiting. The product saturates instead of wrapping, and the
 * bound never goes above the pool's cap (for the default pool, pl_pool_shared_cap()): a batch
 * that cannot fit under it is an error at its position (PoolExhausted), never a reason to
 * page-lock more of the machine. The bound only grows (pl_pool_client_raise_cap). */
static void follow_batch_size(const pl_xfer *x, size_t staged)
{
    size_t per, want;
    if (__builtin_add_overflow(staged, staged / 8 + PL_ALIGN, &per) ||
        __builtin_mul_overflow((size_t)x->depth + 2, per, &want))
        want = SIZE_MAX;
    pl_pool_client_raise_cap(x->pool, x->client, PL_MIN(want, pl_pool_cap(x->pool)));
}

/* The bound a request of the client meets: its own cap within the pool's. */
static size_t effective_cap(const pl_xfer *x)
{
    size_t cap = pl_pool_cap(x->pool);
    if (x->client) {
        pl_pool_client_stats cs;
        pl_pool_client_get_stats(x->pool, x->client, &cs);
        if (cs.cap)
            cap = PL_MIN(cap, cs.cap);
    }
    return cap;
}

/* Reserve the staged area, charged to the client. A wait is counted in the client's stats (and
 * the pool's); times gets this transfer's share of them. */
static int reserve(const pl_xfer *x, size_t n, pl_region **region, pl_xfer_times *times,
                   char *what, size_t what_len)
{
    if (x->cap_follows_batches && x->client)
        follow_batch_size(x, n);
    uint64_t waits0 = 0, waits1 = 0;
    int64_t ns0 = 0, ns1 = 0;
    if (x->client)
        pl_pool_client_waits(x->pool, x->client, &waits0, &ns0);
    int rc = pl_pool_reserve_for(x->pool, x->client, n, -1, x->stop, region);
    if (x->client) {
        /* Only this transfer reserves for the client: the difference is its own wait (the
         * counters alone: the reserve has polled the pool already) */
        pl_pool_client_waits(x->pool, x->client, &waits1, &ns1);
        times->stalled = waits1 > waits0;
        times->stall_ns = ns1 - ns0;
    }
    if (rc == PL_ERR_OVER_CAP)
        snprintf(what, what_len, "a batch of %zu bytes to stage can never fit under the pinned "
                 "cap of %zu bytes (%s)", n, effective_cap(x), x->bound ? x->bound : "the pool's max_bytes");
    else if (rc == PL_ERR_INVALID_VALUE)
        snprintf(what, what_len, "the shared PinnedPool was closed");
    else if (rc != PL_OK)
        snprintf(what, what_len, "reserving %zu pinned bytes", n);
    return rc;
}

/* ---- staging and copies ---- */

typedef struct {
    const pl_xfer *x;
    pl_block *blk;
    pl_region *region;
} chunk_ctx;

static int issue_chunk(void *arg, size_t off, size_t len)
{
    chunk_ctx *c = arg;
    PL_NVTX_PUSH("pinloader.copy");
    int rc = c->x->b->memcpy_h2d_async((char *)c->blk->ptr + off, (char *)c->region->ptr + off, len,
                                       c->x->copy_stream);
    PL_NVTX_POP();
    return rc;
}

/* A copy failed after others were queued: the block's free and the sources' release must
 * still come after them. Record the ready event behind them, or wait for the stream. */
static void mark_ready_after_failure(const pl_xfer *x, pl_block *blk)
{
    if (!blk->ready_recorded && x->b->event_record(blk->ready, x->copy_stream) != PL_OK)
        x->b->stream_synchronize(x->copy_stream);
    blk->ready_recorded = 1;
}

/* Stage the staged leaves into the region, queuing each finished chunk's copy. */
static int stage(const pl_xfer *x, const pl_xfer_leaf *leaves, int n, const pl_layout *lay,
                 pl_region *region, pl_block *blk)
{
    /* The stager wants the staged leaves' copies side by side, in region order. */
    pl_leaf_copy *copies = malloc((size_t)n * sizeof(pl_leaf_copy));
    if (!copies)
        return PL_ERR_NO_MEMORY;
    int staged = 0;
    for (int i = 0; i < n; i++)
        if (!leaves[i].direct && !leaves[i].gather.src) {
            copies[staged] = leaves[i].copy;
            copies[staged].dst = (char *)region->ptr + leaves[i].off;
            staged++;
        }
    chunk_ctx c = {x, blk, region};
    size_t chunk = lay->staged >= 2 * PL_CHUNK_BYTES ? PL_CHUNK_BYTES : 0;
    PL_NVTX_PUSH("pinloader.stage");
    int rc = pl_stager_run(x->stager, copies, staged, region->ptr, lay->staged, chunk, issue_chunk, &c);
    PL_NVTX_POP();
    free(copies);
    return rc;
}

/* The device-gathered leaves' pair tables, into the pinned region (copied with the staged
 * area). */
static int write_tables(const pl_xfer_leaf *leaves, int n, pl_region *region)
{
    for (int i = 0; i < n; i++) {
        const pl_xfer_leaf *L = &leaves[i];
        if (!L->gather.src || !L->copy.nbytes)
            continue;
        pl_gather_pair *t = (pl_gather_pair *)((char *)region->ptr + L->gather.table_off);
        char *edge = (char *)region->ptr + L->gather.edge_off;
        int64_t k;
        /* see Note [device gather] in devgather.h: only small items gain from the sort */
        if (L->gather.span < PL_GATHER_SORT_BELOW) {
            int rc = pl_gather_sort(L->copy.rows, L->copy.shape[0], L->gather.row_stride < 0, t);
            if (rc != PL_OK)
                return rc;
            k = pl_gather_stage_edges(t, L->copy.shape[0], L->copy.src, L->gather.row_stride,
                                      L->gather.span, L->gather.lo, L->gather.hi, edge, L->gather.edge_cap);
        } else {
            k = pl_gather_fill_in_order(L->copy.rows, L->copy.shape[0], t, L->copy.src, L->gather.row_stride,
                                        L->gather.span, L->gather.lo, L->gather.hi, edge, L->gather.edge_cap);
        }
        if (k == -2)
            return PL_ERR_NO_MEMORY;
        if (k < 0)
            return PL_ERR_INVALID_VALUE; /* cannot happen: edge_cap bounds the distinct edges */
    }
    return PL_OK;
}

/* Note [mapped tables]
 * A device gather's kernel reads its pair table and edge items from the staged area. When the
 * staged area holds nothing else (every array leaf of the batch is device-gathered, as in an
 * ArrayLoader whose sources are registered), the kernel reads them straight from the pinned
 * region, which host_alloc mapped for every device, and the staged area is not copied at all.
 * Copied, the table's DMA would sit on the copy stream between the previous batch's kernel and
 * this one's, a gap of a few microseconds per batch in a pipeline whose kernels run back to
 * back; read in place, each row's pair crosses the link once more (16 bytes per item, which
 * the GPU's cache shares among the threads that copy the row). The region is released after
 * the copy stream passes the kernel, as any staged region after its copy. Where the runtime
 * gives no device address for the region, the staged area, tables included, is copied to the
 * device block and the kernel reads the tables there. */

/* Whether any leaf is staged by the host (its bytes in the staged area besides the tables). */
static int has_host_staged(const pl_xfer_leaf *leaves, int n)
{
    for (int i = 0; i < n; i++)
        if (!leaves[i].direct && !leaves[i].gather.src && leaves[i].copy.nbytes)
            return 1;
    return 0;
}

/* Queue the device-gathered leaves' kernels, after the staged area's copies (their tables);
 * tables: where the kernel reads the staged area (the batch's block, or the pinned region's
 * device address: Note [mapped tables]). The launch is the backend's gather_launch: on CUDA,
 * cuda_gather_launch in backend_cuda.c, the kernels pl_gather_{1,2,4,8,16} of gather_kernel.cu (built into
 * gather_kernel_image.h); on the host backend, run_gather in backend_host.c. */
static int launch_gathers(const pl_xfer *x, const pl_xfer_leaf *leaves, int n, pl_block *blk,
                          const char *tables)
{
    for (int i = 0; i < n; i++) {
        const pl_xfer_leaf *L = &leaves[i];
        if (!L->gather.src || !L->copy.nbytes)
            continue;
        pl_gather_args g = {(char *)blk->ptr + L->off,
                            (const pl_gather_pair *)(tables + L->gather.table_off),
                            L->gather.src, tables + L->gather.edge_off,
                            L->gather.row_stride, L->gather.span, L->copy.shape[0], x->device};
        PL_NVTX_PUSH("pinloader.gather");
        int rc = x->b->gather_launch(&g, x->copy_stream);
        PL_NVTX_POP();
        if (rc != PL_OK)
            return rc;
    }
    return PL_OK;
}

int pl_transfer(const pl_xfer *x, pl_xfer_leaf *leaves, int n, const pl_layout *lay, pl_block *blk,
                pl_xfer_times *times, char *what, size_t what_len)
{
    const pl_backend *b = x->b;
    pl_region *region = NULL;
    int rc;
    memset(times, 0, sizeof(*times));
    if (lay->staged && (rc = reserve(x, lay->staged, &region, times, what, what_len)) != PL_OK)
        return rc;
    rc = b->set_device(x->device);
    if (rc == PL_OK)
        rc = pl_block_alloc(blk, pl_layout_bytes(lay), x->copy_stream, 1);
    if (rc != PL_OK) {
        if (region)
            pl_pool_release(x->pool, region);
        snprintf(what, what_len, "allocating device memory for the batch");
        return rc;
    }
    const char *tables = (const char *)blk->ptr;
    if (region) {
        int64_t t0 = pl_now_ns();
        int mapped = 0;
        if (lay->gathered) {
            rc = write_tables(leaves, n, region);
            times->sort_ns = pl_now_ns() - t0;
            t0 = pl_now_ns();
            void *dev = NULL; /* see Note [mapped tables] */
            if (rc == PL_OK && !has_host_staged(leaves, n) && b->host_device_ptr(region->ptr, &dev) == PL_OK && dev) {
                tables = dev;
                mapped = 1;
            }
        }
        if (rc == PL_OK && !mapped)
            rc = stage(x, leaves, n, lay, region, blk);
        times->staging_ns = pl_now_ns() - t0;
        if (rc != PL_OK) {
            /* Some copies may be queued: release only after the stream passes them. */
            mark_ready_after_failure(x, blk);
            pl_pool_release_after(x->pool, region, x->copy_stream);
            snprintf(what, what_len, rc == PL_ERR_NO_MEMORY ? "staging" : "cudaMemcpyAsync of a staged chunk");
            return rc;
        }
    }
    int64_t t1 = pl_now_ns();
    for (int i = 0; rc == PL_OK && i < n; i++) {
        const pl_xfer_leaf *L = &leaves[i];
        if (L->direct)
            rc = b->memcpy_h2d_async((char *)blk->ptr + L->off, L->copy.src, L->copy.nbytes,
                                     x->copy_stream);
    }
    if (rc == PL_OK)
        rc = launch_gathers(x, leaves, n, blk, tables);
    if (rc == PL_OK) {
        rc = b->event_record(blk->ready, x->copy_stream);
        blk->ready_recorded = rc == PL_OK;
    }
    if (region)
        pl_pool_release_after(x->pool, region, x->copy_stream);
    times->issue_ns = pl_now_ns() - t1;
    if (rc != PL_OK) {
        mark_ready_after_failure(x, blk);
        snprintf(what, what_len, "queuing the batch copy (or its device gather)");
    }
    return rc;
}
