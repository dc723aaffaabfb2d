"""Row-exact steps on the GPU (CudaModel row_exact, docs/CUDA_MODEL.md "Row-exact steps").

By default a GPU tree node's logits agree with the one-token AR step at its position to ~1e-6 of their
scale, not bit for bit (a step's size picks its kernels), so DDTree on the GPU can emit another token than
AR in a near tie (the sixty-second session's device fuzz: 13 of 8811 cases, one of them greedy). With
row_exact=True every step of up to CudaModelOptions::kRowExactMaxT tokens runs kernels whose outputs for a
token row depend on that row alone. On a CUDA device (marker cuda; skipped without one):
* verify_attention(exact=True): each query row's output is the bits of a one-token call over its own
  visible keys laid out contiguously (the committed rows, its ancestors, itself), on the fast shapes
  (C = 512, R = 64) and others, and within float64's bounds;
* the model: every tree node's logits and the committed path's cache rows are the bits of the AR steps
  along its path (random trees of 5-260 nodes on random models, one with the fast attention shapes, and on
  the embedded default with its BF16 weights), and still within the 1e-4 parity of the CPU model;
* DDTree == AR token for token with seeded sampling and greedy, on the embedded default.

Everywhere the GPU model is built: a config whose sizes linear_tile cannot take is refused at construction.
"""
import numpy as np
import pytest

import kdtree_native as kn
from kdtree_native import _native
from kdtree_native.config import config_from_dict

from hf_models import config_dict, random_weights
from test_cuda_model import vis_bits
from tree_cases import ddtree_vs_ar_mismatches, path_to, random_tree, tree_rows_against_ar_steps

HAS_MODEL = hasattr(_native, "CudaModel")
DEVICE_OK = HAS_MODEL and bool(_native.cuda_available()[0])
needs_device = pytest.mark.skipif(not DEVICE_OK, reason="no CUDA device (or the GPU model is not built)")


def on_device(f):
    return pytest.mark.cuda(needs_device(f))


# the fast attention kernels' shapes (C = 512, R = 64) with mini-kimi's 16 heads; experts the tensor-core kernel takes
MLA512 = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, num_attention_heads=16,
              num_key_value_heads=16, hidden_size=64, q_lora_rank=48, vocab_size=300, max_position_embeddings=2048)


def attention_f64(ql, qr, kv, vis, L, scale):
    T, H, C = ql.shape
    out = np.zeros((T, H, C))
    for t in range(T):
        keys = list(range(L)) + [L + j for j in range(T) if vis[t, j]]
        k = kv[keys].astype(np.float64)
        s = (np.einsum("hc,kc->hk", ql[t].astype(np.float64), k[:, :C]) +
             np.einsum("hr,kr->hk", qr[t].astype(np.float64), k[:, C:])) * scale
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[t] = (p / p.sum(axis=1, keepdims=True)) @ k[:, :C]
    return out


@on_device
@pytest.mark.parametrize("H,C,R,L,T,split", [(16, 512, 64, 300, 17, 0), (16, 512, 64, 1, 40, 0),
                                             (4, 128, 32, 700, 25, 0), (20, 128, 32, 100, 30, 64),
                                             (3, 18, 6, 90, 12, 0), (16, 512, 64, 5000, 9, 0),
                                             (16, 512, 64, 600, 33, 256)])
def test_exact_attention_rows_are_one_token_calls(H, C, R, L, T, split):
    """Each row of a tree's exact attention = the one-token call over that node's keys alone (contiguous),
    bit for bit, and within float64's bound: the blocked kernel (one split or many, a partial head group past
    16 heads, other split lengths) and the rows kernel's exact form (C = 18: shapes the blocked one refuses)."""
    rng = np.random.default_rng(H * 1000 + T)
    parents, depths, vis = random_tree(T, seed=7 + T)
    ql = rng.standard_normal((T, H, C)).astype(np.float32)
    qr = rng.standard_normal((T, H, R)).astype(np.float32)
    kv = rng.standard_normal((L + T, C + R)).astype(np.float32)
    scale = float(1.0 / np.sqrt(C + R)) * 3.0  # peaked enough that rounding shows
    got = _native.cuda_verify_attention(ql, qr, kv, vis_bits(vis), scale, exact=True, exact_split=split)
    ref = attention_f64(ql, qr, kv, vis, L, scale)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    for i in range(T):
        path = path_to(parents, i)  # its ancestors in depth order, then itself
        rows = np.concatenate([kv[:L], kv[L + np.asarray(path)]])
        one = _native.cuda_verify_attention(ql[i:i + 1], qr[i:i + 1], rows, np.ones((1, 1), np.uint64), scale,
                                            exact=True, exact_split=split)
        assert np.array_equal(got[i], one[0]), (i, np.abs(got[i] - one[0]).max())


def _engine(spec, seed=0, max_seq_len=512, **opts):
    cfg = config_from_dict(config_dict(spec))
    w = random_weights(cfg, seed)
    return kn.Engine.from_weights(cfg, w, device="cuda", max_seq_len=max_seq_len, cuda_options=opts), cfg, w


def _prompt(V, n, seed):
    return np.random.default_rng(seed).integers(0, V, n).astype(np.int32)


@on_device
@pytest.mark.parametrize("spec,cases", [
    ("kimi_like", ((5, 9), (12, 14), (37, 21))),
    (MLA512, ((3, 17), (60, 33), (200, 65))),
    (dict(MLA512, base="neox_yarn_groups"), ((1, 5), (40, 17))),
])
def test_row_exact_tree_rows_are_the_ar_steps_bits(spec, cases):
    """row_exact: a tree node's logits and the committed path's cache rows are the bits of the one-token
    AR steps along its path, and the logits stay within the parity bound of the CPU model."""
    eng, cfg, w = _engine(spec, row_exact=True)
    cpu = kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=512)
    V = cfg.vocab_size
    for k, (L, n) in enumerate(cases):
        parents, depths, vis = random_tree(n, seed=80 + k)
        prefix, toks = _prompt(V, L, 90 + k), _prompt(V, n, 100 + k)
        differ, same_cache = tree_rows_against_ar_steps(eng, prefix, toks, parents, depths, vis)
        assert differ == [] and same_cache, (k, L, n, differ, same_cache)
        eng.prefill(prefix)
        cpu.prefill(prefix)
        a = eng.forward(toks, L + depths, vis)
        b = cpu.forward(toks, L + depths, vis)
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max(), (k, L, n)


def _embedded(**opts):
    try:
        return kn.Engine.from_pretrained(kn.default_model_dir(), device="cuda", max_seq_len=2048, cuda_options=opts)
    except FileNotFoundError:
        pytest.skip("the embedded default models are not installed")


@on_device
def test_row_exact_embedded_tree_rows():
    """The embedded default (BF16 weights: the tile kernels read their BF16 copies) at several contexts, trees
    of up to 260 nodes (past 256, still under kRowExactMaxT)."""
    eng = _embedded(row_exact=True)
    V = eng.vocab_size
    for k, (L, n) in enumerate(((1, 6), (61, 17), (300, 40), (1500, 20), (5, 150), (300, 260))):
        parents, depths, vis = random_tree(n, seed=40 + k)
        differ, same_cache = tree_rows_against_ar_steps(eng, _prompt(V, L, 50 + k), _prompt(V, n, 60 + k),
                                                         parents, depths, vis)
        assert differ == [] and same_cache, (k, L, n, differ, same_cache)


@on_device
def test_row_exact_ddtree_equals_ar_on_the_embedded_model():
    """DDTree emits AR's tokens with row_exact, greedy and seeded sampling, every built-in drafter kind,
    fixed and adaptive budgets, on the device round."""
    eng = _embedded(row_exact=True)
    draft = kn.Engine.from_pretrained(kn.default_draft_dir(), device="cuda", max_seq_len=2048)
    text = kn.models.heldout_sample()[3]["text"]
    ids = np.array([ord(c) % eng.vocab_size for c in text[:300]], dtype=np.int32)
    assert ddtree_vs_ar_mismatches(eng, draft, ids, ((0, 0.0, 1.0), (1, 1.0, 1.0), (2, 0.7, 0.9))) == []


@pytest.mark.skipif(not HAS_MODEL, reason="the GPU model is not built")
def test_row_exact_refuses_sizes_linear_tile_cannot_take():
    """Checked before any device is looked for: runs wherever the GPU model is built (CI too)."""
    odd = dict(hidden_size=42, moe_intermediate_size=21, intermediate_size=37, q_lora_rank=20, kv_lora_rank=18,
               qk_nope_head_dim=6, qk_rope_head_dim=6, v_head_dim=7, vocab_size=157, n_routed_experts=6, n_group=3,
               topk_group=2, num_experts_per_tok=3)
    cfg = config_from_dict(config_dict(odd))
    with pytest.raises(ValueError, match="row_exact needs these sizes to be multiples of 4.*hidden_size = 42"):
        _native.CudaModel(cfg.to_native(), 64, row_exact=True)
    if DEVICE_OK:
        _native.CudaModel(cfg.to_native(), 64)  # (the default kernels take it)
