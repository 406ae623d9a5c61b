"""The torch adapter's per-batch import (Note [per-batch import] in pinloader/_adapter.py):
the batch is flattened once, the consumer stream is looked up once, the leaves are exported
together for that stream and rebuilt into the same structure."""
from __future__ import annotations

import collections
import copy
import dataclasses

import numpy as np
import pytest

import pinloader
from pinloader import _adapter

torch = pytest.importorskip("torch")
import pinloader.torch as pt  # noqa: E402

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Sample:
    image: np.ndarray
    label: int
    note: str = dataclasses.field(default="n", init=False)


class Tagged(dict):
    pass


class Rows(list):
    pass


def _nested(i):
    rng = np.random.default_rng(i)
    return {"x": rng.standard_normal((4, 3, 5)).astype(np.float32),
            "pair": Pair(np.arange(6, dtype=np.int64).reshape(2, 3)[:, ::-1], "tag"),
            "list": [np.full(3, i, np.uint8), None, ("const", 7)],
            "sample": Sample(np.ones((2, 2), np.float16) * i, i),
            "od": collections.OrderedDict(b=np.int32(i) * np.ones(2, np.int32), a=1.5),
            "dd": collections.defaultdict(list, {"k": np.zeros(1, np.bool_)}),
            "tagged": Tagged(v=np.arange(4, dtype=np.float64)),
            "rows": Rows([np.arange(2, dtype=np.int16), "r"]),
            "meta": {"name": "batch", "ids": [1, 2, 3]},
            "empty": {}}


def _expected(obj):
    """What the adapter must give for a source object: arrays as contiguous CPU tensors, every
    container rebuilt with its own type and extra state."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if type(obj) in (dict, list):
        items = obj.items() if type(obj) is dict else enumerate(obj)
        out = copy.copy(obj)
        for k, v in items:
            out[k] = _expected(v)
        return out
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k in list(obj):
            out[k] = _expected(obj[k])
        return out
    if isinstance(obj, tuple):
        vals = [_expected(v) for v in obj]
        return type(obj)(*vals) if hasattr(obj, "_fields") else type(obj)(vals)
    if isinstance(obj, list):  # the prefetcher hands list subclasses out as lists
        return [_expected(v) for v in obj]
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: _expected(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _reference(src):
    return [_expected(b) for b in src]


def _assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


def test_nested_batches_equal_the_source_and_the_old_adapter():
    src = [_nested(i) for i in range(4)]
    with pt.prefetch(src, device="cpu") as batches:
        out = list(batches)
    ref = _reference(src)
    assert len(out) == len(ref) == 4
    for i, (o, r) in enumerate(zip(out, ref)):
        _assert_same(o, r)
        assert torch.equal(o["x"], torch.from_numpy(src[i]["x"]))
        assert o["x"].device.type == "cpu"
        assert o["sample"].label == i and o["sample"].note == "n"
        assert o["dd"].default_factory is list
        assert o["list"][1] is None and o["list"][2] == ("const", 7)
        assert o["meta"] == {"name": "batch", "ids": [1, 2, 3]}


@pytest.mark.parametrize("batch", [
    np.arange(10, dtype=np.float32),                        # a bare array
    (np.arange(3), np.arange(4.0)),
    [np.ones((2, 2), np.int8)] * 3,                         # the same array three times
    {"only": "strings", "n": 3},                            # no arrays at all
    {},
    Pair(a=None, b=[{"deep": [[np.arange(5, dtype=np.uint16)]]}]),
])
def test_shapes_of_batches(batch):
    with pt.prefetch([batch, batch], device="cpu") as batches:
        out = list(batches)
    ref = _reference([batch, batch])
    for o, r in zip(out, ref):
        _assert_same(o, r)


def test_non_array_leaves_pass_through_unchanged():
    marker = object()
    src = [{"a": np.zeros(2), "obj": marker, "s": "text", "n": None, "t": (1, "x")}]
    with pt.prefetch(src, device="cpu") as batches:
        (b,) = list(batches)
    assert b["obj"] is marker and b["s"] == "text" and b["n"] is None and b["t"] == (1, "x")


def test_stream_looked_up_and_leaves_exported_once_per_batch(monkeypatch):
    calls = {"stream": 0, "export": []}
    real_stream = pt.TorchPrefetcher._consumer_stream
    real_export = _adapter.export_leaves

    def counting_stream(self):
        calls["stream"] += 1
        return real_stream(self)

    def counting_export(leaves, stream):
        calls["export"].append((len(leaves), stream))
        return real_export(leaves, stream)

    def no_current_stream(*a, **k):
        raise AssertionError("torch.cuda.current_stream looked up for a host batch")

    monkeypatch.setattr(pt.TorchPrefetcher, "_consumer_stream", counting_stream)
    monkeypatch.setattr(_adapter, "export_leaves", counting_export)
    monkeypatch.setattr(torch.cuda, "current_stream", no_current_stream)
    src = [{f"k{j}": np.full(16, j, np.float32) for j in range(32)} for _ in range(5)]
    with pt.prefetch(src, device="cpu") as batches:
        out = list(batches)
    assert calls["stream"] == 5
    assert calls["export"] == [(32, None)] * 5
    assert all(float(b["k7"][0]) == 7.0 for b in out)


def test_consumer_streams_that_change_between_batches_are_followed(monkeypatch):
    # On the host backend a stream cannot be waited on; what is checked here is the plumbing:
    # each batch is exported for the stream the adapter resolved for that batch.
    streams = iter([11, 22, 11, 33])
    seen = []

    def fake_export(leaves, stream):
        seen.append(stream)
        return [leaf.__dlpack__() for leaf in leaves]

    monkeypatch.setattr(pt.TorchPrefetcher, "_consumer_stream", lambda self: next(streams))
    monkeypatch.setattr(_adapter, "export_leaves", fake_export)
    src = [(np.full(4, i, np.int64), {"y": np.full(2, -i, np.int64)}) for i in range(4)]
    with pt.prefetch(src, device="cpu") as batches:
        out = list(batches)
    assert seen == [11, 22, 11, 33]
    assert [int(b[0][0]) for b in out] == [0, 1, 2, 3]
    assert [int(b[1]["y"][0]) for b in out] == [0, -1, -2, -3]


def test_export_without_native_batch_export(monkeypatch):
    # The per-leaf __dlpack__ fallback (pinloader._C.export_capsules absent) gives the same.
    monkeypatch.setattr(_adapter, "_native_export", None)
    src = [_nested(i) for i in range(2)]
    with pt.prefetch(src, device="cpu") as batches:
        out = list(batches)
    for o, r in zip(out, _reference(src)):
        _assert_same(o, r)


def test_native_batch_export_called_once_per_batch_with_the_stream(monkeypatch):
    # pinloader._C.export_capsules(leaves, stream), when the module has it, takes the whole
    # batch at once for a CUDA stream; a stand-in records the calls here.
    calls = []

    def fake_native(leaves, stream):
        calls.append((len(leaves), stream))
        return [leaf.__dlpack__() for leaf in leaves]

    monkeypatch.setattr(_adapter, "_native_export", fake_native)
    monkeypatch.setattr(pt.TorchPrefetcher, "_consumer_stream", lambda self: 7)
    src = [{"a": np.full(3, i), "b": [np.arange(2) + i, "x"]} for i in range(3)]
    with pt.prefetch(src, device="cpu") as batches:
        out = list(batches)
    assert calls == [(2, 7)] * 3
    assert [int(b["b"][0][1]) for b in out] == [1, 2, 3]
    assert _adapter.export_leaves([], None) == []


def test_export_leaves_passes_other_objects_through(monkeypatch):
    monkeypatch.setattr(_adapter, "_native_export", None)
    with pinloader.AsyncPrefetcher([np.arange(3)], device="cpu") as pf:
        (leaf,) = list(pf)
    marker = object()
    caps = _adapter.export_leaves([leaf, marker, leaf], None)
    assert caps[1] is marker
    assert torch.equal(torch.from_dlpack(caps[0]), torch.from_dlpack(caps[2]))


def test_export_error_propagates_and_the_prefetcher_goes_on(monkeypatch):
    state = {"fail": True}
    real_export = _adapter.export_leaves

    def flaky(leaves, stream):
        if state.pop("fail", False):
            raise BufferError("export failed")
        return real_export(leaves, stream)

    monkeypatch.setattr(_adapter, "export_leaves", flaky)
    src = [np.full(3, i) for i in range(3)]
    with pt.prefetch(src, device="cpu") as batches:
        it = iter(batches)
        with pytest.raises(BufferError, match="export failed"):
            next(it)
        assert [int(next(it)[0]) for _ in range(2)] == [1, 2]


# ---- CUDA ----


@pytest.mark.gpu
@pytest.mark.skipif(not pinloader.cuda_available(), reason="no CUDA device")
def test_cuda_consumer_streams_change_between_batches(monkeypatch):
    src = [{"x": np.full((1024, 1024), i, np.float32), "y": np.arange(i, i + 4)} for i in range(9)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.default_stream()]
    lookups = {"n": 0}
    real = torch.cuda.current_stream

    def counting(*a, **k):
        lookups["n"] += 1
        return real(*a, **k)

    m = torch.randn(4096, 4096, device="cuda")
    out = []
    with pt.prefetch(src, device="cuda") as batches:
        it = iter(batches)
        for i in range(len(src)):
            s = streams[i % 3]
            with torch.cuda.stream(s):
                for _ in range(3):        # the consumer stream is busy when the batch arrives
                    m = m @ m * 1e-4
                monkeypatch.setattr(torch.cuda, "current_stream", counting)
                before = lookups["n"]
                b = next(it)
                assert lookups["n"] - before == 1   # once per batch, not once per leaf
                monkeypatch.setattr(torch.cuda, "current_stream", real)
                assert batches._consumer_stream() == (s.cuda_stream or 1)
                out.append((s, b["x"].sum(), b["y"] * 1))
    torch.cuda.synchronize()
    for i, (s, total, y) in enumerate(out):
        assert float(total) == i * 1024 * 1024
        assert y.cpu().tolist() == list(range(i, i + 4))


# ---- flatten / rebuild against map_leaves (property) ----

from hypothesis import given, settings, strategies as st  # noqa: E402

from pinloader._tree import map_leaves  # noqa: E402


@pytest.fixture(scope="module")
def device_arrays():
    with pinloader.AsyncPrefetcher([[np.full(2, i) for i in range(4)]], device="cpu") as pf:
        (batch,) = list(pf)
    return batch


def _structures(arrays):
    leaf = st.one_of(st.sampled_from(range(len(arrays))).map(lambda i: arrays[i]),
                     st.none(), st.integers(-3, 3), st.text(max_size=3))
    return st.recursive(leaf, lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=3), kids, max_size=4),
        st.tuples(kids, kids).map(lambda t: Pair(*t)),
        st.dictionaries(st.text(max_size=3), kids, max_size=3).map(
            lambda d: collections.OrderedDict(sorted(d.items()))),
    ), max_leaves=12)


def test_flatten_rebuild_matches_map_leaves(device_arrays):
    @settings(max_examples=150, deadline=None)
    @given(_structures(device_arrays))
    def check(obj):
        leaves = []
        spec = _adapter.flatten(obj, leaves)
        assert all(type(x) is pinloader.DeviceArray for x in leaves)
        tag = {id(a): i for i, a in enumerate(device_arrays)}
        rebuilt = _adapter.rebuild(spec, iter([("leaf", tag[id(x)]) for x in leaves]))
        expected = map_leaves(obj, lambda x: ("leaf", tag[id(x)]))
        assert rebuilt == expected
        _assert_same(rebuilt, expected)  # container types too, at every level
    check()
