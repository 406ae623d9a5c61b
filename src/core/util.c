#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* pthread_setname_np */
#endif
#include "util.h"

#include "backend.h"
#include "numa.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

/* See Note [fork generations] in util.h. Written only by the child's atfork handler, which runs
 * while the child has a single thread. */
_Atomic uint32_t pl_process_generation = 0;

void pl_generation_bump_in_child(void)
{
    atomic_fetch_add_explicit(&pl_process_generation, 1, memory_order_relaxed);
}

void pl_mutex_reset_in_child(pthread_mutex_t *m)
{
    /* The holder, if any, was another thread of the parent: it does not exist here, so the
     * mutex is re-made unlocked rather than unlocked. */
    static const pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(m, &fresh, sizeof fresh);
}

int pl_cpu_count(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

void pl_sleep_ns(int64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

void pl_thread_name(const char *name)
{
#ifdef __linux__
    pthread_setname_np(pthread_self(), name); /* at most 15 characters */
#else
    (void)name;
#endif
}

int pl_cond_init(pthread_cond_t *c)
{
    pthread_condattr_t attr;
    int rc = pthread_condattr_init(&attr);
    if (rc == 0)
        rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    if (rc == 0)
        rc = pthread_cond_init(c, &attr);
    pthread_condattr_destroy(&attr);
    return rc;
}

size_t pl_page_size(void)
{
    long n = sysconf(_SC_PAGESIZE);
    return n > 0 ? (size_t)n : 4096;
}

size_t pl_physical_memory(void)
{
    long pages = sysconf(_SC_PHYS_PAGES);
    return pages > 0 ? pl_sat_mul((size_t)pages, pl_page_size()) : (size_t)8 << 30;
}

size_t pl_memlock_limit(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY)
        return SIZE_MAX;
    return (size_t)rl.rlim_cur;
}

_Atomic int pl_debug_state = -1;

/* Threads that come here at once all read the same variable and store the same answer. */
int pl_debug_read(void)
{
    const char *v = getenv("PINLOADER_DEBUG");
    int on = v && *v && strcmp(v, "0") != 0;
    atomic_store_explicit(&pl_debug_state, on, memory_order_relaxed);
    return on;
}

/* ---- prefaulting allocation ---- */

typedef struct {
    char *base;
    size_t len;
    size_t page;
} prefault_job;

static void *prefault_main(void *arg)
{
    prefault_job *job = arg;
    for (size_t off = 0; off < job->len; off += job->page)
        ((volatile char *)job->base)[off] = 0;
    return NULL;
}

int pl_os_alloc(size_t n, int numa_node, void **out)
{
    size_t page = pl_page_size();
    if (n == 0 || pl_align_up_checked(n, page, &n) != 0)
        return n ? PL_ERR_NO_MEMORY : PL_ERR_INVALID_VALUE;
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return PL_ERR_NO_MEMORY;
    /* Before the first touch, which places the pages (a refusal leaves them anywhere). */
    if (numa_node >= 0)
        (void)pl_numa_prefer(p, n, numa_node);
    /* Below a few MiB the threads cost more than the faults they share. */
    enum { MAX_THREADS = 8 };
    int nthreads = (int)PL_MIN((size_t)PL_MIN(pl_cpu_count(), MAX_THREADS), n / ((size_t)4 << 20));
    if (nthreads < 2) {
        prefault_job job = {p, n, page};
        prefault_main(&job);
    } else {
        pthread_t tids[MAX_THREADS];
        prefault_job jobs[MAX_THREADS];
        size_t per = PL_ALIGN_UP(n / (size_t)nthreads, page);
        int started = 0;
        for (int i = 0; i < nthreads; i++) {
            size_t off = (size_t)i * per;
            if (off >= n)
                break;
            jobs[i] = (prefault_job){(char *)p + off, PL_MIN(per, n - off), page};
            if (pthread_create(&tids[i], NULL, prefault_main, &jobs[i]) != 0)
                prefault_main(&jobs[i]);
            else
                started |= 1 << i;
        }
        for (int i = 0; i < nthreads; i++)
            if (started & (1 << i))
                pthread_join(tids[i], NULL);
    }
    *out = p;
    return PL_OK;
}

void pl_os_free(void *p, size_t n)
{
    if (p)
        munmap(p, PL_ALIGN_UP(n, pl_page_size()));
}

int pl_local_world_size(void)
{
    const char *v = getenv("LOCAL_WORLD_SIZE");
    if (!v)
        return 1;
    char *end = NULL;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (end == v || errno)
        return 1;
    while (*end == ' ' || *end == '\t' || *end == '\n')
        end++;
    if (*end || n < 1 || n > PL_LOCAL_RANKS_MAX)
        return 1;
    return (int)n;
}
