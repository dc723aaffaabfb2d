"""The MoE expert schedule on the device (cuda::moe_group): the one-block kernel (A <= 1024
assignments, E <= 1024 experts) against the two-pass kernels and a NumPy construction of the
same schedule (counts, offsets, stable slots in assignment order, tiles in expert order).
Skipped without a usable CUDA device."""
import numpy as np
import pytest

import kdtree_native as kn

if not kn.cuda_available():
    pytest.skip("no usable CUDA device", allow_module_level=True)

from kdtree_native import _native as N  # noqa: E402

pytestmark = pytest.mark.cuda


def reference(idx, E, TR):
    flat = idx.reshape(-1)
    counts = np.bincount(flat, minlength=E).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    order = np.argsort(flat, kind="stable")  # slots: by expert, then assignment order
    slot_of = np.empty_like(flat)
    slot_of[order] = np.arange(flat.size)
    slot_token = (order // idx.shape[1]).astype(np.int32)
    tiles = [(e, offsets[e] + j * TR) for e in range(E) for j in range((counts[e] + TR - 1) // TR)]
    return counts, offsets, slot_token, slot_of.astype(np.int32), tiles


@pytest.mark.parametrize("T,K,E,TR", [(1, 8, 64, 8), (17, 8, 64, 8), (3, 2, 6, 1), (128, 8, 256, 8),
                                      (1, 1, 1, 1), (64, 16, 1024, 4), (40, 8, 64, 64), (200, 8, 64, 8)])
def test_schedule_equals_reference_and_two_pass(T, K, E, TR):
    rng = np.random.default_rng(T * 1000 + E)
    for trial in range(3):
        if trial == 2:  # skewed: most assignments to a few experts
            idx = rng.integers(0, min(E, 3), (T, K)).astype(np.int32)
        else:
            idx = np.stack([rng.permutation(E)[:K] if K <= E else rng.integers(0, E, K) for _ in range(T)]).astype(np.int32)
        counts, offsets, slot_token, slot_of, tiles = reference(idx, E, TR)
        for two_pass in (False, True):
            d = N.cuda_moe_group(idx, E, TR, two_pass)
            assert np.array_equal(d["counts"], counts)
            assert np.array_equal(d["offsets"], offsets)
            assert np.array_equal(d["slot_token"], slot_token)
            assert np.array_equal(d["slot_of"], slot_of)
            n = d["num_tiles"]
            assert n == len(tiles)
            got = list(zip(d["tile_expert"][:n].tolist(), d["tile_row0"][:n].tolist()))
            assert got == [(int(e), int(r)) for e, r in tiles]


ROUTE_CASES = [(1, 64, 8, 1, 1), (2, 64, 8, 1, 1), (4, 64, 8, 8, 4), (3, 256, 8, 8, 4), (1, 6, 2, 2, 1),
               (4, 16, 8, 1, 1), (5, 64, 8, 1, 1), (17, 64, 8, 1, 1),
               # the two-barrier path (T <= 4, topk_group == G, K <= 32) at its edges: K = 32, more
               # assignments than experts, Kimi-K2's 384 experts, all 1024, groups all kept
               (1, 64, 32, 1, 1), (4, 6, 4, 1, 1), (3, 6, 6, 1, 1), (1, 384, 8, 1, 1), (4, 1024, 8, 1, 1),
               (2, 64, 8, 4, 4), (4, 40, 32, 1, 1), (1, 2, 1, 1, 1)]


@pytest.mark.parametrize("T,E,K,G,tg", ROUTE_CASES)
@pytest.mark.parametrize("kind", ["normal", "ties", "nan"])
def test_route_group_one_launch_equals_two(T, E, K, G, tg, kind):
    """moe_route_group (one block routes the few tokens, then builds the schedule; T <= 4) gives
    bit for bit what moe_route + moe_group give, with its two-barrier path (no group masking, K <=
    32) and with its block-per-token path; the ids agree with the float64 reference router and the
    schedule with the NumPy construction; logits with a row stride (the model's merged [router |
    shared gate/up] rows), tied and NaN logits, tiles of 1 / 3 / 8 rows, and T > 4 (the two-launch
    fallback) included."""
    from kdtree_native.reference.model import moe_route
    from types import SimpleNamespace
    rng = np.random.default_rng(T * 100 + E + K)
    pad = 7 if T % 2 else 0
    lg = (rng.standard_normal((T, E + pad)) * 2).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.1).astype(np.float32)
    if kind == "ties":  # few distinct selection values: the order falls to the expert index
        lg = np.round(lg).astype(np.float32)
        bias[:] = 0.0
    elif kind == "nan":  # a NaN logit ranks as -inf (never chosen unless K needs it)
        lg[:, rng.integers(0, E, max(1, E // 8))] = np.nan
    for TR in (1, 3, 8):
        one = N.cuda_moe_route_group(lg, bias, E, K, G, tg, True, 2.5, TR, True)
        blk = N.cuda_moe_route_group(lg, bias, E, K, G, tg, True, 2.5, TR, True, block_path=True)
        two = N.cuda_moe_route_group(lg, bias, E, K, G, tg, True, 2.5, TR, False)
        for key in one:
            assert np.array_equal(one[key], two[key], equal_nan=key == "topk_w"), (TR, key)
            assert np.array_equal(blk[key], two[key], equal_nan=key == "topk_w"), (TR, key)
        counts, offsets, slot_token, slot_of, tiles = reference(one["topk_idx"], E, TR)
        assert np.array_equal(one["counts"], counts) and np.array_equal(one["offsets"], offsets)
        assert np.array_equal(one["slot_token"], slot_token) and np.array_equal(one["slot_of"], slot_of)
        n = int(one["num_tiles"][0])
        assert list(zip(one["tile_expert"][:n].tolist(), one["tile_row0"][:n].tolist())) == \
            [(int(e), int(r)) for e, r in tiles]
    if kind == "nan":
        return  # the float64 reference's order of NaN scores is not the kernels' (-inf) one
    cfg = SimpleNamespace(n_routed_experts=E, n_group=G, topk_group=tg, num_experts_per_tok=K, norm_topk_prob=True,
                          routed_scaling_factor=2.5)
    # the router's logits as x @ w^T with w = I: the reference routes the same scores
    ids, w = moe_route(cfg, lg[:, :E].astype(np.float64), np.eye(E), bias.astype(np.float64))
    assert np.array_equal(one["topk_idx"], ids.astype(np.int32))
    assert np.allclose(one["topk_w"], w, rtol=1e-5)
