"""Random DDTree tree-build cases shared by the tree tests (reference, CPU native, CUDA).

A case is (logprobs float32 [D,K] rows sorted descending, token_ids int32 [D,K], budget).
Kinds cover the awkward corners of the contract (docs/tree_contract.md):

    "random"     distinct float32 log-probs (a log-softmax of random logits)
    "quantised"  log-probs on a 1/4 grid: float64 path sums are exact, so many scores tie and
                 the rank-tuple tie-break decides the order
    "equal"      every entry of every row equal (non-dyadic, so s - a + a may round)
    "neginf"     rows ending in -inf (some rows all -inf): -inf and NaN (-inf - -inf) scores
    "dup"        token ids from a tiny vocabulary: duplicate tokens under one parent
    "positive"   arbitrary sorted floats, some > 0 (children can outscore their parents)
    "rounding"   one row of widely spread magnitudes repeated at every depth: paths with the
                 same multiset of ranks tie mathematically but round differently in float64,
                 so only the contract's exact operation order reproduces the order

Use `case(seed, budget, depth, k, kind)` for one case (a fixed seed per case) and
`case_grid(...)` for the sweep the tests run. `random_tree(n, seed)` and `path_to` give the CPU and
CUDA model tests their verify trees (parents, depths, ancestor-only visibility), and
`tree_rows_against_ar_steps` compares an engine's tree rows with its one-token steps bit for bit.
"""
import numpy as np

from kdtree_native.reference import tree_visibility

KINDS = ("random", "quantised", "equal", "neginf", "dup", "positive", "rounding")
BUDGETS = (0, 1, 2, 3, 17, 64, 255, 256, 1024)


def _sorted_desc(x):
    return -np.sort(-x, axis=1)


def case(seed, budget, depth, k, kind):
    """One case: (logprobs float32 [depth,k], token_ids int32 [depth,k], budget)."""
    rng = np.random.default_rng(seed)
    D, K = depth, k
    if kind == "random":
        logits = rng.standard_normal((D, max(K, 2) + 3)) * rng.uniform(0.3, 5.0)
        logits -= np.log(np.exp(logits).sum(axis=1, keepdims=True))
        lp = _sorted_desc(logits)[:, :K]
    elif kind == "quantised":
        lp = _sorted_desc(-np.round(rng.exponential(rng.uniform(0.3, 2.0), (D, K)) * 4) / 4)
    elif kind == "equal":
        lp = np.full((D, K), -np.log(K + rng.uniform(0.1, 3.0)))
    elif kind == "neginf":
        lp = _sorted_desc(-np.round(rng.exponential(1.0, (D, K)) * 8) / 8)
        finite = rng.integers(0, K + 1, D)  # entries kept per row (0: the row is all -inf)
        finite[rng.random(D) < 0.5] = rng.integers(1, 3)
        for d in range(D):
            lp[d, finite[d]:] = -np.inf
    elif kind == "dup":
        lp = _sorted_desc(-np.round(rng.exponential(1.0, (D, K)) * 4) / 4)
    elif kind == "rounding":
        row = -np.exp(rng.uniform(-40.0, 3.0, K))  # magnitudes 1e-18 .. 20
        lp = np.tile(np.sort(row.astype(np.float32))[::-1], (D, 1))
    elif kind == "positive":
        lp = _sorted_desc(np.round(rng.standard_normal((D, K)) * 8) / 4)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    vocab = int(rng.choice([2, 3])) if kind == "dup" else 1 << 20
    if kind == "dup" or rng.random() < 0.2:
        ids = rng.integers(0, min(vocab, 5) if kind == "dup" else 8, (D, K))  # repeats at one depth
    else:
        ids = np.stack([rng.choice(vocab, K, replace=False) for _ in range(D)])  # distinct per depth
    return lp.astype(np.float32), ids.astype(np.int32), int(budget)


def case_grid(n_small=2000, n_large=60, seed=1234, max_k=1024):
    """Yield (case_id, logprobs, token_ids, budget): many small cases, a few large ones.

    Budgets 0..1024 as in the issue, depths 1..16, K from 1 to the budget (at most max_k;
    K >= 1 when the budget is 0), every kind. Large = budget >= 255.
    """
    rng = np.random.default_rng(seed)
    small = [b for b in BUDGETS if b < 255]
    large = [b for b in BUDGETS if b >= 255]
    for i in range(n_small + n_large):
        budget = int(rng.choice(small if i < n_small else large))
        depth = int(rng.integers(1, 17))
        hi = max(1, min(budget, max_k))
        k = int(rng.integers(1, hi + 1)) if rng.random() < 0.8 else int(rng.choice([1, hi]))
        kind = KINDS[i % len(KINDS)]
        lp, ids, budget = case(int(rng.integers(1 << 31)), budget, depth, k, kind)
        yield f"{i}:{kind}:B{budget}:D{depth}:K{k}", lp, ids, budget


def rounding_grid(n=300, seed=77):
    """Yield (case_id, logprobs, token_ids, budget) of small "rounding" cases with a budget
    covering most of the tree: about one in seven depends on the exact float64 operation order
    (computing a sibling as s + (b - a) instead of (s - a) + b changes the tree)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        depth, k = int(rng.integers(2, 8)), int(rng.integers(2, 10))
        budget = int(rng.choice([64, 255]))
        lp, ids, budget = case(int(rng.integers(1 << 31)), budget, depth, k, "rounding")
        yield f"r{i}:rounding:B{budget}:D{depth}:K{k}", lp, ids, budget


def random_choice(rng, tree, p_follow=0.8, vocab=None):
    """Target choices int64 [n+1] for an accept walk: at each node, with probability p_follow
    the token of a random child (so the walk goes deeper), else a random token."""
    n = tree.n
    tokens = np.asarray(tree.tokens)
    hi = int(tokens.max()) + 2 if n else 4
    choice = rng.integers(0, vocab or hi, n + 1).astype(np.int64)
    children = [[] for _ in range(n + 1)]
    for c in range(1, n + 1):
        children[int(tree.parents[c])].append(c)
    for i in range(n + 1):
        if children[i] and rng.random() < p_follow:
            choice[i] = tokens[children[i][rng.integers(len(children[i]))] - 1]
    return choice


def deepest_choice(tree):
    """Choices that accept the full depth: follow the path to the deepest node (last of ties)."""
    n = tree.n
    choice = np.full(n + 1, -1, np.int64)
    if n == 0:
        return choice
    node = int(np.argmax(tree.depths)) + 1
    while node > 0:
        parent = int(tree.parents[node])
        choice[parent] = tree.tokens[node - 1]
        node = parent
    return choice


def random_tree(n, seed, max_children=3):
    """A random verify tree of n nodes for the model tests (CPU and CUDA): parents [n] (parents[0] = -1,
    parent < child, at most max_children each), depths [n], ancestor-only visibility bool [n, n]."""
    rng = np.random.default_rng(seed)
    parents = np.full(n, -1, dtype=np.int64)
    children = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        while True:
            p = int(rng.integers(0, i))
            if children[p] < max_children:
                break
        parents[i] = p
        children[p] += 1
    depths = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    return parents, depths, tree_visibility(parents)


def path_to(parents, i):
    """The nodes from the root to node i (a root-to-leaf path of random_tree)."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def tree_rows_against_ar_steps(eng, prefix, toks, parents, depths, vis):
    """(the nodes whose logits differ in any bit from the one-token AR steps along their path, whether the
    deepest node's path committed out of the tree leaves the AR steps' cache rows): the tree forwarded once
    after ``prefix``, then each node's path decoded token by token from ``prefix``."""
    eng.prefill(prefix)
    L = eng.cache_len
    tree = eng.forward(toks, L + depths, vis).copy()
    differ = []
    for i in range(len(toks)):
        eng.truncate(L)
        for t in toks[path_to(parents, i)]:
            last = eng.decode(int(t))
        if not np.array_equal(tree[i], last):
            differ.append(i)
    path = path_to(parents, int(np.argmax(depths)))
    eng.truncate(L)
    for t in toks[path]:
        eng.decode(int(t))
    cfg = eng.config
    ar_rows = [eng.model.read_cache(l, L, len(path)) for l in range(cfg.num_hidden_layers)]
    eng.truncate(L)
    eng.forward(toks, L + depths, vis)
    eng.commit(path)
    same_cache = all(np.array_equal(eng.model.read_cache(l, L, len(path)), ar_rows[l])
                     for l in range(cfg.num_hidden_layers))
    return differ, same_cache


def ddtree_vs_ar_mismatches(eng, draft, ids, settings, n=40):
    """[(seed, temperature, top_p, drafter, budget, adaptive)] for which DDTree's tokens differ from AR's on
    `eng` (same seed): every built-in drafter kind (n-gram, the model `draft`, the oracle with noise, the
    adaptive budget), for each (seed, temperature, top_p) of `settings`, from prompt `ids`."""
    from kdtree_native.drafters import ModelDrafter, NgramDrafter, OracleDrafter
    from kdtree_native.generation import generate

    bad = []
    for seed, temp, top_p in settings:
        ar = generate(eng, ids, n, temperature=temp, top_p=top_p, seed=seed).tokens
        for drafter, budget, adaptive in ((NgramDrafter(), 16, False), (ModelDrafter(draft), 8, False),
                                          (OracleDrafter(ar, noise=0.3, seed=seed, vocab_size=eng.vocab_size), 64, False),
                                          (ModelDrafter(draft), 64, True)):
            got = generate(eng, ids, n, drafter=drafter, tree_budget=budget, depth=6, temperature=temp, top_p=top_p,
                           seed=seed, adaptive_budget=adaptive).tokens
            if not np.array_equal(got, ar):
                bad.append((seed, temp, top_p, type(drafter).__name__, budget, adaptive))
    return bad
