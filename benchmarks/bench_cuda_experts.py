"""The grouped expert kernels inside the mini-kimi step (H200): graph-replayed step time at T new
tokens (causal, context 512) with expert_kernel = "skinny" (GEMV-style, tiles of 8 slots),
"tiled" (SGEMM, 64 slots), mma8 / mma16 / mma32 / mma64 (expert_kernel="mma", the tensor cores
3xTF32, expert_mma_rows slots per tile) and "auto", same weights, same run. CudaModel's auto choice comes from this table (docs/BENCHMARKS.md). Makes the
mini-kimi checkpoint of bench_cuda_model.py on first use.

    python3 benchmarks/bench_cuda_experts.py [--tokens 1 4 9 17 33 49 65 97 129] [--reps 15]
        [--kernels skinny tiled mma8 mma16 mma32 mma64 auto]
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 4, 9, 17, 33, 49, 65, 97, 129])
    ap.add_argument("--kernels", nargs="*", default=["skinny", "tiled", "mma8", "mma16", "auto"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--ckpt", default="/tmp/kn_mini_kimi")
    args = ap.parse_args()
    from bench_cuda_model import step_times
    from kdtree_native.config import load_config

    ks = args.kernels
    def options(label):
        if label.startswith("mma"):
            return dict(expert_kernel="mma", expert_mma_rows=int(label[3:] or 0))
        return dict(expert_kernel=label)

    res = step_times(args.ckpt, {k: options(k) for k in ks}, args.tokens, reps=args.reps)
    K = load_config(args.ckpt).num_experts_per_tok
    print(f"## mini-kimi step by expert kernel (graph replay, context 512, median of {args.reps}, ms)")
    print("| T | A | " + " | ".join(ks) + " | fastest |")
    print("|---:|---:|" + "---:|" * len(ks) + "---|")
    for T in args.tokens:
        ms = {k: res[(k, T)] * 1e3 for k in ks}
        print(f"| {T} | {T * K} | " + " | ".join(f"{ms[k]:.3f}" for k in ks) + f" | {min(ms, key=ms.get)} |")


if __name__ == "__main__":
    main()
