"""Hostile user code never crashes the prefetcher (host backend; marked hostile).

User code runs inside the prefetcher: a source's next(), __dlpack__ and __dlpack_device__, the
constructors of containers (namedtuple, dataclass) and the repr of dict keys. Lone surrogates in
what it says are reported without a SystemError; its BaseExceptions (KeyboardInterrupt,
SystemExit) come out unchanged and its ordinary exceptions at the item's position; close()
returns while it blocks; re-entering the prefetcher from the producer thread is a clean error,
not a wait on itself; finalizers that release the GIL while the graveyard is emptied break
nothing.

Anything that could crash or hang on a bug runs in a subprocess under a timeout, with a
faulthandler watchdog inside it, so a bug fails that test instead of the suite.
"""
from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np
import pytest

import pinloader
from helpers import describe, run_py

DEVICE = "cpu"

pytestmark = pytest.mark.hostile


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


# ---- lone surrogates -----------------------------------------------------------------------------

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
    p = run_py(code, timeout=60, watchdog=True)
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
    p = run_py(code, timeout=60, watchdog=True)
    assert "FIRST T" in p.stdout, describe(p)
    assert "ERR 'item.bad\\\\udcff: " in p.stdout, describe(p)
    assert p.returncode == 0, describe(p)


def test_dict_key_with_lone_surrogate_in_path():
    bad = np.array([object()], dtype=object)
    _, err = first_error([{"k\udcff": {"x": bad}}])
    assert isinstance(err, TypeError) and not isinstance(err, SystemError)
    assert str(err).startswith("item['k\\udcff']['x']: "), str(err)


# ---- exceptions from user code -------------------------------------------------------------------

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
    from test_prefetcher_hostile_user_code import RAISE_SITES, Stop, first_error, raising_items
    for where in RAISE_SITES:
        for exc_type in (KeyboardInterrupt, SystemExit, Stop):
            raised = exc_type("from user code")
            got, err = first_error([{"ok": np.arange(2)}, raising_items(where, raised)])
            ok = len(got) == 1 and err is raised
            print(where, exc_type.__name__, "OK" if ok else "BAD %r" % (err,), flush=True)
    print("DONE", flush=True)
    """
    p = run_py(code, timeout=60, watchdog=True)
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


# ---- user code that blocks, or re-enters the prefetcher from its producer thread -----------------

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
    p = run_py(code, timeout=40, watchdog=True)
    assert "CLOSED True" in p.stdout, f"close() did not return while user code blocks\n{describe(p)}"
    assert "FIRST [0, 1, 2]" in p.stdout, describe(p)
    assert "EXITING" in p.stdout and p.returncode == 0, describe(p)


REENTRY = """
import collections, dataclasses, sys, numpy as np, pinloader
from pinloader import _C
from helpers import CapsuleWrapper
holder = {}

def poke(mode, leaf):
    pf = holder["pf"]
    try:
        if mode == "next": next(pf)
        elif mode == "iter": iter(pf)
        elif mode == "stats": pf.stats()
        elif mode == "export":
            caps = _C.export_capsules([leaf], None)
            np.from_dlpack(CapsuleWrapper(caps[0])).sum()  # a null data pointer crashes here
        elif mode == "dlpack": np.from_dlpack(leaf)
        return "returned"
    except Exception as e:
        return f"{type(e).__name__}: {e}"

class NT(collections.namedtuple("NT", ["a"])):
    def __new__(cls, a):
        if isinstance(a, pinloader.DeviceArray):
            holder["seen"].append(poke(holder["mode"], a))
        return super().__new__(cls, a)

@dataclasses.dataclass
class DC:
    a: object
    def __post_init__(self):
        if isinstance(self.a, pinloader.DeviceArray):
            holder["seen"].append(poke(holder["mode"], self.a))

class Leaf:  # a CPU DLPack exporter whose __dlpack__ re-enters
    def __init__(self):
        self.x = np.arange(4.0)
    def __dlpack_device__(self):
        return (1, 0)
    def __dlpack__(self, **kw):
        holder["seen"].append(poke(holder["mode"], None))
        return self.x.__dlpack__(**kw)

def gen():  # a source whose next() re-enters
    for _ in range(3):
        holder["seen"].append(poke(holder["mode"], None))
        yield np.arange(4)

for kind in ("nt", "dc", "dlpack", "source"):
    for mode in ("next", "iter", "stats", "export", "dlpack"):
        if kind in ("dlpack", "source") and mode in ("export", "dlpack"):
            continue
        holder.update(mode=mode, seen=[])
        if kind == "source":
            src = gen()
        else:
            make = {"nt": lambda: NT(np.arange(4)), "dc": lambda: DC(np.arange(4)), "dlpack": Leaf}[kind]
            src = [tuple.__new__(NT, (np.arange(4),)) if kind == "nt" else make() for _ in range(3)]
        pf = holder["pf"] = pinloader.AsyncPrefetcher(src, device="cpu")
        try:
            n = len([b for b in pf])
        except Exception as e:
            n = f"{type(e).__name__}: {e}"
        pf.close()
        print("RESULT", kind, mode, n, "|", holder["seen"][0] if holder["seen"] else None, flush=True)
"""


def test_user_code_on_the_producer_thread_reentering_gets_clean_errors():
    p = run_py(REENTRY, timeout=90, watchdog=True)
    assert p.returncode == 0, describe(p)
    res = {}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            kind, mode, rest = line.split(" ", 3)[1:]
            res[kind, mode] = rest
    assert len(res) == 16, describe(p)
    for (kind, mode), rest in res.items():
        n, seen = rest.split(" | ", 1)
        if mode in ("next", "iter"):
            # refused, not a wait on itself (next) or an epoch restarted per item (iter)
            assert seen.startswith(f"RuntimeError: AsyncPrefetcher: {mode}() was called on the "
                                   "prefetcher's own producer thread"), (kind, mode, rest)
        elif mode == "stats":
            assert seen == "returned" and n == "3", (kind, mode, rest)
        else:  # export_capsules and __dlpack__ of the batch being built: the same refusal
            assert seen.startswith("BufferError: ") and "still being prepared" in seen, (kind, mode, rest)
            assert n == "3", (kind, mode, rest)
    assert res["nt", "export"].split(" | ")[1].startswith("BufferError: export_capsules: leaves[0]: ")


# ---- finalizers that release the GIL -------------------------------------------------------------

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
    from test_prefetcher_hostile_user_code import SleepyArray
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
    p = run_py(code, timeout=120, watchdog=True)
    assert "OK 300" in p.stdout, describe(p)
    assert p.returncode == 0, describe(p)


# ---- a Ctrl-C while a batch is handed out loses no batch (Note [interrupted handout]) -----------

def test_ctrl_c_in_convert_hands_the_same_batch_out_again():
    # before: the batch was freed with the KeyboardInterrupt and never handed out
    calls = []

    def convert(x):
        calls.append(int(np.from_dlpack(x)[0]))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return x

    pf = pinloader.AsyncPrefetcher([np.full(4, i) for i in range(5)], device="cpu", depth=2,
                                   convert=convert)
    got, kis = [], 0
    while True:
        try:
            got.append(int(np.from_dlpack(next(pf))[0]))
        except KeyboardInterrupt:
            kis += 1
        except StopIteration:
            break
    assert kis == 1 and got == [0, 1, 2, 3, 4]
    assert calls == [0, 1, 1, 2, 3, 4]  # batch 1 converted again
    assert pf.stats()["batches"] == 5
    pf.close()


@pytest.mark.parametrize("how", ["static", "torch", "plain"])
def test_ctrl_c_during_the_handout_loses_no_batch(how):
    # A Ctrl-C that lands during C code that does not look for signals (the static copy) was
    # raised by CPython as next() returned, dropping the batch it had just handed out. The test
    # switch raises the signal from C at the end of one handout, where such a signal would be
    # found: next() raises KeyboardInterrupt, and the next next() gives that same batch.
    import signal
    src = np.repeat(np.arange(48, dtype=np.float32)[:, None], 1024, axis=1)
    L = pinloader.ArrayLoader(src, 4, device="cpu", shuffle=False, depth=2,
                              **({"static": True} if how == "static" else {}))
    if how == "torch":
        pt = pytest.importorskip("pinloader.torch")
        it = iter(pt.prefetch(L, device="cpu"))
    else:
        it = iter(L)
    got = [int(np.from_dlpack(next(it))[0, 0])]
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for _ in range(2):
            pinloader._C._testing.debug_signal_after_handout(signal.SIGINT)
            with pytest.raises(KeyboardInterrupt):
                next(it)
            got.append(int(np.from_dlpack(next(it))[0, 0]))  # the batch the signal interrupted
    finally:
        pinloader._C._testing.debug_signal_after_handout(0)
        signal.signal(signal.SIGINT, old)
    while True:  # next(), not a for loop: iter() on an ArrayLoader starts an epoch
        try:
            got.append(int(np.from_dlpack(next(it))[0, 0]))
        except StopIteration:
            break
    assert got == list(range(0, 48, 4))
    assert L.state_dict()["epoch"] == 1 and L.state_dict()["position"] == 0
    L.close()


def test_close_and_ctrl_c_in_convert_leaks_no_block():
    # convert closes the prefetcher, then is interrupted: the batch is freed, not put back on
    # the queue of a closed prefetcher (which nothing frees any more)
    from helpers import live_blocks
    before = live_blocks()
    holder = {}

    def convert(x):
        holder["pf"].close()
        raise KeyboardInterrupt

    for _ in range(3):
        pf = pinloader.AsyncPrefetcher([np.ones((3, 4), np.float32)] * 6, device="cpu", convert=convert)
        holder["pf"] = pf
        with pytest.raises(KeyboardInterrupt):
            next(pf)
        holder.clear()
        del pf
    import gc
    gc.collect()
    assert live_blocks()[0] <= before[0]


@pytest.mark.parametrize("where", ["convert", "namedtuple"])
def test_stop_iteration_from_user_code_is_an_error_not_the_end(where):
    # a StopIteration raised by user code as a batch is made or handed out ended the loop
    # silently, losing the epoch's other batches; it is a RuntimeError now (as PEP 479 makes it
    # for generators), the StopIteration its cause
    calls = {"n": 0}
    opts = {}
    if where == "convert":
        def convert(x):
            calls["n"] += 1
            if calls["n"] == 3:
                raise StopIteration
            return x
        opts["convert"] = convert
        src = [(np.full(4, i, np.float32),) for i in range(10)]
    else:
        class NT(collections.namedtuple("NT", "x")):
            def __new__(cls, *a):
                calls["n"] += 1
                if calls.get("armed") and calls["n"] == 4:
                    raise StopIteration
                return super().__new__(cls, *a)
        src = [NT(np.full(4, i, np.float32)) for i in range(10)]
        calls["n"], calls["armed"] = 0, True
    pf = pinloader.AsyncPrefetcher(src, device="cpu", **opts)
    got = []
    with pytest.raises(RuntimeError, match="raised StopIteration") as info:
        for b in pf:
            got.append(float(np.from_dlpack(b[0])[0]))
    assert isinstance(info.value.__cause__, StopIteration)
    assert len(got) < 10
    pf.close()
