/* Small process-level helpers shared by every layer: OS memory, clocks, mutex wrappers. */
#ifndef PL_UTIL_H
#define PL_UTIL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#define PL_ALIGN 256u
#define PL_ALIGN_UP(x, a) (((x) + ((a) - 1)) & ~((size_t)(a) - 1))
#define PL_MIN(a, b) ((a) < (b) ? (a) : (b))
#define PL_MAX(a, b) ((a) > (b) ? (a) : (b))

/* Note [checked sizes]
 * Every size derived from a request (rounding, alignment, slab sizes, caps) is computed with
 * these: an overflow either saturates at SIZE_MAX (a cap: "no limit") or is reported (a size:
 * the caller fails cleanly), never wraps to a small number. PL_ALIGN_UP is only for values
 * already known to be far below SIZE_MAX. */
static inline size_t pl_sat_add(size_t a, size_t b)
{
    size_t r;
    return __builtin_add_overflow(a, b, &r) ? SIZE_MAX : r;
}
static inline size_t pl_sat_mul(size_t a, size_t b)
{
    size_t r;
    return __builtin_mul_overflow(a, b, &r) ? SIZE_MAX : r;
}
/* *out = n rounded up to a multiple of a (a power of two); returns -1 (and leaves *out) on
 * overflow. */
static inline int pl_align_up_checked(size_t n, size_t a, size_t *out)
{
    size_t r;
    if (__builtin_add_overflow(n, a - 1, &r))
        return -1;
    *out = r & ~(a - 1);
    return 0;
}

/* Anonymous page-aligned memory with every page touched by several threads, so that pinning
 * it (cudaHostRegister) or first use does not fault page by page on one core. */
int pl_os_alloc(size_t n, int numa_node, void **out);
void pl_os_free(void *p, size_t n);
size_t pl_page_size(void);
/* Physical memory and RLIMIT_MEMLOCK in bytes (SIZE_MAX when unlimited). */
size_t pl_physical_memory(void);
size_t pl_memlock_limit(void);

/* CPUs online; a sleep of ns (retried on EINTR). */
int pl_cpu_count(void);
void pl_sleep_ns(int64_t ns);

/* CLOCK_MONOTONIC now, in nanoseconds; inline, like the other helpers every batch reads (the
 * fork generation, debug mode, pl_deadline). A C test program that runs the pool on a virtual
 * clock (tests/pool_expect_check.c) is built with PL_EXTERN_CLOCK and defines it. */
#ifdef PL_EXTERN_CLOCK
int64_t pl_now_ns(void);
#else
static inline int64_t pl_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
#endif
/* Name the calling thread ("pl-producer", seen in top -H, py-spy, gdb); best effort. */
void pl_thread_name(const char *name);

/* Absolute CLOCK_MONOTONIC deadline `ns` (>= 0) from now, for pthread_cond_timedwait on a
 * condvar initialised with pl_cond_init. */
static inline void pl_deadline(struct timespec *ts, int64_t ns)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    int64_t nsec = ts->tv_nsec + ns % 1000000000;
    ts->tv_sec += (time_t)(ns / 1000000000 + nsec / 1000000000);
    ts->tv_nsec = (long)(nsec % 1000000000);
}
int pl_cond_init(pthread_cond_t *c);

/* Note [fork generations]
 * Every fork() child increments the process generation (a pthread_atfork child handler
 * installed at module init). An object records the generation it was created in; in a child it
 * finds pl_inherited(gen) true and must neither touch its mutexes (another thread of the parent
 * may have held them at fork time), nor its threads (they do not exist in the child), nor its
 * CUDA state: it fails fast with PL_ERR_FORKED. Objects created in the child work as usual. */
extern _Atomic uint32_t pl_process_generation; /* util.c; written by the child's handler only */
static inline uint32_t pl_generation(void)
{
    return atomic_load_explicit(&pl_process_generation, memory_order_relaxed);
}
static inline int pl_inherited(uint32_t gen) { return gen != pl_generation(); }
void pl_generation_bump_in_child(void); /* the atfork child handler */
/* In the atfork child handler only (one thread): make a process-wide mutex usable again,
 * whoever held it at fork time. */
void pl_mutex_reset_in_child(pthread_mutex_t *m);

/* The local ranks sharing this host: LOCAL_WORLD_SIZE (set by torchrun), read at each call.
 * A decimal integer from 1 to PL_LOCAL_RANKS_MAX, surrounding blanks allowed; anything else
 * (unset, empty, 0, negative, too large, trailing text) counts as 1. The one reading for every
 * layer that divides a per-host resource among the ranks (the default pool's cap in
 * pool_default.c, the staging threads in cpus.c). */
#define PL_LOCAL_RANKS_MAX 65536
int pl_local_world_size(void);

/* Debug mode (PINLOADER_DEBUG=1): invariant checks with canaries; the variable is read once,
 * by the first call (pl_debug_read), and the answer kept in pl_debug_state (-1 before). */
extern _Atomic int pl_debug_state;
int pl_debug_read(void);
static inline int pl_debug_enabled(void)
{
    int on = atomic_load_explicit(&pl_debug_state, memory_order_relaxed);
    return on >= 0 ? on : pl_debug_read();
}

#endif
