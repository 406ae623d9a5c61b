"""PINLOADER_DEBUG=1 (in subprocesses that set it): ordinary epochs, with a private pool, a
shared one and a pinned bound, report no violation; a write past the end of a pinned region is
reported when the region is released.
"""
from __future__ import annotations

from helpers import describe, run_py


def test_debug_mode_normal_epochs_report_no_violation():
    code = """
import faulthandler, gc
import numpy as np
import pinloader
from pinloader import _C
faulthandler.dump_traceback_later(30, exit=True)

rng = np.random.default_rng(0)
items = []
for i in range(60):
    items.append({
        "a": rng.standard_normal((i % 9 + 1, 33)).astype(np.float32),
        "b": np.arange(i * 37 % 1000, dtype=np.int16)[::-1],
        "c": [np.full(5, i), "meta", None],
        "big": np.full((1 << 16) + 7, i, dtype=np.uint8) if i % 10 == 0 else None,
    })
pool = pinloader.PinnedPool(max_bytes=4 << 20, device="cpu")
for kwargs in ({}, {"pool": pool}, {"max_pinned_bytes": 1 << 20, "depth": 4}):
    with pinloader.AsyncPrefetcher(items, device="cpu", **kwargs) as pf:
        for epoch in range(2):
            n = 0
            for b in pf:
                assert (np.from_dlpack(b["c"][0]) == n).all()
                assert np.array_equal(np.from_dlpack(b["a"]), items[n]["a"])
                n += 1
            assert n == len(items)
held = None
pool.close()
gc.collect()
print("VIOLATION", repr(_C._testing.debug_violation()), flush=True)
"""
    p = run_py(code, timeout=60, env_extra={"PINLOADER_DEBUG": "1"})
    assert p.returncode == 0, describe(p)
    assert "VIOLATION None" in p.stdout, describe(p)
    assert "pinloader debug:" not in p.stderr, describe(p)


def test_debug_mode_reports_a_write_past_a_pinned_region():
    code = """
import ctypes, pinloader
pool = pinloader.PinnedPool(max_bytes=1 << 20, device="cpu")
buf = pool.alloc(1000)
assert pinloader._C._testing.debug_violation() is None
ctypes.memset(buf.ptr + 1000, 0x11, 4)   # 4 bytes past the end
buf.release()
print("VIOLATION", pinloader._C._testing.debug_violation(), flush=True)
"""
    p = run_py(code, timeout=60, env_extra={"PINLOADER_DEBUG": "1"})
    assert p.returncode == 0, describe(p)
    assert "VIOLATION pinned region" in p.stdout and "written past its end at byte 1000" in p.stdout, describe(p)
