// linear_tile.cu: the tiled linear layer for steps of a few to a few dozen tokens (tree verify;
// CudaModel routes 6-16 and 21-48-token steps here by default), see model_kernels.h (linear_tile).
//
// Why: linear_skinny (one warp streams a few weight rows, the token rows come through L1) is
// built for decode; Nsight Compute on the H200 (mini-kimi, T = 17, docs/CUDA_MODEL.md): it ran the
// projections at 4-13 % of the DRAM peak with 12-18 % occupancy (160-200 registers for 64
// accumulators) and ~60 % of the warp cycles waiting on L1 loads of the token rows, and cuBLAS
// was no better below ~33 tokens. Here the operands come through shared memory instead:
//   * a block owns a tile of BM token rows x kBN = 64 weight rows; each k-chunk of kBK = 64 floats
//     of both is copied to shared memory with cp.async (16-byte, L2 only), kStages = 3 chunks in
//     flight, so a block keeps ~35-65 KB of loads outstanding without registers for them; the
//     first chunks of the (immutable) weights are issued before the PDL wait, while the previous
//     kernel finishes; rows are padded to 68 floats (conflict-free fragment / float4 reads);
//   * 128 threads; the products on the tensor cores as 3xTF32 (FP32-accurate, below: warp w owns
//     weight rows [16 w, 16 w + 16) as the A operand, token groups of 8 are the B operands), the
//     three partial products of a k-step in three independent accumulators (hi*hi, lo*hi, hi*lo;
//     summed once at the end as big + (s1 + s2), as the expert GEMM does): with one warp per
//     scheduler (small grids) one accumulator chain made every mma wait for the one before it;
//     H200, twenty-fourth session: -3 to -14 % per call at 17-65 tokens, -1 to -3 % in the verify
//     step. Or, tile_math = 1, in FP32 on the CUDA cores (each thread a BM / 8 tokens x 4 rows tile);
//   * few output tiles (o_proj: 1024 rows = 16 tiles) would leave most SMs idle, so the k range is
//     split over a thread-block cluster of up to 8 blocks (Hopper); each block leaves its partial
//     tile in its shared memory and, after a cluster barrier, block r sums slice r of the tile over
//     the cluster's blocks through distributed shared memory, in rank order;
//   * a large matrix (the head) in one token tile runs 2 or 4 warps per row group (KH, 256 or 512
//     threads), each on its own part of every k-chunk, the parts added in order after the loop
//     (launch_rows; forty-fourth session: the head 9-13 % faster at 6-24 tokens).
// Deterministic: per output a thread sums its k range in ascending k (per accumulator), the partial tiles are added
// in split order; the split count is a function of the shape and the SM count only. Measured and
// routed in docs/BENCHMARKS.md ("Eighth session", "Ninth session"); what bounds it: docs/CUDA_MODEL.md.
#include <algorithm>
#include <cstdint>

#include <cooperative_groups.h>

#include "model_kernels.h"
#include "launch.h"
#include "model/tile_mma.h"
#include "model/vec_load.h"

namespace kdtree {
namespace cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kBN = kTileBN;       // weight rows (outputs) per tile
constexpr int kBK = 64;            // k floats per chunk (256-byte row segments; 32 measured 0-5 % slower in-step)
constexpr int kStages = 3;         // chunks in flight
constexpr int kPad = kBK + 4;      // shared row stride in floats (= 4 mod 32: conflict-free)
constexpr int KQ = kBK / 4;        // float4s per row and chunk
constexpr int kThreads = 128;       // 16 row groups x 8 token groups
constexpr int kMaxSplits = kLinearTileMaxSplits;  // a portable cluster size


// grid (splits, column tiles, batch x token tiles), cluster (splits, 1, 1); chunks_per_split
// k-chunks per split. TC: the products on the tensor cores (3xTF32, mma.sync m16n8k8: warp w owns
// weight rows [16 w, 16 w + 16) of the tile as the A operand, the BM / 8 token groups of 8 are B
// operands), else on the CUDA cores (thread = BM / 8 tokens x 4 rows).
constexpr int kPadB = kTilePadB<kBK>;  // BF: BF16 weight rows in shared memory (tile_mma.h)

// BF (with TC): the weights from the exact BF16 copy p.w_bf16 (Kd, w_batch multiples of 8): half the
// bytes copied, no split of the weights, two mma per product (tile_mma.h, mma_chunk_bf16w): the same sums.
template <int BM, bool TC, bool BF = false, int KH = 1>
__global__ void __launch_bounds__(kThreads * KH) linear_tile_kernel(LinearParams p, int chunks_per_split) {
  static_assert(!BF || TC, "BF16 weights on the tensor-core path only");
  static_assert(KH == 1 || (TC && (KH == 2 || KH == 4)), "k parts on the tensor-core path only");
  constexpr int NT = kThreads * KH;  // KH warps per row group, each on its own part of every chunk
  constexpr int TM = BM / 8;
  constexpr int RSTEP = NT / KQ;  // rows per pass of the block's copies
  constexpr int KQB = kBK / 8, RSTEPB = NT / KQB;  // BF: 16-byte pieces per row and chunk, rows per pass
  extern __shared__ __align__(16) float smem[];
  float* const Ws = smem;                              // [kStages][kBN][kPad]
  uint16_t* const Wsb = reinterpret_cast<uint16_t*>(smem);  // BF: [kStages][kBN][kPadB]
  float* const Xs = BF ? smem + kStages * kBN * kPadB / 2 : smem + kStages * kBN * kPad;  // [kStages][BM][kPad]
  const int tid = threadIdx.x, tn = tid & 15, tm = tid >> 4;
  const int lane = tid & 31, warp = (tid >> 5) & 3, g = lane >> 2, q = lane & 3;  // mma fragment coordinates
  const int kh = tid >> 7;  // the k part of every chunk this warp multiplies (KH parts)
  const int splits = (int)gridDim.x, split = (int)blockIdx.x;
  const int mtiles = (p.T + BM - 1) / BM;
  const int b = (int)blockIdx.z / mtiles, m0 = ((int)blockIdx.z % mtiles) * BM, n0 = (int)blockIdx.y * kBN;
  const int Kd = p.Kd, rows = min(BM, p.T - m0);
  const float* const W = p.w + (size_t)b * p.w_batch + (size_t)n0 * Kd;
  const uint16_t* const Wb = BF ? p.w_bf16 + (size_t)b * p.w_batch + (size_t)n0 * Kd : nullptr;
  const float* const X = p.x + (size_t)b * p.x_batch + (size_t)m0 * p.ldx;
  const int nchunks = (Kd + kBK - 1) / kBK;
  const int c0 = split * chunks_per_split, c1 = min(nchunks, c0 + chunks_per_split), nc = max(c1 - c0, 0);
  pdl_trigger();

  // this thread's copies of a chunk: weight float4 j: row (tid / KQ) + RSTEP j, k offset 4 (tid % KQ).
  // Each copy's source row pointer is formed once here (rows past the matrix point at row 0,
  // a valid address, and copy nothing), so a chunk's copy is the chunk's k added to it: the loop used
  // to form every address by a 64-bit product and a select against the base pointer (copy-loop SASS
  // of the 16 / 24 / 48 / 72-row tiles 172 / 195 / 333 / 378 -> 145 / 114 / 191 / 172 instructions;
  // H200, thirty-ninth session, graph-replayed mini-kimi steps: T = 17 / 65 -2.4 to -2.9 %).
  constexpr int WCP = kBN * kBK / 4 / NT, XCP = (BM * kBK / 4 + NT - 1) / NT;
  const float* wp[BF ? 1 : WCP];
  const float* xp[XCP];
  bool wok[BF ? 1 : WCP], xok[XCP];
  if constexpr (!BF) {
#pragma unroll
    for (int j = 0; j < WCP; ++j) {
      const int r = tid / KQ + RSTEP * j;
      wok[j] = n0 + r < p.N;
      wp[j] = W + (size_t)(wok[j] ? r : 0) * Kd + (tid % KQ) * 4;
    }
  }
#pragma unroll
  for (int j = 0; j < XCP; ++j) {
    const int r = tid / KQ + RSTEP * j;
    xok[j] = r < rows;
    xp[j] = X + (size_t)(xok[j] ? r : 0) * p.ldx + (tid % KQ) * 4;
  }
  auto load_w = [&](int c, int slot) {
    if constexpr (BF) {
      const int k = c * kBK + (tid % KQB) * 8;
#pragma unroll
      for (int j = 0; j < kBN * kBK / 8 / NT; ++j) {
        const int r = tid / KQB + RSTEPB * j;
        const bool ok = n0 + r < p.N && k < Kd;
        cp_async16(reinterpret_cast<float*>(Wsb + ((size_t)slot * kBN + r) * kPadB + (tid % KQB) * 8),
                   reinterpret_cast<const float*>(ok ? Wb + (size_t)r * Kd + k : p.w_bf16), ok);
      }
    } else {
      const bool kin = c * kBK + (tid % KQ) * 4 < Kd;
      const int k = kin ? c * kBK : 0;  // (k past the row: copies nothing)
      float* const ws = Ws + ((size_t)slot * kBN + tid / KQ) * kPad + (tid % KQ) * 4;
#pragma unroll
      for (int j = 0; j < WCP; ++j) cp_async16(ws + RSTEP * j * kPad, wp[j] + k, kin && wok[j]);
    }
  };
  auto load_x = [&](int c, int slot) {
    const bool kin = c * kBK + (tid % KQ) * 4 < Kd;
    const int k = kin ? c * kBK : 0;
    float* const xs = Xs + ((size_t)slot * BM + tid / KQ) * kPad + (tid % KQ) * 4;
#pragma unroll
    for (int j = 0; j < XCP; ++j)
      if (tid / KQ + RSTEP * j < BM) cp_async16(xs + RSTEP * j * kPad, xp[j] + k, kin && xok[j]);
  };
  // prologue: the weights of the first kStages - 1 chunks before the wait (immutable), then the
  // token rows; group s holds chunk s's x (and, for s = 0, all the early weights)
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s)
    if (s < nc) load_w(c0 + s, s);  // pdl: pre-wait (weights)
  pdl_wait();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nc) load_x(c0 + s, s);
    cp_async_commit();
  }

  // TC: acc[j] = the m16n8 fragment of token group j (c0 (row g, token 2q), c1 (g, 2q + 1), c2 (g + 8,
  // 2q), c3 (g + 8, 2q + 1)), hi*hi there, lo(w)*hi(x) in s1 and hi(w)*lo(x) in s2 (the same
  // fragments); else acc[i][j] = token tm + 8 i x row tn + 16 j
  float acc[TM][4], s1[TM][4], s2[TM][4];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = s1[i][j] = s2[i][j] = 0.f;
  for (int c = 0; c < nc; ++c) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // chunk c visible to all; the slot of chunk c - 1 free again
    const int nxt = c + kStages - 1;
    if (nxt < nc) {
      load_w(c0 + nxt, nxt % kStages);
      load_x(c0 + nxt, nxt % kStages);
    }
    cp_async_commit();
    const float* ws = Ws + (size_t)(c % kStages) * kBN * kPad;
    const float* xs = Xs + (size_t)(c % kStages) * BM * kPad;
    constexpr int BKH = kBK / KH;
    if constexpr (BF) {  // the FP32 path's chains: hi*hi, hi*lo (lo*hi = +0: s1 stays +0, not computed)
      mma_chunk_bf16w<TM, BKH, kPadB, kPad>(acc, s2, Wsb + (size_t)(c % kStages) * kBN * kPadB + kh * BKH,
                                            xs + kh * BKH, warp, g, q);
    } else if constexpr (TC) {
      mma_chunk_3xtf32<TM, BKH, kPad, true>(acc, s1, s2, ws + kh * BKH, xs + kh * BKH, warp, g, q);
    } else {
#pragma unroll
      for (int kk = 0; kk < kBK; kk += 4) {
        float4 wv[4], xv[TM];
#pragma unroll
        for (int j = 0; j < 4; ++j) wv[j] = *reinterpret_cast<const float4*>(ws + (tn + 16 * j) * kPad + kk);
#pragma unroll
        for (int i = 0; i < TM; ++i) xv[i] = *reinterpret_cast<const float4*>(xs + (tm + 8 * i) * kPad + kk);
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float a = acc[i][j];
            a = fmaf(xv[i].x, wv[j].x, a);
            a = fmaf(xv[i].y, wv[j].y, a);
            a = fmaf(xv[i].z, wv[j].z, a);
            acc[i][j] = fmaf(xv[i].w, wv[j].w, a);
          }
      }
    }
  }
  cp_async_wait<0>();
  if constexpr (TC) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = acc[i][j] + (s1[i][j] + s2[i][j]);
  }

  // the block's (partial) tile [BM tokens][kBN rows] in shared memory, then written out (one
  // split) or summed over the cluster's blocks in rank order, slice `split` of it by this block
  __syncthreads();  // every thread is done reading the stages
  constexpr int E = BM * kBN;
  float* const part = smem;
  {
    float* const mine = part + kh * E;  // k part kh's tile (KH > 1: added to part 0 below)
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      if constexpr (TC) {
        const int r = 16 * warp + g, t = 8 * i + 2 * q;
        mine[t * kBN + r] = acc[i][0];
        mine[(t + 1) * kBN + r] = acc[i][1];
        mine[t * kBN + r + 8] = acc[i][2];
        mine[(t + 1) * kBN + r + 8] = acc[i][3];
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) mine[(tm + 8 * i) * kBN + tn + 16 * j] = acc[i][j];
      }
    }
  }
  if constexpr (KH > 1) {  // the k parts in order, into part 0 (each element by one thread)
    __syncthreads();
    for (int e = tid; e < E; e += NT) {
      float s = part[e];
#pragma unroll
      for (int h = 1; h < KH; ++h) s += part[h * E + e];
      part[e] = s;
    }
  }
  float* const Y = p.y + (size_t)b * p.y_batch + (size_t)m0 * p.ldy + n0;
  if (splits == 1) {
    __syncthreads();
    for (int e = tid; e < E; e += NT) {
      const int m = e / kBN, n = e % kBN;
      if (m < rows && n0 + n < p.N) {
        float* out = Y + (size_t)m * p.ldy + n;
        *out = p.beta != 0.f ? fmaf(p.beta, *out, part[e]) : part[e];
      }
    }
    return;
  }
  // Block `split` sums slice `split` of the tile, in float4 units (4 outputs of one token row; kBN is a
  // multiple of 4): all the blocks' float4s of a unit are loaded first, then added in rank order, so a
  // thread waits for one distributed-shared-memory round trip per unit, not one per block and output
  // (the loads of a scalar loop could not pass its global stores).
  cg::cluster_group cluster = cg::this_cluster();
  // Publish the partial tiles to the cluster: a release fence restricted to this block's shared memory
  // (SASS: MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S), a relaxed arrival and an acquiring wait. cluster.sync()
  // did the same with a GPU-scope release (MEMBAR.ALL.GPU), which also waited for global stores this
  // block has no need to publish here (forty-eighth session: same bits, steps -0.5 to -2 %).
  asm volatile("fence.release.sync_restrict::shared::cta.cluster;\n" ::: "memory");
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  constexpr int E4 = E / 4;
  static_assert(kBN % 4 == 0, "a float4 unit stays within one token row");
  const int u0 = (int)((long long)E4 * split / splits), u1 = (int)((long long)E4 * (split + 1) / splits);
  for (int u = u0 + tid; u < u1; u += NT) {
    const int m = (4 * u) / kBN, n = (4 * u) % kBN;
    if (m >= rows || n0 + n >= p.N) continue;  // (no load whose value goes unused: see the barrier below)
    float4 v[kMaxSplits];
#pragma unroll
    for (int r = 0; r < kMaxSplits; ++r)
      if (r < splits) v[r] = reinterpret_cast<const float4*>(cluster.map_shared_rank(part, r))[u];
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int r = 0; r < kMaxSplits; ++r)
      if (r < splits) {
        s[0] += v[r].x;
        s[1] += v[r].y;
        s[2] += v[r].z;
        s[3] += v[r].w;
      }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (n0 + n + j >= p.N) break;
      float* out = Y + (size_t)m * p.ldy + n + j;
      *out = p.beta != 0.f ? fmaf(p.beta, *out, s[j]) : s[j];
    }
  }
  // No block leaves while another still reads its shared memory. A relaxed arrival: cluster.sync()'s
  // release ordering compiles to MEMBAR.ALL.GPU, which here waited for this thread's output stores to
  // reach L2 before the block could leave. The loads from the other blocks have returned by now (each
  // loaded float4 fed a store above), which is all this barrier has to protect.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}

template <int BM, bool TC, bool BF, int KH = 1>
cudaError_t launch_tile(const LinearParams& p, cudaStream_t stream) {
  constexpr size_t smem = std::max(tile_smem_bytes<BM, kBK, kStages, BF>(), (size_t)KH * BM * kBN * sizeof(float));
  static const cudaError_t attr_err =
      cudaFuncSetAttribute(linear_tile_kernel<BM, TC, BF, KH>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (attr_err != cudaSuccess) return attr_err;
  const long long mtiles = (p.T + BM - 1) / BM, ntiles = (p.N + kBN - 1) / kBN;
  // (row_exact: the split rule sees one token tile, so the split count, hence every output's order of
  // summation, does not depend on T)
  const long long base = ntiles * (p.row_exact ? 1 : mtiles) * p.batch;
  const int nchunks = (p.Kd + kBK - 1) / kBK;
  int splits = p.tile_splits;
  if (splits <= 0) {  // about two blocks per SM, each split at least two chunks
    const long long want = 2LL * num_sms();
    splits = (int)std::min<long long>(kMaxSplits, std::max<long long>(1, (want + base - 1) / base));
    splits = std::max(1, std::min(splits, nchunks / 2));
    // a grid that would fill less than half the SMs (few output tiles, short rows: the shared
    // expert's down projection, 16 tiles x 4 chunks) takes splits of one chunk, up to one block
    // per SM. H200, 1024 x 256 at T = 65: 2 splits 11.5 us, 4 splits 7.3 us
    // (bench_cuda_linear_tile.py --splits); grids of 128 blocks (W_UK, W_UV) were slower with more.
    if (base * splits * 2 < num_sms())
      splits = std::max<long long>(splits, std::min<long long>({(long long)kMaxSplits, (long long)nchunks,
                                                                 (num_sms() + base - 1) / base}));
    // a large matrix (>= 64 MB as FP32) in tiles of <= 24 token rows, where the rule above takes
    // one split (more than two tiles per SM), takes two when a block runs one warp per row group (KH = 1):
    // H200, mini-kimi's 131 MB lm_head (bench_cuda_linear_tile.py --splits 1 2 --only lm_head,
    // twenty-fourth session): T = 8 44.5 -> 42.2 us, T = 17 61.4 -> 54.1; in the step T = 17 / 24 -0.8 /
    // -0.9 %. Taller tiles (fewer blocks per SM) were slower with two: T = 33 72.9 -> 88.4, T = 65 96.2 ->
    // 113.4. With more warps per row group (KH = 4 on <= 16 rows, 2 on 24: the tensor-core path's large
    // matrices) one split is the faster: KH = 4 at T = 2-13, the head 36-43 us against 39-48 with two
    // splits and KH = 1 (forty-fourth session); KH = 2 at T = 17 / 18 / 20 / 24 44.9 / 45.2 / 45.8 / 46.9
    // against 47.7 / 48.2 / 48.7 / 49.9 with two, the step -0.2 / -0.4 / -0.4 % (forty-eighth session,
    // after the cluster barriers got cheaper).
    if (KH == 1 && splits == 1 && BM <= 24 && nchunks >= 4 && linear_weight_bytes(p) >= (64LL << 20)) splits = 2;
  }
  splits = std::min(splits, nchunks);
  const int cps = (nchunks + splits - 1) / splits;
  splits = (nchunks + cps - 1) / cps;  // no empty split
  if (ntiles > 65535 || base / ntiles > 65535) return cudaErrorInvalidValue;
  cudaLaunchAttribute attr[2];
  int na = 0;
  if (splits > 1) {
    attr[na].id = cudaLaunchAttributeClusterDimension;
    attr[na].val.clusterDim.x = (unsigned)splits;
    attr[na].val.clusterDim.y = 1;
    attr[na].val.clusterDim.z = 1;
    ++na;
  }
  if (pdl_enabled()) {
    attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[na].val.programmaticStreamSerializationAllowed = 1;
    ++na;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)splits, (unsigned)ntiles, (unsigned)(mtiles * p.batch));
  cfg.blockDim = dim3(kThreads * KH);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = (unsigned)na;
  return cudaLaunchKernelEx(&cfg, linear_tile_kernel<BM, TC, BF, KH>, p, cps);
}

}  // namespace

long long linear_weight_bytes(const LinearParams& p) { return (long long)p.N * p.Kd * p.batch * 4; }

bool linear_tile_reads_bf16(const LinearParams& p) {
  return p.tile_math == 0 && p.w_bf16 && p.Kd % 8 == 0 && p.w_batch % 8 == 0 && aligned16(p.w_bf16);
}

bool linear_tile_supported(const LinearParams& p) {
  return !p.norm_w && !p.x_swiglu && !p.norm_out && p.Kd % 4 == 0 && p.ldx % 4 == 0 && p.x_batch % 4 == 0 &&
         p.w_batch % 4 == 0 && aligned16(p.x) && aligned16(p.w);
}

// Token rows per tile. A matrix that stays in L2 through the call (<= 32 MB as FP32: every
// projection of mini-kimi but the head) takes several small tiles: 16 rows up to 32 tokens, 24 rows
// for 33-72 tokens. More blocks, so more warps per SM to hide the mma chains' latency (these
// grids are latency-bound, docs/CUDA_MODEL.md); each tile re-reads the weights, from L2. H200,
// twenty-fifth session (docs/BENCHMARKS.md): per call at T = 65 q_b 12.7 -> 9.4 us, W_UK 9.5 -> 7.0,
// router + shared 8.8 -> 6.2; in the verify step T = 17 / 33 / 65 -2.1 / -5.9 / -7.8 % at context
// 512 against one tile holding the step. Larger matrices (the head: 131 MB) keep one tile for the
// step, the smallest height that holds it (a second tile would re-read them from HBM), so a
// 65-token step runs one 72-row tile instead of a 64-row and a 1-row one; past 72 tokens (cuBLAS's
// range for them in CudaModel) they take tiles of 64. The small matrices keep 24-row tiles at any
// token count (CudaModel runs them here up to 264 tokens).
int linear_tile_rows(int T, long long wbytes) {
  if (wbytes <= kLinearTileSmallBytes && T > 8) return T <= 32 ? 16 : 24;
  const int one = linear_tile_one_tile_rows(T);
  return one > 0 ? one : 64;
}

int linear_tile_one_tile_rows(int T) {
  return T <= 8 ? 8 : T <= 16 ? 16 : T <= 24 ? 24 : T <= 32 ? 32 : T <= 48 ? 48 : T <= 64 ? 64 : T <= 72 ? 72 : 0;
}

namespace {
bool tile_height_ok(int rows) {
  return rows == 8 || rows == 16 || rows == 24 || rows == 32 || rows == 48 || rows == 64 || rows == 72;
}
}  // namespace

// Large matrices (past kLinearTileSmallBytes: the head), streamed once from HBM in one token tile of
// a long k loop, run more warps per row group, each on its own part of every k-chunk: KH = 4 for
// tiles of <= 16 rows (one k split: 16 warps a block already cover the chunk), KH = 2 for 24 rows (the
// automatic two splits). H200, mini-kimi's 131 MB head (bench_cuda_linear_tile.py --only lm_head,
// forty-fourth session): T = 6 / 9 / 13 / 16 / 17 / 20 / 24 40.7 / 47.1 / 48.4 / 49.2 / 52.8 / 53.8 /
// 55.4 -> 38.2 / 41.0 / 43.2 / 43.8 / 47.7 / 48.4 / 49.8 us; KH = 4 for 24 rows (512 threads of 81
// registers: one block an SM) 55-56 us; KH = 2 for 32 rows no change; two warps per row group on the
// small matrices (the attention side's projections, latency-bound grids of 2-4 chunks a block) 0.4-0.9 us
// slower each. The k parts are added in order after the loop: other bits than KH = 1, as deterministic.
template <bool TC, bool BF = false>
cudaError_t launch_rows(const LinearParams& p, cudaStream_t stream) {
  const int rows = p.row_exact ? kLinearTileExactRows
                   : p.tile_rows ? p.tile_rows
                                 : linear_tile_rows(p.T, linear_weight_bytes(p));
  if constexpr (TC) {
    if (linear_weight_bytes(p) > kLinearTileSmallBytes) {
      switch (rows) {
        case 8: return launch_tile<8, TC, BF, 4>(p, stream);
        case 16: return launch_tile<16, TC, BF, 4>(p, stream);
        case 24: return launch_tile<24, TC, BF, 2>(p, stream);
        default: break;
      }
    }
  }
  switch (rows) {
    case 8: return launch_tile<8, TC, BF>(p, stream);
    case 16: return launch_tile<16, TC, BF>(p, stream);
    case 24: return launch_tile<24, TC, BF>(p, stream);
    case 32: return launch_tile<32, TC, BF>(p, stream);
    case 48: return launch_tile<48, TC, BF>(p, stream);
    case 64: return launch_tile<64, TC, BF>(p, stream);
    case 72: return launch_tile<72, TC, BF>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t linear_tile(const LinearParams& p, cudaStream_t stream) {
  if (!p.x || !p.w || !p.y || p.T < 0 || p.N <= 0 || p.Kd <= 0 || p.batch <= 0 || p.ldx < p.Kd || p.ldy < p.N ||
      p.x_batch < 0 || p.w_batch < 0 || p.y_batch < 0 || p.tile_splits < 0 || p.tile_splits > kMaxSplits ||
      p.tile_math < 0 || p.tile_math > 1 ||
      (p.tile_rows != 0 && !tile_height_ok(p.tile_rows)) ||
      !linear_tile_supported(p))
    return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  if (p.tile_math == 1) return launch_rows<false>(p, stream);
  if (linear_tile_reads_bf16(p)) return launch_rows<true, true>(p, stream);
  return launch_rows<true>(p, stream);
}

}  // namespace cuda
}  // namespace kdtree
