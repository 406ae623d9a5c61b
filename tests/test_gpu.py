"""GPU tests: run on a machine with a CUDA device (`pytest -m gpu`); skipped with a reason elsewhere.

They cover what the host backend cannot: real streams and copy engines, the consumer-stream
event wait, DLPack into torch, CuPy and JAX on the device, pinned-source direct copies, and a
training loop that must give bit-identical losses with and without pinloader.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import pinloader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not pinloader.cuda_available(),
                       reason=f"no CUDA device: {pinloader.cuda_info()['error']}"),
]


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def _batches(n, seed=0, shape=(8, 3, 32, 32)):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(shape, dtype=np.float32),
             "y": rng.integers(0, 10, size=shape[0], dtype=np.int64),
             "meta": ("tag", i)} for i in range(n)]


def test_device_arrays_report_cuda(torch):
    src = _batches(3)
    with pinloader.AsyncPrefetcher(src, device="cuda:0") as pf:
        assert pf.device == "cuda:0"
        for b, ref in zip(pf, src):
            assert b["x"].__dlpack_device__() == (2, 0)
            assert b["x"].device == "cuda:0"
            assert b["meta"] == ref["meta"]
            t = torch.from_dlpack(b["x"])
            assert t.is_cuda and t.dtype == torch.float32
            np.testing.assert_array_equal(t.cpu().numpy(), ref["x"])
            np.testing.assert_array_equal(torch.from_dlpack(b["y"]).cpu().numpy(), ref["y"])


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32",
                                   "int64", "uint64", "float16", "float32", "float64",
                                   "complex64", "complex128"])
def test_every_dtype_roundtrip_torch(torch, dtype):
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((5, 7)) * 100).astype(dtype)
    cases = [a, a[:, ::2], a[::-1], np.asfortranarray(a), a[0, 0, ...], a[:0]]
    with pinloader.AsyncPrefetcher([cases], device="cuda:0") as pf:
        (out,) = list(pf)
    for src, leaf in zip(cases, out):
        t = torch.from_dlpack(leaf)
        np.testing.assert_array_equal(t.cpu().numpy(), src)
        assert tuple(t.shape) == src.shape


def test_bfloat16_and_pinned_torch_sources(torch):
    x = torch.randn(64, 1024).to(torch.bfloat16)
    p = torch.randn(256, 1024).pin_memory()          # pinned: copied without staging
    nc = torch.randn(32, 64)[:, ::2]                 # non-contiguous CPU tensor
    with pinloader.AsyncPrefetcher([(x, p, nc)], device="cuda:0") as pf:
        (out,) = list(pf)
    assert out[0].dtype == "bfloat16"
    for src, leaf in zip((x, p, nc), out):
        assert torch.equal(torch.from_dlpack(leaf).cpu(), src)


def test_pinned_buffer_source_direct_copy(torch):
    pool = pinloader.PinnedPool(max_bytes=64 << 20)
    bufs = [pool.alloc(4 << 20) for _ in range(3)]
    arrays = [np.frombuffer(b, dtype=np.float32) for b in bufs]
    for i, a in enumerate(arrays):
        a[:] = np.arange(a.size, dtype=np.float32) + i
    attrs = pinloader._C._testing.Prim("cuda:0")
    assert attrs.is_pinned(bufs[0].ptr)
    with pinloader.AsyncPrefetcher([[a] for a in arrays], device="cuda:0") as pf:
        outs = [torch.from_dlpack(b[0]).cpu().numpy() for b in pf]
    for a, o in zip(arrays, outs):
        np.testing.assert_array_equal(a, o)


def test_busy_consumer_stream_sees_right_data(torch):
    """The wait is on the consumer's stream, not the host: a stream busy with a long kernel when
    from_dlpack is called still reads the copied data, not what was there before."""
    big = [np.full((4096, 4096), float(i), dtype=np.float32) for i in range(6)]
    s = torch.cuda.Stream()
    m = torch.randn(8192, 8192, device="cuda")
    with torch.cuda.stream(s), pinloader.AsyncPrefetcher(big, device="cuda:0", depth=2) as pf:
        for i, b in enumerate(pf):
            for _ in range(4):            # keep the consumer stream busy
                m = m @ m * 1e-4
            t = torch.from_dlpack(b)      # s waits on the ready event; host does not block
            assert float(t.mean().item()) == float(i)
    torch.cuda.synchronize()


def test_large_batch_read_at_once_on_an_idle_consumer_stream(torch):
    """The consumer reads each 256 MiB batch the moment it is handed out, on a stream with
    nothing queued: only the ready-event wait orders that read after the copy. (The busy-stream
    test above queues matmuls first, so there the copy is long done before the read.) A
    missing or misplaced wait snapshots memory the DMA has not reached yet."""
    n = (256 << 20) // 4  # 256 MiB of int32 per batch
    src = [np.random.default_rng(100 + i).integers(-2**31, 2**31 - 1, size=n, dtype=np.int32)
           for i in range(3)]
    s = torch.cuda.Stream()
    torch.cuda.synchronize()  # the consumer stream is idle when each batch arrives
    snaps = []
    with pinloader.AsyncPrefetcher(src, device="cuda:0", depth=1) as pf:
        for b in pf:
            with torch.cuda.stream(s):
                t = torch.from_dlpack(b)  # s waits on the ready event; the host does not
                snaps.append(t.clone())   # a device-side copy taken now, in s's order
            del t, b
    s.synchronize()
    assert len(snaps) == len(src)
    for i, (ref, snap) in enumerate(zip(src, snaps)):
        got = snap.cpu().numpy()
        if not np.array_equal(got, ref):
            bad = np.flatnonzero(got != ref)
            raise AssertionError(f"batch {i}: {bad.size} of {n} elements read before the copy "
                                 f"landed (first at element {bad[0]})")


def test_batch_held_for_50_steps_keeps_data(torch):
    src = [np.full((256, 256), i, dtype=np.int32) for i in range(60)]
    held = []
    with pinloader.AsyncPrefetcher(src, device="cuda:0", depth=3) as pf:
        for i, b in enumerate(pf):
            held.append((i, torch.from_dlpack(b)))
            held.append((i, b))   # and the DeviceArray itself, exported later
    torch.cuda.synchronize()
    for i, h in held:
        t = h if isinstance(h, torch.Tensor) else torch.from_dlpack(h)
        assert int(t[0, 0].item()) == i and int(t[-1, -1].item()) == i


def test_custom_stream_and_kept_alive_across_steps(torch):
    import pinloader.torch as pt
    src = _batches(20)
    s = torch.cuda.Stream()
    prev = None
    with torch.cuda.stream(s):
        for ref, b in zip(src, pt.prefetch(src, device="cuda")):
            assert b["x"].is_cuda
            assert torch.equal(b["x"].cpu(), torch.from_numpy(ref["x"]))
            if prev is not None:   # the previous batch is still intact after the next arrived
                assert torch.equal(prev[1]["x"].cpu(), torch.from_numpy(prev[0]["x"]))
            prev = (ref, b)


def test_training_loop_bit_identical(torch):
    """200 steps of a small MLP: the same losses with pinloader as with plain .to(device)."""
    import pinloader.torch as pt

    def run(use_pinloader):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3 * 16 * 16, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 10)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        rng = np.random.default_rng(0)
        data = [(rng.standard_normal((32, 3, 16, 16), dtype=np.float32),
                 rng.integers(0, 10, 32).astype(np.int64)) for _ in range(200)]
        loader = pt.prefetch(data, device="cuda") if use_pinloader else (
            (torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()) for x, y in data)
        losses = []
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x.flatten(1)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses).cpu().numpy()

    torch.backends.cudnn.deterministic = True
    a, b = run(False), run(True)
    assert a.shape == (200,)
    np.testing.assert_array_equal(a, b)


def test_cupy_roundtrip():
    cp = pytest.importorskip("cupy")
    import pinloader.cupy as pc
    src = _batches(4)
    for ref, b in zip(src, pc.prefetch(src)):
        assert isinstance(b["x"], cp.ndarray)
        np.testing.assert_array_equal(cp.asnumpy(b["x"]), ref["x"])
        np.testing.assert_array_equal(cp.asnumpy(b["y"]), ref["y"])


@pytest.mark.jax_gpu
def test_jax_roundtrip():
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")
    import pinloader.jax as pj
    src = _batches(4)
    for ref, b in zip(src, pj.prefetch(src, device=gpu)):
        assert b["x"].devices() == {gpu}
        np.testing.assert_array_equal(np.asarray(b["x"]), ref["x"])
        np.testing.assert_array_equal(np.asarray(b["y"] + 0), ref["y"])


def test_cuda_array_interface(torch):
    src = [np.arange(1000, dtype=np.float32).reshape(10, 100)]
    with pinloader.AsyncPrefetcher(src, device="cuda:0") as pf:
        (b,) = list(pf)
        cai = b.__cuda_array_interface__
        assert cai["version"] == 3 and cai["shape"] == (10, 100) and cai["typestr"] == "<f4"
        assert "stream" in cai
        t = torch.as_tensor(b, device="cuda")
        np.testing.assert_array_equal(t.cpu().numpy(), src[0])


def test_device_memory_flat_over_many_batches(torch):
    src = [np.ones((1024, 256), np.float32)] * 2000
    base = pinloader._C._testing.live_device_blocks("cuda")
    with pinloader.AsyncPrefetcher(src, device="cuda:0", depth=2) as pf:
        peak = 0
        for i, b in enumerate(pf):
            t = torch.from_dlpack(b)
            t.add_(1)
            if i % 100 == 0:
                peak = max(peak, pinloader._C._testing.live_device_blocks("cuda")[0])
        st = pf.stats()
    del b, t
    gc.collect()
    torch.cuda.synchronize()
    assert peak <= base[0] + 2 + 3   # depth + the one in hand + slack for frees in flight
    assert st["pinned_bytes_peak"] <= st["pinned_cap"]
    assert pinloader._C._testing.live_device_blocks("cuda")[0] == base[0]


def test_big_batch_chunked_pipeline(torch):
    """A 77 MB batch (the seed workload) is staged in chunks overlapping its DMA."""
    rng = np.random.default_rng(3)
    src = [(rng.standard_normal((128, 3, 224, 224), dtype=np.float32), np.arange(128)) for _ in range(3)]
    with pinloader.AsyncPrefetcher(src, device="cuda:0", staging_threads=4) as pf:
        for ref, b in zip(src, pf):
            assert torch.equal(torch.from_dlpack(b[0]).cpu(), torch.from_numpy(ref[0]))
        st = pf.stats()
    assert st["batches"] == 3 and st["pinned_bytes_peak"] <= st["pinned_cap"]


def test_capsule_output_waits_on_given_stream(torch):
    s = torch.cuda.Stream()
    src = _batches(2)
    with pinloader.AsyncPrefetcher(src, device="cuda:0", output="capsule", stream=s.cuda_stream) as pf:
        for ref, b in zip(src, pf):
            with torch.cuda.stream(s):
                t = torch.from_dlpack(b["x"])
                assert torch.equal(t.cpu(), torch.from_numpy(ref["x"]))
