// round_kernels.cu: see round_kernels.h.
#include "engine/round_kernels.h"
#include "launch.h"

#include <math.h>

namespace kdtree {
namespace cuda {
namespace {

__global__ void set_int32_kernel(int32_t* dst, int32_t value) {
  pdl_prologue();
  *dst = value;
}

constexpr int kDraftRowThreads = 1024;

// One block. Pass 1: the row copied, NaN / +inf flags, finite count, the max with its first
// index; pass 2 (a clean row): the float64 sum of exp(x - max) (the row again, from L2).
__global__ void __launch_bounds__(kDraftRowThreads) draft_row_kernel(DraftRowParams p) {
  pdl_prologue();
  __shared__ float s_val[32];
  __shared__ int s_idx[32], s_fin[32], s_bad[32];
  __shared__ double s_sum[32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  float best = -INFINITY;
  int bi = -1, fin = 0, bad = 0;
  for (int j = tid; j < p.V; j += blockDim.x) {
    const float x = p.src[j];
    if (p.dst) p.dst[j] = x;
    if (x != x) {
      bad |= 1;
    } else if (x == INFINITY) {
      bad |= 2;
    } else if (x != -INFINITY) {
      ++fin;
      if (x > best) {  // the first (lowest) index of this thread's max: indices increase
        best = x;
        bi = j;
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (oi >= 0 && (bi < 0 || ov > best || (ov == best && oi < bi))) {
      best = ov;
      bi = oi;
    }
    fin += __shfl_xor_sync(0xffffffffu, fin, o);
    bad |= __shfl_xor_sync(0xffffffffu, bad, o);
  }
  if (lane == 0) {
    s_val[warp] = best;
    s_idx[warp] = bi;
    s_fin[warp] = fin;
    s_bad[warp] = bad;
  }
  __syncthreads();
  if (warp == 0) {
    best = lane < nw ? s_val[lane] : -INFINITY;
    bi = lane < nw ? s_idx[lane] : -1;
    fin = lane < nw ? s_fin[lane] : 0;
    bad = lane < nw ? s_bad[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (oi >= 0 && (bi < 0 || ov > best || (ov == best && oi < bi))) {
        best = ov;
        bi = oi;
      }
      fin += __shfl_xor_sync(0xffffffffu, fin, o);
      bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    }
    if (lane == 0) {
      s_val[0] = best;
      s_idx[0] = bi;
      s_fin[0] = fin;
      s_bad[0] = bad;
    }
  }
  __syncthreads();
  best = s_val[0];
  bi = s_idx[0];
  fin = s_fin[0];
  bad = s_bad[0];
  const bool clean = bad == 0 && bi >= 0;
  double sum = 0.0;
  if (clean) {
    const double mx = (double)best;
    for (int j = tid; j < p.V; j += blockDim.x) sum += exp((double)p.src[j] - mx);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) s_sum[warp] = sum;
    __syncthreads();
    if (tid == 0) {
      sum = 0.0;
      for (int w = 0; w < nw; ++w) sum += s_sum[w];
    }
  }
  if (tid == 0) {
    DraftRowStats st;
    st.bad = (bad & 1) ? 1 : (bad ? 2 : 0);
    st.finite = fin;
    st.argmax = bi;
    st.pad = 0;
    st.logp_top1 = clean ? -log(sum) : 0.0;
    *p.stats = st;
    if (p.next_token) *p.next_token = bi >= 0 ? bi : 0;
    if (p.next_position) *p.next_position = p.position_value;
  }
}

}  // namespace

cudaError_t draft_row(const DraftRowParams& p, cudaStream_t stream) {
  if (!p.src || !p.stats || p.V < 1) return cudaErrorInvalidValue;
  launch_kernel(draft_row_kernel, 1, kDraftRowThreads, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t set_int32(int32_t* dst, int32_t value, cudaStream_t stream) {
  if (!dst) return cudaErrorInvalidValue;
  launch_kernel(set_int32_kernel, 1, 1, 0, stream, dst, value);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kdtree
