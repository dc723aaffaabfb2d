"""GPU DDTree tree build: kernel time vs the official Python implementation and our CPU twin.

Times (CUDA events around each launch, median of --iters launches on device-resident inputs):
  * tree_build from [15, K] log-probs + ids (K = B, as the official code takes top-k = budget),
  * tree_build_from_logits from [15, 163840] float32 logits (Kimi's vocabulary), top-k included,
  * the CPU twin (kn.ops device="cpu" native call, no validation) on the same [15, K] inputs.
Anchors (official implementation on an H200, GPU top-k + copy + Python heap + visibility):
B=16 0.49 ms, 64 0.71 ms, 256 1.69 ms, 512 3.28 ms, 1024 6.60 ms (docs/BENCHMARKS.md).
Goals: <= 15 us at B=256 and <= 40 us at B=1024 from [15,K]; <= 60 us at B=256 from logits.

Inputs ("peaked", the table): per depth a Zipf-like drafter distribution, logit of the r-th
most likely token = -s*log(r) + N(0, 0.5^2), s ~ U(1.3, 2.3) per depth, ids shuffled: top-1
probabilities 0.3..0.7, trees 8..12 deep at B = 1024 (the regime where DDTree pays). A "flat"
row set (N(0, 3^2) logits: shallow, bushy trees) is measured and printed too.

GPU times: "graph" = per op in a CUDA graph replaying 10 back-to-back ops (pure GPU time, as a
captured engine round sees it); "stream" = one launch + event pair per op (adds launch gaps).

    python benchmarks/bench_cuda_tree_build.py [--iters 200] [--json out.json] [--quick]
    python benchmarks/bench_cuda_tree_build.py --engine-shapes   # depth 15, K = 8 / 4, each path forced
    python benchmarks/bench_cuda_tree_build.py --small-budgets   # B = 1..24: one warp vs parallel (auto's cut)
    python benchmarks/bench_cuda_tree_build.py --ab new          # one JSON line for same-lease A/B runs
"""
import argparse
import json
import time

import numpy as np

import kdtree_native as kn

ANCHOR_MS = {16: 0.49, 64: 0.71, 256: 1.69, 512: 3.28, 1024: 6.60}
GOAL_US = {("lp", 256): 15.0, ("lp", 1024): 40.0, ("logits", 256): 60.0}
PATH_NAMES = ("parallel", "fallback", "one warp", "parallel, estimate")  # by path_taken


def drafter_logits(seed, kind="peaked", D=15, V=163840):
    rng = np.random.default_rng(seed)
    if kind == "flat":
        return rng.standard_normal((D, V), dtype=np.float32) * 3.0
    ranks = np.log(np.arange(1, V + 1, dtype=np.float64))
    rows = []
    for _ in range(D):
        s = rng.uniform(1.3, 2.3)
        row = -s * ranks + rng.standard_normal(V) * 0.5
        rows.append(row[rng.permutation(V)])
    return np.asarray(rows, dtype=np.float32)


def oracle_rows(D=15, K=8):
    """The OracleDrafter's rows (kdtree_native.drafters: [-0.01, -4, -5, ...] at every depth) with made-up ids:
    chains with many exact score ties."""
    lp = np.tile(np.concatenate([[-0.01], -4.0 - np.arange(K - 1)]).astype(np.float32), (D, 1))
    return lp, np.arange(D * K, dtype=np.int32).reshape(D, K)


def checked(r, ref, what):
    """r (a timing call's result) after checking that its tree is the CPU twin's (n and parents)."""
    assert int(r["n"]) == ref.n and np.array_equal(r["parents"][: ref.n + 1], ref.parents), what
    return r


def cpu_twin_ms(lp, ids, budget, reps):
    fn = kn._native.tree_build_cpu
    fn(lp, ids, budget)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(lp, ids, budget)
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


def engine_shapes(N, props, iters):
    """The shapes generate() uses by default (depth 15, top_k 8: K < B, so trees grow deep),
    each path forced (one warp / parallel) and auto, peaked drafter rows; graph-replay medians."""
    print(f"## GPU tree build at the engine's shapes ({props['name']}): depth 15, K = 8, peaked drafter; "
          f"graph-replay median us")
    print("| B | K | auto | path (auto) | one warp | parallel | parallel, adaptive threshold | tree depth |")
    print("|---|---|---|---|---|---|---|---|")
    for K in (8, 4):
        lp_all, ids_all = kn.reference.topk_logsoftmax(drafter_logits(0, "peaked", V=32000), K)
        lp, ids = np.ascontiguousarray(lp_all), np.ascontiguousarray(ids_all)
        for B in (16, 32, 64, 128, 256):
            ref = kn.ops.tree_build(lp, ids, B, device="cpu")
            t = {}
            for name, fp in (("auto", 0), ("warp", 2), ("parallel", 3), ("adaptive", 4)):
                t[name] = checked(N.cuda_time_tree_build(lp, ids, B, iters=iters, warmup=10, force_path=fp), ref,
                                  (B, K, name))
            print(f"| {B} | {K} | {t['auto']['graph_median_ms'] * 1e3:.1f} | "
                  f"{PATH_NAMES[int(t['auto']['path'])]} | "
                  f"{t['warp']['graph_median_ms'] * 1e3:.1f} | {t['parallel']['graph_median_ms'] * 1e3:.1f} | "
                  f"{t['adaptive']['graph_median_ms'] * 1e3:.1f} | "
                  f"{int(ref.depths.max()) if ref.n else 0} |", flush=True)


def small_budgets(N, props, iters):
    """Where auto's cut between the one-warp path and the parallel path belongs: both forced at
    B = 1..24 on peaked rows (K = B, and the engine's K = 8 / 4) and flat rows (K = B)."""
    print(f"## GPU tree build at small budgets ({props['name']}): depth 15, one warp vs parallel "
          f"(auto takes one warp for B <= {N.CUDA_TREE_WARP_PATH_MAX_B}); graph-replay median us")
    print("| B | peaked K=B: one warp / parallel | flat K=B | peaked K=8 | peaked K=4 |")
    print("|---|---|---|---|---|")
    peaked, flat = drafter_logits(0, "peaked", V=32000), drafter_logits(0, "flat", V=32000)
    for B in (1, 2, 4, 6, 8, 12, 16, 20, 24):
        cells = []
        for logits, K in ((peaked, B), (flat, B), (peaked, 8), (peaked, 4)):
            lp_all, ids_all = kn.reference.topk_logsoftmax(logits, K)
            lp, ids = np.ascontiguousarray(lp_all), np.ascontiguousarray(ids_all)
            ref = kn.ops.tree_build(lp, ids, B, device="cpu")
            t = []
            for fp in (2, 3):
                r = checked(N.cuda_time_tree_build(lp, ids, B, iters=iters, warmup=10, force_path=fp), ref,
                            (B, K, fp))
                t.append(r["graph_median_ms"] * 1e3)
            cells.append(f"{t[0]:.1f} / {t[1]:.1f}")
        print(f"| {B} | " + " | ".join(cells) + " |", flush=True)


def ab_line(N, label, iters):
    """One line, `AB <label> {shape: graph-replay median us}`, for same-lease A/B runs: run it in
    alternating processes against two builds (e.g. PYTHONPATH=/tmp/mainmod for main's module,
    installed with `pip install --no-deps --no-build-isolation --target /tmp/mainmod <main's tree>`).
    Shapes: peaked K = B at every budget, flat K = B at 256 / 1024, the engine's K = 8 at 64 / 256, the
    OracleDrafter's rows ([-0.01, -4, -5, ...], K = 8: exact score ties, where a looser threshold estimate
    can overflow the candidate store) at 16 / 64 / 256; every tree is checked against the CPU twin."""
    pk, fl = drafter_logits(0, "peaked"), drafter_logits(0, "flat")
    lp_p, ids_p = kn.reference.topk_logsoftmax(pk, 1024)
    lp_f, ids_f = kn.reference.topk_logsoftmax(fl, 1024)
    lp_8, ids_8 = kn.reference.topk_logsoftmax(drafter_logits(0, "peaked", V=32000), 8)
    lp_o, ids_o = oracle_rows()
    shapes = [("pk", B, lp_p[:, :B], ids_p[:, :B]) for B in (16, 64, 256, 512, 1024)] + \
             [("fl", B, lp_f[:, :B], ids_f[:, :B]) for B in (256, 1024)] + [("k8", B, lp_8, ids_8) for B in (64, 256)] + \
             [("or", B, lp_o, ids_o) for B in (16, 64, 256)]
    out = {}
    for name, B, lp, ids in shapes:
        lp, ids = np.ascontiguousarray(lp), np.ascontiguousarray(ids)
        ref = kn.ops.tree_build(lp, ids, B, device="cpu")
        r = checked(N.cuda_time_tree_build(lp, ids, B, iters=iters, warmup=10), ref, (name, B))
        out[f"{name}{B}"] = round(r["graph_median_ms"] * 1e3, 2)
    print("AB", label, json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--engine-shapes", action="store_true",
                    help="only the engine's default shapes (depth 15, top-k 8: deep trees) with each path forced")
    ap.add_argument("--small-budgets", action="store_true",
                    help="only budgets 1..24 with the one-warp and the parallel path forced (auto's cut)")
    ap.add_argument("--ab", metavar="LABEL", default=None,
                    help="only one line 'AB LABEL {shape: us}' of the A/B shapes (40 launches each): for alternating "
                         "runs against another build in the same lease")
    args = ap.parse_args()
    if not kn.cuda_available():
        raise SystemExit("no CUDA device")
    N = kn._native
    props = N.cuda_device_props()
    budgets = [16, 64, 256, 512, 1024]
    iters = 30 if args.quick else args.iters
    if args.ab is not None:
        ab_line(N, args.ab, 40)
        return
    if args.engine_shapes:
        engine_shapes(N, props, iters)
        return
    if args.small_budgets:
        small_budgets(N, props, iters)
        return
    tables = {}
    for kind in ("peaked", "flat"):
        logits = drafter_logits(0, kind)
        lp_all, ids_all = kn.reference.topk_logsoftmax(logits, max(budgets))
        rows = []
        for B in budgets:
            lp, ids = np.ascontiguousarray(lp_all[:, :B]), np.ascontiguousarray(ids_all[:, :B])
            ref = kn.ops.tree_build(lp, ids, B, device="cpu")
            r = checked(N.cuda_time_tree_build(lp, ids, B, iters=iters, warmup=10), ref, "GPU != CPU twin")
            ra = checked(N.cuda_time_tree_build(lp, ids, B, iters=iters, warmup=10, force_path=4),  # no threshold estimate
                         ref, "adaptive != CPU twin")
            rl = checked(N.cuda_time_tree_build_from_logits(logits, B, B, iters=max(10, iters // 2), warmup=5),
                         ref, "logits path != CPU twin")
            cpu = cpu_twin_ms(lp, ids, B, 20 if args.quick else 100)
            row = dict(budget=B, depth=15, K=B, path=int(r["path"]),
                       gpu_lp_us=r["graph_median_ms"] * 1e3, gpu_lp_stream_us=r["median_ms"] * 1e3,
                       gpu_lp_adaptive_us=ra["graph_median_ms"] * 1e3,
                       gpu_logits_us=rl["graph_median_ms"] * 1e3, gpu_logits_stream_us=rl["median_ms"] * 1e3,
                       gpu_topk_us=rl["topk_graph_median_ms"] * 1e3, cpu_twin_us=cpu * 1e3,
                       official_us=ANCHOR_MS[B] * 1e3,
                       nodes_per_depth=np.bincount(ref.depths, minlength=16)[1:].tolist(),
                       max_depth=int(ref.depths.max()) if ref.n else 0)
            row["speedup_vs_official_lp"] = row["official_us"] / row["gpu_lp_us"]
            row["speedup_vs_official_logits"] = row["official_us"] / row["gpu_logits_us"]
            row["speedup_vs_cpu_twin"] = row["cpu_twin_us"] / row["gpu_lp_us"]
            rows.append(row)
        tables[kind] = rows
    for kind, rows in tables.items():
        print(f"## GPU tree build, {kind} drafter ({props['name']}), depth 15, K = B; GPU = graph-replay median "
              f"(stream launch+event median in brackets)")
        print("| B | GPU [15,K] us | path | adaptive threshold only us | GPU from [15,163840] logits us (top-k) | CPU twin us | official us | x official ([15,K] / logits) | x CPU twin | tree depth |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['budget']} | {r['gpu_lp_us']:.1f} ({r['gpu_lp_stream_us']:.1f}) | "
                  f"{PATH_NAMES[r['path']]} | {r['gpu_lp_adaptive_us']:.1f} | "
                  f"{r['gpu_logits_us']:.1f} ({r['gpu_topk_us']:.1f}) | "
                  f"{r['cpu_twin_us']:.1f} | {r['official_us']:.0f} | {r['speedup_vs_official_lp']:.0f}x / "
                  f"{r['speedup_vs_official_logits']:.0f}x | {r['speedup_vs_cpu_twin']:.1f}x | {r['max_depth']} |")
    goals = []
    for kind, rows in tables.items():
        for (what, B), us in GOAL_US.items():
            r = next(x for x in rows if x["budget"] == B)
            got = r["gpu_lp_us"] if what == "lp" else r["gpu_logits_us"]
            goals.append(dict(dist=kind, what=f"B={B} from {'[15,K]' if what == 'lp' else '[15,163840] logits'}",
                              goal_us=us, got_us=got, met=bool(got <= us)))
            print(f"goal ({kind}) B={B} {what}: <= {us} us, got {got:.1f} us -> {'MET' if got <= us else 'NOT MET'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=props, tables=tables, goals=goals), f, indent=1)


if __name__ == "__main__":
    main()
