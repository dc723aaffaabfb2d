"""CPU model: what loading a BF16 checkpoint costs in memory and time, and what each way of holding
its weights (`cpu_options={"bf16_weights": "only" | "copies" | "off"}`, docs/MODEL.md) gives for
prefill, decode and tree-verify forwards.

    python benchmarks/bench_cpu_load.py --make /tmp/minikimi          # write the checkpoint once
    python benchmarks/bench_cpu_load.py /tmp/minikimi                 # every mode, a child each
    python benchmarks/bench_cpu_load.py /tmp/minikimi --modes only --sizes 1 17 512
    PYTHONPATH=<older build> python benchmarks/bench_cpu_load.py /tmp/minikimi --legacy

Each mode loads in a fresh child process (`Engine.from_pretrained(dir, device="cpu")`), which
reports its peak resident memory (ru_maxrss: the most the process ever held, loading included),
the load time, the model's own count (`memory_bytes`, `bf16_weight_bytes`, `fp32_weight_bytes`)
and the median time of forwards of T tokens after a 100-token prompt (T = 1: a decode step, T =
17: a verify of a 16-node tree, larger T: a prefill chunk), modes interleaved over --rounds; --ttft P
adds the time to the first token of `generate` on a P-token prompt. Peak
memory counts the checkpoint's pages that the child has read through the memory map as well.
--legacy: for builds before `bf16_weights` (their modes: "copies" = the default, "off" =
`bf16_weight_copies=False`). --make writes a random BF16 checkpoint of the mini-kimi shape of
docs/BENCHMARKS.md (483M parameters, 967 MB; no torch needed).
"""
import argparse
import json
import os
import resource
import statistics
import struct
import subprocess
import sys
import time

import numpy as np

MINI_KIMI = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 32000,
    "hidden_size": 1024, "intermediate_size": 2816, "moe_intermediate_size": 256, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 384,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "head_dim": 64,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
    "rope_interleave": True, "torch_dtype": "bfloat16",
}


# Kimi K2-Thinking's scheme: the routed experts 4-bit symmetric in groups of 32 with BF16 scales
INT4_QC = {
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, "dynamic": False}}},
    "format": "pack-quantized", "quant_method": "compressed-tensors", "quantization_status": "compressed",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
}


def make_checkpoint(out: str, int4: bool = False) -> None:
    """config.json + model.safetensors: every tensor BF16, random N(0, 1 / fan_in), norms 1; with int4,
    the routed experts as compressed-tensors pack-quantized 4-bit integers (uniform in [-8, 7]) in
    groups of 32 with BF16 scales (the values of 1 / (4 sqrt(fan_in)) times a factor in [0.5, 1.5))."""
    from kdtree_native.checkpoint import expected_weight_shapes
    from kdtree_native.config import config_from_dict

    os.makedirs(out, exist_ok=True)
    cfg = dict(MINI_KIMI, quantization_config=INT4_QC) if int4 else MINI_KIMI
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    shapes = expected_weight_shapes(config_from_dict(MINI_KIMI))
    entries = []  # (name, dtype, shape, what)
    for name, shape in shapes.items():
        if int4 and ".mlp.experts." in name:
            mod = name[:-len(".weight")]
            entries += [(mod + ".weight_packed", "I32", [shape[0], shape[1] // 8], "packed"),
                        (mod + ".weight_scale", "BF16", [shape[0], shape[1] // 32], "scale"),
                        (mod + ".weight_shape", "I32", [2], "shape")]
        else:
            entries.append((name, "BF16", list(shape), "float"))
    header, off = {}, 0
    for name, dt, shape, _ in entries:
        size = int(np.prod(shape)) * (4 if dt == "I32" else 2)
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + size]}
        off += size
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    rng = np.random.default_rng(0)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for k, (name, dt, shape, what) in enumerate(entries):
            if what == "packed":
                nib = rng.integers(0, 16, (shape[0], shape[1] * 8), dtype=np.uint32)  # fields: the integer + 8
                words = np.zeros((shape[0], shape[1]), np.uint32)
                for j in range(8):
                    words |= nib[:, j::8] << np.uint32(4 * j)
                f.write(words.tobytes())
            elif what == "scale":
                fan = shape[1] * 32
                v = (rng.random(shape, dtype=np.float32) + 0.5) / np.float32(4 * np.sqrt(fan))
                f.write((v.view(np.uint32) >> 16).astype(np.uint16).tobytes())
            elif what == "shape":
                f.write(np.array(shapes[name[:-len("_shape")]], np.int32).tobytes())  # (module.weight's shape)
            else:
                if name.endswith("norm.weight"):
                    v = np.ones(shape, np.float32)
                else:
                    v = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))
                f.write((v.view(np.uint32) >> 16).astype(np.uint16).tobytes())  # truncated to BF16
            if k % 200 == 0:
                print(f"\r  writing {k + 1}/{len(entries)} tensors", end="", file=sys.stderr, flush=True)
    print(f"\rwrote {out} ({off / 1e6:.0f} MB, {len(entries)} tensors{', INT4 experts' if int4 else ''})",
          file=sys.stderr)


def child(args) -> None:
    """One mode: load, count, time forwards; one JSON line on stdout."""
    import kdtree_native as kn

    opts = {}
    if args.legacy:
        if args.child == "off":
            opts = {"bf16_weight_copies": False}
    else:
        opts = {"bf16_weights": args.child}
    t0 = time.perf_counter()
    eng = kn.Engine.from_pretrained(args.dir, device="cpu", max_seq_len=max(args.sizes + [args.ttft]) + 200,
                                    cpu_options=opts)
    load_s = time.perf_counter() - t0
    peak_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    m = eng.model
    out = {"mode": args.child, "load_s": load_s, "peak_rss_after_load": peak_load, "memory_bytes": m.memory_bytes,
           "bf16_weight_bytes": m.bf16_weight_bytes, "fp32_weight_bytes": getattr(m, "fp32_weight_bytes", None),
           "forward_ms": {}}
    rng = np.random.default_rng(1)
    eng.prefill(rng.integers(0, eng.vocab_size, 100))
    for T in args.sizes:
        toks = rng.integers(0, eng.vocab_size, T)
        pos = np.arange(100, 100 + T)
        eng.forward(toks, pos)  # warm-up
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            eng.forward(toks, pos)
            ts.append(time.perf_counter() - t)
        out["forward_ms"][str(T)] = 1e3 * statistics.median(ts)
    # time to the first token: generate(prompt of --ttft tokens, 1) = a prefill (in 512-token chunks) + its choice
    if args.ttft:
        ids = rng.integers(0, eng.vocab_size, args.ttft)
        eng.generate(ids, 1)
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            eng.generate(ids, 1)
            ts.append(time.perf_counter() - t)
        out["ttft_ms"] = 1e3 * statistics.median(ts)
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", nargs="?", help="checkpoint directory (BF16)")
    ap.add_argument("--make", metavar="DIR", help="write the random mini-kimi BF16 checkpoint to DIR and exit")
    ap.add_argument("--int4", action="store_true", help="with --make: the routed experts INT4 (Kimi K2-Thinking's scheme)")
    ap.add_argument("--modes", nargs="+", default=None, help="default: only copies off (--legacy: copies off)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 17, 512], help="forward sizes T (default 1 17 512)")
    ap.add_argument("--reps", type=int, default=5, help="forwards timed per size and round (median)")
    ap.add_argument("--rounds", type=int, default=2, help="children per mode, modes interleaved")
    ap.add_argument("--ttft", type=int, default=0, metavar="P",
                    help="also time generate(P-token prompt, 1 new token): the time to the first token")
    ap.add_argument("--legacy", action="store_true", help="a build before bf16_weights")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make:
        make_checkpoint(args.make, args.int4)
        return 0
    if not args.dir:
        ap.error("give a checkpoint directory (or --make DIR)")
    if args.child:
        child(args)
        return 0
    modes = args.modes or (["copies", "off"] if args.legacy else ["only", "copies", "off"])
    results = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            cmd = [sys.executable, os.path.abspath(__file__), args.dir, "--child", mode, "--reps", str(args.reps),
                   "--sizes", *map(str, args.sizes), "--ttft", str(args.ttft)] + (["--legacy"] if args.legacy else [])
            print(f"  round {r + 1}/{args.rounds}: {mode} ...", file=sys.stderr, flush=True)
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                print(res.stderr, file=sys.stderr)
                return 1
            results[mode].append(json.loads(res.stdout.strip().splitlines()[-1]))
    gb = 1e9
    cols = ["mode", "peak RSS GB (load / end)", "load s", "memory_bytes GB", "BF16 GB", "FP32 GB"]
    cols += [f"T = {t} ms" for t in args.sizes] + ([f"first token after {args.ttft} ms"] if args.ttft else [])
    head = "| " + " | ".join(cols) + " |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for mode in modes:
        rs = results[mode]
        med = lambda key: statistics.median(x[key] for x in rs)  # noqa: E731
        fp32 = rs[0]["fp32_weight_bytes"]
        cells = [f"{med('peak_rss_after_load') / gb:.2f} / {med('peak_rss') / gb:.2f}", f"{med('load_s'):.2f}",
                 f"{rs[0]['memory_bytes'] / gb:.2f}", f"{rs[0]['bf16_weight_bytes'] / gb:.2f}",
                 "-" if fp32 is None else f"{fp32 / gb:.2f}"]
        cells += [" / ".join(f"{x['forward_ms'][str(t)]:.2f}" for x in rs) for t in args.sizes]
        if args.ttft:
            cells.append(" / ".join(f"{x['ttft_ms']:.1f}" for x in rs))
        print(f"| {mode} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
