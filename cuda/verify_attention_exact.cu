// verify_attention_exact.cu: the row-exact MLA verify attention (VerifyAttentionParams::exact; CudaModel's
// row_exact steps, docs/CUDA_MODEL.md "Row-exact steps").
//
// What it guarantees: a query row's output is a function of its query and of its *visible keys in index
// order* alone: the committed rows 0 .. L-1, then the tree rows its bitmask shows (its ancestors in depth
// order, then itself). That sequence is the same for a tree node and for the one-token step at the node's
// position (whose committed rows are the prefix and the path), so both get the same bits, whatever the tree's
// layout, its other nodes, T or L. The default kernels cannot promise that: they walk the keys by cache index
// (a node's masked siblings sit between its ancestors), split them by T and L, and share each chunk among rows
// of several nodes.
//
// How: a block takes one node's heads (up to RB = 16 rows, which see the same keys) and one split of its key
// *sequence*: keys [s * split_len, (s + 1) * split_len) of it, gathered by index (j < L: row j; else the
// (j - L)-th visible tree row), split_len a constant of the model (not of the step). Chunks of KC = 32 keys of
// the sequence (the last one padded with zero rows and -inf scores) go through shared memory (cp.async; one
// buffer, two blocks an SM); per chunk the 16 x 32 scores (FP32 dot products, four partial sums in a fixed order), the chunk's
// max and weight sum across the row's 16 threads (shuffle butterflies, the same tree in every lane), the
// online-softmax update, and O += P V on the CUDA cores, each output summing the chunk's keys in order. The
// partials (unnormalised O, max, sum) of every split go to the workspace and one merge kernel adds them in
// split order, over the row's own splits only (the empty ones past its sequence are marked), so the grid's
// split count (which does depend on the step) does not reach the bits. FP32 throughout; needs C <= 512, C and R multiples of 4, C + R <= 576,
// 16-byte aligned rows (verify_exact_fast_ok); other shapes run the rows kernel in its exact form
// (verify_attention.cu), unsplit and much slower.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"
#include "launch.h"
#include "model/tile_mma.h"
#include "verify_attention_common.h"

namespace kdtree {
namespace cuda {
namespace {

namespace ve {
constexpr int RB = 16;   // query rows (one node's heads) per block
constexpr int KC = 32;   // keys per chunk
constexpr int NT = 256;  // threads: 16 per row in the scores; two output columns each in P V
constexpr int NB = 1;    // key chunk buffers (one: ~112 KB of shared memory a block, two blocks an SM)
constexpr int kMaxC = 2 * NT, kMaxCR = 576;
}  // namespace ve

__host__ __device__ inline int ve_stride(int C, int R) { return (C + R + 31) / 32 * 32 + 4; }  // = 4 mod 32

size_t ve_smem_bytes(const VerifyAttentionParams& p) {
  using namespace ve;
  return sizeof(float) * ((size_t)(RB + NB * KC) * ve_stride(p.C, p.R) + RB * KC + RB) + sizeof(int) * (size_t)p.T;
}

__global__ void __launch_bounds__(ve::NT, 2) mla_verify_exact_kernel(VerifyAttentionParams p, int split_len) {
  pdl_prologue();
  using namespace ve;
  extern __shared__ __align__(16) float ve_sm[];
  __shared__ int s_nvis;
  const int st = ve_stride(p.C, p.R);
  float* sq = ve_sm;              // [RB][st]: the rows' [q_latent | q_rope]
  float* sk = sq + RB * st;       // [NB][KC][st]: key chunks
  float* sp = sk + NB * KC * st;  // [RB][KC]: the chunk's weights
  float* salpha = sp + RB * KC;   // [RB]: the chunk's rescale of O
  int* tslot = reinterpret_cast<int*>(salpha + RB);  // [T]: the node's visible tree rows, in index order
  const int tid = threadIdx.x, lane = tid & 31;
  const int split = blockIdx.x, node = blockIdx.y, h0 = blockIdx.z * RB;
  const int rows = min(RB, p.H - h0), M = p.T * p.H, nsplit = gridDim.x;
  const int L = attn_committed_len(p);
  const float ninf = attn_neg_inf();
  if (tid < 32) {  // the node's visible tree rows (ancestors, itself) in index order, by ballots
    const uint64_t* vrow = p.visibility + (size_t)node * p.vis_stride;
    int base = 0;
    for (int t0 = 0; t0 < p.T; t0 += 32) {
      const int t = t0 + lane;
      const bool v = t < p.T && ((vrow[t >> 6] >> (t & 63)) & 1ull);
      const unsigned b = __ballot_sync(0xffffffffu, v);
      if (v) tslot[base + __popc(b & ((1u << lane) - 1u))] = L + t;
      base += __popc(b);
    }
    if (lane == 0) s_nvis = base;
  }
  __syncthreads();
  const int N = L + s_nvis;  // the sequence's length (the one-token step's L + 1)
  const int k0 = split * split_len, k1 = min(N, k0 + split_len);
  float* wso = static_cast<float*>(p.workspace);
  float* wsml = wso + (size_t)nsplit * M * p.C;
  if (k0 >= k1) {  // past the node's sequence: an empty split (the merge skips it)
    if (tid < rows) {
      const size_t g = (size_t)split * M + (size_t)node * p.H + h0 + tid;
      wsml[2 * g] = ninf;
      wsml[2 * g + 1] = -1.f;  // (absent: a real sum is >= 0)
    }
    return;
  }
  const int CR = p.C + p.R, q4 = CR / 4;
  for (int i = tid; i < RB * q4; i += NT) {  // Q rows -> shared (rows past H: zeros)
    const int r = i / q4, d = (i - r * q4) * 4;
    const bool ok = r < rows;
    const size_t g = (size_t)node * p.H + h0 + (ok ? r : 0);
    cp_async16(sq + r * st + d, d < p.C ? p.q_latent + g * p.C + d : p.q_rope + g * p.R + (d - p.C), ok);
  }
  auto load_chunk = [&](int ci, int buf) {  // keys k0 + 32 ci .. of the sequence -> buffer buf (past k1: zeros)
    float* dst = sk + buf * KC * st;
    const int kb = k0 + ci * KC;
    for (int i = tid; i < KC * q4; i += NT) {
      const int kk = i / q4, d = (i - kk * q4) * 4, j = kb + kk;
      const bool ok = j < k1;
      const int row = !ok ? 0 : j < L ? j : tslot[j - L];
      cp_async16(dst + kk * st + d, p.kv + (size_t)row * p.kv_stride + d, ok);
    }
  };
  const int nch = (k1 - k0 + KC - 1) / KC;
  load_chunk(0, 0);
  cp_async_commit();  // Q and the first chunk

  const int r = tid >> 4, kk = tid & 15;  // scores: row r, keys kk and kk + 16 of the chunk
  const int c0 = 2 * tid;                 // P V: output columns c0, c0 + 1 of every row
  const bool pv = c0 < p.C;
  float m = ninf, l = 0.f;  // row r's running max and weight sum (the same in its 16 threads)
  float o[RB][2];
#pragma unroll
  for (int i = 0; i < RB; ++i) o[i][0] = o[i][1] = 0.f;
  for (int ci = 0; ci < nch; ++ci) {
    const int buf = NB == 1 ? 0 : ci & 1;
    if (NB == 1) {
      if (ci > 0) {  // (the previous chunk's P V is done: the last barrier of the loop)
        load_chunk(ci, 0);
        cp_async_commit();
      }
      cp_async_wait<0>();
    } else if (ci + 1 < nch) {
      load_chunk(ci + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const float* kc = sk + buf * KC * st;
    float s0, s1;
    {
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
      const float* qr = sq + r * st;
      const float* ka = kc + kk * st;
      const float* kb = kc + (kk + 16) * st;
      auto step = [&](const float4& q, const float4& x, const float4& y) {
        a.x = fmaf(q.x, x.x, a.x);
        a.y = fmaf(q.y, x.y, a.y);
        a.z = fmaf(q.z, x.z, a.z);
        a.w = fmaf(q.w, x.w, a.w);
        b.x = fmaf(q.x, y.x, b.x);
        b.y = fmaf(q.y, y.y, b.y);
        b.z = fmaf(q.z, y.z, b.z);
        b.w = fmaf(q.w, y.w, b.w);
      };
      int d = 0;
      for (; d + 16 <= CR; d += 16) {  // four steps' loads first (latency), then their products in order
        float4 q[4], x[4], y[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          q[u] = *reinterpret_cast<const float4*>(qr + d + 4 * u);
          x[u] = *reinterpret_cast<const float4*>(ka + d + 4 * u);
          y[u] = *reinterpret_cast<const float4*>(kb + d + 4 * u);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) step(q[u], x[u], y[u]);
      }
      for (; d < CR; d += 4)
        step(*reinterpret_cast<const float4*>(qr + d), *reinterpret_cast<const float4*>(ka + d),
             *reinterpret_cast<const float4*>(kb + d));
      const int j = k0 + ci * KC + kk;
      s0 = j < k1 ? ((a.x + a.y) + (a.z + a.w)) * p.scale : ninf;
      s1 = j + 16 < k1 ? ((b.x + b.y) + (b.z + b.w)) * p.scale : ninf;
    }
    // online softmax over the row's 16 threads (xor offsets < 16 stay in the half warp: one row)
    float cm = fmaxf(s0, s1);
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, off));
    const float mn = fmaxf(m, cm);
    const float p0 = s0 == ninf ? 0.f : expf(s0 - mn);
    const float p1 = s1 == ninf ? 0.f : expf(s1 - mn);
    const float alpha = m == ninf ? 0.f : expf(m - mn);
    float cs = p0 + p1;
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) cs += __shfl_xor_sync(0xffffffffu, cs, off);
    l = fmaf(l, alpha, cs);
    m = mn;
    sp[r * KC + kk] = p0;
    sp[r * KC + kk + 16] = p1;
    if (kk == 0) salpha[r] = alpha;
    __syncthreads();
    if (pv) {  // O = alpha O + P V, each output over the chunk's keys in order
#pragma unroll
      for (int i = 0; i < RB; ++i) {
        o[i][0] *= salpha[i];
        o[i][1] *= salpha[i];
      }
#pragma unroll 2
      for (int j = 0; j < KC; j += 4) {
        float2 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = *reinterpret_cast<const float2*>(kc + (j + u) * st + c0);
#pragma unroll
        for (int i = 0; i < RB; ++i) {
          const float4 w = *reinterpret_cast<const float4*>(sp + i * KC + j);
          o[i][0] = fmaf(w.x, v[0].x, o[i][0]);
          o[i][1] = fmaf(w.x, v[0].y, o[i][1]);
          o[i][0] = fmaf(w.y, v[1].x, o[i][0]);
          o[i][1] = fmaf(w.y, v[1].y, o[i][1]);
          o[i][0] = fmaf(w.z, v[2].x, o[i][0]);
          o[i][1] = fmaf(w.z, v[2].y, o[i][1]);
          o[i][0] = fmaf(w.w, v[3].x, o[i][0]);
          o[i][1] = fmaf(w.w, v[3].y, o[i][1]);
        }
      }
    }
    __syncthreads();  // the key buffer(s) and P are free for the next chunk's copies
  }
  // partials: unnormalised O, then (max, sum) per row
  if (pv) {
#pragma unroll
    for (int i = 0; i < RB; ++i)
      if (i < rows) {
        const size_t g = (size_t)split * M + (size_t)node * p.H + h0 + i;
        *reinterpret_cast<float2*>(wso + g * p.C + c0) = make_float2(o[i][0], o[i][1]);
      }
  }
  if (kk == 0 && r < rows) {
    const size_t g = (size_t)split * M + (size_t)node * p.H + h0 + r;
    wsml[2 * g] = m;
    wsml[2 * g + 1] = l;
  }
}

// One block per query row. A row's non-empty splits are its first S_row ones (the later ones, past its key
// sequence, wrote l = -1): the row's max gm over them, each one's factor exp(its max - gm), the sum of the
// factors times the splits' sums in split order, then every output column's sum of factor x partial in split
// order (float4 columns, loads of four splits in flight), divided by that sum. 0 where no key scored above
// -inf. Every step of the arithmetic is a function of the row's own splits.
constexpr int kMergeThreads = 128;  // C <= 512: one float4 of columns a thread
__global__ void __launch_bounds__(kMergeThreads) mla_verify_exact_merge_kernel(VerifyAttentionParams p, int S) {
  pdl_prologue();
  extern __shared__ float mg_sm[];  // [S] max, [S] sum, [S] factor
  __shared__ float s_gm, s_inv;
  __shared__ int s_rows;
  float* sm = mg_sm;
  float* sl = sm + S;
  float* sw = sl + S;
  const int g = blockIdx.x, tid = threadIdx.x;
  const size_t M = (size_t)p.T * p.H;
  const float* wso = static_cast<const float*>(p.workspace);
  const float* ml = wso + (size_t)S * M * p.C;
  const float ninf = attn_neg_inf();
  for (int s = tid; s < S; s += kMergeThreads) {
    sm[s] = ml[((size_t)s * M + g) * 2];
    sl[s] = ml[((size_t)s * M + g) * 2 + 1];
  }
  __syncthreads();
  if (tid == 0) {
    int n = 0;
    float gm = ninf;
    while (n < S && sl[n] >= 0.f) gm = fmaxf(gm, sm[n++]);
    s_rows = n;
    s_gm = gm;
  }
  __syncthreads();
  const int n = s_rows;
  const float gm = s_gm;
  float* out = p.out + (size_t)g * p.C;
  if (gm == ninf) {
    for (int c = tid; c < p.C; c += kMergeThreads) out[c] = 0.f;
    return;
  }
  for (int s = tid; s < n; s += kMergeThreads) sw[s] = expf(sm[s] - gm);
  __syncthreads();
  if (tid == 0) {
    float l = 0.f;
    for (int s = 0; s < n; ++s) l = fmaf(sw[s], sl[s], l);
    s_inv = 1.f / l;
  }
  __syncthreads();
  const int c0 = 4 * tid;
  if (c0 >= p.C) return;
  const float* src = wso + (size_t)g * p.C + c0;
  const size_t sstride = M * p.C;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  int s = 0;
  for (; s + 4 <= n; s += 4) {
    float4 x[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) x[u] = *reinterpret_cast<const float4*>(src + (size_t)(s + u) * sstride);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float w = sw[s + u];
      o.x = fmaf(w, x[u].x, o.x);
      o.y = fmaf(w, x[u].y, o.y);
      o.z = fmaf(w, x[u].z, o.z);
      o.w = fmaf(w, x[u].w, o.w);
    }
  }
  for (; s < n; ++s) {
    const float4 x = *reinterpret_cast<const float4*>(src + (size_t)s * sstride);
    const float w = sw[s];
    o.x = fmaf(w, x.x, o.x);
    o.y = fmaf(w, x.y, o.y);
    o.z = fmaf(w, x.z, o.z);
    o.w = fmaf(w, x.w, o.w);
  }
  const float inv = s_inv;
  *reinterpret_cast<float4*>(out + c0) = make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
}

int exact_split_len(const VerifyAttentionParams& p) {
  return p.exact_split > 0 ? p.exact_split : kVerifyExactSplitDefault;
}

}  // namespace

bool verify_exact_fast_ok(const VerifyAttentionParams& p) {
  return p.C <= ve::kMaxC && p.C % 4 == 0 && p.R % 4 == 0 && p.C + p.R <= ve::kMaxCR && p.kv_stride % 4 == 0 &&
         aligned16(p.q_latent) && aligned16(p.q_rope) && aligned16(p.kv) && exact_split_len(p) % ve::KC == 0;
}

size_t verify_exact_workspace_bytes(const VerifyAttentionParams& p) {
  if (!verify_exact_fast_ok(p)) return 0;
  const long long S = ((long long)p.L + p.T + exact_split_len(p) - 1) / exact_split_len(p);
  return (size_t)S * p.T * p.H * (p.C + 2) * sizeof(float);
}

cudaError_t launch_verify_exact(const VerifyAttentionParams& p, cudaStream_t stream) {
  static int state = 0;  // the dynamic shared memory limit, raised once
  const size_t smem = ve_smem_bytes(p);
  if (state == 0) {
    const int most = (int)(sizeof(float) * ((size_t)(ve::RB + ve::NB * ve::KC) * ve_stride(512, 64) + ve::RB * ve::KC +
                                            ve::RB) +
                           sizeof(int) * 2048);
    state = cudaFuncSetAttribute(mla_verify_exact_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, most) == cudaSuccess
                ? 1
                : -1;
    if (state < 0) cudaGetLastError();
    else if (cudaFuncSetAttribute(mla_verify_exact_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100) !=
             cudaSuccess)
      cudaGetLastError();  // only a hint (two blocks an SM need the whole 228 KB)
  }
  if (state < 0 || p.T > 2048 || !p.workspace) return cudaErrorInvalidValue;
  const int sl = exact_split_len(p);
  const int S = (p.L + p.T + sl - 1) / sl;  // (p.L: the committed length or its upper bound)
  cudaError_t e = launch_kernel(mla_verify_exact_kernel, dim3(S, p.T, (p.H + ve::RB - 1) / ve::RB), ve::NT, smem, stream,
                                p, sl);
  if (e != cudaSuccess) return e;
  const size_t msm = 3 * sizeof(float) * (size_t)S;  // (> 48 KB only past ~4000 splits: very long contexts)
  if (msm > (48u << 10) &&
      cudaFuncSetAttribute(mla_verify_exact_merge_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)msm) !=
          cudaSuccess)
    return cudaGetLastError();
  return launch_kernel(mla_verify_exact_merge_kernel, p.T * p.H, kMergeThreads, msm, stream, p, S);
}

}  // namespace cuda
}  // namespace kdtree
