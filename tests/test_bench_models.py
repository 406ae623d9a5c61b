"""benchmarks/bench_models.py on the host: the --smoke run (every row, every ratio, on the CPU),
the GPU crop + flip against the CPU one, and the refusal without CUDA."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="bench_models.py needs PyTorch")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_models.py"

# benchmarks/ stays in the repository: the sdist (whose tests CI also runs) does not carry it.
if not (ROOT / "benchmarks").is_dir():
    pytest.skip("benchmarks/ is not in the sdist", allow_module_level=True)
IMAGE_ROWS = ["dataloader", "two_stream", "pinloader_dl", "arrayloader_host",
              "arrayloader_device", "on_gpu"]
TOKEN_ROWS = ["get_batch", "arrayloader_host", "arrayloader_device", "on_gpu"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _run(*args, timeout=120):
    try:
        return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                              text=True, timeout=timeout, env=_env(), cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"bench_models.py still running after {timeout}s\nstderr:\n{err[-4000:]}")


def _bench_module():
    from helpers import bench_module
    mod = bench_module("bench_models")
    mod.torch = torch
    return mod


def test_smoke_run_has_every_row_with_ratios(tmp_path):
    p = _run("--smoke", "--models", "tiny,gpt2", "--out", str(tmp_path))
    assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-6000:]}"
    assert "Traceback" not in p.stderr, p.stderr[-6000:]
    data = json.loads((tmp_path / "models.json").read_text())
    assert (tmp_path / "models.md").is_file()
    assert data["args"]["smoke"] is True
    for model, rows in (("tiny", IMAGE_ROWS), ("gpt2", TOKEN_ROWS)):
        rec = data["models"][model]
        assert "error" not in rec, rec.get("error")
        assert rec["rounds_done"] == 2
        assert list(rec["rows"]) == rows
        for name, row in rec["rows"].items():
            assert "error" not in row, (model, name, row.get("error"))
            assert len(row["runs"]) == 2, (model, name)
            assert row["images_per_s"]["n"] == 2 and row["images_per_s"]["median"] > 0
            ratio = row["ratio_to_on_gpu"]
            assert ratio["n"] == 2 and ratio["median"] > 0, (model, name, ratio)
        assert rec["rows"]["on_gpu"]["ratio_to_on_gpu"]["median"] == pytest.approx(1.0)
        assert np.isfinite(rec["final_loss"])
    built = data["rows_built"]
    assert built["arrayloader_device"]["gather"] == "device"
    assert built["arrayloader_host"]["gather"] == "host"
    assert built["gpt2.arrayloader_device"]["gather"] == "device"
    md = (tmp_path / "models.md").read_text()
    for name in IMAGE_ROWS + TOKEN_ROWS:
        assert f"`{name}`" in md


def test_gpu_crop_flip_is_the_cpu_crop_flip():
    bm = _bench_module()
    rng = np.random.default_rng(0)
    b, h, crop = 6, 11, 7
    x = rng.integers(0, 256, (b, 3, h, h), dtype=np.uint8)
    top = rng.integers(0, h - crop + 1, (b, 1))
    left = rng.integers(0, h - crop + 1, (b, 1))
    flip = np.array([[True], [False], [True], [False], [False], [True]])
    aug = bm.GpuCropFlip(torch.device("cpu"), b, 3, crop)
    got = aug.indices(torch.from_numpy(x), torch.from_numpy(top), torch.from_numpy(left),
                      torch.from_numpy(flip)).numpy()
    for i in range(b):
        want = x[i, :, top[i, 0]:top[i, 0] + crop, left[i, 0]:left[i, 0] + crop]
        if flip[i, 0]:
            want = want[:, :, ::-1]
        np.testing.assert_array_equal(got[i], want)
    out = aug(torch.from_numpy(x))  # random offsets: the shape and dtype the model gets
    assert out.shape == (b, 3, crop, crop) and out.dtype == torch.uint8


def test_normalize_is_the_usual_formula():
    bm = _bench_module()
    x = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    got = bm.Normalize(torch.device("cpu"))(x)
    mean = torch.tensor(bm.MEAN).view(1, 3, 1, 1)
    std = torch.tensor(bm.STD).view(1, 3, 1, 1)
    torch.testing.assert_close(got, (x / 255 - mean) / std)
    assert got.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_exits_2(tmp_path):
    p = _run("--out", str(tmp_path), "--models", "tiny", timeout=60)
    assert p.returncode == 2, p.stderr
    assert "CUDA" in p.stderr
