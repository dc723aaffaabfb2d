"""Checkpoint loading: single file and shards, F32 zero-copy, BF16/F16 -> F32 exactly, MTP and
K2.5 prefixes, and clear errors for missing / unexpected / mis-shaped tensors and damaged files."""
import json
import os
import struct

import numpy as np
import pytest

from hf_models import cached_checkpoint, config_dict, random_weights, require_hf, to_bf16_bits
from kdtree_native import checkpoint as ckpt
from kdtree_native.checkpoint import expected_weight_shapes, load_weights
from kdtree_native.config import config_from_dict

CFG_NAME = "no_q_lora"   # 3 layers, 2 dense + 1 MoE, direct q_proj, 2 shared experts


def write_safetensors(path, tensors, metadata=None):
    """Minimal safetensors writer: tensors {name: ndarray (f32/f16/u2-as-BF16) or (dtype, shape, bytes)}."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        if isinstance(t, tuple):
            dtype, shape, data = t
        else:
            dtype = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("uint16"): "BF16",
                     np.dtype("float64"): "F64", np.dtype("int32"): "I32"}[t.dtype]
            shape, data = list(t.shape), np.ascontiguousarray(t).astype(t.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path


@pytest.fixture(scope="module")
def cfg():
    return config_from_dict(config_dict(CFG_NAME))


@pytest.fixture(scope="module")
def weights(cfg):
    return {k: v.astype(np.float32) for k, v in random_weights(cfg, seed=5).items()}


def save_model(dirpath, cfg_dict, tensors, shards=1):
    os.makedirs(dirpath, exist_ok=True)
    with open(os.path.join(dirpath, "config.json"), "w") as f:
        json.dump(cfg_dict, f)
    names = list(tensors)
    if shards == 1:
        write_safetensors(os.path.join(dirpath, "model.safetensors"), tensors)
        return dirpath
    weight_map = {}
    for s in range(shards):
        fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        write_safetensors(os.path.join(dirpath, fn), part)
        weight_map.update({n: fn for n in part})
    with open(os.path.join(dirpath, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return dirpath


def test_expected_names_and_shapes(cfg):
    shapes = expected_weight_shapes(cfg)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (2 * 20, 48)
    assert "model.layers.0.self_attn.q_a_proj.weight" not in shapes
    assert shapes["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"] == (16 + 8, 48)
    assert shapes["model.layers.2.self_attn.kv_b_proj.weight"] == (2 * (12 + 10), 16)
    assert shapes["model.layers.2.self_attn.o_proj.weight"] == (48, 2 * 10)
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (80, 48)          # dense (layer < 2)
    assert shapes["model.layers.2.mlp.experts.7.down_proj.weight"] == (48, 24)
    assert shapes["model.layers.2.mlp.gate.weight"] == (8, 48)
    assert shapes["model.layers.2.mlp.gate.e_score_correction_bias"] == (8,)
    assert shapes["model.layers.2.mlp.shared_experts.up_proj.weight"] == (48, 48)   # 2 shared x 24
    assert shapes["lm_head.weight"] == (160, 48)
    tied = config_from_dict(config_dict("tied_nonorm"))
    assert "lm_head.weight" not in expected_weight_shapes(tied)
    assert not any("shared_experts" in n for n in expected_weight_shapes(tied))


@pytest.mark.parametrize("shards", [1, 3])
def test_f32_round_trip_zero_copy(tmp_path, cfg, weights, shards):
    d = save_model(str(tmp_path / "m"), config_dict(CFG_NAME), weights, shards=shards)
    seen = []
    out = load_weights(d, cfg, progress=lambda i, n: seen.append((i, n)))
    assert set(out) == set(weights)
    for n, w in weights.items():
        assert out[n].dtype == np.float32 and out[n].shape == w.shape
        np.testing.assert_array_equal(out[n], w)
        assert not out[n].flags.writeable and not out[n].flags.owndata      # a view of the map
    assert seen[-1] == (len(weights), len(weights)) and len(seen) == len(weights)


def test_each_tensor_read_once(tmp_path, cfg, weights, monkeypatch):
    d = save_model(str(tmp_path / "m"), config_dict(CFG_NAME), weights, shards=2)
    calls = []
    orig = ckpt.SafetensorsFile.raw
    monkeypatch.setattr(ckpt.SafetensorsFile, "raw", lambda self, name: calls.append(name) or orig(self, name))
    load_weights(d, cfg)
    assert sorted(calls) == sorted(weights)


def test_bf16_f16_f64_converted_exactly(tmp_path, cfg, weights):
    names = list(weights)
    tensors, expect = {}, {}
    for i, n in enumerate(names):
        kind = i % 4
        if kind == 0:
            bits = to_bf16_bits(weights[n])
            tensors[n] = bits
            expect[n] = (bits.astype(np.uint32) << 16).view(np.float32)
        elif kind == 1:
            h = weights[n].astype(np.float16)
            tensors[n] = h
            expect[n] = h.astype(np.float32)
        elif kind == 2:
            tensors[n] = weights[n].astype(np.float64)
            expect[n] = weights[n]
        else:
            tensors[n] = weights[n]
            expect[n] = weights[n]
    d = save_model(str(tmp_path / "m"), config_dict(CFG_NAME), tensors)
    out = load_weights(d, cfg)
    for n in names:
        assert out[n].dtype == np.float32
        np.testing.assert_array_equal(out[n], expect[n])
    # bf16 widening is exact on special values too
    special = np.array([0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, 3.0e38, 1e-40], dtype=np.float32)
    bits = to_bf16_bits(special)
    np.testing.assert_array_equal(ckpt._to_float(bits, "BF16", np.float32),
                                  (bits.astype(np.uint32) << 16).view(np.float32))
    # float64 output on request
    out64 = load_weights(d, cfg, dtype=np.float64)
    assert all(v.dtype == np.float64 for v in out64.values())


def test_mtp_layer_and_tied_head_and_empty_shared_ignored(tmp_path, weights, cfg):
    extra = dict(weights)
    extra["model.layers.3.self_attn.kv_b_proj.weight"] = np.zeros((4, 4), np.float32)   # MTP layer
    extra["model.layers.3.eh_proj.weight"] = np.zeros((4, 4), np.float32)
    d = save_model(str(tmp_path / "mtp"), config_dict(CFG_NAME), extra)
    assert set(load_weights(d, cfg)) == set(weights)

    tcfg = config_from_dict(config_dict("tied_nonorm"))
    tw = {k: v.astype(np.float32) for k, v in random_weights(tcfg).items()}
    tw["lm_head.weight"] = tw["model.embed_tokens.weight"].copy()                        # tied: ignored
    tw["model.layers.1.mlp.shared_experts.gate_proj.weight"] = np.zeros((0, 48), np.float32)
    d = save_model(str(tmp_path / "tied"), config_dict("tied_nonorm"), tw)
    out = load_weights(d, tcfg)
    assert "lm_head.weight" not in out and not any("shared_experts" in n for n in out)


def test_kimi_k25_prefix(tmp_path, cfg, weights):
    text = config_dict(CFG_NAME)
    top = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "text_config": text}
    kcfg = config_from_dict(top)
    tensors = {"language_model." + n: w for n, w in weights.items()}
    tensors["vision_tower.patch_embed.weight"] = np.zeros((3, 3), np.float32)
    tensors["mm_projector.proj.0.weight"] = np.zeros((2, 2), np.float32)
    d = save_model(str(tmp_path / "k25"), top, tensors)
    out = load_weights(d, kcfg)
    assert set(out) == set(weights)


def test_missing_unexpected_misshaped_listed_together(tmp_path, cfg, weights):
    bad = dict(weights)
    del bad["model.layers.2.mlp.experts.3.up_proj.weight"]
    del bad["model.norm.weight"]
    bad["model.layers.0.self_attn.q_a_proj.weight"] = np.zeros((4, 48), np.float32)
    bad["model.layers.1.self_attn.o_proj.weight"] = np.zeros((48, 21), np.float32)
    d = save_model(str(tmp_path / "m"), config_dict(CFG_NAME), bad, shards=2)
    with pytest.raises(ValueError) as e:
        load_weights(d, cfg)
    msg = str(e.value)
    for needle in ("missing (2)", "model.layers.2.mlp.experts.3.up_proj.weight", "model.norm.weight",
                   "unexpected (1)", "model.layers.0.self_attn.q_a_proj.weight",
                   "mis-shaped (1)", "model.layers.1.self_attn.o_proj.weight: shape [48, 21], expected [48, 20]"):
        assert needle in msg, (needle, msg)


def test_integer_tensor_refused(tmp_path, cfg, weights):
    bad = dict(weights)
    bad["model.norm.weight"] = np.zeros(48, np.int32)
    d = save_model(str(tmp_path / "m"), config_dict(CFG_NAME), bad)
    with pytest.raises(ValueError, match="dtype I32"):
        load_weights(d, cfg)


def _one_file(tmp_path, cfg, weights):
    d = save_model(str(tmp_path / "m"), config_dict(CFG_NAME), weights)
    return d, os.path.join(d, "model.safetensors")


def test_truncated_file(tmp_path, cfg, weights):
    d, f = _one_file(tmp_path, cfg, weights)
    data = open(f, "rb").read()
    for cut in (len(data) - 1, len(data) // 2, 20, 7, 0):
        open(f, "wb").write(data[:cut])
        with pytest.raises(ValueError, match="model.safetensors.*truncated"):
            load_weights(d, cfg)


def test_bad_header(tmp_path, cfg, weights):
    d, f = _one_file(tmp_path, cfg, weights)
    data = bytearray(open(f, "rb").read())
    (n,) = struct.unpack("<Q", data[:8])
    # not JSON
    broken = bytearray(data)
    broken[8:12] = b"}}}}"
    open(f, "wb").write(broken)
    with pytest.raises(ValueError, match="model.safetensors: bad safetensors header: not valid JSON"):
        load_weights(d, cfg)
    # an absurd header length
    open(f, "wb").write(struct.pack("<Q", 1 << 60) + data[8:])
    with pytest.raises(ValueError, match="model.safetensors: bad safetensors header"):
        load_weights(d, cfg)
    # JSON but not an object
    write_raw_header(f, b"[1, 2, 3]", b"")
    with pytest.raises(ValueError, match="not a JSON object"):
        load_weights(d, cfg)


def write_raw_header(path, header_bytes, payload):
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header_bytes)) + header_bytes + payload)


@pytest.mark.parametrize("entry,match", [
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4096]}, "ends at byte"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 4]}, "data_offsets"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}, "data_offsets"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "needs 12 bytes"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}, "shape"),
    ({"dtype": "F8_E5M2", "shape": [2], "data_offsets": [0, 2]}, "unsupported dtype"),
    ({"dtype": "F32", "shape": [2]}, "lacks"),
])
def test_bad_entries(tmp_path, cfg, entry, match):
    d = str(tmp_path / "m")
    os.makedirs(d)
    json.dump(config_dict(CFG_NAME), open(os.path.join(d, "config.json"), "w"))
    f = os.path.join(d, "model.safetensors")
    write_raw_header(f, json.dumps({"model.norm.weight": entry}).encode(), b"\0" * 16)
    with pytest.raises(ValueError, match=match) as e:
        load_weights(d, cfg)
    assert "model.safetensors" in str(e.value)


def test_bad_index(tmp_path, cfg, weights):
    d = save_model(str(tmp_path / "m"), config_dict(CFG_NAME), weights, shards=2)
    os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match="shard 'model-00002-of-00002.safetensors' is missing"):
        load_weights(d, cfg)
    open(os.path.join(d, "model.safetensors.index.json"), "w").write("{")
    with pytest.raises(ValueError, match="bad index file"):
        load_weights(d, cfg)
    with pytest.raises(FileNotFoundError):
        load_weights(str(tmp_path), cfg)


# ---- checkpoints written by transformers --------------------------------------------------

@pytest.mark.hf
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_hf_save_pretrained_loads(dtype):
    torch, _ = require_hf()
    safe_open = pytest.importorskip("safetensors").safe_open

    path = cached_checkpoint("ds3_base", seed=1, dtype=dtype)
    cfg = config_from_dict(config_dict("ds3_base"))
    out = load_weights(path, cfg)
    assert set(out) == set(expected_weight_shapes(cfg))
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for n in out:
            np.testing.assert_array_equal(out[n], f.get_tensor(n).to(torch.float32).numpy())


@pytest.mark.parametrize("shards", [1, 3])
def test_matrices_stored_as_bf16(tmp_path, cfg, weights, shards):
    """What from_pretrained on CUDA reads to hold a checkpoint's matrices as BF16 alone: every 2-D tensor the
    model takes stored as BF16 (the embedding and the vectors may be anything); one F32 matrix, an F16 one,
    or a quantized checkpoint: no."""
    bf = {k: to_bf16_bits(v) if v.ndim >= 2 else v for k, v in weights.items()}
    d = save_model(str(tmp_path / "a"), config_dict(CFG_NAME), bf, shards=shards)
    assert ckpt.matrices_stored_as_bf16(d, cfg)
    bf["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"]  # F32 embedding: still yes
    d = save_model(str(tmp_path / "b"), config_dict(CFG_NAME), bf, shards=shards)
    assert ckpt.matrices_stored_as_bf16(d, cfg)
    for name, arr in (("model.layers.2.mlp.experts.1.up_proj.weight", None),
                      ("model.layers.0.self_attn.kv_b_proj.weight", "f16")):
        odd = dict(bf)
        odd[name] = weights[name].astype(np.float16) if arr == "f16" else weights[name]
        d = save_model(str(tmp_path / name), config_dict(CFG_NAME), odd, shards=shards)
        assert not ckpt.matrices_stored_as_bf16(d, cfg), name
    d = save_model(str(tmp_path / "all32"), config_dict(CFG_NAME), weights, shards=shards)
    assert not ckpt.matrices_stored_as_bf16(d, cfg)


def test_matrices_not_bf16_names_them(tmp_path, cfg, weights):
    """matrices_not_bf16 (a CUDA model's fp32_matrices under bf16_weights="only"): exactly the 2-D tensors the
    model takes that are not stored as BF16 (the embedding among them), in the model's order; vectors never."""
    bf = {k: to_bf16_bits(v) if v.ndim >= 2 else v for k, v in weights.items()}
    bf["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"]
    odd = ["model.embed_tokens.weight", "model.layers.2.mlp.gate.weight",
           "model.layers.2.mlp.experts.0.down_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight"]
    for name in odd:
        bf[name] = weights[name] if "kv_b" not in name else weights[name].astype(np.float16)
    d = save_model(str(tmp_path / "a"), config_dict(CFG_NAME), bf)
    order = list(ckpt.expected_weight_shapes(cfg))
    assert ckpt.matrices_not_bf16(d, cfg) == sorted(odd, key=order.index)
    assert ckpt.matrices_not_bf16(d, cfg, int4_experts=True) == sorted(odd[:2] + odd[3:], key=order.index)
    assert not ckpt.matrices_stored_as_bf16(d, cfg)
    bf = {k: to_bf16_bits(v) if v.ndim >= 2 else v for k, v in weights.items()}
    bf["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"]
    d = save_model(str(tmp_path / "c"), config_dict(CFG_NAME), bf)
    assert ckpt.matrices_not_bf16(d, cfg) == ["model.embed_tokens.weight"] and ckpt.matrices_stored_as_bf16(d, cfg)
    d = save_model(str(tmp_path / "b"), config_dict(CFG_NAME), weights)
    assert len(ckpt.matrices_not_bf16(d, cfg)) == sum(1 for s in ckpt.expected_weight_shapes(cfg).values() if len(s) == 2)


def test_cuda_matrix_blocks(cfg):
    """The GPU model's storage blocks of HF matrix names (what fp32_matrices holds FP32 whole), host logic only:
    the router and the shared expert's gate / up share a block, each expert stack is one block per layer and
    projection kind, kv_b_proj one block, the embedding its own; vectors and unknown names have none."""
    from kdtree_native import _native

    if not hasattr(_native, "cuda_matrix_block"):
        pytest.skip("built without the CUDA model")
    c = cfg.to_native()
    blocks = {n: _native.cuda_matrix_block(c, n) for n, s in ckpt.expected_weight_shapes(cfg).items()}
    moe = cfg.first_k_dense_replace
    p = f"model.layers.{moe}."
    assert blocks[p + "mlp.gate.weight"] == f"{moe}.router"
    if cfg.n_shared_experts:
        assert blocks[p + "mlp.shared_experts.gate_proj.weight"] == blocks[p + "mlp.shared_experts.up_proj.weight"] \
            == f"{moe}.router"
        assert blocks[p + "mlp.shared_experts.down_proj.weight"] == f"{moe}.shared_down"
    assert {blocks[p + f"mlp.experts.{e}.gate_proj.weight"] for e in range(cfg.n_routed_experts)} \
        | {blocks[p + f"mlp.experts.{e}.up_proj.weight"] for e in range(cfg.n_routed_experts)} == {f"{moe}.experts_gate_up"}
    assert {blocks[p + f"mlp.experts.{e}.down_proj.weight"] for e in range(cfg.n_routed_experts)} == {f"{moe}.experts_down"}
    assert blocks["model.layers.0.self_attn.kv_b_proj.weight"] == "0.kv_b"
    assert blocks["model.layers.0.self_attn.o_proj.weight"] == "0.o_proj"
    assert blocks["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == "0.qkv_a"
    if moe > 0:
        assert blocks["model.layers.0.mlp.gate_proj.weight"] == blocks["model.layers.0.mlp.up_proj.weight"] == "0.mlp_gate_up"
        assert blocks["model.layers.0.mlp.down_proj.weight"] == "0.mlp_down"
    assert blocks["model.embed_tokens.weight"] == "embed"
    for n, s in ckpt.expected_weight_shapes(cfg).items():
        assert (blocks[n] == "") == (len(s) != 2), n
    assert _native.cuda_matrix_block(c, "model.layers.99.mlp.gate.weight") == ""
    assert _native.cuda_matrix_block(c, "lm_head.weight") == ("" if cfg.tie_word_embeddings else "lm_head")
