"""pinloader for JAX: ``pinloader.jax.prefetch(iterable)`` yields ``jax.Array`` s on a device.

Importing this module imports JAX; ``import pinloader`` alone never does.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import jax as _jax
import jax.dlpack as _jdl

from ._C import AsyncPrefetcher
from ._tree import map_leaves

__all__ = ["prefetch", "JaxPrefetcher"]


def _resolve(device: Any) -> tuple[str, Any]:
    if device is None:
        device = _jax.devices()[0]
    if isinstance(device, str):
        platform, _, idx = device.partition(":")
        platform = {"cuda": "gpu"}.get(platform, platform)
        device = _jax.devices(platform)[int(idx or 0)]
    if device.platform == "gpu":
        return f"cuda:{device.id}", device
    if device.platform == "cpu":
        return "cpu", device
    raise ValueError(f"pinloader.jax.prefetch: unsupported JAX device {device}")


class JaxPrefetcher:
    """Iterate any iterable with array leaves delivered as ``jax.Array`` s on ``device``.

    Parameters
    ----------
    iterable : iterable
        Nested tuples, lists, dicts, namedtuples or dataclasses of NumPy/DLPack arrays.
    device : jax.Device or str, optional
        Default: ``jax.devices()[0]``. "cuda:N"/"gpu:N" or "cpu" are accepted.
    depth : int, default 2
    **opts
        Passed to :class:`pinloader.AsyncPrefetcher`.
    """

    def __init__(self, iterable: Iterable, device: Any = None, depth: int = 2, **opts: Any) -> None:
        pl_device, self.device = _resolve(device)
        self._pf = AsyncPrefetcher(iterable, device=pl_device, depth=depth, **opts)

    def _convert(self, leaf: Any) -> Any:
        # JAX passes its own stream to __dlpack__ and accepts only legacy capsules, which
        # DeviceArray gives when max_version is not passed.
        arr = _jdl.from_dlpack(leaf)
        return arr if arr.devices() == {self.device} else _jax.device_put(arr, self.device)

    def __iter__(self) -> Iterator[Any]:
        iter(self._pf)
        return self

    def __next__(self) -> Any:
        return map_leaves(next(self._pf), self._convert)

    def __len__(self) -> int:
        return len(self._pf)

    def stats(self) -> dict:
        return self._pf.stats()

    def close(self) -> None:
        self._pf.close()

    def __enter__(self) -> "JaxPrefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def prefetch(iterable: Iterable, device: Any = None, depth: int = 2, **opts: Any) -> JaxPrefetcher:
    """Wrap ``iterable`` so that it yields the same structures with ``jax.Array`` leaves."""
    return JaxPrefetcher(iterable, device=device, depth=depth, **opts)
