// choose_kernels.cu: see choose_kernels.h (greedy block argmax; sampling with top-k / top-p
// filters through shared-memory gathers or an exact radix selection).
#include "engine/choose_kernels.h"

#include <cstdint>

#include "launch.h"

namespace kdtree {
namespace cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

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
      // the chosen bin j of this lane: its number and the count / mass above it and in it
      auto set_bin = [&](int j, long long ac, double am, long long bc, double bm) {
        sh.b_status = kSelExact;
        sh.b_bin = 255 - 8 * lane - j;
        sh.b_above_c = ac;
        sh.b_above_m = am;
        sh.b_bin_c = bc;
        sh.b_bin_m = bm;
      };
      if (hits) {
        if (lane == __ffs(hits) - 1) set_bin(hit, hc, hm, hbc, hbm);
      } else if (shift != 56 && lasts) {  // rounding: the parent crossed, its parts do not; its end
        if (lane == 31 - __clz(lasts)) set_bin(last, lc2, lm2, lbc, lbm);
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
    if (!isfinite(mx)) {  // +inf: the first +inf logit (the largest key); nothing finite: id 0 (sampler.cpp)
      if (tid == 0) p.choice[row] = mx > 0.f ? key_id(mck) : 0;
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

}  // namespace

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
