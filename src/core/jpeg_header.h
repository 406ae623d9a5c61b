/* A JPEG's frame header read on the host: the image's size and components, for ImageLoader's
 * crop parameters (pinloader/_image_ops.py), without decoding. No Python. */
#ifndef PL_JPEG_HEADER_H
#define PL_JPEG_HEADER_H

#include <stddef.h>

/* Reads the first frame header (SOF0..SOF15, not DHT/JPG/DAC) of the n bytes at p. Returns 0 and
 * sets *h, *w, *c (height, width, components; h, w >= 1), or -1 when p is not a JPEG or no frame
 * header lies before the first scan or the end of the bytes. Never reads past p + n. */
int pl_jpeg_header(const unsigned char *p, size_t n, int *h, int *w, int *c);

/* 1 where the last bytes of the n at p hold an end-of-image marker (FF D9), else 0 (Note
 * [truncated JPEGs] in jpeg_header.c). */
int pl_jpeg_has_end_marker(const unsigned char *p, size_t n);

#endif
