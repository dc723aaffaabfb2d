"""One mini-kimi forward step of T new tokens (context 512, eager: graphs off, so every kernel is
its own launch) between cudaProfilerStart / cudaProfilerStop, for Nsight Compute:

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --csv --page details python3 benchmarks/ncu_cuda_step.py [--tokens 17] [--option NAME=VALUE] > step.csv

ncu locks the clocks (1.5 GHz on the H200), so its durations are ~1.3x the real ones; use it for
the shares, throughputs and stall reasons, and benchmarks/bench_cuda_model.py for times.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=17)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-seq-len", type=int, default=600)
    ap.add_argument("--ckpt", default="/tmp/kn_mini_kimi")
    ap.add_argument("--option", action="append", default=[],
                    help="a CudaModel option NAME=VALUE (int, true/false or string), e.g. expert_kernel=mma")
    args = ap.parse_args()
    from bench_cuda_step_options import parse_variant
    import numpy as np
    import torch
    from bench_cuda_model import MINI_KIMI, upload
    from hf_models import make_checkpoint
    from kdtree_native import _native
    from kdtree_native.checkpoint import load_weights
    from kdtree_native.config import load_config

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    T, L = args.tokens, args.context
    if not os.path.isfile(os.path.join(args.ckpt, "config.json")):
        make_checkpoint(args.ckpt, MINI_KIMI, seed=0)
    cfg = load_config(args.ckpt)
    opts = parse_variant("x:" + ",".join(args.option))[1] if args.option else {}
    m = upload(_native.CudaModel(cfg.to_native(), max(args.max_seq_len, L + T), graphs=False, **opts),
               load_weights(args.ckpt, cfg))
    V = cfg.vocab_size
    m.forward(np.random.default_rng(0).integers(0, V, L).astype(np.int32), np.arange(L), None)
    m.commit(np.arange(L))
    dev = torch.device("cuda")
    tok = torch.as_tensor(np.random.default_rng(T).integers(0, V, T).astype(np.int32), device=dev)
    pos = torch.arange(L, L + T, dtype=torch.int32, device=dev)
    out = torch.empty((T, V), device=dev)
    for _ in range(3):  # warm-up, outside the profiled range
        m.forward_ptr(tok.data_ptr(), pos.data_ptr(), 0, 0, T, out.data_ptr())
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    m.forward_ptr(tok.data_ptr(), pos.data_ptr(), 0, 0, T, out.data_ptr())
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one step of T = {T} at context {L}, options {opts or 'defaults'}")


if __name__ == "__main__":
    main()
