/* pinloader._C.JpegDecoder (jpeg_decoder.c): the GPU image decoder's Python face. */
#ifndef PL_JPEG_DECODER_H
#define PL_JPEG_DECODER_H

#include "state.h"

int pl_jpeg_decoder_init(PyObject *m);
/* The test suite's probe (pinloader._C._testing.jpeg_decoder_stream): an open JpegDecoder's own
 * stream as an int, for a stream hold that keeps its kernels queued. */
PyObject *pl_jpeg_decoder_stream(PyObject *m, PyObject *decoder);

#endif
