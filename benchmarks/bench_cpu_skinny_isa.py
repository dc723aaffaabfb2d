"""CPU skinny GEMM kernels, AVX2 vs AVX-512, inside the embedded default model's forward: the
median time of one forward of T new tokens (causal, after 100 committed) with each vector ISA of
this CPU, switched in-process (`_native.sgemm_set_skinny_isa`) and interleaved over rounds, so
machine noise hits both alike.

    python3 benchmarks/bench_cpu_skinny_isa.py [--tokens 1 2 5 9 17] [--rounds 6]
"""
import argparse
import time

import numpy as np

from kdtree_native import _native, models
from kdtree_native.engine import Engine
from kdtree_native.generation import native_target


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 5, 9, 17])
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    default = _native.sgemm_skinny_isa()
    isas = [i for i in ("avx2", "avx512") if _native.sgemm_set_skinny_isa(i)]
    if default != "none":
        _native.sgemm_set_skinny_isa(default)
    if len(isas) < 2:
        raise SystemExit(f"this CPU has the skinny kernels for {isas or 'no ISA'} only: nothing to compare")
    m = native_target(Engine.from_pretrained(models.default_model_dir(), device="cpu", max_seq_len=512))
    ids = (np.arange(100, dtype=np.int32) % 4000) + 5
    m.reset()
    m.forward(ids, np.arange(100), None)
    m.commit(np.arange(100))
    res = {}
    for _ in range(args.rounds):
        for isa in isas:
            _native.sgemm_set_skinny_isa(isa)
            for T in args.tokens:
                toks = np.arange(T, dtype=np.int32) * 7 + 11
                pos = 100 + np.arange(T)
                m.forward(toks, pos, None)
                n = max(20, 1000 // T)
                t = time.perf_counter()
                for _ in range(n):
                    m.forward(toks, pos, None)
                res.setdefault((isa, T), []).append((time.perf_counter() - t) / n * 1e3)
    _native.sgemm_set_skinny_isa(default)
    print(f"## embedded model forward, CPU skinny kernels by ISA (median of {args.rounds} rounds, ms)")
    print("| T | avx2 | avx512 | avx512 / avx2 |")
    print("|---:|---:|---:|---:|")
    for T in args.tokens:
        a, b = np.median(res[("avx2", T)]), np.median(res[("avx512", T)])
        print(f"| {T} | {a:.3f} | {b:.3f} | {b / a:.3f} |")


if __name__ == "__main__":
    main()
