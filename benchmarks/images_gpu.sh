#!/usr/bin/env bash
# The GPU checks and measurements of the image path in one call (about 9 minutes on an H200
# machine with 16 cores), for a machine that returns at most a few files: everything goes into
# one archive, $OUT/images_gpu.tgz, and the step summary is printed.
#   1. build in place;
#   2. tests/test_jpeg_decoder_gpu.py, whole decodes, then region decodes (PINLOADER_JPEG_REGION=1,
#      Note [region decode] in src/core/jpeg_cuda.c);
#   3. every GPU test (-m gpu), then the README's, docs' and CLI tests;
#   4. compute-sanitizer memcheck over tests/test_image_loader_gpu.py and the decoder's tests;
#   5. bench_jpeg_decode.py: the decoder alone on 1..3 threads against torchvision's decode;
#   6. bench_images.py, loader-bound rows (ImageNet-like images), the packed row again with 2 and
#      3 GPU decoders on threads (PINLOADER_JPEG_DECODERS), then ResNet-50 and ResNet-18 fed by
#      ImageLoader and by the DataLoader against the bound.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/images_gpu_out}"
R="$OUT/images_gpu"
mkdir -p "$R"
PY="${PYTHON:-python3}"
SECONDS=0
step() { echo "$1 rc=$2 t=${SECONDS}s" >>"$R/steps.txt"; }
{
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    nproc
    "$PY" -c "import sys, numpy, torch, torchvision, PIL; print(sys.version.split()[0], numpy.__version__, torch.__version__, torchvision.__version__, PIL.__version__)"
} >"$R/machine.txt" 2>&1
timeout 120 "$PY" setup.py -q build_ext --inplace -j 16 >"$R/build.txt" 2>&1; step build $?
timeout 60 "$PY" -m pytest -q -p no:cacheprovider -s tests/test_jpeg_decoder_gpu.py >"$R/decoder.txt" 2>&1; step decoder $?
PINLOADER_JPEG_REGION=1 timeout 60 "$PY" -m pytest -q -p no:cacheprovider -s tests/test_jpeg_decoder_gpu.py \
    >"$R/decoder_region.txt" 2>&1; step decoder_region $?
timeout 200 "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu tests >"$R/gpu_tests.txt" 2>&1; step gpu_tests $?
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_readme.py tests/test_docs.py tests/test_cli.py \
    >"$R/readme_docs_cli.txt" 2>&1; step readme_docs_cli $?
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_image_loader_gpu.py tests/test_jpeg_decoder_gpu.py >"$R/memcheck.txt" 2>&1; step memcheck $?
timeout 90 "$PY" benchmarks/bench_jpeg_decode.py --rounds 3 --images 2048 --threads 3 \
    --out "$R/jpeg_decode_imagenet.json" >"$R/jpeg_decode_imagenet.txt" 2>&1; step jpeg_decode $?
timeout 150 "$PY" benchmarks/bench_images.py --size-class imagenet --images 4096 --rounds 3 \
    --data-dir /tmp/pinloader_images --out "$R" --name images_loader \
    --rows imageloader_packed,imageloader_tar,imageloader_folder,dataloader,torchvision_gpu,decoder_alone \
    >"$R/images_loader.txt" 2>&1; step images_loader $?
for k in 2 3; do  # Note [decoder threads] in pinloader/_image_epochs.py: K decoders on K threads
    PINLOADER_JPEG_DECODERS=$k timeout 60 "$PY" benchmarks/bench_images.py --size-class imagenet --images 4096 \
        --rounds 3 --data-dir /tmp/pinloader_images --out "$R" --name "images_loader_decoders$k" \
        --rows imageloader_packed >"$R/images_loader_decoders$k.txt" 2>&1; step "images_loader_decoders$k" $?
done
left=$(( 570 - SECONDS ))
if [ "$left" -gt 30 ]; then
    timeout "$left" "$PY" benchmarks/bench_images.py --size-class imagenet --images 4096 --rounds 3 \
        --data-dir /tmp/pinloader_images --out "$R" --name images_models --steps 30 --models resnet50,resnet18 \
        --rows imageloader_packed,dataloader >"$R/images_models.txt" 2>&1; step images_models $?
fi
tar -C "$OUT" -czf "$OUT/images_gpu.tgz" images_gpu && rm -rf "$R"
tar -xzOf "$OUT/images_gpu.tgz" images_gpu/steps.txt
