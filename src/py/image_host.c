/* pinloader._C.jpeg_info and pinloader._C.read_files: the host work of ImageLoader
 * (pinloader/image_loader.py) that would otherwise cost Python per sample.
 *
 *   hwc = jpeg_info(base, offsets, lengths)
 *       int32 (n, 3): each sample's height, width and components from its JPEG frame header
 *       (src/core/jpeg_header.h), or -1s where there is none (not a JPEG, truncated). Sample i
 *       is base[offsets[i]:offsets[i] + lengths[i]]; one outside base is a ValueError.
 *   data, offsets, lengths, errors = read_files(paths, threads)
 *       The files' bytes, one after the other, in one uint8 array; errors: int32 per file, 0 or
 *       the errno of the open or read that failed (-1: not a regular file), its length then 0.
 *   region, starts = map_files(paths)
 *       The files mapped read-only one after the other into one range of addresses (Note [one
 *       region of files]): a read-only uint8 array over all of them, and where each begins.
 *
 * Note [file reader threads]
 * Each file is opened (O_NONBLOCK, so a FIFO under a dataset's name cannot block the open),
 * checked to be a regular file, read whole into a buffer of its own, and closed by one of up to
 * `threads` native threads taking files off a shared counter; then the buffers are copied into
 * the result, in order. No descriptor is held longer than one file's read, however many files a
 * batch has. The threads touch no Python object: paths are encoded with the GIL first, and the
 * errors become exceptions on the Python side. A file that grows while it is read is read to
 * the size it had when it was opened; one that shrinks, to its new end. */
#include "image_host.h"

#include "jpeg_header.h"
#include "tar_index.h"
#include "np.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- headers ---- */

/* o as a 1-d int64 array: integers only, cast safely (a float or a string, or a list of them,
 * is refused rather than converted; so is a uint64 beyond int64). */
static PyArrayObject *int64_vector(PyObject *o, const char *name)
{
    PyArrayObject *a = NULL, *raw = (PyArrayObject *)PyArray_FromAny(o, NULL, 1, 1, NPY_ARRAY_IN_ARRAY, NULL);
    npy_intp none = 0;
    if (raw && PyArray_SIZE(raw) == 0) /* [] is float64 to NumPy */
        a = (PyArrayObject *)PyArray_SimpleNew(1, &none, NPY_INT64);
    else if (raw && !PyArray_ISINTEGER(raw))
        PyErr_SetString(PyExc_TypeError, "not integers");
    else if (raw)
        a = (PyArrayObject *)PyArray_FROMANY((PyObject *)raw, NPY_INT64, 1, 1, NPY_ARRAY_IN_ARRAY);
    Py_XDECREF(raw);
    if (!a) {
        if (PyErr_ExceptionMatches(PyExc_ValueError) || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s must be a 1-d array of integers", name);
        }
    }
    return a;
}

static PyObject *ih_jpeg_info(PyObject *m, PyObject *args)
{
    (void)m;
    PyObject *base, *off_o, *len_o;
    if (!PyArg_ParseTuple(args, "OOO:jpeg_info", &base, &off_o, &len_o))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(base, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyArrayObject *off = NULL, *len = NULL, *out = NULL;
    if (!(off = int64_vector(off_o, "offsets")) || !(len = int64_vector(len_o, "lengths")))
        goto error;
    npy_intp n = PyArray_DIM(off, 0);
    if (PyArray_DIM(len, 0) != n) {
        PyErr_SetString(PyExc_ValueError, "jpeg_info: offsets and lengths differ in length");
        goto error;
    }
    const int64_t *o = PyArray_DATA(off), *l = PyArray_DATA(len);
    for (npy_intp i = 0; i < n; i++) {
        int64_t end;
        if (o[i] < 0 || l[i] < 0 || __builtin_add_overflow(o[i], l[i], &end) || end > (int64_t)view.len) {
            PyErr_Format(PyExc_ValueError, "jpeg_info: sample %zd: bytes [%lld, %lld + %lld) lie outside "
                         "base (%zd bytes)", (Py_ssize_t)i, (long long)o[i], (long long)o[i],
                         (long long)l[i], view.len);
            goto error;
        }
    }
    npy_intp dims[2] = {n, 3};
    if (!(out = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_INT32)))
        goto error;
    int32_t *r = PyArray_DATA(out);
    const unsigned char *p = view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (npy_intp i = 0; i < n; i++) {
        int h, w, c;
        if (pl_jpeg_header(p + o[i], (size_t)l[i], &h, &w, &c) == 0) {
            r[3 * i] = h;
            r[3 * i + 1] = w;
            r[3 * i + 2] = c;
        } else {
            r[3 * i] = r[3 * i + 1] = r[3 * i + 2] = -1;
        }
    }
    Py_END_ALLOW_THREADS
    Py_DECREF(off);
    Py_DECREF(len);
    PyBuffer_Release(&view);
    return (PyObject *)out;
error:
    Py_XDECREF(off);
    Py_XDECREF(len);
    PyBuffer_Release(&view);
    return NULL;
}

/* ---- files (Note [file reader threads]) ---- */

/* The paths as a tuple: a list could be changed under the loop that encodes them by a path's
 * own __fspath__ (user code), and the loop indexes it by the length it had first. */
static PyObject *paths_tuple(PyObject *o, const char *msg)
{
    PyObject *seq = PySequence_Fast(o, msg);
    if (!seq || PyTuple_CheckExact(seq))
        return seq;
    PyObject *t = PyList_AsTuple(seq);
    Py_DECREF(seq);
    return t;
}

typedef struct {
    const char **paths;
    size_t n;
    unsigned char **bufs; /* one per file, malloc'd by the reader (NULL: empty or failed) */
    size_t *sizes;
    int32_t *errs;
    size_t next;          /* the next file to take; atomic */
} read_job;

static void read_one(read_job *j, size_t k)
{
    int fd = open(j->paths[k], O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) {
        j->errs[k] = errno ? errno : EIO;
        return;
    }
    struct stat st;
    if (fstat(fd, &st) < 0) {
        j->errs[k] = errno ? errno : EIO;
        close(fd);
        return;
    }
    if (!S_ISREG(st.st_mode)) {
        j->errs[k] = -1;
        close(fd);
        return;
    }
    size_t want = (size_t)st.st_size, got = 0;
    unsigned char *buf = want ? malloc(want) : NULL;
    if (want && !buf) {
        j->errs[k] = ENOMEM;
        close(fd);
        return;
    }
    while (got < want) {
        ssize_t r = read(fd, buf + got, want - got);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            j->errs[k] = errno ? errno : EIO;
            free(buf);
            close(fd);
            return;
        }
        if (r == 0)
            break; /* shrank since the fstat: its new end */
        got += (size_t)r;
    }
    close(fd);
    j->bufs[k] = buf;
    j->sizes[k] = got;
}

static void *read_worker(void *arg)
{
    read_job *j = arg;
    for (;;) {
        size_t k = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (k >= j->n)
            return NULL;
        read_one(j, k);
    }
}

enum { MAX_READERS = 64 };

static PyObject *ih_read_files(PyObject *m, PyObject *args)
{
    (void)m;
    PyObject *paths_o;
    int threads;
    if (!PyArg_ParseTuple(args, "Oi:read_files", &paths_o, &threads))
        return NULL;
    if (threads < 1 || threads > MAX_READERS) {
        PyErr_Format(PyExc_ValueError, "read_files: threads must be in 1..%d, got %d", MAX_READERS, threads);
        return NULL;
    }
    PyObject *seq = paths_tuple(paths_o, "read_files: paths must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *encoded = PyList_New(n), *result = NULL;
    read_job j = {0};
    PyArrayObject *data = NULL, *offs = NULL, *lens = NULL, *errs = NULL;
    if (!encoded)
        goto done;
    j.n = (size_t)n;
    j.paths = PyMem_Calloc((size_t)n + 1, sizeof *j.paths);
    j.bufs = PyMem_Calloc((size_t)n + 1, sizeof *j.bufs);
    j.sizes = PyMem_Calloc((size_t)n + 1, sizeof *j.sizes);
    if (!j.paths || !j.bufs || !j.sizes) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = NULL;
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, i), &b))
            goto done;
        PyList_SET_ITEM(encoded, i, b);
        j.paths[i] = PyBytes_AS_STRING(b); /* FSConverter refuses embedded NUL bytes */
    }
    npy_intp dn = n;
    if (!(offs = (PyArrayObject *)PyArray_SimpleNew(1, &dn, NPY_INT64)) ||
        !(lens = (PyArrayObject *)PyArray_SimpleNew(1, &dn, NPY_INT64)) ||
        !(errs = (PyArrayObject *)PyArray_ZEROS(1, &dn, NPY_INT32, 0)))
        goto done;
    j.errs = PyArray_DATA(errs);
    Py_BEGIN_ALLOW_THREADS
    pthread_t tids[MAX_READERS];
    int started = 0;
    int want = threads < n ? threads : (int)n;
    for (int t = 1; t < want; t++) { /* the calling thread is the first reader */
        if (pthread_create(&tids[started], NULL, read_worker, &j) != 0)
            break; /* fewer threads: the others take more files */
        started++;
    }
    read_worker(&j);
    for (int t = 0; t < started; t++)
        pthread_join(tids[t], NULL);
    Py_END_ALLOW_THREADS
    size_t total = 0;
    int64_t *o = PyArray_DATA(offs), *l = PyArray_DATA(lens);
    for (Py_ssize_t i = 0; i < n; i++) {
        o[i] = (int64_t)total;
        l[i] = (int64_t)j.sizes[i];
        if (__builtin_add_overflow(total, j.sizes[i], &total) || total > (size_t)NPY_MAX_INTP) {
            PyErr_SetString(PyExc_OverflowError, "read_files: the files are larger than an array can hold");
            goto done;
        }
    }
    npy_intp dt = total ? (npy_intp)total : 1; /* a buffer to point into even when all are empty */
    if (!(data = (PyArrayObject *)PyArray_ZEROS(1, &dt, NPY_UINT8, 0)))
        goto done;
    unsigned char *dst = PyArray_DATA(data);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        if (j.sizes[i])
            memcpy(dst + o[i], j.bufs[i], j.sizes[i]);
    Py_END_ALLOW_THREADS
    result = PyTuple_Pack(4, data, offs, lens, errs);
done:
    if (j.bufs)
        for (size_t i = 0; i < j.n; i++)
            free(j.bufs[i]);
    PyMem_Free(j.paths);
    PyMem_Free(j.bufs);
    PyMem_Free(j.sizes);
    Py_XDECREF(data);
    Py_XDECREF(offs);
    Py_XDECREF(lens);
    Py_XDECREF(errs);
    Py_XDECREF(encoded);
    Py_DECREF(seq);
    return result;
}

/* ---- one region of files ---- */

/* Note [one region of files]
 * A batch of samples from many tar shards must be one buffer for the GPU decoder. Rather than
 * copy the samples, the shards are mapped next to each other: an address range for all of them
 * is reserved (PROT_NONE, anonymous, no memory behind it), and each file is mapped over its
 * part with MAP_FIXED, starting on a page boundary. Sample bytes are then ragged rows of one
 * array whose base unmaps the whole range when the last view of it goes. A file's last page is
 * mapped whole: the bytes past its end read as zeros, never as another file's. Only the files'
 * sizes when they were mapped are covered; the loader checks them before each batch is read
 * (a file cut short under a mapping would fault). */

typedef struct {
    void *addr;
    size_t len;
} map_region;

static const char REGION_CAPSULE[] = "pinloader.image_region";

static void region_free(PyObject *cap)
{
    map_region *r = PyCapsule_GetPointer(cap, REGION_CAPSULE);
    if (!r)
        return;
    munmap(r->addr, r->len);
    free(r);
}

static PyObject *ih_map_files(PyObject *m, PyObject *paths_o)
{
    (void)m;
    PyObject *seq = paths_tuple(paths_o, "map_files: paths must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *encoded = PyList_New(n), *result = NULL, *cap = NULL;
    PyArrayObject *arr = NULL, *starts = NULL;
    int *fds = NULL;
    size_t *sizes = NULL;
    map_region *r = NULL;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (!encoded)
        goto done;
    if (!(fds = PyMem_Malloc(((size_t)n + 1) * sizeof *fds)) ||
        !(sizes = PyMem_Calloc((size_t)n + 1, sizeof *sizes))) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        fds[i] = -1;
    npy_intp dn = n;
    if (!(starts = (PyArrayObject *)PyArray_ZEROS(1, &dn, NPY_INT64, 0)))
        goto done;
    int64_t *st = PyArray_DATA(starts);
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = NULL;
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, i), &b))
            goto done;
        PyList_SET_ITEM(encoded, i, b);
        const char *path = PyBytes_AS_STRING(b);
        int fd;
        struct stat sb;
        int err = 0;
        Py_BEGIN_ALLOW_THREADS
        fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
        if (fd < 0 || fstat(fd, &sb) < 0)
            err = errno ? errno : EIO;
        Py_END_ALLOW_THREADS
        fds[i] = fd;
        if (err) {
            errno = err;
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, PySequence_Fast_GET_ITEM(seq, i));
            goto done;
        }
        if (!S_ISREG(sb.st_mode)) {
            PyErr_Format(PyExc_OSError, "map_files: %s is not a regular file", path);
            goto done;
        }
        sizes[i] = (size_t)sb.st_size;
        st[i] = (int64_t)total;
        size_t pages = (sizes[i] + page - 1) / page * page;
        if (__builtin_add_overflow(total, pages, &total) || total > (size_t)NPY_MAX_INTP / 2) {
            PyErr_SetString(PyExc_OverflowError, "map_files: the files are larger than one mapping can hold");
            goto done;
        }
    }
    size_t len = total ? total : page; /* an empty region still has an address */
    if (!(r = malloc(sizeof *r))) {
        PyErr_NoMemory();
        goto done;
    }
    int err = 0;
    Py_ssize_t bad = -1;
    void *base;
    Py_BEGIN_ALLOW_THREADS
    base = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
        err = errno;
    } else {
        for (Py_ssize_t i = 0; i < n && !err; i++) {
            if (!sizes[i])
                continue;
            void *at = (char *)base + st[i];
            if (mmap(at, sizes[i], PROT_READ, MAP_SHARED | MAP_FIXED, fds[i], 0) == MAP_FAILED) {
                err = errno;
                bad = i;
            }
        }
        if (err)
            munmap(base, len);
    }
    Py_END_ALLOW_THREADS
    if (err) {
        free(r);
        r = NULL;
        errno = err;
        if (bad >= 0)
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, PySequence_Fast_GET_ITEM(seq, bad));
        else
            PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    r->addr = base;
    r->len = len;
    if (!(cap = PyCapsule_New(r, REGION_CAPSULE, region_free))) {
        munmap(base, len);
        free(r);
        goto done;
    }
    npy_intp dl = (npy_intp)total;
    if (!(arr = (PyArrayObject *)PyArray_New(&PyArray_Type, 1, &dl, NPY_UINT8, NULL, base, 0,
                                             NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED, NULL)))
        goto done;
    if (PyArray_SetBaseObject(arr, cap) < 0) { /* steals cap, also on failure */
        cap = NULL;
        goto done;
    }
    cap = NULL;
    result = PyTuple_Pack(2, arr, starts);
done:
    if (fds)
        for (Py_ssize_t i = 0; i < n; i++)
            if (fds[i] >= 0)
                close(fds[i]); /* a mapping keeps its file */
    PyMem_Free(fds);
    PyMem_Free(sizes);
    Py_XDECREF(cap);
    Py_XDECREF(arr);
    Py_XDECREF(starts);
    Py_XDECREF(encoded);
    Py_DECREF(seq);
    return result;
}

/* ---- tar shards ---- */

typedef struct {
    const unsigned char *p;
    char *names;        /* the names, one after the other */
    size_t names_len, names_cap;
    int64_t *cols;      /* per member: name end, data offset, size */
    size_t n, cap;
} tar_acc;

static int tar_add(void *ctx, const pl_tar_member *m)
{
    tar_acc *a = ctx;
    size_t need = (size_t)m->name_len + (m->prefix_len ? (size_t)m->prefix_len + 1 : 0);
    if (a->names_len + need > a->names_cap) {
        size_t cap = a->names_cap ? a->names_cap : 4096;
        while (cap < a->names_len + need)
            cap *= 2;
        char *q = realloc(a->names, cap);
        if (!q)
            return -1;
        a->names = q;
        a->names_cap = cap;
    }
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 1024;
        int64_t *q = realloc(a->cols, cap * 3 * sizeof *q);
        if (!q)
            return -1;
        a->cols = q;
        a->cap = cap;
    }
    if (m->prefix_len) {
        memcpy(a->names + a->names_len, a->p + m->prefix_off, (size_t)m->prefix_len);
        a->names_len += (size_t)m->prefix_len;
        a->names[a->names_len++] = '/';
    }
    if (m->name_len) /* an empty name (a header whose name field starts with NUL): names may be NULL */
        memcpy(a->names + a->names_len, a->p + m->name_off, (size_t)m->name_len);
    a->names_len += (size_t)m->name_len;
    a->cols[3 * a->n] = (int64_t)a->names_len;
    a->cols[3 * a->n + 1] = m->data_off;
    a->cols[3 * a->n + 2] = m->size;
    a->n++;
    return 0;
}

static PyObject *ih_tar_scan(PyObject *m, PyObject *arg)
{
    (void)m;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    tar_acc a = {.p = view.buf};
    const char *why = NULL;
    int64_t where = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pl_tar_scan(view.buf, (size_t)view.len, tar_add, &a, &why, &where);
    Py_END_ALLOW_THREADS
    PyObject *result = NULL, *names = NULL;
    PyArrayObject *cols = NULL;
    if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    if (rc > 0) {
        PyErr_Format(PyExc_ValueError, "tar_scan: at byte %lld: %s", (long long)where, why);
        goto done;
    }
    npy_intp dims[2] = {(npy_intp)a.n, 3};
    if (!(names = PyBytes_FromStringAndSize(a.names ? a.names : "", (Py_ssize_t)a.names_len)) ||
        !(cols = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_INT64)))
        goto done;
    if (a.n)
        memcpy(PyArray_DATA(cols), a.cols, a.n * 3 * sizeof(int64_t));
    result = PyTuple_Pack(2, names, cols);
done:
    Py_XDECREF(names);
    Py_XDECREF(cols);
    free(a.names);
    free(a.cols);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef image_host_methods[] = {
    {"jpeg_info", ih_jpeg_info, METH_VARARGS,
     "jpeg_info(base, offsets, lengths, /)\n--\n\nint32 (n, 3): each sample's JPEG height, width "
     "and components (-1s where there is no JPEG frame header)."},
    {"read_files", ih_read_files, METH_VARARGS,
     "read_files(paths, threads, /)\n--\n\n(data, offsets, lengths, errors): the files read by "
     "native threads into one uint8 array; errors int32 per file (0, an errno, or -1: not a "
     "regular file)."},
    {"tar_scan", ih_tar_scan, METH_O,
     "tar_scan(archive, /)\n--\n\n(names, members): a tar archive's regular files, in order: "
     "their names one after the other (bytes) and int64 (n, 3) rows of name end, data offset and "
     "size. A malformed archive is a ValueError naming the byte."},
    {"map_files", ih_map_files, METH_O,
     "map_files(paths, /)\n--\n\n(region, starts): the files mapped read-only one after the other "
     "into one range of addresses, as one read-only uint8 array, and where each begins."},
    {NULL, NULL, 0, NULL},
};

int pl_image_host_init(PyObject *m)
{
    return PyModule_AddFunctions(m, image_host_methods);
}
