"""The shapes of the dictionaries that pinloader's stats() and cuda_info() return.

For annotations in user code: ``stats: pinloader.PrefetcherStats = pf.stats()``.
"""
from __future__ import annotations

from typing import Literal, TypedDict

__all__ = ["CudaInfo", "PoolStats", "PrefetcherStats"]


class CudaInfo(TypedDict):
    """What :func:`cuda_info` found."""

    usable: bool
    library: str
    driver_version: int
    runtime_version: int
    device_count: int
    error: str
    error_code: int

class PoolStats(TypedDict):
    """:meth:`PinnedPool.stats`: bytes, counts and the time spent waiting at the cap.

    The same pool seen from a prefetcher: :meth:`AsyncPrefetcher.stats` repeats some of these
    figures under ``pool_*`` names (``pool.stats()["in_use_bytes"]`` is
    ``pf.stats()["pool_bytes_in_use"]``); see :class:`PrefetcherStats` for the mapping.
    """

    reserved_bytes: int
    in_use_bytes: int
    peak_in_use_bytes: int
    peak_reserved_bytes: int
    max_bytes: int
    slabs: int
    regions: int
    pending: int
    allocs_cached: int
    allocs_new: int
    slabs_created: int
    slabs_freed: int
    waits: int
    wait_s: float
    waiting: int
    numa_node: int

class PrefetcherStats(TypedDict):
    """:meth:`AsyncPrefetcher.stats` (see "Reading stats()" in the Concepts page).

    ``pinned_*`` keys are this prefetcher's own share of its pool (its client bound); ``pool_*``
    keys are the whole pool it draws from, shared with other prefetchers, and are the pool's own
    :class:`PoolStats` under prefetcher-style names:

    ============================  ==============================
    ``AsyncPrefetcher.stats()``   ``PinnedPool.stats()``
    ============================  ==============================
    ``pool_bytes_reserved``       ``reserved_bytes``
    ``pool_bytes_in_use``         ``in_use_bytes``
    ``pool_bytes_peak``           ``peak_reserved_bytes``
    ``pool_cap``                  ``max_bytes``
    ``pool_slabs_created``        ``slabs_created``
    ``pool_waits``                ``waits``
    ============================  ==============================

    ``pinned_bytes_in_use``, ``pinned_bytes_peak`` and ``pinned_cap`` have no pool counterpart:
    they count this prefetcher's reservations only.
    """

    batches: int
    bytes: int
    padding_bytes: int
    h2d_gbps: float
    wait_s_total: float
    wait_ms_mean: float
    wait_ms_p99: float
    next_s_total: float
    staging_s_total: float
    copy_issue_s_total: float
    pinned_bytes_in_use: int
    pinned_bytes_reserved: int
    pinned_bytes_peak: int
    pinned_cap: int
    device_bytes_peak: int
    pinned_stalls: int
    pinned_stall_s: float
    queued: int
    backend: Literal["cuda", "host"]
    pool_bytes_reserved: int
    pool_bytes_in_use: int
    pool_bytes_peak: int
    pool_cap: int
    pool_slabs_created: int
    pool_waits: int
    sort_s_total: float
    gil_wait_s_total: float
    producer_s_total: float
    producer_gil_holds: int
