// ops.cpp: row-wise CPU ops of the model forward (see ops.h).
#include "model/ops.h"

#include <cmath>
#include <limits>

namespace kdtree {

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
  const float* g = gu;
  const float* u = gu + I;
  for (int64_t i = 0; i < I; ++i) out[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
}

bool softmax_row(float* s, int64_t n) {
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
