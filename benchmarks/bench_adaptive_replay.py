"""The adaptive tree budget's policy (cpp/engine/adaptive_budget.h) replayed on made-up rounds: no
model, no device, deterministic, so a policy change can be compared on exactly the same drafts.

Each round draws a logits draft over V columns (N(0, sd^2) noise, the text's next token at each
depth + boost; `--noise` drops the boost at a depth with that chance; `--scale` multiplies the
logits, > 1 making the draft over-confident), reduces it to its top-k
(kdtree_native.reference), asks `_native.AdaptiveBudget` for the size n (the round is then given
the rows `draft_rows()` hands over, as the engine does), walks the tree of n nodes against the text
(greedy: the longest matching path plus the bonus token), and charges the round t0 + slope x (n + 1)
seconds plus the draft's time; skipped rounds (skip_draft) are plain steps. The default costs are
GPU-like (a 0.13 ms step, 2 us a node, a 50 us draft: the fifty-first session's H200 device-draft
rounds). Beside it, the fixed budget (n = the ceiling every round) on the same drafts.

    python benchmarks/bench_adaptive_replay.py [--seeds 16] [--vocab 32000 163840] [--tokens 96]
        [--depth 8] [--top-k 8] [--ceiling 32] [--boost 12] [--sd 2] [--noise 0] [--scale 1]
        [--t0-ms 0.13] [--node-us 2] [--draft-us 50]

--embedded (fifty-sixth session): the same replay on real drafts instead, the embedded draft model's
(ModelDrafter, --min-chain-prob) on the text the embedded target generates greedily after the demo's prompt,
each round charged a cost table's round time (--cost "T:ms,...", interpolated, extrapolated past its last
point; default: this session's isolated CPU forwards of the embedded target, 2-vCPU VM) plus --draft-ms-row a
drafted row; AR and every fixed budget beside it on the same drafts. The adaptive mode asks the policy how many
rows to draft each round (draft_depth, fifty-ninth session: the rows are a prefix of the drafter's --depth draft,
which it drafts row by row; --fixed-depth drafts --depth rows every round, as the policy did before). Deterministic:
it separates what the policy chooses from the timing noise of live runs (docs/BENCHMARKS.md "Adaptive tree budget").

    python benchmarks/bench_adaptive_replay.py --embedded [--tokens 256] [--depth 4] [--ceiling 16]
        [--cost 1:0.70,2:0.79,5:0.985,9:1.5,17:3.0] [--draft-ms-row 0.09] [--min-chain-prob 0.2] [--fixed-depth]
        [--prompts N] [--drafter model|ngram]
"""
import argparse
import statistics

import numpy as np

from kdtree_native import _native
from kdtree_native import reference as R


def accepted(lp, ids, n, text, L):
    """Tokens the greedy walk accepts in the tree of n nodes built from (lp, ids), the target
    taking text[L], text[L + 1], ... (its choice at a node of depth t is text[L + t])."""
    if n <= 0:
        return 0
    t = R.tree_build(lp, ids, n)
    path, _ = R.tree_accept(t, text[L + np.concatenate([[0], np.asarray(t.depths)])])
    return len(path) - 1


def replay(a, V, seed, fixed, args):
    rng = np.random.default_rng(seed)
    text = rng.integers(0, V, args.tokens + args.depth + 64).astype(np.int32)
    t0, slope, draft = args.t0_ms * 1e-3, args.node_us * 1e-6, args.draft_us * 1e-6
    a.reset(args.ceiling)
    L = start = 16
    rounds = plain = 0
    secs = 0.0
    sizes = []
    while L - start < args.tokens:
        rounds += 1
        if not fixed and a.skip_draft():
            a.observe(0, t0 + slope, -1.0)
            secs += t0 + slope
            plain += 1
            L += 1
            a.label(text[:L])
            continue
        x = rng.standard_normal((args.depth, V)).astype(np.float32) * args.sd
        for d in range(args.depth):
            if rng.random() >= args.noise:
                x[d, text[L + d]] += args.boost
        lp, ids = R.topk_logsoftmax(x * np.float32(args.scale), args.top_k)
        lp, ids = np.ascontiguousarray(lp), np.ascontiguousarray(ids)
        n = a.choose(lp, ids, args.ceiling, L - 1)
        if fixed:
            n = min(args.ceiling, args.depth * args.top_k)
        else:
            # (the rows the round is given; builds before the fifty-second session have no
            # draft_rows and give the round the draft's own rows: kept to replay those too)
            rows = a.draft_rows() if hasattr(a, "draft_rows") else None
            if rows is not None:
                lp, ids = rows
        acc = accepted(lp, ids, n, text, L)
        t = t0 + slope * (n + 1)
        a.observe(n, t, draft)
        secs += t + draft
        sizes.append(n)
        L += acc + 1
        a.label(text[:L])
    return rounds, plain, secs, sizes


def replay_embedded(args):
    """The policy on the embedded draft model's drafts (see the module docstring); prints a table."""
    from kdtree_native import cli
    from kdtree_native.drafters import ModelDrafter, NgramDrafter
    from kdtree_native.generation import generate

    pts = sorted((int(t), float(ms)) for t, ms in (x.split(":") for x in args.cost.split(",")))
    Ts, Cs = [float(t) for t, _ in pts], [c * 1e-3 for _, c in pts]

    def cost(T):  # seconds for a round of T tokens
        if len(Ts) > 1 and T > Ts[-1]:
            return Cs[-1] + (T - Ts[-1]) * (Cs[-1] - Cs[-2]) / (Ts[-1] - Ts[-2])
        return float(np.interp(T, Ts, Cs))

    eng, deng, tok, what = cli._demo_models(argparse.Namespace(device="cpu", max_seq_len=4096))
    if deng is None:
        raise SystemExit(f"no embedded draft model here ({what})")
    prompts = [("the demo's prompt", np.asarray(cli._demo_prompt_ids(tok), dtype=np.int32))]
    if args.prompts > 0:  # held-out files' beginnings, as bench_cpu_engine.py cuts them
        import pathlib
        import sys
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from bench_cpu_engine import heldout_prompts
        prompts = [(name, np.asarray(ids, np.int32)) for name, ids in heldout_prompts(tok, args.prompts, 64)]
    cases = []  # (prompt length, the prompt and the target's greedy continuation)
    for _, prompt in prompts:
        cont = generate(eng, prompt, args.tokens + args.depth + 8).tokens
        cases.append((len(prompt), np.concatenate([prompt, cont]).astype(np.int32)))
    drafter = NgramDrafter() if args.drafter == "ngram" else ModelDrafter(deng, min_chain_prob=args.min_chain_prob)
    drafts = {}

    def draft_at(c, L):  # the draft for the root text[L - 1] of case c (cached: every mode replays the same drafts)
        if (c, L) not in drafts:
            rows = drafter.draft(cases[c][1][:L], args.depth, args.ceiling)
            if rows is None:  # no draft (the n-gram drafter without a match): a plain step
                rows = (np.zeros((0, 1), np.float32), np.zeros((0, 1), np.int32))
            lp, ids = rows if isinstance(rows, tuple) else R.topk_logsoftmax(np.asarray(rows, np.float32), args.ceiling)
            drafts[c, L] = (np.ascontiguousarray(lp, np.float32), np.ascontiguousarray(ids, np.int32))
        return drafts[c, L]

    asked = []

    def run(mode):  # "ar", "adaptive" or a fixed budget over every case: (seconds, rounds, plain steps, the
        secs, rounds, plain, first = 0.0, 0, 0, None  # first case's sizes)
        for c, (P, text) in enumerate(cases):
            s, n, p, sizes = run_case(mode, c, P, text)
            secs, rounds, plain = secs + s, rounds + n, plain + p
            first = sizes if first is None else first
        return secs, rounds, plain, first

    def run_case(mode, c, P, text):  # one prompt: a generate call's policy, fresh (as each call's calibration)
        a = _native.AdaptiveBudget()
        a.reset(args.ceiling)
        new_policy = hasattr(a, "draft_depth")  # (builds before the fifty-ninth session: the depth fixed)
        L, secs, sizes, plain = P, 0.0, [], 0
        while L - P < args.tokens:
            if mode == "ar" or (mode == "adaptive" and a.skip_draft()):
                if mode == "adaptive":
                    a.observe(0, cost(1), -1.0)
                secs, L, plain = secs + cost(1), L + 1, plain + 1
                sizes.append(-1)
                if mode == "adaptive":
                    a.label(text[:L])
                continue
            lp, ids = draft_at(c, L)
            if mode == "adaptive" and new_policy and not args.fixed_depth:  # the rows the policy asks for (a
                rows = a.draft_depth(args.depth)             # prefix of the drafter's deepest draft: row by row)
                lp, ids = lp[:rows], ids[:rows]
                asked.append(rows)
            td = (args.draft_ms_call + args.draft_ms_row * lp.shape[0]) * 1e-3
            if lp.shape[0] == 0:  # nothing drafted: a plain step after the drafter's call
                n = 0
                if mode == "adaptive":
                    a.observe(0, cost(1), td, 0) if new_policy else a.observe(0, cost(1), td)
            elif mode == "adaptive":
                n = a.choose(lp, ids, args.ceiling, L - 1)
                lp, ids = a.draft_rows()
                a.observe(n, cost(n + 1), td, len(lp)) if new_policy else a.observe(n, cost(n + 1), td)
            else:  # a fixed budget verifies its tree's nodes: the budget, or fewer where the draft has fewer
                n = len(R.tree_build(lp, ids, int(mode)).tokens)
            acc = accepted(lp, ids, n, text, L) if lp.shape[0] else 0
            secs, L = secs + cost(n + 1) + td, L + acc + 1
            sizes.append(n)
            if mode == "adaptive":
                a.label(text[:L])
        return secs, len(sizes), plain, sizes

    where = "the demo prompt" if args.prompts <= 0 else f"each of {len(cases)} held-out prompts"
    print(f"## Adaptive budget replay on the embedded draft model ({args.tokens} tokens after {where}, depth "
          f"{args.depth}, ceiling {args.ceiling}, "
          f"{'the n-gram drafter' if args.drafter == 'ngram' else f'min_chain_prob {args.min_chain_prob}'}; round costs {args.cost} ms, "
          f"{args.draft_ms_row} ms a drafted row, {args.draft_ms_call} ms a call)\n")
    print("| mode | x AR | rounds | plain steps | sizes (adaptive: . = a plain step) |")
    print("|---|---:|---:|---:|---|")
    ar = run("ar")[0]
    budgets = sorted({b for b in (1, 2, 3, 4, 6, 8, 16, args.ceiling) if b <= args.ceiling})
    for mode in ["adaptive"] + [str(b) for b in budgets]:
        secs, rounds, plain, sizes = run(mode)
        seq = "".join("." if x < 0 else str(min(x, 9)) for x in sizes)[:80] if mode == "adaptive" else ""
        if mode == "adaptive" and asked:
            mode = f"adaptive (rows asked: {np.mean(asked):.2f} a draft)"
        print(f"| {mode if mode.startswith('adaptive') else 'fixed ' + mode} | {ar / secs:.3f} | {rounds} | {plain} | {seq} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--embedded", action="store_true", help="replay on the embedded draft model's real drafts")
    ap.add_argument("--cost", default="1:0.70,2:0.79,5:0.985,9:1.5,17:3.0", help="--embedded: T:ms,... round costs")
    ap.add_argument("--draft-ms-row", type=float, default=0.09, help="--embedded: drafting cost a row")
    ap.add_argument("--draft-ms-call", type=float, default=0.0, help="--embedded: drafting cost a call (beside the rows')")
    ap.add_argument("--min-chain-prob", type=float, default=0.2,
                    help="--embedded: the drafter's chain stop (the demo's; 0.1 before the fifty-ninth session)")
    ap.add_argument("--drafter", choices=("model", "ngram"), default="model",
                    help="--embedded: the embedded draft model's drafts, or the n-gram drafter's (its time is tiny: set "
                         "--draft-ms-row to match, e.g. 0.002)")
    ap.add_argument("--prompts", type=int, default=0,
                    help="--embedded: replay after N held-out prompts (64 tokens each, bench_cpu_engine.py's) instead of "
                         "the demo's; x AR pooled over them (the sizes column: the first prompt's)")
    ap.add_argument("--fixed-depth", action="store_true",
                    help="--embedded: the adaptive mode drafts --depth rows every round (before the fifty-ninth "
                         "session the policy did not choose the depth)")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 163840])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--ceiling", type=int, default=32)
    ap.add_argument("--boost", type=float, default=12.0)
    ap.add_argument("--sd", type=float, default=2.0)
    ap.add_argument("--noise", type=float, default=0.0)
    ap.add_argument("--scale", type=float, default=1.0, help="logits x scale (> 1: an over-confident draft)")
    ap.add_argument("--t0-ms", type=float, default=0.13)
    ap.add_argument("--node-us", type=float, default=2.0)
    ap.add_argument("--draft-us", type=float, default=50.0)
    args = ap.parse_args()
    if args.embedded:
        for name, default, embedded in (("tokens", 96, 256), ("depth", 8, 4), ("ceiling", 32, 16)):
            if getattr(args, name) == default:  # (the synthetic replay's defaults -> the demo's)
                setattr(args, name, embedded)
        return replay_embedded(args)
    print(f"## Adaptive budget replay: {args.tokens} tokens, depth {args.depth}, top-k {args.top_k}, ceiling "
          f"{args.ceiling}, boost {args.boost} over N(0, {args.sd}^2), noise {args.noise}, scale {args.scale}; a round "
          f"{args.t0_ms} ms + {args.node_us} us a node, a draft {args.draft_us} us; {args.seeds} seeds\n")
    print("| V | mode | ms (median) | ms (sum) | rounds (median) | plain steps (median) | mean tree |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for V in args.vocab:
        for fixed in (True, False):
            res = [replay(_native.AdaptiveBudget(), V, s, fixed, args) for s in range(args.seeds)]
            ms = [r[2] * 1e3 for r in res]
            tree = [n for r in res for n in r[3]]
            print(f"| {V} | {'fixed' if fixed else 'adaptive'} | {statistics.median(ms):.2f} | {sum(ms):.1f} | "
                  f"{statistics.median([r[0] for r in res]):.1f} | {statistics.median([r[1] for r in res]):.1f} | "
                  f"{np.mean(tree) if tree else 0:.1f} |")


if __name__ == "__main__":
    main()
