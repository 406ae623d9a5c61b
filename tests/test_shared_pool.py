"""Prefetchers on the process-wide default pool (host backend).

Prefetchers made without pool= draw from pinloader.default_pool(device), each bounded by its
own client (Note [pinned bound] in src/core/transfer.c, Note [default pool] in src/core/pool.c): slabs
outlive the prefetchers, the pool's cap holds with several at once, each prefetcher's bound and
stall counters are its own, trim() gives idle slabs back. And a fork() child makes its own.
"""
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import pinloader
from helpers import describe, drain, run_child

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KiB, MiB = 1 << 10, 1 << 20
DEVICE = "cpu"

# The tests that take `device` run on the host backend here and, on the GPU machine
# (`pytest -m gpu`), on CUDA too: the default pool of a CUDA device holds cudaHostRegister'ed
# slabs and its regions are released behind CUDA events.
CUDA = pinloader.cuda_available()
DEVICES = ["cpu", pytest.param("cuda:0", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="no CUDA device")])]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def run_py(code, timeout=120):
    env = dict(os.environ)
    env.pop("LOCAL_WORLD_SIZE", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return run_child(code, env, timeout, cwd=ROOT)


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
    env_lws = dict(os.environ)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT,
                       env={**env_lws, "LOCAL_WORLD_SIZE": "64",
                            "PYTHONPATH": ROOT + os.pathsep + env_lws.get("PYTHONPATH", "")})
    assert p.returncode == 0, describe(p)
    cap, pool_cap, big = map(int, p.stdout.split("CAPS ")[1].split()[:3])
    assert cap == pool_cap == big, describe(p)
    assert "DEFAULT 0" in p.stdout, describe(p)     # the default pool was not touched


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


def test_stall_counters_count_only_this_prefetchers_waits_on_the_default_pool():
    # A waits at its own small bound; B, on the same default pool while A is open, never does.
    a_items = batches(20, 1 * MiB)
    b_items = batches(20, 1000, seed=3)
    # Copies held: A's first region stays pending, so its second reserve must wait (its bound
    # fits one region), deterministically.
    pinloader._C._debug_hold_copies(True)
    try:
        a = pinloader.AsyncPrefetcher(a_items, device=DEVICE, depth=4, max_pinned_bytes=1 * MiB + 512)
        time.sleep(0.2)
    finally:
        pinloader._C._debug_hold_copies(False)
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


@pytest.mark.skipif("libtsan" in os.environ.get("LD_PRELOAD", ""),
                    reason="ThreadSanitizer cannot run threads started in the child of a "
                    "multi-threaded fork() (it dies, or with die_after_fork=0 aborts on a reused "
                    "thread id); the plain and ASan runs cover this test")
def test_fork_child_of_a_running_prefetcher_makes_its_own():
    code = """
    import os, signal, sys, time
    import numpy as np, pinloader
    items = [{"x": np.full(300000 + i, i % 251, np.uint8), "i": i} for i in range(40)]
    parent = pinloader.AsyncPrefetcher(items, device="cpu", depth=3)
    first = next(parent)                 # the producer is running, batches in flight
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                next(parent)
            except RuntimeError as e:
                assert "fork" in str(e), e
            else:
                raise AssertionError("the parent's prefetcher worked in the child")
            with pinloader.AsyncPrefetcher(items, device="cpu", depth=2) as pf:
                got = list(pf)
            assert len(got) == len(items)
            for b, it in zip(got, items):
                assert b["i"] == it["i"]
                assert np.array_equal(np.from_dlpack(b["x"]), it["x"])
            print("CHILD OK", len(got), flush=True)
            code = 0
        finally:
            os._exit(code)
    # (no faulthandler timer: its watchdog thread does not survive fork, and re-arming it in the
    # child waits for that thread)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            print("CHILD HUNG", flush=True)
            sys.exit(1)
        time.sleep(0.05)
    rest = [first]
    while True:                          # the rest of this epoch (iter() would start another)
        try:
            rest.append(next(parent))
        except StopIteration:
            break
    assert [b["i"] for b in rest] == list(range(len(items)))
    assert len(rest) == len(items)
    parent.close()
    print("CHILD STATUS", os.waitstatus_to_exitcode(status), flush=True)
    print("PARENT OK", len(rest), flush=True)
    """
    p = run_py(code, timeout=120)
    assert "CHILD OK 40" in p.stdout, describe(p)
    assert "CHILD STATUS 0" in p.stdout and "PARENT OK 40" in p.stdout, describe(p)
    assert p.returncode == 0, describe(p)
