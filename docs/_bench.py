"""Benchmark tables for the documentation, generated from the committed JSON results at build
time (docs/conf.py calls write_tables), so the pages cannot drift from the data. Every figure is
a median over the runs with the minimum–maximum in brackets, stated as a ratio to a physical
reference measured in the same run."""
from __future__ import annotations

import json
import statistics
from pathlib import Path


def _load(d: Path, name: str) -> dict:
    return json.loads((d / name).read_text(encoding="utf-8"))


def _vals(r: dict, key: str) -> list[float]:
    return [x[key] for x in r.get("repeats", []) if x.get(key) is not None]


def _ratio(vals: list[float], ref: float) -> str:
    if not vals or not ref:
        return "–"
    med, lo, hi = statistics.median(vals) / ref, min(vals) / ref, max(vals) / ref
    return f"{med:.3f}× ({lo:.2f}–{hi:.2f})"


def _abs(vals: list[float], fmt: str = "{:,.0f}") -> str:
    if not vals:
        return "–"
    return f"{fmt.format(statistics.median(vals))} ({fmt.format(min(vals))}–{fmt.format(max(vals))})"


def _table(header: list[str], rows: list[list[str]]) -> str:
    # class "numbers": a median and its range stay on one line (docs/_static/custom.css)
    out = [".. list-table::", "   :header-rows: 1", "   :class: numbers", ""]
    for row in [header] + rows:
        row = [c if "``" in c else c.replace("`", "``") for c in row]  # Markdown code to RST
        out.append("   * - " + row[0])
        out += [f"     - {c}" for c in row[1:]]
    return "\n".join(out) + "\n"


def _machine(payload: dict) -> str:
    m = payload.get("machine", {})
    return (f"{m.get('gpu', {}).get('name', '?')}, {m.get('cpu_count', '?')}-CPU host, "
            f"torch {m.get('versions', {}).get('torch', '?')}")


def overlap(d: Path) -> str:
    p = _load(d, "overlap_collated.json")
    copy = p["pinned_copy"]
    lvl = p["compute_levels"][0]
    parts = [f"Measured on {_machine(p)}; one pinned copy of the 77 MB batch: "
             f"{copy['ms']['median']:.2f} ms ({copy['gbps']:.1f} GB/s); compute "
             f"{lvl['calibrated_ms']:.2f} ms per step; {p['config']['steps']} measured steps, "
             f"{p['config']['repeats']} runs.\n"]
    for loop, title in (("reused", "Prefetcher made once (reused)"),
                        ("per_epoch", "Loader made anew every epoch (every 60 steps)")):
        res = {r["row"]: r for r in p["results"] if r["loop"] == loop}
        gpu = statistics.median(_vals(res["on_gpu"], "samples_per_s"))
        dma = statistics.median(_vals(res["pinloader_pinned"], "samples_per_s"))
        rows = [[r["label"], _abs(_vals(r, "samples_per_s")),
                 _ratio(_vals(r, "samples_per_s"), gpu), _ratio(_vals(r, "samples_per_s"), dma)]
                for r in res.values()]
        parts.append(f"**{title}** (on-GPU bound {gpu:,.0f} samples/s)\n")
        parts.append(_table(["loading", "samples/s", "÷ data already on the GPU",
                             "÷ one DMA from resident pinned memory"], rows))
    return "\n".join(parts)


def array_loader(d: Path) -> str:
    p = _load(d, "array_loader.json")
    labels = {"arrayloader": "``pinloader.ArrayLoader``",
              "dataloader": "DataLoader, 8 workers, ``pin_memory``, persistent",
              "pinloader_dl": "``pinloader.torch.prefetch`` over that DataLoader",
              "on_gpu": "data already on the GPU"}
    parts = [f"Measured on {_machine(p)}; images held in RAM, shuffled, batch "
             f"{p['config']['batch_size']}, {p['config']['repeats']} runs.\n"]
    for spec in dict.fromkeys(r["level"]["spec"] for r in p["images"]):
        res = {r["row"]: r for r in p["images"] if r["level"]["spec"] == spec}
        gpu = statistics.median(_vals(res["on_gpu"], "samples_per_s"))
        rows = [[labels.get(k, k), _abs(_vals(r, "samples_per_s")),
                 _ratio(_vals(r, "samples_per_s"), gpu)] for k, r in res.items()]
        parts.append(f"**Compute {spec}**\n")
        parts.append(_table(["loading", "samples/s", "÷ data already on the GPU"], rows))
    w = p.get("windows")
    if w:
        a = [x["host_ms_per_batch"] for x in w["arrayloader"]]
        b = [x["host_ms_per_batch"] for x in w["stack_loop"]]
        ref = statistics.median(b)
        parts.append(f"**Token windows** {w['batch']} × {w['window']} from a "
                     f"{w['bytes'] / 1e9:.2f} GB uint16 memmap, host time per batch:\n")
        parts.append(_table(["loading", "ms per batch", "÷ the torch.stack loop"], [
            ["``ArrayLoader(tokens, 64, windows=1025)``", _abs(a, "{:.3f}"), _ratio(a, ref)],
            ["``torch.stack(...).pin_memory().to()``", _abs(b, "{:.3f}"), _ratio(b, ref)]]))
    return "\n".join(parts)


def staging(d: Path) -> str:
    rows = []
    for name in ("bandwidth_staging.json", "bandwidth_staging_ranks.json"):
        p = _load(d, name)
        dflt, tall = p["default"], p["torch_all"]
        ref = tall["summary"]["median"]
        st = [x for x in (dflt["staging"]["min"], dflt["staging"]["median"], dflt["staging"]["max"])]
        rows.append([_machine(p), f"{dflt['threads']}",
                     f"{st[1]:.1f} ({st[0]:.1f}–{st[2]:.1f})",
                     f"{ref:.1f} ({tall['summary']['min']:.1f}–{tall['summary']['max']:.1f})",
                     f"{st[1] / ref:.2f}× ({st[0] / ref:.2f}–{st[2] / ref:.2f})"])
        ranks = p.get("ranks")
        if isinstance(ranks, dict) and ranks.get("aggregate_gbps"):
            agg = ranks["aggregate_gbps"]
            rows.append([f"same host, {ranks['ranks']} ranks staging at once", "each its share",
                         f"{agg:.1f} together (one run)", f"{ref:.1f}", f"{agg / ref:.2f}×"])
    return ("256 MiB pageable batches staged into pinned memory; the reference is torch's own "
            "all-thread ``copy_`` into a pinned tensor, measured in the same run (GB/s, "
            "median of 3 runs, min–max in brackets).\n\n" +
            _table(["machine", "pinloader threads", "pinloader staging GB/s",
                    "torch ``copy_`` GB/s", "ratio"], rows))


def overhead(d: Path) -> str:
    p = _load(d, "overhead.json")
    res = p["results"]["32x4KiB"]["methods"]
    ref = res["dl_pin_thread"]["summary"]["median"]
    labels = {"pinloader_torch": "``pinloader.torch.prefetch`` (torch tensors out)",
              "pinloader_dlpack": "``AsyncPrefetcher`` + ``torch.from_dlpack`` per leaf",
              "pinloader_raw": "``AsyncPrefetcher``, leaves not converted",
              "dl_pin_thread": "DataLoader, 2 workers, pin thread",
              "dl_pin_inline": "DataLoader, no workers, pinned inline",
              "blocking_to": "blocking ``.to()`` per tensor"}
    rows = []
    for m, r in res.items():
        s = r["summary"]
        rows.append([labels.get(m, m), f"{s['median']:,.0f} ({s['min']:,.0f}–{s['max']:,.0f})",
                     f"{s['median'] / ref:.3f}×"])
    return (f"Measured on {_machine(p)}: a dict of 32 float32 arrays of 4 KiB per batch; host "
            "time per batch in µs (median of 3 runs, min–max), and as a ratio to the DataLoader "
            "pin thread.\n\n" + _table(["method", "µs per batch", "÷ DataLoader pin thread"], rows))


def write_tables(results: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, fn in (("overlap", overlap), ("array_loader", array_loader), ("staging", staging),
                     ("overhead", overhead)):
        text = fn(results)
        path = out / f"bench_{name}.rst"
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
