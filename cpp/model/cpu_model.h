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

class CpuModel : public TargetModel {
 public:
  CpuModel(const ModelConfig& cfg, int64_t max_seq_len);

  const ModelConfig& config() const override { return cfg_; }
  int64_t max_seq_len() const override { return max_seq_len_; }
  const char* device() const override { return "cpu"; }

  void set_weight(const std::string& name, const float* data, const std::vector<int64_t>& shape) override;
  std::vector<std::string> missing_weights() const override;
  void finalize() override;
  bool finalized() const override { return finalized_; }

  void forward(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
               float* logits_out) override;
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
  // Bytes held by weights + cache + workspaces (the BF16 copies below included).
  int64_t memory_bytes() const;

  // BF16 copies of the projection weights (on by default, made at finalize): a weight matrix
  // whose every FP32 value is exactly a BF16 value (a BF16 checkpoint widened by the loader) is
  // also kept as BF16, and the few-row GEMMs (decode, tree verify, experts: sgemm's skinny kernels)
  // read that copy: half the bytes, the same results (widening is exact and the kernels, tiles and
  // threads are the same). Larger GEMMs (prefill) and matrices with other values use FP32.
  // use_bf16_weights(false) drops the copies (A/B, tests); bf16_weight_bytes() = bytes held.
  void use_bf16_weights(bool on);
  int64_t bf16_weight_bytes() const;

 private:
  struct Layer {
    std::vector<float> input_ln, post_ln;          // [Dm]
    std::vector<float> q_a, q_a_ln, q_b;           // [qr, Dm], [qr], [H*(Dn+R), qr]   (q_lora_rank > 0)
    std::vector<float> q_proj;                     // [H*(Dn+R), Dm]                   (q_lora_rank == 0)
    std::vector<float> kv_a, kv_a_ln;              // [C+R, Dm], [C]
    std::vector<float> w_uk, w_uv;                 // [H, Dn, C], [H, Dv, C]: kv_b_proj split per head
    std::vector<float> o_proj;                     // [Dm, H*Dv]
    bool moe = false;
    std::vector<float> mlp_gate_up, mlp_down;      // dense: [2I, Dm] (gate rows, then up), [Dm, I]
    std::vector<float> router, router_bias;        // [E, Dm], [E]
    std::vector<float> experts_gate_up;            // [E, 2Ie, Dm]
    std::vector<float> experts_down;               // [E, Dm, Ie]
    std::vector<float> shared_gate_up, shared_down;// [2Is, Dm], [Dm, Is]
    std::vector<float> cache;                      // [max_seq_len, C+R] latent cache
  };
  struct Slot {
    float* dst = nullptr;        // contiguous destination (kind kCopy)
    std::vector<int64_t> shape;
    int kind = 0;                // kCopy, or kKvB: split rows into layer.w_uk / layer.w_uv
    int64_t layer = -1;
    bool set = false;
  };
  static constexpr int kCopy = 0, kKvB = 1;

  void ensure_workspace(int64_t T);
  // C[M, N] = A[M, K] @ W^T for a weight W [N, K] (row stride ldw) inside one of the model's
  // weight tensors: through its BF16 copy when it has one and the skinny kernels take the shape.
  void wgemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* W, int64_t ldw, float* C,
             int64_t ldc, float alpha = 1.f) const;
  void build_bf16_weights();
  struct Bf16Copy {
    const float* begin = nullptr;  // the FP32 tensor [begin, end)
    const float* end = nullptr;
    std::vector<uint16_t> bits;    // its BF16 copy, same layout
  };
  std::vector<Bf16Copy> bf16_;  // sorted by begin
  bool bf16_on_ = true;          // use_bf16_weights: make the copies at finalize
  void route(const Layer& ly, int64_t T);
  void attention(Layer& ly, const int32_t* positions, const uint8_t* vis, int64_t T);
  void dense_mlp(const Layer& ly, int64_t T);
  void moe_mlp(const Layer& ly, int64_t T);
  // y[n, Dm] = down(silu(gate(x)) * up(x)); gu [n, 2I] and act [n, I] are its scratch rows.
  void swiglu_mlp(const float* x, int64_t n, const float* gate_up, const float* down, int64_t I, float* y, float* gu,
                  float* act);

  ModelConfig cfg_;
  int64_t max_seq_len_;
  std::vector<Layer> layers_;
  std::vector<float> embed_, final_ln_, lm_head_;
  const float* lm_head_ptr_ = nullptr;
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
};

}  // namespace kdtree
