"""DeepSeek-V3 / Kimi-K2 forward, NumPy reference (float64): the plain, non-absorbed model.

Where it sits: the oracle the CPU and CUDA engines are compared with, and the maker of golden
data. It follows HF transformers' `DeepseekV3ForCausalLM` step by step (eager attention), in
float64, and is written to be read rather than to be fast.

Legend: T = new tokens of one call, N = cache rows, h = hidden_size, V = vocab_size,
H = heads, C = kv_lora_rank, R = qk_rope_head_dim, Dn = qk_nope_head_dim, Dv = v_head_dim,
E = n_routed_experts, K = num_experts_per_tok.

The KV cache holds, per layer and per token, what the engines keep too: the normed latent
[C] and the roped shared key [R]. Attention expands them into per-head K/V (HF `expand_kv`);
the absorbed form lives in `reference/mla.py`.

    model = ReferenceModel(cfg, weights)
    logits = model.forward(tokens, positions)              # prefill: causal, [T, V]
    logits = model.forward([tok], [pos])                   # decode
    logits = model.forward(tree_tokens, tree_pos, vis)     # verify a tree: vis bool [T, T]
    model.compact(keep)                                    # keep these rows of the last call
    model.reset()
"""
from __future__ import annotations

import numpy as np

from ..checkpoint import expected_weight_shapes
from .mla import absorb_queries, expand_kv, unabsorb_output, verify_attention, verify_attention_plain
from .rope import apply_rope, rope_cos_sin

__all__ = ["ReferenceModel", "rms_norm", "silu", "moe_route"]


def rms_norm(x, weight, eps):
    """x [T, n] -> weight * x / sqrt(mean(x^2) + eps)."""
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def silu(x):
    return x / (1.0 + np.exp(-x))


def swiglu_mlp(x, w_gate, w_up, w_down):
    """down(silu(gate(x)) * up(x)); x [T, h], w_gate/w_up [I, h], w_down [h, I]."""
    return (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def moe_route(cfg, x, w_router, bias):
    """HF `DeepseekV3TopkRouter`: -> (expert ids int [T, K], weights float64 [T, K]).

    sigmoid scores; the correction bias is added for *selection* only; group score = sum of
    the top-2 biased scores of the group; the best `topk_group` groups stay, the others are
    set to -inf; top-K experts of what is left; weights are the unbiased sigmoid scores,
    normalised (+1e-20) when norm_topk_prob, times routed_scaling_factor.
    """
    T = x.shape[0]
    E, G = cfg.n_routed_experts, cfg.n_group
    scores = 1.0 / (1.0 + np.exp(-(x @ w_router.T)))                 # [T, E]
    choice = scores + bias[None, :]                                   # [T, E]
    grouped = choice.reshape(T, G, E // G)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)   # [T, G]
    keep_groups = np.argsort(-group_scores, axis=-1, kind="stable")[:, :cfg.topk_group]
    group_mask = np.zeros((T, G), dtype=bool)
    np.put_along_axis(group_mask, keep_groups, True, axis=-1)
    choice = np.where(np.repeat(group_mask, E // G, axis=-1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :cfg.num_experts_per_tok]   # [T, K]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


class ReferenceModel:
    """Float64 NumPy forward with a latent KV cache. `weights`: {HF name: array} as returned
    by `kdtree_native.checkpoint.load_weights` (any float dtype; converted to float64)."""

    def __init__(self, cfg, weights, absorbed=False):
        """absorbed=True runs attention in the absorbed form (reference/mla.py
        `verify_attention` over the latent cache) instead of expanding per-head K/V; the two
        agree to float64 rounding, which the tests check."""
        self.cfg = cfg
        self.absorbed = bool(absorbed)
        missing = [n for n in expected_weight_shapes(cfg) if n not in weights]
        if missing:
            raise ValueError(f"ReferenceModel: missing weights: {missing[:10]}")
        self.w = {n: np.asarray(weights[n], dtype=np.float64) for n in expected_weight_shapes(cfg)}
        self.lm_head = self.w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else self.w["lm_head.weight"]
        self.reset()

    # ---- cache ----------------------------------------------------------------------------
    def reset(self):
        """Empty the cache."""
        C, R = self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim
        self.kv_latent = [np.zeros((0, C)) for _ in range(self.cfg.num_hidden_layers)]   # [N, C]
        self.k_rope = [np.zeros((0, R)) for _ in range(self.cfg.num_hidden_layers)]      # [N, R]
        self.last_new = 0          # rows appended by the last forward

    @property
    def cache_len(self) -> int:
        return self.kv_latent[0].shape[0]

    def compact(self, keep):
        """Keep only rows `keep` (indices 0..T-1 into the last forward's new tokens, in this
        order) of the entries the last forward appended; drop the rest."""
        keep = np.asarray(keep, dtype=np.int64).reshape(-1)
        T = self.last_new
        if keep.size and (keep.min() < 0 or keep.max() >= T):
            raise ValueError(f"compact: indices must be in [0, {T}), got {keep.tolist()}")
        L = self.cache_len - T
        rows = np.concatenate([np.arange(L), L + keep])
        for i in range(self.cfg.num_hidden_layers):
            self.kv_latent[i] = self.kv_latent[i][rows]
            self.k_rope[i] = self.k_rope[i][rows]
        self.last_new = keep.size

    def truncate(self, n: int):
        """Drop cache rows from n on."""
        for i in range(self.cfg.num_hidden_layers):
            self.kv_latent[i] = self.kv_latent[i][:n]
            self.k_rope[i] = self.k_rope[i][:n]
        self.last_new = 0

    # ---- forward --------------------------------------------------------------------------
    def forward(self, tokens, positions=None, visibility=None) -> np.ndarray:
        """Run T new tokens against the cache and append their entries; logits float64 [T, V].

        tokens int [T]; positions int [T] (default: cache_len + 0..T-1);
        visibility bool [T, T]: new token i sees new token j iff visibility[i, j]
        (None = causal). Every new token sees all cached rows.
        """
        cfg = self.cfg
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        T = tokens.size
        if T == 0:
            raise ValueError("forward: no tokens")
        if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            raise ValueError(f"forward: token ids must be in [0, {cfg.vocab_size})")
        if positions is None:
            positions = self.cache_len + np.arange(T)
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if positions.size != T:
            raise ValueError(f"forward: {T} tokens but {positions.size} positions")
        if visibility is None:
            visibility = np.tril(np.ones((T, T), dtype=bool))
        visibility = np.asarray(visibility, dtype=bool)
        if visibility.shape != (T, T):
            raise ValueError(f"forward: visibility must be [{T}, {T}], got {visibility.shape}")

        cos, sin = rope_cos_sin(cfg, positions)                 # [T, R/2]
        x = self.w["model.embed_tokens.weight"][tokens]         # [T, h]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, self.w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            x = x + self._attention(i, h, cos, sin, visibility)
            h = rms_norm(x, self.w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            x = x + (self._moe(i, h) if cfg.is_moe_layer(i) else self._dense_mlp(i, h))
        self.last_new = T
        x = rms_norm(x, self.w["model.norm.weight"], cfg.rms_norm_eps)
        return x @ self.lm_head.T                               # [T, V]

    def _attention(self, i, h, cos, sin, visibility):
        """MLA, plain form: h [T, h] -> [T, h]; appends this layer's cache rows."""
        cfg, w = self.cfg, self.w
        a = f"model.layers.{i}.self_attn."
        T, H = h.shape[0], cfg.num_attention_heads
        C, Dn = cfg.kv_lora_rank, cfg.qk_nope_head_dim

        # queries [T, H, Dn + R]
        if cfg.q_lora_rank:
            q_a = rms_norm(h @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], cfg.latent_norm_eps)
            q = q_a @ w[a + "q_b_proj.weight"].T
        else:
            q = h @ w[a + "q_proj.weight"].T
        q = q.reshape(T, H, cfg.qk_head_dim)
        q_nope, q_rope = q[..., :Dn], q[..., Dn:]
        q_rope = apply_rope(q_rope, cos, sin, cfg.rope_interleave)

        # this token's cache entry: normed latent [C] + roped shared key [R]
        ckv = h @ w[a + "kv_a_proj_with_mqa.weight"].T                     # [T, C + R]
        latent = rms_norm(ckv[:, :C], w[a + "kv_a_layernorm.weight"], cfg.latent_norm_eps)
        k_rope = apply_rope(ckv[:, C:], cos, sin, cfg.rope_interleave)
        self.kv_latent[i] = np.concatenate([self.kv_latent[i], latent])
        self.k_rope[i] = np.concatenate([self.k_rope[i], k_rope])

        w_kv_b = w[a + "kv_b_proj.weight"]                                 # [H*(Dn+Dv), C]
        if self.absorbed:
            # q_nope through W_UK, attention over the latent rows, then W_UV
            out_latent = verify_attention(absorb_queries(q_nope, w_kv_b, cfg), q_rope, self.kv_latent[i],
                                          self.k_rope[i], visibility, cfg.softmax_scale)
            out = unabsorb_output(out_latent, w_kv_b, cfg)                 # [T, H, Dv]
        else:
            # per-head K/V of every cache row, then plain attention (what HF does)
            k, v = expand_kv(self.kv_latent[i], self.k_rope[i], w_kv_b, cfg)
            out = verify_attention_plain(np.concatenate([q_nope, q_rope], axis=-1), k, v, visibility,
                                         cfg.softmax_scale)                # [T, H, Dv]
        return out.reshape(T, H * cfg.v_head_dim) @ w[a + "o_proj.weight"].T

    def _dense_mlp(self, i, h):
        m = f"model.layers.{i}.mlp."
        return swiglu_mlp(h, self.w[m + "gate_proj.weight"], self.w[m + "up_proj.weight"],
                          self.w[m + "down_proj.weight"])

    def _moe(self, i, h):
        """Routed experts (weighted) + shared experts."""
        cfg, w = self.cfg, self.w
        m = f"model.layers.{i}.mlp."
        ids, weights = moe_route(cfg, h, w[m + "gate.weight"], w[m + "gate.e_score_correction_bias"])
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            for e, g in zip(ids[t], weights[t]):
                x = f"{m}experts.{e}."
                out[t] += g * swiglu_mlp(h[t:t + 1], w[x + "gate_proj.weight"], w[x + "up_proj.weight"],
                                         w[x + "down_proj.weight"])[0]
        if cfg.n_shared_experts:
            out += swiglu_mlp(h, w[m + "shared_experts.gate_proj.weight"], w[m + "shared_experts.up_proj.weight"],
                              w[m + "shared_experts.down_proj.weight"])
        return out
