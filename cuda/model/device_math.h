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

// The block size of the one-block-per-row kernels (rmsnorm, mla_prep, embed, the MoE combine): the
// smallest power of two >= n from 32 to 256. Their reductions' order depends on it.
__host__ __device__ constexpr int threads_for(int n) {
  int t = 32;
  while (t < n && t < 256) t *= 2;
  return t;
}

// The sum of a block of vbd threads (a multiple of 32) as one barrier's reduction forms it: each warp's
// values by an xor tree, then the warps in order. The block may run fewer threads than vbd: thread
// tid + blockDim.x * j stands for v[j] (j < NV, vbd <= NV * blockDim.x, vbd = blockDim.x when NV = 1;
// linear_skinny's prep blocks play mla_prep's 256 threads with 128). red: [32] shared, reused only
// after another barrier.
template <int NV, class V>
__device__ __forceinline__ V block_sum_virtual(const V (&v)[NV], V* red, int vbd) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5, vw = vbd >> 5;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    V x = v[j];
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    if (lane == 0 && (NV == 1 || warp + nw * j < vw)) red[warp + nw * j] = x;  // (NV = 1: vbd = blockDim.x)
  }
  __syncthreads();
  V t = V(0);
  for (int w = 0; w < vw; ++w) t += red[w];
  return t;
}
// ... of the block's own threads (no barrier needed before the shared writes)
template <class V>
__device__ __forceinline__ V block_sum_once(V v, V* red /* [32] shared */) {
  const V a[1] = {v};
  return block_sum_virtual<1>(a, red, (int)blockDim.x);
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
