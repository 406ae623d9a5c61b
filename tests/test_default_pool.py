"""The process-wide default pool and per-client bounds within a shared pool (host backend).

Note [default pool] in src/core/pool_default.c: one pool per device shared by prefetchers made without
pool=, slabs kept until trim() or interpreter exit, capped by the documented default divided
among torchrun's local ranks. Note [pool clients] in src/core/pool.h: each owner is bounded by its own
cap within the pool, and its wait counters count only its own waits. (The default pool in a fork
child: test_fork.py; prefetchers on the default pool: test_prefetcher_pinned_memory.py.)
"""
from __future__ import annotations

import gc
import random
import threading

import numpy as np
import pytest

import pinloader
from pinloader import _C
from helpers import KiB, MiB, describe, run_py, wait_for


def test_default_pool_is_one_object_per_device_and_cannot_be_closed():
    pool = _C.default_pool("cpu")
    assert pool is _C.default_pool("cpu") is _C.default_pool(device="cpu")
    assert isinstance(pool, pinloader.PinnedPool) and pool.backend == "host"
    assert pool.max_bytes == _C.default_pool_cap() <= _C.default_pinned_cap()
    with pytest.raises(ValueError, match="cannot be closed"):
        pool.close()
    with pool.alloc(1000) as b:        # still usable after the refused close
        assert b.nbytes == 1000
    with pytest.raises(ValueError, match="device"):
        _C.default_pool("tpu")


def test_second_client_of_the_same_size_makes_no_new_slab():
    pool = _C.default_pool("cpu")
    sizes = [3 * MiB + 17, 200 * KiB, 5000]

    def one_client():
        c = pool.client()
        bufs = [c.alloc(n) for n in sizes]
        for b in bufs:
            np.frombuffer(b, np.uint8)[:] = 1
            b.release()
        return c.stats()

    first = one_client()
    before = pool.stats()
    for _ in range(3):                 # a prefetcher made per epoch: the same slabs every time
        st = one_client()
        assert st["waits"] == 0 and st["in_use_bytes"] == 0
    after = pool.stats()
    assert after["slabs_created"] == before["slabs_created"], (before, after)
    assert after["allocs_new"] == before["allocs_new"]
    assert after["allocs_cached"] == before["allocs_cached"] + 3 * len(sizes)
    assert first["peak_in_use_bytes"] >= sum(sizes)


def test_client_cap_is_its_own_bound_within_the_pool():
    pool = pinloader.PinnedPool(max_bytes=8 * MiB, device="cpu")
    a, b = pool.client(max_bytes=1 * MiB), pool.client(max_bytes=4 * MiB)
    with pytest.raises(pinloader.PoolExhausted, match="client"):
        a.alloc(1 * MiB + 1)
    with pytest.raises(pinloader.PoolExhausted):
        b.alloc(9 * MiB)               # over the pool's cap, which binds too
    held = a.alloc(700 * KiB)
    with pytest.raises(pinloader.PoolExhausted, match="timed out"):
        a.alloc(700 * KiB, timeout=0.05)   # over a's own cap, though the pool has room
    other = [b.alloc(1 * MiB) for _ in range(3)]   # b is not held back by a
    assert a.stats()["waits"] >= 1
    assert b.stats()["waits"] == 0, "b's counters must not count a's waits"
    # a's blocked alloc returns when a's own region comes back
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("x", a.alloc(700 * KiB, timeout=30)))
    t.start()
    t.join(0.1)
    assert t.is_alive()
    held.release()
    t.join(30)
    assert got["x"].nbytes == 700 * KiB
    assert a.stats()["peak_in_use_bytes"] <= 1 * MiB
    got["x"].release()
    for x in other:
        x.release()
    assert a.stats()["in_use_bytes"] == 0 and b.stats()["in_use_bytes"] == 0
    assert pool.stats()["in_use_bytes"] == 0


def test_pool_client_never_exceeds_its_bound():
    pool = pinloader.PinnedPool(max_bytes=8 * MiB, device="cpu")
    c = pool.client(max_bytes=MiB)
    a = c.alloc(MiB - 4096)
    # the pool has room, the client has not: its request waits for its own regions
    with pytest.raises(pinloader.PoolExhausted):
        c.alloc(64 << 10, timeout=0.05)
    other = pool.alloc(4 * MiB, timeout=1)  # the pool itself still serves others
    got = []
    t = threading.Thread(target=lambda: got.append(c.alloc(64 << 10, timeout=30)))
    t.start()
    assert wait_for(lambda: pool.stats()["waiting"] == 1, timeout=30.0, step=0.005), (
        "timed out waiting for the client's reserve to wait")
    assert not got and c.stats()["in_use_bytes"] <= MiB
    a.release()
    t.join(30)
    assert got and c.stats()["peak_in_use_bytes"] <= MiB, c.stats()
    assert c.stats()["waits"] >= 2  # the timed-out request and the one that waited
    got[0].release()
    other.release()
    pool.close()


def test_client_slabs_are_no_larger_than_its_cap():
    # A prefetcher bounded by max_pinned_bytes pins no more than that, even in a shared pool.
    pool = pinloader.PinnedPool(max_bytes=256 * MiB, device="cpu")
    small = pool.client(max_bytes=1 * MiB)
    with small.alloc(1000):
        assert pool.stats()["reserved_bytes"] <= 1 * MiB
    big = pool.client()
    with big.alloc(2 * MiB):             # an unbounded client gets an ordinary (64 MiB) slab
        assert pool.stats()["reserved_bytes"] >= 65 * MiB


def test_pool_cap_and_client_caps_hold_with_many_clients_at_once():
    cap = 6 * MiB
    pool = pinloader.PinnedPool(max_bytes=cap, device="cpu")
    client_caps = [1 * MiB, 2 * MiB, 3 * MiB, 4 * MiB]
    clients = [pool.client(max_bytes=c) for c in client_caps]
    errors = []
    overlap_checks = [0]

    def work(c, seed):
        rng = random.Random(seed)
        mine = []
        try:
            for i in range(150):
                if mine and (rng.random() < 0.5 or len(mine) > 2):
                    b, val = mine.pop(rng.randrange(len(mine)))
                    v = np.frombuffer(b, np.uint8)
                    if not (v == val).all():
                        errors.append("a region was overwritten while held")
                    del v
                    b.release()
                else:
                    n = rng.choice([1000, 100 * KiB, 300 * KiB, 700 * KiB])
                    if mine:
                        # Never wait long while holding: two threads of one client each
                        # holding half its cap and waiting for more would wait for ever.
                        try:
                            b = c.alloc(n, timeout=0.005)
                        except pinloader.PoolExhausted:
                            continue
                    else:
                        b = c.alloc(n, timeout=30)   # holding nothing: must succeed
                    val = rng.randrange(256)
                    np.frombuffer(b, np.uint8)[:] = val
                    mine.append((b, val))
                    s = c.stats()
                    if s["in_use_bytes"] > s["max_bytes"]:
                        errors.append(f"client over its cap: {s}")
                    overlap_checks[0] += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
        finally:
            for b, _ in mine:
                b.release()

    threads = [threading.Thread(target=work, args=(c, i)) for i, c in enumerate(clients * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors[:5]
    assert overlap_checks[0] > 0
    st = pool.stats()
    assert st["peak_reserved_bytes"] <= cap and st["peak_in_use_bytes"] <= cap, st
    for c, ccap in zip(clients, client_caps):
        s = c.stats()
        assert s["peak_in_use_bytes"] <= ccap, s
        assert s["in_use_bytes"] == 0
    assert st["in_use_bytes"] == 0


def test_client_dropped_before_its_buffers():
    # The pool owns the client's accounting: buffers may outlive the PoolClient object.
    pool = pinloader.PinnedPool(max_bytes=4 * MiB, device="cpu")
    c = pool.client(max_bytes=2 * MiB)
    bufs = [c.alloc(500 * KiB) for _ in range(3)]
    del c
    gc.collect()
    for b in bufs:
        np.frombuffer(b, np.uint8)[:] = 9
        b.release()
    assert pool.stats()["in_use_bytes"] == 0


def test_trim_gives_idle_slabs_of_the_default_pool_back():
    pool = _C.default_pool("cpu")
    c = pool.client()
    keep = c.alloc(100 * MiB)          # larger than a default slab: a slab of its own
    idle = c.alloc(1000)
    idle.release()
    pool.trim()
    st = pool.stats()
    assert st["slabs"] >= 1 and st["in_use_bytes"] >= 100 * MiB   # the live region's slab stays
    keep.release()
    freed = pool.trim()
    assert freed >= 100 * MiB
    st = pool.stats()
    assert st["slabs"] == 0 and st["reserved_bytes"] == 0, st


@pytest.mark.parametrize("lws, divisor", [("4", 4), ("1", 1), ("", 1), ("abc", 1), ("0", 1),
                                          ("-2", 1), ("3x", 1), ("99999999999999999999", 1)])
def test_local_world_size_divides_the_default_cap(lws, divisor):
    code = """
import threading
from pinloader import _C
cap = _C.default_pool_cap()
pool = _C.default_pool("cpu")
print("CAP", cap, _C.default_pinned_cap(), pool.max_bytes, flush=True)
"""
    p = run_py(code, timeout=120, env_extra={"LOCAL_WORLD_SIZE": lws})
    line = [x for x in p.stdout.splitlines() if x.startswith("CAP ")]
    assert line, describe(p)
    cap, full, pool_cap = map(int, line[0].split()[1:])
    assert cap == full // divisor == pool_cap, describe(p)


def test_shared_default_cap_holds_for_several_clients_under_many_ranks():
    # With many local ranks the per-process default cap is small enough to reach here.
    code = """
import threading
from pinloader import _C
cap = _C.default_pool_cap()
pool = _C.default_pool("cpu")
assert pool.max_bytes == cap
clients = [pool.client(max_bytes=cap // 2) for _ in range(4)]
errors = []
def work(c):
    try:
        for i in range(100):
            bufs = [c.alloc(cap // 16, timeout=30) for _ in range(2)]  # 4 x 2 x 1/16: no hold-and-wait
            for b in bufs:
                b.release()
    except Exception as e:
        errors.append(repr(e))
ts = [threading.Thread(target=work, args=(c,)) for c in clients]
for t in ts: t.start()
for t in ts: t.join()
st = pool.stats()
print("OK", not errors, st["peak_reserved_bytes"] <= cap, st["peak_in_use_bytes"] <= cap,
      all(c.stats()["peak_in_use_bytes"] <= cap // 2 for c in clients), errors[:3], flush=True)
"""
    lws = max(2, _C.default_pinned_cap() // (16 * MiB))   # a cap of about 16 MiB
    p = run_py(code, timeout=120, env_extra={"LOCAL_WORLD_SIZE": str(min(lws, 65536))})
    assert "OK True True True True []" in p.stdout, describe(p)


def test_interpreter_exit_with_default_pool_regions_alive():
    code = """
import numpy as np
from pinloader import _C
pool = _C.default_pool("cpu")
c = pool.client(max_bytes=1 << 22)
b = c.alloc(1 << 20)
v = np.frombuffer(b, np.uint8)     # an export alive at exit
v[:] = 1
print("DONE", flush=True)
"""
    p = run_py(code, timeout=120)
    assert p.returncode == 0 and "DONE" in p.stdout, describe(p)
