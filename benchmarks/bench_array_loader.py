#!/usr/bin/env python3
"""ArrayLoader against its peers, in one run.

Images: the seed workload held in RAM as one float32 array (N x 3 x 224 x 224) plus int64
labels, shuffled, batch 128, each step a compute chain that depends on the batch, at the
compute levels given by --compute (default: 1.2 x one pinned copy of the batch, and 2.5 ms).
Rows:
  arrayloader   pinloader.torch.prefetch(pinloader.ArrayLoader((images, labels), 128)): the
                staging threads gather the rows straight into pinned memory (the only copy)
  dataloader    the best torch DataLoader configuration: a per-sample Dataset over the same
                arrays, --workers worker processes (8), pin_memory, persistent workers,
                .to(non_blocking=True)
  pinloader_dl  pinloader.torch.prefetch over that DataLoader (pin_memory=False)
  on_gpu        the arrays already on the GPU, batches gathered there (upper bound)
Also measured in the same run: the host copy ceiling (torch copy_ of a batch into pinned
memory, all threads) and, for comparison, one pinned host-to-device copy of the batch.

Token windows: a uint16 memory-mapped file (--token-bytes, default 2 GiB), batches of 64
windows of 1025 tokens at the ArrayLoader's offsets; host time per batch of the ArrayLoader
(consumed as fast as it delivers) against the usual loop
``torch.stack([torch.from_numpy(data[i:i+L]) for i in ix]).pin_memory().to(dev, non_blocking=True)``.

Every figure is the median of --repeats runs (min-max in the JSON). Without a GPU (or with
--device cpu) everything runs on pinloader's host backend with a CPU matmul chain as compute
and no pinning; use small sizes there (--rows 256 --token-bytes 64M --workers 2).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

torch = None  # imported in main()
IMAGE_SHAPE = (3, 224, 224)
ROWS = ("arrayloader", "dataloader", "pinloader_dl", "on_gpu")


# ---- helpers ----

class InRamSamples:
    """Per-sample map-style dataset over the same arrays the ArrayLoader reads."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def cycle(iterable):
    """Endless batches: re-iterating the iterable starts its next epoch."""
    while True:
        empty = True
        for item in iterable:
            empty = False
            yield item
        if empty:
            raise RuntimeError("the feed is empty")


class Step:
    """Compute that depends on the batch: a chain of square matmuls (bf16 on the GPU, float32 on
    the CPU) whose first operand takes the batch's first values; `n` products, calibrated."""

    def __init__(self, device, dim):
        self.cuda = device.type == "cuda"
        dt = torch.bfloat16 if self.cuda else torch.float32
        g = torch.Generator(device=device).manual_seed(0)
        self.w = (torch.randn((dim, dim), device=device, generator=g) / math.sqrt(dim)).to(dt)
        self.dim, self.n = dim, 1

    def __call__(self, x, y):
        b = x.shape[0]
        h = x.reshape(b, -1)[:, :self.dim].to(self.w.dtype)
        m = torch.cat((h, self.w[b:])) if b < self.dim else h[:self.dim]
        for _ in range(self.n):
            m = m @ self.w
        return (m[0, :b].float() * y.float()).sum()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, iters):
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return 1e3 * (time.perf_counter() - t0) / iters


def calibrate(step, x, y, target_ms, device):
    step.n = 1
    one = time_ms(lambda: step(x, y), device, 10)
    step.n = max(1, round(target_ms / one))
    got = time_ms(lambda: step(x, y), device, 10)
    return {"target_ms": target_ms, "matmuls": step.n, "measured_ms": got}


def copy_ceiling(images, batch, device, repeats):
    """torch copy_ of one batch into pinned memory (all threads), and one pinned H2D copy."""
    torch.set_num_threads(os.cpu_count() or 1)
    # A different batch of the array each time: copying one batch again and again would run
    # from the host's last-level cache (hundreds of MiB on server CPUs), not from memory.
    n_batches = max(1, len(images) // batch)
    srcs = [torch.from_numpy(images[i * batch:(i + 1) * batch]) for i in range(n_batches)]
    src = srcs[0]
    pin = device.type == "cuda"
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
    host = []
    for i in range(max(repeats + 2, 2 * n_batches)):
        s = srcs[i % n_batches]
        t0 = time.perf_counter()
        dst.copy_(s)
        host.append(time.perf_counter() - t0)
    out = {"bytes": src.nbytes, "host_copy_gbps": common.summarize(src.nbytes / t / 1e9 for t in host[2:])}
    if pin:
        dev = torch.empty_like(src, device=device)
        h2d = []
        for _ in range(repeats + 2):
            ms = time_ms(lambda: dev.copy_(dst, non_blocking=True), device, 1)
            h2d.append(ms)
        out["pinned_h2d_ms"] = common.summarize(h2d[2:])
    return out


# ---- image rows ----

def make_feed(row, args, images, labels, device, gpu_data):
    import pinloader
    import pinloader.torch as pt
    bs = args.batch_size
    if row == "arrayloader":
        loader = pinloader.ArrayLoader((images, labels), bs, seed=1, drop_last=True)
        feed = pt.prefetch(loader, device=device)  # ArrayLoader's own depth
        return cycle(feed), feed
    if row in ("dataloader", "pinloader_dl"):
        pin = row == "dataloader" and device.type == "cuda"
        ds = InRamSamples(torch.from_numpy(images), torch.from_numpy(labels))
        kw = dict(num_workers=args.workers, pin_memory=pin)
        if args.workers:
            kw.update(persistent_workers=True, prefetch_factor=args.prefetch_factor,
                      multiprocessing_context="fork")
        dl = torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=True, drop_last=True, **kw)
        if row == "pinloader_dl":
            feed = pt.prefetch(dl, device=device, depth=args.depth)
            return cycle(feed), feed

        def gen():
            for x, y in cycle(dl):
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        return gen(), dl
    if row == "on_gpu":
        gx, gy = gpu_data

        if len(gx) < bs:
            raise ValueError(f"--rows ({len(gx)}) must be at least --batch-size ({bs})")

        def gen():
            g = torch.Generator(device=device).manual_seed(1)
            while True:
                perm = torch.randperm(len(gx), device=device, generator=g)
                for b in range(len(gx) // bs):
                    idx = perm[b * bs:(b + 1) * bs]
                    yield gx[idx], gy[idx]
        return gen(), None
    raise ValueError(row)


def run_row(row, args, images, labels, device, step, gpu_data):
    feed, owner = make_feed(row, args, images, labels, device, gpu_data)
    try:
        events = []
        total = args.warmup + args.steps
        t0 = c0 = None
        for i in range(total):
            if i == args.warmup:
                sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
            if device.type == "cuda" and i >= 2:
                events[i - 2].synchronize()  # the loop reads its loss two steps late
            x, y = next(feed)
            step(x, y)
            if device.type == "cuda":
                ev = torch.cuda.Event()
                ev.record()
                events.append(ev)
            del x, y
        sync(device)
        wall = time.perf_counter() - t0
        stats = owner.stats() if hasattr(owner, "stats") else None
        return {"samples_per_s": args.batch_size * args.steps / wall,
                "step_ms": 1e3 * wall / args.steps,
                "cpu_ms_per_step": 1e3 * (time.process_time() - c0) / args.steps,
                "pinloader_stats": stats}
    finally:
        close = getattr(owner, "close", None)
        if close:
            close()
        feed.close() if hasattr(feed, "close") else None


# ---- token windows ----

def token_file(args):
    path = Path(args.token_file or Path(tempfile.gettempdir()) / "pinloader_bench_tokens.u16")
    n = args.token_bytes // 2
    if not path.exists() or path.stat().st_size != 2 * n:
        common.log(f"writing {path} ({args.token_bytes / 1e9:.2f} GB)")
        mm = np.memmap(path, dtype=np.uint16, mode="w+", shape=(n,))
        chunk = 1 << 24
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            mm[s:e] = (np.arange(s, e, dtype=np.uint64) * 2654435761 % 50257).astype(np.uint16)
        mm.flush()
        del mm
    return np.memmap(path, dtype=np.uint16, mode="r", shape=(n,)), path


def run_windows(args, device):
    import pinloader
    import pinloader.torch as pt
    data, path = token_file(args)
    L, bs, n = args.window, args.window_batch, args.window_batches
    res = {"file": str(path), "bytes": data.nbytes, "window": L, "batch": bs, "batches": n,
           "arrayloader": [], "stack_loop": []}
    for _ in range(args.repeats):
        loader = pinloader.ArrayLoader(data, bs, windows=L, seed=2, drop_last=True)
        feed = pt.prefetch(loader, device=device)  # ArrayLoader's own depth
        it = iter(feed)
        for _ in range(3):
            next(it)
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            w = next(it)
        sync(device)
        res["arrayloader"].append({"host_ms_per_batch": 1e3 * (time.perf_counter() - t0) / n,
                                   "cpu_ms_per_batch": 1e3 * (time.process_time() - c0) / n})
        starts = loader.indices(loader.epoch)
        feed.close()
        del w
        pin = device.type == "cuda"
        t0, c0 = time.perf_counter(), time.process_time()
        for b in range(3, 3 + n):
            ix = starts[b * bs:(b + 1) * bs]
            t = torch.stack([torch.from_numpy(data[i:i + L]) for i in ix])
            if pin:
                t = t.pin_memory()
            w = t.to(device, non_blocking=True)
        sync(device)
        res["stack_loop"].append({"host_ms_per_batch": 1e3 * (time.perf_counter() - t0) / n,
                                  "cpu_ms_per_batch": 1e3 * (time.process_time() - c0) / n})
    for k in ("arrayloader", "stack_loop"):
        res[k + "_summary"] = {m: common.summarize(r[m] for r in res[k])
                               for m in ("host_ms_per_batch", "cpu_ms_per_batch")}
    res["speedup_host_time"] = common.ratio(res["stack_loop_summary"]["host_ms_per_batch"]["median"],
                                            res["arrayloader_summary"]["host_ms_per_batch"]["median"])
    return res


# ---- driver ----

def parse_compute(text):
    out = []
    for item in text.split(","):
        item = item.strip()
        out.append(("x", float(item[:-1])) if item.endswith("x") else ("ms", float(item)))
    return out


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda:N or cpu (default: cuda:0 if usable)")
    p.add_argument("--rows", type=int, default=4096, help="images in the array (default 4096, 2.5 GB)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--compute", type=parse_compute, default=parse_compute("1.2x,2.5"),
                   help="compute levels: Nx = N times one pinned copy, else ms (default 1.2x,2.5)")
    p.add_argument("--feeds", type=common.choice_list(ROWS), default=list(ROWS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--prefetch-factor", type=int, default=3)
    p.add_argument("--depth", type=int, default=2, help="prefetch depth over the DataLoader (ArrayLoader rows use its own default)")
    p.add_argument("--dim", type=int, default=8192, help="matmul size (default 8192; CPU: use 256)")
    p.add_argument("--token-bytes", type=common.parse_size, default=2 * common.GiB)
    p.add_argument("--token-file", default=None)
    p.add_argument("--window", type=int, default=1025)
    p.add_argument("--window-batch", type=int, default=64)
    p.add_argument("--window-batches", type=int, default=200)
    p.add_argument("--skip-windows", action="store_true")
    p.add_argument("--skip-images", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p


def main(argv=None):
    global torch
    args = build_parser().parse_args(argv)
    import torch as _torch
    torch = _torch
    if args.device is None:
        args.device = "cuda:0" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if args.rows < args.batch_size:
        common.fail(f"--rows ({args.rows}) must be at least --batch-size ({args.batch_size})", 1)
    if device.type == "cuda":
        common.require_cuda(args.device)
    payload = {"machine": common.machine_info(torch if device.type == "cuda" else None, args.device),
               "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}

    if not args.skip_images:
        rng = np.random.default_rng(0)
        images = np.empty((args.rows, *IMAGE_SHAPE), np.float32)
        for s in range(0, args.rows, 256):
            images[s:s + 256] = rng.random((min(256, args.rows - s), *IMAGE_SHAPE), dtype=np.float32)
        labels = rng.integers(0, 1000, args.rows, dtype=np.int64)
        ceiling = copy_ceiling(images, args.batch_size, device, max(5, args.repeats))
        payload["copy"] = ceiling
        batch_bytes = args.batch_size * (images[0].nbytes + 8)
        gpu_data = None
        if "on_gpu" in args.feeds:
            gpu_data = (torch.from_numpy(images).to(device), torch.from_numpy(labels).to(device))
        step = Step(device, args.dim)
        gx = torch.from_numpy(images[:args.batch_size]).to(device)
        gy = torch.from_numpy(labels[:args.batch_size]).to(device)
        copy_ms = (ceiling.get("pinned_h2d_ms") or {}).get("median") or \
            1e3 * ceiling["bytes"] / (ceiling["host_copy_gbps"]["median"] * 1e9)
        results = []
        for kind, value in args.compute:
            target = value * copy_ms if kind == "x" else value
            level = calibrate(step, gx, gy, target, device)
            level["spec"] = f"{value}{'x copy' if kind == 'x' else ' ms'}"
            for row in args.feeds:
                reps = []
                for r in range(args.repeats):
                    common.log(f"images: {level['spec']} ({target:.2f} ms), {row}, repeat {r + 1}")
                    rec, err = common.guarded(run_row, row, args, images, labels, device, step, gpu_data)
                    reps.append(rec if err is None else err)
                ok = [x for x in reps if "error" not in x]
                summary = {m: common.summarize(x[m] for x in ok)
                           for m in ("samples_per_s", "step_ms", "cpu_ms_per_step")}
                sps = summary["samples_per_s"]["median"]
                gather = sps * batch_bytes / args.batch_size / 1e9 if sps else None
                results.append({"level": level, "row": row, "repeats": reps, "summary": summary,
                                "gather_gbps": gather,
                                "vs_host_copy_ceiling": common.ratio(gather, ceiling["host_copy_gbps"]["median"])})
        payload["images"] = results
        del gpu_data

    if not args.skip_windows:
        payload["windows"] = run_windows(args, device)

    # the summary on stdout
    for res in payload.get("images", []):
        s = res["summary"]["samples_per_s"]
        print(f"{res['level']['spec']:>12} {res['row']:>13}: {common.fmt_summary(s, 0)} samples/s"
              + (f", gather {res['gather_gbps']:.1f} GB/s = {res['vs_host_copy_ceiling']:.2f} x host copy ceiling"
                 if res.get("gather_gbps") else ""))
    if "copy" in payload:
        print(f"host copy ceiling: {payload['copy']['host_copy_gbps']['median']:.1f} GB/s")
    if "windows" in payload:
        w = payload["windows"]
        print(f"windows {w['batch']}x{w['window']}: ArrayLoader "
              f"{w['arrayloader_summary']['host_ms_per_batch']['median']:.3f} ms/batch, stack loop "
              f"{w['stack_loop_summary']['host_ms_per_batch']['median']:.3f} ms/batch "
              f"({w['speedup_host_time']:.1f}x)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(common._jsonable(payload), indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
