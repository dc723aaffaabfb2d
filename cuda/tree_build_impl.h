// tree_build_impl.h: the DDTree best-first tree build as ONE thread block's algorithm.
//
// Where it sits: included by cuda/tree_kernels.cu (GPU, one block of up to 1024 threads) and
// also compilable as plain host C++ (a "Ctx" that runs the block's threads on the CPU with a
// barrier), so the parallel logic can be checked without a GPU. No CUDA-only constructs here
// except behind KD_HD / __CUDA_ARCH__; the Ctx supplies thread id, barrier (also one that ORs a
// predicate over the block), atomics and four warp primitives (inclusive warp sum, warp total,
// shuffle, warp barrier; full mask: every lane of a warp calls them).
// ctx.step(n) marks n units of dependent serial work of the calling thread (a loop iteration,
// a binary-search step): a no-op on the GPU, the latency proxy of the CPU emulation.
//
// Semantics: docs/tree_contract.md, bit for bit (the NumPy heap in reference/tree.py).
// Legend: D = depth rows, K = top-k, B = budget, Keff = min(K, B) (a rank >= B is never
// popped: it needs B earlier pops of its own siblings), n = nodes built (n <= B).
//
// Three paths, one block, one launch (ONE-WARP PATH for small budgets: see warp_build()):
//  * PARALLEL EXACT PATH. When every score the heap can form is an exact float64 sum of the
//    float32 inputs (checked up front: the inputs' exponent span leaves room for D+1 terms in
//    53 bits), when every row is sorted descending and lp[d][0] <= 0 for d >= 1, the heap's
//    keys are monotone (a pushed candidate never beats the node that pushed it) and the pop
//    order equals the order of the top-B prefixes by (score desc, rank tuple asc). First a
//    threshold is estimated (fixed_threshold: a lower-bound count of prefixes by deficit, per-row
//    histograms convolved depth by depth); when the prefixes within it are at least B they hold
//    the tree, found level by level with no further threshold work. A parent's children count
//    there starts from its row's rank table (the estimate's histogram summed up, built by the
//    warps the estimate leaves idle), which narrows the search to one histogram bin of ranks. Otherwise (and for trees of
//    at most two levels) the adaptive levels: we find
//    that set level by level with a score threshold (a 2048-bucket histogram of the scores of
//    all prefixes materialised so far; a prefix in a bucket past the one holding the B-th is
//    out), bound each parent's children by a staircase argument (child rank r of a parent
//    that i_lb same-level nodes beat, with c_lt nodes of any level before it, has at least
//    c_lt + 1 + r + i_lb*(r+1) better prefixes), and finally rank the survivors by bucket
//    (counting sort) plus exact comparisons inside a bucket. Within a level, nodes are stored
//    in lexicographic order of their rank tuples, so the tie-break needs no tuples.
//    Latency (the build is latency-bound): the main histogram packs two 16-bit counts per
//    bucket (all levels | this level; counts <= cap < 2^16, so prefix sums never carry), with
//    per-32-bucket group counts kept by the same atomics; the scan is one warp per nonempty
//    group, started from a group prefix each warp forms itself (no inner barrier), and finds
//    the crossing bucket on the way. Children counts are summed in registers and offset with
//    one warp-total exchange. Common path: 4 block barriers per level (was 9). (An exact
//    score threshold inside the crossing bucket, which pruned children a little tighter, was
//    dropped in the fifth session: its O(bucket members) ranking and 2 barriers per level
//    cost more than the pruning saved, most on deep trees and tied scores.)
//  * SEQUENTIAL FALLBACK (thread 0): the reference heap verbatim (same float64 operation
//    order, NaN ranked like -inf, rank-tuple ties). Taken when the checks above fail or the
//    candidate store would overflow; slow (about 1 ms at B = 1024) but exact for any input.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#ifndef __CUDACC__
#include <cmath>
#endif

#ifndef KD_HD
#ifdef __CUDACC__
#define KD_HD __host__ __device__
#else
#define KD_HD
#endif
#endif

// KDTREE_TREE_PROFILE (GPU builds only, off by default): thread 0 adds the clock64() cycles since
// its previous mark to one of kProfCats categories at each mark (right after a block barrier, so
// an interval is the slowest thread's time for that part) and the kernel prints them per launch.
// A measuring aid (benchmarks/profile_cuda_tree_build.py); never compiled into the shipped module.
#if defined(KDTREE_TREE_PROFILE) && defined(__CUDA_ARCH__)
#define KD_TREE_MARK(cat) prof_mark(cat)
#elif defined(KDTREE_EMU_MARKS) && !defined(__CUDA_ARCH__)
#define KD_TREE_MARK(cat) ctx.mark(cat)  // the block emulation's latency proxy per phase
#else
#define KD_TREE_MARK(cat) ((void)0)
#endif

namespace kdtree {
namespace treeimpl {

// KD_TREE_MARK categories (a mark adds the time since the previous one to its category; P_START
// only restarts the clock) and two event counters (levels counted, probes run). P_RANK_PAR is no
// longer marked (the parents are mapped in write_outputs); kept so the profile line keeps its fields.
enum ProfCat {
  P_START = -1, P_PHASE0 = 0, P_LEVEL1, P_COUNT, P_PROBE, P_MAT, P_GSCAN, P_RANK_SORT, P_RANK_CMP, P_RANK_PAR,
  P_OUT, P_OTHER, P_OFFS, P_THR, P_THR_HIST, P_DPMAC, P_NODE, P_NARROW, P_OFFSUM, P_NLOAD, P_NSTORE, kProfTimed,
  P_LEVELS = kProfTimed, P_PROBES, kProfCats
};
constexpr const char* kProfNames[kProfTimed] = {"phase0", "level1", "count", "probe", "mat", "gscan",
                                                "rank-sort", "rank-cmp", "rank-par", "out", "other", "offs", "thr",
                                                "thrhist", "dpmac", "node", "narrow", "offsum", "nload", "nstore"};

constexpr int kMaxDepth = 16;      // D limit of the CUDA tree build
constexpr int kMaxBudget = 1024;   // B limit of the CUDA tree build (one block)
constexpr int kWarpPathMaxB = 8;   // == cuda::kTreeWarpPathMaxB (kernels.h; this header is also
                                   // built without CUDA for the block emulation test)
constexpr int kNB = 2048;          // score buckets
constexpr int kBottom = kNB - 1;   // bucket of -inf (and NaN) scores
constexpr int kNG = kNB / 32;      // bucket groups of 32 (one warp-wide scan each)
constexpr int kLo = 0xFFFF;        // packed counts: low 16 bits = all levels, high = this level
constexpr int kBoth = 0x10001;     // one more prefix in both halves (counts <= cap < 2^16)
constexpr uint16_t kRoot = 0xFFFF; // parent id of a depth-1 node in the candidate store
constexpr int kDpG = 64;           // threshold estimate: deficit bins (fixed_threshold)
constexpr int kDpCap = 8192;       // threshold estimate: counts saturate here (>= every budget;
                                   // products <= kDpCap * kMaxBudget, kDpG of them: no int overflow)
constexpr int kSZ = 67;            // threshold estimate: bin i of a count buffer sits at [kSZ + i], zeros below
                                   // (kSZ = 3 mod 4 puts dp_warp's windows on 16-byte boundaries)
constexpr int kSB = 136;           // ... and a buffer's length (two buffers in cur)
static_assert(kDpG == 64 && kSZ % 4 == 3 && kSZ >= kDpG + 2 && kSZ + kDpG + 1 <= kSB && kSB % 4 == 0 &&
                  2 * kSB <= kNB,
              "dp_warp: 4 bins x 32 k per lane pair, windows 16-byte aligned, reads within the zeros and the buffer");

KD_HD inline int vis_words(int B) { return (B + 64) / 64; }

// Shared-memory layout (bytes), the same on host and device.
struct TreeLayout {
  int cap, keff;
  size_t o_sc, o_par, o_rk, o_bk, o_dp, o_lpc, o_hist, o_hpre, o_gcnt, o_phist, o_pgc, o_cur, o_cnt,
      o_ord, o_nid, o_odp, o_ork, o_opar, o_misc, o_scan, total;
  size_t o_osc;  // the final ranking's scores in bucket order: [cap] doubles over phist .. cnt (dead by then)
};
// The order matters in three places: the fallback heap aliases sc .. dp (make_fallback_layout);
// the ranking's osc spans phist .. cnt; write_outputs stages the visibility rows in [0, o_par),
// everything the build no longer needs once the ranking is done (par and nid, which the output
// walk reads, sit above it; the layout grows there when the rows need more room).

KD_HD inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

KD_HD inline TreeLayout make_tree_layout(int B, int D, int K) {
  TreeLayout L;
  L.keff = K < B ? K : B;
  if (L.keff < 1) L.keff = 1;
  int cap = 4 * B + 512;
  if (cap > 6144) cap = 6144;
  L.cap = cap;
  size_t o = 0;
  L.o_sc = o;    o = align_up(o + sizeof(double) * cap, 16);
  L.o_rk = o;    o = align_up(o + sizeof(uint16_t) * cap, 16);
  L.o_bk = o;    o = align_up(o + sizeof(uint16_t) * cap, 16);
  L.o_dp = o;    o = align_up(o + sizeof(uint8_t) * cap, 16);
  L.o_lpc = o;   o = align_up(o + sizeof(float) * (size_t)(D > 0 ? D : 1) * L.keff, 16);
  L.o_hist = o;  o = align_up(o + sizeof(int) * kNB, 16);
  L.o_hpre = o;  o = align_up(o + sizeof(int) * kNB, 16);
  L.o_gcnt = o;  o = align_up(o + sizeof(int) * kNG, 16);
  L.o_phist = o; o = align_up(o + sizeof(int) * kNB, 16);
  L.o_pgc = o;   o = align_up(o + sizeof(int) * kNG, 16);
  L.o_cur = o;   o = align_up(o + sizeof(int) * kNB, 16);
  L.o_cnt = o;   o = align_up(o + sizeof(int) * (cap + 1), 16);
  L.o_osc = L.o_phist;  // phist, pgc, cur, cnt are adjacent: cnt grows (B > 912) to hold cap doubles
  if (o < L.o_osc + sizeof(double) * cap) o = align_up(L.o_osc + sizeof(double) * cap, 16);
  L.o_ord = o;   o = align_up(o + sizeof(uint16_t) * cap, 16);
  const size_t vis_bytes = sizeof(uint64_t) * (size_t)(B + 1) * vis_words(B);  // the staged rows
  if (o < vis_bytes) o = align_up(vis_bytes, 16);
  L.o_par = o;   o = align_up(o + sizeof(uint16_t) * cap, 16);
  L.o_nid = o;   o = align_up(o + sizeof(uint16_t) * cap, 16);
  L.o_odp = o;   o = align_up(o + sizeof(uint8_t) * (B + 1), 16);
  L.o_ork = o;   o = align_up(o + sizeof(uint16_t) * (B + 1), 16);
  L.o_opar = o;  o = align_up(o + sizeof(int16_t) * (B + 1), 16);
  L.o_misc = o;  o = align_up(o + sizeof(int) * 64, 16);
  L.o_scan = o;  o = align_up(o + sizeof(int) * 64, 16);
  L.total = o;
  return L;
}

// Arguments of one build. Pointers are device pointers on the GPU, host pointers in emulation.
struct TreeArgs {
  const float* lp;        // [D, ld] log-probs, rows sorted descending (first K used)
  const int32_t* ids;     // [D, ld] token ids
  int D, K, ld, B;        // depth rows, top-k, row stride (elements), budget
  int cache_len;          // positions = cache_len + depth
  int32_t* tokens;        // [B]      token of node i+1 (-1 past n)
  int32_t* depths;        // [B]      depth of node i+1 (0 past n)
  int32_t* parents;       // [B+1]    parents[0] = -1 (and -1 past n)
  int32_t* positions;     // [B+1]    cache_len + depth (-1 past n)
  uint64_t* visibility;   // [B+1, W] W = (B+64)/64; bit j%64 of word j/64 of row i: i sees j
  int32_t* n_out;         // [1]      n
  int32_t* path_out;      // [1]      0 = parallel exact path (adaptive threshold), 1 = sequential fallback,
                          //          2 = one-warp path, 3 = parallel exact path with the threshold estimate (may be null)
  int force_fallback;     // 0 = auto; testing: 1 = sequential path, 2 = one-warp path, 3 = parallel path,
                          //   4 = parallel path with the adaptive threshold only
  TreeLayout lay;         // make_tree_layout(B, D, K), filled by the launcher: read from the kernel's
                          // parameters, not recomputed by every thread (a chain of ~60 dependent
                          // instructions before the first load; thirty-sixth session: -0.2 us a tree)
};

// Fallback heap storage, aliased onto the candidate store (sc .. dp), which is large enough:
// heap (B+1) x (8+2+2+1) bytes plus rank tuples (B+1) x 16 x 2 bytes <= cap x 13 bytes.
struct FallbackLayout {
  size_t o_hsc, o_hpar, o_hrk, o_hdp, o_tup;
};
KD_HD inline FallbackLayout make_fallback_layout(int B) {
  FallbackLayout F;
  size_t o = 0;
  F.o_hsc = o;  o = align_up(o + sizeof(double) * (B + 1), 16);
  F.o_hpar = o; o = align_up(o + sizeof(int16_t) * (B + 1), 16);
  F.o_hrk = o;  o = align_up(o + sizeof(uint16_t) * (B + 1), 16);
  F.o_hdp = o;  o = align_up(o + sizeof(uint8_t) * (B + 1), 16);
  F.o_tup = o;
  return F;
}
// The heap / candidate arrays of the sequential fallback and the one-warp path, in the block's
// shared memory at `base` (laid out by make_fallback_layout).
struct FallbackViews {
  double* hsc;     // [B+1] scores (float64)
  int16_t* hpar;   // [B+1] parent node
  uint16_t* hrk;   // [B+1] rank in the parent's row
  uint8_t* hdp;    // [B+1] depth
  uint16_t* tup;   // [B+1][kMaxDepth] rank tuple of each node
  KD_HD FallbackViews(unsigned char* base, int B) {
    const FallbackLayout F = make_fallback_layout(B);
    hsc = (double*)(base + F.o_hsc);
    hpar = (int16_t*)(base + F.o_hpar);
    hrk = (uint16_t*)(base + F.o_hrk);
    hdp = (uint8_t*)(base + F.o_hdp);
    tup = (uint16_t*)(base + F.o_tup);
  }
};

// ---------------------------------------------------------------- small portable helpers
// The bits of x read as another type of the same size (std::bit_cast, which C++17 lacks); a
// 4- or 8-byte memcpy between registers compiles to a plain move on the device as on the host.
template <class To, class From>
KD_HD inline To bits_as(From x) {
  static_assert(sizeof(To) == sizeof(From), "bits_as: the two types must have the same size");
  To t;
  std::memcpy(&t, &x, sizeof(To));
  return t;
}
// W consecutive floats (W = 4: 16-byte aligned) between global / shared memory and registers.
template <int W>
KD_HD inline void load_row(const float* p, float (&x)[W]) {
#ifdef __CUDA_ARCH__
  if constexpr (W == 4) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
  } else
#endif
  {
    for (int j = 0; j < W; ++j) x[j] = p[j];
  }
}
// Four consecutive ints (16-byte aligned) from shared memory into registers.
KD_HD inline void load_int4(const int* p, int* x) {
#ifdef __CUDA_ARCH__
  const int4 v = *reinterpret_cast<const int4*>(p);
  x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
#else
  for (int j = 0; j < 4; ++j) x[j] = p[j];
#endif
}
// Four ints to 16-byte aligned shared memory.
KD_HD inline void store_int4(int* p, int x0, int x1, int x2, int x3) {
#ifdef __CUDA_ARCH__
  *reinterpret_cast<int4*>(p) = make_int4(x0, x1, x2, x3);
#else
  p[0] = x0; p[1] = x1; p[2] = x2; p[3] = x3;
#endif
}
template <int W>
KD_HD inline void store_row(float* p, const float (&x)[W]) {
#ifdef __CUDA_ARCH__
  if constexpr (W == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
  } else
#endif
  {
    for (int j = 0; j < W; ++j) p[j] = x[j];
  }
}
KD_HD inline int clz32(uint32_t x) {  // x != 0
#ifdef __CUDA_ARCH__
  return __clz((int)x);
#else
  return __builtin_clz(x);
#endif
}
// floor(log2 x) of a positive finite float (subnormals included)
KD_HD inline int float_exponent(float x) {
  const uint32_t bits = bits_as<uint32_t>(x);
  const int e = (int)(bits >> 23);
  return e != 0 ? e - 127 : -149 + (31 - clz32(bits & 0x7FFFFFu));
}
// Phase 0's exponent bounds, one element v at a time, without a branch or a bit scan: amax = the
// largest |v| and qmin = the smallest quantum (the value of v's lowest set significand bit, a power
// of two: |v| minus |v| with that bit cleared, exact; |v| itself when the significand is the
// implicit bit alone) over the nonzero finite elements (start: 0 and +inf); float_exponent of the
// two gives the largest exponent and the smallest quantum exponent (the exactness test's maxe and
// minq), once a thread. The per-element exponent arithmetic with a BREV + FLO bit scan in two
// branches (normal, subnormal) was ~20 instructions: -0.26 us at peaked B = 256 in a same-lease
// A/B on an H100 (fifty-seventh session, docs/BENCHMARKS.md).
KD_HD inline void exponent_bounds(float v, float& amax, float& qmin) {
  const uint32_t bits = bits_as<uint32_t>(v) & 0x7FFFFFFFu;
  const bool fin = bits - 1u < 0x7F7FFFFFu;  // nonzero and finite
  const float av = bits_as<float>(bits);
  const float qv = (bits & 0x7FFFFFu) ? av - bits_as<float>(bits & (bits - 1u)) : av;
  amax = fin && av > amax ? av : amax;
  qmin = fin && qv < qmin ? qv : qmin;
}
KD_HD inline bool is_nan_d(double x) { return x != x; }
KD_HD inline float neg_inf_f() { return -__builtin_huge_valf(); }
KD_HD inline double neg_inf_d() { return -__builtin_huge_val(); }
KD_HD inline double pos_inf_d() { return __builtin_huge_val(); }

// Score bucket: nondecreasing in (smax - s), i.e. a better score never lands in a later bucket.
// 64 buckets per binade of delta in [2^-23, 2^9); clamped at both ends; -inf -> kBottom.
KD_HD inline int bucket_of_delta(double delta) {  // delta = smax - s, finite
  if (!(delta > 0.0)) return 0;
  uint32_t bits = bits_as<uint32_t>((float)delta);
  int idx = (int)(bits >> 17) - ((127 - 23) << 6) + 1;
  if (idx < 1) idx = 1;
  if (idx > kNB - 2) idx = kNB - 2;
  return idx;
}
KD_HD inline int bucket_of(double smax, double s) {
  if (s == neg_inf_d()) return kBottom;
  return bucket_of_delta(smax - s);
}


// The same test without the float conversion: for bt < kBottom and any s (finite or -inf),
// bucket_of(smax, s) <= bt  <=>  smax - s < bucket_limit(bt). bucket_of rounds delta = smax - s
// to float (nearest, ties to even) and keeps bits >> 17; bucket <= bt (1 <= bt <= kNB - 3) means
// (float)delta < F = the float with bits (bt + (127 - 23) * 64) << 17, i.e. delta below the midpoint
// of F and its predecessor (a tie there rounds to F, whose last mantissa bit is 0). bt = 0 holds
// only delta <= 0 (the clamp puts every positive delta in bucket >= 1), bt >= kNB - 2 every finite
// delta (the top clamp). s = -inf gives delta = +inf: never below the limit (bucket kBottom).
KD_HD inline double bucket_limit(int bt) {
  if (bt <= 0) return bits_as<double>(uint64_t{1});  // the smallest positive double: delta < it <=> delta <= 0
  if (bt >= kNB - 2) return pos_inf_d();
  const uint32_t U = (uint32_t)(bt + ((127 - 23) << 6)) << 17;
  return ((double)bits_as<float>(U - 1) + (double)bits_as<float>(U)) * 0.5;  // exact: two adjacent floats
}

// The children of a parent of score s that keep a bucket <= bt (bt < kBottom) are the ranks r
// with smax - (s + row[r]) < lim, lim = bucket_limit(bt). With the parallel path's exact float64
// sums (phase 0's span check) that is row[r] > tau = (smax - s) - lim in real numbers, and for a
// float v, v > tau <=> v > floor_float(tau) (the largest float <= tau; -inf for lim = +inf). So
// the binary searches over a row compare floats against this value: one float compare per step
// instead of a conversion, two double additions and a double compare. Exact: tau = t + e by
// TwoSum (t = fl(A - lim), e its rounding error); rounding t down to a float gives floor_float(tau)
// except when t is a float itself and e < 0 (then the float below it); when t is not a float,
// |e| is below the gap between t and the float below it. On the device the same value comes from
// directed rounding in two instructions (fifty-eighth session: -0.17 to -0.40 us a tree at peaked B = 16 ..
// 1024 on an H100; the TwoSum's dependent double operations were on every parent's children count): t' = A - lim rounded
// down is the largest double <= tau, and that rounded down to a float is the largest float <= t', which
// is the largest float <= tau (every float <= tau is a double <= tau, so <= t'). The block emulation
// checks the two formulas against each other (test_tree_block_emulation, check_child_floor).
KD_HD inline float child_floor(double smax, double s, double lim) {
  if (lim == pos_inf_d()) return neg_inf_f();
#ifdef __CUDA_ARCH__
  return __double2float_rd(__dsub_rd(smax - s, lim));
#else
  const double A = smax - s, b = -lim;
  const double t = A + b;
  const double bb = t - A;
  const double e = (A - (t - bb)) + (b - bb);
  float f = (float)t;
  if ((double)f > t) f = std::nextafter(f, neg_inf_f());
  if ((double)f == t && e < 0.0) f = std::nextafter(f, neg_inf_f());
  return f;
#endif
}

// misc[] slots in shared memory
enum {
  M_FAIL = 0, M_MAXE = 1, M_MINQ = 2, M_USED = 3, M_BT = 4, M_N = 5, M_BT2 = 6, M_T = 7,
  M_FB = 8,   // [kMaxDepth] first bottom (-inf/NaN) rank per row (Keff if none)
  M_FIX = 24, // how the parallel path ended: 0 adaptive (no estimate), 1 fixed threshold, 2 fixed then adaptive
  M_LS = 28,  // [kMaxDepth + 2] level start offsets in the candidate store
  M_WD = 48, M_WT = 49, M_WU = 50, M_WP = 51,  // fixed_levels: warp 0 hands back (depth, T, used, p0)
  M_DPB = 52, // fixed_threshold: the crossing dp_warp found (warp 0 hands it to the block)
};
static_assert(M_LS + kMaxDepth + 2 <= M_WD && M_WP < M_DPB && M_DPB < 64, "misc[] slots overlap or pass its 64 ints (make_tree_layout)");

// ---------------------------------------------------------------- the block algorithm
template <class Ctx>
struct TreeBlock {
  Ctx& ctx;
  const TreeArgs& a;
  TreeLayout L;
  unsigned char* sm;
  int tid, nt, lgnt, lane, warp, nw, B, D, keff, cap;
  double* sc; uint16_t* par; uint16_t* rk; uint16_t* bk; uint8_t* dp; float* lpc;
  int* hist; int* hpre; int* gcnt; int* phist; int* pgc; int* cur; int* cnt; uint16_t* ord;
  uint16_t* nid;
  uint8_t* odp; uint16_t* ork; int16_t* opar; int* misc; int* scan_tmp;
  double smax;
  float dp_inv = 0.0f;  // fixed_threshold's 1 / w (the rank tables in hpre use it)
#if defined(KDTREE_TREE_PROFILE) && defined(__CUDA_ARCH__)
  long long prof_acc[kProfCats] = {0};
  long long prof_last = 0;
  __device__ void prof_mark(int cat) {
    if (tid == 0) {
      const long long t = clock64();
      if (cat >= 0) prof_acc[cat] += t - prof_last;
      prof_last = t;
    }
  }
#define KD_TREE_COUNT(ev) (tid == 0 ? (void)++prof_acc[ev] : (void)0)
#else
#define KD_TREE_COUNT(ev) ((void)0)
#endif

  KD_HD TreeBlock(Ctx& c, const TreeArgs& args, unsigned char* smem) : ctx(c), a(args), sm(smem) {
    tid = ctx.tid();
    nt = ctx.nthreads();  // a multiple of 32
    lane = tid & 31;
    warp = tid >> 5;
    nw = nt >> 5;
    lgnt = 31 - clz32((uint32_t)nt);  // nt is a power of two (a loop here cost ~0.1 us a tree)
    B = a.B;
    D = a.D;
    L = a.lay;
    keff = L.keff;
    cap = L.cap;
    sc = (double*)(sm + L.o_sc);
    par = (uint16_t*)(sm + L.o_par);
    rk = (uint16_t*)(sm + L.o_rk);
    bk = (uint16_t*)(sm + L.o_bk);
    dp = (uint8_t*)(sm + L.o_dp);
    lpc = (float*)(sm + L.o_lpc);
    hist = (int*)(sm + L.o_hist);
    hpre = (int*)(sm + L.o_hpre);
    gcnt = (int*)(sm + L.o_gcnt);
    phist = (int*)(sm + L.o_phist);
    pgc = (int*)(sm + L.o_pgc);
    cur = (int*)(sm + L.o_cur);
    cnt = (int*)(sm + L.o_cnt);
    ord = (uint16_t*)(sm + L.o_ord);
    nid = (uint16_t*)(sm + L.o_nid);
    odp = (uint8_t*)(sm + L.o_odp);
    ork = (uint16_t*)(sm + L.o_ork);
    opar = (int16_t*)(sm + L.o_opar);
    misc = (int*)(sm + L.o_misc);
    scan_tmp = (int*)(sm + L.o_scan);
    smax = 0.0;
  }

  // Histogram scan, one block barrier (at the end). h: bucket counts, gc: their sums per group
  // of 32 buckets (kept by the same atomics), both complete (a barrier since the last update).
  // Writes pre[b] = the exclusive prefix of h (if pre) for every bucket of a NONEMPTY group
  // (buckets of empty groups hold no prefix, so nobody reads their pre), and misc[slot] = the
  // bucket holding the B-th prefix, counting h & mask (misc[slot] must be kBottom already; it
  // stays so with fewer than B prefixes). Each warp scans whole groups with shuffles, starting
  // from the group prefix it scans itself: no shared scratch, no inner barrier.
  // clear_level: h is the packed main histogram; zero its high halves (the level counts) once
  // read, ready for the next level.
  KD_HD void gscan(int* h, const int* gc, int* pre, int mask, int slot, bool clear_level) {
    const int ga = gc[2 * lane], gb = gc[2 * lane + 1];  // kNG = 64 = 2 per lane
    const int gx = ctx.warp_incl_sum(ga + gb) - ga - gb;  // prefix of group 2*lane
    for (int g = warp; g < kNG; g += nw) {              // warp-uniform trip count and branches
      ctx.step(1);
      if (gc[g] == 0) continue;
      const int base = ctx.warp_shfl((g & 1) ? gx + ga : gx, g >> 1);
      const int b = g * 32 + lane;
      const int v = h[b];
      const int ex = base + ctx.warp_incl_sum(v) - v;
      if (pre) pre[b] = ex;
      if ((ex & mask) < B && ((ex + v) & mask) >= B) misc[slot] = b;  // unique writer
      if (clear_level) h[b] = v & kLo;
      ctx.step(2);
    }
    ctx.sync();
  }

  // cnt[j] = the exclusive prefix of the children counts c[j] of the np parents (j < np; c[j]
  // in nid[j] if from_nid, else in cnt[j]); returns the total to every thread. The calling
  // thread owns parents [j0, j1) (contiguous runs in thread order) and passes s = the sum of
  // its c[j]. Two block barriers, the last at the end.
  KD_HD int offsets(bool from_nid, int s, int j0, int j1) {
    const int incl = ctx.warp_incl_sum(s);
    if (lane == 31) scan_tmp[warp] = incl;
    ctx.sync();
    const int wt = lane < nw ? scan_tmp[lane] : 0;
    const int wi = ctx.warp_incl_sum(wt);
    const int total = ctx.warp_shfl(wi, 31);
    int run = ctx.warp_shfl(wi - wt, warp) + incl - s;
    for (int j = j0; j < j1; ++j) {
      ctx.step(1);
      const int c = from_nid ? (int)nid[j] : cnt[j];
      cnt[j] = run;
      run += c;
    }
    ctx.sync();
    return total;
  }

  // Number of children (ranks 0..c-1) of parent p at level d that can still be in the tree.
  KD_HD int count_children(int p, int d, int bt) const {
    int b = bk[p];
    if (b > bt) return 0;
    const int pre = hpre[b];       // low half: all prefixes in better buckets; high: the level's
    int avail = B - 1 - (pre & kLo);  // better prefixes than (p, r) number >= that + 1 + r + ...
    if (avail <= 0) return 0;
    int fb = misc[M_FB + d - 1];  // children r >= fb have score -inf
    if (b == kBottom) return avail < keff ? avail : keff;  // a -inf parent: only siblings bound it
    int ilb = pre >> 16;                                  // same-level nodes strictly better
    int capf = avail / (1 + ilb);
    if (capf > fb) capf = fb;
    int c;
    if (capf < fb || fb >= keff) {
      c = capf;
    } else {  // every finite child allowed; -inf children only bounded by their siblings
      c = avail < keff ? avail : keff;
    }
    if (bt == kBottom) return c;
    // children keep a bucket <= bt (child_floor: the same test)
    return ranks_above(lpc + (size_t)(d - 1) * keff, 0, c, child_floor(smax, sc[p], bucket_limit(bt)));
  }

  // The first rank r in [lo, hi) with row[r] <= fl, or hi (rows are sorted descending, so the ranks
  // r with row[r] > fl, i.e. the children that pass child_floor's test, are a prefix): the children
  // count of every search below.
  KD_HD int ranks_above(const float* row, int lo, int hi, float fl) const {
    while (lo < hi) {
      ctx.step(1);
      const int mid = (lo + hi) >> 1;
      if (row[mid] > fl) lo = mid + 1; else hi = mid;
    }
    return lo;
  }

  // Ranks of level d's row before its first -inf (children past it have score -inf).
  KD_HD int row_end(int d) const {
    const int fb = misc[M_FB + d - 1];
    return fb < keff ? fb : keff;
  }

  // Position j of the parent owning item t: the last j with off[j] <= t (off has np+1 entries).
  KD_HD int owner(const int* off, int np, int t) const {
    int lo = 0, hi = np;  // off[0] = 0 <= t < off[np]
    while (hi - lo > 1) {
      ctx.step(1);
      int mid = (lo + hi) >> 1;
      if (off[mid] <= t) lo = mid; else hi = mid;
    }
    return lo;
  }

  KD_HD bool lex_less(int x, int y) const {  // rank tuple of x < rank tuple of y (x != y)
    int dx = dp[x], dy = dp[y];
    if (dx == dy) return x < y;
    if (dx < dy) {
      int yy = y;
      ctx.step(dy - dx);
      for (int k = dy; k > dx; --k) yy = par[yy];
      if (yy == x) return true;
      return x < yy;
    }
    int xx = x;
    ctx.step(dx - dy);
    for (int k = dx; k > dy; --k) xx = par[xx];
    if (xx == y) return false;
    return xx < y;
  }

  // Phase 0's element checks (parallel_build) for items of W consecutive elements of a row
  // (W = 4 needs vec4_ok: every row 16-byte aligned, Keff a multiple of 4).
  KD_HD bool vec4_ok() const {
    return keff % 4 == 0 && a.ld % 4 == 0 && (reinterpret_cast<uintptr_t>(a.lp) & 15) == 0;
  }
  // The row of phase 0's item `it` (per_row items a row): it / per_row, as a shift when per_row is a
  // power of two (K = B = 2^k: the common case). A runtime integer division is ~20 instructions
  // around a MUFU.RCP, and this one delays the first loads' issue (thirty-fifth session: the
  // divisions and runtime trip counts taken off the build's path cost 0.7 us at peaked B = 256).
  KD_HD static int item_row(int it, int per_row) {
    if ((per_row & (per_row - 1)) == 0) return it >> (31 - clz32((uint32_t)per_row));
    return it / per_row;
  }

  // Phase 0's first two items of this thread (item = W consecutive elements of a row and the
  // element before them), loaded before the scratch initialisation and its barrier so that their
  // global-memory latency overlaps it (the loads cannot move across a barrier by themselves).
  template <int W>
  struct RowItems {
    float x[2][W];
    float prev[2];
    int d[2], r0[2];  // the items' row and first column
  };
  template <int W>
  KD_HD void load_items(RowItems<W>& P) const {
    const int per_row = keff / W, nitems = D * per_row;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int it = tid + k * nt;
      if (it < nitems) {
        const int d = item_row(it, per_row), r0 = (it - d * per_row) * W;
        const float* rowp = a.lp + (size_t)d * a.ld;
        load_row<W>(rowp + r0, P.x[k]);
        P.prev[k] = r0 > 0 ? rowp[r0 - 1] : 0.0f;  // the left neighbour (unused for r0 = 0)
        P.d[k] = d;
        P.r0[k] = r0;
      }
    }
  }
  template <int W>
  KD_HD void check_rows(const RowItems<W>& P) {
    const int per_row = keff / W;  // items per row
    const int nitems = D * per_row;
    if (tid >= nitems) return;  // (small inputs: most threads have none)
    bool bad = false;
    float amax = 0.0f, qmin = -neg_inf_f();  // 0 / +inf: no nonzero finite element yet
    // (Per element: one compare for NaN / +inf, the order against the left neighbour (r > 0 is
    // known for j > 0), the -inf count and the exponent bounds; the rest once an item.)
    auto check = [&](int d, int r0, const float (&x)[W], float prev) {
      int above = 0;  // elements above -inf
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const float v = x[j];
        bad |= !(v < -neg_inf_f());                  // NaN, +inf
        if (j > 0 || r0 > 0) bad |= !(v <= prev);   // not sorted (or NaN before)
        above += v > neg_inf_f();
        exponent_bounds(v, amax, qmin);
        prev = v;
      }
      bad |= d > 0 && r0 == 0 && x[0] > 0.0f;  // child would beat parent
      store_row<W>(lpc + (size_t)d * keff + r0, x);
      // sorted rows (else `bad`, and the parallel path reads no M_FB) hold their -inf as a suffix:
      // the item's first -inf rank is r0 + above
      if (above < W) ctx.atomic_min(&misc[M_FB + d], r0 + above);
    };
    ctx.step(1);
    check(P.d[0], P.r0[0], P.x[0], P.prev[0]);
    if (tid + nt < nitems) {
      ctx.step(1);
      check(P.d[1], P.r0[1], P.x[1], P.prev[1]);
    }
    if (tid + 2 * nt < nitems) {  // large inputs (K = 1024, or unaligned rows): more items
      int d = item_row(tid + 2 * nt, per_row), q = tid + 2 * nt - d * per_row;
      const int dd = item_row(nt, per_row), dq = nt - dd * per_row;  // a step of nt items: dd rows and dq items
      for (int it = tid + 2 * nt; it < nitems; it += nt) {
        ctx.step(1);
        const float* rowp = a.lp + (size_t)d * a.ld;
        const int r0 = q * W;
        float x[W];
        load_row<W>(rowp + r0, x);
        check(d, r0, x, r0 > 0 ? rowp[r0 - 1] : 0.0f);
        d += dd;
        q += dq;
        if (q >= per_row) { q -= per_row; ++d; }
      }
    }
    if (bad) ctx.atomic_max(&misc[M_FAIL], 1);
    if (amax > 0.0f) {  // floor(log2) of the largest |v| and of the smallest quantum
      ctx.atomic_max(&misc[M_MAXE], float_exponent(amax));
      ctx.atomic_min(&misc[M_MINQ], float_exponent(qmin));
    }
  }

  // Returns n >= 0, or -1 when the parallel path cannot be used (then nothing is output yet).
  // *fixed: the threshold estimate gave the tree (also in misc[M_FIX] for the profile, written by
  // thread 0 only). adaptive_only (testing): no estimate.
  KD_HD int parallel_build(bool adaptive_only, bool* fixed) {
    *fixed = false;
    KD_TREE_MARK(P_START);
    // ---- phase 0: one pass over the inputs: the exactness / monotonicity / sortedness checks
    // (rows must be finite-descending then -inf; NaN, +inf, a finite after -inf, or
    // lp[d][0] > 0 for d >= 1 send us to the fallback), first -inf rank per row, exponents.
    const bool vec4 = vec4_ok() && D * (keff / 4) * 2 >= nt;
    RowItems<4> P4;
    RowItems<1> P1;
    if (vec4) load_items<4>(P4);
    else load_items<1>(P1);
    if (tid == 0) {
      misc[M_FAIL] = 0;
      misc[M_MAXE] = -100000;
      misc[M_MINQ] = 100000;
      for (int d = 0; d < kMaxDepth; ++d) misc[M_FB + d] = keff;
    }
    // 16 bytes a store (the thirty-ninth session's one int a store took four trips of the loop at 512
    // threads; this one trip: -0.2 to -0.3 us a tree on the H200, fortieth session). (Not unrolled:
    // an unrolled loop of runtime stride nt starts with an integer division for its trip count, on
    // the path of every tree.)
    static_assert(kNB % 4 == 0 && (kMaxDepth * kDpG) % 4 == 0 && (2 * kSB) % 4 == 0, "phase 0's 16-byte stores");
#pragma unroll 1
    for (int i = tid; i < kNB / 4; i += nt) {  // (phist and cur: the threshold estimate's scratch)
      ctx.step(1);
      const int e = 4 * i;
      store_int4(hist + e, 0, 0, 0, 0);
      if (e < kMaxDepth * kDpG) store_int4(phist + e, 0, 0, 0, 0);
      if (e < 2 * kSB) {  // fixed_threshold's S_0 (the root, in every bin), zeros
        auto s0 = [](int x) { return x >= kSZ && x < kSZ + kDpG ? 1 : 0; };
        store_int4(cur + e, s0(e), s0(e + 1), s0(e + 2), s0(e + 3));
      }
    }
    if (tid < kNG) gcnt[tid] = 0;
    ctx.sync();
    // (The items' loads were issued above, before the scratch initialisation and its barrier.)
    // Issue-bound, not latency-bound: the block's threads share one SM's schedulers. The
    // per-element loop (an integer division for the row, two scalar loads, the checks, atomics
    // the compiler aggregates per warp) was ~100 SASS instructions per element: ~15k cycles at
    // D = 15, K = 1024 (benchmarks/profile_cuda_tree_build.py). Now check_rows: items of 4
    // elements (one 16-byte load and the left neighbour) where the rows allow it and there are
    // at least half as many items as threads (small inputs, the engine's K = 8, keep one element
    // per thread: the 4-element items left them to one warp and were slower), one division per
    // item for a thread's first two items and the row and column advanced by additions after
    // them, the checks kept in registers and published with one atomic per bound per thread (a
    // -inf boundary, rare, still per item).
    if (vec4) {
      check_rows<4>(P4);
    } else {
      check_rows<1>(P1);
    }
    ctx.sync();
    {
      // exact float64 sums: every intermediate has <= D+1 terms of magnitude < 2^(maxe+1),
      // all multiples of 2^minq: exact when (maxe + 1 + ceil(log2(D+1))) - minq <= 53.
      int lg = 0;
      while ((1 << lg) < D + 1) ++lg;
      const bool inexact = misc[M_MAXE] > -100000 && misc[M_MAXE] + 1 + lg - misc[M_MINQ] > 53;
      if (misc[M_FAIL] || inexact || misc[M_FB + 0] == 0) return -1;  // lp[0][0] = -inf too
    }
    smax = (double)lpc[0];
    KD_TREE_MARK(P_PHASE0);
    // ---- the threshold estimate, then the levels with that fixed threshold; if the estimate
    // fails (no crossing, too many candidates, or fewer than B found) the adaptive levels.
    const int btf = adaptive_only ? kBottom : fixed_threshold();
    KD_TREE_MARK(P_THR);
    int n = build_levels(btf);  // btf = kBottom: the adaptive levels at once
    *fixed = btf < kBottom && n != -2;
    if (tid == 0) misc[M_FIX] = btf == kBottom ? 0 : n == -2 ? 2 : 1;
    if (n == -2) {  // the estimate failed (every thread returned at the same barrier-ordered point)
      // (not unrolled: no trip-count division)
#pragma unroll 1
      for (int i = tid; i < kNB / 4; i += nt) { ctx.step(1); store_int4(hist + 4 * i, 0, 0, 0, 0); }
      if (tid < kNG) gcnt[tid] = 0;
      ctx.sync();
      n = build_levels(kBottom);
    }
    return n;
  }

  // The fixed threshold's child count of a parent of score sp at level d: the ranks r < the row's
  // first -inf with smax - (sp + row[r]) < lim, by the same float search as count_children.
  KD_HD int count_fixed(double sp, int d, double lim) const {
    const float* row = lpc + (size_t)(d - 1) * keff;
    const float fl = child_floor(smax, sp, lim);
    int lo = 0;
    if (keff % 4 == 0 && keff >= 8) {
      // most parents have few children: ranks 0..7 at once (two 16-byte loads; a -inf past fb
      // never counts), the binary search only past them. Rows are sorted: the ranks above fl
      // are a prefix, so this count is min(children, 8).
      float x[4], y[4];
      load_row<4>(row, x);
      load_row<4>(row + 4, y);
      int c = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) c += (x[e] > fl) + (y[e] > fl);
      if (c < 8) return c;
      lo = 8;
    }
    return ranks_fixed(d - 1, lo, fl);
  }

  // The fixed path's count of the ranks r in [lo, row end) of row d (0-based) with row[r] > fl, from
  // the row's rank table (ranks_hint) when it has one: the tables exist for rows of more than 8
  // ranks; shorter rows are done by count_fixed's first 8 when keff is a multiple of 4, else by a
  // search of at most 3 steps.
  KD_HD int ranks_fixed(int d, int lo, float fl) const {
    const float* row = lpc + (size_t)d * keff;
    return keff > 8 ? ranks_hint(row, d, lo, row_end(d + 1), fl) : ranks_above(row, lo, row_end(d + 1), fl);
  }

  // ranks_above(row, lo, hi, fl) for row d of the fixed path, its search narrowed by the row's rank
  // table first (hpre[d][k] = the ranks r < hi with ceil((row[0] - row[r]) * dp_inv) <= k, from the
  // estimate's histogram H[d]). g(v) = (row[0] - v) * dp_inv in floats is nonincreasing in v, so with
  // K = ceil(g(fl)): a rank of bin < K has row[r] > fl (a child), one of bin > K has row[r] < fl,
  // and ranks past the table (their g > 63) are children only when K > 63. The answer lies in
  // [table[K - 1], table[K]]: two loads and a search of the one bin instead of ~log2(hi) steps.
  KD_HD int ranks_hint(const float* row, int d, int lo, int hi, float fl) const {
    const float x = (row[0] - fl) * dp_inv;
    const int* tab = hpre + d * kDpG;
    int l2 = lo, h2 = hi;
    if (x < (float)kDpG) {
      int K = (int)ceilf(x);
      if (K < 0) K = 0;  // (fl >= row[0]: no children; table[0] is still an upper bound)
      const int a0 = K >= 1 ? tab[K - 1] : 0;  // (K <= kDpG: x < kDpG)
      if (K < kDpG) h2 = tab[K];
      l2 = a0 > lo ? a0 : lo;
    } else {
      const int a0 = tab[kDpG - 1];
      l2 = a0 > lo ? a0 : lo;
    }
    if (h2 > hi) h2 = hi;
    if (h2 < l2) h2 = l2;
    const int r = ranks_above(row, l2, h2, fl);
#if defined(KDTREE_EMU_MARKS) && !defined(__CUDA_ARCH__)
    {  // block emulation: the answer of a plain scan of [lo, hi) (no ctx.step: the latency proxy is unchanged)
      int ref = lo;
      while (ref < hi && row[ref] > fl) ++ref;
      ctx.emu_hint_check(r, ref, h2 - l2);
    }
#endif
    return r;
  }

  // Threshold estimate (a speed device only: build_levels checks what it gives). A prefix's
  // deficit is smax minus its score. Split it into the chain part, sp_n = sum over its depths d of
  // -lp[d][0] (d >= 1: what the top ranks would cost; the same for every depth-n prefix), and the
  // rank part, the sum of e_d(r) = lp[d][0] - lp[d][r] >= 0 over its ranks (0 for a top rank, so
  // a confident drafter's deep chains carry no rounding). With every e rounded up to a multiple of
  // w, the prefixes are counted by a convolution of per-row histograms, one depth at a time:
  // S_{n+1}[j] = sum_k H_n[k] S_n[j-k] counts the depth-(n+1) prefixes of rank part <= j*w
  // (cumulative over the bins; S_0 = 1: the root), and N[m] = sum_n S_n[m - ceil(sp_n / w)] those
  // of deficit <= m*w. That is a lower bound on the true count, so the first bin where N reaches B
  // bounds the B-th prefix's deficit: returns the bucket of that bound (kBottom: no bin reaches
  // B). Counts saturate at kDpCap. w: a set of >= B prefixes formed up front (the chain of top
  // ranks with every sibling along it, one rank part each) has deficits <= U, so its members land
  // within the bins even after rounding up (kDpG - 3 bins span U); without one, a generous guess.
  // Cost: one barrier for the histograms, then the depth steps in warp 0 (dp_warp: warp barriers
  // only) until a depth adds nothing below the crossing (N is cumulative, so that is a per-bin
  // test, no scan) or an early stop judges that the depths left cannot move the crossing much, and one
  // barrier to hand the crossing over. Scratch in phist and cur, which phase 0 initialised.
  KD_HD int fixed_threshold() {
    int* H = phist;                  // [D][kDpG] row histograms of ceil(e / w) (zeroed in phase 0)
    // the range, the same in every thread (no barrier)
    float U = 0.0f, spine = 0.0f, emax = 0.0f;
    int have = 0;
    bool got = false;
    for (int d = 0; d < D; ++d) {
      ctx.step(1);
      const int fb = misc[M_FB + d];
      const int last = (fb < keff ? fb : keff) - 1;
      if (last < 0) break;  // an all -inf row: nothing deeper
      const float* row = lpc + (size_t)d * keff;
      if (d > 0) spine -= row[0];
      const float el = row[0] - row[last];
      U = U > spine + el ? U : spine + el;
      emax = emax > el ? emax : el;
      have += last + 1;  // prefixes (top ranks..., r) for r <= last
      if (have >= B) {
        got = true;
        break;
      }
    }
    // A tree of at most two levels (every depth-3 prefix costs more than U, which bounds the B-th
    // deficit) takes the adaptive levels: for one or two levels they cost less than the estimate
    // (flat drafts: 2-3 us at B = 64..1024 on the H200).
    if (got && (D < 3 || -lpc[keff] - lpc[2 * (size_t)keff] > U)) return kBottom;
    if (!got) U = spine + 2.0f * emax;
    if (!(U > 0.0f)) U = 1.0f;
    constexpr float span = (float)(kDpG - 3);  // bins for U: rounding adds <= 2 bins to the set's members
    // 1/w, a little too large: float rounding (of e, sp and e / w) must not round a bin down, or
    // exact ties sitting on a bin edge (OracleDrafter rows) would be counted a bin too low
    const float inv = span / U * (1.0f + 0x1p-16f);
    // row histograms, one group of threads per row, each row cut where it leaves the range (rows
    // are sorted, so the rest of a thread's strided ranks are out too)
    {
      // nt / 2^ceil(log2 D) threads a row (shifts; D <= 16 <= nt / 8): two integer divisions for
      // nt / D threads a row cost more than the few extra ranks a thread walks
      const int lgd = D > 1 ? 32 - clz32((uint32_t)(D - 1)) : 0;
      const int tpr = nt >> lgd, d = tid >> (lgnt - lgd), q = tid & (tpr - 1);
      if (d < D) {
        const int fb = misc[M_FB + d];
        const int hi = fb < keff ? fb : keff;
        const float* row = lpc + (size_t)d * keff;
        const float r0 = row[0];
        for (int r = q; r < hi; r += tpr) {
          ctx.step(1);
          const float x = (r0 - row[r]) * inv;
          if (!(x < (float)kDpG)) break;
          const int k = (int)ceilf(x);
          if (k >= kDpG) break;
          ctx.atomic_add(&H[d * kDpG + k], 1);
        }
      }
    }
    ctx.sync();
    KD_TREE_MARK(P_THR_HIST);  // (the profile's "thrhist": the estimate up to here; "thr": the depth steps on)
#if defined(KDTREE_EMU_MARKS) && !defined(__CUDA_ARCH__)
    // block emulation (tests/cpp/test_tree_block_emulation.cpp): the crossing is checked against a
    // serial recount of every depth (the early stop may only loosen it)
    if (tid == 0) ctx.emu_estimate_rows(H, D, kDpG);
    ctx.emu_sync();
#endif
    dp_inv = inv;
    if (warp == 0) {
      const int bw = dp_warp(H, inv);
      if (lane == 0) {
        misc[M_DPB] = bw;
#if defined(KDTREE_EMU_MARKS) && !defined(__CUDA_ARCH__)
        ctx.emu_estimate_result(bw, lpc, keff, D, B, inv);
#endif
      }
    } else if (keff > 8) {
      // meanwhile the other warps turn each row's histogram into its rank table (ranks_hint)
      for (int d = warp - 1; d < D; d += nw - 1) {
        ctx.step(1);
        const int h0 = H[d * kDpG + 2 * lane], h1 = H[d * kDpG + 2 * lane + 1];
        const int incl = ctx.warp_incl_sum(h0 + h1);
        hpre[d * kDpG + 2 * lane] = incl - h1;
        hpre[d * kDpG + 2 * lane + 1] = incl;
      }
    }
    ctx.sync();
    // the crossing: the number of bins whose total is below B
    const int below = misc[M_DPB];
    if (below >= kDpG) return kBottom;
    // (times 1 / span, not divided by span: a double division is ~10 dependent instructions; any
    // bound here is valid, the levels check what it gives)
    return bucket_of_delta((double)below * (double)U * (1.0 / (double)span));
  }

  // The bin shift of a depth's chain part sp: ceil(sp / w), clamped at kDpG (such a depth lands past
  // every bin, as it would unclamped). A row of -inf from rank 0 at a depth d >= 1 makes sp +inf
  // from there on: converting that to int is undefined in C++ (the host emulation crashed on it);
  // on the GPU it saturates and the landing bin j + shift overflowed (the 32-bit shared address
  // wrapped onto a bin that held the same value: harmless there by luck).
  KD_HD static int dp_shift(float sp, float inv) {
    const float x = sp * inv;
    return x < (float)kDpG ? (int)ceilf(x) : kDpG;
  }

  // fixed_threshold's depth steps in warp 0 alone: warp barriers only, while the other warps wait at
  // one block barrier (thirty-sixth session: the block-wide steps, a block barrier each, cost as much
  // at 512 threads and more at 1024). Lane 2g + h owns bins 4g .. 4g + 3 over the deficit bins k of
  // [32h, 32h + 32) of the depth's histogram, in quarters of 8: two 16-byte loads of H and three of S
  // (the window of the 4 bins x 8 k; kSZ puts it on a 16-byte boundary), 32 multiply-adds into four
  // independent sums; the pair's halves meet by one shuffle. S has zeros below bin 0 (fixed trip
  // counts; the triangle's zero terms cost no latency in a warp). The running totals N stay in
  // registers (both lanes of a pair hold the pair's four). Bins past the crossing are computed too:
  // they can only feed bins past it, so the crossing, the `more` test and the early stop are the
  // block-wide version's (checked bin for bin in the CPU emulation when it was replaced). Buffer
  // reuse needs one warp barrier a step: step n + 1 writes the buffer step n read its windows from
  // (before step n's barrier), and Sout is next written at step n + 2 (after step n + 1's barrier).
  // Returns the final crossing (the last step's count of bins below B; no second reduction).
  //
  // The early stop (thirty-second session): N is a lower bound after any number of steps, so
  // stopping early only loosens the threshold (never a wrong tree), and the last steps rarely move
  // the crossing. After step n, with am = what it added just below the crossing and the gap to B
  // there: when the additions shrink by a ratio r < 1 a depth and even r / (1 - r) times them
  // could not fill the gap, step n + 1 is the last (the block-wide version decided one step late,
  // so it kept that one step; the same step count here). The settled stop (fifty-eighth session)
  // ends the steps at once when step n moved the crossing by at most one bin and four times the
  // gap would still take the geometric rest of the additions: peaked B = 256 stops after 5 of 8
  // steps for a threshold one bin looser (-0.7 us on an H100); without the gap test it fired where
  // later depths still add a lot, and the looser threshold overflowed the candidate store (a random
  // case of the block emulation). Measured and dropped the same session: the next depth's product
  // formed before this depth's tests (software-pipelined, one basic block; +0.6 us), the counts as
  // floats (FFMA; no change: IMAD issues at the FFMA rate on sm_90).
  KD_HD int dp_warp(const int* H, float inv) {
    int* S = cur;  // two buffers of kSB ints, bin i at [kSZ + i] (phase 0 wrote S_0 = 1 and the zeros)
    const int g = lane >> 1, h = lane & 1, j0 = 4 * g, k0 = 32 * h;
    int N0 = 0, N1 = 0, N2 = 0, N3 = 0;
    int ab_prev = 0, below = kDpG;  // (no step: every total 0 < B)
    int prev_below = kDpG;          // the crossing after the step before
    bool stop_next = false;
    float sp = 0.0f;
    for (int n = 0; n < D; ++n) {
      const int* Sin = S + (n & 1) * kSB + kSZ;
      int* Sout = S + ((n + 1) & 1) * kSB + kSZ;
      const int* Hn = H + n * kDpG;
      if (n > 0) sp -= lpc[(size_t)n * keff];
      int v[4] = {0, 0, 0, 0};
      KD_TREE_MARK(P_THR);
      ctx.step(4);
#pragma unroll
      for (int qq = 0; qq < 4; ++qq) {
        const int kq = k0 + 8 * qq;
        int hv[8], w[12];
        load_int4(Hn + kq, hv);
        load_int4(Hn + kq + 4, hv + 4);
        const int* wp = Sin + (j0 - kq - 7);  // bins j0 - kq - 7 .. j0 - kq + 4 (the last unused)
        load_int4(wp, w);
        load_int4(wp + 4, w + 4);
        load_int4(wp + 8, w + 8);
#pragma unroll
        for (int t = 0; t < 8; ++t) {
#pragma unroll
          for (int b = 0; b < 4; ++b) v[b] += hv[t] * w[7 + b - t];
        }
      }
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        v[b] += ctx.warp_shfl(v[b], lane ^ 1);
        v[b] = v[b] < kDpCap ? v[b] : kDpCap;
      }
      KD_TREE_MARK(P_DPMAC);
      if (h == 0) {
#pragma unroll
        for (int b = 0; b < 4; ++b) Sout[j0 + b] = v[b];
      }
      ctx.warp_sync();  // Sout complete (and every lane done reading Sin)
      const int c = dp_shift(sp, inv);
      // bin t gains what this depth put at t - c (zeros below bin 0)
      const int a0 = Sout[j0 - c], a1 = Sout[j0 + 1 - c], a2 = Sout[j0 + 2 - c], a3 = Sout[j0 + 3 - c];
      N0 += a0; N1 += a1; N2 += a2; N3 += a3;
      // one warp reduction for both tests: the bins below B (the crossing; N is nondecreasing) and,
      // above them (<< 8), the bins this depth raised and left below B (deeper prefixes land there)
      const int more = (a0 > 0 && N0 < B) + (a1 > 0 && N1 < B) + (a2 > 0 && N2 < B) + (a3 > 0 && N3 < B);
      const int cnt = (N0 < B) + (N1 < B) + (N2 < B) + (N3 < B);
      const int red = ctx.warp_sum(h == 0 ? cnt + (more << 8) : 0);
      below = red & 255;  // the totals do not change after this: the final crossing if the steps end here
      if ((red >> 8) == 0) break;
      if (stop_next) break;
      if (below < kDpG) {
        if (below == 0) {
          stop_next = true;
        } else {
          const int m = below - 1;  // the last bin below the crossing
          const int am = Sout[m - c];  // what this depth added there
          const int e = m & 3;
          const int mine = e == 0 ? N0 : e == 1 ? N1 : e == 2 ? N2 : N3;
          const int gap = B - ctx.warp_shfl(mine, 2 * (m >> 2));
          stop_next = ab_prev > am && am * am < gap * (ab_prev - am);  // (<= 8192^2: no overflow)
          // settled: this step moved the crossing by at most one bin, and the additions, shrinking,
          // would fill at most four times the gap if they went on geometrically: the depths left
          // could move the crossing by a bin or so, which costs the levels less than their steps
          if (prev_below - below <= 1 && ab_prev > am && am * am < 4 * gap * (ab_prev - am)) break;  // (<= 2^26)
          ab_prev = am;
        }
      }
      prev_below = below;
    }
    return below;
  }

  // The fixed threshold's levels (btf < kBottom): every prefix whose bucket is <= btf, level by
  // level, in the same store order as the adaptive levels (parents in store order, children by
  // rank). The threshold does not move, so the thread that materialises a node also counts its
  // children (count_fixed on the score it has just formed): a level is its materialisation plus
  // one offset scan, two block barriers (the first a __syncthreads_or that also ends the levels
  // when nothing has children). A level of at most 32 nodes is warp 0's alone (node t = lane),
  // and so are the small levels after it: warp barriers only, then one block barrier to hand the
  // state back. Returns the prefixes materialised (every thread the same), or -2 if the candidate
  // store would overflow. Level d's parent offsets sit in cnt (by parent position in its level)
  // and each node's parent position in nid (by position in its level).
  KD_HD int fixed_levels(int btf) {
    const double lim = bucket_limit(btf);
    const float fl1 = child_floor(smax, 0.0, lim);
    int T = ranks_fixed(0, 0, fl1);  // depth 1: a prefix of row 0
    int d = 1, used = 0, p0 = 0;  // level d: T nodes from store index `used`; its parents from p0
    if (tid == 0) misc[M_BT] = kBottom;  // the final gscan's crossing slot (written there by one warp)
    while (T > 0) {
      if (used + T > cap) return -2;  // (uniform: T and used are the same in every thread)
      if (T <= 32) {
        if (warp == 0) {
          for (;;) {
            ctx.step(1);
            const int c = lane < T ? fixed_node(d, p0, used, lane, lim) : 0;
            const int incl = ctx.warp_incl_sum(c);
            const int Tn = ctx.warp_shfl(incl, 31);
            ctx.warp_sync();  // every lane has read level d's cnt / nid
            if (lane < T) {
              cnt[lane] = incl - c;
              for (int r = incl - c; r < incl && r < cap; ++r) nid[r] = (uint16_t)lane;
            }
            ctx.warp_sync();  // ... and sees the next level's
            p0 = used;
            used += T;
            ++d;
            T = Tn;
            if (T == 0 || T > 32 || used + T > cap) break;
          }
          if (lane == 0) {
            misc[M_WD] = d;
            misc[M_WT] = T;
            misc[M_WU] = used;
            misc[M_WP] = p0;
          }
        }
        ctx.sync();
        d = misc[M_WD];
        T = misc[M_WT];
        used = misc[M_WU];
        p0 = misc[M_WP];
        KD_TREE_MARK(P_NARROW);
        continue;
      }
      // a wide level: thread tid materialises nodes [t0, t1) (contiguous: the offsets below keep
      // store order), keeping the counts in registers (one node) or in ord (free until the ranking)
      const int per = (T + nt - 1) >> lgnt;
      const int t0 = tid * per < T ? tid * per : T, t1 = t0 + per < T ? t0 + per : T;
      int sum = 0, c1 = 0;
      for (int t = t0; t < t1; ++t) {
        ctx.step(1);
        const int c = fixed_node(d, p0, used, t, lim);
        if (per > 1) ord[t] = (uint16_t)c;
        c1 = c;
        sum += c;
      }
      KD_TREE_MARK(P_NODE);
      // Only the warps that own nodes of the level scan its counts; the others just pass the two
      // barriers (their shuffles only queued up in front of the owners', thirty-fourth session:
      // peaked B = 512 / 1024 -0.5 us) and read the next level's size from misc[M_T]. Warp w owns
      // nodes when its first thread's first node 32 w per is below T (no integer division here:
      // the first version's ceil(ceil(T / per) / 32) cost 0.4-1 us a tree, thirty-fifth session).
      auto owns = [&](int w) { return w * 32 * per < T; };  // warp w holds nodes of this level
      const bool owner = owns(warp);  // (warp-uniform)
      int incl = 0;
      if (owner) {
        incl = ctx.warp_incl_sum(sum);
        if (lane == 31) scan_tmp[warp] = incl;
      }
      const bool more = ctx.sync_or(sum > 0);  // level d materialised, its cnt / nid read
      KD_TREE_MARK(P_MAT);
      p0 = used;
      used += T;
      ++d;
      if (!more) {
        T = 0;
        break;
      }
      if (owner) {
        const int wt = owns(lane) ? scan_tmp[lane] : 0;  // warp `lane`'s total
        // the warps before this one (warp 0: all of them, the next level's size) in one warp
        // reduction (redux.sync) rather than a second warp scan and a shuffle (thirty-fifth session:
        // peaked B = 256 / 1024 -0.3 / -0.5 us)
        const int before = ctx.warp_sum(warp == 0 || lane < warp ? wt : 0);
        if (warp == 0 && lane == 0) misc[M_T] = before;  // the next level's size
        int run = (warp == 0 ? 0 : before) + incl - sum;
        KD_TREE_MARK(P_OFFSUM);
        for (int t = t0; t < t1; ++t) {
          ctx.step(1);
          const int c = per > 1 ? (int)ord[t] : c1;
          cnt[t] = run;
          for (int r = 0; r < c && run + r < cap; ++r) nid[run + r] = (uint16_t)t;
          run += c;
        }
      }
      ctx.sync();
      T = misc[M_T];  // (rewritten only after the next level's first barrier)
      KD_TREE_MARK(P_OFFS);
      KD_TREE_COUNT(P_LEVELS);
    }
    return used;
  }

  // Materialise node t of level d (fixed_levels; parents from store index p0, the level from
  // `used`) and return its children count at the fixed threshold (0 at the last depth).
  KD_HD int fixed_node(int d, int p0, int used, int t, double lim) {
    double s;
    int p, r;
    if (d == 1) {
      p = kRoot;
      r = t;
      s = (double)lpc[t];
    } else {
      const int j = nid[t];
      p = p0 + j;
      r = t - cnt[j];
      s = sc[p] + (double)lpc[(size_t)(d - 1) * keff + r];
    }
    KD_TREE_MARK(P_NLOAD);
    const int x = used + t, b = bucket_of(smax, s);
    sc[x] = s; par[x] = (uint16_t)p; rk[x] = (uint16_t)r; dp[x] = (uint8_t)d; bk[x] = (uint16_t)b;
    ctx.atomic_add(&hist[b], 1);  // (one count: the fixed path reads no level halves)
    ctx.atomic_add(&gcnt[b >> 5], 1);
    KD_TREE_MARK(P_NSTORE);
    return d < D ? count_fixed(s, d + 1, lim) : 0;
  }

  // The adaptive levels (btf = kBottom): level 1, then levels 2..D with the threshold of
  // everything materialised so far, the staircase bounds and probes. Returns 0, or -1 when the
  // candidate store would overflow (the sequential fallback).
  KD_HD int adaptive_levels() {
    const int T1 = keff;
    if (tid == 0) {
      misc[M_BT] = kBottom;
      misc[M_USED] = T1;
      misc[M_LS + 1] = 0;
      misc[M_LS + 2] = T1;
    }
    // ---- level 1: every rank < Keff (rank r has r better siblings, r < B)
    for (int r = tid; r < T1; r += nt) {
      ctx.step(1);
      const double s = (double)lpc[r];
      const int b = bucket_of(smax, s);
      sc[r] = s; par[r] = kRoot; rk[r] = (uint16_t)r; dp[r] = 1; bk[r] = (uint16_t)b;
      ctx.atomic_add(&hist[b], kBoth);
      ctx.atomic_add(&gcnt[b >> 5], kBoth);
    }
    ctx.sync();
    gscan(hist, gcnt, hpre, kLo, M_BT, true);
    KD_TREE_MARK(P_LEVEL1);

    // ---- levels 2..D (4 block barriers per level on the common path: 2 count + offsets,
    // 1 materialise, 1 histogram scan)
    for (int d = 2; d <= D; ++d) {
      const int p0 = misc[M_LS + d - 1], p1 = misc[M_LS + d], np = p1 - p0;
      const int used = misc[M_USED];
      const int bt = misc[M_BT];
      if (tid < kNG) gcnt[tid] &= kLo;  // the level halves of hist were cleared by gscan
      const int per = (np + nt - 1) >> lgnt;  // this thread's parents: [j0, j1)
      const int j0 = tid * per < np ? tid * per : np, j1 = j0 + per < np ? j0 + per : np;
      int T;
      if (np <= 32) {  // warp 0 counts (lane j = parent j, as j0 = tid here), scans and publishes: one barrier
        if (warp == 0) {
          const int c = lane >= np ? 0 : count_children(p0 + lane, d, bt);
          const int incl = ctx.warp_incl_sum(c);
          if (lane < np) cnt[lane] = incl - c;
          if (lane == 31) misc[M_T] = incl;
        }
        ctx.sync();
        T = misc[M_T];
      } else {
        int s = 0;
        for (int j = j0; j < j1; ++j) {
          ctx.step(1);
          const int c = count_children(p0 + j, d, bt);
          cnt[j] = c;
          s += c;
        }
        KD_TREE_MARK(P_COUNT);  // thread 0's own counting (no barrier since the last mark)
        T = offsets(false, s, j0, j1);
        KD_TREE_MARK(P_OFFS);
      }
      KD_TREE_MARK(P_COUNT);
      KD_TREE_COUNT(P_LEVELS);
      if (T == 0) break;
      const float* row = lpc + (size_t)(d - 1) * keff;
      if (T > B || used + T > cap) {
        // probe: count every allowed child into a copy of the histogram, take the tighter
        // threshold (the B-th over materialised + probed prefixes), recount.
        // (not unrolled: no trip-count division)
#pragma unroll 1
        for (int i = tid; i < kNB / 4; i += nt) {  // 16 bytes a copy (level halves are 0)
          ctx.step(1);
          int v[4];
          load_int4(hist + 4 * i, v);
          store_int4(phist + 4 * i, v[0], v[1], v[2], v[3]);
        }
        if (tid < kNG) pgc[tid] = gcnt[tid];
        if (tid == 0) misc[M_BT2] = kBottom;
        ctx.sync();
        for (int t = tid; t < T; t += nt) {
          ctx.step(1);
          const int j = owner(cnt, np, t);
          const int p = p0 + j, r = t - cnt[j];
          const int b = bucket_of(smax, sc[p] + (double)row[r]);
          ctx.atomic_add(&phist[b], 1);
          ctx.atomic_add(&pgc[b >> 5], 1);
        }
        ctx.sync();
        gscan(phist, pgc, nullptr, -1, M_BT2, false);
        const int bt2 = misc[M_BT2];
        const double lim2 = bucket_limit(bt2);
        int s2 = 0;
        for (int j = j0; j < j1; ++j) {  // new counts into nid (free until the end)
          ctx.step(1);
          int c = (j + 1 < np ? cnt[j + 1] : T) - cnt[j];
          if (bt2 != kBottom) c = ranks_above(row, 0, c, child_floor(smax, sc[p0 + j], lim2));
          nid[j] = (uint16_t)c;  // c <= Keff
          s2 += c;
        }
        T = offsets(true, s2, j0, j1);
        KD_TREE_MARK(P_PROBE);
        KD_TREE_COUNT(P_PROBES);
        if (used + T > cap) return -1;  // candidate store overflow: exact fallback
        if (T == 0) break;
      }
      // materialise level d
      for (int t = tid; t < T; t += nt) {
        ctx.step(1);
        const int j = owner(cnt, np, t);
        const int p = p0 + j, r = t - cnt[j], x = used + t;
        const double s = sc[p] + (double)row[r];
        const int b = bucket_of(smax, s);
        sc[x] = s; par[x] = (uint16_t)p; rk[x] = (uint16_t)r; dp[x] = (uint8_t)d; bk[x] = (uint16_t)b;
        ctx.atomic_add(&hist[b], kBoth);
        ctx.atomic_add(&gcnt[b >> 5], kBoth);
      }
      if (tid == 0) {
        misc[M_USED] = used + T;
        misc[M_LS + d + 1] = used + T;
        misc[M_BT] = kBottom;
      }
      ctx.sync();
      KD_TREE_MARK(P_MAT);
      gscan(hist, gcnt, hpre, kLo, M_BT, true);
      KD_TREE_MARK(P_GSCAN);
    }
    return 0;
  }

  // The levels and the final ranking. btf < kBottom: fixed_levels (returns -2 if the prefixes
  // within btf are fewer than B, so the tree may reach past them, or overflow the candidate
  // store). btf = kBottom: the adaptive threshold (histogram of everything materialised, probes).
  // Returns n, -1 (sequential fallback) or -2 (fixed threshold failed).
  KD_HD int build_levels(int btf) {
    if (btf < kBottom) {
      const int used = fixed_levels(btf);
      if (used < B) return -2;  // (also -2 itself)
      if (tid == 0) misc[M_USED] = used;  // (misc[M_BT] = kBottom since fixed_levels' first barrier)
      gscan(hist, gcnt, hpre, kLo, M_BT, false);
      KD_TREE_MARK(P_GSCAN);
    } else {
      if (adaptive_levels() < 0) return -1;
    }
    // ---- final ranking: counting sort by bucket, exact comparisons inside a bucket
    // Sort: every prefix of a bucket <= bt goes to ord[k] (store id) and osc[k] (its score), k in
    // its bucket's run; hpre[b]'s low half is the cursor (it ends at the run's end; + cb <= cap, so
    // it never carries into the level half, which nothing reads any more).
    const int used = misc[M_USED];
    const int bt = misc[M_BT];
    double* osc = reinterpret_cast<double*>(sm + L.o_osc);
    for (int x = tid; x < used; x += nt) {
      ctx.step(1);
      const int b = bk[x];
      if (b <= bt) {
        const int k = ctx.atomic_add(&hpre[b], 1) & kLo;
        ord[k] = (uint16_t)x;
        osc[k] = sc[x];
      }
    }
    ctx.sync();
    KD_TREE_MARK(P_RANK_SORT);
    // with fewer than B prefixes (bt = kBottom) all `used` of them are in
    const int total_in = bt == kBottom ? used : hpre[bt] & kLo;
    const int n = total_in < B ? total_in : B;
    // Compare: thread k ranks the prefix at sorted position k. The lanes of a warp hold consecutive
    // positions, so they mostly share a bucket and read the same osc / ord / dp entries in each
    // step (shared-memory broadcasts, no bank conflicts; gathering sc[ord[k]] in store order, as
    // this was, cost an extra dependent load and up to 32 distinct banks per load).
    for (int k = tid; k < total_in; k += nt) {
      const int x = ord[k];
      const int b = bk[x];
      const int ke = hpre[b] & kLo, cb = hist[b] & kLo, s0 = ke - cb;
      const int dx = dp[x], rx = rk[x], px = par[x];
      // the node's token: a global load issued now, consumed after the comparisons (its latency
      // hides behind them instead of opening write_outputs)
      const int32_t tok = a.ids[(size_t)(dx - 1) * a.ld + rx];
      // rank = s0 + the bucket's members that pop before x. First pass: the better scores (four
      // independent loads at a time, branch-free). Only if another member ties x's score, a second
      // pass over the ties: one at x's depth is decided by the store index (within a level, store
      // order is rank-tuple order), one at another depth by the rank-tuple walk (lex_less).
      const double sx = osc[k];
      int rank = s0;
      bool tie = false;
      ctx.step(1 + cb / 4);
      for (int j = s0; j < ke; j += 4) {
        int q[4];
        double ay[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) q[e] = j + e < ke ? j + e : k;  // past the end: x itself
#pragma unroll
        for (int e = 0; e < 4; ++e) ay[e] = osc[q[e]];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          rank += ay[e] > sx;
          tie |= ay[e] == sx && q[e] != k;
        }
      }
      if (tie) {
        bool walk = false;
        ctx.step(cb / 4);
        for (int j = s0; j < ke; j += 4) {
          int y[4], dy[4];
          double ay[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int qe = j + e < ke ? j + e : k;
            y[e] = ord[qe];
            ay[e] = osc[qe];
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) dy[e] = dp[y[e]];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const bool eq = ay[e] == sx;
            rank += eq && dy[e] == dx && y[e] < x;
            walk |= eq && dy[e] != dx;
          }
        }
        if (walk) {
          ctx.step(cb);
          for (int j = s0; j < ke; ++j) {
            const int y = ord[j];
            if (osc[j] == sx && dp[y] != dx && lex_less(y, x)) ++rank;
          }
        }
      }
      if (rank < n) {
        odp[rank] = (uint8_t)dx;
        ork[rank] = (uint16_t)rx;
        opar[rank] = (int16_t)px;  // the parent's store id (kRoot: -1); write_outputs maps it by nid
        nid[x] = (uint16_t)(rank + 1);
        a.tokens[rank] = tok;  // node rank + 1's outputs but its parent (write_outputs skips them)
        a.depths[rank] = dx;
        a.positions[rank + 1] = a.cache_len + dx;
      }
    }
    ctx.sync();
    KD_TREE_MARK(P_RANK_CMP);
    return n;
  }

  // ---------------------------------------------------------------- sequential fallback
  KD_HD int sequential_build() {
    const FallbackViews fv(sm + L.o_sc, B);
    double* hsc = fv.hsc;
    int16_t* hpar = fv.hpar;
    uint16_t* hrk = fv.hrk;
    uint8_t* hdp = fv.hdp;
    uint16_t* tup = fv.tup;
    if (tid == 0) {
      const float* lp = a.lp;
      const int ld = a.ld;
      int size = 0, npop = 0;
      // heap order: i before j when i pops first
      auto before = [&](int i, int j) -> bool {
        double si = hsc[i], sj = hsc[j];
        if (is_nan_d(si)) si = neg_inf_d();
        if (is_nan_d(sj)) sj = neg_inf_d();
        if (si != sj) return si > sj;
        int di = hdp[i], dj = hdp[j];
        const uint16_t* ti = tup + (size_t)hpar[i] * kMaxDepth;
        const uint16_t* tj = tup + (size_t)hpar[j] * kMaxDepth;
        int m = di < dj ? di : dj;
        for (int k = 0; k < m; ++k) {
          int vi = k < di - 1 ? ti[k] : hrk[i];
          int vj = k < dj - 1 ? tj[k] : hrk[j];
          if (vi != vj) return vi < vj;
        }
        return di < dj;
      };
      auto swap_e = [&](int i, int j) {
        double ts = hsc[i]; hsc[i] = hsc[j]; hsc[j] = ts;
        int16_t tp = hpar[i]; hpar[i] = hpar[j]; hpar[j] = tp;
        uint16_t tr = hrk[i]; hrk[i] = hrk[j]; hrk[j] = tr;
        uint8_t td = hdp[i]; hdp[i] = hdp[j]; hdp[j] = td;
      };
      auto push = [&](double s, int p, int r, int d) {
        int i = size++;
        hsc[i] = s; hpar[i] = (int16_t)p; hrk[i] = (uint16_t)r; hdp[i] = (uint8_t)d;
        while (i > 0) {
          int q = (i - 1) >> 1;
          if (!before(i, q)) break;
          swap_e(i, q);
          i = q;
        }
      };
      push((double)lp[0], 0, 0, 1);
      while (size > 0 && npop < B) {
        double s = hsc[0];
        int p = hpar[0], r = hrk[0], d = hdp[0];
        --size;
        if (size > 0) {
          swap_e(0, size);
          int i = 0;
          for (;;) {
            int l = 2 * i + 1, rr = l + 1, m = i;
            if (l < size && before(l, m)) m = l;
            if (rr < size && before(rr, m)) m = rr;
            if (m == i) break;
            swap_e(i, m);
            i = m;
          }
        }
        int node = ++npop;
        odp[node - 1] = (uint8_t)d;
        ork[node - 1] = (uint16_t)r;
        opar[node - 1] = (int16_t)p;
        uint16_t* tn = tup + (size_t)node * kMaxDepth;
        const uint16_t* tp = tup + (size_t)p * kMaxDepth;
        for (int k = 0; k < d - 1; ++k) tn[k] = tp[k];
        tn[d - 1] = (uint16_t)r;
        if (r + 1 < keff) {
          double s2 = s - (double)lp[(size_t)(d - 1) * ld + r];
          s2 = s2 + (double)lp[(size_t)(d - 1) * ld + r + 1];
          push(s2, p, r + 1, d);
        }
        if (d < D) push(s + (double)lp[(size_t)d * ld], node, 0, d + 1);
      }
      misc[M_N] = npop;
    }
    ctx.sync();
    return misc[M_N];
  }

  // ---------------------------------------------------------------- one-warp exact path
  // The reference heap's pop order computed by warp 0 without a heap: the candidates (at most
  // one more than the pops so far) sit unsorted in shared memory, and each pop is the minimum
  // under the fallback's own order `before` (score desc with NaN as -inf, then rank tuple asc,
  // then the shorter tuple): a strict total order (two candidates never share a rank tuple), so
  // the minimum is unique and equals what the binary heap pops. Each lane scans a strided slice
  // for its best, a 5-round xor butterfly gives every lane the winner, the winner's rank tuple
  // is copied one entry per lane, and lane 0 swaps the last candidate into its slot and appends
  // the sibling (same float64 operations as the fallback) and the first child. The rows are
  // copied into shared memory first (one block barrier); the butterfly carries each lane's best
  // key in registers and reads shared memory only on equal keys. Exact for any input. Cost ~ B pops x (size/32 + 5 shuffle rounds + 2 warp
  // syncs): for small budgets, far less than the parallel path's per-level barriers.
  KD_HD int warp_build() {
    const FallbackViews fv(sm + L.o_sc, B);
    double* hsc = fv.hsc;
    int16_t* hpar = fv.hpar;
    uint16_t* hrk = fv.hrk;
    uint8_t* hdp = fv.hdp;
    uint16_t* tup = fv.tup;
    const int kf = keff;                           // ranks >= keff are never pushed
    for (int i = tid; i < D * kf; i += nt) {       // the rows into shared memory, as they are
      ctx.step(1);
      const int d = i / kf, r = i - d * kf;
      lpc[i] = a.lp[(size_t)d * a.ld + r];
    }
    ctx.sync();
    if (warp == 0) {
      auto key = [&](int i) -> double {  // the heap's score key: NaN ranks as -inf
        const double v = hsc[i];
        return is_nan_d(v) ? neg_inf_d() : v;
      };
      auto tuple_before = [&](int i, int j) -> bool {  // equal keys: rank tuple asc, then shorter
        int di = hdp[i], dj = hdp[j];
        const uint16_t* ti = tup + (size_t)hpar[i] * kMaxDepth;
        const uint16_t* tj = tup + (size_t)hpar[j] * kMaxDepth;
        int m = di < dj ? di : dj;
        for (int k = 0; k < m; ++k) {
          ctx.step(1);
          int vi = k < di - 1 ? ti[k] : hrk[i];
          int vj = k < dj - 1 ? tj[k] : hrk[j];
          if (vi != vj) return vi < vj;
        }
        return di < dj;
      };
      if (lane == 0) {
        hsc[0] = (double)lpc[0];
        hpar[0] = 0;
        hrk[0] = 0;
        hdp[0] = 1;
      }
      ctx.warp_sync();
      int size = 1, npop = 0;
      while (size > 0 && npop < B) {
        int best = -1;       // this lane's best candidate and its key (registers: the butterfly
        double bk = 0.0;     // reads shared memory only on equal keys)
        for (int c = lane; c < size; c += 32) {
          ctx.step(1);
          const double kc = key(c);
          if (best < 0 || kc > bk || (kc == bk && tuple_before(c, best))) {
            best = c;
            bk = kc;
          }
        }
        for (int o = 16; o >= 1; o >>= 1) {
          const uint64_t u = bits_as<uint64_t>(bk);
          const int other = ctx.warp_shfl(best, lane ^ o);
          const int hi = ctx.warp_shfl((int)(u >> 32), lane ^ o), lo = ctx.warp_shfl((int)(uint32_t)u, lane ^ o);
          const double ok = bits_as<double>(((uint64_t)(uint32_t)hi << 32) | (uint32_t)lo);
          if (other >= 0 && (best < 0 || ok > bk || (ok == bk && tuple_before(other, best)))) {
            best = other;
            bk = ok;
          }
        }
        const double s = hsc[best];
        const int p = hpar[best], r = hrk[best], d = hdp[best];
        const int node = ++npop;
        if (lane < d) tup[(size_t)node * kMaxDepth + lane] = lane < d - 1 ? tup[(size_t)p * kMaxDepth + lane] : (uint16_t)r;
        const bool sib = r + 1 < kf, child = d < D;
        double s2 = 0.0, s3 = 0.0;
        if (sib) {  // the fallback's float64 operations, in its order
          s2 = s - (double)lpc[(d - 1) * kf + r];
          s2 = s2 + (double)lpc[(d - 1) * kf + r + 1];
        }
        if (child) s3 = s + (double)lpc[d * kf];
        ctx.warp_sync();  // every lane has read the winner's slot
        if (lane == 0) {
          ctx.step(4);
          odp[node - 1] = (uint8_t)d;
          ork[node - 1] = (uint16_t)r;
          opar[node - 1] = (int16_t)p;
          int last = size - 1;
          if (best != last) {
            hsc[best] = hsc[last];
            hpar[best] = hpar[last];
            hrk[best] = hrk[last];
            hdp[best] = hdp[last];
          }
          if (sib) {
            hsc[last] = s2;
            hpar[last] = (int16_t)p;
            hrk[last] = (uint16_t)(r + 1);
            hdp[last] = (uint8_t)d;
            ++last;
          }
          if (child) {
            hsc[last] = s3;
            hpar[last] = (int16_t)node;
            hrk[last] = 0;
            hdp[last] = (uint8_t)(d + 1);
          }
        }
        size += (sib ? 1 : 0) + (child ? 1 : 0) - 1;
        ctx.warp_sync();  // the candidate slots and the new tuple are visible to every lane
      }
      if (lane == 0) misc[M_N] = npop;
    }
    ctx.sync();
    return misc[M_N];
  }

  // ---------------------------------------------------------------- outputs
  // by_store (the parallel path): the ranking wrote nodes 1..n's tokens, depths and positions
  // and left, per node, its parent's store id in opar and every node's index in nid (store id ->
  // rank + 1), with no block barrier since: the parents and the visibility walks map store ids
  // through nid here. Otherwise (the fallback and one-warp paths) odp / ork / opar hold each
  // node's depth, rank and parent index.
  KD_HD void write_outputs(int n, int path, bool by_store) {
    const int W = vis_words(B);
#pragma unroll 1  // (no trip-count division, as in phase 0)
    for (int i = tid; i < B; i += nt) {
      ctx.step(1);
      if (i < n && by_store) {
        const int p = (uint16_t)opar[i];
        a.parents[i + 1] = p == kRoot ? 0 : nid[p];
      } else if (i < n) {
        int d = odp[i];
        a.tokens[i] = a.ids[(size_t)(d - 1) * a.ld + ork[i]];
        a.depths[i] = d;
        a.parents[i + 1] = opar[i];
        a.positions[i + 1] = a.cache_len + d;
      } else {
        a.tokens[i] = -1;
        a.depths[i] = 0;
        a.parents[i + 1] = -1;
        a.positions[i + 1] = -1;
      }
    }
    if (tid == 0) {
      a.parents[0] = -1;
      a.positions[0] = a.cache_len;
      a.n_out[0] = n;
      if (a.path_out) a.path_out[0] = path;
    }
    // Visibility: one ancestor walk per row (ancestors have smaller indices, so the walk meets
    // the row's words in descending order and each word is complete when the walk leaves it),
    // staged in the shared memory the build no longer needs (everything below o_par, which
    // make_tree_layout sizes for the rows), then copied out coalesced.
    // Warp by warp: a warp walks rpw <= 32 consecutive rows (lane = row; rpw spreads the rows
    // over every warp) and copies those rows, one contiguous run of the output, itself after a
    // warp barrier: no block barrier, and a warp's stores start while other warps still walk.
    uint64_t* const st = reinterpret_cast<uint64_t*>(sm);  // the staged rows
    const int rpw0 = (B + nw) >> (lgnt - 5), rpw = rpw0 < 32 ? rpw0 : 32;  // ceil((B + 1) / nw), at most 32
    for (int i0 = warp * rpw; i0 <= B; i0 += nw * rpw) {  // warp-uniform trip count
      const int i = i0 + lane;
      if (lane < rpw && i <= B) {
        ctx.step(1);
        vis_row(st + (size_t)i * W, i, n, W, by_store);
      }
      ctx.warp_sync();  // the warp's rows are staged (and visible to its lanes)
      const int e1 = (i0 + rpw <= B + 1 ? i0 + rpw : B + 1) * W;
      for (int idx = i0 * W + lane; idx < e1; idx += 32) {
        ctx.step(1);
        a.visibility[idx] = st[idx];
      }
    }
  }

  // Row i of the visibility (W words at row): the ancestor walk, over parent indices in opar, or
  // (by_store) over store ids: par from the candidate store, the index of each by nid.
  KD_HD void vis_row(uint64_t* row, int i, int n, int W, bool by_store) const {
    int w = W - 1;  // the next word to write, descending
    uint64_t cur = 0;
    if (i <= n) {
      int x = i;  // the node (index)
      int y = by_store && i > 0 ? (int)(uint16_t)opar[i - 1] : (int)kRoot;  // by_store: x's parent's store id
      for (;;) {
        ctx.step(1);
        const int xw = x >> 6;
        for (; w > xw; --w) {  // the walk has left word w: it is complete (or empty)
          row[w] = cur;
          cur = 0;
        }
        cur |= (uint64_t)1 << (x & 63);
        if (x == 0) break;
        if (!by_store) {
          x = opar[x - 1];
        } else if (y == kRoot) {
          x = 0;
        } else {
          x = nid[y];  // (two independent loads: one dependent step per ancestor, as over opar)
          y = par[y];
        }
      }
    }
    for (; w >= 0; --w) {  // word 0 (the root's) and, for rows past n, every word = 0
      row[w] = cur;
      cur = 0;
    }
  }

  // Path choice: force_fallback 1 = sequential fallback, 2 = one-warp path, 3 = parallel path,
  // 4 = parallel path without the threshold estimate (testing the adaptive levels)
  // (then the fallback if its checks fail), 0 = auto: the one-warp path for B <= kWarpPathMaxB,
  // else the parallel path.
  KD_HD void run() {
    KD_TREE_MARK(P_START);
    int n = 0, path = 0;
    if (B > 0 && D > 0 && a.K > 0) {
      const int f = a.force_fallback;
      if (f == 2 || (f == 0 && B <= kWarpPathMaxB)) {
        path = 2;
        n = warp_build();
        KD_TREE_MARK(P_OTHER);
      } else {
        bool fixed = false;
        int r = f == 1 ? -1 : parallel_build(f == 4, &fixed);
        if (r < 0) {
          path = 1;
          ctx.sync();  // everyone is done with the candidate store before the heap reuses it
          n = sequential_build();
          KD_TREE_MARK(P_OTHER);
        } else {
          n = r;
          path = fixed ? 3 : 0;
        }
      }
    }
    write_outputs(n, path, path == 0 || path == 3);
#if defined(KDTREE_TREE_PROFILE) && defined(__CUDA_ARCH__)
    ctx.sync();  // (profile only: write_outputs ends without a block barrier; out = the slowest warp's time)
#endif
    KD_TREE_MARK(P_OUT);
#if defined(KDTREE_TREE_PROFILE) && defined(__CUDA_ARCH__)
    if (tid == 0)
      printf("TREEPROF B=%d D=%d K=%d nt=%d path=%d n=%d levels=%lld probes=%lld fix=%d | phase0 %lld level1 %lld count %lld "
             "probe %lld mat %lld gscan %lld rank %lld+%lld+%lld out %lld other %lld offs %lld thr %lld thrhist %lld "
             "dpmac %lld node %lld narrow %lld offsum %lld nload %lld nstore %lld\n",
             B, D, a.K, nt, path, n, prof_acc[P_LEVELS], prof_acc[P_PROBES], path == 0 || path == 3 ? misc[M_FIX] : -1,
             prof_acc[P_PHASE0], prof_acc[P_LEVEL1], prof_acc[P_COUNT], prof_acc[P_PROBE], prof_acc[P_MAT],
             prof_acc[P_GSCAN], prof_acc[P_RANK_SORT], prof_acc[P_RANK_CMP], prof_acc[P_RANK_PAR], prof_acc[P_OUT],
             prof_acc[P_OTHER], prof_acc[P_OFFS], prof_acc[P_THR], prof_acc[P_THR_HIST],
             prof_acc[P_DPMAC], prof_acc[P_NODE], prof_acc[P_NARROW], prof_acc[P_OFFSUM], prof_acc[P_NLOAD],
             prof_acc[P_NSTORE]);
#endif
  }
};

}  // namespace treeimpl
}  // namespace kdtree
