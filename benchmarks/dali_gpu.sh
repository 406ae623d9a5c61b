#!/usr/bin/env bash
# ImageLoader beside NVIDIA DALI 2.4 on a GPU machine that cannot reach PyPI, in one call of at
# most ~9.5 minutes (LIMIT seconds):
#   1. DALI installed from wheels: DALI_PARTS (default /tmp/dali_parts) holds dali.part.* , the
#      pieces of one tar of deps/*.whl (nvidia-dali-cuda130 2.4 and its dependencies), carried
#      to the machine over several calls because one call takes at most 64 MiB (and py-spy's
#      wheel, py_spy-*.whl, if it came too);
#   2. the extension built in place when it is not built yet;
#   3. bench_images.py, ImageNet-like images: the loader-bound rows (ImageLoader packed, DALI at
#      its default and its best hw_decoder_load, the DataLoader, the GPU decoder alone), then
#      ResNet-50 and ResNet-18 fed by ImageLoader, the DataLoader and DALI against pre-decoded
#      crops already on the GPU, rows interleaved over the rounds.
# Results: $OUT/dali_gpu.tgz (json, markdown, log); the markdown is printed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/dali_gpu_out}"
R="$OUT/dali_gpu"
mkdir -p "$R"
PY="${PYTHON:-python3}"
LIMIT="${LIMIT:-570}"
PARTS="${DALI_PARTS:-/tmp/dali_parts}"
ROUNDS="${ROUNDS:-5}"
SECONDS=0
{
    nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
    nproc
    git log --oneline -1 2>/dev/null
} >"$R/machine.txt" 2>&1
if ! "$PY" -c "import nvidia.dali" 2>/dev/null; then
    w=$(mktemp -d)
    cat "$PARTS"/dali.part.* | tar -C "$w" -xf - &&
        "$PY" -m pip install -q --no-index --find-links "$w/deps" nvidia-dali-cuda130 >"$R/install.txt" 2>&1
    echo "dali install rc=$? t=${SECONDS}s" | tee -a "$R/steps.txt"
    rm -rf "$w"
fi
"$PY" -c "import nvidia.dali as d; print('dali', d.__version__)" >>"$R/machine.txt" 2>&1
# py-spy, when its wheel came with the parts: bench_images.py's stall watch then adds the native
# stacks (a model row of ResNet-50 fed by ImageLoader stopped making progress on 2026-12-05:
# benchmarks/results/h100_2026-12-05/README.md)
for w in "$PARTS"/py_spy-*.whl; do
    [ -f "$w" ] && "$PY" -m pip install -q --no-index "$w" >>"$R/install.txt" 2>&1
done
if ! "$PY" -c "import pinloader._C" 2>/dev/null; then
    "$PY" setup.py -q build_ext --inplace -j 16 >"$R/build.txt" 2>&1
    echo "build rc=$? t=${SECONDS}s" | tee -a "$R/steps.txt"
fi
# bench NAME ARGS...: bench_images.py under a timeout of the time left; each part publishes its
# own results, so the loader-bound table survives a model table that runs out of time
bench() {
    local name=$1
    shift
    PYTHONUNBUFFERED=1 timeout $(( LIMIT - SECONDS )) "$PY" benchmarks/bench_images.py --size-class imagenet \
        --images 4096 --rounds "$ROUNDS" --data-dir /tmp/pinloader_images --out "$R" --name "$name" --stall-s 90 "$@" \
        >"$R/$name.log" 2>&1
    echo "$name rc=$? t=${SECONDS}s" | tee -a "$R/steps.txt"
    cat "$R/$name.md" 2>/dev/null || tail -30 "$R/$name.log"
}
bench images_dali --rows imageloader_packed,dali_default,dali_best,dataloader,decoder_alone
bench models_dali --rows decoder_alone --models resnet50,resnet18 --steps 20 --drain 20
tar -C "$OUT" -czf "$OUT/dali_gpu.tgz" dali_gpu && rm -rf "$R"
