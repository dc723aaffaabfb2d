// mla_prep_device.h: one token's MLA preparation (model_kernels.h, MlaPrepParams) as device code, shared by
// the mla_prep kernel (a block per token) and linear_skinny's rope blocks (LinearParams::prep_on), so both
// write the same bits. CUDA sources only.
#pragma once
#include <cuda_runtime.h>

#include "model/device_math.h"
#include "model_kernels.h"

namespace kdtree {
namespace cuda {

constexpr int kPrepRegs = 4;  // latent elements / rope pairs per (virtual) thread loaded up front

// Token t of p: cache row [kv_norm_w * rmsnorm(latent) | rope(k_rope)], the query rope parts unless skip_q,
// and q_scale_out[t]. Virtual thread vt (< vbd = threads_for(C)) does what thread vt of the mla_prep
// kernel does (elements and pairs vt + m vbd; the first MR of each kind loaded up front, the rest re-read: the
// same sums in the same order whatever MR); the activations are read with coherent loads (this may run
// behind a PDL wait inside a branch, cuda/launch.h). Two barriers; red / red2: [32] shared doubles each.
template <int NV, int MR = kPrepRegs>
__device__ __forceinline__ void mla_prep_token(const MlaPrepParams& p, int t, double* red, double* red2) {
  const int half = p.R / 2, C = p.C, H = p.H, Dn = p.Dn, Dqk = p.Dn + p.R, R = p.R;
  const int vbd = threads_for(C), bd = blockDim.x, P = (p.skip_q ? 1 : H + 1) * half;
  const float* kv = p.kv + (size_t)t * p.ldkv;
  const float* q = p.q + (p.skip_q ? 0 : (size_t)t * p.ldq);  // (skip_q: q unused, maybe null)
  const float* cs = p.cs + (size_t)t * p.R;
  const int il = p.interleaved;
  const long long row0 = p.row0_dev ? (long long)__ldcg(p.row0_dev) + p.row0 : p.row0;
  auto pair_src = [&](int u) { return u < half ? kv + C : q + (size_t)(u / half - 1) * Dqk + Dn; };
  auto pair_load = [&](int u, float& a, float& b) {
    const float* x = pair_src(u);
    const int j = u % half;
    a = __ldcg(x + (il ? 2 * j : j));
    b = __ldcg(x + (il ? 2 * j + 1 : j + half));
  };
  float lv[NV][MR], lw[NV][MR], ra[NV][MR], rb[NV][MR], rc[NV][MR], rs[NV][MR];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int vt = threadIdx.x + bd * j;
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      const int i = vt + m * vbd, u = i;
      const bool on = vt < vbd;
      lv[j][m] = on && i < C ? __ldcg(kv + i) : 0.f;
      lw[j][m] = on && i < C ? __ldg(p.kv_norm_w + i) : 0.f;
      ra[j][m] = rb[j][m] = rc[j][m] = rs[j][m] = 0.f;
      if (on && u < P) {
        pair_load(u, ra[j][m], rb[j][m]);
        rc[j][m] = __ldcg(cs + u % half);
        rs[j][m] = __ldcg(cs + half + u % half);
      }
    }
  }
  double ss[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int vt = threadIdx.x + bd * j;
    ss[j] = 0.0;
    if (vt < vbd) {
#pragma unroll
      for (int m = 0; m < MR; ++m)
        if (vt + m * vbd < C) ss[j] += (double)lv[j][m] * (double)lv[j][m];
      for (int i = vt + MR * vbd; i < C; i += vbd) {
        const float x = __ldcg(kv + i);
        ss[j] += (double)x * (double)x;
      }
    }
  }
  const float inv = rms_inv(block_sum_virtual<NV>(ss, red, vbd), C, p.eps);
  float* row = p.cache + (size_t)(row0 + t) * p.ldc;
  float* qr = p.q_rope + (size_t)t * H * R;
  auto dst = [&](int u) { return u < half ? row + C : qr + (size_t)(u / half - 1) * R; };
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int vt = threadIdx.x + bd * j;
    if (vt >= vbd) continue;
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      const int i = vt + m * vbd, u = i;
      if (i < C) row[i] = __fmul_rn(lw[j][m], __fmul_rn(lv[j][m], inv));
      if (u < P) rope_store(ra[j][m], rb[j][m], rc[j][m], rs[j][m], half, u % half, dst(u));
    }
    for (int i = vt + MR * vbd; i < C; i += vbd)
      row[i] = __fmul_rn(__ldg(p.kv_norm_w + i), __fmul_rn(__ldcg(kv + i), inv));
    for (int u = vt + MR * vbd; u < P; u += vbd) {
      float a, b;
      pair_load(u, a, b);
      rope_store(a, b, __ldcg(cs + u % half), __ldcg(cs + half + u % half), half, u % half, dst(u));
    }
  }
  if (p.q_scale_out) {  // block-uniform: the folded query norm's factor
    const float* qa = p.qa + (size_t)t * p.ldqa;
    double sq[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int vt = threadIdx.x + bd * j;
      sq[j] = 0.0;
      if (vt < vbd)
        for (int i = vt; i < p.qa_n; i += vbd) {
          const float x = __ldcg(qa + i);
          sq[j] += (double)x * (double)x;
        }
    }
    const double s = block_sum_virtual<NV>(sq, red2, vbd);
    if (threadIdx.x == 0) p.q_scale_out[t] = rms_inv(s, p.qa_n, p.qa_eps);
  }
}

}  // namespace cuda
}  // namespace kdtree
