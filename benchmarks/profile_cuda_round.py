"""Where the time of a GPU DDTree round goes: the GPU timeline of generate() (rounds="device") on
the mini-kimi checkpoint with OracleDrafter, from torch.profiler (CUPTI: every kernel, copy and
memset of the process, our native library's included), cut into rounds.

Per round (averaged over the rounds after the first): the host gap (GPU idle between the previous
round's result copy and this round's first upload: engine loop, drafter, emission), the GPU time
before the verify forward (uploads, tree build, idle while the host launches), the forward span,
and the GPU time after it (choice, accept + compaction, result gather, the copy back), each with
the kernels and copies in it. With --events N the first N rounds' raw events are listed too.

    python3 benchmarks/profile_cuda_round.py [--noise 0.3] [--budget 64] [--n-new 64] [--events 1]
"""
import argparse
import os
import sys
from collections import defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))

ROUND_KERNELS = ("tree_build", "topk_", "choose_", "tree_accept", "kv_compact", "round_finish")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--noise", type=float, default=0.3)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--n-new", type=int, default=64)
    ap.add_argument("--events", type=int, default=1, help="list the raw events of the first N rounds")
    ap.add_argument("--ckpt", default="/tmp/kn_mini_kimi")
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    import kdtree_native as kn
    from kdtree_native.drafters import OracleDrafter
    from kdtree_native.generation import generate
    from bench_cuda_model import MINI_KIMI
    from hf_models import make_checkpoint

    if not os.path.isfile(os.path.join(args.ckpt, "config.json")):
        make_checkpoint(args.ckpt, MINI_KIMI, seed=0)
    eng = kn.Engine.from_pretrained(args.ckpt, device="cuda", max_seq_len=1024)
    V = MINI_KIMI["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, V, 64).astype(np.int32)
    ref = generate(eng, prompt, args.n_new, seed=0).tokens
    mk = lambda: OracleDrafter(ref, noise=args.noise, seed=1, vocab_size=V)
    kw = dict(drafter=None, tree_budget=args.budget, depth=args.depth, top_k=args.top_k, seed=0)
    for _ in range(2):  # warm-up: graphs captured for every tree size the run meets
        kw["drafter"] = mk()
        generate(eng, prompt, args.n_new, **kw)
    torch.cuda.synchronize()
    kw["drafter"] = mk()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = generate(eng, prompt, args.n_new, **kw)
        torch.cuda.synchronize()
    sec, nr = r.stats["seconds"], r.stats["rounds"]
    assert np.array_equal(r.tokens, ref), "DDTree output differs from AR"

    ev = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t0 = e.time_range.start
        ev.append((t0, t0 + e.device_time, e.name))
    ev.sort()
    # the first round: its tree kernel, preceded by its uploads (the draft; the root too when the
    # device does not hold it) as HtoD copies
    k = next(i for i, x in enumerate(ev) if "tree_build_kernel" in x[2] or "topk_" in x[2])
    while k > 0 and "HtoD" in ev[k - 1][2]:
        k -= 1
    # group: a new round starts at each HtoD copy that follows a DtoH copy
    rounds, cur, last_dtoh = [], [], False
    for x in ev[k:]:
        if "HtoD" in x[2] and last_dtoh:
            rounds.append(cur)
            cur = []
            last_dtoh = False
        if "DtoH" in x[2]:
            last_dtoh = True
        cur.append(x)
    if cur:
        rounds.append(cur)

    def is_round_kernel(name):
        return any(k in name for k in ROUND_KERNELS) or "Memcpy" in name or "Memset" in name

    rows = []
    prev_end = None
    for rd in rounds:
        fwd = [x for x in rd if not is_round_kernel(x[2])]
        f0, f1 = (fwd[0][0], max(x[1] for x in fwd)) if fwd else (rd[0][0], rd[0][0])
        pre = [x for x in rd if x[0] < f0]
        post = [x for x in rd if x[0] >= f1 or (x[0] >= f0 and is_round_kernel(x[2]))]
        end = max(x[1] for x in rd)
        row = dict(host_gap=(rd[0][0] - prev_end) if prev_end is not None else float("nan"),
                   pre_span=f0 - rd[0][0], pre_busy=sum(x[1] - x[0] for x in pre),
                   fwd_span=f1 - f0, fwd_busy=sum(x[1] - x[0] for x in fwd), fwd_kernels=len(fwd),
                   post_span=end - f1, post_busy=sum(x[1] - x[0] for x in post), events=rd)
        rows.append(row)
        prev_end = end
    print(f"noise {args.noise}, budget {args.budget}: {nr} rounds, mean acceptance "
          f"{r.stats['mean_acceptance_length']:.2f}; stats per round (ms): draft {sec['draft'] / nr * 1e3:.3f}, "
          f"verify (host clock) {sec['verify'] / nr * 1e3:.3f}, verify forward (GPU events) "
          f"{sec['verify_forward_gpu'] / nr * 1e3:.3f}, tree_build (host) {sec['tree_build'] / nr * 1e3:.3f}, "
          f"accept_commit {sec['accept_commit'] / nr * 1e3:.3f}; decode {(sec['total'] - sec['prefill']) / nr * 1e3:.3f}")
    print(f"profiled rounds found: {len(rows)}")
    use = rows[1:] if len(rows) > 2 else rows
    keys = ["host_gap", "pre_span", "pre_busy", "fwd_span", "fwd_busy", "post_span", "post_busy"]
    print("median per round (us): " + ", ".join(f"{k} {np.nanmedian([u[k] for u in use]):.1f}" for k in keys)
          + f", forward kernels {np.median([u['fwd_kernels'] for u in use]):.0f}")
    # the round's own events by name (median duration and count per round)
    by = defaultdict(list)
    for u in use:
        for x in u["events"]:
            if is_round_kernel(x[2]):
                by[x[2][:60]].append(x[1] - x[0])
    for k, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {k:60s} {len(v) / len(use):4.1f}/round  median {np.median(v):6.1f} us")
    for ri in range(min(args.events, len(rows))):
        u = rows[min(ri + 1, len(rows) - 1)]
        t_0 = u["events"][0][0]
        print(f"-- round {ri + 1} events (start us from the round's first event, duration, name); host gap before "
              f"{u['host_gap']:.1f} us")
        for x in u["events"]:
            if is_round_kernel(x[2]) or x is u["events"][-1]:
                print(f"  {x[0] - t_0:9.1f} {x[1] - x[0]:7.1f}  {x[2][:90]}")


if __name__ == "__main__":
    main()
