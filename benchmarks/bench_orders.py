#!/usr/bin/env python3
"""How long the next epoch's order takes to be made while the training loop runs (Note [orders
made ahead] in pinloader/_epoch_plan.py): host only, no GPU needed.

A loader makes the order of epoch e + 1 while epoch e runs; when an epoch is shorter than that
(64-byte rows: 64 batches of 0.3 ms on an H200 against a permutation of 4 million items), each
epoch's first batch waits for it. Rows, interleaved over --rounds rounds, each the time from the
job's start until its order is there (ms, median and range):

  python_thread  what the loader did before _OrderJob: a Python thread calling
                 pinloader._C.permutation, which fills a freshly allocated table
  job_fresh      pinloader._C._OrderJob, a C thread that never takes the GIL, fresh blocks
  job_reuse      the same with the loader's _EpochTables: the block of the order before last
                 (what a run of epochs does; Note [epoch table reuse] in src/py/epoch_table.c)

each with the main thread --main:
  idle  waiting for it (join() / result())
  busy  spinning in Python until the order is there, holding the GIL but at the interpreter's
        switch interval, as a training loop's Python does between its C calls

--items is the items of the order (default 4,194,304: 64-byte rows over 256 MiB, the user
loop's smallest rows in bench_user_loop.py). --smoke runs tiny sizes (CI runs it).
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
    job = pl._C._OrderJob(n, 0, epoch, tables=tables)
    if main == "busy":
        _spin(lambda: job.done)
    order = job.result()
    dt = time.perf_counter() - t0
    assert len(order) == n
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_output_args(ap, "orders")
    ap.add_argument("--items", type=int, default=1 << 22)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", type=C.choice_list(ROWS), default=ROWS)
    ap.add_argument("--main", type=C.choice_list(MAINS), default=MAINS)
    ap.add_argument("--smoke", action="store_true", help="tiny orders, 2 rounds (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.items, args.rounds = 70_000, 2
    pl, _ = C.import_pinloader()
    info = C.machine_info(None)
    tables = pl._C._EpochTables()
    # the reuse row's steady state: a block of the size is there before the first timed job
    pl._C._OrderJob(args.items, 0, 0, tables=tables).result()
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
    summary = {k: C.summarize(v) for k, v in times.items()}
    rows = []
    for m in args.main:
        base = summary.get(f"python_thread {m}")
        for r in args.rows:
            s = summary[f"{r} {m}"]
            per_round = [a / b for a, b in zip(times[f"python_thread {m}"], times[f"{r} {m}"])] \
                if base else []
            rows.append([r, m, C.fmt_summary(s, 1), C.fmt_summary(C.summarize(per_round), 2) if per_round else "–"])
    text = "\n".join([
        f"# Epoch orders made ahead: {args.items:,} items, {args.rounds} rounds", "",
        *C.machine_summary_lines(info), "",
        C.md_table(["row", "main thread", "ms until the order is there", "python_thread / row, per round"], rows),
        "",
        "Medians over the rounds (range in brackets); rows interleaved in each round.", ""])
    C.publish(args.out, args.name, {"machine": info, "args": vars(args) | {"out": str(args.out)},
                                    "times_ms": times, "summary": summary}, text)
    print(text)


if __name__ == "__main__":
    main()
