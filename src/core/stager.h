/* The stager: gathers array leaves (any strides) into one contiguous pinned region with several
 * threads, reporting finished chunks in order so the caller can start each chunk's DMA while
 * later chunks are still being staged. No Python, no backend calls. */
#ifndef PL_STAGER_H
#define PL_STAGER_H

#include <stddef.h>
#include <stdint.h>

#define PL_MAX_DIMS 64

typedef struct pl_leaf_copy {
    char *dst;              /* contiguous destination */
    const char *src;        /* address of element [0, ..., 0] */
    int ndim;
    int64_t shape[PL_MAX_DIMS];
    int64_t strides[PL_MAX_DIMS]; /* in bytes, any sign */
    size_t itemsize;
    size_t nbytes;
    /* Optional dim-0 index table (see Note [row gather] in stager.c): when set, element
     * (i0, i1, ...) is at src + rows[i0] * strides[0] + i1 * strides[1] + ..., and rows has
     * shape[0] entries, each already validated against the source's extent. */
    const int64_t *rows;
} pl_leaf_copy;

typedef struct pl_stager pl_stager;

/* nthreads counts the calling thread: nthreads - 1 workers are started. */
int pl_stager_create(int nthreads, pl_stager **out);
void pl_stager_destroy(pl_stager *s);
int pl_stager_threads(const pl_stager *s);
/* Bytes staged with streaming stores so far, by every stager of the process (Note
 * [non-temporal staging stores] in stager.c); a counter for the tests. */
unsigned long long pl_stager_streamed_bytes(void);

/* Called on the calling thread, in order, for each finished chunk [off, off + len) of the
 * region; a non-zero return stops reporting (staging still finishes) and is returned. */
typedef int (*pl_chunk_fn)(void *arg, size_t off, size_t len);

/* Stage n leaves into the region starting at base (each leaf's dst lies inside
 * [base, base + total)). Chunks are chunk_bytes long (0: one chunk). */
int pl_stager_run(pl_stager *s, pl_leaf_copy *leaves, int n, char *base, size_t total,
                  size_t chunk_bytes, pl_chunk_fn on_chunk, void *arg);

/* Simplify a leaf in place: drop size-1 dimensions, merge dimensions that are contiguous with
 * each other. Afterwards ndim >= 1. A leaf with a rows table keeps its dim 0 as it is and
 * simplifies only the dimensions after it. */
void pl_leaf_collapse(pl_leaf_copy *L);
/* Copy elements [start, start + count) of L (row-major order) to dst. With a rows table, whole
 * rows in the range are read in source-address order (see Note [row gather]). */
void pl_leaf_gather(char *dst, const pl_leaf_copy *L, int64_t start, int64_t count);

#endif
