"""Acceptance on the embedded default model: chain vs DDTree, n-gram and model drafters, T=0 and T=1.

Target: ``kn.Engine.from_pretrained(kn.default_model_dir())``; draft engine for ``ModelDrafter``:
``kn.default_draft_dir()`` (both on --device). Prompts: the beginnings of --prompts different
held-out files (``kdtree_native.models.heldout_sample()``, never trained on), tokenised with the
shipped tokenizer.json through HF ``tokenizers`` (``<|bos|>`` prepended, as in training) and cut
at a token boundary near --prompt-tokens whose text does not end in whitespace and that
re-tokenises to the same ids.

For each prompt and temperature: plain AR, then for each drafter (ngram, model)
  * chain:  budget = depth, top_k = 1 (each round verifies the drafter's top-1 path only);
  * DDTree: each budget in --budgets with the same depth, top_k = min(budget, --top-k-cap).
Every run generates exactly --max-new-tokens tokens (no stop token). T > 0 runs use the same
seed (--seed + prompt index) for AR and every tree, so by the engine's construction
(docs/ENGINE.md "Sampling") their outputs must be identical too; the "== AR" column checks it
at both temperatures.

Reported per row (pooled over prompts): mean acceptance length = tokens emitted by rounds /
rounds (bonus included; the engine's res.stats definition, i.e. vLLM's; the first token,
which comes from prefill, is not a round), the draft acceptance rate (accepted draft tokens /
verified tree nodes), decode tokens/s = (generated - 1) / (total - prefill) seconds summed over
prompts, and the decode speed-up over AR at the same temperature. Each configuration runs once
per prompt (prompts outer, configurations inner, so load changes hit every row alike); the
load average is recorded at start and end.

    python benchmarks/bench_acceptance.py [--prompts 8] [--max-new-tokens 96] [--depth 8]
        [--budgets 4 16 64 256] [--temperatures 0 1] [--drafters ngram model] [--device cpu]
        [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

import kdtree_native as kn
from kdtree_native.drafters import ModelDrafter, NgramDrafter
from kdtree_native.generation import generate
from kdtree_native.models import default_draft_dir, default_model_dir, heldout_sample


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def pick_files(files, n):
    """n files spread evenly over the held-out sample (path order): index floor(i * len / n)."""
    files = sorted(files, key=lambda f: f["path"])
    if n > len(files):
        raise SystemExit(f"--prompts {n}: the held-out sample has only {len(files)} files")
    return [files[(i * len(files)) // n] for i in range(n)]


def cut_prompt(tok, text, want, min_tokens):
    """The first ~`want` tokens of `text` (BOS included), cut where the prompt's text does not end
    in whitespace and re-encoding the prompt's text gives the same ids."""
    ids = tok.encode(text).ids
    n = min(want, len(ids) - 1)  # the sample's last token may be cut mid-word: never use it
    while n >= min_tokens:
        prefix = tok.decode(ids[:n])
        if prefix and not prefix[-1].isspace() and tok.encode(prefix).ids == ids[:n]:
            return ids[:n], prefix
        n -= 1
    raise SystemExit(f"no prompt cut of >= {min_tokens} tokens found (file has {len(ids)} tokens)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="number of held-out files used as prompts")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt length aimed at (BOS included)")
    ap.add_argument("--min-prompt-tokens", type=int, default=160)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--depth", type=int, default=8, help="draft depth; the chain uses budget = depth")
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 16, 64, 256])
    ap.add_argument("--top-k-cap", type=int, default=32, help="DDTree top_k = min(budget, cap)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--seed", type=int, default=1234, help="T>0 seed of prompt i is seed + i")
    ap.add_argument("--drafters", nargs="+", default=["ngram", "model"], choices=["ngram", "model"])
    ap.add_argument("--no-chain", action="store_true", help="skip the chain rows")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer

    load_start = loadavg()
    t_start = time.time()
    eng = kn.Engine.from_pretrained(default_model_dir(), device=args.device, max_seq_len=args.max_seq_len)
    draft_eng = None
    if "model" in args.drafters:
        draft_eng = kn.Engine.from_pretrained(default_draft_dir(), device=args.device, max_seq_len=args.max_seq_len)
    tok = Tokenizer.from_file(os.path.join(default_model_dir(), "tokenizer.json"))

    prompts = []
    for f in pick_files(heldout_sample(), args.prompts):
        ids, text = cut_prompt(tok, f["text"], args.prompt_tokens, args.min_prompt_tokens)
        prompts.append(dict(path=f["path"], ids=ids, text=text))

    # configurations: (drafter, kind, budget, top_k)
    configs = [("none", "AR", 0, None)]
    for d in args.drafters:
        if not args.no_chain:
            configs.append((d, "chain", args.depth, 1))
        for b in args.budgets:
            configs.append((d, "DDTree", b, min(b, args.top_k_cap)))

    def make_drafter(name):
        if name == "ngram":
            return NgramDrafter()
        if name == "model":
            return ModelDrafter(draft_eng)
        return None

    # warm-up (first-call allocations, page faults of the weights)
    generate(eng, prompts[0]["ids"], 8)
    if draft_eng is not None:
        generate(eng, prompts[0]["ids"], 8, drafter=make_drafter("model"), tree_budget=4, depth=4)

    runs = []  # one dict per (prompt, temperature, config)
    for pi, p in enumerate(prompts):
        for temp in args.temperatures:
            seed = args.seed + pi
            ar_tokens = None
            for (dname, kind, budget, top_k) in configs:
                res = generate(eng, p["ids"], args.max_new_tokens, drafter=make_drafter(dname), tree_budget=budget,
                               depth=args.depth, top_k=top_k, temperature=temp, seed=seed)
                s = res.stats
                if kind == "AR":
                    ar_tokens = res.tokens.copy()
                runs.append(dict(prompt=pi, path=p["path"], temperature=temp, drafter=dname, kind=kind, budget=budget,
                                 top_k=top_k, num_tokens=s["num_tokens"], rounds=s["rounds"],
                                 acc_sum=int(np.sum(res.acceptance_lengths)),
                                 mean_acceptance_length=s["mean_acceptance_length"],
                                 num_draft_tokens=s["num_draft_tokens"], num_accepted_tokens=s["num_accepted_tokens"],
                                 seconds=s["seconds"], equal_ar=bool(np.array_equal(res.tokens, ar_tokens))))
            print(f"prompt {pi + 1}/{len(prompts)} ({p['path']}, {len(p['ids'])} tokens) T={temp:g} done "
                  f"[{time.time() - t_start:.0f}s, load {loadavg()}]", file=sys.stderr, flush=True)
    load_end = loadavg()
    elapsed = time.time() - t_start

    # pooled rows
    rows = []
    ar_tps = {}
    for temp in args.temperatures:
        for (dname, kind, budget, top_k) in configs:
            rs = [r for r in runs if r["temperature"] == temp and r["drafter"] == dname and r["kind"] == kind
                  and r["budget"] == budget]
            rounds = sum(r["rounds"] for r in rs)
            acc = sum(r["acc_sum"] for r in rs)
            drafted = sum(r["num_draft_tokens"] for r in rs)
            accepted = sum(r["num_accepted_tokens"] for r in rs)
            n = sum(r["num_tokens"] for r in rs)
            total = sum(r["seconds"]["total"] for r in rs)
            decode = sum(r["seconds"]["total"] - r["seconds"]["prefill"] for r in rs)
            dec_tps = (n - len(rs)) / decode if decode > 0 else 0.0
            if kind == "AR":
                ar_tps[temp] = dec_tps
            rows.append(dict(
                temperature=temp, drafter=dname, kind=kind, depth=args.depth if kind != "AR" else 1,
                budget=budget, top_k=top_k,
                mean_acceptance_length=acc / rounds if rounds else 0.0,
                mean_acceptance_length_per_prompt=[r["mean_acceptance_length"] for r in rs],
                draft_acceptance_rate=accepted / drafted if drafted else 0.0,
                tokens=n, rounds=rounds,
                tokens_per_second=n / total if total > 0 else 0.0,
                decode_tokens_per_second=dec_tps,
                speedup_decode=dec_tps / ar_tps[temp] if ar_tps.get(temp) else 0.0,
                seconds={k: sum(r["seconds"][k] for r in rs) for k in rs[0]["seconds"]},
                all_equal_ar=all(r["equal_ar"] for r in rs),
                equal_ar_count=sum(r["equal_ar"] for r in rs), prompts=len(rs)))

    machine = (f"{platform.node()}: {cpu_name()}, {os.cpu_count()} logical CPUs, "
               f"device={eng.device}, SGEMM {kn.build_info().get('cpu_blas')}")
    thread_env = {k: v for k, v in sorted(os.environ.items())
                  if k.startswith(("OMP_", "GOMP_", "OPENBLAS_", "MKL_", "KMP_"))}
    print(f"\nmodel: embedded default target ({default_model_dir()}), draft {default_draft_dir()}")
    print(f"machine: {machine}")
    print(f"threading environment: {thread_env or '(none set)'}")
    print(f"load average (1/5/15 min): start {load_start}, end {load_end}; wall {elapsed:.0f} s")
    print(f"{len(prompts)} held-out prompts ({', '.join(p['path'] + ':' + str(len(p['ids'])) for p in prompts)} tokens), "
          f"{args.max_new_tokens} new tokens each, depth {args.depth}; chain = budget {args.depth}, top_k 1; "
          f"DDTree top_k = min(budget, {args.top_k_cap}); T>0 seed {args.seed}+prompt index")
    hdr = (f"{'T':>3} {'drafter':<7} {'tree':<7} {'B':>4} {'K':>3} {'mean acc':>9} {'draft acc':>9} "
           f"{'dec tok/s':>9} {'speedup':>8} {'draft s':>8} {'verify s':>8} {'== AR':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        k = "-" if r["top_k"] is None else str(r["top_k"])
        eq = "yes" if r["all_equal_ar"] else f"{r['equal_ar_count']}/{r['prompts']}"
        print(f"{r['temperature']:>3g} {r['drafter']:<7} {r['kind']:<7} {r['budget']:>4} {k:>3} "
              f"{r['mean_acceptance_length']:>9.2f} {r['draft_acceptance_rate']:>9.3f} "
              f"{r['decode_tokens_per_second']:>9.1f} {r['speedup_decode']:>7.2f}x "
              f"{r['seconds']['draft']:>8.2f} {r['seconds']['verify']:>8.2f} {eq:>6}")

    bad = [r for r in rows if r["temperature"] == 0 and not r["all_equal_ar"]]
    if args.json:
        out = dict(benchmark="bench_acceptance", command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
                   args=vars(args), machine=machine, device=eng.device, thread_env=thread_env, load_average_start=load_start,
                   load_average_end=load_end, wall_seconds=elapsed, kdtree_native=kn.build_info(),
                   prompts=[dict(path=p["path"], num_tokens=len(p["ids"]), text=p["text"]) for p in prompts],
                   rows=rows, runs=runs)
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"wrote {args.json}")
    if bad:
        print("error: at T=0 some DDTree outputs differ from AR: "
              + ", ".join(f"{r['drafter']} {r['kind']} B={r['budget']}" for r in bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
