"""pinloader: feed the GPU from Python.

A pinned slab pool (:class:`PinnedPool`) and an off-GIL asynchronous prefetcher
(:class:`AsyncPrefetcher`) that copies batches from any Python iterable into reused
page-locked memory with several threads, issues one DMA per batch on a high-priority copy
stream, and hands back DLPack-exportable :class:`DeviceArray` s that torch, CuPy and JAX consume
after a stream-side event wait. Without a GPU the same pipeline runs on a host backend.
"""
from __future__ import annotations

import atexit as _atexit

from . import _cudart
from . import _C
from ._stats import CudaInfo, PoolStats, PrefetcherStats
from ._version import __version__

_C.set_cudart_candidates(_cudart.candidates())

from ._C import (  # noqa: E402
    AsyncPrefetcher,
    CudaError,
    DeviceArray,
    PinnedBuffer,
    PinnedPool,
    PoolExhausted,
    backend,
    cuda_available,
    cuda_info,
    default_pinned_cap,
    default_pool,
    default_pool_cap,
    device_count,
)
from .array_loader import ArrayLoader  # noqa: E402
from .image_loader import ImageDecodeError, ImageLoader  # noqa: E402
from ._stateful import StatefulPrefetcher  # noqa: E402

__all__ = [
    "ArrayLoader",
    "AsyncPrefetcher",
    "CudaError",
    "CudaInfo",
    "DeviceArray",
    "ImageDecodeError",
    "ImageLoader",
    "PinnedBuffer",
    "PinnedPool",
    "PoolExhausted",
    "PoolStats",
    "PrefetcherStats",
    "StatefulPrefetcher",
    "backend",
    "cuda_available",
    "cuda_info",
    "default_pinned_cap",
    "default_pool",
    "default_pool_cap",
    "device_count",
    "__version__",
]

# Stop live prefetchers' threads before the interpreter finalizes: a native thread that asks
# for the GIL during finalization would hang there.
_atexit.register(_C.shutdown)
