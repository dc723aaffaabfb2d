"""BF16 weights held alone on the GPU (CudaModel bf16_weights="only", docs/CUDA_MODEL.md "BF16
weights"): every weight matrix lives on the device as BF16 only; its FP32 addresses are a reserved
range with no memory behind it, so a kernel that read one would fault (and fail these tests). The
few-token kernels read the BF16 form as they read the copies of bf16_weights="copies"; the cuBLAS
products (prefill) widen it into a workspace first, block by block. The values are the same, so:
* logits and caches equal "copies" bit for bit: decode, trees, 2-65-token steps, eager and graph
  replays, a 300-token prefill (cuBLAS, also with tiny widening blocks), on several configs;
* the device holds 2 bytes a matrix weight, the embedding's included (and the FP32 vectors);
* a matrix value that is not exactly BF16 is refused with a clear error, the model stays usable;
  set_weight_bf16 gives what set_weight gives; shapes the BF16 kernels cannot take are refused
  at construction, with the reason (and cuda_bf16_only_unsupported says the same);
* Engine.from_pretrained(cuda_options={"bf16_weights": "only"}) on a BF16 checkpoint: the same
  tokens as "copies", DDTree == AR.
Skipped without a usable CUDA device."""
import numpy as np
import pytest

import kdtree_native as kn

if not kn.cuda_available():
    pytest.skip("no usable CUDA device", allow_module_level=True)

from kdtree_native import _native as N  # noqa: E402
from kdtree_native.config import config_from_dict  # noqa: E402

from hf_models import config_dict, random_weights, to_bf16  # noqa: E402
from test_cuda_bf16 import matrix_elements, maybe_torch, run_steps  # noqa: E402
from test_cuda_model import load, prefill, prompt  # noqa: E402

pytestmark = pytest.mark.cuda

# every size a multiple of 8 (what the BF16 kernels take whole)
DIMS8 = dict(qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16, qk_rope_head_dim=8)
CONFIGS = {
    "ds3_8": dict(DIMS8),
    "kimi_8": dict(DIMS8, num_attention_heads=4, num_key_value_heads=4, n_group=1, topk_group=1, n_routed_experts=16,
                   num_experts_per_tok=4, routed_scaling_factor=2.827),
    "no_q_lora_8": dict(DIMS8, q_lora_rank=None, num_hidden_layers=3, first_k_dense_replace=2, n_shared_experts=2),
    "tied_8": dict(DIMS8, tie_word_embeddings=True, norm_topk_prob=False, n_shared_experts=0, n_group=1,
                   topk_group=1),
    "mla512": dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, num_attention_heads=4,
                   num_key_value_heads=4, hidden_size=64, q_lora_rank=48, vocab_size=300,
                   max_position_embeddings=2048),
}


def cfg_of(name):
    return config_from_dict(config_dict(CONFIGS[name]))


def bf16_weights(cfg, seed=0):
    return {k: to_bf16(v.astype(np.float32)) for k, v in random_weights(cfg, seed).items()}


def bits_equal(a, b):
    return np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_only_gives_the_bits_of_copies(name):
    cfg = cfg_of(name)
    w = bf16_weights(cfg)
    copies = load(N.CudaModel(cfg.to_native(), 400), w)
    only = load(N.CudaModel(cfg.to_native(), 400, bf16_weights="only"), w)
    assert copies.bf16_weights == "copies" and only.bf16_weights == "only"
    # the memory: the matrices (the embedding's too) as BF16 alone; FP32 for the vectors only
    mats = matrix_elements(w)
    assert copies.weight_bytes - only.weight_bytes >= 4 * mats
    assert mats <= only.bf16_weight_elements <= mats + 128 * len(w)
    assert only.bf16_weight_bytes <= (copies.weight_bytes - only.weight_bytes) // 2 + 256
    # (the workspaces grow by the widening room: at most the largest matrix here)
    assert only.memory_bytes - only.workspace_bytes <= copies.memory_bytes - copies.workspace_bytes - 4 * mats
    # a 300-token prefill: the products past linear_tile's range run on cuBLAS from widened weights
    ids = prompt(cfg.vocab_size, 300, seed=3)
    a, b = prefill(copies, ids), prefill(only, ids)
    assert np.isfinite(a).all()
    assert bits_equal(a, b)
    n = copies.cache_len
    for layer in range(cfg.num_hidden_layers):
        assert bits_equal(copies.read_cache(layer, 0, n), only.read_cache(layer, 0, n)), f"layer {layer}"
    torch = maybe_torch()
    x, y = run_steps([copies, only], cfg.vocab_size, torch)
    for i, (u, v) in enumerate(zip(x, y)):
        assert np.isfinite(u).all()
        assert bits_equal(u, v), f"step {i}"
    if torch is not None:
        assert only.graph_replays >= 3


@pytest.mark.parametrize("widen", [1, 1000, 4096])
def test_cublas_products_in_small_widening_blocks(widen):
    """bf16_widen_elements caps how many weights one widening holds: a cuBLAS product of a larger
    matrix runs over blocks of its rows (1: the smallest room the constructor allows, one row of the
    largest inner size), each block its own cuBLAS call, whose kernel may sum in another order: within
    float rounding of the one-call product; greedy tokens the same. Products that take no widening
    (linear_tile, 120 tokens) stay the same bits."""
    cfg = cfg_of("kimi_8")
    w = bf16_weights(cfg, seed=1)
    copies = load(N.CudaModel(cfg.to_native(), 300), w)
    only = load(N.CudaModel(cfg.to_native(), 300, bf16_weights="only", bf16_widen_elements=widen), w)
    ids = prompt(cfg.vocab_size, 270, seed=270)  # cuBLAS past 264 tokens
    a, b = prefill(copies, ids), prefill(only, ids)
    assert np.isfinite(b).all()
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    assert np.array_equal(a.argmax(-1), b.argmax(-1))
    ids = prompt(cfg.vocab_size, 120, seed=120)
    assert bits_equal(prefill(copies, ids), prefill(only, ids))


def test_cublas_only_options():
    """skinny_max_tokens = tile_max_tokens = 0: every product on cuBLAS, from widened weights."""
    cfg = cfg_of("ds3_8")
    w = bf16_weights(cfg, seed=2)
    opts = dict(skinny_max_tokens=0, tile_max_tokens=0)
    copies = load(N.CudaModel(cfg.to_native(), 64, **opts), w)
    only = load(N.CudaModel(cfg.to_native(), 64, bf16_weights="only", **opts), w)
    for T in (1, 5, 17):
        ids = prompt(cfg.vocab_size, T, seed=T)
        assert bits_equal(prefill(copies, ids), prefill(only, ids))


def test_inexact_value_refused_and_model_usable():
    cfg = cfg_of("ds3_8")
    w = bf16_weights(cfg, seed=3)
    ref = load(N.CudaModel(cfg.to_native(), 64), w)
    only = load(N.CudaModel(cfg.to_native(), 64, bf16_weights="only"), w)
    ids = prompt(cfg.vocab_size, 9, seed=4)
    want = prefill(ref, ids)
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight",
                 "model.layers.1.mlp.experts.3.down_proj.weight", "model.embed_tokens.weight"):
        bad = w[name].copy()
        bad.flat[7] = np.float32(1.0 + 2.0 ** -20)  # not a BF16
        with pytest.raises(ValueError, match="not exactly BF16.*flat index 7.*copies"):
            only.set_weight(name, bad)
    only.finalize()
    assert bits_equal(prefill(only, ids), want)  # the refused values never reached the model
    # the vectors stay FP32: any value is taken; so is the embedding's with fp32_matrices naming it
    name = "model.layers.1.post_attention_layernorm.weight"
    vec = w[name] + np.float32(1e-3)
    emb = w["model.embed_tokens.weight"] + np.float32(1e-3)
    emb32 = load(N.CudaModel(cfg.to_native(), 64, bf16_weights="only", fp32_matrices=["model.embed_tokens.weight"]), w)
    for m in (only, ref, emb32):
        m.set_weight(name, vec)
        if m is not only:
            m.set_weight("model.embed_tokens.weight", emb)
        m.finalize()
    want = prefill(ref, ids)
    assert bits_equal(prefill(emb32, ids), want)
    ref.set_weight("model.embed_tokens.weight", w["model.embed_tokens.weight"])
    ref.finalize()
    assert bits_equal(prefill(only, ids), prefill(ref, ids))


def test_set_weight_bf16_same_as_set_weight():
    cfg = cfg_of("kimi_8")
    w = bf16_weights(cfg, seed=5)
    ids = prompt(cfg.vocab_size, 40, seed=6)
    for mode in ("only", "copies", "off"):
        a = load(N.CudaModel(cfg.to_native(), 64, bf16_weights=mode), w)
        b = N.CudaModel(cfg.to_native(), 64, bf16_weights=mode)
        for name, arr in w.items():
            b.set_weight_bf16(name, (np.ascontiguousarray(arr, np.float32).view(np.uint32) >> 16).astype(np.uint16))
        b.finalize()
        assert b.bf16_weights == mode
        assert bits_equal(prefill(a, ids), prefill(b, ids)), mode
    with pytest.raises(ValueError, match="uint16"):
        b.set_weight_bf16("model.norm.weight", w["model.norm.weight"])
    name = "model.layers.0.self_attn.o_proj.weight"
    nan = np.full(w[name].shape, 0x7FC0, np.uint16)
    with pytest.raises(ValueError, match="NaN"):
        b.set_weight_bf16(name, nan)
    with pytest.raises(ValueError, match="shape"):
        b.set_weight_bf16(name, np.zeros((w[name].shape[0], 8), np.uint16))
    b.finalize()  # (nothing refused reached the model)
    assert bits_equal(prefill(a, ids), prefill(b, ids))


def test_unsupported_shapes_and_options_refused():
    odd = config_from_dict(config_dict("ds3_base"))  # qk_nope_head_dim 12, v_head_dim 10
    why = N.cuda_bf16_only_unsupported(odd.to_native())
    assert "qk_nope_head_dim" in why and "multiple of 8" in why
    with pytest.raises(ValueError, match="qk_nope_head_dim to be a multiple of 8"):
        N.CudaModel(odd.to_native(), 32, bf16_weights="only")
    cfg = cfg_of("ds3_8")
    assert N.cuda_bf16_only_unsupported(cfg.to_native()) == ""
    with pytest.raises(ValueError, match="tile_tensor_cores"):
        N.CudaModel(cfg.to_native(), 32, bf16_weights="only", tile_tensor_cores=False)
    with pytest.raises(ValueError, match="tiled"):
        N.CudaModel(cfg.to_native(), 32, bf16_weights="only", expert_kernel="tiled")
    with pytest.raises(ValueError, match="contradicts"):
        N.CudaModel(cfg.to_native(), 32, bf16_weights="only", bf16_weight_copies=False)
    with pytest.raises(ValueError, match="bf16_weights"):
        N.CudaModel(cfg.to_native(), 32, bf16_weights="half")
    with pytest.raises(ValueError, match="bf16_widen_elements"):
        N.CudaModel(cfg.to_native(), 32, bf16_weights="only", bf16_widen_elements=-1)
    assert N.CudaModel(cfg.to_native(), 32, bf16_weight_copies=False).bf16_weights == "off"
    assert N.CudaModel(cfg.to_native(), 32, bf16_weights="off").bf16_weights == "off"


def test_engine_from_pretrained_only(tmp_path):
    """A BF16 checkpoint through from_pretrained: held as BF16 alone by default (the tensors go over as
    bits), "copies" when asked; the same greedy tokens, DDTree == AR. An FP32 checkpoint: "copies"."""
    pytest.importorskip("transformers")
    from hf_models import make_checkpoint
    from kdtree_native.drafters import NgramDrafter

    cfg_d = config_dict(CONFIGS["kimi_8"])
    make_checkpoint(str(tmp_path / "bf"), CONFIGS["kimi_8"], seed=7, dtype="bfloat16")
    make_checkpoint(str(tmp_path / "f32"), CONFIGS["kimi_8"], seed=7, dtype="float32")
    copies = kn.Engine.from_pretrained(str(tmp_path / "bf"), device="cuda", max_seq_len=128,
                                       cuda_options={"bf16_weights": "copies"})
    only = kn.Engine.from_pretrained(str(tmp_path / "bf"), device="cuda", max_seq_len=128)
    assert copies.model.bf16_weights == "copies" and only.model.bf16_weights == "only"
    assert only.model.weight_bytes < copies.model.weight_bytes / 2
    f32 = kn.Engine.from_pretrained(str(tmp_path / "f32"), device="cuda", max_seq_len=128)
    assert f32.model.bf16_weights == "copies" and f32.model.bf16_weight_bytes == 0
    ids = prompt(cfg_d["vocab_size"], 20, seed=8)
    ar = copies.generate(ids, 24).tokens
    assert np.array_equal(only.generate(ids, 24).tokens, ar)
    assert np.array_equal(only.generate(ids, 24, drafter=NgramDrafter(), tree_budget=16).tokens, ar)


def _fp32_pieces(cfg, w, seed=5):
    """A router, one routed expert's down projection (its whole stack goes FP32) and a kv_b_proj given values that
    are not BF16 (what a checkpoint storing them as F32 holds); returns their names."""
    moe = cfg.first_k_dense_replace
    names = [f"model.layers.{moe}.mlp.gate.weight", f"model.layers.{moe}.mlp.experts.3.down_proj.weight",
             "model.layers.0.self_attn.kv_b_proj.weight"]
    rng = np.random.default_rng(seed)
    for n in names:
        w[n] = (w[n] + rng.standard_normal(w[n].shape) * 1e-3).astype(np.float32)
    return names


@pytest.mark.parametrize("name", ["kimi_8", "no_q_lora_8"])
def test_fp32_matrices_beside_bf16_only(name):
    """bf16_weights="only" with fp32_matrices: the named matrices (their storage blocks) held as FP32, every other
    matrix as BF16 alone; the logits are the bits of "copies" on the same weights (a 300-token prefill, steps of
    2-65 tokens, graph replays); without fp32_matrices those values are refused; bad names refused."""
    cfg = cfg_of(name)
    w = bf16_weights(cfg)
    names = _fp32_pieces(cfg, w)
    copies = load(N.CudaModel(cfg.to_native(), 400), w)
    only = load(N.CudaModel(cfg.to_native(), 400, bf16_weights="only", fp32_matrices=names), w)
    plain = N.CudaModel(cfg.to_native(), 400, bf16_weights="only")
    assert only.bf16_weights == "only"
    blocks = {N.cuda_matrix_block(cfg.to_native(), n) for n in names}
    held32 = sum(a.size for n, a in w.items() if N.cuda_matrix_block(cfg.to_native(), n) in blocks)
    assert only.weight_bytes - plain.weight_bytes >= 4 * held32
    assert only.bf16_weight_bytes <= plain.bf16_weight_bytes - 2 * held32 + 256
    ids = prompt(cfg.vocab_size, 300, seed=3)
    assert bits_equal(prefill(copies, ids), prefill(only, ids))
    torch = maybe_torch()
    x, y = run_steps([copies, only], cfg.vocab_size, torch)
    for i, (u, v) in enumerate(zip(x, y)):
        assert np.isfinite(u).all() and bits_equal(u, v), f"step {i}"
    with pytest.raises(ValueError, match="not exactly BF16"):
        load(plain, w)
    # every matrix named: nothing left to hold as BF16 (no empty BF16 range to reserve), the bits of "copies"
    every = [n for n, a in w.items() if a.ndim == 2]
    none16 = load(N.CudaModel(cfg.to_native(), 400, bf16_weights="only", fp32_matrices=every), w)
    assert none16.bf16_weight_bytes == 0 and none16.weight_bytes >= 4 * sum(w[n].size for n in every)
    assert bits_equal(prefill(copies, ids), prefill(none16, ids))
    with pytest.raises(ValueError, match="not a weight matrix of this config"):
        N.CudaModel(cfg.to_native(), 64, bf16_weights="only", fp32_matrices=["model.layers.0.input_layernorm.weight"])
    with pytest.raises(ValueError, match="not a weight matrix of this config"):
        N.CudaModel(cfg.to_native(), 64, bf16_weights="only", fp32_matrices=["model.layers.99.mlp.gate.weight"])
    with pytest.raises(ValueError, match="goes with bf16_weights='only'"):
        N.CudaModel(cfg.to_native(), 64, fp32_matrices=names[:1])


def test_engine_from_pretrained_only_with_f32_routers(tmp_path):
    """A checkpoint storing its matrices as BF16 but its routers (and one kv_b_proj) as F32, as the embedded
    default model does: from_pretrained holds it "only" with those as FP32 (fp32_matrices from the headers), and
    gives the tokens of "copies"; DDTree == AR."""
    from hf_models import to_bf16_bits
    from kdtree_native.drafters import NgramDrafter
    from test_checkpoint import save_model

    cfg = cfg_of("kimi_8")
    w = bf16_weights(cfg, seed=2)
    names = _fp32_pieces(cfg, w)
    names.pop(1)  # (an expert stored F32 would make its stack FP32: fine, but keep the routers' case plain)
    w[f"model.layers.{cfg.first_k_dense_replace}.mlp.experts.3.down_proj.weight"] = to_bf16(
        w[f"model.layers.{cfg.first_k_dense_replace}.mlp.experts.3.down_proj.weight"])
    stored = {n: (a if n in names or a.ndim < 2 else to_bf16_bits(a).reshape(a.shape)) for n, a in w.items()}
    d = save_model(str(tmp_path / "m"), config_dict(CONFIGS["kimi_8"]), stored)
    only = kn.Engine.from_pretrained(d, device="cuda", max_seq_len=128)
    copies = kn.Engine.from_pretrained(d, device="cuda", max_seq_len=128, cuda_options={"bf16_weights": "copies"})
    assert only.model.bf16_weights == "only" and copies.model.bf16_weights == "copies"
    assert only.model.memory_bytes < copies.model.memory_bytes
    ids = prompt(cfg.vocab_size, 20, seed=8)
    assert bits_equal(only.prefill(ids), copies.prefill(ids))
    ar = copies.generate(ids, 24).tokens
    assert np.array_equal(only.generate(ids, 24).tokens, ar)
    assert np.array_equal(only.generate(ids, 24, drafter=NgramDrafter(), tree_budget=16).tokens, ar)
