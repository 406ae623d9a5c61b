/* PinnedPool, PinnedBuffer and PoolClient: the Python face of pool.c
 * (pinned_pool.c, pinned_buffer.c, pinned_client.c; their private header is pinned_impl.h). */
#ifndef PL_PINNED_H
#define PL_PINNED_H

#include "state.h"

struct pl_pool;

int pl_pinned_init(PyObject *m, pl_state *st);

/* 1 if o is a PinnedBuffer (a pinned source skips staging); inline: the walk asks it of leaves. */
static inline int pl_pinned_buffer_check(pl_state *st, PyObject *o)
{
    return PyObject_TypeCheck(o, st->PinnedBuffer_Type);
}
/* A byte count from a Python int: TypeError for other types, ValueError below min, and
 * OverflowError (naming `name`) past SIZE_MAX. Returns 0 or -1. */
int pl_parse_nbytes(PyObject *o, const char *name, size_t min, size_t *out);
struct pl_pool *pl_pinned_pool_get(pl_state *st, PyObject *pool_obj); /* borrowed; NULL if not a pool */
/* default_pool(device): the PinnedPool object of the process-wide default pool of device
 * (Note [default pool] in src/core/pool_default.c); the same object on every call. New
 * reference. */
PyObject *pl_default_pool(pl_state *st, PyObject *device);

#endif
