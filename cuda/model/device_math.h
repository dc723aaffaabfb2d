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

// Block b of nb asks the L2 for its share of [base, base + bytes) (16-byte aligned, a multiple of
// 16 bytes) with one bulk prefetch from thread 0 (sm_90+; a no-op before). Only for data no kernel
// of the step writes (weights): it may run before the PDL wait.
__device__ __forceinline__ void l2_prefetch_share(const void* base, long long bytes, long long b, long long nb) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (!base || bytes <= 0 || threadIdx.x != 0) return;
  const long long per = ((bytes + nb - 1) / nb + 15) / 16 * 16;
  const long long off = b * per;
  if (off >= bytes) return;
  const long long n = bytes - off < per ? bytes - off : per;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(static_cast<const char*>(base) + off), "r"((unsigned)n)
               : "memory");
#endif
}

}  // namespace cuda
}  // namespace kdtree
