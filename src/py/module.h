/* Shared declarations of the Python-facing files (module.c, pinned.c, device_array.c,
 * prefetcher.c, prim.c, gather.c). */
#ifndef PL_MODULE_H
#define PL_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "backend.h"
#include "dlpack.h"

typedef struct pl_prefetcher_obj pl_prefetcher_obj;

#if PY_VERSION_HEX >= 0x030D0000
#define pl_py_finalizing() Py_IsFinalizing()
#else
#define pl_py_finalizing() _Py_IsFinalizing()
#endif

typedef struct {
    PyTypeObject *PinnedPool_Type;
    PyTypeObject *PinnedBuffer_Type;
    PyTypeObject *PoolClient_Type;
    PyTypeObject *DeviceArray_Type;
    PyTypeObject *AsyncPrefetcher_Type;
    PyTypeObject *Prim_Type;
    PyTypeObject *RowGather_Type;
    PyTypeObject *Registration_Type;
    PyObject *CudaError;
    PyObject *PoolExhausted;
    PyObject *numpy_dtype_fn; /* numpy.dtype */
    /* The PinnedPool objects of the default pools, by (backend name, device); made on first
     * use. Guarded by the GIL. */
    PyObject *default_pools;
    /* Live prefetchers, closed by _shutdown() at interpreter exit. Guarded by the GIL. */
    pl_prefetcher_obj *live;
} pl_state;

extern PyModuleDef pl_module_def;

pl_state *pl_state_of_type(PyTypeObject *tp);
pl_state *pl_state_of_module(PyObject *m);

/* Raise the exception for backend error `code`: CudaError (with .code and .name) for CUDA
 * and backend failures, MemoryError for host allocation failures. `what` says what failed.
 * Always returns NULL. */
PyObject *pl_raise_backend(pl_state *st, const pl_backend *b, int code, const char *what);
/* Raise RuntimeError: this `what` (a type name) was created before fork() and cannot be used
 * in the child. Always returns NULL. */
PyObject *pl_raise_forked(const char *what);

/* Resolve a user's device argument: None (CUDA current device if usable, else host), "cpu",
 * "cuda", "cuda:N", an int, or a torch.device-like object with .type and .index.
 * Returns 0 or -1 with an exception set. */
int pl_resolve_device(pl_state *st, PyObject *device, const pl_backend **b, int *dev);

/* Module parts. */
int pl_pinned_init(PyObject *m, pl_state *st);
int pl_device_array_init(PyObject *m, pl_state *st);
int pl_prefetcher_init(PyObject *m, pl_state *st);
int pl_prim_init(PyObject *m, pl_state *st);
int pl_gather_init(PyObject *m, pl_state *st);
int pl_cpus_init(PyObject *m); /* cpu_budget.c: default_staging_threads() */
void pl_prefetcher_shutdown_all(pl_state *st);

/* ---- pieces shared between files ---- */
struct pl_block;
struct pl_pool;
struct pl_region;

/* PinnedBuffer internals the prefetcher needs (pinned sources skip staging). */
int pl_pinned_buffer_check(pl_state *st, PyObject *o);
/* A byte count from a Python int: TypeError for other types, ValueError below min, and
 * OverflowError (naming `name`) past SIZE_MAX. Returns 0 or -1. */
int pl_parse_nbytes(PyObject *o, const char *name, size_t min, size_t *out);
struct pl_pool *pl_pinned_pool_get(pl_state *st, PyObject *pool_obj); /* borrowed; NULL if not a pool */
/* default_pool(device): the PinnedPool object of the process-wide default pool of device
 * (Note [default pool] in pool.c); the same object on every call. New reference. */
PyObject *pl_default_pool(pl_state *st, PyObject *device);

/* DeviceArray: a view of `nbytes` at `offset` in blk, C-contiguous. Takes a new block
 * reference. shape may be NULL when ndim is 0. */
PyObject *pl_device_array_new(pl_state *st, struct pl_block *blk, size_t offset, int ndim,
                              const int64_t *shape, DLDataType dtype, int device_type, int device_id);

void pl_device_array_add_offset(PyObject *o, size_t delta);
int pl_device_array_check(pl_state *st, PyObject *o);

/* Map between NumPy and DLPack dtypes. Returns 0, or -1 with *why set (no exception). */
int pl_dtype_from_numpy(char kind, int elsize, int type_num, char byteorder, DLDataType *out,
                        const char **why);
/* A numpy.dtype object for dt, or a str name where NumPy has none (bfloat16, float8...). */
PyObject *pl_dtype_to_python(pl_state *st, DLDataType dt);
int pl_dtype_valid(DLDataType dt, const char **why);

/* Read a DLPack capsule (either name) without consuming it. */
int pl_capsule_tensor(PyObject *capsule, DLTensor **t, int *versioned);

#endif
