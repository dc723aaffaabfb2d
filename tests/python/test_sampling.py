"""Sampling at T > 0 (cpp/engine/sampler.h): DDTree's output distribution equals the target's
(and AR's). Frequency test: the first 3 generated tokens over thousands of seeds on the toy
target, against the exact distribution enumerated from the target's logits, with a chi-square
test at p < 1e-3 (critical value from the Wilson-Hilferty approximation); a control shows the
same test rejects a wrong distribution. Plus: same seed -> same tokens (AR == DDTree, coupled),
top_p / target_top_k filtering applied identically in AR and DDTree.
"""
import itertools
import math

import numpy as np
import pytest

from kdtree_native import _native
from kdtree_native.drafters import NgramDrafter, OracleDrafter
from kdtree_native.generation import generate
from test_engine_loop import PROMPT, random_logits_drafter, toy

V, TEMP, N_SEEDS = 4, 0.9, 3000
P3 = np.array([1, 3, 0, 2, 1], dtype=np.int64)


def _filtered(logits, temp, top_k=0, top_p=1.0):
    """The sampler's distribution (sampler.h): top-k by logit, softmax(l / T), nucleus."""
    l = np.asarray(logits, np.float64)
    order = np.lexsort((np.arange(len(l)), -l))  # logit desc, id asc
    if top_k:
        order = order[:top_k]
    w = np.exp((l[order] - l[order].max()) / temp)
    if top_p < 1.0:
        c = np.cumsum(w)
        m = int(np.searchsorted(c, top_p * c[-1] - 1e-12)) + 1
        order, w = order[:m], w[:m]
    p = np.zeros(len(l))
    p[order] = w / w.sum()
    return p


def exact_first3(tgt_seed, scale, temp, top_k=0, top_p=1.0):
    """p(t1, t2, t3) for every triple, from fresh causal forwards of the toy target."""
    out = {}
    t = toy(V, 64, seed=tgt_seed, scale=scale)

    def dist(seq):
        t.reset()
        lg = t.forward(np.asarray(seq, np.int32), np.arange(len(seq), dtype=np.int32), None)
        return _filtered(lg[-1], temp, top_k, top_p)

    p1 = dist(P3)
    for a in range(V):
        p2 = dist(list(P3) + [a])
        for b in range(V):
            p3 = dist(list(P3) + [a, b])
            for c in range(V):
                out[(a, b, c)] = p1[a] * p2[b] * p3[c]
    return out


def chi2_critical(df, p=1e-3):
    z = {1e-3: 3.090232, 1e-4: 3.719016}[p]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts, probs, n):
    """Chi-square statistic and dof, bins with expected < 5 pooled."""
    stat, df, pool_o, pool_e = 0.0, 0, 0.0, 0.0
    for key, p in probs.items():
        e, o = p * n, counts.get(key, 0)
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        df += 1
    return stat, df - 1


def sample_counts(drafter_factory, temp, budget, depth, top_k=0, top_p=1.0, n=N_SEEDS, tgt_seed=5, scale=0.7):
    t = toy(V, 64, seed=tgt_seed, scale=scale)
    counts = {}
    for s in range(n):
        r = generate(t, P3, 3, drafter=drafter_factory() if drafter_factory else None, tree_budget=budget,
                     depth=depth, temperature=temp, seed=1000 + s, target_top_k=top_k or None, top_p=top_p)
        key = tuple(int(x) for x in r.tokens)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("mode", ["ar", "ddtree_logits", "ddtree_ngram"])
def test_first3_distribution_matches_exact(mode):
    exact = exact_first3(5, 0.7, TEMP)
    assert min(exact.values()) < 0.01 < max(exact.values()) < 0.5  # a non-degenerate target
    if mode == "ar":
        counts = sample_counts(None, TEMP, 0, 1)
    elif mode == "ddtree_logits":
        rng_seed = iter(range(10**6))
        counts = sample_counts(lambda: random_logits_drafter(V, next(rng_seed)), TEMP, 16, 3)
    else:
        counts = sample_counts(NgramDrafter, TEMP, 8, 2)
    stat, df = chi2(counts, exact, N_SEEDS)
    assert stat < chi2_critical(df), (mode, stat, df, chi2_critical(df))
    tv = 0.5 * sum(abs(counts.get(k, 0) / N_SEEDS - p) for k, p in exact.items())
    assert tv < 0.08, tv


def test_chi2_rejects_a_wrong_distribution():
    """Control: the same samples against the distribution at another temperature must fail."""
    counts = sample_counts(None, TEMP, 0, 1)
    wrong = exact_first3(5, 0.7, 1.6)
    stat, df = chi2(counts, wrong, N_SEEDS)
    assert stat > chi2_critical(df)


def test_filtered_distribution_top_p_top_k():
    exact = exact_first3(5, 0.7, TEMP, top_k=3, top_p=0.8)
    rng_seed = iter(range(10**6))
    for factory, budget in ((None, 0), (lambda: random_logits_drafter(V, next(rng_seed)), 16)):
        counts = sample_counts(factory, TEMP, budget, 3, top_k=3, top_p=0.8, n=2000)
        assert all(exact.get(k, 0) > 0 for k in counts)  # never a filtered-out token
        stat, df = chi2(counts, exact, 2000)
        assert stat < chi2_critical(df), (stat, df)


def test_same_seed_same_tokens_ar_equals_ddtree():
    t = toy(48, 256, seed=9, scale=1.0)
    for seed in (0, 1, 12345):
        ar = generate(t, PROMPT, 40, temperature=0.8, seed=seed)
        assert np.array_equal(generate(t, PROMPT, 40, temperature=0.8, seed=seed).tokens, ar.tokens)
        for drafter in (OracleDrafter(ar.tokens, 0.3, vocab_size=48), NgramDrafter(), random_logits_drafter(48)):
            res = generate(t, PROMPT, 40, drafter=drafter, tree_budget=32, depth=5, temperature=0.8, seed=seed)
            assert np.array_equal(res.tokens, ar.tokens)
        res = generate(t, PROMPT, 40, drafter=OracleDrafter(ar.tokens, vocab_size=48), tree_budget=32, depth=5,
                       temperature=0.8, seed=seed)
        assert res.stats["mean_acceptance_length"] > 4
    outs = {tuple(generate(t, PROMPT, 10, temperature=0.8, seed=s).tokens) for s in range(8)}
    assert len(outs) > 1  # the seed matters
    r = generate(t, PROMPT, 5, temperature=0.8)
    assert isinstance(r.stats["seed"], int)  # seed=None draws one and reports it


def test_plus_infinity_logits_take_all_the_mass():
    """A row with +inf logits: every mode picks one of them (the softmax's limit gives them all the
    mass), the lowest id among them (first in id order, and first in the filtered order, logit
    descending then id); the sampled modes used to return id 0 when unfiltered."""
    rng = np.random.default_rng(5)
    V, T = 50, 12
    x = rng.standard_normal((T, V)).astype(np.float32)
    x[rng.random((T, V)) < 0.1] = np.nan
    first = []
    for t in range(T):
        where = np.sort(rng.choice(np.arange(1, V), size=1 + t % 3, replace=False))
        x[t, where] = np.inf
        first.append(where[0])
    pos = np.arange(T, dtype=np.int64)
    for temperature, top_k, top_p in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (2.0, 1, 0.3)]:
        for seed in (0, 9):
            got = _native.sampler_choose(x, pos, temperature, top_k, top_p, seed)
            np.testing.assert_array_equal(got, first, err_msg=f"T={temperature} k={top_k} p={top_p}")
