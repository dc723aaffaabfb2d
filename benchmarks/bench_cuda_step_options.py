"""A/B of CudaModel options inside the mini-kimi forward step (H200): the graph-replayed step time
of T new tokens (causal) with the default options and with each variant given on the command
line, same weights, same run. For a fusion or kernel switch that has a CudaModel option, this is
the in-step measurement (neighbouring kernels overlap through programmatic dependent launch, which
isolated kernel timings miss).

    python3 benchmarks/bench_cuda_step_options.py --variant cublas:skinny_max_tokens=0 \\
        [--tokens 1 2 4 17] [--contexts 512] [--reps 20] [--rounds 1] [--json FILE]

The variants run one after another (a model each, all its T, then the next). With --rounds N the
whole set runs N times, in reverse order every other round (so a drift over the run, or the first
variant's warm-up, does not favour one side): each cell then lists the rounds' times in order and
the ratio column compares the medians over the rounds (forty-sixth session: single rounds of the same
A/B moved by up to 4 %, the first round of a run against the variant that ran first).

A variant is LABEL:NAME=VALUE[,NAME=VALUE...]; VALUE is an int, 0/1 for booleans given as
true/false, or a string.
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))


def parse_options(items, what):
    """CudaModel keyword arguments from NAME=VALUE strings (VALUE: an int, true / false, or a string);
    `what` names the argument in the error (profile_cuda_model.py uses this too)."""
    kwargs = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"{what}: {item!r} is not NAME=VALUE")
        low = value.lower()
        if low in ("true", "false"):
            kwargs[name] = low == "true"
        else:
            try:
                kwargs[name] = int(value)
            except ValueError:
                kwargs[name] = value
    return kwargs


def parse_variant(text):
    label, _, spec = text.partition(":")
    if not label or not spec:
        raise SystemExit(f"--variant {text!r}: expected LABEL:NAME=VALUE[,NAME=VALUE...]")
    return label, parse_options(spec.split(","), f"--variant {text!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", required=True, help="LABEL:NAME=VALUE[,NAME=VALUE...]")
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 17])
    ap.add_argument("--contexts", type=int, nargs="*", default=[512])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1, help="repeat the set, reversed every other round")
    ap.add_argument("--ckpt", default="/tmp/kn_mini_kimi")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    from bench_cuda_model import step_times

    variants = {"default": {}}
    for v in args.variant:
        label, kwargs = parse_variant(v)
        variants[label] = kwargs
    labels = list(variants)
    print(f"## mini-kimi step with CudaModel options ({torch.cuda.get_device_name(0)}, graph replay, "
          f"median of {args.reps}, ms)")
    print("variants: " + "; ".join(f"{k} = {v or 'defaults'}" for k, v in variants.items()))
    print("| context | T | " + " | ".join(labels) + " | " + " | ".join(f"{k} / default" for k in labels[1:]) + " |")
    print("|---:|---:|" + "---:|" * (2 * len(labels) - 1))
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    rows = []
    for L in args.contexts:
        runs = {}  # (label, T) -> ms per round
        for r in range(args.rounds):
            order = labels if r % 2 == 0 else labels[::-1]
            res = step_times(args.ckpt, {k: variants[k] for k in order}, args.tokens, context=L, reps=args.reps)
            for key, t in res.items():
                runs.setdefault(key, []).append(t * 1e3)
        for T in args.tokens:
            ms = {k: float(np.median(runs[(k, T)])) for k in labels}
            rows.append(dict(context=L, T=T, **{f"{k}_ms": v for k, v in ms.items()},
                             **{f"{k}_rounds_ms": runs[(k, T)] for k in labels}))
            print(f"| {L} | {T} | " + " | ".join(" / ".join(f"{x:.3f}" for x in runs[(k, T)]) for k in labels) +
                  " | " + " | ".join(f"{ms[k] / ms['default']:.3f}" for k in labels[1:]) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
