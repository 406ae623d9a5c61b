#!/usr/bin/env python3
"""Draw PNG charts from the benchmark JSON files.

Reads every *.json in the results directory (or the files named on the command line), picks
the ones written by bench_overlap.py, bench_bandwidth.py (full run and --staging-sweep),
bench_overhead.py and bench_array_loader.py by their "benchmark" field (or, for
bench_array_loader.py, by its "images"/"windows" results), and writes next to them (or into --out):
  <stem>[_<source>].png  overlap: samples/s per row as a ratio to data already on the GPU in the
                         same run, one panel per loop mode and compute level
  <stem>.png             array_loader: the same ratios for the ArrayLoader and its peers (log
                         scale), and token-window host time as a ratio to the torch.stack loop
  <stem>.png             bandwidth_staging: staging GB/s against threads beside torch's copy_
                         and np.copyto from the same run
  <stem>.png             bandwidth: GB/s against size per method; staging and memcpy by threads
  <stem>.png             overhead: µs per batch per method, one group per batch kind
  <stem>.png             device_memory: the device pool's growth per window of batches
Every chart names the machine it was measured on. Bars and points are medians over repeats;
whiskers, bands and bracketed ranges span min to max; value labels sit beyond the whiskers.
Needs matplotlib only (no torch, no GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

plt = None  # matplotlib.pyplot, imported by main()


def _med_err(summary):
    """(median, [[below], [above]]) for an error bar, or (nan, zeros) if no values."""
    if not summary or not summary.get("n"):
        return math.nan, (0.0, 0.0)
    med = summary["median"]
    return med, (max(0.0, med - summary["min"]), max(0.0, summary["max"] - med))


def _machine(payload):
    """'NVIDIA H200, 16-CPU host' from the result's machine description."""
    m = payload.get("machine", {})
    gpu = m.get("gpu", {}).get("name") or "no GPU"
    cpus = m.get("cpu_count")
    return f"{gpu}, {cpus}-CPU host" if cpus else gpu


def _title(payload, what):
    return f"{what} — measured on {_machine(payload)}"


def _short(label):
    return label.replace("`", "")


def _ratio_summary(values, ref):
    """median/min/max of values divided by the reference median (nan when missing)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals or not ref:
        return math.nan, math.nan, math.nan
    return (common.summarize(vals)["median"] / ref, min(vals) / ref, max(vals) / ref)


def _ratio_bars(ax, names, triples, colors, ref_name, log=False):
    """Horizontal bars of ratios (median, min, max) with whiskers over the range and each value
    written right of its whisker, so labels never sit on a bar end or an error bar."""
    y = list(range(len(names)))
    meds = [0 if math.isnan(m) else m for m, _, _ in triples]
    lo = [0 if math.isnan(m) else m - a for m, a, _ in triples]
    hi = [0 if math.isnan(m) else b - m for m, _, b in triples]
    ax.barh(y, meds, xerr=[lo, hi], color=colors, capsize=3, height=0.6,
            error_kw={"elinewidth": 1, "ecolor": "black"})
    top = max([b for _, _, b in triples if not math.isnan(b)] or [1.0])
    for yi, (m, a, b) in zip(y, triples):
        if math.isnan(m):
            ax.text(0.01 if log else 0, yi, "  not run in this benchmark", va="center", fontsize=8, color="tab:gray")
            continue
        rng = f" ({a:.2f}–{b:.2f})" if b - a >= 0.005 else ""
        txt = f"{m:.3f}×{rng}" if m >= 0.1 else f"{m:.3f}×{rng}"
        ax.text(b * (1.08 if log else 1) + (0 if log else top * 0.015), yi, txt, va="center",
                fontsize=8)
    ax.axvline(1.0, color="black", lw=0.8, ls=":")
    ax.set_yticks(y)
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
        lows = [a for _, a, _ in triples if not math.isnan(a) and a > 0]
        ax.set_xlim(min(lows + [0.5]) * 0.5, top * 6)
        from matplotlib.ticker import FuncFormatter, LogLocator
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    else:
        ax.set_xlim(0, top * 1.45)
    ax.set_xlabel(f"ratio to {ref_name} (median; whiskers and brackets: min–max of the runs)",
                  fontsize=8)
    ax.grid(axis="x", alpha=0.3)


def _color(row):
    return ("tab:green" if row.startswith(("pinloader", "arrayloader"))
            else "tab:gray" if row == "on_gpu" else "tab:blue")


def _stem_with(stem, suffix):
    return stem if stem.endswith("_" + suffix) or stem == suffix else f"{stem}_{suffix}"


def plot_overlap(payload, stem, out_dir):
    """samples/s of every row as a ratio to data already on the GPU in the same run (same
    source, compute level and loop), one panel per loop; the absolute figures go in the
    subtitle so that each ratio can be turned back into samples/s."""
    paths = []
    levels = payload["compute_levels"]
    copy_ms = payload.get("pinned_copy", {}).get("ms", {}).get("median")
    for source in payload["sources"]:
        res = [r for r in payload["results"] if r["source"] == source]
        loops = list(dict.fromkeys(r.get("loop") for r in res))
        panels = [(lvl, loop) for lvl in levels for loop in loops]
        rows = list(dict.fromkeys(r["row"] for r in res))
        fig, axes = plt.subplots(len(panels), 1, figsize=(11, 0.42 * len(rows) * len(panels) + 2.2),
                                 squeeze=False)
        for ax, (lvl, loop) in zip(axes[:, 0], panels):
            by_row = {r["row"]: r for r in res if r["level"] == lvl["level"] and r.get("loop") == loop}
            ref = by_row.get("on_gpu")
            ref_med = (ref or {}).get("summary", {}).get("samples_per_s", {}).get("median")
            names, triples, colors = [], [], []
            for row in rows:
                r = by_row.get(row)
                names.append(_short(r["label"]) if r else row)
                vals = [x.get("samples_per_s") for x in (r or {}).get("repeats", [])]
                triples.append(_ratio_summary(vals, ref_med))
                colors.append(_color(row))
            _ratio_bars(ax, names, triples, colors, "data already on the GPU")
            loop_txt = {"reused": "prefetcher made once (reused)",
                        "per_epoch": "loader made anew every epoch"}.get(loop, loop or "")
            ax.set_title(f"{loop_txt}; compute {lvl.get('calibrated_ms', lvl['target_ms']):.2f} ms/step; "
                         f"on-GPU bound {ref_med:,.0f} samples/s" if ref_med else loop_txt, fontsize=9)
        sub = f"one pinned copy of a batch: {copy_ms:.2f} ms" if copy_ms else ""
        fig.suptitle(_title(payload, f"Training-loop throughput, source: {source}") +
                     (f"\n{sub}; medians of {payload['config'].get('repeats', '?')} runs"
                      if sub else ""), fontsize=10)
        fig.tight_layout()
        path = Path(out_dir) / f"{_stem_with(stem, source)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


ARRAY_LABELS = {"arrayloader": "pinloader.ArrayLoader", "dataloader":
                "DataLoader (8 workers, pin_memory)", "pinloader_dl": "pinloader over that DataLoader",
                "on_gpu": "data already on the GPU"}


def plot_array_loader(payload, stem, out_dir):
    """ArrayLoader against its peers: samples/s as a ratio to data already on the GPU at the
    same compute level (log scale: the DataLoader rows are 20× slower), and the token-window
    host time per batch."""
    images = payload.get("images") or []
    levels = list(dict.fromkeys(r["level"]["spec"] for r in images))
    windows = payload.get("windows")
    n = len(levels) + (1 if windows else 0)
    if n == 0:
        raise ValueError("no images or windows results")
    fig, axes = plt.subplots(n, 1, figsize=(11, 2.1 * n + 1.5), squeeze=False)
    for ax, spec in zip(axes[:, 0], levels):
        by_row = {r["row"]: r for r in images if r["level"]["spec"] == spec}
        ref = by_row.get("on_gpu", {}).get("summary", {}).get("samples_per_s", {}).get("median")
        names, triples, colors = [], [], []
        for row, r in by_row.items():
            names.append(ARRAY_LABELS.get(row, row))
            triples.append(_ratio_summary([x.get("samples_per_s") for x in r.get("repeats", [])], ref))
            colors.append(_color(row))
        _ratio_bars(ax, names, triples, colors, "data already on the GPU", log=True)
        lvl = next(iter(by_row.values()))["level"]
        ax.set_title(f"images in RAM, shuffled, batch {payload['config'].get('batch_size')}: "
                     f"compute {spec} ({lvl.get('measured_ms', 0):.2f} ms measured); on-GPU bound "
                     f"{ref:,.0f} samples/s" if ref else spec, fontsize=9)
    if windows:
        ax = axes[-1][0]
        a = windows["arrayloader_summary"]["host_ms_per_batch"]
        b = windows["stack_loop_summary"]["host_ms_per_batch"]
        ref = b["median"]
        triples = [(a["median"] / ref, a["min"] / ref, a["max"] / ref),
                   (1.0, b["min"] / ref, b["max"] / ref)]
        _ratio_bars(ax, ["pinloader.ArrayLoader(windows=...)", "torch.stack(...).pin_memory().to()"],
                    triples, ["tab:green", "tab:blue"], "the torch.stack loop's host time", log=True)
        ax.set_title(f"token windows {windows['batch']} × {windows['window']} from a "
                     f"{windows['bytes'] / 1e9:.2f} GB uint16 memmap: host time per batch "
                     f"{a['median']:.3f} ms vs {b['median']:.3f} ms (lower is better)", fontsize=9)
    fig.suptitle(_title(payload, "ArrayLoader") + f"\nmedians of {payload['config'].get('repeats', '?')} runs",
                 fontsize=10)
    fig.tight_layout()
    path = Path(out_dir) / f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_bandwidth_staging(payload, stem, out_dir):
    """Staging GB/s against threads: pinloader's stager, the consumer's wall rate, torch's
    copy_ into pinned memory and np.copyto, all measured in the same run on the same host."""
    threads = [int(t) for t in payload["threads"]]
    sweep = payload["sweep"]
    fig, ax = plt.subplots(figsize=(10, 5.2))
    series = (("staging", "pinloader staging (stager's own time)", "-o", "tab:green"),
              ("wall", "pinloader end to end (consumer's wall time)", "-s", "tab:olive"),
              ("torch", "torch copy_ into pinned memory", "--^", "tab:blue"),
              ("numpy", "np.copyto over T threads", "--v", "tab:purple"))
    top = 0.0
    for key, label, style, color in series:
        meds, los, his = [], [], []
        for t in threads:
            sm = sweep.get(str(t), {}).get(key) or {}
            ok = sm.get("n")
            meds.append(sm["median"] if ok else math.nan)
            los.append(sm["min"] if ok else math.nan)
            his.append(sm["max"] if ok else math.nan)
            if ok:
                top = max(top, sm["max"])
        ax.plot(threads, meds, style, color=color, label=label, markersize=5)
        ax.fill_between(threads, los, his, color=color, alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set_xticks(threads)
    ax.set_xticklabels([str(t) for t in threads])
    ax.set_ylim(0, top * 1.15 if top else 1)
    ax.set_xlabel("threads")
    ax.set_ylabel("GB/s (1e9 bytes/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    cfg = payload["config"]
    rt = payload.get("ratios", {})
    d = payload.get("default", {})
    ta = payload.get("torch_all", {})
    note = (f"default {d.get('threads')} threads: {common.fmt_num(d.get('staging', {}).get('median'), 1)} GB/s "
            f"= {common.fmt_num(rt.get('default_over_torch_all'), 2)}× torch's all-thread copy_ "
            f"({common.fmt_num(ta.get('summary', {}).get('median'), 1)} GB/s, {ta.get('threads')} threads)")
    ranks = payload.get("ranks")
    if isinstance(ranks, dict) and ranks.get("aggregate_gbps"):
        note += (f"; {ranks.get('ranks')} ranks at once: {ranks['aggregate_gbps']:.1f} GB/s "
                 f"together = {common.fmt_num(rt.get('ranks_aggregate_over_torch_all'), 2)}×")
    fig.suptitle(_title(payload, f"Staging {common.format_size(cfg['staging_bytes'])} pageable "
                                 f"batches into pinned memory") + "\n" + note, fontsize=9)
    fig.tight_layout()
    path = Path(out_dir) / f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_bandwidth(payload, stem, out_dir):
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    methods = payload["config"]["methods"]
    labels = {"pageable_to": "pageable .to()", "pinned_copy": "torch pinned copy_",
              "raw_memcpy": "raw cudaMemcpyAsync", "pinloader_pinned": "pinloader pinned src",
              "pinloader_pageable": "pinloader pageable src"}
    sizes = [p["bytes"] for p in payload["sizes"]]
    top = 0.0
    for m in methods:
        meds, los, his = [], [], []
        for p in payload["sizes"]:
            s = p["methods"][m]["summary"]
            ok = s.get("n") and not p["methods"][m].get("implausible")
            if ok:
                top = max(top, s["max"])
            meds.append(s["median"] if ok else math.nan)
            los.append(s["min"] if ok else math.nan)
            his.append(s["max"] if ok else math.nan)
        style = "-o" if m.startswith("pinloader") else "--o"
        line, = ax.plot(sizes, meds, style, label=labels.get(m, m), markersize=4)
        ax.fill_between(sizes, los, his, color=line.get_color(), alpha=0.15)
    if top > 0:
        ax.set_ylim(0, 1.1 * top)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([common.format_size(s).replace(" ", "") for s in sizes], fontsize=8)
    ax.set_xlabel("transfer size")
    ax.set_ylabel("GB/s")
    ax.set_title("Host to device")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

    threads = sorted({int(t) for t in payload["staging"]} | {int(t) for t in payload["memcpy"]})
    width = 0.27
    series = [("pinloader pageable → device", lambda t: payload["staging"].get(str(t), {}).get("summary")),
              ("pinloader staging (stats)", lambda t: payload["staging"].get(str(t), {}).get("staging_summary")),
              ("host memcpy", lambda t: payload["memcpy"].get(str(t), {}).get("summary"))]
    for i, (name, get) in enumerate(series):
        meds, errs = [], [[], []]
        for t in threads:
            med, (lo, hi) = _med_err(get(t))
            meds.append(0 if math.isnan(med) else med)
            errs[0].append(lo)
            errs[1].append(hi)
        xs = [j + (i - 1) * width for j in range(len(threads))]
        ax2.bar(xs, meds, width, yerr=errs, capsize=3, label=name)
    ax2.set_xticks(range(len(threads)))
    ax2.set_xticklabels([str(t) for t in threads])
    ax2.set_xlabel("threads")
    ax2.set_ylabel("GB/s")
    cfg = payload["config"]
    ax2.set_title(f"Staging {common.format_size(cfg['staging_bytes'])}, "
                  f"memcpy {common.format_size(cfg['memcpy_bytes'])}")
    ax2.grid(axis="y", alpha=0.3)
    ax2.legend(fontsize=8)
    rt = payload.get("ratios", {})
    note = (f"pinned/raw {common.fmt_num(rt.get('pinned_over_raw'), 3)} (≥ 0.95)   "
            f"pageable/memcpy {common.fmt_num(rt.get('pageable_over_memcpy'), 3)} (≥ 0.85)")
    fig.suptitle(_title(payload, "Bandwidth") + "\n" + note, fontsize=11)
    fig.tight_layout()
    path = Path(out_dir) / f"{stem}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def plot_overhead(payload, stem, out_dir):
    kinds = list(payload["results"])
    methods = payload["config"]["methods"]
    fig, axes = plt.subplots(1, len(kinds), figsize=(max(9.5, 6.5 * len(kinds)), 5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        res = payload["results"][kind]["methods"]
        meds, errs, colors = [], [[], []], []
        for m in methods:
            med, (lo, hi) = _med_err(res[m]["summary"])
            meds.append(med)
            errs[0].append(lo)
            errs[1].append(hi)
            colors.append("tab:green" if m.startswith("pinloader") else "tab:blue")
        xs = list(range(len(methods)))
        ax.bar(xs, [0 if math.isnan(m) else m for m in meds], yerr=errs, capsize=3, color=colors)
        for x, med, up in zip(xs, meds, errs[1]):
            # above the whisker's top, so the label never sits on the error bar
            ax.text(x, (med + up) * 1.08 if not math.isnan(med) else 1, "error" if math.isnan(med)
                    else f"{med:,.0f}", ha="center", va="bottom", fontsize=8)
        if any(not math.isnan(m) and m > 0 for m in meds):
            ax.set_yscale("log")
            tops = [m + u for m, u in zip(meds, errs[1]) if not math.isnan(m)]
            ax.set_ylim(top=max(tops) * 3)
        ax.set_xticks(xs)
        ax.set_xticklabels([m.replace("_", "\n", 1) for m in methods], fontsize=8)
        ax.set_ylabel("µs per batch (log)")
        rt = payload["results"][kind].get("ratio_pin_thread_over_pinloader")
        ri = payload["results"][kind].get("ratio_pin_inline_over_pinloader")
        ax.set_title(f"{kind}: vs pinloader_dlpack, pin thread {common.fmt_num(rt, 1)}× "
                     f"(target ≥ 8×), inline pin {common.fmt_num(ri, 1)}×", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(_title(payload, "Host cost per batch of small leaves"))
    fig.tight_layout()
    path = Path(out_dir) / f"{stem}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def _save(fig, out_dir, stem):
    fig.tight_layout()
    path = Path(out_dir) / f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _triple(summary):
    if not summary or not summary.get("n"):
        return math.nan, math.nan, math.nan
    return summary["median"], summary["min"], summary["max"]


def _round_ratios(runs, ref_runs, key):
    """Per-round ratios of runs[i][key] to ref_runs[i][key] (rounds are interleaved)."""
    return common.summarize(r[key] / b[key] for r, b in zip(runs, ref_runs) if b.get(key))


GATHER_LABELS = {"host_gather": 'ArrayLoader(gather="host")', "device_gather": 'ArrayLoader(gather="device")',
                 "auto": "ArrayLoader() (auto)", "torch_index": "torch index_select + copy",
                 "numpy_index": "NumPy take + copy (one thread)",
                 "dma_ceiling": "one DMA from resident pinned memory"}


def plot_gather(payload, stem, out_dir):
    """bench_gather.py: each path's GB/s as a ratio to one DMA of the same bytes, per row size."""
    rows = payload["rows"]
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 1.9 * len(rows) + 1.2), squeeze=False)
    for ax, (row, rec) in zip(axes[:, 0], rows.items()):
        runs = rec["runs"]
        ref = runs.get("dma_ceiling")
        names, triples, colors = [], [], []
        for path, rs in runs.items():
            names.append(GATHER_LABELS.get(path, path))
            triples.append(_triple(_round_ratios(rs, ref, "gbps")) if ref else (math.nan,) * 3)
            colors.append("tab:gray" if path == "dma_ceiling" else
                          "tab:green" if path in ("device_gather", "auto", "host_gather") else "tab:blue")
        _ratio_bars(ax, names, triples, colors, "one DMA of the same bytes (same round)")
        ax.set_title(f"rows of {int(row):,} B x {rec['batch']:,} per batch, loader-bound", fontsize=9)
    fig.suptitle(_title(payload, "Random rows to the GPU") + "\nmedians of interleaved rounds", fontsize=10)
    return _save(fig, out_dir, stem)


def plot_models(payload, stem, out_dir):
    """bench_models.py: each feed's images/s as a ratio to data already on the GPU, per model."""
    models = payload["models"]
    labels = payload.get("row_labels", {})
    fig, axes = plt.subplots(len(models), 1, figsize=(11, 2.3 * len(models) + 1.2), squeeze=False)
    for ax, (name, rec) in zip(axes[:, 0], models.items()):
        names, triples, colors = [], [], []
        for row, r in rec["rows"].items():
            names.append(_short(labels.get(row, row)))
            triples.append(_triple(r.get("ratio_to_on_gpu")))
            colors.append(_color(row))
        _ratio_bars(ax, names, triples, colors, "data already on the GPU (same round)")
        ax.set_title(f"{name}, batch {rec.get('batch')}", fontsize=9)
    fig.suptitle(_title(payload, "Real models, every feed") + "\nmedians of interleaved rounds", fontsize=10)
    return _save(fig, out_dir, stem)


def plot_static(payload, stem, out_dir):
    """bench_static.py: a captured step fed several ways, as a ratio to data on the GPU."""
    rows = payload["rows"]
    ref = rows["graph_on_gpu"]
    names, triples, colors = [], [], []
    for row, rs in rows.items():
        names.append(row)
        triples.append(_triple(_round_ratios(rs, ref, "images_per_s")))
        colors.append("tab:gray" if row == "graph_on_gpu" else "tab:green" if row == "graph_static" else "tab:blue")
    fig, ax = plt.subplots(figsize=(11, 3.2))
    _ratio_bars(ax, names, triples, colors, "the captured step fed from data on the GPU (same round)")
    fig.suptitle(_title(payload, "ResNet-18 step in a CUDA graph") + "\nmedians of interleaved rounds",
                 fontsize=10)
    return _save(fig, out_dir, stem)


def plot_gather_kernel(payload, stem, out_dir):
    """bench_gather_kernel.py: the kernel alone against one DMA, per row size and launch."""
    runs = payload["runs"]
    names = [f"{r['row']:,} B rows{', ' + r['order'] if 'order' in r else ''}, UNROLL {r['unroll']}, "
             + (f"{r['blocks_per_sm']} blocks/SM" if "blocks_per_sm" in r else f"at most {r['blocks']} blocks")
             for r in runs]
    triples = [(r["gbps"] / r["dma_gbps"], min(r["runs_gbps"]) / r["dma_gbps"],
                max(r["runs_gbps"]) / r["dma_gbps"]) for r in runs]
    fig, ax = plt.subplots(figsize=(11, 0.28 * len(runs) + 1.6))
    _ratio_bars(ax, names, triples, ["tab:green"] * len(runs), "one DMA of the same bytes")
    fig.suptitle(_title(payload, "The gather kernel alone"), fontsize=10)
    return _save(fig, out_dir, stem)


def plot_device_memory(payload, stem, out_dir):
    """bench_device_memory.py: pinloader's device pool growth at each window's end, per gather."""
    fig, ax = plt.subplots(figsize=(11, 3.6))
    args = payload.get("args", {})
    for gather, windows in payload["runs"].items():
        xs = [w["window"] for w in windows]
        ax.plot(xs, [w["pool_mib"] / 1024 for w in windows], marker="o",
                label=f'ArrayLoader(gather="{gather}")')
        synced = [w for w in windows if w["end"] != "event"]
        ax.scatter([w["window"] for w in synced], [w["pool_mib"] / 1024 for w in synced], s=90,
                   facecolors="none", edgecolors="black")
    ax.set_xlabel(f"window of {args.get('batches', '?')} loader-bound batches "
                  "(circled: ends with torch.cuda.synchronize(), else an event)")
    ax.set_ylabel("device pool growth (GiB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(_title(payload, "Device memory in a loop that never synchronises the device"),
                 fontsize=10)
    return _save(fig, out_dir, stem)


PLOTTERS = {"device_memory": plot_device_memory, "overlap": plot_overlap, "bandwidth": plot_bandwidth, "overhead": plot_overhead,
            "bandwidth_staging": plot_bandwidth_staging, "array_loader": plot_array_loader,
            "gather": plot_gather, "models": plot_models, "static": plot_static,
            "gather_kernel": plot_gather_kernel}


def kind_of(payload):
    """The benchmark that wrote payload: its "benchmark" field, or for the scripts whose JSON
    has none (bench_array_loader, bench_gather, bench_static, bench_gather_kernel) the shape of
    their results; None for anything else."""
    if not isinstance(payload, dict):
        return None
    kind = payload.get("benchmark")
    if kind is None and ("images" in payload or "windows" in payload) and "config" in payload:
        kind = "array_loader"
    rows = payload.get("rows")
    if kind is None and isinstance(rows, dict) and rows:
        first = next(iter(rows.values()))
        if "graph_on_gpu" in rows:
            kind = "static"
        elif isinstance(first, dict) and "runs" in first and "batch" in first:
            kind = "gather"
    if kind is None and isinstance(payload.get("runs"), list) and payload["runs"] and \
            ("blocks_per_sm" in payload["runs"][0] or "blocks" in payload["runs"][0]):
        kind = "gather_kernel"
    return kind if kind in PLOTTERS else None


def main(argv=None):
    global plt
    p = argparse.ArgumentParser(description="Charts (PNG) from benchmark JSON results.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("files", nargs="*", type=Path,
                   help="JSON files to draw (default: every *.json in --results)")
    p.add_argument("--results", type=Path, default=common.DEFAULT_OUT,
                   help="directory to read (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for the PNGs (default: next to each JSON file)")
    args = p.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except Exception as exc:
        common.fail(f"matplotlib is needed to draw charts: {exc}", code=2)
    plt = pyplot

    files = args.files or sorted(args.results.glob("*.json"))
    if not files:
        common.fail(f"no JSON results in {args.results}", code=1)
    written, failed = [], 0
    for f in files:
        try:
            payload = json.loads(Path(f).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            common.log(f"skip {f}: {exc}")
            continue
        kind = kind_of(payload)
        if kind is None:
            common.log(f"skip {f}: not a benchmark result")
            continue
        out_dir = args.out or Path(f).parent
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            written += PLOTTERS[kind](payload, Path(f).stem, out_dir)
        except Exception as exc:
            failed += 1
            common.log(f"failed to draw {f}: {type(exc).__name__}: {exc}")
    for path in written:
        print(path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
