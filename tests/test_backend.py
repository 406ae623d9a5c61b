"""The backend primitives (src/core/backend_host.c, src/core/backend_cuda.c) through
``pinloader._C._testing.Prim``.

Every test runs on the host backend ("cpu") and, gpu-marked, on the CUDA backend ("cuda:0").
Streams that tests hold with a gate are always released again (the ``res`` fixture opens every
gate at teardown), so a failing assertion cannot leave a worker thread or a CUDA host function
spinning. Copies issued onto a held stream always read page-locked memory from ``host_alloc``:
a pageable-source ``cudaMemcpyAsync`` synchronises with its stream and would deadlock there.
"""
from __future__ import annotations

import ctypes
import json
import threading

import numpy as np
import pytest

import pinloader
from pinloader import _C
from helpers import KiB, MiB, run_py

WAIT_S = 30.0  # bound on every wait that must succeed: a hang becomes a failure, not a stall


def host_view(ptr: int, n: int) -> np.ndarray:
    """A writable uint8 numpy view of n bytes at a raw host address."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))


class Resources:
    """Creates primitives on one backend and frees them all at teardown, gates first."""

    def __init__(self, prim):
        self.p = prim
        self.streams, self.events, self.gates = [], [], []
        self.host, self.dev = [], []

    def stream(self, high=False):
        s = self.p.stream(high)
        self.streams.append(s)
        return s

    def event(self):
        e = self.p.event()
        self.events.append(e)
        return e

    def hold(self, s):
        g = self.p.hold(s)
        self.gates.append(g)
        return g

    def host_alloc(self, n):
        ptr = self.p.host_alloc(n)
        self.host.append((ptr, n))
        return ptr

    def pinned_array(self, n):
        """host_alloc memory as a numpy view."""
        return host_view(self.host_alloc(n), n)

    def device_alloc(self, n, s):
        ptr = self.p.device_alloc(n, s)
        self.dev.append((ptr, s))
        return ptr

    def to_host(self, dptr, n):
        out = np.empty(n, np.uint8)
        self.p.copy_d2h(out.ctypes.data, dptr, n)
        return out

    def close(self):
        for g in self.gates:
            self.p.open_gate(g)
        for s in self.streams:
            self.p.stream_synchronize(s)
        for ptr, s in self.dev:
            self.p.device_free(ptr, s)
        for s in self.streams:
            self.p.stream_synchronize(s)
        for ptr, n in self.host:
            self.p.host_free(ptr, n)
        for e in self.events:
            self.p.event_destroy(e)
        for s in self.streams:
            self.p.stream_destroy(s)


@pytest.fixture
def res(prim):
    r = Resources(prim)
    yield r
    r.close()


def rand_bytes(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def zero_device(res, dptr, n, s):
    z = res.pinned_array(n)
    z[:] = 0
    res.p.copy_h2d(dptr, z.ctypes.data, n, s)
    res.p.stream_synchronize(s)
    assert not res.to_host(dptr, n).any()


# ---- ordering within a stream ----

def test_later_copy_to_same_destination_wins(prim, res):
    n = 64 * KiB
    s = res.stream()
    dst = res.device_alloc(n, s)
    zero_device(res, dst, n, s)
    a, b = res.pinned_array(n), res.pinned_array(n)
    a[:] = rand_bytes(n, 1)
    b[:] = rand_bytes(n, 2)
    ev = res.event()

    gate = res.hold(s)  # both copies are queued before either can run
    prim.copy_h2d(dst, a.ctypes.data, n, s)
    prim.copy_h2d(dst, b.ctypes.data, n, s)
    prim.record(ev, s)
    assert prim.query(ev) is False
    assert not res.to_host(dst, n).any(), "a copy ran while its stream was held"
    prim.open_gate(gate)
    assert prim.event_wait(ev, WAIT_S) is True
    np.testing.assert_array_equal(res.to_host(dst, n), b)


def test_many_copies_to_one_destination_last_wins(prim, res):
    n, k = 4 * KiB, 64
    s = res.stream()
    dst = res.device_alloc(n, s)
    src = res.pinned_array(n * k)
    src[:] = rand_bytes(n * k, 3)
    for i in range(k):
        prim.copy_h2d(dst, src.ctypes.data + i * n, n, s)
    prim.stream_synchronize(s)
    np.testing.assert_array_equal(res.to_host(dst, n), src[(k - 1) * n:])


def test_queued_copies_to_distinct_offsets_all_land(prim, res):
    chunk, k = 4 * KiB + 8, 256  # an odd chunk size: offsets are not page multiples
    n = chunk * k
    s = res.stream()
    dst = res.device_alloc(n, s)
    zero_device(res, dst, n, s)
    src = res.pinned_array(n)
    src[:] = rand_bytes(n, 4)
    src[src == 0] = 1  # every landed byte differs from the zeroed destination
    order = np.random.default_rng(5).permutation(k)
    ev = res.event()
    gate = res.hold(s)
    for i in order:
        off = int(i) * chunk
        prim.copy_h2d(dst + off, src.ctypes.data + off, chunk, s)
    prim.record(ev, s)
    assert prim.query(ev) is False
    prim.open_gate(gate)
    assert prim.event_wait(ev, WAIT_S) is True
    out = res.to_host(dst, n)
    missing = [int(i) for i in range(k) if not np.array_equal(out[i * chunk:(i + 1) * chunk],
                                                              src[i * chunk:(i + 1) * chunk])]
    assert missing == []


# ---- events ----

def test_never_recorded_event_is_complete(prim, res):
    ev = res.event()
    assert prim.query(ev) is True
    assert prim.event_wait(ev, 0.0) is True
    prim.event_synchronize(ev)


def test_event_not_complete_before_stream_reaches_it(prim, res):
    s = res.stream()
    ev = res.event()
    gate = res.hold(s)
    prim.record(ev, s)
    assert prim.query(ev) is False
    assert prim.event_wait(ev, 0.05) is False  # a bounded wait on a held stream times out
    assert prim.query(ev) is False
    prim.open_gate(gate)
    prim.stream_synchronize(s)
    assert prim.query(ev) is True
    assert prim.event_wait(ev, 0.0) is True

    # Re-recording makes the event track the new record, which again is not reached yet.
    gate2 = res.hold(s)
    prim.record(ev, s)
    assert prim.query(ev) is False
    prim.open_gate(gate2)
    prim.event_synchronize(ev)
    assert prim.query(ev) is True


def test_event_on_one_stream_unaffected_by_another(prim, res):
    s1, s2 = res.stream(), res.stream()
    e1, e2 = res.event(), res.event()
    gate = res.hold(s1)
    prim.record(e1, s1)
    prim.record(e2, s2)
    assert prim.event_wait(e2, WAIT_S) is True  # s2 is not held back by s1's gate
    assert prim.query(e1) is False
    prim.open_gate(gate)
    assert prim.event_wait(e1, WAIT_S) is True


# ---- cross-stream waits ----

def test_cross_stream_wait_holds_back_waiting_stream(prim, res):
    n = 64 * KiB
    s1, s2 = res.stream(), res.stream()
    e1, e2 = res.event(), res.event()
    dst = res.device_alloc(n, s2)
    zero_device(res, dst, n, s2)
    src = res.pinned_array(n)
    src[:] = rand_bytes(n, 6)
    src[src == 0] = 7

    gate = res.hold(s1)
    prim.record(e1, s1)
    prim.wait(s2, e1)
    prim.copy_h2d(dst, src.ctypes.data, n, s2)
    prim.record(e2, s2)

    assert prim.query(e1) is False
    assert prim.query(e2) is False
    assert prim.event_wait(e2, 0.05) is False
    assert not res.to_host(dst, n).any(), "the waiting stream ran past its wait"
    prim.open_gate(gate)
    assert prim.event_wait(e2, WAIT_S) is True
    assert prim.query(e1) is True
    np.testing.assert_array_equal(res.to_host(dst, n), src)


def test_wait_on_never_recorded_event_does_not_block(prim, res):
    s = res.stream()
    e_fresh, e_after = res.event(), res.event()
    prim.wait(s, e_fresh)
    prim.record(e_after, s)
    assert prim.event_wait(e_after, WAIT_S) is True


def test_wait_targets_the_record_current_at_call_time(prim, res):
    """backend.h: work queued after stream_wait_event starts only once e, *as last recorded*
    at that call, has completed. A later record of the same event on another stream that
    completes first must not release the wait (CUDA semantics)."""
    s1, s2, s3 = res.stream(), res.stream(), res.stream()
    e, e2 = res.event(), res.event()
    gate = res.hold(s1)
    prim.record(e, s1)        # record #1: held
    prim.wait(s2, e)          # s2 waits for record #1
    prim.record(e2, s2)
    prim.record(e, s3)        # record #2 on a free stream: completes at once
    prim.stream_synchronize(s3)
    try:
        assert prim.event_wait(e2, 0.2) is False, (
            "s2 passed its wait although the record it waited for (on held s1) has not run")
    finally:
        prim.open_gate(gate)
    assert prim.event_wait(e2, WAIT_S) is True


# ---- memory ----

def _round_trip_sizes(device):
    sizes = [1, 255, 256, 4097, 3 * MiB + 5]
    if device.startswith("cuda"):
        sizes.append(256 * MiB)
    return sizes


def test_memory_round_trip_byte_for_byte(backend_device, prim, res):
    s = res.stream()
    for i, n in enumerate(_round_trip_sizes(backend_device)):
        src = res.pinned_array(n)
        assert src.ctypes.data % 4096 == 0, "host_alloc memory is page aligned"
        data = rand_bytes(n, 100 + i)
        src[:] = data
        dptr = res.device_alloc(n, s)
        assert dptr % 256 == 0
        prim.copy_h2d(dptr, src.ctypes.data, n, s)
        prim.stream_synchronize(s)
        out = res.to_host(dptr, n)
        assert np.array_equal(out, data), f"round trip of {n} bytes differs"


def test_round_trip_from_pageable_memory(prim, res):
    n = 1 * MiB + 3
    s = res.stream()
    data = rand_bytes(n, 7)
    dptr = res.device_alloc(n, s)
    prim.copy_h2d(dptr, data.ctypes.data, n, s)
    prim.stream_synchronize(s)
    np.testing.assert_array_equal(res.to_host(dptr, n), data)


def test_device_free_is_stream_ordered_and_memory_reusable(prim, res):
    # Frees are queued behind work still pending on the stream: the copies into a block and
    # the block's free are issued while the stream is held, so a free that ran at once would
    # let another stream's allocation reuse the block and then have the held copies write into
    # it (and, under ASan, write freed memory).
    s, other = res.stream(), res.stream()
    n = 1 * MiB
    rounds = 8
    srcs = [res.pinned_array(n) for _ in range(rounds)]
    for i, src in enumerate(srcs):
        src[:] = i + 1
    gate = res.hold(s)
    after_free = res.event()
    blocks = []
    for i in range(rounds):
        d = prim.device_alloc(n, s)
        prim.copy_h2d(d, srcs[i].ctypes.data, n, s)
        prim.device_free(d, s)  # queued behind the copy, which is queued behind the gate
        blocks.append(d)
    prim.record(after_free, s)
    assert not prim.query(after_free), "the held stream ran past its gate"
    # Meanwhile another stream allocates and fills blocks of the same size.
    mine = []
    pattern = res.pinned_array(n)
    pattern[:] = 0xEE
    for _ in range(rounds):
        d2 = res.device_alloc(n, other)
        prim.copy_h2d(d2, pattern.ctypes.data, n, other)
        mine.append(d2)
    prim.stream_synchronize(other)
    assert not prim.query(after_free)
    prim.open_gate(gate)
    prim.stream_synchronize(s)
    assert prim.query(after_free)
    # The held copies ran after the gate opened and wrote only into their own (since freed)
    # blocks, never into blocks another stream was handed in the meantime.
    for d2 in mine:
        assert (res.to_host(d2, n) == 0xEE).all(), "a queued copy wrote into a reallocated block"
    # And the freed memory is reusable on the stream itself, round after round.
    src = srcs[0]
    for i in range(20):
        src[:] = i + 1
        d = prim.device_alloc(n, s)
        prim.copy_h2d(d, src.ctypes.data, n, s)
        prim.device_free(d, s)  # free queued right behind the copy, before it is read
        check = prim.device_alloc(n, s)
        prim.copy_h2d(check, src.ctypes.data, n, s)
        prim.stream_synchronize(s)
        assert (res.to_host(check, n) == i + 1).all()
        prim.device_free(check, s)
    prim.stream_synchronize(s)


def test_is_pinned(backend_device, prim, res):
    ptr = res.host_alloc(2 * MiB)
    pageable = np.zeros(MiB, np.uint8)
    if backend_device == "cpu":
        assert prim.is_pinned(ptr) is False
    else:
        assert prim.is_pinned(ptr) is True
        assert prim.is_pinned(ptr + MiB + 1) is True  # inside the allocation
    assert prim.is_pinned(pageable.ctypes.data) is False


# ---- concurrency ----

N_THREADS, ROUNDS, REPEATS = 8, 200, 3


@pytest.mark.parametrize("repeat", range(REPEATS))
def test_concurrent_streams_from_threads(prim, repeat):
    n = 4 * KiB
    errors: list[str] = []
    done = [0] * N_THREADS
    start = threading.Barrier(N_THREADS)

    def worker(tid):
        r = Resources(prim)
        try:
            s = r.stream(high=bool(tid % 2))
            ev = r.event()
            src = r.pinned_array(n)
            dst = r.device_alloc(n, s)
            out = np.empty(n, np.uint8)
            start.wait(WAIT_S)
            for i in range(ROUNDS):
                val = (tid * 31 + i * 7 + repeat) % 251 + 1
                src[:] = val
                src[tid] = i % 256  # a per-round byte that differs between threads
                prim.copy_h2d(dst, src.ctypes.data, n, s)
                prim.record(ev, s)
                how = i % 3
                if how == 0:
                    prim.event_synchronize(ev)
                elif how == 1:
                    if not prim.event_wait(ev, WAIT_S):
                        errors.append(f"thread {tid} round {i}: event_wait timed out")
                        return
                else:
                    prim.stream_synchronize(s)
                if not prim.query(ev):
                    errors.append(f"thread {tid} round {i}: event incomplete after sync")
                    return
                prim.copy_d2h(out.ctypes.data, dst, n)
                if not np.array_equal(out, src):
                    bad = int(np.flatnonzero(out != src)[0])
                    errors.append(f"thread {tid} round {i}: byte {bad} is {out[bad]}, "
                                  f"expected {src[bad]}")
                    return
                done[tid] += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {tid}: {e!r}")
        finally:
            r.close()

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "worker threads hung"
    assert errors == []
    assert done == [ROUNDS] * N_THREADS


# ---- backend selection and errors ----

def test_prim_reports_backend(backend_device, prim):
    assert prim.backend == ("host" if backend_device == "cpu" else "cuda")


@pytest.mark.skipif(pinloader.cuda_available(), reason="CUDA is available here")
def test_no_gpu_reports_host(monkeypatch):
    monkeypatch.delenv("PINLOADER_BACKEND", raising=False)
    assert pinloader.backend() == "host"
    assert pinloader.cuda_available() is False
    assert pinloader.device_count() == 0
    info = pinloader.cuda_info()
    assert info["usable"] is False and info["error"], info
    assert _C._testing.Prim().backend == "host"
    assert pinloader.PinnedPool(max_bytes=MiB).backend == "host"


def test_forced_host_backend_in_subprocess():
    code = r"""
import json, pinloader
from pinloader import _C
out = {"backend": pinloader.backend(), "available": pinloader.cuda_available(),
       "count": pinloader.device_count(), "prim": _C._testing.Prim().backend,
       "pool": pinloader.PinnedPool(max_bytes=1 << 20).backend}
try:
    pinloader.AsyncPrefetcher([], device="cuda:0")
    out["cuda0"] = None
except Exception as e:
    out["cuda0"] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""
    cp = run_py(code, timeout=60, env_extra={"PINLOADER_BACKEND": "host"})
    assert cp.returncode == 0, cp.stderr
    out = json.loads(cp.stdout.strip().splitlines()[-1])
    assert out["backend"] == "host"
    assert out["available"] is False
    assert out["count"] == 0
    assert out["prim"] == "host"
    assert out["pool"] == "host"
    assert out["cuda0"] is not None, "device='cuda:0' was accepted under PINLOADER_BACKEND=host"
    kind, msg = out["cuda0"]
    assert kind == "ValueError"
    assert "PINLOADER_BACKEND" in msg and "cuda:0" in msg


@pytest.mark.skipif(pinloader.cuda_available(), reason="CUDA is available here")
@pytest.mark.parametrize("make", ["prefetcher", "pool", "prim"])
@pytest.mark.parametrize("device", ["cuda:0", "cuda", 0, "cuda:1"])
def test_cuda_device_without_cuda_raises_cuda_error(monkeypatch, make, device):
    monkeypatch.delenv("PINLOADER_BACKEND", raising=False)
    ctor = {"prefetcher": lambda: pinloader.AsyncPrefetcher([], device=device),
            "pool": lambda: pinloader.PinnedPool(device=device),
            "prim": lambda: _C._testing.Prim(device)}[make]
    with pytest.raises(pinloader.CudaError) as ei:
        ctor()
    e = ei.value
    assert isinstance(e, RuntimeError)
    msg = str(e)
    asked = {"cuda:0": "'cuda:0'", 0: "'cuda:0'", "cuda": "'cuda'", "cuda:1": "'cuda:1'"}[device]
    assert asked in msg, msg
    assert "CUDA is not usable" in msg, msg
    assert isinstance(e.code, int) and e.code != 0
    assert isinstance(e.name, str) and e.name
    assert e.name in msg or e.name.startswith("pinloader"), msg


@pytest.mark.skipif(pinloader.device_count() >= 2, reason="a second CUDA device exists")
@pytest.mark.parametrize("make", ["prefetcher", "pool"])
def test_missing_second_device_is_named(monkeypatch, make):
    monkeypatch.delenv("PINLOADER_BACKEND", raising=False)
    with pytest.raises(pinloader.CudaError) as ei:
        if make == "prefetcher":
            pinloader.AsyncPrefetcher([], device="cuda:1")
        else:
            pinloader.PinnedPool(device="cuda:1")
    msg = str(ei.value)
    assert "'cuda:1'" in msg, msg
    if pinloader.cuda_available():
        assert "visible" in msg and str(pinloader.device_count()) in msg, msg
        assert ei.value.name == "cudaErrorInvalidDevice"
    else:
        assert "CUDA is not usable" in msg, msg


BAD_DEVICES = ["gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:1.0", "CUDA", "", " cuda:0",
               "cuda:0:1", "cuda0", "cpu:1", "cuda:0x1"]
# strtol-isms: these parse as a device index today and should not.
LENIENT_DEVICES = ["cuda: 0", "cuda:+0"]


@pytest.mark.parametrize("make", ["prefetcher", "pool", "prim"])
@pytest.mark.parametrize("device", BAD_DEVICES + LENIENT_DEVICES)
def test_bad_device_string_raises_value_error(make, device):
    ctor = {"prefetcher": lambda: pinloader.AsyncPrefetcher([], device=device),
            "pool": lambda: pinloader.PinnedPool(device=device),
            "prim": lambda: _C._testing.Prim(device)}[make]
    with pytest.raises(ValueError) as ei:
        ctor()
    assert repr(device) in str(ei.value)


@pytest.mark.parametrize("device", [-1, -7])
def test_negative_device_index_raises_value_error(device):
    with pytest.raises(ValueError, match="device index"):
        pinloader.PinnedPool(device=device)


class _TorchLikeDevice:
    """A torch.device-like object: .type and .index."""

    def __init__(self, type_, index):
        self.type, self.index = type_, index

    def __repr__(self):
        return f"device(type={self.type!r}, index={self.index!r})"


@pytest.mark.parametrize("make", ["prefetcher", "pool"])
@pytest.mark.parametrize("device", [2**32, 2**64, 2**20 + 1, _TorchLikeDevice("cuda", 2**32),
                                    _TorchLikeDevice("cuda", -1), _TorchLikeDevice("cpu", 2**63)])
def test_device_index_out_of_range_is_refused_not_wrapped(make, device):
    # a C int cast would wrap 2**32 to device 0: the index is checked whole
    ctor = {"prefetcher": lambda: pinloader.AsyncPrefetcher([], device=device),
            "pool": lambda: pinloader.PinnedPool(device=device)}[make]
    with pytest.raises(ValueError, match="device index must be between 0 and 1048576"):
        ctor()


@pytest.mark.parametrize("index", [1.0, "0", True])
def test_torch_like_device_index_of_wrong_type_raises_type_error(index):
    with pytest.raises(TypeError, match="device index must be an int"):
        pinloader.PinnedPool(device=_TorchLikeDevice("cuda", index))


@pytest.mark.parametrize("device", [1.5, b"cuda", ["cuda"]])
def test_device_of_wrong_type_raises_type_error(device):
    with pytest.raises(TypeError):
        pinloader.PinnedPool(device=device)


@pytest.mark.parametrize("device", [True, False])
def test_bool_device_is_refused(device):
    # before: True was read as 'cuda:1' and False as 'cuda:0'
    with pytest.raises(TypeError, match="device must be a str, an int or None, not bool"):
        pinloader.AsyncPrefetcher([np.arange(3)], device=device)
    with pytest.raises(TypeError, match="not bool"):
        pinloader.PinnedPool(max_bytes=1 << 20, device=device)
    # a loader reads its device where it is made (Note [device spellings] in pinloader/_device.py)
    with pytest.raises(TypeError, match="ArrayLoader: device must be .* not bool"):
        pinloader.ArrayLoader(np.arange(3), 1, device=device)
