"""bench_bandwidth.py --staging-sweep: staging into pinned memory alone (no CUDA needed: the
host backend stands in), pinloader against torch's copy_ and threaded numpy copies for thread
counts 1..N; with --ranks, N processes staging at once. Also the threaded host memcpy that
bench_bandwidth.py's main run measures as its ceiling.

Nothing here imports torch at import time: the sweep imports it once the script's arguments
are parsed and passes it on.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

import _common as common


def _cpu_budget(pl: Any) -> Any:
    """The extension's CPU budget (cpu_budget(); _cpu_budget() in builds before 2026-12-07), or
    None where the build has neither."""
    fn = getattr(pl._C, "cpu_budget", None) or getattr(pl._C, "_cpu_budget", None)
    return fn() if fn else None


def host_memcpy_gbps(dst, src, threads, iters, warmup=2):
    """GB/s of np.copyto(dst, src) split over ``threads`` threads; per-iteration GB/s list."""
    n = src.nbytes
    step = -(-n // threads)
    step = -(-step // 4096) * 4096
    bounds = [(a, min(a + step, n)) for a in range(0, n, step)]

    def copy(ab):
        np.copyto(dst[ab[0]:ab[1]], src[ab[0]:ab[1]])

    rates = []
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            list(pool.map(copy, bounds))
            dt = time.perf_counter() - t0
            if i >= warmup:
                rates.append(n / dt / 1e9)
    return statistics.median(rates), rates



def default_sweep_threads(limit):
    """1, 2, 4, ... up to ``limit``, plus ``limit`` itself and 12/24 where they fit."""
    out = {limit}
    t = 1
    while t < limit:
        out.add(t)
        t *= 2
    out.update(x for x in (12, 24) if x < limit)
    return sorted(out)


def staging_rate(torch, pinloader, leaf, batches, device, threads, pool, depth):
    """One prefetcher over ``batches`` copies of the pageable ``leaf``: staging GB/s (bytes over
    the stager's own time, stats()["staging_s_total"]) and wall GB/s (consumer side)."""
    def source():
        for _ in range(batches):
            yield (leaf,)

    kwargs = {"device": device, "depth": depth, "pool": pool}
    if threads is not None:
        kwargs["staging_threads"] = threads
    pf = pinloader.AsyncPrefetcher(source(), **kwargs)
    n = 0
    try:
        t0 = time.perf_counter()
        for batch in pf:
            if device == "cpu":
                batch[0].__dlpack__()  # waits for the host "copy", like a consumer would
            else:
                t = torch.from_dlpack(batch[0])
                t.sum(dtype=torch.int64) if n == batches - 1 else None
                del t
            del batch
            n += 1
        if device != "cpu":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        stats = pf.stats()
        used = pf.staging_threads
    finally:
        pf.close()
    secs = stats.get("staging_s_total") or 0.0
    nbytes = stats.get("bytes", 0)
    return {"threads": used, "staging_gbps": nbytes / secs / 1e9 if secs else None,
            "wall_gbps": n * leaf.nbytes / wall / 1e9 if wall else None,
            "staging_s_total": secs, "batches": n}


def torch_copy_rate(torch, dst, src, threads, iters):
    """GB/s of dst.copy_(src) with torch.set_num_threads(threads): median of ``iters``."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dst.copy_(src)
        rates = []
        for _ in range(iters):
            t0 = time.perf_counter()
            dst.copy_(src)
            rates.append(src.numel() * src.element_size() / (time.perf_counter() - t0) / 1e9)
    finally:
        torch.set_num_threads(old)
    return statistics.median(rates), rates


def render_staging_markdown(payload):
    cfg = payload["config"]
    lines = ["# Staging into pinned memory against torch's `copy_` (`bench_bandwidth.py "
             "--staging-sweep`)", ""]
    lines += common.machine_summary_lines(payload["machine"])
    size = common.format_size(cfg["staging_bytes"])
    pinned = payload["pinned_destination"]
    lines += ["", f"{size} pageable uint8 batches. pinloader: `AsyncPrefetcher(device="
              f"{payload['device']!r}, pool=<one warm PinnedPool>, staging_threads=T)`; staging "
              "GB/s = bytes / `stats()['staging_s_total']` (the stager's own time, chunk DMA "
              "issue included), wall GB/s = batches delivered to the consumer. torch: "
              f"`dst.copy_(src)` of {size} with `torch.set_num_threads(T)`, into "
              + ("a pinned tensor (`pin_memory=True`)." if pinned else
                 "a plain CPU tensor: `pin_memory=True` needs CUDA, unavailable here, so this "
                 "is pageable-to-pageable.")
              + f" numpy: `np.copyto` split over T Python threads. Cells: median over "
              f"{cfg['repeats']} repeat(s) (min–max). CPU budget: {payload['cpu_budget']}.", ""]
    rows = []
    for t in payload["threads"]:
        e = payload["sweep"][str(t)]
        rows.append([t, common.fmt_summary(e["staging"], 1), common.fmt_summary(e["wall"], 1),
                     common.fmt_summary(e["torch"], 1), common.fmt_summary(e["numpy"], 1)])
    d = payload["default"]
    rows.append([f"default ({d['threads']})", common.fmt_summary(d["staging"], 1),
                 common.fmt_summary(d["wall"], 1), "", ""])
    a = payload["torch_all"]
    rows.append([f"torch default ({a['threads']})", "", "", common.fmt_summary(a["summary"], 1), ""])
    lines.append(common.md_table(["threads", "pinloader staging GB/s", "pinloader wall GB/s",
                                  "torch copy_ GB/s", "numpy threads GB/s"], rows))
    r = payload["ratios"]
    lines += ["", common.md_table(["ratio", "value", "target"], [
        ["pinloader staging, default threads / torch all-thread copy_",
         common.fmt_num(r.get("default_over_torch_all"), 3), "≥ 0.95"],
        ["best pinloader staging / best torch copy_",
         common.fmt_num(r.get("best_over_best_torch"), 3), "(reference)"],
    ] + ([[f"{payload['ranks']['ranks']} ranks staging at once (LOCAL_WORLD_SIZE), aggregate "
           f"{common.fmt_num(payload['ranks'].get('aggregate_gbps'), 1)} GB/s / torch all-thread "
           "copy_", common.fmt_num(r.get("ranks_aggregate_over_torch_all"), 3), "≥ 0.9"]]
         if payload.get("ranks") else []), align="lrr"), ""]
    return "\n".join(lines)


def rank_worker(args):
    """--rank-worker R (started by --ranks): stage with the default thread count on device
    cuda:R (or the host backend), from --start-at on; print one JSON line."""
    import json

    import torch
    import pinloader as pl
    cuda = torch.cuda.is_available() and pl.cuda_available()
    device = f"cuda:{args.rank_worker % max(1, torch.cuda.device_count())}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    src = np.empty(args.staging_bytes, dtype=np.uint8)
    src.view(np.uint64)[:] = 0x0123456789ABCDEF
    pool = pl.PinnedPool(max_bytes=(args.depth + 3) * args.staging_bytes)
    staging_rate(torch, pl, src, args.depth + 2, device, None, pool, args.depth)
    time.sleep(max(0.0, args.start_at - time.time()))
    t0 = time.time()
    rec = staging_rate(torch, pl, src, args.rank_batches, device, None, pool, args.depth)
    rec.update(start=t0, end=time.time(), device=device, bytes=args.rank_batches * src.nbytes,
               budget=_cpu_budget(pl))
    pool.close()
    print("RANK " + json.dumps(rec), flush=True)
    return 0


def ranks_run(args, script):
    """--ranks N: N processes staging at once (LOCAL_WORLD_SIZE=N, as torchrun sets it), each
    with the default thread count; aggregate GB/s over the common window."""
    import json
    import subprocess
    env = dict(os.environ, LOCAL_WORLD_SIZE=str(args.ranks))
    start_at = time.time() + args.rank_start_s
    cmd = [sys.executable, script, "--staging-sweep",
           "--staging-bytes", str(args.staging_bytes), "--depth", str(args.depth),
           "--rank-batches", str(args.rank_batches), "--start-at", repr(start_at)]
    procs = [subprocess.Popen(cmd + ["--rank-worker", str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(args.ranks)]
    recs, errors = [], []
    for p in procs:
        out, err = p.communicate(timeout=args.rank_start_s + 120)
        line = next((ln for ln in out.splitlines() if ln.startswith("RANK ")), None)
        if p.returncode != 0 or line is None:
            errors.append((err or out)[-500:])
        else:
            recs.append(json.loads(line[5:]))
    if not recs:
        return {"ranks": args.ranks, "errors": errors}
    window = max(r["end"] for r in recs) - min(r["start"] for r in recs)
    late = max(r["start"] for r in recs) - min(r["start"] for r in recs)
    return {"ranks": args.ranks, "per_rank": recs, "errors": errors,
            "aggregate_gbps": sum(r["bytes"] for r in recs) / window / 1e9,
            "aggregate_staging_gbps": sum(r["staging_gbps"] or 0 for r in recs),
            "window_s": window, "start_skew_s": late}


def staging_sweep(args, script):
    """--staging-sweep: pinloader staging against torch copy_ for thread counts 1..N; runs on
    the host backend (device "cpu") when CUDA is unavailable."""
    if args.rank_worker is not None:
        return rank_worker(args)
    import torch
    pl, err = common.import_pinloader()
    if pl is None:
        common.fail(f"pinloader import failed: {err}")
    cuda = torch.cuda.is_available() and pl.cuda_available() and args.device.startswith("cuda")
    device = args.device if cuda else "cpu"
    started = time.perf_counter()
    machine = common.machine_info(torch if cuda else None, args.device)
    budget = _cpu_budget(pl) or {}
    limit = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.sweep_threads or default_sweep_threads(limit)
    size = args.staging_bytes
    common.log(f"staging sweep on {device}: {common.format_size(size)} batches, threads {threads}, "
               f"budget {budget}")

    src = np.empty(size, dtype=np.uint8)
    src.view(np.uint64)[:] = 0x0123456789ABCDEF
    src_t = torch.from_numpy(src)
    try:
        dst = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        pinned = True
    except Exception as exc:
        common.log(f"pin_memory=True failed ({type(exc).__name__}); torch copy_ goes to a plain "
                   "tensor")
        dst = torch.empty(size, dtype=torch.uint8)
        pinned = False
    dst.fill_(1)
    dst_np = dst.numpy()

    pool = pl.PinnedPool(max_bytes=(args.depth + 3) * size)
    batches = args.sweep_batches
    # Warm the pool: its slabs are allocated and pinned here, once, as a process-wide pool's
    # would be by an earlier epoch.
    staging_rate(torch, pl, src, args.depth + 2, device, None, pool, args.depth)

    sweep = {}
    for t in threads:
        st, wall, tc, nc = [], [], [], []
        for _ in range(args.repeats):
            rec, e = common.guarded(staging_rate, torch, pl, src, batches, device, t, pool,
                                    args.depth)
            if e is None:
                st.append(rec["staging_gbps"])
                wall.append(rec["wall_gbps"])
            else:
                common.log(f"  threads={t}: {e['error']}")
            tc.append(torch_copy_rate(torch, dst, src_t, t, args.memcpy_iters)[0])
            nc.append(host_memcpy_gbps(dst_np, src, t, args.memcpy_iters)[0])
        sweep[str(t)] = {"staging": common.summarize(st), "wall": common.summarize(wall),
                         "torch": common.summarize(tc), "numpy": common.summarize(nc),
                         "staging_repeats": st, "torch_repeats": tc}
        common.log(f"  threads={t:3d}: pinloader staging {common.fmt_num(sweep[str(t)]['staging']['median'], 1)}"
                   f" (wall {common.fmt_num(sweep[str(t)]['wall']['median'], 1)})  torch copy_ "
                   f"{common.fmt_num(sweep[str(t)]['torch']['median'], 1)}  numpy "
                   f"{common.fmt_num(sweep[str(t)]['numpy']['median'], 1)} GB/s")

    default_threads = pl._C.default_staging_threads() if hasattr(pl._C, "default_staging_threads") else None
    dst_, dwall = [], []
    used = None
    for _ in range(args.repeats):
        rec = staging_rate(torch, pl, src, batches, device, None, pool, args.depth)
        used = rec["threads"]
        dst_.append(rec["staging_gbps"])
        dwall.append(rec["wall_gbps"])
    default = {"threads": used, "default_staging_threads": default_threads,
               "staging": common.summarize(dst_), "wall": common.summarize(dwall)}
    all_threads = torch.get_num_threads()
    ta = [torch_copy_rate(torch, dst, src_t, all_threads, args.memcpy_iters)[0]
          for _ in range(args.repeats)]
    torch_all = {"threads": all_threads, "summary": common.summarize(ta), "repeats": ta}
    best_pl = max((e["staging"]["median"] for e in sweep.values() if e["staging"]["median"]),
                  default=None)
    best_torch = max([e["torch"]["median"] for e in sweep.values() if e["torch"]["median"]]
                     + [torch_all["summary"]["median"]])
    ratios = {"default_over_torch_all": common.ratio(default["staging"]["median"],
                                                     torch_all["summary"]["median"]),
              "best_over_best_torch": common.ratio(best_pl, best_torch)}
    common.log(f"  default ({used} threads): staging {common.fmt_num(default['staging']['median'], 1)} GB/s; "
               f"torch all-thread ({all_threads}) copy_ {common.fmt_num(torch_all['summary']['median'], 1)} GB/s; "
               f"ratio {common.fmt_num(ratios['default_over_torch_all'], 3)}")
    pool.close()
    ranks = None
    if args.ranks > 1:
        ranks, rerr = common.guarded(ranks_run, args, script)
        ranks = ranks if rerr is None else rerr
        if "aggregate_gbps" in ranks:
            ratios["ranks_aggregate_over_torch_all"] = common.ratio(
                ranks["aggregate_gbps"], torch_all["summary"]["median"])
            common.log(f"  {args.ranks} ranks at once: aggregate {ranks['aggregate_gbps']:.1f} GB/s "
                       f"(start skew {ranks['start_skew_s'] * 1e3:.0f} ms); / torch all-thread "
                       f"{common.fmt_num(ratios['ranks_aggregate_over_torch_all'], 3)}")
        else:
            common.log(f"  ranks run failed: {ranks.get('errors') or ranks.get('error')}")
    payload = {
        "benchmark": "bandwidth_staging", "schema": 1, "machine": machine, "device": device,
        "ranks": ranks,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cpu_budget": budget, "pinned_destination": pinned, "threads": threads,
        "sweep": sweep, "default": default, "torch_all": torch_all, "ratios": ratios,
        "elapsed_s": time.perf_counter() - started,
    }
    name = args.name if args.name != "bandwidth" else "bandwidth_staging"
    common.publish_timed(args.out, name, payload, render_staging_markdown(payload))
    return 0
