// topk.cu: top-k + log-softmax of drafter logits [D, V] on the device (V up to 512K).
//
// Two launches. topk_partial: grid (chunks, D), each block takes a chunk of one row into
// shared memory as order-preserving uint32 keys, writes the chunk's (max, sum exp(x - max))
// in float64, and selects the chunk's top min(k, chunk) by (logit desc, id asc) with a 3-pass
// radix select (11/11/10 bits, warp-aggregated shared atomics), ties resolved by a second
// radix select on the ids. topk_merge: one block per row selects the row's top k from the
// chunk candidates the same way, sorts them (bitonic on 64-bit (key, ~id)), and writes
// logprob = logit - float32(max + log(sum)) as the NumPy reference does (float64 sum).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels.h"

namespace kdtree {
namespace cuda {
namespace {

constexpr int kChunkTarget = 20480;
constexpr int kMaxChunk = 32768;
constexpr int kMaxChunks = 16;
constexpr int kPartialThreads = 512;
constexpr int kMergeThreads = 1024;

__device__ __forceinline__ uint32_t float_key(float x) {
  if (x == 0.0f) x = 0.0f;  // -0 and +0 tie (as in the reference's stable argsort)
  uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(uint32_t k) {
  uint32_t u = (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
  return __uint_as_float(u);
}

struct Plan {
  int nchunk, chunk;
};
inline Plan make_plan(int V) {
  Plan p;
  p.nchunk = (V + kChunkTarget - 1) / kChunkTarget;
  if (p.nchunk < 1) p.nchunk = 1;
  if (p.nchunk > kMaxChunks) p.nchunk = kMaxChunks;
  p.chunk = (V + p.nchunk - 1) / p.nchunk;
  return p;
}

// Workspace: per (row, chunk) partial max (float64), sum (float64), candidate keys and ids.
struct WsLayout {
  size_t o_max, o_sum, o_key, o_id, total;
};
inline WsLayout ws_layout(int D, int nchunk, int k) {
  WsLayout w;
  size_t o = 0, n = (size_t)D * nchunk;
  w.o_max = o; o += (n * 8 + 255) / 256 * 256;
  w.o_sum = o; o += (n * 8 + 255) / 256 * 256;
  w.o_key = o; o += (n * k * 4 + 255) / 256 * 256;
  w.o_id = o;  o += (n * k * 4 + 255) / 256 * 256;
  w.total = o;
  return w;
}

// ---------------------------------------------------------------- block helpers
template <int NT>
__device__ double block_sum_d(double v, double* red) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  double s = 0.0;
  for (int w = 0; w < NT / 32; ++w) s += red[w];
  return s;
}
template <int NT>
__device__ float block_max_f(float v, float* red) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float m = red[0];
  for (int w = 1; w < NT / 32; ++w) m = fmaxf(m, red[w]);
  return m;
}

// In-place exclusive scan over h[0..n) (n a multiple of NT); returns the total; barrier at end.
template <int NT>
__device__ int block_scan_excl(int* h, int n, int* tmp) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int per = n / NT, b = t * per;
  int s = 0;
  for (int i = 0; i < per; ++i) s += h[b + i];
  int x = s;
  for (int off = 1; off < 32; off <<= 1) {
    int y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  if (lane == 31) tmp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int v = lane < NT / 32 ? tmp[lane] : 0;
    for (int off = 1; off < 32; off <<= 1) {
      int y = __shfl_up_sync(0xffffffffu, v, off);
      if (lane >= off) v += y;
    }
    tmp[lane] = v;
  }
  __syncthreads();
  int run = (warp ? tmp[warp - 1] : 0) + x - s;
  int total = tmp[NT / 32 - 1];
  for (int i = 0; i < per; ++i) {
    int v = h[b + i];
    h[b + i] = run;
    run += v;
  }
  __syncthreads();
  return total;
}

// Radix select: among items i < n with valid(i), the `need`-th largest key (1-based) by
// key(i). Returns the threshold key; *need_eq = how many items equal to it belong to the
// top `need` (the rest of the top are the items strictly greater). Needs hist[2048], tmp[40],
// misc[4] in shared memory. All threads must call it.
template <int NT, class KeyFn>
__device__ uint32_t radix_select(int n, int need, KeyFn keyfn, int* hist, int* tmp, int* misc,
                                 int* need_eq) {
  uint32_t prefix = 0, mask = 0;
  const int lane = threadIdx.x & 31;
  const int shifts[3] = {21, 10, 0};
  const int nbits[3] = {11, 11, 10};
  for (int pass = 0; pass < 3; ++pass) {
    const int sh = shifts[pass], nb = 1 << nbits[pass];
    for (int i = threadIdx.x; i < 2048; i += NT) hist[i] = 0;
    __syncthreads();
    for (int base = 0; base < n; base += NT) {
      int i = base + threadIdx.x;
      uint32_t key = 0;
      bool ok = false;
      if (i < n) ok = keyfn(i, &key);
      ok = ok && ((key & mask) == prefix);
      // reversed digit so that bin 0 holds the largest keys
      int dig = ok ? (nb - 1 - (int)((key >> sh) & (uint32_t)(nb - 1))) : -1;
      unsigned grp = __match_any_sync(0xffffffffu, dig);
      if (ok && lane == __ffs(grp) - 1) atomicAdd(&hist[dig], __popc(grp));
    }
    __syncthreads();
    if (threadIdx.x == 0) misc[0] = -1;
    block_scan_excl<NT>(hist, 2048, tmp);  // bins >= nb are zero
    // the bin where the running count crosses `need`: excl < need <= excl + count
    for (int b = threadIdx.x; b < nb; b += NT) {
      int excl = hist[b];
      int incl = (b + 1 < 2048) ? hist[b + 1] : 0x7fffffff;
      if (b + 1 == nb) incl = excl + 0x7fffffff / 2;  // last bin: anything left
      if (excl < need && need <= incl) {
        misc[0] = b;
        misc[1] = excl;
      }
    }
    __syncthreads();
    const int b = misc[0];
    need -= misc[1];
    const uint32_t dig = (uint32_t)(nb - 1 - b);
    prefix |= dig << sh;
    mask |= (uint32_t)(nb - 1) << sh;
    __syncthreads();
  }
  *need_eq = need;
  return prefix;
}

// ---------------------------------------------------------------- kernels
__global__ void __launch_bounds__(kPartialThreads) topk_partial_kernel(TopkParams p, Plan plan,
                                                                       WsLayout wl) {
  extern __shared__ __align__(16) unsigned char sm[];
  uint32_t* keys = (uint32_t*)sm;                    // [chunk]
  int* hist = (int*)(sm + (size_t)plan.chunk * 4);   // [2048]
  int* tmp = hist + 2048;                            // [40]
  int* misc = tmp + 40;                              // [8]
  double* red = (double*)(misc + 8);                 // [32]
  const int row = blockIdx.y, ch = blockIdx.x;
  const int c0 = ch * plan.chunk;
  int n = p.V - c0;
  if (n > plan.chunk) n = plan.chunk;
  if (n < 0) n = 0;
  const float* x = p.logits + (size_t)row * p.ld + c0;
  float mx = -__int_as_float(0x7f800000);
  for (int i = threadIdx.x; i < n; i += kPartialThreads) {
    float v = x[i];
    keys[i] = float_key(v);
    mx = fmaxf(mx, v);
  }
  mx = block_max_f<kPartialThreads>(mx, (float*)red);
  double s = 0.0;
  if (mx != -__int_as_float(0x7f800000)) {
    for (int i = threadIdx.x; i < n; i += kPartialThreads) s += exp((double)key_float(keys[i]) - (double)mx);
  }
  s = block_sum_d<kPartialThreads>(s, red);
  const size_t slot = (size_t)row * plan.nchunk + ch;
  unsigned char* ws = (unsigned char*)p.workspace;
  if (threadIdx.x == 0) {
    ((double*)(ws + wl.o_max))[slot] = (double)mx;
    ((double*)(ws + wl.o_sum))[slot] = s;
    misc[4] = 0;
  }
  const int kk = p.k < n ? p.k : n;
  uint32_t* ck = (uint32_t*)(ws + wl.o_key) + slot * p.k;
  int32_t* ci = (int32_t*)(ws + wl.o_id) + slot * p.k;
  __syncthreads();
  if (kk == n) {  // the whole chunk is a candidate
    for (int i = threadIdx.x; i < n; i += kPartialThreads) {
      ck[i] = keys[i];
      ci[i] = c0 + i;
    }
    return;
  }
  int need_eq = 0;
  const uint32_t thr = radix_select<kPartialThreads>(
      n, kk, [&](int i, uint32_t* k) { *k = keys[i]; return true; }, hist, tmp, misc, &need_eq);
  // ties at thr: keep the need_eq lowest ids (largest ~index)
  int cnt_eq = 0;
  for (int i = threadIdx.x; i < n; i += kPartialThreads) cnt_eq += keys[i] == thr;
  __syncthreads();
  if (threadIdx.x == 0) misc[5] = 0;
  __syncthreads();
  atomicAdd(&misc[5], cnt_eq);
  __syncthreads();
  const int total_eq = misc[5];
  uint32_t thr2 = 0;
  bool all_eq = total_eq == need_eq;
  if (!all_eq) {
    int ne2 = 0;
    thr2 = radix_select<kPartialThreads>(
        n, need_eq,
        [&](int i, uint32_t* k) {
          *k = ~(uint32_t)i;
          return keys[i] == thr;
        },
        hist, tmp, misc, &ne2);
  }
  for (int i = threadIdx.x; i < n; i += kPartialThreads) {
    uint32_t k = keys[i];
    bool take = k > thr || (k == thr && (all_eq || ~(uint32_t)i >= thr2));
    if (take) {
      int o = atomicAdd(&misc[4], 1);
      ck[o] = k;
      ci[o] = c0 + i;
    }
  }
}

__global__ void __launch_bounds__(kMergeThreads) topk_merge_kernel(TopkParams p, Plan plan,
                                                                   WsLayout wl) {
  extern __shared__ __align__(16) unsigned char sm[];
  const int row = blockIdx.x;
  // candidate counts per chunk are deterministic: min(k, chunk size)
  int ncand = 0;
  for (int ch = 0; ch < plan.nchunk; ++ch) {
    int n = p.V - ch * plan.chunk;
    if (n > plan.chunk) n = plan.chunk;
    if (n < 0) n = 0;
    ncand += p.k < n ? p.k : n;
  }
  uint32_t* ckey = (uint32_t*)sm;                                  // [ncand]
  int32_t* cid = (int32_t*)(sm + (size_t)ncand * 4);               // [ncand]
  unsigned long long* sortv = (unsigned long long*)(sm + (size_t)ncand * 8);  // [1024]
  int* hist = (int*)(sortv + 1024);                                // [2048]
  int* tmp = hist + 2048;                                          // [40]
  int* misc = tmp + 40;                                            // [8]
  double* red = (double*)(misc + 8);                               // [32]
  unsigned char* ws = (unsigned char*)p.workspace;
  {
    int off = 0;
    for (int ch = 0; ch < plan.nchunk; ++ch) {
      int n = p.V - ch * plan.chunk;
      if (n > plan.chunk) n = plan.chunk;
      if (n < 0) n = 0;
      int kk = p.k < n ? p.k : n;
      const size_t slot = (size_t)row * plan.nchunk + ch;
      const uint32_t* ck = (const uint32_t*)(ws + wl.o_key) + slot * p.k;
      const int32_t* ci = (const int32_t*)(ws + wl.o_id) + slot * p.k;
      for (int i = threadIdx.x; i < kk; i += kMergeThreads) {
        ckey[off + i] = ck[i];
        cid[off + i] = ci[i];
      }
      off += kk;
    }
  }
  // log-sum-exp from the partials (float64), rounded to float32 like the reference
  double m = -1.0 / 0.0;
  for (int ch = 0; ch < plan.nchunk; ++ch) {
    double v = ((const double*)(ws + wl.o_max))[(size_t)row * plan.nchunk + ch];
    if (v > m) m = v;
  }
  double ssum = 0.0;
  for (int ch = 0; ch < plan.nchunk; ++ch) {
    const size_t slot = (size_t)row * plan.nchunk + ch;
    double mc = ((const double*)(ws + wl.o_max))[slot];
    double sc = ((const double*)(ws + wl.o_sum))[slot];
    if (sc > 0.0) ssum += sc * exp(mc - m);
  }
  const float lse = (float)(m + log(ssum));
  if (threadIdx.x == 0) misc[4] = 0;
  __syncthreads();
  const int k = p.k;
  int need_eq = k;
  uint32_t thr = 0, thr2 = 0;
  bool all_eq = true;
  if (k < ncand) {
    thr = radix_select<kMergeThreads>(
        ncand, k, [&](int i, uint32_t* kk) { *kk = ckey[i]; return true; }, hist, tmp, misc,
        &need_eq);
    int ce = 0;
    for (int i = threadIdx.x; i < ncand; i += kMergeThreads) ce += ckey[i] == thr;
    __syncthreads();
    if (threadIdx.x == 0) misc[5] = 0;
    __syncthreads();
    atomicAdd(&misc[5], ce);
    __syncthreads();
    all_eq = misc[5] == need_eq;
    if (!all_eq) {
      int ne2 = 0;
      thr2 = radix_select<kMergeThreads>(
          ncand, need_eq,
          [&](int i, uint32_t* kk) {
            *kk = ~(uint32_t)cid[i];
            return ckey[i] == thr;
          },
          hist, tmp, misc, &ne2);
    }
  }
  // gather the k winners as 64-bit sort values (key, ~id): descending = key desc, id asc
  int P = 1;
  while (P < k) P <<= 1;
  for (int i = threadIdx.x; i < P; i += kMergeThreads) sortv[i] = 0ull;
  __syncthreads();
  for (int i = threadIdx.x; i < ncand; i += kMergeThreads) {
    uint32_t kk = ckey[i];
    bool take = (k >= ncand) || kk > thr || (kk == thr && (all_eq || ~(uint32_t)cid[i] >= thr2));
    if (take) {
      int o = atomicAdd(&misc[4], 1);
      sortv[o] = ((unsigned long long)kk << 32) | (unsigned long long)(~(uint32_t)cid[i]);
    }
  }
  __syncthreads();
  // bitonic sort, descending
  for (int size = 2; size <= P; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < P; i += kMergeThreads) {
        int j = i ^ stride;
        if (j > i) {
          unsigned long long a = sortv[i], b = sortv[j];
          bool desc = (i & size) == 0;
          if (desc ? (a < b) : (a > b)) {
            sortv[i] = b;
            sortv[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int i = threadIdx.x; i < k; i += kMergeThreads) {
    unsigned long long v = sortv[i];
    float xv = key_float((uint32_t)(v >> 32));
    p.logprobs[(size_t)row * k + i] = xv - lse;
    p.ids[(size_t)row * k + i] = (int32_t)(~(uint32_t)(v & 0xffffffffull));
  }
}

size_t partial_smem(const Plan& pl) { return (size_t)pl.chunk * 4 + (2048 + 40 + 8) * 4 + 32 * 8; }
size_t merge_smem(const Plan& pl, int k) {
  return (size_t)pl.nchunk * k * 8 + 1024 * 8 + (2048 + 40 + 8) * 4 + 32 * 8;
}

}  // namespace

size_t topk_workspace_bytes(int D, int V, int k) {
  if (D < 1 || V < 1 || k < 1) return 0;
  Plan pl = make_plan(V);
  return ws_layout(D, pl.nchunk, k).total;
}

cudaError_t topk_logsoftmax(const TopkParams& p, cudaStream_t stream) {
  if (!p.logits || !p.logprobs || !p.ids || !p.workspace || p.D < 1 || p.D > kTreeMaxDepth ||
      p.V < 1 || p.V > kTopkMaxV || p.ld < p.V || p.k < 1 || p.k > p.V || p.k > kTopkMaxK)
    return cudaErrorInvalidValue;
  Plan pl = make_plan(p.V);
  if (pl.chunk > kMaxChunk) return cudaErrorInvalidValue;
  WsLayout wl = ws_layout(p.D, pl.nchunk, p.k);
  size_t s1 = partial_smem(pl), s2 = merge_smem(pl, p.k);
  cudaError_t e = cudaFuncSetAttribute(topk_partial_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s1);
  if (e != cudaSuccess) return e;
  e = cudaFuncSetAttribute(topk_merge_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s2);
  if (e != cudaSuccess) return e;
  topk_partial_kernel<<<dim3(pl.nchunk, p.D), kPartialThreads, s1, stream>>>(p, pl, wl);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  topk_merge_kernel<<<p.D, kMergeThreads, s2, stream>>>(p, pl, wl);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kdtree
