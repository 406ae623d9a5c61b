/* Device blocks: one device allocation per batch, shared by the batch's device arrays and the
 * DLPack capsules exported from them, freed in stream order after the last use.
 * No Python: deleters call in from any thread, with or without the GIL, even at exit. */
#ifndef PL_BLOCK_H
#define PL_BLOCK_H

#include "backend.h"

#include <stdatomic.h>
#include <stddef.h>

typedef struct pl_block_use {
    pl_stream *stream;
    pl_event *event;
} pl_block_use;

/* A consumer stream already made to wait on the ready event, and how many live exports to it
 * rely on that wait. See Note [consumer waits] in block.c. */
typedef struct pl_block_waited {
    pl_stream *stream; /* NULL on the host backend: the consumer is the CPU */
    long live;
} pl_block_waited;

enum { PL_BLOCK_WAIT_MEMO = 4 };

typedef struct pl_block {
    atomic_long refcount;
    const pl_backend *b;
    int device;
    uint32_t gen;     /* process generation it was made in (Note [fork generations], util.h) */
    void *ptr;        /* device memory (NULL while size is 0 or not yet allocated) */
    size_t size;
    pl_event *ready;  /* recorded on the copy stream once the batch's copies are queued */
    int ready_recorded;
    int leak;         /* a consumer's use could not be ordered: never free (set by note_use) */
    int no_memo;      /* never skip a consumer wait (a static block: Note [static batches]) */
    /* Consumer streams that used the block, each with an event recorded when its last user on
     * that stream let go (see Note [device lifetime]); guarded by mu. */
    atomic_flag mu;
    pl_block_use *uses;
    int n_uses, cap_uses;
    /* Streams whose wait on ready is queued and relied on by live exports; guarded by mu. */
    pl_block_waited waited[PL_BLOCK_WAIT_MEMO];
} pl_block;

/* A block with a ready event, no memory yet; refcount 1. */
int pl_block_create(const pl_backend *b, int device, pl_block **out);
/* Allocate `size` bytes of device memory, ordered on stream s. reuse_deferred: s is a copy
 * stream of pinloader's own, never capturing, where finished deferred blocks are freed first
 * and an allocation out of memory may wait for the unfinished ones (Note [deferred frees]). */
int pl_block_alloc(pl_block *blk, size_t size, pl_stream *s, int reuse_deferred);
void pl_block_incref(pl_block *blk);
/* The last reference releases the memory behind the ready event and every use event, on
 * pinloader's release stream (Note [deferred frees] in block.c). */
void pl_block_decref(pl_block *blk);
/* A consumer on stream s is done enqueuing work that reads the block (called from DLPack
 * deleters, on any thread). s may be the legacy (1) or per-thread (2) default stream handle.
 * Makes the block's device current for the record and restores the caller's. */
int pl_block_note_use(pl_block *blk, pl_stream *s);
/* 1 in a fork() child for a block made before the fork: its memory, events and streams are the
 * parent's. Such a block is never waited on and never freed (leaked), and its users must refuse
 * to export it. */
int pl_block_inherited(const pl_block *blk);
/* The atfork child handler of this file's process-wide state (module.c installs it). */
void pl_block_atfork_child(void);
/* Make stream s wait until the block's data is ready. */
int pl_block_wait_ready(pl_block *blk, pl_stream *s);

/* The consumer side of an export; see Note [consumer waits] in block.c.
 * pl_block_consumer_memo: 1 if a live export already made s wait on the ready event; the
 *   caller then holds one count on that memo entry and skips the wait. 0 otherwise.
 * pl_block_consumer_wait: make consumer s wait. CUDA: s is a stream handle (1, the legacy
 *   default stream, and 2, the per-thread default stream, are taken on the block's device);
 *   queued with cudaStreamWaitEvent, the host does not block. Host backend: s is NULL and the
 *   calling thread blocks until the copy is done (see pl_block_consumer_wait_blocks). With
 *   memo non-NULL and success, *memo = 1 when s was recorded with one count held by the caller.
 * pl_block_consumer_done: give back a count taken by either (no Python: deleters call it);
 *   1 when it was the last count on that stream's entry (or there was none), else 0. */
int pl_block_consumer_memo(pl_block *blk, pl_stream *s);
int pl_block_consumer_wait(pl_block *blk, pl_stream *s, int *memo);
int pl_block_consumer_done(pl_block *blk, pl_stream *s);
/* Whether pl_block_consumer_wait would block the calling thread now (host backend, copy not
 * finished, block not inherited across fork): callers then wait for the ready event in slices
 * without the GIL first. A brief event query, never a wait. */
int pl_block_consumer_wait_blocks(pl_block *blk);
/* Process-wide counts of consumer waits issued and skipped thanks to the memo, per backend. */
void pl_block_consumer_counters(pl_backend_kind kind, unsigned long long *waits,
                                unsigned long long *skipped);
/* Block the calling thread until the data is ready (host backend consumers). */
int pl_block_sync_ready(pl_block *blk);

/* Per-device event cache shared by blocks; events are created once and reused. */
int pl_device_event_take(const pl_backend *b, int device, pl_event **out);
void pl_device_event_give(const pl_backend *b, int device, pl_event *e);

/* Live device bytes held by blocks, per backend, for stats and leak tests. */
size_t pl_block_live_bytes(const pl_backend *b);
long pl_block_live_count(const pl_backend *b);

#endif
