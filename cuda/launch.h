// launch.h: how every kernel of the CUDA backend is launched — with Programmatic Dependent
// Launch (PDL, sm_90+) — and the device-side half of that contract. Included by the .cu files.
//
// Why: a model step is ~140 small dependent kernels in one CUDA graph. Launched plainly, each
// kernel's blocks are scheduled only after the previous kernel has drained, and its first loads
// start from cold: per kernel a few microseconds of ramp-up and tail where the GPU does little.
// With PDL (cudaLaunchAttributeProgrammaticStreamSerialization) a kernel's blocks may become
// resident while its predecessor still runs; they wait in `griddepcontrol.wait` until the
// predecessor has completed and its memory is visible. Work that needs nothing from earlier
// kernels (streaming a weight matrix that no kernel writes) can be issued before that wait.
//
// The contract every kernel launched through launch_kernel() keeps (all kernels of cuda/):
//   * pdl_prologue() (or pdl_trigger() + pdl_wait()) runs in every thread before any global
//     write and before any read of data an earlier kernel may write; only immutable data
//     (model weights) may be read before pdl_wait(). Every thread waiting also keeps the chain
//     transitive: a grid cannot complete before its predecessor has, so a kernel that reads the
//     output of the kernel two launches back is safe too.
//   * pdl_trigger() (griddepcontrol.launch_dependents) at the start lets the next kernel launch
//     once every block of this one has started; its blocks then only hold SM slots while they
//     wait, after all of this kernel's blocks are resident.
//   * One exception to "only immutable data before the wait": a kernel whose predecessor calls
//     pdl_trigger() only after its own pdl_wait() may read, before its wait, what the kernel two
//     launches back wrote (through L2: __ldcg): once every block of the predecessor has passed its
//     wait, that kernel has completed. Used by the routed experts' down projection, which reads the
//     MoE schedule and starts its weight copies while the gate/up grid drains (expert_mma.cu, PRE).
//   * A wait that only some threads or launches execute (behind a run-time branch) does not
//     order the loads after it in the source: ptxas may hoist an `ld.global.nc` (__ldg) above a
//     griddepcontrol.wait that sits in a branch. Seen on sm_90 with CUDA 13.0 (seventeenth session:
//     an expert kernel with `if (!flag) pdl_wait();` read the previous layer's schedule with the
//     flag off; nvdisasm showed the LDG.E.CONSTANT above the ACQBULK). So: an unconditional wait
//     per instantiation (make the choice a template parameter), or coherent loads (__ldcg / plain)
//     for anything an earlier kernel wrote. scripts/check_pdl_loads.py (tests/python/
//     test_pdl_audit.py) checks the machine code: every load that a path reaches before the wait
//     must sit on a source line marked `pdl: pre-wait`.
//   * The other way round, a load written before the wait may be issued after it: ptxas can sink
//     it to its first use (an __ldg, or even a volatile asm load; seen in uv_combine, forty-first
//     session). Where the overlap matters, make something before the wait need the value (a
//     volatile shared store of it) or copy with cp.async; the audit reports a `pdl: pre-wait`
//     marker that accepts no load before the wait.
// Without the attribute (pre-sm_90 GPUs, KDTREE_CUDA_PDL=0, cuda::set_pdl(false)) both
// instructions are no-ops and launches are ordinary stream-ordered launches.
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "kernels.h"  // pdl_enabled() / set_pdl(): the process-wide switch (defined in cuda_device.cu)

namespace kdtree {
namespace cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_prologue() {
  pdl_trigger();
  pdl_wait();
}

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute when enabled. Returns the
// launch's error (also left for cudaGetLastError()).
template <class... Params, class... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// The same launch without the PDL attribute: the kernel starts only after everything before it in
// the stream has completed. A model step's first kernel is launched so, which makes every row of
// the cache committed before the step (and the committed length) safe to read before pdl_wait()
// anywhere in the step: each later kernel can only start after this one has started.
template <class... Params, class... Args>
cudaError_t launch_kernel_ordered(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                  Args&&... args) {
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kdtree
