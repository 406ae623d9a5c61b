"""Backend failures at every point of a scenario (Note [injected faults] in
src/core/host_faults.c): the host backend's injector makes its k-th call fail (one-shot), or
every call from the k-th on (sticky, as CUDA's sticky errors do), for every k of the calls the
scenario makes (a spread sample where there are many). Each run must end with correct values or
a clean Python exception (RuntimeError, CudaError among them; MemoryError; OSError), never a
crash, a hang, wrong data, an exception of another type (also not as an unraisable one, from a
deallocator), or a device block left alive once everything is closed and collected; and once
the injector is disarmed the same scenario must work again.

The scenarios: an AsyncPrefetcher over dict batches taken to the end and closed, and one dropped
mid-epoch without close(); an ArrayLoader epoch with the host gather and with the device gather;
a PinnedPool with clients and buffers; the torch door (pinloader.torch.prefetch).

Each sweep runs in a child interpreter, so that a crash (a double free aborts the process) or a
hang fails its test with the child's output instead of ending the suite; under the ASan job the
child inherits the sanitizer's LD_PRELOAD and options.
"""
from __future__ import annotations

import gc
import json
import sys

import numpy as np
import pytest

from helpers import child_env, run_child

# The most failure points swept per scenario and mode: every one below it, else an even spread
# that always includes the first and the last.
MAX_POINTS = 160
# Bound on one sweep (a hang becomes a failure); a sweep takes a few seconds.
SWEEP_TIMEOUT_S = 240
# Bound on one failure point's run, after which the child prints every thread's stack and exits.
POINT_TIMEOUT_S = 60

ALLOWED = (RuntimeError, MemoryError, OSError)


class WrongData(Exception):
    """A scenario saw values that differ from its source's: never allowed."""


def _host(a):
    return np.from_dlpack(a)


def _check(cond, what):
    if not cond:
        raise WrongData(what)


# ---- the scenarios (each makes, uses and closes its own objects) ----

def _dict_batches():
    return [{"x": np.arange(i * 300, (i + 1) * 300, dtype=np.int64).reshape(30, 10),
             "y": np.full(7, i, dtype=np.float32)} for i in range(6)]


def _every_dict_batch(**kw):
    """Every batch of _dict_batches() through an AsyncPrefetcher(**kw), each checked."""
    import pinloader
    batches = _dict_batches()
    p = pinloader.AsyncPrefetcher(batches, device="cpu", **kw)
    try:
        got = 0
        for i, b in enumerate(p):
            _check(np.array_equal(_host(b["x"]), batches[i]["x"]), f"batch {i} x")
            _check(np.array_equal(_host(b["y"]), batches[i]["y"]), f"batch {i} y")
            got += 1
        _check(got == len(batches), f"{got} batches of {len(batches)}")
    finally:
        p.close()


def prefetcher_all():
    _every_dict_batch()


def prefetcher_dropped():
    import pinloader
    batches = _dict_batches()
    p = pinloader.AsyncPrefetcher(batches, device="cpu", depth=3)
    b = next(p)
    _check(np.array_equal(_host(b["x"]), batches[0]["x"]), "batch 0 x")
    b = next(p)
    _check(np.array_equal(_host(b["y"]), batches[1]["y"]), "batch 1 y")
    del p  # dropped mid-epoch, the last batch still held: the deallocator stops the producer
    del b


def prefetcher_generated():
    # batches made on the fly and dropped by the source at once: the prefetcher keeps each one
    # alive (its graves, src/py/pf_producer.c) until the copies that read it are done
    import pinloader

    def gen():
        for i in range(6):
            yield {"x": np.arange(i * 5000, (i + 1) * 5000, dtype=np.int64)}
    p = pinloader.AsyncPrefetcher(gen(), device="cpu")
    try:
        got = 0
        for i, b in enumerate(p):
            _check(np.array_equal(_host(b["x"]), np.arange(i * 5000, (i + 1) * 5000)), f"batch {i}")
            got += 1
        _check(got == 6, f"{got} batches of 6")
    finally:
        p.close()


def prefetcher_pinned_sources():
    # leaves in PinnedBuffers (copied straight from the source, src/py/flat_leaves.c), made on
    # the fly and dropped by the source at once: only the prefetcher keeps each buffer from
    # going back to its pool before its copy has read it
    import pinloader
    pool = pinloader.PinnedPool(8 << 20, device="cpu")

    def gen():
        for i in range(6):
            a = np.frombuffer(pool.alloc(80_000, timeout=5), np.int64)
            a[:] = np.arange(i * a.size, (i + 1) * a.size)
            yield {"x": a}
    p = pinloader.AsyncPrefetcher(gen(), device="cpu", depth=1)
    try:
        got = 0
        for i, b in enumerate(p):
            _check(np.array_equal(_host(b["x"]), np.arange(i * 10_000, (i + 1) * 10_000)), f"batch {i}")
            got += 1
        _check(got == 6, f"{got} batches of 6")
    finally:
        p.close()
        pool.close()


def prefetcher_static():
    # static=True: every batch copied into the same device arrays (src/py/handout.c)
    _every_dict_batch(static=True)


class _Cyclic:
    """A source that the prefetcher and its batches reach and that reaches them back: only the
    cycle collector frees them."""

    def __init__(self, batches):
        self.batches = batches
        self.keep = []

    def __iter__(self):
        return iter(self.batches)


def prefetcher_cycle():
    import pinloader
    src = _Cyclic(_dict_batches())
    p = pinloader.AsyncPrefetcher(src, device="cpu", output="capsule")
    src.keep.append(p)
    b = next(p)
    src.keep.append(b)
    b = next(p)
    _check(np.array_equal(np.from_dlpack(_Capsule(b["y"])), src.batches[1]["y"]), "batch 1 y")
    src.keep.append(b)
    del p, b, src  # mid-epoch, never closed: the cycle collector stops and frees it


class _Capsule:
    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, stream=None, **kw):
        return self.cap

    def __dlpack_device__(self):
        return (1, 0)


def _rows():
    # row i holds i in every column; 4096 rows of 16 bytes: whole pages, so gather="device"
    # can serve it
    return np.repeat(np.arange(4096, dtype=np.float32)[:, None], 4, axis=1)


def _loader(gather):
    import pinloader
    arr = _rows()
    loader = pinloader.ArrayLoader(arr, 500, device="cpu", gather=gather, seed=3)
    try:
        seen = []
        for b in loader:
            h = _host(b)
            _check(h.shape[1:] == (4,) and (h == h[:, :1]).all(), "a row not whole")
            seen.append(h[:, 0].copy())
        seen = np.sort(np.concatenate(seen)) if seen else np.empty(0)
        _check(np.array_equal(seen, np.arange(4096, dtype=np.float32)), "not every row once")
    finally:
        loader.close()


def loader_host_gather():
    _loader("host")


def loader_device_gather():
    _loader("device")


def pinned_pool():
    import pinloader
    pool = pinloader.PinnedPool(1 << 20, device="cpu")
    try:
        client = pool.client(1 << 19)
        bufs = []
        for i, n in enumerate((1000, 70_000, 4096, 200_000)):
            b = (client if i % 2 else pool).alloc(n, timeout=5)
            np.frombuffer(b, np.uint8)[:] = i + 1
            bufs.append(b)
        for i, b in enumerate(bufs):
            _check((np.frombuffer(b, np.uint8) == i + 1).all(), f"buffer {i}")
        bufs[1].release()
        bufs[0].release()
        again = client.alloc(60_000, timeout=5)
        np.frombuffer(again, np.uint8)[:] = 9
        _check((np.frombuffer(bufs[2], np.uint8) == 3).all(), "buffer 2 after reuse")
        del bufs, again
        pool.trim()
    finally:
        pool.close()


def torch_door():
    import torch

    import pinloader.torch
    batches = [{"x": torch.arange(i * 64, (i + 1) * 64).reshape(8, 8), "y": torch.full((3,), float(i))}
               for i in range(4)]
    p = pinloader.torch.prefetch(batches, device="cpu")
    try:
        got = 0
        for i, b in enumerate(p):
            _check(torch.equal(b["x"], batches[i]["x"]) and torch.equal(b["y"], batches[i]["y"]),
                   f"batch {i}")
            got += 1
        _check(got == len(batches), f"{got} batches of {len(batches)}")
    finally:
        p.close()


SCENARIOS = {f.__name__: f for f in (prefetcher_all, prefetcher_dropped, prefetcher_generated,
                                     prefetcher_pinned_sources, prefetcher_static, prefetcher_cycle,
                                     loader_host_gather, loader_device_gather, pinned_pool,
                                     torch_door)}


# ---- the sweep, in the child ----

def _points(n):
    if n <= MAX_POINTS:
        return list(range(n))
    return sorted({round(i * (n - 1) / (MAX_POINTS - 1)) for i in range(MAX_POINTS)})


def sweep(name):
    """Run scenario `name` disarmed (counting its calls), then failing at each point, one-shot
    and sticky; print a JSON summary line. Any breach raises (the child exits non-zero)."""
    import faulthandler

    import pinloader
    T = pinloader._C._testing
    scenario = SCENARIOS[name]
    unraisable = []
    sys.unraisablehook = lambda u: unraisable.append((u.exc_type, str(u.exc_value), repr(u.object)))

    def live():
        gc.collect()
        return T.live_device_blocks("cpu")[0]

    scenario()  # warm: first-use objects (release streams, event caches) are made once
    base = live()
    T.host_fail_after(1 << 62)  # count only
    scenario()
    n = T.host_fail_after(-1)
    if live() != base:
        raise AssertionError(f"{name}: device blocks left alive by a run without faults")
    summary = {"scenario": name, "calls": n, "points": 0, "completed": 0, "raised": {}}
    breaches = []
    for sticky in (False, True):
        for k in _points(n):
            faulthandler.dump_traceback_later(POINT_TIMEOUT_S, exit=True)
            print(f"point {k} sticky={sticky}", file=sys.stderr, flush=True)  # for a crash's log
            T.host_fail_after(k, sticky)
            outcome = "completed"
            try:
                scenario()
            except ALLOWED as e:
                outcome = type(e).__name__
                del e
            except ValueError as e:
                # gather='device' refused because the backend could not ready its gather or
                # register the source: the loader's designed answer (src/py/registration.c),
                # naming the backend's error
                if "gather='device' cannot serve this source" not in str(e):
                    outcome = f"breach: ValueError: {e}"
                else:
                    outcome = "ValueError"
                del e
            except BaseException as e:
                outcome = f"breach: {type(e).__name__}: {e}"
                del e
            gc.collect()  # deallocators still run with the injector armed
            failed = T.host_first_failed()
            T.host_fail_after(-1)
            faulthandler.cancel_dump_traceback_later()
            summary["points"] += 1
            where = f"{name}: failing call {k} ({failed}, sticky={sticky})"
            if outcome.startswith("breach"):
                breaches.append(f"{where}: {outcome}")
            elif outcome == "completed":
                summary["completed"] += 1
            else:
                summary["raised"][outcome] = summary["raised"].get(outcome, 0) + 1
            left = live() - base
            if left:
                breaches.append(f"{where}: left {left} device blocks alive")
                base += left
            bad = [u for u in unraisable if not issubclass(u[0], ALLOWED)]
            if bad:
                breaches.append(f"{where}: unraisable {bad[0][0].__name__}: {bad[0][1]} in {bad[0][2]}")
            unraisable.clear()
    if breaches:
        raise AssertionError(f"{len(breaches)} breaches:\n" + "\n".join(breaches[:40]))
    scenario()  # disarmed again: the process still works
    if live() != base:
        raise AssertionError(f"{name}: device blocks left alive after the sweep")
    print("SWEEP " + json.dumps(summary))


# ---- the tests ----

@pytest.mark.hostile
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_backend_failure_point_ends_cleanly(name):
    if name == "torch_door":
        pytest.importorskip("torch", reason="torch is not installed")
    r = run_child(f"import test_host_faults as t; t.sweep({name!r})", child_env(),
                  timeout=SWEEP_TIMEOUT_S)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    line = [s for s in r.stdout.splitlines() if s.startswith("SWEEP ")]
    assert line, out[-6000:]
    summary = json.loads(line[-1][len("SWEEP "):])
    # the scenario made backend calls, and every one of the points ran (one-shot and sticky)
    assert summary["calls"] > 0, summary
    assert summary["points"] == 2 * len(_points(summary["calls"])), summary
    # sticky failure from the first call on cannot let a scenario finish: some runs raised
    assert sum(summary["raised"].values()) > 0, summary
    print(summary)


def test_the_injector_counts_fails_and_disarms():
    import pinloader
    T = pinloader._C._testing
    assert T.host_fail_after(-1) >= 0
    # counting only: nothing fails
    T.host_fail_after(1 << 62)
    prefetcher_all()
    n = T.host_fail_after(-1)
    assert n > 0
    # disarmed: nothing is counted
    prefetcher_all()
    T.host_fail_after(1 << 62)
    assert T.host_fail_after(-1) == 0
    # the first call fails: the scenario raises the backend's error, cleanly
    T.host_fail_after(0, True)
    try:
        with pytest.raises(ALLOWED):
            prefetcher_all()
    finally:
        counted = T.host_fail_after(-1)
    assert counted >= 1
    gc.collect()
    prefetcher_all()
