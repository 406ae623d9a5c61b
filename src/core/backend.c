/* What the two backends share: the names and messages of pinloader's own error codes, and of
 * a backend's codes through its table (the host backend's when none is given). */
#include "backend.h"

const char *pl_error_name(const pl_backend *b, int code)
{
    switch (code) {
    case PL_ERR_NO_RUNTIME: return "pinloaderErrorNoCudaRuntime";
    case PL_ERR_TIMEOUT: return "pinloaderErrorTimeout";
    case PL_ERR_STOPPED: return "pinloaderErrorStopped";
    case PL_ERR_FORKED: return "pinloaderErrorForked";
    case PL_ERR_OVER_CAP: return "pinloaderErrorOverCap";
    default: return (b ? b : pl_backend_host())->error_name(code);
    }
}

const char *pl_error_string(const pl_backend *b, int code)
{
    switch (code) {
    case PL_ERR_NO_RUNTIME: return "no usable CUDA runtime library (libcudart) could be loaded";
    case PL_ERR_TIMEOUT: return "timed out";
    case PL_ERR_STOPPED: return "the operation was abandoned because its owner is closing";
    case PL_ERR_FORKED: return "pinloader objects created before fork() cannot be used in the child";
    case PL_ERR_OVER_CAP: return "the request can never fit under the pinned-memory cap";
    default: return (b ? b : pl_backend_host())->error_string(code);
    }
}

int pl_device_push(const pl_backend *b, int device, int *prev)
{
    if (b->get_device(prev) != PL_OK)
        *prev = -1;
    return *prev == device ? PL_OK : b->set_device(device);
}

void pl_device_pop(const pl_backend *b, int device, int prev)
{
    if (prev >= 0 && prev != device)
        b->set_device(prev);
}
