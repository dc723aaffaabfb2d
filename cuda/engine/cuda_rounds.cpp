// cuda_rounds.cpp: see cuda_rounds.h.
#if defined(KDTREE_HAVE_CUBLAS)
#include "engine/cuda_rounds.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "common.h"
#include "device_util.h"
#include "engine/choose_kernels.h"
#include "engine/round_kernels.h"
#include "kernels.h"
#include "model/model_kernels.h"

namespace kdtree {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
std::string s(int64_t v) { return std::to_string(v); }
constexpr int64_t kMaxDepth = cuda::kTreeMaxDepth;  // 16
constexpr int64_t kMaxK = cuda::kTopkMaxK;          // 1024

using cuda::Arena;
using cuda::DeviceGuard;
}  // namespace

void CudaRounds::check(int err, const char* what) const {
  if (err != cudaSuccess)
    throw RuntimeFailure(std::string("GPU round: ") + what + ": " + cudaGetErrorString(static_cast<cudaError_t>(err)));
}

CudaRounds::CudaRounds(CudaModel& model) : model_(model) {
  V_ = model.config().vocab_size;
  max_chunk_ = model.max_tokens();
  max_budget_ = std::min<int64_t>(cuda::kTreeMaxBudget, model.max_tokens() - 1);
  KD_CHECK(V_ <= cuda::kTopkMaxV, "GPU round: vocab " + s(V_) + " above the device top-k limit " + s(cuda::kTopkMaxV));
  const int64_t Bm = std::max<int64_t>(max_budget_, 0);
  const int64_t W = cuda::tree_vis_words((int)Bm);
  // draft block: logits [d, V], or log-probs [d, k] followed by ids [d, k] (one upload)
  const int64_t vals = std::max<int64_t>(kMaxDepth * V_, 2 * kMaxDepth * kMaxK);
  const int64_t npos = std::max<int64_t>(Bm + 1, max_chunk_);
  Arena dev;
  dev.add(&d_draft_, vals);
  dev.add(reinterpret_cast<char**>(&d_topk_ws_),
          (int64_t)cuda::tree_from_logits_workspace_bytes((int)kMaxDepth, (int)V_, (int)std::min<int64_t>(kMaxK, V_)));
  dev.add(&d_tokens_, Bm + 1);
  dev.add(&d_depths_, std::max<int64_t>(Bm, 1));
  dev.add(&d_parents_, Bm + 1);
  dev.add(&d_positions_, npos);
  dev.add(&d_vis_, (Bm + 1) * W);
  dev.add(&d_n_, 1);
  dev.add(&d_choice_, Bm + 1);
  dev.add(&d_path_, Bm + 1);
  dev.add(&d_count_, 1);
  dev.add(&d_bonus_, 1);
  dev.add(&d_result_, 3 + Bm + 1);
  dev.add(&d_prompt_, max_chunk_);
  dev.add(&d_ids_, kMaxDepth * kMaxK);
  dev.add(&d_dstats_, 2 * kMaxDepth);
  Arena host;
  host.add(&h_draft_, vals);
  host.add(&h_small_, 2 * npos + 1);
  host.add(&h_result_, 3 + Bm + 1);
  host.add(&h_dstats_, 2 * kMaxDepth);
  DeviceGuard guard(model.device_ordinal());
  const std::string err = cuda::alloc_device_and_pinned(dev.bytes, &dev_mem_, host.bytes, &host_mem_);
  if (!err.empty()) throw RuntimeFailure("GPU round: workspace: " + err);
  cudaError_t e = cudaSuccess;
  dev.commit(dev_mem_);
  host.commit(host_mem_);
  void** events[3] = {&ev_fwd_[0], &ev_fwd_[1], &ev_wait_};
  for (int i = 0; i < 3; ++i) {
    cudaEvent_t ce = nullptr;
    e = i < 2 ? cudaEventCreate(&ce) : cudaEventCreateWithFlags(&ce, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      cudaGetLastError();
      for (int j = 0; j < i; ++j) cudaEventDestroy(static_cast<cudaEvent_t>(*events[j]));
      cudaFreeHost(host_mem_);
      cudaFree(dev_mem_);
      host_mem_ = dev_mem_ = nullptr;
      ev_fwd_[0] = ev_fwd_[1] = ev_wait_ = nullptr;
      throw RuntimeFailure(std::string("GPU round: cudaEventCreate: ") + cudaGetErrorString(e));
    }
    *events[i] = ce;
  }
  check(cudaMemset(dev_mem_, 0, (size_t)dev.bytes), "cudaMemset");
}

CudaRounds::~CudaRounds() {
  DeviceGuard guard(model_.device_ordinal());
  if (dev_mem_ || host_mem_) cudaStreamSynchronize(static_cast<cudaStream_t>(model_.stream()));
  for (void* e : {ev_fwd_[0], ev_fwd_[1], ev_wait_})
    if (e) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  if (host_mem_) cudaFreeHost(host_mem_);
  if (dev_mem_) cudaFree(dev_mem_);
  cudaGetLastError();
}

void CudaRounds::begin(const GenerateParams& p) {
  KD_CHECK(p.depth <= kMaxDepth, "device='cuda': depth must be <= " + s(kMaxDepth) + " (the GPU tree build), got " + s(p.depth));
  KD_CHECK(p.tree_budget <= max_budget_, "device='cuda': tree_budget must be <= " + s(max_budget_) +
                                             " (min(1024, the model's max_tokens - 1)), got " + s(p.tree_budget));
  KD_CHECK(p.top_k <= kMaxK, "device='cuda': top_k must be <= " + s(kMaxK) + ", got " + s(p.top_k));
  KD_CHECK(model_.finalized(), "model: generate before finalize() (weights not complete)");
  check_sampling_params(p.sampling);
  sampling_ = p.sampling;
  dev_root_ = -1;
}

void CudaRounds::sync_result(int64_t words) {
  cudaStream_t st = static_cast<cudaStream_t>(model_.stream());
  check(cudaMemcpyAsync(h_result_, d_result_, (size_t)words * sizeof(int32_t), cudaMemcpyDeviceToHost, st),
        "copy the round's result back");
  check(cudaStreamSynchronize(st), "round");
}

namespace {
cudaError_t choose(const float* logits, int64_t T, int64_t V, const int32_t* positions, const SamplingParams& sp,
                   int32_t* out, cudaStream_t st) {
  cuda::ChooseParams cp{};
  cp.logits = logits;
  cp.T = (int)T;
  cp.V = (int)V;
  cp.ldl = V;
  cp.positions = positions;
  cp.temperature = sp.temperature;
  cp.top_k = sp.top_k;
  cp.top_p = sp.top_p;
  cp.seed = sp.seed;
  cp.choice = out;
  return cuda::choose_tokens(cp, st);
}
}  // namespace

void CudaRounds::check_device_draft(DraftOutput& draft, int64_t vocab) {
  DeviceGuard guard(model_.device_ordinal());
  cudaStream_t st = static_cast<cudaStream_t>(model_.stream());
  const int64_t d = draft.d, k = draft.k;
  KD_CHECK(d >= 1 && d <= kMaxDepth, "GPU round: a device draft of " + s(d) + " rows (1.." + s(kMaxDepth) + ")");
  KD_CHECK(draft.is_logits ? k == vocab : (k >= 1 && k <= kMaxK && draft.device_ids != nullptr),
           "GPU round: a device draft of " + s(k) + " columns");
  // the producer's work first
  if (draft.device_wait_kind == 0) {
    check(cudaDeviceSynchronize(), "wait for the drafter's device work");
  } else if (draft.device_wait_kind == 1) {
    const unsigned long long h = draft.device_wait_stream;
    cudaStream_t producer = h == 1 ? cudaStreamLegacy : h == 2 ? cudaStreamPerThread : reinterpret_cast<cudaStream_t>(h);
    cudaEvent_t ev = static_cast<cudaEvent_t>(ev_wait_);
    check(cudaEventRecord(ev, producer), "wait for the drafter's stream (cudaEventRecord)");
    check(cudaStreamWaitEvent(st, ev, 0), "wait for the drafter's stream (cudaStreamWaitEvent)");
  }
  cuda::DraftCheckParams cp{};
  cp.values = draft.device_values;
  cp.ids = draft.is_logits ? nullptr : draft.device_ids;
  cp.ids_bytes = draft.device_ids_bytes;
  cp.d = (int)d;
  cp.k = (int)k;
  cp.vocab = (int)vocab;
  cp.ids_out = d_ids_;
  cp.stats = d_dstats_;
  check(cuda::draft_check(cp, st), "draft_check");
  check(cudaMemcpyAsync(h_dstats_, d_dstats_, sizeof(int32_t) * 2 * (size_t)d, cudaMemcpyDeviceToHost, st),
        "copy the draft's checks back");
  check(cudaStreamSynchronize(st), "draft_check");
  for (int64_t r = 0; r < d; ++r) {
    const int32_t f = h_dstats_[2 * r];
    if (f == 0) continue;
    const int64_t code = cuda::kDraftFaultBase - (int64_t)f, j = code >> 2, kind = code & 3;
    if (draft.is_logits)
      throw Error(std::string(kind == 0 ? "drafter logits contain NaN" : "drafter logits contain +inf") + " (row " +
                  s(r) + ")");
    const std::string at = "(row " + s(r) + ", column " + s(j) + ")";
    if (kind == 0) throw Error("drafter logprobs contain NaN " + at);
    if (kind == 1) throw Error("drafter logprobs contain +inf " + at);
    if (kind == 3) throw Error("drafter logprobs row " + s(r) + " is not sorted in descending order (column " + s(j) + ")");
    int64_t id = 0;  // the offending id, for the message
    const char* src = static_cast<const char*>(draft.device_ids) + (size_t)(r * k + j) * draft.device_ids_bytes;
    if (draft.device_ids_bytes == 8) {
      check(cudaMemcpy(&id, src, 8, cudaMemcpyDeviceToHost), "read a token id");
    } else {
      int32_t v = 0;
      check(cudaMemcpy(&v, src, 4, cudaMemcpyDeviceToHost), "read a token id");
      id = v;
    }
    throw Error("drafter token id " + s(id) + " outside the vocab [0, " + s(vocab) + ") " + at);
  }
  draft.row_finite.resize(static_cast<size_t>(d));
  for (int64_t r = 0; r < d; ++r) draft.row_finite[r] = h_dstats_[2 * r + 1];
  draft.device_checked = true;
}

void CudaRounds::device_draft_to_host(DraftOutput& draft, int64_t k) {
  KD_CHECK(draft.device_values != nullptr && draft.device_checked && draft.d >= 1 && draft.d <= kMaxDepth,
           "GPU round: device_draft_to_host without a checked device draft");
  DeviceGuard guard(model_.device_ordinal());
  cudaStream_t st = static_cast<cudaStream_t>(model_.stream());
  const int64_t d = draft.d;
  int64_t kk = draft.k;
  const int32_t* ids_d = d_ids_;  // a log-prob draft's ids as int32 (check_device_draft; what round() reads too)
  if (draft.is_logits) {
    kk = std::min<int64_t>(std::min<int64_t>(k, V_), kMaxK);
    KD_CHECK(kk >= 1, "GPU round: top-k of a device logits draft must be >= 1");
    // log-probs [d, kk] then ids [d, kk] into d_draft_: the layout of a host draft's upload block
    cuda::TopkParams tp{};
    tp.logits = draft.device_values;
    tp.D = (int)d;
    tp.V = (int)V_;
    tp.ld = (int)V_;
    tp.k = (int)kk;
    tp.logprobs = d_draft_;
    tp.ids = reinterpret_cast<int32_t*>(d_draft_ + d * kk);
    tp.workspace = d_topk_ws_;  // sized for 16 rows at the largest k: covers any smaller call
    check(cuda::topk_logsoftmax(tp, st), "topk_logsoftmax (device draft for the adaptive budget)");
    check(cudaMemcpyAsync(h_draft_, d_draft_, (size_t)(2 * d * kk) * sizeof(float), cudaMemcpyDeviceToHost, st),
          "copy the draft's top-k back");
  } else {
    check(cudaMemcpyAsync(h_draft_, draft.device_values, (size_t)(d * kk) * sizeof(float), cudaMemcpyDeviceToHost, st),
          "copy the draft's log-probs back");
    check(cudaMemcpyAsync(h_draft_ + d * kk, ids_d, (size_t)(d * kk) * sizeof(int32_t), cudaMemcpyDeviceToHost, st),
          "copy the draft's ids back");
  }
  check(cudaStreamSynchronize(st), "device draft to host");
  const int ok = draft.device_ok;
  draft.clear();  // (releases a Python producer's arrays: nothing reads them after the synchronisation;
                  // the vectors keep their capacity, so a warm loop allocates nothing here)
  draft.device_ok = ok;
  draft.d = d;
  draft.k = kk;
  draft.is_logits = false;
  const int32_t* h_ids = reinterpret_cast<const int32_t*>(h_draft_ + d * kk);
  draft.values.assign(h_draft_, h_draft_ + d * kk);
  draft.ids.assign(h_ids, h_ids + d * kk);
}

int32_t CudaRounds::prefill(const int32_t* prompt, int64_t P, int64_t chunk, int64_t keep) {
  KD_CHECK(keep >= 0 && keep < P, "GPU prefill: keep must be in [0, P)");
  DeviceGuard guard(model_.device_ordinal());
  cudaStream_t st = static_cast<cudaStream_t>(model_.stream());
  if (keep > 0)
    model_.truncate(keep);  // prefix reuse: the first `keep` entries are prompt[0, keep)'s already
  else
    model_.reset();
  chunk = std::min(chunk, max_chunk_);
  float* logits = model_.logits_device();
  for (int64_t c0 = keep; c0 < P; c0 += chunk) {
    const int64_t T = std::min(chunk, P - c0);
    // The previous chunk's copies have finished (forward_device is ordered on the stream, but
    // the pinned staging is reused): wait for them before overwriting.
    if (c0 > keep) check(cudaStreamSynchronize(st), "prefill");
    int32_t* h_tok = h_small_;
    int32_t* h_pos = h_small_ + max_chunk_;
    std::memcpy(h_tok, prompt + c0, (size_t)T * sizeof(int32_t));
    for (int64_t i = 0; i < T; ++i) h_pos[i] = (int32_t)(c0 + i);
    check(cudaMemcpyAsync(d_prompt_, h_tok, (size_t)T * sizeof(int32_t), cudaMemcpyHostToDevice, st), "upload prompt");
    check(cudaMemcpyAsync(d_positions_, h_pos, (size_t)T * sizeof(int32_t), cudaMemcpyHostToDevice, st), "upload positions");
    // only the prompt's last token's logits are used: the LM head runs for it alone (earlier chunks: none)
    const bool last = c0 + T == P;
    model_.forward_device(d_prompt_, d_positions_, nullptr, 0, T, logits, last ? 1 : 0);
    model_.set_committed(T);  // causal window kept whole: nothing to compact
    if (last) {
      check(choose(logits, 1, V_, d_positions_ + (T - 1), sampling_, d_tokens_, st), "choose_tokens");
      check(cudaMemcpyAsync(h_result_, d_tokens_, sizeof(int32_t), cudaMemcpyDeviceToHost, st), "copy the first token");
      check(cudaStreamSynchronize(st), "prefill");
      dev_root_ = h_result_[0];  // choose wrote it to d_tokens_[0]: the first round's root
    }
  }
  return h_result_[0];
}

void CudaRounds::round(const RoundRequest& rq, RoundResult& out) {
  DeviceGuard guard(model_.device_ordinal());
  cudaStream_t st = static_cast<cudaStream_t>(model_.stream());
  auto t0 = Clock::now();
  const DraftOutput* draft = rq.draft;
  const int64_t n = (draft && draft->d > 0) ? rq.nodes : 0, T = n + 1, L = rq.L;
  KD_CHECK(n <= max_budget_, "GPU round: " + s(n) + " tree nodes above the budget limit " + s(max_budget_));

  // root token (node 0): on the device already unless the request names another one
  if (rq.root != dev_root_) {
    dev_root_ = -1;
    h_small_[0] = rq.root;
    check(cudaMemcpyAsync(d_tokens_, h_small_, sizeof(int32_t), cudaMemcpyHostToDevice, st), "upload root");
    dev_root_ = rq.root;
  }
  cuda::TreeBuildParams tb{};
  tb.budget = (int)n;
  tb.cache_len = (int)L;
  tb.tokens = d_tokens_ + 1;
  tb.depths = d_depths_;
  tb.parents = d_parents_;
  tb.positions = d_positions_;
  tb.visibility = d_vis_;
  tb.n_nodes = d_n_;
  if (n > 0 && draft->is_logits) {
    const float* logits_d = draft->device_values;  // a device draft (checked, ordered on this stream)
    if (logits_d == nullptr) {
      const int64_t cnt = draft->d * draft->k;
      std::memcpy(h_draft_, draft->values.data(), (size_t)cnt * sizeof(float));
      check(cudaMemcpyAsync(d_draft_, h_draft_, (size_t)cnt * sizeof(float), cudaMemcpyHostToDevice, st),
            "upload draft logits");
      logits_d = d_draft_;
    }
    cuda::TreeFromLogitsParams fp{};
    fp.logits = logits_d;
    fp.D = (int)draft->d;
    fp.V = (int)V_;
    fp.ld = (int)V_;
    fp.top_k = (int)std::min<int64_t>(rq.top_k, V_);
    fp.tree = tb;
    fp.workspace = d_topk_ws_;
    check(cuda::tree_build_from_logits(fp, st), "tree_build_from_logits");
  } else if (n > 0) {
    KD_CHECK(draft->k <= kMaxK, "GPU round: draft k " + s(draft->k) + " above " + s(kMaxK));
    if (draft->device_values) {  // in place; the ids as int32 by check_device_draft
      tb.logprobs = draft->device_values;
      tb.token_ids = d_ids_;
    } else {  // log-probs then ids, one block, one copy
      const int64_t cnt = draft->d * draft->k;
      std::memcpy(h_draft_, draft->values.data(), (size_t)cnt * sizeof(float));
      std::memcpy(reinterpret_cast<int32_t*>(h_draft_ + cnt), draft->ids.data(), (size_t)cnt * sizeof(int32_t));
      check(cudaMemcpyAsync(d_draft_, h_draft_, (size_t)(2 * cnt) * sizeof(float), cudaMemcpyHostToDevice, st),
            "upload draft log-probs and ids");
      tb.logprobs = d_draft_;
      tb.token_ids = reinterpret_cast<const int32_t*>(d_draft_ + cnt);
    }
    tb.D = (int)draft->d;
    tb.K = (int)draft->k;
    tb.ld = (int)draft->k;
    check(cuda::tree_build(tb, st), "tree_build");
  } else {
    tb.D = 0;  // the empty tree: root only (positions[0] = L, visibility row 0 = {0}, n = 0)
    check(cuda::tree_build(tb, st), "tree_build");
  }
  out.tree_build = since(t0);

  // verify + choose + accept/compact + gather, then the one copy back
  t0 = Clock::now();
  float* logits = model_.logits_device();
  check(cudaEventRecord(static_cast<cudaEvent_t>(ev_fwd_[0]), st), "cudaEventRecord");
  model_.forward_device(d_tokens_, d_positions_, d_vis_, cuda::tree_vis_words((int)n), T, logits);
  check(cudaEventRecord(static_cast<cudaEvent_t>(ev_fwd_[1]), st), "cudaEventRecord");
  check(choose(logits, T, V_, d_positions_, sampling_, d_choice_, st), "choose_tokens");
  cuda::TreeAcceptParams ap{};
  ap.tokens = d_tokens_ + 1;
  ap.parents = d_parents_;
  ap.choice = d_choice_;
  ap.n_nodes = d_n_;
  ap.n_max = (int)n;
  ap.path = d_path_;
  ap.count = d_count_;
  ap.bonus = d_bonus_;
  ap.result = d_result_;     // (m, n, bonus, path tokens): the round's one copy back
  ap.next_root = d_tokens_;  // the bonus is the next round's root (node 0)
  dev_root_ = -1;  // the accept writes node 0 (known again once the result is back)
  const CudaModel::CacheLayout cl = model_.cache_layout();
  cuda::KvCompactParams kp{};
  kp.cache = cl.base;
  kp.num_layers = cl.num_layers;
  kp.layer_stride = cl.layer_stride;
  kp.row_stride = cl.row_stride;
  kp.row_bytes = cl.row_bytes;
  kp.cache_len = (int)L;
  kp.path = d_path_;
  kp.count = d_count_;
  check(cuda::tree_accept_compact(ap, kp, st), "tree_accept_compact");
  const int64_t max_m = std::min<int64_t>(n, kMaxDepth) + 1;  // path length <= depth + 1
  sync_result(3 + max_m);
  out.verify = since(t0);
  float fwd_ms = 0.f;
  check(cudaEventElapsedTime(&fwd_ms, static_cast<cudaEvent_t>(ev_fwd_[0]), static_cast<cudaEvent_t>(ev_fwd_[1])),
        "cudaEventElapsedTime");
  out.verify_forward_gpu = 1e-3 * (double)fwd_ms;

  t0 = Clock::now();
  const int64_t m = h_result_[0];
  dev_root_ = h_result_[2];
  if (h_result_[1] != n || m < 1 || m > max_m)
    throw RuntimeFailure("GPU round: internal error (tree of " + s(h_result_[1]) + " nodes for " + s(n) +
                         " asked, path length " + s(m) + ")");
  model_.set_committed(m);
  out.tokens.assign(h_result_ + 3, h_result_ + 3 + (m - 1));
  out.tokens.push_back(h_result_[2]);
  out.tree_nodes = n;
  out.accept_commit = since(t0);
}

}  // namespace kdtree
#endif  // KDTREE_HAVE_CUBLAS
