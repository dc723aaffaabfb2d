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
// then 1 / sqrt in double. The rmsnorm and mla_prep kernels and linear_skinny's norm prologue.
__device__ __forceinline__ float rms_inv(double ss, int D, double eps) {
  const float var = (float)(ss / (double)D);
  return (float)(1.0 / sqrt((double)var + eps));
}

// RoPE of one pair (ops.cpp rope_row): (a, b) = (x[2j], x[2j+1]) interleaved or (x[j], x[j+half]);
// the rotated pair goes to y[j], y[j + half] (each operation rounded once). mla_prep and the W_UK
// product's rope block (linear_skinny, which loads the pair itself) share rope_store, so their
// queries have the same bits.
__device__ __forceinline__ void rope_load(const float* x, int half, int j, int interleaved, float& a, float& b) {
  a = interleaved ? x[2 * j] : x[j];
  b = interleaved ? x[2 * j + 1] : x[j + half];
}
__device__ __forceinline__ void rope_store(float a, float b, float c, float s, int half, int j, float* y) {
  y[j] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  y[j + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

}  // namespace cuda
}  // namespace kdtree
