// cuda_model.h: the GPU backend of the target model (DeepSeek-V3 / Kimi-K2, HF
// DeepseekV3ForCausalLM semantics, FP32), the same TargetModel interface as the CPU model
// (cpp/model/model.h) so that the engine drives either. docs/CUDA_MODEL.md describes it.
//
// Weights are uploaded once (set_weight, one tensor at a time by HF name); the latent cache
// [layers, max_seq_len, C+R] and every workspace are allocated once at construction, sized
// from max_seq_len and max_tokens (the most tokens one forward step computes: a prefill chunk
// or 1 + the largest tree budget); forward() allocates nothing. Dense projections are cuBLAS
// SGEMMs (FP32; TF32 only when asked for), the attention is verify_attention (cuda/kernels.h)
// over the latent cache, and the MoE runs routing, grouping and the expert GEMMs on the device
// with no host work per token (cuda/model/model_kernels.h).
//
// Two ways in:
//  * host path (TargetModel): tokens / positions / uint8 visibility from host memory, logits
//    copied back to host memory; a causal forward longer than max_tokens runs in chunks.
//  * device path (the GPU round): forward_device() with device pointers (visibility as the
//    bitmask tree_build writes), logits left on the device, nothing synchronised;
//    commit_device() compacts on the device from a device keep list and count, and
//    set_committed() tells the host the new length once it has read the count back.
//
// Legend: T = new tokens, L = committed cache length, Dm = hidden, H = heads, C = kv_lora_rank,
// R = qk_rope_head_dim, E = routed experts, K = experts per token, V = vocab.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/model.h"

namespace kdtree {
namespace cuda {
struct LinearParams;  // model_kernels.h
}

struct CudaModelOptions {
  int64_t max_tokens = 0;        // most tokens per forward step; 0 = min(max_seq_len, 1025)
  int device = 0;                // CUDA device ordinal
  int math = 0;                  // cuBLAS math: kMathDefault (FP32), kMathPedantic, kMathTf32 (opt-in)
  bool attention_naive = false;  // force verify_attention's simple reference kernel (testing)
  int attention_kernel = 0;      // verify_attention's force_kernel: 0 auto, 1 tiled, 2 split-KV, 3 decode, 4 tensor cores
                                 // (benchmarks / testing; a kernel that cannot take a shape passes it on)
  int attention_rows = 0;        // verify_attention's force_splitkv_rows: 0 auto, 4, 8 or 16 (benchmarks)
  int expert_kernel = 0;         // kExpertAuto, kExpertSkinny (GEMV-style, tiles of 8 slots), kExpertTiled (SGEMM
                                 // tiles of 64 slots), kExpertMma (tensor cores, 3xTF32; where the shapes do not
                                 // allow it, expert_mma_supported: the GEMV-style kernel)
  int expert_mma_rows = 0;       // slots per tile of the tensor-core expert kernel: 0 = auto (by assignments
                                 // per expert), 8, 16, 32 or 64
  int skinny_max_tokens = -1;    // steps of <= this many tokens run the dense projections through
                                 // linear_skinny instead of cuBLAS; -1 = auto, 0 = never (cuBLAS only)
  int skinny_big_max_tokens = -1;  // weights of more than kSkinnyBigBytes (the L2) run through linear_skinny
                                   // only in steps of <= this many tokens, cuBLAS beyond (each token slice
                                   // re-reads them from HBM); -1 = auto (16: one slice); a fused RMSNorm
                                   // (<= 4 tokens) stays on the skinny kernel
  int tile_max_tokens = -1;      // steps of at most this many tokens run the dense projections through
                                 // linear_tile (shared-memory tiles, split-k clusters) where linear_skinny
                                 // does not take them (past skinny_max_tokens, or 6..16 tokens while
                                 // skinny_max_tokens is auto); cuBLAS beyond; -1 = auto (264 tokens for
                                 // matrices of <= 32 MB as FP32, 72 for larger ones), 0 = never; an
                                 // explicit value holds for every matrix
  bool tile_tensor_cores = true;  // linear_tile's products on the tensor cores as 3xTF32 (FP32-accurate,
                                  // docs/CUDA_MODEL.md), else FP32 on the CUDA cores
  bool side_stream = true;       // run independent kernels of a step on a second stream (graph
                                 // branches): mla_prep beside the W_UK product, the shared expert's
                                 // SwiGLU + down projection beside the routed experts (steps on
                                 // linear_skinny / linear_tile, <= 72 tokens by default); same results
  bool bf16_weight_copies = true;  // weights whose every value is exactly a BF16 (a BF16 checkpoint) also get a
                                   // BF16 copy on the device, made at finalize(), which the kernels of steps up
                                   // to 72 tokens (linear_skinny, linear_tile, both expert kernels) read instead:
                                   // the same results from half the bytes, for +50 % weight memory
                                   // (docs/CUDA_MODEL.md)
  bool bf16_weights_only = false;  // every weight matrix held as BF16 alone (2 bytes a value; the FP32 form is
                                   // never stored): each matrix given must be exactly BF16 (set_weight refuses
                                   // another value), the kernels of few-token steps read it as the copies above,
                                   // the cuBLAS products widen it into a workspace block by block first. The same
                                   // results as bf16_weight_copies where each cuBLAS product is one call (its
                                   // matrix fits bf16_widen_elements); the vectors stay FP32, the embedding is a matrix here.
                                   // Needs every matrix's inner size a multiple of 8 and tile_tensor_cores
                                   // (docs/CUDA_MODEL.md "BF16 weights")
  int64_t bf16_widen_elements = 0;  // bf16_weights_only: the most weight values a cuBLAS product widens at once
                                    // (0 = 16M, 64 MB of workspace); smaller runs it in more blocks of rows
  std::vector<std::string> fp32_matrices;  // bf16_weights_only: these weight matrices (HF names) held as FP32 all the
                                 // same, for a checkpoint that stores a few in F32 (the embedded default's routers):
                                 // a router block or an expert stack is held FP32 whole when a piece of it is named
                                 // (the router rows share one matrix with the shared expert's gate/up rows); an
                                 // unknown or non-matrix name is an Error (docs/CUDA_MODEL.md "BF16 weights")
  int int4_experts_group = 0;    // > 0: the routed experts' matrices held as 4-bit integers in groups of this many
                                 // weights along k with one scale each (Kimi K2's INT4 W4A16 experts: 32), 0.5
                                 // bytes a weight + a float a group, given by set_weight_int4 only; both expert
                                 // kernels read them and dequantize in registers to the loader's BF16 values (the
                                 // same logits as those values held otherwise). A power of two >= 32 dividing
                                 // hidden_size and moe_intermediate_size; not with expert_kernel 'tiled'
                                 // (docs/CUDA_MODEL.md "INT4 experts")
  int uv_combine_max_tokens = 1;  // steps of at most this many tokens (<= cuda::kUvMaxT; 0 = never) whose attention
                                  // splits the keys merge the splits inside the W_UV product (uv_combine kernel:
                                  // one launch instead of two; the same attention output, the W_UV sums in another
                                  // order than linear_skinny's); decode only by default (docs/CUDA_MODEL.md)
  bool graphs = true;            // forward_device replays a CUDA graph per (T, context bucket, buffers) from
                                 // the second call with the same shape on (docs/CUDA_MODEL.md)
  bool combine_norm = true;      // steps whose norms run as their own kernels (> 4 tokens): the RMSNorm after a
                                 // MoE layer (the next layer's input norm, or the final one) runs inside the
                                 // MoE combine kernel (one launch fewer a MoE layer; the same bits as the
                                 // separate kernel in every case tested, model_kernels.h)
  int context_buckets = 1;       // context buckets per doubling of the context past 256 (1, 2, 4 or 8): the
                                 // attention of a step at context L is sized for the bucket's top (grid, key
                                 // splits, kernel), so more buckets fit L more tightly at the price of more
                                 // graphs (docs/CUDA_MODEL.md "CUDA graphs")
  bool row_exact = false;        // steps of at most kRowExactMaxT tokens (decode, the verify of trees up to that
                                 // size) run kernels whose every output row is a function of its own token alone:
                                 // a tree node's logits are the bits of the one-token step at its position (DDTree
                                 // == AR bit for bit on the GPU, as on the CPU). Every projection on linear_tile in
                                 // fixed tiles, verify_attention's exact kernels, the routed experts on fixed tiles;
                                 // the skinny kernels, fused norms, uv_combine and cuBLAS stay out of those steps.
                                 // Slower; needs the model's inner sizes multiples of 4 (docs/CUDA_MODEL.md
                                 // "Row-exact steps")
  int q_fold_max_tokens = -1;    // q-LoRA models with FP32 weights: steps of kQFoldMinT up to this many tokens project
                                 // the queries straight from the layer's input through one folded matrix
                                 // W_qb diag(g) W_qa (made at finalize(); rows after q_a / kv_a, one product with
                                 // them) and apply q_a's RMS factor to the attention scores: the q_a norm and the
                                 // q_b product leave the step's chain, for H * (Dn + R) x hidden more FP32 weights a
                                 // layer. -1 = auto: kQFoldAutoMaxT where those rows add at most
                                 // kQFoldAutoMaxExtraBytes a layer over q_b (mini-kimi, not Kimi K2's shapes), else
                                 // never; 0 = never. Not in row-exact steps, not for layers whose q_a and kv_a
                                 // are exactly BF16, not with BF16-only weights (docs/CUDA_MODEL.md "Folded query
                                 // projection")
  static constexpr int64_t kRowExactMaxT = 264;
  static constexpr int64_t kQFoldMinT = 5, kQFoldAutoMaxT = 24;
  static constexpr int64_t kQFoldAutoMaxExtraBytes = int64_t(16) << 20;
  static constexpr int kMathDefault = 0, kMathPedantic = 1, kMathTf32 = 2;
  static constexpr int kExpertAuto = 0, kExpertSkinny = 1, kExpertTiled = 2, kExpertMma = 3;
};

class CudaModel : public TargetModel {
 public:
  // Throws Error for a bad config / sizes, RuntimeFailure when there is no usable device, no
  // cuBLAS, or not enough device memory (the message gives the sizes asked for).
  CudaModel(const ModelConfig& cfg, int64_t max_seq_len, const CudaModelOptions& opt = CudaModelOptions());
  ~CudaModel() override;
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& config() const override { return cfg_; }
  int64_t max_seq_len() const override { return max_seq_len_; }
  const char* device() const override { return "cuda"; }
  // The context bucket of a T-token step at committed length L: the next power of two >= L + 1 (at
  // least 256), or with context_buckets = n > 1 the next of n equal steps inside that doubling, at
  // most max_seq_len - T. Every step's attention is sized for it (docs/CUDA_MODEL.md "CUDA graphs").
  int64_t context_bucket(int64_t L, int64_t T) const;

  void set_weight(const std::string& name, const float* data, const std::vector<int64_t>& shape) override;
  // Why bf16_weights_only cannot hold this config with these options ("" when it can)
  static std::string bf16_only_unsupported(const ModelConfig& cfg, const CudaModelOptions& opt);
  // set_weight of the float32 values whose high halves `bits` are (a BF16 tensor), without widening
  // them on the host first: with bf16_weights_only a matrix's bits go to the device as they are
  void set_weight_bf16(const std::string& name, const uint16_t* bits, const std::vector<int64_t>& shape);
  // A routed expert's matrix [N, K] (shape) as 4-bit integers (packed [N, K / 2], element 2j in the low nibble
  // of byte j, each the integer + 8) and float32 scales [N, K / group] (CpuModel::set_weight_int4's form):
  // with int4_experts_group = group, held as given; any other matrix, or a model without INT4 experts, takes
  // the dequantized values (bf16_round((q - 8) * scale)) through set_weight.
  void set_weight_int4(const std::string& name, const uint8_t* packed, const float* scales, int64_t group,
                       const std::vector<int64_t>& shape);
  // The storage block an HF weight matrix lands in ("lm_head", "<layer>.router", "<layer>.experts_down", ...): what
  // fp32_matrices holds FP32 whole ("embed": the embedding); "" for a name that is not a weight matrix of this config
  static std::string matrix_block(const ModelConfig& cfg, const std::string& name);
  static std::string block_of(const std::string& name);  // matrix_block of a name known to be a 2-D weight
  // Why int4_experts_group = group cannot hold this config with these options ("" when it can)
  static std::string int4_experts_unsupported(const ModelConfig& cfg, const CudaModelOptions& opt, int64_t group);
  std::vector<std::string> missing_weights() const override;
  void finalize() override;
  bool finalized() const override { return finalized_; }

  void forward(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
               float* logits_out) override;
  // The last `rows` tokens' logits only (TargetModel::forward_last): the LM head over those rows (when
  // they lie in the last max_tokens chunk; else the whole forward, its tail copied).
  void forward_last(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
                    int64_t rows, float* logits_out) override;
  void commit(const int32_t* keep, int64_t n) override;
  void truncate(int64_t n) override;
  void reset() override;
  int64_t cache_len() const override { return cache_len_; }
  int64_t pending_len() const override { return pending_; }
  bool cache_epoch(uint64_t* out) const override {
    *out = epoch_;
    return true;
  }

  // ---- device path (all pointers device memory; work queued on stream(), not synchronised)
  // tokens_d [T], positions_d [T], vis_bits_d [T, vis_stride] uint64 (bit j of row i: new token
  // i sees new token j; nullptr = causal), logits_d [T, V]. T <= max_tokens.
  // rows >= 0: the logits of the last `rows` tokens only (logits_d [rows, V]; the final norm and
  // the LM head run over those rows alone: a prefill chunk needs 1 or 0), -1: all T.
  void forward_device(const int32_t* tokens_d, const int32_t* positions_d, const uint64_t* vis_bits_d,
                      int64_t vis_stride, int64_t T, float* logits_d, int64_t rows = -1);
  // Pending entries keep_d[0 .. *count_d) (strictly increasing) packed after the context, on
  // the device; the host length is unchanged until set_committed(n) with n = *count_d.
  void commit_device(const int32_t* keep_d, const int32_t* count_d);
  void set_committed(int64_t n);
  void* stream() const { return stream_; }  // cudaStream_t
  int device_ordinal() const { return opt_.device; }
  // The model's own logits workspace [max_tokens, V] (device), free for a caller of
  // forward_device between steps (the host path uses it inside forward()).
  float* logits_device() const { return logits_; }
  // The latent cache's layout for a caller that compacts it itself (e.g. the fused accept +
  // compaction of the GPU round): layer l, slot s at base + l*layer_stride + s*row_stride bytes,
  // row_bytes moved per slot.
  struct CacheLayout {
    void* base;
    int num_layers;
    int64_t layer_stride, row_stride;
    int row_bytes;
  };
  CacheLayout cache_layout() const;
  void synchronize();

  // ---- inspection
  int64_t max_tokens() const { return max_tokens_; }
  // Copy n cache rows [begin, begin + n) of `layer` into out [n, C + R] (host).
  void read_cache(int64_t layer, int64_t begin, int64_t n, float* out);
  // Routed-expert token counts of the last forward, [MoE layers, E] (host), for the benchmark's
  // "experts touched" and bytes-read accounting.
  std::vector<int32_t> last_expert_counts();
  int64_t memory_bytes() const { return weight_bytes_ + bf16_bytes_ + q4_bytes_ + cache_bytes_ + workspace_bytes_; }
  // device bytes of the INT4 experts (nibbles + scales; 0 without int4_experts_group)
  int64_t int4_weight_bytes() const { return q4_bytes_; }
  int int4_experts_group() const { return opt_.int4_experts_group; }
  int64_t weight_bytes() const { return weight_bytes_; }
  // device bytes of the BF16 weight copies (0 until finalize() found a BF16-exact weight, or with
  // bf16_weight_copies off) and how many of the weights' floats they cover
  int64_t bf16_weight_bytes() const { return bf16_bytes_; }
  bool bf16_weights_only() const { return opt_.bf16_weights_only; }
  bool bf16_weight_copies() const { return opt_.bf16_weight_copies; }
  int64_t bf16_weight_elements() const;
  int64_t cache_bytes() const { return cache_bytes_; }
  int64_t workspace_bytes() const { return workspace_bytes_; }
  std::string device_name() const { return device_name_; }
  std::string cublas_path() const;
  int64_t graph_replays() const { return graph_replays_; }
  int64_t graph_captures() const { return graph_captures_; }

 private:
  struct Layer {
    float *input_ln = nullptr, *post_ln = nullptr;       // [Dm]
    float* qkv_a = nullptr;    // [qr + C + R, Dm]: q_a_proj rows then kv_a_proj_with_mqa rows (qr = 0: kv only)
    float* q_a_ln = nullptr;   // [qr]
    float* q_b = nullptr;      // [H*Dqk, qr], or q_proj [H*Dqk, Dm] when q_lora_rank == 0
    float* kv_a_ln = nullptr;  // [C]
    float *w_ukT = nullptr, *w_uv = nullptr;             // [H, C, Dn] (W_UK transposed), [H, Dv, C] (from kv_b_proj)
    float* o_proj = nullptr;   // [Dm, H*Dv]
    bool moe = false;
    bool q_fold = false;       // the folded query rows are made and used (finalize(): not for BF16-exact q_a / kv_a)
    float *mlp_gate_up = nullptr, *mlp_down = nullptr;   // dense: [2I, Dm], [Dm, I]
    float *router = nullptr, *router_bias = nullptr;     // [E (+ 2Is, the shared gate/up rows), Dm], [E]
    float *experts_gate_up = nullptr, *experts_down = nullptr;  // [E, 2Ie, Dm], [E, Dm, Ie]
    float *shared_gate_up = nullptr, *shared_down = nullptr;    // [2Is, Dm] (= router + E*Dm: the two are one
                                                                // [E + 2Is, Dm] block), [Dm, Is]
    float* cache = nullptr;    // [max_seq_len, C+R]
    int moe_index = -1;        // index among MoE layers
  };
  struct Slot {
    float* dst = nullptr;
    std::vector<int64_t> shape;
    int kind = 0;  // kCopy, or kKvB (split into w_ukT / w_uv)
    int64_t layer = -1;
    bool set = false;
    bool bf16_exact = false;  // every value set is exactly a BF16 (its low 16 bits zero)
    bool values_bf16 = false;  // the same, whatever bf16_weight_copies says, for q_a / kv_a (the q fold's choice)
  };
  static constexpr int kCopy = 0, kKvB = 1;

  void check_cuda(int err, const char* what) const;
  void check_cublas(int status, const char* what) const;
  // out[T, N] (ldo) = alpha * in[T, Kd] (ldi) @ w[N, Kd]^T + beta * out. norm_w (only when
  // fuse_norm(T)): the in rows are RMSNorm-ed with norm_w / norm_eps first, inside the kernel;
  // norm_out (with norm_w): the normalised rows are also written there [T, Kd], for other consumers.
  // tile_rows: linear_tile's token rows per tile (LinearParams::tile_rows; 0 = its automatic height).
  void gemm_nt(int64_t T, int64_t N, int64_t Kd, const float* in, int64_t ldi, const float* w, float* out,
               int64_t ldo, float beta = 0.f, const float* norm_w = nullptr, double norm_eps = 0.0,
               float* norm_out = nullptr, int tile_rows = 0);
  // gemm_nt's parameters, and which kernel it runs them on; gemm_run launches that on `stream`
  // (nullptr: stream_; cuBLAS only on stream_, its handle's stream)
  enum class GemmKind { kSkinny, kTile, kCublas };
  cuda::LinearParams gemm_params(int64_t T, int64_t N, int64_t Kd, const float* in, int64_t ldi, const float* w,
                                 float* out, int64_t ldo, float beta) const;
  GemmKind gemm_kind(const cuda::LinearParams& lp) const;
  void gemm_run(cuda::LinearParams lp, float* norm_out, void* stream);
  // per head h < heads: out[T, N] (ldo, at h * out_head) = in[T, Kd] (ldi, at h * in_head) @ w_h^T,
  // w_h = w + h * N * Kd row-major [N, Kd] (the absorbed MLA products W_UK, W_UV)
  // the parameters of gemm_nt_heads' product, and whether it runs on linear_skinny
  cuda::LinearParams heads_params(int64_t T, int64_t N, int64_t Kd, const float* in, int64_t ldi, int64_t in_head,
                                  const float* w, float* out, int64_t ldo, int64_t out_head, int64_t heads) const;
  bool heads_on_skinny(const cuda::LinearParams& lp) const;
  void gemm_nt_heads(int64_t T, int64_t N, int64_t Kd, const float* in, int64_t ldi, int64_t in_head, const float* w,
                     float* out, int64_t ldo, int64_t out_head, int64_t heads);
  void run_heads(const cuda::LinearParams& lp);  // gemm_nt_heads' dispatch (linear_skinny, linear_tile, cuBLAS)
  // out[T, N] (ld ldo) = beta * out + swiglu(gu) @ w^T with gu [T, 2I] = [gate | up] rows, row
  // stride ldg (the down projection of an MLP): the SwiGLU inside linear_skinny for a few tokens
  // (swiglu_in_skinny), else swiglu into act (nullptr: act_) then gemm_run; on `stream` (nullptr: stream_).
  void swiglu_gemm_nt(int64_t T, int64_t N, int64_t I, const float* gu, int64_t ldg, const float* w, float* out,
                      int64_t ldo, float beta = 0.f, float* act = nullptr, void* stream = nullptr);
  bool swiglu_in_skinny(int64_t T) const;  // swiglu_gemm_nt's SwiGLU inside linear_skinny
  // steps whose RMSNorms feeding a single projection run inside that projection's kernel
  bool fuse_norm(int64_t T) const;
  int64_t tile_max_for(int64_t wbytes) const;  // most tokens on linear_tile for a matrix of wbytes (FP32)
  bool tile_first(int64_t T, int64_t wbytes) const;  // linear_tile ahead of linear_skinny (auto rule; wbytes: the matrix)
  // The forward over T <= max_tokens tokens already on the device (d_tokens_/d_positions_ or
  // the caller's), cache rows written from row0 = committed + chunk offset.
  // len_d (graph replays): the committed length is read from device memory (*len_d, rows written
  // from there) and row0 is only its upper bound (sizes the attention grid); nullptr: row0 exact.
  // rows >= 0: the LM head over the last `rows` tokens only (logits_d [rows, V]); -1: all T.
  void run_step(const int32_t* tokens_d, const int32_t* positions_d, const uint64_t* vis_d, int64_t vis_stride,
                int64_t T, int64_t row0, float* logits_d, const int32_t* len_d = nullptr, int64_t rows = -1);
  // run_step as a graph of it runs: committed length row0 through d_len_, the attention sized for
  // context_bucket(row0, T); every step (eager, captured, host path) goes through this shape
  void run_step_bucketed(const int32_t* tokens_d, const int32_t* positions_d, const uint64_t* vis_d,
                         int64_t vis_stride, int64_t T, int64_t row0, float* logits_d, int64_t rows = -1);
  // in: the layer input x_ with its RMSNorm (in_norm) fused into the projections (fuse_norm(T)),
  // or the normed hn_ (in_norm = nullptr)
  void attention(Layer& ly, const uint64_t* vis_d, int64_t vis_stride, int64_t T,
                 int64_t row0, const int32_t* len_d, const float* in, const float* in_norm);
  // CUDA graphs of forward_device: one per key, captured on the key's second use.
  struct GraphKey {
    const void *tokens, *positions, *vis, *logits;
    int64_t vis_stride, T, l_bound, rows;
    bool operator==(const GraphKey& o) const {
      return tokens == o.tokens && positions == o.positions && vis == o.vis && logits == o.logits &&
             vis_stride == o.vis_stride && T == o.T && l_bound == o.l_bound && rows == o.rows;
    }
  };
  struct GraphEntry {
    GraphKey key;
    int uses = 0;
    void* exec = nullptr;  // cudaGraphExec_t
  };
  void* graph_for(const GraphKey& key);  // nullptr: run eagerly this time
  void forward_rows(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
                    int64_t rows, float* logits_out);  // forward (rows < 0) / forward_last
  void clear_graphs();
  // fused_norm: the post-attention RMSNorm of x_ runs inside the first projection (fuse_norm(T)),
  // else hn_ holds the normalised input already
  void dense_mlp(const Layer& ly, int64_t T, bool fused_norm);
  // next_norm (nullable): the RMSNorm weights of what follows (the next layer's input norm or the
  // final one); when the combine can take it (combine_norm option, moe_combine_norm_ok), hn_ =
  // next_norm * rmsnorm(x_) is written by moe_combine too and the call returns true.
  bool moe_mlp(const Layer& ly, int64_t T, bool fused_norm, const float* next_norm = nullptr);
  void launch_compact(const int32_t* keep_d, const int32_t* count_d);
  // The BF16 copy of the weights [w, w + n) when they lie in one BF16-exact range and the copies
  // exist (finalize), else nullptr.
  const uint16_t* bf16_of(const float* w, int64_t n) const;
  void make_bf16_copies();  // finalize(): the exact ranges, the copy arena (once), the conversion
  // bf16_weights_only: whether w lies in the matrices' reserved (never backed) FP32 address range,
  // i.e. is held as BF16 alone and must not be read as FP32
  bool bf16_only(const float* w) const { return w && w >= mat_begin_ && w < mat_end_; }
  // bf16_weights_only: lp's weights widened into widen_ (a cuBLAS product, or a kernel that would
  // not read the BF16 form) on the main stream; lp then points there (w_bf16 cleared)
  void widen_weights(cuda::LinearParams& lp, int64_t elements);
  // INT4 experts: the packed nibbles and scales of the stack part at w (in [q_begin_, q_end_)), n values
  struct Q4View {
    const uint8_t* packed = nullptr;
    const float* scales = nullptr;
  };
  Q4View int4_of(const float* w, int64_t n) const;
  // whether w lies in the INT4 expert stacks' reserved FP32 range (held as 4-bit integers: set_weight_int4 only)
  bool int4_held(const float* w) const { return w && w >= q_begin_ && w < q_end_; }
  bool upload_bf16_ok(const Slot& s) const;  // bf16_weights_only and s is a matrix: held as BF16 alone
  void upload_bf16(Slot& s, const uint16_t* bits);  // its bits into the BF16 arena
  template <class T>
  void split_kv_b(const T* data, std::vector<T>* uk, std::vector<T>* uv) const;  // kv_b_proj -> W_UK^T, W_UV

  ModelConfig cfg_;
  int64_t max_seq_len_ = 0, max_tokens_ = 0;
  int64_t skinny_max_t_ = 0;  // resolved opt_.skinny_max_tokens
  int64_t skinny_big_max_t_ = 0;  // resolved opt_.skinny_big_max_tokens
  int64_t tile_max_t_ = 0;  // resolved opt_.tile_max_tokens
  bool exact_step_ = false;  // the step being built is row-exact (opt_.row_exact, T <= kRowExactMaxT; run_step)
  int exact_split_ = 0;      // row_exact: the exact attention's keys per split (fixed at construction)
  CudaModelOptions opt_;
  std::string device_name_;
  void* stream_ = nullptr;          // cudaStream_t
  void* side_ = nullptr;            // cudaStream_t: the second stream (opt_.side_stream), else nullptr
  void* ev_fork_ = nullptr;         // cudaEvent_t: main -> side
  void* ev_join_ = nullptr;         // cudaEvent_t: side -> main
  // Side work: fork() makes the side stream wait for the main stream's work so far and returns the
  // stream to launch on (the main one without opt_.side_stream); join() makes the main stream wait
  // for the side's work. Inside a capture these become graph branches.
  void* fork();
  void join();
  void* cublas_ = nullptr;          // cublasHandle_t
  std::mutex mu_;

  // one allocation each: weights, cache, workspace; pinned host staging
  void* weights_mem_ = nullptr;
  struct Bf16Range {
    const float *begin, *end;  // a merged run of BF16-exact weight matrices in the weights arena
    int64_t off;               // its copy at bf16_mem_ + off (uint16 elements, 256-byte aligned)
    bool operator==(const Bf16Range& o) const { return begin == o.begin && end == o.end; }
  };
  void* bf16_mem_ = nullptr;        // the BF16 copies (bf16_ranges_), one allocation
  int64_t bf16_bytes_ = 0;
  std::vector<Bf16Range> bf16_ranges_;  // sorted by begin
  // bf16_weights_only: the matrices' FP32 addresses, a reserved device address range with no memory
  // behind it (a read faults), held as one BF16 range
  void* mat_va_ = nullptr;
  int64_t mat_va_bytes_ = 0;
  const float *mat_begin_ = nullptr, *mat_end_ = nullptr;
  // INT4 experts (opt_.int4_experts_group): the expert stacks' FP32 addresses, another reserved range with nothing
  // behind it; per stack its nibbles and scales in q4_mem_ (q4_ranges_, sorted by begin)
  void* q_va_ = nullptr;
  int64_t q_va_bytes_ = 0;
  const float *q_begin_ = nullptr, *q_end_ = nullptr;
  struct Q4Range {
    const float *begin, *end;
    int64_t packed_off, scale_off;  // bytes into q4_mem_
  };
  std::vector<Q4Range> q4_ranges_;
  void* q4_mem_ = nullptr;
  int64_t q4_bytes_ = 0;
  bool q4_scales_bf16_ = true;  // every INT4 stack's scales given so far are BF16 values (ExpertGemmParams::int4_scales_bf16)
  float* widen_ = nullptr;        // [widen_elems_] workspace of the widened weights (bf16_weights_only)
  int64_t widen_elems_ = 0;
  void* cache_mem_ = nullptr;
  void* work_mem_ = nullptr;
  void* host_mem_ = nullptr;
  int64_t weight_bytes_ = 0, cache_bytes_ = 0, workspace_bytes_ = 0, host_bytes_ = 0;

  std::vector<Layer> layers_;
  float *embed_ = nullptr, *final_ln_ = nullptr, *lm_head_ = nullptr, *inv_freq_ = nullptr;
  std::unordered_map<std::string, Slot> slots_;
  std::vector<std::string> slot_order_;
  bool finalized_ = false;
  int64_t cache_len_ = 0, pending_ = 0;
  uint64_t epoch_ = 0;  // cache_epoch(): bumped by every call that can change the cache or the weights
  int64_t n_moe_layers_ = 0;
  std::vector<GraphEntry> graphs_;
  int64_t graph_replays_ = 0, graph_captures_ = 0;

  // workspaces (device), sized for max_tokens_ = Tm
  float *x_ = nullptr, *hn_ = nullptr;     // [Tm, Dm]
  float* qkv_a_out_ = nullptr;             // [Tm, qr + C + R]
  float* q_ = nullptr;                     // [Tm, H*Dqk]
  float *q_lat_ = nullptr, *q_rope_ = nullptr, *o_lat_ = nullptr;  // [Tm, H, C], [Tm, H, R], [Tm, H, C]
  float* rope_cs_ = nullptr;               // [Tm, R] the step's RoPE cos | sin per token (embed writes it)
  float* ov_ = nullptr;                    // [Tm, H*Dv]
  float *gu_ = nullptr, *act_ = nullptr;   // dense / shared / tiled-expert [rows, 2I], [rows, I]
  float *ye_ = nullptr, *ys_ = nullptr;    // [Tm*K, Dm] expert outputs by slot, [Tm, Dm] shared
  float* acts_ = nullptr;                  // [Tm, Is] the shared expert's SwiGLU output (side stream)
  float* router_logits_ = nullptr;         // [Tm, E], or [Tm, E + 2Is] (router | shared gate/up, merged)
  int32_t* topk_idx_ = nullptr;            // [Tm, K]
  float* topk_w_ = nullptr;                // [Tm, K]
  int32_t* expert_counts_ = nullptr;       // [MoE layers, E]
  int32_t* offsets_ = nullptr;             // [E + 1]
  int32_t *slot_token_ = nullptr, *slot_of_ = nullptr;  // [Tm*K]
  int32_t *tile_expert_ = nullptr, *tile_row0_ = nullptr, *num_tiles_ = nullptr;
  // the folded query projection (q_fold_max_tokens): fold_rows_ extra rows of every qkv_a block (0: none),
  // q_scale_ [Tm] the per-token score factors, steps of at most q_fold_max_t_ tokens
  int64_t fold_rows_ = 0, q_fold_max_t_ = 0;
  float* q_scale_ = nullptr;
  int64_t max_tiles_ = 0;
  float* logits_ = nullptr;                // [Tm, V] (host path)
  int32_t *d_tokens_ = nullptr, *d_positions_ = nullptr, *d_keep_ = nullptr, *d_count_ = nullptr;
  int32_t* d_len_ = nullptr;               // [1] committed length, for graph replays
  uint64_t *d_vis_ = nullptr, *d_causal_ = nullptr;  // [Tm, Wm]
  int64_t vis_words_ = 0;                  // Wm = ceil(Tm / 64)
  void* attn_ws_ = nullptr;
  int64_t attn_ws_bytes_ = 0;
  void* cublas_ws_ = nullptr;
  int64_t cublas_ws_bytes_ = 0;
  // pinned host staging
  int32_t *h_tokens_ = nullptr, *h_positions_ = nullptr, *h_keep_ = nullptr;
  uint64_t* h_vis_ = nullptr;
};

}  // namespace kdtree
