"""Soak tests, marked slow: 20,000 small batches through one prefetcher, and 60 prefetchers made
and closed, with flat threads, file descriptors, device blocks, pool reservation and RSS
(host backend). The sanitizer jobs leave them out: ASan's quarantine holds freed memory, which
makes their RSS checks meaningless.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import pinloader
from helpers import count_fds, count_tasks, drain, live_blocks, val, wait_for, warm_up

DEVICE = "cpu"


@pytest.mark.slow  # RSS checks: not under ASan, whose quarantine holds freed memory
def test_soak_20000_small_batches_flat_resources():
    psutil = pytest.importorskip("psutil")
    warm_up()
    gc.collect()
    proc = psutil.Process()
    base_tasks = count_tasks()
    base_fds = count_fds()
    base_blocks = live_blocks()

    n, depth = 20000, 4
    table = [np.full(16, i, dtype=np.int32) for i in range(997)]

    def src():
        for i in range(n):
            yield {"i": i, "x": table[i % 997], "y": np.arange(i % 13, dtype=np.float32), "s": "meta"}

    samples = {}
    pf = pinloader.AsyncPrefetcher(src(), device=DEVICE, depth=depth)
    try:
        count = 0
        while True:
            try:
                b = next(pf)
            except StopIteration:
                break
            assert b["i"] == count
            if count % 97 == 0:  # spot checks keep the loop fast
                assert (val(b["x"]) == count % 997).all()
                assert val(b["y"]).shape == (count % 13,)
            count += 1
            if count in (n // 4, n // 2, 3 * n // 4, n):
                del b
                gc.collect()
                st = pf.stats()
                samples[count] = dict(
                    rss=proc.memory_info().rss,
                    reserved=st["pool_bytes_reserved"],
                    blocks=live_blocks()[0] - base_blocks[0],
                    fds=count_fds(),
                    tasks=count_tasks(),
                )
        assert count == n
        st = pf.stats()
        assert st["batches"] == n
    finally:
        pf.close()
    first, mid, end = samples[n // 4], samples[n // 2], samples[n]
    # RSS: the 2nd half must not grow (some allocator warm-up is allowed in the 1st)
    assert end["rss"] - mid["rss"] < 8 << 20, f"RSS grew {(end['rss'] - mid['rss']) >> 20} MiB in the 2nd half"
    assert end["rss"] - first["rss"] < 16 << 20
    assert end["reserved"] == mid["reserved"] == first["reserved"], samples
    for s in samples.values():
        assert s["blocks"] <= depth + 3, samples  # queued + in flight, nothing accumulates
    assert end["fds"] == mid["fds"] == first["fds"], samples
    assert end["tasks"] == mid["tasks"], samples
    gc.collect()
    assert wait_for(lambda: count_tasks() <= base_tasks), (count_tasks(), base_tasks)
    assert count_fds() <= base_fds
    assert wait_for(lambda: live_blocks()[0] <= base_blocks[0]), (live_blocks(), base_blocks)


@pytest.mark.slow  # RSS checks: not under ASan, whose quarantine holds freed memory
def test_repeated_create_close_returns_threads_and_memory():
    psutil = pytest.importorskip("psutil")
    warm_up()
    proc = psutil.Process()
    base_tasks = count_tasks()
    base_fds = count_fds()
    rss = []
    for round_ in range(60):
        pf = pinloader.AsyncPrefetcher([{"x": np.arange(5000)}] * 5, device=DEVICE, depth=3,
                                       staging_threads=2)
        assert len(drain(pf)) == 5
        pf.close()
        if round_ in (20, 59):
            gc.collect()
            rss.append(proc.memory_info().rss)
    assert wait_for(lambda: count_tasks() <= base_tasks), (count_tasks(), base_tasks)
    assert count_fds() <= base_fds
    assert rss[1] - rss[0] < 8 << 20
