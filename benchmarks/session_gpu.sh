#!/usr/bin/env bash
# What the open issues still need from a GPU machine, in one call of at most ~9.5 minutes (steps in
# order of need; each step is skipped when the time left is under its budget):
#   1. build in place;
#   2. every GPU test (-m gpu);
#   3. the stall bisect: ResNet-50 fed by ImageLoader alone beside the bound (no other loader in the
#      process), with two decoder threads (and after step 4, with one);
#   4. the user loop (bench_user_loop.py) at 64-byte and 512-byte rows: next(), the torch door and
#      bench_gather's loop beside one DMA, 2 rounds (the 64-byte rows' wait for the next epoch's
#      order, Note [orders made ahead] in pinloader/_epoch_plan.py); bench_host_rows.py: the row
#      gather's prefetch on and off (host backend);
#   5. compute-sanitizer memcheck over the image, decoder and ArrayLoader GPU tests;
#   6. bench_orders.py: the next epoch's order made as before and now, on this host;
#   7. bench_images.py: ResNet-50 and ResNet-18 fed by ImageLoader (packed) and by the DataLoader
#      against pre-decoded crops on the GPU, and the loader-bound packed row beside the decoder
#      alone.
# A bench_images run that stops making progress for 60 s leaves its stacks and ends (--stall-s).
# SKIP="name ..." leaves those steps out (for instance images_models when benchmarks/dali_gpu.sh runs
# the model rows with DALI beside them in a later call). Everything goes into one archive,
# $OUT/session_gpu.tgz; the step summary is printed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/session_gpu_out}"
R="$OUT/session_gpu"
mkdir -p "$R"
PY="${PYTHON:-python3}"
LIMIT="${LIMIT:-570}"
SECONDS=0
step() { echo "$1 rc=$2 t=${SECONDS}s" >>"$R/steps.txt"; }
# run NAME BUDGET_S COMMAND...: the command under a timeout of what is left, if BUDGET_S is left
run() {
    local name=$1 budget=$2
    shift 2
    case " ${SKIP:-} " in *" $name "*) echo "$name skipped: SKIP" >>"$R/steps.txt"; return ;; esac
    local left=$(( LIMIT - SECONDS ))
    if [ "$left" -lt "$budget" ]; then
        echo "$name skipped: ${left}s left, needs ${budget}s" >>"$R/steps.txt"
        return
    fi
    timeout "$left" "$@" >"$R/$name.txt" 2>&1
    step "$name" $?
}
{
    nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
    nproc
    git log --oneline -1 2>/dev/null
    "$PY" -c "import sys, numpy, torch, torchvision, PIL; print(sys.version.split()[0], numpy.__version__, torch.__version__, torchvision.__version__, PIL.__version__)"
} >"$R/machine.txt" 2>&1
# py-spy, when its wheel was carried (py_spy-*.whl in DALI_PARTS): bench_images.py's stall watch
# then writes the native stacks too (benchmarks/results/h100_2026-12-05/README.md)
for w in "${DALI_PARTS:-/tmp/dali_parts}"/py_spy-*.whl; do
    [ -f "$w" ] && "$PY" -m pip install -q --no-index "$w" >"$R/pyspy_install.txt" 2>&1
done
run build 60 "$PY" setup.py -q build_ext --inplace -j 16
# GPU_TESTS="file ..." narrows the GPU tests (default: all of tests/)
run gpu_tests 150 "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu ${GPU_TESTS:-tests}
# the stall of ImageLoader's ResNet-50 row (benchmarks/results/h100_2026-12-05/README.md), with no
# other loader in the process: does it need the DataLoader's workers or DALI beside it? And with
# one decoder thread instead of two?
run stall_bisect 120 "$PY" benchmarks/bench_images.py --size-class imagenet --images 4096 --rounds 4 \
    --data-dir /tmp/pinloader_images --out "$R" --name stall_bisect --steps 20 --drain 20 \
    --models resnet50 --model-rows bound,imageloader_packed --rows decoder_alone --stall-s 60
run user_loop 90 "$PY" benchmarks/bench_user_loop.py --out "$R" --name user_loop --rounds 2 --rows 64,512 --row-prefetch on,off \
    --sources numpy --loops next,door,bench
# the row gather's prefetch on and off on this host (Note [row gather] in src/core/stager.c)
run host_rows 50 "$PY" benchmarks/bench_host_rows.py --rows 64,512 --rounds 2
PINLOADER_JPEG_DECODERS=1 run stall_bisect_k1 120 "$PY" benchmarks/bench_images.py --size-class imagenet \
    --images 4096 --rounds 4 --data-dir /tmp/pinloader_images --out "$R" --name stall_bisect_k1 --steps 20 \
    --drain 20 --models resnet50 --model-rows bound,imageloader_packed --rows decoder_alone --stall-s 60
run memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_image_loader_gpu.py tests/test_jpeg_decoder_gpu.py tests/test_array_loader_gpu.py
run orders 20 "$PY" benchmarks/bench_orders.py --out "$R" --name orders --rounds 7
run images_models 150 "$PY" benchmarks/bench_images.py --size-class imagenet --images 4096 --rounds 3 \
    --data-dir /tmp/pinloader_images --out "$R" --name images_models --steps 20 --drain 20 \
    --models resnet50,resnet18 --rows imageloader_packed,dataloader,decoder_alone --stall-s 60
tar -C "$OUT" -czf "$OUT/session_gpu.tgz" session_gpu && rm -rf "$R"
tar -xzOf "$OUT/session_gpu.tgz" session_gpu/steps.txt
