"""benchmarks/bench_images.py --smoke on the host backend: every ImageLoader row and the tiny
model run and land in the result files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_benchmark_smoke

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_images.py"

pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason="benchmarks/ is not in the sdist")
pytest.importorskip("torch", reason="bench_images.py needs PyTorch")


def test_smoke_run(tmp_path):
    p = run_benchmark_smoke("bench_images.py", tmp_path)
    assert "Traceback" not in p.stderr, p.stderr[-6000:]
    data = json.loads((tmp_path / "images.json").read_text())
    assert (tmp_path / "images.md").is_file()
    rows = data["loader_bound"]["imagenet"]
    assert list(rows) == ["imageloader_packed", "imageloader_tar", "imageloader_folder"]
    for name, v in rows.items():
        assert len(v["ips"]) == 2 and min(v["ips"]) > 0, (name, v)
    tiny = data["models"]["tiny"]
    assert tiny["rounds_done"] == 2 and set(tiny["rows"]) == {"bound", "imageloader_packed"}
    assert all(len(v["ratio"]) == 2 for v in tiny["rows"].values())
    # the training thread's time in next() per step, every row, every round, in the table
    assert all(len(v["next_ms"]) == 2 and min(v["next_ms"]) >= 0 for v in tiny["rows"].values())
    assert "next() per step, ms" in (tmp_path / "images.md").read_text()
