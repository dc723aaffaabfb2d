// tree_kernels.cu: DDTree tree build (one block, parallel exact path + sequential fallback:
// see tree_build_impl.h), tree accept walk, and KV compaction, plus tree_build_from_logits.
#include <cuda_runtime.h>

#include <cstdio>

#include "kernels.h"
#include "tree_build_impl.h"
#include "launch.h"

static_assert(kdtree::treeimpl::kWarpPathMaxB == kdtree::cuda::kTreeWarpPathMaxB, "one constant");
static_assert(kdtree::treeimpl::kMaxBudget == kdtree::cuda::kTreeMaxBudget, "one constant");

namespace kdtree {
namespace cuda {
namespace {

using treeimpl::TreeArgs;

// The block context the portable algorithm runs on: thread id, barrier, shared atomics, warp
// shuffles.
struct GpuCtx {
  __device__ int tid() const { return (int)threadIdx.x; }
  __device__ int nthreads() const { return (int)blockDim.x; }
  __device__ void sync() const { __syncthreads(); }
  __device__ int sync_or(int pred) const { return __syncthreads_or(pred); }  // barrier + OR over the block
  __device__ void step(int) const {}  // latency-proxy hook of the CPU emulation: nothing here
  __device__ int atomic_add(int* p, int v) const { return atomicAdd(p, v); }
  __device__ void atomic_min(int* p, int v) const { atomicMin(p, v); }
  __device__ void atomic_max(int* p, int v) const { atomicMax(p, v); }
  // Warp-level primitives (every lane of the warp calls them, full mask).
  __device__ int warp_incl_sum(int v) const {  // inclusive prefix sum over the lanes
    const int lane = (int)threadIdx.x & 31;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, v, off);
      if (lane >= off) v += y;
    }
    return v;
  }
  __device__ int warp_shfl(int v, int src) const { return __shfl_sync(0xffffffffu, v, src); }
  __device__ int warp_sum(int v) const { return __reduce_add_sync(0xffffffffu, v); }  // the warp's total (redux.sync)
  __device__ void warp_sync() const { __syncwarp(); }  // orders the warp's shared-memory accesses
};

__global__ void __launch_bounds__(1024) tree_build_kernel(TreeArgs a) {
  pdl_prologue();
  extern __shared__ __align__(16) unsigned char smem[];
  GpuCtx ctx;
  treeimpl::TreeBlock<GpuCtx> blk(ctx, a, smem);
  blk.run();
}

int tree_threads(int B) { return B > 256 ? 1024 : (B > 64 ? 512 : (B > 16 ? 256 : 128)); }

// ---------------------------------------------------------------- accept + compaction
// best[p] = the highest-index child c of p with tokens[c-1] == choice[p]; walk from 0.
__device__ int accept_walk(const TreeAcceptParams& a, int* best, int* path_s) {
  const int t = (int)threadIdx.x, nt = (int)blockDim.x;
  int n = a.n_nodes[0];
  if (n < 0) n = 0;
  if (n > a.n_max) n = a.n_max;
  for (int i = t; i <= n; i += nt) best[i] = -1;
  __syncthreads();
  for (int c = 1 + t; c <= n; c += nt) {
    int p = a.parents[c];
    if (p >= 0 && p < c && a.tokens[c - 1] == a.choice[p]) atomicMax(&best[p], c);
  }
  __syncthreads();
  if (t == 0) {
    int cur = 0, m = 0;
    path_s[m++] = 0;
    while (best[cur] > cur) {
      cur = best[cur];
      path_s[m++] = cur;
    }
    path_s[1024 + 1] = m;    // count
    path_s[1024 + 2] = cur;  // last node
  }
  __syncthreads();
  return path_s[1024 + 1];
}

// The walk's outputs (one block): path, count, bonus, and the optional round outputs.
// next_root may alias a.tokens[-1] (the root's slot in the round's node-token array), which no
// block of the walk reads; it must not alias anything else the walk reads.
__device__ void write_accept(const TreeAcceptParams& a, const int* path_s, int m) {
  const int t = (int)threadIdx.x, nt = (int)blockDim.x;
  const int b = a.choice[path_s[1024 + 2]];
  for (int j = t; j < m; j += nt) a.path[j] = path_s[j];
  if (a.result)
    for (int j = t; j + 1 < m; j += nt) a.result[3 + j] = a.tokens[path_s[j + 1] - 1];
  if (t == 0) {
    a.count[0] = m;
    a.bonus[0] = b;
    if (a.result) {
      a.result[0] = m;
      a.result[1] = a.n_nodes[0];
      a.result[2] = b;
    }
  }
  if (a.next_root && t == 0) a.next_root[0] = b;
}

__global__ void tree_accept_kernel(TreeAcceptParams a) {
  pdl_prologue();
  __shared__ int best[1025];
  __shared__ int path_s[1025 + 2];
  int m = accept_walk(a, best, path_s);
  write_accept(a, path_s, m);
}

// Move slots L + src_idx(j) -> L + j for j < m in one layer; read-all-then-write per chunk of
// items (j-major), which is safe in place because dst j < j' <= path[j'] for later items.
template <typename U>
__device__ void compact_layer(const KvCompactParams& c, int layer, const int* path, int m) {
  constexpr int kRegs = 16;
  const int t = (int)threadIdx.x, nt = (int)blockDim.x;
  const int units = c.row_bytes / (int)sizeof(U);
  unsigned char* base = (unsigned char*)c.cache + (long long)layer * c.layer_stride;
  const long long items = (long long)(m - 1) * units;  // rows 1..m-1 (row 0 never moves)
  const long long chunk = (long long)nt * kRegs;
  for (long long c0 = 0; c0 < items; c0 += chunk) {
    U v[kRegs];
#pragma unroll
    for (int k = 0; k < kRegs; ++k) {
      long long it = c0 + (long long)k * nt + t;
      if (it < items) {
        int j = 1 + (int)(it / units), u = (int)(it % units);
        const U* src = (const U*)(base + (long long)(c.cache_len + path[j]) * c.row_stride) + u;
        v[k] = *src;
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kRegs; ++k) {
      long long it = c0 + (long long)k * nt + t;
      if (it < items) {
        int j = 1 + (int)(it / units), u = (int)(it % units);
        if (path[j] != j) {
          U* dst = (U*)(base + (long long)(c.cache_len + j) * c.row_stride) + u;
          *dst = v[k];
        }
      }
    }
    __syncthreads();
  }
}

__device__ void compact_dispatch(const KvCompactParams& c, int layer, const int* path, int m) {
  bool a16 = (c.row_bytes % 16 == 0) && (c.row_stride % 16 == 0) && (c.layer_stride % 16 == 0) &&
             (((unsigned long long)c.cache) % 16 == 0);
  if (a16) compact_layer<uint4>(c, layer, path, m);
  else if (c.row_bytes % 4 == 0 && c.row_stride % 4 == 0 && c.layer_stride % 4 == 0 &&
           ((unsigned long long)c.cache) % 4 == 0)
    compact_layer<unsigned int>(c, layer, path, m);
  else compact_layer<unsigned char>(c, layer, path, m);
}

__global__ void kv_compact_kernel(KvCompactParams c) {
  pdl_prologue();
  __shared__ int path_s[1025];
  __shared__ int m_s;
  if (threadIdx.x == 0) {
    int m = c.count[0];
    m_s = m < 1 ? 1 : (m > 1025 ? 1025 : m);
  }
  __syncthreads();
  const int m = m_s;
  for (int j = (int)threadIdx.x; j < m; j += blockDim.x) path_s[j] = c.path[j];
  __syncthreads();
  compact_dispatch(c, (int)blockIdx.x, path_s, m);
}

__global__ void tree_accept_compact_kernel(TreeAcceptParams a, KvCompactParams c) {
  pdl_prologue();
  __shared__ int best[1025];
  __shared__ int path_s[1025 + 2];
  int m = accept_walk(a, best, path_s);
  if (blockIdx.x == 0) write_accept(a, path_s, m);
  compact_dispatch(c, (int)blockIdx.x, path_s, m);
}

__global__ void spin_kernel(unsigned long long ns) {
  pdl_prologue();
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  float x = (float)threadIdx.x;
  do {
#pragma unroll
    for (int i = 0; i < 64; ++i) x = fmaf(x, 0.999f, 0.5f);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
  if (x == 12345.f) printf("%f\n", x);
}

bool compact_ok(const KvCompactParams& c) {
  return c.num_layers >= 0 && c.row_bytes > 0 && c.row_stride >= c.row_bytes && c.cache_len >= 0 &&
         (c.num_layers == 0 || (c.cache && c.path && c.count)) &&
         (c.num_layers <= 1 || c.layer_stride > 0);
}
bool accept_ok(const TreeAcceptParams& a) {
  return a.tokens && a.parents && a.choice && a.n_nodes && a.path && a.count && a.bonus &&
         a.n_max >= 0 && a.n_max <= 1024;
}

}  // namespace

cudaError_t tree_build(const TreeBuildParams& p, cudaStream_t stream) {
  if (p.budget < 0 || p.budget > kTreeMaxBudget || p.D < 0 || p.D > kTreeMaxDepth ||
      (p.D > 0 && p.budget > 0 && (p.K < 1 || p.ld < p.K || !p.logprobs || !p.token_ids)) ||
      !p.tokens || !p.depths || !p.parents || !p.positions || !p.visibility || !p.n_nodes)
    return cudaErrorInvalidValue;
  if (p.budget == 0) {
    // Only the root: parents[0] = -1, positions[0] = cache_len, visibility[0] = 1, n = 0.
    // Done by the kernel too (B = 0 writes just those), keeping one code path.
  }
  TreeArgs a;
  a.lp = p.logprobs;
  a.ids = p.token_ids;
  a.D = p.D;
  a.K = p.K < 1 ? 1 : p.K;
  a.ld = p.ld;
  a.B = p.budget;
  a.cache_len = p.cache_len;
  a.tokens = p.tokens;
  a.depths = p.depths;
  a.parents = p.parents;
  a.positions = p.positions;
  a.visibility = p.visibility;
  a.n_out = p.n_nodes;
  a.path_out = p.path_taken;
  a.force_fallback = p.force_fallback;
  a.lay = treeimpl::make_tree_layout(p.budget, p.D, a.K);
  const size_t smem = a.lay.total;
  static size_t smem_set = 48 * 1024;  // the dynamic shared memory limit already granted
  if (smem > smem_set) {
    cudaError_t e = cudaFuncSetAttribute(tree_build_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    smem_set = smem;
  }
  launch_kernel(tree_build_kernel, 1, tree_threads(p.budget), smem, stream, a);
  return cudaGetLastError();
}

size_t tree_from_logits_workspace_bytes(int D, int V, int top_k) {
  int k = top_k < V ? top_k : V;
  if (k < 1) k = 1;
  size_t lp = ((size_t)D * k * sizeof(float) + 255) / 256 * 256;
  size_t ids = ((size_t)D * k * sizeof(int32_t) + 255) / 256 * 256;
  return lp + ids + topk_workspace_bytes(D, V, k);
}

cudaError_t tree_build_from_logits(const TreeFromLogitsParams& p, cudaStream_t stream) {
  if (!p.logits || p.D < 1 || p.D > kTreeMaxDepth || p.V < 1 || p.ld < p.V || p.top_k < 1 ||
      !p.workspace)
    return cudaErrorInvalidValue;
  int k = p.top_k < p.V ? p.top_k : p.V;
  if (k > kTopkMaxK) return cudaErrorInvalidValue;
  unsigned char* ws = (unsigned char*)p.workspace;
  size_t lp_bytes = ((size_t)p.D * k * sizeof(float) + 255) / 256 * 256;
  size_t ids_bytes = ((size_t)p.D * k * sizeof(int32_t) + 255) / 256 * 256;
  TopkParams t;
  t.logits = p.logits;
  t.D = p.D;
  t.V = p.V;
  t.ld = p.ld;
  t.k = k;
  t.logprobs = (float*)ws;
  t.ids = (int32_t*)(ws + lp_bytes);
  t.workspace = ws + lp_bytes + ids_bytes;
  cudaError_t e = topk_logsoftmax(t, stream);
  if (e != cudaSuccess) return e;
  TreeBuildParams b = p.tree;
  b.logprobs = t.logprobs;
  b.token_ids = t.ids;
  b.D = p.D;
  b.K = k;
  b.ld = k;
  return tree_build(b, stream);
}

cudaError_t gpu_spin(double milliseconds, int blocks, cudaStream_t stream) {
  if (milliseconds <= 0 || blocks <= 0) return cudaSuccess;
  launch_kernel(spin_kernel, blocks, 256, 0, stream, (unsigned long long)(milliseconds * 1e6));
  return cudaGetLastError();
}

cudaError_t tree_accept(const TreeAcceptParams& p, cudaStream_t stream) {
  if (!accept_ok(p)) return cudaErrorInvalidValue;
  launch_kernel(tree_accept_kernel, 1, 1024, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t kv_compact(const KvCompactParams& p, cudaStream_t stream) {
  if (!compact_ok(p)) return cudaErrorInvalidValue;
  if (p.num_layers == 0) return cudaSuccess;
  launch_kernel(kv_compact_kernel, p.num_layers, 256, 0, stream, p);
  return cudaGetLastError();
}

cudaError_t tree_accept_compact(const TreeAcceptParams& a, const KvCompactParams& c,
                                cudaStream_t stream) {
  if (!accept_ok(a) || !compact_ok(c)) return cudaErrorInvalidValue;
  int blocks = c.num_layers > 0 ? c.num_layers : 1;
  KvCompactParams cc = c;
  if (c.num_layers == 0) {  // accept only: compaction over zero rows
    cc.row_bytes = 0;
  }
  launch_kernel(tree_accept_compact_kernel, blocks, 256, 0, stream, a, cc);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kdtree
