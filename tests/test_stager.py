"""The stager (src/core/stager.c): how a batch's leaves reach pinned memory (host backend).

A batch that stages two chunks (8 MiB each) or more is copied chunk by chunk by the staging
threads: the last, partial chunk is exact to the byte, whatever the number of threads. Leaves
already in pinned memory (PinnedBuffer views of 64 KiB and more) skip staging and are copied
straight to the device block, after the staged leaves; on the host backend they take the same
direct path as on CUDA, so that layout is checked here on CI.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pinloader
from helpers import ALIGN, MiB, drain

DEVICE = "cpu"


# ---- chunked staging -----------------------------------------------------------------------------

CHUNK = 8 * MiB  # the staging chunk: batches staging >= 2 chunks are copied chunk by chunk


def odd_bytes(seed, n):
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def assert_bytes_equal(expected, leaf, where):
    got = np.from_dlpack(leaf)
    assert got.shape == expected.shape and got.dtype == expected.dtype, where
    if not np.array_equal(got.view(np.uint8).reshape(-1), expected.view(np.uint8).reshape(-1)):
        diff = np.flatnonzero(got.view(np.uint8).reshape(-1) != expected.view(np.uint8).reshape(-1))
        raise AssertionError(f"{where}: {diff.size} bytes differ, first at byte {diff[0]} "
                             f"of {expected.nbytes}")


# Staged totals around and past the chunked path: the last chunk is partial unless the total is a
# multiple of CHUNK (one thread stages inline on the calling thread: the default on 1-CPU hosts).
# The ones that are multiples of the 256-byte alignment end exactly at the end of the staged
# region: a short last chunk loses a data byte there, not padding.
STAGED_SIZES = [2 * CHUNK + 256, 3 * CHUNK - 256, 2 * CHUNK + 1, 2 * CHUNK + 255, 3 * CHUNK - 3,
                2 * CHUNK - 1, 2 * CHUNK]
def test_large_leaf_multithreaded_chunked_staging():
    # 64 MiB contiguous plus a 32 MiB strided view: both above the 2 x 8 MiB chunking threshold,
    # staged by two threads.
    big = np.arange(16 << 20, dtype=np.float32)  # 64 MiB
    strided_base = np.arange(8 << 20, dtype=np.int64).reshape(2048, 4096)  # 64 MiB
    strided = strided_base[:, ::2]  # 32 MiB, non-contiguous
    items = [
        {"big": big, "strided": strided, "tag": "a"},
        {"big": big[::-1], "strided": strided[::-1], "tag": "b"},
    ]
    pf = pinloader.AsyncPrefetcher(items, device=DEVICE, staging_threads=2)
    try:
        assert pf.staging_threads == 2
        out = drain(pf)
        assert len(out) == 2
        for exp, got in zip(items, out):
            assert got["tag"] is exp["tag"]
            for k in ("big", "strided"):
                leaf = got[k]
                assert leaf.shape == exp[k].shape and leaf.dtype == exp[k].dtype
                assert np.array_equal(np.from_dlpack(leaf), exp[k])
        st = pf.stats()
        assert st["bytes"] >= 2 * (big.nbytes + strided.nbytes)
    finally:
        pf.close()


@pytest.mark.parametrize("threads,nbytes", [(1, n) for n in STAGED_SIZES] + [
    (2, STAGED_SIZES[0]), (2, STAGED_SIZES[2]), (3, STAGED_SIZES[1]), (4, STAGED_SIZES[3])])
def test_chunked_staging_last_partial_chunk_is_exact(threads, nbytes):
    # A single leaf, and the same bytes through a non-contiguous view, every byte checked.
    data = odd_bytes(nbytes, nbytes)
    strided = np.lib.stride_tricks.as_strided(data, shape=(nbytes // 2,), strides=(2,))
    items = [{"flat": data}, {"strided": strided}, (data[::-1],)]
    with pinloader.AsyncPrefetcher(items, device=DEVICE, staging_threads=threads, depth=1) as pf:
        assert pf.staging_threads == threads
        b0 = next(pf)
        assert_bytes_equal(data, b0["flat"], f"flat {nbytes} B, {threads} thread(s)")
        del b0
        b1 = next(pf)
        assert_bytes_equal(strided, b1["strided"], f"strided {nbytes // 2} B")
        del b1
        b2 = next(pf)
        assert_bytes_equal(data[::-1], b2[0], f"reversed {nbytes} B")
        with pytest.raises(StopIteration):
            next(pf)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_chunked_staging_multi_leaf_batch_of_odd_sizes(threads):
    # Many leaves of odd sizes whose aligned total is >= 2 chunks and not a multiple of a chunk:
    # leaves straddle chunk boundaries, and the last chunk is partial.
    # (first and last end on the 256-byte alignment, so in both orders the region's last byte is data)
    sizes = [5 * MiB + 256, 1, 3 * MiB + 255, 257, 7 * MiB + 1, 4 * MiB - 3, 12345, 0, 99, 4352]
    leaves = [odd_bytes(i, n) for i, n in enumerate(sizes)]
    leaves[2] = leaves[2].view(np.uint8)[::-1]  # one strided (reversed) leaf among them
    assert sum(-(-n // ALIGN) * ALIGN for n in sizes) >= 2 * CHUNK
    assert sum(-(-n // ALIGN) * ALIGN for n in sizes) % CHUNK
    items = [{"leaves": list(leaves), "i": i} for i in range(2)]
    items[1]["leaves"] = leaves[::-1]
    with pinloader.AsyncPrefetcher(items, device=DEVICE, staging_threads=threads) as pf:
        for exp in items:
            got = next(pf)
            assert got["i"] == exp["i"]
            for j, (e, g) in enumerate(zip(exp["leaves"], got["leaves"])):
                assert_bytes_equal(e, g, f"batch {exp['i']} leaf {j} ({e.nbytes} B, {threads} thread(s))")
            del got


# ---- direct copies of pinned sources -------------------------------------------------------------

def test_pinned_views_interleaved_with_staged_leaves():
    pool = pinloader.PinnedPool(max_bytes=64 << 20, device="cpu")
    bufs = [pool.alloc(1 << 20) for _ in range(6)]
    arrays = [np.frombuffer(b, dtype=np.float32) for b in bufs]
    for i, a in enumerate(arrays):
        a[:] = np.arange(a.size, dtype=np.float32) * (i + 1)
    small = np.arange(10.0)
    src = [(small, arrays[2 * i], small[::-1], {"p": arrays[2 * i + 1]}) for i in range(3)]
    with pinloader.AsyncPrefetcher(src, device="cpu") as pf:
        out = list(pf)
    assert len(out) == 3
    for s, b in zip(src, out):
        np.testing.assert_array_equal(np.from_dlpack(b[0]), s[0])
        np.testing.assert_array_equal(np.from_dlpack(b[1]), s[1])
        np.testing.assert_array_equal(np.from_dlpack(b[2]), s[2])
        np.testing.assert_array_equal(np.from_dlpack(b[3]["p"]), s[3]["p"])


def test_only_pinned_leaves_need_no_pinned_region():
    pool = pinloader.PinnedPool(max_bytes=16 << 20, device="cpu")
    bufs = [pool.alloc(256 << 10) for _ in range(4)]
    arrays = [np.frombuffer(b, dtype=np.uint8) for b in bufs]
    for i, a in enumerate(arrays):
        a[:] = i
    with pinloader.AsyncPrefetcher([[a] for a in arrays], device="cpu") as pf:
        got = [np.from_dlpack(b[0]).copy() for b in pf]
        st = pf.stats()
    for i, g in enumerate(got):
        assert (g == i).all()
    assert st["pinned_bytes_reserved"] == 0  # nothing was staged


# ---- property: pinned (direct) leaves of >= 64 KiB mixed with staged leaves ----------------------

DIRECT_MIN = 64 << 10  # pinned, C-contiguous leaves of at least this size are copied directly


@st.composite
def mixed_leaf(draw):
    if draw(st.booleans()):
        # a PinnedBuffer view: at, just over or well over the direct threshold (or, rarely, under
        # it: then it is staged like any other leaf), of a random dtype, possibly sliced so that
        # it starts inside the buffer
        n = draw(st.sampled_from([DIRECT_MIN, DIRECT_MIN + 8, DIRECT_MIN + 4096, 200_000,
                                  1 << 20, DIRECT_MIN - 8]))
        dtype = draw(st.sampled_from([np.uint8, np.float32, np.int64, np.complex128]))
        skip = draw(st.sampled_from([0, 0, 1, 3]))
        return ("pinned", n, np.dtype(dtype).str, skip, draw(st.integers(0, 2**32 - 1)))
    shape = tuple(draw(st.lists(st.integers(0, 40), min_size=0, max_size=3)))
    step = draw(st.sampled_from([1, 1, -1, 2]))
    dtype = draw(st.sampled_from([np.uint8, np.int16, np.float64]))
    return ("staged", shape, np.dtype(dtype).str, step, draw(st.integers(0, 2**32 - 1)))


def build_mixed(spec, pool, keep):
    rng = np.random.default_rng(spec[-1])
    if spec[0] == "pinned":
        _, n, dtype, skip, _ = spec
        buf = pool.alloc(n)
        keep.append(buf)
        raw = np.frombuffer(buf, np.uint8)
        raw[:] = rng.integers(0, 256, size=n, dtype=np.uint8)
        view = np.frombuffer(buf, np.dtype(dtype), count=n // np.dtype(dtype).itemsize)[skip:]
        return view
    _, shape, dtype, step, _ = spec
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    a = rng.integers(0, 256, size=n, dtype=np.uint8).view(dtype).reshape(shape)
    return a[::step] if a.ndim else a


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(st.lists(mixed_leaf(), min_size=1, max_size=6), min_size=1, max_size=3),
       nest=st.booleans())
def test_pinned_and_staged_leaves_mixed_land_at_their_positions(batches, nest):
    pool = pinloader.PinnedPool(max_bytes=64 << 20, device="cpu")
    keep = []
    items = []
    for specs in batches:
        leaves = [build_mixed(s, pool, keep) for s in specs]
        # each leaf at a known position: a list, or a dict of tuples when nested
        items.append({f"k{i}": (i, leaf) for i, leaf in enumerate(leaves)} if nest else leaves)
    with pinloader.AsyncPrefetcher(items, device="cpu") as pf:
        out = list(pf)
    assert len(out) == len(items)
    checked = []
    for b, (item, got) in enumerate(zip(items, out)):
        if nest:
            assert list(got) == list(item)
            pairs = [(item[k][1], got[k][1], f"batch {b} [{k!r}][1]") for k in item]
            assert all(got[k][0] == item[k][0] for k in item)
        else:
            assert type(got) is list and len(got) == len(item)
            pairs = [(e, g, f"batch {b} [{i}]") for i, (e, g) in enumerate(zip(item, got))]
        ranges = []
        for exp, leaf, where in pairs:
            assert isinstance(leaf, pinloader.DeviceArray), where
            assert leaf.shape == exp.shape and leaf.dtype == exp.dtype, where
            assert leaf.nbytes == exp.nbytes, where
            if exp.nbytes:
                assert leaf.ptr % ALIGN == 0, f"{where}: not {ALIGN}-byte aligned"
                # every byte, read at the address the DeviceArray reports
                raw = exp.tobytes()
                leaf.__dlpack__()  # waits for the batch's copy: .ptr itself is raw memory
                assert ctypes.string_at(leaf.ptr, leaf.nbytes) == raw, f"{where}: bytes differ"
                checked.append((leaf, raw, where))
                ranges.append((leaf.ptr, leaf.ptr + leaf.nbytes, where))
        # no two leaves of a batch share device bytes
        ranges.sort()
        for (a0, a1, wa), (b0, b1, wb) in zip(ranges, ranges[1:]):
            assert a1 <= b0, f"{wa} [{a0:#x}, {a1:#x}) overlaps {wb} [{b0:#x}, {b1:#x})"
    # the copies are the prefetcher's own: overwriting the pinned sources changes none of them
    for buf in keep:
        np.frombuffer(buf, np.uint8)[:] = 0
    for leaf, raw, where in checked:
        assert ctypes.string_at(leaf.ptr, leaf.nbytes) == raw, f"{where}: changed with its source"
