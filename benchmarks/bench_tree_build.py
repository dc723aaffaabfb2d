"""DDTree tree build latency: native CPU (C++) vs the NumPy reference.

Inputs: a drafter's top-K log-probs at depth D (default 15) from random logits over a 32000-token
vocabulary (kn.reference.topk_logsoftmax), K = the budget by default, as the official code does
(top-k = min(budget, vocab)); --top-k caps it. Three timings per budget, each the median of many
runs after a warm-up:

  reference   kn.reference.tree_build           (Python heap, NumPy visibility)
  ops         kn.ops.tree_build(device="cpu")   (whole Python call: checks, native build,
                                                 bool [n+1,n+1] visibility unpacked)
  core        the C++ tree_build alone, timed in C++ (workspace reused; visibility bitmask)

    python benchmarks/bench_tree_build.py [--budgets 16 64 256 512 1024] [--depth 15]
                                          [--top-k K] [--json out.json]
"""
import argparse
import json
import platform
import time

import numpy as np

import kdtree_native as kn


def median_seconds(fn, repeats, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256, 512, 1024])
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--top-k", type=int, default=None, help="K = min(budget, top-k); default K = budget")
    ap.add_argument("--temperature", type=float, default=0.3, help="logit scale 1/T of the random drafter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ref-repeats", type=int, default=30)
    ap.add_argument("--ops-repeats", type=int, default=300)
    ap.add_argument("--core-repeats", type=int, default=3000)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    logits = (rng.standard_normal((args.depth, args.vocab)) / args.temperature).astype(np.float32)
    rows = []
    print(f"tree build, depth {args.depth}, vocab {args.vocab}, K = "
          f"{'budget' if args.top_k is None else f'min(budget, {args.top_k})'}; median seconds")
    print(f"{'budget':>6} {'K':>5} {'nodes':>5} {'reference':>12} {'ops (py call)':>14} {'core (C++)':>12} "
          f"{'ref/ops':>8} {'ref/core':>9}")
    for budget in args.budgets:
        k = budget if args.top_k is None else min(budget, args.top_k)
        lp, ids = kn.reference.topk_logsoftmax(logits, k)
        ref_tree = kn.reference.tree_build(lp, ids, budget)
        nat_tree = kn.ops.tree_build(lp, ids, budget)
        assert np.array_equal(ref_tree.parents, nat_tree.parents) and np.array_equal(ref_tree.tokens, nat_tree.tokens)
        t_ref = median_seconds(lambda: kn.reference.tree_build(lp, ids, budget), args.ref_repeats, 3)
        t_ops = median_seconds(lambda: kn.ops.tree_build(lp, ids, budget), args.ops_repeats, 20)
        kn._native.tree_build_cpu_timing(lp, ids, budget, 50)  # warm-up
        t_core = float(np.median(kn._native.tree_build_cpu_timing(lp, ids, budget, args.core_repeats)))
        row = dict(budget=budget, depth=args.depth, top_k=k, nodes=ref_tree.n, reference_s=t_ref, ops_s=t_ops,
                   core_s=t_core, speedup_ops=t_ref / t_ops, speedup_core=t_ref / t_core)
        rows.append(row)
        print(f"{budget:>6} {k:>5} {ref_tree.n:>5} {t_ref * 1e6:>10.1f}us {t_ops * 1e6:>12.1f}us "
              f"{t_core * 1e6:>10.1f}us {t_ref / t_ops:>7.1f}x {t_ref / t_core:>8.0f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(benchmark="tree_build", machine=platform.machine(), processor=platform.processor(),
                           python=platform.python_version(), build=kn.build_info(), args=vars(args), rows=rows),
                      f, indent=2, default=str)


if __name__ == "__main__":
    main()
