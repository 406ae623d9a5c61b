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

#include "devgather.h"

#include "block.h"
#include "numa.h"
#include "pool.h"
#include "stager.h"
#include "util.h"

#include "pl_nvtx.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

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

static PyObject *mod_debug_violation(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    const char *v = pl_debug_first_violation();
    if (!v)
        Py_RETURN_NONE;
    return PyUnicode_FromString(v);
}

static PyObject *mod_live_device_blocks(PyObject *m, PyObject *arg)
{
    (void)m;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    const pl_backend *b = strcmp(name, "cuda") == 0 ? pl_backend_cuda(NULL, NULL) : pl_backend_host();
    if (!b)
        return Py_BuildValue("(in)", 0, (Py_ssize_t)0);
    return Py_BuildValue("(ln)", pl_block_live_count(b), (Py_ssize_t)pl_block_live_bytes(b));
}

/* Test hook: bytes staged with streaming stores (Note [non-temporal staging stores]). */
static PyObject *mod_streamed_bytes(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    return PyLong_FromUnsignedLongLong(pl_stager_streamed_bytes());
}

/* Test hook: the sysfs reading of Note [slabs on the GPU's node] in numa.c. */
static PyObject *mod_numa_node_of_pci(PyObject *m, PyObject *arg)
{
    (void)m;
    const char *id = PyUnicode_AsUTF8(arg);
    if (!id)
        return NULL;
    return PyLong_FromLong(pl_numa_node_of_pci(id));
}

static PyObject *mod_debug_hold_copies(PyObject *m, PyObject *on)
{
    (void)m;
    int v = PyObject_IsTrue(on);
    if (v < 0)
        return NULL;
    pl_host_hold_streams(v);
    Py_RETURN_NONE;
}

static PyObject *mod_gather_grid(PyObject *m, PyObject *arg)
{
    (void)m;
    unsigned long v = PyLong_AsUnsignedLong(arg);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    if (v > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "_gather_grid: max_blocks must be at most 2**31 - 1");
        return NULL;
    }
    return PyLong_FromUnsignedLong(pl_cuda_gather_grid((unsigned)v));
}

static PyObject *mod_device_pool_reserved(PyObject *m, PyObject *arg)
{
    long device = PyLong_AsLong(arg);
    if (device == -1 && PyErr_Occurred())
        return NULL;
    if (device < 0 || device > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "_device_pool_reserved: device must be >= 0");
        return NULL;
    }
    const pl_backend *b = pl_backend_cuda(NULL, NULL);
    if (!b) {
        PyErr_SetString(PyExc_RuntimeError, "_device_pool_reserved: CUDA is not usable here");
        return NULL;
    }
    size_t n = 0;
    int rc = pl_cuda_device_pool_reserved((int)device, &n);
    if (rc != PL_OK) {
        pl_raise_backend(pl_state_of_module(m), b, rc, "cudaMemPoolGetAttribute");
        return NULL;
    }
    return PyLong_FromSize_t(n);
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
    {"_set_cudart_candidates", mod_set_cudart_candidates, METH_O, NULL},
    {"_shutdown", mod_shutdown, METH_NOARGS, NULL},
    {"_debug_violation", mod_debug_violation, METH_NOARGS, NULL},
    {"_live_device_blocks", mod_live_device_blocks, METH_O, NULL},
    {"_streamed_bytes", mod_streamed_bytes, METH_NOARGS, NULL},
    {"_numa_node_of_pci", mod_numa_node_of_pci, METH_O,
     "_numa_node_of_pci(bus_id, /)\n--\n\nTest hook: the NUMA node pinned slabs of the GPU at this PCI "
     "bus id would be placed on (-1: one node or unknown). PINLOADER_SYSFS_ROOT stands in for /."},
    {"_debug_signal_after_handout", pl_pf_debug_signal_after_handout, METH_O,
     "_debug_signal_after_handout(signum, /)\n--\n\nTest switch: the next batch handed out ends with "
     "signal signum raised from C, as one that lands during the static copy would be (0: off)."},
    {"_device_pool_reserved", mod_device_pool_reserved, METH_O,
     "_device_pool_reserved(device, /)\n--\n\nTest hook: the bytes the device pool of CUDA device "
     "`device` holds, in use and kept for reuse (Note [device pool] in src/core/backend_cuda.c)."},
    {"_gather_grid", mod_gather_grid, METH_O,
     "_gather_grid(max_blocks, /)\n--\n\nBenchmark knob: the most blocks one gather kernel launch "
     "uses (0: the default, 16 per multiprocessor). Returns the previous value (0 for the default)."},
    {"_debug_hold_copies", mod_debug_hold_copies, METH_O,
     "_debug_hold_copies(on)\n--\n\nTest switch, host backend only: while on, every host stream holds "
     "its queued work (copies included) and new device blocks are poisoned with 0xcd, so a reader "
     "that skips the ready-event wait sees the poison. Anything that waits for a stream waits until "
     "it is turned off."},
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
        pl_gather_init(m, st) < 0 || pl_cpus_init(m) < 0 || pl_flatten_init(m) < 0 ||
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
