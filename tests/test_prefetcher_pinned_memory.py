"""AsyncPrefetcher and pinned memory: pools, bounds and stall counters (host backend; the tests
that take `device` run on CUDA too, gpu-marked).

Prefetchers made without pool= draw from pinloader.default_pool(device), each bounded by its own
client (Note [pinned bound] in src/core/transfer.c, Note [default pool] in src/core/pool_default.c):
slabs outlive the prefetchers, the pool's cap holds with several at once, trim() gives idle slabs
back. max_pinned_bytes bounds a prefetcher within the default pool or a shared PinnedPool (pool=);
a batch that can never fit under the bound is refused with PoolExhausted at its position, and the
bound is never raised to make room for it. Each prefetcher's stall counters count only its own
waits.
"""
from __future__ import annotations

import gc
import threading
import time
import traceback

import numpy as np
import pytest

import pinloader
from pinloader import _C
from helpers import (
    KiB, MiB, check_good, count_tasks, describe, drain, good, live_blocks, run_py, val, values, wait_for,
    warm_up)

DEVICE = "cpu"


# ---- the default pool ----------------------------------------------------------------------------

# The tests that take `device` run on the host backend here and, on the GPU machine
# (`pytest -m gpu`), on CUDA too: the default pool of a CUDA device holds cudaHostRegister'ed
# slabs and its regions are released behind CUDA events.
CUDA = pinloader.cuda_available()
DEVICES = ["cpu", pytest.param("cuda:0", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="no CUDA device")])]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def batches(n, nbytes, seed=0):
    return [{"x": np.full(nbytes, (seed + i) % 251, np.uint8), "i": i} for i in range(n)]


def host_copy(leaf):
    if leaf.device.startswith("cuda"):
        import torch
        return torch.from_dlpack(leaf).cpu().numpy()
    return np.from_dlpack(leaf)


def check(out, items):
    assert len(out) == len(items)
    for b, it in zip(out, items):
        assert b["i"] == it["i"]
        np.testing.assert_array_equal(host_copy(b["x"]), it["x"])


def test_default_pool_is_exported_and_is_the_prefetchers_pool(device):
    pool = pinloader.default_pool(device)
    assert pool is pinloader._C.default_pool(device)
    assert pool.max_bytes == pinloader.default_pool_cap() <= pinloader.default_pinned_cap()
    items = batches(4, 3 * MiB + 5)
    before = pool.stats()["allocs_cached"] + pool.stats()["allocs_new"]
    with pinloader.AsyncPrefetcher(items, device=device) as pf:
        check(drain(pf), items)
        st = pf.stats()
    after = pool.stats()["allocs_cached"] + pool.stats()["allocs_new"]
    assert after - before == len(items)          # every staged batch came from the default pool
    assert st["pool_cap"] == pool.max_bytes
    assert 0 < st["pinned_bytes_peak"] <= st["pinned_cap"] <= st["pool_cap"]


def test_a_prefetcher_per_epoch_reuses_the_previous_epochs_slabs(device):
    pool = pinloader.default_pool(device)
    items = batches(6, 5 * MiB + 123)
    with pinloader.AsyncPrefetcher(items, device=device, depth=2) as pf:   # the first epoch
        check(drain(pf), items)
    before = pool.stats()
    for epoch in range(3):
        with pinloader.AsyncPrefetcher(items, device=device, depth=2) as pf:
            check(drain(pf), items)
            st = pf.stats()
        assert 0 < st["pinned_bytes_peak"] <= st["pinned_cap"] <= st["pool_cap"]
    after = pool.stats()
    assert after["slabs_created"] == before["slabs_created"], (before, after)
    assert after["allocs_new"] == before["allocs_new"], (before, after)
    assert after["allocs_cached"] == before["allocs_cached"] + 3 * len(items)


def test_per_prefetcher_bound_holds_within_the_default_pool(device):
    cap = 3 * MiB
    items = batches(30, 1 * MiB)
    with pinloader.AsyncPrefetcher(items, device=device, depth=4, max_pinned_bytes=cap) as pf:
        check(drain(pf), items)
        st = pf.stats()
    assert st["pinned_cap"] == cap
    assert 1 * MiB <= st["pinned_bytes_peak"] <= cap
    assert st["pool_cap"] == pinloader.default_pool_cap()


def test_default_pool_cap_holds_with_several_prefetchers_at_once(device):
    # Several threads, each with its own prefetcher of the default pool, at once: the pool never
    # exceeds its cap, each prefetcher stays within its own bound, and every batch arrives.
    pool = pinloader.default_pool(device)
    errors = []
    results = {}

    def work(k):
        try:
            items = batches(25, (k + 1) * 512 * KiB + 77 * k, seed=k)
            bound = (k + 2) * MiB
            with pinloader.AsyncPrefetcher(items, device=device, depth=3, max_pinned_bytes=bound) as pf:
                out = drain(pf)
                check(out, items)
                del out
                st = pf.stats()
            results[k] = st
            if st["pinned_bytes_peak"] > bound or st["pinned_cap"] != bound:
                errors.append((k, st))
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append((k, repr(e)))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert len(results) == 4
    st = pool.stats()
    assert st["peak_reserved_bytes"] <= st["max_bytes"]
    assert st["peak_in_use_bytes"] <= st["max_bytes"]


def test_trim_returns_idle_slabs_after_prefetchers_close(device):
    pool = pinloader.default_pool(device)
    items = batches(5, 9 * MiB)
    pfs = [pinloader.AsyncPrefetcher(items, device=device) for _ in range(2)]
    for pf in pfs:
        check(drain(pf), items)
    assert pool.stats()["reserved_bytes"] > 0
    for pf in pfs:
        pf.close()
    freed = pool.trim()
    st = pool.stats()
    assert freed > 0 and st["reserved_bytes"] == 0 and st["in_use_bytes"] == 0, (freed, st)
    # still usable afterwards: a new prefetcher pins again
    with pinloader.AsyncPrefetcher(items, device=device) as pf:
        check(drain(pf), items)
    assert pool.stats()["slabs_created"] > st["slabs_created"]


def test_open_prefetcher_keeps_its_regions_through_trim(device):
    pool = pinloader.default_pool(device)
    items = batches(3, 2 * MiB)
    with pinloader.AsyncPrefetcher(items, device=device) as pf:
        out = drain(pf)
        pool.trim()          # frees only slabs with no live region
        check(out, items)


# ---- the bound: max_pinned_bytes and the pool's cap ----------------------------------------------

def test_a_batch_over_the_bound_names_max_pinned_bytes():
    cap = 256 * KiB
    pf = pinloader.AsyncPrefetcher([{"x": np.zeros(1 * MiB, np.uint8)}], device=DEVICE,
                                   max_pinned_bytes=cap)
    try:
        with pytest.raises(pinloader.PoolExhausted) as info:
            next(pf)
    finally:
        pf.close()
    msg = str(info.value)
    assert str(1 * MiB) in msg and str(cap) in msg and "max_pinned_bytes" in msg, msg


def test_leaf_bigger_than_max_pinned_bytes():
    cap = 64 << 10
    big = np.zeros(1 << 20, dtype=np.uint8)  # 1 MiB, a multiple of 256: staged size == nbytes
    items = [good(0), good(1), {"x": big}, good(3)]
    pf = pinloader.AsyncPrefetcher(items, device=DEVICE, max_pinned_bytes=cap)
    try:
        got = []
        # Observed: pinloader.PoolExhausted (a MemoryError subclass), "item 0: a batch of N bytes
        # to stage can never fit under the pinned cap of M bytes (...)", at the batch's position
        # (an earlier build raised a plain MemoryError). A CudaError is accepted as well.
        with pytest.raises((MemoryError, pinloader.CudaError)) as info:
            while True:
                got.append(next(pf))
        assert len(got) == 2
        check_good(got[0], 0)
        check_good(got[1], 1)
        msg = str(info.value)
        assert msg.startswith("item"), msg
        assert str(big.nbytes) in msg, msg
        assert str(cap) in msg, msg
        with pytest.raises(StopIteration):
            next(pf)
    finally:
        pf.close()


@pytest.mark.parametrize("how", ["max_pinned_bytes", "shared-pool"])
def test_leaf_bigger_than_the_cap_raises_pool_exhausted(how):
    # PoolExhausted is pinloader's exception for "a pinned request cannot be met under the
    # pool's cap (it can never fit ...)": exactly this case, whether the cap comes from
    # max_pinned_bytes or from a shared PinnedPool.
    cap = 64 << 10
    kwargs = {"max_pinned_bytes": cap} if how == "max_pinned_bytes" else {
        "pool": pinloader.PinnedPool(max_bytes=cap, device=DEVICE)}
    pf = pinloader.AsyncPrefetcher([{"x": np.zeros(1 << 20, np.uint8)}], device=DEVICE, **kwargs)
    try:
        with pytest.raises(pinloader.PoolExhausted) as info:
            next(pf)
        assert str(1 << 20) in str(info.value) and str(cap) in str(info.value)
    finally:
        pf.close()


def test_pool_and_max_pinned_bytes_together_bound_the_prefetcher_within_the_pool():
    pool = pinloader.PinnedPool(max_bytes=8 << 20, device=DEVICE)
    with pinloader.AsyncPrefetcher([np.zeros(1)], device=DEVICE, pool=pool,
                                   max_pinned_bytes=64 << 10) as pf:
        assert pf.stats()["pinned_cap"] == 64 << 10
        assert pf.stats()["pool_cap"] == 8 << 20
    with pinloader.AsyncPrefetcher([{"x": np.zeros(1 << 20, np.uint8)}], device=DEVICE, pool=pool,
                                   max_pinned_bytes=64 << 10) as pf:
        with pytest.raises(pinloader.PoolExhausted, match="max_pinned_bytes"):
            next(pf)
    pool.close()


def test_max_pinned_bytes_above_the_default_pools_cap_gets_a_pool_of_its_own():
    code = """
    import numpy as np, pinloader
    # LOCAL_WORLD_SIZE makes the default pool's cap small; an explicit bound above it is honoured.
    shared = pinloader.default_pool_cap()
    big = 3 * shared
    assert big <= pinloader.default_pinned_cap()
    n = 2 * shared
    items = [{"x": np.broadcast_to(np.full((), 5, np.uint8), (n,))}]
    with pinloader.AsyncPrefetcher(items, device="cpu", max_pinned_bytes=big, depth=1) as pf:
        (b,) = list(pf)
        assert int(np.from_dlpack(b["x"])[n - 1]) == 5
        st = pf.stats()
        del b
    print("CAPS", st["pinned_cap"], st["pool_cap"], big, flush=True)
    print("DEFAULT", pinloader.default_pool("cpu").stats()["slabs_created"], flush=True)
    """
    p = run_py(code, timeout=120, env_extra={"LOCAL_WORLD_SIZE": "64"})
    assert p.returncode == 0, describe(p)
    cap, pool_cap, big = map(int, p.stdout.split("CAPS ")[1].split()[:3])
    assert cap == pool_cap == big, describe(p)
    assert "DEFAULT 0" in p.stdout, describe(p)     # the default pool was not touched


def test_private_pool_cap_saturates_at_the_default():
    # (depth + 2) x batch is more than the default cap: the cap stops at the default.
    default = pinloader.default_pinned_cap()
    n = default // 40
    b = np.broadcast_to(np.full((), 7, np.uint8), (n,))
    with pinloader.AsyncPrefetcher([{"x": b}], device=DEVICE, depth=64) as pf:
        (out,) = drain(pf)
        assert int(np.from_dlpack(out["x"])[n - 1]) == 7
        del out
        assert pf.stats()["pinned_cap"] == pinloader._C.default_pool_cap() <= default
@pytest.mark.hostile
def test_one_huge_broadcast_is_refused_by_the_cap_without_allocating():
    # Fits the layout (< PTRDIFF_MAX) but never the pinned cap: PoolExhausted at its position,
    # and the prefetcher's bound is not raised past the default to try (it was raised to 2**61).
    code = """
    import numpy as np, pinloader
    b = np.broadcast_to(np.zeros((), np.uint8), (2**62,))
    pf = pinloader.AsyncPrefetcher([{"x": b}], device="cpu")
    try:
        next(pf)
    except pinloader.PoolExhausted as e:
        print("EXHAUSTED", str(e), flush=True)
    print("CAP", pf.stats()["pinned_cap"], pinloader.default_pinned_cap(), flush=True)
    pf.close()
    """
    p = run_py(code, timeout=60, watchdog=True)
    assert "EXHAUSTED item 0: a batch of 4611686018427387904 bytes" in p.stdout, describe(p)
    cap, default = map(int, p.stdout.split("CAP ")[1].split())
    assert cap <= default, describe(p)


@pytest.mark.hostile
def test_private_pool_cap_never_raised_past_the_default():
    # A 2**62-byte zero-stride leaf must not raise the prefetcher's pinned bound past the
    # documented default (it once became 2**61).
    leaf = np.broadcast_to(np.zeros((), np.uint8), (2**62,))
    with pinloader.AsyncPrefetcher([leaf], device="cpu") as pf:
        with pytest.raises(pinloader.PoolExhausted, match="never fit"):
            next(pf)
        assert pf.stats()["pinned_cap"] <= _C.default_pinned_cap()


# ---- a shared PinnedPool -------------------------------------------------------------------------

def test_several_prefetchers_in_several_threads_sharing_one_pool():
    warm_up()
    base_tasks = count_tasks()
    base_blocks = live_blocks()
    cap = 2 << 20
    pool = pinloader.PinnedPool(max_bytes=cap, device=DEVICE)
    n_threads, n_batches = 4, 150
    errors = []
    results = {}

    def worker(t):
        try:
            rng = np.random.default_rng(t)
            sizes = rng.integers(1, 16 << 10, size=n_batches)

            def src():
                for i in range(n_batches):
                    yield {"t": t, "i": i, "x": np.full(int(sizes[i]), t * 100000 + i, dtype=np.int32)}

            count = 0
            with pinloader.AsyncPrefetcher(src(), device=DEVICE, pool=pool, depth=3) as pf:
                for b in pf:
                    assert b["t"] == t and b["i"] == count
                    x = val(b["x"])
                    assert x.shape == (sizes[count],)
                    assert (x == t * 100000 + count).all()
                    count += 1
                    if count % 25 == 0:
                        assert pool.stats()["reserved_bytes"] <= cap
            results[t] = count
        except BaseException as e:  # report in the main thread
            errors.append((t, repr(e), traceback.format_exc()))

    # The pool's in-use bytes, sampled from outside while the prefetchers share it.
    sampled = []
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            sampled.append(pool.stats()["in_use_bytes"])
            time.sleep(0.001)

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(n_threads)]
    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    stop.set()
    watcher.join(10)
    assert not any(th.is_alive() for th in threads), "a worker thread hung"
    assert not errors, errors[0][2]
    assert results == {t: n_batches for t in range(n_threads)}
    st = pool.stats()
    assert st["reserved_bytes"] <= cap
    assert st["peak_reserved_bytes"] <= cap
    assert sampled and max(sampled) <= cap, max(sampled)
    assert st["peak_in_use_bytes"] <= cap, st
    # the prefetchers did use the pool at the same time: more was in use at once than the
    # largest batch any one of them stages
    assert st["peak_in_use_bytes"] > (16 << 10) * 4, st
    assert wait_for(lambda: pool.stats()["in_use_bytes"] == 0), pool.stats()
    pool.close()
    gc.collect()
    assert wait_for(lambda: count_tasks() <= base_tasks), (count_tasks(), base_tasks)
    assert wait_for(lambda: live_blocks()[0] <= base_blocks[0]), (live_blocks(), base_blocks)


def test_close_while_waiting_on_a_shared_pool_cap():
    # The producer waits inside pl_pool_reserve on the shared pool's cap; close() sets the
    # prefetcher's stop (read by the pool without the prefetcher's mutex: an atomic).
    pool = pinloader.PinnedPool(max_bytes=2 << 20, device="cpu")
    held = pool.alloc(2 << 20)
    pf = pinloader.AsyncPrefetcher([{"x": np.ones(1 << 20, np.uint8)}], device=DEVICE, pool=pool)
    time.sleep(0.1)
    pf.close()
    assert pf.closed
    held.release()
    assert wait_for(lambda: pool.stats()["in_use_bytes"] == 0), pool.stats()


# ---- stall counters ------------------------------------------------------------------------------

def test_stall_counters_count_only_this_prefetchers_waits_on_the_default_pool():
    # A waits at its own small bound; B, on the same default pool while A is open, never does.
    a_items = batches(20, 1 * MiB)
    b_items = batches(20, 1000, seed=3)
    # Copies held: A's first region stays pending, so its second reserve must wait (its bound
    # fits one region), deterministically.
    pinloader._C._testing.debug_hold_copies(True)
    try:
        a = pinloader.AsyncPrefetcher(a_items, device=DEVICE, depth=4, max_pinned_bytes=1 * MiB + 512)
        time.sleep(0.2)
    finally:
        pinloader._C._testing.debug_hold_copies(False)
    try:
        with pinloader.AsyncPrefetcher(b_items, device=DEVICE, depth=2) as b:
            check(drain(b), b_items)
            b_stats = b.stats()
        check(drain(a), a_items)
        a_stats = a.stats()
    finally:
        a.close()
    assert b_stats["pinned_stalls"] == 0 and b_stats["pinned_stall_s"] == 0, b_stats
    assert a_stats["pinned_stalls"] >= 1, a_stats
    assert a_stats["pool_waits"] >= a_stats["pinned_stalls"]


def test_stall_counters_are_per_prefetcher_on_a_shared_pool():
    pool = pinloader.PinnedPool(max_bytes=4 << 20, device="cpu")
    held = pool.alloc(3 << 20)  # leaves 1 MiB
    big = [{"x": np.ones(2 << 20, np.uint8)}]  # can only fit once `held` is released
    a = pinloader.AsyncPrefetcher(big, device=DEVICE, pool=pool)
    try:
        time.sleep(0.1)  # A is now waiting for room
        small = [{"x": np.full(1000, i)} for i in range(40)]
        with pinloader.AsyncPrefetcher(small, device=DEVICE, pool=pool, depth=2) as b:
            got = [int(np.from_dlpack(x["x"])[0]) for x in b]
            b_stats = b.stats()
        assert got == list(range(40))
        held.release()
        out = drain(a)
        assert len(out) == 1 and int(np.from_dlpack(out[0]["x"])[0]) == 1
        a_stats = a.stats()
    finally:
        a.close()
    assert b_stats["pinned_stalls"] == 0, b_stats  # B never waited; A's waits are not B's
    assert a_stats["pinned_stalls"] == 1 and a_stats["pinned_stall_s"] > 0, a_stats


def test_stall_counted_once_per_reserve_that_waited():
    # The second (large) batch cannot fit next to the first, whose copy is held: its reserve
    # waits (seen as the pool's `waiting`) until the copy is let go. The small batches after it
    # always fit (each batch is exported, so at most depth + 1 copies are outstanding): exactly
    # one stall, whatever the timing.
    pool = pinloader.PinnedPool(max_bytes=8 * MiB, device="cpu")
    big = [np.full(MiB, i, dtype=np.uint8) for i in range(2)]
    small = [np.full(16 << 10, 10 + i, dtype=np.uint8) for i in range(20)]
    items = big + small
    _C._testing.debug_hold_copies(True)
    try:
        pf = pinloader.AsyncPrefetcher(items, device="cpu", pool=pool, depth=2,
                                       max_pinned_bytes=3 * MiB // 2)
        first = next(pf)  # queued; its copy is held, so its region stays pending
        assert wait_for(lambda: pool.stats()["waiting"] == 1, timeout=30.0, step=0.005), (
            "timed out waiting for the second batch's reserve to wait")
        assert pf.stats()["pinned_stalls"] == 0
    finally:
        _C._testing.debug_hold_copies(False)
    out = [values(first)] + [values(b) for b in drain(pf)]
    assert [o[0] for o in out] == [0, 1] + [10 + i for i in range(20)]
    st = pf.stats()
    assert st["pinned_stalls"] == 1, st
    assert pool.stats()["waits"] == 1 and pool.stats()["waiting"] == 0
    pf.close()
    pool.close()
