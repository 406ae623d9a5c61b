"""The CUDA driver's hardware work queues, which ImageLoader asks for before the driver is
initialized in the process (Note [hardware work queues] in src/core/backend_cuda.c).

A context gets ``CUDA_DEVICE_MAX_CONNECTIONS`` queues (8 when it is unset, at most 32), read when
the driver is initialized. With 8, the GPU decoder's streams share queues with the model's, and
each decode call waits behind the kernels a training step has queued ahead. So an ImageLoader
that may decode on the GPU sets the variable to 32 when the user has not set it and the driver
is not yet initialized in the process; a value the user set is never changed, and once the
driver is initialized a new value could no longer take effect, so it is left alone and
``stats()`` says why.
"""
from __future__ import annotations

import os

from . import _C

VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
WANTED = 32
DRIVER_DEFAULT = 8

# what ask() did in this process: (pid, queues, why); a fork child asks again
_done: tuple[int, int | None, str] | None = None


def ask() -> tuple[int | None, str]:
    """Ask for WANTED queues where that can still take effect; never initializes CUDA. Returns
    the queues this process's CUDA contexts get (None when unknown) and a sentence saying why."""
    global _done
    pid = os.getpid()
    if _done is not None and _done[0] == pid:
        return _done[1], _done[2]
    text = os.environ.get(VARIABLE)
    if text is not None:  # the user's: reported, never changed
        t = text.strip()
        value = int(t) if t.isascii() and t.isdigit() and len(t) <= 9 else None
        return value, f"{VARIABLE}={text!r} was set before the loader was made"
    initialized = _C.cuda_driver_initialized()
    if initialized is False:
        os.environ[VARIABLE] = str(WANTED)
        got: tuple[int | None, str] = (
            WANTED, f"set {VARIABLE}={WANTED}: the CUDA driver was not yet initialized in this process")
    elif initialized:
        got = (DRIVER_DEFAULT, f"the driver's default: CUDA was initialized in this process before the loader was "
                               f"made (set {VARIABLE}={WANTED} before CUDA is first used, or make the loader first)")
    else:
        got = (None, "unknown: the CUDA driver could not say whether it was initialized")
    _done = (pid, *got)
    return got
