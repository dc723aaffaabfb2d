// verify_attention_common.h: device helpers shared by the verify attention kernels of
// verify_attention.cu (split-KV) and verify_attention_mma.cu (tensor cores): the committed length,
// the key mask and the masked online-softmax step of one chunk. CUDA sources only.
#pragma once
#include <cuda_runtime.h>

#include "kernels.h"

namespace kdtree {
namespace cuda {

__device__ __forceinline__ float attn_neg_inf() { return -__int_as_float(0x7f800000); }

// the committed length: from device memory when p.L_dev is set (graph capture), else p.L
__device__ __forceinline__ int attn_committed_len(const VerifyAttentionParams& p) {
  return p.L_dev ? *p.L_dev : p.L;
}

// key j (0 <= j) visible to tree node `node` (>= 0)? N = L + T keys: committed keys are, tree keys
// by the node's bitmask row, keys past N are not.
__device__ __forceinline__ bool attn_key_visible(const VerifyAttentionParams& p, int L, int N, int node, int j) {
  if (j < L) return true;
  if (j >= N) return false;
  const int t = j - L;
  return (p.visibility[(size_t)node * p.vis_stride + (t >> 6)] >> (t & 63)) & 1ull;
}

// L2 prefetch of a chunk's key rows j0 .. j0 + (threads / TPR) - 1 (those < N; rows of DQ floats,
// `stride` apart) before the chunk's cp.async copies need them: thread `sub` of TPR per row takes the
// 128-byte lines sub, sub + TPR, ... of row j0 + t / TPR (the split-KV kernel: TPR = 4; the tensor-core
// kernel: TPR = 8). No divisions: the loops that mapped a flat line index to (row, line) cost more
// instructions than the prefetches (thirty-eighth session).
template <int TPR, int DQ>
__device__ __forceinline__ void attn_prefetch_rows_l2(const float* kv, int stride, int j, int N, int sub) {
  static_assert(DQ % 32 == 0, "whole 128-byte lines");
  if (j >= N) return;
  const float* row = kv + (size_t)j * stride + 32 * sub;
#pragma unroll
  for (int i = 0; i < (DQ / 32 + TPR - 1) / TPR; ++i)
    if (32 * (sub + TPR * i) < DQ) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + 32 * TPR * i));
}

// does tree node `node` (-1: a padding row, none) see any of keys kbase + kofs + (0 .. KPT - 1)?
template <int KPT>
__device__ __forceinline__ bool attn_sees_any(const VerifyAttentionParams& p, int L, int N, int node, int kbase,
                                              int kofs) {
  bool any = false;
  if (node >= 0) {
#pragma unroll
    for (int e = 0; e < KPT; ++e) any |= attn_key_visible(p, L, N, node, kbase + kofs + e);
  }
  return any;
}

// The softmax scale of query row g (token g / H): p.scale, times the token's q_scale factor when given.
__device__ __forceinline__ float attn_row_scale(const VerifyAttentionParams& p, int g) {
  return p.q_scale ? p.scale * p.q_scale[g / p.H] : p.scale;
}

// One chunk's online-softmax step for one query row, TPR consecutive lanes per row, KPT keys each,
// in two parts around the caller's store of P (each kernel lays P out its own way):
//   attn_softmax_exp: v = the raw scores of keys kbase + kofs + (0 .. KPT - 1) of tree node `node` (-1:
//     a padding row, all masked) -> masked, scaled to the log2 domain (sl2 = scale * log2 e) and
//     exponentiated against the new row maximum over the TPR lanes (returned; mo = the row's
//     running maximum m before, sum = this lane's part of the row sum). A row with no visible key
//     keeps maximum -inf and gets P = 0.
//   attn_softmax_commit: the row sum over the TPR lanes; lane `leader` updates the row's running
//     (m, l) and alpha = 2^(m_old - m_new), the factor the row's O must be scaled by.
template <int KPT, int TPR>
__device__ __forceinline__ float attn_softmax_exp(const VerifyAttentionParams& p, int L, int N, int node, int kbase,
                                                 int kofs, float sl2, float (&v)[KPT], const float& m, float& mo, float& sum) {
  float mx = attn_neg_inf();
#pragma unroll
  for (int e = 0; e < KPT; ++e) {
    const bool ok = node >= 0 && attn_key_visible(p, L, N, node, kbase + kofs + e);
    v[e] = ok ? v[e] * sl2 : attn_neg_inf();
    mx = fmaxf(mx, v[e]);
  }
#pragma unroll
  for (int o = 1; o < TPR; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  mo = m;
  const float mn = fmaxf(mo, mx);
  sum = 0.f;
#pragma unroll
  for (int e = 0; e < KPT; ++e) {
    v[e] = (mn == attn_neg_inf()) ? 0.f : exp2f(v[e] - mn);
    sum += v[e];
  }
  return mn;
}

template <int TPR>
__device__ __forceinline__ void attn_softmax_commit(float sum, float mo, float mn, bool leader, float& m, float& l,
                                                    float& alpha) {
#pragma unroll
  for (int o = 1; o < TPR; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  __syncwarp();  // every lane of the row has read m before it changes
  if (leader) {
    const float a = (mo == attn_neg_inf()) ? 0.f : exp2f(mo - mn);
    l = l * a + sum;
    m = mn;
    alpha = a;
  }
}

}  // namespace cuda
}  // namespace kdtree
