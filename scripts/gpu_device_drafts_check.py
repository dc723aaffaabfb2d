"""End-to-end generate on the GPU with a Python drafter's device arrays (torch CUDA tensors) read in
place by the device round, small enough for compute-sanitizer: [d, k] log-probs + int64 ids, then
[d, V] logits (== AR, every draft taken on the device), a NaN draft (ValueError, caught), and the
[d, k] run again on the same model. Needs torch with CUDA. Run from the repository root:

    compute-sanitizer --tool memcheck python3 scripts/gpu_device_drafts_check.py
"""
import sys, os
sys.path.insert(0, "tests/python")
import numpy as np, torch
from test_cuda_rounds import models, prompt_ids
from kdtree_native.drafters import OracleDrafter
from kdtree_native.generation import generate
cpu, gpu, draft, cfg = models("kimi_like")
V = cfg.vocab_size
P = prompt_ids(V, 14, seed=21)
ar = generate(gpu, P, 24)
orc = OracleDrafter(ar.tokens, 0.3, seed=5, vocab_size=V)
def f(ctx, depth, top_k):
    o = orc.draft(ctx, depth, top_k)
    return None if o is None else (torch.as_tensor(o[0], device="cuda"), torch.as_tensor(o[1].astype(np.int64), device="cuda"))
r = generate(gpu, P, 24, drafter=f, tree_budget=16, depth=6, top_k=4)
assert np.array_equal(r.tokens, ar.tokens) and r.stats["device_drafts"] > 0
g = torch.Generator(device="cuda").manual_seed(0)
r = generate(gpu, P, 24, drafter=lambda c, d, k: torch.randn((d, V), device="cuda", generator=g), tree_budget=8, depth=4)
assert np.array_equal(r.tokens, ar.tokens) and r.stats["device_drafts"] > 0
try:
    generate(gpu, P, 8, drafter=lambda c, d, k: torch.full((d, V), float("nan"), device="cuda"), tree_budget=8, depth=4)
    raise SystemExit("no error")
except ValueError as e:
    print("error as expected:", e)
r = generate(gpu, P, 24, drafter=f, tree_budget=16, depth=6, top_k=4)
assert np.array_equal(r.tokens, ar.tokens)
print("dd_memcheck ok")
