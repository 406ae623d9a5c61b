/* default_staging_threads() and cpu_budget() (cpu_budget.c). */
#ifndef PL_CPU_BUDGET_H
#define PL_CPU_BUDGET_H

#include "state.h"

int pl_cpus_init(PyObject *m);

#endif
