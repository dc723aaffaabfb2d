// verify_attention_mma.cu: MLA tree-verify attention on the tensor cores, FP32-accurate (3xTF32).
//
// The same problem as the CUDA-core kernels of verify_attention.cu (absorbed MLA: the T*H query
// rows share one latent K/V row of C + R = 576 floats per key, so it is one MQA problem,
// S = Q K^T, online softmax, O = P V with V = the first C = 512 columns of the key rows), split
// like the split-KV kernel (grid = row groups x key splits over contiguous 32-key chunks, the
// same partial layout and combine kernel, the same masks, L from device memory when p.L_dev is
// set), but both products run as mma.sync m16n8k8 TF32 with each FP32 operand split into
// hi + lo (tile_mma.h): a product is hi*hi + hi*lo + lo*hi, ~2^-22 of it dropped, FP32 sums.
//
// A block: 256 threads (8 warps), RM = 32 query rows (row m = node * H + head), one block per SM
// (190 KB of shared memory: Q 32 x 580, one key chunk 32 x 580, the partial scores). A last row
// block of at most 16 rows runs one m-tile (MT2 = 1: ~60 % of the work per chunk) and may take
// fewer key splits than the others (launch_verify_mma). Per 32-key chunk:
//  * the chunk's 32 key rows land in shared memory in three cp.async groups; group r holds the
//    24-column slabs 3 w + r of every warp w, so each warp starts on its own columns as soon as the
//    first group is in (and the next chunk's rows are prefetched into L2);
//  * phase 1, S = Q K^T: warp w computes all 32 rows (two m-tiles) x all 32 keys (four n-tiles)
//    over its 72 columns [72 w, 72 w + 72), so every Q and K element is split into hi + lo once per
//    chunk. hi*hi goes to one accumulator, the two cross terms to another (independent mma
//    chains, added in FP32 at the end); the eight k-parts are added in shared memory in a fixed
//    pairwise order;
//  * phase 2: 8 threads per row mask the 32 scores (key < L: visible; L <= key < L + T: the
//    node's bitmask; beyond: none) and run the online softmax in the log2 domain (the split-KV
//    kernel's formulas), P to shared memory;
//  * phase 3, O = alpha O + P V: warp w owns all 32 rows x columns [64 w, 64 w + 64), in two
//    passes of four 8-column n-tiles; k = the 32 keys. The k index of each 8-key step is permuted
//    (slot q <-> key 2q, slot q + 4 <-> key 2q + 1), so P's A fragment is two float2 loads and V's
//    B fragment reads are bank-conflict free (rows 580 floats apart). The chunk's product goes to
//    a fresh accumulator that is then added to O with CUDA-core FMAs (O = alpha O + chunk), so a
//    tensor-core accumulation chain is one chunk long, whatever L is.
// A chunk that no row of the block sees (tree region) is skipped whole, which is exact.
// Measured (H200, docs/BENCHMARKS.md): first issue-bound on the hi/lo splits (ncu, first version:
// 2 warps per scheduler issuing every 3.9 cycles; the SASS showed cvt.rna.tf32.f32 emulated in four
// instructions plus an inf test). Taking all 32 rows per warp (each K / V element split once per
// chunk, not twice) gained ~5 %; tile_mma.h's split in three instructions (cvt.rn + a truncated
// remainder, twentieth session) 10-14 % over the seven of the integer rounding with its NaN guard;
// since then latency-bound (ncu, T = 17, H = 16, L = 4096: an instruction every 6.1 cycles per warp,
// 0.43 eligible warps per scheduler). 16 warps per block (128 registers) lost 5-8 %; the next
// chunk's first group in a buffer of its own, issued during phases 2 and 3, lost 5-6 %.
// Thirty-eighth session: the key copies' addresses as offsets from the chunk's first row (mv_load_group):
// 2.7-4.3 % (ncu had 1.9 of 7.6 cycles per instruction waiting for instruction fetch). Thirty-ninth
// session: mv_block<2> from one call site (SASS 6216 -> 4040 instructions): equal time within 0.5 %
// (T = 1, H = 128, L = 512 -2 %); kept for the smaller code, the instruction-fetch stalls did not
// turn into time.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"
#include "launch.h"
#include "model/tile_mma.h"
#include "verify_attention_common.h"
#include "verify_attention_mma.h"

namespace kdtree {
namespace cuda {
namespace {

namespace mv {
constexpr int C = 512, R = 64, DQ = C + R;
constexpr int RM = 32;       // query rows per block
constexpr int KC = 32;       // keys per chunk
constexpr int NW = 8;        // warps per block
constexpr int NT = 32 * NW;  // threads per block
constexpr int QS = DQ + 4;   // 580 floats per Q / K row in shared memory (4 banks apart)
constexpr int PS = KC + 8;   // 40 floats per score / P row (8 banks apart: float2 fragments conflict-free)
constexpr int NGRP = 3;      // cp.async groups per chunk (a k-part = 3 slabs)
constexpr int TPR = NT / RM; // phase 2: threads per row (8)
constexpr int KPT = KC / TPR;  // ... and keys per thread (4)
constexpr float kLog2e = 1.4426950408889634f;
constexpr int KP = NW;        // k-parts (phase 1) = column parts (phase 3): one per warp
constexpr int SLAB = DQ / (KP * NGRP);  // 24 columns of one k-part in one cp.async group
constexpr int CQ = C / KP;    // phase 3: 64 output columns per warp
constexpr int NJ = CQ / 8;    // ... in 8 n-tiles
static_assert(KP * NGRP * SLAB == DQ && SLAB % 8 == 0, "slabs cover the key row in whole k-steps");
}  // namespace mv

struct __align__(16) MvSmem {
  float q[mv::RM][mv::QS];
  float k[mv::KC][mv::QS];
  float ps[mv::KP][mv::RM][mv::PS];  // phase-1 partial scores of the k-parts
  float p[mv::RM][mv::PS];           // the chunk's probabilities
  float m[mv::RM], l[mv::RM], alpha[mv::RM];
};

// wait until at most n (0..3) cp.async groups are pending (block-uniform n)
__device__ __forceinline__ void mv_wait_le(int n) {
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    default: cp_async_wait<3>(); break;
  }
}

// The key rows kbase .. kbase + KC - 1 of cp.async group r, warp w's slab NGRP w + r (the columns
// its phase 1 reads) -> their columns of s.k (rows past N zero-filled). Each warp copies only its own
// slabs, so phase 1 waits for its own copies (cp.async.wait_group + __syncwarp), not the block's.
// Lane mapping: copy i of lane l is piece (l + 32 i) % 6 of row (l + 32 i) / 6, so consecutive lanes
// read consecutive 16-byte pieces of a row (an instruction covers ~5 rows' 96-byte slabs, the fewest
// 128-byte lines; a mapping with 16 rows of 32 bytes per instruction, cheaper to address, made the
// chunk loop 2-7 % slower, thirty-eighth session). The addresses are 32-bit offsets from the chunk's
// first row (the first version formed each one by a 64-bit product and a select against the base
// pointer: ~300 SASS instructions a chunk per warp for 18 copies).
__device__ __forceinline__ void mv_load_group(const VerifyAttentionParams& p, MvSmem& s, int r, int kbase, int N,
                                              int warp, int lane) {
  using namespace mv;
  const float* base = p.kv + (size_t)kbase * p.kv_stride;  // row kbase < N: a valid address
  const int rows = N - kbase;                               // rows of the chunk that exist (> 0)
#pragma unroll
  for (int i = 0; i < (KC * SLAB / 4) / 32; ++i) {
    const int idx = lane + 32 * i;
    const int kk = idx / (SLAB / 4), f = idx % (SLAB / 4);
    const int col = (NGRP * warp + r) * SLAB + 4 * f;
    const bool ok = kk < rows;
    cp_async16(&s.k[kk][col], base + ((ok ? kk : 0) * p.kv_stride + col), ok);
  }
}

// One block: query rows [m0, m0 + 32) (MT2 m-tiles of 16 of them carry rows: 2, or 1 when rows m0 + 16 ..
// are all past M) against the key chunks of split `split` of `nsplit`; the partials go to slot
// `split` of `nslots` (a block of split 0 also marks slots nsplit .. nslots - 1 of its rows empty).
template <int MT2>
__device__ __forceinline__ void mv_block(const VerifyAttentionParams& p, MvSmem& s, int m0, int split, int nsplit,
                                         int nslots) {
  using namespace mv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, q = lane & 3;     // mma fragment coordinates
  const int wq = warp;                       // k-part (phase 1) / column part (phase 3)
  const int M = p.T * p.H;
  if (!p.committed_ready) pdl_wait();  // *L_dev may come from the previous kernel (waiting twice is free)
  const int L = attn_committed_len(p);  // pdl: pre-wait (committed_ready: *L_dev was set before the step)
  const int N = L + p.T;
  const int nch = (N + KC - 1) / KC;
  const int cps = (nch + nsplit - 1) / nsplit;
  const int c0 = min(split * cps, nch), c1 = min(c0 + cps, nch);
  // phase 2 mapping: row pr, keys KPT pq .. KPT pq + KPT - 1 of each chunk (rows 16 .. 31 of a
  // one-m-tile block are past M: whole warps 4 .. 7, which skip the partial-score reads)
  const int pr = tid / TPR, pq = tid % TPR;
  const bool prow = MT2 == 2 || pr < 16;
  const int node2 = m0 + pr < M ? (m0 + pr) / p.H : -1;
  const int ra = g;  // the fragment rows of m-tile mt: ra + 16 mt and ra + 16 mt + 8 (block-local)

  // The first chunk's keys before the PDL wait when they are committed rows complete before the
  // step began (committed_ready; as in the split-KV kernel), in one cp.async group before Q's.
  const bool pre = p.committed_ready && c0 < c1 && (c0 + 1) * KC <= L;
  if (pre) {
#pragma unroll
    for (int r = 0; r < NGRP; ++r) mv_load_group(p, s, r, c0 * KC, N, warp, lane);  // pdl: pre-wait (committed rows)
    cp_async_commit();
  }
  pdl_wait();
  const float sl2 = (node2 >= 0 ? attn_row_scale(p, m0 + pr) : p.scale) * kLog2e;  // (q_scale: after the wait)

  if (tid < RM) {
    s.m[tid] = attn_neg_inf();
    s.l[tid] = 0.f;
  }
  if (c0 < c1) {  // Q rows [m0, m0 + 16 MT2) -> shared (rows past M zero), one group ahead of the chunks;
    // warp w copies its k-part's columns [NGRP SLAB w, + NGRP SLAB), the ones its phase 1 reads
    constexpr int QW = NGRP * SLAB / 4;  // float4 per row of one k-part (18)
    for (int i = lane; i < 16 * MT2 * QW; i += 32) {
      const int r = i / QW, d = NGRP * SLAB * warp + (i % QW) * 4, gm = m0 + r;
      const bool ok = gm < M;
      const int g = ok ? gm : 0;  // (row 0 when zero-filled: never read)
      cp_async16(&s.q[r][d], d < C ? p.q_latent + (g * C + d) : p.q_rope + (g * R + (d - C)), ok);
    }
    cp_async_commit();
  }
  __syncthreads();

  float O[MT2][NJ][4];
#pragma unroll
  for (int mt = 0; mt < MT2; ++mt)
#pragma unroll
    for (int j = 0; j < NJ; ++j) O[mt][j][0] = O[mt][j][1] = O[mt][j][2] = O[mt][j][3] = 0.f;

  for (int ch = c0; ch < c1; ++ch) {
    const int kbase = ch * KC;
    // reaches the tree rows: skip the chunk if no row of the block sees any key
    if (kbase + KC > L && !__syncthreads_or(attn_sees_any<KPT>(p, L, N, node2, kbase, KPT * pq))) continue;
    const bool loaded = pre && ch == c0;  // issued before the PDL wait (one group, before Q's)
    // ---- the chunk's key rows -> shared, three groups
    if (!loaded) {
#pragma unroll
      for (int r = 0; r < NGRP; ++r) {
        mv_load_group(p, s, r, kbase, N, warp, lane);
        cp_async_commit();
      }
    }
    if (ch + 1 < c1)  // L2 prefetch of the next chunk's rows
      attn_prefetch_rows_l2<NT / KC, DQ>(p.kv, p.kv_stride, kbase + KC + tid / (NT / KC), N, tid % (NT / KC));
    // ---------------- phase 1: partial S over this warp's k-part, 3xTF32 (hi*hi to big, the
    // two cross terms to small: independent chains, summed in FP32 at the end)
    {
      float big[MT2][4][4], small[MT2][4][4];
#pragma unroll
      for (int mt = 0; mt < MT2; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) big[mt][j][e] = small[mt][j][e] = 0.f;
      for (int r = 0; r < NGRP; ++r) {
        mv_wait_le(loaded ? 0 : NGRP - 1 - r);  // preloaded: Q's group came last, wait for all
        __syncwarp();  // the warp's own copies (Q's and the key slab's columns) visible to all its lanes
        const int d0 = (NGRP * wq + r) * SLAB;
#pragma unroll
        for (int kk = 0; kk < SLAB; kk += 8) {
          uint32_t ah[MT2][4], al[MT2][4];
#pragma unroll
          for (int mt = 0; mt < MT2; ++mt) {
            const float* qa = &s.q[ra + 16 * mt][d0 + kk + q];
            split_tf32(qa[0], ah[mt][0], al[mt][0]);
            split_tf32(qa[8 * QS], ah[mt][1], al[mt][1]);
            split_tf32(qa[4], ah[mt][2], al[mt][2]);
            split_tf32(qa[8 * QS + 4], ah[mt][3], al[mt][3]);
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float* kb = &s.k[8 * j + g][d0 + kk + q];
            uint32_t bh[2], bl[2];
            split_tf32(kb[0], bh[0], bl[0]);
            split_tf32(kb[4], bh[1], bl[1]);
#pragma unroll
            for (int mt = 0; mt < MT2; ++mt) {
              mma_tf32(small[mt][j], al[mt], bh);
              mma_tf32(small[mt][j], ah[mt], bl);
              mma_tf32(big[mt][j], ah[mt], bh);
            }
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT2; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int row = ra + 16 * mt;
          *reinterpret_cast<float2*>(&s.ps[wq][row][8 * j + 2 * q]) =
              make_float2(big[mt][j][0] + small[mt][j][0], big[mt][j][1] + small[mt][j][1]);
          *reinterpret_cast<float2*>(&s.ps[wq][row + 8][8 * j + 2 * q]) =
              make_float2(big[mt][j][2] + small[mt][j][2], big[mt][j][3] + small[mt][j][3]);
        }
    }
    __syncthreads();
    // ---------------- phase 2: k-parts summed, mask + online softmax (log2 domain), 8 threads per row
    {
      float v[KPT];
      {
        float part[KP][KPT];
#pragma unroll
        for (int k = 0; k < KP; ++k) {
          const float4 x = prow ? *reinterpret_cast<const float4*>(&s.ps[k][pr][KPT * pq]) : make_float4(0.f, 0.f, 0.f, 0.f);
          part[k][0] = x.x;
          part[k][1] = x.y;
          part[k][2] = x.z;
          part[k][3] = x.w;
        }
#pragma unroll
        for (int w = 1; w < KP; w *= 2)  // pairwise, fixed order: ((p0 + p1) + (p2 + p3)) + ...
#pragma unroll
          for (int k = 0; k < KP; k += 2 * w)
#pragma unroll
            for (int e = 0; e < KPT; ++e) part[k][e] += part[k + w][e];
#pragma unroll
        for (int e = 0; e < KPT; ++e) v[e] = part[0][e];
      }
      float mo, sum;
      const float mn = attn_softmax_exp<KPT, TPR>(p, L, N, node2, kbase, KPT * pq, sl2, v, s.m[pr], mo, sum);
      *reinterpret_cast<float4*>(&s.p[pr][KPT * pq]) = make_float4(v[0], v[1], v[2], v[3]);
      attn_softmax_commit<TPR>(sum, mo, mn, pq == 0, s.m[pr], s.l[pr], s.alpha[pr]);
    }
    __syncthreads();
    // ---------------- phase 3: chunk = P V (this warp's rows x columns CQ wq ..), O = alpha O + chunk.
    // In NPASS column passes of NJ / NPASS n-tiles each, so the chunk's accumulator stays at 32
    // registers (P's fragments are re-read and re-split per pass: 8 values per k-step).
    constexpr int NPASS = 2;
#pragma unroll
    for (int jp = 0; jp < NPASS; ++jp) {
      constexpr int NJP = NJ / NPASS;
      float oc[MT2][NJP][4];
#pragma unroll
      for (int mt = 0; mt < MT2; ++mt)
#pragma unroll
        for (int j = 0; j < NJP; ++j) oc[mt][j][0] = oc[mt][j][1] = oc[mt][j][2] = oc[mt][j][3] = 0.f;
#pragma unroll 1  // unrolled: 255 registers and spills
      for (int kk = 0; kk < KC; kk += 8) {
        uint32_t ah[MT2][4], al[MT2][4];
#pragma unroll
        for (int mt = 0; mt < MT2; ++mt) {
          const float2 x = *reinterpret_cast<const float2*>(&s.p[ra + 16 * mt][kk + 2 * q]);
          const float2 y = *reinterpret_cast<const float2*>(&s.p[ra + 16 * mt + 8][kk + 2 * q]);
          split_tf32(x.x, ah[mt][0], al[mt][0]);  // slot q     <-> key kk + 2q
          split_tf32(y.x, ah[mt][1], al[mt][1]);
          split_tf32(x.y, ah[mt][2], al[mt][2]);  // slot q + 4 <-> key kk + 2q + 1
          split_tf32(y.y, ah[mt][3], al[mt][3]);
        }
        const float* v0 = &s.k[kk + 2 * q][CQ * wq + 8 * NJP * jp + g];
#pragma unroll
        for (int j = 0; j < NJP; ++j) {
          uint32_t bh[2], bl[2];
          split_tf32(v0[8 * j], bh[0], bl[0]);
          split_tf32(v0[QS + 8 * j], bh[1], bl[1]);
#pragma unroll
          for (int mt = 0; mt < MT2; ++mt) {
            mma_tf32(oc[mt][j], al[mt], bh);
            mma_tf32(oc[mt][j], ah[mt], bl);
            mma_tf32(oc[mt][j], ah[mt], bh);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT2; ++mt) {
        const float a0 = s.alpha[ra + 16 * mt], a1 = s.alpha[ra + 16 * mt + 8];
#pragma unroll
        for (int j = 0; j < NJP; ++j) {
          float* o = O[mt][NJP * jp + j];
          o[0] = fmaf(o[0], a0, oc[mt][j][0]);
          o[1] = fmaf(o[1], a0, oc[mt][j][1]);
          o[2] = fmaf(o[2], a1, oc[mt][j][2]);
          o[3] = fmaf(o[3], a1, oc[mt][j][3]);
        }
      }
    }
    __syncthreads();  // the key rows and P are free for the next chunk
  }
  cp_async_wait<0>();

  // ---------------- epilogue: normalised output (one slot) or partials for the combine
  const bool final_out = nslots == 1;
  float* wso = (float*)p.workspace;
  float* wsml = wso + (size_t)nslots * M * C;
#pragma unroll
  for (int mt = 0; mt < MT2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int lr = ra + 16 * mt + 8 * h, gm = m0 + lr;
      if (gm >= M) continue;
      const float l = s.l[lr];
      const float inv = final_out ? (l > 0.f ? 1.f / l : 0.f) : 1.f;
      float* dst = (final_out ? p.out + (size_t)gm * C : wso + ((size_t)split * M + gm) * C) + CQ * wq + 2 * q;
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(O[mt][j][2 * h] * inv, O[mt][j][2 * h + 1] * inv);
    }
  if (!final_out && tid < RM && m0 + tid < M) {
    const int gm = m0 + tid;
    wsml[((size_t)split * M + gm) * 2 + 0] = s.m[tid];
    wsml[((size_t)split * M + gm) * 2 + 1] = s.l[tid];
    if (split == 0)  // slots this row block has no split for: empty (max -inf: the combine reads no O there)
      for (int sp = nsplit; sp < nslots; ++sp) {
        wsml[((size_t)sp * M + gm) * 2 + 0] = attn_neg_inf();
        wsml[((size_t)sp * M + gm) * 2 + 1] = 0.f;
      }
  }
}

// grid: (row blocks - 1) x s_full blocks for the full row blocks (split = b % s_full), then s_last
// blocks for the last row block; its rows get s_last of the max(s_full, s_last) partial slots. A
// last row block with at most 16 rows runs one m-tile (MT2 = 1): about 60 % of a full block's time.
__global__ void __launch_bounds__(mv::NT, 1) mla_verify_mma_kernel(VerifyAttentionParams p, int s_full, int s_last) {
  pdl_trigger();
  using namespace mv;
  extern __shared__ __align__(16) unsigned char mv_smraw[];
  MvSmem& s = *reinterpret_cast<MvSmem*>(mv_smraw);
  const int M = p.T * p.H;
  const int rg = (M + RM - 1) / RM;
  const int b = blockIdx.x, nfull = (rg - 1) * s_full;
  const int nslots = s_full > s_last ? s_full : s_last;
  // one call site per instantiation (the kernel's code is ~25 KB per copy of the chunk loop; two
  // inlined copies of mv_block<2> doubled it)
  const bool full = b < nfull;
  const int m0 = full ? (b / s_full) * RM : (rg - 1) * RM;
  const int split = full ? b % s_full : b - nfull, nsplit = full ? s_full : s_last;
  if (!full && M - m0 <= 16)
    mv_block<1>(p, s, m0, split, nsplit, nslots);
  else
    mv_block<2>(p, s, m0, split, nsplit, nslots);
}

}  // namespace

namespace {
__global__ void tf32_split_kernel(const float* x, uint32_t* hi, uint32_t* lo, int n) {
  pdl_prologue();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) split_tf32(x[i], hi[i], lo[i]);
}
}  // namespace

cudaError_t tf32_split(const float* x, uint32_t* hi, uint32_t* lo, int n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  return launch_kernel(tf32_split_kernel, std::min((n + 255) / 256, 4096), 256, 0, stream, x, hi, lo, n);
}

int verify_mma_rows() { return mv::RM; }
int verify_mma_chunk() { return mv::KC; }

bool verify_mma_ready() {
  static int state = 0;
  if (state == 0) {
    cudaError_t e = cudaFuncSetAttribute(mla_verify_mma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)sizeof(MvSmem));
    if (e == cudaSuccess &&
        cudaFuncSetAttribute(mla_verify_mma_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100) != cudaSuccess)
      cudaGetLastError();  // only a hint
    if (e != cudaSuccess) cudaGetLastError();
    state = e == cudaSuccess ? 1 : -1;
  }
  return state == 1;
}

cudaError_t launch_verify_mma(const VerifyAttentionParams& p, int s_full, int s_last, cudaStream_t stream) {
  const int M = p.T * p.H;
  const int rg = (M + mv::RM - 1) / mv::RM;
  return launch_kernel(mla_verify_mma_kernel, dim3((rg - 1) * s_full + s_last), mv::NT, sizeof(MvSmem), stream, p, s_full,
                       s_last);
}

}  // namespace cuda
}  // namespace kdtree
