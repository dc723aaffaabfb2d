// engine.cpp: see engine.h.
#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "common.h"

namespace kdtree {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
std::string s(int64_t v) { return std::to_string(v); }
}  // namespace

void check_draft_shape(const DraftOutput& out, int64_t depth, int64_t top_k, int64_t vocab) {
  KD_CHECK(out.d >= 0, "drafter output: negative number of rows");
  KD_CHECK(out.d <= depth, "drafter output has d=" + s(out.d) + " rows but this call asked for depth=" + s(depth) +
                               " (need d <= depth: the depth argument, which the engine may set below generate's depth)");
  if (out.d == 0) return;
  if (out.is_logits) {
    KD_CHECK(out.k == vocab, "drafter logits must have vocab_size=" + s(vocab) + " columns, got " + s(out.k));
    return;
  }
  KD_CHECK(out.k >= 1, "drafter output has d=" + s(out.d) + " rows but k=0 columns");
  KD_CHECK(out.k <= top_k, "drafter output has k=" + s(out.k) + " columns but top_k is " + s(top_k) + " (need k <= top_k)");
}

void check_draft_output(const DraftOutput& out, int64_t depth, int64_t top_k, int64_t vocab) {
  check_draft_shape(out, depth, top_k, vocab);
  if (out.d == 0) return;
  if (out.device_values) {  // the values were checked on the device; the counts here
    KD_CHECK(out.device_checked, "device draft: its values were not checked (engine bug)");
    KD_CHECK(out.is_logits || out.device_ids, "device draft: log-probs without token ids");
    KD_CHECK(static_cast<int64_t>(out.row_finite.size()) == out.d, "device draft: row_finite must have d entries");
    if (out.is_logits)
      for (int64_t r = 0; r < out.d; ++r)
        KD_CHECK(out.row_finite[r] >= 1, "drafter logits: row " + s(r) + " has no finite value");
    return;
  }
  if (out.is_logits) {
    KD_CHECK(static_cast<int64_t>(out.values.size()) == out.d * out.k, "drafter logits: size does not match [d, V]");
    for (int64_t r = 0; r < out.d; ++r) {
      bool any_finite = false;
      const int64_t bad = logits_row_check(out.values.data() + r * out.k, out.k, &any_finite);
      if (bad >= 0)
        throw Error(std::string(std::isnan(out.values[r * out.k + bad]) ? "drafter logits contain NaN"
                                                                         : "drafter logits contain +inf") +
                    " (row " + s(r) + ")");
      KD_CHECK(any_finite, "drafter logits: row " + s(r) + " has no finite value");
    }
    return;
  }
  KD_CHECK(static_cast<int64_t>(out.values.size()) == out.d * out.k && static_cast<int64_t>(out.ids.size()) == out.d * out.k,
           "drafter output: logprobs and token_ids must both have shape [d, k]");
  for (int64_t r = 0; r < out.d; ++r) {
    for (int64_t j = 0; j < out.k; ++j) {
      const float x = out.values[r * out.k + j];
      const int32_t id = out.ids[r * out.k + j];
      KD_CHECK(!std::isnan(x), "drafter logprobs contain NaN (row " + s(r) + ", column " + s(j) + ")");
      KD_CHECK(!(std::isinf(x) && x > 0), "drafter logprobs contain +inf (row " + s(r) + ", column " + s(j) + ")");
      KD_CHECK(id >= 0 && id < vocab, "drafter token id " + s(id) + " outside the vocab [0, " + s(vocab) + ") (row " +
                                          s(r) + ", column " + s(j) + ")");
      KD_CHECK(j == 0 || out.values[r * out.k + j - 1] >= x,
               "drafter logprobs row " + s(r) + " is not sorted in descending order (column " + s(j) + ")");
    }
  }
}

int64_t draft_tree_nodes(const DraftOutput& draft, int64_t k, int64_t budget) {
  int64_t nodes = 0, prod = 1;
  for (int64_t r = 0; r < draft.d && nodes < budget; ++r) {
    int64_t f = 0;
    const float* row = draft.device_values ? nullptr : draft.values.data() + r * draft.k;
    if (draft.device_values) {  // checked rows: a sorted log-prob row's finite entries lead it
      f = std::min(k, draft.row_finite[r]);
    } else if (draft.is_logits) {
      for (int64_t j = 0; j < draft.k && f < k; ++j) f += std::isfinite(row[j]) ? 1 : 0;
    } else {
      while (f < draft.k && std::isfinite(row[f])) ++f;
    }
    prod = std::min<int64_t>(prod * f, budget);
    if (prod == 0) break;
    nodes += prod;
  }
  return std::min(nodes, budget);
}

void RoundExecutor::check_device_draft(DraftOutput&, int64_t) {
  throw Error("a draft in device memory, but these rounds take host arrays only");
}

void RoundExecutor::device_draft_to_host(DraftOutput&, int64_t) {
  throw Error("a draft in device memory, but these rounds take host arrays only");
}

void Target::forward_last(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
                          int64_t rows, float* logits_out) {
  KD_CHECK(rows >= 0 && rows <= T, "forward_last: rows outside [0, T]");
  const int64_t V = vocab_size();
  std::vector<float> all(static_cast<size_t>(T * V));
  forward(tokens, positions, visibility, T, all.data());
  std::copy(all.end() - rows * V, all.end(), logits_out);
}

// ---------------------------------------------------------------- HostRounds
int32_t HostRounds::prefill(const int32_t* prompt, int64_t P, int64_t chunk, int64_t keep) {
  const int64_t V = target_.vocab_size();
  KD_CHECK(keep >= 0 && keep < P, "prefill: keep must be in [0, P)");
  if (keep > 0)
    target_.truncate(keep);
  else
    target_.reset();
  int32_t first = 0;
  for (int64_t c0 = keep; c0 < P; c0 += chunk) {
    const int64_t T = std::min(chunk, P - c0);
    pos_.resize(T);
    keep_.resize(T);
    vis_.assign(static_cast<size_t>(T * T), 0);
    for (int64_t i = 0; i < T; ++i) {
      pos_[i] = static_cast<int32_t>(c0 + i);
      keep_[i] = static_cast<int32_t>(i);
      for (int64_t j = 0; j <= i; ++j) vis_[i * T + j] = 1;
    }
    // only the prompt's last token's logits are used: earlier chunks ask for none
    const bool last = c0 + T == P;
    logits_.resize(static_cast<size_t>(V));
    target_.forward_last(prompt + c0, pos_.data(), vis_.data(), T, last ? 1 : 0, logits_.data());
    target_.commit(keep_.data(), T);
    if (last) first = sampler_.choose(logits_.data(), V, P);
  }
  return first;
}

void HostRounds::round(const RoundRequest& rq, RoundResult& out) {
  const int64_t V = target_.vocab_size(), L = rq.L;
  auto t0 = Clock::now();
  tree_.n = 0;
  tree_.tokens.clear();
  tree_.depths.clear();
  tree_.parents.assign(1, -1);
  const DraftOutput* draft = rq.draft;
  if (draft && draft->d > 0 && rq.nodes > 0) {
    KD_CHECK(draft->device_values == nullptr, "host rounds: a draft in device memory (the drafter ignored device_ok)");
    const float* lp = draft->values.data();
    const int32_t* ids = draft->ids.data();
    int64_t k = draft->k;
    if (draft->is_logits) {
      topk_lp_.resize(static_cast<size_t>(draft->d * rq.top_k));
      topk_ids_.resize(static_cast<size_t>(draft->d * rq.top_k));
      k = topk_logsoftmax(draft->values.data(), draft->d, V, rq.top_k, topk_lp_.data(), topk_ids_.data());
      lp = topk_lp_.data();
      ids = topk_ids_.data();
    }
    tree_build(lp, ids, draft->d, k, rq.nodes, &tree_, &ws_);
  }
  out.tree_build = since(t0);

  // verify: one forward over root + nodes, ancestor-only visibility
  t0 = Clock::now();
  const int64_t n = tree_.n, T = n + 1;
  tok_.resize(T);
  pos_.resize(T);
  tok_[0] = rq.root;
  for (int64_t i = 1; i < T; ++i) tok_[i] = tree_.tokens[i - 1];
  tree_positions(tree_.depths.data(), n, L, pos_.data());
  vis_.assign(static_cast<size_t>(T * T), 0);
  for (int64_t i = 0; i < T; ++i)  // walk up the parents: node i sees itself and its ancestors
    for (int64_t a = i; a >= 0; a = tree_.parents[a]) vis_[i * T + a] = 1;
  logits_.resize(static_cast<size_t>(T * V));
  target_.forward(tok_.data(), pos_.data(), vis_.data(), T, logits_.data());
  choice_.resize(T);
  for (int64_t i = 0; i < T; ++i) choice_[i] = sampler_.choose(logits_.data() + i * V, V, pos_[i] + 1);
  out.verify = since(t0);

  // accept + commit
  t0 = Clock::now();
  path_.resize(T);
  int64_t bonus = 0;
  const int64_t m = tree_accept(tree_.parents.data(), tree_.tokens.data(), n, choice_.data(), path_.data(), &bonus);
  target_.commit(path_.data(), m);
  out.tokens.clear();
  for (int64_t j = 1; j < m; ++j) out.tokens.push_back(tree_.tokens[path_[j] - 1]);
  out.tokens.push_back(static_cast<int32_t>(bonus));
  out.tree_nodes = n;
  out.accept_commit = since(t0);
}

// ---------------------------------------------------------------- Generator
Generator::Generator(Target& target) : Generator(std::make_unique<HostRounds>(target)) {}

Generator::Generator(std::unique_ptr<HostRounds> host) : host_(std::move(host)), exec_(*host_) { size_buffer(); }

Generator::Generator(RoundExecutor& executor) : exec_(executor) { size_buffer(); }

void Generator::size_buffer() {
  const int64_t cap = exec_.max_seq_len();
  KD_CHECK(cap >= 1, "target max_seq_len must be >= 1");
  buf_.assign(static_cast<size_t>(cap), 0);
}

GenerateResult Generator::generate(const int32_t* prompt, int64_t P, const GenerateParams& p, const DraftFn& drafter,
                                   const ProgressFn& progress) {
  const auto t_start = Clock::now();
  const int64_t V = exec_.vocab_size();
  const int64_t cap = exec_.max_seq_len();
  KD_CHECK(static_cast<int64_t>(buf_.size()) == cap, "target max_seq_len changed after the Generator was made");
  KD_CHECK(P >= 1, "the prompt must have at least one token");
  KD_CHECK(p.max_new_tokens >= 0, "max_new_tokens must be >= 0");
  KD_CHECK(p.tree_budget >= 0, "tree_budget must be >= 0");
  KD_CHECK(p.depth >= 1 && p.depth <= kTreeMaxDepth, "depth must be in [1, " + s(kTreeMaxDepth) + "], got " + s(p.depth));
  KD_CHECK(p.tree_budget <= kTreeMaxBudget, "tree_budget must be <= " + s(kTreeMaxBudget) + ", got " + s(p.tree_budget));
  KD_CHECK(p.top_k >= 0, "top_k must be >= 1 (or 0/None for min(tree_budget, vocab))");
  KD_CHECK(p.prefill_chunk >= 1, "prefill_chunk must be >= 1");
  KD_CHECK(P <= cap && p.max_new_tokens <= cap - P, "prompt (" + s(P) + " tokens) + max_new_tokens (" + s(p.max_new_tokens) +
                                            ") exceeds max_seq_len (" + s(cap) + ")");
  for (int64_t i = 0; i < P; ++i)
    KD_CHECK(prompt[i] >= 0 && prompt[i] < V,
             "prompt token " + s(prompt[i]) + " at index " + s(i) + " outside the vocab [0, " + s(V) + ")");
  for (int32_t t : p.stop_tokens)
    KD_CHECK(t >= 0 && t < V, "stop token " + s(t) + " outside the vocab [0, " + s(V) + ")");
  check_sampling_params(p.sampling);
  {
    // The executor checks its own limits on what the rounds will use: without a drafter every
    // round is an AR step, whatever tree_budget / depth / top_k say.
    GenerateParams used = p;
    if (!drafter) {
      used.tree_budget = 0;
      used.depth = 1;
      used.top_k = 0;
    }
    exec_.begin(used);
  }

  GenerateResult res;
  // Prefix reuse: the entries the last generate left are still valid when the cache epoch has not
  // moved since; they are buf_[0, min(cache_len, n_)) (a round cut short by a stop token committed
  // path nodes past the last emitted token: those are not in buf_).
  int64_t keep = 0;
  uint64_t epoch = 0;
  if (p.reuse_prefix && left_valid_ && exec_.cache_epoch(&epoch) && epoch == left_epoch_) {
    const int64_t lim = std::min({exec_.cache_len(), n_, P - 1});
    while (keep < lim && buf_[keep] == prompt[keep]) ++keep;
  }
  left_valid_ = false;  // (set again at the end of a call that completes)
  std::copy(prompt, prompt + P, buf_.begin());
  n_ = P;
  if (p.max_new_tokens == 0) {
    exec_.reset();
    left_valid_ = exec_.cache_epoch(&left_epoch_);
    res.seconds.total = since(t_start);
    return res;
  }
  auto is_stop = [&](int32_t t) {
    for (int32_t x : p.stop_tokens)
      if (x == t) return true;
    return false;
  };

  // ---- prefill (in chunks: causal inside a chunk, earlier chunks committed)
  {
    const auto t0 = Clock::now();
    const int32_t first = exec_.prefill(prompt, P, p.prefill_chunk, keep);
    res.prefill_reused = keep;
    buf_[n_++] = first;
    res.tokens.push_back(first);
    res.seconds.prefill = since(t0);
    res.stopped = is_stop(first);
    if (progress) progress(&buf_[n_ - 1], 1, 1, p.max_new_tokens);
  }

  // ---- rounds
  DraftOutput draft;
  RoundResult rr;
  if (p.adaptive_budget) adapt_.reset(p.tree_budget);
  const int64_t K = p.top_k > 0 ? p.top_k : std::min<int64_t>(std::max<int64_t>(p.tree_budget, 1), V);
  while (!res.stopped && static_cast<int64_t>(res.tokens.size()) < p.max_new_tokens) {
    const int64_t L = exec_.cache_len();
    KD_CHECK(L == n_ - 1, "the target's cache changed during generate (cache length " + s(L) + ", the engine expects " +
                              s(n_ - 1) + "): a drafter or progress callback must not run prefill / reset / truncate / "
                              "forward on the model being generated with");
    const int64_t remaining = p.max_new_tokens - static_cast<int64_t>(res.tokens.size());
    const int64_t depth_r = std::min(p.depth, remaining - 1);     // deeper nodes could never be emitted
    const int64_t budget_r = std::min(p.tree_budget, cap - L - 1);  // the window must fit in the cache
    const int64_t k_r = std::min(std::min(K, std::max<int64_t>(budget_r, 1)), V);

    RoundRequest rq;
    rq.root = buf_[n_ - 1];
    rq.L = L;
    rq.top_k = k_r;
    int64_t d_got = 0;
    double draft_s = -1;     // this round's drafting seconds (-1: no draft asked for), then with its
                             // checks, top-k / copy back and choice: what the adaptive policy counts
    if (drafter && depth_r > 0 && budget_r > 0 && !(p.adaptive_budget && adapt_.skip_draft())) {
      draft.clear();
      draft.device_ok = exec_.draft_device();
      draft.host_topk = p.adaptive_budget ? k_r : 0;  // the policy reads [d, k_r] log-probs on the host
      // with the adaptive budget, the rows the recent drafts were worth (each row at its measured cost)
      const int64_t depth_ask = p.adaptive_budget ? adapt_.draft_depth(depth_r) : depth_r;
      auto t0 = Clock::now();
      drafter(buf_.data(), n_, depth_ask, k_r, draft);
      draft_s = since(t0);
      res.seconds.draft += draft_s;
      t0 = Clock::now();
      if (draft.device_values && !draft.device_checked) {
        check_draft_shape(draft, depth_ask, k_r, V);
        if (draft.d > 0) exec_.check_device_draft(draft, V);
      }
      check_draft_output(draft, depth_ask, k_r, V);
      d_got = draft.d;
      if (draft.d > 0 && (draft.device_values || draft.device_topk)) ++res.device_drafts;
      if (draft.d > 0) {
        rq.draft = &draft;
        rq.nodes = draft_tree_nodes(draft, draft.is_logits ? k_r : draft.k, budget_r);
        if (p.adaptive_budget && rq.nodes > 0) {
          if (draft.device_values) {  // the policy reads the draft on the host: its [d, k] form copied back
            exec_.device_draft_to_host(draft, k_r);
          } else if (draft.is_logits) {  // top-k + log-softmax once, here; the executor gets the [d, k] form
            adapt_lp_.resize(static_cast<size_t>(draft.d * k_r));
            adapt_ids_.resize(static_cast<size_t>(draft.d * k_r));
            const int64_t kk = topk_logsoftmax(draft.values.data(), draft.d, V, k_r, adapt_lp_.data(), adapt_ids_.data());
            draft.values.assign(adapt_lp_.begin(), adapt_lp_.begin() + draft.d * kk);
            draft.ids.assign(adapt_ids_.begin(), adapt_ids_.begin() + draft.d * kk);
            draft.k = kk;
            draft.is_logits = false;
          }
          rq.nodes = adapt_.choose(draft.values.data(), draft.ids.data(), draft.d, draft.k, rq.nodes, n_ - 1);
          if (!adapt_.draft_logprobs().empty()) {  // the round builds the choice's tree: the calibrated rows
            draft.values.assign(adapt_.draft_logprobs().begin(), adapt_.draft_logprobs().end());
            draft.ids.assign(adapt_.draft_ids().begin(), adapt_.draft_ids().end());
          }
        }
      }
      const double prep_s = since(t0);
      res.seconds.tree_build += prep_s;
      draft_s += prep_s;
    }
    const auto t_round = Clock::now();
    exec_.round(rq, rr);
    if (p.adaptive_budget) adapt_.observe(rr.tree_nodes, since(t_round), draft_s, d_got);
    res.seconds.tree_build += rr.tree_build;
    res.seconds.verify += rr.verify;
    res.seconds.verify_forward_gpu += rr.verify_forward_gpu;

    // emit
    const auto t0 = Clock::now();
    const int64_t n0 = n_;
    for (int32_t tok : rr.tokens) {
      buf_[n_++] = tok;
      res.tokens.push_back(tok);
      if (is_stop(tok)) {
        res.stopped = true;
        break;
      }
      if (static_cast<int64_t>(res.tokens.size()) == p.max_new_tokens) break;
    }
    if (p.adaptive_budget) adapt_.label(buf_.data(), n_);
    res.acceptance_lengths.push_back(static_cast<int32_t>(n_ - n0));
    res.tree_sizes.push_back(static_cast<int32_t>(rr.tree_nodes));
    res.draft_depths.push_back(static_cast<int32_t>(d_got));
    res.seconds.accept_commit += rr.accept_commit + since(t0);
    if (progress) progress(&buf_[n0], n_ - n0, static_cast<int64_t>(res.tokens.size()), p.max_new_tokens);
  }
  left_valid_ = exec_.cache_epoch(&left_epoch_);
  res.seconds.total = since(t_start);
  return res;
}

}  // namespace kdtree
