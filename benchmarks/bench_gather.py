#!/usr/bin/env python3
"""Random rows of an in-RAM array to the GPU, loader-bound (no compute), every path in one run.

For each row size (--rows: 64 B, 512 B, 4 KiB, 150,528 B = uint8 3x224x224 by default) a
source of about --source-bytes is made once, and these rows are timed over --rounds rounds,
interleaved (each round runs every row once, in order):
  host_gather     ArrayLoader(gather="host"), default settings: the staging threads gather the
                  rows into pinned memory, one DMA per chunk
  device_gather   ArrayLoader(gather="device"): a kernel on the copy stream reads the rows
                  straight from the registered source
  auto            ArrayLoader() as a user gets it: what gather="auto" picks for the row size
  torch_index     torch's best user-level alternative: torch.index_select(src, 0, idx,
                  out=pinned) with all threads, then .to(device, non_blocking=True), two
                  pinned buffers in turn
  dma_ceiling     the physical reference: one cudaMemcpyAsync of the batch's bytes from
                  resident pinned memory per batch (no gather at all)
Each figure is delivered bytes per second over --batches batches after a warm-up epoch,
torch.cuda.synchronize() included; host CPU per batch is the process's CPU time (all threads)
divided by the batches. The table reports the median over the rounds with the range, and each
path's ratio to the DMA ceiling measured in the same round.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ROW_SIZES = [64, 512, 4096, 150_528]
PATHS = ["host_gather", "device_gather", "auto", "torch_index", "dma_ceiling"]


def _anon_huge() -> str:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def batch_rows(row_bytes: int, target: int) -> int:
    return max(1, target // row_bytes)


def make_source(row_bytes: int, source_bytes: int, hugepages: bool = False) -> np.ndarray:
    n = max(1, source_bytes // row_bytes)
    if hugepages:
        # An anonymous mapping advised MADV_HUGEPAGE before its first touch: transparent huge
        # pages where the kernel allows them (madvise or always mode), so random rows cost far
        # fewer TLB misses, on the CPU and in the GPU's mapping of the registered range.
        import mmap
        m = mmap.mmap(-1, n * row_bytes)
        m.madvise(mmap.MADV_HUGEPAGE)
        src = np.frombuffer(m, np.uint8).reshape(n, row_bytes)
        src[...] = 7
    else:
        src = np.full((n, row_bytes), 7, np.uint8)  # every page touched, as a loaded dataset's
    src[:, 0] = np.arange(n, dtype=np.uint64).astype(np.uint8)
    return src


def run_loader(torch, pinloader, src, bs, batches, device, **opts):
    L = pinloader.ArrayLoader(src, bs, device=device, seed=1, **opts)
    n_per_epoch = len(L)
    it = iter(L)
    for _ in range(min(5, n_per_epoch - 1)):  # warm-up: registration, slabs, the kernel's load
        torch.from_dlpack(next(it))
    torch.cuda.synchronize()
    done = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while done < batches:
        try:
            b = next(it)  # next(), not a for loop: iter() on an ArrayLoader starts an epoch
        except StopIteration:
            it = iter(L)
            continue
        torch.from_dlpack(b)
        done += 1
    torch.cuda.synchronize()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = L.stats()
    L.close()
    return {"gbps": done * bs * src.shape[1] / dt / 1e9, "cpu_ms_per_batch": cpu / done * 1e3,
            "gather": st["gather"], "batches_per_epoch": n_per_epoch,
            "reason": "; ".join(i["reason"] for i in st["gather_leaves"] if i["reason"])}


def run_torch_index(torch, src, bs, batches, device):
    t = torch.from_numpy(src)
    n = t.shape[0]
    g = torch.Generator().manual_seed(1)
    bufs = [torch.empty((bs, src.shape[1]), dtype=torch.uint8).pin_memory() for _ in range(2)]
    evs = [None, None]
    out = None
    for warm in (True, False):
        torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        for k in range(2 if warm else batches):
            i = k % 2
            if evs[i] is not None:
                evs[i].synchronize()  # the copy that read this buffer is done
            idx = torch.randint(0, n, (bs,), generator=g)
            torch.index_select(t, 0, idx, out=bufs[i])
            out = bufs[i].to(device, non_blocking=True)
            evs[i] = torch.cuda.Event()
            evs[i].record()
        torch.cuda.synchronize()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    del out
    return {"gbps": batches * bs * src.shape[1] / dt / 1e9, "cpu_ms_per_batch": cpu / batches * 1e3}


def run_dma(torch, nbytes, batches, device):
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(batches):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"gbps": batches * nbytes / dt / 1e9, "cpu_ms_per_batch": cpu / batches * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_output_args(ap, "gather")
    ap.add_argument("--rows", type=C.csv_list(int), default=ROW_SIZES, help="row sizes in bytes")
    ap.add_argument("--batch-bytes", type=C.parse_size, default=C.parse_size("4M"),
                    help="bytes per batch for rows under 64 KiB (larger rows: 256 per batch)")
    ap.add_argument("--source-bytes", type=C.parse_size, default=C.parse_size("2G"))
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paths", type=C.choice_list(PATHS), default=PATHS)
    ap.add_argument("--hugepages", action="store_true",
                    help="the source in transparent huge pages (madvise(MADV_HUGEPAGE) before "
                         "the first touch); the run prints how much of it got them")
    args = ap.parse_args()
    torch = C.require_cuda(args.device)
    import pinloader

    results: dict = {"machine": C.machine_info(torch, args.device), "args": vars(args), "rows": {}}
    for row in args.rows:
        bs = 256 if row >= 65536 else batch_rows(row, args.batch_bytes)
        src = make_source(row, args.source_bytes, args.hugepages)
        C.log(f"rows of {row} B x {bs} per batch, source {C.format_size(src.nbytes)}"
              + (f", {_anon_huge()} of anonymous huge pages in the process" if args.hugepages else ""))
        per: dict[str, list] = {p: [] for p in args.paths}
        for rnd in range(args.rounds):
            for p in args.paths:
                if p == "host_gather":
                    r = run_loader(torch, pinloader, src, bs, args.batches, args.device, gather="host")
                elif p == "device_gather":
                    r = run_loader(torch, pinloader, src, bs, args.batches, args.device, gather="device")
                elif p == "auto":
                    r = run_loader(torch, pinloader, src, bs, args.batches, args.device)
                elif p == "torch_index":
                    r = run_torch_index(torch, src, bs, args.batches, args.device)
                else:
                    r = run_dma(torch, bs * row, args.batches, args.device)
                r["round"] = rnd
                per[p].append(r)
                C.log(f"  round {rnd} {p:14s} {r['gbps']:7.2f} GB/s  {r['cpu_ms_per_batch']:7.3f} ms CPU/batch"
                      + (f"  [{r['gather']}]" if "gather" in r else ""))
        results["rows"][str(row)] = {"batch": bs, "source_bytes": src.nbytes, "runs": per}
        del src

    lines = C.machine_summary_lines(results["machine"]) + [""]
    head = ["row bytes x batch"] + [f"{p} GB/s" for p in args.paths] + ["device / DMA", "device CPU ms/batch"]
    table = []
    for row, rec in results["rows"].items():
        runs = rec["runs"]
        cells = [f"{row} x {rec['batch']}"]
        for p in args.paths:
            cells.append(C.fmt_summary(C.summarize(r["gbps"] for r in runs[p])))
        if "device_gather" in runs and "dma_ceiling" in runs:
            rat = [d["gbps"] / c["gbps"] for d, c in zip(runs["device_gather"], runs["dma_ceiling"])]
            cells.append(C.fmt_summary(C.summarize(rat)))
            cells.append(C.fmt_summary(C.summarize(r["cpu_ms_per_batch"] for r in runs["device_gather"]), 3))
        else:
            cells += ["–", "–"]
        table.append(cells)
        if "auto" in runs:
            rec["auto_picked"] = runs["auto"][0].get("gather")
    lines.append(C.md_table(head, table))
    text = "\n".join(lines)
    print(text)
    C.write_json(args.out, args.name, results)
    C.write_markdown(args.out, args.name, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
