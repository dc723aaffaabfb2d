"""Model configuration: HF `config.json` -> `ModelConfig` (DeepSeek-V3 / Kimi-K2, MLA + MoE).

Where it sits: the first thing `Engine.from_pretrained` and `kn.reference` read. Everything the
forward needs is a plain field here, plus the few derived numbers that must equal HF
transformers' `DeepseekV3ForCausalLM` bit for bit or close to it (softmax scale, RoPE inverse
frequencies and the YaRN cos/sin factor), so the native backends use them as given and never
recompute them.

Accepted: `model_type` "deepseek_v3" and "kimi_k2", and the Kimi K2.5 layout that nests the
text model under `text_config` (weights then carry the `language_model.` prefix). RoPE is read
from `rope_parameters` (transformers >= 5) or the legacy `rope_scaling` + top-level
`rope_theta`, exactly as HF's `convert_rope_params_to_dict` / `standardize_rope_params` do.
A `quantization_config` of compressed-tensors pack-quantized integer weights (Kimi K2-Thinking's
INT4) is parsed into `ModelConfig.quantization` (quantization.py); other methods are refused.
Anything the engine cannot run (another rope type, another quantization method, a scoring function
other than sigmoid, ...) raises ValueError naming the field; so does a value of the wrong type
or out of range (integer sizes in [minimum, 2**31 - 1], finite floats, true/false switches; a
`null` switch is false where HF's annotation allows None and the forward tests its truth, as in
`if config.norm_topk_prob:`). A config.json that is not a regular file (a FIFO, a device), is
over 16 MiB or is not valid JSON (nested too deeply included) raises ValueError naming the file.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .quantization import QuantizationSpec, parse_quantization_config

__all__ = ["ModelConfig", "load_config", "config_from_dict", "yarn_get_mscale"]

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
SUPPORTED_ROPE_TYPES = ("default", "yarn")

# Defaults of HF's DeepseekV3Config for keys a config.json may leave out (HF fills them the
# same way when it loads such a file).
_HF_DEFAULTS = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "attention_bias": False,
}
_DEFAULT_ROPE_THETA = 10000.0  # PreTrainedConfig.default_theta
_MAX_INT = 2**31 - 1           # every size / count the native model takes (vocab, dims, positions)
_MAX_CONFIG_BYTES = 16 * 1024 * 1024
# Switches HF annotates `bool | None` and tests by truth in the forward: `null` there means false
# (`if config.norm_topk_prob:` / `if config.rope_interleave:`), not the default true.
_NULL_IS_FALSE = ("norm_topk_prob", "rope_interleave")


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN magnitude correction, as HF `yarn_get_mscale` (python float arithmetic)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass
class ModelConfig:
    """Every setting of the DeepSeek-V3 / Kimi-K2 forward, parsed and checked.

    Shapes legend used across the project: H = num_attention_heads, C = kv_lora_rank,
    R = qk_rope_head_dim, Dn = qk_nope_head_dim, Dv = v_head_dim, E = n_routed_experts.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int          # dense MLP (layers < first_k_dense_replace)
    moe_intermediate_size: int      # one routed expert; shared experts: * n_shared_experts
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    q_lora_rank: int                # 0 means no LoRA on q: a direct q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    rope_interleave: bool
    rope_type: str                  # "default" | "yarn"
    rope_scaling: Optional[dict]    # the standardized rope_parameters dict (None for plain RoPE)
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: Optional[int]
    eos_token_id: Any               # int, list of ints or None, as in config.json
    model_type: str
    # Prefix of every weight name in the checkpoint ("language_model." for Kimi K2.5).
    weight_prefix: str = ""
    # Number of MTP layers stored after the main ones (ignored by the forward, like HF).
    num_nextn_predict_layers: int = 0
    # The RMSNorm eps HF uses for q_a_layernorm / kv_a_layernorm (its RMSNorm default).
    latent_norm_eps: float = 1e-6
    # A quantized checkpoint's storage (compressed-tensors pack-quantized integer weights, read
    # by checkpoint.load_weights into float32); None for FP32 / BF16 / F16 checkpoints.
    quantization: Optional[QuantizationSpec] = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    # ---- derived --------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    @property
    def softmax_scale(self) -> float:
        """The attention scale HF uses: qk_head_dim^-0.5, times mscale^2 for YaRN with
        mscale_all_dim (HF `yarn_apply_mscale`, same float operation order)."""
        scaling = self.qk_head_dim ** (-0.5)
        if self.rope_type != "default" and self.rope_scaling is not None:
            mscale_all_dim = self.rope_scaling.get("mscale_all_dim", 0)
            if mscale_all_dim:
                mscale = yarn_get_mscale(self.rope_scaling["factor"], mscale_all_dim)
                scaling = scaling * mscale * mscale
        return scaling

    @property
    def rope_attention_factor(self) -> float:
        """The factor HF multiplies cos and sin with (`attention_scaling`; 1.0 for plain RoPE)."""
        if self.rope_type == "default":
            return 1.0
        rp = self.rope_scaling
        attention_factor = rp.get("attention_factor")
        if attention_factor is not None:
            return float(attention_factor)
        factor = rp["factor"]
        mscale = rp.get("mscale")
        mscale_all_dim = rp.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        return float(yarn_get_mscale(factor))

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies float32 [R/2], computed with HF's float32 operations
        (`compute_default_rope_parameters` / `_compute_yarn_parameters`); equal to HF's values
        to within 1 ulp (see the pow below), exactly equal in most cases."""
        dim = self.qk_rope_head_dim
        exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
        # base ** exponent, correctly rounded to float32. torch's vectorised powf is within 1 ulp
        # of this and not always equal to it (nor the same on every CPU), so HF's values are
        # matched to 1 ulp; everything after this line is HF's float32 arithmetic verbatim.
        pos_freqs = np.power(np.float64(self.rope_theta), exponents.astype(np.float64)).astype(np.float32)
        if self.rope_type == "default":
            return (np.float32(1.0) / pos_freqs).astype(np.float32)

        rp = self.rope_scaling
        factor = float(rp["factor"])
        beta_fast = rp.get("beta_fast") or 32
        beta_slow = rp.get("beta_slow") or 1
        original_max = rp["original_max_position_embeddings"]
        truncate = rp.get("truncate", True)

        def correction_dim(num_rotations):
            return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(self.rope_theta))

        low = correction_dim(beta_fast)
        high = correction_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # HF: prevent singularity
        ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
        ramp = np.clip(ramp, np.float32(0), np.float32(1)).astype(np.float32)

        inv_freq_extrapolation = np.float32(1.0) / pos_freqs
        inv_freq_interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
        extrapolation_factor = np.float32(1.0) - ramp
        inv_freq = (inv_freq_interpolation * (np.float32(1.0) - extrapolation_factor)
                    + inv_freq_extrapolation * extrapolation_factor)
        return inv_freq.astype(np.float32)

    def is_moe_layer(self, i: int) -> bool:
        """Layers from `first_k_dense_replace` on use MoE; the ones below a dense MLP (as HF)."""
        return i >= self.first_k_dense_replace

    def to_native(self) -> dict:
        """What the native backends receive: plain ints / floats / bools, plus `rope_inv_freq`
        as a list of floats (the float32 values of `rope_inv_freq()`)."""
        out = {
            "vocab_size": int(self.vocab_size),
            "hidden_size": int(self.hidden_size),
            "intermediate_size": int(self.intermediate_size),
            "moe_intermediate_size": int(self.moe_intermediate_size),
            "num_hidden_layers": int(self.num_hidden_layers),
            "num_attention_heads": int(self.num_attention_heads),
            "n_routed_experts": int(self.n_routed_experts),
            "n_shared_experts": int(self.n_shared_experts),
            "num_experts_per_tok": int(self.num_experts_per_tok),
            "n_group": int(self.n_group),
            "topk_group": int(self.topk_group),
            "first_k_dense_replace": int(self.first_k_dense_replace),
            "q_lora_rank": int(self.q_lora_rank),
            "kv_lora_rank": int(self.kv_lora_rank),
            "qk_nope_head_dim": int(self.qk_nope_head_dim),
            "qk_rope_head_dim": int(self.qk_rope_head_dim),
            "qk_head_dim": int(self.qk_head_dim),
            "v_head_dim": int(self.v_head_dim),
            "norm_topk_prob": bool(self.norm_topk_prob),
            "routed_scaling_factor": float(self.routed_scaling_factor),
            "rms_norm_eps": float(self.rms_norm_eps),
            "latent_norm_eps": float(self.latent_norm_eps),
            "rope_theta": float(self.rope_theta),
            "rope_interleave": bool(self.rope_interleave),
            "rope_is_yarn": self.rope_type == "yarn",
            "rope_attention_factor": float(self.rope_attention_factor),
            "softmax_scale": float(self.softmax_scale),
            "max_position_embeddings": int(self.max_position_embeddings),
            "tie_word_embeddings": bool(self.tie_word_embeddings),
            "rope_inv_freq": [float(x) for x in self.rope_inv_freq()],
        }
        return out

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# ---- parsing ------------------------------------------------------------------------------

def _refuse(field_name: str, value, why: str):
    raise ValueError(f"unsupported config: `{field_name}` = {value!r}: {why}")


def _int(d: dict, key: str, *, minimum: int = 0, allow_none_as=None) -> int:
    v = d.get(key, _HF_DEFAULTS.get(key))
    if v is None and allow_none_as is not None:
        return allow_none_as
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v))
            or int(v) != v):
        raise ValueError(f"config field `{key}` must be an integer, got {v!r}")
    v = int(v)
    if v < minimum:
        raise ValueError(f"config field `{key}` must be >= {minimum}, got {v}")
    if v > _MAX_INT:
        shown = v if v < 10**30 else f"a {len(str(v))}-digit number"
        raise ValueError(f"config field `{key}` must be <= 2**31 - 1, got {shown}")
    return v


def _float(d: dict, key: str) -> float:
    v = d.get(key, _HF_DEFAULTS.get(key))
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"config field `{key}` must be a finite number, got {v!r}")
    return float(v)


def _bool(d: dict, key: str) -> bool:
    v = d.get(key, _HF_DEFAULTS.get(key))
    if v is None and key in _NULL_IS_FALSE:
        return False
    if not isinstance(v, bool):
        raise ValueError(f"config field `{key}` must be true/false, got {v!r}")
    return v


def _is_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _parse_rope(d: dict) -> tuple[str, float, Optional[dict]]:
    """(rope_type, rope_theta, standardized rope dict or None) as HF standardizes them."""
    # HF: `self.rope_parameters = rope_scaling or self.rope_parameters`
    rp = d.get("rope_scaling") or d.get("rope_parameters")
    if rp and not isinstance(rp, dict):
        raise ValueError(f"config field `rope_scaling`/`rope_parameters` must be an object (or null), got {rp!r}")
    rp = dict(rp) if rp else {}
    theta = rp.get("rope_theta", d.get("rope_theta", _DEFAULT_ROPE_THETA))
    if not _is_number(theta) or not theta > 0:
        raise ValueError(f"config field `rope_theta` must be a finite positive number, got {theta!r}")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        _refuse("rope_scaling.rope_type", rope_type, f"only {list(SUPPORTED_ROPE_TYPES)} are supported")
    prf = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        _refuse("partial_rotary_factor", prf, "only 1.0 (rope over all of qk_rope_head_dim) is supported")
    rp["rope_type"] = rope_type
    rp["rope_theta"] = float(theta)
    if rope_type == "default":
        return "default", float(theta), None
    # yarn
    if "original_max_position_embeddings" in d:   # HF gives a top-level value priority
        rp["original_max_position_embeddings"] = d["original_max_position_embeddings"]
    else:
        rp.setdefault("original_max_position_embeddings",
                      d.get("max_position_embeddings", _HF_DEFAULTS["max_position_embeddings"]))
    factor = rp.get("factor")
    # (float32 range: HF computes the frequencies with factor as a float32)
    if not _is_number(factor) or not 1.0 <= factor <= float(np.finfo(np.float32).max):
        _refuse("rope_scaling.factor", factor, "YaRN needs a finite number >= 1")
    for key in ("mscale", "mscale_all_dim", "beta_fast", "beta_slow", "attention_factor"):
        v = rp.get(key)
        if v is not None and not _is_number(v):
            _refuse(f"rope_scaling.{key}", v, "must be a finite number")
    for key in ("beta_fast", "beta_slow"):   # HF: `get(key) or default`, then log(orig_max / (beta * 2 pi))
        if rp.get(key) is not None and rp[key] < 0:
            _refuse(f"rope_scaling.{key}", rp[key], "must be a positive number (0 or null: the default)")
    if rp.get("truncate") is not None and not isinstance(rp["truncate"], bool):
        _refuse("rope_scaling.truncate", rp["truncate"], "must be true/false")
    if not theta > 1:
        _refuse("rope_theta", theta, "YaRN needs rope_theta > 1 (its correction range divides by log(rope_theta))")
    omp = rp["original_max_position_embeddings"]
    if not _is_number(omp) or not omp > 0:
        _refuse("rope_scaling.original_max_position_embeddings", omp, "must be a finite positive number")
    known = {"rope_type", "type", "rope_theta", "factor", "mscale", "mscale_all_dim", "beta_fast",
             "beta_slow", "attention_factor", "original_max_position_embeddings", "truncate",
             "partial_rotary_factor"}
    unknown = sorted(set(rp) - known)
    if unknown:
        _refuse(f"rope_scaling.{unknown[0]}", rp[unknown[0]], "unknown YaRN parameter")
    return "yarn", float(theta), rp


def config_from_dict(raw: dict) -> ModelConfig:
    """Parse a config.json dict (top level, possibly with `text_config`)."""
    if not isinstance(raw, dict):
        raise ValueError(f"config must be a JSON object, got {type(raw).__name__}")
    top = raw
    prefix = ""
    if isinstance(raw.get("text_config"), dict):     # Kimi K2.5: text model nested
        d = dict(raw["text_config"])
        prefix = "language_model."
        # quantization settings live at the top level in K2.5
        if "quantization_config" in top and "quantization_config" not in d:
            d["quantization_config"] = top["quantization_config"]
        for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):
            if key not in d and key in top:
                d[key] = top[key]
    else:
        d = dict(raw)

    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        _refuse("model_type", model_type, f"supported: {list(SUPPORTED_MODEL_TYPES)}")

    # -- settings we cannot run ----------------------------------------------------------
    qc = d.get("quantization_config")
    quantization = parse_quantization_config(qc) if qc else None
    if d.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", d.get("hidden_act"), "only silu (SwiGLU experts) is supported")
    if d.get("scoring_func", "sigmoid") != "sigmoid":
        _refuse("scoring_func", d.get("scoring_func"), "only sigmoid routing is supported")
    if d.get("topk_method", "noaux_tc") != "noaux_tc":
        _refuse("topk_method", d.get("topk_method"), "only noaux_tc (correction-bias, group-limited) is supported")
    if d.get("attention_bias", False):
        _refuse("attention_bias", d.get("attention_bias"), "attention projections with bias are not supported")
    if d.get("moe_layer_freq", 1) != 1:
        _refuse("moe_layer_freq", d.get("moe_layer_freq"), "HF DeepseekV3 makes every layer >= first_k_dense_replace MoE")
    if d.get("pretraining_tp", 1) not in (1, None):
        _refuse("pretraining_tp", d.get("pretraining_tp"), "only 1 is supported")

    heads = _int(d, "num_attention_heads", minimum=1)
    kvh = d.get("num_key_value_heads")
    if kvh is not None and kvh != heads:
        _refuse("num_key_value_heads", kvh, f"MLA needs num_key_value_heads == num_attention_heads ({heads})")

    rope_type, rope_theta, rope_scaling = _parse_rope(d)

    q_lora = d.get("q_lora_rank", _HF_DEFAULTS["q_lora_rank"])
    q_lora_rank = 0 if q_lora is None else _int(d, "q_lora_rank", minimum=1)

    cfg = ModelConfig(
        vocab_size=_int(d, "vocab_size", minimum=1),
        hidden_size=_int(d, "hidden_size", minimum=1),
        intermediate_size=_int(d, "intermediate_size", minimum=1),
        moe_intermediate_size=_int(d, "moe_intermediate_size", minimum=1),
        num_hidden_layers=_int(d, "num_hidden_layers", minimum=1),
        num_attention_heads=heads,
        n_routed_experts=_int(d, "n_routed_experts", minimum=1),
        n_shared_experts=_int(d, "n_shared_experts", minimum=0, allow_none_as=0),
        num_experts_per_tok=_int(d, "num_experts_per_tok", minimum=1),
        n_group=_int(d, "n_group", minimum=1),
        topk_group=_int(d, "topk_group", minimum=1),
        first_k_dense_replace=_int(d, "first_k_dense_replace", minimum=0),
        q_lora_rank=q_lora_rank,
        kv_lora_rank=_int(d, "kv_lora_rank", minimum=1),
        qk_nope_head_dim=_int(d, "qk_nope_head_dim", minimum=1),
        qk_rope_head_dim=_int(d, "qk_rope_head_dim", minimum=2),
        v_head_dim=_int(d, "v_head_dim", minimum=1),
        norm_topk_prob=_bool(d, "norm_topk_prob"),
        routed_scaling_factor=_float(d, "routed_scaling_factor"),
        rms_norm_eps=_float(d, "rms_norm_eps"),
        rope_theta=rope_theta,
        rope_interleave=_bool(d, "rope_interleave"),
        rope_type=rope_type,
        rope_scaling=rope_scaling,
        max_position_embeddings=_int(d, "max_position_embeddings", minimum=1),
        tie_word_embeddings=_bool(d, "tie_word_embeddings"),
        bos_token_id=_token_id(d, "bos_token_id"),
        eos_token_id=_token_id(d, "eos_token_id", allow_list=True),
        model_type=model_type,
        weight_prefix=prefix,
        num_nextn_predict_layers=_int(d, "num_nextn_predict_layers", minimum=0, allow_none_as=0),
        quantization=quantization,
        raw=raw,
    )

    # -- consistency ---------------------------------------------------------------------
    if cfg.qk_rope_head_dim % 2:
        _refuse("qk_rope_head_dim", cfg.qk_rope_head_dim, "must be even")
    if cfg.n_routed_experts % cfg.n_group:
        _refuse("n_group", cfg.n_group, f"must divide n_routed_experts ({cfg.n_routed_experts})")
    if cfg.experts_per_group < 2:
        _refuse("n_group", cfg.n_group, "each group needs >= 2 experts (group score = sum of its top-2)")
    if cfg.topk_group > cfg.n_group:
        _refuse("topk_group", cfg.topk_group, f"must be <= n_group ({cfg.n_group})")
    if cfg.num_experts_per_tok > cfg.topk_group * cfg.experts_per_group:
        _refuse("num_experts_per_tok", cfg.num_experts_per_tok,
                f"must be <= topk_group * experts per group ({cfg.topk_group * cfg.experts_per_group})")
    if cfg.rms_norm_eps <= 0:
        _refuse("rms_norm_eps", cfg.rms_norm_eps, "must be > 0")
    # the derived numbers the native model takes as given: finite, or the field that broke them
    with np.errstate(all="ignore"):
        inv_freq = cfg.rope_inv_freq()
    if not np.isfinite(inv_freq).all():
        _refuse("rope_theta", cfg.rope_theta, "gives non-finite RoPE inverse frequencies in float32")
    if cfg.rope_type == "yarn":
        if not math.isfinite(cfg.rope_attention_factor):
            _refuse("rope_scaling", cfg.rope_scaling, "gives a non-finite YaRN attention factor (mscale too large)")
        if not (math.isfinite(cfg.softmax_scale) and cfg.softmax_scale > 0):
            _refuse("rope_scaling.mscale_all_dim", cfg.rope_scaling.get("mscale_all_dim"),
                    f"gives a softmax scale of {cfg.softmax_scale} (must be finite and > 0)")
    return cfg


def _token_id(d: dict, key: str, allow_list: bool = False):
    """bos/eos: an integer, null or (eos) a list of integers, as HF's annotations say."""
    v = d.get(key, _HF_DEFAULTS[key])
    ok = lambda x: isinstance(x, int) and not isinstance(x, bool) and -2**63 <= x < 2**63  # noqa: E731
    if v is None or ok(v) or (allow_list and isinstance(v, list) and all(ok(x) for x in v)):
        return v
    raise ValueError(f"config field `{key}` must be an integer{', a list of integers' if allow_list else ''} "
                     f"or null, got {v!r}")


def load_config(model_dir_or_config_json) -> ModelConfig:
    """Read `config.json` from a model directory (or the path of the JSON file itself)."""
    path = os.fspath(model_dir_or_config_json)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json at {path}") from None
    except OSError as e:   # a symlink loop, a name too long, no permission on a parent ...
        raise ValueError(f"{path}: cannot read the config: {e.strerror or e}") from None
    # (checked before opening: reading a FIFO would block, a device such as /dev/zero never ends)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: not a regular file (a directory, FIFO or device); config.json must be a file")
    if st.st_size > _MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: {st.st_size} bytes, more than the {_MAX_CONFIG_BYTES} a config.json may have "
                         "(a model config is a few kilobytes)")
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_CONFIG_BYTES + 1)
        raw = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"{path}: not valid JSON: nested too deeply") from None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError, the 4300-digit int limit
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    return config_from_dict(raw)
