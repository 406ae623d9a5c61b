/* The host backend's fault injector, a test switch: which backend call fails, and the counts of
 * the calls made (Note [injected faults]). The streams' workers (backend_host.c) read its state
 * through host_faults.h. */
#include "backend.h"
#include "host_faults.h"

atomic_int pl_fault_armed;
atomic_int pl_fault_delay;
pthread_mutex_t pl_fault_mu = PTHREAD_MUTEX_INITIALIZER;
atomic_int pl_fault_dead;
atomic_ullong pl_fault_epoch;
_Alignas(64) atomic_int pl_fault_ops_running;

/* Note [injected faults]
 * A test switch (pinloader._C._testing.host_fail_after): while armed, every call of the table's
 * functions that return a status (all but numa_node and the error names) is counted, and the
 * call numbered `fault_at` (from 0, counted since arming) returns an error instead of doing its
 * work, as would every later one if sticky (CUDA's sticky errors: after a failed launch or an
 * invalidated capture, every call in the process fails, frees and destroys included). Callers
 * see what a failing CUDA runtime gives them, so tests can sweep every failure point of a
 * scenario through the layers above the table (tests/test_host_faults.py). Allocations fail with
 * PL_ERR_NO_MEMORY, everything else with PL_ERR_UNKNOWN. A failed free or destroy leaks what it
 * would have released, as CUDA's do. Once a sticky failure has struck, the streams' workers run
 * none of the work still queued (a dead context runs nothing), so that what the layers above do
 * is tested against what a dead runtime does, not against an emulation that goes on copying
 * from memory they have given up. Two more rules make the emulation's own copies safe to free
 * under, as a dead context's are (the sanitizer jobs run the sweep):
 * - a sticky failure returns only after every operation a worker had already begun is done
 *   (pl_fault_ops_running; a wait or hold under way stops, woken by backend_host.c): a
 *   caller may free what a copy read the moment its call fails;
 * - disarming after a sticky failure begins a new lifetime (pl_fault_epoch), and what was queued
 *   in the dead one never runs, not even once the switch is off.
 * Arming, disarming and each failure's decision take pl_fault_mu, so a call racing a disarm
 * either fails before it or runs after it in the new lifetime (the sweep's leftover threads may
 * call the backend meanwhile).
 * While armed, every stream operation also starts late (FAULT_OP_DELAY_NS), so that a caller
 * that stops waiting for queued work too early (a failed wait proves nothing) is caught every
 * time rather than by a race; armed with n >= 2**62 the switch only counts (no call fails, no
 * operation starts late: tests/test_backend_calls.py counts a batch's calls so). Disarmed, each
 * call costs one relaxed atomic load, and each stream
 * operation a few atomic operations (nothing beside a copy). */
static atomic_llong fault_calls;    /* calls counted since arming */
static atomic_llong fault_at;       /* the number of the call that fails */
static atomic_int fault_sticky;     /* every call after it fails too */
static const char *_Atomic fault_first; /* the name of the first call failed since arming */

/* The calls counted since arming, by function (under pl_fault_mu): a test reads how many of each
 * call a steady-state batch makes. The names are the literals of backend_host.c's FAULTY list,
 * so one pointer a function. */
enum { FAULT_NAMES = 48 };
static struct {
    const char *name;
    long long n;
} fault_names[FAULT_NAMES];
static int n_fault_names;

static void count_call_locked(const char *name)
{
    for (int i = 0; i < n_fault_names; i++)
        if (fault_names[i].name == name) {
            fault_names[i].n++;
            return;
        }
    if (n_fault_names < FAULT_NAMES) {
        fault_names[n_fault_names].name = name;
        fault_names[n_fault_names++].n = 1;
    }
}

int pl_host_call_counts(const char **names, long long *counts, int cap)
{
    pthread_mutex_lock(&pl_fault_mu);
    int n = n_fault_names;
    for (int i = 0; i < n && i < cap; i++) {
        names[i] = fault_names[i].name;
        counts[i] = fault_names[i].n;
    }
    pthread_mutex_unlock(&pl_fault_mu);
    return n;
}

long long pl_fault_arm(long long n, int sticky, int *was_dead_out)
{
    pthread_mutex_lock(&pl_fault_mu);
    /* the new lifetime before the flag clears, and both before the switch goes off: a call that
     * finds the switch off (an acquire load) sees them, so no work of the dead lifetime is queued
     * as live, and none queued in it runs */
    int was_dead = atomic_load(&pl_fault_dead);
    if (was_dead)
        atomic_fetch_add(&pl_fault_epoch, 1);
    atomic_store(&pl_fault_dead, 0);
    atomic_store(&pl_fault_armed, 0);
    atomic_store(&pl_fault_delay, 0);
    long long counted = atomic_exchange(&fault_calls, 0);
    atomic_store(&fault_first, NULL);
    if (n >= 0)
        n_fault_names = 0; /* counted afresh; read after disarming */
    if (n >= 0) {
        atomic_store(&fault_at, n);
        atomic_store(&fault_sticky, sticky ? 1 : 0);
        atomic_store(&pl_fault_delay, n < (1LL << 62));
        atomic_store(&pl_fault_armed, 1);
    }
    pthread_mutex_unlock(&pl_fault_mu);
    *was_dead_out = was_dead;
    return counted;
}

const char *pl_host_first_failed(void)
{
    return atomic_load(&fault_first);
}

int pl_fault_decide(const char *name)
{
    pthread_mutex_lock(&pl_fault_mu);
    if (!atomic_load(&pl_fault_armed)) { /* disarmed since the caller looked */
        pthread_mutex_unlock(&pl_fault_mu);
        return 0;
    }
    long long i = atomic_fetch_add(&fault_calls, 1);
    count_call_locked(name);
    long long at = atomic_load(&fault_at);
    const int sticky = atomic_load(&fault_sticky);
    if (i != at && !(i > at && sticky)) {
        pthread_mutex_unlock(&pl_fault_mu);
        return 0;
    }
    if (sticky)
        atomic_store(&pl_fault_dead, 1);
    const char *none = NULL;
    atomic_compare_exchange_strong(&fault_first, &none, name);
    pthread_mutex_unlock(&pl_fault_mu);
    return sticky ? PL_FAULT_DEAD : PL_FAULT_FAIL;
}
