/* pinloader._C._Prim: the backend primitives, one method each, for the tests (prim.c). */
#ifndef PL_PRIM_H
#define PL_PRIM_H

#include "state.h"

int pl_prim_init(PyObject *m, pl_state *st);

#endif
