// model_kernels.cu: the small kernels of the GPU target model (see model_kernels.h). Each one
// mirrors the CPU twin named in its comment (cpp/model/ops.cpp, cpp/model/cpu_model.cpp);
// products and sums that the CPU does one by one are written with __fmul_rn / __fadd_rn so
// that the compiler does not contract them into FMAs (the CPU build has none), which keeps the
// two backends within a few ulps of each other outside the GEMMs.
#include "model/model_kernels.h"

#include <cstdint>
#include <type_traits>
#include "launch.h"
#include "model/vec_load.h"
#include "model/device_math.h"

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
  pdl_prologue();
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

// block_sum for a block that reduces once (no barrier needed before the shared writes).
template <class V>
__device__ __forceinline__ V block_sum_once(V v, V* red /* [32] shared */) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  V t = V(0);
  for (int w = 0; w < nw; ++w) t += red[w];
  return t;
}

// One block per row, threads_for(D) threads; thread i owns elements i + j * blockDim (j < NPT),
// x and w both loaded into registers up front (the weight fetch overlaps the reduction; one pass
// over x), sum of squares in double, one barrier. Same per-thread order and block reduction as
// the generic kernel below, so the same results. NPT * blockDim >= D.
template <int NPT>
__global__ void __launch_bounds__(256) rmsnorm_reg_kernel(RmsNormParams p) {
  pdl_prologue();
  __shared__ double red[32];
  const int t = blockIdx.x, D = p.D, bd = blockDim.x, tid = threadIdx.x;
  const float* x = p.x + (size_t)t * p.ldx;
  float* y = p.y + (size_t)t * p.ldy;
  float xv[NPT], wv[NPT];
#pragma unroll
  for (int j = 0; j < NPT; ++j) {
    const int i = tid + j * bd;
    xv[j] = i < D ? x[i] : 0.f;
    wv[j] = i < D ? __ldg(p.w + i) : 0.f;
  }
  double ss = 0.0;
#pragma unroll
  for (int j = 0; j < NPT; ++j)
    if (tid + j * bd < D) ss += (double)xv[j] * (double)xv[j];
  ss = block_sum_once(ss, red);
  const float inv = rms_inv(ss, D, p.eps);
#pragma unroll
  for (int j = 0; j < NPT; ++j) {
    const int i = tid + j * bd;
    if (i < D) y[i] = __fmul_rn(wv[j], __fmul_rn(xv[j], inv));
  }
}

// Generic (rows longer than 32 * 256): two passes over x.
__global__ void rmsnorm_kernel(RmsNormParams p) {
  pdl_prologue();
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
// RoPE of one pair (ops.cpp rope_row): (a, b) = (x[2j], x[2j+1]) interleaved or (x[j], x[j+half]).
__device__ __forceinline__ void rope_load(const float* x, int half, int j, int interleaved, float& a, float& b) {
  a = interleaved ? x[2 * j] : x[j];
  b = interleaved ? x[2 * j + 1] : x[j + half];
}
__device__ __forceinline__ void rope_store(float a, float b, const float* cs, int half, int j, float* y) {
  const float c = cs[j], s = cs[half + j];
  y[j] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  y[j + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// One block per token, threads_for(C) threads. Latent element i and rope pair u (u < half: the
// key's pair u; else head h = u / half - 1, pair u % half) belong to thread i % blockDim, u %
// blockDim. Every global input is loaded up front (the first kPrepRegs of each kind per thread
// into registers; longer rows re-read the rest), so the loads overlap each other and the cos/sin
// computation; the barrier of the latent's sum of squares also publishes cos/sin. Same
// arithmetic and reduction order as before.
constexpr int kPrepRegs = 4;

__global__ void __launch_bounds__(256) mla_prep_kernel(MlaPrepParams p) {
  pdl_prologue();
  extern __shared__ float cs[];  // [R]: cos | sin
  __shared__ double red[32];
  const int t = blockIdx.x, half = p.R / 2, C = p.C, H = p.H, Dn = p.Dn, Dqk = p.Dn + p.R;
  const int tid = threadIdx.x, bd = blockDim.x, P = (H + 1) * half;
  const float* kv = p.kv + (size_t)t * p.ldkv;
  const float* q = p.q + (size_t)t * p.ldq;
  const int interleaved = p.interleaved;
  const float pos = (float)p.positions[t];
  const long long row0 = p.row0_dev ? (long long)*p.row0_dev + p.row0 : p.row0;
  auto pair_src = [&](int u) { return u < half ? kv + C : q + (size_t)(u / half - 1) * Dqk + Dn; };
  float lv[kPrepRegs], lw[kPrepRegs], ra[kPrepRegs], rb[kPrepRegs];
#pragma unroll
  for (int m = 0; m < kPrepRegs; ++m) {
    const int i = tid + m * bd, u = i;
    lv[m] = i < C ? kv[i] : 0.f;
    lw[m] = i < C ? __ldg(p.kv_norm_w + i) : 0.f;
    ra[m] = rb[m] = 0.f;
    if (u < P) rope_load(pair_src(u), half, u % half, interleaved, ra[m], rb[m]);
  }
  for (int j = tid; j < half; j += bd) {  // ops.cpp rope_cos_sin
    const float ang = __fmul_rn(pos, p.inv_freq[j]);
    cs[j] = __fmul_rn((float)cos((double)ang), p.attention_factor);
    cs[half + j] = __fmul_rn((float)sin((double)ang), p.attention_factor);
  }
  double ss = 0.0;
#pragma unroll
  for (int m = 0; m < kPrepRegs; ++m)
    if (tid + m * bd < C) ss += (double)lv[m] * (double)lv[m];
  for (int i = tid + kPrepRegs * bd; i < C; i += bd) ss += (double)kv[i] * (double)kv[i];
  ss = block_sum_once(ss, red);  // also orders the cs writes before the reads below
  const float inv = rms_inv(ss, C, p.eps);
  float* row = p.cache + (size_t)(row0 + t) * p.ldc;
  float* qr = p.q_rope + (size_t)t * H * p.R;
#pragma unroll
  for (int m = 0; m < kPrepRegs; ++m) {
    const int i = tid + m * bd, u = i;
    if (i < C) row[i] = __fmul_rn(lw[m], __fmul_rn(lv[m], inv));
    if (u < P) rope_store(ra[m], rb[m], cs, half, u % half, u < half ? row + C : qr + (size_t)(u / half - 1) * p.R);
  }
  for (int i = tid + kPrepRegs * bd; i < C; i += bd) row[i] = __fmul_rn(p.kv_norm_w[i], __fmul_rn(kv[i], inv));
  for (int u = tid + kPrepRegs * bd; u < P; u += bd) {
    float a, b;
    rope_load(pair_src(u), half, u % half, interleaved, a, b);
    rope_store(a, b, cs, half, u % half, u < half ? row + C : qr + (size_t)(u / half - 1) * p.R);
  }
}

// ---------------------------------------------------------------- SwiGLU (ops.cpp swiglu_row)

__global__ void swiglu_kernel(SwigluParams p) {
  pdl_prologue();
  const int rows = p.n_rows ? *p.n_rows : p.rows;
  const size_t n = (size_t)rows * p.I;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const size_t r = i / p.I, c = i - r * p.I;
    const float* g = p.gu + r * 2 * p.I;
    p.out[i] = silu_mul(g[c], g[p.I + c]);
  }
}

// ---------------------------------------------------------------- MoE routing (cpu_model.cpp route)
// One block per token, thread e owns expert e (blockDim = E rounded up to a warp). The CPU picks
// the K experts in K rounds of an ascending scan with a strict '>' (the largest b, ties to the
// lower index); that is the strict total order "(v, i) before (w, j) iff v > w or v == w and
// i < j", so expert e's selection round is its rank in that order among the selectable experts
// (the number of selectable experts before it) and the top-K can be found in parallel:
//  1. each warp ranks its own experts (32 shuffles): only those with in-warp rank < min(K, 32)
//     can be in the top-K (everything before a top-K expert is itself top-K, hence in-warp rank
//     < K), so they go to fixed candidate slots (empty slots hold NaN, which compares false);
//  2. each candidate counts the candidates before it: exact for the top-K (all experts before
//     one of them are candidates), >= K for the rest.
// Groups (topk_group < G) likewise: a group's score is its two largest b (as the CPU's top-2
// scan, any tie order gives the same two values), the kept groups are those of rank <
// topk_group by (score, group index). A NaN b or group score ranks as -inf (the CPU's scans
// would depend on where the NaN sits; any total order keeps the ranks a permutation).
__device__ __forceinline__ bool rank_before(float v, int i, float w, int j) {
  return v > w || (v == w && i < j);
}
__device__ __forceinline__ float nan_to_neg_inf(float v) { return v != v ? neg_inf() : v; }

__global__ void __launch_bounds__(1024) moe_route_kernel(RouteParams p) {
  pdl_prologue();
  extern __shared__ float sm[];
  const int E = p.E, G = p.G, K = p.K, per = E / G;
  const int nw = blockDim.x >> 5, KC = K < 32 ? K : 32, NC = nw * KC;
  float* cand_v = sm;                                             // [NC] candidate keys (NaN = empty)
  int* cand_i = reinterpret_cast<int*>(cand_v + NC);             // [NC] candidate experts
  float* sel_s = reinterpret_cast<float*>(cand_i + NC);          // [K] s of the chosen, by rank
  int* sel_i = reinterpret_cast<int*>(sel_s + K);                // [K] chosen experts, by rank
  float* bsh = reinterpret_cast<float*>(sel_i + K);              // [E]  b (group path only)
  float* gs = bsh + E;                                            // [G]  group scores
  int* gsel = reinterpret_cast<int*>(gs + G);                     // [G]  group kept
  const int t = blockIdx.x, e = threadIdx.x, lane = e & 31, warp = e >> 5;
  const float nanv = __int_as_float(0x7fffffff);
  float sv = 0.f, key = nanv;  // key: the selection value b (NaN: not an expert / not selectable)
  if (e < E) {
    sv = 1.f / (1.f + expf(-p.logits[(size_t)t * E + e]));
    key = nan_to_neg_inf(__fadd_rn(sv, p.bias[e]));
  }
  if (p.topk_group < G) {  // else every group is kept
    if (e < E) bsh[e] = key;
    __syncthreads();
    for (int g = e; g < G; g += blockDim.x) {  // the group's two largest b
      const float* bg = bsh + g * per;
      float m1 = fmaxf(bg[0], bg[1]), m2 = fminf(bg[0], bg[1]);
      for (int i = 2; i < per; ++i) {
        const float v = bg[i];
        if (v > m1) {
          m2 = m1;
          m1 = v;
        } else if (v > m2) {
          m2 = v;
        }
      }
      gs[g] = nan_to_neg_inf(__fadd_rn(m1, m2));
    }
    __syncthreads();
    for (int g = e; g < G; g += blockDim.x) {
      const float v = gs[g];
      int r = 0;
      for (int h = 0; h < G; ++h) r += rank_before(gs[h], h, v, g);
      gsel[g] = r < p.topk_group;
    }
    __syncthreads();
    if (e < E && !gsel[e / per]) key = nanv;
  }
  // 1. in-warp rank among the selectable experts of this warp
  int rw = 0;
  for (int j = 0; j < 32; ++j) {
    const float v = __shfl_sync(kFull, key, j);
    rw += rank_before(v, j, key, lane);
  }
  const bool cand = key == key && rw < KC;  // key == key: selectable
  const int ncand = __popc(__ballot_sync(kFull, cand));
  if (cand) {  // candidates fill slots [0, ncand) of the warp's KC
    cand_v[warp * KC + rw] = key;
    cand_i[warp * KC + rw] = e;
  }
  if (lane >= ncand && lane < KC) cand_v[warp * KC + lane] = nanv;
  __syncthreads();
  // 2. rank among all candidates
  if (cand) {
    int r = 0;
    for (int j = 0; j < NC; ++j) r += rank_before(cand_v[j], cand_i[j], key, e);
    if (r < K) {
      sel_i[r] = e;
      sel_s[r] = sv;
    }
  }
  __syncthreads();
  for (int k = e; k < K; k += blockDim.x) {
    float sum = 0.f;  // in selection order, as the CPU
    for (int j = 0; j < K; ++j) sum = __fadd_rn(sum, sel_s[j]);
    float w = sel_s[k];
    if (p.norm_topk_prob) w = __fdiv_rn(w, __fadd_rn(sum, 1e-20f));
    p.topk_idx[(size_t)t * K + k] = sel_i[k];
    p.topk_w[(size_t)t * K + k] = __fmul_rn(w, p.routed_scaling_factor);
  }
}

// ---------------------------------------------------------------- expert grouping
constexpr int kGroupThreads = 256;

__global__ void moe_count_kernel(MoeGroupParams p) {
  pdl_prologue();
  const int e = blockIdx.x, A = p.T * p.K;
  int c = 0;
  for (int i0 = 0; i0 < A; i0 += kGroupThreads) {
    const int i = i0 + threadIdx.x;
    c += __syncthreads_count(i < A && p.topk_idx[i] == e);
  }
  if (threadIdx.x == 0) p.counts[e] = c;
}

__global__ void moe_place_kernel(MoeGroupParams p) {
  pdl_prologue();
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

// Count + scan + placement in one block, for A <= kGroupSmallMax assignments and E <= 1024
// experts (decode, small trees): the same outputs as moe_count_kernel + moe_place_kernel (counts,
// offsets, the tile list in expert order, stable slots in assignment order), one launch instead
// of two. Thread e counts expert e; thread i places assignment i after the earlier ones of its
// expert (O(A) shared-memory reads each).
constexpr int kGroupSmallMax = 1024;

// exclusive prefix sum over the block (blockDim.x <= 1024, a multiple of 32); *total = the sum
__device__ __forceinline__ int block_exclusive_scan(int v, int* wsum, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) wsum[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < nw ? wsum[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFull, w, o);
      if (lane >= o) w += y;
    }
    wsum[lane] = w;
  }
  __syncthreads();
  const int excl = (warp ? wsum[warp - 1] : 0) + x - v;
  *total = wsum[nw - 1];
  __syncthreads();  // wsum may be reused
  return excl;
}

__global__ void __launch_bounds__(kGroupSmallMax) moe_group_small_kernel(MoeGroupParams p) {
  pdl_prologue();
  __shared__ int idx[kGroupSmallMax], off[kGroupSmallMax];
  __shared__ int wsum[32];
  const int tid = threadIdx.x, A = p.T * p.K, E = p.E, TR = p.tile_rows;
  if (tid < A) idx[tid] = p.topk_idx[tid];
  __syncthreads();
  int c = 0;
  if (tid < E) {
    for (int i = 0; i < A; ++i) c += idx[i] == tid;
    p.counts[tid] = c;
  }
  const int tiles = tid < E ? (c + TR - 1) / TR : 0;
  int total_rows, total_tiles;
  const int o = block_exclusive_scan(c, wsum, &total_rows);
  const int to = block_exclusive_scan(tiles, wsum, &total_tiles);
  if (tid < E) {
    off[tid] = o;
    p.offsets[tid + 1] = o + c;
    for (int j = 0; j < tiles; ++j) {
      p.tile_expert[to + j] = tid;
      p.tile_row0[to + j] = o + j * TR;
    }
  }
  if (tid == 0) {
    p.offsets[0] = 0;
    *p.num_tiles = total_tiles;
  }
  __syncthreads();
  if (tid < A) {
    const int e = idx[tid];
    if (e >= 0 && e < E) {
      int r = 0;
      for (int j = 0; j < tid; ++j) r += idx[j] == e;
      const int slot = off[e] + r;
      p.slot_token[slot] = tid / p.K;
      p.slot_of[tid] = slot;
    }
  }
}

// ---------------------------------------------------------------- grouped expert GEMM, skinny
// GEMV-style, for tiles of <= MS slots (decode: one slot per tile). Memory-bound: the point is to
// have many of the tile's weight bytes in flight, each streamed once per tile.
// Launch: grid (max_tiles, ceil(N / (kSkinnyWarps * CPW))), kSkinnyWarps * 32 = 128 threads;
// blocks past *num_tiles return at once. Warp w owns the output columns nb .. nb + CPW - 1, nb =
// (blockIdx.y * kSkinnyWarps + w) * CPW: kSkinnyRW = 4 weight rows (CPW = 4 plain; CPW = 2 with
// SwiGLU, gate row n and up row N + n of each column). Lane l covers the float4 columns l + 32 i
// (VEC) or the floats l + 32 i (scalar) of each row; U k-steps per iteration, their 4 * U loads
// all issued before the FMAs (U = 4: 16 independent 16-byte loads per lane), the first
// iteration's before the wait on the tile's row count. The tile's x rows are read through L1
// (__ldg; the block's warps read the same rows): no shared staging, no barrier. Per output, a
// lane sums its k-steps in ascending order, then a butterfly over the warp: the summation order
// of the previous (shared-staged) kernel, so the same results.
constexpr int kSkinnyWarps = 4, kSkinnyRW = 4;

__device__ __forceinline__ float wdot(float w, float x, float acc) { return acc + w * x; }
__device__ __forceinline__ float wdot(const float4& g4, const float4& x4, float acc) {
  return acc + (g4.x * x4.x + g4.y * x4.y + g4.z * x4.z + g4.w * x4.w);
}

template <int MS, int U, bool SWI, bool VEC>
__global__ void __launch_bounds__(kSkinnyWarps * 32, 3) expert_gemv_kernel(ExpertGemmParams p) {
  pdl_prologue();
  using WT = typename std::conditional<VEC, float4, float>::type;
  constexpr int CPW = SWI ? kSkinnyRW / 2 : kSkinnyRW;  // output columns per warp
  constexpr int RW = kSkinnyRW;                         // weight rows per warp
  constexpr int VW = VEC ? 4 : 1;                       // floats per lane and k-step
  const int tile = blockIdx.x;
  // The schedule loads are independent (tile_expert / tile_row0 hold max_tiles entries; those
  // past *num_tiles are not used), so they go out together.
  const int nt = __ldg(p.num_tiles), e = __ldg(p.tile_expert + tile), r0 = __ldg(p.tile_row0 + tile);
  if (tile >= nt || e < 0 || r0 < 0) return;  // (e, r0 >= 0 always: keeps their loads above the exit)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int Kd = p.Kd, N = p.N;
  const int nb = (blockIdx.y * kSkinnyWarps + warp) * CPW;
  if (nb >= N) return;  // no block barrier below
  const int ncol = min(CPW, N - nb);
  const float* W = p.w + (size_t)e * (SWI ? 2 : 1) * N * Kd;
  const float* wrow[RW];  // gate rows nb.., then (SwiGLU) up rows N + nb..; rows >= N clamped, unused
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    const int c = min(SWI ? i % CPW : i, ncol - 1);
    wrow[i] = W + (size_t)((SWI && i >= CPW ? N : 0) + nb + c) * Kd;
  }
  const int nsteps = (Kd + 32 * VW - 1) / (32 * VW);
  WT wv[U][RW];
  auto load_w = [&](int s0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = ((s0 + u) * 32 + lane) * VW;
#pragma unroll
      for (int i = 0; i < RW; ++i) {
        const int c = SWI ? i % CPW : i;
        if (k < Kd && c < ncol) wv[u][i] = ldg_vec<WT>(wrow[i] + k);
        else vzero(wv[u][i]);
      }
    }
  };
  load_w(0);  // in flight while the tile's rows are looked up

  // x row of each slot. Slot r0 always belongs to the tile: its row is looked up at once; the
  // others (rows > 1) after the wait on offsets, in the first iteration, so that the weight
  // loads above are issued first (clamped to the tile's last slot; unused past rows).
  int src[MS];
  src[0] = p.x_row ? __ldg(p.x_row + r0) : r0;
#pragma unroll
  for (int r = 1; r < MS; ++r) src[r] = src[0];
  const int rows = min(MS, __ldg(p.offsets + e + 1) - r0);
  float acc[RW][MS];
#pragma unroll
  for (int i = 0; i < RW; ++i)
#pragma unroll
    for (int r = 0; r < MS; ++r) acc[i][r] = 0.f;

  for (int s0 = 0;;) {
    if (s0 == 0 && rows > 1) {
#pragma unroll
      for (int r = 1; r < MS; ++r) {
        const int s = r0 + min(r, rows - 1);
        src[r] = p.x_row ? __ldg(p.x_row + s) : s;
      }
    }
#pragma unroll
    for (int r = 0; r < MS; ++r) {
      if (r < rows) {  // slot by slot; the slot's U x loads issued together
        const float* xr = p.x + (size_t)src[r] * p.ldx;
        WT xv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int k = ((s0 + u) * 32 + lane) * VW;
          if (k < Kd) xv[u] = ldg_vec<WT>(xr + k);
          else vzero(xv[u]);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (((s0 + u) * 32 + lane) * VW < Kd) {
#pragma unroll
            for (int i = 0; i < RW; ++i) acc[i][r] = wdot(wv[u][i], xv[u], acc[i][r]);
          }
        }
      }
    }
    s0 += U;
    if (s0 >= nsteps) break;
    load_w(s0);
  }
#pragma unroll
  for (int c = 0; c < CPW; ++c) {
    if (c >= ncol) break;
    const int n = nb + c;
#pragma unroll
    for (int r = 0; r < MS; ++r) {
      if (r < rows) {
        float a = acc[c][r], u = SWI ? acc[CPW + c][r] : 0.f;
        for (int o = 16; o > 0; o >>= 1) {
          a += __shfl_xor_sync(kFull, a, o);
          if (SWI) u += __shfl_xor_sync(kFull, u, o);
        }
        if (lane == 0) p.y[(size_t)(r0 + r) * p.ldy + n] = SWI ? silu_mul(a, u) : a;
      }
    }
  }
}

// ---------------------------------------------------------------- grouped expert GEMM, tiled
// Block: 64 slots x 64 columns, k-steps of 16 through shared memory, 4x4 outputs per thread.
// The global loads run kTilePf k-steps ahead of the step being computed (a ring of register
// stages, unrolled so that it stays in registers): without it every k-step waited for a full
// HBM round trip (H200, mini-kimi verify of 65 tokens: ~100 us per expert GEMM, latency-bound).
constexpr int TBM = kExpertTileRows, TBN = 64, TBK = 16, TThreads = 256;
constexpr int kTilePf = 4;

template <bool VEC>
__global__ void __launch_bounds__(TThreads) expert_tiled_kernel(ExpertGemmParams p) {
  pdl_prologue();
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
  const int ar = arow[lr], n = n0 + lr;
  const float* xrow = ar >= 0 ? p.x + (size_t)ar * p.ldx : nullptr;
  const float* wrow = n < N ? W + (size_t)n * Kd : nullptr;
  auto load_step = [&](int step, float* a, float* b) {
    const int k0 = step * TBK;
    if (VEC && k0 + lk + 3 < Kd) {
      float4 a4 = make_float4(0.f, 0.f, 0.f, 0.f), b4 = a4;
      if (xrow) a4 = *reinterpret_cast<const float4*>(xrow + k0 + lk);
      if (wrow) b4 = __ldg(reinterpret_cast<const float4*>(wrow + k0 + lk));
      a[0] = a4.x; a[1] = a4.y; a[2] = a4.z; a[3] = a4.w;
      b[0] = b4.x; b[1] = b4.y; b[2] = b4.z; b[3] = b4.w;
    } else {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int k = k0 + lk + u;
        a[u] = (xrow && k < Kd) ? xrow[k] : 0.f;
        b[u] = (wrow && k < Kd) ? __ldg(wrow + k) : 0.f;
      }
    }
  };
  const int nsteps = (Kd + TBK - 1) / TBK;
  float ra[kTilePf][4], rb[kTilePf][4];
#pragma unroll
  for (int u = 0; u < kTilePf; ++u)
    if (u < nsteps) load_step(u, ra[u], rb[u]);
  for (int it0 = 0; it0 < nsteps; it0 += kTilePf) {
#pragma unroll
    for (int u = 0; u < kTilePf; ++u) {
      const int it = it0 + u;
      if (it >= nsteps) break;  // block-uniform
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        As[lk + v][lr] = ra[u][v];
        Bs[lk + v][lr] = rb[u][v];
      }
      __syncthreads();
      if (it + kTilePf < nsteps) load_step(it + kTilePf, ra[u], rb[u]);  // in flight during the FMAs
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
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty * 4 + i;
    if (r >= rows) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int nn = n0 + tx * 4 + j;
      if (nn < N) p.y[(size_t)(r0 + r) * p.ldy + nn] = acc[i][j];
    }
  }
}

// ---------------------------------------------------------------- MoE combine
// Grid (T, chunks of the row), kCombineThreads threads (at least K); each thread owns one float4
// (VEC) or one float of out[t]. Threads k < K rank the token's picks by (expert, k) in parallel
// (the order of a stable sort by expert index) and stage their slots and weights in shared
// memory in that order; the thread's out / shared values are loaded before that barrier and its
// K expert rows after it (unrolled: all in flight together). Per element the same operations in
// the same order as the CPU's (cpu_model.cpp) and the previous kernel's.
constexpr int kCombineThreads = 128;

template <bool VEC>
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(MoeCombineParams p) {
  pdl_prologue();
  using VT = typename std::conditional<VEC, float4, float>::type;
  constexpr int VW = VEC ? 4 : 1;
  __shared__ int sidx[64], sslot[64];
  __shared__ float sw[64];
  const int t = blockIdx.x, K = p.K, Dm = p.Dm, tid = threadIdx.x;
  int my_idx = 0, my_slot = 0;
  float my_w = 0.f;
  if (tid < K) {
    const int a = t * K + tid;
    my_idx = p.topk_idx[a];
    my_slot = p.slot_of[a];
    my_w = p.topk_w[a];
    sidx[tid] = my_idx;
  }
  const int i = (blockIdx.y * blockDim.x + tid) * VW;
  const bool active = i < Dm;
  const size_t o = (size_t)t * Dm + i;
  VT prev, sh;
  vzero(prev);
  vzero(sh);
  if (active && p.accumulate) prev = *reinterpret_cast<const VT*>(p.out + o);
  if (active && p.shared) sh = ldg_vec<VT>(p.shared + o);
  __syncthreads();
  if (tid < K) {
    int rank = 0;
    for (int j = 0; j < K; ++j) {
      const int v = sidx[j];
      rank += (v < my_idx || (v == my_idx && j < tid)) ? 1 : 0;
    }
    sslot[rank] = my_slot;
    sw[rank] = my_w;
  }
  __syncthreads();
  if (!active) return;
  float acc[VW];
#pragma unroll
  for (int c = 0; c < VW; ++c) acc[c] = 0.f;
  for (int j0 = 0; j0 < K; j0 += 8) {  // 8 expert rows in flight
    VT v[8];
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      if (j0 + jj < K) v[jj] = ldg_vec<VT>(p.y + (size_t)sslot[j0 + jj] * Dm + i);
      else vzero(v[jj]);
    }
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      if (j0 + jj < K) {
        const float w = sw[j0 + jj];
        const float* vv = reinterpret_cast<const float*>(&v[jj]);
#pragma unroll
        for (int c = 0; c < VW; ++c) acc[c] = __fadd_rn(acc[c], __fmul_rn(vv[c], w));
      }
    }
  }
  const float* shv = reinterpret_cast<const float*>(&sh);
  const float* pv = reinterpret_cast<const float*>(&prev);
  VT res;
  float* rv = reinterpret_cast<float*>(&res);
#pragma unroll
  for (int c = 0; c < VW; ++c) {
    float a = acc[c];
    if (p.shared) a = __fadd_rn(a, shv[c]);
    rv[c] = p.accumulate ? __fadd_rn(pv[c], a) : a;
  }
  *reinterpret_cast<VT*>(p.out + o) = res;
}

// ---------------------------------------------------------------- cache compaction
constexpr int kCompactThreads = 256, kCompactRegs = 16;

__global__ void cache_compact_kernel(CompactParams p) {
  pdl_prologue();
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
  pdl_prologue();
  const int i = blockIdx.x;
  for (int w = threadIdx.x; w < W; w += blockDim.x) {
    const int lo = w * 64;
    uint64_t m = 0;
    if (i >= lo + 63) m = ~0ull;
    else if (i >= lo) m = (i - lo == 63) ? ~0ull : ((1ull << (i - lo + 1)) - 1ull);
    bits[(size_t)i * W + w] = m;
  }
}

// ---------------------------------------------------------------- the target's choice (engine/sampler.cpp)
// Greedy: per thread an ascending scan with a strict '>' (lowest id of a tie), NaN skipped; the
// per-thread bests then merge by (value, lower id).
__device__ __forceinline__ void arg_take(float x, int i, float& bv, int& bi) {
  if (x > bv || (bi < 0 && x == x)) {
    bv = x;
    bi = i;
  }
}
__device__ __forceinline__ bool arg_better(float v, int i, float bv, int bi) {
  return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

template <int THREADS, bool VEC>
__global__ void __launch_bounds__(THREADS) choose_greedy_kernel(ChooseParams p) {
  pdl_prologue();
  __shared__ float rv[32];
  __shared__ int ri[32];
  const float* l = p.logits + (size_t)blockIdx.x * p.ldl;
  const int V = p.V, tid = threadIdx.x;
  float bv = neg_inf();
  int bi = -1;
  int tail = 0;
  if (VEC) {
    const float4* l4 = reinterpret_cast<const float4*>(l);
    const int V4 = V >> 2;
    constexpr int U = 4;
    int q = tid;
    for (; q + (U - 1) * THREADS < V4; q += U * THREADS) {
      float4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = __ldcs(l4 + q + u * THREADS);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = 4 * (q + u * THREADS);
        arg_take(v[u].x, i, bv, bi);
        arg_take(v[u].y, i + 1, bv, bi);
        arg_take(v[u].z, i + 2, bv, bi);
        arg_take(v[u].w, i + 3, bv, bi);
      }
    }
    for (; q < V4; q += THREADS) {
      const float4 v = __ldcs(l4 + q);
      arg_take(v.x, 4 * q, bv, bi);
      arg_take(v.y, 4 * q + 1, bv, bi);
      arg_take(v.z, 4 * q + 2, bv, bi);
      arg_take(v.w, 4 * q + 3, bv, bi);
    }
    tail = 4 * V4;
  }
  for (int i = tail + tid; i < V; i += THREADS) arg_take(__ldcs(l + i), i, bv, bi);
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFull, bv, o);
    const int oi = __shfl_xor_sync(kFull, bi, o);
    if (arg_better(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
  const int warp = tid >> 5, lane = tid & 31;
  if (lane == 0) {
    rv[warp] = bv;
    ri[warp] = bi;
  }
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < THREADS / 32; ++w)
      if (arg_better(rv[w], ri[w], bv, bi)) {
        bv = rv[w];
        bi = ri[w];
      }
    p.choice[blockIdx.x] = bi < 0 ? 0 : bi;
  }
}

// Sampling. Candidate order of the CPU when filtering: logit descending (NaN as -inf, -0 == +0),
// ties by lower id. ck = (order_key(logit) << 32) | ~id is that order as one unique 64-bit key
// (larger = earlier), so "the first n candidates" is always {ck >= some threshold}.
//  - top_k <= kSampCap, or top_p alone: one pass keeps each thread's R largest ck; the n0-th
//    largest of those (n0 = top_k, or kNucleus0 for top_p) is a threshold L with at least n0
//    candidates >= L (usually a few more). Those are gathered into shared memory and sorted,
//    and the CPU's loops run on them as written (same order of every double operation; the
//    total of a nucleus-only softmax is the one sum over the whole row, see set_mass). If more
//    than kSampCap pass L, an exact radix count selection (8-bit digits over ck) finds a
//    threshold instead.
//  - unfiltered: the inverse CDF in id order over tiles / groups of the row (sample_unfiltered).
//  - otherwise (top_k > kSampCap, a nucleus longer than the gathered candidates): radix
//    selection to the exact candidate by count / probability mass (per-bin sums), slower.
// Probabilities: p = exp((double(l) - mx) * inv_t), 0 for NaN, mx = the largest non-NaN logit.
constexpr int kSampThreads = 512, kSampWarps = kSampThreads / 32, kSampCap = 2048, kNfGroups = 256;
constexpr int kHistWarps = 8, kHistThreads = kHistWarps * 32;  // the radix passes' threads
constexpr int kStreamU = 8;   // float4 loads in flight per thread in the streaming passes
constexpr int kSampBatch = 8; // scalar loads in flight per thread in the radix passes
constexpr int kNucleus0 = 1024;

__device__ __forceinline__ uint32_t order_key(float x) {
  if (x != x) x = neg_inf();
  uint32_t u = __float_as_uint(x);
  if (x == 0.f) u = 0u;  // -0 ties with +0 (the CPU compares floats)
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ unsigned long long cand_key(float x, int id) {
  return ((unsigned long long)order_key(x) << 32) | (unsigned long long)(~(uint32_t)id);
}
__device__ __forceinline__ int key_id(unsigned long long ck) { return (int)(~(uint32_t)ck); }
__device__ __forceinline__ double prob_of(float l, double mx, double inv_t) {
  return l != l ? 0.0 : exp(__dmul_rn(__dsub_rn((double)l, mx), inv_t));
}

// Logits 4q .. 4q+3 (NaN past V); one float4 load when the row is 16-byte aligned.
__device__ __forceinline__ float4 load_quad(const float* l, int V, int q, bool vec) {
  const int i = 4 * q;
  if (vec && i + 3 < V) return __ldcg(reinterpret_cast<const float4*>(l) + q);
  const float nanv = __int_as_float(0x7fffffff);
  return make_float4(i < V ? l[i] : nanv, i + 1 < V ? l[i + 1] : nanv, i + 2 < V ? l[i + 2] : nanv,
                     i + 3 < V ? l[i + 3] : nanv);
}

// f(logit, id) for this thread's ids (quads q = tid + j * kSampThreads, ascending), kStreamU
// float4 loads in flight.
template <class F>
__device__ __forceinline__ void for_each_logit(const float* l, int V, bool vec, F&& f) {
  const int nq = (V + 3) >> 2;
  for (int q0 = threadIdx.x; q0 < nq; q0 += kSampThreads * kStreamU) {
    float4 v[kStreamU];
#pragma unroll
    for (int u = 0; u < kStreamU; ++u) {
      const int q = q0 + u * kSampThreads;
      v[u] = q < nq ? load_quad(l, V, q, vec) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kStreamU; ++u) {
      const int q = q0 + u * kSampThreads, i = 4 * q;
      if (q < nq) {
        f(v[u].x, i);
        if (i + 1 < V) f(v[u].y, i + 1);
        if (i + 2 < V) f(v[u].z, i + 2);
        if (i + 3 < V) f(v[u].w, i + 3);
      }
    }
  }
}

struct SampShared {
  union {
    struct {
      double mass[kHistWarps][256];
      int cnt[kHistWarps][256];
    } h;  // radix histograms, one per warp (deterministic sums)
    struct {
      unsigned long long ck[kSampCap];
      double p[kSampCap];
    } g;  // gathered candidates
    struct {
      double group[kNfGroups];
      double tile[kSampCap];  // gt <= kSampCap: V <= kNfGroups * kSampCap * 128
    } nf;  // unfiltered: sums of id-order groups / of one group's tiles
  } u;
  unsigned long long sample[256];  // ck of an element of each bin (exact when the bin has one)
  double red_d[32];
  float red_f[32];
  unsigned long long red_u[32];
  // broadcast from one thread
  int b_status, b_bin, b_n, b_choice;
  long long b_above_c, b_bin_c;
  double b_above_m, b_bin_m, b_total, b_mx;
  unsigned long long b_ck;
};

__device__ __forceinline__ float block_max_f(SampShared& sh, float m) {
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.red_f[threadIdx.x >> 5] = m;
  __syncthreads();
  m = sh.red_f[0];
  for (int w = 1; w < kSampWarps; ++w) m = fmaxf(m, sh.red_f[w]);
  return m;
}
__device__ __forceinline__ unsigned long long block_max_u(SampShared& sh, unsigned long long c) {
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long k = __shfl_xor_sync(kFull, c, o);
    c = k > c ? k : c;
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.red_u[threadIdx.x >> 5] = c;
  __syncthreads();
  c = sh.red_u[0];
  for (int w = 1; w < kSampWarps; ++w) c = sh.red_u[w] > c ? sh.red_u[w] : c;
  return c;
}

// Largest non-NaN logit (-inf if none) and the largest ck (the CPU's first filtered candidate).
__device__ void row_max(SampShared& sh, const float* l, int V, bool vec, float& mx, unsigned long long& mck) {
  float m = neg_inf();
  unsigned long long c = 0;
  for_each_logit(l, V, vec, [&](float x, int i) {
    m = fmaxf(m, x);  // fmaxf ignores a NaN operand
    const unsigned long long k = cand_key(x, i);
    c = k > c ? k : c;
  });
  mx = block_max_f(sh, m);
  mck = block_max_u(sh, c);
}

// Sum of p over {ck >= cmin}, in a fixed order (per thread ascending, then the warp's xor tree,
// then the warps in order).
__device__ double set_mass(SampShared& sh, const float* l, int V, bool vec, unsigned long long cmin, double mx,
                           double inv_t) {
  double s = 0.0;
  for_each_logit(l, V, vec, [&](float x, int i) {
    if (cand_key(x, i) >= cmin) s += prob_of(x, mx, inv_t);
  });
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.red_d[threadIdx.x >> 5] = s;
  __syncthreads();
  s = 0.0;
  for (int w = 0; w < kSampWarps; ++w) s += sh.red_d[w];
  return s;
}

// The candidate of {ck >= cmin} that comes last in the order among those with p > 0 (the CPU's
// fallback when rounding leaves the target at the very top); 0 if none.
__device__ unsigned long long last_positive(SampShared& sh, const float* l, int V, bool vec,
                                            unsigned long long cmin, double mx, double inv_t) {
  unsigned long long c = ~0ull;
  for_each_logit(l, V, vec, [&](float x, int i) {
    const unsigned long long k = cand_key(x, i);
    if (k >= cmin && k < c && prob_of(x, mx, inv_t) > 0.0) c = k;
  });
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long k = __shfl_xor_sync(kFull, c, o);
    c = k < c ? k : c;
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.red_u[threadIdx.x >> 5] = c;
  __syncthreads();
  c = ~0ull;
  for (int w = 0; w < kSampWarps; ++w) c = sh.red_u[w] < c ? sh.red_u[w] : c;
  return c == ~0ull ? 0ull : c;
}

// Sorts sh.u.g.ck[0, n2) descending (n2 a power of two, >= 2), bitonic.
__device__ void sort_desc(SampShared& sh, int n2) {
  __syncthreads();
  for (int k = 2; k <= n2; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n2; i += kSampThreads) {
        const int o = i ^ j;
        if (o > i) {
          const unsigned long long a = sh.u.g.ck[i], b = sh.u.g.ck[o];
          if ((i & k) == 0 ? a < b : a > b) {
            sh.u.g.ck[i] = b;
            sh.u.g.ck[o] = a;
          }
        }
      }
      __syncthreads();
    }
}

// One pass: each thread's R largest ck and the row's largest non-NaN logit; then the n0-th
// largest of the kSampThreads * R kept keys (n0 <= that), a threshold with >= n0 candidates above
// or at it. Also the largest ck (mck).
template <int R>
__device__ void scan_threshold(SampShared& sh, const float* l, int V, bool vec, int n0, float& mx,
                               unsigned long long& thr, unsigned long long& mck) {
  unsigned long long top[R];
#pragma unroll
  for (int j = 0; j < R; ++j) top[j] = 0ull;
  float m = neg_inf();
  for_each_logit(l, V, vec, [&](float x, int i) {
    m = fmaxf(m, x);
    const unsigned long long k = cand_key(x, i);
    if (k > top[R - 1]) {
      top[R - 1] = k;
#pragma unroll
      for (int j = R - 1; j > 0; --j)
        if (top[j] > top[j - 1]) {
          const unsigned long long t = top[j];
          top[j] = top[j - 1];
          top[j - 1] = t;
        }
    }
  });
  mx = block_max_f(sh, m);  // (syncs: the union is free)
#pragma unroll
  for (int j = 0; j < R; ++j) sh.u.g.ck[threadIdx.x * R + j] = top[j];
  sort_desc(sh, kSampThreads * R);
  thr = sh.u.g.ck[n0 - 1];
  mck = sh.u.g.ck[0];
  __syncthreads();
}

// Gathers {ck >= lo} into sh.u.g.ck, sorted descending, when they are at most kSampCap; returns
// their number (more than kSampCap: nothing usable gathered).
// (With mask: only those with (ck & mask) == prefix.)
__device__ int gather_sorted(SampShared& sh, const float* l, int V, bool vec, unsigned long long lo,
                             unsigned long long mask = 0ull, unsigned long long prefix = 0ull) {
  __syncthreads();
  if (threadIdx.x == 0) sh.b_n = 0;
  __syncthreads();
  for_each_logit(l, V, vec, [&](float x, int i) {
    const unsigned long long ck = cand_key(x, i);
    if (ck >= lo && (ck & mask) == prefix) {
      const int slot = atomicAdd(&sh.b_n, 1);
      if (slot < kSampCap) sh.u.g.ck[slot] = ck;
    }
  });
  __syncthreads();
  const int n = sh.b_n;
  if (n > kSampCap) return n;
  int n2 = 2;
  while (n2 < n) n2 <<= 1;
  for (int i = n + threadIdx.x; i < n2; i += kSampThreads) sh.u.g.ck[i] = 0ull;  // padding sorts last
  sort_desc(sh, n2);
  return n;
}

enum { kSelCount = 0, kSelMassGE = 1, kSelMassGT = 2 };
enum { kSelNotFound = 0, kSelExact = 1, kSelEarly = 2 };

// Radix selection over the elements with ck >= cmin, in candidate order: the first element at
// which the running count reaches `need` (kSelCount) or the running mass reaches thr (>=,
// kSelMassGE) or exceeds it (>, kSelMassGT). Returns kSelExact with the element's ck and the
// count / mass up to and including it, kSelEarly (only when `early`) with ck = a threshold such
// that {ck >= threshold} holds n <= kSampCap elements and contains the crossing, or kSelNotFound.
// Histogram passes by the first kHistWarps warps (per-warp histograms: the sums are
// deterministic); every thread must call it.
__device__ int radix_select(SampShared& sh, const float* l, int V, bool vec, int mode, long long need, double thr,
                            unsigned long long cmin, bool early, double mx, double inv_t,
                            unsigned long long& rck, long long& rcnt, double& rmass) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const bool with_mass = mode != kSelCount, act = warp < kHistWarps;
  unsigned long long prefix = 0;
  long long above_c = 0;
  double above_m = 0.0;
  const int nq = (V + 3) >> 2, iters = (nq + kHistThreads - 1) / kHistThreads;
  for (int shift = 56; shift >= 0; shift -= 8) {
    __syncthreads();
    for (int i = tid; i < kHistWarps * 256; i += kSampThreads) {
      (&sh.u.h.mass[0][0])[i] = 0.0;
      (&sh.u.h.cnt[0][0])[i] = 0;
    }
    __syncthreads();
    const unsigned long long hi_mask = shift == 56 ? 0ull : (~0ull << (shift + 8));
    if (act) {
      for (int it0 = 0; it0 < iters; it0 += kSampBatch) {
        float4 xs[kSampBatch];
#pragma unroll
        for (int b = 0; b < kSampBatch; ++b) {  // loads first: several in flight per thread
          const int q = (it0 + b) * kHistThreads + tid;
          xs[b] = q < nq ? load_quad(l, V, q, vec) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int b = 0; b < kSampBatch; ++b)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int i = 4 * ((it0 + b) * kHistThreads + tid) + c;
            const float x = c == 0 ? xs[b].x : c == 1 ? xs[b].y : c == 2 ? xs[b].z : xs[b].w;
            const unsigned long long ck = cand_key(x, i);
            const bool in = i < V && ck >= cmin && (ck & hi_mask) == prefix;
            unsigned rem = __ballot_sync(kFull, in);
            if (!rem) continue;
            const int bin = (int)(ck >> shift) & 255;
            const double pm = (with_mass && in) ? prob_of(x, mx, inv_t) : 0.0;
            while (rem) {  // one bin at a time: its lanes' count and (xor-tree) mass
              const int src = __ffs(rem) - 1;
              const int bb = __shfl_sync(kFull, bin, src);
              const bool mine = in && bin == bb;
              const unsigned grp = __ballot_sync(kFull, mine);
              double v = mine ? pm : 0.0;
              if (with_mass)
                for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
              if (lane == src) {
                sh.u.h.mass[warp][bb] += v;
                sh.u.h.cnt[warp][bb] += __popc(grp);
                sh.sample[bb] = ck;
              }
              rem &= ~grp;
            }
          }
      }
    }
    __syncthreads();
    if (tid < 256) {  // merge the warps' histograms, in warp order (column tid is this thread's)
      double m = 0.0;
      int c = 0;
      for (int w = 0; w < kHistWarps; ++w) {
        m += sh.u.h.mass[w][tid];
        c += sh.u.h.cnt[w][tid];
      }
      sh.u.h.mass[0][tid] = m;
      sh.u.h.cnt[0][tid] = c;
    }
    __syncthreads();
    if (warp == 0) {  // decide: lane L holds bins 255-8L .. 248-8L (candidate order)
      long long c[8], lc = 0;
      double m[8], lm = 0.0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int b = 255 - 8 * lane - j;
        c[j] = sh.u.h.cnt[0][b];
        m[j] = sh.u.h.mass[0][b];
        lc += c[j];
        lm += m[j];
      }
      long long ic = lc;
      double im = lm;
      for (int o = 1; o < 32; o <<= 1) {
        const long long oc = __shfl_up_sync(kFull, ic, o);
        const double om = __shfl_up_sync(kFull, im, o);
        if (lane >= o) {
          ic += oc;
          im = om + im;
        }
      }
      double em = __shfl_up_sync(kFull, im, 1);
      if (lane == 0) em = 0.0;
      const long long ec = ic - lc;
      long long rc = above_c + ec;
      double rm = above_m + em;
      int hit = -1, last = -1;
      long long hc = 0, lc2 = 0, hbc = 0, lbc = 0;
      double hm = 0.0, lm2 = 0.0, hbm = 0.0, lbm = 0.0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const long long nc = rc + c[j];
        const double nm = rm + m[j];
        const bool cross = mode == kSelCount ? nc >= need : (mode == kSelMassGE ? nm >= thr : nm > thr);
        if (hit < 0 && c[j] > 0 && cross) {
          hit = j;
          hc = rc;
          hm = rm;
          hbc = c[j];
          hbm = m[j];
        }
        if (c[j] > 0 && (mode == kSelCount || m[j] > 0.0)) {
          last = j;
          lc2 = rc;
          lm2 = rm;
          lbc = c[j];
          lbm = m[j];
        }
        rc = nc;
        rm = nm;
      }
      const unsigned hits = __ballot_sync(kFull, hit >= 0);
      const unsigned lasts = __ballot_sync(kFull, last >= 0);
      if (hits) {
        if (lane == __ffs(hits) - 1) {
          sh.b_status = kSelExact;
          sh.b_bin = 255 - 8 * lane - hit;
          sh.b_above_c = hc;
          sh.b_above_m = hm;
          sh.b_bin_c = hbc;
          sh.b_bin_m = hbm;
        }
      } else if (shift != 56 && lasts) {  // rounding: the parent crossed, its parts do not; its end
        if (lane == 31 - __clz(lasts)) {
          sh.b_status = kSelExact;
          sh.b_bin = 255 - 8 * lane - last;
          sh.b_above_c = lc2;
          sh.b_above_m = lm2;
          sh.b_bin_c = lbc;
          sh.b_bin_m = lbm;
        }
      } else if (lane == 0) {
        sh.b_status = kSelNotFound;
      }
    }
    __syncthreads();
    const int status = sh.b_status, bin = sh.b_bin;
    if (status == kSelNotFound) return kSelNotFound;
    above_c = sh.b_above_c;
    above_m = sh.b_above_m;
    const long long bc = sh.b_bin_c;
    prefix |= (unsigned long long)bin << shift;
    if (early && above_c + bc <= kSampCap) {
      rck = prefix;
      rcnt = above_c + bc;
      return kSelEarly;
    }
    if (bc == 1 || shift == 0) {
      rck = bc == 1 ? sh.sample[bin] : prefix;
      rcnt = above_c + 1;
      rmass = above_m + sh.b_bin_m;
      return kSelExact;
    }
    if (bc <= kSampCap) {  // the bin fits: gather it, sort it, walk it in order from the running totals
      const int n = gather_sorted(sh, l, V, vec, cmin, ~0ull << shift, prefix);
      if (with_mass)
        for (int i = tid; i < n; i += kSampThreads) sh.u.g.p[i] = prob_of(l[key_id(sh.u.g.ck[i])], mx, inv_t);
      __syncthreads();
      if (tid == 0) {
        int pick = -1, lastp = -1;
        double mm = above_m, mpick = 0.0, mlast = 0.0;
        if (mode == kSelCount) {
          pick = (int)(need - above_c - 1);
          pick = pick < 0 ? 0 : (pick >= n ? n - 1 : pick);
        } else {
          for (int i = 0; i < n && pick < 0; ++i) {
            const double pi = sh.u.g.p[i];
            mm = mm + pi;
            if (pi > 0.0) {
              lastp = i;
              mlast = mm;
            }
            if (mode == kSelMassGE ? mm >= thr : mm > thr) {
              pick = i;
              mpick = mm;
            }
          }
          if (pick < 0) {  // rounding: the bin crossed, its elements do not; its last with p > 0
            pick = lastp < 0 ? n - 1 : lastp;
            mpick = mlast;
          }
        }
        sh.b_ck = sh.u.g.ck[pick];
        sh.b_above_c = above_c + pick + 1;
        sh.b_total = mpick;
      }
      __syncthreads();
      rck = sh.b_ck;
      rcnt = sh.b_above_c;
      rmass = sh.b_total;
      return kSelExact;
    }
  }
  return kSelNotFound;  // not reached
}

// The CPU's loops (sampler.cpp) over the first candidates, gathered and sorted (sh.u.g.ck[0,
// ng)): n = k (top_k; mx found here, over them) or all ng (nucleus only; mx given). total:
// summed here over the n (sum_total: top_k, or the whole vocabulary gathered) or given (the whole
// row's). Returns false (nothing chosen) when the nucleus reaches past the gathered candidates
// (allow_short: they are not the whole row).
__device__ bool finish_gathered(SampShared& sh, const float* l, int ng, bool use_k, long long k, bool use_p,
                                float top_p, double given_mx, bool sum_total, double given_total,
                                bool allow_short, double inv_t, double u) {
  const int n = use_k ? (int)k : ng;
  const int tid = threadIdx.x;
  for (int i = tid; i < n; i += kSampThreads) sh.u.g.p[i] = (double)l[key_id(sh.u.g.ck[i])];  // logits
  __syncthreads();
  if (tid == 0) {
    double mx = given_mx;
    if (use_k) {
      mx = neg_inf();
      for (int i = 0; i < n; ++i) {
        const double x = sh.u.g.p[i];
        if (x == x) mx = fmax(mx, x);
      }
    }
    sh.b_mx = mx;
    sh.b_status = isfinite(mx) ? 1 : 0;
  }
  __syncthreads();
  if (!sh.b_status) {  // nothing finite: the first candidate
    if (tid == 0) sh.b_choice = key_id(sh.u.g.ck[0]);
    return true;
  }
  const double mx = sh.b_mx;
  for (int i = tid; i < n; i += kSampThreads) sh.u.g.p[i] = prob_of((float)sh.u.g.p[i], mx, inv_t);
  __syncthreads();
  if (tid == 0) {
    const double* p = sh.u.g.p;
    double total = given_total;
    int m = n;
    bool ok = true;
    if (sum_total) {
      total = 0.0;
      for (int i = 0; i < n; ++i) total += p[i];
    }
    if (use_p) {
      const double th = (double)top_p * total;
      double cum = 0.0;
      bool crossed = false;
      m = 0;
      while (m < n) {
        cum += p[m++];
        if (cum >= th) {
          crossed = true;
          break;
        }
      }
      total = cum;
      ok = crossed || !allow_short;
    }
    if (ok) {
      const double target = u * total;
      double cum = 0.0;
      int pick = -1;
      for (int i = 0; i < m && pick < 0; ++i) {
        cum += p[i];
        if (target < cum) pick = i;
      }
      for (int i = m - 1; i >= 0 && pick < 0; --i)
        if (p[i] > 0.0) pick = i;
      sh.b_choice = key_id(sh.u.g.ck[pick < 0 ? 0 : pick]);
    }
    sh.b_status = ok ? 1 : 0;
  }
  __syncthreads();
  return sh.b_status != 0;
}

// No filtering: the inverse CDF in id order. Lane j of a tile (128 ids) owns ids 4j .. 4j+3 and
// sums them in order; an inclusive shuffle scan over the lanes gives the tile's sum; groups of gt
// consecutive tiles are summed tile by tile, then the groups in order. The search recomputes the
// very same sums (group, then tile, then lane, then id), so what it finds is consistent with the
// total; only lanes with p > 0 are ever chosen.
struct Quad {
  double p0, p1, p2, p3, s;  // p of the 4 ids, their running sum ((p0 + p1) + p2) + p3
};
__device__ __forceinline__ Quad quad_probs(float4 v, double mx, double inv_t) {
  Quad q;
  q.p0 = prob_of(v.x, mx, inv_t);
  q.p1 = prob_of(v.y, mx, inv_t);
  q.p2 = prob_of(v.z, mx, inv_t);
  q.p3 = prob_of(v.w, mx, inv_t);
  q.s = ((q.p0 + q.p1) + q.p2) + q.p3;
  return q;
}
__device__ __forceinline__ double lane_scan(double s) {
  const int lane = threadIdx.x & 31;
  for (int o = 1; o < 32; o <<= 1) {
    const double v = __shfl_up_sync(kFull, s, o);
    if (lane >= o) s = v + s;
  }
  return s;
}
constexpr int kTileBatch = 8;

__device__ void sample_unfiltered(SampShared& sh, const float* l, int V, bool vec, double mx, double inv_t,
                                  double u) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int ntiles = (V + 127) / 128, gt = (ntiles + kNfGroups - 1) / kNfGroups, ng = (ntiles + gt - 1) / gt;
  // tile sums of tiles tb .. tb + kTileBatch - 1 below t1 (0 past it)
  auto tile_sums = [&](int tb, int t1, double (&ts)[kTileBatch]) {
    float4 v[kTileBatch];
#pragma unroll
    for (int b = 0; b < kTileBatch; ++b)
      v[b] = tb + b < t1 ? load_quad(l, V, (tb + b) * 32 + lane, vec) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int b = 0; b < kTileBatch; ++b) {
      const double sc = lane_scan(quad_probs(v[b], mx, inv_t).s);
      ts[b] = tb + b < t1 ? __shfl_sync(kFull, sc, 31) : 0.0;
    }
  };
  for (int g = warp; g < ng; g += kSampWarps) {
    const int t1 = min(ntiles, (g + 1) * gt);
    double gs = 0.0;
    for (int tb = g * gt; tb < t1; tb += kTileBatch) {
      double ts[kTileBatch];
      tile_sums(tb, t1, ts);
#pragma unroll
      for (int b = 0; b < kTileBatch; ++b)
        if (tb + b < t1) gs = gs + ts[b];
    }
    if (lane == 0) sh.u.nf.group[g] = gs;
  }
  __syncthreads();
  if (tid == 0) {
    double total = 0.0;
    for (int g = 0; g < ng; ++g) total = total + sh.u.nf.group[g];
    const double target = u * total;
    int gsel = -1;
    double base = 0.0;
    for (int g = 0; g < ng; ++g) {
      const double nb = base + sh.u.nf.group[g];
      if (nb > target) {
        gsel = g;
        break;
      }
      base = nb;
    }
    sh.b_status = 1;
    if (gsel < 0) {  // rounding at the very top: the last id with p > 0
      sh.b_status = 0;
      for (int g = ng - 1; g >= 0 && gsel < 0; --g)
        if (sh.u.nf.group[g] > 0.0) gsel = g;
      if (gsel < 0) gsel = 0;
    }
    sh.b_bin = gsel;
    sh.b_above_m = base;
    sh.b_total = target;
  }
  __syncthreads();
  const int g = sh.b_bin, t0 = g * gt, t1 = min(ntiles, (g + 1) * gt);
  const bool normal = sh.b_status;
  const double base = sh.b_above_m, target = sh.b_total;
  for (int tb = t0 + warp * kTileBatch; tb < t1; tb += kSampWarps * kTileBatch) {  // its tiles, as above
    double ts[kTileBatch];
    tile_sums(tb, t1, ts);
#pragma unroll
    for (int b = 0; b < kTileBatch; ++b)
      if (lane == 0 && tb + b < t1) sh.u.nf.tile[tb + b - t0] = ts[b];
  }
  __syncthreads();
  if (tid == 0) {
    double r = 0.0, rb = 0.0;
    int tsel = -1;
    for (int t = t0; t < t1; ++t) {
      const double ts = sh.u.nf.tile[t - t0], nr = r + ts;
      if (normal ? base + nr > target : ts > 0.0) {
        tsel = t;
        rb = r;
        if (normal) break;
      }
      r = nr;
    }
    sh.b_n = tsel < 0 ? t0 : tsel;
    sh.b_mx = rb;
  }
  __syncthreads();
  if (warp == 0) {
    const int t = sh.b_n;
    const double rb = sh.b_mx;
    const Quad q = quad_probs(load_quad(l, V, t * 32 + lane, vec), mx, inv_t);
    const double sc = lane_scan(q.s);
    double ex = __shfl_up_sync(kFull, sc, 1);
    if (lane == 0) ex = 0.0;
    // the lane's first id with p > 0 whose running mass passes the target; its last with p > 0
    const double c0 = ex + q.p0, c1 = c0 + q.p1, c2 = c1 + q.p2, c3 = c2 + q.p3;
    int first = -1, lastp = -1;
    if (normal) {
      if (q.p3 > 0.0 && base + (rb + c3) > target) first = 3;
      if (q.p2 > 0.0 && base + (rb + c2) > target) first = 2;
      if (q.p1 > 0.0 && base + (rb + c1) > target) first = 1;
      if (q.p0 > 0.0 && base + (rb + c0) > target) first = 0;
    }
    if (q.p0 > 0.0) lastp = 0;
    if (q.p1 > 0.0) lastp = 1;
    if (q.p2 > 0.0) lastp = 2;
    if (q.p3 > 0.0) lastp = 3;
    const unsigned cross = __ballot_sync(kFull, first >= 0);
    const unsigned pos = __ballot_sync(kFull, lastp >= 0);
    if (cross) {
      if (lane == __ffs(cross) - 1) sh.b_choice = min(t * 128 + 4 * lane + first, V - 1);
    } else if (pos) {
      if (lane == 31 - __clz(pos)) sh.b_choice = min(t * 128 + 4 * lane + lastp, V - 1);
    } else if (lane == 0) {
      sh.b_choice = min(t * 128, V - 1);
    }
  }
}

__global__ void __launch_bounds__(kSampThreads) choose_sample_kernel(ChooseParams p) {
  pdl_prologue();
  __shared__ SampShared sh;
  const int row = blockIdx.x, V = p.V, tid = threadIdx.x;
  const float* l = p.logits + (size_t)row * p.ldl;
  const bool vec = ((uintptr_t)l & 15) == 0;
  const double inv_t = 1.0 / (double)p.temperature;
  const double u = sample_uniform(p.seed, (int64_t)p.positions[row] + 1);
  const bool use_k = p.top_k > 0 && p.top_k < V, use_p = p.top_p < 1.0f;
  const long long k = p.top_k;
  if (!use_k && !use_p) {
    float mx;
    unsigned long long mck;
    row_max(sh, l, V, vec, mx, mck);
    if (!isfinite(mx)) {
      if (tid == 0) p.choice[row] = 0;
      return;
    }
    sample_unfiltered(sh, l, V, vec, (double)mx, inv_t, u);
    __syncthreads();
    if (tid == 0) p.choice[row] = sh.b_choice;
    return;
  }
  float mxf = neg_inf();
  unsigned long long mck = 0;
  double total = 0.0;
  bool have_max = false;
  if (!use_k || k <= kSampCap) {  // gather the first candidates, finish with the CPU's loops
    const int n0 = use_k ? (int)k : min(V, kNucleus0);
    unsigned long long lo = 0;
    const int need_r = (2 * n0 + kSampThreads - 1) / kSampThreads;
    if (need_r <= 1) scan_threshold<1>(sh, l, V, vec, min(n0, kSampThreads), mxf, lo, mck);
    else if (need_r <= 2) scan_threshold<2>(sh, l, V, vec, n0, mxf, lo, mck);
    else scan_threshold<4>(sh, l, V, vec, n0, mxf, lo, mck);
    if (V <= kSampCap) lo = 0;
    have_max = true;
    if (!use_k) {  // the nucleus is measured against the whole row's mass
      if (!isfinite(mxf)) {
        if (tid == 0) p.choice[row] = key_id(mck);
        return;
      }
      total = set_mass(sh, l, V, vec, 0ull, (double)mxf, inv_t);
    }
    int n = gather_sorted(sh, l, V, vec, lo);
    if (n > kSampCap) {  // too many above the estimate: an exact threshold
      unsigned long long sck;
      long long scnt;
      double smass;
      radix_select(sh, l, V, vec, kSelCount, n0, 0.0, 0ull, true, 0.0, inv_t, sck, scnt, smass);
      n = gather_sorted(sh, l, V, vec, sck);
    }
    if (n <= kSampCap &&
        finish_gathered(sh, l, n, use_k, k, use_p, p.top_p, (double)mxf, use_k || n == V, total,
                        !use_k && n < V, inv_t, u)) {
      if (tid == 0) p.choice[row] = sh.b_choice;
      return;
    }
  }
  // Exact radix selection: top_k > kSampCap, or a nucleus longer than the gathered candidates.
  unsigned long long sck = 0;
  long long scnt = 0;
  double smass = 0.0;
  int st;
  if (use_k) st = radix_select(sh, l, V, vec, kSelCount, k, 0.0, 0ull, false, 0.0, inv_t, sck, scnt, smass);
  if (!have_max) row_max(sh, l, V, vec, mxf, mck);
  if (!isfinite(mxf)) {
    if (tid == 0) p.choice[row] = key_id(mck);
    return;
  }
  const double mx = (double)mxf;
  unsigned long long c1 = 0;  // the candidates: {ck >= c1}, of mass m1
  double m1;
  if (use_k) {
    c1 = sck;
    m1 = set_mass(sh, l, V, vec, c1, mx, inv_t);
  } else {
    m1 = total;
  }
  if (use_p) {
    st = radix_select(sh, l, V, vec, kSelMassGE, 0, (double)p.top_p * m1, c1, false, mx, inv_t, sck, scnt,
                      smass);
    if (st == kSelExact) {
      c1 = sck;
      m1 = smass;
    }
  }
  st = radix_select(sh, l, V, vec, kSelMassGT, 0, u * m1, c1, false, mx, inv_t, sck, scnt, smass);
  unsigned long long pick = sck;
  if (st != kSelExact) pick = last_positive(sh, l, V, vec, c1, mx, inv_t);
  if (!pick) pick = mck;
  if (tid == 0) p.choice[row] = key_id(pick);
}

template <bool SWI, bool VEC>
void launch_gemv(int U, dim3 grid, const ExpertGemmParams& p, cudaStream_t stream) {
  constexpr int MS = kExpertSkinnyRows, TH = kSkinnyWarps * 32;
  if (U == 4) launch_kernel(expert_gemv_kernel<MS, 4, SWI, VEC>, grid, TH, 0, stream, p);
  else if (U == 2) launch_kernel(expert_gemv_kernel<MS, 2, SWI, VEC>, grid, TH, 0, stream, p);
  else launch_kernel(expert_gemv_kernel<MS, 1, SWI, VEC>, grid, TH, 0, stream, p);
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
  launch_kernel(embed_kernel, p.T, threads_for(p.Dm), 0, stream, p);
  return cudaGetLastError();
}

cudaError_t rmsnorm(const RmsNormParams& p, cudaStream_t stream) {
  if (!p.x || !p.w || !p.y || p.T < 0 || p.D <= 0 || p.ldx < p.D || p.ldy < p.D) return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  const int th = threads_for(p.D), npt = (p.D + th - 1) / th;  // th = 256 when npt > 1
  if (npt == 1) launch_kernel(rmsnorm_reg_kernel<1>, p.T, th, 0, stream, p);
  else if (npt == 2) launch_kernel(rmsnorm_reg_kernel<2>, p.T, th, 0, stream, p);
  else if (npt <= 4) launch_kernel(rmsnorm_reg_kernel<4>, p.T, th, 0, stream, p);
  else if (npt <= 8) launch_kernel(rmsnorm_reg_kernel<8>, p.T, th, 0, stream, p);
  else if (npt <= 16) launch_kernel(rmsnorm_reg_kernel<16>, p.T, th, 0, stream, p);
  else if (npt <= 32) launch_kernel(rmsnorm_reg_kernel<32>, p.T, th, 0, stream, p);
  else launch_kernel(rmsnorm_kernel, p.T, th, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t mla_prep(const MlaPrepParams& p, cudaStream_t stream) {
  if (!p.q || !p.kv || !p.kv_norm_w || !p.inv_freq || !p.positions || !p.cache || !p.q_rope) return cudaErrorInvalidValue;
  if (p.T < 0 || p.H <= 0 || p.C <= 0 || p.R <= 0 || p.R % 2 || p.Dn < 0 || p.ldc < p.C + p.R ||
      p.ldkv < p.C + p.R || p.ldq < p.H * (p.Dn + p.R) || p.row0 < 0)
    return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  launch_kernel(mla_prep_kernel, p.T, threads_for(p.C), p.R * sizeof(float), stream, p);
  return cudaGetLastError();
}

cudaError_t swiglu(const SwigluParams& p, cudaStream_t stream) {
  if (!p.gu || !p.out || p.rows < 0 || p.I <= 0) return cudaErrorInvalidValue;
  const long long n = (long long)p.rows * p.I;
  if (n == 0) return cudaSuccess;
  long long blocks = (n + 255) / 256;
  if (blocks > 4096) blocks = 4096;
  launch_kernel(swiglu_kernel, (int)blocks, 256, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t moe_route(const RouteParams& p, cudaStream_t stream) {
  if (!p.logits || !p.bias || !p.topk_idx || !p.topk_w || p.T < 0 || p.E <= 0 || p.E > 1024 || p.G <= 0 ||
      p.E % p.G || p.E / p.G < 2 || p.topk_group < 1 || p.topk_group > p.G || p.K < 1 ||
      p.K > p.topk_group * (p.E / p.G))
    return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  const int threads = (p.E + 31) / 32 * 32, nc = threads / 32 * (p.K < 32 ? p.K : 32);
  const size_t smem = (size_t)(2 * nc + 2 * p.K + p.E + 2 * p.G) * 4;  // < 48 KiB for E <= 1024
  launch_kernel(moe_route_kernel, p.T, threads, smem, stream, p);
  return cudaGetLastError();
}

cudaError_t moe_group(const MoeGroupParams& p, cudaStream_t stream) {
  if (!p.topk_idx || !p.counts || !p.offsets || !p.slot_token || !p.slot_of || !p.tile_expert || !p.tile_row0 ||
      !p.num_tiles || p.T < 0 || p.K < 1 || p.E < 1 || p.tile_rows < 1)
    return cudaErrorInvalidValue;
  const int A = p.T * p.K;
  if (A <= kGroupSmallMax && p.E <= kGroupSmallMax && !p.force_two_pass) {
    const int n = A > p.E ? A : p.E, threads = (n + 31) / 32 * 32;
    launch_kernel(moe_group_small_kernel, 1, threads < 32 ? 32 : threads, 0, stream, p);
    return cudaGetLastError();
  }
  launch_kernel(moe_count_kernel, p.E, kGroupThreads, 0, stream, p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  launch_kernel(moe_place_kernel, p.E, kGroupThreads, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t expert_gemm(const ExpertGemmParams& p, cudaStream_t stream) {
  if (!p.x || !p.w || !p.offsets || !p.tile_expert || !p.tile_row0 || !p.num_tiles || !p.y || p.N <= 0 ||
      p.Kd <= 0 || p.ldx < p.Kd || p.ldy < p.N || p.max_tiles < 0)
    return cudaErrorInvalidValue;
  if (p.max_tiles == 0) return cudaSuccess;
  const bool vec = p.Kd % 4 == 0 && p.ldx % 4 == 0 && ((uintptr_t)p.x % 16) == 0 && ((uintptr_t)p.w % 16) == 0;
  if (p.tile_rows == kExpertSkinnyRows) {
    const int cols = kSkinnyWarps * (p.swiglu ? kSkinnyRW / 2 : kSkinnyRW);  // output columns per block
    dim3 grid(p.max_tiles, (p.N + cols - 1) / cols);
    if (grid.y > 65535u) return cudaErrorInvalidValue;
    const int steps = (p.Kd + (vec ? 127 : 31)) / (vec ? 128 : 32);  // k-steps of a warp over one row
    const int U = steps >= 4 ? 4 : steps >= 2 ? 2 : 1;
    if (p.swiglu) {
      if (vec) launch_gemv<true, true>(U, grid, p, stream);
      else launch_gemv<true, false>(U, grid, p, stream);
    } else {
      if (vec) launch_gemv<false, true>(U, grid, p, stream);
      else launch_gemv<false, false>(U, grid, p, stream);
    }
    return cudaGetLastError();
  }
  if (p.tile_rows == kExpertTileRows && !p.swiglu) {
    dim3 grid(p.max_tiles, (p.N + TBN - 1) / TBN);
    if (vec) launch_kernel(expert_tiled_kernel<true>, grid, TThreads, 0, stream, p);
    else launch_kernel(expert_tiled_kernel<false>, grid, TThreads, 0, stream, p);
    return cudaGetLastError();
  }
  return cudaErrorInvalidValue;
}

cudaError_t moe_combine(const MoeCombineParams& p, cudaStream_t stream) {
  if (!p.y || !p.topk_idx || !p.topk_w || !p.slot_of || !p.out || p.T < 0 || p.K < 1 || p.K > 64 || p.Dm <= 0)
    return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  const bool vec = p.Dm % 4 == 0 && ((uintptr_t)p.y % 16) == 0 && ((uintptr_t)p.out % 16) == 0 &&
                   ((uintptr_t)p.shared % 16) == 0;
  const int n = vec ? p.Dm / 4 : p.Dm;  // float4s / floats per row, one per thread
  int th = threads_for(n) < kCombineThreads ? threads_for(n) : kCombineThreads;
  if (th < p.K) th = (p.K + 31) / 32 * 32;  // the threads k < K rank the picks (K <= 64)
  dim3 grid(p.T, (n + th - 1) / th);
  if (grid.y > 65535u) return cudaErrorInvalidValue;
  if (vec) launch_kernel(moe_combine_kernel<true>, grid, th, 0, stream, p);
  else launch_kernel(moe_combine_kernel<false>, grid, th, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t cache_compact(const CompactParams& p, cudaStream_t stream) {
  if (!p.cache || !p.keep || !p.count || p.num_layers < 0 || p.row_len <= 0 || p.ld < p.row_len || p.L < 0)
    return cudaErrorInvalidValue;
  if (p.num_layers == 0) return cudaSuccess;
  launch_kernel(cache_compact_kernel, p.num_layers, kCompactThreads, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t causal_bits(uint64_t* bits, int T, int W, cudaStream_t stream) {
  if (!bits || T < 0 || W < (T + 63) / 64) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  launch_kernel(causal_bits_kernel, T, 32, 0, stream, bits, T, W);
  return cudaGetLastError();
}

cudaError_t choose_tokens(const ChooseParams& p, cudaStream_t stream) {
  if (!p.logits || !p.choice || p.T < 0 || p.V <= 0 || p.ldl < p.V || !(p.temperature >= 0.f) ||
      !(p.temperature <= 3.402823466e38f))
    return cudaErrorInvalidValue;
  const bool greedy = p.temperature == 0.f;
  if (!greedy && (!p.positions || p.top_k < 0 || !(p.top_p > 0.f && p.top_p <= 1.f) ||
                  (long long)p.V > (long long)kNfGroups * kSampCap * 128))
    return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  if (greedy) {
    const bool vec = ((uintptr_t)p.logits % 16) == 0 && p.ldl % 4 == 0;
    if (p.T < 64) {  // few rows: more loads in flight per row
      if (vec) launch_kernel(choose_greedy_kernel<1024, true>, p.T, 1024, 0, stream, p);
      else launch_kernel(choose_greedy_kernel<1024, false>, p.T, 1024, 0, stream, p);
    } else {
      if (vec) launch_kernel(choose_greedy_kernel<256, true>, p.T, 256, 0, stream, p);
      else launch_kernel(choose_greedy_kernel<256, false>, p.T, 256, 0, stream, p);
    }
  } else {
    launch_kernel(choose_sample_kernel, p.T, kSampThreads, 0, stream, p);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kdtree
