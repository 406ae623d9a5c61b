/* The poll behind a backend's timed event wait (Note [expected waits] in backend_cuda.c). It
 * lives apart from the backends and from util.c so that tests/pool_expect_check.c runs this
 * very loop on a virtual clock, with pl_now_ns and pl_sleep_ns wrapped at link time. */
#include "backend.h"
#include "util.h"

enum { FIRST_NAP_NS = 10000, MAX_NAP_NS = 200000 };

int pl_event_poll(int (*query)(pl_event *), pl_event *e, int64_t timeout_ns, int64_t expect_ns)
{
    int64_t deadline = pl_now_ns() + timeout_ns;
    int64_t nap = expect_ns > 0 ? PL_MAX(FIRST_NAP_NS, expect_ns / 16) : FIRST_NAP_NS;
    /* told how long such waits take: sleep through 7/8 of it first */
    int64_t first = expect_ns > 0 ? expect_ns - expect_ns / 8 : 0;
    for (;;) {
        int rc = query(e);
        if (rc != PL_ERR_NOT_READY)
            return rc;
        int64_t left = deadline - pl_now_ns();
        if (left <= 0)
            return PL_ERR_TIMEOUT;
        if (first > 0) {
            pl_sleep_ns(PL_MIN(first, left));
            first = 0;
            continue;
        }
        pl_sleep_ns(PL_MIN(nap, left));
        nap = PL_MIN(nap * 2, MAX_NAP_NS);
    }
}
