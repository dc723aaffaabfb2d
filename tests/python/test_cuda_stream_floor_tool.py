"""benchmarks/cuda_stream_floor.cu is a standalone tool outside the CMake build (how fast linear_tile's weight
streams can go with no products, docs/BENCHMARKS.md "Forty-fifth session"). These tests keep it compiling wherever nvcc
is on the PATH (CI included), check that without a device it says so and exits 1 instead of printing garbage,
and, on a GPU, that it prints every row with a plausible rate."""
import os
import re
import shutil
import subprocess

import pytest

import kdtree_native as kn

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "cuda_stream_floor.cu")
ROW = re.compile(r"^(\w+)\s+(\d+)x(\d+)\s+splits\s+(\d+)\s+(\d+) blocks\s+NBUF (\d)\s+(row-major|tiled)\s+([0-9.]+) us"
                 r"\s+([0-9.]+) TB/s$")
PLAIN = re.compile(r"^plain 512MiB: ([0-9.]+) us, ([0-9.]+) TB/s$")

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")


@pytest.fixture(scope="module")
def tool(tmp_path_factory):
    exe = tmp_path_factory.mktemp("stream_floor") / "stream_floor"
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
    assert "cuda_stream_floor:" in r.stderr
    assert not ROW.search(r.stdout) and not PLAIN.search(r.stdout)


@needs_nvcc
@pytest.mark.cuda
def test_rates_on_the_device(tool):
    if not kn.cuda_available():
        pytest.skip("no usable CUDA device")
    r = subprocess.run([tool], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    plain = [PLAIN.match(line) for line in lines if line.startswith("plain")]
    rows = [ROW.match(line) for line in lines[2:]]
    assert len(plain) == 1 and plain[0], r.stdout
    # 6 shapes: 2 + 2 + 1 + 4 + 4 + 4 split counts, each at 3 ring depths x 2 layouts
    assert len(rows) == 17 * 6 and all(rows), r.stdout
    for m in rows:
        R, K, us, tbs = int(m.group(2)), int(m.group(3)), float(m.group(8)), float(m.group(9))
        assert 0.05 < tbs < 10, m.group(0)
        # the two columns are the same measurement: bytes / time
        assert abs(tbs - R * K * 4 / (us * 1e-6) / 1e12) <= 0.01 * tbs + 0.01, m.group(0)
