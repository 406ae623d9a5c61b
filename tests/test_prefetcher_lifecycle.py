"""AsyncPrefetcher: lifecycle (host backend).

The context manager and close(), properties, the default device; what becomes of the threads,
the device blocks and the source when a prefetcher is dropped (with batches in flight, through a
reference cycle, collected on its own producer thread), when its construction fails, and at
interpreter exit. Interpreter exit runs in a subprocess under a timeout, with faulthandler armed
inside it, so a hang fails that test instead of the suite.
"""
from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest

import pinloader
from helpers import (
    assert_leaf_equal, check_good, count_tasks, describe, drain, good, live_blocks, run_py, wait_for,
    warm_up)

DEVICE = "cpu"


# ---- context manager, close, properties ----------------------------------------------------------

def test_context_manager_closes():
    src = [np.arange(3)] * 5
    with pinloader.AsyncPrefetcher(src, device=DEVICE) as pf:
        assert not pf.closed
        first = next(pf)
    assert pf.closed
    with pytest.raises(ValueError, match="closed"):
        next(pf)
    assert_leaf_equal(src[0], first)


def test_context_manager_closes_on_exception():
    class Oops(Exception):
        pass

    with pytest.raises(Oops):
        with pinloader.AsyncPrefetcher([np.arange(3)] * 5, device=DEVICE) as pf:
            next(pf)
            raise Oops
    assert pf.closed


def test_close_is_idempotent_and_blocks_further_use():
    pf = pinloader.AsyncPrefetcher([np.arange(3)] * 10, device=DEVICE)
    next(pf)
    pf.close()
    pf.close()
    pf.close()
    assert pf.closed
    with pytest.raises(ValueError, match="closed"):
        next(pf)
    with pytest.raises(ValueError, match="closed"):
        iter(pf)
    with pytest.raises(ValueError):
        with pf:
            pass
    # stats and repr still answer after close
    assert pf.stats()["batches"] >= 1
    assert "closed" in repr(pf)


def test_close_before_anything_consumed():
    pf = pinloader.AsyncPrefetcher([np.arange(3)] * 10, device=DEVICE)
    pf.close()
    assert pf.closed
    with pytest.raises(ValueError):
        next(pf)


def test_properties():
    src = [np.arange(3)]
    pf = pinloader.AsyncPrefetcher(src, device=DEVICE, depth=5, staging_threads=3)
    try:
        assert pf.device == "cpu"
        assert pf.depth == 5
        assert pf.source is src
        assert pf.staging_threads == 3
        assert pf.closed is False
        assert "cpu" in repr(pf)
    finally:
        pf.close()
    assert pf.closed is True


def test_default_device_without_cuda_is_host():
    if pinloader.cuda_available():
        pytest.skip("CUDA is usable here: device=None selects it")
    with pinloader.AsyncPrefetcher([np.arange(3)], device=None) as pf:
        assert pf.device == "cpu"
        (b,) = drain(pf)
        assert b.device == "cpu"
        assert pf.stats()["backend"] == "host"


def test_failed_construction_leaks_no_threads():
    warm_up()
    base = count_tasks()
    for _ in range(20):
        for kwargs in ({"depth": 0}, {"staging_threads": 0}, {"device": "gpu"}):
            with pytest.raises((TypeError, ValueError)):
                pinloader.AsyncPrefetcher([np.zeros(1)], **{"device": DEVICE, **kwargs})
        with pytest.raises(TypeError):
            pinloader.AsyncPrefetcher(5, device=DEVICE)
    gc.collect()
    assert count_tasks() <= base


# ---- dropping a prefetcher -----------------------------------------------------------------------

def test_dropping_prefetcher_with_batches_in_flight():
    warm_up()
    base_blocks = live_blocks()
    base_tasks = count_tasks()

    pf = pinloader.AsyncPrefetcher((good(i) for i in range(200)), device=DEVICE, depth=8)
    held = [next(pf), next(pf)]
    assert wait_for(lambda: pf.stats()["queued"] >= 4)  # batches in flight / queued
    assert live_blocks()[0] >= base_blocks[0] + 2
    del pf
    gc.collect()
    # the threads are gone, the batches handed out are intact
    assert wait_for(lambda: count_tasks() <= base_tasks), (count_tasks(), base_tasks)
    check_good(held[0], 0)
    check_good(held[1], 1)
    assert live_blocks()[0] <= base_blocks[0] + 2
    del held
    gc.collect()
    assert wait_for(lambda: live_blocks()[0] <= base_blocks[0]), (live_blocks(), base_blocks)
    assert live_blocks()[1] <= base_blocks[1]
def test_prefetcher_drop_finalizes_the_source_generator():
    state = {"finally": False, "pulled": 0}

    def gen():
        try:
            for i in range(1000):
                state["pulled"] += 1
                yield good(i)
        finally:
            state["finally"] = True

    pf = pinloader.AsyncPrefetcher(gen(), device=DEVICE, depth=2)
    check_good(next(pf), 0)
    pf.close()
    del pf
    gc.collect()
    assert state["finally"], "the source generator was never finalized"
    assert state["pulled"] < 10
def test_source_generator_closed_early_by_its_owner():
    n = 500
    produced = []

    def gen():
        for i in range(n):
            produced.append(i)
            yield good(i)

    g = gen()
    pf = pinloader.AsyncPrefetcher(g, device=DEVICE, depth=3)
    try:
        got = [next(pf) for _ in range(5)]
        # close the generator under the prefetcher's feet (retry while the producer runs it)
        deadline = time.monotonic() + 5
        while True:
            try:
                g.close()
                break
            except ValueError:  # generator already executing
                assert time.monotonic() < deadline
                time.sleep(0.001)
        rest = drain(pf)  # whatever was produced before close, then a clean end
        got += rest
        assert 5 <= len(got) < n
        for i, b in enumerate(got):
            check_good(b, i)
        assert len(got) == len(produced)
        with pytest.raises(StopIteration):
            next(pf)
    finally:
        pf.close()


def test_prefetcher_collected_on_its_own_producer_thread():
    # The cycle collector may run on the producer thread (it allocates while reading leaves)
    # and free an unreachable prefetcher there: it must not join itself or use freed memory,
    # and the collection must really free what the prefetcher held: its threads, its device
    # blocks (queued batches) and its pinned regions in the shared pool.
    code = """
import gc, os, threading, time, numpy as np, pinloader
from pinloader import _C
gc.disable()
def tasks():
    return len(os.listdir("/proc/self/task"))
pool = pinloader.PinnedPool(max_bytes=64 << 20, device="cpu")
# the process-wide host release thread, made once: create it before counting threads
with pinloader.AsyncPrefetcher([np.zeros(4)] * 2, device="cpu") as warm:
    list(warm)
del warm
gc.collect()
base_tasks, base_blocks = tasks(), _C._testing.live_device_blocks("host")
collected = []
class Leaf:
    def __dlpack_device__(self):
        n = gc.collect()
        if n and threading.get_ident() != threading.main_thread().ident:
            collected.append(n)  # something was collected on the producer thread
        return (1, 0)
    def __dlpack__(self, **kw):
        return np.zeros(1 << 16, np.float32).__dlpack__(**kw)
class Src:
    def __iter__(self):
        return self
    def __next__(self):
        time.sleep(0.02)  # slower than the queue fills: the producer keeps reading leaves
        return {"x": Leaf(), "y": np.ones(1 << 16, np.float32)}
s = Src()
pf = pinloader.AsyncPrefetcher(s, device="cpu", pool=pool, depth=64)
s.pf = pf
deadline = time.monotonic() + 20
while pf.stats()["queued"] < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
busy = _C._testing.live_device_blocks("host")[0]
del s, pf
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    st = pool.stats()
    if (sum(collected) and tasks() <= base_tasks
            and _C._testing.live_device_blocks("host") == base_blocks and st["in_use_bytes"] == 0):
        break
    time.sleep(0.02)
st = pool.stats()
print("collected", sum(collected) > 0, flush=True)
print("tasks", tasks(), base_tasks, flush=True)
print("blocks", busy, _C._testing.live_device_blocks("host")[0], base_blocks[0], flush=True)
print("pinned", st["in_use_bytes"], st["regions"], flush=True)
print("survived", flush=True)
"""
    p = run_py(code, timeout=60)
    assert p.returncode == 0 and "survived" in p.stdout, describe(p)
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines() if " " in line)
    assert lines["collected"] == "True", describe(p)  # collected on the producer thread
    now, base = map(int, lines["tasks"].split())
    assert now <= base, f"the prefetcher's threads outlived its collection\n{describe(p)}"
    busy, now, base = map(int, lines["blocks"].split())
    assert busy >= base + 2, f"no batches were queued when the prefetcher was dropped\n{describe(p)}"
    assert now == base, f"device blocks of queued batches were not freed\n{describe(p)}"
    assert lines["pinned"] == "0 0", f"pinned regions were not given back\n{describe(p)}"


# ---- the cycle collector sees what the prefetcher holds ------------------------------------------

class Ctx:
    pass


class WeakCtxSource:
    """Items that carry a context object; the source holds it only weakly, so the queued
    batches' outputs are the only strong path from the prefetcher back to it."""

    def __init__(self, ctx, n):
        self.ctx = weakref.ref(ctx)
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"x": np.full(1000, i), "ctx": self.ctx()}


def test_cycle_through_queued_batches_is_collected():
    gc.collect()
    base_blocks = live_blocks()
    base_tasks = count_tasks()
    ctx = Ctx()
    pf = pinloader.AsyncPrefetcher(WeakCtxSource(ctx, 8), device=DEVICE, depth=3)
    ctx.pf = pf
    assert wait_for(lambda p=pf: p.stats()["queued"] >= 2)
    ref = weakref.ref(pf)
    del pf, ctx
    gc.collect()
    assert ref() is None, gc.get_referrers(ref()) if ref() is not None else None
    assert wait_for(lambda: live_blocks() == base_blocks), (live_blocks(), base_blocks)
    assert wait_for(lambda: count_tasks() <= base_tasks), (count_tasks(), base_tasks)


def test_cycle_through_source_exception_is_collected():
    gc.collect()
    base_blocks = live_blocks()

    class Boom(Exception):
        pass

    def source(holder):
        yield {"x": np.arange(10)}
        err = Boom()
        err.holder = holder  # the queued exception leads back to the prefetcher
        raise err

    holder = Ctx()
    pf = pinloader.AsyncPrefetcher(source(holder), device=DEVICE, depth=3)
    holder.pf = pf
    assert wait_for(lambda p=pf: p.stats()["queued"] >= 2)
    ref = weakref.ref(pf)
    del pf, holder
    gc.collect()
    assert ref() is None
    assert wait_for(lambda: live_blocks() == base_blocks)


# ---- interpreter exit (subprocesses) -------------------------------------------------------------

EXIT_SCENARIOS = {
    "take-one-exit": """
pf = pinloader.AsyncPrefetcher((np.full(1000, i) for i in range(10**6)), device="cpu", depth=4)
b = next(pf)
time.sleep(0.1)   # producer blocked on a full queue
""",
    "slow-source-mid-next": """
def slow():
    for i in range(10**6):
        time.sleep(0.05)
        yield {"x": np.full(100, i)}
pf = pinloader.AsyncPrefetcher(slow(), device="cpu", depth=2)
b = next(pf)
time.sleep(0.02)  # producer (most likely) inside the source's next()
""",
    "holding-exports-at-exit": """
pf = pinloader.AsyncPrefetcher([{"x": np.arange(10**5)}] * 50, device="cpu", depth=3)
b = next(pf)
view = np.from_dlpack(b["x"])            # a DLPack export alive at exit
cap = b["x"].__dlpack__()                # an unconsumed capsule alive at exit
""",
    "reference-cycle": """
class Holder:
    pass
h = Holder()
h.self = h
h.pf = pinloader.AsyncPrefetcher([np.arange(100)] * 100, device="cpu", depth=2)
h.b = next(h.pf)
del h
""",
    "two-prefetchers-shared-pool": """
pool = pinloader.PinnedPool(max_bytes=1 << 20, device="cpu")
a = pinloader.AsyncPrefetcher([np.arange(1000)] * 100, device="cpu", pool=pool)
c = pinloader.AsyncPrefetcher([np.arange(2000)] * 100, device="cpu", pool=pool)
x, y = next(a), next(c)
""",
}


@pytest.mark.parametrize("scenario", sorted(EXIT_SCENARIOS))
def test_interpreter_exit_with_live_prefetcher(scenario):
    code = """
import faulthandler, time
import numpy as np
import pinloader
faulthandler.dump_traceback_later(15, exit=True)
""" + EXIT_SCENARIOS[scenario] + """
print("EXITING", flush=True)
"""
    t0 = time.monotonic()
    p = run_py(code, timeout=40)
    elapsed = time.monotonic() - t0
    assert "EXITING" in p.stdout, describe(p)
    assert p.returncode == 0, describe(p)
    assert "Traceback" not in p.stderr and "Fatal" not in p.stderr, describe(p)
    assert elapsed < 10, f"exit took {elapsed:.1f}s\n{describe(p)}"
