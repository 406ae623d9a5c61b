/* The epoch tables (pinloader._C.epoch_table and epoch_view) that ArrayLoader's epoch orders
 * are read from in place, and pinloader._C.permutation, the epoch's sampling order (shared with
 * row_gather.c and row_batches.c through gather_impl.h).
 *
 * Note [epoch permutation]
 * The sampling order must be the same on every machine, NumPy version and run, so it is
 * specified here, not borrowed (tests/helpers.py has a Python reference, ref_permutation, that
 * must agree bit for bit: tests/test_permutation.py). All arithmetic is modulo 2**64.
 *   GAMMA = 0x9E3779B97F4A7C15
 *   mix(z):  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9; z = (z ^ (z >> 27)) * 0x94D049BB133111EB;
 *            return z ^ (z >> 31)                                   (SplitMix64's finaliser)
 *   state  = mix(seed) ^ mix(epoch + GAMMA)    (seed, epoch taken modulo 2**64)
 *   next() : state += GAMMA; return mix(state)                      (SplitMix64)
 *   below(n), n >= 1 (Lemire's unbiased multiply-shift):
 *            m = next() * n (128-bit); if low64(m) < n: t = (2**64 - n) % n;
 *            while low64(m) < t: m = next() * n;  return m >> 64
 *   phase  = below(phase_range + 1)                                 (always drawn first)
 *   perm   = [0, 1, ..., n-1]; for i = n-1 down to 1: j = below(i + 1); swap perm[i], perm[j]
 */
#include "gather_impl.h"

#include <string.h>
#include <limits.h>

/* Note [epoch row tables]
 * A loader's epoch order is made once per epoch and read a batch at a time. The RowGathers of its
 * batches need not copy and check their rows (16 bytes of memory traffic per row on the producer,
 * read and written, every batch) when the order is immutable and checked once: epoch_table(order)
 * copies it into an epoch table, memory owned by a capsule that exports no buffer, and returns a
 * read-only int64 array over it (NumPy refuses to make it or a view of it writeable, since its
 * base offers no writable buffer; only raw-pointer tools such as ctypes or a hand-made
 * __array_interface__ could write it, and those can write anything); the table records its
 * smallest and largest entry. A RowGather given such an array, or a C-contiguous slice of one
 * (found through the array's bases, its bytes checked to lie inside the table on whole entries:
 * np.lib.stride_tricks can point a view anywhere), keeps a reference to the table's capsule (not
 * to the array, which ndarray.__setstate__ can re-point elsewhere) and reads the rows in place;
 * they are checked against the source once, by the table's range. Anything else (other arrays,
 * lists, a table whose range does not fit the source) is copied and checked row by row.
 * permutation() returns an epoch table too. epoch_table takes integers only by NumPy's safe
 * casts: floats, or uint64 that int64 cannot hold, are a TypeError, never a silently truncated
 * order. */
#define EPOCH_TABLE_CAPSULE "pinloader.epoch_table"

/* Note [epoch table reuse]
 * A loader makes a table of 8 bytes an item every epoch (32 MiB for 4 million rows). Fresh from
 * the allocator, such a block is new pages from the kernel, and the first write of each 4 KiB
 * page faults: on a 2-core test host that doubles the time the permutation takes (10 ms of
 * shuffling, 12 ms of faults for 4 million items). So a loader's plan holds an EpochTables
 * (pinloader/_epoch_plan.py), which keeps up to TABLE_SPARES blocks that its tables no longer
 * need (the largest, when more come back), and the next table of a size that fits takes one: in a run of epochs the table
 * of epoch e + 1 is made in the block of epoch e - 1, whose pages are already there. A table's
 * capsule holds a reference to the EpochTables it came from and gives its block back when its
 * last reference goes: only then, so a table a user or a RowGather still holds (indices(), a
 * batch's rows) is never written. A block is taken only for a table of at least half its size,
 * and clear() (the loader's close()) frees the spares: the memory kept is at most TABLE_SPARES
 * tables of the largest size the loader made. The cache is touched with the GIL held only
 * (taking a block, the capsule's destructor, clear()). */
#define TABLE_SPARES 2

typedef struct {
    PyObject_HEAD
    epoch_table *spare[TABLE_SPARES];
    int n_spare;
    int64_t reused; /* blocks handed out again (a count for tests) */
} EpochTablesObject;

static PyTypeObject *EpochTables_Type; /* one per process: the module is single-phase */

int pl_is_epoch_tables(PyObject *o)
{
    return o && EpochTables_Type && Py_IS_TYPE(o, EpochTables_Type);
}

static epoch_table *table_alloc(int64_t n)
{
    if ((uint64_t)n > ((uint64_t)PY_SSIZE_T_MAX - sizeof(epoch_table)) / sizeof(int64_t))
        return NULL;
    epoch_table *t = PyMem_RawMalloc(sizeof(epoch_table) + (size_t)n * sizeof(int64_t));
    if (t)
        t->cap = n;
    return t;
}

epoch_table *pl_epoch_table_take(PyObject *tables, int64_t n)
{
    epoch_table *t = NULL;
    if (pl_is_epoch_tables(tables)) {
        EpochTablesObject *c = (EpochTablesObject *)tables;
        int best = -1;
        for (int i = 0; i < c->n_spare; i++) /* the smallest that fits, not more than twice n */
            if (c->spare[i]->cap >= n && c->spare[i]->cap / 2 <= n &&
                (best < 0 || c->spare[i]->cap < c->spare[best]->cap))
                best = i;
        if (best >= 0) {
            t = c->spare[best];
            c->spare[best] = c->spare[--c->n_spare];
            c->reused++;
        }
    }
    if (!t && !(t = table_alloc(n))) {
        if ((uint64_t)n > ((uint64_t)PY_SSIZE_T_MAX - sizeof(epoch_table)) / sizeof(int64_t))
            PyErr_Format(PyExc_MemoryError, "an epoch order of %lld items is too large", (long long)n);
        else
            PyErr_Format(PyExc_MemoryError, "an epoch order of %lld items (%lld bytes) could not be "
                         "allocated", (long long)n, (long long)n * 8);
        return NULL;
    }
    t->n = n;
    t->lo = 0;
    t->hi = -1;
    return t;
}

void pl_epoch_table_give(PyObject *tables, epoch_table *t)
{
    if (!t)
        return;
    if (pl_is_epoch_tables(tables)) {
        EpochTablesObject *c = (EpochTablesObject *)tables;
        if (c->n_spare < TABLE_SPARES) {
            c->spare[c->n_spare++] = t;
            return;
        }
        int small = 0; /* full: keep the larger blocks */
        for (int i = 1; i < c->n_spare; i++)
            if (c->spare[i]->cap < c->spare[small]->cap)
                small = i;
        if (c->spare[small]->cap < t->cap) {
            epoch_table *out = c->spare[small];
            c->spare[small] = t;
            t = out;
        }
    }
    PyMem_RawFree(t);
}

static void epoch_table_free(PyObject *cap)
{
    epoch_table *t = PyCapsule_GetPointer(cap, EPOCH_TABLE_CAPSULE);
    PyObject *tables = PyCapsule_GetContext(cap);
    pl_epoch_table_give(tables, t);
    Py_XDECREF(tables);
}

PyObject *pl_epoch_table_array(epoch_table *t, PyObject *tables)
{
    PyObject *cap = PyCapsule_New(t, EPOCH_TABLE_CAPSULE, epoch_table_free);
    if (!cap) {
        pl_epoch_table_give(tables, t);
        return NULL;
    }
    if (pl_is_epoch_tables(tables))
        PyCapsule_SetContext(cap, Py_NewRef(tables)); /* released by epoch_table_free */
    npy_intp dim = (npy_intp)t->n;
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, PyArray_DescrFromType(NPY_INT64), 1, &dim, NULL,
                                         t->data, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED, NULL);
    if (!arr || PyArray_SetBaseObject((PyArrayObject *)arr, cap) < 0) { /* steals cap */
        if (!arr)
            Py_DECREF(cap);
        Py_XDECREF(arr);
        return NULL;
    }
    return arr;
}

/* A read-only int64 array of n entries over a new epoch table (*out: its entries, to be
 * filled, then epoch_table_range), or NULL with an exception. */
static PyObject *epoch_table_new(int64_t n, epoch_table **out)
{
    epoch_table *t = pl_epoch_table_take(NULL, n);
    PyObject *arr = t ? pl_epoch_table_array(t, NULL) : NULL;
    if (arr)
        *out = t;
    return arr;
}

static void epoch_table_range(epoch_table *t)
{
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int64_t i = 0; i < t->n; i++) {
        lo = t->data[i] < lo ? t->data[i] : lo;
        hi = t->data[i] > hi ? t->data[i] : hi;
    }
    t->lo = t->n ? lo : 0;
    t->hi = t->n ? hi : -1;
}

/* The epoch table that array a lies inside (see the Note), or NULL (no exception); *cap gets
 * its capsule (borrowed). */
const epoch_table *pl_epoch_table_of(PyArrayObject *a, PyObject **cap)
{
    if (PyArray_NDIM(a) != 1 || PyArray_TYPE(a) != NPY_INT64 || !PyArray_ISNOTSWAPPED(a) ||
        !PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) || PyArray_ISWRITEABLE(a))
        return NULL;
    PyObject *base = PyArray_BASE(a);
    for (int hops = 0; base && PyArray_Check(base) && hops < 64; hops++)
        base = PyArray_BASE((PyArrayObject *)base);
    if (!base || !PyCapsule_CheckExact(base) || !PyCapsule_IsValid(base, EPOCH_TABLE_CAPSULE))
        return NULL;
    const epoch_table *t = PyCapsule_GetPointer(base, EPOCH_TABLE_CAPSULE);
    const char *p = PyArray_DATA(a), *lo = (const char *)t->data;
    size_t len = (size_t)PyArray_SIZE(a) * sizeof(int64_t);
    /* inside the table, on whole entries (not only where NumPy calls int64 aligned) */
    if (p < lo || (size_t)(p - lo) > (size_t)t->n * sizeof(int64_t) ||
        len > (size_t)t->n * sizeof(int64_t) - (size_t)(p - lo) || (size_t)(p - lo) % sizeof(int64_t))
        return NULL;
    *cap = base;
    return t;
}

/* If obj is (a slice of) an epoch table whose entries all fit [0, limit - span], borrow it:
 * *out its rows, *owner a new reference to the table's capsule, which owns the memory (not to
 * obj or any array: ndarray.__setstate__ can re-point an array at other memory and drop its
 * base, so only the capsule keeps the rows alive). Returns 1 if borrowed, else 0. */
int pl_borrow_rows(PyObject *obj, int64_t span, int64_t limit, int64_t **out, Py_ssize_t *n_out,
                   PyObject **owner)
{
    if (!PyArray_Check(obj))
        return 0;
    PyObject *cap;
    const epoch_table *t = pl_epoch_table_of((PyArrayObject *)obj, &cap);
    if (!t || (t->n && (t->lo < 0 || t->hi > limit - span)))
        return 0;
    *out = PyArray_DATA((PyArrayObject *)obj);
    *n_out = PyArray_SIZE((PyArrayObject *)obj);
    *owner = Py_NewRef(cap);
    return 1;
}

/* pinloader._C.epoch_table(order): see the Note. */
static PyObject *gather_epoch_table(PyObject *m, PyObject *obj)
{
    (void)m;
    PyArrayObject *a = (PyArrayObject *)PyArray_FROM_OTF(obj, NPY_INT64, NPY_ARRAY_IN_ARRAY); /* safe casts */
    if (!a)
        return NULL;
    if (PyArray_NDIM(a) != 1) {
        PyErr_Format(PyExc_ValueError, "an epoch order must be 1-D, got %d dimensions", PyArray_NDIM(a));
        Py_DECREF(a);
        return NULL;
    }
    PyObject *cap;
    const epoch_table *whole = pl_epoch_table_of(a, &cap);
    if (whole && whole->n == PyArray_SIZE(a) && PyArray_DATA(a) == (void *)whole->data)
        return (PyObject *)a; /* already a whole table: nothing to copy */
    epoch_table *t;
    PyObject *out = epoch_table_new(PyArray_SIZE(a), &t);
    if (out) {
        memcpy(t->data, PyArray_DATA(a), (size_t)t->n * sizeof(int64_t));
        epoch_table_range(t);
    }
    Py_DECREF(a);
    return out;
}

/* pinloader._C.epoch_view(table): a new read-only array over the same entries as `table` (an
 * epoch table, or a slice of one) whose base is the table's capsule itself. What the loader hands
 * out is such a view: `view.base` is the capsule, which user code cannot re-point or free, so
 * ndarray.__setstate__ on anything handed out never reaches the loader's own cached order (a
 * plain .view() would have the cached array as its base, and __setstate__ on that base frees
 * the table under the cache). */
static PyObject *gather_epoch_view(PyObject *m, PyObject *obj)
{
    (void)m;
    PyObject *cap;
    const epoch_table *t = PyArray_Check(obj) ? pl_epoch_table_of((PyArrayObject *)obj, &cap) : NULL;
    if (!t)
        return PyErr_Format(PyExc_TypeError, "epoch_view: not an epoch table (epoch_table)");
    PyArrayObject *a = (PyArrayObject *)obj;
    npy_intp dim = PyArray_SIZE(a);
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, PyArray_DescrFromType(NPY_INT64), 1, &dim, NULL,
                                         PyArray_DATA(a), NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED, NULL);
    if (arr && PyArray_SetBaseObject((PyArrayObject *)arr, Py_NewRef(cap)) < 0) { /* steals cap */
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

/* ---- the epoch permutation (Note [epoch permutation]) ---- */

#define GAMMA 0x9E3779B97F4A7C15ULL

#if defined(__GNUC__) || defined(__clang__)
#define PL_PREFETCH_WRITE(addr) __builtin_prefetch((addr), 1)
#else
#define PL_PREFETCH_WRITE(addr) ((void)(addr))
#endif

static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline uint64_t next64(uint64_t *s)
{
    *s += GAMMA;
    return mix64(*s);
}

static inline uint64_t below(uint64_t *s, uint64_t n)
{
    unsigned __int128 m = (unsigned __int128)next64(s) * n;
    uint64_t l = (uint64_t)m;
    if (l < n) {
        uint64_t t = (0 - n) % n;
        while (l < t) {
            m = (unsigned __int128)next64(s) * n;
            l = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

/* Note [permutation prefetch]
 * The shuffle's swaps land at random in a table of 8 bytes an item (32 MiB for 4 million rows):
 * one cache miss each, and at tens of nanoseconds a miss, an epoch of small rows can be over
 * before the next epoch's order is made (Note [orders made ahead] in pinloader/_epoch_plan.py).
 * The swap targets depend on the random stream only, never on the table, so they are drawn
 * SHUFFLE_AHEAD positions before their swap, in the same order as the Note specifies, and their
 * cache lines fetched meanwhile: the misses overlap instead of queueing one behind the other.
 * The table is the one the plain loop makes, bit for bit (tests/test_permutation.py). */
#define SHUFFLE_AHEAD 128

/* p[0..n) = the permutation of Note [epoch permutation], drawn from stream s. */
static void shuffle(int64_t *p, int64_t n, uint64_t *s)
{
    int64_t js[SHUFFLE_AHEAD]; /* js[i % SHUFFLE_AHEAD]: the swap target of position i */
    for (int64_t i = 0; i < n; i++)
        p[i] = i;
    for (int64_t i = n - 1; i > 0 && i > n - 1 - SHUFFLE_AHEAD; i--) {
        js[i % SHUFFLE_AHEAD] = (int64_t)below(s, (uint64_t)i + 1);
        PL_PREFETCH_WRITE(&p[js[i % SHUFFLE_AHEAD]]);
    }
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t *slot = &js[i % SHUFFLE_AHEAD];
        int64_t j = *slot;
        if (i > SHUFFLE_AHEAD) { /* position i - SHUFFLE_AHEAD's draw: the next in the stream */
            *slot = (int64_t)below(s, (uint64_t)(i - SHUFFLE_AHEAD) + 1);
            PL_PREFETCH_WRITE(&p[*slot]);
        }
        int64_t t = p[i];
        p[i] = p[j];
        p[j] = t;
    }
}

void pl_permute(int64_t *p, int64_t n, uint64_t seed, uint64_t epoch, uint64_t phase_range,
                uint64_t *phase)
{
    uint64_t s = mix64(seed) ^ mix64(epoch + GAMMA);
    *phase = below(&s, phase_range + 1);
    shuffle(p, n, &s);
}

int pl_as_u64(PyObject *o, const char *name, uint64_t *out)
{
    if (PyBool_Check(o) || !PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = (uint64_t)PyLong_AsUnsignedLongLongMask(o); /* modulo 2**64, negatives included */
    return PyErr_Occurred() ? -1 : 0;
}

PyDoc_STRVAR(permutation_doc,
"permutation(n, seed, epoch, phase_range=0) -> (phase, perm)\n--\n\n"
"The epoch's sampling order: perm is a permutation of range(n) (a read-only int64 array) and\n"
"phase an int in [0, phase_range], drawn first from the same stream. Specified in\n"
"src/py/epoch_table.c (Note [epoch permutation]) so that it is identical on every machine and NumPy\n"
"version.");

static PyObject *gather_permutation(PyObject *m, PyObject *args, PyObject *kwds)
{
    (void)m;
    static char *kwlist[] = {"n", "seed", "epoch", "phase_range", NULL};
    long long n, phase_range = 0;
    PyObject *seed_obj, *epoch_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LOO|L:permutation", kwlist, &n, &seed_obj,
                                     &epoch_obj, &phase_range))
        return NULL;
    uint64_t seed, epoch;
    if (pl_as_u64(seed_obj, "seed", &seed) < 0 || pl_as_u64(epoch_obj, "epoch", &epoch) < 0)
        return NULL;
    if (n < 0 || phase_range < 0)
        return PyErr_Format(PyExc_ValueError, "n and phase_range must be >= 0, got %lld and %lld", n, phase_range);
    if ((unsigned long long)n > (unsigned long long)PY_SSIZE_T_MAX / sizeof(int64_t))
        return PyErr_Format(PyExc_MemoryError, "permutation: n = %lld is too large: it needs %lld * 8 "
                            "bytes (one int64 per item), more than the address space", n, n);
    epoch_table *t;
    PyObject *arr = epoch_table_new(n, &t); /* read-only: Note [epoch row tables] */
    if (!arr) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_MemoryError, "permutation: n = %lld is too large: it needs %lld bytes "
                         "(one int64 per item), which could not be allocated", n, n * 8);
        }
        return NULL;
    }
    t->lo = 0;
    t->hi = n - 1;
    uint64_t phase;
    Py_BEGIN_ALLOW_THREADS
    pl_permute(t->data, n, seed, epoch, (uint64_t)phase_range, &phase);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(KN)", (unsigned long long)phase, arr);
}

static PyMethodDef epoch_table_functions[] = {
    {"permutation", (PyCFunction)(void (*)(void))gather_permutation, METH_VARARGS | METH_KEYWORDS, permutation_doc},
    {"epoch_view", gather_epoch_view, METH_O, "epoch_view(table, /)\n--\n\n"
     "A read-only array over the entries of an epoch table (or a slice of one) whose base is the\n"
     "table's capsule: what ArrayLoader.indices hands out (see gather_epoch_view)."},
    {"epoch_table", gather_epoch_table, METH_O, "epoch_table(order, /)\n--\n\n"
     "order (1-D integers) as a read-only int64 array over an epoch table, which RowGathers of its\n"
     "slices read in place (Note [epoch row tables] in src/py/epoch_table.c)."},
    {NULL, NULL, 0, NULL},
};

/* ---- EpochTables (Note [epoch table reuse]) ---- */

static void tables_clear_spares(EpochTablesObject *c)
{
    while (c->n_spare > 0)
        PyMem_RawFree(c->spare[--c->n_spare]);
}

static PyObject *tables_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if ((kwds && PyDict_GET_SIZE(kwds)) || !PyArg_ParseTuple(args, ":EpochTables"))
        return kwds && PyDict_GET_SIZE(kwds) ? PyErr_Format(PyExc_TypeError, "EpochTables() takes no arguments") : NULL;
    return type->tp_alloc(type, 0);
}

static void tables_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    tables_clear_spares((EpochTablesObject *)self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *tables_clear(PyObject *self, PyObject *noargs)
{
    (void)noargs;
    tables_clear_spares((EpochTablesObject *)self);
    Py_RETURN_NONE;
}

static PyObject *tables_spare_bytes(PyObject *self, void *closure)
{
    (void)closure;
    EpochTablesObject *c = (EpochTablesObject *)self;
    long long bytes = 0;
    for (int i = 0; i < c->n_spare; i++)
        bytes += (long long)(sizeof(epoch_table) + (size_t)c->spare[i]->cap * sizeof(int64_t));
    return PyLong_FromLongLong(bytes);
}

static PyObject *tables_reused(PyObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromLongLong(((EpochTablesObject *)self)->reused);
}

static PyMethodDef tables_methods[] = {
    {"clear", tables_clear, METH_NOARGS, "clear($self)\n--\n\nFree the blocks kept for reuse."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef tables_getset[] = {
    {"spare_bytes", tables_spare_bytes, NULL, "Bytes of the blocks kept for reuse.", NULL},
    {"reused", tables_reused, NULL, "Blocks handed out again so far.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot tables_slots[] = {
    {Py_tp_doc, "EpochTables()\n--\n\nThe blocks of a loader's epoch tables kept for reuse "
                "(Note [epoch table reuse] in src/py/epoch_table.c)."},
    {Py_tp_new, tables_new},
    {Py_tp_dealloc, tables_dealloc},
    {Py_tp_methods, tables_methods},
    {Py_tp_getset, tables_getset},
    {0, NULL},
};

static PyType_Spec tables_spec = {
    .name = "pinloader._C.EpochTables",
    .basicsize = sizeof(EpochTablesObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = tables_slots,
};

int pl_epoch_table_init(PyObject *m)
{
    PyTypeObject *tp = (PyTypeObject *)PyType_FromModuleAndSpec(m, &tables_spec, NULL);
    if (!tp || PyModule_AddObjectRef(m, "EpochTables", (PyObject *)tp) < 0) {
        Py_XDECREF(tp);
        return -1;
    }
    Py_XSETREF(EpochTables_Type, tp); /* the module's reference, for is_tables */
    return PyModule_AddFunctions(m, epoch_table_functions);
}
