/* pinloader._C: the module definition, its functions and its initialisation (the state and
 * the shared raise/resolve helpers are in state.c). */
#include "state.h"

/* First: this file imports the NumPy C API, the others (gather.h among them) only use it. */
#define PL_NP_IMPORT
#include "np.h"

#include "cpu_budget.h"
#include "device_array.h"
#include "dlpack.h"
#include "flatten.h"
#include "gather.h"
#include "image_host.h"
#include "jpeg_decoder.h"
#include "pinned.h"
#include "prefetcher.h"
#include "prim.h"
#include "testing.h"

#include "devgather.h"

#include "block.h"
#include "pool.h"
#include "util.h"

#include "pl_nvtx.h"

#include <pthread.h>

/* ---- module functions ---- */

static PyObject *mod_backend(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    return PyUnicode_FromString(pl_cuda_usable() ? "cuda" : "host");
}

static PyObject *mod_cuda_available(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    return PyBool_FromLong(pl_cuda_usable());
}

static PyObject *mod_device_count(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    if (pl_force_host())
        return PyLong_FromLong(0);
    int n = 0;
    pl_cuda_device_count(&n);
    return PyLong_FromLong(n);
}

static PyObject *mod_cuda_info(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    int err = 0, drv = 0, rt = 0, n = 0;
    const char *detail = NULL;
    const pl_backend *b = pl_backend_cuda(&err, &detail);
    pl_cuda_versions(&drv, &rt);
    pl_cuda_device_count(&n);
    const char *path = pl_cuda_library_path();
    return Py_BuildValue("{s:O,s:s,s:i,s:i,s:i,s:s,s:i}", "usable", b ? Py_True : Py_False,
                         "library", path ? path : "", "driver_version", drv, "runtime_version", rt,
                         "device_count", n, "error", b ? "" : detail, "error_code", b ? 0 : err);
}

static PyObject *mod_cuda_driver_state(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    static const char *const names[] = {"absent", "uninitialized", "initialized", "unknown"};
    const int state = pl_cuda_driver_state();
    const int known = state >= PL_DRIVER_ABSENT && state <= PL_DRIVER_UNKNOWN;
    return PyUnicode_FromString(names[known ? state : PL_DRIVER_UNKNOWN]);
}

static PyObject *mod_set_cudart_candidates(PyObject *m, PyObject *seq)
{
    (void)m;
    PyObject *fast = PySequence_Fast(seq, "candidates must be a sequence of str");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    const char **paths = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    if (!paths) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(fast, i);
        if (!(paths[i] = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "candidates must be str");
            PyMem_Free(paths);
            Py_DECREF(fast);
            return NULL;
        }
    }
    pl_cuda_set_library_candidates(paths, (int)n);
    PyMem_Free(paths);
    Py_DECREF(fast);
    Py_RETURN_NONE;
}

static PyObject *mod_shutdown(PyObject *m, PyObject *noargs)
{
    (void)noargs;
    pl_prefetcher_shutdown_all(pl_state_of_module(m));
    /* Give the default pools' idle slabs back (Note [default pool] in pool_default.c). */
    Py_BEGIN_ALLOW_THREADS
    pl_pool_trim_defaults();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *mod_default_pool(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"device", NULL};
    PyObject *device = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:default_pool", kwlist, &device))
        return NULL;
    return pl_default_pool(pl_state_of_module(m), device);
}

static PyObject *mod_default_pool_cap(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    return PyLong_FromSize_t(pl_pool_shared_cap());
}

static PyObject *mod_default_pinned_cap(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    return PyLong_FromSize_t(pl_pool_default_cap());
}

static PyMethodDef module_methods[] = {
    {"backend", mod_backend, METH_NOARGS,
     "backend()\n--\n\n\"cuda\" when a CUDA device is usable (and PINLOADER_BACKEND is not 'host'), else \"host\"."},
    {"cuda_available", mod_cuda_available, METH_NOARGS,
     "cuda_available()\n--\n\nWhether the CUDA runtime loaded and at least one device is visible."},
    {"device_count", mod_device_count, METH_NOARGS,
     "device_count()\n--\n\nNumber of visible CUDA devices (0 without CUDA)."},
    {"cuda_info", mod_cuda_info, METH_NOARGS,
     "cuda_info()\n--\n\nWhat was found: library path, driver and runtime versions, device count, and why CUDA is unusable if it is."},
    {"default_pool", (PyCFunction)(void (*)(void))mod_default_pool, METH_VARARGS | METH_KEYWORDS,
     "default_pool(device=None)\n--\n\nThe process-wide PinnedPool of device, shared by "
     "prefetchers made without pool=. Made on first use with default_pool_cap(); its slabs outlive "
     "the prefetchers; trim() gives idle ones back, and so does interpreter exit. It cannot be "
     "closed.\n\n"
     "Parameters\n----------\n"
     "device\n    As for AsyncPrefetcher: None (the current CUDA device, else the host backend), "
     "'cpu', 'cuda', 'cuda:N' or an int. Each device has its own pool."},
    {"default_pool_cap", mod_default_pool_cap, METH_NOARGS,
     "default_pool_cap()\n--\n\nThe default pools' cap: default_pinned_cap() divided among the "
     "local ranks (LOCAL_WORLD_SIZE, set by torchrun)."},
    {"default_pinned_cap", mod_default_pinned_cap, METH_NOARGS,
     "default_pinned_cap()\n--\n\nThe default PinnedPool cap in bytes: a quarter of physical memory, "
     "at most half of RLIMIT_MEMLOCK where that binds."},
    {"cuda_driver_state", mod_cuda_driver_state, METH_NOARGS,
     "cuda_driver_state()\n--\n\nThe CUDA driver in this process, without initializing it: "
     "'absent' (no libcuda), 'uninitialized', 'initialized' or 'unknown'."},
    {"set_cudart_candidates", mod_set_cudart_candidates, METH_O,
     "set_cudart_candidates(paths, /)\n--\n\nThe libcudart paths pinloader tries when it loads the CUDA "
     "runtime (pinloader/_cudart.py's candidates)."},
    {"shutdown", mod_shutdown, METH_NOARGS,
     "shutdown()\n--\n\nClose every live AsyncPrefetcher (at interpreter exit)."},
    {NULL, NULL, 0, NULL},
};

/* ---- fork ---- */

/* The child of fork() has one thread. Objects made before the fork see a new generation and
 * refuse to work (see Note [fork generations] in util.h); the process-wide state of the host
 * backend, the device blocks and the pool is re-made so that objects made in the child work. */
static void at_fork_child(void)
{
    pl_generation_bump_in_child();
    pl_host_atfork_child();
    pl_block_atfork_child();
    pl_pool_atfork_child();
    pl_hostreg_atfork_child();
    pl_epoch_order_atfork_child();
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void install_fork_handler(void)
{
    pthread_atfork(NULL, NULL, at_fork_child);
}

/* ---- init ---- */

static int module_exec(PyObject *m)
{
    pl_state *st = pl_state_of_module(m);
    if (_import_array() < 0)
        return -1;
    pthread_once(&fork_once, install_fork_handler);
    /* NVTX initialises lazily on first use, racily by design; do it once here, before any
     * producer thread exists. Without a profiler attached this is a no-op. */
    PL_NVTX_INIT();

    PyObject *np = PyImport_ImportModule("numpy");
    if (!np)
        return -1;
    st->numpy_dtype_fn = PyObject_GetAttrString(np, "dtype");
    Py_DECREF(np);
    if (!st->numpy_dtype_fn)
        return -1;

    st->CudaError = PyErr_NewExceptionWithDoc(
        "pinloader.CudaError",
        "A CUDA runtime call failed, or CUDA was asked for and is not usable.\n\n"
        "Attributes: code (the CUDA error number, or a negative pinloader code) and name\n"
        "(the CUDA error name, e.g. 'cudaErrorNoDevice').",
        PyExc_RuntimeError, NULL);
    if (!st->CudaError || PyModule_AddObjectRef(m, "CudaError", st->CudaError) < 0)
        return -1;
    st->PoolExhausted = PyErr_NewExceptionWithDoc(
        "pinloader.PoolExhausted",
        "A pinned-memory request cannot be met under the pool's cap (it can never fit, or the "
        "timeout passed while waiting for regions to come back).",
        PyExc_MemoryError, NULL);
    if (!st->PoolExhausted || PyModule_AddObjectRef(m, "PoolExhausted", st->PoolExhausted) < 0)
        return -1;

    if (pl_pinned_init(m, st) < 0 || pl_device_array_init(m, st) < 0 ||
        pl_prefetcher_init(m, st) < 0 || pl_prim_init(m, st) < 0 ||
        pl_testing_init(m, st) < 0 ||
        pl_array_types_init(m, st) < 0 || pl_cpus_init(m) < 0 || pl_flatten_init(m) < 0 ||
        pl_jpeg_decoder_init(m) < 0 || pl_image_host_init(m) < 0)
        return -1;
    if (PyModule_AddIntConstant(m, "DLPACK_MAJOR", DLPACK_MAJOR_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "DLPACK_MINOR", DLPACK_MINOR_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "NVTX", PL_NVTX_ENABLED) < 0)
        return -1;
#ifdef PL_SANITIZE
    if (PyModule_AddIntConstant(m, "SANITIZED", 1) < 0)
        return -1;
#else
    if (PyModule_AddIntConstant(m, "SANITIZED", 0) < 0)
        return -1;
#endif
    return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg)
{
    pl_state *st = pl_state_of_module(m);
    Py_VISIT(st->PinnedPool_Type);
    Py_VISIT(st->PinnedBuffer_Type);
    Py_VISIT(st->PoolClient_Type);
    Py_VISIT(st->default_pools);
    Py_VISIT(st->DeviceArray_Type);
    Py_VISIT(st->AsyncPrefetcher_Type);
    Py_VISIT(st->Prim_Type);
    Py_VISIT(st->RowGather_Type);
    Py_VISIT(st->Registration_Type);
    Py_VISIT(st->RowBatches_Type);
    Py_VISIT(st->CudaError);
    Py_VISIT(st->PoolExhausted);
    Py_VISIT(st->numpy_dtype_fn);
    return 0;
}

static int module_clear(PyObject *m)
{
    pl_state *st = pl_state_of_module(m);
    Py_CLEAR(st->PinnedPool_Type);
    Py_CLEAR(st->PinnedBuffer_Type);
    Py_CLEAR(st->PoolClient_Type);
    Py_CLEAR(st->default_pools);
    Py_CLEAR(st->DeviceArray_Type);
    Py_CLEAR(st->AsyncPrefetcher_Type);
    Py_CLEAR(st->Prim_Type);
    Py_CLEAR(st->RowGather_Type);
    Py_CLEAR(st->Registration_Type);
    st->n_sources = 0; /* their types are the ones cleared here */
    Py_CLEAR(st->RowBatches_Type);
    Py_CLEAR(st->CudaError);
    Py_CLEAR(st->PoolExhausted);
    Py_CLEAR(st->numpy_dtype_fn);
    return 0;
}

static void module_free(void *m)
{
    module_clear((PyObject *)m);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#ifdef Py_mod_multiple_interpreters
    /* One process-wide CUDA function table, and producer threads that each keep one thread
     * state of the main interpreter (Note [producer thread state] in pf_producer.c, with
     * PyGILState as its fallback): a single interpreter only. */
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
#ifdef Py_mod_gil
    /* Native threads hand results to Python through mutex-protected queues, but the module's
     * Python-facing objects assume the GIL serialises their methods. */
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static PyModuleDef pl_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pinloader._C",
    .m_doc = "pinloader's native core: backends, the pinned slab pool, device arrays and the "
             "asynchronous prefetcher.",
    .m_size = sizeof(pl_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void)
{
    pl_state_set_module_def(&pl_module_def);
    return PyModuleDef_Init(&pl_module_def);
}
