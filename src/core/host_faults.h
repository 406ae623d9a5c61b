/* The host backend's fault injector (Note [injected faults] in host_faults.c): the switch and
 * the runtime's life as the streams' workers of backend_host.c read them, and the decision a
 * backend call asks for while the switch is armed. Private to backend_host.c and host_faults.c;
 * the test switches themselves are declared in backend.h. */
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

/* Arm the switch (n >= 0: the call numbered n fails, and every later one if sticky) or disarm
 * it (n < 0); *was_dead: a sticky failure had struck (a new lifetime begins, and the streams'
 * waiters are to be woken). Returns the calls counted since the previous arming. */
long long pl_fault_arm(long long n, int sticky, int *was_dead);

/* The switch found armed: what the call `name` (a literal, counted by its pointer) does. */
enum { PL_FAULT_FAIL = 1, PL_FAULT_DEAD = 2 /* it fails, and the runtime dies with it */ };
int pl_fault_decide(const char *name);

#endif
