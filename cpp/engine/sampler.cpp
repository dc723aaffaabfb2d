// sampler.cpp: see sampler.h.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "common.h"

namespace kdtree {

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

double sample_uniform(uint64_t seed, int64_t index) {
  const uint64_t h = splitmix64(splitmix64(seed) ^ (static_cast<uint64_t>(index) * 0xD6E8FEB86659FD93ull));
  return static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);
}

void check_sampling_params(const SamplingParams& p) {
  KD_CHECK(std::isfinite(p.temperature) && p.temperature >= 0.0f,
           "temperature must be a finite number >= 0, got " + std::to_string(p.temperature));
  KD_CHECK(p.top_k >= 0, "top_k (target filtering) must be >= 0 (0 = off)");
  KD_CHECK(p.top_p > 0.0f && p.top_p <= 1.0f, "top_p must be in (0, 1], got " + std::to_string(p.top_p));
}

Sampler::Sampler(const SamplingParams& p) : p_(p) { check_sampling_params(p); }

int32_t Sampler::choose(const float* logits, int64_t V, int64_t index) {
  if (p_.temperature == 0.0f) {
    int64_t best = -1;
    for (int64_t v = 0; v < V; ++v)
      if (!std::isnan(logits[v]) && (best < 0 || logits[v] > logits[best])) best = v;
    return static_cast<int32_t>(best < 0 ? 0 : best);
  }
  const double inv_t = 1.0 / static_cast<double>(p_.temperature);
  // Candidates: all ids in id order, or (with filtering) sorted by logit, descending, ties by id.
  order_.resize(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) order_[v] = static_cast<int32_t>(v);
  auto by_logit = [logits](int32_t a, int32_t b) {
    const float la = std::isnan(logits[a]) ? -INFINITY : logits[a];
    const float lb = std::isnan(logits[b]) ? -INFINITY : logits[b];
    return la > lb || (la == lb && a < b);
  };
  int64_t n = V;
  const bool use_k = p_.top_k > 0 && p_.top_k < V;
  const bool use_p = p_.top_p < 1.0f;
  if (use_k) {
    std::partial_sort(order_.begin(), order_.begin() + p_.top_k, order_.end(), by_logit);
    n = p_.top_k;
  } else if (use_p) {
    std::sort(order_.begin(), order_.end(), by_logit);
  }
  double mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float l = logits[order_[i]];
    if (!std::isnan(l)) mx = std::max(mx, static_cast<double>(l));
  }
  if (!std::isfinite(mx)) {
    // +inf: those logits hold all the mass (the softmax's limit), the first in candidate order
    // wins; nothing but -inf / NaN: degenerate, the first candidate
    if (mx > 0)
      for (int64_t i = 0; i < n; ++i)
        if (logits[order_[i]] == INFINITY) return order_[i];
    return order_[0];
  }
  prob_.resize(static_cast<size_t>(n));
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float l = logits[order_[i]];
    prob_[i] = std::isnan(l) ? 0.0 : std::exp((static_cast<double>(l) - mx) * inv_t);
    total += prob_[i];
  }
  if (use_p) {  // smallest prefix (in sorted order) whose mass reaches top_p
    double cum = 0.0;
    int64_t m = 0;
    while (m < n) {
      cum += prob_[m++];
      if (cum >= static_cast<double>(p_.top_p) * total) break;
    }
    n = m;
    total = cum;
  }
  const double target = sample_uniform(p_.seed, index) * total;
  double cum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    cum += prob_[i];
    if (target < cum) return order_[i];
  }
  for (int64_t i = n - 1; i >= 0; --i)  // rounding at the very top: last non-zero candidate
    if (prob_[i] > 0.0) return order_[i];
  return order_[0];
}

}  // namespace kdtree
