/* The module state (the types and exceptions of one pinloader._C module), its lookup from a
 * module or a type, the exceptions raised for backend errors and for objects inherited across
 * fork(), the resolution of a user's device argument to a backend, and the table of native
 * sources. */
#include "state.h"

#include "source.h"

#include <stdlib.h>
#include <string.h>

pl_state *pl_state_of_module(PyObject *m)
{
    return (pl_state *)PyModule_GetState(m);
}

/* The module's definition, for finding the module from one of its types (and their
 * subclasses). Set once by PyInit__C, before any type exists. */
static PyModuleDef *module_def;

void pl_state_set_module_def(PyModuleDef *def)
{
    module_def = def;
}

#if PY_VERSION_HEX < 0x030B0000
/* PyType_GetModuleByDef is new in 3.11. Before it, the documented way: walk the type's MRO
 * and take the first heap type whose module (PyType_GetModule, 3.9+) has this definition.
 * Returns a borrowed reference, or NULL with TypeError set, as the 3.11 function does. */
static PyObject *get_module_by_def(PyTypeObject *tp, PyModuleDef *def)
{
    PyObject *mro = tp->tp_mro;
    Py_ssize_t n = mro && PyTuple_Check(mro) ? PyTuple_GET_SIZE(mro) : 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyTypeObject *t = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
        if (!PyType_HasFeature(t, Py_TPFLAGS_HEAPTYPE))
            continue;
        PyObject *m = PyType_GetModule(t);
        if (!m) {
            /* a heap type made from Python code or another module: no module to compare */
            PyErr_Clear();
            continue;
        }
        PyModuleDef *d = PyModule_GetDef(m);
        if (!d)
            PyErr_Clear();
        else if (d == def)
            return m;
    }
    PyErr_Format(PyExc_TypeError, "PyType_GetModuleByDef: No superclass of '%s' has the given module",
                 tp->tp_name);
    return NULL;
}
#else
#define get_module_by_def PyType_GetModuleByDef
#endif

pl_state *pl_state_of_type(PyTypeObject *tp)
{
    PyObject *m = get_module_by_def(tp, module_def);
    return m ? pl_state_of_module(m) : NULL;
}

/* ---- errors ---- */

/* Raise CudaError(msg) with .code and .name; steals msg and name. */
static void set_cuda_error(pl_state *st, PyObject *msg, int code, PyObject *name)
{
    PyObject *exc = msg ? PyObject_CallOneArg(st->CudaError, msg) : NULL;
    PyObject *c = PyLong_FromLong(code);
    if (exc && c && name && PyObject_SetAttrString(exc, "code", c) == 0 &&
        PyObject_SetAttrString(exc, "name", name) == 0)
        PyErr_SetObject(st->CudaError, exc);
    Py_XDECREF(exc);
    Py_XDECREF(c);
    Py_XDECREF(msg);
    Py_XDECREF(name);
}


PyObject *pl_raise_backend(pl_state *st, const pl_backend *b, int code, const char *what)
{
    const char *name = pl_error_name(b, code);
    const char *msg = pl_error_string(b, code);
    if (code == PL_ERR_NO_MEMORY && (!b || b->kind == PL_BACKEND_HOST))
        return PyErr_Format(PyExc_MemoryError, "%s: %s", what, msg);
    set_cuda_error(st, PyUnicode_FromFormat("%s: %s (%s, error %d)", what, msg, name, code),
                   code, PyUnicode_FromString(name));
    return NULL;
}

PyObject *pl_raise_forked(const char *what)
{
    return PyErr_Format(PyExc_RuntimeError, "this %s was created before fork(): its memory, "
                        "threads and events belong to the parent process; create a new one in "
                        "the child", what);
}

int pl_force_host(void)
{
    const char *v = getenv("PINLOADER_BACKEND");
    return v && strcmp(v, "host") == 0;
}

/* The CUDA backend, or NULL with CudaError set saying why it is unusable. */
static const pl_backend *require_cuda(pl_state *st, const char *asked)
{
    if (pl_force_host()) {
        PyErr_Format(PyExc_ValueError, "device %s was asked for, but PINLOADER_BACKEND=host "
                     "forces the host backend", asked);
        return NULL;
    }
    int err = 0;
    const char *detail = NULL;
    const pl_backend *b = pl_backend_cuda(&err, &detail);
    if (!b) {
        /* detail starts with the CUDA error name ("cudaErrorNoDevice: ...") when CUDA gave one */
        const char *colon = strchr(detail, ':');
        PyObject *name = err == PL_ERR_NO_RUNTIME || !colon
                             ? PyUnicode_FromString(pl_error_name(NULL, err))
                             : PyUnicode_FromStringAndSize(detail, colon - detail);
        PyObject *msg = PyUnicode_FromFormat("device %s was asked for, but CUDA is not usable: "
                                             "%s. Without a GPU, pass device=\"cpu\" to run on "
                                             "pinloader's host backend.", asked, detail);
        set_cuda_error(st, msg, err, name);
        return NULL;
    }
    return b;
}

int pl_cuda_usable(void)
{
    if (pl_force_host())
        return 0;
    return pl_backend_cuda(NULL, NULL) != NULL;
}

static int parse_index(const char *s, int *out)
{
    if (*s < '0' || *s > '9')
        return -1; /* strtol would accept spaces and signs */
    char *end = NULL;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v < 0 || v > 1 << 20)
        return -1;
    *out = (int)v;
    return 0;
}

/* A device index given as a Python int (of `device`, for the message): 0 <= N <= 2**20, the
 * bound parse_index keeps too. 0, or -1 with an exception. */
static int int_index(PyObject *v, PyObject *device, int *out)
{
    if (!PyLong_Check(v) || PyBool_Check(v)) {
        PyErr_Format(PyExc_TypeError, "device index must be an int, got %.100s (in %R)",
                     Py_TYPE(v)->tp_name, device);
        return -1;
    }
    int overflow = 0;
    long long n = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (n == -1 && PyErr_Occurred())
        return -1;
    if (overflow || n < 0 || n > 1 << 20) {
        PyErr_Format(PyExc_ValueError, "device index must be between 0 and %d, got %R", 1 << 20, v);
        return -1;
    }
    *out = (int)n;
    return 0;
}

int pl_resolve_device(pl_state *st, PyObject *device, const pl_backend **b, int *dev)
{
    int index = -1;
    const char *kind = NULL;
    char asked[64];
    if (device == NULL || device == Py_None) {
        if (!pl_cuda_usable()) {
            *b = pl_backend_host();
            *dev = 0;
            return 0;
        }
        kind = "cuda";
    } else if (PyBool_Check(device)) {
        /* an int subclass: True would read as 'cuda:1' */
        PyErr_Format(PyExc_TypeError, "device must be a str, an int or None, not bool (%R)", device);
        return -1;
    } else if (PyLong_Check(device)) {
        if (int_index(device, device, &index) < 0)
            return -1;
        kind = "cuda";
    } else if (PyUnicode_Check(device)) {
        const char *s = PyUnicode_AsUTF8(device);
        if (!s)
            return -1;
        if (strcmp(s, "cpu") == 0 || strcmp(s, "cpu:0") == 0 || strcmp(s, "host") == 0) {
            kind = "cpu"; /* the host backend has one device, like torch's "cpu" and "cpu:0" */
        } else if (strcmp(s, "cuda") == 0) {
            kind = "cuda";
        } else if (strncmp(s, "cuda:", 5) == 0 && parse_index(s + 5, &index) == 0) {
            kind = "cuda";
        } else {
            PyErr_Format(PyExc_ValueError, "device must be 'cpu', 'cpu:0', 'cuda', 'cuda:N', an "
                         "int or None, got %R", device);
            return -1;
        }
    } else if (PyObject_HasAttrString(device, "type")) {
        /* torch.device and the like */
        PyObject *t = PyObject_GetAttrString(device, "type");
        PyObject *i = t ? PyObject_GetAttrString(device, "index") : NULL;
        if (!i) {
            Py_XDECREF(t);
            return -1;
        }
        const char *ts = PyUnicode_Check(t) ? PyUnicode_AsUTF8(t) : NULL;
        if (ts && strcmp(ts, "cpu") == 0)
            kind = "cpu";
        else if (ts && strcmp(ts, "cuda") == 0)
            kind = "cuda";
        int bad = i != Py_None && int_index(i, device, &index) < 0;
        Py_DECREF(t);
        Py_DECREF(i);
        if (bad)
            return -1;
        if (!kind) {
            PyErr_Format(PyExc_ValueError, "unsupported device %R", device);
            return -1;
        }
    } else {
        PyErr_Format(PyExc_TypeError, "device must be a str, an int or None, not %.100s",
                     Py_TYPE(device)->tp_name);
        return -1;
    }

    if (strcmp(kind, "cpu") == 0) {
        if (index > 0) {
            PyErr_Format(PyExc_ValueError, "the host backend has one device ('cpu' or 'cpu:0'), "
                         "got %R", device);
            return -1;
        }
        *b = pl_backend_host();
        *dev = 0;
        return 0;
    }
    if (index >= 0)
        snprintf(asked, sizeof asked, "'cuda:%d'", index);
    else
        snprintf(asked, sizeof asked, "'cuda'");
    const pl_backend *cb = require_cuda(st, asked);
    if (!cb)
        return -1;
    if (index < 0) {
        int cur = 0;
        int rc = cb->get_device(&cur);
        if (rc != PL_OK) {
            pl_raise_backend(st, cb, rc, "cudaGetDevice");
            return -1;
        }
        index = cur;
    }
    int count = 0;
    pl_cuda_device_count(&count);
    if (index >= count) {
        set_cuda_error(st, PyUnicode_FromFormat("device %s was asked for, but only %d CUDA "
                       "device(s) are visible", asked, count), PL_ERR_INVALID_DEVICE,
                       PyUnicode_FromString("cudaErrorInvalidDevice"));
        return -1;
    }
    *b = cb;
    *dev = index;
    return 0;
}

/* ---- the native sources' table (Note [sources] in source.h) ---- */

int pl_source_register(pl_state *st, PyTypeObject *type, const pl_source_ops *ops)
{
    if (st->n_sources >= PL_MAX_SOURCE_TYPES) {
        PyErr_SetString(PyExc_RuntimeError, "pinloader: too many native source types (PL_MAX_SOURCE_TYPES)");
        return -1;
    }
    st->sources[st->n_sources].type = type;
    st->sources[st->n_sources].ops = ops;
    st->n_sources++;
    return 0;
}

const pl_source_ops *pl_source_ops_of(pl_state *st, PyObject *obj)
{
    for (int i = 0; i < st->n_sources; i++)
        if (Py_IS_TYPE(obj, st->sources[i].type))
            return st->sources[i].ops;
    return NULL;
}
