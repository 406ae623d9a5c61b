"""The CUDA driver's hardware work queues, which ImageLoader asks for before the driver is
initialized in the process (Note [hardware work queues] in src/core/backend_cuda.c).

A context gets ``CUDA_DEVICE_MAX_CONNECTIONS`` queues (8 when it is unset, at most 32), read when
the driver is initialized. Beside a model in training, with 8 the GPU decoder's calls lasted
about twice as long and the model waited for the loader. So an ImageLoader that may decode on
the GPU sets the variable to 32 when the user has not set it, a CUDA driver is there, and it is
not yet initialized in the process; a value the user set is never changed, and once the driver
is initialized a new value could no longer take effect, so it is left alone and ``stats()`` says
why. Asking never initializes CUDA (making a loader must not: a fork after it, or
``CUDA_VISIBLE_DEVICES`` set after it, must still work).
"""
from __future__ import annotations

import os
import threading

from . import _C

VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
WANTED = 32
DRIVER_DEFAULT = 8
DRIVER_MAX = 32

_lock = threading.Lock()
# what ask() found in this process: (pid, queues, why); a fork child asks again
_done: tuple[int, int | None, str] | None = None
# the variable was set here (a fork child inherits it, and this flag with it)
_set_here = False


def _after_fork_in_child() -> None:
    """A fork child's lock is new: a thread of the parent may have held it at the fork."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _users(text: str) -> int | None:
    """The queues a value of the variable asks for, read as the CUDA documentation describes it
    (1 to 32; not measured here): None for what is not such a number, 32 for more."""
    t = text.strip()
    if not (t.isascii() and t.isdigit() and len(t) <= 9):
        return None
    v = int(t)
    return min(v, DRIVER_MAX) if v >= 1 else None


def ask() -> tuple[int | None, str]:
    """Ask for WANTED queues where that can still take effect; never initializes CUDA. Returns
    the queues requested for this process's CUDA contexts (None when unknown, or no driver) and
    a sentence saying why. Once per process, whatever thread asks."""
    global _done
    pid = os.getpid()
    with _lock:
        if _done is not None and _done[0] == pid:
            return _done[1], _done[2]
        got = _decide()
        _done = (pid, *got)
        return got


def _decide() -> tuple[int | None, str]:
    global _set_here
    text = os.environ.get(VARIABLE)
    if text is not None:  # the user's (or a parent process's): reported, never changed
        if _set_here and text == str(WANTED):
            return WANTED, f"set {VARIABLE}={WANTED} by pinloader in the process this one was forked from"
        return _users(text), f"{VARIABLE}={text[:40]!r} was set before the loader was made"
    if os.environ.get("PINLOADER_BACKEND") == "host":  # pinloader's host backend, forced: no CUDA
        return None, "PINLOADER_BACKEND=host"
    state = _C.cuda_driver_state()
    if state == "uninitialized":
        os.environ[VARIABLE] = str(WANTED)
        _set_here = True
        return WANTED, f"set {VARIABLE}={WANTED}: the CUDA driver was not yet initialized in this process"
    if state == "initialized":
        return DRIVER_DEFAULT, (f"the driver's default: CUDA was initialized in this process before the loader "
                                f"was made (set {VARIABLE}={WANTED} before CUDA is first used, or make the "
                                f"loader first)")
    if state == "absent":
        return None, "no CUDA driver in this process"
    return None, "unknown: the CUDA driver could not say whether it was initialized"
