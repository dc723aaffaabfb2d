"""Config parsing: every supported layout, derived values equal to HF's, errors name the field."""
import copy
import json

import numpy as np
import pytest

from hf_models import PARITY_CONFIGS, config_dict, require_hf
from kdtree_native.config import ModelConfig, config_from_dict, load_config

# The published DeepSeek-V3 config.json (its FP8 block quantization removed by `unquantized` where a test
# is about the rest).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

# Kimi K2 (model_type kimi_k2): YaRN factor 32, beta 1/1, theta 50000, one group, 64 heads.
KIMI_K2 = dict(
    copy.deepcopy(DEEPSEEK_V3), model_type="kimi_k2", bos_token_id=163584, eos_token_id=163585,
    first_k_dense_replace=1, max_position_embeddings=131072, n_group=1, topk_group=1, n_routed_experts=384,
    num_attention_heads=64, num_key_value_heads=64, num_nextn_predict_layers=0, routed_scaling_factor=2.827,
    rope_theta=50000.0, vocab_size=163840,
    rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "type": "yarn"},
)


def unquantized(d):
    d = copy.deepcopy(d)
    d.pop("quantization_config", None)
    return d


def kimi_k25(text):
    """The Kimi K2.5 layout: the text model nested under text_config."""
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": text, "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14}}


def test_deepseek_v3_fields():
    cfg = config_from_dict(unquantized(DEEPSEEK_V3))
    assert isinstance(cfg, ModelConfig)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (7168, 61, 128)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim) == (1536, 512, 192)
    assert (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, cfg.n_shared_experts) == (8, 4, 8, 1)
    assert cfg.rope_type == "yarn" and cfg.rope_interleave is True and cfg.rope_theta == 10000.0
    assert cfg.rope_scaling["factor"] == 40 and cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert cfg.weight_prefix == "" and cfg.num_nextn_predict_layers == 1
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    # softmax scale: 192^-0.5 * (0.1 ln 40 + 1)^2
    m = 0.1 * np.log(40.0) + 1.0
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * m * m, rel=1e-15)
    assert cfg.rope_attention_factor == 1.0          # mscale == mscale_all_dim
    inv = cfg.rope_inv_freq()
    assert inv.dtype == np.float32 and inv.shape == (32,)


def test_kimi_k2_and_k25_nesting():
    k2 = config_from_dict(unquantized(KIMI_K2))
    assert k2.model_type == "kimi_k2" and k2.n_group == 1 and k2.n_routed_experts == 384
    assert k2.rope_theta == 50000.0 and k2.rope_scaling["beta_fast"] == 1.0
    k25 = config_from_dict(kimi_k25(unquantized(KIMI_K2)))
    assert k25.weight_prefix == "language_model."
    assert k25.to_native() == k2.to_native()
    # a quantization_config at the top level of K2.5 is seen too
    with pytest.raises(ValueError, match="quantization_config"):
        config_from_dict(dict(kimi_k25(unquantized(KIMI_K2)), quantization_config={"quant_method": "compressed-tensors"}))
    # the published FP8 block quantization (inside text_config here) is read (test_quantized.py)
    q = config_from_dict(kimi_k25(KIMI_K2)).quantization
    assert q.method == "fp8" and q.weight_block_size == (128, 128)
    assert config_from_dict(DEEPSEEK_V3).quantization == q


def test_q_lora_null_and_defaults():
    d = unquantized(DEEPSEEK_V3)
    d["q_lora_rank"] = None
    assert config_from_dict(d).q_lora_rank == 0
    # keys left out take HF's DeepseekV3Config defaults, as HF does when loading
    minimal = {"model_type": "deepseek_v3"}
    cfg = config_from_dict(minimal)
    assert (cfg.hidden_size, cfg.q_lora_rank, cfg.rope_type, cfg.rope_theta) == (7168, 1536, "default", 10000.0)
    assert cfg.rope_scaling is None and cfg.softmax_scale == 192 ** -0.5


def test_rope_parameters_and_rope_scaling_agree():
    """transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_scaling` + `rope_theta`."""
    legacy = unquantized(DEEPSEEK_V3)
    new = copy.deepcopy(legacy)
    rp = dict(new.pop("rope_scaling"), rope_type="yarn", rope_theta=10000.0)
    del rp["type"]
    new.pop("rope_theta")
    new["rope_parameters"] = rp
    a, b = config_from_dict(legacy), config_from_dict(new)
    assert a.to_native() == b.to_native()
    plain = unquantized(DEEPSEEK_V3)
    plain.pop("rope_scaling")
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    c = config_from_dict(plain)
    assert c.rope_type == "default" and c.rope_theta == 500.0 and c.rope_attention_factor == 1.0


def test_all_parity_configs_parse():
    seen = set()
    for name in PARITY_CONFIGS:
        cfg = config_from_dict(config_dict(name))
        native = cfg.to_native()
        for k, v in native.items():
            if k == "rope_inv_freq":
                assert all(type(x) is float for x in v) and len(v) == cfg.qk_rope_head_dim // 2
            else:
                assert type(v) in (int, float, bool), (k, type(v))
        seen.add(("interleave", cfg.rope_interleave))
        seen.add(("rope", cfg.rope_type))
        seen.add(("q_lora", cfg.q_lora_rank == 0))
        seen.add(("dense", cfg.first_k_dense_replace))
        seen.add(("norm", cfg.norm_topk_prob))
        seen.add(("tied", cfg.tie_word_embeddings))
        seen.add(("shared", min(cfg.n_shared_experts, 1)))
        seen.add(("groups", cfg.n_group > 1 and cfg.topk_group < cfg.n_group))
        if cfg.rope_type == "yarn":
            seen.add(("mscale_differs", cfg.rope_scaling["mscale"] != cfg.rope_scaling["mscale_all_dim"]))
    required = {("interleave", True), ("interleave", False), ("rope", "yarn"), ("rope", "default"),
                ("q_lora", True), ("q_lora", False), ("dense", 0), ("dense", 1), ("dense", 2), ("norm", False),
                ("tied", True), ("shared", 0), ("shared", 1), ("groups", True), ("mscale_differs", True),
                ("mscale_differs", False)}
    assert required <= seen, required - seen
    assert len(PARITY_CONFIGS) >= 6


def test_load_config_from_dir_and_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(unquantized(KIMI_K2)))
    assert load_config(tmp_path).model_type == "kimi_k2"
    assert load_config(tmp_path / "config.json").model_type == "kimi_k2"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(tmp_path / "bad")
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "nowhere")


@pytest.mark.parametrize("field,value,match", [
    ("model_type", "llama", "model_type"),
    ("scoring_func", "softmax", "scoring_func"),
    ("topk_method", "greedy", "topk_method"),
    ("hidden_act", "gelu", "hidden_act"),
    ("attention_bias", True, "attention_bias"),
    ("moe_layer_freq", 2, "moe_layer_freq"),
    ("num_key_value_heads", 1, "num_key_value_heads"),
    ("n_group", 3, "n_group"),
    ("topk_group", 9, "topk_group"),
    ("num_experts_per_tok", 200, "num_experts_per_tok"),
    ("qk_rope_head_dim", 63, "qk_rope_head_dim"),
    ("hidden_size", "big", "hidden_size"),
    ("num_hidden_layers", 0, "num_hidden_layers"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_type"),
    ("rope_scaling", {"type": "longrope", "factor": 2.0}, "rope_type"),
    ("rope_scaling", {"type": "yarn"}, "factor"),
    ("rope_scaling", {"type": "yarn", "factor": 4.0, "mscale": "x"}, "mscale"),
    ("rope_scaling", {"type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}, "low_freq_factor"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor"),
    ("rms_norm_eps", -1.0, "rms_norm_eps"),
])
def test_unsupported_settings_are_named(field, value, match):
    d = unquantized(DEEPSEEK_V3)
    d[field] = value
    with pytest.raises(ValueError, match=match):
        config_from_dict(d)


# ---- derived values equal HF's, bit for bit ----------------------------------------------

def _hf_values(transformers, d):
    """(inv_freq, attention_scaling, softmax scale) as HF computes them for config dict d."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mdl

    d = {k: v for k, v in d.items() if k not in ("quantization_config", "model_type", "architectures")}
    hf = transformers.DeepseekV3Config(**d)
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        inv, att = mdl.DeepseekV3RotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        inv, att = ROPE_INIT_FUNCTIONS[rope_type](hf)
    scale = mdl.yarn_apply_mscale(hf.rope_parameters, hf.qk_head_dim ** (-0.5))
    return inv.numpy(), att, scale


def assert_inv_freq_matches(ours, hf):
    """Equal to 1 ulp: torch's float32 pow is not always correctly rounded, ours is."""
    assert ours.dtype == np.float32 and ours.shape == hf.shape
    np.testing.assert_array_max_ulp(ours, hf, maxulp=1)
    assert (ours != hf).mean() <= 0.1


@pytest.mark.hf
@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k2"] + list(PARITY_CONFIGS))
def test_derived_values_equal_hf(name):
    _, transformers = require_hf()
    d = {"deepseek_v3": DEEPSEEK_V3, "kimi_k2": KIMI_K2}.get(name)
    d = unquantized(d) if d is not None else config_dict(name)
    cfg = config_from_dict(d)
    inv, att, scale = _hf_values(transformers, copy.deepcopy(d))
    assert_inv_freq_matches(cfg.rope_inv_freq(), inv)
    assert cfg.rope_attention_factor == att
    assert cfg.softmax_scale == scale


@pytest.mark.hf
def test_yarn_variants_equal_hf():
    """attention_factor given, truncate false, mscale without mscale_all_dim, top-level
    original_max_position_embeddings."""
    _, transformers = require_hf()
    variants = [
        {"type": "yarn", "factor": 8.0, "attention_factor": 0.9, "original_max_position_embeddings": 256},
        {"type": "yarn", "factor": 8.0, "truncate": False, "original_max_position_embeddings": 256},
        {"type": "yarn", "factor": 8.0, "mscale": 0.8, "original_max_position_embeddings": 256},
        {"type": "yarn", "factor": 3.0, "mscale": 1.2, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    ]
    for i, rs in enumerate(variants):
        d = config_dict({"rope_scaling": rs, "rope_theta": 20000.0})
        if i == 3:
            d["original_max_position_embeddings"] = 64
        cfg = config_from_dict(copy.deepcopy(d))
        inv, att, scale = _hf_values(transformers, copy.deepcopy(d))
        assert_inv_freq_matches(cfg.rope_inv_freq(), inv)
        assert cfg.rope_attention_factor == att
        assert cfg.softmax_scale == scale


@pytest.mark.hf
def test_saved_config_round_trip(tmp_path):
    """A config.json written by transformers' save_pretrained parses to the same config."""
    from hf_models import cached_checkpoint

    for name in PARITY_CONFIGS:
        path = cached_checkpoint(name)
        assert load_config(path).to_native() == config_from_dict(config_dict(name)).to_native()
