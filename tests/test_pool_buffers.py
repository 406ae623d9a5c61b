"""PinnedBuffer, and the PinnedPool's lifecycle (host backend; one gpu-marked check on CUDA).

A PinnedBuffer shares its bytes with NumPy, memoryview, DLPack and torch views; release() is
refused while a view lives, is idempotent, and the buffer is dead after it; a buffer keeps its
pool alive and gives its region back when dropped; a DLPack view keeps the region after the
buffer object is gone. The pool's close(), trim() and argument checks; on CUDA its regions are
page-locked.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import pinloader
from pinloader import PinnedPool
from helpers import ALIGN, MiB, pool_stats


# ---- buffer protocol, DLPack ---------------------------------------------------------------------

def test_numpy_and_memoryview_share_bytes(make_pool):
    pool = make_pool(4 * MiB)
    n = 10_000
    buf = pool.alloc(n)
    a = np.frombuffer(buf, dtype=np.uint8)
    m = memoryview(buf)
    assert a.size == n and len(m) == n and m.nbytes == n
    assert not m.readonly and a.flags.writeable
    assert a.ctypes.data == buf.ptr
    data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    a[:] = data
    assert m.tobytes() == data.tobytes()  # written through numpy, read through memoryview
    m[100:104] = b"pinl"
    assert a[100:104].tobytes() == b"pinl"  # written through memoryview, read through numpy
    # a second frombuffer sees the same memory too
    b2 = np.frombuffer(buf, dtype=np.uint32, count=4, offset=8)
    b2[:] = [1, 2, 3, 4]
    assert a[8:24].view(np.uint32).tolist() == [1, 2, 3, 4]
    del a, b2
    m.release()
    buf.release()


def test_dlpack_shares_memory(make_pool):
    pool = make_pool(4 * MiB)
    n = 4099
    buf = pool.alloc(n)
    assert buf.__dlpack_device__() == (3, 0)
    d = np.from_dlpack(buf)
    assert d.shape == (n,) and d.dtype == np.uint8
    assert d.ctypes.data == buf.ptr
    d[:] = 7
    mv = memoryview(buf)
    assert mv.tobytes() == b"\x07" * n
    mv[0] = 200
    assert d[0] == 200
    mv.release()
    with pytest.raises(BufferError):
        buf.release()
    del d
    gc.collect()
    buf.release()
    assert buf.released


def test_dlpack_capsule_versions_and_refusals(make_pool):
    pool = make_pool(1 * MiB)
    buf = pool.alloc(64)
    cap = buf.__dlpack__()
    assert type(cap).__name__ == "PyCapsule" and "dltensor" in repr(cap)
    cap_v = buf.__dlpack__(max_version=(1, 0))
    assert "dltensor_versioned" in repr(cap_v)
    with pytest.raises(BufferError):
        buf.release()  # two unconsumed capsules keep it exported
    del cap, cap_v
    gc.collect()
    with pytest.raises(BufferError):
        buf.__dlpack__(stream=1)
    with pytest.raises(BufferError):
        buf.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(2, 0))
    buf.__dlpack__(dl_device=(1, 0))  # kDLCPU is fine
    gc.collect()
    buf.release()


def test_torch_from_dlpack_shares_memory(make_pool):
    torch = pytest.importorskip("torch")
    pool = make_pool(4 * MiB)
    n = 1 << 16
    buf = pool.alloc(n)
    t = torch.from_dlpack(buf)
    assert t.device.type == "cpu"
    assert t.dtype == torch.uint8 and t.numel() == n
    assert t.data_ptr() == buf.ptr
    t.fill_(9)
    a = np.frombuffer(buf, np.uint8)
    assert (a == 9).all()
    a[5] = 42
    assert int(t[5]) == 42
    del a
    with pytest.raises(BufferError):
        buf.release()
    del t
    gc.collect()
    buf.release()


def test_dlpack_view_outlives_the_buffer_object():
    # The region belongs to the buffer and to every tensor exported from it: dropping the
    # PinnedBuffer first must neither free the memory under the view nor leak it after.
    pool = pinloader.PinnedPool(max_bytes=4 << 20, device="cpu")
    buf = pool.alloc(4096)
    np.frombuffer(buf, dtype=np.uint8)[:] = 7
    view = np.from_dlpack(buf)
    with pytest.raises(BufferError, match="DLPack"):
        buf.release()
    del buf
    gc.collect()
    assert pool.stats()["in_use_bytes"] > 0
    other = pool.alloc(4096)  # must not be handed the region the view still reads
    np.frombuffer(other, dtype=np.uint8)[:] = 9
    assert (view == 7).all()
    del view
    gc.collect()
    other.release()
    assert pool.stats()["in_use_bytes"] == 0


# ---- lifecycle -----------------------------------------------------------------------------------

def test_release_refused_while_view_alive(make_pool):
    pool = make_pool(1 * MiB)
    buf = pool.alloc(1000)
    m = memoryview(buf)
    a = np.frombuffer(buf, np.uint8)
    with pytest.raises(BufferError) as ei:
        buf.release()
    assert "buffer views" in str(ei.value)
    assert not buf.released
    m.release()
    with pytest.raises(BufferError):
        buf.release()  # the numpy array still holds a view
    assert pool_stats(pool)["in_use_bytes"] > 0
    del a
    buf.release()
    assert buf.released and buf.nbytes == 0 and len(buf) == 0
    assert pool_stats(pool)["in_use_bytes"] == 0


def test_release_is_idempotent_and_buffer_dead_after(make_pool):
    pool = make_pool(1 * MiB)
    keep = pool.alloc(512)
    buf = pool.alloc(1000)
    buf.release()
    s = pool_stats(pool)
    buf.release()  # no error, no double free
    buf.release()
    assert pool_stats(pool)["in_use_bytes"] == s["in_use_bytes"] == 512
    assert pool_stats(pool)["regions"] == 1
    with pytest.raises(BufferError):
        memoryview(buf)
    with pytest.raises(ValueError):
        buf.ptr
    with pytest.raises(ValueError):
        buf.__dlpack__()
    with pytest.raises(ValueError):
        with buf:
            pass
    # the freed region is handed out once, not twice
    x, y = pool.alloc(1000), pool.alloc(1000)
    assert x.ptr != y.ptr
    for b in (x, y, keep):
        b.release()
    assert pool_stats(pool)["regions"] == 0


def test_buffer_context_manager(make_pool):
    pool = make_pool(1 * MiB)
    with pool.alloc(2048) as b:
        assert not b.released and b.pool is pool
        np.frombuffer(b, np.uint8)[:] = 1
        assert pool_stats(pool)["in_use_bytes"] >= 2048
    assert b.released
    assert pool_stats(pool)["in_use_bytes"] == 0
    # exiting while a view is alive refuses, and the region stays out
    with pytest.raises(BufferError):
        with pool.alloc(100) as c:
            v = memoryview(c)
    assert not c.released
    v.release()
    c.release()
    assert pool_stats(pool)["regions"] == 0


def test_dealloc_without_release_returns_region(make_pool):
    pool = make_pool(1 * MiB)
    buf = pool.alloc(5000)
    assert pool_stats(pool)["regions"] == 1
    del buf
    gc.collect()
    s = pool_stats(pool)
    assert s["regions"] == 0 and s["in_use_bytes"] == 0


def test_buffer_keeps_pool_alive():
    buf = PinnedPool(max_bytes=1 * MiB, device="cpu").alloc(300)
    pool = buf.pool
    assert isinstance(pool, PinnedPool)
    np.frombuffer(buf, np.uint8)[:] = 3
    assert memoryview(buf).tobytes() == b"\x03" * 300
    assert pool.stats()["regions"] == 1
    buf.release()
    assert pool.stats()["regions"] == 0


def test_close_then_alloc_raises(make_pool):
    pool = make_pool(1 * MiB)
    with pool.alloc(100):
        pass
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        pool.alloc(10)
    assert "closed" in repr(pool)
    assert pool.stats()["reserved_bytes"] == 0  # close gives idle slabs back


def test_pool_context_manager_and_live_buffer_across_close(make_pool):
    with PinnedPool(max_bytes=1 * MiB, device="cpu") as pool:
        buf = pool.alloc(4096)
        np.frombuffer(buf, np.uint8)[:] = 0xAB
    with pytest.raises(ValueError):
        pool.alloc(1)
    # A buffer handed out before close stays valid; its slab goes back when it is released.
    assert memoryview(buf).tobytes() == b"\xab" * 4096
    assert pool.stats()["reserved_bytes"] > 0
    buf.release()
    s = pool.stats()
    assert s["regions"] == 0 and s["reserved_bytes"] == 0 and s["slabs"] == 0


def test_trim_frees_idle_slabs(make_pool):
    pool = make_pool(8 * MiB)
    a = pool.alloc(1 * MiB)
    s = pool_stats(pool)
    assert s["reserved_bytes"] > 0 and s["slabs"] == 1
    assert pool.trim() == 0  # the only slab has a live region
    assert pool_stats(pool)["reserved_bytes"] == s["reserved_bytes"]
    a.release()
    freed = pool.trim()
    assert freed == s["reserved_bytes"]
    s2 = pool_stats(pool)
    assert s2["reserved_bytes"] == 0 and s2["slabs"] == 0 and s2["slabs_freed"] == 1
    assert pool.trim() == 0
    with pool.alloc(1000) as b:  # the pool makes a new slab after a trim
        assert b.nbytes == 1000
    assert pool_stats(pool)["slabs_created"] == 2


def test_argument_checks():
    with pytest.raises(ValueError):
        PinnedPool(max_bytes=0, device="cpu")
    with pytest.raises(ValueError):
        PinnedPool(max_bytes=-5, device="cpu")
    pool = PinnedPool(max_bytes=1 * MiB, device="cpu")
    assert pool.max_bytes == 1 * MiB and pool.backend == "host"
    with pytest.raises(ValueError):
        pool.alloc(-1)
    with pytest.raises(ValueError):
        pool.alloc(10, timeout=-1)
    with pool.alloc(0) as z:
        assert z.nbytes == 0 and z.ptr % ALIGN == 0
    default = PinnedPool(device="cpu")
    assert default.max_bytes == pinloader.default_pinned_cap() > 0
    pool.close()
    default.close()


# ---- CUDA ----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_pool_regions_are_pinned():
    from pinloader import _C

    prim = _C._testing.Prim("cuda:0")
    with PinnedPool(max_bytes=64 * MiB, device="cuda:0") as pool:
        assert pool.backend == "cuda"
        bufs = [pool.alloc(n) for n in (1, 4096, 3 * MiB + 7)]
        for b in bufs:
            assert b.ptr % ALIGN == 0
            assert prim.is_pinned(b.ptr) is True
            assert prim.is_pinned(b.ptr + b.nbytes - 1) is True
            np.frombuffer(b, np.uint8)[:] = 5
            assert memoryview(b).tobytes() == b"\x05" * b.nbytes
        for b in bufs:
            b.release()
