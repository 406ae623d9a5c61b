/* pinloader._C._testing: switches and probes for the test suite and the benchmarks, kept off the
 * public module. Note [the testing submodule]. */
#include "testing.h"

#include "dlpack.h"
#include "gather_impl.h"
#include "jpeg_cuda.h"
#include "jpeg_decoder.h"
#include "prefetcher.h"

#include "block.h"
#include "devgather.h"
#include "numa.h"
#include "pool.h"
#include "stager.h"

#include <limits.h>
#include <string.h>

/* Note [the testing submodule]
 * The hooks that let tests see inside (live device blocks, registered bytes, the pool's debug
 * report, the backend primitives) and the switches that force a timing every time (held
 * copies, a signal after a handout) are not API, and a user who finds them in dir(pinloader._C)
 * cannot tell. They live in the same shared object, so every build and every CI job tests the
 * very code it ships, with no second extension and no build flag to flip; they hang off one
 * module object, pinloader._C._testing, made here while pinloader._C executes.
 *
 * The submodule is a plain module (PyModule_NewObject) with no state of its own. Its functions
 * are bound to pinloader._C itself (self is _C, __module__ is the submodule's name), so the
 * ones that raise through the module state (pl_state_of_module) find it; the _Prim type is
 * made with _C as its module for the same reason and only listed here. It is put in
 * sys.modules under its full name, as CPython's pyexpat does for pyexpat.errors, so both
 * `from pinloader._C import _testing` and `import pinloader._C._testing` find it. The switches
 * flip process-wide state that the data paths read (the host backend's held streams, the
 * prefetcher's signal after a handout, the gather kernel's grid cap): only the way Python
 * reaches them is private. */

static PyObject *t_debug_violation(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    const char *v = pl_debug_first_violation();
    if (!v)
        Py_RETURN_NONE;
    return PyUnicode_FromString(v);
}

static PyObject *t_live_device_blocks(PyObject *m, PyObject *arg)
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

static PyObject *t_streamed_bytes(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    return PyLong_FromUnsignedLongLong(pl_stager_streamed_bytes());
}

static PyObject *t_numa_node_of_pci(PyObject *m, PyObject *arg)
{
    (void)m;
    const char *id = PyUnicode_AsUTF8(arg);
    if (!id)
        return NULL;
    return PyLong_FromLong(pl_numa_node_of_pci(id));
}

/* The on/off test switches: set(on) with on = the argument's truth. */
static PyObject *set_switch(PyObject *arg, void (*set)(int))
{
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    set(on);
    Py_RETURN_NONE;
}

static PyObject *t_debug_hold_copies(PyObject *m, PyObject *on)
{
    (void)m;
    return set_switch(on, pl_host_hold_streams);
}

static PyObject *t_host_fail_after(PyObject *m, PyObject *args)
{
    (void)m;
    long long n;
    int sticky = 0;
    if (!PyArg_ParseTuple(args, "L|p:host_fail_after", &n, &sticky))
        return NULL;
    return PyLong_FromLongLong(pl_host_fail_after(n, sticky));
}

static PyObject *t_host_first_failed(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    const char *name = pl_host_first_failed();
    if (!name)
        Py_RETURN_NONE;
    return PyUnicode_FromString(name);
}

static PyObject *t_host_call_counts(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    const char *names[64];
    long long counts[64];
    int n = pl_host_call_counts(names, counts, 64);
    PyObject *d = PyDict_New();
    for (int i = 0; d && i < n && i < 64; i++) {
        PyObject *v = PyLong_FromLongLong(counts[i]);
        if (!v || PyDict_SetItemString(d, names[i], v) < 0) {
            Py_XDECREF(v);
            Py_CLEAR(d);
            break;
        }
        Py_DECREF(v);
    }
    return d;
}

static PyObject *t_gather_grid(PyObject *m, PyObject *arg)
{
    (void)m;
    unsigned long v = PyLong_AsUnsignedLong(arg);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    if (v > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "gather_grid: max_blocks must be at most 2**31 - 1");
        return NULL;
    }
    return PyLong_FromUnsignedLong(pl_cuda_gather_grid((unsigned)v));
}

/* m is pinloader._C (Note [the testing submodule]): a failure raises its CudaError. */
static PyObject *t_device_pool_reserved(PyObject *m, PyObject *arg)
{
    long device = PyLong_AsLong(arg);
    if (device == -1 && PyErr_Occurred())
        return NULL;
    if (device < 0 || device > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "device_pool_reserved: device must be >= 0");
        return NULL;
    }
    const pl_backend *b = pl_backend_cuda(NULL, NULL);
    if (!b) {
        PyErr_SetString(PyExc_RuntimeError, "device_pool_reserved: CUDA is not usable here");
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

static PyObject *t_registered_bytes(PyObject *m, PyObject *arg)
{
    (void)m;
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (!name || (strcmp(name, "host") && strcmp(name, "cuda")))
        return PyErr_Format(PyExc_ValueError, "backend must be 'host' or 'cuda'");
    const pl_backend *b = pl_backend_host();
    if (!strcmp(name, "cuda") && !(b = pl_backend_cuda(NULL, NULL)))
        return PyLong_FromLong(0);
    return PyLong_FromSize_t(pl_hostreg_total(b));
}

static PyObject *t_debug_counters(PyObject *m, PyObject *noargs)
{
    (void)m;
    (void)noargs;
    unsigned long long hw, hs, cw, cs;
    pl_block_consumer_counters(PL_BACKEND_HOST, &hw, &hs);
    pl_block_consumer_counters(PL_BACKEND_CUDA, &cw, &cs);
    return Py_BuildValue("{s:K,s:K,s:K,s:K}", "host_consumer_waits", hw,
                         "host_consumer_waits_skipped", hs, "cuda_consumer_waits", cw,
                         "cuda_consumer_waits_skipped", cs);
}

static PyObject *t_dlpack_stream(PyObject *m, PyObject *args)
{
    (void)m;
    PyObject *stream;
    int cuda;
    if (!PyArg_ParseTuple(args, "Op:dlpack_stream", &stream, &cuda))
        return NULL;
    pl_dlpack_stream s;
    if (pl_dlpack_parse_stream(stream, cuda, "this array", &s) < 0)
        return NULL;
    return Py_BuildValue("(ON)", s.kind == PL_DLPACK_SYNC ? Py_True : Py_False,
                         PyLong_FromVoidPtr(s.handle));
}

static PyObject *t_debug_hold_order_jobs(PyObject *m, PyObject *arg)
{
    (void)m;
    return set_switch(arg, pl_epoch_order_hold);
}

static PyObject *t_order_jobs_parked(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    return PyLong_FromLong(pl_epoch_order_parked());
}

static PyObject *t_debug_jpeg_engine_waits(PyObject *m, PyObject *arg)
{
    (void)m;
    return set_switch(arg, pl_jpeg_debug_engine_waits);
}

static PyObject *t_debug_jpeg_pipelined(PyObject *m, PyObject *arg)
{
    (void)m;
    return set_switch(arg, pl_jpeg_debug_pipelined);
}

static PyMethodDef testing_methods[] = {
    {"debug_jpeg_pipelined", t_debug_jpeg_pipelined, METH_O,
     PyDoc_STR("debug_jpeg_pipelined(on): True makes the GPU decoders made after it use nvJPEG's "
               "pipelined hardware mode (Note [the engines' call beside training] in "
               "src/core/jpeg_cuda.c)")},
    {"debug_jpeg_engine_waits", t_debug_jpeg_engine_waits, METH_O,
     PyDoc_STR("debug_jpeg_engine_waits(on): False makes every GPU decoder skip its wait before "
               "the hardware engines write (Note [engines write at once] in src/core/jpeg_cuda.c)")},
    {"jpeg_decoder_stream", pl_jpeg_decoder_stream, METH_O,
     PyDoc_STR("jpeg_decoder_stream(decoder) -> int: an open JpegDecoder's own stream, for "
               "Prim.hold (tests/test_jpeg_decoder_gpu.py)")},
    {"debug_hold_order_jobs", t_debug_hold_order_jobs, METH_O,
     "debug_hold_order_jobs(on, /)\n--\n\nTest switch: while on, the threads of epoch order jobs "
     "(OrderJob, Note [epoch orders] in src/py/epoch_order.c) wait before they begin."},
    {"order_jobs_parked", t_order_jobs_parked, METH_NOARGS,
     "order_jobs_parked()\n--\n\nHow many epoch order jobs' threads wait at the "
     "debug_hold_order_jobs switch now: a test forks only once they all do."},
    {"debug_hold_copies", t_debug_hold_copies, METH_O,
     "debug_hold_copies(on, /)\n--\n\nTest switch, host backend only: while on, every host stream "
     "holds its queued work (copies included) and new device blocks are poisoned with 0xcd, so a "
     "reader that skips the ready-event wait sees the poison. Anything that waits for a stream "
     "waits until it is turned off (Note [held copies] in src/core/backend_host.c)."},
    {"host_fail_after", t_host_fail_after, METH_VARARGS,
     "host_fail_after(n, sticky=False, /)\n--\n\nTest switch, host backend only: n >= 0 makes "
     "the host backend's call numbered n (from 0, counting only the table's calls that return a "
     "status) fail with an error instead of doing its work, and every later one too if sticky; "
     "n < 0 disarms; n >= 2**62 only counts (nothing fails, nothing is delayed). Returns the calls "
     "counted since the previous arming (Note [injected faults] in src/core/host_faults.c)."},
    {"host_first_failed", t_host_first_failed, METH_NOARGS,
     "host_first_failed()\n--\n\nTest probe: the name of the first host backend function that "
     "host_fail_after failed since it was last armed (e.g. 'event_record'), or None."},
    {"host_call_counts", t_host_call_counts, METH_NOARGS,
     "host_call_counts()\n--\n\nTest probe: the host backend's calls counted since "
     "host_fail_after last armed it, by function name (a dict)."},
    {"debug_signal_after_handout", pl_pf_debug_signal_after_handout, METH_O,
     "debug_signal_after_handout(signum, /)\n--\n\nTest switch: the next batch handed out ends with "
     "signal signum raised from C, as one that lands during the static copy would be (0: off; "
     "Note [interrupted handout] in src/py/pf_producer.c)."},
    {"debug_violation", t_debug_violation, METH_NOARGS,
     "debug_violation()\n--\n\nTest probe: the first misuse of pinned memory that debug mode "
     "(PINLOADER_DEBUG=1) reported in this process, or None."},
    {"debug_counters", t_debug_counters, METH_NOARGS,
     "debug_counters()\n--\n\nTest probe: process-wide counts of consumer waits issued and skipped "
     "(already queued on the same stream for the same batch), per backend."},
    {"dlpack_stream", t_dlpack_stream, METH_VARARGS,
     "dlpack_stream(stream, cuda, /)\n--\n\nTest probe: how __dlpack__ reads a stream argument, "
     "for tests of the CUDA rules on hosts without a GPU. Returns (synchronise, handle)."},
    {"live_device_blocks", t_live_device_blocks, METH_O,
     "live_device_blocks(backend, /)\n--\n\nTest probe: (count, bytes) of the device blocks alive "
     "on backend 'cuda' or 'host' ((0, 0) for 'cuda' where CUDA is not usable)."},
    {"registered_bytes", t_registered_bytes, METH_O,
     "registered_bytes(backend, /)\n--\n\nTest probe: bytes pinloader holds registered for the "
     "device gather in this process, for backend 'host' or 'cuda'."},
    {"streamed_bytes", t_streamed_bytes, METH_NOARGS,
     "streamed_bytes()\n--\n\nTest probe: bytes staged with streaming stores in this process (Note "
     "[non-temporal staging stores] in src/core/stager.c)."},
    {"numa_node_of_pci", t_numa_node_of_pci, METH_O,
     "numa_node_of_pci(bus_id, /)\n--\n\nTest probe: the NUMA node pinned slabs of the GPU at this "
     "PCI bus id would be placed on (-1: one node or unknown). PINLOADER_SYSFS_ROOT stands in for /."},
    {"device_pool_reserved", t_device_pool_reserved, METH_O,
     "device_pool_reserved(device, /)\n--\n\nTest probe: the bytes the device pool of CUDA device "
     "`device` holds, in use and kept for reuse (Note [device pool] in src/core/backend_cuda.c)."},
    {"gather_grid", t_gather_grid, METH_O,
     "gather_grid(max_blocks, /)\n--\n\nBenchmark switch: the most blocks one gather kernel launch "
     "uses (0: the default, 16 per multiprocessor). Returns the previous value (0 for the default)."},
    {NULL, NULL, 0, NULL},
};

int pl_testing_init(PyObject *m, pl_state *st)
{
    PyObject *parent = PyModule_GetNameObject(m);
    if (!parent)
        return -1;
    PyObject *name = PyUnicode_FromFormat("%U._testing", parent);
    Py_DECREF(parent);
    if (!name)
        return -1;
    PyObject *t = PyModule_NewObject(name);
    if (!t) {
        Py_DECREF(name);
        return -1;
    }
    int rc = -1;
    if (PyModule_SetDocString(t, "Switches and probes for pinloader's test suite and benchmarks "
                                 "(src/py/testing.c). Not API: any of them may change or go "
                                 "without notice.") < 0 ||
        PyModule_AddObjectRef(t, "Prim", (PyObject *)st->Prim_Type) < 0)
        goto done;
    for (PyMethodDef *d = testing_methods; d->ml_name; d++) {
        PyObject *f = PyCMethod_New(d, m, name, NULL);
        if (!f || PyModule_AddObjectRef(t, d->ml_name, f) < 0) {
            Py_XDECREF(f);
            goto done;
        }
        Py_DECREF(f);
    }
    PyObject *modules = PyImport_GetModuleDict(); /* borrowed */
    if (PyDict_SetItem(modules, name, t) < 0)
        goto done;
    rc = PyModule_AddObjectRef(m, "_testing", t);
done:
    Py_DECREF(t);
    Py_DECREF(name);
    return rc;
}
