"""Helpers shared by the test modules (fixtures live in conftest.py).

* Paths and sizes: ROOT (the repository), TESTS_DIR, PKG_PARENT (where the pinloader under test
  lives), KiB, MiB, ALIGN (the 256-byte alignment of every leaf and region).
* Child interpreters: ``run_py`` (the one way to run Python code in a fresh interpreter),
  ``child_env`` (its environment, for a Popen or a torchrun of one's own), ``run_child``,
  ``describe`` (for assertion messages) and ``WAIT_CHILD`` (the parent's side of a fork test,
  pasted into the child's code).
* Benchmarks: ``bench_module`` (a benchmarks/ script imported in the test's process).
* Waiting and counting: ``wait_for``, ``count_tasks``, ``count_fds``, ``live_blocks``,
  ``warm_up``.
* Batches: ``drain``, ``val``, ``values``, ``good`` / ``check_good``, ``assert_leaf_equal``,
  ``CapsuleWrapper``.
* DLPack by hand: the DLPack ABI as ctypes structures, ``capsule_new`` and ``RawDLPack`` (an
  exporter whose header says whatever it is told).
* Pools: ``pool_stats`` (stats, with the invariants every pool keeps checked).
* ArrayLoader: the Python reference of the epoch permutation (``ref_permutation``,
  ``ref_order``, ``RefStream``) and ``collect``, ``ids``, ``sample``.
"""
from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

import pinloader
from pinloader import _C

# ---- paths and sizes ---------------------------------------------------------------------------

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
# Where the pinloader package under test lives (the checkout, or site-packages when the sdist's
# tests run against the installed package), for the child interpreters.
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(pinloader.__file__)))

KiB = 1 << 10
MiB = 1 << 20
ALIGN = 256

# ---- child interpreters ------------------------------------------------------------------------

# Settings that change what pinloader does: a child starts without them unless the test sets
# them (env_extra).
CHILD_ENV_REMOVED = ("PINLOADER_DEBUG", "LOCAL_WORLD_SIZE")


def child_env(env_extra=None, env_remove=()):
    """The environment of a child interpreter that imports the pinloader under test, with tests/
    importable: this process's environment without CHILD_ENV_REMOVED and `env_remove`, plus
    `env_extra`. Under ThreadSanitizer, PL_TEST_CHILD_THREADS=0 tells the fork tests' children to
    skip the part that starts threads (ThreadSanitizer cannot follow a thread started in the
    child of a multi-threaded fork: it dies, or with die_after_fork=0 fails a CHECK on reused
    thread ids)."""
    env = dict(os.environ)
    for name in CHILD_ENV_REMOVED + tuple(env_remove):
        env.pop(name, None)
    if "TSAN_OPTIONS" in env:
        env["PL_TEST_CHILD_THREADS"] = "0"
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join([PKG_PARENT, TESTS_DIR] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_child(code, env, timeout, cwd=None, argv=()):
    """Run `code` (dedented) in a fresh interpreter with `env` and the arguments `argv`; fail
    the test (not hang) past `timeout`."""
    import pytest

    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *argv],
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"subprocess still running after {timeout}s (hang)\nstdout:\n{out}\n"
                    f"stderr:\n{err[-4000:]}")


def run_py(code, *, timeout, env_extra=None, env_remove=(), watchdog=False, argv=()):
    """Run `code` (dedented) in a fresh interpreter, in the repository root, with
    child_env(env_extra, env_remove) and the arguments `argv`; fail the test (not hang) past
    `timeout` seconds.

    With `watchdog`, a faulthandler timer in the child dumps its stacks and exits 10 s before
    that. Not for a child that forks and lets its forked child leave through sys.exit(): CPython
    then waits in the forked child for the watchdog's thread, which does not exist there."""
    if watchdog:
        code = ("import faulthandler; faulthandler.dump_traceback_later(%d, exit=True)\n"
                % (timeout - 10) + textwrap.dedent(code))
    return run_child(code, child_env(env_extra, env_remove), timeout, cwd=ROOT, argv=argv)


def describe(p):
    """A child interpreter's exit status and output, for assertion messages."""
    return f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-6000:]}"


# The parent's side of the fork tests: wait for a child, kill it (and say "HANG") past timeout.
# Before the kill, a hung child's threads are written to stderr (which describe() shows): each
# thread's kernel state, and its native stack where gdb is installed, so that a hang seen once
# in CI says where it was.
WAIT_CHILD = '''
def dump_hung_child(pid):
    import glob, shutil, subprocess
    sys.stderr.write(f"---- child {{pid}} hung; its threads:\\n")
    for task in sorted(glob.glob(f"/proc/{{pid}}/task/*")):
        fields = []
        for name in ("comm", "wchan", "syscall"):
            try:
                with open(f"{{task}}/{{name}}") as f:
                    fields.append(f"{{name}}={{f.read().strip()}}")
            except OSError:
                pass
        sys.stderr.write(f"  {{task.rsplit('/', 1)[1]}}: {{' '.join(fields)}}\\n")
    if shutil.which("gdb"):
        try:
            out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt"],
                                 capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError) as e:
            out = f"gdb failed: {{e}}"
        sys.stderr.write(out[-20000:] + "\\n")
    sys.stderr.flush()

def wait_child(pid, timeout={timeout}):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep({poll})
    dump_hung_child(pid)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "HANG"
'''

def bench_module(name):
    """benchmarks/<name>.py imported in this process (benchmarks/ is not a package). sys.path is
    put back as it was: some of them add their own folder too."""
    import importlib
    saved = list(sys.path)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


# ---- waiting and counting ----------------------------------------------------------------------


def wait_for(cond, timeout=10.0, step=0.01):
    """Poll `cond` until it is true or `timeout` seconds have passed; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def count_tasks():
    """The threads of this process."""
    return len(os.listdir("/proc/self/task"))


def count_fds():
    """The open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def live_blocks():
    """(count, bytes) of the host backend's live device blocks."""
    return _C._testing.live_device_blocks("host")


def warm_up():
    """Create the process-wide host 'release stream' thread (made once, never destroyed: see
    Note [device lifetime] in src/core/block.c) so that thread counts can be compared afterwards."""
    with pinloader.AsyncPrefetcher([np.zeros(4)] * 3, device="cpu") as pf:
        batches = drain(pf)
    del batches
    gc.collect()


# ---- batches -----------------------------------------------------------------------------------


def drain(pf):
    """next() until StopIteration, without calling iter() (which would start a new epoch)."""
    out = []
    while True:
        try:
            out.append(next(pf))
        except StopIteration:
            return out


def val(leaf):
    """The host array a leaf shows (np.from_dlpack: a view, no copy)."""
    return np.from_dlpack(leaf)


def values(leaf):
    """A copy of the host array a leaf shows."""
    return np.from_dlpack(leaf).copy()


def good(i):
    """The i-th well-formed item: an int, a (4, 3) int64 array of i and a tag."""
    return {"i": i, "x": np.full((4, 3), i, dtype=np.int64), "tag": f"b{i}"}


def check_good(b, i):
    """`b` is the batch made from good(i)."""
    assert b["i"] == i
    assert b["tag"] == f"b{i}"
    x = val(b["x"])
    assert x.shape == (4, 3) and (x == i).all()


def assert_leaf_equal(expected, leaf, where="item"):
    """leaf is the DeviceArray delivered for the array-like `expected`: same shape, dtype, bytes."""
    exp = np.asarray(expected)
    assert isinstance(leaf, pinloader.DeviceArray), f"{where}: got {type(leaf)!r}, expected DeviceArray"
    assert leaf.shape == exp.shape, where
    assert leaf.ndim == exp.ndim, where
    assert leaf.dtype == exp.dtype, where
    assert leaf.nbytes == exp.nbytes, where
    assert leaf.device == "cpu", where
    assert leaf.__dlpack_device__() == (1, 0), where
    if exp.size:
        assert leaf.ptr % ALIGN == 0, f"{where}: leaf not {ALIGN}-byte aligned"
    got = np.from_dlpack(leaf)
    assert got.shape == exp.shape, where
    assert got.dtype == exp.dtype, where
    # bit-exact: a copy must preserve NaN payloads, -0.0, every byte
    assert got.tobytes() == exp.tobytes(), f"{where}: values differ"


class CapsuleWrapper:
    """np.from_dlpack only takes objects with __dlpack__: wrap a raw (CPU) capsule in one."""

    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, **kwargs):
        return self.cap

    def __dlpack_device__(self):
        return (1, 0)


# ---- DLPack by hand (the 64-bit ABI) -----------------------------------------------------------


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


assert ctypes.sizeof(DLTensor) == 48 and ctypes.sizeof(DLManagedTensor) == 64
assert ctypes.sizeof(DLManagedTensorVersioned) == 80

capsule_new = ctypes.pythonapi.PyCapsule_New
capsule_new.restype = ctypes.py_object
capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# A capsule's name must outlive the capsule: a module constant.
DLTENSOR_NAME = ctypes.create_string_buffer(b"dltensor")


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
        t.dl_tensor.shape = ctypes.addressof(self._shape)
        t.dl_tensor.strides = ctypes.addressof(self._strides) if self._strides is not None else None
        t.dl_tensor.byte_offset = byte_offset
        self._t = t

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        return capsule_new(ctypes.addressof(self._t), DLTENSOR_NAME, None)


# ---- pools -------------------------------------------------------------------------------------


def pool_stats(pool):
    """pool.stats(), with the invariants of every pool checked: reserved <= cap, in use <= reserved."""
    s = pool.stats()
    assert s["reserved_bytes"] <= s["max_bytes"], s
    assert s["in_use_bytes"] <= s["reserved_bytes"], s
    return s


# ---- ArrayLoader: the Python reference of Note [epoch permutation] (src/py/epoch_table.c) ------

M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def _mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class RefStream:
    def __init__(self, seed, epoch):
        self.s = _mix(seed & M64) ^ _mix((epoch + GAMMA) & M64)

    def next(self):
        self.s = (self.s + GAMMA) & M64
        return _mix(self.s)

    def below(self, n):
        m = self.next() * n
        if (m & M64) < n:
            t = ((1 << 64) - n) % n
            while (m & M64) < t:
                m = self.next() * n
        return m >> 64


def ref_permutation(n, seed, epoch, phase_range=0):
    r = RefStream(seed, epoch)
    phase = r.below(phase_range + 1)
    p = list(range(n))
    for i in range(n - 1, 0, -1):
        j = r.below(i + 1)
        p[i], p[j] = p[j], p[i]
    return phase, p


def ref_order(n_rows, batch_size, seed, epoch, rank=0, world=1, shuffle=True, drop_last=False, window=None):
    """The item order ArrayLoader documents, built from the reference generator."""
    n = n_rows if window is None else n_rows // window
    spare = 0 if window is None else n_rows - n * window
    phase, perm = ref_permutation(n, seed, epoch, spare) if shuffle else (0, list(range(n)))
    per = n // world if drop_last else -(-n // world)
    total = per * world
    if total <= n:
        perm = perm[:total]
    else:
        perm = [perm[i % n] for i in range(total)] if n else []
    mine = perm[rank::world]
    return [phase + i * window for i in mine] if window is not None else mine


def collect(loader):
    """Every batch of one epoch of `loader`, as host copies in the batch's structure."""
    return [{k: np.from_dlpack(v).copy() for k, v in b.items()} if isinstance(b, dict)
            else tuple(np.from_dlpack(v).copy() for v in b) if isinstance(b, tuple)
            else np.from_dlpack(b).copy() for b in loader]


def ids(n):
    """Row ids 0 .. n-1 (int64): a leaf that names each batch's rows."""
    return np.arange(n, dtype=np.int64)


def sample(shape, dtype, seed=0):
    """A seeded array of small values (0..249) of `shape` and `dtype`, complex included."""
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 250, size=shape)
    if np.dtype(dtype).kind == "c":
        return (v + 1j * rng.integers(0, 250, size=shape)).astype(dtype)
    return v.astype(dtype)


def map_leaves(obj, fn):
    """obj rebuilt with every object that is not a container replaced by fn(object): the
    containers the prefetcher rebuilds (dataclasses from their init fields, dicts and dict
    subclasses from a shallow copy, namedtuples, lists, tuples and their subclasses), with
    their types (Note [one leaf classifier] in src/py/flatten.c)."""
    import copy
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return type(obj)(**{f.name: map_leaves(getattr(obj, f.name), fn)
                            for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k in obj:
            out[k] = map_leaves(obj[k], fn)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*[map_leaves(v, fn) for v in obj])
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_leaves(v, fn) for v in obj)
    return fn(obj)


def run_c_check(tmp_path, check, core_sources, link_flags=(), cflags=()):
    """Build tests/<check> against src/core/<core_sources> (with ASan and UBSan where the compiler
    has them; `cflags` before the sources) and run it: it must print "bad=0" and exit 0. Skips
    without a C compiler."""
    import shutil

    import pytest

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    core = os.path.join(root, "src", "core")
    exe = tmp_path / os.path.splitext(check)[0]
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # the sanitizer jobs preload their runtime into Python only
    cmd = ([cc, "-std=gnu11", "-O1", "-fsanitize=address,undefined", "-I", core, *cflags,
            os.path.join(root, "tests", check)]
           + [os.path.join(core, f) for f in core_sources] + ["-o", str(exe), "-lpthread", *link_flags])
    if subprocess.run(cmd, capture_output=True, env=env).returncode != 0:
        cmd = [c for c in cmd if not c.startswith("-fsanitize")]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "bad=0", r.stdout + r.stderr


def capture_and_replay(torch, x, out, side):
    """A training step captured as a CUDA graph in global mode (torch's default, the mode that
    forbids other threads' unsafe CUDA calls during the capture) on stream ``side``, then
    replayed: 100 elementwise ops on ``x`` into ``out``. Returns the graph (the caller drops it
    with the batch). Used by the tests that pinloader's own threads never invalidate a capture."""
    return capture_around(torch, x, out, side, lambda: None)


def capture_around(torch, x, out, side, during):
    """capture_and_replay's step with ``during()`` called in the middle of the capture, on the
    capturing thread. A capture that fails is still ended, so that one failed test does not
    leave the stream capturing and fail every CUDA call of the tests after it."""
    g = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        g.capture_begin(capture_error_mode="global")
        try:
            y = x
            for _ in range(50):
                y = y * 1.0 + 0.0
            during()
            for _ in range(50):
                y = y * 1.0 + 0.0
            out.copy_(y)
        except BaseException:
            try:
                g.capture_end()
            except RuntimeError:
                pass  # the capture was invalidated: the first error is the one to see
            raise
        g.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    g.replay()
    return g


def run_benchmark_smoke(script, out, timeout=300):
    """benchmarks/<script> --smoke --out out on the host backend, this checkout's pinloader
    first on the path; asserts it exits 0 and returns the finished process."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PINLOADER_BACKEND="host")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, str(root / "benchmarks" / script), "--smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    assert p.returncode == 0, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr[-6000:]}"
    return p
