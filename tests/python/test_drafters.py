"""Built-in drafters (kdtree_native.drafters): OracleDrafter's controlled error rate,
NgramDrafter's real trees, ModelDrafter's greedy chain and incremental cache, and the
top-k + log-softmax helper against the NumPy reference."""
import numpy as np
import pytest

import kdtree_native as kn
from kdtree_native.drafters import ModelDrafter, NgramDrafter, OracleDrafter, topk_logsoftmax
from kdtree_native.generation import generate
from test_engine_loop import PROMPT, toy


def test_oracle_noise_rate_and_ranks():
    ref = np.arange(100, 400) % 97
    for noise in (0.0, 0.3, 0.9):
        o = OracleDrafter(ref, noise=noise, seed=3, vocab_size=97, prompt_len=4)
        wrong_top, present_lower, total = 0, 0, 0
        for g in range(1, 200, 7):
            ctx = np.zeros(4 + g, np.int32)
            lp, ids = o.draft(ctx, 5, 6)
            assert lp.dtype == np.float32 and ids.shape == (5, 6) and (np.diff(lp, axis=1) <= 0).all()
            for j in range(5):
                right = ref[g + j]
                assert len(set(ids[j].tolist())) == 6  # distinct candidates
                total += 1
                if ids[j, 0] != right:
                    wrong_top += 1
                    present_lower += right in ids[j]
        rate = wrong_top / total
        assert abs(rate - noise) < 0.1, (noise, rate)
        if noise:
            assert 0 < present_lower < wrong_top  # ranked lower sometimes, absent sometimes


def test_oracle_runs_out_of_reference():
    o = OracleDrafter([5, 6, 7], vocab_size=10, prompt_len=2)
    lp, ids = o.draft(np.zeros(4, np.int32), 5, 2)  # 2 generated: only ref[2] is left
    assert ids.shape == (1, 2) and ids[0, 0] == 7
    assert o.draft(np.zeros(5, np.int32), 5, 2) is None


def test_ngram_builds_trees_not_chains():
    ctx = np.array([1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 7, 6, 1, 2], np.int32)
    lp, ids = NgramDrafter(max_ngram=3).draft(ctx, 4, 8)
    assert lp.dtype == np.float32 and ids.dtype == np.int32 and lp.shape == ids.shape
    assert set(ids[0][np.isfinite(lp[0])].tolist()) == {3, 4}  # two continuations of "1 2"
    assert ids[0, 0] == 3  # seen twice
    assert (np.diff(lp, axis=1) <= 0).all()
    tree = kn.reference.tree_build(lp, ids, 16)
    assert (np.bincount(tree.depths)[1:] > 1).any()  # several nodes at one depth: a tree
    assert NgramDrafter().draft(np.array([1, 2, 3], np.int32), 4, 4) is None  # no repeat


def test_ngram_respects_top_k_and_depth():
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 5, 300).astype(np.int32)
    lp, ids = NgramDrafter().draft(ctx, 6, 3)
    assert lp.shape[0] <= 6 and lp.shape[1] <= 3


def test_model_drafter_chain_and_incremental_cache():
    V = 40
    dm = toy(V, 256, seed=21)
    d = ModelDrafter(dm)
    ctx = np.array([4, 8, 15, 16, 23, 42 % V], np.int32)
    out = d.draft(ctx, 5, 8)
    assert out.shape == (5, V) and out.dtype == np.float32
    # reference: greedy chain recomputed from scratch with causal forwards
    ref_t = toy(V, 256, seed=21)
    seq = list(ctx)
    for j in range(5):
        ref_t.reset()
        lg = ref_t.forward(np.array(seq, np.int32), np.arange(len(seq), dtype=np.int32), None)[-1]
        assert np.allclose(out[j], lg), j
        seq.append(int(np.argmax(lg)))
    assert dm.cache_len == len(ctx)  # only committed context is cached
    before = dm.forward_tokens
    ctx2 = np.concatenate([ctx, [1, 2]]).astype(np.int32)
    d.draft(ctx2, 3, 8)
    assert dm.cache_len == len(ctx2)
    assert dm.forward_tokens - before == 2 + (1 + 2)  # catch-up of 2 tokens + chain steps 1, 2
    d.draft(np.array([7, 7, 7], np.int32), 2, 8)  # a new generation: reset
    assert dm.cache_len == 3


def test_model_drafter_same_model_accepts_everything():
    """Drafting with a copy of the target itself: the greedy chain is always right."""
    V = 48
    tgt = toy(V, 256, seed=7, scale=8.0)  # peaked: the greedy chain is inside the best-64 tree
    ar = generate(tgt, PROMPT, 1 + 4 * 6)
    res = generate(tgt, PROMPT, 1 + 4 * 6, drafter=ModelDrafter(toy(V, 256, seed=7, scale=8.0)), tree_budget=64,
                   depth=5)
    assert np.array_equal(res.tokens, ar.tokens)
    assert res.stats["mean_acceptance_length"] == 6.0


def test_topk_logsoftmax_matches_reference():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 17)).astype(np.float32)
    x[1, 3] = x[1, 5]  # a tie
    lp, ids = topk_logsoftmax(x, 5)
    rlp, rids = kn.reference.topk_logsoftmax(x, 5)
    assert np.array_equal(ids, np.asarray(rids)) and np.allclose(lp, rlp, atol=1e-6)
