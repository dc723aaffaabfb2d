// config.cpp: ModelConfig validation and the weight list a configuration implies.
#include "model/config.h"

#include <cmath>

#include "common.h"

namespace kdtree {

// Plain string building, no iostreams: on a machine where another extension in the process
// had switched the global C++ locale (seen on the H200 image after the HF imports), formatting
// through std::ostringstream crashed inside the locale facets.
std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

namespace {
void need_positive(int64_t v, const char* field) {
  if (v <= 0) throw Error(std::string("model config: ") + field + " must be > 0, got " + std::to_string(v));
}
}  // namespace

void ModelConfig::validate() const {
  need_positive(vocab_size, "vocab_size");
  need_positive(hidden_size, "hidden_size");
  need_positive(num_hidden_layers, "num_hidden_layers");
  need_positive(num_attention_heads, "num_attention_heads");
  need_positive(kv_lora_rank, "kv_lora_rank");
  need_positive(qk_rope_head_dim, "qk_rope_head_dim");
  need_positive(v_head_dim, "v_head_dim");
  if (qk_nope_head_dim < 0) throw Error("model config: qk_nope_head_dim must be >= 0");
  if (q_lora_rank < 0) throw Error("model config: q_lora_rank must be >= 0 (0 means q_proj)");
  if (qk_rope_head_dim % 2 != 0)
    throw Error("model config: qk_rope_head_dim must be even, got " + std::to_string(qk_rope_head_dim));
  if ((int64_t)rope_inv_freq.size() != qk_rope_head_dim / 2)
    throw Error("model config: rope_inv_freq has " + std::to_string(rope_inv_freq.size()) +
                " entries, expected qk_rope_head_dim/2 = " + std::to_string(qk_rope_head_dim / 2));
  for (float f : rope_inv_freq)
    if (!std::isfinite(f)) throw Error("model config: rope_inv_freq has a non-finite entry");
  if (!(softmax_scale > 0) || !std::isfinite(softmax_scale))
    throw Error("model config: softmax_scale must be a finite number > 0");
  if (!std::isfinite(rope_attention_factor)) throw Error("model config: rope_attention_factor must be finite");
  if (!(rms_norm_eps >= 0) || !std::isfinite(rms_norm_eps)) throw Error("model config: rms_norm_eps must be >= 0");
  if (!(latent_norm_eps >= 0) || !std::isfinite(latent_norm_eps))
    throw Error("model config: latent_norm_eps must be >= 0");
  if (first_k_dense_replace < 0) throw Error("model config: first_k_dense_replace must be >= 0");
  if (first_k_dense_replace > 0) need_positive(intermediate_size, "intermediate_size");
  if (first_k_dense_replace < num_hidden_layers) {  // at least one MoE layer
    need_positive(n_routed_experts, "n_routed_experts");
    need_positive(moe_intermediate_size, "moe_intermediate_size");
    need_positive(num_experts_per_tok, "num_experts_per_tok");
    need_positive(n_group, "n_group");
    need_positive(topk_group, "topk_group");
    if (n_shared_experts < 0) throw Error("model config: n_shared_experts must be >= 0");
    if (n_routed_experts % n_group != 0)
      throw Error("model config: n_routed_experts (" + std::to_string(n_routed_experts) +
                  ") must be divisible by n_group (" + std::to_string(n_group) + ")");
    if (n_routed_experts / n_group < 2)
      throw Error("model config: each expert group needs >= 2 experts (group score = sum of the top 2)");
    if (topk_group > n_group)
      throw Error("model config: topk_group (" + std::to_string(topk_group) + ") > n_group (" +
                  std::to_string(n_group) + ")");
    if (num_experts_per_tok > topk_group * (n_routed_experts / n_group))
      throw Error("model config: num_experts_per_tok (" + std::to_string(num_experts_per_tok) +
                  ") exceeds the experts in the topk_group selected groups");
    if (!std::isfinite(routed_scaling_factor)) throw Error("model config: routed_scaling_factor must be finite");
  }
}

std::vector<WeightSpec> model_weight_specs(const ModelConfig& c) {
  std::vector<WeightSpec> w;
  const int64_t Dm = c.hidden_size, H = c.num_attention_heads;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) { w.push_back({name, std::move(shape)}); };
  add("model.embed_tokens.weight", {c.vocab_size, Dm});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {Dm});
    add(p + "post_attention_layernorm.weight", {Dm});
    if (c.q_lora_rank > 0) {
      add(p + "self_attn.q_a_proj.weight", {c.q_lora_rank, Dm});
      add(p + "self_attn.q_a_layernorm.weight", {c.q_lora_rank});
      add(p + "self_attn.q_b_proj.weight", {H * c.qk_head_dim(), c.q_lora_rank});
    } else {
      add(p + "self_attn.q_proj.weight", {H * c.qk_head_dim(), Dm});
    }
    add(p + "self_attn.kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, Dm});
    add(p + "self_attn.kv_a_layernorm.weight", {c.kv_lora_rank});
    add(p + "self_attn.kv_b_proj.weight", {H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
    add(p + "self_attn.o_proj.weight", {Dm, H * c.v_head_dim});
    if (!c.is_moe_layer(l)) {
      add(p + "mlp.gate_proj.weight", {c.intermediate_size, Dm});
      add(p + "mlp.up_proj.weight", {c.intermediate_size, Dm});
      add(p + "mlp.down_proj.weight", {Dm, c.intermediate_size});
    } else {
      add(p + "mlp.gate.weight", {c.n_routed_experts, Dm});
      add(p + "mlp.gate.e_score_correction_bias", {c.n_routed_experts});
      for (int64_t e = 0; e < c.n_routed_experts; ++e) {
        const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
        add(q + "gate_proj.weight", {c.moe_intermediate_size, Dm});
        add(q + "up_proj.weight", {c.moe_intermediate_size, Dm});
        add(q + "down_proj.weight", {Dm, c.moe_intermediate_size});
      }
      if (c.n_shared_experts > 0) {
        const int64_t Is = c.moe_intermediate_size * c.n_shared_experts;
        add(p + "mlp.shared_experts.gate_proj.weight", {Is, Dm});
        add(p + "mlp.shared_experts.up_proj.weight", {Is, Dm});
        add(p + "mlp.shared_experts.down_proj.weight", {Dm, Is});
      }
    }
  }
  add("model.norm.weight", {Dm});
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, Dm});
  return w;
}

}  // namespace kdtree
