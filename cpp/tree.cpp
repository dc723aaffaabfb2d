// tree.cpp: DDTree tree algorithms on the host (see tree.h; oracle: reference/tree.py).
#include "tree.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "common.h"
#include "cpu_features.h"

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#define KD_TREE_AVX2 1
#endif

namespace kdtree {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// A candidate's score as stored: NaN (from -inf - -inf) becomes -inf, which it orders like.
inline double stored_score(double score) { return std::isnan(score) ? kNegInf : score; }

// Best-first order of candidates: higher score first, then the lexicographically smaller rank
// tuple (Python tuple order). A candidate's rank tuple is its parent's rank path (depth-1
// entries, one row of `rank_paths` of width D) followed by its own rank; tuples are unique,
// so this is a strict total order and any correct heap pops the same sequence.
struct CandidateOrder {
  const int32_t* rank_paths;  // [(B+1) * D] row i = rank tuple of tree node i
  const int32_t* depths;      // [B+1] depth of tree node i (root: 0)
  int64_t D;

  bool ranks_less(const TreeCandidate& a, const TreeCandidate& b) const {
    if (a.parent == b.parent) return a.rank < b.rank;  // siblings: same depth
    const int32_t* pa = rank_paths + a.parent * D;
    const int32_t* pb = rank_paths + b.parent * D;
    const int32_t la = depths[a.parent] + 1, lb = depths[b.parent] + 1;  // tuple lengths
    const int32_t common = std::min(la, lb);
    for (int32_t j = 0; j < common; ++j) {
      const int32_t ra = j < la - 1 ? pa[j] : a.rank;
      const int32_t rb = j < lb - 1 ? pb[j] : b.rank;
      if (ra != rb) return ra < rb;
    }
    return la < lb;  // a proper prefix first (never two such in the heap)
  }
  // true when a is popped before b
  bool before(const TreeCandidate& a, const TreeCandidate& b) const {
    if (a.score != b.score) return a.score > b.score;
    return ranks_less(a, b);
  }
};

// The candidates live in a 4-ary heap (children of slot i: 4i+1 .. 4i+4): half the levels
// of a binary heap, and the four children's scores load in parallel.
constexpr size_t kArity = 4;

// The index (a or b) of the candidate popped first; branch-free unless the scores tie.
inline size_t first_of(const std::vector<TreeCandidate>& h, size_t a, size_t b, const CandidateOrder& ord) {
  bool take_b = h[b].score > h[a].score;
  if (__builtin_expect(h[b].score == h[a].score, 0)) take_b = ord.ranks_less(h[b], h[a]);
  return take_b ? b : a;
}

void heap_push(std::vector<TreeCandidate>& h, const TreeCandidate& c, const CandidateOrder& ord) {
  size_t i = h.size();
  h.push_back(c);
  while (i > 0) {
    const size_t up = (i - 1) / kArity;
    if (!ord.before(c, h[up])) break;
    h[i] = h[up];
    i = up;
  }
  h[i] = c;
}

// Replaces the best candidate (the root) by `c` and restores the heap. In the search `c` is
// usually the popped node's first child, which is often among the best, so the sift stops early.
void heap_replace_top(std::vector<TreeCandidate>& h, const TreeCandidate& c, const CandidateOrder& ord) {
  const size_t size = h.size();
  size_t i = 0;
  for (;;) {
    const size_t first = kArity * i + 1;
    if (first >= size) break;
    size_t best = first;
    if (first + kArity <= size) {  // all four children: a small tournament
      best = first_of(h, first_of(h, first, first + 1, ord), first_of(h, first + 2, first + 3, ord), ord);
    } else {
      for (size_t j = first + 1; j < size; ++j) best = first_of(h, best, j, ord);
    }
    if (!ord.before(h[best], c)) break;
    h[i] = h[best];
    i = best;
  }
  h[i] = c;
}

// Removes the best candidate.
void heap_pop(std::vector<TreeCandidate>& h, const CandidateOrder& ord) {
  const TreeCandidate last = h.back();
  h.pop_back();
  if (!h.empty()) heap_replace_top(h, last, ord);
}

}  // namespace

std::string tree_build_input_error(const float* logprobs, const int32_t* token_ids, int64_t D,
                                   int64_t K, int64_t budget) {
  if (D < 0 || D > kTreeMaxDepth)
    return "depth D=" + std::to_string(D) + " must be in [0, " + std::to_string(kTreeMaxDepth) + "]";
  if (K < 1) return "top-k K must be >= 1, got " + std::to_string(K);
  if (budget < 0) return "budget must be >= 0, got " + std::to_string(budget);
  if (budget > kTreeMaxBudget)
    return "budget must be <= " + std::to_string(kTreeMaxBudget) + ", got " + std::to_string(budget);
  for (int64_t d = 0; d < D; ++d) {
    const float* row = logprobs + d * K;
    for (int64_t r = 0; r < K; ++r) {
      const bool nan = std::isnan(row[r]), pos_inf = row[r] == std::numeric_limits<float>::infinity();
      const bool unsorted = r > 0 && row[r] > row[r - 1], bad_id = token_ids[d * K + r] < 0;
      if (!(nan || pos_inf || unsorted || bad_id)) continue;
      const std::string at = " (depth row " + std::to_string(d) + ", rank " + std::to_string(r) + ")";
      if (nan) return "logprobs contain NaN" + at;
      if (pos_inf) return "logprobs contain +inf" + at;
      if (unsorted)
        return "logprobs rows must be sorted descending: row " + std::to_string(d) + " has lp[" +
               std::to_string(r - 1) + "] < lp[" + std::to_string(r) + "]";
      return "token_ids must be >= 0, got " + std::to_string(token_ids[d * K + r]) + at;
    }
  }
  return "";
}

void tree_build(const float* logprobs, const int32_t* token_ids, int64_t D, int64_t K,
                int64_t budget, Tree* out, TreeBuildWorkspace* ws) {
  const int64_t width = std::max<int64_t>(D, 1);
  ws->heap.clear();
  ws->heap.reserve(budget + 1);  // each pop pushes at most 2: size <= n + 1
  ws->rank_paths.resize((budget + 1) * width);
  ws->node_depths.resize(budget + 1);
  ws->node_depths[0] = 0;
  out->tokens.resize(budget);
  out->parents.resize(budget + 1);
  out->parents[0] = -1;
  int32_t* depths = ws->node_depths.data();  // [B+1] node depths, root included
  const CandidateOrder ord{ws->rank_paths.data(), depths, width};

  int64_t n = 0;
  if (budget > 0 && D > 0) heap_push(ws->heap, TreeCandidate{stored_score(logprobs[0]), 0, 0}, ord);
  while (!ws->heap.empty() && n < budget) {
    const TreeCandidate c = ws->heap[0];  // the best candidate becomes node n+1
    const int32_t node = static_cast<int32_t>(n + 1);  // node index = pop order
    const int32_t depth = depths[c.parent] + 1;
    const float* row = logprobs + (depth - 1) * K;
    out->tokens[n] = token_ids[(depth - 1) * K + c.rank];
    out->parents[node] = c.parent;
    depths[node] = depth;
    int32_t* path = ws->rank_paths.data() + node * width;  // rank tuple of the new node
    const int32_t* parent_path = ws->rank_paths.data() + c.parent * width;
    for (int32_t j = 0; j < depth - 1; ++j) path[j] = parent_path[j];
    path[depth - 1] = c.rank;
    ++n;

    // Pop it and push its first child and next sibling; the first of those replaces the root
    // (one sift instead of a pop plus a push).
    bool popped = false;
    if (depth < D) {  // first child: s + lp[d+1][0]
      const double s = c.score + static_cast<double>(logprobs[depth * K]);
      heap_replace_top(ws->heap, TreeCandidate{stored_score(s), node, 0}, ord);
      popped = true;
    }
    if (c.rank + 1 < K) {  // next sibling: s - lp[d][r] + lp[d][r+1], in this order
      const double s = c.score - static_cast<double>(row[c.rank]) + static_cast<double>(row[c.rank + 1]);
      const TreeCandidate sibling{stored_score(s), c.parent, c.rank + 1};
      if (popped) {
        heap_push(ws->heap, sibling, ord);
      } else {
        heap_replace_top(ws->heap, sibling, ord);
        popped = true;
      }
    }
    if (!popped) heap_pop(ws->heap, ord);
  }

  out->n = n;
  out->tokens.resize(n);
  out->parents.resize(n + 1);
  out->depths.assign(depths + 1, depths + 1 + n);
  out->vis_words = tree_visibility_words(n);
  out->visibility.resize((n + 1) * out->vis_words);
  tree_visibility(out->parents.data(), n, out->visibility.data());
}

Tree tree_build(const float* logprobs, const int32_t* token_ids, int64_t D, int64_t K, int64_t budget) {
  const std::string err = tree_build_input_error(logprobs, token_ids, D, K, budget);
  if (!err.empty()) throw Error("tree_build: " + err);
  Tree tree;
  TreeBuildWorkspace ws;
  tree_build(logprobs, token_ids, D, K, budget, &tree, &ws);
  return tree;
}

void tree_visibility(const int32_t* parents, int64_t n, uint64_t* out) {
  const int64_t W = tree_visibility_words(n);
  std::memset(out, 0, sizeof(uint64_t) * W);
  out[0] = 1;  // the root sees itself
  for (int64_t i = 1; i <= n; ++i) {
    uint64_t* row = out + i * W;
    std::memcpy(row, out + parents[i] * W, sizeof(uint64_t) * W);  // the parent's ancestors
    row[i / 64] |= uint64_t{1} << (i % 64);                         // and itself
  }
}

void tree_positions(const int32_t* depths, int64_t n, int64_t cache_len, int32_t* out) {
  out[0] = static_cast<int32_t>(cache_len);
  for (int64_t i = 0; i < n; ++i) out[i + 1] = static_cast<int32_t>(cache_len + depths[i]);
}

std::string tree_structure_error(const int32_t* parents, int64_t n) {
  if (n < 0) return "n must be >= 0";
  if (parents[0] != -1) return "parents[0] must be -1 (the root), got " + std::to_string(parents[0]);
  for (int64_t i = 1; i <= n; ++i)
    if (parents[i] < 0 || parents[i] >= i)
      return "parents[" + std::to_string(i) + "] = " + std::to_string(parents[i]) + " must be in [0, " +
             std::to_string(i) + ")";
  return "";
}

int64_t tree_accept(const int32_t* parents, const int32_t* tokens, int64_t n, const int64_t* choice,
                    int32_t* path, int64_t* bonus) {
  // Children lists, newest first: head[p] = highest-index child of p, next[c] = the next lower
  // sibling of c (-1 ends a list). The first match in a list is the highest node index.
  std::vector<int32_t> head(n + 1, -1), next(n + 1, -1);
  for (int64_t c = 1; c <= n; ++c) {
    next[c] = head[parents[c]];
    head[parents[c]] = static_cast<int32_t>(c);
  }
  int64_t m = 0;
  int32_t node = 0;
  path[m++] = 0;
  for (;;) {
    int32_t found = -1;
    for (int32_t c = head[node]; c >= 0; c = next[c]) {
      if (tokens[c - 1] == choice[node]) {
        found = c;
        break;
      }
    }
    if (found < 0) break;
    path[m++] = found;
    node = found;
  }
  *bonus = choice[node];
  return m;
}

void compact_index_map(const int32_t* path, int64_t m, int64_t cache_len, int32_t* src, int32_t* dst) {
  for (int64_t j = 0; j < m; ++j) {
    src[j] = static_cast<int32_t>(cache_len + path[j]);
    dst[j] = static_cast<int32_t>(cache_len + j);
  }
}

int64_t kv_compact(void* cache, int64_t row_bytes, int64_t cache_len, const int32_t* path, int64_t m) {
  char* base = static_cast<char*>(cache);
  for (int64_t j = 0; j < m; ++j) {
    const int64_t from = cache_len + path[j], to = cache_len + j;
    if (from != to) std::memmove(base + to * row_bytes, base + from * row_bytes, row_bytes);
  }
  return cache_len + m;
}

std::string topk_logsoftmax_input_error(const float* logits, int64_t D, int64_t V, int64_t k) {
  if (D < 0 || D > kTreeMaxDepth)
    return "depth D=" + std::to_string(D) + " must be in [0, " + std::to_string(kTreeMaxDepth) + "]";
  if (V < 1) return "logits must have a vocabulary of at least 1, got V=" + std::to_string(V);
  if (k < 1) return "k must be >= 1, got " + std::to_string(k);
  for (int64_t d = 0; d < D; ++d) {
    const float* row = logits + d * V;
    bool any_finite = false;
    const int64_t bad = logits_row_check(row, V, &any_finite);
    if (bad >= 0)
      return std::string(std::isnan(row[bad]) ? "logits contain NaN" : "logits contain +inf") + " (first at row " +
             std::to_string(d) + ")";
    if (!any_finite) return "logits row " + std::to_string(d) + " is all -inf";
  }
  return "";
}

namespace {
// Top kk of a row under "larger logit first, equal logits by lower id" (a strict total order; the
// row holds no NaN), written to out_ids in that order. Small kk (drafter trees): one pass keeping
// a sorted list; an element enters only if it beats the current kk-th, and an equal logit never
// does (it has the higher id), so ties keep the lower ids first. Large kk: nth_element + sort.
constexpr int64_t kStreamTopK = 64;

int64_t next_above_tail(const float* row, int64_t v, int64_t V, float thr) {
  while (v < V && !(row[v] > thr)) ++v;
  return v;
}

#ifdef KD_TREE_AVX2
__attribute__((target("avx2,fma"))) int64_t next_above_avx2(const float* row, int64_t v, int64_t V, float thr) {
  const __m256 t = _mm256_set1_ps(thr);
  for (; v + 8 <= V; v += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + v), t, _CMP_GT_OQ));
    if (mask) return v + __builtin_ctz(static_cast<unsigned>(mask));
  }
  return next_above_tail(row, v, V, thr);
}
#endif

// The first index in [v, V) whose value is > thr, or V (eight at a time where the CPU has AVX2).
int64_t next_above(const float* row, int64_t v, int64_t V, float thr) {
#ifdef KD_TREE_AVX2
  if (cpu_has_avx2_fma()) return next_above_avx2(row, v, V, thr);
#endif
  return next_above_tail(row, v, V, thr);
}

void row_topk(const float* row, int64_t V, int64_t kk, std::vector<int32_t>& order, int32_t* out_ids) {
  if (kk <= kStreamTopK) {
    float tv[kStreamTopK];
    int32_t ti[kStreamTopK];
    int64_t c = 0;
    for (int64_t v = 0; v < V; ++v) {
      if (c == kk && (v = next_above(row, v, V, tv[kk - 1])) == V) break;  // skip what cannot enter
      const float x = row[v];
      int64_t j = c < kk ? c++ : kk - 1;
      while (j > 0 && x > tv[j - 1]) {
        tv[j] = tv[j - 1];
        ti[j] = ti[j - 1];
        --j;
      }
      tv[j] = x;
      ti[j] = static_cast<int32_t>(v);
    }
    std::copy(ti, ti + kk, out_ids);
    return;
  }
  auto first = [row](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); };
  order.resize(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  if (kk < V) std::nth_element(order.begin(), order.begin() + kk, order.end(), first);
  std::sort(order.begin(), order.begin() + kk, first);
  std::copy(order.begin(), order.begin() + kk, out_ids);
}

// sum over the row of exp(row[v] - m) in float64 (m = the row's max, so every term is <= 1 and
// the sum >= 1). AVX2 + FMA (picked at run time): four doubles at a time with the Cephes exp
// scheme in float64 (x = n ln2 + r, |r| <= ln2 / 2, e^r = 1 + 2 r P(r^2) / (Q(r^2) - r P(r^2)),
// 2^n from the exponent bits), within ~1 ulp of std::exp; terms below e^-708 (and -inf) are 0,
// where std::exp gives a subnormal: beside the row max's term 1 neither changes the sum. The
// sum is taken in a different order than the scalar loop (eight lanes, added at the end), so the
// log-sum-exp can differ from it by an ulp of a double, far below the float32 it is rounded to.
#ifdef KD_TREE_AVX2
__attribute__((target("avx2,fma"), always_inline)) inline __m256d exp4d(__m256d x) {
  const __m256d under = _mm256_cmp_pd(x, _mm256_set1_pd(-708.0), _CMP_LT_OQ);
  x = _mm256_max_pd(x, _mm256_set1_pd(-708.0));
  const __m256d n = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.4426950408889634074)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(6.93145751953125e-1), x);
  r = _mm256_fnmadd_pd(n, _mm256_set1_pd(1.42860682030941723212e-6), r);
  const __m256d r2 = _mm256_mul_pd(r, r);
  __m256d p = _mm256_fmadd_pd(_mm256_set1_pd(1.26177193074810590878e-4), r2, _mm256_set1_pd(3.02994407707441961300e-2));
  p = _mm256_fmadd_pd(p, r2, _mm256_set1_pd(9.99999999999999999910e-1));
  p = _mm256_mul_pd(p, r);
  __m256d q = _mm256_fmadd_pd(_mm256_set1_pd(3.00198505138664455042e-6), r2, _mm256_set1_pd(2.52448340349684104192e-3));
  q = _mm256_fmadd_pd(q, r2, _mm256_set1_pd(2.27265548208155028766e-1));
  q = _mm256_fmadd_pd(q, r2, _mm256_set1_pd(2.00000000000000000009e0));
  __m256d y = _mm256_div_pd(p, _mm256_sub_pd(q, p));
  y = _mm256_fmadd_pd(y, _mm256_set1_pd(2.0), _mm256_set1_pd(1.0));
  // 2^n for n in [-1022, 0]: (n + 1023) << 52 as the bits of a double
  const __m128i ni = _mm256_cvtpd_epi32(n);
  const __m256i e = _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(ni), _mm256_set1_epi64x(1023)), 52);
  y = _mm256_mul_pd(y, _mm256_castsi256_pd(e));
  return _mm256_andnot_pd(under, y);
}

__attribute__((target("avx2,fma"))) double row_sumexp_avx2(const float* row, int64_t V, float m) {
  const __m256d vm = _mm256_set1_pd(static_cast<double>(m));
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 x = _mm256_loadu_ps(row + v);
    a0 = _mm256_add_pd(a0, exp4d(_mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), vm)));
    a1 = _mm256_add_pd(a1, exp4d(_mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), vm)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(a0, a1));
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - static_cast<double>(m));
  return sum;
}
#endif

// logits_row_check's scalar loop from index v on, `any`: a finite value seen before v
int64_t logits_row_check_tail(const float* row, int64_t v, int64_t V, bool any, bool* any_finite) {
  for (; v < V; ++v) {
    if (std::isnan(row[v]) || row[v] == std::numeric_limits<float>::infinity()) {
      *any_finite = any;
      return v;
    }
    any = any || row[v] != -std::numeric_limits<float>::infinity();
  }
  *any_finite = any;
  return -1;
}

#ifdef KD_TREE_AVX2
__attribute__((target("avx2,fma"))) int64_t logits_row_check_avx2(const float* row, int64_t V, bool* any_finite) {
  const float inf = std::numeric_limits<float>::infinity();
  const __m256 pinf = _mm256_set1_ps(inf), ninf = _mm256_set1_ps(-inf);
  int fin = 0;
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 x = _mm256_loadu_ps(row + v);
    const int bad =
        _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q), _mm256_cmp_ps(x, pinf, _CMP_EQ_OQ)));
    if (bad) {
      *any_finite = fin != 0;
      return v + __builtin_ctz(static_cast<unsigned>(bad));
    }
    fin |= _mm256_movemask_ps(_mm256_cmp_ps(x, ninf, _CMP_GT_OQ));  // > -inf, and not NaN / +inf (above)
  }
  return logits_row_check_tail(row, v, V, fin != 0, any_finite);
}
#endif

}  // namespace

double row_sumexp(const float* row, int64_t V, float m) {
#ifdef KD_TREE_AVX2
  if (cpu_has_avx2_fma()) return row_sumexp_avx2(row, V, m);
#endif
  double sum = 0.0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - static_cast<double>(m));
  return sum;
}

int64_t logits_row_check(const float* row, int64_t V, bool* any_finite) {
#ifdef KD_TREE_AVX2
  if (cpu_has_avx2_fma()) return logits_row_check_avx2(row, V, any_finite);
#endif
  return logits_row_check_tail(row, 0, V, false, any_finite);
}

int64_t topk_logsoftmax(const float* logits, int64_t D, int64_t V, int64_t k, float* logprobs, int32_t* ids) {
  const int64_t kk = std::min(k, V);
  std::vector<int32_t> order;
  for (int64_t d = 0; d < D; ++d) {
    const float* row = logits + d * V;
    int32_t* rid = ids + d * kk;
    row_topk(row, V, kk, order, rid);
    // log-sum-exp in float64 (m = the row's max, the first of the top k), rounded once to float32
    const float m = row[rid[0]];
    const double sum = row_sumexp(row, V, m);
    const float lse = static_cast<float>(static_cast<double>(m) + std::log(sum));
    for (int64_t j = 0; j < kk; ++j) logprobs[d * kk + j] = row[rid[j]] - lse;  // one float32 subtraction
  }
  return kk;
}

}  // namespace kdtree
