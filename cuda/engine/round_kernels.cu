// round_kernels.cu: see round_kernels.h.
#include "engine/round_kernels.h"
#include "launch.h"

namespace kdtree {
namespace cuda {
namespace {

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

}  // namespace cuda
}  // namespace kdtree
