/* The pinned types' private header: their objects and the functions their files share.
 * pinned_pool.c holds PinnedPool (alloc, the default pools' objects); pinned_buffer.c
 * PinnedBuffer (the buffer protocol, its DLPack export); pinned_client.c PoolClient and
 * pl_pinned_init. The public header is pinned.h. */
#ifndef PL_PINNED_IMPL_H
#define PL_PINNED_IMPL_H

#include "pinned.h"

#include "pool.h"

#include <stdatomic.h>

typedef struct {
    PyObject_HEAD
    pl_pool *pool;
    const pl_backend *b;
    int device;
    int closed;
    int is_default; /* a process-wide default pool: never closed (Note [default pool],
                     * pool_default.c) */
} PinnedPoolObject;

/* PoolClient: a share of a pool bounded by its own cap (Note [pool clients] in pool.h). */
typedef struct {
    PyObject_HEAD
    PyObject *pool_obj; /* the PinnedPool */
    pl_pool_client *client;
} PoolClientObject;
/* A PinnedBuffer's region and its owners (Note [pinned buffer lifetime] in pinned_buffer.c). */
typedef struct {
    atomic_long refs;
    atomic_long dlpack_exports; /* live capsules / tensors made from the buffer */
    pl_pool *pool;              /* a pool reference of its own */
    pl_region *region;
} pinned_share;

typedef struct {
    PyObject_HEAD
    PyObject *pool_obj;   /* the PinnedPool, for the .pool property */
    pinned_share *share;  /* NULL once released */
    pl_region *region;    /* share->region while live, else NULL */
    Py_ssize_t buffer_exports; /* guarded by the GIL */
} PinnedBufferObject;
/* ---- pinned_pool.c ---- */

/* pl_raise_forked(what); returns -1. */
int pl_pinned_forked_error(const char *what);
/* PinnedPool.alloc and PoolClient.alloc (client non-NULL: charged to it). */
PyObject *pl_pinned_alloc_impl(PyObject *op, pl_pool_client *client, PyObject *args, PyObject *kwds);
/* The PinnedPool type, added to module m. */
int pl_pinned_pool_init(PyObject *m, pl_state *st);

/* ---- pinned_buffer.c ---- */

/* The PinnedBuffer type, added to module m. */
int pl_pinned_buffer_init(PyObject *m, pl_state *st);

#endif
