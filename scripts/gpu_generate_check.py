"""End-to-end generate on the GPU (the device round), small enough for compute-sanitizer:
two random-weight configs (one on the fast MLA-512 attention path), AR then DDTree with the
n-gram, oracle, model (a CPU draft model, and a GPU one whose chain stays on the device) and
logits drafters (== AR), the adaptive budget with a GPU, a CPU and a logits drafter, and sampling (DDTree == AR with one seed).
Exit status non-zero on any mismatch. Run from the repository root:

    compute-sanitizer --tool memcheck python3 scripts/gpu_generate_check.py [NAME=VALUE ...]

NAME=VALUE pairs are CudaModel options (ints, true/false or strings), e.g. skinny_max_tokens=4 to run the
verify steps' projections through linear_tile, attention_kernel=mma for the tensor-core attention.
"""
import os
import sys
import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_cuda_step_options import parse_options  # the NAME=VALUE parser the benchmarks use
from kdtree_native import _native
from kdtree_native.config import config_from_dict
from kdtree_native.drafters import ModelDrafter, NgramDrafter, OracleDrafter
from kdtree_native.generation import generate
from hf_models import config_dict, random_weights
from test_cuda_model import MLA512, load

opts = parse_options(sys.argv[1:], "gpu_generate_check.py")
for name in ["kimi_like", MLA512]:
    cfg = config_from_dict(config_dict(name))
    w = {k: v.astype(np.float32) for k, v in random_weights(cfg, 0).items()}
    g = load(_native.CudaModel(cfg.to_native(), 128, **opts), w)
    wd = {k: v.astype(np.float32) for k, v in random_weights(cfg, 5).items()}
    d = load(_native.CpuModel(cfg.to_native(), 128), wd)
    dg = load(_native.CudaModel(cfg.to_native(), 128, **opts), wd)  # its chain on the GPU, logits kept there
    P = np.random.default_rng(1).integers(0, cfg.vocab_size, 12)
    ar = generate(g, P, 24)
    rng = np.random.default_rng(0)
    logits = lambda c, dd, k: rng.standard_normal((dd, cfg.vocab_size)).astype(np.float32)
    for dr in [NgramDrafter(), OracleDrafter(ar.tokens, 0.3, vocab_size=cfg.vocab_size), ModelDrafter(d), ModelDrafter(dg),
               ModelDrafter(dg, min_chain_prob=0.3), logits]:
        r = generate(g, P, 24, drafter=dr, tree_budget=16, depth=6)
        assert np.array_equal(r.tokens, ar.tokens), name
    for dr in [ModelDrafter(dg), ModelDrafter(d), logits]:  # the adaptive budget (device drafts copied back)
        r = generate(g, P, 24, drafter=dr, tree_budget=16, depth=6, adaptive_budget=True)
        assert np.array_equal(r.tokens, ar.tokens), name
    s1 = generate(g, P, 24, temperature=0.9, top_p=0.9, seed=3)
    s2 = generate(g, P, 24, drafter=NgramDrafter(), temperature=0.9, top_p=0.9, seed=3)
    assert np.array_equal(s1.tokens, s2.tokens)
    print("ok", name, g.graph_captures, g.graph_replays)
