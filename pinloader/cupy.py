"""pinloader for CuPy: ``pinloader.cupy.prefetch(iterable)`` yields ``cupy.ndarray`` s.

Each batch is ready on CuPy's current stream when it is handed out. Importing this module
imports CuPy; ``import pinloader`` alone never does.
"""
from __future__ import annotations

import os
from typing import Any, Iterable

import cupy as _cp  # type: ignore[import-not-found, unused-ignore]  # no typing: Any

from . import _adapter
from ._adapter import FrameworkPrefetcher

__all__ = ["prefetch", "CupyPrefetcher"]


class CupyPrefetcher(FrameworkPrefetcher):
    """Iterate any iterable with array leaves delivered as ``cupy.ndarray`` s.

    Parameters
    ----------
    iterable : iterable
    device : int or str, optional
        CUDA device ordinal (default: CuPy's current device).
    depth : int, default 2
    **opts
        Passed to :class:`pinloader.AsyncPrefetcher`.
    """

    def __init__(self, iterable: Iterable[Any], device: Any = None, depth: int = 2, **opts: Any) -> None:
        _adapter.refuse_bool_device("pinloader.cupy.prefetch", device)
        if device is None:
            device = _cp.cuda.Device().id
        if isinstance(device, int):
            device = f"cuda:{device}"
        # cupy.from_dlpack passes the current CuPy stream, which then waits on the copy.
        super().__init__(iterable, device, depth, _cp.from_dlpack, **opts)

    def _import_leaves(self, leaves: list[Any]) -> list[Any]:
        if _adapter._native_export is None:
            # Each leaf's __dlpack__ makes CuPy's stream wait: nothing to gain by batching.
            return super()._import_leaves(leaves)
        # One export for the batch: CuPy's current stream, looked up once, waits once (see
        # Note [per-batch import] in pinloader/_adapter.py); cupy.from_dlpack then takes each
        # capsule through the protocol.
        handle = _cp.cuda.get_current_stream().ptr or _null_stream()
        capsules = _adapter.export_leaves(leaves, handle)
        return [_cp.from_dlpack(_Exported(c, leaf)) for c, leaf in zip(capsules, leaves)]


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

    def __init__(self, capsule: Any, leaf: Any) -> None:
        self._capsule = capsule
        self._device = leaf.__dlpack_device__()

    def __dlpack__(self, **kwargs: Any) -> Any:
        capsule, self._capsule = self._capsule, None
        if capsule is None:
            raise BufferError("this DLPack capsule was already consumed")
        return capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        device: tuple[int, int] = self._device
        return device


def prefetch(iterable: Iterable[Any], device: Any = None, depth: int = 2, **opts: Any) -> CupyPrefetcher:
    """Wrap ``iterable`` so that it yields the same structures with ``cupy.ndarray`` leaves."""
    return CupyPrefetcher(iterable, device=device, depth=depth, **opts)
