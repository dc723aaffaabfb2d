"""CPU engine: AR vs DDTree tokens/s on the embedded default model, swept over tree budget x depth
for each drafter, on held-out prompts (never trained on). Picks the configuration with the best
tokens/s per drafter (what `kdtree-native demo` uses by default).

    python benchmarks/bench_cpu_engine.py [-n 128] [--prompts 4] [--prompt-tokens 64]
        [--drafters ngram model] [--budgets 4 8 16 32 64] [--adaptive 16 64] [--depths 4 6 8 15]
        [--min-chain-prob 0] [--repeats 1] [--demo-prompt] [--json PATH]
    python benchmarks/bench_cpu_engine.py --forward-sizes 1 2 4 8 16 33 [--context 100] [--repeats 30] [--fp32-only]

Prompts: the beginnings of --prompts held-out files spread over `kdtree_native.models.heldout_sample()`
(path order), tokenised with the shipped tokenizer.json (HF `tokenizers`, <|bos|> prepended) and cut
at a token boundary near --prompt-tokens whose text does not end in whitespace and re-tokenises to
the same ids (docs/TRAINING.md); --demo-prompt adds the demo's own prompt. Falls back to a small
random model (and random prompts) when the embedded model is not installed.

--adaptive B ...: also each drafter at every depth with adaptive_budget=True and tree_budget B (each
round's size chosen from its draft, at most B; rows "<=B").

Order: for each repeat, for each prompt, for each drafter: one AR run, then every (budget, depth)
of that drafter (so load changes hit the AR baseline and the trees alike). A configuration's
tokens/s is pooled over prompts (sum of tokens / sum of seconds of whole generate calls, prefill
included; the median over repeats per prompt), its speed-up is against AR pooled the same way.
Every DDTree output is checked equal to AR's (greedy: lossless). The 1-minute load average is
recorded at start and end.

--forward-sizes: the cost of one target forward of T tokens (causal visibility, like a chain
verify) against a committed context of --context random tokens, for each T; the sizes are
interleaved and each is timed --repeats times (median and min wall time, and the median process
CPU time, which counts every thread).
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from kdtree_native.cli import DEMO_PROMPT, _demo_models
from kdtree_native.drafters import ModelDrafter, NgramDrafter
from kdtree_native.generation import generate


def cut_prompt(tok, text, want, min_tokens=16):
    """The first ~`want` tokens of `text` (BOS included), cut where the text does not end in
    whitespace and re-encoding it gives the same ids; None if no such cut exists."""
    ids = tok.encode(text).ids
    n = min(want, len(ids) - 1)  # the sample's last token may be cut mid-word
    while n >= min_tokens:
        prefix = tok.decode(ids[:n])
        if prefix and not prefix[-1].isspace() and tok.encode(prefix).ids == ids[:n]:
            return ids[:n]
        n -= 1
    return None


def heldout_prompts(tok, n, want):
    from kdtree_native.models import heldout_sample

    files = sorted(heldout_sample(), key=lambda f: f["path"])
    out = []
    for i in range(min(n, len(files))):
        f = files[(i * len(files)) // n]
        ids = cut_prompt(tok, f["text"], want)
        if ids is not None:
            out.append((f["path"], ids))
    return out


def forward_sizes(eng, sizes, context, repeats):
    rng = np.random.default_rng(0)
    V = eng.vocab_size
    eng.prefill(rng.integers(3, V, context).astype(np.int32))
    wall = {T: [] for T in sizes}
    cpu = {T: [] for T in sizes}
    for rep in range(repeats + 1):  # the first round warms up
        for T in sizes:
            toks = rng.integers(3, V, T).astype(np.int32)
            pos = (context + np.arange(T)).astype(np.int32)
            vis = np.tril(np.ones((T, T), dtype=bool))
            c0, t0 = time.process_time(), time.perf_counter()
            eng.forward(toks, pos, vis)
            if rep:
                wall[T].append(time.perf_counter() - t0)
                cpu[T].append(time.process_time() - c0)
    t1 = statistics.median(wall[sizes[0]])
    print(f"forward of T tokens after {context} committed, median of {repeats}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'T':>4}{'median ms':>11}{'min ms':>9}{'cpu ms':>9}{'vs T=' + str(sizes[0]):>10}")
    for T in sizes:
        m = statistics.median(wall[T])
        print(f"{T:>4}{1e3 * m:>11.2f}{1e3 * min(wall[T]):>9.2f}{1e3 * statistics.median(cpu[T]):>9.2f}{m / t1:>9.2f}x")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--demo-prompt", action="store_true", help="also run the demo's default prompt")
    ap.add_argument("--drafters", nargs="*", default=["ngram", "model"])
    ap.add_argument("--budgets", type=int, nargs="*", default=[4, 8, 16, 32, 64])
    ap.add_argument("--adaptive", type=int, nargs="*", default=[],
                    help="tree budgets to run with adaptive_budget=True (each round's size chosen, at most B)")
    ap.add_argument("--depths", type=int, nargs="*", default=[4, 6, 8, 15])
    ap.add_argument("--min-chain-prob", type=float, nargs="*", default=[0.0],
                    help="ModelDrafter early-stop thresholds to sweep (0 = always the full depth)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--json", default=None)
    ap.add_argument("--forward-sizes", type=int, nargs="*", default=None,
                    help="time single target forwards of these T instead of the generation sweep")
    ap.add_argument("--context", type=int, default=100, help="committed tokens before the --forward-sizes forwards")
    ap.add_argument("--fp32-only", action="store_true",
                    help="hold the models' weights as FP32 (CpuModel.use_bf16_weights(False), bf16_weights \"off\"): every GEMM reads FP32")
    args = ap.parse_args()
    args.prompt = None
    eng, draft_eng, tok, what = _demo_models(args)
    if args.fp32_only:
        for e in (eng, draft_eng):
            if e is not None and hasattr(e.model, "use_bf16_weights"):
                e.model.use_bf16_weights(False)
        what += ", FP32 weights only"
    if args.forward_sizes:
        print(f"model: {what}")
        return forward_sizes(eng, args.forward_sizes, args.context, max(args.repeats, 1))
    if tok is not None:
        prompts = heldout_prompts(tok, args.prompts, args.prompt_tokens)
        if args.demo_prompt:
            prompts.append(("<demo prompt>", tok.encode(DEMO_PROMPT).ids))
    else:
        rng = np.random.default_rng(0)
        prompts = [(f"random {i}", [int(x) for x in rng.integers(2, eng.vocab_size, 24)]) for i in range(args.prompts)]
    n = args.max_new_tokens
    load0 = os.getloadavg()[0]

    configs = []  # (drafter name, budget, depth, min_chain_prob, adaptive)
    budget_rows = [(b, False) for b in args.budgets] + [(b, True) for b in args.adaptive]
    for name in args.drafters:
        if name == "model" and draft_eng is None:
            continue
        for b, ada in budget_rows:
            for d in args.depths:
                for mcp in (args.min_chain_prob if name == "model" else [0.0]):
                    configs.append((name, b, d, mcp, ada))

    def make(name, mcp):
        return NgramDrafter() if name == "ngram" else ModelDrafter(draft_eng, min_chain_prob=mcp)

    # runs[(prompt index, config or "AR")] -> list of (seconds, tokens, result)
    runs = {}
    ar_tokens = {}
    t_start = time.perf_counter()
    generate(eng, prompts[0][1], 8)  # warm-up (workspaces, page faults)
    for rep in range(args.repeats):
        for pi, (_, ids) in enumerate(prompts):
            for name in args.drafters:
                ar = generate(eng, ids, n)
                ar_tokens.setdefault(pi, ar.tokens)
                runs.setdefault((pi, "AR"), []).append((ar.stats["seconds"]["total"], len(ar.tokens), ar))
                for cfg in configs:
                    if cfg[0] != name:
                        continue
                    _, b, d, mcp, ada = cfg
                    res = generate(eng, ids, n, drafter=make(name, mcp), tree_budget=b, depth=d, adaptive_budget=ada)
                    if not np.array_equal(res.tokens, ar_tokens[pi]):
                        print(f"error: {cfg} on prompt {pi} differs from AR", file=sys.stderr)
                        return 1
                    runs.setdefault((pi, cfg), []).append((res.stats["seconds"]["total"], len(res.tokens), res))
            print(f"\rrepeat {rep + 1}/{args.repeats}, prompt {pi + 1}/{len(prompts)} done "
                  f"({time.perf_counter() - t_start:.0f} s)", end="", file=sys.stderr, flush=True)
    print("", file=sys.stderr)
    load1 = os.getloadavg()[0]

    def pooled(key):
        secs = toks = 0.0
        acc_num = acc_den = 0
        draft = verify = 0.0
        for pi in range(len(prompts)):
            rs = runs[(pi, key)]
            secs += statistics.median(r[0] for r in rs)
            toks += rs[0][1]
            last = rs[-1][2]
            acc_num += int(last.acceptance_lengths.sum())
            acc_den += len(last.acceptance_lengths)
            draft += statistics.median(r[2].stats["seconds"]["draft"] for r in rs)
            verify += statistics.median(r[2].stats["seconds"]["verify"] for r in rs)
        return dict(tokens_per_second=toks / secs, mean_acceptance_length=acc_num / max(acc_den, 1),
                    draft_seconds=draft, verify_seconds=verify, seconds=secs)

    ar_p = pooled("AR")
    rows = []
    for cfg in configs:
        p = pooled(cfg)
        p.update(drafter=cfg[0], budget=cfg[1], depth=cfg[2], min_chain_prob=cfg[3], adaptive=cfg[4],
                 speedup=p["tokens_per_second"] / ar_p["tokens_per_second"])
        rows.append(p)

    print(f"model: {what}")
    print(f"{len(prompts)} prompts ({', '.join(p[0] for p in prompts)}), {n} new tokens, greedy, "
          f"median of {args.repeats}; load average {load0:.1f} -> {load1:.1f}")
    print(f"AR: {ar_p['tokens_per_second']:.1f} tok/s")
    for name in args.drafters:
        rs = [r for r in rows if r["drafter"] == name]
        if not rs:
            continue
        mcps = sorted({r["min_chain_prob"] for r in rs})
        for mcp in mcps:
            sub = [r for r in rs if r["min_chain_prob"] == mcp]
            title = f"{name}" + (f" (min_chain_prob {mcp:g})" if name == "model" and len(mcps) > 1 else "")
            print(f"\n{title}: speed-up over AR (mean acceptance length)")
            print("budget \\ depth" + "".join(f"{d:>16}" for d in args.depths))
            for b, ada in budget_rows:
                cells = []
                for d in args.depths:
                    r = next(x for x in sub if x["budget"] == b and x["depth"] == d and x["adaptive"] == ada)
                    cells.append(f"{r['speedup']:.2f}x ({r['mean_acceptance_length']:.2f})")
                print(f"{('<=' if ada else '') + str(b):>14}" + "".join(f"{c:>16}" for c in cells))
        best = max(rs, key=lambda r: r["tokens_per_second"])
        print(f"best {name}: budget {('<=' if best['adaptive'] else '') + str(best['budget'])}, depth {best['depth']}"
              + (f", min_chain_prob {best['min_chain_prob']:g}" if name == "model" else "")
              + f": {best['tokens_per_second']:.1f} tok/s = {best['speedup']:.2f}x AR, "
              f"mean acceptance {best['mean_acceptance_length']:.2f}, draft {best['draft_seconds']:.2f} s, "
              f"verify {best['verify_seconds']:.2f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(model=what, prompts=[p[0] for p in prompts], max_new_tokens=n, repeats=args.repeats,
                           loadavg=[load0, load1], ar=ar_p, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
