// verify_attention.cu: MLA tree-verify attention in FP32 (absorbed form), CUDA cores.
//
// MLA shares one latent K/V row (C + R = 576 floats) across all H heads, so the T*H query rows
// form one big "MQA" problem: S = Q [M x 576] . K^T, P = softmax(S) (running max), O = P . V
// with V = the first C = 512 columns of the same rows. The fast kernel tiles it like an SGEMM:
// a block owns BM = 64 query rows (row m = node * H + head) and streams the keys in tiles of
// BN = 128: phase 1 computes the 64 x 128 score tile from 32-wide d-chunks of Q and K
// (cp.async double-buffered in shared memory, 4x8 register tile per thread, 16-byte loads that
// broadcast within a warp), phase 2 does the online softmax (per-row max/sum across the
// block), phase 3 accumulates O [64 x 512] += P . V from 16-key chunks of V (8x16 register tile
// per thread, 128 accumulators). Committed keys (rows < L) need no mask; the tree's own rows
// are gathered per block as the union of the visible tree rows of the block's nodes, masked
// per (row, key) by the bitmask, so a block computes ~17 tree keys per node, not T. When there
// are too few row blocks to fill the GPU, the committed keys are split over blockIdx.y and a
// second kernel merges the partial (O, max, sum). A plain one-row-per-block kernel is kept for
// other shapes (C != 512 or R != 64, T > 2048, unaligned rows) and as a test oracle.
//
// A second fast kernel, the split-KV decode kernel (flash-decoding style), serves few query rows
// and short contexts, where the 64 x 128 tiles above leave most SMs idle and each block's tile
// is long: a block owns 16 query rows and a contiguous range of 32-key chunks; the grid is
// (row groups, key splits) and the same combine kernel merges the splits. A third, on the tensor
// cores (3xTF32, FP32-accurate; verify_attention_mma.cu), has the split-KV structure with 32-row
// blocks and runs where a measured rule says it is faster (mma_wins: trees of 17+ tokens at H = 16
// and every big problem); otherwise verify_attention() picks the cheaper CUDA-core kernel from a
// small cost model (constants in `namespace cost`).
// With p.L_dev set, every kernel reads the committed length from device memory (p.L is then the
// host's upper bound, used for the grid, the split count and the workspace only), so one
// launch can be captured in a CUDA graph and replayed as L grows.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "kernels.h"
#include "launch.h"
#include "verify_attention_common.h"
#include "verify_attention_exact.h"
#include "verify_attention_mma.h"
#include "warp_reduce.h"

namespace kdtree {
namespace cuda {
namespace {

constexpr int BM = 64, BN = 128, VK = 16, NT = 256;
constexpr int C_ = 512, R_ = 64, DQ = C_ + R_;
constexpr int PS = BN + 8;   // shared row stride of the P tile
constexpr int VS = C_ + 4;   // shared row stride of V chunks
constexpr int kMaxTreeRows = 2048;
constexpr float kLog2e = 1.4426950408889634f;

template <int DK>
struct __align__(16) Smem {
  static constexpr int QS = DK + 4;  // shared row stride of Q/K chunks (conflict-free 16-byte reads)
  float q[2][BM][QS];
  float k[2][BN][QS];
  float v[2][VK][VS];
  float p[BM][PS];
  float red_max[2][BM];
  float red_sum[2][BM];
  float m[BM], l[BM], alpha[BM];
  int keyrow[BN];              // cache row of each key of the current tile, -1 = none
  int tlist[kMaxTreeRows];     // visible tree rows (union over the block's nodes)
  unsigned long long vor[kMaxTreeRows / 64];
  int ntree;
  int L;                       // committed length (p.L or *p.L_dev)
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  int sz = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(sz));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void cp_async_wait0() { asm volatile("cp.async.wait_group 0;\n" ::); }


struct Tiles {
  int tb, te;   // committed tiles [tb, te) of this split
  int ntt;      // tree tiles (this split only if it is the last)
  __device__ int count() const { return (te - tb) + ntt; }
};

// cache row of key kk (0..BN-1) of tile index `it` (0-based within this block's sequence)
template <class S>
__device__ __forceinline__ int tile_key_row(const VerifyAttentionParams& p, const S& s,
                                            const Tiles& t, int it, int kk) {
  int nc = t.te - t.tb;
  if (it < nc) {
    int key = (t.tb + it) * BN + kk;
    return key < s.L ? key : -1;
  }
  int idx = (it - nc) * BN + kk;
  return idx < s.ntree ? s.L + s.tlist[idx] : -1;
}

template <int DK>
__device__ __forceinline__ void issue_qk(const VerifyAttentionParams& p, Smem<DK>& s, int m0, int M,
                                         int c, int buf) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int r2 = 0; r2 < (BM * (DK / 4)) / NT; ++r2) {
    int idx = tid + r2 * NT;
    int r = idx / (DK / 4), f = idx % (DK / 4), g = m0 + r, d = c * DK + f * 4;
    bool ok = g < M;
    const float* src = p.q_latent;
    if (ok) src = d < C_ ? p.q_latent + (size_t)g * C_ + d : p.q_rope + (size_t)g * R_ + (d - C_);
    cp_async16(&s.q[buf][r][f * 4], src, ok);
  }
#pragma unroll
  for (int r2 = 0; r2 < (BN * (DK / 4)) / NT; ++r2) {
    int idx = tid + r2 * NT;
    int kk = idx / (DK / 4), f = idx % (DK / 4);
    int row = s.keyrow[kk];
    bool ok = row >= 0;
    const float* src = ok ? p.kv + (size_t)row * p.kv_stride + c * DK + f * 4 : p.kv;
    cp_async16(&s.k[buf][kk][f * 4], src, ok);
  }
}

template <class S>
__device__ __forceinline__ void issue_v(const VerifyAttentionParams& p, S& s, int vc, int buf) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int r2 = 0; r2 < (VK * (C_ / 4)) / NT; ++r2) {
    int idx = tid + r2 * NT;
    int kr = idx >> 7, f = idx & 127;
    int row = s.keyrow[vc * VK + kr];
    bool ok = row >= 0;
    const float* src = ok ? p.kv + (size_t)row * p.kv_stride + f * 4 : p.kv;
    cp_async16(&s.v[buf][kr][f * 4], src, ok);
  }
}

// out_partial layout when split: ws_o [splits][M][C], ws_ml [splits][M][2] (max in log2 units, sum)
template <int DK>
__global__ void __launch_bounds__(NT, 1) mla_verify_fast_kernel(VerifyAttentionParams p) {
  pdl_prologue();
  constexpr int NDC = DQ / DK;
  extern __shared__ __align__(16) unsigned char smraw[];
  Smem<DK>& s = *reinterpret_cast<Smem<DK>*>(smraw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int M = p.T * p.H;
  const int m0 = blockIdx.x * BM;
  const int split = blockIdx.y, nsplit = gridDim.y;
  const int Lc = attn_committed_len(p);  // the split ranges follow the device length (<= p.L)
  const int nLt = (Lc + BN - 1) / BN;
  const int tps = (nLt + nsplit - 1) / nsplit;
  Tiles tiles;
  tiles.tb = split * tps < nLt ? split * tps : nLt;
  tiles.te = tiles.tb + tps < nLt ? tiles.tb + tps : nLt;
  const bool do_tree = split == nsplit - 1;

  // ---- union of the visible tree rows of this block's nodes
  if (do_tree) {
    const int mlast = (m0 + BM < M ? m0 + BM : M) - 1;
    const int i0 = m0 / p.H, i1 = mlast / p.H;
    const int Wt = (p.T + 63) / 64;
    for (int w = tid; w < Wt; w += NT) {
      unsigned long long v = 0;
      for (int i = i0; i <= i1; ++i) v |= p.visibility[(size_t)i * p.vis_stride + w];
      if (w == Wt - 1 && (p.T & 63)) v &= (1ull << (p.T & 63)) - 1;
      s.vor[w] = v;
    }
    __syncthreads();
    if (tid == 0) {
      int n = 0;
      for (int w = 0; w < Wt; ++w) {
        unsigned long long b = s.vor[w];
        while (b) {
          int bit = __ffsll((long long)b) - 1;
          s.tlist[n++] = w * 64 + bit;
          b &= b - 1;
        }
      }
      s.ntree = n;
    }
  } else if (tid == 0) {
    s.ntree = 0;
  }
  if (tid < BM) {
    s.m[tid] = attn_neg_inf();
    s.l[tid] = 0.f;
  }
  if (tid == 0) s.L = Lc;
  __syncthreads();
  tiles.ntt = do_tree ? (s.ntree + BN - 1) / BN : 0;
  const int ntiles = tiles.count();

  // thread layouts
  const int wr = warp & 3, wk = warp >> 2;        // phase 1: 4 row groups x 2 key groups
  const int lr = lane & 3, lk = lane >> 2;
  const int wr3 = warp & 1, wc = warp >> 1;       // phase 3: 2 row groups x 4 col groups
  const int lc = lane >> 2;
  const float sl2 = p.scale * kLog2e;

  float O[8][16];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 16; ++j) O[i][j] = 0.f;

  if (ntiles > 0) {
    if (tid < BN) s.keyrow[tid] = tile_key_row(p, s, tiles, 0, tid);
    __syncthreads();
    issue_qk(p, s, m0, M, 0, 0);
  }
  cp_async_commit();

  for (int it = 0; it < ntiles; ++it) {
    const bool tree_tile = it >= tiles.te - tiles.tb;
    // ---------------- phase 1: S = Q K^T
    float acc[4][8];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
    for (int c = 0; c < NDC; ++c) {
      if (c + 1 < NDC) issue_qk(p, s, m0, M, c + 1, (c + 1) & 1);
      else issue_v(p, s, 0, 0);
      cp_async_commit();
      cp_async_wait1();
      __syncthreads();
      const int buf = c & 1;
#pragma unroll
      for (int dd = 0; dd < DK; dd += 4) {
        float4 qv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) qv[i] = *reinterpret_cast<const float4*>(&s.q[buf][16 * wr + lr + 4 * i][dd]);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          float4 k4 = *reinterpret_cast<const float4*>(&s.k[buf][64 * wk + lk + 8 * j][dd]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            acc[i][j] = fmaf(qv[i].x, k4.x, acc[i][j]);
            acc[i][j] = fmaf(qv[i].y, k4.y, acc[i][j]);
            acc[i][j] = fmaf(qv[i].z, k4.z, acc[i][j]);
            acc[i][j] = fmaf(qv[i].w, k4.w, acc[i][j]);
          }
        }
      }
      __syncthreads();
    }
    // ---------------- phase 2: mask + online softmax (log2 domain)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 16 * wr + lr + 4 * i;
      const int g = m0 + r;
      const int node = g < M ? g / p.H : -1;
      const float rsl2 = node >= 0 ? attn_row_scale(p, g) * kLog2e : sl2;  // (q_scale: the row's token's factor)
      float mx = attn_neg_inf();
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int kk = 64 * wk + lk + 8 * j;
        const int row = s.keyrow[kk];
        bool ok = row >= 0;
        if (ok && tree_tile) {
          const int t = row - s.L;
          ok = node >= 0 && ((p.visibility[(size_t)node * p.vis_stride + (t >> 6)] >> (t & 63)) & 1ull);
        }
        acc[i][j] = ok ? acc[i][j] * rsl2 : attn_neg_inf();
        mx = fmaxf(mx, acc[i][j]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      if (lk == 0) s.red_max[wk][r] = mx;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 16 * wr + lr + 4 * i;
      const float mn = fmaxf(s.m[r], fmaxf(s.red_max[0][r], s.red_max[1][r]));
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int kk = 64 * wk + lk + 8 * j;
        float pv = (mn == attn_neg_inf()) ? 0.f : exp2f(acc[i][j] - mn);
        s.p[r][kk] = pv;
        sum += pv;
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 4);
      sum += __shfl_xor_sync(0xffffffffu, sum, 8);
      sum += __shfl_xor_sync(0xffffffffu, sum, 16);
      if (lk == 0) s.red_sum[wk][r] = sum;
    }
    __syncthreads();
    if (tid < BM) {
      const int r = tid;
      const float mo = s.m[r];
      const float mn = fmaxf(mo, fmaxf(s.red_max[0][r], s.red_max[1][r]));
      const float alpha = (mo == attn_neg_inf()) ? 0.f : exp2f(mo - mn);
      s.l[r] = s.l[r] * alpha + s.red_sum[0][r] + s.red_sum[1][r];
      s.m[r] = mn;
      s.alpha[r] = alpha;
    }
    __syncthreads();
    // ---------------- phase 3: O = alpha * O + P V
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float a = s.alpha[32 * wr3 + lr + 4 * i];
#pragma unroll
      for (int j = 0; j < 16; ++j) O[i][j] *= a;
    }
    for (int vc = 0; vc < BN / VK; ++vc) {
      if (vc + 1 < BN / VK) {
        issue_v(p, s, vc + 1, (vc + 1) & 1);
      } else if (it + 1 < ntiles) {
        // all V chunks of this tile are in flight or landed: switch keyrow to the next tile
        if (tid < BN) s.keyrow[tid] = tile_key_row(p, s, tiles, it + 1, tid);
        __syncthreads();
        issue_qk(p, s, m0, M, 0, 0);
      }
      cp_async_commit();
      cp_async_wait1();
      __syncthreads();
      const int buf = vc & 1;
#pragma unroll
      for (int kq = 0; kq < VK; kq += 4) {
        float4 pv[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) pv[i] = *reinterpret_cast<const float4*>(&s.p[32 * wr3 + lr + 4 * i][vc * VK + kq]);
#pragma unroll
        for (int k4 = 0; k4 < 4; ++k4) {
          float4 v4[4];
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) v4[jj] = *reinterpret_cast<const float4*>(&s.v[buf][kq + k4][128 * wc + 32 * jj + 4 * lc]);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float pp = k4 == 0 ? pv[i].x : (k4 == 1 ? pv[i].y : (k4 == 2 ? pv[i].z : pv[i].w));
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
              O[i][4 * jj + 0] = fmaf(pp, v4[jj].x, O[i][4 * jj + 0]);
              O[i][4 * jj + 1] = fmaf(pp, v4[jj].y, O[i][4 * jj + 1]);
              O[i][4 * jj + 2] = fmaf(pp, v4[jj].z, O[i][4 * jj + 2]);
              O[i][4 * jj + 3] = fmaf(pp, v4[jj].w, O[i][4 * jj + 3]);
            }
          }
        }
      }
      __syncthreads();
    }
  }
  cp_async_wait0();

  // ---------------- epilogue
  const bool final_out = nsplit == 1;
  float* wso = (float*)p.workspace;
  float* wsml = wso + (size_t)nsplit * M * C_;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = 32 * wr3 + lr + 4 * i;
    const int g = m0 + r;
    if (g >= M) continue;
    const float l = s.l[r];
    const float inv = final_out ? (l > 0.f ? 1.f / l : 0.f) : 1.f;
    float* dst = final_out ? p.out + (size_t)g * C_ : wso + ((size_t)split * M + g) * C_;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      float4 o;
      o.x = O[i][4 * jj + 0] * inv;
      o.y = O[i][4 * jj + 1] * inv;
      o.z = O[i][4 * jj + 2] * inv;
      o.w = O[i][4 * jj + 3] * inv;
      *reinterpret_cast<float4*>(dst + 128 * wc + 32 * jj + 4 * lc) = o;
    }
    if (!final_out && wc == 0 && lc == 0) {
      wsml[((size_t)split * M + g) * 2 + 0] = s.m[r];
      wsml[((size_t)split * M + g) * 2 + 1] = l;
    }
  }
}

// merge split partials: one block of C/4 = 128 threads per query row. The splits' (max, sum)
// are read in parallel (one split per thread) and their weights w = 2^(max - global max) staged
// in shared memory, so the O loop has independent loads (many in flight) instead of a serial
// chain per split. A split with max = -inf (it saw no key) is skipped. The first kCombinePre
// splits' partials of the thread's 4 columns are loaded together with the (max, sum) pairs,
// before the weights are known, so the kernel waits for one round trip to the L2, not three
// (max, then (max, sum) again, then O); the arithmetic and its order are unchanged.
constexpr int kCombineThreads = C_ / 4;
constexpr int kCombinePre = 16;
__global__ void __launch_bounds__(kCombineThreads) mla_verify_combine_kernel(VerifyAttentionParams p, int nsplit) {
  pdl_prologue();
  __shared__ float sw[kCombineThreads], swl[kCombineThreads], red[kCombineThreads / 32];
  const int M = p.T * p.H;
  const int g = blockIdx.x;
  const int tid = threadIdx.x;
  const float* wso = (const float*)p.workspace;
  const float* wsml = wso + (size_t)nsplit * M * C_;
  // this thread's split of the first round: its (max, sum)
  float m0 = attn_neg_inf(), l0 = 0.f;
  if (tid < nsplit) {
    const float2 ml = *reinterpret_cast<const float2*>(wsml + ((size_t)tid * M + g) * 2);
    m0 = ml.x;
    l0 = ml.y;
  }
  float4 pre[kCombinePre];  // (an empty split's slot may hold anything: loaded, but its w is 0, so never used)
#pragma unroll
  for (int k = 0; k < kCombinePre; ++k)
    if (k < nsplit) pre[k] = *reinterpret_cast<const float4*>(wso + ((size_t)k * M + g) * C_ + 4 * tid);
  float mx = fmaxf(attn_neg_inf(), m0);  // (as the loop below: a NaN max never wins)
  for (int sp = tid + kCombineThreads; sp < nsplit; sp += kCombineThreads)
    mx = fmaxf(mx, wsml[((size_t)sp * M + g) * 2]);
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if ((tid & 31) == 0) red[tid >> 5] = mx;
  __syncthreads();
  mx = red[0];
#pragma unroll
  for (int w = 1; w < kCombineThreads / 32; ++w) mx = fmaxf(mx, red[w]);
  float den = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int base = 0; base < nsplit; base += kCombineThreads) {
    const int sp = base + tid;
    if (sp < nsplit) {
      float m = m0, l = l0;
      if (base > 0) {
        m = wsml[((size_t)sp * M + g) * 2];
        l = wsml[((size_t)sp * M + g) * 2 + 1];
      }
      const float w = m == attn_neg_inf() ? 0.f : exp2f(m - mx);
      sw[tid] = w;
      swl[tid] = w * l;
    }
    __syncthreads();
    const int n = nsplit - base < kCombineThreads ? nsplit - base : kCombineThreads;
    int k = 0;
    if (base == 0) {
#pragma unroll
      for (; k < kCombinePre; ++k) {
        if (k >= n) break;
        const float w = sw[k];
        den += swl[k];
        if (w != 0.f) {
          acc.x = fmaf(w, pre[k].x, acc.x);
          acc.y = fmaf(w, pre[k].y, acc.y);
          acc.z = fmaf(w, pre[k].z, acc.z);
          acc.w = fmaf(w, pre[k].w, acc.w);
        }
      }
    }
#pragma unroll 8
    for (; k < n; ++k) {
      const float w = sw[k];
      den += swl[k];
      if (w != 0.f) {
        const float4 o = *reinterpret_cast<const float4*>(wso + ((size_t)(base + k) * M + g) * C_ + 4 * tid);
        acc.x = fmaf(w, o.x, acc.x);
        acc.y = fmaf(w, o.y, acc.y);
        acc.z = fmaf(w, o.z, acc.z);
        acc.w = fmaf(w, o.w, acc.w);
      }
    }
    __syncthreads();
  }
  const float inv = den > 0.f ? 1.f / den : 0.f;
  acc.x *= inv;
  acc.y *= inv;
  acc.z *= inv;
  acc.w *= inv;
  *reinterpret_cast<float4*>(p.out + (size_t)g * C_ + 4 * tid) = acc;
}

// ---------------------------------------------------------------- split-KV decode kernel
// For few query rows (decode, small trees) and short contexts. A block of 128 threads owns
// RG = 16 query rows (rows past M are zero and fully masked) and the contiguous range of
// 32-key chunks [c0, c1) of split blockIdx.y over the L + T keys (whole chunks; the ranges
// follow the device length, so a split can be empty and then writes max = -inf, sum = 0).
// Per chunk: the 32 key rows land in shared memory in 9 cp.async groups of 64 columns, and
// phase 1 (S = Q K^T, 16 x 32) starts on the first group while the rest is in flight; phase 2
// masks (key < L: visible; L <= key < L+T: the node's bitmask; beyond: no key) and does the
// online softmax in the log2 domain (the tiled kernel's formulas); phase 3 O[16 x 512] +=
// P V with V = the first 512 columns of the same rows (no second load). A chunk that no row of
// the group sees (only in the tree region) is skipped whole, which is exact.
// Shared memory: Q [16][580] (37 KB, loaded once) + one K chunk [32][580] (74 KB) + P
// [16][36] = 113,856 B. Single-buffered on purpose: KC = 32 double-buffered (185 KB) would
// leave one block per SM; single-buffered, two blocks fit in the SM's 228 KB (2 x (111.2 KB + 1
// KB reserved)), so one block's loads overlap the other's arithmetic, and within a block the
// 9 column groups overlap the chunk's load latency with phase 1. (KC = 16 double-buffered
// would fit too but halves the work between barriers and doubles the per-chunk overheads.)
// Thread mappings: phase 1: warp w owns keys 8w..8w+7 of all 16 rows; lane (h = lane%4,
// kt = lane/4%2, rt = lane/8) computes rows {rt + 4i} x keys {8w + kt + 2j} (a 4x4 tile) over a
// quarter of the columns, the quarters summed by shuffles (8 float4 loads per 64 FMAs); the
// next chunk's rows are prefetched into L2; phase 2: 8 threads per row, 4 keys each; phase 3:
// thread t owns columns 4t..4t+3 of all 16 rows (64 accumulators), P read as broadcast float4.
namespace sk {
constexpr int KC = 32, NT = 128;
constexpr int QS = DQ + 4;        // 580 floats: consecutive rows start 4 banks apart
constexpr int PS = KC + 4;        // 36
constexpr int SLW = 64;           // columns per cp.async group
constexpr int NSL = DQ / SLW;     // 9 groups per chunk
}  // namespace sk

// RG query rows per block: 16, or 8 / 4 when there are few rows (two / four times the blocks, a
// half / a quarter of the work each: decode and small trees leave most SMs idle with 16).
template <int RG>
struct __align__(16) SkSmemT {
  float q[RG][sk::QS];
  float k[sk::KC][sk::QS];
  float p[RG][sk::PS];
  float m[RG], l[RG], alpha[RG];
};
using SkSmem = SkSmemT<16>;

// wait until at most n (0..8) cp.async groups are pending (n is a block-uniform run-time value)
__device__ __forceinline__ void cp_async_wait_le(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::); break;
    case 4: asm volatile("cp.async.wait_group 4;\n" ::); break;
    case 5: asm volatile("cp.async.wait_group 5;\n" ::); break;
    case 6: asm volatile("cp.async.wait_group 6;\n" ::); break;
    case 7: asm volatile("cp.async.wait_group 7;\n" ::); break;
    default: asm volatile("cp.async.wait_group 8;\n" ::); break;
  }
}


__device__ __forceinline__ float4 lds4(const float* x) { return *reinterpret_cast<const float4*>(x); }

// One split-KV chunk's key rows kbase .. kbase + KC - 1 -> s.k, NSL cp.async groups of SLW columns
// (rows past N zero-filled; `commit`: one group per slice, else all in the caller's group). Thread t
// copies float4 column t % 16 of every slice of rows t / 16 + 8 r: four row pointers a chunk and
// fixed offsets from them (16 lanes per row: an 8-lane phase of the 16-byte stores covers the 32
// banks). The first version formed each of the 36 copies' address apart (by the 64-bit row product
// and a select against the base pointer): ~800 SASS instructions a chunk, more than the chunk's
// products at decode sizes (thirty-eighth session).
template <class S>
__device__ __forceinline__ void splitkv_load_chunk(const VerifyAttentionParams& p, S& s, int kbase, int N, int tid,
                                                   bool commit) {
  using namespace sk;
  constexpr int RPI = sk::NT / (SLW / 4);  // rows per pass (8)
  static_assert(KC % RPI == 0, "whole passes");
  const int f4 = 4 * (tid % (SLW / 4)), r0 = tid / (SLW / 4);
  const float* src[KC / RPI];
  bool ok[KC / RPI];
#pragma unroll
  for (int r2 = 0; r2 < KC / RPI; ++r2) {
    const int j = kbase + r0 + RPI * r2;
    ok[r2] = j < N;
    src[r2] = p.kv + (size_t)(ok[r2] ? j : 0) * p.kv_stride + f4;  // (row 0 when zero-filled: never read)
  }
#pragma unroll
  for (int sl = 0; sl < NSL; ++sl) {
#pragma unroll
    for (int r2 = 0; r2 < KC / RPI; ++r2) cp_async16(&s.k[r0 + RPI * r2][sl * SLW + f4], src[r2] + sl * SLW, ok[r2]);
    if (commit) cp_async_commit();
  }
}

template <int RG>
__global__ void __launch_bounds__(sk::NT, 2) mla_verify_splitkv_kernel(VerifyAttentionParams p) {
  pdl_trigger();
  using namespace sk;
  constexpr int RI = RG / 4;     // phase 1: rows rt + 4i, i < RI, per thread
  constexpr int TPR = sk::NT / RG;  // phase 2: threads per row (8, 16 or 32)
  constexpr int KPT = KC / TPR;  // ... and keys per thread (4, 2 or 1)
  static_assert(RG == 4 || RG == 8 || RG == 16, "split-KV rows per block");
  extern __shared__ __align__(16) unsigned char smraw[];
  SkSmemT<RG>& s = *reinterpret_cast<SkSmemT<RG>*>(smraw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int M = p.T * p.H;
  const int m0 = blockIdx.x * RG;
  const int split = blockIdx.y, nsplit = gridDim.y;
  if (!p.committed_ready) pdl_wait();  // *L_dev may come from the previous kernel (waiting twice is free)
  const int L = attn_committed_len(p);  // pdl: pre-wait (committed_ready: *L_dev was set before the step)
  const int N = L + p.T;                            // keys: L committed + T tree rows
  const int nch = (N + KC - 1) / KC;
  const int cps = (nch + nsplit - 1) / nsplit;       // chunks per split (from the device length)
  const int c0 = min(split * cps, nch), c1 = min(c0 + cps, nch);

  // phase-2 / mask mapping (fixed per thread): row pr, keys KPT*pq .. KPT*pq+KPT-1 of each chunk
  const int pr = tid / TPR, pq = tid % TPR;
  const int node2 = m0 + pr < M ? (m0 + pr) / p.H : -1;
  // phase-1 mapping: rows rt + 4i, keys 8*warp + kt + 2j (i, j = 0..3), d-part h of each slice
  const int h = lane & 3, kt = (lane >> 2) & 1, rt = lane >> 3;
  const int key0 = 8 * warp + kt;

  // The first chunk's keys before the PDL wait when they are committed rows that were complete
  // before the step began (committed_ready): their loads then overlap the previous kernels
  // instead of following them. The queries come after the wait (the previous kernel wrote them).
  const bool pre = p.committed_ready && c0 < c1 && (c0 + 1) * KC <= L;
  if (pre) {
    splitkv_load_chunk(p, s, c0 * KC, N, tid, false);  // pdl: pre-wait (committed cache rows, complete before the step)
    cp_async_commit();
  }
  pdl_wait();
  const float sl2 = (node2 >= 0 ? attn_row_scale(p, m0 + pr) : p.scale) * kLog2e;  // (q_scale: after the wait)

  if (tid < RG) {
    s.m[tid] = attn_neg_inf();
    s.l[tid] = 0.f;
  }
  if (c0 < c1) {  // Q rows [m0, m0 + RG) -> shared, one cp.async group ahead of the first chunk's:
    // NT / RG threads per row, thread t float4 columns t % (NT / RG) + (NT / RG) i (two row pointers)
    constexpr int TQ = sk::NT / RG, QF = (DQ / 4 + TQ - 1) / TQ;
    const int r = tid / TQ, f0 = tid % TQ, g = m0 + r;
    const bool ok = g < M;
    const size_t gr = ok ? g : 0;  // (row 0 when zero-filled: never read)
    const float* pl = p.q_latent + gr * C_;  // column d < C_: pl + d
    const float* pr = p.q_rope + gr * R_;    // else pr + (d - C_)
#pragma unroll
    for (int i = 0; i < QF; ++i) {
      const int d = 4 * (f0 + TQ * i);
      if (d < DQ) cp_async16(&s.q[r][d], d < C_ ? pl + d : pr + (d - C_), ok);
    }
    cp_async_commit();
  }
  __syncthreads();

  float4 O[RG];
#pragma unroll
  for (int r = 0; r < RG; ++r) O[r] = make_float4(0.f, 0.f, 0.f, 0.f);

  for (int ch = c0; ch < c1; ++ch) {
    const int kbase = ch * KC;
    // reaches the tree rows: skip the chunk if no row of the group sees any key
    if (kbase + KC > L && !__syncthreads_or(attn_sees_any<KPT>(p, L, N, node2, kbase, KPT * pq))) continue;
    const bool loaded = pre && ch == c0;  // issued before the PDL wait (one group, before Q's)
    // ---- K chunk -> shared (rows past N zero-filled), 9 groups of 64 columns
    if (!loaded) splitkv_load_chunk(p, s, kbase, N, tid, true);
    // ---------------- phase 1: S = Q K^T. Each thread: a 4x4 (row, key) tile over a quarter of
    // every slice's columns (float4 columns 2h, 2h+1, 2h+8, 2h+9 of 16), then the 4 quarters are
    // summed across lanes. Per step 4 Q + 4 K float4 loads feed 64 FMAs; Q loads: 2 wavefronts,
    // K loads: 1 (rows start one bank quad apart: 580 floats = 145 quads).
    float acc[RI][4];
#pragma unroll
    for (int i = 0; i < RI; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    // L2 prefetch of the next chunk's rows (it then lands from L2, not HBM)
    if (ch + 1 < c1) attn_prefetch_rows_l2<sk::NT / KC, DQ>(p.kv, p.kv_stride, kbase + KC + tid / (sk::NT / KC), N, tid % (sk::NT / KC));
    for (int sl = 0; sl < NSL; ++sl) {
      cp_async_wait_le(loaded ? 0 : NSL - 1 - sl);  // preloaded: Q's group came last, wait for all
      __syncthreads();
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        const int d = sl * SLW + 4 * (2 * h + (st & 1) + 8 * (st >> 1));
        float4 q[RI], k[4];
#pragma unroll
        for (int i = 0; i < RI; ++i) q[i] = lds4(&s.q[rt + 4 * i][d]);
#pragma unroll
        for (int j = 0; j < 4; ++j) k[j] = lds4(&s.k[key0 + 2 * j][d]);
#pragma unroll
        for (int i = 0; i < RI; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            acc[i][j] = fmaf(q[i].x, k[j].x, acc[i][j]);
            acc[i][j] = fmaf(q[i].y, k[j].y, acc[i][j]);
            acc[i][j] = fmaf(q[i].z, k[j].z, acc[i][j]);
            acc[i][j] = fmaf(q[i].w, k[j].w, acc[i][j]);
          }
      }
    }
    // sum the 4 column quarters (lanes h = 0..3); lane h then stores key column j = h
#pragma unroll
    for (int i = 0; i < RI; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[i][j] += __shfl_xor_sync(0xffffffffu, acc[i][j], 1);
        acc[i][j] += __shfl_xor_sync(0xffffffffu, acc[i][j], 2);
      }
    // raw scores -> P tile (the previous chunk's phase 3 finished reading it: barrier below)
#pragma unroll
    for (int i = 0; i < RI; ++i) {
      const float v = h == 0 ? acc[i][0] : h == 1 ? acc[i][1] : h == 2 ? acc[i][2] : acc[i][3];
      s.p[rt + 4 * i][key0 + 2 * h] = v;
    }
    __syncthreads();
    // ---------------- phase 2: mask + online softmax (log2 domain), TPR threads per row
    {
      float v[KPT];
#pragma unroll
      for (int e = 0; e < KPT; ++e) v[e] = s.p[pr][KPT * pq + e];
      float mo, sum;
      const float mn = attn_softmax_exp<KPT, TPR>(p, L, N, node2, kbase, KPT * pq, sl2, v, s.m[pr], mo, sum);
#pragma unroll
      for (int e = 0; e < KPT; ++e) s.p[pr][KPT * pq + e] = v[e];
      attn_softmax_commit<TPR>(sum, mo, mn, pq == 0, s.m[pr], s.l[pr], s.alpha[pr]);
    }
    __syncthreads();
    // ---------------- phase 3: O = alpha * O + P V (columns 4*tid .. 4*tid+3)
#pragma unroll
    for (int r = 0; r < RG; ++r) {
      const float a = s.alpha[r];
      O[r].x *= a;
      O[r].y *= a;
      O[r].z *= a;
      O[r].w *= a;
    }
#pragma unroll 2
    for (int kk = 0; kk < KC; kk += 4) {
      float4 v4[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) v4[e] = lds4(&s.k[kk + e][4 * tid]);
#pragma unroll
      for (int r = 0; r < RG; ++r) {
        const float4 pp = lds4(&s.p[r][kk]);
        O[r].x = fmaf(pp.x, v4[0].x, O[r].x);
        O[r].y = fmaf(pp.x, v4[0].y, O[r].y);
        O[r].z = fmaf(pp.x, v4[0].z, O[r].z);
        O[r].w = fmaf(pp.x, v4[0].w, O[r].w);
        O[r].x = fmaf(pp.y, v4[1].x, O[r].x);
        O[r].y = fmaf(pp.y, v4[1].y, O[r].y);
        O[r].z = fmaf(pp.y, v4[1].z, O[r].z);
        O[r].w = fmaf(pp.y, v4[1].w, O[r].w);
        O[r].x = fmaf(pp.z, v4[2].x, O[r].x);
        O[r].y = fmaf(pp.z, v4[2].y, O[r].y);
        O[r].z = fmaf(pp.z, v4[2].z, O[r].z);
        O[r].w = fmaf(pp.z, v4[2].w, O[r].w);
        O[r].x = fmaf(pp.w, v4[3].x, O[r].x);
        O[r].y = fmaf(pp.w, v4[3].y, O[r].y);
        O[r].z = fmaf(pp.w, v4[3].z, O[r].z);
        O[r].w = fmaf(pp.w, v4[3].w, O[r].w);
      }
    }
    __syncthreads();  // the K chunk and P are free for the next chunk
  }
  cp_async_wait0();

  // ---------------- epilogue: normalised output (one split) or partials for the combine
  const bool final_out = nsplit == 1;
  float* wso = (float*)p.workspace;
  float* wsml = wso + (size_t)nsplit * M * C_;
#pragma unroll
  for (int r = 0; r < RG; ++r) {
    const int g = m0 + r;
    if (g >= M) break;
    const float l = s.l[r];
    const float inv = final_out ? (l > 0.f ? 1.f / l : 0.f) : 1.f;
    float* dst = final_out ? p.out + (size_t)g * C_ : wso + ((size_t)split * M + g) * C_;
    *reinterpret_cast<float4*>(dst + 4 * tid) = make_float4(O[r].x * inv, O[r].y * inv, O[r].z * inv, O[r].w * inv);
  }
  if (!final_out && tid < RG && m0 + tid < M) {
    const int g = m0 + tid;
    wsml[((size_t)split * M + g) * 2 + 0] = s.m[tid];
    wsml[((size_t)split * M + g) * 2 + 1] = s.l[tid];
  }
}

// ---------------------------------------------------------------- decode kernels (two passes)
// For few query rows at short and medium contexts (AR decode: M = H rows). The split-KV kernel
// gives each block a 16 x 32 chunk and then pays a combine of splits x M x C partials; here the
// score matrix is small (M x N floats), so it goes through global memory instead and no output
// partials exist:
//   pass 1 (mla_decode_scores_kernel): grid (key blocks of 16, row groups of 16). The block's 16
//     query rows sit in shared memory; warp w takes keys 2w, 2w+1, each lane holds 18 floats of
//     a key row in registers and dots them with the 16 rows (32 partial sums per lane), summed
//     across the warp by one 31-shuffle reduce-scatter. Lane l ends with (row l%16, key l/16)
//     and writes the masked score in the log2 domain (scale * log2 e), -inf where hidden; the
//     block also writes each row's maximum over its 16 keys (Bm [M][ldB]).
//   pass 2 (mla_decode_pv_kernel): grid (C / 4 column slices, row groups). Each row's maximum
//     comes from the N/16 block maxima; then O[16 x 4 columns] = P V over 256-key chunks staged in
//     shared memory (P and V^T), four threads per output each summing a quarter of the keys, the
//     next chunk's V and scores loaded into registers while the current one is summed, and the
//     row sum of P accumulated in the same loop; the quarters are added by two shuffles (fixed
//     order); out = O / sum.
// Pass 2's work per block grows with N. Measured: not faster than split-KV + combine (see
// decode_ok below), so only taken when forced; kept as a tested alternative for benchmarks.
namespace dk {
constexpr int RG = 16, KB = 16, NT = 256, CW = 4, VC = 256;  // CW columns per pass-2 block, VC keys per chunk
constexpr int PSW = VC + 4;                  // shared row stride of P / V^T (rows 4 banks apart)
constexpr int QF4 = DQ / 4;                  // 144 float4 per query / key row
constexpr int KF4 = (QF4 + 31) / 32;         // 5 float4 per lane (the last only for lanes < 16)
}  // namespace dk

__global__ void __launch_bounds__(dk::NT) mla_decode_scores_kernel(VerifyAttentionParams p, float* S, int ldS,
                                                                    float* Bm, int ldB) {
  pdl_prologue();
  __shared__ __align__(16) float4 q[dk::RG][dk::QF4];
  __shared__ float bmax[dk::NT / 32][32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int M = p.T * p.H, m0 = blockIdx.y * dk::RG;
  const int L = attn_committed_len(p), N = L + p.T;
  const int j0 = blockIdx.x * dk::KB;
  if (j0 >= N) return;  // grid sized for the host's bound on L
  for (int i = tid; i < dk::RG * dk::QF4; i += dk::NT) {
    const int r = i / dk::QF4, f = i % dk::QF4, g = m0 + r;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (g < M)
      v = f < C_ / 4 ? __ldg(reinterpret_cast<const float4*>(p.q_latent + (size_t)g * C_) + f)
                     : __ldg(reinterpret_cast<const float4*>(p.q_rope + (size_t)g * R_) + (f - C_ / 4));
    q[r][f] = v;
  }
  float acc[2 * dk::RG];  // acc[kk * 16 + r]
  float4 kr[2][dk::KF4];
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    const int j = j0 + 2 * warp + kk;
#pragma unroll
    for (int i = 0; i < dk::KF4; ++i) {
      const int f = lane + 32 * i;
      kr[kk][i] = (j < N && f < dk::QF4) ? __ldg(reinterpret_cast<const float4*>(p.kv + (size_t)j * p.kv_stride) + f)
                                     : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  __syncthreads();
#pragma unroll
  for (int kk = 0; kk < 2; ++kk)
#pragma unroll
    for (int r = 0; r < dk::RG; ++r) {
      float a = 0.f;
#pragma unroll
      for (int i = 0; i < dk::KF4; ++i) {
        const int f = lane + 32 * i;
        if (f < dk::QF4) {
          const float4 qv = q[r][f], k = kr[kk][i];
          a = fmaf(qv.x, k.x, a);
          a = fmaf(qv.y, k.y, a);
          a = fmaf(qv.z, k.z, a);
          a = fmaf(qv.w, k.w, a);
        }
      }
      acc[kk * dk::RG + r] = a;
    }
  const float v = reduce_scatter32(acc, lane);
  const int g = m0 + (lane & (dk::RG - 1)), j = j0 + 2 * warp + (lane >> 4);
  float sc = attn_neg_inf();
  if (g < M && j < N) {
    bool vis = j < L;
    if (!vis) {
      const int t = j - L, node = g / p.H;
      vis = (p.visibility[(size_t)node * p.vis_stride + (t >> 6)] >> (t & 63)) & 1ull;
    }
    if (vis) sc = v * (attn_row_scale(p, g) * kLog2e);
    S[(size_t)g * ldS + j] = sc;
  }
  bmax[warp][lane] = sc;
  __syncthreads();
  if (tid < dk::RG && m0 + tid < M) {  // the row's maximum over the block's 16 keys
    float mx = attn_neg_inf();
#pragma unroll
    for (int w = 0; w < dk::NT / 32; ++w) mx = fmaxf(mx, fmaxf(bmax[w][tid], bmax[w][tid + 16]));
    Bm[(size_t)(m0 + tid) * ldB + blockIdx.x] = mx;
  }
}

__global__ void __launch_bounds__(dk::NT) mla_decode_pv_kernel(VerifyAttentionParams p, const float* S, int ldS,
                                                                const float* Bm, int ldB) {
  pdl_prologue();
  __shared__ __align__(16) float ps[dk::RG][dk::PSW];  // P chunk: 16 rows x 256 keys
  __shared__ __align__(16) float vt[dk::CW][dk::PSW];  // V^T chunk: 4 columns x 256 keys
  const int tid = threadIdx.x;
  const int M = p.T * p.H, m0 = blockIdx.y * dk::RG, c0 = blockIdx.x * dk::CW;
  const int L = attn_committed_len(p), N = L + p.T;
  // a half warp per row: row r = tid / 16; for the sums, column c4 = (tid / 4) % 4 and key
  // quarter qk = tid % 4 (keys 4i + qk of each chunk)
  const int r = tid >> 4, c4 = (tid >> 2) & 3, qk = tid & 3, g = m0 + r, h16 = tid & 15;
  const float* srow = S + (size_t)(g < M ? g : 0) * ldS;
  float mx = attn_neg_inf();
  if (g < M) {
    const float* brow = Bm + (size_t)g * ldB;
    const int nb = (N + dk::KB - 1) / dk::KB;
    for (int b = h16; b < nb; b += 16) mx = fmaxf(mx, brow[b]);
  }
#pragma unroll
  for (int o = 8; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const bool live = g < M && mx != attn_neg_inf();  // a row that sees nothing gets 0
  // chunk loader (registers): V row k0 + tid, columns [c0, c0 + 4); the row's scores
  // k0 + h16 + 16 e (e < 16), coalesced across the half warp
  float4 vn;
  float sn[dk::VC / 16];
  auto load = [&](int k0) {
    const int j = k0 + tid;
    vn = j < N ? __ldg(reinterpret_cast<const float4*>(p.kv + (size_t)j * p.kv_stride + c0))
               : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int e = 0; e < dk::VC / 16; ++e) {
      const int jj = k0 + h16 + 16 * e;
      sn[e] = (live && jj < N) ? srow[jj] : attn_neg_inf();
    }
  };
  load(0);
  float acc = 0.f, sum = 0.f;
  for (int k0 = 0; k0 < N; k0 += dk::VC) {
    __syncthreads();  // the previous chunk is consumed
    vt[0][tid] = vn.x;
    vt[1][tid] = vn.y;
    vt[2][tid] = vn.z;
    vt[3][tid] = vn.w;
#pragma unroll
    for (int e = 0; e < dk::VC / 16; ++e) ps[r][h16 + 16 * e] = live ? exp2f(sn[e] - mx) : 0.f;  // exp2(-inf) = 0
    if (k0 + dk::VC < N) load(k0 + dk::VC);  // in flight during the sums below
    __syncthreads();
#pragma unroll 16
    for (int i = 0; i < dk::VC / 4; ++i) {
      const float pv = ps[r][4 * i + qk];
      acc = fmaf(pv, vt[c4][4 * i + qk], acc);
      sum += pv;
    }
  }
  // the 4 key quarters (lanes qk = 0..3 of the same row and column), fixed order
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  acc += __shfl_xor_sync(0xffffffffu, acc, 2);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  if (g < M && qk == 0) p.out[(size_t)g * C_ + c0 + c4] = sum > 0.f ? acc / sum : 0.f;
}

// ---------------------------------------------------------------- plain kernel (any shape)
// One block per query row (node t, head h): pass 1 the max score, pass 2 chunks of 256 keys:
// p = exp(s - max) into shared memory, then every thread accumulates its output columns.
constexpr int kNaiveThreads = 256;
constexpr int kNaiveMaxCols = 8;  // C <= 8 * 256

__device__ __forceinline__ bool naive_visible(const VerifyAttentionParams& p, int L, int t, int j) {
  if (j < L) return true;
  int tj = j - L;
  return (p.visibility[(size_t)t * p.vis_stride + (tj >> 6)] >> (tj & 63)) & 1ull;
}
__device__ __forceinline__ float naive_score(const VerifyAttentionParams& p, const float* ql,
                                             const float* qr, int j, float scale) {
  const float* kr = p.kv + (size_t)j * p.kv_stride;
  float s = 0.f;
  for (int c = 0; c < p.C; ++c) s = fmaf(ql[c], kr[c], s);
  for (int r = 0; r < p.R; ++r) s = fmaf(qr[r], kr[p.C + r], s);
  return s * scale;
}

__global__ void __launch_bounds__(kNaiveThreads) mla_verify_naive_kernel(VerifyAttentionParams p) {
  pdl_prologue();
  __shared__ float pbuf[kNaiveThreads];
  __shared__ float red[kNaiveThreads / 32];
  const int g = blockIdx.x, t = g / p.H;
  const float* ql = p.q_latent + (size_t)g * p.C;
  const float* qr = p.q_rope + (size_t)g * p.R;
  const int L = attn_committed_len(p);
  const int N = L + p.T;
  const float scale = attn_row_scale(p, g);
  float mx = attn_neg_inf();
  for (int j = threadIdx.x; j < N; j += kNaiveThreads)
    if (naive_visible(p, L, t, j)) mx = fmaxf(mx, naive_score(p, ql, qr, j, scale));
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < kNaiveThreads / 32; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();
  float acc[kNaiveMaxCols];
  for (int q = 0; q < kNaiveMaxCols; ++q) acc[q] = 0.f;
  float lsum = 0.f;
  for (int base = 0; base < N; base += kNaiveThreads) {
    const int j = base + threadIdx.x;
    float pv = 0.f;
    if (j < N && mx != attn_neg_inf() && naive_visible(p, L, t, j)) pv = expf(naive_score(p, ql, qr, j, scale) - mx);
    pbuf[threadIdx.x] = pv;
    lsum += pv;
    __syncthreads();
    const int kmax = N - base < kNaiveThreads ? N - base : kNaiveThreads;
    for (int kk = 0; kk < kmax; ++kk) {
      const float w = pbuf[kk];
      if (w == 0.f) continue;
      const float* vr = p.kv + (size_t)(base + kk) * p.kv_stride;
#pragma unroll
      for (int q = 0; q < kNaiveMaxCols; ++q) {
        int c = threadIdx.x + q * kNaiveThreads;
        if (c < p.C) acc[q] = fmaf(w, vr[c], acc[q]);
      }
    }
    __syncthreads();
  }
  for (int off = 16; off > 0; off >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, off);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = lsum;
  __syncthreads();
  float l = 0.f;
  for (int w = 0; w < kNaiveThreads / 32; ++w) l += red[w];
  const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int q = 0; q < kNaiveMaxCols; ++q) {
    int c = threadIdx.x + q * kNaiveThreads;
    if (c < p.C) p.out[(size_t)g * p.C + c] = acc[q] * inv;
  }
}

// ---------------------------------------------------------------- rows kernel (any C, R)
// What other shapes than the fast kernels' C = 512 / R = 64 run (the embedded default model's
// C = 128 / 64, say). One block of 512 threads per query row, as the plain kernel, without its
// latency: a GPU thread stalls on each load it uses, so every loop loads a batch first (a key's
// row 32 floats at a time; eight keys' values at a time in P V). Pass 1 keeps the first 4096
// scores in shared memory (pass 2 recomputes only beyond them). P V: the threads form
// G = 512 / C32 key groups (C32 = C rounded up to 32; G = 1 above C = 256) that take every G-th
// key of a chunk and add their partial outputs at the end. Zero weights are skipped (a masked
// key's NaN value stays out, as in the plain kernel). Not bit-identical to the plain kernel (other
// summation orders); the plain kernel stays the reference (force_naive).
constexpr int kRowsThreads = 512;
constexpr int kRowsCache = 4096;  // scores kept from pass 1 (16 KB of shared memory)
constexpr int kRowsCols = (kNaiveThreads * kNaiveMaxCols) / kRowsThreads;  // columns per thread when G = 1

__device__ __forceinline__ void rows_dot(const float* __restrict__ q, const float* k, int n, float* s) {
  int c = 0;
  for (; c + 32 <= n; c += 32) {
    float v[32];
#pragma unroll
    for (int u = 0; u < 32; ++u) v[u] = k[c + u];
#pragma unroll
    for (int u = 0; u < 32; ++u) s[u & 3] = fmaf(__ldg(q + c + u), v[u], s[u & 3]);
  }
  for (; c + 4 <= n; c += 4) {
    const float v0 = k[c], v1 = k[c + 1], v2 = k[c + 2], v3 = k[c + 3];
    s[0] = fmaf(__ldg(q + c), v0, s[0]);
    s[1] = fmaf(__ldg(q + c + 1), v1, s[1]);
    s[2] = fmaf(__ldg(q + c + 2), v2, s[2]);
    s[3] = fmaf(__ldg(q + c + 3), v3, s[3]);
  }
  for (; c < n; ++c) s[0] = fmaf(__ldg(q + c), k[c], s[0]);
}
__device__ __forceinline__ float rows_score(const VerifyAttentionParams& p, const float* ql, const float* qr, int j,
                                            float scale) {
  const float* kr = p.kv + (size_t)j * p.kv_stride;
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  rows_dot(ql, kr, p.C, s);
  rows_dot(qr, kr + p.C, p.R, s);
  return ((s[0] + s[1]) + (s[2] + s[3])) * scale;
}

// Key splits (gridDim.y = S > 1, short rows where M blocks would leave most SMs idle): block
// (g, s) takes keys [s*ceil(N/S), ...) of row g and leaves its unnormalised output, its max and its
// weight sum in the workspace ([S][M][C], then [S][M][2]); mla_rows_combine_kernel merges them. A
// NaN score in a split whose other keys are all masked is kept as a NaN weight, so that it reaches
// the output exactly when it would without splits (there: whenever the row's max is finite).
//
// EXACT (VerifyAttentionParams::exact; launched unsplit): every key group is one (G = 1: each thread sums its
// columns over all the row's keys in index order) and the weight sum runs in the same order, repeated by every
// thread, instead of per thread and then across the warps. Masked keys carry weight 0 and are skipped, so a row's
// output depends only on its visible keys in index order: a tree node's row gives the bits of the one-token step
// at its position (whose keys are the same rows: the committed ones, the node's ancestors in depth order, itself).
template <bool EXACT>
__global__ void __launch_bounds__(kRowsThreads) mla_verify_rows_kernel(VerifyAttentionParams p) {
  pdl_prologue();
  __shared__ float sc[kRowsCache];
  __shared__ float part[kRowsThreads];
  __shared__ float red[kRowsThreads / 32];
  const int g = blockIdx.x, t = g / p.H, tid = threadIdx.x;
  const int S = gridDim.y, split = blockIdx.y;
  const float* ql = p.q_latent + (size_t)g * p.C;
  const float* qr = p.q_rope + (size_t)g * p.R;
  const int L = attn_committed_len(p);
  const int Nall = L + p.T;
  const int chunk = (Nall + S - 1) / S;
  const int j0 = min(Nall, split * chunk);
  const int N = min(Nall, j0 + chunk) - j0;  // this block's keys: j0 + [0, N)
  const float ninf = attn_neg_inf(), scale = attn_row_scale(p, g);
  float mx = ninf;
  for (int i = tid; i < N; i += kRowsThreads) {
    const int j = j0 + i;
    const float s = naive_visible(p, L, t, j) ? rows_score(p, ql, qr, j, scale) : ninf;
    if (i < kRowsCache) sc[i] = s;
    mx = fmaxf(mx, s);
  }
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if ((tid & 31) == 0) red[tid >> 5] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < kRowsThreads / 32; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();
  const int c32 = (p.C + 31) & ~31;
  const int G = !EXACT && c32 <= kRowsThreads / 2 ? kRowsThreads / c32 : 1;  // key groups (C <= 256: >= 2)
  const int grp = G > 1 ? tid / c32 : 0, col = G > 1 ? tid - grp * c32 : tid;
  const bool pv_lane = G > 1 ? (grp < G && col < p.C) : true;
  float acc[kRowsCols];
#pragma unroll
  for (int q = 0; q < kRowsCols; ++q) acc[q] = 0.f;
  float lsum = 0.f;
  float lseq = 0.f;  // EXACT: the weight sum in key order (the same value in every thread)
  for (int base = 0; base < N; base += kRowsCache) {
    const int kmax = N - base < kRowsCache ? N - base : kRowsCache;
    for (int i = tid; i < kmax; i += kRowsThreads) {  // weights of this chunk (in place: same thread, same slot)
      const int j = base + i;  // (local)
      const float s = j < kRowsCache ? sc[i] : (naive_visible(p, L, t, j0 + j) ? rows_score(p, ql, qr, j0 + j, scale) : ninf);
      const float w = s == ninf ? 0.f : mx != ninf ? expf(s - mx) : (S > 1 && s != s) ? s : 0.f;
      sc[i] = w;
      lsum += w;
    }
    __syncthreads();
    const float* vb = p.kv + (size_t)(j0 + base) * p.kv_stride;
    if (G > 1) {
      if (pv_lane) {
        float a = acc[0];
        int kk = grp;
        for (; kk + 7 * G < kmax; kk += 8 * G) {
          float w[8], v[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            w[u] = sc[kk + u * G];
            v[u] = vb[(size_t)(kk + u * G) * p.kv_stride + col];
          }
#pragma unroll
          for (int u = 0; u < 8; ++u) a = w[u] != 0.f ? fmaf(w[u], v[u], a) : a;
        }
        for (; kk < kmax; kk += G) {
          const float w = sc[kk], v = vb[(size_t)kk * p.kv_stride + col];
          a = w != 0.f ? fmaf(w, v, a) : a;
        }
        acc[0] = a;
      }
    } else {
      int kk = 0;
      for (; kk + 4 <= kmax; kk += 4) {
        const float w0 = sc[kk], w1 = sc[kk + 1], w2 = sc[kk + 2], w3 = sc[kk + 3];
        const float* r0 = vb + (size_t)kk * p.kv_stride;
        if (EXACT) lseq = ((lseq + w0) + w1 + w2) + w3;  // (in order, one rounding each)
#pragma unroll
        for (int q = 0; q < kRowsCols; ++q) {
          const int c = tid + q * kRowsThreads;
          if (c < p.C) {
            const float v0 = r0[c], v1 = r0[p.kv_stride + c], v2 = r0[2 * (size_t)p.kv_stride + c],
                        v3 = r0[3 * (size_t)p.kv_stride + c];
            float a = acc[q];
            a = w0 != 0.f ? fmaf(w0, v0, a) : a;
            a = w1 != 0.f ? fmaf(w1, v1, a) : a;
            a = w2 != 0.f ? fmaf(w2, v2, a) : a;
            a = w3 != 0.f ? fmaf(w3, v3, a) : a;
            acc[q] = a;
          }
        }
      }
      for (; kk < kmax; ++kk) {
        const float w = sc[kk];
        if (w == 0.f) continue;
        if (EXACT) lseq += w;
        const float* vr = vb + (size_t)kk * p.kv_stride;
#pragma unroll
        for (int q = 0; q < kRowsCols; ++q) {
          const int c = tid + q * kRowsThreads;
          if (c < p.C) acc[q] = fmaf(w, vr[c], acc[q]);
        }
      }
    }
    __syncthreads();  // sc is rewritten by the next chunk
  }
  for (int off = 16; off > 0; off >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, off);
  if ((tid & 31) == 0) red[tid >> 5] = lsum;
  __syncthreads();
  float l = 0.f;
  for (int w = 0; w < kRowsThreads / 32; ++w) l += red[w];
  if (EXACT) l = lseq;
  // one split: normalised into out; several: unnormalised partials (and max, sum) in the workspace
  float* dst = p.out + (size_t)g * p.C;
  float inv = l > 0.f ? 1.f / l : 0.f;
  if (S > 1) {
    const size_t M = (size_t)p.T * p.H;
    float* ws = static_cast<float*>(p.workspace);
    dst = ws + ((size_t)split * M + g) * p.C;
    inv = 1.f;
    if (tid == 0) {
      float* ml = ws + (size_t)S * M * p.C + ((size_t)split * M + g) * 2;
      ml[0] = mx;
      ml[1] = l;
    }
  }
  if (G > 1) {  // the groups' partial outputs added in group order
    if (pv_lane) part[tid] = acc[0];
    __syncthreads();
    if (tid < p.C) {
      float o = 0.f;
      for (int k = 0; k < G; ++k) o += part[k * c32 + tid];
      dst[tid] = o * inv;
    }
    return;
  }
#pragma unroll
  for (int q = 0; q < kRowsCols; ++q) {
    const int c = tid + q * kRowsThreads;
    if (c < p.C) dst[c] = acc[q] * inv;
  }
}

// The rows kernel's key splits merged (S > 1), one block per query row: the row's max over the
// splits, each split's output and sum scaled by exp(its max - that), added in split order. A row
// whose every split has max -inf (nothing visible, or only NaN scores) gets 0, as without splits.
constexpr int kRowsCombineThreads = 256;
__global__ void __launch_bounds__(kRowsCombineThreads) mla_rows_combine_kernel(VerifyAttentionParams p, int S) {
  pdl_prologue();
  const int g = blockIdx.x;
  const size_t M = (size_t)p.T * p.H;
  const float* ws = static_cast<const float*>(p.workspace);
  const float* ml = ws + (size_t)S * M * p.C;
  const float ninf = attn_neg_inf();
  float gm = ninf;
  for (int s = 0; s < S; ++s) gm = fmaxf(gm, ml[((size_t)s * M + g) * 2]);
  float* out = p.out + (size_t)g * p.C;
  if (gm == ninf) {
    for (int c = threadIdx.x; c < p.C; c += blockDim.x) out[c] = 0.f;
    return;
  }
  float l = 0.f;
  for (int s = 0; s < S; ++s) {
    const float m = ml[((size_t)s * M + g) * 2];
    l += (m == ninf ? 0.f : expf(m - gm)) * ml[((size_t)s * M + g) * 2 + 1];
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int c = threadIdx.x; c < p.C; c += blockDim.x) {
    float o = 0.f;
    for (int s = 0; s < S; ++s) {
      const float m = ml[((size_t)s * M + g) * 2];
      o += (m == ninf ? 0.f : expf(m - gm)) * ws[((size_t)s * M + g) * p.C + c];
    }
    out[c] = o * inv;
  }
}

// ---------------------------------------------------------------- kernel choice (cost model)
// Per-block time estimates for the H200 (132 SMs). They are ESTIMATES, to be tuned from
// measurements: benchmarks/bench_cuda_verify_attention.py prints auto / tiled / split-KV per
// shape, and cuda_verify_attention_choice(T, H, L) shows what the model picks. First fit
// (H200, graph replay): tiled ~75 us per tile; split-KV ~8 us per 16x32 chunk for a block alone
// on its SM (27% of the SM's FP32 peak: latency-bound, 4 warps) and ~6 us per chunk per SM with
// two blocks resident (36%); ~7 us of fixed cost per call with splits (launches, Q, combine).
namespace cost {
constexpr double kTiledTileUs = 75.0;       // tiled kernel: one 64x128 tile on one SM (1 block/SM), measured ~70-80
constexpr double kSmFp32Flops = 507e9;      // FP32 peak of one SM: 128 lanes x 2 x 1.98 GHz
constexpr double kSplitKvEff1 = 0.27;       // split-KV kernel: fraction of that peak, one block on the SM
constexpr double kSplitKvEff2 = 0.36;       // ... two (or more) blocks on the SM
constexpr double kFlopPerRowKey = 2176.0;   // 2 x (C + R + C)
constexpr double kSplitKvWaveUs = 3.0;      // split-KV: per wave of blocks (Q load, first chunk's latency, epilogue)
constexpr double kCombineUs = 4.0;          // combine kernel: launch + tail
constexpr double kBytesPerUs = 3.0e6;       // sustained HBM bandwidth (3 TB/s): KV stream, partials
constexpr int kSmemPerSm = 228 * 1024;      // Hopper: 228 KB per SM, 1 KB of it reserved per block
constexpr int kSplitKvBlocksPerSm = kSmemPerSm / ((int)sizeof(SkSmem) + 1024);
constexpr int kSplitKvTargetWaves = 4;      // split-KV: at most ~4 waves of (SMs x blocks/SM) blocks
constexpr int kSplitKvMaxSplits = 128;
constexpr double kMmaChunkUs = 7.8;         // tensor-core kernel: one 32-row x 32-key chunk on one SM
                                            //   (measured on the H200: T = 65, H = 16, L = 4096)
constexpr double kMmaWaveUs = 3.0;          // ... per wave of blocks (Q load, first chunk's latency, epilogue)
constexpr int kMmaTargetWaves = 4;          // ... at most ~4 waves of (SMs x 1) blocks
constexpr double kMmaHalfFrac = 0.6;        // ... a chunk of a 16-row (one m-tile) block, relative (sizes only
                                            //   the last row block's splits; in-step, 16-row blocks of 2-3
                                            //   chunks took ~85-90 % of a 32-row chunk each, H100, docs/BENCHMARKS.md
                                            //   "Sixty-ninth session": optimistic, the L = 4096 pick stands)
constexpr int kTiledMaxSplits = 64;
constexpr size_t kMaxWorkspaceBytes = size_t(64) << 20;  // splits * M * (C + 2) * 4 bytes at most
}  // namespace cost
static_assert(cost::kSplitKvBlocksPerSm >= 2, "the split-KV kernel is sized for two blocks per SM");

size_t ws_split_bytes(int M) { return (size_t)M * (C_ + 2) * sizeof(float); }
// most splits whose partials fit in kMaxWorkspaceBytes (>= 1)
int ws_split_cap(int M) {
  const size_t c = cost::kMaxWorkspaceBytes / ws_split_bytes(M);
  return c < 1 ? 1 : (c > (1 << 20) ? (1 << 20) : (int)c);
}
double combine_us(int splits, int M) {
  return splits > 1 ? cost::kCombineUs + 2.0 * (double)splits * ws_split_bytes(M) / cost::kBytesPerUs : 0.0;
}

bool splitkv_ok(const VerifyAttentionParams& p) {  // shapes/alignment of both fast kernels
  auto al16 = [](const void* x) { return ((unsigned long long)x & 15ull) == 0; };
  return p.C == C_ && p.R == R_ && p.kv_stride % 4 == 0 && al16(p.kv) && al16(p.q_latent) && al16(p.q_rope) &&
         al16(p.out) && !p.force_naive;
}
bool tiled_ok(const VerifyAttentionParams& p) { return splitkv_ok(p) && p.T <= kMaxTreeRows; }

// ---- tiled kernel: key splits. Minimise (waves of blocks) x (tiles on a block's critical path).
// The committed tiles go tps per split; the last split also takes the tree tiles (about one),
// so a split count that leaves the last split short of committed tiles hides the tree tile.
// Ties -> fewer. Only when the row blocks alone leave SMs idle, and at most ~2 waves of blocks.
// Every bound below grows with L, so tiled_max_splits(p) covers every L' <= p.L.
int tiled_max_splits(const VerifyAttentionParams& p) {
  const int M = p.T * p.H;
  const int rb = (M + BM - 1) / BM;
  const int nLt = (p.L + BN - 1) / BN;
  if (nLt <= 1) return 1;
  const int cap = ws_split_cap(M);
  if (p.force_splits > 0) return std::max(1, std::min(std::min(p.force_splits, nLt + 1), cap));
  const int sms = num_sms();
  if (rb >= sms) return 1;  // the row blocks alone fill the GPU: no split/combine traffic
  const int smax = (2 * sms + rb - 1) / rb;
  return std::max(1, std::min(std::min(nLt + 1, smax), std::min(cost::kTiledMaxSplits, cap)));
}

int tiled_splits(const VerifyAttentionParams& p, double* est_us) {
  const int M = p.T * p.H;
  const int rb = (M + BM - 1) / BM;
  const int nLt = (p.L + BN - 1) / BN;
  const int sms = num_sms();
  const int smax = tiled_max_splits(p);
  int best_s = 1;
  if (nLt > 1 && p.force_splits > 0) {
    best_s = smax;
  } else if (nLt > 1) {
    double best = 1e30;
    for (int s = 1; s <= smax; ++s) {
      const int tps = (nLt + s - 1) / s;
      const int last = nLt - (s - 1) * tps > 0 ? nLt - (s - 1) * tps : 0;
      const int path = tps > last + 1 ? tps : last + 1;
      const int waves = (rb * s + sms - 1) / sms;
      const double c = (double)waves * path + (s > 1 ? 0.25 : 0.0);
      if (c < best - 1e-9) {
        best = c;
        best_s = s;
      }
    }
  }
  if (est_us) {
    const int s = best_s;
    const int tps = (nLt + s - 1) / s;
    const int last = nLt - (s - 1) * tps > 0 ? nLt - (s - 1) * tps : 0;
    const int path = tps > last + 1 ? tps : last + 1;  // + one tree tile on the last split
    const int waves = (rb * s + sms - 1) / sms;
    *est_us = (double)waves * path * cost::kTiledTileUs + combine_us(s, M);
  }
  return best_s;
}

// ---- split-KV kernel: key splits (whole 32-key chunks). Bounded by 128, the chunk count,
// ~4 waves of blocks and the workspace cap; each bound grows with L (workspace sizing).
int splitkv_max_splits(const VerifyAttentionParams& p, int RG) {
  const int M = p.T * p.H;
  const int rg = (M + RG - 1) / RG;
  const int nch = (p.L + p.T + sk::KC - 1) / sk::KC;
  const int cap = std::min(ws_split_cap(M), nch);
  if (p.force_splits > 0) return std::max(1, std::min(p.force_splits, cap));
  const int slots = num_sms() * cost::kSplitKvBlocksPerSm;
  const int wave_cap = std::max(1, (cost::kSplitKvTargetWaves * slots + rg - 1) / rg);
  return std::max(1, std::min(std::min(cap, wave_cap), cost::kSplitKvMaxSplits));
}

double splitkv_est_us(const VerifyAttentionParams& p, int s, int RG) {
  const int M = p.T * p.H;
  const int rg = (M + RG - 1) / RG;
  const int nch = (p.L + p.T + sk::KC - 1) / sk::KC;
  const int sms = num_sms();
  const int cps = (nch + s - 1) / s;
  const long long blocks = (long long)rg * s;
  const long long per_sm = (blocks + sms - 1) / sms;  // blocks one SM runs (side by side share it)
  const long long waves = (blocks + (long long)sms * cost::kSplitKvBlocksPerSm - 1) / ((long long)sms * cost::kSplitKvBlocksPerSm);
  const double eff = per_sm >= 2 ? cost::kSplitKvEff2 : cost::kSplitKvEff1;  // SM throughput shared by its blocks
  const double chunk_us = RG * sk::KC * cost::kFlopPerRowKey / (eff * cost::kSmFp32Flops) * 1e6;
  const double compute = (double)per_sm * cps * chunk_us;
  const double memory = ((double)(p.L + p.T) * DQ * 4.0 + (double)M * (DQ + C_) * 4.0) / cost::kBytesPerUs;
  return (compute > memory ? compute : memory) + (double)waves * cost::kSplitKvWaveUs + combine_us(s, M);
}

// s splits of nch chunks in whole chunks leave none empty (else a smaller count does the same)
bool no_empty_split(int nch, int s) {
  const int cps = (nch + s - 1) / s;
  return (nch + cps - 1) / cps == s;
}

// The split count in [1, smax] over nch chunks with the lowest estimate est(s) (ties: fewer),
// skipping counts that would leave a split empty (a smaller count does the same); forced: smax.
template <class Est>
int best_split_count(int nch, int smax, bool forced, Est est) {
  if (forced) return smax;
  int best_s = 1;
  double best = 1e30;
  for (int s = 1; s <= smax; ++s) {
    if (!no_empty_split(nch, s)) continue;
    const double c = est(s);
    if (c < best * (1.0 - 1e-9)) {
      best = c;
      best_s = s;
    }
  }
  return best_s;
}

int splitkv_splits(const VerifyAttentionParams& p, int RG, double* est_us) {
  const int nch = (p.L + p.T + sk::KC - 1) / sk::KC;
  const int best_s = best_split_count(nch, splitkv_max_splits(p, RG), p.force_splits > 0,
                                      [&](int s) { return splitkv_est_us(p, s, RG); });
  if (est_us) *est_us = splitkv_est_us(p, best_s, RG);
  return best_s;
}

// Rows per split-KV block: forced (testing), else 8 when the 16-row grid (row groups x its
// splits) fills at most 80% of the SMs, which halves each block's work and doubles the blocks,
// and 4 when the 8-row grid fills at most 60% of them; else 16 (smaller blocks then only add
// waves and L2 re-reads of the key chunks). Measured on the H200 (bench_cuda_verify_attention.py
// --decode-only, docs/BENCHMARKS.md): 8 rows faster at 16-row grids of 17..102 blocks (T=1 H=16
// L=512: 11.3 vs 14.0 us; T=17 H=16 L=512: 32.5 vs 39.7), slower from 130 blocks on (T=2 H=16
// L=4096: 32.8 vs 29.6; T=65 L=512: 90 vs 68); 4 rows faster at 8-row grids of 34..68 blocks
// (T=1 H=16 L=512: 10.7 vs 11.3; L=1024: 12.5 vs 15.2; T=2 L=512: 12.1 vs 13.3), slower from
// 130 on (T=1 H=16 L=2048: 20.5 vs 19.0; T=4 L=512: 18.6 vs 14.5).
int splitkv_rows(const VerifyAttentionParams& p) {
  if (p.force_splitkv_rows == 4 || p.force_splitkv_rows == 8 || p.force_splitkv_rows == 16) return p.force_splitkv_rows;
  const long long sms = num_sms();
  const long long blocks16 = (long long)((p.T * p.H + 15) / 16) * splitkv_splits(p, 16, nullptr);
  if (blocks16 * 5 > sms * 4) return 16;
  const long long blocks8 = (long long)((p.T * p.H + 7) / 8) * splitkv_splits(p, 8, nullptr);
  return blocks8 * 5 <= sms * 3 ? 4 : 8;
}

// ---- tensor-core kernel (verify_attention_mma.cu): key splits over 32-key chunks, one block of
// 32 rows per SM; the same bounds as the split-KV kernel's (each grows with L).
int mma_max_splits(const VerifyAttentionParams& p) {
  const int M = p.T * p.H;
  const int rm = verify_mma_rows(), kc = verify_mma_chunk();
  const int rg = (M + rm - 1) / rm;
  const int nch = (p.L + p.T + kc - 1) / kc;
  const int cap = std::min(ws_split_cap(M), nch);
  if (p.force_splits > 0) return std::max(1, std::min(p.force_splits, cap));
  const int wave_cap = std::max(1, (cost::kMmaTargetWaves * num_sms() + rg - 1) / rg);
  return std::max(1, std::min(std::min(cap, wave_cap), cost::kSplitKvMaxSplits));
}

// rows of the last row block; <= 16: it runs one m-tile (verify_attention_mma.cu)
bool mma_last_is_half(int M) { return M - (M - 1) / verify_mma_rows() * verify_mma_rows() <= 16; }

// s_full key splits for each full row block, s_last for the last one
double mma_est_us(const VerifyAttentionParams& p, int s_full, int s_last) {
  const int M = p.T * p.H;
  const int rm = verify_mma_rows(), kc = verify_mma_chunk();
  const int rg = (M + rm - 1) / rm;
  const int nch = (p.L + p.T + kc - 1) / kc;
  const int sms = num_sms();
  const int cf = (nch + s_full - 1) / s_full, cl = (nch + s_last - 1) / s_last;
  const long long blocks = (long long)(rg - 1) * s_full + s_last;
  const long long waves = (blocks + sms - 1) / sms;
  const double last = cl * (mma_last_is_half(M) ? cost::kMmaHalfFrac : 1.0);
  const double path = rg > 1 ? std::max((double)cf, last) : last;
  const double compute = (double)waves * path * cost::kMmaChunkUs;
  const double memory = ((double)(p.L + p.T) * DQ * 4.0 + (double)M * (DQ + C_) * 4.0) / cost::kBytesPerUs;
  return (compute > memory ? compute : memory) + (double)waves * cost::kMmaWaveUs +
         combine_us(std::max(s_full, s_last), M);
}

// (s_full, s_last): each full row block's key splits and the last row block's. Forced: both
// force_splits. A single row block: the split count with the lowest estimate. Else for each
// s_full (whole chunks, no empty split) the last row block takes either as many splits or the
// most that still fit in the wave the full row blocks leave partly empty (it is cheaper per
// chunk when it has at most 16 rows, so it can run longer splits); the lowest estimate wins (ties:
// the earlier: fewer splits, equal counts). E.g. H200, T = 17, H = 16, L = 4096 (8 full row blocks
// + 16 rows, 129 chunks): (15, 12) = 132 blocks, at most 9 chunks each, instead of 13 x 9 = 117 blocks of
// 10 chunks.
std::pair<int, int> mma_splits(const VerifyAttentionParams& p) {
  const int kc = verify_mma_chunk(), rm = verify_mma_rows();
  const int M = p.T * p.H;
  const int rg = (M + rm - 1) / rm;
  const int nch = (p.L + p.T + kc - 1) / kc;
  const int smax = mma_max_splits(p);
  if (p.force_splits > 0) return {smax, smax};
  if (rg == 1) {
    const int s = best_split_count(nch, smax, false, [&](int x) { return mma_est_us(p, x, x); });
    return {s, s};
  }
  const long long sms = num_sms();
  std::pair<int, int> best{1, 1};
  double best_us = 1e30;
  for (int sf = 1; sf <= smax; ++sf) {
    if (!no_empty_split(nch, sf)) continue;
    const long long used = (long long)(rg - 1) * sf;
    const long long room = ((used + sms - 1) / sms) * sms - used;  // blocks left in the last wave
    int sl = (int)std::min<long long>(room, smax);
    while (sl > 1 && !no_empty_split(nch, sl)) --sl;
    for (int cand : {sf, sl}) {
      if (cand < 1) continue;
      const double us = mma_est_us(p, sf, cand);
      if (us < best_us * (1.0 - 1e-9)) {
        best_us = us;
        best = {sf, cand};
      }
    }
  }
  return best;
}

// ---- decode kernels: M x (L+T) scores in the workspace. Only when forced (force_kernel = 3,
// CudaModel(attention_kernel="decode")): measured on the H200 they are not faster than the
// split-KV kernel + combine, alone (15.7 vs 14.1 us at T=1, H=16, L=512; slower with L) or
// inside the mini-kimi step (equal at T=1, 5-30 % slower for T=2..4; docs/BENCHMARKS.md).
constexpr int kDecodeMaxRows = 1024, kDecodeMaxKeys = 16384;
bool decode_ok(const VerifyAttentionParams& p) {
  const long long M = (long long)p.T * p.H, N = (long long)p.L + p.T;
  return splitkv_ok(p) && M <= kDecodeMaxRows && N <= kDecodeMaxKeys;
}
int decode_ld(long long keys) { return (int)((keys + 3) / 4 * 4); }
int decode_ldb(long long keys) { return decode_ld((keys + dk::KB - 1) / dk::KB); }  // block maxima per row
// bytes for the scores at any L' <= p.L (non-decreasing in L: the key count is capped, not refused)
size_t decode_ws_bytes(const VerifyAttentionParams& p) {
  const long long M = (long long)p.T * p.H;
  const int cap = kDecodeMaxKeys;
  if (!splitkv_ok(p) || M > kDecodeMaxRows || p.T > cap) return 0;
  const long long keys = std::min<long long>((long long)p.L + p.T, cap);
  return (size_t)M * (decode_ld(keys) + decode_ldb(keys)) * sizeof(float);
}

// Auto choice of the tensor-core kernel: a measured rule, not the cost model (H200,
// bench_cuda_verify_attention.py, docs/BENCHMARKS.md "Verify attention on the tensor cores" and
// "... each warp copies its own key slabs; the tensor-core rule re-measured"). With M = T x H query
// rows and N = L + T keys it was faster than the best CUDA-core kernel on every measured shape with
// M >= 2048 at any N (B = 256, H = 16, L = 0: 32 vs 77 us), M >= 1024 and N >= 64 (B = 64, H = 16,
// L = 0: 15 vs 18 us), and, in the twenty-first session's decode table (warp-own loads,
// three-instruction split): M >= 128 with N >= 512 (T = 1, H = 128, L = 512: 15.5 vs 19.5 us; L =
// 1024: 19.3 vs 22.6), M >= 64 with N >= 2048 (T = 1, H = 64, L = 2048: 26.3 vs 28.4) and M >= 16
// with N >= 4096 (T = 1, H = 16, L = 4096: 24.0 vs 25.2; L = 8192: 32.8 vs 36.8; T = 2, L = 4096:
// 30.0 vs 30.4). Slower with fewer rows or keys (T = 1, H = 16, L = 512: 11.7 vs 11.4 us; H = 64, L
// = 1024: 17.9 vs 17.7; T = 4, H = 16, L = 512: 15.6 vs 15.0; B = 16, H = 16 or 64, L = 0: 12.5 vs
// 7.8 / 11.1 us), where one 32-row block per chunk leaves too little work per block.
bool mma_wins(const VerifyAttentionParams& p) {
  const long long M = (long long)p.T * p.H, N = (long long)p.L + p.T;
  return M >= 2048 || (M >= 1024 && N >= 64) || (M >= 128 && N >= 512) || (M >= 64 && N >= 2048) ||
         (M >= 16 && N >= 4096);
}

// Key splits of the rows kernel (shapes the fast kernels do not take; grid y), from host values
// only. A block's time is about fixed latency + its keys' share (one block per query row and split,
// latency-bound), and blocks beyond one per SM take turns; so the pick minimises
//   ceil(M S / SMs) * (kRowsBlockUs + kRowsKeyUs * (C + R) * ceil(N / S)) + [S > 1] kRowsMergeUs (1 + S / 8)
// over S = 1 .. rows_max_splits (M = T x H query rows, N = L + T keys). The constants fit the
// H200's forced-split table (benchmarks/bench_cuda_attention_rows.py --splits, docs/BENCHMARKS.md
// "Rows kernel key splits"): C = 128 / 64, H = 8 / 4, T = 1 / 5 / 17, L = 64..2048, where the pick
// among the measured counts (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) was on average 1.9 % and at most
// 14 % slower than the best of them. No splits above kRowsMaxSplitRows query rows (they fill
// the GPU already); force_splits > 0 forces a count (clamped to 1..rows_max_splits).
constexpr int kRowsMaxSplits = 32, kRowsMaxSplitRows = 1024;
constexpr double kRowsBlockUs = 2.0, kRowsKeyUs = 0.0007, kRowsMergeUs = 0.5;
// the most splits any L' <= L can use (the workspace's size; non-decreasing in L)
int rows_max_splits(const VerifyAttentionParams& p) {
  const long long M = (long long)p.T * p.H, N = (long long)p.L + p.T;
  if (p.force_naive || M > kRowsMaxSplitRows) return 1;
  const long long cap = (64ll << 20) / (M * (p.C + 2) * 4);  // partials <= 64 MiB
  return (int)std::max<long long>(1, std::min<long long>({(long long)kRowsMaxSplits, N, cap}));
}
int rows_splits(const VerifyAttentionParams& p) {
  const int smax = rows_max_splits(p);
  if (smax == 1) return 1;
  if (p.force_splits > 0) return std::min(p.force_splits, smax);
  const long long M = (long long)p.T * p.H, N = (long long)p.L + p.T, sms = std::max(1, num_sms());
  const double per_key = kRowsKeyUs * (p.C + p.R);
  int best = 1;
  double best_us = 0;
  for (int S = 1; S <= smax; ++S) {
    const double us = (double)((M * S + sms - 1) / sms) * (kRowsBlockUs + per_key * (double)((N + S - 1) / S)) +
                      (S > 1 ? kRowsMergeUs * (1.0 + S / 8.0) : 0.0);
    if (S == 1 || us < best_us) {
      best = S;
      best_us = us;
    }
  }
  return best;
}
size_t rows_ws_bytes(const VerifyAttentionParams& p, int splits) {
  return splits > 1 ? (size_t)splits * (size_t)p.T * p.H * (p.C + 2) * sizeof(float) : 0;
}

struct Choice {
  int kernel;  // 0 = plain, 1 = tiled, 2 = split-KV, 3 = decode (two passes), 4 = tensor cores
  int splits;  // key splits (tensor cores: partial slots = max(splits of a full row block, of the last))
  int rows;    // query rows per block (split-KV: 4, 8 or 16; tensor cores: 32)
  int splits_full = 0;  // tensor cores: each full row block's key splits
  int splits_last = 0;  // ... and the last row block's
};

Choice choose(const VerifyAttentionParams& p) {
  if (!splitkv_ok(p)) return {0, 1, 16};
  if (p.force_kernel == 3 && decode_ok(p)) return {3, 1, 16};
  if (p.force_kernel == 1 && tiled_ok(p)) return {1, tiled_splits(p, nullptr), 16};
  // (the tensor-core kernel needs 190 KB of shared memory per block: where a GPU cannot give it,
  // the CUDA-core kernels run)
  if ((p.force_kernel == 4 || (p.force_kernel == 0 && mma_wins(p))) && verify_mma_ready()) {
    const std::pair<int, int> sp = mma_splits(p);
    return {4, std::max(sp.first, sp.second), verify_mma_rows(), sp.first, sp.second};
  }
  const int rows = splitkv_rows(p);
  if (p.force_kernel >= 2 || !tiled_ok(p)) return {2, splitkv_splits(p, rows, nullptr), rows};
  double ct = 0, cs = 0;
  const int st = tiled_splits(p, &ct);
  const int ss = splitkv_splits(p, rows, &cs);
  return cs < ct ? Choice{2, ss, rows} : Choice{1, st, 16};
}

bool basic_ok(const VerifyAttentionParams& p) {
  return p.q_latent && p.q_rope && p.kv && p.out && p.visibility && p.T >= 1 && p.H >= 1 &&
         p.C >= 1 && p.R >= 0 && p.L >= 0 && p.kv_stride >= p.C + p.R &&
         p.vis_stride >= (p.T + 63) / 64 && p.C <= kNaiveThreads * kNaiveMaxCols &&
         p.force_kernel >= 0 && p.force_kernel <= 4 &&
         (p.force_splitkv_rows == 0 || p.force_splitkv_rows == 4 || p.force_splitkv_rows == 8 ||
          p.force_splitkv_rows == 16);
}

// raise a kernel's dynamic shared memory limit once; false on a GPU with less shared memory
template <class Kernel>
bool smem_attr_ok(Kernel k, int bytes, int& state, bool max_carveout) {
  if (state == 0) {
    cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess && max_carveout) {
      if (cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, 100) != cudaSuccess)
        cudaGetLastError();  // only a hint
    }
    if (e != cudaSuccess) cudaGetLastError();
    state = e == cudaSuccess ? 1 : -1;
  }
  return state == 1;
}

}  // namespace

bool verify_attention_fast_path(const VerifyAttentionParams& p) { return splitkv_ok(p); }

void verify_attention_choice(const VerifyAttentionParams& p, int* kernel, int* splits, int* rows, int* splits_full,
                             int* splits_last) {
  const Choice c = p.exact ? Choice{5, 1, 16} : choose(p);
  if (kernel) *kernel = c.kernel;
  if (splits) *splits = c.splits;
  if (rows) *rows = c.rows;
  if (splits_full) *splits_full = c.kernel == 4 ? c.splits_full : c.splits;
  if (splits_last) *splits_last = c.kernel == 4 ? c.splits_last : c.splits;
}

size_t verify_attention_workspace_bytes(const VerifyAttentionParams& p) {
  if (p.exact) return verify_exact_workspace_bytes(p);  // (0 for the rows kernel, unsplit)
  // the rows kernel's splits (other shapes; the fallback of a GPU with less shared memory for the
  // fast kernels' shapes runs it unsplit)
  if (!splitkv_ok(p)) return rows_ws_bytes(p, rows_max_splits(p));
  // the largest split count either kernel can use for these shapes at any L' <= p.L
  // (deterministic; p.L is the upper bound when L_dev is used)
  int s = 1;
  const bool tiled = tiled_ok(p) && p.force_kernel != 2;
  const bool splitkv = p.force_kernel != 1 || !tiled_ok(p);
  if (tiled) s = std::max(s, tiled_max_splits(p));
  if (splitkv) s = std::max({s, splitkv_max_splits(p, 16), splitkv_max_splits(p, 8), splitkv_max_splits(p, 4)});
  if (p.force_kernel == 0 || p.force_kernel == 4) s = std::max(s, mma_max_splits(p));
  size_t ws = s > 1 ? (size_t)s * ws_split_bytes(p.T * p.H) : 0;
  if (p.force_kernel == 3) ws = std::max(ws, decode_ws_bytes(p));
  return ws;
}

cudaError_t verify_attention(const VerifyAttentionParams& p, cudaStream_t stream) {
  if (!basic_ok(p)) return cudaErrorInvalidValue;
  const int M = p.T * p.H;
  if (p.defer_splits) *p.defer_splits = 0;
  if (p.exact && p.q_scale) return cudaErrorInvalidValue;  // (the exact kernels take no per-token scale)
  if (p.exact) {  // row-exact (verify_attention_exact.cu); shapes it does not take: the rows kernel, unsplit
    if (verify_exact_fast_ok(p)) return launch_verify_exact(p, stream);
    launch_kernel(mla_verify_rows_kernel<true>, dim3(M, 1), kRowsThreads, 0, stream, p);
    return cudaGetLastError();
  }
  const Choice c = choose(p);
  // the caller merges the splits (p.defer_splits): leave the partials, launch no combine
  auto combine = [&](int splits) {
    if (p.defer_splits && splits <= p.defer_max_splits) {
      *p.defer_splits = splits;
      return cudaSuccess;
    }
    launch_kernel(mla_verify_combine_kernel, M, kCombineThreads, 0, stream, p, splits);
    return cudaGetLastError();
  };
  static int tiled_state = 0, splitkv_state = 0, splitkv8_state = 0, splitkv4_state = 0;
  // DK = 32-wide d-chunks: measured on the H200 a little faster than 64 (which spills a few
  // registers), so it is the only instantiation of the tiled kernel.
  if (c.kernel == 3) {
    if (!p.workspace) return cudaErrorInvalidValue;
    const long long keys = (long long)p.L + p.T;
    const int ldS = decode_ld(keys), ldB = decode_ldb(keys), rg = (M + dk::RG - 1) / dk::RG;
    float* S = static_cast<float*>(p.workspace);
    float* Bm = S + (size_t)M * ldS;
    cudaError_t e = launch_kernel(mla_decode_scores_kernel, dim3((unsigned)((keys + dk::KB - 1) / dk::KB), rg), dk::NT,
                                  0, stream, p, S, ldS, Bm, ldB);
    if (e != cudaSuccess) return e;
    return launch_kernel(mla_decode_pv_kernel, dim3(C_ / dk::CW, rg), dk::NT, 0, stream, p, (const float*)S, ldS,
                         (const float*)Bm, ldB);
  }
  if (c.kernel == 4) {
    if (c.splits > 1 && !p.workspace) return cudaErrorInvalidValue;
    cudaError_t e = launch_verify_mma(p, c.splits_full, c.splits_last, stream);
    if (e != cudaSuccess || c.splits == 1) return e;
    return combine(c.splits);
  }
  const bool ok = c.kernel == 1   ? smem_attr_ok(mla_verify_fast_kernel<32>, (int)sizeof(Smem<32>), tiled_state, false)
                  : c.kernel == 2 && c.rows == 16
                      ? smem_attr_ok(mla_verify_splitkv_kernel<16>, (int)sizeof(SkSmemT<16>), splitkv_state, true)
                  : c.kernel == 2 && c.rows == 8
                      ? smem_attr_ok(mla_verify_splitkv_kernel<8>, (int)sizeof(SkSmemT<8>), splitkv8_state, true)
                  : c.kernel == 2 ? smem_attr_ok(mla_verify_splitkv_kernel<4>, (int)sizeof(SkSmemT<4>), splitkv4_state, true)
                                  : false;
  if (!ok) {  // other shapes or a GPU with less shared memory per block: the rows kernel; forced: the plain one
    if (p.force_naive) {
      launch_kernel(mla_verify_naive_kernel, M, kNaiveThreads, 0, stream, p);
      return cudaGetLastError();
    }
    const int S = splitkv_ok(p) ? 1 : rows_splits(p);  // (the workspace holds no rows splits for fast shapes)
    if (S > 1 && !p.workspace) return cudaErrorInvalidValue;
    launch_kernel(mla_verify_rows_kernel<false>, dim3(M, S), kRowsThreads, 0, stream, p);
    if (S > 1) launch_kernel(mla_rows_combine_kernel, M, kRowsCombineThreads, 0, stream, p, S);
    return cudaGetLastError();
  }
  if (c.splits > 1 && !p.workspace) return cudaErrorInvalidValue;
  if (c.kernel == 1) {
    dim3 grid((M + BM - 1) / BM, c.splits);
    launch_kernel(mla_verify_fast_kernel<32>, grid, NT, sizeof(Smem<32>), stream, p);
  } else if (c.rows == 16) {
    launch_kernel(mla_verify_splitkv_kernel<16>, dim3((M + 15) / 16, c.splits), sk::NT, sizeof(SkSmemT<16>), stream, p);
  } else if (c.rows == 8) {
    launch_kernel(mla_verify_splitkv_kernel<8>, dim3((M + 7) / 8, c.splits), sk::NT, sizeof(SkSmemT<8>), stream, p);
  } else {
    launch_kernel(mla_verify_splitkv_kernel<4>, dim3((M + 3) / 4, c.splits), sk::NT, sizeof(SkSmemT<4>), stream, p);
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || c.splits == 1) return e;
  return combine(c.splits);
}

}  // namespace cuda
}  // namespace kdtree
