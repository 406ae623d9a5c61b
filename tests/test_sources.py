"""The producer's source interface (Note [sources] in src/py/source.h), on the host backend: the
producer picks how to read an epoch's iterator by its type alone -- a RowBatches is read as a
native source when the prefetcher has a structure to place its leaves in, and as a plain Python
iterable otherwise -- and an epoch may switch between the two kinds, each batch equal to NumPy
indexing, the retired native source released, its reader's state freed.
"""
from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

import pinloader
from pinloader import _C
from pinloader._epoch_plan import epoch_batches

DEVICE = "cpu"


def host(leaf):
    return np.from_dlpack(leaf).copy()


def loader(n=100, bs=30):
    d = {"x": np.arange(n * 3, dtype=np.float32).reshape(n, 3), "i": np.arange(n, dtype=np.int64)}
    return d, pinloader.ArrayLoader(d, bs, device=DEVICE, seed=4)


def test_row_batches_without_a_structure_are_a_python_iterable():
    d, L = loader()
    rb = epoch_batches(L._plan, 0)
    with pinloader.AsyncPrefetcher(rb, device=DEVICE) as pf:
        got = [tuple(host(x) for x in b) for b in pf]
        holds = pf.stats()["producer_gil_holds"]
    assert not rb.adopted  # read with next() from Python, not opened natively
    assert holds >= len(got) == 4  # one GIL round per batch
    order = L.indices(0)
    for b, (gx, gi) in enumerate(got):  # a tuple of RowGathers, copied as leaves
        assert np.array_equal(gi, order[b * 30:(b + 1) * 30])
        assert np.array_equal(gx, d["x"][order[b * 30:(b + 1) * 30]])
    L.close()


def test_row_batches_with_a_structure_are_read_natively():
    d, L = loader()
    rb = epoch_batches(L._plan, 0)
    with pinloader.AsyncPrefetcher(rb, device=DEVICE, structure=d) as pf:
        got = [{k: host(v) for k, v in b.items()} for b in pf]
        holds = pf.stats()["producer_gil_holds"]
    assert rb.adopted and len(got) == 4
    assert holds == 1  # opened once with the GIL; every batch made without it
    order = L.indices(0)
    assert np.array_equal(np.concatenate([b["i"] for b in got]), order)
    assert np.array_equal(np.concatenate([b["x"] for b in got]), d["x"][order])
    L.close()


def test_a_native_source_with_other_leaves_than_the_structure_is_refused():
    d, L = loader()
    rb = epoch_batches(L._plan, 0)
    pf = pinloader.AsyncPrefetcher(rb, device=DEVICE, structure={"x": d["x"], "i": d["i"], "y": d["i"]})
    with pytest.raises(TypeError, match="the source's batches have 2 leaves, the structure 3"):
        next(pf)
    pf.close()
    L.close()


class Alternating:
    """Epoch e: the loader's RowBatches for e when e is even, else a generator of leaf tuples
    giving the same batches from Python (a structure-mode item is a tuple of its leaves)."""

    def __init__(self, L, d):
        self.L, self.d, self.epoch = L, d, 0
        self.sources: list = []

    def __iter__(self):
        e = self.epoch
        self.epoch += 1
        if e % 2 == 0:
            rb = epoch_batches(self.L._plan, e)
            self.sources.append(rb)
            return rb
        order = self.L.indices(e)
        leaves, _ = _C.leaves(self.d, "batch")  # (path, leaf) in the structure's walk order
        return (tuple(leaf[order[s:s + 30]] for _, leaf in leaves) for s in range(0, 100, 30))


def test_epochs_switch_between_a_native_source_and_a_python_iterable():
    d, L = loader()
    src = Alternating(L, d)
    with pinloader.AsyncPrefetcher(src, device=DEVICE, structure=d) as pf:
        for e in range(5):
            got = [{k: host(v) for k, v in b.items()} for b in pf]
            assert [len(b["i"]) for b in got] == [30, 30, 30, 10], e
            order = L.indices(e)
            assert np.array_equal(np.concatenate([b["i"] for b in got]), order), e
            assert np.array_equal(np.concatenate([b["x"] for b in got]), d["x"][order]), e
        holds = pf.stats()["producer_gil_holds"]
    # the native epochs (0, 2, 4) took the GIL once each, the Python ones once per batch and at
    # their ends
    assert holds <= 3 + 2 * 5
    gc.collect()
    # every native source was opened, then retired and released once its batches were copied:
    # the list here holds the last reference (getrefcount counts its own argument too)
    assert len(src.sources) == 3 and all(rb.adopted for rb in src.sources)
    assert [sys.getrefcount(src.sources[k]) for k in range(3)] == [2, 2, 2]
    L.close()


@pytest.mark.hostile
def test_a_type_error_raised_by_the_sources_own_iter_is_its_own():
    class Broken:
        def __iter__(self):
            raise TypeError("the dataset's shard list is not ready")

    with pytest.raises(TypeError, match="shard list is not ready"):
        pinloader.AsyncPrefetcher(Broken(), device=DEVICE)
    with pytest.raises(TypeError, match="needs an iterable source, got int"):
        pinloader.AsyncPrefetcher(3, device=DEVICE)
    # a sequence without __iter__ is iterable by __getitem__, as iter() allows
    class Seq:
        def __getitem__(self, i):
            if i >= 2:
                raise IndexError(i)
            return np.full(3, i, np.int32)

    with pinloader.AsyncPrefetcher(Seq(), device=DEVICE) as pf:
        assert [host(b).tolist() for b in pf] == [[0, 0, 0], [1, 1, 1]]


@pytest.mark.parametrize("end", ["close", "drop"])
def test_a_native_source_left_mid_epoch_is_released(end):
    # the producer holds the opened RowBatches (and its reader's state) between batches; closing
    # the prefetcher, or dropping it unclosed, mid-epoch releases it
    d, L = loader(1000, 10)
    rb = epoch_batches(L._plan, 0)
    pf = pinloader.AsyncPrefetcher(rb, device=DEVICE, structure=d, depth=2)
    first = next(pf)
    assert rb.adopted and np.array_equal(host(first["i"]), L.indices(0)[:10])
    if end == "close":
        pf.close()
    del pf, first
    gc.collect()
    assert sys.getrefcount(rb) == 2  # the name here and getrefcount's argument
    L.close()


class _NoneIter:
    __iter__ = None  # declared not iterable, though it has __getitem__

    def __getitem__(self, i):
        raise IndexError(i)


class _NonIterator:
    def __iter__(self):
        return [np.zeros(2)]  # a list, not an iterator


class _Meta(type):
    def __iter__(cls):
        return iter([np.zeros(2, np.float32)])


class _ByMeta(metaclass=_Meta):
    pass


@pytest.mark.hostile
@pytest.mark.parametrize("source, refused", [
    (3, "needs an iterable source, got int"),
    (None, "needs an iterable source, got NoneType"),
    (_ByMeta(), "needs an iterable source, got _ByMeta"),  # the metaclass's __iter__ is the class's
    (_NoneIter(), "'_NoneIter' object is not iterable"),
    (_NonIterator(), "iter\\(\\) returned non-iterator of type 'list'"),
    (_ByMeta, None),
    ({"a": 1}, None),
    (b"ab", None),
])
def test_the_first_iterator_is_what_iter_gives_or_refuses(source, refused):
    # AsyncPrefetcher accepts exactly what iter() accepts, and every refusal is a TypeError
    # naming the source's type (its own __iter__'s TypeError as it raised it)
    try:
        iter(source)
        iter_ok = True
    except TypeError:
        iter_ok = False
    assert iter_ok == (refused is None)
    if refused is None:
        pinloader.AsyncPrefetcher(source, device=DEVICE).close()
    else:
        with pytest.raises(TypeError, match=refused):
            pinloader.AsyncPrefetcher(source, device=DEVICE)
