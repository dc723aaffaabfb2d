"""CUDA kernels (kn.ops device="cuda", kdtree_native._cuda_ops) against the CPU twin and the
NumPy reference. Skipped as a whole without a usable CUDA device.

Integer outputs (tree nodes, parents, visibility, accept paths, compaction) must be equal bit
for bit; verify attention (FP32) within 1e-5 relative of a float64 evaluation. Every device
output buffer is poisoned (0xFF bytes) before the kernel runs, and the full-size buffers are
checked here, so an element the kernel forgets to write shows up.
"""
import numpy as np
import pytest

import kdtree_native as kn

if not kn.cuda_available():
    pytest.skip("no usable CUDA device", allow_module_level=True)

import tree_cases as tc  # noqa: E402
from kdtree_native import _cuda_ops as cu  # noqa: E402

pytestmark = pytest.mark.cuda
R = kn.reference
N = kn._native


def assert_same_tree(a, b, what=""):
    for field in ("tokens", "depths", "parents", "visibility"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype, (what, field, x.dtype, y.dtype)
        assert x.shape == y.shape and np.array_equal(x, y), (what, field)


def check_raw(raw, tree, budget, cache_len):
    """The full-size device outputs: valid part equals `tree`, padding has its fill value."""
    n = raw["n"]
    assert n == tree.n
    W = (budget + 64) // 64
    assert np.array_equal(raw["tokens"][:n], tree.tokens) and (raw["tokens"][n:] == -1).all()
    assert np.array_equal(raw["depths"][:n], tree.depths) and (raw["depths"][n:] == 0).all()
    assert np.array_equal(raw["parents"][: n + 1], tree.parents) and (raw["parents"][n + 1:] == -1).all()
    pos = raw["positions"]
    assert pos[0] == cache_len and np.array_equal(pos[1: n + 1], cache_len + tree.depths)
    assert (pos[n + 1:] == -1).all()
    vis = raw["visibility"]
    assert vis.shape == (budget + 1, W)
    assert np.array_equal(cu.unpack_visibility(vis, n), tree.visibility)
    assert (vis[n + 1:] == 0).all()
    full = np.unpackbits(vis[: n + 1].astype("<u8").view(np.uint8), axis=1, bitorder="little")
    assert not full[:, n + 1:].any()  # no bits past column n


# ----------------------------------------------------------------------------- tree build
def test_tree_build_equals_cpu_twin_on_random_cases():
    paths = {0: 0, 1: 0, 3: 0}
    for i, (cid, lp, ids, budget) in enumerate(tc.case_grid(n_small=3000, n_large=120, seed=77)):
        cpu = kn.ops.tree_build(lp, ids, budget, device="cpu")
        gpu = kn.ops.tree_build(lp, ids, budget, device="cuda")  # auto: one warp for small budgets
        assert_same_tree(cpu, gpu, cid)
        if budget > 0:
            if budget <= N.CUDA_TREE_WARP_PATH_MAX_B:
                assert cu.last_path() == 2, cid
            assert_same_tree(cpu, cu.tree_build(lp, ids, budget, force_fallback=3), cid)
            paths[cu.last_path()] += 1  # the parallel path when forced (or its fallback)
        if i % 10 == 0:  # the NumPy oracle too, and the raw poisoned buffers
            assert_same_tree(R.tree_build(lp, ids, budget), gpu, cid)
            if budget > 0:
                raw = N.cuda_tree_build(lp, ids, budget, 5 + i, False)
                check_raw(raw, gpu, budget, 5 + i)
    # every path must have been exercised substantially: the parallel path with the threshold
    # estimate (3), with the adaptive threshold (0: no estimate, or the estimate's set fell short),
    # the sequential fallback (1)
    assert paths[3] > 500 and paths[0] + paths[3] > 1000 and paths[1] > 100, paths


def test_tree_build_adaptive_threshold_equals_cpu_twin():
    """The parallel path's adaptive levels (what runs when the threshold estimate fails) forced."""
    paths = {0: 0, 1: 0}
    for i, (cid, lp, ids, budget) in enumerate(tc.case_grid(n_small=800, n_large=40, seed=80)):
        if budget == 0:
            continue
        raw = N.cuda_tree_build(lp, ids, budget, 2 + i, 4)
        paths[raw["path"]] += 1
        check_raw(raw, kn.ops.tree_build(lp, ids, budget, device="cpu"), budget, 2 + i)
    assert paths[0] > 400, paths


def test_tree_build_fallback_path_equals_cpu_twin():
    for i, (cid, lp, ids, budget) in enumerate(tc.case_grid(n_small=600, n_large=20, seed=78)):
        if budget == 0:
            continue
        raw = N.cuda_tree_build(lp, ids, budget, 0, True)
        assert raw["path"] == 1
        cpu = kn.ops.tree_build(lp, ids, budget, device="cpu")
        check_raw(raw, cpu, budget, 0)


def test_tree_build_one_warp_path_equals_cpu_twin():
    """The one-warp path (auto for small budgets) forced at every budget, on every kind of case."""
    for i, (cid, lp, ids, budget) in enumerate(tc.case_grid(n_small=800, n_large=40, seed=79)):
        if budget == 0:
            continue
        raw = N.cuda_tree_build(lp, ids, budget, 3 + i, 2)
        assert raw["path"] == 2
        check_raw(raw, kn.ops.tree_build(lp, ids, budget, device="cpu"), budget, 3 + i)
    for i, (cid, lp, ids, budget) in enumerate(tc.rounding_grid(n=100, seed=81)):
        raw = N.cuda_tree_build(lp, ids, budget, 0, 2)
        check_raw(raw, kn.ops.tree_build(lp, ids, budget, device="cpu"), budget, 0)


def realistic_case(seed, budget, depth=15, k=None, sharp=None):
    rng = np.random.default_rng(seed)
    k = budget if k is None else k
    V = max(k + 8, 2048)
    sharp = rng.uniform(1.0, 4.0) if sharp is None else sharp
    logits = rng.standard_normal((depth, V)) * sharp
    logits[:, :8] += rng.uniform(0, 8, (depth, 1)) * np.linspace(1, 0, 8)  # peaky heads
    logits = logits.astype(np.float32)
    return R.topk_logsoftmax(logits, k)


@pytest.mark.parametrize("budget", [16, 64, 256, 512, 1024])
def test_tree_build_realistic_takes_parallel_path(budget):
    for seed in range(6):
        lp, ids = realistic_case(seed, budget, k=budget if seed % 2 == 0 else min(budget, 32))
        raw = N.cuda_tree_build(lp, ids, budget, 100, 3)  # the parallel path forced
        cpu = kn.ops.tree_build(lp, ids, budget, device="cpu")
        check_raw(raw, cpu, budget, 100)
        # drafter-like rows: trees of 3+ levels take the threshold estimate; shallower ones may
        # take the adaptive levels (cheaper for one or two levels; the kernel's test for that,
        # every depth-3 prefix costing more than its bound on the B-th, catches most of them)
        deep = cpu.n > 0 and int(cpu.depths.max()) >= 3
        assert raw["path"] == 3 if deep else raw["path"] in (0, 3), (budget, seed, int(cpu.depths.max()) if cpu.n else 0)
        auto = N.cuda_tree_build(lp, ids, budget, 100, 0)
        check_raw(auto, cpu, budget, 100)
        assert auto["path"] == (2 if budget <= N.CUDA_TREE_WARP_PATH_MAX_B else raw["path"]), (budget, seed)
        adaptive = N.cuda_tree_build(lp, ids, budget, 100, 4)
        check_raw(adaptive, cpu, budget, 100)
        assert adaptive["path"] == 0, (budget, seed)


def test_tree_build_row_of_neg_inf_below_the_root():
    """A drafter with nothing to say from some depth on: a row of -inf from rank 0 at a depth d >= 1.
    The threshold estimate's chain part is +inf there; its bin shift now clamps (dp_shift). Every
    path equals the CPU twin, and the estimate must have run on some of them. (The unclamped shift
    was undefined behaviour: the host emulation crashed on it, test_tree_block_emulation's -inf row
    cases; on the H200 the wrapped 32-bit shared address happened to land on a bin holding the same
    value, so this test passed on the old code there too.)"""
    rng = np.random.default_rng(99)
    estimated = 0
    for c in range(40):
        budget = (64, 96, 256, 1000)[c % 4]
        D, K = int(rng.integers(3, 17)), int(rng.integers(2, 8))
        lp = -np.sort(rng.uniform(0.01, 6.0, (D, K)), axis=1).astype(np.float32)
        lp[int(rng.integers(1, D))] = -np.inf
        ids = rng.integers(0, 50000, (D, K)).astype(np.int32)
        cpu = kn.ops.tree_build(lp, ids, budget, device="cpu")
        for force in (0, 3, 4):
            raw = N.cuda_tree_build(lp, ids, budget, 7, force)
            check_raw(raw, cpu, budget, 7)
            estimated += raw["path"] == 3
    assert estimated > 0


def test_tree_build_corners():
    lp = np.zeros((1, 1), np.float32)
    ids = np.array([[7]], np.int32)
    for budget in (0, 1, 2):
        assert_same_tree(R.tree_build(lp, ids, budget), kn.ops.tree_build(lp, ids, budget, device="cuda"))
    # all -inf beyond the first column, K > budget, depth 16 chain
    lp = np.full((16, 40), -np.inf, np.float32)
    lp[:, 0] = -0.25
    ids = np.arange(16 * 40, dtype=np.int32).reshape(16, 40)
    for budget in (1, 15, 16, 17, 300, 1024):
        assert_same_tree(R.tree_build(lp, ids, budget), kn.ops.tree_build(lp, ids, budget, device="cuda"))
    # every entry equal to 0: the whole tree is one big tie
    lp = np.zeros((16, 64), np.float32)
    ids = np.arange(16 * 64, dtype=np.int32).reshape(16, 64)
    for budget in (63, 64, 65, 1024):
        assert_same_tree(kn.ops.tree_build(lp, ids, budget), kn.ops.tree_build(lp, ids, budget, device="cuda"))


def test_tree_build_limits():
    lp = np.zeros((17, 2), np.float32)
    ids = np.zeros((17, 2), np.int32)
    with pytest.raises(ValueError):
        cu.tree_build(lp, ids, 4)
    with pytest.raises(ValueError):
        cu.tree_build(lp[:2], ids[:2], 1025)


def test_tree_build_native_entries_check_shapes():
    """The native tree builds (the plain one and the benchmarks' timed one share their input checks) refuse
    token ids of another shape than the log-probabilities, K = 0 and a depth past the GPU's limit."""
    lp = np.zeros((2, 3), np.float32)
    ids = np.zeros((2, 3), np.int32)
    calls = {"plain": lambda a, b: N.cuda_tree_build(a, b, 4),
             "timed": lambda a, b: N.cuda_time_tree_build(a, b, 4, iters=1, warmup=0)}
    for name, call in calls.items():
        assert call(lp, ids)["n"] == 4, name
        with pytest.raises(ValueError, match="shape"):
            call(lp, ids[:, :2])
        with pytest.raises(ValueError, match="K"):
            call(lp[:, :0], ids[:, :0])
        with pytest.raises(ValueError, match="depth"):
            call(np.zeros((17, 2), np.float32), np.zeros((17, 2), np.int32))


# ----------------------------------------------------------------------------- top-k + from logits
def logits_cases():
    rng = np.random.default_rng(5)
    yield "small", rng.standard_normal((3, 10)).astype(np.float32) * 3, 4
    yield "k=V", rng.standard_normal((2, 7)).astype(np.float32), 7
    yield "V=1", rng.standard_normal((4, 1)).astype(np.float32), 1
    yield "ints", rng.integers(-3, 3, (5, 300)).astype(np.float32), 50      # massive ties
    yield "equal", np.full((2, 5000), 1.5, np.float32), 1000                # all equal: ids order
    x = rng.standard_normal((4, 3000)).astype(np.float32)
    x[:, 100:2000] = -np.inf
    yield "neginf", x, 1024
    z = rng.standard_normal((3, 40000)).astype(np.float32)
    z[:, ::7] = 0.0
    z[:, 1::7] = -0.0
    yield "zeros", z, 300                                                  # -0 ties +0
    yield "chunks", rng.standard_normal((16, 100003)).astype(np.float32) * 4, 777
    yield "kimi", (rng.standard_normal((15, 163840)) * 3).astype(np.float32), 1024
    yield "kimi-k16", (rng.standard_normal((15, 163840)) * 3).astype(np.float32), 16
    # Zipf-like rows (what a confident drafter gives; the benchmark's "peaked" rows): few candidates
    ranks = np.log(np.arange(1, 163841, dtype=np.float64))
    yield "peaked", np.stack([(-s * ranks + rng.standard_normal(163840) * 0.5)[rng.permutation(163840)]
                              for s in rng.uniform(1.3, 2.3, 15)]).astype(np.float32), 256
    # sorted rows: ~20K logits pass the group-max bound, more than the select's store (8192):
    # the select then runs over the whole row in global memory
    srt = np.stack([np.arange(163840, dtype=np.float32), -np.arange(163840, dtype=np.float32)])
    yield "sorted", srt, 1024
    yield "sorted-k256", srt, 256


@pytest.mark.parametrize("name,logits,k", list(logits_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_topk_logsoftmax_matches_reference(name, logits, k):
    lp_r, ids_r = R.topk_logsoftmax(logits, k)
    lp_g, ids_g = kn.ops.topk_logsoftmax(logits, k, device="cuda")
    assert ids_g.dtype == np.int32 and lp_g.dtype == np.float32
    assert np.array_equal(ids_r, ids_g), name
    # log-sum-exp is a float64 sum in both; the summation order differs, so allow 1 ulp
    diff = np.abs(lp_g.astype(np.float64) - lp_r.astype(np.float64))
    ulp = np.spacing(np.abs(lp_r)).astype(np.float64)
    assert (diff <= ulp).all(), (name, float(np.max(diff / np.maximum(ulp, 1e-30))))


@pytest.mark.parametrize("budget,top_k", [(1, None), (16, None), (64, 8), (256, None), (1024, None), (300, 1024)])
def test_tree_build_from_logits_equals_tree_of_its_topk(budget, top_k):
    rng = np.random.default_rng(budget)
    for V in (50, 20000):
        logits = (rng.standard_normal((15, V)) * rng.uniform(1, 4)).astype(np.float32)
        gpu = kn.ops.tree_build_from_logits(logits, budget, top_k=top_k, device="cuda")
        k = min(budget if top_k is None else top_k, V)
        lp, ids = kn.ops.topk_logsoftmax(logits, k, device="cuda")
        assert_same_tree(kn.ops.tree_build(lp, ids, budget, device="cpu"), gpu)
        lp_r, ids_r = R.topk_logsoftmax(logits, k)
        if np.array_equal(lp_r, lp) and np.array_equal(ids_r, ids):
            assert_same_tree(R.tree_build_from_logits(logits, budget, top_k), gpu)


# ----------------------------------------------------------------------------- accept + compaction
def test_tree_accept_equals_cpu_twin():
    rng = np.random.default_rng(3)
    for cid, lp, ids, budget in tc.case_grid(n_small=1500, n_large=40, seed=79):
        tree = kn.ops.tree_build(lp, ids, budget, device="cpu")
        for choice in (tc.random_choice(rng, tree, 0.5), tc.random_choice(rng, tree, 1.0), tc.deepest_choice(tree)):
            p_c, b_c = kn.ops.tree_accept(tree, choice, device="cpu")
            p_g, b_g = kn.ops.tree_accept(tree, choice, device="cuda")
            assert p_g.dtype == np.int32 and np.array_equal(p_c, p_g) and b_c == b_g, cid


@pytest.mark.parametrize("row", [576, 3, 1, 144])
def test_kv_compact_equals_reference(row):
    rng = np.random.default_rng(row)
    for trial in range(40):
        layers = int(rng.integers(1, 5))
        L = int(rng.integers(0, 50))
        n = int(rng.integers(0, 300))
        S = L + n + 1 + int(rng.integers(0, 5))
        cache = rng.standard_normal((layers, S, row)).astype(np.float32)
        m = int(rng.integers(1, min(n + 1, 17) + 1))
        path = np.concatenate([[0], np.sort(rng.choice(np.arange(1, n + 1), m - 1, replace=False))]).astype(np.int32)
        want = cache.copy()
        for layer in range(layers):
            R.kv_compact(want[layer], path, L)
        got = cu.kv_compact(cache, path, L)
        assert np.array_equal(got, want), (row, trial)


def test_fused_accept_compact():
    rng = np.random.default_rng(11)
    for cid, lp, ids, budget in tc.case_grid(n_small=200, n_large=10, seed=80):
        tree = kn.ops.tree_build(lp, ids, budget, device="cpu")
        choice = tc.random_choice(rng, tree, 0.9)
        L = int(rng.integers(0, 30))
        cache = rng.standard_normal((3, L + tree.n + 2, 20)).astype(np.float32)
        path, bonus, got, result, next_root = cu.accept_compact(tree, choice, cache, L, round_outputs=True)
        p_r, b_r = R.tree_accept(tree, choice)
        assert np.array_equal(path, p_r) and bonus == b_r, cid
        # the GPU round's copy-back array and next root, from the reference walk
        want_res = np.concatenate([[len(p_r), tree.n, b_r], np.asarray(tree.tokens)[p_r[1:] - 1]]).astype(np.int32)
        assert np.array_equal(result, want_res) and next_root == b_r, cid
        want = cache.copy()
        for layer in range(3):
            R.kv_compact(want[layer], p_r, L)
        assert np.array_equal(got, want), cid


# ----------------------------------------------------------------------------- verify attention
def random_tree_visibility(rng, T):
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, T)], np.int32)
    return R.tree_visibility(parents)


def ref64(ql, qr, kvl, kr, vis, scale):
    """float64 absorbed MLA attention (the reference's math, through BLAS, row-chunked)."""
    T, H, C = ql.shape
    L = kvl.shape[0] - T
    k = np.concatenate([kvl, kr], axis=1).astype(np.float64)
    q = np.concatenate([ql, qr], axis=2).astype(np.float64).reshape(T * H, -1)
    mask = np.ones((T, L + T), bool)
    mask[:, L:] = vis
    out = np.empty((T * H, C))
    step = max(1, 2 ** 25 // max(1, L + T))
    for a in range(0, T * H, step):
        s = (q[a: a + step] @ k.T) * scale
        rows = np.arange(a, min(a + step, T * H)) // H
        s = np.where(mask[rows], s, -np.inf)
        s -= s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=1, keepdims=True)
        out[a: a + step] = p @ k[:, :C]
    return out.reshape(T, H, C)


def attn_case(seed, L, H, B, C=512, R_=64, tree=True):
    rng = np.random.default_rng(seed)
    T = B + 1
    ql = rng.standard_normal((T, H, C)).astype(np.float32)
    qr = rng.standard_normal((T, H, R_)).astype(np.float32)
    kvl = rng.standard_normal((L + T, C)).astype(np.float32)
    kr = rng.standard_normal((L + T, R_)).astype(np.float32)
    if tree:
        vis = random_tree_visibility(rng, T)
    else:
        vis = rng.random((T, T)) < 0.3
        np.fill_diagonal(vis, True)
    scale = float(1.0 / np.sqrt(192.0))
    return ql, qr, kvl, kr, vis, scale


def rel_err(out, ref):
    return float(np.linalg.norm(out.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-300))


ATTN_SIZES = [(L, H, B) for i, (L, B) in enumerate([(L, B) for L in (0, 1, 17, 257, 4099) for B in (0, 1, 17, 63, 256, 1024)])
              for H in ((1, 3, 16, 128)[i % 4], (1, 3, 16, 128)[(i + 2) % 4])]


@pytest.mark.parametrize("L,H,B", ATTN_SIZES)
def test_verify_attention_awkward_sizes(L, H, B):
    if L * H * (B + 1) > 4099 * 16 * 257 and not (L == 4099 and H == 128 and B == 1024):
        H = min(H, 16)  # keep the float64 oracle affordable; one full-size case remains
    ql, qr, kvl, kr, vis, scale = attn_case(L * 1000 + H * 10 + B, L, H, B)
    out = cu.verify_attention(ql, qr, kvl, kr, vis, scale)
    assert out.shape == ql.shape and out.dtype == np.float32
    assert np.isfinite(out).all()
    ref = ref64(ql, qr, kvl, kr, vis, scale)
    assert rel_err(out, ref) < 1e-5, (L, H, B, rel_err(out, ref))
    if (B + 1) * H * (L + B + 1) <= 2_000_000:  # the project's oracle itself on the small ones
        ref2 = R.verify_attention(ql, qr, kvl, kr, vis, scale)
        assert rel_err(out, ref2) < 1e-5


# every kernel: (force_kernel, force_naive, C, R): tiled, split-KV, decode, tensor cores, the plain kernel, and the rows
# kernel (shapes other than C = 512 / R = 64)
Q_SCALE_KERNELS = [(1, False, 512, 64), (2, False, 512, 64), (3, False, 512, 64), (4, False, 512, 64),
                   (0, True, 512, 64), (0, False, 96, 32)]


@pytest.mark.parametrize("fk,naive,C,R_", Q_SCALE_KERNELS)
@pytest.mark.parametrize("L,B", [(0, 16), (300, 16), (700, 0), (40, 64)])
def test_verify_attention_q_scale_equals_scaled_queries(fk, naive, C, R_, L, B):
    """q_scale[t] multiplies token t's scores: the same output as queries scaled by it beforehand (float64
    oracle on the scaled queries), in every kernel. Factors far from 1 (0.05 .. 4), so a kernel that ignored
    them, or applied one row's to another, fails."""
    ql, qr, kvl, kr, vis, scale = attn_case(7 * L + B + C, L, 4, B, C=C, R_=R_)
    f = np.random.default_rng(L + B).uniform(0.05, 4.0, B + 1).astype(np.float32)
    out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_naive=naive, force_kernel=fk, q_scale=f)
    ref = ref64(ql * f[:, None, None], qr * f[:, None, None], kvl, kr, vis, scale)
    assert rel_err(out, ref) < 1e-5, rel_err(out, ref)
    plain = ref64(ql, qr, kvl, kr, vis, scale)
    assert rel_err(plain, ref) > 1e-2  # the factors change the result


def test_verify_attention_q_scale_refused_with_exact():
    ql, qr, kvl, kr, vis, scale = attn_case(3, 20, 2, 4)
    kv = np.ascontiguousarray(np.concatenate([kvl, kr], axis=1))
    with pytest.raises((RuntimeError, ValueError)):
        N.cuda_verify_attention(ql, qr, kv, cu.pack_visibility(vis), scale, exact=True,
                                q_scale=np.ones(5, np.float32))


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_verify_attention_splits_and_naive(splits):
    ql, qr, kvl, kr, vis, scale = attn_case(9, 1000, 3, 40, tree=False)
    ref = ref64(ql, qr, kvl, kr, vis, scale)
    out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_splits=splits)
    assert rel_err(out, ref) < 1e-5
    naive = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_naive=True)
    assert rel_err(naive, ref) < 1e-5


@pytest.mark.parametrize("C,R_", [(32, 16), (512, 32), (100, 0 + 8)])
def test_verify_attention_other_shapes_use_plain_kernel(C, R_):
    ql, qr, kvl, kr, vis, scale = attn_case(4, 70, 5, 30, C=C, R_=R_)
    out = cu.verify_attention(ql, qr, kvl, kr, vis, scale)
    assert rel_err(out, ref64(ql, qr, kvl, kr, vis, scale)) < 1e-5


@pytest.mark.parametrize("C,R_,L,H,B", [(128, 32, 160, 8, 0), (128, 32, 517, 8, 16), (64, 32, 0, 4, 5),
                                         (64, 32, 300, 4, 0), (100, 8, 70, 5, 30), (96, 5, 255, 3, 2),
                                         (257, 3, 40, 2, 9), (1000, 64, 33, 3, 4), (32, 1, 1100, 3, 2),
                                         (128, 32, 4099, 2, 63)])
def test_verify_attention_rows_kernel_other_shapes(C, R_, L, H, B):
    """Shapes the fast kernels do not take (the embedded default's C = 128 / 64 with R = 32, odd
    widths, C above 128 where the key groups stop, long contexts) run the rows kernel; it and the
    plain reference kernel (force_naive) within 1e-5 of the float64 oracle."""
    ql, qr, kvl, kr, vis, scale = attn_case(C * 7 + L, L, H, B, C=C, R_=R_)
    ref = ref64(ql, qr, kvl, kr, vis, scale)
    out = cu.verify_attention(ql, qr, kvl, kr, vis, scale)
    assert rel_err(out, ref) < 1e-5, rel_err(out, ref)
    assert rel_err(cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_naive=True), ref) < 1e-5


@pytest.mark.parametrize("C", [64, 128, 200])
def test_verify_attention_rows_kernel_nan_only_from_visible_keys(C):
    """A NaN in a visible key row reaches every output row of the rows kernel; one in a tree entry
    that some rows do not see reaches exactly the rows that see it."""
    ql, qr, kvl, kr, vis, scale = attn_case(5, 50, 3, 12, C=C, R_=32)
    a = kvl.copy()
    a[7, 2] = np.nan
    assert np.isnan(cu.verify_attention(ql, qr, a, kr, vis, scale)).all()
    b = kvl.copy()
    j = 50 + 5  # tree node 5
    b[j, 1] = np.nan
    out = cu.verify_attention(ql, qr, b, kr, vis, scale)
    sees = np.asarray(vis)[:, 5].astype(bool)
    assert 0 < sees.sum() < len(sees)
    assert np.isnan(out[sees]).all() and np.isfinite(out[~sees]).all()


@pytest.mark.parametrize("C,R_,L,H,B", [(128, 32, 160, 8, 0), (64, 32, 1000, 4, 0), (128, 32, 517, 8, 16),
                                         (100, 8, 70, 5, 30), (257, 3, 333, 2, 9), (1000, 64, 200, 3, 4),
                                         (32, 1, 1100, 3, 2), (128, 32, 5000, 1, 0)])
def test_verify_attention_rows_kernel_key_splits(C, R_, L, H, B):
    """The rows kernel's key splits (grid y) and their merge: forced 1..32 splits (more splits than
    keys, uneven ranges, empty trailing splits) and the automatic count, with the committed length on
    the device below a host bound (as under graph capture): every result within 1e-5 of float64."""
    ql, qr, kvl, kr, vis, scale = attn_case(C * 3 + L + B, L, H, B, C=C, R_=R_)
    ref = ref64(ql, qr, kvl, kr, vis, scale)
    for splits in (0, 1, 2, 3, 7, 32):
        for l_bound in (None, L + 3000):
            out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_splits=splits, l_bound=l_bound)
            assert rel_err(out, ref) < 1e-5, (splits, l_bound, rel_err(out, ref))


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_verify_attention_rows_kernel_splits_nan_and_empty_rows(splits):
    """NaN and empty rows with the rows kernel's splits, as without them: a NaN in a visible
    committed key reaches every row (also when it is the only visible key of its split); a tree entry's NaN
    reaches only the rows that see it; with L = 0 a row that sees nothing is 0."""
    C, R_ = 128, 32
    ql, qr, kvl, kr, vis, scale = attn_case(11, 90, 3, 40, C=C, R_=R_)
    a = kvl.copy()
    a[7, 2] = np.nan
    assert np.isnan(cu.verify_attention(ql, qr, a, kr, vis, scale, force_splits=splits)).all()
    b = kvl.copy()
    j = 90 + 5  # tree node 5
    b[j, 1] = np.nan
    out = cu.verify_attention(ql, qr, b, kr, vis, scale, force_splits=splits)
    sees = np.asarray(vis)[:, 5].astype(bool)
    assert 0 < sees.sum() < len(sees)
    assert np.isnan(out[sees]).all() and np.isfinite(out[~sees]).all()
    # L = 91, T = 41, 132 keys: with 16 splits of 9 keys the committed key 90 starts split 10, whose
    # other keys are tree rows 0..7, which a row t >= 8 does not see (each tree row sees itself)
    qlc, qrc, c, krc, _, sc = attn_case(13, 91, 3, 40, C=C, R_=R_)
    c[90, 0] = np.nan
    out = cu.verify_attention(qlc, qrc, c, krc, np.eye(41, dtype=bool), sc, force_splits=splits)
    assert np.isnan(out).all()
    # L = 0: rows that see nothing get 0, the others match float64
    ql0, qr0, kvl0, kr0, vis0, scale0 = attn_case(12, 0, 3, 40, C=C, R_=R_)
    vis0 = vis0.copy()
    empty = np.zeros(41, bool)
    empty[1::3] = True
    vis0[empty] = False
    out = cu.verify_attention(ql0, qr0, kvl0, kr0, vis0, scale0, force_splits=splits)
    assert (out[empty] == 0).all()
    vref = vis0.copy()
    vref[np.flatnonzero(empty), np.flatnonzero(empty)] = True
    ref = ref64(ql0, qr0, kvl0, kr0, vref, scale0)
    assert rel_err(out[~empty], ref[~empty]) < 1e-5


def test_verify_attention_matches_reference_api_on_a_tree():
    lp, ids = realistic_case(1, 64)
    tree = kn.ops.tree_build(lp, ids, 64, device="cuda")
    T = tree.n + 1
    rng = np.random.default_rng(2)
    H, L = 8, 300
    ql = rng.standard_normal((T, H, 512)).astype(np.float32)
    qr = rng.standard_normal((T, H, 64)).astype(np.float32)
    kvl = rng.standard_normal((L + T, 512)).astype(np.float32)
    kr = rng.standard_normal((L + T, 64)).astype(np.float32)
    ref = R.verify_attention(ql, qr, kvl, kr, tree.visibility, 0.1)
    out = cu.verify_attention(ql, qr, kvl, kr, tree.visibility, 0.1)
    assert rel_err(out, ref) < 1e-5


# ----------------------------------------------------------------------------- verify attention: split-KV kernel,
# kernel choice, device-side L (CUDA-graph mode)
WS_CAP = 64 << 20   # verify_attention_workspace_bytes never exceeds this
WS_ROW = (512 + 2) * 4  # workspace bytes per (split, query row)


def attn_case_t(seed, L, H, T, mask):
    """Like attn_case with T rows and mask "tree" (random tree ancestors) or "causal"."""
    if mask == "tree":
        return attn_case(seed, L, H, T - 1, tree=True)
    ql, qr, kvl, kr, _, scale = attn_case(seed, L, H, T - 1, tree=True)
    return ql, qr, kvl, kr, np.tril(np.ones((T, T), bool)), scale


def row_err(out, ref):
    """Largest per-row relative error (a single wrong row shows even among thousands)."""
    o = out.astype(np.float64).reshape(-1, out.shape[-1])
    r = ref.reshape(-1, ref.shape[-1])
    return float(np.max(np.linalg.norm(o - r, axis=1) / np.maximum(np.linalg.norm(r, axis=1), 1e-30)))


def check_attn(out, ref, what):
    assert out.shape == ref.shape and out.dtype == np.float32, what
    assert np.isfinite(out).all(), what  # poisoned (NaN) output or workspace left unwritten
    assert rel_err(out, ref) < 1e-5, (what, rel_err(out, ref))
    assert row_err(out, ref) < 1e-4, (what, row_err(out, ref))


SPLITKV_LT = [(L, T) for L in (0, 1, 31, 32, 33, 517, 4099) for T in (1, 2, 5, 17, 65)]
SPLITKV_HS = (1, 3, 16, 64, 128)
SPLITKV_SIZES = [(L, T, SPLITKV_HS[(i + k) % 5], ("tree", "causal")[(i + k) % 2])
                 for i, (L, T) in enumerate(SPLITKV_LT) for k in (0, 2)]


@pytest.mark.parametrize("L,T,H,mask", SPLITKV_SIZES)
def test_verify_attention_splitkv_awkward_sizes(L, T, H, mask):
    ql, qr, kvl, kr, vis, scale = attn_case_t(L * 7919 + T * 31 + H, L, H, T, mask)
    ref = ref64(ql, qr, kvl, kr, vis, scale)
    nch = (L + T + 31) // 32
    for splits in (0, 1, 2, 7, 128):
        kernel, s = cu.verify_attention_choice(T, H, L, force_kernel=2, force_splits=splits)
        assert kernel == 2 and 1 <= s <= max(1, min(128, nch)), (kernel, s)
        if splits:
            assert s == min(splits, nch, max(1, WS_CAP // (T * H * WS_ROW))), (splits, s)
        out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=2, force_splits=splits)
        check_attn(out, ref, (L, T, H, mask, splits))


@pytest.mark.parametrize("L,T,H,mask", SPLITKV_SIZES[::2])
def test_verify_attention_splitkv_4_8_and_16_rows(L, T, H, mask):
    """The split-KV kernel with 4, 8 and 16 query rows per block (force_rows), each within the
    bound of the float64 reference, with key splits and L through a device int; the auto pick of
    rows equals the same rows forced, bit for bit."""
    ql, qr, kvl, kr, vis, scale = attn_case_t(L * 613 + T * 17 + H, L, H, T, mask)
    ref = ref64(ql, qr, kvl, kr, vis, scale)
    for rows in (4, 8, 16):
        assert cu.verify_attention_choice(T, H, L, force_kernel=2, force_rows=rows, rows=True)[2] == rows
        for splits in (0, 1, 3):
            for l_bound in (None, L + 100):
                out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=2, force_splits=splits,
                                          l_bound=l_bound, force_rows=rows)
                check_attn(out, ref, (L, T, H, mask, rows, splits, l_bound))
    kernel, s, rows = cu.verify_attention_choice(T, H, L, force_kernel=2, rows=True)
    assert rows in (4, 8, 16)
    auto = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=2)
    forced = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=2, force_splits=s, force_rows=rows)
    assert np.array_equal(auto, forced)


@pytest.mark.parametrize("kernel", [1, 2, 3, 4, "naive"])
@pytest.mark.parametrize("L,T", [(0, 5), (0, 70), (40, 9)])
def test_verify_attention_rows_that_see_nothing_get_zero(kernel, L, T):
    # a visibility row with no bits: with L = 0 the row sees nothing and must come out 0;
    # with L > 0 it still sees the L committed keys
    H = 3
    ql, qr, kvl, kr, vis, scale = attn_case_t(T + L, L, H, T, "tree")
    empty = np.zeros(T, bool)
    empty[1::3] = True
    vis = vis.copy()
    vis[empty] = False
    vis_ref = vis.copy()
    if L == 0:  # rows are independent: give the empty rows a key so the oracle stays finite
        vis_ref[np.flatnonzero(empty), np.flatnonzero(empty)] = True
    ref = ref64(ql, qr, kvl, kr, vis_ref, scale)
    keep = ~empty if L == 0 else np.ones(T, bool)
    kw = dict(force_naive=True) if kernel == "naive" else dict(force_kernel=kernel)
    for splits in (0, 1, 3):
        for l_bound in (None, L + 700):
            out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_splits=splits, l_bound=l_bound, **kw)
            what = (kernel, L, T, splits, l_bound)
            assert np.isfinite(out).all(), what
            if L == 0:
                assert (out[empty] == 0).all(), what
            check_attn(out[keep], ref[keep], what)


def mma_rule(M, N):
    """The measured rule for the tensor-core kernel (mma_wins in cuda/verify_attention.cu, docs/CUDA.md)."""
    return (M >= 2048 or (M >= 1024 and N >= 64) or (M >= 128 and N >= 512) or (M >= 64 and N >= 2048)
            or (M >= 16 and N >= 4096))


@pytest.mark.parametrize("H", [16, 64, 128])
@pytest.mark.parametrize("L", [0, 512, 4096])
def test_verify_attention_auto_on_decode_shapes(H, L):
    ql, qr, kvl, kr, vis, scale = attn_case_t(H + L, L, H, 1, "tree")
    ref = ref64(ql, qr, kvl, kr, vis, scale)
    out = cu.verify_attention(ql, qr, kvl, kr, vis, scale)
    check_attn(out, ref, (H, L))
    kernel, s = cu.verify_attention_choice(1, H, L)
    assert kernel in (1, 2, 4) and s >= 1
    assert (kernel == 4) == mma_rule(H, L + 1), (H, L, kernel)
    # the auto pick equals the same kernel forced with the same split count, bit for bit
    forced = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=kernel, force_splits=s)
    assert np.array_equal(out, forced)


def test_verify_attention_auto_picks_splitkv_for_ar_decode():
    # AR decode on mini-kimi (T=1, H=16, L=512): the tiled kernel's one 64-row block per split
    # is ~75 us of work for 16 rows; the split-KV kernel spreads 17 chunks over many SMs (the
    # two-pass decode kernels measured no faster: only when forced)
    kernel, s = cu.verify_attention_choice(1, 16, 512)
    assert kernel == 2 and s > 1, (kernel, s)
    kernel, s = cu.verify_attention_choice(1, 16, 2048)
    assert kernel == 2 and s > 1, (kernel, s)
    # ... from 4096 keys the tensor-core kernel (24.0 vs 25.2 us on the H200)
    kernel, s = cu.verify_attention_choice(1, 16, 4096)
    assert kernel == 4 and s > 1, (kernel, s)
    # verify steps of the model's trees take the tensor-core kernel (T = 17 / 65 at H = 16)
    for T, L in ((17, 512), (65, 512), (65, 4096), (257, 512)):
        kernel, s = cu.verify_attention_choice(T, 16, L)
        assert kernel == 4, (T, L, kernel, s)
    # ... and a big verify at long context; a small tree with no context stays on split-KV
    kernel, s = cu.verify_attention_choice(1025, 64, 32768)
    assert kernel == 4, (kernel, s)
    kernel, s = cu.verify_attention_choice(17, 16, 0)
    assert kernel == 2, (kernel, s)


def test_verify_attention_workspace_covers_choice_and_grows_with_L():
    Ls = [0, 1, 31, 32, 33, 127, 128, 129, 511, 512, 513, 4095, 4096, 4097, 32767, 32768, 131071]
    for T in (1, 2, 5, 17, 65, 257, 1025, 2048, 2049):
        for H in (1, 3, 16, 64, 128):
            M = T * H
            for fk in (0, 1, 2, 3, 4):
                for fs in (0, 2, 7, 128):
                    prev = 0
                    for L in Ls:
                        ws = N.cuda_verify_attention_workspace_bytes(T, H, 512, 64, L, 576, force_kernel=fk,
                                                                    force_splits=fs)
                        kernel, s = cu.verify_attention_choice(T, H, L, force_kernel=fk, force_splits=fs)
                        what = (T, H, L, fk, fs, kernel, s, ws)
                        assert kernel in (1, 2, 3, 4), what
                        N_ = L + T
                        if kernel == 3:  # decode: only forced, up to 1024 rows and 16384 keys
                            assert fk == 3 and M <= 1024 and L + T <= 16384, what
                            assert s == 1 and ws >= M * ((L + T + 3) // 4 * 4) * 4, what
                        elif fk == 4 or (fk == 0 and mma_rule(M, N_)):  # tensor cores: forced or the measured rule
                            assert kernel == 4, what
                        elif fk in (2, 3) or T > 2048:  # the tiled kernel gathers at most 2048 tree rows
                            assert kernel == 2, what
                        elif fk == 1:
                            assert kernel == 1, what
                        else:
                            assert kernel in (1, 2), what
                        assert 1 <= s <= 128, what
                        if kernel in (2, 4):
                            assert s <= max(1, (L + T + 31) // 32), what
                        assert ws <= WS_CAP, what
                        assert ws >= (s * M * WS_ROW if s > 1 else 0), what
                        assert ws >= prev, what  # sized at the longest L, it covers every shorter one
                        prev = ws


@pytest.mark.parametrize("kernel", [0, 1, 2, 3, 4, "naive"])
@pytest.mark.parametrize("L,l_bound", [(0, 0), (0, 1000), (33, 34), (33, 100000), (517, 600), (517, 40000),
                                       (4099, 4099 + 128 * 7)])
def test_verify_attention_device_L(kernel, L, l_bound):
    T, H = 17, 3
    ql, qr, kvl, kr, vis, scale = attn_case_t(L + l_bound, L, H, T, "tree" if L % 2 else "causal")
    ref = ref64(ql, qr, kvl, kr, vis, scale)
    kw = dict(force_naive=True) if kernel == "naive" else dict(force_kernel=kernel)
    for splits in (0, 1, 3, 128):
        out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_splits=splits, l_bound=l_bound, **kw)
        check_attn(out, ref, (kernel, L, l_bound, splits))


def test_verify_attention_device_L_big_rows():
    # many row groups / row blocks with a bound far above L, both fast kernels and auto
    T, H, L = 65, 16, 300
    ql, qr, kvl, kr, vis, scale = attn_case_t(5, L, H, T, "tree")
    ref = ref64(ql, qr, kvl, kr, vis, scale)
    for kernel in (0, 1, 2, 3, 4):
        for l_bound in (L, 4096, 65536):
            out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=kernel, l_bound=l_bound)
            check_attn(out, ref, (kernel, l_bound))


def test_verify_attention_l_bound_below_L_is_rejected():
    ql, qr, kvl, kr, vis, scale = attn_case_t(1, 40, 2, 3, "tree")
    with pytest.raises(Exception):
        cu.verify_attention(ql, qr, kvl, kr, vis, scale, l_bound=39)
    with pytest.raises(Exception):
        cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=5)
    with pytest.raises(Exception):
        cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=2, force_rows=12)


def test_verify_attention_more_than_2048_tree_rows_use_splitkv():
    # the tiled kernel gathers at most 2048 tree rows: force_kernel=1 takes split-KV; auto takes
    # the tensor-core kernel (2100 query rows), which has no tree-row limit
    T, H, L = 2100, 1, 50
    ql, qr, kvl, kr, vis, scale = attn_case_t(3, L, H, T, "causal")
    assert cu.verify_attention_choice(T, H, L)[0] == 4
    assert cu.verify_attention_choice(T, H, L, force_kernel=1)[0] == 2
    ref = ref64(ql, qr, kvl, kr, vis, scale)
    for fk in (0, 1, 2, 4):
        check_attn(cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=fk), ref, fk)


DECODE_SIZES = [(L, T, H, ("tree", "causal")[(L + T + H) % 2]) for L in (0, 1, 15, 16, 17, 517, 2047, 4099)
                for T, H in ((1, 1), (1, 16), (1, 64), (2, 3), (5, 16), (17, 16), (65, 3), (16, 64))]


@pytest.mark.parametrize("L,T,H,mask", DECODE_SIZES)
def test_verify_attention_decode_kernels_awkward_sizes(L, T, H, mask):
    """The two-pass decode kernels forced (force_kernel=3): partial row groups (M % 16), key
    blocks cut by N = L + T, tree rows masked per node, with L through a device int too."""
    ql, qr, kvl, kr, vis, scale = attn_case_t(L * 131 + T * 7 + H, L, H, T, mask)
    ref = ref64(ql, qr, kvl, kr, vis, scale)
    assert cu.verify_attention_choice(T, H, L, force_kernel=3) == (3, 1)
    for l_bound in (None, L + 37, 16384 - T):
        out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=3, l_bound=l_bound)
        check_attn(out, ref, (L, T, H, mask, l_bound))
    assert cu.verify_attention_choice(T, H, L)[0] != 3  # never the auto pick (measured slower)


# ----------------------------------------------------------------------------- verify attention: tensor cores
MMA_LTH = [(0, 1, 1), (0, 2, 16), (1, 5, 3), (31, 17, 16), (32, 1, 32), (33, 65, 16), (517, 17, 16),
           (517, 2, 64), (100, 257, 16), (0, 1025, 1), (4099, 17, 16), (4099, 65, 3), (2047, 129, 128),
           (63, 33, 7), (700, 9, 5)]
MMA_SIZES = [(L, T, H, ("tree", "causal")[i % 2]) for i, (L, T, H) in enumerate(MMA_LTH)]


@pytest.mark.parametrize("L,T,H,mask", MMA_SIZES)
def test_verify_attention_mma_awkward_sizes(L, T, H, mask):
    """The tensor-core kernel forced (force_kernel=4): partial row blocks (M % 32), chunks cut by
    N = L + T, tree rows masked per node, key splits (partials and the combine), L through a
    device int; within the float64 bounds of the other kernels; outputs and partials start as
    NaN, so an unwritten element fails."""
    ql, qr, kvl, kr, vis, scale = attn_case_t(L * 389 + T * 13 + H, L, H, T, mask)
    ref = ref64(ql, qr, kvl, kr, vis, scale)
    nch = (L + T + 31) // 32
    for splits in (0, 1, 2, 7, 128):
        kernel, s = cu.verify_attention_choice(T, H, L, force_kernel=4, force_splits=splits)
        assert kernel == 4 and 1 <= s <= max(1, min(128, nch)), (kernel, s)
        if splits:
            assert s == min(splits, nch, max(1, WS_CAP // (T * H * WS_ROW))), (splits, s)
        for l_bound in ((None, L + 100) if splits in (0, 2) else (None,)):
            out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=4, force_splits=splits,
                                      l_bound=l_bound)
            check_attn(out, ref, (L, T, H, mask, splits, l_bound))
    # deterministic: the same call twice gives the same bits
    a = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=4, force_splits=3)
    b = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=4, force_splits=3)
    assert np.array_equal(a, b)


def test_verify_attention_mma_uneven_splits():
    """The tensor-core kernel's auto split choice may give the last row block (at most 16 rows, one
    m-tile) another split count than the full row blocks (then `splits` = the larger: the partial
    slots; the row block with fewer splits marks its other slots empty). On the shapes below at
    least one such choice must come up, and every auto choice (also with L through a device int)
    stays within the float64 bounds; forced splits are equal for all row blocks."""
    shapes = [(4096, 17, 16), (4099, 17, 16), (2000, 17, 16), (3000, 33, 16), (4096, 9, 16), (1500, 65, 16)]
    uneven = 0
    for L, T, H in shapes:
        k, s, rows, sf, sl = cu.verify_attention_choice(T, H, L, force_kernel=4, detail=True)
        assert k == 4 and rows == 32 and s == max(sf, sl) and sf >= 1 and sl >= 1, (L, T, H, s, sf, sl)
        uneven += sf != sl
        ql, qr, kvl, kr, vis, scale = attn_case_t(L + 7 * T, L, H, T, "tree")
        ref = ref64(ql, qr, kvl, kr, vis, scale)
        for l_bound in (None, L + 300):
            out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=4, l_bound=l_bound)
            check_attn(out, ref, (L, T, H, sf, sl, l_bound))
        assert cu.verify_attention_choice(T, H, L, force_kernel=4, force_splits=5, detail=True)[3:] == (5, 5)
    assert uneven >= 1, "no shape took uneven splits"


def test_verify_attention_mma_large_scores_and_real_tree():
    """Scores far from 0 (queries scaled x30: softmax close to one-hot, the running max moves
    between chunks) and a drafter-like tree from the GPU tree build."""
    lp, ids = realistic_case(3, 256)
    tree = kn.ops.tree_build(lp, ids, 256, device="cuda")
    T, H, L = tree.n + 1, 16, 1500
    rng = np.random.default_rng(8)
    ql = (30 * rng.standard_normal((T, H, 512))).astype(np.float32)
    qr = (30 * rng.standard_normal((T, H, 64))).astype(np.float32)
    kvl = rng.standard_normal((L + T, 512)).astype(np.float32)
    kr = rng.standard_normal((L + T, 64)).astype(np.float32)
    ref = ref64(ql, qr, kvl, kr, tree.visibility, 0.07)
    for fk in (4, 2):
        out = cu.verify_attention(ql, qr, kvl, kr, tree.visibility, 0.07, force_kernel=fk)
        check_attn(out, ref, fk)


CANONICAL_NANS = (0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000)  # CUDA's canonical NaN (all mantissa bits), negated, numpy's


@pytest.mark.parametrize("nan_bits", CANONICAL_NANS)
@pytest.mark.parametrize("kernel", [1, 2, 4, "naive"])
def test_verify_attention_nan_key_propagates(kernel, nan_bits):
    """A NaN in a committed key row reaches every output row, in every kernel: the tensor-core
    kernel's TF32 rounding must not turn a NaN into a number (a NaN whose top mantissa bits are
    all ones carries into the sign bit when rounded)."""
    T, H, L = 17, 16, 600
    ql, qr, kvl, kr, vis, scale = attn_case_t(77, L, H, T, "tree")
    kvl = kvl.copy()
    kvl[5, 3] = np.array([nan_bits], np.uint32).view(np.float32)[0]
    kw = dict(force_naive=True) if kernel == "naive" else dict(force_kernel=kernel)
    out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, **kw)
    assert np.isnan(out).all(), (kernel, hex(nan_bits), int(np.isnan(out).sum()), out.size)


@pytest.mark.parametrize("splits", [0, 1, 2, 3, 7])
def test_verify_attention_tiled_forced_matches(splits):
    ql, qr, kvl, kr, vis, scale = attn_case(10, 1000, 3, 40, tree=False)
    ref = ref64(ql, qr, kvl, kr, vis, scale)
    for fk in (1, 2):
        kernel, _ = cu.verify_attention_choice(41, 3, 1000, force_kernel=fk, force_splits=splits)
        assert kernel == fk
        out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=fk, force_splits=splits)
        check_attn(out, ref, (fk, splits))


def test_tf32_split_bits():
    """The 3xTF32 operand split of every tensor-core kernel (tile_mma.h split_tf32), bit for bit
    against a NumPy reference: hi = x rounded to TF32 to nearest, ties to even (low 13 bits zero),
    lo = (x - hi) truncated to TF32; a NaN gives NaN hi and lo, +-inf gives +-inf hi and a NaN lo.
    Inputs: both signs, every exponent (subnormals, inf and NaN included), 1024 top-mantissa
    patterns and the low-13-bit rounding boundaries (0, 1, 0xfff, the tie 0x1000, 0x1001, 0x1fff)
    plus two random low parts: 4.2M values."""
    rng = np.random.default_rng(5)
    sign = np.arange(2, dtype=np.uint32)[:, None, None, None] << 31
    expo = np.arange(256, dtype=np.uint32)[None, :, None, None] << 23
    mant = np.arange(1024, dtype=np.uint32)[None, None, :, None] << 13
    lows = np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0, 0], np.uint32)
    low = np.broadcast_to(lows, (2, 256, 1024, 8)).copy()
    low[..., 6:] = rng.integers(0, 0x2000, size=(2, 256, 1024, 2), dtype=np.uint32)
    bits = (sign | expo | mant | low).reshape(-1)
    x = bits.view(np.float32)
    hi, lo = N.cuda_tf32_split(x)
    assert hi.dtype == np.uint32 and lo.dtype == np.uint32 and hi.shape == lo.shape == x.shape
    nan, inf = np.isnan(x), np.isinf(x)
    fin = ~nan & ~inf
    # to nearest, ties to even, in integers (a carry past the largest finite value gives inf)
    h_ref = ((bits + np.uint32(0xFFF) + ((bits >> 13) & 1)) & np.uint32(0xFFFFE000)).astype(np.uint32)
    with np.errstate(invalid="ignore", over="ignore"):
        r = x - h_ref.view(np.float32)  # exact in float32 (or -+inf past the largest finite value)
    lo_ref = r.view(np.uint32) & np.uint32(0xFFFFE000)
    bad_hi = fin & (hi != h_ref)
    bad_lo = fin & (lo != lo_ref)
    assert not bad_hi.any(), [hex(v) for v in bits[bad_hi][:5]]
    assert not bad_lo.any(), [hex(v) for v in bits[bad_lo][:5]]
    assert np.isnan(hi[nan].view(np.float32)).all() and np.isnan(lo[nan].view(np.float32)).all()
    assert np.array_equal(hi[inf], bits[inf]) and np.isnan(lo[inf].view(np.float32)).all()
    # the bound the kernels rely on: |x - (hi + lo)| <= 2^-21 |x| for normal finite x
    # whose rounding stays finite
    normal = fin & (np.abs(x) >= np.float32(2.0**-100)) & np.isfinite(h_ref.view(np.float32))
    xs = x[normal].astype(np.float64)
    err = np.abs(xs - hi[normal].view(np.float32).astype(np.float64) - lo[normal].view(np.float32).astype(np.float64))
    assert (err <= np.abs(xs) * 2.0**-21).all()
