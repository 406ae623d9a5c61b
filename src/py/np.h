/* NumPy C API, shared by several files: module.c imports it, the others use it. */
#ifndef PL_NP_H
#define PL_NP_H
#define PY_ARRAY_UNIQUE_SYMBOL pinloader_ARRAY_API
#ifndef PL_NP_IMPORT
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>
#endif
