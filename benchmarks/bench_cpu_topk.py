"""CPU top-k + log-softmax of drafter logits (kn.ops.topk_logsoftmax, device="cpu"): the host
round's cost for a logits draft (ModelDrafter). Best of `--repeats` means of 50 calls each.

    python3 benchmarks/bench_cpu_topk.py [--depth 8] [--vocab 4096] [--ks 8 32 64 65 512]
"""
import argparse
import time

import numpy as np

import kdtree_native as kn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--ks", type=int, nargs="*", default=[8, 32, 64, 65, 512])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    x = np.random.default_rng(0).standard_normal((args.depth, args.vocab)).astype(np.float32) * 3
    print(f"## CPU topk_logsoftmax, logits [{args.depth}, {args.vocab}] (best of {args.repeats} means of 50 calls)")
    print("| k | us per call |")
    print("|---:|---:|")
    for k in args.ks:
        kn.ops.topk_logsoftmax(x, k, device="cpu")
        best = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            for _ in range(50):
                kn.ops.topk_logsoftmax(x, k, device="cpu")
            best = min(best, (time.perf_counter() - t) / 50)
        print(f"| {k} | {best * 1e6:.0f} |")


if __name__ == "__main__":
    main()
