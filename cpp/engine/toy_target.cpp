// toy_target.cpp: see toy_target.h.
#include "engine/toy_target.h"

#include <string>

#include "common.h"

namespace kdtree {

namespace {
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
float unit(uint64_t x) {  // [-1, 1)
  return static_cast<float>(static_cast<double>(mix64(x) >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0);
}
uint64_t entry_hash(uint64_t seed, int32_t tok, int32_t pos) {
  return mix64(seed ^ mix64((static_cast<uint64_t>(static_cast<uint32_t>(tok)) << 32) |
                            static_cast<uint32_t>(pos)));
}
}  // namespace

ToyTarget::ToyTarget(int64_t vocab_size, int64_t max_seq_len, uint64_t seed, float scale)
    : vocab_(vocab_size), max_seq_(max_seq_len), seed_(seed), scale_(scale) {
  KD_CHECK(vocab_size >= 2, "ToyTarget: vocab_size must be >= 2");
  KD_CHECK(max_seq_len >= 1, "ToyTarget: max_seq_len must be >= 1");
}

void ToyTarget::reset() {
  ++epoch_;
  cache_tok_.clear();
  cache_pos_.clear();
  pend_tok_.clear();
  pend_pos_.clear();
  cache_sum_ = 0;
}

void ToyTarget::forward(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility,
                        int64_t T, float* logits_out) {
  KD_CHECK(T >= 1, "ToyTarget.forward: need at least one token");
  KD_CHECK(cache_len() + T <= max_seq_,
           "ToyTarget.forward: " + std::to_string(cache_len()) + " cached + " + std::to_string(T) +
               " new entries exceed max_seq_len " + std::to_string(max_seq_));
  for (int64_t i = 0; i < T; ++i) {
    KD_CHECK(tokens[i] >= 0 && tokens[i] < vocab_, "ToyTarget.forward: token id out of range");
    KD_CHECK(positions[i] >= 0, "ToyTarget.forward: negative position");
  }
  ++epoch_;
  ++forward_calls_;
  forward_tokens_ += T;
  pend_tok_.assign(tokens, tokens + T);
  pend_pos_.assign(positions, positions + T);
  for (int64_t i = 0; i < T; ++i) {
    uint64_t sum = cache_sum_;
    int32_t parent_tok = -1, parent_pos = -1;
    if (!cache_pos_.empty()) {  // committed entries are in position order: the last is highest
      parent_tok = cache_tok_.back();
      parent_pos = cache_pos_.back();
    }
    for (int64_t j = 0; j < T; ++j) {
      if (!visibility[i * T + j]) continue;
      sum += entry_hash(seed_, tokens[j], positions[j]);
      if (positions[j] < positions[i] && positions[j] > parent_pos) {
        parent_pos = positions[j];
        parent_tok = tokens[j];
      }
    }
    const uint64_t local = mix64(seed_ * 31 + static_cast<uint64_t>(tokens[i]) * 1000003ull +
                                 static_cast<uint64_t>(static_cast<int64_t>(parent_tok) + 1));
    const uint64_t global = mix64(sum ^ 0x5DEECE66Dull);
    float* row = logits_out + i * vocab_;
    for (int64_t v = 0; v < vocab_; ++v)
      row[v] = scale_ * (2.0f * unit(local + static_cast<uint64_t>(v)) +
                         unit(global + static_cast<uint64_t>(v) * 0x632BE59BD9B4E019ull));
  }
}

void ToyTarget::commit(const int32_t* keep, int64_t n) {
  ++epoch_;
  const int64_t T = static_cast<int64_t>(pend_tok_.size());
  for (int64_t j = 0; j < n; ++j) {
    KD_CHECK(keep[j] >= 0 && keep[j] < T, "ToyTarget.commit: keep index outside the last forward's window");
    KD_CHECK(j == 0 || keep[j] > keep[j - 1], "ToyTarget.commit: keep indices must be strictly increasing");
  }
  for (int64_t j = 0; j < n; ++j) {
    cache_tok_.push_back(pend_tok_[keep[j]]);
    cache_pos_.push_back(pend_pos_[keep[j]]);
    cache_sum_ += entry_hash(seed_, pend_tok_[keep[j]], pend_pos_[keep[j]]);
  }
  pend_tok_.clear();
  pend_pos_.clear();
}

void ToyTarget::truncate(int64_t n) {
  KD_CHECK(n >= 0 && n <= cache_len(), "ToyTarget.truncate: n outside [0, cache_len]");
  ++epoch_;
  cache_tok_.resize(static_cast<size_t>(n));
  cache_pos_.resize(static_cast<size_t>(n));
  cache_sum_ = 0;
  for (int64_t j = 0; j < n; ++j) cache_sum_ += entry_hash(seed_, cache_tok_[j], cache_pos_[j]);
  pend_tok_.clear();
  pend_pos_.clear();
}

}  // namespace kdtree
