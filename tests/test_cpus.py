"""The default staging thread count: affinity, cgroup CPU quota (fake cgroup trees through
PINLOADER_CGROUP_ROOT), LOCAL_WORLD_SIZE (read alike for the staging threads and the pool's
cap); the staging stores.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import pinloader
from pinloader import _C
from helpers import run_py


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("PINLOADER_CGROUP_ROOT", raising=False)


def _expected(b):
    cpus = b["affinity"]
    if b["quota"] is not None:
        q = b["quota"]
        cpus = min(cpus, max(1, int(q) + (int(q) < q)))
    return max(1, min(b["max_staging_threads"], cpus // b["local_ranks"]))


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v2(root, membership, files):
    _write(root / "proc/self/cgroup", membership)
    _write(root / "sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n")
    for rel, text in files.items():
        _write(root / "sys/fs/cgroup" / rel, text)


def _budget(monkeypatch, root):
    monkeypatch.setenv("PINLOADER_CGROUP_ROOT", str(root))
    return _C.cpu_budget()


def test_default_matches_the_budget_and_the_prefetcher_uses_it():
    b = _C.cpu_budget()
    assert b["online"] >= 1 and 1 <= b["affinity"] <= max(b["online"], b["affinity"])
    assert b["local_ranks"] == 1
    assert _C.default_staging_threads() == b["staging_threads"] == _expected(b)
    with pinloader.AsyncPrefetcher([]) as pf:
        assert pf.staging_threads == b["staging_threads"]
    with pinloader.AsyncPrefetcher([], staging_threads=3) as pf:
        assert pf.staging_threads == 3


def test_cgroup_v2_quota_smallest_along_the_ancestors(tmp_path, monkeypatch):
    _v2(tmp_path, "0::/kube/pod/ctr\n", {"kube/pod/ctr/cpu.max": "max 100000\n",
                                          "kube/pod/cpu.max": "150000 100000\n",
                                          "kube/cpu.max": "400000 100000\n"})
    b = _budget(monkeypatch, tmp_path)
    assert b["quota"] == pytest.approx(1.5)
    assert b["staging_threads"] == _expected(b) == min(2, b["affinity"])


def test_cgroup_v2_unlimited_and_period_default(tmp_path, monkeypatch):
    _v2(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert _budget(monkeypatch, tmp_path)["quota"] is None
    _v2(tmp_path, "0::/\n", {"cpu.max": "50000\n"})  # no period: the kernel default 100000
    b = _budget(monkeypatch, tmp_path)
    assert b["quota"] == pytest.approx(0.5)
    assert b["staging_threads"] == 1


def test_cgroup_v2_inside_a_namespace_path_missing_under_the_mount(tmp_path, monkeypatch):
    # The membership names a path that the (namespaced) mount does not show: the mount root's
    # own cpu.max applies.
    _v2(tmp_path, "0::/system.slice/job.scope\n", {"cpu.max": "100000 100000\n"})
    b = _budget(monkeypatch, tmp_path)
    assert b["quota"] == pytest.approx(1.0)
    assert b["staging_threads"] == 1


def test_cgroup_v1_cfs_quota(tmp_path, monkeypatch):
    _write(tmp_path / "proc/self/cgroup", "4:memory:/job\n3:cpu,cpuacct:/job\n0::/\n")
    _write(tmp_path / "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us", "250000\n")
    _write(tmp_path / "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us", "100000\n")
    b = _budget(monkeypatch, tmp_path)
    assert b["quota"] == pytest.approx(2.5)
    assert b["staging_threads"] == _expected(b)
    _write(tmp_path / "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us", "-1\n")
    assert _budget(monkeypatch, tmp_path)["quota"] is None


def test_cgroup_v1_without_membership_file(tmp_path, monkeypatch):
    _write(tmp_path / "sys/fs/cgroup/cpu/cpu.cfs_quota_us", "100000\n")
    _write(tmp_path / "sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n")
    b = _budget(monkeypatch, tmp_path)
    assert b["quota"] == pytest.approx(1.0) and b["staging_threads"] == 1


@pytest.mark.parametrize("text", ["", "garbage\n", "-5 100000\n", "100000 0\n", "x" * 5000,
                                  "99999999999999999999999 1\n"])
def test_cgroup_garbage_is_ignored(tmp_path, monkeypatch, text):
    _v2(tmp_path, "0::/a\n" + "zzz\n:::\n", {"a/cpu.max": text})
    b = _budget(monkeypatch, tmp_path)
    assert b["quota"] is None or b["quota"] > 0
    assert 1 <= b["staging_threads"] <= b["max_staging_threads"]


def test_missing_cgroup_tree(tmp_path, monkeypatch):
    b = _budget(monkeypatch, tmp_path / "nothing")
    assert b["quota"] is None and b["staging_threads"] == _expected(b)


@pytest.mark.parametrize("value, ranks", [("2", 2), ("1", 1), ("0", 1), ("-3", 1), ("abc", 1),
                                          ("4x", 1), ("", 1), ("999999999999", 1)])
def test_local_world_size_divides_the_cpus(monkeypatch, value, ranks):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    b = _C.cpu_budget()
    assert b["local_ranks"] == ranks
    assert b["staging_threads"] == _expected(b) == max(1, b["affinity"] // ranks)


@pytest.mark.parametrize("value, ranks", [("4", 4), (" 3 ", 3), ("1", 1), ("0", 1), ("-2", 1),
                                          ("", 1), ("x", 1), ("2x", 1), ("65536", 65536),
                                          ("65537", 1), ("100000", 1), ("99999999999999999999", 1)])
@pytest.mark.hostile
def test_local_world_size_is_read_alike_for_the_pool_and_the_staging_threads(monkeypatch, value, ranks):
    # before: the pool accepted 2..65536 and the staging threads 1..2**20
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert _C.cpu_budget()["local_ranks"] == ranks
    full = _C.default_pinned_cap()
    assert _C.default_pool_cap() == max(full // ranks, 256)


def test_local_ranks_more_than_cpus_still_one_thread(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    b = _C.cpu_budget()
    assert b["staging_threads"] == 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity")
def test_affinity_mask_is_followed():
    code = ("import os, json\n"
            "cpu = min(os.sched_getaffinity(0))\n"
            "os.sched_setaffinity(0, {cpu})\n"
            "from pinloader import _C\n"
            "import pinloader\n"
            "pf = pinloader.AsyncPrefetcher([])\n"
            "print(json.dumps([_C.cpu_budget(), pf.staging_threads]))\n"
            "pf.close()\n")
    out = run_py(code, timeout=60, env_remove=("PINLOADER_CGROUP_ROOT",))
    assert out.returncode == 0, out.stderr
    b, threads = json.loads(out.stdout)
    assert b["affinity"] == 1
    assert b["staging_threads"] == threads == 1


# ---- staging stores (Note [non-temporal staging stores] in src/core/stager.c) ----

@pytest.fixture(params=[None, "0", "1"], ids=["by-size", "off", "on"])
def staging_nt(request, monkeypatch):
    """PINLOADER_STAGING_NT unset, 0 or 1: read when a stager is created."""
    if request.param is None:
        monkeypatch.delenv("PINLOADER_STAGING_NT", raising=False)
    else:
        monkeypatch.setenv("PINLOADER_STAGING_NT", request.param)
    return request.param


@pytest.mark.parametrize("threads", [1, 3])
def test_staging_with_and_without_streaming_stores(staging_nt, threads):
    rng = np.random.default_rng(threads)
    raw = rng.integers(0, 256, size=(9 << 20) + 37, dtype=np.uint8)
    batches = []
    for k in range(4):
        # unaligned starts and odd lengths, big (streamed) and small (cached) leaves, one
        # strided leaf (gathered), in one batch
        a = raw[1 + k:(5 << 20) + 3 + k]
        b = raw[7:(1 << 20) + 7].view(np.uint8)
        c = raw[11:11 + 3 * 1001].view(np.uint8)[::3]
        d = raw[:(2 << 20)].view(np.int32)[5:-3]
        batches.append({"a": a, "b": b, "c": c, "d": d})
    with pinloader.AsyncPrefetcher(batches, device="cpu", staging_threads=threads) as pf:
        for src, out in zip(batches, pf):
            for key in src:
                got = np.from_dlpack(out[key])
                assert got.dtype == src[key].dtype and got.shape == src[key].shape
                assert np.array_equal(got, src[key]), key


@pytest.mark.parametrize("threads", [1, 3])
def test_row_gathers_with_and_without_streaming_stores(staging_nt, threads):
    # rows of at least 4 KiB are streamed in jobs of 4 MiB or more staged as one chunk (these
    # batches: 7.9 MB and 4.2 MB, windows included; always with =1): rows at odd addresses and of odd lengths,
    # rows split between pieces (300,001 B > one piece), reversed sources, token windows (one
    # span of L rows), a strided row (never streamed), and short rows beside them in the batch
    rng = np.random.default_rng(7 + threads)
    raw = rng.integers(0, 256, size=(48 << 20) + 64, dtype=np.uint8)
    n = 60
    big = raw[3:3 + n * 300_001].reshape(n, 300_001)
    img = raw[1:1 + n * 150_528].reshape(n, 150_528)[::-1]
    odd = raw[5:5 + n * 4103 * 2].view(np.int16).reshape(n, 4103)
    strided = raw[:n * 8192].reshape(n, 8192)[:, ::2]
    small = raw[9:9 + n * 100].reshape(n, 100)
    arrays = {"i": np.arange(n), "big": big, "img": img, "odd": odd, "strided": strided, "small": small}
    with pinloader.ArrayLoader(arrays, 17, seed=threads, device="cpu", gather="host",
                               staging_threads=threads) as L:
        seen = 0
        for b in L:
            order = np.from_dlpack(b["i"])
            for key, src in arrays.items():
                got = np.from_dlpack(b[key])
                assert got.dtype == src.dtype and np.array_equal(got, src[order]), key
            seen += len(order)
        assert seen == n
    buf = np.zeros((8 << 20) + 1, dtype=np.uint8)
    tokens = buf[1:].view(np.uint16)  # at an odd address
    tokens[:] = np.arange(len(tokens)) % 65521
    with pinloader.ArrayLoader(tokens, 700, windows=3000, seed=1, device="cpu", gather="host",
                               staging_threads=threads) as L:  # 4.2 MB batches of 6 KB spans
        for b in L:
            got = np.from_dlpack(b).astype(np.int64)
            assert got.shape[1:] == (3000,) and len(got) > 0
            assert np.array_equal(got, (got[:, :1] + np.arange(3000)) % 65521)
