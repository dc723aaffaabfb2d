// test_cpu_model.cpp: the CPU target model (cpp/model/) against golden data written by
// tests/golden/golden_model.py (NumPy reference logits of tiny random models), replaying
// prefill -> tree verify -> commit(path) -> decode; plus the SGEMM paths (portable kernel vs a
// double-precision triple loop, and vs CBLAS when built) and the model's argument checks.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "kdtr.h"
#include "model/cpu_model.h"
#include "model/parallel.h"
#include "model/sgemm.h"

using kdtree::KdtrFile;

namespace {

int64_t cfg_int(const KdtrFile& f, const std::string& key) { return f.at("cfg." + key).as<int64_t>()[0]; }
double cfg_f64(const KdtrFile& f, const std::string& key) { return f.at("cfg." + key).as<double>()[0]; }

kdtree::ModelConfig config_of(const KdtrFile& f) {
  kdtree::ModelConfig c;
  c.vocab_size = cfg_int(f, "vocab_size");
  c.hidden_size = cfg_int(f, "hidden_size");
  c.intermediate_size = cfg_int(f, "intermediate_size");
  c.moe_intermediate_size = cfg_int(f, "moe_intermediate_size");
  c.num_hidden_layers = cfg_int(f, "num_hidden_layers");
  c.num_attention_heads = cfg_int(f, "num_attention_heads");
  c.n_routed_experts = cfg_int(f, "n_routed_experts");
  c.n_shared_experts = cfg_int(f, "n_shared_experts");
  c.num_experts_per_tok = cfg_int(f, "num_experts_per_tok");
  c.n_group = cfg_int(f, "n_group");
  c.topk_group = cfg_int(f, "topk_group");
  c.first_k_dense_replace = cfg_int(f, "first_k_dense_replace");
  c.q_lora_rank = cfg_int(f, "q_lora_rank");
  c.kv_lora_rank = cfg_int(f, "kv_lora_rank");
  c.qk_nope_head_dim = cfg_int(f, "qk_nope_head_dim");
  c.qk_rope_head_dim = cfg_int(f, "qk_rope_head_dim");
  c.v_head_dim = cfg_int(f, "v_head_dim");
  c.norm_topk_prob = cfg_int(f, "norm_topk_prob") != 0;
  c.rope_interleave = cfg_int(f, "rope_interleave") != 0;
  c.tie_word_embeddings = cfg_int(f, "tie_word_embeddings") != 0;
  c.routed_scaling_factor = cfg_f64(f, "routed_scaling_factor");
  c.rms_norm_eps = cfg_f64(f, "rms_norm_eps");
  c.latent_norm_eps = cfg_f64(f, "latent_norm_eps");
  c.softmax_scale = cfg_f64(f, "softmax_scale");
  c.rope_attention_factor = cfg_f64(f, "rope_attention_factor");
  const kdtree::KdtrTensor& inv = f.at("cfg.rope_inv_freq");
  c.rope_inv_freq.assign(inv.as<float>(), inv.as<float>() + inv.numel());
  return c;
}

// max |got - want| / max |want|
double rel_err(const std::vector<float>& got, const kdtree::KdtrTensor& want) {
  const float* w = want.as<float>();
  double err = 0, scale = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    err = std::max(err, std::fabs((double)got[(size_t)i] - w[i]));
    scale = std::max(scale, std::fabs((double)w[i]));
    if (std::isnan(got[(size_t)i])) return INFINITY;
  }
  return err / scale;
}

void golden_model(const std::string& name) {
  KdtrFile f = KdtrFile::open(kdtest::golden_path("model_" + name + ".kdtr"));
  kdtree::ModelConfig cfg = config_of(f);
  const int64_t V = cfg.vocab_size;
  kdtree::CpuModel m(cfg, 64);
  int set = 0;
  for (const kdtree::KdtrTensor& t : f.tensors()) {
    if (t.name.rfind("w.", 0) != 0) continue;
    m.set_weight(t.name.substr(2), t.as<float>(), t.shape);
    ++set;
  }
  CHECK(set == (int)kdtree::model_weight_specs(cfg).size());
  CHECK(m.missing_weights().empty());
  m.finalize();

  // 1. prefill (causal), commit all
  const kdtree::KdtrTensor& pt = f.at("prefill.tokens");
  const int64_t P = pt.numel();
  std::vector<int32_t> pos(P), all(P);
  for (int64_t i = 0; i < P; ++i) pos[i] = all[i] = (int32_t)i;
  std::vector<float> logits(P * V, NAN);
  m.forward(pt.as<int32_t>(), pos.data(), nullptr, P, logits.data());
  const double e1 = rel_err(logits, f.at("prefill.logits"));
  std::printf("%s prefill: rel err %.3g\n", name.c_str(), e1);
  CHECK(e1 < 1e-4);
  m.commit(all.data(), P);
  CHECK(m.cache_len() == P);

  // 2. tree verify, commit the path
  const kdtree::KdtrTensor& tt = f.at("tree.tokens");
  const int64_t n = tt.numel();
  std::vector<float> tl(n * V, NAN);
  m.forward(tt.as<int32_t>(), f.at("tree.positions").as<int32_t>(), f.at("tree.visibility").as<uint8_t>(), n,
            tl.data());
  const double e2 = rel_err(tl, f.at("tree.logits"));
  std::printf("%s tree verify: rel err %.3g\n", name.c_str(), e2);
  CHECK(e2 < 1e-4);
  CHECK(m.cache_len() == P && m.pending_len() == n);
  const kdtree::KdtrTensor& keep = f.at("tree.keep");
  m.commit(keep.as<int32_t>(), keep.numel());
  CHECK(m.cache_len() == P + keep.numel());

  // 3. decode after compaction
  std::vector<float> dl(V, NAN);
  const int32_t zero_keep = 0;
  const int32_t dpos = (int32_t)m.cache_len();
  m.forward(f.at("decode.token").as<int32_t>(), &dpos, nullptr, 1, dl.data());
  const double e3 = rel_err(dl, f.at("decode.logits"));
  std::printf("%s decode after commit: rel err %.3g\n", name.c_str(), e3);
  CHECK(e3 < 1e-4);

  // 4. truncate back to the prompt minus its last token and decode that token again: the
  //    prefill's last row (rolls back the tree path and the last prompt entry, recomputes nothing)
  m.commit(nullptr, 0);
  m.truncate(P - 1);
  CHECK(m.cache_len() == P - 1 && m.pending_len() == 0);
  const int32_t lpos = (int32_t)(P - 1);
  m.forward(pt.as<int32_t>() + (P - 1), &lpos, nullptr, 1, dl.data());
  std::vector<float> last(logits.end() - V, logits.end());
  double e4 = 0;
  for (int64_t i = 0; i < V; ++i) e4 = std::max(e4, (double)std::fabs(dl[(size_t)i] - last[(size_t)i]));
  std::printf("%s decode after truncate: max abs diff to prefill %.3g\n", name.c_str(), e4);
  CHECK(e4 < 1e-4);
  m.commit(&zero_keep, 1);
  CHECK(m.cache_len() == P);
  CHECK_THROWS(m.truncate(P + 1));
  CHECK_THROWS(m.truncate(-1));
  CHECK(m.cache_len() == P);

  // Argument checks: overflow, bad tokens / positions, bad keep.
  std::vector<int32_t> big(64, 1), bigpos(64, 0);
  std::vector<float> out(64 * V);
  CHECK_THROWS(m.forward(big.data(), bigpos.data(), nullptr, 64, out.data()));
  int32_t bad_tok = (int32_t)V, zero = 0, neg = -1;
  CHECK_THROWS(m.forward(&bad_tok, &zero, nullptr, 1, out.data()));
  CHECK_THROWS(m.forward(&zero, &neg, nullptr, 1, out.data()));
  const int32_t epos = (int32_t)m.cache_len();
  m.forward(&zero, &epos, nullptr, 1, out.data());
  int32_t twice[2] = {0, 0};
  CHECK_THROWS(m.commit(twice, 2));
  int32_t past = 1;
  CHECK_THROWS(m.commit(&past, 1));
  CHECK_THROWS(m.set_weight("model.norm.weight", out.data(), {cfg.hidden_size + 1}));
  CHECK_THROWS(m.set_weight("no.such.weight", out.data(), {1}));
  m.reset();
  CHECK(m.cache_len() == 0 && m.pending_len() == 0);
}

// C = alpha * A @ op(B) + beta * C in double, the oracle for both SGEMM paths.
void naive(bool tb, int64_t M, int64_t N, int64_t K, float alpha, const std::vector<float>& A,
           const std::vector<float>& B, float beta, std::vector<double>& C) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += (double)A[i * K + k] * (tb ? B[j * K + k] : B[k * N + j]);
      C[i * N + j] = alpha * s + beta * C[i * N + j];
    }
}

void sgemm_paths() {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  const int64_t sizes[][3] = {{1, 1, 1}, {1, 300, 70}, {3, 17, 5}, {4, 65, 33}, {5, 16, 256},
                              {7, 33, 257}, {64, 48, 96}, {200, 130, 300}, {385, 17, 9}};
  for (const auto& s : sizes) {
    const int64_t M = s[0], N = s[1], K = s[2];
    for (int tb = 0; tb < 2; ++tb) {
      std::vector<float> A(M * K), B(N * K), C0(M * N);
      for (float& x : A) x = nd(rng);
      for (float& x : B) x = nd(rng);
      for (float& x : C0) x = nd(rng);
      for (int variant = 0; variant < 2; ++variant) {
        const float alpha = variant ? 0.75f : 1.f, beta = variant ? -0.5f : 0.f;
        std::vector<double> want(C0.begin(), C0.end());
        naive(tb, M, N, K, alpha, A, B, beta, want);
        for (int path = 0; path < 2; ++path) {
          std::vector<float> C = C0;
          if (beta == 0.f) std::fill(C.begin(), C.end(), NAN);  // beta == 0 must not read C
          if (path == 0)
            kdtree::sgemm_portable(tb, M, N, K, alpha, A.data(), K, B.data(), tb ? K : N, beta, C.data(), N);
          else
            kdtree::sgemm(tb, M, N, K, alpha, A.data(), K, B.data(), tb ? K : N, beta, C.data(), N);
          double err = 0;
          for (int64_t i = 0; i < M * N; ++i) err = std::max(err, std::fabs(C[i] - want[i]));
          if (std::isnan(err) || err > 1e-4 * std::sqrt((double)K) * 4) {
            std::fprintf(stderr, "sgemm %s M=%lld N=%lld K=%lld tb=%d variant=%d: err %g\n",
                         path ? kdtree::sgemm_backend() : "portable", (long long)M, (long long)N, (long long)K, tb,
                         variant, err);
            CHECK(false);
          } else {
            CHECK(true);
          }
        }
      }
    }
  }
  // Strided operands (lda/ldb/ldc larger than the row), as the attention calls use them.
  const int64_t M = 9, N = 21, K = 35, ld = 50;
  std::vector<float> A(M * ld), B(N * ld), C(M * ld, 0.f), Cp(M * ld, 0.f);
  for (float& x : A) x = nd(rng);
  for (float& x : B) x = nd(rng);
  kdtree::sgemm(true, M, N, K, 1.f, A.data(), ld, B.data(), ld, 0.f, C.data(), ld);
  kdtree::sgemm_portable(true, M, N, K, 1.f, A.data(), ld, B.data(), ld, 0.f, Cp.data(), ld);
  double err = 0;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += (double)A[i * ld + k] * B[j * ld + k];
      err = std::max(err, std::max(std::fabs(C[i * ld + j] - s), std::fabs(Cp[i * ld + j] - s)));
    }
  CHECK(err < 1e-4);
  CHECK(C[N] == 0.f && Cp[N] == 0.f);  // the padding past N is untouched
}

// sgemm_rows_exact: each output the same bits whatever M and N (the CPU model's row-exact windows,
// docs/MODEL.md): columns [0, 129) of every call against B[:N] (N = 120 .. 139, both layouts) and rows
// 1 .. 13 and 150 (past sgemm's own skinny border of 128 rows) against the one-row call over 129 columns.
// Where the CPU has no skinny kernels it is plain sgemm and promises nothing: skipped.
void sgemm_rows_exact_bits() {
  if (std::string(kdtree::sgemm_skinny_isa()) == "none") return;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  const int64_t K = 160, Nmax = 140, Mmax = 150;
  std::vector<float> A(Mmax * K), B(Nmax * K);
  for (float& x : A) x = nd(rng);
  for (float& x : B) x = nd(rng);
  for (int tb = 0; tb < 2; ++tb) {
    // tb: B [N, K] (the scores against the cache rows); else B [K, Nmax] used as [K, N] (P @ latent, ldb = Nmax)
    std::vector<float> ref(129);
    kdtree::sgemm_rows_exact(tb, 1, 129, K, 0.5f, A.data(), K, B.data(), tb ? K : Nmax, 0.f, ref.data(), 129);
    for (int64_t N = 120; N < Nmax; ++N)
      for (int64_t M : {1, 2, 3, 5, 7, 13, 150}) {
        std::vector<float> C(M * N);
        kdtree::sgemm_rows_exact(tb, M, N, K, 0.5f, A.data(), K, B.data(), tb ? K : Nmax, 0.f, C.data(), N);
        std::vector<float> last(N);  // the last row alone
        kdtree::sgemm_rows_exact(tb, 1, N, K, 0.5f, A.data() + (M - 1) * K, K, B.data(), tb ? K : Nmax, 0.f,
                                 last.data(), N);
        for (int64_t j = 0; j < N; ++j)
          if ((j < 129 && C[j] != ref[j]) || C[(M - 1) * N + j] != last[j]) {
            std::fprintf(stderr, "sgemm_rows_exact tb=%d M=%lld N=%lld: column %lld differs from a 1-row call\n", tb,
                         (long long)M, (long long)N, (long long)j);
            CHECK(false);
            return;
          }
      }
  }
  CHECK(true);
}

// BF16 weights (sgemm_bf16_weights): bit for bit what sgemm(trans_b, ...) gives on the same weights
// widened to FP32, wherever it takes the call (few rows, AVX2), both layouts (W [N, K] and W [K, N]),
// with strides, k and column tails, alpha / beta, one to 130 rows (above 128 only when the weight is
// small); where it declines it leaves C alone and returns false.
void sgemm_bf16() {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  auto bf16 = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return (uint16_t)(u >> 16);
  };
  auto widen = [](uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  };
  const int64_t sizes[][3] = {{1, 1, 1},   {1, 300, 70},  {1, 4096, 320}, {2, 17, 5},    {3, 64, 320},
                              {9, 1024, 320}, {9, 21, 35}, {17, 256, 128}, {33, 160, 96}, {130, 40, 64}};
  int taken = 0;
  for (const bool tb : {true, false}) {
    for (const auto& s : sizes) {
      const int64_t M = s[0], N = s[1], K = s[2], lda = K + 3, ldb = tb ? K + 5 : N + 5, ldc = N + 2;
      const int64_t wrows = tb ? N : K;
      std::vector<float> A(M * lda), Wf(wrows * ldb), C0(M * ldc);
      std::vector<uint16_t> Wb(wrows * ldb);
      for (float& x : A) x = nd(rng);
      for (int64_t i = 0; i < wrows * ldb; ++i) {
        Wb[i] = bf16(nd(rng));
        Wf[i] = widen(Wb[i]);
      }
      for (float& x : C0) x = nd(rng);
      for (int variant = 0; variant < 2; ++variant) {
        const float alpha = variant ? 0.75f : 1.f, beta = variant ? -0.5f : 0.f;
        std::vector<float> want = C0, got = C0;
        kdtree::sgemm(tb, M, N, K, alpha, A.data(), lda, Wf.data(), ldb, beta, want.data(), ldc);
        const bool ok =
            kdtree::sgemm_bf16_weights(M, N, K, alpha, A.data(), lda, Wb.data(), ldb, beta, got.data(), ldc, tb);
        if (ok) {
          ++taken;
          const bool same = std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) == 0;
          if (!same)
            std::fprintf(stderr, "sgemm_bf16_weights trans_b=%d M=%lld N=%lld K=%lld variant=%d differs from sgemm\n",
                         (int)tb, (long long)M, (long long)N, (long long)K, variant);
          CHECK(same);
        } else {
          CHECK(std::memcmp(C0.data(), got.data(), C0.size() * sizeof(float)) == 0);
        }
      }
    }
  }
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) CHECK(taken == 40);
#endif
}

// The pool of parallel.h: every chunk runs exactly once, also with nested calls and with two
// callers at once (one of them then runs alone).
void parallel_pool() {
  for (int64_t n : {0, 1, 2, 7, 64, 1000}) {
    std::vector<int> hits((size_t)n, 0);
    auto f = [&](int64_t i) { hits[(size_t)i]++; };
    kdtree::parallel_chunks(n, f);
    CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
  }
  std::vector<std::atomic<int>> inner(16 * 16);
  auto outer = [&](int64_t i) {
    auto g = [&](int64_t j) { inner[(size_t)(i * 16 + j)]++; };
    kdtree::parallel_chunks(16, g);
  };
  kdtree::parallel_chunks(16, outer);
  CHECK(std::all_of(inner.begin(), inner.end(), [](const std::atomic<int>& h) { return h.load() == 1; }));
  std::vector<std::atomic<int>> hits(2 * 5000);
  auto caller = [&](int which) {
    for (int rep = 0; rep < 50; ++rep) {
      auto f = [&](int64_t i) { hits[(size_t)(which * 5000 + rep * 100 + i)]++; };
      kdtree::parallel_chunks(100, f);
    }
  };
  std::thread a(caller, 0), b(caller, 1);
  a.join();
  b.join();
  CHECK(std::all_of(hits.begin(), hits.end(), [](const std::atomic<int>& h) { return h.load() == 1; }));
  CHECK(kdtree::parallel_threads() >= 1);
}

void config_checks() {
  kdtree::ModelConfig c;
  CHECK_THROWS(c.validate());  // all zero
  CHECK_THROWS(kdtree::CpuModel(c, 16));
}

}  // namespace

int main() {
  // the skinny kernels of every vector ISA this CPU has (AVX2; AVX-512 where present), then the default
  const std::string isa0 = kdtree::sgemm_skinny_isa();
  for (const char* isa : {"avx2", "avx512"}) {
    if (!kdtree::sgemm_set_skinny_isa(isa)) continue;
    CHECK(std::string(kdtree::sgemm_skinny_isa()) == isa);
    std::printf("skinny ISA %s\n", isa);
    sgemm_paths();
    sgemm_bf16();
    sgemm_rows_exact_bits();
  }
  if (isa0 != "none") CHECK(kdtree::sgemm_set_skinny_isa(isa0.c_str()));
  parallel_pool();
  config_checks();
  std::ifstream list(kdtest::golden_path("model_configs.txt"));
  std::string name;
  int n = 0;
  while (std::getline(list, name))
    if (!name.empty()) {
      golden_model(name);
      ++n;
    }
  CHECK(n >= 2);
  std::printf("sgemm backend: %s\n", kdtree::sgemm_backend());
  TEST_MAIN_END();
}
