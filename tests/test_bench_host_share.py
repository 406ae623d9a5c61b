"""benchmarks/host_share_cost.py: every way runs on a few images and lands in the result files,
and the DCT-scaled way makes the same output shape from the same crop box."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import bench_module

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not (ROOT / "benchmarks" / "host_share_cost.py").is_file(),
                                reason="benchmarks/ is not in the sdist")
pytest.importorskip("PIL", reason="host_share_cost.py decodes with Pillow")


def test_every_way_is_timed_and_published(tmp_path):
    hs = bench_module("host_share_cost")
    assert hs.main(["--imagenet", "3", "--highres", "1", "--repeats", "2", "--out", str(tmp_path),
                    "--name", "hs"]) == 0
    data = json.loads((tmp_path / "hs.json").read_text())["results"]
    assert set(data) == {"imagenet", "highres"}
    for cls in data.values():
        for way in ("decode", "decode+crop", "draft+crop"):
            assert len(cls[way]["cpu_ms"]) == 2 and min(cls[way]["cpu_ms"]) > 0
    assert "draft+crop" in (tmp_path / "hs.md").read_text()
    assert sum(data["imagenet"]["draft_scales"].values()) == 3


def test_the_dct_scaled_crop_is_the_training_crop_at_a_lower_resolution():
    from pinloader import _image_ops as ops
    hs = bench_module("host_share_cost")
    bi = bench_module("bench_images")
    blob = bi.make_jpegs(1, "highres")[0]
    full = ops.decode_rgb(blob)
    p = np.array([100, 200, 900, 1000, 224, 224, 0, 0, 0], np.int32)  # a 4x reduction applies
    a = hs._draft_crop(blob, p).astype(np.float64)
    b = ops.resample(full, p, (224, 224)).astype(np.float64)
    assert a.shape == b.shape == (224, 224, 3)
    # the same region: far closer to it than to the image's other corner
    other = ops.resample(full, np.array([0, 0, 900, 1000, 224, 224, 0, 0, 0], np.int32), (224, 224))
    assert np.abs(a - b).mean() < 0.5 * np.abs(a - other.astype(np.float64)).mean()


@pytest.mark.parametrize("side", [(1001, 1201), (1420, 1416), (901, 1799)])
def test_the_reduction_asked_is_the_one_libjpeg_applies_whatever_the_sides(side):
    import io

    from PIL import Image
    hs = bench_module("host_share_cost")
    h, w = side
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (90, 120, 150)).save(buf, format="JPEG", quality=90)
    for box, want in [((h, w), 4), ((500, 500), 2), ((400, 900), 1), ((h // 2, w // 2), 2)]:
        arr, k = hs.draft_decode(buf.getvalue(), box)
        assert k == want, (side, box, k)
        assert arr.shape[:2] == (-(-h // k), -(-w // k))
