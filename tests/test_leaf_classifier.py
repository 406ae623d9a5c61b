"""One classifier of what a leaf is (Note [one leaf classifier] in src/py/flatten.c): the per-item
walk (AsyncPrefetcher over items) and structure mode (``pinloader._C.leaves`` and
``AsyncPrefetcher(structure=)``, which ArrayLoader uses) agree on every container kind and every
leaf kind, and every container comes back with its own type."""
from __future__ import annotations

import array
import collections
import dataclasses

import numpy as np
import pytest

import pinloader
from helpers import assert_leaf_equal, drain
from pinloader import _C

DEVICE = "cpu"

NT = collections.namedtuple("NT", "a b")


class TupleSub(tuple):
    """A tuple subclass that is not a namedtuple: rebuilt as TupleSub(items)."""


class ListSub(list):
    """A list subclass: rebuilt as ListSub(items)."""


@dataclasses.dataclass
class DC:
    a: object
    b: object


@dataclasses.dataclass(frozen=True)
class FrozenDC:
    a: object
    b: object


class DLOnly:
    """Exports DLPack (both methods): an array leaf."""

    def __init__(self, arr):
        self.arr = arr

    def __dlpack__(self, **kwargs):
        return self.arr.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (1, 0)


class HalfDL:
    """Has __dlpack__ but no __dlpack_device__: not a DLPack exporter, so it passes through."""

    def __dlpack__(self, **kwargs):
        raise AssertionError("never called")


class Plain:
    pass


# container kind -> (make from two children, children back out of a container)
CONTAINERS = {
    "tuple": (lambda a, b: (a, b), lambda c: list(c)),
    "list": (lambda a, b: [a, b], lambda c: list(c)),
    "dict": (lambda a, b: {"a": a, "b": b}, lambda c: [c["a"], c["b"]]),
    "OrderedDict": (lambda a, b: collections.OrderedDict(b=b, a=a), lambda c: [c["a"], c["b"]]),
    "defaultdict": (lambda a, b: collections.defaultdict(list, a=a, b=b), lambda c: [c["a"], c["b"]]),
    "namedtuple": (lambda a, b: NT(a, b), lambda c: [c.a, c.b]),
    "tuple subclass": (lambda a, b: TupleSub((a, b)), lambda c: list(c)),
    "list subclass": (lambda a, b: ListSub([a, b]), lambda c: list(c)),
    "dataclass": (lambda a, b: DC(a, b), lambda c: [c.a, c.b]),
    "frozen dataclass": (lambda a, b: FrozenDC(a, b), lambda c: [c.a, c.b]),
}

# leaf kind -> (make, is an array leaf)
LEAVES = {
    "ndarray": (lambda: np.arange(6, dtype=np.float32).reshape(2, 3), True),
    "0-d ndarray": (lambda: np.array(2.5), True),
    "bytearray": (lambda: bytearray(b"abcd"), True),
    "memoryview": (lambda: memoryview(np.arange(4, dtype=np.int16)), True),
    "array.array": (lambda: array.array("i", [1, 2, 3]), True),
    "DLPack exporter": (lambda: DLOnly(np.arange(5, dtype=np.int32)), True),
    "np.float32": (lambda: np.float32(1.5), False),
    "np.int64": (lambda: np.int64(-7), False),
    "np.bool_": (lambda: np.bool_(True), False),
    "int": (lambda: 3, False),
    "float": (lambda: 2.5, False),
    "bool": (lambda: True, False),
    "complex": (lambda: 1 + 2j, False),
    "str": (lambda: "text", False),
    "bytes": (lambda: b"xy", False),
    "None": (lambda: None, False),
    "__dlpack__ only": (HalfDL, False),
    "object": (Plain, False),
}


def as_array(leaf):
    return np.from_dlpack(leaf.arr) if isinstance(leaf, DLOnly) else np.asarray(leaf)


@pytest.mark.parametrize("leaf_kind", list(LEAVES))
@pytest.mark.parametrize("container", list(CONTAINERS))
def test_both_walks_classify_and_rebuild_alike(container, leaf_kind):
    make, children = CONTAINERS[container]
    make_leaf, is_array = LEAVES[leaf_kind]
    leaf, other = make_leaf(), np.arange(3, dtype=np.int64)  # `other` keeps structure= non-empty
    item = make(leaf, other)

    found, passed = _C.leaves(item, "item")
    assert any(obj is leaf for _, obj in (found if is_array else passed)), (found, passed)
    assert not any(obj is leaf for _, obj in (passed if is_array else found)), (found, passed)

    with pinloader.AsyncPrefetcher([item], device=DEVICE) as pf:
        (walked,) = drain(pf)
    with pinloader.AsyncPrefetcher([tuple(obj for _, obj in found)], device=DEVICE,
                                   structure=item) as pf:
        (placed,) = drain(pf)

    for mode, got in (("walk", walked), ("structure", placed)):
        assert type(got) is type(item), mode
        if isinstance(item, collections.defaultdict):
            assert got.default_factory is list, mode
        if isinstance(item, dict):
            assert list(got) == list(item), mode  # key order kept
        g_leaf, g_other = children(got)
        assert_leaf_equal(other, g_other, f"{mode}: other")
        if is_array:
            assert_leaf_equal(as_array(leaf), g_leaf, f"{mode}: leaf")
        else:
            assert g_leaf is leaf, f"{mode}: {g_leaf!r} was not passed through"


def test_a_failing_rebuild_names_the_container_and_chains_the_cause():
    class Pairs(tuple):
        def __new__(cls, *items):  # not tuple's signature: Pairs(items) gets one argument
            if len(items) != 2:
                raise ValueError("Pairs wants two items")
            return super().__new__(cls, items)

    item = {"x": [np.arange(2), NT(a=0, b=Pairs(np.arange(3), 1))]}
    with pinloader.AsyncPrefetcher([item], device=DEVICE) as pf:
        with pytest.raises(TypeError, match=r"item\['x'\]\[1\]\.b: cannot rebuild the .*Pairs") as info:
            next(pf)
    assert isinstance(info.value.__cause__, ValueError)
    assert "Pairs wants two items" in str(info.value)
    # structure mode names it the same way
    found, _ = _C.leaves(item, "item")
    with pinloader.AsyncPrefetcher([tuple(leaf for _, leaf in found)], device=DEVICE,
                                   structure=item) as pf:
        with pytest.raises(TypeError, match=r"item\['x'\]\[1\]\.b: cannot rebuild the .*Pairs"):
            next(pf)
