#!/usr/bin/env python3
"""Copy/compute overlap in a synthetic training loop: the seed write-up's experiment, redone.

Each step takes a batch of 128 x 3 x 224 x 224 float32 images plus 128 int64 labels and runs a
chain of bf16 8192 x 8192 matrix products that depends on the batch, so the step cannot start
before its batch is on the GPU. The number of products (plus one partial product) is calibrated
so that the compute takes a target time; by default about 1.2x and 8x the time of one pinned
host-to-device copy of the batch, measured first.

Three sources:
  dataset   a per-sample in-RAM Dataset of float32 images read through torch DataLoaders (8
            worker processes, prefetch_factor 3, persistent workers); the loader itself is
            slow here.
  crops     the common case: a per-sample in-RAM Dataset of 256 x 256 uint8 images, each
            sample a random 224 x 224 crop with a random horizontal flip, through the same
            DataLoaders (uint8 batches, 19 MB).
  collated  pre-collated numpy batches (a ring of distinct batches, reused); the loader is not
            the bottleneck, so the copy path is. Its pin_memory DataLoader has no workers by
            default (--collated-workers), since moving 77 MB batches between processes would
            make the loader the bottleneck again.

Loops (--loops), both over epochs of --epoch-steps steps (60 by default; 0: one epoch as long
as the run):
  reused      each row's loader object (pinloader prefetcher, the seed's wrapper, the side-stream
              prefetcher) is created once and iterated epoch after epoch
  per_epoch   it is created anew at the start of every epoch, as a loop written
              `for epoch ...: batches = pt.prefetch(loader)` does (DataLoaders themselves are
              created once, outside the loop, in both modes)
The measured steps span epoch boundaries, so the cost of starting an epoch is in the figures.

Rows (ways of getting a batch onto the GPU):
  pageable          pageable source, blocking .to(device)
  dl_pinned         DataLoader(pin_memory=True), .to(device, non_blocking=True); the DataLoader
                    pins in its pin thread when it has workers, else in the main thread
  pin_inline        pageable source, .pin_memory() in the training loop, non_blocking .to()
  seed              the seed write-up's AsyncGPUDataLoader over the pin_memory DataLoader,
                    reproduced as published (side stream of priority -1, wait_stream before
                    yielding the previous batch, no record_stream)
  apex              a correct side-stream prefetcher (wait_stream + record_stream, Apex-style)
                    over the pin_memory DataLoader
  pinloader         pinloader.torch.prefetch over the pageable source
  pinloader_pinned  pinloader.torch.prefetch over batches that are numpy views of PinnedBuffers
                    (collated source only)
  on_gpu            the batches are already on the GPU (upper bound)

Columns, per step and as the median over repeats (min-max in brackets):
  samples/s, step time (wall clock over the measured steps, ending with the last step's compute)
  data wait: time the compute stream spends between one step's compute and the next, from CUDA
             events; it covers copies on that stream, waits on copy streams and starvation while
             the host is blocked fetching the batch
  host wait: host time blocked in next() on the feed (fetching plus any blocking copy)
  GPU idle:  1 - compute-only time / step time, the compute-only time measured back to back with
             the data already on the GPU
  idle in run: 1 - (sum of the compute times measured by events in the run) / (run's wall
             time); the GPU's clocks depend on its load, so this can differ from GPU idle by a
             few percent
  host CPU:  process CPU time per step (all threads of this process: pin threads and pinloader's
             threads included, DataLoader worker processes excluded)
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402
from _overlap_sources import IMAGE_SHAPE, SOURCE_KINDS, SOURCE_LABELS, SOURCES  # noqa: E402
from _overlap_sources import WORKER_COLLATED, Epochs  # noqa: E402
from _peers import AsyncGPUDataLoader, SideStreamPrefetcher  # noqa: E402

torch = None  # imported by main() once the arguments are parsed

DIM = 8192

LOOPS = ("reused", "per_epoch")
LOOP_LABELS = {"reused": "loader reused across epochs", "per_epoch": "loader created per epoch"}
ROWS = ("pageable", "dl_pinned", "pin_inline", "seed", "apex",
        "pinloader", "pinloader_pinned", "on_gpu")
ROW_LABELS = {
    "pageable": "pageable, blocking `.to()`",
    "dl_pinned": "DataLoader `pin_memory=True`, `non_blocking`",
    "pin_inline": "`.pin_memory()` inline, `non_blocking`",
    "seed": "seed's two-stream `AsyncGPUDataLoader`",
    "apex": "side-stream prefetcher + `record_stream` (Apex-style)",
    "pinloader": "pinloader `torch.prefetch`",
    "pinloader_pinned": "pinloader, PinnedBuffer source",
    "on_gpu": "data already on the GPU (upper bound)",
}
NOT_APPLICABLE = {(src, "pinloader_pinned"): WORKER_COLLATED for src in ("dataset", "crops")}


# --------------------------------------------------------------------------- feeds (rows)

class Feed:
    """An endless iterator of (inputs, targets) CUDA tensors usable on the current stream:
    epoch after epoch of a row's loader, created once (reused) or per epoch (per_epoch)."""

    def __init__(self, new_loader, per_epoch):
        self._new_loader = new_loader
        self._per_epoch = per_epoch
        self._loader = None
        self.epochs = 0
        self.iterator = self._batches()

    def _batches(self):
        while True:
            if self._loader is None or self._per_epoch:
                self._close_loader()
                self._loader = self._new_loader()
            n = 0
            for batch in self._loader:
                n += 1
                yield batch
            self.epochs += 1
            if n == 0:
                raise RuntimeError("an epoch yielded no batches")

    def _close_loader(self):
        loader, self._loader = self._loader, None
        return common.close_quietly(loader) if loader is not None else None

    def stats(self):
        fn = getattr(self._loader, "stats", None)
        return fn() if callable(fn) else None

    def close(self):
        self.iterator.close()
        self._new_loader = None  # drop the source it holds (PinnedBuffer views...)
        return self._close_loader()


def _tensor(a):
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else a


class _Moved:
    """One epoch of ``source`` with ``move`` applied to every (x, y)."""

    def __init__(self, source, move):
        self.source = source
        self.move = move

    def __iter__(self):
        move = self.move
        for x, y in self.source:
            yield move(x, y)


def loader_factory(row, source, ctx):
    """A function returning a new loader object of ``row`` (one epoch per iteration)."""
    dev = ctx["device"]
    if row == "pageable":
        src = source.pageable()
        return lambda: _Moved(src, lambda x, y: (_tensor(x).to(dev), _tensor(y).to(dev)))
    if row == "dl_pinned":
        src = source.pinned()
        return lambda: _Moved(src, lambda x, y: (x.to(dev, non_blocking=True),
                                                 y.to(dev, non_blocking=True)))
    if row == "pin_inline":
        src = source.pageable()
        return lambda: _Moved(src, lambda x, y: (
            _tensor(x).pin_memory().to(dev, non_blocking=True),
            _tensor(y).pin_memory().to(dev, non_blocking=True)))
    if row == "seed":
        src = source.pinned()
        return lambda: AsyncGPUDataLoader(src, torch.device(dev), torch)
    if row == "apex":
        src = source.pinned()
        return lambda: SideStreamPrefetcher(src, torch.device(dev), torch)
    if row in ("pinloader", "pinloader_pinned"):
        common.require_pinloader_cuda()
        import pinloader.torch as pt
        src = source.pageable() if row == "pinloader" else source.pinned_buffers()
        return lambda: pt.prefetch(src, device=dev, **ctx["pinloader_opts"])
    if row == "on_gpu":
        src = Epochs(ctx["gpu_ring"], ctx["epoch_batches"])
        return lambda: src
    raise ValueError(f"unknown row {row!r}")


def make_feed(row, source, ctx, loop):
    return Feed(loader_factory(row, source, ctx), per_epoch=(loop == "per_epoch"))


# --------------------------------------------------------------------------- compute

class SyntheticStep:
    """A compute step that depends on the batch: a chain of bf16 DIM x DIM matrix products.

    The first DIM-wide slice of each image (as bf16) replaces the top rows of the weight to
    form the chain's first operand; ``full`` products of DIM x DIM by DIM x DIM follow, then
    one product of the first ``tail`` rows, which gives a finer step than a whole product."""

    def __init__(self, device, dim=DIM):
        gen = torch.Generator(device=device).manual_seed(0)
        w = torch.randn((dim, dim), device=device, generator=gen)
        self.w = (w / math.sqrt(dim)).to(torch.bfloat16)
        self.dim = dim
        self.full = 1
        self.tail = 0

    def configure(self, full, tail):
        self.full, self.tail = int(full), int(tail)

    def __call__(self, x, y):
        b = x.shape[0]
        h = x.view(b, -1)[:, :self.dim].to(torch.bfloat16)
        m = torch.cat((h, self.w[b:]))
        for _ in range(self.full):
            m = m @ self.w
        if self.tail:
            m = m[:self.tail] @ self.w
        return (m[0, :b].float() * y.to(torch.float32)).sum()


def _time_back_to_back(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    with common.CudaTimer(torch) as timer:
        for _ in range(iters):
            fn()
    return timer.elapsed_ms() / iters


def compute_only_ms(step, gx, gy, target_ms):
    """Back-to-back compute time per step with the data on the GPU.

    About 50 ms of untimed steps first bring the clocks up from idle; the timed stretch is
    about 150 ms. The GPU's clocks depend on how long it has been busy (power management), so
    this figure and the compute time inside a run (gpu_compute_ms) can differ by several
    percent."""
    per = max(target_ms, 0.1)
    warmup = max(3, int(50 / per))
    iters = max(5, min(100, int(150 / per)))
    return _time_back_to_back(lambda: step(gx, gy), iters, warmup)


def _plan(target_ms, matmul_ms, dim, granule=256):
    full = int(target_ms // matmul_ms)
    rest = target_ms - full * matmul_ms
    tail = int(round(rest / matmul_ms * dim / granule)) * granule
    if tail >= dim:
        full, tail = full + 1, 0
    if full == 0 and tail == 0:
        tail = granule
    return full, tail


def calibrate(step, gx, gy, target_ms, matmul_ms):
    """Choose (full, tail) so that the step takes about target_ms; measured, not predicted."""
    effective = target_ms
    best = None
    tried = []
    for _ in range(4):
        full, tail = _plan(effective, matmul_ms, step.dim)
        step.configure(full, tail)
        ms = compute_only_ms(step, gx, gy, target_ms)
        tried.append({"full": full, "tail": tail, "ms": ms})
        if best is None or abs(ms - target_ms) < abs(best[2] - target_ms):
            best = (full, tail, ms)
        if abs(ms - target_ms) <= 0.04 * target_ms:
            break
        effective *= target_ms / ms
    step.configure(best[0], best[1])
    return {"target_ms": target_ms, "full_matmuls": best[0], "tail_rows": best[1],
            "calibrated_ms": best[2], "tried": tried}


def measure_pinned_copy(args):
    """Time of one pinned H2D copy of a batch (images + labels) on a side stream."""
    x = torch.rand((args.batch_size, *IMAGE_SHAPE)).pin_memory()
    y = torch.randint(0, 1000, (args.batch_size,)).pin_memory()
    xd = torch.empty_like(x, device=args.device)
    yd = torch.empty_like(y, device=args.device)
    stream = torch.cuda.Stream(device=args.device)
    samples = []
    with torch.cuda.stream(stream):
        for i in range(3 + args.copy_repeats):
            with common.CudaTimer(torch) as timer:
                xd.copy_(x, non_blocking=True)
                yd.copy_(y, non_blocking=True)
            ms = timer.elapsed_ms()
            if i >= 3:
                samples.append(ms)
    nbytes = x.nbytes + y.nbytes
    summary = common.summarize(samples)
    return {"bytes": nbytes, "ms": summary, "samples_ms": samples,
            "gbps": nbytes / (summary["median"] * 1e-3) / 1e9}


# --------------------------------------------------------------------------- one run

def run_steps(feed, step, steps, warmup, max_ahead, batch_size):
    """Drive ``steps`` measured steps (after ``warmup``) and return the per-run metrics."""
    total = warmup + steps
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    host_wait = []
    harness_cpu = 0.0
    it = feed.iterator
    result = None
    t0 = c0 = None
    for i in range(total):
        if i == warmup:
            torch.cuda.synchronize()
            harness_cpu = 0.0
            t0, c0 = time.perf_counter(), time.process_time()
        if i >= max_ahead:
            h0 = time.thread_time()
            common.wait_event(ends[i - max_ahead])
            harness_cpu += time.thread_time() - h0
        f0 = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            raise RuntimeError(f"the feed ended after {i} batches; {total} were needed") from None
        waited = time.perf_counter() - f0
        if i >= warmup:
            host_wait.append(waited)
        starts[i].record()
        result = step(x, y)
        ends[i].record()
        del x, y
    h0 = time.thread_time()
    common.wait_event(ends[-1])
    harness_cpu += time.thread_time() - h0
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0 - harness_cpu
    torch.cuda.synchronize()
    del result

    compute = [starts[i].elapsed_time(ends[i]) for i in range(warmup, total)]
    gaps = [ends[i - 1].elapsed_time(starts[i]) for i in range(warmup + 1, total)]
    waits_ms = [1e3 * w for w in host_wait]
    step_ms = 1e3 * wall / steps
    gap = common.summarize(gaps)
    wait = common.summarize(waits_ms)
    return {
        "steps": steps,
        "warmup": warmup,
        "step_ms": step_ms,
        "samples_per_s": batch_size * steps / wall,
        "data_wait_ms": gap["mean"],
        "data_wait_ms_p90": gap["p90"],
        "host_wait_ms": wait["mean"],
        "host_wait_ms_p90": wait["p90"],
        "gpu_compute_ms": common.summarize(compute)["mean"],
        "stream_idle_pct": 100.0 * (1.0 - sum(compute) / (1e3 * wall)),
        "cpu_ms_per_step": 1e3 * cpu / steps,
        "per_step": {
            "host_wait_ms": [round(v, 4) for v in waits_ms],
            "gpu_gap_ms": [round(v, 4) for v in gaps],
            "gpu_compute_ms": [round(v, 4) for v in compute],
        },
    }


def run_row(row, source, ctx, steps, warmup, loop):
    feed = None
    record = {}
    try:
        feed = make_feed(row, source, ctx, loop)
        record = run_steps(feed, ctx["step"], steps, warmup, ctx["max_ahead"],
                           ctx["batch_size"])
        record["epochs_started"] = feed.epochs + 1
        try:
            stats = feed.stats()
        except Exception as exc:
            stats = {"error": f"{type(exc).__name__}: {exc}"}
        if stats is not None:
            record["pinloader_stats"] = stats
    except Exception as exc:
        record = common.error_record(exc)
    finally:
        if feed is not None:
            err = feed.close()
            if err and "error" not in record:
                record["close_error"] = err["error"]
        # The row's garbage goes now: a cycle holding CUDA tensors (a side-stream prefetcher's
        # batches, record_stream'd) left for later would be inherited by the DataLoader workers
        # that a later row forks, and a collection there would free them in a process that
        # cannot use CUDA (a suspected cause of the aborted workers in
        # benchmarks/results/h100_2026-12-05/README.md).
        feed = None
        gc.collect()
        try:
            torch.cuda.synchronize()
        except Exception as exc:
            record.setdefault("error", f"after the run: {type(exc).__name__}: {exc}")
    return record


# --------------------------------------------------------------------------- driver

METRICS = ("samples_per_s", "step_ms", "data_wait_ms", "host_wait_ms", "idle_pct",
           "stream_idle_pct", "cpu_ms_per_step", "gpu_compute_ms")


def summarize_results(results):
    for res in results:
        ok = [r for r in res["repeats"] if "error" not in r]
        res["summary"] = {m: common.summarize(r.get(m) for r in ok) for m in METRICS}
        errors = [r["error"] for r in res["repeats"] if "error" in r]
        if errors:
            res["errors"] = sorted(set(errors))
        res["status"] = ("not applicable" if res.get("not_applicable")
                         else "ok" if ok and not errors
                         else "partial" if ok else "error")


TORCH_ROWS = ("pageable", "dl_pinned", "pin_inline", "seed", "apex")


def target_ratios(results, levels):
    """The issue's targets, per source, compute level and loop, from the medians of samples/s:
    pinloader / seed (>= 1.05), pinloader / Apex-style (>= 1), per-epoch / reused pinloader
    (>= 0.97), pinloader / best PyTorch row (>= 1.5 for the per-sample sources)."""
    med = {}
    for res in results:
        m = res.get("summary", {}).get("samples_per_s", {}).get("median")
        med[(res["source"], res["level"], res.get("loop"), res["row"])] = m
    out = []
    for (source, level, loop, row), v in sorted(med.items(), key=lambda kv: str(kv[0])):
        if row != "pinloader":
            continue
        get = lambda r, lp=loop: med.get((source, level, lp, r))  # noqa: E731
        torch_best = max((get(r) for r in TORCH_ROWS if get(r)), default=None)
        out.append({
            "source": source, "level": level, "loop": loop,
            "target_ms": next((lv["target_ms"] for lv in levels if lv["level"] == level), None),
            "pinloader": v,
            "over_seed": common.ratio(v, get("seed")),
            "over_apex": common.ratio(v, get("apex")),
            "over_best_torch": common.ratio(v, torch_best),
            "per_epoch_over_reused": (common.ratio(v, get("pinloader", "reused"))
                                      if loop == "per_epoch" else None),
        })
    return out


def render_markdown(payload):
    lines = ["# Copy/compute overlap (`bench_overlap.py`)", ""]
    lines += common.machine_summary_lines(payload["machine"])
    cfg = payload["config"]
    copy = payload["pinned_copy"]
    lines += [
        "",
        f"Batch: {cfg['batch_size']} x {' x '.join(map(str, IMAGE_SHAPE))} float32 + "
        f"{cfg['batch_size']} int64 labels ({copy['bytes'] / 1e6:.1f} MB). One pinned H2D copy "
        f"of it: {common.fmt_summary(copy['ms'], 3)} ms, {copy['gbps']:.1f} GB/s.",
        f"Loop: the host waits for step i-{cfg['max_ahead']}'s compute before fetching batch i "
        f"(`--max-ahead`); pinloader options: `{cfg['pinloader_opts']}`. Epochs of "
        f"{cfg.get('epoch_steps') or 'the whole run'} steps; loop modes: "
        + ", ".join(f"{lp} ({LOOP_LABELS[lp]})" for lp in cfg.get("loops", [])) + ".",
        "Cells: median over repeats (min–max). Repeats: "
        f"{cfg['repeats']}.",
        "",
        "## Compute levels",
        "",
    ]
    level_rows = []
    for lvl in payload["compute_levels"]:
        only = common.summarize(lvl.get("compute_only_ms", []))
        level_rows.append([lvl["level"], common.fmt_num(lvl["target_ms"]),
                           f"{lvl['full_matmuls']} + {lvl['tail_rows']} rows",
                           common.fmt_summary(only, 3)])
    lines.append(common.md_table(["level", "target (ms)", "8192² products + partial",
                                  "compute-only (ms)"], level_rows))
    for source in payload["sources"]:
        lines += ["", f"## Source: {source} — {SOURCE_LABELS[source]}", "",
                  payload["source_descriptions"].get(source, ""), "",
                  f"Steps per run: {payload['steps'][source]['steps']} measured after "
                  f"{payload['steps'][source]['warmup']} warm-up.", ""]
        table = []
        for lvl in payload["compute_levels"]:
            for res in payload["results"]:
                if res["source"] != source or res["level"] != lvl["level"]:
                    continue
                label = ROW_LABELS[res["row"]]
                compute = common.fmt_num(lvl["target_ms"], 1) + (
                    f", {res['loop']}" if res.get("loop") else "")
                if res["status"] == "not applicable":
                    table.append([label, compute, "n/a", "", "", "", "", "", ""])
                    continue
                if res["status"] == "error":
                    msg = res["errors"][0].replace("|", "/")
                    table.append([label, compute, f"error: {msg[:160]}", "", "", "", "", "", ""])
                    continue
                s = res["summary"]
                label_cell = label + (" (some repeats failed)" if res["status"] == "partial" else "")
                table.append([
                    label_cell, compute,
                    common.fmt_summary(s["samples_per_s"], 0),
                    common.fmt_summary(s["step_ms"], 2),
                    common.fmt_summary(s["data_wait_ms"], 2),
                    common.fmt_summary(s["host_wait_ms"], 2),
                    common.fmt_summary(s["idle_pct"], 1),
                    common.fmt_summary(s["stream_idle_pct"], 1),
                    common.fmt_summary(s["cpu_ms_per_step"], 2),
                ])
        lines.append(common.md_table(
            ["row", "compute (ms), loop", "samples/s", "step (ms)", "data wait (ms)",
             "host wait (ms)", "GPU idle (%)", "idle in run (%)", "host CPU (ms/step)"],
            table))
    targets = payload.get("targets") or []
    if targets:
        lines += ["", "## Targets (ratios of median samples/s)", ""]
        trows = [[t["source"], common.fmt_num(t["target_ms"], 2), t["loop"],
                  common.fmt_num(t["pinloader"], 0), common.fmt_num(t["over_seed"], 3),
                  common.fmt_num(t["over_apex"], 3), common.fmt_num(t["over_best_torch"], 3),
                  common.fmt_num(t["per_epoch_over_reused"], 3)] for t in targets]
        lines.append(common.md_table(
            ["source", "compute (ms)", "loop", "pinloader samples/s", "/ seed (≥ 1.05)",
             "/ Apex-style (≥ 1)", "/ best PyTorch row (≥ 1.5 per-sample)",
             "per-epoch / reused (≥ 0.97)"], trows))
    lines += ["", "Data wait: mean gap on the compute stream between consecutive steps' compute "
              "(CUDA events). Host wait: mean host time blocked in `next()`. GPU idle: "
              "1 − compute-only / step. Idle in run: 1 − (compute time measured by events in "
              "the run) / (wall time of the run); GPU clocks vary with load, so the two idle "
              "figures can differ by a few percent. Host CPU: process CPU time per step, all "
              "threads, DataLoader worker processes excluded.", ""]
    return "\n".join(lines)


def build_parser():
    p = argparse.ArgumentParser(
        description="Copy/compute overlap in a synthetic training loop (the seed's experiment).",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--sources", type=common.choice_list(SOURCES), default=list(SOURCES),
                   help="comma-separated sources (default: all): " + ", ".join(SOURCES))
    p.add_argument("--rows", type=common.choice_list(ROWS), default=list(ROWS),
                   help="comma-separated rows (default: all): " + ", ".join(ROWS))
    p.add_argument("--compute-ms", type=common.csv_list(float), default=None,
                   help="compute levels in ms (default: --compute-factors x pinned copy time)")
    p.add_argument("--compute-factors", type=common.csv_list(float), default=[1.2, 8.0],
                   help="compute levels as multiples of the pinned copy time (default: 1.2,8)")
    p.add_argument("--loops", type=common.choice_list(LOOPS), default=list(LOOPS),
                   help="comma-separated loop modes (default: all): " + ", ".join(LOOPS))
    p.add_argument("--epoch-steps", type=int, default=60,
                   help="batches per epoch (default: 60; 0: one epoch as long as the run)")
    p.add_argument("--repeats", type=int, default=3, help="runs of every row (default: 3)")
    p.add_argument("--steps", type=int, default=120,
                   help="measured steps per run, collated source (default: 120)")
    p.add_argument("--warmup", type=int, default=10,
                   help="warm-up steps per run, collated source (default: 10)")
    p.add_argument("--dataset-steps", type=int, default=60,
                   help="measured steps per run, dataset and crops sources (default: 60)")
    p.add_argument("--dataset-warmup", type=int, default=None,
                   help="warm-up steps per run, dataset source (default: workers x "
                        "prefetch_factor + 4, so the loader's initial backlog is consumed)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers, dataset source")
    p.add_argument("--prefetch-factor", type=int, default=3)
    p.add_argument("--collated-workers", type=int, default=0,
                   help="workers of the pin_memory DataLoader over the collated ring; 0 (the "
                        "default) pins in the main thread, N > 0 uses N worker processes and "
                        "the pin thread, which adds moving each batch between processes")
    p.add_argument("--dataset-samples", type=int, default=512,
                   help="distinct samples held in RAM by the dataset source (default: 512)")
    p.add_argument("--ring", type=int, default=8, help="distinct collated batches (default: 8)")
    p.add_argument("--depth", type=int, default=2, help="pinloader prefetch depth (default: 2)")
    p.add_argument("--staging-threads", type=int, default=None,
                   help="pinloader staging threads (default: pinloader's own default)")
    p.add_argument("--max-ahead", type=int, default=2,
                   help="before fetching batch i the loop waits for step i-N's compute, as a "
                        "loop that reads its loss one step late does; 1 = fully synchronous "
                        "(default: 2)")
    p.add_argument("--copy-repeats", type=int, default=20,
                   help="timed pinned copies for the reference copy time (default: 20)")
    p.add_argument("--settle-s", type=float, default=0.2,
                   help="pause after each run so background work of one row does not overlap "
                        "the next (default: 0.2)")
    p.add_argument("--quick", action="store_true",
                   help="a small run (well under a minute): 1 repeat, fewer steps, smaller ring")
    common.add_output_args(p, "overlap")
    return p


def apply_quick(args):
    if not args.quick:
        return
    args.repeats = 1
    args.steps = min(args.steps, 30)
    args.epoch_steps = min(args.epoch_steps, 15) if args.epoch_steps else 0
    args.warmup = min(args.warmup, 5)
    args.dataset_steps = min(args.dataset_steps, 10)
    args.ring = min(args.ring, 4)
    args.dataset_samples = min(args.dataset_samples, 256)
    args.copy_repeats = min(args.copy_repeats, 10)
    args.settle_s = min(args.settle_s, 0.05)


def main(argv=None):
    global torch
    args = build_parser().parse_args(argv)
    apply_quick(args)
    for name in ("steps", "dataset_steps"):
        if getattr(args, name) < 2:
            common.fail(f"--{name.replace('_', '-')} must be at least 2")
    if args.epoch_steps < 0:
        common.fail("--epoch-steps must be at least 0")
    if args.repeats < 1 or args.max_ahead < 1 or args.batch_size < 1:
        common.fail("--repeats, --max-ahead and --batch-size must be at least 1")
    if args.batch_size > DIM:
        common.fail(f"--batch-size must be at most {DIM}")
    if args.dataset_warmup is None:
        args.dataset_warmup = args.workers * args.prefetch_factor + 4
    torch = common.require_cuda(args.device)
    started = time.perf_counter()

    machine = common.machine_info(torch, args.device)
    common.log(f"overlap: {machine.get('gpu', {}).get('name')} | sources {args.sources} | "
               f"rows {args.rows} | repeats {args.repeats}")

    copy = measure_pinned_copy(args)
    copy_ms = copy["ms"]["median"]
    common.log(f"pinned copy of one batch: {copy_ms:.3f} ms ({copy['gbps']:.1f} GB/s)")
    targets = args.compute_ms or [f * copy_ms for f in args.compute_factors]

    step = SyntheticStep(args.device)
    gx = torch.rand((args.batch_size, *IMAGE_SHAPE), device=args.device)
    gy = torch.randint(0, 1000, (args.batch_size,), device=args.device)
    matmul_ms = _time_back_to_back(lambda: step.w @ step.w, 50, warmup=40)
    levels = []
    for i, target in enumerate(targets):
        cal = calibrate(step, gx, gy, target, matmul_ms)
        cal.update(level=i, matmul_ms=matmul_ms, compute_only_ms=[])
        levels.append(cal)
        common.log(f"level {i}: target {target:.2f} ms -> {cal['full_matmuls']} products + "
                   f"{cal['tail_rows']} rows, {cal['calibrated_ms']:.3f} ms")

    pinloader_opts = {"depth": args.depth}
    if args.staging_threads is not None:
        pinloader_opts["staging_threads"] = args.staging_threads
    slack = args.depth + 4
    steps_cfg = {"dataset": {"steps": args.dataset_steps, "warmup": args.dataset_warmup},
                 "crops": {"steps": args.dataset_steps, "warmup": args.dataset_warmup},
                 "collated": {"steps": args.steps, "warmup": args.warmup}}

    results = []
    descriptions = {}
    for source_name in args.sources:
        sc = steps_cfg[source_name]
        epoch_batches = args.epoch_steps or sc["warmup"] + sc["steps"] + slack
        common.log(f"source {source_name}: preparing")
        source = SOURCE_KINDS[source_name](torch, args, epoch_batches)
        descriptions[source_name] = source.describe()
        ctx = {"device": args.device, "step": step, "max_ahead": args.max_ahead,
               "batch_size": args.batch_size, "pinloader_opts": pinloader_opts,
               "gpu_ring": source.gpu_ring(args.device), "epoch_batches": epoch_batches}
        entries = {}
        for lvl in levels:
            for loop in args.loops:
                for row in args.rows:
                    entry = {"source": source_name, "row": row, "label": ROW_LABELS[row],
                             "loop": loop, "level": lvl["level"], "target_ms": lvl["target_ms"],
                             "repeats": []}
                    if (source_name, row) in NOT_APPLICABLE:
                        entry["not_applicable"] = NOT_APPLICABLE[(source_name, row)]
                    entries[(lvl["level"], loop, row)] = entry
                    results.append(entry)
        try:
            for rep in range(args.repeats):
                for lvl in levels:
                    step.configure(lvl["full_matmuls"], lvl["tail_rows"])
                    only = compute_only_ms(step, gx, gy, lvl["target_ms"])
                    lvl["compute_only_ms"].append(only)
                    for loop in args.loops:
                        for row in args.rows:
                            entry = entries[(lvl["level"], loop, row)]
                            if "not_applicable" in entry:
                                continue
                            rec = run_row(row, source, ctx, sc["steps"], sc["warmup"], loop)
                            rec["repeat"] = rep
                            rec["compute_only_ms"] = only
                            tag = f"  [{source_name} r{rep} L{lvl['level']} {loop:9s}] {row:17s}"
                            if "step_ms" in rec:
                                rec["idle_pct"] = 100.0 * (1.0 - only / rec["step_ms"])
                                common.log(f"{tag} {rec['samples_per_s']:9.0f} samples/s  step "
                                           f"{rec['step_ms']:7.2f} ms  idle {rec['idle_pct']:5.1f}%  "
                                           f"wait {rec['data_wait_ms']:.2f}/"
                                           f"{rec['host_wait_ms']:.2f} ms")
                            else:
                                common.log(f"{tag} {rec.get('error')}")
                            entry["repeats"].append(rec)
                            time.sleep(args.settle_s)
        finally:
            source.close()

    summarize_results(results)
    targets_out = target_ratios(results, levels)
    payload = {
        "benchmark": "overlap",
        "schema": 1,
        "machine": machine,
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "pinloader_opts": pinloader_opts, "image_shape": IMAGE_SHAPE, "dim": DIM},
        "sources": args.sources,
        "source_descriptions": descriptions,
        "steps": {s: steps_cfg[s] for s in args.sources},
        "pinned_copy": copy,
        "matmul_ms": matmul_ms,
        "compute_levels": levels,
        "results": results,
        "targets": targets_out,
        "elapsed_s": time.perf_counter() - started,
    }
    common.publish_timed(args.out, args.name, payload, render_markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
