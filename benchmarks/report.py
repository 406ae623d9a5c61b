#!/usr/bin/env python3
"""Draw PNG charts from the benchmark JSON files.

Reads every *.json in the results directory (or the files named on the command line), picks
the ones written by bench_overlap.py, bench_bandwidth.py and bench_overhead.py by their
"benchmark" field, and writes next to them (or into --out):
  <stem>_<source>.png  overlap: samples/s and GPU idle % per row, one panel per compute level
  <stem>.png           bandwidth: GB/s against size per method; staging and memcpy by threads
  <stem>.png           overhead: µs per batch per method, one group per batch kind
Bars and points are medians over repeats; whiskers and bands span min to max.
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


def _title(payload, what):
    gpu = payload.get("machine", {}).get("gpu", {}).get("name", "?")
    return f"{what} — {gpu}"


def _short(label):
    return label.replace("`", "")


def plot_overlap(payload, stem, out_dir):
    paths = []
    levels = payload["compute_levels"]
    for source in payload["sources"]:
        res = [r for r in payload["results"] if r["source"] == source]
        loops = {r.get("loop") for r in res}

        def key(r):
            return (r["row"], r.get("loop"))

        rows = []
        for r in res:
            if key(r) not in rows:
                rows.append(key(r))
        labels = {key(r): _short(r["label"]) + (f" [{r['loop']}]" if len(loops) > 1 else "")
                  for r in res}
        fig, axes = plt.subplots(2, len(levels), figsize=(5.5 * len(levels) + 2.5, 8.5),
                                 squeeze=False, sharey="row")
        for col, lvl in enumerate(levels):
            by_row = {key(r): r for r in res if r["level"] == lvl["level"]}
            only = common.summarize(lvl.get("compute_only_ms", []))["median"]
            for line, metric, ylabel in ((0, "samples_per_s", "samples/s"),
                                         (1, "idle_pct", "GPU idle (%)")):
                ax = axes[line][col]
                meds, errs, colors = [], [[], []], []
                for row in rows:
                    r = by_row.get(row)
                    s = r.get("summary", {}).get(metric) if r else None
                    med, (lo, hi) = _med_err(s)
                    meds.append(med)
                    errs[0].append(lo)
                    errs[1].append(hi)
                    colors.append("tab:green" if row[0].startswith("pinloader")
                                  else "tab:gray" if row[0] == "on_gpu" else "tab:blue")
                y = list(range(len(rows)))
                ax.barh(y, [0 if math.isnan(m) else m for m in meds], xerr=errs,
                        color=colors, capsize=3)
                for yi, (row, med) in enumerate(zip(rows, meds)):
                    r = by_row.get(row)
                    if math.isnan(med):
                        status = r.get("status", "missing") if r else "missing"
                        ax.text(0, yi, f"  {status}", va="center", fontsize=8, color="tab:red")
                    else:
                        ax.text(med, yi, f" {med:,.0f}" if line == 0 else f" {med:.1f}",
                                va="center", fontsize=8)
                ax.set_yticks(y)
                ax.set_yticklabels([labels[r] for r in rows], fontsize=8)
                ax.invert_yaxis()
                ax.set_xlabel(ylabel)
                ax.grid(axis="x", alpha=0.3)
                if line == 0:
                    ax.set_title(f"compute {lvl['target_ms']:.1f} ms (measured "
                                 f"{only if only is not None else float('nan'):.2f} ms)")
                if line == 1:
                    ax.set_xlim(left=min(0, ax.get_xlim()[0]))
        fig.suptitle(_title(payload, f"Copy/compute overlap, source: {source}"))
        fig.tight_layout()
        path = Path(out_dir) / f"{stem}_{source}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


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
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 5), squeeze=False)
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
        for x, med in zip(xs, meds):
            ax.text(x, med if not math.isnan(med) else 1, "error" if math.isnan(med)
                    else f"{med:,.0f}", ha="center", va="bottom", fontsize=8)
        if any(not math.isnan(m) and m > 0 for m in meds):
            ax.set_yscale("log")
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


PLOTTERS = {"overlap": plot_overlap, "bandwidth": plot_bandwidth, "overhead": plot_overhead}


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
        kind = payload.get("benchmark") if isinstance(payload, dict) else None
        if kind not in PLOTTERS:
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
