"""Verify attention at shapes the fast kernels (C = 512, R = 64) do not take: the rows kernel (what
runs: its automatic key splits) against the plain reference kernel (force_naive) and against the
rows kernel with forced key splits (--splits; 1 = one block per query row, the kernel before the
splits), graph-replay medians in us, and the automatic pick's error against a float64 oracle.
Default shapes: the embedded default target (C = 128, R = 32, H = 8) and draft (C = 64, R = 32,
H = 4), AR steps and small trees, short to long contexts.

    python3 benchmarks/bench_cuda_attention_rows.py [--shapes 128,32,8 64,32,4] [--tokens 1 5 17]
        [--contexts 160 512 2048] [--splits 1 2 4 8 16] [--iters 30]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["128,32,8", "64,32,4"], help="C,R,H")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 5, 17])
    ap.add_argument("--contexts", type=int, nargs="+", default=[160, 512, 2048])
    ap.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    from kdtree_native import _native
    from kdtree_native._cuda_ops import pack_visibility
    from test_cuda_ops import attn_case, ref64, rel_err

    print(f"## Verify attention, rows kernel vs the plain kernel ({_native.cuda_device_name()}), graph medians, us")
    sp = "".join(f" splits {k} |" for k in args.splits)
    print(f"| C | R | H | T | L | plain | rows (auto) |{sp} plain / auto | rel. err vs float64 |")
    print("|---:" * (8 + len(args.splits)) + "|---:|")
    for shape in args.shapes:
        C, R, H = (int(x) for x in shape.split(","))
        for T in args.tokens:
            for L in args.contexts:
                ql, qr, kvl, kr, vis, scale = attn_case(L + T, L, H, T - 1, C=C, R_=R)
                kv = np.ascontiguousarray(np.concatenate([kvl, kr], axis=1))
                vb = np.ascontiguousarray(pack_visibility(vis))
                res = {}
                runs = [("plain", dict(force_naive=True)), ("rows", {})]
                runs += [(k, dict(force_splits=k)) for k in args.splits]
                for label, kw in runs:
                    r = _native.cuda_time_verify_attention(ql, qr, kv, vb, scale, iters=args.iters, warmup=3, **kw)
                    res[label] = (1e3 * r["graph_median_ms"], r["out"])
                err = rel_err(res["rows"][1], ref64(ql, qr, kvl, kr, vis, scale))
                forced = "".join(f" {res[k][0]:.1f} |" for k in args.splits)
                print(f"| {C} | {R} | {H} | {T} | {L} | {res['plain'][0]:.1f} | {res['rows'][0]:.1f} |{forced} "
                      f"{res['plain'][0] / res['rows'][0]:.2f}x | {err:.1e} |")


if __name__ == "__main__":
    main()
