/* RowGather's part, private header: the objects and the functions its files share.
 * row_batches.c holds RowBatches, one epoch's batches made without the GIL, and pl_array_types_init;
 * row_gather.c RowGather (its source, its rows, read-ahead); epoch_table.c the epoch
 * tables, their reuse and the epoch permutation; epoch_order.c the epoch's order (permutation,
 * shards, windows) made on a thread of its own; registration.c Registration, register_rows and what makes
 * a source eligible for the device gather. The public header is gather.h. */
#ifndef PL_GATHER_IMPL_H
#define PL_GATHER_IMPL_H

#include "gather.h"

#include "devgather.h"

_Static_assert(sizeof(npy_intp) == sizeof(int64_t), "npy_intp must be 64-bit");

typedef struct {
    PyObject_HEAD
    pl_hostreg *reg;
    const pl_backend *b;
    int device;
    uint32_t gen;         /* Note [fork generations] */
    size_t span;          /* bytes per item, when registered for */
    int64_t window;
    const char *lo;       /* the source's bytes, [lo, lo + n): what RowGathers may read */
    size_t n;
    PyObject *holder;     /* a RowGather over the source, holding it until close() (Note [a
                           * registration holds its source]); NULL once closed */
} RegistrationObject;

typedef struct {
    PyObject_HEAD
    PyObject *array;      /* the ndarray rows are read from: the RowGather's own view */
    PyObject *registration; /* a Registration for the device gather, or NULL */
    pl_hostreg *reg;      /* with it: the RowGather's own handle on its range (pl_hostreg_dup),
                           * which the Registration's close() does not release */
    PyObject *source;     /* what the caller passed */
    Py_buffer held;       /* an export on the object the array views; held.obj NULL if none */
    int64_t *rows;        /* n_rows validated starts: PyMem_Malloc'd, or borrowed */
    PyObject *rows_owner; /* the capsule of the epoch table rows are borrowed from (Note [epoch
                           * row tables]), or NULL when rows is the RowGather's own */
    Py_ssize_t n_rows;
    int64_t window;       /* 0: single rows */
    int64_t advised;      /* bytes given to madvise (Note [read-ahead]) */
    int writeable;        /* NumPy says the source may be written */
    DLDataType dtype;
} RowGatherObject;

/* The epoch table (Note [epoch row tables] in epoch_table.c). */
typedef struct epoch_table {
    int64_t n, lo, hi; /* entries, and the smallest and largest of them (0, -1 when empty) */
    int64_t cap;       /* entries the block has room for (>= n; a reused block's may be more) */
    int64_t data[];
} epoch_table;

/* ---- epoch_table.c ---- */

/* The epoch table that array a lies inside, or NULL (no exception); *cap gets its capsule
 * (borrowed). */
const epoch_table *pl_epoch_table_of(PyArrayObject *a, PyObject **cap);
/* If obj is (a slice of) an epoch table whose entries all fit [0, limit - span], borrow it
 * (*owner: a new reference to the table's capsule). Returns 1 if borrowed, else 0. */
int pl_borrow_rows(PyObject *obj, int64_t span, int64_t limit, int64_t **out, Py_ssize_t *n_out,
                   PyObject **owner);
/* o is an EpochTables (Note [epoch table reuse] in epoch_table.c). */
int pl_is_epoch_tables(PyObject *o);
/* GIL held: a block for an epoch table of n entries (n set, lo/hi not), taken from `tables`
 * (an EpochTables, Note [epoch table reuse]; NULL: none) when it has one big enough, else
 * allocated; NULL with MemoryError when memory is short. */
epoch_table *pl_epoch_table_take(PyObject *tables, int64_t n);
/* GIL held (or tables NULL): block t back to `tables`, or freed when it keeps enough. */
void pl_epoch_table_give(PyObject *tables, epoch_table *t);
/* GIL held: a read-only int64 array over block t (n, lo and hi set), owned by a capsule that
 * gives it back to `tables` when the last reference goes. On failure t is given back too and
 * NULL returned with an exception. */
PyObject *pl_epoch_table_array(epoch_table *t, PyObject *tables);
/* p[0..n) = the permutation of Note [epoch permutation] for (seed, epoch); *phase gets the
 * phase drawn first, in [0, phase_range]. No GIL needed. */
void pl_permute(int64_t *p, int64_t n, uint64_t seed, uint64_t epoch, uint64_t phase_range,
                uint64_t *phase);
/* An int (not a bool) modulo 2**64 into *out, or -1 with TypeError naming `name`. */
int pl_as_u64(PyObject *o, const char *name, uint64_t *out);
/* permutation, epoch_table, epoch_view and EpochTables, added to module m. */
int pl_epoch_table_init(PyObject *m);

/* ---- epoch_order.c ---- */

/* OrderJob (Note [epoch orders]), added to module m (by pl_array_types_init, after the tables). */
int pl_epoch_order_init(PyObject *m);
/* The test switch: while on, order jobs' threads wait before they begin (testing.c). */
void pl_epoch_order_hold(int on);
int pl_epoch_order_parked(void);

/* ---- row_gather.c ---- */

/* The RowGather type, added to module m. */
int pl_row_gather_init(PyObject *m, pl_state *st);

/* Read-ahead of rows (Note [read-ahead] in row_gather.c): bytes advised. No GIL. */
int64_t pl_advise_rows(const char *data, int nd, const npy_intp *shape, const npy_intp *strides,
                       size_t itemsize, int64_t window, const int64_t *rows, Py_ssize_t n);

/* ---- registration.c ---- */

/* Take registration reg_obj for the device gather of g's rows, or -1 with an exception. */
int pl_attach_registration(RowGatherObject *g, PyObject *reg_obj);
/* The Registration type and register_rows, added to module m. */
int pl_registration_init(PyObject *m, pl_state *st);

#endif
