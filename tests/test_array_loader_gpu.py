"""ArrayLoader on CUDA (gpu-marked: run on the GPU machine, `pytest -m gpu`): values through torch,
CuPy and JAX, and token windows from a memory-mapped file. (Two GPUs under torchrun:
test_example_ddp.py.)
"""
from __future__ import annotations

import numpy as np
import pytest

import pinloader
from helpers import ids, sample


def _gpu_loader(device="cuda:0"):
    n = 300
    a = sample((n, 3, 8), np.float32, 4)
    return a, pinloader.ArrayLoader((ids(n), a), 64, seed=3, device=device)


@pytest.mark.gpu
def test_gpu_values_through_torch():
    torch = pytest.importorskip("torch")
    import pinloader.torch as pt
    a, L = _gpu_loader(None)
    with pt.prefetch(L, device="cuda:0") as tp:
        for i, x in tp:
            assert x.is_cuda and x.device.index == 0
            assert np.array_equal(x.cpu().numpy(), a[i.cpu().numpy()])
    assert torch.cuda.is_available()


@pytest.mark.gpu
def test_gpu_values_through_cupy():
    cp = pytest.importorskip("cupy")
    import pinloader.cupy as pc
    a, L = _gpu_loader(None)
    with pc.prefetch(L, device=0) as it:
        for i, x in it:
            assert isinstance(x, cp.ndarray)
            assert np.array_equal(cp.asnumpy(x), a[cp.asnumpy(i)])


@pytest.mark.gpu
@pytest.mark.jax_gpu
def test_gpu_values_through_jax():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU device")
    import pinloader.jax as pj
    a, L = _gpu_loader(None)
    with pj.prefetch(L, device="cuda:0") as it:
        for i, x in it:
            assert np.array_equal(np.asarray(x), a[np.asarray(i)])


@pytest.mark.gpu
def test_gpu_windows_memmap(tmp_path):
    torch = pytest.importorskip("torch")
    import pinloader.torch as pt
    mm = np.memmap(tmp_path / "tok.bin", dtype=np.uint16, mode="w+", shape=(200_000,))
    mm[:] = np.arange(200_000) % 65521
    mm.flush()
    ro = np.memmap(tmp_path / "tok.bin", dtype=np.uint16, mode="r", shape=(200_000,))
    L = pinloader.ArrayLoader(ro, 16, windows=1025, seed=1)
    with pt.prefetch(L, device="cuda:0") as tp:
        starts = L.indices(0)
        for b, w in enumerate(tp):
            assert w.shape == (len(starts[b * 16:(b + 1) * 16]), 1025) and w.is_cuda
            want = np.stack([ro[s:s + 1025] for s in starts[b * 16:(b + 1) * 16]]).astype(np.int32)
            assert np.array_equal(w.to(torch.int32).cpu().numpy(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("gather", ["device", "host"])
def test_device_memory_stays_flat_without_a_device_synchronisation(gather):
    # Note [deferred frees] in src/core/block.c: a loader-bound loop that never synchronises the
    # device (a training loop) grew the device pool by one batch per batch, since the pool did
    # not see the release stream's frees complete
    torch = pytest.importorskip("torch")
    from pinloader import _C
    row, bs = 64 << 10, 128  # 8 MiB batches
    src = np.full((4096, row), 7, np.uint8)  # 256 MiB
    L = pinloader.ArrayLoader(src, bs, device="cuda:0", seed=1, gather=gather)
    it = iter(L)

    def take(n):
        nonlocal it
        for _ in range(n):
            try:
                b = next(it)
            except StopIteration:
                it = iter(L)
                b = next(it)
            torch.from_dlpack(b).view(-1)[:1].add_(0)  # a kernel reads the batch on torch's stream

    take(40)
    done = torch.cuda.Event(blocking=True)
    done.record()
    done.synchronize()  # an event, not a device-wide synchronisation
    before = _C._testing.device_pool_reserved(0)
    take(400)  # 3.2 GiB of batches
    done.record()
    done.synchronize()
    grown = _C._testing.device_pool_reserved(0) - before
    L.close()
    assert grown <= 16 * row * bs, f"the device pool grew by {grown >> 20} MiB over 400 batches of 8 MiB"


@pytest.mark.gpu
def test_a_dropped_batch_is_not_reused_while_a_slow_stream_still_reads_it():
    # Note [deferred frees] in src/core/block.c: a dropped batch's memory goes to a later batch
    # only once every stream that used it has passed its use. Here the consumer's stream sleeps
    # before each read while the host runs ahead, dropping each batch as soon as its read is
    # queued, and nothing synchronises the device: each read must still see its own batch.
    torch = pytest.importorskip("torch")
    n, width = 2048, 1024
    src = np.repeat(np.arange(n, dtype=np.int32)[:, None], width, axis=1)  # row i holds i
    L = pinloader.ArrayLoader(src, 64, device="cuda:0", seed=3, gather="device")
    side = torch.cuda.Stream()
    reads = []
    with torch.cuda.stream(side):
        for b in L:  # one epoch, 32 batches
            t = torch.from_dlpack(b)  # side waits for the copy; the deleter records side's use
            torch.cuda._sleep(5_000_000)  # a few ms of the side stream before the read
            reads.append(t[:, ::97].clone())
            del t, b
    done = torch.cuda.Event(blocking=True)
    done.record(side)
    done.synchronize()
    L.close()
    got = torch.cat(reads).cpu().numpy()
    assert (got == got[:, :1]).all(), "a row was read while another batch overwrote it"
    assert sorted(got[:, 0].tolist()) == list(range(n)), "the epoch's rows were not each read once"


# ---- doors over one loader (Note [doors over a loader] in pinloader/_loader_base.py) ----

@pytest.mark.gpu
def test_gpu_a_torch_door_per_epoch_over_one_loader():
    pytest.importorskip("torch")
    import pinloader.torch as pt
    a, L = _gpu_loader(None)
    pfs, ptrs = set(), set()
    for ep in range(3):
        L.set_epoch(ep)
        got = []
        for i, x in pt.prefetch(L):
            assert x.is_cuda
            got.append(i.cpu().numpy())
            assert np.array_equal(x.cpu().numpy(), a[got[-1]])
        pfs.add(id(L._pf))
        assert np.array_equal(np.concatenate(got), L.indices(ep))
    assert len(pfs) == 1  # the same door settings each epoch: one prefetcher
    for ep in range(3, 5):  # a static door per epoch keeps its static buffers too
        door = pt.prefetch(L, static=True)
        for i, x in door:
            ptrs.add(x.data_ptr())
            v = door.valid_rows
            assert np.array_equal(x[:v].cpu().numpy(), a[i[:v].cpu().numpy()])
    assert len(ptrs) == 1
    L.close()


@pytest.mark.gpu
def test_gpu_doors_after_a_plain_epoch_and_with_other_options():
    torch = pytest.importorskip("torch")
    import pinloader.torch as pt
    a, L = _gpu_loader(None)
    plain = [i for i, _ in L]
    assert len(plain) == len(L)
    for ep, door in enumerate([pt.prefetch(L), pt.prefetch(L, static=True), pt.prefetch(L, depth=4),
                               pt.prefetch(L)]):
        got = []
        for i, x in door:
            v = door.valid_rows or len(i)
            got.append(i[:v].cpu().numpy().copy())
            assert isinstance(x, torch.Tensor) and x.is_cuda
            assert np.array_equal(x[:v].cpu().numpy(), a[got[-1]])
        assert np.array_equal(np.concatenate(got), L.indices(ep + 1))
    assert len([b for b in L]) == len(L)  # and plain again
    L.close()


@pytest.mark.gpu
def test_gpu_a_door_over_a_closed_loader_says_closed():
    pytest.importorskip("torch")
    import pinloader.torch as pt
    _, L = _gpu_loader(None)
    list(pt.prefetch(L))
    L.close()
    with pytest.raises(ValueError, match="ArrayLoader is closed"):
        pt.prefetch(L)


@pytest.mark.gpu
def test_gpu_cupy_doors_per_epoch_and_switched():
    cp = pytest.importorskip("cupy")
    pytest.importorskip("torch")
    import pinloader.cupy as pc
    import pinloader.torch as pt
    a, L = _gpu_loader(None)
    for ep, make in enumerate([lambda: pc.prefetch(L, device=0), lambda: pc.prefetch(L, device=0),
                               lambda: pt.prefetch(L), lambda: pc.prefetch(L, device=0, static=True)]):
        door = make()
        got = []
        for i, x in door:
            host_i = cp.asnumpy(i) if isinstance(i, cp.ndarray) else i.cpu().numpy()
            host_x = cp.asnumpy(x) if isinstance(x, cp.ndarray) else x.cpu().numpy()
            v = door.valid_rows or len(host_i)
            got.append(host_i[:v])
            assert np.array_equal(host_x[:v], a[host_i[:v]])
        assert np.array_equal(np.concatenate(got), L.indices(ep))
    L.close()


@pytest.mark.gpu
def test_gpu_nested_torch_doors():
    torch = pytest.importorskip("torch")
    import pinloader.torch as pt
    src = [np.full((64, 3), b, np.float32) for b in range(5)]
    got = [t.cpu().numpy() for t in pt.prefetch(pt.prefetch(src))]
    assert np.array_equal(np.stack(got), np.stack(src))
    a, L = _gpu_loader(None)
    outer = pt.prefetch(pt.prefetch(L))
    for i, x in outer:
        assert x.is_cuda and np.array_equal(x.cpu().numpy(), a[i.cpu().numpy()])
    assert outer.state_dict()["epoch"] == 1
    L.close()
    assert torch.cuda.is_available()
