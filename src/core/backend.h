/* The primitive layer: streams, events, pinned host memory, stream-ordered device memory and
 * asynchronous copies, behind one table of functions with two implementations.
 *
 *   backend_cuda.c  the CUDA runtime, loaded with dlopen at first use, so that importing
 *                   pinloader works on a machine without a GPU, a driver or a toolkit.
 *   backend_host.c  a real emulation on the host: a stream is an ordered worker thread, an
 *                   event completes when its stream reaches it, "device" memory is host memory.
 *
 * Everything above this layer (the pinned pool, device blocks, the prefetcher) is written once
 * against it. Nothing here includes Python.h or touches Python objects; every function may be
 * called from any thread without the GIL.
 *
 * Return codes: 0 on success, otherwise the backend's error code. Both backends use the CUDA
 * runtime's numbering for the errors they share (so that one helper can name them), plus the
 * pinloader-only codes below (negative, never produced by CUDA). */
#ifndef PL_BACKEND_H
#define PL_BACKEND_H

#include <stddef.h>
#include <stdint.h>

enum {
    PL_OK = 0,
    PL_ERR_INVALID_VALUE = 1,      /* cudaErrorInvalidValue */
    PL_ERR_NO_MEMORY = 2,          /* cudaErrorMemoryAllocation */
    PL_ERR_UNLOADING = 4,          /* cudaErrorCudartUnloading */
    PL_ERR_INVALID_DEVICE = 101,   /* cudaErrorInvalidDevice */
    PL_ERR_NOT_READY = 600,        /* cudaErrorNotReady */
    PL_ERR_UNKNOWN = 999,          /* cudaErrorUnknown */
    PL_ERR_NO_RUNTIME = -1,        /* no usable CUDA runtime library could be loaded */
    PL_ERR_TIMEOUT = -2,           /* a bounded wait ran out */
    PL_ERR_STOPPED = -3,           /* a wait was abandoned because its owner is stopping */
    PL_ERR_FORKED = -4,            /* used in a child process after fork() */
    PL_ERR_OVER_CAP = -5,          /* a pinned request that can never fit under the pool's cap */
};

typedef struct pl_stream pl_stream; /* cudaStream_t for CUDA; a worker thread for the host */
typedef struct pl_gather_args pl_gather_args; /* devgather.h */
typedef struct pl_event pl_event;   /* cudaEvent_t for CUDA */

typedef enum { PL_BACKEND_HOST = 0, PL_BACKEND_CUDA = 1 } pl_backend_kind;

typedef struct pl_backend {
    const char *name;
    pl_backend_kind kind;

    /* Make `device` current for the calling thread (CUDA's per-thread current device). */
    int (*set_device)(int device);
    int (*get_device)(int *device);
    /* Let the calling thread's CUDA calls ignore stream captures begun by other threads
     * (cudaStreamCaptureModeThreadLocal; see Note [the producer and graph captures] in
     * pf_producer.c). Called once by each of pinloader's own threads that call CUDA. */
    int (*thread_ignore_other_captures)(void);
    /* Lift for the calling thread the ban that a capture in cudaStreamCaptureModeGlobal puts on
     * "potentially unsafe" calls (cudaStreamCaptureModeRelaxed); *saved gets the mode that
     * thread_restore_captures puts back. Use pl_captures_relax / pl_captures_restore. */
    int (*thread_relax_captures)(int *saved);
    void (*thread_restore_captures)(int saved);

    /* Streams are created on the calling thread's current device. high_priority selects the
     * greatest priority the device offers. */
    int (*stream_create)(int high_priority, pl_stream **out);
    int (*stream_destroy)(pl_stream *s);
    int (*stream_synchronize)(pl_stream *s);
    /* Work queued on s after this call starts only once e (as last recorded) has completed. */
    int (*stream_wait_event)(pl_stream *s, pl_event *e);

    int (*event_create)(pl_event **out);
    int (*event_destroy)(pl_event *e);
    int (*event_record)(pl_event *e, pl_stream *s);
    /* PL_OK if complete (or never recorded), PL_ERR_NOT_READY if not yet, else an error. */
    int (*event_query)(pl_event *e);
    int (*event_synchronize)(pl_event *e);
    /* Wait at most timeout_ns for e: PL_OK, PL_ERR_TIMEOUT, or an error. expect_ns > 0: how
     * long the caller expects e to take, which a backend that polls (CUDA has no timed event
     * wait) sleeps through before it polls (Note [expected waits] in backend_cuda.c); 0:
     * unknown. */
    int (*event_wait)(pl_event *e, int64_t timeout_ns, int64_t expect_ns);

    /* Page-locked host memory of at least n bytes, page aligned, prefaulted; numa_node >= 0:
     * preferably on that node (Note [slabs on the GPU's node] in numa.c). */
    int (*host_alloc)(size_t n, int numa_node, void **out);
    /* The NUMA node to put device's pinned slabs on, or -1 (one node, unknown, no device). */
    int (*numa_node)(int device);
    int (*host_free)(void *p, size_t n);
    /* *pinned = 1 if p lies in page-locked memory known to the runtime. */
    int (*host_is_pinned)(const void *p, int *pinned);

    /* Stream-ordered device memory from pinloader's own pool on `device`; memory freed on one
     * stream is reused on another only once the free has completed, so reuse never makes the
     * allocating stream wait on another stream. */
    int (*device_alloc)(int device, size_t n, pl_stream *s, void **out);
    int (*device_free)(int device, void *p, pl_stream *s);

    int (*memcpy_h2d_async)(void *dst, const void *src, size_t n, pl_stream *s);
    /* Device-to-device copy, and zeroing device memory, queued on s (static batches: Note
     * [static batches] in src/py/handout.c). The host backend with s == NULL (the CPU as the
     * consumer) does it at once. */
    int (*memcpy_d2d_async)(void *dst, const void *src, size_t n, pl_stream *s);
    int (*memzero_async)(void *dst, size_t n, pl_stream *s);
    /* Synchronous device-to-host copy (tests and debugging; never on a hot path). */
    int (*memcpy_d2h)(void *dst, const void *src, size_t n);

    /* Hold stream s (work queued after this call) until *gate becomes non-zero. A test facility
     * (cudaLaunchHostFunc on CUDA); never used on a data path. */
    int (*stream_hold)(pl_stream *s, volatile int *gate);

    /* ---- device gather (Note [device gather] in devgather.h) ---- */
    /* Page-lock [p, p + n) (page aligned) and map it for reads by every device; read-only
     * first if prefer_read_only (and `device` supports it), else only where nothing else
     * registers (*read_only says which). *dev: the address devices read p at. The host
     * backend pins nothing: *dev = p. */
    int (*host_register)(int device, void *p, size_t n, int prefer_read_only, void **dev, int *read_only);
    int (*host_unregister)(void *p);
    /* Whether [p, p + n) already lies in one page-locked range known to the runtime (pinned by
     * the user or another library): *dev its device address for p, else *dev = NULL. */
    int (*host_mapped)(const void *p, size_t n, void **dev);
    /* The address devices read p at, p in memory host_alloc made (mapped for every device:
     * Note [mapped tables] in transfer.c), or an error. The host backend: p itself. */
    int (*host_device_ptr)(void *p, void **dev);
    /* PL_OK when the gather kernel can run on `device` (loading it on first use), else an
     * error with *why, a static sentence, saying what is missing. */
    int (*gather_ready)(int device, const char **why);
    /* Queue one gather (devgather.h) on stream s. */
    int (*gather_launch)(const pl_gather_args *g, pl_stream *s);

    const char *(*error_name)(int code);
    const char *(*error_string)(int code);
} pl_backend;

/* The host backend: always available. */
const pl_backend *pl_backend_host(void);
/* Its process-wide state after fork(), in the atfork child handler (module.c). */
void pl_host_atfork_child(void);
/* Hold (1) or run (0) every host stream's queued work: a test switch, see Note [held copies]
 * in backend_host.c. */
void pl_host_hold_streams(int on);
/* Arm the host backend's fault injector (a test switch, Note [injected faults] in
 * host_faults.c): n >= 0 makes the call numbered n, counted from now, fail (and every later
 * one if sticky); n < 0 disarms. Returns the calls counted since the previous arming. */
long long pl_host_fail_after(long long n, int sticky);
/* The name of the first table function the injector failed since arming (e.g.
 * "event_record"), or NULL. */
const char *pl_host_first_failed(void);
/* Test probe: the calls counted since the switch was last armed, by function: up to cap (name,
 * count) pairs into names/counts; returns how many functions were called. */
int pl_host_call_counts(const char **names, long long *counts, int cap);

/* The CUDA backend. The first call loads the runtime (thread-safe, once); later calls return
 * the same answer. Returns NULL when CUDA is unusable and sets *err (and *detail, a static or
 * process-lifetime string) to say why. */
const pl_backend *pl_backend_cuda(int *err, const char **detail);
/* Wait at most timeout_ns (>= 0) for e by polling query(e) (poll.c): expect_ns > 0 sleeps
 * through 7/8 of it first and naps from 1/16 of it, else naps start at 10 us; naps double to
 * 0.2 ms (Note [expected waits] in backend_cuda.c). PL_OK, PL_ERR_TIMEOUT, or query's error. */
int pl_event_poll(int (*query)(pl_event *), pl_event *e, int64_t timeout_ns, int64_t expect_ns);

/* The most blocks one gather kernel launch uses on any device; 0 restores the default (16 per
 * multiprocessor). A benchmark switch (pinloader._C._testing.gather_grid): the previous value. */
unsigned pl_cuda_gather_grid(unsigned max_blocks);
/* The bytes the CUDA backend's device pool of `device` holds (Note [device pool] in
 * backend_cuda.c): in use and kept for reuse. */
int pl_cuda_device_pool_reserved(int device, size_t *out);
/* Candidate library paths tried after the ones found by the dynamic loader; call before the
 * first pl_backend_cuda(). The strings are copied. */
void pl_cuda_set_library_candidates(const char *const *paths, int n);
int pl_cuda_device_count(int *count);
/* The CUDA driver in this process, without initializing it (Note [hardware work queues] in
 * backend_cuda.c): no driver library, loaded (or loadable) but not initialized, initialized, or
 * another answer. */
enum { PL_DRIVER_ABSENT, PL_DRIVER_UNINITIALIZED, PL_DRIVER_INITIALIZED, PL_DRIVER_UNKNOWN };
int pl_cuda_driver_state(void);
/* Versions as CUDA encodes them (1000 * major + 10 * minor); 0 when unknown. */
void pl_cuda_versions(int *driver, int *runtime);
const char *pl_cuda_library_path(void);

/* Make `device` current on the calling thread for a moment (*prev: what was current, or -1),
 * and put it back with pl_device_pop: pinloader must not change the device the user's
 * framework works on, and the legacy and per-thread default streams are per device. */
int pl_device_push(const pl_backend *b, int device, int *prev);
void pl_device_pop(const pl_backend *b, int device, int prev);

/* Note [releases during a capture]
 * pinloader's objects are released on whatever thread drops the last reference: a batch's
 * device memory when its tensors die, a decoder, prefetcher, pool or registration when the
 * garbage collector finds it in a cycle. That thread may be capturing a CUDA graph (torch's
 * default mode is cudaStreamCaptureModeGlobal), or another thread may be: then a "potentially
 * unsafe" call of the release (a stream synchronize, an event query, cudaFreeHost) fails and
 * invalidates the user's graph, at a moment that depends on when the collector runs. So each
 * release lifts that ban for its own thread (cudaStreamCaptureModeRelaxed) and puts the
 * thread's mode back after. This is sound because a release touches only pinloader's own
 * streams, events and memory, none of which is part of a capture. It does not cover a tensor
 * imported inside the capture (its consumer stream is the capturing stream) and dropped there:
 * the use recorded on that stream joins pinloader's release stream to the capture, which then
 * fails to end, in every mode (pl_block_note_use in block.c). The
 * producer and decoder threads need no such bracket: they ignore other threads' captures for
 * good (Note [the producer and graph captures] in src/py/pf_producer.c).
 * Around such a release: pl_captures_relax returns what pl_captures_restore needs (-1:
 * nothing was changed; a backend table without the two calls, as the C tests' doubles, changes
 * nothing). Never in a fork child on the parent's objects. */
static inline int pl_captures_relax(const pl_backend *b)
{
    int saved = -1;
    if (!b || !b->thread_relax_captures || b->thread_relax_captures(&saved) != PL_OK)
        return -1;
    return saved;
}

static inline void pl_captures_restore(const pl_backend *b, int saved)
{
    if (b && saved >= 0 && b->thread_restore_captures)
        b->thread_restore_captures(saved);
}

/* Names for pinloader's own codes and the shared ones, for either backend; b == NULL names a
 * backend's code as the host backend does (backend.c). */
const char *pl_error_name(const pl_backend *b, int code);
const char *pl_error_string(const pl_backend *b, int code);

#endif
