"""Decode-and-crop throughput of the GPU image decoder against torchvision's GPU decode.

Images are made from real photographs (scikit-image's sample photos), rescaled to ImageNet-like
sizes (short side 333-500 px) or high resolution (1.2-1.5k px), given sensor noise, and saved as
JPEG at quality 90. Each row decodes batches of --batch images, taken in a shuffled order:

  pinloader_decoder   _C.JpegDecoder.decode: nvJPEG (hardware engines, CUDA decoder for the
                      rest) + the fused RandomResizedCrop-style resize to 224 px, bf16, normalised
  torchvision_decode  torchvision.io.decode_jpeg(list, device="cuda"): decode only, no crop

Rows are interleaved over --rounds rounds; each prints images/s (median and range) and CPU-seconds
of the process per 1,000 images. GPU only.

    python benchmarks/bench_jpeg_decode.py --images 2048 --batch 256 --rounds 5
"""
from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402,F401  (the working tree's pinloader when built in place)


def photos():
    from skimage import data

    names = ["astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry",
             "motorcycle_left", "retina", "cat", "colorwheel"]
    out = []
    for n in names:
        f = getattr(data, n, None)
        if f is None:
            continue
        try:
            a = f()
        except Exception:
            continue
        if isinstance(a, tuple):
            a = a[0]
        if a.ndim == 3 and a.shape[2] >= 3:
            out.append(np.ascontiguousarray(a[..., :3]))
    return out


def make_images(n, size_class, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = photos()
    blobs, shapes = [], []
    distinct = min(n, 256)
    for i in range(distinct):
        src = Image.fromarray(base[i % len(base)])
        short = int(rng.integers(333, 501)) if size_class == "imagenet" else int(rng.integers(1200, 1501))
        aspect = float(rng.uniform(0.75, 1.5))
        w, h = (int(short * aspect), short) if rng.random() < 0.6 else (short, int(short * aspect))
        im = np.asarray(src.resize((w, h), Image.BILINEAR), np.float32)
        im = np.clip(im + rng.normal(0, 4, im.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="JPEG", quality=90)
        blobs.append(buf.getvalue())
        shapes.append((h, w))
    reps = [blobs[i % distinct] for i in range(n)]
    rshapes = [shapes[i % distinct] for i in range(n)]
    return reps, rshapes


def rrc_params(rng, shapes, size=224, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    out = []
    for H, W in shapes:
        area = H * W
        for _ in range(10):
            ta = area * rng.uniform(*scale)
            ar = np.exp(rng.uniform(np.log(ratio[0]), np.log(ratio[1])))
            w = int(round(np.sqrt(ta * ar)))
            h = int(round(np.sqrt(ta / ar)))
            if 0 < w <= W and 0 < h <= H:
                out.append([rng.integers(0, H - h + 1), rng.integers(0, W - w + 1), h, w, size, size, 0, 0,
                            rng.integers(0, 2)])
                break
        else:
            out.append([0, 0, H, W, size, size, 0, 0, 0])
    return np.array(out, np.int32)


def cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size-class", choices=["imagenet", "highres"], default="imagenet")
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=3, help="also run 2..N decoders on N threads")
    args = ap.parse_args(argv)

    import torch
    import torchvision

    from pinloader import _C, _cudart

    blobs, shapes = make_images(args.images, args.size_class)
    base = np.frombuffer(b"".join(blobs), np.uint8)
    lengths = np.array([len(b) for b in blobs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    dec = _C.JpegDecoder(0, libraries=_cudart.nvjpeg_candidates())
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    scale, bias = tuple(1 / (255 * std)), tuple(-mean / std)
    rng = np.random.default_rng(0)
    B = args.batch
    nb = args.images // B

    def run_pinloader():
        order = rng.permutation(args.images)
        for k in range(nb):
            idx = order[k * B:(k + 1) * B]
            params = rrc_params(rng, [shapes[i] for i in idx])
            arr, status = dec.decode(base, offsets[idx], lengths[idx], params, (224, 224), scale, bias,
                                     "bfloat16", True)
            t = torch.from_dlpack(arr)
            t.view(-1)[:1].add_(0)
        torch.cuda.synchronize()

    def run_torchvision():
        order = rng.permutation(args.images)
        for k in range(nb):
            idx = order[k * B:(k + 1) * B]
            out = torchvision.io.decode_jpeg([tensors[i] for i in idx], device="cuda")
            out[-1].view(-1)[:1].add_(0)
        torch.cuda.synchronize()

    extra = [_C.JpegDecoder(0, libraries=_cudart.nvjpeg_candidates()) for _ in range(args.threads - 1)]

    def run_threads(k_threads):
        # k decoders, each on its own thread (the decode releases the GIL), batches dealt in turn
        decs = [dec] + extra[:k_threads - 1]
        order = rng.permutation(args.images)
        jobs = [(order[k * B:(k + 1) * B], rrc_params(rng, [shapes[i] for i in order[k * B:(k + 1) * B]]))
                for k in range(nb)]

        def work(t):
            for idx, params in jobs[t::k_threads]:
                arr, _ = decs[t].decode(base, offsets[idx], lengths[idx], params, (224, 224), scale, bias,
                                        "bfloat16", True)
                torch.from_dlpack(arr).view(-1)[:1].add_(0)

        ts = [threading.Thread(target=work, args=(t,)) for t in range(k_threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        torch.cuda.synchronize()

    rows = {"pinloader_decoder": run_pinloader, "torchvision_decode": run_torchvision}
    for k in range(2, args.threads + 1):
        rows[f"pinloader_decoder_x{k}"] = lambda k=k: run_threads(k)
    for f in rows.values():  # warm-up
        f()
    res = {k: {"ips": [], "cpu": []} for k in rows}
    for r in range(args.rounds):
        for name in (list(rows) if r % 2 == 0 else list(rows)[::-1]):
            c0, t0 = cpu_s(), time.perf_counter()
            rows[name]()
            t1, c1 = time.perf_counter(), cpu_s()
            n = nb * B
            res[name]["ips"].append(n / (t1 - t0))
            res[name]["cpu"].append((c1 - c0) / n * 1000)
    info = dec.info()
    print(f"## JPEG decode + crop, {args.size_class}, batch {B}, {nb * B} images per round, "
          f"{args.rounds} rounds; decoder: {info}")
    print("| row | images/s (median, range) | CPU-s per 1,000 images |")
    print("| --- | ---: | ---: |")
    for k, v in res.items():
        print(f"| {k} | {statistics.median(v['ips']):,.0f} ({min(v['ips']):,.0f}-{max(v['ips']):,.0f}) "
              f"| {statistics.median(v['cpu']):.3f} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "results": res, "decoder": info}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
