/* Flatten: the walk that classifies an item's objects (Note [one leaf classifier]) and reads
 * its leaves with flat_leaves.c; the Python-iterable source, whose batches are the items next()
 * gives, walked (Note [sources] in source.h); and the container rebuild. See Note [flatten in
 * two passes] in flatten.h; the files share flatten_impl.h. GIL held throughout. */
#include "flatten_impl.h"
#include "source.h"

#include "device_array.h"
#include "gather.h"
#include "np.h"
#include "util.h"

#include <stddef.h>
#include <string.h>

#define MAX_NEST PL_FLAT_MAX_NEST

/* ---- the walk ---- */

/* getattr(o, name) where a missing attribute is not an error: 1 and *out set, 0 when missing,
 * -1 with whatever else the lookup raised. */
static int optional_attr(PyObject *o, const char *name, PyObject **out)
{
    *out = PyObject_GetAttrString(o, name);
    if (*out)
        return 1;
    if (!PyErr_ExceptionMatches(PyExc_AttributeError))
        return -1;
    PyErr_Clear();
    return 0;
}

static int walk(pl_flat *f, PyObject *obj, PyObject *key, int level);

/* Walk child `item` under path suffix already pushed at `mark`. */
static int walk_child(pl_flat *f, PyObject *item, PyObject *key, int level, size_t mark)
{
    int rc = walk(f, item, key, level + 1);
    pl_fl_path_pop(f, mark);
    return rc;
}

/* tuple, list, namedtuple (its _fields in `fields`, borrowed, naming the children), list or tuple
 * subclass. A snapshot of the items, taken without calling user code, is walked: what the walk
 * runs (a __dlpack__) cannot change what is read. */
static int walk_seq(pl_flat *f, PyObject *obj, PyObject *key, int level, fnode_kind kind,
                    PyObject *fields)
{
    PyObject *items = PyList_Check(obj) ? PyList_AsTuple(obj) : PyTuple_GetSlice(obj, 0, PY_SSIZE_T_MAX);
    if (!items)
        return -1;
    int typed = kind == FN_NAMEDTUPLE || kind == FN_SEQ_SUBCLASS;
    Py_ssize_t node = pl_fl_push_node(f, kind, typed ? (PyObject *)Py_TYPE(obj) : NULL, key);
    int rc = node < 0 ? -1 : 0;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
        PyObject *name = fields && PyTuple_Check(fields) && i < PyTuple_GET_SIZE(fields)
                             ? PyTuple_GET_ITEM(fields, i) : NULL;
        size_t mark;
        if (name && PyUnicode_Check(name))
            rc = pl_fl_path_push_text(f, name, 1, &mark);
        else if ((mark = pl_fl_path_push_index(f, i)) == (size_t)-1)
            rc = -1;
        if (rc == 0)
            rc = walk_child(f, PyTuple_GET_ITEM(items, i), NULL, level, mark);
    }
    if (rc == 0)
        f->nodes[node].n = n;
    Py_DECREF(items);
    return rc;
}

/* The (key, value) pairs of a dict, walked with keys: dicts and dataclass init fields. */
static int walk_pairs(pl_flat *f, Py_ssize_t node, PyObject *pairs, int level, int as_attr)
{
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        PyObject *k = PyTuple_GET_ITEM(pair, 0), *v = PyTuple_GET_ITEM(pair, 1);
        size_t mark;
        if (pl_fl_path_push_text(f, k, as_attr, &mark) < 0 || walk_child(f, v, k, level, mark) < 0)
            return -1;
    }
    f->nodes[node].n = n;
    return 0;
}

static int walk_dict(pl_flat *f, PyObject *obj, PyObject *key, int level)
{
    PyObject *proto = NULL;
    if (!PyDict_CheckExact(obj)) {
        /* OrderedDict, defaultdict and other dict subclasses: a shallow copy keeps the type and
         * its extra state (default_factory...); the rebuild fills it with the outputs. */
        PyObject *copy_mod = PyImport_ImportModule("copy");
        proto = copy_mod ? PyObject_CallMethod(copy_mod, "copy", "O", obj) : NULL;
        Py_XDECREF(copy_mod);
        if (!proto || !PyDict_Check(proto)) {
            Py_XDECREF(proto);
            if (pl_fl_pending_is_base_only())
                return -1;
            PyErr_Clear();
            return pl_fl_leaf_error(f, PyExc_TypeError, "cannot rebuild this dict subclass (copy.copy failed)");
        }
        /* the type's own clear(): an OrderedDict keeps its own links beside the dict's */
        PyObject *r = PyObject_CallMethod(proto, "clear", NULL);
        if (!r) {
            Py_DECREF(proto);
            if (pl_fl_pending_is_base_only())
                return -1;
            PyErr_Clear();
            return pl_fl_leaf_error(f, PyExc_TypeError, "cannot rebuild this dict subclass (clear() failed)");
        }
        Py_DECREF(r);
    }
    PyObject *pairs = PyDict_Items(obj); /* a snapshot */
    Py_ssize_t node = pairs ? pl_fl_push_node(f, FN_DICT, proto, key) : -1;
    Py_XDECREF(proto);
    int rc = node < 0 ? -1 : walk_pairs(f, node, pairs, level, 0);
    Py_XDECREF(pairs);
    return rc;
}

/* dataclass: rebuilt with type(obj)(**{field: value}) over its init fields */
static int walk_dataclass(pl_flat *f, PyObject *obj, PyObject *key, PyObject *dcf, int level)
{
    if (!PyDict_Check(dcf))
        return pl_fl_leaf_error(f, PyExc_TypeError, "__dataclass_fields__ is not a dict");
    PyObject *fields = PyDict_Items(dcf);
    PyObject *pairs = fields ? PyList_New(0) : NULL;
    int rc = pairs ? 0 : -1;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(fields); i++) {
        PyObject *pair = PyList_GET_ITEM(fields, i);
        PyObject *name = PyTuple_GET_ITEM(pair, 0), *init = NULL;
        rc = optional_attr(PyTuple_GET_ITEM(pair, 1), "init", &init);
        int is_init = rc > 0 ? PyObject_IsTrue(init) : rc;
        Py_XDECREF(init);
        if (is_init < 0) {
            rc = -1;
            break;
        }
        rc = 0;
        if (!is_init)
            continue;
        PyObject *value = PyObject_GetAttr(obj, name);
        PyObject *entry = value ? PyTuple_Pack(2, name, value) : NULL;
        Py_XDECREF(value);
        if (!entry || PyList_Append(pairs, entry) < 0)
            rc = -1;
        Py_XDECREF(entry);
    }
    Py_ssize_t node = rc == 0 ? pl_fl_push_node(f, FN_DATACLASS, (PyObject *)Py_TYPE(obj), key) : -1;
    if (node >= 0)
        rc = walk_pairs(f, node, pairs, level, 1);
    else
        rc = -1;
    Py_XDECREF(fields);
    Py_XDECREF(pairs);
    return rc;
}

/* Note [one leaf classifier]
 * Both walks -- the per-item walk (pl_flat_walk) and structure mode (pl_flat_structure, which
 * captures an ArrayLoader's or a structure='s leaves without reading them) -- ask classify()
 * what an object is, so they cannot disagree. The first rule that matches decides:
 *   1. a NumPy array (0-d included), a RowGather: an array leaf;
 *   2. None, str, bytes, int (bool), float, complex and NumPy scalars (np.float32(1.5)):
 *      values, passed through unchanged -- a NumPy scalar is a value as a Python float is;
 *   3. tuple and list: rebuilt as tuple and list;
 *   4. a tuple subclass with a tuple `_fields` (a namedtuple): rebuilt as type(obj)(*children);
 *   5. any other list or tuple subclass (torch.return_types, os.stat_result, class T(list)):
 *      rebuilt as type(obj)(children), the constructor signature of list and tuple;
 *   6. a dict or dict subclass: a shallow copy.copy of it, cleared and filled (Note [handout]);
 *   7. a dataclass instance: type(obj)(**init_fields);
 *   8. an object with both __dlpack__ and __dlpack_device__: an array leaf;
 *   9. any other buffer-protocol object (memoryview, bytearray, array.array, mmap): an array
 *      leaf;
 *  10. anything else passes through unchanged.
 * A container's children are walked in order (a dict's in insertion order, a dataclass's in
 * field order). When a rebuild's constructor raises an Exception, the error is a TypeError
 * naming the container's path in the batch ("item[0].x: ...") with the constructor's exception
 * as its cause; a BaseException that is not an Exception, and a StopIteration (which the
 * prefetcher makes a RuntimeError), propagate unchanged. */
typedef enum {
    OK_ARRAY, OK_ROWS, OK_PASS, OK_TUPLE, OK_LIST, OK_NAMEDTUPLE, OK_SEQ_SUBCLASS, OK_DICT,
    OK_DATACLASS, OK_DLPACK, OK_BUFFER,
} obj_kind;

/* What obj is (Note [one leaf classifier]), or -1 with an exception (an attribute lookup raised).
 * *attr gets a new reference for OK_NAMEDTUPLE (its _fields), OK_DATACLASS (the type's
 * __dataclass_fields__) and OK_DLPACK (its __dlpack_device__), else NULL. */
static int classify(pl_flat *f, PyObject *obj, PyObject **attr)
{
    *attr = NULL;
    if (PyArray_Check(obj))
        return OK_ARRAY;
    if (pl_row_gather_check(f->st, obj))
        return OK_ROWS;
    if (obj == Py_None || PyUnicode_Check(obj) || PyBytes_Check(obj) || PyLong_Check(obj) ||
        PyFloat_Check(obj) || PyComplex_Check(obj) || PyArray_IsScalar(obj, Generic))
        return OK_PASS;
    if (PyTuple_CheckExact(obj))
        return OK_TUPLE;
    if (PyList_CheckExact(obj))
        return OK_LIST;
    if (PyList_Check(obj))
        return OK_SEQ_SUBCLASS;
    if (PyTuple_Check(obj)) {
        PyObject *fields;
        int has = optional_attr(obj, "_fields", &fields);
        if (has < 0)
            return -1;
        if (has && PyTuple_Check(fields)) {
            *attr = fields;
            return OK_NAMEDTUPLE;
        }
        Py_XDECREF(fields);
        return OK_SEQ_SUBCLASS;
    }
    if (PyDict_Check(obj))
        return OK_DICT;
    int has = optional_attr((PyObject *)Py_TYPE(obj), "__dataclass_fields__", attr);
    if (has)
        return has < 0 ? -1 : OK_DATACLASS;
    PyObject *devfn, *fn;
    has = optional_attr(obj, "__dlpack_device__", &devfn);
    if (has < 0)
        return -1;
    if (has) {
        has = optional_attr(obj, "__dlpack__", &fn);
        Py_XDECREF(fn);
        if (has < 0) {
            Py_DECREF(devfn);
            return -1;
        }
        if (has) {
            *attr = devfn;
            return OK_DLPACK;
        }
        Py_DECREF(devfn);
    }
    return PyObject_CheckBuffer(obj) ? OK_BUFFER : OK_PASS;
}

/* Structure mode (pl_flat_structure): an array leaf becomes a leaf node and a (path, object)
 * pair in f->found, unread. */
static int structure_leaf(pl_flat *f, PyObject *obj, PyObject *key)
{
    Py_ssize_t node = pl_fl_push_node(f, FN_LEAF, NULL, key);
    if (node < 0 || pl_fl_record_at_path(f, f->found, obj) < 0)
        return -1;
    f->nodes[node].leaf = f->n_leaves++;
    return 0;
}

static int walk(pl_flat *f, PyObject *obj, PyObject *key, int level)
{
    if (level > MAX_NEST)
        return pl_fl_leaf_error(f, PyExc_RecursionError, "nesting deeper than %d levels", MAX_NEST);
    PyObject *attr;
    int kind = classify(f, obj, &attr);
    if (kind < 0)
        return -1;
    int rc;
    if (f->found && (kind == OK_ARRAY || kind == OK_ROWS || kind == OK_DLPACK || kind == OK_BUFFER)) {
        rc = structure_leaf(f, obj, key);
    } else {
        switch (kind) {
        case OK_ARRAY:
            rc = pl_fl_numpy_leaf(f, key, (PyArrayObject *)obj);
            break;
        case OK_ROWS:
            rc = pl_fl_row_gather_leaf(f, key, obj);
            break;
        case OK_TUPLE:
            rc = walk_seq(f, obj, key, level, FN_TUPLE, NULL);
            break;
        case OK_LIST:
            rc = walk_seq(f, obj, key, level, FN_LIST, NULL);
            break;
        case OK_NAMEDTUPLE:
            rc = walk_seq(f, obj, key, level, FN_NAMEDTUPLE, attr);
            break;
        case OK_SEQ_SUBCLASS:
            rc = walk_seq(f, obj, key, level, FN_SEQ_SUBCLASS, NULL);
            break;
        case OK_DICT:
            rc = walk_dict(f, obj, key, level);
            break;
        case OK_DATACLASS:
            rc = walk_dataclass(f, obj, key, attr, level);
            break;
        case OK_DLPACK:
            rc = pl_fl_walk_dlpack(f, obj, key, attr);
            break;
        case OK_BUFFER:
            rc = pl_fl_walk_buffer(f, obj, key);
            break;
        default: /* OK_PASS */
            rc = pl_fl_push_node(f, FN_PASS, obj, key) < 0 ? -1 : 0;
            break;
        }
    }
    Py_XDECREF(attr);
    return rc;
}

void pl_flat_init(pl_flat *f, pl_state *st, const pl_backend *b, int device)
{
    memset(f, 0, offsetof(pl_flat, steps)); /* n_steps 0: steps and path are written first */
    f->path_len = 0;
    f->path[0] = 0;
    f->st = st;
    f->b = b;
    f->device = device;
}

void pl_flat_begin(pl_flat *f)
{
    pl_xfer_leaf *leaves = f->leaves;
    DLDataType *dtypes = f->dtypes;
    Py_ssize_t cap = f->cap_leaves;
    pl_flat_init(f, f->st, f->b, f->device);
    f->leaves = leaves;
    f->dtypes = dtypes;
    f->cap_leaves = cap;
}

int pl_flat_structure(pl_flat *f, PyObject *obj, const char *root, PyObject **found,
                      PyObject **passed)
{
    f->found = PyList_New(0);
    f->passed = passed ? PyList_New(0) : NULL;
    int rc = f->found && (!passed || f->passed) ? 0 : -1;
    pl_fl_path_root(f, root);
    if (rc == 0)
        rc = walk(f, obj, NULL, 0);
    pl_fl_path_pop(f, 0);
    *found = f->found;
    if (passed)
        *passed = f->passed;
    f->found = f->passed = NULL;
    if (rc < 0) {
        Py_CLEAR(*found);
        if (passed)
            Py_CLEAR(*passed);
    }
    return rc;
}

int pl_flat_walk(pl_flat *f, PyObject *item)
{
    pl_fl_path_root(f, "item");
    int rc = walk(f, item, NULL, 0);
    pl_fl_path_pop(f, 0);
    if (rc < 0)
        return -1;
    pl_layout_finish(&f->layout, f->leaves, f->n_leaves);
    return 0;
}

/* ---- the Python-iterable source (Note [sources] in source.h): next(), then the walk ---- */

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

/* ---- rebuild ---- */

/* Where build_at is, for an error naming a container it could not rebuild: the chain of
 * parents on the C stack, rendered only then (Note [one leaf classifier]). */
typedef struct build_frame {
    const struct build_frame *up;
    const pl_flat_node *parent;
    const pl_flat_node *child;
    Py_ssize_t index;
} build_frame;

static PyObject *build_at(const pl_tree *t, PyObject *leaves, Py_ssize_t *pos, const build_frame *up);

/* The path of the node below `up` ("item[0].x['k']"), into buf. -1 only with a BaseException
 * that is not an Exception pending (a key's repr() runs user code). */
static int frame_path(const build_frame *up, char *buf, size_t n)
{
    const build_frame *chain[MAX_NEST + 2];
    int depth = 0;
    for (const build_frame *fr = up; fr && depth < (int)(sizeof chain / sizeof chain[0]); fr = fr->up)
        chain[depth++] = fr;
    size_t len = (size_t)snprintf(buf, n, "item");
    for (int d = depth - 1; d >= 0 && len < n; d--) {
        const build_frame *fr = chain[d];
        char text[160];
        int w;
        PyObject *name = NULL;
        if (fr->parent->kind == FN_NAMEDTUPLE) {
            /* the field's name, as the walk wrote it; the index where the type has none */
            PyObject *fields;
            if (optional_attr(fr->parent->obj, "_fields", &fields) < 0) {
                if (pl_fl_pending_is_base_only())
                    return -1;
                PyErr_Clear();
            } else if (fields) {
                if (PyTuple_Check(fields) && fr->index < PyTuple_GET_SIZE(fields) &&
                    PyUnicode_Check(PyTuple_GET_ITEM(fields, fr->index)))
                    name = Py_NewRef(PyTuple_GET_ITEM(fields, fr->index));
                Py_DECREF(fields);
            }
        }
        if (fr->parent->kind == FN_DICT || fr->parent->kind == FN_DATACLASS || name) {
            int is_dict = fr->parent->kind == FN_DICT;
            int rc = pl_fl_text_of(name ? name : fr->child->key, is_dict, text, sizeof text);
            Py_XDECREF(name);
            if (rc < 0)
                return -1;
            w = snprintf(buf + len, n - len, is_dict ? "[%s]" : ".%s", text);
        } else {
            w = snprintf(buf + len, n - len, "[%zd]", fr->index);
        }
        len = w > 0 ? PL_MIN(n - 1, len + (size_t)w) : len;
    }
    return 0;
}

/* The constructor of container node nd raised: a TypeError naming it, with that exception as
 * its cause. A BaseException that is not an Exception propagates unchanged, and so does a
 * StopIteration, which the prefetcher turns into its own RuntimeError (a StopIteration must not
 * end the consumer's loop). Returns NULL. */
static PyObject *rebuild_failed(const build_frame *up, const pl_flat_node *nd, const char *how)
{
    if (pl_fl_pending_is_base_only() || PyErr_ExceptionMatches(PyExc_StopIteration))
        return NULL;
    PyObject *type, *cause, *tb;
    PyErr_Fetch(&type, &cause, &tb);
    PyErr_NormalizeException(&type, &cause, &tb);
    if (cause && tb)
        PyException_SetTraceback(cause, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    char path[512], text[200] = "?";
    if (frame_path(up, path, sizeof path) < 0 || (cause && pl_fl_text_of(cause, 0, text, sizeof text) < 0)) {
        Py_XDECREF(cause);
        return NULL;
    }
    const char *name = nd->obj && PyType_Check(nd->obj) ? ((PyTypeObject *)nd->obj)->tp_name
                                                        : nd->obj ? Py_TYPE(nd->obj)->tp_name : "?";
    PyErr_Format(PyExc_TypeError, "%s: cannot rebuild the %.100s with %s: %.100s: %s", path, name,
                 how, cause ? Py_TYPE(cause)->tp_name : "?", text);
    PyObject *exc;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc && cause) {
        PyException_SetCause(exc, Py_NewRef(cause));
        PyException_SetContext(exc, Py_NewRef(cause));
    }
    Py_XDECREF(cause);
    PyErr_Restore(type, exc, tb);
    return NULL;
}

static PyObject *copy_of(PyObject *proto)
{
    PyObject *mod = PyImport_ImportModule("copy");
    PyObject *out = mod ? PyObject_CallMethod(mod, "copy", "O", proto) : NULL;
    Py_XDECREF(mod);
    if (out && !PyDict_Check(out)) {
        Py_SETREF(out, NULL);
        PyErr_Format(PyExc_TypeError, "copy.copy of a %.100s did not give a dict", Py_TYPE(proto)->tp_name);
    }
    return out;
}

/* The children of a dict-like node nd into a dict (out: a new reference, filled). -1 with the
 * exception of a child's rebuild, or 1 with the exception of out's own __setitem__. */
static int build_pairs(const pl_tree *t, PyObject *leaves, Py_ssize_t *pos, const pl_flat_node *nd,
                       const build_frame *up, PyObject *out)
{
    for (Py_ssize_t i = 0; i < nd->n; i++) {
        build_frame fr = {up, nd, &t->nodes[*pos], i};
        PyObject *k = t->nodes[*pos].key;
        PyObject *v = build_at(t, leaves, pos, &fr);
        if (!v)
            return -1;
        /* a dict subclass through its own __setitem__ (an OrderedDict's order) */
        int rc = PyDict_CheckExact(out) ? PyDict_SetItem(out, k, v) : PyObject_SetItem(out, k, v);
        Py_DECREF(v);
        if (rc < 0)
            return 1;
    }
    return 0;
}

static PyObject *build_at(const pl_tree *t, PyObject *leaves, Py_ssize_t *pos, const build_frame *up)
{
    const pl_flat_node *nd = &t->nodes[(*pos)++];
    PyObject *out = NULL, *args;
    int rc;
    switch (nd->kind) {
    case FN_PASS:
        return Py_NewRef(nd->obj);
    case FN_LEAF:
        return Py_NewRef(PyTuple_GET_ITEM(leaves, nd->leaf));
    case FN_TUPLE:
    case FN_LIST:
    case FN_NAMEDTUPLE:
    case FN_SEQ_SUBCLASS:
        out = nd->kind == FN_LIST ? PyList_New(nd->n) : PyTuple_New(nd->n);
        for (Py_ssize_t i = 0; out && i < nd->n; i++) {
            build_frame fr = {up, nd, &t->nodes[*pos], i};
            PyObject *o = build_at(t, leaves, pos, &fr);
            if (!o)
                Py_CLEAR(out);
            else if (nd->kind == FN_LIST)
                PyList_SET_ITEM(out, i, o);
            else
                PyTuple_SET_ITEM(out, i, o);
        }
        if (out && nd->kind == FN_NAMEDTUPLE) {
            args = out;
            out = PyObject_Call(nd->obj, args, NULL);
            Py_DECREF(args);
            if (!out)
                return rebuild_failed(up, nd, "its fields as arguments");
        } else if (out && nd->kind == FN_SEQ_SUBCLASS) {
            args = out;
            out = PyObject_CallOneArg(nd->obj, args);
            Py_DECREF(args);
            if (!out)
                return rebuild_failed(up, nd, "a tuple of its items");
        }
        return out;
    case FN_DICT:
        /* a dict subclass: a shallow copy of the empty one the walk made (keeps its type and a
         * defaultdict's factory), so a tree builds any number of batches */
        out = nd->obj ? copy_of(nd->obj) : PyDict_New();
        if (!out)
            return nd->obj ? rebuild_failed(up, nd, "copy.copy") : NULL;
        rc = build_pairs(t, leaves, pos, nd, up, out);
        if (rc) {
            Py_DECREF(out);
            return rc > 0 ? rebuild_failed(up, nd, "its items set") : NULL;
        }
        return out;
    case FN_DATACLASS:
        out = PyDict_New();
        if (!out)
            return NULL;
        if (build_pairs(t, leaves, pos, nd, up, out) != 0) {
            Py_DECREF(out);
            return NULL;
        }
        args = PyTuple_New(0);
        if (args)
            Py_SETREF(out, PyObject_Call(nd->obj, args, out));
        else
            Py_CLEAR(out);
        Py_XDECREF(args);
        return out || !args ? out : rebuild_failed(up, nd, "its fields as keyword arguments");
    }
    return PyErr_Format(PyExc_SystemError, "pinloader: unknown flatten node");
}

PyObject *pl_tree_build(const pl_tree *t, PyObject *leaves)
{
    if (!t->n_nodes)
        return PyErr_Format(PyExc_SystemError, "pinloader: rebuild before a walk");
    if (!PyTuple_Check(leaves) || PyTuple_GET_SIZE(leaves) != t->n_leaves)
        return PyErr_Format(PyExc_SystemError, "pinloader: a batch rebuilt with %zd leaves, walked "
                            "with %zd", PyTuple_Check(leaves) ? PyTuple_GET_SIZE(leaves) : -1,
                            t->n_leaves);
    Py_ssize_t pos = 0;
    return build_at(t, leaves, &pos, NULL);
}

void pl_tree_clear(pl_tree *t)
{
    for (Py_ssize_t i = 0; i < t->n_nodes; i++) {
        Py_XDECREF(t->nodes[i].obj);
        Py_XDECREF(t->nodes[i].key);
    }
    PyMem_RawFree(t->nodes);
    t->nodes = NULL;
    t->n_nodes = t->n_leaves = 0;
}

int pl_tree_traverse(const pl_tree *t, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < t->n_nodes; i++) {
        Py_VISIT(t->nodes[i].obj);
        Py_VISIT(t->nodes[i].key);
    }
    return 0;
}

static void drop_nodes(pl_flat *f)
{
    pl_tree t = {f->nodes, f->n_nodes, 0};
    pl_tree_clear(&t);
    f->nodes = NULL;
    f->n_nodes = f->cap_nodes = 0;
}

void pl_flat_take_tree(pl_flat *f, pl_tree *out)
{
    *out = (pl_tree){f->nodes, f->n_nodes, f->n_leaves};
    f->nodes = NULL;
    f->n_nodes = f->cap_nodes = 0;
}

PyObject *pl_flat_device_arrays(pl_flat *f, pl_block *blk)
{
    PyObject *out = PyTuple_New(f->n_leaves);
    int cuda = f->b->kind == PL_BACKEND_CUDA;
    for (int i = 0; out && i < f->n_leaves; i++) {
        const pl_xfer_leaf *L = &f->leaves[i];
        PyObject *a = pl_device_array_new(f->st, blk, L->off, L->copy.ndim, L->copy.shape,
                                          f->dtypes[i], cuda ? kDLCUDA : kDLCPU, cuda ? f->device : 0);
        if (!a)
            Py_CLEAR(out);
        else
            PyTuple_SET_ITEM(out, i, a);
    }
    return out;
}

pl_leaves *pl_flat_leaf_views(pl_flat *f, pl_block *blk)
{
    pl_leaves *out = pl_flat_leaf_views_raw(f, blk);
    if (!out)
        PyErr_NoMemory();
    return out;
}

pl_leaves *pl_flat_leaf_views_raw(pl_flat *f, pl_block *blk)
{
    size_t dims = 0;
    for (int i = 0; i < f->n_leaves; i++)
        dims += (size_t)f->leaves[i].copy.ndim;
    pl_leaves *out = PyMem_RawMalloc(sizeof(pl_leaves) + (size_t)f->n_leaves * sizeof(pl_da_view) +
                                     dims * sizeof(int64_t));
    if (!out)
        return NULL;
    out->n = f->n_leaves;
    int64_t *shapes = (int64_t *)(out->v + f->n_leaves);
    for (int i = 0; i < f->n_leaves; i++) {
        const pl_xfer_leaf *L = &f->leaves[i];
        int ndim = L->copy.ndim;
        size_t nbytes = f->dtypes[i].bits / 8; /* as pl_device_array_new counts it */
        for (int d = 0; d < ndim; d++)
            nbytes *= (size_t)L->copy.shape[d];
        if (ndim)
            memcpy(shapes, L->copy.shape, (size_t)ndim * sizeof(int64_t));
        out->v[i] = (pl_da_view){blk, L->off, nbytes, ndim, ndim ? shapes : NULL, f->dtypes[i]};
        shapes += ndim;
    }
    return out;
}

PyObject *pl_flat_rebuild(pl_flat *f, pl_block *blk)
{
    PyObject *leaves = pl_flat_device_arrays(f, blk);
    pl_tree t;
    pl_flat_take_tree(f, &t);
    PyObject *out = leaves ? pl_tree_build(&t, leaves) : NULL;
    pl_tree_clear(&t);
    Py_XDECREF(leaves);
    return out;
}

PyObject **pl_flat_take_owners(pl_flat *f, Py_ssize_t *n)
{
    PyObject **o = f->owners;
    *n = f->n_owners;
    f->owners = NULL;
    f->n_owners = f->cap_owners = 0;
    return o;
}

void pl_flat_release_leaves(pl_flat *f)
{
    PyMem_RawFree(f->leaves);
    PyMem_RawFree(f->dtypes);
    f->leaves = NULL;
    f->dtypes = NULL;
    f->n_leaves = 0;
    f->cap_leaves = 0;
    memset(&f->layout, 0, sizeof f->layout);
}

void pl_flat_clear(pl_flat *f)
{
    for (Py_ssize_t i = 0; i < f->n_owners; i++)
        Py_DECREF(f->owners[i]);
    PyMem_RawFree(f->owners);
    drop_nodes(f);
    pl_flat_release_leaves(f);
    pl_flat_init(f, f->st, f->b, f->device);
}

/* pinloader._C.leaves(obj, root, /): see flatten_functions. */
static PyObject *leaves_of(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyUnicode_Check(args[1]))
        return PyErr_Format(PyExc_TypeError, "leaves(obj, root: str)");
    const char *root = PyUnicode_AsUTF8(args[1]);
    if (!root)
        return NULL;
    pl_state *st = pl_state_of_module(m);
    pl_flat f;
    PyObject *found = NULL, *passed = NULL;
    pl_flat_init(&f, st, pl_backend_host(), 0);
    int rc = pl_flat_structure(&f, args[0], root, &found, &passed);
    pl_flat_clear(&f);
    if (rc < 0)
        return NULL;
    PyObject *out = PyTuple_Pack(2, found, passed);
    Py_DECREF(found);
    Py_DECREF(passed);
    return out;
}

static PyMethodDef flatten_functions[] = {
    {"leaves", (PyCFunction)(void (*)(void))leaves_of, METH_FASTCALL,
     "leaves(obj, root, /)\n--\n\n(leaves, others): the array-like leaves of obj as (path, leaf) "
     "pairs in the order the prefetcher walks it (the walk AsyncPrefetcher's structure= "
     "captures), and the other non-container objects in it, also as (path, object)."},
    {NULL, NULL, 0, NULL},
};

int pl_flatten_init(PyObject *m)
{
    return PyModule_AddFunctions(m, flatten_functions);
}
