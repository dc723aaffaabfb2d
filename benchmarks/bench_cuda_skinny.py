"""Skinny linear layers vs cuBLAS inside the mini-kimi forward step (H200): the graph-replayed
step time at T = 1..32 new tokens (causal, context 512) with the dense projections through
cuda::linear_skinny (the default, skinny_max_tokens=-1) and through cuBLAS (skinny_max_tokens=0, tile_max_tokens=0),
same weights, same run. Picks the crossover that CudaModel's auto setting uses.

    python3 benchmarks/bench_cuda_skinny.py [--context 512] [--reps 20] [--tokens 1 2 4 ...] [--json FILE]
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32])
    ap.add_argument("--max-tokens", type=int, default=-1,
                    help="skinny_max_tokens of the skinny variant (-1 auto = 20; up to 64: token slices of <= 16)")
    ap.add_argument("--ckpt", default="/tmp/kn_mini_kimi")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    from bench_cuda_model import step_times

    res = step_times(args.ckpt, {"skinny": dict(skinny_max_tokens=args.max_tokens), "cublas": dict(skinny_max_tokens=0, tile_max_tokens=0)},
                     args.tokens, context=args.context, reps=args.reps)
    print(f"## mini-kimi step, context {args.context}: dense projections through linear_skinny vs cuBLAS "
          f"({torch.cuda.get_device_name(0)}, graph replay, median of {args.reps})")
    print("| T | skinny ms | cuBLAS ms | cuBLAS / skinny |")
    print("|---:|---:|---:|---:|")
    rows = []
    for T in args.tokens:
        a, b = res[("skinny", T)], res[("cublas", T)]
        rows.append(dict(T=T, skinny_ms=a * 1e3, cublas_ms=b * 1e3))
        print(f"| {T} | {a * 1e3:.3f} | {b * 1e3:.3f} | {b / a:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(context=args.context, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
