/* ImageLoader's host helpers (image_host.c): JPEG headers of many samples at once, and many files
 * read into one buffer by native threads. */
#ifndef PL_IMAGE_HOST_H
#define PL_IMAGE_HOST_H

#include "state.h"

int pl_image_host_init(PyObject *m);

#endif
