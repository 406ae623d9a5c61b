#!/usr/bin/env bash
# On a machine with a CUDA GPU and torch (no network needed): build in place, run the GPU tests,
# then the given stages. Logs and results go to ${OUT:-benchmarks/results}.
#   bash benchmarks/run_gpu.sh tests            build + GPU tests + the CUDA-backend primitive tests
#   bash benchmarks/run_gpu.sh sanitize         compute-sanitizer memcheck/racecheck/synccheck over GPU tests
#   bash benchmarks/run_gpu.sh bench            the benchmark suite
#   bash benchmarks/run_gpu.sh perf             the persistence/staging/fast-path checks, about
#                                               5 minutes on the 16-core H200 host: the staging
#                                               sweep against torch copy_ (streaming stores on,
#                                               then off), small leaves through torch.prefetch,
#                                               the collated loop in both loop modes and the
#                                               uint8-crops DataLoader source, at compute 1.2x copy
#   bash benchmarks/run_gpu.sh tests perf       both in one call (about 6 minutes)
#   bash benchmarks/run_gpu.sh gather           the device gather: the committed kernel image against nvcc,
#                                               its GPU tests, compute-sanitizer memcheck over them,
#                                               then benchmarks/bench_gather.py (about 5 minutes)
#   bash benchmarks/run_gpu.sh models           benchmarks/bench_models.py: ResNet-18/50 training fed by
#                                               every loader (about 2 minutes; MODELS_ARGS adds options)
#   bash benchmarks/run_gpu.sh handout          the static-batch and handout GPU tests, compute-sanitizer memcheck and
#                                               racecheck over them, the torch door on 32 x 4 KiB leaves (~5 min)
#   bash benchmarks/run_gpu.sh static           benchmarks/bench_static.py: a CUDA-graph-captured ResNet-18 step fed
#                                               into static tensors, against the eager step (about 1.5 minutes)
#   bash benchmarks/run_gpu.sh ranks            on a several-GPU host: the staging sweep plus one
#                                               process per GPU staging at once (LOCAL_WORLD_SIZE),
#                                               aggregate against torch's all-thread copy_ (~1.5 min)
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
    perf)
      echo "== staging sweep: streaming stores (default) =="
      timeout 110 $py benchmarks/bench_bandwidth.py --staging-sweep --out "$out" --repeats 3 2>&1 | grep -v "^  threads" | tail -22 || status=1
      echo "== staging sweep: PINLOADER_STAGING_NT=0 (memcpy) =="
      PINLOADER_STAGING_NT=0 timeout 90 $py benchmarks/bench_bandwidth.py --staging-sweep --out "$out" \
        --name bandwidth_staging_memcpy --repeats 3 2>&1 | grep -E "^\| |default \(" | tail -14 || status=1
      echo "== small leaves =="
      timeout 90 $py benchmarks/bench_overhead.py --out "$out" --kinds 32x4KiB --repeats 3 --max-run-s 1.0 2>&1 | tail -28 || status=1
      echo "== overlap: collated, both loop modes =="
      timeout 170 $py benchmarks/bench_overlap.py --out "$out" --name overlap_collated --sources collated \
        --loops reused,per_epoch --compute-factors 1.2 --repeats 3 2>&1 | tail -32 || status=1
      echo "== overlap: uint8 crops through 8 DataLoader workers =="
      timeout 130 $py benchmarks/bench_overlap.py --out "$out" --name overlap_crops --sources crops \
        --loops reused --compute-factors 1.2 --repeats 3 2>&1 | tail -20 || status=1 ;;
    gather)
      echo "== kernel image against nvcc =="
      $py tools/gen_gather_kernels.py --check || status=1
      echo "== device gather GPU tests =="
      timeout 300 $py -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_device_gather.py tests/test_fork.py tests/test_array_loader_gpu.py \
        tests/test_example_ddp.py 2>&1 \
        | tee "$out/gather_gpu_tests.log" | tail -15 || status=1
      echo "== compute-sanitizer memcheck over them =="
      timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 --target-processes all \
        $py -m pytest -q -p no:cacheprovider -m gpu -k "not fork" tests/test_device_gather.py tests/test_static_batches.py 2>&1 \
        | tee "$out/gather_memcheck.log" | grep -E "ERROR SUMMARY|passed|failed|error" | tail -5 || status=1
      echo "== bench_gather =="
      timeout 400 $py benchmarks/bench_gather.py --out "$out" ${GATHER_ARGS:-} 2>&1 | tail -40 || status=1 ;;
    handout)
      echo "== static batches and the handout: GPU tests =="
      timeout 300 $py -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_static_cuda.py tests/test_static_batches.py tests/test_doors.py 2>&1 \
        | tee "$out/handout_gpu_tests.log" | tail -15 || status=1
      echo "== compute-sanitizer memcheck over the static-batch tests =="
      timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 --target-processes all \
        $py -m pytest -q -p no:cacheprovider -m gpu -k "not reduce_overhead and not counts_see" \
        tests/test_static_cuda.py tests/test_static_batches.py 2>&1 \
        | tee "$out/handout_memcheck.log" | grep -E "ERROR SUMMARY|passed|failed|error" | tail -5 || status=1
      # racecheck instruments every kernel's shared memory: the tests whose own work is light
      # (no matmul loops, no training step), which still run every static-batch path
      echo "== compute-sanitizer racecheck over the light static-batch tests =="
      timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 --target-processes all \
        $py -m pytest -q -p no:cacheprovider -m gpu -k "not reduce_overhead and not counts_see and not captured and not given_stream and not looks_the_stream and not every_container" \
        tests/test_static_cuda.py tests/test_static_batches.py 2>&1 \
        | tee "$out/handout_racecheck.log" | grep -E "ERROR SUMMARY|passed|failed|error" | tail -5 || status=1
      echo "== the torch door on 32 x 4 KiB leaves =="
      timeout 120 $py benchmarks/bench_overhead.py --out "$out" --kinds 32x4KiB --repeats 3 --max-run-s 1.0 2>&1 | tail -30 || status=1 ;;
    static)
      timeout 200 $py benchmarks/bench_static.py --out "$out" ${STATIC_ARGS:-} 2>&1 | tail -16 || status=1 ;;
    models)
      timeout 290 $py benchmarks/bench_models.py --out "$out" ${MODELS_ARGS:-} 2>&1 | tail -40 || status=1 ;;
    ranks)
      n=$(nvidia-smi -L | wc -l)
      timeout 300 $py benchmarks/bench_bandwidth.py --staging-sweep --ranks "$n" --out "$out" \
        --name bandwidth_staging_ranks --repeats 3 2>&1 | tail -24 || status=1 ;;
    bench)
      timeout 580 $py benchmarks/bench_bandwidth.py --out "$out" 2>&1 | tail -30
      timeout 580 $py benchmarks/bench_overhead.py --out "$out" 2>&1 | tail -20
      timeout 580 $py benchmarks/bench_overlap.py --out "$out" --loops reused 2>&1 | tail -40 ;;
  esac
done
exit $status
