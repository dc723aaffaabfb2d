"""The tiled linear kernel (cuda::linear_tile) against the skinny one and cuBLAS on the dense
projections of the mini-kimi step (H200): per (projection, T) the median time of one call inside
graphs of 20 calls (weights rotated past the L2, as in the step): linear_skinny's automatic
configuration (T <= 64), linear_tile on the tensor cores (3xTF32) with its automatic k split
count and with each forced count of --splits, linear_tile on the CUDA cores (FP32), and cuBLAS (torch.matmul / bmm, FP32, TF32 off) in graphs of the same length.
Guides CudaModel's skinny_max_tokens / tile_max_tokens and linear_tile's split rule.

    python3 benchmarks/bench_cuda_linear_tile.py [--tokens 5 8 17 33 65 257] [--splits 1 2 4 8] [--rows 64 72]
        [--json FILE]

--rows adds a column per forced tile height (LinearParams::tile_rows; auto split count).
"""
import argparse
import json
import os
import sys

from kdtree_native import _native as N

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cuda_skinny_configs import SHAPES  # noqa: E402


def cublas_us(torch, T, n, kd, batch, iters, graph_ops=20):
    """Median us per call of the FP32 product through cuBLAS (torch), in CUDA graphs of graph_ops
    calls over rotating weight copies (about 192 MiB in all, at least graph_ops of them)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    wbytes = batch * n * kd * 4
    copies = max(1, min(graph_ops, (192 << 20) // wbytes + 1))
    ws = [torch.full((batch, n, kd), 0.0115, device=dev) for _ in range(copies)]
    x = torch.full((batch, T, kd), 0.0115, device=dev)
    y = torch.empty((batch, T, n), device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            torch.bmm(x, ws[i % copies].transpose(1, 2), out=y)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(graph_ops):
            torch.bmm(x, ws[i % copies].transpose(1, 2), out=y)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / graph_ops)
    times.sort()
    del g, ws
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[5, 8, 17, 24, 33, 65, 129, 257])
    ap.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--rows", type=int, nargs="*", default=[], help="forced tile heights (extra columns)")
    ap.add_argument("--only", nargs="*", default=None, help="projection names")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    print(f"## linear_tile vs linear_skinny vs cuBLAS ({N.cuda_device_props()['name']}, us per call in graphs of 20)")
    head = " | ".join([f"tile s={s}" for s in args.splits] + [f"tile rows={r}" for r in args.rows])
    print(f"| projection | T | MB | skinny | tile auto | {head} | tile FP32 cores | cuBLAS | best | tile auto TB/s |")
    print("|---|---:|---:|---:|---:|" + "---:|" * (len(args.splits) + len(args.rows)) + "---:|---:|---|---:|")
    rows = []
    for name, n, kd, batch, _pro in SHAPES:
        if args.only and name not in args.only:
            continue
        for T in args.tokens:
            t = {}
            if T <= 64:
                t["skinny"] = N.cuda_time_linear_skinny(T, n, kd, batch, iters=args.iters)["graph_median_ms"] * 1e3
            t["tile"] = N.cuda_time_linear_skinny(T, n, kd, batch, iters=args.iters, kernel="tile")["graph_median_ms"] * 1e3
            for s in args.splits:
                t[f"s{s}"] = N.cuda_time_linear_skinny(T, n, kd, batch, iters=args.iters, kernel="tile",
                                                       splits=s)["graph_median_ms"] * 1e3
            for r in args.rows:
                t[f"r{r}"] = N.cuda_time_linear_skinny(T, n, kd, batch, iters=args.iters, kernel="tile",
                                                       tile_rows=r)["graph_median_ms"] * 1e3
            t["fp32"] = N.cuda_time_linear_skinny(T, n, kd, batch, iters=args.iters, kernel="tile",
                                                  tile_math=1)["graph_median_ms"] * 1e3
            t["cublas"] = cublas_us(torch, T, n, kd, batch, args.iters)
            best = min(t, key=t.get)
            mb = n * kd * batch * 4 / 1e6
            rows.append(dict(name=name, T=T, N=n, Kd=kd, batch=batch, us=t, best=best))
            cells = " | ".join([f"{t[f's{s}']:.1f}" for s in args.splits] + [f"{t[f'r{r}']:.1f}" for r in args.rows])
            sk = f"{t['skinny']:.1f}" if "skinny" in t else "-"
            print(f"| {name} | {T} | {mb:.1f} | {sk} | {t['tile']:.1f} | {cells} | {t['fp32']:.1f} | {t['cublas']:.1f} | {best} | "
                  f"{mb / t['tile']:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
