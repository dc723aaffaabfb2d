#!/usr/bin/env bash
# cpu_sanitize.sh: the host code (C++ engine, CPU model, KDTR loader, bindings) under
# AddressSanitizer + UndefinedBehaviorSanitizer, on any Linux machine with GCC (no GPU needed):
#   1. the module built CPU-only with -fsanitize=address,undefined into $OUT/mod (not installed),
#   2. the Python suite against it (LD_PRELOAD of libasan / libubsan, which a CPython not built with
#      ASan needs), leaks not reported (the interpreter's own are not ours); the tool tests that
#      start nvcc / nvdisasm are deselected (those binaries crash under the preloaded runtime),
#   3. the C++ tests (ctest) built with the same flags, leak detection on.
# A sanitizer report aborts the test it happens in (-fno-sanitize-recover), so a clean run is a
# pass of both suites. Takes ~7 min on a 2-core VM (the two builds and the block emulation test).
#
# Usage:  bash scripts/cpu_sanitize.sh          (PYTHON: an interpreter with the build and test
#         dependencies, e.g. the .venv that .ci/run makes; OUT: default /tmp/kdtree_sanitize)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/kdtree_sanitize}
FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
mkdir -p "$OUT"
echo "== building the sanitized module into $OUT/mod"
KDTREE_CUDA=OFF "$PY" -m pip install -q --no-deps --no-build-isolation --target "$OUT/mod" --upgrade . \
  -Ccmake.build-type=RelWithDebInfo -Cinstall.strip=false -Cbuild-dir="$OUT/build" \
  "-Ccmake.define.CMAKE_CXX_FLAGS=$FLAGS" "-Ccmake.define.CMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined"
PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
echo "== pytest (CPU) against the sanitized module"
ASAN_OPTIONS=detect_leaks=0 LD_PRELOAD="$PRELOAD" PYTHONPATH="$OUT/mod" \
  "$PY" -m pytest -q tests/python -p no:cacheprovider \
  --deselect tests/python/test_cuda_tools.py --deselect tests/python/test_pdl_audit.py
echo "== ctest, built with the same flags"
cmake -S . -B "$OUT/ctest" -G Ninja -DKDTREE_BUILD_TESTS=ON -DKDTREE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DCMAKE_CXX_FLAGS=$FLAGS" "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" \
  "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined" -DPython_EXECUTABLE="$(command -v "$PY")" >/dev/null
cmake --build "$OUT/ctest" -j "$(nproc)"
ASAN_OPTIONS=detect_leaks=1 ctest --test-dir "$OUT/ctest" --output-on-failure -j "$(nproc)"
echo "== cpu_sanitize: clean"
