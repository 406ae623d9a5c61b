/* Small process-level helpers shared by every layer: OS memory, clocks, mutex wrappers. */
#ifndef PL_UTIL_H
#define PL_UTIL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define PL_ALIGN 256u
#define PL_ALIGN_UP(x, a) (((x) + ((a) - 1)) & ~((size_t)(a) - 1))
#define PL_MIN(a, b) ((a) < (b) ? (a) : (b))
#define PL_MAX(a, b) ((a) > (b) ? (a) : (b))

/* Anonymous page-aligned memory with every page touched by several threads, so that pinning
 * it (cudaHostRegister) or first use does not fault page by page on one core. */
int pl_os_alloc(size_t n, void **out);
void pl_os_free(void *p, size_t n);
size_t pl_page_size(void);
/* Physical memory and RLIMIT_MEMLOCK in bytes (SIZE_MAX when unlimited). */
size_t pl_physical_memory(void);
size_t pl_memlock_limit(void);

/* Absolute CLOCK_MONOTONIC deadline `ns` from now, for pthread_cond_timedwait on a condvar
 * initialised with pl_cond_init. */
void pl_deadline(struct timespec *ts, int64_t ns);
int pl_cond_init(pthread_cond_t *c);

/* Note [fork generations]
 * Every fork() child increments the process generation (a pthread_atfork child handler
 * installed at module init). An object records the generation it was created in; in a child it
 * finds pl_inherited(gen) true and must neither touch its mutexes (another thread of the parent
 * may have held them at fork time), nor its threads (they do not exist in the child), nor its
 * CUDA state: it fails fast with PL_ERR_FORKED. Objects created in the child work as usual. */
uint32_t pl_generation(void);
static inline int pl_inherited(uint32_t gen) { return gen != pl_generation(); }
void pl_generation_bump_in_child(void); /* the atfork child handler */

/* Debug mode (PINLOADER_DEBUG=1): invariant checks with canaries; read once. */
int pl_debug_enabled(void);

#endif
