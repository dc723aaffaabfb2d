// ops.cpp: row-wise CPU ops of the model forward (see ops.h).
#include "model/ops.h"

#include <cmath>
#include <limits>

#include "cpu_features.h"

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#define KD_OPS_AVX2 1
#endif

namespace kdtree {

#ifdef KD_OPS_AVX2
// exp over 8 floats for the softmax and SiLU rows (AVX2+FMA, picked at run time like the skinny
// GEMMs): the Cephes expf scheme, x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for
// e^r, 2^n from the exponent bits; within ~2 ulp of expf over the range. Below -87.3 (and -inf)
// the result is exactly 0, as a masked softmax entry must be; above 88 it saturates at e^88 (1.7e38).
namespace {
#define KD_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline
#define KD_AVX2 __attribute__((target("avx2,fma")))

KD_AVX2_INLINE __m256 exp8(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(under, y);
}

KD_AVX2 void swiglu_row_avx2(const float* gu, int64_t I, float* out) {
  const float* g = gu;
  const float* u = gu + I;
  const __m256 one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
  for (; i < I; ++i) out[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
}

// The softmax's double lane sums: lanes 0-3 of e into lo, 4-7 into hi.
KD_AVX2_INLINE void add_lanes(__m256 e, __m256d& lo, __m256d& hi) {
  lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
  hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
}

// Same steps as the scalar softmax_row: max, exp(s - max) with the sum in double, scale.
KD_AVX2 bool softmax_row_avx2(float* s, int64_t n) {
  const float ninf = -std::numeric_limits<float>::infinity();
  __m256 vm = _mm256_set1_ps(ninf);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, vm);
  float mx = ninf;
  for (float v : lanes) mx = v > mx ? v : mx;
  for (int64_t j = i; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
  if (mx == ninf) {
    for (int64_t j = 0; j < n; ++j) s[j] = 0.f;
    return false;
  }
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256d sum_lo = _mm256_setzero_pd(), sum_hi = _mm256_setzero_pd();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx));
    _mm256_storeu_ps(s + i, e);
    add_lanes(e, sum_lo, sum_hi);
  }
  // The last n % 8 elements as one more vector padded with -inf (exp8 gives exactly 0 there, and a
  // lane sum plus 0.0 is itself): every element takes exp8 and lands in lane i % 8 whatever n is, so
  // an attention row's probabilities do not depend on how many masked (-inf) entries follow it
  // (the window's invisible tokens). Until the sixty-first session the tail took std::exp and
  // was added after the lanes: a row's logits then depended on the window (docs/MODEL.md).
  if (i < n) {
    alignas(32) float t[8];
    for (int j = 0; j < 8; ++j) t[j] = i + j < n ? s[i + j] : ninf;
    const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(t), vmx));
    _mm256_store_ps(t, e);
    for (int64_t j = 0; i + j < n; ++j) s[i + j] = t[j];
    add_lanes(e, sum_lo, sum_hi);
  }
  double parts[4];
  _mm256_storeu_pd(parts, _mm256_add_pd(sum_lo, sum_hi));
  const double sum = (parts[0] + parts[1]) + (parts[2] + parts[3]);
  const float inv = (float)(1.0 / sum);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), vinv));
  for (; i < n; ++i) s[i] *= inv;
  return true;
}

const bool g_avx2 = cpu_has_avx2_fma();
}  // namespace
#endif

void rmsnorm_row(const float* x, const float* w, int64_t D, double eps, float* y) {
  double ss = 0.0;
  for (int64_t i = 0; i < D; ++i) ss += (double)x[i] * (double)x[i];
  const float var = (float)(ss / (double)D);
  const float inv = (float)(1.0 / std::sqrt((double)var + eps));
  for (int64_t i = 0; i < D; ++i) y[i] = w[i] * (x[i] * inv);
}

void rope_cos_sin(int64_t pos, const float* inv_freq, int64_t half, double factor, float* cs) {
  const float p = (float)pos;
  const float f = (float)factor;
  for (int64_t j = 0; j < half; ++j) {
    const float ang = p * inv_freq[j];
    cs[j] = (float)std::cos((double)ang) * f;
    cs[half + j] = (float)std::sin((double)ang) * f;
  }
}

void rope_row(const float* x, const float* cs, int64_t half, bool interleaved, float* y) {
  const float* c = cs;
  const float* s = cs + half;
  for (int64_t j = 0; j < half; ++j) {
    const float a = interleaved ? x[2 * j] : x[j];
    const float b = interleaved ? x[2 * j + 1] : x[j + half];
    y[j] = a * c[j] - b * s[j];
    y[j + half] = b * c[j] + a * s[j];
  }
}

void swiglu_row(const float* gu, int64_t I, float* out) {
#ifdef KD_OPS_AVX2
  if (g_avx2) return swiglu_row_avx2(gu, I, out);
#endif
  const float* g = gu;
  const float* u = gu + I;
  for (int64_t i = 0; i < I; ++i) out[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
}

bool softmax_row(float* s, int64_t n) {
#ifdef KD_OPS_AVX2
  if (g_avx2) return softmax_row_avx2(s, n);
#endif
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
  if (mx == -std::numeric_limits<float>::infinity()) {
    for (int64_t i = 0; i < n; ++i) s[i] = 0.f;
    return false;
  }
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float e = std::exp(s[i] - mx);
    s[i] = e;
    sum += e;
  }
  const float inv = (float)(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
  return true;
}

}  // namespace kdtree
