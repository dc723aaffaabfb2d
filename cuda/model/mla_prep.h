// mla_prep.h: one token's MLA preparation (the cache row and the roped queries, model_kernels.h
// MlaPrepParams) as block code, shared by the standalone mla_prep kernel (model_kernels.cu) and
// the extra blocks of a linear_skinny launch (linear_kernels.cu) that write the cache rows beside
// the q_b projection. Blocks that write cache rows have kPrepThreads threads on both paths, so the
// block reduction of the latent's sum of squares, and with it every bit, is the same. CUDA only.
#pragma once
#include <cuda_runtime.h>

#include "model/device_math.h"
#include "model/model_kernels.h"

namespace kdtree {
namespace cuda {

// RoPE of one pair (ops.cpp rope_row): (a, b) = (x[2j], x[2j+1]) interleaved or (x[j], x[j+half]).
__device__ __forceinline__ void rope_load(const float* x, int half, int j, int interleaved, float& a, float& b) {
  a = interleaved ? x[2 * j] : x[j];
  b = interleaved ? x[2 * j + 1] : x[j + half];
}
__device__ __forceinline__ void rope_store(float a, float b, float c, float s, int half, int j, float* y) {
  y[j] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  y[j + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// Token t's preparation by the whole block (blockDim.x a multiple of 32; every thread calls it):
// the parts of p.parts. Latent element i and rope pair u (u < half: the key's pair u; else head h
// = u / half - 1, pair u % half) belong to thread i % blockDim, u % blockDim. The first kPrepRegs
// of each kind per thread (inputs and their cos / sin) are loaded up front into registers, so the
// loads overlap; longer rows re-read the rest. One barrier (the latent's sum of squares), none for
// the queries alone.
constexpr int kPrepRegs = 4;
__device__ __forceinline__ void mla_prep_token(const MlaPrepParams& p, int t, double* red /* [32] shared */) {
  const int half = p.R / 2, C = p.C, Dn = p.Dn, Dqk = p.Dn + p.R;
  const bool rows = p.parts & kPrepCacheRows, queries = p.parts & kPrepQueries;
  const int tid = threadIdx.x, bd = blockDim.x;
  // rope pairs u in [u0, u1): the key's (u < half) with the cache row, the heads' with the queries
  const int u0 = rows ? 0 : half, u1 = queries ? (p.H + 1) * half : half, P = u1 - u0;
  const int CL = rows ? C : 0;  // latent elements
  const float* kv = p.kv + (size_t)t * p.ldkv;
  const float* q = p.q + (size_t)t * p.ldq;
  const float* cs = p.cs + (size_t)t * p.R;
  const int interleaved = p.interleaved;
  auto pair_src = [&](int u) { return u < half ? kv + C : q + (size_t)(u / half - 1) * Dqk + Dn; };
  float lv[kPrepRegs], lw[kPrepRegs], ra[kPrepRegs], rb[kPrepRegs], rc[kPrepRegs], rs[kPrepRegs];
#pragma unroll
  for (int m = 0; m < kPrepRegs; ++m) {
    const int i = tid + m * bd, u = u0 + i;
    lv[m] = i < CL ? kv[i] : 0.f;
    lw[m] = i < CL ? __ldg(p.kv_norm_w + i) : 0.f;
    ra[m] = rb[m] = rc[m] = rs[m] = 0.f;
    if (i < P) {
      rope_load(pair_src(u), half, u % half, interleaved, ra[m], rb[m]);
      rc[m] = cs[u % half];
      rs[m] = cs[half + u % half];
    }
  }
  float* row = nullptr;
  float inv = 0.f;
  if (rows) {  // block-uniform
    const long long row0 = p.row0_dev ? (long long)*p.row0_dev + p.row0 : p.row0;
    row = p.cache + (size_t)(row0 + t) * p.ldc;
    double ss = 0.0;
#pragma unroll
    for (int m = 0; m < kPrepRegs; ++m)
      if (tid + m * bd < C) ss += (double)lv[m] * (double)lv[m];
    for (int i = tid + kPrepRegs * bd; i < C; i += bd) ss += (double)kv[i] * (double)kv[i];
    ss = block_sum_once(ss, red);
    inv = rms_inv(ss, C, p.eps);
  }
  float* qr = p.q_rope + (size_t)t * p.H * p.R;
  auto dst = [&](int u) { return u < half ? row + C : qr + (size_t)(u / half - 1) * p.R; };
#pragma unroll
  for (int m = 0; m < kPrepRegs; ++m) {
    const int i = tid + m * bd, u = u0 + i;
    if (i < CL) row[i] = __fmul_rn(lw[m], __fmul_rn(lv[m], inv));
    if (i < P) rope_store(ra[m], rb[m], rc[m], rs[m], half, u % half, dst(u));
  }
  for (int i = tid + kPrepRegs * bd; i < CL; i += bd) row[i] = __fmul_rn(p.kv_norm_w[i], __fmul_rn(kv[i], inv));
  for (int i = tid + kPrepRegs * bd; i < P; i += bd) {
    const int u = u0 + i;
    float a, b;
    rope_load(pair_src(u), half, u % half, interleaved, a, b);
    rope_store(a, b, cs[u % half], cs[half + u % half], half, u % half, dst(u));
  }
}

}  // namespace cuda
}  // namespace kdtree
