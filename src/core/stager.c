/* Multi-threaded staging into pinned memory.
 *
 * Note [staging pieces]
 * Each leaf is cut into pieces of at most PIECE_BYTES; every chunk of the region counts the
 * pieces that overlap it. Workers (and the calling thread, between reports) take pieces in
 * region order from a shared counter, so chunks finish roughly in order and the caller can
 * start the DMA of chunk i while chunk i + 1 is being staged. The calling thread reports chunk
 * i only when every piece overlapping it is done, in increasing order.
 *
 * Note [row gather]
 * A leaf with a rows table (pl_leaf_copy.rows) is a gather of whole rows of a larger source:
 * element (i0, i1, ...) is read from src + rows[i0] * strides[0] + i1 * strides[1] + ..., so
 * dim 0 is never dropped or merged by pl_leaf_collapse (its stride is applied through the
 * table), while the dimensions inside a row simplify as usual. A window of L consecutive rows
 * is the same thing with one more dimension: shape (n, L, ...), strides (s0, s0, ...), rows =
 * the window starts. Pieces of such a leaf hold whole rows where a row fits in a piece, and
 * within a piece the rows are read in source-address order and written to their batch
 * positions: consecutive reads then walk a memory-mapped file forwards (the kernel's
 * read-ahead and the page cache see a sequential scan) and share pages and TLB entries. Rows
 * under SORT_MIN_ROW_BYTES are read in batch order: sorting them costs more than it saves
 * (with 64-byte rows the sort was most of the gather's time). Contiguous rows of a power-of-two
 * size up to 256 bytes are copied by a loop with the size known to the compiler, so each row is
 * a few vector moves instead of a memcpy call. Rows read in batch order are prefetched
 * PREFETCH_ROWS rows ahead (a contiguous row's lines up to PREFETCH_MAX_BYTES, else its first): the
 * loads are independent, but a core's out-of-order window holds only the misses of the next
 * few rows, so short random rows from a source far larger than the caches waited on memory one
 * handful at a time; asked for 64 rows ahead, a batch of random 64-byte rows took about half
 * the time on one host (benchmarks/results/design_measurements.md, "software prefetch in the
 * row gather").
 * PINLOADER_ROW_PREFETCH=0 turns the prefetch off (for measurement), read when a stager is
 * created, for that stager, as PINLOADER_STAGING_NT is. */
#include "stager.h"
#include "backend.h"
#include "util.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#define PL_HAVE_NT_STORES 1
#endif

#define PIECE_BYTES ((size_t)256 << 10) /* a 4 MiB batch is 16 pieces: every thread gets work */
#define INLINE_BYTES ((size_t)256 << 10) /* below this, one thread does it all */
#define SORT_MIN_ROW_BYTES 4096 /* see Note [row gather] */
#define SORT_GROUP 256         /* rows sorted together, on the stack */
#define PREFETCH_ROWS 64       /* rows asked for ahead of the one copied: Note [row gather] */
#define PREFETCH_MAX_BYTES 1024 /* of a row, at most; the hardware prefetcher follows the rest */

/* Note [non-temporal staging stores]
 * The staged region is read next by the copy engine, not by a CPU, so writing it through the
 * caches only costs: every cache line written is first read from memory (read-for-ownership)
 * and later evicted, three memory transfers per byte where streaming stores need two. glibc's
 * memcpy switches to streaming stores only above a threshold of about 3/4 of the shared cache
 * (tens to hundreds of MiB), far above a 1 MiB piece. So contiguous pieces of jobs of at least
 * NT_MIN_BYTES are copied with SSE2 streaming stores, followed by an sfence before the piece
 * is counted done (streaming stores are weakly ordered; the fence and the release decrement
 * make them visible before the chunk's DMA is issued). Smaller jobs keep memcpy:
 * their lines may still be in cache when the DMA (which snoops) reads them. Row gathers of
 * such jobs (Note [row gather]) stream too, row by row, where a row is contiguous and at least
 * NT_MIN_ROW_BYTES long, but only in a job of one chunk: such a batch is staged whole before
 * its one DMA starts, so staging is the step to shorten. In a chunked job the copy engine reads
 * each chunk right after it was staged, in steady state it is the bottleneck, and it reads
 * cached lines without a trip to memory, so streaming them out first would slow it. Shorter
 * rows keep the cached copies: a call per row, and lines only partly written. The
 * measurements behind these thresholds: benchmarks/results/design_measurements.md.
 * PINLOADER_STAGING_NT=0 / =1 turns streaming off / on for every job, chunked row gathers
 * included (for measurement), read when a stager is created. */
#define NT_MIN_BYTES ((size_t)4 << 20)
/* Bytes staged through the streaming path (process-wide, all stagers), for the tests: the rule
 * above has no other visible effect. */
static atomic_ullong streamed_bytes;

unsigned long long pl_stager_streamed_bytes(void)
{
    return atomic_load_explicit(&streamed_bytes, memory_order_relaxed);
}
#define NT_MIN_ROW_BYTES ((size_t)4096)

typedef struct {
    int leaf;
    int64_t start, count;
    size_t off, len; /* bytes within the region */
} piece;

typedef struct {
    pl_leaf_copy *leaves;
    piece *pieces;
    size_t n_pieces;
    atomic_size_t next;     /* next piece to take */
    atomic_int *chunk_left; /* pieces not yet done per chunk */
    size_t n_chunks, chunk_bytes;
    char *base;
    int nt, nt_rows; /* see Note [non-temporal staging stores] */
    int prefetch;    /* rows read in batch order are prefetched: Note [row gather] */
} job;

struct pl_stager {
    int nthreads;
    int nt_mode; /* -1: by job size, 0: never, 1: always; see Note [non-temporal staging stores] */
    int prefetch; /* 0 with PINLOADER_ROW_PREFETCH=0: Note [row gather] */
    pthread_t *workers;
    int n_workers;
    pthread_mutex_t mu;
    pthread_cond_t work_cv;  /* workers wait here for a new job */
    pthread_cond_t done_cv;  /* the caller waits here for chunks and for workers to leave */
    job *cur;                /* guarded by mu */
    uint64_t gen;            /* guarded by mu: bumped per job */
    int busy;                /* guarded by mu: workers inside the current job */
    int stop;                /* guarded by mu */
};

/* ---- gather ---- */

void pl_leaf_collapse(pl_leaf_copy *L)
{
    /* dim 0 of a row-gathered leaf stays as it is: see Note [row gather] */
    const int keep = L->rows ? 1 : 0;
    int nd = keep;
    for (int d = keep; d < L->ndim; d++) {
        if (L->shape[d] == 1)
            continue;
        L->shape[nd] = L->shape[d];
        L->strides[nd] = L->strides[d];
        nd++;
    }
    int out = keep;
    for (int d = keep; d < nd; d++) {
        if (out > keep && L->strides[out - 1] == L->shape[d] * L->strides[d]) {
            L->shape[out - 1] *= L->shape[d];
            L->strides[out - 1] = L->strides[d];
            continue;
        }
        L->shape[out] = L->shape[d];
        L->strides[out] = L->strides[d];
        out++;
    }
    if (out == 0) {
        L->shape[0] = 1;
        L->strides[0] = (int64_t)L->itemsize;
        out = 1;
    }
    L->ndim = out;
}

static void copy_strided(char *dst, const char *src, int64_t n, int64_t stride, size_t isz)
{
    switch (isz) {
#define CASE(T)                                                  \
    case sizeof(T):                                              \
        for (int64_t i = 0; i < n; i++, src += stride)           \
            memcpy(dst + (size_t)i * sizeof(T), src, sizeof(T)); \
        return;
        CASE(uint8_t)
        CASE(uint16_t)
        CASE(uint32_t)
        CASE(uint64_t)
#undef CASE
    default:
        for (int64_t i = 0; i < n; i++, src += stride, dst += isz)
            memcpy(dst, src, isz);
    }
}

static int gather_rows(char *dst, const pl_leaf_copy *L, int64_t start, int64_t count, int nt, int prefetch);
static void copy_streaming(char *dst, const char *src, size_t n);

void pl_leaf_gather(char *dst, const pl_leaf_copy *L, int64_t start, int64_t count)
{
    if (L->rows) {
        /* no stager here (the host backend's gather): the prefetch is on, as by default */
        gather_rows(dst, L, start, count, 0, 1);
        return;
    }
    const int nd = L->ndim;
    const size_t isz = L->itemsize;
    int64_t idx[PL_MAX_DIMS];
    int64_t rem = start;
    const char *src = L->src;
    for (int d = nd - 1; d >= 0; d--) {
        idx[d] = rem % L->shape[d];
        rem /= L->shape[d];
        src += idx[d] * L->strides[d];
    }
    const int64_t inner = L->shape[nd - 1], is = L->strides[nd - 1];
    while (count > 0) {
        int64_t run = PL_MIN(inner - idx[nd - 1], count);
        if (is == (int64_t)isz)
            memcpy(dst, src, (size_t)run * isz);
        else
            copy_strided(dst, src, run, is, isz);
        dst += (size_t)run * isz;
        count -= run;
        idx[nd - 1] += run;
        src += run * is;
        for (int d = nd - 1; d > 0 && idx[d] == L->shape[d]; d--) {
            src -= L->shape[d] * L->strides[d];
            idx[d] = 0;
            idx[d - 1]++;
            src += L->strides[d - 1];
        }
    }
}

/* One row of a row-gathered leaf as a plain leaf (dims 1.. of L). */
static void row_leaf(const pl_leaf_copy *L, pl_leaf_copy *R)
{
    R->rows = NULL;
    R->itemsize = L->itemsize;
    if (L->ndim == 1) {
        R->ndim = 1;
        R->shape[0] = 1;
        R->strides[0] = (int64_t)L->itemsize;
    } else {
        R->ndim = L->ndim - 1;
        memcpy(R->shape, L->shape + 1, (size_t)R->ndim * sizeof(int64_t));
        memcpy(R->strides, L->strides + 1, (size_t)R->ndim * sizeof(int64_t));
    }
}

/* Copy elements [start, start + count) of row i; contiguous rows with streaming stores when
 * nt (see Note [non-temporal staging stores]; the caller fences). */
static void copy_row_part(char *dst, const pl_leaf_copy *L, pl_leaf_copy *R, int contiguous, int nt,
                          int64_t i, int64_t start, int64_t count)
{
    R->src = L->src + L->rows[i] * L->strides[0];
    if (contiguous && nt)
        copy_streaming(dst, R->src + start * (int64_t)L->itemsize, (size_t)count * L->itemsize);
    else if (contiguous)
        memcpy(dst, R->src + start * (int64_t)L->itemsize, (size_t)count * L->itemsize);
    else
        pl_leaf_gather(dst, R, start, count);
}

/* Each cache line that the n bytes at p touch, once, asked for ahead of the row's copy (Note
 * [row gather]): a row inside one line costs one prefetch. */
static inline void prefetch_row(const char *p, size_t n)
{
    const uintptr_t end = (uintptr_t)p + (n ? n : 1);
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < end; a += 64)
        __builtin_prefetch((const void *)a);
}

typedef struct {
    int64_t key; /* source offset of the row, in stride units with the sign of the stride */
    int64_t pos; /* batch position */
} row_ref;

static int cmp_row_ref(const void *a, const void *b)
{
    const row_ref *x = a, *y = b;
    if (x->key != y->key)
        return x->key < y->key ? -1 : 1;
    return x->pos < y->pos ? -1 : x->pos > y->pos;
}

/* See Note [row gather]. Returns whether the rows went through streaming stores. */
static int gather_rows(char *dst, const pl_leaf_copy *L, int64_t start, int64_t count, int nt, int prefetch)
{
    pl_leaf_copy R;
    row_leaf(L, &R);
    int64_t row = 1;
    for (int d = 0; d < R.ndim; d++)
        row *= R.shape[d];
    const size_t isz = L->itemsize;
    const size_t row_bytes = (size_t)row * isz;
    const int contiguous = R.ndim == 1 && (R.shape[0] == 1 || R.strides[0] == (int64_t)isz);
    nt = nt && contiguous && row_bytes >= NT_MIN_ROW_BYTES;
    int64_t i = start / row, off = start % row;
    if (off && count > 0) { /* the end of a row a previous piece started */
        int64_t n = PL_MIN(count, row - off);
        copy_row_part(dst, L, &R, contiguous, nt, i, off, n);
        dst += (size_t)n * isz;
        count -= n;
        i++;
    }
    int64_t whole = count / row;
    /* rows ahead of the copied one that are prefetched; past every row when switched off */
    const int64_t ahead = prefetch ? PREFETCH_ROWS : INT64_MAX / 2;
    if (contiguous && whole > 0 && row_bytes <= 256 && (row_bytes & (row_bytes - 1)) == 0) {
        const char *src = L->src;
        const int64_t s0 = L->strides[0], *r = L->rows + i;
        switch (row_bytes) {
#define ROWS(N)                                                            \
    case N:                                                                \
        for (int64_t k = 0; k < whole; k++) {                              \
            if (k + ahead < whole)                                         \
                prefetch_row(src + r[k + ahead] * s0, N);                  \
            memcpy(dst + (size_t)k * N, src + r[k] * s0, N);               \
        }                                                                  \
        break;
            ROWS(1) ROWS(2) ROWS(4) ROWS(8) ROWS(16) ROWS(32) ROWS(64) ROWS(128) ROWS(256)
#undef ROWS
        }
        dst += (size_t)whole * row_bytes;
        count -= whole * row;
        i += whole;
        whole = 0;
    }
    const int64_t sign = L->strides[0] < 0 ? -1 : 1;
    /* a contiguous row's lines up to PREFETCH_MAX_BYTES, else its first line */
    const size_t pf_bytes = contiguous ? PL_MIN(row_bytes, (size_t)PREFETCH_MAX_BYTES) : 1;
    while (whole > 0) {
        int64_t n = PL_MIN(whole, (int64_t)SORT_GROUP);
        if (n > 1 && row_bytes >= SORT_MIN_ROW_BYTES) {
            row_ref refs[SORT_GROUP];
            for (int64_t k = 0; k < n; k++) {
                refs[k].key = L->rows[i + k] * sign;
                refs[k].pos = k;
            }
            qsort(refs, (size_t)n, sizeof(row_ref), cmp_row_ref);
            for (int64_t k = 0; k < n; k++)
                copy_row_part(dst + (size_t)refs[k].pos * row_bytes, L, &R, contiguous, nt,
                              i + refs[k].pos, 0, row);
        } else {
            for (int64_t k = 0; k < n; k++) {
                if (k + ahead < whole)
                    prefetch_row(L->src + L->rows[i + k + ahead] * L->strides[0], pf_bytes);
                copy_row_part(dst + (size_t)k * row_bytes, L, &R, contiguous, nt, i + k, 0, row);
            }
        }
        dst += (size_t)n * row_bytes;
        count -= n * row;
        whole -= n;
        i += n;
    }
    if (count > 0) /* the start of a row the next piece finishes */
        copy_row_part(dst, L, &R, contiguous, nt, i, 0, count);
    return nt;
}

/* ---- workers ---- */

/* memcpy with streaming stores; see Note [non-temporal staging stores]. */
static void copy_streaming(char *dst, const char *src, size_t n)
{
#ifdef PL_HAVE_NT_STORES
    size_t head = PL_MIN(n, (size_t)(-(uintptr_t)dst & 15));
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

/* Elements [start, start + count) of a collapsed leaf to dst; with nt, contiguous leaves go
 * through streaming stores, with nt_rows contiguous rows of at least NT_MIN_ROW_BYTES, fenced
 * before returning. */
static void stage_range(int nt, int nt_rows, int prefetch, char *dst, const pl_leaf_copy *L,
                        int64_t start, int64_t count)
{
    int streamed = 0;
    /* After pl_leaf_collapse a contiguous leaf is one dimension with unit stride. */
    if (nt && !L->rows && L->ndim == 1 && L->strides[0] == (int64_t)L->itemsize) {
        copy_streaming(dst, L->src + (size_t)start * L->itemsize, (size_t)count * L->itemsize);
        streamed = 1;
    } else if (L->rows) {
        streamed = gather_rows(dst, L, start, count, nt_rows, prefetch);
    } else {
        pl_leaf_gather(dst, L, start, count);
    }
    if (streamed) /* once per piece (256 KiB): no contention on the counter */
        atomic_fetch_add_explicit(&streamed_bytes, (unsigned long long)count * L->itemsize,
                                  memory_order_relaxed);
#ifdef PL_HAVE_NT_STORES
    if (nt || nt_rows)
        _mm_sfence();
#endif
}

static int use_streaming(const pl_stager *s, size_t total)
{
#ifdef PL_HAVE_NT_STORES
    return s->nt_mode >= 0 ? s->nt_mode : total >= NT_MIN_BYTES;
#else
    (void)s;
    (void)total;
    return 0;
#endif
}

/* Row gathers stream only in a job of one chunk: see Note [non-temporal staging stores]. */
static int use_streaming_rows(const pl_stager *s, size_t total, size_t n_chunks)
{
    return s->nt_mode == 1 || (use_streaming(s, total) && n_chunks == 1);
}

static void do_piece(job *j, size_t i)
{
    piece *p = &j->pieces[i];
    stage_range(j->nt, j->nt_rows, j->prefetch, j->base + p->off, &j->leaves[p->leaf], p->start, p->count);
    size_t first = p->off / j->chunk_bytes, last = (p->off + p->len - 1) / j->chunk_bytes;
    for (size_t c = first; c <= last; c++)
        atomic_fetch_sub_explicit(&j->chunk_left[c], 1, memory_order_release);
}

/* Take and do one piece; 0 when none is left. */
static int take_piece(job *j)
{
    size_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
    if (i >= j->n_pieces)
        return 0;
    do_piece(j, i);
    return 1;
}

static void *worker_main(void *arg)
{
    pl_stager *s = arg;
    uint64_t seen = 0;
    pl_thread_name("pl-stage");
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->stop && s->gen == seen)
            pthread_cond_wait(&s->work_cv, &s->mu);
        if (s->stop)
            break;
        seen = s->gen;
        job *j = s->cur;
        if (!j)
            continue;
        s->busy++;
        pthread_mutex_unlock(&s->mu);
        while (take_piece(j))
            ;
        pthread_mutex_lock(&s->mu);
        s->busy--;
        pthread_cond_broadcast(&s->done_cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

int pl_stager_create(int nthreads, pl_stager **out)
{
    pl_stager *s = calloc(1, sizeof(*s));
    if (!s)
        return PL_ERR_NO_MEMORY;
    s->nthreads = nthreads < 1 ? 1 : nthreads;
    const char *nt = getenv("PINLOADER_STAGING_NT");
    s->nt_mode = nt && strcmp(nt, "0") == 0 ? 0 : nt && strcmp(nt, "1") == 0 ? 1 : -1;
    const char *pf = getenv("PINLOADER_ROW_PREFETCH");
    s->prefetch = !(pf && strcmp(pf, "0") == 0);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work_cv, NULL);
    pthread_cond_init(&s->done_cv, NULL);
    if (s->nthreads > 1) {
        s->workers = calloc((size_t)s->nthreads - 1, sizeof(pthread_t));
        if (!s->workers) {
            pl_stager_destroy(s);
            return PL_ERR_NO_MEMORY;
        }
        for (int i = 0; i < s->nthreads - 1; i++) {
            if (pthread_create(&s->workers[i], NULL, worker_main, s) != 0)
                break;
            s->n_workers++;
        }
    }
    *out = s;
    return PL_OK;
}

void pl_stager_destroy(pl_stager *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < s->n_workers; i++)
        pthread_join(s->workers[i], NULL);
    free(s->workers);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->work_cv);
    pthread_cond_destroy(&s->done_cv);
    free(s);
}

int pl_stager_threads(const pl_stager *s)
{
    return s->n_workers + 1;
}

/* ---- one job ---- */

/* Elements per piece of L: whole rows of a row-gathered leaf where a row fits in a piece (see
 * Note [row gather]). L->nbytes > 0. */
static int64_t piece_elems(const pl_leaf_copy *L)
{
    int64_t per = (int64_t)PL_MAX((size_t)1, PIECE_BYTES / L->itemsize);
    if (L->rows) {
        int64_t row = (int64_t)(L->nbytes / L->itemsize) / L->shape[0];
        if (row > 0 && row <= per)
            per = per / row * row;
    }
    return per;
}

static size_t count_pieces(const pl_leaf_copy *leaves, int n)
{
    size_t total = 0;
    for (int i = 0; i < n; i++)
        if (leaves[i].nbytes) {
            int64_t elems = (int64_t)(leaves[i].nbytes / leaves[i].itemsize);
            int64_t per = piece_elems(&leaves[i]);
            total += (size_t)((elems + per - 1) / per);
        }
    return total;
}

int pl_stager_run(pl_stager *s, pl_leaf_copy *leaves, int n, char *base, size_t total,
                  size_t chunk_bytes, pl_chunk_fn on_chunk, void *arg)
{
    if (total == 0)
        return PL_OK;
    if (chunk_bytes == 0 || chunk_bytes > total)
        chunk_bytes = total;
    size_t n_chunks = (total + chunk_bytes - 1) / chunk_bytes;

    /* Small batches: one thread, no hand-off. */
    if (total <= INLINE_BYTES || s->n_workers == 0) {
        size_t reported = 0;
        int rc = PL_OK, nt = use_streaming(s, total), nt_rows = use_streaming_rows(s, total, n_chunks);
        for (int i = 0; i < n; i++) {
            pl_leaf_copy *L = &leaves[i];
            if (!L->nbytes)
                continue;
            pl_leaf_collapse(L);
            stage_range(nt, nt_rows, s->prefetch, L->dst, L, 0, (int64_t)(L->nbytes / L->itemsize));
            /* every chunk that ends before the next leaf's start is complete */
            size_t limit = i + 1 < n ? (size_t)(leaves[i + 1].dst - base) : total;
            while (rc == PL_OK && reported < n_chunks && (reported + 1) * chunk_bytes <= limit) {
                rc = on_chunk(arg, reported * chunk_bytes, chunk_bytes);
                reported++;
            }
        }
        while (rc == PL_OK && reported < n_chunks) {
            size_t off = reported * chunk_bytes;
            rc = on_chunk(arg, off, PL_MIN(chunk_bytes, total - off));
            reported++;
        }
        return rc;
    }

    size_t max_pieces = count_pieces(leaves, n);
    piece *pieces = malloc((max_pieces ? max_pieces : 1) * sizeof(*pieces)); /* a batch of tables only has none */
    atomic_int *left = calloc(n_chunks, sizeof(*left));
    if (!pieces || !left) {
        free(pieces);
        free(left);
        return PL_ERR_NO_MEMORY;
    }
    size_t np = 0;
    for (int i = 0; i < n; i++) {
        pl_leaf_copy *L = &leaves[i];
        if (!L->nbytes)
            continue;
        pl_leaf_collapse(L);
        int64_t elems = (int64_t)(L->nbytes / L->itemsize);
        int64_t per = piece_elems(L);
        size_t leaf_off = (size_t)(L->dst - base);
        for (int64_t e = 0; e < elems; e += per) {
            piece *p = &pieces[np++];
            p->leaf = i;
            p->start = e;
            p->count = PL_MIN(per, elems - e);
            p->off = leaf_off + (size_t)e * L->itemsize;
            p->len = (size_t)p->count * L->itemsize;
            size_t first = p->off / chunk_bytes, last = (p->off + p->len - 1) / chunk_bytes;
            for (size_t c = first; c <= last; c++)
                atomic_fetch_add_explicit(&left[c], 1, memory_order_relaxed);
        }
    }
    job j = {leaves, pieces, np, 0, left, n_chunks, chunk_bytes, base, use_streaming(s, total),
             use_streaming_rows(s, total, n_chunks), s->prefetch};

    pthread_mutex_lock(&s->mu);
    s->cur = &j;
    s->gen++;
    pthread_cond_broadcast(&s->work_cv);
    pthread_mutex_unlock(&s->mu);

    int rc = PL_OK;
    size_t reported = 0;
    while (reported < n_chunks) {
        if (atomic_load_explicit(&left[reported], memory_order_acquire) == 0) {
            size_t off = reported * chunk_bytes;
            if (rc == PL_OK)
                rc = on_chunk(arg, off, PL_MIN(chunk_bytes, total - off));
            reported++;
        } else if (!take_piece(&j)) {
            /* Everything is taken; the workers are finishing the last pieces. */
            sched_yield();
        }
    }

    /* Workers may still be inside take_piece (finding nothing): wait for them to leave. */
    pthread_mutex_lock(&s->mu);
    s->cur = NULL;
    while (s->busy > 0)
        pthread_cond_wait(&s->done_cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    free(pieces);
    free(left);
    return rc;
}
