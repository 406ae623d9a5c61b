#!/usr/bin/env python3
"""Does an ArrayLoader's device memory stay flat in a loop that never synchronises the device?

A training loop synchronises streams and events, not the whole device. This runs such a loop,
loader-bound: ArrayLoader(gather=...) over an in-RAM array of --row-bytes rows (256 per batch),
every batch turned into a torch tensor and dropped, in --windows windows of --batches batches.
Each window ends with a blocking-sync torch.cuda.Event (the thread sleeps; the device is not
synchronised), except the last --device-syncs windows, which end with torch.cuda.synchronize().
Per window it reports the growth of pinloader's device pool (the bytes it holds from the driver:
cudaMemPoolAttrReservedMemCurrent), of the device memory in use (torch.cuda.mem_get_info), and
the CPU per batch of the producer thread and of the training thread. The claim it checks
(Note [deferred frees] in src/core/block.c): after the first window the pool does not grow, with
or without a device-wide synchronisation. Needs CUDA.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import _common as C
from bench_gather import cpu_by_thread_name, thread_cpu_ns


def run(torch, pinloader, args, gather: str) -> list[dict]:
    from pinloader import _C
    dev = torch.device(args.device)
    index = dev.index or 0
    src = np.full((max(256, args.source_bytes // args.row_bytes), args.row_bytes), 7, np.uint8)
    L = pinloader.ArrayLoader(src, 256, device=args.device, seed=1, gather=gather)
    it = iter(L)

    def take() -> None:
        nonlocal it
        while True:
            try:
                torch.from_dlpack(next(it))
                return
            except StopIteration:
                it = iter(L)

    done = torch.cuda.Event(blocking=True)
    free0, pool0 = torch.cuda.mem_get_info(dev)[0], _C._testing.device_pool_reserved(index)
    windows = []
    for w in range(args.windows):
        sync = w >= args.windows - args.device_syncs
        th0 = thread_cpu_ns()
        t0 = time.perf_counter()
        for _ in range(args.batches):
            take()
        if sync:
            torch.cuda.synchronize(dev)
        else:
            done.record()
            done.synchronize()
        dt = time.perf_counter() - t0
        cpu = cpu_by_thread_name(th0, thread_cpu_ns(), args.batches)
        rec = {"window": w, "end": "device synchronize" if sync else "event",
               "pool_mib": (_C._testing.device_pool_reserved(index) - pool0) / 2**20,
               "in_use_mib": (free0 - torch.cuda.mem_get_info(dev)[0]) / 2**20,
               "gbps": args.batches * 256 * args.row_bytes / dt / 1e9,
               "producer_cpu_ms": cpu.get("pl-producer", 0.0), "main_cpu_ms": cpu.get("main", 0.0)}
        windows.append(rec)
        C.log(f"  {gather:6s} window {w:2d} ({rec['end']:18s}): pool +{rec['pool_mib']:8.0f} MiB, "
              f"in use +{rec['in_use_mib']:8.0f} MiB, {rec['gbps']:6.2f} GB/s, CPU ms/batch: "
              f"producer {rec['producer_cpu_ms']:.3f}, main {rec['main_cpu_ms']:.3f}")
    L.close()
    return windows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_output_args(ap, "device_memory")
    ap.add_argument("--row-bytes", type=int, default=150528, help="bytes per row (256 rows per batch)")
    ap.add_argument("--source-bytes", type=C.parse_size, default=C.parse_size("2G"))
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--batches", type=int, default=200, help="batches per window")
    ap.add_argument("--device-syncs", type=int, default=2,
                    help="how many of the last windows end with torch.cuda.synchronize()")
    ap.add_argument("--gathers", type=C.choice_list(["device", "host"]), default=["device", "host"])
    args = ap.parse_args()
    torch = C.require_cuda(args.device)
    pinloader = C.require_pinloader_cuda()
    results: dict = {"benchmark": "device_memory", "machine": C.machine_info(torch, args.device),
                     "args": vars(args), "runs": {}}
    for g in args.gathers:
        results["runs"][g] = run(torch, pinloader, args, g)
    lines = C.machine_summary_lines(results["machine"]) + [""]
    lines.append(f"{args.windows} windows of {args.batches} loader-bound batches of 256 x "
                 f"{args.row_bytes} B ({C.format_size(256 * args.row_bytes)} per batch); growth "
                 "since the loader's start at each window's end.")
    lines.append("")
    rows = []
    for g, ws in results["runs"].items():
        for r in ws:
            rows.append([g, r["window"], r["end"], f"{r['pool_mib']:.0f}", f"{r['in_use_mib']:.0f}",
                         f"{r['gbps']:.2f}", f"{r['producer_cpu_ms']:.3f}", f"{r['main_cpu_ms']:.3f}"])
    lines.append(C.md_table(["gather", "window", "ends with", "pool growth MiB", "in use growth MiB",
                             "GB/s", "producer CPU ms/batch", "main CPU ms/batch"], rows))
    text = "\n".join(lines)
    C.publish(args.out, args.name, results, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
