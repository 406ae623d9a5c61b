#!/usr/bin/env bash
# What the open issues still need from a GPU machine, in one call of at most ~9.5 minutes (steps in
# order of need; each step is skipped when the time left is under its budget):
#   1. build in place;
#   2. every GPU test (-m gpu);
#   3. prof_images.py: where a ResNet-18 step's GPU time goes when ImageLoader feeds it, beside
#      the bound and the GPU decoder alone (benchmarks/results/h100_2026-12-05d/README.md);
#   4. bench_images.py: the four models of the images issue (EfficientNet-B0, ResNet-50 and
#      ResNet-18 on ImageNet-like images, ViT-B/16 on high-res ones) fed by ImageLoader (packed)
#      and by the DataLoader against pre-decoded crops on the GPU, 5 rounds;
#   5. the user loop (bench_user_loop.py) at 64-byte and 512-byte rows: next(), the torch door and
#      bench_gather's loop beside one DMA, 2 rounds;
#   6. compute-sanitizer memcheck over the image, decoder, ArrayLoader and capture-release GPU tests.
# A bench_images run that stops making progress for 90 s leaves its stacks and ends (--stall-s).
# SKIP="name ..." leaves those steps out. Everything goes into one archive, $OUT/session_gpu.tgz;
# the step summary is printed.
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
run prof_images 90 "$PY" benchmarks/prof_images.py --model resnet18 --data-dir /tmp/pinloader_images \
    --out "$R" --name prof_images
run images_models 240 "$PY" benchmarks/bench_images.py --size-class imagenet --images 4096 --rounds 5 \
    --data-dir /tmp/pinloader_images --out "$R" --name images_models --steps 20 --drain 5 \
    --models efficientnet_b0,vit_b_16,resnet50,resnet18 --model-rows imageloader_packed,dataloader \
    --rows decoder_alone --stall-s 90
run user_loop 90 "$PY" benchmarks/bench_user_loop.py --out "$R" --name user_loop --rounds 2 --rows 64,512 \
    --sources numpy --loops next,door,bench
run memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_image_loader_gpu.py tests/test_jpeg_decoder_gpu.py tests/test_array_loader_gpu.py \
    "tests/test_static_cuda.py::test_pinloaders_objects_released_during_a_capture_in_global_mode"
tar -C "$OUT" -czf "$OUT/session_gpu.tgz" session_gpu && rm -rf "$R"
tar -xzOf "$OUT/session_gpu.tgz" session_gpu/steps.txt
