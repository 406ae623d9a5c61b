"""benchmarks/report.py redraws every committed chart from the committed JSON results (host only,
no GPU: the charts read numbers measured on the GPU machine, which each chart names)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LATEST = RESULTS / "h200_2026-12-01"

# benchmarks/ stays in the repository: the sdist (whose tests CI also runs) does not carry it.
if not (ROOT / "benchmarks").is_dir():
    pytest.skip("benchmarks/ is not in the sdist", allow_module_level=True)

pytest.importorskip("matplotlib", reason="matplotlib is not installed (the test extra brings it)")


def _report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), *args],
                          capture_output=True, text=True, timeout=280)


def test_every_committed_result_is_drawn(tmp_path):
    files = sorted(LATEST.glob("*.json")) + sorted(RESULTS.glob("*.json"))
    out = _report(*map(str, files), "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "skip" not in out.stderr, out.stderr  # every JSON is a result kind report.py knows
    drawn = {Path(line).name for line in out.stdout.split()}
    for f in LATEST.glob("*.json"):
        payload = json.loads(f.read_text(encoding="utf-8"))
        sources = payload.get("sources") if payload.get("benchmark") == "overlap" else None
        if sources:
            assert any(name.startswith(f.stem) for name in drawn), f
        else:
            assert f"{f.stem}.png" in drawn, f
    for name in drawn:
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        # the committed chart of the same name exists (regenerate with benchmarks/report.py)
        assert (LATEST / name).exists() or (RESULTS / name).exists(), name


def test_report_names_the_machine_and_reads_ratios():
    from helpers import bench_module
    report = bench_module("report")
    payload = json.loads((LATEST / "overlap_collated.json").read_text(encoding="utf-8"))
    assert report._machine(payload) == "NVIDIA H200, 16-CPU host"
    assert report.kind_of(json.loads((LATEST / "array_loader.json").read_text())) == "array_loader"
    assert report.kind_of({"benchmark": "nope"}) is None
    med, lo, hi = report._ratio_summary([1.0, 2.0, 3.0], 2.0)
    assert (med, lo, hi) == (1.0, 0.5, 1.5)


@pytest.mark.parametrize("folder", ["h200_2026-12-01b", "h200_2026-12-02"])
def test_the_device_gather_results_are_drawn(tmp_path, folder):
    # bench_gather (on the GPU and on the host backend), bench_gather_kernel, bench_models,
    # bench_static and bench_overhead results, each with its committed chart
    later = RESULTS / folder
    files = sorted(later.glob("*.json"))
    assert files
    out = _report(*map(str, files), "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "skip" not in out.stderr, out.stderr
    drawn = {Path(line).name for line in out.stdout.split()}
    assert drawn == {f"{f.stem}.png" for f in files}
    for name in drawn:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (later / name).exists(), f"{name}: regenerate with benchmarks/report.py"
