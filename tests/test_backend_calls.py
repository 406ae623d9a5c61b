"""The backend calls one steady-state batch makes, counted by the host backend's injector in
its count-only mode (pinloader._C._testing.host_fail_after(2**62) and host_call_counts; Note
[injected faults] in src/core/host_faults.c). The producer's and the release's calls go through
the same table on CUDA, so a batch's fixed calls here are the CUDA runtime calls it costs there:
each is checked exactly, so that one more (a second allocation, an extra copy or device switch)
does not creep in unnoticed. In the steady state no thread synchronizes a stream or an event,
creates a stream or allocates pinned memory. The waits, event queries and capture-mode
exchanges are left unbounded: their number follows how long a thread waits (a reserve or a
handout that waits polls in slices; the host backend's consumer waits on the host where CUDA's
waits on its stream)."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import pinloader

T = pinloader._C._testing
WARM = 300
BATCHES = 200
AHEAD = 6  # batches the producer may be ahead of (or behind) the counted window
NEVER = {"stream_synchronize", "event_synchronize", "host_alloc", "stream_create"}
TIMING = {"event_wait", "event_query", "event_create", "thread_relax_captures"}
# per batch: the producer's device switch and back, the block (its memory, its ready event, the
# release after its copy), the consumer's stream wait, and the release's device switch
COMMON = {"set_device": 2, "get_device": 1, "device_alloc": 1, "device_free": 1, "event_record": 2,
          "stream_wait_event": 1}


def counts_per_batch(batches):
    """Take WARM batches (the caches fill, the pool's regions and the device blocks reach their
    steady number), then count the calls over BATCHES more, the collector off (it would free
    other tests' objects inside the window): per function, per batch."""
    it = iter(batches)
    for _ in range(WARM):
        next(it)
    gc.collect()
    gc.disable()
    T.host_fail_after(1 << 62)  # counts only
    try:
        for _ in range(BATCHES):
            x = next(it)
            del x
    finally:
        total = T.host_fail_after(-1)
        gc.enable()
    by_name = T.host_call_counts()
    assert sum(by_name.values()) == total
    return {k: v / BATCHES for k, v in by_name.items()}


def check(by, expected):
    """The calls outside TIMING are exactly `expected` a batch (within AHEAD batches' worth: the
    producer runs ahead of the counted window), and none of NEVER is made."""
    assert not NEVER & set(by), by
    fixed = {k: v for k, v in by.items() if k not in TIMING}
    assert set(fixed) == set(expected), (fixed, expected)
    for k, n in expected.items():
        assert abs(fixed[k] - n) <= n * AHEAD / BATCHES, (k, fixed, expected)


def forever(loader):
    while True:
        yield from loader


@pytest.mark.parametrize("gather", ["device", "host"])
def test_array_loader_batch(gather):
    arr = np.random.default_rng(0).integers(0, 255, (1 << 15, 512), dtype=np.uint8)
    with pinloader.ArrayLoader(arr, 256, seed=1, device="cpu", drop_last=True, gather=gather) as L:
        by = counts_per_batch(forever(L))
        assert L.stats()["gather"] == gather
    # device: the GPU reads the rows from the registered source (its device address, a launch);
    # host: the staging threads gather them into pinned memory (one copy)
    extra = {"host_device_ptr": 1, "gather_launch": 1} if gather == "device" else {"memcpy_h2d_async": 1}
    check(by, {**COMMON, **extra})


def test_prefetcher_batch_of_a_dict():
    items = [{"x": np.full((256, 64), i, np.float32), "y": np.arange(256) + i} for i in range(40)]
    with pinloader.AsyncPrefetcher(items * 20, device="cpu") as pf:
        by = counts_per_batch(pf)
    # both leaves staged into one pinned region: one copy, one device block
    check(by, {**COMMON, "memcpy_h2d_async": 1})
