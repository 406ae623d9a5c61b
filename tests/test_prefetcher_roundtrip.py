"""Property tests of AsyncPrefetcher: whatever goes in comes out, bit for bit, in the same structure.

Hypothesis draws arrays of every supported numeric dtype with 0-4 dimensions (sizes 0 and 1
included), views them through random slicing (steps, negative steps) and transposes, nests them
in dicts, lists and tuples with non-array leaves mixed in, pushes batches of them through an
AsyncPrefetcher on the host backend and checks that every DeviceArray read back with
np.from_dlpack equals its source array (shape, dtype, bytes) and every other leaf is the very
same object.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pinloader
from helpers import CapsuleWrapper

DEVICE = "cpu"


DTYPES = [
    np.dtype(t) for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
        np.float16, np.float32, np.float64, np.complex64, np.complex128,
    )
]

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def strided_views(draw):
    """An array of a random dtype and shape, seen through random slices and a transpose."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6))
    order = draw(st.sampled_from("CF"))
    base = draw(hnp.arrays(dtype, shape))
    if order == "F":
        base = np.asfortranarray(base)
    view = base
    if view.ndim:
        slices = []
        for n in view.shape:
            step = draw(st.sampled_from([1, 1, 2, 3, -1, -2]))
            start = draw(st.none() | st.integers(0, max(n - 1, 0)))
            stop = draw(st.none() | st.integers(0, n))
            slices.append(slice(start, stop, step))
        view = view[tuple(slices)]
        if draw(st.booleans()):
            perm = draw(st.permutations(range(view.ndim)))
            view = view.transpose(perm)
    return view


PASS_THROUGH = st.one_of(
    st.none(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5), st.binary(max_size=5),
    st.booleans(),
)

LEAVES = st.one_of(strided_views(), strided_views(), PASS_THROUGH)

KEYS = st.one_of(st.text(min_size=1, max_size=6), st.integers(-5, 5))


def trees(max_leaves=12):
    return st.recursive(
        LEAVES,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
            st.dictionaries(KEYS, children, max_size=4),
        ),
        max_leaves=max_leaves,
    )


def check_tree(expected, actual, where="item"):
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, pinloader.DeviceArray), f"{where}: {type(actual)!r}"
        assert actual.shape == expected.shape, where
        assert actual.dtype == expected.dtype, where
        assert actual.nbytes == expected.nbytes, where
        got = np.from_dlpack(actual)
        assert got.shape == expected.shape, where
        assert got.dtype == expected.dtype, where
        assert got.tobytes() == expected.tobytes(), f"{where}: values differ"
        return
    if isinstance(expected, dict):
        assert type(actual) is dict, where
        assert list(actual) == list(expected), where
        for k in expected:
            check_tree(expected[k], actual[k], f"{where}[{k!r}]")
        return
    if isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), where
        assert len(actual) == len(expected), where
        for i, (e, a) in enumerate(zip(expected, actual)):
            check_tree(e, a, f"{where}[{i}]")
        return
    assert actual is expected, f"{where}: {actual!r} is not {expected!r}"


@SETTINGS
@given(arr=strided_views())
def test_single_array_roundtrip(arr):
    with pinloader.AsyncPrefetcher([arr], device=DEVICE) as pf:
        out = next(pf)
        with pytest.raises(StopIteration):
            next(pf)
    check_tree(arr, out)


@SETTINGS
@given(items=st.lists(trees(), min_size=1, max_size=4), depth=st.integers(1, 4))
def test_nested_batches_roundtrip(items, depth):
    with pinloader.AsyncPrefetcher(items, device=DEVICE, depth=depth) as pf:
        out = []
        while True:
            try:
                out.append(next(pf))
            except StopIteration:
                break
    assert len(out) == len(items)
    for i, (exp, got) in enumerate(zip(items, out)):
        check_tree(exp, got, f"batch {i}: item")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(trees(max_leaves=6), min_size=1, max_size=6))
def test_roundtrip_over_two_epochs_and_capsules(items):
    # Re-iterating gives the same values again; capsule mode gives the same bytes as array mode.
    with pinloader.AsyncPrefetcher(items, device=DEVICE, depth=2) as pf:
        for _ in range(2):
            out = list(pf)
            assert len(out) == len(items)
            for exp, got in zip(items, out):
                check_tree(exp, got)

    def check_caps(expected, actual):
        if isinstance(expected, np.ndarray):
            assert type(actual).__name__ == "PyCapsule"
            got = np.from_dlpack(CapsuleWrapper(actual))
            assert got.shape == expected.shape and got.dtype == expected.dtype
            assert got.tobytes() == expected.tobytes()
        elif isinstance(expected, dict):
            for k in expected:
                check_caps(expected[k], actual[k])
        elif isinstance(expected, (list, tuple)):
            assert type(actual) is type(expected)
            for e, a in zip(expected, actual):
                check_caps(e, a)
        else:
            assert actual is expected

    with pinloader.AsyncPrefetcher(items, device=DEVICE, output="capsule") as pf:
        out = list(pf)
    assert len(out) == len(items)
    for exp, got in zip(items, out):
        check_caps(exp, got)
