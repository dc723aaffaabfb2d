// round_kernels.h: small helper kernels of the GPU round and the model's graph replays that are
// not tree kernels (cuda/kernels.h) or model kernels (cuda/model/model_kernels.h). (The round's
// result gather is part of tree_accept_compact: TreeAcceptParams::result.)
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace kdtree {
namespace cuda {

// *dst = value, as a one-thread kernel: the value travels in the launch's arguments, so the host
// may change its copy right after the call (unlike a copy from host memory).
cudaError_t set_int32(int32_t* dst, int32_t value, cudaStream_t stream);

}  // namespace cuda
}  // namespace kdtree
