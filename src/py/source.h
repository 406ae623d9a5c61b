/* What AsyncPrefetcher's producer thread reads batches from: one interface (pl_source_ops), the
 * Python-iterable source (flatten.c) and the native sources that types of this module register
 * (their table in state.c).
 *
 * Note [sources]
 * The producer (pf_producer.c) drives a source without knowing what is behind it. A source puts
 * one batch at a time into the producer's pl_flat (flatten.h): the array leaves with their
 * checked layout, the objects that keep their memory alive, and the item's structure when the
 * batch brings one (a walked item's tree); a batch with no tree is placed in the structure the
 * prefetcher captured once (structure=). The producer then makes the batch's device block,
 * copies the leaves and queues the batch, the same way for every source.
 *
 * Two kinds of source:
 * - pl_py_source (flatten.c), any Python iterable: next() on the iterator and the walk over the
 *   item, with the GIL held, once per batch. It holds nothing between batches: the
 *   iterator is the prefetcher's (the epoch's), lent for each call.
 * - a native source: a type of this module that registers its ops (pl_source_register) and
 *   makes its batches in C, without the GIL, from state it set up when the producer opened it
 *   (with the GIL, once per epoch). ArrayLoader's epochs (RowBatches, row_batches.c) are one:
 *   Note [native epochs]. A native source gives leaves only, so the producer reads such an object
 *   natively when the prefetcher has a captured structure to put them in, and as a plain Python
 *   iterable otherwise.
 *
 * The producer finds a source's ops by the exact type of the epoch's iterator
 * (pl_source_ops_of): no source-specific branch in the producer. An opened native source is held
 * (a strong reference) until the last batch made from it is copied (pf_producer.c). */
#ifndef PL_SOURCE_H
#define PL_SOURCE_H

#include "state.h"

#include "flatten.h"

#include <stdatomic.h>

/* What next() returns. */
enum {
    PL_SOURCE_BATCH = 1,    /* f holds a batch */
    PL_SOURCE_END = 0,      /* the epoch is over */
    PL_SOURCE_ERROR = -1,   /* needs_gil: a Python exception is set; else the reason is in why */
    PL_SOURCE_STOPPED = -2, /* the prefetcher was closed while user code ran: f holds nothing */
};

/* What the producer tells a source about the batch it asks for, and what it learns back. */
typedef struct pl_source_ctx {
    atomic_int *stop;         /* the prefetcher is closing (read it after running user code) */
    Py_ssize_t structure_leaves; /* structure=: each item is a tuple of this many leaves; 0: none */
    uint64_t index;           /* the batch's position in the epoch, for messages */
    int64_t next_ns;          /* out: the time the source took to give its item */
} pl_source_ctx;

typedef struct pl_source_ops {
    const char *name;
    int needs_gil; /* next() runs with the GIL held (it calls Python) */
    /* GIL held: begin reading `obj` (its one reader). *state gets what next() needs (freed by
     * close), *n_leaves the leaves every batch has. f is the producer's, for reserving room.
     * Returns 0, or -1 with an exception. Every native source has one (the producer calls it
     * for n_leaves); only pl_py_source, never opened, leaves it NULL. */
    int (*open)(PyObject *obj, pl_flat *f, void **state, int *n_leaves);
    /* The next batch into f (pl_flat_begin is the source's to call): PL_SOURCE_*. */
    int (*next)(PyObject *obj, void *state, pl_flat *f, pl_source_ctx *ctx, char *why, size_t n_why);
    /* Free what open made (any thread, no GIL needed). It runs when the producer retires the
     * source, before the copy of its last batch is done (only obj is held until then): the
     * state must hold nothing a batch's copy reads. NULL when open makes no state. */
    void (*close)(void *state);
} pl_source_ops;

/* Any Python iterable (Note [sources]). */
extern const pl_source_ops pl_py_source;

/* GIL held, at module init: objects of exactly `type` are native sources read with `ops` (a
 * static table). Returns 0, or -1 with an exception. */
int pl_source_register(pl_state *st, PyTypeObject *type, const pl_source_ops *ops);
/* GIL held: the registered ops of obj's exact type, or NULL (read it as a Python iterable). */
const pl_source_ops *pl_source_ops_of(pl_state *st, PyObject *obj);

#endif
