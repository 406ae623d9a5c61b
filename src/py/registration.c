/* pinloader._C.Registration and register_rows: a source's host range registered for the device
 * gather (Note [registered sources] in devgather.h), and what makes a RowGather's rows eligible
 * for it (gather_impl.h).
 */
#include "gather_impl.h"

#include "util.h"


/* ---- device gather eligibility (Note [device gather] in devgather.h) ---- */

/* The bytes array a spans, [*lo, *lo + *n). Sizes were checked by NumPy when a was made;
 * the sums are checked again here. Returns -1 for an empty array. */
static int array_extent(PyArrayObject *a, const char **lo, size_t *n)
{
    const int nd = PyArray_NDIM(a);
    int64_t below = 0, above = (int64_t)PyArray_ITEMSIZE(a);
    for (int d = 0; d < nd; d++) {
        int64_t dim = PyArray_DIMS(a)[d], ext;
        if (dim == 0)
            return -1;
        if (__builtin_mul_overflow(dim - 1, (int64_t)PyArray_STRIDES(a)[d], &ext))
            return -1;
        if (ext < 0 ? __builtin_add_overflow(below, ext, &below) : __builtin_add_overflow(above, ext, &above))
            return -1;
    }
    *lo = (const char *)PyArray_DATA(a) + below;
    *n = (size_t)(above - below);
    return 0;
}

/* The bytes of one item (a row, or `window` rows) if they are one contiguous span of the
 * source, else 0 with *why saying why not. */
static size_t item_span(PyArrayObject *a, int64_t window, const char **why)
{
    const int nd = PyArray_NDIM(a);
    int64_t expect = (int64_t)PyArray_ITEMSIZE(a);
    for (int d = nd - 1; d >= 1; d--) {
        if (PyArray_DIMS(a)[d] != 1 && PyArray_STRIDES(a)[d] != expect) {
            *why = "the source's rows are not contiguous (strided or Fortran-order inner dimensions)";
            return 0;
        }
        expect *= PyArray_DIMS(a)[d];
    }
    if (expect == 0) {
        *why = "the source's rows are empty";
        return 0;
    }
    if (window > 1) {
        if (PyArray_STRIDES(a)[0] != expect) {
            *why = "a window of rows is not contiguous in the source (the row stride is not the row size)";
            return 0;
        }
        expect *= window;
    }
    return (size_t)expect;
}

/* ---- registrations (Note [registered sources] in devgather.h) ---- */

static int registration_check(PyObject *o)
{
    pl_state *st = pl_state_of_type(Py_TYPE(o));
    return st && PyObject_TypeCheck(o, st->Registration_Type);
}

/* Take reg for the device gather of g's rows: same fork generation, open, covering the view,
 * and the items one contiguous span of the size it was made for. */
int pl_attach_registration(RowGatherObject *g, PyObject *reg_obj)
{
    if (!registration_check(reg_obj)) {
        PyErr_Format(PyExc_TypeError, "registration must be a pinloader._C.Registration or None, not %.100s",
                     Py_TYPE(reg_obj)->tp_name);
        return -1;
    }
    RegistrationObject *r = (RegistrationObject *)reg_obj;
    if (pl_inherited(r->gen)) {
        pl_raise_forked("Registration");
        return -1;
    }
    if (!r->reg) {
        PyErr_SetString(PyExc_ValueError, "the registration is closed");
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)g->array;
    const char *lo, *why = NULL;
    size_t n;
    if (array_extent(a, &lo, &n) < 0 || lo < r->lo || n > r->n || (size_t)(lo - r->lo) > r->n - n) {
        PyErr_SetString(PyExc_ValueError, "the source does not lie inside the registered range");
        return -1;
    }
    size_t span = item_span(a, g->window, &why);
    if (!span || span != r->span || (g->window ? g->window : 1) != (r->window ? r->window : 1)) {
        PyErr_Format(PyExc_ValueError, "the registration was made for items of %zu bytes, not for "
                     "these rows (%s)", r->span, why ? why : "a different item size");
        return -1;
    }
    if (!(g->reg = pl_hostreg_dup(r->reg))) {
        PyErr_NoMemory();
        return -1;
    }
    g->registration = Py_NewRef(reg_obj);
    return 0;
}

/* Note [a registration holds its source]
 * A Registration is an address range the device reads through its own mapping of the pages
 * that were there when it was made. Were the source freed while the range stays registered, a
 * new array the allocator places at the same addresses would pass a RowGather's range check,
 * and the device gather would read the old pages through the stale mapping: silently wrong
 * rows. So a Registration holds its source until close() or its own end (the probe RowGather
 * register_rows made: it holds the source and a buffer export on it, for a CPU torch tensor
 * one on a NumPy view of it, torch_hold), and lets go of it only after the range is given
 * back. The Registration is tracked by the garbage collector, so a cycle through it and its
 * source is collected; but NumPy does not show an array's base to the collector, so a cycle
 * that runs through a view's base (a registration of arr.view() stored on arr) is not: such a
 * registration must be closed. */
static void reg_release(RegistrationObject *r)
{
    pl_hostreg *h = r->reg;
    PyObject *holder = r->holder; /* taken with the range: a close() in another thread while
                                   * this one gives the range back must not drop it first */
    r->reg = NULL;
    r->holder = NULL;
    if (h && !pl_inherited(r->gen)) { /* the parent's range: never unregistered in a child */
        Py_BEGIN_ALLOW_THREADS
        pl_hostreg_release(h);
        Py_END_ALLOW_THREADS
    }
    Py_XDECREF(holder); /* after the range is given back */
}

static int reg_traverse(PyObject *op, visitproc visit, void *arg)
{
    Py_VISIT(((RegistrationObject *)op)->holder);
    Py_VISIT(Py_TYPE(op));
    return 0;
}

static int reg_clear(PyObject *op)
{
    reg_release((RegistrationObject *)op);
    return 0;
}

static void reg_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    reg_release((RegistrationObject *)op);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyObject *reg_close(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    reg_release((RegistrationObject *)op);
    Py_RETURN_NONE;
}

static PyObject *reg_get_nbytes(PyObject *op, void *c)
{
    (void)c;
    RegistrationObject *r = (RegistrationObject *)op;
    return PyLong_FromSize_t(r->reg && !pl_inherited(r->gen) ? pl_hostreg_bytes(r->reg) : 0);
}

static PyObject *reg_get_flag(PyObject *op, void *c)
{
    RegistrationObject *r = (RegistrationObject *)op;
    if (!r->reg || pl_inherited(r->gen))
        Py_RETURN_FALSE;
    int v = c ? pl_hostreg_owned(r->reg) : pl_hostreg_read_only(r->reg);
    return PyBool_FromLong(v);
}

static PyObject *reg_get_closed(PyObject *op, void *c)
{
    (void)c;
    return PyBool_FromLong(((RegistrationObject *)op)->reg == NULL);
}

static PyObject *reg_get_span(PyObject *op, void *c)
{
    (void)c;
    return PyLong_FromSize_t(((RegistrationObject *)op)->span);
}

static PyObject *reg_get_backend(PyObject *op, void *c)
{
    (void)c;
    return PyUnicode_FromString(((RegistrationObject *)op)->b->name);
}

static PyObject *reg_repr(PyObject *op)
{
    RegistrationObject *r = (RegistrationObject *)op;
    if (!r->reg)
        return PyUnicode_FromString("<pinloader._C.Registration (closed)>");
    return PyUnicode_FromFormat("<pinloader._C.Registration %s:%d, %zu bytes, %s>", r->b->name, r->device,
                                pl_hostreg_bytes(r->reg), pl_hostreg_owned(r->reg) ? "registered by pinloader"
                                                                                    : "already page-locked");
}

static PyMethodDef reg_methods[] = {
    {"close", reg_close, METH_NOARGS, "Give the registration back; the range is unregistered when no "
     "RowGather in flight uses it any more. Idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef reg_getset[] = {
    {"nbytes", reg_get_nbytes, NULL, "bytes of the page-rounded registered range (0 once closed)", NULL},
    {"owned", reg_get_flag, NULL, "True if pinloader registered the range (False: it was already page-locked)",
     (void *)1},
    {"read_only", reg_get_flag, NULL, "True if the device maps the range read-only", NULL},
    {"closed", reg_get_closed, NULL, "True once close() ran", NULL},
    {"span", reg_get_span, NULL, "bytes per item the registration was made for", NULL},
    {"backend", reg_get_backend, NULL, "'cuda' or 'host': the backend whose kernels read the range", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot reg_slots[] = {
    {Py_tp_dealloc, reg_dealloc},
    {Py_tp_traverse, reg_traverse},
    {Py_tp_clear, reg_clear},
    {Py_tp_methods, reg_methods},
    {Py_tp_getset, reg_getset},
    {Py_tp_repr, reg_repr},
    {Py_tp_doc, (void *)"A source's host range registered for the device gather (made by register_rows)."},
    {0, NULL},
};

static PyType_Spec reg_spec = {
    .name = "pinloader._C.Registration",
    .basicsize = sizeof(RegistrationObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION |
             Py_TPFLAGS_HAVE_GC,
    .slots = reg_slots,
};

PyDoc_STRVAR(register_rows_doc,
"register_rows(source, window=None, device=None, max_bytes=None) -> (Registration | None, reason)\n--\n\n"
"Register the host memory of `source` (anything RowGather takes) so that the device gather can\n"
"read its rows (or windows of `window` rows) with a kernel on `device`'s copy stream: the\n"
"Registration, with reason '', or None with the reason it cannot be (the rows are not\n"
"contiguous spans, the range does not fit in `max_bytes` of registered memory (default: the\n"
"default pinned pool's cap), the driver refused, no gather kernel for the device...).\n"
"Memory already page-locked is used as it is. Registrations of one range are shared. A\n"
"Registration holds `source` until it is closed or dropped.");

static PyObject *gather_register_rows(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"source", "window", "device", "max_bytes", NULL};
    PyObject *src, *window_obj = Py_None, *device_obj = Py_None, *max_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OOO:register_rows", kwlist, &src, &window_obj,
                                     &device_obj, &max_obj))
        return NULL;
    pl_state *st = pl_state_of_module(m);
    const pl_backend *b;
    int device;
    if (pl_resolve_device(st, device_obj, &b, &device) < 0)
        return NULL;
    size_t budget = pl_hostreg_default_budget();
    if (max_obj != Py_None) {
        if (PyBool_Check(max_obj) || !PyLong_Check(max_obj))
            return PyErr_Format(PyExc_TypeError, "max_bytes must be an int or None, not %.100s",
                                Py_TYPE(max_obj)->tp_name);
        long long v = PyLong_AsLongLong(max_obj);
        if (v == -1 && PyErr_Occurred())
            return NULL;
        if (v < 0)
            return PyErr_Format(PyExc_ValueError, "max_bytes must be >= 0, got %lld", v);
        budget = (size_t)v;
    }
    /* the source and its layout, exactly as a RowGather over it will see them */
    PyObject *no_rows = PyTuple_New(0);
    if (!no_rows)
        return NULL;
    PyObject *kw = window_obj != Py_None ? Py_BuildValue("{s:O}", "window", window_obj) : NULL;
    PyObject *call_args = Py_BuildValue("(OO)", src, no_rows);
    Py_DECREF(no_rows);
    PyObject *probe = call_args ? PyObject_Call((PyObject *)st->RowGather_Type, call_args, kw) : NULL;
    Py_XDECREF(call_args);
    Py_XDECREF(kw);
    if (!probe)
        return NULL;
    RowGatherObject *g = (RowGatherObject *)probe;
    PyArrayObject *a = (PyArrayObject *)g->array;
    const char *why = NULL, *lo;
    size_t n, span = 0;
    char text[300];
    int rc;
    if (array_extent(a, &lo, &n) < 0) {
        why = "the source is empty";
        goto refuse;
    }
    if (!(span = item_span(a, g->window, &why)))
        goto refuse;
    if ((rc = b->gather_ready(device, &why)) != PL_OK) {
        snprintf(text, sizeof text, "%s (%s)", why, pl_error_name(b, rc));
        why = text;
        goto refuse;
    }
    /* only the whole pages inside the source (Note [registered sources] in devgather.h) */
    const uintptr_t page = (uintptr_t)pl_page_size();
    uintptr_t in_lo = ((uintptr_t)lo + page - 1) & ~(page - 1), in_hi = ((uintptr_t)lo + n) & ~(page - 1);
    if (in_hi <= in_lo) {
        why = "the source holds no whole page of memory (smaller than a page, or not aligned so)";
        goto refuse;
    }
    pl_hostreg *h = NULL;
    int err = PL_OK;
    Py_BEGIN_ALLOW_THREADS
    if ((rc = b->set_device(device)) == PL_OK)
        rc = pl_hostreg_acquire(b, (const void *)in_lo, in_hi - in_lo, budget, !g->writeable, &h, &err);
    else
        err = rc, rc = PL_REG_REFUSED;
    Py_END_ALLOW_THREADS
    if (rc == PL_REG_OVER_BUDGET) {
        snprintf(text, sizeof text, "the source's %zu bytes do not fit in the registered-memory budget "
                 "(max_registered_bytes=%zu, %zu already registered)", n, budget, pl_hostreg_total(b));
        why = text;
        goto refuse;
    }
    if (rc == PL_REG_OVERLAP) {
        why = "the source overlaps a registered range without lying inside it";
        goto refuse;
    }
    if (rc != PL_REG_OK) {
        snprintf(text, sizeof text, "cudaHostRegister refused the source: %s (%s)", pl_error_name(b, err),
                 pl_error_string(b, err));
        why = text;
        goto refuse;
    }
    RegistrationObject *r = PyObject_GC_New(RegistrationObject, st->Registration_Type);
    if (!r) {
        Py_BEGIN_ALLOW_THREADS
        pl_hostreg_release(h);
        Py_END_ALLOW_THREADS
        Py_DECREF(probe);
        return NULL;
    }
    r->reg = h;
    r->b = b;
    r->device = device;
    r->gen = pl_generation();
    r->span = span;
    r->window = g->window;
    r->lo = lo;
    r->n = n;
    r->holder = probe; /* Note [a registration holds its source] */
    PyObject_GC_Track((PyObject *)r);
    return Py_BuildValue("(Ns)", (PyObject *)r, "");

refuse:
    Py_DECREF(probe);
    return Py_BuildValue("(Os)", Py_None, why);
}

static PyMethodDef registration_functions[] = {
    {"register_rows", (PyCFunction)(void (*)(void))gather_register_rows, METH_VARARGS | METH_KEYWORDS,
     register_rows_doc},
    {NULL, NULL, 0, NULL},
};

int pl_registration_init(PyObject *m, pl_state *st)
{
    st->Registration_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &reg_spec, NULL);
    if (!st->Registration_Type ||
        PyModule_AddObjectRef(m, "Registration", (PyObject *)st->Registration_Type) < 0)
        return -1;
    return PyModule_AddFunctions(m, registration_functions);
}
