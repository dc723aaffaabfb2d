#include "engine/model_drafter.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "common.h"
#include "tree.h"

namespace kdtree {

void check_model_draft_params(const ModelDraftParams& p) {
  if (!(p.min_chain_prob >= 0.0 && p.min_chain_prob < 1.0))
    throw Error("ModelDrafter: min_chain_prob must be in [0, 1), got " + std::to_string(p.min_chain_prob));
  if (p.prefill_chunk < 1)
    throw Error("ModelDrafter: prefill_chunk must be >= 1, got " + std::to_string(p.prefill_chunk));
}

double logp_top1(const float* row, int64_t V, int64_t top) { return -std::log(row_sumexp(row, V, row[top])); }

ModelDrafter::ModelDrafter(TargetModel& model, const ModelDraftParams& p) : model_(model), p_(p) {
  check_model_draft_params(p_);
  if (!model_.finalized()) throw Error("ModelDrafter: the draft model is not finalized (weights incomplete)");
}

bool ModelDrafter::chain_stops(double& cum, double logp) const {
  if (p_.min_chain_prob <= 0.0) return false;
  cum += logp;
  return cum < std::log(p_.min_chain_prob);
}

int64_t ModelDrafter::rows_kept(const double* logp, int64_t rows) const {
  double cum = 0.0;
  int64_t d = 1;
  while (d < rows && !chain_stops(cum, logp[d - 1])) ++d;
  return d;
}

void ModelDrafter::draft(const int32_t* ctx, int64_t n, int64_t depth, int64_t /*top_k*/, DraftOutput& out) {
  out.clear();
  const int64_t max_len = model_.max_seq_len();
  if (n <= 0 || n >= max_len || depth <= 0) return;
  if (model_.cache_len() != static_cast<int64_t>(held_.size())) {  // someone else moved the cache
    held_.clear();
    model_.reset();
  }
  int64_t m = std::min<int64_t>(static_cast<int64_t>(held_.size()), n - 1);  // feed at least the root
  for (int64_t i = 0; i < m; ++i)
    if (held_[i] != ctx[i]) {
      m = i;
      break;
    }
  const int64_t V = model_.config().vocab_size;
  for (int64_t i = m; i < n; ++i)  // (a GPU model's device forward does not check its tokens)
    if (ctx[i] < 0 || ctx[i] >= V)
      throw Error("ModelDrafter: context token " + std::to_string(ctx[i]) + " at index " + std::to_string(i) +
                  " outside the draft model's vocab [0, " + std::to_string(V) + ")");
  try {
    if (m < static_cast<int64_t>(held_.size())) model_.truncate(m);
    held_.resize(static_cast<size_t>(m));
    chain_kept_.clear();
    feed_and_chain(ctx, m, n, std::min(depth, max_len - n + 1), out);
  } catch (...) {
    held_.clear();
    out.clear();
    try {
      model_.reset();
    } catch (...) {
    }
    throw;
  }
  held_.assign(ctx, ctx + n);
  held_.insert(held_.end(), chain_kept_.begin(), chain_kept_.end());
}

void ModelDrafter::feed_and_chain(const int32_t* ctx, int64_t m, int64_t n, int64_t depth, DraftOutput& out) {
  const int64_t V = model_.config().vocab_size;
  out.values.resize(static_cast<size_t>(depth * V));
  for (int64_t c0 = m; c0 < n; c0 += p_.prefill_chunk) {
    const int64_t T = std::min(p_.prefill_chunk, n - c0);
    pos_.resize(static_cast<size_t>(T));
    keep_.resize(static_cast<size_t>(T));
    for (int64_t i = 0; i < T; ++i) {
      pos_[i] = static_cast<int32_t>(c0 + i);
      keep_[i] = static_cast<int32_t>(i);
    }
    // only the last fed token's logits are used (the chain's first row): earlier chunks ask for none
    model_.forward_last(ctx + c0, pos_.data(), nullptr, T, c0 + T == n ? 1 : 0, out.values.data());
    model_.commit(keep_.data(), T);
  }
  double cum = 0.0;
  int64_t d = 1;
  for (int64_t i = 1; i < depth; ++i) {  // greedy chain: one token per step, committed and kept (see the header)
    const float* row = out.values.data() + (i - 1) * V;
    const int64_t tok = greedy_.choose(row, V, 0);  // the first index of the largest logit
    if (p_.min_chain_prob > 0.0 && chain_stops(cum, logp_top1(row, V, tok))) break;
    const int32_t t32 = static_cast<int32_t>(tok), p32 = static_cast<int32_t>(n + i - 1), k0 = 0;
    model_.forward(&t32, &p32, nullptr, 1, out.values.data() + i * V);
    model_.commit(&k0, 1);
    chain_kept_.push_back(t32);
    ++d;
  }
  out.values.resize(static_cast<size_t>(d * V));
  out.is_logits = true;
  out.d = d;
  out.k = V;
}

}  // namespace kdtree
