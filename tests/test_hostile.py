"""Hostile input never crashes the process (host backend, device="cpu").

One test (or parametrized group) per hostile input on the prefetcher side, by theme:
checked layout arithmetic and DLPack import validation, outputs built only after the layout is
fixed, lone surrogates and BaseExceptions from user code, reference cycles through queued
batches, fork, the graveyard, close() while user code blocks inside flatten, per-prefetcher
stall counters, the prefetcher's pinned bound, one-shot sources and payload byte counts.

Anything that could crash or hang on a bug runs in a subprocess under a timeout, with a
faulthandler watchdog inside it, so a bug fails that test instead of the suite.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import gc
import os
import textwrap
import time
import warnings
import weakref

import numpy as np
import pytest

import pinloader
from helpers import WAIT_CHILD, describe, drain, run_child
from pinloader import _C

DEVICE = "cpu"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(pinloader.__file__)))
PTRDIFF_MAX = 2**63 - 1


# ---- helpers -------------------------------------------------------------------------------

def run_py(code, timeout=60, env_extra=None):
    """Run `code` in a fresh interpreter (this checkout, tests/ importable); fail, not hang."""
    env = dict(os.environ)
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join([PKG_PARENT, TESTS_DIR] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("PINLOADER_DEBUG", None)
    code = "import faulthandler; faulthandler.dump_traceback_later(%d, exit=True)\n" % (timeout - 10) + textwrap.dedent(code)
    return run_child(code, env, timeout)


def first_error(items, **kw):
    """Drain a prefetcher over items; return (batches before the error, the error)."""
    got = []
    with pinloader.AsyncPrefetcher(items, device=DEVICE, **kw) as pf:
        try:
            while True:
                got.append(next(pf))
        except StopIteration:
            return got, None
        except BaseException as e:  # noqa: B902 - KeyboardInterrupt is what some tests expect
            return got, e


def live_blocks():
    return _C._live_device_blocks("host")


def count_tasks():
    return len(os.listdir("/proc/self/task"))


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


# ---- a DLPack exporter that says whatever it is told ---------------------------------------

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DLTENSOR_NAME = ctypes.create_string_buffer(b"dltensor")


class RawDLPack:
    """A CPU DLPack exporter over `base` (a NumPy array kept alive) with any header fields.

    ndim defaults to len(shape); strides are in elements (None: C order); data defaults to
    base's address. The capsule has no destructor: this object owns the header's memory."""

    def __init__(self, base, shape, dtype=(2, 64, 1), strides=None, byte_offset=0, ndim=None,
                 data=None, device=(1, 0)):
        self.base = base
        self.device = device
        n = max(len(shape), 1)
        self._shape = (ctypes.c_int64 * n)(*shape)
        self._strides = (ctypes.c_int64 * n)(*strides) if strides is not None else None
        t = DLManagedTensor()
        t.dl_tensor.data = base.ctypes.data if data is None else data
        t.dl_tensor.device = DLDevice(1, 0)
        t.dl_tensor.ndim = len(shape) if ndim is None else ndim
        t.dl_tensor.dtype = DLDataType(*dtype)
        t.dl_tensor.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        t.dl_tensor.strides = (ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
                               if self._strides is not None else None)
        t.dl_tensor.byte_offset = byte_offset
        self._t = t

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        return _capsule_new(ctypes.addressof(self._t), _DLTENSOR_NAME, None)


# ---- checked layout, before anything exists --------------------------------------------------

def test_broadcast_leaves_whose_sum_wraps_raise_naming_the_leaf():
    # Two one-byte broadcasts of 2**63 - 256 bytes each: their sum wraps a size_t once the third
    # leaf is added; this used to segfault in the stager.
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
    p = run_py(code)
    assert "FIRST [0, 1, 2, 3]" in p.stdout, describe(p)
    assert "ERR ValueError item[1]: shape (9223372036854775552,) is too large" in p.stdout, describe(p)
    assert "FINISHED" in p.stdout, describe(p)
    assert p.returncode == 0, describe(p)


def test_one_huge_broadcast_is_refused_by_the_cap_without_allocating():
    # Fits the layout (< PTRDIFF_MAX) but never the pinned cap: PoolExhausted at its position,
    # and the prefetcher's bound is not raised past the default to try (it was raised to 2**61).
    code = """
    import numpy as np, pinloader
    b = np.broadcast_to(np.zeros((), np.uint8), (2**62,))
    pf = pinloader.AsyncPrefetcher([{"x": b}], device="cpu")
    try:
        next(pf)
    except pinloader.PoolExhausted as e:
        print("EXHAUSTED", str(e), flush=True)
    print("CAP", pf.stats()["pinned_cap"], pinloader.default_pinned_cap(), flush=True)
    pf.close()
    """
    p = run_py(code)
    assert "EXHAUSTED item 0: a batch of 4611686018427387904 bytes" in p.stdout, describe(p)
    cap, default = map(int, p.stdout.split("CAP ")[1].split())
    assert cap <= default, describe(p)


def test_private_pool_cap_saturates_at_the_default():
    # (depth + 2) x batch is more than the default cap: the cap stops at the default.
    default = pinloader.default_pinned_cap()
    n = default // 40
    b = np.broadcast_to(np.full((), 7, np.uint8), (n,))
    with pinloader.AsyncPrefetcher([{"x": b}], device=DEVICE, depth=64) as pf:
        (out,) = drain(pf)
        assert int(np.from_dlpack(out["x"])[n - 1]) == 7
        del out
        assert pf.stats()["pinned_cap"] == pinloader._C.default_pool_cap() <= default


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
    from test_hostile import RawDLPack
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
    p = run_py(code)
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


def test_huge_zero_size_leaf_is_fine():
    z = np.empty((0, 2**40), np.float64)
    with pinloader.AsyncPrefetcher([(z, np.arange(3))], device=DEVICE) as pf:
        (b,) = drain(pf)
    assert np.from_dlpack(b[0]).shape == (0, 2**40)
    np.testing.assert_array_equal(np.from_dlpack(b[1]), np.arange(3))


# ---- outputs are made after the layout; user constructors cannot see stale views -------------

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


def test_constructor_dropping_direct_leaf_under_sanitizer_subprocess():
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
    p = run_py(code)
    assert "OK 8 [0, 1, 2]" in p.stdout, describe(p)
    assert p.returncode == 0, describe(p)


# ---- items 3 and 7: surrogates and BaseExceptions from user code --------------------------------

def test_dlpack_error_with_lone_surrogate():
    code = """
    import numpy as np, pinloader
    class Bad:
        def __dlpack_device__(self):
            return (1, 0)
        def __dlpack__(self, **kw):
            raise ValueError("bad \\udcff")
    with pinloader.AsyncPrefetcher([{"x": Bad()}], device="cpu") as pf:
        try:
            next(pf)
        except TypeError as e:
            print("ERR", ascii(str(e)), type(e.__cause__).__name__, flush=True)
    """
    p = run_py(code)
    assert "item['x']: __dlpack__() failed: bad \\\\udcff\" ValueError" in p.stdout, describe(p)
    assert p.returncode == 0, describe(p)


def test_namedtuple_field_with_lone_surrogate():
    code = """
    import numpy as np, pinloader
    import collections
    class T(collections.namedtuple("T", ["ok", "bad"])):
        _fields = ("ok", "bad\\udcff")
    bad = np.array([object()], dtype=object)
    items = [T(np.arange(3), 1), T(np.arange(3), bad)]
    with pinloader.AsyncPrefetcher(items, device="cpu") as pf:
        print("FIRST", type(next(pf)).__name__, flush=True)
        try:
            next(pf)
        except SystemError as e:
            print("SYSTEMERROR", e, flush=True)
        except TypeError as e:
            print("ERR", ascii(str(e)), flush=True)
    """
    p = run_py(code)
    assert "FIRST T" in p.stdout, describe(p)
    assert "ERR 'item.bad\\\\udcff: " in p.stdout, describe(p)
    assert p.returncode == 0, describe(p)


def test_dict_key_with_lone_surrogate_in_path():
    bad = np.array([object()], dtype=object)
    _, err = first_error([{"k\udcff": {"x": bad}}])
    assert isinstance(err, TypeError) and not isinstance(err, SystemError)
    assert str(err).startswith("item['k\\udcff']['x']: "), str(err)


class Stop(BaseException):
    """A BaseException that is not an Exception, like KeyboardInterrupt and SystemExit."""


def raising_items(where, exc):
    def boom(*a, **k):
        raise exc

    class DL:
        def __dlpack_device__(self):
            if where == "__dlpack_device__":
                boom()
            return (1, 0)

        def __dlpack__(self, **kw):
            if where == "__dlpack__":
                boom()
            return np.arange(3).__dlpack__(**kw)

    @dataclasses.dataclass
    class DC:
        x: object

        def __post_init__(self):
            if where == "dataclass" and isinstance(self.x, pinloader.DeviceArray):
                boom()

    class NT(collections.namedtuple("NT", ["x"])):
        def __new__(cls, x):
            if where == "namedtuple" and isinstance(x, pinloader.DeviceArray):
                boom()
            return super().__new__(cls, x)

    class Fields(tuple):
        @property
        def _fields(self):
            boom()

    class Key:
        def __repr__(self):
            boom()

        def __hash__(self):
            return 1

    return {
        "__dlpack__": {"x": DL()},
        "__dlpack_device__": {"x": DL()},
        "dataclass": DC(np.arange(3)),
        "namedtuple": NT(np.arange(3)),
        "_fields": Fields((np.arange(3),)),
        "key-repr": {Key(): np.arange(3)},
    }[where]


RAISE_SITES = ["__dlpack__", "__dlpack_device__", "dataclass", "namedtuple", "_fields", "key-repr"]


def test_base_exceptions_from_user_code_propagate_unchanged():
    # In a subprocess: a KeyboardInterrupt that escapes would otherwise stop the whole session.
    code = """
    import numpy as np
    from test_hostile import RAISE_SITES, Stop, first_error, raising_items
    for where in RAISE_SITES:
        for exc_type in (KeyboardInterrupt, SystemExit, Stop):
            raised = exc_type("from user code")
            got, err = first_error([{"ok": np.arange(2)}, raising_items(where, raised)])
            ok = len(got) == 1 and err is raised
            print(where, exc_type.__name__, "OK" if ok else "BAD %r" % (err,), flush=True)
    print("DONE", flush=True)
    """
    p = run_py(code)
    lines = [ln for ln in p.stdout.splitlines() if ln.endswith("OK") or " BAD " in ln]
    assert "DONE" in p.stdout and len(lines) == 3 * len(RAISE_SITES), describe(p)
    assert all(ln.endswith(" OK") for ln in lines), describe(p)


@pytest.mark.parametrize("where", ["__dlpack__", "dataclass", "namedtuple", "_fields"])
def test_ordinary_exceptions_from_user_code_are_reported(where):
    raised = ZeroDivisionError("user bug")
    _, err = first_error([raising_items(where, raised)])
    assert err is raised or err.__cause__ is raised or err.__context__ is raised, repr(err)
    if err is not raised:
        assert str(err).startswith("item"), str(err)


# ---- the cycle collector sees what the prefetcher holds --------------------------------------

class Ctx:
    pass


class WeakCtxSource:
    """Items that carry a context object; the source holds it only weakly, so the queued
    batches' outputs are the only strong path from the prefetcher back to it."""

    def __init__(self, ctx, n):
        self.ctx = weakref.ref(ctx)
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"x": np.full(1000, i), "ctx": self.ctx()}


def test_cycle_through_queued_batches_is_collected():
    gc.collect()
    base_blocks = live_blocks()
    base_tasks = count_tasks()
    ctx = Ctx()
    pf = pinloader.AsyncPrefetcher(WeakCtxSource(ctx, 8), device=DEVICE, depth=3)
    ctx.pf = pf
    assert wait_for(lambda p=pf: p.stats()["queued"] >= 2)
    ref = weakref.ref(pf)
    del pf, ctx
    gc.collect()
    assert ref() is None, gc.get_referrers(ref()) if ref() is not None else None
    assert wait_for(lambda: live_blocks() == base_blocks), (live_blocks(), base_blocks)
    assert wait_for(lambda: count_tasks() <= base_tasks), (count_tasks(), base_tasks)


def test_cycle_through_source_exception_is_collected():
    gc.collect()
    base_blocks = live_blocks()

    class Boom(Exception):
        pass

    def source(holder):
        yield {"x": np.arange(10)}
        err = Boom()
        err.holder = holder  # the queued exception leads back to the prefetcher
        raise err

    holder = Ctx()
    pf = pinloader.AsyncPrefetcher(source(holder), device=DEVICE, depth=3)
    holder.pf = pf
    assert wait_for(lambda p=pf: p.stats()["queued"] >= 2)
    ref = weakref.ref(pf)
    del pf, holder
    gc.collect()
    assert ref() is None
    assert wait_for(lambda: live_blocks() == base_blocks)


# ---- fork ------------------------------------------------------------------------------------

FORK_PRELUDE = """
import os, sys, time, warnings
import numpy as np
import pinloader
warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads, 3.12+
""" + WAIT_CHILD.format(timeout=20.0, poll=0.01) + """"""


def test_inherited_prefetcher_fails_fast_everywhere():
    code = FORK_PRELUDE + """
pf = pinloader.AsyncPrefetcher([np.arange(3)] * 50, device="cpu", depth=4)
next(pf)
time.sleep(0.05)
pid = os.fork()
if pid == 0:
    bad = 0
    for name, op in [("next", lambda: next(pf)), ("iter", lambda: iter(pf)),
                     ("stats", pf.stats), ("enter", pf.__enter__)]:
        try:
            op()
            bad |= 1
        except RuntimeError as e:
            bad |= 0 if "fork" in str(e) else 2
    r = repr(pf)
    bad |= 0 if "fork" in r else 4
    pf.close()
    del pf
    import gc; gc.collect()
    os._exit(bad)
print("CHILD", wait_child(pid), flush=True)
n = 0
while True:
    try:
        next(pf)
        n += 1
    except StopIteration:
        break
print("PARENT", n, flush=True)
pf.close()
"""
    p = run_py(code)
    assert "CHILD 0" in p.stdout, describe(p)
    assert "PARENT 49" in p.stdout, describe(p)


@pytest.mark.skipif("libtsan" in os.environ.get("LD_PRELOAD", ""),
                    reason="ThreadSanitizer cannot run threads started in the child of a "
                    "multi-threaded fork() (it dies, or with die_after_fork=0 aborts on a reused "
                    "thread id); the plain and ASan runs cover this test")
def test_prefetcher_created_in_fork_child_is_not_refused_as_inherited():
    code = FORK_PRELUDE + """
with pinloader.AsyncPrefetcher([np.arange(3)], device="cpu") as pf:
    list(pf)
pid = os.fork()
if pid == 0:
    try:
        pf2 = pinloader.AsyncPrefetcher([np.arange(3), np.arange(4)], device="cpu")
    except RuntimeError as e:
        print("REFUSED", e, flush=True)
        os._exit(1)
    try:
        out = [np.from_dlpack(b).tolist() for b in pf2]
        print("CHILD OK", out, flush=True)
    except Exception as e:
        print("CHILD ERROR", type(e).__name__, e, flush=True)
    pf2.close()
    os._exit(0)
print("CHILD", wait_child(pid), flush=True)
"""
    p = run_py(code)
    assert "CHILD 0" in p.stdout, describe(p)
    assert "REFUSED" not in p.stdout, describe(p)
    if "CHILD OK [[0, 1, 2], [0, 1, 2, 3]]" not in p.stdout:
        # The prefetcher itself now works in a fork child; the pool (src/core/pool.c) still refuses
        # reserves there until it records its own fork generation.
        assert "fork" in p.stdout.lower() or "forked" in p.stdout.lower(), describe(p)
        pytest.xfail("the pinned pool still refuses work in a fork child: " + p.stdout.strip())


# ---- the graveyard, stuck user code, stall counters ------------------------------------------

class SleepyArray(np.ndarray):
    """An array whose finalizer releases the GIL: dropping a source leaf lets other threads in."""

    def __del__(self):
        time.sleep(0.0002)


def test_graves_emptied_concurrently_by_producer_and_consumer():
    # Each batch has a pinned (direct) leaf, so its owners wait in the graveyard for the copy,
    # and a staged leaf whose finalizer releases the GIL while a grave is being emptied: the
    # consumer's next() then empties graves too. A shared walk used freed graves.
    code = """
    import numpy as np, pinloader
    from test_hostile import SleepyArray
    pool = pinloader.PinnedPool(max_bytes=64 << 20, device="cpu")
    pinned = [np.frombuffer(pool.alloc(64 << 10), dtype=np.uint8) for _ in range(4)]
    for i, a in enumerate(pinned):
        a[:] = i
    def source():
        for i in range(300):
            yield (np.full(100, i).view(SleepyArray), pinned[i % 4], np.full(3, i).view(SleepyArray))
    n = 0
    with pinloader.AsyncPrefetcher(source(), device="cpu", depth=4) as pf:
        for i, b in enumerate(pf):
            assert int(np.from_dlpack(b[0])[0]) == i and int(np.from_dlpack(b[1])[0]) == i % 4
            n += 1
    print("OK", n, flush=True)
    """
    p = run_py(code, timeout=120)
    assert "OK 300" in p.stdout, describe(p)
    assert p.returncode == 0, describe(p)


@pytest.mark.parametrize("where", ["__dlpack__", "dataclass-init"])
def test_close_returns_while_user_code_blocks_inside_flatten(where):
    code = f"""
    import dataclasses, threading, time, numpy as np, pinloader
    where = {where!r}
    forever = threading.Event()
    class Blocks:
        def __dlpack_device__(self):
            return (1, 0)
        def __dlpack__(self, **kw):
            forever.wait()
    @dataclasses.dataclass
    class DC:
        x: object
        def __post_init__(self):
            if isinstance(self.x, pinloader.DeviceArray):
                forever.wait()
    stuck = {{"x": Blocks()}} if where == "__dlpack__" else DC(np.arange(3))
    pf = pinloader.AsyncPrefetcher([{{"x": np.arange(3)}}, stuck], device="cpu")
    first = next(pf)
    time.sleep(0.2)  # the producer is now blocked inside flatten, in user code
    t0 = time.monotonic()
    pf.close()
    print("CLOSED", pf.closed, flush=True)
    print("FIRST", np.from_dlpack(first["x"]).tolist(), flush=True)
    forever.set()   # let the detached producer finish and clean up
    time.sleep(0.2)
    print("EXITING", flush=True)
    """
    p = run_py(code, timeout=40)
    assert "CLOSED True" in p.stdout, f"close() did not return while user code blocks\n{describe(p)}"
    assert "FIRST [0, 1, 2]" in p.stdout, describe(p)
    assert "EXITING" in p.stdout and p.returncode == 0, describe(p)


def test_stall_counters_are_per_prefetcher_on_a_shared_pool():
    pool = pinloader.PinnedPool(max_bytes=4 << 20, device="cpu")
    held = pool.alloc(3 << 20)  # leaves 1 MiB
    big = [{"x": np.ones(2 << 20, np.uint8)}]  # can only fit once `held` is released
    a = pinloader.AsyncPrefetcher(big, device=DEVICE, pool=pool)
    try:
        time.sleep(0.1)  # A is now waiting for room
        small = [{"x": np.full(1000, i)} for i in range(40)]
        with pinloader.AsyncPrefetcher(small, device=DEVICE, pool=pool, depth=2) as b:
            got = [int(np.from_dlpack(x["x"])[0]) for x in b]
            b_stats = b.stats()
        assert got == list(range(40))
        held.release()
        out = drain(a)
        assert len(out) == 1 and int(np.from_dlpack(out[0]["x"])[0]) == 1
        a_stats = a.stats()
    finally:
        a.close()
    assert b_stats["pinned_stalls"] == 0, b_stats  # B never waited; A's waits are not B's
    assert a_stats["pinned_stalls"] == 1 and a_stats["pinned_stall_s"] > 0, a_stats


def test_close_while_waiting_on_a_shared_pool_cap():
    # The producer waits inside pl_pool_reserve on the shared pool's cap; close() sets the
    # prefetcher's stop (read by the pool without the prefetcher's mutex: an atomic).
    pool = pinloader.PinnedPool(max_bytes=2 << 20, device="cpu")
    held = pool.alloc(2 << 20)
    pf = pinloader.AsyncPrefetcher([{"x": np.ones(1 << 20, np.uint8)}], device=DEVICE, pool=pool)
    time.sleep(0.1)
    pf.close()
    assert pf.closed
    held.release()
    assert wait_for(lambda: pool.stats()["in_use_bytes"] == 0), pool.stats()


# ---- one-shot sources, payload bytes ---------------------------------------------------------

def test_second_epoch_of_exhausted_generator_warns():
    pf = pinloader.AsyncPrefetcher((np.full(3, i) for i in range(3)), device=DEVICE)
    try:
        assert len(list(pf)) == 3
        with pytest.warns(RuntimeWarning, match="one-shot iterator that is already exhausted"):
            again = list(pf)
        assert again == []
    finally:
        pf.close()


def test_second_epoch_of_reiterable_source_does_not_warn():
    pf = pinloader.AsyncPrefetcher([np.full(3, i) for i in range(3)], device=DEVICE)
    try:
        assert len(list(pf)) == 3
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(list(pf)) == 3
    finally:
        pf.close()


def test_bytes_count_payload_and_padding_apart():
    pool = pinloader.PinnedPool(max_bytes=8 << 20, device="cpu")
    pinned = np.frombuffer(pool.alloc(100_000), dtype=np.uint8)  # direct, 100000 -> 100096
    items = [(np.zeros(5, np.int8), pinned, np.zeros(3, np.float64))] * 3
    with pinloader.AsyncPrefetcher(items, device=DEVICE) as pf:
        drain(pf)
        st = pf.stats()
    assert st["bytes"] == 3 * (5 + 100_000 + 24)
    assert st["padding_bytes"] == 3 * ((256 - 5) + (100_096 - 100_000) + (256 - 24))
