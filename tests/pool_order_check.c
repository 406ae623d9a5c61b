/* The pool's pending releases (Note [slab reuse] in src/core/pool.c), against a fake backend
 * whose events complete only when the test says so: three regions are released after one
 * stream in turn, a fourth reservation must wait, and the first event it waits on must be the
 * first release's; polling asks one event per stream whose oldest release is not done, not one
 * per pending region. A client's waits tell the backend how long its previous waits for a
 * copy took (Note [expected waits] in src/core/backend_cuda.c), bounded by one polling slice.
 * Prints "bad=0" when every check holds. Built and run by tests/test_pool.py. */
#include "pool.h"
#include "backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    int id, done, recorded;
} fake_event;

static int n_events, waited_first = -1, bad, queries;
static int64_t last_expect = -1, wait_sleep_ns;

static int f_event_create(pl_event **out)
{
    fake_event *e = calloc(1, sizeof *e);
    if (!e)
        return PL_ERR_NO_MEMORY;
    e->id = n_events++;
    *out = (pl_event *)e;
    return PL_OK;
}
static int f_event_destroy(pl_event *e) { free(e); return PL_OK; }
static int f_event_record(pl_event *e, pl_stream *s) { (void)s; ((fake_event *)e)->recorded++; ((fake_event *)e)->done = 0; return PL_OK; }
static int f_event_query(pl_event *e)
{
    queries++;
    return ((fake_event *)e)->done ? PL_OK : PL_ERR_NOT_READY;
}
static int f_event_sync(pl_event *e) { ((fake_event *)e)->done = 1; return PL_OK; }
/* A wait completes the event it waits on: the copy it stands for finishes during the wait. */
static int f_event_wait(pl_event *e, int64_t timeout_ns, int64_t expect_ns)
{
    (void)timeout_ns;
    last_expect = expect_ns;
    if (wait_sleep_ns) {
        struct timespec ts = {0, (long)wait_sleep_ns};
        nanosleep(&ts, NULL);
    }
    if (waited_first < 0)
        waited_first = ((fake_event *)e)->id;
    ((fake_event *)e)->done = 1;
    return PL_OK;
}
static int f_host_alloc(size_t n, int node, void **out) { (void)node; *out = aligned_alloc(4096, (n + 4095) / 4096 * 4096); return *out ? PL_OK : PL_ERR_NO_MEMORY; }
static int f_host_free(void *p, size_t n) { (void)n; free(p); return PL_OK; }
static int f_numa(int device) { (void)device; return -1; }
static int f_sync(pl_stream *s) { (void)s; return PL_OK; }

#define CHECK(c) do { if (!(c)) { bad++; fprintf(stderr, "failed: %s (line %d)\n", #c, __LINE__); } } while (0)

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
    const size_t region = 1 << 20;
    pl_pool *p;
    CHECK(pl_pool_create(&b, 0, 3 * region, &p) == PL_OK);
    pl_region *r[4];
    for (int i = 0; i < 3; i++)
        CHECK(pl_pool_reserve(p, region, 0, NULL, &r[i]) == PL_OK);
    pl_stream *s = (pl_stream *)(uintptr_t)16;
    for (int i = 0; i < 3; i++)
        CHECK(pl_pool_release_after(p, r[i], s) == PL_OK);
    /* all three pending, the cap reached: this one waits, on the oldest release's event */
    CHECK(pl_pool_reserve(p, region, -1, NULL, &r[3]) == PL_OK);
    CHECK(waited_first >= 0);
    int first_event = waited_first;
    /* the events were taken in release order: the first release's is the lowest id made */
    CHECK(first_event == 0);
    /* the others are still pending, oldest first: polling frees nothing more */
    pl_pool_poll(p);
    pl_pool_stats st;
    pl_pool_get_stats(p, &st);
    CHECK(st.pending == 2);
    /* a second wait takes the next oldest */
    waited_first = -1;
    pl_region *r5;
    pl_pool_release(p, r[3]);
    CHECK(pl_pool_reserve(p, region, 0, NULL, &r5) == PL_OK); /* r[3]'s room, no wait */
    CHECK(waited_first == -1);
    pl_region *r6;
    CHECK(pl_pool_reserve(p, region, -1, NULL, &r6) == PL_OK);
    CHECK(waited_first == 1);
    pl_pool_release(p, r5);
    pl_pool_release(p, r6);

    /* polling: one query per stream until its oldest release is done */
    pl_pool *q;
    CHECK(pl_pool_create(&b, 0, 8 * region, &q) == PL_OK);
    pl_region *t[5];
    for (int i = 0; i < 5; i++)
        CHECK(pl_pool_reserve(q, region, 0, NULL, &t[i]) == PL_OK);
    for (int i = 0; i < 3; i++)
        CHECK(pl_pool_release_after(q, t[i], s) == PL_OK);
    pl_stream *s2 = (pl_stream *)(uintptr_t)32;
    CHECK(pl_pool_release_after(q, t[3], s2) == PL_OK);
    CHECK(pl_pool_release_after(q, t[4], s2) == PL_OK);
    queries = 0;
    pl_pool_poll(q);
    CHECK(queries == 2); /* s's oldest and s2's oldest */
    pl_pool_get_stats(q, &st);
    CHECK(st.pending == 5);
    /* s's first copy finishes: it is freed, its second is asked, the third is not */
    queries = 0;
    f_event_sync(t[0]->event); /* t[0] is pending: the pool keeps it, its event attached */
    pl_pool_poll(q);
    CHECK(queries == 3); /* t[0] (done), t[1] (not), t[3] (not) */
    pl_pool_get_stats(q, &st);
    CHECK(st.pending == 4);
    pl_pool_close(q); /* drains: every wait completes its event */
    pl_pool_decref(q);

    /* expected waits: a client's second wait for a copy is told how long its first took (each
     * fake wait lasts 2 ms: more than the bound, one 1 ms polling slice); waits outside a
     * client tell nothing */
    pl_pool *e;
    CHECK(pl_pool_create(&b, 0, 2 * region, &e) == PL_OK);
    pl_pool_client *c;
    CHECK(pl_pool_client_open(e, 2 * region, &c) == PL_OK);
    wait_sleep_ns = 2000000;
    pl_region *u[4];
    CHECK(pl_pool_reserve_for(e, c, region, 0, NULL, &u[0]) == PL_OK);
    CHECK(pl_pool_reserve_for(e, c, region, 0, NULL, &u[1]) == PL_OK);
    CHECK(pl_pool_release_after(e, u[0], s) == PL_OK);
    CHECK(pl_pool_release_after(e, u[1], s) == PL_OK);
    last_expect = -1;
    CHECK(pl_pool_reserve_for(e, c, region, -1, NULL, &u[2]) == PL_OK);
    CHECK(last_expect == 0); /* the client's first wait: nothing known */
    CHECK(pl_pool_release_after(e, u[2], s) == PL_OK);
    pl_pool_poll(e);
    last_expect = -1;
    CHECK(pl_pool_reserve_for(e, c, region, -1, NULL, &u[3]) == PL_OK);
    CHECK(last_expect == 1000000);
    CHECK(pl_pool_release_after(e, u[3], s) == PL_OK);
    pl_region *v;
    last_expect = -1;
    CHECK(pl_pool_reserve(e, region, -1, NULL, &v) == PL_OK); /* no client */
    CHECK(last_expect <= 0);
    pl_pool_release(e, v);
    wait_sleep_ns = 0;
    pl_pool_client_close(e, c);
    pl_pool_close(e);
    pl_pool_decref(e);
    pl_pool_close(p);
    pl_pool_decref(p);
    printf("bad=%d\n", bad);
    return bad != 0;
}
