"""Rotary position embedding, NumPy reference (HF DeepseekV3 semantics).

Angles: `angle[t, i] = float32(position[t]) * inv_freq[i]`, rounded to float32 exactly as HF
does (`position_ids.float() * inv_freq`), then cos / sin in float64 and multiplied by the YaRN
attention factor (`cfg.rope_attention_factor`, 1.0 for plain RoPE).

Two layouts of the R = qk_rope_head_dim rotary dims:
  * NeoX (`rope_interleave=False`): pairs are (x[i], x[i + R/2]); output in the same layout.
  * interleaved (`rope_interleave=True`, DeepSeek's default): pairs are (x[2i], x[2i+1]);
    HF writes the result de-interleaved, `[x0*c - x1*s ..., x1*c + x0*s ...]`, i.e. the output
    is in NeoX layout. Queries and keys get the same treatment, so only the dot product
    matters, but the cached k_rope of this reference is in that output layout.
"""
from __future__ import annotations

import numpy as np

__all__ = ["rope_cos_sin", "apply_rope"]


def rope_cos_sin(cfg, positions) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float64 [T, R/2] for the given positions (already times the attention factor)."""
    positions = np.asarray(positions)
    inv_freq = cfg.rope_inv_freq()                                      # float32 [R/2]
    angle = positions.astype(np.float32)[:, None] * inv_freq[None, :]   # float32 product, as HF
    factor = cfg.rope_attention_factor
    # HF: cos(emb) * attention_scaling in float32; float64 here (the oracle)
    return np.cos(angle.astype(np.float64)) * factor, np.sin(angle.astype(np.float64)) * factor


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool) -> np.ndarray:
    """Rotate x [T, ..., R] with cos/sin [T, R/2]; returns float64 [T, ..., R] (NeoX layout)."""
    x = np.asarray(x, dtype=np.float64)
    half = x.shape[-1] // 2
    extra = x.ndim - 2                      # broadcast cos/sin over middle axes (heads)
    c = cos.reshape(cos.shape[0], *([1] * extra), half)
    s = sin.reshape(sin.shape[0], *([1] * extra), half)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
