/* Clients of the pinned pool: an owner's bound within a shared pool (Note [pool clients] in
 * pool.h). A reserve charges its client and honours its cap (pl_pool_reserve_for in pool.c);
 * a region back in its slab uncharges it, and frees a closed client with its last region
 * (region_free_locked in pool.c). */
#include "pool_impl.h"
#include "util.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- clients (Note [pool clients] in pool.h) ---- */

int pl_pool_client_open(pl_pool *p, size_t cap, pl_pool_client **out)
{
    if (pl_inherited(p->gen))
        return PL_ERR_FORKED;
    pl_pool_client *c = calloc(1, sizeof(*c));
    if (!c)
        return PL_ERR_NO_MEMORY;
    c->st.cap = cap ? cap : SIZE_MAX;
    *out = c;
    return PL_OK;
}

void pl_pool_client_set_cap(pl_pool *p, pl_pool_client *c, size_t cap)
{
    if (pl_inherited(p->gen))
        return;
    pthread_mutex_lock(&p->mu);
    c->st.cap = cap ? cap : SIZE_MAX;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

void pl_pool_client_raise_cap(pl_pool *p, pl_pool_client *c, size_t cap)
{
    if (pl_inherited(p->gen))
        return;
    pthread_mutex_lock(&p->mu);
    if (cap > c->st.cap) {
        c->st.cap = cap;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
}

void pl_pool_client_get_stats(pl_pool *p, pl_pool_client *c, pl_pool_client_stats *st)
{
    if (pl_inherited(p->gen)) {
        memset(st, 0, sizeof(*st));
        return;
    }
    pl_pool_poll(p);
    pthread_mutex_lock(&p->mu);
    *st = c->st;
    pthread_mutex_unlock(&p->mu);
}

void pl_pool_client_waits(pl_pool *p, pl_pool_client *c, uint64_t *waits, int64_t *wait_ns)
{
    *waits = 0;
    *wait_ns = 0;
    if (pl_inherited(p->gen))
        return;
    pthread_mutex_lock(&p->mu);
    *waits = c->st.waits;
    *wait_ns = c->st.wait_ns;
    pthread_mutex_unlock(&p->mu);
}

void pl_pool_client_close(pl_pool *p, pl_pool_client *c)
{
    if (!c || pl_inherited(p->gen))
        return;
    pl_pool_poll(p);
    pthread_mutex_lock(&p->mu);
    int idle = c->st.in_use == 0;
    c->closed = 1;
    pthread_mutex_unlock(&p->mu);
    if (idle)
        free(c); /* else region_free_locked (pool.c) frees it with its last region */
}
