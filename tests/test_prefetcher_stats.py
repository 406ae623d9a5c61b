"""AsyncPrefetcher.stats() (host backend): every field present, typed and sane; the payload
bytes counted apart from the alignment padding, direct (pinned) leaves included.
"""
from __future__ import annotations

import numpy as np

import pinloader
from helpers import ALIGN, drain

DEVICE = "cpu"


STATS_KEYS = {
    "batches", "bytes", "padding_bytes", "h2d_gbps", "wait_s_total", "wait_ms_mean", "wait_ms_p99", "next_s_total",
    "staging_s_total", "copy_issue_s_total", "pinned_bytes_in_use", "pinned_bytes_reserved",
    "pinned_bytes_peak", "pinned_cap", "device_bytes_peak", "pinned_stalls", "pinned_stall_s",
    "queued", "backend", "sort_s_total", "gil_wait_s_total", "producer_s_total", "producer_gil_holds",
}


def test_stats_fields_are_sane():
    rng = np.random.default_rng(0)
    items = []
    for i in range(12):
        items.append({
            "a": rng.standard_normal((i + 1, 7)).astype(np.float32),
            "b": np.zeros(i * 100, np.uint8),
            "c": np.arange(3, dtype=np.int16)[::-1],
            "s": "meta",
        })
    pf = pinloader.AsyncPrefetcher(items, device=DEVICE, depth=3)
    try:
        st0 = pf.stats()
        assert set(st0) >= STATS_KEYS, STATS_KEYS - set(st0)
        out = drain(pf)
        st = pf.stats()
    finally:
        pf.close()
    assert len(out) == 12
    assert st["batches"] == 12
    raw = sum(v.nbytes for it in items for v in it.values() if isinstance(v, np.ndarray))
    rounded = sum(-(-v.nbytes // ALIGN) * ALIGN for it in items for v in it.values()
                  if isinstance(v, np.ndarray))
    assert st["bytes"] == raw  # payload only; alignment is reported apart
    assert st["bytes"] + st["padding_bytes"] == rounded
    assert st["backend"] == "host"
    for k in ("h2d_gbps", "wait_s_total", "wait_ms_mean", "wait_ms_p99", "next_s_total",
              "staging_s_total", "copy_issue_s_total", "pinned_stall_s", "sort_s_total",
              "gil_wait_s_total", "producer_s_total"):
        assert isinstance(st[k], float) and st[k] >= 0.0, k
    for k in ("pinned_bytes_in_use", "pinned_bytes_reserved", "pinned_bytes_peak", "pinned_cap",
              "device_bytes_peak", "pinned_stalls", "queued"):
        assert isinstance(st[k], int) and st[k] >= 0, k
    assert st["pinned_bytes_peak"] >= st["pinned_bytes_reserved"] > 0
    assert st["pinned_bytes_reserved"] <= st["pinned_cap"]
    assert st["pinned_bytes_in_use"] <= st["pinned_bytes_reserved"]
    assert st["device_bytes_peak"] >= max(-(-v.nbytes // ALIGN) * ALIGN for v in items[-1].values()
                                          if isinstance(v, np.ndarray))
    assert 0 <= st["queued"] <= 3
    assert st["sort_s_total"] == 0.0  # no device-gathered leaf: no pair table was built
    # the producer's rounds contain their own waits for the GIL and the source's next()
    assert st["producer_s_total"] >= st["gil_wait_s_total"] + st["next_s_total"] > 0.0
    # a Python source: the GIL once per item, and once for the end of the epoch
    assert st["producer_gil_holds"] == 13
    assert st["wait_ms_p99"] >= 0.0
    assert st["wait_ms_mean"] * 12 <= st["wait_s_total"] * 1000 + 1e-6 or st["wait_s_total"] == 0


def test_stats_bytes_exact_for_known_layout():
    # payload 3 + 0 + 300 bytes per batch, laid out as 3 B -> 256, 0 B -> 0, 300 B -> 512
    items = [(np.zeros(3, np.int8), np.zeros(0), np.zeros(300, np.uint8))] * 4
    with pinloader.AsyncPrefetcher(items, device=DEVICE) as pf:
        drain(pf)
        st = pf.stats()
    assert st["batches"] == 4
    assert st["bytes"] == 4 * (3 + 0 + 300)
    assert st["padding_bytes"] == 4 * ((256 - 3) + 0 + (512 - 300))


def test_bytes_count_payload_and_padding_apart():
    pool = pinloader.PinnedPool(max_bytes=8 << 20, device="cpu")
    pinned = np.frombuffer(pool.alloc(100_000), dtype=np.uint8)  # direct, 100000 -> 100096
    items = [(np.zeros(5, np.int8), pinned, np.zeros(3, np.float64))] * 3
    with pinloader.AsyncPrefetcher(items, device=DEVICE) as pf:
        drain(pf)
        st = pf.stats()
    assert st["bytes"] == 3 * (5 + 100_000 + 24)
    assert st["padding_bytes"] == 3 * ((256 - 5) + (100_096 - 100_000) + (256 - 24))
