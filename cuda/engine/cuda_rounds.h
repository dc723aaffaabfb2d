// cuda_rounds.h: the DDTree round on the GPU (issue 6), a RoundExecutor (cpp/engine/engine.h)
// over a CudaModel. The loop (drafter call, validation, emission, stop tokens, stats) is the
// shared Generator; this class does what happens between a validated draft and the accepted
// tokens, all queued on the model's stream with no host synchronisation until the end:
//
//   [upload: the draft (log-probs and ids [d,k] as one block, or logits [d,V]) from pinned
//    memory, one copy; the root token only when the device does not hold it already]
//   tree_build (or top-k + log-softmax + tree_build)   -> node tokens, parents, positions, bitmask
//   model forward_device over root + n nodes            -> logits [1+n, V] (stay on the device)
//   choose_tokens (argmax or the seeded sampler)        -> choice [1+n]
//   tree_accept_compact (walk + KV compaction, 1 launch) -> path, m, bonus; cache packed; the
//                                                          (m, n, bonus, path tokens) array for
//                                                          the host; the bonus as the next root
//   one device-to-host copy of that array, one stream synchronisation.
//
// The root of a round is the previous round's bonus (or prefill's first token), which the
// device already wrote to node 0: the host remembers that value and uploads the root only
// when the request's differs (never in a plain generate()).
//
// Prefill runs the causal forward on the device and copies back only the first token. The
// drafter runs between rounds and sees the context as numpy. A draft in this GPU's memory is
// never copied (DraftOutput::device_values): a native model drafter on the same GPU
// (cuda/engine/cuda_model_drafter.h) hands over its checked logits; a Python drafter's device
// arrays (DLPack / __cuda_array_interface__, e.g. torch CUDA tensors) are checked here on the
// device (check_device_draft: after the producer's stream, one kernel, [d, 2] counts copied
// back, one synchronisation; a log-prob draft's ids become int32 in d_ids_) and read in place.
//
// With the adaptive budget (docs/ENGINE.md) a device draft is brought to the host in its [d, k]
// log-prob form first (device_draft_to_host: the device top-k of a logits draft into d_draft_,
// one copy back, one synchronisation), because the round's size is chosen on the host from the
// draft's probabilities; the round then uploads that [d, k] block like a host draft's.
//
// Limits (checked by begin() when a drafter is given, ValueError): depth <= 16,
// tree_budget <= min(1024, max_tokens-1),
// top_k <= 1024 for logits drafts; the model's own limits for everything else.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/engine.h"
#include "model/cuda_model.h"

namespace kdtree {

class CudaRounds : public RoundExecutor {
 public:
  explicit CudaRounds(CudaModel& model);
  ~CudaRounds() override;
  CudaRounds(const CudaRounds&) = delete;
  CudaRounds& operator=(const CudaRounds&) = delete;

  int64_t vocab_size() const override { return model_.config().vocab_size; }
  int64_t max_seq_len() const override { return model_.max_seq_len(); }
  int64_t cache_len() const override { return model_.cache_len(); }
  void begin(const GenerateParams& p) override;
  int32_t prefill(const int32_t* prompt, int64_t P, int64_t chunk, int64_t keep) override;
  bool cache_epoch(uint64_t* out) const override { return model_.cache_epoch(out); }
  void reset() override { model_.reset(); }
  void round(const RoundRequest& rq, RoundResult& out) override;
  int draft_device() const override { return model_.device_ordinal(); }
  void check_device_draft(DraftOutput& draft, int64_t vocab) override;
  void device_draft_to_host(DraftOutput& draft, int64_t k) override;
  CudaModel& model() { return model_; }

 private:
  void check(int err, const char* what) const;  // cudaError_t -> RuntimeFailure
  void sync_result(int64_t words);              // result -> h_result_, synchronised

  CudaModel& model_;
  SamplingParams sampling_;
  int64_t V_ = 0, max_budget_ = 0, max_chunk_ = 0;
  void* dev_mem_ = nullptr;
  void* host_mem_ = nullptr;
  // device
  float* d_draft_ = nullptr;        // logits [d,V], or log-probs [d,k] then ids [d,k] (int32) right after
  void* d_topk_ws_ = nullptr;
  int32_t* d_tokens_ = nullptr;     // [1 + Bm] node 0 = root, then the tree's node tokens
  int32_t *d_depths_ = nullptr, *d_parents_ = nullptr, *d_positions_ = nullptr;  // [Bm], [Bm+1], [max(Bm+1, chunk)]
  uint64_t* d_vis_ = nullptr;       // [Bm+1, W]
  int32_t *d_n_ = nullptr, *d_choice_ = nullptr, *d_path_ = nullptr, *d_count_ = nullptr, *d_bonus_ = nullptr;
  int32_t* d_result_ = nullptr;     // [3 + Bm + 1]
  int32_t* d_prompt_ = nullptr;     // [chunk]
  int32_t* d_ids_ = nullptr;        // [16 * 1024] a device log-prob draft's ids as int32
  int32_t* d_dstats_ = nullptr;     // [16, 2] draft_check's per-row counts
  // pinned host
  float* h_draft_ = nullptr;        // the same layout as d_draft_
  int32_t* h_small_ = nullptr;      // root / prompt chunk + positions staging
  int32_t* h_result_ = nullptr;
  int32_t* h_dstats_ = nullptr;     // [16, 2]
  void* ev_fwd_[2] = {nullptr, nullptr};  // cudaEvent_t around the verify forward (its GPU time)
  void* ev_wait_ = nullptr;         // cudaEvent_t (no timing): the stream waits for a draft's producer
  int64_t dev_root_ = -1;           // the token in d_tokens_[0] written by the device (-1: unknown)
};

}  // namespace kdtree
