// expert_mma.cu: the grouped expert GEMM of the MoE layers on the tensor cores (3xTF32,
// FP32-accurate), for schedule tiles of 8 / 16 / 32 / 64 slots: every step with at least as many
// expert assignments as experts (verify steps, prefill). See model_kernels.h (expert_gemm_mma).
//
// Why: the GEMV-style kernel (model_kernels.cu, expert_gemv_kernel) keeps its weight loads in
// registers; a warp issues 16 float4 loads per lane, waits for them, multiplies and only then
// issues the next ones, and a block covers only 16 weight rows (a down-projection block reads
// 16 KB in one round trip). Nsight Compute on the H200 (mini-kimi verify of 17 tokens,
// docs/BENCHMARKS.md): gate/up at 33 % and down at 18 % of the DRAM peak. Here a block streams 64
// weight rows of one expert through shared memory with cp.async (kStages - 1 = 2 chunks of 64
// floats ahead: 32 KB per block without registers) and multiplies them with the tile's slots, whose
// rows are gathered by slot with the same copies, on the tensor cores (tile_mma.h, the machinery
// of linear_tile). SwiGLU (gate rows [0, N), up rows [N, 2N) of each expert): a block takes 32
// gate rows and the 32 matching up rows and writes silu(gate) * up.
//
// Deterministic: per output and k part the products are summed in ascending k by one warp's three
// mma chains (hi*hi, lo*hi, hi*lo: three accumulators, added as big + (s1 + s2) at the end), the k
// parts added in a fixed order; the schedule (which slots a tile holds) comes from moe_group and
// does not depend on timing.
#include <algorithm>
#include <cstdint>

#include "model_kernels.h"
#include "launch.h"
#include "model/device_math.h"
#include "model/tile_mma.h"
#include "model/vec_load.h"

namespace kdtree {
namespace cuda {
namespace {

constexpr int kThreads = 128;

constexpr int kBK = 64;     // k floats per chunk (256-byte row segments)
constexpr int kStages = 3;  // chunks in flight

constexpr int kPadB = kTilePadB<kBK>;  // BF16 weight rows in shared memory (tile_mma.h)

// grid (max_tiles, column blocks of 64 weight rows: 64 outputs, or 32 with SwiGLU), 128 KH threads:
// warp w of k part h (w = warp % 4, h = warp / 4) multiplies weight rows [16 w, 16 w + 16) of the
// block with columns [h BK / KH, (h + 1) BK / KH) of every chunk; the KH partial tiles are added in
// order h = 0, 1, ... after the loop.
// The three 3xTF32 partial products go to three accumulators: independent mma chains (a third of
// the latency of one chain) and the small terms summed apart from the large one.
// BF: the weights come from the exact BF16 copy (p.w_bf16, Kd a multiple of 8): half the bytes
// copied, no split of the weights and two mma per product instead of three (tile_mma.h,
// mma_chunk_bf16w), the same results.
// Q4: the weights from the INT4 stack (p.w_int4 / p.w_scale): a chunk's 32 bytes of nibbles a row and the
// row's two group scales are copied (cp.async) and turned into BF16 values in the fragment reads
// (tile_mma.h, mma_chunk_int4w): the BF16 path's products on the dequantized values, the same results.
// PRE (down projections, !SWI): the block reads the schedule and issues its first ST - 1 chunks' weight
// copies before its PDL wait, the input rows after it. Allowed because the schedule comes from two
// launches back and the launch just before is this kernel's SwiGLU form, which triggers its dependents
// only after its own wait (below): when a block of this grid starts, moe_group has completed (the
// caller's promise: ExpertGemmParams::pdl_pre). So the down projection's first weights stream while the
// gate/up grid drains instead of after it.
template <int BM, bool SWI, bool BF = false, bool Q4 = false, int KH = 1, bool PRE = false>
__global__ void __launch_bounds__(kThreads * KH) expert_mma_kernel(ExpertGemmParams p) {
  static_assert(!(BF && Q4), "one weight form");
  static_assert(!(PRE && (SWI || BF || Q4)), "the early weight copies: FP32 down projections only");
  static_assert(kBK == 64 && kThreads * KH >= 2 * kTileBN, "Q4: one 16-byte piece and one scale a thread at most");
  constexpr int TM = BM / 8, BK = kBK, ST = kStages, NTH = kThreads * KH;
  constexpr int PAD = BK + 4;                  // row stride: 16-byte rows, PAD = 4 mod 32 (conflict-free)
  constexpr int KQ = BK / 4;                   // float4s per row and chunk
  constexpr int RSTEP = NTH / KQ;              // rows covered by one pass of the block's threads
  constexpr int WPASS = kTileBN / RSTEP;       // weight float4s per thread and chunk
  constexpr int XPASS = (BM + RSTEP - 1) / RSTEP;
  constexpr int COLS = SWI ? kTileBN / 2 : kTileBN;  // outputs per block
  constexpr int KQB = BK / 8;                  // BF: 16-byte pieces (8 weights) per row and chunk
  constexpr int RSTEPB = NTH / KQB;            // BF: rows per pass
  constexpr int WPASSB = kTileBN / RSTEPB;     // BF: weight pieces per thread and chunk
  extern __shared__ __align__(16) float smem[];
  float* const Ws = smem;                          // [ST][kTileBN][PAD]
  uint16_t* const Wsb = reinterpret_cast<uint16_t*>(smem);  // BF: [ST][kTileBN][kPadB]
  uint32_t* const Wsq = reinterpret_cast<uint32_t*>(smem);  // Q4: [ST][kTileBN][kTileRowQ4 / 4] words
  float* const Wsc = smem + ST * kTileBN * kTileRowQ4 / 4;      // Q4: [ST][kTileBN][2] scales
  float* const Xs = Q4   ? Wsc + ST * kTileBN * 2
                    : BF ? smem + ST * kTileBN * kPadB / 2
                         : smem + ST * kTileBN * PAD;  // [ST][BM][PAD]
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, q = lane & 3;
  const int warp = (tid >> 5) & 3, kh = (tid >> 5) >> 2;  // row group of 16; k part of the chunk (KH parts)
  const int tile = blockIdx.x;
  int nt, e, r0, rows;
  if constexpr (PRE) {
    pdl_trigger();
    // the schedule (two launches back, see PRE above), through L2: coherent loads
    nt = __ldcg(p.num_tiles), e = __ldcg(p.tile_expert + tile), r0 = __ldcg(p.tile_row0 + tile);  // pdl: pre-wait (schedule)
    if (tile >= nt || e < 0 || r0 < 0) {  // block-uniform
      pdl_wait();
      return;
    }
    rows = min(BM, __ldcg(p.offsets + e + 1) - r0);  // pdl: pre-wait (schedule)
  } else {
    if constexpr (SWI) {
      pdl_wait();     // the schedule and the input rows come from earlier kernels
      pdl_trigger();  // only now: the down projection that follows reads the schedule before its wait (PRE)
    } else {
      pdl_trigger();
      pdl_wait();  // the schedule and the input rows come from earlier kernels
    }
    nt = __ldg(p.num_tiles), e = __ldg(p.tile_expert + tile), r0 = __ldg(p.tile_row0 + tile);
    if (tile >= nt || e < 0 || r0 < 0) return;  // block-uniform
    rows = min(BM, __ldg(p.offsets + e + 1) - r0);
  }
  const int N = p.N, Kd = p.Kd, n0 = (int)blockIdx.y * COLS;
  const float* const W = p.w + (size_t)e * (SWI ? 2 : 1) * N * Kd;

  // this thread's copies per chunk: shared rows (tid / KQ) + RSTEP j at k offset 4 (tid % KQ).
  // Shared row r -> weight row: r (plain) or, SwiGLU, gate row r (r < 32) / up row N + r - 32,
  // offset by n0; rows past N zero-filled. Tile rows past `rows` zero-filled.
  const int kq = (tid % KQ) * 4, rbase = tid / KQ;
  const float* wsrc[WPASS];
  bool wok[WPASS];
#pragma unroll
  for (int j = 0; j < WPASS; ++j) {
    const int r = rbase + RSTEP * j;
    const int c = SWI ? (r & (COLS - 1)) : r;  // output column within the block
    wok[j] = n0 + c < N;
    wsrc[j] = wok[j] ? W + (size_t)((SWI && r >= COLS ? N : 0) + n0 + c) * Kd : p.w;
  }
  const int kqb = (tid % KQB) * 8, rbaseb = tid / KQB;  // BF: the weight copies' mapping
  size_t wsrcb[BF ? WPASSB : 1];
  bool wokb[BF ? WPASSB : 1];
  if constexpr (BF) {
#pragma unroll
    for (int j = 0; j < WPASSB; ++j) {
      const int r = rbaseb + RSTEPB * j;
      const int c = SWI ? (r & (COLS - 1)) : r;
      wokb[j] = n0 + c < N;
      wsrcb[j] = wokb[j] ? (size_t)e * (SWI ? 2 : 1) * N * Kd + (size_t)((SWI && r >= COLS ? N : 0) + n0 + c) * Kd : 0;
    }
  }
  // Q4: thread t < 128 copies half t % 2 (16 bytes: 32 k) of row t / 2's chunk and that half's scale
  const int rq = (tid >> 1) & (kTileBN - 1), hq = tid & 1;
  const bool qthr = tid < 2 * kTileBN;
  size_t wsrcq = 0;  // the row's first element in the stack (flat index, as the FP32 offsets)
  bool wokq = false;
  const int gshift = Q4 ? __ffs(p.int4_group) - 1 : 0;
  if constexpr (Q4) {
    const int c = SWI ? (rq & (COLS - 1)) : rq;
    wokq = qthr && n0 + c < N;
    wsrcq = wokq ? (size_t)e * (SWI ? 2 : 1) * N * Kd + (size_t)((SWI && rq >= COLS ? N : 0) + n0 + c) * Kd : 0;
  }
  const int nchunks = (Kd + BK - 1) / BK;
  auto load_w = [&](int c, int slot) {
    const int k = c * BK + kq;
    const bool kin = k < Kd;
    if constexpr (Q4) {
      if (qthr) {
        const int kq4 = c * BK + 32 * hq;
        const bool ok = wokq && kq4 < Kd;  // (Kd is a multiple of 32: a half is whole or absent)
        const size_t o = wsrcq + kq4;
        cp_async16(reinterpret_cast<float*>(Wsq + ((size_t)slot * kTileBN + rq) * (kTileRowQ4 / 4) + 4 * hq),
                   reinterpret_cast<const float*>(ok ? p.w_int4 + o / 2 : p.w_int4), ok);
        cp_async4(Wsc + ((size_t)slot * kTileBN + rq) * 2 + hq, ok ? p.w_scale + (o >> gshift) : p.w_scale, ok);
      }
    } else if constexpr (BF) {
      const int kb = c * BK + kqb;
#pragma unroll
      for (int j = 0; j < WPASSB; ++j) {
        const bool ok = wokb[j] && kb < Kd;
        cp_async16(reinterpret_cast<float*>(Wsb + ((size_t)slot * kTileBN + rbaseb + RSTEPB * j) * kPadB + kqb),
                   reinterpret_cast<const float*>(ok ? p.w_bf16 + wsrcb[j] + kb : p.w_bf16), ok);
      }
    } else {
#pragma unroll
      for (int j = 0; j < WPASS; ++j) {
        const bool ok = wok[j] && kin;
        cp_async16(Ws + ((size_t)slot * kTileBN + rbase + RSTEP * j) * PAD + kq, ok ? wsrc[j] + k : p.w, ok);  // pdl: pre-wait (weights)
      }
    }
  };
  if constexpr (PRE) {
#pragma unroll
    for (int s = 0; s < ST - 1; ++s)
      if (s < nchunks) load_w(s, s);
    pdl_wait();  // the input rows come from the previous kernel
  }
  const float* xsrc[XPASS];
  bool xok[XPASS];
#pragma unroll
  for (int j = 0; j < XPASS; ++j) {
    const int r = rbase + RSTEP * j;
    xok[j] = r < rows;
    xsrc[j] = p.x;
    if (xok[j]) xsrc[j] = p.x + (size_t)(p.x_row ? __ldg(p.x_row + r0 + r) : r0 + r) * p.ldx;
  }
  auto load_x = [&](int c, int slot) {
    const int k = c * BK + kq;
    const bool kin = k < Kd;
#pragma unroll
    for (int j = 0; j < XPASS; ++j) {
      if (rbase + RSTEP * j < BM) {
        const bool ok = xok[j] && kin;
        cp_async16(Xs + ((size_t)slot * BM + rbase + RSTEP * j) * PAD + kq, ok ? xsrc[j] + k : p.x, ok);
      }
    }
  };
  auto load = [&](int c, int slot) {
    load_w(c, slot);
    load_x(c, slot);
  };
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < nchunks) {
      if constexpr (PRE) load_x(s, s);  // (the weights went before the wait: in the first group)
      else load(s, s);
    }
    cp_async_commit();
  }
  float acc[TM][4], s1[TM][4], s2[TM][4];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = s1[i][j] = s2[i][j] = 0.f;
  for (int c = 0; c < nchunks; ++c) {
    cp_async_wait<ST - 2>();
    __syncthreads();  // chunk c visible to all; the slot of chunk c - 1 free again
    const int nxt = c + ST - 1;
    if (nxt < nchunks) load(nxt, nxt % ST);
    cp_async_commit();
    const float* xs = Xs + (size_t)(c % ST) * BM * PAD;
    constexpr int BKH = BK / KH;
    if constexpr (Q4) {
      mma_chunk_int4w<TM, BKH, PAD>(acc, s2, Wsq + (size_t)(c % ST) * kTileBN * (kTileRowQ4 / 4) + kh * BKH / 8,
                                    Wsc + (size_t)(c % ST) * kTileBN * 2, kh * BKH / 32, xs + kh * BKH, warp, g, q);
    } else if constexpr (BF) {
      mma_chunk_bf16w<TM, BKH, kPadB, PAD>(acc, s2, Wsb + (size_t)(c % ST) * kTileBN * kPadB + kh * BKH,
                                           xs + kh * BKH, warp, g, q);
    } else {
      const float* ws = Ws + (size_t)(c % ST) * kTileBN * PAD;
      mma_chunk_3xtf32<TM, BKH, PAD, true>(acc, s1, s2, ws + kh * BKH, xs + kh * BKH, warp, g, q);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every thread is done reading the stages
  float* const part = smem + kh * BM * kTileBN;  // [KH][BM][kTileBN]
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = acc[i][j] + (s1[i][j] + s2[i][j]);
    const int r = 16 * warp + g, t = 8 * i + 2 * q;
    part[t * kTileBN + r] = v[0];
    part[(t + 1) * kTileBN + r] = v[1];
    part[t * kTileBN + r + 8] = v[2];
    part[(t + 1) * kTileBN + r + 8] = v[3];
  }
  __syncthreads();
  for (int o = tid; o < BM * COLS; o += NTH) {
    const int t = o / COLS, c = o % COLS;
    if (t >= rows || n0 + c >= N) continue;
    float a = smem[t * kTileBN + c], u = SWI ? smem[t * kTileBN + COLS + c] : 0.f;
#pragma unroll
    for (int h = 1; h < KH; ++h) {  // the k parts in order
      a += smem[(h * BM + t) * kTileBN + c];
      if constexpr (SWI) u += smem[(h * BM + t) * kTileBN + COLS + c];
    }
    p.y[(size_t)(r0 + t) * p.ldy + n0 + c] = SWI ? silu_mul(a, u) : a;
  }
}

// Tiles of <= 16 slots (verify steps) run two warps per row group, each on half of every k-chunk
// (KH = 2, 256 threads): these grids hold ~2 blocks per SM (one block per expert and column block),
// and Nsight Compute on the H200 (T = 17, gate/up) showed 2 warps per scheduler issuing every 5.6
// cycles at 43 % of the DRAM peak. Twice the warps on the same chunks: in-step -0.2 to -3.6 % at
// T = 9-129 (twenty-sixth session, docs/BENCHMARKS.md). Prefill's 32 / 64-slot tiles keep KH = 1
// (not measured with two).
template <int BM, bool SWI, bool BF, bool Q4 = false, int KH = (BM <= 16 ? 2 : 1), bool PRE = false>
cudaError_t launch_mma_as(const ExpertGemmParams& p, cudaStream_t stream) {
  constexpr size_t q4_stages = (size_t)kStages * (kTileBN * (kTileRowQ4 + 2 * sizeof(float)) + (size_t)BM * (kBK + 4) * sizeof(float));
  constexpr size_t stages = Q4 ? q4_stages : tile_smem_bytes<BM, kBK, kStages, BF>();
  constexpr size_t smem = std::max(stages, (size_t)KH * BM * kTileBN * sizeof(float));
  auto kern = expert_mma_kernel<BM, SWI, BF, Q4, KH, PRE>;
  static const cudaError_t attr_err =
      cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (attr_err != cudaSuccess) return attr_err;
  constexpr int cols = SWI ? kTileBN / 2 : kTileBN;
  const dim3 grid((unsigned)p.max_tiles, (unsigned)((p.N + cols - 1) / cols));
  if (grid.y > 65535u) return cudaErrorInvalidValue;
  return launch_kernel(kern, grid, kThreads * KH, smem, stream, p);
}

// the BF16-weight kernel when the exact copy is there and its rows are whole 16-byte pieces
template <int BM, bool SWI>
cudaError_t launch_mma(const ExpertGemmParams& p, cudaStream_t stream) {
  if (p.w_int4) return launch_mma_as<BM, SWI, false, true>(p, stream);  // (expert_gemm_int4_ok checked)
  if (expert_gemm_mma_reads_bf16(p)) return launch_mma_as<BM, SWI, true>(p, stream);
  // the early weight copies (PRE) for the verify steps' tiles (<= 16 slots, where they were measured:
  // docs/BENCHMARKS.md "Sixty-second session"); prefill's larger tiles keep the plain order
  if constexpr (!SWI && BM <= 16)
    if (p.pdl_pre) return launch_mma_as<BM, SWI, false, false, 2, true>(p, stream);
  return launch_mma_as<BM, SWI, false>(p, stream);
}

}  // namespace

bool expert_gemm_mma_reads_bf16(const ExpertGemmParams& p) {
  return !p.w_int4 && p.w_bf16 && p.Kd % 8 == 0 && aligned16(p.w_bf16);
}

bool expert_mma_supported(const ExpertGemmParams& p) {
  return (p.tile_rows == 8 || p.tile_rows == 16 || p.tile_rows == 32 || p.tile_rows == 64) && p.Kd % 4 == 0 &&
         p.ldx % 4 == 0 && aligned16(p.x) && aligned16(p.w);
}

cudaError_t expert_gemm_mma(const ExpertGemmParams& p, cudaStream_t stream) {
  if (!p.x || !p.w || !p.offsets || !p.tile_expert || !p.tile_row0 || !p.num_tiles || !p.y || p.N <= 0 ||
      p.Kd <= 0 || p.ldx < p.Kd || p.ldy < p.N || p.max_tiles < 0 || !expert_mma_supported(p) ||
      (p.w_int4 && !expert_gemm_int4_ok(p)))
    return cudaErrorInvalidValue;
  if (p.max_tiles == 0) return cudaSuccess;
  switch (p.tile_rows) {
    case 8: return p.swiglu ? launch_mma<8, true>(p, stream) : launch_mma<8, false>(p, stream);
    case 16: return p.swiglu ? launch_mma<16, true>(p, stream) : launch_mma<16, false>(p, stream);
    case 32: return p.swiglu ? launch_mma<32, true>(p, stream) : launch_mma<32, false>(p, stream);
    default: return p.swiglu ? launch_mma<64, true>(p, stream) : launch_mma<64, false>(p, stream);
  }
}

}  // namespace cuda
}  // namespace kdtree
