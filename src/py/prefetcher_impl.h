/* AsyncPrefetcher's private header: the object, its batches and graves, the methods' checks,
 * and the functions its files share. prefetcher.c holds the type (epochs, the lifecycle,
 * construction, stats and getters), pf_producer.c the batch queue with both its ends (the
 * producer thread, the consumer's next()) and the graveyard, pf_pipeline.c the pipeline made
 * and freed (copy stream, pool policy, stager), pf_options.c the constructor's options. The
 * public header is prefetcher.h.
 *
 * Locking: `mu` guards the queue, the flow-control counters and the stats; it is never held
 * while taking the GIL, and the consumer releases the GIL before waiting on it. `stop` is an
 * atomic written under mu (so condition waits see it) and read anywhere, including by
 * pl_pool_reserve without mu. */
#ifndef PL_PREFETCHER_IMPL_H
#define PL_PREFETCHER_IMPL_H

#include "prefetcher.h"

#include "block.h"
#include "flatten.h"
#include "handout.h"
#include "pool.h"
#include "stager.h"
#include "util.h"

#include <pthread.h>
#include <stdatomic.h>

#define WAIT_SAMPLES 4096

/* ---- batches ---- */

typedef enum { B_READY, B_END, B_ERROR } batch_kind;

typedef struct batch {
    struct batch *next;
    batch_kind kind;
    uint64_t epoch;
    uint64_t index;       /* position in the epoch */
    PyObject *output;     /* B_READY without a handout (a Python source, output="array"): the
                           * structure of DeviceArrays */
    pl_leaves *leaves;    /* B_READY with a handout (Note [handout] in handout.h): the array
                           * leaves as views of blk (Note [batch leaves] in flatten.h) */
    pl_tree tree;         /* with a handout: the item's structure, built when handed out */
    PyObject *exc;        /* B_ERROR with a Python exception (source or bad leaf) */
    int err_code;         /* B_ERROR from the backend */
    int err_value;        /* B_ERROR: a bad source found without the GIL, ValueError(err_what) */
    char err_what[640];
    pl_block *blk;        /* the batch's reference */
    size_t bytes;         /* payload */
    size_t padding;       /* alignment padding in the device block */
} batch;

typedef struct grave {
    struct grave *next;
    PyObject **objs;
    Py_ssize_t n;
    pl_block *blk; /* non-NULL: keep objs until blk's ready event completes */
} grave;

typedef enum { PF_OPEN, PF_EPOCH_DONE, PF_FAILED, PF_CLOSED, PF_DETACHED, PF_ORPHANED } pf_state;

struct pl_prefetcher_obj {
    PyObject_HEAD
    PyObject *weakreflist;
    pl_prefetcher_obj *live_prev, *live_next; /* GIL */
    pl_state *st;
    uint32_t gen; /* see Note [prefetcher lifecycle] in prefetcher.c */

    /* configuration: set in tp_new, read-only afterwards (the pipeline pointers are cleared
     * once, under the GIL, when the pipeline is freed) */
    PyObject *source;
    PyObject *pool_obj;
    pl_pool *pool;         /* the default pool of the device, the given one, or a private one */
    pl_pool_client *client; /* this prefetcher's bound within pool (Note [pinned bound]) */
    int own_pool;          /* a private pool: max_pinned_bytes above the shared cap */
    int cap_follows;       /* no max_pinned_bytes and no pool: the bound follows the batches */
    const char *bound;     /* what sets the bound, for PoolExhausted messages */
    size_t max_pinned;
    const pl_backend *b;
    int device;
    int depth;
    pl_handout handout;    /* output, convert, stream, static (Note [handout] in handout.h) */
    pl_tree templ;         /* structure=: the items' structure, captured once (n_nodes 0: none) */
    pl_stager *stager;
    pl_stream *copy_stream;
    pthread_t thread;
    int thread_started;
    PyInterpreterState *interp; /* the producer's thread state belongs to it */

    /* GIL-protected */
    pf_state state;
    int producer_in_user;
    pl_block *last_direct; /* producer only: the last batch copied straight from the source */
    PyObject *it;
    uint64_t it_epoch;
    uint64_t consumer_epoch;
    uint64_t consumed_in_epoch;
    PyObject *stash; /* a batch made while a signal arrived (Note [interrupted handout] in
                      * pf_producer.c); the consumer thread's, under the GIL */
    grave *graves;

    atomic_int gil_wanted; /* the producer is waiting for the GIL (see Note [GIL handoff] in
                            * pf_producer.c) */
    atomic_int stop;       /* written under mu */

    /* mu-protected */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    batch *head, *tail;
    int queued;
    uint64_t requested_epoch;
    uint64_t finished_epoch;
    /* stats */
    uint64_t n_batches;
    uint64_t n_bytes;
    uint64_t n_padding;
    int64_t first_batch_ns, last_batch_ns;
    int64_t next_ns, staging_ns, copy_issue_ns;
    int64_t sort_ns;     /* the device gathers' pair tables (pl_xfer_times.sort_ns) */
    int64_t gil_wait_ns; /* the producer waiting to take the GIL */
    uint64_t gil_holds;  /* rounds in which the producer took the GIL */
    int64_t producer_ns; /* the producer's rounds, from room in the queue to the batch queued */
    int64_t wait_ns_total;
    uint64_t n_waits;
    double wait_samples[WAIT_SAMPLES];
    size_t device_peak;
    int64_t stall_ns;
    uint64_t stalls;
};

/* The constructor's arguments, as pl_pf_parse_options checked them (pf_options.c). */
typedef struct pf_options {
    PyObject *iterable, *device, *pool_obj, *stream, *convert, *out, *structure;
    long depth, threads;
    int64_t static_rows; /* 0: the first batch's rows (Note [static batches] in handout.c) */
    int high_priority, capsule, is_static;
    size_t max_pinned;
    pl_pool *shared; /* borrowed from pool_obj */
} pf_options;

/* Closed, detached or orphaned (Note [prefetcher lifecycle] in prefetcher.c). */
static inline int pl_pf_is_closed(const pl_prefetcher_obj *self)
{
    return self->state >= PF_CLOSED;
}

/* ---- the checks of the object's methods (GIL held) ---- */

static inline int pl_pf_check_inherited(pl_prefetcher_obj *self)
{
    if (pl_inherited(self->gen)) {
        PyErr_SetString(PyExc_RuntimeError, "this AsyncPrefetcher was created before fork(): it "
                        "cannot be used in the child process (its threads and CUDA state stay in "
                        "the parent); create a new one in the child, or start worker processes "
                        "with the 'spawn' method");
        return -1;
    }
    return 0;
}

static inline int pl_pf_check_usable(pl_prefetcher_obj *self)
{
    if (pl_pf_check_inherited(self) < 0)
        return -1;
    if (pl_pf_is_closed(self)) {
        PyErr_SetString(PyExc_ValueError, "AsyncPrefetcher is closed");
        return -1;
    }
    return 0;
}

/* Note [re-entry from the producer]
 * The producer runs user code with the GIL: the source's next(), and what flatten calls for an
 * item (a __dlpack__, a namedtuple's or dataclass's constructor, a finalizer). That code may
 * reach this very prefetcher. next() there would wait for a batch that only the waiting thread
 * can make (for ever: signals are delivered to the main thread only, so not even Ctrl-C ends
 * it), and iter() would restart the epoch from inside it, so that each item starts a new
 * epoch. Both are refused with a RuntimeError, which reaches the consumer as that item's error.
 * What does not wait on the producer stays allowed there: stats(), and close(), which detaches
 * the producer (Note [stuck producers] in prefetcher.c). A DeviceArray of the batch being built
 * refuses to be exported (check_exportable in device_array.c). */
static inline int pl_pf_check_not_producer(pl_prefetcher_obj *self, const char *what, const char *why)
{
    if (self->thread_started && pthread_equal(self->thread, pthread_self())) {
        PyErr_Format(PyExc_RuntimeError, "AsyncPrefetcher: %s was called on the prefetcher's own "
                     "producer thread, by user code it runs for an item (the source's next(), a "
                     "__dlpack__, a container's constructor): %s", what, why);
        return -1;
    }
    return 0;
}

/* ---- pf_producer.c: the graveyard and the queue ---- */

/* GIL held, on the producer: drop objs (n of them, a PyMem_Raw array taken over) at a later GIL
 * hold; with blk, not before blk's ready event has completed. */
void pl_pf_bury(pl_prefetcher_obj *self, PyObject **objs, Py_ssize_t n, pl_block *blk);
/* GIL held: drop what was buried; what waits for a copy is kept unless wait (Note [emptying
 * graves] in pf_producer.c). relax: the caller is a user's thread that has not lifted the capture
 * ban (Note [releases during a capture] in src/core/backend.h). */
void pl_pf_empty_graves(pl_prefetcher_obj *self, int wait, int relax);
/* Queue a batch for the consumer (takes mu) and count it in the stats. */
void pl_pf_push_batch(pl_prefetcher_obj *self, batch *bt);
void pl_pf_batch_free(batch *bt);

/* ---- pf_producer.c: the producer thread and the consumer's next() ---- */

/* The producer thread's body (pthread_create's start routine; arg is the prefetcher). */
void *pl_pf_producer_main(void *arg);
/* next(prefetcher), the type's tp_iternext: the consumer takes the next batch from the queue and
 * hands it out (GIL held). */
PyObject *pl_pf_next(PyObject *op);

/* ---- pf_pipeline.c: the pipeline ---- */

/* Copy stream, pinned pool and client, stager. Returns 0 or -1 with an exception. */
int pl_pf_setup_pipeline(pl_prefetcher_obj *self, const pf_options *o);
/* Free the pipeline (GIL held; the producer has exited or is this thread). Called once. */
void pl_pf_free_resources(pl_prefetcher_obj *self);

/* ---- pf_options.c: the constructor's options ---- */

int pl_pf_parse_options(pl_state *st, PyObject *args, PyObject *kwds, pf_options *o);
PyObject *pl_pf_first_iterator(PyObject *iterable);
int pl_pf_capture_structure(pl_prefetcher_obj *self, PyObject *structure);

#endif
