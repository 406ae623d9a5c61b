/* The Python-iterable source and the table of native sources (Note [sources] in source.h). */
#include "source.h"

#include "util.h"

/* ---- the Python-iterable source ---- */

/* The exception set now gets a note naming the item the source raised at (3.11+). */
static void note_source_item(uint64_t index)
{
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value && tb)
        PyException_SetTraceback(value, tb);
    PyObject *note = value ? PyUnicode_FromFormat("raised by the source at item %llu of the epoch "
                                                  "(pinloader producer thread)", (unsigned long long)index)
                           : NULL;
    if (note) {
        PyObject *r = PyObject_CallMethod(value, "add_note", "O", note);
        Py_XDECREF(r);
        Py_DECREF(note);
    }
    PyErr_Clear(); /* a failed note leaves the source's exception as it was */
    PyErr_Restore(type, value, tb);
#else
    (void)index;
#endif
}

/* structure=: the item is a tuple of the structure's leaves, walked; the captured structure
 * places them (the walked tree is dropped). 0, or -1 with an exception. */
static int walk_leaf_tuple(pl_flat *f, PyObject *item, Py_ssize_t n)
{
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != n) {
        PyErr_Format(PyExc_TypeError, "AsyncPrefetcher(structure=...): each item must be a tuple of "
                     "the structure's %zd leaves, got %.100s", n, Py_TYPE(item)->tp_name);
        return -1;
    }
    if (pl_flat_walk(f, item) < 0)
        return -1;
    pl_tree walked;
    pl_flat_take_tree(f, &walked);
    pl_tree_clear(&walked);
    if (f->n_leaves != n) {
        PyErr_Format(PyExc_TypeError, "AsyncPrefetcher(structure=...): %zd of the item's %zd entries "
                     "are array leaves", (Py_ssize_t)f->n_leaves, n);
        return -1;
    }
    return 0;
}

/* GIL held: next() on the iterator `it` (NULL: an epoch with none, which is over), then the walk
 * over the item (see Note [flatten in two passes] in flatten.h). */
static int py_next(PyObject *it, void *state, pl_flat *f, pl_source_ctx *c, char *why, size_t n_why)
{
    (void)state;
    (void)why;
    (void)n_why;
    Py_XINCREF(it); /* the epoch's iterator may be replaced by the code next() runs */
    int64_t t0 = pl_now_ns();
    PyObject *item = it ? PyIter_Next(it) : NULL;
    c->next_ns = pl_now_ns() - t0;
    Py_XDECREF(it);
    if (atomic_load(c->stop)) {
        /* closed while the source was running: what it gave is not wanted */
        Py_XDECREF(item);
        PyErr_Clear();
        return PL_SOURCE_STOPPED;
    }
    if (!item) {
        if (!PyErr_Occurred())
            return PL_SOURCE_END;
        note_source_item(c->index);
        return PL_SOURCE_ERROR;
    }
    pl_flat_begin(f); /* the last item's leaf buffers are reused */
    int rc = c->structure_leaves ? walk_leaf_tuple(f, item, c->structure_leaves) : pl_flat_walk(f, item);
    Py_DECREF(item);
    if (rc < 0) {
        /* the item's owners go now; their finalizers must not see (or clobber) the error */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        pl_flat_clear(f);
        PyErr_Restore(type, value, tb);
        return PL_SOURCE_ERROR;
    }
    return PL_SOURCE_BATCH;
}

const pl_source_ops pl_py_source = {
    .name = "a Python iterable",
    .needs_gil = 1,
    .open = NULL,
    .next = py_next,
    .close = NULL,
};

/* ---- native sources ---- */

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
