"""Prefix reuse (generate(reuse_prefix=True), docs/ENGINE.md "Prefix reuse"): a multi-turn exchange on the
embedded default model, each turn's prompt = the whole conversation so far + a new user line, generated with and
without reuse. Reports per turn the prompt length, the tokens reused, the prefill seconds and the time to the
first token (prefill included), median over --repeats, and checks the outputs equal.

    python benchmarks/bench_prefix_reuse.py [--turns 6] [--new 64] [--line-tokens 24] [--repeats 3]
        [--device cpu|cuda] [--drafter none|ngram]
"""
import argparse
import statistics
import sys
import time

import numpy as np

import kdtree_native as kn
from kdtree_native.drafters import NgramDrafter


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--new", type=int, default=64, help="tokens generated per turn")
    ap.add_argument("--line-tokens", type=int, default=24, help="tokens of each turn's new user line")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--drafter", default="none", choices=("none", "ngram"))
    args = ap.parse_args()
    eng = kn.Engine.from_pretrained(kn.default_model_dir(), device=args.device, max_seq_len=2048)
    rng = np.random.default_rng(0)
    lines = [rng.integers(5, eng.vocab_size, args.line_tokens) for _ in range(args.turns)]
    kw = dict(drafter=NgramDrafter(), tree_budget=4, depth=8) if args.drafter == "ngram" else {}

    def conversation(reuse):
        """One pass over the turns: per turn (prompt length, reused, prefill s, first-token s, tokens)."""
        hist = np.zeros(0, np.int64)
        rows = []
        eng.generate(np.array([1, 2, 3]), 1)   # (another prompt last: the first turn reuses nothing)
        for line in lines:
            prompt = np.concatenate([hist, line])
            t0 = time.perf_counter()
            first = []
            r = eng.generate(prompt, args.new, reuse_prefix=reuse,
                             progress=lambda new, done, total: first.append(time.perf_counter() - t0) if done == 1 else None,
                             **kw)
            rows.append((len(prompt), r.stats["prefill_reused"], r.stats["seconds"]["prefill"], first[0], r.tokens))
            hist = np.concatenate([prompt, r.tokens])
        return rows

    runs = {False: [], True: []}
    for _ in range(args.repeats):
        for reuse in (False, True):
            runs[reuse].append(conversation(reuse))
    print(f"{args.turns} turns on the embedded model ({eng.device}), {args.line_tokens} new prompt tokens and "
          f"{args.new} generated per turn, drafter {args.drafter}; medians of {args.repeats}")
    print(f"{'turn':>4}{'prompt':>8}{'reused':>8}{'prefill ms':>12}{'(reuse)':>9}{'first tok ms':>14}{'(reuse)':>9}  same")
    ok = True
    for t in range(args.turns):
        med = {k: [statistics.median(run[t][i] for run in runs[k]) for i in (2, 3)] for k in runs}
        same = all(np.array_equal(a[t][4], b[t][4]) for a in runs[False] for b in runs[True])
        ok &= same
        print(f"{t + 1:>4}{runs[True][0][t][0]:>8}{runs[True][0][t][1]:>8}{med[False][0] * 1e3:>12.2f}"
              f"{med[True][0] * 1e3:>9.2f}{med[False][1] * 1e3:>14.2f}{med[True][1] * 1e3:>9.2f}  {'yes' if same else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
