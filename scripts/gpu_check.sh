#!/usr/bin/env bash
# gpu_check.sh: the whole check on a CUDA machine (made for the H200), in one command:
#   1. build + install the package for sm_90 (pip, no build isolation),
#   2. the whole test suite through scripts/run_tests.sh (pytest, then ctest with the CUDA
#      backend: KDTREE_CTEST_CUDA=ON), GPU tests included,
#   3. compute-sanitizer memcheck, racecheck, synccheck and initcheck on the CUDA ctest binary
#      (small sizes), memcheck on a pytest subset and on an end-to-end GPU generate
#      (scripts/gpu_generate_check.py: the device round with every drafter kind; with torch also
#      scripts/gpu_device_drafts_check.py: a Python drafter's CUDA tensors read in place),
#   4. the kernel benchmarks (benchmarks/bench_cuda_*.py, bench_cuda_skinny_configs.py), JSON results, and (with torch +
#      transformers) the GPU model's: bench_cuda_model.py --quick, bench_cuda_skinny.py,
#      bench_cuda_experts.py, bench_cuda_attention_model.py.
# Logs and JSON land in $OUT (default ./gpu_check_out); a summary table is printed last and
# the exit status is non-zero if any step failed.
#
# Usage:  bash scripts/gpu_check.sh            # everything
#         GPU_CHECK_STEPS="build cuda-tests bench" bash scripts/gpu_check.sh   # a subset
# Steps (run in the order given): build, tests (whole suite + ctest), cuda-tests (only
# every pytest case marked cuda and the CUDA ctest binary), sanitizer, bench. Env: PYTHON (default python3),
# KDTREE_CUDA_ARCH (default 90), BENCH_ARGS (extra args for every benchmark, e.g. --quick).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
ARCH=${KDTREE_CUDA_ARCH:-90}
STEPS=${GPU_CHECK_STEPS:-"build tests sanitizer bench"}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export CUDAARCHS=$ARCH
export PYTHONUNBUFFERED=1
declare -a SUMMARY=()
STATUS=0

run_step() {  # run_step NAME LOGFILE CMD...
  local name=$1 log=$2
  shift 2
  local t0=$SECONDS
  echo "== $name ($(date +%T))"
  "$@" >>"$log" 2>&1
  local rc=$?
  local dt=$((SECONDS - t0))
  if [ $rc -eq 0 ]; then
    SUMMARY+=("$(printf '%-22s ok      %5ds' "$name" "$dt")")
  else
    SUMMARY+=("$(printf '%-22s FAILED  %5ds  (rc=%d, see %s)' "$name" "$dt" "$rc" "$(basename "$log")")")
    STATUS=1
    echo "-- $name failed (rc=$rc); last lines of $log:"
    tail -n 40 "$log"
  fi
  return $rc
}

{
  echo "host: $(hostname)  date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 || true
  nvcc --version 2>&1 | tail -n 2 || true
  "$PY" --version 2>&1
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

step_build() {
  run_step build "$OUT/build.log" "$PY" -m pip install -v --no-build-isolation --no-deps \
    -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCH" -Ccmake.define.KDTREE_CUDA=ON . || return 1
  "$PY" -c "import kdtree_native as kn; print(kn.build_info())" >>"$OUT/build.log" 2>&1
  tail -n 1 "$OUT/build.log"
}

CTEST_BIN="$ROOT/build/ctest/tests/cpp/test_cuda_kernels"
build_ctest() {
  cmake -S . -B build/ctest -G Ninja -DKDTREE_BUILD_TESTS=ON -DKDTREE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DPython_EXECUTABLE="$(command -v "$PY")" >/dev/null &&
    cmake --build build/ctest -j "$CMAKE_BUILD_PARALLEL_LEVEL"
}

step_tests() {  # the whole suite: pytest (GPU tests included) + ctest with the CUDA backend
  run_step tests "$OUT/tests.log" env PYTHON="$PY" KDTREE_CTEST_CUDA=ON bash scripts/run_tests.sh -ra
}

step_cuda_tests() {  # only the CUDA tests (quick iteration)
  run_step pytest-cuda "$OUT/tests.log" "$PY" -m pytest -q -ra tests/python -m cuda
  run_step ctest-cuda-build "$OUT/tests.log" build_ctest
  run_step ctest-cuda "$OUT/tests.log" "$CTEST_BIN"
}

step_sanitizer() {
  local SAN="compute-sanitizer --error-exitcode 97"
  [ -x "$CTEST_BIN" ] || run_step ctest-cuda-build "$OUT/sanitizer.log" build_ctest
  export KDTREE_CUDA_TEST_CASES=${KDTREE_SANITIZER_CASES:-12} KDTREE_CUDA_TEST_SMALL=1
  run_step memcheck "$OUT/sanitizer.log" $SAN --tool memcheck --leak-check full "$CTEST_BIN"
  run_step racecheck "$OUT/sanitizer.log" $SAN --tool racecheck --racecheck-report all "$CTEST_BIN"
  run_step synccheck "$OUT/sanitizer.log" $SAN --tool synccheck "$CTEST_BIN"
  run_step initcheck "$OUT/sanitizer.log" $SAN --tool initcheck "$CTEST_BIN"
  unset KDTREE_CUDA_TEST_CASES KDTREE_CUDA_TEST_SMALL
  run_step racecheck-tree "$OUT/sanitizer.log" $SAN --tool racecheck "$PY" scripts/gpu_tree_sanitize.py
  run_step synccheck-tree "$OUT/sanitizer.log" $SAN --tool synccheck "$PY" scripts/gpu_tree_sanitize.py
  run_step racecheck-attention "$OUT/sanitizer.log" $SAN --tool racecheck "$PY" scripts/gpu_attention_sanitize.py
  run_step memcheck-attention "$OUT/sanitizer.log" $SAN --tool memcheck "$PY" scripts/gpu_attention_sanitize.py
  run_step memcheck-pytest "$OUT/sanitizer.log" $SAN --tool memcheck "$PY" -m pytest -q -x \
    tests/python/test_cuda_ops.py -k "corners or kv_compact or splits_and_naive"
  run_step memcheck-generate "$OUT/sanitizer.log" $SAN --tool memcheck "$PY" scripts/gpu_generate_check.py
  if "$PY" -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
    run_step memcheck-device-drafts "$OUT/sanitizer.log" $SAN --tool memcheck "$PY" scripts/gpu_device_drafts_check.py
  fi
}

step_bench() {
  for b in tree_build verify_attention accept_compact; do
    run_step "bench-$b" "$OUT/bench.log" "$PY" benchmarks/bench_cuda_$b.py --json "$OUT/bench_$b.json" ${BENCH_ARGS:-}
  done
  # every configuration of the skinny linear kernel on the mini-kimi projections (~70 s)
  run_step bench-skinny-configs "$OUT/bench.log" "$PY" benchmarks/bench_cuda_skinny_configs.py \
    --json "$OUT/bench_skinny_configs.json"
  grep -E "^(##|\||goal)" "$OUT/bench.log"
  # the GPU model (needs torch with CUDA and transformers for the mini-kimi checkpoint)
  if "$PY" -c "import torch, transformers; assert torch.cuda.is_available()" >/dev/null 2>&1; then
    run_step bench-model "$OUT/bench_model.log" "$PY" benchmarks/bench_cuda_model.py --quick --no-hf --reps 10 \
      --json "$OUT/bench_model.json"
    run_step bench-skinny "$OUT/bench_model.log" "$PY" benchmarks/bench_cuda_skinny.py --tokens 1 2 4 8 16 17
    run_step bench-experts "$OUT/bench_model.log" "$PY" benchmarks/bench_cuda_experts.py
    run_step bench-attention-model "$OUT/bench_model.log" "$PY" benchmarks/bench_cuda_attention_model.py --contexts 512 2048
    grep -E "^(prefill|AR|verify|DDTree|##|\||expert kernels)" "$OUT/bench_model.log"
  else
    echo "bench-model: skipped (needs torch with CUDA and transformers)"
  fi
}

for st in $STEPS; do
  case $st in
    build) step_build || { printf '%s\n' "${SUMMARY[@]}"; exit 1; } ;;
    tests) step_tests ;;
    cuda-tests) step_cuda_tests ;;
    sanitizer) step_sanitizer ;;
    bench) step_bench ;;
    *) echo "unknown step $st"; STATUS=1 ;;
  esac
done

echo
echo "== summary ($OUT)"
printf '%s\n' "${SUMMARY[@]}"
exit $STATUS
