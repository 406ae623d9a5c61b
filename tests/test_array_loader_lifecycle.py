"""ArrayLoader: arguments, len/stats/close, and its one prefetcher (host backend).

Bad arguments are refused at construction naming what is wrong (RowGather's rows too), a bad
device at the first iteration; len(), stats(), close() and the context manager; one prefetcher
serves every epoch; a container constructor that calls next() on the loader from the producer
thread gets a clean error.
"""
from __future__ import annotations

import numpy as np
import pytest

import pinloader
from pinloader import _C
from helpers import collect, describe, ids, run_py

DEVICE = "cpu"


# ---- arguments -----------------------------------------------------------------------------------

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
    (dict(batch_size=np.uint64(2**64 - 1)), ValueError, r"batch_size must be < 2\*\*63, got 18446744073709551615"),
    (dict(world_size=2**63, rank=0), ValueError, r"world_size must be < 2\*\*63"),
    (dict(rank=2, world_size=2), ValueError, "rank must be < world_size"),
    (dict(rank=-1, world_size=2), ValueError, "rank must be >= 0"),
    (dict(world_size=0, rank=0), ValueError, "world_size must be >= 1"),
    (dict(windows=11), ValueError, "windows=11 is longer than the arrays"),
    (dict(windows=0), ValueError, "windows must be >= 1"),
    (dict(arrays=[np.zeros(10), FakeCuda()]), ValueError, r"arrays\[1\]: source is on cuda:0"),
    (dict(arrays=np.float32(3)), TypeError, "arrays: ArrayLoader needs arrays .*got float32"),
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


def test_bad_device_is_reported_where_the_loader_is_made():
    # not at its first iteration (Note [device spellings] in pinloader/_device.py)
    with pytest.raises(ValueError, match="^ArrayLoader: device must be .*; got 'tpu'"):
        pinloader.ArrayLoader(np.zeros(4), 2, device="tpu")


# ---- lifecycle -----------------------------------------------------------------------------------

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


@pytest.mark.hostile
def test_array_loader_container_constructor_calling_next_on_the_loader():
    code = """
    import collections, numpy as np, pinloader
    box = {}
    class Pair(collections.namedtuple("Pair", ["x", "y"])):
        def __new__(cls, x, y):
            # the batch's structure is built where the batch is handed out (the producer makes
            # an ArrayLoader's batches in C: Note [native epochs] in src/py/row_batches.c), so a
            # next() in here is the consumer's own, nested: it takes the following batch
            if isinstance(x, pinloader.DeviceArray) and "L" in box and "seen" not in box:
                box["seen"] = "entered"
                try:
                    box["seen"] = f"returned {type(next(box['L'])).__name__}"
                except Exception as e:
                    box["seen"] = f"{type(e).__name__}: {e}"
            return super().__new__(cls, x, y)
    data = np.arange(40.0).reshape(20, 2)
    L = box["L"] = pinloader.ArrayLoader(Pair(data, data[:, 0]), 5, device="cpu", shuffle=False)
    got = [np.from_dlpack(b.y).copy() for b in L]
    print("BATCHES", len(got), flush=True)
    print("SEEN", box.get("seen"), flush=True)
    L.close()
    """
    p = run_py(code, timeout=60, watchdog=True)
    assert p.returncode == 0, describe(p)
    # nothing hangs; the nested next() took batch 1, the loop the other three
    assert "BATCHES 3" in p.stdout, describe(p)
    assert "SEEN returned Pair" in p.stdout, describe(p)


class _InterruptedOnce:
    """A DLPack source (over a NumPy array) whose next read is interrupted once it is armed:
    a Ctrl-C as an epoch begins."""

    def __init__(self, a):
        self.a, self.armed = a, False

    def __dlpack_device__(self):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return self.a.__dlpack_device__()

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)


@pytest.mark.hostile
def test_ctrl_c_as_an_epoch_begins_leaves_that_epoch_to_run():
    # before: the interrupted epoch counted as begun and finished: the next iteration ran the
    # epoch after it, and state_dict() said so
    a = np.arange(400, dtype=np.int64).reshape(100, 4)
    src = _InterruptedOnce(a)
    L = pinloader.ArrayLoader(src, 10, device="cpu")
    assert len(list(L)) == 10 and L.epoch == 0
    before = L.state_dict()
    src.armed = True
    with pytest.raises(KeyboardInterrupt):
        iter(L)
    assert L.epoch == 0
    assert L.state_dict() == before
    got = [np.from_dlpack(b).copy() for b in L]
    assert L.epoch == 1
    assert np.array_equal(np.concatenate(got), a[L.indices(1)])
    L.close()


@pytest.mark.hostile
def test_close_lets_go_of_the_sources_the_epoch_table_and_the_files(tmp_path):
    # before: a closed loader kept its sources (and so their mappings' descriptors), the
    # epoch's table (8 bytes a row) and a descriptor per mapped file, for as long as it lived
    import gc
    import weakref
    from helpers import count_fds
    p = tmp_path / "d.npy"
    np.save(p, np.arange(40000, dtype=np.int64).reshape(10000, 4))
    fds = count_fds()
    m = np.load(p, mmap_mode="r")
    ref = weakref.ref(m)
    L = pinloader.ArrayLoader({"x": m}, 100, device="cpu")
    next(iter(L))
    assert L.stats()["epoch_source"] == "native"
    state = L.state_dict()
    L.close()
    del m
    gc.collect()
    assert ref() is None
    assert count_fds() == fds
    # what a closed loader still answers
    assert L.state_dict() == state
    assert len(L) == 100 and len(L.indices(0)) == 10000
    with pytest.raises(ValueError, match="closed"):
        iter(L)
