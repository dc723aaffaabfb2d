"""The NumPy tree reference (kn.reference) against independent definitions.

- tree_build == a brute-force global sort of all prefixes by (score desc, rank tuple asc),
  on inputs where float64 arithmetic is exact (quarter-grid log-probs, -inf included);
- structure (parents, depths, tokens, visibility, positions) on random cases of every kind;
- accept walk, compaction maps, top-k + log-softmax against float64 NumPy.
"""
import itertools
import math

import numpy as np
import pytest

import kdtree_native as kn
import tree_cases as tc

R = kn.reference


def brute_force_tree(lp, ids, budget):
    """All prefixes, each scored along its discovery chain (the contract's operation order),
    sorted by (score desc with NaN as -inf, rank tuple asc); the first `budget` form the tree.
    Valid where scores never increase along a chain (log-probs <= 0, exact arithmetic)."""
    D, K = lp.shape
    score = {}
    prefixes = []
    for d in range(1, D + 1):
        for ranks in itertools.product(range(K), repeat=d):
            r = ranks[-1]
            if r == 0:
                s = (score[ranks[:-1]] if d > 1 else 0.0) + float(lp[d - 1, 0])
            else:
                s = score[ranks[:-1] + (r - 1,)] - float(lp[d - 1, r - 1]) + float(lp[d - 1, r])
            score[ranks] = s
            prefixes.append(ranks)
    key = {t: (-(-math.inf if math.isnan(s) else s), t) for t, s in score.items()}
    chosen = sorted(prefixes, key=lambda t: key[t])[:budget]
    index = {(): 0}
    tokens, depths, parents = [], [], [-1]
    for i, t in enumerate(chosen, start=1):
        index[t] = i
        tokens.append(int(ids[len(t) - 1, t[-1]]))
        depths.append(len(t))
        parents.append(index[t[:-1]])
    return tokens, depths, parents


@pytest.mark.parametrize("seed", range(60))
def test_tree_build_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    D = int(rng.integers(1, 5))
    K = int(rng.integers(1, 5))
    while K ** D > 300:
        D -= 1
    lp = -np.sort(np.round(rng.exponential(1.0, (D, K)) * 4) / 4, axis=1)  # exact sums, ties
    if seed % 3 == 0:  # rows ending in -inf: -inf and NaN scores
        for d in range(D):
            lp[d, rng.integers(0, K + 1):] = -np.inf
    lp = lp.astype(np.float32)
    ids = rng.integers(0, 50, (D, K)).astype(np.int32)
    total = sum(K ** d for d in range(1, D + 1))
    for budget in sorted({0, 1, 2, 5, total // 2, total, total + 3}):
        tree = R.tree_build(lp, ids, budget)
        tokens, depths, parents = brute_force_tree(lp, ids, budget)
        assert tree.n == min(budget, total)
        assert tree.tokens.tolist() == tokens
        assert tree.depths.tolist() == depths
        assert tree.parents.tolist() == parents


def ancestors(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = int(parents[i])
        out.add(i)
    return out


def test_tree_structure_on_random_cases():
    for cid, lp, ids, budget in tc.case_grid(n_small=300, n_large=6, seed=7):
        tree = R.tree_build(lp, ids, budget)
        D, K = lp.shape
        n = tree.n
        assert n <= budget
        assert tree.tokens.dtype == np.int32 and tree.depths.dtype == np.int32
        assert tree.parents.dtype == np.int32 and tree.visibility.dtype == bool
        assert tree.parents.shape == (n + 1,) and tree.visibility.shape == (n + 1, n + 1)
        assert tree.parents[0] == -1
        depth = np.concatenate([[0], tree.depths])
        for i in range(1, n + 1):
            p = tree.parents[i]
            assert 0 <= p < i, cid
            assert depth[i] == depth[p] + 1, cid
            assert tree.tokens[i - 1] in ids[depth[i] - 1], cid
        assert depth.max() <= D
        if budget > 0:  # a full tree or a budget-limited one
            total = sum(K ** d for d in range(1, D + 1)) if K ** D < 10 ** 7 else 10 ** 9
            assert n == min(budget, total), cid
        # visibility: exactly the ancestors and the node itself
        for i in range(0, n + 1, max(1, n // 16)):
            want = np.zeros(n + 1, bool)
            want[list(ancestors(tree.parents, i))] = True
            assert np.array_equal(tree.visibility[i], want), cid
        pos = R.tree_positions(tree, 100)
        assert pos.dtype == np.int32 and pos.tolist() == (100 + depth).tolist()


def test_empty_trees():
    lp = np.zeros((3, 2), np.float32)
    ids = np.zeros((3, 2), np.int32)
    for tree in (R.tree_build(lp, ids, 0), R.tree_build(lp[:0], ids[:0], 5),
                 R.tree_build_from_logits(np.zeros((4, 9), np.float32), 0)):
        assert tree.n == 0
        assert tree.parents.tolist() == [-1]
        assert tree.visibility.tolist() == [[True]]
        path, bonus = R.tree_accept(tree, np.array([42]))
        assert path.tolist() == [0] and bonus == 42


def test_order_matches_official_operation_order():
    """Equal-valued non-dyadic rows: siblings are scored s - a + b, not recomputed sums, so
    rounding (not the rank tuple alone) decides some orders; check against a direct replay."""
    lp = np.full((3, 4), -np.log(7.3), np.float32)
    ids = np.arange(12, dtype=np.int32).reshape(3, 4)
    tree = R.tree_build(lp, ids, 40)
    tokens, depths, parents = brute_force_tree(lp, ids, 40)  # also exact-order scoring
    assert tree.tokens.tolist() == tokens and tree.parents.tolist() == parents


def hand_tree():
    # root 0 -> 1 (tok 5), 2 (tok 7), 3 (tok 5: a duplicate of node 1); 1 -> 4 (tok 9); 3 -> 5 (tok 9)
    parents = np.array([-1, 0, 0, 0, 1, 3], np.int32)
    tokens = np.array([5, 7, 5, 9, 9], np.int32)
    depths = np.array([1, 1, 1, 2, 2], np.int32)
    return R.Tree(tokens=tokens, depths=depths, parents=parents, visibility=R.tree_visibility(parents))


def test_accept_walk_rules():
    tree = hand_tree()
    # duplicate token 5 under the root: the highest node index (3) wins, as the official dict
    path, bonus = R.tree_accept(tree, np.array([5, 0, 0, 9, 0, 11]))
    assert path.tolist() == [0, 3, 5] and bonus == 11
    path, bonus = R.tree_accept(tree, np.array([7, 0, 4, 0, 0, 0]))
    assert path.tolist() == [0, 2] and bonus == 4
    path, bonus = R.tree_accept(tree, np.array([8, 0, 0, 0, 0, 0]))
    assert path.tolist() == [0] and bonus == 8
    assert path.dtype == np.int32 and isinstance(bonus, int)


def test_accept_full_depth():
    rng = np.random.default_rng(3)
    for seed in range(40):
        lp, _, budget = tc.case(seed, int(rng.choice([17, 64, 255])), int(rng.integers(1, 17)), 8, "random")
        ids = np.stack([rng.permutation(100)[:8] for _ in range(lp.shape[0])])  # distinct per depth
        tree = R.tree_build(lp, ids, budget)
        path, bonus = R.tree_accept(tree, tc.deepest_choice(tree))
        assert len(path) == int(tree.depths.max()) + 1  # ids distinct per depth: no duplicates
        assert bonus == -1
        for a, b in zip(path[:-1], path[1:]):
            assert tree.parents[b] == a


def test_accept_input_errors():
    tree = hand_tree()
    with pytest.raises(ValueError, match="target_choice"):
        R.tree_accept(tree, np.zeros(5, np.int64))
    with pytest.raises(ValueError, match="target_choice"):
        R.tree_accept(tree, np.zeros(6, np.float32))
    bad = R.Tree(tokens=tree.tokens, depths=tree.depths, parents=np.array([-1, 0, 0, 4, 1, 3], np.int32),
                 visibility=tree.visibility)
    with pytest.raises(ValueError, match="parents"):
        R.tree_accept(bad, np.zeros(6, np.int64))
    for impl in (R.tree_accept, kn.ops.tree_accept):
        with pytest.raises(TypeError, match="tree must be a Tree"):
            impl(None, np.zeros(6, np.int64))
        with pytest.raises(ValueError, match="past int64"):
            impl(tree, np.full(6, 2**64 - 1, np.uint64))


def test_compaction():
    src, dst = R.compact_index_map(np.array([0, 2, 5]), 10)
    assert src.tolist() == [10, 12, 15] and dst.tolist() == [10, 11, 12]
    cache = np.arange(20 * 3).reshape(20, 3)
    before = cache.copy()
    new_len = R.kv_compact(cache, np.array([0, 2, 5, 9]), 10)
    assert new_len == 14
    assert np.array_equal(cache[:10], before[:10])
    assert np.array_equal(cache[10:14], before[[10, 12, 15, 19]])
    for bad in ([1, 2], [0, 2, 2], [], [[0]]):
        with pytest.raises(ValueError):
            R.compact_index_map(np.array(bad, np.int64), 3)


def test_topk_logsoftmax_vs_float64():
    rng = np.random.default_rng(0)
    for D, V, k in [(1, 1, 1), (3, 17, 5), (15, 1000, 64), (16, 257, 300), (4, 32000, 8)]:
        x = (rng.standard_normal((D, V)) * rng.uniform(0.5, 8)).astype(np.float32)
        x[0, : V // 3] = np.round(x[0, : V // 3])  # ties inside a row
        if V > 4:
            x[-1, ::3] = -np.inf
        lp, ids = R.topk_logsoftmax(x, k)
        kk = min(k, V)
        assert lp.shape == ids.shape == (D, kk) and lp.dtype == np.float32 and ids.dtype == np.int32
        x64 = x.astype(np.float64)
        m = x64.max(axis=1, keepdims=True)
        want = x64 - (m + np.log(np.exp(x64 - m).sum(axis=1, keepdims=True)))
        for d in range(D):
            order = sorted(range(V), key=lambda v: (-x[d, v], v))[:kk]
            assert ids[d].tolist() == order
        got = np.take_along_axis(want, ids.astype(np.int64), axis=1)
        fin = np.isfinite(got)
        assert np.array_equal(fin, np.isfinite(lp))
        np.testing.assert_allclose(lp[fin], got[fin], rtol=2e-7, atol=2e-6 * max(1.0, np.abs(x[np.isfinite(x)]).max()))


def test_tree_build_from_logits():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    for budget, top_k in [(1, None), (17, None), (100, None), (100, 3), (64, 64)]:
        tree = R.tree_build_from_logits(x, budget, top_k)
        lp, ids = R.topk_logsoftmax(x, min(budget, 40) if top_k is None else top_k)
        ref = R.tree_build(lp, ids, budget)
        assert np.array_equal(tree.parents, ref.parents) and np.array_equal(tree.tokens, ref.tokens)
