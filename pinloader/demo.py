"""The demo behind ``python -m pinloader demo``.

A synthetic training step whose compute depends on the batch, fed three ways from the same
pre-collated batches in ordinary (pageable) host memory:

  plain        the batch is copied to the device at the start of the step (``.to(device)``)
  pinned       ``.pin_memory()`` then ``.to(device, non_blocking=True)`` (PyTorch's own recipe)
  pinloader    ``pinloader.torch.prefetch``: staged off the GIL, copied while the previous step computes

On a GPU it uses torch on CUDA; without one it runs the same loop on the CPU through pinloader's
host backend (torch on the CPU if installed, else NumPy), so the pipeline is the same code.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

import numpy as np

import pinloader


def _progress(label: str, i: int, n: int, quiet: bool) -> None:
    if quiet or not sys.stderr.isatty():
        return
    width = 30
    done = int(width * i / max(n, 1))
    sys.stderr.write(f"\r  {label:<10} [{'#' * done}{'.' * (width - done)}] {i}/{n}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _make_batches(batch_size: int, image: int, count: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((batch_size, 3, image, image), dtype=np.float32),
             rng.integers(0, 1000, size=batch_size, dtype=np.int64)) for _ in range(count)]


def _square_dim(dim: int, numel: int) -> int:
    """The compute's matrix side: at most ``dim``, and small enough to be filled by the batch."""
    return max(1, min(dim, int(numel ** 0.5)))


class _Source:
    """Cycles pre-made batches for a fixed number of steps (re-iterable)."""

    def __init__(self, batches: list, steps: int) -> None:
        self.batches, self.steps = batches, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for i in range(self.steps):
            yield self.batches[i % len(self.batches)]


def _run_torch(args: Any, device_str: str, quiet: bool) -> dict:
    import torch

    import pinloader.torch as pt

    dev = torch.device(device_str)
    cuda = dev.type == "cuda"
    if cuda:
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    batches = _make_batches(args.batch_size, args.image_size)
    nbytes = sum(a.nbytes for a in batches[0])
    dim = _square_dim(2048 if cuda else 256, batches[0][0].size)
    dtype = torch.bfloat16 if cuda else torch.float32
    weight = torch.randn(dim, dim, device=dev, dtype=dtype) / dim ** 0.5

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def compute(x: torch.Tensor, reps: int) -> torch.Tensor:
        # depends on the batch: its first dim*dim values seed the chain
        h = x.reshape(-1)[: dim * dim].reshape(dim, dim).to(dtype)
        for _ in range(reps):
            h = torch.tanh(h @ weight)
        return h.float().mean()

    # Calibrate compute to the requested time (default: 3x the pinned copy on a GPU).
    x0 = torch.from_numpy(batches[0][0]).to(dev)
    if args.compute_ms is None:
        if cuda:
            pinned = torch.from_numpy(batches[0][0]).pin_memory()
            sync()
            t = time.perf_counter()
            for _ in range(5):
                x0.copy_(pinned, non_blocking=True)
            sync()
            target = 3 * (time.perf_counter() - t) / 5 * 1e3
        else:
            target = 20.0
    else:
        target = args.compute_ms
    reps = 1
    while True:
        compute(x0, reps)
        sync()
        t = time.perf_counter()
        for _ in range(3):
            compute(x0, reps)
        sync()
        ms = (time.perf_counter() - t) / 3 * 1e3
        if ms >= target or reps > 1 << 14:
            break
        reps = max(reps + 1, int(reps * target / max(ms, 1e-3)))
    compute_ms = ms

    def timed(label: str, loader_fn: Callable[[], Any], to_device: Callable[[Any], Any]) -> dict:
        steps = args.steps + args.warmup
        it = iter(loader_fn())
        wait = 0.0
        acc = torch.zeros((), device=dev)
        for i in range(steps):
            if i == args.warmup:
                sync()
                wait = 0.0
                t0 = time.perf_counter()
                c0 = time.process_time()
            tw = time.perf_counter()
            x, y = to_device(next(it))
            wait += time.perf_counter() - tw
            acc += compute(x, reps) + y.float().mean() * 0
            _progress(label, i + 1, steps, quiet)
        sync()
        wall = time.perf_counter() - t0
        step_ms = wall / args.steps * 1e3
        return {
            "samples_per_s": args.steps * args.batch_size / wall,
            "step_ms": step_ms,
            "data_wait_ms": wait / args.steps * 1e3,
            "idle_pct": max(0.0, 100.0 * (1.0 - compute_ms / step_ms)),
            "host_cpu_ms_per_step": (time.process_time() - c0) / args.steps * 1e3,
        }

    src = _Source(batches, args.steps + args.warmup + 1)
    rows = {}
    rows["plain .to()"] = timed(
        "plain", lambda: src,
        lambda b: (torch.from_numpy(b[0]).to(dev), torch.from_numpy(b[1]).to(dev)))
    if cuda:
        rows["pin_memory + non_blocking"] = timed(
            "pinned", lambda: src,
            lambda b: (torch.from_numpy(b[0]).pin_memory().to(dev, non_blocking=True),
                       torch.from_numpy(b[1]).pin_memory().to(dev, non_blocking=True)))
    with pt.prefetch(src, device=dev, depth=2) as pf:
        rows["pinloader"] = timed("pinloader", lambda: pf, lambda b: b)
        stats = pf.stats()
    return {"framework": "torch", "device": str(dev), "batch_bytes": nbytes, "compute_ms": compute_ms,
            "rows": rows, "pinloader_stats": stats}


def _run_numpy(args: Any, quiet: bool) -> dict:
    """No torch: the same loop with NumPy on the host backend."""
    batches = _make_batches(args.batch_size, args.image_size)
    nbytes = sum(a.nbytes for a in batches[0])
    dim = _square_dim(256, batches[0][0].size)
    weight = np.random.default_rng(1).standard_normal((dim, dim)).astype(np.float32) / dim ** 0.5
    target = args.compute_ms or 20.0

    def compute(x: np.ndarray, reps: int) -> float:
        h = x.reshape(-1)[: dim * dim].reshape(dim, dim)
        for _ in range(reps):
            h = np.tanh(h @ weight)
        return float(h.mean())

    reps, ms = 1, 0.0
    while reps < 1 << 14:
        t = time.perf_counter()
        compute(batches[0][0], reps)
        ms = (time.perf_counter() - t) * 1e3
        if ms >= target:
            break
        reps = max(reps + 1, int(reps * target / max(ms, 1e-3)))
    timings = []
    for _ in range(5):
        t = time.perf_counter()
        compute(batches[0][0], reps)
        timings.append((time.perf_counter() - t) * 1e3)
    compute_ms = float(np.median(timings))

    def timed(label: str, it: Any, get: Callable[[Any], Any]) -> dict:
        steps = args.steps + args.warmup
        wait = 0.0
        for i in range(steps):
            if i == args.warmup:
                wait, t0, c0 = 0.0, time.perf_counter(), time.process_time()
            tw = time.perf_counter()
            x, _ = get(next(it))
            wait += time.perf_counter() - tw
            compute(x, reps)
            _progress(label, i + 1, steps, quiet)
        wall = time.perf_counter() - t0
        step_ms = wall / args.steps * 1e3
        return {"samples_per_s": args.steps * args.batch_size / wall, "step_ms": step_ms,
                "data_wait_ms": wait / args.steps * 1e3,
                "idle_pct": max(0.0, 100.0 * (1.0 - compute_ms / step_ms)),
                "host_cpu_ms_per_step": (time.process_time() - c0) / args.steps * 1e3}

    src = _Source(batches, args.steps + args.warmup + 1)
    rows = {"plain copy": timed("plain", iter(src), lambda b: (b[0].copy(), b[1].copy()))}
    with pinloader.AsyncPrefetcher(src, device="cpu", depth=2) as pf:
        rows["pinloader"] = timed("pinloader", iter(pf),
                                  lambda b: (np.from_dlpack(b[0]), np.from_dlpack(b[1])))
        stats = pf.stats()
    return {"framework": "numpy", "device": "cpu", "batch_bytes": nbytes, "compute_ms": compute_ms,
            "rows": rows, "pinloader_stats": stats}


def run(args: Any) -> int:
    quiet = args.json
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    device = args.device
    if device is None:
        device = "cuda" if pinloader.backend() == "cuda" else "cpu"
    if not quiet:
        where = f"GPU {device}" if device.startswith("cuda") else "CPU (pinloader host backend)"
        print(f"pinloader {pinloader.__version__} demo on {where}: batch {args.batch_size}x3x"
              f"{args.image_size}x{args.image_size} float32 + labels, {args.steps} steps each")
    if have_torch:
        result = _run_torch(args, device, quiet)
    elif device.startswith("cuda"):
        print("the GPU demo needs torch: pip install torch", file=sys.stderr)
        return 2
    else:
        result = _run_numpy(args, quiet)
    result["backend"] = pinloader.backend()
    result["cpu_count"] = os.cpu_count()
    if args.json:
        print(json.dumps(result, indent=2, default=float))
        return 0
    print(f"\nbatch {result['batch_bytes'] / 1e6:.1f} MB, compute {result['compute_ms']:.2f} ms/step "
          f"({result['framework']} on {result['device']})\n")
    idle = "GPU idle %" if result["device"].startswith("cuda") else "compute idle %"
    print(f"| {'loading':<26} | {'samples/s':>10} | {'data wait ms/step':>17} | {idle:>14} |")
    print(f"|{'-' * 28}|{'-' * 12}|{'-' * 19}|{'-' * 16}|")
    for name, r in result["rows"].items():
        print(f"| {name:<26} | {r['samples_per_s']:>10,.0f} | {r['data_wait_ms']:>17.2f} | {r['idle_pct']:>14.1f} |")
    s = result["pinloader_stats"]
    print(f"\npinloader: {s['batches']} batches, {s['h2d_gbps']:.1f} GB/s delivered, wait p99 "
          f"{s['wait_ms_p99']:.2f} ms, pinned peak {s['pinned_bytes_peak'] / 1e6:.0f} MB")
    return 0
