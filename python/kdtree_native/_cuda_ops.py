"""CUDA tree ops behind kdtree_native.ops(device="cuda"), plus verify attention and compaction.

Same results as kdtree_native.reference (bit for bit for the integer outputs). The inputs come
here already validated by kn.ops (the reference's checks); these functions copy numpy arrays to
the device, run the kernels of cuda/kernels.h and copy the outputs back. The GPU engine calls
the kernels directly on device buffers (no copies); see docs/CUDA.md.

    tree_build(logprobs f32 [D,K], token_ids int32 [D,K], budget)  -> Tree
    tree_build_from_logits(logits f32 [D,V], budget, top_k=None)   -> Tree
    topk_logsoftmax(logits f32 [D,V], k)                            -> (logprobs [D,k], ids [D,k])
    tree_accept(tree, target_choice [n+1])                          -> (path int32 [m], bonus)
    kv_compact(cache [layers,S,row], path, cache_len)               -> compacted copy
    verify_attention(q_latent, q_rope, kv_latent, k_rope, visibility, scale) -> out [T,H,C]

GPU limits: budget <= 1024, depth <= 16, k <= 1024, V <= 524288 (ValueError beyond).
"""
import numpy as np

from . import _native
from .reference.tree import Tree

MAX_BUDGET = 1024
MAX_DEPTH = 16
MAX_K = 1024

__all__ = ["available", "tree_build", "tree_build_from_logits", "topk_logsoftmax", "tree_accept",
           "kv_compact", "accept_compact", "verify_attention", "verify_attention_choice", "pack_visibility",
           "unpack_visibility", "last_path"]

_last = {"path": None}


def available():
    """True when the CUDA kernels are compiled in and a device is usable."""
    return bool(getattr(_native, "cuda_kernels_compiled", False)) and bool(_native.cuda_available()[0])


def _require():
    if not getattr(_native, "cuda_kernels_compiled", False):
        raise RuntimeError("this build of kdtree_native has no CUDA backend")
    ok, why = _native.cuda_available()
    if not ok:
        raise RuntimeError(f"CUDA is unavailable: {why}")


def pack_visibility(vis):
    """bool [T, T] -> uint64 [T, ceil(T/64)] (bit j%64 of word j//64 of row i: i sees j)."""
    vis = np.asarray(vis, dtype=bool)
    T = vis.shape[0]
    W = (T + 63) // 64
    padded = np.zeros((T, W * 64), dtype=bool)
    padded[:, :vis.shape[1]] = vis
    return np.packbits(padded, axis=1, bitorder="little").view("<u8").astype(np.uint64)


def unpack_visibility(bits, n):
    """uint64 [n+1, W] -> bool [n+1, n+1]."""
    as_bytes = np.ascontiguousarray(bits[: n + 1]).astype("<u8", copy=False).view(np.uint8)
    return np.unpackbits(as_bytes, axis=1, count=n + 1, bitorder="little").view(bool)


def _check_limits(D, budget):
    if budget > MAX_BUDGET:
        raise ValueError(f"budget {budget} exceeds the CUDA tree build's limit {MAX_BUDGET} (use device='cpu')")
    if D > MAX_DEPTH:
        raise ValueError(f"depth D={D} exceeds the CUDA tree build's limit {MAX_DEPTH} (use device='cpu')")


def _tree_from_result(r):
    n = int(r["n"])
    _last["path"] = int(r["path"])
    return Tree(tokens=r["tokens"][:n].copy(), depths=r["depths"][:n].copy(),
                parents=r["parents"][: n + 1].copy(), visibility=unpack_visibility(r["visibility"], n))


def last_path():
    """Which path the last GPU tree build took: 0 = parallel exact (adaptive threshold),
    1 = sequential fallback, 2 = one warp (small budgets), 3 = parallel exact with the threshold
    estimate."""
    return _last["path"]


def tree_build(logprobs, token_ids, budget, cache_len=0, force_fallback=False):
    """Best-first tree on the GPU; logprobs float32 [D,K], token_ids int32 [D,K] (validated).
    force_fallback (testing): False/0 = auto, True/1 = sequential fallback, 2 = one-warp path,
    3 = parallel path, 4 = parallel path with the adaptive threshold only."""
    _require()
    lp = np.ascontiguousarray(logprobs, dtype=np.float32)
    ids = np.ascontiguousarray(token_ids, dtype=np.int32)
    D = lp.shape[0]
    _check_limits(D, int(budget))
    if int(budget) == 0 or D == 0:
        from .reference.tree import empty_tree
        _last["path"] = 0
        return empty_tree()
    r = _native.cuda_tree_build(lp, ids, int(budget), int(cache_len), int(force_fallback))
    return _tree_from_result(r)


def topk_logsoftmax(logits, k):
    """Top-k + log-softmax on the GPU: (logprobs float32 [D,k], ids int32 [D,k])."""
    _require()
    x = np.ascontiguousarray(logits, dtype=np.float32)
    k = min(int(k), x.shape[1])
    if k > MAX_K:
        raise ValueError(f"k={k} exceeds the CUDA top-k limit {MAX_K} (use device='cpu')")
    if x.shape[0] > MAX_DEPTH:
        raise ValueError(f"D={x.shape[0]} exceeds the CUDA limit {MAX_DEPTH}")
    return _native.cuda_topk_logsoftmax(x, k)


def tree_build_from_logits(logits, budget, top_k=None, cache_len=0):
    """Device top-k + log-softmax + tree build from logits [D,V] (k = top_k or budget)."""
    _require()
    x = np.ascontiguousarray(logits, dtype=np.float32)
    budget = int(budget)
    _check_limits(x.shape[0], budget)
    if budget == 0:
        from .reference.tree import empty_tree
        return empty_tree()
    k = min(budget if top_k is None else int(top_k), x.shape[1])
    if k > MAX_K:
        raise ValueError(f"top_k={k} exceeds the CUDA top-k limit {MAX_K} (use device='cpu')")
    return _tree_from_result(_native.cuda_tree_build_from_logits(x, budget, k, int(cache_len)))


def tree_accept(tree, target_choice):
    """Accept walk on the GPU: (path int32 [m], bonus int)."""
    _require()
    tokens = np.asarray(tree.tokens)
    choice = np.asarray(target_choice, dtype=np.int64)
    if tokens.shape[0] > MAX_BUDGET:
        raise ValueError(f"the CUDA accept walk supports n <= {MAX_BUDGET} nodes")
    # tokens and choices only need to compare equal: map them into int32 consistently
    vals, inv = np.unique(np.concatenate([tokens.astype(np.int64), choice]), return_inverse=True)
    if vals.size and (vals.min() < np.iinfo(np.int32).min or vals.max() > np.iinfo(np.int32).max):
        tok32 = inv[: tokens.shape[0]].astype(np.int32)
        ch32 = inv[tokens.shape[0]:].astype(np.int32)
    else:
        tok32 = tokens.astype(np.int32)
        ch32 = choice.astype(np.int32)
    path, bonus_i32 = _native.cuda_tree_accept(tok32, np.asarray(tree.parents, dtype=np.int32), ch32)
    m = int(path.shape[0])
    return path, int(choice[int(path[m - 1])])


def kv_compact(cache, path, cache_len):
    """GPU compaction of float32 caches [layers, S, row]; returns the compacted copy."""
    _require()
    c = np.ascontiguousarray(cache, dtype=np.float32)
    if c.ndim == 2:
        return _native.cuda_kv_compact(c[None], int(cache_len), np.asarray(path, np.int32))[0]
    return _native.cuda_kv_compact(c, int(cache_len), np.asarray(path, np.int32))


def accept_compact(tree, target_choice, cache, cache_len, round_outputs=False):
    """Fused GPU accept + compaction: (path, bonus, compacted cache copy); with round_outputs
    also the GPU round's result array [m, n, bonus, tokens of path nodes 1..m-1] and the next
    root (= bonus), as the kernel writes them for the round's one copy back."""
    _require()
    tokens = np.asarray(tree.tokens, dtype=np.int32)
    choice = np.asarray(target_choice, dtype=np.int32)
    c = np.ascontiguousarray(cache, dtype=np.float32)
    r = _native.cuda_tree_accept_compact(tokens, np.asarray(tree.parents, np.int32), choice, c, int(cache_len))
    return r if round_outputs else r[:3]


def verify_attention(q_latent, q_rope, kv_latent, k_rope, visibility, scale, force_naive=False,
                     force_splits=0, force_kernel=0, l_bound=None, force_rows=0, q_scale=None):
    """MLA tree-verify attention (FP32) on the GPU, the signature of reference.verify_attention.

    q_latent [T,H,C], q_rope [T,H,R], kv_latent [L+T,C], k_rope [L+T,R], visibility bool [T,T]
    (or uint64 words [T, W]), scale. Returns out_latent float32 [T,H,C].
    Testing knobs: force_naive (the plain kernel), force_splits (> 0: key splits), force_kernel
    (0 = auto, 1 = tiled, 2 = split-KV, 3 = decode, 4 = tensor cores), l_bound (int >= L: L reaches the kernels through a
    device int and l_bound is the host's upper bound, as under CUDA-graph capture), force_rows (4, 8 or
    16 query rows per split-KV block; 0 = the cost model's pick), q_scale (float32 [T]: token t's scores
    also scaled by q_scale[t], as the GPU model's folded query norm uses it).
    """
    _require()
    ql = np.ascontiguousarray(q_latent, dtype=np.float32)
    qr = np.ascontiguousarray(q_rope, dtype=np.float32)
    kv = np.ascontiguousarray(np.concatenate([np.asarray(kv_latent, np.float32),
                                              np.asarray(k_rope, np.float32)], axis=1))
    vis = np.asarray(visibility)
    if vis.dtype != np.uint64:
        vis = pack_visibility(vis)
    return _native.cuda_verify_attention(ql, qr, kv, np.ascontiguousarray(vis), float(scale),
                                         bool(force_naive), int(force_splits), int(force_kernel),
                                         None if l_bound is None else int(l_bound), int(force_rows),
                                         q_scale=None if q_scale is None else np.ascontiguousarray(q_scale, np.float32))


def verify_attention_choice(T, H, L, force_kernel=0, force_splits=0, force_rows=0, rows=False, detail=False):
    """verify_attention's pick for C=512, R=64 aligned buffers: (kernel, splits), with rows=True
    also the query rows per block (split-KV: 4, 8 or 16; tensor cores: 32); kernel 0 = plain,
    1 = tiled, 2 = split-KV, 3 = decode (two passes), 4 = tensor cores (3xTF32). detail=True:
    (kernel, splits, rows, splits of each full row block, splits of the last row block); the
    tensor-core kernel may give its last row block (at most 16 rows: cheaper chunks) other splits,
    and its `splits` is then the larger count (the partial slots the combine reads)."""
    _require()
    r = tuple(_native.cuda_verify_attention_choice(int(T), int(H), int(L), force_kernel=int(force_kernel),
                                                   force_splits=int(force_splits), force_rows=int(force_rows)))
    return r if detail else (r[:3] if rows else r[:2])
