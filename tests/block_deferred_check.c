/* Deferred frees (Note [deferred frees] in src/core/block.c), against a fake CUDA backend whose
 * events complete only when the test says so and whose device holds `capacity` bytes: a dropped
 * block's `done` is recorded on the release stream after its waits there; it is not freed until
 * `done` has completed, and then on the stream of the next copy-stream allocation, before that
 * allocation; its `done` is not recorded again before it is freed; at most 64 blocks wait, past
 * that the oldest is freed on the release stream; an allocation that runs out of memory waits
 * for the deferred blocks, frees them on its stream and succeeds, and one with nothing deferred
 * fails without waiting; an allocation on a consumer's stream (reuse_deferred 0) touches none,
 * and out of memory there fails without waiting; an evicted block's event is given back (the
 * events made stay flat over rounds of evictions).
 * Prints "bad=0" when every check holds. Built and run by tests/test_pool.py. */
#include "block.h"
#include "backend.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define COPY ((pl_stream *)(uintptr_t)0x100)
#define RELEASE ((pl_stream *)(uintptr_t)0x200)
#define USER ((pl_stream *)(uintptr_t)0x300)
enum { MAX_EVENTS = 1024, MAX_LOG = 4096 };

typedef struct {
    int done;
    void *guards; /* the deferred block whose free waits for this event, until it is freed */
} fake_event;

typedef struct {
    char what; /* 'a' alloc, 'f' free, 'w' stream waits on event, 'r' event recorded */
    void *ptr; /* the memory, or the event */
    pl_stream *stream;
} log_entry;

static fake_event *events[MAX_EVENTS];
static int n_events, syncs, bad;
static log_entry logs[MAX_LOG];
static int n_logs;
static size_t capacity = SIZE_MAX, held; /* device bytes allocated and not yet freed */

static void note(char what, void *ptr, pl_stream *s)
{
    if (n_logs < MAX_LOG)
        logs[n_logs++] = (log_entry){what, ptr, s};
}

static int f_get_device(int *d) { *d = 0; return PL_OK; }
static int f_set_device(int d) { (void)d; return PL_OK; }
static int f_stream_create(int hi, pl_stream **out) { (void)hi; *out = RELEASE; return PL_OK; }
static int f_stream_destroy(pl_stream *s) { (void)s; return PL_OK; }
static int f_stream_wait_event(pl_stream *s, pl_event *e) { note('w', e, s); return PL_OK; }
static int f_event_create(pl_event **out)
{
    if (n_events == MAX_EVENTS)
        return PL_ERR_NO_MEMORY;
    fake_event *e = calloc(1, sizeof *e);
    if (!e)
        return PL_ERR_NO_MEMORY;
    events[n_events++] = e;
    *out = (pl_event *)e;
    return PL_OK;
}
static int f_event_destroy(pl_event *e) { (void)e; return PL_OK; } /* freed at the end */
static int f_event_record(pl_event *e, pl_stream *s)
{
    fake_event *f = (fake_event *)e;
    if (f->guards) {
        bad++; /* recycled while a deferred block still waits for it */
        fprintf(stderr, "failed: an event recorded again before the block it guards was freed\n");
    }
    f->done = 0;
    note('r', e, s);
    return PL_OK;
}
static int f_event_query(pl_event *e) { return ((fake_event *)e)->done ? PL_OK : PL_ERR_NOT_READY; }
static int f_event_sync(pl_event *e) { syncs++; ((fake_event *)e)->done = 1; return PL_OK; }

typedef struct {
    size_t n;
    max_align_t align;
} fake_header;

static int f_device_alloc(int device, size_t n, pl_stream *s, void **out)
{
    (void)device;
    if (n > capacity - held)
        return PL_ERR_NO_MEMORY;
    fake_header *h = malloc(sizeof *h + n);
    if (!h)
        return PL_ERR_NO_MEMORY;
    h->n = n;
    held += n;
    *out = h + 1;
    note('a', *out, s);
    return PL_OK;
}
static int f_device_free(int device, void *p, pl_stream *s)
{
    (void)device;
    for (int i = 0; i < n_events; i++)
        if (events[i]->guards == p) {
            if (s != RELEASE && !events[i]->done) {
                bad++; /* only the release stream is ordered behind the uses */
                fprintf(stderr, "failed: freed on another stream before its uses completed\n");
            }
            events[i]->guards = NULL;
        }
    fake_header *h = (fake_header *)p - 1;
    held -= h->n;
    note('f', p, s);
    free(h);
    return PL_OK;
}

static void complete_all(void)
{
    for (int i = 0; i < n_events; i++)
        events[i]->done = 1;
}

static int count(char what, pl_stream *s, int from)
{
    int n = 0;
    for (int i = from; i < n_logs; i++)
        n += logs[i].what == what && logs[i].stream == s;
    return n;
}

#define CHECK(c) do { if (!(c)) { bad++; fprintf(stderr, "failed: %s (line %d)\n", #c, __LINE__); } } while (0)

static pl_block *alloc_block(const pl_backend *b, size_t n)
{
    pl_block *blk = NULL;
    CHECK(pl_block_create(b, 0, &blk) == PL_OK);
    if (blk)
        CHECK(pl_block_alloc(blk, n, COPY, 1) == PL_OK);
    return blk;
}

/* Drop the last reference: the release stream waits on the block's ready event, then records
 * `done` as its last operation, and nothing is freed; `done` then guards the memory. */
static void drop(pl_block *blk, int expect_evict)
{
    void *p = blk->ptr;
    pl_event *ready = blk->ready;
    int mark = n_logs, waited = 0, last_release = -1;
    pl_block_decref(blk);
    for (int i = mark; i < n_logs; i++) {
        if (logs[i].stream != RELEASE)
            continue;
        if (logs[i].what == 'w' && logs[i].ptr == (void *)ready)
            waited = i + 1;
        if (logs[i].what == 'r')
            last_release = i;
    }
    CHECK(waited > 0 && last_release > waited - 1);
    CHECK(count('f', COPY, mark) == 0 && count('f', RELEASE, mark) == expect_evict);
    if (last_release >= 0) {
        fake_event *done = (fake_event *)logs[last_release].ptr;
        CHECK(!done->guards);
        done->guards = p;
    }
}

/* drop() without counting evictions: the drop's `done` still guards its memory */
static void drop_any(pl_block *blk)
{
    void *p = blk->ptr;
    int mark = n_logs, last_release = -1;
    pl_block_decref(blk);
    for (int i = mark; i < n_logs; i++)
        if (logs[i].stream == RELEASE && logs[i].what == 'r')
            last_release = i;
    if (last_release >= 0)
        ((fake_event *)logs[last_release].ptr)->guards = p;
}

int main(void)
{
    pl_backend b;
    memset(&b, 0, sizeof b);
    b.name = "fake";
    b.kind = PL_BACKEND_CUDA; /* deferring is CUDA's; the host backend does not defer */
    b.get_device = f_get_device;
    b.set_device = f_set_device;
    b.stream_create = f_stream_create;
    b.stream_destroy = f_stream_destroy;
    b.stream_wait_event = f_stream_wait_event;
    b.event_create = f_event_create;
    b.event_destroy = f_event_destroy;
    b.event_record = f_event_record;
    b.event_query = f_event_query;
    b.event_synchronize = f_event_sync;
    b.device_alloc = f_device_alloc;
    b.device_free = f_device_free;

    /* a dropped block waits for its uses: nothing is freed while they are pending */
    pl_block *b1 = alloc_block(&b, 100);
    void *p1 = b1->ptr;
    drop(b1, 0);
    CHECK(count('f', COPY, 0) + count('f', RELEASE, 0) == 0);
    CHECK(pl_block_live_bytes(&b) == 0);
    pl_block *b2 = alloc_block(&b, 100);
    CHECK(count('f', COPY, 0) == 0 && held == 200);

    /* once they completed, the next allocation frees it on its own stream, before allocating */
    complete_all();
    int mark = n_logs;
    pl_block *b3 = alloc_block(&b, 100);
    CHECK(n_logs == mark + 2);
    CHECK(logs[mark].what == 'f' && logs[mark].ptr == p1 && logs[mark].stream == COPY);
    CHECK(logs[mark + 1].what == 'a' && logs[mark + 1].stream == COPY);
    CHECK(held == 200 && pl_block_live_bytes(&b) == 200);
    drop(b2, 0);
    drop(b3, 0);
    complete_all();

    /* at most 64 wait: dropping 70 whose uses never complete frees the 6 oldest on the release
     * stream (the two finished ones above are freed on the copy stream by the first allocation) */
    pl_block *many[70];
    mark = n_logs;
    for (int i = 0; i < 70; i++)
        many[i] = alloc_block(&b, 1000);
    CHECK(count('f', COPY, mark) == 2);
    void *first[6];
    for (int i = 0; i < 70; i++) {
        if (i < 6)
            first[i] = many[i]->ptr;
        drop(many[i], i >= 64);
    }
    CHECK(count('f', RELEASE, mark) == 6);
    for (int i = 0, k = 0; i < n_logs; i++)
        if (logs[i].what == 'f' && logs[i].stream == RELEASE)
            CHECK(k < 6 && logs[i].ptr == first[k++]); /* oldest first */
    CHECK(held == 64 * 1000 && pl_block_live_bytes(&b) == 0);

    /* out of memory with 64 deferred and pending: they are waited for, freed here, and the
     * allocation succeeds on the second try */
    capacity = held + 500;
    mark = n_logs;
    pl_block *big = alloc_block(&b, 2000);
    CHECK(syncs == 64);
    CHECK(count('f', COPY, mark) == 64 && count('a', COPY, mark) == 1);
    CHECK(big && big->ptr && held == 2000);

    /* out of memory with nothing deferred: an error, and no wait */
    capacity = held;
    pl_block *none = NULL;
    CHECK(pl_block_create(&b, 0, &none) == PL_OK);
    CHECK(pl_block_alloc(none, 10, COPY, 1) == PL_ERR_NO_MEMORY);
    CHECK(syncs == 64);
    pl_block_decref(none);

    /* an allocation on a consumer's stream neither frees deferred blocks there nor waits */
    capacity = SIZE_MAX;
    void *pbig = big->ptr;
    drop(big, 0);
    complete_all();
    pl_block *user = NULL;
    mark = n_logs;
    CHECK(pl_block_create(&b, 0, &user) == PL_OK);
    CHECK(pl_block_alloc(user, 10, USER, 0) == PL_OK);
    CHECK(count('f', USER, mark) == 0 && count('f', COPY, mark) == 0 && held == 2010);
    drop(user, 0);
    complete_all();
    pl_block *last = alloc_block(&b, 10); /* a copy-stream allocation frees both, oldest first */
    CHECK(count('f', COPY, mark) == 2 && held == 10);
    int first_free = mark;
    while (first_free < n_logs && logs[first_free].what != 'f')
        first_free++;
    CHECK(first_free < n_logs && logs[first_free].ptr == pbig);
    drop(last, 0);
    CHECK(pl_block_live_bytes(&b) == 0 && pl_block_live_count(&b) == 0);

    /* out of memory on a consumer's stream while blocks are deferred: an error there, without
     * a wait or a free (that stream may be capturing a CUDA graph) */
    pl_block *d1 = alloc_block(&b, 100);
    drop(d1, 0);
    capacity = held;
    int syncs_before = syncs;
    mark = n_logs;
    pl_block *u2 = NULL;
    CHECK(pl_block_create(&b, 0, &u2) == PL_OK);
    CHECK(u2 && pl_block_alloc(u2, 10, USER, 0) == PL_ERR_NO_MEMORY);
    CHECK(syncs == syncs_before && count('f', USER, mark) == 0 && count('f', COPY, mark) == 0);
    if (u2)
        pl_block_decref(u2);
    capacity = SIZE_MAX;
    complete_all();

    /* rounds of more drops than the list holds: each evicted block's done event goes back to
     * the device's events like every other, so the events made stay flat from round to round */
    int made[3];
    for (int round = 0; round < 3; round++) {
        pl_block *r[70];
        for (int i = 0; i < 70; i++)
            r[i] = alloc_block(&b, 10);
        for (int i = 0; i < 70; i++)
            drop_any(r[i]);
        complete_all();
        made[round] = n_events;
    }
    CHECK(made[2] == made[1]);
    pl_block *flush = alloc_block(&b, 10);
    drop_any(flush);

    for (int i = 0; i < n_events; i++)
        free(events[i]);
    printf("bad=%d\n", bad);
    return bad != 0;
}
