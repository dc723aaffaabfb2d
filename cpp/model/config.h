// config.h: the DeepSeek-V3 / Kimi-K2 model configuration as the native backends see it, and
// the list of weight tensors (HF hub names + shapes) a configuration implies.
//
// Python parses HF config.json (python/kdtree_native/config.py) and hands over a flat dict
// (ModelConfig.to_native()); derived quantities that HF computes in Python — the RoPE inverse
// frequencies (default / YaRN), the cos/sin attention factor and the softmax scale — are
// computed there exactly as HF does and passed in, so the native side never re-derives them.
//
// Legend: Dm = hidden_size, H = heads, C = kv_lora_rank, R = qk_rope_head_dim,
// Dn = qk_nope_head_dim, Dv = v_head_dim, E = routed experts, I = (moe_)intermediate size.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kdtree {

struct ModelConfig {
  int64_t vocab_size = 0;             // V
  int64_t hidden_size = 0;            // Dm
  int64_t intermediate_size = 0;      // dense MLP width
  int64_t moe_intermediate_size = 0;  // one routed expert's width (shared: x n_shared_experts)
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;    // H
  int64_t n_routed_experts = 0;       // E
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;    // top-k
  int64_t n_group = 1;
  int64_t topk_group = 1;
  int64_t first_k_dense_replace = 0;  // layers [0, this) use the dense MLP
  int64_t q_lora_rank = 0;            // 0: direct q_proj (HF q_lora_rank = null)
  int64_t kv_lora_rank = 0;           // C
  int64_t qk_nope_head_dim = 0;       // Dn
  int64_t qk_rope_head_dim = 0;       // R (even)
  int64_t v_head_dim = 0;             // Dv
  bool norm_topk_prob = true;
  bool rope_interleave = true;        // HF rope_interleave: pairs (x0,x1),(x2,x3)...
  bool tie_word_embeddings = false;
  double routed_scaling_factor = 1.0;
  double rms_norm_eps = 1e-6;         // input/post-attention/final norms
  double latent_norm_eps = 1e-6;      // q_a_layernorm / kv_a_layernorm (HF: always 1e-6)
  double softmax_scale = 0.0;         // qk_head_dim^-0.5 * yarn mscale^2 (from Python)
  double rope_attention_factor = 1.0; // multiplies cos and sin (HF attention_scaling)
  std::vector<float> rope_inv_freq;   // [R/2], float32 as HF computes it

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool is_moe_layer(int64_t i) const { return i >= first_k_dense_replace; }
  // Throws kdtree::Error naming the first field that is missing, out of range or unsupported.
  void validate() const;
};

struct WeightSpec {
  std::string name;            // HF hub name, e.g. model.layers.3.mlp.experts.7.up_proj.weight
  std::vector<int64_t> shape;  // row-major, as in the checkpoint
};

// Every tensor the forward needs, in a fixed order. lm_head.weight is absent when
// tie_word_embeddings (the embedding matrix is used), shared-expert tensors when
// n_shared_experts == 0.
std::vector<WeightSpec> model_weight_specs(const ModelConfig& cfg);

}  // namespace kdtree
