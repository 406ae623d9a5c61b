/* AsyncPrefetcher (prefetcher.c, its batch queue in pf_producer.c). */
#ifndef PL_PREFETCHER_H
#define PL_PREFETCHER_H

#include "state.h"

int pl_prefetcher_init(PyObject *m, pl_state *st);
/* Close every live prefetcher (pinloader._C.shutdown(), at interpreter exit). */
void pl_prefetcher_shutdown_all(pl_state *st);
/* pinloader._C._testing.debug_signal_after_handout(signum): a test switch, Note [interrupted
 * handout] in pf_producer.c. */
PyObject *pl_pf_debug_signal_after_handout(PyObject *m, PyObject *arg);

#endif
