"""The NumPy reference model: parity with HF transformers (eager, fp32) on every PARITY_CONFIG,
incremental decode == prefill, and tree verification == decoding each root-to-node path."""
import numpy as np
import pytest

from hf_models import (PARITY_CONFIGS, cached_checkpoint, config_dict, hf_greedy, hf_logits,
                       random_weights, require_hf)
from kdtree_native.checkpoint import load_weights
from kdtree_native.config import config_from_dict, load_config
from kdtree_native.reference import ReferenceModel, tree_visibility
from kdtree_native.reference.model import moe_route
from tree_cases import path_to


def rel_to_scale(a, b):
    """max |a - b| relative to the logits' scale (max |b|)."""
    return float(np.abs(a - b).max() / np.abs(b).max())


def numpy_model(name, seed=0):
    cfg = config_from_dict(config_dict(name))
    return ReferenceModel(cfg, random_weights(cfg, seed))


def prompt(cfg, n, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n)


# ---- HF parity ------------------------------------------------------------------------------

@pytest.mark.hf
@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_prefill_logits_match_hf(name):
    path = cached_checkpoint(name)
    cfg = load_config(path)
    model = ReferenceModel(cfg, load_weights(path, cfg))
    ids = prompt(cfg, 37, seed=len(name))
    ref = model.forward(ids)
    hf = hf_logits(path, ids)
    assert ref.shape == hf.shape == (37, cfg.vocab_size)
    assert rel_to_scale(ref, hf) < 1e-5
    assert np.abs(hf).max() > 1.0 and hf.std() > 0.5      # logits are not degenerate


@pytest.mark.hf
@pytest.mark.parametrize("name", ["ds3_base", "neox_yarn_groups", "tied_nonorm"])
def test_greedy_continuation_matches_hf(name):
    path = cached_checkpoint(name)
    cfg = load_config(path)
    model = ReferenceModel(cfg, load_weights(path, cfg))
    ids = prompt(cfg, 9, seed=3)
    logits = model.forward(ids)
    ours = []
    for _ in range(24):                                    # incremental decode
        nxt = int(np.argmax(logits[-1]))
        ours.append(nxt)
        logits = model.forward([nxt])
    np.testing.assert_array_equal(ours, hf_greedy(path, ids, 24))


@pytest.mark.hf
def test_router_matches_hf_including_group_masking():
    """Routing (ids and weights) equals HF's DeepseekV3TopkRouter on many random tokens, with
    biases large enough that the masked groups and the selection bias matter."""
    torch, transformers = require_hf()
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    for name in ("neox_yarn_groups", "neox_many_groups", "ds3_base"):
        d = config_dict(name)
        hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
        cfg = config_from_dict(d)
        rng = np.random.default_rng(0)
        router = DeepseekV3TopkRouter(hf_cfg)
        w = rng.standard_normal((cfg.n_routed_experts, cfg.hidden_size)) / np.sqrt(cfg.hidden_size) * 2
        bias = rng.standard_normal(cfg.n_routed_experts) * 0.3 - 0.5   # some biased scores < 0
        with torch.no_grad():
            router.weight.copy_(torch.from_numpy(w))
            router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        x = rng.standard_normal((500, cfg.hidden_size))
        with torch.no_grad():
            _, hw, hi = router(torch.from_numpy(x).float())
        ids, weights = moe_route(cfg, x.astype(np.float32).astype(np.float64), w.astype(np.float32).astype(np.float64),
                                 bias.astype(np.float32).astype(np.float64))
        hi, hw = hi.numpy(), hw.numpy()
        order = np.argsort(hi, axis=1)
        hi, hw = np.take_along_axis(hi, order, 1), np.take_along_axis(hw, order, 1)
        order = np.argsort(ids, axis=1)
        ids, weights = np.take_along_axis(ids, order, 1), np.take_along_axis(weights, order, 1)
        np.testing.assert_array_equal(ids, hi)
        np.testing.assert_allclose(weights, hw, rtol=1e-5)
        if cfg.topk_group < cfg.n_group:
            # the case is sharp: masking dropped groups to 0 instead of -inf changes the choice
            scores = 1 / (1 + np.exp(-(x @ w.T)))
            choice = (scores + bias).reshape(len(x), cfg.n_group, -1)
            top2 = np.sort(choice, -1)[..., -2:].sum(-1)
            kept = np.argsort(-top2, -1)[:, :cfg.topk_group]
            gmask = np.zeros(top2.shape, bool)
            np.put_along_axis(gmask, kept, True, -1)
            zero_fill = np.where(np.repeat(gmask, cfg.experts_per_group, -1), choice.reshape(len(x), -1), 0.0)
            ids0 = np.sort(np.argsort(-zero_fill, -1)[:, :cfg.num_experts_per_tok], 1)
            assert (ids0 != ids).any(axis=1).sum() >= 5


# ---- cache consistency (NumPy only) ----------------------------------------------------------

@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_incremental_decode_equals_prefill(name):
    model = numpy_model(name)
    ids = prompt(model.cfg, 20, seed=1)
    full = model.forward(ids)
    model.reset()
    parts = [model.forward(ids[:7])]                      # chunked prefill, then decode
    parts.append(model.forward(ids[7:12]))
    for t in ids[12:]:
        parts.append(model.forward([t]))
    assert model.cache_len == 20
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=1e-10 * np.abs(full).max())


@pytest.mark.parametrize("name", ["ds3_base", "neox_yarn_groups", "no_q_lora"])
def test_absorbed_attention_model_equals_plain(name):
    cfg = config_from_dict(config_dict(name))
    w = random_weights(cfg, seed=6)
    plain, absorbed = ReferenceModel(cfg, w), ReferenceModel(cfg, w, absorbed=True)
    rng = np.random.default_rng(1)
    ids = prompt(cfg, 13, seed=2)
    a, b = plain.forward(ids), absorbed.forward(ids)
    tokens, _, depths, vis = random_tree(rng, 9, cfg.vocab_size)
    a2, b2 = plain.forward(tokens, 13 + depths, vis), absorbed.forward(tokens, 13 + depths, vis)
    for x, y in ((a, b), (a2, b2)):
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-11 * np.abs(x).max())


def random_tree(rng, T, vocab):
    """A random tree of T nodes (node 0 = root): tokens, parents, depths, ancestor visibility."""
    parents = np.full(T, -1)
    depths = np.zeros(T, dtype=np.int64)
    for j in range(1, T):
        parents[j] = rng.integers(0, j)
        depths[j] = depths[parents[j]] + 1
    return rng.integers(0, vocab, T), parents, depths, tree_visibility(parents)


@pytest.mark.parametrize("name", ["ds3_base", "neox_yarn_groups", "no_q_lora", "kimi_like"])
def test_tree_logits_equal_path_decoding(name):
    """Every tree node's logits == the logits of decoding its root-to-node path one token at a
    time after the same context; after compaction to a path, the next decode == plain AR."""
    model = numpy_model(name, seed=2)
    cfg = model.cfg
    rng = np.random.default_rng(len(name))
    context = prompt(cfg, 11, seed=4)
    L = len(context)
    tokens, parents, depths, vis = random_tree(rng, 17, cfg.vocab_size)

    model.forward(context)
    tree_logits = model.forward(tokens, L + depths, vis)
    scale = np.abs(tree_logits).max()

    for node in range(len(tokens)):
        model.reset()
        model.forward(context)
        for n in path_to(parents, node):
            logits = model.forward([tokens[n]])[0]
        np.testing.assert_allclose(tree_logits[node], logits, rtol=0, atol=1e-10 * scale)

    # accept the path to the deepest node, compact, and decode one more token
    leaf = int(np.argmax(depths))
    path = path_to(parents, leaf)
    model.reset()
    model.forward(context)
    model.forward(tokens, L + depths, vis)
    model.compact(path)
    assert model.cache_len == L + len(path)
    nxt = int(rng.integers(0, cfg.vocab_size))
    after_tree = model.forward([nxt])

    model.reset()
    ar = model.forward(np.concatenate([context, tokens[path], [nxt]]))[-1:]
    np.testing.assert_allclose(after_tree, ar, rtol=0, atol=1e-10 * np.abs(ar).max())


def test_forward_input_checks():
    model = numpy_model("ds3_base")
    with pytest.raises(ValueError, match="token ids"):
        model.forward([model.cfg.vocab_size])
    with pytest.raises(ValueError, match="positions"):
        model.forward([1, 2], [0])
    with pytest.raises(ValueError, match="visibility"):
        model.forward([1, 2], [0, 1], np.ones((3, 3), bool))
    model.forward([1, 2, 3])
    with pytest.raises(ValueError, match="compact"):
        model.compact([3])
    model.compact([0, 2])
    assert model.cache_len == 2
