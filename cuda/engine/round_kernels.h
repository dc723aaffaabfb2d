// round_kernels.h: the small kernels of the GPU DDTree round (cuda_rounds.h) that are not tree
// kernels (cuda/kernels.h) or model kernels (cuda/model/model_kernels.h).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace kdtree {
namespace cuda {

// After tree_accept: gathers what the host needs into one small array so that the round ends
// with a single device-to-host copy, and writes the bonus token as the next round's root.
//   result[0] = m (accepted path length, root included, >= 1)
//   result[1] = n (tree nodes the device built; the host checks it against what it asked for)
//   result[2] = bonus token
//   result[3 + j] = token of path node j+1, j < m - 1
struct RoundFinishParams {
  const int32_t* node_tokens;  // [1 + n] token of node i (node 0 = the root)
  const int32_t* path;         // [m] accepted node indices (path[0] = 0)
  const int32_t* count;        // [1] m
  const int32_t* n_nodes;      // [1] n
  const int32_t* bonus;        // [1]
  int32_t* result;             // [3 + max_path]
  int max_path;                // capacity: result holds at most max_path path tokens
  int32_t* next_root;          // [1] receives the bonus (may alias node_tokens[0]); may be null
};
cudaError_t round_finish(const RoundFinishParams& p, cudaStream_t stream);

// *dst = value, as a one-thread kernel: the value travels in the launch's arguments, so the host
// may change its copy right after the call (unlike a copy from host memory).
cudaError_t set_int32(int32_t* dst, int32_t value, cudaStream_t stream);

}  // namespace cuda
}  // namespace kdtree
