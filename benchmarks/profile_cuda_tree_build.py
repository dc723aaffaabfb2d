"""Where the GPU tree build's time goes, phase by phase (clock64 cycles of the block's thread 0).

Needs a module built with the kernel's phase timers (never in a normal build):

    python3 -m pip install --no-build-isolation -Cbuild-dir=build/prof \\
        -Ccmake.define.CMAKE_CUDA_FLAGS=-DKDTREE_TREE_PROFILE .
    python3 benchmarks/profile_cuda_tree_build.py

With KDTREE_TREE_PROFILE every tree-build launch prints one "TREEPROF" line from the device
(cuda/tree_build_impl.h, KD_TREE_MARK): per category the cycles between thread 0's marks, each
mark right after a block barrier, so an interval is the slowest thread's time for that part.
Categories: phase0 (input checks), thrhist (the threshold estimate's range and row histograms, to
their barrier), thr (the rest of the estimate: the depth steps in warp 0 beside the rank tables, the
hand-over barrier; the whole estimate when it stops before the histograms; the "threshold" column
says whether its threshold gave the tree), dpmac (of the depth steps, the products: loads, multiply-adds,
the pair's shuffle; thr keeps the rest of each step), level1, count (adaptive levels: children counts, per level;
for levels of more than 32 parents thread 0's own counting), offs (adaptive levels: those levels'
offsets, two warp scans and two barriers; estimate's levels of more than 32 nodes: the parent
positions' fill and the second barrier, after offsum: the warp totals' reduction), probe (the tighter-threshold recount), estimate's
levels of more than 32 nodes: node (thread 0's own nodes, from the last barrier, with their children
counts), mat (from there to the level's barrier), narrow (the warp-0 runs of levels of at most 32 nodes);
nload / nstore (thread 0's nodes on either kind of level: the loads and the score, the bucket and the
stores; taken out of node / narrow), gscan (histogram
scan; on the estimate's path only the final one), rank (counting sort + comparisons inside a bucket;
the parallel path also writes each node's token, depth and position there), out (outputs: parents,
visibility walk and copy, warp by warp with no block barrier; the profile build adds one at its end,
so out is the slowest warp's time), other (the one-warp / sequential paths). This script runs each shape a few times, captures the
device prints (file descriptor 1) and prints the median launch per shape as a table.
Shapes: the benchmark's peaked and flat drafters at K = B, the engine's K = 8 rows, and the
OracleDrafter's rows ([-0.01, -4, -5, ...] at every depth: chains with many exact score ties).
"""
import ctypes
import os
import re
import sys
import tempfile

import numpy as np

import kdtree_native as kn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cuda_tree_build import PATH_NAMES, drafter_logits, oracle_rows  # noqa: E402

CATS = ("phase0", "thrhist", "thr", "dpmac", "level1", "count", "node", "mat", "narrow", "nload", "nstore", "offsum", "offs", "probe",
        "gscan", "rank", "out", "other")


def shapes():
    for kind in ("peaked", "flat"):
        lp_all, ids_all = kn.reference.topk_logsoftmax(drafter_logits(0, kind), 1024)
        for B in (64, 256, 1024):
            yield f"{kind} K=B", np.ascontiguousarray(lp_all[:, :B]), np.ascontiguousarray(ids_all[:, :B]), B
    lp_all, ids_all = kn.reference.topk_logsoftmax(drafter_logits(0, "peaked", V=32000), 8)
    for B in (64, 256):
        yield "engine K=8", np.ascontiguousarray(lp_all), np.ascontiguousarray(ids_all), B
    lp, ids = oracle_rows()
    for B in (16, 64, 256):
        yield "oracle K=8", lp, ids, B


def capture(fn):
    """Run fn() with file descriptor 1 redirected to a file (the device printf goes there)."""
    sys.stdout.flush()
    with tempfile.TemporaryFile(mode="w+") as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            fn()
        finally:
            ctypes.CDLL(None).fflush(None)  # the driver prints through C stdio
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return f.read()


def parse(text):
    rows = []
    for line in text.splitlines():
        if not line.startswith("TREEPROF"):
            continue
        head, tail = line.split("|", 1)
        r = dict(re.findall(r"(\w+)=(\d+)", head))
        vals = re.findall(r"(\w+) ([\d+]+)", tail)
        for k, v in vals:
            r[k] = sum(int(x) for x in v.split("+"))
        rows.append(r)
    return rows


def main():
    if not kn.cuda_available():
        raise SystemExit("no CUDA device")
    N = kn._native
    print("| shape | B | path | threshold | levels | probes | " + " | ".join(CATS) + " | total cycles |")
    print("|---|---|---|---|---|---|" + "---|" * len(CATS) + "---|")
    for name, lp, ids, B in shapes():
        text = capture(lambda: N.cuda_time_tree_build(lp, ids, B, iters=3, warmup=1))
        rows = parse(text)
        if not rows:
            raise SystemExit("no TREEPROF lines: build with -DKDTREE_TREE_PROFILE (see the docstring)")
        for r in rows:
            r["total"] = sum(int(r.get(c, 0)) for c in CATS)
        rows.sort(key=lambda r: r["total"])
        r = rows[len(rows) // 2]
        path = PATH_NAMES[int(r["path"])]
        fix = {"0": "adaptive", "1": "fixed", "2": "fixed, then adaptive"}.get(r.get("fix"), "-")
        print(f"| {name} | {B} | {path} | {fix} | {r['levels']} | {r['probes']} | "
              + " | ".join(str(r.get(c, 0)) for c in CATS) + f" | {r['total']} |", flush=True)


if __name__ == "__main__":
    main()
