// topk.cu: top-k + log-softmax of drafter logits [D, V] on the device (V up to 512K, k <= 1024).
//
// Two launches (fourteenth session; before: three, with 8 blocks of ~20K logits per row, and a
// one-block-per-row select kernel; docs/CUDA.md "Top-k + log-softmax" has the measurements).
//  topk_stats (grid chunks x D, chunks of <= 6144 logits, ~32 per row at V = 163840): a block
//    loads its chunk (every load in flight at once) into shared memory as order-preserving
//    uint32 keys, writes the chunk's max and sum exp(x - max) (float64, so the log-sum-exp
//    rounds to the same float32 as the NumPy reference's float64 sum), and the max key of each
//    of the row's NG groups of gs consecutive logits (NG >= 8k, a power of 2) in its chunk; the
//    row's first block also zeroes the row's candidate count and arrival counter.
//  topk_filter (grid chunks x D): every block finds the same lower bound g of the k-th largest
//    group max of its row (redundant per block but parallel; kth_bound: 8 steps of an 8-way
//    bisection of the key space): the k-th largest group max is a lower bound of the row's k-th
//    largest logit (k groups reach it), so the top k are among the logits >= g, ~1.07k for
//    i.i.d. rows. The block appends its chunk's logits >= g (key, id) to the row's candidate
//    list (warp-aggregated atomics; any order), then counts itself in; the row's last block to
//    arrive (threadfence reduction) selects the row's top k:
//      * <= 2048 candidates (the normal case): all of them as 64-bit (key, ~id), E per thread in
//        registers, padded to a power of two P, sorted descending by a bitonic network (strides
//        inside a thread in registers, inside a warp by shuffles, across warps through shared
//        memory); the first k are the answer (the largest logits, ties by lower id);
//      * more (long runs of equal or sorted logits): a radix select (11/11/10 bits, then on the ids
//        for ties) over the candidate list in global memory, or over the whole row if more than
//        kCap passed the bound, then a sort of the k winners;
//    written as logprob = logit - float32(max + log(sum)).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "kernels.h"
#include "launch.h"

namespace kdtree {
namespace cuda {
namespace {

constexpr int kThreads = 256;        // both kernels
constexpr int kCap = 8192;           // candidates the filter stores per row
constexpr int kSortMax = 2048;       // candidates the register sort takes (else the radix select)
constexpr int kMaxGroups = 16384;
constexpr int kChunkMax = 6144;      // logits per block (at most)
constexpr int kLoadBatch = kChunkMax / kThreads;  // global loads in flight per thread (a chunk: 24)

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
  int nchunk;  // blocks per row
  int gpc;     // groups per chunk (power of 2)
  int chunk;   // logits per chunk = gpc * gs
  int prof;    // KDTREE_TOPK_PROFILE builds: print phase cycles (KDTREE_TOPK_PROF=1)
};

// Phase profile (compile with -DKDTREE_TOPK_PROFILE, run with KDTREE_TOPK_PROF=1): clock64
// cycles between marks of thread 0, printed for the first and last block of row 0 (and the
// select of row 0's last block).
#ifdef KDTREE_TOPK_PROFILE
#define PROF_DECL long long tmark[8];
#define PROF_MARK(i) if (pl.prof && threadIdx.x == 0) tmark[i] = clock64();
#define PROF_PRINT(name, n, cond)                                                                        \
  if (pl.prof && threadIdx.x == 0 && (cond)) {                                                           \
    long long d[5] = {0, 0, 0, 0, 0};                                                                    \
    for (int q = 1; q < n; ++q) d[q - 1] = tmark[q] - tmark[q - 1];                                      \
    printf("%s b%d: %lld %lld %lld %lld %lld tot %lld\n", name, (int)blockIdx.x, d[0], d[1], d[2], d[3], \
           d[4], tmark[n - 1] - tmark[0]);                                                               \
  }
#else
#define PROF_DECL
#define PROF_MARK(i)
#define PROF_PRINT(name, n, cond)
#endif

inline Plan make_plan(int V, int k) {
  Plan p;
  int ng = 1024;
  while (ng < 8 * k && ng < kMaxGroups) ng <<= 1;
  p.NG = ng;
  p.gs = (V + ng - 1) / ng;
  if (p.gs < 1) p.gs = 1;
  p.gpc = p.NG;  // the largest power of 2 whose chunk fits kChunkMax
  while (p.gpc > 1 && (long long)p.gpc * p.gs > kChunkMax) p.gpc >>= 1;
  p.nchunk = p.NG / p.gpc;
  p.chunk = p.gpc * p.gs;
  p.prof = 0;
#ifdef KDTREE_TOPK_PROFILE
  static const int prof = [] {
    const char* v = std::getenv("KDTREE_TOPK_PROF");
    return v && v[0] == '1' ? 1 : 0;
  }();
  p.prof = prof;
#endif
  return p;
}

struct WsLayout {
  size_t o_max, o_sum, o_gmax, o_cnt, o_done, o_ck, o_ci, total;
};
inline WsLayout ws_layout(int D, const Plan& p) {
  WsLayout w;
  size_t o = 0, n = (size_t)D * p.nchunk;
  auto up = [](size_t b) { return (b + 255) / 256 * 256; };
  w.o_max = o;  o += up(n * 8);
  w.o_sum = o;  o += up(n * 8);
  w.o_gmax = o; o += up((size_t)D * p.NG * 4);
  w.o_cnt = o;  o += up((size_t)D * 4);          // candidates per row (may exceed kCap: then unused)
  w.o_done = o; o += up((size_t)D * 4);          // topk_filter blocks done per row
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

// ---------------------------------------------------------------- kernel 1: stats + group maxima
__global__ void __launch_bounds__(kThreads) topk_stats_kernel(TopkParams p, Plan pl, WsLayout wl) {
  pdl_prologue();
  PROF_DECL
  PROF_MARK(0)
  extern __shared__ __align__(16) unsigned char sm[];
  uint32_t* keys = (uint32_t*)sm;                                      // [chunk]
  double* red = (double*)(sm + ((size_t)pl.chunk * 4 + 15) / 16 * 16); // [32]
  const int row = blockIdx.y, ch = blockIdx.x;
  const long long c0 = (long long)ch * pl.chunk;
  int n = (int)((long long)p.V - c0);
  if (n > pl.chunk) n = pl.chunk;
  if (n < 0) n = 0;
  const float* x = p.logits + (size_t)row * p.ld + c0;
  uint32_t mk = 0;
  for (int base = 0; base < n; base += kThreads * kLoadBatch) {  // one trip for chunks <= kChunkMax
    float v[kLoadBatch];
#pragma unroll
    for (int j = 0; j < kLoadBatch; ++j) {
      const int i = base + j * kThreads + (int)threadIdx.x;
      v[j] = i < n ? __ldg(x + i) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kLoadBatch; ++j) {
      const int i = base + j * kThreads + (int)threadIdx.x;
      if (i < n) {
        const uint32_t k = float_key(v[j]);
        keys[i] = k;
        mk = max(mk, k);
      }
    }
  }
  PROF_MARK(1)
  mk = block_max_u<kThreads>(mk, (uint32_t*)red);
  const double mx = (double)key_float(mk);
  double s = 0.0;
  if (n > 0 && mk > float_key(-__int_as_float(0x7f800000))) {
    for (int i = threadIdx.x; i < n; i += kThreads) s += exp_nonpos((double)key_float(keys[i]) - mx);
  }
  s = block_sum_d<kThreads>(s, red);
  PROF_MARK(2)
  unsigned char* ws = (unsigned char*)p.workspace;
  const size_t slot = (size_t)row * pl.nchunk + ch;
  if (threadIdx.x == 0 && ch == 0) {  // topk_filter appends and counts in after this kernel
    ((int*)(ws + wl.o_cnt))[row] = 0;
    ((int*)(ws + wl.o_done))[row] = 0;
  }
  if (threadIdx.x == 0) {
    ((double*)(ws + wl.o_max))[slot] = n > 0 ? mx : -__longlong_as_double(0x7ff0000000000000LL);
    ((double*)(ws + wl.o_sum))[slot] = s;
  }
  // group maxima: tpg threads per group (<= 32, a power of 2; they stride over the group's
  // logits), reduced by shuffles
  uint32_t* gmax = (uint32_t*)(ws + wl.o_gmax) + (size_t)row * pl.NG + (size_t)ch * pl.gpc;
  const int tpg = pl.gpc >= kThreads / 32 ? (pl.gpc >= kThreads ? 1 : kThreads / pl.gpc) : 32;
  for (int g0 = 0; g0 < pl.gpc; g0 += kThreads / tpg) {  // uniform trip count
    const int g = g0 + (int)threadIdx.x / tpg, sub = (int)threadIdx.x % tpg;
    const int b = g * pl.gs, e = g < pl.gpc ? min(pl.gs, n - b) : 0;
    uint32_t m = 0;
#pragma unroll 4
    for (int i = sub; i < e; i += tpg) m = max(m, keys[b + i]);
    for (int off = tpg >> 1; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (sub == 0 && g < pl.gpc) gmax[g] = m;  // 0 (below every key) for an empty group
  }
  PROF_MARK(3)
  PROF_PRINT("stats", 4, blockIdx.y == 0 && (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1))
}

// ---------------------------------------------------------------- kernel 2: filter, then the last block selects
// A lower bound of the k-th largest of v[0..n) (1 <= k <= n): the k-th largest with its low 8 bits
// cleared. An 8-way bisection of the key space: 8 steps, each counting the values at or above 7
// thresholds (a warp reduction per threshold, per-warp slots in shared memory, one barrier,
// every thread adds the slots). cnt: 2 * 8 * 8 ints of shared memory (two alternating sets).
// All threads call it.
template <int NT>
__device__ uint32_t kth_bound(const uint32_t* v, int n, int k, int* cnt) {
  constexpr int NW = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long lo = 0, hi = 1ull << 32;  // count(>= lo) >= k > count(>= hi)
#pragma unroll 1
  for (int step = 0; step < 8; ++step) {
    const unsigned long long q = (hi - lo) >> 3;
    uint32_t t[7];
#pragma unroll
    for (int j = 0; j < 7; ++j) t[j] = (uint32_t)(lo + (unsigned long long)(j + 1) * q);
    unsigned c[7] = {0, 0, 0, 0, 0, 0, 0};
    for (int i = threadIdx.x; i < n; i += NT) {
      const uint32_t x = v[i];
#pragma unroll
      for (int j = 0; j < 7; ++j) c[j] += x >= t[j];
    }
    // set step & 1 was last read in step - 2; every thread is past that (barrier of step - 1)
    int* cs = cnt + (step & 1) * NW * 8;
#pragma unroll
    for (int j = 0; j < 7; ++j) {
      const unsigned cj = __reduce_add_sync(0xffffffffu, c[j]);
      if (lane == j) cs[warp * 8 + j] = (int)cj;
    }
    __syncthreads();
    int j_hi = 0;  // the largest j with count(>= t[j - 1]) >= k (counts fall with j)
#pragma unroll
    for (int j = 0; j < 7; ++j) {
      int C = 0;
#pragma unroll
      for (int w = 0; w < NW; ++w) C += cs[w * 8 + j];
      if (C >= k) j_hi = j + 1;
    }
    lo = lo + (unsigned long long)j_hi * q;
    if (j_hi < 7) hi = lo + q;
  }
  return (uint32_t)lo;
}

// ---------------------------------------------------------------- the select (in topk_filter's last block per row)
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

// The sort path of the select: the nc candidates (k <= nc <= P) as (key, ~id), E per thread for
// the first P / E threads, sorted descending; the first k written.
template <int E>
__device__ void sort_write(const TopkParams& p, int row, int nc, int P, const uint32_t* cks, const int32_t* cis,
                           unsigned long long* xs, float lse) {
  const int na = P / E;  // threads taking part (a multiple of 32)
  const int t = threadIdx.x;
  if (t >= na) return;
  unsigned long long v[E];
#pragma unroll
  for (int r = 0; r < E; ++r) {
    const int i = t * E + r;  // padding 0 sorts below every candidate (their ~id is > 0)
    v[r] = i < nc ? ((unsigned long long)__ldcg(cks + i) << 32) | (unsigned long long)(~(uint32_t)__ldcg(cis + i))
                  : 0ull;
  }
  bitonic_sort_desc<E>(v, xs, P, na);
#pragma unroll
  for (int r = 0; r < E; ++r) {
    const int i = t * E + r;
    if (i < p.k) {
      p.logprobs[(size_t)row * p.k + i] = key_float((uint32_t)(v[r] >> 32)) - lse;
      p.ids[(size_t)row * p.k + i] = (int32_t)(~(uint32_t)(v[r] & 0xffffffffull));
    }
  }
}

struct SelectSmem {
  int* hist;      // [2048]
  int* tmp;       // [32]
  int* misc;      // [8]
  unsigned long long* sortv;  // [1024]
};

template <int NT, class KeyFn, class IdFn>
__device__ void select_write(const TopkParams& p, int row, int n, KeyFn keyfn, IdFn idfn, float lse,
                             const SelectSmem& s) {
  const int k = p.k;
  int need_eq = k;
  uint32_t thr = 0, thr2 = 0;
  bool all_eq = true;
  if (k < n) {
    thr = radix_select<NT>(n, k, keyfn, s.hist, s.tmp, s.misc, &need_eq);
    int ce = 0;
    for (int i = threadIdx.x; i < n; i += NT) {
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
      thr2 = radix_select<NT>(
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
  for (int i = threadIdx.x; i < P; i += NT) s.sortv[i] = 0ull;
  if (threadIdx.x == 0) s.misc[4] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += NT) {
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
      for (int i = threadIdx.x; i < P; i += NT) {
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
  for (int i = threadIdx.x; i < k; i += NT) {
    const unsigned long long v = s.sortv[i];
    p.logprobs[(size_t)row * k + i] = key_float((uint32_t)(v >> 32)) - lse;
    p.ids[(size_t)row * k + i] = (int32_t)(~(uint32_t)(v & 0xffffffffull));
  }
}

// Shared (dynamic): region A = max(gk [NG], the select's: sort exchange [kSortMax] u64, or
// sortv [1024] u64 + hist [2048] + tmp [32] + misc [8]), then cnt [128], flag [4].
size_t filter_region_a(const Plan& pl) {
  const size_t sel = 1024 * 8 + (2048 + 32 + 8) * 4;
  size_t a = (size_t)pl.NG * 4;
  if (a < (size_t)kSortMax * 8) a = (size_t)kSortMax * 8;
  if (a < sel) a = sel;
  return (a + 15) / 16 * 16;
}

__global__ void __launch_bounds__(kThreads) topk_filter_kernel(TopkParams p, Plan pl, WsLayout wl, size_t region_a) {
  pdl_prologue();
  PROF_DECL
  PROF_MARK(0)
  extern __shared__ __align__(16) unsigned char sm[];
  uint32_t* gk = (uint32_t*)sm;
  int* cnt = (int*)(sm + region_a);
  int* flag = cnt + 128;
  const int row = blockIdx.y, ch = blockIdx.x;
  unsigned char* ws = (unsigned char*)p.workspace;
  const uint32_t* gsrc = (const uint32_t*)(ws + wl.o_gmax) + (size_t)row * pl.NG;
  for (int g = threadIdx.x; g < pl.NG; g += kThreads) gk[g] = gsrc[g];
  __syncthreads();
  PROF_MARK(1)
  const uint32_t g = kth_bound<kThreads>(gk, pl.NG, p.k, cnt);
  PROF_MARK(2)
  const long long c0 = (long long)ch * pl.chunk;
  int n = (int)((long long)p.V - c0);
  if (n > pl.chunk) n = pl.chunk;
  if (n < 0) n = 0;
  const float* x = p.logits + (size_t)row * p.ld;
  int* cntg = (int*)(ws + wl.o_cnt) + row;
  uint32_t* ck = (uint32_t*)(ws + wl.o_ck) + (size_t)row * kCap;
  int32_t* ci = (int32_t*)(ws + wl.o_ci) + (size_t)row * kCap;
  const int lane = threadIdx.x & 31;
  for (int base = 0; base < n; base += kThreads * kLoadBatch) {  // uniform trip count: whole warps vote
    float v[kLoadBatch];
#pragma unroll
    for (int j = 0; j < kLoadBatch; ++j) {
      const int i = base + j * kThreads + (int)threadIdx.x;
      v[j] = i < n ? __ldg(x + c0 + i) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kLoadBatch; ++j) {
      const int i = base + j * kThreads + (int)threadIdx.x;
      const uint32_t kk = float_key(v[j]);
      const bool take = i < n && kk >= g;
      const unsigned vote = __ballot_sync(0xffffffffu, take);
      if (vote == 0u) continue;
      int o0 = 0;
      if (lane == 0) o0 = atomicAdd(cntg, __popc(vote));
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
  PROF_MARK(3)
  PROF_PRINT("filter", 4, blockIdx.y == 0 && (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1))
  // count this block in; the row's last block to arrive goes on to the select (its appends and
  // every other block's are then visible: each thread fenced its own before the count)
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int old = atomicAdd((int*)(ws + wl.o_done) + row, 1);
    flag[0] = old == pl.nchunk - 1;
  }
  __syncthreads();
  if (!flag[0]) return;
  __threadfence();
  PROF_MARK(4)
  // ---- the row's select (this block's threads; region A is free: gk was last read in kth_bound)
  const int nc = __ldcg(cntg);
  const float lse = row_lse(pl, wl, row, ws);
  const uint32_t* cks = ck;
  const int32_t* cis = ci;
  if (nc >= p.k && nc <= kSortMax) {
    int P = 64;
    while (P < nc) P <<= 1;
    unsigned long long* xs = (unsigned long long*)sm;
    if (P <= 2 * kThreads) {
      sort_write<2>(p, row, nc, P, cks, cis, xs, lse);
    } else if (P <= 4 * kThreads) {
      sort_write<4>(p, row, nc, P, cks, cis, xs, lse);
    } else {
      sort_write<8>(p, row, nc, P, cks, cis, xs, lse);
    }
#ifdef KDTREE_TOPK_PROFILE
    PROF_MARK(5)
    if (pl.prof && threadIdx.x == 0 && row == 0)
      printf("select nc %d P %d: lse+sort+write %lld (arrival to end of filter %lld)\n", nc, P, tmark[5] - tmark[4],
             tmark[4] - tmark[3]);
#endif
    return;
  }
  SelectSmem s;
  s.sortv = (unsigned long long*)sm;  // [1024]
  s.hist = (int*)(s.sortv + 1024);    // [2048]
  s.tmp = s.hist + 2048;              // [32]
  s.misc = s.tmp + 32;                // [8]
  if (nc <= kCap) {  // many candidates (ties): select among them in global memory
    select_write<kThreads>(
        p, row, nc, [&](int i, uint32_t* kk) { *kk = __ldcg(cks + i); return true; },
        [&](int i) { return (int32_t)__ldcg(cis + i); }, lse, s);
  } else {  // more than the store holds (a sorted row): select over the whole row
    select_write<kThreads>(
        p, row, p.V, [&](int i, uint32_t* kk) { *kk = float_key(x[i]); return true; },
        [&](int i) { return (int32_t)i; }, lse, s);
  }
}

size_t stats_smem(const Plan& pl) { return ((size_t)pl.chunk * 4 + 15) / 16 * 16 + 32 * 8; }
size_t filter_smem(const Plan& pl) { return filter_region_a(pl) + (128 + 4) * 4; }

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
  static size_t done1 = 48 * 1024, done2 = 48 * 1024;
  cudaError_t e = ensure_smem(topk_stats_kernel, stats_smem(pl), &done1);
  if (e != cudaSuccess) return e;
  e = ensure_smem(topk_filter_kernel, filter_smem(pl), &done2);
  if (e != cudaSuccess) return e;
  e = launch_kernel(topk_stats_kernel, dim3(pl.nchunk, p.D), kThreads, stats_smem(pl), stream, p, pl, wl);
  if (e != cudaSuccess) return e;
  return launch_kernel(topk_filter_kernel, dim3(pl.nchunk, p.D), kThreads, filter_smem(pl), stream, p, pl, wl,
                       filter_region_a(pl));
}

}  // namespace cuda
}  // namespace kdtree
