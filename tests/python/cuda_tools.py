"""Shared by the tests of the standalone CUDA tools in benchmarks/ (single .cu files outside the CMake build, built
with nvcc on their own; their error check and device refusal in benchmarks/cuda_tool.h): build one into a temporary directory, and check that without a device it says so on stderr
and exits 1 instead of printing rows."""
import os
import re
import shutil
import subprocess

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")


# the target each tool is built for (sm_90 unless it needs the architecture-specific sm_90a: wgmma)
TOOL_ARCH = {"cuda_wgmma_probe.cu": "90a"}


def build_tool(tmp_path_factory, source):
    """nvcc -O3 for sm_90 (or TOOL_ARCH's target) of benchmarks/<source> into a temporary directory; the executable's
    path."""
    name = os.path.splitext(source)[0]
    exe = tmp_path_factory.mktemp(name) / name
    arch = TOOL_ARCH.get(source, "90")
    subprocess.run(["nvcc", "-gencode", f"arch=compute_{arch},code=sm_{arch}", "-O3", "-o", str(exe),
                    os.path.join(BENCH, source)], check=True, capture_output=True)
    return str(exe)


def check_refuses_without_device(tool, prefix, *rows):
    """Without a device the tool exits 1 with `prefix` on stderr and prints none of the regexes `rows`."""
    assert os.path.isfile(tool)
    r = subprocess.run([tool], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert prefix in r.stderr
    assert not any(row.search(r.stdout) for row in rows)


# the rows each tool prints on a device (its tests parse them)
MMA_RATE_ROW = re.compile(r"^(tf32|f16|bf16)\s+acc (\d+) warps/SM\s+(\d+): ([0-9.]+) cycles per mma per SM, (\d+) FMA/clk/SM")
STREAM_FLOOR_ROW = re.compile(r"^(\w+)\s+(\d+)x(\d+)\s+splits\s+(\d+)\s+(\d+) blocks\s+NBUF (\d)\s+(row-major|tiled)"
                              r"\s+([0-9.]+) us\s+([0-9.]+) TB/s$")
STREAM_FLOOR_PLAIN = re.compile(r"^plain 512MiB: ([0-9.]+) us, ([0-9.]+) TB/s$")
CHAIN_ROW = re.compile(r"^(chain pdl|chain plain|persistent)\s+blocks\s+(\d+) smem\s+(\d+) KB:\s+([0-9.]+) us per boundary$")
CHAIN_CHECK = re.compile(r"^check: persistent (-?\d+), chain (-?\d+) \(expected (\d+)\)$")
WGMMA_ROW = re.compile(r"^PROBE BM=(\d+) mode=(mma\.sync|wgmma|wgmma-pipe|wgmma-ss) K=(\d+) blocks=(\d+): worst \|err\| / "
                       r"sum\|xw\| ([0-9.e+-]+|nan|inf), cycles per chunk repeat \(median block, R = K / 64\) ([0-9.]+)$")

# source -> (its stderr prefix, the rows it must not print without a device)
TOOLS = {
    "cuda_mma_rate.cu": ("cuda_mma_rate:", (MMA_RATE_ROW,)),
    "cuda_stream_floor.cu": ("cuda_stream_floor:", (STREAM_FLOOR_ROW, STREAM_FLOOR_PLAIN)),
    "cuda_chain_floor.cu": ("cuda_chain_floor:", (CHAIN_ROW, CHAIN_CHECK)),
    "cuda_wgmma_probe.cu": ("cuda_wgmma_probe:", (WGMMA_ROW,)),
}
