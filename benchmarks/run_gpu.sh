#!/usr/bin/env bash
# On a machine with a CUDA GPU and torch (no network needed): build in place, run the GPU tests,
# then the given stages. Logs and results go to ${OUT:-benchmarks/results}.
#   bash benchmarks/run_gpu.sh tests            build + GPU tests + the CUDA-backend primitive tests
#   bash benchmarks/run_gpu.sh sanitize         compute-sanitizer memcheck/racecheck/synccheck over GPU tests
#   bash benchmarks/run_gpu.sh bench            the benchmark suite
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
$py setup.py -q build_ext --inplace 2>&1 | grep -E "(error|warning):" | grep -v Setuptools && exit 1
$py -m pinloader info
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
status=0
for stage in "$@"; do
  case $stage in
    tests)
      timeout 500 $py -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$out/gpu_tests.log" | tail -40 || status=1 ;;
    suite)
      timeout 500 $py -m pytest -q -p no:cacheprovider -x tests 2>&1 | tee "$out/gpu_suite.log" | tail -40 || status=1 ;;
    sanitize)
      for tool in memcheck racecheck synccheck; do
        echo "== compute-sanitizer $tool =="
        timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 --target-processes all \
          $py -m pytest -q -p no:cacheprovider -m gpu -k "not training and not flat and not big_batch and not jax" tests/test_gpu.py 2>&1 \
          | tee "$out/sanitizer_$tool.log" | grep -E "ERROR SUMMARY|passed|failed|error" | tail -5 || status=1
      done ;;
    bench)
      timeout 580 $py benchmarks/bench_bandwidth.py --out "$out" 2>&1 | tail -30
      timeout 580 $py benchmarks/bench_overhead.py --out "$out" 2>&1 | tail -20
      timeout 580 $py benchmarks/bench_overlap.py --out "$out" 2>&1 | tail -40 ;;
  esac
done
exit $status
