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

// A warp's reduction of draft_row's per-thread statistics (every lane gets the result): the max
// with its first index (-1 = none), the finite count, the NaN / +inf flags.
__device__ __forceinline__ void warp_row_stats(float& best, int& bi, int& fin, int& bad) {
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
}

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
  warp_row_stats(best, bi, fin, bad);
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
    warp_row_stats(best, bi, fin, bad);
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

constexpr int kCheckThreads = 256, kCheckPerThread = 8;

// Grid (column blocks, d): each thread takes up to kCheckPerThread entries of row blockIdx.y,
// strided by the block; the block's first fault and finite count go to stats, stored when one
// block holds the row, else with one atomicMax and one atomicAdd into zeroed stats (integers:
// the result does not depend on the order).
__global__ void __launch_bounds__(kCheckThreads) draft_check_kernel(DraftCheckParams p) {
  pdl_prologue();
  __shared__ int s_fault[kCheckThreads / 32], s_fin[kCheckThreads / 32];
  const int r = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c0 = blockIdx.x * kCheckThreads * kCheckPerThread;
  const int c1 = min(p.k, c0 + kCheckThreads * kCheckPerThread);
  const float* row = p.values + (size_t)r * p.k;
  int fault = 0, fin = 0;
  for (int j = c0 + threadIdx.x; j < c1; j += kCheckThreads) {
    const float x = row[j];
    int kind = -1;
    if (x != x) {
      kind = 0;
    } else if (x == INFINITY) {
      kind = 1;
    } else {
      fin += x != -INFINITY ? 1 : 0;
      if (p.ids) {
        const size_t at = (size_t)r * p.k + j;
        const long long id = p.ids_bytes == 8 ? static_cast<const long long*>(p.ids)[at]
                                              : (long long)static_cast<const int32_t*>(p.ids)[at];
        p.ids_out[at] = (int32_t)id;
        if (id < 0 || id >= p.vocab) kind = 2;
        else if (j > 0 && !(row[j - 1] >= x)) kind = 3;
      }
    }
    if (kind >= 0) fault = max(fault, kDraftFaultBase - (j * 4 + kind));
  }
  fault = __reduce_max_sync(0xffffffffu, fault);
  fin = __reduce_add_sync(0xffffffffu, fin);
  if (lane == 0) {
    s_fault[warp] = fault;
    s_fin[warp] = fin;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kCheckThreads / 32; ++w) {
      fault = max(fault, s_fault[w]);
      fin += s_fin[w];
    }
    if (gridDim.x == 1) {  // the whole row in this block: plain stores (no zeroing needed)
      p.stats[2 * r] = fault;
      p.stats[2 * r + 1] = fin;
    } else {
      if (fault) atomicMax(p.stats + 2 * r, fault);
      if (fin) atomicAdd(p.stats + 2 * r + 1, fin);
    }
  }
}

}  // namespace

cudaError_t draft_check(const DraftCheckParams& p, cudaStream_t stream) {
  if (!p.values || !p.stats || p.d < 1 || p.k < 1 || p.k >= (1 << 27) || (int64_t)p.d * p.k >= (int64_t(1) << 31) ||
      (p.ids && (!p.ids_out || (p.ids_bytes != 4 && p.ids_bytes != 8))))
    return cudaErrorInvalidValue;
  const int per_block = kCheckThreads * kCheckPerThread;
  const dim3 grid((unsigned)((p.k + per_block - 1) / per_block), (unsigned)p.d);
  if (grid.x > 1) {  // several blocks per row combine with atomics: start from zero
    const cudaError_t e = cudaMemsetAsync(p.stats, 0, sizeof(int32_t) * 2 * (size_t)p.d, stream);
    if (e != cudaSuccess) return e;
  }
  // after a memset and possibly an event wait: launched without PDL
  return launch_kernel_ordered(draft_check_kernel, grid, dim3(kCheckThreads), 0, stream, p);
}

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
