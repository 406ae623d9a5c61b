"""The demo behind ``python -m pinloader demo``.

A synthetic training step whose compute depends on the batch, fed from the same pre-collated
batches in ordinary (pageable) host memory, in up to three ways:

  plain        the batch is copied to the device at the start of the step (``.to(device)``; on
               the CPU a ``.clone()``/``.copy()``, so that every row copies the batch)
  pinned       ``.pin_memory()`` then ``.to(device, non_blocking=True)`` (PyTorch's own recipe;
               GPU only)
  pinloader    staged off the GIL and copied while the previous step computes

Every row does the same work per step: one copy of the batch into device memory (host memory on
the CPU) and the same compute. On a GPU it uses torch on CUDA; without one it runs the same loop
on the CPU through pinloader's host backend (torch on the CPU if installed, else NumPy), and says
what such a run can and cannot show.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np

import pinloader
from pinloader import _device

CALIBRATION_TRIALS = 12  # at most this many tries to reach the requested compute time
CALIBRATION_REPEATS = 5  # each try, and the final measurement, is a median of this many runs


def _cpus() -> int:
    """The CPUs this process may use: its affinity mask, capped by the cgroup CPU quota (rounded
    up), as pinloader's own staging default counts them (``pinloader._C.cpu_budget()``)."""
    try:
        budget = pinloader._C.cpu_budget()
        n = int(budget["affinity"]) or int(budget["online"])
        quota = budget.get("quota")
        if quota:
            n = min(n, max(1, math.ceil(float(quota))))
        return max(1, n)
    except (AttributeError, KeyError, TypeError, ValueError):
        pass
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class DeviceError(Exception):
    """The requested device cannot run the demo (the message says why)."""


def _resolve_device(requested: str | None, have_torch: bool, torch_cuda: bool) -> tuple[str, str | None]:
    """(device, note): the device the demo runs on and, when it is not the one asked for, why.

    ``requested`` is ``None`` (the current GPU when pinloader and torch can use CUDA, else the
    host backend), ``"cpu"``/``"cpu:0"``/``"host"``, ``"cuda"`` or ``"cuda:N"``, read as every
    door reads them (Note [device spellings] in pinloader/_device.py) after case and spaces are
    dropped; anything else raises :class:`DeviceError`. CUDA asked for where it cannot be used (no usable GPU for pinloader,
    or a torch built without CUDA) falls back to the host backend, saying so.
    """
    text = None if requested is None else str(requested).strip().lower()
    try:
        spec = _device.parse(text, "pinloader demo --device")
    except (TypeError, ValueError):
        raise DeviceError(f"unknown device {requested!r}: use 'cpu', 'cuda' or 'cuda:N' (N a "
                          f"device index)") from None
    if spec is not None and spec[0] == "cpu":
        return "cpu", None
    index = None if spec is None else spec[1]
    if pinloader.backend() != "cuda":
        why = pinloader.cuda_info().get("error") or "no usable CUDA device"
        if text is None:
            return "cpu", None
        return "cpu", (f"{requested} was asked for, but pinloader cannot use CUDA here ({why}): "
                       f"running on the host backend instead")
    if index is not None and index >= pinloader.device_count():
        raise DeviceError(f"{requested}: there are {pinloader.device_count()} CUDA device(s) "
                          f"here (indices 0 to {pinloader.device_count() - 1})")
    if have_torch and not torch_cuda:
        note = ("torch is installed without CUDA (a CPU-only build), so the GPU demo cannot run: "
                "running on the host backend instead (install a CUDA build of torch for the GPU "
                "demo)")
        return "cpu", note
    if not have_torch:
        return "cpu", ("the GPU demo needs torch (pip install torch): running on the host "
                       "backend with NumPy instead")
    return ("cuda" if index is None else f"cuda:{index}"), None


class _Progress:
    """A progress bar on stderr: tqdm when installed, a plain one otherwise; nothing with --json."""

    def __init__(self, label: str, total: int, quiet: bool) -> None:
        self.label, self.total, self.quiet, self.n = label, total, quiet, 0
        self.bar: Any = None
        if quiet:
            return
        try:
            from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
        except ImportError:
            if not sys.stderr.isatty():
                print(f"  {label}: {total} steps ...", file=sys.stderr, flush=True)
            return
        self.bar = tqdm(total=total, desc=f"  {label}", unit="step", file=sys.stderr, leave=True)

    def update(self) -> None:
        self.n += 1
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.update(1)
        elif sys.stderr.isatty():
            width = 30
            done = int(width * self.n / max(self.total, 1))
            sys.stderr.write(f"\r  {self.label:<34} [{'#' * done}{'.' * (width - done)}] "
                             f"{self.n}/{self.total}")
            if self.n == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif not self.quiet and not sys.stderr.isatty():
            print(f"  {self.label}: done", file=sys.stderr, flush=True)


def _say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _make_batches(batch_size: int, image: int, count: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((batch_size, 3, image, image), dtype=np.float32),
             rng.integers(0, 1000, size=batch_size, dtype=np.int64)) for _ in range(count)]


def _square_dim(dim: int, numel: int) -> int:
    """The compute's matrix side: at most ``dim``, and small enough to be filled by the batch."""
    return max(1, min(dim, int(numel ** 0.5)))


class _Source:
    """Cycles pre-made batches for a fixed number of steps (re-iterable)."""

    def __init__(self, batches: list[tuple[np.ndarray, np.ndarray]], steps: int) -> None:
        self.batches, self.steps = batches, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for i in range(self.steps):
            yield self.batches[i % len(self.batches)]


def _median_ms(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _calibrate(run_once: Callable[[int], None], target_ms: float, quiet: bool) -> tuple[int, float]:
    """The number of repetitions of the compute that takes about ``target_ms``, and its time
    (the median of CALIBRATION_REPEATS runs, after a warm-up run at each size)."""
    reps, ms = 1, 0.0
    for trial in range(1, CALIBRATION_TRIALS + 1):
        run_once(reps)  # warm-up: first-call costs (allocations, kernels) are not compute
        ms = _median_ms(lambda: run_once(reps), CALIBRATION_REPEATS)
        _say(quiet, f"  calibrating compute, try {trial}/{CALIBRATION_TRIALS} (at most): {reps} "
                    f"repetition(s) take {ms:.2f} ms, target {target_ms:.2f} ms")
        if ms >= 0.9 * target_ms or reps >= 1 << 14:
            break
        reps = min(1 << 14, max(reps + 1, round(reps * target_ms / max(ms, 1e-3))))
    ms = _median_ms(lambda: run_once(reps), CALIBRATION_REPEATS)
    _say(quiet, f"  compute: {reps} repetition(s), {ms:.2f} ms per step (median of "
                f"{CALIBRATION_REPEATS} runs)")
    return reps, ms


def _timed(label: str, it: Iterator[Any], get: Callable[[Any], tuple[Any, Any]],
           step: Callable[[Any, Any], None], sync: Callable[[], None], args: Any,
           compute_ms: float, quiet: bool, gpu: bool = False) -> dict[str, float]:
    total = args.warmup + args.steps
    bar = _Progress(f"{label} ({args.warmup} warm-up + {args.steps} timed)", total, quiet)
    waits: list[float] = []
    steps: list[float] = []
    t0 = c0 = 0.0
    for i in range(total):
        if i == args.warmup:
            sync()
            waits, steps, t0, c0 = [], [], time.perf_counter(), time.process_time()
        tw = time.perf_counter()
        x, y = get(next(it))
        tc = time.perf_counter()
        waits.append(tc - tw)
        step(x, y)
        steps.append(time.perf_counter() - tc)
        bar.update()
    sync()
    wall = time.perf_counter() - t0
    bar.close()
    step_ms = wall / args.steps * 1e3
    row = {
        "samples_per_s": args.steps * args.batch_size / wall,
        "step_ms": step_ms,
        "data_wait_ms": sum(waits) / args.steps * 1e3,
        # the timed steps only: the warm-up's first batch waits for the pipeline to fill
        "data_wait_ms_p99": _percentile(waits, 99) * 1e3,
        "host_cpu_ms_per_step": (time.process_time() - c0) / args.steps * 1e3,
    }
    if gpu:
        # the GPU computes while the host waits: the share of the step it had no work
        row["idle_pct"] = min(100.0, max(0.0, 100.0 * (1.0 - compute_ms / step_ms)))
    else:
        # on the CPU the compute shares the cores with the copies: the step's own time, which
        # grows above the calibrated compute when copying threads take cores from it
        row["compute_ms"] = sum(steps) / args.steps * 1e3
    return row


def _percentile(values: list[float], q: float) -> float:
    """The q-th percentile of values (nearest rank), 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _threads(cuda: bool, requested: int | None) -> tuple[int, int]:
    """(compute threads, staging threads): on a GPU the host only drives the loop, so staging
    gets the cores but one (at most 8); on the CPU the compute gets the cores but one and
    staging what is left (at least 1)."""
    cpus = _cpus()
    if cuda:
        compute = 1
        staging = max(1, min(8, cpus - 1))
    else:
        compute = max(1, cpus - 1)
        staging = max(1, cpus - compute)
    return compute, requested if requested else staging


def _run_torch(args: Any, device_str: str, quiet: bool) -> dict[str, Any]:
    import torch

    import pinloader.torch as pt

    dev = _device.for_torch(device_str).native  # "cuda": torch's current device
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    compute_threads, staging = _threads(cuda, args.staging_threads)
    if not cuda:
        torch.set_num_threads(compute_threads)
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

    x0 = torch.from_numpy(batches[0][0]).to(dev)
    if args.compute_ms is not None:
        target = args.compute_ms
    elif cuda:
        # 3x the pinned copy time: a step where a hidden copy can matter
        pinned = torch.from_numpy(batches[0][0]).pin_memory()

        def copy_once() -> None:
            x0.copy_(pinned, non_blocking=True)
            sync()

        copy_once()
        target = 3 * _median_ms(copy_once, CALIBRATION_REPEATS)
    else:
        target = 20.0

    def run_once(reps: int) -> None:
        compute(x0, reps)
        sync()

    reps, compute_ms = _calibrate(run_once, target, quiet)
    acc = torch.zeros((), device=dev)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        nonlocal acc
        acc += compute(x, reps) + y.float().mean() * 0

    src = _Source(batches, args.steps + args.warmup)
    rows: dict[str, dict[str, float]] = {}
    if cuda:
        rows["plain .to()"] = _timed(
            "plain .to()", iter(src),
            lambda b: (torch.from_numpy(b[0]).to(dev), torch.from_numpy(b[1]).to(dev)),
            step, sync, args, compute_ms, quiet, gpu=True)
        rows["pin_memory + non_blocking"] = _timed(
            "pin_memory + non_blocking", iter(src),
            lambda b: (torch.from_numpy(b[0]).pin_memory().to(dev, non_blocking=True),
                       torch.from_numpy(b[1]).pin_memory().to(dev, non_blocking=True)),
            step, sync, args, compute_ms, quiet, gpu=True)
    else:
        # .to("cpu") would return the same tensor and copy nothing: clone, so the row copies
        # the batch like the others do.
        rows["plain copy (.clone())"] = _timed(
            "plain copy (.clone())", iter(src),
            lambda b: (torch.from_numpy(b[0]).clone(), torch.from_numpy(b[1]).clone()),
            step, sync, args, compute_ms, quiet)
    with pt.prefetch(src, device=dev, depth=2, staging_threads=staging) as pf:
        rows["pinloader"] = _timed("pinloader", iter(pf), lambda b: (b[0], b[1]), step, sync,
                                   args, compute_ms, quiet, gpu=cuda)
        stats = pf.stats()
    return {"framework": "torch", "device": str(dev), "batch_bytes": nbytes, "compute_ms": compute_ms,
            "compute_reps": reps, "compute_threads": compute_threads if not cuda else None,
            "staging_threads": staging, "rows": rows, "pinloader_stats": stats}


def _run_numpy(args: Any, quiet: bool) -> dict[str, Any]:
    """No torch: the same loop with NumPy on the host backend. The compute is elementwise (one
    thread, no BLAS), so its time does not swing with BLAS threads competing for the cores with
    the staging threads."""
    compute_threads = 1
    staging = args.staging_threads or max(1, _cpus() - compute_threads)
    batches = _make_batches(args.batch_size, args.image_size)
    nbytes = sum(a.nbytes for a in batches[0])
    n = min(1 << 16, batches[0][0].size)
    target = args.compute_ms if args.compute_ms is not None else 20.0

    def compute(x: np.ndarray, reps: int) -> float:
        # depends on the batch: its first n values seed the chain
        h = x.reshape(-1)[:n]
        for _ in range(reps):
            h = np.tanh(h * np.float32(1.5) + np.float32(0.25))
        return float(h.mean())

    def run_once(r: int) -> None:
        compute(batches[0][0], r)

    reps, compute_ms = _calibrate(run_once, target, quiet)

    def step(x: np.ndarray, y: np.ndarray) -> None:
        compute(x, reps)

    src = _Source(batches, args.steps + args.warmup)
    rows = {"plain copy (.copy())": _timed(
        "plain copy (.copy())", iter(src), lambda b: (b[0].copy(), b[1].copy()), step,
        lambda: None, args, compute_ms, quiet)}
    with pinloader.AsyncPrefetcher(src, device="cpu", depth=2, staging_threads=staging) as pf:
        rows["pinloader"] = _timed("pinloader", iter(pf),
                                   lambda b: (np.from_dlpack(b[0]), np.from_dlpack(b[1])),
                                   step, lambda: None, args, compute_ms, quiet)
        stats = pf.stats()
    return {"framework": "numpy", "device": "cpu", "batch_bytes": nbytes, "compute_ms": compute_ms,
            "compute_reps": reps, "compute_threads": compute_threads,
            "staging_threads": staging, "rows": rows, "pinloader_stats": stats}


def _host_note(result: dict[str, Any]) -> str:
    mb = result["batch_bytes"] / 1e6
    compute = f"{result['compute_threads']} compute thread(s)"
    return (
        f"What this run shows: there is no usable GPU here, so the demo ran on pinloader's host "
        f"backend, where 'device' memory is host memory and each copy is a memcpy by a CPU "
        f"thread, not a DMA engine. Every row copies each {mb:.1f} MB batch once into new memory "
        f"and runs the same compute; pinloader copies it twice (into its pinned staging buffer "
        f"with {result['staging_threads']} staging thread(s), then into 'device' memory on its "
        f"copy thread) while the previous step computes, and those threads share the "
        f"{result['cpu_count']} core(s) with {compute}. 'compute ms/step' is the time of the "
        f"step itself (calibrated at {result['compute_ms']:.2f} ms when nothing else runs): "
        f"where it is higher, copying threads took cores from the compute. That is CPU "
        f"contention, not idle time, and it is why pinloader can lose to a single plain copy "
        f"here: it does more copying on the same cores. So the table shows that the pipeline "
        f"works and how much loading it hides on this CPU; it does not predict what pinloader "
        f"gains on a GPU, where the copy runs on the DMA engine beside the GPU's compute and "
        f"takes nothing from it.")


def _gpu_note(result: dict[str, Any]) -> str:
    return (
        "plain .to(): pageable copy, the step waits for it. pin_memory + non_blocking: pinned on "
        "the main thread every step, then an asynchronous copy. pinloader: staged into reused "
        f"pinned memory by {result['staging_threads']} threads off the GIL and copied on its own "
        "stream while the previous step computes. Idle % is 1 - compute / step time.")


def run(args: Any) -> int:
    quiet = args.json
    for name in ("batch_size", "image_size", "steps"):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if args.warmup < 0 or (args.compute_ms is not None and args.compute_ms <= 0) or (
            args.staging_threads is not None and args.staging_threads < 1):
        print("--warmup must be >= 0, --compute-ms > 0 and --staging-threads >= 1", file=sys.stderr)
        return 2
    try:
        import torch
        have_torch = True
        built = torch.backends.cuda.is_built()  # type: ignore[no-untyped-call, unused-ignore]
        torch_cuda = bool(built) and torch.cuda.is_available()
    except ImportError:
        have_torch = torch_cuda = False
    try:
        device, fallback = _resolve_device(args.device, have_torch, torch_cuda)
    except DeviceError as exc:
        print(f"pinloader demo: {exc}", file=sys.stderr)
        return 2
    cuda = device.startswith("cuda")
    if fallback:
        print(f"pinloader demo: {fallback}", file=sys.stderr, flush=True)
    if not quiet:
        where = f"GPU {device}" if cuda else "the CPU (pinloader's host backend: no usable GPU)" \
            if pinloader.backend() == "host" else "the CPU (pinloader's host backend)"
        print(f"pinloader {pinloader.__version__} demo on {where}: batches of {args.batch_size} x "
              f"3 x {args.image_size} x {args.image_size} float32 + int64 labels; each loading "
              f"method runs {args.warmup} warm-up + {args.steps} timed steps", flush=True)
    if have_torch:
        result = _run_torch(args, device, quiet)
    else:
        result = _run_numpy(args, quiet)
    if fallback:
        result["fallback"] = fallback
    result["backend"] = pinloader.backend()
    result["cpu_count"] = _cpus()
    result["note"] = _gpu_note(result) if cuda else _host_note(result)
    if args.json:
        print(json.dumps(result, indent=2, default=float))
        return 0
    print(f"\nbatch {result['batch_bytes'] / 1e6:.1f} MB, compute {result['compute_ms']:.2f} ms/step "
          f"({result['framework']} on {result['device']}), {result['cpu_count']} CPU core(s)\n")
    # On a GPU the last column is the share of the step the GPU had no work; on the CPU it is
    # the step's own compute time, which copying threads slow down by taking cores from it.
    last, key, fmt = ("GPU idle %", "idle_pct", ".1f") if cuda else ("compute ms/step", "compute_ms", ".2f")
    print(f"| {'loading':<26} | {'samples/s':>10} | {'data wait ms/step':>17} | {last:>15} |")
    print(f"|{'-' * 28}|{'-' * 12}|{'-' * 19}|{'-' * 17}|")
    for name, r in result["rows"].items():
        print(f"| {name:<26} | {r['samples_per_s']:>10,.0f} | {r['data_wait_ms']:>17.2f} | {r[key]:>15{fmt}} |")
    s = result["pinloader_stats"]
    timed = result["rows"]["pinloader"]
    print(f"\npinloader: {s['batches']} batches copied ({args.warmup} warm-up + {args.steps} "
          f"timed), {s['h2d_gbps']:.2f} GB/s delivered, data wait p99 over the timed steps "
          f"{timed['data_wait_ms_p99']:.2f} ms (the first warm-up batch, which waits for the "
          f"pipeline to fill, is not counted), pinned peak {s['pinned_bytes_peak'] / 1e6:.0f} MB, "
          f"{result['staging_threads']} staging thread(s)\n")
    import textwrap

    print(textwrap.fill(result["note"], width=96))
    return 0
