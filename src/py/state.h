/* The module state and the helpers every Python-facing file shares: state lookup, the
 * exceptions for backend errors and for objects inherited across fork(), and the resolution of
 * a device argument (state.c). */
#ifndef PL_STATE_H
#define PL_STATE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "backend.h"

typedef struct pl_prefetcher_obj pl_prefetcher_obj;
struct pl_source_ops;

/* The native sources' types (Note [sources] in source.h); borrowed, the types are held above. */
#define PL_MAX_SOURCE_TYPES 4

/* A wait that blocks with the GIL released (a batch, a pool reservation, a host-backend copy)
 * runs in slices this long and checks for signals between them, so Ctrl-C is seen within one. */
#define PL_SIGNAL_SLICE_NS ((int64_t)50 * 1000 * 1000)

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
    PyTypeObject *RowBatches_Type;
    struct {
        PyTypeObject *type;
        const struct pl_source_ops *ops;
    } sources[PL_MAX_SOURCE_TYPES];
    int n_sources;
    PyObject *CudaError;
    PyObject *PoolExhausted;
    PyObject *numpy_dtype_fn; /* numpy.dtype */
    /* The PinnedPool objects of the default pools, by (backend name, device); made on first
     * use. Guarded by the GIL. */
    PyObject *default_pools;
    /* Live prefetchers, closed by shutdown() at interpreter exit. Guarded by the GIL. */
    pl_prefetcher_obj *live;
} pl_state;

/* The module's definition, given once by PyInit__C (module.c) before any lookup by type. */
void pl_state_set_module_def(PyModuleDef *def);
pl_state *pl_state_of_type(PyTypeObject *tp);
pl_state *pl_state_of_module(PyObject *m);

/* Raise the exception for backend error `code`: CudaError (with .code and .name) for CUDA
 * and backend failures, MemoryError for host allocation failures. `what` says what failed.
 * Always returns NULL. */
PyObject *pl_raise_backend(pl_state *st, const pl_backend *b, int code, const char *what);
/* Raise RuntimeError: this `what` (a type name) was created before fork() and cannot be used
 * in the child. Always returns NULL. */
PyObject *pl_raise_forked(const char *what);

/* PINLOADER_BACKEND=host: the host backend whatever CUDA can do. */
int pl_force_host(void);
/* 1 if the CUDA backend is usable (and not forced off by PINLOADER_BACKEND=host). */
int pl_cuda_usable(void);
/* Resolve a user's device argument: None (CUDA current device if usable, else host), "cpu",
 * "cuda", "cuda:N", an int, or a torch.device-like object with .type and .index.
 * Returns 0 or -1 with an exception set. */
int pl_resolve_device(pl_state *st, PyObject *device, const pl_backend **b, int *dev);

#endif
