#!/usr/bin/env bash
# The plain user loop's gap on a GPU machine, in one call (about 3-5 minutes): build in place, then
#   1. bench_user_loop.py over the user loop's four rows (random uint8 rows made by NumPy): the user's
#      next() loop (seeds 0 and 1, drop_last on and off), the torch door, `for` across epoch ends,
#      bench_gather's own run_loader on the same source, one DMA (2 rounds);
#   2. 512 B and 4 KiB rows over sources made four ways (NumPy, torch, torch collapsed into huge
#      pages, bench_gather's constant rows), the user loop with and without its kernel and
#      bench_gather's loop, with a cProfile of one user run per source (2 rounds).
# Writes under $OUT (default ./userloop_out): diag.txt, user_loop.{md,json,log},
# user_loop_sources.{md,json,log}; with PACK=1, only the archive $OUT.tgz of them (for a machine
# that returns a few files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/userloop_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
{
    echo "== $(date -u +%FT%TZ) $(uname -r)"
    nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader 2>&1
    for f in enabled defrag khugepaged/defrag; do
        echo "thp $f: $(cat /sys/kernel/mm/transparent_hugepage/$f 2>&1)"
    done
    grep -E "MemTotal|MemAvailable|AnonHugePages|HugePages_Total" /proc/meminfo
    nproc
    "$PY" -c "import sys, numpy, torch; print(sys.version.split()[0], numpy.__version__, torch.__version__, torch.version.cuda)"
    echo "== build"
    "$PY" setup.py -q build_ext --inplace 2>&1 | tail -5
    "$PY" -c "import pinloader; print('pinloader', pinloader.__file__, pinloader.backend())"
} >"$OUT/diag.txt" 2>&1
rc=0
"$PY" benchmarks/bench_user_loop.py --out "$OUT" --name user_loop --rounds 2 \
    --sources numpy --loops next,door,for,bench >/dev/null 2>"$OUT/user_loop.log" || rc=$?
echo "user_loop rc=$rc" >>"$OUT/diag.txt"
"$PY" benchmarks/bench_user_loop.py --out "$OUT" --name user_loop_sources --rounds 2 \
    --rows 512,4096 --sources numpy,torch,torch_thp,full --loops next,next_bare,bench \
    --seeds 0 --drop-last true --profile >/dev/null 2>"$OUT/user_loop_sources.log" || rc=$?
echo "user_loop_sources rc=$rc" >>"$OUT/diag.txt"
tail -n 3 "$OUT/user_loop.log" "$OUT/user_loop_sources.log"
if [ -n "${PACK:-}" ]; then
    tar -C "$(dirname "$OUT")" -czf "$OUT.tgz" "$(basename "$OUT")" && rm -rf "$OUT"
fi
exit $rc
