#!/usr/bin/env bash
# A change measured against the tree it changes, on one GPU machine, in one call: this tree (A) and
# this tree with PATCH applied (B) are built side by side; B's GPU tests run (and compute-sanitizer
# memcheck over MEMCHECK_TESTS); then BENCH runs in separate processes, A and B alternating (ABBA
# order over PAIRS pairs), so that both sides see the same machine, clocks and data.
#
#   PATCH=.dalipart/change.patch bash benchmarks/ab_gpu.sh
#   PATCH= ENV_B="PINLOADER_JPEG_DECODERS=4" bash benchmarks/ab_gpu.sh   # a setting, not a change
#
# PATCH         a patch for `git apply` (made with `git diff main branch`), relative to this tree;
#               empty: B is this tree too, and only ENV_A / ENV_B tell the sides apart
# ENV_A, ENV_B  NAME=VALUE ... set for that side's benchmark processes (default: none)
# TESTS         B's GPU test files (default: tests/test_jpeg_decoder_gpu.py tests/test_image_loader_gpu.py)
# MEMCHECK_TESTS  the tests run under memcheck on B (default: tests/test_jpeg_decoder_gpu.py; empty: none)
# BENCH         the benchmark command, run from each tree with --out and --name appended
#               (default: bench_images.py's decoder alone and packed ImageLoader, loader-bound)
# PAIRS         A/B pairs of benchmark processes (default 2)
# LIMIT         seconds for the whole call (default 540); a step that no longer fits is skipped
# Everything goes into $OUT/ab (steps.txt, the logs, each process's JSON and Markdown); the
# steps and the benchmark's tables are printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
OUT="${OUT:-$PWD/ab_out}"
R="$OUT/ab"
mkdir -p "$R"
PY="${PYTHON:-python3}"
LIMIT="${LIMIT:-540}"
PAIRS="${PAIRS:-2}"
TESTS="${TESTS:-tests/test_jpeg_decoder_gpu.py tests/test_image_loader_gpu.py}"
MEMCHECK_TESTS="${MEMCHECK_TESTS-tests/test_jpeg_decoder_gpu.py}"
BENCH="${BENCH:-benchmarks/bench_images.py --size-class imagenet --images 8192 --rounds 5 --data-dir /tmp/pinloader_images --rows decoder_alone,imageloader_packed --stall-s 60}"
SECONDS=0
: "${PATCH?PATCH must name a patch file, or be empty for an A/B of ENV_A against ENV_B}"
ENV_A="${ENV_A:-}"
ENV_B="${ENV_B:-}"
if [ -z "$PATCH" ] && [ "$ENV_A" = "$ENV_B" ]; then
    echo "nothing tells A from B: give PATCH, or ENV_A and ENV_B that differ" >&2
    exit 2
fi
# the settings as words (split on blanks, never globbed): NAME=VALUE only, no blank in a value
read -r -a env_a <<<"$ENV_A"
read -r -a env_b <<<"$ENV_B"
for kv in ${env_a[@]+"${env_a[@]}"} ${env_b[@]+"${env_b[@]}"}; do
    if ! [[ "$kv" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then
        echo "ENV_A and ENV_B take NAME=VALUE words; '$kv' is not one" >&2
        exit 2
    fi
done
note() { echo "$*" | tee -a "$R/steps.txt"; }
# run NAME BUDGET_S DIR COMMAND...: in DIR under a timeout of what is left, if BUDGET_S is left
run() {
    local name=$1 budget=$2 dir=$3
    shift 3
    local left=$(( LIMIT - SECONDS ))
    if [ "$left" -lt "$budget" ]; then
        note "$name skipped: ${left}s left, needs ${budget}s"
        return 1
    fi
    (cd "$dir" && timeout "$left" "$@") >"$R/$name.txt" 2>&1
    local rc=$?
    note "$name rc=$rc t=${SECONDS}s"
    return $rc
}
{
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    nproc
    "$PY" -c "import sys, numpy, torch; print(sys.version.split()[0], numpy.__version__, torch.__version__)"
    if [ -n "$PATCH" ]; then sha256sum "$PATCH"; fi
    echo "ENV_A: $ENV_A"
    echo "ENV_B: $ENV_B"
} >"$R/machine.txt" 2>&1
if [ -n "$PATCH" ]; then cp "$PATCH" "$R/change.patch"; fi
W=/tmp/ab_trees
rm -rf "$W" && mkdir -p "$W/A" "$W/B"
tar -C "$SRC" --exclude=./.dalipart --exclude=./ab_out --exclude=./build -cf - . | tar -C "$W/A" -xf -
tar -C "$SRC" --exclude=./.dalipart --exclude=./ab_out --exclude=./build -cf - . | tar -C "$W/B" -xf -
if [ -n "$PATCH" ] && ! (cd "$W/B" && git apply --whitespace=nowarn "$SRC/$PATCH") >"$R/apply.txt" 2>&1; then
    note "the patch does not apply: $(cat "$R/apply.txt")"
    exit 2
fi
rm -f "$W"/A/pinloader/*.so "$W"/B/pinloader/*.so # each side built from its own sources
# both builds at once, half the cores each
(cd "$W/A" && "$PY" setup.py -q build_ext --inplace -j "$(( $(nproc) / 2 ))") >"$R/build_A.txt" 2>&1 &
pa=$!
(cd "$W/B" && "$PY" setup.py -q build_ext --inplace -j "$(( $(nproc) / 2 ))") >"$R/build_B.txt" 2>&1
rb=$?
wait $pa
ra=$?
note "build A rc=$ra B rc=$rb t=${SECONDS}s"
[ "$ra" -eq 0 ] && [ "$rb" -eq 0 ] || exit 2
if [ -z "$PATCH" ]; then
    note "no patch: B is this tree, its tests not run again"
else
    # shellcheck disable=SC2086  # word splitting of the test list is meant
    run tests_B 100 "$W/B" "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu $TESTS
fi
if [ -n "$PATCH" ] && [ -n "$MEMCHECK_TESTS" ]; then
    # shellcheck disable=SC2086
    run memcheck_B 120 "$W/B" compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$PY" -m pytest -q -p no:cacheprovider $MEMCHECK_TESTS
fi
for p in $(seq 1 "$PAIRS"); do
    if [ $(( p % 2 )) -eq 1 ]; then order="A B"; else order="B A"; fi
    for side in $order; do
        if [ "$side" = A ]; then envs=(${env_a[@]+"${env_a[@]}"}); else envs=(${env_b[@]+"${env_b[@]}"}); fi
        # shellcheck disable=SC2086
        run "bench_${side}_$p" 60 "$W/$side" env ${envs[@]+"${envs[@]}"} "$PY" $BENCH --out "$R" --name "bench_${side}_$p"
    done
done
tar -C "$OUT" -czf "$OUT/ab.tgz" ab
cat "$R/steps.txt"
for f in "$R"/bench_*_*.md; do
    [ -f "$f" ] && { echo "== $(basename "$f")"; grep -E '^\|' "$f"; }
done
