#!/usr/bin/env python3
"""How long the next epoch's order takes to be made while the training loop runs (Note [orders
made ahead] in pinloader/_epoch_plan.py): host only, no GPU needed.

A loader makes the order of epoch e + 1 while epoch e runs; when an epoch is shorter than that
(64-byte rows: 64 batches of 0.3 ms on an H200 against a permutation of 4 million items), each
epoch's first batch waits for it. Rows, interleaved over --rounds rounds, each the time from the
job's start until its order is there (ms, median and range):

  python_thread  what the loader did before OrderJob: a Python thread calling
                 pinloader._C.permutation, which fills a freshly allocated table
  job_fresh      pinloader._C.OrderJob, a C thread that never takes the GIL, fresh blocks
  job_reuse      the same with the loader's EpochTables: the block of the order before last
                 (what a run of epochs does; Note [epoch table reuse] in src/py/epoch_table.c)

each with the main thread --main:
  idle  waiting for it (join() / result())
  busy  spinning in Python until the order is there, holding the GIL but at the interpreter's
        switch interval, as a training loop's Python does between its C calls

--items is the items of the order (default 4,194,304: 64-byte rows over 256 MiB, the user
loop's smallest rows in bench_user_loop.py).

Then (--loader-epochs, 0 to leave out) a loader whose epochs are shorter than its order takes:
rank 0 of --world ranks of an ArrayLoader over --items 64-byte rows on the host backend, batch
65,536, drop_last: each epoch gathers 1/world of the rows while its order job permutes them all.
Rows, interleaved: the loader with orders made one epoch ahead (_AHEAD_MAX = 1) and as it is
(two ahead once an epoch waited: Note [orders made ahead]); batches/s over the epochs and the
wall time of each epoch's first next() (median over the epochs after the first five).
--smoke runs tiny sizes (CI runs it).
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ROWS = ["python_thread", "job_fresh", "job_reuse"]
MAINS = ["idle", "busy"]


def _spin(done) -> None:
    x = 0
    while not done():
        x += 1


def run_python_thread(pl, n: int, epoch: int, main: str) -> float:
    box: list = []
    t0 = time.perf_counter()
    t = threading.Thread(target=lambda: box.append(pl._C.permutation(n, 0, epoch)[1]),
                         name="pl-epoch-order")
    t.start()
    if main == "busy":
        _spin(lambda: not t.is_alive())
    t.join()
    dt = time.perf_counter() - t0
    assert len(box[0]) == n
    return dt


def run_job(pl, n: int, epoch: int, main: str, tables) -> float:
    t0 = time.perf_counter()
    job = pl._C.OrderJob(n, 0, epoch, tables=tables)
    if main == "busy":
        _spin(lambda: job.done)
    order = job.result()
    dt = time.perf_counter() - t0
    assert len(order) == n
    return dt


def run_loader(pl, src, world: int, epochs: int, ahead_max: int) -> tuple[float, float]:
    """(batches/s, median ms of an epoch's first next()) of rank 0 over ``epochs`` epochs."""
    from pinloader import _epoch_plan
    saved = _epoch_plan._AHEAD_MAX
    _epoch_plan._AHEAD_MAX = ahead_max
    try:
        with pl.ArrayLoader(src, 65536 if len(src) >= 65536 * world else 1024, seed=0, device="cpu",
                            rank=0, world_size=world, drop_last=True) as loader:
            waits, n = [], 0
            t_all = time.perf_counter()
            for _ in range(epochs):
                t0 = time.perf_counter()
                it = iter(loader)
                next(it)
                waits.append((time.perf_counter() - t0) * 1e3)
                n += 1 + sum(1 for _ in it)
            dt = time.perf_counter() - t_all
    finally:
        _epoch_plan._AHEAD_MAX = saved
    w = sorted(waits[5:] or waits)
    return n / dt, w[len(w) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_output_args(ap, "orders")
    ap.add_argument("--items", type=int, default=1 << 22)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", type=C.choice_list(ROWS), default=ROWS)
    ap.add_argument("--main", type=C.choice_list(MAINS), default=MAINS)
    ap.add_argument("--loader-epochs", type=int, default=30)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="tiny orders, 2 rounds (CI)")
    args = ap.parse_args()
    if args.smoke:
        C.smoke_out(args)
        args.items, args.rounds, args.loader_epochs = 70_000, 2, 6
    pl, _ = C.import_pinloader()
    info = C.machine_info(None)
    tables = pl._C.EpochTables()
    # the reuse row's steady state: a block of the size is there before the first timed job
    pl._C.OrderJob(args.items, 0, 0, tables=tables).result()
    times: dict[str, list[float]] = {f"{r} {m}": [] for r in args.rows for m in args.main}
    epoch = 1
    for rnd in range(args.rounds):
        for m in args.main:
            for r in args.rows:
                if r == "python_thread":
                    dt = run_python_thread(pl, args.items, epoch, m)
                else:
                    dt = run_job(pl, args.items, epoch, m, tables if r == "job_reuse" else None)
                epoch += 1
                times[f"{r} {m}"].append(dt * 1e3)
        C.log(f"round {rnd}: " + ", ".join(f"{k} {v[-1]:.1f} ms" for k, v in times.items()))
    loader: dict[str, dict[str, list[float]]] = {}
    if args.loader_epochs > 0:
        import numpy as np
        src = np.random.default_rng(0).integers(0, 256, size=(args.items, 64), dtype=np.uint8)
        for rnd in range(args.rounds):
            for name, ahead in (("loader_one_ahead", 1), ("loader_adaptive", 2)):
                bps, wait = run_loader(pl, src, args.world, args.loader_epochs, ahead)
                rec = loader.setdefault(name, {"batches_per_s": [], "first_next_ms": []})
                rec["batches_per_s"].append(bps)
                rec["first_next_ms"].append(wait)
            C.log(f"round {rnd}: " + ", ".join(f"{k} {v['batches_per_s'][-1]:.0f} batches/s" for k, v in loader.items()))
    summary = {k: C.summarize(v) for k, v in times.items()}
    rows = []
    for m in args.main:
        base = summary.get(f"python_thread {m}")
        for r in args.rows:
            s = summary[f"{r} {m}"]
            per_round = [a / b for a, b in zip(times[f"python_thread {m}"], times[f"{r} {m}"])] \
                if base else []
            rows.append([r, m, C.fmt_summary(s, 1), C.fmt_summary(C.summarize(per_round), 2) if per_round else "–"])
    lines = [
        f"# Epoch orders made ahead: {args.items:,} items, {args.rounds} rounds", "",
        *C.machine_summary_lines(info), "",
        C.md_table(["row", "main thread", "ms until the order is there", "python_thread / row, per round"], rows),
        "",
        "Medians over the rounds (range in brackets); rows interleaved in each round.", ""]
    if loader:
        base = loader["loader_one_ahead"]["batches_per_s"]
        lrows = []
        for name, rec in loader.items():
            per = [a / b for a, b in zip(rec["batches_per_s"], base)]
            lrows.append([name, C.fmt_summary(C.summarize(rec["batches_per_s"]), 0),
                          C.fmt_summary(C.summarize(rec["first_next_ms"]), 2),
                          C.fmt_summary(C.summarize(per), 2)])
        lines += [f"## Rank 0 of {args.world}, {args.items:,} rows of 64 B, {args.loader_epochs} epochs a run "
                  "(host backend)", "",
                  C.md_table(["row", "batches/s", "first next() of an epoch, ms", "/ loader_one_ahead, per round"],
                             lrows), ""]
    text = "\n".join(lines)
    C.publish(args.out, args.name, {"machine": info, "args": vars(args) | {"out": str(args.out)},
                                    "times_ms": times, "summary": summary, "loader": loader}, text)
    print(text)


if __name__ == "__main__":
    main()
