// target.h: the model interface the engine loop (cpp/engine/engine.h) is written against.
// A Target owns a KV cache: cache_len() committed entries, then the "pending" window that the
// last forward() wrote (one entry per input token). commit(keep) keeps some pending entries,
// packed in order right after the committed ones, and drops the rest. Implementations: the
// toy target (toy_target.h, for tests) and the adapter to the CPU model (model_target.h).
//
// Legend: T = tokens in one forward (tree root + nodes, or a prompt chunk), V = vocab size.
#pragma once
#include <cstdint>

namespace kdtree {

class Target {
 public:
  virtual ~Target() = default;
  virtual int64_t vocab_size() const = 0;
  // Cache capacity: committed + pending entries never exceed this.
  virtual int64_t max_seq_len() const = 0;
  virtual int64_t cache_len() const = 0;
  // tokens     [T]    input tokens
  // positions  [T]    absolute positions (RoPE)
  // visibility [T,T]  row-major, 1 = query i sees window entry j (every query also sees all
  //                   committed entries); causal for a prompt, ancestor-only for a tree
  // logits_out [T,V]  next-token logits for every input token
  // Writes T pending entries at cache slots cache_len() .. cache_len()+T-1 (replacing any
  // pending entries of an earlier forward that were never committed).
  virtual void forward(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility,
                       int64_t T, float* logits_out) = 0;
  // The same forward with the logits of the last `rows` tokens only (logits_out [rows, V], rows in
  // [0, T]): a prefill chunk's (TargetModel::forward_last). The default runs forward() and copies them.
  virtual void forward_last(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
                            int64_t rows, float* logits_out);
  // keep [n]: strictly increasing indices into the last forward's window. After the call the
  // cache holds the committed entries followed by the kept ones; cache_len() grows by n.
  virtual void commit(const int32_t* keep, int64_t n) = 0;
  // Empties the cache.
  virtual void reset() = 0;
  // Keeps the first n committed entries (0 <= n <= cache_len()) and drops any pending ones.
  virtual void truncate(int64_t n) = 0;
  // A counter changed by every call that can change the cache (TargetModel::cache_epoch);
  // false: not tracked (then the engine never reuses a cache it left).
  virtual bool cache_epoch(uint64_t* out) const {
    (void)out;
    return false;
  }
};

}  // namespace kdtree
