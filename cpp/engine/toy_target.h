// toy_target.h: a deterministic, dependency-free Target for testing the engine loop (ctest and
// pytest) without a real model. Its cache stores (token, position) per entry, and the logits of
// a query depend on everything it can see, so a wrong visibility mask or a wrong compaction
// changes the output:
//   logits[v] = scale * ( 2 * h(token, parent_token, v)  +  h(sum of all visible entries, v) )
// where parent_token is the visible entry at the highest position below the query's, and
// h(.) is a seeded hash mapped to [-1, 1). The first term gives n-gram-like structure (so
// prompt-lookup drafting finds repeats); the second makes every token depend on its whole
// ancestry.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/target.h"

namespace kdtree {

class ToyTarget : public Target {
 public:
  ToyTarget(int64_t vocab_size, int64_t max_seq_len, uint64_t seed, float scale = 3.0f);
  int64_t vocab_size() const override { return vocab_; }
  int64_t max_seq_len() const override { return max_seq_; }
  int64_t cache_len() const override { return static_cast<int64_t>(cache_tok_.size()); }
  void forward(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility,
               int64_t T, float* logits_out) override;
  void commit(const int32_t* keep, int64_t n) override;
  void reset() override;
  void truncate(int64_t n) override;
  bool cache_epoch(uint64_t* out) const override {
    *out = epoch_;
    return true;
  }
  int64_t forward_calls() const { return forward_calls_; }
  int64_t forward_tokens() const { return forward_tokens_; }

 private:
  int64_t vocab_, max_seq_;
  uint64_t seed_;
  float scale_;
  std::vector<int32_t> cache_tok_, cache_pos_;      // committed entries
  uint64_t cache_sum_ = 0;                          // sum of entry hashes over committed entries
  std::vector<int32_t> pend_tok_, pend_pos_;        // last forward's window
  int64_t forward_calls_ = 0, forward_tokens_ = 0;
  uint64_t epoch_ = 0;  // bumped by forward / commit / truncate / reset
};

}  // namespace kdtree
