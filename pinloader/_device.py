"""What ``device=`` means, read in one place for every front door and loader.

Note [device spellings]
The native AsyncPrefetcher reads ``device=`` itself (pl_resolve_device in src/py/state.c):
None, "cpu", "cpu:0", "host", "cuda", "cuda:N", an int N, or an object with ``type`` and
``index`` (a ``torch.device``). Every Python place that takes ``device=`` reads it here first,
with the same grammar, so that a spelling means the same thing at every door, a bad one is
refused where it is given (a loader's where the loader is made) with one message naming the door and what it accepts, and what reaches the prefetcher is one canonical
string: "cpu", "cuda:N", or "cuda" (the prefetcher's current CUDA device, or its error saying
why CUDA is unusable).

A framework door also needs the device as its framework's own object (to look its stream up,
to place its arrays), so "cuda" without an index means that framework's current device, read
when the door is made: a door's arrays and the prefetcher's copies must be on one device, and
the framework's idea of "current" is the one its user set (``torch.cuda.set_device``,
``cupy.cuda.Device(n).use()``, JAX's default device).

============================  ===============  ===============  ===============  ==============
spelling                      core, loaders    torch door       CuPy door        JAX door
============================  ===============  ===============  ===============  ==============
None                          CUDA's current   torch's current  CuPy's current   JAX's default
                              device, else     device, else     device [4]       device
                              the host         the host [1]                      (local_devices()[0])
"cpu", "cpu:0", "host",       the host         the host         refused [2]      the host, JAX's
torch.device("cpu")                                                              CPU device 0
"cpu:N" (N > 0)               refused [3]      refused [3]      refused [2]      the host, JAX's
                                                                                 CPU device N
"cuda", torch.device("cuda")  CUDA's current   torch's current  CuPy's current   JAX's default
                              device [4]       device [4]       device [4]       GPU
"cuda:N", int N [5],          CUDA device N    CUDA device N    CUDA device N    the JAX GPU of
torch.device("cuda", N)                                                          CUDA ordinal N
"gpu", "gpu:N"                refused          refused          refused          as "cuda[:N]"
cupy.cuda.Device(N)           refused          refused          CUDA device N    refused
a JAX Device                  refused          refused          refused          its GPU or CPU
bool                          refused          refused          refused          refused
============================  ===============  ===============  ===============  ==============

[1] pinloader's default: CUDA when pinloader can use it (``pinloader.backend() == "cuda"``).
[2] a ``cupy.ndarray`` lives on a CUDA device; the host backend has none.
[3] the host backend has one device.
[4] when the framework cannot tell (no usable CUDA), "cuda" goes to the prefetcher as it is,
    which raises the CudaError saying why.
[5] a NumPy integer too.

A bool is refused (TypeError) because Python reads True as 1, and ``device=True`` would mean
"cuda:1". A string is read exactly (no case folding, no spaces); N is decimal digits; an
index is at most 2**20 (the native reader's bound for "cuda:N"). A value of another type is a TypeError, a value of an accepted
type that names no device here a ValueError.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from . import _C

# A CUDA ordinal above this is no device (the native reader's bound, parse_index in state.c).
_MAX_INDEX = 1 << 20

_CUDA = "'cuda', 'cuda:N', an int N"
ACCEPTED = {
    "core": f"None, 'cpu', 'cpu:0', 'host', {_CUDA} or a torch.device",
    "torch": f"None, 'cpu', 'cpu:0', 'host', {_CUDA} or a torch.device",
    "cupy": f"None, {_CUDA}, a torch.device or a cupy.cuda.Device",
    "jax": f"None, 'cpu', 'cpu:N', 'host', {_CUDA}, 'gpu', 'gpu:N', a torch.device or a jax.Device",
}


@dataclasses.dataclass(frozen=True)
class Device:
    """A door's ``device=`` resolved: where the prefetcher puts batches, and the framework's own
    object for that device."""

    kind: str
    """"cpu" (pinloader's host backend) or "cuda"."""
    index: int | None
    """The CUDA ordinal; None on the host, and for "cuda" when the framework could not tell its
    current device (the prefetcher then says why CUDA is unusable)."""
    native: Any = None
    """The framework's device: a torch.device, a cupy.cuda.Device, a jax Device."""

    @property
    def core(self) -> str:
        """The canonical spelling given to the prefetcher."""
        if self.kind == "cpu":
            return "cpu"
        return "cuda" if self.index is None else f"cuda:{self.index}"


def _shown(device: Any) -> str:
    """``device`` for an error message: its repr, cut to 80 characters (an int of thousands of
    digits has no repr, a hostile object's may raise)."""
    if isinstance(device, int) and device.bit_length() > 64:
        return f"an int of {device.bit_length()} bits"
    try:
        text = repr(device)
    except Exception:
        return f"a {type(device).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse(who: str, door: str, device: Any, why: str = "") -> ValueError:
    tail = f" ({why})" if why else ""
    return ValueError(f"{who}: device must be {ACCEPTED[door]}; got {_shown(device)}{tail}")


def _index(text: str) -> int | None:
    """N of "cuda:N": decimal digits only (int() would take spaces, signs and underscores)."""
    if not text or not text.isascii() or not text.isdigit():
        return None
    # past the bound either way; int() of thousands of digits would be refused or slow
    return int(text) if len(text) <= 20 else _MAX_INDEX + 1


def parse(device: Any, who: str, door: str = "core", *, gpu_alias: bool = False) -> tuple[str, int | None] | None:
    """``device`` as (kind, index), kind "cpu" or "cuda" and index None where the spelling gives
    none ("cuda": the current device); None for None. The spellings every reader shares (Note
    [device spellings]); ``gpu_alias`` also takes JAX's "gpu" and "gpu:N". Framework device
    objects are the doors' to read before this. Raises TypeError or ValueError naming ``who``
    and what ``door`` accepts."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise TypeError(f"{who}: device must be {ACCEPTED[door]}; not bool ({device!r} would "
                        f"read as device {int(device)})")
    if isinstance(device, (int, np.integer)):
        v = int(device)
        if not 0 <= v <= _MAX_INDEX:
            raise _refuse(who, door, device, f"a CUDA device index is between 0 and {_MAX_INDEX}")
        return "cuda", v
    if isinstance(device, str):
        kind, colon, rest = device.partition(":")
        if gpu_alias and kind == "gpu":
            kind = "cuda"
        index = _index(rest) if colon else None
        if colon and index is None:
            raise _refuse(who, door, device, "N is a device index: decimal digits")
        if kind == "host" and not colon:
            return "cpu", None
        if kind in ("cpu", "cuda"):
            return _checked(kind, index, who, door, device)
        raise _refuse(who, door, device)
    if hasattr(device, "type"):  # torch.device and the like, as the native reader takes them
        kind, index = getattr(device, "type"), getattr(device, "index", None)
        if kind not in ("cpu", "cuda") or not (index is None or (isinstance(index, int)
                                                                   and not isinstance(index, bool))):
            raise _refuse(who, door, device)
        return _checked(kind, index, who, door, device)
    raise TypeError(f"{who}: device must be {ACCEPTED[door]}; not {type(device).__name__}")


def _checked(kind: str, index: int | None, who: str, door: str, device: Any) -> tuple[str, int | None]:
    if index is not None and not 0 <= index <= _MAX_INDEX:
        raise _refuse(who, door, device, f"a device index is between 0 and {_MAX_INDEX}")
    if kind == "cpu" and index and door != "jax":
        raise _refuse(who, door, device, "the host backend has one device: 'cpu' or 'cpu:0'")
    return kind, index


def canonical(device: Any, who: str) -> str | None:
    """A loader's (or the core's) ``device``: "cpu", "cuda", "cuda:N", or None (the prefetcher's
    default: CUDA's current device, else the host)."""
    spec = parse(device, who, "core")
    if spec is None:
        return None
    return Device(*spec).core


def agree(mine: str | None, theirs: str | None) -> bool:
    """Whether a loader made with device ``mine`` can run for a door that asks for ``theirs``
    (both canonical): one is None, they are equal, or one is "cuda" and the other "cuda:N"."""
    if mine is None or theirs is None or mine == theirs:
        return True
    return "cuda" in (mine, theirs) and mine.startswith("cuda") and theirs.startswith("cuda")


def narrower(mine: str | None, theirs: str | None) -> str | None:
    """The device of two that agree (see agree) that says the most: the given one where the
    other is None, "cuda:N" over "cuda" (a door's arrays are made for its index)."""
    if mine is None or mine == "cuda":
        return theirs if theirs is not None else mine
    return mine


# ---- the doors: each framework's "current" device and its own device objects ----

def for_torch(device: Any) -> Device:
    """pinloader.torch.prefetch's ``device`` (Note [device spellings])."""
    import torch

    spec = parse(device, "pinloader.torch.prefetch", "torch")
    if spec is None:  # pinloader's default: CUDA when pinloader can use it, else the host
        spec = ("cuda", None) if _C.backend() == "cuda" else ("cpu", None)
    kind, index = spec
    if kind == "cpu":
        return Device("cpu", None, torch.device("cpu"))
    if index is None:
        if not torch.cuda.is_available():  # the prefetcher says why CUDA is unusable
            return Device("cuda", None, torch.device("cuda"))
        index = int(torch.cuda.current_device())
    return Device("cuda", index, torch.device("cuda", index))


def for_cupy(device: Any) -> Device:
    """pinloader.cupy.prefetch's ``device`` (Note [device spellings])."""
    import cupy  # type: ignore[import-not-found, unused-ignore]  # no typing: Any

    who = "pinloader.cupy.prefetch"
    if isinstance(device, cupy.cuda.Device):
        index: int | None = int(device.id)
    else:
        spec = parse(device, who, "cupy") or ("cuda", None)
        if spec[0] == "cpu":
            raise _refuse(who, "cupy", device, "a cupy.ndarray lives on a CUDA device; the host "
                          "backend has none")
        index = spec[1]
    if index is None:
        if not cupy.cuda.is_available():  # the prefetcher says why CUDA is unusable
            return Device("cuda", None, None)
        index = int(cupy.cuda.Device().id)  # CuPy's current device
    return Device("cuda", index, cupy.cuda.Device(index))


def _ordinal(dev: Any) -> int:
    """A JAX GPU's CUDA ordinal in this process (its ``id`` is global across processes)."""
    local = getattr(dev, "local_hardware_id", None)
    return int(local) if isinstance(local, int) else int(dev.id)


def for_jax(device: Any) -> Device:
    """pinloader.jax.prefetch's ``device`` (Note [device spellings])."""
    import jax  # type: ignore[import-not-found, unused-ignore]

    who = "pinloader.jax.prefetch"
    if device is None:
        device = jax.local_devices()[0]
    if not hasattr(device, "platform"):
        asked = device
        kind, index = parse(device, who, "jax", gpu_alias=True) or ("cuda", None)
        found = jax.local_devices(backend="gpu" if kind == "cuda" else "cpu")
        if index is None:
            device = found[0]
        elif kind == "cuda":
            device = next((d for d in found if _ordinal(d) == index), None)
        else:
            device = found[index] if index < len(found) else None
        if device is None:
            raise _refuse(who, "jax", asked, f"JAX has no {'GPU' if kind == 'cuda' else 'CPU device'} "
                          f"{index} here")
    if device.platform == "gpu":
        return Device("cuda", _ordinal(device), device)
    if device.platform == "cpu":
        return Device("cpu", None, device)
    raise _refuse(who, "jax", device, f"a {device.platform} device: pinloader delivers to CUDA "
                  "devices and the host")
