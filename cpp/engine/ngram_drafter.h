// ngram_drafter.h: the n-gram (prompt lookup) drafter in C++, so the engine calls it inside the
// round without Python (bindings: _native.NgramDraft; Python: kdtree_native.NgramDrafter). The
// definition, and its NumPy oracle, is kdtree_native.reference.ngram_draft: the earlier
// occurrences of the context's last ng tokens (ng = min_ngram .. max_ngram, each match of length
// ng + 1 also one of length ng), the max_matches most recent per length; what followed each
// occurrence at offsets 1..depth counts with weight ng; each depth's tokens ordered by (-weight,
// token id), log-prob = log(weight / the depth's total weight) in float64, rounded to float32.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/engine.h"

namespace kdtree {

struct NgramParams {
  int64_t max_ngram = 4;
  int64_t min_ngram = 1;
  int64_t max_matches = 32;
};

// Throws Error unless 1 <= min_ngram <= max_ngram and max_matches >= 1.
void check_ngram_params(const NgramParams& p);

class NgramDrafter {
 public:
  explicit NgramDrafter(const NgramParams& p);
  const NgramParams& params() const { return p_; }
  // context [n] (ending with the round's root) -> out: log-probs [d, k] (rows sorted descending,
  // -inf padding with id 0) and ids, d <= depth, k <= top_k; d = 0 when nothing matches.
  void draft(const int32_t* context, int64_t n, int64_t depth, int64_t top_k, DraftOutput& out);

 private:
  struct Entry {
    int64_t depth;
    int32_t token;
    int64_t weight;
  };
  NgramParams p_;
  std::vector<int64_t> ends_, starts_, weights_, first_;  // scratch, reused across rounds
  std::vector<Entry> entries_;
};

}  // namespace kdtree
