"""Hostile input to ArrayLoader, RowGather, export_capsules and the adapters: files cut under a
mapping, user code re-entering the prefetcher from its producer thread, errors that say what
happened, and the sampling arithmetic under extreme shard counts (host backend).

Anything that could crash or hang on a bug runs in a subprocess under a timeout, with a
faulthandler watchdog inside it, so a bug fails that test instead of the suite.
"""
from __future__ import annotations

import collections
import dataclasses
import mmap
import os
import textwrap

import numpy as np
import pytest

import pinloader
from helpers import CapsuleWrapper, describe, drain, run_child
from pinloader import _C
from pinloader.array_loader import _order

DEVICE = "cpu"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(pinloader.__file__)))


def run_py(code, timeout=60):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PKG_PARENT, TESTS_DIR])
    env.pop("PINLOADER_DEBUG", None)
    code = ("import faulthandler; faulthandler.dump_traceback_later(%d, exit=True)\n" % (timeout - 10)
            + textwrap.dedent(code))
    return run_child(code, env, timeout)


def values(batch):
    return np.from_dlpack(batch).copy()


# ---- memory-mapped files cut on disk -------------------------------------------------------

def run_cut(body, tmp_path):
    """Run `body` in a child with `tmp` (a directory); a SIGBUS fails only this test."""
    return run_py(f"import os, mmap, numpy as np, pinloader\ntmp = {str(tmp_path)!r}\n"
                  + textwrap.dedent(body))


def test_file_truncated_before_the_epoch_is_a_clean_error_not_sigbus(tmp_path):
    # Without the per-batch check the staging threads read pages past the new end of the file
    # and SIGBUS kills the process.
    p = run_cut("""
    path = os.path.join(tmp, "cut.npy")
    np.save(path, np.arange(4096 * 64, dtype=np.float32).reshape(4096, 64))
    mm = np.load(path, mmap_mode="r")
    L = pinloader.ArrayLoader({"x": mm}, 256, device="cpu", shuffle=False)
    os.truncate(path, 4096)
    try:
        for b in L:
            np.from_dlpack(b["x"]).sum()
        print("NO ERROR")
    except ValueError as e:
        print("ERROR", e)
    L.close()
    """, tmp_path)
    assert p.returncode == 0, describe(p)
    assert "ERROR arrays['x']: the memory-mapped file" in p.stdout, describe(p)
    assert "cut.npy was truncated on disk" in p.stdout and "now 4096 bytes" in p.stdout, describe(p)


def test_file_truncated_during_the_epoch(tmp_path):
    p = run_cut("""
    path = os.path.join(tmp, "raw.bin")
    mm = np.memmap(path, dtype=np.int32, mode="w+", shape=(1000, 256))
    mm[:] = np.arange(1000, dtype=np.int32)[:, None]
    mm.flush()
    L = pinloader.ArrayLoader((mm,), 100, device="cpu", shuffle=False, depth=1)
    it = iter(L)
    first = next(it)
    assert (np.from_dlpack(first[0])[:, 0] == np.arange(100)).all()
    import time
    while L.stats()["queued"] < 1:  # the next batch is staged: the producer waits for room
        time.sleep(0.001)
    os.truncate(path, 1000)  # less than one row
    try:
        for b in it:
            np.from_dlpack(b[0]).sum()
        print("NO ERROR")
    except ValueError as e:
        print("ERROR", e)
    """, tmp_path)
    assert p.returncode == 0, describe(p)
    assert "ERROR arrays[0]: the memory-mapped file " in p.stdout, describe(p)
    assert "raw.bin was truncated on disk" in p.stdout, describe(p)


def test_truncation_check_covers_raw_mmap_and_views(tmp_path):
    # a view of a raw mmap at a file offset: the file must cover the offset plus the length
    p = run_cut("""
    path = os.path.join(tmp, "m.bin")
    with open(path, "wb") as fh:
        fh.write(np.arange(64 * 1024, dtype=np.uint8).tobytes())
    with open(path, "r+b") as fh:
        m = mmap.mmap(fh.fileno(), 32 * 1024, offset=mmap.ALLOCATIONGRANULARITY)
    view = np.frombuffer(m, dtype=np.uint8).reshape(-1, 64)[::-1]
    L = pinloader.ArrayLoader({"raw": view}, 64, device="cpu")
    assert sum(1 for _ in L) == len(L)
    os.truncate(path, mmap.ALLOCATIONGRANULARITY + 16 * 1024)  # longer than the mapping alone
    try:
        for _ in L:
            pass
        print("NO ERROR")
    except ValueError as e:
        print("ERROR", e)
    """, tmp_path)
    assert p.returncode == 0, describe(p)
    assert "ERROR arrays['raw']: the memory-mapped file " in p.stdout, describe(p)
    assert "m.bin was truncated" in p.stdout, describe(p)


def test_anonymous_mmap_and_file_that_grew_are_fine(tmp_path):
    anon = mmap.mmap(-1, 4096 * 4)
    path = tmp_path / "g.bin"
    mm = np.memmap(path, dtype=np.float32, mode="w+", shape=(64, 16))
    with open(path, "ab") as fh:
        fh.write(b"\0" * 8192)  # appended to: the mapping is still backed
    L = pinloader.ArrayLoader((np.frombuffer(anon, np.uint8).reshape(64, -1), mm), 8, device=DEVICE)
    assert sum(1 for _ in L) == 8
    L.close()


# ---- sharding: the rank's shard is computed directly ---------------------------------------

def old_order(plan, epoch):
    """The formula ArrayLoader used before: pad the whole epoch to num_samples * world_size,
    then slice the rank's items out of it (memory grew with world_size)."""
    n, L = plan.num_items, plan.window
    spare = 0 if L is None else plan.num_rows - n * L
    phase, order = (_C.permutation(n, plan.seed, epoch, spare) if plan.shuffle
                    else (0, np.arange(n, dtype=np.int64)))
    world = plan.world_size
    if world > 1:
        total = plan.num_samples * world
        if total <= n:
            order = order[:total]
        elif n:
            order = np.resize(order, total)
        order = order[plan.rank::world]
    else:
        order = order[:plan.num_samples]
    return order if L is None else phase + order * L


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("window", [None, 2])
def test_shard_equals_the_padded_formula_on_small_inputs(drop_last, window):
    for n_rows in [0, 1, 2, 3, 5, 7, 12, 13]:
        if window and n_rows < window:
            continue
        for world in [1, 2, 3, 4, 7, 13, 20]:
            for rank in range(world):
                L = pinloader.ArrayLoader(np.zeros((n_rows, 1)) if n_rows else np.zeros((0, 1)), 2,
                                          rank=rank, world_size=world, drop_last=drop_last,
                                          seed=n_rows, windows=window, device=DEVICE)
                for epoch in (0, 3):
                    L._plan.cache = None
                    new = L.indices(epoch)
                    ref = old_order(L._plan, epoch)
                    assert new.tolist() == np.asarray(ref).tolist(), (n_rows, world, rank, epoch)
                L.close()


@pytest.mark.parametrize("drop_last", [False, True])
def test_huge_world_size_takes_memory_of_the_shard_only(drop_last):
    # before: the epoch was padded to num_samples * world_size items first (a 2**40-item
    # array: an empty MemoryError)
    data = np.arange(10, dtype=np.int64)
    L = pinloader.ArrayLoader(data, 4, rank=2**40 - 3, world_size=2**40, drop_last=drop_last,
                              device=DEVICE, seed=1)
    idx = L.indices(0)
    if drop_last:
        assert len(L) == 0 and idx.tolist() == []
    else:
        perm = _C.permutation(10, 1, 0)[1]
        assert idx.tolist() == [perm[(2**40 - 3) % 10]] and len(L) == 1
        assert [values(b).tolist() for b in L] == [[data[perm[(2**40 - 3) % 10]]]]
    L.close()


def test_drop_last_with_world_size_every_batch_full():
    # 103 rows over 4 ranks: 25 each (the last 3 dropped), batches of 4: 6 full, the 7th dropped
    data = np.arange(103, dtype=np.int64)
    seen = []
    for rank in range(4):
        L = pinloader.ArrayLoader(data, 4, rank=rank, world_size=4, drop_last=True, device=DEVICE)
        assert L.num_samples == 25 and len(L) == 6
        got = [values(b) for b in L]
        assert len(got) == 6 and all(g.shape == (4,) for g in got)
        assert np.concatenate(got).tolist() == L.indices(0)[:24].tolist()
        seen += L.indices(0).tolist()
        L.close()
    assert len(seen) == len(set(seen)) == 100  # disjoint shards, the tail dropped


# ---- the adapters adopt a loader that already ran with the same settings -------------------

def test_adapter_adopts_a_loader_after_a_plain_epoch_with_equal_settings():
    torch_ = pytest.importorskip("torch")
    import pinloader.torch as pt
    data = np.arange(40, dtype=np.float32).reshape(20, 2)
    L = pinloader.ArrayLoader(data, 5, device="cpu", shuffle=False)
    plain = [values(b) for b in L]
    T = pt.prefetch(L)  # same device (cpu) and depth (the default): accepted
    got = [t.numpy().copy() for t in T]
    assert all(isinstance(t, np.ndarray) for t in got)
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(plain))
    L.close()
    # other settings than the running prefetcher's are still refused
    L2 = pinloader.ArrayLoader(data, 5, device="cpu")
    assert len([values(b) for b in L2]) == 4
    for opts in ({"depth": 4}, {"max_pinned_bytes": 1 << 20}):
        with pytest.raises(ValueError, match="already iterating with other settings"):
            pt.prefetch(L2, **opts)
    L2.close()
    assert torch_ is not None


# ---- user code on the producer thread re-entering the prefetcher ---------------------------

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
    p = run_py(REENTRY, timeout=90)
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


def test_array_loader_container_constructor_calling_next_on_the_loader():
    code = """
    import collections, numpy as np, pinloader
    box = {}
    class Pair(collections.namedtuple("Pair", ["x", "y"])):
        def __new__(cls, x, y):
            # the batch's structure is built on the producer thread, around its DeviceArrays
            if isinstance(x, pinloader.DeviceArray) and "L" in box:
                try:
                    next(box["L"])
                    box["seen"] = "returned"
                except Exception as e:
                    box["seen"] = f"{type(e).__name__}: {e}"
            return super().__new__(cls, x, y)
    data = np.arange(40.0).reshape(20, 2)
    L = box["L"] = pinloader.ArrayLoader(Pair(data, data[:, 0]), 5, device="cpu")
    print("BATCHES", len(list(L)), flush=True)
    print("SEEN", box.get("seen"), flush=True)
    L.close()
    """
    p = run_py(code)
    assert p.returncode == 0, describe(p)
    assert "BATCHES 4" in p.stdout, describe(p)
    assert "SEEN RuntimeError: AsyncPrefetcher: next() was called on the prefetcher's own producer" \
        in p.stdout, describe(p)


# ---- errors that say what happened ---------------------------------------------------------

def test_permutation_too_large_says_what():
    with pytest.raises(MemoryError, match=r"permutation: n = 4611686018427387904 is too large: it "
                                          r"needs 4611686018427387904 \* 8 bytes"):
        _C.permutation(2**62, 0, 0)
    with pytest.raises(MemoryError, match=r"n = 576460752303423488 is too large: it needs "
                                          r"4611686018427387904 bytes"):
        _C.permutation(2**59, 0, 0)


def closed_sources():
    m = mmap.mmap(-1, 4096)
    m.close()
    mv = memoryview(bytearray(64))
    mv.release()
    return [(m, "the mmap.mmap cannot be read: mmap closed or invalid"),
            (mv, "the memoryview cannot be read: operation forbidden on released memoryview")]


@pytest.mark.parametrize("case", [0, 1])
def test_closed_mmap_and_released_memoryview_say_so(case):
    src, what = closed_sources()[case]
    # before: "object arrays cannot be copied (dtype object)"
    with pytest.raises(ValueError, match=f"^source: {what}"):
        _C.RowGather(src, [0])
    with pytest.raises(ValueError, match=rf"^arrays\[1\]: source: {what}"):
        pinloader.ArrayLoader((np.zeros(4), src), 1, device=DEVICE)
    with pytest.raises(ValueError, match=rf"^item\[0\]: {what}"):
        with pinloader.AsyncPrefetcher([(src,)], device=DEVICE) as pf:
            drain(pf)


def test_strided_buffer_exporters_are_still_read():
    # an exporter that refuses only a contiguous export is read through its strides
    a = np.arange(20, dtype=np.int32)
    mv = memoryview(a)[::2]
    g = _C.RowGather(mv, [0, 3])
    assert g.source_shape == (10,)
    with pinloader.AsyncPrefetcher([(mv,)], device=DEVICE) as pf:
        (b,) = drain(pf)
    np.testing.assert_array_equal(values(b[0]), a[::2])


@pytest.mark.parametrize("device", [True, False])
def test_bool_device_is_refused(device):
    # before: True was read as 'cuda:1' and False as 'cuda:0'
    with pytest.raises(TypeError, match="device must be a str, an int or None, not bool"):
        pinloader.AsyncPrefetcher([np.arange(3)], device=device)
    with pytest.raises(TypeError, match="not bool"):
        pinloader.PinnedPool(max_bytes=1 << 20, device=device)
    # the loader makes its prefetcher on the first iteration
    L = pinloader.ArrayLoader(np.arange(3), 1, device=device)
    with pytest.raises(TypeError, match="not bool"):
        iter(L)
    L.close()


def test_bool_device_is_refused_by_the_torch_adapter():
    pytest.importorskip("torch")
    import pinloader.torch as pt
    with pytest.raises(TypeError, match=r"pinloader.torch.prefetch: device must be .* not bool"):
        pt.prefetch([np.arange(3)], device=True)


@pytest.mark.parametrize("value, ranks", [("4", 4), (" 3 ", 3), ("1", 1), ("0", 1), ("-2", 1),
                                          ("", 1), ("x", 1), ("2x", 1), ("65536", 65536),
                                          ("65537", 1), ("100000", 1), ("99999999999999999999", 1)])
def test_local_world_size_is_read_alike_for_the_pool_and_the_staging_threads(monkeypatch, value, ranks):
    # before: the pool accepted 2..65536 and the staging threads 1..2**20
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert _C._cpu_budget()["local_ranks"] == ranks
    full = _C.default_pinned_cap()
    assert _C.default_pool_cap() == max(full // ranks, 256)


# ---- Lemire's rejection step (Note [epoch permutation], src/py/gather.c) ----------------------

# (bound = phase_range + 1, seed, rejections the reference makes, phase, perm of 6): bounds just
# above 2**62 and at 3 * 2**61 (near 2**63) and 2**64 / 3, where a quarter to a third of the
# draws are rejected; the counts include repeated rejections (a `while` read as an `if`, or a
# wrong threshold t, changes the phase and every later draw).
LEMIRE_CASES = [
    (2**62 + 1, 8, 2, 2569297520966558801, [4, 3, 2, 1, 0, 5]),
    (2**62 + 1, 1, 1, 1929241123449960082, [0, 3, 1, 4, 5, 2]),
    (3 * 2**61, 6, 4, 3198488007021353553, [4, 1, 0, 5, 2, 3]),
    (3 * 2**61, 14, 3, 6828530171798318487, [1, 3, 0, 2, 5, 4]),
    (2**64 // 3 + 1, 3, 3, 2977766631039090612, [2, 3, 0, 4, 1, 5]),
]


def counted_phase(bound, seed, epoch=0):
    """The reference's phase draw (tests/test_array_loader.py), counting rejected draws."""
    from test_array_loader import M64, RefStream
    r = RefStream(seed, epoch)
    rejected = 0
    m = r.next() * bound
    if (m & M64) < bound:
        t = ((1 << 64) - bound) % bound
        while (m & M64) < t:
            rejected += 1
            m = r.next() * bound
    return m >> 64, rejected


@pytest.mark.parametrize("bound, seed, rejections, phase, perm", LEMIRE_CASES)
def test_permutation_rejection_step_near_2_62_and_2_63(bound, seed, rejections, phase, perm):
    from test_array_loader import ref_permutation
    ref_phase, n_rejected = counted_phase(bound, seed)
    assert n_rejected == rejections  # the case exercises the rejection loop
    assert ref_phase == phase
    assert ref_permutation(6, seed, 0, bound - 1) == (phase, perm)
    got_phase, got = _C.permutation(6, seed, 0, bound - 1)
    assert (got_phase, got.tolist()) == (phase, perm)


# ---- held copies: the stall counter and the pool's own guarantees ---------------------------

MiB = 1 << 20


def wait_until(cond, what, timeout=30.0):
    import time
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_stall_counted_once_per_reserve_that_waited():
    # The second (large) batch cannot fit next to the first, whose copy is held: its reserve
    # waits (seen as the pool's `waiting`) until the copy is let go. The small batches after it
    # always fit (each batch is exported, so at most depth + 1 copies are outstanding): exactly
    # one stall, whatever the timing.
    pool = pinloader.PinnedPool(max_bytes=8 * MiB, device="cpu")
    big = [np.full(MiB, i, dtype=np.uint8) for i in range(2)]
    small = [np.full(16 << 10, 10 + i, dtype=np.uint8) for i in range(20)]
    items = big + small
    _C._debug_hold_copies(True)
    try:
        pf = pinloader.AsyncPrefetcher(items, device="cpu", pool=pool, depth=2,
                                       max_pinned_bytes=3 * MiB // 2)
        first = next(pf)  # queued; its copy is held, so its region stays pending
        wait_until(lambda: pool.stats()["waiting"] == 1, "the second batch's reserve to wait")
        assert pf.stats()["pinned_stalls"] == 0
    finally:
        _C._debug_hold_copies(False)
    out = [values(first)] + [values(b) for b in drain(pf)]
    assert [o[0] for o in out] == [0, 1] + [10 + i for i in range(20)]
    st = pf.stats()
    assert st["pinned_stalls"] == 1, st
    assert pool.stats()["waits"] == 1 and pool.stats()["waiting"] == 0
    pf.close()
    pool.close()


def test_pool_trim_frees_nothing_pending_and_pending_regions_are_not_reused():
    pool = pinloader.PinnedPool(max_bytes=2 * MiB, device="cpu")
    _C._debug_hold_copies(True)
    try:
        pf = pinloader.AsyncPrefetcher([np.ones(MiB + MiB // 2, np.uint8)], device="cpu", pool=pool,
                                       depth=1)
        batch = next(pf)
        wait_until(lambda: pool.stats()["pending"] == 1, "the staged region to be pending")
        st = pool.stats()
        assert st["regions"] == 1 and st["in_use_bytes"] >= MiB + MiB // 2, st
        # trim() gives back only slabs with no live region: the pending one's slab stays
        assert pool.trim() == 0
        assert pool.stats()["slabs"] == st["slabs"] and pool.stats()["pending"] == 1
        # the pending region is neither reused nor counted as free: no room for another
        with pytest.raises(pinloader.PoolExhausted):
            pool.alloc(MiB, timeout=0.05)
        assert pool.stats()["pending"] == 1
    finally:
        _C._debug_hold_copies(False)
    np.testing.assert_array_equal(values(batch), np.ones(MiB + MiB // 2, np.uint8))
    pf.close()
    wait_until(lambda: pool.stats()["pending"] == 0, "the region to come back")
    buf = pool.alloc(MiB, timeout=5)  # room again once the copy is done
    buf.release()
    assert pool.trim() > 0 and pool.stats()["slabs"] == 0
    pool.close()


def test_pool_client_never_exceeds_its_bound():
    import threading
    pool = pinloader.PinnedPool(max_bytes=8 * MiB, device="cpu")
    c = pool.client(max_bytes=MiB)
    a = c.alloc(MiB - 4096)
    # the pool has room, the client has not: its request waits for its own regions
    with pytest.raises(pinloader.PoolExhausted):
        c.alloc(64 << 10, timeout=0.05)
    other = pool.alloc(4 * MiB, timeout=1)  # the pool itself still serves others
    got = []
    t = threading.Thread(target=lambda: got.append(c.alloc(64 << 10, timeout=30)))
    t.start()
    wait_until(lambda: pool.stats()["waiting"] == 1, "the client's reserve to wait")
    assert not got and c.stats()["in_use_bytes"] <= MiB
    a.release()
    t.join(30)
    assert got and c.stats()["peak_in_use_bytes"] <= MiB, c.stats()
    assert c.stats()["waits"] >= 2  # the timed-out request and the one that waited
    got[0].release()
    other.release()
    pool.close()
