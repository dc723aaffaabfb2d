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
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels.h"

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
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  int sz = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(sz));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void cp_async_wait0() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

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
    return key < p.L ? key : -1;
  }
  int idx = (it - nc) * BN + kk;
  return idx < s.ntree ? p.L + s.tlist[idx] : -1;
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
  constexpr int NDC = DQ / DK;
  extern __shared__ __align__(16) unsigned char smraw[];
  Smem<DK>& s = *reinterpret_cast<Smem<DK>*>(smraw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int M = p.T * p.H;
  const int m0 = blockIdx.x * BM;
  const int split = blockIdx.y, nsplit = gridDim.y;
  const int nLt = (p.L + BN - 1) / BN;
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
    s.m[tid] = neg_inf();
    s.l[tid] = 0.f;
  }
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
      float mx = neg_inf();
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int kk = 64 * wk + lk + 8 * j;
        const int row = s.keyrow[kk];
        bool ok = row >= 0;
        if (ok && tree_tile) {
          const int t = row - p.L;
          ok = node >= 0 && ((p.visibility[(size_t)node * p.vis_stride + (t >> 6)] >> (t & 63)) & 1ull);
        }
        acc[i][j] = ok ? acc[i][j] * sl2 : neg_inf();
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
        float pv = (mn == neg_inf()) ? 0.f : exp2f(acc[i][j] - mn);
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
      const float alpha = (mo == neg_inf()) ? 0.f : exp2f(mo - mn);
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

// merge split partials: one block of C/4 threads per query row
__global__ void mla_verify_combine_kernel(VerifyAttentionParams p, int nsplit) {
  const int M = p.T * p.H;
  const int g = blockIdx.x;
  const float* wso = (const float*)p.workspace;
  const float* wsml = wso + (size_t)nsplit * M * C_;
  float mx = neg_inf();
  for (int sp = 0; sp < nsplit; ++sp) mx = fmaxf(mx, wsml[((size_t)sp * M + g) * 2]);
  float den = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const int c4 = threadIdx.x;
  for (int sp = 0; sp < nsplit; ++sp) {
    const float m = wsml[((size_t)sp * M + g) * 2], l = wsml[((size_t)sp * M + g) * 2 + 1];
    if (m == neg_inf()) continue;
    const float w = exp2f(m - mx);
    den += w * l;
    float4 o = *reinterpret_cast<const float4*>(wso + ((size_t)sp * M + g) * C_ + 4 * c4);
    acc.x += w * o.x;
    acc.y += w * o.y;
    acc.z += w * o.z;
    acc.w += w * o.w;
  }
  const float inv = den > 0.f ? 1.f / den : 0.f;
  acc.x *= inv;
  acc.y *= inv;
  acc.z *= inv;
  acc.w *= inv;
  *reinterpret_cast<float4*>(p.out + (size_t)g * C_ + 4 * c4) = acc;
}

// ---------------------------------------------------------------- plain kernel (any shape)
// One block per query row (node t, head h): pass 1 the max score, pass 2 chunks of 256 keys:
// p = exp(s - max) into shared memory, then every thread accumulates its output columns.
constexpr int kNaiveThreads = 256;
constexpr int kNaiveMaxCols = 8;  // C <= 8 * 256

__device__ __forceinline__ bool naive_visible(const VerifyAttentionParams& p, int t, int j) {
  if (j < p.L) return true;
  int tj = j - p.L;
  return (p.visibility[(size_t)t * p.vis_stride + (tj >> 6)] >> (tj & 63)) & 1ull;
}
__device__ __forceinline__ float naive_score(const VerifyAttentionParams& p, const float* ql,
                                             const float* qr, int j) {
  const float* kr = p.kv + (size_t)j * p.kv_stride;
  float s = 0.f;
  for (int c = 0; c < p.C; ++c) s = fmaf(ql[c], kr[c], s);
  for (int r = 0; r < p.R; ++r) s = fmaf(qr[r], kr[p.C + r], s);
  return s * p.scale;
}

__global__ void __launch_bounds__(kNaiveThreads) mla_verify_naive_kernel(VerifyAttentionParams p) {
  __shared__ float pbuf[kNaiveThreads];
  __shared__ float red[kNaiveThreads / 32];
  const int g = blockIdx.x, t = g / p.H;
  const float* ql = p.q_latent + (size_t)g * p.C;
  const float* qr = p.q_rope + (size_t)g * p.R;
  const int N = p.L + p.T;
  float mx = neg_inf();
  for (int j = threadIdx.x; j < N; j += kNaiveThreads)
    if (naive_visible(p, t, j)) mx = fmaxf(mx, naive_score(p, ql, qr, j));
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
    if (j < N && mx != neg_inf() && naive_visible(p, t, j)) pv = expf(naive_score(p, ql, qr, j) - mx);
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

int num_sms() {
  static int n = 0;
  if (n == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      n = 132;
    }
  }
  return n;
}

// Key splits: minimise (waves of blocks) x (tiles on a block's critical path). The committed
// tiles go tps per split; the last split also takes the tree tiles (about one), so a split
// count that leaves the last split short of committed tiles hides the tree tile. Ties -> fewer.
// Only when the row blocks alone leave SMs idle, and at most ~2 waves of blocks.
int choose_splits(const VerifyAttentionParams& p) {
  const int M = p.T * p.H;
  const int rb = (M + BM - 1) / BM;
  const int nLt = (p.L + BN - 1) / BN;
  if (nLt <= 1) return 1;
  if (p.force_splits > 0) return p.force_splits < nLt ? p.force_splits : nLt;
  const int sms = num_sms();
  if (rb >= sms) return 1;  // the row blocks alone fill the GPU: no split/combine traffic
  const int smax = (2 * sms + rb - 1) / rb;
  double best = 1e30;
  int best_s = 1;
  for (int s = 1; s <= nLt + 1 && s <= smax && s <= 64; ++s) {
    const int tps = (nLt + s - 1) / s;
    const int last = nLt - (s - 1) * tps > 0 ? nLt - (s - 1) * tps : 0;
    const int path = tps > last + 1 ? tps : last + 1;
    const int waves = (rb * s + sms - 1) / sms;
    const double cost = (double)waves * path + (s > 1 ? 0.25 : 0.0);
    if (cost < best - 1e-9) {
      best = cost;
      best_s = s;
    }
  }
  return best_s;
}

bool basic_ok(const VerifyAttentionParams& p) {
  return p.q_latent && p.q_rope && p.kv && p.out && p.visibility && p.T >= 1 && p.H >= 1 &&
         p.C >= 1 && p.R >= 0 && p.L >= 0 && p.kv_stride >= p.C + p.R &&
         p.vis_stride >= (p.T + 63) / 64 && p.C <= kNaiveThreads * kNaiveMaxCols;
}

}  // namespace

bool verify_attention_fast_path(const VerifyAttentionParams& p) {
  auto al16 = [](const void* x) { return ((unsigned long long)x & 15ull) == 0; };
  return p.C == C_ && p.R == R_ && p.T <= kMaxTreeRows && p.kv_stride % 4 == 0 && al16(p.kv) &&
         al16(p.q_latent) && al16(p.q_rope) && al16(p.out) && !p.force_naive;
}

size_t verify_attention_workspace_bytes(const VerifyAttentionParams& p) {
  if (!verify_attention_fast_path(p)) return 0;
  const int s = choose_splits(p);
  if (s <= 1) return 0;
  const size_t M = (size_t)p.T * p.H;
  return (size_t)s * M * (C_ + 2) * sizeof(float);
}

cudaError_t verify_attention(const VerifyAttentionParams& p, cudaStream_t stream) {
  if (!basic_ok(p)) return cudaErrorInvalidValue;
  const int M = p.T * p.H;
  if (!verify_attention_fast_path(p)) {
    mla_verify_naive_kernel<<<M, kNaiveThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
  const int splits = choose_splits(p);
  if (splits > 1 && !p.workspace) return cudaErrorInvalidValue;
  // DK = 32-wide d-chunks: measured on the H200 a little faster than 64 (which spills a few
  // registers), so it is the only instantiation.
  static bool smem_set = false;
  cudaError_t e;
  dim3 grid((M + BM - 1) / BM, splits);
  if (!smem_set) {
    e = cudaFuncSetAttribute(mla_verify_fast_kernel<32>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sizeof(Smem<32>));
    if (e != cudaSuccess) {  // a GPU with less shared memory per block: the plain kernel
      cudaGetLastError();
      mla_verify_naive_kernel<<<M, kNaiveThreads, 0, stream>>>(p);
      return cudaGetLastError();
    }
    smem_set = true;
  }
  mla_verify_fast_kernel<32><<<grid, NT, sizeof(Smem<32>), stream>>>(p);
  e = cudaGetLastError();
  if (e != cudaSuccess || splits == 1) return e;
  mla_verify_combine_kernel<<<M, C_ / 4, 0, stream>>>(p, splits);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kdtree
