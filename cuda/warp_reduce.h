// warp_reduce.h: warp-level reductions shared by the kernels (device code only).
#pragma once
#include <cuda_runtime.h>

namespace kdtree {
namespace cuda {

// One step of the warp reduce-scatter over 32 values per lane: lanes with bit OFF set keep the
// upper half of the live values, the others the lower half, and add their partner's copy.
template <int OFF>
__device__ __forceinline__ void rs_step(float* v, int lane) {
  const bool up = (lane & OFF) != 0;
#pragma unroll
  for (int j = 0; j < OFF; ++j) {
    const float send = up ? v[j] : v[j + OFF];
    const float keep = up ? v[j + OFF] : v[j];
    v[j] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
  }
}
// v[0..31] per lane -> returns, on lane l, the warp sum of v[l] (31 shuffles for 32 sums; the
// summation order is fixed, so the result is deterministic).
__device__ __forceinline__ float reduce_scatter32(float* v, int lane) {
  rs_step<16>(v, lane);
  rs_step<8>(v, lane);
  rs_step<4>(v, lane);
  rs_step<2>(v, lane);
  rs_step<1>(v, lane);
  return v[0];
}

}  // namespace cuda
}  // namespace kdtree
