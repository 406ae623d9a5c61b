"""ArrayLoader and RowGather: sampling, sharding, values, windows, memory-mapped sources, errors.

Host-backend tests run everywhere; tests marked ``gpu`` need CUDA (values through torch, CuPy
and JAX, and a 2-process DistributedDataParallel run where two GPUs exist).
"""
from __future__ import annotations

import array
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pinloader
from pinloader import _C
from conftest import CUDA

DEVICE = "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- the Python reference of Note [epoch permutation] (src/py/gather.c) ----

M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def _mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class RefStream:
    def __init__(self, seed, epoch):
        self.s = _mix(seed & M64) ^ _mix((epoch + GAMMA) & M64)

    def next(self):
        self.s = (self.s + GAMMA) & M64
        return _mix(self.s)

    def below(self, n):
        m = self.next() * n
        if (m & M64) < n:
            t = ((1 << 64) - n) % n
            while (m & M64) < t:
                m = self.next() * n
        return m >> 64


def ref_permutation(n, seed, epoch, phase_range=0):
    r = RefStream(seed, epoch)
    phase = r.below(phase_range + 1)
    p = list(range(n))
    for i in range(n - 1, 0, -1):
        j = r.below(i + 1)
        p[i], p[j] = p[j], p[i]
    return phase, p


def ref_order(n_rows, batch_size, seed, epoch, rank=0, world=1, shuffle=True, drop_last=False, window=None):
    """The item order ArrayLoader documents, built from the reference generator."""
    n = n_rows if window is None else n_rows // window
    spare = 0 if window is None else n_rows - n * window
    phase, perm = ref_permutation(n, seed, epoch, spare) if shuffle else (0, list(range(n)))
    per = n // world if drop_last else -(-n // world)
    total = per * world
    if total <= n:
        perm = perm[:total]
    else:
        perm = [perm[i % n] for i in range(total)] if n else []
    mine = perm[rank::world]
    return [phase + i * window for i in mine] if window is not None else mine


def collect(loader):
    return [{k: np.from_dlpack(v).copy() for k, v in b.items()} if isinstance(b, dict)
            else tuple(np.from_dlpack(v).copy() for v in b) if isinstance(b, tuple)
            else np.from_dlpack(b).copy() for b in loader]


# ---- the generator ----

def test_permutation_golden_vector():
    # pins the specification itself: both implementations changing together would pass the
    # agreement test but change every user's sampling order
    phase, p = _C.permutation(10, 0, 0)
    assert phase == 0 and p.tolist() == [6, 2, 4, 1, 8, 0, 9, 5, 3, 7]
    assert _C.permutation(10, 0, 1, phase_range=5)[0] == 2


@pytest.mark.parametrize("n,seed,epoch,phase_range", [
    (0, 0, 0, 0), (1, 5, 0, 0), (2, 1, 1, 0), (17, 0, 0, 3), (1000, 123, 7, 100),
    (257, -1, 3, 0), (100, 2**64 + 5, 2**70, 1), (64, -(2**63), -4, 2**40), (3000, 2**63 - 1, 0, 0),
])
def test_permutation_matches_reference(n, seed, epoch, phase_range):
    phase, p = _C.permutation(n, seed, epoch, phase_range)
    assert p.dtype == np.int64
    assert (phase, p.tolist()) == ref_permutation(n, seed, epoch, phase_range)
    assert sorted(p.tolist()) == list(range(n))
    assert 0 <= phase <= phase_range


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300), st.integers(-(2**70), 2**70), st.integers(-(2**64), 2**64), st.integers(0, 2**62))
def test_permutation_matches_reference_property(n, seed, epoch, phase_range):
    phase, p = _C.permutation(n, seed, epoch, phase_range)
    assert (phase, p.tolist()) == ref_permutation(n, seed, epoch, phase_range)


def test_permutation_bad_args():
    with pytest.raises(ValueError):
        _C.permutation(-1, 0, 0)
    with pytest.raises(TypeError):
        _C.permutation(3, 1.5, 0)
    with pytest.raises(TypeError):
        _C.permutation(3, 0, True)


# ---- sampling through the loader ----

def ids(n):
    return np.arange(n, dtype=np.int64)


@pytest.mark.parametrize("n,bs", [(1000, 64), (64, 64), (65, 64), (5, 10), (1, 1)])
def test_every_row_once_per_epoch_in_permutation_order(n, bs):
    data = np.random.default_rng(0).standard_normal((n, 3)).astype(np.float32)
    with pinloader.ArrayLoader({"id": ids(n), "x": data}, bs, seed=11, device=DEVICE) as L:
        assert len(L) == -(-n // bs)
        for epoch in range(3):
            got = collect(L)
            assert L.epoch == epoch and len(got) == len(L)
            order = np.concatenate([b["id"] for b in got])
            assert order.tolist() == ref_order(n, bs, 11, epoch)
            assert np.array_equal(order, L.indices(epoch))
            assert sorted(order.tolist()) == list(range(n))
            assert np.array_equal(np.concatenate([b["x"] for b in got]), data[order])
            assert all(len(b["id"]) == bs for b in got[:-1])


def test_same_seed_same_order_other_epochs_and_seeds_differ():
    n = 500
    a = pinloader.ArrayLoader(ids(n), 50, seed=7, device=DEVICE)
    b = pinloader.ArrayLoader(ids(n), 50, seed=7, device=DEVICE)
    c = pinloader.ArrayLoader(ids(n), 50, seed=8, device=DEVICE)
    ea = [np.concatenate(collect(a)) for _ in range(3)]
    eb = [np.concatenate(collect(b)) for _ in range(3)]
    for x, y in zip(ea, eb):
        assert np.array_equal(x, y)
    assert not np.array_equal(ea[0], ea[1]) and not np.array_equal(ea[1], ea[2])
    assert not np.array_equal(c.indices(0), a.indices(0))
    for L in (a, b, c):
        L.close()


def test_sequential_and_drop_last():
    n = 103
    with pinloader.ArrayLoader(ids(n), 10, shuffle=False, device=DEVICE) as L:
        assert len(L) == 11
        got = collect(L)
        assert np.array_equal(np.concatenate(got), ids(n)) and len(got[-1]) == 3
    with pinloader.ArrayLoader(ids(n), 10, shuffle=False, drop_last=True, device=DEVICE) as L:
        assert len(L) == 10
        got = collect(L)
        assert np.array_equal(np.concatenate(got), ids(100))
    with pinloader.ArrayLoader(ids(n), 10, drop_last=True, seed=3, device=DEVICE) as L:
        got = np.concatenate(collect(L))
        assert got.tolist() == ref_order(n, 10, 3, 0)[:100]


def test_epoch_numbering_set_epoch_and_early_break():
    n = 200
    L = pinloader.ArrayLoader(ids(n), 20, seed=1, device=DEVICE)
    L.set_epoch(5)  # before the first iteration: honoured
    assert np.array_equal(np.concatenate(collect(L)), L.indices(5)) and L.epoch == 5
    assert np.array_equal(np.concatenate(collect(L)), L.indices(6)) and L.epoch == 6
    # a partial epoch, then the next iteration is the next epoch
    it = iter(L)
    first = np.from_dlpack(next(it)).copy()
    assert np.array_equal(first, L.indices(7)[:20])
    assert np.array_equal(np.concatenate(collect(L)), L.indices(8))
    # an iteration broken off before any batch keeps its epoch...
    iter(L)
    assert L.epoch == 9
    assert np.array_equal(np.concatenate(collect(L)), L.indices(9))
    # ...unless set_epoch asks for another one
    iter(L)
    L.set_epoch(2)
    assert np.array_equal(np.concatenate(collect(L)), L.indices(2))
    # set_epoch to the current epoch mid-way restarts it
    it = iter(L)
    next(it)
    L.set_epoch(L.epoch)
    assert np.array_equal(np.concatenate(collect(L)), L.indices(3))
    L.close()


def test_distributed_sampler_compatible_when_sequential():
    torch_data = pytest.importorskip("torch.utils.data")
    for n, world, drop in [(10, 3, False), (10, 3, True), (9, 3, False), (2, 4, False), (7, 2, True)]:
        for rank in range(world):
            ds = torch_data.DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False,
                                               drop_last=drop)
            L = pinloader.ArrayLoader(ids(n), 4, shuffle=False, rank=rank, world_size=world,
                                      drop_last=drop, device=DEVICE)
            assert L.indices(0).tolist() == list(ds)
            L.close()


@pytest.mark.parametrize("n", [0, 1, 7, 100, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_disjoint_equal_and_covering(n, world, drop_last):
    arr = ids(max(n, 0))
    if n == 0:
        arr = np.zeros((0,), np.int64)
    shards = []
    for rank in range(world):
        L = pinloader.ArrayLoader(arr, 8, seed=4, rank=rank, world_size=world, drop_last=drop_last,
                                  device=DEVICE)
        shards.append(L.indices(2).tolist())
        assert shards[-1] == ref_order(n, 8, 4, 2, rank, world, drop_last=drop_last)
        if rank == world - 1 and n:
            L.set_epoch(2)
            got = np.concatenate(collect(L)) if len(L) else np.zeros(0)
            assert got.tolist() == shards[-1][:len(L) * 8]  # drop_last drops a partial batch too
        L.close()
    sizes = {len(s) for s in shards}
    assert len(sizes) == 1
    flat = [i for s in shards for i in s]
    if drop_last:
        assert len(flat) == len(set(flat)) == (n // world) * world
    else:
        assert set(flat) == set(range(n))
        per = -(-n // world)
        assert len(flat) == per * world and len(flat) - len(set(flat)) == per * world - n


def test_rank_world_defaults_from_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    L = pinloader.ArrayLoader(ids(30), 4, device=DEVICE)
    assert (L.rank, L.world_size) == (2, 3)
    assert L.indices(0).tolist() == ref_order(30, 4, 0, 0, 2, 3)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match="rank must be < world_size"):
        pinloader.ArrayLoader(ids(30), 4, device=DEVICE)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    L = pinloader.ArrayLoader(ids(30), 4, device=DEVICE)
    assert (L.rank, L.world_size) == (0, 1)


# ---- values ----

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.float16, np.float32, np.float64, np.complex64, np.complex128]


def sample(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 250, size=shape)
    if np.dtype(dtype).kind == "c":
        return (v + 1j * rng.integers(0, 250, size=shape)).astype(dtype)
    return v.astype(dtype)


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
                                             ((300000,), 3), ((262144,), 20)], ids=str)
def test_large_batches_multithreaded(threads, row_shape, batch):
    # batches over the stager's inline limit: pieces of whole rows, rows sorted by address
    # within a piece, pieces that split a row (300000 float32 > one 1 MiB piece), chunked copies
    n = 2 * batch + 5
    a = sample((n,) + row_shape, np.float32, 5)
    rev = a[::-1]
    with pinloader.ArrayLoader((ids(n), a, rev), batch, seed=1, device=DEVICE, staging_threads=threads) as L:
        for g in collect(L):
            assert np.array_equal(g[1], a[g[0]]) and np.array_equal(g[2], rev[g[0]])


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


# ---- windows ----

@pytest.mark.parametrize("shape,L", [((10000,), 129), ((1000, 3), 7), ((50,), 50), ((51,), 10)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_windows_equal_source_slices(shape, L, shuffle):
    tok = sample(shape, np.uint16, 7)
    n = shape[0]
    with pinloader.ArrayLoader(tok, 8, windows=L, seed=3, shuffle=shuffle, device=DEVICE) as ld:
        for epoch in range(2):
            starts = ld.indices(epoch)
            assert len(starts) == n // L
            assert starts.tolist() == ref_order(n, 8, 3, epoch, shuffle=shuffle, window=L)
            phase = starts.min()
            assert 0 <= phase <= n - (n // L) * L
            assert sorted(starts.tolist()) == [phase + k * L for k in range(n // L)]  # no overlap
            got = collect(ld)
            out = np.concatenate(got)
            assert out.shape == (n // L, L) + shape[1:]
            assert np.array_equal(out, np.stack([tok[s:s + L] for s in starts]))


def test_windows_sharded():
    tok = ids(1000)
    shards = [pinloader.ArrayLoader(tok, 4, windows=34, rank=r, world_size=3, device=DEVICE).indices(1)
              for r in range(3)]
    starts = sorted(s for sh in shards for s in sh.tolist())
    assert len(starts) == 30 and len(set(starts)) == 29  # 29 windows padded to 30
    assert all(s % 34 == starts[0] % 34 for s in starts)


# ---- memory-mapped sources ----

def test_memmap_sources_and_readahead(tmp_path):
    path = tmp_path / "data.npy"
    a = sample((3000, 5, 7), np.float32, 8)
    np.save(path, a)
    mm = np.load(path, mmap_mode="r")
    raw = np.memmap(tmp_path / "raw.bin", dtype=np.int16, mode="w+", shape=(3000, 9))
    raw[:] = sample((3000, 9), np.int16, 9)
    raw.flush()
    ro = np.memmap(tmp_path / "raw.bin", dtype=np.int16, mode="r", shape=(3000, 9))
    with pinloader.ArrayLoader({"i": ids(3000), "a": mm, "r": ro[:, 1:], "s": mm[:, 2]}, 128, seed=6,
                               device=DEVICE) as L:
        for g in collect(L):
            assert np.array_equal(g["a"], a[g["i"]])
            assert np.array_equal(g["r"], raw[:, 1:][g["i"]])
            assert np.array_equal(g["s"], a[:, 2][g["i"]])
    g = _C.RowGather(mm, [0, 1], readahead=[2999, 5, 6, 1500])
    assert g.advised_bytes >= 3 * 4096
    w = _C.RowGather(ro, [0], window=500, readahead=[0, 2000])
    assert w.advised_bytes >= 2 * 500 * 18
    with pytest.raises(IndexError, match="readahead"):
        _C.RowGather(mm, [0], readahead=[3000])


@pytest.mark.parametrize("readahead", [None, True, False, "auto-large"])
def test_loader_readahead_policy(tmp_path, monkeypatch, readahead):
    import pinloader.array_loader as al
    mm = np.memmap(tmp_path / "r.bin", dtype=np.float64, mode="w+", shape=(4096, 64))
    mm[:] = np.arange(4096)[:, None]
    advised = []
    real = al.RowGather

    def spy(*a, **kw):
        g = real(*a, **kw)
        advised.append(g.advised_bytes)
        return g
    monkeypatch.setattr(al, "RowGather", spy)
    if readahead == "auto-large":  # a mapping larger than the memory available
        monkeypatch.setattr(al, "_mem_available", lambda: 1 << 20)
        readahead = None
    L = pinloader.ArrayLoader((ids(4096), mm, np.zeros(4096)), 100, readahead=readahead, device=DEVICE)
    for i, x, _ in collect(L):
        assert np.array_equal(x[:, 0], i.astype(np.float64))
    L.close()
    advised = advised[3:]  # the constructor's probes
    if readahead is False or (readahead is None and not al._mem_available() == 1 << 20):
        assert not any(advised)
    else:
        # the mapped leaf of every batch but the last is advised (the next batch's rows, the
        # first batch's own too); the in-RAM leaves are not
        assert len(advised) == 3 * len(L)
        assert [bool(a) for a in advised[1::3]] == [True] * (len(L) - 1) + [False]
        assert not any(advised[0::3]) and not any(advised[2::3])
        assert advised[1] >= 2 * 100 * 512


def test_pinned_bytes_stay_under_cap_with_memmap_larger_than_cap(tmp_path):
    cap = 8 << 20
    n, row = 1024, 32 << 10  # a 32 MiB file, 4x the cap
    mm = np.memmap(tmp_path / "big.bin", dtype=np.uint8, mode="w+", shape=(n, row))
    for i in range(0, n, 128):
        mm[i:i + 128] = (np.arange(i, i + 128) % 251)[:, None]
    mm.flush()
    ro = np.memmap(tmp_path / "big.bin", dtype=np.uint8, mode="r", shape=(n, row))
    with pinloader.ArrayLoader((ids(n), ro), 48, seed=1, device=DEVICE, max_pinned_bytes=cap, depth=3) as L:
        seen = 0
        for i, x in L:
            i, x = np.from_dlpack(i), np.from_dlpack(x)
            assert np.array_equal(x[:, ::4096], np.broadcast_to((i % 251)[:, None], (len(i), 8)).astype(np.uint8))
            seen += len(i)
        s = L.stats()
    assert seen == n
    assert s["pinned_bytes_peak"] <= cap and s["pinned_cap"] == cap
    assert s["bytes"] >= n * row


# ---- sources held, closed or resized ----

def test_source_cannot_be_closed_or_resized_while_loading(tmp_path):
    mm = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(100, 4))
    buf = bytearray(100)
    a = np.zeros((100, 2))
    L = pinloader.ArrayLoader((mm, buf, a), 10, device=DEVICE)
    it = iter(L)
    next(it)
    with pytest.raises(BufferError):
        mm._mmap.close()
    with pytest.raises(BufferError):
        buf.extend(b"x")
    with pytest.raises(ValueError):
        a.resize((200, 2))
    assert len(collect(L)) == 10
    L.close()
    buf.extend(b"x")  # released with the loader
    del it


def test_source_resized_under_the_loader_is_a_clear_error():
    torch = pytest.importorskip("torch")
    t = torch.arange(400, dtype=torch.float32).reshape(100, 4)
    L = pinloader.ArrayLoader(t, 10, device=DEVICE, depth=1)
    it = iter(L)
    next(it)
    t.resize_(20, 4)  # torch allows it; the loader notices at the next batch it reads
    with pytest.raises(ValueError, match=r"arrays: the source changed shape from \(100, 4\) to \(20, 4\)"):
        for _ in range(12):
            next(it)
    # not silently empty afterwards: the next iteration reports it again
    with pytest.raises(ValueError, match="changed shape"):
        list(L)
    L.close()


# ---- bad input ----

class FakeCuda:
    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kw):
        raise AssertionError("must not be called")


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(arrays=(np.zeros(5), np.zeros(6))), ValueError, r"same first dimension.*arrays\[0\]: 5.*arrays\[1\]: 6"),
    (dict(arrays={"o": np.array([1, "a"], dtype=object)}), TypeError, r"arrays\['o'\]: .*object"),
    (dict(arrays=np.zeros(4, dtype=[("a", "i4"), ("b", "f4")])), TypeError, r"arrays: .*structured"),
    (dict(arrays=np.zeros(4, dtype="U3")), TypeError, "string"),
    (dict(arrays=np.zeros(4, dtype=">f4")), TypeError, "big-endian"),
    (dict(batch_size=0), ValueError, "batch_size must be >= 1"),
    (dict(batch_size=-3), ValueError, "batch_size must be >= 1"),
    (dict(batch_size=2.0), TypeError, "batch_size must be an int"),
    (dict(rank=2, world_size=2), ValueError, "rank must be < world_size"),
    (dict(rank=-1, world_size=2), ValueError, "rank must be >= 0"),
    (dict(world_size=0, rank=0), ValueError, "world_size must be >= 1"),
    (dict(windows=11), ValueError, "windows=11 is longer than the arrays"),
    (dict(windows=0), ValueError, "windows must be >= 1"),
    (dict(arrays=[np.zeros(10), FakeCuda()]), ValueError, r"arrays\[1\]: source is on cuda:0"),
    (dict(arrays=np.float32(3)), ValueError, "at least one dimension"),
    (dict(arrays=[np.zeros(10), "text"]), TypeError, r"arrays\[1\]: ArrayLoader needs arrays"),
    (dict(arrays=[np.zeros(10), object()]), TypeError, r"arrays\[1\]: ArrayLoader needs arrays .*got object"),
    (dict(arrays={}), ValueError, "no array"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
])
def test_bad_inputs(kwargs, exc, match):
    args = dict(arrays=np.zeros((10, 2)), batch_size=4)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        pinloader.ArrayLoader(args.pop("arrays"), args.pop("batch_size"), device=DEVICE, **args)


def test_rowgather_bad_rows():
    a = np.zeros((10, 3))
    with pytest.raises(IndexError, match=r"rows\[1\] = 10 is out of range for a source of 10 rows"):
        _C.RowGather(a, [0, 10])
    with pytest.raises(IndexError, match=r"rows\[0\] = -1"):
        _C.RowGather(a, [-1])
    with pytest.raises(IndexError, match="out of range"):
        _C.RowGather(a, np.array([2**64 - 1], dtype=np.uint64))
    with pytest.raises(IndexError, match="a window of 4 rows starting there does not fit"):
        _C.RowGather(a, [7], window=4)
    with pytest.raises(TypeError, match="integers"):
        _C.RowGather(a, [1.0])
    with pytest.raises(ValueError, match="1-D"):
        _C.RowGather(a, [[1]])
    with pytest.raises(ValueError, match="longer than the source"):
        _C.RowGather(a, [], window=11)
    with pytest.raises(TypeError, match="window must be an int"):
        _C.RowGather(a, [], window=2.0)
    assert _C.RowGather(a, []).shape == (0, 3)


def test_bad_device_is_reported_at_first_iteration():
    L = pinloader.ArrayLoader(np.zeros(4), 2, device="tpu")
    with pytest.raises((ValueError, TypeError), match="tpu"):
        iter(L)
    L.close()


# ---- lifecycle and the adapters ----

def test_len_stats_close_and_context_manager():
    L = pinloader.ArrayLoader(ids(10), 3, device=DEVICE)
    assert len(L) == 4 and L.stats()["batches_per_epoch"] == 4 and L.stats()["epoch"] is None
    collect(L)
    s = L.stats()
    assert s["batches"] == 4 and s["epoch"] == 0 and s["rank"] == 0 and s["world_size"] == 1
    L.close()
    L.close()
    assert L.closed
    with pytest.raises(ValueError, match="closed"):
        iter(L)
    with pytest.raises(ValueError, match="closed"):
        next(L)
    with pinloader.ArrayLoader(ids(10), 3, device=DEVICE) as L2:
        next(iter(L2))
    assert L2.closed
    assert "ArrayLoader(rows=10" in repr(L2)


def test_one_prefetcher_across_epochs():
    L = pinloader.ArrayLoader(ids(40), 8, device=DEVICE)
    collect(L)
    pf = L._pf
    collect(L)
    collect(L)
    assert L._pf is pf and L.stats()["batches"] == 15
    L.close()


def test_torch_adapter_wraps_the_loader_prefetcher():
    pytest.importorskip("torch")
    import pinloader.torch as pt
    n = 50
    a = sample((n, 3), np.float32)
    L = pinloader.ArrayLoader((ids(n), a), 16, seed=2)
    tp = pt.prefetch(L, device="cpu", depth=3, staging_threads=2)
    assert tp._pf is L and len(tp) == 4
    for epoch in range(2):
        tp.set_epoch(epoch)
        got = list(tp)
        idx = np.concatenate([g[0].numpy() for g in got])
        assert np.array_equal(idx, L.indices(epoch))
        assert np.array_equal(np.concatenate([g[1].numpy() for g in got]), a[idx])
    assert L.stats()["batches"] == 8
    tp.close()
    assert L.closed
    with pytest.raises(ValueError, match="device"):
        pt.prefetch(pinloader.ArrayLoader(ids(n), 4, device="cpu"), device="cuda:1")
    with pytest.raises(ValueError, match="staging_threads"):
        pt.prefetch(pinloader.ArrayLoader(ids(n), 4, staging_threads=1), device="cpu", staging_threads=2)


# ---- examples/ddp_train.py ----

@pytest.mark.slow
def test_ddp_example_matches_plain_indexing_on_cpu():
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "ddp_train.py"), "--cpu", "--epochs", "2", "--rows", "1001"]
    # 1001 rows, 2 ranks: 501 rows each, 8 batches of 64, 2 epochs; both ranks' losses per line
    expected_lines = 2 * 8

    def run(extra):
        p = subprocess.run(cmd + extra, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout.splitlines()

    lines = [run([]), run(["--plain"])]
    assert len(lines[0]) == expected_lines
    assert lines[0] == lines[1]
    assert lines[0][-1].startswith("epoch 1 step 7 losses ") and len(lines[0][-1].split()) == 7


# ---- GPU ----

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


def _two_gpus() -> bool:
    return CUDA and pinloader.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices (torchrun, one GPU per process)")
def test_two_gpu_ddp_example_matches_plain_indexing():
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "ddp_train.py"), "--epochs", "2"]
    outs = []
    for extra in ([], ["--plain"]):
        p = subprocess.run(cmd + extra, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        outs.append(p.stdout.splitlines())
    assert len(outs[0]) > 0 and outs[0] == outs[1]
