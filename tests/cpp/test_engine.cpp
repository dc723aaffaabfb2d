// test_engine.cpp: drives the engine loop (cpp/engine/engine.h) on the toy target with C++
// drafters: DDTree == AR token for token at T=0 and T>0 (same seed) over budgets x depths,
// perfect-oracle acceptance = 1 + depth, exact max_new_tokens, stop tokens, max_seq_len, bad
// drafter output rejected (kdtree::Error) and the generator usable afterwards.
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

#include "check.h"
#include "common.h"
#include "engine/engine.h"
#include "engine/toy_target.h"

using namespace kdtree;

namespace {

// Proposes `ref` (the AR output) with probability 1 - noise per depth, else a wrong top-1.
DraftFn oracle(const std::vector<int32_t>& ref, int64_t P, int64_t V, double noise, uint32_t seed) {
  auto rng = std::make_shared<std::mt19937>(seed);
  return [ref, P, V, noise, rng](const int32_t* ctx, int64_t n, int64_t depth, int64_t top_k, DraftOutput& out) {
    const int64_t g = n - P;
    const int64_t d = std::min<int64_t>(depth, static_cast<int64_t>(ref.size()) - g);
    if (d <= 0) return;
    const int64_t k = std::min<int64_t>(top_k, 3);
    out.d = d;
    out.k = k;
    std::uniform_real_distribution<double> U(0, 1);
    for (int64_t j = 0; j < d; ++j) {
      const int32_t right = ref[g + j];
      const bool wrong = U(*rng) < noise;
      for (int64_t r = 0; r < k; ++r) {
        int32_t t = static_cast<int32_t>((right + 1 + r) % V);
        if (r == 0 && !wrong) t = right;
        out.ids.push_back(t);
        out.values.push_back(r == 0 ? -0.01f : -4.0f - r);
      }
    }
  };
}

// Random logits [depth, V] (the engine does top-k + log-softmax).
DraftFn logits_drafter(int64_t V, uint32_t seed) {
  auto rng = std::make_shared<std::mt19937>(seed);
  return [V, rng](const int32_t*, int64_t, int64_t depth, int64_t, DraftOutput& out) {
    std::normal_distribution<float> N(0, 2);
    out.is_logits = true;
    out.d = depth;
    out.k = V;
    for (int64_t i = 0; i < depth * V; ++i) out.values.push_back(N(*rng));
  };
}

// Duplicate ids and -inf log-probs.
void nasty_drafter(const int32_t* ctx, int64_t n, int64_t depth, int64_t top_k, DraftOutput& out) {
  out.d = depth;
  out.k = top_k;
  for (int64_t j = 0; j < depth; ++j)
    for (int64_t r = 0; r < top_k; ++r) {
      out.ids.push_back((ctx[n - 1] + static_cast<int32_t>(r / 2)) % 16);
      out.values.push_back(r < 3 ? -1.0f * r : -INFINITY);
    }
}

bool same(const std::vector<int32_t>& a, const std::vector<int32_t>& b, size_t n) {
  if (a.size() != n || b.size() < n) return false;
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return false;
  return true;
}

}  // namespace

int main() {
  const int64_t V = 40;
  ToyTarget target(V, 512, 7);
  Generator gen(target);
  const std::vector<int32_t> prompt = {5, 9, 2, 7, 5, 9, 2, 11, 3};
  const int64_t P = static_cast<int64_t>(prompt.size());

  for (float temp : {0.0f, 0.8f}) {
    GenerateParams ar;
    ar.max_new_tokens = 50;
    ar.sampling.temperature = temp;
    ar.sampling.seed = 99;
    const std::vector<int32_t> ref = gen.generate(prompt.data(), P, ar, nullptr, nullptr).tokens;
    CHECK(ref.size() == 50);
    for (int64_t budget : {0, 1, 16, 64, 256})
      for (int64_t depth : {1, 4, 15}) {
        GenerateParams p = ar;
        p.tree_budget = budget;
        p.depth = depth;
        const DraftFn drafters[] = {oracle(ref, P, V, 0.0, 1), oracle(ref, P, V, 0.3, 2), oracle(ref, P, V, 0.9, 3),
                                    logits_drafter(V, 4), nasty_drafter};
        for (const DraftFn& d : drafters) {
          GenerateResult r = gen.generate(prompt.data(), P, p, d, nullptr);
          CHECK(same(r.tokens, ref, 50));
          int64_t sum = 0;
          for (int32_t a : r.acceptance_lengths) sum += a;
          CHECK(1 + sum == 50);
        }
      }
  }

  {  // perfect oracle: every round accepts depth tokens + the bonus
    GenerateParams ar;
    ar.max_new_tokens = 1 + 3 * 5;
    const std::vector<int32_t> ref = gen.generate(prompt.data(), P, ar, nullptr, nullptr).tokens;
    GenerateParams p = ar;
    p.tree_budget = 16;
    p.depth = 4;
    GenerateResult r = gen.generate(prompt.data(), P, p, oracle(ref, P, V, 0.0, 5), nullptr);
    CHECK(r.acceptance_lengths.size() == 3);
    for (int32_t a : r.acceptance_lengths) CHECK(a == 5);
  }

  {  // stop token inside an accepted path
    GenerateParams ar;
    ar.max_new_tokens = 50;
    const std::vector<int32_t> ref = gen.generate(prompt.data(), P, ar, nullptr, nullptr).tokens;
    const int32_t stop = ref[10];
    size_t first = 0;
    while (ref[first] != stop) ++first;
    GenerateParams p = ar;
    p.stop_tokens = {stop};
    GenerateResult r = gen.generate(prompt.data(), P, p, oracle(ref, P, V, 0.0, 6), nullptr);
    CHECK(r.stopped && same(r.tokens, ref, first + 1));
  }

  {  // max_seq_len: a clear error, or a tree shrunk to fit
    ToyTarget small(V, 24, 3);
    Generator g2(small);
    GenerateParams p;
    p.max_new_tokens = 16;
    CHECK_THROWS(g2.generate(prompt.data(), P, p, nullptr, nullptr));
    p.max_new_tokens = 15;
    const std::vector<int32_t> ref = g2.generate(prompt.data(), P, p, nullptr, nullptr).tokens;
    p.tree_budget = 256;
    GenerateResult r = g2.generate(prompt.data(), P, p, oracle(ref, P, V, 0.3, 7), nullptr);
    CHECK(same(r.tokens, ref, 15));
  }

  {  // bad drafter output and drafter exceptions: an exception, then the generator still works
    GenerateParams p;
    p.max_new_tokens = 20;
    p.tree_budget = 8;
    p.depth = 4;
    const std::vector<int32_t> ref = gen.generate(prompt.data(), P, p, nullptr, nullptr).tokens;
    auto bad = [](int kind) {
      return DraftFn([kind](const int32_t*, int64_t, int64_t depth, int64_t top_k, DraftOutput& out) {
        out.d = kind == 0 ? depth + 1 : 1;
        out.k = kind == 1 ? top_k + 1 : 1;
        out.values.assign(out.d * out.k, kind == 2 ? NAN : 0.0f);
        out.ids.assign(out.d * out.k, kind == 3 ? 1000 : 0);
        if (kind == 4) {
          out.k = 2;
          out.values = {-2.0f, -1.0f};
          out.ids = {0, 1};
        }
        if (kind == 5) throw std::runtime_error("drafter failure");
      });
    };
    for (int kind = 0; kind < 6; ++kind) {
      bool threw = false;
      try {
        gen.generate(prompt.data(), P, p, bad(kind), nullptr);
      } catch (const Error&) {
        threw = kind != 5;
      } catch (const std::runtime_error&) {
        threw = kind == 5;
      }
      CHECK(threw);
      CHECK(same(gen.generate(prompt.data(), P, p, nullptr, nullptr).tokens, ref, 20));
    }
    GenerateParams bad_p = p;
    bad_p.sampling.temperature = -1;
    CHECK_THROWS(gen.generate(prompt.data(), P, bad_p, nullptr, nullptr));
    CHECK_THROWS(gen.generate(prompt.data(), 0, p, nullptr, nullptr));
  }
  TEST_MAIN_END();
}
