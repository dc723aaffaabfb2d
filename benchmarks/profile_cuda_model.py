"""Per-kernel GPU time of one mini-kimi step (AR decode, and verify of a 1+B tree), with
torch.profiler (CUPTI): the wall time per step, the sum of kernel times, launches per step, and
the kernels sorted by total time. The steps run through forward_ptr, so from the second call on
they are CUDA graph replays (docs/CUDA_MODEL.md). Needs torch with CUDA and the GPU model.

    python3 benchmarks/profile_cuda_model.py [--budget 64] [--context 512] [--rows 18] [--sequence]
                                             [--option NAME=VALUE ...]

--option passes a CudaModel keyword argument (an int, true / false, or a string), e.g. row_exact=true.
"""
import argparse
import os, sys, time
import numpy as np
import torch
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
ap = argparse.ArgumentParser()
ap.add_argument("--budget", type=int, default=64)
ap.add_argument("--context", type=int, default=512)
ap.add_argument("--rows", type=int, default=18)
ap.add_argument("--ckpt", default="/tmp/kn_mini_kimi")
ap.add_argument("--sequence", action="store_true",
                help="also list one step's kernels in launch order: duration, start / end from the step's start, and how far each moved the latest end (the timeline; with KDTREE_CUDA_PDL=0 the durations are the kernels' own)")
ap.add_argument("--option", action="append", default=[], help="NAME=VALUE: a CudaModel keyword argument")
args = ap.parse_args()
from bench_cuda_step_options import parse_options
opts = parse_options(args.option, "--option")
import kdtree_native as kn
from kdtree_native import _native
from kdtree_native.checkpoint import load_weights
from kdtree_native.config import load_config
from bench_cuda_model import MINI_KIMI, real_tree, upload, vis_bits
from hf_models import make_checkpoint
ck = args.ckpt
if not os.path.isfile(ck + "/config.json"):
    make_checkpoint(ck, MINI_KIMI, seed=0)
cfg = load_config(ck)
model = upload(_native.CudaModel(cfg.to_native(), args.context + 1100, **opts), load_weights(ck, cfg))
V = cfg.vocab_size
dev = torch.device("cuda")
L = args.context
ids = np.random.default_rng(0).integers(0, V, L).astype(np.int32)
model.forward(ids, np.arange(L), None); model.commit(np.arange(L))
logits = torch.empty((1025, V), device=dev)
def step(T, vis):
    toks = torch.randint(0, V, (T,), device=dev, dtype=torch.int32)
    pos = torch.arange(L, L + T, device=dev, dtype=torch.int32)
    tv = torch.as_tensor(vis_bits(vis).view(np.int64), device=dev) if vis is not None else None
    torch.cuda.synchronize()
    def fn():
        model.forward_ptr(toks.data_ptr(), pos.data_ptr(), tv.data_ptr() if tv is not None else 0,
                          tv.shape[1] if tv is not None else 0, T, logits.data_ptr(), False)
    return fn
from torch.profiler import profile, ProfilerActivity
B = args.budget
for label, T, vis in [("AR", 1, None), (f"verify B={B}", B + 1, real_tree(B, 1)[2])]:
    fn = step(T, vis)
    for _ in range(5): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20): fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10): fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    tot = sum(e.device_time for e in ev) / 10
    print(f"== {label}: wall {wall * 1e3:.3f} ms/step, GPU kernel time {tot / 1e3:.3f} ms/step, "
          f"kernels/step {len(ev) / 10:.0f}")
    if args.sequence:
        # one step's kernels in launch order; start / end in us from the step's first kernel start.
        # With PDL a kernel starts (its blocks resident, waiting) before its predecessor ends, so the
        # end times are the timeline: "+end" = this kernel's end minus the latest end before it.
        seq = sorted(ev, key=lambda e: e.time_range.start)[: len(ev) // 10]
        t0 = seq[0].time_range.start
        last_end = t0
        print(f"  {'#':>4} {'dur us':>7} {'start':>7} {'end':>7} {'+end':>6}  kernel")
        for i, e in enumerate(seq):
            name = e.name.replace("kdtree::cuda::", "").replace("(anonymous namespace)::", "")
            st, en = e.time_range.start - t0, e.time_range.end - t0
            print(f"  {i:4d} {e.device_time:7.1f} {st:7.1f} {en:7.1f} {e.time_range.end - last_end:6.1f}  {name[:100]}")
            last_end = max(last_end, e.time_range.end)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
