/* Debug mode of the pinned pool (PINLOADER_DEBUG=1, pl_debug_enabled()): the report of
 * invariant violations, the canary after each region, and the quarantine of dead regions. */
#include "pool_impl.h"
#include "util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CANARY_BYTE 0xa5

/* ---- debug reporting ---- */

static pthread_mutex_t debug_mu = PTHREAD_MUTEX_INITIALIZER;
static char debug_first[512]; /* guarded by debug_mu */

void pl_debug_report(const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "pinloader debug: %s\n", msg);
    pthread_mutex_lock(&debug_mu);
    if (!debug_first[0])
        snprintf(debug_first, sizeof debug_first, "%s", msg);
    pthread_mutex_unlock(&debug_mu);
}

const char *pl_debug_first_violation(void)
{
    pthread_mutex_lock(&debug_mu);
    const char *r = debug_first[0] ? debug_first : NULL;
    pthread_mutex_unlock(&debug_mu);
    return r;
}

/* ---- canaries ---- */

void pl_pool_canary_fill(pl_region *r)
{
    if (r->size - r->requested >= 1)
        memset((char *)r->ptr + r->requested, CANARY_BYTE, PL_MIN(CANARY_BYTES, r->size - r->requested));
}

void pl_pool_canary_check(pl_region *r)
{
    size_t n = PL_MIN(CANARY_BYTES, r->size - r->requested);
    const unsigned char *c = (const unsigned char *)r->ptr + r->requested;
    for (size_t i = 0; i < n; i++)
        if (c[i] != CANARY_BYTE) {
            pl_debug_report("pinned region %p (%zu bytes requested) was written past its end at "
                            "byte %zu", r->ptr, r->requested, r->requested + i);
            return;
        }
}

/* ---- quarantine ---- */

/* Debug mode keeps dead regions a while so a second release finds REGION_DEAD, not reused
 * memory. */
#define QUARANTINE 4096
static pthread_mutex_t q_mu = PTHREAD_MUTEX_INITIALIZER;
static pl_region *quarantine[QUARANTINE]; /* guarded by q_mu */
static size_t q_next;                     /* guarded by q_mu */

void pl_pool_quarantine(pl_region *r)
{
    pthread_mutex_lock(&q_mu);
    pl_region *old = quarantine[q_next % QUARANTINE];
    quarantine[q_next++ % QUARANTINE] = r;
    pthread_mutex_unlock(&q_mu);
    free(old);
}

void pl_pool_debug_atfork_child(void)
{
    pl_mutex_reset_in_child(&debug_mu);
    pl_mutex_reset_in_child(&q_mu);
}
