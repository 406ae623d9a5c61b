"""benchmarks/bench_orders.py: the --smoke run times every row with the main thread idle and
busy, each order the right length, and the sharded loader both ways, and writes its tables."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_orders.py"

# benchmarks/ stays in the repository: the sdist (whose tests CI also runs) does not carry it.
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ is not in the sdist")


def test_smoke_run_times_every_row(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-6000:]}"
    data = json.loads((tmp_path / "orders.json").read_text())
    md = (tmp_path / "orders.md").read_text()
    want = {f"{r} {m}" for r in ("python_thread", "job_fresh", "job_reuse") for m in ("idle", "busy")}
    assert set(data["times_ms"]) == want
    for name, times in data["times_ms"].items():
        assert len(times) == 2 and all(t > 0 for t in times), name
        assert data["summary"][name]["n"] == 2
    for row in ("python_thread", "job_fresh", "job_reuse"):
        assert f"| {row} | idle |" in md and f"| {row} | busy |" in md
    # the sharded loader, orders one epoch ahead and as made now
    assert set(data["loader"]) == {"loader_one_ahead", "loader_adaptive"}
    for name, rec in data["loader"].items():
        assert len(rec["batches_per_s"]) == 2 and all(v > 0 for v in rec["batches_per_s"]), name
        assert len(rec["first_next_ms"]) == 2 and all(v > 0 for v in rec["first_next_ms"]), name
        assert f"| {name} |" in md
