// device_math.h: small device-side math shared by the model kernels (CUDA sources only).
#pragma once
#include <cuda_runtime.h>

namespace kdtree {
namespace cuda {

// SwiGLU of one (gate, up) pair as the CPU model computes it (ops.cpp swiglu_row): silu(g) * u
// with silu(g) = g / (1 + exp(-g)), each operation rounded once (no contraction).
__device__ __forceinline__ float silu_mul(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))), u);
}
__device__ __forceinline__ float4 silu_mul(const float4& g, const float4& u) {
  return make_float4(silu_mul(g.x, u.x), silu_mul(g.y, u.y), silu_mul(g.z, u.z), silu_mul(g.w, u.w));
}

// RMSNorm's scale from a row's sum of squares (ops.cpp rmsnorm_row): the mean rounded to float,
// then 1 / sqrt in double.
__device__ __forceinline__ float rms_inv(double ss, int D, double eps) {
  const float var = (float)(ss / (double)D);
  return (float)(1.0 / sqrt((double)var + eps));
}

// Sum over the block (blockDim.x a multiple of 32) for a block that reduces once (no barrier
// needed before the shared writes); every thread gets the total, warps summed in order.
template <class V>
__device__ __forceinline__ V block_sum_once(V v, V* red /* [32] shared */) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  V t = V(0);
  for (int w = 0; w < nw; ++w) t += red[w];
  return t;
}

}  // namespace cuda
}  // namespace kdtree
