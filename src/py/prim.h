/* pinloader._C._testing.Prim: the backend primitives, one method each, for the tests (prim.c). */
#ifndef PL_PRIM_H
#define PL_PRIM_H

#include "state.h"

/* Make the type into st->Prim_Type; pl_testing_init lists it. */
int pl_prim_init(PyObject *m, pl_state *st);

#endif
