"""GPU model with INT4 routed experts (int4_experts_group=32, Kimi K2-Thinking's W4A16 scheme) against the same
model with those experts dequantized and held as BF16 (bf16_weights="only" both), in one process: device
memory, prefill time, the verify-sized steps (T new tokens after a 512-token context), AR decode tokens/s, and
whether the logits and tokens are the same bits (the kernels dequantize to the BF16 values the other model
holds: the same bits where the experts run on the tensor cores; the INT4 GEMV of the decode and small steps sums
in its own lane order, within FP32 rounding, and the line says how far; docs/CUDA_MODEL.md "INT4 experts").

Checkpoint: mini-kimi (bench_cuda_model.py's, made with HF transformers when missing) rounded to BF16, its
routed experts quantized here as Kimi's release is (groups of 32 along k, scale = BF16(absmax / 7), integers
round(w / scale) clipped to [-8, 7]). Prefill = forward_last of a P-token prompt from an empty cache; a step =
forward_last(1 row) of T causal tokens after a committed 512-token context, truncated back each time
(medians of --reps, the two models alternating); AR = generate() of --ar-tokens tokens after a 64-token prompt
(decode time only, alternating, each run printed).

    python benchmarks/bench_cuda_int4.py [--ckpt DIR] [--prompts 512 2048] [--steps 1 17 65] [--reps 10]
        [--ar-tokens 128] [--ar-runs 6]
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

GROUP = 32


def quantize(w, to_bf16):
    """w float32 [N, K] -> (packed uint8 [N, K / 2], scales float32 [N, K / 32] (BF16 values), the dequantized
    float32 weight bf16_round((q - 8) * scale)) as Kimi's INT4 release stores its experts."""
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    scale = to_bf16(np.maximum(np.abs(g).max(-1) / 7.0, 1e-8).astype(np.float32))
    q = np.clip(np.rint(g / scale[..., None]), -8, 7).astype(np.int32).reshape(n, k)
    nib = (q + 8).astype(np.uint8)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    deq = to_bf16((q.astype(np.float32) * np.repeat(scale, GROUP, axis=1)).astype(np.float32))
    return packed, scale, deq


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/kn_mini_kimi")
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 17, 65])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ar-tokens", type=int, default=128)
    ap.add_argument("--ar-runs", type=int, default=6)
    args = ap.parse_args()

    from bench_cuda_model import mini_kimi_checkpoint
    from hf_models import to_bf16
    cfg = load_config(mini_kimi_checkpoint(args.ckpt))
    max_len = max(max(args.prompts), 512 + max(args.steps)) + 256
    models = {"int4": _native.CudaModel(cfg.to_native(), max_len, bf16_weights="only", int4_experts_group=GROUP),
              "bf16": _native.CudaModel(cfg.to_native(), max_len, bf16_weights="only")}
    t0 = time.time()
    for name, arr in load_weights(args.ckpt, cfg).items():
        w = to_bf16(arr.astype(np.float32))
        if ".mlp.experts." in name:
            packed, scale, w = quantize(w, to_bf16)
            models["int4"].set_weight_int4(name, packed, scale, GROUP)
        else:
            models["int4"].set_weight(name, w)
        models["bf16"].set_weight(name, w)
    for label, m in models.items():
        m.finalize()
        print(f"{label}: weights {m.weight_bytes / 2**20:.0f} MiB FP32 + {m.bf16_weight_bytes / 2**20:.0f} MiB BF16 + "
              f"{m.int4_weight_bytes / 2**20:.0f} MiB INT4, workspaces {m.workspace_bytes / 2**20:.0f} MiB, all "
              f"{m.memory_bytes / 2**20:.0f} MiB ({m.device_name})", flush=True)
    print(f"loaded and quantized in {time.time() - t0:.1f} s", flush=True)

    rng = np.random.default_rng(0)

    def timed(fn):
        times = {k: [] for k in models}
        last = {}
        for rep in range(args.reps + 1):
            for label, m in (models.items() if rep % 2 == 0 else list(models.items())[::-1]):
                m.synchronize()
                t = time.perf_counter()
                last[label] = fn(m)
                m.synchronize()
                if rep:  # (the first: warm-up)
                    times[label].append(time.perf_counter() - t)
        a, b = np.asarray(last["int4"]), np.asarray(last["bf16"])
        same = "yes" if np.array_equal(a.view(np.uint32), b.view(np.uint32)) else \
            f"no, max |diff| / max |logit| {np.abs(a - b).max() / np.abs(b).max():.1e}"
        return {k: float(np.median(v)) * 1e3 for k, v in times.items()}, same

    for P in args.prompts:
        ids = rng.integers(0, cfg.vocab_size, P).astype(np.int32)

        def prefill(m):
            m.reset()
            return m.forward_last(ids, np.arange(P), 1)
        t, same = timed(prefill)
        print(f"prefill {P:5d}: int4 {t['int4']:.2f} ms, bf16 {t['bf16']:.2f} ms ({t['int4'] / t['bf16']:.3f}x); "
              f"the same bits: {same}", flush=True)
    ctx = rng.integers(0, cfg.vocab_size, 512).astype(np.int32)
    for m in models.values():
        m.reset()
        m.forward_last(ctx, np.arange(512), 0)
        m.commit(np.arange(512))
    for T in args.steps:
        ids = rng.integers(0, cfg.vocab_size, T).astype(np.int32)

        def step(m):
            m.truncate(512)
            return m.forward_last(ids, 512 + np.arange(T), 1)
        t, same = timed(step)
        print(f"step T = {T:3d} at 512: int4 {t['int4']:.3f} ms, bf16 {t['bf16']:.3f} ms ({t['int4'] / t['bf16']:.3f}x); "
              f"the same bits: {same}", flush=True)
    ids = rng.integers(0, cfg.vocab_size, 64).astype(np.int32)
    tokens = {label: generate(m, ids, args.ar_tokens + 1, seed=0).tokens for label, m in models.items()}  # warm-up
    rates = {k: [] for k in models}
    for run in range(args.ar_runs):
        for label, m in (models.items() if run % 2 == 0 else list(models.items())[::-1]):
            r = generate(m, ids, args.ar_tokens + 1, seed=0)
            s = r.stats["seconds"]
            assert np.array_equal(r.tokens, tokens[label])
            rates[label].append(args.ar_tokens / (s["total"] - s["prefill"]))
            print(f"AR {label}: {rates[label][-1]:.1f} tok/s", flush=True)
    print(f"AR median: int4 {np.median(rates['int4']):.1f}, bf16 {np.median(rates['bf16']):.1f} tok/s; the same tokens: "
          f"{bool(np.array_equal(tokens['int4'], tokens['bf16']))}")


if __name__ == "__main__":
    main()
