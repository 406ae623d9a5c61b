"""The device gather (ArrayLoader(gather="device"), Note [device gather] in src/core/devgather.h):
values, layouts it serves and refuses, registrations (sharing, budget, release) and lifetimes.
Every test runs on the host backend (same semantics, the copy on its stream thread) and,
gpu-marked, on CUDA, where a kernel reads the registered rows. (Registered sources in fork
children: test_fork.py.)
"""
from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

import pinloader
from pinloader import _C
from helpers import run_c_check

BACKENDS = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]


def to_numpy(x):
    if x.device.startswith("cuda") if isinstance(x.device, str) else False:
        torch = pytest.importorskip("torch")
        return torch.from_dlpack(x).cpu().numpy()
    return np.from_dlpack(x).copy()


def batches(loader):
    out = []
    for b in loader:
        if isinstance(b, dict):
            out.append({k: to_numpy(v) for k, v in b.items()})
        else:
            out.append(to_numpy(b))
    return out


def backend_name(dev):
    return "host" if dev == "cpu" else "cuda"


def expected(src, loader, epoch, b, windows=None):
    idx = loader.indices(epoch)[b * loader.batch_size:(b + 1) * loader.batch_size]
    if windows is None:
        return src[idx]
    return np.stack([src[i:i + windows] for i in idx]) if len(idx) else src[:0]


DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.float16, np.int32, np.float32,
          np.uint32, np.int64, np.float64, np.uint64, np.complex64, np.complex128]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_equal_numpy_indexing_for_every_dtype(device, dtype):
    rng = np.random.default_rng(1)
    src = (rng.standard_normal((4099, 5)) * 50).astype(dtype)
    L = pinloader.ArrayLoader(src, 512, device=device, gather="device", seed=5)
    got = batches(L)
    assert L.stats()["gather"] == "device"
    assert len(got) == len(L) == 9
    for b, x in enumerate(got):
        np.testing.assert_array_equal(x, expected(src, L, 0, b))
    L.close()


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("row_shape,dtype", [((), np.uint8), ((3,), np.uint8), ((1,), np.int64),
                                             ((7,), np.float32), ((64,), np.uint8),
                                             ((4, 128), np.float32), ((3, 33, 17), np.uint8)])
def test_every_row_size_and_alignment(device, row_shape, dtype):
    # 1-, 3-, 8-, 28-, 64-, 2048- and 1683-byte rows: every unit width of the kernel, and
    # sources whose base address is not aligned to the row size (an offset view).
    rows = 9001
    size = rows * int(np.prod(row_shape, dtype=np.int64))
    src = (np.arange(size + 3, dtype=np.uint8)[3:] if dtype == np.uint8 else
           np.arange(size + 1, dtype=dtype)[1:])
    src = src.reshape((rows,) + row_shape)
    L = pinloader.ArrayLoader(src, 1000, device=device, gather="device", seed=2)
    for b, x in enumerate(batches(L)):
        np.testing.assert_array_equal(x, expected(src, L, 0, b))
    assert L.stats()["gather"] == "device"
    L.close()


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("windows", [1, 7, 64])
def test_token_windows_are_one_span_each(device, windows):
    tokens = np.random.default_rng(3).integers(0, 50257, 30_001).astype(np.uint16)
    L = pinloader.ArrayLoader(tokens, 64, windows=windows, device=device, gather="device", seed=9)
    assert L.stats()["gather"] in ("device", "mixed", "host")  # before the first iteration
    for epoch in range(2):
        for b, x in enumerate(batches(L)):
            np.testing.assert_array_equal(x, expected(tokens, L, epoch, b, windows))
    assert L.stats()["gather"] == "device"
    L.close()


@pytest.mark.parametrize("device", BACKENDS)
def test_negative_row_stride_is_device_gathered(device):
    base = np.arange(3000 * 6, dtype=np.float32).reshape(3000, 6)
    src = base[::-1]
    L = pinloader.ArrayLoader(src, 400, device=device, gather="device", shuffle=True, seed=4)
    for b, x in enumerate(batches(L)):
        np.testing.assert_array_equal(x, expected(src, L, 0, b))
    assert L.stats()["gather"] == "device"
    L.close()


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("make,why", [
    (lambda a: np.asfortranarray(a), "not contiguous"),
    (lambda a: a[:, ::2], "not contiguous"),
])
def test_layouts_it_cannot_serve_fall_back_in_auto_and_are_refused_in_device(device, make, why):
    src = make(np.arange(2000 * 128, dtype=np.int32).reshape(2000, 128))
    with pytest.raises(ValueError, match=rf"arrays: gather='device' cannot serve this source: .*{why}"):
        iter(pinloader.ArrayLoader(src, 100, device=device, gather="device"))
    L = pinloader.ArrayLoader({"ok": np.zeros((2000, 64)), "bad": src}, 100, device=device, seed=1)
    got = batches(L)
    st = L.stats()
    info = {i["leaf"]: i for i in st["gather_leaves"]}
    assert info["arrays['bad']"]["gather"] == "host" and why in info["arrays['bad']"]["reason"]
    if device == "cpu":
        assert st["gather"] == "host"  # auto keeps the host gather on the host backend
    else:
        assert info["arrays['ok']"]["gather"] == "device" and st["gather"] == "mixed"
    for b, x in enumerate(got):
        np.testing.assert_array_equal(x["bad"], expected(src, L, 0, b))
    L.close()


@pytest.mark.parametrize("device", BACKENDS)
def test_windows_over_rows_with_a_gap_are_host_gathered(device):
    src = np.arange(100 * 4, dtype=np.int16).reshape(100, 4)[:, :3]  # rows not back to back
    with pytest.raises(ValueError, match="not contiguous"):
        iter(pinloader.ArrayLoader(src, 5, windows=4, device=device, gather="device"))


@pytest.mark.parametrize("device", BACKENDS)
def test_budget_refuses_what_does_not_fit(device):
    src = np.ones((1000, 256), np.uint8)
    with pytest.raises(ValueError, match=r"max_registered_bytes=4096"):
        iter(pinloader.ArrayLoader(src, 10, device=device, gather="device", max_registered_bytes=4096))
    L = pinloader.ArrayLoader(src, 10, device=device, gather="auto", max_registered_bytes=4096)
    batches(L)
    st = L.stats()
    assert st["gather"] == "host" and st["registered_bytes"] == 0
    if device != "cpu":
        assert "max_registered_bytes=4096" in st["gather_leaves"][0]["reason"]
    L.close()


@pytest.mark.parametrize("device", BACKENDS)
def test_registration_is_shared_counted_once_and_released_by_the_last_user(device):
    b = backend_name(device)
    before = _C._testing.registered_bytes(b)
    src = np.random.default_rng(0).random((4096, 16))
    A = pinloader.ArrayLoader(src, 64, device=device, gather="device", seed=1)
    B = pinloader.ArrayLoader(src[100:3000], 64, device=device, gather="device", seed=2)
    a0 = batches(A)
    b0 = batches(B)
    held = _C._testing.registered_bytes(b) - before
    assert A.stats()["registered_bytes"] == held > 0
    assert held < src.nbytes + 2 * 65536  # one page-rounded range, not two
    A.close()
    assert _C._testing.registered_bytes(b) - before == held  # B still uses it
    for k, x in enumerate(batches(B)):
        np.testing.assert_array_equal(x, expected(src[100:3000], B, 1, k))
    B.close()
    gc.collect()
    assert _C._testing.registered_bytes(b) == before
    for k, x in enumerate(a0):
        np.testing.assert_array_equal(x, expected(src, A, 0, k))
    assert len(b0) == len(B)


@pytest.mark.parametrize("device", BACKENDS)
def test_held_batches_stay_valid_after_later_batches_epochs_and_close(device):
    src = np.random.default_rng(7).integers(0, 255, (999, 3, 8, 8), dtype=np.uint8)
    L = pinloader.ArrayLoader(src, 100, device=device, gather="device", depth=2, seed=3)
    held = list(L)  # the DeviceArrays themselves, all kept
    later = batches(L)  # epoch 1 runs over the same registration
    L.close()
    gc.collect()
    for b, x in enumerate(held):
        np.testing.assert_array_equal(to_numpy(x), expected(src, L, 0, b))
    for b, x in enumerate(later):
        np.testing.assert_array_equal(x, expected(src, L, 1, b))


@pytest.mark.parametrize("device", BACKENDS)
def test_memory_flat_over_epochs(device):
    b = backend_name(device)
    src = np.random.default_rng(0).random((2000, 32)).astype(np.float32)
    L = pinloader.ArrayLoader({"x": src, "y": np.arange(2000)}, 128, device=device, gather="device")
    batches(L)
    reg = _C._testing.registered_bytes(b)
    blocks = _C._testing.live_device_blocks(b)
    for _ in range(5):
        batches(L)
        gc.collect()
        assert _C._testing.registered_bytes(b) == reg
        assert _C._testing.live_device_blocks(b)[0] <= blocks[0] + 4
    L.close()


@pytest.mark.parametrize("device", BACKENDS)
def test_memmap_sources_read_only_and_private(device, tmp_path):
    data = np.random.default_rng(2).random((500, 12)).astype(np.float32)
    path = tmp_path / "d.npy"
    np.save(path, data)
    for mode in ("r", "c"):
        src = np.load(path, mmap_mode=mode)
        L = pinloader.ArrayLoader(src, 64, device=device, gather="device", seed=11)
        for b, x in enumerate(batches(L)):
            np.testing.assert_array_equal(x, expected(data, L, 0, b))
        assert L.stats()["gather"] == "device"
        L.close()
        del src


def test_rowgather_refuses_a_registration_of_another_source():
    a = np.zeros((100_000, 4), np.float32)  # separate mappings: no page in common
    other = np.zeros((100_000, 4), np.float32)
    reg, why = _C.register_rows(a, device="cpu")
    assert why == "" and reg.backend == "host"
    with pytest.raises(ValueError, match="does not lie inside the registered range"):
        _C.RowGather(other, [1, 2], registration=reg)
    with pytest.raises(ValueError, match="items of 16 bytes"):
        _C.RowGather(a.reshape(200_000, 2), [1], registration=reg)
    with pytest.raises(TypeError, match="registration must be"):
        _C.RowGather(a, [1], registration=object())
    reg.close()
    assert reg.closed and reg.nbytes == 0
    with pytest.raises(ValueError, match="closed"):
        _C.RowGather(a, [1], registration=reg)
    reg.close()  # idempotent


@pytest.mark.parametrize("device", BACKENDS)
def test_a_registration_holds_its_source_until_it_is_closed(device):
    # Note [a registration holds its source] in src/py/registration.c: freed memory that stayed
    # registered would be read through the stale mapping by a RowGather over whatever array the
    # allocator puts at the same addresses next.
    src = np.zeros((100_000, 4), np.float32)  # owns its memory: the view below bases on it
    alive = weakref.ref(src)
    reg, why = _C.register_rows(src[10:], device=device)
    assert why == ""
    del src
    gc.collect()
    assert alive() is not None
    rows = _C.RowGather(alive()[10:], [5, 2], registration=reg)
    reg.close()
    assert alive() is not None  # the RowGather's own hold
    del rows
    gc.collect()
    assert alive() is None

    src = np.ones((100_000, 4), np.float32)
    alive = weakref.ref(src)
    reg, why = _C.register_rows(src, device=device)
    del src
    gc.collect()
    assert alive() is not None
    del reg  # dropped without close(): its end lets go too
    gc.collect()
    assert alive() is None


class _Tagged(np.ndarray):
    pass


@pytest.mark.parametrize("device", BACKENDS)
def test_a_registration_in_a_cycle_with_its_source_is_collected_and_unregistered(device):
    b = backend_name(device)
    before = _C._testing.registered_bytes(b)
    src = np.zeros((100_000, 4), np.float32).view(_Tagged)
    src.reg, why = _C.register_rows(src, device=device)  # source -> registration -> source
    assert why == "" and _C._testing.registered_bytes(b) > before
    alive = weakref.ref(src)
    del src
    gc.collect()
    assert alive() is None
    assert _C._testing.registered_bytes(b) == before


def test_register_rows_reasons():
    assert _C.register_rows(np.zeros((0, 4)), device="cpu") == (None, "the source is empty")
    assert "no whole page" in _C.register_rows(np.zeros((10, 4)), device="cpu")[1]
    assert _C.register_rows(np.zeros((5, 0)), device="cpu")[1] == "the source is empty"
    assert "not contiguous" in _C.register_rows(np.zeros((5, 4)).T, device="cpu")[1]
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        _C.register_rows(np.zeros(4), device="cpu", max_bytes=-1)
    with pytest.raises(TypeError):
        _C.register_rows(np.zeros(4), device="cpu", max_bytes=True)


@pytest.mark.parametrize("device", BACKENDS)
def test_duplicate_and_descending_rows_land_in_their_slots(device):
    # sorting the pair table must keep every slot: duplicates, descending runs, one row
    src = np.arange(640 * 5, dtype=np.int64).reshape(640, 5)[1:]  # 639 rows, no row page aligned
    reg, why = _C.register_rows(src, device=device)
    assert why == ""
    # the first and last rows lie in partial pages (staged edges), 5 and 300 inside
    rows = np.array([638, 638, 0, 5, 5, 5, 637, 1, 0, 638, 300] * 20)
    pf = pinloader.AsyncPrefetcher([_C.RowGather(src, rows, registration=reg),
                                    _C.RowGather(src, rows[::-1].copy(), registration=reg),
                                    _C.RowGather(src, [7], registration=reg)], device=device)
    got = [to_numpy(b) for b in pf]
    np.testing.assert_array_equal(got[0], src[rows])
    np.testing.assert_array_equal(got[1], src[rows[::-1]])
    np.testing.assert_array_equal(got[2], src[[7]])
    pf.close()
    reg.close()


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("offset", [0, 1, 100, 4095])
def test_rows_in_the_partial_first_and_last_pages(device, offset):
    # Only whole pages inside the source are registered: the rows at both ends are staged
    # edge items; every alignment of the source against the pages, windows crossing them.
    buf = np.random.default_rng(offset).integers(0, 255, 64 * 1024 + offset + 777, dtype=np.uint8)
    src = buf[offset:offset + 66200].reshape(-1, 100)  # 662 rows of 100 bytes
    reg, why = _C.register_rows(src, device=device)
    assert why == "" and reg.nbytes < src.nbytes
    n = src.shape[0]
    rows = np.array([0, n - 1, 1, n - 2, 40, 0, n - 1, n - 1, 200, 2])
    flat = buf[offset:offset + 66200]
    reg_w, why_w = _C.register_rows(flat, window=300, device=device)
    assert why_w == ""
    starts = np.array([0, len(flat) - 300, 1, 4000, len(flat) - 301, 0])
    pf = pinloader.AsyncPrefetcher([(_C.RowGather(src, rows, registration=reg),
                                     _C.RowGather(flat, starts, window=300, registration=reg_w))],
                                   device=device)
    (a, w), = [(to_numpy(x), to_numpy(y)) for x, y in pf]
    np.testing.assert_array_equal(a, src[rows])
    np.testing.assert_array_equal(w, np.stack([flat[s:s + 300] for s in starts]))
    pf.close()
    reg.close()
    reg_w.close()


@pytest.mark.parametrize("device", BACKENDS)
def test_tables_read_in_place_or_copied_with_host_staged_leaves(device):
    # Note [mapped tables] in src/core/transfer.c: a batch whose array leaves are all
    # device-gathered has its kernel read the pair table and edge items from the pinned region;
    # a batch that also stages a leaf on the host copies them with it. Both, with edge items
    # (rows in the partial pages) and rows sorted (under 256 bytes) and in batch order.
    buf = np.random.default_rng(9).integers(0, 255, 200 * 1024 + 333, dtype=np.uint8)
    small = buf[333:333 + 100 * 700].reshape(700, 100)      # 100-byte rows: the table sorted
    big = buf[333:333 + 400 * 500].reshape(500, 400)        # 400-byte rows: in batch order
    regs = [_C.register_rows(small, device=device), _C.register_rows(big, device=device)]
    assert [why for _, why in regs] == ["", ""]
    rs, rb = np.array([0, 699, 5, 699, 0, 350] * 7), np.array([499, 0, 7, 0, 499, 250] * 7)
    host_leaf = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]  # strided: host-staged
    items = [(_C.RowGather(small, rs, registration=regs[0][0]), _C.RowGather(big, rb, registration=regs[1][0])),
             (_C.RowGather(small, rs, registration=regs[0][0]), host_leaf,
              _C.RowGather(big, rb, registration=regs[1][0]))]
    with pinloader.AsyncPrefetcher(items, device=device) as pf:
        pure, mixed = [[to_numpy(x) for x in b] for b in pf]
    for got in (pure, mixed):
        np.testing.assert_array_equal(got[0], small[rs])
        np.testing.assert_array_equal(got[-1], big[rb])
    np.testing.assert_array_equal(mixed[1], host_leaf)
    for reg, _ in regs:
        reg.close()


@pytest.mark.parametrize("device", BACKENDS)
def test_sharded_drop_last_and_padding(device):
    src = np.arange(1003 * 3, dtype=np.float64).reshape(1003, 3)  # 24 KB: edge rows in most batches
    for world in (1, 3, 4):
        for drop_last in (False, True):
            for rank in range(world):
                L = pinloader.ArrayLoader(src, 37, device=device, gather="device", rank=rank,
                                          world_size=world, drop_last=drop_last, seed=8)
                for b, x in enumerate(batches(L)):
                    np.testing.assert_array_equal(x, expected(src, L, 0, b))
                L.close()


@pytest.mark.gpu
def test_host_registration_is_refused_by_a_cuda_prefetcher():
    a = np.zeros((100_000, 4), np.float32)
    reg, why = _C.register_rows(a, device="cpu")
    assert why == ""
    pf = pinloader.AsyncPrefetcher([_C.RowGather(a, [1, 2], registration=reg)], device="cuda:0")
    with pytest.raises(ValueError, match="registered for the host backend"):
        next(iter(pf))
    pf.close()
    reg.close()


@pytest.mark.gpu
def test_cuda_gather_reads_memory_already_pinned_without_registering_it():
    torch = pytest.importorskip("torch")
    t = torch.arange(1000 * 4, dtype=torch.float32).reshape(1000, 4).pin_memory()
    before = _C._testing.registered_bytes("cuda")
    L = pinloader.ArrayLoader(t, 100, device="cuda:0", gather="device", seed=3)
    got = batches(L)
    assert _C._testing.registered_bytes("cuda") == before  # used as it is
    st = L.stats()
    assert st["gather"] == "device" and st["registered_bytes"] == 0
    src = t.numpy()
    for b, x in enumerate(got):
        np.testing.assert_array_equal(x, expected(src, L, 0, b))
    L.close()


@pytest.mark.gpu
def test_cuda_auto_picks_by_row_size():
    small = np.zeros((100_000, 16), np.float32)  # 64-byte rows: the host gather is faster
    big = np.zeros((20_000, 256), np.float32)    # 1 KiB rows: the device gather
    L = pinloader.ArrayLoader({"s": small[:20_000], "b": big}, 256, device="cuda:0")
    next(iter(L))
    info = {i["leaf"]: i for i in L.stats()["gather_leaves"]}
    assert info["arrays['b']"]["gather"] == "device"
    assert info["arrays['s']"]["gather"] == "host" and "64 bytes" in info["arrays['s']"]["reason"]
    L.close()


@pytest.mark.gpu
def test_cuda_auto_prefers_the_device_gather_and_consumer_streams_wait():
    torch = pytest.importorskip("torch")
    src = np.random.default_rng(5).random((20_000, 128)).astype(np.float32)  # 512-byte rows
    L = pinloader.ArrayLoader(src, 1024, device="cuda:0", seed=6)
    side = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(side):
        for b in L:
            x = torch.from_dlpack(b)  # waits on the side stream, not the default one
            sums.append(x.double().sum())
    torch.cuda.synchronize()
    assert L.stats()["gather"] == "device"
    for b, s in enumerate(sums):
        assert float(s) == pytest.approx(float(expected(src, L, 0, b).astype(np.float64).sum()))
    L.close()


def test_pair_table_meets_its_contract(tmp_path):
    # pl_gather_sort on all its paths, pl_gather_fill_in_order, and pl_gather_stage_edges over
    # sorted and in-order tables (tests/devgather_sort_check.c), compiled with the sanitizers where the compiler has them
    run_c_check(tmp_path, "devgather_sort_check.c", ["devgather.c"])
