"""The memory layer under hostile sizes, fork() and a consumer that skips the ready wait.

Host backend only. Sizes: every rounding in the pool and the host backend is checked (Note
[checked sizes] in src/core/util.h), so absurd requests raise a clear error and never wrap. Fork:
objects made before fork() fail fast in the child (Note [pool after fork] in src/core/pool.c), objects
made in the child work, and nothing takes a lock a parent thread may have held. Everything that
could hang or crash on a bug runs in a subprocess under a timeout.
"""
import ctypes
import math
import os
import threading

import numpy as np
import pytest

import pinloader
from pinloader import _C

from helpers import WAIT_CHILD, describe, drain, run_child

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_py(code, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if "TSAN_OPTIONS" in env:
        # ThreadSanitizer cannot follow a thread started in the child of a multi-threaded
        # fork (it dies, or with die_after_fork=0 fails a CHECK on reused thread ids): under
        # it the fork children below skip the part that starts host stream threads.
        env["PL_TEST_CHILD_THREADS"] = "0"
    env.pop("PINLOADER_DEBUG", None)
    return run_child(code, env, timeout, cwd=ROOT)


# ---- sizes ----

@pytest.mark.parametrize("max_bytes, exc", [
    (0, ValueError), (-1, ValueError), (-(2**70), ValueError),
    (2**64, OverflowError), (2**80, OverflowError), (1.5, TypeError), ("1", TypeError),
])
def test_pool_cap_refused_cleanly(max_bytes, exc):
    with pytest.raises(exc, match="max_bytes"):
        pinloader.PinnedPool(max_bytes=max_bytes, device="cpu")


def test_pool_cap_at_the_top_of_size_t_never_wraps():
    pool = pinloader.PinnedPool(max_bytes=2**64 - 1, device="cpu")
    assert pool.max_bytes == 2**64 - 1
    # Larger than any buffer: refused before the pool is asked.
    for n in (2**63, 2**64 - 200, 2**64 - 1):
        with pytest.raises(pinloader.PoolExhausted, match=str(n)):
            pool.alloc(n)
    # Fits the cap, but no address space holds it: the OS refuses, the pool stays consistent.
    for n in (2**63 - 1, 2**63 - 256, 2**62):
        with pytest.raises(MemoryError):
            pool.alloc(n)
    s = pool.stats()
    assert s["in_use_bytes"] == 0 and s["regions"] == 0 and s["reserved_bytes"] == 0, s
    with pool.alloc(1000) as b:               # still an ordinary pool
        np.frombuffer(b, np.uint8)[:] = 3
        assert b.nbytes == 1000
    pool.close()


@pytest.mark.parametrize("n, exc", [
    (-1, ValueError), (-(2**64), ValueError), (2**64, OverflowError), (2**100, OverflowError),
    (1.0, TypeError), (None, TypeError),
])
def test_alloc_size_refused_cleanly(n, exc):
    pool = pinloader.PinnedPool(max_bytes=1 << 20, device="cpu")
    with pytest.raises(exc, match="nbytes"):
        pool.alloc(n)
    assert pool.stats()["regions"] == 0


@pytest.mark.parametrize("n", [2**62, 2**63 - 1, (1 << 20) + 1, (1 << 20) * 2])
def test_alloc_over_cap_is_pool_exhausted(n):
    pool = pinloader.PinnedPool(max_bytes=1 << 20, device="cpu")
    with pytest.raises(pinloader.PoolExhausted, match="never fit"):
        pool.alloc(n)
    assert pool.stats()["slabs"] == 0


def test_alloc_exactly_the_cap_when_rounding_would_pass_it():
    # Rounding (Note [region sizes]) would take 2**20 + 2**17 - ...; the request still fits.
    pool = pinloader.PinnedPool(max_bytes=(1 << 20) + 1, device="cpu")
    with pool.alloc((1 << 20) + 1) as b:
        assert b.nbytes == (1 << 20) + 1
    assert pool.stats()["reserved_bytes"] <= (1 << 20) + 1


def test_timeout_nan_refused_and_inf_means_no_limit():
    pool = pinloader.PinnedPool(max_bytes=1 << 16, device="cpu")
    with pytest.raises(ValueError, match="timeout"):
        pool.alloc(100, timeout=float("nan"))
    with pytest.raises(ValueError, match="timeout"):
        pool.alloc(100, timeout=-1e-9)
    with pytest.raises(ValueError, match="timeout"):
        pool.alloc(100, timeout=float("-inf"))
    first = pool.alloc(1 << 16, timeout=float("inf"))
    # The pool is full: an infinite (or absurdly long) timeout waits until a region comes back.
    for timeout in (float("inf"), 1e300, 2.0**63):
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("b", pool.alloc(1 << 16, timeout=timeout)))
        t.start()
        t.join(0.2)
        assert t.is_alive(), "alloc returned while the pool was full"
        first.release()
        t.join(30)
        assert not t.is_alive()
        first = got["b"]
        assert first.nbytes == 1 << 16
    first.release()


def test_private_pool_cap_never_raised_past_the_default():
    # A 2**62-byte zero-stride leaf must not raise the prefetcher's pinned bound past the
    # documented default (it once became 2**61).
    leaf = np.broadcast_to(np.zeros((), np.uint8), (2**62,))
    with pinloader.AsyncPrefetcher([leaf], device="cpu") as pf:
        with pytest.raises(pinloader.PoolExhausted, match="never fit"):
            next(pf)
        assert pf.stats()["pinned_cap"] <= _C.default_pinned_cap()


# ---- the held-copy test switch (Note [held copies] in src/core/backend_host.c) ----

def test_hold_switch_makes_a_missing_ready_wait_visible():
    n = 1 << 16
    src = [np.full(n, 7, np.uint8), np.full(n, 9, np.uint8)]
    _C._debug_hold_copies(True)
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
        _C._debug_hold_copies(False)
    t.join(30)
    assert not t.is_alive()
    assert (got["x"] == 7).all()
    rest = drain(pf)
    assert [int(np.from_dlpack(x)[0]) for x in rest] == [9]
    assert ctypes.string_at(b.ptr, n) == b"\x07" * n  # after the wait, the raw bytes too
    pf.close()


# ---- fork ----

FORK_PRELUDE = """
import gc, os, sys, threading, time, warnings
import numpy as np
import pinloader
from pinloader import _C
warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads, 3.12+
""" + WAIT_CHILD.format(timeout=10.0, poll=0.002) + """
def child(fn):
    code = 99
    try:
        code = fn()
    except BaseException as e:
        sys.stderr.write(f"child: {type(e).__name__}: {e}\\n")
    finally:
        os._exit(code)

def fresh_pool_works():
    with pinloader.PinnedPool(max_bytes=1 << 22, device="cpu") as pool:
        with pool.alloc(12345) as b:
            v = np.frombuffer(b, np.uint8)
            v[:] = 5
            assert int(v.sum()) == 5 * 12345
            del v
        assert pool.stats()["slabs"] == 1
        assert pool.trim() > 0
    if os.environ.get("PL_TEST_CHILD_THREADS") == "0":
        return 0
    # The host backend's streams and events work in the child too (new worker threads).
    p = _C._Prim("cpu")
    s, e = p.stream(), p.event()
    p.record(e, s)
    p.event_synchronize(e)
    p.stream_synchronize(s)
    p.event_destroy(e)
    p.stream_destroy(s)
    return 0

def expect_forked(f):
    try:
        f()
    except RuntimeError as e:
        assert "fork" in str(e), e
        return
    except BufferError as e:
        assert "fork" in str(e), e
        return
    raise AssertionError(f"{f} worked on an inherited object")
"""


def test_child_of_a_parent_that_only_imported_creates_pools():
    code = FORK_PRELUDE + """
pid = os.fork()
if pid == 0:
    child(fresh_pool_works)
print("CHILD", wait_child(pid), flush=True)
"""
    p = run_py(code)
    assert "CHILD 0" in p.stdout, describe(p)


def test_inherited_pool_buffer_and_device_array_fail_fast_fresh_ones_work():
    code = FORK_PRELUDE + """
pool = pinloader.PinnedPool(max_bytes=1 << 22, device="cpu")
buf = pool.alloc(4096)
np.frombuffer(buf, np.uint8)[:] = 1
_C._debug_hold_copies(True)            # the batch's copy is queued, not done, at fork time
pf = pinloader.AsyncPrefetcher([np.full(1000, 3, np.int32)] * 3, device="cpu", depth=2)
batch = next(pf)

def in_child():
    for f in (lambda: pool.alloc(10), pool.trim, pool.stats, lambda: memoryview(buf),
              buf.__dlpack__, lambda: buf.ptr, batch.__dlpack__, lambda: np.from_dlpack(batch)):
        expect_forked(f)
    assert "fork" in repr(pool)
    pool.close()                        # no-op, no lock, no hang
    buf.release()
    _C._debug_hold_copies(False)
    fresh_pool_works()
    return 0

pid = os.fork()
if pid == 0:
    child(in_child)
status = wait_child(pid)
_C._debug_hold_copies(False)
print("CHILD", status, flush=True)
print("PARENT", [int(np.from_dlpack(b)[0]) for b in [batch] + [next(pf) for _ in range(2)]],
      int(np.frombuffer(buf, np.uint8).sum()), flush=True)
pf.close()
buf.release()
print("TRIM", pool.trim() > 0, flush=True)
"""
    p = run_py(code)
    assert "CHILD 0" in p.stdout, describe(p)
    assert "PARENT [3, 3, 3] 4096" in p.stdout, describe(p)
    assert "TRIM True" in p.stdout, describe(p)


def test_fork_while_threads_hammer_pool_and_streams_never_deadlocks():
    # Parent threads hammer a pool (alloc, release, trim: its mutex is often held) and host
    # streams and events (the host backend's process-wide locks) while the main thread forks.
    # Each child must fail fast on the inherited pool, close it, and make a fresh pool and
    # stream of its own, without hanging on a lock held at fork time. (No prefetcher runs here:
    # its producer creates a Python thread state per batch, and CPython 3.11 can itself hang in
    # a child forked while another thread does that, before any of pinloader's code runs.)
    code = FORK_PRELUDE + """
pool = pinloader.PinnedPool(max_bytes=1 << 22, device="cpu")
stop = threading.Event()

def hammer_pool():
    while not stop.is_set():
        bs = [pool.alloc(n) for n in (1000, 70000, 300)]
        for b in bs:
            b.release()
        pool.trim()

def hammer_streams():
    # Host streams, events and the device-block cache: their worker threads take the host
    # backend's process-wide locks without the GIL, so a fork often lands while one is held.
    p = _C._Prim("cpu")
    s, e = p.stream(), p.event()
    while not stop.is_set():
        blocks = [p.device_alloc(n, s) for n in (4096, 100000, 4096)]
        for _ in range(4):
            p.record(e, s)
        p.event_synchronize(e)
        for d in blocks:
            p.device_free(d, s)
        p.stream_synchronize(s)
    p.event_destroy(e)
    p.stream_destroy(s)

def in_child():
    expect_forked(pool.trim)
    pool.close()
    return fresh_pool_works()

threads = [threading.Thread(target=hammer_pool), threading.Thread(target=hammer_streams)]
for t in threads:
    t.start()
results = {}
for i in range(N_FORKS):
    pid = os.fork()
    if pid == 0:
        child(in_child)
    st = wait_child(pid)
    results[st] = results.get(st, 0) + 1
stop.set()
for t in threads:
    t.join()
print("RESULTS", sorted(results.items(), key=str), flush=True)
"""
    n = 200
    p = run_py(code.replace("N_FORKS", str(n)), timeout=300)
    assert f"RESULTS [(0, {n})]" in p.stdout, describe(p)
