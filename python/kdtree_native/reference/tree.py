"""DDTree tree algorithms in plain NumPy + Python: the oracle for the native CPU and CUDA ops.

This is the executable form of docs/tree_contract.md. It is deliberately slow and simple (a
Python heap, plain loops); cpp/tree.cpp and the CUDA kernels must produce exactly the same
integers. One DDTree round uses these steps:

    topk_logsoftmax(logits [D,V], k)          -> logprobs f32 [D,K], token_ids int32 [D,K]
    tree_build(logprobs, token_ids, budget)   -> Tree (tokens, depths, parents, visibility)
    tree_positions(tree, cache_len)           -> positions int32 [n+1] of the verify window
    tree_accept(tree, target_choice)          -> accepted path int32 [m], bonus token
    compact_index_map(path, cache_len)        -> which cache slots move where (KV compaction)

Legend: D = draft depth, K = top-k per depth, V = vocabulary, B = node budget,
n = tree nodes besides the root (n <= B), node 0 = the root (the last committed token),
node i >= 1 = the i-th node popped by the best-first search.
"""
import heapq
import math
from dataclasses import dataclass

import numpy as np

# Limits shared with the native code (cpp/tree.h: kTreeMaxDepth, kTreeMaxBudget).
MAX_TREE_DEPTH = 64
MAX_TREE_BUDGET = 16384


@dataclass(eq=False)
class Tree:
    """A draft tree. Node 0 is the root; node i >= 1 is described by entry i-1 of tokens/depths."""

    tokens: np.ndarray      # int32 [n]      token of node i+1
    depths: np.ndarray      # int32 [n]      depth of node i+1 (1..D; the root has depth 0)
    parents: np.ndarray     # int32 [n+1]    parents[0] = -1, 0 <= parents[i] < i
    visibility: np.ndarray  # bool [n+1,n+1] visibility[i, j]: node i attends to node j

    @property
    def n(self):
        """Number of nodes besides the root."""
        return int(self.tokens.shape[0])


# ----------------------------------------------------------------------------- input checks
# The same checks guard kn.reference and kn.ops, so both raise the same ValueError.


def _check_int(value, name, lo, hi=None):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    value = int(value)
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return value


def _as_array(x, name):
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def check_tree_inputs(logprobs, token_ids, budget):
    """Validate tree_build's inputs; return (logprobs f32 [D,K], token_ids int32 [D,K], budget).

    logprobs: any float dtype (converted to float32), 2-D [D,K], D <= MAX_TREE_DEPTH, K >= 1,
    no NaN or +inf (-inf is allowed), each row sorted descending.
    token_ids: any integer dtype, same shape, values in [0, 2**31).
    budget: integer in [0, MAX_TREE_BUDGET].
    """
    lp = _as_array(logprobs, "logprobs")
    ids = _as_array(token_ids, "token_ids")
    if lp.dtype.kind != "f":
        raise ValueError(f"logprobs must be a float array, got dtype {lp.dtype}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be an integer array, got dtype {ids.dtype}")
    if lp.ndim != 2:
        raise ValueError(f"logprobs must be 2-D [D, K], got shape {lp.shape}")
    if ids.shape != lp.shape:
        raise ValueError(f"token_ids shape {ids.shape} must equal logprobs shape {lp.shape}")
    D, K = lp.shape
    if D > MAX_TREE_DEPTH:
        raise ValueError(f"depth D={D} exceeds the limit {MAX_TREE_DEPTH}")
    if K < 1:
        raise ValueError(f"top-k K must be >= 1, got logprobs shape {lp.shape}")
    budget = _check_int(budget, "budget", 0, MAX_TREE_BUDGET)
    lp = np.ascontiguousarray(lp, dtype=np.float32)
    if np.isnan(lp).any():
        d, r = np.argwhere(np.isnan(lp))[0]
        raise ValueError(f"logprobs contain NaN (first at depth row {d}, rank {r})")
    if np.isposinf(lp).any():
        d, r = np.argwhere(np.isposinf(lp))[0]
        raise ValueError(f"logprobs contain +inf (first at depth row {d}, rank {r})")
    if K > 1 and (lp[:, 1:] > lp[:, :-1]).any():
        d, r = np.argwhere(lp[:, 1:] > lp[:, :-1])[0]
        raise ValueError(f"logprobs rows must be sorted descending: row {d} has "
                         f"lp[{r}]={lp[d, r]} < lp[{r + 1}]={lp[d, r + 1]}")
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        bad = ids.min() if ids.min() < 0 else ids.max()
        raise ValueError(f"token_ids must be in [0, 2**31), got {int(bad)}")
    return lp, np.ascontiguousarray(ids, dtype=np.int32), budget


def check_tree(tree):
    """Validate a Tree's structure (used before an accept walk); return (parents, tokens) int32."""
    if not (hasattr(tree, "parents") and hasattr(tree, "tokens")):
        raise TypeError(f"tree must be a Tree (with .parents and .tokens), got {type(tree).__name__}")
    parents = np.asarray(tree.parents)
    tokens = np.asarray(tree.tokens)
    if parents.ndim != 1 or tokens.ndim != 1 or parents.shape[0] != tokens.shape[0] + 1:
        raise ValueError(f"tree.parents must be [n+1] and tree.tokens [n]; got shapes "
                         f"{parents.shape} and {tokens.shape}")
    if parents.dtype.kind not in "iu" or tokens.dtype.kind not in "iu":
        raise ValueError("tree.parents and tree.tokens must be integer arrays")
    if parents[0] != -1:
        raise ValueError(f"tree.parents[0] must be -1 (the root), got {parents[0]}")
    i = np.arange(1, parents.shape[0])
    bad = (parents[1:] < 0) | (parents[1:] >= i)
    if bad.any():
        j = int(i[bad][0])
        raise ValueError(f"tree.parents[{j}] = {parents[j]} must be in [0, {j})")
    return parents.astype(np.int32), tokens.astype(np.int64)


def check_choice(target_choice, n):
    """Validate the target's per-node choices: integers, shape [n+1]; return int64 [n+1]."""
    choice = _as_array(target_choice, "target_choice")
    if choice.dtype.kind not in "iu":
        raise ValueError(f"target_choice must be an integer array, got dtype {choice.dtype}")
    if choice.ndim != 1 or choice.shape[0] != n + 1:
        raise ValueError(f"target_choice must have shape [n+1] = [{n + 1}], got {choice.shape}")
    if choice.dtype.kind == "u" and choice.size and choice.max() > np.iinfo(np.int64).max:
        raise ValueError(f"target_choice holds {int(choice.max())}, past int64")
    return choice.astype(np.int64)


def check_logits(logits, k):
    """Validate topk_logsoftmax's inputs; return (logits f32 [D,V], k clamped to V)."""
    x = _as_array(logits, "logits")
    if x.dtype.kind != "f":
        raise ValueError(f"logits must be a float array, got dtype {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"logits must be 2-D [D, V], got shape {x.shape}")
    D, V = x.shape
    if D > MAX_TREE_DEPTH:
        raise ValueError(f"depth D={D} exceeds the limit {MAX_TREE_DEPTH}")
    if V < 1:
        raise ValueError(f"logits must have a vocabulary of at least 1, got shape {x.shape}")
    k = _check_int(k, "k", 1)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if np.isnan(x).any():
        raise ValueError(f"logits contain NaN (first at row {np.argwhere(np.isnan(x))[0][0]})")
    if np.isposinf(x).any():
        raise ValueError(f"logits contain +inf (first at row {np.argwhere(np.isposinf(x))[0][0]})")
    if D and (x == -np.inf).all(axis=1).any():
        raise ValueError(f"logits row {int(np.argmax((x == -np.inf).all(axis=1)))} is all -inf")
    return x, min(k, V)


# ----------------------------------------------------------------------------- algorithms


def _order_score(score):
    """The value a candidate is ranked by: its score, except that NaN ranks like -inf."""
    return -math.inf if math.isnan(score) else score


def tree_build(logprobs, token_ids, budget):
    """Best-first DDTree build: the top-`budget` prefixes of the factorised draft distribution.

    logprobs: float32 [D,K] (row d = depth d+1, sorted descending); token_ids: int [D,K];
    budget: the node budget B >= 0. Returns a Tree with n = min(B, number of prefixes) nodes.

    Candidates live in a min-heap of (-score, rank tuple, parent, depth, rank, score), exactly
    the entries of the official build_ddtree_tree: higher score first, equal scores broken by
    the lexicographically smaller rank tuple. Scores are Python floats (float64) updated in the
    official operation order: sibling `s - lp[d][r] + lp[d][r+1]`, child `s + lp[d+1][0]`.
    """
    lp, ids, budget = check_tree_inputs(logprobs, token_ids, budget)
    D, K = lp.shape
    tokens, depths, parents = [], [], [-1]

    if budget > 0 and D > 0:
        first = float(lp[0, 0])
        heap = [(-_order_score(first), (0,), 0, 1, 0, first)]
        while heap and len(tokens) < budget:
            _, ranks, parent, depth, rank, score = heapq.heappop(heap)
            node = len(tokens) + 1  # node index = pop order; the root is node 0
            tokens.append(int(ids[depth - 1, rank]))
            depths.append(depth)
            parents.append(parent)

            if rank + 1 < K:  # next sibling: same parent and depth, next rank
                s = score - float(lp[depth - 1, rank]) + float(lp[depth - 1, rank + 1])
                heapq.heappush(heap, (-_order_score(s), ranks[:-1] + (rank + 1,), parent, depth, rank + 1, s))
            if depth < D:  # first child: one deeper, rank 0, below the new node
                s = score + float(lp[depth, 0])
                heapq.heappush(heap, (-_order_score(s), ranks + (0,), node, depth + 1, 0, s))

    parents = np.array(parents, dtype=np.int32)
    return Tree(tokens=np.array(tokens, dtype=np.int32),
                depths=np.array(depths, dtype=np.int32),
                parents=parents,
                visibility=tree_visibility(parents))


def tree_visibility(parents):
    """Ancestor-only attention mask: bool [n+1, n+1], row i = node i's ancestors and itself.

    parents: int [n+1] with parents[0] = -1 and parents[i] < i (so rows can be filled in order).
    """
    parents = np.asarray(parents)
    n1 = parents.shape[0]
    vis = np.zeros((n1, n1), dtype=bool)
    vis[0, 0] = True
    for i in range(1, n1):
        vis[i] = vis[parents[i]]  # everything the parent sees ...
        vis[i, i] = True          # ... plus the node itself
    return vis


def tree_positions(tree, cache_len):
    """Positions of the verify window: int32 [n+1] = cache_len + depth (root at cache_len)."""
    cache_len = _check_int(cache_len, "cache_len", 0)
    depth = np.concatenate([[0], np.asarray(tree.depths, dtype=np.int64)])
    pos = cache_len + depth
    if pos.max() > np.iinfo(np.int32).max:
        raise ValueError(f"positions overflow int32 (cache_len={cache_len})")
    return pos.astype(np.int32)


def tree_accept(tree, target_choice):
    """Walk the tree with the target's choices; return (path int32 [m], bonus token int).

    target_choice: int [n+1], the target's token at every node (argmax or sample). From the
    root, move to the child whose token equals the choice at the current node, while one
    exists. If several children carry that token (duplicate ids at one depth), take the one
    with the highest node index, as the official child map (a dict, last insert wins) does.
    The bonus token is the choice at the last accepted node.
    """
    parents, tokens = check_tree(tree)
    n = tokens.shape[0]
    choice = check_choice(target_choice, n)

    children = [[] for _ in range(n + 1)]  # children[p] in increasing node order
    for c in range(1, n + 1):
        children[parents[c]].append(c)

    path = [0]
    node = 0
    while True:
        nxt = None
        for c in children[node]:
            if tokens[c - 1] == choice[node]:
                nxt = c  # keep scanning: the last match wins
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return np.array(path, dtype=np.int32), int(choice[node])


def check_path(path):
    """Validate an accepted path: int [m], m >= 1, path[0] = 0, strictly increasing."""
    p = _as_array(path, "path")
    if p.dtype.kind not in "iu" or p.ndim != 1 or p.shape[0] < 1:
        raise ValueError(f"path must be a non-empty 1-D integer array, got {p.dtype} {p.shape}")
    p = p.astype(np.int64)
    if p[0] != 0:
        raise ValueError(f"path[0] must be 0 (the root), got {p[0]}")
    if (np.diff(p) <= 0).any():
        raise ValueError("path must be strictly increasing")
    return p


def compact_index_map(path, cache_len):
    """KV compaction after an accept: (src_slots int32 [m], dst_slots int32 [m]).

    The verify window occupied slots cache_len + i for node i. After compaction slot
    dst_slots[j] = cache_len + j holds what was at src_slots[j] = cache_len + path[j]. Since
    path is increasing with path[j] >= j, copying j = 0, 1, ... in order is safe in place.
    """
    p = check_path(path)
    cache_len = _check_int(cache_len, "cache_len", 0)
    src = cache_len + p
    dst = cache_len + np.arange(p.shape[0], dtype=np.int64)
    if src.max() > np.iinfo(np.int32).max:
        raise ValueError(f"slots overflow int32 (cache_len={cache_len})")
    return src.astype(np.int32), dst.astype(np.int32)


def kv_compact(cache, path, cache_len):
    """Apply compact_index_map in place along axis 0 of `cache` [S, ...]; return the new length."""
    src, dst = compact_index_map(path, cache_len)
    if src[-1] >= cache.shape[0]:
        raise ValueError(f"path reaches slot {src[-1]} but the cache has {cache.shape[0]} slots")
    for s, d in zip(src, dst):
        cache[d] = cache[s]
    return int(dst[-1]) + 1


def topk_logsoftmax(logits, k):
    """Top-k of each row of a drafter's logits, as log-probabilities.

    logits: float [D,V]; k >= 1 (clamped to V). Returns (logprobs float32 [D,k], ids int32
    [D,k]), each row sorted descending, equal logits in increasing token id. As the official
    code (torch, float32): logprobs = top_logits - logsumexp(row), one float32 subtraction; the
    log-sum-exp itself is evaluated in float64 and rounded to float32.
    """
    x, k = check_logits(logits, k)
    D = x.shape[0]
    out_lp = np.empty((D, k), dtype=np.float32)
    out_ids = np.empty((D, k), dtype=np.int32)
    for d in range(D):
        row = x[d]
        ids = np.argsort(-row, kind="stable")[:k]  # descending, ties by lower id
        m = float(row.max())
        lse = np.float32(m + math.log(np.sum(np.exp(row.astype(np.float64) - m))))
        out_lp[d] = row[ids] - lse  # float32 - float32
        out_ids[d] = ids
    return out_lp, out_ids


def empty_tree():
    """The tree of budget 0 (or D = 0): just the root."""
    return Tree(tokens=np.zeros(0, np.int32), depths=np.zeros(0, np.int32),
                parents=np.array([-1], np.int32), visibility=np.ones((1, 1), bool))


def tree_build_from_logits(logits, budget, top_k=None):
    """tree_build from a drafter's logits [D,V]: k = top_k or min(budget, V), as the official code."""
    budget = _check_int(budget, "budget", 0, MAX_TREE_BUDGET)
    k = budget if top_k is None else top_k
    if budget == 0:
        check_logits(logits, 1)
        return empty_tree()
    lp, ids = topk_logsoftmax(logits, k)
    return tree_build(lp, ids, budget)
