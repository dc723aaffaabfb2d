"""Native CPU tree ops (kn.ops, device="cpu") == the NumPy reference, exactly.

Thousands of random cases (tests/python/tree_cases.py): budgets 0..1024, depths 1..16, K from 1
to the budget, forced ties, -inf log-probs, duplicate tokens, all-equal rows; the accept walk on
random, full-depth and duplicate-token choices; top-k + log-softmax; input validation that
raises the same ValueError on both paths; device dispatch.
"""
import threading

import numpy as np
import pytest

import kdtree_native as kn
import tree_cases as tc

R = kn.reference
IMPLS = {"reference": R, "ops": kn.ops}


def assert_same_tree(a, b, what=""):
    for field in ("tokens", "depths", "parents", "visibility"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype, (what, field, x.dtype, y.dtype)
        assert np.array_equal(x, y), (what, field)


def test_tree_build_matches_reference_on_random_cases():
    rng = np.random.default_rng(99)
    count = 0
    for cid, lp, ids, budget in tc.case_grid(n_small=2400, n_large=60, seed=2024):
        ref = R.tree_build(lp, ids, budget)
        nat = kn.ops.tree_build(lp, ids, budget, device="cpu")
        assert isinstance(nat, R.Tree)
        assert_same_tree(ref, nat, cid)
        # accept walks on the same tree: random, greedy-deep and full-depth choices
        for choice in (tc.random_choice(rng, ref, 0.5), tc.random_choice(rng, ref, 1.0), tc.deepest_choice(ref)):
            p_ref, b_ref = R.tree_accept(ref, choice)
            p_nat, b_nat = kn.ops.tree_accept(nat, choice)
            assert p_nat.dtype == np.int32 and isinstance(b_nat, int)
            assert np.array_equal(p_ref, p_nat) and b_ref == b_nat, cid
        count += 1
    assert count == 2460


def test_tree_build_operation_order_cases():
    """Cases where only the contract's exact float64 operation order gives the right tree."""
    for cid, lp, ids, budget in tc.rounding_grid(300):
        assert_same_tree(R.tree_build(lp, ids, budget), kn.ops.tree_build(lp, ids, budget), cid)


def test_tree_build_dtypes_and_layouts():
    lp, ids, budget = tc.case(5, 64, 7, 9, "quantised")
    ref = R.tree_build(lp, ids, budget)
    # int64 ids, float64 log-probs (converted to float32), non-contiguous views, lists
    assert_same_tree(ref, kn.ops.tree_build(lp.astype(np.float64), ids.astype(np.int64), budget))
    lp2 = np.asfortranarray(lp)
    ids2 = np.repeat(ids, 2, axis=1)[:, ::2]
    assert_same_tree(ref, kn.ops.tree_build(lp2, ids2, np.int64(budget)))
    assert_same_tree(ref, kn.ops.tree_build(lp.tolist(), ids.tolist(), budget))


@pytest.mark.parametrize("n", [62, 63, 64, 65, 127, 128, 129])
def test_visibility_bit_boundaries(n):
    lp = np.full((16, 64), -1.0, np.float32)
    ids = np.zeros((16, 64), np.int32)
    assert_same_tree(R.tree_build(lp, ids, n), kn.ops.tree_build(lp, ids, n))


def test_accept_duplicates_and_edges():
    parents = np.array([-1, 0, 0, 0, 1, 3], np.int32)
    tree = R.Tree(tokens=np.array([5, 7, 5, 9, 9], np.int32), depths=np.array([1, 1, 1, 2, 2], np.int32),
                  parents=parents, visibility=R.tree_visibility(parents))
    for choice in ([5, 0, 0, 9, 0, 11], [7, 0, 4, 0, 0, 0], [8, 0, 0, 0, 0, 0], [5, 9, 0, 9, 1, 2]):
        for dtype in (np.int32, np.int64):
            c = np.array(choice, dtype)
            p1, b1 = R.tree_accept(tree, c)
            p2, b2 = kn.ops.tree_accept(tree, c)
            assert p1.tolist() == p2.tolist() and b1 == b2
    assert kn.ops.tree_accept(tree, np.array([5, 0, 0, 9, 0, 11]))[0].tolist() == [0, 3, 5]


def test_topk_logsoftmax_matches_reference():
    rng = np.random.default_rng(11)
    for i in range(150):
        D = int(rng.integers(0, 17))
        V = int(rng.choice([1, 2, 3, 17, 64, 255, 1000, 5000]))
        k = int(rng.integers(1, min(V, 1024) + 3))
        x = (rng.standard_normal((D, V)) * rng.uniform(0.1, 10)).astype(np.float32)
        if i % 3 == 0:
            x = np.round(x)  # many exact ties: lower id first
        if i % 5 == 0 and V > 1:
            x[rng.random((D, V)) < 0.5] = -np.inf
            x[:, 0] = 0.0  # keep a finite entry in every row
        lp_r, ids_r = R.topk_logsoftmax(x, k)
        lp_n, ids_n = kn.ops.topk_logsoftmax(x, k)
        assert lp_n.dtype == np.float32 and ids_n.dtype == np.int32
        assert lp_n.shape == lp_r.shape == (D, min(k, V))
        assert np.array_equal(ids_r, ids_n), i
        # same float32 log-sum-exp up to an ulp of it (float64 sums in a different order)
        assert np.array_equal(np.isfinite(lp_r), np.isfinite(lp_n))
        fin = np.isfinite(lp_r)
        scale = np.spacing(np.float32(max(1.0, np.abs(x[np.isfinite(x)]).max() if x.size else 1.0)))
        assert np.all(np.abs(lp_r[fin] - lp_n[fin]) <= 2 * scale), i


def test_topk_logsoftmax_log_sum_exp_exact():
    """The CPU log-sum-exp (float64, vectorised exp where the CPU has AVX2) against one summed
    exactly (math.fsum of float64 exps) and rounded once to float32: equal in every case here
    (wide and narrow rows, -inf entries, row lengths that are not multiples of the vector width,
    terms down to e^-700 and below e^-708), and never more than one ulp off."""
    import math
    rng = np.random.default_rng(21)
    total = equal = 0
    for i in range(300):
        V = int(rng.choice([1, 7, 8, 9, 31, 1000, 4096, 4099]))
        x = (rng.standard_normal((3, V)) * rng.choice([0.1, 3.0, 40.0, 300.0])).astype(np.float32)
        if i % 3 == 0:
            x[rng.random((3, V)) < 0.4] = -np.inf
            x[:, 0] = 2.0
        lp, ids = kn.ops.topk_logsoftmax(x, 4, device="cpu")
        for d in range(3):
            row = x[d].astype(np.float64)
            fin = row[np.isfinite(row)]
            lse = np.float32(fin.max() + math.log(math.fsum(np.exp(fin - fin.max()))))
            want = (x[d, ids[d]] - lse).astype(np.float32)
            ok = np.isfinite(want)
            assert np.array_equal(np.isfinite(lp[d]), ok)
            ulps = np.abs(lp[d][ok] - want[ok]) / np.spacing(np.maximum(np.abs(want[ok]), np.float32(1e-30)))
            assert (ulps <= 1).all(), i
            total += int(ok.sum())
            equal += int((lp[d][ok] == want[ok]).sum())
    assert equal == total, (equal, total)


def test_tree_build_from_logits_matches_reference():
    rng = np.random.default_rng(12)
    for i in range(60):
        D, V = int(rng.integers(1, 17)), int(rng.choice([2, 50, 3000]))
        x = (rng.standard_normal((D, V)) * 3).astype(np.float32)
        budget = int(rng.choice([0, 1, 17, 64, 255]))
        top_k = None if i % 2 else int(rng.integers(1, 70))
        lp, ids = R.topk_logsoftmax(x, budget if top_k is None else top_k) if budget else (None, None)
        ref = R.tree_build(lp, ids, budget) if budget else R.tree_build_from_logits(x, 0)
        # the native path feeds its own log-probs; compare against the reference built on them
        nat = kn.ops.tree_build_from_logits(x, budget, top_k=top_k)
        lp_n, ids_n = kn.ops.topk_logsoftmax(x, budget if top_k is None else top_k) if budget else (None, None)
        assert_same_tree(R.tree_build(lp_n, ids_n, budget) if budget else ref, nat)
        if budget and np.array_equal(lp, lp_n):
            assert_same_tree(ref, nat)


def test_threads_share_nothing():
    cases = list(tc.case_grid(n_small=40, n_large=4, seed=5))
    want = [R.tree_build(lp, ids, b) for _, lp, ids, b in cases]
    errors = []

    def work():
        try:
            for _ in range(5):
                for (cid, lp, ids, b), ref in zip(cases, want):
                    assert_same_tree(ref, kn.ops.tree_build(lp, ids, b), cid)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


# ----------------------------------------------------------------------------- validation

GOOD_LP = np.array([[-0.1, -1.0, -2.0], [-0.5, -0.6, -3.0]], np.float32)
GOOD_IDS = np.array([[1, 2, 3], [4, 5, 6]], np.int32)


def with_value(a, idx, value):
    a = a.copy()
    a[idx] = value
    return a


BAD_TREE_INPUTS = {
    "nan": (with_value(GOOD_LP, (1, 1), np.nan), GOOD_IDS, 4, "NaN"),
    "+inf": (with_value(GOOD_LP, (0, 0), np.inf), GOOD_IDS, 4, r"\+inf"),
    "unsorted": (with_value(GOOD_LP, (0, 2), -0.5), GOOD_IDS, 4, "sorted descending"),
    "1-D": (GOOD_LP[0], GOOD_IDS[0], 4, "2-D"),
    "3-D": (GOOD_LP[None], GOOD_IDS[None], 4, "2-D"),
    "shape mismatch": (GOOD_LP, GOOD_IDS[:, :2], 4, "shape"),
    "K = 0": (GOOD_LP[:, :0], GOOD_IDS[:, :0], 4, "K"),
    "too deep": (np.zeros((R.MAX_TREE_DEPTH + 1, 2), np.float32), np.zeros((R.MAX_TREE_DEPTH + 1, 2), np.int32), 4, "depth"),
    "budget < 0": (GOOD_LP, GOOD_IDS, -1, "budget"),
    "budget too big": (GOOD_LP, GOOD_IDS, R.MAX_TREE_BUDGET + 1, "budget"),
    "budget float": (GOOD_LP, GOOD_IDS, 4.0, "budget"),
    "budget bool": (GOOD_LP, GOOD_IDS, True, "budget"),
    "negative id": (GOOD_LP, with_value(GOOD_IDS, (1, 0), -3), 4, "token_ids"),
    "huge id": (GOOD_LP, with_value(GOOD_IDS.astype(np.int64), (1, 0), 2 ** 40), 4, "token_ids"),
    "float ids": (GOOD_LP, GOOD_IDS.astype(np.float32), 4, "token_ids"),
    "int logprobs": (GOOD_LP.astype(np.int32), GOOD_IDS, 4, "logprobs"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", BAD_TREE_INPUTS)
def test_tree_build_input_errors(impl, name):
    lp, ids, budget, match = BAD_TREE_INPUTS[name]
    with pytest.raises(ValueError, match=match):
        IMPLS[impl].tree_build(lp, ids, budget)


def test_neginf_is_allowed():
    lp = with_value(GOOD_LP, (1, slice(1, None)), -np.inf)
    assert_same_tree(R.tree_build(lp, GOOD_IDS, 10), kn.ops.tree_build(lp, GOOD_IDS, 10))
    lp = np.full((3, 4), -np.inf, np.float32)
    ids = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert_same_tree(R.tree_build(lp, ids, 50), kn.ops.tree_build(lp, ids, 50))


@pytest.mark.parametrize("impl", IMPLS)
def test_topk_logsoftmax_input_errors(impl):
    f = IMPLS[impl].topk_logsoftmax
    x = np.zeros((2, 5), np.float32)
    for bad, k, match in [(with_value(x, (1, 1), np.nan), 2, "NaN"), (with_value(x, (0, 3), np.inf), 2, r"\+inf"),
                          (with_value(x, (1, slice(None)), -np.inf), 2, "all -inf"), (x[0], 2, "2-D"),
                          (x, 0, "k"), (x, -1, "k"), (x.astype(np.int32), 2, "float"), (x[:, :0], 1, "vocabulary")]:
        with pytest.raises(ValueError, match=match):
            f(bad, k)


def test_topk_logsoftmax_finds_the_first_bad_logit():
    """The native input scan (eight values at a time where the CPU has AVX2, then a scalar tail;
    the engine checks a drafter's logits with the same scan): NaN or +inf anywhere in a row, the
    first of them named; rows that are -inf but for one finite value anywhere pass; all -inf is
    refused. Rows of 1 to 4099 values, the bad value in the vector part and in the tail. Called
    on the binding (kn.ops checks in NumPy first, NaN before +inf)."""
    rng = np.random.default_rng(17)
    for V in (1, 7, 8, 9, 15, 16, 17, 40, 4099):
        for trial in range(12):
            x = rng.standard_normal((3, V)).astype(np.float32)
            r, p = int(rng.integers(0, 3)), int(rng.integers(0, V))
            first = [np.nan, np.inf][trial % 2]
            x[r, p] = first
            if p + 1 < V:  # a later bad value of the other kind must not be the one named
                x[r, int(rng.integers(p + 1, V))] = [np.inf, np.nan][trial % 2]
            with pytest.raises(ValueError, match="NaN" if trial % 2 == 0 else r"\+inf"):
                kn._native.topk_logsoftmax_cpu(x, 1)
            y = np.full((2, V), -np.inf, np.float32)
            y[0, int(rng.integers(0, V))] = 0.5
            y[1, int(rng.integers(0, V))] = -3.0
            lp, ids = kn._native.topk_logsoftmax_cpu(y, 1)
            assert lp.shape == (2, 1) and np.all(lp == 0) and y[0, ids[0, 0]] == 0.5 and y[1, ids[1, 0]] == -3.0
            y[1, :] = -np.inf
            with pytest.raises(ValueError, match="all -inf"):
                kn._native.topk_logsoftmax_cpu(y, 1)


@pytest.mark.parametrize("impl", IMPLS)
def test_tree_accept_input_errors(impl):
    tree = R.tree_build(GOOD_LP, GOOD_IDS, 5)
    f = IMPLS[impl].tree_accept
    with pytest.raises(ValueError, match="target_choice"):
        f(tree, np.zeros(tree.n, np.int64))
    with pytest.raises(ValueError, match="target_choice"):
        f(tree, np.zeros((tree.n + 1, 1), np.int64))
    with pytest.raises(ValueError, match="target_choice"):
        f(tree, np.zeros(tree.n + 1, np.float64))
    broken = R.Tree(tokens=tree.tokens, depths=tree.depths, parents=with_value(tree.parents, 2, 4),
                    visibility=tree.visibility)
    with pytest.raises(ValueError, match="parents"):
        f(broken, np.zeros(tree.n + 1, np.int64))


def test_native_binding_validates_by_itself():
    """The _native functions guard native memory on their own, whatever kn.ops checked."""
    N = kn._native
    with pytest.raises(ValueError, match="float32"):
        N.tree_build_cpu(GOOD_LP.astype(np.float64), GOOD_IDS, 4)
    with pytest.raises(ValueError, match="2-D"):
        N.tree_build_cpu(GOOD_LP[0], GOOD_IDS[0], 4)
    with pytest.raises(ValueError, match="NaN"):
        N.tree_build_cpu(with_value(GOOD_LP, (0, 1), np.nan), GOOD_IDS, 4)
    with pytest.raises(ValueError, match="sorted"):
        N.tree_build_cpu(with_value(GOOD_LP, (0, 2), 0.0), GOOD_IDS, 4)
    with pytest.raises(ValueError, match="budget"):
        N.tree_build_cpu(GOOD_LP, GOOD_IDS, -1)
    with pytest.raises(ValueError, match="token_ids"):
        N.tree_build_cpu(GOOD_LP, with_value(GOOD_IDS, (0, 0), -1), 4)
    with pytest.raises(ValueError, match="numpy array"):
        N.tree_build_cpu(GOOD_LP.tolist(), GOOD_IDS, 4)
    with pytest.raises(ValueError, match="choice"):
        N.tree_accept_cpu(np.array([-1, 0], np.int32), np.array([3], np.int32), np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="parents"):
        N.tree_accept_cpu(np.array([-1, 1], np.int32), np.array([3], np.int32), np.array([1, 2]))
    with pytest.raises(ValueError, match="all -inf"):
        N.topk_logsoftmax_cpu(np.full((1, 3), -np.inf, np.float32), 2)
    tokens, depths, parents, bits = N.tree_build_cpu(GOOD_LP, GOOD_IDS, 4)
    assert bits.dtype == np.uint64 and bits.shape == (5, 1)
    assert N.tree_build_cpu_timing(GOOD_LP, GOOD_IDS, 4, 3).shape == (3,)


def test_device_dispatch():
    lp, ids = GOOD_LP, GOOD_IDS
    for bad in ("gpu", "CPU", None, "cuda:0"):
        with pytest.raises(ValueError, match="device"):
            kn.ops.tree_build(lp, ids, 3, device=bad)
        with pytest.raises(ValueError, match="device"):
            kn.ops.topk_logsoftmax(lp, 3, device=bad)
    tree = kn.ops.tree_build(lp, ids, 3)
    with pytest.raises(ValueError, match="device"):
        kn.ops.tree_accept(tree, np.zeros(4, np.int64), device="tpu")
    if not kn.cuda_available():
        with pytest.raises(RuntimeError, match="cuda|CUDA"):
            kn.ops.tree_build(lp, ids, 3, device="cuda")
        with pytest.raises(RuntimeError, match="cuda|CUDA"):
            kn.ops.tree_build_from_logits(np.zeros((2, 4), np.float32), 3, device="cuda")
