"""In-step A/B of environment switches on the mini-kimi step (H200): for each variant the
environment is set, a CudaModel is built and its graph-replayed step of T new tokens (causal,
after `context` committed) is timed; variants are interleaved over rounds, so lease drift hits
them alike. For temporary experiment switches read through getenv in the native code (graphs
capture what the switch chose when the step is first replayed); CudaModel options have
bench_cuda_step_options.py. The last column is each variant's largest logit difference from the
first variant, relative to the logits' scale (0 = the same bits).

    python3 benchmarks/bench_cuda_step_env.py "base;" "new;KDTREE_EXP_X=2,KDTREE_EXP_Y=1" \\
        [--tokens 17 33 65] [--contexts 512] [--rounds 2] [--reps 30]

A variant is LABEL;NAME=VALUE[,NAME=VALUE...] (nothing after ';' = no switch). Every switch named
in any variant is unset for the variants that do not name it.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))


def parse(text):
    label, _, spec = text.partition(";")
    if not label:
        raise SystemExit(f"variant {text!r}: expected LABEL;NAME=VALUE[,NAME=VALUE...]")
    env = {}
    for item in filter(None, spec.split(",")):
        name, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"variant {text!r}: {item!r} is not NAME=VALUE")
        env[name] = value
    return label, env


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--tokens", type=int, nargs="+", default=[17, 33, 65])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ckpt", default="/tmp/kn_mini_kimi")
    args = ap.parse_args()
    import torch
    from bench_cuda_model import MINI_KIMI, median_time, upload
    from hf_models import make_checkpoint
    from kdtree_native import _native
    from kdtree_native.checkpoint import load_weights
    from kdtree_native.config import load_config

    variants = [parse(v) for v in args.variants]
    knobs = sorted({k for _, env in variants for k in env})
    if not os.path.isfile(os.path.join(args.ckpt, "config.json")):
        make_checkpoint(args.ckpt, MINI_KIMI, seed=0)
    cfg = load_config(args.ckpt)
    weights = load_weights(args.ckpt, cfg)
    dev, sync, V = torch.device("cuda"), torch.cuda.synchronize, cfg.vocab_size
    logits = torch.empty((max(args.tokens), V), device=dev)
    times, diffs, first = {}, {}, {}
    for L in args.contexts:
        ctx = np.random.default_rng(0).integers(0, V, L).astype(np.int32)
        for _ in range(args.rounds):
            for label, env in variants:
                for k in knobs:
                    os.environ.pop(k, None)
                os.environ.update(env)
                m = upload(_native.CudaModel(cfg.to_native(), L + max(args.tokens)), weights)
                m.forward(ctx, np.arange(L), None)
                m.commit(np.arange(L))
                for T in args.tokens:
                    tok = torch.as_tensor(np.random.default_rng(T).integers(0, V, T).astype(np.int32), device=dev)
                    pos = torch.arange(L, L + T, dtype=torch.int32, device=dev)
                    fn = lambda: m.forward_ptr(tok.data_ptr(), pos.data_ptr(), 0, 0, T, logits.data_ptr())
                    times.setdefault((L, T, label), []).append(median_time(fn, sync, args.reps, warmup=5) * 1e3)
                    out = logits[:T].cpu().numpy().copy()
                    ref = first.setdefault((L, T), out)
                    d = float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
                    diffs[(L, T, label)] = max(diffs.get((L, T, label), 0.0), d)
                del m
                torch.cuda.empty_cache()
    for k in knobs:
        os.environ.pop(k, None)
    labels = [label for label, _ in variants]
    print(f"## mini-kimi step per environment variant ({torch.cuda.get_device_name(0)}, graph replay, median of "
          f"{args.reps} per round, ms, rounds in order)")
    print("variants: " + "; ".join(f"{label} = {env or 'no switch'}" for label, env in variants))
    print("| context | T | " + " | ".join(labels) + " | max rel diff vs " + labels[0] + " |")
    print("|---:|---:|" + "---|" * len(labels) + "---|")
    for L in args.contexts:
        for T in args.tokens:
            cells = [" / ".join(f"{x:.3f}" for x in times[(L, T, label)]) for label in labels]
            print(f"| {L} | {T} | " + " | ".join(cells) + " | " +
                  " ".join(f"{diffs[(L, T, label)]:.1e}" for label in labels) + " |")


if __name__ == "__main__":
    main()
