/* AsyncPrefetcher's queue of batches (producer to consumer, under mu) and its graveyard, the
 * objects the producer drops at its next GIL hold (Note [producer and the GIL] in
 * prefetcher.c). The object and its batches are in prefetcher_impl.h. */
#include "prefetcher_impl.h"

#include "util.h"

/* ---- graveyard (GIL held) ---- */

/* The graves are emptied by the producer (in thread-local mode for good: Note [the producer and
 * graph captures] in pf_producer.c), on the consumer's thread and in a release (the collector's,
 * inside a user's capture maybe). On a user's thread (relax) the CUDA calls on a batch's copy
 * lift the capture ban for this thread around themselves only (Note [releases during a capture]
 * in src/core/backend.h): the sources' finalizers run in the thread's own mode, unless the
 * caller relaxed the whole release (pl_pf_free_resources, pf_pipeline.c says why). */
static int query_copy(pl_block *blk, int relax)
{
    const int mode = relax ? pl_captures_relax(blk->b) : -1;
    int rc = blk->b->event_query(blk->ready);
    pl_captures_restore(blk->b, mode);
    return rc;
}

/* GIL held; released for the wait. */
static void sync_copy(pl_block *blk, int relax)
{
    Py_BEGIN_ALLOW_THREADS
    const int mode = relax ? pl_captures_relax(blk->b) : -1;
    pl_block_sync_ready(blk);
    pl_captures_restore(blk->b, mode);
    Py_END_ALLOW_THREADS
}

void pl_pf_bury(pl_prefetcher_obj *self, PyObject **objs, Py_ssize_t n, pl_block *blk)
{
    if (n == 0) {
        PyMem_RawFree(objs);
        return;
    }
    grave *g = PyMem_Malloc(sizeof(*g));
    if (!g) {
        /* Cannot defer: wait for the copy (if any) and drop now (the producer buries) */
        if (blk)
            sync_copy(blk, 0);
        for (Py_ssize_t i = 0; i < n; i++)
            Py_DECREF(objs[i]);
        PyMem_RawFree(objs);
        return;
    }
    if (blk)
        pl_block_incref(blk);
    *g = (grave){self->graves, objs, n, blk};
    self->graves = g;
}

/* Note [emptying graves]
 * Dropping a source object runs its finalizers, which may release the GIL (a __del__ that
 * sleeps, a deleter that takes a lock) and let the producer and a consumer both enter here. So
 * the list is detached from the object first: each caller walks only the graves it took, and
 * what is not ready yet is put back in front of whatever was buried meanwhile. */
void pl_pf_empty_graves(pl_prefetcher_obj *self, int wait, int relax)
{
    grave *list = self->graves, *keep = NULL, **keep_tail = &keep;
    self->graves = NULL;
    while (list) {
        grave *g = list;
        list = g->next;
        int q = g->blk && !wait ? query_copy(g->blk, relax) : PL_OK;
        if (q == PL_ERR_NOT_READY) {
            g->next = NULL;
            *keep_tail = g;
            keep_tail = &g->next;
            continue;
        }
        /* A query that failed proves nothing about the copy that reads these sources (an error
         * need not be sticky): wait for it, as pl_pool_poll does; if the wait fails too, the
         * runtime is gone and nothing reads them any more. */
        if (g->blk && (wait || q != PL_OK))
            sync_copy(g->blk, relax);
        for (Py_ssize_t i = 0; i < g->n; i++)
            Py_DECREF(g->objs[i]);
        PyMem_RawFree(g->objs);
        if (g->blk)
            pl_block_decref(g->blk);
        PyMem_Free(g);
    }
    *keep_tail = self->graves;
    self->graves = keep;
}

/* ---- queue ---- */

/* Put a batch the consumer took back at the head of the queue (Note [interrupted handout] in
 * prefetcher.c): it is the next one handed out. */
void pl_pf_requeue_batch(pl_prefetcher_obj *self, batch *bt)
{
    pthread_mutex_lock(&self->mu);
    bt->next = self->head;
    self->head = bt;
    if (!self->tail)
        self->tail = bt;
    self->queued++;
    pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
}

void pl_pf_push_batch(pl_prefetcher_obj *self, batch *bt)
{
    pthread_mutex_lock(&self->mu);
    bt->next = NULL;
    if (self->tail)
        self->tail->next = bt;
    else
        self->head = bt;
    self->tail = bt;
    self->queued++;
    if (bt->kind != B_READY)
        self->finished_epoch = bt->epoch;
    if (bt->kind == B_READY) {
        int64_t now = pl_now_ns();
        if (!self->first_batch_ns)
            self->first_batch_ns = now;
        self->last_batch_ns = now;
        self->n_batches++;
        self->n_bytes += bt->bytes;
        self->n_padding += bt->padding;
        size_t live = pl_block_live_bytes(self->b);
        if (live > self->device_peak)
            self->device_peak = live;
    }
    pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
}

batch *pl_pf_take_batch(pl_prefetcher_obj *self, int *waited)
{
    for (;;) {
        pthread_mutex_lock(&self->mu);
        batch *bt = self->head;
        if (bt) {
            self->head = bt->next;
            if (!self->head)
                self->tail = NULL;
            self->queued--;
            pthread_cond_broadcast(&self->cv);
        }
        pthread_mutex_unlock(&self->mu);
        if (bt) {
            if (bt->epoch == self->consumer_epoch)
                return bt;
            pl_pf_batch_free(bt); /* from an abandoned epoch */
            continue;
        }
        if (self->state != PF_OPEN) {
            /* another thread closed it, or took the end of the epoch */
            if (pl_pf_is_closed(self))
                PyErr_SetString(PyExc_ValueError, "AsyncPrefetcher was closed while waiting for a batch");
            return NULL;
        }
        *waited = 1;
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&self->mu);
        if (!self->head) {
            struct timespec ts;
            pl_deadline(&ts, PL_SIGNAL_SLICE_NS);
            pthread_cond_timedwait(&self->cv, &self->mu, &ts);
        }
        pthread_mutex_unlock(&self->mu);
        Py_END_ALLOW_THREADS
        if (PyErr_CheckSignals() < 0)
            return NULL;
    }
}

void pl_pf_batch_free(batch *bt)
{
    pl_tree_clear(&bt->tree);
    Py_XDECREF(bt->output);
    PyMem_RawFree(bt->leaves);
    Py_XDECREF(bt->exc);
    if (bt->blk)
        pl_block_decref(bt->blk);
    PyMem_RawFree(bt);
}
