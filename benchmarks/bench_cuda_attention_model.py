"""Verify-attention kernels inside the mini-kimi forward step (H200): the graph-replayed step time
of T new tokens (causal) at several contexts with CudaModel(attention_kernel=...) = auto, split-KV
with 16, 8 and 4 query rows per block, and the two-pass decode kernels, same weights, same run. Isolated kernel timings
(bench_cuda_verify_attention.py) replay 10 copies of one attention call; inside the step the
kernels overlap their neighbours through programmatic dependent launch, which this measures.

    python3 benchmarks/bench_cuda_attention_model.py [--contexts 512 1024 2048] [--tokens 1 2 4] [--json FILE]
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
    ap.add_argument("--contexts", type=int, nargs="*", default=[512, 1024, 2048])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ckpt", default="/tmp/kn_mini_kimi")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    from bench_cuda_model import step_times

    variants = {"auto": {}, "splitkv16": dict(attention_kernel="splitkv16"),
                "splitkv8": dict(attention_kernel="splitkv8"), "splitkv4": dict(attention_kernel="splitkv4"),
                "decode": dict(attention_kernel="decode")}
    print(f"## mini-kimi step: attention kernels inside the step ({torch.cuda.get_device_name(0)}, graph replay, "
          f"median of {args.reps}, ms)")
    print("| context | T | auto | split-KV 16 rows | split-KV 8 rows | split-KV 4 rows | decode | 8 rows / 4 rows |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for L in args.contexts:
        res = step_times(args.ckpt, variants, args.tokens, context=L, reps=args.reps)
        for T in args.tokens:
            a, s16, s8, s4, d = (res[(k, T)] * 1e3 for k in ("auto", "splitkv16", "splitkv8", "splitkv4", "decode"))
            rows.append(dict(context=L, T=T, auto_ms=a, splitkv16_ms=s16, splitkv8_ms=s8, splitkv4_ms=s4, decode_ms=d))
            print(f"| {L} | {T} | {a:.3f} | {s16:.3f} | {s8:.3f} | {s4:.3f} | {d:.3f} | {s8 / s4:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
