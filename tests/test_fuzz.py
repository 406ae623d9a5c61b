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

# The suite's per-test timeout (pyproject.toml, 300 s) is for hangs; a fuzz test runs a bounded
# number of examples (PINLOADER_FUZZ_EXAMPLES), which under ASan on a 2-core host can take
# close to that, so its bound here is larger.
pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(1200)]

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
    # own view of the source (Note [array sources] in src/py/row_gather.c), so a change made while a
    # batch is gathered cannot reach the gather, and one made between batches is a clean error.
    # In a child: a crash there fails this test only. The budget follows the fuzz profile.
    p = run_py(MUTATION_CHILD, timeout=600, argv=(str(max(20, EXAMPLES // 10)), "18"))
    TRIED_LOADER["mutation"] = p.stdout.strip()
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout}\n{p.stderr[-4000:]}"


# ---- static batches, out= buffers, resume and doors ------------------------------------------------

# These make a prefetcher (or a loader) per example: a part of the budget keeps the job's time
# (under ASan, 6000 examples: 750 static and 1500 resume examples, about a minute together).
SMALL_SETTINGS = settings(FUZZ_SETTINGS, max_examples=max(20, EXAMPLES // 4))
STATIC_SETTINGS = settings(FUZZ_SETTINGS, max_examples=max(20, EXAMPLES // 8))
TRIED_STATIC = {"examples": 0, "batches": 0, "refused": 0, "closed": 0}

_STATIC_DTYPES = ("float32", "int64", "uint8", "float64")


@st.composite
def static_cases(draw):
    """Leaves (dtype, shape: 0-d included), batches with full, short or too many rows (or
    another layout), an out= mode (None: static=True; "own": buffers of the first batch's layout;
    "alias": the same buffer twice or overlapping views), static_rows, and the batch at which
    the stream callable closes the prefetcher (None: never)."""
    n_leaves = draw(st.integers(1, 3))
    leaves = [(draw(st.sampled_from(_STATIC_DTYPES)),
               tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=2)))) for _ in range(n_leaves)]
    rows = draw(st.integers(0, 5))
    batches = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["full", "full", "short", "more", "other"]))
        batches.append((kind, draw(st.integers(0, 5))))
    out = draw(st.sampled_from([None, "own", "alias"])) if any(len(s) or True for _, s in leaves) else None
    static_rows = draw(st.one_of(st.none(), st.integers(0, 7)))
    close_at = draw(st.one_of(st.none(), st.integers(0, 4)))
    return leaves, rows, batches, out, static_rows, close_at


def _static_leaf(dtype, shape, rows, fill):
    full = (rows,) + shape if shape is not None else ()
    return (np.arange(int(np.prod(full, dtype=np.int64)), dtype=np.int64) % 97 + fill).astype(dtype).reshape(full)


def _check_static(item, got):
    """Each leaf of a static batch: the source's rows first, zeros after (no view outlives it)."""
    for x, g in zip(item, got):
        g = np.from_dlpack(g)
        if x.ndim:
            np.testing.assert_array_equal(g[:x.shape[0]], x)
            assert not g[x.shape[0]:].any()
        else:
            np.testing.assert_array_equal(g, x)


@STATIC_SETTINGS
@given(case=static_cases())
def test_static_batches_equal_the_source_or_clean_errors(case):
    from helpers import count_tasks, live_blocks, wait_for, warm_up
    leaves, rows, batches, out_mode, static_rows, close_at = case
    if LOG:
        with open(LOG, "w") as f:
            f.write(repr(("static", case)) + "\n")
            f.flush()
            os.fsync(f.fileno())
    TRIED_STATIC["examples"] += 1
    warm_up()
    pool = source_pool()
    before, tasks = live_blocks(), count_tasks()
    # leaves with a rows dimension: shape (rows, *trailing); 0-d leaves: shape ()
    kinds = [(d, None if k == 0 else s) for k, (d, s) in enumerate(leaves)] if len(leaves) > 1 else \
        [(leaves[0][0], leaves[0][1])]
    items = []
    for b, (kind, r) in enumerate(batches):
        n = rows if kind == "full" else min(r, rows) if kind == "short" else rows + 1 + r % 2
        item = []
        for d, trailing in kinds:
            if trailing is None:
                item.append(np.array(b, d))
            elif kind == "other":
                item.append(_static_leaf(d, trailing + (2,), n, b))
            else:
                item.append(_static_leaf(d, trailing, n, b))
        items.append(tuple(item))
    first = items[0]
    out = None
    if out_mode == "own":
        out = [np.zeros(a.shape, a.dtype) for a in first]
    elif out_mode == "alias":
        big = np.zeros(sum(a.nbytes for a in first) + 64, np.uint8)
        out = [big[:a.nbytes].view(a.dtype).reshape(a.shape) if a.nbytes else np.zeros(a.shape, a.dtype)
               for a in first]
    box = {"n": 0}

    def stream():
        if close_at is not None and box["n"] == close_at:
            box["pf"].close()
        box["n"] += 1
        return None

    pf = box["pf"] = pinloader.AsyncPrefetcher(items, device=DEVICE, static=out is None, out=out,
                                               stream=stream, static_rows=static_rows, pool=pool)
    aliased = out_mode == "alias" and sum(1 for a in first if a.nbytes) > 1
    layout = [np.array(a) for a in first]
    try:
        for b, item in enumerate(items):
            try:
                got = next(pf)
            except StopIteration:
                raise AssertionError("the epoch ended early")
            except ValueError as e:
                msg = str(e)
                if close_at is not None and b >= close_at:
                    assert "closed" in msg, msg
                    TRIED_STATIC["closed"] += 1
                elif aliased and b == 0:
                    assert "overlap in memory" in msg, msg
                    TRIED_STATIC["refused"] += 1
                else:
                    assert "batch leaf" in msg or "array leaves" in msg, msg
                    assert any(x.shape[1:] != y.shape[1:] or x.ndim != y.ndim or
                               (x.ndim and x.shape[0] > max(y.shape[0], static_rows or 0 if out is None else 0))
                               for x, y in zip(item, layout)), (msg, item, layout)
                    TRIED_STATIC["refused"] += 1
                break
            assert close_at is None or b < close_at, "a batch was handed out after close()"
            assert not (aliased and b == 0), "overlapping out= buffers were accepted"
            with_rows = [x.shape[0] for x in item if x.ndim]
            assert pf.valid_rows == (min(with_rows) if with_rows else None)
            _check_static(item, got)
            TRIED_STATIC["batches"] += 1
            del got  # a delivered static batch holds the static buffers
    finally:
        pf.close()
    # nothing left after close(): device blocks, pinned regions, threads
    assert wait_for(lambda: live_blocks() == before, timeout=5, step=0.001), live_blocks()
    assert wait_for(lambda: pool.stats()["in_use_bytes"] == 0, timeout=5, step=0.001), pool.stats()
    assert wait_for(lambda: count_tasks() <= tasks, timeout=5, step=0.001), (count_tasks(), tasks)


TRIED_RESUME = {"examples": 0, "batches": 0, "refused": 0}


def _from_capsule(cap):
    from helpers import CapsuleWrapper
    return np.from_dlpack(CapsuleWrapper(cap))


@SMALL_SETTINGS
@given(n=st.integers(1, 40), batch_size=st.integers(1, 7), world=st.integers(1, 3), new_world=st.integers(1, 4),
       position=st.integers(-2, 50), epoch=st.integers(-1, 3), drop_last=st.booleans(),
       hostile=st.sampled_from([None, "world_size", "epoch", "rank", "sources", "format"]),
       doors=st.lists(st.sampled_from(["plain", "static", "convert", "capsule"]), min_size=1, max_size=3))
def test_resume_with_random_states_and_doors_per_epoch(n, batch_size, world, new_world, position, epoch,
                                                       drop_last, hostile, doors):
    from pinloader._door import Door
    if LOG:
        with open(LOG, "w") as f:
            f.write(repr(("resume", n, batch_size, world, new_world, position, epoch, drop_last, hostile,
                          doors)) + "\n")
            f.flush()
            os.fsync(f.fileno())
    TRIED_RESUME["examples"] += 1
    data = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    L0 = pinloader.ArrayLoader(data, batch_size, device=DEVICE, world_size=world, rank=0, seed=3,
                               drop_last=drop_last)
    st_ = L0.state_dict()
    L0.close()
    st_["epoch"], st_["position"] = epoch, position
    if hostile == "world_size":
        st_["world_size"] = 0
    elif hostile == "rank":
        st_["rank"] = world
    elif hostile == "sources":
        st_["sources"] = {"rows": n + 1, "leaves": st_["sources"]["leaves"]}
    elif hostile == "format":
        st_["format"] = None
    L = pinloader.ArrayLoader(data, batch_size, device=DEVICE, world_size=new_world, rank=new_world - 1,
                              seed=3, drop_last=drop_last)
    try:
        try:
            L.load_state_dict(st_)
        except (ValueError, TypeError) as e:
            assert hostile not in (None, "epoch") or epoch < 0 or position < 0, repr(e)
            TRIED_RESUME["refused"] += 1
            return
        assert hostile in (None, "epoch") and epoch >= 0 and position >= 0
        for k, door in enumerate(doors):
            ep = epoch if k == 0 else None
            want = L.indices_after(ep, position) if k == 0 and position < L.num_items else None
            if door == "plain":
                it = L
            else:
                handout = {"output": "capsule" if door == "capsule" else "array", "stream": None,
                           "convert": _from_capsule if door == "capsule" else np.from_dlpack}
                if door == "static":
                    handout = {"static": True}
                it = Door(L, DEVICE, 2, handout)
            got = []
            for b in it:
                x = np.from_dlpack(b).copy()
                v = it.valid_rows if door == "static" else None
                got.append(x[:v] if v is not None else x)
                TRIED_RESUME["batches"] += 1
            idx = np.concatenate(got) if got else np.empty((0, 2), np.float32)
            if want is not None:
                exp = data[want]
                if drop_last:
                    exp = exp[:len(exp) // batch_size * batch_size]
                np.testing.assert_array_equal(idx, exp)
            else:
                assert len(got) == len(L) or k == 0
    finally:
        L.close()
