"""The iterator shared by the framework adapters (torch, JAX, CuPy)."""
from __future__ import annotations

from typing import Any, Callable, Iterable

from ._C import AsyncPrefetcher, DeviceArray
from ._stats import PrefetcherStats
from ._tree import map_leaves


class FrameworkPrefetcher:
    """Wraps an :class:`AsyncPrefetcher`; each batch's DeviceArray leaves go through
    ``convert`` (the framework's DLPack import) as the batch is handed out."""

    def __init__(self, iterable: Iterable[Any], device: Any, depth: int,
                 convert: Callable[[DeviceArray], Any], **opts: Any) -> None:
        self._convert = convert
        self._pf = AsyncPrefetcher(iterable, device=device, depth=depth, **opts)

    def __iter__(self) -> "FrameworkPrefetcher":
        iter(self._pf)
        return self

    def __next__(self) -> Any:
        return map_leaves(next(self._pf), self._convert)

    def __len__(self) -> int:
        return len(self._pf)

    def stats(self) -> PrefetcherStats:
        """See :meth:`pinloader.AsyncPrefetcher.stats`."""
        return self._pf.stats()

    def close(self) -> None:
        """Stop the producer and free what is not handed out. Idempotent."""
        self._pf.close()

    def __enter__(self) -> "FrameworkPrefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__module__}.{type(self).__name__}({self._pf!r})"
