// model.h: the target-model interface every backend implements (CPU here; a CUDA model later),
// written once against by the engine loop (cpp/engine) and the bindings.
//
// One entry point runs any set of T new tokens against the latent KV cache:
//   prefill = causal visibility, then commit all T;  decode = T = 1;  verify = the tree mask.
// forward() writes the T new cache entries as *pending* slots [cache_len, cache_len + T) and
// returns logits [T, V]; commit(keep, n) keeps pending entries keep[0..n) (indices into the T
// pending tokens, strictly increasing), packs them right after the committed context and
// advances cache_len by n; the rest are dropped. A forward without a commit is simply
// overwritten by the next forward. truncate(n) rolls the committed cache back to its first n
// entries (a drafter's speculative chain, a rejected continuation) without recomputing them.
//
// Legend: T = new tokens, V = vocab, L = committed cache length.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace kdtree {

class TargetModel {
 public:
  virtual ~TargetModel() = default;

  virtual const ModelConfig& config() const = 0;
  virtual int64_t max_seq_len() const = 0;
  virtual const char* device() const = 0;  // "cpu" / "cuda"

  // --- weights: one tensor at a time by HF name, then finalize() once.
  // data: float32 row-major with exactly the shape model_weight_specs() gives for `name`.
  virtual void set_weight(const std::string& name, const float* data, const std::vector<int64_t>& shape) = 0;
  virtual std::vector<std::string> missing_weights() const = 0;
  // Checks completeness (Error listing the missing names) and precomputes derived tensors
  // (the absorbed per-head W_UK / W_UV from kv_b_proj). Also resets the cache.
  virtual void finalize() = 0;
  virtual bool finalized() const = 0;

  // --- forward
  // tokens [T] in [0, V); positions [T] >= 0 (RoPE positions); visibility [T, T] row-major
  // (nonzero = row token sees column token; nullptr = causal); the committed cache is always
  // visible. logits_out [T, V]. Throws Error when cache_len + T > max_seq_len.
  virtual void forward(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
                       float* logits_out) = 0;
  // The same forward (the same cache entries) with the logits of the last `rows` tokens only:
  // logits_out [rows, V], rows in [0, T] (0: no logits, e.g. a prefill chunk before the last). What a
  // prefill needs (its last token's). The CPU model then runs the LM head over those rows alone (a
  // prefill chunk of P tokens skips P - 1 rows of [V, hidden] products); the default runs forward()
  // and copies them. The logits are those of forward() up to the GEMM's summation order for that
  // row count (the same bits where the LM head takes the skinny kernels, <= 128 rows).
  virtual void forward_last(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
                            int64_t rows, float* logits_out);
  virtual void commit(const int32_t* keep, int64_t n) = 0;
  // Keep only the first n committed entries (0 <= n <= cache_len; Error otherwise) and drop any
  // pending window: cache_len = n, the next forward writes at slot n. O(1), nothing is moved.
  virtual void truncate(int64_t n) = 0;
  virtual void reset() = 0;
  virtual int64_t cache_len() const = 0;
  virtual int64_t pending_len() const = 0;  // T of the last forward not yet committed, else 0
  // A counter that changes with every call that can change the cache or the weights (forward,
  // commit, truncate, reset, set_weight, finalize, ...): a caller that recorded it can tell
  // whether the cache is still what it left (the engine's prefix reuse). false: not tracked.
  virtual bool cache_epoch(uint64_t* out) const {
    (void)out;
    return false;
  }
};

// Input checks shared by the backends (throw Error naming the problem).
void check_forward_args(const TargetModel& m, const int32_t* tokens, const int32_t* positions, int64_t T);

// Throws Error("finalize: N weight tensor(s) missing: a, b, ...") when `missing` is not empty.
void check_no_missing_weights(const std::vector<std::string>& missing);
void check_commit_args(const TargetModel& m, const int32_t* keep, int64_t n);
void check_truncate_args(const TargetModel& m, int64_t n);

// The names in `order` whose slot (a map name -> struct with a bool `set`) was never set, in that order:
// the backends' missing_weights().
template <class SlotMap>
std::vector<std::string> unset_slots(const std::vector<std::string>& order, const SlotMap& slots) {
  std::vector<std::string> m;
  for (const std::string& n : order)
    if (!slots.at(n).set) m.push_back(n);
  return m;
}

}  // namespace kdtree
