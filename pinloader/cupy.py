"""pinloader for CuPy: ``pinloader.cupy.prefetch(iterable)`` yields ``cupy.ndarray`` s.

Each batch is ready on CuPy's current stream when it is handed out. Importing this module
imports CuPy; ``import pinloader`` alone never does.
"""
from __future__ import annotations

import os
from typing import Any, Iterable

import cupy as _cp  # type: ignore[import-not-found, unused-ignore]  # no typing: Any

from . import _door, _device
from ._door import Door

__all__ = ["prefetch", "CupyPrefetcher"]


class CupyPrefetcher(Door):
    """Iterate any iterable with array leaves delivered as ``cupy.ndarray`` s.

    Parameters
    ----------
    iterable : iterable
    device : int, str or cupy.cuda.Device, optional
        The CUDA device: N, "cuda:N", a ``cupy.cuda.Device``, or "cuda" or None (the default):
        CuPy's current device. The spellings are every door's (Note [device spellings] in
        pinloader/_device.py); "cpu" is refused, as a ``cupy.ndarray`` lives on a GPU.
    depth : int, default 2
        Batches in flight or waiting. Left out over an :class:`~pinloader.ArrayLoader`, the
        loader's depth applies (its default is 3); an explicit value, 2 included, wins.
    static : bool, default False
        Deliver every batch in the same ``cupy.ndarray`` s, one per leaf, copied on CuPy's
        current stream when the batch is taken (for a CUDA graph); the rules are
        :class:`pinloader.torch.TorchPrefetcher`'s (``valid_rows``, a short last batch, valid
        until the next batch).
    out : sequence of cupy.ndarray, optional
        Your own static buffers (C-contiguous, on ``device``); implies ``static=True``.
    **opts
        Passed to :class:`pinloader.AsyncPrefetcher`.
    """

    def __init__(self, iterable: Iterable[Any], device: Any = None, depth: int = _door.DEFAULT_DEPTH, *,
                 static: bool = False, out: Any = None, **opts: Any) -> None:
        dev = _device.for_cupy(device)
        # CuPy's device (None only where CUDA is unusable: the prefetcher then says why)
        self.device: Any = dev.native
        stream, convert = _callables(0 if dev.index is None else dev.index)
        handout = dict(output="capsule", stream=stream, convert=convert)
        if static or out is not None:
            # one array is one leaf's buffer: list(array) would split it into its rows
            out = [out] if isinstance(out, _cp.ndarray) else out
            handout.update(static=True, out=None if out is None else list(out))
        super().__init__(iterable, dev.core, depth, handout, **opts)


# The stream and convert callables per device (and per CuPy stream lookup and null stream): a
# door made per epoch over one ArrayLoader asks for the same settings each time and keeps the
# loader's prefetcher (Note [doors over a loader] in pinloader/_loader_base.py).
_callables_cache: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def _callables(dev_id: int) -> tuple[Any, Any]:
    get_stream, null = _cp.cuda.get_current_stream, _null_stream()
    key = (dev_id, get_stream, null)
    found = _callables_cache.get(key)
    if found is not None:
        return found

    def stream() -> int:
        # Once per batch: CuPy's current stream waits on the copy once (see Note
        # [per-batch import] in pinloader/_door.py).
        return get_stream().ptr or null

    def convert(capsule: Any) -> Any:
        return _cp.from_dlpack(_Exported(capsule, (2, dev_id)))

    if len(_callables_cache) >= 64:
        _callables_cache.clear()
    _callables_cache[key] = (stream, convert)
    return stream, convert


def _null_stream() -> int:
    """CuPy's null stream in DLPack's numbering: 2 (per-thread default) in CuPy's per-thread
    default stream mode, else 1 (legacy default)."""
    ptds = getattr(_cp.cuda.stream, "is_ptds_enabled", None)
    if ptds is not None:
        return 2 if ptds() else 1
    return 2 if os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM") == "1" else 1


class _Exported:
    """A capsule already exported for the consumer's stream, offered through the DLPack
    protocol (the stream argument has been honoured by the export)."""

    __slots__ = ("_capsule", "_device")

    def __init__(self, capsule: Any, device: tuple[int, int]) -> None:
        self._capsule = capsule
        self._device = device

    def __dlpack__(self, **kwargs: Any) -> Any:
        capsule, self._capsule = self._capsule, None
        if capsule is None:
            raise BufferError("this DLPack capsule was already consumed")
        return capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        device: tuple[int, int] = self._device
        return device


def prefetch(iterable: Iterable[Any], device: Any = None, depth: int = _door.DEFAULT_DEPTH, *, static: bool = False,
             out: Any = None, **opts: Any) -> CupyPrefetcher:
    """Wrap ``iterable`` so that it yields the same structures with ``cupy.ndarray`` leaves;
    with ``static=True`` (or ``out=``) always the same arrays."""
    return CupyPrefetcher(iterable, device=device, depth=depth, static=static, out=out, **opts)
