#!/usr/bin/env python3
"""Host cost per batch for batches of many small leaves.

Batch kinds:
  32x4KiB   a dict of 32 float32 arrays of 4 KiB each
  256x1KiB  a dict of 256 float32 arrays of 1 KiB each

Methods (time per batch consumed, wall clock and this process's CPU time):
  pinloader_dlpack  pinloader.AsyncPrefetcher, torch.from_dlpack of every leaf
  pinloader_raw     pinloader.AsyncPrefetcher, batches taken without converting the leaves
  pinloader_torch   pinloader.torch.prefetch (yields torch CUDA tensors)
  dl_pin_thread     DataLoader(IterableDataset, batch_size=None, num_workers=N, pin_memory=True):
                    its pin thread pins every tensor; the loop calls .to(non_blocking=True) on each
  dl_pin_inline     the same DataLoader with num_workers=0 (pinned in the main thread)
  blocking_to       the batches from an in-process iterator, blocking .to(device) on each tensor

Each run consumes warm-up batches, synchronises, then times N batches and synchronises again,
so the time covers the copies finishing too. N is --batches, lowered for slow methods so that
a run stays near --max-run-s (never below --min-batches).

Reported ratios: dl_pin_thread / pinloader_dlpack (the target: >= 8) and, because the pin
thread path also pays for moving every tensor between processes, dl_pin_inline /
pinloader_dlpack, which compares pinning alone; for the torch front door, pinloader_torch's
host time per batch (target: <= 150 µs for 32 x 4 KiB) and dl_pin_thread / pinloader_torch
(target: >= 3.8).

Breakdown (per leaf, µs, on one batch held by the consumer): what pinloader.torch.prefetch
pays per batch and per leaf, measured piece by piece: torch.cuda.current_stream() (once per
batch), the batch's export for that stream (pinloader._C.export_capsules), torch's import of
one capsule (torch._C._from_dlpack), and for comparison torch.from_dlpack(DeviceArray) (which
looks the current stream up again for every leaf). The structure is built in C around the
imported leaves (Note [handout] in src/py/handout.h), so there is no separate rebuild.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

torch = None  # imported by main() once the arguments are parsed

KINDS = {"32x4KiB": (32, 4 * common.KiB), "256x1KiB": (256, 1 * common.KiB)}
DEFAULT_BATCHES = {"32x4KiB": 1000, "256x1KiB": 300}
METHODS = ("pinloader_dlpack", "pinloader_raw", "pinloader_torch",
           "dl_pin_thread", "dl_pin_inline", "blocking_to")
METHOD_LABELS = {
    "pinloader_dlpack": "pinloader AsyncPrefetcher + `torch.from_dlpack` per leaf",
    "pinloader_raw": "pinloader AsyncPrefetcher, no conversion",
    "pinloader_torch": "pinloader `torch.prefetch`",
    "dl_pin_thread": "DataLoader pin thread + per-tensor `non_blocking` `.to()`",
    "dl_pin_inline": "DataLoader `num_workers=0`, `pin_memory=True` + `non_blocking` `.to()`",
    "blocking_to": "per-tensor blocking `.to()`",
}
RATIO_TARGET = 8.0
TORCH_US_TARGET = 100.0
TORCH_RATIO_TARGET = 3.8


def make_ring(kind, ring):
    count, nbytes = KINDS[kind]
    rng = np.random.default_rng(3)
    return [{f"f{i:03d}": rng.random(nbytes // 4, dtype=np.float32) for i in range(count)}
            for _ in range(ring)]


def numpy_batches(ring, total):
    for i in range(total):
        yield ring[i % len(ring)]


def torch_batches(ring_t, total):
    for i in range(total):
        yield ring_t[i % len(ring_t)]


class RingStream:
    """Iterable-style dataset over a ring of batches (each worker yields the whole stream)."""

    def __init__(self, ring_t, total):
        self.ring_t = ring_t
        self.total = total

    def __iter__(self):
        return torch_batches(self.ring_t, self.total)


def _iterable_dataset(ring_t, total):
    class _Stream(RingStream, torch.utils.data.IterableDataset):
        pass
    return _Stream(ring_t, total)


def make_run(method, ring, ring_t, total, args):
    """Return (iterable, consume, closers) for one method."""
    dev = args.device
    if method in ("pinloader_dlpack", "pinloader_raw"):
        pinloader = common.require_pinloader_cuda()
        pf = pinloader.AsyncPrefetcher(numpy_batches(ring, total), device=dev, depth=args.depth)
        if method == "pinloader_dlpack":
            def consume(batch):
                for leaf in batch.values():
                    torch.from_dlpack(leaf)
        else:
            def consume(batch):
                pass
        return pf, consume, [pf]
    if method == "pinloader_torch":
        common.require_pinloader_cuda()
        import pinloader.torch as pt
        it = pt.prefetch(numpy_batches(ring, total), device=dev, depth=args.depth)
        return it, (lambda batch: None), [it]
    if method in ("dl_pin_thread", "dl_pin_inline"):
        workers = args.workers if method == "dl_pin_thread" else 0
        kw = dict(batch_size=None, num_workers=workers, pin_memory=True)
        if workers:
            kw.update(prefetch_factor=args.prefetch_factor, multiprocessing_context="fork")
        per_worker = total if workers == 0 else -(-total // workers) + args.prefetch_factor + 2
        loader = torch.utils.data.DataLoader(_iterable_dataset(ring_t, per_worker), **kw)

        def consume(batch):
            for t in batch.values():
                t.to(dev, non_blocking=True)
        return loader, consume, []
    if method == "blocking_to":
        def consume(batch):
            for t in batch.values():
                t.to(dev)
        return torch_batches(ring_t, total), consume, []
    raise ValueError(f"unknown method {method!r}")


def run_once(method, ring, ring_t, batches, args):
    """Warm up, then time up to ``batches`` batches (fewer if they would take over
    --max-run-s, never fewer than --min-batches)."""
    total = args.warmup + batches
    iterable, consume, closers = make_run(method, ring, ring_t, total, args)
    it = iter(iterable)
    stats = None
    try:
        consume(next(it))
        warm = 1
        w0 = time.perf_counter()
        while warm < args.warmup and (warm < 5 or time.perf_counter() - w0 < args.max_warmup_s):
            consume(next(it))
            warm += 1
        torch.cuda.synchronize()
        per_batch = (time.perf_counter() - w0) / max(1, warm - 1)
        if per_batch > 0:
            affordable = int(args.max_run_s / per_batch)
            batches = min(batches, max(args.min_batches, affordable))
        timer = common.HostTimer().start()
        for _ in range(batches):
            consume(next(it))
        torch.cuda.synchronize()
        timer.stop()
        for obj in (iterable, it):
            fn = getattr(obj, "stats", None)
            if callable(fn):
                stats = fn()
                break
    finally:
        for obj in closers:
            common.close_quietly(obj)
        if it is not iterable:
            common.close_quietly(it)
        del it, iterable
        gc.collect()
    rec = {"batches": batches, "warmup": warm,
           "us_per_batch": 1e6 * timer.wall_s / batches,
           "cpu_us_per_batch": 1e6 * timer.cpu_s / batches}
    if stats is not None:
        rec["pinloader_stats"] = stats
    return rec


def build_parser():
    p = argparse.ArgumentParser(
        description="Host time per batch for batches of many small arrays.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--kinds", type=common.choice_list(list(KINDS)), default=list(KINDS),
                   help="batch kinds (default: all): " + ", ".join(KINDS))
    p.add_argument("--methods", type=common.choice_list(METHODS), default=list(METHODS),
                   help="comma-separated methods (default: all): " + ", ".join(METHODS))
    p.add_argument("--batches", type=int, default=None,
                   help="timed batches per run (default: 1000 for 32x4KiB, 300 for 256x1KiB)")
    p.add_argument("--warmup", type=int, default=50,
                   help="untimed batches first (default: 50; fewer, but at least 5, if they take "
                        "over --max-warmup-s)")
    p.add_argument("--max-warmup-s", type=float, default=1.0,
                   help="time limit of the warm-up (default: 1.0)")
    p.add_argument("--max-run-s", type=float, default=3.0,
                   help="time limit of one timed run, estimated from the warm-up; slow methods "
                        "time fewer batches (default: 3.0)")
    p.add_argument("--min-batches", type=int, default=30,
                   help="fewest timed batches per run whatever the time limit (default: 30)")
    p.add_argument("--repeats", type=int, default=3, help="runs of every method (default: 3)")
    p.add_argument("--ring", type=int, default=4, help="distinct batches, reused (default: 4)")
    p.add_argument("--depth", type=int, default=2, help="pinloader prefetch depth (default: 2)")
    p.add_argument("--workers", type=int, default=2,
                   help="DataLoader workers for dl_pin_thread (default: 2)")
    p.add_argument("--prefetch-factor", type=int, default=2)
    p.add_argument("--quick", action="store_true",
                   help="a small run (well under a minute): 1 repeat, fewer batches")
    common.add_output_args(p, "overhead")
    return p


def apply_quick(args):
    if args.quick:
        args.repeats = 1
        args.warmup = min(args.warmup, 20)
        args.batches = min(args.batches or 200, 200)
        args.max_run_s = min(args.max_run_s, 1.0)
        args.max_warmup_s = min(args.max_warmup_s, 0.3)
        args.min_batches = min(args.min_batches, 20)


def _per_call_us(fn, reps, setup=None):
    """Median µs of fn(state) over ``reps`` calls; setup() makes a fresh state per call
    outside the timing (capsules can be consumed only once)."""
    samples = []
    for _ in range(reps):
        state = setup() if setup else None
        t0 = time.perf_counter()
        fn(state)
        samples.append(1e6 * (time.perf_counter() - t0))
    samples.sort()
    return samples[len(samples) // 2]


def breakdown(kind, ring, args):
    """Per-leaf and per-batch costs of the torch front door's pieces (see the docstring)."""
    pinloader = common.require_pinloader_cuda()
    from pinloader import _C
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    idx = (dev.index if dev.index is not None else torch.cuda.current_device()) if cuda else None
    reps = 200
    with pinloader.AsyncPrefetcher(numpy_batches(ring, 4), device=args.device, depth=2) as pf:
        batch = next(iter(pf))
        leaves = list(batch.values())
        n = len(leaves)
        handle = (torch.cuda.current_stream(idx).cuda_stream or 1) if cuda else None
        out = {"leaves": n, "native_export_capsules": True}
        out["current_stream_us_per_batch"] = _per_call_us(
            lambda _: torch.cuda.current_stream(idx), reps) if cuda else 0.0
        out["export_us_per_leaf"] = _per_call_us(
            lambda _: _C.export_capsules(leaves, handle), reps) / n
        out["dlpack_per_leaf_us"] = _per_call_us(
            lambda _: [leaf.__dlpack__(stream=handle) for leaf in leaves], reps) / n
        out["from_capsule_us_per_leaf"] = _per_call_us(
            lambda caps: [torch._C._from_dlpack(c) for c in caps], reps,
            setup=lambda: _C.export_capsules(leaves, handle)) / n
        out["from_dlpack_device_array_us_per_leaf"] = _per_call_us(
            lambda _: [torch.from_dlpack(leaf) for leaf in leaves], reps) / n
        batch = leaves = None  # the held batch goes back before the prefetcher closes
    torch.cuda.synchronize()
    # the structure is built in C with the leaves (Note [handout] in src/py/handout.h): no
    # separate flatten + rebuild any more
    out["predicted_door_us_per_batch"] = (
        out["current_stream_us_per_batch"]
        + n * (out["export_us_per_leaf"] + out["from_capsule_us_per_leaf"]))
    return out


def render_markdown(payload):
    cfg = payload["config"]
    lines = ["# Small-leaf overhead (`bench_overhead.py`)", ""]
    lines += common.machine_summary_lines(payload["machine"])
    lines += ["", f"Cells: median over {cfg['repeats']} repeat(s) (min–max). Wall time per batch "
              "consumed includes the copies finishing; CPU is this process's CPU time (all "
              "threads, DataLoader worker processes excluded). The pin thread path uses "
              f"{cfg['workers']} worker process(es) and the default tensor sharing strategy.", ""]
    for kind in cfg["kinds"]:
        res = payload["results"][kind]
        count, nbytes = KINDS[kind]
        lines += [f"## {kind}: dict of {count} float32 arrays of {common.format_size(nbytes)}", ""]
        rows = []
        for m in cfg["methods"]:
            r = res["methods"][m]
            if not r["summary"]["n"]:
                msg = (r.get("errors") or ["no result"])[0].replace("|", "/")
                rows.append([METHOD_LABELS[m], f"error: {msg[:160]}", "", ""])
                continue
            rows.append([METHOD_LABELS[m], common.fmt_summary(r["summary"], 1),
                         common.fmt_summary(r["cpu_summary"], 1),
                         common.fmt_num(r.get("vs_pinloader"), 2)])
        lines.append(common.md_table(["method", "µs / batch", "CPU µs / batch",
                                      "× pinloader_dlpack"], rows))
        rt = res.get("ratio_pin_thread_over_pinloader")
        ri = res.get("ratio_pin_inline_over_pinloader")
        lines += ["", f"DataLoader pin thread / pinloader (from_dlpack): "
                  f"**{common.fmt_num(rt, 2)}×** (target ≥ {RATIO_TARGET:g}×); "
                  f"DataLoader pinning in the main process / pinloader: {common.fmt_num(ri, 2)}×.",
                  ""]
        tu = res.get("torch_us_per_batch")
        if tu is not None:
            lines += [f"pinloader `torch.prefetch`: **{common.fmt_num(tu, 1)} µs** per batch "
                      f"(target ≤ {TORCH_US_TARGET:g} µs for 32 × 4 KiB); DataLoader pin thread / "
                      f"pinloader `torch.prefetch`: **{common.fmt_num(res.get('ratio_pin_thread_over_torch'), 2)}×** "
                      f"(target ≥ {TORCH_RATIO_TARGET:g}×).", ""]
        bd = res.get("breakdown")
        if bd and "error" not in bd:
            lines += ["Where `torch.prefetch`'s time goes (median per call, one held batch; "
                      + ("`pinloader._C.export_capsules`" if bd["native_export_capsules"]
                         else "no `export_capsules`: one `__dlpack__(stream=...)` per leaf")
                      + "):", "", common.md_table(["piece", "µs"], [
                          ["`torch.cuda.current_stream()`, once per batch",
                           common.fmt_num(bd["current_stream_us_per_batch"], 2)],
                          ["export for the stream, per leaf", common.fmt_num(bd["export_us_per_leaf"], 2)],
                          ["(`__dlpack__(stream=...)` alone, per leaf)",
                           common.fmt_num(bd["dlpack_per_leaf_us"], 2)],
                          ["torch's import of a capsule (`torch._C._from_dlpack`), per leaf",
                           common.fmt_num(bd["from_capsule_us_per_leaf"], 2)],
                          ["(`torch.from_dlpack(DeviceArray)`, per leaf, for comparison)",
                           common.fmt_num(bd["from_dlpack_device_array_us_per_leaf"], 2)],
                          ["sum for one batch (door only, prefetcher excluded)",
                           common.fmt_num(bd["predicted_door_us_per_batch"], 1)],
                      ], align="lr"), ""]
        elif bd:
            lines += [f"Breakdown failed: `{bd['error'][:200]}`", ""]
    return "\n".join(lines)


def main(argv=None):
    global torch
    args = build_parser().parse_args(argv)
    apply_quick(args)
    if min(args.repeats, args.warmup, args.ring, args.depth, args.min_batches) < 1:
        common.fail("--repeats, --warmup, --ring, --depth and --min-batches must be at least 1")
    if args.batches is not None and args.batches < 1:
        common.fail("--batches must be at least 1")
    torch = common.require_cuda(args.device)
    started = time.perf_counter()
    machine = common.machine_info(torch, args.device)
    common.log(f"overhead: {machine.get('gpu', {}).get('name')} | kinds {args.kinds} | "
               f"methods {args.methods}")
    torch.empty(1, device=args.device).add_(1)
    torch.cuda.synchronize()

    results = {}
    for kind in args.kinds:
        batches = args.batches or DEFAULT_BATCHES[kind]
        ring = make_ring(kind, args.ring)
        ring_t = [{k: torch.from_numpy(v) for k, v in b.items()} for b in ring]
        entry = {"batches": batches, "methods": {m: {"repeats": []} for m in args.methods}}
        for rep in range(args.repeats):
            for m in args.methods:
                rec, err = common.guarded(run_once, m, ring, ring_t, batches, args)
                rec = rec if err is None else err
                rec["repeat"] = rep
                entry["methods"][m]["repeats"].append(rec)
                common.log(f"  [{kind} r{rep}] {m:17s} "
                           + (f"{rec['us_per_batch']:9.1f} µs/batch  cpu "
                              f"{rec['cpu_us_per_batch']:9.1f} µs" if err is None
                              else rec["error"]))
        for m in args.methods:
            r = entry["methods"][m]
            ok = [x for x in r["repeats"] if "error" not in x]
            r["summary"] = common.summarize(x["us_per_batch"] for x in ok)
            r["cpu_summary"] = common.summarize(x["cpu_us_per_batch"] for x in ok)
            errors = sorted({x["error"] for x in r["repeats"] if "error" in x})
            if errors:
                r["errors"] = errors
        base = entry["methods"].get("pinloader_dlpack", {}).get("summary", {}).get("median")
        for m in args.methods:
            r = entry["methods"][m]
            r["vs_pinloader"] = common.ratio(r["summary"]["median"], base)
        for m, key in (("dl_pin_thread", "ratio_pin_thread_over_pinloader"),
                       ("dl_pin_inline", "ratio_pin_inline_over_pinloader")):
            if m in entry["methods"]:
                entry[key] = entry["methods"][m]["vs_pinloader"]
        if "pinloader_torch" in entry["methods"]:
            tu = entry["methods"]["pinloader_torch"]["summary"]["median"]
            entry["torch_us_per_batch"] = tu
            if "dl_pin_thread" in entry["methods"]:
                entry["ratio_pin_thread_over_torch"] = common.ratio(
                    entry["methods"]["dl_pin_thread"]["summary"]["median"], tu)
            bd, err = common.guarded(breakdown, kind, ring, args)
            entry["breakdown"] = bd if err is None else err
            if err is None:
                common.log(f"  [{kind}] breakdown: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in bd.items() if isinstance(v, float)))
        results[kind] = entry

    payload = {
        "benchmark": "overhead",
        "schema": 1,
        "machine": machine,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "kinds": {k: {"leaves": c, "leaf_bytes": b} for k, (c, b) in KINDS.items()
                  if k in args.kinds},
        "results": results,
        "elapsed_s": time.perf_counter() - started,
    }
    common.publish_timed(args.out, args.name, payload, render_markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
