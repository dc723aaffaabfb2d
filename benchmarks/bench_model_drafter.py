"""The model drafter through C++ (the default over a native model; on the GPU its chain stays on
the device and the round takes its logits there) against its Python definition (native=False:
a Python loop of the draft model's host forwards, logits through numpy), on the embedded default
target + draft pair, on --device.

Two tables:
  * the drafter alone: one call per round-like context (the demo prompt's AR continuation, the
    context grown by --accept tokens + a root per call), the two drafters (each over its own copy
    of the draft model) called alternately, median us per call, per depth;
  * generate: tokens/s of whole calls (prefill included, the demo's measure), median of --repeats,
    the modes interleaved per repeat; AR, then per (budget, depth): Python drafter, native drafter,
    and their ratio; mean acceptance and the drafter's share of the time (stats seconds.draft).
Every row's tokens are checked against AR's.

With --adaptive, each setting also runs the native drafter with adaptive_budget=True (the
budget as the ceiling; on the GPU its device drafts are read back for the choice), and the
table adds the mean tree size; --no-python leaves the Python drafter's rows out.

    python3 benchmarks/bench_model_drafter.py [--device cuda] [-n 128] [--repeats 5]
        [--settings 4x4 8x4 16x6 32x8] [--min-chain-prob 0.1] [--depths 2 4 8] [--adaptive] [--no-python]
"""
import argparse
import statistics
import sys
import time

import numpy as np

import kdtree_native as kn
from kdtree_native.cli import DEMO_PROMPT, _demo_prompt_ids
from kdtree_native.drafters import ModelDrafter
from kdtree_native.generation import generate
from kdtree_native.models import default_draft_dir, default_model_dir


def load(device):
    from tokenizers import Tokenizer

    eng = kn.Engine.from_pretrained(default_model_dir(), device=device, max_seq_len=1024)
    draft = kn.Engine.from_pretrained(default_draft_dir(), device=device, max_seq_len=1024)
    tok = Tokenizer.from_file(default_model_dir() + "/tokenizer.json")
    return eng, draft, tok


def time_drafters(drafters, ctx_all, P, depth, accept, reps):
    """Median us per draft() call of each drafter over contexts P, P + accept + 1, ... of the AR
    continuation, the drafters called alternately on each context (each over its own draft model)."""
    times = [[] for _ in drafters]
    for rep in range(reps):
        n = P
        while n + depth + 1 < len(ctx_all):
            c = np.ascontiguousarray(ctx_all[:n], dtype=np.int32)
            for d, ts in zip(drafters, times):
                t0 = time.perf_counter()
                d.draft(c, depth, 8)
                ts.append(time.perf_counter() - t0)
            n += accept + 1
    return [1e6 * statistics.median(ts) for ts in times]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--settings", nargs="+", default=["4x4", "8x4", "16x6", "32x8"])
    ap.add_argument("--min-chain-prob", type=float, default=0.1)
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--accept", type=int, default=2, help="tokens accepted per call in the drafter-alone table")
    ap.add_argument("--adaptive", action="store_true", help="add adaptive-budget rows of the native drafter")
    ap.add_argument("--no-python", action="store_true", help="leave out the Python drafter's rows")
    args = ap.parse_args()
    eng, draft, tok = load(args.device)
    dev = eng.device
    name = kn._native.cuda_device_name() if dev == "cuda" else "CPU"
    prompt = np.asarray(_demo_prompt_ids(tok, DEMO_PROMPT), np.int64)
    ar = generate(eng, prompt, args.n)
    ctx_all = np.concatenate([prompt, ar.tokens]).astype(np.int32)
    mcp = args.min_chain_prob

    print(f"## Model drafter, Python vs C++ ({dev}: {name}); embedded default target + draft")
    print(f"\n### The drafter alone: median us per call (contexts of the demo prompt's AR continuation, "
          f"+{args.accept} accepted + a root per call; min_chain_prob 0)")
    print("| depth | Python | C++ | ratio |\n|---:|---:|---:|---:|")
    draft2 = kn.Engine.from_pretrained(default_draft_dir(), device=draft.device, max_seq_len=1024)
    for depth in ([] if args.no_python else args.depths):
        py, nat = time_drafters([ModelDrafter(draft2, native=False), ModelDrafter(draft)], ctx_all, len(prompt),
                                depth, args.accept, 3)
        print(f"| {depth} | {py:.0f} | {nat:.0f} | {py / nat:.2f}x |")

    modes = [("AR", None, 0, 1, False)]
    for s in args.settings:
        b, d = (int(x) for x in s.split("x"))
        if not args.no_python:
            modes.append((f"python {b}x{d}", lambda: ModelDrafter(draft, min_chain_prob=mcp, native=False), b, d,
                          False))
        modes.append((f"native {b}x{d}", lambda: ModelDrafter(draft, min_chain_prob=mcp), b, d, False))
        if args.adaptive:
            modes.append((f"native <={b}x{d} adaptive", lambda: ModelDrafter(draft, min_chain_prob=mcp), b, d, True))
    runs = {m[0]: [] for m in modes}
    for rep in range(args.repeats):
        for label, make, b, d, adaptive in modes:
            r = generate(eng, prompt, args.n, drafter=make() if make else None, tree_budget=b, depth=d,
                         adaptive_budget=adaptive)
            if not np.array_equal(r.tokens, ar.tokens):
                print(f"error: {label} differs from AR", file=sys.stderr)
                return 1
            runs[label].append(r)
    tps = {k: statistics.median(r.stats["tokens_per_second"] for r in v) for k, v in runs.items()}
    print(f"\n### generate: {args.n} new tokens, greedy, tokens/s = median of {args.repeats} whole calls "
          f"(prefill included); min_chain_prob {mcp}; every row == AR")
    print("| mode | tok/s | x AR | mean acc | mean tree | draft s / call | draft share |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for label, *_ in modes:
        r = runs[label][-1]
        sec = r.stats["seconds"]
        share = sec["draft"] / sec["total"] if sec["total"] else 0.0
        print(f"| {label} | {tps[label]:.1f} | {tps[label] / tps['AR']:.2f}x | "
              f"{r.stats['mean_acceptance_length']:.2f} | {r.stats['mean_tree_size']:.1f} | {sec['draft']:.4f} | "
              f"{100 * share:.0f} % |")
    for s in args.settings:
        if not args.no_python:
            print(f"native / python {s}: {tps['native ' + s] / tps['python ' + s]:.2f}x")
        if args.adaptive:
            b, d = s.split("x")
            print(f"adaptive / fixed {s}: {tps[f'native <={b}x{d} adaptive'] / tps['native ' + s]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
