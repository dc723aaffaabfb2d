"""GPU MLA tree-verify attention (FP32): achieved FLOP/s, bytes/s and roofline fraction.

For L in {0, 512, 4096, 32768}, H in {16, 64}, B in {16, 64, 256} (T = B+1 tree rows, C = 512,
R = 64, a real best-first tree's ancestor mask): per-op median of CUDA-graph replays (10 ops
per graph; the split-combine kernel included), after 150 ms of GPU warm-up.
  useful FLOPs = sum over query rows (L + visible tree rows) * 2 * (C + R + C)
  bytes        = 4 * (T*H*(C+R) queries + (L+T)*(C+R) cache + T*H*C output) + mask
  roofline     = max(FLOPs / FP32 CUDA-core peak, bytes / measured copy bandwidth)
FP32 peak = SMs x 128 lanes x 2 x peak SM clock; bandwidth = a measured device-to-device copy
(bytes read + written). Goal: >= 50% of the roofline at L >= 4096.

Then the decode table, for tuning the kernel choice's cost model (cuda/verify_attention.cu,
`namespace cost`): T = 1 with H in {16, 64, 128} and L in {512, 4096, 32768}, and T = 17, 65
(a tree) with H = 16 at L in {512, 4096}; per shape the auto pick (kernel, splits, time), the
tiled kernel forced and the split-KV kernel forced with 16, 8 and 4 query rows per block (each
with its own split choice), in us.

    python benchmarks/bench_cuda_verify_attention.py [--iters 10] [--json out.json] [--quick]
        [--kernels auto,mma] [--contexts 4096,32768] [--no-decode] [--decode-only]
    python benchmarks/bench_cuda_verify_attention.py --ab LABEL   # one JSON line for same-lease A/B runs
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


def case_arrays(rng, T, H, L):
    """A verify case's mask bits (a best-first tree's, or the one row of a decode step), queries and cache."""
    vis = tree_visibility(T - 1, T) if T > 1 else np.ones((1, 1), bool)
    ql = rng.standard_normal((T, H, C), dtype=np.float32)
    qr = rng.standard_normal((T, H, R), dtype=np.float32)
    kv = rng.standard_normal((L + T, C + R), dtype=np.float32)
    return cu.pack_visibility(vis), ql, qr, kv


def decode_rows(N, rng, args):
    """T = 1 (AR decode) and small trees: auto vs each fast kernel forced."""
    shapes = [(1, H, L) for H in (16, 64, 128) for L in (512, 1024, 2048, 4096, 8192, 16384, 32768)]
    shapes += [(T, 16, L) for T in (2, 4, 17, 65) for L in (512, 4096)]
    if args.quick:
        shapes = [s for s in shapes if s[2] <= 4096]
    out = []
    for T, H, L in shapes:
        bits, ql, qr, kv = case_arrays(rng, T, H, L)
        row = dict(T=T, H=H, L=L)
        for name, fk, rows in (("auto", 0, 0), ("tiled", 1, 0), ("splitkv16", 2, 16), ("splitkv8", 2, 8),
                               ("splitkv4", 2, 4), ("decode", 3, 0), ("mma", 4, 0)):
            r = N.cuda_time_verify_attention(ql, qr, kv, bits, 0.0722, iters=args.iters, warmup=2, force_kernel=fk,
                                             force_rows=rows)
            row[name + "_us"] = r["graph_median_ms"] * 1e3
            row[name + "_splits"] = int(r["splits"])
            if fk == 0:
                row["auto_kernel"] = int(r["kernel"])
                row["auto_rows"] = int(r["rows"])
            if fk == 3:
                row["decode_kernel"] = int(r["kernel"])
        out.append(row)
    return out


def print_decode(decode):
    print("## decode / small trees: time per kernel (us; graph replay median). kernel: 1 = tiled, 2 = split-KV "
          "(16, 8 or 4 query rows per block), 3 = decode (two passes, only when forced; up to 1024 rows and 16384 keys, "
          "else split-KV), 4 = tensor cores (3xTF32)")
    print("| T | H | L | auto kernel (rows) | auto splits | auto us | tiled splits | tiled us | split-KV 16 rows: splits, us "
          "| split-KV 8 rows: splits, us | split-KV 4 rows: splits, us | decode us | tensor cores: splits, us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in decode:
        rows = f" ({r['auto_rows']})" if r["auto_kernel"] == 2 else ""
        print(f"| {r['T']} | {r['H']} | {r['L']} | {r['auto_kernel']}{rows} | {r['auto_splits']} | {r['auto_us']:.1f} | "
              f"{r['tiled_splits']} | {r['tiled_us']:.1f} | {r['splitkv16_splits']}, {r['splitkv16_us']:.1f} | "
              f"{r['splitkv8_splits']}, {r['splitkv8_us']:.1f} | {r['splitkv4_splits']}, {r['splitkv4_us']:.1f} | "
              f"{r['decode_us']:.1f}{'' if r['decode_kernel'] == 3 else ' (split-KV)'} | {r['mma_splits']}, {r['mma_us']:.1f} |")


def ab_line(N, label):
    """One line, `AB <label> {shape: graph-replay median us}`, for same-lease A/B runs in alternating
    processes (two builds, or an experiment switch that a process reads once): the automatic kernel and
    split count with its combine, at the verify shapes of mini-kimi's B = 16 / 64 / 256 trees (H = 16,
    contexts 512 and 4096); the key is T, L and the split count taken."""
    rng = np.random.default_rng(0)
    out = {}
    for T, L in ((17, 512), (17, 4096), (65, 512), (65, 4096), (257, 512)):
        bits, ql, qr, kv = case_arrays(rng, T, 16, L)
        r = N.cuda_time_verify_attention(ql, qr, kv, bits, 0.0722, iters=40, warmup=5, force_kernel=0)
        out[f"T{T}L{L}s{int(r['splits'])}"] = round(r["graph_median_ms"] * 1e3, 2)
    print("AB", label, json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ab", default=None, metavar="LABEL", help="print one A/B line (see ab_line) and stop")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--decode-only", action="store_true", help="only the decode / small-tree table")
    ap.add_argument("--no-decode", action="store_true", help="only the roofline table(s)")
    ap.add_argument("--contexts", default=None, help="comma list of contexts L for the roofline table "
                    "(default 0,512,4096,32768; --quick drops 32768)")
    ap.add_argument("--kernels", default="auto", help="comma list for the roofline table: auto, tiled, splitkv, mma "
                    "(one table each)")
    args = ap.parse_args()
    kernel_ids = dict(auto=0, tiled=1, splitkv=2, mma=4)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    for k in kernels:
        if k not in kernel_ids:
            raise SystemExit(f"--kernels: unknown kernel {k!r} (auto, tiled, splitkv, mma)")
    if not kn.cuda_available():
        raise SystemExit("no CUDA device")
    N = kn._native
    if args.ab:
        ab_line(N, args.ab)
        return
    props = N.cuda_device_props()
    bw = N.cuda_copy_bandwidth(1 << 31, 10)
    peak = props["fp32_peak_flops"]
    rng = np.random.default_rng(0)
    if args.decode_only:
        decode = decode_rows(N, rng, args)
        print_decode(decode)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=props, decode_rows=decode), f, indent=1)
        return
    Ls = [0, 512, 4096] if args.quick else [0, 512, 4096, 32768]
    if args.contexts:
        Ls = [int(x) for x in args.contexts.split(",") if x.strip()]
    kv_all = rng.standard_normal((max(Ls) + 257, C + R), dtype=np.float32)
    tables = {}
    for kname in kernels:
        tables[kname] = roofline_rows(N, rng, args, Ls, kv_all, kernel_ids[kname], peak, bw)
        print_roofline(tables[kname], kname, props, peak, bw)
    rows = tables[kernels[0]]
    decode = [] if args.no_decode else decode_rows(N, rng, args)
    if decode:
        print()
        print_decode(decode)
    for kname, krows in tables.items():
        big = [r for r in krows if r["L"] >= 4096]
        if not big:
            continue
        worst = min(r["roofline_frac"] for r in big)
        best = max(r["roofline_frac"] for r in big)
        print(f"[{kname}] goal >= 50% of roofline at L >= 4096: min {100 * worst:.0f}%, max {100 * best:.0f}% -> "
              f"{'MET' if worst >= 0.5 else 'NOT MET (for all sizes)'}")
    big = [r for r in rows if r["L"] >= 4096] or rows
    worst = min(r["roofline_frac"] for r in big)
    best = max(r["roofline_frac"] for r in big)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=props, copy_bandwidth=bw, fp32_peak=peak, rows=rows, tables=tables, decode_rows=decode,
                           goal=dict(min_frac_L4096=worst, max_frac_L4096=best, met=bool(worst >= 0.5))), f, indent=1)


def roofline_rows(N, rng, args, Ls, kv_all, fk, peak, bw):
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
                r = N.cuda_time_verify_attention(ql, qr, kv, bits, 0.0722, iters=args.iters, warmup=2, force_kernel=fk)
                t = r["graph_median_ms"] * 1e-3
                flops = float(H * np.sum(L + nvis) * 2 * (C + R + C))
                nbytes = 4.0 * (T * H * (C + R) + (L + T) * (C + R) + T * H * C) + bits.nbytes
                roof = max(flops / peak, nbytes / bw)
                rows.append(dict(L=L, H=H, B=B, T=T, ms=r["graph_median_ms"], stream_ms=r["median_ms"], tflops=flops / t / 1e12,
                                 gbps=nbytes / t / 1e9, roofline_ms=roof * 1e3, roofline_frac=roof / t,
                                 compute_bound=bool(flops / peak >= nbytes / bw), fast_path=bool(r["fast_path"]),
                                 kernel=int(r["kernel"]), splits=int(r["splits"])))
    return rows


def print_roofline(rows, kname, props, peak, bw):
    print(f"## verify attention FP32, kernel {kname} ({props['name']}): FP32 peak {peak / 1e12:.1f} TFLOP/s "
          f"({props['sms']} SMs x 128 x 2 x {props['sm_clock_khz'] / 1e6:.2f} GHz), copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| L | H | B | kernel, splits | time ms | TFLOP/s | GB/s | roofline ms | % of roofline | bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['L']} | {r['H']} | {r['B']} | {r['kernel']}, {r['splits']} | {r['ms']:.4f} | {r['tflops']:.2f} | "
              f"{r['gbps']:.0f} | {r['roofline_ms']:.4f} | {100 * r['roofline_frac']:.0f}% | "
              f"{'FP32' if r['compute_bound'] else 'memory'} |")
    print()


if __name__ == "__main__":
    main()
