"""Native DDTree tree ops, dispatched by device ("cpu": C++ host code, "cuda": CUDA kernels).

Same signatures and results as kdtree_native.reference (the NumPy oracle), which also does
the input validation for both, so bad input raises the same ValueError on every path:

    tree = tree_build(logprobs [D,K], token_ids [D,K], budget, device="cpu")   -> Tree
    tree = tree_build_from_logits(logits [D,V], budget, top_k=None, device="cpu")
    path, bonus = tree_accept(tree, target_choice [n+1], device="cpu")
    logprobs, ids = topk_logsoftmax(logits [D,V], k, device="cpu")

device="cuda" goes to kdtree_native._cuda_ops (functions of the same names).
"""
import importlib
import importlib.util

import numpy as np

from . import _native
from .reference import tree as _ref
from .reference.tree import Tree

__all__ = ["Tree", "tree_build", "tree_build_from_logits", "tree_accept", "topk_logsoftmax"]


def _cuda_ops():
    name = __package__ + "._cuda_ops"
    if importlib.util.find_spec(name) is None:
        raise RuntimeError("device='cuda': the CUDA tree ops (kdtree_native._cuda_ops) are not "
                           "part of this installation")
    try:
        mod = importlib.import_module(name)
    except ImportError as e:
        raise RuntimeError(f"device='cuda': kdtree_native._cuda_ops failed to import: {e}") from e
    ok, why = _native.cuda_available()
    if not ok:
        raise RuntimeError(f"device='cuda' but CUDA is unavailable: {why}")
    return mod


def _device(device):
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return device


def _unpack_visibility(bits, n):
    """uint64 bitmask rows [n+1, W] (bit j%64 of word j//64) -> bool [n+1, n+1]."""
    as_bytes = np.ascontiguousarray(bits).astype("<u8", copy=False).view(np.uint8)
    return np.unpackbits(as_bytes, axis=1, count=n + 1, bitorder="little").view(bool)


def tree_build(logprobs, token_ids, budget, device="cpu"):
    """Best-first DDTree build (see reference.tree_build); returns a Tree."""
    device = _device(device)
    lp, ids, budget = _ref.check_tree_inputs(logprobs, token_ids, budget)
    if device == "cuda":
        return _cuda_ops().tree_build(lp, ids, budget)
    tokens, depths, parents, bits = _native.tree_build_cpu(lp, ids, budget)
    return Tree(tokens=tokens, depths=depths, parents=parents,
                visibility=_unpack_visibility(bits, tokens.shape[0]))


def tree_accept(tree, target_choice, device="cpu"):
    """Accept walk (see reference.tree_accept); returns (path int32 [m], bonus int)."""
    device = _device(device)
    parents, tokens = _ref.check_tree(tree)
    choice = _ref.check_choice(target_choice, tokens.shape[0])
    if device == "cuda":
        return _cuda_ops().tree_accept(tree, choice)
    if tokens.size and (tokens.min() < np.iinfo(np.int32).min or tokens.max() > np.iinfo(np.int32).max):
        raise ValueError("tree.tokens must fit int32")
    path, bonus = _native.tree_accept_cpu(parents, tokens.astype(np.int32), choice)
    return path, int(bonus)


def topk_logsoftmax(logits, k, device="cpu"):
    """Top-k + log-softmax of drafter logits (see reference.topk_logsoftmax)."""
    device = _device(device)
    x, k = _ref.check_logits(logits, k)
    if device == "cuda":
        return _cuda_ops().topk_logsoftmax(x, k)
    return _native.topk_logsoftmax_cpu(x, k)


def tree_build_from_logits(logits, budget, top_k=None, device="cpu"):
    """tree_build from logits [D,V] with k = top_k or min(budget, V), as the official code."""
    device = _device(device)
    budget = _ref._check_int(budget, "budget", 0, _ref.MAX_TREE_BUDGET)
    if budget == 0:
        _ref.check_logits(logits, 1)
        return _ref.empty_tree()
    if device == "cuda":
        mod = _cuda_ops()
        if hasattr(mod, "tree_build_from_logits"):  # stays on the device end to end
            x, _ = _ref.check_logits(logits, 1 if top_k is None else top_k)
            return mod.tree_build_from_logits(x, budget, top_k)
    lp, ids = topk_logsoftmax(logits, budget if top_k is None else top_k, device=device)
    return tree_build(lp, ids, budget, device=device)
