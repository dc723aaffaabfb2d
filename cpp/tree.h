// tree.h: DDTree tree algorithms on the host: the native CPU twin of
// python/kdtree_native/reference/tree.py (the oracle) and of the CUDA tree kernels.
// Semantics: docs/tree_contract.md. Every function here gives exactly the reference's
// integers (tree build, visibility, accept walk, compaction maps); top-k + log-softmax gives
// the same ids and log-probs within an ulp of the reference's float64 log-sum-exp.
//
// Legend: D = draft depth, K = top-k per depth, V = vocabulary, B = node budget,
// n = tree nodes besides the root (n <= B), W = ceil((n+1)/64) bitmask words per row,
// m = accepted path length (root included). Node 0 is the root; node i >= 1 is the i-th pop.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kdtree {

constexpr int64_t kTreeMaxDepth = 64;      // D limit (reference: MAX_TREE_DEPTH)
constexpr int64_t kTreeMaxBudget = 16384;  // B limit (reference: MAX_TREE_BUDGET)

// Words per visibility row for a tree of n nodes besides the root.
inline int64_t tree_visibility_words(int64_t n) { return (n + 1 + 63) / 64; }

// A built tree. Visibility is a bitmask: node i sees node j iff bit (j % 64) of
// visibility[i * vis_words + j / 64] is set (ancestors and itself only).
struct Tree {
  int64_t n = 0;                      // nodes besides the root
  std::vector<int32_t> tokens;        // [n]       token of node i+1
  std::vector<int32_t> depths;        // [n]       depth of node i+1 (1..D)
  std::vector<int32_t> parents;       // [n+1]     parents[0] = -1, 0 <= parents[i] < i
  int64_t vis_words = 0;              // W
  std::vector<uint64_t> visibility;   // [(n+1) * W]

  bool sees(int64_t i, int64_t j) const {
    return (visibility[i * vis_words + j / 64] >> (j % 64)) & 1u;
  }
};

// One heap candidate of the best-first search (a prefix not yet in the tree). Its depth is
// its parent's depth + 1.
struct TreeCandidate {
  double score;    // float64 sum of log-probs along the prefix (official operation order);
                   // NaN is stored as -inf (same order, and every score derived from either
                   // is NaN or -inf again, so the search pops the same sequence)
  int32_t parent;  // tree node the candidate hangs below
  int32_t rank;    // 0..K-1, index into row depth-1 of the [D,K] inputs
};

// Scratch memory of tree_build, reusable across calls so a round allocates nothing.
struct TreeBuildWorkspace {
  std::vector<TreeCandidate> heap;  // [<= B+1] 4-ary heap, best candidate first
  std::vector<int32_t> rank_paths;  // [(B+1) * D] rank tuple of every tree node (row = node)
  std::vector<int32_t> node_depths; // [B+1] depth of every tree node (root: 0)
};

// The first problem with tree_build's inputs as a message ("" when they are fine):
// D in [0, kTreeMaxDepth], K >= 1, budget in [0, kTreeMaxBudget], no NaN or +inf log-prob
// (-inf is allowed), rows sorted descending, token ids >= 0.
std::string tree_build_input_error(const float* logprobs,    // [D, K]
                                   const int32_t* token_ids,  // [D, K]
                                   int64_t D, int64_t K, int64_t budget);

// Best-first DDTree build (docs/tree_contract.md): pops the top-`budget` prefixes by
// (score desc, rank tuple asc). Inputs must pass tree_build_input_error (not re-checked).
void tree_build(const float* logprobs,    // [D, K] rows sorted descending
                const int32_t* token_ids,  // [D, K]
                int64_t D, int64_t K, int64_t budget,
                Tree* out, TreeBuildWorkspace* ws);
// Convenience form: validates (throws kdtree::Error) and allocates its own workspace.
Tree tree_build(const float* logprobs, const int32_t* token_ids, int64_t D, int64_t K, int64_t budget);

// Ancestor-only visibility bitmask from parents: out [(n+1) * tree_visibility_words(n)].
void tree_visibility(const int32_t* parents,  // [n+1]
                     int64_t n, uint64_t* out);

// Verify-window positions: out[i] = cache_len + depth of node i (root: cache_len).
void tree_positions(const int32_t* depths,  // [n]
                    int64_t n, int64_t cache_len,
                    int32_t* out);           // [n+1]

// The first structural problem of a tree given as parents/tokens ("" when fine):
// parents[0] = -1 and 0 <= parents[i] < i.
std::string tree_structure_error(const int32_t* parents,  // [n+1]
                                 int64_t n);

// Accept walk: from the root, move to the child whose token equals choice[current] while one
// exists; among children with equal tokens the highest node index wins (official dict rule).
// Writes the path (node indices from 0) and returns its length m; *bonus = choice[path[m-1]].
int64_t tree_accept(const int32_t* parents,  // [n+1] (must pass tree_structure_error)
                    const int32_t* tokens,   // [n]
                    int64_t n,
                    const int64_t* choice,   // [n+1] target's token at every node
                    int32_t* path,           // [<= n+1] out
                    int64_t* bonus);

// KV compaction maps: after an accept, slot dst[j] = cache_len + j takes the entry of slot
// src[j] = cache_len + path[j]. path is strictly increasing with path[0] = 0 (so src >= dst and
// copying in order j = 0, 1, ... is safe in place).
void compact_index_map(const int32_t* path,  // [m]
                       int64_t m, int64_t cache_len,
                       int32_t* src,          // [m]
                       int32_t* dst);         // [m]
// Applies the map to a cache of rows of row_bytes each (rows cache_len + path[j] move to
// cache_len + j); returns the new cache length cache_len + m.
int64_t kv_compact(void* cache, int64_t row_bytes, int64_t cache_len,
                   const int32_t* path, int64_t m);

// One logits row [V]: the index of its first NaN or +inf (-1 when none) and, in *any_finite,
// whether it holds a finite value (eight values at a time where the CPU has AVX2).
int64_t logits_row_check(const float* row, int64_t V, bool* any_finite);

// sum_v exp(row[v] - m) in float64 (AVX2 where the CPU has it): topk_logsoftmax's log-sum-exp,
// and the model drafter's log p(top-1).
double row_sumexp(const float* row, int64_t V, float m);

// The first problem with topk_logsoftmax's inputs ("" when fine): D in [0, kTreeMaxDepth],
// V >= 1, k >= 1, no NaN or +inf, no all -inf row.
std::string topk_logsoftmax_input_error(const float* logits,  // [D, V]
                                        int64_t D, int64_t V, int64_t k);

// Top-k of each logits row as log-probs: k' = min(k, V) entries per row, sorted descending,
// equal logits by increasing id; logprob = logit - float32(logsumexp(row)) in float32, the
// log-sum-exp evaluated in float64. Returns k'. Inputs must pass the check above.
int64_t topk_logsoftmax(const float* logits,  // [D, V]
                        int64_t D, int64_t V, int64_t k,
                        float* logprobs,       // [D, k'] out
                        int32_t* ids);         // [D, k'] out

}  // namespace kdtree
