// sampler.h: the target's per-token choice, shared by AR decoding and DDTree verification
// (cpp/engine). temperature == 0: argmax (lowest id on ties). temperature > 0: a sample from
// softmax(logits / temperature), optionally restricted to the top_k largest logits and then to
// the smallest set of tokens whose probability reaches top_p (renormalised).
//
// Randomness: the sample for the token at absolute sequence index `index` (prompt tokens are
// 0..P-1, the first generated token is P) uses the uniform u = sample_uniform(seed, index) and
// inverse-CDF sampling. Every tree node that would produce the token at index i uses the same
// u; only one node per depth is ever accepted, so each accepted token is an exact sample given
// its ancestors (lossless), and AR and DDTree with the same seed emit the same tokens.
#pragma once
#include <cstdint>
#include <vector>

namespace kdtree {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy
  int64_t top_k = 0;         // 0 = no top-k filtering of the target
  float top_p = 1.0f;        // 1 = no nucleus filtering
  uint64_t seed = 0;
};

// Uniform in [0, 1) from (seed, index); a pure function (reproducible, order-independent).
double sample_uniform(uint64_t seed, int64_t index);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // logits [V] -> chosen token id.
  int32_t choose(const float* logits, int64_t V, int64_t index);
  const SamplingParams& params() const { return p_; }

 private:
  SamplingParams p_;
  std::vector<int32_t> order_;  // scratch: candidate ids
  std::vector<double> prob_;    // scratch: candidate weights
};

// Checks the parameters (throws Error naming the problem).
void check_sampling_params(const SamplingParams& p);

}  // namespace kdtree
