// kernels.h: the DDTree CUDA kernels' public launcher API (no Python, no pybind11 here).
//
// Where it sits: implemented in cuda/tree_kernels.cu (tree build, accept, KV compaction),
// cuda/topk.cu (top-k + log-softmax of drafter logits) and cuda/verify_attention.cu (MLA
// tree-verify attention); called by bindings/bind_cuda.cpp and, later, the GPU engine.
// Every launcher takes device pointers + a Params struct + a cudaStream_t, launches
// asynchronously, and returns cudaSuccess or the launch/validation error
// (cudaErrorInvalidValue for bad arguments; it never synchronises).
//
// Legend: D = draft depth rows (<= 16), K = top-k per depth, V = vocabulary, B = node budget
// (<= 1024), n = nodes built (n <= B; node 0 is the root), W = (B+64)/64 visibility words per
// row, T = tree rows in a verify call (1 + n), H = heads, C = kv_lora_rank, R = rope dim,
// L = committed cache length. Semantics: docs/tree_contract.md; performance: docs/CUDA.md.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace kdtree {
namespace cuda {

constexpr int kTreeMaxDepth = 16;
constexpr int kTreeMaxBudget = 1024;
constexpr int kTreeWarpPathMaxB = 8;  // auto: budgets up to this take the one-warp path (H200: docs/CUDA.md)
constexpr int kTopkMaxK = 1024;
constexpr int kTopkMaxV = 16 * 32768;
inline int tree_vis_words(int budget) { return (budget + 64) / 64; }

// ---------------------------------------------------------------- tree build
// Programmatic Dependent Launch for every kernel of the backend (cuda/launch.h): process-wide,
// read at each launch (a captured CUDA graph keeps what it was captured with). Default on, unless
// the environment sets KDTREE_CUDA_PDL=0. set_pdl returns the previous setting.
bool pdl_enabled();
bool set_pdl(bool on);
// SMs of the current device (read once; 132, an H200's, if the query fails): the launchers' grid
// sizing (verify_attention's kernel choice, linear_tile's split count).
int num_sms();

struct TreeBuildParams {
  const float* logprobs;    // [D, ld] rows sorted descending; first K columns used
  const int32_t* token_ids; // [D, ld]
  int D;                    // 1..16 (D = 0 gives the empty tree)
  int K;                    // >= 1
  int ld;                   // row stride in elements (>= K)
  int budget;               // B, 0..1024
  int cache_len;            // positions = cache_len + depth
  int32_t* tokens;          // [B]      token of node i+1 (-1 past n)
  int32_t* depths;          // [B]      depth of node i+1 (0 past n)
  int32_t* parents;         // [B+1]    parents[0] = -1, node index of each node's parent
  int32_t* positions;       // [B+1]    cache_len + depth (-1 past n)
  uint64_t* visibility;     // [B+1, W] bit j%64 of word j/64 of row i: node i sees node j
  int32_t* n_nodes;         // [1]      n
  int32_t* path_taken;      // [1]      0 = parallel exact path (adaptive threshold), 1 = sequential
                            //          fallback, 2 = one-warp path (small budgets), 3 = parallel exact
                            //          path with the threshold estimate; may be null
  int force_fallback;       // 0 = auto; testing only: 1 = sequential fallback, 2 = one-warp path,
                            //   3 = parallel path (falls back when its checks fail), 4 = parallel
                            //   path with the adaptive threshold only
};
cudaError_t tree_build(const TreeBuildParams& p, cudaStream_t stream);

// ---------------------------------------------------------------- top-k + log-softmax
struct TopkParams {
  const float* logits;      // [D, ld] drafter logits (no NaN / +inf; no all -inf row)
  int D;                    // 1..16
  int V;                    // vocabulary, 1..kTopkMaxV
  int ld;                   // row stride in elements (>= V)
  int k;                    // 1..min(V, 1024)
  float* logprobs;          // [D, k] descending; = logit - float32(logsumexp(row))
  int32_t* ids;             // [D, k] token ids; equal logits: lower id first
  void* workspace;          // topk_workspace_bytes(D, V, k) bytes of device memory
};
size_t topk_workspace_bytes(int D, int V, int k);
cudaError_t topk_logsoftmax(const TopkParams& p, cudaStream_t stream);

// tree_build from logits [D, V]: top-k (k = top_k) + log-softmax + tree build, all on the
// device. `tree` carries the outputs, budget and cache_len; its logprobs/token_ids/K/ld are
// ignored (filled from the workspace).
struct TreeFromLogitsParams {
  const float* logits;      // [D, ld]
  int D, V, ld;
  int top_k;                // 1..1024 (clamped to V)
  TreeBuildParams tree;
  void* workspace;          // tree_from_logits_workspace_bytes(D, V, top_k) bytes
};
size_t tree_from_logits_workspace_bytes(int D, int V, int top_k);
cudaError_t tree_build_from_logits(const TreeFromLogitsParams& p, cudaStream_t stream);

// ---------------------------------------------------------------- tree accept
struct TreeAcceptParams {
  const int32_t* tokens;    // [n_max]   token of node i+1
  const int32_t* parents;   // [n_max+1] parents[0] = -1, 0 <= parents[i] < i
  const int32_t* choice;    // [n_max+1] the target's choice at every node
  const int32_t* n_nodes;   // [1] n (device memory, <= n_max)
  int n_max;                // capacity of the arrays above, <= 1024
  int32_t* path;            // [n_max+1] accepted node indices (first *count valid)
  int32_t* count;           // [1] m >= 1 (path[0] = 0)
  int32_t* bonus;           // [1] choice at the last accepted node
  // Optional round outputs (null: not written), so that a GPU round needs no extra kernel:
  int32_t* result;          // [3 + n_max]: m, *n_nodes, bonus, then the tokens of path nodes 1..m-1
  int32_t* next_root;       // [1]: the bonus again, the next round's root (may alias tokens[-1], nothing
                            // else the walk reads)
};
cudaError_t tree_accept(const TreeAcceptParams& p, cudaStream_t stream);

// ---------------------------------------------------------------- KV compaction
// For every layer l: slot cache_len + j <- slot cache_len + path[j], j < *count, in place
// (path increasing, path[0] = 0), all layers in one launch. Byte-based, any dtype.
struct KvCompactParams {
  void* cache;                // layer l, slot s at cache + l*layer_stride + s*row_stride (bytes)
  int num_layers;
  long long layer_stride;     // bytes between layers
  long long row_stride;       // bytes between slots
  int row_bytes;              // bytes moved per slot (<= row_stride)
  int cache_len;              // L: the verify window started at slot L
  const int32_t* path;        // [>= *count] device
  const int32_t* count;       // [1] device
};
cudaError_t kv_compact(const KvCompactParams& p, cudaStream_t stream);

// Fused accept + compaction (one launch): every block repeats the tiny accept walk, block 0
// writes path/count/bonus, block l compacts layer l.
cudaError_t tree_accept_compact(const TreeAcceptParams& a, const KvCompactParams& c,
                                cudaStream_t stream);

// ---------------------------------------------------------------- MLA tree-verify attention
// FP32, exact softmax with running max, FP32 accumulation. Row i (tree node i) x head h sees
// the L committed cache rows and tree row j iff bit j of visibility row i is set.
// Kernels (docs/CUDA.md): tiled (64 query rows x 128-key tiles), split-KV (16 or 8 query rows x
// 32-key chunks, for decode / short contexts), plain (other shapes); a cost model picks.
// Callers zero-initialise the struct (`VerifyAttentionParams p{};`): every optional field's
// zero means "default".
struct VerifyAttentionParams {
  const float* q_latent;        // [T, H, C] queries after absorption (q_nope @ W_UK)
  const float* q_rope;          // [T, H, R] roped query part
  const float* kv;              // [L+T, kv_stride] row = normed latent [C] then roped key [R]
  int kv_stride;                // elements between cache rows (>= C+R)
  const uint64_t* visibility;   // [T, vis_stride] bit j%64 of word j/64 of row i: i sees tree row j
  int vis_stride;               // words per visibility row (>= ceil(T/64))
  int T, H, C, R, L;            // L: committed length, or its upper bound when L_dev is set
  float scale;                  // softmax scale
  float* out;                   // [T, H, C] out_latent (a row that sees nothing gets 0)
  void* workspace;              // verify_attention_workspace_bytes(...) bytes (may be 0 bytes)
  int force_naive;              // testing: 1 = the simple reference kernel
  int force_splits;             // testing: > 0 forces the number of key splits (of whichever fast
                                //   kernel runs; clamped to its key tiles/chunks and the workspace cap)
  int force_kernel;             // 0 = auto (rule + cost model), 1 = tiled kernel, 2 = split-KV kernel,
                                //   3 = the two-pass decode kernels (M <= 1024 rows, L+T <= 16384;
                                //   else split-KV), 4 = tensor cores (3xTF32, verify_attention_mma.cu);
                                //   1 with T > 2048 runs split-KV; force_naive wins
  const int* L_dev;             // optional device int: the real committed length, read by the
                                //   kernels (CUDA graph capture); then 0 <= *L_dev <= L and L is the
                                //   host's upper bound (grid, split count, workspace size only)
  int force_splitkv_rows;       // testing: query rows per split-KV block, 4, 8 or 16 (0 = the cost
                                //   model's pick: 8 or 4 when 16-row blocks would leave SMs idle)
  int committed_ready;          // 1: the committed rows [0, L) and *L_dev were complete before this
                                //   launch's chain of PDL launches began (the model launches a step's
                                //   first kernel without PDL and writes no committed row within a
                                //   step), so the kernels may load them before their PDL wait
                                //   (launch.h); 0: only after it
  int* defer_splits;            // optional HOST int: when set and the chosen kernel splits the keys
                                //   into 2..defer_max_splits, the merge of the splits is left to the
                                //   caller (no combine launch, `out` not written): the partials stay
                                //   in the workspace as [S][T*H][C] unnormalised O, then [S][T*H][2]
                                //   (max in the log2 domain, sum), and *defer_splits = S; else 0
  int defer_max_splits;
  int exact;                    // 1: row-exact (CudaModel row_exact): each query row's output is a function of its own
                                //   query and its visible keys in index order alone (the committed rows, then its
                                //   ancestors and itself), the same bits whatever the other rows, the tree's layout, T
                                //   or L (verify_attention_exact.cu); any shape; force_* and defer_splits ignored
  int exact_split;              // exact: keys of a row's sequence per block (a multiple of 32; 0 = the default,
                                //   kVerifyExactSplitDefault); part of the bits, so one value for every step of a model
  const float* q_scale = nullptr;  // optional [T]: token t's scores are scale * q_scale[t] * (q . k) (CudaModel's folded
                                   //   query norm, q_fold: the queries come unnormalised, their RMS factor here);
                                   //   not with exact (cudaErrorInvalidValue)
};
constexpr int kVerifyExactSplitDefault = 128;
// Bytes of workspace for these params: the most splits either kernel can use at any L' <= L
// (deterministic, non-decreasing in L, at most 64 MiB); 0 when no split is possible.
size_t verify_attention_workspace_bytes(const VerifyAttentionParams& p);
// True when a fast kernel handles these shapes (C = 512, R = 64, 16-byte aligned rows, not
// force_naive); the tiled one also needs T <= 2048.
bool verify_attention_fast_path(const VerifyAttentionParams& p);
// The pick for these params: kernel 0 = plain, 1 = tiled, 2 = split-KV, 3 = decode (two passes,
// no splits), 4 = tensor cores, 5 = the row-exact kernels (p.exact; splits not reported); key splits; query rows
// per block (split-KV: 4, 8 or 16; tensor cores: 32).
void verify_attention_choice(const VerifyAttentionParams& p, int* kernel, int* splits, int* rows = nullptr,
                             int* splits_full = nullptr, int* splits_last = nullptr);
cudaError_t verify_attention(const VerifyAttentionParams& p, cudaStream_t stream);

// ---------------------------------------------------------------- testing hook
// The 3xTF32 operand split of every tensor-core kernel (model/tile_mma.h split_tf32) applied to n
// floats: hi[i], lo[i] as the kernels hand them to mma.sync (tests/python/test_cuda_ops.py
// test_tf32_split_bits checks them against NumPy over every exponent and the rounding boundaries).
cudaError_t tf32_split(const float* x, uint32_t* hi, uint32_t* lo, int n, cudaStream_t stream);

// ---------------------------------------------------------------- benchmark helper
// Keeps `blocks` blocks busy for `milliseconds` (spinning on the global timer) so the SM clocks
// leave their idle state before a timed region.
cudaError_t gpu_spin(double milliseconds, int blocks, cudaStream_t stream);

}  // namespace cuda
}  // namespace kdtree
