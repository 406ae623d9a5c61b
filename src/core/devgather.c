/* Device gather: the launch's unit size, the sorted pair table, and the registry of registered
 * host ranges. No Python. See Note [device gather] and Note [registered sources] in
 * devgather.h. */
#include "devgather.h"

#include "pool.h"
#include "util.h"

#include <stdlib.h>
#include <string.h>

/* ---- the launch ---- */

int pl_gather_unit(const pl_gather_args *g)
{
    uint64_t bits = (uint64_t)(uintptr_t)g->src | (uint64_t)g->row_stride | (uint64_t)g->span |
                    (uint64_t)(uintptr_t)g->edge | 16u;
    return 1 << __builtin_ctzll(bits);
}

/* ---- the table ---- */

#define RADIX_BITS 11
#define RADIX (1 << RADIX_BITS)

/* Sort packed keys (offset << slot_bits | slot), 8 bytes each, by their offset bits: an LSD
 * radix sort, stable, so equal offsets keep slot order. a and b are the two halves of the
 * table's own memory (n pairs of 16 bytes hold 2n keys), so nothing is allocated; returns the
 * half that holds the result. */
static uint64_t *sort_keys(uint64_t *a, uint64_t *b, int64_t n, int slot_bits, uint64_t span)
{
    size_t count[RADIX];
    for (int shift = slot_bits; shift < 64 && (span >> (shift - slot_bits)); shift += RADIX_BITS) {
        memset(count, 0, sizeof count);
        for (int64_t i = 0; i < n; i++)
            count[(a[i] >> shift) & (RADIX - 1)]++;
        size_t sum = 0;
        for (int d = 0; d < RADIX; d++) {
            size_t c = count[d];
            count[d] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < n; i++)
            b[count[(a[i] >> shift) & (RADIX - 1)]++] = a[i];
        uint64_t *t = a;
        a = b;
        b = t;
    }
    return a;
}

static int cmp_pair(const void *x, const void *y)
{
    const pl_gather_pair *a = x, *b = y;
    if (a->row != b->row)
        return a->row < b->row ? -1 : 1;
    return a->slot < b->slot ? -1 : a->slot > b->slot;
}

int pl_gather_sort(const int64_t *rows, int64_t n, int descending, pl_gather_pair *out)
{
    if (n <= 0)
        return PL_OK;
    int64_t hi = 0, lo = INT64_MAX;
    for (int64_t i = 0; i < n; i++) {
        hi = rows[i] > hi ? rows[i] : hi;
        lo = rows[i] < lo ? rows[i] : lo;
    }
    /* keys are offsets from the smallest (largest, descending) row: fewer digits to sort */
    const uint64_t span = (uint64_t)(hi - lo);
    const int slot_bits = n > 1 ? 64 - __builtin_clzll((uint64_t)(n - 1)) : 1;
    const int key_bits = span ? 64 - __builtin_clzll(span) : 0;
    if (n >= 64 && span > 0 && slot_bits + key_bits <= 64) {
        /* 8-byte keys in the table's memory: half the traffic of sorting the pairs */
        uint64_t *a = (uint64_t *)out, *b = a + n;
        for (int64_t i = 0; i < n; i++) {
            uint64_t off = (uint64_t)(descending ? hi - rows[i] : rows[i] - lo);
            a[i] = off << slot_bits | (uint64_t)i;
        }
        uint64_t *r = sort_keys(a, b, n, slot_bits, span);
        const uint64_t mask = ((uint64_t)1 << slot_bits) - 1;
        /* unpack into pairs over the same memory: pair i covers keys 2i and 2i + 1, so the
         * first half is unpacked from the end and the second half from the start */
        if (r == a) {
            for (int64_t i = n - 1; i >= 0; i--) {
                uint64_t k = r[i];
                int64_t off = (int64_t)(k >> slot_bits);
                out[i] = (pl_gather_pair){descending ? hi - off : lo + off, (int64_t)(k & mask)};
            }
        } else {
            for (int64_t i = 0; i < n; i++) {
                uint64_t k = r[i];
                int64_t off = (int64_t)(k >> slot_bits);
                out[i] = (pl_gather_pair){descending ? hi - off : lo + off, (int64_t)(k & mask)};
            }
        }
        return PL_OK;
    }
    /* few pairs, or a row range too wide to pack beside the slot in 64 bits: a comparison
     * sort, by offset then slot */
    for (int64_t i = 0; i < n; i++) {
        out[i].row = descending ? hi - rows[i] : rows[i] - lo;
        out[i].slot = i;
    }
    if (span > 0)
        qsort(out, (size_t)n, sizeof(*out), cmp_pair);
    for (int64_t i = 0; i < n; i++)
        out[i].row = descending ? hi - out[i].row : out[i].row + lo;
    return PL_OK;
}

/* ---- edge items (Note [device gather]) ---- */

static int inside(const char *a, size_t span, const char *lo, const char *hi)
{
    return a >= lo && a <= hi && (size_t)(hi - a) >= span;
}

int64_t pl_gather_edge_items(const char *src, int64_t stride, size_t span, int64_t n_items,
                             const char *lo, const char *hi)
{
    if (n_items <= 0)
        return 0;
    /* items inside form one run of rows (addresses are monotonic in the row): find it */
    if (stride == 0)
        return inside(src, span, lo, hi) ? 0 : n_items;
    const intptr_t s = (intptr_t)stride, base = (intptr_t)src;
    /* the first and last rows whose start lies in [lo, hi - span] */
    intptr_t a_lo = (intptr_t)lo - base, a_hi = (intptr_t)hi - (intptr_t)span - base;
    if (a_hi < a_lo)
        return n_items;
    intptr_t r0, r1;
    if (s > 0) {
        r0 = a_lo <= 0 ? 0 : (a_lo + s - 1) / s;
        r1 = a_hi < 0 ? -1 : a_hi / s;
    } else {
        intptr_t m = -s;
        r0 = a_hi >= 0 ? 0 : (-a_hi + m - 1) / m;
        r1 = a_lo > 0 ? -1 : -a_lo / m;
    }
    if (r0 < 0)
        r0 = 0;
    if (r1 > n_items - 1)
        r1 = n_items - 1;
    int64_t in = r1 >= r0 ? (int64_t)(r1 - r0 + 1) : 0;
    return n_items - in;
}

int64_t pl_gather_stage_edges(pl_gather_pair *t, int64_t n, const char *src, int64_t stride,
                              size_t span, const char *lo, const char *hi, char *edge, int64_t cap)
{
    int64_t k = 0, last_row = -1, last_k = -1;
    for (int64_t i = 0; i < n; i++) {
        const char *a = src + t[i].row * stride;
        if (inside(a, span, lo, hi))
            continue;
        if (t[i].row != last_row) { /* sorted: a repeat is next to the first */
            if (k == cap)
                return -1;
            memcpy(edge + (size_t)k * span, a, span);
            last_row = t[i].row;
            last_k = k++;
        }
        t[i].row = -1 - last_k;
    }
    return k;
}

int64_t pl_gather_fill_in_order(const int64_t *rows, int64_t n, pl_gather_pair *t, const char *src,
                                int64_t stride, size_t span, const char *lo, const char *hi, char *edge,
                                int64_t cap)
{
    /* One pass: each pair written once. A repeat of an edge item is staged once: each edge
     * pair looks through the rows staged so far (seen[], at most cap of them, a few: the items
     * touching a source's first and last partial pages). */
    int64_t small[64], *seen = small;
    if (cap > 64 && !(seen = malloc((size_t)cap * sizeof(int64_t))))
        return -2;
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = rows[i];
        const char *a = src + r * stride;
        if (inside(a, span, lo, hi)) {
            t[i] = (pl_gather_pair){r, i};
            continue;
        }
        int64_t j = -1;
        for (int64_t q = 0; q < k && j < 0; q++)
            if (seen[q] == r)
                j = q;
        if (j < 0) {
            if (k == cap) {
                k = -1;
                break;
            }
            memcpy(edge + (size_t)k * span, a, span);
            seen[k] = r;
            j = k++;
        }
        t[i] = (pl_gather_pair){-1 - j, i};
    }
    if (seen != small)
        free(seen);
    return k;
}

/* ---- the registry (Note [registered sources]) ---- */

/* One registered (or found page-locked) page range; entries never overlap. */
typedef struct entry {
    struct entry *next;
    const pl_backend *b;
    char *base; /* page aligned */
    size_t len; /* page multiple */
    char *dev;  /* the device's address of base */
    long refs;  /* guarded by reg_mu: handles using it */
    int owned;  /* pinloader registered it (else it was already page-locked) */
    int read_only;
    uint32_t gen;
} entry;

/* What a caller holds: the entries that together cover its page range. */
struct pl_hostreg {
    const pl_backend *b;
    char *base;
    size_t len;
    char *dev; /* the device's address of base */
    int n_parts;
    int owned, read_only;
    uint32_t gen;
    entry *parts[];
};

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static entry *reg_list;      /* guarded by reg_mu */
static size_t reg_total[2];  /* guarded by reg_mu: owned bytes per backend kind */

enum { MAX_PARTS = 64 };

static int kind_of(const pl_backend *b) { return b->kind == PL_BACKEND_CUDA; }

/* Register [p, p + len) as a new entry (reg_mu held). Memory that another party registered
 * meanwhile (cudaErrorHostMemoryAlreadyRegistered) becomes an entry that is not ours. */
static int new_entry(const pl_backend *b, char *p, size_t len, int prefer_ro, entry **out, int *err)
{
    entry *e = calloc(1, sizeof(*e));
    if (!e)
        return *err = PL_ERR_NO_MEMORY, PL_REG_REFUSED;
    *e = (entry){NULL, b, p, len, NULL, 0, 0, 0, pl_generation()};
    void *dev = NULL;
    int device = 0;
    b->get_device(&device);
    int rc = b->host_register(device, p, len, prefer_ro, &dev, &e->read_only);
    if (rc == PL_OK) {
        e->owned = 1;
    } else if (b->host_mapped(p, len, &dev) != PL_OK || !dev) {
        free(e);
        *err = rc;
        return PL_REG_REFUSED;
    }
    e->dev = dev;
    e->next = reg_list;
    reg_list = e;
    if (e->owned)
        reg_total[kind_of(b)] += len;
    *out = e;
    return PL_REG_OK;
}

static void drop_entry(entry *e)
{
    /* reg_mu held; e->refs reached 0 */
    for (entry **p = &reg_list; *p; p = &(*p)->next)
        if (*p == e) {
            *p = e->next;
            break;
        }
    if (e->owned) {
        reg_total[kind_of(e->b)] -= e->len;
        /* a dead runtime at exit unregisters nothing: the process's end does; Note [releases
         * during a capture] in backend.h */
        const int mode = pl_captures_relax(e->b);
        e->b->host_unregister(e->base);
        pl_captures_restore(e->b, mode);
    }
    free(e);
}

static int cmp_entry(const void *a, const void *b)
{
    const entry *x = *(entry *const *)a, *y = *(entry *const *)b;
    return x->base < y->base ? -1 : x->base > y->base;
}

int pl_hostreg_acquire(const pl_backend *b, const void *lo, size_t n, size_t budget,
                       int prefer_read_only, pl_hostreg **out, int *err)
{
    const size_t page = pl_page_size();
    uintptr_t start = (uintptr_t)lo & ~(uintptr_t)(page - 1), end;
    *err = PL_OK;
    if (__builtin_add_overflow((uintptr_t)lo, n ? n : 1, &end) ||
        __builtin_add_overflow(end, page - 1, &end))
        return *err = PL_ERR_INVALID_VALUE, PL_REG_REFUSED;
    end &= ~(uintptr_t)(page - 1);
    pl_hostreg *h = calloc(1, sizeof(*h) + MAX_PARTS * sizeof(entry *));
    if (!h)
        return *err = PL_ERR_NO_MEMORY, PL_REG_REFUSED;
    *h = (pl_hostreg){b, (char *)start, end - start, NULL, 0, 0, 1, pl_generation()};
    pthread_mutex_lock(&reg_mu);
    /* the entries the range already overlaps, in address order */
    entry *found[MAX_PARTS];
    int nf = 0, rc = PL_REG_OK;
    for (entry *e = reg_list; e; e = e->next) {
        if (e->b != b || pl_inherited(e->gen))
            continue;
        uintptr_t es = (uintptr_t)e->base, ee = es + e->len;
        if (start < ee && end > es) {
            if (nf == MAX_PARTS) {
                rc = PL_REG_OVERLAP;
                break;
            }
            found[nf++] = e;
        }
    }
    qsort(found, (size_t)nf, sizeof(entry *), cmp_entry);
    void *pinned = NULL;
    if (rc == PL_REG_OK && nf == 0 && b->host_mapped((void *)start, end - start, &pinned) == PL_OK && pinned) {
        /* already page-locked by someone else: used as it is, never counted or unregistered */
        entry *e = calloc(1, sizeof(*e));
        if (!e)
            rc = PL_REG_REFUSED, *err = PL_ERR_NO_MEMORY;
        else {
            *e = (entry){reg_list, b, (char *)start, end - start, pinned, 0, 0, 0, pl_generation()};
            reg_list = e;
            found[nf++] = e;
        }
    } else if (rc == PL_REG_OK) {
        /* register the gaps between the entries found (Note [registered sources]) */
        size_t gap_bytes = 0;
        uintptr_t at = start;
        for (int i = 0; i <= nf; i++) {
            uintptr_t next = i < nf ? (uintptr_t)found[i]->base : end;
            if (next > at)
                gap_bytes += next - at;
            if (i < nf)
                at = PL_MAX(at, (uintptr_t)found[i]->base + found[i]->len);
        }
        if (pl_sat_add(reg_total[kind_of(b)], gap_bytes) > budget)
            rc = PL_REG_OVER_BUDGET;
        at = start;
        int n_old = nf;
        for (int i = 0; rc == PL_REG_OK && i <= n_old; i++) {
            uintptr_t next = i < n_old ? (uintptr_t)found[i]->base : end;
            if (next > at) {
                entry *e = NULL;
                if (nf == MAX_PARTS)
                    rc = PL_REG_OVERLAP;
                else if ((rc = new_entry(b, (char *)at, next - at, prefer_read_only, &e, err)) == PL_REG_OK)
                    found[nf++] = e;
            }
            if (i < n_old)
                at = PL_MAX(at, (uintptr_t)found[i]->base + found[i]->len);
        }
        if (rc != PL_REG_OK) {
            for (int i = n_old; i < nf; i++)
                drop_entry(found[i]);
            nf = n_old;
        }
        qsort(found, (size_t)nf, sizeof(entry *), cmp_entry);
    }
    if (rc == PL_REG_OK && nf > 1) {
        /* pieces read as one range: only where every device address is the host address */
        for (int i = 0; i < nf; i++)
            if (found[i]->dev != found[i]->base)
                rc = PL_REG_OVERLAP;
    }
    if (rc != PL_REG_OK) {
        for (int i = 0; i < nf; i++)
            if (found[i]->refs == 0)
                drop_entry(found[i]); /* made just now for this call */
        pthread_mutex_unlock(&reg_mu);
        free(h);
        return rc;
    }
    h->dev = found[0]->dev + (start - (uintptr_t)found[0]->base);
    for (int i = 0; i < nf; i++) {
        found[i]->refs++;
        h->parts[h->n_parts++] = found[i];
        h->owned |= found[i]->owned;
        h->read_only &= found[i]->read_only;
    }
    pthread_mutex_unlock(&reg_mu);
    *out = h;
    return PL_REG_OK;
}

pl_hostreg *pl_hostreg_dup(const pl_hostreg *h)
{
    size_t size = sizeof(*h) + (size_t)h->n_parts * sizeof(entry *);
    pl_hostreg *d = malloc(size);
    if (!d)
        return NULL;
    memcpy(d, h, size);
    pthread_mutex_lock(&reg_mu);
    for (int i = 0; i < h->n_parts; i++)
        h->parts[i]->refs++;
    pthread_mutex_unlock(&reg_mu);
    return d;
}

void pl_hostreg_release(pl_hostreg *h)
{
    if (!h)
        return;
    if (pl_inherited(h->gen))
        return; /* the parent's: Note [registered sources] */
    pthread_mutex_lock(&reg_mu);
    for (int i = 0; i < h->n_parts; i++)
        if (--h->parts[i]->refs == 0)
            drop_entry(h->parts[i]);
    pthread_mutex_unlock(&reg_mu);
    free(h);
}

const char *pl_hostreg_device_ptr(const pl_hostreg *r, const void *p)
{
    /* p may lie before the range (a source's row 0 in its unregistered first page): integer
     * arithmetic, the result is only ever offset back into the range by the kernel */
    return (const char *)((uintptr_t)r->dev + ((uintptr_t)p - (uintptr_t)r->base));
}

int pl_hostreg_covers(const pl_hostreg *r, const void *p, size_t n)
{
    uintptr_t a = (uintptr_t)p, s = (uintptr_t)r->base;
    return a >= s && n <= r->len && a - s <= r->len - n;
}

const pl_backend *pl_hostreg_backend(const pl_hostreg *r) { return r->b; }
const char *pl_hostreg_base(const pl_hostreg *r) { return r->base; }
size_t pl_hostreg_bytes(const pl_hostreg *r) { return r->len; }
int pl_hostreg_owned(const pl_hostreg *r) { return r->owned; }
int pl_hostreg_read_only(const pl_hostreg *r) { return r->read_only; }

size_t pl_hostreg_total(const pl_backend *b)
{
    pthread_mutex_lock(&reg_mu);
    size_t n = reg_total[kind_of(b)];
    pthread_mutex_unlock(&reg_mu);
    return n;
}

size_t pl_hostreg_default_budget(void)
{
    return pl_pool_shared_cap();
}

void pl_hostreg_atfork_child(void)
{
    /* The parent's entries stay allocated (objects of the child may still point at them) but
     * leave the list; they are never unregistered here. */
    pl_mutex_reset_in_child(&reg_mu);
    reg_list = NULL;
    reg_total[0] = reg_total[1] = 0;
}
