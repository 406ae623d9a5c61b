"""The backend calls one steady-state batch makes, counted by the host backend's injector
(pinloader._C._testing.host_call_counts; Note [injected faults] in src/core/backend_host.c):
the code above the backend table is the same on CUDA, so these are the CUDA runtime calls a
batch costs there. In the steady state a batch never synchronizes a stream or an event on any
thread (the host never blocks on the GPU) and never creates a stream or pinned memory, and the
number of calls does not creep up unnoticed."""
from __future__ import annotations

import numpy as np
import pytest

import pinloader

T = pinloader._C._testing
WARM = 300
BATCHES = 60
NEVER = ("stream_synchronize", "event_synchronize", "host_alloc", "stream_create")


def counts_per_batch(batches):
    """Take WARM batches (the event caches fill, the pool's regions and the device blocks
    reach their steady number), then count the calls over BATCHES more: (calls per batch, per
    function)."""
    it = iter(batches)
    for _ in range(WARM):
        next(it)
    T.host_fail_after(1 << 62)  # counts, never fails
    try:
        for _ in range(BATCHES):
            x = next(it)
            del x
    finally:
        total = T.host_fail_after(-1)
    by_name = T.host_call_counts()
    assert sum(by_name.values()) == total
    return total / BATCHES, {k: v / BATCHES for k, v in by_name.items()}


def about(by, name, n):
    """The producer runs ahead of the counted window by up to a few batches: per-batch counts of
    a call made once a batch land within a few percent of it."""
    return abs(by.get(name, 0) - n) <= 0.1


def forever(loader):
    while True:
        yield from loader


def bounded(by, limit):
    """At most `limit` calls a batch besides event queries and creations, and at most 10
    queries. The counts follow the timing: a poll of the pool's releases queries until it meets
    one not done yet, and a consumer that waits for its batch adds waits and the graves' query
    (11 calls a batch besides queries when the consumer never waits; 15 under ThreadSanitizer,
    where the producer is slow and the consumer waits for every batch)."""
    # events come from caches that grow to the most ever in flight, which the timing may still
    # raise now and then (counted apart, not bounded)
    others = sum(v for k, v in by.items() if k not in ("event_query", "event_create"))
    return others <= limit and by.get("event_query", 0) <= 10


@pytest.mark.parametrize("gather, limit", [("device", 16), ("host", 16)])
def test_array_loader_batch(gather, limit):
    arr = np.random.default_rng(0).integers(0, 255, (1 << 15, 512), dtype=np.uint8)
    with pinloader.ArrayLoader(arr, 256, seed=1, device="cpu", drop_last=True, gather=gather) as L:
        total, by = counts_per_batch(forever(L))
        assert L.stats()["gather"] == gather
    assert not set(NEVER) & set(by), by
    if gather == "device":
        assert about(by, "gather_launch", 1) and "memcpy_h2d_async" not in by, by
    else:
        assert about(by, "memcpy_h2d_async", 1) and "gather_launch" not in by, by
    assert about(by, "device_alloc", 1) and about(by, "stream_wait_event", 1), by
    assert bounded(by, limit), by


def test_prefetcher_batch_of_a_dict():
    items = [{"x": np.full((256, 64), i, np.float32), "y": np.arange(256) + i} for i in range(40)]
    with pinloader.AsyncPrefetcher(items * 20, device="cpu") as pf:
        total, by = counts_per_batch(pf)
    assert not set(NEVER) & set(by), by
    # both leaves in one staged region, one copy, one device block
    assert about(by, "memcpy_h2d_async", 1) and about(by, "device_alloc", 1), by
    assert bounded(by, 16), by
