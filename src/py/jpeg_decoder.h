/* pinloader._C.JpegDecoder (jpeg_decoder.c): the GPU image decoder's Python face. */
#ifndef PL_JPEG_DECODER_H
#define PL_JPEG_DECODER_H

#include "state.h"

int pl_jpeg_decoder_init(PyObject *m);

#endif
