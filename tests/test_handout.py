"""How a batch is handed out (Note [handout] in src/py/handout.h): every container kind the
same on every path (output="array", "capsule", convert=, the torch door, ArrayLoader), the
per-batch stream callable, convert=, and static batches (static=, out=, valid_rows) on the
host backend. The CUDA side of static batches is in tests/test_static_batches.py."""
from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

import pinloader
from helpers import CapsuleWrapper, drain, map_leaves
from pinloader import _C, AsyncPrefetcher

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Sample:
    image: object
    label: object
    note: str = dataclasses.field(default="n", init=False)


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: object
    y: object = 0


class Tagged(dict):
    pass


def _arr(i, n=3, dtype=np.float32):
    return np.arange(n, dtype=dtype) + i


# Each maker gives item i of a source: every container kind, nested and empty ones included.
STRUCTURES = {
    "bare": lambda i: _arr(i),
    "tuple": lambda i: (_arr(i), _arr(i, 2, np.int64)),
    "list": lambda i: [_arr(i), "text", None],
    "dict": lambda i: {"a": _arr(i), "b": {"c": _arr(i, 4)}},
    "defaultdict": lambda i: collections.defaultdict(list, x=_arr(i)),
    "ordereddict": lambda i: collections.OrderedDict([("z", _arr(i)), ("a", 1.5)]),
    "dict_subclass": lambda i: Tagged(v=_arr(i, 2)),
    "namedtuple": lambda i: Pair(_arr(i), "tag"),
    "dataclass": lambda i: Sample(_arr(i), i),
    "frozen_dataclass": lambda i: Frozen(_arr(i)),
    "nested": lambda i: {"p": Pair([_arr(i), (Frozen(_arr(i, 2)),)], {"d": [_arr(i, 1)]})},
    "empty_containers": lambda i: {"x": _arr(i), "e": {}, "l": [], "t": ()},
}


def _canon(obj):
    """The structure with arrays as lists and every container tagged with its type."""
    if isinstance(obj, np.ndarray):
        return ("array", str(obj.dtype), obj.tolist())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__,
                [(f.name, _canon(getattr(obj, f.name))) for f in dataclasses.fields(obj)])
    if isinstance(obj, dict):
        extra = getattr(obj, "default_factory", None)
        return (type(obj).__name__, extra, [(k, _canon(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [_canon(v) for v in obj])
    return obj


def _to_numpy(x):
    if type(x) is pinloader.DeviceArray:
        return np.from_dlpack(x).copy()
    if type(x).__name__ == "PyCapsule":
        return np.from_dlpack(CapsuleWrapper(x)).copy()
    if type(x).__module__.startswith("torch"):
        return x.numpy().copy()
    if isinstance(x, np.ndarray):
        return x.copy()
    return x


def _leaves_to_numpy(obj):
    return map_leaves(obj, _to_numpy)


def _deliver(path, src):
    """The batches of src through one delivery path, as NumPy."""
    if path == "array":
        pf = AsyncPrefetcher(src, device="cpu")
    elif path == "capsule":
        pf = AsyncPrefetcher(src, device="cpu", output="capsule")
    elif path == "convert_array":
        pf = AsyncPrefetcher(src, device="cpu", convert=np.from_dlpack)
    elif path == "convert_capsule":
        pf = AsyncPrefetcher(src, device="cpu", output="capsule",
                             convert=lambda c: np.from_dlpack(CapsuleWrapper(c)))
    elif path == "static":
        pf = AsyncPrefetcher(src, device="cpu", static=True, convert=np.from_dlpack)
        out = []
        for b in pf:  # a static batch is valid until the next one: copy it now
            out.append(_leaves_to_numpy(b))
        pf.close()
        return out
    elif path == "torch":
        pt = pytest.importorskip("pinloader.torch")
        pf = pt.prefetch(src, device="cpu")
    else:
        raise AssertionError(path)
    with pf:
        return [_leaves_to_numpy(b) for b in pf]


PATHS = ["array", "capsule", "convert_array", "convert_capsule", "static", "torch"]


@pytest.mark.parametrize("kind", sorted(STRUCTURES))
@pytest.mark.parametrize("path", PATHS)
def test_every_container_kind_is_rebuilt_the_same_on_every_path(kind, path):
    src = [STRUCTURES[kind](i) for i in range(3)]
    got = _deliver(path, src)
    assert [_canon(b) for b in got] == [_canon(b) for b in src]


@pytest.mark.parametrize("kind", ["tuple", "dict", "defaultdict", "ordereddict", "dict_subclass",
                                  "namedtuple", "dataclass", "frozen_dataclass", "nested"])
def test_array_loader_keeps_every_container_kind_of_its_arrays(kind):
    rows = 6
    arrays = STRUCTURES[kind](0)

    def rowsof(obj):  # each leaf as `rows` rows of an array (ArrayLoader takes only arrays)
        obj = obj if isinstance(obj, np.ndarray) else np.zeros(1, np.int32)
        return np.stack([obj + r for r in range(rows)])
    arrays = _map_arrays(arrays, rowsof, every_leaf=True)
    with pinloader.ArrayLoader(arrays, 2, device="cpu", shuffle=False) as L:
        got = [_leaves_to_numpy(b) for b in L]
    want = [_map_arrays(arrays, lambda a, k=k: a[2 * k:2 * k + 2]) for k in range(3)]
    assert [_canon(b) for b in got] == [_canon(b) for b in want]


def _map_arrays(obj, fn, every_leaf=False):
    return map_leaves(obj, lambda x: fn(x) if every_leaf or isinstance(x, np.ndarray) else x)


# ---- stream= and convert= ----


def test_a_stream_callable_is_called_once_per_batch_and_convert_once_per_leaf():
    calls = {"stream": 0, "convert": 0}

    def stream():
        calls["stream"] += 1
        return None  # the host backend's only stream

    def convert(cap):
        calls["convert"] += 1
        return np.from_dlpack(CapsuleWrapper(cap))

    src = [{f"k{j}": np.full(4, j + i, np.float32) for j in range(8)} for i in range(5)]
    with AsyncPrefetcher(src, device="cpu", output="capsule", stream=stream, convert=convert) as pf:
        out = list(pf)
    assert calls == {"stream": 5, "convert": 40}
    assert [float(b["k3"][0]) for b in out] == [3.0, 4.0, 5.0, 6.0, 7.0]


@pytest.mark.parametrize("where", ["stream", "convert"])
def test_an_error_in_stream_or_convert_reaches_the_consumer_and_the_next_batch_comes(where):
    state = {"fail": True}

    def maybe_fail():
        if state.pop("fail", False):
            raise RuntimeError(f"{where} failed")

    def stream():
        if where == "stream":
            maybe_fail()
        return None

    def convert(leaf):
        if where == "convert":
            maybe_fail()
        return np.from_dlpack(leaf)

    src = [np.full(3, i) for i in range(3)]
    with AsyncPrefetcher(src, device="cpu", stream=stream, convert=convert) as pf:
        with pytest.raises(RuntimeError, match=f"{where} failed"):
            next(pf)
        assert [int(next(pf)[0]) for _ in range(2)] == [1, 2]


def test_keyboard_interrupt_in_convert_stays_a_keyboard_interrupt():
    def convert(leaf):
        raise KeyboardInterrupt

    with AsyncPrefetcher([np.zeros(2)] * 2, device="cpu", convert=convert) as pf:
        with pytest.raises(KeyboardInterrupt):
            next(pf)


@pytest.mark.parametrize("kwargs, err, match", [
    ({"convert": 3}, TypeError, "convert must be a callable or None, not int"),
    ({"stream": "s"}, TypeError, "stream must be None, a DLPack stream handle"),
    ({"stream": True}, TypeError, "stream must be None, a DLPack stream handle"),
    ({"out": np.zeros(3)}, TypeError, "out must be a list or tuple"),
])
def test_bad_handout_options_are_refused_at_construction(kwargs, err, match):
    with pytest.raises(err, match=match):
        AsyncPrefetcher([np.zeros(2)], device="cpu", **kwargs)


def test_a_host_stream_other_than_none_is_refused_when_the_batch_is_handed_out():
    with AsyncPrefetcher([np.zeros(2)] * 2, device="cpu", output="capsule", stream=lambda: 7) as pf:
        with pytest.raises(BufferError):
            next(pf)


def test_a_door_refuses_handout_options_it_sets_itself():
    pt = pytest.importorskip("pinloader.torch")
    with pytest.raises(TypeError, match="convert is set by the framework door itself"):
        pt.prefetch([np.zeros(2)], device="cpu", convert=np.asarray)


# ---- static batches (host backend) ----


def _rows(i, n=4, cols=3):
    return np.arange(n * cols, dtype=np.float32).reshape(n, cols) + 100 * i


def test_static_batches_are_the_same_objects_with_each_batch_values():
    src = [{"x": _rows(i), "y": np.arange(4) + i, "tag": "t"} for i in range(4)]
    with AsyncPrefetcher(src, device="cpu", static=True) as pf:
        seen, ids = [], set()
        for b in pf:
            ids.add((id(b["x"]), id(b["y"])))
            seen.append((np.from_dlpack(b["x"]).copy(), np.from_dlpack(b["y"]).copy(), b["tag"]))
            assert pf.valid_rows == 4
        arrays = pf.static_arrays
    assert len(ids) == 1
    assert len(arrays) == 2 and all(type(a) is pinloader.DeviceArray for a in arrays)
    for i, (x, y, tag) in enumerate(seen):
        np.testing.assert_array_equal(x, src[i]["x"])
        np.testing.assert_array_equal(y, src[i]["y"])
        assert tag == "t"


def test_static_convert_runs_once_per_buffer():
    calls = []

    def convert(leaf):
        calls.append(1)
        return np.from_dlpack(leaf)

    src = [(_rows(i), _rows(-i)) for i in range(5)]
    with AsyncPrefetcher(src, device="cpu", static=True, convert=convert) as pf:
        firsts = [(b[0], b[1], float(b[0][0, 0]), float(b[1][0, 0])) for b in pf]
    assert len(calls) == 2
    assert all(f[0] is firsts[0][0] and f[1] is firsts[0][1] for f in firsts)
    assert [f[2] for f in firsts] == [0.0, 100.0, 200.0, 300.0, 400.0]
    assert [f[3] for f in firsts] == [0.0, -100.0, -200.0, -300.0, -400.0]


def test_a_short_static_batch_fills_the_first_rows_zeroes_the_rest_and_counts_them():
    src = [_rows(0), _rows(1), _rows(2, n=1)]
    with AsyncPrefetcher(src, device="cpu", static=True, convert=np.from_dlpack) as pf:
        got = [(b.copy(), pf.valid_rows) for b in pf]
    assert [v for _, v in got] == [4, 4, 1]
    np.testing.assert_array_equal(got[2][0][:1], src[2])
    assert not got[2][0][1:].any()


@pytest.mark.parametrize("second, match", [
    (np.zeros((4, 2), np.float32), r"batch leaf 0 is \(4, 2\) float32, but the static buffer "
                                   r"\(laid out from the first batch\) is \(4, 3\) float32"),
    (np.zeros((5, 3), np.float32), r"batch leaf 0 is \(5, 3\) float32"),
    (np.zeros((4, 3), np.float64), r"batch leaf 0 is \(4, 3\) float64"),
    ((np.zeros((4, 3), np.float32), np.zeros(1)), "the batch has 2 array leaves, the static batch"),
])
def test_a_static_batch_of_another_layout_is_a_clear_error_and_the_next_one_comes(second, match):
    src = [_rows(0), second, _rows(2)]
    with AsyncPrefetcher(src, device="cpu", static=True, convert=np.from_dlpack) as pf:
        np.testing.assert_array_equal(next(pf), src[0])
        with pytest.raises(ValueError, match=match):
            next(pf)
        np.testing.assert_array_equal(next(pf), src[2])


def test_out_buffers_are_delivered_as_they_are():
    out = [np.zeros((4, 3), np.float32), np.zeros(4, np.int64)]
    src = [(_rows(i), np.arange(4) * i) for i in range(3)]
    with AsyncPrefetcher(src, device="cpu", out=out) as pf:
        for i in range(3):
            b = next(pf)
            assert b[0] is out[0] and b[1] is out[1]
            np.testing.assert_array_equal(out[0], src[i][0])
            np.testing.assert_array_equal(out[1], src[i][1])
        assert pf.static_arrays is None


@pytest.mark.parametrize("bad, match", [
    (np.zeros((4, 6), np.float32)[:, ::2], "out\\[0\\] is not C-contiguous"),
    ("text", "out\\[0\\] \\(str\\) does not export DLPack"),
])
def test_bad_out_buffers_are_named(bad, match):
    with AsyncPrefetcher([_rows(0)], device="cpu", out=[bad]) as pf:
        with pytest.raises((ValueError, TypeError), match=match):
            next(pf)


def test_read_only_out_buffer_is_refused():
    ro = np.zeros((4, 3), np.float32)
    ro.flags.writeable = False
    with AsyncPrefetcher([_rows(0)], device="cpu", out=[ro]) as pf:
        with pytest.raises((ValueError, BufferError), match="read-only|readonly"):
            next(pf)


def test_out_buffer_smaller_than_the_batch_is_refused():
    with AsyncPrefetcher([_rows(0)], device="cpu", out=[np.zeros((2, 3), np.float32)]) as pf:
        with pytest.raises(ValueError, match=r"batch leaf 0 is \(4, 3\) float32"):
            next(pf)


def test_static_array_loader_and_its_torch_door():
    data = np.arange(30, dtype=np.float32).reshape(10, 3)
    with pinloader.ArrayLoader(data, 4, device="cpu", shuffle=False, static=True) as L:
        got = []
        for b in L:
            got.append((np.from_dlpack(b).copy(), L.valid_rows, id(b)))
    assert [v for _, v, _ in got] == [4, 4, 2]
    assert len({i for _, _, i in got}) == 1
    np.testing.assert_array_equal(got[2][0][:2], data[8:])
    assert not got[2][0][2:].any()
    pt = pytest.importorskip("pinloader.torch")
    L = pinloader.ArrayLoader(data, 4, device="cpu", shuffle=False)
    with pt.prefetch(L, static=True) as T:
        rows = [(t.numpy().copy(), T.valid_rows, t.data_ptr()) for t in T]
    assert [v for _, v, _ in rows] == [4, 4, 2]
    assert len({p for _, _, p in rows}) == 1
    np.testing.assert_array_equal(np.concatenate([r[:v] for r, v, _ in rows]), data)


def test_static_memory_is_one_block_across_epochs_and_freed_after_close():
    before = _C._testing.live_device_blocks("host")[0]
    src = [_rows(i) for i in range(3)]
    pf = AsyncPrefetcher(src, device="cpu", static=True, depth=1)
    counts = []
    for _ in range(5):
        drain(pf)
        counts.append(_C._testing.live_device_blocks("host")[0] - before)
        iter(pf)
    assert max(counts) == min(counts), counts  # nothing grows epoch over epoch
    pf.close()
    assert pf.static_arrays is None
    assert _C._testing.live_device_blocks("host")[0] - before <= 0


@pytest.mark.parametrize("static", [False, True])
def test_a_convert_that_closes_the_prefetcher_gets_its_batch_and_then_a_clean_error(static):
    box = {}

    def convert(leaf):
        box["pf"].close()  # user code dropping everything mid-handout
        return np.from_dlpack(leaf).copy()

    src = [_rows(i) for i in range(3)]
    pf = box["pf"] = AsyncPrefetcher(src, device="cpu", static=static, convert=convert)
    np.testing.assert_array_equal(next(pf), src[0])
    assert pf.closed and pf.static_arrays is None
    with pytest.raises(ValueError, match="closed"):
        next(pf)


# ---- a batch's leaves exported straight from its block (Note [batch leaves]) ----


def _host_waits():
    c = _C._testing.debug_counters()
    return c["host_consumer_waits"], c["host_consumer_waits_skipped"]


def test_capsules_of_a_held_batch_stay_valid_after_later_batches_and_close():
    from helpers import live_blocks

    import gc

    gc.collect()
    src = [{f"k{j}": np.full(5, 10 * i + j, np.float32) for j in range(6)} for i in range(6)]
    blocks0 = live_blocks()[0]
    pf = AsyncPrefetcher(src, device="cpu", output="capsule")
    it = iter(pf)
    held = next(it)  # raw capsules, unconsumed
    assert sorted(held) == [f"k{j}" for j in range(6)]
    later = [next(it) for _ in range(3)]
    del later
    pf.close()
    assert live_blocks()[0] >= blocks0 + 1  # the held capsules keep their batch's block
    for j in range(6):
        a = np.from_dlpack(CapsuleWrapper(held[f"k{j}"]))
        assert a.tolist() == [float(j)] * 5
    del a, held
    assert live_blocks()[0] <= blocks0  # and the last capsule's release frees it


@pytest.mark.parametrize("convert", [None, "numpy"])
def test_a_handed_out_batch_waits_once_for_its_copy_whatever_its_leaf_count(convert):
    n_leaves, n_batches = 9, 4
    src = [{f"k{j}": np.full(3, i + j, np.int32) for j in range(n_leaves)} for i in range(n_batches)]
    fn = (lambda cap: np.from_dlpack(CapsuleWrapper(cap))) if convert else None
    waits0, skipped0 = _host_waits()
    with AsyncPrefetcher(src, device="cpu", output="capsule", convert=fn) as pf:
        out = list(pf)
    waits, skipped = _host_waits()
    assert waits - waits0 == n_batches
    assert skipped - skipped0 == n_batches * (n_leaves - 1)
    if convert:
        assert [int(b["k4"][0]) for b in out] == [4 + i for i in range(n_batches)]


def test_output_array_with_convert_gets_device_arrays_made_at_the_handout():
    seen = []

    def convert(x):
        seen.append(type(x))
        return np.from_dlpack(x)

    src = [(np.full(2, i, np.int64), {"y": np.full((2, 3), i, np.float32)}) for i in range(3)]
    with AsyncPrefetcher(src, device="cpu", convert=convert) as pf:
        out = list(pf)
    assert seen == [pinloader.DeviceArray] * 6
    assert [(int(a[0]), b["y"].shape, float(b["y"][1, 2])) for a, b in out] == \
        [(i, (2, 3), float(i)) for i in range(3)]


def test_a_batch_of_many_leaves_released_in_any_order_frees_its_block():
    # Exported from the batch's views (Note [batch leaves] in src/py/flatten.h): every rank,
    # each capsule released on its own, consumed or not, in any order; the last frees the block.
    import gc
    import random

    from helpers import live_blocks

    gc.collect()
    shapes = [(), (3,), (2, 3), (1, 2, 2), (0,), (4, 1)]

    def item(i):
        return [np.full(shapes[j % len(shapes)], i * 100 + j, np.float64) for j in range(70)]

    blocks0 = live_blocks()[0]
    with AsyncPrefetcher([item(i) for i in range(3)], device="cpu", output="capsule") as pf:
        batches = list(pf)
    rng = random.Random(5)
    for i, caps in enumerate(batches):
        arrays = {j: np.from_dlpack(CapsuleWrapper(caps[j])) for j in range(0, 70, 3)}
        for j, a in arrays.items():
            assert a.shape == shapes[j % len(shapes)]
            assert a.size == 0 or float(a.flat[0]) == i * 100 + j
        order = list(range(70))
        rng.shuffle(order)
        for j in order:  # unconsumed capsules and consumed ones' arrays, mixed
            caps[j] = None
            arrays.pop(j, None)
    del batches, caps, arrays, a
    assert live_blocks()[0] <= blocks0
