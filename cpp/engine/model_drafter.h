// model_drafter.h: a smaller model's greedy chain as the drafter, in C++, so that the engine calls
// it inside the round without Python (bindings: _native.ModelDraft; Python:
// kdtree_native.ModelDrafter, whose Python path for targets without truncate is the same
// definition).
//
// Per call, with ctx [n] the committed context ending with the round's root:
//   * the model's committed cache is rolled back to the longest common prefix m of what it holds
//     and ctx (m <= n - 1: the root is always fed, its logits are row 0), and ctx[m .. n) is fed
//     in causal chunks of prefill_chunk tokens, each committed;
//   * then the chain: for i = 1 .. depth - 1 the argmax of row i - 1 (first index of the largest
//     logit) is fed at position n + i - 1 and committed, its logits are row i;
//   * the chain's tokens stay in the cache (fifty-ninth session; before, it was truncated back to n):
//     the next call's context is this one + the accepted tokens + a new root, and where the target
//     accepted the chain's own tokens their cache entries are already there, so only the tokens
//     after the common prefix are fed (the root at least). On the 2-vCPU VM a draft after 3 new
//     tokens cost ~0.04 ms more than after one (a ~0.07 ms row); the embedded draft model's
//     accepted tokens are mostly its chain's. (The GPU drafter, cuda/engine/cuda_model_drafter.h,
//     still truncates back to n.)
// depth is capped at max_seq_len - n + 1; a context of 0 or >= max_seq_len tokens gives no draft.
// min_chain_prob > 0 stops the chain before row i once the sum over the rows before it of
// log p(top-1) = -log(sum_j exp(x_j - max)) (float64) falls below log(min_chain_prob).
// The output is logits [d, V]; the engine takes their top-k. If the model's cache was moved by
// someone else (its length differs from what the drafter left), it starts over from an empty
// cache; an exception inside a call also empties it.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/engine.h"
#include "engine/sampler.h"
#include "model/model.h"

namespace kdtree {

struct ModelDraftParams {
  double min_chain_prob = 0.0;  // in [0, 1)
  int64_t prefill_chunk = 512;  // >= 1
};

// Throws Error unless 0 <= min_chain_prob < 1 and prefill_chunk >= 1.
void check_model_draft_params(const ModelDraftParams& p);

// -log(sum_j exp(row_j - row[top])) in float64: log p of the top-1 token under softmax(row).
double logp_top1(const float* row, int64_t V, int64_t top);

class ModelDrafter {
 public:
  ModelDrafter(TargetModel& model, const ModelDraftParams& p);
  virtual ~ModelDrafter() = default;
  ModelDrafter(const ModelDrafter&) = delete;
  ModelDrafter& operator=(const ModelDrafter&) = delete;

  // context [n] -> out: logits [d, V] (d <= depth; 0 = no draft). top_k is not used (the
  // engine takes the top-k of the logits).
  void draft(const int32_t* context, int64_t n, int64_t depth, int64_t top_k, DraftOutput& out);
  TargetModel& model() { return model_; }
  const ModelDraftParams& params() const { return p_; }

 protected:
  // With the cache holding ctx[0 .. m): feed ctx[m .. n), decode the chain (depth >= 1 rows at
  // most), truncate back to n, fill out. The host version runs the model's forward();
  // cuda/engine/cuda_model_drafter.h keeps the chain on the GPU.
  virtual void feed_and_chain(const int32_t* ctx, int64_t m, int64_t n, int64_t depth, DraftOutput& out);
  // The min_chain_prob rule: adds the log p(top-1) of the row the next step would be drafted from
  // to cum; true when the chain stops before that step (never when min_chain_prob is 0).
  bool chain_stops(double& cum, double logp) const;
  // How many rows of a chain of `rows` the rule keeps, given each row's log p(top-1) (the first
  // rows - 1 are used: the rows that a next step was drafted from).
  int64_t rows_kept(const double* logp, int64_t rows) const;

  TargetModel& model_;
  ModelDraftParams p_;
  std::vector<int32_t> held_;  // what the committed cache holds
  std::vector<int32_t> chain_kept_;  // the chain tokens feed_and_chain left in the cache after the context
  std::vector<int32_t> pos_, keep_;
  Sampler greedy_{SamplingParams()};  // temperature 0: the chain's argmax
};

}  // namespace kdtree
