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


def _ngram_plain(ctx, depth, top_k, max_ngram=4, min_ngram=1, max_matches=32):
    """NgramDrafter's definition written plainly (a dict per depth, one occurrence at a time): the
    last max_matches occurrences of the context's last ng tokens (ng = max_ngram .. min_ngram,
    excluding the suffix itself), what followed each at offsets 1..depth weighted ng, each depth's
    tokens by (-weight, token), log of weight / depth total."""
    ctx = [int(t) for t in ctx]
    n = len(ctx)
    counts = [dict() for _ in range(depth)]
    for ng in range(max_ngram, min_ngram - 1, -1):
        if ng >= n:
            continue
        suffix = ctx[n - ng:]
        hits = [s for s in range(0, n - ng) if ctx[s:s + ng] == suffix][-max_matches:]
        for s in hits:
            for j, t in enumerate(ctx[s + ng:s + ng + depth]):
                counts[j][t] = counts[j].get(t, 0) + ng
    d = 0
    while d < depth and counts[d]:
        d += 1
    if d == 0:
        return None
    k = min(top_k, max(len(c) for c in counts[:d]))
    lp = np.full((d, k), -np.inf, dtype=np.float32)
    ids = np.zeros((d, k), dtype=np.int32)
    for j in range(d):
        total = float(sum(counts[j].values()))
        for r, (tok, c) in enumerate(sorted(counts[j].items(), key=lambda kv: (-kv[1], kv[0]))[:k]):
            lp[j, r] = np.log(c / total)
            ids[j, r] = tok
    return lp, ids


def test_ngram_equals_its_plain_definition():
    """The C++ drafter (NgramDrafter) and the vectorised NumPy reference (kn.reference.ngram_draft)
    against the plain definition above, bit for bit: random and
    repetitive contexts (few distinct tokens: many overlapping matches, ties in the weights),
    every parameter varied, contexts of 1 to 400 tokens."""
    rng = np.random.default_rng(11)
    compared = none = 0
    for trial in range(500):
        V = int(rng.choice([2, 3, 5, 20, 50000]))
        n = int(rng.integers(1, 400))
        ctx = rng.integers(0, V, n).astype(np.int32)
        if trial % 4 == 0:  # a repeated phrase with a few edits
            ctx = np.tile(rng.integers(0, V, int(rng.integers(2, 9))), n)[:n].astype(np.int32)
            ctx[rng.integers(0, n, max(1, n // 20))] = int(rng.integers(0, V))
        depth, top_k = int(rng.integers(1, 17)), int(rng.integers(1, 40))
        mx = int(rng.integers(1, 6))
        mn, mm = int(rng.integers(1, mx + 1)), int(rng.integers(1, 40))
        want = _ngram_plain(ctx, depth, top_k, mx, mn, mm)
        for got in (NgramDrafter(mx, mn, mm).draft(ctx, depth, top_k),  # C++
                    kn.reference.ngram_draft(ctx, depth, top_k, mx, mn, mm)):  # NumPy
            if want is None:
                assert got is None, trial
                continue
            assert got is not None, trial
            assert got[0].dtype == np.float32 and got[1].dtype == np.int32
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), trial
        none += want is None
        compared += want is not None
    assert compared > 300 and none > 10, (compared, none)


def test_ngram_parameters_checked():
    for kwargs, err in (({"max_matches": 0}, ValueError), ({"min_ngram": 0}, ValueError),
                        ({"min_ngram": 3, "max_ngram": 2}, ValueError), ({"max_ngram": 2.5}, TypeError),
                        ({"max_matches": True}, TypeError)):
        with pytest.raises(err):
            NgramDrafter(**kwargs)
    d = NgramDrafter(3, 2, 7)
    assert (d._native.max_ngram, d._native.min_ngram, d._native.max_matches) == (3, 2, 7)
    ctx = np.array([1, 2, 3, 1, 2], np.int32)
    assert d.draft(ctx, 0, 4) is None and d.draft(ctx, 4, 0) is None  # nothing asked for
    assert d.draft(ctx[:1], 4, 4) is None
    with pytest.raises(ValueError, match="1-D"):
        d._native(np.zeros((2, 3), np.int32), 4, 4)
    import copy
    import pickle
    ctx = np.array([5, 1, 2, 3, 1, 2, 4, 1, 2], np.int32)
    for c in (pickle.loads(pickle.dumps(d)), copy.deepcopy(d)):  # the native object is rebuilt
        assert repr(c) == repr(d) == "NgramDrafter(max_ngram=3, min_ngram=2, max_matches=7)"
        assert all(np.array_equal(a, b) for a, b in zip(c.draft(ctx, 3, 4), d.draft(ctx, 3, 4)))


def test_ngram_runs_natively_in_generate():
    """generate() hands NgramDrafter's C++ drafter to the loop (no Python callback per round) and
    gives exactly the tokens and acceptance lengths of the same drafter called through Python; a
    subclass that overrides draft() is called through Python."""
    from kdtree_native import _native
    from kdtree_native.generation import as_draft_fn, generate

    class Logged(NgramDrafter):
        calls = 0

        def draft(self, context, depth, top_k):
            Logged.calls += 1
            return super().draft(context, depth, top_k)

    assert isinstance(as_draft_fn(NgramDrafter()), _native.NgramDraft)
    assert not isinstance(as_draft_fn(Logged()), _native.NgramDraft)
    tgt = toy(32, 512, seed=3)
    rng = np.random.default_rng(4)
    prompt = np.tile(rng.integers(0, 32, 9), 6).astype(np.int32)
    native = generate(tgt, prompt, 60, drafter=NgramDrafter(), tree_budget=12, depth=6)
    python = generate(tgt, prompt, 60, drafter=lambda c, d, k: NgramDrafter().draft(c, d, k), tree_budget=12, depth=6)
    logged = generate(tgt, prompt, 60, drafter=Logged(), tree_budget=12, depth=6)
    ar = generate(tgt, prompt, 60)
    assert np.array_equal(native.tokens, ar.tokens)
    assert np.array_equal(native.tokens, python.tokens) and np.array_equal(native.tokens, logged.tokens)
    assert np.array_equal(native.acceptance_lengths, python.acceptance_lengths)
    assert np.array_equal(native.acceptance_lengths, logged.acceptance_lengths)
    assert Logged.calls == len(logged.acceptance_lengths) - 1 > 0  # one draft per round after the first token
    assert max(native.acceptance_lengths) > 1  # the drafts were used


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


def _engine_pair(max_seq_len=128):
    from hf_models import config_dict, random_weights
    from kdtree_native.config import config_from_dict

    cfg = config_from_dict(config_dict("ds3_base"))
    w = random_weights(cfg, 3)
    return [kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=max_seq_len) for _ in range(2)], cfg


def test_model_drafter_with_truncate_is_linear_and_rolls_back():
    """On a model with truncate (kn.Engine): the chain is decoded one token at a time and its tokens
    stay in the cache (fifty-ninth session), the cache follows the committed context through the
    longest common prefix (accepted chain tokens are not fed again), and the rows equal the greedy
    chain recomputed from scratch."""
    (eng, ref_eng), cfg = _engine_pair()
    V = cfg.vocab_size
    d = ModelDrafter(eng, native=False)  # the Python definition (the Spy below sees its forwards)
    calls = []
    fwd, fwd_last = eng.model.forward, eng.model.forward_last

    class Spy:  # counts the tokens of every forward the drafter makes (the feed's: forward_last)
        def __getattr__(self, name):
            return getattr(eng.model, name)

        def forward(self, tokens, positions, vis=None):
            calls.append(len(tokens))
            return fwd(tokens, positions, vis)

        def forward_last(self, tokens, positions, rows, vis=None):
            calls.append(len(tokens))
            return fwd_last(tokens, positions, rows, vis)

    d.model = Spy()
    ctx = (np.arange(9) * 7 % V).astype(np.int32)
    out = d.draft(ctx, 5, 8)
    assert out.shape == (5, V) and out.dtype == np.float32
    assert calls == [9, 1, 1, 1, 1] and eng.cache_len == len(ctx) + 4   # the context, then the chain's 4 tokens
    seq = list(ctx)
    for j in range(5):
        lg = ref_eng.prefill(np.array(seq, np.int32))[-1]
        assert np.abs(out[j] - lg).max() < 1e-5 * np.abs(lg).max(), j
        seq.append(int(np.argmax(lg)))
    chain = seq[len(ctx):]
    # two tokens the chain did not draft + a new root: those 3 are fed (the chain's entries dropped), then
    # depth - 1 chain steps
    other = [(t + 1) % V for t in chain[:2]]
    calls.clear()
    ctx2 = np.concatenate([ctx, other, [5]]).astype(np.int32)
    d.draft(ctx2, 3, 8)
    assert calls == [3, 1, 1] and eng.cache_len == len(ctx2) + 2
    # the chain's own two first tokens accepted + a new root: only the root is fed
    calls.clear()
    out_a = d.draft(ctx, 4, 8)                                   # back to ctx: its chain drafted again
    chain_a = [int(np.argmax(r)) for r in out_a[:3]]
    calls.clear()
    ctx_acc = np.concatenate([ctx, chain_a[:2], [6]]).astype(np.int32)
    out_acc = d.draft(ctx_acc, 3, 8)
    assert calls == [1, 1, 1] and eng.cache_len == len(ctx_acc) + 2
    lg = ref_eng.prefill(ctx_acc)[-1]
    assert np.abs(out_acc[0] - lg).max() < 1e-5 * np.abs(lg).max()
    # a new generation sharing the first 4 tokens: rolled back to them, not reset
    calls.clear()
    ctx3 = np.concatenate([ctx[:4], [9, 9]]).astype(np.int32)
    out3 = d.draft(ctx3, 2, 8)
    assert calls == [2, 1] and eng.cache_len == len(ctx3) + 1
    lg = ref_eng.prefill(ctx3)[-1]
    assert np.abs(out3[0] - lg).max() < 1e-5 * np.abs(lg).max()
    # the same context again: only the root is re-fed
    calls.clear()
    d.draft(ctx3, 1, 8)
    assert calls == [1] and eng.cache_len == len(ctx3)


def model_draft_walk(native, python, V, max_seq_len, seed, steps=40, depths=(1, 7)):
    """Drives two ModelDrafters (over two copies of one model) through the same contexts, as
    generation would (accepted tokens + a new root, rollbacks to a shorter common prefix, new
    prompts, a context that no longer fits), and checks that they return the same bits."""
    rng = np.random.default_rng(seed)
    ctx = list(rng.integers(0, V, 9))
    drafted = 0
    for step in range(steps):
        depth = int(rng.integers(*depths))
        a = native.draft(np.array(ctx, np.int32), depth, 8)
        b = python.draft(np.array(ctx, np.int32), depth, 8)
        assert (a is None) == (b is None), step
        if a is not None:
            assert a.dtype == np.float32 and a.shape[1] == V and 1 <= a.shape[0] <= depth
            np.testing.assert_array_equal(a, b, err_msg=f"step {step}, n {len(ctx)}, depth {depth}")
            drafted += 1
            # the context, then (CPU models) the chain's tokens, one a row after the first; the GPU drafter and
            # the definition over a CUDA model truncate back to the context
            kept = a.shape[0] - 1 if python._keep_chain else 0
            assert native.model.cache_len == python.model.cache_len == len(ctx) + kept, step
        r = rng.random()
        if r < 0.1 and len(ctx) > 2:  # a rollback: keep a shorter prefix, then new tokens
            ctx = ctx[:int(rng.integers(1, len(ctx)))] + list(rng.integers(0, V, int(rng.integers(1, 4))))
        elif r < 0.15:  # a new prompt
            ctx = list(rng.integers(0, V, int(rng.integers(1, 12))))
        elif len(ctx) + depth + 2 > max_seq_len:
            ctx = list(rng.integers(0, V, max_seq_len + int(rng.integers(0, 2)))) if r < 0.3 else ctx[:5]
        else:  # the chain's first tokens accepted, then a bonus token
            acc = [int(np.argmax(row)) for row in a[:int(rng.integers(0, a.shape[0] + 1))]] if a is not None else []
            ctx = ctx + acc + [int(rng.integers(0, V))]
    return drafted


@pytest.mark.parametrize("mcp", [0.0, 0.3, 0.9])
def test_model_drafter_native_equals_python_definition(mcp):
    """The C++ drafter (_native.ModelDraft, the default over a native model) against the Python
    definition (native=False) over a second copy of the same model: the same rows, bit for bit,
    through growing contexts, rollbacks, new prompts and contexts past max_seq_len."""
    (eng, ref_eng), cfg = _engine_pair(64)
    a = ModelDrafter(eng, min_chain_prob=mcp, prefill_chunk=5)
    b = ModelDrafter(ref_eng, min_chain_prob=mcp, prefill_chunk=5, native=False)
    assert a._native is not None and b._native is None
    assert model_draft_walk(a, b, cfg.vocab_size, 64, seed=int(mcp * 10)) > 20


def test_model_drafter_native_errors_leave_the_engine_usable():
    from hf_models import config_dict, random_weights
    from kdtree_native.config import config_from_dict

    (tgt, drf), cfg = _engine_pair(96)
    V = cfg.vocab_size
    ids = (np.arange(10) * 3 % V).astype(np.int64)
    ar = generate(tgt, ids, 12)
    with pytest.raises(ValueError, match="target model itself"):
        generate(tgt, ids, 12, drafter=ModelDrafter(tgt), tree_budget=8, depth=4)
    with pytest.raises(ValueError, match="target model itself"):  # the Python path too
        generate(tgt, ids, 12, drafter=ModelDrafter(tgt, native=False), tree_budget=8, depth=4)
    d = ModelDrafter(drf)
    with pytest.raises(ValueError, match="outside the draft model's vocab"):
        d.draft(np.array([1, V + 3], np.int32), 3, 4)
    w = random_weights(cfg, 3)
    w["lm_head.weight"] = w["lm_head.weight"].copy()
    w["lm_head.weight"][5] = np.nan  # logit 5 of every row is NaN
    with pytest.raises(ValueError, match=r"'lm_head.weight' holds NaN at flat index"):
        kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=96)
    bad = kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=96, check_finite=False)
    with pytest.raises(ValueError, match="NaN"):
        generate(tgt, ids, 12, drafter=ModelDrafter(bad), tree_budget=8, depth=4)
    np.testing.assert_array_equal(generate(tgt, ids, 12).tokens, ar.tokens)
    np.testing.assert_array_equal(generate(tgt, ids, 12, drafter=d, tree_budget=8, depth=4).tokens, ar.tokens)
    with pytest.raises(ValueError, match="prefill_chunk"):
        ModelDrafter(drf, prefill_chunk=0)
    with pytest.raises(ValueError, match="native model"):
        ModelDrafter(toy(V, 64), native=True)


def test_model_drafter_stops_early_on_low_confidence():
    (eng, _), cfg = _engine_pair()
    ctx = (np.arange(9) * 5 % cfg.vocab_size).astype(np.int32)
    full = ModelDrafter(eng).draft(ctx, 6, 8)
    short = ModelDrafter(eng, min_chain_prob=0.999999).draft(ctx, 6, 8)
    assert full.shape[0] == 6 and 1 <= short.shape[0] < 6
    np.testing.assert_array_equal(short, full[:short.shape[0]])
    assert eng.cache_len == len(ctx)
    with pytest.raises(ValueError, match="min_chain_prob"):
        ModelDrafter(eng, min_chain_prob=1.0)


def test_model_drafter_engine_is_lossless():
    (tgt, drf), cfg = _engine_pair(256)
    ids = (np.arange(12) * 11 % cfg.vocab_size).astype(np.int64)
    ar = generate(tgt, ids, 40)
    for mcp in (0.0, 0.3):
        res = generate(tgt, ids, 40, drafter=ModelDrafter(drf, min_chain_prob=mcp), tree_budget=16, depth=6)
        assert np.array_equal(res.tokens, ar.tokens)
        assert res.stats["mean_acceptance_length"] > 1.5  # same weights: its drafts are right


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


def test_direct_draft_calls_refuse_ids_int32_would_change():
    """NgramDrafter / ModelDrafter .draft() on a context int32 cannot hold (ids past 2**31 - 1,
    negatives, floats): a clear error instead of wrapped ids (2**32 + 5 used to be read as 5)."""
    (eng, _), cfg = _engine_pair()
    good = (np.arange(12) * 5 % cfg.vocab_size).astype(np.int64)
    for d in (NgramDrafter(), ModelDrafter(eng), ModelDrafter(eng, native=False)):
        ref = d.draft(good, 3, 4)
        for bad, err, what in ((np.append(good, 2**32 + 5), ValueError, "4294967301"),
                               (np.append(good, -1), ValueError, "-1"),
                               (good.astype(np.float64), TypeError, "integer token ids")):
            with pytest.raises(err, match=what):
                d.draft(bad, 3, 4)
        again = d.draft(good.astype(np.int32), 3, 4)
        if ref is None:
            assert again is None
        else:
            for a, b in zip(ref if isinstance(ref, tuple) else (ref,), again if isinstance(again, tuple) else (again,)):
                np.testing.assert_array_equal(a, b)
