#!/usr/bin/env python3
"""The gather kernel alone (src/core/gather_kernel.cu compiled by CuPy's NVRTC), over a source
registered with cudaHostRegister, against one DMA of the same bytes: a sweep of UNROLL and of
the grid (blocks per multiprocessor), to choose the launch that backend_cuda.c uses. Rows of
--rows bytes, --batch-bytes per batch, random rows sorted as pinloader sorts them; GB/s of
delivered bytes over --launches launches, median of --repeats. --order random also times the
rows in batch order (unsorted), which says what the producer's sort buys."""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_output_args(ap, "gather_kernel")
    ap.add_argument("--rows", type=C.csv_list(int), default=[512, 4096, 150528])
    ap.add_argument("--unroll", type=C.csv_list(int), default=[4, 8])
    ap.add_argument("--blocks-per-sm", type=C.csv_list(int), default=[4, 8, 16, 32])
    ap.add_argument("--blocks", type=C.csv_list(int), default=[],
                    help="grids of at most this many blocks, in place of --blocks-per-sm (the "
                         "launch's cap: pinloader._C._testing.gather_grid)")
    ap.add_argument("--batch-bytes", type=C.parse_size, default=C.parse_size("8M"))
    ap.add_argument("--source-bytes", type=C.parse_size, default=C.parse_size("1G"))
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--order", type=C.choice_list(["sorted", "random"]), default=["sorted"],
                    help="the table's order: sorted by source row (as pinloader sorts it), or "
                         "the batch's random order")
    args = ap.parse_args()
    C.require_cuda(args.device)
    import cupy as cp

    code = (ROOT / "src" / "core" / "gather_kernel.cu").read_text()
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = {"machine": C.machine_info(None, args.device), "args": vars(args), "runs": []}
    lines = []
    for row in args.rows:
        n = max(1, args.source_bytes // row)
        src = np.full((n, row), 7, np.uint8)
        cp.cuda.runtime.hostRegister(src.ctypes.data, src.nbytes, 3)  # portable | mapped
        dev_src = src.ctypes.data  # unified addressing: the device reads registered memory at its host address
        bs = max(1, args.batch_bytes // row)
        rows = np.random.default_rng(0).integers(0, n, bs)
        tables = {"random": cp.asarray(np.stack([rows, np.arange(bs)], 1).astype(np.int64))}
        srt = np.argsort(rows, kind="stable")
        tables["sorted"] = cp.asarray(np.stack([rows[srt], srt], 1).astype(np.int64))
        dst = cp.empty(bs * row, cp.uint8)
        host = cp.cuda.alloc_pinned_memory(bs * row)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        best_dma = []
        for _ in range(args.repeats):
            start.record()
            for _ in range(args.launches):
                cp.cuda.runtime.memcpyAsync(dst.data.ptr, host.ptr, bs * row, 1, 0)
            stop.record()
            stop.synchronize()
            best_dma.append(args.launches * bs * row / cp.cuda.get_elapsed_time(start, stop) / 1e6)
        dma = statistics.median(best_dma)
        unit = 16 if row % 16 == 0 else 8 if row % 8 == 0 else 4 if row % 4 == 0 else 1
        for order, unroll in ((o, u) for o in args.order for u in args.unroll):
            table = tables[order]
            mod = cp.RawModule(code=code, options=("-std=c++17", f"-DUNROLL={unroll}"))
            k = mod.get_function(f"pl_gather_{unit}")
            units = row // unit
            total = units * bs
            grids = ([("blocks", b, b) for b in args.blocks] if args.blocks else
                     [("blocks_per_sm", bps, sms * bps) for bps in args.blocks_per_sm])
            for key, bps, cap in grids:
                blocks = min((total + 255) // 256, cap)
                gbps = []
                for _ in range(args.repeats):
                    start.record()
                    for _ in range(args.launches):
                        k((blocks,), (256,), (dst, table, np.uint64(dev_src), np.uint64(0), np.int64(row),
                                              np.uint64(units), np.uint64(total)))
                    stop.record()
                    stop.synchronize()
                    gbps.append(args.launches * bs * row / cp.cuda.get_elapsed_time(start, stop) / 1e6)
                g = statistics.median(gbps)
                out["runs"].append({"row": row, "order": order, "unroll": unroll, key: bps,
                                    "gbps": g, "dma_gbps": dma, "runs_gbps": gbps})
                what = f"blocks {bps:5d}" if key == "blocks" else f"blocks/SM {bps:3d}"
                line = (f"row {row:7d} B  {order:6s}  unroll {unroll:2d}  {what}: {g:6.2f} GB/s "
                        f"= {g / dma:.2f}x DMA ({dma:.1f})")
                C.log(line)
                lines.append(line)
        want = src[rows[:4]]
        got = cp.asnumpy(dst[:4 * row]).reshape(4, row)
        assert (got == want).all(), "the kernel delivered wrong bytes"
        cp.cuda.runtime.hostUnregister(src.ctypes.data)
    text = "\n".join(C.machine_summary_lines(out["machine"]) + [""] + lines)
    C.publish(args.out, args.name, out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
