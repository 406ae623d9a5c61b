"""Sources already in pinned memory skip staging and are copied straight to the device block.

On the host backend a PinnedBuffer view takes the same direct path as on CUDA, so the layout
(staged leaves first, direct leaves after them in the device block) is checked here on CI.
"""
import numpy as np

import pinloader


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

import ctypes  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DIRECT_MIN = 64 << 10  # pinned, C-contiguous leaves of at least this size are copied directly
ALIGN = 256


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
