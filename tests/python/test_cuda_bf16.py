"""BF16 weight copies on the GPU (CudaModel bf16_weight_copies, docs/CUDA_MODEL.md): a weight matrix
whose every value is exactly a BF16 also lives on the device as BF16, and the kernels of the
steps up to 48 tokens (linear_skinny, linear_tile, the expert GEMV and tensor-core kernels) read
that copy and widen it. Widening is exact and the arithmetic is the FP32 path's, so every result
must be the same bits as with the FP32 weights:
* the kernels on host arrays, bf16_weights on and off, equal bit for bit: every linear_skinny
  configuration and prologue (batched, at an offset); linear_tile's tile heights and k splits;
  the expert GEMV and tensor-core kernels with and without SwiGLU;
* the model on BF16-rounded weights, copies on and off: equal logits and caches, eager and
  graph-replayed, over decode, tree and 17-65-token steps; the copies cover exactly the weight
  matrices; float32 weights get none;
* set_weight with non-BF16 values after graphs were captured: the copy is dropped for that
  matrix (and the graphs that used it), results still equal the copy-less model's; and back.
Skipped without a usable CUDA device."""
import numpy as np
import pytest

import kdtree_native as kn

if not kn.cuda_available():
    pytest.skip("no usable CUDA device", allow_module_level=True)

from kdtree_native import _native as N  # noqa: E402
from kdtree_native.config import config_from_dict  # noqa: E402

from hf_models import config_dict, random_weights, to_bf16  # noqa: E402
from test_cuda_model import load, prefill, prompt, spec  # noqa: E402

pytestmark = pytest.mark.cuda


def test_to_bf16_is_exact_and_close():
    a = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    b = to_bf16(a)
    assert not (b.view(np.uint32) & 0xFFFF).any()
    assert np.abs(b - a).max() <= np.abs(a).max() * 2.0 ** -8


# ---- kernels on host arrays --------------------------------------------------------------------

@pytest.mark.parametrize("config", range(1, len(N.cuda_linear_skinny_configs()) + 1))
@pytest.mark.parametrize("prologue", ["none", "norm", "swiglu"])
def test_linear_skinny_bf16_weights_same_bits(config, prologue):
    rw, tt, u = N.cuda_linear_skinny_configs()[config - 1]
    if prologue == "norm" and tt > 4:
        pytest.skip("the RMSNorm prologue needs a configuration of <= 4 tokens")
    rng = np.random.default_rng(config * 7 + len(prologue))
    Kd, Nn, batch = 320, 37, 2  # k tail (320 = 2.5 x 128), a partial row group, two batches at an offset
    for T in sorted({1, min(tt, 3), tt, tt + 1}):
        if prologue == "norm" and T > 4:
            continue
        kx = 2 * Kd if prologue == "swiglu" else Kd
        x = rng.standard_normal((batch * T, kx)).astype(np.float32)
        w_off, w_batch = 8, Nn * Kd
        w = to_bf16(rng.standard_normal((1, w_off + batch * w_batch)).astype(np.float32) * 0.1)
        y = np.full((batch * T, Nn), np.nan, np.float32)
        kw = dict(batch=batch if prologue != "norm" else 1, x_batch=T * kx, w_batch=w_batch, y_batch=T * Nn,
                  w_off=w_off, config=config, x_swiglu=prologue == "swiglu")
        if prologue == "norm":
            kw["norm_w"] = (1 + 0.1 * rng.standard_normal(Kd)).astype(np.float32)
        a = N.cuda_linear_skinny(x, w, y, T, Nn, Kd, **kw)
        b = N.cuda_linear_skinny(x, w, y, T, Nn, Kd, bf16_weights=True, **kw)
        rows = kw["batch"] * T
        assert np.isfinite(a[:rows]).all()
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"T={T}"


@pytest.mark.parametrize("T", [1, 7, 16, 21, 33, 64, 65, 72])
@pytest.mark.parametrize("splits", [0, 1, 3])
def test_linear_tile_bf16_weights_same_bits(T, splits):
    """linear_tile (tensor cores) on the BF16 copy: two mma per product instead of three, the
    FP32 path's bits; every tile height (8..72 tokens), k splits over a cluster, two batches at an
    offset, Kd = 320 (a partial k chunk), a partial weight-row tile (N = 100)."""
    rng = np.random.default_rng(T * 10 + splits)
    Kd, Nn, batch, w_off = 320, 100, 2, 8
    x = rng.standard_normal((batch * T, Kd)).astype(np.float32)
    w = to_bf16(rng.standard_normal((1, w_off + batch * Nn * Kd)).astype(np.float32) * 0.1)
    y = np.full((batch * T, Nn), np.nan, np.float32)
    kw = dict(batch=batch, x_batch=T * Kd, w_batch=Nn * Kd, y_batch=T * Nn, w_off=w_off, kernel="tile", splits=splits)
    a = N.cuda_linear_skinny(x, w, y, T, Nn, Kd, **kw)
    b = N.cuda_linear_skinny(x, w, y, T, Nn, Kd, bf16_weights=True, **kw)
    assert np.isfinite(a).all()
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("T", [9, 17, 24])
def test_linear_tile_bf16_weights_same_bits_large_matrix(T):
    """The same on a matrix past kLinearTileSmallBytes (33.6 MB as FP32), which runs more warps per row
    group (KH = 4 for 16-row tiles, 2 for 24): the BF16 copy gives the FP32 path's bits there too."""
    rng = np.random.default_rng(900 + T)
    Kd, Nn = 1024, 8200
    x = rng.standard_normal((T, Kd)).astype(np.float32)
    w = to_bf16(rng.standard_normal((1, Nn * Kd)).astype(np.float32) * 0.1)
    y = np.full((T, Nn), np.nan, np.float32)
    a = N.cuda_linear_skinny(x, w, y, T, Nn, Kd, kernel="tile")
    b = N.cuda_linear_skinny(x, w, y, T, Nn, Kd, bf16_weights=True, kernel="tile")
    assert np.isfinite(a).all()
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_linear_skinny_bf16_weights_rejects_inexact_values():
    x = np.ones((1, 128), np.float32)
    w = np.full((1, 128 * 4), 0.1, np.float32)  # 0.1 is not a BF16
    with pytest.raises(ValueError, match="BF16"):
        N.cuda_linear_skinny(x, w, np.zeros((1, 4), np.float32), 1, 4, 128, bf16_weights=True)


@pytest.mark.parametrize("kernel,tile_rows", [("gemv", 8), ("mma", 8), ("mma", 16), ("mma", 32), ("mma", 64)])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("T,K,E", [(1, 4, 16), (3, 2, 8), (9, 6, 64), (40, 8, 16)])
def test_expert_kernels_bf16_weights_same_bits(kernel, tile_rows, swiglu, T, K, E):
    """The GEMV kernel and the tensor-core one (tiles of 8-64 slots; 2 mma per product with BF16
    weights instead of 3) on the BF16 copy: the FP32 path's bits. Kd = 264: a partial k chunk."""
    rng = np.random.default_rng(T * 100 + K + swiglu + tile_rows)
    Kd, Nn = 264, 36
    x = rng.standard_normal((T, Kd)).astype(np.float32)
    w = to_bf16(rng.standard_normal((E, 2 * Nn if swiglu else Nn, Kd)).astype(np.float32) * 0.1)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    a, sa = N.cuda_expert_gemm(x, w, idx, E, swiglu, tile_rows, kernel)
    b, sb = N.cuda_expert_gemm(x, w, idx, E, swiglu, tile_rows, kernel, bf16_weights=True)
    assert np.isfinite(a).all()
    assert np.array_equal(sa, sb)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---- the model ---------------------------------------------------------------------------------

MODEL_NAMES = ["ds3_base", "kimi_like", "no_q_lora", "tied_nonorm", "mla512", "odd_sizes"]


def bf16_weights(cfg, seed=0):
    return {k: to_bf16(v.astype(np.float32)) for k, v in random_weights(cfg, seed).items()}


def matrix_elements(weights):
    return sum(v.size for v in weights.values() if v.ndim >= 2)


def run_steps(models, V, torch=None):
    """The same steps on every model (decode, trees, the skinny step sizes; eager, then with torch
    graph-replayed): every model's logits, step by step."""
    outs = [[] for _ in models]
    for m in models:
        prefill(m, prompt(V, 30, seed=51))
    for T in (1, 2, 4, 5, 9, 17, 20, 33, 65):
        toks = prompt(V, T, seed=60 + T)
        vis = np.tril(np.ones((T, T), dtype=bool))
        if T >= 3:
            vis[T - 1, 1: T - 1] = False
        for i, m in enumerate(models):
            outs[i].append(m.forward(toks, m.cache_len + np.arange(T), vis))
            m.commit([0])
    if torch is not None:
        dev = torch.device("cuda")
        for T in (1, 4, 17):
            bufs = [(torch.empty(T, dtype=torch.int32, device=dev), torch.empty(T, dtype=torch.int32, device=dev),
                     torch.empty((T, V), device=dev)) for _ in models]
            for rep in range(3):  # the second and third calls replay a captured graph
                toks = prompt(V, T, seed=80 + 3 * T + rep)
                for i, m in enumerate(models):
                    t_tok, t_pos, t_out = bufs[i]
                    t_tok.copy_(torch.as_tensor(toks.astype(np.int32)))
                    t_pos.copy_(torch.as_tensor((m.cache_len + np.arange(T)).astype(np.int32)))
                    torch.cuda.synchronize()
                    m.forward_ptr(t_tok.data_ptr(), t_pos.data_ptr(), 0, 0, T, t_out.data_ptr())
                    torch.cuda.synchronize()
                    outs[i].append(t_out.cpu().numpy().copy())
                    m.commit([0])
    return outs


def maybe_torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_with_bf16_copies_gives_the_same_bits(name):
    cfg = config_from_dict(config_dict(spec(name)))
    w = bf16_weights(cfg)
    off = load(N.CudaModel(cfg.to_native(), 200, bf16_weight_copies=False), w)
    on = load(N.CudaModel(cfg.to_native(), 200), w)
    assert off.bf16_weight_bytes == 0 and off.bf16_weight_elements == 0
    assert on.bf16_weight_elements == matrix_elements(w)
    assert on.bf16_weight_bytes >= 2 * on.bf16_weight_elements
    assert on.memory_bytes == off.memory_bytes + on.bf16_weight_bytes
    torch = maybe_torch()
    a, b = run_steps([off, on], cfg.vocab_size, torch)
    for i, (x, y) in enumerate(zip(a, b)):
        assert np.isfinite(x).all()
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), f"step {i}"
    if torch is not None:
        assert on.graph_replays >= 3
    n = off.cache_len
    assert on.cache_len == n
    for layer in range(cfg.num_hidden_layers):
        assert np.array_equal(off.read_cache(layer, 0, n), on.read_cache(layer, 0, n)), f"layer {layer}"


def test_float32_weights_get_no_copies():
    cfg = config_from_dict(config_dict("kimi_like"))
    w = {k: v.astype(np.float32) for k, v in random_weights(cfg, 0).items()}
    m = load(N.CudaModel(cfg.to_native(), 64), w)
    assert m.bf16_weight_bytes == 0 and m.bf16_weight_elements == 0


def test_copies_follow_set_weight():
    """A matrix set to non-BF16 values after graphs were captured loses its copy (the graphs that
    read it are dropped); the results stay those of the copy-less model; back to BF16 values, the
    copy returns."""
    cfg = config_from_dict(config_dict(spec("mla512")))
    w = bf16_weights(cfg)
    off = load(N.CudaModel(cfg.to_native(), 300, bf16_weight_copies=False), w)
    on = load(N.CudaModel(cfg.to_native(), 300), w)
    torch = maybe_torch()
    full = on.bf16_weight_elements
    name = "model.layers.1.self_attn.o_proj.weight"
    fp32 = w[name] + np.float32(1e-3) * np.random.default_rng(1).standard_normal(w[name].shape).astype(np.float32)
    assert (fp32.view(np.uint32) & 0xFFFF).any()
    for values, expect in ((fp32, full - w[name].size), (w[name], full)):
        a, b = run_steps([off, on], cfg.vocab_size, torch)  # graphs captured with the current copies
        assert all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b))
        for m in (off, on):
            m.set_weight(name, values)
            m.finalize()
        assert on.bf16_weight_elements == expect
        a, b = run_steps([off, on], cfg.vocab_size, torch)
        for i, (x, y) in enumerate(zip(a, b)):
            assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), f"step {i}"


def test_engine_passes_the_option():
    """Engine(cuda_options={'bf16_weight_copies': False}) reaches the GPU model before finalize:
    no copies; the default makes them; the prefill logits are the same bits."""
    cfg = config_from_dict(config_dict("kimi_like"))
    w = bf16_weights(cfg)
    on = kn.Engine.from_weights(cfg, w, device="cuda", max_seq_len=32)
    off = kn.Engine.from_weights(cfg, w, device="cuda", max_seq_len=32, cuda_options={"bf16_weight_copies": False})
    assert on.model.bf16_weight_bytes > 0 and off.model.bf16_weight_bytes == 0
    ids = np.arange(9) * 5 % cfg.vocab_size
    np.testing.assert_array_equal(on.prefill(ids), off.prefill(ids))
