/* The host backend's fault injector (Note [injected faults] in host_faults.c): the switch and
 * the runtime's life as the streams' workers of backend_host.c read them, and the check each
 * backend call makes. Private to backend_host.c and host_faults.c; the test switches themselves
 * are declared in backend.h. */
#ifndef PL_HOST_FAULTS_H
#define PL_HOST_FAULTS_H

#include <pthread.h>
#include <stdatomic.h>

/* The switch (armed to fail or to count) and whether a sticky failure has struck since arming. */
extern atomic_int pl_fault_armed;
extern atomic_int pl_fault_delay; /* armed to fail (not only to count): operations start late */
/* Arming, disarming and a failure's decision, one at a time (the armed path only): a call that
 * found the switch on decides under it whether the switch is still on. */
extern pthread_mutex_t pl_fault_mu;
extern atomic_int pl_fault_dead;
/* The runtime's lifetime: disarming after a sticky failure begins a new one, and an operation
 * queued in a lifetime that ended never runs (a dead context's queued work is gone for good). */
extern atomic_ullong pl_fault_epoch;
/* Operations the streams' workers have begun and not finished: a sticky failure returns only
 * once none is left that began before it. On a cache line of its own (host_faults.c): every
 * operation changes it, and every backend call reads pl_fault_armed. */
extern atomic_int pl_fault_ops_running;
/* While armed, each stream operation starts this late: work queued on a stream then plainly
 * outlives a caller that gave up waiting for it (a failed wait proves nothing). */
#define FAULT_OP_DELAY_NS 200000

/* The armed path of pl_fault_hit: 1 if the call `name` (a literal, counted by its pointer)
 * fails. */
int pl_fault_hit_armed(const char *name);

/* 1 if the backend call `name` is to fail (the switch armed and this call its target). */
static inline int pl_fault_hit(const char *name)
{
    /* acquire: a call that finds the switch off sees the lifetime pl_host_fail_after set */
    if (__builtin_expect(!atomic_load_explicit(&pl_fault_armed, memory_order_acquire), 1))
        return 0;
    return pl_fault_hit_armed(name);
}

/* backend_host.c: wake the streams' workers that wait for a record (the runtime they wait in
 * may have died). */
void pl_host_wake_waiters(void);

#endif
