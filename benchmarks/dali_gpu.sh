#!/usr/bin/env bash
# ImageLoader beside NVIDIA DALI 2.4 on a GPU machine that cannot reach PyPI, in calls of at most
# ~9.5 minutes (LIMIT seconds) each:
#   1. DALI installed from wheels, carried to the machine in pieces because one call takes at most
#      64 MiB (DALI_PARTS, default /tmp/dali_parts), in one of two forms:
#        dali.part.*     the pieces of one tar of deps/*.whl (nvidia-dali-cuda130 2.4 and its
#                        dependencies; about 270 MB, six pieces of 45 MiB);
#        dali.xz.part.*  the pieces of one tar.xz of the same wheels unpacked, one folder per
#                        wheel named as its file (about 180 MB, four pieces), zipped again here:
#          for w in deps/*.whl; do unzip -q "$w" -d "u/$(basename "$w" .whl)"; done
#          tar -C u -cf - . | xz -9 -T0 | split -b 45m -d -a 1 - dali.xz.part.
#      (and py-spy's wheel, py_spy-*.whl, if it came too);
#   2. the extension built in place when it is not built yet;
#   3. STEPS (default "loader models"), bench_images.py with the datasets kept in /tmp:
#        loader  loader-bound rows, ImageNet-like (4,096 images) and high-res (1,024) JPEGs:
#                ImageLoader (packed; and tar shards and a folder on ImageNet-like), DALI at its
#                default and at hw_decoder_load 0.9 and at each configuration of SWEEP, the
#                DataLoader and torchvision's GPU decode (ImageNet-like), the GPU decoder alone;
#        models  ResNet-50, ResNet-18 and EfficientNet-B0 on ImageNet-like, ViT-B/16 on high-res
#                JPEGs, fed by ImageLoader, DALI (0.9) and the DataLoader against pre-decoded crops
#                already on the GPU, rows interleaved over ROUNDS rounds.
# Results: $OUT/dali_gpu.tgz (json, markdown, logs); the tables are printed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/dali_gpu_out}"
R="$OUT/dali_gpu"
mkdir -p "$R"
PY="${PYTHON:-python3}"
LIMIT="${LIMIT:-570}"
PARTS="${DALI_PARTS:-/tmp/dali_parts}"
ROUNDS="${ROUNDS:-5}"
STEPS="${STEPS-loader models}"  # STEPS= for the install alone
SWEEP="${SWEEP-0.8:8,0.99:8,0.65:12,0.9:12,0.99:12}"  # SWEEP= for none
DATA="${DATA:-/tmp/pinloader_images}"
SECONDS=0
step() { echo "$1 rc=$2 t=${SECONDS}s" | tee -a "$R/steps.txt"; }
{
    nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
    nproc
    git log --oneline -1 2>/dev/null
} >"$R/machine.txt" 2>&1
if ! "$PY" -c "import nvidia.dali" 2>/dev/null; then
    w=$(mktemp -d)
    if ls "$PARTS"/dali.xz.part.* >/dev/null 2>&1; then
        cat "$PARTS"/dali.xz.part.* | "$PY" -c "import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1], filter='data')" "$w/u"
        step "dali unpack" $?
        "$PY" - "$w/u" "$w/wheels" <<'EOF'
# each unpacked wheel zipped again under its own name, stored (pip unpacks it at once); the
# timestamps unzip restored may be before 1980, which a zip cannot hold
import os
import sys
import zipfile

src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
for d in sorted(os.listdir(src)):
    top = os.path.join(src, d)
    if os.path.isdir(top):
        with zipfile.ZipFile(os.path.join(dst, d + ".whl"), "w", zipfile.ZIP_STORED, strict_timestamps=False) as z:
            for root, _, files in os.walk(top):
                for f in files:
                    z.write(os.path.join(root, f), os.path.relpath(os.path.join(root, f), top))
EOF
        step "dali rezip" $?
        links="$w/wheels"
    else
        cat "$PARTS"/dali.part.* | tar -C "$w" -xf -
        step "dali unpack" $?
        links="$w/deps"
    fi
    "$PY" -m pip install -q --no-index --find-links "$links" nvidia-dali-cuda130 >"$R/install.txt" 2>&1
    step "dali install" $?
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
    step build $?
fi
# bench NAME ARGS...: bench_images.py under a timeout of the time left; each part publishes its
# own results, so a table that runs out of time leaves the others
bench() {
    local name=$1
    shift
    if [ $(( LIMIT - SECONDS )) -lt 30 ]; then
        echo "$name skipped: $(( LIMIT - SECONDS ))s left" | tee -a "$R/steps.txt"
        return
    fi
    PYTHONUNBUFFERED=1 timeout $(( LIMIT - SECONDS )) "$PY" benchmarks/bench_images.py --rounds "$ROUNDS" \
        --data-dir "$DATA" --out "$R" --name "$name" --stall-s 90 "$@" >"$R/$name.log" 2>&1
    step "$name" $?
    sed -n '/^## /,$p' "$R/$name.md" 2>/dev/null || tail -30 "$R/$name.log"
}
case " $STEPS " in *" loader "*)
    bench images_imagenet --size-class imagenet --images 4096 ${SWEEP:+--dali-sweep "$SWEEP"} \
        --rows imageloader_packed,imageloader_tar,imageloader_folder,dali_default,dali_best,dataloader,torchvision_gpu,decoder_alone
    # (no DataLoader row here: a run is 6 epochs of 1,024 high-res images, half a minute a round
    # at its rate; the models step's ViT-B/16 table has it)
    bench images_highres --size-class highres --images 1024 ${SWEEP:+--dali-sweep "$SWEEP"} \
        --rows imageloader_packed,dali_default,dali_best,decoder_alone
esac
case " $STEPS " in *" models "*)
    bench models_imagenet --size-class imagenet --images 4096 --rows decoder_alone --steps "${MODEL_STEPS:-30}" \
        --drain 5 --models resnet50,resnet18,efficientnet_b0 --model-rows imageloader_packed,dali_best,dataloader
    bench models_highres --size-class highres --images 1024 --rows decoder_alone --steps "${VIT_STEPS:-20}" \
        --drain 5 --models vit_b_16 --model-rows imageloader_packed,dali_best,dataloader
esac
tar -C "$OUT" -czf "$OUT/dali_gpu.tgz" dali_gpu && rm -rf "$R"
