"""CPU engine: AR vs DDTree tokens/s with each drafter, and mean acceptance length per tree
budget. Runs on the embedded default model when it is installed (kdtree_native.models), else on
a small random DeepSeek-V3-shaped model built in memory (the table says which).

    python benchmarks/bench_cpu_engine.py [-n 128] [--budgets 0 4 16 64] [--depth 8] [--repeats 3] [--out result.json]

Each configuration: one warm-up run, then the median of --repeats timed runs (tokens/s of the
whole generate call, prefill included). Every DDTree output is checked equal to AR's.
"""
import argparse
import json
import statistics
import sys

import numpy as np

from kdtree_native.cli import DEMO_PROMPT, _demo_models
from kdtree_native.drafters import ModelDrafter, NgramDrafter, OracleDrafter
from kdtree_native.generation import generate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--budgets", type=int, nargs="*", default=[4, 16, 64])
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--drafters", nargs="*", default=["ngram", "model", "oracle", "oracle:0.3"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.prompt = None
    eng, draft_eng, tok, what = _demo_models(args)
    prompt = tok.encode(DEMO_PROMPT).ids if tok else [int(x) for x in np.random.default_rng(0).integers(2, eng.vocab_size, 24)]
    n = args.max_new_tokens

    def timed(drafter_factory, budget):
        runs = []
        for i in range(args.repeats + 1):
            res = generate(eng, prompt, n, drafter=drafter_factory() if drafter_factory else None, tree_budget=budget,
                           depth=args.depth)
            if i:
                runs.append(res)
        tps = statistics.median(r.stats["tokens_per_second"] for r in runs)
        return runs[-1], tps

    ar, ar_tps = timed(None, 0)
    factories = {
        "ngram": lambda: NgramDrafter(),
        "model": (lambda: ModelDrafter(draft_eng)) if draft_eng is not None else None,
        "oracle": lambda: OracleDrafter(ar.tokens, vocab_size=eng.vocab_size),
        "oracle:0.3": lambda: OracleDrafter(ar.tokens, 0.3, seed=1, vocab_size=eng.vocab_size),
    }
    rows = [dict(drafter="none (AR)", budget=0, tokens_per_second=ar_tps, speedup=1.0, mean_acceptance_length=1.0,
                 stage_seconds=ar.stats["seconds"])]
    for name in args.drafters:
        f = factories.get(name)
        if f is None:
            continue
        for b in args.budgets:
            res, tps = timed(f, b)
            if not np.array_equal(res.tokens, ar.tokens):
                print(f"error: {name} B={b} output differs from AR", file=sys.stderr)
                return 1
            rows.append(dict(drafter=name, budget=b, tokens_per_second=tps, speedup=tps / ar_tps,
                             mean_acceptance_length=res.stats["mean_acceptance_length"],
                             stage_seconds=res.stats["seconds"]))
    print(f"model: {what}; {n} new tokens, depth {args.depth}, median of {args.repeats}")
    print(f"{'drafter':<12}{'budget':>7}{'tok/s':>9}{'speedup':>9}{'mean acc':>10}{'draft s':>9}{'verify s':>9}")
    for r in rows:
        s = r["stage_seconds"]
        print(f"{r['drafter']:<12}{r['budget']:>7}{r['tokens_per_second']:>9.1f}{r['speedup']:>8.2f}x"
              f"{r['mean_acceptance_length']:>10.2f}{s['draft']:>9.3f}{s['verify']:>9.3f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(model=what, max_new_tokens=n, depth=args.depth, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
