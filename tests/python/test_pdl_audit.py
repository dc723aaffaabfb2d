"""The PDL load audit (scripts/check_pdl_loads.py) on the built module's sm_90 machine code: no
kernel may reach a global load before its griddepcontrol.wait unless the load's source line is
marked `pdl: pre-wait` (immutable data: weights, the cache rows committed before the step), nor
a global store or atomic at all, nor exit without waiting. Runs
without a GPU (it reads the cubins); skipped when the module was built without CUDA / sm_90 or
when nvdisasm / cuobjdump (CUDA toolkit, or PyPI's nvidia-cuda-nvdisasm / nvidia-cuda-cuobjdump)
or nvcc are missing. The second test checks that the audit can fail: a load after a wait that
sits behind a run-time branch (what broke the expert kernels in the seventeenth session), a
store before the wait and an exit without one are reported, the same load after an unconditional wait or marked is not."""
import importlib.util
import os
import re
import shutil
import subprocess

import pytest

import kdtree_native as kn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("check_pdl_loads", os.path.join(ROOT, "scripts", "check_pdl_loads.py"))
audit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(audit)

NVDISASM, CUOBJDUMP = audit.find_tool("nvdisasm"), audit.find_tool("cuobjdump")
needs_tools = pytest.mark.skipif(not (NVDISASM and CUOBJDUMP), reason="nvdisasm / cuobjdump not found")


@needs_tools
def test_module_has_no_unmarked_pre_wait_loads(capsys):
    info = kn.build_info()
    if not info.get("cuda") or "90" not in re.split(r"[;, ]+", str(info.get("cuda_archs", ""))):
        pytest.skip("the module has no sm_90 CUDA code")
    from kdtree_native import _native
    rc = audit.main(["check_pdl_loads", _native.__file__])
    out = capsys.readouterr().out
    if rc == 2:
        pytest.skip(out.strip())
    assert "kernels" in out and rc == 0, out


TINY = r"""
__global__ void branched(const int* a, int* b, int f) {
  if (!f) asm volatile("griddepcontrol.wait;" ::: "memory");
  b[0] = __ldg(a);
}
__global__ void straight(const int* a, int* b) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  b[0] = __ldg(a);
}
__global__ void early_store(const int* a, int* b) {
  b[1] = 7;
  asm volatile("griddepcontrol.wait;" ::: "memory");
  b[0] = __ldg(a);
}
__global__ void early_exit(const int* a, int* b, int f) {
  if (f) return;
  asm volatile("griddepcontrol.wait;" ::: "memory");
  b[0] = __ldg(a);
}
__global__ void marked(const int* a, int* b, const int* w) {
  const int v = __ldg(w);  // pdl: pre-wait (immutable)
  asm volatile("griddepcontrol.wait;" ::: "memory");
  b[0] = __ldg(a) + v;
}
"""


@needs_tools
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_audit_reports_a_load_behind_a_branched_wait(tmp_path):
    src = tmp_path / "tiny.cu"
    src.write_text(TINY)
    cubin = tmp_path / "tiny.cubin"
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "-lineinfo", "-o", str(cubin), str(src)], check=True,
                   capture_output=True)
    n, bad = audit.audit_cubin(NVDISASM, str(cubin), repo=str(tmp_path))
    assert n == 5
    flagged = {name for name, _, _ in bad}
    assert any("early_exit" in name and op.startswith("EXIT") for name, op, _ in bad), bad  # no wait on that path
    assert any("branched" in name for name in flagged), bad
    assert any("early_store" in name and op.startswith("ST") for name, op, _ in bad), bad  # a store: never allowed
    assert not any("straight" in name or "marked" in name for name in flagged), bad


TINY_MARKS = r"""
__global__ void kept(const int* a, int* b, const int* w) {
  __shared__ int pin[1];
  const int v = __ldg(w);  // pdl: pre-wait (issued before the wait: this marker accepts it)
  *(volatile int*)pin = v;  // (needs the load before the wait; a bare __ldg there may be sunk below it)
  asm volatile("griddepcontrol.wait;" ::: "memory");
  b[0] = __ldg(a) + v;
}
__global__ void after(const int* a, int* b, const int* w) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  b[0] = __ldg(a) + __ldg(w);  // pdl: pre-wait (marked, but the load runs after the wait)
}
"""


@needs_tools
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_audit_reports_a_marked_load_that_runs_after_the_wait(tmp_path):
    """The other direction (forty-first session: uv_combine's W_UV loads, written before the wait,
    ran after it in the machine code): every `// pdl: pre-wait` marker in cuda/ must accept a load
    that some kernel issues before its wait; a marker whose load runs after the wait is reported."""
    (tmp_path / "cuda").mkdir()
    src = tmp_path / "cuda" / "marks.cu"
    src.write_text(TINY_MARKS)
    cubin = tmp_path / "marks.cubin"
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "-lineinfo", "-o", str(cubin), str(src)], check=True,
                   capture_output=True)
    used = set()
    n, bad = audit.audit_cubin(NVDISASM, str(cubin), repo=str(tmp_path), used=used)
    assert n == 2 and not bad, bad
    marks = audit.marker_lines(str(tmp_path))
    lines = TINY_MARKS.splitlines()
    kept_line = next(i for i, t in enumerate(lines, 1) if "issued before the wait" in t)
    after_line = next(i for i, t in enumerate(lines, 1) if "runs after the wait" in t)
    assert marks == {("cuda/marks.cu", kept_line), ("cuda/marks.cu", after_line)}, marks
    assert marks - used == {("cuda/marks.cu", after_line)}, (marks, used)
