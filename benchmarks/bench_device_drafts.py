"""What a GPU-resident Python drafter saves by returning its draft as device arrays (torch CUDA
tensors: read in place by the GPU round, docs/ENGINE.md) instead of numpy (`.cpu().numpy()`,
then validated on the host and uploaded again by the round).

A small random-weight model on the GPU (the tests' kimi_like shape, --vocab columns), so that the
round's fixed costs are visible; its greedy AR continuation of a random prompt is the oracle. The
drafter's outputs for every context length are made on the GPU up front (torch tensors), so each
call only picks one: the two modes differ only in how the draft reaches the round:
  * [d, k] log-probs + int64 ids (OracleDrafter rows, noise --noise);
  * [d, V] logits (the oracle's token +12 over N(0, 2^2) noise; the round's device top-k).
Per mode: medians over --repeats interleaved generate() calls of the rounds, the decode time per round, and
the stats' draft + tree_build seconds per round (the drafter call with its copy, validation and
upload, as the host sees them); every output is checked against AR.

--adaptive adds the same two modes with adaptive_budget=True (--budget the ceiling; a device
draft's top-k is then copied back for the choice, one small copy a round), with the mean tree size.

    python3 benchmarks/bench_device_drafts.py [--vocab 32000 163840] [--depth 8] [--budget 32]
        [-n 96] [--repeats 5] [--adaptive]
"""
import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))

import kdtree_native as kn  # noqa: E402
from kdtree_native.config import config_from_dict  # noqa: E402
from kdtree_native.drafters import OracleDrafter  # noqa: E402
from kdtree_native.generation import generate  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 163840])
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--noise", type=float, default=0.3)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--adaptive", action="store_true", help="also the adaptive budget (--budget as its ceiling)")
    args = ap.parse_args()
    import torch
    from hf_models import config_dict, random_weights

    dev = torch.device("cuda")
    print(f"## Device drafts vs numpy drafts ({kn._native.cuda_device_name()}); kimi_like shape, "
          f"depth {args.depth}, budget {args.budget}, top-k {args.top_k}, {args.n} new tokens, "
          f"median of {args.repeats}")
    print("\n| V | draft | mode | rounds | ms / round | draft + tree_build us / round | mean tree | device drafts | "
          "== AR |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---|")
    mode_list = ["numpy", "device"] + (["numpy adaptive", "device adaptive"] if args.adaptive else [])
    for V in args.vocab:
        cfg = config_from_dict(config_dict(dict(base="kimi_like", vocab_size=V)))
        w = {k: v.astype(np.float32) for k, v in random_weights(cfg, 0).items()}
        eng = kn.Engine.from_weights(cfg, w, device="cuda", max_seq_len=64 + args.n + args.depth + 2)
        P = np.random.default_rng(1).integers(0, V, 32)
        ar = generate(eng, P, args.n)
        seq = np.concatenate([P, ar.tokens])
        # every context length's draft, on the GPU
        orc = OracleDrafter(ar.tokens, args.noise, seed=3, vocab_size=V, prompt_len=len(P))
        lpk, lgt = {}, {}
        g = torch.Generator(device=dev).manual_seed(0)
        for n in range(len(P), len(seq) + 1):
            ctx = seq[:n].astype(np.int32)
            out = orc.draft(ctx, args.depth, args.top_k)
            if out is not None:
                lpk[n] = (torch.as_tensor(out[0], device=dev), torch.as_tensor(out[1].astype(np.int64), device=dev))
            d = min(args.depth, len(seq) - n)
            if d > 0:
                x = torch.randn((d, V), device=dev, generator=g) * 2
                x[torch.arange(d, device=dev), torch.as_tensor(seq[n:n + d], device=dev)] += 12
                lgt[n] = x
        torch.cuda.synchronize()

        def drafter(form, mode):
            def fn(ctx, depth, top_k):
                n = len(ctx)
                if form == "[d, k]":
                    t = lpk.get(n)
                    if t is None:
                        return None
                    lp, ids = t[0][:depth], t[1][:depth]
                    return (lp, ids) if mode.startswith("device") else (lp.cpu().numpy(), ids.cpu().numpy())
                x = lgt.get(n)
                if x is None:
                    return None
                x = x[:depth]
                return x if mode.startswith("device") else x.cpu().numpy()
            return fn

        for form in ("[d, k]", "[d, V] logits"):
            rows = {m: [] for m in mode_list}
            for _ in range(args.repeats):
                for mode in mode_list:
                    r = generate(eng, P, args.n, drafter=drafter(form, mode), tree_budget=args.budget,
                                 depth=args.depth, top_k=args.top_k, adaptive_budget=mode.endswith("adaptive"))
                    s = r.stats
                    nr = max(1, s["rounds"])
                    dec = s["seconds"]["total"] - s["seconds"]["prefill"]
                    rows[mode].append((1e3 * dec / nr, 1e6 * (s["seconds"]["draft"] + s["seconds"]["tree_build"]) / nr,
                                       nr, s["device_drafts"], bool(np.array_equal(r.tokens, ar.tokens)),
                                       s["mean_tree_size"]))
            for mode in mode_list:
                rr = rows[mode]
                print(f"| {V} | {form} | {mode} | {statistics.median(x[2] for x in rr):g} | "
                      f"{statistics.median(x[0] for x in rr):.3f} | "
                      f"{statistics.median(x[1] for x in rr):.1f} | {statistics.median(x[5] for x in rr):.1f} | "
                      f"{rr[0][3]} | {all(x[4] for x in rr)} |")
        del eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
