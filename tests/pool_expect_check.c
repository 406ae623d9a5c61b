/* Note [expected waits] in src/core/backend_cuda.c, on a virtual clock: the pool's clock and
 * its sleeps (pl_now_ns, defined here for a build with PL_EXTERN_CLOCK, and pl_sleep_ns, wrapped
 * at link time) are one counter, so every wait below lasts exactly as long as the model says and
 * the checks are exact. The fake
 * event_wait is the CUDA backend's: pl_event_poll (src/core/poll.c; a first sleep of 7/8 of the
 * expected wait, then naps from 1/16 of it, doubling to 0.2 ms); every sleep overruns by the
 * kernel's default timer slack, 50 us.
 * A wait the pool measures includes the poller's own sleep, so an average of told waits climbs
 * (to 8x the overrun for copies of 50 us, against a 60 us poll): the expectations must come
 * from untold waits only, short ones must not be told at all, and one stall must be forgotten.
 * Prints "bad=0" when every check holds. Built and run by tests/test_pool.py. */
#include "pool.h"
#include "backend.h"
#include "util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SLACK_NS 50000

static int64_t vnow = 1000000000, copy_ns, last_expect;
static int bad, queries;

int64_t pl_now_ns(void) { return vnow; } /* built with PL_EXTERN_CLOCK (util.h) */
void __wrap_pl_sleep_ns(int64_t ns);
void __wrap_pl_sleep_ns(int64_t ns) { vnow += ns + SLACK_NS; }

typedef struct {
    int64_t done_at;
} fake_event;

static int f_event_create(pl_event **out)
{
    fake_event *e = calloc(1, sizeof *e);
    *out = (pl_event *)e;
    return e ? PL_OK : PL_ERR_NO_MEMORY;
}
static int f_event_destroy(pl_event *e) { free(e); return PL_OK; }
static int f_event_record(pl_event *e, pl_stream *s) { (void)s; ((fake_event *)e)->done_at = vnow + copy_ns; return PL_OK; }
static int f_event_query(pl_event *e)
{
    queries++;
    return vnow >= ((fake_event *)e)->done_at ? PL_OK : PL_ERR_NOT_READY;
}
static int f_event_sync(pl_event *e)
{
    if (vnow < ((fake_event *)e)->done_at)
        vnow = ((fake_event *)e)->done_at;
    return PL_OK;
}
/* cuda_event_wait (src/core/backend_cuda.c): pl_event_poll (src/core/poll.c) on the virtual
 * clock; ignore: the polling from before Note [expected waits], whatever the pool says */
static int ignore;
static int f_event_wait(pl_event *e, int64_t timeout_ns, int64_t expect_ns)
{
    last_expect = expect_ns;
    if (ignore)
        expect_ns = 0;
    if (timeout_ns < 0)
        return f_event_sync(e);
    return pl_event_poll(f_event_query, e, timeout_ns, expect_ns);
}
static int f_host_alloc(size_t n, int node, void **out) { (void)node; *out = aligned_alloc(4096, (n + 4095) / 4096 * 4096); return *out ? PL_OK : PL_ERR_NO_MEMORY; }
static int f_host_free(void *p, size_t n) { (void)n; free(p); return PL_OK; }
static int f_numa(int device) { (void)device; return -1; }
static int f_sync(pl_stream *s) { (void)s; return PL_OK; }

#define CHECK(c) do { if (!(c)) { bad++; fprintf(stderr, "failed: %s (line %d)\n", #c, __LINE__); } } while (0)

typedef struct {
    int64_t wait_ns; /* the mean wait over the tail */
    int64_t told_ns; /* the largest expectation told over the tail */
    double queries;  /* event queries per wait over the tail */
} tail_stats;

/* A fresh client of one region waits 200 times for the previous copy (the first lasts first_ns
 * when that is set, every other copy_ns); the last 50 waits are summed up. */
static tail_stats waits_of(pl_pool *p, pl_stream *s, int64_t copy, int64_t first_ns)
{
    const size_t region = 1 << 20;
    const int n = 200, tail = 50;
    tail_stats t = {0, 0, 0};
    pl_pool_client *c;
    pl_region *r;
    CHECK(pl_pool_client_open(p, region, &c) == PL_OK);
    CHECK(pl_pool_reserve_for(p, c, region, -1, NULL, &r) == PL_OK);
    for (int i = -1; i < n; i++) {
        copy_ns = i < 0 && first_ns ? first_ns : copy;
        CHECK(pl_pool_release_after(p, r, s) == PL_OK);
        int64_t t0 = vnow;
        int q0 = queries;
        last_expect = -1;
        CHECK(pl_pool_reserve_for(p, c, region, -1, NULL, &r) == PL_OK);
        CHECK(vnow - t0 >= copy_ns); /* it waited for the copy */
        if (i >= n - tail) {
            t.wait_ns += vnow - t0;
            t.queries += queries - q0;
            t.told_ns = PL_MAX(t.told_ns, last_expect);
        }
    }
    pl_pool_release(p, r);
    pl_pool_client_close(p, c);
    t.wait_ns /= tail;
    t.queries /= tail;
    return t;
}

static void show(const char *what, tail_stats t)
{
    fprintf(stderr, "%-34s wait %5lld us, told %5lld us, %.2f queries per wait\n", what,
            (long long)(t.wait_ns / 1000), (long long)(t.told_ns / 1000), t.queries);
}

int main(void)
{
    pl_backend b;
    memset(&b, 0, sizeof b);
    b.name = "fake";
    b.kind = PL_BACKEND_HOST;
    b.event_create = f_event_create;
    b.event_destroy = f_event_destroy;
    b.event_record = f_event_record;
    b.event_query = f_event_query;
    b.event_synchronize = f_event_sync;
    b.event_wait = f_event_wait;
    b.host_alloc = f_host_alloc;
    b.host_free = f_host_free;
    b.numa_node = f_numa;
    b.stream_synchronize = f_sync;
    pl_stream *s = (pl_stream *)(uintptr_t)16;
    pl_pool *p;
    CHECK(pl_pool_create(&b, 0, 4 << 20, &p) == PL_OK);

    /* short copies (50 us): polling notices them in one 60 us nap; nothing is told */
    ignore = 1;
    tail_stats plain = waits_of(p, s, 50000, 0);
    ignore = 0;
    tail_stats told = waits_of(p, s, 50000, 0);
    tail_stats stalled = waits_of(p, s, 50000, 5000000); /* after one 5 ms copy */
    show("50 us copies, polling:", plain);
    show("50 us copies, told:", told);
    show("50 us copies after a stall, told:", stalled);
    CHECK(told.told_ns == 0 && told.wait_ns == plain.wait_ns);
    CHECK(stalled.told_ns == 0 && stalled.wait_ns == plain.wait_ns);

    /* long copies (700 us): told, the waits take fewer wake-ups and no longer */
    ignore = 1;
    plain = waits_of(p, s, 700000, 0);
    ignore = 0;
    told = waits_of(p, s, 700000, 0);
    show("700 us copies, polling:", plain);
    show("700 us copies, told:", told);
    CHECK(told.told_ns >= 700000 && told.told_ns <= plain.wait_ns);
    CHECK(told.queries < plain.queries * 2 / 3); /* the pool polls its pending releases too */
    CHECK(told.wait_ns <= plain.wait_ns);

    pl_pool_close(p);
    pl_pool_decref(p);
    printf("bad=%d\n", bad);
    return bad != 0;
}
