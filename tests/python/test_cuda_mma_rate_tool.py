"""benchmarks/cuda_mma_rate.cu is a standalone tool outside the CMake build (the mma.sync issue rate per SM,
docs/BENCHMARKS.md "Verify attention at T = 17"). These tests keep it compiling wherever nvcc is on the PATH
(CI included), check that without a device it says so and exits 1 instead of printing garbage, and, on a
GPU, that every row it prints is a plausible rate."""
import os
import re
import shutil
import subprocess

import pytest

import kdtree_native as kn

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "cuda_mma_rate.cu")
ROW = re.compile(r"^(tf32|f16|bf16)\s+acc (\d+) warps/SM\s+(\d+): ([0-9.]+) cycles per mma per SM, (\d+) FMA/clk/SM")

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")


@pytest.fixture(scope="module")
def tool(tmp_path_factory):
    exe = tmp_path_factory.mktemp("mma_rate") / "mma_rate"
    subprocess.run(["nvcc", "-gencode", "arch=compute_90,code=sm_90", "-O3", "-o", str(exe), SRC], check=True,
                   capture_output=True)
    return str(exe)


@needs_nvcc
def test_builds_and_refuses_without_a_device(tool):
    assert os.path.isfile(tool)
    if kn.cuda_available():
        pytest.skip("a CUDA device is present (the device test covers the run)")
    r = subprocess.run([tool], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "cuda_mma_rate:" in r.stderr
    assert not ROW.search(r.stdout)


@needs_nvcc
@pytest.mark.cuda
def test_rates_on_the_device(tool):
    if not kn.cuda_available():
        pytest.skip("no usable CUDA device")
    r = subprocess.run([tool], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [ROW.match(line) for line in r.stdout.splitlines()]
    assert len(rows) == 14 and all(rows), r.stdout
    for m in rows:
        cycles, fma = float(m.group(4)), int(m.group(5))
        per = 16 * 8 * (8 if m.group(1) == "tf32" else 16)
        assert 0.25 < cycles < 100, m.group(0)
        # the two columns are the same measurement: FMA per cycle = products per mma / cycles per mma
        assert abs(fma - per / cycles) <= 0.02 * fma + 1, m.group(0)
