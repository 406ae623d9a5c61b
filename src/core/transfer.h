/* Transfer: one batch's leaves from host memory to one device block. The layout (every size and
 * offset, computed with checked arithmetic), the pinned reservation under a cap policy, staging
 * with the stager, the DMA in chunks on the copy stream, and the ready event.
 *
 * No Python here: the producer runs all of it without the GIL. It knows nothing of where the
 * leaves came from, so any source that can describe its batch as leaves uses it: the
 * AsyncPrefetcher's flatten (flat_leaves.c), with array leaves, row-gathered leaves (staged by
 * the stager, Note [row gather] in stager.c) and device-gathered leaves (read by a kernel, Note
 * [device gather] in devgather.h). */
#ifndef PL_TRANSFER_H
#define PL_TRANSFER_H

#include "backend.h"
#include "block.h"
#include "pool.h"
#include "stager.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* Leaves already pinned and contiguous, at least this big, are copied by DMA straight from the
 * source instead of being staged. */
#define PL_DIRECT_MIN_BYTES ((size_t)64 << 10)
/* Batches are staged and copied in chunks of this size once they are twice as big: staging
 * one chunk overlaps the copy of the one before. -DPL_CHUNK_BYTES=... builds another size, to
 * compare (benchmarks/results/design_measurements.md). */
#ifndef PL_CHUNK_BYTES
#define PL_CHUNK_BYTES ((size_t)8 << 20)
#endif
/* No leaf, and no batch, may need more bytes than this: every offset fits a ptrdiff_t, so
 * `base + off` never wraps, and sums of two sizes never overflow a size_t. */
#define PL_LAYOUT_MAX_BYTES ((size_t)PTRDIFF_MAX)

/* A leaf whose rows a kernel reads from registered host memory (Note [device gather]). */
typedef struct pl_xfer_gather {
    const char *src;    /* the device's address of the source's row 0; NULL: not device-gathered */
    int64_t row_stride; /* bytes */
    size_t span;        /* bytes per item (one row, or one window) */
    const char *lo, *hi; /* the registered host range: items outside it are staged edges */
    int64_t edge_items; /* the most distinct items of the source outside [lo, hi) */
    size_t table_off;   /* the pair table's offset in the staged area (set by layout) */
    size_t edge_off;    /* the staged edge items' offset (set by layout) */
    int64_t edge_cap;   /* room for this many edge items there (set by layout) */
} pl_xfer_gather;

typedef struct pl_xfer_leaf {
    pl_leaf_copy copy; /* the source: pointer, shape, byte strides, itemsize; nbytes set by layout;
                        * with gather.src, copy.rows and copy.shape[0] are the items */
    size_t off;        /* offset in the device block (final after pl_layout_finish) */
    int direct;        /* copied by DMA straight from the source (set by layout) */
    pl_xfer_gather gather;
} pl_xfer_leaf;

/* Note [batch layout]
 * A batch's device block holds its staged leaves first, then its direct and device-gathered
 * leaves; each leaf starts PL_ALIGN-aligned. The pinned region holds only the staged area, at
 * the same offsets: the staged leaves and the pair tables of device-gathered leaves.
 * pl_layout_add is the one place that turns a leaf's shape and itemsize into bytes and offsets:
 * every product and sum is checked (__builtin_*_overflow) and bounded by PL_LAYOUT_MAX_BYTES,
 * before anything is allocated and before any output object exists. The caller turns a refusal
 * into an error naming the leaf. */
typedef struct pl_layout {
    size_t staged;  /* bytes of the pinned region (and the start of the direct area) */
    size_t direct;  /* bytes of the direct area */
    size_t gathered; /* bytes of the device-gathered area, after the direct one */
    size_t payload; /* sum of the leaves' nbytes: what stats() calls bytes; the rest is padding */
} pl_layout;

enum {
    PL_LAYOUT_OK = 0,
    PL_LAYOUT_NEGATIVE = 1,  /* a negative shape entry */
    PL_LAYOUT_TOO_LARGE = 2, /* the leaf, or the batch with it, exceeds PL_LAYOUT_MAX_BYTES */
};

/* Bytes of the batch's device block. */
static inline size_t pl_layout_bytes(const pl_layout *lay)
{
    return lay->staged + lay->direct + lay->gathered;
}

/* Add leaf L (copy.ndim, copy.shape, copy.strides, copy.itemsize set; L->direct set when the
 * source is pinned memory) to the layout: sets copy.nbytes, L->off and whether it really goes
 * direct. Returns PL_LAYOUT_OK or a refusal; on refusal lay is unchanged. */
int pl_layout_add(pl_layout *lay, pl_xfer_leaf *L);
/* Once every leaf is added: move the direct leaves' offsets behind the staged area. */
void pl_layout_finish(const pl_layout *lay, pl_xfer_leaf *leaves, int n);

/* What a transfer needs; owned by the caller (the prefetcher), read-only during a transfer. */
typedef struct pl_xfer {
    const pl_backend *b;
    int device;
    pl_pool *pool;
    pl_pool_client *client;  /* the caller's bound within pool (Note [pool clients] in pool.h) */
    int cap_follows_batches; /* the client's cap follows the batches: Note [pinned bound] */
    const char *bound;       /* what sets the bound, for PoolExhausted: "max_pinned_bytes", ... */
    int depth;
    pl_stager *stager;
    pl_stream *copy_stream;
    const atomic_int *stop;  /* a reserve waiting for room gives up when it becomes non-zero */
} pl_xfer;

/* What one transfer measured, for the caller's stats. */
typedef struct pl_xfer_times {
    int stalled;        /* the reserve had to wait for pinned memory to come back */
    int64_t stall_ns;
    int64_t staging_ns;
    int64_t issue_ns;
    int64_t sort_ns;    /* building the device gathers' pair tables */
} pl_xfer_times;

/* Copy the batch: reserve the pinned region, allocate blk's device memory, stage, queue the
 * copies, record blk's ready event. Returns PL_OK, or an error code with `what` (a sentence
 * without the item's position) filled; after an error, blk's ready event still comes after any
 * copy that was queued. */
int pl_transfer(const pl_xfer *x, pl_xfer_leaf *leaves, int n, const pl_layout *lay, pl_block *blk,
                pl_xfer_times *times, char *what, size_t what_len);

#endif
