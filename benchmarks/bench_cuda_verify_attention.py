"""GPU MLA tree-verify attention (FP32): achieved FLOP/s, bytes/s and roofline fraction.

For L in {0, 512, 4096, 32768}, H in {16, 64}, B in {16, 64, 256} (T = B+1 tree rows, C = 512,
R = 64, a real best-first tree's ancestor mask): per-op median of CUDA-graph replays (10 ops
per graph; the split-combine kernel included), after 150 ms of GPU warm-up.
  useful FLOPs = sum over query rows (L + visible tree rows) * 2 * (C + R + C)
  bytes        = 4 * (T*H*(C+R) queries + (L+T)*(C+R) cache + T*H*C output) + mask
  roofline     = max(FLOPs / FP32 CUDA-core peak, bytes / measured copy bandwidth)
FP32 peak = SMs x 128 lanes x 2 x peak SM clock; bandwidth = a measured device-to-device copy
(bytes read + written). Goal: >= 50% of the roofline at L >= 4096.

    python benchmarks/bench_cuda_verify_attention.py [--iters 10] [--json out.json] [--quick]
"""
import argparse
import json

import numpy as np

import kdtree_native as kn
from kdtree_native import _cuda_ops as cu

C, R = 512, 64


def tree_visibility(B, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((15, 4096)).astype(np.float32) * 3
    x[:, :8] += (rng.uniform(0, 8, (15, 1)) * np.linspace(1, 0, 8)).astype(np.float32)
    lp, ids = kn.reference.topk_logsoftmax(x, B)
    tree = kn.ops.tree_build(lp, ids, B, device="cpu")
    assert tree.n == B
    return tree.visibility


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not kn.cuda_available():
        raise SystemExit("no CUDA device")
    N = kn._native
    props = N.cuda_device_props()
    bw = N.cuda_copy_bandwidth(1 << 31, 10)
    peak = props["fp32_peak_flops"]
    rng = np.random.default_rng(0)
    Ls = [0, 512, 4096] if args.quick else [0, 512, 4096, 32768]
    kv_all = rng.standard_normal((max(Ls) + 257, C + R), dtype=np.float32)
    rows = []
    for B in (16, 64, 256):
        vis = tree_visibility(B, B)
        T = B + 1
        bits = cu.pack_visibility(vis)
        nvis = vis.sum(axis=1)
        for H in (16, 64):
            ql = rng.standard_normal((T, H, C), dtype=np.float32)
            qr = rng.standard_normal((T, H, R), dtype=np.float32)
            for L in Ls:
                kv = np.ascontiguousarray(kv_all[: L + T])
                r = N.cuda_time_verify_attention(ql, qr, kv, bits, 0.0722, iters=args.iters, warmup=2)
                t = r["graph_median_ms"] * 1e-3
                flops = float(H * np.sum(L + nvis) * 2 * (C + R + C))
                nbytes = 4.0 * (T * H * (C + R) + (L + T) * (C + R) + T * H * C) + bits.nbytes
                roof = max(flops / peak, nbytes / bw)
                rows.append(dict(L=L, H=H, B=B, T=T, ms=r["graph_median_ms"], stream_ms=r["median_ms"], tflops=flops / t / 1e12,
                                 gbps=nbytes / t / 1e9, roofline_ms=roof * 1e3, roofline_frac=roof / t,
                                 compute_bound=bool(flops / peak >= nbytes / bw), fast_path=bool(r["fast_path"])))
    print(f"## verify attention FP32 ({props['name']}): FP32 peak {peak / 1e12:.1f} TFLOP/s "
          f"({props['sms']} SMs x 128 x 2 x {props['sm_clock_khz'] / 1e6:.2f} GHz), copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| L | H | B | time ms | TFLOP/s | GB/s | roofline ms | % of roofline | bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['L']} | {r['H']} | {r['B']} | {r['ms']:.4f} | {r['tflops']:.2f} | {r['gbps']:.0f} | "
              f"{r['roofline_ms']:.4f} | {100 * r['roofline_frac']:.0f}% | {'FP32' if r['compute_bound'] else 'memory'} |")
    big = [r for r in rows if r["L"] >= 4096]
    worst = min(r["roofline_frac"] for r in big)
    best = max(r["roofline_frac"] for r in big)
    print(f"goal >= 50% of roofline at L >= 4096: min {100 * worst:.0f}%, max {100 * best:.0f}% -> "
          f"{'MET' if worst >= 0.5 else 'NOT MET (for all sizes)'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=props, copy_bandwidth=bw, fp32_peak=peak, rows=rows,
                           goal=dict(min_frac_L4096=worst, max_frac_L4096=best, met=bool(worst >= 0.5))), f, indent=1)


if __name__ == "__main__":
    main()
