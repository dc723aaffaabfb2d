// engine.h: the generation loop (prefill, plain autoregressive decoding, DDTree speculative
// decoding), written once against the Target interface (target.h). Python reaches it through
// bindings/bind_engine.cpp; the Python face is python/kdtree_native/generation.py.
//
// One DDTree round (DESIGN.md section 1, docs/tree_contract.md), with L = committed cache length
// and the root = the last emitted token (not yet in the cache):
//   draft(context = prompt + generated so far, depth, top_k) -> logprobs/ids [d,k] or logits [d,V]
//   -> tree build (budget B) -> one forward over root + n nodes at positions L + depth with the
//   ancestor-only visibility -> per-node choice (sampler.h) -> accept walk -> commit(path)
//   -> emit the accepted node tokens and the bonus token; the bonus is the next root.
// A round without a drafter (or with budget 0, or an empty draft) is one AR step.
//
// Legend: P = prompt length, D = depth, K = top-k, V = vocab, n = tree nodes.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "engine/sampler.h"
#include "engine/target.h"
#include "tree.h"

namespace kdtree {

// What a drafter hands back for one round.
struct DraftOutput {
  int64_t d = 0;                // rows: depths 1..d (d <= the depth asked for; 0 = no draft)
  int64_t k = 0;                // columns (<= the top_k asked for); V when is_logits
  bool is_logits = false;       // values holds logits [d,V] (the engine does top-k + log-softmax)
  std::vector<float> values;    // [d,k] log-probs, each row sorted descending (or logits [d,V])
  std::vector<int32_t> ids;     // [d,k] token ids (unused when is_logits)
  void clear() { d = k = 0; is_logits = false; values.clear(); ids.clear(); }
};

// context [context_len]: every committed token, ending with this round's root. The pointer is
// the engine's own buffer: valid (and unchanged) only during the call.
using DraftFn = std::function<void(const int32_t* context, int64_t context_len, int64_t depth, int64_t top_k,
                                   DraftOutput& out)>;
// Called after the first token and after every round: new_tokens [n_new], the total generated
// so far, and max_new_tokens.
using ProgressFn = std::function<void(const int32_t* new_tokens, int64_t n_new, int64_t generated, int64_t max_new)>;

struct GenerateParams {
  int64_t max_new_tokens = 0;
  int64_t tree_budget = 64;   // B: tree nodes per round (root excluded); 0 = AR
  int64_t depth = 15;         // D: the drafter is asked for up to this many depths
  int64_t top_k = 0;          // K: candidates per depth; 0 = min(tree_budget, V)
  SamplingParams sampling;
  std::vector<int32_t> stop_tokens;
  int64_t prefill_chunk = 512;  // prompt tokens per prefill forward
};

struct StageSeconds {
  double prefill = 0, draft = 0, tree_build = 0, verify = 0, accept_commit = 0, total = 0;
};

struct GenerateResult {
  std::vector<int32_t> tokens;              // [N] generated tokens only
  std::vector<int32_t> acceptance_lengths;  // [rounds] tokens emitted per round (bonus included)
  std::vector<int32_t> tree_sizes;          // [rounds] n (nodes verified, root excluded)
  std::vector<int32_t> draft_depths;        // [rounds] d returned by the drafter (0 = none)
  StageSeconds seconds;
  bool stopped = false;                     // ended on a stop token
};

// Checks a drafter's output against the round's request (throws Error naming the problem).
void check_draft_output(const DraftOutput& out, int64_t depth, int64_t top_k, int64_t vocab);

class Generator {
 public:
  explicit Generator(Target& target);
  // prompt [P]. drafter may be empty (plain AR). Resets the target's cache first.
  GenerateResult generate(const int32_t* prompt, int64_t P, const GenerateParams& params, const DraftFn& drafter,
                          const ProgressFn& progress);
  // The committed-token buffer (prompt + generated); capacity fixed at max_seq_len + 1 so the
  // pointer stays valid for the Generator's lifetime (drafters get zero-copy views of it).
  const int32_t* token_buffer() const { return buf_.data(); }
  int64_t num_tokens() const { return n_; }
  Target& target() { return target_; }

 private:
  Target& target_;
  std::vector<int32_t> buf_;
  int64_t n_ = 0;
};

}  // namespace kdtree
