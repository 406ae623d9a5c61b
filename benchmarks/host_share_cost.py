"""What a share of each batch decoded on the host would cost: CPU time per image, one thread,
for bench_images.py's ImageNet-like and high-res JPEGs, of each step a host share would take.

  decode          Pillow's (libjpeg-turbo's) whole decode, as ImageLoader's host path does it
  decode+crop     the same, then the training crop and resize (pinloader's host path: the
                  sample's RandomResizedCrop box, bilinear with antialias, 224 px)
  draft+crop      Pillow's DCT-scaled decode (``Image.draft``) at the largest reduction that keeps
                  the crop's box at least the output's size, then the crop and resize: the
                  cheapest libjpeg-turbo offers, with other pixels than torchvision's resized_crop

The GPU loader's own figures (images/s, CPU-s per 1,000 images) come from bench_images.py on the
GPU machine; with these, a host share of s of every batch adds s x (CPU-ms per image) CPU-s per
1,000 images. Run on the machine whose cores would do the decoding for a figure of that machine.

    python benchmarks/host_share_cost.py [--imagenet 64] [--highres 16] [--out DIR --name NAME]
"""
from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import bench_images  # noqa: E402  (the benchmarks' images)

SIZE = (224, 224)


def draft_decode(data: bytes, box_hw: tuple[int, int]) -> tuple[np.ndarray, int]:
    """Decode at the largest DCT reduction k (2, 4 or 8) that keeps a box of box_hw at least the
    output's size once reduced: the image as (h, w, 3) uint8, and k (1: none). Pillow picks its
    scale as the largest k with W // k and H // k at least the size asked, so it is asked for
    exactly that."""
    from PIL import Image
    h, w = box_hw
    k = 1
    while k < 8 and h // (2 * k) >= SIZE[0] and w // (2 * k) >= SIZE[1]:
        k *= 2
    with Image.open(io.BytesIO(data)) as im:
        W, H = im.size
        if k > 1:
            im.draft("RGB", (W // k, H // k))
        arr = np.asarray(im.convert("RGB"))
    # libjpeg's reduced size is ceil(side / k): the scale it applied, whatever was asked
    got = max(1, round(W / arr.shape[1]))
    return arr, got


def _draft_crop(data: bytes, p: np.ndarray) -> np.ndarray:
    """The training crop from a DCT-scaled decode: the box scaled down with the image, then
    resized and windowed as the host path does."""
    from pinloader import _image_ops as ops
    top, left, h, w = (int(v) for v in p[:4])
    arr, k = draft_decode(data, (h, w))
    q = np.array(p, np.int64).copy()
    q[0], q[1] = top // k, left // k
    q[2] = max(1, min(arr.shape[0] - int(q[0]), -(-h // k)))
    q[3] = max(1, min(arr.shape[1] - int(q[1]), -(-w // k)))
    return ops.resample(arr, q, SIZE)


WAYS = ("decode", "decode+crop", "draft+crop")


def measure(blobs: list[bytes], repeats: int) -> dict[str, Any]:
    from PIL import Image

    from pinloader import _image_ops as ops
    hw = []
    for b in blobs:
        with Image.open(io.BytesIO(b)) as im:
            hw.append((im.size[1], im.size[0]))
    hw_a = np.array(hw, np.int64)
    u = ops.draws(0, 0, np.arange(len(blobs), dtype=np.int64))
    params = ops.train_params(hw_a, u, SIZE, (0.08, 1.0), (3 / 4, 4 / 3), True)
    fns: dict[str, Callable[[bytes, np.ndarray], Any]] = {
        "decode": lambda b, p: ops.decode_rgb(b),
        "decode+crop": lambda b, p: ops.host_decode(b, p, SIZE),
        "draft+crop": _draft_crop,
    }
    reduced = [draft_decode(b, (int(p[2]), int(p[3])))[1] for b, p in zip(blobs, params)]
    out: dict[str, Any] = {"images": len(blobs), "mean_kb": float(np.mean([len(b) for b in blobs]) / 1024),
                           "mean_mpix": float(np.mean(hw_a[:, 0] * hw_a[:, 1]) / 1e6),
                           "draft_scales": {str(k): reduced.count(k) for k in (1, 2, 4, 8)}}
    per_round: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(repeats):  # the ways interleaved: each round runs every way, in turn
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            t0 = time.process_time()
            for b, p in zip(blobs, params):
                fns[way](b, p)
            per_round[way].append((time.process_time() - t0) * 1e3 / len(blobs))
    for way in WAYS:
        out[way] = {"cpu_ms": per_round[way], "cpu_ms_summary": C.summarize(per_round[way])}
    return out


def render(res: dict[str, Any], info: dict[str, Any]) -> str:
    lines = ["# CPU time per image of a host share (host_share_cost.py)", ""]
    lines += C.machine_summary_lines(info)
    table = []
    for cls, r in res.items():
        for way in WAYS:
            table.append([cls, f"{r['images']} ({r['mean_mpix']:.2f} MP, {r['mean_kb']:.0f} KB)", way,
                          C.fmt_summary(r[way]["cpu_ms_summary"], 2)])
    lines += ["", C.md_table(["images", "count (mean size)", "way", "CPU-ms per image, one thread"], table, "lllr")]
    lines += ["", "The DCT reduction each image's crop allowed (draft+crop), images per scale: " +
              "; ".join(f"{cls}: " + ", ".join(f"1/{k} {n}" for k, n in r["draft_scales"].items() if n)
                        for cls, r in res.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--imagenet", type=int, default=64, help="ImageNet-like images (0: none)")
    ap.add_argument("--highres", type=int, default=16, help="high-res images (0: none)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the images per way")
    C.add_output_args(ap, "host_share_cost")
    args = ap.parse_args(argv)
    res = {}
    for cls, n in (("imagenet", args.imagenet), ("highres", args.highres)):
        if n > 0:
            res[cls] = measure(bench_images.make_jpegs(n, cls), args.repeats)
    info = C.machine_info(None, "cpu")
    C.publish(args.out, args.name, {"args": vars(args), "machine": info, "results": res}, render(res, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
