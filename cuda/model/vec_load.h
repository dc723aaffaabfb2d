// vec_load.h: float / float4 loads through the read-only path and zeroing, shared by the
// skinny linear kernel (linear_kernels.cu) and the expert / MoE kernels (model_kernels.cu).
// CUDA sources only.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace kdtree {
namespace cuda {

template <class VT>
__device__ __forceinline__ VT ldg_vec(const float* p);
template <>
__device__ __forceinline__ float ldg_vec<float>(const float* p) { return __ldg(p); }
template <>
__device__ __forceinline__ float4 ldg_vec<float4>(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
// BF16 weights (the exact BF16 copies of CudaModel, bf16_weight_copies): four BF16 values in 8
// bytes, widened to the FP32 values they stand for (exact: a BF16 is the high half of its FP32),
// streamed past L1. Element i is the low half of word i / 2 (little-endian).
__device__ __forceinline__ float4 ldg_bf16x4(const uint16_t* p) {
  unsigned a, b;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "l"(p));
  return make_float4(__uint_as_float(a << 16), __uint_as_float(a & 0xffff0000u), __uint_as_float(b << 16),
                     __uint_as_float(b & 0xffff0000u));
}
__device__ __forceinline__ void vzero(float& v) { v = 0.f; }
__device__ __forceinline__ void vzero(float4& v) { v = make_float4(0.f, 0.f, 0.f, 0.f); }
// host side: whether a pointer allows the 16-byte (float4 / cp.async) paths
inline bool aligned16(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15u) == 0; }
inline bool aligned8(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 7u) == 0; }

}  // namespace cuda
}  // namespace kdtree
