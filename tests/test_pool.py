"""PinnedPool (src/core/pool.c, src/py/pinned_pool.c) on the host backend: allocation.

Many threads allocating and releasing at once never get overlapping regions nor pass the cap;
same-sized requests reuse the same extents and a steady mix stops creating slabs; every region is
256-byte aligned and rounded by at most 1/8 of the request (also as a property); at the cap an
allocation waits until room is made, times out with PoolExhausted naming the numbers, is refused
at once when it can never fit, and is interrupted by Ctrl-C; a region a copy still reads
(pending) is neither reused nor trimmed. (Buffers and the pool's lifecycle: test_pool_buffers.py;
absurd sizes: test_pool_hostile.py; the default pool and its clients: test_default_pool.py.)

No assertion depends on how long something takes, only on what may or may not happen: a blocked
allocation must not return while the cap is full, and must return (within a generous bound) once
room is made.
"""
from __future__ import annotations

import bisect
import json
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pinloader
from pinloader import PinnedPool, PoolExhausted, _C
from helpers import ALIGN, KiB, MiB, child_env, pool_stats, run_c_check, values, wait_for

JOIN_S = 30.0  # bound on waits that must end: a hang becomes a failure


# ---- many threads at once ----

class LiveRanges:
    """[ptr, ptr + nbytes) of every live buffer; add() reports any overlap."""

    def __init__(self):
        self.lock = threading.Lock()
        self.starts: list[int] = []
        self.ends: dict[int, int] = {}
        self.max_live = 0
        self.live_bytes = 0  # bytes of the live buffers, as the users hold them
        self.max_live_bytes = 0

    def add(self, ptr, n):
        with self.lock:
            i = bisect.bisect_left(self.starts, ptr)
            if i < len(self.starts) and self.starts[i] < ptr + n:
                nxt = self.starts[i]
                return f"[{ptr:#x}, {ptr + n:#x}) overlaps live [{nxt:#x}, {self.ends[nxt]:#x})"
            if i > 0 and self.ends[self.starts[i - 1]] > ptr:
                prv = self.starts[i - 1]
                return f"[{ptr:#x}, {ptr + n:#x}) overlaps live [{prv:#x}, {self.ends[prv]:#x})"
            self.starts.insert(i, ptr)
            self.ends[ptr] = ptr + n
            self.max_live = max(self.max_live, len(self.starts))
            self.live_bytes += n
            self.max_live_bytes = max(self.max_live_bytes, self.live_bytes)
            return None

    def remove(self, ptr):
        with self.lock:
            i = bisect.bisect_left(self.starts, ptr)
            assert self.starts[i] == ptr
            del self.starts[i]
            self.live_bytes -= self.ends.pop(ptr) - ptr


def stamp(buf, token):
    """Write an owner token across the buffer: a uint64 every 4 KiB, the last whole uint64,
    and the token's low byte in the bytes after it (all of a buffer under 8 bytes)."""
    a = np.frombuffer(buf, np.uint8)
    k = a.size // 8 * 8
    if k:
        w = a[:k].view(np.uint64)
        w[::512] = token
        w[-1] = token
    a[k:] = token & 0xFF


def stamp_ok(buf, token):
    a = np.frombuffer(buf, np.uint8)
    k = a.size // 8 * 8
    if k:
        w = a[:k].view(np.uint64)
        if not ((w[::512] == token).all() and w[-1] == token):
            return False
    return bool((a[k:] == (token & 0xFF)).all())


STRESS_THREADS = 8
STRESS_OPS = 100_000  # allocations in total (each also released: 200k pool calls)
STRESS_CAP = 16 * MiB  # small enough that threads regularly wait at the cap
MAX_SIZE = 2 * MiB


def rand_size(rng):
    r = rng.random()
    if r < 0.25:
        return rng.randint(1, 512)
    if r < 0.85:
        return int(2 ** rng.uniform(9, 21))  # log-uniform 512 B .. 2 MiB
    return rng.randint(MAX_SIZE // 2, MAX_SIZE)


def test_stress_threads_no_overlap_no_overrun(make_pool):
    pool = make_pool(STRESS_CAP)
    live = LiveRanges()
    errors: list[str] = []
    samples: list[dict] = []
    ops_done = [0] * STRESS_THREADS
    exhausted = [0] * STRESS_THREADS
    per_thread = STRESS_OPS // STRESS_THREADS
    stop = threading.Event()
    barrier = threading.Barrier(STRESS_THREADS)

    def release(entry):
        buf, token, n = entry
        if not stamp_ok(buf, token):
            errors.append(f"{n}-byte region at {buf.ptr:#x} was overwritten while held")
        live.remove(buf.ptr)  # before release: once released the range may be handed out
        buf.release()

    def worker(tid):
        rng = random.Random(1234 + tid)
        held = []
        max_held = rng.randint(2, 6)
        try:
            barrier.wait(JOIN_S)
            while ops_done[tid] < per_thread and not errors:
                if held and (len(held) >= max_held or rng.random() < 0.45):
                    release(held.pop(rng.randrange(len(held))))
                    continue
                n = rand_size(rng)
                try:
                    buf = pool.alloc(n, timeout=0.02)
                except PoolExhausted:
                    # Everyone may be holding while waiting: give back what this thread holds.
                    exhausted[tid] += 1
                    while held:
                        release(held.pop())
                    continue
                ops_done[tid] += 1
                token = (tid << 56) | (ops_done[tid] << 8) | 0x5A
                if buf.nbytes != n or len(buf) != n:
                    errors.append(f"asked {n} bytes, got nbytes={buf.nbytes} len={len(buf)}")
                if buf.ptr % ALIGN:
                    errors.append(f"region {buf.ptr:#x} is not {ALIGN}-byte aligned")
                clash = live.add(buf.ptr, n)
                if clash:
                    errors.append("region handed out twice: " + clash)
                    return
                stamp(buf, token)
                held.append((buf, token, n))
                if ops_done[tid] % 2000 == 0:
                    samples.append(pool.stats())
            while held:
                release(held.pop())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {tid}: {e!r}")

    threads = [threading.Thread(target=worker, args=(t,), daemon=True)
               for t in range(STRESS_THREADS)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and time.monotonic() - t0 < 120:
        samples.append(pool.stats())
        stop.wait(0.01)
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "stress workers hung"
    assert errors == [], errors[:5]
    assert sum(ops_done) == per_thread * STRESS_THREADS

    assert len(samples) > 10
    for s in samples:
        assert s["reserved_bytes"] <= s["max_bytes"] == STRESS_CAP, s
        assert s["in_use_bytes"] <= s["reserved_bytes"], s
    end = pool_stats(pool)
    assert end["in_use_bytes"] == 0, end
    assert end["regions"] == 0, end
    assert end["pending"] == 0, end
    assert end["peak_reserved_bytes"] <= STRESS_CAP, end
    assert end["peak_in_use_bytes"] <= STRESS_CAP, end
    assert end["allocs_cached"] + end["allocs_new"] == STRESS_OPS, end
    assert live.max_live > STRESS_THREADS  # threads really did hold buffers concurrently
    # The cap, observed from outside the pool: the bytes the threads held at once never
    # exceeded it, and they did press against it (so the bound above was tested, not implied).
    assert live.max_live_bytes <= STRESS_CAP, live.max_live_bytes
    assert live.max_live_bytes > STRESS_CAP // 2, live.max_live_bytes
    assert sum(exhausted) > 0 or end["waits"] > 0, "no allocation ever had to wait at the cap"
    assert end["peak_in_use_bytes"] >= live.max_live_bytes, end
    # The pool still works, and is whole again, after the storm.
    with pool.alloc(STRESS_CAP // 2, timeout=JOIN_S) as b:
        assert b.nbytes == STRESS_CAP // 2


# ---- reuse ----

def test_same_sized_allocs_reuse_slabs(make_pool):
    pool = make_pool(8 * MiB)
    n, k = 300_000, 3
    first_ptrs = None
    for i in range(50):
        bufs = [pool.alloc(n) for _ in range(k)]
        ptrs = sorted(b.ptr for b in bufs)
        for b in bufs:
            b.release()
        if i == 0:
            s0 = pool_stats(pool)
            first_ptrs = ptrs
        else:
            assert ptrs == first_ptrs, "same-sized batches should get the very same extents"
    s = pool_stats(pool)
    assert s["slabs_created"] == s0["slabs_created"] == 1
    assert s["allocs_new"] == s0["allocs_new"] == 1
    assert s["allocs_cached"] == 50 * k - 1
    assert s["reserved_bytes"] == s0["reserved_bytes"]
    assert s["slabs_freed"] == 0
    assert s["in_use_bytes"] == 0 and s["regions"] == 0


def test_steady_state_mixed_sizes_stop_creating_slabs(make_pool):
    pool = make_pool(32 * MiB)
    sizes = [1, 4096, 100_000, 1_000_000, 3_000_000, 77]
    for _ in range(5):
        bufs = [pool.alloc(n) for n in sizes]
        del bufs  # dealloc without release() also returns regions
    s0 = pool_stats(pool)
    assert s0["in_use_bytes"] == 0 and s0["regions"] == 0
    for _ in range(30):
        bufs = [pool.alloc(n) for n in sizes]
        for b in bufs:
            b.release()
    s = pool_stats(pool)
    assert s["slabs_created"] == s0["slabs_created"]
    assert s["allocs_new"] == s0["allocs_new"]
    assert s["allocs_cached"] - s0["allocs_cached"] == 30 * len(sizes)


# ---- alignment and rounding ----

def max_reserved(n):
    """Documented bound on rounding: 256-byte granules, and at most 1/8 of the request."""
    return max(ALIGN, n + max(ALIGN - 1, n // 8))


def test_alignment_and_waste_many_live(make_pool):
    pool = make_pool(64 * MiB)
    rng = random.Random(7)
    sizes = [0, 1, 2, 255, 256, 257, 511, 1000, 2047, 2048, 2049, 4095, 4096, 4097,
             65535, 65536, 65537, 1_000_000, 2 * MiB - 1, 2 * MiB + 1]
    sizes += [rng.randint(1, 3 * MiB) for _ in range(40)]
    live = LiveRanges()
    bufs = []
    total_requested = 0
    for n in sizes:
        before = pool_stats(pool)["in_use_bytes"]
        b = pool.alloc(n)
        r = pool_stats(pool)["in_use_bytes"] - before
        assert b.ptr % ALIGN == 0, (n, hex(b.ptr))
        assert b.nbytes == n
        assert r % ALIGN == 0 and r >= max(n, 1), (n, r)
        assert r <= max_reserved(n), f"request of {n} bytes reserved {r}"
        assert live.add(b.ptr, max(r, 1)) is None  # reserved extents are disjoint too
        bufs.append(b)
        total_requested += n
    s = pool_stats(pool)
    assert s["regions"] == len(sizes)
    assert s["in_use_bytes"] <= sum(max_reserved(n) for n in sizes)
    for b in bufs:
        b.release()
    assert pool_stats(pool)["in_use_bytes"] == 0


_hyp_pool = None


def _shared_pool():
    global _hyp_pool
    if _hyp_pool is None:
        _hyp_pool = PinnedPool(max_bytes=16 * MiB, device="cpu")
    return _hyp_pool


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.one_of(st.integers(0, 4096), st.integers(0, 8 * MiB)))
def test_rounding_bound_property(n):
    pool = _shared_pool()
    before = pool.stats()["in_use_bytes"]
    with pool.alloc(n) as b:
        r = pool.stats()["in_use_bytes"] - before
        assert b.ptr % ALIGN == 0
        assert r % ALIGN == 0 and max(n, 1) <= r <= max_reserved(n), (n, r)
    assert pool.stats()["in_use_bytes"] == before


# ---- the cap ----

def _fill(pool, n):
    b = pool.alloc(n, timeout=0)
    assert pool_stats(pool)["reserved_bytes"] <= pool.max_bytes
    return b


def test_blocking_alloc_returns_when_another_thread_releases(make_pool):
    pool = make_pool(1 * MiB)
    big = _fill(pool, 1 * MiB)
    result: dict = {}
    entered = threading.Event()

    def waiter():
        entered.set()
        try:
            result["buf"] = pool.alloc(4096)  # no timeout: waits for room
        except BaseException as e:  # noqa: BLE001
            result["err"] = e

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    assert entered.wait(JOIN_S)
    t.join(0.3)
    assert t.is_alive() and not result, f"alloc returned while the cap was full: {result}"
    assert pool_stats(pool)["in_use_bytes"] == 1 * MiB
    big.release()
    t.join(JOIN_S)
    assert not t.is_alive(), "blocked alloc did not return after a release made room"
    assert "err" not in result, result
    buf = result["buf"]
    assert buf.nbytes == 4096 and buf.ptr % ALIGN == 0
    s = pool_stats(pool)
    assert s["waits"] >= 1 and s["wait_s"] > 0, s
    buf.release()


def test_timeout_raises_pool_exhausted_with_numbers(make_pool):
    cap = 1 * MiB
    pool = make_pool(cap)
    a = _fill(pool, 768 * KiB)
    b = _fill(pool, 128 * KiB)
    in_use = pool_stats(pool)["in_use_bytes"]
    assert in_use == 896 * KiB
    want = 256 * KiB
    t0 = time.monotonic()
    with pytest.raises(PoolExhausted) as ei:
        pool.alloc(want, timeout=0.2)
    elapsed = time.monotonic() - t0
    assert elapsed >= 0.2, "timed out before the timeout"
    assert elapsed < JOIN_S
    e = ei.value
    assert isinstance(e, MemoryError)
    msg = str(e)
    assert str(want) in msg and str(cap) in msg and str(in_use) in msg, msg
    # timeout=0 polls once
    with pytest.raises(PoolExhausted):
        pool.alloc(want, timeout=0)
    # nothing leaked by the failed attempts
    s = pool_stats(pool)
    assert s["in_use_bytes"] == in_use and s["regions"] == 2
    b.release()
    with pool.alloc(want, timeout=0) as c:  # now it fits
        assert c.nbytes == want
    a.release()


def _in_thread(fn, timeout=JOIN_S):
    """Run fn in a daemon thread; return its result or exception, or fail if it hangs."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "call did not return"
    return out


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_request_over_cap_raises_at_once(make_pool, timeout):
    cap = 1 * MiB
    pool = make_pool(cap)
    out = _in_thread(lambda: pool.alloc(cap + 1, timeout=timeout))
    e = out.get("err")
    assert isinstance(e, PoolExhausted), out
    msg = str(e)
    assert str(cap + 1) in msg and str(cap) in msg, msg
    assert pool_stats(pool)["waits"] == 0  # it did not wait for room that can never come
    # An empty pool serves a request of exactly the cap.
    with pool.alloc(cap, timeout=0) as b:
        assert b.nbytes == cap


@pytest.mark.parametrize("cap,n", [(1000, 1000), (100_000_000, 99_000_000),
                                   (3 * MiB + 100, 3 * MiB + 1)])
def test_request_within_cap_fits_empty_pool(make_pool, cap, n):
    """A request no larger than the cap must be served by an empty pool, whatever the rounding
    granule; at the very least it must not fail as if the host were out of memory."""
    pool = make_pool(cap)
    out = _in_thread(lambda: pool.alloc(n, timeout=1.0))
    assert "err" not in out, f"alloc({n}) under cap {cap} failed: {out['err']!r}"
    buf = out["value"]
    assert buf.nbytes == n
    assert pool_stats(pool)["reserved_bytes"] <= cap
    buf.release()


def test_ctrl_c_interrupts_blocked_alloc():
    # The child's helper thread announces "blocked" once the pool has counted a wait, i.e. once
    # the main thread is inside alloc() waiting for room; only then does the parent send SIGINT.
    code = r"""
import json, sys, threading, time, pinloader
pool = pinloader.PinnedPool(max_bytes=1 << 20, device="cpu")
full = pool.alloc(1 << 20)

def announce():
    while pool.stats()["waits"] < 1:
        time.sleep(0.005)
    print("blocked", flush=True)

threading.Thread(target=announce, daemon=True).start()
try:
    pool.alloc(4096)
    print(json.dumps({"result": "returned"}), flush=True)
except KeyboardInterrupt:
    s = pool.stats()
    full.release()
    with pool.alloc(4096, timeout=5) as b:  # the pool is intact after the interrupt
        ok = b.nbytes == 4096
    print(json.dumps({"result": "KeyboardInterrupt", "waits": s["waits"],
                      "in_use": s["in_use_bytes"], "regions": s["regions"], "ok": ok}), flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        line = proc.stdout.readline()  # returns "" if the child dies first
        assert line.strip() == "blocked", line + proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)  # "promptly": well within this bound
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["result"] == "KeyboardInterrupt", res
    assert res["waits"] >= 1, res
    assert res["in_use"] == 1 << 20 and res["regions"] == 1, res  # the failed alloc leaked nothing
    assert res["ok"] is True


# ---- pending regions (held copies) ----

def test_pool_trim_frees_nothing_pending_and_pending_regions_are_not_reused():
    pool = pinloader.PinnedPool(max_bytes=2 * MiB, device="cpu")
    _C._testing.debug_hold_copies(True)
    try:
        pf = pinloader.AsyncPrefetcher([np.ones(MiB + MiB // 2, np.uint8)], device="cpu", pool=pool,
                                       depth=1)
        batch = next(pf)
        assert wait_for(lambda: pool.stats()["pending"] == 1, timeout=30.0, step=0.005), (
            "timed out waiting for the staged region to be pending")
        st = pool.stats()
        assert st["regions"] == 1 and st["in_use_bytes"] >= MiB + MiB // 2, st
        # trim() gives back only slabs with no live region: the pending one's slab stays
        assert pool.trim() == 0
        assert pool.stats()["slabs"] == st["slabs"] and pool.stats()["pending"] == 1
        # the pending region is neither reused nor counted as free: no room for another
        with pytest.raises(pinloader.PoolExhausted):
            pool.alloc(MiB, timeout=0.05)
        assert pool.stats()["pending"] == 1
    finally:
        _C._testing.debug_hold_copies(False)
    np.testing.assert_array_equal(values(batch), np.ones(MiB + MiB // 2, np.uint8))
    pf.close()
    assert wait_for(lambda: pool.stats()["pending"] == 0, timeout=30.0, step=0.005), (
        "timed out waiting for the region to come back")
    buf = pool.alloc(MiB, timeout=5)  # room again once the copy is done
    buf.release()
    assert pool.trim() > 0 and pool.stats()["slabs"] == 0
    pool.close()


def test_a_waiting_reservation_waits_on_the_oldest_release(tmp_path):
    # Note [slab reuse] in src/core/pool.c, against a fake backend (tests/pool_order_check.c):
    # waiting on the newest release would find the GPU idle when it wakes
    run_c_check(tmp_path, "pool_order_check.c",
                ["pool.c", "pool_debug.c", "pool_default.c", "util.c", "numa.c"])


def test_expected_waits_learn_from_untold_waits_and_forget_a_stall(tmp_path):
    # Note [expected waits] in src/core/backend_cuda.c, on a virtual clock (tests/pool_expect_check.c:
    # the clock its own, pl_event_poll's sleeps wrapped at link time): short copies are never told an
    # expectation, a stall is forgotten, long copies are told and then take fewer wake-ups and no
    # longer
    run_c_check(tmp_path, "pool_expect_check.c",
                ["pool.c", "pool_debug.c", "pool_default.c", "poll.c", "util.c", "numa.c"],
                link_flags=["-Wl,--wrap=pl_sleep_ns"], cflags=["-DPL_EXTERN_CLOCK"])


def test_deferred_frees_wait_for_their_uses_and_are_freed_where_memory_is_next_allocated(tmp_path):
    # Note [deferred frees] in src/core/block.c, against a fake backend (tests/block_deferred_check.c):
    # a dropped device block is freed on the next allocation's stream once its uses completed,
    # at most 64 wait, and running out of memory waits for them instead of failing
    run_c_check(tmp_path, "block_deferred_check.c", ["block.c", "util.c", "numa.c"])
