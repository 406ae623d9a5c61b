"""benchmarks/bench_user_loop.py on the host backend: the --smoke run has every row, source and
loop of a plain user loop beside bench_gather's own measurement and the reference, with the
ratios, the CPU split and the loader's path recorded."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_user_loop.py"
HAVE_TORCH = importlib.util.find_spec("torch") is not None

import pytest  # noqa: E402

# benchmarks/ stays in the repository: the sdist (whose tests CI also runs) does not carry it.
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ is not in the sdist")


def test_smoke_run_has_every_row_source_and_loop(tmp_path):
    loops = "next,next_bare,for,bench" + (",door" if HAVE_TORCH else "")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path), "--sources",
                        "numpy,full", "--loops", loops], capture_output=True, text=True, timeout=300,
                       env=env, cwd=ROOT)
    assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-6000:]}"
    assert "Traceback" not in p.stderr, p.stderr[-6000:]
    data = json.loads((tmp_path / "user_loop.json").read_text())
    md = (tmp_path / "user_loop.md").read_text()
    assert data["backend"] == "host" and data["args"]["smoke"] is True
    assert sorted(data["rows"]) == sorted(["64", "512", "4096", "150528"])
    names = {"bench", "for seed=0 drop_last=False"}
    names |= {f"{lp} seed={s} drop_last={d}" for lp in ("next", "next_bare") for s in (0, 1) for d in (True, False)}
    if HAVE_TORCH:
        names |= {"door seed=0 drop_last=True", "door seed=1 drop_last=True"}
    for row, rec in data["rows"].items():
        assert len(rec["ref"]) == 2 and all(r["gbps"] > 0 for r in rec["ref"])
        assert set(rec["sources"]) == {"numpy", "full"}
        for kind, src in rec["sources"].items():
            assert src["bytes"] >= 2 * rec["batch_bytes"]
            assert set(src["runs"]) == names, (row, kind)
            for name, runs in src["runs"].items():
                assert len(runs) == 2, (row, kind, name)
                for r in runs:
                    assert r["gbps"] > 0 and r["ratio"] > 0, (row, kind, name, r)
                    assert r["cpu_ms_per_batch"] >= 0 and r["loader_cpu_ms_per_batch"] >= 0
                    assert r["gather"] == "host"  # what auto picks on the host backend
                    assert isinstance(r["epoch_ends"], int)
                    if name != "bench":
                        assert r["cpu_ms_per_batch_before_wait"] <= r["cpu_ms_per_batch"] + 1e-9
                        assert "producer_ms_per_batch" in r and "thread_cpu_ms_per_batch" in r
            # the smoke sources hold a few batches: the user loops cross epoch ends
            assert any(r["epoch_ends"] > 0 for r in src["runs"]["next seed=0 drop_last=True"])
        for name in names:
            assert f"`{name}`" in md
    assert "`dma`" in md


def test_row_prefetch_on_and_off_are_rows_of_one_run(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path), "--rows", "64",
                        "--loops", "next", "--seeds", "0", "--drop-last", "true", "--row-prefetch", "on,off"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, f"rc={p.returncode}\nstderr:\n{p.stderr[-6000:]}"
    data = json.loads((tmp_path / "user_loop.json").read_text())
    runs = data["rows"]["64"]["sources"]["numpy"]["runs"]
    assert set(runs) == {"next seed=0 drop_last=True", "next seed=0 drop_last=True prefetch=off"}
    assert all(len(r) == 2 and all(x["gbps"] > 0 for x in r) for r in runs.values())
    assert "`next seed=0 drop_last=True prefetch=off`" in (tmp_path / "user_loop.md").read_text()
