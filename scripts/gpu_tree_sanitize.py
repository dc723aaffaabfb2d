"""A small tree-build set for compute-sanitizer (racecheck / synccheck): random cases through
every GPU path (auto, sequential fallback, one warp, parallel, parallel without the threshold
estimate) and realistic drafters at
B = 16..1024, every tree compared with the CPU twin. Exit status 1 on a mismatch. Takes a minute
or more under racecheck.

    compute-sanitizer --tool racecheck --error-exitcode 9 python3 scripts/gpu_tree_sanitize.py
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import kdtree_native as kn  # noqa: E402
import tree_cases as tc  # noqa: E402
from kdtree_native import _native as N  # noqa: E402
from test_cuda_ops import realistic_case  # noqa: E402


def same(raw, cpu):
    return raw["n"] == cpu.n and np.array_equal(raw["parents"][: cpu.n + 1], cpu.parents) and \
        np.array_equal(raw["tokens"][: cpu.n], cpu.tokens)


bad = n = 0
for cid, lp, ids, budget in tc.case_grid(n_small=24, n_large=4, seed=5):
    if budget == 0:
        continue
    cpu = kn.ops.tree_build(lp, ids, budget, device="cpu")
    for mode in (0, 1, 2, 3, 4):  # auto, fallback, one warp, parallel, parallel with the adaptive threshold
        bad += not same(N.cuda_tree_build(lp, ids, budget, 0, mode), cpu)
        n += 1
for b in (16, 64, 256, 1024):
    for seed in range(2):
        lp, ids = realistic_case(seed, b)
        bad += not same(N.cuda_tree_build(lp, ids, b, 0, 0), kn.ops.tree_build(lp, ids, b, device="cpu"))
        n += 1
print("gpu_tree_sanitize: trees", n, "mismatches", bad)
sys.exit(1 if bad else 0)
