"""Host CPU per batch of ArrayLoader's row gather, with the row prefetch (Note [row gather] in
src/core/stager.c) on and off, in alternating subprocesses: random rows of a 1 GiB in-RAM
uint8 array, 4 MiB batches, on the host backend (no GPU needed).

    python benchmarks/bench_host_rows.py --rows 64,512 --rounds 3

Prints one line per run: process CPU ms per batch and wall ms per batch, each the median of
5 stretches of 50 batches after 20 batches of warm-up.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = r"""
import resource, sys, time
import numpy as np
import pinloader
rows = int(sys.argv[1])
arr = np.random.default_rng(0).integers(0, 255, ((1 << 30) // rows, rows), dtype=np.uint8)
L = pinloader.ArrayLoader(arr, batch_size=(4 << 20) // rows, seed=0, device="cpu", drop_last=True)
it = iter(L)
for _ in range(20):
    next(it)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
got = []
for _ in range(5):
    c0, t0 = cpu(), time.perf_counter()
    for _ in range(50):
        try:
            next(it)
        except StopIteration:
            it = iter(L)
            next(it)
    got.append(((cpu() - c0) / 50 * 1e3, (time.perf_counter() - t0) / 50 * 1e3))
print(f"{sorted(g[0] for g in got)[2]:.3f} {sorted(g[1] for g in got)[2]:.3f}")
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,512", help="row sizes in bytes, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for r in range(args.rounds):
        for rows in (int(x) for x in args.rows.split(",")):
            for prefetch in ("0", "1"):
                env = dict(os.environ, PINLOADER_ROW_PREFETCH=prefetch, PINLOADER_BACKEND="host")
                out = subprocess.run([sys.executable, "-c", CHILD, str(rows)], env=env, cwd=root,
                                     capture_output=True, text=True, check=True).stdout.split()
                print(f"round {r} rows {rows:>5} prefetch {'on ' if prefetch == '1' else 'off'}: "
                      f"CPU {out[0]} ms/batch, wall {out[1]} ms/batch", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
