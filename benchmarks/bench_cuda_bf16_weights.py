"""GPU model on a BF16 checkpoint: its weight matrices held as FP32 + BF16 copies (bf16_weights="copies")
against BF16 alone ("only"), in one process on the same weights: device memory, prefill time, AR
decode tokens/s, and whether the logits and tokens are the same bits (docs/CUDA_MODEL.md "BF16
weights").

Checkpoint: mini-kimi (bench_cuda_model.py's, made with HF transformers when missing) with its
weights rounded to BF16 (what a BF16 checkpoint of the same model holds). Prefill = forward_last of
a P-token prompt from an empty cache, synchronised (median of --reps, the modes alternating); AR =
generate() of --ar-tokens tokens after a 64-token prompt (decode time only, the modes alternating,
each run printed).

    python benchmarks/bench_cuda_bf16_weights.py [--ckpt DIR] [--prompts 512 2048] [--reps 6] [--ar-tokens 128] [--ar-runs 6]
"""
import argparse
import os
import sys
import time

import numpy as np

from kdtree_native import _native
from kdtree_native.checkpoint import load_weights
from kdtree_native.config import load_config
from kdtree_native.generation import generate

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
sys.path.insert(0, HERE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/kn_mini_kimi")
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--ar-tokens", type=int, default=128)
    ap.add_argument("--ar-runs", type=int, default=6)
    args = ap.parse_args()

    from bench_cuda_model import mini_kimi_checkpoint
    from hf_models import to_bf16
    cfg = load_config(mini_kimi_checkpoint(args.ckpt))
    weights = {k: to_bf16(v.astype(np.float32)) for k, v in load_weights(args.ckpt, cfg).items()}
    max_len = max(args.prompts) + 512
    models = {}
    for mode in ("copies", "only"):
        t0 = time.time()
        m = _native.CudaModel(cfg.to_native(), max_len, bf16_weights=mode)
        for name, arr in weights.items():
            m.set_weight(name, arr)
        m.finalize()
        models[mode] = m
        print(f"{mode:6s}: weights {m.weight_bytes / 2**20:.0f} MiB FP32 + {m.bf16_weight_bytes / 2**20:.0f} MiB BF16, "
              f"workspaces {m.workspace_bytes / 2**20:.0f} MiB, all {m.memory_bytes / 2**20:.0f} MiB; "
              f"loaded in {time.time() - t0:.1f} s ({m.device_name})", flush=True)
    del weights
    rng = np.random.default_rng(0)
    for P in args.prompts:
        ids = rng.integers(0, cfg.vocab_size, P).astype(np.int32)
        times = {k: [] for k in models}
        last = {}
        for rep in range(args.reps + 1):
            for mode, m in models.items():
                m.reset()
                m.synchronize()
                t0 = time.perf_counter()
                last[mode] = m.forward_last(ids, np.arange(P), 1)
                m.synchronize()
                if rep:  # (the first: warm-up)
                    times[mode].append(time.perf_counter() - t0)
        same = np.array_equal(last["copies"].view(np.uint32), last["only"].view(np.uint32))
        print(f"prefill {P:5d}: copies {np.median(times['copies']) * 1e3:.2f} ms, only "
              f"{np.median(times['only']) * 1e3:.2f} ms; the last row's logits the same bits: {same}", flush=True)
    ids = rng.integers(0, cfg.vocab_size, 64).astype(np.int32)
    tokens = {}
    for mode, m in models.items():  # warm-up (graphs captured)
        tokens[mode] = generate(m, ids, args.ar_tokens + 1, seed=0).tokens
    for run in range(args.ar_runs):
        order = list(models.items()) if run % 2 == 0 else list(models.items())[::-1]
        for mode, m in order:
            r = generate(m, ids, args.ar_tokens + 1, seed=0)
            s = r.stats["seconds"]
            assert np.array_equal(r.tokens, tokens[mode])
            print(f"AR {mode:6s}: {args.ar_tokens / (s['total'] - s['prefill']):.1f} tok/s", flush=True)
    print("AR tokens the same in both modes:", bool(np.array_equal(tokens["copies"], tokens["only"])))


if __name__ == "__main__":
    main()
