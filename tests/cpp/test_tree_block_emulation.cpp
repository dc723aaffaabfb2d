// test_tree_block_emulation.cpp: the GPU tree build's block algorithm (cuda/tree_build_impl.h,
// TreeBlock<Ctx>) run on the CPU, so CI checks the GPU tree logic without a GPU.
//
// The block's threads are std::threads with the same count the kernel launches (128..1024 by
// budget), sharing one byte buffer as "shared memory"; the Ctx gives them a barrier (mutex +
// condition variable), atomics (GCC __atomic builtins) and warp shuffles (a warp = 32
// consecutive thread ids with its own barrier and exchange buffer, full-mask semantics). Every case
// is compared with the CPU twin (cpp/tree.h tree_build, itself checked against the NumPy oracle):
// n, node tokens / depths / parents / positions, the visibility bitmask bit for bit, the padding
// past n (tokens -1, depths 0, parents -1, positions -1, no stray visibility bits), and which
// path ran (most cases must take the parallel path when it is forced, and most of those trees
// must come from its threshold estimate). Every path is checked: every case runs with the
// parallel path forced (it falls back when its exactness checks fail), the parallel path without
// the threshold estimate (its adaptive levels), the sequential fallback forced, and (B <= 128)
// the one-warp path forced.
//
// KDTREE_EMU_CASES (default 60) sets the number of random cases (plus half as many of other
// regimes); KDTREE_EMU_PROXY=1 prints the latency proxy (barriers, critical path) instead;
// KDTREE_EMU_TRACE=1 prints each case and run (mode, path, how the estimate ended) to stderr
// before and after it, which finds the case of a hang (a barrier some threads skip).
#include <algorithm>
#include <atomic>
#include <cfenv>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tree.h"
#define KDTREE_EMU_MARKS 1  // per-phase latency proxy (ctx.mark)
#include "tree_build_impl.h"

namespace {

using kdtree::treeimpl::TreeArgs;
using kdtree::treeimpl::TreeBlock;

struct Warp {  // 32 consecutive threads: a barrier and an exchange buffer for the shuffles
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  long generation = 0;
  int buf[32] = {};
  void barrier() {
    std::unique_lock<std::mutex> lk(mu);
    const long gen = generation;
    if (++arrived == 32) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lk, [&] { return generation != gen; });
    }
  }
};

struct Block {  // what the threads of one emulated block share
  int nthreads = 0;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  long generation = 0;
  // Latency proxy: block barriers the GPU would execute, entries that go through warp scans
  // (32 per warp_incl_sum of a warp), and the critical path = the sum over barrier intervals of
  // the largest per-thread step count (ctx.step; a warp scan counts 5, a shuffle 1).
  std::vector<long> steps;
  std::vector<Warp> warps;  // nthreads / 32
  long gpu_barriers = 0, scan_elems = 0, crit = 0;
  long phase[kdtree::treeimpl::kProfCats] = {}, phase_last = 0;  // KD_TREE_MARK: critical-path steps per phase (thread 0 marks)
  int last_cat = -1;  // the category of thread 0's last mark: it also gets the tail after the last barrier

  int or_acc = 0, or_result = 0;  // barrier_or: the OR of this generation's predicates, then its result
  // The threshold estimate's crossing recounted serially (emu_estimate_*): the row histograms as
  // the block counted them, and the estimates checked / mismatched.
  std::vector<int> est_h;
  int est_checked = 0, est_earlier = 0, est_exact = 0;
  // Children counts found through the rank tables (ranks_hint) against a plain scan of the row:
  // checked / wrong / narrowed to a span of more than one rank.
  std::atomic<long> hint_checked{0}, hint_wrong{0}, hint_wide{0};

  // gpu = false: a barrier of the emulation only (the GPU has none there): not counted.
  // Returns the OR of every thread's pred (__syncthreads_or).
  int barrier(bool gpu = true, int pred = 0) {
    std::unique_lock<std::mutex> lk(mu);
    const long gen = generation;
    or_acc |= pred != 0;
    if (++arrived == nthreads) {
      if (gpu) {
        long m = 0;
        for (long& v : steps) { m = std::max(m, v); v = 0; }
        crit += m;
        ++gpu_barriers;
      }
      or_result = or_acc;
      or_acc = 0;
      arrived = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lk, [&] { return generation != gen; });
    }
    return or_result;  // (read under the lock: the next barrier cannot complete without this thread)
  }
};

struct HostCtx {
  static constexpr int kBins = kdtree::treeimpl::kDpG;  // the threshold estimate's deficit bins
  Block* blk;
  int t;
  int tid() const { return t; }
  int nthreads() const { return blk->nthreads; }
  void sync() const { blk->barrier(); }
  int sync_or(int pred) const { return blk->barrier(true, pred); }
  void step(int n) const { blk->steps[t] += n; }
  void mark(int cat) const {  // right after a block barrier: blk->crit is the path so far
    if (t != 0) return;
    std::lock_guard<std::mutex> lk(blk->mu);
    if (cat >= 0 && cat < kdtree::treeimpl::kProfTimed) blk->phase[cat] += blk->crit - blk->phase_last;
    blk->phase_last = blk->crit;
    blk->last_cat = cat;
  }
  void emu_sync() const { blk->barrier(false); }  // a barrier of the emulation only (not counted)
  // Thread 0, right after the estimate's histograms are complete: keep a copy of the D rows
  // (row d's bin k at H[d * stride + k]).
  void emu_estimate_rows(const int* H, int D, int stride) const {
    blk->est_h.assign((size_t)D * kBins, 0);
    for (int d = 0; d < D; ++d)
      for (int k = 0; k < kBins; ++k) blk->est_h[(size_t)d * kBins + k] = H[(size_t)d * stride + k];
  }
  // Thread 0 with the block's crossing `below` (bins whose N is below B): the count by its
  // definition, one depth at a time in 64-bit counts (S_{n+1} = H_n * S_n cumulative from S_0 = 1,
  // saturated at 2^20 >= B, which keeps every comparison with B), every depth, the chain part's
  // shifts as ceil(sp_n * inv) with sp_n summed in float in depth order. The block's N is a lower
  // bound of this one (its early stop skips the last depths), so its crossing may lie later, never
  // earlier: an earlier one would claim B prefixes within a bound that holds fewer.
  void emu_estimate_result(int below, const float* lpc, int keff, int D, int B, float inv) const {
    constexpr long long cap = 1LL << 20;
    std::vector<long long> S(kBins, 1), Sn(kBins), N(kBins, 0);
    float sp = 0.0f;
    for (int n = 0; n < D; ++n) {
      if (n > 0) sp -= lpc[(size_t)n * keff];
      for (int j = 0; j < kBins; ++j) {
        long long v = 0;
        for (int k = 0; k <= j; ++k) v += (long long)blk->est_h[(size_t)n * kBins + k] * S[j - k];
        Sn[j] = std::min(v, cap);
      }
      S = Sn;
      const float x = sp * inv;  // (the shift by its definition, not through the block's dp_shift)
      const int c = x < (float)kBins ? (int)std::ceil(x) : kBins;
      for (int m = c; m < kBins; ++m) N[m] = std::min(N[m] + S[m - c], cap);
    }
    int ref = 0;
    for (int m = 0; m < kBins; ++m) ref += N[m] < B;
    ++blk->est_checked;
    blk->est_exact += ref == below;
    if (below < ref) {
      if (blk->est_earlier < 5) std::fprintf(stderr, "estimate crossing %d, serial recount %d (D=%d B=%d)\n", below, ref, D, B);
      ++blk->est_earlier;
    }
  }
  void emu_hint_check(int got, int full, int span) const {
    ++blk->hint_checked;
    if (got != full) {
      if (blk->hint_wrong < 5) std::fprintf(stderr, "rank-table children count %d, a scan of the row %d\n", got, full);
      ++blk->hint_wrong;
    }
    if (span > 1) ++blk->hint_wide;
  }
  int atomic_add(int* p, int v) const { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
  void atomic_min(int* p, int v) const {
    int cur = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v < cur && !__atomic_compare_exchange_n(p, &cur, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
  }
  void atomic_max(int* p, int v) const {
    int cur = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v > cur && !__atomic_compare_exchange_n(p, &cur, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
  }
  // Warp primitives with CUDA's full-mask semantics: lanes = 32 consecutive thread ids; every
  // lane publishes its value in the warp's exchange buffer, a warp barrier, each lane reads what
  // it needs, a second warp barrier (the buffer is reused by the next call). A lane that skips a
  // call its warp makes hangs the test (on the GPU it would be undefined behaviour).
  int warp_incl_sum(int v) const {
    step(5);  // 5 shuffle rounds on the GPU
    if ((t & 31) == 0) {
      std::lock_guard<std::mutex> lk(blk->mu);
      blk->scan_elems += 32;
    }
    return exchange(v, [&](const int* buf) {
      int r = 0;
      for (int i = 0; i <= (t & 31); ++i) r += buf[i];
      return r;
    });
  }
  void warp_sync() const {
    step(1);
    blk->warps[t >> 5].barrier();
  }
  int warp_sum(int v) const {  // __reduce_add_sync: every lane gets the warp's total
    step(1);
    return exchange(v, [](const int* buf) {
      int r = 0;
      for (int i = 0; i < 32; ++i) r += buf[i];
      return r;
    });
  }
  int warp_shfl(int v, int src) const {
    step(1);
    return exchange(v, [&](const int* buf) { return buf[src & 31]; });
  }

 private:
  // Every lane publishes v in the warp's buffer, a warp barrier, `read` computes this lane's result
  // from the buffer, a second warp barrier (the buffer is reused by the next call).
  template <class F>
  int exchange(int v, F read) const {
    Warp& w = blk->warps[t >> 5];
    w.buf[t & 31] = v;
    w.barrier();
    const int r = read(w.buf);
    w.barrier();
    return r;
  }
};

int tree_threads(int B) { return B > 256 ? 1024 : (B > 64 ? 512 : (B > 16 ? 256 : 128)); }

struct Out {
  std::vector<int32_t> tokens, depths, parents, positions, n, path;
  std::vector<uint64_t> vis;
  long gpu_barriers = 0, scan_elems = 0, crit = 0;
  long phase[kdtree::treeimpl::kProfCats] = {};
  int fix = -1;  // misc[M_FIX] after the run: how the parallel path ended (0 no estimate, 1 estimate, 2 estimate failed)
  int est_checked = 0, est_earlier = 0, est_exact = 0;  // threshold estimates recounted serially / earlier than the recount / equal to it
  long hint_checked = 0, hint_wrong = 0, hint_wide = 0;  // rank-table children counts (Block)
};

// mode: TreeArgs::force_fallback (0 auto, 1 sequential fallback, 2 one-warp path, 3 parallel path)
Out run_block(const std::vector<float>& lp, const std::vector<int32_t>& ids, int D, int K, int B, int cache_len,
              int mode) {
  const int W = kdtree::treeimpl::vis_words(B);
  Out o;
  o.tokens.assign(std::max(B, 1), 12345);  // poisoned: every slot must be written
  o.depths.assign(std::max(B, 1), 12345);
  o.parents.assign(B + 1, 12345);
  o.positions.assign(B + 1, 12345);
  o.vis.assign((size_t)(B + 1) * W, 0xA5A5A5A5A5A5A5A5ull);
  o.n.assign(1, -7);
  o.path.assign(1, -7);
  TreeArgs a{};
  a.lp = lp.data();
  a.ids = ids.data();
  a.D = D;
  a.K = K;
  a.ld = K;
  a.B = B;
  a.cache_len = cache_len;
  a.tokens = o.tokens.data();
  a.depths = o.depths.data();
  a.parents = o.parents.data();
  a.positions = o.positions.data();
  a.visibility = o.vis.data();
  a.n_out = o.n.data();
  a.path_out = o.path.data();
  a.force_fallback = mode;
  a.lay = kdtree::treeimpl::make_tree_layout(B, D, K);  // as the launcher does
  const auto& L = a.lay;
  std::vector<double> smem_storage(L.total / sizeof(double) + 2, 0.0);  // 8-byte aligned
  unsigned char* smem = reinterpret_cast<unsigned char*>(smem_storage.data());
  Block blk;
  blk.nthreads = tree_threads(B);
  blk.steps.assign(blk.nthreads, 0);
  blk.warps = std::vector<Warp>(blk.nthreads / 32);
  std::vector<std::thread> threads;
  threads.reserve(blk.nthreads);
  for (int t = 0; t < blk.nthreads; ++t) {
    threads.emplace_back([&, t] {
      HostCtx ctx{&blk, t};
      TreeBlock<HostCtx> tb(ctx, a, smem);
      tb.run();
    });
  }
  for (auto& th : threads) th.join();
  o.gpu_barriers = blk.gpu_barriers;
  o.scan_elems = blk.scan_elems;
  long m = 0;
  for (long v : blk.steps) m = std::max(m, v);
  o.crit = blk.crit + m;  // the tail after the last barrier
  for (int i = 0; i < kdtree::treeimpl::kProfCats; ++i) o.phase[i] = blk.phase[i];
  if (blk.last_cat >= 0 && blk.last_cat < kdtree::treeimpl::kProfTimed) o.phase[blk.last_cat] += m;  // (the outputs' copy)
  o.fix = reinterpret_cast<const int*>(smem + L.o_misc)[kdtree::treeimpl::M_FIX];
  o.est_checked = blk.est_checked;
  o.est_earlier = blk.est_earlier;
  o.est_exact = blk.est_exact;
  o.hint_checked = blk.hint_checked;
  o.hint_wrong = blk.hint_wrong;
  o.hint_wide = blk.hint_wide;
  return o;
}

int failures = 0, runs = 0, parallel = 0, parallel_big = 0, estimated = 0, estimates_checked = 0, estimates_exact = 0;
long hints_checked = 0, hints_wide = 0;
void fail(const std::string& what) {
  if (failures < 20) std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  ++failures;
}

// Random [D, K] inputs: sorted log-probs of a few kinds, token ids.
void make_case(std::mt19937_64& rng, int kind, int D, int K, std::vector<float>* lp, std::vector<int32_t>* ids) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_int_distribution<int> tok(0, 50000);
  lp->resize((size_t)D * K);
  ids->resize((size_t)D * K);
  for (int d = 0; d < D; ++d) {
    std::vector<double> x(K);
    const double peak = 2.0 + 4.0 * std::fabs(nd(rng));
    for (int j = 0; j < K; ++j) x[j] = nd(rng) * 2.0 + (j == 0 ? peak : 0.0);
    if (kind == 4)  // very peaked: deep, narrow trees
      for (int j = 0; j < K; ++j) x[j] = (j == 0 ? 12.0 + 4.0 * std::fabs(nd(rng)) : 0.0) + 0.3 * nd(rng);
    if (kind == 5)  // near-flat: crowded buckets (probes)
      for (int j = 0; j < K; ++j) x[j] = 1e-3 * nd(rng);
    if (kind == 6)  // exactly flat rows: exact ties everywhere (store overflow -> fallback)
      for (int j = 0; j < K; ++j) x[j] = (d % 3 == 0) ? 0.0 : 0.25 * (double)(j / 3);
    if (kind == 7)  // the benchmark's Zipf-like drafter
      for (int j = 0; j < K; ++j) x[j] = -(1.3 + (d % 5) * 0.25) * std::log(j + 1.0) + 0.5 * nd(rng);
    if (kind == 1)
      for (double& v : x) v = std::round(v * 2.0) / 2.0;  // many exact ties
    std::sort(x.begin(), x.end(), [](double p, double q) { return p > q; });
    double m = x[0], s = 0.0;
    for (double v : x) s += std::exp(v - m);
    const float lse = (float)(m + std::log(s + 1.0));  // as if over a larger vocab
    for (int j = 0; j < K; ++j) (*lp)[(size_t)d * K + j] = (float)x[j] - lse;
    if (kind == 2 || kind == 7) {  // -inf tail in some rows
      const int f = 1 + (int)(rng() % (uint64_t)K);
      if (rng() % 2)
        for (int j = f; j < K; ++j) (*lp)[(size_t)d * K + j] = -INFINITY;
    }
    for (int j = 0; j < K; ++j) (*ids)[(size_t)d * K + j] = kind == 3 ? (int32_t)(rng() % 7) : tok(rng);
  }
}

void check_case(int c, const std::vector<float>& lp, const std::vector<int32_t>& ids, int D, int K, int B, int kind,
                kdtree::Tree* tree, kdtree::TreeBuildWorkspace* ws) {
  const int cache_len = 17 + c;
  kdtree::tree_build(lp.data(), ids.data(), D, K, B, tree, ws);
  const int n = (int)tree->n;
  const int W = kdtree::treeimpl::vis_words(B);
  // parallel (falls back when its checks fail), fallback, one warp, parallel with the adaptive threshold only
  for (int mode : {3, 1, 2, 4}) {
    // The one-warp path runs for small budgets only (auto: B <= kWarpPathMaxB); its emulation
    // (a warp barrier per shuffle) is slow, so it is checked up to B = 128 here.
    if (mode == 2 && B > 128) continue;
    if (std::getenv("KDTREE_EMU_TRACE"))
      std::fprintf(stderr, "case %d kind %d D=%d K=%d B=%d mode %d\n", c, kind, D, K, B, mode);
    const Out o = run_block(lp, ids, D, K, B, cache_len, mode);
    if (std::getenv("KDTREE_EMU_TRACE")) std::fprintf(stderr, "  path %d fix %d\n", o.path[0], o.fix);
    const std::string where = "case " + std::to_string(c) + " kind " + std::to_string(kind) + " D=" +
                              std::to_string(D) + " K=" + std::to_string(K) + " B=" + std::to_string(B) +
                              (mode == 1 ? " (fallback)" : mode == 2 ? " (one warp)" : mode == 4 ? " (adaptive)" : "");
    if (o.n[0] != n) {
      fail(where + ": n " + std::to_string(o.n[0]) + " vs CPU " + std::to_string(n));
      continue;
    }
    estimates_checked += o.est_checked;
    estimates_exact += o.est_exact;
    if (o.est_earlier) fail(where + ": the threshold estimate's crossing lies before its serial recount's");
    hints_checked += o.hint_checked;
    hints_wide += o.hint_wide;
    if (o.hint_wrong) fail(where + ": " + std::to_string(o.hint_wrong) + " children counts through the rank tables differ from a scan of the row");
    if (mode == 1 && o.path[0] != 1) fail(where + ": force_fallback did not take the fallback");
    if (mode == 2 && o.path[0] != 2) fail(where + ": the one-warp path was not taken");
    if (mode == 4 && o.path[0] != 0 && o.path[0] != 1) fail(where + ": the threshold estimate ran");
    if (mode == 3) {
      ++runs;
      if (o.path[0] == 0 || o.path[0] == 3) {
        ++parallel;
        if (o.path[0] == 3) ++estimated;
        if (B >= 256) ++parallel_big;
      }
    }
    bool ok = o.parents[0] == -1 && o.positions[0] == cache_len;
    for (int i = 0; i < n && ok; ++i)
      ok = o.tokens[i] == tree->tokens[i] && o.depths[i] == tree->depths[i] && o.parents[i + 1] == tree->parents[i + 1] &&
           o.positions[i + 1] == cache_len + tree->depths[i];
    for (int i = n; i < B && ok; ++i) ok = o.tokens[i] == -1 && o.depths[i] == 0;
    for (int i = n + 1; i <= B && ok; ++i) ok = o.parents[i] == -1 && o.positions[i] == -1;
    if (!ok) {
      fail(where + ": node arrays differ from the CPU twin");
      continue;
    }
    for (int i = 0; i <= B && ok; ++i)
      for (int j = 0; j < W * 64 && ok; ++j) {
        const bool got = (o.vis[(size_t)i * W + j / 64] >> (j % 64)) & 1ull;
        const bool want = i <= n && j <= n && tree->sees(i, j);
        ok = got == want;
        if (!ok) fail(where + ": visibility bit (" + std::to_string(i) + ", " + std::to_string(j) + ")");
      }
  }
}

// The benchmark's drafter rows (benchmarks/bench_cuda_tree_build.py): "peaked" = per depth
// logit of the r-th likeliest token -s*log(r) + N(0, 0.5^2), s ~ U(1.3, 2.3); "flat" = N(0, 3^2)
// logits; V ids; top-K by logit (lower id first on ties), log-softmax in float32.
void drafter_rows(uint64_t seed, bool peaked, int D, int V, int K, std::vector<float>* lp, std::vector<int32_t>* ids) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  lp->assign((size_t)D * K, 0.f);
  ids->assign((size_t)D * K, 0);
  std::vector<float> row(V);
  std::vector<int32_t> idx(V);
  for (int d = 0; d < D; ++d) {
    const double s = std::uniform_real_distribution<double>(1.3, 2.3)(rng);
    for (int v = 0; v < V; ++v) row[v] = (float)(peaked ? -s * std::log(v + 1.0) + 0.5 * nd(rng) : 3.0 * nd(rng));
    std::shuffle(row.begin(), row.end(), rng);
    for (int v = 0; v < V; ++v) idx[v] = v;
    std::partial_sort(idx.begin(), idx.begin() + K, idx.end(),
                      [&](int32_t x, int32_t y) { return row[x] != row[y] ? row[x] > row[y] : x < y; });
    double m = row[idx[0]], acc = 0.0;
    for (int v = 0; v < V; ++v) acc += std::exp((double)row[v] - m);
    const float lse = (float)(m + std::log(acc));
    for (int j = 0; j < K; ++j) {
      (*lp)[(size_t)d * K + j] = row[idx[j]] - lse;
      (*ids)[(size_t)d * K + j] = idx[j];
    }
  }
}

// critical-path steps per phase (KD_TREE_MARK categories), for the proxy table
std::string phases(const Out& o) {
  std::string r;
  char buf[64];
  for (int i = 0; i < kdtree::treeimpl::kProfTimed; ++i)
    if (o.phase[i]) {
      std::snprintf(buf, sizeof buf, " %s %ld", kdtree::treeimpl::kProfNames[i], o.phase[i]);
      r += buf;
    }
  return r;
}

// KDTREE_EMU_PROXY=1: the latency proxy per budget on the benchmark's drafters (D = 15, K = B).
int proxy_table() {
  kdtree::Tree tree;
  kdtree::TreeBuildWorkspace ws;
  std::printf("| drafter | B | threads | n | depth | path | block barriers | scanned entries | critical path steps |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (int peaked = 1; peaked >= 0; --peaked)
    for (int B : {16, 64, 256, 1024}) {
      const int D = 15, K = B;
      std::vector<float> lp;
      std::vector<int32_t> ids;
      drafter_rows(7, peaked == 1, D, 163840, K, &lp, &ids);
      check_case(0, lp, ids, D, K, B, 0, &tree, &ws);  // exactness vs the CPU twin
      for (int mode : {3, 2}) {
        const Out o = run_block(lp, ids, D, K, B, 0, mode);
        int depth = 0;
        for (int i = 0; i < o.n[0]; ++i) depth = std::max(depth, o.depths[i]);
        std::printf("| %s | %d | %d | %d | %d | %s | %ld | %ld | %ld |%s\n", peaked ? "peaked" : "flat", B,
                    tree_threads(B), o.n[0], depth, o.path[0] == 0 ? "parallel" : o.path[0] == 3 ? "parallel, estimate" : o.path[0] == 2 ? "one warp" : "fallback",
                    o.gpu_barriers, o.scan_elems, o.crit, phases(o).c_str());
      }
    }
  // OracleDrafter's rows (python/kdtree_native/drafters.py): the same [-0.01, -4, -5, ...] at every
  // depth, K = 8: many prefixes share a score exactly (ties broken by rank tuples).
  for (int B : {16, 64, 256}) {
    const int D = 15, K = 8;
    std::vector<float> lp((size_t)D * K);
    std::vector<int32_t> ids((size_t)D * K);
    for (int d = 0; d < D; ++d)
      for (int j = 0; j < K; ++j) {
        lp[(size_t)d * K + j] = j == 0 ? -0.01f : -4.0f - (float)(j - 1);
        ids[(size_t)d * K + j] = 100 * d + j;
      }
    check_case(0, lp, ids, D, K, B, 0, &tree, &ws);
    for (int mode : {3, 2}) {
      const Out o = run_block(lp, ids, D, K, B, 0, mode);
      int depth = 0;
      for (int i = 0; i < o.n[0]; ++i) depth = std::max(depth, o.depths[i]);
      std::printf("| oracle K=8 | %d | %d | %d | %d | %s | %ld | %ld | %ld |%s\n", B, tree_threads(B), o.n[0], depth,
                  o.path[0] == 0 ? "parallel" : o.path[0] == 3 ? "parallel, estimate" : o.path[0] == 2 ? "one warp" : "fallback", o.gpu_barriers,
                  o.scan_elems, o.crit, phases(o).c_str());
    }
  }
  std::printf("proxy cases: %d failures\n", failures);
  return failures ? 1 : 0;
}

}  // namespace

// bucket_limit(bt) is the threshold form of bucket_of(smax, s) <= bt used by the binary searches:
// check it on random deltas, on the exact bucket boundaries (the float midpoints) and next to them.
int check_bucket_limit() {
  using namespace kdtree::treeimpl;
  std::mt19937_64 rng(7);
  int bad = 0;
  long n = 0;
  auto check = [&](double smax, double s) {
    const int b = bucket_of(smax, s);
    for (int bt : {0, 1, 2, b - 1, b, b + 1, kNB - 3, kNB - 2, kNB - 1 - 1}) {
      if (bt < 0 || bt >= kBottom) continue;
      ++n;
      if ((b <= bt) != (smax - s < bucket_limit(bt))) {
        if (++bad < 5) std::printf("bucket_limit mismatch: smax %.17g s %.17g bucket %d bt %d\n", smax, s, b, bt);
      }
    }
  };
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int i = 0; i < 200000; ++i) {
    const double smax = -std::ldexp(std::abs(u(rng)), (int)(rng() % 10) - 5);
    const double delta = std::ldexp(std::abs(u(rng)), (int)(rng() % 80) - 40);
    check(smax, smax - delta);
    check(smax, smax + delta);  // delta <= 0 side
  }
  for (int bt = 1; bt < kNB - 2; ++bt) {  // every boundary, exactly and one double either side
    const double m = bucket_limit(bt);
    for (double d : {m, std::nextafter(m, 0.0), std::nextafter(m, 1e300)}) check(0.0, -d);
  }
  check(0.0, -__builtin_huge_val());
  check(0.0, 0.0);
  std::printf("bucket_limit: %ld checks, %d mismatches\n", n, bad);
  return bad;
}

// Phase 0's branch-free exponent bounds (exponent_bounds + float_exponent) against the exponent
// arithmetic by their definition (bit scans, normal and subnormal apart): the largest floor(log2 |v|)
// and the smallest exponent of a lowest set significand bit over the nonzero finite elements of
// random groups of floats (normals, subnormals, zeros, powers of two, trailing zeros, infinities, NaN).
int check_exponent_bounds() {
  using namespace kdtree::treeimpl;
  std::mt19937_64 rng(11);
  int bad = 0;
  long n = 0;
  for (int it = 0; it < 400000; ++it) {
    int me_max = -100000, qe_min = 100000;
    float amax = 0.0f, qmin = __builtin_huge_valf();
    const int cnt = 1 + (int)(rng() % 6);
    for (int j = 0; j < cnt; ++j) {
      uint32_t b = (uint32_t)rng();
      switch (rng() % 8) {
        case 0: b &= 0x807FFFFFu; break;                      // subnormal or zero
        case 1: b &= 0xFF800000u; break;                      // a power of two, zero or infinity
        case 2: b &= 0xFFFFF000u; break;                      // trailing zeros
        case 3: b = (b & 0x80000000u) | 0x7F800000u | (uint32_t)(rng() % 3 == 0); break;  // inf or NaN
        case 4: b = (b & 0x80000000u) | (uint32_t)(rng() % 5); break;                     // tiny subnormals, zero
        default: break;
      }
      float v;
      std::memcpy(&v, &b, 4);
      exponent_bounds(v, amax, qmin);
      const uint32_t bits = b & 0x7FFFFFFFu;
      if (bits != 0 && bits < 0x7F800000u) {
        const int e = (int)(bits >> 23);
        const uint32_t m = bits & 0x7FFFFFu;
        int qe, me;
        if (e == 0) { qe = -149 + __builtin_ctz(m); me = -149 + (31 - __builtin_clz(m)); }
        else { qe = (e - 150) + __builtin_ctz(m | 0x800000u); me = e - 127; }
        me_max = std::max(me_max, me);
        qe_min = std::min(qe_min, qe);
      }
    }
    ++n;
    const bool any = amax > 0.0f;
    if (any != (me_max > -100000) ||
        (any && (float_exponent(amax) != me_max || float_exponent(qmin) != qe_min))) {
      if (++bad < 5) std::printf("exponent bounds mismatch: %d %d vs %d %d\n", any ? float_exponent(amax) : 0,
                                 any ? float_exponent(qmin) : 0, me_max, qe_min);
    }
  }
  std::printf("exponent bounds: %ld groups, %d mismatches\n", n, bad);
  return bad;
}

// [D, K] rows -1 - 0.25 j (sorted, exact, every row alike) and ids 1000 d + j: the base that the
// phase 0 cases below edit one element of.
void plain_rows(int D, int K, std::vector<float>* lp, std::vector<int32_t>* ids) {
  lp->resize((size_t)D * K);
  ids->resize((size_t)D * K);
  for (int d = 0; d < D; ++d)
    for (int j = 0; j < K; ++j) {
      (*lp)[(size_t)d * K + j] = -1.0f - 0.25f * (float)j;
      (*ids)[(size_t)d * K + j] = 1000 * d + j;
    }
}

// child_floor (tree_build_impl.h): the binary searches' float test `v > child_floor(smax, s, lim)`
// against the double test it replaces, `smax - (s + v) < lim`, on exact sums (scores on a 2^-20
// grid below 2^8, as phase 0's span check guarantees) and on floats v at and next to the
// threshold (where the TwoSum error and the rounding direction decide).
int check_child_floor() {
  using kdtree::treeimpl::bucket_limit;
  using kdtree::treeimpl::child_floor;
  using kdtree::treeimpl::kNB;
  std::mt19937_64 rng(4242);
  std::uniform_int_distribution<int64_t> grid(-(int64_t{1} << 27), 0);  // multiples of 2^-20 in (-2^7, 0]
  auto exact_sum = [](double x, double y) {  // x + y exact in double (TwoSum error 0)
    const double z = x + y, yy = z - x;
    return (x - (z - yy)) + (y - yy) == 0.0;
  };
  // the device's formula (cuda/tree_build_impl.h, child_floor under __CUDA_ARCH__): A - lim rounded
  // down to a double, then down to a float; here by the FPU's rounding mode (volatile operands keep
  // the operations after fesetround)
  auto device_formula = [](double smax, double s, double lim) -> float {
    if (lim == INFINITY) return -INFINITY;
    volatile double va = smax - s, vl = lim;
    std::fesetround(FE_DOWNWARD);
    volatile double t = va - vl;
    volatile float f = (float)t;
    std::fesetround(FE_TONEAREST);
    return f;
  };
  long n = 0, nd = 0;
  int bad = 0, bad_dev = 0;
  for (int i = 0; i < 200000; ++i) {
    const double smax = std::ldexp((double)grid(rng), -20 - (int)(rng() % 8));
    double s = smax;
    const int terms = 1 + (int)(rng() % 15);
    for (int k = 0; k < terms; ++k) s += std::ldexp((double)grid(rng), -20);
    const int bt = (int)(rng() % (uint64_t)(kNB - 1));  // 0 .. kNB - 2 (kNB - 2: lim = +inf)
    const double lim = bucket_limit(bt);
    {
      const float host = child_floor(smax, s, lim), dev = device_formula(smax, s, lim);
      ++nd;
      if (std::memcmp(&host, &dev, sizeof(float)) != 0 && ++bad_dev <= 5)
        std::printf("child_floor: TwoSum %.9g, directed rounding %.9g (smax %.17g s %.17g lim %.17g)\n", (double)host,
                    (double)dev, smax, s, lim);
    }
    const double t = (smax - s) - lim;
    const float ft = (float)t;
    float cands[8] = {ft, std::nextafter(ft, INFINITY), std::nextafter(ft, -INFINITY), 0.0f, -0.0f,
                      (float)std::ldexp((double)grid(rng), -20), -INFINITY, -std::ldexp(1.0f, -30)};
    for (float v : cands) {
      // the identity holds where the algorithm uses it: exact sums (phase 0's span check)
      if (v != -INFINITY && (!exact_sum(s, (double)v) || !exact_sum(smax, -(s + (double)v)))) continue;
      const bool want = smax - (s + (double)v) < lim;
      const bool got = v > child_floor(smax, s, lim);
      ++n;
      if (want != got && ++bad <= 5)
        std::printf("child_floor mismatch: smax %.17g s %.17g lim %.17g v %.9g: double %d float %d\n", smax, s, lim,
                    (double)v, want, got);
    }
  }
  std::printf("child_floor: %ld checks, %d mismatches; the device's directed-rounding formula: %ld checks, %d "
              "mismatches\n", n, bad, nd, bad_dev);
  return bad + bad_dev;
}

int main() {
  if (std::getenv("KDTREE_EMU_PROXY")) return proxy_table();
  if (check_bucket_limit()) return 1;
  if (check_child_floor()) return 1;
  if (check_exponent_bounds()) return 1;
  const char* env = std::getenv("KDTREE_EMU_CASES");
  const int cases = env ? std::atoi(env) : 60;
  std::mt19937_64 rng(20261130);
  const int budgets[] = {1, 2, 3, 8, 16, 31, 64, 65, 100, 256, 300, 512, 1024};
  kdtree::Tree tree;
  kdtree::TreeBuildWorkspace ws;
  int done = 0;
  for (int c = 0; c < cases; ++c) {
    const int B = budgets[rng() % (sizeof(budgets) / sizeof(budgets[0]))];
    const int D = 1 + (int)(rng() % 16);
    const int K = 1 + (int)(rng() % (uint64_t)std::min(B, 48));
    const int kind = (int)(rng() % 4);  // 0 plain, 1 ties, 2 -inf tails, 3 duplicate ids
    std::vector<float> lp;
    std::vector<int32_t> ids;
    make_case(rng, kind, D, K, &lp, &ids);
    check_case(c, lp, ids, D, K, B, kind, &tree, &ws);
    ++done;
  }
  // Regimes the main loop rarely hits: small budgets (B <= 64: one warp's worth), deep narrow
  // trees, near-flat and exactly flat drafts (ties), Zipf rows with -inf tails.
  {
    std::mt19937_64 rng2(77001);
    const int small_b[] = {1, 2, 4, 5, 7, 16, 24, 32, 33, 48, 63, 64, 96, 128, 200, 256, 1000, 1024};
    for (int c = 0; c < cases / 2; ++c) {
      const int B = small_b[rng2() % (sizeof(small_b) / sizeof(small_b[0]))];
      const int D = 1 + (int)(rng2() % 16);
      const int K = 1 + (int)(rng2() % (uint64_t)std::min(B, c % 3 == 0 ? 1024 : 64));
      const int kind = 4 + (int)(rng2() % 4);
      std::vector<float> lp;
      std::vector<int32_t> ids;
      make_case(rng2, kind, D, K, &lp, &ids);
      check_case(100000 + c, lp, ids, D, K, B, kind, &tree, &ws);
      ++done;
    }
  }
  // A row of -inf from rank 0 at a depth d >= 1 (a drafter with nothing to say that deep): the
  // threshold estimate's chain part is +inf from depth d on, and its bin shift must clamp (the
  // float-to-int conversion of +inf is undefined in C++; the GPU's saturates, and the landing bin
  // j + shift wrapped to a negative index). Few ranks per row, so the depth steps reach row d.
  {
    std::mt19937_64 rng3(99001);
    const int bs[] = {64, 96, 256, 1000};
    const int est0 = estimated;
    for (int c = 0; c < 16; ++c) {
      const int B = bs[c % 4];
      const int D = 3 + (int)(rng3() % 14);
      const int K = 2 + (int)(rng3() % 6);
      std::vector<float> lp;
      std::vector<int32_t> ids;
      make_case(rng3, (int)(rng3() % 4), D, K, &lp, &ids);
      const int d = 1 + (int)(rng3() % (uint64_t)(D - 1));
      for (int j = 0; j < K; ++j) lp[(size_t)d * K + j] = -INFINITY;
      check_case(300000 + c, lp, ids, D, K, B, 2, &tree, &ws);
      ++done;
    }
    if (estimated == est0) fail("no tree with a row of -inf from rank 0 took the threshold estimate");
  }
  // The exactness check of phase 0 (float64 sums of D + 1 terms exact when the inputs' exponent
  // span leaves room in 53 bits): the largest magnitude and the finest quantum sit in elements of
  // different warps, so the span is only right if the per-warp bounds are combined across warps.
  // D = 4 (3 bits for the terms): maxe 10 and quantum 2^-45 -> 59 bits > 53: fallback; quantum
  // 2^-35 -> 49 bits: parallel path. Both trees equal to the CPU twin.
  {
    for (int q : {45, 35}) {
      const int D = 4, K = 64, B = 96;
      std::vector<float> lp;
      std::vector<int32_t> ids;
      plain_rows(D, K, &lp, &ids);  // maxe 4, quantum 2^-2
      lp[(size_t)0 * K + 63] = -1024.0f;                    // element 63 (warp 1): maxe 10
      lp[(size_t)3 * K + 0] = -std::ldexp(1.0f, -q);        // element 192 (warp 6): quantum 2^-q
      const Out o = run_block(lp, ids, D, K, B, 3, 3);
      const int want = q == 45 ? 1 : 0;
      if ((o.path[0] == 3 ? 0 : o.path[0]) != want)  // 0 or 3: the parallel path
        fail("exponent span 2^-" + std::to_string(q) + " .. 2^10: path " + std::to_string(o.path[0]) + ", expected " +
             std::to_string(want));
      check_case(200000 + q, lp, ids, D, K, B, 0, &tree, &ws);
      ++done;
    }
  }
  // Inputs phase 0 must send to the fallback, each placed inside a 4-element item and on an
  // item's first element (the left neighbour comes from the previous item): NaN, +inf, a rise
  // within a row, lp[d][0] > 0 for d >= 1, a finite value after -inf. And a -inf tail alone,
  // which the parallel path takes (its first -inf rank per row bounds the children).
  {
    struct Bad { const char* what; int d, r; float v; int want; };
    const Bad bads[] = {{"NaN mid-item", 2, 6, NAN, 1},        {"NaN item start", 1, 8, NAN, 1},
                        {"+inf", 3, 5, INFINITY, 1},           {"rise at item start", 2, 4, -0.5f, 1},
                        {"rise mid-item", 1, 3, -0.5f, 1},     {"lp[d][0] > 0", 2, 0, 0.25f, 1},
                        {"finite after -inf", 0, 61, -3.0f, 1}, {"-inf tail", 0, 0, 0.0f, 0}};
    int k = 0;
    for (const Bad& c : bads) {
      const int D = 4, K = 64, B = 96;
      std::vector<float> lp;
      std::vector<int32_t> ids;
      plain_rows(D, K, &lp, &ids);
      for (int j = 60; j < K; ++j) lp[(size_t)0 * K + j] = -INFINITY;  // row 0: a -inf tail from rank 60
      if (c.want) lp[(size_t)c.d * K + c.r] = c.v;
      const Out o = run_block(lp, ids, D, K, B, 3, 3);
      if ((o.path[0] == 3 ? 0 : o.path[0]) != c.want)  // 0 or 3: the parallel path
        fail(std::string("phase 0 input '") + c.what + "': path " + std::to_string(o.path[0]) + ", expected " +
             std::to_string(c.want));
      check_case(300000 + k++, lp, ids, D, K, B, 0, &tree, &ws);
      ++done;
    }
  }
  // the empty cases: B = 0 (root only)
  {
    std::vector<float> lp(4, -1.f);
    std::vector<int32_t> ids(4, 3);
    const Out o = run_block(lp, ids, 2, 2, 0, 5, 0);
    if (o.n[0] != 0 || o.parents[0] != -1 || o.positions[0] != 5 || o.vis[0] != 1ull) fail("B = 0: root only");
  }
  // The parallel path must carry most cases (else this test would mostly check the fallback);
  // flat drafts with deep trees at B = 1024 may overflow its candidate store and fall back.
  if (parallel * 4 < runs * 3) fail("only " + std::to_string(parallel) + " of " + std::to_string(runs) +
                                     " cases took the parallel path");
  if (parallel_big == 0) fail("no case with B >= 256 took the parallel path");
  // and the threshold estimate must give most of the parallel path's trees
  if (estimated * 2 < parallel) fail("the threshold estimate gave only " + std::to_string(estimated) + " of " +
                                     std::to_string(parallel) + " parallel trees");
  // (every estimate's crossing was recounted serially; there must have been some)
  if (estimates_checked < estimated) fail("only " + std::to_string(estimates_checked) + " estimates recounted");
  // (and the rank tables' searches must have run, some over more than one rank)
  if (hints_checked == 0 || hints_wide == 0) fail("the rank-table children counts were not exercised");
  std::printf("tree block emulation: %d random cases x 4 paths + the empty tree (parallel path taken in %d of %d, "
              "%d with B >= 256, %d with the threshold estimate; %d estimate crossings recounted serially, %d of them "
              "equal; %ld children counts through the rank tables checked against a scan of the row, %ld of them "
              "narrowed to more than one rank), %d failures\n", done, parallel, runs, parallel_big, estimated,
              estimates_checked, estimates_exact, hints_checked, hints_wide, failures);
  return failures ? 1 : 0;
}
