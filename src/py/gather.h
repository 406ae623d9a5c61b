/* RowGather: rows of an array source (RAM or memory-mapped), a batch leaf that the staging
 * threads gather straight into pinned memory (see Note [array sources] in row_gather.c and
 * Note [row gather] in stager.c). Also the epoch permutation ArrayLoader samples with. */
#ifndef PL_GATHER_H
#define PL_GATHER_H

#include "state.h"

#include "dlpack.h"
#include "np.h"
#include "stager.h"

/* The gathered leaf of a RowGather, as the prefetcher lays it out: shape (n,) + row shape, or
 * (n, window) + row shape; strides of the source (dim 0 applied through rows). */
typedef struct pl_row_gather_leaf {
    const char *src; /* the source's element [0, ..., 0] */
    int ndim;
    npy_intp shape[PL_MAX_DIMS];
    int64_t strides[PL_MAX_DIMS]; /* bytes */
    DLDataType dtype;
    const int64_t *rows; /* shape[0] validated entries, owned by the RowGather */
    const struct pl_hostreg *reg; /* registered for the device gather, or NULL */
    size_t span;         /* with reg: bytes per item (Note [device gather] in devgather.h) */
    int64_t n_items;     /* items in the source: its rows, less window - 1 */
} pl_row_gather_leaf;

/* 1 if o is a pinloader._C.RowGather (inline: the walk asks it of every leaf). */
static inline int pl_row_gather_check(pl_state *st, PyObject *o)
{
    return PyObject_TypeCheck(o, st->RowGather_Type);
}

/* ArrayLoader's native types (RowGather, Registration, RowBatches, registered as a native source;
 * the epoch tables and OrderJob) added to module m. */
int pl_array_types_init(PyObject *m, pl_state *st);
/* The fork child handler's part (module.c): epoch_order.c's test switch re-made, off. */
void pl_epoch_order_atfork_child(void);

/* RowBatches, one epoch of an ArrayLoader, is a native source (Note [sources] in source.h,
 * Note [native epochs] in row_batches.c): the producer reads it through the ops it registers. */

/* The layout of RowGather o (already validated when o was made; cannot fail). Valid while o
 * is alive. */
void pl_row_gather_layout(PyObject *o, pl_row_gather_leaf *out);

#endif
