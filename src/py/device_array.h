/* DeviceArray: a view of one leaf of a batch in the batch's device block (device_array.c). */
#ifndef PL_DEVICE_ARRAY_H
#define PL_DEVICE_ARRAY_H

#include "state.h"

#include "dlpack.h"

struct pl_block;

int pl_device_array_init(PyObject *m, pl_state *st);

/* DeviceArray: a view of `nbytes` at `offset` in blk, C-contiguous. Takes a new block
 * reference. shape may be NULL when ndim is 0. */
PyObject *pl_device_array_new(pl_state *st, struct pl_block *blk, size_t offset, int ndim,
                              const int64_t *shape, DLDataType dtype, int device_type, int device_id);

void pl_device_array_add_offset(PyObject *o, size_t delta);
int pl_device_array_check(pl_state *st, PyObject *o);

/* What a DeviceArray views (borrowed: valid while o lives). */
typedef struct pl_da_view {
    struct pl_block *blk;
    size_t offset, nbytes;
    int ndim;
    const int64_t *shape;
    DLDataType dtype;
} pl_da_view;
/* 0 with *v filled when o is a DeviceArray, else -1 (no exception). */
int pl_device_array_view(pl_state *st, PyObject *o, pl_da_view *v);

/* A batch's leaves without DeviceArrays (Note [batch leaves] in flatten.h): n views on DLPack
 * device dev, all in one block.
 * pl_export_views: their legacy "dltensor" capsules for the consumer's `stream`, exactly as
 *   pl_export_leaves exports DeviceArrays viewing the same memory (one wait per block and
 *   stream, each capsule a block reference; errors name "export_capsules: leaves[i]"). A new
 *   tuple, or NULL with an exception.
 * pl_device_arrays_of: a DeviceArray per view (a new tuple), or NULL with an exception. */
PyObject *pl_export_views(pl_state *st, const pl_da_view *v, Py_ssize_t n, DLDevice dev,
                          PyObject *stream);
PyObject *pl_device_arrays_of(pl_state *st, const pl_da_view *v, Py_ssize_t n, DLDevice dev);

/* DLPack capsules (legacy "dltensor") of the DeviceArrays in `items` (a tuple; other objects
 * are passed through) for the consumer's `stream` (as __dlpack__'s stream argument): each
 * batch's block is waited on once per stream. A new tuple, or NULL with an exception naming
 * "export_capsules: leaves[i]". */
PyObject *pl_export_leaves(pl_state *st, PyObject *items, PyObject *stream);

/* A numpy.dtype object for dt, or a str name where NumPy has none (bfloat16, float8...). */
PyObject *pl_dtype_to_python(pl_state *st, DLDataType dt);

#endif
