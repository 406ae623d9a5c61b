"""benchmarks/prof_images.py --smoke on the host backend: its rows run and land in the result
files with every kernel group (a GPU run fills them; here there are no kernels to see)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_benchmark_smoke

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "prof_images.py"

pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason="benchmarks/ is not in the sdist")
pytest.importorskip("torch", reason="prof_images.py needs PyTorch")


def test_smoke_run(tmp_path):
    run_benchmark_smoke("prof_images.py", tmp_path)
    data = json.loads((tmp_path / "prof_images.json").read_text())
    assert list(data["rows"]) == ["bound", "imageloader"]
    for name, r in data["rows"].items():
        assert set(r["gpu_ms_per_step"]) == {"pinloader", "nvjpeg", "copies", "model"}, name
        assert r["wall_ms"]["n"] == 1 and r["wall_ms"]["median"] > 0, name
    text = (tmp_path / "prof_images.md").read_text()
    assert "| imageloader |" in text and "| bound |" in text


def test_kernel_groups():
    from helpers import bench_module
    prof_images = bench_module("prof_images")
    assert prof_images.group_of("pl_image_v_bf16") == "pinloader"
    assert prof_images.group_of("_ZN6nvjpeg15DecodeHuffmanKernelEv") == "nvjpeg"
    assert prof_images.group_of("Memcpy HtoD (Pinned -> Device)") == "copies"
    assert prof_images.group_of("void cudnn::bn_fw_tr_1C11_kernel_NCHW") == "model"
