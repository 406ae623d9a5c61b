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
