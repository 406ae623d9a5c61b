"""Hostile leaves never crash the prefetcher (host backend; marked hostile).

Layout arithmetic is checked before anything is allocated (broadcasts whose sizes wrap, zero-size
leaves of huge shapes); a DLPack header is validated before it is read (negative or wrapping
shapes and strides, bad dtypes, ndim out of range, null data), and legal odd ones are copied
exactly; a batch's outputs are built only once its layout is fixed, so user constructors that drop
or export a direct (pinned) leaf never see a batch without memory.

Anything that could crash or hang on a bug runs in a subprocess under a timeout, with a
faulthandler watchdog inside it, so a bug fails that test instead of the suite.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

import pinloader
from helpers import RawDLPack, describe, drain, run_py

DEVICE = "cpu"

pytestmark = pytest.mark.hostile


# ---- checked layout, before anything exists ------------------------------------------------------

def test_broadcast_leaves_whose_sum_wraps_raise_naming_the_leaf():
    # Two one-byte broadcasts of 2**63 - 256 bytes each: their sum wraps a size_t once the third
    # leaf is added; an unchecked sum would make the stager write past the pinned region.
    code = """
    import numpy as np, pinloader
    b = np.broadcast_to(np.zeros((), np.uint8), (2**63 - 256,))
    items = [{"a": np.arange(4)}, (b, b, np.ones(1024, np.uint8)), {"a": np.arange(4)}]
    with pinloader.AsyncPrefetcher(items, device="cpu") as pf:
        print("FIRST", np.from_dlpack(next(pf)["a"]).tolist(), flush=True)
        try:
            next(pf)
            print("NO ERROR", flush=True)
        except BaseException as e:
            print("ERR", type(e).__name__, str(e), flush=True)
        try:
            next(pf)
        except StopIteration:
            print("FINISHED", flush=True)
    """
    p = run_py(code, timeout=60, watchdog=True)
    assert "FIRST [0, 1, 2, 3]" in p.stdout, describe(p)
    assert "ERR ValueError item[1]: shape (9223372036854775552,) is too large" in p.stdout, describe(p)
    assert "FINISHED" in p.stdout, describe(p)
    assert p.returncode == 0, describe(p)


def test_huge_zero_size_leaf_is_fine():
    z = np.empty((0, 2**40), np.float64)
    with pinloader.AsyncPrefetcher([(z, np.arange(3))], device=DEVICE) as pf:
        (b,) = drain(pf)
    assert np.from_dlpack(b[0]).shape == (0, 2**40)
    np.testing.assert_array_equal(np.from_dlpack(b[1]), np.arange(3))


# ---- DLPack headers that lie ---------------------------------------------------------------------

DLPACK_BAD = {
    # name: (RawDLPack kwargs, exception type, text in the message)
    "negative-shape": (dict(shape=[-2]), ValueError, "negative dimension"),
    "negative-among-others": (dict(shape=[3, -1, 4]), ValueError, "negative dimension"),
    "float64-wraps": (dict(shape=[2**61 + 1]), ValueError, "is too large"),
    "product-wraps": (dict(shape=[2**32, 2**32, 2]), ValueError, "is too large"),
    "ndim-negative": (dict(shape=[4], ndim=-1), ValueError, "ndim -1 is out of range"),
    "ndim-huge": (dict(shape=[4], ndim=1000), ValueError, "ndim 1000 is out of range"),
    "dtype-code": (dict(shape=[4], dtype=(99, 32, 1)), TypeError, "code 99"),
    "dtype-bits": (dict(shape=[4], dtype=(2, 12, 1)), TypeError, "bits 12"),
    "dtype-bits-zero": (dict(shape=[4], dtype=(1, 0, 1)), TypeError, "bits 0"),
    "dtype-lanes": (dict(shape=[4], dtype=(2, 32, 4)), TypeError, "lanes 4"),
    "stride-wraps": (dict(shape=[4], strides=[2**62]), ValueError, "strides is too large"),
    "stride-leaves-address-space": (dict(shape=[3], strides=[-(2**58)]), ValueError, "outside the address space"),
    "byte-offset-huge": (dict(shape=[4], byte_offset=2**64 - 8), ValueError, "byte_offset"),
    "null-data": (dict(shape=[4], data=0), ValueError, "outside the address space"),
}


@pytest.mark.parametrize("case", sorted(DLPACK_BAD))
def test_dlpack_import_is_validated_before_use(case):
    kwargs, exc, text = DLPACK_BAD[case]
    code = f"""
    import numpy as np, pinloader
    from helpers import RawDLPack
    base = np.arange(16, dtype=np.float64)
    bad = RawDLPack(base, **{kwargs!r})
    items = [{{"x": np.arange(3)}}, {{"x": bad}}]
    with pinloader.AsyncPrefetcher(items, device="cpu") as pf:
        next(pf)
        try:
            out = next(pf)
            print("NO ERROR", out, flush=True)
        except BaseException as e:
            print("ERR", type(e).__name__, str(e), flush=True)
    """
    p = run_py(code, timeout=60, watchdog=True)
    assert f"ERR {exc.__name__} item['x']: " in p.stdout, describe(p)
    assert text in p.stdout, describe(p)
    assert p.returncode == 0, describe(p)


def test_valid_odd_dlpack_round_trips():
    # Negative strides with a byte_offset to the last element, a zero-size leaf with a null
    # pointer, a 0-d leaf: all legal, and copied exactly.
    base = np.arange(12, dtype=np.float64)
    rev = RawDLPack(base, shape=[3, 4], strides=[-4, -1], byte_offset=11 * 8)
    empty = RawDLPack(base, shape=[0, 5], data=0)
    scalar = RawDLPack(base, shape=[], byte_offset=5 * 8)
    with pinloader.AsyncPrefetcher([{"r": rev, "e": empty, "s": scalar}], device=DEVICE) as pf:
        (b,) = drain(pf)
    np.testing.assert_array_equal(np.from_dlpack(b["r"]), base[::-1].reshape(3, 4))
    assert np.from_dlpack(b["e"]).shape == (0, 5)
    assert np.from_dlpack(b["s"]).shape == () and float(np.from_dlpack(b["s"])) == 5.0


# ---- outputs are made after the layout; user constructors cannot see stale views -----------------

def pinned_arrays(pool, n, size=256 << 10):
    arrays = [np.frombuffer(pool.alloc(size), dtype=np.uint8) for _ in range(n)]
    for i, a in enumerate(arrays):
        a[:] = (i * 7 + 1) % 251
    return arrays


def test_constructors_that_drop_or_export_direct_leaves():
    pool = pinloader.PinnedPool(max_bytes=32 << 20, device="cpu")
    seen = []

    def try_export(arr):
        try:
            np.from_dlpack(arr)
            seen.append("exported")
        except BufferError as e:
            seen.append(str(e))

    @dataclasses.dataclass
    class Drops:
        staged: object
        pinned: object

        def __post_init__(self):
            if isinstance(self.pinned, pinloader.DeviceArray):
                self.pinned = None  # drops the only reference to the DeviceArray

    @dataclasses.dataclass
    class Exports:
        staged: object
        pinned: object

        def __post_init__(self):
            if isinstance(self.pinned, pinloader.DeviceArray):
                try_export(self.pinned)

    class NT(collections.namedtuple("NT", ["staged", "pinned"])):
        def __new__(cls, staged, pinned):
            if not isinstance(pinned, pinloader.DeviceArray):
                return super().__new__(cls, staged, pinned)
            try_export(pinned)
            return super().__new__(cls, staged, None)  # tries to export, then drops

    pinned = pinned_arrays(pool, 3)
    staged = np.arange(1000, dtype=np.float32)
    items = [Drops(staged, pinned[0]), Exports(staged, pinned[1]), NT(staged, pinned[2])]
    with pinloader.AsyncPrefetcher(items, device=DEVICE) as pf:
        out = drain(pf)
    assert out[0].pinned is None and out[2].pinned is None
    for b in out:
        np.testing.assert_array_equal(np.from_dlpack(b.staged), staged)
    np.testing.assert_array_equal(np.from_dlpack(out[1].pinned), pinned[1])
    # the pinned leaf sits right after the staged area (1000 float32 -> 4096 bytes)
    assert out[1].pinned.ptr - out[1].staged.ptr == 4096
    # inside the constructors the batch has no memory yet: a clean refusal, not a null pointer
    assert len(seen) == 2 and all("still being prepared" in s for s in seen), seen


def test_constructor_dropping_a_direct_leaf_and_collecting_delivers_every_batch():
    # Heap-use-after-free in device_array.c under ASan before the rebuild was moved after the
    # layout; run in a subprocess so a crash fails only this test.
    code = """
    import dataclasses, gc, numpy as np, pinloader
    pool = pinloader.PinnedPool(max_bytes=32 << 20, device="cpu")
    bufs = [np.frombuffer(pool.alloc(128 << 10), dtype=np.uint8) for _ in range(8)]
    @dataclasses.dataclass
    class D:
        a: object
        p: object
        def __post_init__(self):
            if isinstance(self.p, pinloader.DeviceArray):
                self.p = None
                gc.collect()
    items = [D(np.arange(10), b) for b in bufs]
    with pinloader.AsyncPrefetcher(items, device="cpu") as pf:
        out = [np.from_dlpack(b.a).tolist() for b in pf]
    print("OK", len(out), out[0][:3], flush=True)
    """
    p = run_py(code, timeout=60, watchdog=True)
    assert "OK 8 [0, 1, 2]" in p.stdout, describe(p)
    assert p.returncode == 0, describe(p)


def test_a_dlpack_capsule_is_consumed_so_no_one_else_frees_it():
    # Note [consumed imports] in src/py/dlpack.c: an exporter that keeps the capsule it returned
    # and hands it to a second consumer could have that consumer run its deleter (and free the
    # memory) while the staging threads read it; the capsule is consumed on import now
    import gc
    import threading
    exported = threading.Event()

    class KeepsItsCapsule:
        def __init__(self):
            self.a = np.ones((256, 256), np.float32)

        def __dlpack__(self, **kw):
            self.cap = self.a.__dlpack__(**kw)
            exported.set()
            return self.cap

        def __dlpack_device__(self):
            return (1, 0)

    class Hands:
        def __init__(self, cap):
            self.cap = cap

        def __dlpack__(self, **kw):
            return self.cap

        def __dlpack_device__(self):
            return (1, 0)

    src = KeepsItsCapsule()
    with pinloader.AsyncPrefetcher([src], device="cpu", depth=1) as pf:
        assert exported.wait(10)
        with pytest.raises(ValueError):
            np.from_dlpack(Hands(src.cap))  # "used_dltensor": already consumed
        src.a = None
        gc.collect()
        assert float(np.from_dlpack(next(pf)).sum()) == 256 * 256
