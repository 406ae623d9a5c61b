"""ArrayLoader: which rows each batch holds (host backend).

Every row once per epoch, in the documented permutation order (the Python reference in
tests/helpers.py), the same for the same seed and different across epochs and seeds; sequential
order and drop_last; epoch numbering and set_epoch; per-rank shards that are disjoint, equal and
covering (DistributedSampler's order when sequential), computed directly, even for a world size of
2**40; windows (token spans) and their shards.
"""
from __future__ import annotations

import numpy as np
import pytest

import pinloader
from pinloader import _C
from helpers import collect, ids, ref_order, sample, values

DEVICE = "cpu"


# ---- rows and epochs -----------------------------------------------------------------------------

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


# ---- shards --------------------------------------------------------------------------------------

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


def old_order(plan, epoch):
    """The formula ArrayLoader used before: pad the whole epoch to num_samples * world_size,
    then slice the rank's items out of it (memory grew with world_size)."""
    n, L = plan.num_items, plan.window
    spare = 0 if L is None else plan.num_rows - n * L
    phase, order = (_C.permutation(n, plan.seed, epoch, spare) if plan.shuffle
                    else (0, np.arange(n, dtype=np.int64)))
    world = plan.world_size
    if world > 1:
        total = plan.num_samples * world
        if total <= n:
            order = order[:total]
        elif n:
            order = np.resize(order, total)
        order = order[plan.rank::world]
    else:
        order = order[:plan.num_samples]
    return order if L is None else phase + order * L


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("window", [None, 2])
def test_shard_equals_the_padded_formula_on_small_inputs(drop_last, window):
    for n_rows in [0, 1, 2, 3, 5, 7, 12, 13]:
        if window and n_rows < window:
            continue
        for world in [1, 2, 3, 4, 7, 13, 20]:
            for rank in range(world):
                L = pinloader.ArrayLoader(np.zeros((n_rows, 1)) if n_rows else np.zeros((0, 1)), 2,
                                          rank=rank, world_size=world, drop_last=drop_last,
                                          seed=n_rows, windows=window, device=DEVICE)
                for epoch in (0, 3):
                    L._plan.cache = None
                    new = L.indices(epoch)
                    ref = old_order(L._plan, epoch)
                    assert new.tolist() == np.asarray(ref).tolist(), (n_rows, world, rank, epoch)
                L.close()


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.hostile
def test_world_size_of_2_40_gives_a_rank_its_shard(drop_last):
    # before: the epoch was padded to num_samples * world_size items first (a 2**40-item
    # array: an empty MemoryError)
    data = np.arange(10, dtype=np.int64)
    L = pinloader.ArrayLoader(data, 4, rank=2**40 - 3, world_size=2**40, drop_last=drop_last,
                              device=DEVICE, seed=1)
    idx = L.indices(0)
    if drop_last:
        assert len(L) == 0 and idx.tolist() == []
    else:
        perm = _C.permutation(10, 1, 0)[1]
        assert idx.tolist() == [perm[(2**40 - 3) % 10]] and len(L) == 1
        assert [values(b).tolist() for b in L] == [[data[perm[(2**40 - 3) % 10]]]]
    L.close()


def test_drop_last_with_world_size_every_batch_full():
    # 103 rows over 4 ranks: 25 each (the last 3 dropped), batches of 4: 6 full, the 7th dropped
    data = np.arange(103, dtype=np.int64)
    seen = []
    for rank in range(4):
        L = pinloader.ArrayLoader(data, 4, rank=rank, world_size=4, drop_last=True, device=DEVICE)
        assert L.num_samples == 25 and len(L) == 6
        got = [values(b) for b in L]
        assert len(got) == 6 and all(g.shape == (4,) for g in got)
        assert np.concatenate(got).tolist() == L.indices(0)[:24].tolist()
        seen += L.indices(0).tolist()
        L.close()
    assert len(seen) == len(set(seen)) == 100  # disjoint shards, the tail dropped


# ---- windows -------------------------------------------------------------------------------------

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


def test_indices_is_read_only_and_cannot_repoint_the_loaders_order():
    # Note [epoch row tables] in src/py/epoch_table.c: what indices() returns is the loader's order,
    # read-only; re-pointing it (ndarray.__setstate__) leaves the loader's batches unchanged
    data = np.arange(100, dtype=np.int64)
    with pinloader.ArrayLoader(data, 10, seed=3, device=DEVICE) as L:
        idx = L.indices(0)
        want = idx.copy()
        with pytest.raises(ValueError):
            idx[0] = 5
        idx.__setstate__((1, (1,), np.dtype(np.int64), False, b"\0" * 8))
        got = np.concatenate([np.from_dlpack(b).copy() for b in L])
        assert got.tolist() == data[want].tolist()
        assert L.indices(0).tolist() == want.tolist()

