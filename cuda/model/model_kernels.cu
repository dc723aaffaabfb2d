// model_kernels.cu: the small kernels of the GPU target model (see model_kernels.h). Each one
// mirrors the CPU twin named in its comment (cpp/model/ops.cpp, cpp/model/cpu_model.cpp);
// products and sums that the CPU does one by one are written with __fmul_rn / __fadd_rn so
// that the compiler does not contract them into FMAs (the CPU build has none), which keeps the
// two backends within a few ulps of each other outside the GEMMs.
#include "model/model_kernels.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include "launch.h"
#include "model/vec_load.h"
#include "model/device_math.h"
#include "model/mla_prep_device.h"

namespace kdtree {
namespace cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the total.
template <class V>
__device__ V block_sum(V v, V* red /* [32] shared */) {
  __syncthreads();  // red may still be read by a previous call
  return block_sum_once(v, red);
}

// ---------------------------------------------------------------- embedding
__global__ void embed_kernel(EmbedParams p) {
  pdl_prologue();
  const int t = blockIdx.x;
  if (p.cs) {  // the step's RoPE table (ops.cpp rope_cos_sin)
    const float pos = (float)p.positions[t];
    float* cs = p.cs + (size_t)t * 2 * p.half;
    for (int j = threadIdx.x; j < p.half; j += blockDim.x) {
      const float ang = __fmul_rn(pos, p.inv_freq[j]);
      cs[j] = __fmul_rn((float)cos((double)ang), p.attention_factor);
      cs[p.half + j] = __fmul_rn((float)sin((double)ang), p.attention_factor);
    }
  }
  const int tok = p.tokens[t];
  float* o = p.out + (size_t)t * p.Dm;
  if (tok < 0 || tok >= p.V) {
    for (int i = threadIdx.x; i < p.Dm; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
    return;
  }
  if (p.table_bf16) {  // (a bf16_weights_only model's embedding: held as BF16 alone)
    const uint16_t* src = p.table_bf16 + (size_t)tok * p.Dm;
    for (int i = threadIdx.x; i < p.Dm; i += blockDim.x) o[i] = __uint_as_float((uint32_t)src[i] << 16);
    return;
  }
  const float* src = p.table + (size_t)tok * p.Dm;
  for (int i = threadIdx.x; i < p.Dm; i += blockDim.x) o[i] = src[i];
}

// ---------------------------------------------------------------- RMSNorm (ops.cpp rmsnorm_row)
// (rms_inv, block_sum_once, threads_for: device_math.h)

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
// One block per token, threads_for(C) threads: mla_prep_token (mla_prep_device.h, also run by
// linear_skinny's prep blocks). Latent element i and rope pair u (u < half: the key's pair u; else head
// h = u / half - 1, pair u % half) belong to thread i % blockDim, u % blockDim. Every global input is
// loaded up front (the first kPrepRegs of each kind per thread, with the pairs' cos / sin from the
// step's RoPE table, into registers; longer rows re-read the rest), so the loads overlap each other.
// One barrier for the latent's sum of squares (and one for q_scale_out's).
__global__ void __launch_bounds__(256) mla_prep_kernel(MlaPrepParams p) {
  pdl_prologue();
  __shared__ double red[32], red2[32];
  mla_prep_token<1>(p, blockIdx.x, red, red2);
}

// one thread per output; consecutive threads consecutive k (coalesced w_qa reads, w_qb broadcast)
__global__ void fold_q_kernel(const float* w_qb, const float* g, const float* w_qa, int N, int J, int Kd, float* out) {
  pdl_prologue();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)N * Kd) return;
  const int n = (int)(i / Kd), k = (int)(i - (long long)n * Kd);
  double acc = 0.0;
  for (int j = 0; j < J; ++j) acc += (double)w_qb[(size_t)n * J + j] * (double)g[j] * (double)w_qa[(size_t)j * Kd + k];
  out[i] = (float)acc;
}

// ---------------------------------------------------------------- SwiGLU (ops.cpp swiglu_row)

__global__ void swiglu_kernel(SwigluParams p) {
  pdl_prologue();
  const int rows = p.n_rows ? *p.n_rows : p.rows;
  const size_t n = (size_t)rows * p.I;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const size_t r = i / p.I, c = i - r * p.I;
    const float* g = p.gu + r * (p.ldg > 0 ? (size_t)p.ldg : 2 * (size_t)p.I);
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

// A selectable expert (key not NaN) of in-warp rank rw < KC takes slot rw of its warp's KC candidate
// slots; the warp's unused slots get NaN keys (they compare false). Whole warps call it.
__device__ __forceinline__ void place_candidate(float key, int rw, int KC, int e, float* cand_v, int* cand_i) {
  const int lane = e & 31, base = (e >> 5) * KC;
  const bool cand = key == key && rw < KC;
  const int ncand = __popc(__ballot_sync(kFull, cand));
  if (cand) {  // candidates fill slots [0, ncand) of the warp's KC
    cand_v[base + rw] = key;
    cand_i[base + rw] = e;
  }
  if (lane >= ncand && lane < KC) cand_v[base + lane] = __int_as_float(0x7fffffff);
}
// The rank of expert e (key) among the NC candidates: exact for the top-K (all experts before one
// of them are candidates), >= K for the rest.
__device__ __forceinline__ int candidate_rank(const float* cand_v, const int* cand_i, int NC, float key, int e) {
  int r = 0;
  for (int j = 0; j < NC; ++j) r += rank_before(cand_v[j], cand_i[j], key, e);
  return r;
}
// topk_idx / topk_w of a token's k-th choice from its choices by rank (sel_i, sel_s [K]): the
// weight normalised by their sum in selection order (as the CPU), times the scaling factor.
__device__ __forceinline__ void write_choice(const RouteParams& p, const float* sel_s, const int* sel_i, int t, int k) {
  float sum = 0.f;
  for (int j = 0; j < p.K; ++j) sum = __fadd_rn(sum, sel_s[j]);
  float w = sel_s[k];
  if (p.norm_topk_prob) w = __fdiv_rn(w, __fadd_rn(sum, 1e-20f));
  p.topk_idx[(size_t)t * p.K + k] = sel_i[k];
  p.topk_w[(size_t)t * p.K + k] = __fmul_rn(w, p.routed_scaling_factor);
}

// The routing of token t by one block of >= E threads (threads past E take part in the barriers
// and scans only); sm: the dynamic shared memory sized by moe_route.
__device__ void route_token(const RouteParams& p, int t, float* sm) {
  const int E = p.E, G = p.G, K = p.K, per = E / G;
  const int nw = blockDim.x >> 5, KC = K < 32 ? K : 32, NC = nw * KC;
  float* cand_v = sm;                                             // [NC] candidate keys (NaN = empty)
  int* cand_i = reinterpret_cast<int*>(cand_v + NC);             // [NC] candidate experts
  float* sel_s = reinterpret_cast<float*>(cand_i + NC);          // [K] s of the chosen, by rank
  int* sel_i = reinterpret_cast<int*>(sel_s + K);                // [K] chosen experts, by rank
  float* bsh = reinterpret_cast<float*>(sel_i + K);              // [E]  b (group path only)
  float* gs = bsh + E;                                            // [G]  group scores
  int* gsel = reinterpret_cast<int*>(gs + G);                     // [G]  group kept
  const int e = threadIdx.x, lane = e & 31;
  const float nanv = __int_as_float(0x7fffffff);
  float sv = 0.f, key = nanv;  // key: the selection value b (NaN: not an expert / not selectable)
  if (e < E) {
    sv = 1.f / (1.f + expf(-p.logits[(size_t)t * (p.ldl > 0 ? p.ldl : E) + e]));
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
  place_candidate(key, rw, KC, e, cand_v, cand_i);
  __syncthreads();
  // 2. rank among all candidates
  if (cand) {
    const int r = candidate_rank(cand_v, cand_i, NC, key, e);
    if (r < K) {
      sel_i[r] = e;
      sel_s[r] = sv;
    }
  }
  __syncthreads();
  for (int k = e; k < K; k += blockDim.x) write_choice(p, sel_s, sel_i, t, k);
}

__global__ void __launch_bounds__(1024) moe_route_kernel(RouteParams p) {
  pdl_prologue();
  extern __shared__ float sm[];
  route_token(p, blockIdx.x, sm);
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

// The whole schedule in one block of >= max(A, E) threads (A, E <= kGroupSmallMax), in shared
// arrays idx / off [kGroupSmallMax] and wsum [32] of the caller. With tab (nw * E ints, nw = the
// block's warps): thread i takes assignment i; __match_any_sync gives its rank among the warp's
// assignments to the same expert, the lowest such lane writes the warp's count to tab[warp][e],
// and thread e turns its column into the exclusive prefix over the warps (its count at the end):
// O(nw) steps per thread. Without tab, the two O(A) loops (thread e counts expert e over all
// assignments, thread i counts the earlier assignments to its expert). The same schedule either
// way: slots by expert, then by assignment index; an id outside [0, E) gets no slot.
constexpr int kGroupTable = 8192;  // ints of the per-warp count table (32 KB)

__device__ void group_small(const MoeGroupParams& p, int* idx, int* off, int* wsum, int* tab) {
  const int tid = threadIdx.x, A = p.T * p.K, E = p.E, TR = p.tile_rows;
  const int lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  int c = 0, e = -1, rank = 0;
  if (tab) {
    for (int i = tid; i < nw * E; i += blockDim.x) tab[i] = 0;
    if (tid < A) {
      e = p.topk_idx[tid];
      if (e < 0 || e >= E) e = -1;
    }
    const unsigned same = __match_any_sync(kFull, e);
    rank = __popc(same & ((1u << lane) - 1u));
    __syncthreads();  // tab zeroed
    if (e >= 0 && rank == 0) tab[warp * E + e] = __popc(same);
    __syncthreads();
    if (tid < E) {
      for (int w = 0; w < nw; ++w) {
        const int v = tab[w * E + tid];
        tab[w * E + tid] = c;
        c += v;
      }
      p.counts[tid] = c;
    }
  } else {
    if (tid < A) idx[tid] = p.topk_idx[tid];
    __syncthreads();
    if (tid < E) {
      for (int i = 0; i < A; ++i) c += idx[i] == tid;
      p.counts[tid] = c;
    }
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
  if (tab) {
    if (e >= 0) {
      const int slot = off[e] + tab[warp * E + e] + rank;
      p.slot_token[slot] = tid / p.K;
      p.slot_of[tid] = slot;
    }
  } else if (tid < A) {
    e = idx[tid];
    if (e >= 0 && e < E) {
      int r = 0;
      for (int j = 0; j < tid; ++j) r += idx[j] == e;
      const int slot = off[e] + r;
      p.slot_token[slot] = tid / p.K;
      p.slot_of[tid] = slot;
    }
  }
}

__global__ void __launch_bounds__(kGroupSmallMax) moe_group_small_kernel(MoeGroupParams p) {
  pdl_prologue();
  __shared__ int idx[kGroupSmallMax], off[kGroupSmallMax], wsum[32], tab[kGroupTable];
  const bool table = (int)(blockDim.x >> 5) * p.E <= kGroupTable;
  group_small(p, idx, off, wsum, table ? tab : nullptr);
}

// Decode and tiny trees: the routing of the few tokens and the schedule in one block (one launch
// instead of two); the block's global writes of topk_idx are visible to it after the barrier.
__global__ void __launch_bounds__(kGroupSmallMax) moe_route_group_kernel(RouteParams rp, MoeGroupParams gp) {
  pdl_prologue();
  extern __shared__ float sm[];
  for (int t = 0; t < rp.T; ++t) {
    route_token(rp, t, sm);
    __syncthreads();  // the shared candidates are reused by the next token; topk_idx complete
  }
  __shared__ int idx[kGroupSmallMax], off[kGroupSmallMax], wsum[32];
  group_small(gp, idx, off, wsum, nullptr);
}

// The same outputs for the common decode case in two block barriers instead of about ten: T <=
// kRouteGroupMaxT tokens, no group masking (topk_group == G: mini-kimi, Kimi-K2), K <= 32. Thread
// e (one per expert, blockDim = max(E, A) rounded up to a warp) routes expert e for every token at
// once (in-warp rank by shuffles, then the rank among the warps' candidates, as route_token) and
// so knows which tokens chose it (tmask); the schedule follows without a scan: expert e's slots
// start after every assignment to a lower expert, its tiles after the tiles of the lower chosen
// experts (each counted once, at its first token), and its slot for token t after the earlier
// tokens that chose it (a token chooses an expert at most once). The router bias load is written
// before the PDL wait, but the compiler issues it after the wait, beside the logits' load (one round
// trip either way; the SASS, forty-first session), so it carries no marker. moe_route_group_fast_ok
// says when it applies.
constexpr int kFastRouteMaxK = 32;

template <int T>
__global__ void __launch_bounds__(kGroupSmallMax) moe_route_group_fast_kernel(RouteParams rp, MoeGroupParams gp) {
  pdl_trigger();
  extern __shared__ float sm[];
  const int E = rp.E, K = rp.K, A = T * K, TR = gp.tile_rows;
  const int e = threadIdx.x, lane = e & 31, nw = blockDim.x >> 5, NC = nw * K;
  float* cand_v = sm;                                          // [T][NC] candidate keys (NaN = empty)
  int* cand_i = reinterpret_cast<int*>(cand_v + T * NC);      // [T][NC] candidate experts
  float* sel_s = reinterpret_cast<float*>(cand_i + T * NC);   // [T][K] s of the chosen, by rank
  int* sel_i = reinterpret_cast<int*>(sel_s + T * K);         // [T][K] chosen experts, by rank
  int* ent_nt = sel_i + T * K;                                // [T][K] tiles of the entry's expert at its
                                                              // first token's entry, else 0
  const float nanv = __int_as_float(0x7fffffff);
  const float bias = e < E ? __ldg(rp.bias + e) : 0.f;
  pdl_wait();
  const int ldl = rp.ldl > 0 ? rp.ldl : E;
  float sv[T], key[T];
#pragma unroll
  for (int t = 0; t < T; ++t) {
    sv[t] = 0.f;
    key[t] = nanv;
    if (e < E) sv[t] = rp.logits[(size_t)t * ldl + e];
  }
#pragma unroll
  for (int t = 0; t < T; ++t) {
    if (e < E) {
      sv[t] = 1.f / (1.f + expf(-sv[t]));
      key[t] = nan_to_neg_inf(__fadd_rn(sv[t], bias));
    }
  }
  // 1. in-warp ranks; the candidates (in-warp rank < K) go to fixed slots of their warp
  int rw[T];
#pragma unroll
  for (int t = 0; t < T; ++t) rw[t] = 0;
#pragma unroll 8
  for (int j = 0; j < 32; ++j) {
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float v = __shfl_sync(kFull, key[t], j);
      rw[t] += rank_before(v, j, key[t], lane);
    }
  }
#pragma unroll
  for (int t = 0; t < T; ++t) place_candidate(key[t], rw[t], K, e, cand_v + t * NC, cand_i + t * NC);
  __syncthreads();
  // 2. rank among all candidates: exact for the top-K
  int tmask = 0, rk[T];
#pragma unroll
  for (int t = 0; t < T; ++t) {
    rk[t] = K;
    if (key[t] == key[t] && rw[t] < K) {
      const int r = candidate_rank(cand_v + t * NC, cand_i + t * NC, NC, key[t], e);
      rk[t] = r;
      if (r < K) {
        sel_i[t * K + r] = e;
        sel_s[t * K + r] = sv[t];
        tmask |= 1 << t;
      }
    }
  }
  const int c = __popc(tmask), first_t = __ffs(tmask) - 1;
#pragma unroll
  for (int t = 0; t < T; ++t)
    if (rk[t] < K) ent_nt[t * K + rk[t]] = t == first_t ? (c + TR - 1) / TR : 0;
  __syncthreads();
  // weights, in selection order as the CPU
  if (e < A) write_choice(rp, sel_s + (e / K) * K, sel_i + (e / K) * K, e / K, e % K);
  // the schedule: assignments and tiles of the lower experts (each chosen expert's tiles counted
  // at its first token's entry)
  if (e < E) {  // thread 0 is one of them (E >= 1)
    int below = 0, tiles_below = 0, tiles_all = 0;
#pragma unroll 8
    for (int j = 0; j < A; ++j) {
      const int x = sel_i[j], nt = ent_nt[j];
      below += x < e;
      tiles_below += x < e ? nt : 0;
      tiles_all += nt;
    }
    if (e == 0) {
      gp.offsets[0] = 0;
      *gp.num_tiles = tiles_all;
    }
    gp.counts[e] = c;
    gp.offsets[e + 1] = below + c;
    for (int j = 0; j * TR < c; ++j) {
      gp.tile_expert[tiles_below + j] = e;
      gp.tile_row0[tiles_below + j] = below + j * TR;
    }
    int before = 0;  // earlier tokens that chose e
#pragma unroll
    for (int t = 0; t < T; ++t) {
      if (rk[t] >= K) continue;
      const int slot = below + before++;
      gp.slot_token[slot] = t;
      gp.slot_of[t * K + rk[t]] = slot;
    }
  }
}

// acc + the weights' products with x (one float, or four summed first): the GEMV kernels' step
__device__ __forceinline__ float wdot(float w, float x, float acc) { return acc + w * x; }
__device__ __forceinline__ float wdot(const float4& g4, const float4& x4, float acc) {
  return acc + (g4.x * x4.x + g4.y * x4.y + g4.z * x4.z + g4.w * x4.w);
}

// ---------------------------------------------------------------- attention combine + W_UV
// Block (h, y): head h, value rows v0 = 16 y + 2 w (+1) of warp w. The weights (16 floats of each
// row per lane) are loaded before the PDL wait, the first batch of split partials (up to 32
// splits of token 0) right after it, beside warp t < T turning token t's split maxima and sums
// into weights w_s = 2^(m_s - max) (0 for a split that saw no key) and w_s * l_s. Thread i then
// merges columns 2i, 2i + 1 of each token's o_lat row over the splits in split order exactly as
// mla_verify_combine_kernel does (den += w l; acc = fma(w, o, acc) where w != 0; acc * (1 / den)),
// into shared memory, and each warp takes its two rows' dot products with the merged rows
// (lane-strided float4 columns, a butterfly sum).
constexpr int kUvThreads = 256, kUvRows = 16, kUvBatch = 32;

template <bool BF>
__global__ void __launch_bounds__(kUvThreads) uv_combine_kernel(UvCombineParams p) {
  pdl_trigger();
  __shared__ float sw[kUvMaxT][kUvMaxS], swl[kUvMaxT][kUvMaxS];
  __shared__ __align__(16) float xs[kUvMaxT][512];
  const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int C = 512, Dv = p.Dv, T = p.T, S = p.S, H = p.H, M = T * H;
  const int v0 = blockIdx.y * kUvRows + 2 * warp;
  float4 w[2][4];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const size_t o = ((size_t)h * Dv + v0 + r) * C + 4 * lane + 128 * i;
      if constexpr (BF) w[r][i] = ldg_bf16x4(p.w_uv_bf16 + o);  // pdl: pre-wait (weights)
      else w[r][i] = ldg_vec<float4>(p.w_uv + o);               // pdl: pre-wait (weights)
    }
  // Keep those loads above the wait: ptxas sank them below it, next to their use after the merge (the
  // machine code of the forty-first session had every W_UV load after the ACQBULK, so the weights'
  // DRAM round trip sat on the step's critical path after the attention). A volatile shared store of
  // bits of every loaded value needs them all first; it is never read.
  {
    unsigned any = 0u;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        any |= __float_as_uint(w[r][i].x) ^ __float_as_uint(w[r][i].y) ^ __float_as_uint(w[r][i].z) ^
               __float_as_uint(w[r][i].w);
    __shared__ unsigned pin[kUvThreads];
    reinterpret_cast<volatile unsigned*>(pin)[tid] = any;
  }
  pdl_wait();
  const float* wso = p.partials;
  const float* wsml = wso + (size_t)S * M * C;
  float2 o[kUvBatch];
  auto load_batch = [&](int t, int s0) {  // splits s0 .. s0 + kUvBatch - 1 of token t, all in flight
    const float* src = wso + (size_t)(t * H + h) * C + 2 * tid;
#pragma unroll
    for (int j = 0; j < kUvBatch; ++j)
      o[j] = s0 + j < S ? *reinterpret_cast<const float2*>(src + (size_t)(s0 + j) * M * C) : make_float2(0.f, 0.f);
  };
  load_batch(0, 0);
  if (warp < T) {
    const int g = warp * H + h;
    float mv[kUvMaxS / 32], lv[kUvMaxS / 32];
    float mx = neg_inf();
#pragma unroll
    for (int j = 0; j < kUvMaxS / 32; ++j) {
      const int sp = lane + 32 * j;
      mv[j] = sp < S ? wsml[((size_t)sp * M + g) * 2] : neg_inf();
      lv[j] = sp < S ? wsml[((size_t)sp * M + g) * 2 + 1] : 0.f;
      mx = fmaxf(mx, mv[j]);
    }
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, off));
#pragma unroll
    for (int j = 0; j < kUvMaxS / 32; ++j) {
      const int sp = lane + 32 * j;
      if (sp < S) {
        const float ws = mv[j] == neg_inf() ? 0.f : exp2f(mv[j] - mx);
        sw[warp][sp] = ws;
        swl[warp][sp] = ws * lv[j];
      }
    }
  }
  __syncthreads();
  for (int t = 0; t < T; ++t) {
    float den = 0.f, a0 = 0.f, a1 = 0.f;
    for (int s0 = 0; s0 < S; s0 += kUvBatch) {
      if (t > 0 || s0 > 0) load_batch(t, s0);
#pragma unroll
      for (int j = 0; j < kUvBatch; ++j) {
        if (s0 + j < S) {
          const float ws = sw[t][s0 + j];
          den += swl[t][s0 + j];
          if (ws != 0.f) {
            a0 = fmaf(ws, o[j].x, a0);
            a1 = fmaf(ws, o[j].y, a1);
          }
        }
      }
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    xs[t][2 * tid] = a0 * inv;
    xs[t][2 * tid + 1] = a1 * inv;
  }
  __syncthreads();
  for (int t = 0; t < T; ++t) {
    float acc[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 x = *reinterpret_cast<const float4*>(&xs[t][4 * lane + 128 * i]);
#pragma unroll
      for (int r = 0; r < 2; ++r) acc[r] = wdot(w[r][i], x, acc[r]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float a = acc[r];
      for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(kFull, a, off);
      if (lane == 0) p.out[(size_t)t * H * Dv + (size_t)h * Dv + v0 + r] = a;
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

// The GEMV kernels' shared pieces (expert_gemv_kernel, expert_gemv_int4_kernel). A warp's weight rows: gate
// rows nb.., then (SwiGLU) up rows N + nb..; rows >= N clamped, unused (offsets into expert e's stack).
template <int RW, int CPW, bool SWI>
__device__ __forceinline__ void gemv_weight_rows(size_t (&wrow)[RW], int e, int N, int Kd, int nb, int ncol) {
  const size_t wbase = (size_t)e * (SWI ? 2 : 1) * N * Kd;
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    const int c = min(SWI ? i % CPW : i, ncol - 1);
    wrow[i] = wbase + (size_t)((SWI && i >= CPW ? N : 0) + nb + c) * Kd;
  }
}
// The tile's slots: slot r0 always belongs to the tile, so its x row is looked up at once; the others (rows >
// 1) in the first iteration, after the weight loads are issued (gemv_slot_rows). Returns the tile's slot
// count; the sums start at zero.
template <int MS, int RW>
__device__ __forceinline__ int gemv_tile_slots(int (&src)[MS], float (&acc)[RW][MS], const ExpertGemmParams& p, int e,
                                               int r0) {
  src[0] = p.x_row ? __ldg(p.x_row + r0) : r0;
#pragma unroll
  for (int r = 1; r < MS; ++r) src[r] = src[0];
  const int rows = min(MS, __ldg(p.offsets + e + 1) - r0);
#pragma unroll
  for (int i = 0; i < RW; ++i)
#pragma unroll
    for (int r = 0; r < MS; ++r) acc[i][r] = 0.f;
  return rows;
}
// The x row of each slot past the first (rows > 1; looked up after the weight loads are issued; clamped to
// the tile's last slot, unused past rows).
template <int MS>
__device__ __forceinline__ void gemv_slot_rows(int (&src)[MS], const ExpertGemmParams& p, int r0, int rows) {
#pragma unroll
  for (int r = 1; r < MS; ++r) {
    const int s = r0 + min(r, rows - 1);
    src[r] = p.x_row ? __ldg(p.x_row + s) : s;
  }
}
// Per output a butterfly over the warp, then lane 0 stores (SwiGLU: silu(gate) * up).
template <int MS, int RW, int CPW, bool SWI>
__device__ __forceinline__ void gemv_store(const float (&acc)[RW][MS], const ExpertGemmParams& p, int lane, int nb,
                                           int ncol, int r0, int rows) {
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

// BF (with VEC): the weights from w_bf16 (exact BF16 copies), widened as loaded: the same results.
// (INT4 weights: expert_gemv_int4_kernel below.)
template <int MS, int U, bool SWI, bool VEC, bool BF = false>
__global__ void __launch_bounds__(kSkinnyWarps * 32, 3) expert_gemv_kernel(ExpertGemmParams p) {
  static_assert(!BF || VEC, "BF16 weights on the vector path only");
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
  size_t wrow[RW];
  gemv_weight_rows<RW, CPW, SWI>(wrow, e, N, Kd, nb, ncol);
  const int nsteps = (Kd + 32 * VW - 1) / (32 * VW);
  WT wv[U][RW];
  auto load_w = [&](int s0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = ((s0 + u) * 32 + lane) * VW;
#pragma unroll
      for (int i = 0; i < RW; ++i) {
        const int c = SWI ? i % CPW : i;
        if (k < Kd && c < ncol) {
          if constexpr (BF) wv[u][i] = ldg_bf16x4(p.w_bf16 + wrow[i] + k);
          else wv[u][i] = ldg_vec<WT>(p.w + wrow[i] + k);
        } else {
          vzero(wv[u][i]);
        }
      }
    }
  };
  load_w(0);  // in flight while the tile's rows are looked up

  int src[MS];
  float acc[RW][MS];
  const int rows = gemv_tile_slots<MS, RW>(src, acc, p, e, r0);

  for (int s0 = 0;;) {
    if (s0 == 0 && rows > 1) gemv_slot_rows<MS>(src, p, r0, rows);
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
  gemv_store<MS, RW, CPW, SWI>(acc, p, lane, nb, ncol, r0, rows);
}

// ---------------------------------------------------------------- grouped expert GEMV, INT4 weights
// The GEMV-style kernel for INT4 experts (ExpertGemmParams::w_int4), fifty-sixth session. Lane l of a warp
// covers QW consecutive k per step, k = (32 s + l) QW + j (j < QW): one 4-byte (QW = 8) or 8-byte (QW = 16)
// load of its nibbles a row and step (a warp reads 128 / 256 contiguous bytes) and one scale for QW weights.
// expert_gemv_kernel's float4 mapping (k = 4 (32 s + l) + j, which its FP32 and BF16 paths share so that
// they give the same bits) gave each lane two bytes a row and step and a scale load for four weights: four
// times the load instructions for the same bytes, each weight widened alone (int4_value, ~6 instructions;
// int4x8_values takes ~3 when the scales are BF16 values, the BS instances), and that per slot. Here a
// step's rows are dequantized once (wv) before the tile's slots use them, and a warp owns kInt4RW = 2 rows
// (one SwiGLU column): twice the warps of the FP32 kernel's four rows, for a kernel that is more
// instruction- than byte-bound. Measured (H100, bench_cuda_int4.py, mini-kimi AR): 0.80x -> 1.06x the
// BF16 model's tokens/s (docs/BENCHMARKS.md "INT4 GEMV"). The weights are the same values; the sums run
// in this mapping's order (per output a lane adds its float4 groups in ascending k, as wdot does, then the
// same butterfly), so the results are within FP32 rounding of expert_gemv_kernel's on the dequantized BF16
// weights, not the same bits (the tensor-core kernel's INT4 path does give those bits).
constexpr int kInt4RW = 2;  // weight rows per warp (one SwiGLU column; four measured 2 % slower AR, H100)
template <int MS, int U, bool SWI, int QW, bool BS>
__global__ void __launch_bounds__(kSkinnyWarps * 32, 3) expert_gemv_int4_kernel(ExpertGemmParams p) {
  static_assert(QW == 8 || QW == 16, "a lane's nibbles: one 4- or 8-byte load");
  pdl_prologue();
  constexpr int RW = kInt4RW, CPW = SWI ? RW / 2 : RW;  // weight rows, output columns per warp
  constexpr int NWD = QW / 8;                           // nibble words per lane, row and step
  const int tile = blockIdx.x;
  const int nt = __ldg(p.num_tiles), e = __ldg(p.tile_expert + tile), r0 = __ldg(p.tile_row0 + tile);
  if (tile >= nt || e < 0 || r0 < 0) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int Kd = p.Kd, N = p.N;
  const int nb = (blockIdx.y * kSkinnyWarps + warp) * CPW;
  if (nb >= N) return;  // no block barrier below
  const int ncol = min(CPW, N - nb);
  size_t wrow[RW];
  gemv_weight_rows<RW, CPW, SWI>(wrow, e, N, Kd, nb, ncol);
  const int nsteps = (Kd + 32 * QW - 1) / (32 * QW);
  const int gshift = __ffs(p.int4_group) - 1;  // a power of two >= 32 >= QW: a lane's QW weights share a scale
  uint32_t wq[U][RW][NWD];
  float ws[U][RW];
  auto load_w = [&](int s0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = ((s0 + u) * 32 + lane) * QW;
#pragma unroll
      for (int i = 0; i < RW; ++i) {
        const int c = SWI ? i % CPW : i;
        if (k < Kd && c < ncol) {  // (Kd % 32 == 0: a lane's QW weights are all in range or all out)
          const size_t o = wrow[i] + k;
          const uint8_t* q = p.w_int4 + o / 2;
          if constexpr (QW == 16) {
            asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(wq[u][i][0]), "=r"(wq[u][i][1]) : "l"(q));
          } else {
            asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(wq[u][i][0]) : "l"(q));
          }
          ws[u][i] = __ldg(p.w_scale + (o >> gshift));
        } else {
#pragma unroll
          for (int j = 0; j < NWD; ++j) wq[u][i][j] = 0u;
          ws[u][i] = 0.f;
        }
      }
    }
  };
  load_w(0);

  int src[MS];
  float acc[RW][MS];
  const int rows = gemv_tile_slots<MS, RW>(src, acc, p, e, r0);

  for (int s0 = 0;;) {
    if (s0 == 0 && rows > 1) gemv_slot_rows<MS>(src, p, r0, rows);
    // per step: the warp's rows dequantized once (64 floats at QW = 16), then every slot's products
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = ((s0 + u) * 32 + lane) * QW;
      if (k < Kd) {
        float wv[RW][QW];
#pragma unroll
        for (int i = 0; i < RW; ++i)
#pragma unroll
          for (int j = 0; j < NWD; ++j) {
            float v8[8];
            if constexpr (BS) {
              int4x8_values(wq[u][i][j], ws[u][i], v8);
            } else {
#pragma unroll
              for (int t = 0; t < 8; ++t) v8[t] = int4_value((wq[u][i][j] >> (4 * t)) & 15u, ws[u][i]);
            }
#pragma unroll
            for (int t = 0; t < 8; ++t) wv[i][8 * j + t] = v8[t];
          }
#pragma unroll
        for (int r = 0; r < MS; ++r) {
          if (r < rows) {
            const float* xr = p.x + (size_t)src[r] * p.ldx + k;
            float4 xv[QW / 4];
#pragma unroll
            for (int q4 = 0; q4 < QW / 4; ++q4) xv[q4] = ldg_vec<float4>(xr + 4 * q4);
#pragma unroll
            for (int i = 0; i < RW; ++i)
#pragma unroll
              for (int q4 = 0; q4 < QW / 4; ++q4)
                acc[i][r] = wdot(make_float4(wv[i][4 * q4], wv[i][4 * q4 + 1], wv[i][4 * q4 + 2], wv[i][4 * q4 + 3]),
                                 xv[q4], acc[i][r]);
          }
        }
      }
    }
    s0 += U;
    if (s0 >= nsteps) break;
    load_w(s0);
  }
  gemv_store<MS, RW, CPW, SWI>(acc, p, lane, nb, ncol, r0, rows);
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

// A token's K picks in the order the combine adds them (a stable sort by expert index): load() by
// threads k < K (its expert, slot and weight; the expert index staged in shared memory), then, after a
// block barrier, rank() puts slot and weight at the pick's position in that order (sslot / sw).
struct CombinePicks {
  int idx = 0, slot = 0;
  float w = 0.f;
  __device__ __forceinline__ void load(const MoeCombineParams& p, int t, int k, int* sidx) {
    if (k < p.K) {
      const int a = t * p.K + k;
      idx = p.topk_idx[a];
      slot = p.slot_of[a];
      w = p.topk_w[a];
      sidx[k] = idx;
    }
  }
  __device__ __forceinline__ void rank(int K, int k, const int* sidx, int* sslot, float* sw) const {
    if (k < K) {
      int r = 0;
      for (int j = 0; j < K; ++j) {
        const int v = sidx[j];
        r += (v < idx || (v == idx && j < k)) ? 1 : 0;
      }
      sslot[r] = slot;
      sw[r] = w;
    }
  }
};

template <bool VEC>
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(MoeCombineParams p) {
  pdl_prologue();
  using VT = typename std::conditional<VEC, float4, float>::type;
  constexpr int VW = VEC ? 4 : 1;
  __shared__ int sidx[64], sslot[64];
  __shared__ float sw[64];
  const int t = blockIdx.x, K = p.K, Dm = p.Dm, tid = threadIdx.x;
  CombinePicks pk;
  pk.load(p, t, tid, sidx);
  const int i = (blockIdx.y * blockDim.x + tid) * VW;
  const bool active = i < Dm;
  const size_t o = (size_t)t * Dm + i;
  VT prev, sh;
  vzero(prev);
  vzero(sh);
  if (active && p.accumulate) prev = *reinterpret_cast<const VT*>(p.out + o);
  if (active && p.shared) sh = ldg_vec<VT>(p.shared + o);
  __syncthreads();
  pk.rank(K, tid, sidx, sslot, sw);
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

// MoE combine + the RMSNorm that follows it (MoeCombineParams::norm_w): the next layer's input norm
// or the final one, which was its own kernel after the combine. One block per token row; thread i
// owns the NV float4s (VEC; else floats) i + j * blockDim of the row, so the whole row is in
// registers when its sum of squares is formed (in double, in the thread's element order, then
// block_sum_once as rmsnorm_reg_kernel). The combine's per-element operations are
// moe_combine_kernel's (the same x bits); the norm's summation order is another than rmsnorm's
// (per thread, consecutive elements), which can change the double sum's last bits but, in every
// case tested, not the float 1 / rms taken from it (tests/python/test_cuda_model.py).
template <bool VEC, int NV>
__global__ void __launch_bounds__(256) moe_combine_norm_kernel(MoeCombineParams p) {
  pdl_trigger();
  using VT = typename std::conditional<VEC, float4, float>::type;
  constexpr int VW = VEC ? 4 : 1;
  __shared__ int sidx[64], sslot[64];
  __shared__ float sw[64];
  __shared__ double red[32];
  const int t = blockIdx.x, K = p.K, Dm = p.Dm, tid = threadIdx.x, bd = blockDim.x;
  pdl_wait();  // (the norm weights are loaded below, beside the row: ptxas sank a load placed before the wait)
  CombinePicks pk;
  pk.load(p, t, tid, sidx);
  const size_t row = (size_t)t * Dm;
  VT prev[NV], sh[NV], nw[NV];
  float acc[NV][VW];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int i = (tid + j * bd) * VW;
    vzero(prev[j]);
    vzero(sh[j]);
    vzero(nw[j]);
    if (i < Dm) nw[j] = ldg_vec<VT>(p.norm_w + i);
    if (i < Dm && p.accumulate) prev[j] = *reinterpret_cast<const VT*>(p.out + row + i);
    if (i < Dm && p.shared) sh[j] = ldg_vec<VT>(p.shared + row + i);
#pragma unroll
    for (int c = 0; c < VW; ++c) acc[j][c] = 0.f;
  }
  __syncthreads();
  pk.rank(K, tid, sidx, sslot, sw);
  __syncthreads();
  for (int j0 = 0; j0 < K; j0 += 8) {  // 8 expert rows in flight
    VT v[8][NV];
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const float* yr = p.y + (size_t)sslot[j0 + jj < K ? j0 + jj : 0] * Dm;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int i = (tid + j * bd) * VW;
        vzero(v[jj][j]);
        if (j0 + jj < K && i < Dm) v[jj][j] = ldg_vec<VT>(yr + i);
      }
    }
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      if (j0 + jj < K) {
        const float w = sw[j0 + jj];
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          const float* vv = reinterpret_cast<const float*>(&v[jj][j]);
#pragma unroll
          for (int c = 0; c < VW; ++c) acc[j][c] = __fadd_rn(acc[j][c], __fmul_rn(vv[c], w));
        }
      }
    }
  }
  VT xv[NV];
  double ss = 0.0;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int i = (tid + j * bd) * VW;
    const float* shv = reinterpret_cast<const float*>(&sh[j]);
    const float* pv = reinterpret_cast<const float*>(&prev[j]);
    float* xr = reinterpret_cast<float*>(&xv[j]);
#pragma unroll
    for (int c = 0; c < VW; ++c) {
      float a = acc[j][c];
      if (p.shared) a = __fadd_rn(a, shv[c]);
      xr[c] = p.accumulate ? __fadd_rn(pv[c], a) : a;
    }
    if (i < Dm) {
      *reinterpret_cast<VT*>(p.out + row + i) = xv[j];
#pragma unroll
      for (int c = 0; c < VW; ++c) ss += (double)xr[c] * (double)xr[c];
    }
  }
  ss = block_sum_once(ss, red);
  const float inv = rms_inv(ss, Dm, p.norm_eps);
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int i = (tid + j * bd) * VW;
    if (i >= Dm) continue;
    const float* xr = reinterpret_cast<const float*>(&xv[j]);
    const float* wr = reinterpret_cast<const float*>(&nw[j]);
    VT y;
    float* yv = reinterpret_cast<float*>(&y);
#pragma unroll
    for (int c = 0; c < VW; ++c) yv[c] = __fmul_rn(wr[c], __fmul_rn(xr[c], inv));
    *reinterpret_cast<VT*>(p.norm_out + row + i) = y;
  }
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

__global__ void f32_to_bf16_high_kernel(const float* src, uint16_t* dst, long long n) {
  pdl_prologue();
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = (uint16_t)(__float_as_uint(src[i]) >> 16);
}

__global__ void bf16_to_f32_kernel(const uint16_t* src, float* dst, long long n) {
  pdl_prologue();
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = __uint_as_float((uint32_t)src[i] << 16);
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

template <bool SWI, bool VEC, bool BF = false>
void launch_gemv(int U, dim3 grid, const ExpertGemmParams& p, cudaStream_t stream) {
  constexpr int MS = kExpertSkinnyRows, TH = kSkinnyWarps * 32;
  if (U == 4) launch_kernel(expert_gemv_kernel<MS, 4, SWI, VEC, BF>, grid, TH, 0, stream, p);
  else if (U == 2) launch_kernel(expert_gemv_kernel<MS, 2, SWI, VEC, BF>, grid, TH, 0, stream, p);
  else launch_kernel(expert_gemv_kernel<MS, 1, SWI, VEC, BF>, grid, TH, 0, stream, p);
}

template <bool SWI, int QW, bool BS>
void launch_gemv_int4_as(int U, dim3 grid, const ExpertGemmParams& p, cudaStream_t stream) {
  constexpr int MS = kExpertSkinnyRows, TH = kSkinnyWarps * 32;
  if (U == 4) launch_kernel(expert_gemv_int4_kernel<MS, 4, SWI, QW, BS>, grid, TH, 0, stream, p);
  else if (U == 2) launch_kernel(expert_gemv_int4_kernel<MS, 2, SWI, QW, BS>, grid, TH, 0, stream, p);
  else launch_kernel(expert_gemv_int4_kernel<MS, 1, SWI, QW, BS>, grid, TH, 0, stream, p);
}
template <bool SWI, int QW>
void launch_gemv_int4(int U, dim3 grid, const ExpertGemmParams& p, cudaStream_t stream) {
  if (p.int4_scales_bf16) launch_gemv_int4_as<SWI, QW, true>(U, grid, p, stream);
  else launch_gemv_int4_as<SWI, QW, false>(U, grid, p, stream);
}

}  // namespace

// ---------------------------------------------------------------- launchers
cudaError_t embed(const EmbedParams& p, cudaStream_t stream) {
  if (!p.tokens || !p.table || !p.out || p.T < 0 || p.V <= 0 || p.Dm <= 0) return cudaErrorInvalidValue;
  if (p.cs && (!p.positions || !p.inv_freq || p.half <= 0)) return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  // the step's first kernel: ordered (no PDL) so that the committed cache is complete for every
  // later kernel of the step (launch.h, VerifyAttentionParams::committed_ready)
  launch_kernel_ordered(embed_kernel, p.T, threads_for(p.Dm), 0, stream, p);
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

bool mla_prep_params_ok(const MlaPrepParams& p) {
  if ((!p.skip_q && !p.q) || !p.q_rope || !p.kv || !p.kv_norm_w || !p.cs || !p.cache) return false;
  if (p.T < 0 || p.H <= 0 || p.C <= 0 || p.R <= 0 || p.R % 2 || p.Dn < 0 || p.ldc < p.C + p.R ||
      p.ldkv < p.C + p.R || (!p.skip_q && p.ldq < p.H * (p.Dn + p.R)) || p.row0 < 0)
    return false;
  return !(p.q_scale_out && (!p.qa || p.qa_n <= 0 || p.ldqa < p.qa_n));
}

cudaError_t mla_prep(const MlaPrepParams& p, cudaStream_t stream) {
  if (!mla_prep_params_ok(p)) return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  launch_kernel(mla_prep_kernel, p.T, threads_for(p.C), 0, stream, p);
  return cudaGetLastError();
}

cudaError_t fold_q_projection(const float* w_qb, const float* g, const float* w_qa, int N, int J, int Kd, float* out,
                              cudaStream_t stream) {
  if (!w_qb || !g || !w_qa || !out || N <= 0 || J <= 0 || Kd <= 0) return cudaErrorInvalidValue;
  const long long n = (long long)N * Kd;
  launch_kernel(fold_q_kernel, (unsigned)((n + 255) / 256), 256, 0, stream, w_qb, g, w_qa, N, J, Kd, out);
  return cudaGetLastError();
}

bool uv_combine_ok(int T, int S, int C, int Dv) {
  return T >= 1 && T <= kUvMaxT && S >= 2 && S <= kUvMaxS && C == 512 && Dv >= kUvRows && Dv % kUvRows == 0;
}

cudaError_t uv_combine(const UvCombineParams& p, cudaStream_t stream) {
  if (!p.partials || !p.out || !p.w_uv || p.H < 1 || !uv_combine_ok(p.T, p.S, p.C, p.Dv) || !aligned16(p.partials) ||
      !aligned16(p.w_uv))
    return cudaErrorInvalidValue;
  const dim3 grid(p.H, p.Dv / kUvRows);
  if (p.w_uv_bf16 && aligned8(p.w_uv_bf16)) launch_kernel(uv_combine_kernel<true>, grid, kUvThreads, 0, stream, p);
  else launch_kernel(uv_combine_kernel<false>, grid, kUvThreads, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t swiglu(const SwigluParams& p, cudaStream_t stream) {
  if (!p.gu || !p.out || p.rows < 0 || p.I <= 0 || (p.ldg != 0 && p.ldg < 2LL * p.I)) return cudaErrorInvalidValue;
  const long long n = (long long)p.rows * p.I;
  if (n == 0) return cudaSuccess;
  long long blocks = (n + 255) / 256;
  if (blocks > 4096) blocks = 4096;
  launch_kernel(swiglu_kernel, (int)blocks, 256, 0, stream, p);
  return cudaGetLastError();
}

namespace {
bool route_invalid(const RouteParams& p) {
  return !p.logits || !p.bias || !p.topk_idx || !p.topk_w || p.T < 0 || p.E <= 0 || p.E > 1024 || p.G <= 0 ||
         p.E % p.G || p.E / p.G < 2 || p.topk_group < 1 || p.topk_group > p.G || p.K < 1 ||
         p.K > p.topk_group * (p.E / p.G) || (p.ldl != 0 && p.ldl < p.E);
}
bool group_invalid(const MoeGroupParams& p) {
  return !p.topk_idx || !p.counts || !p.offsets || !p.slot_token || !p.slot_of || !p.tile_expert || !p.tile_row0 ||
         !p.num_tiles || p.T < 0 || p.K < 1 || p.E < 1 || p.tile_rows < 1;
}
bool moe_route_group_fast_ok(const RouteParams& p) {
  return p.T >= 1 && p.T <= kRouteGroupMaxT && p.topk_group == p.G && p.K <= kFastRouteMaxK;
}
// dynamic shared memory of route_token for a block of `threads` (< 48 KiB for E <= 1024)
size_t route_smem(const RouteParams& p, int threads) {
  const int nc = threads / 32 * (p.K < 32 ? p.K : 32);
  return (size_t)(2 * nc + 2 * p.K + p.E + 2 * p.G) * 4;
}
}  // namespace

cudaError_t moe_route(const RouteParams& p, cudaStream_t stream) {
  if (route_invalid(p)) return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  const int threads = (p.E + 31) / 32 * 32;
  launch_kernel(moe_route_kernel, p.T, threads, route_smem(p, threads), stream, p);
  return cudaGetLastError();
}

cudaError_t moe_route_group(const RouteParams& rp, const MoeGroupParams& gp, cudaStream_t stream) {
  const int A = gp.T * gp.K;
  if (rp.T > kRouteGroupMaxT || rp.T != gp.T || rp.K != gp.K || rp.E != gp.E || rp.topk_idx != gp.topk_idx ||
      A > kGroupSmallMax || gp.E > kGroupSmallMax || gp.force_two_pass || rp.T == 0) {
    cudaError_t e = moe_route(rp, stream);
    return e != cudaSuccess ? e : moe_group(gp, stream);
  }
  if (route_invalid(rp) || group_invalid(gp)) return cudaErrorInvalidValue;
  const int n = A > rp.E ? A : rp.E, threads = (n + 31) / 32 * 32;
  if (moe_route_group_fast_ok(rp) && !rp.force_block) {
    const size_t smem = (size_t)(2 * rp.T * (threads / 32) * rp.K + 3 * rp.T * rp.K) * 4;
    switch (rp.T) {
      case 1: launch_kernel(moe_route_group_fast_kernel<1>, 1, threads, smem, stream, rp, gp); break;
      case 2: launch_kernel(moe_route_group_fast_kernel<2>, 1, threads, smem, stream, rp, gp); break;
      case 3: launch_kernel(moe_route_group_fast_kernel<3>, 1, threads, smem, stream, rp, gp); break;
      default: launch_kernel(moe_route_group_fast_kernel<4>, 1, threads, smem, stream, rp, gp); break;
    }
    return cudaGetLastError();
  }
  launch_kernel(moe_route_group_kernel, 1, threads, route_smem(rp, threads), stream, rp, gp);
  return cudaGetLastError();
}

cudaError_t moe_group(const MoeGroupParams& p, cudaStream_t stream) {
  if (group_invalid(p)) return cudaErrorInvalidValue;
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

namespace {
bool expert_vec(const ExpertGemmParams& p) {
  return p.Kd % 4 == 0 && p.ldx % 4 == 0 && ((uintptr_t)p.x % 16) == 0 && ((uintptr_t)p.w % 16) == 0;
}
}  // namespace

bool expert_gemm_reads_bf16(const ExpertGemmParams& p) {
  return !p.w_int4 && p.tile_rows == kExpertSkinnyRows && expert_vec(p) && p.w_bf16 && aligned8(p.w_bf16);
}

bool expert_gemm_int4_ok(const ExpertGemmParams& p) {
  const int g = p.int4_group;
  return p.w_int4 && p.w_scale && g >= 32 && (g & (g - 1)) == 0 && p.Kd % g == 0 && p.ldx % 4 == 0 &&
         aligned16(p.x) && aligned16(p.w_int4) && aligned16(p.w_scale);
}

cudaError_t expert_gemm(const ExpertGemmParams& p, cudaStream_t stream) {
  if (!p.x || !p.w || !p.offsets || !p.tile_expert || !p.tile_row0 || !p.num_tiles || !p.y || p.N <= 0 ||
      p.Kd <= 0 || p.ldx < p.Kd || p.ldy < p.N || p.max_tiles < 0)
    return cudaErrorInvalidValue;
  if (p.w_int4 && (p.tile_rows != kExpertSkinnyRows || !expert_gemm_int4_ok(p)))
    return cudaErrorInvalidValue;  // INT4 weights: the GEMV-style kernel only, on the shapes it takes
  if (p.max_tiles == 0) return cudaSuccess;
  const bool vec = expert_vec(p) || (p.w_int4 != nullptr);  // (INT4: p.w is never read)
  if (p.tile_rows == kExpertSkinnyRows) {
    const int cols = kSkinnyWarps * (p.swiglu ? kSkinnyRW / 2 : kSkinnyRW);  // output columns per block
    dim3 grid(p.max_tiles, (p.N + cols - 1) / cols);
    if (grid.y > 65535u) return cudaErrorInvalidValue;
    const int steps = (p.Kd + (vec ? 127 : 31)) / (vec ? 128 : 32);  // k-steps of a warp over one row
    const int U = steps >= 4 ? 4 : steps >= 2 ? 2 : 1;
    const bool bf = expert_gemm_reads_bf16(p);
    if (p.w_int4) {
      // lanes of 16 weights where every step fills the warp (Kd % 512 == 0), else of 8; two rows a warp
      const int QW = p.Kd % 512 == 0 ? 16 : 8;
      const int qsteps = (p.Kd + 32 * QW - 1) / (32 * QW);
      const int qU = qsteps >= 4 ? 4 : qsteps >= 2 ? 2 : 1;  // (no instance spills: 72-155 registers)
      const int qcols = kSkinnyWarps * (p.swiglu ? kInt4RW / 2 : kInt4RW);  // output columns per block
      const dim3 qgrid(p.max_tiles, (p.N + qcols - 1) / qcols);
      if (qgrid.y > 65535u) return cudaErrorInvalidValue;
      if (QW == 16) {
        if (p.swiglu) launch_gemv_int4<true, 16>(qU, qgrid, p, stream);
        else launch_gemv_int4<false, 16>(qU, qgrid, p, stream);
      } else {
        if (p.swiglu) launch_gemv_int4<true, 8>(qU, qgrid, p, stream);
        else launch_gemv_int4<false, 8>(qU, qgrid, p, stream);
      }
      return cudaGetLastError();
    }
    if (p.swiglu) {
      if (bf) launch_gemv<true, true, true>(U, grid, p, stream);
      else if (vec) launch_gemv<true, true>(U, grid, p, stream);
      else launch_gemv<true, false>(U, grid, p, stream);
    } else {
      if (bf) launch_gemv<false, true, true>(U, grid, p, stream);
      else if (vec) launch_gemv<false, true>(U, grid, p, stream);
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

bool moe_combine_norm_ok(int Dm, int K) { return Dm >= 1 && Dm <= 8 * 256 && K >= 1 && K <= 64; }

cudaError_t moe_combine(const MoeCombineParams& p, cudaStream_t stream) {
  if (!p.y || !p.topk_idx || !p.topk_w || !p.slot_of || !p.out || p.T < 0 || p.K < 1 || p.K > 64 || p.Dm <= 0)
    return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  // float4 rows: every row the kernels read or write starts 16-byte aligned (the norm adds two more)
  const bool vec_base = p.Dm % 4 == 0 && ((uintptr_t)p.y % 16) == 0 && ((uintptr_t)p.out % 16) == 0 &&
                        ((uintptr_t)p.shared % 16) == 0;
  if (p.norm_w) {
    if (!p.norm_out || !moe_combine_norm_ok(p.Dm, p.K)) return cudaErrorInvalidValue;
    const bool vec = vec_base && ((uintptr_t)p.norm_w % 16) == 0 && ((uintptr_t)p.norm_out % 16) == 0;
    const int n = vec ? p.Dm / 4 : p.Dm;  // float4s / floats per row
    int th = threads_for(n);
    if (th < p.K) th = (p.K + 31) / 32 * 32;
    const int nv = (n + th - 1) / th;  // <= 8: moe_combine_norm_ok
    if (vec) {
      if (nv == 1) launch_kernel(moe_combine_norm_kernel<true, 1>, p.T, th, 0, stream, p);
      else launch_kernel(moe_combine_norm_kernel<true, 2>, p.T, th, 0, stream, p);
    } else {
      if (nv == 1) launch_kernel(moe_combine_norm_kernel<false, 1>, p.T, th, 0, stream, p);
      else if (nv == 2) launch_kernel(moe_combine_norm_kernel<false, 2>, p.T, th, 0, stream, p);
      else if (nv <= 4) launch_kernel(moe_combine_norm_kernel<false, 4>, p.T, th, 0, stream, p);
      else launch_kernel(moe_combine_norm_kernel<false, 8>, p.T, th, 0, stream, p);
    }
    return cudaGetLastError();
  }
  const bool vec = vec_base;
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

namespace {
// the two element-wise conversions: a grid-stride kernel over n elements, at most max_blocks blocks of 256
template <class S, class D>
cudaError_t launch_convert(void (*kernel)(const S*, D*, long long), const S* src, D* dst, long long n,
                           long long max_blocks, cudaStream_t stream) {
  if (!src || !dst || n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const long long blocks = std::min<long long>((n + 255) / 256, max_blocks);
  launch_kernel(kernel, (int)blocks, 256, 0, stream, src, dst, n);
  return cudaGetLastError();
}
}  // namespace

cudaError_t f32_to_bf16_high(const float* src, uint16_t* dst, long long n, cudaStream_t stream) {
  return launch_convert(f32_to_bf16_high_kernel, src, dst, n, 4096, stream);
}

cudaError_t bf16_to_f32(const uint16_t* src, float* dst, long long n, cudaStream_t stream) {
  return launch_convert(bf16_to_f32_kernel, src, dst, n, 8192, stream);
}

cudaError_t causal_bits(uint64_t* bits, int T, int W, cudaStream_t stream) {
  if (!bits || T < 0 || W < (T + 63) / 64) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  launch_kernel(causal_bits_kernel, T, 32, 0, stream, bits, T, W);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kdtree
