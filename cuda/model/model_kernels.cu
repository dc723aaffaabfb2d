// model_kernels.cu: the small kernels of the GPU target model (see model_kernels.h). Each one
// mirrors the CPU twin named in its comment (cpp/model/ops.cpp, cpp/model/cpu_model.cpp);
// products and sums that the CPU does one by one are written with __fmul_rn / __fadd_rn so
// that the compiler does not contract them into FMAs (the CPU build has none), which keeps the
// two backends within a few ulps of each other outside the GEMMs.
#include "model/model_kernels.h"

#include <cstdint>

namespace kdtree {
namespace cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the total.
template <class V>
__device__ V block_sum(V v, V* red /* [32] shared */) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  V t = V(0);
  for (int w = 0; w < nw; ++w) t += red[w];
  return t;
}

// ---------------------------------------------------------------- embedding
__global__ void embed_kernel(EmbedParams p) {
  const int t = blockIdx.x;
  const int tok = p.tokens[t];
  float* o = p.out + (size_t)t * p.Dm;
  if (tok < 0 || tok >= p.V) {
    for (int i = threadIdx.x; i < p.Dm; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
    return;
  }
  const float* src = p.table + (size_t)tok * p.Dm;
  for (int i = threadIdx.x; i < p.Dm; i += blockDim.x) o[i] = src[i];
}

// ---------------------------------------------------------------- RMSNorm (ops.cpp rmsnorm_row)
__device__ __forceinline__ float rms_inv(double ss, int D, double eps) {
  const float var = (float)(ss / (double)D);
  return (float)(1.0 / sqrt((double)var + eps));
}

__global__ void rmsnorm_kernel(RmsNormParams p) {
  __shared__ double red[32];
  const int t = blockIdx.x;
  const float* x = p.x + (size_t)t * p.ldx;
  float* y = p.y + (size_t)t * p.ldy;
  double ss = 0.0;
  for (int i = threadIdx.x; i < p.D; i += blockDim.x) ss += (double)x[i] * (double)x[i];
  ss = block_sum(ss, red);
  const float inv = rms_inv(ss, p.D, p.eps);
  for (int i = threadIdx.x; i < p.D; i += blockDim.x) y[i] = __fmul_rn(p.w[i], __fmul_rn(x[i], inv));
}

// ---------------------------------------------------------------- MLA preparation
// RoPE of one head (ops.cpp rope_row): pair j = (x[2j], x[2j+1]) interleaved or (x[j], x[j+half]).
__device__ __forceinline__ void rope_pair(const float* x, const float* cs, int half, int j, int interleaved,
                                          float* y) {
  const float c = cs[j], s = cs[half + j];
  const float a = interleaved ? x[2 * j] : x[j];
  const float b = interleaved ? x[2 * j + 1] : x[j + half];
  y[j] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  y[j + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

__global__ void mla_prep_kernel(MlaPrepParams p) {
  extern __shared__ float cs[];  // [R]: cos | sin
  __shared__ double red[32];
  const int t = blockIdx.x, half = p.R / 2;
  const float pos = (float)p.positions[t];
  for (int j = threadIdx.x; j < half; j += blockDim.x) {  // ops.cpp rope_cos_sin
    const float ang = __fmul_rn(pos, p.inv_freq[j]);
    cs[j] = __fmul_rn((float)cos((double)ang), p.attention_factor);
    cs[half + j] = __fmul_rn((float)sin((double)ang), p.attention_factor);
  }
  const float* kv = p.kv + (size_t)t * p.ldkv;
  float* row = p.cache + (size_t)(p.row0 + t) * p.ldc;
  double ss = 0.0;
  for (int i = threadIdx.x; i < p.C; i += blockDim.x) ss += (double)kv[i] * (double)kv[i];
  ss = block_sum(ss, red);  // also orders the cs writes before the reads below
  const float inv = rms_inv(ss, p.C, p.eps);
  for (int i = threadIdx.x; i < p.C; i += blockDim.x) row[i] = __fmul_rn(p.kv_norm_w[i], __fmul_rn(kv[i], inv));
  for (int j = threadIdx.x; j < half; j += blockDim.x) rope_pair(kv + p.C, cs, half, j, p.interleaved, row + p.C);
  const int Dqk = p.Dn + p.R;
  for (int i = threadIdx.x; i < p.H * half; i += blockDim.x) {
    const int h = i / half, j = i - h * half;
    rope_pair(p.q + (size_t)t * p.ldq + h * Dqk + p.Dn, cs, half, j, p.interleaved,
              p.q_rope + ((size_t)t * p.H + h) * p.R);
  }
}

// ---------------------------------------------------------------- SwiGLU (ops.cpp swiglu_row)
__device__ __forceinline__ float silu_mul(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))), u);
}

__global__ void swiglu_kernel(SwigluParams p) {
  const int rows = p.n_rows ? *p.n_rows : p.rows;
  const size_t n = (size_t)rows * p.I;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const size_t r = i / p.I, c = i - r * p.I;
    const float* g = p.gu + r * 2 * p.I;
    p.out[i] = silu_mul(g[c], g[p.I + c]);
  }
}

// ---------------------------------------------------------------- MoE routing (cpu_model.cpp route)
// (value, index) is better than (bv, bi) when bi is unset, the value is larger, or equal with a
// lower index: the CPU's ascending scan with a strict '>' keeps the lowest index of a tie.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

__global__ void moe_route_kernel(RouteParams p) {
  extern __shared__ float sm[];
  const int E = p.E, G = p.G, K = p.K, per = E / G;
  float* s = sm;            // [E] sigmoid scores
  float* b = s + E;         // [E] + correction bias
  float* gs = b + E;        // [G] group scores
  unsigned char* taken = reinterpret_cast<unsigned char*>(gs + G);  // [E]
  unsigned char* gsel = taken + E;                                  // [G]
  const int t = blockIdx.x, lane = threadIdx.x;
  const float* lg = p.logits + (size_t)t * E;
  for (int e = lane; e < E; e += 32) {
    const float v = 1.f / (1.f + expf(-lg[e]));
    s[e] = v;
    b[e] = __fadd_rn(v, p.bias[e]);
    taken[e] = 0;
  }
  __syncwarp();
  for (int g = lane; g < G; g += 32) {  // sum of the group's top-2
    const float* bg = b + g * per;
    int i1 = 0;
    for (int i = 1; i < per; ++i)
      if (bg[i] > bg[i1]) i1 = i;
    int i2 = (i1 == 0) ? 1 : 0;
    for (int i = 0; i < per; ++i)
      if (i != i1 && bg[i] > bg[i2]) i2 = i;
    gs[g] = __fadd_rn(bg[i1], bg[i2]);
    gsel[g] = 0;
  }
  __syncwarp();
  if (lane == 0) {
    for (int k = 0; k < p.topk_group; ++k) {
      int best = -1;
      for (int g = 0; g < G; ++g)
        if (!gsel[g] && (best < 0 || gs[g] > gs[best])) best = g;
      gsel[best] = 1;
    }
  }
  __syncwarp();
  int32_t* idx = p.topk_idx + (size_t)t * K;
  float* w = p.topk_w + (size_t)t * K;
  for (int k = 0; k < K; ++k) {
    float bv = neg_inf();
    int bi = -1;
    for (int e = lane; e < E; e += 32)
      if (gsel[e / per] && !taken[e] && better(b[e], e, bv, bi)) {
        bv = b[e];
        bi = e;
      }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(kFull, bv, o);
      const int oi = __shfl_xor_sync(kFull, bi, o);
      if (better(ov, oi, bv, bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane == 0) {
      idx[k] = bi;
      taken[bi] = 1;
    }
    __syncwarp();
  }
  if (lane == 0) {
    float sum = 0.f;
    for (int k = 0; k < K; ++k) {
      w[k] = s[idx[k]];
      sum = __fadd_rn(sum, w[k]);
    }
    if (p.norm_topk_prob) {
      const float den = __fadd_rn(sum, 1e-20f);
      for (int k = 0; k < K; ++k) w[k] = __fdiv_rn(w[k], den);
    }
    for (int k = 0; k < K; ++k) w[k] = __fmul_rn(w[k], p.routed_scaling_factor);
  }
}

// ---------------------------------------------------------------- expert grouping
constexpr int kGroupThreads = 256;

__global__ void moe_count_kernel(MoeGroupParams p) {
  const int e = blockIdx.x, A = p.T * p.K;
  int c = 0;
  for (int i0 = 0; i0 < A; i0 += kGroupThreads) {
    const int i = i0 + threadIdx.x;
    c += __syncthreads_count(i < A && p.topk_idx[i] == e);
  }
  if (threadIdx.x == 0) p.counts[e] = c;
}

__global__ void moe_place_kernel(MoeGroupParams p) {
  __shared__ int red[32];
  __shared__ int warp_cnt[kGroupThreads / 32];
  const int e = blockIdx.x, A = p.T * p.K, TR = p.tile_rows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int off = 0, tiles = 0;
  for (int j = threadIdx.x; j < e; j += kGroupThreads) {
    const int c = p.counts[j];
    off += c;
    tiles += (c + TR - 1) / TR;
  }
  off = block_sum(off, red);
  tiles = block_sum(tiles, red);
  const int cnt = p.counts[e], mine = (cnt + TR - 1) / TR;
  if (threadIdx.x == 0) {
    p.offsets[e + 1] = off + cnt;
    if (e == 0) p.offsets[0] = 0;
    if (e == p.E - 1) *p.num_tiles = tiles + mine;
  }
  for (int j = threadIdx.x; j < mine; j += kGroupThreads) {
    p.tile_expert[tiles + j] = e;
    p.tile_row0[tiles + j] = off + j * TR;
  }
  // Stable placement: slot = off + (number of earlier assignments routed to e).
  int running = 0;
  for (int i0 = 0; i0 < A; i0 += kGroupThreads) {
    const int i = i0 + threadIdx.x;
    const bool m = i < A && p.topk_idx[i] == e;
    const unsigned bal = __ballot_sync(kFull, m);
    if (lane == 0) warp_cnt[warp] = __popc(bal);
    __syncthreads();
    int base = 0, total = 0;
    for (int w = 0; w < kGroupThreads / 32; ++w) {
      if (w < warp) base += warp_cnt[w];
      total += warp_cnt[w];
    }
    if (m) {
      const int slot = off + running + base + __popc(bal & ((1u << lane) - 1u));
      p.slot_token[slot] = i / p.K;
      p.slot_of[i] = slot;
    }
    running += total;
    __syncthreads();
  }
}

// ---------------------------------------------------------------- grouped expert GEMM, skinny
// Block: one tile (<= MS slots of one expert) x kSkinnyCols output columns; warp w owns columns
// n0 + w*CPW .. +CPW-1 and streams their weight rows (float4 per lane) once, against the
// tile's rows of x staged in shared memory kSkinnyKC columns at a time.
constexpr int kSkinnyWarps = 8, kSkinnyCPW = 4, kSkinnyCols = kSkinnyWarps * kSkinnyCPW, kSkinnyKC = 1024;

template <int MS, bool VEC>
__global__ void __launch_bounds__(kSkinnyWarps * 32) expert_gemv_kernel(ExpertGemmParams p) {
  __shared__ __align__(16) float xs[MS * kSkinnyKC];
  const int tile = blockIdx.x;
  if (tile >= *p.num_tiles) return;
  const int e = p.tile_expert[tile], r0 = p.tile_row0[tile];
  const int end = p.offsets[e + 1];
  const int rows = min(MS, end - r0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int Kd = p.Kd, N = p.N;
  const size_t wsize = (size_t)(p.swiglu ? 2 : 1) * N * Kd;
  const float* W = p.w + (size_t)e * wsize;
  const int nbase = blockIdx.y * kSkinnyCols + warp * kSkinnyCPW;
  float acc[kSkinnyCPW][MS], acc2[kSkinnyCPW][MS];
#pragma unroll
  for (int c = 0; c < kSkinnyCPW; ++c)
#pragma unroll
    for (int r = 0; r < MS; ++r) acc[c][r] = acc2[c][r] = 0.f;

  for (int k0 = 0; k0 < Kd; k0 += kSkinnyKC) {
    const int kc = min(kSkinnyKC, Kd - k0);
    __syncthreads();
    for (int i = threadIdx.x; i < rows * kc; i += blockDim.x) {
      const int r = i / kc, k = i - r * kc;
      const int src = p.x_row ? p.x_row[r0 + r] : r0 + r;
      xs[r * kc + k] = p.x[(size_t)src * p.ldx + k0 + k];
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kSkinnyCPW; ++c) {
      const int n = nbase + c;
      if (n >= N) break;
      const float* wg = W + (size_t)n * Kd + k0;
      const float* wu = W + (size_t)(N + n) * Kd + k0;
      if (VEC) {
        for (int k = lane * 4; k < kc; k += 128) {
          const float4 g4 = __ldg(reinterpret_cast<const float4*>(wg + k));
          float4 u4 = make_float4(0.f, 0.f, 0.f, 0.f);
          if (p.swiglu) u4 = __ldg(reinterpret_cast<const float4*>(wu + k));
#pragma unroll
          for (int r = 0; r < MS; ++r) {
            if (r < rows) {
              const float4 x4 = *reinterpret_cast<const float4*>(xs + r * kc + k);
              acc[c][r] += g4.x * x4.x + g4.y * x4.y + g4.z * x4.z + g4.w * x4.w;
              if (p.swiglu) acc2[c][r] += u4.x * x4.x + u4.y * x4.y + u4.z * x4.z + u4.w * x4.w;
            }
          }
        }
      } else {
        for (int k = lane; k < kc; k += 32) {
          const float g = __ldg(wg + k);
          const float u = p.swiglu ? __ldg(wu + k) : 0.f;
#pragma unroll
          for (int r = 0; r < MS; ++r) {
            if (r < rows) {
              const float xv = xs[r * kc + k];
              acc[c][r] += g * xv;
              if (p.swiglu) acc2[c][r] += u * xv;
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kSkinnyCPW; ++c) {
    const int n = nbase + c;
    if (n >= N) break;
#pragma unroll
    for (int r = 0; r < MS; ++r) {
      if (r < rows) {
        float a = acc[c][r], u = acc2[c][r];
        for (int o = 16; o > 0; o >>= 1) {
          a += __shfl_xor_sync(kFull, a, o);
          if (p.swiglu) u += __shfl_xor_sync(kFull, u, o);
        }
        if (lane == 0) p.y[(size_t)(r0 + r) * p.ldy + n] = p.swiglu ? silu_mul(a, u) : a;
      }
    }
  }
}

// ---------------------------------------------------------------- grouped expert GEMM, tiled
// Block: 64 slots x 64 columns, k-steps of 16 through shared memory, 4x4 outputs per thread.
constexpr int TBM = kExpertTileRows, TBN = 64, TBK = 16, TThreads = 256;

template <bool VEC>
__global__ void __launch_bounds__(TThreads) expert_tiled_kernel(ExpertGemmParams p) {
  __shared__ __align__(16) float As[TBK][TBM + 4];
  __shared__ __align__(16) float Bs[TBK][TBN + 4];
  __shared__ int arow[TBM];
  const int tile = blockIdx.x;
  if (tile >= *p.num_tiles) return;
  const int e = p.tile_expert[tile], r0 = p.tile_row0[tile];
  const int rows = min(TBM, p.offsets[e + 1] - r0);
  const int n0 = blockIdx.y * TBN, N = p.N, Kd = p.Kd;
  const float* W = p.w + (size_t)e * N * Kd;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  if (tid < TBM) arow[tid] = tid < rows ? (p.x_row ? p.x_row[r0 + tid] : r0 + tid) : -1;
  __syncthreads();
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  const int lr = tid / 4, lk = (tid % 4) * 4;  // this thread loads row/col lr, k = lk..lk+3
  for (int k0 = 0; k0 < Kd; k0 += TBK) {
    float a[4], b[4];
    const int ar = arow[lr], n = n0 + lr;
    if (VEC && k0 + lk + 3 < Kd) {
      float4 a4 = make_float4(0.f, 0.f, 0.f, 0.f), b4 = a4;
      if (ar >= 0) a4 = *reinterpret_cast<const float4*>(p.x + (size_t)ar * p.ldx + k0 + lk);
      if (n < N) b4 = __ldg(reinterpret_cast<const float4*>(W + (size_t)n * Kd + k0 + lk));
      a[0] = a4.x; a[1] = a4.y; a[2] = a4.z; a[3] = a4.w;
      b[0] = b4.x; b[1] = b4.y; b[2] = b4.z; b[3] = b4.w;
    } else {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int k = k0 + lk + u;
        a[u] = (ar >= 0 && k < Kd) ? p.x[(size_t)ar * p.ldx + k] : 0.f;
        b[u] = (n < N && k < Kd) ? __ldg(W + (size_t)n * Kd + k) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      As[lk + u][lr] = a[u];
      Bs[lk + u][lr] = b[u];
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < TBK; ++kk) {
      const float4 a4 = *reinterpret_cast<const float4*>(&As[kk][ty * 4]);
      const float4 b4 = *reinterpret_cast<const float4*>(&Bs[kk][tx * 4]);
      const float av[4] = {a4.x, a4.y, a4.z, a4.w}, bv[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty * 4 + i;
    if (r >= rows) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + tx * 4 + j;
      if (n < N) p.y[(size_t)(r0 + r) * p.ldy + n] = acc[i][j];
    }
  }
}

// ---------------------------------------------------------------- MoE combine
__global__ void moe_combine_kernel(MoeCombineParams p) {
  __shared__ int ord[64];  // the token's K picks sorted by expert index (K <= 64)
  const int t = blockIdx.x, K = p.K;
  const int32_t* idx = p.topk_idx + (size_t)t * K;
  if (threadIdx.x == 0) {
    for (int k = 0; k < K; ++k) ord[k] = k;
    for (int a = 1; a < K; ++a)
      for (int j = a; j > 0 && idx[ord[j]] < idx[ord[j - 1]]; --j) {
        const int tmp = ord[j];
        ord[j] = ord[j - 1];
        ord[j - 1] = tmp;
      }
  }
  __syncthreads();
  float* out = p.out + (size_t)t * p.Dm;
  for (int i = threadIdx.x; i < p.Dm; i += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < K; ++j) {
      const int a = t * K + ord[j];
      acc = __fadd_rn(acc, __fmul_rn(p.y[(size_t)p.slot_of[a] * p.Dm + i], p.topk_w[a]));
    }
    if (p.shared) acc = __fadd_rn(acc, p.shared[(size_t)t * p.Dm + i]);
    out[i] = p.accumulate ? __fadd_rn(out[i], acc) : acc;
  }
}

// ---------------------------------------------------------------- cache compaction
constexpr int kCompactThreads = 256, kCompactRegs = 16;

__global__ void cache_compact_kernel(CompactParams p) {
  float* base = p.cache + (size_t)blockIdx.x * p.layer_stride;
  const long long n = *p.count;
  const long long items = n * p.row_len;
  const long long chunk = (long long)kCompactThreads * kCompactRegs;
  for (long long c0 = 0; c0 < items; c0 += chunk) {
    float v[kCompactRegs];
#pragma unroll
    for (int u = 0; u < kCompactRegs; ++u) {
      const long long it = c0 + (long long)u * kCompactThreads + threadIdx.x;
      if (it < items) {
        const long long j = it / p.row_len, c = it - j * p.row_len;
        v[u] = base[(p.L + p.keep[j]) * p.ld + c];
      }
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kCompactRegs; ++u) {
      const long long it = c0 + (long long)u * kCompactThreads + threadIdx.x;
      if (it < items) {
        const long long j = it / p.row_len, c = it - j * p.row_len;
        if (p.keep[j] != j) base[(p.L + j) * p.ld + c] = v[u];
      }
    }
    __syncthreads();
  }
}

__global__ void causal_bits_kernel(uint64_t* bits, int T, int W) {
  const int i = blockIdx.x;
  for (int w = threadIdx.x; w < W; w += blockDim.x) {
    const int lo = w * 64;
    uint64_t m = 0;
    if (i >= lo + 63) m = ~0ull;
    else if (i >= lo) m = (i - lo == 63) ? ~0ull : ((1ull << (i - lo + 1)) - 1ull);
    bits[(size_t)i * W + w] = m;
  }
}

int threads_for(int n) {
  int t = 32;
  while (t < n && t < 256) t *= 2;
  return t;
}

}  // namespace

// ---------------------------------------------------------------- launchers
cudaError_t embed(const EmbedParams& p, cudaStream_t stream) {
  if (!p.tokens || !p.table || !p.out || p.T < 0 || p.V <= 0 || p.Dm <= 0) return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  embed_kernel<<<p.T, threads_for(p.Dm), 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t rmsnorm(const RmsNormParams& p, cudaStream_t stream) {
  if (!p.x || !p.w || !p.y || p.T < 0 || p.D <= 0 || p.ldx < p.D || p.ldy < p.D) return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  rmsnorm_kernel<<<p.T, threads_for(p.D), 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t mla_prep(const MlaPrepParams& p, cudaStream_t stream) {
  if (!p.q || !p.kv || !p.kv_norm_w || !p.inv_freq || !p.positions || !p.cache || !p.q_rope) return cudaErrorInvalidValue;
  if (p.T < 0 || p.H <= 0 || p.C <= 0 || p.R <= 0 || p.R % 2 || p.Dn < 0 || p.ldc < p.C + p.R ||
      p.ldkv < p.C + p.R || p.ldq < p.H * (p.Dn + p.R) || p.row0 < 0)
    return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  mla_prep_kernel<<<p.T, threads_for(p.C), p.R * sizeof(float), stream>>>(p);
  return cudaGetLastError();
}

cudaError_t swiglu(const SwigluParams& p, cudaStream_t stream) {
  if (!p.gu || !p.out || p.rows < 0 || p.I <= 0) return cudaErrorInvalidValue;
  const long long n = (long long)p.rows * p.I;
  if (n == 0) return cudaSuccess;
  long long blocks = (n + 255) / 256;
  if (blocks > 4096) blocks = 4096;
  swiglu_kernel<<<(int)blocks, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t moe_route(const RouteParams& p, cudaStream_t stream) {
  if (!p.logits || !p.bias || !p.topk_idx || !p.topk_w || p.T < 0 || p.E <= 0 || p.G <= 0 || p.E % p.G ||
      p.E / p.G < 2 || p.topk_group < 1 || p.topk_group > p.G || p.K < 1 || p.K > p.topk_group * (p.E / p.G))
    return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  const size_t smem = (size_t)(2 * p.E + p.G) * sizeof(float) + p.E + p.G;
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  moe_route_kernel<<<p.T, 32, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t moe_group(const MoeGroupParams& p, cudaStream_t stream) {
  if (!p.topk_idx || !p.counts || !p.offsets || !p.slot_token || !p.slot_of || !p.tile_expert || !p.tile_row0 ||
      !p.num_tiles || p.T < 0 || p.K < 1 || p.E < 1 || p.tile_rows < 1)
    return cudaErrorInvalidValue;
  moe_count_kernel<<<p.E, kGroupThreads, 0, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  moe_place_kernel<<<p.E, kGroupThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t expert_gemm(const ExpertGemmParams& p, cudaStream_t stream) {
  if (!p.x || !p.w || !p.offsets || !p.tile_expert || !p.tile_row0 || !p.num_tiles || !p.y || p.N <= 0 ||
      p.Kd <= 0 || p.ldx < p.Kd || p.ldy < p.N || p.max_tiles < 0)
    return cudaErrorInvalidValue;
  if (p.max_tiles == 0) return cudaSuccess;
  const bool vec = p.Kd % 4 == 0 && p.ldx % 4 == 0 && ((uintptr_t)p.x % 16) == 0 && ((uintptr_t)p.w % 16) == 0;
  if (p.tile_rows == kExpertSkinnyRows) {
    dim3 grid(p.max_tiles, (p.N + kSkinnyCols - 1) / kSkinnyCols);
    if (vec) expert_gemv_kernel<kExpertSkinnyRows, true><<<grid, kSkinnyWarps * 32, 0, stream>>>(p);
    else expert_gemv_kernel<kExpertSkinnyRows, false><<<grid, kSkinnyWarps * 32, 0, stream>>>(p);
    return cudaGetLastError();
  }
  if (p.tile_rows == kExpertTileRows && !p.swiglu) {
    dim3 grid(p.max_tiles, (p.N + TBN - 1) / TBN);
    if (vec) expert_tiled_kernel<true><<<grid, TThreads, 0, stream>>>(p);
    else expert_tiled_kernel<false><<<grid, TThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
  return cudaErrorInvalidValue;
}

cudaError_t moe_combine(const MoeCombineParams& p, cudaStream_t stream) {
  if (!p.y || !p.topk_idx || !p.topk_w || !p.slot_of || !p.out || p.T < 0 || p.K < 1 || p.K > 64 || p.Dm <= 0)
    return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  moe_combine_kernel<<<p.T, threads_for(p.Dm), 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t cache_compact(const CompactParams& p, cudaStream_t stream) {
  if (!p.cache || !p.keep || !p.count || p.num_layers < 0 || p.row_len <= 0 || p.ld < p.row_len || p.L < 0)
    return cudaErrorInvalidValue;
  if (p.num_layers == 0) return cudaSuccess;
  cache_compact_kernel<<<p.num_layers, kCompactThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t causal_bits(uint64_t* bits, int T, int W, cudaStream_t stream) {
  if (!bits || T < 0 || W < (T + 63) / 64) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  causal_bits_kernel<<<T, 32, 0, stream>>>(bits, T, W);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kdtree
