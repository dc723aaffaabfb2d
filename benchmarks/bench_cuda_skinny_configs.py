"""Every configuration of the skinny linear kernel on the dense projections of the mini-kimi
step (H200): per (projection, T) the median time of one call inside graphs of 20 calls (a PDL
chain, as in the step; weights rotated past the L2), for the automatic choice and for each
forced configuration (rows per warp RW, tokens per slice TT, k-steps in flight U). Guides the
automatic choice in cuda/model/linear_kernels.cu.

    python3 benchmarks/bench_cuda_skinny_configs.py [--tokens 1 2 4 17] [--only W_UK q_b] [--json FILE]
"""
import argparse
import json
import os
import sys

from kdtree_native import _native as N

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cuda_model import MINI_KIMI  # noqa: E402


def shapes(c):
    """(name, N, Kd, batch, prologue) of every dense projection of the config's step, as
    CudaModel runs them. The RMSNorm prologue runs for <= 4 tokens where the model fuses it; the
    SwiGLU of the down projections likewise."""
    dm, h, c_lat, r = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    qr, dn, dv = c["q_lora_rank"], c["qk_nope_head_dim"], c["v_head_dim"]
    e, i_s = c["n_routed_experts"], c["moe_intermediate_size"] * c["n_shared_experts"]
    return [
        ("qkv_a", qr + c_lat + r, dm, 1, "norm"),
        ("q_b", h * (dn + r), qr, 1, "norm"),
        ("W_UK", c_lat, dn, h, ""),
        ("W_UV", dv, c_lat, h, ""),
        ("o_proj", dm, h * dv, 1, ""),
        ("router+shared", e + 2 * i_s, dm, 1, "norm"),
        ("shared_down", dm, i_s, 1, "swiglu"),
        ("dense_gate_up", 2 * c["intermediate_size"], dm, 1, "norm"),
        ("dense_down", dm, c["intermediate_size"], 1, "swiglu"),
        ("lm_head", c["vocab_size"], dm, 1, "norm"),
    ]


SHAPES = shapes(MINI_KIMI)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 17])
    ap.add_argument("--only", nargs="*", default=None, help="projection names")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    configs = N.cuda_linear_skinny_configs()
    print(f"## skinny linear configurations ({N.cuda_device_props()['name']}, us per call in graphs of 20)")
    print("configs: " + ", ".join(f"{i + 1} = {c}" for i, c in enumerate(configs)) + " (RW, TT, U)")
    print("| projection | T | MB | auto | " + " | ".join(str(i + 1) for i in range(len(configs))) +
          " | best | auto / best |")
    print("|---|---:|---:|---:|" + "---:|" * len(configs) + "---:|---:|")
    rows = []
    for name, n, kd, batch, pro in SHAPES:
        if args.only and name not in args.only:
            continue
        for T in args.tokens:
            norm = pro == "norm" and T <= 4
            swiglu = pro == "swiglu" and T <= 4
            t = {}
            for cfg in range(len(configs) + 1):
                if cfg and norm and configs[cfg - 1][1] > 4:
                    continue
                r = N.cuda_time_linear_skinny(T, n, kd, batch, cfg, norm, swiglu, iters=args.iters)
                t[cfg] = r["graph_median_ms"] * 1e3
            best = min((c for c in t if c), key=lambda c: t[c])
            rows.append(dict(name=name, T=T, N=n, Kd=kd, batch=batch, prologue=pro if (norm or swiglu) else "",
                             us={str(c): v for c, v in t.items()}, best=best))
            mb = n * kd * batch * 4 / 1e6
            cells = " | ".join(f"{t[c]:.1f}" if c in t else "-" for c in range(1, len(configs) + 1))
            print(f"| {name}{' +' + pro if (norm or swiglu) else ''} | {T} | {mb:.1f} | {t[0]:.1f} | {cells} | "
                  f"{best} | {t[0] / t[best]:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(configs=configs, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
