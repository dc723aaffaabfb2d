"""NumPy reference of the n-gram (prompt lookup) drafter: the definition that
kdtree_native.NgramDrafter (C++, cpp/engine/ngram_drafter.cpp) is tested against, bit for bit."""
import numpy as np


def ngram_draft(context, depth, top_k, max_ngram=4, min_ngram=1, max_matches=32):
    """The earlier occurrences of the context's last ng tokens (ng = min_ngram .. max_ngram), the
    ``max_matches`` most recent per ng; what followed each at offsets 1..depth counts with weight
    ng; each depth's tokens by (-weight, token id), log-prob = log(weight / the depth's total) in
    float64, rounded to float32. Returns (logprobs float32 [d, k], ids int32 [d, k]), rows padded
    with (-inf, 0), or None when nothing matches (or depth / top_k < 1)."""
    # Vectorised (a few array passes per call, no per-occurrence Python loop): the window ends
    # e (0 .. n-2) whose last ng tokens equal the context's last ng are filtered one length at
    # a time (the matches of length ng+1 are among those of length ng), the continuations of
    # the kept matches gathered as (depth, token, weight) and summed per (depth, token).
    ctx = np.asarray(context).reshape(-1).astype(np.int64, copy=False)
    n, depth = len(ctx), int(depth)
    if depth <= 0 or int(top_k) <= 0 or n < 2:
        return None
    ends = np.flatnonzero(ctx[:n - 1] == ctx[n - 1])
    starts, weights = [], []
    for ng in range(1, min(max_ngram, n - 1) + 1):
        if ng > 1:
            ends = ends[ends >= ng - 1]
            ends = ends[ctx[ends - (ng - 1)] == ctx[n - ng]]
        if not ends.size:
            break
        if ng >= min_ngram:
            hits = ends[-max_matches:]  # the most recent occurrences
            starts.append(hits + 1)
            weights.append(np.full(hits.size, ng, np.int64))
    if not starts:
        return None
    starts, weights = np.concatenate(starts), np.concatenate(weights)
    d = min(depth, n - int(starts.min()))  # depths with a continuation: a prefix 0 .. d-1
    pos = starts[:, None] + np.arange(d)[None, :]
    ok = pos < n
    js = np.broadcast_to(np.arange(d)[None, :], pos.shape)[ok]
    toks = ctx[np.minimum(pos, n - 1)][ok]
    w = np.broadcast_to(weights[:, None], pos.shape)[ok]
    # sum the weights per (depth, token), then order each depth by (-count, token)
    o = np.lexsort((toks, js))
    js, toks, w = js[o], toks[o], w[o]
    head = np.ones(js.size, bool)
    head[1:] = (js[1:] != js[:-1]) | (toks[1:] != toks[:-1])
    idx = np.flatnonzero(head)
    kj, kt, cnt = js[idx], toks[idx], np.add.reduceat(w, idx)
    order = np.lexsort((kt, -cnt, kj))
    kj, kt, cnt = kj[order], kt[order], cnt[order]
    per_depth = np.bincount(kj, minlength=d)
    k = min(int(top_k), int(per_depth.max()))
    rank = np.arange(kj.size) - np.concatenate([[0], np.cumsum(per_depth)[:-1]])[kj]
    keep = rank < k
    total = np.bincount(kj, weights=cnt, minlength=d)
    lp = np.full((d, k), -np.inf, dtype=np.float32)
    ids = np.zeros((d, k), dtype=np.int32)
    lp[kj[keep], rank[keep]] = np.log(cnt[keep] / total[kj[keep]])
    ids[kj[keep], rank[keep]] = kt[keep]
    return lp, ids

