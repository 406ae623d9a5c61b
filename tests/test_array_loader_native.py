"""ArrayLoader epochs made in C (Note [native epochs] in src/py/gather.c), on the host backend:
the producer takes the GIL once per epoch, not once per batch; the batches equal the Python
generator's and NumPy indexing; a RowBatches read from Python gives the same RowGathers; an
epoch has one reader; hostile constructor arguments are clear errors.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import pinloader
from pinloader import _C
from pinloader._epoch_plan import _epoch_batches
from helpers import collect, ids

DEVICE = "cpu"


def source(n=1000, fortran=True):
    rng = np.random.default_rng(3)
    w = rng.integers(0, 255, (n, 5), dtype=np.uint8)
    return {"x": rng.standard_normal((n, 6)).astype(np.float32), "i": ids(n),
            "w": np.asfortranarray(w) if fortran else w}


@pytest.mark.parametrize("gather", ["host", "device"])
def test_producer_takes_the_gil_once_per_epoch(gather):
    d = source(4000, fortran=gather == "host")  # the device gather: contiguous rows, whole pages
    with pinloader.ArrayLoader(d, 10, device=DEVICE, gather=gather) as L:
        for epoch in range(3):
            got = collect(L)
            order = L.indices(epoch)
            assert np.array_equal(np.concatenate([g["i"] for g in got]), order)
            assert np.array_equal(np.concatenate([g["x"] for g in got]), d["x"][order])
            assert np.array_equal(np.concatenate([g["w"] for g in got]), d["w"][order])
        st = L.stats()
    assert st["batches"] == 3 * 400
    # one hold per epoch (adopting its RowBatches), not one per batch (before: 1203)
    assert st["producer_gil_holds"] == 3
    assert st["gather"] == gather


def test_native_and_generator_batches_are_equal():
    d = source(777)
    runs = []
    for native in (True, False):
        L = pinloader.ArrayLoader(d, 64, device=DEVICE, seed=5, windows=None)
        L._plan.native = native
        runs.append([collect(L) for _ in range(2)])
        st = L.stats()
        L.close()
        assert (st["producer_gil_holds"] <= 2) == native, st["producer_gil_holds"]
    for a, b in zip(*runs):
        assert len(a) == len(b) == 13
        for x, y in zip(a, b):
            for k in d:
                assert np.array_equal(x[k], y[k]), k


def test_windows_native():
    tokens = np.arange(10_000, dtype=np.int32)
    with pinloader.ArrayLoader(tokens, 8, windows=65, device=DEVICE, seed=2) as L:
        got = np.concatenate(collect(L))
        starts = L.indices(0)
        assert L.stats()["producer_gil_holds"] == 1
    assert np.array_equal(got, tokens[starts[:, None] + np.arange(65)])


def test_row_batches_read_from_python_give_the_same_row_gathers():
    d = source(100)
    L = pinloader.ArrayLoader(d, 30, device=DEVICE, seed=1)
    rb = _epoch_batches(L._plan, 0)
    assert isinstance(rb, _C.RowBatches) and not rb.adopted
    assert rb.__length_hint__() == 4
    batches = list(rb)
    order = L.indices(0)
    assert len(batches) == 4 and rb.__length_hint__() == 0
    for b, item in enumerate(batches):
        assert all(isinstance(g, _C.RowGather) for g in item)
        for g in item:
            assert np.array_equal(g.rows, order[b * 30:(b + 1) * 30])
    with pytest.raises(StopIteration):
        next(rb)
    L.close()


def test_an_epoch_has_one_reader():
    d = source(100)
    L = pinloader.ArrayLoader(d, 30, device=DEVICE, seed=1)
    rb = _epoch_batches(L._plan, 0)
    next(rb)
    # a prefetcher given an epoch already being read refuses it, as the batch's error
    pf = pinloader.AsyncPrefetcher(rb, device=DEVICE, structure=d)
    with pytest.raises(RuntimeError, match="already being read"):
        next(pf)
    pf.close()
    fresh = _epoch_batches(L._plan, 0)
    with pinloader.AsyncPrefetcher(fresh, device=DEVICE, structure=d) as pf:
        assert len([b for b in pf]) == 4
    assert fresh.adopted
    with pytest.raises(RuntimeError, match="already being read"):
        next(fresh)  # the producer's now
    L.close()


@pytest.mark.hostile
def test_row_batches_constructor_refuses_bad_arguments():
    a = np.zeros((10, 3), np.float32)
    probe = _C.RowGather(a, [])
    table = _C._epoch_table(np.arange(10))
    leaf = ("arrays", probe, False, -1, 0, None)
    with pytest.raises(TypeError, match="epoch table"):
        _C.RowBatches([leaf], np.arange(10), 3, 4)
    with pytest.raises(ValueError, match="do not fit"):
        _C.RowBatches([leaf], table, 3, 5)
    with pytest.raises(ValueError, match="do not fit"):
        _C.RowBatches([leaf], table, 0, 1)
    with pytest.raises(ValueError, match="leaves"):
        _C.RowBatches([], table, 3, 4)
    with pytest.raises(TypeError):
        _C.RowBatches([("arrays", a, False, -1, 0, None)], table, 3, 4)  # not a RowGather
    with pytest.raises(TypeError, match="tuple"):
        _C.RowBatches([["arrays", probe, False, -1, 0, None]], table, 3, 4)
    with pytest.raises(ValueError, match="file's name"):
        _C.RowBatches([("arrays", probe, False, 0, 10, None)], table, 3, 4)
    with pytest.raises(OSError):
        _C.RowBatches([("arrays", probe, False, 1 << 30, 10, "f")], table, 3, 4)  # no such descriptor
    # rows outside a leaf's source: checked once, against the table's range
    with pytest.raises(IndexError, match="rows 0 to 10"):
        _C.RowBatches([leaf], _C._epoch_table(np.arange(11)), 3, 4)
    win = _C.RowGather(a, [], window=4)
    with pytest.raises(IndexError, match="7 items"):
        _C.RowBatches([("arrays", win, False, -1, 0, None)], table, 3, 4)
    ok = _C.RowBatches([leaf], table, 3, 3)  # drop_last: 3 batches of 3, one row left
    assert [len(g[0].rows) for g in ok] == [3, 3, 3]


def test_file_cut_after_the_epoch_began_is_reported_by_the_native_check(tmp_path):
    # the RowBatches checks on its own descriptor: closing the caller's changes nothing
    path = tmp_path / "m.bin"
    mm = np.memmap(path, dtype=np.int32, mode="w+", shape=(1000, 64))
    mm[:] = np.arange(1000, dtype=np.int32)[:, None]
    mm.flush()
    L = pinloader.ArrayLoader({"x": mm}, 100, device=DEVICE, shuffle=False)
    rb = _epoch_batches(L._plan, 0)
    assert next(rb)[0].rows[0] == 0
    os.truncate(path, 100)  # before the next batch's rows are read: none of them are touched
    with pytest.raises(ValueError, match=r"^arrays\['x'\]: the memory-mapped file .*m.bin was truncated on disk "
                                         r"while loading: it is now 100 bytes, the mapping needs 256000"):
        next(rb)
    del rb
    L.close()


def test_deleted_mapped_file_falls_back_to_the_generator(tmp_path):
    # a mapping whose file was unlinked has no name to open: the generator checks it instead
    path = tmp_path / "gone.bin"
    mm = np.memmap(path, dtype=np.int32, mode="w+", shape=(500, 8))
    mm[:] = np.arange(500, dtype=np.int32)[:, None]
    mm.flush()
    os.unlink(path)
    with pinloader.ArrayLoader({"x": mm}, 50, device=DEVICE, seed=4) as L:
        assert not isinstance(_epoch_batches(L._plan, 0), _C.RowBatches)
        got = np.concatenate([g["x"] for g in collect(L)])
        assert np.array_equal(got[:, 0], L.indices(0))
        assert L.stats()["producer_gil_holds"] == 11  # the generator: once per batch, and the end
