/* The default pinned pools: one process-wide pool per (backend, device), made on first use,
 * and the shared cap they are made with (Note [default pool]); and the atfork child handler of
 * the pool's process-wide state. */
#include "pool_impl.h"
#include "util.h"

#include <pthread.h>

/* ---- default pools ---- */

/* Note [default pool]
 * Prefetchers given no pool share one process-wide pool per (backend, device), made on first
 * use, so the slabs one prefetcher made serve the next (a loader made per epoch pays for
 * pinning once per process, as torch's caching host allocator does). What is kept: slabs, up to
 * the shared cap, pl_pool_shared_cap(): the documented default cap (a quarter of physical
 * memory, at most half of RLIMIT_MEMLOCK) divided among the local ranks that torchrun starts
 * on one host (LOCAL_WORLD_SIZE), so N ranks together stay within the one-process default.
 * Each prefetcher is bounded within it by its own client (Note [pool clients]). When it is
 * given back: trim() (PinnedPool.trim on _C.default_pool(device)) frees every slab with
 * no live region; interpreter exit (the module's atexit hook) trims every default pool after
 * the live prefetchers are closed; regions still exported then return as their last user lets
 * go, and the process exit returns the rest. A default pool is never closed. In a fork()
 * child the parent's default pools are inherited (unusable) and replaced on first use. */
enum { MAX_DEFAULT_DEVICES = 64 };
static pthread_mutex_t defaults_mu = PTHREAD_MUTEX_INITIALIZER;
static pl_pool *defaults[2][MAX_DEFAULT_DEVICES]; /* guarded by defaults_mu; one reference each */

size_t pl_pool_shared_cap(void)
{
    size_t cap = pl_pool_default_cap() / (size_t)pl_local_world_size();
    return PL_MAX(cap, (size_t)PL_ALIGN);
}

int pl_pool_default(const pl_backend *b, int device, pl_pool **out)
{
    if (device < 0 || device >= MAX_DEFAULT_DEVICES)
        return PL_ERR_INVALID_DEVICE;
    pl_pool **slot = &defaults[b->kind == PL_BACKEND_CUDA][device];
    pthread_mutex_lock(&defaults_mu);
    if (*slot && pl_inherited((*slot)->gen)) {
        pl_pool_decref(*slot); /* the parent's: touches nothing but its own refcount */
        *slot = NULL;
    }
    int rc = PL_OK;
    if (!*slot)
        rc = pl_pool_create(b, device, pl_pool_shared_cap(), slot);
    if (rc == PL_OK) {
        pl_pool_incref(*slot);
        *out = *slot;
    }
    pthread_mutex_unlock(&defaults_mu);
    return rc;
}

size_t pl_pool_trim_defaults(void)
{
    pl_pool *live[2 * MAX_DEFAULT_DEVICES];
    int n = 0;
    pthread_mutex_lock(&defaults_mu);
    for (int k = 0; k < 2; k++)
        for (int d = 0; d < MAX_DEFAULT_DEVICES; d++)
            if (defaults[k][d] && !pl_inherited(defaults[k][d]->gen)) {
                pl_pool_incref(defaults[k][d]);
                live[n++] = defaults[k][d];
            }
    pthread_mutex_unlock(&defaults_mu);
    size_t freed = 0;
    for (int i = 0; i < n; i++) {
        freed += pl_pool_trim(live[i]);
        pl_pool_decref(live[i]);
    }
    return freed;
}

/* The pool's process-wide state is this file's and debug mode's (Note [pool after fork] in
 * pool.c). */
void pl_pool_atfork_child(void)
{
    pl_pool_debug_atfork_child();
    pl_mutex_reset_in_child(&defaults_mu);
}
