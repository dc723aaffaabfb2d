"""The two grouped expert kernels inside the mini-kimi step (H200): graph-replayed step time at
T new tokens (causal, context 512) with expert_kernel="skinny" and "tiled", same weights, same
run. CudaModel's auto switch (T*K <= 12 E -> skinny) comes from this table (docs/BENCHMARKS.md).
Needs the mini-kimi checkpoint of bench_cuda_model.py (made there on first use).

    python3 benchmarks/bench_cuda_experts.py
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))


def main():
    import torch
    from kdtree_native import _native
    from kdtree_native.checkpoint import load_weights
    from kdtree_native.config import load_config
    from bench_cuda_model import MINI_KIMI, median_time
    from hf_models import make_checkpoint

    ck = "/tmp/kn_mini_kimi"
    if not os.path.isfile(os.path.join(ck, "config.json")):
        make_checkpoint(ck, MINI_KIMI, seed=0)
    cfg = load_config(ck)
    W = load_weights(ck, cfg)
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    L, V = 512, cfg.vocab_size
    sizes = (9, 17, 33, 49, 65, 97)
    ctx = np.random.default_rng(0).integers(0, V, L).astype(np.int32)
    logits = torch.empty((128, V), device=dev)
    res = {}
    for ek in ("skinny", "tiled"):
        m = _native.CudaModel(cfg.to_native(), L + 128, expert_kernel=ek)
        for k, a in W.items():
            m.set_weight(k, np.ascontiguousarray(a, dtype=np.float32))
        m.finalize()
        m.forward(ctx, np.arange(L), None)
        m.commit(np.arange(L))
        for T in sizes:
            tok = torch.as_tensor(np.random.default_rng(T).integers(0, V, T).astype(np.int32), device=dev)
            pos = torch.arange(L, L + T, dtype=torch.int32, device=dev)
            res[(ek, T)] = median_time(
                lambda: m.forward_ptr(tok.data_ptr(), pos.data_ptr(), 0, 0, T, logits.data_ptr()), sync, 15, warmup=5)
        del m
        torch.cuda.empty_cache()
    K = cfg.num_experts_per_tok
    for T in sizes:
        print(f"expert kernels T={T} (A={T * K}): skinny {res[('skinny', T)] * 1e3:.3f} ms  "
              f"tiled {res[('tiled', T)] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
