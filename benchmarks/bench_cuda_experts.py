"""The two grouped expert kernels inside the mini-kimi step (H200): graph-replayed step time at
T new tokens (causal, context 512) with expert_kernel="skinny" and "tiled", same weights, same
run. CudaModel's auto switch (T*K <= 12 E -> skinny) comes from this table (docs/BENCHMARKS.md).
Makes the mini-kimi checkpoint of bench_cuda_model.py on first use.

    python3 benchmarks/bench_cuda_experts.py [--tokens 9 17 33 49 65 97] [--reps 15]
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[9, 17, 33, 49, 65, 97])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--ckpt", default="/tmp/kn_mini_kimi")
    args = ap.parse_args()
    from bench_cuda_model import step_times
    from kdtree_native.config import load_config

    res = step_times(args.ckpt, {"skinny": dict(expert_kernel="skinny"), "tiled": dict(expert_kernel="tiled")},
                     args.tokens, reps=args.reps)
    K = load_config(args.ckpt).num_experts_per_tok
    for T in args.tokens:
        print(f"expert kernels T={T} (A={T * K}): skinny {res[('skinny', T)] * 1e3:.3f} ms  "
              f"tiled {res[('tiled', T)] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
