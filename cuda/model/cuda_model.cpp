// cuda_model.cpp: the GPU forward of the DeepSeek-V3 / Kimi-K2 target model (see cuda_model.h
// and docs/CUDA_MODEL.md). One step over T <= max_tokens new tokens, all on one stream:
//
//   x = embed(tokens); RoPE cos / sin of the positions            embed kernel (once per step)
//   per layer:  hn = rmsnorm(x)                                  rmsnorm kernel
//     [qa | kv] = hn @ [q_a_proj; kv_a_proj]^T                    one SGEMM (fused weights)
//     q = rmsnorm(qa) @ q_b_proj^T   (or hn @ q_proj^T)           rmsnorm + SGEMM
//     cache[L+t] = [norm(latent) | rope(k_rope)], q_rope = rope   mla_prep kernel
//     q_lat[:, h] = q_nope[:, h] @ W_UK[h]                        strided-batched SGEMM over h
//     o_lat = softmax(mask([q_lat|q_rope] . cache^T)) . cache     verify_attention (cuda/kernels.h)
//     x += (o_lat[:, h] @ W_UV[h]^T) @ o_proj^T                   strided-batched SGEMM + SGEMM (beta 1)
//     hn = rmsnorm(x)
//     dense:  x += down(silu(gate(hn)) * up(hn))                 SGEMM, swiglu, SGEMM (beta 1)
//     MoE:    router SGEMM -> moe_route -> moe_group (device sort) -> expert GEMMs (grouped, by
//             device tile schedule) -> shared expert (SGEMMs) -> moe_combine (x +=)
//   logits = rmsnorm(x) @ lm_head^T                              rmsnorm + SGEMM
#include "model/cuda_model.h"

#ifdef KDTREE_HAVE_CUBLAS

#include <cuda.h>  // CUresult, CUdeviceptr (the driver entry points reached through the runtime)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <unordered_set>

#include "common.h"
#include "device_util.h"
#include "model/bf16.h"
#include "kernels.h"
#include "model/cublas_api.h"
#include "engine/round_kernels.h"
#include "model/model_kernels.h"

namespace kdtree {

namespace {

constexpr int64_t kAlignBytes = cuda::kArenaAlign;
constexpr int64_t kCublasWorkspace = 32ll << 20;
// bf16_weights_only: the most weight values widened at once for a cuBLAS product (64 MB)
constexpr int64_t kWidenMaxElems = int64_t(16) << 20;
// Steps of up to this many tokens run the dense projections through cuda::linear_skinny (the
// crossover with cuBLAS measured on the H200, docs/BENCHMARKS.md "Skinny linear layers vs cuBLAS").
constexpr int64_t kSkinnyAutoMaxT = 20;  // 17 = B 16 verify: 1.05x; 24: 0.95x
// A weight matrix larger than this (the H200's L2 is 50 MB) is re-read from HBM by every token
// slice of linear_skinny (at most 16 tokens a slice); such matrices (lm_head of mini-kimi: 131 MB)
// go to cuBLAS in steps of more than kSkinnyBigAutoMaxT tokens (skinny_big_max_tokens). H200,
// in-step (bench_cuda_step_options.py --variant big4:skinny_big_max_tokens=4): T = 17 1.380 ->
// 1.309 ms with lm_head on cuBLAS; T = 5 / 8 within noise (0.830 / 0.836, 1.032 / 1.024).
constexpr int64_t kSkinnyBigBytes = int64_t(48) << 20;
constexpr int64_t kSkinnyBigAutoMaxT = 16;
// The dense projections of a step of T tokens (CudaModel::gemm_nt): linear_tile for T up to
// kTileAutoMaxT (tile_max_tokens), and ahead of linear_skinny for kTileFirstMinT..kTileFirstMaxT
// tokens while skinny_max_tokens is auto; linear_skinny otherwise up to skinny_max_tokens; cuBLAS
// beyond. H200, mini-kimi in-step (bench_cuda_step_options.py, docs/BENCHMARKS.md "Tiled linear
// layer"): tile vs skinny T = 8 / 12 / 16: 0.916 / 1.074 / 1.218 vs 1.002 / 1.156 / 1.380 ms,
// T = 6 equal, T = 17 (skinny's two 9 + 8 token slices) 1.345 vs 1.275; T = 24 tile 1.429 vs
// cuBLAS 1.612. With 64-float k chunks (ninth session, --variant t64:tile_max_tokens=64): T = 33 /
// 48 tile 1.811 / 2.014 vs cuBLAS 1.862 / 2.078 ms; T = 65 (a 64-row tile + a 1-row one) not
// measured faster, so it stayed on cuBLAS. Twenty-second session: tiles of 48 and 72 token rows (a
// 65-token step in one tile, not 64 + 1), --variant t72:tile_max_tokens=72: T = 49 / 65 1.864 / 2.219
// -> 1.655 / 1.897 ms (T = 17 / 33 unchanged), hence 72.
constexpr int64_t kTileAutoMaxT = 72;
// Matrices of at most cuda::kLinearTileSmallBytes (32 MB as FP32; they stay in L2 through the
// call: every mini-kimi projection but the 131 MB head) stay on linear_tile up to kTileSmallAutoMaxT
// tokens while tile_max_tokens is auto, in 24-row tiles (linear_tile_rows); larger ones go to
// cuBLAS past 72. H200, mini-kimi in-step at context 512 (docs/BENCHMARKS.md "Twenty-sixth
// session", --variant old72:tile_max_tokens=72): T = 73 / 97 / 129 / 257 2.439 / 2.555 / 3.117 /
// 4.734 -> 1.990 / 2.206 / 2.677 / 4.288 ms. Prefill chunks (512 tokens) stay on cuBLAS.
constexpr int64_t kTileSmallAutoMaxT = 264;
constexpr int64_t kTileFirstMinT = 6, kTileFirstMaxT = 16;
// The head (past kSkinnyBigBytes) from 5 tokens (below, its RMSNorm runs inside linear_skinny): with
// four warps per row group on its 8-row tiles (linear_tile.cu, forty-fourth session) it takes 37.8 us
// there against 44.3 on skinny; in-step at T = 5 0.795 -> 0.785 ms (three rounds, T = 6 unchanged).
constexpr int64_t kTileFirstBigMinT = 5;
// 17-20 tokens (B = 16 trees): linear_tile also takes the projections of at least this many weight
// bytes (not the batched W_UK / W_UV heads: W_UK carries the query RoPE block on skinny, and W_UV
// measured faster there). H200, bench_cuda_linear_tile.py at T = 17, us skinny -> tile: qkv_a 6.5
// -> 5.4, o_proj 11.5 -> 9.6, router + shared gate/up (2.4 MB) 6.1 -> 5.1, dense gate/up 24.2 ->
// 15.0, down 15.8 -> 13.3; the shared expert's down projection (1 MB) 2.4 vs 5.5 stays on skinny.
constexpr int64_t kTileFirstLateMinBytes = int64_t(2) << 20;
// Row-exact steps (CudaModelOptions::row_exact): the routed experts' tensor-core tiles, of one height at any T
constexpr int kExactExpertRows = 16;
// ... and the attention's partials: at most this many bytes, or the longest key splits (docs/CUDA_MODEL.md)
constexpr int64_t kExactWorkspaceBytes = int64_t(256) << 20;
constexpr int kExactSplitMax = 4096;

std::string mib(int64_t bytes) {
  char b[64];
  snprintf(b, sizeof b, "%.1f MiB", (double)bytes / (1024.0 * 1024.0));
  return b;
}

using cuda::Arena;
using cuda::DeviceGuard;

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
cublasHandle_t as_handle(void* h) { return static_cast<cublasHandle_t>(h); }

// A device virtual address range of `bytes` (a multiple of 2 MiB) reserved with no memory mapped
// behind it (the driver's cuMemAddressReserve, found through the runtime: no link to libcuda): any
// access faults. nullptr and *err on failure.
void* reserve_address_range(int64_t bytes, std::string* err) {
  using Reserve = CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuMemAddressReserve", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess || !fn) {
    cudaGetLastError();
    *err = "the driver has no cuMemAddressReserve (virtual memory management)";
    return nullptr;
  }
  CUdeviceptr p = 0;
  const CUresult r = reinterpret_cast<Reserve>(fn)(&p, (size_t)bytes, 0, 0, 0);
  if (r != CUDA_SUCCESS || !p) {
    *err = "cannot reserve " + mib(bytes) + " of device addresses (cuMemAddressReserve error " + std::to_string((int)r) + ")";
    return nullptr;
  }
  return reinterpret_cast<void*>(p);
}

void release_address_range(void* p, int64_t bytes) {
  using Free = CUresult (*)(CUdeviceptr, size_t);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuMemAddressFree", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
      q == cudaDriverEntryPointSuccess && fn)
    reinterpret_cast<Free>(fn)(reinterpret_cast<CUdeviceptr>(p), (size_t)bytes);
  cudaGetLastError();
}

}  // namespace

void CudaModel::check_cuda(int err, const char* what) const {
  if (err == cudaSuccess) return;
  const cudaError_t e = static_cast<cudaError_t>(err);
  if (e == cudaErrorInvalidValue)
    throw RuntimeFailure(std::string("CudaModel: ") + what + " rejected its arguments (cudaErrorInvalidValue)");
  throw RuntimeFailure(std::string("CudaModel: ") + what + " failed: " + cudaGetErrorName(e) + " (" +
                       cudaGetErrorString(e) + ")");
}

void CudaModel::check_cublas(int status, const char* what) const {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  const cuda::CublasApi& api = cuda::cublas_api();
  throw RuntimeFailure(std::string("CudaModel: cuBLAS ") + what + " failed: " +
                       api.status_string(static_cast<cublasStatus_t>(status)));
}

std::string CudaModel::cublas_path() const { return cuda::cublas_api().path; }

// Every product of a bf16_weights_only model must run on a kernel that reads the BF16 form, or on
// cuBLAS after widening: inner sizes (and the strides built from them) in whole 16-byte pieces of
// BF16, the tensor-core tiles, no SGEMM expert tiles.
std::string CudaModel::bf16_only_unsupported(const ModelConfig& c, const CudaModelOptions& opt) {
  const int64_t nL = c.num_hidden_layers;
  const bool any_moe = c.first_k_dense_replace < nL, any_dense = c.first_k_dense_replace > 0;
  const int64_t Is = c.moe_intermediate_size * std::max<int64_t>(c.n_shared_experts, 0);
  std::vector<std::pair<const char*, int64_t>> sizes = {
      {"hidden_size", c.hidden_size}, {"kv_lora_rank", c.kv_lora_rank}, {"qk_nope_head_dim", c.qk_nope_head_dim},
      {"qk_rope_head_dim", c.qk_rope_head_dim}, {"v_head_dim", c.v_head_dim}};
  if (c.q_lora_rank > 0) sizes.push_back({"q_lora_rank", c.q_lora_rank});
  if (any_dense) sizes.push_back({"intermediate_size", c.intermediate_size});
  if (any_moe) sizes.push_back({"moe_intermediate_size", c.moe_intermediate_size});
  if (any_moe && Is > 0) sizes.push_back({"n_routed_experts (the shared expert's rows follow the router's)", c.n_routed_experts});
  for (const auto& x : sizes)
    if (x.second % 8)
      return std::string("needs ") + x.first + " to be a multiple of 8, got " + std::to_string(x.second) +
             " (bf16_weights='copies' holds FP32 and BF16 forms for any shape)";
  if (!opt.tile_tensor_cores) return "needs tile_tensor_cores=True (the FP32 tiles read FP32 weights)";
  if (opt.expert_kernel == CudaModelOptions::kExpertTiled) return "cannot run expert_kernel='tiled' (it reads FP32 weights)";
  return "";
}

std::string CudaModel::matrix_block(const ModelConfig& c, const std::string& name) {
  for (const WeightSpec& w : model_weight_specs(c))
    if (w.name == name) return w.shape.size() == 2 ? block_of(name) : "";
  return "";
}

std::string CudaModel::block_of(const std::string& name) {
  if (name == "lm_head.weight") return "lm_head";
  if (name == "model.embed_tokens.weight") return "embed";
  const std::string pre = "model.layers.";
  const size_t dot = name.find('.', pre.size());
  const std::string layer = name.substr(pre.size(), dot - pre.size()), rest = name.substr(dot + 1);
  auto has = [&](const char* s) { return rest.find(s) != std::string::npos; };
  const char* block = has("q_a_proj") || has("kv_a_proj_with_mqa") ? "qkv_a"
                      : has("q_b_proj") || has("q_proj")            ? "q_b"
                      : has("kv_b_proj")                            ? "kv_b"
                      : has("o_proj")                               ? "o_proj"
                      : has("mlp.experts.")                         ? (has("down_proj") ? "experts_down" : "experts_gate_up")
                      : has("mlp.gate.") || (has("shared_experts") && !has("down_proj")) ? "router"
                      : has("shared_experts")                       ? "shared_down"
                      : has("down_proj")                            ? "mlp_down"
                                                                    : "mlp_gate_up";
  return layer + "." + block;
}

std::string CudaModel::int4_experts_unsupported(const ModelConfig& c, const CudaModelOptions& opt, int64_t g) {
  if (g < 32 || (g & (g - 1)) != 0) return "needs a group of a power of two >= 32, got " + std::to_string(g);
  if (c.first_k_dense_replace >= c.num_hidden_layers || c.n_routed_experts <= 0) return "needs routed experts (a MoE layer)";
  if (c.hidden_size % g || c.moe_intermediate_size % g)
    return "needs hidden_size (" + std::to_string(c.hidden_size) + ") and moe_intermediate_size (" +
           std::to_string(c.moe_intermediate_size) + ") to be multiples of the group (" + std::to_string(g) + ")";
  if (opt.expert_kernel == CudaModelOptions::kExpertTiled) return "cannot run expert_kernel='tiled' (it reads FP32 weights)";
  return "";
}

CudaModel::CudaModel(const ModelConfig& cfg, int64_t max_seq_len, const CudaModelOptions& opt)
    : cfg_(cfg), max_seq_len_(max_seq_len), opt_(opt) {
  cfg_.validate();
  const ModelConfig& c = cfg_;
  if (max_seq_len <= 0) throw Error("CudaModel: max_seq_len must be > 0, got " + std::to_string(max_seq_len));
  if (max_seq_len > (1ll << 30)) throw Error("CudaModel: max_seq_len " + std::to_string(max_seq_len) + " is too large");
  if (opt.max_tokens < 0) throw Error("CudaModel: max_tokens must be >= 0 (0 = default)");
  max_tokens_ = opt.max_tokens > 0 ? std::min<int64_t>(opt.max_tokens, max_seq_len) : std::min<int64_t>(max_seq_len, 1025);
  if (max_tokens_ > (1 << 20)) throw Error("CudaModel: max_tokens must be <= 2^20");
  if (opt.math < 0 || opt.math > 2) throw Error("CudaModel: math must be 0 (default), 1 (pedantic) or 2 (tf32)");
  if (opt.attention_kernel < 0 || opt.attention_kernel > 4)
    throw Error("CudaModel: attention_kernel must be 0 (auto), 1 (tiled), 2 (split-KV), 3 (decode) or 4 (tensor cores)");
  if (opt.expert_kernel < 0 || opt.expert_kernel > 3)
    throw Error("CudaModel: expert_kernel must be 0 (auto), 1 (skinny), 2 (tiled) or 3 (mma)");
  if (opt.expert_mma_rows != 0 && opt.expert_mma_rows != 8 && opt.expert_mma_rows != 16 && opt.expert_mma_rows != 32 &&
      opt.expert_mma_rows != 64)
    throw Error("CudaModel: expert_mma_rows must be 0 (auto), 8, 16, 32 or 64, got " + std::to_string(opt.expert_mma_rows));
  if (opt.q_fold_max_tokens < -1)
    throw Error("CudaModel: q_fold_max_tokens must be -1 (auto), 0 (never) or a token count, got " +
                std::to_string(opt.q_fold_max_tokens));
  if (opt.context_buckets != 1 && opt.context_buckets != 2 && opt.context_buckets != 4 && opt.context_buckets != 8)
    throw Error("CudaModel: context_buckets must be 1, 2, 4 or 8, got " + std::to_string(opt.context_buckets));
  if (opt.bf16_widen_elements < 0)
    throw Error("CudaModel: bf16_widen_elements must be >= 0 (0 = default), got " + std::to_string(opt.bf16_widen_elements));
  if (opt.uv_combine_max_tokens < 0 || opt.uv_combine_max_tokens > cuda::kUvMaxT)
    throw Error("CudaModel: uv_combine_max_tokens must be 0.." + std::to_string(cuda::kUvMaxT) + ", got " +
                std::to_string(opt.uv_combine_max_tokens));
  if (opt.skinny_max_tokens < -1 || opt.skinny_max_tokens > cuda::kLinearSkinnyMaxT)
    throw Error("CudaModel: skinny_max_tokens must be -1 (auto) or in [0, " + std::to_string(cuda::kLinearSkinnyMaxT) +
                "], got " + std::to_string(opt.skinny_max_tokens));
  skinny_max_t_ = opt.skinny_max_tokens < 0 ? kSkinnyAutoMaxT : opt.skinny_max_tokens;
  if (opt.skinny_big_max_tokens < -1 || opt.skinny_big_max_tokens > cuda::kLinearSkinnyMaxT)
    throw Error("CudaModel: skinny_big_max_tokens must be -1 (auto) or in [0, " +
                std::to_string(cuda::kLinearSkinnyMaxT) + "], got " + std::to_string(opt.skinny_big_max_tokens));
  skinny_big_max_t_ = opt.skinny_big_max_tokens < 0 ? kSkinnyBigAutoMaxT : opt.skinny_big_max_tokens;
  if (opt.tile_max_tokens < -1) throw Error("CudaModel: tile_max_tokens must be -1 (auto) or >= 0, got " + std::to_string(opt.tile_max_tokens));
  tile_max_t_ = opt.tile_max_tokens < 0 ? kTileAutoMaxT : opt.tile_max_tokens;
  const int64_t Dm = c.hidden_size, H = c.num_attention_heads, C = c.kv_lora_rank, R = c.qk_rope_head_dim;
  const int64_t Dn = c.qk_nope_head_dim, Dv = c.v_head_dim, Dqk = c.qk_head_dim(), CR = C + R;
  const int64_t qr = c.q_lora_rank, V = c.vocab_size, Tm = max_tokens_;
  const int64_t nL = c.num_hidden_layers;
  const bool any_moe = c.first_k_dense_replace < nL, any_dense = c.first_k_dense_replace > 0;
  const int64_t E = any_moe ? c.n_routed_experts : 0, K = any_moe ? c.num_experts_per_tok : 0;
  const int64_t Ie = c.moe_intermediate_size, Is = Ie * std::max<int64_t>(c.n_shared_experts, 0);
  if (any_moe && E > 1024) throw Error("CudaModel: at most 1024 routed experts are supported, got " + std::to_string(E));
  if (any_moe && K > 64) throw Error("CudaModel: at most 64 experts per token are supported, got " + std::to_string(K));
  if (C > 2048) throw Error("CudaModel: kv_lora_rank > 2048 is not supported by verify_attention");
  if (opt.row_exact) {  // every product of a row-exact step runs on linear_tile, whose rows are read in float4s
    std::string bad;
    auto need4 = [&](const char* what, int64_t v, bool used) {
      if (used && v % 4 != 0) bad += std::string(bad.empty() ? "" : ", ") + what + " = " + std::to_string(v);
    };
    need4("hidden_size", Dm, true);
    need4("q_lora_rank", qr, qr > 0);
    need4("kv_lora_rank", C, true);
    need4("qk_rope_head_dim", R, true);
    need4("qk_nope_head_dim", Dn, true);
    need4("num_attention_heads x v_head_dim", H * Dv, true);
    need4("intermediate_size", c.intermediate_size, any_dense);
    need4("moe_intermediate_size", Ie, any_moe);
    if (!bad.empty())
      throw Error("CudaModel: row_exact needs these sizes to be multiples of 4 (its products run on linear_tile): " +
                  bad);
  }
  for (int64_t v : {Dm, V, H * Dqk, qr + CR, H * C, Tm * K, Tm * std::max<int64_t>(E, 1)})
    if (v >= (1ll << 31)) throw Error("CudaModel: a dimension exceeds the 32-bit range of the kernels");
  if (opt.bf16_weights_only) {
    const std::string why = bf16_only_unsupported(c, opt);
    if (!why.empty()) throw Error("CudaModel: bf16_weights_only " + why);
  }
  if (opt.int4_experts_group != 0) {
    const std::string why = int4_experts_unsupported(c, opt, opt.int4_experts_group);
    if (!why.empty()) throw Error("CudaModel: int4_experts_group " + why);
  }
  std::unordered_set<std::string> fp32_blocks;  // fp32_matrices' storage blocks
  std::unordered_set<std::string> matrices;      // the config's 2-D weights, listed once (fp32_matrices may name
  if (!opt.fp32_matrices.empty())                // tens of thousands: every expert of an FP8 checkpoint)
    for (const WeightSpec& w : model_weight_specs(c))
      if (w.shape.size() == 2) matrices.insert(w.name);
  for (const std::string& n : opt.fp32_matrices) {
    const std::string b = matrices.count(n) ? block_of(n) : "";
    if (b.empty())
      throw Error("CudaModel: fp32_matrices: '" + n + "' is not a weight matrix of this config (HF names of 2-D "
                  "weights)");
    if (opt.int4_experts_group > 0 && b.find(".experts_") != std::string::npos)
      throw Error("CudaModel: fp32_matrices: '" + n + "' is a routed expert, held as 4-bit integers (int4_experts_group)");
    fp32_blocks.insert(b);
  }

  // ---- device, stream, cuBLAS
  std::string why;
  int ndev = 0;
  cudaError_t ce = cudaGetDeviceCount(&ndev);
  if (ce != cudaSuccess || ndev == 0) {
    cudaGetLastError();
    throw RuntimeFailure(std::string("CudaModel: no usable CUDA device (") +
                         (ce != cudaSuccess ? cudaGetErrorString(ce) : "no CUDA device found") + ")");
  }
  if (opt.device < 0 || opt.device >= ndev)
    throw Error("CudaModel: device " + std::to_string(opt.device) + " out of range (" + std::to_string(ndev) +
                " device(s))");
  DeviceGuard guard(opt.device);
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, opt.device), "cudaGetDeviceProperties");
  device_name_ = std::string(prop.name) + " (sm_" + std::to_string(prop.major * 10 + prop.minor) + ")";
  const cuda::CublasApi& api = cuda::cublas_api();  // throws naming the paths tried
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  stream_ = stream;
  if (opt.side_stream) {
    cudaStream_t side;
    check_cuda(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreate(side)");
    side_ = side;
    cudaEvent_t ev;
    check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    ev_fork_ = ev;
    check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    ev_join_ = ev;
  }

  // ---- weights (one arena), in the order of model_weight_specs. bf16_weights_only: the matrices
  // (mat) in an arena of their own, committed to a reserved address range with no memory behind it
  // (their FP32 addresses, which bf16_of maps onto the BF16 arena; the embedding among them); the vectors in w.
  const bool only = opt.bf16_weights_only, q4 = opt.int4_experts_group > 0;
  // the folded query rows: by default only where their extra bytes a layer over q_b's (read in the steps the fold
  // takes) stay under kQFoldAutoMaxExtraBytes, ~4 us at the H200's bandwidth, less than the two dependent
  // kernels the fold removes (mini-kimi: 7.9 MB; Kimi K2's shapes: 277 MB, never by default)
  const int64_t fold_extra = H * Dqk * (c.hidden_size - qr) * (int64_t)sizeof(float);
  q_fold_max_t_ = opt.q_fold_max_tokens >= 0                       ? opt.q_fold_max_tokens
                  : fold_extra <= CudaModelOptions::kQFoldAutoMaxExtraBytes ? CudaModelOptions::kQFoldAutoMaxT
                                                                   : 0;
  fold_rows_ = q_fold_max_t_ >= CudaModelOptions::kQFoldMinT && qr > 0 && !only ? H * Dqk : 0;
  Arena w, wm, wq;  // wq: the INT4 expert stacks' FP32 addresses (reserved, never backed)
  // a matrix of block `key` (matrix_block): with "only", in the BF16 range unless fp32_matrices names it
  std::string lp;  // the layer's prefix of the block keys
  auto mat = [&](float** where, int64_t count, const char* key) {
    (only && !fp32_blocks.count(lp + key) ? wm : w).add(where, count);
  };
  auto xmat = [&](float** where, int64_t count, const char* key) {
    if (q4) wq.add(where, count);
    else mat(where, count, key);
  };
  mat(&embed_, V * Dm, "embed");  // ("only": BF16 alone too; the embedding kernel and a tied head read that)
  w.add(&final_ln_, Dm);
  if (!c.tie_word_embeddings) mat(&lm_head_, V * Dm, "lm_head");
  w.add(&inv_freq_, R / 2);
  layers_.resize((size_t)nL);
  for (int64_t l = 0; l < nL; ++l) {
    Layer& ly = layers_[(size_t)l];
    lp = std::to_string(l) + ".";
    w.add(&ly.input_ln, Dm);
    w.add(&ly.post_ln, Dm);
    mat(&ly.qkv_a, (qr + CR + fold_rows_) * Dm, "qkv_a");  // (+ the folded query rows, finalize())
    if (qr > 0) {
      w.add(&ly.q_a_ln, qr);
      mat(&ly.q_b, H * Dqk * qr, "q_b");
    } else {
      mat(&ly.q_b, H * Dqk * Dm, "q_b");
    }
    w.add(&ly.kv_a_ln, C);
    mat(&ly.w_ukT, H * Dn * C, "kv_b");
    mat(&ly.w_uv, H * Dv * C, "kv_b");
    mat(&ly.o_proj, Dm * H * Dv, "o_proj");
    ly.moe = c.is_moe_layer(l);
    if (!ly.moe) {
      mat(&ly.mlp_gate_up, 2 * c.intermediate_size * Dm, "mlp_gate_up");
      mat(&ly.mlp_down, Dm * c.intermediate_size, "mlp_down");
    } else {
      ly.moe_index = (int)n_moe_layers_++;
      // router rows then (Is > 0) the shared expert's gate/up rows, contiguous: one projection
      // serves both for few tokens (moe_mlp)
      mat(&ly.router, (E + 2 * Is) * Dm, "router");
      w.add(&ly.router_bias, E);
      xmat(&ly.experts_gate_up, E * 2 * Ie * Dm, "experts_gate_up");
      xmat(&ly.experts_down, E * Dm * Ie, "experts_down");
      if (Is > 0) mat(&ly.shared_down, Dm * Is, "shared_down");
    }
  }
  weight_bytes_ = w.bytes;
  cache_bytes_ = nL * max_seq_len * CR * (int64_t)sizeof(float);

  // ---- workspaces (one arena), sized for Tm tokens
  Arena ws;
  const int64_t A = Tm * K;
  vis_words_ = (Tm + 63) / 64;
  int64_t gu_rows_cols = 0;  // floats of gu: max over dense, shared and tiled-expert uses
  if (any_dense) gu_rows_cols = std::max(gu_rows_cols, Tm * 2 * c.intermediate_size);
  if (any_moe) gu_rows_cols = std::max({gu_rows_cols, Tm * 2 * Is, A * 2 * Ie});
  ws.add(&x_, Tm * Dm);
  ws.add(&hn_, Tm * Dm);
  ws.add(&qkv_a_out_, Tm * (qr + CR + fold_rows_));
  if (fold_rows_) ws.add(&q_scale_, Tm);
  ws.add(&q_, Tm * H * Dqk);
  ws.add(&q_lat_, Tm * H * C);
  ws.add(&q_rope_, Tm * H * R);
  ws.add(&rope_cs_, Tm * R);
  ws.add(&o_lat_, Tm * H * C);
  ws.add(&ov_, Tm * H * Dv);
  ws.add(&gu_, gu_rows_cols);
  ws.add(&act_, gu_rows_cols / 2);
  if (any_moe) {
    max_tiles_ = cuda::moe_max_tiles((int)A, (int)E, cuda::kExpertSkinnyRows);
    ws.add(&ye_, A * Dm);
    if (Is > 0) ws.add(&ys_, Tm * Dm);
    if (Is > 0) ws.add(&acts_, Tm * Is);
    ws.add(&router_logits_, Tm * (E + 2 * Is));  // [T, E] or, merged, [T, E + 2 Is]
    ws.add(&topk_idx_, A);
    ws.add(&topk_w_, A);
    ws.add(&expert_counts_, n_moe_layers_ * E);
    ws.add(&offsets_, E + 1);
    ws.add(&slot_token_, A);
    ws.add(&slot_of_, A);
    ws.add(&tile_expert_, max_tiles_);
    ws.add(&tile_row0_, max_tiles_);
    ws.add(&num_tiles_, 1);
  }
  ws.add(&logits_, Tm * V);
  ws.add(&d_tokens_, Tm);
  ws.add(&d_positions_, Tm);
  ws.add(&d_keep_, max_seq_len + 1);
  ws.add(&d_vis_, Tm * vis_words_);
  ws.add(&d_causal_, Tm * vis_words_);
  ws.add(&d_len_, 1);
  {
    // verify_attention's split-K workspace: the largest over every T <= Tm at the longest
    // context it can meet (its split count grows with L).
    cuda::VerifyAttentionParams vp{};
    vp.q_latent = vp.q_rope = vp.kv = vp.out = reinterpret_cast<float*>(kAlignBytes);
    vp.visibility = reinterpret_cast<const uint64_t*>(kAlignBytes);
    vp.kv_stride = (int)CR;
    vp.H = (int)H;
    vp.C = (int)C;
    vp.R = (int)R;
    vp.scale = 1.f;
    vp.force_naive = opt.attention_naive ? 1 : 0;
    vp.force_kernel = opt.attention_kernel;
    size_t mx = 0;
    for (int64_t T = 1; T <= Tm; ++T) {
      vp.T = (int)T;
      vp.vis_stride = (int)vis_words_;
      vp.L = (int)(max_seq_len - T);
      mx = std::max(mx, cuda::verify_attention_workspace_bytes(vp));
    }
    if (opt.row_exact) {  // the row-exact kernel's partials: keys per split doubled from the default while they
      vp.exact = 1;       // would need more than kExactWorkspaceBytes (a constant of the model: part of the bits)
      for (exact_split_ = cuda::kVerifyExactSplitDefault;; exact_split_ *= 2) {
        vp.exact_split = exact_split_;
        size_t ex = 0;
        for (int64_t T = 1; T <= std::min(Tm, CudaModelOptions::kRowExactMaxT); ++T) {
          vp.T = (int)T;
          vp.L = (int)(max_seq_len - T);
          ex = std::max(ex, cuda::verify_attention_workspace_bytes(vp));
        }
        if (ex <= (size_t)kExactWorkspaceBytes || exact_split_ >= kExactSplitMax) {
          mx = std::max(mx, ex);
          break;
        }
      }
    }
    attn_ws_bytes_ = (int64_t)mx;
  }
  ws.add(reinterpret_cast<char**>(&attn_ws_), attn_ws_bytes_);
  cublas_ws_bytes_ = kCublasWorkspace;
  ws.add(reinterpret_cast<char**>(&cublas_ws_), cublas_ws_bytes_);
  if (only) {
    // the widened weights of a cuBLAS product: a whole per-head matrix (W_UK, W_UV: one batched call),
    // else up to kWidenMaxElems floats, the product run block of rows by block of rows
    int64_t big = std::max({(qr + CR) * Dm, H * Dqk * std::max<int64_t>(qr, Dm), Dm * H * Dv, V * Dm});
    if (any_dense) big = std::max({big, 2 * c.intermediate_size * Dm});
    if (any_moe) big = std::max({big, (E + 2 * Is) * Dm, Dm * Is});
    const int64_t cap = opt.bf16_widen_elements > 0 ? opt.bf16_widen_elements : kWidenMaxElems;
    widen_elems_ = std::max({std::min(big, cap), H * Dn * C, H * Dv * C, Dm, H * Dv, c.intermediate_size, Is});
    ws.add(&widen_, widen_elems_);
  }
  workspace_bytes_ = ws.bytes;

  // ---- allocate: a clear error with the sizes when the device has too little memory
  auto oom = [&](const char* what, int64_t bytes, cudaError_t err) {
    cudaGetLastError();
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    cudaGetLastError();
    std::string msg = std::string("CudaModel: cannot allocate the ") + what + " (" + mib(bytes) + ") on " +
                      device_name_ + ": " + cudaGetErrorString(err) + ". Asked for weights " +
                      mib(weight_bytes_ + (only ? cuda::arena_align_up(wm.bytes / 2) : 0) + q4_bytes_) +
                      " + latent cache " + mib(cache_bytes_) + " (max_seq_len " + std::to_string(max_seq_len) +
                      ") + workspaces " + mib(workspace_bytes_) + " (max_tokens " + std::to_string(Tm) +
                      "); the device has " + mib((int64_t)fr) + " free of " + mib((int64_t)tot) +
                      ". Lower max_seq_len or max_tokens.";
    throw RuntimeFailure(msg);
  };
  // An arena's FP32 addresses in a reserved device range with nothing behind it (whole 2 MiB pages)
  auto reserve = [](Arena& a, void** va, int64_t* bytes, const float** begin, const float** end, const char* what) {
    std::string err;
    *bytes = (a.bytes + (int64_t(2) << 20) - 1) / (int64_t(2) << 20) * (int64_t(2) << 20);
    *va = reserve_address_range(*bytes, &err);
    if (!*va) throw RuntimeFailure(std::string("CudaModel: ") + what + ": " + err);
    a.commit(*va);
    *begin = static_cast<const float*>(*va);
    *end = *begin + a.bytes / (int64_t)sizeof(float);
  };
  // From here on a throw must release what was taken: the destructor does not run.
  try {
    cudaError_t e;
    if ((e = cudaMalloc(&weights_mem_, (size_t)weight_bytes_)) != cudaSuccess) oom("weights", weight_bytes_, e);
    w.commit(weights_mem_);
    if (only && wm.bytes > 0) {  // (fp32_matrices may name every matrix: then nothing is held as BF16)
      // the matrices: FP32 addresses reserved, never backed; their values in one BF16 range
      reserve(wm, &mat_va_, &mat_va_bytes_, &mat_begin_, &mat_end_, "bf16_weights_only");
      bf16_bytes_ = cuda::arena_align_up(wm.bytes / 2);
      if ((e = cudaMalloc(&bf16_mem_, (size_t)bf16_bytes_)) != cudaSuccess) oom("BF16 weights", bf16_bytes_, e);
      check_cuda(cudaMemsetAsync(bf16_mem_, 0, (size_t)bf16_bytes_, stream), "cudaMemset(BF16 weights)");
      bf16_ranges_.push_back(Bf16Range{mat_begin_, mat_end_, 0});
    }
    if (q4) {
      // the INT4 expert stacks: FP32 addresses reserved (never backed), per stack its nibbles (half a byte a
      // value) and its scales (a float a group) in one allocation
      reserve(wq, &q_va_, &q_va_bytes_, &q_begin_, &q_end_, "int4_experts_group");
      int64_t off = 0;
      for (const Layer& ly : layers_) {
        if (!ly.moe) continue;
        for (const auto& st : {std::make_pair(ly.experts_gate_up, E * 2 * Ie * Dm), std::make_pair(ly.experts_down, E * Dm * Ie)}) {
          Q4Range r{st.first, st.first + st.second, off, 0};
          off += cuda::arena_align_up(st.second / 2);
          r.scale_off = off;
          off += cuda::arena_align_up(st.second / opt.int4_experts_group * (int64_t)sizeof(float));
          q4_ranges_.push_back(r);
        }
      }
      std::sort(q4_ranges_.begin(), q4_ranges_.end(), [](const Q4Range& a, const Q4Range& b) { return a.begin < b.begin; });
      q4_bytes_ = off;
      if ((e = cudaMalloc(&q4_mem_, (size_t)std::max<int64_t>(q4_bytes_, 1))) != cudaSuccess) oom("INT4 experts", q4_bytes_, e);
      check_cuda(cudaMemsetAsync(q4_mem_, 0, (size_t)q4_bytes_, stream), "cudaMemset(INT4 experts)");
    }
    for (Layer& ly : layers_)
      if (ly.moe && Is > 0) ly.shared_gate_up = ly.router + E * Dm;  // right after the router rows
    if ((e = cudaMalloc(&cache_mem_, (size_t)std::max<int64_t>(cache_bytes_, 1))) != cudaSuccess)
      oom("latent cache", cache_bytes_, e);
    for (int64_t l = 0; l < nL; ++l) layers_[(size_t)l].cache = static_cast<float*>(cache_mem_) + l * max_seq_len * CR;
    if ((e = cudaMalloc(&work_mem_, (size_t)workspace_bytes_)) != cudaSuccess) oom("workspaces", workspace_bytes_, e);
    ws.commit(work_mem_);
    if (attn_ws_bytes_ == 0) attn_ws_ = nullptr;
    d_count_ = d_keep_ + max_seq_len;

    Arena hs;
    hs.add(&h_tokens_, Tm);
    hs.add(&h_positions_, Tm);
    hs.add(&h_keep_, max_seq_len + 1);
    hs.add(&h_vis_, Tm * vis_words_);
    host_bytes_ = hs.bytes;
    if ((e = cudaHostAlloc(&host_mem_, (size_t)host_bytes_, cudaHostAllocDefault)) != cudaSuccess)
      oom("pinned host staging", host_bytes_, e);
    hs.commit(host_mem_);

    // Zero everything once (unset weights read as 0, never as garbage), the RoPE table, the
    // causal mask for any T <= Tm.
    check_cuda(cudaMemsetAsync(weights_mem_, 0, (size_t)weight_bytes_, stream), "cudaMemset(weights)");
    check_cuda(cudaMemsetAsync(cache_mem_, 0, (size_t)std::max<int64_t>(cache_bytes_, 1), stream), "cudaMemset(cache)");
    check_cuda(cudaMemsetAsync(work_mem_, 0, (size_t)workspace_bytes_, stream), "cudaMemset(workspace)");
    check_cuda(cudaMemcpyAsync(inv_freq_, c.rope_inv_freq.data(), c.rope_inv_freq.size() * sizeof(float),
                               cudaMemcpyHostToDevice, stream),
               "upload rope_inv_freq");
    check_cuda(cuda::causal_bits(d_causal_, (int)Tm, (int)vis_words_, stream), "causal_bits");

    cublasHandle_t h = nullptr;
    check_cublas(api.create(&h), "create");
    cublas_ = h;
    check_cublas(api.set_stream(h, stream), "set_stream");
    const cublasMath_t mode = opt.math == CudaModelOptions::kMathTf32       ? CUBLAS_TF32_TENSOR_OP_MATH
                              : opt.math == CudaModelOptions::kMathPedantic ? CUBLAS_PEDANTIC_MATH
                                                                           : CUBLAS_DEFAULT_MATH;
    check_cublas(api.set_math_mode(h, mode), "set_math_mode");
    check_cublas(api.set_workspace(h, cublas_ws_, (size_t)cublas_ws_bytes_), "set_workspace");
    check_cuda(cudaStreamSynchronize(stream), "initialisation");
  } catch (...) {
    if (cublas_) api.destroy(as_handle(cublas_));
    if (host_mem_) cudaFreeHost(host_mem_);
    if (work_mem_) cudaFree(work_mem_);
    if (cache_mem_) cudaFree(cache_mem_);
    if (weights_mem_) cudaFree(weights_mem_);
    if (bf16_mem_) cudaFree(bf16_mem_);
    if (q4_mem_) cudaFree(q4_mem_);
    if (mat_va_) release_address_range(mat_va_, mat_va_bytes_);
    if (q_va_) release_address_range(q_va_, q_va_bytes_);
    cudaStreamDestroy(stream);
    throw;
  }

  // ---- HF name -> where it lands
  std::unordered_map<std::string, float*> where;
  where["model.embed_tokens.weight"] = embed_;
  where["model.norm.weight"] = final_ln_;
  if (!c.tie_word_embeddings) where["lm_head.weight"] = lm_head_;
  for (int64_t l = 0; l < nL; ++l) {
    Layer& ly = layers_[(size_t)l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    where[p + "input_layernorm.weight"] = ly.input_ln;
    where[p + "post_attention_layernorm.weight"] = ly.post_ln;
    if (qr > 0) {
      where[p + "self_attn.q_a_proj.weight"] = ly.qkv_a;
      where[p + "self_attn.q_a_layernorm.weight"] = ly.q_a_ln;
      where[p + "self_attn.q_b_proj.weight"] = ly.q_b;
    } else {
      where[p + "self_attn.q_proj.weight"] = ly.q_b;
    }
    where[p + "self_attn.kv_a_proj_with_mqa.weight"] = ly.qkv_a + qr * Dm;
    where[p + "self_attn.kv_a_layernorm.weight"] = ly.kv_a_ln;
    where[p + "self_attn.o_proj.weight"] = ly.o_proj;
    if (!ly.moe) {
      const int64_t I = c.intermediate_size;
      where[p + "mlp.gate_proj.weight"] = ly.mlp_gate_up;
      where[p + "mlp.up_proj.weight"] = ly.mlp_gate_up + I * Dm;
      where[p + "mlp.down_proj.weight"] = ly.mlp_down;
    } else {
      where[p + "mlp.gate.weight"] = ly.router;
      where[p + "mlp.gate.e_score_correction_bias"] = ly.router_bias;
      for (int64_t e = 0; e < E; ++e) {
        const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
        float* gu = ly.experts_gate_up + e * 2 * Ie * Dm;
        where[q + "gate_proj.weight"] = gu;
        where[q + "up_proj.weight"] = gu + Ie * Dm;
        where[q + "down_proj.weight"] = ly.experts_down + e * Dm * Ie;
      }
      if (Is > 0) {
        where[p + "mlp.shared_experts.gate_proj.weight"] = ly.shared_gate_up;
        where[p + "mlp.shared_experts.up_proj.weight"] = ly.shared_gate_up + Is * Dm;
        where[p + "mlp.shared_experts.down_proj.weight"] = ly.shared_down;
      }
    }
  }
  for (const WeightSpec& s : model_weight_specs(c)) {
    Slot slot;
    slot.shape = s.shape;
    auto it = where.find(s.name);
    if (it != where.end()) {
      slot.dst = it->second;
    } else if (s.name.find("self_attn.kv_b_proj.weight") != std::string::npos) {
      slot.kind = kKvB;
      slot.layer = std::stoll(s.name.substr(13));  // after "model.layers."
    } else {
      throw RuntimeFailure("CudaModel: internal error, no storage for " + s.name);
    }
    slots_.emplace(s.name, std::move(slot));
    slot_order_.push_back(s.name);
  }
}

CudaModel::~CudaModel() {
  DeviceGuard guard(opt_.device);
  if (stream_) cudaStreamSynchronize(as_stream(stream_));
  if (side_) cudaStreamSynchronize(as_stream(side_));
  clear_graphs();
  if (cublas_) {
    std::string info;
    if (cuda::cublas_probe(&info)) cuda::cublas_api().destroy(as_handle(cublas_));
  }
  if (host_mem_) cudaFreeHost(host_mem_);
  if (work_mem_) cudaFree(work_mem_);
  if (cache_mem_) cudaFree(cache_mem_);
  if (weights_mem_) cudaFree(weights_mem_);
  if (bf16_mem_) cudaFree(bf16_mem_);
  if (q4_mem_) cudaFree(q4_mem_);
  if (mat_va_) release_address_range(mat_va_, mat_va_bytes_);
  if (q_va_) release_address_range(q_va_, q_va_bytes_);
  if (stream_) cudaStreamDestroy(as_stream(stream_));
  if (side_) cudaStreamDestroy(as_stream(side_));
  if (ev_fork_) cudaEventDestroy(static_cast<cudaEvent_t>(ev_fork_));
  if (ev_join_) cudaEventDestroy(static_cast<cudaEvent_t>(ev_join_));
  cudaGetLastError();
}

void* CudaModel::fork() {
  if (!side_) return stream_;
  check_cuda(cudaEventRecord(static_cast<cudaEvent_t>(ev_fork_), as_stream(stream_)), "cudaEventRecord(fork)");
  check_cuda(cudaStreamWaitEvent(as_stream(side_), static_cast<cudaEvent_t>(ev_fork_), 0), "cudaStreamWaitEvent(fork)");
  return side_;
}

void CudaModel::join() {
  if (!side_) return;
  check_cuda(cudaEventRecord(static_cast<cudaEvent_t>(ev_join_), as_stream(side_)), "cudaEventRecord(join)");
  check_cuda(cudaStreamWaitEvent(as_stream(stream_), static_cast<cudaEvent_t>(ev_join_), 0), "cudaStreamWaitEvent(join)");
}

// ---------------------------------------------------------------- weights
void CudaModel::set_weight(const std::string& name, const float* data, const std::vector<int64_t>& shape) {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  auto it = slots_.find(name);
  if (it == slots_.end()) {
    std::string hint;
    if (name == "lm_head.weight" && cfg_.tie_word_embeddings) hint = " (tie_word_embeddings: the embedding is used)";
    throw Error("set_weight: unexpected tensor '" + name + "' for this config" + hint);
  }
  Slot& s = it->second;
  if (shape != s.shape)
    throw Error("set_weight: '" + name + "' has shape " + shape_str(shape) + ", the config needs " +
                shape_str(s.shape));
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (n > 0 && data == nullptr) throw Error("set_weight: null data for '" + name + "'");
  if (int4_held(s.dst))
    throw Error("set_weight: '" + name + "' is a routed expert's matrix, held as 4-bit integers (int4_experts_group = " +
                std::to_string(opt_.int4_experts_group) + "): give its integers and scales with set_weight_int4");
  DeviceGuard guard(opt_.device);
  if (upload_bf16_ok(s)) {  // bf16_weights_only: a matrix, held as BF16 alone
    if (!kdtree::bf16_exact(data, n)) {
      int64_t i = 0;
      while (i < n && kdtree::bf16_exact(data + i, 1)) ++i;  // the first value that is not
      throw Error("set_weight: '" + name + "' holds a value that is not exactly BF16 (flat index " + std::to_string(i) +
                  ": " + std::to_string(data[i]) + "); with bf16_weights_only the matrices are held as BF16 alone: "
                  "pass bf16_weights='copies' (FP32 and BF16 copies) for such a checkpoint");
    }
    std::vector<uint16_t> bits((size_t)n);
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, data + i, 4);
      bits[(size_t)i] = (uint16_t)(u >> 16);
    }
    upload_bf16(s, bits.data());
    s.bf16_exact = true;
    s.set = true;
    finalized_ = false;
    return;
  }
  // exactly BF16 (a BF16 checkpoint widened to float32)? Its copy comes at finalize (with the option on).
  // (values_bf16: read for q_a / kv_a alone, by finalize()'s q fold; the full scan only where it is needed)
  const bool qkv_a = name.find("q_a_proj.weight") != std::string::npos ||
                     name.find("kv_a_proj_with_mqa.weight") != std::string::npos;
  s.values_bf16 = (opt_.bf16_weight_copies || qkv_a) && kdtree::bf16_exact(data, n);
  s.bf16_exact = opt_.bf16_weight_copies && s.values_bf16;
  if (s.kind == kCopy) {
    check_cuda(cudaMemcpy(s.dst, data, (size_t)n * sizeof(float), cudaMemcpyHostToDevice), "set_weight upload");
  } else {
    const Layer& ly = layers_[(size_t)s.layer];
    std::vector<float> uk, uv;
    split_kv_b(data, &uk, &uv);
    if (!uk.empty()) check_cuda(cudaMemcpy(ly.w_ukT, uk.data(), uk.size() * sizeof(float), cudaMemcpyHostToDevice), "set_weight upload");
    check_cuda(cudaMemcpy(ly.w_uv, uv.data(), uv.size() * sizeof(float), cudaMemcpyHostToDevice), "set_weight upload");
  }
  s.set = true;
  finalized_ = false;
}

// kv_b_proj [H*(Dn+Dv), C] (FP32 values or BF16 bits): per head h, rows [0, Dn) are W_UK[h], stored transposed
// ([C, Dn]) in uk, rows [Dn, Dn+Dv) W_UV[h] in uv
template <class T>
void CudaModel::split_kv_b(const T* data, std::vector<T>* uk, std::vector<T>* uv) const {
  const int64_t H = cfg_.num_attention_heads, C = cfg_.kv_lora_rank;
  const int64_t Dn = cfg_.qk_nope_head_dim, Dv = cfg_.v_head_dim;
  uk->assign((size_t)(H * Dn * C), T());
  uv->assign((size_t)(H * Dv * C), T());
  for (int64_t h = 0; h < H; ++h) {
    const T* src = data + h * (Dn + Dv) * C;
    for (int64_t d = 0; d < Dn; ++d)  // W_UK[h] [Dn, C] -> W_UK[h]^T [C, Dn]
      for (int64_t c = 0; c < C; ++c) (*uk)[(size_t)(h * C * Dn + c * Dn + d)] = src[d * C + c];
    std::memcpy(uv->data() + h * Dv * C, src + Dn * C, (size_t)(Dv * C) * sizeof(T));
  }
}

bool CudaModel::upload_bf16_ok(const Slot& s) const {
  return bf16_only(s.kind == kKvB ? layers_[(size_t)s.layer].w_ukT : s.dst);
}

// bf16_weights_only: a matrix's BF16 bits into its place in the BF16 arena (kv_b_proj split into
// W_UK^T and W_UV as set_weight does with the values)
void CudaModel::upload_bf16(Slot& s, const uint16_t* bits) {
  int64_t n = 1;
  for (int64_t d : s.shape) n *= d;
  if (s.kind == kCopy) {
    check_cuda(cudaMemcpy(const_cast<uint16_t*>(bf16_of(s.dst, n)), bits, (size_t)n * 2, cudaMemcpyHostToDevice),
               "set_weight upload (BF16)");
    return;
  }
  const Layer& ly = layers_[(size_t)s.layer];
  const int64_t H = cfg_.num_attention_heads, C = cfg_.kv_lora_rank;
  const int64_t Dn = cfg_.qk_nope_head_dim, Dv = cfg_.v_head_dim;
  std::vector<uint16_t> uk, uv;
  split_kv_b(bits, &uk, &uv);
  if (!uk.empty())
    check_cuda(cudaMemcpy(const_cast<uint16_t*>(bf16_of(ly.w_ukT, H * Dn * C)), uk.data(), uk.size() * 2,
                          cudaMemcpyHostToDevice), "set_weight upload (BF16)");
  if (!uv.empty())
    check_cuda(cudaMemcpy(const_cast<uint16_t*>(bf16_of(ly.w_uv, H * Dv * C)), uv.data(), uv.size() * 2,
                          cudaMemcpyHostToDevice), "set_weight upload (BF16)");
}

void CudaModel::set_weight_bf16(const std::string& name, const uint16_t* bits, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (n > 0 && bits == nullptr) throw Error("set_weight_bf16: null data for '" + name + "'");
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = slots_.find(name);
    if (it != slots_.end() && shape == it->second.shape && upload_bf16_ok(it->second)) {
      ++epoch_;
      DeviceGuard guard(opt_.device);
      upload_bf16(it->second, bits);
      it->second.bf16_exact = true;
      it->second.set = true;
      finalized_ = false;
      return;
    }
  }
  // a vector, the embedding, any tensor without bf16_weights_only (or a name / shape set_weight refuses
  // with its message): the widened values
  std::vector<float> v((size_t)n);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = (uint32_t)bits[i] << 16;
    std::memcpy(&v[(size_t)i], &u, 4);
  }
  set_weight(name, v.data(), shape);
}

void CudaModel::set_weight_int4(const std::string& name, const uint8_t* packed, const float* scales, int64_t group,
                                const std::vector<int64_t>& shape) {
  if (shape.size() != 2 || shape[0] <= 0 || shape[1] <= 0 || shape[1] % 2 || group <= 0 || shape[1] % group)
    throw Error("set_weight_int4: '" + name + "': shape " + shape_str(shape) + " and group " + std::to_string(group) +
                " do not make whole bytes and groups");
  const int64_t N = shape[0], K = shape[1];
  if (!packed || !scales) throw Error("set_weight_int4: null data for '" + name + "'");
  const std::string bad = kdtree::int4_groups_problem(name, packed, scales, group, N * K);  // the CPU model's checks
  if (!bad.empty()) throw Error(bad);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = slots_.find(name);
    if (it != slots_.end() && int4_held(it->second.dst)) {
      Slot& s = it->second;
      if (shape != s.shape)
        throw Error("set_weight_int4: '" + name + "' has shape " + shape_str(shape) + ", the config needs " +
                    shape_str(s.shape));
      if (group != opt_.int4_experts_group)
        throw Error("set_weight_int4: '" + name + "' comes in groups of " + std::to_string(group) +
                    ", the model holds its INT4 experts in groups of " + std::to_string(opt_.int4_experts_group) +
                    " (int4_experts_group)");
      ++epoch_;
      DeviceGuard guard(opt_.device);
      const Q4View v = int4_of(s.dst, N * K);
      if (!v.packed) throw RuntimeFailure("CudaModel: internal error, no INT4 storage for " + name);
      check_cuda(cudaMemcpy(const_cast<uint8_t*>(v.packed), packed, (size_t)(N * K / 2), cudaMemcpyHostToDevice),
                 "set_weight_int4 upload");
      check_cuda(cudaMemcpy(const_cast<float*>(v.scales), scales, (size_t)(N * K / group) * sizeof(float),
                            cudaMemcpyHostToDevice), "set_weight_int4 upload");
      // one stack with scales that are not BF16 values sends every INT4 GEMV to the per-weight FP32 widening
      if (!kdtree::bf16_exact(scales, N * K / group)) q4_scales_bf16_ = false;
      s.set = true;
      finalized_ = false;
      return;
    }
  }
  // another matrix, or no INT4 experts: the dequantized values (what the loader computes), through set_weight
  std::vector<float> v((size_t)(N * K));
  for (int64_t r = 0; r < N; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const int q = (packed[(r * K + k) / 2] >> (4 * (k & 1))) & 15;
      v[(size_t)(r * K + k)] = kdtree::bf16_round((float)(q - 8) * scales[r * (K / group) + k / group]);
    }
  set_weight(name, v.data(), shape);
}

CudaModel::Q4View CudaModel::int4_of(const float* w, int64_t n) const {
  Q4View v;
  if (!q4_mem_ || !w || w < q_begin_ || w >= q_end_) return v;
  auto it = std::upper_bound(q4_ranges_.begin(), q4_ranges_.end(), w,
                             [](const float* x, const Q4Range& r) { return x < r.begin; });
  if (it == q4_ranges_.begin()) return v;
  --it;
  const int64_t o = w - it->begin, g = opt_.int4_experts_group;
  if (w + n > it->end || o % g) return v;
  v.packed = static_cast<const uint8_t*>(q4_mem_) + it->packed_off + o / 2;
  v.scales = reinterpret_cast<const float*>(static_cast<const char*>(q4_mem_) + it->scale_off) + o / g;
  return v;
}

std::vector<std::string> CudaModel::missing_weights() const { return unset_slots(slot_order_, slots_); }

void CudaModel::finalize() {
  std::vector<std::string> missing = missing_weights();
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  check_no_missing_weights(missing);
  DeviceGuard guard(opt_.device);
  check_cuda(cudaStreamSynchronize(as_stream(stream_)), "finalize");
  make_bf16_copies();
  if (fold_rows_) {  // the folded query projections: W_qb diag(q_a norm) W_qa, after q_a / kv_a in each qkv_a block
    const ModelConfig& c = cfg_;
    const int64_t qr = c.q_lora_rank, CR = c.kv_lora_rank + c.qk_rope_head_dim, Dm = c.hidden_size;
    for (size_t l = 0; l < layers_.size(); ++l) {
      // not for a BF16 checkpoint's layer (q_a and kv_a exactly BF16): its unfolded product reads their BF16 copies
      // (bf16_weight_copies), which the FP32-only folded rows would forgo, and a model without the copies must give
      // the same bits as one with them; so such a layer never folds, copies or not
      Layer& ly = layers_[l];
      const std::string pre = "model.layers." + std::to_string(l) + ".self_attn.";
      const auto qa = slots_.find(pre + "q_a_proj.weight"), kva = slots_.find(pre + "kv_a_proj_with_mqa.weight");
      ly.q_fold = !(qa != slots_.end() && kva != slots_.end() && qa->second.values_bf16 && kva->second.values_bf16);
      if (ly.q_fold)
        check_cuda(cuda::fold_q_projection(ly.q_b, ly.q_a_ln, ly.qkv_a, (int)fold_rows_, (int)qr, (int)Dm,
                                           ly.qkv_a + (qr + CR) * Dm, as_stream(stream_)),
                   "fold_q_projection");
    }
    check_cuda(cudaStreamSynchronize(as_stream(stream_)), "finalize (q fold)");
  }
  finalized_ = true;
  cache_len_ = 0;
  pending_ = 0;
}

// BF16 copies (opt_.bf16_weight_copies): every weight matrix whose values are all exactly BF16 (a
// BF16 checkpoint widened to float32) gets a BF16 copy in one device allocation, made here and
// refreshed at every finalize(). The few-token kernels read the copy and widen it, which gives the
// same values and so the same results from half the bytes. Vectors (norm weights, biases) are left
// out: no kernel that streams weights reads them. When the set of exact ranges changes (a
// set_weight with values of another kind), captured graphs that baked in the old choice are
// dropped, and the allocation is redone when it no longer fits.
void CudaModel::make_bf16_copies() {
  if (opt_.bf16_weights_only) return;  // the matrices are the BF16 range itself, laid out at construction
  std::vector<std::pair<const float*, const float*>> r;
  if (opt_.bf16_weight_copies) {
    const int64_t H = cfg_.num_attention_heads, C = cfg_.kv_lora_rank;
    const int64_t Dn = cfg_.qk_nope_head_dim, Dv = cfg_.v_head_dim;
    for (const auto& kv : slots_) {
      const Slot& sl = kv.second;
      if (!sl.set || !sl.bf16_exact || sl.shape.size() < 2) continue;
      if (sl.kind == kCopy) {
        int64_t n = 1;
        for (int64_t d : sl.shape) n *= d;
        if (n > 0) r.emplace_back(sl.dst, sl.dst + n);
      } else {
        const Layer& ly = layers_[(size_t)sl.layer];
        if (H * Dn * C > 0) r.emplace_back(ly.w_ukT, ly.w_ukT + H * Dn * C);
        if (H * Dv * C > 0) r.emplace_back(ly.w_uv, ly.w_uv + H * Dv * C);
      }
    }
    std::sort(r.begin(), r.end());
  }
  std::vector<Bf16Range> m;
  int64_t total = 0;  // uint16 elements
  for (const auto& x : r) {  // merge touching ranges (the router and the shared gate/up rows are one block)
    if (!m.empty() && x.first <= m.back().end) {
      const int64_t grow = std::max<int64_t>(x.second - m.back().end, 0);
      m.back().end += grow;
      total += grow;
    } else {
      total = cuda::arena_align_up(total * 2) / 2;
      m.push_back(Bf16Range{x.first, x.second, total});
      total += x.second - x.first;
    }
  }
  if (!(m == bf16_ranges_)) clear_graphs();
  bf16_ranges_.clear();
  if (m.empty()) return;
  const int64_t bytes = cuda::arena_align_up(total * 2);
  if (bytes > bf16_bytes_) {
    if (bf16_mem_) cudaFree(bf16_mem_);
    bf16_mem_ = nullptr;
    bf16_bytes_ = 0;
    const cudaError_t e = cudaMalloc(&bf16_mem_, (size_t)bytes);
    if (e != cudaSuccess) {
      bf16_mem_ = nullptr;
      cudaGetLastError();
      size_t fr = 0, tot = 0;
      cudaMemGetInfo(&fr, &tot);
      cudaGetLastError();
      throw RuntimeFailure("CudaModel: cannot allocate the BF16 weight copies (" + mib(bytes) + ") on " + device_name_ +
                           ": " + cudaGetErrorString(e) + "; the device has " + mib((int64_t)fr) + " free of " +
                           mib((int64_t)tot) + ". Pass bf16_weight_copies=False (cuda_options) to run without them.");
    }
    bf16_bytes_ = bytes;
  }
  cudaStream_t st = as_stream(stream_);
  for (const Bf16Range& x : m)
    check_cuda(cuda::f32_to_bf16_high(x.begin, static_cast<uint16_t*>(bf16_mem_) + x.off, (long long)(x.end - x.begin), st),
               "f32_to_bf16_high");
  check_cuda(cudaStreamSynchronize(st), "finalize(bf16 copies)");
  bf16_ranges_ = std::move(m);
}

const uint16_t* CudaModel::bf16_of(const float* w, int64_t n) const {
  if (!bf16_mem_ || !w || bf16_ranges_.empty()) return nullptr;
  auto it = std::upper_bound(bf16_ranges_.begin(), bf16_ranges_.end(), w,
                             [](const float* v, const Bf16Range& x) { return v < x.begin; });
  if (it == bf16_ranges_.begin()) return nullptr;
  --it;
  if (w < it->begin || w + n > it->end) return nullptr;
  return static_cast<const uint16_t*>(bf16_mem_) + it->off + (w - it->begin);
}

int64_t CudaModel::bf16_weight_elements() const {
  int64_t n = 0;
  for (const Bf16Range& x : bf16_ranges_) n += x.end - x.begin;
  return n;
}

void CudaModel::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  cache_len_ = 0;
  pending_ = 0;
}

// ---------------------------------------------------------------- building blocks
bool CudaModel::fuse_norm(int64_t T) const { return !exact_step_ && T <= skinny_max_t_ && T <= cuda::kLinearNormMaxT; }

int64_t CudaModel::tile_max_for(int64_t wbytes) const {
  if (opt_.tile_max_tokens >= 0 || wbytes > cuda::kLinearTileSmallBytes) return tile_max_t_;
  return std::max(tile_max_t_, kTileSmallAutoMaxT);
}

bool CudaModel::tile_first(int64_t T, int64_t wbytes) const {
  if (opt_.skinny_max_tokens >= 0) return false;
  return (T >= (wbytes > kSkinnyBigBytes ? kTileFirstBigMinT : kTileFirstMinT) && T <= kTileFirstMaxT) ||
         (T > kTileFirstMaxT && T <= kSkinnyAutoMaxT && wbytes >= kTileFirstLateMinBytes);
}

cuda::LinearParams CudaModel::gemm_params(int64_t T, int64_t N, int64_t Kd, const float* in, int64_t ldi,
                                          const float* w, float* out, int64_t ldo, float beta) const {
  cuda::LinearParams lp{in, ldi, 0, w, 0, out, ldo, 0, (int)T, (int)N, (int)Kd, 1, beta};
  lp.tile_math = opt_.tile_tensor_cores ? 0 : 1;
  lp.w_bf16 = bf16_of(w, N * Kd);  // read by linear_skinny / linear_tile, not by cuBLAS
  lp.row_exact = exact_step_ ? 1 : 0;
  return lp;
}

CudaModel::GemmKind CudaModel::gemm_kind(const cuda::LinearParams& lp) const {
  const int64_t T = lp.T, wbytes = cuda::linear_weight_bytes(lp);
  if (exact_step_) {  // row-exact: linear_tile alone (the constructor checked the shapes)
    if (!cuda::linear_tile_supported(lp))
      throw RuntimeFailure("CudaModel: internal error, a row-exact product linear_tile cannot take");
    return GemmKind::kTile;
  }
  const bool big = wbytes > kSkinnyBigBytes;
  const bool tile = T <= tile_max_for(wbytes) && cuda::linear_tile_supported(lp);  // (false with norm_w)
  const bool skinny = T <= skinny_max_t_ && (lp.norm_w || !big || T <= skinny_big_max_t_);
  if (skinny && !(tile && tile_first(T, wbytes))) return GemmKind::kSkinny;
  return tile ? GemmKind::kTile : GemmKind::kCublas;  // (tile: also big weights past skinny_big_max_tokens)
}

void CudaModel::widen_weights(cuda::LinearParams& lp, int64_t elements) {
  if (elements > widen_elems_)
    throw RuntimeFailure("CudaModel: internal error, " + std::to_string(elements) + " BF16 weights to widen, room for " +
                         std::to_string(widen_elems_));
  check_cuda(cuda::bf16_to_f32(lp.w_bf16, widen_, elements, as_stream(stream_)), "bf16_to_f32");
  lp.w = widen_;
  lp.w_bf16 = nullptr;
}

void CudaModel::gemm_run(cuda::LinearParams lp, float* norm_out, void* stream) {
  cudaStream_t st = as_stream(stream ? stream : stream_);
  const GemmKind kind = gemm_kind(lp);
  if (bf16_only(lp.w) && kind != GemmKind::kCublas &&
      !(kind == GemmKind::kSkinny ? cuda::linear_skinny_reads_bf16(lp) : cuda::linear_tile_reads_bf16(lp))) {
    // (bf16_weights_only: the constructor's shape checks keep this off the measured paths)
    if (st != as_stream(stream_))
      throw RuntimeFailure("CudaModel: internal error, BF16-only weights to widen off the main stream");
    widen_weights(lp, lp.N * lp.Kd);
  }
  switch (kind) {
    case GemmKind::kSkinny:
      lp.norm_out = norm_out;
      lp.ldn = lp.Kd;
      check_cuda(cuda::linear_skinny(lp, st), "linear_skinny");
      return;
    case GemmKind::kTile:
      check_cuda(cuda::linear_tile(lp, st), "linear_tile");
      return;
    case GemmKind::kCublas:
      break;
  }
  if (st != as_stream(stream_)) throw RuntimeFailure("CudaModel: internal error, a cuBLAS product off the main stream");
  const cuda::CublasApi& api = cuda::cublas_api();
  const float alpha = 1.f, beta = lp.beta;
  if (bf16_only(lp.w)) {  // bf16_weights_only: widened block by block of rows (output columns), each product after
    const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(lp.N, widen_elems_ / lp.Kd));
    const uint16_t* src = lp.w_bf16;
    for (int64_t n0 = 0; n0 < lp.N; n0 += rows) {
      const int64_t nb = std::min<int64_t>(rows, lp.N - n0);
      check_cuda(cuda::bf16_to_f32(src + n0 * lp.Kd, widen_, nb * lp.Kd, st), "bf16_to_f32");
      check_cublas(api.sgemm(as_handle(cublas_), CUBLAS_OP_T, CUBLAS_OP_N, (int)nb, lp.T, lp.Kd, &alpha, widen_, lp.Kd,
                             lp.x, (int)lp.ldx, &beta, lp.y + n0, (int)lp.ldy),
                   "sgemm");
    }
    return;
  }
  check_cublas(api.sgemm(as_handle(cublas_), CUBLAS_OP_T, CUBLAS_OP_N, lp.N, lp.T, lp.Kd, &alpha, lp.w, lp.Kd, lp.x,
                         (int)lp.ldx, &beta, lp.y, (int)lp.ldy),
               "sgemm");
}

void CudaModel::gemm_nt(int64_t T, int64_t N, int64_t Kd, const float* in, int64_t ldi, const float* w, float* out,
                        int64_t ldo, float beta, const float* norm_w, double norm_eps, float* norm_out, int tile_rows) {
  if (norm_w && !fuse_norm(T)) throw RuntimeFailure("CudaModel: internal error, a fused RMSNorm outside fuse_norm");
  cuda::LinearParams lp = gemm_params(T, N, Kd, in, ldi, w, out, ldo, beta);
  lp.norm_w = norm_w;
  lp.norm_eps = norm_eps;
  lp.tile_rows = tile_rows;
  gemm_run(lp, norm_out, nullptr);
}

cuda::LinearParams CudaModel::heads_params(int64_t T, int64_t N, int64_t Kd, const float* in, int64_t ldi,
                                           int64_t in_head, const float* w, float* out, int64_t ldo, int64_t out_head,
                                           int64_t heads) const {
  cuda::LinearParams lp{in, ldi, in_head, w, N * Kd, out, ldo, out_head, (int)T, (int)N, (int)Kd, (int)heads, 0.f};
  lp.tile_math = opt_.tile_tensor_cores ? 0 : 1;
  lp.w_bf16 = bf16_of(w, heads * N * Kd);  // read by linear_skinny / linear_tile, not by cuBLAS
  lp.row_exact = exact_step_ ? 1 : 0;
  return lp;
}

bool CudaModel::heads_on_skinny(const cuda::LinearParams& lp) const {
  const int64_t T = lp.T;
  if (exact_step_) return false;
  const bool tile = T <= tile_max_for(cuda::linear_weight_bytes(lp)) && cuda::linear_tile_supported(lp);
  return T <= skinny_max_t_ && !(tile && tile_first(T, 0));  // 17-20 tokens: the W_UK / W_UV heads stay on skinny
}

void CudaModel::gemm_nt_heads(int64_t T, int64_t N, int64_t Kd, const float* in, int64_t ldi, int64_t in_head,
                              const float* w, float* out, int64_t ldo, int64_t out_head, int64_t heads) {
  run_heads(heads_params(T, N, Kd, in, ldi, in_head, w, out, ldo, out_head, heads));
}

void CudaModel::run_heads(const cuda::LinearParams& lp_in) {
  cuda::LinearParams lp = lp_in;
  const int64_t T = lp.T, N = lp.N, Kd = lp.Kd;
  const bool skinny = heads_on_skinny(lp);
  const bool tile = !skinny && (exact_step_ || T <= tile_max_for(cuda::linear_weight_bytes(lp))) &&
                    cuda::linear_tile_supported(lp);
  if (exact_step_ && !tile)
    throw RuntimeFailure("CudaModel: internal error, a row-exact head product linear_tile cannot take");
  // bf16_weights_only: widened whole (one batched product) where the kernel would not read the BF16 form
  if (bf16_only(lp.w) &&
      !(skinny ? cuda::linear_skinny_reads_bf16(lp) : tile ? cuda::linear_tile_reads_bf16(lp) : false))
    widen_weights(lp, lp.batch * lp.w_batch);
  if (skinny) {
    check_cuda(cuda::linear_skinny(lp, as_stream(stream_)), "linear_skinny(heads)");
    return;
  }
  if (tile) {
    check_cuda(cuda::linear_tile(lp, as_stream(stream_)), "linear_tile(heads)");
    return;
  }
  const float one = 1.f, zero = 0.f;
  check_cublas(cuda::cublas_api().sgemm_strided_batched(as_handle(cublas_), CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)T,
                                                        (int)Kd, &one, lp.w, (int)Kd, lp.w_batch, lp.x, (int)lp.ldx,
                                                        lp.x_batch, &zero, lp.y, (int)lp.ldy, lp.y_batch, lp.batch),
               "sgemm_strided_batched");
}

bool CudaModel::swiglu_in_skinny(int64_t T) const {
  return !exact_step_ && T <= skinny_max_t_ && T <= cuda::kLinearSwigluFuseMaxT;
}

void CudaModel::swiglu_gemm_nt(int64_t T, int64_t N, int64_t I, const float* gu, int64_t ldg, const float* w,
                               float* out, int64_t ldo, float beta, float* act, void* stream) {
  if (!act) act = act_;
  cuda::LinearParams lp = gemm_params(T, N, I, act, I, w, out, ldo, beta);
  if (swiglu_in_skinny(T)) {
    lp.x = gu;
    lp.ldx = ldg;
    lp.x_swiglu = 1;
    check_cuda(cuda::linear_skinny(lp, as_stream(stream ? stream : stream_)), "linear_skinny(swiglu)");
    return;
  }
  cuda::SwigluParams sp{gu, (int)T, (int)I, nullptr, act, ldg};
  check_cuda(cuda::swiglu(sp, as_stream(stream ? stream : stream_)), "swiglu");
  gemm_run(lp, nullptr, stream);
}

void CudaModel::run_step(const int32_t* tokens_d, const int32_t* positions_d, const uint64_t* vis_d,
                         int64_t vis_stride, int64_t T, int64_t row0, float* logits_d, const int32_t* len_d,
                         int64_t rows) {
  const ModelConfig& c = cfg_;
  const int64_t Dm = c.hidden_size;
  cudaStream_t st = as_stream(stream_);
  cuda::EmbedParams ep{tokens_d, embed_, (int)T, (int)c.vocab_size, (int)Dm, x_};
  ep.table_bf16 = bf16_only(embed_) ? bf16_of(embed_, c.vocab_size * Dm) : nullptr;
  ep.positions = positions_d;  // + the step's RoPE table, read by every layer's mla_prep
  ep.inv_freq = inv_freq_;
  ep.half = (int)(c.qk_rope_head_dim / 2);
  ep.attention_factor = (float)c.rope_attention_factor;
  ep.cs = rope_cs_;
  check_cuda(cuda::embed(ep, st), "embed");
  exact_step_ = opt_.row_exact && T <= CudaModelOptions::kRowExactMaxT;  // read by every product and kernel choice below
  const bool fuse = fuse_norm(T);  // few tokens: the norms before q_a/kv_a, q_b and lm_head run in those kernels
  bool normed = false;             // hn_ already holds the norm of x_ that comes next (a MoE combine wrote it)
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& ly = layers_[l];
    cuda::RmsNormParams np{x_, ly.input_ln, (int)T, (int)Dm, (int)Dm, (int)Dm, c.rms_norm_eps, hn_};
    if (fuse) {
      attention(ly, vis_d, vis_stride, T, row0, len_d, x_, ly.input_ln);
    } else {
      if (!normed) check_cuda(cuda::rmsnorm(np, st), "rmsnorm");
      attention(ly, vis_d, vis_stride, T, row0, len_d, hn_, nullptr);
    }
    normed = false;
    // post-attention RMSNorm: fused into the MLP's first projection for few tokens (which also
    // writes hn_ for the routed experts), else its own kernel
    if (!fuse) {
      np.w = ly.post_ln;
      check_cuda(cuda::rmsnorm(np, st), "rmsnorm");
    }
    if (ly.moe) {
      // the norm that follows this layer (the next layer's input norm, or the final one), which the MoE
      // combine may write with the new rows; none when the next projection fuses it
      const float* next_norm = l + 1 < layers_.size() ? layers_[l + 1].input_ln : final_ln_;
      normed = moe_mlp(ly, T, fuse, fuse ? nullptr : next_norm);
    } else {
      dense_mlp(ly, T, fuse);
    }
  }
  const float* head = c.tie_word_embeddings ? embed_ : lm_head_;
  const int64_t R = rows < 0 ? T : rows, t0 = T - R;  // the final norm and the LM head over the last R tokens
  if (R == 0) return;
  if (fuse) {
    gemm_nt(R, c.vocab_size, Dm, x_ + t0 * Dm, Dm, head, logits_d, c.vocab_size, 0.f, final_ln_, c.rms_norm_eps);
  } else {
    cuda::RmsNormParams np{x_ + t0 * Dm, final_ln_, (int)R, (int)Dm, (int)Dm, (int)Dm, c.rms_norm_eps, hn_ + t0 * Dm};
    if (!normed) check_cuda(cuda::rmsnorm(np, st), "rmsnorm");
    gemm_nt(R, c.vocab_size, Dm, hn_ + t0 * Dm, Dm, head, logits_d, c.vocab_size);
  }
}

// folded steps of more tokens than this write the cache rows in the W_UK launch (attention() says why)
constexpr int64_t kPrepInUkMinT = 8;

void CudaModel::attention(Layer& ly, const uint64_t* vis_d, int64_t vis_stride, int64_t T,
                          int64_t row0, const int32_t* len_d, const float* in, const float* in_norm) {
  const ModelConfig& c = cfg_;
  const int64_t Dm = c.hidden_size, H = c.num_attention_heads, C = c.kv_lora_rank, R = c.qk_rope_head_dim;
  const int64_t Dn = c.qk_nope_head_dim, Dv = c.v_head_dim, Dqk = c.qk_head_dim(), CR = C + R;
  const int64_t qr = c.q_lora_rank, lda = qr + CR;
  cudaStream_t st = as_stream(stream_);

  // The folded query projection (q_fold_max_tokens): [qa | kv | q'] in one product, q' = x (W_qb diag(g) W_qa)^T
  // the queries without q_a's norm, whose factor 1 / rms(qa) mla_prep computes and the attention applies to
  // the scores (every consumer of q is linear in it: W_UK, RoPE, the dot products). Layers whose q_a / kv_a
  // are exactly BF16 never fold (finalize(): ly.q_fold).
  const bool fold = fold_rows_ > 0 && ly.q_fold && !exact_step_ && T >= CudaModelOptions::kQFoldMinT &&
                    T <= q_fold_max_t_;
  const int64_t ldo = fold ? lda + fold_rows_ : lda;  // row stride of qkv_a_out_
  float* const qsrc = fold ? qkv_a_out_ + lda : q_;   // the queries [T, H, Dqk] (row stride ldq)
  const int64_t ldq = fold ? ldo : H * Dqk;
  // [qa | kv] (and q') in one GEMM, then q. The folded product in one token tile (on linear_tile: the automatic
  // height gave T = 17 two 16-row tiles, each streaming mini-kimi's 16.5 MB block, 15.6 us against 11-12;
  // docs/BENCHMARKS.md "Sixty-fourth session")
  gemm_nt(T, ldo, Dm, in, Dm, ly.qkv_a, qkv_a_out_, ldo, 0.f, in_norm, c.rms_norm_eps, nullptr,
          fold ? cuda::linear_tile_one_tile_rows((int)T) : 0);
  // Cache rows (normed latent | roped key) and roped queries: mla_prep, on the side stream with
  // opt_.side_stream (joined before the attention). When the W_UK product runs on linear_skinny,
  // its rope block ropes the queries (LinearParams::rope_out, the same bits) and mla_prep writes
  // only the cache rows: it needs only the q_a / kv projection and starts here, beside q_b and
  // W_UK, instead of after q_b (it ended ~3 us after W_UK on the decode step's critical path).
  cuda::MlaPrepParams mp{};
  mp.q = qsrc;
  mp.ldq = (int)ldq;
  mp.kv = qkv_a_out_ + qr;
  mp.ldkv = (int)ldo;
  if (fold) {
    mp.qa = qkv_a_out_;
    mp.ldqa = (int)ldo;
    mp.qa_n = (int)qr;
    mp.qa_eps = c.latent_norm_eps;
    mp.q_scale_out = q_scale_;
  }
  mp.kv_norm_w = ly.kv_a_ln;
  mp.cs = rope_cs_;
  mp.T = (int)T;
  mp.H = (int)H;
  mp.Dn = (int)Dn;
  mp.C = (int)C;
  mp.R = (int)R;
  mp.eps = c.latent_norm_eps;
  mp.interleaved = c.rope_interleave ? 1 : 0;
  mp.cache = ly.cache;
  mp.ldc = (int)CR;
  mp.row0 = len_d ? 0 : row0;  // graph replay: rows from *len_d
  mp.row0_dev = len_d;
  mp.q_rope = q_rope_;
  // Absorption: q_lat[t, h, :] = W_UK[h]^T q_nope[t, h, :], with W_UK[h]^T stored row-major [C, Dn] (w_ukT).
  cuda::LinearParams uk = heads_params(T, C, Dn, qsrc, ldq, Dqk, ly.w_ukT, q_lat_, H * C, C, H);
  uk.rope_cs = rope_cs_;
  uk.rope_out = q_rope_;
  uk.rope_ld = H * R;
  uk.rope_off = (int)Dn;
  uk.rope_R = (int)R;
  uk.rope_interleaved = mp.interleaved;
  const bool rope_uk = Dn > 0 && heads_on_skinny(uk) && cuda::linear_skinny_rope_ok(uk);
  if (rope_uk) {
    mp.skip_q = 1;
    // Folded steps of more than 8 tokens: no q_b between the q_a / kv_a projection and W_UK to hide mla_prep
    // behind, and its side-stream launch started ~4 us after that projection and ended ~3 us after W_UK (H100
    // timeline, T = 17): the W_UK launch's rope blocks write the cache rows instead (LinearParams::prep_on, the
    // same bits), no fork or join. In-step on an H100 (docs/BENCHMARKS.md "Sixty-fifth session"): T = 17 / 20
    // 1.4-1.8 / 1.6 % faster at context 512, T = 17 4.9 % at 4096; T = 5 (folded, on skinny) 1.1 % slower and the
    // unfolded decode step (q_b in between) 2-3 % slower, so those keep mla_prep beside the chain.
    if (fold && T > kPrepInUkMinT) {
      uk.prep = mp;
      uk.prep_on = 1;
    } else {
      check_cuda(cuda::mla_prep(mp, as_stream(fork())), "mla_prep(cache rows)");
    }
  } else {
    uk.rope_out = nullptr;  // mla_prep ropes the queries
  }
  // The query projection (with q_fold, q' came with q_a / kv_a: nothing to do).
  if (!fold) {
    if (qr == 0) {  // no q LoRA: q_proj (held as q_b) straight from the layer's input
      gemm_nt(T, H * Dqk, Dm, in, Dm, ly.q_b, q_, H * Dqk, 0.f, in_norm, c.rms_norm_eps);
    } else if (in_norm) {  // fused: q_a's latent norm inside the q_b projection
      gemm_nt(T, H * Dqk, qr, qkv_a_out_, lda, ly.q_b, q_, H * Dqk, 0.f, ly.q_a_ln, c.latent_norm_eps);
    } else {
      cuda::RmsNormParams np{qkv_a_out_, ly.q_a_ln, (int)T, (int)qr, (int)lda, (int)lda, c.latent_norm_eps, qkv_a_out_};
      check_cuda(cuda::rmsnorm(np, st), "rmsnorm(q_a)");
      gemm_nt(T, H * Dqk, qr, qkv_a_out_, lda, ly.q_b, q_, H * Dqk);
    }
  }
  // Otherwise mla_prep (cache rows, roped queries) and the W_UK product both only read q_ /
  // qkv_a_out_: the prep runs beside the product.
  if (!rope_uk) check_cuda(cuda::mla_prep(mp, as_stream(fork())), "mla_prep");
  if (Dn > 0) {
    run_heads(uk);
  } else {
    check_cuda(cudaMemsetAsync(q_lat_, 0, (size_t)(T * H * C) * sizeof(float), st), "cudaMemset(q_lat)");
  }
  if (!uk.prep_on) join();  // (mla_prep went to the side stream; with prep_on nothing did, and a capture forbids
                            // waiting on a stream it never forked to)
  // Attention over the latent cache rows [0, row0) (all visible) and the T new rows (mask).
  cuda::VerifyAttentionParams vp{};
  vp.q_latent = q_lat_;
  vp.q_rope = q_rope_;
  vp.kv = ly.cache;
  vp.kv_stride = (int)CR;
  vp.visibility = vis_d;
  vp.vis_stride = (int)vis_stride;
  vp.T = (int)T;
  vp.H = (int)H;
  vp.C = (int)C;
  vp.R = (int)R;
  vp.L = (int)row0;  // with len_d: the upper bound (grid, splits), the length itself from *len_d
  vp.L_dev = len_d;
  vp.scale = (float)c.softmax_scale;
  vp.out = o_lat_;
  vp.workspace = attn_ws_;
  vp.force_naive = opt_.attention_naive ? 1 : 0;
  vp.force_kernel = opt_.attention_kernel;
  vp.force_splitkv_rows = opt_.attention_rows;
  vp.committed_ready = 1;  // the step's first kernel is ordered and no kernel of it writes rows < L
  vp.exact = exact_step_ ? 1 : 0;
  vp.exact_split = exact_split_;
  vp.q_scale = fold ? q_scale_ : nullptr;
  if ((int64_t)cuda::verify_attention_workspace_bytes(vp) > attn_ws_bytes_)
    throw RuntimeFailure("CudaModel: internal error, verify_attention needs more workspace than was sized");
  // Few tokens: the merge of the attention's key splits moves into the W_UV product (uv_combine).
  int deferred = 0;
  if (!exact_step_ && T <= opt_.uv_combine_max_tokens && cuda::uv_combine_ok((int)T, 2, (int)C, (int)Dv)) {
    vp.defer_splits = &deferred;
    vp.defer_max_splits = cuda::kUvMaxS;
  }
  check_cuda(cuda::verify_attention(vp, st), "verify_attention");
  // Values: ov[t, h, :] = o_lat[t, h, :] @ W_UV[h]^T, then x += ov @ o_proj^T.
  if (deferred > 1) {
    cuda::UvCombineParams up{static_cast<const float*>(attn_ws_), deferred, (int)T, (int)H, (int)C, (int)Dv, ly.w_uv,
                             bf16_of(ly.w_uv, H * Dv * C), ov_};
    check_cuda(cuda::uv_combine(up, st), "uv_combine");
  } else {
    gemm_nt_heads(T, Dv, C, o_lat_, H * C, C, ly.w_uv, ov_, H * Dv, Dv, H);
  }
  gemm_nt(T, Dm, H * Dv, ov_, H * Dv, ly.o_proj, x_, Dm, 1.f);
}

void CudaModel::dense_mlp(const Layer& ly, int64_t T, bool fused_norm) {
  const int64_t Dm = cfg_.hidden_size, I = cfg_.intermediate_size;
  if (fused_norm) gemm_nt(T, 2 * I, Dm, x_, Dm, ly.mlp_gate_up, gu_, 2 * I, 0.f, ly.post_ln, cfg_.rms_norm_eps);
  else gemm_nt(T, 2 * I, Dm, hn_, Dm, ly.mlp_gate_up, gu_, 2 * I);
  swiglu_gemm_nt(T, Dm, I, gu_, 2 * I, ly.mlp_down, x_, Dm, 1.f);
}

bool CudaModel::moe_mlp(const Layer& ly, int64_t T, bool fused_norm, const float* next_norm) {
  const ModelConfig& c = cfg_;
  const int64_t Dm = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok, Ie = c.moe_intermediate_size;
  const int64_t Is = Ie * c.n_shared_experts, A = T * K;
  cudaStream_t st = as_stream(stream_);

  // Few tokens (the skinny or tiled kernel): the router and the shared expert's gate/up are one projection
  // of the normalised input (rows [router | shared gate | shared up], contiguous in the weights),
  // with the RMSNorm itself fused in (fused_norm: it also writes hn_ for the routed experts).
  // Otherwise the router alone here and the shared gate/up after the routed experts.
  const int64_t merged_bytes = (E + 2 * Is) * Dm * (int64_t)sizeof(float);
  const bool merged = Is > 0 && (exact_step_ || T <= skinny_max_t_ || T <= tile_max_for(merged_bytes));  // not on cuBLAS
  const int64_t ldr = merged ? E + 2 * Is : E;  // rows projected = the row stride of router_logits_
  if (fused_norm) gemm_nt(T, ldr, Dm, x_, Dm, ly.router, router_logits_, ldr, 0.f, ly.post_ln, c.rms_norm_eps, hn_);
  else gemm_nt(T, ldr, Dm, hn_, Dm, ly.router, router_logits_, ldr);
  cuda::RouteParams rp{router_logits_, ly.router_bias, (int)T, (int)E, (int)K, (int)c.n_group, (int)c.topk_group,
                       c.norm_topk_prob ? 1 : 0, (float)c.routed_scaling_factor, topk_idx_, topk_w_, (int)ldr};

  // Which grouped GEMM (measured in-step on the H200, mini-kimi, docs/BENCHMARKS.md "Ninth session", the
  // expert kernels table): fewer assignments than experts (decode, tiny trees) -> the GEMV-style kernel; more ->
  // the tensor-core kernel, tiles of 8 slots while experts average < 8 rows (trees up to ~64 nodes), 16
  // below 32 rows, 32 beyond (prefill). Shapes that the tensor-core kernel cannot take
  // (expert_mma_supported) keep the earlier rule: GEMV-style up to 12 rows per expert on average, the
  // SGEMM tiles beyond.
  auto mma_takes = [](const float* x, int64_t ldx, const float* w) {  // x [*, ldx] @ w[e]^T, rows of ldx floats
    cuda::ExpertGemmParams q{};
    q.x = x;
    q.ldx = (int)ldx;
    q.w = w;
    q.Kd = (int)ldx;
    q.tile_rows = cuda::kExpertSkinnyRows;
    return cuda::expert_mma_supported(q);
  };
  const bool mma_ok = mma_takes(hn_, Dm, ly.experts_gate_up) && mma_takes(act_, Ie, ly.experts_down);
  enum { kGemv, kTiled, kMma } kind = A < E ? kGemv : mma_ok ? kMma : A <= 12 * E ? kGemv : kTiled;
  const int mma_rows = opt_.expert_mma_rows > 0 ? opt_.expert_mma_rows : A < 8 * E ? 8 : A < 32 * E ? 16 : 32;
  switch (opt_.expert_kernel) {
    case CudaModelOptions::kExpertSkinny: kind = kGemv; break;
    case CudaModelOptions::kExpertTiled: kind = kTiled; break;
    case CudaModelOptions::kExpertMma: kind = mma_ok ? kMma : kGemv; break;
    default: break;
  }
  if ((opt_.bf16_weights_only || opt_.int4_experts_group > 0) && kind == kTiled) kind = kGemv;  // (the SGEMM tiles read FP32 weights)
  if (exact_step_) kind = mma_ok ? kMma : kGemv;  // row-exact: one kernel and one tile height at any T
  const int tile_rows = kind == kMma ? (exact_step_ ? kExactExpertRows : mma_rows)
                        : kind == kTiled ? cuda::kExpertTileRows
                                         : cuda::kExpertSkinnyRows;
  const bool swiglu_fused = kind != kTiled;
  auto run_experts = [&](const cuda::ExpertGemmParams& xp, const char* what) {
    if (bf16_only(xp.w) && !(kind == kMma ? cuda::expert_gemm_mma_reads_bf16(xp) : cuda::expert_gemm_reads_bf16(xp)))
      throw RuntimeFailure(std::string("CudaModel: internal error, ") + what + " would read BF16-only weights as FP32");
    if (int4_held(xp.w) && !cuda::expert_gemm_int4_ok(xp))
      throw RuntimeFailure(std::string("CudaModel: internal error, ") + what + " cannot read the INT4 experts");
    check_cuda(kind == kMma ? cuda::expert_gemm_mma(xp, st) : cuda::expert_gemm(xp, st), what);
  };
  cuda::MoeGroupParams gp{topk_idx_, (int)T, (int)K, (int)E, tile_rows, expert_counts_ + ly.moe_index * E, offsets_,
                          slot_token_, slot_of_, tile_expert_, tile_row0_, num_tiles_};
  // The shared expert reads only the merged projection's output (its gate/up rows): with
  // opt_.side_stream its SwiGLU and down projection (swiglu_gemm_nt, the SwiGLU into acts_ where it
  // is its own kernel: act_ belongs to the routed experts meanwhile) run beside the routing and the
  // routed experts, on the second stream (a graph branch), joined before moe_combine. Not where the
  // product would need cuBLAS (its handle runs on the main stream).
  const bool shared_side = side_ && merged &&
                           (swiglu_in_skinny(T) || gemm_kind(gemm_params(T, Dm, Is, acts_, Is, ly.shared_down, ys_,
                                                                         Dm, 0.f)) != GemmKind::kCublas);
  if (shared_side) swiglu_gemm_nt(T, Dm, Is, router_logits_ + E, ldr, ly.shared_down, ys_, Dm, 0.f, acts_, fork());
  check_cuda(cuda::moe_route_group(rp, gp, st), "moe_route + moe_group");  // one launch for few tokens

  cuda::ExpertGemmParams xp{};
  xp.offsets = offsets_;
  xp.tile_expert = tile_expert_;
  xp.tile_row0 = tile_row0_;
  xp.num_tiles = num_tiles_;
  xp.tile_rows = tile_rows;
  xp.max_tiles = cuda::moe_max_tiles((int)A, (int)E, tile_rows);
  // gate/up: act[slot] = silu(hn[tok] @ Wg_e^T) * (hn[tok] @ Wu_e^T)
  xp.x = hn_;
  xp.ldx = (int)Dm;
  xp.x_row = slot_token_;
  xp.w = ly.experts_gate_up;
  xp.w_bf16 = kind != kTiled ? bf16_of(ly.experts_gate_up, E * 2 * Ie * Dm) : nullptr;
  const Q4View qgu = int4_of(ly.experts_gate_up, E * 2 * Ie * Dm);
  xp.w_int4 = qgu.packed;
  xp.w_scale = qgu.scales;
  xp.int4_group = opt_.int4_experts_group;
  xp.int4_scales_bf16 = q4_scales_bf16_;
  xp.Kd = (int)Dm;
  if (swiglu_fused) {
    xp.N = (int)Ie;
    xp.swiglu = 1;
    xp.y = act_;
    xp.ldy = (int)Ie;
    run_experts(xp, "expert_gemm(gate_up)");
  } else {
    xp.N = (int)(2 * Ie);
    xp.swiglu = 0;
    xp.y = gu_;
    xp.ldy = (int)(2 * Ie);
    run_experts(xp, "expert_gemm(gate_up)");
    cuda::SwigluParams sp{gu_, (int)A, (int)Ie, nullptr, act_};
    check_cuda(cuda::swiglu(sp, st), "swiglu(experts)");
  }
  // down: ye[slot] = act[slot] @ Wd_e^T
  xp.x = act_;
  xp.ldx = (int)Ie;
  xp.x_row = nullptr;
  xp.w = ly.experts_down;
  xp.w_bf16 = kind != kTiled ? bf16_of(ly.experts_down, E * Dm * Ie) : nullptr;
  const Q4View qd = int4_of(ly.experts_down, E * Dm * Ie);
  xp.w_int4 = qd.packed;
  xp.w_scale = qd.scales;
  xp.N = (int)Dm;
  xp.Kd = (int)Ie;
  xp.swiglu = 0;
  xp.y = ye_;
  xp.ldy = (int)Dm;
  xp.pdl_pre = swiglu_fused && kind == kMma ? 1 : 0;  // the gate/up launch just before, the schedule before it
  run_experts(xp, "expert_gemm(down)");

  if (shared_side) {
    join();
  } else if (merged) {
    swiglu_gemm_nt(T, Dm, Is, router_logits_ + E, ldr, ly.shared_down, ys_, Dm);
  } else if (Is > 0) {  // after the routed experts: gu_/act_ are reused
    gemm_nt(T, 2 * Is, Dm, hn_, Dm, ly.shared_gate_up, gu_, 2 * Is);
    swiglu_gemm_nt(T, Dm, Is, gu_, 2 * Is, ly.shared_down, ys_, Dm);
  }
  cuda::MoeCombineParams cp{ye_, topk_idx_, topk_w_, slot_of_, Is > 0 ? ys_ : nullptr, (int)T, (int)K, (int)Dm, x_, 1};
  const bool norm = next_norm && opt_.combine_norm && cuda::moe_combine_norm_ok((int)Dm, (int)K);
  if (norm) {  // the RMSNorm that follows, in the same launch (hn_ is free again: the experts have read it)
    cp.norm_w = next_norm;
    cp.norm_eps = c.rms_norm_eps;
    cp.norm_out = hn_;
  }
  check_cuda(cuda::moe_combine(cp, st), norm ? "moe_combine(+rmsnorm)" : "moe_combine");
  return norm;
}

// ---------------------------------------------------------------- forward / commit
void CudaModel::forward(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
                        float* logits_out) {
  forward_rows(tokens, positions, visibility, T, -1, logits_out);
}

void CudaModel::forward_last(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
                             int64_t rows, float* logits_out) {
  if (rows < 0 || rows > T)
    throw Error("forward_last: rows " + std::to_string(rows) + " outside [0, T = " + std::to_string(T) + "]");
  const int64_t last = T - (T - 1) / max_tokens_ * max_tokens_;  // tokens of the last chunk
  if (rows > last) {  // rows from more than the last chunk: the whole forward, its tail copied
    TargetModel::forward_last(tokens, positions, visibility, T, rows, logits_out);
    return;
  }
  forward_rows(tokens, positions, visibility, T, rows, logits_out);
}

// rows < 0: every token's logits; else the last `rows` tokens' (all in the last chunk), earlier chunks none
void CudaModel::forward_rows(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
                             int64_t rows, float* logits_out) {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  check_forward_args(*this, tokens, positions, T);
  if (visibility && T > max_tokens_)
    throw Error("forward: " + std::to_string(T) + " tokens with an explicit visibility exceed max_tokens (" +
                std::to_string(max_tokens_) + "); only causal forwards (visibility None) run in chunks");
  DeviceGuard guard(opt_.device);
  cudaStream_t st = as_stream(stream_);
  const int64_t V = cfg_.vocab_size, W = vis_words_;
  for (int64_t c0 = 0; c0 < T; c0 += max_tokens_) {
    const int64_t Tc = std::min(max_tokens_, T - c0);
    std::memcpy(h_tokens_, tokens + c0, (size_t)Tc * sizeof(int32_t));
    std::memcpy(h_positions_, positions + c0, (size_t)Tc * sizeof(int32_t));
    check_cuda(cudaMemcpyAsync(d_tokens_, h_tokens_, (size_t)Tc * sizeof(int32_t), cudaMemcpyHostToDevice, st), "upload tokens");
    check_cuda(cudaMemcpyAsync(d_positions_, h_positions_, (size_t)Tc * sizeof(int32_t), cudaMemcpyHostToDevice, st),
               "upload positions");
    const uint64_t* vis_d = d_causal_;
    if (visibility) {  // uint8 [T, T] -> bitmask [T, W]
      for (int64_t i = 0; i < Tc; ++i) {
        uint64_t* row = h_vis_ + i * W;
        const uint8_t* src = visibility + i * T;
        for (int64_t w = 0; w < W; ++w) {
          uint64_t m = 0;
          const int64_t j1 = std::min<int64_t>(T, (w + 1) * 64);
          for (int64_t j = w * 64; j < j1; ++j)
            if (src[j]) m |= 1ull << (j - w * 64);
          row[w] = m;
        }
      }
      check_cuda(cudaMemcpyAsync(d_vis_, h_vis_, (size_t)(Tc * W) * sizeof(uint64_t), cudaMemcpyHostToDevice, st),
                 "upload visibility");
      vis_d = d_vis_;
    }
    const int64_t rc = rows < 0 ? Tc : (c0 + Tc == T ? rows : 0);  // this chunk's rows of logits
    run_step_bucketed(d_tokens_, d_positions_, vis_d, W, Tc, cache_len_ + c0, logits_, rc);
    if (rc > 0)
      check_cuda(cudaMemcpyAsync(logits_out + (rows < 0 ? c0 * V : 0), logits_, (size_t)(rc * V) * sizeof(float),
                                 cudaMemcpyDeviceToHost, st),
                 "download logits");
    check_cuda(cudaStreamSynchronize(st), "forward");  // also frees the pinned staging for the next chunk
  }
  pending_ = T;
}

void CudaModel::forward_device(const int32_t* tokens_d, const int32_t* positions_d, const uint64_t* vis_bits_d,
                               int64_t vis_stride, int64_t T, float* logits_d, int64_t rows) {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  if (!finalized_) throw Error("model: forward() before finalize() (weights not complete)");
  if (T <= 0 || T > max_tokens_)
    throw Error("forward_device: T = " + std::to_string(T) + " outside [1, max_tokens = " + std::to_string(max_tokens_) + "]");
  if (cache_len_ + T > max_seq_len_)
    throw Error("forward_device: cache_len (" + std::to_string(cache_len_) + ") + T (" + std::to_string(T) +
                ") exceeds max_seq_len (" + std::to_string(max_seq_len_) + ")");
  if (!tokens_d || !positions_d || !logits_d) throw Error("forward_device: null device pointer");
  if (rows > T) throw Error("forward_device: rows " + std::to_string(rows) + " > T = " + std::to_string(T));
  if (rows < 0) rows = T;
  if (vis_bits_d && vis_stride < (T + 63) / 64)
    throw Error("forward_device: vis_stride " + std::to_string(vis_stride) + " < ceil(T/64) = " + std::to_string((T + 63) / 64));
  DeviceGuard guard(opt_.device);
  if (!vis_bits_d) {
    vis_bits_d = d_causal_;
    vis_stride = vis_words_;
  }
  if (opt_.graphs) {
    GraphKey key{tokens_d, positions_d, vis_bits_d, logits_d, vis_stride, T, context_bucket(cache_len_, T), rows};
    void* exec = graph_for(key);
    if (exec) {
      cudaStream_t st = as_stream(stream_);
      check_cuda(cuda::set_int32(d_len_, (int32_t)cache_len_, st), "set_int32(len)");
      check_cuda(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), st), "cudaGraphLaunch");
      ++graph_replays_;
      pending_ = T;
      return;
    }
  }
  run_step_bucketed(tokens_d, positions_d, vis_bits_d, vis_stride, T, cache_len_, logits_d, rows);
  pending_ = T;
}

// Context bucket: the attention grid, its kernel and its key splits are sized for the next power of
// two >= L + 1 (at least 256), or, with context_buckets = n > 1, for the next of the n equal steps
// that divide that doubling (lb / 2, lb] (steps of >= 32 keys: whole attention chunks), at most what
// still leaves room for T; one graph serves a bucket's lengths.
int64_t CudaModel::context_bucket(int64_t L, int64_t T) const {
  int64_t lb = 256;
  while (lb < L + 1) lb *= 2;
  if (opt_.context_buckets > 1 && lb > 256) {
    const int64_t lo = lb / 2, step = lo / opt_.context_buckets;
    lb = lo + (L + 1 - lo + step - 1) / step * step;
  }
  return std::min(lb, max_seq_len_ - T);
}

// An eager step exactly as a captured graph of it runs: the committed length through d_len_ and
// the attention sized for its context bucket, so that the same step gives the same bits whether
// it is replayed from a graph or not (the split count changes the attention's summation order).
void CudaModel::run_step_bucketed(const int32_t* tokens_d, const int32_t* positions_d, const uint64_t* vis_d,
                                  int64_t vis_stride, int64_t T, int64_t row0, float* logits_d, int64_t rows) {
  check_cuda(cuda::set_int32(d_len_, (int32_t)row0, as_stream(stream_)), "set_int32(len)");
  run_step(tokens_d, positions_d, vis_d, vis_stride, T, context_bucket(row0, T), logits_d, d_len_, rows);
}

void* CudaModel::graph_for(const GraphKey& key) {
  GraphEntry* e = nullptr;
  for (GraphEntry& g : graphs_)
    if (g.key == key) e = &g;
  if (e == nullptr) {
    if (graphs_.size() >= 64) clear_graphs();  // bounded: start over rather than grow
    graphs_.push_back(GraphEntry{key, 0, nullptr});
    e = &graphs_.back();
  }
  if (e->exec) return e->exec;
  if (++e->uses < 2) return nullptr;  // first use runs eagerly (prefill chunks, one-off shapes)
  cudaStream_t st = as_stream(stream_);
  cudaGraph_t graph = nullptr;
  check_cuda(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  try {
    run_step(static_cast<const int32_t*>(key.tokens), static_cast<const int32_t*>(key.positions),
             static_cast<const uint64_t*>(key.vis), key.vis_stride, key.T, key.l_bound,
             static_cast<float*>(const_cast<void*>(key.logits)), d_len_, key.rows);
  } catch (...) {
    cudaStreamEndCapture(st, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw;
  }
  check_cuda(cudaStreamEndCapture(st, &graph), "cudaStreamEndCapture");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check_cuda(err, "cudaGraphInstantiate");
  e->exec = exec;
  ++graph_captures_;
  return exec;
}

void CudaModel::clear_graphs() {
  for (GraphEntry& g : graphs_)
    if (g.exec) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g.exec));
  graphs_.clear();
}

void CudaModel::launch_compact(const int32_t* keep_d, const int32_t* count_d) {
  const int64_t CR = cfg_.kv_lora_rank + cfg_.qk_rope_head_dim;
  cuda::CompactParams cp{static_cast<float*>(cache_mem_), (int)cfg_.num_hidden_layers, max_seq_len_ * CR, (int)CR,
                         (int)CR, cache_len_, keep_d, count_d};
  check_cuda(cuda::cache_compact(cp, as_stream(stream_)), "cache_compact");
}

void CudaModel::commit(const int32_t* keep, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  check_commit_args(*this, keep, n);
  bool identity = true;
  for (int64_t j = 0; j < n && identity; ++j) identity = keep[j] == j;
  if (!identity) {
    DeviceGuard guard(opt_.device);
    cudaStream_t st = as_stream(stream_);
    std::memcpy(h_keep_, keep, (size_t)n * sizeof(int32_t));
    h_keep_[max_seq_len_] = (int32_t)n;
    check_cuda(cudaMemcpyAsync(d_keep_, h_keep_, (size_t)n * sizeof(int32_t), cudaMemcpyHostToDevice, st), "upload keep");
    check_cuda(cudaMemcpyAsync(d_count_, h_keep_ + max_seq_len_, sizeof(int32_t), cudaMemcpyHostToDevice, st),
               "upload count");
    launch_compact(d_keep_, d_count_);
    check_cuda(cudaStreamSynchronize(st), "commit");
  }
  cache_len_ += n;
  pending_ = 0;
}

void CudaModel::truncate(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  check_truncate_args(*this, n);
  cache_len_ = n;  // a host-side length: later forwards overwrite the device rows past n
  pending_ = 0;
}

void CudaModel::commit_device(const int32_t* keep_d, const int32_t* count_d) {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  if (!keep_d || !count_d) throw Error("commit_device: null device pointer");
  if (pending_ == 0) throw Error("commit_device: nothing pending (run forward first)");
  DeviceGuard guard(opt_.device);
  launch_compact(keep_d, count_d);
}

void CudaModel::set_committed(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  if (n < 0 || n > pending_)
    throw Error("set_committed: " + std::to_string(n) + " outside [0, pending = " + std::to_string(pending_) + "]");
  cache_len_ += n;
  pending_ = 0;
}

CudaModel::CacheLayout CudaModel::cache_layout() const {
  const int64_t CR = cfg_.kv_lora_rank + cfg_.qk_rope_head_dim;
  return CacheLayout{cache_mem_, (int)cfg_.num_hidden_layers, max_seq_len_ * CR * (int64_t)sizeof(float),
                     CR * (int64_t)sizeof(float), (int)(CR * sizeof(float))};
}

void CudaModel::synchronize() {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceGuard guard(opt_.device);
  check_cuda(cudaStreamSynchronize(as_stream(stream_)), "synchronize");
}

void CudaModel::read_cache(int64_t layer, int64_t begin, int64_t n, float* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (layer < 0 || layer >= cfg_.num_hidden_layers) throw Error("read_cache: layer out of range");
  if (begin < 0 || n < 0 || begin + n > cache_len_ + pending_)
    throw Error("read_cache: rows [" + std::to_string(begin) + ", " + std::to_string(begin + n) +
                ") outside the filled cache [0, " + std::to_string(cache_len_ + pending_) + ")");
  const int64_t CR = cfg_.kv_lora_rank + cfg_.qk_rope_head_dim;
  DeviceGuard guard(opt_.device);
  check_cuda(cudaStreamSynchronize(as_stream(stream_)), "read_cache");
  if (n > 0)
    check_cuda(cudaMemcpy(out, layers_[(size_t)layer].cache + begin * CR, (size_t)(n * CR) * sizeof(float),
                          cudaMemcpyDeviceToHost),
               "read_cache");
}

std::vector<int32_t> CudaModel::last_expert_counts() {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t E = n_moe_layers_ > 0 ? cfg_.n_routed_experts : 0;
  std::vector<int32_t> out((size_t)(n_moe_layers_ * E));
  if (out.empty()) return out;
  DeviceGuard guard(opt_.device);
  check_cuda(cudaStreamSynchronize(as_stream(stream_)), "last_expert_counts");
  check_cuda(cudaMemcpy(out.data(), expert_counts_, out.size() * sizeof(int32_t), cudaMemcpyDeviceToHost),
             "last_expert_counts");
  return out;
}

}  // namespace kdtree

#endif  // KDTREE_HAVE_CUBLAS
