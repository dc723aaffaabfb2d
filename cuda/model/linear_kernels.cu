// linear_kernels.cu: the skinny linear layer (few tokens x a dense weight), see model_kernels.h.
//
// Why: at decode and small-tree verify the dense projections of the model (q_a/kv_a, q_b, the
// absorbed W_UK / W_UV, o_proj, the dense and shared MLPs, the router, lm_head) are a few token
// rows against a weight matrix that is read once. cuBLAS runs them as SIMT SGEMM tiles or GEMV
// kernels that keep few bytes in flight (mini-kimi on the H200: 3-9 us for 1.5-8 MB matrices,
// 0.3-1 TB/s). Measured on the H200 (docs/BENCHMARKS.md, "Skinny linear layers vs cuBLAS"):
// the whole mini-kimi step is 1.1-1.35x faster with this kernel for T = 1..16; a single block
// of more token accumulators lost to cuBLAS (issue-bound: ~11 cycles per instruction with few
// warps per SM). Up to 64 tokens are accepted, in balanced slices of at most the configuration's
// token capacity TT along grid.z (each slice streams the weights again, mostly from L2); the
// configuration (RW, TT, U) is picked per shape (auto_config below, measured per projection).
// At T = 17 the step was 1.05x cuBLAS, 0.95x at 24; CudaModel uses it for 1-5 and 17-20 tokens (linear_tile.cu for 6-16). Here
// every lane streams 16-byte weight loads, U k-steps of RW rows issued before any FMA, and the
// few token rows come through L1 (__ldg; the weight bypasses L1 so that they stay). Deterministic: no atomics; per output a lane sums its k-steps in ascending order,
// the warp's lanes are reduced by a fixed shuffle tree and (KS > 1) the block's warps in warp
// order. An RMSNorm of the x rows can run first, inside the kernel (norm_w, T <= 4), or the x rows
// can be [gate | up] pairs whose SwiGLU is the input (x_swiglu: the down projection of an MLP).
//
// Layout of the work: a block has kLinWarps = 4 warps and owns RW * 4 / KS output rows; the KS
// warps of a row group split the k-steps round robin (warp kw takes steps kw, kw + KS, ...).
// Lane l covers the floats [4 (32 s + l), +4) of step s (VEC) or float 32 s + l (scalar).
#include <type_traits>
#include <utility>

#include "model_kernels.h"
#include "launch.h"
#include "warp_reduce.h"
#include "model/vec_load.h"
#include "model/device_math.h"
#include "model/mla_prep_device.h"

namespace kdtree {
namespace cuda {
namespace {

constexpr int kLinWarps = 4;

template <class WT>
__device__ __forceinline__ WT ld_weight(const float* p);
template <>
__device__ __forceinline__ float ld_weight<float>(const float* p) { return __ldg(p); }
template <>
__device__ __forceinline__ float4 ld_weight<float4>(const float* p) {
  float4 v;  // streamed once: keep L1 for the token rows
  asm("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
      : "l"(p));
  return v;
}
__device__ __forceinline__ float fdot(float w, float x, float acc) { return fmaf(w, x, acc); }
__device__ __forceinline__ float fdot(const float4& w, const float4& x, float acc) {
  acc = fmaf(w.x, x.x, acc);
  acc = fmaf(w.y, x.y, acc);
  acc = fmaf(w.z, x.z, acc);
  return fmaf(w.w, x.w, acc);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// RMSNorm prologue (NORM, p.norm_w): the x rows are normalised on the fly, x'[t, k] = norm_w[k] *
// x[t, k] / rms(x[t]) (the sum of squares in double, as the rmsnorm kernel); each warp computes
// the few rows' 1/rms itself (no barrier), after its first weight loads are issued, and scales
// its sums by it. Lane l sums x[t, l + 32 j] in ascending j; the loads of a chunk of CH j's of
// every row are issued before any of them is summed (before: a loop with the compiler's unroll by
// 4, Kd / 128 dependent L2 round trips per row), the sums keep their order (the same bits).
template <int TT>
__device__ __forceinline__ void row_inv_rms(const LinearParams& p, const float* X, int T, float* inv, int lane) {
  constexpr int CH = TT == 1 ? 32 : TT == 2 ? 16 : 8;  // loads in flight per lane: CH * TT <= 32
  double ss[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) ss[t] = 0.0;
  for (int k0 = lane; k0 < p.Kd; k0 += 32 * CH) {
    float v[TT][CH];
#pragma unroll
    for (int t = 0; t < TT; ++t)
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        const int k = k0 + 32 * j;
        v[t][j] = t < T && k < p.Kd ? __ldg(X + (size_t)t * p.ldx + k) : 0.f;
      }
#pragma unroll
    for (int t = 0; t < TT; ++t)
#pragma unroll
      for (int j = 0; j < CH; ++j)
        if (k0 + 32 * j < p.Kd) ss[t] += (double)v[t][j] * (double)v[t][j];
  }
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    inv[t] = 1.f;
    if (t < T) {  // warp-uniform
#pragma unroll
      for (int o = 16; o >= 1; o >>= 1) ss[t] += __shfl_xor_sync(0xffffffffu, ss[t], o);
      inv[t] = rms_inv(ss[t], p.Kd, p.norm_eps);
    }
  }
}
__device__ __forceinline__ void scale(float& v, float g) { v *= g; }
__device__ __forceinline__ void scale(float4& v, const float4& g) {
  v.x *= g.x;
  v.y *= g.y;
  v.z *= g.z;
  v.w *= g.w;
}

// The rope block (PRO 3, LinearParams::rope_out): RoPE of the slice's T token rows' rope part of
// head blockIdx.y, as mla_prep does it (rope_store: the same bits). Its loads of x (the previous
// kernel's output) are coherent (__ldcg): this wait is behind a branch (cuda/launch.h).
__device__ __forceinline__ void rope_rows(const LinearParams& p, const float* X, int t0, int T) {
  pdl_wait();
  const int half = p.rope_R / 2, il = p.rope_interleaved;
  float* out = p.rope_out + (size_t)t0 * p.rope_ld + (size_t)blockIdx.y * p.rope_R;
  for (int i = threadIdx.x; i < T * half; i += blockDim.x) {
    const int t = i / half, j = i % half;
    const float* x = X + (size_t)t * p.ldx + p.rope_off;
    const float* cs = p.rope_cs + (size_t)(t0 + t) * p.rope_R;
    const float a = __ldcg(x + (il ? 2 * j : j)), b = __ldcg(x + (il ? 2 * j + 1 : j + half));
    rope_store(a, b, __ldcg(cs + j), __ldcg(cs + half + j), half, j, out + (size_t)t * p.rope_ld);
  }
}

// PRO: the x prologue: 0 none, 1 RMSNorm (norm_w), 2 SwiGLU of [gate | up] rows (x_swiglu), 3 none
// plus the rope block (the first block of each batch entry and slice; rope_out), 4 the rope block that also
// does mla_prep's cache rows (prep_on; its own instantiation: the prep's registers stay out of the others).
// BF (with VEC): the weights come from w_bf16 (exact BF16 copies), widened as they are loaded; the
// arithmetic is the FP32 path's, on the same values, so the results are the same bits.
template <int RW, int TT, int U, int KS, bool VEC, int PRO, bool BF = false>
__global__ void __launch_bounds__(kLinWarps * 32) linear_skinny_kernel(LinearParams p) {
  static_assert(!BF || VEC, "BF16 weights on the vector path only");
  constexpr bool NORM = PRO == 1, SWI = PRO == 2, ROPE = PRO == 3 || PRO == 4, PREP = PRO == 4;
  using WT = typename std::conditional<VEC, float4, float>::type;
  constexpr int VW = VEC ? 4 : 1;
  constexpr int NV = RW * TT;            // outputs per row group: value i * TT + t
  constexpr int GROUPS = kLinWarps / KS; // row groups per block
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int grp = warp / KS, kw = warp % KS;
  // (ROPE: block x = 0 of each head and slice is the rope block, launched first; the product's blocks follow)
  const int n0 = (((int)blockIdx.x - (ROPE ? 1 : 0)) * GROUPS + grp) * RW;
  // token slice blockIdx.z: tokens [t0, t0 + T) of the step; more than TT tokens go in gridDim.z
  // slices of ts <= TT tokens, balanced (17 = 9 + 8), each streaming the weights again (mostly
  // from L2)
  const int ts = (p.T + (int)gridDim.z - 1) / (int)gridDim.z;
  const int t0 = blockIdx.z * ts, T = min(ts, p.T - t0), Kd = p.Kd, N = p.N;
  const float* X = p.x + (size_t)blockIdx.y * p.x_batch + (size_t)t0 * p.ldx;
  const float* W = p.w + (size_t)blockIdx.y * p.w_batch;
  const uint16_t* Wb = BF ? p.w_bf16 + (size_t)blockIdx.y * p.w_batch : nullptr;
  float* Y = p.y + (size_t)blockIdx.y * p.y_batch + (size_t)t0 * p.ldy;
  const bool live = n0 < N;  // (KS > 1: every warp reaches the block barrier below)
  pdl_trigger();
  if constexpr (ROPE) {
    if (blockIdx.x == 0) {  // the whole block: no barrier below is reached
      rope_rows(p, X, t0, T);
      if constexpr (PREP) {  // mla_prep's work for the step's tokens f, f + rope blocks, ... (block-uniform),
                             // f = z H + y counting the rope blocks in launch order: one token each, first wave
        static_assert(2 * kLinWarps * 32 >= 256, "mla_prep_token<2, .> covers mla_prep's block of <= 256 threads");
        __shared__ double red[32], red2[32];
        const int nrope = (int)(gridDim.y * gridDim.z);
        for (int t = (int)(blockIdx.z * gridDim.y + blockIdx.y); t < p.T; t += nrope) {
          mla_prep_token<2, kPrepRegs / 2>(p.prep, t, red, red2);
          __syncthreads();  // red / red2 read by every thread before the next token writes them
        }
      }
      return;
    }
  }

  float acc[NV];
#pragma unroll
  for (int v = 0; v < NV; ++v) acc[v] = 0.f;
  if (live) {
    size_t wrow[RW];  // row offsets (elements) in W / Wb
#pragma unroll
    for (int i = 0; i < RW; ++i) wrow[i] = (size_t)min(n0 + i, N - 1) * Kd;  // rows >= N: unused copies
    constexpr int STEP = 32 * VW;
    WT wv[U][RW];
    auto load_w = [&](int k0) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = k0 + u * STEP + lane * VW;
#pragma unroll
        for (int i = 0; i < RW; ++i) {
          if (k < Kd) {
            if constexpr (BF) wv[u][i] = ldg_bf16x4(Wb + wrow[i] + k);
            else wv[u][i] = ld_weight<WT>(W + wrow[i] + k);
          } else {
            vzero(wv[u][i]);
          }
        }
      }
    };
    WT gv[NORM ? U : 1];  // norm weights of the k-steps (NORM; immutable like the weights)
    auto load_g = [&](int k0) {
      if constexpr (NORM) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int k = k0 + u * STEP + lane * VW;
          if (k < Kd) gv[u] = ldg_vec<WT>(p.norm_w + k);
          else vzero(gv[u]);
        }
      }
    };
    int k0 = kw * U * STEP;
    if (k0 < Kd) {  // in flight while the previous kernel finishes and the norm (if any) runs
      load_w(k0);  // pdl: pre-wait (weights)
      load_g(k0);  // pdl: pre-wait (norm weights)
    }
    pdl_wait();  // the weights are immutable; x and y come after the wait
    float inv[NORM ? TT : 1];
    if constexpr (NORM) {
      row_inv_rms<TT>(p, X, T, inv, lane);
      if (p.norm_out && blockIdx.x == 0 && blockIdx.y == 0) {  // each slice its rows
        // the normalised rows for later kernels, rounded as the rmsnorm kernel rounds them; split
        // over block 0's live warps (warp w < nlive: its row group starts below N)
        const int nlive = min(kLinWarps, ((N + RW - 1) / RW) * KS);
#pragma unroll
        for (int t = 0; t < TT; ++t)
          if (t < T)
            for (int k = warp * 32 + lane; k < Kd; k += nlive * 32)
              p.norm_out[(size_t)(t0 + t) * p.ldn + k] =
                  __fmul_rn(__ldg(p.norm_w + k), __fmul_rn(__ldg(X + (size_t)t * p.ldx + k), inv[t]));
      }
    }
    while (k0 < Kd) {
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        if (t < T) {  // warp-uniform
          const float* xr = X + (size_t)t * p.ldx;
          WT xv[U];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int k = k0 + u * STEP + lane * VW;
            if (k < Kd) {
              xv[u] = ldg_vec<WT>(xr + k);
              if constexpr (SWI) xv[u] = silu_mul(xv[u], ldg_vec<WT>(xr + Kd + k));
            } else {
              vzero(xv[u]);
            }
            if constexpr (NORM) scale(xv[u], gv[u]);
          }
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int i = 0; i < RW; ++i) acc[i * TT + t] = fdot(wv[u][i], xv[u], acc[i * TT + t]);
        }
      }
      k0 += KS * U * STEP;
      if (k0 < Kd) {
        load_w(k0);
        load_g(k0);
      }
    }
    if constexpr (NORM) {
#pragma unroll
      for (int i = 0; i < RW; ++i)
#pragma unroll
        for (int t = 0; t < TT; ++t) acc[i * TT + t] *= inv[t];
    }
  } else {
    pdl_wait();
  }

  // Warp reduction: value v of the group ends on lane v % 32 (NV >= 32) or on every lane.
  constexpr int NR = NV >= 32 ? NV / 32 : NV;  // reduced values per lane
  float red[NR];
  if constexpr (NV >= 32) {
#pragma unroll
    for (int g = 0; g < NR; ++g) red[g] = reduce_scatter32(acc + g * 32, lane);
  } else {
#pragma unroll
    for (int v = 0; v < NR; ++v) red[v] = warp_sum(acc[v]);
  }
  if constexpr (KS > 1) {  // the KS warps of a row group, summed in warp order by the group's first warp
    __shared__ float part[kLinWarps][NR][32];
#pragma unroll
    for (int r = 0; r < NR; ++r) part[warp][r][lane] = red[r];
    __syncthreads();
    if (kw != 0) return;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float s = part[warp][r][lane];
#pragma unroll
      for (int w = 1; w < KS; ++w) s += part[warp + w][r][lane];
      red[r] = s;
    }
  }
  if (!live) return;
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const int v = NV >= 32 ? r * 32 + lane : r;
    if (NV < 32 && lane != 0) continue;
    const int i = v / TT, t = v % TT, n = n0 + i;
    if (t < T && n < N) {
      float* out = Y + (size_t)t * p.ldy + n;
      *out = p.beta != 0.f ? fmaf(p.beta, *out, red[r]) : red[r];
    }
  }
}

// the vector path with FP32 or (bf) BF16 weights, or the scalar path (FP32 weights)
template <int RW, int TT, int U, int KS, int PRO>
void launch_pro(const LinearParams& p, bool vec, bool bf, dim3 grid, cudaStream_t stream) {
  if (vec && bf) launch_kernel(linear_skinny_kernel<RW, TT, U, KS, true, PRO, true>, grid, kLinWarps * 32, 0, stream, p);
  else if (vec) launch_kernel(linear_skinny_kernel<RW, TT, U, KS, true, PRO>, grid, kLinWarps * 32, 0, stream, p);
  else launch_kernel(linear_skinny_kernel<RW, TT, U, KS, false, PRO>, grid, kLinWarps * 32, 0, stream, p);
}

// The configurations that have the rope block (those auto_config gives the W_UK product's short
// rows, Kd <= 128, at any token count); rope_config_of() is the same test at run time.
template <int RW, int TT, int U>
constexpr bool kRopeConfig = (RW == 4 && TT == 1 && U == 1) || (RW == 8 && TT == 4 && U == 1);

template <int RW, int TT, int U, int KS>
cudaError_t launch(const LinearParams& p, bool vec, cudaStream_t stream) {
  constexpr int rows_per_block = RW * kLinWarps / KS;
  dim3 grid((unsigned)((p.N + rows_per_block - 1) / rows_per_block), (unsigned)p.batch,
            (unsigned)((p.T + TT - 1) / TT));  // balanced slices of <= TT tokens
  const bool bf = vec && linear_skinny_reads_bf16(p);  // (vec = vec_path(p), which that includes)
  if constexpr (kRopeConfig<RW, TT, U>) {
    if (p.rope_out) {  // (vec: checked by linear_skinny)
      grid.x += 1;
      if (p.prep_on) {
        if (bf) launch_kernel(linear_skinny_kernel<RW, TT, U, KS, true, 4, true>, grid, kLinWarps * 32, 0, stream, p);
        else launch_kernel(linear_skinny_kernel<RW, TT, U, KS, true, 4>, grid, kLinWarps * 32, 0, stream, p);
      } else if (bf) {
        launch_kernel(linear_skinny_kernel<RW, TT, U, KS, true, 3, true>, grid, kLinWarps * 32, 0, stream, p);
      } else {
        launch_kernel(linear_skinny_kernel<RW, TT, U, KS, true, 3>, grid, kLinWarps * 32, 0, stream, p);
      }
      return cudaGetLastError();
    }
  }
  if (p.rope_out) return cudaErrorInvalidValue;
  if constexpr (TT <= kLinearNormMaxT) {
    if (p.norm_w) {
      launch_pro<RW, TT, U, KS, 1>(p, vec, bf, grid, stream);
      return cudaGetLastError();
    }
  }
  if (p.x_swiglu) launch_pro<RW, TT, U, KS, 2>(p, vec, bf, grid, stream);
  else launch_pro<RW, TT, U, KS, 0>(p, vec, bf, grid, stream);
  return cudaGetLastError();
}

// Split the k-steps over 2 warps per row group when one warp per group leaves the GPU short of
// blocks (a few hundred rows: q_a/kv_a, o_proj, W_UV) and k is long enough to share.
constexpr long long kFillBlocks = 264;  // 2 blocks per SM on a 132-SM H200
template <int RW, int TT, int U>
cudaError_t launch_fill(const LinearParams& p, bool vec, cudaStream_t stream) {
  const long long blocks = (long long)((p.N + RW * kLinWarps - 1) / (RW * kLinWarps)) * p.batch;
  const int steps = (p.Kd + (vec ? 128 : 32) - 1) / (vec ? 128 : 32);
  if (blocks < kFillBlocks && steps >= 2 * U) return launch<RW, TT, U, 2>(p, vec, stream);
  return launch<RW, TT, U, 1>(p, vec, stream);
}

// The configurations (RW, TT, U) a caller may force (LinearParams::force_config = index + 1),
// for tests and benchmarks (bench_cuda_skinny_configs.py); the automatic choice below uses
// entries of the same table.
constexpr LinearSkinnyConfig kConfigs[] = {
    {1, 1, 8}, {2, 2, 4}, {2, 4, 4}, {4, 8, 2}, {4, 16, 2}, {4, 1, 1}, {4, 1, 2}, {4, 1, 4}, {2, 8, 2}, {8, 4, 1},
};
constexpr int kNumConfigs = sizeof(kConfigs) / sizeof(kConfigs[0]);
constexpr bool same_config(const LinearSkinnyConfig& c, int rw, int tt, int u) { return c.RW == rw && c.TT == tt && c.U == u; }

// launch_config(i, ...) = launch_fill<kConfigs[i].RW, kConfigs[i].TT, kConfigs[i].U>: the table above
// is the only list of the configurations (a function table built over the indices).
using LaunchFn = cudaError_t (*)(const LinearParams&, bool, cudaStream_t);
template <size_t I>
cudaError_t launch_config_at(const LinearParams& p, bool vec, cudaStream_t stream) {
  return launch_fill<kConfigs[I].RW, kConfigs[I].TT, kConfigs[I].U>(p, vec, stream);
}
template <size_t... I>
cudaError_t launch_config_of(int i, const LinearParams& p, bool vec, cudaStream_t stream, std::index_sequence<I...>) {
  static constexpr LaunchFn table[] = {&launch_config_at<I>...};
  return i >= 0 && i < (int)sizeof...(I) ? table[i](p, vec, stream) : cudaErrorInvalidValue;
}
cudaError_t launch_config(int i, const LinearParams& p, bool vec, cudaStream_t stream) {
  return launch_config_of(i, p, vec, stream, std::make_index_sequence<kNumConfigs>{});
}

// The automatic choice: an index into kConfigs from the token count, the row length Kd, the
// batch (heads) and the weight bytes. Measured on the H200 per projection of the mini-kimi step
// and per T with benchmarks/bench_cuda_skinny_configs.py (docs/BENCHMARKS.md, "Skinny linear
// configurations"); in words:
// * T = 1: enough loads in flight per lane with few blocks: four rows per warp with as many
//   k-steps as a row of < 2048 floats has (up to 4; 8 rows of 4 tokens' capacity for 256), one
//   row and 8 k-steps for longer rows (o_proj, the dense down projection);
// * T = 2..4: slices of one token (four rows, 2-4 k-steps: the other slices re-read the weights
//   from the L2) unless the weights do not stay in the L2 (> 16 MB: lm_head, the dense gate/up)
//   or the rows are short (W_UK): then 8 rows x 4 tokens; per-head products with rows <= 512
//   (W_UV): 4 rows x 8 tokens; rows >= 2048 without the SwiGLU prologue (o_proj): 2 rows x 4;
// * T >= 5: short rows (<= 256, or <= 512 per head: W_UK, W_UV, the shared down projection):
//   8 rows x 4-token slices; else 4 rows x 8 or 16 tokens (slices of 16).
// The scalar path (unaligned rows) keeps the first tuning: one configuration per token count.
// The per-output summation order differs between configurations (warp reductions), so this
// choice is a pure function of the shapes: deterministic results for a given model.
int auto_config(const LinearParams& p, bool vec) {
  enum { c1x8 = 0, c2x2 = 1, c2x4 = 2, c4x8 = 3, c4x16 = 4, c4t1u1 = 5, c4t1u2 = 6, c4t1u4 = 7, c8x4 = 9 };
  static_assert(same_config(kConfigs[c1x8], 1, 1, 8) && same_config(kConfigs[c2x2], 2, 2, 4) &&
                    same_config(kConfigs[c2x4], 2, 4, 4) && same_config(kConfigs[c4x8], 4, 8, 2) &&
                    same_config(kConfigs[c4x16], 4, 16, 2) && same_config(kConfigs[c4t1u1], 4, 1, 1) &&
                    same_config(kConfigs[c4t1u2], 4, 1, 2) && same_config(kConfigs[c4t1u4], 4, 1, 4) &&
                    same_config(kConfigs[c8x4], 8, 4, 1),
                "auto_config's names must match the configuration table");
  const int T = p.T, Kd = p.Kd;
  if (!vec) return T == 1 ? c1x8 : T == 2 ? c2x2 : T <= 4 ? c2x4 : T <= 8 ? c4x8 : c4x16;
  const bool big = (long long)p.N * Kd * p.batch * 4 > (16ll << 20);
  const bool heads = p.batch > 1 && Kd <= 512 && !p.norm_w;
  if (T == 1) return Kd <= 128 ? c4t1u1 : Kd <= 256 ? c8x4 : Kd < 2048 ? c4t1u4 : c1x8;
  if (T <= 4) {
    if (big || Kd <= 128) return c8x4;
    if (heads) return c4x8;
    if (T == 2) return c4t1u4;
    if (Kd >= 2048 && !p.x_swiglu) return c2x4;
    return Kd <= 512 ? c4t1u2 : c4t1u4;
  }
  if (Kd <= 256 || heads) return c8x4;
  return T <= 8 ? c4x8 : c4x16;
}

// whether the configuration at index i has the rope block (kRopeConfig)
template <size_t... I>
bool rope_config_of(int i, std::index_sequence<I...>) {
  static constexpr bool table[] = {kRopeConfig<kConfigs[I].RW, kConfigs[I].TT, kConfigs[I].U>...};
  return i >= 0 && i < (int)sizeof...(I) && table[i];
}
bool vec_path(const LinearParams& p) {
  return p.Kd % 4 == 0 && p.ldx % 4 == 0 && p.x_batch % 4 == 0 && p.w_batch % 4 == 0 && aligned16(p.x) &&
         aligned16(p.w) && (!p.norm_w || aligned16(p.norm_w));
}

}  // namespace

bool linear_skinny_reads_bf16(const LinearParams& p) { return vec_path(p) && p.w_bf16 && aligned8(p.w_bf16); }

bool linear_skinny_rope_ok(const LinearParams& p) {
  if (p.norm_w || p.x_swiglu || !vec_path(p)) return false;
  const int i = p.force_config > 0 ? p.force_config - 1 : auto_config(p, true);
  return rope_config_of(i, std::make_index_sequence<kNumConfigs>{});
}

int linear_skinny_num_configs() { return kNumConfigs; }
LinearSkinnyConfig linear_skinny_config(int i) { return i >= 0 && i < kNumConfigs ? kConfigs[i] : LinearSkinnyConfig{0, 0, 0}; }

cudaError_t linear_skinny(const LinearParams& p, cudaStream_t stream) {
  if (!p.x || !p.w || !p.y || p.T < 0 || p.T > kLinearSkinnyMaxT || p.N <= 0 || p.Kd <= 0 || p.batch <= 0 ||
      p.batch > 65535 || p.ldx < p.Kd || p.ldy < p.N || p.x_batch < 0 || p.w_batch < 0 || p.y_batch < 0)
    return cudaErrorInvalidValue;
  if (p.norm_w && (p.T > kLinearNormMaxT || !(p.norm_eps >= 0.0))) return cudaErrorInvalidValue;
  if (p.x_swiglu && (p.norm_w || p.ldx < 2LL * p.Kd)) return cudaErrorInvalidValue;
  if (p.norm_out && (!p.norm_w || p.ldn < p.Kd || p.batch != 1)) return cudaErrorInvalidValue;
  if (p.force_config < 0 || p.force_config > kNumConfigs) return cudaErrorInvalidValue;
  // a forced configuration with the RMSNorm prologue needs a token capacity that has it
  if (p.force_config > 0 && p.norm_w && kConfigs[p.force_config - 1].TT > kLinearNormMaxT) return cudaErrorInvalidValue;
  if (p.rope_out && (!p.rope_cs || p.rope_R <= 0 || p.rope_R % 2 || p.rope_off < 0 ||
                     p.rope_off + p.rope_R > p.ldx || p.rope_ld < (long long)p.batch * p.rope_R ||
                     !linear_skinny_rope_ok(p)))
    return cudaErrorInvalidValue;
  // the prep blocks: mla_prep's cache rows only (the rope block ropes the queries), for this product's tokens,
  // at most 2 x 128 threads' worth of mla_prep's block (threads_for: <= 256)
  if (p.prep_on && (!p.rope_out || !p.prep.skip_q || p.prep.T != p.T || !mla_prep_params_ok(p.prep)))
    return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  const bool vec = vec_path(p);
  if (p.force_config > 0) return launch_config(p.force_config - 1, p, vec, stream);
  return launch_config(auto_config(p, vec), p, vec, stream);
}

}  // namespace cuda
}  // namespace kdtree
