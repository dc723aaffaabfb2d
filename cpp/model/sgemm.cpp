// sgemm.cpp: CBLAS dispatch and the portable cache-blocked SGEMM (see sgemm.h).
//
// Portable kernel, Goto-style but small: for each K block (KC) and M block (MC) the A block is
// packed into MR-row strips ([kc][MR] each); the columns are split into NR-wide strips, each
// thread packs its B strip ([kc][NR], lives in L1) and runs the MR x NR micro-kernel over the
// A strips (A block lives in L2). Edges are zero-padded in the packed copies and only the valid
// part of a tile is written back. For M <= kSmallM (decode, T=1) packing costs more than it
// saves, so rows are computed directly: dot products (B^T) or axpy sweeps (B).
#include "model/sgemm.h"

#include "cpu_features.h"
#include "model/parallel.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef KDTREE_HAVE_CBLAS
#include <cblas.h>
#include <dlfcn.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#endif

// Function multiversioning: an AVX2+FMA clone and a baseline one, chosen at load time.
// ("arch=x86-64-v3" is a feature-level check: AVX2 + FMA on any vendor; "arch=haswell" would
// test for that exact Intel core.)
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__) && defined(__linux__)
#define KD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#elif defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KD_CLONES
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"  // 32-byte vectors in helpers that are always inlined
#endif

namespace kdtree {

namespace {

std::atomic<bool> g_force_portable{false};

constexpr int MR = 6;            // micro-tile rows
constexpr int NR = 16;           // micro-tile columns (two 8-float vectors)
constexpr int64_t KC = 256;      // K block: a packed B strip (KC x NR) stays in L1
constexpr int64_t MC = 192;      // M block: the packed A block (MC x KC) stays in L2
constexpr int64_t kSmallM = 4;   // M at or below this: direct dot / axpy rows, no packing
constexpr double kParallelFlops = 4e6;  // below this a GEMM stays on one thread

// acc[MR][NR] = sum_k Ap[k][0:MR] (x) Bp[k][0:NR]: 12 vector accumulators, FMA on AVX2.
#if defined(__GNUC__)
typedef float v8f __attribute__((vector_size(32)));
static inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
static inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
static inline v8f bcast(float x) {
  v8f v = {x, x, x, x, x, x, x, x};
  return v;
}
KD_CLONES void micro_kernel(int64_t kc, const float* __restrict Ap, const float* __restrict Bp,
                            float* __restrict acc) {
  v8f c00 = bcast(0.f), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  v8f c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < kc; ++k) {
    const v8f b0 = load8(Bp + k * NR), b1 = load8(Bp + k * NR + 8);
    const float* a = Ap + k * MR;
    v8f ar = bcast(a[0]);
    c00 += ar * b0; c01 += ar * b1;
    ar = bcast(a[1]);
    c10 += ar * b0; c11 += ar * b1;
    ar = bcast(a[2]);
    c20 += ar * b0; c21 += ar * b1;
    ar = bcast(a[3]);
    c30 += ar * b0; c31 += ar * b1;
    ar = bcast(a[4]);
    c40 += ar * b0; c41 += ar * b1;
    ar = bcast(a[5]);
    c50 += ar * b0; c51 += ar * b1;
  }
  store8(acc + 0 * NR, c00); store8(acc + 0 * NR + 8, c01);
  store8(acc + 1 * NR, c10); store8(acc + 1 * NR + 8, c11);
  store8(acc + 2 * NR, c20); store8(acc + 2 * NR + 8, c21);
  store8(acc + 3 * NR, c30); store8(acc + 3 * NR + 8, c31);
  store8(acc + 4 * NR, c40); store8(acc + 4 * NR + 8, c41);
  store8(acc + 5 * NR, c50); store8(acc + 5 * NR + 8, c51);
}
#else
void micro_kernel(int64_t kc, const float* Ap, const float* Bp, float* acc) {
  float c[MR * NR] = {};
  for (int64_t k = 0; k < kc; ++k)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) c[r * NR + j] += Ap[k * MR + r] * Bp[k * NR + j];
  std::memcpy(acc, c, sizeof(c));
}
#endif

// sum_k a[k] * b[k], 16 independent partial sums so the loop vectorises without -ffast-math.
KD_CLONES float dot(const float* __restrict a, const float* __restrict b, int64_t K) {
  float s[16];
  for (int j = 0; j < 16; ++j) s[j] = 0.f;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16)
    for (int j = 0; j < 16; ++j) s[j] += a[k + j] * b[k + j];
  float tail = 0.f;
  for (; k < K; ++k) tail += a[k] * b[k];
  float t = 0.f;
  for (int j = 0; j < 16; ++j) t += s[j];
  return t + tail;
}

// y[0:n] += a * x[0:n]
KD_CLONES void axpy(int64_t n, float a, const float* __restrict x, float* __restrict y) {
  for (int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}

inline void store_tile(const float* acc, int mr, int nr, float alpha, float beta, bool first, float* C,
                       int64_t ldc) {
  for (int r = 0; r < mr; ++r) {
    float* c = C + r * ldc;
    const float* a = acc + r * NR;
    if (!first) {
      for (int j = 0; j < nr; ++j) c[j] += alpha * a[j];
    } else if (beta == 0.f) {
      for (int j = 0; j < nr; ++j) c[j] = alpha * a[j];
    } else {
      for (int j = 0; j < nr; ++j) c[j] = beta * c[j] + alpha * a[j];
    }
  }
}

// Pack B columns [n0, n0+nr) x rows [k0, k0+kc) of op(B) into Bp[kc][NR] (zero-padded).
void pack_b(bool trans_b, const float* B, int64_t ldb, int64_t k0, int64_t kc, int64_t n0, int nr, float* Bp) {
  if (trans_b) {  // op(B)[k][n] = B[n][k]
    for (int j = 0; j < nr; ++j) {
      const float* src = B + (n0 + j) * ldb + k0;
      for (int64_t k = 0; k < kc; ++k) Bp[k * NR + j] = src[k];
    }
    for (int j = nr; j < NR; ++j)
      for (int64_t k = 0; k < kc; ++k) Bp[k * NR + j] = 0.f;
  } else {
    for (int64_t k = 0; k < kc; ++k) {
      const float* src = B + (k0 + k) * ldb + n0;
      float* dst = Bp + k * NR;
      int j = 0;
      for (; j < nr; ++j) dst[j] = src[j];
      for (; j < NR; ++j) dst[j] = 0.f;
    }
  }
}

// Pack A rows [m0, m0+mc) x cols [k0, k0+kc) into MR-row strips, each [kc][MR] (zero-padded).
void pack_a(const float* A, int64_t lda, int64_t m0, int64_t mc, int64_t k0, int64_t kc, float* Ap) {
  for (int64_t s = 0; s < mc; s += MR) {
    float* dst = Ap + s * kc;
    const int mr = (int)std::min<int64_t>(MR, mc - s);
    for (int r = 0; r < MR; ++r) {
      if (r < mr) {
        const float* src = A + (m0 + s + r) * lda + k0;
        for (int64_t k = 0; k < kc; ++k) dst[k * MR + r] = src[k];
      } else {
        for (int64_t k = 0; k < kc; ++k) dst[k * MR + r] = 0.f;
      }
    }
  }
}

int num_threads_for(double flops) {
#ifdef _OPENMP
  if (flops < kParallelFlops) return 1;  // not worth waking the team
  return omp_get_max_threads();
#else
  (void)flops;
  return 1;
#endif
}

void scale_c(int64_t M, int64_t N, float beta, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    float* c = C + i * ldc;
    if (beta == 0.f) std::fill(c, c + N, 0.f);
    else for (int64_t j = 0; j < N; ++j) c[j] *= beta;
  }
}

void small_m(bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const int nt = num_threads_for(2.0 * M * N * K);
  if (trans_b) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
#endif
    for (int64_t n = 0; n < N; ++n) {
      const float* b = B + n * ldb;
      for (int64_t i = 0; i < M; ++i) {
        const float v = alpha * dot(A + i * lda, b, K);
        float& c = C[i * ldc + n];
        c = (beta == 0.f) ? v : beta * c + v;
      }
    }
  } else {
    constexpr int64_t NB = 512;  // column chunk: the accumulator row stays in L1
    const int64_t nblocks = (N + NB - 1) / NB;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
#endif
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      float acc[NB];
      const int64_t n0 = blk * NB, nb = std::min(NB, N - n0);
      for (int64_t i = 0; i < M; ++i) {
        std::fill(acc, acc + nb, 0.f);
        const float* a = A + i * lda;
        for (int64_t k = 0; k < K; ++k) axpy(nb, a[k], B + k * ldb + n0, acc);
        float* c = C + i * ldc + n0;
        if (beta == 0.f)
          for (int64_t j = 0; j < nb; ++j) c[j] = alpha * acc[j];
        else
          for (int64_t j = 0; j < nb; ++j) c[j] = beta * c[j] + alpha * acc[j];
      }
    }
  }
}

// ---- Skinny GEMMs (few rows: decode, tree verify, per-expert blocks), AVX2+FMA ----------------
//
// With M up to a few dozen rows, a packing GEMM (OpenBLAS, or the portable kernel above) spends
// most of its time copying the weight matrix into its packed layout (OpenBLAS 0.3.21: M = 2 costs
// 5x M = 1's sgemv), plus a per-call overhead that adds up over the ~250 GEMMs of a forward. These
// kernels read the operands where they are, once:
//
// * trans_b (B = a weight [N, K], the nn.Linear case): a 3-row x 4-column tile of dot products,
//   12 eight-float accumulators over K, reduced with horizontal adds at the end; the 4 weight
//   rows are streamed once per 3 activation rows (activations stay in L1/L2).
// * B not transposed ([K, N]): a 6-row x 16-column outer-product tile straight on B's rows.
//
// Compiled for AVX2+FMA through function attributes and chosen at run time (cpu_supports), so the
// library itself stays baseline x86-64; elsewhere sgemm() falls back to CBLAS / portable.
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define KD_SKINNY 1
#define KD_AVX2 __attribute__((target("avx2,fma")))
#define KD_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline

KD_AVX2_INLINE void put(float* c, float v, float alpha, float beta) {
  v *= alpha;
  *c = (beta == 0.f) ? v : beta * *c + v;
}

// [sum(a0), sum(a1), sum(a2), sum(a3)], each as ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
KD_AVX2_INLINE __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// sum(a) in hsum4's order. A column outside the 4- and 8-column tiles (the last N % 4 of a call)
// must come out with the same bits as inside one: which case a column is depends on N, and N
// depends on the window (the attention's scores run over the cache plus the window's visible
// tokens), so another order here made a row's logits depend on how many tokens were forwarded
// with it (until the sixty-first session: (x0 + x4) + (x2 + x6) + ..., the AR step and a tree
// verify disagreeing in the last bits, and a sampled token flipping with them; docs/MODEL.md).
KD_AVX2_INLINE float hsum(__m256 a) { return _mm_cvtss_f32(hsum4(a, a, a, a)); }

// Weight elements: FP32, or BF16 (uint16, the high half of an FP32 value; widening is exact, so
// a kernel on BF16 weights computes exactly what it computes on the widened FP32 copy).
KD_AVX2_INLINE __m256 ldw8(const float* b) { return _mm256_loadu_ps(b); }
KD_AVX2_INLINE __m256 ldw8(const uint16_t* b) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
KD_AVX2_INLINE float widen(float b) { return b; }
KD_AVX2_INLINE float widen(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Software prefetch of the weights pays off for few rows, where the kernel waits on memory. With
// more rows the core is busy anyway and lines prefetched that far ahead only evict A from L1
// (measured on Zen 3: slower from ~24 rows on), so the hardware prefetchers are left alone there.
constexpr int64_t kPrefetchMaxM = 20;

// The skinny kernels per ISA (skinny.inc). AVX2: tiles of 3 activation rows x 4 weight rows,
// 8-float vectors. AVX-512 (the CPU has avx512f/bw/vl; KDTREE_CPU_ISA=avx2 keeps AVX2): 5 x 4 tiles
// of 16-float vectors (a 5-token verify in one tile; 26 of the 32 registers), half the
// instructions per multiply-add, each weight vector (and its BF16 widening) used for 5 rows. The
// sums run over 16 lanes instead of 8, so the results differ from the AVX2 kernel's in the last
// bits; within one ISA an output is computed the same way whatever M (results do not depend on T).
// Measured on this 2-vCPU VM (AMD EPYC with AVX-512), the embedded model's forward, in-process A/B:
// docs/BENCHMARKS.md "AVX-512 skinny kernels" (7-38 % faster across four runs at 1-17 tokens).

// s[j] = the sum of h[j]'s 8 lanes (hsum4 for each group of four, hsum for the rest)
template <int NB>
KD_AVX2_INLINE void hsums8(const __m256* h, float* s) {
  if constexpr (NB % 4 == 0) {
    for (int j = 0; j < NB; j += 4) _mm_storeu_ps(s + j, hsum4(h[j], h[j + 1], h[j + 2], h[j + 3]));
  } else {
    for (int j = 0; j < NB; ++j) s[j] = hsum(h[j]);
  }
}

namespace avx2 {
#define KD_ISA KD_AVX2
#define KD_ISA_INLINE KD_AVX2_INLINE
using Vec = __m256;
constexpr int64_t kW = 8, kMB = 3;
KD_ISA_INLINE Vec vzero() { return _mm256_setzero_ps(); }
KD_ISA_INLINE Vec vload(const float* a) { return _mm256_loadu_ps(a); }
KD_ISA_INLINE Vec vloadw(const float* b) { return ldw8(b); }
KD_ISA_INLINE Vec vloadw(const uint16_t* b) { return ldw8(b); }
KD_ISA_INLINE Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
KD_ISA_INLINE Vec vbroadcast(const float* a) { return _mm256_broadcast_ss(a); }
KD_ISA_INLINE Vec vset1(float v) { return _mm256_set1_ps(v); }
KD_ISA_INLINE Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
KD_ISA_INLINE void vstore(float* c, Vec v) { _mm256_storeu_ps(c, v); }
template <int NB>
KD_ISA_INLINE void hsums(const Vec* acc, float* s) { hsums8<NB>(acc, s); }
#include "model/skinny.inc"
#undef KD_ISA
#undef KD_ISA_INLINE
}  // namespace avx2

#define KD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
#define KD_AVX512_INLINE __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"), always_inline)) inline
// GCC 12 warns -Wmaybe-uninitialized inside avx512fintrin.h's shuffle / extract intrinsics (their
// masked builtins take an undefined pass-through operand): a false positive, silenced here only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace avx512 {
#define KD_ISA KD_AVX512
#define KD_ISA_INLINE KD_AVX512_INLINE
using Vec = __m512;
constexpr int64_t kW = 16, kMB = 5;
KD_ISA_INLINE Vec vzero() { return _mm512_setzero_ps(); }
KD_ISA_INLINE Vec vload(const float* a) { return _mm512_loadu_ps(a); }
KD_ISA_INLINE Vec vloadw(const float* b) { return _mm512_loadu_ps(b); }
KD_ISA_INLINE Vec vloadw(const uint16_t* b) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
KD_ISA_INLINE Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
KD_ISA_INLINE Vec vbroadcast(const float* a) { return _mm512_set1_ps(*a); }
KD_ISA_INLINE Vec vset1(float v) { return _mm512_set1_ps(v); }
KD_ISA_INLINE Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
KD_ISA_INLINE void vstore(float* c, Vec v) { _mm512_storeu_ps(c, v); }
template <int NB>
KD_ISA_INLINE void hsums(const Vec* acc, float* s) {  // the two 8-lane halves added, then summed as AVX2 does
  __m256 h[NB];
  for (int j = 0; j < NB; ++j)
    h[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]),
                         _mm512_castps512_ps256(_mm512_shuffle_f32x4(acc[j], acc[j], 0xEE)));  // + upper half
  hsums8<NB>(h, s);
}
#include "model/skinny.inc"
#undef KD_ISA
#undef KD_ISA_INLINE
}  // namespace avx512
#pragma GCC diagnostic pop

bool use_avx512();

// B not transposed ([K, N]: the attention's absorption and P @ latent): 2 kW-column tiles of the
// CPU's widest ISA, then 16-column AVX2 tiles, then plain loops for the last N % 16 columns (every
// column always takes the same one of these, and the two vector tiles give the same bits).
template <class BT>
KD_AVX2 void skinny_nn(int64_t M, int64_t n0, int64_t n1, int64_t K, float alpha, const float* A, int64_t lda,
                       const BT* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  int64_t n = n0;
  if (use_avx512()) n = avx512::nn_blocks(M, n, n1, K, alpha, A, lda, B, ldb, beta, C, ldc);  // 32 columns
  n = avx2::nn_blocks(M, n, n1, K, alpha, A, lda, B, ldb, beta, C, ldc);                     // 16 columns
  for (; n < n1; ++n)  // leftover columns (N % 16): plain loops, an explicit fma (GCC contracted a * b + s
    for (int64_t m = 0; m < M; ++m) {  // for FP32 B and not for BF16 B, whose widening sits in between)
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s = std::fma(A[m * lda + k], widen(B[k * ldb + n]), s);
      put(C + m * ldc + n, s, alpha, beta);
    }
}

// The skinny kernels' ISA: AVX-512 where the CPU has it, unless KDTREE_CPU_ISA=avx2 (read once)
// or sgemm_set_skinny_isa says otherwise.
std::atomic<bool> g_avx512{[] {
  const char* v = std::getenv("KDTREE_CPU_ISA");
  return !(v && std::strcmp(v, "avx2") == 0) && cpu_has_avx512();
}()};
bool use_avx512() { return g_avx512.load(std::memory_order_relaxed); }

template <class BT>
void skinny_tb_isa(int64_t M, int64_t n0, int64_t n1, int64_t K, float alpha, const float* A, int64_t lda,
                   const BT* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (use_avx512()) avx512::skinny_tb(M, n0, n1, K, alpha, A, lda, B, ldb, beta, C, ldc);
  else avx2::skinny_tb(M, n0, n1, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
#endif  // KD_SKINNY

}  // namespace

void sgemm_portable(bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                    const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0 || alpha == 0.f) {
    scale_c(M, N, beta, C, ldc);
    return;
  }
  if (M <= kSmallM) {
    small_m(trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  // One parallel region: each thread owns a contiguous range of NR-wide column strips and runs
  // every K / M block over it (packing its own copy of the A block), so there are no barriers.
  const int64_t n_strips = (N + NR - 1) / NR;
  const int nt = (int)std::min<int64_t>(num_threads_for(2.0 * M * N * K), n_strips);
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
  {
    int tid = 0, nthr = 1;
#ifdef _OPENMP
    tid = omp_get_thread_num();
    nthr = omp_get_num_threads();
#endif
    const int64_t s0 = n_strips * tid / nthr, s1 = n_strips * (tid + 1) / nthr;
    static thread_local std::vector<float> a_pack, b_pack;
    if ((int64_t)a_pack.size() < MC * KC) a_pack.resize(MC * KC);
    if ((int64_t)b_pack.size() < KC * NR) b_pack.resize(KC * NR);
    float* Ap = a_pack.data();
    float* Bp = b_pack.data();
    float acc[MR * NR];
    for (int64_t k0 = 0; k0 < K && s0 < s1; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      const bool first = (k0 == 0);
      for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t mc = std::min(MC, M - m0);
        pack_a(A, lda, m0, mc, k0, kc, Ap);
        for (int64_t s = s0; s < s1; ++s) {
          const int64_t n0 = s * NR;
          const int nr = (int)std::min<int64_t>(NR, N - n0);
          pack_b(trans_b, B, ldb, k0, kc, n0, nr, Bp);
          for (int64_t ms = 0; ms < mc; ms += MR) {
            const int mr = (int)std::min<int64_t>(MR, mc - ms);
            micro_kernel(kc, Ap + ms * kc, Bp, acc);
            store_tile(acc, mr, nr, alpha, beta, first, C + (m0 + ms) * ldc + n0, ldc);
          }
        }
      }
    }
  }
}

namespace {
#ifdef KD_SKINNY
// Which GEMMs take the skinny kernels: up to 128 rows always (every projection of a decode step
// or of a tree verify of up to 128 tokens), up to kSkinnyMaxM rows when B is small enough to stay
// in L2 (attention over the cache: H rows per token). Larger ones (prefill projections) go to
// CBLAS / the portable kernel, whose packing and threads pay off there. Threads: column chunks
// through the work-sharing pool of parallel.h, never an OpenMP team or OpenBLAS's threads (these
// calls take 10-300 us; a barrier waiting for a descheduled thread costs more on a shared machine).
// KDTREE_SKINNY_MAX_M overrides kSkinnyMaxM (0 = never skinny: the CBLAS / portable paths
// alone, for A/B measurements; sgemm_rows_exact does not ask it); read once.
const int64_t kSkinnyMaxM = [] {
  const char* v = std::getenv("KDTREE_SKINNY_MAX_M");
  return (v && *v) ? (int64_t)std::atoll(v) : (int64_t)1024;
}();
constexpr int64_t kSkinnyAlwaysM = 128;
constexpr int64_t kParallelB = 1 << 15;     // floats of B (128 KiB): ~15 us to stream from DRAM
constexpr int64_t kParallelWork = 1 << 20;  // multiply-adds: ~20 us of compute
constexpr int64_t kSkinnyMaxB = 1 << 18;  // floats of B (1 MiB) above which many rows go to BLAS

bool skinny_takes(int64_t M, int64_t N, int64_t K) {
  if (kSkinnyMaxM <= 0 || K <= 0 || !cpu_has_avx2_fma()) return false;
  return !(M > std::min(kSkinnyAlwaysM, kSkinnyMaxM) && (M > kSkinnyMaxM || N * K > kSkinnyMaxB));
}

// BT = uint16_t (BF16 weights): trans_b only, and the same tiles, chunks and threads as FP32 B of
// the same shape, hence the same results as on the widened copy.
// force: whatever the shape (sgemm_rows_exact), where the CPU has the kernels.
template <class BT>
bool sgemm_skinny(bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                  const BT* B, int64_t ldb, float beta, float* C, int64_t ldc, bool force = false) {
  if (force ? (K <= 0 || !cpu_has_avx2_fma()) : !skinny_takes(M, N, K)) return false;
  auto cols = [&](int64_t n0, int64_t n1) {
    if (!trans_b) {
      skinny_nn(M, n0, n1, K, alpha, A, lda, B, ldb, beta, C, ldc);
    } else if (M <= kSkinnyAlwaysM) {  // weights: B streamed once
      skinny_tb_isa(M, n0, n1, K, alpha, A, lda, B, ldb, beta, C, ldc);
    } else {  // many rows (attention scores: H per token): 48-row chunks keep A's chunk in L2
      for (int64_t m0 = 0; m0 < M; m0 += 48)
        skinny_tb_isa(std::min<int64_t>(48, M - m0), n0, n1, K, alpha, A + m0 * lda, lda, B, ldb, beta,
                      C + m0 * ldc, ldc);
    }
  };
  // Column chunks shared with the pool's helpers (parallel.h) when the call is worth it: at least
  // kParallelB floats of B (streaming them is the cost of a decode GEMM) or kParallelWork MACs.
  const int64_t step = trans_b ? 8 : 16;
  const int nt = (N * K >= kParallelB || M * N * K >= kParallelWork) ? parallel_threads() : 1;
  const int64_t chunks = std::min<int64_t>(4 * nt, N / (2 * step));
  if (nt <= 1 || chunks <= 1) {
    cols(0, N);
    return true;
  }
  auto chunk = [&](int64_t i) {
    const int64_t c = (N + step - 1) / step;  // whole steps per chunk, the last one takes the rest
    cols(std::min(N, c * i / chunks * step), std::min(N, c * (i + 1) / chunks * step));
  };
  parallel_chunks(chunks, chunk);
  return true;
}
#endif
}  // namespace

#ifdef KDTREE_HAVE_CBLAS
namespace {
// OpenBLAS has its own threads, which busy-wait between calls as the pool's helpers do: with both
// at work on the same cores each waits out the other (measured on the 2-vCPU VM, the embedded
// model's prefill: 512 tokens 170 ms with OpenBLAS's 2 threads, 142 ms with 1). So OpenBLAS runs
// single-threaded and the pool shares a large call out by column ranges (each a single-threaded BLAS
// call over its own rows of B and columns of C). Also when the user set OPENBLAS_NUM_THREADS (until the
// fifty-fifth session that let OpenBLAS thread itself): OpenBLAS 0.3.21 on an Intel Xeon gives other
// bits with 2 threads than with 1 (up to ~1e-5 on the embedded model's prefill logits), and the
// logits must not depend on an environment variable; the pool's thread count (KDTREE_NUM_THREADS)
// is the knob, and it does not change any element's sum.
bool blas_split() {
  static const bool on = [] {
    using SetThreads = void (*)(int);
    auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
    if (!set) return false;  // another BLAS: left as it is
    set(1);
    return true;
  }();
  return on;
}

constexpr int64_t kBlasSplitWork = 1 << 21;  // multiply-adds (~40 us) before a BLAS call is shared out

void cblas_gemm(bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, (int)M, (int)N, (int)K, alpha, A,
              (int)lda, B, (int)ldb, beta, C, (int)ldc);
}
}  // namespace
#endif

void sgemm(bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (g_force_portable.load(std::memory_order_relaxed)) {
    sgemm_portable(trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  if (M <= 0 || N <= 0) return;
#ifdef KD_SKINNY
  if (alpha != 0.f && sgemm_skinny(trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) return;
#endif
#ifdef KDTREE_HAVE_CBLAS
  if (K <= 0) {
    scale_c(M, N, beta, C, ldc);
    return;
  }
  if (beta == 0.f) scale_c(M, N, 0.f, C, ldc);  // BLAS may read C even with beta == 0 (0 * NaN)
  if (M == 1) {
    if (trans_b)
      cblas_sgemv(CblasRowMajor, CblasNoTrans, (int)N, (int)K, alpha, B, (int)ldb, A, 1, beta, C, 1);
    else
      cblas_sgemv(CblasRowMajor, CblasTrans, (int)K, (int)N, alpha, B, (int)ldb, A, 1, beta, C, 1);
    return;
  }
  const int nt = (blas_split() && M * N * K >= kBlasSplitWork) ? parallel_threads() : 1;
  const int64_t chunks = std::min<int64_t>(2 * nt, N / 64);
  if (nt <= 1 || chunks <= 1) {
    cblas_gemm(trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  auto chunk = [&](int64_t i) {  // columns [n0, n1), whole multiples of 16 but the last
    const int64_t c = (N + 15) / 16, n0 = std::min(N, c * i / chunks * 16), n1 = std::min(N, c * (i + 1) / chunks * 16);
    if (n1 > n0)
      cblas_gemm(trans_b, M, n1 - n0, K, alpha, A, lda, trans_b ? B + n0 * ldb : B + n0, ldb, beta, C + n0, ldc);
  };
  parallel_chunks(chunks, chunk);
#else
  sgemm_portable(trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
}

void sgemm_rows_exact(bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                      const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
#ifdef KD_SKINNY
  if (!g_force_portable.load(std::memory_order_relaxed) && M > 0 && N > 0 && alpha != 0.f &&
      sgemm_skinny(trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, /*force=*/true))
    return;
#endif
  sgemm(trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void sgemm_force_portable(bool on) { g_force_portable.store(on); }

bool sgemm_bf16_weights(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const uint16_t* B,
                        int64_t ldb, float beta, float* C, int64_t ldc, bool trans_b) {
  if (g_force_portable.load(std::memory_order_relaxed)) return false;
  if (M <= 0 || N <= 0) return true;
#ifdef KD_SKINNY
  return alpha != 0.f && sgemm_skinny(trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#else
  return false;
#endif
}

bool sgemm_set_skinny_isa(const char* isa) {
#ifdef KD_SKINNY
  if (std::strcmp(isa, "avx2") == 0) {
    g_avx512.store(false);
    return cpu_has_avx2_fma();
  }
  if (std::strcmp(isa, "avx512") == 0) {
    g_avx512.store(cpu_has_avx512());
    return cpu_has_avx512();
  }
#endif
  return false;
}

const char* sgemm_skinny_isa() {
#ifdef KD_SKINNY
  if (!cpu_has_avx2_fma()) return "none";
  return use_avx512() ? "avx512" : "avx2";
#else
  return "none";
#endif
}

bool sgemm_skinny_takes(int64_t M, int64_t N, int64_t K) {
  if (g_force_portable.load(std::memory_order_relaxed)) return false;
#ifdef KD_SKINNY
  return skinny_takes(M, N, K);
#else
  (void)M, (void)N, (void)K;
  return false;
#endif
}

const char* sgemm_backend() {
#ifdef KDTREE_HAVE_CBLAS
  if (g_force_portable.load()) return "portable";
  return "cblas";
#else
  return "portable";
#endif
}

}  // namespace kdtree
