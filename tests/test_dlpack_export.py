"""DLPack export (src/py/dlpack.c): every __dlpack__ argument checked with a clean error, capsules
that round-trip byte-equal, and export_capsules with its once-per-batch consumer wait (host
backend; the same on CUDA, gpu-marked).
"""
from __future__ import annotations

import ctypes
import gc
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pinloader
from pinloader import _C
from helpers import CapsuleWrapper, drain

_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.restype = ctypes.c_int
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def capsule_name(cap):
    for name in (b"dltensor", b"dltensor_versioned", b"used_dltensor", b"used_dltensor_versioned"):
        if _is_valid(cap, name):
            return name.decode()
    return None


def counters():
    c = _C._testing.debug_counters()
    return c["host_consumer_waits"], c["host_consumer_waits_skipped"]


def make_batch(n=32, seed=0):
    rng = np.random.default_rng(seed)
    dtypes = [np.uint8, np.int16, np.float32, np.float64, np.int64, np.bool_, np.complex64]
    item = {}
    for i in range(n):
        dt = dtypes[i % len(dtypes)]
        shape = [(), (7,), (3, 5), (2, 1, 4), (0, 3)][i % 5]
        a = rng.integers(0, 100, size=shape).astype(dt)
        item[f"k{i}"] = a
    return item


@pytest.fixture
def batch():
    """One host-backend batch of 32 leaves and the item it came from."""
    item = make_batch()
    pf = pinloader.AsyncPrefetcher([item], device="cpu")
    out = drain(pf)
    assert len(out) == 1
    yield item, out[0]
    pf.close()


@pytest.fixture
def device_array(batch):
    return batch[1]["k1"]


@pytest.fixture
def pinned_buffer():
    pool = pinloader.PinnedPool(device="cpu")
    buf = pool.alloc(64)
    np.frombuffer(buf, np.uint8)[:] = np.arange(64, dtype=np.uint8)
    yield buf
    gc.collect()
    buf.release()
    pool.close()


# ---- every argument gives a clean error, never SystemError ----

COMMON_BAD = [
    (dict(stream=2**70), ValueError),
    (dict(stream=2**64), ValueError),
    (dict(stream=-(2**70)), ValueError),
    (dict(stream=-2), ValueError),
    (dict(stream=True), TypeError),
    (dict(stream=1.0), TypeError),
    (dict(stream="1"), TypeError),
    (dict(stream=0), BufferError),  # host memory: only None and -1
    (dict(stream=1), BufferError),
    (dict(dl_device=[1, 0]), TypeError),
    (dict(dl_device=(1,)), TypeError),
    (dict(dl_device=(1, 0, 0)), TypeError),
    (dict(dl_device=("1", 0)), TypeError),
    (dict(dl_device=(1, None)), TypeError),
    (dict(dl_device=(True, 0)), TypeError),
    (dict(dl_device=1), TypeError),
    (dict(dl_device=(2**70, 0)), BufferError),
    (dict(dl_device=(1, -(2**70))), BufferError),
    (dict(dl_device=(2, 0)), BufferError),
    (dict(dl_device=(1, 1)), BufferError),
    (dict(max_version="x"), TypeError),
    (dict(max_version=[1, 0]), TypeError),
    (dict(max_version=(1,)), TypeError),
    (dict(max_version=(1, 0, 0)), TypeError),
    (dict(max_version=(1, "x")), TypeError),
    (dict(max_version=(1.0, 0)), TypeError),
    (dict(max_version=(True, 0)), TypeError),
    (dict(copy=1), TypeError),
    (dict(copy="yes"), TypeError),
    (dict(copy=True), BufferError),
]


@pytest.mark.parametrize("kwargs,exc", COMMON_BAD, ids=[repr(k) for k, _ in COMMON_BAD])
@pytest.mark.parametrize("which", ["device_array", "pinned_buffer"])
def test_dlpack_bad_arguments_raise_cleanly(which, kwargs, exc, request):
    obj = request.getfixturevalue(which)
    with pytest.raises(exc) as ei:
        obj.__dlpack__(**kwargs)
    assert type(ei.value) is not SystemError
    # The object stays usable after the refusal.
    assert capsule_name(obj.__dlpack__()) == "dltensor"


@pytest.mark.parametrize("which", ["device_array", "pinned_buffer"])
def test_dlpack_positional_and_unknown_arguments(which, request):
    obj = request.getfixturevalue(which)
    with pytest.raises(TypeError):
        obj.__dlpack__(None)
    with pytest.raises(TypeError):
        obj.__dlpack__(strem=None)
    with pytest.raises(TypeError):
        obj.__dlpack_device__(1)


@pytest.mark.parametrize("which", ["device_array", "pinned_buffer"])
def test_dlpack_max_version_any_int(which, request):
    obj = request.getfixturevalue(which)
    assert capsule_name(obj.__dlpack__(max_version=(2**70, 0))) == "dltensor_versioned"
    assert capsule_name(obj.__dlpack__(max_version=(1, 2**70))) == "dltensor_versioned"
    assert capsule_name(obj.__dlpack__(max_version=(1, 0))) == "dltensor_versioned"
    assert capsule_name(obj.__dlpack__(max_version=(0, 9))) == "dltensor"
    assert capsule_name(obj.__dlpack__(max_version=(-(2**70), 0))) == "dltensor"
    assert capsule_name(obj.__dlpack__(max_version=None)) == "dltensor"


def test_dlpack_accepted_arguments(device_array, pinned_buffer):
    for obj in (device_array, pinned_buffer):
        assert capsule_name(obj.__dlpack__(stream=None, copy=False, dl_device=(1, 0))) == "dltensor"
        assert capsule_name(obj.__dlpack__(stream=-1, copy=None)) == "dltensor"
    # Pinned memory answers to kDLCUDAHost (what __dlpack_device__ says) and kDLCPU.
    assert pinned_buffer.__dlpack_device__() == (3, 0)
    assert capsule_name(pinned_buffer.__dlpack__(dl_device=(3, 0))) == "dltensor"
    assert device_array.__dlpack_device__() == (1, 0)
    with pytest.raises(BufferError):
        device_array.__dlpack__(dl_device=(3, 0))


class _BadIndex:
    def __init__(self, exc):
        self.exc = exc

    def __index__(self):
        raise self.exc


@pytest.mark.parametrize("which", ["device_array", "pinned_buffer"])
def test_dlpack_integer_like_arguments(which, request):
    """IntEnums and NumPy integers are ints to DLPack (torch passes its DLDeviceType enum); an
    __index__ that raises propagates its own exception, a KeyboardInterrupt unchanged."""
    import enum

    class Dev(enum.IntEnum):
        CPU = 1

    obj = request.getfixturevalue(which)
    assert capsule_name(obj.__dlpack__(dl_device=(Dev.CPU, np.int64(0)))) == "dltensor"
    assert capsule_name(obj.__dlpack__(max_version=(np.int32(1), np.uint8(3)))) == "dltensor_versioned"
    for kwargs in (dict(dl_device=(_BadIndex(ValueError("no")), 0)),
                   dict(max_version=(_BadIndex(ValueError("no")), 0))):
        with pytest.raises(ValueError, match="no"):
            obj.__dlpack__(**kwargs)
    with pytest.raises(KeyboardInterrupt):
        obj.__dlpack__(dl_device=(1, _BadIndex(KeyboardInterrupt())))
    with pytest.raises(TypeError):
        obj.__dlpack__(stream=np.int64(-1))  # a stream is a plain int (a pointer)


def test_cuda_array_interface_absent_on_host(device_array):
    with pytest.raises(AttributeError):
        device_array.__cuda_array_interface__
    assert not hasattr(device_array, "__cuda_array_interface__")


def test_released_pinned_buffer_refuses_export():
    pool = pinloader.PinnedPool(device="cpu")
    buf = pool.alloc(16)
    buf.release()
    with pytest.raises(ValueError, match="released"):
        buf.__dlpack__()
    # Argument errors are not masked by the release either way round.
    with pytest.raises((ValueError, TypeError)):
        buf.__dlpack__(dl_device=[1, 0])
    pool.close()


CUDA_STREAMS = [
    (None, (True, 1)),
    (-1, (False, 1)),
    (1, (True, 1)),
    (2, (True, 2)),
    (0x7F00DEADBEEF, (True, 0x7F00DEADBEEF)),
    (2**64 - 1, (True, 2**64 - 1)),
    (0, ValueError),
    (-2, ValueError),
    (-(2**70), ValueError),
    (2**64, ValueError),
    (2**70, ValueError),
    (True, TypeError),
    (1.5, TypeError),
    ("1", TypeError),
]


@pytest.mark.parametrize("stream,want", CUDA_STREAMS, ids=[repr(s) for s, _ in CUDA_STREAMS])
def test_cuda_stream_argument_rules(stream, want):
    """How a CUDA DeviceArray reads stream= (the parser is shared; checked without a GPU)."""
    if isinstance(want, type):
        with pytest.raises(want):
            _C._testing.dlpack_stream(stream, True)
    else:
        assert _C._testing.dlpack_stream(stream, True) == want


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**80), 2**80), st.floats(allow_nan=True),
    st.text(max_size=3), st.just(b"\x01"), st.just(object()))
_args = st.one_of(_scalars, st.tuples(_scalars, _scalars), st.lists(_scalars, max_size=3),
                  st.tuples(_scalars), st.tuples(_scalars, _scalars, _scalars))
_EXPECTED = (TypeError, ValueError, BufferError, OverflowError)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=_args, max_version=_args, dl_device=_args, copy=_args)
def test_dlpack_arguments_fuzz(device_array, pinned_buffer, stream, max_version, dl_device, copy):
    """Any combination of argument values: a capsule or a clean error, never SystemError."""
    for obj in (device_array, pinned_buffer):
        try:
            cap = obj.__dlpack__(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)
        except _EXPECTED:
            continue
        assert capsule_name(cap) in ("dltensor", "dltensor_versioned")
        np.from_dlpack(CapsuleWrapper(cap))
    try:
        caps = _C.export_capsules([device_array, 7], stream)
    except _EXPECTED:
        return
    assert capsule_name(caps[0]) == "dltensor" and caps[1] == 7


# ---- round trips ----

@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_device_array_roundtrip_numpy(batch, max_version):
    item, out = batch
    for k, a in item.items():
        got = np.from_dlpack(CapsuleWrapper(out[k].__dlpack__(max_version=max_version)))
        assert got.dtype == a.dtype and got.shape == a.shape
        assert got.tobytes() == a.tobytes()
        np.testing.assert_array_equal(np.from_dlpack(out[k]), a)


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_pinned_buffer_roundtrip(pinned_buffer, max_version):
    cap = pinned_buffer.__dlpack__(max_version=max_version)
    got = np.from_dlpack(CapsuleWrapper(cap))
    assert got.dtype == np.uint8 and got.tobytes() == bytes(range(64))
    torch = pytest.importorskip("torch")
    t = torch.from_dlpack(pinned_buffer)
    assert bytes(t.numpy()) == bytes(range(64))
    # The buffer cannot be released while an export lives; once it goes, it can.
    with pytest.raises(BufferError):
        pinned_buffer.release()
    del t, got, cap
    gc.collect()


def test_unconsumed_capsules_release_their_references(pinned_buffer):
    caps = [pinned_buffer.__dlpack__(max_version=v) for v in (None, (1, 0))] * 4
    with pytest.raises(BufferError):
        pinned_buffer.release()
    del caps
    pinned_buffer.release()
    assert pinned_buffer.released


# ---- export_capsules and the once-per-batch consumer wait ----

def test_export_capsules_roundtrip_and_one_wait_per_batch(batch):
    item, out = batch
    keys = list(item)
    extras = ["text", 3, None, item["k0"]]
    leaves = [out[k] for k in keys] + extras
    w0, s0 = counters()
    caps = _C.export_capsules(leaves, None)
    w1, s1 = counters()
    assert (w1 - w0, s1 - s0) == (1, len(keys) - 1)
    assert isinstance(caps, list) and len(caps) == len(leaves)
    for obj, cap in zip(extras, caps[len(keys):]):
        assert cap is obj  # passed through unchanged
    for k, cap in zip(keys, caps):
        assert capsule_name(cap) == "dltensor"
        got = np.from_dlpack(CapsuleWrapper(cap))
        assert got.dtype == item[k].dtype and got.shape == item[k].shape
        assert got.tobytes() == item[k].tobytes()
        assert capsule_name(cap) == "used_dltensor"


def test_export_capsules_torch_roundtrip(batch):
    torch = pytest.importorskip("torch")
    item, out = batch
    keys = list(item)
    caps = _C.export_capsules(tuple(out[k] for k in keys), -1)
    for k, cap in zip(keys, caps):
        t = torch.from_dlpack(cap)
        a = item[k]
        assert tuple(t.shape) == a.shape
        assert t.numpy().tobytes() == a.tobytes()


def test_memo_lives_as_long_as_the_exports(batch):
    item, out = batch
    leaves = [out[k] for k in item]
    w0, s0 = counters()
    caps = _C.export_capsules(leaves, None)
    arrays = [np.from_dlpack(CapsuleWrapper(c)) for c in caps]
    del caps
    # Tensors made from the capsules keep the wait valid: per-leaf exports skip it too.
    for da in leaves:
        np.from_dlpack(da)
    assert counters()[0] - w0 == 1
    del arrays
    gc.collect()
    # Every export has gone: the next one waits again (the memo never outlives its exports).
    caps = _C.export_capsules(leaves[:3], None)
    w2, s2 = counters()
    assert w2 - w0 == 2
    assert s2 - s0 == (len(leaves) - 1) + len(leaves) + 2
    del caps


def test_export_capsules_one_wait_per_distinct_batch():
    items = [make_batch(8, seed=s) for s in range(3)]
    pf = pinloader.AsyncPrefetcher(items, device="cpu")
    outs = drain(pf)
    leaves = [b[k] for k in items[0] for b in outs]  # interleaved across the batches
    w0, s0 = counters()
    caps = _C.export_capsules(leaves, None)
    w1, s1 = counters()
    assert (w1 - w0, s1 - s0) == (3, len(leaves) - 3)
    i = 0
    for k in items[0]:
        for it in items:
            assert np.from_dlpack(CapsuleWrapper(caps[i])).tobytes() == it[k].tobytes()
            i += 1
    pf.close()


@pytest.mark.parametrize(
    "args,exc",
    [
        ((5, None), TypeError),
        ((iter([]), None), TypeError),
        (("abc", None), TypeError),
        (({"a": 1}, None), TypeError),
        (([], None, None), TypeError),
        (([],), TypeError),
    ],
)
def test_export_capsules_hostile_containers(args, exc):
    with pytest.raises(exc):
        _C.export_capsules(*args)


@pytest.mark.parametrize(
    "stream,exc",
    [(2**70, ValueError), (-(2**70), ValueError), (-2, ValueError), (True, TypeError),
     ("x", TypeError), (1, BufferError), (0, BufferError)],
)
def test_export_capsules_hostile_stream(batch, stream, exc):
    _, out = batch
    w0, _ = counters()
    with pytest.raises(exc):
        _C.export_capsules([1, out["k0"], out["k1"]], stream)
    assert counters()[0] == w0  # refused before any wait
    # A list without DeviceArrays never reads the stream.
    assert _C.export_capsules([1, "a"], stream) == [1, "a"]


def test_export_capsules_empty_and_passthrough():
    assert _C.export_capsules([], None) == []
    assert _C.export_capsules((), 2**70) == []
    obj = object()
    assert _C.export_capsules((obj,), None)[0] is obj


def test_export_right_after_handoff_waits_for_the_copy():
    """Batches are handed out once their copy is queued, not finished: an export straight away
    must wait (in interruptible slices, GIL released) before the data can be read."""
    rng = np.random.default_rng(11)
    items = [{"big": rng.integers(0, 255, size=48 << 20, dtype=np.uint8),
              "small": np.arange(i, i + 10)} for i in range(3)]
    with pinloader.AsyncPrefetcher(items, device="cpu", depth=1) as pf:
        for item, out in zip(items, pf):
            w0, s0 = counters()
            caps = _C.export_capsules([out["small"], out["big"]], None)
            assert counters() == (w0 + 1, s0 + 1)
            assert np.from_dlpack(CapsuleWrapper(caps[1])).tobytes() == item["big"].tobytes()
            assert np.from_dlpack(CapsuleWrapper(caps[0])).tolist() == item["small"].tolist()


def test_export_capsules_outlive_the_prefetcher():
    item = make_batch(4, seed=7)
    pf = pinloader.AsyncPrefetcher([item], device="cpu")
    out = drain(pf)[0]
    caps = _C.export_capsules(list(out.values()), None)
    del out
    pf.close()
    gc.collect()
    for k, cap in zip(item, caps):
        assert np.from_dlpack(CapsuleWrapper(cap)).tobytes() == item[k].tobytes()


def test_export_capsules_release_device_blocks():
    before = _C._testing.live_device_blocks("host")[0]
    item = make_batch(6, seed=3)
    pf = pinloader.AsyncPrefetcher([item], device="cpu")
    out = drain(pf)[0]
    caps = _C.export_capsules(list(out.values()), None)
    consumed = [np.from_dlpack(CapsuleWrapper(c)) for c in caps[:3]]  # half consumed
    pf.close()
    del out
    gc.collect()
    assert _C._testing.live_device_blocks("host")[0] == before + 1  # held by the exports
    del caps, consumed
    gc.collect()
    assert _C._testing.live_device_blocks("host")[0] == before


def test_export_capsules_from_many_threads(batch):
    """Exports of one batch from several threads: every capsule is right, and every export
    either waited or found a wait already done (the memo is guarded by the block's lock)."""
    item, out = batch
    keys = list(item)
    leaves = [out[k] for k in keys]
    w0, s0 = counters()
    errors, results = [], {}

    def work(tid):
        try:
            got = []
            for _ in range(20):
                caps = _C.export_capsules(leaves, None)
                got.append([np.from_dlpack(CapsuleWrapper(c)).tobytes() for c in caps])
            results[tid] = got
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    want = [item[k].tobytes() for k in keys]
    assert len(results) == 4
    for got in results.values():
        assert all(g == want for g in got)
    w1, s1 = counters()
    assert (w1 - w0) + (s1 - s0) == 4 * 20 * len(keys)
    assert 1 <= w1 - w0 <= 4 * 20


# ---- the same on CUDA (run on the GPU machine: pytest -m gpu tests/test_dlpack_export.py) ----

def cuda_counters():
    c = _C._testing.debug_counters()
    return c["cuda_consumer_waits"], c["cuda_consumer_waits_skipped"]


@pytest.fixture
def cuda_batches():
    if not pinloader.cuda_available():
        pytest.skip("no CUDA device")
    items = [make_batch(32, seed=s) for s in range(2)]
    pf = pinloader.AsyncPrefetcher(items, device="cuda:0")
    outs = drain(pf)
    yield items, outs
    pf.close()


@pytest.mark.gpu
def test_cuda_export_capsules_one_wait_per_batch_and_stream(cuda_batches):
    torch = pytest.importorskip("torch")
    items, outs = cuda_batches
    keys = list(items[0])
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    tensors = []
    for s in streams:  # consumer streams that change between exports of the same batches
        for item, out in zip(items, outs):
            w0, k0 = cuda_counters()
            caps = _C.export_capsules([out[k] for k in keys] + ["meta"], s.cuda_stream)
            assert cuda_counters() == (w0 + 1, k0 + len(keys) - 1)
            assert caps[-1] == "meta"
            with torch.cuda.stream(s):
                ts = [torch.from_dlpack(c) for c in caps[:-1]]
                tensors.append(ts)
                for k, t in zip(keys, ts):
                    assert t.is_cuda
                    assert np.array_equal(t.cpu().numpy(), item[k])
    # The tensors still alive keep the memo: per-leaf exports to the same stream skip the wait.
    w0, _ = cuda_counters()
    with torch.cuda.stream(streams[0]):
        again = [torch.from_dlpack(outs[0][k]) for k in keys]
    assert cuda_counters()[0] == w0
    del again, tensors
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_default_stream_handles(cuda_batches):
    torch = pytest.importorskip("torch")
    items, outs = cuda_batches
    leaves = list(outs[0].values())
    w0, k0 = cuda_counters()
    legacy = _C.export_capsules(leaves, None)  # the legacy default stream, memoised
    assert cuda_counters() == (w0 + 1, k0 + len(leaves) - 1)
    w1, k1 = cuda_counters()
    per_thread = _C.export_capsules(leaves, 2)  # a different stream per thread: never memoised
    assert cuda_counters() == (w1 + len(leaves), k1)
    for caps in (legacy, per_thread):
        for k, c in zip(items[0], caps):
            assert np.array_equal(torch.from_dlpack(c).cpu().numpy(), items[0][k])
    with pytest.raises(ValueError):
        _C.export_capsules(leaves, 0)
    with pytest.raises(ValueError):
        _C.export_capsules(leaves, 2**70)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_memo_table_full_still_waits(cuda_batches):
    """More consumer streams than the memo holds: the extra streams are made to wait for every
    leaf (never skipped), and the data is right on all of them."""
    torch = pytest.importorskip("torch")
    items, outs = cuda_batches
    keys = list(items[0])[:4]
    leaves = [outs[0][k] for k in keys]
    streams = [torch.cuda.Stream() for _ in range(6)]
    held = []
    w0, k0 = cuda_counters()
    for s in streams:
        caps = _C.export_capsules(leaves, s.cuda_stream)
        with torch.cuda.stream(s):
            held.append([torch.from_dlpack(c) for c in caps])
    w1, k1 = cuda_counters()
    memo = 4  # PL_BLOCK_WAIT_MEMO in src/core/block.h
    assert w1 - w0 == memo * 1 + (len(streams) - memo) * len(keys)
    assert k1 - k0 == memo * (len(keys) - 1)
    for s, ts in zip(streams, held):
        with torch.cuda.stream(s):
            for k, t in zip(keys, ts):
                assert np.array_equal(t.cpu().numpy(), items[0][k])
    del held
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_big_batch_read_at_once_on_idle_stream():
    """A large batch read immediately on an idle consumer stream: only the event wait orders the
    read after the copy (the memo must not skip a first wait)."""
    if not pinloader.cuda_available():
        pytest.skip("no CUDA device")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    items = [{"a": rng.integers(0, 255, size=64 << 20, dtype=np.uint8),
              "b": rng.integers(0, 255, size=1 << 10, dtype=np.uint8)} for _ in range(3)]
    s = torch.cuda.Stream()
    with pinloader.AsyncPrefetcher(items, device="cuda:0") as pf:
        for item, out in zip(items, pf):
            caps = _C.export_capsules([out["b"], out["a"]], s.cuda_stream)
            with torch.cuda.stream(s):
                a = torch.from_dlpack(caps[1])
                total = a.sum(dtype=torch.int64)
            s.synchronize()
            assert int(total) == int(item["a"].sum(dtype=np.int64))
