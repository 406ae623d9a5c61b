/* How many CPUs this process may use for staging: affinity, cgroup CPU quota, and the local
 * ranks sharing the host. No Python. */
#ifndef PL_CPUS_H
#define PL_CPUS_H

/* Staging threads beyond which host copy bandwidth stops growing: see Note [staging threads]. */
#define PL_STAGING_THREADS_MAX 32

typedef struct {
    int online;          /* CPUs online on the host */
    int affinity;        /* CPUs in this thread's affinity mask */
    double quota;        /* cgroup CPU quota in CPUs (quota / period), 0 when unlimited */
    int local_ranks;     /* LOCAL_WORLD_SIZE when set and valid, else 1 */
    int threads;         /* the default staging thread count derived from the above */
} pl_cpu_budget;

void pl_cpu_budget_read(pl_cpu_budget *out);
/* The default for AsyncPrefetcher(staging_threads=None): pl_cpu_budget_read(...).threads. */
int pl_default_staging_threads(void);

#endif
