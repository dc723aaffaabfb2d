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
#include <memory>
#include <vector>

#include "engine/adaptive_budget.h"
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
  // A draft in device memory (CUDA), row-major and contiguous; values / ids stay empty:
  // device_values [d, k] log-probs (then device_ids [d, k], int32 or int64 by device_ids_bytes)
  // or logits [d, V] (is_logits, k = V). Two producers:
  //  - a native drafter on the executor's device (cuda/engine/cuda_model_drafter.h) that checked
  //    its rows itself (device_checked = true; it throws Error like check_draft_output) and fills
  //    row_finite [d] (each row's count of finite values);
  //  - a Python drafter's device arrays (DLPack or __cuda_array_interface__; bindings): the
  //    executor checks them on the device (RoundExecutor::check_device_draft: the same checks and
  //    messages as check_draft_output; fills row_finite, sets device_checked) after the producer's
  //    work: device_wait_kind 0 = synchronise the whole device (a producer that names no stream),
  //    1 = the stream device_wait_stream (cudaStream_t; 1 = legacy default, 2 = per-thread
  //    default; DLPack arrays are exported for the legacy default stream), 2 = nothing to wait
  //    for. device_owner keeps the arrays alive until clear().
  // The memory must stay valid and unchanged until the next clear() (the round has finished by then).
  const float* device_values = nullptr;
  const void* device_ids = nullptr;
  int device_ids_bytes = 4;
  bool device_checked = false;
  int device_wait_kind = 2;
  unsigned long long device_wait_stream = 0;
  std::shared_ptr<void> device_owner;
  std::vector<int64_t> row_finite;
  // Set by the loop before each call (clear() keeps it): the CUDA device ordinal whose memory
  // the round executor takes a draft in, -1 = host arrays only.
  int device_ok = -1;
  // Set by the loop before each call (clear() keeps it): > 0 when the loop reads the draft on the
  // host as [d, host_topk] log-probs (the adaptive budget). A producer whose logits are in device
  // memory may then return that form itself (cuda/engine/cuda_model_drafter.h: the device top-k,
  // copied back with its row statistics in the call's one synchronisation) and set device_topk;
  // any other form stays valid (the loop reduces it as before).
  int64_t host_topk = 0;
  bool device_topk = false;  // the [d, k] host draft was reduced from logits in device memory
  void clear() {
    d = k = 0;
    is_logits = false;
    values.clear();
    ids.clear();
    device_values = nullptr;
    device_ids = nullptr;
    device_ids_bytes = 4;
    device_checked = false;
    device_wait_kind = 2;
    device_wait_stream = 0;
    device_owner.reset();
    row_finite.clear();
    device_topk = false;
  }
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
  // Each round verifies the n <= tree_budget nodes that maximise the expected tokens per second
  // (adaptive_budget.h); false: min(tree_budget, finite prefixes) every round.
  bool adaptive_budget = false;
  // Keep the cache entries this Generator's previous generate left for the longest common prefix
  // of its tokens and this prompt, when the target's cache epoch shows nothing changed it since;
  // prefill only the rest (GenerateResult::prefill_reused).
  bool reuse_prefix = false;
};

struct StageSeconds {
  double prefill = 0, draft = 0, tree_build = 0, verify = 0, accept_commit = 0, total = 0;
  double verify_forward_gpu = 0;  // GPU executor: the verify forwards' GPU time (CUDA events); 0 on the host
};

struct GenerateResult {
  std::vector<int32_t> tokens;              // [N] generated tokens only
  std::vector<int32_t> acceptance_lengths;  // [rounds] tokens emitted per round (bonus included)
  std::vector<int32_t> tree_sizes;          // [rounds] n (nodes verified, root excluded)
  std::vector<int32_t> draft_depths;        // [rounds] d returned by the drafter (0 = none)
  StageSeconds seconds;
  bool stopped = false;                     // ended on a stop token
  int64_t prefill_reused = 0;               // prompt tokens whose cache entries were kept (reuse_prefix)
  int64_t device_drafts = 0;                // rounds whose draft the executor took in device memory, or whose
                                            // [d, k] form the drafter reduced there (DraftOutput::device_topk)
};

// The shape part of check_draft_output (d <= depth; k <= top_k, or k = vocab for logits).
void check_draft_shape(const DraftOutput& out, int64_t depth, int64_t top_k, int64_t vocab);
// Checks a drafter's output against the round's request (throws Error naming the problem).
// A device draft must have been checked on the device already (device_checked).
void check_draft_output(const DraftOutput& out, int64_t depth, int64_t top_k, int64_t vocab);

// ---- how a round is executed: the loop above (Generator) is written once; where the tree is
// built, verified and accepted is a RoundExecutor. HostRounds (below) runs it through a Target
// with host memory (CPU model, toy target, or any model through its host path); the GPU
// executor (cuda/engine/cuda_rounds.h) keeps the whole round on the device.

// One round, as decided by the loop (the draft is already validated).
struct RoundRequest {
  int32_t root = 0;                    // last emitted token; not yet in the cache
  int64_t L = 0;                       // committed cache length (root goes to slot L, position L)
  const DraftOutput* draft = nullptr;  // nullptr, or d == 0: a plain AR step
  int64_t top_k = 0;                   // k for a logits draft's top-k + log-softmax
  int64_t nodes = 0;                   // tree nodes to verify: min(budget, finite-score prefixes); 0 = AR step
};

struct RoundResult {
  std::vector<int32_t> tokens;  // accepted node tokens in path order, then the bonus token (size >= 1)
  int64_t tree_nodes = 0;       // n verified (root excluded)
  double tree_build = 0, verify = 0, accept_commit = 0;  // seconds, as the executor can see them
  double verify_forward_gpu = 0;  // seconds of GPU time of the target forward (0 when not measured)
};

class RoundExecutor {
 public:
  virtual ~RoundExecutor() = default;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t max_seq_len() const = 0;
  virtual int64_t cache_len() const = 0;
  // Checks the executor's own limits (throws Error) and takes the sampling parameters.
  virtual void begin(const GenerateParams& p) = 0;
  // Keeps the first `keep` committed cache entries (0: empties the cache; keep < P, and those
  // entries are prompt[0, keep)'s), then prefills prompt[keep, P) in chunks of `chunk`; returns
  // the first generated token (the choice after the last prompt token, sequence index P).
  virtual int32_t prefill(const int32_t* prompt, int64_t P, int64_t chunk, int64_t keep) = 0;
  // The target's cache epoch (TargetModel::cache_epoch); false: not tracked (no prefix reuse).
  virtual bool cache_epoch(uint64_t* out) const {
    (void)out;
    return false;
  }
  // Empties the cache only (max_new_tokens == 0).
  virtual void reset() = 0;
  // Builds the tree (rq.nodes nodes), verifies root + nodes in one forward, chooses per node,
  // walks, commits root + the accepted nodes; fills out.
  virtual void round(const RoundRequest& rq, RoundResult& out) = 0;
  // The CUDA device whose memory round() takes a draft in (DraftOutput::device_values);
  // -1 = none (host arrays only).
  virtual int draft_device() const { return -1; }
  // A device draft not checked by its producer (DraftOutput::device_checked false, shape already
  // checked): waits for the producer's work as the draft says, runs check_draft_output's value
  // checks on the device (throws Error with the same messages), fills row_finite and sets
  // device_checked. Executors with draft_device() == -1 never get one.
  virtual void check_device_draft(DraftOutput& draft, int64_t vocab);
  // A checked device draft brought to the host in its [d, k] log-prob form, for the adaptive
  // budget (which chooses the round's size from the draft's probabilities on the host): a logits
  // draft reduced to its top-k (k = min(k, V), the device top-k + log-softmax the round would
  // run), a log-prob draft copied as it is; one copy back and one synchronisation. The draft
  // becomes a host log-prob draft (values / ids filled, the device fields cleared), which the
  // round uploads again ([d, k]: a few KB). Executors with draft_device() == -1 never get one.
  virtual void device_draft_to_host(DraftOutput& draft, int64_t k);
};

// Rounds through a Target's host interface (target.h): tree built on the host, logits [T, V]
// in host memory, per-node choice by the host sampler.
class HostRounds : public RoundExecutor {
 public:
  explicit HostRounds(Target& target) : target_(target), sampler_(SamplingParams()) {}
  int64_t vocab_size() const override { return target_.vocab_size(); }
  int64_t max_seq_len() const override { return target_.max_seq_len(); }
  int64_t cache_len() const override { return target_.cache_len(); }
  void begin(const GenerateParams& p) override { sampler_ = Sampler(p.sampling); }
  int32_t prefill(const int32_t* prompt, int64_t P, int64_t chunk, int64_t keep) override;
  bool cache_epoch(uint64_t* out) const override { return target_.cache_epoch(out); }
  void reset() override { target_.reset(); }
  void round(const RoundRequest& rq, RoundResult& out) override;
  Target& target() { return target_; }

 private:
  Target& target_;
  Sampler sampler_;
  std::vector<float> logits_, topk_lp_;
  std::vector<int32_t> pos_, keep_, topk_ids_, tok_, path_;
  std::vector<uint8_t> vis_;
  std::vector<int64_t> choice_;
  Tree tree_;
  TreeBuildWorkspace ws_;
};

// Nodes a round can verify: min(budget, number of prefixes whose every entry is finite).
// Candidates with log-prob -inf are never verified: the best-first order pops every
// finite-score prefix before any -inf one, and there are sum_j prod_{d<=j} f_d finite prefixes
// (f_d = finite entries among row d's first k: a leading run since rows are sorted; for a
// logits draft, min(k, finite logits of the row)).
int64_t draft_tree_nodes(const DraftOutput& draft, int64_t k, int64_t budget);

class Generator {
 public:
  explicit Generator(Target& target);          // rounds on the host (HostRounds)
  explicit Generator(RoundExecutor& executor);  // e.g. the GPU executor
  // prompt [P]. drafter may be empty (plain AR). Resets the target's cache first.
  GenerateResult generate(const int32_t* prompt, int64_t P, const GenerateParams& params, const DraftFn& drafter,
                          const ProgressFn& progress);
  // The committed-token buffer (prompt + generated); capacity fixed at max_seq_len + 1 so the
  // pointer stays valid for the Generator's lifetime (drafters get zero-copy views of it).
  const int32_t* token_buffer() const { return buf_.data(); }
  int64_t num_tokens() const { return n_; }
  RoundExecutor& executor() { return exec_; }

 private:
  explicit Generator(std::unique_ptr<HostRounds> host);
  void size_buffer();
  std::unique_ptr<HostRounds> host_;
  RoundExecutor& exec_;
  AdaptiveBudget adapt_;
  std::vector<float> adapt_lp_;
  std::vector<int32_t> adapt_ids_;
  std::vector<int32_t> buf_;
  int64_t n_ = 0;
  bool left_valid_ = false;  // the cache holds entries for buf_[0, min(cache_len, n_)) as of left_epoch_
  uint64_t left_epoch_ = 0;
};

}  // namespace kdtree
