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

// Asks the L2 for [base, base + bytes) (16-byte aligned, a multiple of 16 bytes) in bulk prefetches
// of 64 KiB from the calling thread (sm_90+; a no-op before). Immutable data only (weights).
__device__ __forceinline__ void l2_prefetch_range(const void* base, long long bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const char* b = static_cast<const char*>(base);
  for (long long off = 0; off < bytes; off += 65536) {
    const long long n = bytes - off < 65536 ? bytes - off : 65536;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(b + off), "r"((unsigned)n) : "memory");
  }
#endif
}

}  // namespace cuda
}  // namespace kdtree
