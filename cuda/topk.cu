// topk.cu: top-k + log-softmax of drafter logits [D, V] on the device (V up to 512K, k <= 1024).
//
// Three launches (fourteenth session: ~32 chunks of <= 6144 logits per row instead of 8 of ~20K,
// every load of a chunk in flight at once, a bisection bound in the filter, a register bitonic
// sort in the select; docs/CUDA.md "Top-k + log-softmax" has the measurements).
//  topk_stats (grid chunks x D): a block loads a chunk of a row into shared memory as
//    order-preserving uint32 keys, writes the chunk's max and sum exp(x - max) (float64, so the
//    log-sum-exp rounds to the same float32 as the NumPy reference's float64 sum), and the max
//    key of each of the row's NG groups of gs consecutive logits (NG >= 8k, a power of 2); the
//    row's first block also zeroes the row's candidate count.
//  topk_filter (grid chunks x D): every block loads its chunk and meanwhile finds the same lower
//    bound g of the k-th largest group max of its row (a key with k .. k + k/8 group maxima at or
//    above it, else the k-th largest's first 22 bits, by up to 11 steps of a 4-way bisection of
//    the key space over the NG group maxima; redundant per block but parallel): the k-th largest group
//    max is a lower bound of the row's k-th largest logit (k groups reach it), so the top k are
//    among the logits >= g, ~1.07k for i.i.d. rows. The block appends its chunk's logits >= g
//    (key, id) to the row's candidate list in the workspace (warp-aggregated atomics; the order
//    does not matter, the select orders by (key, id)).
//  topk_select (one block per row): the candidates (<= kCap), as 64-bit (key, ~id), 2 (P <=
//    1024) or 8 per thread in registers, padded to a power of two P, are sorted descending by a
//    bitonic network (strides inside a thread in registers, inside a warp by shuffles, across
//    warps through shared memory; only the P / E threads it needs take part, and the first idle
//    warp computes the log-sum-exp meanwhile) and the first k written as
//    logprob = logit - float32(max + log(sum)): the k largest logits, ties by lower id. If more
//    than kCap logits passed the filter (long runs of equal or sorted logits), a radix select
//    (11/11/10 bits, then on the ids for ties) runs over the whole row in global memory and its
//    k winners are sorted the same way.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "kernels.h"
#include "launch.h"

namespace kdtree {
namespace cuda {
namespace {

constexpr int kStatsThreads = 256;   // topk_stats and topk_filter
constexpr int kSelectThreads = 1024;
constexpr int kSortE = 8;            // sort elements per thread
constexpr int kCap = kSelectThreads * kSortE;  // candidates the select sorts (8192)
constexpr int kMaxGroups = 16384;
constexpr int kChunkMax = 6144;      // logits per topk_stats / topk_filter block (at most)
constexpr int kLoadBatch = kChunkMax / kStatsThreads;  // global loads in flight per thread (a chunk: 24)
// a chunk is at most one batch: at least 1024 groups per row, so a group (and a one-group chunk)
// holds at most kTopkMaxV / 1024 logits
static_assert(kTopkMaxV / 1024 <= kChunkMax, "topk_filter loads its chunk as one batch");

__device__ __forceinline__ uint32_t float_key(float x) {
  if (x == 0.0f) x = 0.0f;  // -0 and +0 tie (as in the reference's stable argsort)
  uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(uint32_t k) {
  uint32_t u = (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
  return __uint_as_float(u);
}

// exp(t) for t <= 0 in float64, ~1e-14 relative (Taylor degree 11 after reduction by ln 2);
// 0 below -708. Cheaper than the libdevice exp; the sum it feeds only needs ~1e-12.
__device__ __forceinline__ double exp_nonpos(double t) {
  if (t < -708.0) return 0.0;
  const double kd = rint(t * 1.4426950408889634);
  double r = fma(-kd, 6.93147180369123816490e-01, t);
  r = fma(-kd, 1.90821492927058770002e-10, r);
  double q = 2.5052108385441720e-08;         // 1/11!
  q = fma(q, r, 2.7557319223985893e-07);     // 1/10!
  q = fma(q, r, 2.7557319223985888e-06);     // 1/9!
  q = fma(q, r, 2.4801587301587302e-05);     // 1/8!
  q = fma(q, r, 1.9841269841269841e-04);     // 1/7!
  q = fma(q, r, 1.3888888888888889e-03);     // 1/6!
  q = fma(q, r, 8.3333333333333332e-03);     // 1/5!
  q = fma(q, r, 4.1666666666666664e-02);     // 1/4!
  q = fma(q, r, 1.6666666666666666e-01);     // 1/3!
  q = fma(q, r, 0.5);
  q = fma(q, r, 1.0);
  q = fma(q, r, 1.0);
  return q * __longlong_as_double((long long)((int)kd + 1023) << 52);
}

struct Plan {
  int NG;      // groups per row (power of 2)
  int gs;      // logits per group
  int nchunk;  // blocks per row in topk_stats
  int gpc;     // groups per chunk
  int chunk;   // logits per chunk = gpc * gs
};
// KDTREE_TOPK_PROFILE (GPU builds only, off by default; build with
// -Ccmake.define.CMAKE_CUDA_FLAGS=-DKDTREE_TOPK_PROFILE): thread 0 of the first and the last block
// of row 0 reads clock64() at the marks below and prints one "TOPKPROF <kernel>" line of cycles
// between them per launch (the select: row 0's block). docs/CUDA.md "Top-k + log-softmax".
#if defined(KDTREE_TOPK_PROFILE) && defined(__CUDA_ARCH__)
#define TOPK_PROF_DECL long long tmark[6];
#define TOPK_PROF_MARK(i) \
  if (threadIdx.x == 0) tmark[i] = clock64();
#define TOPK_PROF_PRINT(name, n, cond)                                                                    \
  if (threadIdx.x == 0 && (cond)) {                                                                       \
    long long d[5] = {0, 0, 0, 0, 0};                                                                     \
    for (int q = 1; q < n; ++q) d[q - 1] = tmark[q] - tmark[q - 1];                                       \
    printf("TOPKPROF %s block %d: %lld %lld %lld %lld %lld total %lld\n", name, (int)blockIdx.x, d[0], d[1], \
           d[2], d[3], d[4], tmark[n - 1] - tmark[0]);                                                    \
  }
#else
#define TOPK_PROF_DECL
#define TOPK_PROF_MARK(i)
#define TOPK_PROF_PRINT(name, n, cond)
#endif

inline Plan make_plan(int V, int k) {
  Plan p;
  int ng = 1024;
  while (ng < 8 * k && ng < kMaxGroups) ng <<= 1;
  p.NG = ng;
  p.gs = (V + ng - 1) / ng;
  if (p.gs < 1) p.gs = 1;
  p.gpc = p.NG;  // groups per chunk: a power of 2, the largest whose chunk fits kChunkMax
  while (p.gpc > 1 && (long long)p.gpc * p.gs > kChunkMax) p.gpc >>= 1;
  p.nchunk = p.NG / p.gpc;
  p.chunk = p.gpc * p.gs;
  return p;
}

struct WsLayout {
  size_t o_max, o_sum, o_gmax, o_cnt, o_ck, o_ci, total;
};
inline WsLayout ws_layout(int D, const Plan& p) {
  WsLayout w;
  size_t o = 0, n = (size_t)D * p.nchunk;
  auto up = [](size_t b) { return (b + 255) / 256 * 256; };
  w.o_max = o;  o += up(n * 8);
  w.o_sum = o;  o += up(n * 8);
  w.o_gmax = o; o += up((size_t)D * p.NG * 4);
  w.o_cnt = o;  o += up((size_t)D * 4);          // candidates per row (may exceed kCap: then unused)
  w.o_ck = o;   o += up((size_t)D * kCap * 4);   // candidate keys [D][kCap]
  w.o_ci = o;   o += up((size_t)D * kCap * 4);   // candidate ids  [D][kCap]
  w.total = o;
  return w;
}

// ---------------------------------------------------------------- block helpers
template <int NT>
__device__ double block_sum_d(double v, double* red) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  double s = 0.0;
  for (int w = 0; w < NT / 32; ++w) s += red[w];
  return s;
}
template <int NT>
__device__ uint32_t block_max_u(uint32_t v, uint32_t* red) {
  for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  uint32_t m = red[0];
  for (int w = 1; w < NT / 32; ++w) m = max(m, red[w]);
  return m;
}

// In-place exclusive scan of h[0..2048); barrier at the end.
template <int NT>
__device__ void scan2048(int* h, int* tmp) {
  constexpr int per = 2048 / NT;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  int v[per];
  int s = 0;
#pragma unroll
  for (int i = 0; i < per; ++i) {
    v[i] = h[t * per + i];
    s += v[i];
  }
  int x = s;
  for (int off = 1; off < 32; off <<= 1) {
    int y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  if (lane == 31) tmp[warp] = x;
  __syncthreads();
  int wsum = lane < NT / 32 ? tmp[lane] : 0;  // every warp scans the warp totals itself
  int wx = wsum;
  for (int off = 1; off < 32; off <<= 1) {
    int y = __shfl_up_sync(0xffffffffu, wx, off);
    if (lane >= off) wx += y;
  }
  const int warp_excl = __shfl_sync(0xffffffffu, wx - wsum, warp);
  int run = warp_excl + x - s;
#pragma unroll
  for (int i = 0; i < per; ++i) {
    h[t * per + i] = run;
    run += v[i];
  }
  __syncthreads();
}

// Radix select: among items i < n with keyfn(i, &key) true, the `need`-th largest key
// (1-based). Returns it; *need_eq = how many items equal to it belong to the top `need`.
// Shared: hist[2048], tmp[32], misc[4]. All threads call it; n uniform.
template <int NT, class KeyFn>
__device__ uint32_t radix_select(int n, int need, KeyFn keyfn, int* hist, int* tmp, int* misc,
                                 int* need_eq) {
  uint32_t prefix = 0, mask = 0;
  const int lane = threadIdx.x & 31;
#pragma unroll 1
  for (int pass = 0; pass < 3; ++pass) {
    const int sh = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
    const int nb = pass == 2 ? 1024 : 2048;
    for (int i = threadIdx.x; i < 2048; i += NT) hist[i] = 0;
    if (threadIdx.x == 0) misc[0] = -1;
    __syncthreads();
    for (int base = 0; base < n; base += NT) {
      const int i = base + threadIdx.x;
      uint32_t key = 0;
      bool ok = false;
      if (i < n) ok = keyfn(i, &key);
      ok = ok && ((key & mask) == prefix);
      // reversed digit: bin 0 holds the largest keys
      const int dig = ok ? (nb - 1 - (int)((key >> sh) & (uint32_t)(nb - 1))) : -1;
      const unsigned grp = __match_any_sync(0xffffffffu, dig);
      if (ok && lane == __ffs(grp) - 1) atomicAdd(&hist[dig], __popc(grp));
    }
    __syncthreads();
    // crossing bin b: excl(b) < need <= excl(b) + count(b); count(b) = excl(b+1) - excl(b)
    scan2048<NT>(hist, tmp);
    for (int b = threadIdx.x; b < nb; b += NT) {
      const int excl = hist[b];
      const int incl = b + 1 < nb ? hist[b + 1] : 0x7fffffff;
      if (excl < need && need <= incl) {
        misc[0] = b;
        misc[1] = excl;
      }
    }
    __syncthreads();
    const int b = misc[0];
    need -= misc[1];
    prefix |= (uint32_t)(nb - 1 - b) << sh;
    mask |= (uint32_t)(nb - 1) << sh;
    __syncthreads();
  }
  *need_eq = need;
  return prefix;
}

// The logits of chunk ch of a row (n of them, 0 past the end of the row) and the loads of one
// batch: kLoadBatch per thread, all in flight before the first use (0 past n).
struct ChunkSpan {
  const float* x;  // the chunk's first logit
  int n;
};
__device__ __forceinline__ ChunkSpan chunk_span(const TopkParams& p, const Plan& pl, int row, int ch) {
  const long long c0 = (long long)ch * pl.chunk;
  int n = (int)((long long)p.V - c0);
  if (n > pl.chunk) n = pl.chunk;
  if (n < 0) n = 0;
  return {p.logits + (size_t)row * p.ld + c0, n};
}
__device__ __forceinline__ void load_batch(const float* x, int base, int n, float (&v)[kLoadBatch]) {
#pragma unroll
  for (int j = 0; j < kLoadBatch; ++j) {
    const int i = base + j * kStatsThreads + (int)threadIdx.x;
    v[j] = i < n ? __ldg(x + i) : 0.f;
  }
}

// ---------------------------------------------------------------- kernel 1: stats + group maxima
__global__ void __launch_bounds__(kStatsThreads) topk_stats_kernel(TopkParams p, Plan pl, WsLayout wl) {
  pdl_prologue();
  TOPK_PROF_DECL
  TOPK_PROF_MARK(0)
  extern __shared__ __align__(16) unsigned char sm[];
  uint32_t* keys = (uint32_t*)sm;                                      // [chunk]
  double* red = (double*)(sm + ((size_t)pl.chunk * 4 + 15) / 16 * 16); // [32]
  const int row = blockIdx.y, ch = blockIdx.x;
  const ChunkSpan cs = chunk_span(p, pl, row, ch);
  const int n = cs.n;
  uint32_t mk = 0;
  for (int base = 0; base < n; base += kStatsThreads * kLoadBatch) {  // kLoadBatch loads in flight
    float v[kLoadBatch];
    load_batch(cs.x, base, n, v);
#pragma unroll
    for (int j = 0; j < kLoadBatch; ++j) {
      const int i = base + j * kStatsThreads + (int)threadIdx.x;
      if (i < n) {
        const uint32_t k = float_key(v[j]);
        keys[i] = k;
        mk = max(mk, k);
      }
    }
  }
  TOPK_PROF_MARK(1)  // loads
  mk = block_max_u<kStatsThreads>(mk, (uint32_t*)red);
  const double mx = (double)key_float(mk);
  double s = 0.0;
  if (n > 0 && mk > float_key(-__int_as_float(0x7f800000))) {
    for (int i = threadIdx.x; i < n; i += kStatsThreads) s += exp_nonpos((double)key_float(keys[i]) - mx);
  }
  TOPK_PROF_MARK(2)  // max + exp
  s = block_sum_d<kStatsThreads>(s, red);
  TOPK_PROF_MARK(3)  // sum
  unsigned char* ws = (unsigned char*)p.workspace;
  const size_t slot = (size_t)row * pl.nchunk + ch;
  if (threadIdx.x == 0 && ch == 0) ((int*)(ws + wl.o_cnt))[row] = 0;  // topk_filter appends after this kernel
  if (threadIdx.x == 0) {
    ((double*)(ws + wl.o_max))[slot] = n > 0 ? mx : -__longlong_as_double(0x7ff0000000000000LL);
    ((double*)(ws + wl.o_sum))[slot] = s;
  }
  // group maxima: tpg threads per group (<= 32, a power of 2; the lanes of a group stride over its
  // logits), reduced by shuffles
  uint32_t* gmax = (uint32_t*)(ws + wl.o_gmax) + (size_t)row * pl.NG + (size_t)ch * pl.gpc;
  const int tpg = pl.gpc >= kStatsThreads / 32 ? (pl.gpc >= kStatsThreads ? 1 : kStatsThreads / pl.gpc) : 32;
  for (int g0 = 0; g0 < pl.gpc; g0 += kStatsThreads / tpg) {  // uniform trip count
    const int g = g0 + (int)threadIdx.x / tpg, sub = (int)threadIdx.x % tpg;
    const int b = g * pl.gs, e = g < pl.gpc ? min(pl.gs, n - b) : 0;
    uint32_t m = 0;
#pragma unroll 4
    for (int i = sub; i < e; i += tpg) m = max(m, keys[b + i]);
    for (int off = tpg >> 1; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (sub == 0 && g < pl.gpc) gmax[g] = m;  // 0 (below every key) for an empty group
  }
  TOPK_PROF_MARK(4)  // group maxima
  TOPK_PROF_PRINT("stats", 5, blockIdx.y == 0 && (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1))
}

// ---------------------------------------------------------------- kernel 2: candidate filter
// A lower bound of the k-th largest of v[0..n) (1 <= k <= n): a key with at least k and at most
// k + k/8 values at or above it, or else the k-th largest with its low 10 bits cleared (the same
// value as two 11-bit radix passes give). Quaternary bisection over the key space: up to 11
// steps, each counting the values at or above three thresholds (warp reductions, shared atomics
// into one of three rotating counter triples, one barrier). cnt: 9 ints of shared memory. All
// threads call it.
template <int NT>
__device__ uint32_t kth_bound(const uint32_t* v, int n, int k, int* cnt) {
  if (threadIdx.x < 9) cnt[threadIdx.x] = 0;
  __syncthreads();
  unsigned long long lo = 0, hi = 1ull << 32;  // count(>= lo) >= k > count(>= hi)
#pragma unroll 1
  for (int step = 0; step < 11; ++step) {
    const unsigned long long q = (hi - lo) >> 2;
    const uint32_t t1 = (uint32_t)(lo + q), t2 = (uint32_t)(lo + 2 * q), t3 = (uint32_t)(lo + 3 * q);
    unsigned c1 = 0, c2 = 0, c3 = 0;
    for (int i = threadIdx.x; i < n; i += NT) {
      const uint32_t x = v[i];
      c1 += x >= t1;
      c2 += x >= t2;
      c3 += x >= t3;
    }
    c1 = __reduce_add_sync(0xffffffffu, c1);
    c2 = __reduce_add_sync(0xffffffffu, c2);
    c3 = __reduce_add_sync(0xffffffffu, c3);
    int* cb = cnt + 3 * (step % 3);
    if ((threadIdx.x & 31) == 0) {
      atomicAdd(cb + 0, (int)c1);
      atomicAdd(cb + 1, (int)c2);
      atomicAdd(cb + 2, (int)c3);
    }
    // the triple of step + 1 was last read in step - 2: every thread is past that (barrier of step - 1)
    if (threadIdx.x < 3) cnt[3 * ((step + 1) % 3) + threadIdx.x] = 0;
    __syncthreads();
    const int C1 = cb[0], C2 = cb[1], C3 = cb[2];
    // close enough: a threshold with k .. k + k/8 values at or above it bounds as well as the exact
    // one (at most k/8 more groups pass the filter); stop early (block-uniform: the same counts)
    const int slack = k + (k >> 3);
    if (C3 >= k && C3 <= slack) return t3;
    if (C2 >= k && C2 <= slack) return t2;
    if (C1 >= k && C1 <= slack) return t1;
    if (C3 >= k) {
      lo = lo + 3 * q;
    } else if (C2 >= k) {
      lo = lo + 2 * q;
      hi = lo + q;
    } else if (C1 >= k) {
      lo = lo + q;
      hi = lo + q;
    } else {
      hi = lo + q;
    }
  }
  return (uint32_t)lo;
}

// Shared (dynamic): gk [NG], misc [16].
__global__ void __launch_bounds__(kStatsThreads) topk_filter_kernel(TopkParams p, Plan pl, WsLayout wl) {
  pdl_prologue();
  TOPK_PROF_DECL
  TOPK_PROF_MARK(0)
  extern __shared__ __align__(16) unsigned char sm[];
  uint32_t* gk = (uint32_t*)sm;
  int* misc = (int*)(gk + pl.NG);
  const int row = blockIdx.y, ch = blockIdx.x;
  unsigned char* ws = (unsigned char*)p.workspace;
  const uint32_t* gsrc = (const uint32_t*)(ws + wl.o_gmax) + (size_t)row * pl.NG;
  for (int g = threadIdx.x; g < pl.NG; g += kStatsThreads) gk[g] = gsrc[g];
  // the chunk (one batch: chunk <= kChunkMax) is loaded while the bound is searched
  const long long c0 = (long long)ch * pl.chunk;
  const ChunkSpan cs = chunk_span(p, pl, row, ch);
  const int n = cs.n;
  float v[kLoadBatch];
  load_batch(cs.x, 0, n, v);
  __syncthreads();
  TOPK_PROF_MARK(1)  // group maxima in
  const uint32_t g = kth_bound<kStatsThreads>(gk, pl.NG, p.k, misc);
  TOPK_PROF_MARK(2)  // bound
  int* cnt = (int*)(ws + wl.o_cnt) + row;
  uint32_t* ck = (uint32_t*)(ws + wl.o_ck) + (size_t)row * kCap;
  int32_t* ci = (int32_t*)(ws + wl.o_ci) + (size_t)row * kCap;
  const int lane = threadIdx.x & 31;
  {  // every thread runs every j (whole warps vote)
#pragma unroll
    for (int j = 0; j < kLoadBatch; ++j) {
      const int i = j * kStatsThreads + (int)threadIdx.x;
      const uint32_t kk = float_key(v[j]);
      const bool take = i < n && kk >= g;
      const unsigned vote = __ballot_sync(0xffffffffu, take);
      if (vote == 0u) continue;
      int o0 = 0;
      if (lane == 0) o0 = atomicAdd(cnt, __popc(vote));
      o0 = __shfl_sync(0xffffffffu, o0, 0);
      if (take) {
        const int o = o0 + __popc(vote & ((1u << lane) - 1u));
        if (o < kCap) {
          ck[o] = kk;
          ci[o] = (int32_t)(c0 + i);
        }
      }
    }
  }
  TOPK_PROF_MARK(3)  // scan + appends
  TOPK_PROF_PRINT("filter", 4, blockIdx.y == 0 && (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1))
}

// ---------------------------------------------------------------- kernel 3: select + sort
// Named barrier 1 over the first `nthreads` threads (a multiple of 32).
__device__ __forceinline__ void bar_first(int nthreads) {
  asm volatile("bar.sync 1, %0;" ::"r"(nthreads) : "memory");
}

// One compare-exchange of the bitonic network, seen from element i whose partner is j = i ^ stride:
// in a descending run ((i & size) == 0) the lower index keeps the larger value.
__device__ __forceinline__ unsigned long long bitonic_keep(unsigned long long a, unsigned long long o, int i,
                                                           int j, int size) {
  const bool desc = (i & size) == 0;
  const bool lower = i < j;
  return (desc == lower) ? (a > o ? a : o) : (a < o ? a : o);
}

// Sorts P = nthreads * E values descending; thread t holds elements t*E .. t*E+E-1 in v. Strides
// below E run inside the thread, up to 32*E by warp shuffles, the rest through xs[P] in shared
// memory with barrier 1 over the nthreads taking part (threads >= nthreads do not call it).
template <int E>
__device__ void bitonic_sort_desc(unsigned long long (&v)[E], unsigned long long* xs, int P, int nthreads) {
  const int t = (int)threadIdx.x;
  for (int size = 2; size <= P; size <<= 1) {
    for (int stride = size >> 1; stride >= E; stride >>= 1) {
      if (stride >= 32 * E) {
#pragma unroll
        for (int r = 0; r < E; ++r) xs[t * E + r] = v[r];
        bar_first(nthreads);
#pragma unroll
        for (int r = 0; r < E; ++r) {
          const int i = t * E + r, j = i ^ stride;
          v[r] = bitonic_keep(v[r], xs[j], i, j, size);
        }
        bar_first(nthreads);
      } else {
        const int lm = stride / E;  // partner lane
#pragma unroll
        for (int r = 0; r < E; ++r) {
          const unsigned long long o = __shfl_xor_sync(0xffffffffu, v[r], lm);
          const int i = t * E + r;
          v[r] = bitonic_keep(v[r], o, i, i ^ stride, size);
        }
      }
    }
#pragma unroll
    for (int st = E / 2; st > 0; st >>= 1) {
      if (st < size) {
#pragma unroll
        for (int r = 0; r < E; ++r) {
          if ((r & st) == 0) {
            const int i = t * E + r;  // the pair's lower index
            const unsigned long long a = v[r], b = v[r | st];
            const bool desc = (i & size) == 0;
            if (desc ? (a < b) : (a > b)) {
              v[r] = b;
              v[r | st] = a;
            }
          }
        }
      }
    }
  }
}

// The row's log-sum-exp from the chunk partials (float64), rounded to float32 like the
// reference; computed by a whole warp (lane-strided partials, then butterflies: every lane ends
// with the same bits).
__device__ float row_lse(const Plan& pl, const WsLayout& wl, int row, const unsigned char* ws) {
  const int lane = threadIdx.x & 31;
  const double* pm = (const double*)(ws + wl.o_max) + (size_t)row * pl.nchunk;
  const double* ps = (const double*)(ws + wl.o_sum) + (size_t)row * pl.nchunk;
  double m = -__longlong_as_double(0x7ff0000000000000LL);
  for (int c = lane; c < pl.nchunk; c += 32) m = fmax(m, pm[c]);
  for (int off = 16; off > 0; off >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, off));
  double ssum = 0.0;
  for (int c = lane; c < pl.nchunk; c += 32) {
    const double sc = ps[c];
    if (sc > 0.0) ssum += sc * exp(pm[c] - m);
  }
  for (int off = 16; off > 0; off >>= 1) ssum += __shfl_xor_sync(0xffffffffu, ssum, off);
  return (float)(m + log(ssum));
}

// The sort path of topk_select: the nc candidates (k <= nc <= P) as (key, ~id), E per thread for
// the first P / E threads, sorted descending; the first k written with the row's log-sum-exp.
// That is computed meanwhile by the first warp the sort leaves idle (handed over through shared
// memory at named barrier 2), or by every sorting warp after the sort when none is idle.
template <int E>
__device__ void sort_write(const TopkParams& p, const Plan& pl, const WsLayout& wl, int row, int nc, int P,
                           unsigned long long* xs, float* lse_s) {
  const unsigned char* ws = (const unsigned char*)p.workspace;
  const int na = P / E;  // threads taking part (a multiple of 32)
  const int t = threadIdx.x;
  const int lse_warp = na < kSelectThreads ? na / 32 : -1;
  if (lse_warp >= 0 && t / 32 == lse_warp) {
    const float lse = row_lse(pl, wl, row, ws);
    if ((t & 31) == 0) *lse_s = lse;
    asm volatile("bar.arrive 2, %0;" ::"r"(na + 32) : "memory");
    return;
  }
  if (t >= na) return;
  TOPK_PROF_DECL
  TOPK_PROF_MARK(0)
  const uint32_t* cks = (const uint32_t*)(ws + wl.o_ck) + (size_t)row * kCap;
  const int32_t* cis = (const int32_t*)(ws + wl.o_ci) + (size_t)row * kCap;
  unsigned long long v[E];
#pragma unroll
  for (int r = 0; r < E; ++r) {
    const int i = t * E + r;  // padding 0 sorts below every candidate (their ~id is > 0)
    v[r] = i < nc ? ((unsigned long long)cks[i] << 32) | (unsigned long long)(~(uint32_t)cis[i]) : 0ull;
  }
  TOPK_PROF_MARK(1)  // candidates in
  bitonic_sort_desc<E>(v, xs, P, na);
  TOPK_PROF_MARK(2)  // sort
  float lse;
  if (lse_warp >= 0) {
    asm volatile("bar.sync 2, %0;" ::"r"(na + 32) : "memory");
    lse = *lse_s;
  } else {
    lse = row_lse(pl, wl, row, ws);
  }
  TOPK_PROF_MARK(3)  // lse (waited for, or computed)
#pragma unroll
  for (int r = 0; r < E; ++r) {
    const int i = t * E + r;
    if (i < p.k) {
      p.logprobs[(size_t)row * p.k + i] = key_float((uint32_t)(v[r] >> 32)) - lse;
      p.ids[(size_t)row * p.k + i] = (int32_t)(~(uint32_t)(v[r] & 0xffffffffull));
    }
  }
  TOPK_PROF_MARK(4)  // write
  TOPK_PROF_PRINT(E == 2 ? "select(E=2)" : "select(E=8)", 5, row == 0)
}

struct SelectSmem {
  int* hist;      // [2048]
  int* tmp;       // [32]
  int* misc;      // [8]
  uint32_t* ck;   // [kCap]
  int32_t* ci;    // [kCap]
  unsigned long long* sortv;  // [1024]
};

template <class KeyFn, class IdFn>
__device__ void select_write(const TopkParams& p, int row, int n, KeyFn keyfn, IdFn idfn, float lse,
                             const SelectSmem& s) {
  const int k = p.k;
  int need_eq = k;
  uint32_t thr = 0, thr2 = 0;
  bool all_eq = true;
  if (k < n) {
    thr = radix_select<kSelectThreads>(n, k, keyfn, s.hist, s.tmp, s.misc, &need_eq);
    int ce = 0;
    for (int i = threadIdx.x; i < n; i += kSelectThreads) {
      uint32_t kk;
      if (keyfn(i, &kk) && kk == thr) ++ce;
    }
    if (threadIdx.x == 0) s.misc[5] = 0;
    __syncthreads();
    atomicAdd(&s.misc[5], ce);
    __syncthreads();
    all_eq = s.misc[5] == need_eq;
    if (!all_eq) {
      int ne2 = 0;
      thr2 = radix_select<kSelectThreads>(
          n, need_eq,
          [&](int i, uint32_t* kk) {
            uint32_t v;
            if (!keyfn(i, &v) || v != thr) return false;
            *kk = ~(uint32_t)idfn(i);
            return true;
          },
          s.hist, s.tmp, s.misc, &ne2);
    }
  }
  int P = 1;
  while (P < k) P <<= 1;
  for (int i = threadIdx.x; i < P; i += kSelectThreads) s.sortv[i] = 0ull;
  if (threadIdx.x == 0) s.misc[4] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += kSelectThreads) {
    uint32_t kk;
    if (!keyfn(i, &kk)) continue;
    const int32_t id = idfn(i);
    const bool take = (k >= n) || kk > thr || (kk == thr && (all_eq || ~(uint32_t)id >= thr2));
    if (take) {
      const int o = atomicAdd(&s.misc[4], 1);
      if (o < P) s.sortv[o] = ((unsigned long long)kk << 32) | (unsigned long long)(~(uint32_t)id);
    }
  }
  __syncthreads();
  for (int size = 2; size <= P; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < P; i += kSelectThreads) {
        const int j = i ^ stride;
        if (j > i) {
          const unsigned long long a = s.sortv[i], b = s.sortv[j];
          const bool desc = (i & size) == 0;
          if (desc ? (a < b) : (a > b)) {
            s.sortv[i] = b;
            s.sortv[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int i = threadIdx.x; i < k; i += kSelectThreads) {
    const unsigned long long v = s.sortv[i];
    p.logprobs[(size_t)row * k + i] = key_float((uint32_t)(v >> 32)) - lse;
    p.ids[(size_t)row * k + i] = (int32_t)(~(uint32_t)(v & 0xffffffffull));
  }
}

__global__ void __launch_bounds__(kSelectThreads) topk_select_kernel(TopkParams p, Plan pl, WsLayout wl) {
  pdl_prologue();
  extern __shared__ __align__(16) unsigned char sm[];
  SelectSmem s;
  s.sortv = (unsigned long long*)sm;                  // [1024]
  s.ck = (uint32_t*)(s.sortv + 1024);                 // [kCap]
  s.ci = (int32_t*)(s.ck + kCap);                     // [kCap]
  s.hist = (int*)(s.ci + kCap);                       // [2048]
  s.tmp = s.hist + 2048;                              // [32]
  s.misc = s.tmp + 32;                                // [8]
  const int row = blockIdx.x;
  const unsigned char* ws = (const unsigned char*)p.workspace;
  const int nc = ((const int*)(ws + wl.o_cnt))[row];
  if (nc <= kCap && nc >= p.k) {  // the candidates topk_filter found (>= its bound, at least k): sort them all
    int P = 64;
    while (P < nc) P <<= 1;
    if (P <= kSelectThreads) {  // E = 2 up to 1024 candidates; beyond, 8 leave idle warps for the lse
      sort_write<2>(p, pl, wl, row, nc, P, (unsigned long long*)s.ck, (float*)s.misc);
    } else {
      sort_write<kSortE>(p, pl, wl, row, nc, P, (unsigned long long*)s.ck, (float*)s.misc);
    }
    return;
  }
  const float lse = row_lse(pl, wl, row, ws);
  const float* x = p.logits + (size_t)row * p.ld;
  // too many ties / a sorted row: select over the whole row in global memory
  select_write(
      p, row, p.V, [&](int i, uint32_t* kk) { *kk = float_key(x[i]); return true; },
      [&](int i) { return (int32_t)i; }, lse, s);
}

size_t stats_smem(const Plan& pl) { return ((size_t)pl.chunk * 4 + 15) / 16 * 16 + 32 * 8; }
size_t filter_smem(const Plan& pl) { return (size_t)pl.NG * 4 + 16 * 4; }
size_t select_smem(const Plan&) { return 1024 * 8 + (size_t)kCap * 8 + (2048 + 32 + 8) * 4; }

template <class K>
cudaError_t ensure_smem(K kernel, size_t bytes, size_t* done) {
  if (bytes <= *done) return cudaSuccess;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
  if (e == cudaSuccess) *done = bytes;
  return e;
}

}  // namespace

size_t topk_workspace_bytes(int D, int V, int k) {
  if (D < 1 || V < 1 || k < 1) return 0;
  return ws_layout(D, make_plan(V, k)).total;
}

cudaError_t topk_logsoftmax(const TopkParams& p, cudaStream_t stream) {
  if (!p.logits || !p.logprobs || !p.ids || !p.workspace || p.D < 1 || p.D > kTreeMaxDepth ||
      p.V < 1 || p.V > kTopkMaxV || p.ld < p.V || p.k < 1 || p.k > p.V || p.k > kTopkMaxK)
    return cudaErrorInvalidValue;
  const Plan pl = make_plan(p.V, p.k);
  const WsLayout wl = ws_layout(p.D, pl);
  static size_t done1 = 48 * 1024, done2 = 48 * 1024, done3 = 48 * 1024;
  cudaError_t e = ensure_smem(topk_stats_kernel, stats_smem(pl), &done1);
  if (e != cudaSuccess) return e;
  e = ensure_smem(topk_select_kernel, select_smem(pl), &done2);
  if (e != cudaSuccess) return e;
  e = ensure_smem(topk_filter_kernel, filter_smem(pl), &done3);
  if (e != cudaSuccess) return e;
  launch_kernel(topk_stats_kernel, dim3(pl.nchunk, p.D), kStatsThreads, stats_smem(pl), stream, p, pl, wl);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  static const bool stats_only = [] {  // benchmark knob: time the first kernel alone
    const char* v = std::getenv("KDTREE_TOPK_STATS_ONLY");
    return v && v[0] == '1';
  }();
  if (stats_only) return cudaSuccess;
  e = launch_kernel(topk_filter_kernel, dim3(pl.nchunk, p.D), kStatsThreads, filter_smem(pl), stream, p, pl, wl);
  if (e != cudaSuccess) return e;
  launch_kernel(topk_select_kernel, p.D, kSelectThreads, select_smem(pl), stream, p, pl, wl);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kdtree
