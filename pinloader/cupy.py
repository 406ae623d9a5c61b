"""pinloader for CuPy: ``pinloader.cupy.prefetch(iterable)`` yields ``cupy.ndarray`` s.

Each batch is ready on CuPy's current stream when it is handed out. Importing this module
imports CuPy; ``import pinloader`` alone never does.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import cupy as _cp

from ._C import AsyncPrefetcher
from ._tree import map_leaves

__all__ = ["prefetch", "CupyPrefetcher"]


class CupyPrefetcher:
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
        self._pf = AsyncPrefetcher(iterable, device=device, depth=depth, **opts)

    def __iter__(self) -> Iterator[Any]:
        iter(self._pf)
        return self

    def __next__(self) -> Any:
        # cupy.from_dlpack passes the current CuPy stream, which then waits on the copy.
        return map_leaves(next(self._pf), _cp.from_dlpack)

    def __len__(self) -> int:
        return len(self._pf)

    def stats(self) -> dict:
        return self._pf.stats()

    def close(self) -> None:
        self._pf.close()

    def __enter__(self) -> "CupyPrefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def prefetch(iterable: Iterable, device: Any = None, depth: int = 2, **opts: Any) -> CupyPrefetcher:
    """Wrap ``iterable`` so that it yields the same structures with ``cupy.ndarray`` leaves."""
    return CupyPrefetcher(iterable, device=device, depth=depth, **opts)
