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
__device__ __forceinline__ void vzero(float& v) { v = 0.f; }
__device__ __forceinline__ void vzero(float4& v) { v = make_float4(0.f, 0.f, 0.f, 0.f); }
// host side: whether a pointer allows the 16-byte (float4 / cp.async) paths
inline bool aligned16(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15u) == 0; }

}  // namespace cuda
}  // namespace kdtree
