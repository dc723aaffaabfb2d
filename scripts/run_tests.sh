#!/usr/bin/env bash
# Run the whole test suite against the installed kdtree_native: pytest, then the C++ tests
# (configured CPU-only here; scripts/gpu_check.sh builds them with CUDA on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
JOBS=${JOBS:-$(nproc)}
"$PY" -m pytest -q tests/python "$@"
cmake -S . -B build/ctest -G Ninja -DKDTREE_BUILD_TESTS=ON -DKDTREE_CUDA=${KDTREE_CTEST_CUDA:-OFF} \
      -DPython_EXECUTABLE="$(command -v "$PY")" >/dev/null
cmake --build build/ctest -j "$JOBS"
ctest --test-dir build/ctest --output-on-failure -j "$JOBS"
