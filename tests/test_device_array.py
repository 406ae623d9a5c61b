"""DeviceArray (host backend): batches outlive their prefetcher, and no read comes before the copy.

A batch handed out stays valid after close() and after the prefetcher is gone (a NumPy view keeps
its block alive on its own); 1000 batches held at once are all intact while the pinned memory is
recycled. Batches are handed out once their copy is queued, not finished: a DLPack export waits
for the copy. The held-copy switch (pinloader._C._testing.debug_hold_copies, Note [held copies] in
src/core/backend_host.c) keeps copies queued, which makes that wait, or its absence, visible every
time. (The export arguments, export_capsules and its once-per-batch wait: test_dlpack_export.py.)
"""
from __future__ import annotations

import ctypes
import gc
import os
import threading

import numpy as np

import pinloader
from pinloader import _C
from helpers import check_good, drain, good, live_blocks, val, wait_for, warm_up

DEVICE = "cpu"


# ---- lifetimes -----------------------------------------------------------------------------------

def test_batch_used_after_close_still_holds_data():
    warm_up()
    base_blocks = live_blocks()
    pf = pinloader.AsyncPrefetcher((good(i) for i in range(50)), device=DEVICE, depth=4)
    held = [next(pf) for _ in range(3)]
    early_view = val(held[0]["x"])  # exported before close
    assert wait_for(lambda: pf.stats()["queued"] >= 2)
    pf.close()
    # the queued-but-not-handed-out batches are freed by close(); the held ones stay
    assert wait_for(lambda: live_blocks()[0] <= base_blocks[0] + 3), (live_blocks(), base_blocks)
    for i, b in enumerate(held):
        check_good(b, i)  # exported after close
    assert (early_view == 0).all()
    # DeviceArray attributes still answer
    leaf = held[2]["x"]
    assert leaf.shape == (4, 3) and leaf.dtype == np.int64 and leaf.nbytes == 96
    assert leaf.ptr != 0 and leaf.device == "cpu"
    del pf
    gc.collect()
    check_good(held[1], 1)
    del held, leaf, b
    gc.collect()
    assert (early_view == 0).all()  # a NumPy view keeps its block alive on its own
    del early_view
    gc.collect()
    assert wait_for(lambda: live_blocks()[0] <= base_blocks[0]), (live_blocks(), base_blocks)
def test_holding_1000_batches_alive():
    warm_up()
    base_blocks = live_blocks()
    n = 1000
    rng = np.random.default_rng(11)
    sizes = rng.integers(1, 300, size=n)

    def src():
        for i in range(n):
            yield {"i": i, "x": np.full(int(sizes[i]), i, dtype=np.int32), "y": np.float64(i)}

    with pinloader.AsyncPrefetcher(src(), device=DEVICE, depth=2) as pf:
        held = drain(pf)
        st = pf.stats()
    assert len(held) == n
    assert live_blocks()[0] >= base_blocks[0] + n
    # pinned memory was recycled, not grown per batch
    assert st["pinned_bytes_peak"] <= 4 << 20
    for i, b in enumerate(held):
        assert b["i"] == i
        x = val(b["x"])
        assert x.shape == (sizes[i],) and (x == i).all(), f"batch {i} corrupted"
        assert b["y"] == i
    del held, b, x
    gc.collect()
    assert wait_for(lambda: live_blocks()[0] <= base_blocks[0]), (live_blocks(), base_blocks)


# ---- the ready wait ------------------------------------------------------------------------------

def test_dlpack_export_waits_for_the_held_copy():
    # pinloader._C._testing.debug_hold_copies(True) holds the host backend's copy streams: every
    # copy issued after it stays queued until debug_hold_copies(False). A batch handed out while its
    # copy is held has not been filled yet, so a consumer that skipped the ready-event wait
    # would read unfilled memory every time, not only when a race happens to go that way.
    hold = _C._testing.debug_hold_copies
    n = 1 << 20
    src = np.frombuffer(os.urandom(n), dtype=np.uint8)  # fresh bytes: no stale copy can match
    released = threading.Event()

    def release():
        released.set()  # set first: whatever the export returns must come after this
        hold(False)

    watchdog = threading.Timer(30.0, release)  # never leave the copies held, whatever fails
    watchdog.start()
    pf = None
    try:
        hold(True)
        pf = pinloader.AsyncPrefetcher([{"x": src}], device=DEVICE, depth=1)
        b = next(pf)
        assert not released.is_set(), "next() waited for the held copy (it must hand out at once)"
        leaf = b["x"]
        assert leaf.nbytes == n
        # .ptr is the raw block: before the release the held copy has not filled it
        raw = ctypes.string_at(leaf.ptr, n)
        assert raw != src.tobytes(), "the block was filled while its copy was held"
        # the export waits for the copy: release from another thread a little later
        threading.Timer(0.2, release).start()
        got = np.from_dlpack(leaf)
        assert released.is_set(), "np.from_dlpack returned before the held copy was released"
        assert np.array_equal(got, src), "the export returned before the copy landed"
        assert ctypes.string_at(leaf.ptr, n) == src.tobytes()
    finally:
        if not released.is_set():
            release()
        watchdog.cancel()
        if pf is not None:
            pf.close()


def test_hold_switch_makes_a_missing_ready_wait_visible():
    n = 1 << 16
    src = [np.full(n, 7, np.uint8), np.full(n, 9, np.uint8)]
    _C._testing.debug_hold_copies(True)
    try:
        pf = pinloader.AsyncPrefetcher(src, device="cpu", depth=2)
        b = next(pf)
        # Reading the memory without the DLPack wait sees the poison, not the data: every time.
        assert ctypes.string_at(b.ptr, n) == b"\xcd" * n
        # The DLPack path waits for the copy: it cannot finish while the copy is held.
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("x", np.from_dlpack(b).copy()))
        t.start()
        t.join(0.2)
        assert t.is_alive() and "x" not in got
    finally:
        _C._testing.debug_hold_copies(False)
    t.join(30)
    assert not t.is_alive()
    assert (got["x"] == 7).all()
    rest = drain(pf)
    assert [int(np.from_dlpack(x)[0]) for x in rest] == [9]
    assert ctypes.string_at(b.ptr, n) == b"\x07" * n  # after the wait, the raw bytes too
    pf.close()
