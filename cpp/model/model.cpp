// model.cpp: argument checks shared by every TargetModel backend.
#include "model/model.h"

#include <algorithm>
#include <vector>

#include "common.h"

namespace kdtree {

void check_forward_args(const TargetModel& m, const int32_t* tokens, const int32_t* positions, int64_t T) {
  if (!m.finalized()) throw Error("model: forward() before finalize() (weights not complete)");
  if (T <= 0) throw Error("forward: need at least one token, got T = " + std::to_string(T));
  if (m.cache_len() + T > m.max_seq_len())
    throw Error("forward: cache_len (" + std::to_string(m.cache_len()) + ") + T (" + std::to_string(T) +
                ") exceeds max_seq_len (" + std::to_string(m.max_seq_len()) + ")");
  const int64_t V = m.config().vocab_size;
  for (int64_t t = 0; t < T; ++t) {
    if (tokens[t] < 0 || tokens[t] >= V)
      throw Error("forward: token id " + std::to_string(tokens[t]) + " at index " + std::to_string(t) +
                  " is outside [0, vocab_size=" + std::to_string(V) + ")");
    if (positions[t] < 0)
      throw Error("forward: position " + std::to_string(positions[t]) + " at index " + std::to_string(t) +
                  " is negative");
  }
}

void TargetModel::forward_last(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
                               int64_t rows, float* logits_out) {
  if (rows < 0 || rows > T)
    throw Error("forward_last: rows " + std::to_string(rows) + " outside [0, T = " + std::to_string(T) + "]");
  const int64_t V = config().vocab_size;
  std::vector<float> all(static_cast<size_t>(std::max<int64_t>(T, 0) * V));
  forward(tokens, positions, visibility, T, all.data());
  std::copy(all.end() - rows * V, all.end(), logits_out);
}

void check_commit_args(const TargetModel& m, const int32_t* keep, int64_t n) {
  const int64_t P = m.pending_len();
  if (n < 0) throw Error("commit: negative count");
  if (n > P)
    throw Error("commit: keeping " + std::to_string(n) + " entries but only " + std::to_string(P) +
                " are pending (run forward() first)");
  for (int64_t j = 0; j < n; ++j) {
    if (keep[j] < 0 || keep[j] >= P)
      throw Error("commit: keep[" + std::to_string(j) + "] = " + std::to_string(keep[j]) + " is outside [0, " +
                  std::to_string(P) + ")");
    if (j > 0 && keep[j] <= keep[j - 1]) throw Error("commit: keep indices must be strictly increasing");
  }
}

void check_truncate_args(const TargetModel& m, int64_t n) {
  if (n < 0 || n > m.cache_len())
    throw Error("truncate: length " + std::to_string(n) + " outside [0, cache_len = " + std::to_string(m.cache_len()) +
                "]");
}

void check_no_missing_weights(const std::vector<std::string>& missing) {
  if (missing.empty()) return;
  std::string msg = "finalize: " + std::to_string(missing.size()) + " weight tensor(s) missing: ";
  for (size_t i = 0; i < missing.size() && i < 12; ++i) msg += (i ? ", " : "") + missing[i];
  if (missing.size() > 12) msg += ", ...";
  throw Error(msg);
}

}  // namespace kdtree
