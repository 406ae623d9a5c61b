#!/usr/bin/env python3
"""ArrayLoader loader-bound as a user's loop gets it, beside bench_gather.py's own measurement of
the same rows, in one run.

For each row size (--rows; the batch and the source of the user-loop measurements: 512 B x 8,192 over
512 MiB, 4 KiB x 1,024 over 1 GiB, 150,528 B x 256 over 1.2 GiB, 64 B x 65,536 over 256 MiB) a
source of random uint8 rows is made once per kind (--sources):
  numpy   np.random.default_rng(0).integers(0, 256, ..., dtype=np.uint8): NumPy's allocator
  torch   torch.randint(0, 256, ..., dtype=torch.uint8).numpy(): torch's allocator
  torch_thp  the same, then collapsed into transparent huge pages (madvise MADV_HUGEPAGE and
          MADV_COLLAPSE, Linux 6.1+, over its 2 MiB-aligned interior)
  bytes   np.frombuffer(rng.bytes(n)): Python's allocator
  full    bench_gather.make_source: constant but for one byte per row (what bench_gather reads)
(NumPy advises its large allocations MADV_HUGEPAGE, torch and Python do not: the JSON keeps how
much of each source is in transparent huge pages.) Then, in --rounds rounds, interleaved, every
loop (--loops) runs over every source:
  next         ArrayLoader(src, batch_size=B, seed=s, device=..., drop_last=d) with every other
               option default (for each --seeds and --drop-last), --warmup batches, then
               --batches batches each taken with next(), turned into a tensor
               (torch.from_dlpack) and touched by one small kernel on the current stream
               (x.view(-1)[:1].add_(0)); time to a final torch.cuda.synchronize(), as a user
               times it. An epoch's end (StopIteration) is followed by iter(loader), counted.
  next_bare    the same without the kernel on the batch (torch.from_dlpack only)
  door         the same loop through pinloader.torch.prefetch(loader) (seeds, drop_last=True)
  for          `for x in loader:` over epoch after epoch until warm-up + batches are taken
               (seed 0, drop_last=False): its epoch ends are in the time
  bench        bench_gather.run_loader on the same source: bench_gather's own loop (seed 1,
               drop_last=False, warm-up until the pinned pool is steady, no kernel, a blocking
               event at the end)
and the reference: one DMA of the batch's bytes from resident pinned memory, copy_(non_blocking=
True) --dma-batches times (bench_gather.run_dma; on the host backend one memcpy).

Each run records delivered GB/s and its ratio to the reference of the same round; the process's
CPU per batch (all threads), with and without the final wait (torch.cuda.synchronize() spins a
core for as long as the GPU is behind); the loader's own CPU per batch as bench_gather counts it
(every thread but the training thread, plus the training thread's time inside next()); CPU by
thread name; the training thread's time in next() and in the tensor and kernel; the producer's
time per batch from stats() (and the consumer's waits, pinned stalls, slabs made); the device
pool's growth; the gather path auto chose and why; the epoch ends crossed. Tables report medians
over the rounds with the range. --profile adds, per row and source, a cProfile of one `next` run
(its top functions in the JSON).

Without a GPU (--device cpu, or no CUDA) the loops run on pinloader's host backend; --smoke runs
tiny sizes there (CI runs it).
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import bench_gather as BG  # noqa: E402

# (row bytes, rows per batch, source bytes) of the user-loop measurements
ROWS = {512: (8192, 512 * C.MiB), 4096: (1024, C.GiB), 150_528: (256, 1_204_224_000), 64: (65536, 256 * C.MiB)}
SOURCES = ["numpy", "torch", "torch_thp", "bytes", "full"]
LOOPS = ["next", "next_bare", "door", "for", "bench"]
REF = "dma"


# ---- sources ------------------------------------------------------------------------------------

def make_source(kind: str, row: int, nbytes: int, seed: int = 0) -> np.ndarray:
    n = max(1, nbytes // row)
    if kind == "numpy":
        return np.random.default_rng(seed).integers(0, 256, size=(n, row), dtype=np.uint8)
    if kind == "torch":
        import torch
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (n, row), dtype=torch.uint8, generator=g).numpy()
    if kind == "torch_thp":
        arr = make_source("torch", row, nbytes, seed)
        collapse(arr)
        return arr
    if kind == "bytes":
        return np.frombuffer(np.random.default_rng(seed).bytes(n * row), np.uint8).reshape(n, row)
    if kind == "full":
        return BG.make_source(row, n * row)
    raise ValueError(kind)


def collapse(arr: np.ndarray) -> int:
    """madvise(MADV_HUGEPAGE) then MADV_COLLAPSE over the 2 MiB-aligned interior of arr's bytes:
    0, or the errno of the call that failed (EINVAL: a kernel without MADV_COLLAPSE)."""
    import ctypes
    import ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    huge = 2 * C.MiB
    lo = arr.__array_interface__["data"][0]
    start, end = -(-lo // huge) * huge, (lo + arr.nbytes) // huge * huge
    if end <= start:
        return 0
    for advice in (14, 25):  # MADV_HUGEPAGE, MADV_COLLAPSE
        if libc.madvise(ctypes.c_void_p(start), end - start, advice) != 0:
            return ctypes.get_errno()
    return 0


def huge_page_bytes(arr: np.ndarray) -> int | None:
    """Bytes of the mappings under `arr` held in transparent huge pages (AnonHugePages of
    /proc/self/smaps over the mappings the array's bytes overlap), or None where unreadable."""
    lo = arr.__array_interface__["data"][0]
    hi = lo + arr.nbytes
    total, inside = 0, False
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as fh:
            for line in fh:
                m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
                if m:
                    inside = int(m.group(1), 16) < hi and int(m.group(2), 16) > lo
                elif inside and line.startswith("AnonHugePages:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return None
    return min(total, arr.nbytes)  # (the mappings may be larger than the array)


def thp_settings() -> dict:
    out = {}
    for k in ("enabled", "defrag", "khugepaged/defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{k}") as fh:
                out[k] = fh.read().strip()
        except OSError:
            out[k] = None
    return out


# ---- the loops ----------------------------------------------------------------------------------

class Ctx:
    """What every run needs: torch (or None on the host backend), the device, pinloader."""

    def __init__(self, torch, device: str, pinloader, args) -> None:
        self.torch, self.device, self.pl, self.args = torch, device, pinloader, args
        self.host = torch is None or device == "cpu"

    def take(self, b):
        if self.torch is not None:
            return self.torch.from_dlpack(b)
        return np.from_dlpack(b)

    def touch(self, x) -> None:
        if self.torch is not None:
            x.view(-1)[:1].add_(0)
        else:
            x.reshape(-1)[:1].sum()  # the host backend: a read of the batch by the CPU

    def settle(self) -> None:
        """Wait for everything queued, asleep (between warm-up and the timed batches)."""
        BG._sync(self.torch if not self.host else None)

    def user_wait(self) -> None:
        """The user's final wait: torch.cuda.synchronize() (it spins while the GPU is behind)."""
        if not self.host:
            self.torch.cuda.synchronize()

    def pool_reserved(self) -> int:
        if self.host:
            return 0
        from pinloader import _C
        idx = int(self.device.split(":")[1]) if ":" in self.device else 0
        return int(_C._testing.device_pool_reserved(idx))


def _producer(st0: dict, st: dict) -> dict:
    if "batches" not in st0 or "batches" not in st:  # (--warmup 0: no prefetcher yet at the start)
        return {}
    made = max(1, st["batches"] - st0["batches"])
    out = {k.replace("_s_total", "_ms_per_batch"): (st[k] - st0[k]) / made * 1e3 for k in BG.PRODUCER_STATS}
    out["consumer_wait_ms_per_batch"] = (st["wait_s_total"] - st0["wait_s_total"]) / made * 1e3
    out["pinned_stalls"] = st["pinned_stalls"] - st0["pinned_stalls"]
    out["pinned_stall_ms_per_batch"] = (st["pinned_stall_s"] - st0["pinned_stall_s"]) / made * 1e3
    out["pool_slabs_created"] = st["pool_slabs_created"] - st0["pool_slabs_created"]
    out["producer_gil_holds"] = st["producer_gil_holds"] - st0["producer_gil_holds"]
    return out


def user_loop(ctx: Ctx, src: np.ndarray, bs: int, *, seed: int, drop_last: bool, touch: bool = True,
              door: bool = False, for_loop: bool = False) -> dict:
    """One user's run: a fresh loader, warm-up, the timed batches, the final wait."""
    pl, a = ctx.pl, ctx.args
    L = pl.ArrayLoader(src, batch_size=bs, seed=seed, device=ctx.device, drop_last=drop_last)
    feed = L
    if door:
        import pinloader.torch as pt
        feed = pt.prefetch(L)
    warm, total = a.warmup, a.warmup + a.batches
    per_next: list[float] = []
    state = {"done": 0, "ends": 0, "next_ns": 0, "take_ns": 0, "end_ns": 0, "x": None}
    marks: dict = {}

    def begin_timing() -> None:
        ctx.settle()
        marks["st0"] = L.stats()
        marks["pool0"] = ctx.pool_reserved()
        marks["th0"] = BG.thread_cpu_ns()
        marks["t0"], marks["c0"] = time.perf_counter(), time.process_time()

    def consume(b) -> None:
        t0 = time.thread_time_ns()
        if for_loop and state["done"] > warm:  # the for loop's next(): since the last batch
            state["next_ns"] += t0 - state["end_ns"]
        x = b if door else ctx.take(b)
        if touch:
            ctx.touch(x)
        state["x"] = x  # held until the next batch replaces it, as a loop variable is
        if state["done"] >= warm:
            state["take_ns"] += time.thread_time_ns() - t0
        state["done"] += 1
        if state["done"] == warm:
            begin_timing()
        state["end_ns"] = time.thread_time_ns()

    if warm == 0:
        begin_timing()
    if for_loop:
        while state["done"] < total:
            started = state["done"]
            for b in feed:
                consume(b)
                if state["done"] == total:
                    break
            else:
                if state["done"] > warm:
                    state["ends"] += 1
            if state["done"] == started:
                raise RuntimeError("an epoch gave no batch")
    else:
        it = iter(feed)
        while state["done"] < total:
            t0, n0 = time.perf_counter(), time.thread_time_ns()
            try:
                b = next(it)
            except StopIteration:
                it = iter(feed)  # the next epoch, as a user's loop over next() starts it
                if state["done"] >= warm:
                    state["ends"] += 1
                b = next(it)
            if state["done"] >= warm:
                state["next_ns"] += time.thread_time_ns() - n0
                per_next.append((time.perf_counter() - t0) * 1e3)
            consume(b)
    c_last, t_last = time.process_time(), time.perf_counter()
    th_last = BG.thread_cpu_ns(names=False)
    ctx.user_wait()
    dt, cpu = time.perf_counter() - marks["t0"], time.process_time() - marks["c0"]
    n = a.batches
    threads = BG.cpu_by_thread_name(marks["th0"], BG.thread_cpu_ns(), n)
    threads_before_wait = BG.cpu_by_thread_name(marks["th0"], th_last, n)
    # CPU of threads that ended in the timed window (theirs is in the process's total but in no
    # snapshot's last reading), and their names where they had begun before it
    ended_ms = (c_last - marks["c0"]) * 1e3 / n - sum(threads_before_wait.values())
    threads_before_wait["(ended)"] = round(max(0.0, ended_ms), 4)
    ended_names = sorted({name for tid, (name, _) in marks["th0"].items() if tid not in th_last})
    st = L.stats()
    pool = ctx.pool_reserved() - marks["pool0"]
    state["x"] = None
    if door:
        feed.close()
    L.close()
    next_ms = state["next_ns"] / 1e6 / n
    loader_cpu = sum(v for k, v in threads_before_wait.items() if k != "main") + next_ms
    gather = st.get("gather")
    reason = "; ".join(i["reason"] for i in st.get("gather_leaves", []) if i["reason"])
    return {"gbps": n * bs * src.shape[1] / dt / 1e9, "wall_ms_per_batch": dt / n * 1e3,
            "cpu_ms_per_batch": cpu / n * 1e3,
            "cpu_ms_per_batch_before_wait": (c_last - marks["c0"]) / n * 1e3,
            "end_wait_ms": (time.perf_counter() - t_last) * 1e3,
            "loader_cpu_ms_per_batch": loader_cpu, "next_cpu_ms_per_batch": next_ms,
            "take_cpu_ms_per_batch": state["take_ns"] / 1e6 / n,
            "next_wall_ms": {"median": float(np.median(per_next)) if per_next else None,
                             "max": float(max(per_next)) if per_next else None},
            "thread_cpu_ms_per_batch": threads, "thread_cpu_ms_per_batch_before_wait": threads_before_wait,
            "threads_ended": ended_names,
            **_producer(marks["st0"], st), "device_pool_growth_mib": pool / C.MiB,
            "gather": gather, "reason": reason, "epoch_ends": state["ends"],
            "batches_per_epoch": st.get("batches_per_epoch"), "registered_bytes": st.get("registered_bytes")}


def bench_loop(ctx: Ctx, src: np.ndarray, bs: int) -> dict:
    """bench_gather.py's own measurement of the same rows (its function, unchanged)."""
    r = BG.run_loader(ctx.torch if not ctx.host else None, ctx.pl, src, bs, ctx.args.batches, ctx.device)
    r["epoch_ends"] = r.pop("epoch_boundaries")
    return r


def dma_ref(ctx: Ctx, nbytes: int) -> dict:
    return BG.run_dma(ctx.torch if not ctx.host else None, nbytes, ctx.args.dma_batches, ctx.device)


def variants(args) -> list[tuple[str, dict]]:
    out = []
    for loop in args.loops:
        if loop in ("next", "next_bare"):
            for s in args.seeds:
                for d in args.drop_last:
                    out.append((f"{loop} seed={s} drop_last={d}", {"loop": loop, "seed": s, "drop_last": d}))
        elif loop == "door":
            for s in args.seeds:
                out.append((f"door seed={s} drop_last=True", {"loop": loop, "seed": s, "drop_last": True}))
        elif loop == "for":
            out.append(("for seed=0 drop_last=False", {"loop": loop, "seed": 0, "drop_last": False}))
        else:
            out.append(("bench", {"loop": "bench"}))
    if args.row_prefetch == ["on"]:
        return out
    # the host row gather's prefetch (Note [row gather] in src/core/stager.c) per variant
    return [(name if pf == "on" else f"{name} prefetch=off", dict(v, row_prefetch=pf))
            for name, v in out for pf in args.row_prefetch]


def run_variant(ctx: Ctx, v: dict, src: np.ndarray, bs: int) -> dict:
    # read when the loader's stager is made, for that stager (Note [row gather])
    os.environ["PINLOADER_ROW_PREFETCH"] = "0" if v.get("row_prefetch") == "off" else "1"
    loop = v["loop"]
    if loop == "bench":
        return bench_loop(ctx, src, bs)
    return user_loop(ctx, src, bs, seed=v["seed"], drop_last=v["drop_last"], touch=loop != "next_bare",
                     door=loop == "door", for_loop=loop == "for")


def profile_run(ctx: Ctx, src: np.ndarray, bs: int, top: int = 25) -> str:
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    try:
        user_loop(ctx, src, bs, seed=0, drop_last=True)
    finally:
        prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


# ---- main ---------------------------------------------------------------------------------------

def _bool_list(text: str) -> list[bool]:
    vals = {"true": True, "false": False, "1": True, "0": False}
    out = [vals.get(t.strip().lower()) for t in text.split(",") if t.strip()]
    if not out or any(v is None for v in out):
        raise ValueError(f"not a list of true/false: {text!r}")
    return out  # type: ignore[return-value]


def fmt_line(name: str, r: dict) -> str:
    extra = ""
    if "producer_ms_per_batch" in r:
        extra = (f" producer {r['producer_ms_per_batch']:.3f} (stall {r.get('pinned_stall_ms_per_batch', 0):.3f}, "
                 f"issue {r['copy_issue_ms_per_batch']:.3f}) consumer wait {r.get('consumer_wait_ms_per_batch', 0):.3f};"
                 f" loader CPU {r['loader_cpu_ms_per_batch']:.3f} next() {r['next_cpu_ms_per_batch']:.3f};"
                 f" [{r['gather']}] ends {r['epoch_ends']}, slabs {r['pool_slabs_created']}")
    th = r.get("thread_cpu_ms_per_batch") or {}
    threads = ", ".join(f"{k} {v:.3f}" for k, v in list(th.items())[:5])
    ended = (r.get("thread_cpu_ms_per_batch_before_wait") or {}).get("(ended)")
    if ended:
        threads += f", threads that ended {ended:.3f} ({', '.join(r.get('threads_ended') or []) or 'begun in the window'})"
    return (f"    {name:32s} {r['gbps']:7.2f} GB/s {r['cpu_ms_per_batch']:6.3f} ms CPU/batch"
            + (f" ({r['cpu_ms_per_batch_before_wait']:.3f} before the final wait)" if "cpu_ms_per_batch_before_wait" in r else "")
            + extra + (f"; by thread: {threads}" if threads else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_output_args(ap, "user_loop")
    ap.add_argument("--rows", type=C.csv_list(int), default=list(ROWS), help="row sizes in bytes (the four measured)")
    ap.add_argument("--source-scale", type=float, default=1.0,
                    help="scale every source's size (at least two batches)")
    ap.add_argument("--batch-scale", type=float, default=1.0, help="scale every batch's rows")
    ap.add_argument("--sources", type=C.choice_list(SOURCES), default=["numpy"])
    ap.add_argument("--loops", type=C.choice_list(LOOPS), default=["next", "door", "for", "bench"])
    ap.add_argument("--seeds", type=C.csv_list(int), default=[0, 1])
    ap.add_argument("--drop-last", type=_bool_list, default=[True, False])
    ap.add_argument("--row-prefetch", type=C.choice_list(("on", "off")), default=["on"],
                    help="on,off: each loop with the host row gather's prefetch on and off, alternated "
                         "(PINLOADER_ROW_PREFETCH)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--dma-batches", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="a cProfile of one `next` run per row and source")
    ap.add_argument("--smoke", action="store_true",
                    help="host backend, tiny sources and few batches, 2 rounds: checks the script (CI)")
    args = ap.parse_args()
    import pinloader

    if args.smoke:
        C.smoke_out(args)
        args.device = "cpu"
        args.source_scale = 0.0  # two batches: every loop crosses epoch ends
        args.batch_scale = min(args.batch_scale, 1 / 64)
        args.warmup, args.batches, args.dma_batches, args.rounds = 3, 6, 5, 2
    host = args.device == "cpu" or pinloader.backend() != "cuda"
    torch = None
    if not host:
        torch = C.require_cuda(args.device)
    else:
        try:
            import torch  # noqa: F811 -- the torch source and the door, on the CPU
        except ImportError:
            torch = None
    device = "cpu" if host else args.device
    if torch is None:
        dropped = [s for s in args.sources if s == "torch"] + [lp for lp in args.loops if lp == "door"]
        if dropped:
            C.log(f"without torch: leaving out {', '.join(dropped)}")
        args.sources = [s for s in args.sources if s != "torch"]
        args.loops = [lp for lp in args.loops if lp != "door"]
    ctx = Ctx(torch if not host else None, device, pinloader, args)
    if host and torch is not None:
        # the door and the tensors on the host backend: torch CPU tensors
        ctx.torch = None
        ctx.take = lambda b: torch.from_dlpack(b)  # type: ignore[method-assign]
        ctx.touch = lambda x: x.view(-1)[:1].add_(0)  # type: ignore[method-assign]
    bad = [r for r in args.rows if r not in ROWS]
    if bad:
        C.fail(f"--rows: {bad} not among {list(ROWS)}", 1)

    results: dict = {"machine": C.machine_info(torch if not host else None, device), "args": vars(args),
                     "backend": "host" if host else "cuda", "thp": thp_settings(), "rows": {}}
    C.log(f"transparent huge pages: {results['thp']}")
    vs = variants(args)
    for row in args.rows:
        bs, nbytes = ROWS[row]
        bs = max(1, int(bs * args.batch_scale))
        nbytes = max(bs * row * 2, int(nbytes * args.source_scale))
        rec: dict = {"batch": bs, "batch_bytes": bs * row, "sources": {}, "ref": []}
        srcs = {}
        for kind in args.sources:
            t0 = time.perf_counter()
            srcs[kind] = make_source(kind, row, nbytes)
            hp = huge_page_bytes(srcs[kind])
            rec["sources"][kind] = {"bytes": srcs[kind].nbytes, "rows": srcs[kind].shape[0],
                                    "huge_page_bytes": hp, "made_s": time.perf_counter() - t0,
                                    "runs": {name: [] for name, _ in vs}}
            C.log(f"rows of {row} B x {bs} per batch, source {kind}: {C.format_size(srcs[kind].nbytes)}, "
                  f"{(hp or 0) / C.MiB:.0f} MiB in huge pages")
        for rnd in range(args.rounds):
            ref = dma_ref(ctx, bs * row)
            ref["round"] = rnd
            rec["ref"].append(ref)
            C.log(f"  round {rnd}: reference {ref['gbps']:.2f} GB/s")
            for kind in args.sources:
                C.log(f"   source {kind}")
                for name, v in vs:
                    gc.collect()
                    r = run_variant(ctx, v, srcs[kind], bs)
                    r["round"] = rnd
                    r["ratio"] = r["gbps"] / ref["gbps"]
                    rec["sources"][kind]["runs"][name].append(r)
                    C.log(fmt_line(name, r) + f"  -> {r['ratio']:.2f}x")
        if args.profile:
            for kind in args.sources:
                rec["sources"][kind]["profile"] = profile_run(ctx, srcs[kind], bs)
                C.log(rec["sources"][kind]["profile"])
        results["rows"][str(row)] = rec
        del srcs
        gc.collect()

    ref_name = "one DMA" if not host else "one memcpy"
    lines = C.machine_summary_lines(results["machine"]) + [
        f"- transparent huge pages: {results['thp'].get('enabled')} (defrag {results['thp'].get('defrag')})", ""]
    head = ["rows x batch", "source (huge pages)", "loop", "GB/s", f"/ {ref_name}", "CPU ms/batch",
            "CPU before final wait", "loader CPU ms/batch", "next() CPU ms", "producer ms/batch",
            "consumer wait ms", "path", "epoch ends"]
    table = []
    for row, rec in results["rows"].items():
        for kind, srec in rec["sources"].items():
            hp = srec["huge_page_bytes"]
            hp_text = f"{kind} ({hp / srec['bytes'] * 100:.0f}%)" if hp is not None else kind
            for name, runs in srec["runs"].items():
                if not runs:
                    continue

                def s(key, digits=3, runs=runs):
                    return C.fmt_summary(C.summarize(r.get(key) for r in runs), digits)
                table.append([f"{row} x {rec['batch']}", hp_text, f"`{name}`", s("gbps", 2), s("ratio", 2),
                              s("cpu_ms_per_batch"), s("cpu_ms_per_batch_before_wait"),
                              s("loader_cpu_ms_per_batch"), s("next_cpu_ms_per_batch"),
                              s("producer_ms_per_batch"), s("consumer_wait_ms_per_batch"),
                              runs[0].get("gather", "–"),
                              ",".join(str(r.get("epoch_ends", "–")) for r in runs)])
        refs = C.summarize(r["gbps"] for r in rec["ref"])
        table.append([f"{row} x {rec['batch']}", "resident pinned", f"`{REF}`", C.fmt_summary(refs),
                      "1.00", C.fmt_summary(C.summarize(r["cpu_ms_per_batch"] for r in rec["ref"]), 3),
                      "", "", "", "", "", "", ""])
    lines.append(C.md_table(head, table))
    lines += ["", "Medians over the rounds (range in brackets); each ratio is to the reference of its own "
              "round. `bench` is bench_gather.run_loader on the same source (seed 1, drop_last=False, "
              "warm-up until the pool is steady, no kernel, a blocking event at the end); the CPU "
              "before the final wait leaves out torch.cuda.synchronize()'s spin."]
    C.publish(args.out, args.name, results, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
