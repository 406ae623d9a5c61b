"""ArrayLoader epochs made in C (Note [native epochs] in src/py/row_batches.c), on the host backend:
the producer takes the GIL once per epoch, not once per batch; the batches equal the Python
generator's and NumPy indexing; a RowBatches read from Python gives the same RowGathers; an
epoch has one reader; hostile constructor arguments are clear errors.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import pinloader
from pinloader import _C
from pinloader._epoch_plan import epoch_batches
from helpers import collect, describe, ids, run_py

DEVICE = "cpu"


def source(n=1000, fortran=True):
    rng = np.random.default_rng(3)
    w = rng.integers(0, 255, (n, 5), dtype=np.uint8)
    return {"x": rng.standard_normal((n, 6)).astype(np.float32), "i": ids(n),
            "w": np.asfortranarray(w) if fortran else w}


@pytest.mark.parametrize("gather", ["host", "device"])
def test_producer_takes_the_gil_once_per_epoch(gather):
    d = source(4000, fortran=gather == "host")  # the device gather: contiguous rows, whole pages
    with pinloader.ArrayLoader(d, 10, device=DEVICE, gather=gather) as L:
        for epoch in range(3):
            got = collect(L)
            order = L.indices(epoch)
            assert np.array_equal(np.concatenate([g["i"] for g in got]), order)
            assert np.array_equal(np.concatenate([g["x"] for g in got]), d["x"][order])
            assert np.array_equal(np.concatenate([g["w"] for g in got]), d["w"][order])
        st = L.stats()
    assert st["batches"] == 3 * 400
    assert st["epoch_source"] == "native" and st["epoch_source_reason"] == ""
    # one hold per epoch (opening its RowBatches), not one per batch (1203 for a Python source)
    assert st["producer_gil_holds"] == 3
    assert st["gather"] == gather


def test_native_and_generator_batches_are_equal():
    d = source(777)
    runs = []
    for native in (True, False):
        L = pinloader.ArrayLoader(d, 64, device=DEVICE, seed=5, windows=None)
        L._plan.native = native
        runs.append([collect(L) for _ in range(2)])
        st = L.stats()
        L.close()
        assert (st["producer_gil_holds"] <= 2) == native, st["producer_gil_holds"]
    for a, b in zip(*runs):
        assert len(a) == len(b) == 13
        for x, y in zip(a, b):
            for k in d:
                assert np.array_equal(x[k], y[k]), k


def test_windows_native():
    tokens = np.arange(10_000, dtype=np.int32)
    with pinloader.ArrayLoader(tokens, 8, windows=65, device=DEVICE, seed=2) as L:
        got = np.concatenate(collect(L))
        starts = L.indices(0)
        assert L.stats()["producer_gil_holds"] == 1
    assert np.array_equal(got, tokens[starts[:, None] + np.arange(65)])


def test_row_batches_read_from_python_give_the_same_row_gathers():
    d = source(100)
    L = pinloader.ArrayLoader(d, 30, device=DEVICE, seed=1)
    rb = epoch_batches(L._plan, 0)
    assert isinstance(rb, _C.RowBatches) and not rb.adopted
    assert rb.__length_hint__() == 4
    batches = list(rb)
    order = L.indices(0)
    assert len(batches) == 4 and rb.__length_hint__() == 0
    for b, item in enumerate(batches):
        assert all(isinstance(g, _C.RowGather) for g in item)
        for g in item:
            assert np.array_equal(g.rows, order[b * 30:(b + 1) * 30])
    with pytest.raises(StopIteration):
        next(rb)
    L.close()


def test_an_epoch_has_one_reader():
    d = source(100)
    L = pinloader.ArrayLoader(d, 30, device=DEVICE, seed=1)
    rb = epoch_batches(L._plan, 0)
    next(rb)
    # a prefetcher given an epoch already being read refuses it, as the batch's error
    pf = pinloader.AsyncPrefetcher(rb, device=DEVICE, structure=d)
    with pytest.raises(RuntimeError, match="already being read"):
        next(pf)
    pf.close()
    fresh = epoch_batches(L._plan, 0)
    with pinloader.AsyncPrefetcher(fresh, device=DEVICE, structure=d) as pf:
        assert len([b for b in pf]) == 4
    assert fresh.adopted
    with pytest.raises(RuntimeError, match="already being read"):
        next(fresh)  # the producer's now
    L.close()


@pytest.mark.hostile
def test_row_batches_constructor_refuses_bad_arguments():
    a = np.zeros((10, 3), np.float32)
    probe = _C.RowGather(a, [])
    table = _C.epoch_table(np.arange(10))
    leaf = ("arrays", probe, False, None, 0, None)
    with pytest.raises(TypeError, match="epoch table"):
        _C.RowBatches([leaf], np.arange(10), 3, 4)
    with pytest.raises(ValueError, match="do not fit"):
        _C.RowBatches([leaf], table, 3, 5)
    with pytest.raises(ValueError, match="do not fit"):
        _C.RowBatches([leaf], table, 0, 1)
    with pytest.raises(ValueError, match="leaves"):
        _C.RowBatches([], table, 3, 4)
    with pytest.raises(TypeError):
        _C.RowBatches([("arrays", a, False, None, 0, None)], table, 3, 4)  # not a RowGather
    with pytest.raises(TypeError, match="tuple"):
        _C.RowBatches([["arrays", probe, False, None, 0, None]], table, 3, 4)
    with pytest.raises(ValueError, match="file's name"):
        _C.RowBatches([("arrays", probe, False, 0, 10, None)], table, 3, 4)
    with pytest.raises(TypeError):
        _C.RowBatches([("arrays", probe, False, object(), 10, "f")], table, 3, 4)  # no fileno()
    with pytest.raises(ValueError):
        _C.RowBatches([("arrays", probe, False, -3, 10, "f")], table, 3, 4)  # a negative descriptor
    # rows outside a leaf's source: checked once, against the table's range
    with pytest.raises(IndexError, match="rows 0 to 10"):
        _C.RowBatches([leaf], _C.epoch_table(np.arange(11)), 3, 4)
    win = _C.RowGather(a, [], window=4)
    with pytest.raises(IndexError, match="7 items"):
        _C.RowBatches([("arrays", win, False, None, 0, None)], table, 3, 4)
    ok = _C.RowBatches([leaf], table, 3, 3)  # drop_last: 3 batches of 3, one row left
    assert [len(g[0].rows) for g in ok] == [3, 3, 3]


def cut_after_one_batch(tmp_path):
    """A loader over a 1000 x 64 int32 memmap and its epoch 0's RowBatches, read one batch, then
    the file cut to 100 bytes: (path, loader, RowBatches)."""
    path = tmp_path / "m.bin"
    mm = np.memmap(path, dtype=np.int32, mode="w+", shape=(1000, 64))
    mm[:] = np.arange(1000, dtype=np.int32)[:, None]
    mm.flush()
    L = pinloader.ArrayLoader({"x": mm}, 100, device=DEVICE, shuffle=False)
    rb = epoch_batches(L._plan, 0)
    assert next(rb)[0].rows[0] == 0
    os.truncate(path, 100)
    return path, L, rb


def test_file_cut_after_the_epoch_began_is_reported_by_the_native_check(tmp_path):
    # the RowBatches checks on its own descriptor: closing the caller's changes nothing
    # cut before the next batch's rows are read: none of them are touched
    path, L, rb = cut_after_one_batch(tmp_path)
    with pytest.raises(ValueError, match=r"^arrays\['x'\]: the memory-mapped file .*m.bin was truncated on disk "
                                         r"while loading: it is now 100 bytes, the mapping needs 256000"):
        next(rb)
    del rb
    L.close()


def test_deleted_mapped_file_falls_back_to_the_generator(tmp_path):
    # a mapping whose file was unlinked has no name to open: the generator checks it instead
    path = tmp_path / "gone.bin"
    mm = np.memmap(path, dtype=np.int32, mode="w+", shape=(500, 8))
    mm[:] = np.arange(500, dtype=np.int32)[:, None]
    mm.flush()
    os.unlink(path)
    with pinloader.ArrayLoader({"x": mm}, 50, device=DEVICE, seed=4) as L:
        assert not isinstance(epoch_batches(L._plan, 0), _C.RowBatches)
        got = np.concatenate([g["x"] for g in collect(L)])
        assert np.array_equal(got[:, 0], L.indices(0))
        st = L.stats()
        assert st["producer_gil_holds"] == 11  # the generator: once per batch, and the end
        assert st["epoch_source"] == "generator"
        assert st["epoch_source_reason"].startswith("arrays['x']: the file it maps (") and "gone.bin" in \
            st["epoch_source_reason"] and st["epoch_source_reason"].endswith("each batch takes the GIL")


def test_a_mapped_file_is_matched_by_its_mapping_not_by_stat(tmp_path, monkeypatch):
    # On a btrfs subvolume stat()'s st_dev is not the device /proc/self/maps shows for the
    # file's mappings: a stat() match took every such file for another one, and each epoch fell
    # back to the generator (_open_matching in pinloader/_mapped.py). Such a file system is
    # played here by a stat() whose st_dev never agrees with /proc/self/maps.
    import pinloader._mapped as mapped_mod
    mm = np.memmap(tmp_path / "m.bin", dtype=np.int32, mode="w+", shape=(400, 8))
    mm[:] = np.arange(400, dtype=np.int32)[:, None]
    mm.flush()
    real_stat, real_fstat = os.stat, os.fstat

    def other_device(st):
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev ^ 0x5A5A, st.st_nlink, st.st_uid,
                               st.st_gid, st.st_size, int(st.st_atime), int(st.st_mtime), int(st.st_ctime)))

    monkeypatch.setattr(mapped_mod.os, "stat", lambda *a, **k: other_device(real_stat(*a, **k)))
    monkeypatch.setattr(mapped_mod.os, "fstat", lambda fd: other_device(real_fstat(fd)))
    with pinloader.ArrayLoader({"x": mm}, 50, device=DEVICE, seed=4) as L:
        got = np.concatenate([g["x"] for g in collect(L)])
        st = L.stats()
    assert st["epoch_source"] == "native", st["epoch_source_reason"]
    assert np.array_equal(got[:, 0], L.indices(0))


def test_a_mapped_files_name_now_naming_another_file_is_not_taken_for_it(tmp_path):
    path = tmp_path / "m.bin"
    mm = np.memmap(path, dtype=np.int32, mode="w+", shape=(400, 8))
    mm[:] = np.arange(400, dtype=np.int32)[:, None]
    mm.flush()
    other = tmp_path / "other.bin"
    other.write_bytes(bytes(400 * 8 * 4))  # same size, another file
    os.replace(other, path)  # the mapping keeps the old file; its name now names the new one
    with pinloader.ArrayLoader({"x": mm}, 50, device=DEVICE, seed=4) as L:
        got = np.concatenate([g["x"] for g in collect(L)])
        st = L.stats()
    assert st["epoch_source"] == "generator"
    assert "m.bin) could not be opened for its size check" in st["epoch_source_reason"]
    assert np.array_equal(got[:, 0], L.indices(0))  # the mapped file's rows, not the new file's


# ---- found by a hostile review of the native epochs ----------------------------------------------

@pytest.mark.hostile
def test_an_epochs_sources_live_until_its_last_device_gather_is_done():
    # A RowBatches holding the only reference to its source: the producer gives it up when the
    # next epoch begins, but only once the last batch made from it is copied (the copies are
    # held back here until after the switch). Freed early, the held copy reads unmapped memory.
    code = """
    import numpy as np
    from pinloader import _C, AsyncPrefetcher
    N, D, BS = 2048, 8192, 1024  # 64 MiB sources: freed, they go back to the OS
    class Src:
        k = 0
        def __iter__(self):
            Src.k += 1
            a = np.full((N, D), Src.k, np.float32)
            reg, why = _C.register_rows(a, None, "cpu")
            probe = _C.RowGather(a, np.empty(0, np.int64), None, None, reg)
            reg.close()  # the RowGather keeps its own hold on the registered range
            return _C.RowBatches([("x", probe, False, None, 0, None)], _C.epoch_table(np.arange(N)), BS, N // BS)
    pf = AsyncPrefetcher(Src(), device="cpu", depth=2, structure=(np.empty((1, D), np.float32),))
    bad = 0
    for e in range(1, 9):
        _C._testing.debug_hold_copies(True)
        got = [next(pf) for _ in range(2)]
        iter(pf)  # the next epoch: the producer retires this one's RowBatches
        junk = [np.ones((N, D), np.float32) for _ in range(2)]
        _C._testing.debug_hold_copies(False)
        bad += sum(not (np.from_dlpack(b[0]) == e).all() for b in got)
        del junk, got
    pf.close()
    print("BAD", bad)
    """
    p = run_py(code, timeout=120, watchdog=True)
    assert p.returncode == 0 and "BAD 0" in p.stdout, describe(p)


@pytest.mark.hostile
def test_closing_the_registration_does_not_pull_the_range_from_under_an_epoch():
    a = np.arange(4096 * 1024, dtype=np.float32).reshape(4096, 1024)
    base = _C._testing.registered_bytes("host")
    reg, why = _C.register_rows(a, None, "cpu")
    assert reg is not None, why
    rb = _C.RowBatches([("x", _C.RowGather(a, [], None, None, reg), False, None, 0, None)],
                       _C.epoch_table(np.arange(4096)), 64, 64)
    pf = pinloader.AsyncPrefetcher(rb, device="cpu", depth=1, structure=(np.empty((1, 1024), np.float32),))
    first = next(pf)
    reg.close()  # the epoch's probe still holds the range
    assert _C._testing.registered_bytes("host") > base
    junk = [bytearray(64) for _ in range(20000)]
    rest = list(pf)
    got = np.concatenate([np.from_dlpack(first[0])] + [np.from_dlpack(b[0]) for b in rest])
    assert np.array_equal(got, a)
    del rb, pf, rest, first, junk
    import gc
    gc.collect()
    assert _C._testing.registered_bytes("host") == base  # unregistered with the last holder


def test_a_source_cut_between_epochs_is_the_first_batchs_error_and_ends_the_epoch(tmp_path):
    # found when the epoch begins, reported as the generator did: by the first next(), after
    # which the loader hands out nothing stale
    path = tmp_path / "cut.bin"
    mm = np.memmap(path, dtype=np.float32, mode="w+", shape=(400, 16))
    mm[:] = np.arange(400, dtype=np.float32)[:, None]
    mm.flush()
    L = pinloader.ArrayLoader({"x": mm}, 40, device=DEVICE, shuffle=False)
    assert len(collect(L)) == 10
    os.truncate(path, 4096)
    it = iter(L)  # no error yet
    with pytest.raises(ValueError, match=r"arrays\['x'\]: the memory-mapped file .*cut.bin was truncated"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(ValueError, match="was truncated"):
        list(L)  # and again at the next epoch
    L.close()


def test_descriptors_one_per_mapped_file_opened_once_per_loader(tmp_path):
    def fds():
        return len(os.listdir("/proc/self/fd"))
    maps = {}
    for k in range(40):
        mm = np.memmap(tmp_path / f"m{k}.bin", dtype=np.int32, mode="w+", shape=(200, 4))
        mm[:] = k
        maps[f"m{k}"] = mm
    maps["again"] = np.memmap(tmp_path / "m0.bin", dtype=np.int32, mode="r", shape=(200, 4))  # the same file
    base = fds()
    L = pinloader.ArrayLoader(maps, 50, device=DEVICE)
    counts = []
    for _ in range(4):
        got = collect(L)
        assert all((g["m7"] == 7).all() and (g["again"] == 0).all() for g in got)
        counts.append(fds())
    assert L.stats()["producer_gil_holds"] == 4  # native epochs, not the generator
    L.close()
    del L
    import gc
    gc.collect()
    # one descriptor per file (m0 once), the same in every epoch, all closed with the loader
    assert counts[0] - base <= 40 + 8 and len(set(counts)) == 1, (base, counts)
    assert fds() <= base + 2


@pytest.mark.hostile
def test_a_mapped_files_name_now_naming_a_fifo_does_not_hang(tmp_path):
    code = f"""
    import os, numpy as np, pinloader
    p = {str(tmp_path / "f.bin")!r}
    mm = np.memmap(p, np.float32, "w+", shape=(1000, 16)); mm[:] = 1; mm.flush()
    L = pinloader.ArrayLoader({{"x": mm}}, 100, device="cpu")
    os.unlink(p); os.mkfifo(p)
    print("BATCHES", len(list(L)), flush=True)
    L.close()
    """
    p = run_py(code, timeout=60, watchdog=True)
    assert p.returncode == 0 and "BATCHES 10" in p.stdout, describe(p)


def test_a_failed_batch_read_from_python_is_read_again(tmp_path):
    path, L, rb = cut_after_one_batch(tmp_path)
    with pytest.raises(ValueError, match="truncated"):
        next(rb)
    os.truncate(path, 1000 * 64 * 4)
    assert next(rb)[0].rows[0] == 100  # batch 1, not skipped
    del rb
    L.close()


def test_mapped_files_are_matched_with_one_read_of_the_maps(tmp_path, monkeypatch):
    # _open_matching in pinloader/_mapped.py: a read of /proc/self/maps per mapped file is
    # O(files x mappings) at the first native epoch (24 s for 3,000 memmapped files)
    import pinloader._mapped as mapped_mod
    leaves = {}
    for i in range(20):
        mm = np.memmap(tmp_path / f"m{i}.bin", dtype=np.int32, mode="w+", shape=(400, 8))
        mm[:] = np.arange(400, dtype=np.int32)[:, None]
        mm.flush()
        leaves[f"x{i}"] = mm
    reads = []
    real = mapped_mod._maps_lines
    monkeypatch.setattr(mapped_mod, "_maps_lines", lambda addrs: reads.append(len(addrs)) or real(addrs))
    with pinloader.ArrayLoader(leaves, 50, device=DEVICE, seed=4) as L:
        got = np.concatenate([g["x7"] for g in collect(L)])
        st = L.stats()
    assert st["epoch_source"] == "native", st["epoch_source_reason"]
    assert np.array_equal(got[:, 0], L.indices(0))
    assert len(reads) <= 2, reads
