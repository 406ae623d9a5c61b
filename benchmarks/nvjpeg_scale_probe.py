"""Runs benchmarks/nvjpeg_scale_probe.cu on a GPU machine with nvcc and libnvjpeg: makes
ImageNet-like and high-res JPEGs (bench_images.py's generator), builds the probe, times nvJPEG's
hardware batched decode at scales 1, 1/2, 1/4 and 1/8 with and without
NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION, and compares the decoded pixels with Pillow's
(libjpeg-turbo): at scale 1 with Pillow's full decode, at scale 1/4 with Pillow's DCT-scaled
decode (``Image.draft``). Prints the probe's lines and a table; writes OUT/scale_probe.md.

    python3 benchmarks/nvjpeg_scale_probe.py OUT [--imagenet 256] [--highres 64]
"""
from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_images  # noqa: E402  (the benchmarks' images)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--imagenet", type=int, default=256)
    ap.add_argument("--highres", type=int, default=64)
    args = ap.parse_args()
    from PIL import Image

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    exe = out / "nvjpeg_scale_probe"
    src = Path(__file__).resolve().parent / "nvjpeg_scale_probe.cu"
    subprocess.run(["nvcc", "-O2", "-o", str(exe), str(src), "-lnvjpeg"], check=True)
    lines, diffs = [], []
    for label, n in (("imagenet", args.imagenet), ("highres", args.highres)):
        d = out / label
        d.mkdir(exist_ok=True)
        blobs = bench_images.make_jpegs(n, label)
        files = []
        for i, b in enumerate(blobs):
            f = d / f"{i:04d}.jpg"
            f.write_bytes(b)
            files.append(str(f))
        dump = out / f"{label}_px"
        dump.mkdir(exist_ok=True)
        r = subprocess.run([str(exe), label, str(dump), *files], capture_output=True, text=True)
        print(r.stdout + r.stderr, flush=True)
        lines += (r.stdout + r.stderr).splitlines()
        for p in sorted(dump.glob("*.rgb")):
            m = re.match(r"(\w+)_f(\d+)_s(\d+)_(\d+)_(\d+)x(\d+)\.rgb", p.name)
            if not m:
                continue
            name, flags, scale, i, w, h = (m.group(1), *map(int, m.groups()[1:]))
            roi = name.endswith("roi")
            gpu = np.fromfile(p, np.uint8).reshape(h, w, 3).astype(np.int16)
            im = Image.open(io.BytesIO(blobs[i]))
            W, H = im.size
            if roi and scale > 1:
                diffs.append((name, flags, scale, i, f"{w}x{h} (not compared)", None, None))
                continue
            if scale > 1:
                # libjpeg's DCT scaling by 1/scale: draft() takes the largest power-of-two scale
                # whose division of the full size by the requested one it does not exceed
                im.draft("RGB", (max(1, W // scale), max(1, H // scale)))
            ref = np.asarray(im.convert("RGB"))
            if roi:  # the probe's region: the central half of each side, corner on the 16-pixel grid
                rx, ry = (W // 4) & ~15, (H // 4) & ~15
                ref = ref[ry:ry + H // 2, rx:rx + W // 2]
            if ref.shape[:2] != (h, w):
                diffs.append((name, flags, scale, i, f"{w}x{h}; Pillow gave {ref.shape[1]}x{ref.shape[0]}", None, None))
                continue
            a = np.abs(gpu - ref.astype(np.int16))
            diffs.append((name, flags, scale, i, f"{w}x{h}", float(a.mean()), int(a.max())))
    md = ["# nvJPEG hardware decode: scale factors and interpolated chroma", "", "```", *lines, "```", "",
          "| images | flags | scale | image | size | mean abs diff to Pillow | max |", "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for label, flags, scale, i, size, mean, mx in diffs:
        md.append(f"| {label} | {flags} | 1/{scale} | {i} | {size} | "
                  f"{'' if mean is None else f'{mean:.3f}'} | {'' if mx is None else mx} |")
    (out / "scale_probe.md").write_text("\n".join(md) + "\n")
    print("\n".join(md[len(lines) + 5:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
