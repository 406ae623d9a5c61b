/* Flatten: a Python item -> array leaves with their paths and a checked layout -> the rebuilt
 * container of DeviceArrays. Runs with the GIL held (it calls user code: __dlpack__, _fields,
 * dataclass and namedtuple constructors, copy.copy of dict subclasses).
 *
 * Note [flatten in two passes]
 * pl_flat_walk reads the item: it classifies every object (container, array leaf, pass-through),
 * validates array leaves (dtype, DLPack ndim/shape/strides/byte_offset) and adds each to the
 * layout (see Note [batch layout] in transfer.h), keeping a strong reference to each leaf's
 * owner (the array, or the DLPack capsule) so its memory stays valid whatever user code does
 * later. The shape of the item is recorded as a preorder list of nodes. Only when the whole
 * layout is known does pl_flat_rebuild create the outputs: each DeviceArray at its final offset,
 * then the containers around them, calling the user's constructors last. No borrowed pointer to
 * an output outlives user code, and no output is ever patched after it was made. */
#ifndef PL_FLATTEN_H
#define PL_FLATTEN_H

#include "state.h"

#include "device_array.h"
#include "dlpack.h"
#include "gather.h"
#include "transfer.h"

typedef struct pl_flat_node pl_flat_node;

/* The shape of a walked item: its nodes in preorder (containers, pass-through objects, array
 * leaves numbered in walk order). Built once per item, with the GIL; a batch carries its tree
 * to the consumer when the leaves are converted there (see Note [handout] in handout.h). */
typedef struct pl_tree {
    pl_flat_node *nodes;
    Py_ssize_t n_nodes;
    Py_ssize_t n_leaves;
} pl_tree;

/* Note [lazy paths]
 * An error names the leaf by its path ("item['x'][2].y"), and structure mode records each
 * leaf's path; but almost every walk succeeds, and formatting every step's text (a repr() and
 * an encode per dict key, a printf per index) costs more than reading the leaves. So the walk
 * keeps the path as a stack of steps, and path_render (flat_path.c) renders the text only when
 * it is read. A step whose text needs no user code (an index, an exact str or int key, an exact str
 * field name) keeps its object and is rendered then; any other key's repr() (or name's str())
 * is still taken when the walk reaches it, as user code may raise there or answer differently
 * later, and that text is kept with the step. The objects are borrowed from the snapshots the
 * walk holds while it is below them (the pairs list, the fields tuple), and the root's text
 * from the caller of the walk. The text is what formatting each step in turn gave: the same
 * repr() cut to 159 bytes, the whole cut to 511. */
enum { PL_FLAT_MAX_NEST = 256 };

typedef struct pl_path_step {
    int kind;        /* see path_step_kind in flatten_impl.h */
    PyObject *obj;   /* borrowed (Note [lazy paths]) */
    Py_ssize_t index;
    char *text;      /* the root's (borrowed), or a key's taken at once (PyMem_Raw, owned) */
} pl_path_step;

typedef struct pl_flat {
    /* target, set by pl_flat_init */
    pl_state *st;
    const pl_backend *b;
    int device;
    /* results of pl_flat_walk */
    pl_xfer_leaf *leaves;   /* layout final after a successful walk */
    DLDataType *dtypes;     /* per leaf */
    int n_leaves;
    Py_ssize_t cap_leaves;
    pl_layout layout;
    PyObject **owners;      /* strong references keeping the leaves' memory alive */
    Py_ssize_t n_owners, cap_owners;
    /* private */
    pl_flat_node *nodes;
    Py_ssize_t n_nodes, cap_nodes;
    PyObject *found;        /* structure mode: the (path, leaf) list, else NULL */
    PyObject *passed;       /* structure mode: the (path, object) list of the others, or NULL */
    int n_steps;
    /* last: pl_flat_init leaves these two unwritten, as nothing reads them before writing */
    pl_path_step steps[PL_FLAT_MAX_NEST + 2]; /* the root, then one per level (Note [lazy paths]) */
    char path[512];  /* the rendered text, valid after path_render */
    size_t path_len;
} pl_flat;

void pl_flat_init(pl_flat *f, pl_state *st, const pl_backend *b, int device);
/* Start reading the next item with f, keeping its leaf buffers (leaves, dtypes) for reuse: a
 * producer reads one item after another. f must hold nothing else: its owners taken and its
 * nodes taken or cleared, or f just made by pl_flat_init or emptied by pl_flat_clear. */
void pl_flat_begin(pl_flat *f);
/* Read the item (see Note [flatten in two passes]). Returns 0, or -1 with an exception set:
 * TypeError/ValueError naming the leaf's path for bad leaves, or whatever user code raised
 * (a BaseException that is not an Exception, such as KeyboardInterrupt, always unchanged). */
int pl_flat_walk(pl_flat *f, PyObject *item);
/* The output structure: DeviceArrays viewing blk, in containers of the item's types. Consumes
 * the walked nodes; the leaves, layout and owners stay. */
PyObject *pl_flat_rebuild(pl_flat *f, pl_block *blk);
/* The parts of pl_flat_rebuild: a tuple of the DeviceArrays viewing blk, one per leaf in walk
 * order; and the walked nodes, moved into *out. */
PyObject *pl_flat_device_arrays(pl_flat *f, pl_block *blk);
void pl_flat_take_tree(pl_flat *f, pl_tree *out);

/* Note [batch leaves]
 * A batch handed out through the handout (Note [handout] in handout.h) carries its array leaves
 * as what a DeviceArray of each would view -- block, offset, bytes, dtype, shape -- in one
 * allocation, not as a DeviceArray per leaf: the handout exports the capsules (or copies into
 * the static buffers) straight from these views, and makes DeviceArrays only where they are
 * delivered (output="array" with convert=). Each export takes its own block reference, as a
 * DeviceArray's does, so the views only need to live as long as the batch: `blk` in each is
 * borrowed from the batch's own reference, which outlives the handout. */
typedef struct pl_leaves {
    Py_ssize_t n;
    pl_da_view v[]; /* n views in walk order, then their shapes */
} pl_leaves;
/* The walked leaves as views of blk (PyMem_Raw; free with PyMem_RawFree), or NULL with
 * MemoryError. */
pl_leaves *pl_flat_leaf_views(pl_flat *f, pl_block *blk);
/* The same without the GIL: NULL (no exception) when out of memory. */
pl_leaves *pl_flat_leaf_views_raw(pl_flat *f, pl_block *blk);
/* The item's structure with leaf i replaced by leaves[i] (a tuple of t->n_leaves objects);
 * user constructors (namedtuple, dataclass, copy.copy of a dict subclass) run here. t is left
 * as it is: a tree builds any number of batches. */
PyObject *pl_tree_build(const pl_tree *t, PyObject *leaves);
void pl_tree_clear(pl_tree *t);
/* "(2, 3)", "(4,)", "()": a shape as error messages write it, cut to fit n bytes. */
void pl_shape_text(char *buf, size_t n, int ndim, const int64_t *shape);
/* Add pinloader._C.leaves to the module. */
int pl_flatten_init(PyObject *m);
int pl_tree_traverse(const pl_tree *t, visitproc visit, void *arg);
/* Structure mode: walk obj (its path named `root`) recording containers, pass-through objects
 * and array-like leaves without reading any leaf; *found gets a new list of (path, leaf) in
 * walk order, and *passed (when not NULL) a new list of the pass-through objects, also as
 * (path, object). The tree is then taken with pl_flat_take_tree. Used to capture an ArrayLoader's
 * structure once (AsyncPrefetcher's structure=, pinloader._C.leaves). */
int pl_flat_structure(pl_flat *f, PyObject *obj, const char *root, PyObject **found,
                      PyObject **passed);
/* ArrayLoader batches made without the GIL (Note [native epochs] in row_batches.c): the leaves of
 * the batch are row-gathered leaves only, added in order after pl_flat_begin, with no nodes
 * and no owners (the epoch's RowBatches keeps the sources). pl_flat_reserve_rows makes room for
 * n leaves (GIL held; 0, or -1 with MemoryError); pl_flat_add_rows adds one (no GIL; 0, or -1
 * with the reason in why); pl_flat_finish_rows fixes the layout once all are added. */
int pl_flat_reserve_rows(pl_flat *f, Py_ssize_t n);
int pl_flat_add_rows(pl_flat *f, const pl_row_gather_leaf *g, char *why, size_t n_why);
void pl_flat_finish_rows(pl_flat *f);
/* Take the owners (the caller drops them later, with the GIL); *n gets their count. */
PyObject **pl_flat_take_owners(pl_flat *f, Py_ssize_t *n);
/* Free the leaves and the layout (no GIL needed: transfer reads them without it). */
void pl_flat_release_leaves(pl_flat *f);
/* Free everything still held (GIL held). */
void pl_flat_clear(pl_flat *f);

#endif
