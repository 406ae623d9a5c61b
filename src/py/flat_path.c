/* Flatten's error helpers and leaf paths (Note [lazy paths] in flatten.h): the path of the leaf
 * being walked is kept as steps, recorded inline by the walk (flatten_impl.h), and rendered here
 * only for an error or a structure; a step whose text must be taken when walked is made here.
 * GIL held throughout. */
#include "flatten_impl.h"

#include "util.h"

#include <stdarg.h>
#include <string.h>

/* ---- error helpers ---- */

/* True when the pending exception is a BaseException that is not an Exception
 * (KeyboardInterrupt, SystemExit, GeneratorExit): it must propagate unchanged. */
int pl_fl_pending_is_base_only(void)
{
    return PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception);
}

/* str(o) (or repr) as UTF-8 into buf, lone surrogates and other unencodable characters escaped.
 * An Exception raised by __str__/__repr__ gives "?"; returns -1 only with a BaseException that is
 * not an Exception pending. */
int pl_fl_text_of(PyObject *o, int use_repr, char *buf, size_t n)
{
    snprintf(buf, n, "?");
    PyObject *s = use_repr ? PyObject_Repr(o) : PyObject_Str(o);
    PyObject *u = s ? PyUnicode_AsEncodedString(s, "utf-8", "backslashreplace") : NULL;
    Py_XDECREF(s);
    if (!u) {
        if (pl_fl_pending_is_base_only())
            return -1;
        PyErr_Clear();
        return 0;
    }
    snprintf(buf, n, "%s", PyBytes_AS_STRING(u));
    Py_DECREF(u);
    return 0;
}

/* ---- paths (Note [lazy paths] in flatten.h) ---- */

static void path_append(pl_flat *f, const char *fmt, ...)
{
    size_t old = f->path_len;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(f->path + old, sizeof f->path - old, fmt, ap);
    va_end(ap);
    if (n > 0)
        f->path_len = PL_MIN(sizeof f->path - 1, old + (size_t)n);
}

/* A step whose text is taken now: a key that is not an exact str or int, or a name that is
 * not an exact str ("[repr(key)]" for dict entries, ".name" for attributes; user code may run).
 * -1 with an exception: a BaseException from that code, or MemoryError. */
int pl_fl_path_push_taken(pl_flat *f, PyObject *key, int as_attr, size_t *mark)
{
    char text[160], step[164];
    if (pl_fl_text_of(key, !as_attr, text, sizeof text) < 0)
        return -1;
    snprintf(step, sizeof step, as_attr ? ".%s" : "[%s]", text);
    size_t len = strlen(step);
    char *copy = PyMem_RawMalloc(len + 1);
    if (!copy) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(copy, step, len + 1);
    pl_path_step *p = pl_fl_path_step(f, PATH_TEXT, mark);
    if (!p) {
        PyMem_RawFree(copy);
        return -1;
    }
    p->text = copy;
    return 0;
}

/* Render the path into f->path. A pending exception is kept. -1 only with a BaseException
 * that is not an Exception pending (text_of's rule); no exact str or int repr raises one. */
int pl_fl_path_render(pl_flat *f)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    f->path_len = 0;
    f->path[0] = 0;
    for (int i = 0; i < f->n_steps; i++) {
        const pl_path_step *p = &f->steps[i];
        char text[160];
        switch (p->kind) {
        case PATH_ROOT:
        case PATH_TEXT:
            path_append(f, "%s", p->text);
            break;
        case PATH_INDEX:
            path_append(f, "[%zd]", p->index);
            break;
        case PATH_KEY:
        case PATH_ATTR:
            if (pl_fl_text_of(p->obj, p->kind == PATH_KEY, text, sizeof text) < 0) {
                Py_XDECREF(type);
                Py_XDECREF(value);
                Py_XDECREF(tb);
                return -1;
            }
            path_append(f, p->kind == PATH_KEY ? "[%s]" : ".%s", text);
            break;
        }
    }
    PyErr_Restore(type, value, tb);
    return 0;
}

int pl_fl_leaf_error(pl_flat *f, PyObject *type, const char *fmt, ...)
{
    char why[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    if (pl_fl_path_render(f) < 0)
        return -1;
    PyErr_Format(type, "%s: %s", f->path, why);
    return -1;
}

void pl_shape_text(char *buf, size_t n, int ndim, const int64_t *shape)
{
    size_t len = (size_t)snprintf(buf, n, "(");
    for (int i = 0; i < ndim && len < n; i++)
        len += (size_t)snprintf(buf + len, n - len, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (len < n)
        snprintf(buf + len, n - len, ndim == 1 ? ",)" : ")");
}

