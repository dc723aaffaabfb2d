// cuda_model_drafter.cpp: see cuda_model_drafter.h.
#if defined(KDTREE_HAVE_CUBLAS)
#include "engine/cuda_model_drafter.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "common.h"
#include "device_util.h"
#include "engine/round_kernels.h"
#include "kernels.h"

namespace kdtree {

namespace {
std::string s(int64_t v) { return std::to_string(v); }
cudaStream_t as_stream(void* p) { return static_cast<cudaStream_t>(p); }
}  // namespace

void CudaModelDrafter::check(int err, const char* what) const {
  if (err != cudaSuccess)
    throw RuntimeFailure(std::string("ModelDrafter (GPU): ") + what + ": " +
                         cudaGetErrorString(static_cast<cudaError_t>(err)));
}

CudaModelDrafter::CudaModelDrafter(CudaModel& model, const ModelDraftParams& p) : ModelDrafter(model, p), cm_(model) {
  chunk_ = std::min<int64_t>(p_.prefill_chunk, cm_.max_tokens());
  cuda::DeviceGuard guard(cm_.device_ordinal());
  cuda::Arena dev;
  dev.add(&d_in_, 2 * chunk_);
  dev.add(&d_step_, 2);
  const std::string err =
      cuda::alloc_device_and_pinned(dev.bytes, &dev_mem_, (2 * chunk_) * (int64_t)sizeof(int32_t), &host_mem_);
  if (!err.empty()) throw RuntimeFailure("ModelDrafter (GPU): " + err);
  dev.commit(dev_mem_);
  h_in_ = static_cast<int32_t*>(host_mem_);
  ensure_rows(cuda::kTreeMaxDepth);
}

CudaModelDrafter::~CudaModelDrafter() {
  cuda::DeviceGuard guard(cm_.device_ordinal());
  cudaStreamSynchronize(as_stream(cm_.stream()));
  free_rows();
  if (host_mem_) cudaFreeHost(host_mem_);
  if (dev_mem_) cudaFree(dev_mem_);
  cudaGetLastError();
}

void CudaModelDrafter::free_rows() {
  if (stats_host_) cudaFreeHost(stats_host_);
  if (rows_mem_) cudaFree(rows_mem_);
  stats_host_ = rows_mem_ = nullptr;
  d_rows_ = d_topk_ = nullptr;
  d_stats_ = d_topk_ws_ = nullptr;
  rows_cap_ = 0;
}

void CudaModelDrafter::ensure_rows(int64_t depth) {
  if (depth <= rows_cap_) return;
  cuda::DeviceGuard guard(cm_.device_ordinal());
  check(cudaStreamSynchronize(as_stream(cm_.stream())), "cudaStreamSynchronize");
  free_rows();
  const int64_t V = cm_.config().vocab_size;
  // rows, then the statistics and the top-k block [2 * depth * kmax] (log-probs [depth, k], then
  // ids [depth, k]) side by side, mirrored in the pinned block: one copy brings both back
  const int64_t kmax = std::min<int64_t>(V, cuda::kTopkMaxK);
  cuda::Arena dev;
  dev.add(&d_rows_, depth * V);
  dev.add(reinterpret_cast<cuda::DraftRowStats**>(&d_stats_), depth);
  dev.add(&d_topk_, 2 * depth * kmax);
  dev.add(reinterpret_cast<char**>(&d_topk_ws_),
          (int64_t)cuda::topk_workspace_bytes((int)depth, (int)V, (int)kmax));
  const std::string err = cuda::alloc_device_and_pinned(dev.bytes, &rows_mem_, dev.items[3].offset - dev.items[1].offset,
                                                        &stats_host_);
  if (!err.empty()) throw RuntimeFailure("ModelDrafter (GPU): " + s(depth) + " draft rows: " + err);
  dev.commit(rows_mem_);
  topk_offset_ = dev.items[2].offset - dev.items[1].offset;  // bytes from the statistics to the top-k block
  rows_cap_ = depth;
}

void CudaModelDrafter::feed_and_chain(const int32_t* ctx, int64_t m, int64_t n, int64_t depth, DraftOutput& out) {
  const int64_t V = cm_.config().vocab_size;
  ensure_rows(depth);
  cuda::DeviceGuard guard(cm_.device_ordinal());
  cudaStream_t st = as_stream(cm_.stream());
  float* ws = cm_.logits_device();  // [max_tokens, V]: every forward's logits
  for (int64_t c0 = m; c0 < n; c0 += chunk_) {
    const int64_t T = std::min(chunk_, n - c0);
    if (c0 > m) check(cudaStreamSynchronize(st), "cudaStreamSynchronize");  // the staging is reused
    for (int64_t i = 0; i < T; ++i) {
      h_in_[i] = ctx[c0 + i];
      h_in_[chunk_ + i] = static_cast<int32_t>(c0 + i);
    }
    check(cudaMemcpyAsync(d_in_, h_in_, (size_t)T * sizeof(int32_t), cudaMemcpyHostToDevice, st), "upload tokens");
    check(cudaMemcpyAsync(d_in_ + chunk_, h_in_ + chunk_, (size_t)T * sizeof(int32_t), cudaMemcpyHostToDevice, st),
          "upload positions");
    cm_.forward_device(d_in_, d_in_ + chunk_, nullptr, 0, T, ws, c0 + T == n ? 1 : 0);  // the last token's logits only
    keep_.resize(static_cast<size_t>(T));
    for (int64_t i = 0; i < T; ++i) keep_[i] = static_cast<int32_t>(i);
    cm_.commit(keep_.data(), T);  // an identity: host bookkeeping only
  }
  auto* stats = static_cast<cuda::DraftRowStats*>(d_stats_);
  const float* src = ws;  // (row 0: the feed's last token, the only row asked for)
  const int32_t k0 = 0;
  for (int64_t i = 1; i < depth; ++i) {  // row i - 1 -> its argmax -> step i
    cuda::DraftRowParams rp{src, d_rows_ + (i - 1) * V, (int)V, stats + (i - 1), d_step_, d_step_ + 1,
                            static_cast<int32_t>(n + i - 1)};
    check(cuda::draft_row(rp, st), "draft_row");
    cm_.forward_device(d_step_, d_step_ + 1, nullptr, 0, 1, ws);
    cm_.commit(&k0, 1);
    src = ws;
  }
  cuda::DraftRowParams rp{src, d_rows_ + (depth - 1) * V, (int)V, stats + (depth - 1), nullptr, nullptr, 0};
  check(cuda::draft_row(rp, st), "draft_row");
  // The loop reads [d, k] log-probs on the host (the adaptive budget): the device top-k of every
  // row (the kernel is safe on any float row; a row the checks below reject is never read), copied
  // back in the statistics' copy: one synchronisation, where the round executor's reduction of a
  // device draft (RoundExecutor::device_draft_to_host) would cost another.
  const int64_t kk = depth <= cuda::kTreeMaxDepth
                         ? std::min<int64_t>(std::min<int64_t>(out.host_topk, V), cuda::kTopkMaxK) : 0;
  size_t copy = (size_t)depth * sizeof(cuda::DraftRowStats);
  if (kk >= 1) {
    cuda::TopkParams tp{};
    tp.logits = d_rows_;
    tp.D = (int)depth;
    tp.V = (int)V;
    tp.ld = (int)V;
    tp.k = (int)kk;
    tp.logprobs = d_topk_;
    tp.ids = reinterpret_cast<int32_t*>(d_topk_ + depth * kk);
    tp.workspace = d_topk_ws_;  // sized for rows_cap_ rows at the largest k: covers any smaller call
    check(cuda::topk_logsoftmax(tp, st), "topk_logsoftmax (the draft's [d, k] form)");
    copy = (size_t)topk_offset_ + (size_t)(2 * depth * kk) * sizeof(float);
  }
  auto* hs = static_cast<cuda::DraftRowStats*>(stats_host_);
  check(cudaMemcpyAsync(hs, stats, copy, cudaMemcpyDeviceToHost, st), "download row statistics");
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize");
  cm_.truncate(n);

  logp_.resize(static_cast<size_t>(depth));
  for (int64_t r = 0; r < depth; ++r) logp_[r] = hs[r].logp_top1;
  const int64_t d = rows_kept(logp_.data(), depth);
  for (int64_t r = 0; r < d; ++r) {
    if (hs[r].bad == 1) throw Error("drafter logits contain NaN (row " + s(r) + ")");
    if (hs[r].bad == 2) throw Error("drafter logits contain +inf (row " + s(r) + ")");
    if (hs[r].finite < 1) throw Error("drafter logits: row " + s(r) + " has no finite value");
  }
  out.d = d;
  if (kk >= 1) {  // [d, kk] log-probs and ids on the host
    const float* h_lp = reinterpret_cast<const float*>(static_cast<const char*>(stats_host_) + topk_offset_);
    const int32_t* h_ids = reinterpret_cast<const int32_t*>(h_lp + depth * kk);
    out.is_logits = false;
    out.k = kk;
    out.values.assign(h_lp, h_lp + d * kk);
    out.ids.assign(h_ids, h_ids + d * kk);
    out.device_topk = true;
    return;
  }
  out.is_logits = true;
  out.k = V;
  if (out.device_ok == cm_.device_ordinal()) {
    out.device_values = d_rows_;
    out.device_checked = true;  // the rows were checked above
    out.row_finite.resize(static_cast<size_t>(d));
    for (int64_t r = 0; r < d; ++r) out.row_finite[r] = hs[r].finite;
  } else {
    out.values.resize(static_cast<size_t>(d * V));
    check(cudaMemcpy(out.values.data(), d_rows_, (size_t)(d * V) * sizeof(float), cudaMemcpyDeviceToHost),
          "download draft logits");
  }
}

}  // namespace kdtree
#endif  // KDTREE_HAVE_CUBLAS
