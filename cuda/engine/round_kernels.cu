// round_kernels.cu: see round_kernels.h.
#include "engine/round_kernels.h"
#include "launch.h"

namespace kdtree {
namespace cuda {
namespace {

__global__ void round_finish_kernel(RoundFinishParams p) {
  pdl_prologue();
  const int m = *p.count;
  const int t = threadIdx.x;
  for (int j = t; j + 1 < m && j < p.max_path; j += blockDim.x) p.result[3 + j] = p.node_tokens[p.path[j + 1]];
  __syncthreads();  // all reads of node_tokens done before next_root (may alias node_tokens[0]) is written
  if (t == 0) {
    const int b = *p.bonus;
    p.result[0] = m;
    p.result[1] = *p.n_nodes;
    p.result[2] = b;
    if (p.next_root) *p.next_root = b;
  }
}

__global__ void set_int32_kernel(int32_t* dst, int32_t value) {
  pdl_prologue();
  *dst = value;
}

}  // namespace

cudaError_t set_int32(int32_t* dst, int32_t value, cudaStream_t stream) {
  if (!dst) return cudaErrorInvalidValue;
  launch_kernel(set_int32_kernel, 1, 1, 0, stream, dst, value);
  return cudaGetLastError();
}

cudaError_t round_finish(const RoundFinishParams& p, cudaStream_t stream) {
  if (!p.node_tokens || !p.path || !p.count || !p.n_nodes || !p.bonus || !p.result || p.max_path < 0)
    return cudaErrorInvalidValue;
  launch_kernel(round_finish_kernel, 1, 128, 0, stream, p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kdtree
