// expert_mma.cu: the grouped expert GEMM of the MoE layers on the tensor cores (3xTF32,
// FP32-accurate), for tiles of 8 or 16 slots: verify steps of a few dozen tokens, where every
// expert gets a few rows. See model_kernels.h (expert_gemm_mma).
//
// Why: the GEMV-style kernel (model_kernels.cu, expert_gemv_kernel) keeps its weight loads in
// registers; a warp issues 16 float4 loads per lane, waits for them, multiplies and only then
// issues the next ones, and a block covers only 16 weight rows (a down-projection block reads
// 16 KB in one round trip). Nsight Compute on the H200 (mini-kimi verify of 17 tokens,
// docs/BENCHMARKS.md): gate/up at 33 % and down at 18 % of the DRAM peak. Here a block streams 64
// weight rows of one expert through shared memory with cp.async (kStages chunks of 32 floats in
// flight: 24-27 KB per block without registers) and multiplies them with the tile's slots, whose
// rows are gathered by slot with the same copies, on the tensor cores (tile_mma.h, the machinery
// of linear_tile). SwiGLU (gate rows [0, N), up rows [N, 2N) of each expert): a block takes 32
// gate rows and the 32 matching up rows and writes silu(gate) * up.
//
// Deterministic: per output the products are summed in ascending k by one warp's mma chain; the
// schedule (which slots a tile holds) comes from moe_group and does not depend on timing.
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

constexpr int kStages = 4;
constexpr int kThreads = 128;

template <int BM>
constexpr size_t mma_smem_bytes() {
  constexpr size_t stages = (size_t)kStages * (kTileBN + BM) * kTilePad * sizeof(float);
  constexpr size_t out = (size_t)BM * kTileBN * sizeof(float);
  return stages > out ? stages : out;
}

// grid (max_tiles, column blocks of 64 weight rows: 64 outputs, or 32 with SwiGLU), 128 threads.
template <int BM, bool SWI>
__global__ void __launch_bounds__(kThreads) expert_mma_kernel(ExpertGemmParams p) {
  constexpr int TM = BM / 8;
  constexpr int COLS = SWI ? kTileBN / 2 : kTileBN;  // outputs per block
  extern __shared__ __align__(16) float smem[];
  float* const Ws = smem;                                  // [kStages][kTileBN][kTilePad]
  float* const Xs = smem + kStages * kTileBN * kTilePad;   // [kStages][BM][kTilePad]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
  pdl_trigger();
  pdl_wait();  // the schedule and the input rows come from earlier kernels
  const int tile = blockIdx.x;
  const int nt = __ldg(p.num_tiles), e = __ldg(p.tile_expert + tile), r0 = __ldg(p.tile_row0 + tile);
  if (tile >= nt || e < 0 || r0 < 0) return;  // block-uniform
  const int rows = min(BM, __ldg(p.offsets + e + 1) - r0);
  const int N = p.N, Kd = p.Kd, n0 = (int)blockIdx.y * COLS;
  const float* const W = p.w + (size_t)e * (SWI ? 2 : 1) * N * Kd;

  // this thread's copies per chunk: weight rows (tid >> 3) + 16 j (j < 4) at k offset 4 (tid & 7);
  // tile row tid >> 3 of the slots (threads < 8 BM). Shared row r -> weight row: r (plain) or,
  // SwiGLU, gate row r (r < 32) / up row N + r - 32, all offset by n0; rows past N zero-filled.
  const int kq = (tid & 7) * 4;
  const float* wsrc[4];
  bool wok[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = (tid >> 3) + 16 * j;
    const int c = SWI ? (r & (COLS - 1)) : r;  // output column within the block
    wok[j] = n0 + c < N;
    const int wr = (SWI && r >= COLS ? N : 0) + n0 + c;
    wsrc[j] = wok[j] ? W + (size_t)wr * Kd : p.w;
  }
  const int xr = tid >> 3;
  const bool xload = xr < BM, xok = xr < rows;
  const float* xsrc = p.x;
  if (xok) {
    const int s = r0 + xr;
    xsrc = p.x + (size_t)(p.x_row ? __ldg(p.x_row + s) : s) * p.ldx;
  }
  const int nchunks = (Kd + kTileBK - 1) / kTileBK;
  auto load = [&](int c, int slot) {
    const int k = c * kTileBK + kq;
    const bool kin = k < Kd;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool ok = wok[j] && kin;
      cp_async16(Ws + ((size_t)slot * kTileBN + (tid >> 3) + 16 * j) * kTilePad + kq, ok ? wsrc[j] + k : p.w, ok);
    }
    if (xload) {
      const bool ok = xok && kin;
      cp_async16(Xs + ((size_t)slot * BM + xr) * kTilePad + kq, ok ? xsrc + k : p.x, ok);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nchunks) load(s, s);
    cp_async_commit();
  }
  float acc[TM][4];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  for (int c = 0; c < nchunks; ++c) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // chunk c visible to all; the slot of chunk c - 1 free again
    const int nxt = c + kStages - 1;
    if (nxt < nchunks) load(nxt, nxt % kStages);
    cp_async_commit();
    mma_chunk_3xtf32<TM>(acc, Ws + (size_t)(c % kStages) * kTileBN * kTilePad,
                         Xs + (size_t)(c % kStages) * BM * kTilePad, warp, g, q);
  }
  cp_async_wait<0>();
  __syncthreads();  // every thread is done reading the stages
  float* const part = smem;  // [BM][kTileBN]
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int r = 16 * warp + g, t = 8 * i + 2 * q;
    part[t * kTileBN + r] = acc[i][0];
    part[(t + 1) * kTileBN + r] = acc[i][1];
    part[t * kTileBN + r + 8] = acc[i][2];
    part[(t + 1) * kTileBN + r + 8] = acc[i][3];
  }
  __syncthreads();
  for (int o = tid; o < BM * COLS; o += kThreads) {
    const int t = o / COLS, c = o % COLS;
    if (t >= rows || n0 + c >= N) continue;
    const float v = SWI ? silu_mul(part[t * kTileBN + c], part[t * kTileBN + COLS + c]) : part[t * kTileBN + c];
    p.y[(size_t)(r0 + t) * p.ldy + n0 + c] = v;
  }
}

template <int BM, bool SWI>
cudaError_t launch_mma(const ExpertGemmParams& p, cudaStream_t stream) {
  constexpr size_t smem = mma_smem_bytes<BM>();
  static const cudaError_t attr_err =
      cudaFuncSetAttribute(expert_mma_kernel<BM, SWI>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (attr_err != cudaSuccess) return attr_err;
  constexpr int cols = SWI ? kTileBN / 2 : kTileBN;
  const dim3 grid((unsigned)p.max_tiles, (unsigned)((p.N + cols - 1) / cols));
  if (grid.y > 65535u) return cudaErrorInvalidValue;
  return launch_kernel(expert_mma_kernel<BM, SWI>, grid, kThreads, smem, stream, p);
}

}  // namespace

bool expert_mma_supported(const ExpertGemmParams& p) {
  return (p.tile_rows == 8 || p.tile_rows == 16) && p.Kd % 4 == 0 && p.ldx % 4 == 0 && aligned16(p.x) &&
         aligned16(p.w);
}

cudaError_t expert_gemm_mma(const ExpertGemmParams& p, cudaStream_t stream) {
  if (!p.x || !p.w || !p.offsets || !p.tile_expert || !p.tile_row0 || !p.num_tiles || !p.y || p.N <= 0 ||
      p.Kd <= 0 || p.ldx < p.Kd || p.ldy < p.N || p.max_tiles < 0 || !expert_mma_supported(p))
    return cudaErrorInvalidValue;
  if (p.max_tiles == 0) return cudaSuccess;
  if (p.tile_rows == 8) return p.swiglu ? launch_mma<8, true>(p, stream) : launch_mma<8, false>(p, stream);
  return p.swiglu ? launch_mma<16, true>(p, stream) : launch_mma<16, false>(p, stream);
}

}  // namespace cuda
}  // namespace kdtree
