/* Handing a batch to the consumer (handout.c): the one place where a batch's array leaves
 * become what the consumer asked for, and its structure is rebuilt around them.
 *
 * Note [handout]
 * The producer walks each item once (flatten.c) and keeps its tree (pl_tree) and its leaves,
 * as views of the batch's block in walk order (Note [batch leaves] in flatten.h). When the
 * consumer takes the batch, pl_handout_batch turns each leaf into the delivered object and
 * builds the structure once, in C:
 *   - output="array" (no convert, not static), a Python source: the producer has already
 *     built the structure of DeviceArrays, and this file is not involved; a native source's
 *     batch (leaves only: Note [sources] in source.h) comes here in every mode, its leaves
 *     made DeviceArrays and placed in the captured structure;
 *   - output="capsule": every leaf is exported for the consumer's stream in one pass, straight
 *     from its view (the stream waits on the batch's copy once; no DeviceArray is made);
 *   - convert=f: each delivered leaf is f(x), x the capsule (output="capsule") or a DeviceArray
 *     made from the view (output="array"): a framework's DLPack import applied in place, so a
 *     torch, CuPy or JAX batch is walked once and built once;
 *   - static=True: the leaves are copied into the prefetcher's static buffers first (Note
 *     [static batches] in handout.c), and the delivered leaves are the same objects every
 *     batch (the buffers' DeviceArrays, or their convert= results, made once), except with
 *     output="capsule" and no convert, where each batch gets fresh capsules of the same
 *     buffers (a capsule is consumed once); with out=, the buffers are the user's (any DLPack
 *     exporters), delivered as they are.
 * The stream is `stream=`: None (the legacy default stream), a DLPack stream handle, or a
 * callable returning one, called once per batch (a framework's current stream).
 * Containers are rebuilt with the item's types: list, tuple, namedtuple, list and tuple
 * subclasses, dict and dict subclasses (a shallow copy keeps a defaultdict's factory),
 * dataclasses (frozen ones too); other objects pass through (Note [one leaf classifier] in
 * flatten.c). */
#ifndef PL_HANDOUT_H
#define PL_HANDOUT_H

#include "state.h"

#include "flatten.h"

typedef struct pl_static pl_static;

typedef struct pl_handout {
    int capsule;          /* output="capsule" */
    PyObject *convert;    /* NULL, or the per-leaf callable */
    PyObject *stream;     /* None, a DLPack stream handle, or a callable giving one */
    int is_static;        /* static=True (or out=) */
    PyObject *out;        /* out=: a tuple of the user's static buffers, or NULL */
    pl_static *statics;   /* the static buffers, made at the first batch */
    Py_ssize_t valid_rows; /* rows of the last static batch (-1: none yet) */
    unsigned long static_gen; /* counts drops of the static buffers (see pl_handout_batch) */
    int closed;           /* set by pl_handout_drop_static (close()): see Note [closed during
                           * a handout] in handout.c */
    int64_t static_rows;  /* static=True without out=: lay the buffers out for at least this
                           * many rows (0: the first batch's rows) */
} pl_handout;

/* 1 when batches go through pl_handout_batch (capsule, convert or static). */
static inline int pl_handout_active(const pl_handout *h)
{
    return h->capsule || h->convert || h->is_static;
}

/* The batch to hand out: `leaves` (the batch's array leaves, walk order; their block must
 * stay referenced by the caller until this returns) made into the delivered objects and placed
 * in `tree`. A new reference, or NULL with an exception (a static batch that does not fit the
 * static layout: ValueError naming the leaf). */
PyObject *pl_handout_batch(pl_state *st, const pl_backend *b, int device, pl_handout *h,
                           const pl_tree *tree, const pl_leaves *leaves);
/* The static buffers' DeviceArrays (a new tuple), or None before the first static batch and
 * with out=. */
PyObject *pl_handout_static_arrays(const pl_handout *h);
/* Drop the static buffers and their converted leaves and mark the handout closed (GIL held;
 * at close()): the memory is freed in stream order after the last use, once nothing delivered
 * refers to it. A handout under way notices (Note [closed during a handout] in handout.c). */
void pl_handout_drop_static(pl_handout *h);
/* pl_handout_drop_static, and drop the options' references (tp_clear, dealloc). */
void pl_handout_clear(pl_handout *h);
int pl_handout_traverse(const pl_handout *h, visitproc visit, void *arg);

#endif
