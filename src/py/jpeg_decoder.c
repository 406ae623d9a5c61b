/* pinloader._C.JpegDecoder: the GPU image decoder (src/core/jpeg_cuda.h) for ImageLoader.
 *
 *   dec = JpegDecoder(device, libraries=(), interpolate=True)
 *   image, status = dec.decode(base, offsets, lengths, params, size, scale, bias, dtype,
 *                              channels_last, raw=None)
 *
 * base: a C-contiguous buffer of encoded bytes; sample i is base[offsets[i]:offsets[i] +
 * lengths[i]] (int64 arrays); params: int32 (B, 9) per sample (Note [image resampling] in
 * jpeg_cuda.c); raw: {i: (h, w, 3) uint8 array} for samples the host decoded already. Returns a
 * DeviceArray (B, 3, H, W), or (B, H, W, 3) with channels_last, whose consumers wait on the
 * decode's ready event, and an int32 NumPy array of per-sample status (0 decoded; see the
 * PL_JPEG_* codes in jpeg_cuda.h). The decode runs without the GIL. */
#include "jpeg_decoder.h"

#include "device_array.h"
#include "dlpack.h"
#include "jpeg_cuda.h"
#include "np.h"
#include "util.h"

#include <string.h>

typedef struct {
    PyObject_HEAD
    pl_jpeg *j;            /* NULL once closed */
    const pl_backend *b;
    int device;
    uint32_t gen;          /* process generation it was made in */
    PyThread_type_lock lock; /* one decode at a time; taken without the GIL */
} JpegDecoderObject;

static void jd_close_impl(JpegDecoderObject *self)
{
    pl_jpeg *j = self->j;
    self->j = NULL;
    if (!j)
        return;
    if (pl_inherited(self->gen))
        return; /* the parent's GPU objects: never touched in a fork child */
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    pl_jpeg_destroy(j);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
}

static PyObject *jd_new(PyTypeObject *tp, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"device", "libraries", "interpolate", NULL};
    PyObject *device = Py_None, *libs = NULL;
    int interpolate = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|Op:JpegDecoder", kwlist, &device, &libs, &interpolate))
        return NULL;
    pl_state *st = pl_state_of_type(tp);
    const pl_backend *b;
    int dev;
    if (pl_resolve_device(st, device, &b, &dev) < 0)
        return NULL;
    if (b->kind != PL_BACKEND_CUDA) {
        PyErr_Format(PyExc_ValueError, "JpegDecoder decodes on a CUDA device; %R is the host backend",
                     device);
        return NULL;
    }
    PyObject *fast = NULL;
    const char **paths = NULL;
    Py_ssize_t n = 0;
    if (libs && libs != Py_None) {
        if (!(fast = PySequence_Fast(libs, "libraries must be a sequence of str")))
            return NULL;
        n = PySequence_Fast_GET_SIZE(fast);
        if (!(paths = PyMem_Calloc((size_t)n + 1, sizeof(char *)))) {
            Py_DECREF(fast);
            return PyErr_NoMemory();
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *o = PySequence_Fast_GET_ITEM(fast, i);
            if (!(paths[i] = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL)) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_TypeError, "libraries[%zd] must be a str, not %.100s", i,
                                 Py_TYPE(o)->tp_name);
                PyMem_Free(paths);
                Py_DECREF(fast);
                return NULL;
            }
        }
    }
    JpegDecoderObject *self = (JpegDecoderObject *)tp->tp_alloc(tp, 0);
    if (!self) {
        PyMem_Free(paths);
        Py_XDECREF(fast);
        return NULL;
    }
    self->b = b;
    self->device = dev;
    self->gen = pl_generation();
    if (!(self->lock = PyThread_allocate_lock())) {
        PyMem_Free(paths);
        Py_XDECREF(fast);
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    char why_buf[256];
    const char *why = "";
    int rc;
    pl_jpeg *j = NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = pl_jpeg_create(b, dev, paths, (int)n, interpolate, &j, why_buf, sizeof why_buf, &why);
    Py_END_ALLOW_THREADS
    PyMem_Free(paths);
    Py_XDECREF(fast);
    if (rc != PL_OK) {
        if (rc == PL_ERR_NO_RUNTIME)
            PyErr_Format(PyExc_RuntimeError, "JpegDecoder: %s", why);
        else
            pl_raise_backend(st, b, rc, why);
        Py_DECREF(self);
        return NULL;
    }
    self->j = j;
    return (PyObject *)self;
}

static void jd_dealloc(JpegDecoderObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    jd_close_impl(self);
    if (self->lock)
        PyThread_free_lock(self->lock);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *jd_close(JpegDecoderObject *self, PyObject *noargs)
{
    (void)noargs;
    jd_close_impl(self);
    Py_RETURN_NONE;
}

/* An int64 (or int32 for params) C-contiguous array of the given shape, or NULL with an error. */
static PyArrayObject *int_array(PyObject *o, int typenum, const char *name, npy_intp n, npy_intp cols)
{
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(o, typenum, 1, 2, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (!a)
        return NULL;
    int ok = cols ? PyArray_NDIM(a) == 2 && PyArray_DIM(a, 0) == n && PyArray_DIM(a, 1) == cols
                  : PyArray_NDIM(a) == 1 && PyArray_DIM(a, 0) == n;
    if (!ok) {
        if (cols)
            PyErr_Format(PyExc_ValueError, "decode: %s must have shape (%zd, %zd)", name, (Py_ssize_t)n,
                         (Py_ssize_t)cols);
        else
            PyErr_Format(PyExc_ValueError, "decode: %s must have shape (%zd,)", name, (Py_ssize_t)n);
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

static int parse_triple(PyObject *o, const char *name, float out[3])
{
    PyObject *fast = PySequence_Fast(o, "");
    if (!fast || PySequence_Fast_GET_SIZE(fast) != 3) {
        Py_XDECREF(fast);
        PyErr_Format(PyExc_ValueError, "decode: %s must be three numbers", name);
        return -1;
    }
    for (int i = 0; i < 3; i++) {
        double v = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1.0 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        out[i] = (float)v;
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *jd_decode(JpegDecoderObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"base", "offsets", "lengths", "params", "size", "scale", "bias",
                             "dtype", "channels_last", "raw", NULL};
    PyObject *base, *offsets_o, *lengths_o, *params_o, *scale_o, *bias_o, *raw = Py_None;
    int oh, ow, channels_last;
    const char *dtype_s;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO(ii)OOsp|O:decode", kwlist, &base, &offsets_o,
                                     &lengths_o, &params_o, &oh, &ow, &scale_o, &bias_o, &dtype_s,
                                     &channels_last, &raw))
        return NULL;
    pl_state *st = pl_state_of_type(Py_TYPE(self));
    if (!self->j) {
        PyErr_SetString(PyExc_ValueError, "decode: the JpegDecoder is closed");
        return NULL;
    }
    if (pl_inherited(self->gen))
        return pl_raise_forked("JpegDecoder.decode");
    if (oh <= 0 || ow <= 0 || oh > 16384 || ow > 16384) {
        PyErr_Format(PyExc_ValueError, "decode: size must be two ints in 1..16384, got (%d, %d)", oh, ow);
        return NULL;
    }
    int dtype;
    DLDataType dl;
    if (strcmp(dtype_s, "uint8") == 0) {
        dtype = PL_IMG_U8;
        dl = (DLDataType){kDLUInt, 8, 1};
    } else if (strcmp(dtype_s, "float32") == 0) {
        dtype = PL_IMG_F32;
        dl = (DLDataType){kDLFloat, 32, 1};
    } else if (strcmp(dtype_s, "float16") == 0) {
        dtype = PL_IMG_F16;
        dl = (DLDataType){kDLFloat, 16, 1};
    } else if (strcmp(dtype_s, "bfloat16") == 0) {
        dtype = PL_IMG_BF16;
        dl = (DLDataType){kDLBfloat, 16, 1};
    } else {
        PyErr_Format(PyExc_ValueError, "decode: dtype must be 'uint8', 'float32', 'float16' or "
                     "'bfloat16', got '%s'", dtype_s);
        return NULL;
    }
    pl_jpeg_out o = {.oh = oh, .ow = ow, .dtype = dtype, .channels_last = channels_last};
    if (parse_triple(scale_o, "scale", o.scale) < 0 || parse_triple(bias_o, "bias", o.bias) < 0)
        return NULL;
    if (raw != Py_None && !PyDict_Check(raw)) {
        PyErr_Format(PyExc_TypeError, "decode: raw must be a dict or None, not %.100s", Py_TYPE(raw)->tp_name);
        return NULL;
    }

    Py_buffer view;
    if (PyObject_GetBuffer(base, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyArrayObject *offsets = NULL, *lengths = NULL, *params = NULL, *status = NULL;
    PyObject *result = NULL, *rawrefs = NULL;
    pl_jpeg_item *items = NULL;
    pl_block *blk = NULL;
    PyArrayObject *tmp = (PyArrayObject *)PyArray_FROMANY(offsets_o, NPY_INT64, 1, 1, NPY_ARRAY_C_CONTIGUOUS);
    if (!tmp)
        goto error;
    npy_intp n = PyArray_DIM(tmp, 0);
    Py_DECREF(tmp);
    if (n <= 0 || n > 65535) {
        PyErr_Format(PyExc_ValueError, "decode: a batch holds 1 to 65535 samples, got %zd", (Py_ssize_t)n);
        goto error;
    }
    if (!(offsets = int_array(offsets_o, NPY_INT64, "offsets", n, 0)) ||
        !(lengths = int_array(lengths_o, NPY_INT64, "lengths", n, 0)) ||
        !(params = int_array(params_o, NPY_INT32, "params", n, 9)))
        goto error;
    if (!(items = PyMem_Calloc((size_t)n, sizeof *items)) || !(rawrefs = PyList_New(0))) {
        PyErr_NoMemory();
        goto error;
    }
    const int64_t *off = PyArray_DATA(offsets), *len = PyArray_DATA(lengths);
    const int32_t *par = PyArray_DATA(params);
    for (npy_intp i = 0; i < n; i++) {
        int64_t end;
        if (off[i] < 0 || len[i] < 0 || __builtin_add_overflow(off[i], len[i], &end) || end > (int64_t)view.len) {
            PyErr_Format(PyExc_ValueError, "decode: sample %zd: bytes [%lld, %lld + %lld) lie outside "
                         "base (%zd bytes)", (Py_ssize_t)i, (long long)off[i], (long long)off[i],
                         (long long)len[i], view.len);
            goto error;
        }
        items[i].data = (const unsigned char *)view.buf + off[i];
        items[i].len = (size_t)len[i];
        memcpy(items[i].p, par + 9 * i, sizeof items[i].p);
        if (items[i].p[8] != 0 && items[i].p[8] != 1) {
            PyErr_Format(PyExc_ValueError, "decode: params[%zd][8] (flip) must be 0 or 1", (Py_ssize_t)i);
            goto error;
        }
    }
    if (raw != Py_None) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(raw, &pos, &k, &v)) {
            Py_ssize_t i = PyLong_Check(k) ? PyLong_AsSsize_t(k) : -1;
            if (i == -1 && PyErr_Occurred())
                goto error;
            if (i < 0 || i >= n) {
                PyErr_Format(PyExc_ValueError, "decode: raw key %R is not a sample index in 0..%zd", k,
                             (Py_ssize_t)n - 1);
                goto error;
            }
            PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(v, NPY_UINT8, 3, 3, NPY_ARRAY_C_CONTIGUOUS);
            if (!a)
                goto error;
            if (PyList_Append(rawrefs, (PyObject *)a) < 0) {
                Py_DECREF(a);
                goto error;
            }
            Py_DECREF(a);
            if (PyArray_DIM(a, 2) != 3 || PyArray_DIM(a, 0) <= 0 || PyArray_DIM(a, 1) <= 0 ||
                PyArray_DIM(a, 0) > 65535 || PyArray_DIM(a, 1) > 65535) {
                PyErr_Format(PyExc_ValueError, "decode: raw[%zd] must be a (h, w, 3) uint8 image with "
                             "1 <= h, w <= 65535", i);
                goto error;
            }
            items[i].raw = PyArray_DATA(a);
            items[i].raw_h = (int)PyArray_DIM(a, 0);
            items[i].raw_w = (int)PyArray_DIM(a, 1);
        }
    }
    npy_intp sdim = n;
    if (!(status = (PyArrayObject *)PyArray_ZEROS(1, &sdim, NPY_INT32, 0)))
        goto error;
    int rc = pl_block_create(self->b, self->device, &blk);
    if (rc != PL_OK) {
        pl_raise_backend(st, self->b, rc, "decode: a device block");
        blk = NULL;
        goto error;
    }
    const char *why = "";
    int32_t *stat = PyArray_DATA(status);
    pl_jpeg *j = self->j;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    rc = self->j == j ? pl_jpeg_decode(j, (int)n, items, &o, blk, stat, &why) : PL_ERR_STOPPED;
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    if (rc == PL_ERR_STOPPED) {
        PyErr_SetString(PyExc_ValueError, "decode: the JpegDecoder was closed during the call");
        goto error;
    }
    if (rc != PL_OK) {
        pl_raise_backend(st, self->b, rc, why);
        goto error;
    }
    int64_t shape[4] = {n, 3, oh, ow};
    if (channels_last) {
        shape[1] = oh;
        shape[2] = ow;
        shape[3] = 3;
    }
    PyObject *arr = pl_device_array_new(st, blk, 0, 4, shape, dl, kDLCUDA, self->device);
    if (!arr)
        goto error;
    result = PyTuple_Pack(2, arr, (PyObject *)status);
    Py_DECREF(arr);
error:
    if (blk)
        pl_block_decref(blk);
    PyBuffer_Release(&view);
    Py_XDECREF(offsets);
    Py_XDECREF(lengths);
    Py_XDECREF(params);
    Py_XDECREF(status);
    Py_XDECREF(rawrefs);
    PyMem_Free(items);
    return result;
}

static PyObject *jd_info(JpegDecoderObject *self, PyObject *noargs)
{
    (void)noargs;
    if (!self->j) {
        PyErr_SetString(PyExc_ValueError, "info: the JpegDecoder is closed");
        return NULL;
    }
    pl_jpeg_counts c;
    pl_jpeg_get_counts(self->j, &c, pl_inherited(self->gen));
    return Py_BuildValue("{s:i,s:I,s:I,s:K,s:K,s:K,s:K,s:K,s:K,s:n,s:K,s:K,s:K,s:K,s:K,s:K,s:O}", "device",
                         self->device, "engines", c.engines, "cores_per_engine", c.cores_per_engine,
                         "batches", c.batches, "hardware", c.hardware, "roi", c.roi, "cuda", c.cuda, "raw",
                         c.raw, "failed", c.failed, "workspace_bytes", (Py_ssize_t)c.workspace_bytes,
                         "headers_ns", c.headers_ns, "engines_wait_ns", c.engines_wait_ns, "engines_ns",
                         c.engines_ns, "cuda_ns", c.cuda_ns, "block_ns", c.block_ns, "kernels_ns",
                         c.kernels_ns, "chroma_interpolated", c.chroma_interpolated ? Py_True : Py_False);
}

/* For ImageLoader's decoder threads (Note [decoder threads] in pinloader/_image_epochs.py):
 * pinloader's own threads that call CUDA ignore the stream captures other threads begin (Note
 * [the producer and graph captures] in pf_producer.c). Per thread, for good; cheap. */
static PyObject *jd_ignore_other_captures(JpegDecoderObject *self, PyObject *noargs)
{
    (void)noargs;
    if (!pl_inherited(self->gen)) /* a fork child: the parent's CUDA, never touched */
        (void)self->b->thread_ignore_other_captures();
    Py_RETURN_NONE;
}

static PyMethodDef jd_methods[] = {
    {"decode", (PyCFunction)(void (*)(void))jd_decode, METH_VARARGS | METH_KEYWORDS,
     "decode($self, /, base, offsets, lengths, params, size, scale, bias, dtype, channels_last, raw=None)\n"
     "--\n\nDecode a batch on the GPU: (DeviceArray, status)."},
    {"info", (PyCFunction)jd_info, METH_NOARGS, "info($self)\n--\n\nThe counts as of the end of the last decode call: batches, images per decoder "
     "(hardware, roi, cuda, raw, failed), the engines, the workspace, the calls' host time by step "
     "(headers_ns, engines_wait_ns, engines_ns, cuda_ns, block_ns, kernels_ns) and chroma_interpolated: "
     "src/core/jpeg_cuda.h."},
    {"close", (PyCFunction)jd_close, METH_NOARGS, "close($self)\n--\n\nFree the decoder's GPU resources (idempotent)."},
    {"ignore_other_captures", (PyCFunction)jd_ignore_other_captures, METH_NOARGS,
     "ignore_other_captures($self)\n--\n\nThe calling thread's CUDA calls ignore the stream captures other "
     "threads begin (cudaStreamCaptureModeThreadLocal), for good: for pinloader's own decoder threads."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot jd_slots[] = {
    {Py_tp_new, jd_new},
    {Py_tp_dealloc, jd_dealloc},
    {Py_tp_methods, jd_methods},
    {Py_tp_doc, "JpegDecoder(device, libraries=(), interpolate=True)\n--\n\nThe GPU JPEG decoder behind "
                "ImageLoader; interpolate: chroma upsampled as libjpeg-turbo does (Note [interpolated chroma] in "
                "src/core/nvjpeg_load.c)."},
    {0, NULL},
};

static PyType_Spec jd_spec = {
    .name = "pinloader._C.JpegDecoder",
    .basicsize = sizeof(JpegDecoderObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = jd_slots,
};

int pl_jpeg_decoder_init(PyObject *m)
{
    PyObject *tp = PyType_FromModuleAndSpec(m, &jd_spec, NULL);
    if (!tp)
        return -1;
    int r = PyModule_AddObjectRef(m, "JpegDecoder", tp);
    Py_DECREF(tp);
    return r;
}

PyObject *pl_jpeg_decoder_stream(PyObject *m, PyObject *decoder)
{
    (void)m;
    if (Py_TYPE(decoder)->tp_dealloc != (destructor)jd_dealloc) /* this module's JpegDecoder type */
        return PyErr_Format(PyExc_TypeError, "jpeg_decoder_stream: a JpegDecoder is needed, not %s",
                            Py_TYPE(decoder)->tp_name);
    JpegDecoderObject *self = (JpegDecoderObject *)decoder;
    if (!self->j || pl_inherited(self->gen)) {
        PyErr_SetString(PyExc_ValueError, "jpeg_decoder_stream: the JpegDecoder is closed");
        return NULL;
    }
    return PyLong_FromVoidPtr((void *)pl_jpeg_stream(self->j));
}
