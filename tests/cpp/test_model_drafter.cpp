// test_model_drafter.cpp: the C++ model drafter (cpp/engine/model_drafter.h) over a fake model
// whose logits depend on (token, position) only and whose cache is a length: the chain's rows,
// the cache following the context (forwards per call: the tokens after the common prefix, then
// depth - 1 steps), the truncation back to the context, and the min_chain_prob rule. The GPU
// drafter applies the rule after its full chain (rows_kept on each row's log p(top-1)); here it
// must keep exactly the rows the host drafter's early stop keeps, over many contexts and
// thresholds.
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "common.h"
#include "engine/model_drafter.h"

using namespace kdtree;

namespace {

class FakeModel : public TargetModel {
 public:
  FakeModel(int64_t V, int64_t max_len) : max_len_(max_len) { cfg_.vocab_size = V; }
  const ModelConfig& config() const override { return cfg_; }
  int64_t max_seq_len() const override { return max_len_; }
  const char* device() const override { return "cpu"; }
  void set_weight(const std::string&, const float*, const std::vector<int64_t>&) override {}
  std::vector<std::string> missing_weights() const override { return {}; }
  void finalize() override {}
  bool finalized() const override { return true; }
  void forward(const int32_t* tokens, const int32_t* positions, const uint8_t*, int64_t T, float* logits) override {
    if (len_ + T > max_len_) throw Error("fake: past max_seq_len");
    const int64_t V = cfg_.vocab_size;
    for (int64_t t = 0; t < T; ++t) {
      if (positions[t] != len_ + t) throw Error("fake: position " + std::to_string(positions[t]) + " at slot " +
                                                std::to_string(len_ + t));
      logits_row(tokens[t], positions[t], logits + t * V);
    }
    pending_ = T;
    ++forwards_;
    tokens_in_ += T;
  }
  void commit(const int32_t*, int64_t n) override {
    len_ += n;
    pending_ = 0;
  }
  void truncate(int64_t n) override {
    if (n < 0 || n > len_) throw Error("fake: truncate past the cache");
    len_ = n;
    pending_ = 0;
  }
  void reset() override { len_ = pending_ = 0; }
  int64_t cache_len() const override { return len_; }
  int64_t pending_len() const override { return pending_; }

  // a row whose confidence varies with (token, position): a peak at a pseudo-random token
  void logits_row(int32_t tok, int32_t pos, float* row) const {
    const int64_t V = cfg_.vocab_size;
    uint64_t h = (uint64_t)tok * 0x9E3779B97F4A7C15ull ^ ((uint64_t)pos + 17) * 0xBF58476D1CE4E5B9ull;
    const float peak = 0.5f + (float)((h >> 7) % 8);
    const int64_t top = (int64_t)((h >> 20) % (uint64_t)V);
    for (int64_t v = 0; v < V; ++v) {
      h = h * 6364136223846793005ull + 1442695040888963407ull;
      row[v] = (float)((h >> 40) % 1000) / 1000.0f + (v == top ? peak : 0.0f);
    }
  }
  int64_t forwards_ = 0, tokens_in_ = 0;

 private:
  ModelConfig cfg_;
  int64_t max_len_, len_ = 0, pending_ = 0;
};

// exposes the rule the GPU drafter applies after its chain
struct Probe : ModelDrafter {
  using ModelDrafter::ModelDrafter;
  int64_t kept(const std::vector<double>& logp, int64_t rows) const { return rows_kept(logp.data(), rows); }
};

int64_t argmax(const float* row, int64_t V) {
  int64_t b = 0;
  for (int64_t j = 1; j < V; ++j)
    if (row[j] > row[b]) b = j;
  return b;
}

}  // namespace

int main() {
  const int64_t V = 37, max_len = 64;
  std::mt19937 rng(5);
  // 1. rows = the greedy chain of the fake model; the cache follows the context
  {
    FakeModel m(V, max_len);
    ModelDrafter d(m, ModelDraftParams{0.0, 4});
    std::vector<int32_t> ctx = {3, 1, 4, 1, 5, 9, 2, 6, 5};
    DraftOutput out;
    d.draft(ctx.data(), (int64_t)ctx.size(), 5, 8, out);
    CHECK(out.is_logits && out.d == 5 && out.k == V && (int64_t)out.values.size() == 5 * V);
    CHECK(m.cache_len() == (int64_t)ctx.size() + 4);        // the chain's 4 tokens stay
    CHECK(m.tokens_in_ == 9 + 4 && m.forwards_ == 3 + 4);  // chunks of 4: 4 + 4 + 1, then 4 steps
    std::vector<float> row(V);
    std::vector<int32_t> chain;  // the chain's tokens (row r's argmax)
    int32_t tok = ctx.back();
    for (int64_t r = 0; r < 5; ++r) {
      m.logits_row(tok, (int32_t)(ctx.size() - 1 + r), row.data());
      bool same = true;
      for (int64_t v = 0; v < V; ++v) same &= row[v] == out.values[r * V + v];
      CHECK(same);
      tok = (int32_t)argmax(row.data(), V);
      chain.push_back(tok);
    }
    // the chain's first two tokens accepted + a root: only the root is fed (their entries are there), then
    // the chain of 3 rows
    std::vector<int32_t> acc = ctx;
    acc.push_back(chain[0]);
    acc.push_back(chain[1]);
    acc.push_back((chain[2] + 1) % (int32_t)V);
    int64_t before = m.tokens_in_;
    d.draft(acc.data(), (int64_t)acc.size(), 3, 8, out);
    CHECK(m.tokens_in_ - before == 1 + 2 && m.cache_len() == (int64_t)acc.size() + 2);
    // two tokens the chain did not draft + a root: 3 tokens fed, then the chain
    ctx.push_back((chain[0] + 1) % (int32_t)V);
    ctx.push_back(8);
    ctx.push_back(9);
    before = m.tokens_in_;
    d.draft(ctx.data(), (int64_t)ctx.size(), 3, 8, out);
    CHECK(m.tokens_in_ - before == 3 + 2 && m.cache_len() == (int64_t)ctx.size() + 2);
    // a context that does not fit: no draft, the cache untouched
    std::vector<int32_t> big(max_len, 1);
    d.draft(big.data(), max_len, 3, 8, out);
    CHECK(out.d == 0 && m.cache_len() == (int64_t)ctx.size() + 2);
    // depth capped by the cache: n + depth - 1 <= max_len
    std::vector<int32_t> edge(max_len - 2, 2);
    d.draft(edge.data(), (int64_t)edge.size(), 8, 8, out);
    CHECK(out.d == 3 && m.cache_len() == (int64_t)edge.size() + 2);  // n + depth - 1 == max_len
    // a context token outside the vocabulary
    std::vector<int32_t> badv = {1, (int32_t)V};
    CHECK_THROWS(d.draft(badv.data(), 2, 2, 8, out));
  }
  // 2. min_chain_prob: the host's early stop == rows_kept on the full chain's log p(top-1)
  int64_t stopped = 0, cases = 0;
  for (double mcp : {0.05, 0.2, 0.5, 0.8, 0.95}) {
    FakeModel mf(V, max_len), ms(V, max_len);
    ModelDrafter full(mf, ModelDraftParams{0.0, 512});
    Probe rule(ms, ModelDraftParams{mcp, 512});
    for (int c = 0; c < 60; ++c) {
      std::vector<int32_t> ctx(1 + rng() % 20);
      for (auto& x : ctx) x = (int32_t)(rng() % V);
      const int64_t depth = 1 + rng() % 9;
      DraftOutput a, b;
      full.draft(ctx.data(), (int64_t)ctx.size(), depth, 8, a);
      rule.draft(ctx.data(), (int64_t)ctx.size(), depth, 8, b);
      std::vector<double> logp(a.d);
      for (int64_t r = 0; r < a.d; ++r) logp[r] = logp_top1(a.values.data() + r * V, V, argmax(a.values.data() + r * V, V));
      CHECK(a.d == depth && b.d == rule.kept(logp, a.d));
      bool prefix = (int64_t)b.values.size() == b.d * V;
      for (int64_t i = 0; prefix && i < b.d * V; ++i) prefix = a.values[i] == b.values[i];
      CHECK(prefix);
      stopped += b.d < a.d;
      ++cases;
    }
  }
  CHECK(stopped > 20 && stopped < cases);  // the rule both stops and keeps chains here
  // 3. parameters
  {
    FakeModel m(V, max_len);
    CHECK_THROWS(ModelDrafter(m, ModelDraftParams{1.0, 4}));
    CHECK_THROWS(ModelDrafter(m, ModelDraftParams{-0.1, 4}));
    CHECK_THROWS(ModelDrafter(m, ModelDraftParams{0.0, 0}));
  }
  std::printf("test_model_drafter: %d checks, %d failures (%lld of %lld chains stopped early)\n", kdtest::checks(),
              kdtest::failures(), (long long)stopped, (long long)cases);
  return kdtest::failures() != 0;
}
