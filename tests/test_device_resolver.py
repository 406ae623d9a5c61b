"""device= read in one place (pinloader/_device.py, Note [device spellings]): every spelling
through every door and loader, the bad ones refused with one message naming the door, the
Python reader agreeing with the native one, and "cuda" meaning the door's framework's current
device (the CuPy door took it for device 0).

CuPy and JAX are not installed on CI: their doors run here over small fake modules that have
only what the doors call (a current device, device objects, DLPack import), and the prefetcher
the door makes is a recorder, so what the door hands the prefetcher is what is asserted. The
torch door runs over the real torch (a CPU build on CI) with its current device patched where a
GPU is pretended. The gpu-marked tests at the end do the same with the real frameworks on CUDA.
"""
from __future__ import annotations

import importlib
import re
import sys
import types

import numpy as np
import pytest

import pinloader
from pinloader import _door, _C, _device

try:
    import torch
except ImportError:  # the torch door's tests skip; the others read a stand-in device object
    torch = None


class StandIn:
    """An object with ``type`` and ``index``, which is what the readers take a torch.device
    as (the native one too)."""

    def __init__(self, type, index=None):
        self.type, self.index = type, index

    def __repr__(self):
        return f"device(type={self.type!r}" + ("" if self.index is None else f", index={self.index}") + ")"


def tdev(*args):
    """torch.device(*args), or its stand-in where torch is not installed."""
    return torch.device(*args) if torch is not None else StandIn(*args)


@pytest.fixture
def pt():
    pytest.importorskip("torch")
    import pinloader.torch
    return pinloader.torch


class Recorder:
    """Stands in for AsyncPrefetcher under a door: records what the door asked for."""

    def __init__(self, iterable, device=None, depth=2, **opts):
        self.iterable, self.device, self.depth, self.opts = iterable, device, depth, opts

    def close(self):
        pass


@pytest.fixture
def recorder(monkeypatch):
    monkeypatch.setattr(_door, "AsyncPrefetcher", Recorder)


def _import_door(monkeypatch, name):
    """pinloader.<name> imported afresh over the fake framework now in sys.modules; removed at
    teardown (with monkeypatch's undo, which puts back whatever was there before)."""
    monkeypatch.delitem(sys.modules, f"pinloader.{name}", raising=False)
    monkeypatch.delattr(pinloader, name, raising=False)
    return importlib.import_module(f"pinloader.{name}")


def _forget_door(name, mod):
    if sys.modules.get(f"pinloader.{name}") is mod:
        del sys.modules[f"pinloader.{name}"]
    if getattr(pinloader, name, None) is mod:
        delattr(pinloader, name)


# ---- the shared grammar, and the native reader agreeing with it ----

GOOD = [  # (spelling, what the prefetcher is given)
    (None, None), ("cpu", "cpu"), ("cpu:0", "cpu"), ("host", "cpu"), ("cuda", "cuda"),
    ("cuda:0", "cuda:0"), ("cuda:12", "cuda:12"), (0, "cuda:0"), (3, "cuda:3"),
    (np.int64(2), "cuda:2"), (tdev("cpu"), "cpu"), (tdev("cpu", 0), "cpu"),
    (tdev("cuda"), "cuda"), (tdev("cuda", 1), "cuda:1"),
]

BAD = [  # (spelling, error): refused alike by the native reader (AsyncPrefetcher)
    (True, TypeError), (False, TypeError), (1.5, TypeError), (b"cuda", TypeError),
    (["cuda"], TypeError), (object(), TypeError),
    ("gpu", ValueError), ("gpu:0", ValueError), ("CUDA", ValueError), (" cuda", ValueError),
    ("cuda ", ValueError), ("cuda:", ValueError), ("cuda:x", ValueError), ("cuda:-1", ValueError),
    ("cuda:+1", ValueError), ("cuda:1_0", ValueError), ("cuda:\u0661", ValueError),
    ("cpu:1", ValueError), ("host:0", ValueError), ("meta", ValueError), ("", ValueError),
    (-1, ValueError), (tdev("meta"), ValueError), (tdev("cpu", 1), ValueError),
]


@pytest.mark.parametrize("device,want", GOOD, ids=repr)
def test_every_accepted_spelling_reads_to_one_canonical_string(device, want):
    assert _device.canonical(device, "here") == want
    if want == "cpu":  # the native reader puts it on the host backend too
        with pinloader.AsyncPrefetcher([], device=device) as pf:
            assert pf.device == "cpu"


@pytest.mark.parametrize("device,error", BAD, ids=repr)
def test_bad_spellings_are_refused_alike_by_the_python_and_native_readers(device, error):
    with pytest.raises(error, match=r"^ArrayLoader: device must be None, 'cpu', 'cpu:0', 'host', "
                       r"'cuda', 'cuda:N', an int N or a torch\.device[;]") as ei:
        _device.canonical(device, "ArrayLoader")
    if error is TypeError:
        assert f"not {type(device).__name__}" in str(ei.value)
    else:
        assert repr(device) in str(ei.value)
    with pytest.raises(error):
        pinloader.AsyncPrefetcher([], device=device)


def test_a_bool_says_which_device_it_would_have_read_as():
    with pytest.raises(TypeError, match=r"not bool \(True would read as device 1\)"):
        _device.parse(True, "here")
    with pytest.raises(TypeError, match=r"not bool \(False would read as device 0\)"):
        _device.parse(False, "here")


def test_indices_past_the_native_readers_bound_are_refused():
    assert _device.canonical(1 << 20, "here") == f"cuda:{1 << 20}"
    assert _device.canonical(f"cuda:{1 << 20}", "here") == f"cuda:{1 << 20}"
    for device in ((1 << 20) + 1, f"cuda:{(1 << 20) + 1}", 1 << 40, f"cuda:{1 << 64}",
                   "cuda:" + "9" * 5000, 10 ** 5000):
        with pytest.raises(ValueError, match="between 0 and 1048576"):
            _device.parse(device, "here")


# ---- the loaders ----

@pytest.mark.parametrize("make", ["ArrayLoader", "ImageLoader"])
@pytest.mark.parametrize("device,error", [(True, TypeError), ("cuda:x", ValueError),
                                          ("cpu:1", ValueError), (2.0, TypeError)], ids=repr)
def test_a_loader_refuses_a_bad_device_where_it_is_made(make, device, error, tmp_path):
    with pytest.raises(error, match=rf"^{make}: device must be "):
        if make == "ArrayLoader":
            pinloader.ArrayLoader(np.arange(4), 2, device=device)
        else:
            pinloader.ImageLoader(str(tmp_path), 2, device=device)


@pytest.mark.parametrize("device", ["cpu", "cpu:0", "host", tdev("cpu"), None],
                         ids=repr)
def test_a_loader_and_a_door_agree_on_the_host_however_it_is_spelt(device, pt):
    data = np.arange(10, dtype=np.float32)
    with pinloader.ArrayLoader(data, 5, device=device, shuffle=False) as L:
        for door_device in ("cpu", "cpu:0", "host", tdev("cpu")):
            got = [t.numpy().copy() for t in pt.prefetch(L, device=door_device)]
            assert np.array_equal(np.concatenate(got), data)
            assert L._pf_settings[0] == "cpu"


def test_a_loader_made_for_cuda_runs_a_doors_cuda_n_on_n(monkeypatch, pt):
    # the door's arrays are made for its index: the loader's "cuda" (the current device when the
    # prefetcher is made) gives way to it; a loader's "cuda:N" agrees only with a door's N
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    L = pinloader.ArrayLoader(np.arange(4), 2, device="cuda")
    for door_device, want in (("cuda", "cuda:3"), ("cuda:1", "cuda:1"), (5, "cuda:5"),
                              (tdev("cuda", 2), "cuda:2")):
        door = pt.prefetch(L, device=door_device)
        assert door._pf._settings[0] == want
        assert door.device == torch.device(want)
    L.close()
    L = pinloader.ArrayLoader(np.arange(4), 2, device=torch.device("cuda", 1))
    assert pt.prefetch(L, device=1)._pf._settings[0] == "cuda:1"
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # the door's "cuda" is torch's
    assert pt.prefetch(L, device="cuda")._pf._settings[0] == "cuda:1"
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for other in ("cuda", "cuda:0", "cpu", 2):
        with pytest.raises(ValueError, match=r"ArrayLoader was made with device='cuda:1', but the "
                           r"door asks for device="):
            pt.prefetch(L, device=other)
    L.close()


# ---- the torch door ----

TORCH = [  # (spelling, prefetcher's device, door's torch.device), torch's current device 2
    ("cpu", "cpu", "cpu"), ("cpu:0", "cpu", "cpu"), ("host", "cpu", "cpu"),
    (tdev("cpu"), "cpu", "cpu"), ("cuda", "cuda:2", "cuda:2"),
    (tdev("cuda"), "cuda:2", "cuda:2"), ("cuda:0", "cuda:0", "cuda:0"),
    ("cuda:5", "cuda:5", "cuda:5"), (1, "cuda:1", "cuda:1"), (np.int32(4), "cuda:4", "cuda:4"),
    (tdev("cuda", 3), "cuda:3", "cuda:3"),
]


@pytest.mark.parametrize("device,core,native", TORCH, ids=repr)
def test_torch_door_spellings(device, core, native, recorder, monkeypatch, pt):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    door = pt.prefetch([np.zeros(2)], device=device)
    assert door._pf.device == core
    assert door.device == torch.device(native)
    assert (door._pf.opts["stream"] is None) == (core == "cpu")


def test_torch_door_default_follows_pinloaders_backend(recorder, monkeypatch, pt):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(_C, "backend", lambda: "host")
    assert pt.prefetch([]).device == torch.device("cpu")
    monkeypatch.setattr(_C, "backend", lambda: "cuda")
    door = pt.prefetch([])
    assert door.device == torch.device("cuda", 1) and door._pf.device == "cuda:1"


def test_torch_door_leaves_cuda_to_the_prefetcher_when_torch_has_none(recorder, monkeypatch, pt):
    # a CPU build of torch cannot tell its current device: the prefetcher says why CUDA is
    # unusable (the next test, unpatched)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    door = pt.prefetch([], device="cuda")
    assert door._pf.device == "cuda" and door.device == torch.device("cuda")


@pytest.mark.skipif(pinloader.cuda_available(), reason="CUDA is usable here")
def test_cuda_without_cuda_is_the_prefetchers_error_at_the_torch_door(pt):
    for device in ("cuda", "cuda:0", 0):
        with pytest.raises((pinloader.CudaError, ValueError), match="was asked for"):
            pt.prefetch([], device=device)


@pytest.mark.parametrize("device,error", BAD, ids=repr)
def test_torch_door_refuses_bad_spellings_naming_itself(device, error, pt):
    with pytest.raises(error, match=r"^pinloader\.torch\.prefetch: device must be None, 'cpu', "
                       r"'cpu:0', 'host', 'cuda', 'cuda:N', an int N or a torch\.device;"):
        pt.prefetch([np.zeros(1)], device=device)


# ---- the CuPy door, over a fake CuPy ----

class FakeCupyDevice:
    """cupy.cuda.Device: Device() is the current device, Device(n) device n."""

    current = 0

    def __init__(self, device=None):
        self.id = FakeCupyDevice.current if device is None else int(device)

    def __eq__(self, other):
        return isinstance(other, FakeCupyDevice) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


def _fake_cupy(available=True):
    cp = types.ModuleType("cupy")
    cp.ndarray = type("ndarray", (), {})
    cuda = types.SimpleNamespace(Device=FakeCupyDevice, is_available=lambda: available,
                                 get_current_stream=lambda: types.SimpleNamespace(ptr=0),
                                 stream=types.SimpleNamespace(is_ptds_enabled=lambda: False))
    cp.cuda = cuda
    # what cupy.from_dlpack reads first: the device the producer says the data is on
    cp.from_dlpack = lambda obj: ("imported", obj.__dlpack_device__())
    return cp


@pytest.fixture
def cupy_door(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(FakeCupyDevice, "current", 0)
    mod = _import_door(monkeypatch, "cupy")
    yield mod
    _forget_door("cupy", mod)


CUPY = [  # (spelling, CUDA device) with CuPy's current device 3
    (None, 3), ("cuda", 3), (tdev("cuda"), 3), ("cuda:0", 0), ("cuda:5", 5), (0, 0),
    (2, 2), (np.int64(1), 1), (tdev("cuda", 4), 4), (FakeCupyDevice(6), 6),
]


@pytest.mark.parametrize("device,index", CUPY, ids=repr)
def test_cupy_door_spellings(device, index, cupy_door, recorder, monkeypatch):
    monkeypatch.setattr(FakeCupyDevice, "current", 3)
    door = cupy_door.prefetch([np.zeros(2)], device=device)
    assert door._pf.device == f"cuda:{index}"
    assert door.device == FakeCupyDevice(index)
    # each array is imported as being on that device
    assert door._pf.opts["convert"](object()) == ("imported", (2, index))


def test_cupy_door_cuda_is_cupys_current_device_not_device_0(cupy_door, recorder, monkeypatch):
    # the regression: device="cuda" was read as device 0 whatever CuPy's current device was
    for current in (1, 7, 0):
        monkeypatch.setattr(FakeCupyDevice, "current", current)
        for spelling in ("cuda", None):
            door = cupy_door.prefetch([np.zeros(2)], device=spelling)
            assert door._pf.device == f"cuda:{current}", spelling
            assert door._pf.opts["convert"](object())[1] == (2, current)


def test_cupy_door_hands_the_prefetcher_cupys_current_device(cupy_door, monkeypatch):
    # no recorder: the native prefetcher itself names the device it was given (one past the
    # devices visible here, so that it refuses whatever this machine has)
    missing = pinloader.device_count() + 5
    monkeypatch.setattr(FakeCupyDevice, "current", missing)
    with pytest.raises((pinloader.CudaError, ValueError), match=f"'cuda:{missing}' was asked for"):
        cupy_door.prefetch([np.zeros(2)], device="cuda")


@pytest.mark.parametrize("device", ["cpu", "cpu:0", "host", tdev("cpu")], ids=repr)
def test_cupy_door_refuses_the_host(device, cupy_door):
    with pytest.raises(ValueError, match=r"^pinloader\.cupy\.prefetch: device must be .*; got "
                       r".* \(a cupy\.ndarray lives on a CUDA device; the host backend has none\)"):
        cupy_door.prefetch([np.zeros(1)], device=device)


@pytest.mark.parametrize("device,error", [d for d in BAD if not str(d[0]).startswith("cpu")]
                         + [(types.SimpleNamespace(id=1), TypeError)], ids=repr)
def test_cupy_door_refuses_bad_spellings_naming_itself(device, error, cupy_door):
    with pytest.raises(error, match=r"^pinloader\.cupy\.prefetch: device must be None, 'cuda', "
                       r"'cuda:N', an int N, a torch\.device or a cupy\.cuda\.Device"):
        cupy_door.prefetch([np.zeros(1)], device=device)


def test_cupy_door_without_cuda_leaves_cuda_to_the_prefetcher(monkeypatch, recorder):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(available=False))
    mod = _import_door(monkeypatch, "cupy")
    try:
        for device in (None, "cuda"):
            door = mod.prefetch([], device=device)
            assert door._pf.device == "cuda" and door.device is None
    finally:
        _forget_door("cupy", mod)


# ---- the JAX door, over a fake JAX ----

class FakeJaxDevice:
    def __init__(self, platform, id, local=None):
        self.platform, self.id = platform, id
        if local is not None:
            self.local_hardware_id = local

    def __repr__(self):
        return f"{self.platform.upper()}Device(id={self.id})"


def _fake_jax(gpus, cpus):
    jax = types.ModuleType("jax")

    def local_devices(backend=None):
        found = gpus if backend in (None, "gpu") and gpus else cpus if backend in (None, "cpu") else []
        if not found:
            raise RuntimeError(f"Unknown backend {backend}")
        return list(found)

    jax.local_devices = local_devices
    jax.devices = local_devices
    jax.device_put = lambda arr, dev: arr
    jax.dlpack = types.ModuleType("jax.dlpack")
    jax.dlpack.from_dlpack = lambda leaf: leaf
    return jax


@pytest.fixture
def jax_door(monkeypatch):
    def make(gpus, cpus):
        fake = _fake_jax(gpus, cpus)
        monkeypatch.setitem(sys.modules, "jax", fake)
        monkeypatch.setitem(sys.modules, "jax.dlpack", fake.dlpack)
        made.append(_import_door(monkeypatch, "jax"))
        return made[-1]
    made = []
    yield make
    for mod in made:
        _forget_door("jax", mod)


# a second process's devices: global ids 8 and 9, CUDA ordinals 0 and 1 here
GPUS = [FakeJaxDevice("gpu", 8, 0), FakeJaxDevice("gpu", 9, 1)]
CPUS = [FakeJaxDevice("cpu", 0), FakeJaxDevice("cpu", 1)]
JAX = [  # (spelling, prefetcher's device, the JAX device)
    (None, "cuda:0", GPUS[0]), ("cuda", "cuda:0", GPUS[0]), ("gpu", "cuda:0", GPUS[0]),
    ("cuda:1", "cuda:1", GPUS[1]), ("gpu:1", "cuda:1", GPUS[1]), (1, "cuda:1", GPUS[1]),
    (tdev("cuda", 1), "cuda:1", GPUS[1]), (tdev("cuda"), "cuda:0", GPUS[0]),
    (GPUS[1], "cuda:1", GPUS[1]), ("cpu", "cpu", CPUS[0]), ("cpu:0", "cpu", CPUS[0]),
    ("host", "cpu", CPUS[0]), ("cpu:1", "cpu", CPUS[1]), (CPUS[1], "cpu", CPUS[1]),
    (tdev("cpu"), "cpu", CPUS[0]),
]


@pytest.mark.parametrize("device,core,native", JAX, ids=repr)
def test_jax_door_spellings(device, core, native, jax_door, recorder):
    pj = jax_door(GPUS, CPUS)
    door = pj.prefetch([np.zeros(2)], device=device)
    assert door._pf.device == core
    assert door.device is native


def test_jax_door_without_a_gpu(jax_door, recorder):
    pj = jax_door([], CPUS)
    door = pj.prefetch([])  # JAX's default device is then its CPU: the host backend
    assert door._pf.device == "cpu" and door.device is CPUS[0]
    for device in ("cuda", "cuda:0", 0):
        with pytest.raises(RuntimeError, match="Unknown backend gpu"):  # JAX's own error
            pj.prefetch([], device=device)


@pytest.mark.parametrize("device,why", [("cuda:2", "JAX has no GPU 2 here"),
                                        (7, "JAX has no GPU 7 here"),
                                        ("cpu:2", "JAX has no CPU device 2 here"),
                                        (FakeJaxDevice("tpu", 0), "a tpu device")], ids=repr)
def test_jax_door_refuses_devices_it_cannot_serve(device, why, jax_door):
    pj = jax_door(GPUS, CPUS)
    with pytest.raises(ValueError, match=rf"^pinloader\.jax\.prefetch: device must be .*a "
                       rf"jax\.Device; got {re.escape(repr(device))} \({why}"):
        pj.prefetch([], device=device)


def _jax_takes(device):
    """The spellings the JAX door takes and the others refuse: JAX's "gpu" aliases and its CPU
    devices by index (a string, or a torch.device-like of type "cpu" -- real or the stand-in,
    whose str differs)."""
    if isinstance(device, str):
        return device in ("gpu", "gpu:0", "cpu:1")
    return getattr(device, "type", None) == "cpu" and bool(getattr(device, "index", None))


@pytest.mark.parametrize("device,error", [d for d in BAD if not _jax_takes(d[0])], ids=repr)
def test_jax_door_refuses_bad_spellings_naming_itself(device, error, jax_door):
    pj = jax_door(GPUS, CPUS)
    with pytest.raises(error, match=r"^pinloader\.jax\.prefetch: device must be None, 'cpu', "
                       r"'cpu:N', 'host', 'cuda', 'cuda:N', an int N, 'gpu', 'gpu:N', a "
                       r"torch\.device or a jax\.Device"):
        pj.prefetch([], device=device)


# ---- on CUDA, with the real frameworks ----

def _other_device():
    """A CUDA device other than 0 when there are two, else 0."""
    return 1 if pinloader.device_count() > 1 else 0


@pytest.mark.gpu
def test_gpu_torch_door_cuda_is_torchs_current_device():
    pytest.importorskip("torch")
    import pinloader.torch as pt
    n = _other_device()
    src = [np.full((4, 3), i, np.float32) for i in range(3)]
    with torch.cuda.device(n):
        for device in ("cuda", None, torch.device("cuda")):
            with pt.prefetch(src, device=device) as door:
                assert door.device == torch.device("cuda", n)
                for ref, t in zip(src, door):
                    assert t.device == torch.device("cuda", n)
                    assert np.array_equal(t.cpu().numpy(), ref)


@pytest.mark.gpu
def test_gpu_cupy_door_cuda_is_cupys_current_device():
    cp = pytest.importorskip("cupy")
    import pinloader.cupy as pc
    n = _other_device()
    src = [np.full((4, 3), i, np.float32) for i in range(3)]
    with cp.cuda.Device(n):
        for device in ("cuda", None, n, cp.cuda.Device(n)):
            with pc.prefetch(src, device=device) as door:
                assert door.device.id == n
                for ref, a in zip(src, door):
                    assert a.device.id == n
                    assert np.array_equal(cp.asnumpy(a), ref)


@pytest.mark.gpu
@pytest.mark.jax_gpu
def test_gpu_jax_door_cuda_is_jaxs_default_gpu():
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.local_devices(backend="gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")
    import pinloader.jax as pj
    src = [np.full((4, 3), i, np.float32) for i in range(3)]
    for device in ("cuda", "gpu", gpu, 0):
        with pj.prefetch(src, device=device) as door:
            assert door.device == gpu
            for ref, a in zip(src, door):
                assert a.devices() == {gpu}
                assert np.array_equal(np.asarray(a), ref)
