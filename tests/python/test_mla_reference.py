"""The absorbed-MLA tree-verify attention reference equals the plain (per-head K/V) attention.

Random sizes at awkward values, L = 0 and L > 0, T = 1..33, visibility from random trees
(ancestor-only incl. self) and causal masks. NumPy only.
"""
import numpy as np
import pytest

from kdtree_native.reference import tree_visibility
from kdtree_native.reference.mla import (
    absorb_queries, attention_mask, expand_kv, unabsorb_output, verify_attention, verify_attention_plain,
)


class Dims:
    """The few config fields the MLA reference reads."""

    def __init__(self, H, C, Dn, Dv):
        self.num_attention_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim = H, C, Dn, Dv


def random_tree_visibility(rng, T):
    """Ancestor-only visibility (incl. self) of a random tree with T nodes, node 0 the root."""
    parents = np.full(T, -1)
    for j in range(1, T):
        parents[j] = rng.integers(0, j)
    return tree_visibility(parents), parents


def rel_err(a, b):
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)


def run_case(rng, T, L, H, C, R, Dn, Dv, vis):
    dims = Dims(H, C, Dn, Dv)
    q_nope = rng.standard_normal((T, H, Dn))
    q_rope = rng.standard_normal((T, H, R))
    kv_latent = rng.standard_normal((L + T, C))
    k_rope = rng.standard_normal((L + T, R))
    w_kv_b = rng.standard_normal((H * (Dn + Dv), C)) / np.sqrt(C)
    scale = 1.0 / np.sqrt(Dn + R) * rng.uniform(0.5, 2.0)

    out_latent = verify_attention(absorb_queries(q_nope, w_kv_b, dims), q_rope, kv_latent, k_rope, vis, scale)
    absorbed = unabsorb_output(out_latent, w_kv_b, dims)                     # [T, H, Dv]

    k, v = expand_kv(kv_latent, k_rope, w_kv_b, dims)
    plain = verify_attention_plain(np.concatenate([q_nope, q_rope], -1), k, v, vis, scale)
    assert absorbed.shape == plain.shape == (T, H, Dv)
    assert absorbed.dtype == np.float64
    assert rel_err(absorbed, plain) < 1e-12
    return absorbed, (q_nope, q_rope, kv_latent, k_rope, w_kv_b, scale, dims)


@pytest.mark.parametrize("L", [0, 1, 17, 63])
@pytest.mark.parametrize("T", [1, 2, 3, 7, 16, 33])
def test_absorbed_equals_plain_on_random_trees(T, L):
    rng = np.random.default_rng(1000 * T + L)
    H = int(rng.integers(1, 5))
    C = int(rng.choice([3, 16, 17]))
    R = int(rng.choice([2, 4, 8]))
    Dn, Dv = int(rng.integers(1, 13)), int(rng.integers(1, 11))
    vis, _ = random_tree_visibility(rng, T)
    run_case(rng, T, L, H, C, R, Dn, Dv, vis)


@pytest.mark.parametrize("L", [0, 5])
def test_absorbed_equals_plain_causal_and_chain(L):
    rng = np.random.default_rng(7 + L)
    T = 19
    causal = np.tril(np.ones((T, T), dtype=bool))
    run_case(rng, T, L, 3, 16, 4, 8, 6, causal)
    # with L > 0 a diagonal-only mask is allowed too (each node sees itself + the context)
    run_case(rng, T, L, 2, 5, 2, 3, 4, np.eye(T, dtype=bool))


def test_matches_a_loop_over_rows():
    """The vectorised reference equals an explicit per-row, per-head softmax."""
    rng = np.random.default_rng(3)
    T, L, H, C, R = 5, 4, 2, 6, 4
    vis, _ = random_tree_visibility(rng, T)
    q_lat, q_rope = rng.standard_normal((T, H, C)), rng.standard_normal((T, H, R))
    lat, kr = rng.standard_normal((L + T, C)), rng.standard_normal((L + T, R))
    out = verify_attention(q_lat, q_rope, lat, kr, vis, 0.3)
    for i in range(T):
        rows = list(range(L)) + [L + j for j in range(T) if vis[i, j]]
        for h in range(H):
            s = np.array([0.3 * (q_lat[i, h] @ lat[r] + q_rope[i, h] @ kr[r]) for r in rows])
            p = np.exp(s - s.max())
            p /= p.sum()
            np.testing.assert_allclose(out[i, h], p @ lat[rows], rtol=1e-12, atol=1e-12)


def test_invisible_entries_do_not_matter():
    rng = np.random.default_rng(11)
    T, L = 12, 6
    vis, parents = random_tree_visibility(rng, T)
    q_lat, q_rope = rng.standard_normal((T, 2, 8)), rng.standard_normal((T, 2, 4))
    lat, kr = rng.standard_normal((L + T, 8)), rng.standard_normal((L + T, 4))
    base = verify_attention(q_lat, q_rope, lat, kr, vis, 0.5)
    leaf = T - 1                      # the last node has no descendants
    # change an entry no other node sees: only rows that see it change
    lat2 = lat.copy()
    lat2[L + leaf] += 5.0
    changed = verify_attention(q_lat, q_rope, lat2, kr, vis, 0.5)
    for i in range(T):
        if vis[i, leaf]:
            assert not np.allclose(changed[i], base[i])
        else:
            np.testing.assert_array_equal(changed[i], base[i])


def test_bad_inputs():
    rng = np.random.default_rng(0)
    q_lat, q_rope = rng.standard_normal((3, 2, 4)), rng.standard_normal((3, 2, 2))
    lat, kr = rng.standard_normal((3, 4)), rng.standard_normal((3, 2))
    with pytest.raises(ValueError, match="sees nothing"):
        verify_attention(q_lat, q_rope, lat, kr, np.zeros((3, 3), bool), 1.0)
    with pytest.raises(ValueError, match="visibility"):
        verify_attention(q_lat, q_rope, lat, kr, np.ones((3, 2), bool), 1.0)
    with pytest.raises(ValueError, match="shape"):
        verify_attention(q_lat, q_rope, lat[:, :3], kr, np.eye(3, dtype=bool), 1.0)
    assert attention_mask(2, np.eye(3, dtype=bool)).shape == (3, 5)
