// cpu_model.h: the CPU backend of the target model (DeepSeek-V3 / Kimi-K2, HF
// DeepseekV3ForCausalLM semantics, FP32). The executable specification the CUDA model is
// checked against; also what CI runs. docs/MODEL.md describes the implementation.
//
// Legend: T = new tokens, L = committed cache length, S = L + T, Dm = hidden, H = heads,
// C = kv_lora_rank, R = qk_rope_head_dim, Dn = qk_nope_head_dim, Dv = v_head_dim,
// E = routed experts, k = experts per token, V = vocab.
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/model.h"

namespace kdtree {

// How the CPU model holds a weight matrix whose every value is exactly a BF16 (a BF16 checkpoint, widened
// to FP32 by the loader; also INT4 / FP8 checkpoints dequantized with BF16 scales):
//   kOnly   as BF16 alone (the default): 2 bytes a weight. The few-row GEMMs (decode, tree verify,
//           experts) read it in sgemm's skinny kernels; a larger GEMM (prefill) widens blocks of its
//           rows into a scratch buffer and runs the FP32 GEMM on them. A 4-bit group-quantized matrix
//           given packed (set_weight_int4) stays packed in this mode only.
//   kCopies as FP32 plus a BF16 copy: 6 bytes a weight; the few-row GEMMs read the copy, larger ones
//           the FP32 values in place.
//   kOff    as FP32 alone: 4 bytes a weight; every GEMM reads FP32.
// The logits are the same bits in all three (widening is exact; the same kernels, tiles, k order and
// column chunks run on the same FP32 values). A matrix with any other value is held as FP32 in every
// mode. docs/MODEL.md "BF16 weights".
enum class Bf16Weights { kOnly, kCopies, kOff };
const char* bf16_weights_name(Bf16Weights m);
Bf16Weights bf16_weights_from_name(const std::string& s);  // "only" / "copies" / "off", else Error

class CpuModel : public TargetModel {
 public:
  CpuModel(const ModelConfig& cfg, int64_t max_seq_len, Bf16Weights bf16 = Bf16Weights::kOnly);

  const ModelConfig& config() const override { return cfg_; }
  int64_t max_seq_len() const override { return max_seq_len_; }
  const char* device() const override { return "cpu"; }

  void set_weight(const std::string& name, const float* data, const std::vector<int64_t>& shape) override;
  // set_weight of a BF16 tensor given as its bits (a BF16 checkpoint's bytes as they are stored): the
  // same as set_weight of the widened values, without widening them first (kOnly keeps the bits).
  void set_weight_bf16(const std::string& name, const uint16_t* bits, const std::vector<int64_t>& shape);
  // set_weight of a symmetric 4-bit group-quantized matrix [N, K] with BF16 scales (compressed-tensors
  // pack-quantized, Kimi K2-Thinking's experts): packed [N, K / 2] bytes, element 2j in the low nibble
  // of byte j, each nibble the integer + 8 (the checkpoint's int32 words read as bytes); scales [N, K /
  // group] (the BF16 values as floats). The weight is bf16_round((nibble - 8) * scale), exactly what
  // the loader's dequantization gives. With bf16_weights "only" the matrix is held packed (half a
  // byte a weight plus a float per group) and the GEMMs dequantize rows into a per-thread buffer as
  // they go (the same bits as on the BF16 matrix); otherwise, or when the matrix also gets pieces of
  // another form, it is dequantized on arrival. Throws Error on a scale that is not finite or that
  // overflows BF16 (the loader's checks), on group not dividing K, or for kv_b_proj / a vector.
  void set_weight_int4(const std::string& name, const uint8_t* packed, const float* scales, int64_t group,
                       const std::vector<int64_t>& shape);
  int64_t int4_weight_bytes() const;  // bytes of matrices held packed (nibbles + scales)
  std::vector<std::string> missing_weights() const override;
  void finalize() override;
  bool finalized() const override { return finalized_; }

  // A token's logits (and its cache row) are the same bits whatever else is in its window, for windows of
  // up to kRowExactWindow tokens and for tree windows of any size (a visibility that is not causal) on a
  // CPU with AVX2+FMA: a one-token AR step and the same position inside a tree verify agree exactly, so
  // DDTree emits AR's tokens in a near tie too, and a seeded sample lands on the same token. Every GEMM of
  // such a window takes the skinny kernels (the weights' at up to 128 rows by sgemm's own rule, beyond
  // through sgemm_rows_exact; the attention's through sgemm_rows_exact, whose rows (window x heads) and
  // columns (cache + the visible window) vary), the softmax treats a row the same whatever masked entries
  // follow it, and the rest is per row. Causal windows of more tokens (prefill chunks, shared by AR and
  // DDTree; the engine's trees, at most kTreeMaxDepth deep, are never such a chain) take the fastest GEMMs
  // instead: their rows agree with a one-token step to ~1e-6, not bit for bit.
  static constexpr int64_t kRowExactWindow = 128;
  void forward(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
               float* logits_out) override;
  // The LM head over the last `rows` tokens only (TargetModel::forward_last).
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

  // Test access: copy n cache rows [begin, begin + n) of `layer` into out [n, C + R]
  // (normed latent, then roped k_rope). Rows past cache_len + pending are refused.
  void read_cache(int64_t layer, int64_t begin, int64_t n, float* out) const;
  // Bytes held by weights + cache + workspaces (BF16, FP32 and packed 4-bit weight storage included).
  int64_t memory_bytes() const;

  // How exactly-BF16 weight matrices are held (Bf16Weights above). In kOnly a matrix is stored as
  // BF16 as its values arrive (set_weight), so loading never holds it as FP32; kCopies makes the copies
  // at finalize. set_bf16_weights converts what is held now (A/B, tests); use_bf16_weights(false) is
  // kOff, use_bf16_weights(true) the mode the model was built with (kOnly if that was kOff).
  void set_bf16_weights(Bf16Weights mode);
  Bf16Weights bf16_weights() const { return bf16_mode_; }
  void use_bf16_weights(bool on) { set_bf16_weights(on ? (built_mode_ == Bf16Weights::kOff ? Bf16Weights::kOnly : built_mode_) : Bf16Weights::kOff); }
  int64_t bf16_weight_bytes() const;  // bytes of weights held as BF16 (copies or only)
  int64_t fp32_weight_bytes() const;  // bytes of weight matrices held as FP32

 private:
  // A weight matrix (or a stack of them: the routed experts), held as FP32 values (f), BF16 bits (h),
  // or both (Bf16Weights). Allocated when its first values arrive.
  struct Weight {
    int64_t n = 0;              // elements
    bool gemm = true;           // read by GEMMs (false: the untied embedding, only looked up)
    std::vector<float> f;       // FP32 values, or empty
    std::vector<uint16_t> h;    // BF16 bits, or empty
    std::vector<uint8_t> q;     // or 4-bit integers, two a byte (set_weight_int4), with
    std::vector<float> qs;      //   a scale per group of qg weights along a row
    int64_t qg = 0;
    bool empty() const { return f.empty() && h.empty() && q.empty(); }
  };
  struct Layer {
    std::vector<float> input_ln, post_ln;          // [Dm]
    Weight q_a, q_b;                               // [qr, Dm], [H*(Dn+R), qr]         (q_lora_rank > 0)
    std::vector<float> q_a_ln;                     // [qr]
    Weight q_proj;                                 // [H*(Dn+R), Dm]                   (q_lora_rank == 0)
    Weight kv_a;                                   // [C+R, Dm]
    std::vector<float> kv_a_ln;                    // [C]
    Weight w_uk, w_uv;                             // [H, Dn, C], [H, Dv, C]: kv_b_proj split per head
    Weight o_proj;                                 // [Dm, H*Dv]
    bool moe = false;
    Weight mlp_gate_up, mlp_down;                  // dense: [2I, Dm] (gate rows, then up), [Dm, I]
    Weight router;                                 // [E, Dm]
    std::vector<float> router_bias;                // [E]
    Weight experts_gate_up;                        // [E, 2Ie, Dm]
    Weight experts_down;                           // [E, Dm, Ie]
    Weight shared_gate_up, shared_down;            // [2Is, Dm], [Dm, Is]
    std::vector<float> cache;                      // [max_seq_len, C+R] latent cache
  };
  struct Slot {
    float* dst = nullptr;        // contiguous FP32 destination (kind kCopy, a vector: norms, biases)
    Weight* w = nullptr;         // or a weight matrix (kind kCopy), at element offset off
    int64_t off = 0;
    std::vector<int64_t> shape;
    int kind = 0;                // kCopy, or kKvB: split rows into layer.w_uk / layer.w_uv
    int64_t layer = -1;
    bool set = false;
  };
  static constexpr int kCopy = 0, kKvB = 1;

  void ensure_workspace(int64_t T);
  // forward() with logits for the last `rows` of the T tokens (all of them: forward)
  void run(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T, int64_t rows,
           float* logits_out);
  // C[M, N] = A[M, K] @ W^T for the rows of weight w from element off on (W [N, K], row stride ldw;
  // trans_b = false: C = A @ W with W [K, N], the absorption's W_UK): from its BF16 bits when it has
  // them and the skinny kernels take the shape, else from its FP32 values, else (BF16 only, a large
  // GEMM) on blocks of it widened into a per-thread buffer (the routed experts run on the pool's
  // threads at once).
  void wgemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const Weight& w, int64_t off, int64_t ldw,
             float* C, int64_t ldc, bool trans_b = true) const;
  // Writes n values of w from element off on, as the mode holds them (allocating w on first use):
  // float32 values (T = float) or BF16 bits (T = uint16_t).
  template <class T>
  void store(Weight& w, int64_t off, const T* data, int64_t n);
  static void widen_held(Weight& w);  // w's FP32 values from its BF16 bits, if it has none yet
  // packed 4-bit pieces (set_weight_int4): kept packed when the mode and the matrix allow, else
  // dequantized into store(float)
  void store_int4(Weight& w, int64_t off, const uint8_t* packed, const float* scales, int64_t g, int64_t n);
  void unpack_int4(Weight& w);  // a packed matrix dequantized into h (kOnly) or f
  // rows [rows, K] of a packed matrix from element off on (row stride ldw) dequantized into dst [rows, K],
  // with the lookup dequant_isa(w.qg) chose (once a GEMM, not once a block of rows)
  enum class DequantIsa { kScalar, kAvx2, kAvx512 };
  static DequantIsa dequant_isa(int64_t g);
  static void dequant_rows(const Weight& w, int64_t off, int64_t rows, int64_t K, int64_t ldw, float* dst,
                           DequantIsa isa);
  Slot& slot_for(const std::string& name, const std::vector<int64_t>& shape, int64_t* n);  // checked
  template <class T>
  void set_any(const std::string& name, const T* data, const std::vector<int64_t>& shape);
  // Converts w to how bf16_mode_ holds it (final: also makes kCopies' copies).
  void hold(Weight& w, bool final);
  std::vector<Weight*> weights();  // every weight matrix, each once
  Bf16Weights bf16_mode_ = Bf16Weights::kOnly;   // how weights are held now
  Bf16Weights built_mode_ = Bf16Weights::kOnly;  // the constructor's choice
  void route(const Layer& ly, int64_t T);
  void attention(Layer& ly, const int32_t* positions, const uint8_t* vis, int64_t T);
  void dense_mlp(const Layer& ly, int64_t T);
  void moe_mlp(const Layer& ly, int64_t T);
  // y[n, Dm] = down(silu(gate(x)) * up(x)); gu [n, 2I] and act [n, I] are its scratch rows.
  void swiglu_mlp(const float* x, int64_t n, const Weight& gate_up, int64_t gu_off, const Weight& down,
                  int64_t down_off, int64_t I, float* y, float* gu, float* act);

  ModelConfig cfg_;
  int64_t max_seq_len_;
  std::vector<Layer> layers_;
  Weight embed_, lm_head_;
  std::vector<float> final_ln_;
  const Weight* lm_head_w_ = nullptr;  // lm_head_, or embed_ when tied
  std::unordered_map<std::string, Slot> slots_;
  std::vector<std::string> slot_order_;
  bool finalized_ = false;
  int64_t cache_len_ = 0;
  uint64_t epoch_ = 0;  // cache_epoch(): bumped by every call that can change the cache or weights
  int64_t pending_ = 0;

  // Workspaces, grown (never shrunk) to the largest T seen; no allocation per forward otherwise.
  int64_t ws_T_ = 0;
  std::vector<float> x_, hn_;          // [T, Dm] residual stream, normed input
  std::vector<float> qa_, q_, kv_;     // [T, qr], [T, H*(Dn+R)], [T, C+R]
  std::vector<float> qfull_;           // [T, H, C+R] absorbed query (latent part + roped part)
  std::vector<float> cs_;              // [T, R] cos | sin per token
  std::vector<float> scores_;          // [chunk*H, S] attention probabilities
  std::vector<float> olat_;            // [T, H, C] attention output in latent space
  std::vector<float> ov_;              // [T, H*Dv]
  std::vector<float> mlp_out_;         // [T, Dm]
  std::vector<float> gu_, act_;        // [T, 2I], [T, I] dense / shared-expert SwiGLU scratch
  std::vector<float> xe_, ye_;         // [T*k, Dm] expert inputs / outputs, rows grouped by expert
  std::vector<float> egu_, eact_;      // [T*k, 2Ie], [T*k, Ie] routed-expert SwiGLU scratch
  std::vector<int32_t> expert_active_; // [E] experts with at least one token
  std::vector<float> router_logits_;   // [T, E]
  std::vector<int32_t> topk_idx_;      // [T, k]
  std::vector<float> topk_w_;          // [T, k]
  std::vector<int32_t> expert_count_;  // [E + 1] offsets
  std::vector<int32_t> expert_tok_;    // [T*k] token of each (expert, slot) assignment
  std::vector<float> expert_w_;        // [T*k] its weight
  std::vector<float> biased_;          // [T, E] sigmoid + correction bias (selection only)
  std::vector<float> group_score_;     // [T, n_group]
  std::vector<uint8_t> group_sel_;     // [T, n_group]
  std::mutex mu_;                      // one forward/commit at a time per model
  bool exact_window_ = false;          // this forward's window is row-exact (kRowExactWindow; set by run)
};

}  // namespace kdtree
