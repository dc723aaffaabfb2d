"""Quantized checkpoints: compressed-tensors `pack-quantized` integer weights (the format of Kimi
K2-Thinking's INT4 release), read by kdtree_native.quantization + checkpoint.load_weights.

* config parsing: the Kimi-shaped scheme accepted, and every setting the loader cannot honour
  refused with the field named;
* NumPy only: checkpoints packed here by a writer that follows the format's description field by
  field (independent of the loader's vectorised unpacking), loaded back equal to (q - zp) * scale
  rounded to the scale's dtype (BF16 by hf_models.to_bf16); clear errors for damaged parts;
* with torch + compressed-tensors: the loader's weights bit for bit against compressed-tensors'
  own decompressor for several schemes, and the engine on a Kimi-shaped INT4 checkpoint against
  HF transformers (which loads it through compressed-tensors): the same dequantized weights,
  logits within 1e-4, DDTree == AR;
* with a CUDA device: the CUDA engine on that checkpoint against the CPU engine.
"""
import copy
import json
import os

import numpy as np
import pytest

import kdtree_native as kn
from hf_models import config_dict, random_weights, to_bf16, to_bf16_bits
from kdtree_native.checkpoint import expected_weight_shapes, load_weights
from kdtree_native.config import config_from_dict, load_config
from kdtree_native.quantization import WeightQuantization, dequantize_packed, unpack_fields
from test_checkpoint import write_safetensors

# Shaped like Kimi K2-Thinking's quantization_config: 4-bit symmetric integers in groups of 32 for
# every Linear except attention, shared experts, dense MLPs and lm_head.
KIMI_QC = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                    "symmetric": True, "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
# The tiny model with widths that group_size 32 divides (hidden 64, experts 32 wide).
KIMI_LIKE = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=96)


def qc_with(group_size=32, num_bits=4, strategy="group", symmetric=True, ignore=None):
    qc = copy.deepcopy(KIMI_QC)
    w = qc["config_groups"]["group_0"]["weights"]
    w.update(group_size=group_size if strategy == "group" else None, num_bits=num_bits, strategy=strategy,
             symmetric=symmetric)
    if ignore is not None:
        qc["ignore"] = ignore
    return qc


# ---- config -----------------------------------------------------------------------------------

def test_config_reads_the_kimi_scheme():
    cfg = config_from_dict(dict(config_dict(KIMI_LIKE), quantization_config=KIMI_QC))
    spec = cfg.quantization
    assert spec.method == "compressed-tensors" and spec.format == "pack-quantized"
    s = spec.scheme_for("model.layers.1.mlp.experts.3.down_proj")
    assert s == WeightQuantization(num_bits=4, strategy="group", group_size=32, symmetric=True)
    for name in ("model.layers.1.self_attn.q_a_proj", "model.layers.1.mlp.shared_experts.up_proj",
                 "model.layers.0.mlp.gate_proj", "lm_head"):
        assert spec.scheme_for(name) is None, name
    # K2.5 keeps the quantization_config at the top level, beside text_config
    k25 = config_from_dict({"text_config": config_dict(KIMI_LIKE), "quantization_config": KIMI_QC})
    assert k25.quantization == spec and k25.weight_prefix == "language_model."
    assert config_from_dict(config_dict(KIMI_LIKE)).quantization is None


def _weights(**kw):
    return ("config_groups", {"g": {"targets": ["Linear"], "weights": dict(
        dict(num_bits=4, strategy="group", group_size=32, symmetric=True, type="int"), **kw)}})


@pytest.mark.parametrize("change, field", [
    (("quant_method", "gptq"), "quant_method"),
    (("format", "float-quantized"), "format"),
    (("quantization_status", "frozen"), "quantization_status"),
    (("kv_cache_scheme", {"num_bits": 8}), "kv_cache_scheme"),
    (("config_groups", {}), "config_groups"),
    (("config_groups", {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group",
                                                                   "group_size": 32},
                              "input_activations": {"num_bits": 8}}}), "input_activations"),
    (("config_groups", {"g": {"targets": [], "weights": {}}}), "targets"),
    (("config_groups", {"g": {"targets": ["re:("], "weights": {}}}), "targets"),
    (("ignore", ["re:[z-a]"]), "ignore"),
    (_weights(num_bits=3), "num_bits"),
    (_weights(num_bits=True), "num_bits"),
    (_weights(type="float"), "type"),
    (_weights(strategy="block"), "strategy"),
    (_weights(group_size=None), "group_size"),
    (_weights(group_size=0), "group_size"),
    (_weights(symmetric="yes"), "symmetric"),
    (_weights(dynamic=True), "dynamic"),
    (_weights(actorder="group"), "actorder"),
])
def test_config_refuses_what_the_loader_cannot_read(change, field):
    qc = copy.deepcopy(KIMI_QC)
    qc[change[0]] = change[1]
    with pytest.raises(ValueError, match=f"quantization_config.*{field}"):
        config_from_dict(dict(config_dict(KIMI_LIKE), quantization_config=qc))


# ---- NumPy: a field-by-field writer of the format ---------------------------------------------

def pack_rows(q, bits):
    """int [rows, cols] in [-2**(bits-1), 2**(bits-1)) -> int32 [rows, ceil(cols * bits / 32)]: each
    value + 2**(bits-1) as a `bits`-wide field; 32 / bits fields a word, column c in word
    c // (32 / bits) at bit (c % (32 / bits)) * bits. Written one field at a time on purpose."""
    per = 32 // bits
    rows, cols = q.shape
    words = np.zeros((rows, -(-cols // per)), dtype=np.uint64)
    for r in range(rows):
        for c in range(cols):
            field = int(q[r, c]) + (1 << (bits - 1))
            assert 0 <= field < (1 << bits)
            words[r, c // per] |= np.uint64(field << ((c % per) * bits))
    return words.astype(np.uint32).view(np.int32)


SCALE_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


def stored_scale(values, st_dtype):
    """(array to write, the float32 values it holds)."""
    v = np.asarray(values, dtype=np.float32)
    if st_dtype == "BF16":
        return to_bf16_bits(v).reshape(v.shape), to_bf16(v)
    if st_dtype == "F16":
        h = v.astype(np.float16)
        return h, h.astype(np.float32)
    return v, v


def round_like(x, st_dtype):
    x = np.asarray(x, dtype=np.float32)
    if st_dtype == "BF16":
        return to_bf16(x)
    if st_dtype == "F16":
        return x.astype(np.float16).astype(np.float32)
    return x


def quantize_numpy(name, w, scheme, st_dtype, rng):
    """A quantized Linear's tensors {suffix: array} for float weight w, and the float32 weight the
    loader must give back, computed here in float64 then rounded once to the scale's dtype."""
    out_f, in_f = w.shape
    bits = scheme.num_bits
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if scheme.strategy == "group":
        ng = in_f // scheme.group_size
        col_group = np.arange(in_f) // scheme.group_size
        sc_shape = (out_f, ng)
    elif scheme.strategy == "channel":
        ng, col_group, sc_shape = 1, np.zeros(in_f, int), (out_f, 1)
    else:
        ng, col_group, sc_shape = 1, np.zeros(in_f, int), (1,)
    raw_scale = np.abs(rng.standard_normal(sc_shape)) * 0.05 + 0.01
    scale_arr, scale = stored_scale(raw_scale, st_dtype)
    if scheme.strategy == "group":
        sc_cols = scale[:, col_group]
    elif scheme.strategy == "channel":
        sc_cols = np.broadcast_to(scale, (out_f, in_f))
    else:
        sc_cols = np.full((out_f, in_f), scale[0])
    parts = {}
    if scheme.symmetric:
        zp_cols = np.zeros((out_f, in_f))
    else:
        zshape = (out_f, ng) if scheme.strategy != "tensor" else (1,)
        zp = rng.integers(lo, hi + 1, zshape)
        if scheme.strategy == "tensor":
            parts[".weight_zero_point"] = zp.astype(np.int32)
            zp_cols = np.full((out_f, in_f), zp[0])
        else:
            parts[".weight_zero_point"] = np.ascontiguousarray(pack_rows(np.ascontiguousarray(zp.T), bits).T)
            zp_cols = zp[:, col_group] if scheme.strategy == "group" else np.broadcast_to(zp, (out_f, in_f))
    q = np.clip(np.round(w / sc_cols + zp_cols), lo, hi).astype(np.int64)
    parts[".weight_packed"] = pack_rows(q, bits)
    parts[".weight_scale"] = scale_arr
    parts[".weight_shape"] = np.array([out_f, in_f], dtype=np.int32)
    expect = round_like((q - zp_cols).astype(np.float64) * sc_cols.astype(np.float64), st_dtype)
    return parts, expect


def write_quantized(dirpath, cfg_dict, qc, weights, quantize, st_dtype, seed=0, extra=None, prefix="",
                    shards=1):
    """A checkpoint dir: `weights` {name: float32}, the Linears for which quantize(name) is true stored
    packed under `qc`'s scheme (tensor names prefixed by `prefix`; `shards` > 1: the tensors dealt
    round-robin into that many files with an index, so a module's parts sit in different shards).
    Returns {name: the float32 weight the loader must give}."""
    cfg = config_from_dict(dict(cfg_dict, quantization_config=qc))
    rng = np.random.default_rng(seed)
    tensors, expect = {}, {}
    for name, w in weights.items():
        module = name[:-len(".weight")]
        if name.endswith(".weight") and quantize(name):
            scheme = cfg.quantization.scheme_for(prefix + module)
            parts, back = quantize_numpy(name, w, scheme, st_dtype, rng)
            for suffix, arr in parts.items():
                tensors[module + suffix] = arr
            expect[name] = back
        else:
            tensors[name] = w.astype(np.float32)
            expect[name] = w.astype(np.float32)
    if extra:
        extra(tensors)
    os.makedirs(dirpath, exist_ok=True)
    with open(os.path.join(dirpath, "config.json"), "w") as f:
        if prefix:   # the Kimi K2.5 layout: the text model under text_config, quantization at the top
            json.dump({"model_type": "kimi_k25", "text_config": cfg_dict, "quantization_config": qc}, f)
        else:
            json.dump(dict(cfg_dict, quantization_config=qc), f)
    tensors = {prefix + k: (v if v.dtype != np.int64 else v.astype(np.int32)) for k, v in tensors.items()}
    if shards == 1:
        write_safetensors(os.path.join(dirpath, "model.safetensors"), tensors)
        return expect
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    parts = [{} for _ in files]
    for i, (k, v) in enumerate(sorted(tensors.items())):
        parts[i % shards][k] = v
    for fn, part in zip(files, parts):
        write_safetensors(os.path.join(dirpath, fn), part)
    with open(os.path.join(dirpath, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {k: files[i] for i, part in enumerate(parts) for k in part}}, f)
    return expect


def is_expert(name):
    return ".mlp.experts." in name


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_unpack_fields_against_the_field_writer(bits):
    rng = np.random.default_rng(bits)
    for cols in (1, 7, 32, 33, 70):
        q = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (5, cols))
        assert np.array_equal(unpack_fields(pack_rows(q, bits), bits, cols), q)


SCHEMES = [  # (num_bits, strategy, group_size, symmetric, scale dtype)
    (4, "group", 32, True, "BF16"),     # Kimi K2-Thinking
    (4, "group", 16, False, "BF16"),
    (8, "channel", None, False, "F16"),
    (2, "tensor", None, True, "F32"),
    (8, "tensor", None, False, "BF16"),
    (1, "group", 8, True, "F16"),
]


@pytest.mark.parametrize("bits, strategy, gs, sym, sdt", SCHEMES)
def test_load_dequantizes_exactly(tmp_path, bits, strategy, gs, sym, sdt):
    d = config_dict(KIMI_LIKE)
    qc = qc_with(gs, bits, strategy, sym)
    weights = {k: v.astype(np.float32) for k, v in random_weights(config_from_dict(d), seed=3).items()}
    expect = write_quantized(tmp_path, d, qc, weights, is_expert, sdt, seed=bits)
    cfg = load_config(tmp_path)
    got = load_weights(tmp_path, cfg)
    assert sorted(got) == sorted(expect)
    nq = 0
    for name in expect:
        assert got[name].dtype == np.float32 and np.array_equal(got[name], expect[name]), name
        nq += is_expert(name)
    assert nq == 3 * cfg.n_routed_experts * (cfg.num_hidden_layers - cfg.first_k_dense_replace)
    if sdt == "BF16":   # exactly BF16: the native models' BF16 weight copies apply
        w = got["model.layers.1.mlp.experts.0.up_proj.weight"]
        assert not (w.view(np.uint32) & 0xFFFF).any()


@pytest.mark.parametrize("prefix, shards", [("language_model.", 1), ("", 3), ("language_model.", 2)])
def test_load_k25_prefix_and_shards(tmp_path, prefix, shards):
    """Kimi K2.5's nesting (names under language_model., the quantization_config at the top level) and
    sharded files whose index puts a module's packed parts in different shards."""
    d = config_dict(KIMI_LIKE)
    weights = {k: v.astype(np.float32) for k, v in random_weights(config_from_dict(d), seed=10).items()}
    expect = write_quantized(tmp_path, d, KIMI_QC, weights, is_expert, "BF16", prefix=prefix, shards=shards)
    cfg = load_config(tmp_path)
    assert cfg.weight_prefix == prefix and cfg.quantization is not None
    got = load_weights(tmp_path, cfg)
    assert sorted(got) == sorted(expect) and all(np.array_equal(got[k], expect[k]) for k in expect)


def test_engine_on_a_numpy_packed_checkpoint_equals_the_float_one(tmp_path):
    """The engine on the quantized checkpoint == the engine on its dequantized weights saved as F32."""
    d = config_dict(KIMI_LIKE)
    weights = {k: v.astype(np.float32) for k, v in random_weights(config_from_dict(d), seed=4).items()}
    expect = write_quantized(tmp_path / "q", d, KIMI_QC, weights, is_expert, "BF16")
    os.makedirs(tmp_path / "f")
    with open(tmp_path / "f" / "config.json", "w") as f:
        json.dump(d, f)
    write_safetensors(str(tmp_path / "f" / "model.safetensors"), expect)
    ids = np.array([3, 9, 27, 81, 100, 5, 7], dtype=np.int32)
    a = kn.Engine.from_pretrained(tmp_path / "q", device="cpu")
    b = kn.Engine.from_pretrained(tmp_path / "f", device="cpu")
    assert a.config.quantization is not None and b.config.quantization is None
    assert "int4 group 32, symmetric" in repr(a) and "quantized" not in repr(b)
    assert np.array_equal(a.prefill(ids), b.prefill(ids))
    from kdtree_native.drafters import NgramDrafter
    ar = a.generate(ids, 24)
    dd = a.generate(ids, 24, drafter=NgramDrafter(), tree_budget=8, depth=4)
    assert np.array_equal(ar.tokens, b.generate(ids, 24).tokens) and np.array_equal(dd.tokens, ar.tokens)


EXPERT = "model.layers.1.mlp.experts.2.down_proj"


def _nan_scale(t):
    s = t[EXPERT + ".weight_scale"].copy()
    s[0, 0] = 0x7FC0   # a BF16 NaN
    t[EXPERT + ".weight_scale"] = s


def _rename(suffix_from, suffix_to):
    def f(t):
        t[EXPERT + suffix_to] = t.pop(EXPERT + suffix_from)
    return f


@pytest.mark.parametrize("mutate, qc, match", [
    (lambda t: t.pop(EXPERT + ".weight_scale"), KIMI_QC, "down_proj: no .weight_scale"),
    (lambda t: t.pop(EXPERT + ".weight_packed"), KIMI_QC, "without .weight_packed"),
    (lambda t: t.__setitem__(EXPERT + ".weight_g_idx", np.zeros(24, np.int32)), KIMI_QC, "g_idx"),
    (lambda t: t.__setitem__(EXPERT + ".weight_zero_point", np.zeros((1, 1), np.int32)), KIMI_QC,
     "zero_point for a symmetric"),
    (lambda t: t.__setitem__(EXPERT + ".weight_shape", np.array([64, 31], np.int32)), KIMI_QC,
     r"weight_shape says \[64, 31\], expected \[64, 32\]"),
    (lambda t: t.__setitem__(EXPERT + ".weight_packed", t[EXPERT + ".weight_packed"].view(np.float32)), KIMI_QC,
     "weight_packed has dtype F32"),
    (lambda t: t.__setitem__(EXPERT + ".weight_packed", t[EXPERT + ".weight_packed"][:, :-1].copy()), KIMI_QC,
     r"weight_packed: shape \[64, 3\], expected \[64, 4\]"),
    (lambda t: t.__setitem__(EXPERT + ".weight_scale", t[EXPERT + ".weight_scale"][:-1].copy()), KIMI_QC,
     r"weight_scale: shape \[63, 1\], expected \[64, 1\]"),
    (_nan_scale, KIMI_QC, "weight_scale contains NaN"),
    (lambda t: t.__setitem__(EXPERT + ".weight", np.zeros((64, 32), np.float32)), KIMI_QC, "beside a float weight"),
    (None, qc_with(ignore=["re:.*experts\\.2\\.down.*"]), "no quantization_config group covers it"),
    (None, qc_with(symmetric=False), "no .weight_zero_point"),
])
def test_damaged_quantized_parts_are_named(tmp_path, mutate, qc, match):
    d = config_dict(KIMI_LIKE)
    weights = {k: v.astype(np.float32) for k, v in random_weights(config_from_dict(d), seed=6).items()}
    write_quantized(tmp_path, d, KIMI_QC, weights, is_expert, "BF16", extra=mutate)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(dict(d, quantization_config=qc), f)
    with pytest.raises(ValueError, match=match):
        load_weights(tmp_path, load_config(tmp_path))
    with pytest.raises(ValueError, match=match):
        kn.Engine.from_pretrained(tmp_path, device="cpu")


def test_quantized_parts_without_a_quantization_config_are_unexpected(tmp_path):
    d = config_dict(KIMI_LIKE)
    weights = {k: v.astype(np.float32) for k, v in random_weights(config_from_dict(d), seed=7).items()}
    write_quantized(tmp_path, d, KIMI_QC, weights, is_expert, "BF16")
    with open(tmp_path / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(ValueError, match=r"unexpected .*weight_packed"):
        load_weights(tmp_path, load_config(tmp_path))


def test_a_quantization_config_over_float_weights_loads_them(tmp_path):
    """Modules the config would quantize but stored as float: read as float (nothing to undo)."""
    d = config_dict(KIMI_LIKE)
    weights = {k: v.astype(np.float32) for k, v in random_weights(config_from_dict(d), seed=8).items()}
    expect = write_quantized(tmp_path, d, KIMI_QC, weights, lambda n: False, "BF16")
    got = load_weights(tmp_path, load_config(tmp_path))
    assert all(np.array_equal(got[k], expect[k]) for k in expect)


# ---- against compressed-tensors and HF transformers -------------------------------------------

def require_ct():
    torch = pytest.importorskip("torch")
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
        from compressed_tensors.compressors import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    except Exception as e:   # absent or broken
        pytest.skip(f"compressed-tensors not usable: {e}")
    return torch, pack_to_int32, PackedQuantizationCompressor, QuantizationArgs, QuantizationScheme


@pytest.mark.parametrize("bits, strategy, gs, sym, sdt", SCHEMES + [(4, "channel", None, True, "BF16")])
def test_dequantize_equals_compressed_tensors(bits, strategy, gs, sym, sdt):
    torch, pack_to_int32, Compressor, QArgs, QScheme = require_ct()
    tdt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[sdt]
    args = QArgs(num_bits=bits, type="int", strategy=strategy, group_size=gs, symmetric=sym)
    scheme = QScheme(targets=["Linear"], weights=args)
    gen = torch.Generator().manual_seed(bits * 10 + len(strategy))
    out_f, in_f = 40, 64
    ng = in_f // gs if strategy == "group" else 1
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (out_f, in_f), generator=gen, dtype=torch.int8)
    sshape = (out_f, ng) if strategy != "tensor" else (1,)
    scale = (torch.rand(sshape, generator=gen) * 0.3 + 1e-3).to(tdt)
    sd = {"weight_packed": pack_to_int32(q, bits), "weight_scale": scale,
          "weight_shape": torch.tensor([out_f, in_f])}
    zp_np = None
    if not sym:
        zp = torch.randint(lo, hi + 1, sshape, generator=gen, dtype=torch.int8)
        if strategy == "tensor":
            sd["weight_zero_point"] = zp
            zp_np = zp.numpy().astype(np.int32)
        else:
            sd["weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0)
            zp_np = sd["weight_zero_point"].numpy()
    ref = Compressor.decompress(dict(sd), scheme)["weight"].to(torch.float32).numpy()
    ours = dequantize_packed("m", WeightQuantization(bits, strategy, gs, sym), (out_f, in_f),
                             sd["weight_packed"].numpy(), scale.to(torch.float32).numpy(), sdt, zp_np)
    assert np.array_equal(ours, ref)


def save_quantized(qdir, tensors, src_dir, qc):
    """Write torch `tensors` as qdir/model.safetensors with src_dir's config.json plus `qc`."""
    from safetensors.torch import save_file

    os.makedirs(qdir)
    save_file(tensors, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(qdir / "config.json", "w") as f:
        json.dump(cfg, f)
    return qdir


@pytest.fixture(scope="module")
def kimi_like_int4(tmp_path_factory):
    """A Kimi-shaped INT4 checkpoint built from a random HF model: its experts quantized with
    compressed-tensors (scales = group absmax / 7, BF16), packed by compressed-tensors."""
    torch, pack_to_int32, *_ = require_ct()
    from hf_models import make_checkpoint
    from safetensors.torch import load_file

    base = tmp_path_factory.mktemp("int4")
    fp = make_checkpoint(str(base / "bf16"), KIMI_LIKE, seed=11, dtype="bfloat16")
    sd = load_file(os.path.join(fp, "model.safetensors"))
    out = {}
    for k, v in sd.items():
        if is_expert(k) and k.endswith(".weight"):
            w = v.float()
            o, i = w.shape
            g = w.reshape(o, i // 32, 32)
            scale = (g.abs().amax(-1) / 7.0).clamp(min=1e-8).to(torch.bfloat16)
            q = torch.clamp(torch.round(g / scale.float().unsqueeze(-1)), -8, 7).to(torch.int8).reshape(o, i)
            m = k[:-len(".weight")]
            out[m + ".weight_packed"] = pack_to_int32(q, 4)
            out[m + ".weight_scale"] = scale
            out[m + ".weight_shape"] = torch.tensor([o, i])
        else:
            out[k] = v
    return save_quantized(base / "int4", out, fp, KIMI_QC)


def _hf_quantized(path):
    """HF transformers' model of a quantized checkpoint (dequantized by its loader: compressed-tensors
    or FP8), with every parameter widened to float32 (compressed-tensors' experts come as BF16)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    except Exception as e:   # this transformers cannot read compressed-tensors checkpoints
        pytest.skip(f"transformers could not load the compressed-tensors checkpoint: {e}")
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.float()
    model.eval()
    return model


def test_int4_checkpoint_matches_hf_transformers(kimi_like_int4):
    torch = pytest.importorskip("torch")
    model = _hf_quantized(kimi_like_int4)
    cfg = load_config(kimi_like_int4)
    ours = load_weights(kimi_like_int4, cfg)
    inter = cfg.moe_intermediate_size
    # the dequantized experts: the same values HF holds (it stores them fused, gate then up)
    for li in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        ex = model.model.layers[li].mlp.experts
        gu, dn = ex.gate_up_proj.detach().numpy(), ex.down_proj.detach().numpy()
        for e in range(cfg.n_routed_experts):
            p = f"model.layers.{li}.mlp.experts.{e}."
            assert np.array_equal(ours[p + "gate_proj.weight"], gu[e][:inter])
            assert np.array_equal(ours[p + "up_proj.weight"], gu[e][inter:])
            assert np.array_equal(ours[p + "down_proj.weight"], dn[e])
    ids = np.random.default_rng(1).integers(2, cfg.vocab_size, 12)
    with torch.no_grad():
        ref = model(torch.as_tensor(ids)[None], use_cache=False).logits[0].numpy()
    eng = kn.Engine.from_pretrained(kimi_like_int4, device="cpu")
    got = eng.prefill(ids)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    from kdtree_native.drafters import NgramDrafter
    ar = eng.generate(ids, 32)
    assert np.array_equal(eng.generate(ids, 32, drafter=NgramDrafter(), tree_budget=16, depth=6).tokens, ar.tokens)


@pytest.mark.cuda
def test_int4_checkpoint_on_cuda_matches_cpu(kimi_like_int4):
    if not kn.cuda_available():
        pytest.skip("no usable CUDA device")
    ids = np.random.default_rng(2).integers(2, 150, 20)
    cpu = kn.Engine.from_pretrained(kimi_like_int4, device="cpu")
    gpu = kn.Engine.from_pretrained(kimi_like_int4, device="cuda")
    a, b = cpu.prefill(ids), gpu.prefill(ids)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
    from kdtree_native.drafters import NgramDrafter
    ar = gpu.generate(ids, 32)
    assert np.array_equal(ar.tokens, cpu.generate(ids, 32).tokens)
    assert np.array_equal(gpu.generate(ids, 32, drafter=NgramDrafter(), tree_budget=16, depth=6).tokens, ar.tokens)


@pytest.mark.cuda
def test_numpy_packed_checkpoint_on_cuda_matches_cpu(tmp_path):
    """The INT4 path on the GPU without compressed-tensors (the device machine has none): the NumPy
    writer's Kimi-scheme checkpoint, CUDA vs CPU logits within 1e-4, DDTree == AR on the GPU."""
    if not kn.cuda_available():
        pytest.skip("no usable CUDA device")
    d = config_dict(KIMI_LIKE)
    weights = {k: v.astype(np.float32) for k, v in random_weights(config_from_dict(d), seed=4).items()}
    write_quantized(tmp_path, d, KIMI_QC, weights, is_expert, "BF16")
    test_int4_checkpoint_on_cuda_matches_cpu(tmp_path)


# ---- FP8 (block-scaled e4m3: DeepSeek-V3 and Kimi K2's releases) -------------------------------

FP8_QC = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [16, 16]}


def test_e4m3_table_equals_torch():
    torch = pytest.importorskip("torch")
    from kdtree_native.quantization import e4m3_values

    ref = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    ours = e4m3_values()
    assert np.array_equal(np.isnan(ours), np.isnan(ref)) and np.isnan(ours).sum() == 2
    fin = ~np.isnan(ref)
    assert np.array_equal(ours[fin], ref[fin]) and np.array_equal(np.signbit(ours[fin]), np.signbit(ref[fin]))


def fp8_encode(x):
    """float -> the nearest e4m3fn byte (ties to the even code), searching the finite codes: a
    plain encoder for building test checkpoints (values are clipped to +-448)."""
    from kdtree_native.quantization import e4m3_values

    vals = e4m3_values().astype(np.float64)
    codes = np.array([c for c in range(256) if np.isfinite(vals[c]) and c != 0x80])   # one zero
    v = vals[codes]
    x = np.clip(np.asarray(x, dtype=np.float64), -448, 448)
    d = np.abs(x[..., None] - v)
    best = d.min(-1, keepdims=True)
    tie = d == best
    pick = np.where(tie.sum(-1) > 1, np.argmax(tie & (codes % 2 == 0), -1), np.argmin(d, -1))
    return codes[pick].astype(np.uint8)


def write_fp8(dirpath, cfg_dict, weights, block, quantize, scale_dtype="F32", extra=None):
    """An FP8 checkpoint: the Linears for which quantize(name) is true stored as F8_E4M3 bytes with a
    `weight_scale_inv` per block (partial blocks at the edges); returns {name: the float32 weight
    the loader must give}, computed here: byte value x the block's scale, exact in float64, rounded
    once to float32."""
    from kdtree_native.quantization import e4m3_values

    vals = e4m3_values().astype(np.float64)
    bm, bn = block
    tensors, expect = {}, {}
    for name, w in weights.items():
        if not (name.endswith("_proj.weight") and quantize(name)):
            tensors[name] = w.astype(np.float32)
            expect[name] = w.astype(np.float32)
            continue
        o, i = w.shape
        so, si = -(-o // bm), -(-i // bn)
        scale = np.zeros((so, si), np.float32)
        q = np.zeros((o, i), np.uint8)
        for r in range(so):
            for c in range(si):
                blk = w[r * bm:(r + 1) * bm, c * bn:(c + 1) * bn]
                sc = np.float32(max(np.abs(blk).max(), 1e-6) / 448.0)
                stored, sc_val = stored_scale(np.array([sc]), scale_dtype)
                scale[r, c] = sc_val[0]
                q[r * bm:(r + 1) * bm, c * bn:(c + 1) * bn] = fp8_encode(blk / scale[r, c])
        back = np.zeros((o, i), np.float64)
        for r in range(o):
            for c in range(i):
                back[r, c] = vals[q[r, c]] * np.float64(scale[r // bm, c // bn])
        tensors[name] = ("F8_E4M3", [o, i], q.tobytes())
        tensors[name[:-len("weight")] + "weight_scale_inv"] = stored_scale(scale, scale_dtype)[0]
        expect[name] = back.astype(np.float32)
    if extra:
        extra(tensors)
    os.makedirs(dirpath, exist_ok=True)
    with open(os.path.join(dirpath, "config.json"), "w") as f:
        json.dump(dict(cfg_dict, quantization_config=dict(FP8_QC, weight_block_size=list(block))), f)
    write_safetensors(os.path.join(dirpath, "model.safetensors"), tensors)
    return expect


@pytest.fixture(scope="module")
def small_weights():
    d = config_dict(KIMI_LIKE)
    return d, {k: v.astype(np.float32) for k, v in random_weights(config_from_dict(d), seed=9).items()}


@pytest.mark.parametrize("block, scale_dtype", [((16, 16), "F32"), ((5, 7), "BF16"), ((128, 128), "F32")])
def test_fp8_load_dequantizes_exactly(tmp_path, small_weights, block, scale_dtype):
    """Partial edge blocks included (5 x 7 and 16 x 16 blocks over 24-, 40-, 44-, 64-wide weights;
    128 x 128: one partial block per weight), and a BF16 scale grid."""
    d, weights = small_weights
    expect = write_fp8(tmp_path, d, weights, block, lambda n: "layers.1" in n or "layers.0.self_attn" in n,
                       scale_dtype)
    cfg = load_config(tmp_path)
    assert cfg.quantization.method == "fp8" and cfg.quantization.weight_block_size == block
    got = load_weights(tmp_path, cfg)
    assert sorted(got) == sorted(expect)
    for name in expect:
        assert got[name].dtype == np.float32 and np.array_equal(got[name], expect[name]), name
    # and the engine runs it: == the engine on the dequantized weights saved as F32
    os.makedirs(tmp_path / "f")
    with open(tmp_path / "f" / "config.json", "w") as f:
        json.dump(d, f)
    write_safetensors(str(tmp_path / "f" / "model.safetensors"), expect)
    ids = np.array([4, 8, 15, 16, 23, 42], dtype=np.int32)
    assert np.array_equal(kn.Engine.from_pretrained(tmp_path, device="cpu").prefill(ids),
                          kn.Engine.from_pretrained(tmp_path / "f", device="cpu").prefill(ids))


FP8_MOD = "model.layers.1.self_attn.kv_b_proj"


def _fp8_set(name, value):
    return lambda t: t.__setitem__(name, value)


def _fp8_nan_byte(t):
    dt, shape, data = t[FP8_MOD + ".weight"]
    t[FP8_MOD + ".weight"] = (dt, shape, b"\x7f" + data[1:])


@pytest.mark.parametrize("mutate, match", [
    (_fp8_set(FP8_MOD + ".weight_scale_inv", np.ones((2, 1), np.float32)),
     r"kv_b_proj.weight_scale_inv: shape \[2, 1\], expected \[3, 1\]"),
    (_fp8_set(FP8_MOD + ".weight_scale_inv", np.full((3, 1), np.inf, np.float32)), "weight_scale_inv contains NaN"),
    (_fp8_nan_byte, "an FP8 byte is NaN"),
    (lambda t: t.pop(FP8_MOD + ".weight_scale_inv"), "F8_E4M3 weight without its .weight_scale_inv"),
    (lambda t: t.pop(FP8_MOD + ".weight"), r"missing \(1\): model.layers.1.self_attn.kv_b_proj.weight"),
    (_fp8_set(FP8_MOD + ".weight", np.zeros((44, 16), np.float32)), "dtype F32 with a .weight_scale_inv"),
    (_fp8_set(FP8_MOD + ".weight", ("F8_E4M3", [44, 8], bytes(44 * 8))), r"shape \[44, 8\], expected \[44, 16\]"),
    (_fp8_set(FP8_MOD + ".weight_scale_inv", np.ones((3, 1), np.int32)), "expected F32, BF16 or F16"),
])
def test_fp8_damaged_parts_are_named(tmp_path, small_weights, mutate, match):
    d, weights = small_weights
    write_fp8(tmp_path, d, weights, (16, 16), lambda n: True, extra=mutate)
    with pytest.raises(ValueError, match=match):
        load_weights(tmp_path, load_config(tmp_path))


def test_fp8_weights_without_a_quantization_config_are_refused(tmp_path, small_weights):
    d, weights = small_weights
    write_fp8(tmp_path, d, weights, (16, 16), lambda n: True)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(ValueError, match="F8_E4M3 is not a float type"):
        load_weights(tmp_path, load_config(tmp_path))


@pytest.mark.parametrize("change, field", [
    (("fmt", "e5m2"), "fmt"),
    (("activation_scheme", "static"), "activation_scheme"),
    (("weight_block_size", None), "weight_block_size"),
    (("weight_block_size", [128]), "weight_block_size"),
    (("weight_block_size", [0, 128]), "weight_block_size"),
    (("weight_block_size", [128.0, 128]), "weight_block_size"),
    (("modules_to_not_convert", "lm_head"), "modules_to_not_convert"),
])
def test_fp8_config_refusals(change, field):
    qc = dict(FP8_QC)
    qc[change[0]] = change[1]
    with pytest.raises(ValueError, match=f"quantization_config.*{field}"):
        config_from_dict(dict(config_dict(KIMI_LIKE), quantization_config=qc))


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """An FP8 checkpoint from a random HF model, quantized by torch's float8_e4m3fn cast, 4 x 4 blocks
    (every width here is a multiple of 4: HF transformers' dequantizer derives the block from the
    scale grid and cannot read partial blocks)."""
    torch = pytest.importorskip("torch")
    from hf_models import make_checkpoint
    from safetensors.torch import load_file

    base = tmp_path_factory.mktemp("fp8")
    src = make_checkpoint(str(base / "bf16"), KIMI_LIKE, seed=12, dtype="bfloat16")
    sd = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for k, v in sd.items():
        if k.endswith("_proj.weight"):
            w = v.float()
            o, i = w.shape
            blk = w.reshape(o // 4, 4, i // 4, 4)
            s = (blk.abs().amax((1, 3)) / 448.0).clamp(min=1e-12)
            out[k] = (blk / s[:, None, :, None]).reshape(o, i).to(torch.float8_e4m3fn)
            out[k[:-len("weight")] + "weight_scale_inv"] = s
        else:
            out[k] = v
    return save_quantized(base / "fp8", out, src, dict(FP8_QC, weight_block_size=[4, 4]))


def test_fp8_checkpoint_matches_hf_transformers(fp8_checkpoint):
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")   # transformers' FP8 loader needs it
    model = _hf_quantized(fp8_checkpoint)
    cfg = load_config(fp8_checkpoint)
    ours = load_weights(fp8_checkpoint, cfg)
    hf = dict(model.named_parameters())
    for name in ("model.layers.0.self_attn.q_a_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "lm_head.weight"):
        assert np.array_equal(ours[name], hf[name].detach().numpy()), name
    ex = model.model.layers[1].mlp.experts
    inter = cfg.moe_intermediate_size
    for e in range(cfg.n_routed_experts):
        p = f"model.layers.1.mlp.experts.{e}."
        assert np.array_equal(ours[p + "gate_proj.weight"], ex.gate_up_proj[e, :inter].detach().numpy())
        assert np.array_equal(ours[p + "down_proj.weight"], ex.down_proj[e].detach().numpy())
    ids = np.random.default_rng(3).integers(2, cfg.vocab_size, 12)
    with torch.no_grad():
        ref = model(torch.as_tensor(ids)[None], use_cache=False).logits[0].numpy()
    eng = kn.Engine.from_pretrained(fp8_checkpoint, device="cpu")
    assert np.abs(eng.prefill(ids) - ref).max() <= 1e-4 * np.abs(ref).max()
    from kdtree_native.drafters import NgramDrafter
    ar = eng.generate(ids, 32)
    assert np.array_equal(eng.generate(ids, 32, drafter=NgramDrafter(), tree_budget=16, depth=6).tokens, ar.tokens)


@pytest.mark.cuda
def test_fp8_checkpoint_on_cuda_matches_cpu(fp8_checkpoint):
    test_int4_checkpoint_on_cuda_matches_cpu(fp8_checkpoint)


# ---- the CPU model holds 4-bit weights packed ----------------------------------------------------

@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    """A Kimi-like checkpoint with BF16 non-expert weights and INT4 experts (group 32, BF16 scales),
    written by the field writer above; and its dequantized weights."""
    d = config_dict(KIMI_LIKE)
    weights = {k: to_bf16(v) for k, v in random_weights(config_from_dict(d), seed=8).items()}
    path = tmp_path_factory.mktemp("int4")
    expect = write_quantized(path, d, KIMI_QC, weights, is_expert, "BF16")
    return path, config_from_dict(d), expect


def _int4_bytes(cfg):
    """What the packed experts take: half a byte a weight, a float a group of 32."""
    n = 0
    for name, shape in expected_weight_shapes(cfg).items():
        if is_expert(name):
            n += shape[0] * shape[1] // 2 + shape[0] * shape[1] // 32 * 4
    return n


def _outputs(eng, cfg, long_prefill=0):
    from tree_cases import path_to, random_tree

    eng.reset()
    rng = np.random.default_rng(3)
    outs = [eng.prefill(rng.integers(0, cfg.vocab_size, 30))]
    for i, T in enumerate((1, 2, 5, 9, 17, 33)):
        parents, depths, vis = random_tree(T, seed=40 + i)
        outs.append(eng.forward(rng.integers(0, cfg.vocab_size, T), eng.cache_len + depths, vis))
        eng.commit(path_to(parents, T - 1))
    if long_prefill:
        eng.reset()
        outs.append(eng.prefill(rng.integers(0, cfg.vocab_size, long_prefill)))
    return outs


def _assert_same(a, b, what=""):
    for i, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_array_equal(x, y, err_msg=f"{what} output {i}")


def _assert_close(a, b, what=""):
    """Within 1e-5 of each output's largest logit: the INT4 GEMV of the GPU's small steps sums the same values
    in its own lane order (FP32 rounding apart from the model holding the dequantized weights)."""
    for i, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5 * np.abs(y).max(), err_msg=f"{what} output {i}")


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_cpu_holds_int4_packed_with_the_same_bits(int4_dir, isa):
    """from_pretrained on the CPU holds the INT4 experts packed (half a byte a weight plus a float a
    group; int4_weight_bytes), and its logits are the bits of the engine on the dequantized weights
    (held as BF16): a prefill, tree verifies of 1..33 tokens after commits, a 300-token prefill, with
    each skinny ISA and on the portable SGEMM (the GEMMs' other blocking); DDTree == AR."""
    from kdtree_native import _native
    from kdtree_native.drafters import NgramDrafter

    isa0 = _native.sgemm_skinny_isa()
    if not _native.sgemm_set_skinny_isa(isa):
        pytest.skip(f"no {isa} skinny kernels here")
    try:
        path, cfg, _ = int4_dir
        packed = kn.Engine.from_pretrained(path, device="cpu", max_seq_len=512)
        ref = kn.Engine.from_weights(cfg, load_weights(path, load_config(path)), device="cpu", max_seq_len=512)
        assert packed.model.int4_weight_bytes == _int4_bytes(cfg) > 0
        assert ref.model.int4_weight_bytes == 0
        assert packed.model.memory_bytes < ref.model.memory_bytes
        _assert_same(_outputs(packed, cfg, 300), _outputs(ref, cfg, 300), isa)
        _native.sgemm_force_portable(True)
        try:
            _assert_same(_outputs(packed, cfg, 300), _outputs(ref, cfg, 300), "portable")
        finally:
            _native.sgemm_force_portable(False)
        ids = np.array([3, 9, 27, 81, 100, 5, 7])
        ar = packed.generate(ids, 24)
        assert np.array_equal(ar.tokens, ref.generate(ids, 24).tokens)
        dd = packed.generate(ids, 24, drafter=NgramDrafter(), tree_budget=8, depth=4)
        assert np.array_equal(dd.tokens, ar.tokens)
    finally:
        if isa0 != "none":
            _native.sgemm_set_skinny_isa(isa0)


def test_int4_across_modes_and_replaced_pieces(int4_dir):
    """With bf16_weights 'copies' / 'off' the INT4 experts are dequantized on arrival; a packed model
    switched to 'off' and back unpacks them (to BF16: not packed again); a float piece set into a packed
    stack after loading unpacks that stack alone. The logits stay those of the dequantized model."""
    path, cfg, _ = int4_dir
    ref = kn.Engine.from_weights(cfg, load_weights(path, load_config(path)), device="cpu", max_seq_len=128)
    want = _outputs(ref, cfg)
    for mode in ("copies", "off"):
        e = kn.Engine.from_pretrained(path, device="cpu", max_seq_len=128, cpu_options={"bf16_weights": mode})
        assert e.model.int4_weight_bytes == 0
        _assert_same(_outputs(e, cfg), want, mode)
    e = kn.Engine.from_pretrained(path, device="cpu", max_seq_len=128)
    full = e.model.int4_weight_bytes
    e.model.set_bf16_weights("off")
    assert e.model.int4_weight_bytes == 0 and e.model.bf16_weight_bytes == 0
    _assert_same(_outputs(e, cfg), want, "off")
    e.model.set_bf16_weights("only")
    assert e.model.int4_weight_bytes == 0 and e.model.fp32_weight_bytes == 0
    _assert_same(_outputs(e, cfg), want, "only again")
    e = kn.Engine.from_pretrained(path, device="cpu", max_seq_len=128)
    layer = cfg.first_k_dense_replace
    name = f"model.layers.{layer}.mlp.experts.1.down_proj.weight"
    new = to_bf16(np.random.default_rng(9).standard_normal(expected_weight_shapes(cfg)[name]) * 0.05)
    e.model.set_weight(name, new)
    e.model.finalize()
    stack = cfg.n_routed_experts * cfg.hidden_size * cfg.moe_intermediate_size  # experts_down of that layer
    assert e.model.int4_weight_bytes == full - (stack // 2 + stack // 32 * 4)
    w = load_weights(path, load_config(path))
    w[name] = new
    _assert_same(_outputs(e, cfg), _outputs(kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=128), cfg),
                 "replaced piece")


def test_set_weight_int4_validation():
    """set_weight_int4: the layout's shapes, a group that divides the width, finite scales, no weight
    overflowing BF16, and a weight matrix of the model (not kv_b_proj, not the embedding, which is looked
    up, not a vector): ValueErrors."""
    from kdtree_native import _native

    cfg = config_from_dict(config_dict(KIMI_LIKE))
    m = _native.CpuModel(cfg.to_native(), 16)
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    N, K = expected_weight_shapes(cfg)[name]
    p = np.full((N, K // 2), 0x88, np.uint8)
    s = np.ones((N, K // 32), np.float32)
    m.set_weight_int4(name, p, s, 32)
    with pytest.raises(ValueError, match="packed must be uint8"):
        m.set_weight_int4(name, p.astype(np.int32), s, 32)
    with pytest.raises(ValueError, match="do not fit"):
        m.set_weight_int4(name, p, s[:, :-1], 32)
    with pytest.raises(ValueError, match="has shape"):
        m.set_weight_int4(name, p[:-1], s[:-1], 32)
    with pytest.raises(ValueError, match="do not fit"):
        m.set_weight_int4(name, p, s, 24)
    bad = s.copy()
    bad[2, 0] = np.nan
    with pytest.raises(ValueError, match="scale 2 is not finite"):
        m.set_weight_int4(name, p, bad, 32)
    big = s.copy()
    big[0, 0] = 3e38
    q = p.copy()
    q[0, 0] = 0x80  # the integer -8 in the low nibble
    with pytest.raises(ValueError, match="overflows BF16"):
        m.set_weight_int4(name, q, big, 32)
    m.set_weight_int4(name, p, big, 32)  # only zeros in that group: 0 * 3e38 does not overflow
    Ve, De = expected_weight_shapes(cfg)["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="not a weight matrix the CPU model takes packed"):
        m.set_weight_int4("model.embed_tokens.weight", np.full((Ve, De // 2), 0x88, np.uint8),
                          np.ones((Ve, De // 32), np.float32), 32)
    kvb = "model.layers.0.self_attn.kv_b_proj.weight"
    Nk, Kk = expected_weight_shapes(cfg)[kvb]
    with pytest.raises(ValueError, match="not a weight matrix the CPU model takes packed"):
        m.set_weight_int4(kvb, np.full((Nk, Kk // 2), 0x88, np.uint8), np.ones((Nk, Kk // 8), np.float32), 8)


# ---- the GPU model holds the INT4 experts as 4-bit integers -----------------------------------------

def _bf16_stored(tensors):
    """write_quantized's `extra`: the float tensors (BF16 values here) stored as BF16, as Kimi K2-Thinking
    stores everything but its experts."""
    for k, v in list(tensors.items()):
        if v.dtype == np.float32:
            tensors[k] = to_bf16_bits(v).reshape(v.shape)


# KIMI_LIKE with head dims that are multiples of 8, which a GPU model's bf16_weights="only" needs (KIMI_LIKE's 12 /
# 10 take "copies" there)
KIMI_LIKE8 = dict(KIMI_LIKE, qk_nope_head_dim=16, v_head_dim=16)


@pytest.fixture(scope="module", params=["kimi_like8", "kimi_like"])
def int4_bf16_dir(request, tmp_path_factory):
    """int4_dir's model (and one whose shapes a GPU model holds "only") with its non-expert tensors stored as BF16
    (what makes a GPU model's bf16_weights="only" the default beside INT4 experts, where the shapes allow it)."""
    d = config_dict(KIMI_LIKE8 if request.param == "kimi_like8" else KIMI_LIKE)
    weights = {k: to_bf16(v) for k, v in random_weights(config_from_dict(d), seed=8).items()}
    path = tmp_path_factory.mktemp("int4bf16")
    expect = write_quantized(path, d, KIMI_QC, weights, is_expert, "BF16", extra=_bf16_stored)
    return path, config_from_dict(d), expect


def test_int4_experts_plan_from_headers(int4_dir, int4_bf16_dir, tmp_path):
    """checkpoint.int4_experts_group (what a GPU model's int4_experts_group comes from): the group for the
    Kimi scheme's experts; None for a float checkpoint, another scheme, or an expert left in float.
    matrices_stored_as_bf16(int4_experts=True) asks about the other matrices only."""
    from kdtree_native.checkpoint import int4_experts_group, matrices_stored_as_bf16

    path, _, _ = int4_bf16_dir
    cfg = load_config(path)
    assert int4_experts_group(path, cfg) == 32
    assert matrices_stored_as_bf16(path, cfg, int4_experts=True)
    assert not matrices_stored_as_bf16(path, cfg)  # (a quantized checkpoint, asked about every matrix)
    fpath = int4_dir[0]   # the same with F32 non-expert tensors
    assert int4_experts_group(fpath, load_config(fpath)) == 32
    assert not matrices_stored_as_bf16(fpath, load_config(fpath), int4_experts=True)
    d = config_dict(KIMI_LIKE)
    weights = {k: to_bf16(v) for k, v in random_weights(config_from_dict(d), seed=8).items()}
    write_quantized(tmp_path / "asym", d, qc_with(16, symmetric=False), weights, is_expert, "BF16")
    assert int4_experts_group(tmp_path / "asym", load_config(tmp_path / "asym")) is None
    write_quantized(tmp_path / "f16", d, KIMI_QC, weights, is_expert, "F16")  # F16 scales: dequantized
    assert int4_experts_group(tmp_path / "f16", load_config(tmp_path / "f16")) is None
    write_quantized(tmp_path / "mixed", d, KIMI_QC, weights,
                    lambda n: is_expert(n) and ".experts.1.up_proj" not in n, "BF16")
    assert int4_experts_group(tmp_path / "mixed", load_config(tmp_path / "mixed")) is None
    os.makedirs(tmp_path / "f")
    with open(tmp_path / "f" / "config.json", "w") as f:
        json.dump(d, f)
    write_safetensors(str(tmp_path / "f" / "model.safetensors"), weights)
    assert int4_experts_group(tmp_path / "f", load_config(tmp_path / "f")) is None


def test_cuda_int4_experts_unsupported_names_the_reason():
    """The GPU model's INT4 experts need a power-of-two group >= 32 dividing both expert widths and not the
    SGEMM expert tiles; the reason is named (no device needed)."""
    from kdtree_native import _native

    if not hasattr(_native, "cuda_int4_experts_unsupported"):
        pytest.skip("built without the CUDA model")
    cfg = config_from_dict(config_dict(KIMI_LIKE)).to_native()
    assert _native.cuda_int4_experts_unsupported(cfg, 32) == ""
    assert "power of two" in _native.cuda_int4_experts_unsupported(cfg, 16)
    assert "power of two" in _native.cuda_int4_experts_unsupported(cfg, 48)
    assert "multiples of the group" in _native.cuda_int4_experts_unsupported(cfg, 64)   # moe width 32
    assert "tiled" in _native.cuda_int4_experts_unsupported(cfg, 32, "tiled")


GPU_VARIANTS = [{}, {"expert_kernel": "skinny"}, {"expert_kernel": "mma", "expert_mma_rows": 8},
                {"expert_kernel": "mma", "expert_mma_rows": 16}, {"expert_kernel": "mma", "expert_mma_rows": 64},
                {"graphs": False, "side_stream": False}]


@pytest.mark.cuda
@pytest.mark.parametrize("variant", GPU_VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "auto")
def test_cuda_holds_int4_experts_with_the_same_bits(int4_bf16_dir, variant):
    """from_pretrained on the GPU holds the Kimi scheme's experts as 4-bit integers (int4_weight_bytes: half a
    byte a weight plus a float a group, aligned per stack) beside BF16-only matrices, and its logits are the
    bits of the GPU model on the dequantized weights held as BF16 (a prefill, tree verifies of 1..33 tokens
    after commits, a 300-token prefill) with the tensor-core expert kernel at every tile height; where the
    GEMV-style kernel runs (auto's steps of few tokens, "skinny") within FP32 rounding of them, its INT4 sums
    running in their own lane order (expert_gemv_int4_kernel); the same tokens; DDTree == AR."""
    if not kn.cuda_available():
        pytest.skip("no usable CUDA device")
    from kdtree_native.drafters import NgramDrafter

    from kdtree_native import _native

    path, cfg, _ = int4_bf16_dir
    packed = kn.Engine.from_pretrained(path, device="cuda", max_seq_len=512, cuda_options=variant)
    mode = "copies" if _native.cuda_bf16_only_unsupported(cfg.to_native()) else "only"
    ref = kn.Engine.from_weights(cfg, load_weights(path, load_config(path)), device="cuda", max_seq_len=512,
                                 cuda_options=dict(variant, bf16_weights=mode))
    assert packed.model.int4_experts_group == 32 and packed.model.bf16_weights == mode
    assert ref.model.int4_experts_group == 0 and ref.model.int4_weight_bytes == 0
    assert _int4_bytes(cfg) <= packed.model.int4_weight_bytes <= _int4_bytes(cfg) + 4 * 256 * cfg.num_hidden_layers
    assert packed.model.memory_bytes < ref.model.memory_bytes
    got, want = _outputs(packed, cfg, 300), _outputs(ref, cfg, 300)
    if variant.get("expert_kernel") == "mma":
        _assert_same(got, want, str(variant))
    else:
        _assert_close(got, want, str(variant))
        if "expert_kernel" not in variant:  # auto: the prefills (from a fresh cache) on the tensor cores: same bits
            for i, T in ((0, 30), (len(got) - 1, 300)):
                if T * cfg.num_experts_per_tok >= cfg.n_routed_experts:
                    _assert_same([got[i]], [want[i]], f"{variant} prefill {T}")
    ids = np.array([3, 9, 27, 81, 100, 5, 7])
    ar = packed.generate(ids, 24)
    assert np.array_equal(ar.tokens, ref.generate(ids, 24).tokens)
    assert np.array_equal(packed.generate(ids, 24, drafter=NgramDrafter(), tree_budget=16, depth=6).tokens, ar.tokens)


@pytest.mark.cuda
def test_cuda_int4_experts_refusals_leave_the_model_usable(int4_bf16_dir):
    """A float value for an INT4 expert, pieces in another group size, scales that are not finite: ValueErrors
    naming the tensor, and the model computes as before. int4_experts_group=0 dequantizes the experts instead
    (the same logits but for the INT4 GEMV's summation order); an INT4 piece for a matrix that is not a routed expert is taken dequantized."""
    if not kn.cuda_available():
        pytest.skip("no usable CUDA device")
    path, cfg, _ = int4_bf16_dir
    eng = kn.Engine.from_pretrained(path, device="cuda", max_seq_len=128)
    want = _outputs(eng, cfg)
    name = f"model.layers.{cfg.first_k_dense_replace}.mlp.experts.1.down_proj.weight"
    Nr, K = expected_weight_shapes(cfg)[name]
    with pytest.raises(ValueError, match="held as 4-bit integers"):
        eng.model.set_weight(name, np.zeros((Nr, K), np.float32))
    with pytest.raises(ValueError, match="held as 4-bit integers"):
        eng.model.set_weight_bf16(name, np.zeros((Nr, K), np.uint16))
    p = np.full((Nr, K // 2), 0x88, np.uint8)
    with pytest.raises(ValueError, match="groups of 16.*groups of 32"):
        eng.model.set_weight_int4(name, p, np.ones((Nr, K // 16), np.float32), 16)
    bad = np.ones((Nr, K // 32), np.float32)
    bad[1, 0] = np.inf
    with pytest.raises(ValueError, match="scale 1 is not finite"):
        eng.model.set_weight_int4(name, p, bad, 32)
    _assert_same(_outputs(eng, cfg), want, "after the refusals")
    off = kn.Engine.from_pretrained(path, device="cuda", max_seq_len=128, cuda_options={"int4_experts_group": 0})
    assert off.model.int4_weight_bytes == 0
    _assert_close(_outputs(off, cfg), want, "dequantized")
    # an INT4 piece of a matrix that is not a routed expert: dequantized (bf16_round((q - 8) * scale))
    so = f"model.layers.{cfg.first_k_dense_replace}.mlp.shared_experts.down_proj.weight"
    Ns, Ks = expected_weight_shapes(cfg)[so]
    rng = np.random.default_rng(4)
    ps = rng.integers(0, 256, (Ns, Ks // 2), dtype=np.uint8)
    ss = to_bf16(rng.standard_normal((Ns, Ks // 32)).astype(np.float32) * 0.02)
    eng.model.set_weight_int4(so, ps, ss, 32)
    eng.model.finalize()
    q = np.empty((Ns, Ks), np.int32)
    q[:, 0::2], q[:, 1::2] = ps & 15, ps >> 4
    w = load_weights(path, load_config(path))
    w[so] = to_bf16((q - 8).astype(np.float32) * np.repeat(ss, 32, axis=1))
    ref = kn.Engine.from_weights(cfg, w, device="cuda", max_seq_len=128,
                                 cuda_options={"bf16_weights": eng.model.bf16_weights})
    _assert_close(_outputs(eng, cfg), _outputs(ref, cfg), "a dequantized INT4 piece")
