// round_kernels.h: small helper kernels of the GPU round and the model's graph replays that are
// not tree kernels (cuda/kernels.h) or model kernels (cuda/model/model_kernels.h). (The round's
// result gather is part of tree_accept_compact: TreeAcceptParams::result.)
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace kdtree {
namespace cuda {

// *dst = value, as a one-thread kernel: the value travels in the launch's arguments, so the host
// may change its copy right after the call (unlike a copy from host memory).
cudaError_t set_int32(int32_t* dst, int32_t value, cudaStream_t stream);

// ---------------------------------------------------------------- a draft model's chain step
// One row of a draft model's logits (cuda/engine/cuda_model_drafter.h): its checks, its greedy
// token and its top-1 log-probability, the row copied to the draft, the next step's inputs set.
struct DraftRowStats {
  int32_t bad;        // 0 = fine, 1 = a NaN, 2 = +inf (no NaN)
  int32_t finite;     // finite logits in the row
  int32_t argmax;     // the first index of the largest logit (-1 when no logit is finite)
  int32_t pad;
  double logp_top1;   // -log(sum_j exp(x_j - max)) in float64 (0 when bad or no logit is finite)
};
struct DraftRowParams {
  const float* src;        // [V] device: the row
  float* dst;              // [V] device: where the row is copied (nullptr: not copied)
  int V;                   // >= 1
  DraftRowStats* stats;    // [1] device
  int32_t* next_token;     // [1] device: the argmax (0 when none) for the next step's input; nullptr: not written
  int32_t* next_position;  // [1] device: position_value for the next step's input; nullptr: not written
  int32_t position_value;
};
cudaError_t draft_row(const DraftRowParams& p, cudaStream_t stream);

// ---------------------------------------------------------------- a device draft's checks
// check_draft_output's value checks (cpp/engine/engine.h) on a draft in device memory, for the
// GPU round (CudaRounds::check_device_draft). Per row r, stats[2r] = the row's first fault as
// kDraftFaultBase - (column * 4 + kind), 0 = none (kind: 0 NaN, 1 +inf, 2 a token id outside
// [0, vocab), 3 smaller than the entry before it: a log-prob row not sorted descending; the
// lowest column wins, then the lowest kind, as the host check meets them); stats[2r + 1] = the
// row's count of finite values. A log-prob draft's ids are also written as int32 to ids_out.
constexpr int32_t kDraftFaultBase = 1 << 30;
struct DraftCheckParams {
  const float* values;  // [d, k] log-probs, or logits [d, V] (ids == nullptr)
  const void* ids;      // [d, k] token ids, int32 or int64 (ids_bytes); nullptr for logits
  int ids_bytes;        // 4 or 8
  int d, k;             // d >= 1, k >= 1, d * k < 2^31, k < 2^27
  int vocab;
  int32_t* ids_out;     // [d, k] int32 (log-prob drafts)
  int32_t* stats;       // [d, 2] (draft_check zeroes it first when a row spans several blocks)
};
cudaError_t draft_check(const DraftCheckParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace kdtree
