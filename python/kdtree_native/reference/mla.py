"""MLA tree-verify attention, NumPy reference (float64): absorbed and plain forms.

Where it sits: the oracle for the CPU and CUDA verify-attention kernels. One call attends the
T new tokens (the tree's nodes, a decode step or a prefill chunk) to a latent cache of L
committed tokens plus the T new tokens' own entries, under a visibility mask.

Legend: T = new tokens (tree nodes), L = committed cache length, H = heads,
C = kv_lora_rank (latent), R = qk_rope_head_dim, Dn = qk_nope_head_dim, Dv = v_head_dim.

The latent cache holds per token the normed latent `kv_latent` [C] and the roped shared key
`k_rope` [R] (576 floats for Kimi K2 / DeepSeek-V3). Per head, HF's plain attention is
    k_h = [W_UK_h @ latent, k_rope]      v_h = W_UV_h @ latent
with `kv_b_proj.weight` viewed as [H, Dn + Dv, C]: W_UK_h = rows :Dn, W_UV_h = rows Dn:.
Weight absorption moves W_UK into the query and W_UV after the attention:
    q_nope . (W_UK_h latent) = (W_UK_h^T q_nope) . latent = q_latent . latent
    sum_j p_j W_UV_h latent_j = W_UV_h (sum_j p_j latent_j)
so attention runs over the C + R floats per cached token, never expanding per-head K/V.

Visibility: new row i sees all L committed rows, and new row j iff visibility[i, j]
(the tree's own entries are cache rows L..L+T-1; a tree's mask is ancestor-only incl. self,
a prefill's is causal).
"""
from __future__ import annotations

import numpy as np

__all__ = [
    "verify_attention", "verify_attention_plain", "absorb_queries", "unabsorb_output",
    "split_kv_b", "expand_kv", "attention_mask",
]


def attention_mask(L: int, visibility) -> np.ndarray:
    """bool [T, L+T]: True where new row i may attend cache row j."""
    vis = np.asarray(visibility, dtype=bool)
    T = vis.shape[0]
    if vis.shape != (T, T):
        raise ValueError(f"visibility must be [T, T], got {vis.shape}")
    mask = np.ones((T, L + T), dtype=bool)
    mask[:, L:] = vis
    if not mask.any(axis=1).all():
        bad = int(np.flatnonzero(~mask.any(axis=1))[0])
        raise ValueError(f"row {bad} sees nothing (L == 0 and an empty visibility row)")
    return mask


def _masked_softmax(scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """softmax over the last axis of scores [T, H, N] where mask [T, N] is True."""
    scores = np.where(mask[:, None, :], scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    return p / p.sum(axis=-1, keepdims=True)


def verify_attention(q_latent, q_rope, kv_latent, k_rope, visibility, scale) -> np.ndarray:
    """Absorbed MLA attention over the latent cache.

    q_latent  [T, H, C]   queries already multiplied by W_UK (see absorb_queries)
    q_rope    [T, H, R]   roped query part
    kv_latent [L+T, C]    normed latents: L committed rows, then the T new ones
    k_rope    [L+T, R]    roped shared keys, same rows
    visibility bool [T, T]
    scale     softmax scale (cfg.softmax_scale)
    returns out_latent float64 [T, H, C] (apply unabsorb_output to get [T, H, Dv])
    """
    q_latent = np.asarray(q_latent, dtype=np.float64)
    q_rope = np.asarray(q_rope, dtype=np.float64)
    kv_latent = np.asarray(kv_latent, dtype=np.float64)
    k_rope = np.asarray(k_rope, dtype=np.float64)
    T, H, C = q_latent.shape
    N = kv_latent.shape[0]
    R = q_rope.shape[2]
    if q_rope.shape[:2] != (T, H) or kv_latent.shape != (N, C) or k_rope.shape != (N, R) or N < T:
        raise ValueError(f"shape mismatch: q_latent {q_latent.shape}, q_rope {q_rope.shape}, "
                         f"kv_latent {kv_latent.shape}, k_rope {k_rope.shape}")
    mask = attention_mask(N - T, visibility)
    scores = (np.einsum("thc,nc->thn", q_latent, kv_latent)
              + np.einsum("thr,nr->thn", q_rope, k_rope)) * scale     # [T, H, N]
    p = _masked_softmax(scores, mask)
    return np.einsum("thn,nc->thc", p, kv_latent)


def split_kv_b(w_kv_b, cfg) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj.weight [H*(Dn+Dv), C] -> (W_UK [H, Dn, C], W_UV [H, Dv, C]) float64."""
    H, Dn, Dv, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    w = np.asarray(w_kv_b, dtype=np.float64).reshape(H, Dn + Dv, C)
    return w[:, :Dn, :], w[:, Dn:, :]


def absorb_queries(q_nope, w_kv_b, cfg) -> np.ndarray:
    """q_nope [T, H, Dn] -> q_latent [T, H, C] = W_UK_h^T q_nope_h."""
    w_uk, _ = split_kv_b(w_kv_b, cfg)
    return np.einsum("thd,hdc->thc", np.asarray(q_nope, dtype=np.float64), w_uk)


def unabsorb_output(out_latent, w_kv_b, cfg) -> np.ndarray:
    """out_latent [T, H, C] -> per-head attention output [T, H, Dv] = W_UV_h out_latent_h."""
    _, w_uv = split_kv_b(w_kv_b, cfg)
    return np.einsum("thc,hvc->thv", np.asarray(out_latent, dtype=np.float64), w_uv)


def expand_kv(kv_latent, k_rope, w_kv_b, cfg) -> tuple[np.ndarray, np.ndarray]:
    """Per-head keys and values from the latent cache (HF `expand_kv`):
    kv_latent [N, C], k_rope [N, R] -> k [N, H, Dn+R], v [N, H, Dv]."""
    w_uk, w_uv = split_kv_b(w_kv_b, cfg)
    kv_latent = np.asarray(kv_latent, dtype=np.float64)
    k_nope = np.einsum("nc,hdc->nhd", kv_latent, w_uk)
    v = np.einsum("nc,hvc->nhv", kv_latent, w_uv)
    k_rope = np.broadcast_to(np.asarray(k_rope, dtype=np.float64)[:, None, :],
                             (kv_latent.shape[0], cfg.num_attention_heads, k_rope.shape[-1]))
    return np.concatenate([k_nope, k_rope], axis=-1), v


def verify_attention_plain(q, k, v, visibility, scale) -> np.ndarray:
    """Plain multi-head attention on per-head keys/values (what HF computes).

    q [T, H, Dq] (= [q_nope, q_rope]), k [L+T, H, Dq], v [L+T, H, Dv], visibility bool [T, T]
    returns float64 [T, H, Dv]
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    T, N = q.shape[0], k.shape[0]
    if k.shape[1:] != q.shape[1:] or v.shape[:2] != k.shape[:2] or N < T:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    mask = attention_mask(N - T, visibility)
    scores = np.einsum("thd,nhd->thn", q, k) * scale
    p = _masked_softmax(scores, mask)
    return np.einsum("thn,nhv->thv", p, v)
