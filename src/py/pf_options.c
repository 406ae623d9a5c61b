/* AsyncPrefetcher's constructor options: the arguments checked, the source's first iterator,
 * and the structure= captured. pf_new in prefetcher.c puts them together with the pipeline
 * (pf_pipeline.c). */
#include "prefetcher_impl.h"

#include "pinned.h"

#include <string.h>

/* ---- the constructor's arguments ---- */

static int parse_positive(PyObject *o, const char *name, long lo, long hi, long *out)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name, Py_TYPE(o)->tp_name);
        }
        return -1;
    }
    if (v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "%s must be between %ld and %ld, got %ld", name, lo, hi, v);
        return -1;
    }
    *out = v;
    return 0;
}

/* The constructor's arguments, checked. Returns 0 or -1 with an exception. */
int pl_pf_parse_options(pl_state *st, PyObject *args, PyObject *kwds, pf_options *o)
{
    static char *kwlist[] = {"iterable", "device", "depth", "pool", "max_pinned_bytes",
                             "staging_threads", "copy_stream_priority", "output", "stream",
                             "convert", "static", "out", "structure", "static_rows", NULL};
    PyObject *depth_obj = NULL, *max_pinned_obj = Py_None, *threads_obj = Py_None, *rows_obj = Py_None;
    const char *priority = "high", *output = "array";
    memset(o, 0, sizeof(*o));
    o->device = o->pool_obj = o->stream = o->convert = o->out = o->structure = Py_None;
    o->depth = 2;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OOOOOssO$OpOOO:AsyncPrefetcher", kwlist, &o->iterable,
                                     &o->device, &depth_obj, &o->pool_obj, &max_pinned_obj,
                                     &threads_obj, &priority, &output, &o->stream, &o->convert,
                                     &o->is_static, &o->out, &o->structure, &rows_obj))
        return -1;
    if (rows_obj != Py_None) {
        /* static=True: lay the static buffers out for at least this many rows (an ArrayLoader
         * passes its batch_size: a resumed epoch's first batch may be short) */
        long v;
        if (parse_positive(rows_obj, "static_rows", 0, LONG_MAX, &v) < 0)
            return -1;
        o->static_rows = v;
    }
    if (o->out == Py_None) {
        o->out = NULL;
    } else if (!PyList_Check(o->out) && !PyTuple_Check(o->out)) {
        PyErr_Format(PyExc_TypeError, "out must be a list or tuple of arrays (one per array leaf "
                     "of a batch, in walk order), not %.100s", Py_TYPE(o->out)->tp_name);
        return -1;
    } else {
        o->is_static = 1;
    }
    if (o->convert == Py_None)
        o->convert = NULL;
    else if (!PyCallable_Check(o->convert)) {
        PyErr_Format(PyExc_TypeError, "convert must be a callable or None, not %.100s",
                     Py_TYPE(o->convert)->tp_name);
        return -1;
    }
    if (o->stream != Py_None && !PyCallable_Check(o->stream) &&
        (!PyLong_Check(o->stream) || PyBool_Check(o->stream))) {
        PyErr_Format(PyExc_TypeError, "stream must be None, a DLPack stream handle (int) or a "
                     "callable returning one, not %.100s", Py_TYPE(o->stream)->tp_name);
        return -1;
    }
    if (depth_obj && parse_positive(depth_obj, "depth", 1, 64, &o->depth) < 0)
        return -1;
    if (threads_obj != Py_None && parse_positive(threads_obj, "staging_threads", 1, 256, &o->threads) < 0)
        return -1;
    /* CUDA's default stream priority is also its least, so there is no 'low' below 'normal' */
    if (strcmp(priority, "high") == 0)
        o->high_priority = 1;
    else if (strcmp(priority, "low") == 0) {
        PyErr_SetString(PyExc_ValueError, "copy_stream_priority='low' is not offered: CUDA's "
                        "default stream priority ('normal') is already its least; pass 'high' "
                        "or 'normal'");
        return -1;
    } else if (strcmp(priority, "normal") != 0) {
        PyErr_Format(PyExc_ValueError, "copy_stream_priority must be 'high' or 'normal', got '%s'",
                     priority);
        return -1;
    }
    if (strcmp(output, "capsule") == 0)
        o->capsule = 1;
    else if (strcmp(output, "array") != 0) {
        PyErr_Format(PyExc_ValueError, "output must be 'array' or 'capsule', got '%s'", output);
        return -1;
    }
    if (max_pinned_obj != Py_None) {
        long long v = PyLong_AsLongLong(max_pinned_obj);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v <= 0) {
            PyErr_Format(PyExc_ValueError, "max_pinned_bytes must be > 0, got %lld", v);
            return -1;
        }
        o->max_pinned = (size_t)v;
    }
    if (o->pool_obj != Py_None) {
        if (!(o->shared = pl_pinned_pool_get(st, o->pool_obj))) {
            PyErr_Format(PyExc_TypeError, "pool must be a pinloader.PinnedPool, not %.100s",
                         Py_TYPE(o->pool_obj)->tp_name);
            return -1;
        }
        if (pl_pool_closed(o->shared)) {
            PyErr_SetString(PyExc_ValueError, "pool is closed");
            return -1;
        }
    }
    return 0;
}

/* The first iterator over the source, with a clear error for a non-iterable. A TypeError that
 * the source's own __iter__ raised is the source's, and stays as it is. */
PyObject *pl_pf_first_iterator(PyObject *iterable)
{
    PyTypeObject *tp = Py_TYPE(iterable);
    if (!tp->tp_iter && !PySequence_Check(iterable))
        return PyErr_Format(PyExc_TypeError, "AsyncPrefetcher needs an iterable source, got %.100s",
                            tp->tp_name);
    return PyObject_GetIter(iterable);
}

/* ---- structure= ---- */

/* structure=: the structure every item's leaves are placed in (see pl_flat_structure). */
int pl_pf_capture_structure(pl_prefetcher_obj *self, PyObject *structure)
{
    pl_flat f;
    PyObject *found = NULL;
    pl_flat_init(&f, self->st, self->b, self->device);
    int rc = pl_flat_structure(&f, structure, "structure", &found, NULL);
    if (rc == 0) {
        pl_flat_take_tree(&f, &self->templ);
        self->templ.n_leaves = PyList_GET_SIZE(found);
        if (!self->templ.n_leaves) {
            PyErr_SetString(PyExc_ValueError, "AsyncPrefetcher: structure= holds no array leaf");
            rc = -1;
        }
    }
    Py_XDECREF(found);
    pl_flat_clear(&f);
    return rc;
}
