"""PinnedPool under hostile sizes and timeouts (host backend; marked hostile).

Every rounding in the pool and the host backend is checked (Note [checked sizes] in
src/core/util.h), so absurd caps and requests raise a clear error and never wrap; a cap at the top
of size_t stays consistent when the OS refuses the memory; a request of exactly the cap fits
where rounding would pass it; a NaN timeout is refused and an infinite one waits.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import pinloader

pytestmark = pytest.mark.hostile


@pytest.mark.parametrize("max_bytes, exc", [
    (0, ValueError), (-1, ValueError), (-(2**70), ValueError),
    (2**64, OverflowError), (2**80, OverflowError), (1.5, TypeError), ("1", TypeError),
])
def test_pool_cap_refused_cleanly(max_bytes, exc):
    with pytest.raises(exc, match="max_bytes"):
        pinloader.PinnedPool(max_bytes=max_bytes, device="cpu")


def test_pool_cap_at_the_top_of_size_t_never_wraps():
    pool = pinloader.PinnedPool(max_bytes=2**64 - 1, device="cpu")
    assert pool.max_bytes == 2**64 - 1
    # Larger than any buffer: refused before the pool is asked.
    for n in (2**63, 2**64 - 200, 2**64 - 1):
        with pytest.raises(pinloader.PoolExhausted, match=str(n)):
            pool.alloc(n)
    # Fits the cap, but no address space holds it: the OS refuses, the pool stays consistent.
    for n in (2**63 - 1, 2**63 - 256, 2**62):
        with pytest.raises(MemoryError):
            pool.alloc(n)
    s = pool.stats()
    assert s["in_use_bytes"] == 0 and s["regions"] == 0 and s["reserved_bytes"] == 0, s
    with pool.alloc(1000) as b:               # still an ordinary pool
        np.frombuffer(b, np.uint8)[:] = 3
        assert b.nbytes == 1000
    pool.close()


@pytest.mark.parametrize("n, exc", [
    (-1, ValueError), (-(2**64), ValueError), (2**64, OverflowError), (2**100, OverflowError),
    (1.0, TypeError), (None, TypeError),
])
def test_alloc_size_refused_cleanly(n, exc):
    pool = pinloader.PinnedPool(max_bytes=1 << 20, device="cpu")
    with pytest.raises(exc, match="nbytes"):
        pool.alloc(n)
    assert pool.stats()["regions"] == 0


@pytest.mark.parametrize("n", [2**62, 2**63 - 1, (1 << 20) + 1, (1 << 20) * 2])
def test_alloc_over_cap_is_pool_exhausted(n):
    pool = pinloader.PinnedPool(max_bytes=1 << 20, device="cpu")
    with pytest.raises(pinloader.PoolExhausted, match="never fit"):
        pool.alloc(n)
    assert pool.stats()["slabs"] == 0


def test_alloc_exactly_the_cap_when_rounding_would_pass_it():
    # Rounding (Note [region sizes]) would take 2**20 + 2**17 - ...; the request still fits.
    pool = pinloader.PinnedPool(max_bytes=(1 << 20) + 1, device="cpu")
    with pool.alloc((1 << 20) + 1) as b:
        assert b.nbytes == (1 << 20) + 1
    assert pool.stats()["reserved_bytes"] <= (1 << 20) + 1


def test_timeout_nan_refused_and_inf_means_no_limit():
    pool = pinloader.PinnedPool(max_bytes=1 << 16, device="cpu")
    with pytest.raises(ValueError, match="timeout"):
        pool.alloc(100, timeout=float("nan"))
    with pytest.raises(ValueError, match="timeout"):
        pool.alloc(100, timeout=-1e-9)
    with pytest.raises(ValueError, match="timeout"):
        pool.alloc(100, timeout=float("-inf"))
    first = pool.alloc(1 << 16, timeout=float("inf"))
    # The pool is full: an infinite (or absurdly long) timeout waits until a region comes back.
    for timeout in (float("inf"), 1e300, 2.0**63):
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("b", pool.alloc(1 << 16, timeout=timeout)))
        t.start()
        t.join(0.2)
        assert t.is_alive(), "alloc returned while the pool was full"
        first.release()
        t.join(30)
        assert not t.is_alive()
        first = got["b"]
        assert first.nbytes == 1 << 16
    first.release()
