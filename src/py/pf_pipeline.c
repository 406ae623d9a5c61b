/* AsyncPrefetcher's pipeline, made by the constructor and freed once at the end (Note
 * [prefetcher lifecycle] in prefetcher.c): the copy stream, the pinned pool chosen and this
 * prefetcher's client in it (the pool policy), the staging threads; freeing it also drops the
 * queued batches and the graveyard (pf_producer.c). Freed by close() or dealloc in prefetcher.c,
 * or by a producer left behind in user code (pf_producer.c). */
#include "prefetcher_impl.h"

#include "cpus.h"
#include "util.h"

/* ---- made (the pool policy) ---- */

/* Copy stream, pinned pool and stager. Returns 0 or -1 with an exception (self is then
 * released by the caller; dealloc frees what was made). */
int pl_pf_setup_pipeline(pl_prefetcher_obj *self, const pf_options *o)
{
    const pl_backend *b = self->b;
    int rc, prev_device = -1, dev = self->device, high = o->high_priority;
    Py_BEGIN_ALLOW_THREADS
    rc = pl_device_push(b, dev, &prev_device);
    if (rc == PL_OK)
        rc = b->stream_create(high, &self->copy_stream);
    pl_device_pop(b, dev, prev_device);
    Py_END_ALLOW_THREADS
    if (rc != PL_OK) {
        pl_raise_backend(self->st, b, rc, "creating the copy stream");
        return -1;
    }
    /* The pool (see Note [default pool] in pool_default.c) and this prefetcher's client in it
     * (Note [pinned bound] in transfer.c). */
    size_t client_cap = o->max_pinned;
    if (o->shared) {
        pl_pool_incref(o->shared);
        self->pool = o->shared;
        self->pool_obj = Py_NewRef(o->pool_obj);
        self->bound = o->max_pinned ? "max_pinned_bytes" : "the pool's max_bytes";
    } else if (o->max_pinned > pl_pool_shared_cap()) {
        /* More than the default pool may hold, asked for explicitly: a pool of its own. */
        rc = pl_pool_create(b, dev, o->max_pinned, &self->pool);
        self->own_pool = 1;
        self->bound = "max_pinned_bytes";
        if (rc != PL_OK) {
            pl_raise_backend(self->st, b, rc, "creating the pinned pool");
            return -1;
        }
    } else {
        rc = pl_pool_default(b, dev, &self->pool);
        if (rc != PL_OK) {
            pl_raise_backend(self->st, b, rc, "the default pinned pool");
            return -1;
        }
        self->cap_follows = !o->max_pinned;
        self->bound = o->max_pinned ? "max_pinned_bytes" :
            "the prefetcher's default bound, at most pinloader.default_pool_cap(); pass "
            "max_pinned_bytes or a PinnedPool to allow more";
        if (self->cap_follows)
            client_cap = PL_MIN((size_t)1 << 20, pl_pool_cap(self->pool));
    }
    if ((rc = pl_pool_client_open(self->pool, client_cap, &self->client)) != PL_OK) {
        self->client = NULL;
        pl_raise_backend(self->st, b, rc, "opening the prefetcher's share of the pinned pool");
        return -1;
    }
    long threads = o->threads ? o->threads : pl_default_staging_threads(); /* see Note [staging threads] in cpus.c */
    if ((rc = pl_stager_create((int)threads, &self->stager)) != PL_OK) {
        pl_raise_backend(self->st, b, rc, "starting staging threads");
        return -1;
    }
    return 0;
}

/* ---- freed ---- */

/* Free the pipeline (GIL held; the producer has exited or is this thread). Called once. */
void pl_pf_free_resources(pl_prefetcher_obj *self)
{
    if (pl_inherited(self->gen)) {
        /* The parent's threads, streams and memory: touch none of it, drop only Python refs. */
        self->head = self->tail = NULL;
        self->graves = NULL;
        self->stager = NULL;
        self->copy_stream = NULL;
        self->pool = NULL;
        self->client = NULL;
        Py_CLEAR(self->it);
        Py_CLEAR(self->stash);
        return;
    }
    /* close(), the collector's clear or dealloc, maybe in the middle of a capture: the whole
     * release is bracketed (Note [releases during a capture] in src/core/backend.h), so the
     * finalizers of the sources and batches dropped here run with the ban lifted for this
     * thread too, for as long as the release lasts */
    const int mode = pl_captures_relax(self->b);
    int prev_device = -1;
    pl_device_push(self->b, self->device, &prev_device);
    if (self->copy_stream) {
        pl_stream *stream = self->copy_stream;
        const pl_backend *b = self->b;
        Py_BEGIN_ALLOW_THREADS
        b->stream_synchronize(stream);
        Py_END_ALLOW_THREADS
    }
    pthread_mutex_lock(&self->mu);
    batch *bt = self->head;
    self->head = self->tail = NULL;
    self->queued = 0;
    pthread_mutex_unlock(&self->mu);
    while (bt) {
        batch *next = bt->next;
        pl_pf_batch_free(bt);
        bt = next;
    }
    pl_pf_empty_graves(self, 1, 0); /* relaxed already, whole */
    Py_CLEAR(self->it);
    Py_CLEAR(self->stash);
    pl_handout_drop_static(&self->handout);
    pl_stager *stager = self->stager;
    pl_stream *stream = self->copy_stream;
    pl_pool *pool = self->pool;
    pl_pool_client *client = self->client;
    int own = self->own_pool;
    self->stager = NULL; /* before the GIL is released: other threads may read them */
    self->copy_stream = NULL;
    self->pool = NULL;
    self->client = NULL;
    const pl_backend *b = self->b;
    Py_BEGIN_ALLOW_THREADS
    if (stager)
        pl_stager_destroy(stager);
    if (stream)
        b->stream_destroy(stream);
    /* The producer is gone (or is this thread, past its last reserve): the client can go. Its
     * regions still pending come back to the pool later; a default or shared pool stays open. */
    if (pool && client)
        pl_pool_client_close(pool, client);
    if (pool && own)
        pl_pool_close(pool);
    if (pool)
        pl_pool_decref(pool);
    Py_END_ALLOW_THREADS
    pl_device_pop(self->b, self->device, prev_device);
    pl_captures_restore(self->b, mode);
}
