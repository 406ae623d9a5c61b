"""Fuzz target: hostile items through AsyncPrefetcher never crash, and never lie.

Hypothesis builds random nested items (tuples, lists, dicts, namedtuples, dataclasses) whose
leaves are

* numpy arrays of every supported dtype (and unsupported ones: object, string, structured,
  datetime, big-endian), of random shapes (size 0 and 0-dim included), seen through random
  slices, transposes and ``as_strided`` views with negative, zero and overlapping strides;
* ``np.broadcast_to`` views of one real element to huge shapes (2**40 elements, 2**63 - 256
  bytes), which must be refused, and to shapes that fit, which must be copied;
* views of PinnedBuffers of 64 KiB and more (the direct-copy path);
* DLPack exporters whose ``__dlpack__`` returns a capsule built here byte by byte with ctypes
  (legacy ``DLManagedTensor`` or ``DLManagedTensorVersioned``): well-formed ones of every DLPack
  dtype with C-contiguous, NULL, negative, zero and overlapping strides, byte offsets and device
  type 1 or 3, and hostile ones: negative shapes, huge shapes, a shape or stride product or a
  byte offset that overflows 64 bits, bad dtype code/bits/lanes, ndim negative or over the
  limit, NULL data with elements, a versioned capsule of another major version, a capsule of
  another name, a non-capsule, an exporter that raises (with a lone surrogate in its message)
  and a ``__dlpack_device__`` that returns nonsense;
* plain Python values that pass through untouched.

The strategies and the checks live in tests/fuzz_strategies.py.

Each example runs in this process (a crash is a failure of the job; CI runs this module under
the AddressSanitizer build). For every item the prefetcher must either deliver it exactly (same
structure, same shapes, every byte equal to the source, non-array leaves the very same objects)
or, if the item holds a leaf that cannot be copied, raise TypeError, ValueError, OverflowError,
BufferError or PoolExhausted with a message that starts with the item's leaf path (``item...``).
An item whose leaves are all well-formed must never be refused.

The number of examples comes from ``PINLOADER_FUZZ_EXAMPLES`` (150 by default); the count of
items tried is printed in the terminal summary (tests/conftest.py reads TRIED and TRIED_LOADER).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pinloader
from fuzz_strategies import CAP, build_tree, check, count_leaves, loader_sources, make_source, tree_specs
from helpers import run_py

pytestmark = pytest.mark.fuzz

DEVICE = "cpu"

EXAMPLES = int(os.environ.get("PINLOADER_FUZZ_EXAMPLES", "150"))
ALLOWED = (TypeError, ValueError, OverflowError, BufferError, pinloader.PoolExhausted)
LOG = os.environ.get("PINLOADER_FUZZ_LOG")  # where to write each example before it runs

# Read by tests/conftest.py for the terminal summary.
TRIED = {"examples": 0, "items": 0, "leaves": 0, "refused": 0, "delivered": 0}


# ---- the prefetcher ------------------------------------------------------------------------------

_SOURCE_POOL = []


def source_pool():
    """One PinnedPool for the PinnedBuffer-backed leaves of all examples (made once: slabs are
    slow to make); a source leaf's buffer goes back when its example's items are dropped."""
    if not _SOURCE_POOL:
        _SOURCE_POOL.append(pinloader.PinnedPool(max_bytes=64 << 20, device=DEVICE))
    return _SOURCE_POOL[0]


def _identity(leaf):
    return leaf


FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)


@FUZZ_SETTINGS
@given(specs=st.lists(tree_specs(), min_size=1, max_size=3), depth=st.integers(1, 3),
       handout=st.booleans())
def test_hostile_items_are_refused_cleanly_or_delivered_exactly(specs, depth, handout):
    # handout: the structure is kept from the producer's walk and built when the batch is
    # handed out (Note [handout] in src/py/handout.h), through an identity convert
    if LOG:
        with open(LOG, "w") as f:
            f.write(repr((specs, depth, handout)) + "\n")
            f.flush()
            os.fsync(f.fileno())
    TRIED["examples"] += 1
    pool = source_pool()
    items, expected, bads = [], [], []
    for spec in specs:
        bad = []
        obj, exp = build_tree(spec, pool, bad)
        items.append(obj)
        expected.append(exp)
        bads.append(bad)
    pf = pinloader.AsyncPrefetcher(items, device=DEVICE, depth=depth, max_pinned_bytes=CAP,
                                   convert=_identity if handout else None)
    try:
        for i, (obj, exp, bad) in enumerate(zip(items, expected, bads)):
            TRIED["items"] += 1
            TRIED["leaves"] += count_leaves(exp)
            try:
                got = next(pf)
            except ALLOWED as e:
                msg = str(e)
                assert msg.startswith("item"), f"item {i}: message does not name the leaf: {msg!r}"
                if not bad:
                    # Only a legal leaf too big for the cap may be refused in a clean item.
                    assert isinstance(e, pinloader.PoolExhausted), (
                        f"item {i} holds only well-formed leaves but was refused: {e!r}")
                TRIED["refused"] += 1
                break
            assert not bad, f"item {i} holds leaves that must be refused, but was delivered: {bad!r}"
            check(obj, exp, got, "item")
            TRIED["delivered"] += 1
            del got
    finally:
        pf.close()


# ---- ArrayLoader and RowGather -------------------------------------------------------------------

TRIED_LOADER = {"examples": 0, "batches": 0, "refused": 0}


@FUZZ_SETTINGS
@given(src=loader_sources(), batch_size=st.integers(1, 8), windows=st.one_of(st.none(), st.integers(1, 4)),
       world=st.integers(1, 4), rank_frac=st.floats(0, 0.999), drop_last=st.booleans(),
       shuffle=st.booleans(), seed=st.integers(-(2**64), 2**64), truncate=st.booleans(),
       epochs=st.integers(1, 2))
def test_array_loader_batches_equal_numpy_indexing_or_clean_errors(
        src, batch_size, windows, world, rank_frac, drop_last, shuffle, seed, truncate, epochs, tmp_path_factory):
    if LOG:
        with open(LOG, "w") as f:
            f.write(repr(("array_loader", src, batch_size, windows, world, rank_frac, drop_last,
                          shuffle, seed, truncate, epochs)) + "\n")
            f.flush()
            os.fsync(f.fileno())
    TRIED_LOADER["examples"] += 1
    n_rows, specs = src
    tmp = str(tmp_path_factory.mktemp("fuzz"))
    made = [make_source(n_rows, np.dtype(d), row, layout, tmp, k) for k, (d, row, layout) in enumerate(specs)]
    arrays = {f"leaf{k}": a for k, (a, _) in enumerate(made)}
    rank = int(rank_frac * world)
    try:
        L = pinloader.ArrayLoader(arrays, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                  device=DEVICE, rank=rank, world_size=world, windows=windows,
                                  max_pinned_bytes=CAP)
    except ALLOWED as e:
        # only a window longer than the arrays is refused here
        assert windows is not None and windows > n_rows and "windows=" in str(e), repr(e)
        TRIED_LOADER["refused"] += 1
        return
    cut = [p for _, p in made if p] if truncate else []
    for p in cut:
        os.truncate(p, os.path.getsize(p) // 2)
    # the NumPy copy of each source, read before any truncation could matter
    plain = {k: np.array(np.asarray(v) if not cut else v[: 0]) for k, v in arrays.items()}
    try:
        for epoch in range(epochs):
            order = L.indices(epoch)
            got = []
            try:
                for b in L:
                    got.append({k: np.from_dlpack(v).copy() for k, v in b.items()})
            except ALLOWED as e:
                assert cut, f"a clean source was refused: {e!r}"
                assert str(e).startswith("arrays['leaf"), f"the error does not name the leaf: {e!r}"
                assert "truncated on disk" in str(e), repr(e)
                TRIED_LOADER["refused"] += 1
                return
            assert len(got) == len(L)
            if cut:
                assert len(L) == 0, "batches were read from a truncated file without an error"
                continue
            for bi, batch in enumerate(got):
                rows = order[bi * batch_size:(bi + 1) * batch_size]
                if drop_last:
                    assert len(rows) == batch_size
                for k, v in plain.items():
                    exp = v[rows] if windows is None else np.stack([v[r:r + windows] for r in rows]) \
                        if len(rows) else np.empty((0, windows) + v.shape[1:], v.dtype)
                    assert batch[k].shape == exp.shape, (k, batch[k].shape, exp.shape)
                    assert batch[k].tobytes() == np.ascontiguousarray(exp).tobytes(), (k, bi)
                TRIED_LOADER["batches"] += 1
    finally:
        L.close()


MUTATION_CHILD = r"""
import faulthandler, os, sys, threading
import numpy as np, pinloader
faulthandler.enable()
trials = int(sys.argv[1])
rng = np.random.default_rng(int(sys.argv[2]))
stats = {"trials": 0, "batches": 0, "refused": 0}
for t in range(trials):
    n = int(rng.integers(4, 60))
    width = int(rng.choice([2, 4, 6]))
    a = (np.arange(n * width) % 251).astype(rng.choice(["float64", "int32", "uint8"])).reshape(n, width)
    ref = a.copy()
    L = pinloader.ArrayLoader({"x": a}, int(rng.integers(1, 9)), device="cpu",
                              windows=None if rng.random() < 0.5 else int(rng.integers(1, 4)),
                              seed=t, world_size=int(rng.integers(1, 3)), rank=0)
    stop = threading.Event()
    views = [(n * width,), (n * width // 2, 2), (n, width)]
    other = {"float64": "int64", "int32": "float32", "uint8": "int8"}[a.dtype.name]
    def mutate():
        while not stop.is_set():
            for shape in views:
                try:
                    a.shape = shape
                    a.dtype = other
                    a.dtype = ref.dtype
                except (AttributeError, ValueError, TypeError):
                    pass
            a.shape = (n, width)
    th = threading.Thread(target=mutate)
    th.start()
    try:
        order = L.indices(0)
        for bi, b in enumerate(L):
            got = np.from_dlpack(b["x"])
            rows = order[bi * L.batch_size:(bi + 1) * L.batch_size]
            exp = ref[rows] if L.windows is None else np.stack([ref[r:r + L.windows] for r in rows])
            assert got.tobytes() == exp.tobytes(), ("wrong bytes delivered", t, bi)
            stats["batches"] += 1
    except (ValueError, TypeError, IndexError, BufferError) as e:
        assert str(e).startswith("arrays['x']"), ("the error does not name the leaf", repr(e))
        stats["refused"] += 1
    finally:
        stop.set()
        th.join()
        a.shape = (n, width)
        L.close()
    stats["trials"] += 1
print("MUTATION", stats, flush=True)
"""


def test_array_loader_sources_mutated_in_place():
    # Sources reshaped or retyped in place under the loader: each RowGather reads through its
    # own view of the source (Note [array sources] in src/py/gather.c), so a change made while a
    # batch is gathered cannot reach the gather, and one made between batches is a clean error.
    # In a child: a crash there fails this test only. The budget follows the fuzz profile.
    p = run_py(MUTATION_CHILD, timeout=600, argv=(str(max(20, EXAMPLES // 10)), "18"))
    TRIED_LOADER["mutation"] = p.stdout.strip()
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout}\n{p.stderr[-4000:]}"
