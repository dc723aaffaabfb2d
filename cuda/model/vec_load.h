// vec_load.h: float / float4 loads through the read-only path and zeroing, shared by the
// skinny linear kernel (linear_kernels.cu) and the expert / MoE kernels (model_kernels.cu).
// CUDA sources only.
#pragma once
#include <cstdint>

#include <cuda_bf16.h>
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
// INT4 weights (ExpertGemmParams::w_int4, Kimi K2's W4A16 experts): the nibble q (0..15) with its group's
// scale s as the BF16 value the loader dequantizes it to, bf16_round((q - 8) * s), returned as the FP32 it
// stands for (low 16 bits zero). (q - 8) * s is exact in FP32 (4 x 8 significant bits; q - 8 itself comes
// exactly from 2^23 + q - (2^23 + 8)), so the one rounding, to nearest even, is the loader's.
__device__ __forceinline__ float int4_value(uint32_t q, float s) {
  const float v = __uint_as_float(0x4B000000u | q) - 8388616.f;
  return __bfloat162float(__float2bfloat16_rn(v * s));
}
// Eight INT4 weights in one word (element i in bits 4i .. 4i + 3, the packed stack's byte order) with their
// group's scale s (a BF16 value held as a float) as the FP32 values int4_value gives, two at a time in bf16x2
// arithmetic: (0x4300 | q) is the BF16 128 + q, fma(128 + q, 1, -136) = q - 8 exactly, and fma(q - 8, s, -0)
// rounds the exact product once, to nearest even, as int4_value's cvt does (the -0 addend keeps a zero
// product's sign). About three instructions a weight instead of int4_value's six.
__device__ __forceinline__ void int4x8_values(uint32_t w, float s, float (&v)[8]) {
  const uint32_t s2 = __byte_perm(__float_as_uint(s), 0u, 0x3232);  // (s, s)
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t pr = ((w >> (4 * j)) & 0x000F000Fu) | 0x43004300u;  // (128 + q_j, 128 + q_{j+4})
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(pr), "r"(0x3F803F80u), "r"(0xC308C308u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(d), "r"(s2), "r"(0x80008000u));
    v[j] = __uint_as_float(d << 16);
    v[j + 4] = __uint_as_float(d & 0xFFFF0000u);
  }
}
__device__ __forceinline__ void vzero(float& v) { v = 0.f; }
__device__ __forceinline__ void vzero(float4& v) { v = make_float4(0.f, 0.f, 0.f, 0.f); }
// host side: whether a pointer allows the 16-byte (float4 / cp.async) paths
inline bool aligned16(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15u) == 0; }
inline bool aligned8(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 7u) == 0; }

}  // namespace cuda
}  // namespace kdtree
