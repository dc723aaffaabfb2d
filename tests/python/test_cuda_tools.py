"""The standalone CUDA tools in benchmarks/ (single .cu files outside the CMake build, built with nvcc on their own;
cuda_tools.TOOLS): every one keeps compiling wherever nvcc is on the PATH (CI included) and without a device says
so and exits 1 instead of printing rows; on a GPU each prints all its rows with plausible figures.
cuda_mma_rate.cu: the mma.sync issue rate per SM (docs/BENCHMARKS.md "Verify attention at T = 17");
cuda_stream_floor.cu: how fast linear_tile's weight streams can go with no products (docs/BENCHMARKS.md
"Forty-fifth session" under the GPU model); cuda_chain_floor.cu: what a kernel boundary costs in a graph of dependent
kernels, with and without PDL, against a persistent kernel's grid barrier ("Forty-sixth session"); cuda_wgmma_probe.cu
(built for sm_90a): linear_tile's chunk products with wgmma against mma.sync ("Forty-eighth session")."""
import subprocess

import pytest

import kdtree_native as kn
from cuda_tools import CHAIN_CHECK, CHAIN_ROW, MMA_RATE_ROW, STREAM_FLOOR_PLAIN, STREAM_FLOOR_ROW, TOOLS, WGMMA_ROW, \
    build_tool, check_refuses_without_device, needs_nvcc


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """built(source) -> the tool's executable, built once per module."""
    cache = {}

    def get(source):
        if source not in cache:
            cache[source] = build_tool(tmp_path_factory, source)
        return cache[source]
    return get


def run_on_device(tool, timeout):
    """The tool's stdout on a device (skips without one); it must exit 0."""
    if not kn.cuda_available():
        pytest.skip("no usable CUDA device")
    r = subprocess.run([tool], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r.stdout


@needs_nvcc
@pytest.mark.parametrize("source", sorted(TOOLS))
def test_builds_and_refuses_without_a_device(built, source):
    tool = built(source)
    if kn.cuda_available():
        pytest.skip("a CUDA device is present (the tool's device test covers the run)")
    prefix, rows = TOOLS[source]
    check_refuses_without_device(tool, prefix, *rows)


@needs_nvcc
@pytest.mark.cuda
def test_mma_rate_on_the_device(built):
    out = run_on_device(built("cuda_mma_rate.cu"), 120)
    rows = [MMA_RATE_ROW.match(line) for line in out.splitlines()]
    assert len(rows) == 14 and all(rows), out
    for m in rows:
        cycles, fma = float(m.group(4)), int(m.group(5))
        per = 16 * 8 * (8 if m.group(1) == "tf32" else 16)
        assert 0.25 < cycles < 100, m.group(0)
        # the two columns are the same measurement: FMA per cycle = products per mma / cycles per mma
        assert abs(fma - per / cycles) <= 0.02 * fma + 1, m.group(0)


@needs_nvcc
@pytest.mark.cuda
def test_stream_floor_on_the_device(built):
    out = run_on_device(built("cuda_stream_floor.cu"), 300)
    lines = out.splitlines()
    plain = [STREAM_FLOOR_PLAIN.match(line) for line in lines if line.startswith("plain")]
    rows = [STREAM_FLOOR_ROW.match(line) for line in lines[2:]]
    assert len(plain) == 1 and plain[0], out
    # 6 shapes: 2 + 2 + 1 + 4 + 4 + 4 split counts, each at 3 ring depths x 2 layouts
    assert len(rows) == 17 * 6 and all(rows), out
    for m in rows:
        R, K, us, tbs = int(m.group(2)), int(m.group(3)), float(m.group(8)), float(m.group(9))
        assert 0.05 < tbs < 10, m.group(0)
        # the two columns are the same measurement: bytes / time
        assert abs(tbs - R * K * 4 / (us * 1e-6) / 1e12) <= 0.01 * tbs + 0.01, m.group(0)


@needs_nvcc
@pytest.mark.cuda
def test_chain_floor_on_the_device(built):
    out = run_on_device(built("cuda_chain_floor.cu"), 120)
    lines = out.splitlines()
    rows = [CHAIN_ROW.match(line) for line in lines[1:-1]]
    assert all(rows) and len(rows) >= 8, out
    kinds = [(m.group(1), int(m.group(3))) for m in rows]
    # four grid sizes, each with both chains at both shared-memory sizes (and the persistent kernel where its
    # blocks fit at once)
    for kind in ("chain pdl", "chain plain"):
        assert sorted(s for k, s in kinds if k == kind) == [0] * 4 + [160] * 4, out
    for m in rows:
        assert 0.02 < float(m.group(4)) < 100, m.group(0)
    check = CHAIN_CHECK.match(lines[-1])
    assert check, out
    # the data dependence held: 128 phases of +1 through both ways
    assert int(check.group(1)) == int(check.group(3)) == 128 and int(check.group(2)) == 128, out


@needs_nvcc
@pytest.mark.cuda
def test_wgmma_probe_on_the_device(built):
    out = run_on_device(built("cuda_wgmma_probe.cu"), 120)
    rows = [WGMMA_ROW.match(line) for line in out.splitlines()]
    assert len(rows) == 24 and all(rows), out
    # every mode at every height, at one and three blocks per SM
    assert sorted((int(m.group(1)), m.group(2), int(m.group(4)) > 200) for m in rows) == sorted(
        (bm, mode, many) for bm in (8, 16, 24) for mode in ("mma.sync", "wgmma", "wgmma-pipe", "wgmma-ss")
        for many in (False, True)), out
    for m in rows:
        # each mode's products are right (a wrong descriptor or fragment layout gives errors of order 1), and
        # FP32-accurate: 3xTF32 over 1024 terms (16 repeats of one 64-k chunk) stays near 1e-6 of sum |x w|
        assert float(m.group(5)) < 1e-5, m.group(0)
        assert 50 < float(m.group(6)) < 1e6, m.group(0)
