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
    uint64_t bits = (uint64_t)(uintptr_t)g->src | (uint64_t)g->row_stride | (uint64_t)g->span | 16u;
    return 1 << __builtin_ctzll(bits);
}

/* ---- the table ---- */

#define RADIX_BITS 11
#define RADIX (1 << RADIX_BITS)

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
    for (int64_t i = 0; i < n; i++) {
        out[i].row = descending ? hi - rows[i] : rows[i] - lo;
        out[i].slot = i;
    }
    uint64_t span = (uint64_t)(hi - lo);
    if (n < 64) {
        /* insertion sort, stable: ties keep slot order */
        for (int64_t i = 1; i < n; i++) {
            pl_gather_pair p = out[i];
            int64_t j = i - 1;
            for (; j >= 0 && out[j].row > p.row; j--)
                out[j + 1] = out[j];
            out[j + 1] = p;
        }
    } else if (span > 0) {
        /* LSD radix sort, stable, on the digits the keys use */
        pl_gather_pair *tmp = malloc((size_t)n * sizeof(*tmp));
        size_t *count = malloc(RADIX * sizeof(*count));
        if (!tmp || !count) {
            free(tmp);
            free(count);
            return PL_ERR_NO_MEMORY;
        }
        pl_gather_pair *a = out, *b = tmp;
        for (int shift = 0; shift < 64 && (span >> shift); shift += RADIX_BITS) {
            memset(count, 0, RADIX * sizeof(*count));
            for (int64_t i = 0; i < n; i++)
                count[((uint64_t)a[i].row >> shift) & (RADIX - 1)]++;
            size_t sum = 0;
            for (int d = 0; d < RADIX; d++) {
                size_t c = count[d];
                count[d] = sum;
                sum += c;
            }
            for (int64_t i = 0; i < n; i++)
                b[count[((uint64_t)a[i].row >> shift) & (RADIX - 1)]++] = a[i];
            pl_gather_pair *t = a;
            a = b;
            b = t;
        }
        if (a != out)
            memcpy(out, a, (size_t)n * sizeof(*out));
        free(tmp);
        free(count);
    }
    for (int64_t i = 0; i < n; i++)
        out[i].row = descending ? hi - out[i].row : out[i].row + lo;
    return PL_OK;
}

/* ---- the registry (Note [registered sources]) ---- */

struct pl_hostreg {
    pl_hostreg *next;
    const pl_backend *b;
    char *base; /* page aligned */
    size_t len; /* page multiple */
    char *dev;  /* the device's address of base */
    long refs;  /* guarded by reg_mu */
    int owned;  /* pinloader registered it (else it was already page-locked) */
    int read_only;
    uint32_t gen;
};

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static pl_hostreg *reg_list;  /* guarded by reg_mu */
static size_t reg_total[2];   /* guarded by reg_mu: owned bytes per backend kind */

int pl_hostreg_acquire(const pl_backend *b, const void *lo, size_t n, size_t budget,
                       pl_hostreg **out, int *err)
{
    const size_t page = pl_page_size();
    uintptr_t start = (uintptr_t)lo & ~(uintptr_t)(page - 1), end;
    if (__builtin_add_overflow((uintptr_t)lo, n ? n : 1, &end) ||
        __builtin_add_overflow(end, page - 1, &end))
        return *err = PL_ERR_INVALID_VALUE, PL_REG_REFUSED;
    end &= ~(uintptr_t)(page - 1);
    const size_t len = end - start;
    *err = PL_OK;
    pthread_mutex_lock(&reg_mu);
    int rc = PL_REG_OK;
    pl_hostreg *r = NULL;
    for (pl_hostreg *e = reg_list; e; e = e->next) {
        if (e->b != b || pl_inherited(e->gen))
            continue;
        uintptr_t es = (uintptr_t)e->base, ee = es + e->len;
        if (start >= es && end <= ee) {
            r = e;
            break;
        }
        if (start < ee && end > es)
            rc = PL_REG_OVERLAP;
    }
    if (r) {
        r->refs++;
        *out = r;
        pthread_mutex_unlock(&reg_mu);
        return PL_REG_OK;
    }
    if (rc != PL_REG_OK) {
        pthread_mutex_unlock(&reg_mu);
        return rc;
    }
    r = calloc(1, sizeof(*r));
    if (!r) {
        pthread_mutex_unlock(&reg_mu);
        return *err = PL_ERR_NO_MEMORY, PL_REG_REFUSED;
    }
    *r = (pl_hostreg){NULL, b, (char *)start, len, NULL, 1, 0, 1, pl_generation()};
    void *dev = NULL;
    int crc = b->host_mapped(r->base, len, &dev);
    int device = 0;
    b->get_device(&device);
    if (crc == PL_OK && dev) {
        r->dev = dev; /* already page-locked: used as it is, Note [registered sources] */
    } else if (pl_sat_add(reg_total[b->kind == PL_BACKEND_CUDA], len) > budget) {
        rc = PL_REG_OVER_BUDGET;
    } else if ((crc = b->host_register(device, r->base, len, &dev, &r->read_only)) != PL_OK) {
        *err = crc;
        rc = PL_REG_REFUSED;
    } else {
        r->dev = dev;
        r->owned = 1;
        reg_total[b->kind == PL_BACKEND_CUDA] += len;
    }
    if (rc != PL_REG_OK) {
        free(r);
        pthread_mutex_unlock(&reg_mu);
        return rc;
    }
    r->next = reg_list;
    reg_list = r;
    *out = r;
    pthread_mutex_unlock(&reg_mu);
    return PL_REG_OK;
}

void pl_hostreg_release(pl_hostreg *r)
{
    if (!r || pl_inherited(r->gen))
        return; /* the parent's: Note [registered sources] */
    pthread_mutex_lock(&reg_mu);
    if (--r->refs > 0) {
        pthread_mutex_unlock(&reg_mu);
        return;
    }
    for (pl_hostreg **p = &reg_list; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            break;
        }
    if (r->owned) {
        reg_total[r->b->kind == PL_BACKEND_CUDA] -= r->len;
        /* a dead runtime at exit unregisters nothing: the process's end does */
        r->b->host_unregister(r->base);
    }
    pthread_mutex_unlock(&reg_mu);
    free(r);
}

const char *pl_hostreg_device_ptr(const pl_hostreg *r, const void *p)
{
    return r->dev + ((const char *)p - r->base);
}

int pl_hostreg_covers(const pl_hostreg *r, const void *p, size_t n)
{
    uintptr_t a = (uintptr_t)p, s = (uintptr_t)r->base;
    return a >= s && n <= r->len && a - s <= r->len - n;
}

const pl_backend *pl_hostreg_backend(const pl_hostreg *r) { return r->b; }
size_t pl_hostreg_bytes(const pl_hostreg *r) { return r->len; }
int pl_hostreg_owned(const pl_hostreg *r) { return r->owned; }
int pl_hostreg_read_only(const pl_hostreg *r) { return r->read_only; }

size_t pl_hostreg_total(const pl_backend *b)
{
    pthread_mutex_lock(&reg_mu);
    size_t n = reg_total[b->kind == PL_BACKEND_CUDA];
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
