"""AsyncPrefetcher: errors (host backend).

An exception from the source reaches the consumer at its position, the very same object, after
every batch before it, and then the epoch is finished; a leaf that cannot be copied (its dtype, or
an array on another device) is refused at its position with its path in the item
(``item['x'][2]: ...``), losing nothing before it; bad constructor arguments are refused naming
the argument. (A batch too big for the pinned bound: test_prefetcher_pinned_memory.py.)
"""
from __future__ import annotations

import sys
import traceback

import numpy as np
import pytest

import pinloader
from helpers import assert_leaf_equal, check_good, drain, good, val

DEVICE = "cpu"


# ---- source exceptions ---------------------------------------------------------------------------

class Boom(Exception):
    pass


N_ITEMS = 6


@pytest.mark.parametrize("k", [0, N_ITEMS // 2, N_ITEMS - 1, N_ITEMS],
                         ids=["first", "middle", "last", "after-last"])
def test_source_exception_at_position(k):
    raised = []

    def failing_source():
        for i in range(N_ITEMS):
            if i == k:
                e = Boom(f"source failed at {i}")
                raised.append(e)
                raise e
            yield good(i)
        if k == N_ITEMS:
            e = Boom("source failed after the last item")
            raised.append(e)
            raise e

    pf = pinloader.AsyncPrefetcher(failing_source(), device=DEVICE, depth=3)
    try:
        got = []
        with pytest.raises(Boom) as info:
            while True:
                got.append(next(pf))
        # the k earlier batches, in order, all intact
        assert len(got) == k
        for i, b in enumerate(got):
            check_good(b, i)
        # the very same exception object, type preserved, traceback kept
        assert info.value is raised[0]
        tb = "".join(traceback.format_exception(info.value))
        assert "failing_source" in tb, tb
        if sys.version_info >= (3, 11):
            notes = getattr(info.value, "__notes__", [])
            assert any("item" in n for n in notes), notes
        # afterwards the prefetcher is finished
        with pytest.raises(StopIteration):
            next(pf)
        with pytest.raises(StopIteration):
            next(pf)
        assert list(pf) == []
    finally:
        pf.close()


def test_source_exception_from_reiterable_source_each_epoch_is_finished():
    class Flaky:
        def __iter__(self):
            yield good(0)
            yield good(1)
            raise Boom("epoch failed")

    pf = pinloader.AsyncPrefetcher(Flaky(), device=DEVICE)
    try:
        got = []
        with pytest.raises(Boom):
            for b in pf:
                got.append(b)
        assert len(got) == 2
        check_good(got[0], 0)
        check_good(got[1], 1)
        with pytest.raises(StopIteration):
            next(pf)
    finally:
        pf.close()


def test_source_exception_in_iter_of_new_epoch():
    class BadSecondIter:
        def __init__(self):
            self.calls = 0

        def __iter__(self):
            self.calls += 1
            if self.calls > 1:
                raise Boom("cannot restart")
            return iter([good(0), good(1)])

    pf = pinloader.AsyncPrefetcher(BadSecondIter(), device=DEVICE)
    try:
        assert len(list(pf)) == 2
        with pytest.raises(Boom):
            iter(pf)
        assert not pf.closed
    finally:
        pf.close()


# ---- leaves that cannot be copied ----------------------------------------------------------------

BAD_LEAVES = {
    "object": (np.array([object(), 1], dtype=object), "object"),
    "str": (np.array(["a", "bc"]), "<U2"),
    "bytes": (np.array([b"a", b"bc"]), "S2"),
    "datetime64": (np.array(["2020-01-01", "2021-06-30"], dtype="datetime64[D]"), "datetime64"),
    "timedelta64": (np.array([1, 2], dtype="timedelta64[s]"), "timedelta64"),
    "big-endian": (np.arange(4, dtype=">i4"), ">i4"),
    "big-endian-float": (np.arange(4, dtype=">f8"), ">f8"),
    "longdouble": (np.zeros(3, dtype=np.longdouble), None),
    "structured": (np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")]), None),
}


@pytest.mark.parametrize("kind", sorted(BAD_LEAVES))
def test_bad_leaf_raises_at_its_position_naming_the_path(kind):
    bad, dtype_text = BAD_LEAVES[kind]
    items = [good(0), good(1), good(2), {"x": [np.zeros(2), "meta", bad]}, good(4)]
    pf = pinloader.AsyncPrefetcher(items, device=DEVICE, depth=4)
    try:
        got = []
        with pytest.raises((TypeError, ValueError)) as info:
            while True:
                got.append(next(pf))
        # nothing before the bad batch is lost
        assert len(got) == 3
        for i, b in enumerate(got):
            check_good(b, i)
        msg = str(info.value)
        assert msg.startswith("item['x'][2]: "), msg
        if dtype_text:
            assert dtype_text in msg, msg
        with pytest.raises(StopIteration):
            next(pf)
    finally:
        pf.close()


@pytest.mark.parametrize("path_kind", ["namedtuple", "dataclass", "nested-dict", "top-level"])
def test_bad_leaf_path_formats(path_kind):
    import collections
    import dataclasses

    NT = collections.namedtuple("NT", ["image", "label"])

    @dataclasses.dataclass
    class DC:
        image: object
        label: object

    bad = np.array([object()], dtype=object)
    item, path = {
        "namedtuple": (NT(np.zeros(2), bad), "item.label"),
        "dataclass": (DC(bad, 1), "item.image"),
        "nested-dict": ({"a": {"b": [(0, bad)]}}, "item['a']['b'][0][1]"),
        "top-level": (bad, "item"),
    }[path_kind]
    with pinloader.AsyncPrefetcher([good(0), item], device=DEVICE) as pf:
        check_good(next(pf), 0)
        with pytest.raises(TypeError) as info:
            next(pf)
    assert str(info.value).startswith(path + ": "), str(info.value)
    assert "object" in str(info.value)


class _ForeignDeviceArray:
    """A DLPack exporter that says it lives on another device (no data is ever read)."""

    def __init__(self, device):
        self.device = device

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        raise AssertionError("a foreign-device array must be refused before export")


@pytest.mark.parametrize("device,match", [
    ((2, 0), r"item\['x'\]\[1\]: array is on cuda:0, but this prefetcher uses the host backend"),
    ((10, 0), r"item\['x'\]\[1\]: arrays on DLPack device type 10 cannot be copied"),
    ((13, 0), r"item\['x'\]\[1\]: arrays on DLPack device type 13 cannot be copied"),
])
def test_arrays_on_another_device_are_refused_with_their_path(device, match):
    good_items = [{"x": [np.full(3, i), np.full(2, i)]} for i in range(2)]
    bad = {"x": [np.zeros(3), _ForeignDeviceArray(device)]}
    with pinloader.AsyncPrefetcher(good_items + [bad], device=DEVICE) as pf:
        got = [int(val(next(pf)["x"][0])[0]) for _ in range(2)]
        assert got == [0, 1]  # nothing before the bad item is lost
        with pytest.raises(ValueError, match=match):
            next(pf)


# ---- bad arguments -------------------------------------------------------------------------------

@pytest.mark.parametrize("depth,exc,text", [
    (0, ValueError, "got 0"),
    (-1, ValueError, "got -1"),
    (65, ValueError, "got 65"),
    (1000, ValueError, "got 1000"),
    ("2", TypeError, "str"),
    (2.0, TypeError, "float"),
    (None, TypeError, "NoneType"),
])
def test_bad_depth(depth, exc, text):
    with pytest.raises(exc) as info:
        pinloader.AsyncPrefetcher([np.zeros(1)], device=DEVICE, depth=depth)
    assert "depth" in str(info.value), str(info.value)
    assert text in str(info.value), str(info.value)


def test_depth_limits_accepted():
    for depth in (1, 64):
        with pinloader.AsyncPrefetcher([good(i) for i in range(3)], device=DEVICE, depth=depth) as pf:
            assert pf.depth == depth
            out = drain(pf)
        for i, b in enumerate(out):
            check_good(b, i)


@pytest.mark.parametrize("source,typename", [
    (5, "int"),
    (3.5, "float"),
    (None, "NoneType"),
    (object(), "object"),
])
def test_non_iterable_source(source, typename):
    with pytest.raises(TypeError) as info:
        pinloader.AsyncPrefetcher(source, device=DEVICE)
    assert typename in str(info.value), str(info.value)


def test_non_iterable_custom_class_named():
    class NotAnIterable:
        pass

    with pytest.raises(TypeError, match="NotAnIterable"):
        pinloader.AsyncPrefetcher(NotAnIterable(), device=DEVICE)


@pytest.mark.parametrize("kwargs,exc,text", [
    ({"max_pinned_bytes": 0}, ValueError, "max_pinned_bytes"),
    ({"max_pinned_bytes": -5}, ValueError, "max_pinned_bytes"),
    ({"staging_threads": 0}, ValueError, "staging_threads"),
    ({"staging_threads": "4"}, TypeError, "staging_threads"),
    ({"pool": 5}, TypeError, "pool"),
    ({"device": "gpu"}, ValueError, "gpu"),
    ({"device": -1}, ValueError, "-1"),
    ({"device": 1.5}, TypeError, "device"),
])
def test_bad_arguments(kwargs, exc, text):
    kwargs = dict(kwargs)
    kwargs.setdefault("device", DEVICE)
    with pytest.raises(exc) as info:
        pinloader.AsyncPrefetcher([np.zeros(1)], **kwargs)
    assert text in str(info.value), str(info.value)


def test_bad_output_and_priority_arguments():
    with pytest.raises(ValueError, match="output"):
        pinloader.AsyncPrefetcher([], device=DEVICE, output="tensor")
    with pytest.raises(ValueError, match="copy_stream_priority"):
        pinloader.AsyncPrefetcher([], device=DEVICE, copy_stream_priority="urgent")
    with pinloader.AsyncPrefetcher([np.arange(2)], device=DEVICE, copy_stream_priority="normal") as pf:
        (b,) = drain(pf)
        assert_leaf_equal(np.arange(2), b)
    # CUDA has no priority below its default ('normal'): 'low' would mean the same, so it is refused
    with pytest.raises(ValueError, match="copy_stream_priority='low' is not offered"):
        pinloader.AsyncPrefetcher([np.arange(2)], device=DEVICE, copy_stream_priority="low")


class _CountedKey:
    """A dict key whose repr() is user code: counted, and different on each call."""

    calls = 0

    def __hash__(self):
        return 7

    def __eq__(self, other):
        return self is other

    def __repr__(self):
        _CountedKey.calls += 1
        return f"K{_CountedKey.calls}"


class _Name(str):
    """A field name that is a str subclass: its str() is taken as the walk reaches it."""


def test_paths_name_every_step_kind_and_take_user_reprs_once_per_walk():
    # Note [lazy paths] in src/py/flatten.h: exact str and int keys, indices and exact str
    # field names are rendered only when an error (or structure mode) reads the path; any
    # other key's repr() still runs once when the walk reaches it, and the error shows that
    # text, not a later call's.
    import collections

    NT = collections.namedtuple("NT", ["image", "label"])
    bad = np.array([object()], dtype=object)
    key = _CountedKey()
    long_key = "k" * 300
    item = {"a": [0, {5: NT(np.zeros(2), {key: {long_key: bad}})}]}
    _CountedKey.calls = 0
    with pinloader.AsyncPrefetcher([{key: np.zeros(2)}], device=DEVICE) as pf:
        assert len(list(pf)) == 1
    assert _CountedKey.calls == 1  # a good item: one repr() per walk (Note [lazy paths])
    with pinloader.AsyncPrefetcher([item], device=DEVICE) as pf:
        with pytest.raises(TypeError) as info:
            next(pf)
    assert _CountedKey.calls == 2
    # a step's text is repr() cut to 159 bytes: the quote and 158 k
    want = "item['a'][1][5].label[K2]['" + "k" * 158 + "]: object arrays"
    assert str(info.value).startswith(want), str(info.value)
    # structure mode records the same paths, the text of each taken once
    fields = NT(np.zeros(1), [np.zeros(1)])
    named = type("Named", (tuple,), {"_fields": (_Name("first"),)})((np.zeros(1),))
    found, _ = pinloader._C.leaves({"x": fields, 3: named, -1: [{"y": np.zeros(1)}]}, "root")
    assert [p for p, _ in found] == ["root['x'].image", "root['x'].label[0]", "root[3].first",
                                     "root[-1][0]['y']"]
