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
  numpy_index     plain NumPy, one thread: np.take(src, idx, axis=0, out=buf) into a reused
                  buffer (pinned on CUDA, then .to(device, non_blocking=True) as torch_index
                  does; on the host backend the gather itself is the one copy)
  dma_ceiling     the physical reference: one cudaMemcpyAsync of the batch's bytes from
                  resident pinned memory per batch (no gather at all); on the host backend one
                  memcpy of the batch's bytes from resident memory
Each figure is delivered bytes per second over --batches batches after a warm-up (until the
pinned pool is steady: no slab made in 10 batches; the JSON keeps how many, and how many epoch
ends fell in the timed batches: the producer stops at an epoch's end until the next iter(), so
each one drains the pipeline; a source of at least warm-up + --batches batches keeps them out), the
wait for the device's last copy included (a blocking-sync event: the waiting thread sleeps, so
the GPU's lag is not counted as CPU time, as torch.cuda.synchronize()'s spin would count it);
host CPU per batch is the process's CPU time (all threads)
divided by the batches, and for the loader rows also by thread name (the main thread, pinloader's
pl-producer and pl-stage threads, the CUDA driver's own) and as the loader's own CPU: every thread
but the main one, plus the main thread's time inside next() (leaving out torch.from_dlpack, which
any loader of device arrays costs its consumer). For the loader rows the JSON also keeps where the producer thread's
time went, per batch (stats(): producer_s_total, gil_wait_s_total, next_s_total,
staging_s_total, sort_s_total). The table reports the median over the rounds with the range,
and each path's ratio to the DMA ceiling measured in the same round.

Without a GPU (--device cpu, or no CUDA) the same rows run on pinloader's host backend, where
torch_index is left out: ArrayLoader against NumPy on the machine at hand.
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
PATHS = ["host_gather", "device_gather", "auto", "torch_index", "numpy_index", "dma_ceiling"]
HOST_PATHS = ["host_gather", "device_gather", "auto", "numpy_index", "dma_ceiling"]
PRODUCER_STATS = ("producer_s_total", "gil_wait_s_total", "next_s_total", "staging_s_total", "sort_s_total",
                  "copy_issue_s_total")


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


def _thread_clock_ns(tid: int) -> int:
    """CPU time of thread `tid` of this process, exact to the moment (Linux's per-thread CPU
    clock, clockid (~tid << 3) | 6, as pthread_getcpuclockid makes; /proc's schedstat lags a
    running thread by up to a scheduler tick)."""
    try:
        return time.clock_gettime_ns((~tid << 3) | 6)
    except (OSError, OverflowError):
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])


def thread_cpu_ns(names: bool = True) -> dict[int, tuple[str, int]]:
    """Each thread of this process: tid -> (its name, or "" without `names`; its CPU time so far
    in ns) (Linux); empty where /proc/self/task cannot be read."""
    import os
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for t in tids:
        try:
            name = ""
            if names:
                with open(f"/proc/self/task/{t}/comm") as f:
                    name = f.read().strip()
            out[int(t)] = (name, _thread_clock_ns(int(t)))
        except (OSError, ValueError, IndexError):
            pass  # the thread ended meanwhile
    return out


def cpu_by_thread_name(before: dict, after: dict, per: int) -> dict[str, float]:
    """CPU ms per batch between two thread_cpu_ns() snapshots, summed by thread name (the main
    thread is "main"; pinloader names its threads pl-producer, pl-stage, pl-host-stream)."""
    import os
    main = os.getpid()
    by: dict[str, float] = {}
    for tid, (name, ns) in after.items():
        d = ns - before.get(tid, (name, 0))[1]
        key = "main" if tid == main else name
        by[key] = by.get(key, 0.0) + d / 1e6 / max(1, per)
    return {k: round(v, 4) for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v > 0}


def _sync(torch):
    """Wait until the device has done everything queued on the current stream (every row's
    results are consumed there), the calling thread asleep: a blocking-sync event, not
    torch.cuda.synchronize(), which spins a CPU for as long as the GPU is behind and so would
    count the GPU's lag as the host's CPU time."""
    if torch is not None:
        ev = torch.cuda.Event(blocking=True)
        ev.record()
        ev.synchronize()


def run_loader(torch, pinloader, src, bs, batches, device, **opts):
    L = pinloader.ArrayLoader(src, bs, device=device, seed=1, **opts)
    n_per_epoch = len(L)
    take = torch.from_dlpack if torch is not None else np.from_dlpack
    it = iter(L)
    # warm-up: registration, the kernel's load, and the pinned slabs of the batches in flight
    # (made as the first batches need them: a 38 MB batch takes one 64 MiB slab each), until
    # the pool is steady: no slab made in the last 10 batches (20 batches at least, 100 at most)
    warm, steady_since, slabs = 0, 0, L.stats()["pool_slabs_created"]
    while warm < 100 and (warm < 20 or warm - steady_since < 10):
        try:
            take(next(it))
        except StopIteration:
            it = iter(L)
            continue
        warm += 1
        now = L.stats()["pool_slabs_created"]
        if now != slabs:
            slabs, steady_since = now, warm
    _sync(torch)
    st0 = L.stats()
    done = boundaries = next_ns = 0
    th0 = thread_cpu_ns(names=False)
    t0, c0 = time.perf_counter(), time.process_time()
    while done < batches:
        n0 = time.thread_time_ns()
        try:
            b = next(it)  # next(), not a for loop: iter() on an ArrayLoader starts an epoch
        except StopIteration:
            it = iter(L)  # the producer stops at an epoch's end until iter(): a drain
            boundaries += 1
            continue
        finally:
            next_ns += time.thread_time_ns() - n0
        take(b)
        done += 1
    _sync(torch)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    threads = cpu_by_thread_name(th0, thread_cpu_ns(), done)
    # the loader's own CPU: its threads, and the training thread's time inside next() (not
    # the consumer's conversion, torch.from_dlpack, which any loader of device arrays costs)
    loader_cpu = sum(v for k, v in threads.items() if k != "main") + next_ns / 1e6 / max(1, done)
    st = L.stats()
    L.close()
    # the producer's time per batch over the timed batches (the prefetcher may have run a few
    # batches ahead, so these are close to, not exactly, the timed ones)
    made = max(1, st["batches"] - st0["batches"])
    producer = {k.replace("_s_total", "_ms_per_batch"): (st[k] - st0[k]) / made * 1e3 for k in PRODUCER_STATS}
    producer["pinned_stalls"] = st["pinned_stalls"] - st0["pinned_stalls"]
    producer["pool_slabs_created"] = st["pool_slabs_created"] - st0["pool_slabs_created"]
    return {"gbps": done * bs * src.shape[1] / dt / 1e9, "cpu_ms_per_batch": cpu / done * 1e3,
            "wall_ms_per_batch": dt / done * 1e3, **producer, "thread_cpu_ms_per_batch": threads,
            "loader_cpu_ms_per_batch": loader_cpu, "next_cpu_ms_per_batch": next_ns / 1e6 / max(1, done),
            "warmup_batches": warm, "epoch_boundaries": boundaries,
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
        _sync(torch)
        t0, c0 = time.perf_counter(), time.process_time()
        for k in range(2 if warm else batches):
            i = k % 2
            if evs[i] is not None:
                evs[i].synchronize()  # the copy that read this buffer is done
            idx = torch.randint(0, n, (bs,), generator=g)
            torch.index_select(t, 0, idx, out=bufs[i])
            out = bufs[i].to(device, non_blocking=True)
            evs[i] = torch.cuda.Event(blocking=True)  # waited on asleep, as _sync
            evs[i].record()
        _sync(torch)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    del out
    return {"gbps": batches * bs * src.shape[1] / dt / 1e9, "cpu_ms_per_batch": cpu / batches * 1e3}


def run_numpy_index(torch, src, bs, batches, device):
    n = src.shape[0]
    rng = np.random.default_rng(1)
    if torch is not None:
        pinned = [torch.empty((bs, src.shape[1]), dtype=torch.uint8).pin_memory() for _ in range(2)]
        bufs = [p.numpy() for p in pinned]
    else:
        bufs = [np.empty((bs, src.shape[1]), np.uint8) for _ in range(2)]
    evs = [None, None]
    out = None
    for warm in (True, False):
        _sync(torch)
        t0, c0 = time.perf_counter(), time.process_time()
        for k in range(2 if warm else batches):
            i = k % 2
            if evs[i] is not None:
                evs[i].synchronize()  # the copy that read this buffer is done
            idx = rng.integers(0, n, bs)
            np.take(src, idx, axis=0, out=bufs[i])
            if torch is not None:
                out = pinned[i].to(device, non_blocking=True)
                evs[i] = torch.cuda.Event(blocking=True)
                evs[i].record()
        _sync(torch)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    del out
    return {"gbps": batches * bs * src.shape[1] / dt / 1e9, "cpu_ms_per_batch": cpu / batches * 1e3}


def run_host_copy(nbytes, batches):
    """The host backend's ceiling: one memcpy of the batch's bytes from resident memory."""
    host = np.full(nbytes, 3, np.uint8)
    dst = np.empty_like(host)
    np.copyto(dst, host)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(batches):
        np.copyto(dst, host)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"gbps": batches * nbytes / dt / 1e9, "cpu_ms_per_batch": cpu / batches * 1e3}


def run_dma(torch, nbytes, batches, device):
    if torch is None:
        return run_host_copy(nbytes, batches)
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(batches):
        dev.copy_(host, non_blocking=True)
    _sync(torch)
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
    ap.add_argument("--paths", type=C.choice_list(PATHS), default=None,
                    help="default: every path (on the host backend, all but torch_index)")
    ap.add_argument("--depth", type=int, default=None, help="ArrayLoader depth (default: its own)")
    ap.add_argument("--staging-threads", type=int, default=None,
                    help="ArrayLoader staging_threads (default: the CPU budget)")
    ap.add_argument("--hugepages", action="store_true",
                    help="the source in transparent huge pages (madvise(MADV_HUGEPAGE) before "
                         "the first touch); the run prints how much of it got them")
    args = ap.parse_args()
    import pinloader

    host = args.device == "cpu" or pinloader.backend() != "cuda"
    torch = None if host else C.require_cuda(args.device)
    device = "cpu" if host else args.device
    if args.paths is None:
        args.paths = HOST_PATHS if host else PATHS
    if host and "torch_index" in args.paths:
        C.fail("torch_index needs a CUDA device; leave it out on the host backend")
    opts = {k: v for k, v in (("depth", args.depth), ("staging_threads", args.staging_threads)) if v is not None}

    results: dict = {"machine": C.machine_info(torch, device), "args": vars(args), "rows": {},
                     "backend": "host" if host else "cuda"}
    for row in args.rows:
        bs = 256 if row >= 65536 else batch_rows(row, args.batch_bytes)
        src = make_source(row, args.source_bytes, args.hugepages)
        C.log(f"rows of {row} B x {bs} per batch, source {C.format_size(src.nbytes)}"
              + (f", {_anon_huge()} of anonymous huge pages in the process" if args.hugepages else ""))
        per: dict[str, list] = {p: [] for p in args.paths}
        for rnd in range(args.rounds):
            for p in args.paths:
                if p == "host_gather":
                    r = run_loader(torch, pinloader, src, bs, args.batches, device, gather="host", **opts)
                elif p == "device_gather":
                    r = run_loader(torch, pinloader, src, bs, args.batches, device, gather="device", **opts)
                elif p == "auto":
                    r = run_loader(torch, pinloader, src, bs, args.batches, device, **opts)
                elif p == "torch_index":
                    r = run_torch_index(torch, src, bs, args.batches, device)
                elif p == "numpy_index":
                    r = run_numpy_index(torch, src, bs, args.batches, device)
                else:
                    r = run_dma(torch, bs * row, args.batches, device)
                r["round"] = rnd
                per[p].append(r)
                C.log(f"  round {rnd} {p:14s} {r['gbps']:7.2f} GB/s  {r['cpu_ms_per_batch']:7.3f} ms CPU/batch"
                      + (f"  [{r['gather']}] producer {r['producer_ms_per_batch']:.3f} ms/batch "
                         f"(GIL wait {r['gil_wait_ms_per_batch']:.3f}, next {r['next_ms_per_batch']:.3f}, "
                         f"staging {r['staging_ms_per_batch']:.3f}, sort {r['sort_ms_per_batch']:.3f}, "
                         f"issue {r['copy_issue_ms_per_batch']:.3f}) "
                         f"of {r['wall_ms_per_batch']:.3f} ms/batch; {r['pinned_stalls']} stalls, "
                         f"{r['pool_slabs_created']} slabs made, {r['warmup_batches']} warm-up batches, "
                         f"{r['epoch_boundaries']} epoch ends; loader CPU {r['loader_cpu_ms_per_batch']:.3f} "
                         f"ms/batch (in next() {r['next_cpu_ms_per_batch']:.3f}); CPU ms/batch by thread "
                         + ", ".join(f"{k} {v:.3f}" for k, v in list(r["thread_cpu_ms_per_batch"].items())[:6])
                         if "gather" in r else ""))
        results["rows"][str(row)] = {"batch": bs, "source_bytes": src.nbytes, "runs": per}
        del src

    lines = C.machine_summary_lines(results["machine"]) + [""]
    ceiling = "dma_ceiling" if not host else "host memcpy"
    head = (["row bytes x batch"] + [f"{p} GB/s" for p in args.paths]
            + [f"device / {ceiling}", f"host / {ceiling}", "host / numpy", "device CPU ms/batch",
               "device loader CPU ms/batch"])
    table = []
    for row, rec in results["rows"].items():
        runs = rec["runs"]
        cells = [f"{row} x {rec['batch']}"]
        for p in args.paths:
            cells.append(C.fmt_summary(C.summarize(r["gbps"] for r in runs[p])))
        for a, b in (("device_gather", "dma_ceiling"), ("host_gather", "dma_ceiling"),
                     ("host_gather", "numpy_index")):
            if a in runs and b in runs:  # ratios within each round
                cells.append(C.fmt_summary(C.summarize(x["gbps"] / y["gbps"] for x, y in zip(runs[a], runs[b]))))
            else:
                cells.append("–")
        for key in ("cpu_ms_per_batch", "loader_cpu_ms_per_batch"):
            if "device_gather" in runs:
                cells.append(C.fmt_summary(C.summarize(r[key] for r in runs["device_gather"]), 3))
            else:
                cells.append("–")
        table.append(cells)
        if "auto" in runs:
            rec["auto_picked"] = runs["auto"][0].get("gather")
    lines.append(C.md_table(head, table))
    text = "\n".join(lines)
    C.publish(args.out, args.name, results, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
