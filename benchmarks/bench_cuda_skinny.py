"""Skinny linear layers vs cuBLAS inside the mini-kimi forward step (H200): the graph-replayed
step time at T = 1..32 new tokens (causal, context 512) with the dense projections through
cuda::linear_skinny (the default, skinny_max_tokens=-1) and through cuBLAS (skinny_max_tokens=0),
same weights, same run. Picks the crossover that CudaModel's auto setting uses.

    python3 benchmarks/bench_cuda_skinny.py [--context 512] [--reps 20] [--json FILE]
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32])
    ap.add_argument("--ckpt", default="/tmp/kn_mini_kimi")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    from kdtree_native import _native
    from kdtree_native.checkpoint import load_weights
    from kdtree_native.config import load_config
    from bench_cuda_model import MINI_KIMI, median_time
    from hf_models import make_checkpoint

    if not os.path.isfile(os.path.join(args.ckpt, "config.json")):
        make_checkpoint(args.ckpt, MINI_KIMI, seed=0)
    cfg = load_config(args.ckpt)
    weights = load_weights(args.ckpt, cfg)
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    L = args.context
    V = cfg.vocab_size
    ctx = np.random.default_rng(0).integers(0, V, L).astype(np.int32)
    logits = torch.empty((64, V), device=dev)
    res = {}
    for label, smt in (("skinny", -1), ("cublas", 0)):
        m = _native.CudaModel(cfg.to_native(), L + 64, skinny_max_tokens=smt)
        for name, arr in weights.items():
            m.set_weight(name, np.ascontiguousarray(arr, dtype=np.float32))
        m.finalize()
        m.forward(ctx, np.arange(L), None)
        m.commit(np.arange(L))
        for T in args.tokens:
            tok = torch.as_tensor(np.random.default_rng(T).integers(0, V, T).astype(np.int32), device=dev)
            pos = torch.arange(L, L + T, dtype=torch.int32, device=dev)
            fn = lambda: m.forward_ptr(tok.data_ptr(), pos.data_ptr(), 0, 0, T, logits.data_ptr())
            res[(label, T)] = median_time(fn, sync, args.reps, warmup=5)
        del m
        torch.cuda.empty_cache()
    print(f"## mini-kimi step, context {L}: dense projections through linear_skinny vs cuBLAS "
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
            json.dump(dict(context=L, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
