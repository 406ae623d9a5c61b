/* pinloader._C._testing, the test switches and probes (testing.c, Note [the testing submodule]). */
#ifndef PL_TESTING_H
#define PL_TESTING_H

#include "state.h"

/* Make the submodule of module m, add it to m as _testing and to sys.modules. Needs
 * st->Prim_Type (pl_prim_init first). Returns 0, or -1 with an exception set. */
int pl_testing_init(PyObject *m, pl_state *st);

#endif
