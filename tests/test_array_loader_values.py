"""ArrayLoader and RowGather: batch values equal NumPy indexing (host backend).

Every dtype and row shape, strided and broadcast sources, batches over the stager's inline limit
with 1 to 4 threads, duplicate rows and RowGather used directly (windows included, and as a
property), nested containers, buffer-protocol and DLPack (torch) sources, strided buffer
exporters.
"""
from __future__ import annotations

import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pinloader
from pinloader import _C
from helpers import collect, drain, ids, sample, values

DEVICE = "cpu"

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.float16, np.float32, np.float64, np.complex64, np.complex128]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("row", [(), (3,), (2, 3, 4), (1, 5)], ids=str)
def test_values_equal_fancy_indexing(dtype, row):
    n = 97
    a = sample((n,) + row, dtype)
    with pinloader.ArrayLoader((ids(n), a), 16, seed=2, device=DEVICE) as L:
        got = collect(L)
        order = np.concatenate([g[0] for g in got])
        out = np.concatenate([g[1] for g in got])
        assert out.dtype == a.dtype and out.shape == (n,) + row
        assert np.array_equal(out, a[order])


STRIDED = {
    "every_other_row": lambda a: a[::2],
    "reversed_rows": lambda a: a[::-1],
    "reversed_inner": lambda a: a[:, ::-1],
    "column_slice": lambda a: a[:, 1:5:2],
    "fortran": lambda a: np.asfortranarray(a),
    "transposed_3d": lambda a: a.reshape(a.shape[0], 4, -1).transpose(0, 2, 1),
    "broadcast_row": lambda a: np.broadcast_to(a[:, :1], a.shape),
}


@pytest.mark.parametrize("how", STRIDED, ids=str)
def test_strided_sources(how):
    base = sample((400, 12), np.float32, 3)
    a = STRIDED[how](base)
    assert not a.flags.c_contiguous or how == "every_other_row"
    with pinloader.ArrayLoader({"i": ids(len(a)), "a": a}, 37, seed=9, device=DEVICE) as L:
        got = collect(L)
        order = np.concatenate([g["i"] for g in got])
        assert np.array_equal(np.concatenate([g["a"] for g in got]), a[order])


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("row_shape,batch", [((3000,), 300), ((200, 11), 256), ((7,), 40000),
                                             ((16,), 20000), ((128,), 4096),
                                             ((300000,), 3), ((262144,), 20)], ids=str)
def test_large_batches_multithreaded(threads, row_shape, batch):
    # batches over the stager's inline limit: pieces of whole rows, rows sorted by address
    # within a piece, pieces that split a row (300000 float32 > one 1 MiB piece), chunked copies;
    # 64- and 512-byte rows: the loops that prefetch rows ahead (Note [row gather])
    n = 2 * batch + 5
    a = sample((n,) + row_shape, np.float32, 5)
    rev = a[::-1]
    with pinloader.ArrayLoader((ids(n), a, rev), batch, seed=1, device=DEVICE, staging_threads=threads) as L:
        for g in collect(L):
            assert np.array_equal(g[1], a[g[0]]) and np.array_equal(g[2], rev[g[0]])


def test_row_prefetch_on_and_off_side_by_side(monkeypatch):
    # PINLOADER_ROW_PREFETCH is read when a loader's stager is made, for that stager (Note [row
    # gather] in src/core/stager.c): a loader made with it off and one made with it on run at
    # once, each over rows that start anywhere in a cache line (24 and 72 bytes: rows inside one
    # line and rows across two)
    n = 5000
    a24 = sample((n, 6), np.float32, 6)
    a72 = sample((n, 18), np.float32, 7)
    got = {}
    with pinloader.ArrayLoader((ids(n), a24, a72), 4096, seed=3, device=DEVICE) as off, \
            pinloader.ArrayLoader((ids(n), a24, a72), 4096, seed=3, device=DEVICE) as on:
        monkeypatch.setenv("PINLOADER_ROW_PREFETCH", "0")
        its = {"off": iter(off)}  # the stager is made when the first epoch begins
        monkeypatch.setenv("PINLOADER_ROW_PREFETCH", "1")
        its["on"] = iter(on)
        for _ in range(len(off)):  # the two interleaved, batch by batch
            for k, it in its.items():
                b = [np.from_dlpack(x).copy() for x in next(it)]
                got.setdefault(k, []).append(b)
                assert np.array_equal(b[1], a24[b[0]]) and np.array_equal(b[2], a72[b[0]])
    assert len(got["on"]) == len(got["off"]) == 2
    for g, h in zip(got["off"], got["on"]):
        assert np.array_equal(g[0], h[0])


def test_duplicate_rows_and_rowgather_direct():
    a = sample((50, 4, 3), np.int32)
    rows = np.array([3, 3, 49, 0, 3, 10], dtype=np.uint8)
    g = _C.RowGather(a, rows)
    rows[:] = 200  # the RowGather has its own copy
    assert g.shape == (6, 4, 3) and g.source_shape == (50, 4, 3) and g.nbytes == 6 * 48
    assert g.rows.tolist() == [3, 3, 49, 0, 3, 10] and g.window is None
    w = _C.RowGather(a, [0, 45], window=5)
    assert w.shape == (2, 5, 4, 3) and w.window == 5
    with pinloader.AsyncPrefetcher([(g, w, "meta")], device=DEVICE) as pf:
        (x, y, meta), = list(pf)
        assert meta == "meta"
        assert np.array_equal(np.from_dlpack(x), a[[3, 3, 49, 0, 3, 10]])
        assert np.array_equal(np.from_dlpack(y), np.stack([a[0:5], a[45:50]]))
    assert "RowGather" in repr(g)


def test_epoch_tables_are_read_only_and_read_in_place_by_rowgathers():
    # Note [epoch row tables] in src/py/epoch_table.c
    import sys

    a = sample((1000, 5), np.float32, 8)
    order = _C.epoch_table(np.random.default_rng(2).permutation(1000))
    assert order.dtype == np.int64 and not order.flags.writeable
    for arr in (order, order[10:20], order[::2], order.view(np.uint64)):
        with pytest.raises(ValueError):
            arr.flags.writeable = True  # nothing can make the table writable again
        with pytest.raises(ValueError):
            arr[0] = 1
    assert not _C.permutation(10, 1, 2)[1].flags.writeable
    part = order[100:356]
    capsule = part.base.base  # the slice's base is the table array, whose base owns the memory
    before = sys.getrefcount(capsule)
    g = _C.RowGather(a, part)
    assert sys.getrefcount(capsule) == before + 1  # borrowed in place, not copied
    expect = order[100:356].copy()
    # re-pointing the arrays (public NumPy API) drops their bases: the RowGather's own
    # reference keeps the table's memory alive
    part.__setstate__((1, (1,), np.dtype(np.int64), False, b"\0" * 8))
    order.__setstate__((1, (1,), np.dtype(np.int64), False, b"\0" * 8))
    del part, order, capsule
    junk = [np.full(260, 1 << 40, np.int64) for _ in range(100)]  # would reuse freed memory
    del junk
    plain = np.array(expect)
    before = sys.getrefcount(plain)
    assert plain.base is None
    h = _C.RowGather(a, plain)
    assert sys.getrefcount(plain) == before  # any other array is copied
    plain[:] = 0
    for x in (g, h):
        assert np.array_equal(x.rows, expect)
        with pinloader.AsyncPrefetcher([(x,)], device=DEVICE) as pf:
            (y,), = list(pf)
            assert np.array_equal(np.from_dlpack(y), a[expect])
    # a table whose entries do not all fit the source: each row checked, the first bad one named
    wide = _C.epoch_table(np.r_[np.arange(10), 5000])
    assert np.array_equal(_C.RowGather(a, wide[:10]).rows, np.arange(10))
    with pytest.raises(IndexError, match=r"rows\[10\] = 5000 is out of range for a source of 1000 rows"):
        _C.RowGather(a, wide)
    # a strided view of a table is copied (only contiguous slices are read in place)
    s = _C.epoch_table(np.arange(64))[::3]
    assert np.array_equal(_C.RowGather(a, s).rows, np.arange(0, 64, 3))
    # windows: each window checked to fit, by the table's largest entry
    assert _C.RowGather(a, _C.epoch_table([0, 990]), window=10).shape == (2, 10, 5)
    with pytest.raises(IndexError, match="a window of 10 rows"):
        _C.RowGather(a, _C.epoch_table([0, 991]), window=10)
    with pytest.raises(ValueError, match="1-D"):
        _C.epoch_table(np.zeros((2, 2), np.int64))
    for lossy in (np.array([0.5, 1.0]), np.array([2**63], np.uint64)):  # never truncated
        with pytest.raises(TypeError):
            _C.epoch_table(lossy)
    assert _C.epoch_table(np.array([3, 1], np.int32)).tolist() == [3, 1]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_rowgather_property(data):
    nd = data.draw(st.integers(1, 4))
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=nd, max_size=nd)))
    base = np.arange(int(np.prod(shape)) * 4, dtype=np.int16).reshape((shape[0] * 2,) + shape[1:] + (2,))
    steps = [data.draw(st.sampled_from([1, 2, -1]))] + [data.draw(st.sampled_from([1, -1, 2])) for _ in shape[1:]]
    a = base[tuple(slice(None, None, s) for s in steps)][..., 0]
    n = a.shape[0]
    window = data.draw(st.one_of(st.none(), st.integers(1, n)))
    span = window or 1
    rows = data.draw(st.lists(st.integers(0, n - span), max_size=12))
    g = _C.RowGather(a, np.array(rows, dtype=np.int64), window=window)
    with pinloader.AsyncPrefetcher([g], device=DEVICE) as pf:
        out = np.from_dlpack(next(pf))
    want = (np.stack([a[r:r + window] for r in rows]) if rows else np.zeros((0, window) + a.shape[1:], a.dtype)) \
        if window else a[np.array(rows, dtype=np.int64)]
    assert out.shape == want.shape and np.array_equal(out, want)


def test_nested_structures():
    from collections import OrderedDict, defaultdict, namedtuple
    P = namedtuple("P", "a b")
    n = 30
    x, y, z = sample((n, 2), np.float32), sample((n,), np.int64, 1), sample((n, 3), np.uint8, 2)
    dd = defaultdict(list, w=y)
    arrays = {"p": P(x, [y, z]), "o": OrderedDict(z=z), "t": (ids(n),), "d": dd}
    with pinloader.ArrayLoader(arrays, 8, seed=5, device=DEVICE) as L:
        for b in L:
            assert isinstance(b["p"], P) and isinstance(b["p"].b, list) and isinstance(b["o"], OrderedDict)
            idx = np.from_dlpack(b["t"][0])
            assert np.array_equal(np.from_dlpack(b["p"].a), x[idx])
            assert np.array_equal(np.from_dlpack(b["p"].b[1]), z[idx])
            assert np.array_equal(np.from_dlpack(b["o"]["z"]), z[idx])
            assert isinstance(b["d"], defaultdict) and b["d"].default_factory is list
            assert np.array_equal(np.from_dlpack(b["d"]["w"]), y[idx])


def test_buffer_protocol_and_dlpack_sources():
    torch = pytest.importorskip("torch")
    n = 64
    buf = bytearray(range(n))
    arr = array.array("d", [float(i) for i in range(n)])
    t = torch.arange(n * 3, dtype=torch.int32).reshape(n, 3)
    tt = t.t().contiguous().t()  # strided torch tensor
    with pinloader.ArrayLoader((ids(n), buf, arr, t, tt), 10, seed=1, device=DEVICE) as L:
        for i, b, f, x, xt in collect(L):
            assert np.array_equal(b, np.frombuffer(bytes(buf), np.uint8)[i])
            assert np.array_equal(f, np.asarray(arr)[i])
            assert np.array_equal(x, t.numpy()[i]) and np.array_equal(xt, t.numpy()[i])


def test_strided_buffer_exporters_are_still_read():
    # an exporter that refuses only a contiguous export is read through its strides
    a = np.arange(20, dtype=np.int32)
    mv = memoryview(a)[::2]
    g = _C.RowGather(mv, [0, 3])
    assert g.source_shape == (10,)
    with pinloader.AsyncPrefetcher([(mv,)], device=DEVICE) as pf:
        (b,) = drain(pf)
    np.testing.assert_array_equal(values(b[0]), a[::2])
