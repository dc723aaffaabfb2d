"""Why a Python drafter costs more inside `generate` than in a loop (CPU engine, embedded default).

    python benchmarks/bench_cpu_drafter_cache.py [-n 160] [--repeats 3] [--budget 4] [--depth 8]

For each repeat: one n-gram DDTree `generate` on the demo prompt with every `NgramDrafter.draft`
call timed inside the run (its context, depth and top-k recorded), then the same calls replayed
(1) back to back in a tight loop and (2) each after streaming 64 MB through the caches (a stand-in
for the target forward that runs between two drafter calls). Prints the mean / median ms per call
of each. Run it with KDTREE_NUM_THREADS / OPENBLAS_NUM_THREADS varied to see whether the model's
worker threads (or OpenBLAS's) compete with the drafter. Falls back to the small random model when
the embedded model is not installed (then there is no tokenizer: random prompt ids).
"""
import argparse
import os
import sys
import time
import types

import numpy as np

from kdtree_native import cli
from kdtree_native.drafters import NgramDrafter
from kdtree_native.generation import generate


class TimedNgram(NgramDrafter):
    def __init__(self):
        super().__init__()
        self.calls = []

    def draft(self, context, depth, top_k):
        t = time.perf_counter()
        r = super().draft(context, depth, top_k)
        self.calls.append((time.perf_counter() - t, np.array(context, copy=True), depth, top_k))
        return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=160, help="new tokens per generate")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=cli.DEMO_NGRAM[0])
    ap.add_argument("--depth", type=int, default=cli.DEMO_NGRAM[1])
    args = ap.parse_args()
    eng, _, tok, what = cli._demo_models(types.SimpleNamespace(max_seq_len=1024, device="cpu"))
    prompt = cli._demo_prompt_ids(tok)
    threads = {k: os.environ.get(k, "unset") for k in ("KDTREE_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    print(f"model: {what}; {threads}; {os.cpu_count()} CPUs")
    generate(eng, prompt, args.n)  # warm-up
    big = np.ones(16 * 1024 * 1024, np.float32)  # 64 MB
    for rep in range(args.repeats):
        d = TimedNgram()
        res = generate(eng, prompt, args.n, drafter=d, tree_budget=args.budget, depth=args.depth)
        inside = np.array([c[0] for c in d.calls])
        plain, cold = NgramDrafter(), NgramDrafter()
        t0 = time.perf_counter()
        for _, ctx, depth, k in d.calls:
            plain.draft(ctx, depth, k)
        loop = (time.perf_counter() - t0) / len(d.calls)
        ts = []
        for _, ctx, depth, k in d.calls:
            big += 1.0
            t = time.perf_counter()
            cold.draft(ctx, depth, k)
            ts.append(time.perf_counter() - t)
        print(f"repeat {rep + 1}: {res.stats['tokens_per_second']:.1f} tok/s, {len(d.calls)} drafter calls; ms per call: "
              f"inside generate {inside.mean() * 1e3:.3f} (median {np.median(inside) * 1e3:.3f}), "
              f"tight loop {loop * 1e3:.3f}, after a 64 MB stream {np.mean(ts) * 1e3:.3f} (median {np.median(ts) * 1e3:.3f})")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
