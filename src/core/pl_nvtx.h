/* NVTX ranges around staging and copies, for users who profile (nsys, torch.profiler).
 *
 * NVTX3 is header-only: without a profiler attached every call is a cheap no-op, and with one
 * attached the profiler's injection library is found at run time, so no NVTX library is linked.
 * setup.py defines PL_HAVE_NVTX when it found the nvtx3 headers (from the nvidia-nvtx wheel that
 * pyproject.toml lists as a build requirement, or from a CUDA toolkit) and says which it used;
 * without them the macros compile to nothing and pinloader._C.NVTX is 0. */
#ifndef PL_NVTX_H
#define PL_NVTX_H

#ifdef PL_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#define PL_NVTX_ENABLED 1
#define PL_NVTX_INIT() nvtxInitialize(NULL)
#define PL_NVTX_PUSH(name) nvtxRangePushA(name)
#define PL_NVTX_POP() nvtxRangePop()
#else
#define PL_NVTX_ENABLED 0
#define PL_NVTX_INIT() ((void)0)
#define PL_NVTX_PUSH(name) ((void)0)
#define PL_NVTX_POP() ((void)0)
#endif

#endif
