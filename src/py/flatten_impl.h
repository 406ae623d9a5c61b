/* Flatten's private header: the nodes of a walked item and the functions its files share.
 * flatten.c holds the walk (Note [one leaf classifier]), the Python-iterable source and the
 * rebuild; flat_leaves.c the leaf readers (NumPy arrays, RowGathers, DLPack exporters,
 * buffer-protocol objects) and the nodes, leaves and owners they add; flat_path.c the error
 * helpers and the leaf paths' text (Note [lazy paths] in flatten.h), their steps recorded by the
 * inline functions below. The public header is flatten.h. GIL held throughout, except where a
 * function says otherwise. */
#ifndef PL_FLATTEN_IMPL_H
#define PL_FLATTEN_IMPL_H

#include "flatten.h"

typedef enum {
    FN_PASS,       /* obj passes through unchanged */
    FN_LEAF,       /* an array leaf: a DeviceArray of leaves[leaf] */
    FN_TUPLE,      /* n children */
    FN_LIST,       /* n children */
    FN_DICT,       /* n children, each with its key; obj: an empty dict subclass copy, or NULL */
    FN_NAMEDTUPLE, /* type obj called with the n children as positional arguments */
    FN_SEQ_SUBCLASS, /* type obj (a list or tuple subclass) called with a tuple of the n children */
    FN_DATACLASS,  /* type obj called with the n children as keyword arguments (their keys) */
} fnode_kind;

struct pl_flat_node {
    fnode_kind kind;
    PyObject *obj;  /* see fnode_kind; a strong reference */
    PyObject *key;  /* the key (or field name) under which the parent holds it; strong or NULL */
    Py_ssize_t n;   /* children, which follow in preorder */
    int leaf;
};

/* ---- the path's steps (Note [lazy paths] in flatten.h) ----
 * Recorded inline: the walk pushes and pops one for every container entry it visits. */

typedef enum {
    PATH_ROOT,  /* text: the root's name, borrowed */
    PATH_INDEX, /* "[index]" */
    PATH_KEY,   /* "[repr(obj)]", obj an exact str or int */
    PATH_ATTR,  /* ".obj", obj an exact str */
    PATH_TEXT,  /* text, owned: a key's "[repr]" or a name's ".str" taken when walked */
} path_step_kind;

/* flat_path.c: a step whose text is taken now (a key or name not rendered lazily): 0, or -1. */
int pl_fl_path_push_taken(pl_flat *f, PyObject *key, int as_attr, size_t *mark);

/* Room for one more step (the walk's nesting limit bounds them; SystemError past it). */
static inline pl_path_step *pl_fl_path_step(pl_flat *f, int kind, size_t *mark)
{
    if (f->n_steps >= (int)(sizeof f->steps / sizeof f->steps[0])) {
        PyErr_SetString(PyExc_SystemError, "pinloader: path deeper than the nesting limit");
        return NULL;
    }
    *mark = (size_t)f->n_steps;
    pl_path_step *p = &f->steps[f->n_steps++];
    *p = (pl_path_step){kind, NULL, 0, NULL};
    return p;
}

static inline void pl_fl_path_pop(pl_flat *f, size_t mark)
{
    while (f->n_steps > (int)mark) {
        pl_path_step *p = &f->steps[--f->n_steps];
        if (p->kind == PATH_TEXT)
            PyMem_RawFree(p->text);
    }
}

static inline void pl_fl_path_root(pl_flat *f, const char *root)
{
    size_t mark;
    pl_path_step *p = pl_fl_path_step(f, PATH_ROOT, &mark); /* the first: never full */
    if (p)
        p->text = (char *)root;
}

/* "[i]": its mark, or (size_t)-1 with an exception. */
static inline size_t pl_fl_path_push_index(pl_flat *f, Py_ssize_t i)
{
    size_t mark;
    pl_path_step *p = pl_fl_path_step(f, PATH_INDEX, &mark);
    if (p)
        p->index = i;
    return p ? mark : (size_t)-1;
}

/* "[repr(key)]" for dict entries, ".name" for attributes. Exact str and int keys are rendered
 * when read; any other key's text is taken now (pl_fl_path_push_taken: user code). -1 with an
 * exception: a BaseException from that code, or MemoryError. */
static inline int pl_fl_path_push_text(pl_flat *f, PyObject *key, int as_attr, size_t *mark)
{
    int lazy = as_attr ? PyUnicode_CheckExact(key) : PyUnicode_CheckExact(key) || PyLong_CheckExact(key);
    if (!lazy)
        return pl_fl_path_push_taken(f, key, as_attr, mark);
    pl_path_step *p = pl_fl_path_step(f, as_attr ? PATH_ATTR : PATH_KEY, mark);
    if (!p)
        return -1;
    p->obj = key;
    return 0;
}

/* ---- flat_path.c ---- */

/* A BaseException that is not an Exception is pending: it must propagate unchanged. */
int pl_fl_pending_is_base_only(void);
/* str(o) (or repr) as UTF-8 into buf; -1 only with a BaseException that is not an Exception. */
int pl_fl_text_of(PyObject *o, int use_repr, char *buf, size_t n);
/* Render the path into f->path. */
int pl_fl_path_render(pl_flat *f);
/* An exception of `type`, "path: why", for the leaf being walked. Returns -1. */
int pl_fl_leaf_error(pl_flat *f, PyObject *type, const char *fmt, ...);

/* ---- flat_leaves.c ---- */

/* Structure mode: append (the current path, obj) to list. */
int pl_fl_record_at_path(pl_flat *f, PyObject *list, PyObject *obj);
/* Append a node; its index, or -1. */
Py_ssize_t pl_fl_push_node(pl_flat *f, fnode_kind kind, PyObject *obj, PyObject *key);
/* The leaf readers: each adds the leaf and its node, 0 or -1 with an exception. */
int pl_fl_numpy_leaf(pl_flat *f, PyObject *key, PyArrayObject *a);
int pl_fl_row_gather_leaf(pl_flat *f, PyObject *key, PyObject *obj);
int pl_fl_walk_dlpack(pl_flat *f, PyObject *obj, PyObject *key, PyObject *devfn);
int pl_fl_walk_buffer(pl_flat *f, PyObject *obj, PyObject *key);

#endif
