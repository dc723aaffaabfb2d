// cuda_model_drafter.h: the model drafter (cpp/engine/model_drafter.h, same definition) over a
// CudaModel, its chain kept on the GPU: the new context tokens are uploaded once, then each chain
// step is a draft_row kernel (the row's checks, argmax and top-1 log-probability; the row copied
// into the draft; the argmax written as the next step's input token) and a T = 1 forward_device
// (a CUDA graph replay) with no host synchronisation between steps; one small copy of the rows'
// statistics back and one synchronisation per call. When the round executor takes drafts in this
// model's device memory (DraftOutput::device_ok, the GPU round of the same device) the logits
// [d, V] stay there (DraftOutput::device_values); otherwise they are copied to the host.
// When the loop reads the draft on the host (DraftOutput::host_topk: the adaptive budget), the
// device top-k of the rows comes back with the statistics instead (DraftOutput::device_topk), one
// synchronisation in all.
// The rows are checked like check_draft_output's host checks (NaN, +inf, a row without a finite
// logit: Error). min_chain_prob is applied to the rows' statistics after the whole chain has run,
// so a stopped chain costs its full depth on the device; the rows returned are the same.
#pragma once
#if defined(KDTREE_HAVE_CUBLAS)
#include <cstdint>
#include <vector>

#include "engine/model_drafter.h"
#include "model/cuda_model.h"

namespace kdtree {

class CudaModelDrafter : public ModelDrafter {
 public:
  CudaModelDrafter(CudaModel& model, const ModelDraftParams& p);
  ~CudaModelDrafter() override;

 protected:
  void feed_and_chain(const int32_t* ctx, int64_t m, int64_t n, int64_t depth, DraftOutput& out) override;

 private:
  void check(int err, const char* what) const;  // cudaError_t -> RuntimeFailure
  void ensure_rows(int64_t depth);              // d_rows_ / stats for `depth` rows
  void free_rows();

  CudaModel& cm_;
  int64_t chunk_ = 0, rows_cap_ = 0;
  void* dev_mem_ = nullptr;   // d_in_ [2 * chunk] (tokens, then positions at + chunk), d_step_ [2]
  void* host_mem_ = nullptr;  // h_in_ [2 * chunk]
  int32_t *d_in_ = nullptr, *d_step_ = nullptr, *h_in_ = nullptr;
  void* rows_mem_ = nullptr;  // d_rows_ [rows_cap, V] floats, d_stats_ [rows_cap], d_topk_ [2, rows_cap, kmax],
                              // d_topk_ws_ (the top-k's workspace)
  void* stats_host_ = nullptr;  // pinned mirror of d_stats_ .. d_topk_ (statistics, then the top-k at topk_offset_)
  float* d_rows_ = nullptr;
  void* d_stats_ = nullptr;
  float* d_topk_ = nullptr;     // a call's top-k: log-probs [depth, k], then ids [depth, k] (int32)
  void* d_topk_ws_ = nullptr;
  int64_t topk_offset_ = 0;     // bytes from d_stats_ to d_topk_
  std::vector<double> logp_;
};

}  // namespace kdtree
#endif  // KDTREE_HAVE_CUBLAS
