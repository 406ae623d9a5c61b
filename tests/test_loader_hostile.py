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
