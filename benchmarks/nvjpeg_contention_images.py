"""Images for benchmarks/nvjpeg_contention.cu: N JPEGs (quality 90, 4:2:0) made from
scikit-image's photographs, short side 333-500 px, with sensor-like noise.

    python3 benchmarks/nvjpeg_contention_images.py OUT_DIR N
"""
from __future__ import annotations

import os
import sys

import numpy as np
import skimage.data as sd
from PIL import Image


def main() -> None:
    out, n = sys.argv[1], int(sys.argv[2])
    os.makedirs(out, exist_ok=True)
    photos = [sd.astronaut(), sd.coffee(), sd.chelsea(), sd.rocket(), sd.hubble_deep_field()]
    rng = np.random.default_rng(0)
    for i in range(n):
        a = photos[i % len(photos)]
        short = int(rng.integers(333, 501))
        h, w = a.shape[:2]
        s = short / min(h, w)
        im = Image.fromarray(a).resize((max(1, round(w * s)), max(1, round(h * s))), Image.BILINEAR)
        x = np.asarray(im).astype(np.int16) + rng.integers(-6, 7, size=np.asarray(im).shape)
        Image.fromarray(np.clip(x, 0, 255).astype(np.uint8)).save(f"{out}/{i:04d}.jpg", quality=90)


if __name__ == "__main__":
    main()
