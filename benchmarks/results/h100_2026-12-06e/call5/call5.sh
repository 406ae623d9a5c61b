#!/usr/bin/env bash
# session 13, call 5: weight tables (working tree): decoder + image loader GPU tests, memcheck, prof_images (region off, on)
set -uo pipefail
R=$OUT/c5; mkdir -p $R /tmp/pli
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 setup.py -q build_ext --inplace -j 16 > $R/build.txt 2>&1; echo "build rc=$? t=$SECONDS"
env -u CUDA_DEVICE_MAX_CONNECTIONS timeout 130 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_jpeg_decoder_gpu.py tests/test_image_loader_gpu.py > $R/tests.txt 2>&1; echo "tests rc=$? t=$SECONDS"; tail -3 $R/tests.txt
env -u CUDA_DEVICE_MAX_CONNECTIONS timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider tests/test_jpeg_decoder_gpu.py > $R/memcheck.txt 2>&1; echo "memcheck rc=$? t=$SECONDS"; tail -2 $R/memcheck.txt
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 60 python3 benchmarks/prof_images.py --model resnet18 --data-dir /tmp/pli --out $R --name prof_tables > $R/prof1.txt 2>&1; echo "prof rc=$? t=$SECONDS"
grep -a "^|" $R/prof_tables.md | head -10
if [ $SECONDS -lt 150 ]; then
PINLOADER_JPEG_REGION=1 CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 70 python3 benchmarks/prof_images.py --model resnet18 --data-dir /tmp/pli --out $R --name prof_tables_region > $R/prof2.txt 2>&1; echo "prof region rc=$? t=$SECONDS"
grep -a "^|" $R/prof_tables_region.md | head -10
fi
true
