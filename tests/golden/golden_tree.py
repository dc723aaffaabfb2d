"""Golden KDTR file for tests/cpp/test_tree.cpp: tree-op inputs with the NumPy reference outputs.

generate(out_dir) writes tree_golden.kdtr holding, for case i (metadata "cases"):
  c{i}.logprobs f32 [D,K], c{i}.token_ids i32 [D,K], c{i}.budget i64 [1]   inputs
  c{i}.tokens i32 [n], c{i}.depths i32 [n], c{i}.parents i32 [n+1],
  c{i}.visibility bool [n+1,n+1]                                          reference tree
  c{i}.cache_len i64 [1], c{i}.positions i32 [n+1]                         positions
  c{i}.choice i64 [n+1], c{i}.path i32 [m], c{i}.bonus i64 [1]             accept walk
  c{i}.src i32 [m], c{i}.dst i32 [m]                                       compaction map
and for top-k case j (metadata "topk_cases"):
  t{j}.logits f32 [D,V], t{j}.k i64 [1], t{j}.logprobs f32 [D,k'], t{j}.ids i32 [D,k']
The cases come from tests/python/tree_cases.py (every kind, budgets 0..1024, depths 1..16).
"""
import os
import sys

import numpy as np

import kdtree_native as kn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import tree_cases as tc  # noqa: E402

R = kn.reference


def tree_arrays(i, lp, ids, budget, rng):
    tree = R.tree_build(lp, ids, budget)
    cache_len = int(rng.integers(0, 5000))
    choice = tc.random_choice(rng, tree, p_follow=float(rng.choice([0.5, 0.9, 1.0])))
    if i % 5 == 0:
        choice = np.where(tc.deepest_choice(tree) >= 0, tc.deepest_choice(tree), choice)
    path, bonus = R.tree_accept(tree, choice)
    src, dst = R.compact_index_map(path, cache_len)
    p = f"c{i}."
    return {
        p + "logprobs": lp, p + "token_ids": ids, p + "budget": np.array([budget], np.int64),
        p + "tokens": tree.tokens, p + "depths": tree.depths, p + "parents": tree.parents,
        p + "visibility": tree.visibility,
        p + "cache_len": np.array([cache_len], np.int64), p + "positions": R.tree_positions(tree, cache_len),
        p + "choice": choice.astype(np.int64), p + "path": path, p + "bonus": np.array([bonus], np.int64),
        p + "src": src, p + "dst": dst,
    }


def topk_arrays(j, rng):
    D = int(rng.integers(0, 17))
    V = int(rng.choice([1, 2, 7, 64, 300, 4000]))
    k = int(rng.integers(1, min(V, 300) + 3))
    x = (rng.standard_normal((D, V)) * rng.uniform(0.1, 8)).astype(np.float32)
    if j % 3 == 0:
        x = np.round(x)  # ties: lower id first
    if j % 4 == 0 and V > 1:
        x[rng.random((D, V)) < 0.4] = -np.inf
        x[:, -1] = 1.5  # a finite entry in every row
    lp, ids = R.topk_logsoftmax(x, k)
    p = f"t{j}."
    return {p + "logits": x, p + "k": np.array([k], np.int64), p + "logprobs": lp, p + "ids": ids}


def generate(out_dir):
    rng = np.random.default_rng(20260415)
    arrays = {}
    cases = list(tc.case_grid(n_small=260, n_large=10, seed=31)) + list(tc.rounding_grid(40, seed=32))
    for i, (_, lp, ids, budget) in enumerate(cases):
        arrays.update(tree_arrays(i, lp, ids, budget, rng))
    n_topk = 60
    for j in range(n_topk):
        arrays.update(topk_arrays(j, rng))
    kn.save_kdtr(os.path.join(out_dir, "tree_golden.kdtr"), arrays,
                 metadata={"cases": len(cases), "topk_cases": n_topk,
                           "writer": "tests/golden/golden_tree.py (kdtree_native.reference)"})


if __name__ == "__main__":
    generate(sys.argv[1] if len(sys.argv) > 1 else ".")
