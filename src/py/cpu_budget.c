/* pinloader._C.default_staging_threads() and cpu_budget(): the Python face of the CPU budget
 * (Note [staging threads] in src/core/cpus.c). */
#include "cpu_budget.h"

#include "cpus.h"

static PyObject *default_staging_threads(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    (void)m;
    int n;
    Py_BEGIN_ALLOW_THREADS /* file reads */
    n = pl_default_staging_threads();
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(n);
}

static PyObject *cpu_budget(PyObject *m, PyObject *Py_UNUSED(ignored))
{
    (void)m;
    pl_cpu_budget b;
    Py_BEGIN_ALLOW_THREADS
    pl_cpu_budget_read(&b);
    Py_END_ALLOW_THREADS
    PyObject *quota = b.quota > 0 ? PyFloat_FromDouble(b.quota) : Py_NewRef(Py_None);
    if (!quota)
        return NULL;
    return Py_BuildValue("{sisisNsisisi}", "online", b.online, "affinity", b.affinity, "quota", quota,
                         "local_ranks", b.local_ranks, "staging_threads", b.threads,
                         "max_staging_threads", PL_STAGING_THREADS_MAX);
}

static PyMethodDef cpus_methods[] = {
    {"default_staging_threads", default_staging_threads, METH_NOARGS,
     "default_staging_threads()\n--\n\n"
     "The staging thread count AsyncPrefetcher uses when staging_threads is None: the CPUs this\n"
     "process may use (affinity mask, cgroup CPU quota) divided among the local ranks\n"
     "(LOCAL_WORLD_SIZE), at least 1 and at most max_staging_threads."},
    {"cpu_budget", cpu_budget, METH_NOARGS,
     "cpu_budget()\n--\n\nWhat default_staging_threads() is derived from, as a dict."},
    {NULL, NULL, 0, NULL},
};

int pl_cpus_init(PyObject *m)
{
    return PyModule_AddFunctions(m, cpus_methods);
}
