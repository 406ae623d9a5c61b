"""ArrayLoader: memory-mapped sources, and sources that change under it (host backend).

np.memmap and np.load(mmap_mode=) sources with the read-ahead (madvise) policy, and the pinned
cap held with a file four times larger than it; sources that cannot be closed or resized while
loading, and one resized anyway (a clear error); closed mmaps and released memoryviews; files
truncated on disk before or during an epoch (a clean error, not SIGBUS: in subprocesses, marked
hostile), anonymous and grown mappings.
"""
from __future__ import annotations

import mmap
import textwrap

import numpy as np
import pytest

import pinloader
from pinloader import _C
from helpers import collect, describe, drain, ids, run_py, sample

DEVICE = "cpu"


# ---- memory-mapped sources -----------------------------------------------------------------------

def test_memmap_sources_and_readahead(tmp_path):
    path = tmp_path / "data.npy"
    a = sample((3000, 5, 7), np.float32, 8)
    np.save(path, a)
    mm = np.load(path, mmap_mode="r")
    raw = np.memmap(tmp_path / "raw.bin", dtype=np.int16, mode="w+", shape=(3000, 9))
    raw[:] = sample((3000, 9), np.int16, 9)
    raw.flush()
    ro = np.memmap(tmp_path / "raw.bin", dtype=np.int16, mode="r", shape=(3000, 9))
    with pinloader.ArrayLoader({"i": ids(3000), "a": mm, "r": ro[:, 1:], "s": mm[:, 2]}, 128, seed=6,
                               device=DEVICE) as L:
        for g in collect(L):
            assert np.array_equal(g["a"], a[g["i"]])
            assert np.array_equal(g["r"], raw[:, 1:][g["i"]])
            assert np.array_equal(g["s"], a[:, 2][g["i"]])
    g = _C.RowGather(mm, [0, 1], readahead=[2999, 5, 6, 1500])
    assert g.advised_bytes >= 3 * 4096
    w = _C.RowGather(ro, [0], window=500, readahead=[0, 2000])
    assert w.advised_bytes >= 2 * 500 * 18
    with pytest.raises(IndexError, match="readahead"):
        _C.RowGather(mm, [0], readahead=[3000])


@pytest.mark.parametrize("readahead", [None, True, False, "auto-large"])
def test_loader_readahead_policy(tmp_path, monkeypatch, readahead):
    import pinloader.array_loader as al
    mm = np.memmap(tmp_path / "r.bin", dtype=np.float64, mode="w+", shape=(4096, 64))
    mm[:] = np.arange(4096)[:, None]
    epochs = []
    real = pinloader._epoch_plan.RowBatches

    def spy(*a, **kw):
        rb = real(*a, **kw)
        epochs.append(rb)
        return rb
    monkeypatch.setattr(pinloader._epoch_plan, "RowBatches", spy)  # each epoch's batches
    if readahead == "auto-large":  # a mapping larger than the memory available
        monkeypatch.setattr(al, "_mem_available", lambda: 1 << 20)
        readahead = None
    L = pinloader.ArrayLoader((ids(4096), mm, np.zeros(4096)), 100, readahead=readahead, device=DEVICE)
    for i, x, _ in collect(L):
        assert np.array_equal(x[:, 0], i.astype(np.float64))
    L.close()
    assert len(epochs) == 1 and epochs[0].adopted  # made in C by the producer
    per_leaf = epochs[0].advised  # (batches, bytes) per leaf
    if readahead is False or (readahead is None and not al._mem_available() == 1 << 20):
        assert per_leaf == ((0, 0),) * 3
    else:
        # the mapped leaf of every batch but the last is advised (the next batch's rows, the
        # first batch's own too); the in-RAM leaves are not
        assert per_leaf[1][0] == len(L) - 1
        assert per_leaf[1][1] >= (len(L) - 1) * 100 * 512 + 100 * 512
        assert per_leaf[0] == (0, 0) and per_leaf[2] == (0, 0)


def test_pinned_bytes_stay_under_cap_with_memmap_larger_than_cap(tmp_path):
    cap = 8 << 20
    n, row = 1024, 32 << 10  # a 32 MiB file, 4x the cap
    mm = np.memmap(tmp_path / "big.bin", dtype=np.uint8, mode="w+", shape=(n, row))
    for i in range(0, n, 128):
        mm[i:i + 128] = (np.arange(i, i + 128) % 251)[:, None]
    mm.flush()
    ro = np.memmap(tmp_path / "big.bin", dtype=np.uint8, mode="r", shape=(n, row))
    with pinloader.ArrayLoader((ids(n), ro), 48, seed=1, device=DEVICE, max_pinned_bytes=cap, depth=3) as L:
        seen = 0
        for i, x in L:
            i, x = np.from_dlpack(i), np.from_dlpack(x)
            assert np.array_equal(x[:, ::4096], np.broadcast_to((i % 251)[:, None], (len(i), 8)).astype(np.uint8))
            seen += len(i)
        s = L.stats()
    assert seen == n
    assert s["pinned_bytes_peak"] <= cap and s["pinned_cap"] == cap
    assert s["bytes"] >= n * row


# ---- sources held, closed or resized -------------------------------------------------------------

def test_source_cannot_be_closed_or_resized_while_loading(tmp_path):
    mm = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(100, 4))
    buf = bytearray(100)
    a = np.zeros((100, 2))
    L = pinloader.ArrayLoader((mm, buf, a), 10, device=DEVICE)
    it = iter(L)
    next(it)
    with pytest.raises(BufferError):
        mm._mmap.close()
    with pytest.raises(BufferError):
        buf.extend(b"x")
    with pytest.raises(ValueError):
        a.resize((200, 2))
    assert len(collect(L)) == 10
    L.close()
    buf.extend(b"x")  # released with the loader
    del it


def test_source_resized_under_the_loader_is_a_clear_error():
    torch = pytest.importorskip("torch")
    t = torch.arange(400, dtype=torch.float32).reshape(100, 4)
    want = t.numpy().copy()
    L = pinloader.ArrayLoader(t, 10, device=DEVICE, depth=1)
    order = L.indices(0)
    it = iter(L)
    got = [np.from_dlpack(next(it)).copy()]
    t.resize_(20, 4)  # torch allows it (the storage stays: the epoch's export holds it)
    # the epoch in flight reads the layout it began with (Note [native epochs] in
    # src/py/row_batches.c): every row as it was, none lost or torn
    got += [np.from_dlpack(next(it)).copy() for _ in range(len(L) - 1)]  # next(): iter() starts an epoch
    with pytest.raises(StopIteration):
        next(it)
    assert np.array_equal(np.concatenate(got), want[order])
    # the next epoch notices, with a clear error
    with pytest.raises(ValueError, match=r"arrays: the source changed shape from \(100, 4\) to \(20, 4\)"):
        list(L)
    # not silently empty afterwards: the next iteration reports it again
    with pytest.raises(ValueError, match="changed shape"):
        list(L)
    L.close()


@pytest.mark.hostile
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_torch_source_cannot_grow_under_the_loader(dtype):
    # resize_ grows a tensor by moving its storage's memory and freeing the old block, which the
    # epoch in flight reads: the loader takes a NumPy view of the tensor, which makes torch
    # refuse (before: a use-after-free in the staging threads, a segfault)
    torch = pytest.importorskip("torch")
    t = torch.arange(1 << 14).to(getattr(torch, dtype)).reshape(1 << 12, 4)
    want = t.numpy().copy()
    L = pinloader.ArrayLoader(t, 256, device=DEVICE, depth=1)
    order = L.indices(0)
    it = iter(L)
    got = [np.from_dlpack(next(it)).copy()]
    with pytest.raises(RuntimeError, match="not resizable"):
        t.resize_(1 << 15, 4)
    # (torch sets the new shape before it refuses: the next epoch would report it)
    got += [np.from_dlpack(next(it)).copy() for _ in range(len(L) - 1)]  # iter() starts an epoch
    assert np.array_equal(np.concatenate(got), want[order])
    L.close()


def closed_sources():
    m = mmap.mmap(-1, 4096)
    m.close()
    mv = memoryview(bytearray(64))
    mv.release()
    return [(m, "the mmap.mmap cannot be read: mmap closed or invalid"),
            (mv, "the memoryview cannot be read: operation forbidden on released memoryview")]


@pytest.mark.parametrize("case", [0, 1])
@pytest.mark.hostile
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


# ---- memory-mapped files cut on disk (subprocesses) ----------------------------------------------

def run_cut(body, tmp_path):
    """Run `body` in a child with `tmp` (a directory); a SIGBUS fails only this test."""
    return run_py(f"import os, mmap, numpy as np, pinloader\ntmp = {str(tmp_path)!r}\n"
                  + textwrap.dedent(body), timeout=60, watchdog=True)


@pytest.mark.hostile
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


@pytest.mark.hostile
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


@pytest.mark.hostile
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


class _ExportInterrupted:
    """A DLPack exporter interrupted (Ctrl-C) while it exports."""

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **kw):
        raise KeyboardInterrupt


class _LookupInterrupted:
    """An object interrupted while its __dlpack__ is looked up."""

    def __dlpack_device__(self):
        return (1, 0)

    def __getattr__(self, name):
        if name == "__dlpack__":
            raise KeyboardInterrupt
        raise AttributeError(name)


class _DeviceInterrupted:
    """A DLPack exporter whose device type is an object interrupted as it is read."""

    class _Index:
        def __index__(self):
            raise KeyboardInterrupt

    def __dlpack_device__(self):
        return (self._Index(), 0)

    def __dlpack__(self, **kw):
        return np.zeros((4, 2)).__dlpack__(**kw)


@pytest.mark.hostile
@pytest.mark.parametrize("cls", [_ExportInterrupted, _LookupInterrupted, _DeviceInterrupted])
def test_ctrl_c_while_a_source_is_read_stays_keyboard_interrupt(cls):
    # before: TypeError "source: could not read it through DLPack" (while exporting), or
    # "source must be a NumPy array..." (while looking __dlpack__ up)
    with pytest.raises(KeyboardInterrupt):
        _C.RowGather(cls(), [0])
    with pytest.raises(KeyboardInterrupt):
        pinloader.ArrayLoader({"x": cls()}, 1, device=DEVICE)


@pytest.mark.hostile
@pytest.mark.parametrize("change", ["reorder", "replace", "add"])
def test_arrays_changed_after_the_loader_was_made_is_a_clear_error(change):
    # before: the batch's arrays came under each other's names (reorder, replace) with no error
    d = {"x": np.zeros((100, 4), np.float32), "y": np.ones((100, 4), np.float32)}
    L = pinloader.ArrayLoader(d, 10, device=DEVICE)
    if change == "reorder":
        d["x"] = d.pop("x")
    elif change == "replace":
        d["x"] = np.full((100, 4), 2, np.float32)
    else:
        d["z"] = np.zeros((100, 4), np.float32)
    with pytest.raises(ValueError, match="arrays was changed after the loader was made"):
        next(iter(L))
    L.close()


def test_structure_kept_as_it_was_gives_each_array_its_name():
    d = {"x": np.zeros((100, 4), np.float32), "y": np.ones((100, 4), np.float32)}
    L = pinloader.ArrayLoader(d, 10, device=DEVICE)
    for _ in range(2):
        b = next(iter(L))
        assert float(np.from_dlpack(b["x"]).max()) == 0.0
        assert float(np.from_dlpack(b["y"]).min()) == 1.0
    L.close()


@pytest.mark.hostile
@pytest.mark.parametrize("how", ["from_numpy", "from_file"])
def test_truncation_check_finds_files_mapped_under_torch_tensors(tmp_path, how):
    # A torch tensor hides the mmap under it: the mapping is found by address in
    # /proc/self/maps (before: no check, and SIGBUS killed the process)
    pytest.importorskip("torch")
    p = run_cut(f"""
    import torch, warnings
    warnings.simplefilter("ignore")  # torch.from_numpy: a read-only array
    path = os.path.join(tmp, "cut.bin")
    np.arange(4096 * 64, dtype=np.float32).tofile(path)
    if {how!r} == "from_numpy":
        src = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r", shape=(4096, 64)))
    else:
        src = torch.from_file(path, shared=True, size=4096 * 64, dtype=torch.float32).view(4096, 64)
    for native in (True, False):
        L = pinloader.ArrayLoader({{"x": src}}, 256, device="cpu", shuffle=False)
        L._plan.native = native  # the RowBatches' check, then the generator's
        assert sum(1 for _ in L) == len(L)
        os.truncate(path, 4096)
        try:
            for b in L:
                np.from_dlpack(b["x"]).sum()
            print("NO ERROR")
        except ValueError as e:
            print("ERROR", L.stats()["epoch_source"], e)
        L.close()
        os.truncate(path, 4096 * 64 * 4)
    """, tmp_path)
    assert p.returncode == 0, describe(p)
    for source in ("native", "generator"):
        assert f"ERROR {source} arrays['x']: the memory-mapped file " in p.stdout, describe(p)
    assert "cut.bin was truncated on disk" in p.stdout and "NO ERROR" not in p.stdout, describe(p)


@pytest.mark.hostile
def test_row_gather_holds_a_torch_tensors_memory():
    # torch's DLPack export keeps the tensor, not its memory: set_() freed the memory a
    # RowGather read (a use-after-free in the staging threads) and resize_ could move it
    torch = pytest.importorskip("torch")
    src = torch.arange(1024 * 4, dtype=torch.float32).reshape(1024, 4)
    want = src.numpy().copy()
    rows = np.arange(0, 1024, 2)
    g = _C.RowGather(src, rows)
    with pytest.raises(RuntimeError, match="not resizable"):
        src.resize_(1 << 20, 4)
    src.set_(torch.zeros(1, 4))  # the memory the RowGather reads stays alive
    import gc
    gc.collect()
    with pinloader.AsyncPrefetcher([(g,)], device=DEVICE) as pf:
        (b,) = drain(pf)
    assert np.array_equal(np.from_dlpack(b[0]), want[rows])
