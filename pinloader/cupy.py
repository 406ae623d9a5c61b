"""pinloader for CuPy: ``pinloader.cupy.prefetch(iterable)`` yields ``cupy.ndarray`` s.

Each batch is ready on CuPy's current stream when it is handed out. Importing this module
imports CuPy; ``import pinloader`` alone never does.
"""
from __future__ import annotations

from typing import Any, Iterable

import cupy as _cp

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

    def __init__(self, iterable: Iterable, device: Any = None, depth: int = 2, **opts: Any) -> None:
        if device is None:
            device = _cp.cuda.Device().id
        if isinstance(device, int):
            device = f"cuda:{device}"
        # cupy.from_dlpack passes the current CuPy stream, which then waits on the copy.
        super().__init__(iterable, device, depth, _cp.from_dlpack, **opts)


def prefetch(iterable: Iterable, device: Any = None, depth: int = 2, **opts: Any) -> CupyPrefetcher:
    """Wrap ``iterable`` so that it yields the same structures with ``cupy.ndarray`` leaves."""
    return CupyPrefetcher(iterable, device=device, depth=depth, **opts)
