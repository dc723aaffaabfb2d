"""Time to the first token and AR decode through generate() on the GPU model (mini-kimi, FP32), for
comparing builds: run it once per build (e.g. `PYTHONPATH=<other build>`) and compare the medians;
the printed hash of the generated tokens must be the same across builds.

prefill = generate()'s stats["seconds"]["prefill"] of a P-token random prompt (the prefill plus the
first token), median over --reps runs after two warm-ups; AR = the decode tokens/s of the same runs.

    python benchmarks/bench_cuda_ttft.py [--ckpt DIR] [--prompts 512 2048] [--reps 8] [--new 33]
"""
import argparse
import hashlib
import os
import sys

import numpy as np

import kdtree_native as kn
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
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--new", type=int, default=33, help="tokens generated per run")
    args = ap.parse_args()

    from bench_cuda_model import mini_kimi_checkpoint, upload
    cfg = load_config(mini_kimi_checkpoint(args.ckpt))
    model = upload(_native.CudaModel(cfg.to_native(), max(args.prompts) + 512), load_weights(args.ckpt, cfg))
    print(f"kdtree_native from {os.path.dirname(kn.__file__)}; {model.device_name}")
    rng = np.random.default_rng(0)
    for P in args.prompts:
        prompt = rng.integers(0, cfg.vocab_size, P).astype(np.int32)
        pf, dec, toks = [], [], None
        for i in range(args.reps + 2):
            r = generate(model, prompt, args.new, seed=0)
            s = r.stats["seconds"]
            if i >= 2:
                pf.append(s["prefill"])
                dec.append((args.new - 1) / (s["total"] - s["prefill"]))
            toks = r.tokens
        h = hashlib.sha1(np.asarray(toks, np.int64).tobytes()).hexdigest()[:12]
        print(f"prompt {P:5d}: prefill median {np.median(pf) * 1e3:.3f} ms (min {min(pf) * 1e3:.3f}), "
              f"AR decode {np.median(dec):.1f} tok/s, tokens {h}", flush=True)


if __name__ == "__main__":
    main()
