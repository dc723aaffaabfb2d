// sgemm.cpp: CBLAS dispatch and the portable cache-blocked SGEMM (see sgemm.h).
//
// Portable kernel, Goto-style but small: for each K block (KC) and M block (MC) the A block is
// packed into MR-row strips ([kc][MR] each); the columns are split into NR-wide strips, each
// thread packs its B strip ([kc][NR], lives in L1) and runs the MR x NR micro-kernel over the
// A strips (A block lives in L2). Edges are zero-padded in the packed copies and only the valid
// part of a tile is written back. For M <= kSmallM (decode, T=1) packing costs more than it
// saves, so rows are computed directly: dot products (B^T) or axpy sweeps (B).
#include "model/sgemm.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#ifdef KDTREE_HAVE_CBLAS
#include <cblas.h>
#endif
#ifdef _OPENMP
#include <omp.h>
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

void sgemm(bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
#ifdef KDTREE_HAVE_CBLAS
  if (g_force_portable.load(std::memory_order_relaxed)) {
    sgemm_portable(trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  if (M <= 0 || N <= 0) return;
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
  cblas_sgemm(CblasRowMajor, CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, (int)M, (int)N, (int)K, alpha, A,
              (int)lda, B, (int)ldb, beta, C, (int)ldc);
#else
  sgemm_portable(trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
}

void sgemm_force_portable(bool on) { g_force_portable.store(on); }

const char* sgemm_backend() {
#ifdef KDTREE_HAVE_CBLAS
  if (g_force_portable.load()) return "portable";
  return "cblas";
#else
  return "portable";
#endif
}

}  // namespace kdtree
