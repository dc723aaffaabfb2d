// test_cuda_kernels.cpp: the CUDA kernels (cuda/kernels.h) against plain C++ references:
// tree build (both paths) == a reference heap, top-k + log-softmax, accept walk, compaction,
// and verify attention vs float64. Exit 77 (ctest: skipped) without the CUDA backend or a
// device. KDTREE_CUDA_TEST_CASES sets the number of random tree cases (default 400; the
// compute-sanitizer runs in scripts/gpu_check.sh use a handful) and KDTREE_CUDA_TEST_SMALL=1
// keeps the attention sizes tiny.
#include <cstdio>
#include <cstdlib>

#ifndef KDTREE_HAVE_CUDA
int main() {
  std::printf("CUDA backend not compiled: skipped\n");
  return 77;
}
#else

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <queue>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "kernels.h"

namespace kc = kdtree::cuda;

#define CUDA_OK(x)                                                                      \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    CUDA_OK(cudaMalloc(&p, sizeof(T) * std::max<size_t>(count, 1)));
    CUDA_OK(cudaMemset(p, 0xFF, sizeof(T) * std::max<size_t>(count, 1)));  // poison
  }
  Dev(const std::vector<T>& h) : Dev(h.size()) { CUDA_OK(cudaMemcpy(p, h.data(), sizeof(T) * n, cudaMemcpyHostToDevice)); }
  ~Dev() { cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    CUDA_OK(cudaMemcpy(h.data(), p, sizeof(T) * n, cudaMemcpyDeviceToHost));
    return h;
  }
  Dev(const Dev&) = delete;
};

// ---------------------------------------------------------------- reference tree (contract)
struct RefTree {
  std::vector<int> tokens, depths, parents;
};
struct Cand {
  double s;
  std::vector<int> ranks;
  int parent, depth, rank;
};
struct Worse {
  bool operator()(const Cand& a, const Cand& b) const {
    double sa = std::isnan(a.s) ? -INFINITY : a.s, sb = std::isnan(b.s) ? -INFINITY : b.s;
    if (sa != sb) return sa < sb;
    return b.ranks < a.ranks;
  }
};
RefTree ref_tree(const std::vector<float>& lp, const std::vector<int>& ids, int D, int K, int B) {
  RefTree t;
  t.parents.push_back(-1);
  if (B <= 0 || D <= 0) return t;
  std::priority_queue<Cand, std::vector<Cand>, Worse> h;
  h.push({(double)lp[0], {0}, 0, 1, 0});
  while (!h.empty() && (int)t.tokens.size() < B) {
    Cand c = h.top();
    h.pop();
    int node = (int)t.tokens.size() + 1;
    t.tokens.push_back(ids[(c.depth - 1) * K + c.rank]);
    t.depths.push_back(c.depth);
    t.parents.push_back(c.parent);
    if (c.rank + 1 < K) {
      double s = c.s - (double)lp[(c.depth - 1) * K + c.rank];
      s = s + (double)lp[(c.depth - 1) * K + c.rank + 1];
      auto r = c.ranks;
      r.back() += 1;
      h.push({s, r, c.parent, c.depth, c.rank + 1});
    }
    if (c.depth < D) {
      auto r = c.ranks;
      r.push_back(0);
      h.push({c.s + (double)lp[c.depth * K], r, node, c.depth + 1, 0});
    }
  }
  return t;
}

void make_case(std::mt19937& rng, int kind, int D, int K, std::vector<float>* lp, std::vector<int>* ids) {
  lp->assign((size_t)D * K, 0.f);
  ids->assign((size_t)D * K, 0);
  std::normal_distribution<double> nd(0, 1);
  for (int d = 0; d < D; ++d) {
    std::vector<float> row(K);
    if (kind <= 2) {
      double sig = 0.5 + (rng() % 40) * 0.1;
      std::vector<double> lg(K + 16);
      for (auto& x : lg) x = nd(rng) * sig;
      double m = *std::max_element(lg.begin(), lg.end()), s = 0;
      for (double x : lg) s += std::exp(x - m);
      float lse = (float)(m + std::log(s));
      for (int r = 0; r < K; ++r) row[r] = (float)lg[r] - lse;
    } else if (kind == 3) {
      for (int r = 0; r < K; ++r) row[r] = -0.5f * (float)(rng() % 6);
    } else if (kind == 4) {
      int nf = (int)(rng() % (K + 1));
      for (int r = 0; r < K; ++r) row[r] = r < nf ? -(float)(rng() % 1000) / 64.0f : -INFINITY;
    } else {
      for (int r = 0; r < K; ++r) row[r] = -std::ldexp((float)(1 + rng() % 1000), -(int)(rng() % 40));
    }
    std::sort(row.begin(), row.end(), std::greater<float>());
    for (int r = 0; r < K; ++r) {
      (*lp)[(size_t)d * K + r] = row[r];
      (*ids)[(size_t)d * K + r] = (int)(rng() % 50);
    }
  }
}

void test_tree_build(int ncases) {
  std::mt19937 rng(1234);
  int paths[3] = {0, 0, 0};  // forced parallel: adaptive threshold (path 0), estimate (3), fallback (1)
  for (int cs = 0; cs < ncases; ++cs) {
    int kind = (int)(rng() % 6);
    int D = 1 + (int)(rng() % 16);
    int B = (rng() % 4 == 0) ? (int)(rng() % 8) : 1 + (int)(rng() % 300);
    if (rng() % 12 == 0) B = 1024;
    int K = 1 + (int)(rng() % std::max(1, (rng() % 2) ? B : 40));
    std::vector<float> lp;
    std::vector<int> ids;
    make_case(rng, kind, D, K, &lp, &ids);
    RefTree ref = ref_tree(lp, ids, D, K, B);
    const int n = (int)ref.tokens.size(), W = kc::tree_vis_words(B);
    Dev<float> dlp(lp);
    Dev<int32_t> dids(std::vector<int32_t>(ids.begin(), ids.end()));
    for (int force = 0; force < 4; ++force) {  // auto, fallback, one warp, parallel (TreeArgs)
      const int cache_len = 3 + cs;
      Dev<int32_t> tok(B), dep(B), par(B + 1), pos(B + 1), nn(1), path(1);
      Dev<uint64_t> vis((size_t)(B + 1) * W);
      kc::TreeBuildParams p{};
      p.logprobs = dlp.p;
      p.token_ids = dids.p;
      p.D = D;
      p.K = K;
      p.ld = K;
      p.budget = B;
      p.cache_len = cache_len;
      p.tokens = tok.p;
      p.depths = dep.p;
      p.parents = par.p;
      p.positions = pos.p;
      p.visibility = vis.p;
      p.n_nodes = nn.p;
      p.path_taken = path.p;
      p.force_fallback = force;
      CUDA_OK(kc::tree_build(p, 0));
      CUDA_OK(cudaDeviceSynchronize());
      auto gt = tok.get(), gd = dep.get(), gp = par.get(), gpos = pos.get();
      auto gv = vis.get();
      int gn = nn.get()[0], gpath = path.get()[0];
      bool ok = gn == n && gp[0] == -1 && gpos[0] == cache_len;
      for (int i = 0; ok && i < B; ++i) {
        if (i < n)
          ok = gt[i] == ref.tokens[i] && gd[i] == ref.depths[i] && gp[i + 1] == ref.parents[i + 1] &&
               gpos[i + 1] == cache_len + ref.depths[i];
        else
          ok = gt[i] == -1 && gd[i] == 0 && gp[i + 1] == -1 && gpos[i + 1] == -1;
      }
      for (int i = 0; ok && i <= B; ++i) {
        std::vector<uint64_t> want(W, 0);
        if (i <= n) {
          int x = i;
          while (true) {
            want[x >> 6] |= 1ull << (x & 63);
            if (x == 0) break;
            x = ref.parents[x];
          }
        }
        for (int w = 0; ok && w < W; ++w) ok = gv[(size_t)i * W + w] == want[w];
      }
      if (force == 3 && B > 0) paths[gpath == 0 ? 0 : gpath == 3 ? 1 : 2]++;
      if (force == 1 || force == 2) ok = ok && (B == 0 || gpath == force);
      if (force == 0 && B > 0 && B <= kc::kTreeWarpPathMaxB) ok = ok && gpath == 2;  // auto: one warp for small budgets
      CHECK(ok);
      if (!ok) std::fprintf(stderr, "tree case %d kind %d D %d K %d B %d force %d: n %d/%d path %d\n", cs, kind, D, K, B, force, gn, n, gpath);
    }
  }
  std::printf("tree build: %d cases x 4 path choices; parallel path forced: adaptive threshold %d, estimate %d, fallback %d\n",
              ncases, paths[0], paths[1], paths[2]);
  // the parallel path (either threshold) must actually run in a good share of the cases, or the
  // comparisons above would mostly be testing the fallback
  if (ncases >= 100) CHECK(paths[0] + paths[1] > ncases / 4 && paths[1] > 0);
}

// ---------------------------------------------------------------- top-k + log-softmax
void test_topk() {
  std::mt19937 rng(7);
  struct Shape { int D, V, k; bool ties; };
  std::vector<Shape> shapes = {{3, 10, 4, false}, {2, 7, 7, false}, {4, 1, 1, false}, {5, 300, 50, true},
                               {2, 5000, 1000, true}, {16, 45000, 777, false}, {15, 70000, 16, false}};
  for (auto sh : shapes) {
    std::vector<float> x((size_t)sh.D * sh.V);
    std::normal_distribution<float> nd(0, 3);
    for (auto& v : x) v = sh.ties ? (float)((int)(rng() % 5) - 2) : nd(rng);
    Dev<float> dx(x);
    Dev<float> dlp((size_t)sh.D * sh.k);
    Dev<int32_t> dids((size_t)sh.D * sh.k);
    Dev<unsigned char> ws(kc::topk_workspace_bytes(sh.D, sh.V, sh.k));
    kc::TopkParams p{};
    p.logits = dx.p;
    p.D = sh.D;
    p.V = sh.V;
    p.ld = sh.V;
    p.k = sh.k;
    p.logprobs = dlp.p;
    p.ids = dids.p;
    p.workspace = ws.p;
    CUDA_OK(kc::topk_logsoftmax(p, 0));
    CUDA_OK(cudaDeviceSynchronize());
    auto glp = dlp.get();
    auto gid = dids.get();
    bool ok = true;
    for (int d = 0; d < sh.D && ok; ++d) {
      const float* row = &x[(size_t)d * sh.V];
      std::vector<int> idx(sh.V);
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return row[a] > row[b]; });
      double m = *std::max_element(row, row + sh.V), s = 0;
      for (int i = 0; i < sh.V; ++i) s += std::exp((double)row[i] - m);
      float lse = (float)(m + std::log(s));
      for (int j = 0; j < sh.k && ok; ++j) {
        float want = row[idx[j]] - lse;
        float got = glp[(size_t)d * sh.k + j];
        ok = gid[(size_t)d * sh.k + j] == idx[j] && std::fabs(got - want) <= std::nextafter(std::fabs(want), INFINITY) - std::fabs(want);
      }
    }
    CHECK(ok);
    if (!ok) std::fprintf(stderr, "topk D %d V %d k %d failed\n", sh.D, sh.V, sh.k);
  }
}

// ---------------------------------------------------------------- accept + compaction
void test_accept_compact() {
  std::mt19937 rng(9);
  for (int cs = 0; cs < 60; ++cs) {
    int n = (int)(rng() % 200);
    std::vector<int32_t> parents(n + 1), tokens(std::max(n, 1)), choice(n + 1);
    parents[0] = -1;
    for (int i = 1; i <= n; ++i) parents[i] = (int)(rng() % i);
    for (int i = 0; i < n; ++i) tokens[i] = (int)(rng() % 4);
    for (int i = 0; i <= n; ++i) choice[i] = (int)(rng() % 4);
    // reference walk (last match wins)
    std::vector<int> want{0};
    int cur = 0;
    while (true) {
      int nxt = -1;
      for (int c = 1; c <= n; ++c)
        if (parents[c] == cur && tokens[c - 1] == choice[cur]) nxt = c;
      if (nxt < 0) break;
      want.push_back(nxt);
      cur = nxt;
    }
    const int layers = 1 + (int)(rng() % 4), row = (cs % 2) ? 576 : 3, L = (int)(rng() % 20), S = L + n + 2;
    std::vector<float> cache((size_t)layers * S * row);
    for (auto& v : cache) v = (float)(rng() % 100000);
    std::vector<float> cwant = cache;
    for (int l = 0; l < layers; ++l)
      for (size_t j = 0; j < want.size(); ++j)
        std::memcpy(&cwant[((size_t)l * S + L + j) * row], &cwant[((size_t)l * S + L + want[j]) * row], sizeof(float) * row);
    Dev<int32_t> dt(tokens), dp(parents), dc(choice), dn(std::vector<int32_t>{n});
    Dev<int32_t> path(n + 1), count(1), bonus(1);
    kc::TreeAcceptParams a{};
    a.tokens = dt.p;
    a.parents = dp.p;
    a.choice = dc.p;
    a.n_nodes = dn.p;
    a.n_max = n;
    a.path = path.p;
    a.count = count.p;
    a.bonus = bonus.p;
    for (int fused = 0; fused < 2; ++fused) {
      Dev<float> dcache(cache);
      kc::KvCompactParams c{};
      c.cache = dcache.p;
      c.num_layers = layers;
      c.layer_stride = (long long)S * row * 4;
      c.row_stride = (long long)row * 4;
      c.row_bytes = row * 4;
      c.cache_len = L;
      c.path = path.p;
      c.count = count.p;
      if (fused) {
        CUDA_OK(kc::tree_accept_compact(a, c, 0));
      } else {
        CUDA_OK(kc::tree_accept(a, 0));
        CUDA_OK(kc::kv_compact(c, 0));
      }
      CUDA_OK(cudaDeviceSynchronize());
      int m = count.get()[0];
      auto gp = path.get();
      bool ok = m == (int)want.size() && bonus.get()[0] == choice[cur];
      for (int j = 0; ok && j < m; ++j) ok = gp[j] == want[j];
      ok = ok && dcache.get() == cwant;
      CHECK(ok);
      if (!ok) std::fprintf(stderr, "accept/compact case %d fused %d failed\n", cs, fused);
    }
  }
}

// ---------------------------------------------------------------- verify attention
void test_attention(bool small) {
  struct Sz { int L, H, B; };
  std::vector<Sz> sizes = small ? std::vector<Sz>{{17, 3, 5}, {0, 2, 1}, {130, 1, 70}}
                                : std::vector<Sz>{{0, 1, 0}, {1, 3, 1}, {17, 16, 17}, {257, 3, 63}, {4099, 2, 17}, {300, 128, 4}};
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0, 1);
  const int C = 512, R = 64;
  for (auto sz : sizes) {
    const int T = sz.B + 1, H = sz.H, L = sz.L, N = L + T, W = (T + 63) / 64;
    std::vector<float> ql((size_t)T * H * C), qr((size_t)T * H * R), kv((size_t)N * (C + R));
    for (auto& v : ql) v = nd(rng);
    for (auto& v : qr) v = nd(rng);
    for (auto& v : kv) v = nd(rng);
    std::vector<int> parents(T, -1);
    for (int i = 1; i < T; ++i) parents[i] = (int)(rng() % i);
    std::vector<uint64_t> vis((size_t)T * W, 0);
    for (int i = 0; i < T; ++i)
      for (int x = i;; x = parents[x]) {
        vis[(size_t)i * W + (x >> 6)] |= 1ull << (x & 63);
        if (x == 0) break;
      }
    const float scale = 0.0721688f;
    // float64 reference
    std::vector<double> ref((size_t)T * H * C);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) {
        const float* q = &ql[((size_t)t * H + h) * C];
        const float* qrr = &qr[((size_t)t * H + h) * R];
        std::vector<double> s(N, -INFINITY);
        double mx = -INFINITY;
        for (int j = 0; j < N; ++j) {
          if (j >= L && !((vis[(size_t)t * W + ((j - L) >> 6)] >> ((j - L) & 63)) & 1)) continue;
          double acc = 0;
          for (int c = 0; c < C; ++c) acc += (double)q[c] * kv[(size_t)j * (C + R) + c];
          for (int r = 0; r < R; ++r) acc += (double)qrr[r] * kv[(size_t)j * (C + R) + C + r];
          s[j] = acc * scale;
          mx = std::max(mx, s[j]);
        }
        double l = 0;
        std::vector<double> o(C, 0.0);
        for (int j = 0; j < N; ++j) {
          if (s[j] == -INFINITY) continue;
          double pj = std::exp(s[j] - mx);
          l += pj;
          for (int c = 0; c < C; ++c) o[c] += pj * kv[(size_t)j * (C + R) + c];
        }
        for (int c = 0; c < C; ++c) ref[((size_t)t * H + h) * C + c] = o[c] / l;
      }
    Dev<float> dql(ql), dqr(qr), dkv(kv);
    Dev<uint64_t> dvis(vis);
    // variants: 0 auto, 1 plain kernel, 2 three splits, 3 split-KV forced, 4 split-KV with 5
    // splits, 5 auto with L through a device int under an upper bound (graph mode), 6 tiled
    // forced with 3 splits and a device L, 7 split-KV with 7 splits and a device L, 8 tensor cores
    // forced, 9 tensor cores with 4 splits and a device L
    Dev<int> dL(std::vector<int>{L});
    for (int variant = 0; variant < 10; ++variant) {
      Dev<float> out((size_t)T * H * C);
      kc::VerifyAttentionParams p{};
      p.q_latent = dql.p;
      p.q_rope = dqr.p;
      p.kv = dkv.p;
      p.kv_stride = C + R;
      p.visibility = dvis.p;
      p.vis_stride = W;
      p.T = T;
      p.H = H;
      p.C = C;
      p.R = R;
      p.L = L;
      p.scale = scale;
      p.out = out.p;
      p.force_naive = variant == 1;
      p.force_splits = variant == 2 || variant == 6 ? 3 : variant == 4 ? 5 : variant == 7 ? 7 : variant == 9 ? 4 : 0;
      p.force_kernel = variant == 3 || variant == 4 || variant == 7 ? 2 : variant == 6 ? 1 : variant >= 8 ? 4 : 0;
      if (variant >= 5 && variant != 8) {
        p.L_dev = dL.p;
        p.L = L + (variant == 5 ? 1000 : 300);
      }
      Dev<unsigned char> ws(kc::verify_attention_workspace_bytes(p));  // poisoned
      p.workspace = ws.p;
      CUDA_OK(kc::verify_attention(p, 0));
      CUDA_OK(cudaDeviceSynchronize());
      auto got = out.get();
      double num = 0, den = 0;
      bool finite = true;
      for (size_t i = 0; i < got.size(); ++i) {
        finite = finite && std::isfinite(got[i]);
        num += (got[i] - ref[i]) * (got[i] - ref[i]);
        den += ref[i] * ref[i];
      }
      double rel = std::sqrt(num / std::max(den, 1e-300));
      CHECK(finite && rel < 1e-5);
      if (!(finite && rel < 1e-5))
        std::fprintf(stderr, "attention L %d H %d B %d variant %d: rel %.3g finite %d\n", L, H, sz.B, variant, rel, (int)finite);
    }
  }
}

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  const char* e = std::getenv("KDTREE_CUDA_TEST_CASES");
  const int ncases = e ? std::atoi(e) : 400;
  const char* sm = std::getenv("KDTREE_CUDA_TEST_SMALL");
  const bool small = sm && std::atoi(sm) != 0;
  test_tree_build(ncases);
  test_topk();
  test_accept_compact();
  test_attention(small);
  TEST_MAIN_END();
}
#endif
