#!/usr/bin/env python3
"""Host-to-device bandwidth against transfer size, staging threads and the host memcpy ceiling.

Methods (one copy of SIZE bytes per iteration, GB/s = 1e9 bytes per second):
  pageable_to         torch: pageable CPU tensor .to(device) (a blocking copy from pageable memory)
  pinned_copy         torch: pinned CPU tensor, device_tensor.copy_(pinned, non_blocking=True)
  raw_memcpy          cudaMemcpyAsync from cudaHostAlloc memory (through cupy.cuda.runtime, or
                      libcudart through ctypes when cupy is missing)
  pinloader_pinned    pinloader.AsyncPrefetcher over a source of numpy views of a PinnedBuffer
                      (copied without staging), consumed with torch.from_dlpack
  pinloader_pageable  pinloader.AsyncPrefetcher over a pageable numpy source (staged into
                      pinned slabs), consumed with torch.from_dlpack

The torch and raw methods are timed with CUDA events around N back-to-back copies on one
stream after warm-up copies. pinloader's copies run on its own stream, so the consumer records
an event on its stream after torch.from_dlpack of each batch (which makes that stream wait for
the batch's copy); the rate is taken between the events of the last warm-up batch and the last
batch, which leaves out the pipeline's start (slab allocation included).

Also measured in the same run: pinloader pageable-source GB/s against staging_threads, with
pinloader's own staging rate (bytes / staging_s_total from stats()), and the host memcpy
ceiling (numpy copies of a pageable source into pinned memory in 1, 2, 4, 8 threads).

--staging-sweep measures only staging (no CUDA needed: the host backend stands in): 256 MiB
pageable batches through pinloader with a warm PinnedPool against torch's copy_ into a pinned
tensor (a plain tensor without CUDA, said in the output) and threaded numpy copies, for thread
counts 1..N, plus pinloader's default thread count against torch's default (all-thread) copy_.

Ratios reported: pinloader pinned source / raw cudaMemcpyAsync (target >= 0.95) and pinloader
pageable source / best host memcpy (target >= 0.85).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402
from _staging_sweep import host_memcpy_gbps, staging_sweep  # noqa: E402

torch = None  # imported by main() once the arguments are parsed

METHODS = ("pageable_to", "pinned_copy", "raw_memcpy", "pinloader_pinned", "pinloader_pageable")
METHOD_LABELS = {
    "pageable_to": "pageable `.to()`",
    "pinned_copy": "torch pinned `copy_(non_blocking)`",
    "raw_memcpy": "raw `cudaMemcpyAsync` (cudaHostAlloc)",
    "pinloader_pinned": "pinloader, PinnedBuffer source",
    "pinloader_pageable": "pinloader, pageable source",
}
DEFAULT_SIZES = "64K,256K,1M,4M,16M,64M,256M,1G"
IMPLAUSIBLE = 1.15  # a pinloader figure above this times the best torch/raw pinned copy
EVENTS_AHEAD = 1.15  # event rate over this times the wall-clock rate (allowing for the
                     # copies in flight): the consumer stream's events did not wait
PINNED_TARGET = 0.95
PAGEABLE_TARGET = 0.85
CUDA_MEMCPY_HOST_TO_DEVICE = 1


# --------------------------------------------------------------------------- raw CUDA runtime

def _cudart_candidates():
    names = []
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    roots = list(sys.path)
    if torch is not None:
        roots.append(os.path.join(os.path.dirname(torch.__file__), "lib"))
    for root in roots:
        if not root or not os.path.isdir(root):
            continue
        names += sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcudart.so*"),
                                  recursive=True), reverse=True)
        names += sorted(glob.glob(os.path.join(root, "libcudart*.so*")), reverse=True)
    names += ["libcudart.so", "libcudart.so.13", "libcudart.so.12",
              "/usr/local/cuda/lib64/libcudart.so"]
    seen = set()
    return [n for n in names if not (n in seen or seen.add(n))]


class RawCuda:
    """cudaHostAlloc / cudaMemcpyAsync / cudaFreeHost, from cupy or from libcudart via ctypes.

    Both share the device's primary context with torch, so torch device pointers, streams and
    events can be used together with these calls."""

    def __init__(self, device_index):
        self.via = None
        errors = []
        try:
            import cupy
            cupy.cuda.Device(device_index).use()
            rt = cupy.cuda.runtime
            self._alloc = lambda n: rt.hostAlloc(n, 0)
            self._free = rt.freeHost
            self._copy = lambda dst, src, n, stream: rt.memcpyAsync(
                dst, src, n, CUDA_MEMCPY_HOST_TO_DEVICE, stream)
            self.via = f"cupy {cupy.__version__} (cupy.cuda.runtime)"
            return
        except Exception as exc:
            errors.append(f"cupy: {type(exc).__name__}: {exc}")
        for name in _cudart_candidates():
            try:
                lib = ctypes.CDLL(name)
            except OSError as exc:
                errors.append(f"{name}: {exc}")
                continue
            lib.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                          ctypes.c_uint]
            lib.cudaFreeHost.argtypes = [ctypes.c_void_p]
            lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                            ctypes.c_int, ctypes.c_void_p]
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            lib.cudaSetDevice.argtypes = [ctypes.c_int]

            def check(rc, what, lib=lib):
                if rc != 0:
                    raise RuntimeError(f"{what} failed: {lib.cudaGetErrorString(rc).decode()}")

            check(lib.cudaSetDevice(device_index), "cudaSetDevice")

            def alloc(n, lib=lib, check=check):
                ptr = ctypes.c_void_p()
                check(lib.cudaHostAlloc(ctypes.byref(ptr), n, 0), "cudaHostAlloc")
                return ptr.value

            self._alloc = alloc
            self._free = lambda p, lib=lib, check=check: check(lib.cudaFreeHost(p), "cudaFreeHost")
            self._copy = lambda dst, src, n, stream, lib=lib, check=check: check(
                lib.cudaMemcpyAsync(dst, src, n, CUDA_MEMCPY_HOST_TO_DEVICE, stream),
                "cudaMemcpyAsync")
            self.via = f"ctypes {name}"
            return
        raise RuntimeError("no CUDA runtime for raw copies: " + "; ".join(errors[-4:]))

    def host_alloc(self, nbytes):
        return self._alloc(nbytes)

    def free_host(self, ptr):
        self._free(ptr)

    def memcpy_h2d_async(self, dst, src, nbytes, stream):
        self._copy(dst, src, nbytes, stream)


# --------------------------------------------------------------------------- measurements

def gbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else math.nan


def time_back_to_back(issue, iters, warmup):
    """ms for ``iters`` calls of ``issue`` on the current stream (CUDA events)."""
    for _ in range(warmup):
        issue()
    with common.CudaTimer(torch) as timer:
        for _ in range(iters):
            issue()
    return timer.elapsed_ms()


def time_pinloader(pinloader, leaf, iters, warmup, device, depth, staging_threads=None, pool=None):
    """ms for ``iters`` batches of one leaf through an AsyncPrefetcher, after ``warmup``.

    Returns (event ms, host wall ms over the same batches, stats(), event times in ms after the
    first batch's event for the first 64 batches). The wall time, from taking the last warm-up
    batch to the last copy's completion, cross-checks the event figure: it can only be longer."""
    total = warmup + iters

    def batches():
        for _ in range(total):
            yield (leaf,)

    kwargs = {"device": device, "depth": depth}
    if staging_threads is not None:
        kwargs["staging_threads"] = staging_threads
    if pool is not None:
        kwargs["pool"] = pool
    events = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    pf = pinloader.AsyncPrefetcher(batches(), **kwargs)
    count = 0
    t0 = None
    try:
        for batch in pf:
            tensor = torch.from_dlpack(batch[0])
            events[count].record()
            del tensor, batch
            count += 1
            if count == warmup:
                t0 = time.perf_counter()
        stats = pf.stats()
    finally:
        pf.close()
    if count != total:
        raise RuntimeError(f"the prefetcher yielded {count} batches, expected {total}")
    common.wait_event(events[-1])
    wall_ms = 1e3 * (time.perf_counter() - t0)
    marks = [round(events[0].elapsed_time(e), 4) for e in events[:64]]
    return events[warmup - 1].elapsed_time(events[-1]), wall_ms, stats, marks


def release_buffer(buffers, key):
    """Drop the numpy view kept in ``buffers[key]``, then give its PinnedBuffer back to the pool
    (release() is refused while a view of the buffer is alive)."""
    buf, view = buffers.pop(key)
    del view
    try:
        buf.release()
    except Exception as exc:
        common.log(f"PinnedBuffer.release() failed: {type(exc).__name__}: {exc}")


def iterations_for(size, args):
    return max(args.min_iters, min(args.max_iters, math.ceil(args.bytes_per_point / size)))


class Buffers:
    """Source and destination memory, allocated once at the largest size needed."""

    def __init__(self, args, max_size, raw):
        self.max_size = max_size
        self.pageable = np.empty(max_size, dtype=np.uint8)
        self.pageable.view(np.uint64)[:] = 0x0123456789ABCDEF
        self.pinned = torch.empty(max_size, dtype=torch.uint8, pin_memory=True)
        self.pinned.fill_(7)
        self.device = torch.empty(max_size, dtype=torch.uint8, device=args.device)
        self.raw = raw
        self.raw_ptr = None
        if raw is not None:
            self.raw_ptr = raw.host_alloc(max_size)
            ctypes.memset(self.raw_ptr, 7, max_size)

    def close(self):
        if self.raw_ptr is not None:
            self.raw.free_host(self.raw_ptr)
            self.raw_ptr = None


def measure_method(method, size, args, ctx):
    """One repeat of one method at one size: {'gbps', 'ms', 'iters', ...} or an error record."""
    bufs = ctx["buffers"]
    iters = iterations_for(size, args)
    warm = max(2, min(8, iters // 4))
    stream = ctx["stream"]
    rec = {"iters": iters}
    with torch.cuda.stream(stream):
        if method == "pageable_to":
            src = torch.from_numpy(bufs.pageable[:size])
            ms = time_back_to_back(lambda: src.to(args.device), iters, warm)
        elif method == "pinned_copy":
            src, dst = bufs.pinned[:size], bufs.device[:size]
            ms = time_back_to_back(lambda: dst.copy_(src, non_blocking=True), iters, warm)
        elif method == "raw_memcpy":
            if ctx["raw"] is None:
                raise RuntimeError(ctx["raw_error"])
            raw, dst_ptr, src_ptr = ctx["raw"], bufs.device.data_ptr(), bufs.raw_ptr
            handle = stream.cuda_stream
            ms = time_back_to_back(lambda: raw.memcpy_h2d_async(dst_ptr, src_ptr, size, handle),
                                   iters, warm)
        elif method in ("pinloader_pinned", "pinloader_pageable"):
            pinloader = common.require_pinloader_cuda()
            warm = args.depth + 2
            if method == "pinloader_pinned":
                leaf = ctx["pinned_leaf"](size)
            else:
                leaf = bufs.pageable[:size]
            ms, wall_ms, stats, marks = time_pinloader(
                pinloader, leaf, iters, warm, args.device, args.depth,
                ctx.get("staging_threads"), ctx.get("pool"))
            rec.update(pinloader_stats=stats, event_ms=marks, wall_ms=wall_ms,
                       gbps_wall=gbps(iters * size, wall_ms))
        else:
            raise ValueError(f"unknown method {method!r}")
    rec.update(ms=ms, gbps=gbps(iters * size, ms), warmup=warm)
    # The wall-clock span also covers the copies the pipeline had in flight when timing began
    # (at most depth + 1), so only a larger excess means the events did not wait.
    slack = EVENTS_AHEAD * (iters + args.depth + 1) / iters
    if "gbps_wall" in rec and rec["gbps"] > slack * rec["gbps_wall"]:
        rec.update(gbps_events=rec["gbps"], gbps=rec["gbps_wall"], events_ran_ahead=True)
    return rec


# --------------------------------------------------------------------------- driver

def build_parser():
    p = argparse.ArgumentParser(
        description="Host-to-device GB/s against size, staging threads and host memcpy.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--sizes", type=common.csv_list(common.parse_size),
                   default=common.csv_list(common.parse_size)(DEFAULT_SIZES),
                   help=f"transfer sizes (default: {DEFAULT_SIZES})")
    p.add_argument("--methods", type=common.choice_list(METHODS), default=list(METHODS),
                   help="comma-separated methods (default: all): " + ", ".join(METHODS))
    p.add_argument("--repeats", type=int, default=3, help="repeats of every point (default: 3)")
    p.add_argument("--bytes-per-point", type=common.parse_size, default=common.parse_size("2G"),
                   help="bytes copied per timed point, spread over iterations (default: 2G)")
    p.add_argument("--min-iters", type=int, default=8, help="fewest timed copies per point")
    p.add_argument("--max-iters", type=int, default=2000, help="most timed copies per point")
    p.add_argument("--depth", type=int, default=2, help="pinloader prefetch depth (default: 2)")
    p.add_argument("--staging-threads", type=common.csv_list(int), default=[1, 2, 4, 8],
                   help="staging_threads values for the staging sweep (default: 1,2,4,8)")
    p.add_argument("--staging-bytes", type=common.parse_size, default=common.parse_size("256M"),
                   help="batch size of the staging sweep (default: 256M)")
    p.add_argument("--memcpy-threads", type=common.csv_list(int), default=[1, 2, 4, 8],
                   help="thread counts for the host memcpy ceiling (default: 1,2,4,8)")
    p.add_argument("--memcpy-bytes", type=common.parse_size, default=common.parse_size("256M"),
                   help="bytes per host memcpy (default: 256M)")
    p.add_argument("--memcpy-iters", type=int, default=6, help="timed memcpys per point")
    p.add_argument("--ratio-bytes", type=common.parse_size, default=common.parse_size("256M"),
                   help="size at which the headline ratios are taken (default: 256M)")
    p.add_argument("--shared-pool", action="store_true",
                   help="give every pageable-source prefetcher one PinnedPool (pool=) instead "
                        "of its private pool, so slabs are pinned once for the whole run")
    p.add_argument("--staging-sweep", action="store_true",
                   help="only the staging sweep: --staging-bytes pageable batches through "
                        "pinloader with a warm pool against torch's copy_ into a pinned tensor "
                        "and threaded numpy copies, for --sweep-threads (default 1, 2, 4, ... "
                        "up to the usable CPUs); runs on the host backend without CUDA")
    p.add_argument("--sweep-threads", type=common.csv_list(int), default=None,
                   help="thread counts of --staging-sweep")
    p.add_argument("--sweep-batches", type=int, default=12,
                   help="batches per --staging-sweep point (default: 12)")
    p.add_argument("--ranks", type=int, default=1,
                   help="with --staging-sweep: also run N processes staging at once with "
                        "LOCAL_WORLD_SIZE=N (rank r on cuda:r), each with the default thread "
                        "count, and report their aggregate GB/s against torch's all-thread copy_")
    p.add_argument("--rank-batches", type=int, default=40,
                   help="batches each rank stages in the --ranks run (default: 40)")
    p.add_argument("--rank-start-s", type=float, default=20.0,
                   help="seconds the --ranks processes get to start and warm up (default: 20)")
    p.add_argument("--rank-worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true",
                   help="a small run (well under a minute): sizes up to 64M, 1 repeat")
    common.add_output_args(p, "bandwidth")
    return p


def apply_quick(args):
    if not args.quick:
        return
    args.sizes = [s for s in args.sizes if s <= 64 * common.MiB] or [min(args.sizes)]
    args.repeats = 1
    args.bytes_per_point = min(args.bytes_per_point, 256 * common.MiB)
    args.max_iters = min(args.max_iters, 400)
    args.staging_bytes = min(args.staging_bytes, 64 * common.MiB)
    args.memcpy_bytes = min(args.memcpy_bytes, 64 * common.MiB)
    args.memcpy_iters = min(args.memcpy_iters, 4)
    args.ratio_bytes = min(args.ratio_bytes, 64 * common.MiB)


def median_of(records, key="gbps"):
    return common.summarize(r.get(key) for r in records if "error" not in r)


def nearest_size(sizes, target):
    return min(sizes, key=lambda s: (abs(math.log2(s) - math.log2(target)), -s))


def render_markdown(payload):
    cfg = payload["config"]
    lines = ["# Host-to-device bandwidth (`bench_bandwidth.py`)", ""]
    lines += common.machine_summary_lines(payload["machine"])
    lines += ["", f"Raw copies via {payload.get('raw_via') or payload.get('raw_error')}. "
              f"pinloader depth {cfg['depth']}. GB/s = 1e9 B/s; cells: median over "
              f"{cfg['repeats']} repeat(s) (min–max).", "", "## GB/s against size", ""]
    methods = cfg["methods"]
    rows = []
    for point in payload["sizes"]:
        row = [common.format_size(point["bytes"])]
        for m in methods:
            res = point["methods"][m]
            cell = (common.fmt_summary(res["summary"], 1) if res["summary"]["n"]
                    else "error" if res.get("errors") else "–")
            row.append(cell + (" †" if res.get("events_ran_ahead") else "")
                       + (" ‼" if res.get("implausible") else ""))
        r = point.get("pinned_over_raw")
        row.append(common.fmt_num(r, 3) if r is not None else "–")
        rows.append(row)
    lines.append(common.md_table(["size"] + [METHOD_LABELS[m] for m in methods]
                                 + ["pinloader pinned / raw"], rows))
    if any(m.get("events_ran_ahead") for p in payload["sizes"] for m in p["methods"].values()):
        lines += ["", "† in some repeats the consumer stream's events fired sooner than the "
                  "copies can have finished (event rate well over the wall-clock rate), so the "
                  "host wall-clock rate is shown. The events are recorded right "
                  "after `torch.from_dlpack`, which should make the stream wait for the copy: "
                  "check the stream handoff of `__dlpack__(stream=...)`. Raw event times: "
                  "`event_ms` in the JSON."]
    if any(m.get("implausible") for p in payload["sizes"] for m in p["methods"].values()):
        lines += ["", f"‼ more than {IMPLAUSIBLE}× the best torch or raw pinned copy at that "
                  "size, faster than the link: do not use that figure (see `event_ms` and "
                  "`gbps_wall` in the JSON)."]
    errs = sorted({e for p in payload["sizes"] for m in p["methods"].values()
                   for e in m.get("errors", [])})
    if errs:
        lines += ["", "Errors:"] + [f"- `{e[:300]}`" for e in errs]

    lines += ["", f"## Staging ({common.format_size(cfg['staging_bytes'])} pageable batches) "
              f"and the host memcpy ceiling ({common.format_size(cfg['memcpy_bytes'])})", ""]
    threads = sorted(set(cfg["staging_threads"]) | set(cfg["memcpy_threads"]))
    srows = []
    for t in threads:
        st = payload["staging"].get(str(t))
        mc = payload["memcpy"].get(str(t))
        srows.append([t,
                      common.fmt_summary(st["summary"], 1) if st else "",
                      common.fmt_summary(st["staging_summary"], 1) if st else "",
                      common.fmt_summary(mc["summary"], 1) if mc else ""])
    lines.append(common.md_table(["threads", "pinloader pageable → device GB/s",
                                  "pinloader staging GB/s (stats)", "host memcpy GB/s"], srows))
    rt = payload["ratios"]
    lines += ["", "## Ratios", ""]
    lines.append(common.md_table(["ratio", "value", "target"], [
        [f"pinloader pinned source / raw cudaMemcpyAsync at "
         f"{common.format_size(rt['pinned_at_bytes'])}" if rt.get("pinned_at_bytes") else
         "pinloader pinned source / raw cudaMemcpyAsync",
         common.fmt_num(rt.get("pinned_over_raw"), 3), f"≥ {PINNED_TARGET}"],
        [f"pinloader pageable source at {common.format_size(rt['pageable_at_bytes'])} / best host "
         f"memcpy ({rt.get('best_memcpy_threads')} threads)" if rt.get("pageable_at_bytes") else
         "pinloader pageable source / best host memcpy",
         common.fmt_num(rt.get("pageable_over_memcpy"), 3), f"≥ {PAGEABLE_TARGET}"],
        ["best staging sweep point / best host memcpy",
         common.fmt_num(rt.get("best_staging_over_memcpy"), 3), "(for reference)"],
    ], align="lrr"))
    lines.append("")
    return "\n".join(lines)


def main(argv=None):
    global torch
    args = build_parser().parse_args(argv)
    apply_quick(args)
    if args.staging_sweep:
        return staging_sweep(args, os.path.abspath(__file__))
    if args.repeats < 1 or args.depth < 1 or args.min_iters < 1 or args.max_iters < args.min_iters:
        common.fail("--repeats, --depth and --min-iters must be at least 1, "
                    "and --max-iters at least --min-iters")
    if min(args.staging_threads + args.memcpy_threads) < 1:
        common.fail("thread counts must be at least 1")
    args.sizes = sorted(set(args.sizes))
    torch = common.require_cuda(args.device)
    started = time.perf_counter()
    machine = common.machine_info(torch, args.device)
    dev_index = torch.device(args.device).index or 0
    common.log(f"bandwidth: {machine.get('gpu', {}).get('name')} | sizes "
               f"{[common.format_size(s) for s in args.sizes]} | methods {args.methods}")

    raw = raw_error = None
    if "raw_memcpy" in args.methods:
        try:
            raw = RawCuda(dev_index)
        except Exception as exc:
            raw_error = f"{type(exc).__name__}: {exc}"
            common.log(f"raw cudaMemcpyAsync unavailable: {raw_error}")

    max_size = max(args.sizes + [args.staging_bytes, args.memcpy_bytes])
    bufs = Buffers(args, max_size, raw)
    stream = torch.cuda.Stream(device=args.device)

    pl_module, pl_error = common.import_pinloader()
    src_pool = None
    pinned_buffers = {}
    staging_pool = None

    def pinned_leaf(size):
        nonlocal src_pool
        if size not in pinned_buffers:
            module = common.require_pinloader_cuda()
            if src_pool is None:
                src_pool = module.PinnedPool(
                    max_bytes=2 * sum(args.sizes) + 256 * common.MiB)
            buf = src_pool.alloc(size)
            view = np.frombuffer(buf, dtype=np.uint8, count=size)
            view[:] = 7
            pinned_buffers[size] = (buf, view)
        return pinned_buffers[size][1]

    if args.shared_pool and pl_module is not None:
        try:
            staging_pool = pl_module.PinnedPool(
                max_bytes=(args.depth + 3) * max(args.sizes + [args.staging_bytes]))
        except Exception as exc:
            common.log(f"shared PinnedPool failed, using private pools: {exc}")

    ctx = {"buffers": bufs, "stream": stream, "raw": raw, "raw_error": raw_error,
           "pinned_leaf": pinned_leaf, "pool": staging_pool}

    sizes_out = []
    staging = {}
    memcpy = {}
    try:
        for size in args.sizes:
            point = {"bytes": size, "iters": iterations_for(size, args),
                     "methods": {m: {"repeats": []} for m in args.methods}}
            for rep in range(args.repeats):
                for m in args.methods:
                    rec, err = common.guarded(measure_method, m, size, args, ctx)
                    rec = rec if err is None else err
                    rec["repeat"] = rep
                    point["methods"][m]["repeats"].append(rec)
                    torch.cuda.synchronize()
            for m in args.methods:
                res = point["methods"][m]
                res["summary"] = median_of(res["repeats"])
                errors = sorted({r["error"] for r in res["repeats"] if "error" in r})
                if errors:
                    res["errors"] = errors
            link = [point["methods"][m]["summary"]["median"] for m in ("raw_memcpy", "pinned_copy")
                    if m in args.methods and point["methods"][m]["summary"]["n"]]
            for m in ("pinloader_pinned", "pinloader_pageable"):
                res = point["methods"].get(m)
                if res is None:
                    continue
                med = res["summary"]["median"]
                if link and med is not None and med > IMPLAUSIBLE * max(link):
                    res["implausible"] = True
                if any(r.get("events_ran_ahead") for r in res["repeats"]):
                    res["events_ran_ahead"] = True
            if "pinloader_pinned" in args.methods and "raw_memcpy" in args.methods:
                point["pinned_over_raw"] = common.ratio(
                    point["methods"]["pinloader_pinned"]["summary"]["median"],
                    point["methods"]["raw_memcpy"]["summary"]["median"])
            common.log(f"  {common.format_size(size):>9s}: " + "  ".join(
                f"{m} {common.fmt_num(point['methods'][m]['summary']['median'], 1)}"
                for m in args.methods))
            sizes_out.append(point)
            if size in pinned_buffers:
                release_buffer(pinned_buffers, size)

        for t in args.staging_threads:
            entry = {"threads": t, "repeats": []}
            for rep in range(args.repeats):
                local = dict(ctx, staging_threads=t)
                rec, err = common.guarded(measure_method, "pinloader_pageable",
                                          args.staging_bytes, args, local)
                rec = rec if err is None else err
                if err is None:
                    st = rec.get("pinloader_stats") or {}
                    secs = st.get("staging_s_total")
                    rec["staging_gbps"] = (st.get("bytes", 0) / secs / 1e9) if secs else None
                rec["repeat"] = rep
                entry["repeats"].append(rec)
            entry["summary"] = median_of(entry["repeats"])
            entry["staging_summary"] = median_of(entry["repeats"], "staging_gbps")
            errors = sorted({r["error"] for r in entry["repeats"] if "error" in r})
            if errors:
                entry["errors"] = errors
            staging[str(t)] = entry
            common.log(f"  staging_threads={t}: "
                       f"{common.fmt_num(entry['summary']['median'], 1)} GB/s end to end, "
                       f"{common.fmt_num(entry['staging_summary']['median'], 1)} GB/s staging"
                       + (f"  ({errors[0]})" if errors else ""))

        src = bufs.pageable[:args.memcpy_bytes]
        dst = bufs.pinned[:args.memcpy_bytes].numpy()
        for t in args.memcpy_threads:
            entry = {"threads": t, "repeats": []}
            for rep in range(args.repeats):
                med, rates = host_memcpy_gbps(dst, src, t, args.memcpy_iters)
                entry["repeats"].append({"repeat": rep, "gbps": med, "iter_gbps": rates})
            entry["summary"] = median_of(entry["repeats"])
            memcpy[str(t)] = entry
            common.log(f"  host memcpy {t} thread(s): {entry['summary']['median']:.1f} GB/s")
    finally:
        for size in list(pinned_buffers):
            release_buffer(pinned_buffers, size)
        bufs.close()

    ratios = {}
    by_size = {p["bytes"]: p for p in sizes_out}
    if by_size:
        at = nearest_size(list(by_size), args.ratio_bytes)
        p = by_size[at]
        if p.get("pinned_over_raw") is not None:
            ratios.update(pinned_over_raw=p["pinned_over_raw"], pinned_at_bytes=at)
        ratios["pinned_over_raw_by_size"] = {str(s): by_size[s].get("pinned_over_raw")
                                             for s in by_size}
        if "pinloader_pageable" in p["methods"]:
            pageable = p["methods"]["pinloader_pageable"]["summary"]["median"]
            best_t, best = None, None
            for t, e in memcpy.items():
                v = e["summary"]["median"]
                if v is not None and (best is None or v > best):
                    best_t, best = int(t), v
            ratios.update(pageable_at_bytes=at, best_memcpy_gbps=best, best_memcpy_threads=best_t,
                          pageable_over_memcpy=common.ratio(pageable, best))
            staged = [e["summary"]["median"] for e in staging.values()
                      if e["summary"]["median"] is not None]
            ratios["best_staging_over_memcpy"] = common.ratio(max(staged) if staged else None,
                                                              best)

    payload = {
        "benchmark": "bandwidth",
        "schema": 1,
        "machine": machine,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "raw_via": raw.via if raw is not None else None,
        "raw_error": raw_error,
        "pinloader_import_error": pl_error,
        "sizes": sizes_out,
        "staging": staging,
        "memcpy": memcpy,
        "ratios": ratios,
        "elapsed_s": time.perf_counter() - started,
    }
    common.publish_timed(args.out, args.name, payload, render_markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
