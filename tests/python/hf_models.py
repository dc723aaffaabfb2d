"""Test fixtures: small random DeepSeek-V3 checkpoints and HF transformers ground truth.

Shared by the model tests (NumPy reference, CPU engine, CUDA backend):
  PARITY_CONFIGS           named tiny configs covering every model variant the engine supports
  config_dict(name_or_overrides)             -> HF config.json-style dict (no torch needed)
  make_checkpoint(path, name_or_overrides, seed=0, dtype="float32") -> path
                           random DeepseekV3ForCausalLM built by transformers, `save_pretrained`
  cached_checkpoint(name_or_overrides, seed=0, dtype="float32")   -> path (once per session)
  hf_logits(path, ids)     -> float32 [T, V], HF eager attention, fp32
  hf_greedy(path, ids, n)  -> int64 [n], greedy continuation by HF (full recompute each step)
  random_weights(cfg, seed) -> {HF name: float64 array}; NumPy only, for tests that need no torch

Everything touching torch / transformers goes through `require_hf()`, which skips the calling
test cleanly (pytest.skip) when they are absent or cannot be imported.
"""
from __future__ import annotations

import atexit
import copy
import functools
import hashlib
import json
import math
import os
import shutil
import tempfile

import numpy as np

# ---- configs ------------------------------------------------------------------------------

# Common tiny base: 2 layers, hidden 48, 2 heads, 8 experts in 2 groups.
BASE = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=160,
    hidden_size=48,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_interleave=True,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    num_nextn_predict_layers=0,
)

# Each entry: overrides of BASE. Together they cover: n_group>1 with topk_group<n_group, rope
# interleaved and NeoX, YaRN with mscale/mscale_all_dim (equal and different), q_lora_rank null,
# first_k_dense_replace 0/1/2, norm_topk_prob false, tied embeddings, n_shared_experts 0/1/2.
PARITY_CONFIGS = {
    # DeepSeek-V3 shape in miniature: interleaved RoPE, 2 groups pick 1, 1 dense layer.
    "ds3_base": dict(),
    # NeoX RoPE, YaRN with mscale != mscale_all_dim (cos/sin factor != 1, softmax scale != plain),
    # every layer MoE, 4 groups pick 2, 3 experts per token.
    "neox_yarn_groups": dict(
        rope_interleave=False, first_k_dense_replace=0, n_routed_experts=16, n_group=4, topk_group=2,
        num_experts_per_tok=3,
        rope_scaling={"type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                      "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1},
    ),
    # q_lora_rank null (direct q_proj), 3 layers with 2 dense, 2 shared experts.
    "no_q_lora": dict(q_lora_rank=None, num_hidden_layers=3, first_k_dense_replace=2, n_shared_experts=2),
    # Tied embeddings, no top-k normalisation, no shared experts, one group.
    "tied_nonorm": dict(tie_word_embeddings=True, norm_topk_prob=False, n_shared_experts=0, n_group=1,
                        topk_group=1, routed_scaling_factor=1.0),
    # Kimi-K2-like: YaRN factor 32 with beta 1/1 and mscale == mscale_all_dim == 1, theta 50000,
    # one group, 4 heads, interleaved RoPE.
    "kimi_like": dict(
        num_attention_heads=4, num_key_value_heads=4, n_group=1, topk_group=1, n_routed_experts=12,
        num_experts_per_tok=4, routed_scaling_factor=2.827, rope_theta=50000.0,
        rope_scaling={"type": "yarn", "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 16, "beta_fast": 1.0, "beta_slow": 1.0},
    ),
    # NeoX plain RoPE, no q LoRA, 8 groups of 2 pick 3, every layer MoE, rms eps 1e-5, larger
    # rope dim; no shared experts is combined with a dense-free model here.
    "neox_many_groups": dict(
        rope_interleave=False, q_lora_rank=None, n_routed_experts=16, n_group=8, topk_group=3,
        num_experts_per_tok=4, first_k_dense_replace=0, rms_norm_eps=1e-5, qk_rope_head_dim=16,
        qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=0,
    ),
    # YaRN, DeepSeek-V3 style (factor 40, mscale == mscale_all_dim == 1), 3 layers, 2 dense,
    # norm_topk_prob false, tied embeddings.
    "ds3_yarn_tied": dict(
        num_hidden_layers=3, first_k_dense_replace=2, norm_topk_prob=False, tie_word_embeddings=True,
        max_position_embeddings=1280,
        rope_scaling={"type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1},
    ),
}


def config_dict(name_or_overrides) -> dict:
    """An HF config.json-style dict: a PARITY_CONFIGS name, or a dict of overrides of BASE
    (a dict may name a base with key "base")."""
    if isinstance(name_or_overrides, str):
        over = PARITY_CONFIGS[name_or_overrides]
        base = BASE
    else:
        over = dict(name_or_overrides)
        base_name = over.pop("base", None)
        base = dict(BASE, **PARITY_CONFIGS[base_name]) if base_name else BASE
    d = copy.deepcopy(dict(base, **over))
    if d.get("num_attention_heads") != d.get("num_key_value_heads"):
        d["num_key_value_heads"] = d["num_attention_heads"]
    return d


# ---- NumPy random weights (no torch) -----------------------------------------------------

def _init_tensor(rng, name, shape, cfg):
    """One random tensor at a scale that keeps activations O(1) and logits well spread."""
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if name.endswith("e_score_correction_bias"):
        # sigmoid scores live in (0, 1): a bias of this size changes which experts are chosen,
        # and its negative mean makes some biased scores < 0, so that HF's masking of the
        # dropped groups to -inf (not 0) matters
        return 0.3 * rng.standard_normal(shape) - 0.5
    if name == "model.embed_tokens.weight":
        return rng.standard_normal(shape)
    if name == "lm_head.weight":
        return 2.0 * rng.standard_normal(shape) / math.sqrt(shape[1])
    if name.endswith("mlp.gate.weight"):
        return 2.0 * rng.standard_normal(shape) / math.sqrt(shape[1])
    fan_in = shape[1]
    return rng.standard_normal(shape) / math.sqrt(fan_in)


def to_bf16_bits(x):
    """float -> bfloat16 bits (round to nearest even), as uint16."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def to_bf16(x):
    """float32 array rounded to the nearest BF16 (ties to even), as float32: every value exactly a
    BF16 (what a BF16 checkpoint of the same tensor holds, widened by the loader)."""
    return (to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32).reshape(np.shape(x))


def random_weights(cfg, seed=0) -> dict:
    """{HF name: float64 array} for every tensor the forward reads (kdtree_native.checkpoint
    names), random at a sensible scale. For tests that run without torch."""
    from kdtree_native.checkpoint import expected_weight_shapes

    rng = np.random.default_rng(seed)
    return {name: _init_tensor(rng, name, shape, cfg).astype(np.float64)
            for name, shape in expected_weight_shapes(cfg).items()}


# ---- HF transformers -----------------------------------------------------------------------

def require_hf():
    """(torch, transformers), or skip the calling test when either is absent."""
    import pytest

    try:
        import torch
        import transformers
    except ImportError as e:   # absent, or present but broken: skip either way
        pytest.skip(f"torch/transformers not usable: {e}")
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV3ForCausalLM")
    return torch, transformers


def _hf_config(transformers, d):
    d = dict(d)
    d.pop("architectures", None)
    d.pop("model_type", None)
    return transformers.DeepseekV3Config(**d)


def make_checkpoint(path, name_or_overrides, seed=0, dtype="float32"):
    """Build a random DeepseekV3ForCausalLM with transformers and `save_pretrained` it to
    `path` (weights stored as `dtype`: float32, bfloat16 or float16). Returns `path`."""
    torch, transformers = require_hf()
    d = config_dict(name_or_overrides)
    hf_cfg = _hf_config(transformers, d)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(hf_cfg).to(torch.float32)
    model.eval()
    rng = np.random.default_rng(seed)
    # Re-initialise every stored tensor, HF hub name by hub name, at a useful scale.
    sd_names = _hub_names(model)
    with torch.no_grad():
        for hub_name, (param, index) in sd_names.items():
            shape = tuple(param.shape[1:]) if index is not None else tuple(param.shape)
            if 0 in shape:
                continue
            if hub_name.endswith("gate_up_proj.weight"):
                continue
            value = torch.from_numpy(_init_tensor(rng, hub_name, shape, None).astype(np.float32))
            if index is None:
                param.copy_(value)
            else:
                param[index].copy_(value)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if torch_dtype != torch.float32:
        model = model.to(torch_dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def _hub_names(model):
    """{hub name: (tensor, expert index or None)} for the model's parameters and buffers.
    transformers >= 5 stores routed experts fused (experts.gate_up_proj [E, 2I, h],
    experts.down_proj [E, h, I]); hub names are per expert, with gate and up split."""
    out = {}
    state = dict(model.named_parameters())
    state.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    for name, t in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = (t[e, :inter], None)
                out[f"{base}{e}.up_proj.weight"] = (t[e, inter:], None)
        elif name.endswith(".mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = (t[e], None)
        else:
            out[name] = (t, None)
    return out


_SESSION_DIR = None


def cached_checkpoint(name_or_overrides, seed=0, dtype="float32"):
    """`make_checkpoint` into a per-process temporary directory (removed at exit), once per (config, seed, dtype)."""
    global _SESSION_DIR
    key = json.dumps(config_dict(name_or_overrides), sort_keys=True) + f"|{seed}|{dtype}"
    if _SESSION_DIR is None:
        _SESSION_DIR = tempfile.mkdtemp(prefix="kn_hf_ckpt_")
        # removed when the test process ends (each run used to leave its checkpoints in the temp dir)
        atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)
    sub = os.path.join(_SESSION_DIR, hashlib.sha1(key.encode()).hexdigest()[:16])
    if not os.path.isfile(os.path.join(sub, "config.json")):
        make_checkpoint(sub, name_or_overrides, seed=seed, dtype=dtype)
    return sub


@functools.lru_cache(maxsize=16)
def hf_model(path):
    """The checkpoint at `path` loaded by transformers: fp32, eager attention, eager experts.
    Cached by path: write each checkpoint to a fresh directory."""
    torch, transformers = require_hf()
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    try:
        model = transformers.DeepseekV3ForCausalLM.from_pretrained(path, experts_implementation="eager", **kwargs)
    except (TypeError, ValueError):
        model = transformers.DeepseekV3ForCausalLM.from_pretrained(path, **kwargs)
    model.eval()
    return model


class _one_thread:
    """Run torch on one thread inside the block: the models are tiny, and CI has 2 cores."""

    def __enter__(self):
        import torch

        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self.n)


def hf_logits(path, ids) -> np.ndarray:
    """HF logits float32 [T, V] of the token ids (one sequence, positions 0..T-1)."""
    torch, _ = require_hf()
    model = hf_model(os.fspath(path))
    with torch.no_grad(), _one_thread():
        out = model(torch.as_tensor(np.asarray(ids, dtype=np.int64))[None], use_cache=False)
    return out.logits[0].float().numpy()


def hf_greedy(path, ids, n) -> np.ndarray:
    """The n greedy tokens HF picks after `ids` (full recompute each step, no cache)."""
    torch, _ = require_hf()
    model = hf_model(os.fspath(path))
    seq = list(int(t) for t in ids)
    out = []
    with torch.no_grad(), _one_thread():
        for _ in range(n):
            logits = model(torch.as_tensor(seq, dtype=torch.int64)[None], use_cache=False).logits[0, -1]
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            seq.append(nxt)
    return np.asarray(out, dtype=np.int64)
