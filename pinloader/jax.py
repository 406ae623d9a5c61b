"""pinloader for JAX: ``pinloader.jax.prefetch(iterable)`` yields ``jax.Array`` s on a device.

Importing this module imports JAX; ``import pinloader`` alone never does.
"""
from __future__ import annotations

from typing import Any, Iterable

# Without JAX installed (or without its typing) the type checker sees these as Any.
import jax as _jax  # type: ignore[import-not-found, unused-ignore]
import jax.dlpack as _jdl  # type: ignore[import-not-found, unused-ignore]

from . import _door, _device
from ._door import Door

__all__ = ["prefetch", "JaxPrefetcher"]


class JaxPrefetcher(Door):
    """Iterate any iterable with array leaves delivered as ``jax.Array`` s on ``device``.

    Parameters
    ----------
    iterable : iterable
        Nested tuples, lists, dicts, namedtuples or dataclasses of NumPy/DLPack arrays.
    device : jax.Device, str or int, optional
        Default (None): JAX's default device, ``jax.local_devices()[0]``: its first GPU when
        JAX has one, else the CPU (pinloader's host backend). "cuda" or "gpu" (JAX's default
        GPU), "cuda:N", "gpu:N" or N (the GPU of CUDA ordinal N), "cpu" or "cpu:N" (JAX's CPU
        device N, on the host backend) are accepted too (Note [device spellings] in
        pinloader/_device.py).
    depth : int, default 2
        Batches in flight or waiting. Left out over an :class:`~pinloader.ArrayLoader`, the
        loader's depth applies (its default is 3); an explicit value, 2 included, wins.
    **opts
        Passed to :class:`pinloader.AsyncPrefetcher`.

    Notes
    -----
    There are no static batches here: ``static=True`` and ``out=`` are refused, because a
    ``jax.Array`` is immutable (refilling its memory behind XLA's back would break that
    promise). A jitted step already reuses its input buffers when it donates them
    (``jax.jit(step, donate_argnums=...)``).
    """

    def __init__(self, iterable: Iterable[Any], device: Any = None, depth: int = _door.DEFAULT_DEPTH, **opts: Any) -> None:
        if opts.get("static") or opts.get("out") is not None:
            raise ValueError("pinloader.jax.prefetch: static batches are not offered for JAX: a "
                             "jax.Array is immutable, so its memory cannot be refilled with the "
                             "next batch; donate the step's inputs instead "
                             "(jax.jit(step, donate_argnums=...))")
        opts.pop("static", None)
        opts.pop("out", None)
        dev = _device.for_jax(device)
        self.device: Any = dev.native
        super().__init__(iterable, dev.core, depth, dict(convert=self._to_jax), **opts)

    def _to_jax(self, leaf: Any) -> Any:
        # JAX passes its own stream to __dlpack__ and accepts only legacy capsules, which
        # DeviceArray gives when max_version is not passed.
        arr = _jdl.from_dlpack(leaf)
        return arr if arr.devices() == {self.device} else _jax.device_put(arr, self.device)


def prefetch(iterable: Iterable[Any], device: Any = None, depth: int = _door.DEFAULT_DEPTH, **opts: Any) -> JaxPrefetcher:
    """Wrap ``iterable`` so that it yields the same structures with ``jax.Array`` leaves."""
    return JaxPrefetcher(iterable, device=device, depth=depth, **opts)
