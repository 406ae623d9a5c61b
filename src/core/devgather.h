/* Device gather: rows of a source in host memory read by a GPU kernel straight into a batch's
 * device block, and the registry of the host ranges registered for it. No Python.
 *
 * Note [device gather]
 * The host gather (stager.c, Note [row gather]) touches host memory three times per byte: the
 * staging threads read the rows and write the pinned region, then the DMA engine reads it
 * again. When a source is registered with the driver (page-locked and mapped, pl_hostreg
 * below), a kernel on the copy stream can read the rows itself: one touch, no staging threads,
 * no pinned slab for the data. A device-gathered leaf of a batch takes:
 * - its output area in the device block like any leaf (the "direct" area of the layout: no
 *   pinned bytes, see Note [batch layout] in transfer.h);
 * - a table of pl_gather_pair {source row, batch slot}, one per item, written by the producer
 *   into the batch's pinned region (16 bytes per item); the kernel reads it there, through
 *   the region's device address, or from the device block when the staged area is copied
 *   (Note [mapped tables] in transfer.c). Every item lands in its own slot whatever the
 *   table's order, so the batch is exactly source[rows]. Items under PL_GATHER_SORT_BELOW
 *   bytes are sorted by source row, so that consecutive threads read consecutive host
 *   addresses; larger ones stay in batch order. Small rows read in batch order scatter a
 *   warp's loads over many pages and lines, and sorting them makes the kernel up to several
 *   times faster; from 256
 *   bytes on a warp's loads cover whole rows either way and the order buys little or nothing,
 *   while the producer's sort (some nanoseconds a row) takes longer than the kernel's time for
 *   the batch and makes the producer the bound. Below 256 bytes the host gather is faster than
 *   either (ArrayLoader's gather="auto"). The measurements:
 *   benchmarks/results/design_measurements.md.
 * The kernel is queued on the copy stream after the staged area's copies and before the
 * batch's ready event: the consumer's stream-side wait, the block's lifetime and the stats are
 * the same as for any batch. The RowGather (and with it the registration and the source) is
 * kept until that event has completed (Note [producer and the GIL] in prefetcher.c).
 * Only whole pages that lie inside the source are registered (Note [registered sources]); the
 * few items that reach into its first or last partial page (at most the items touching one
 * page at each end) are copied by the producer into the staged area after the table, once
 * each however often the batch repeats them, and their pairs name that copy (row = -1 - k).
 * An item is one span of bytes in the source: a row whose inner dimensions are C-contiguous,
 * or with windows a run of rows when the row stride equals the row size. Any row stride
 * (negative included) and any alignment work; the kernel moves the widest unit (16, 8, 4, 2 or
 * 1 bytes) that divides the source address, the row stride and the span. */
#ifndef PL_DEVGATHER_H
#define PL_DEVGATHER_H

#include "backend.h"

#include <stddef.h>
#include <stdint.h>

typedef struct pl_gather_pair {
    int64_t row;  /* source row, or window start */
    int64_t slot; /* position in the batch */
} pl_gather_pair;

/* One launch: n items of `span` bytes, item pair.slot written at dst + slot * span from the
 * device address src + pair.row * row_stride. */
struct pl_gather_args {
    char *dst;                   /* device */
    const pl_gather_pair *table; /* device, n entries */
    const char *src;             /* the device's address of the source's row 0 */
    const char *edge;            /* device: the staged edge items (pair.row = -1 - k) */
    int64_t row_stride;          /* bytes, any sign */
    size_t span;                 /* bytes per item, > 0 */
    int64_t n;                   /* items, > 0 */
    int device;
};

/* The widest unit (16, 8, 4, 2, 1) dividing the source address, the row stride and the span. */
int pl_gather_unit(const pl_gather_args *g);

/* Fill `out` with n pairs (rows[i], i) sorted by source address (row * sign of the stride),
 * ties by slot. Radix sort on the producer thread: O(n) for the batch sizes that matter. */
int pl_gather_sort(const int64_t *rows, int64_t n, int descending, pl_gather_pair *out);
/* Items of at least this many bytes are gathered in batch order, smaller ones sorted: see
 * Note [device gather]. */
#define PL_GATHER_SORT_BELOW 256

/* Items of a source (n_items of `span` bytes, row 0 at host address src, rows `stride` apart)
 * that do not lie inside the registered host range [lo, hi): the most edge copies a batch can
 * need. */
int64_t pl_gather_edge_items(const char *src, int64_t stride, size_t span, int64_t n_items,
                             const char *lo, const char *hi);
/* Mark the pairs whose items lie outside [lo, hi) as edge items and copy each distinct one
 * (pairs sorted by row, pl_gather_sort: repeats are adjacent) to edge + k * span. Returns the
 * number of distinct edge items, or -1 if more than cap. */
int64_t pl_gather_stage_edges(pl_gather_pair *t, int64_t n, const char *src, int64_t stride,
                              size_t span, const char *lo, const char *hi, char *edge, int64_t cap);
/* The table in batch order, in one pass: pair i is (rows[i], i), or (-1 - k, i) for an item
 * outside [lo, hi), each distinct one copied once to edge + k * span. Returns the number of
 * distinct edge items, -1 if more than cap, -2 if out of memory. */
int64_t pl_gather_fill_in_order(const int64_t *rows, int64_t n, pl_gather_pair *t, const char *src,
                                int64_t stride, size_t span, const char *lo, const char *hi, char *edge,
                                int64_t cap);

/* ---- registered host ranges ---- */

/* Note [registered sources]
 * A source is registered once, as its page-rounded address range, and shared: loaders over the
 * same buffer (or over views inside one registered range) take a reference on the same entry;
 * the range is unregistered when the last reference goes. Only the whole pages inside the
 * source are registered, never the partial pages at its ends: those may hold other data (a
 * small array shares them with its heap neighbours), and a registration reaching into them
 * makes the driver treat a neighbour's buffer that starts there as page-locked memory, so
 * that a later copy into it that runs past the registered page fails (torch's .cpu() into
 * such a buffer fails with cudaErrorInvalidValue). Items in the partial pages take the
 * staged path of Note [device gather]. Registrations are writable; read-only only where the
 * memory registers no other way (a read-only file mapping). A range that overlaps existing
 * entries (views of one buffer) takes references on them and registers only the gaps between
 * them, as new entries (the pieces are read as one range where devices use the host's
 * addresses, as every device with unified addressing on Linux does; otherwise such a source is
 * refused). Memory that is already page-locked
 * (a pinned torch tensor, a PinnedPool buffer, a range another library registered) is used as
 * it is, never registered twice and never unregistered by pinloader; it does not count against
 * the budget. The registered bytes of a process are bounded by a budget the caller passes
 * (ArrayLoader's max_registered_bytes; default pl_hostreg_default_budget()): registering a
 * dataset locks it in RAM, so a source that does not fit comfortably is refused and the caller
 * falls back to the host gather. The registry's mutex is held across the driver call
 * (registering a GiB takes ~0.1-0.2 s) so two loaders registering the same range never race;
 * nothing on a data path takes it: readers use the entry's immutable fields. In a fork()
 * child the parent's entries are inherited: their memory is still mapped in the child (the
 * child can read the arrays), but they are never unregistered there, and new registrations in
 * the child start an own registry. */
typedef struct pl_hostreg pl_hostreg;

enum {
    PL_REG_OK = 0,
    PL_REG_OVER_BUDGET = 1, /* the range does not fit in the budget */
    PL_REG_OVERLAP = 2,     /* the range overlaps a registered range without lying inside it */
    PL_REG_REFUSED = 3,     /* the driver refused (code in *err) */
};

/* Take a reference on the registration of [lo, lo + n) for backend b, registering it if
 * needed. Returns PL_REG_OK with *out set, or a refusal (*err: the backend's code, for
 * PL_REG_REFUSED). */
int pl_hostreg_acquire(const pl_backend *b, const void *lo, size_t n, size_t budget,
                       int prefer_read_only, pl_hostreg **out, int *err);
void pl_hostreg_release(pl_hostreg *r);
/* A second handle on the same range (its entries stay registered until both are released), or
 * NULL when out of memory: a RowGather holds its own, so closing the Registration it was made
 * with cannot unregister what its batches still read. */
pl_hostreg *pl_hostreg_dup(const pl_hostreg *r);
/* The device's address of host address p inside r. */
const char *pl_hostreg_device_ptr(const pl_hostreg *r, const void *p);
/* 1 if [p, p + n) lies inside r. */
int pl_hostreg_covers(const pl_hostreg *r, const void *p, size_t n);
const pl_backend *pl_hostreg_backend(const pl_hostreg *r);
/* The host range the handle covers (page aligned). */
const char *pl_hostreg_base(const pl_hostreg *r);
/* Bytes of the page-rounded range, and whether pinloader registered it (0: already pinned). */
size_t pl_hostreg_bytes(const pl_hostreg *r);
int pl_hostreg_owned(const pl_hostreg *r);
int pl_hostreg_read_only(const pl_hostreg *r);
/* Bytes pinloader holds registered for b in this process, and the default budget: the default
 * pinned pool's shared cap (a quarter of RAM, at most half of RLIMIT_MEMLOCK, divided among
 * LOCAL_WORLD_SIZE ranks). */
size_t pl_hostreg_total(const pl_backend *b);
size_t pl_hostreg_default_budget(void);
void pl_hostreg_atfork_child(void);

#endif
