// test_tree.cpp: the C++ tree ops (cpp/tree.h) against golden outputs of the NumPy reference
// (tests/golden/golden_tree.py -> tree_golden.kdtr): tree build (tokens, depths, parents,
// visibility bitmask), positions, accept walk, compaction maps and kv_compact exactly; top-k
// ids exactly and log-probs within an ulp of the log-sum-exp; input errors.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "check.h"
#include "kdtr.h"
#include "tree.h"

using kdtree::KdtrFile;
using kdtree::KdtrTensor;

namespace {

int64_t scalar(const KdtrFile& f, const std::string& name) { return f.at(name).as<int64_t>()[0]; }

template <class T>
bool same(const T* a, const std::vector<T>& b, int64_t n) {
  if (static_cast<int64_t>(b.size()) != n) return false;
  return std::equal(b.begin(), b.end(), a);
}

int check_tree_case(const KdtrFile& f, int i, kdtree::Tree* tree, kdtree::TreeBuildWorkspace* ws) {
  const std::string p = "c" + std::to_string(i) + ".";
  const KdtrTensor& lp = f.at(p + "logprobs");
  const int64_t D = lp.shape[0], K = lp.shape[1], budget = scalar(f, p + "budget");
  const float* logprobs = lp.as<float>();
  const int32_t* ids = f.at(p + "token_ids").as<int32_t>();
  const int failures_before = kdtest::failures();

  CHECK(kdtree::tree_build_input_error(logprobs, ids, D, K, budget).empty());
  kdtree::tree_build(logprobs, ids, D, K, budget, tree, ws);  // workspace and output reused

  const KdtrTensor& tokens = f.at(p + "tokens");
  const int64_t n = tokens.numel();
  CHECK(tree->n == n);
  CHECK(same(tokens.as<int32_t>(), tree->tokens, n));
  CHECK(same(f.at(p + "depths").as<int32_t>(), tree->depths, n));
  CHECK(same(f.at(p + "parents").as<int32_t>(), tree->parents, n + 1));
  if (tree->n != n) return 1;

  // visibility: the bitmask equals the reference's bool matrix, and tree_visibility agrees
  const bool* vis = f.at(p + "visibility").as<bool>();
  CHECK(tree->vis_words == (n + 1 + 63) / 64);
  bool vis_ok = true;
  for (int64_t a = 0; a <= n; ++a)
    for (int64_t b = 0; b <= n; ++b) vis_ok = vis_ok && tree->sees(a, b) == vis[a * (n + 1) + b];
  CHECK(vis_ok);
  std::vector<uint64_t> bits((n + 1) * kdtree::tree_visibility_words(n), ~uint64_t{0});
  kdtree::tree_visibility(tree->parents.data(), n, bits.data());
  CHECK(bits == tree->visibility);

  // positions
  const int64_t cache_len = scalar(f, p + "cache_len");
  std::vector<int32_t> pos(n + 1, -7);
  kdtree::tree_positions(tree->depths.data(), n, cache_len, pos.data());
  CHECK(same(f.at(p + "positions").as<int32_t>(), pos, n + 1));

  // accept walk
  CHECK(kdtree::tree_structure_error(tree->parents.data(), n).empty());
  const int64_t* choice = f.at(p + "choice").as<int64_t>();
  std::vector<int32_t> path(n + 1, -7);
  int64_t bonus = -12345;
  const int64_t m = kdtree::tree_accept(tree->parents.data(), tree->tokens.data(), n, choice, path.data(), &bonus);
  path.resize(m);
  const KdtrTensor& want_path = f.at(p + "path");
  CHECK(same(want_path.as<int32_t>(), path, want_path.numel()));
  CHECK(bonus == scalar(f, p + "bonus"));

  // compaction map, and kv_compact on rows that hold their own slot number
  std::vector<int32_t> src(m), dst(m);
  kdtree::compact_index_map(path.data(), m, cache_len, src.data(), dst.data());
  CHECK(same(f.at(p + "src").as<int32_t>(), src, m));
  CHECK(same(f.at(p + "dst").as<int32_t>(), dst, m));
  std::vector<int64_t> cache(cache_len + n + 1);
  for (size_t s = 0; s < cache.size(); ++s) cache[s] = static_cast<int64_t>(s) * 10;
  const int64_t new_len = kdtree::kv_compact(cache.data(), sizeof(int64_t), cache_len, path.data(), m);
  CHECK(new_len == cache_len + m);
  bool compact_ok = true;
  for (int64_t s = 0; s < cache_len; ++s) compact_ok = compact_ok && cache[s] == s * 10;
  for (int64_t j = 0; j < m; ++j) compact_ok = compact_ok && cache[cache_len + j] == src[j] * 10;
  CHECK(compact_ok);
  return kdtest::failures() != failures_before;
}

int check_topk_case(const KdtrFile& f, int j) {
  const std::string p = "t" + std::to_string(j) + ".";
  const KdtrTensor& x = f.at(p + "logits");
  const int64_t D = x.shape[0], V = x.shape[1], k = scalar(f, p + "k");
  const float* logits = x.as<float>();
  const int failures_before = kdtest::failures();
  CHECK(kdtree::topk_logsoftmax_input_error(logits, D, V, k).empty());
  const int64_t kk = std::min(k, V);
  std::vector<float> lp(D * kk, 123.f);
  std::vector<int32_t> ids(D * kk, -1);
  CHECK(kdtree::topk_logsoftmax(logits, D, V, k, lp.data(), ids.data()) == kk);
  CHECK(same(f.at(p + "ids").as<int32_t>(), ids, D * kk));
  // the log-sum-exp is float64 in both, summed in different orders: allow two ulps of it
  float big = 1.f;
  for (int64_t e = 0; e < D * V; ++e)
    if (std::isfinite(logits[e])) big = std::max(big, std::fabs(logits[e]));
  const float tol = 2.f * (std::nextafter(big, 2.f * big) - big);
  const float* want = f.at(p + "logprobs").as<float>();
  bool lp_ok = true;
  for (int64_t e = 0; e < D * kk; ++e) {
    if (std::isinf(want[e]) || std::isinf(lp[e])) lp_ok = lp_ok && want[e] == lp[e];
    else lp_ok = lp_ok && std::fabs(want[e] - lp[e]) <= tol;
  }
  CHECK(lp_ok);
  return kdtest::failures() != failures_before;
}

void check_input_errors() {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> lp = {-0.1f, -1.f, -2.f, -0.5f, -0.6f, -3.f};  // [2,3]
  std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6};
  CHECK(kdtree::tree_build_input_error(lp.data(), ids.data(), 2, 3, 4).empty());
  auto err_with = [&](std::vector<float> l, std::vector<int32_t> t, int64_t K, int64_t B, const char* what) {
    const std::string e = kdtree::tree_build_input_error(l.data(), t.data(), 2, K, B);
    return e.find(what) != std::string::npos;
  };
  std::vector<float> bad = lp;
  bad[4] = nan;
  CHECK(err_with(bad, ids, 3, 4, "NaN"));
  bad = lp;
  bad[0] = inf;
  CHECK(err_with(bad, ids, 3, 4, "+inf"));
  bad = lp;
  bad[2] = -0.5f;
  CHECK(err_with(bad, ids, 3, 4, "sorted descending"));
  std::vector<int32_t> bad_ids = ids;
  bad_ids[3] = -1;
  CHECK(err_with(lp, bad_ids, 3, 4, "token_ids"));
  CHECK(err_with(lp, ids, 3, -1, "budget"));
  CHECK(err_with(lp, ids, 3, kdtree::kTreeMaxBudget + 1, "budget"));
  CHECK(err_with(lp, ids, 0, 4, "K"));
  CHECK(!kdtree::tree_build_input_error(lp.data(), ids.data(), kdtree::kTreeMaxDepth + 1, 3, 4).empty());
  bad = lp;
  bad[1] = -inf;
  bad[2] = -inf;
  CHECK(kdtree::tree_build_input_error(bad.data(), ids.data(), 2, 3, 4).empty());  // -inf is fine
  bad[4] = nan;
  CHECK_THROWS(kdtree::tree_build(bad.data(), ids.data(), 2, 3, 4));  // the checked form throws

  const std::vector<int32_t> parents_bad = {-1, 0, 2};
  CHECK(!kdtree::tree_structure_error(parents_bad.data(), 2).empty());
  const std::vector<int32_t> root_bad = {0, 0};
  CHECK(!kdtree::tree_structure_error(root_bad.data(), 1).empty());

  std::vector<float> logits = {0.f, 1.f, 2.f, -inf, -inf, -inf};  // [2,3], row 1 all -inf
  CHECK(kdtree::topk_logsoftmax_input_error(logits.data(), 2, 3, 2).find("all -inf") != std::string::npos);
  CHECK(kdtree::topk_logsoftmax_input_error(logits.data(), 1, 3, 0).find("k") != std::string::npos);
  logits[1] = nan;
  CHECK(kdtree::topk_logsoftmax_input_error(logits.data(), 1, 3, 2).find("NaN") != std::string::npos);
}

void check_empty_and_convenience() {
  const std::vector<float> lp = {-0.25f, -1.f, -0.5f, -0.75f};  // [2,2]
  const std::vector<int32_t> ids = {7, 8, 7, 7};  // depth 2 repeats token 7
  kdtree::Tree t = kdtree::tree_build(lp.data(), ids.data(), 2, 2, 0);
  CHECK(t.n == 0 && t.parents.size() == 1 && t.parents[0] == -1 && t.sees(0, 0));
  t = kdtree::tree_build(lp.data(), ids.data(), 0, 2, 5);  // D = 0
  CHECK(t.n == 0 && t.vis_words == 1 && t.visibility.size() == 1 && t.visibility[0] == 1);
  // full tree of 2 + 4 prefixes: (0) -.25, (0,0) -.75, (0,1) -1.0, (1) -1.0, (1,0) -1.5, (1,1) -1.75;
  // (0,1) and (1) tie at -1.0: the smaller rank tuple (0,1) first
  t = kdtree::tree_build(lp.data(), ids.data(), 2, 2, 100);
  CHECK(t.n == 6);
  CHECK((t.tokens == std::vector<int32_t>{7, 7, 7, 8, 7, 7}));
  CHECK((t.parents == std::vector<int32_t>{-1, 0, 1, 1, 0, 4, 4}));
  CHECK((t.depths == std::vector<int32_t>{1, 2, 2, 1, 2, 2}));
  CHECK(t.sees(3, 1) && t.sees(3, 0) && t.sees(3, 3) && !t.sees(3, 2) && !t.sees(1, 3));
  // token 7 twice below node 1 (nodes 2 and 3): the highest node index wins
  const std::vector<int64_t> choice = {7, 7, 0, 42, 0, 0, 0};
  std::vector<int32_t> path(7);
  int64_t bonus = 0;
  const int64_t m = kdtree::tree_accept(t.parents.data(), t.tokens.data(), t.n, choice.data(), path.data(), &bonus);
  CHECK(m == 3 && path[0] == 0 && path[1] == 1 && path[2] == 3 && bonus == 42);
}

}  // namespace

int main() {
  const std::string path = kdtest::golden_path("tree_golden.kdtr");
  KdtrFile f = KdtrFile::open(path);
  int cases = 0, bad_cases = 0;
  kdtree::Tree tree;
  kdtree::TreeBuildWorkspace ws;
  for (int i = 0; f.find("c" + std::to_string(i) + ".logprobs"); ++i, ++cases) {
    if (check_tree_case(f, i, &tree, &ws) && ++bad_cases <= 5) std::fprintf(stderr, "tree case %d differs\n", i);
  }
  int topk_cases = 0, bad_topk = 0;
  for (int j = 0; f.find("t" + std::to_string(j) + ".logits"); ++j, ++topk_cases) {
    if (check_topk_case(f, j) && ++bad_topk <= 5) std::fprintf(stderr, "top-k case %d differs\n", j);
  }
  const std::string meta = f.metadata_json();
  CHECK(meta.find("\"cases\":" + std::to_string(cases)) != std::string::npos ||
        meta.find("\"cases\": " + std::to_string(cases)) != std::string::npos);
  CHECK(cases >= 300 && topk_cases >= 50);
  check_input_errors();
  check_empty_and_convenience();
  std::printf("%d tree cases (%d differ), %d top-k cases (%d differ)\n", cases, bad_cases, topk_cases, bad_topk);
  TEST_MAIN_END();
}
