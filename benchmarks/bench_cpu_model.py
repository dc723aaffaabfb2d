"""CPU target model: prefill and decode tokens/s of kn.Engine (C++ CPU backend) against HF
transformers (torch CPU, eager, fp32) on the same random checkpoint, in the same run.

    python benchmarks/bench_cpu_model.py                        # default small config
    python benchmarks/bench_cpu_model.py --prefill 128 --decode 64 --repeats 5 \
        --json out.json --append-md docs/BENCHMARKS.md

Prefill: one forward over P prompt tokens (engine: causal forward + commit; HF: model(ids,
use_cache=True)). Decode: D greedy tokens one at a time against the cache (engine: T=1
forward + commit; HF: past_key_values). Median of --repeats runs after one warm-up each.
The default config (hidden 256, 4 layers, 16 routed experts top-4 + 1 shared, vocab 4096) is
small enough for a laptop CPU; --config takes JSON overrides of it.
"""
import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))

import kdtree_native as kn  # noqa: E402
from kdtree_native import _native  # noqa: E402

SMALL = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16,
    n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
    q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    max_position_embeddings=4096,
)


def median_time(fn, repeats):
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_engine(path, ids, n_decode, repeats, max_seq_len):
    eng = kn.Engine.from_pretrained(path, device="cpu", max_seq_len=max_seq_len)
    t_prefill = median_time(lambda: eng.prefill(ids), repeats)

    def decode():
        logits = eng.prefill(ids)
        tok = int(np.argmax(logits[-1]))
        t0 = time.perf_counter()
        for _ in range(n_decode):
            tok = int(np.argmax(eng.decode(tok)))
        return time.perf_counter() - t0

    decode()
    t_decode = statistics.median(decode() for _ in range(repeats))
    return t_prefill, t_decode


def bench_hf(path, ids, n_decode, repeats):
    import torch
    from hf_models import hf_model

    model = hf_model(path)
    x = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]

    def prefill():
        with torch.no_grad():
            return model(x, use_cache=True)

    t_prefill = median_time(prefill, repeats)

    # transformers >= 5.x names the cache argument `cache` (past_key_values is deprecated)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def decode():
        with torch.no_grad():
            out = model(x, use_cache=True)
            cache = getattr(out, cache_kw)
            tok = out.logits[0, -1].argmax().view(1, 1)
            t0 = time.perf_counter()
            for _ in range(n_decode):
                out = model(tok, use_cache=True, **{cache_kw: cache})
                cache = getattr(out, cache_kw)
                tok = out.logits[0, -1].argmax().view(1, 1)
            return time.perf_counter() - t0

    decode()
    t_decode = statistics.median(decode() for _ in range(repeats))
    return t_prefill, t_decode, torch.__version__, torch.get_num_threads()


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=128, help="prompt tokens")
    ap.add_argument("--decode", type=int, default=64, help="decoded tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--config", default="{}", help="JSON overrides of the small config")
    ap.add_argument("--portable", action="store_true", help="measure the engine on the portable SGEMM only")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--append-md", default=None, help="append a markdown section to this file")
    args = ap.parse_args()

    from hf_models import make_checkpoint

    cfg = dict(SMALL, **json.loads(args.config))
    with tempfile.TemporaryDirectory(prefix="kn_bench_cpu_") as tmp:
        return run(args, cfg, make_checkpoint(os.path.join(tmp, "ckpt"), cfg, seed=0))


def run(args, cfg, path):
    ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], args.prefill)
    max_seq_len = args.prefill + args.decode + 8
    rows = []
    if not args.portable:
        e_pre, e_dec = bench_engine(path, ids, args.decode, args.repeats, max_seq_len)
        rows.append((f"kdtree-native CPU, SGEMM {_native.sgemm_backend()}", e_pre, e_dec))
    if args.portable or _native.sgemm_backend() != "portable":
        # the portable kernel too (forced in a CBLAS build)
        _native.sgemm_force_portable(True)
        p_pre, p_dec = bench_engine(path, ids, args.decode, args.repeats, max_seq_len)
        _native.sgemm_force_portable(False)
        rows.append(("kdtree-native CPU, SGEMM portable" + ("" if args.portable else " (forced)"), p_pre, p_dec))
        if args.portable:
            e_pre, e_dec = p_pre, p_dec
    hf_info = None
    if not args.no_hf:
        h_pre, h_dec, torch_version, torch_threads = bench_hf(path, ids, args.decode, args.repeats)
        rows.append((f"HF transformers {__import__('transformers').__version__} (torch {torch_version} CPU, "
                     f"{torch_threads} threads, eager fp32)", h_pre, h_dec))
        hf_info = dict(prefill_s=h_pre, decode_s=h_dec, torch=torch_version, threads=torch_threads)

    machine = f"{cpu_name()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.machine()}"
    cfg_line = (f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers "
                f"({cfg['first_k_dense_replace']} dense), {cfg['num_attention_heads']} heads, "
                f"kv_lora {cfg['kv_lora_rank']}, q_lora {cfg['q_lora_rank']}, "
                f"{cfg['n_routed_experts']} experts top-{cfg['num_experts_per_tok']} + {cfg['n_shared_experts']} shared "
                f"(moe_intermediate {cfg['moe_intermediate_size']}), vocab {cfg['vocab_size']}")
    header = f"| backend | prefill {args.prefill} tok (tok/s) | decode {args.decode} tok (tok/s) |"
    lines = [header, "|---|---:|---:|"]
    for name, pre, dec in rows:
        lines.append(f"| {name} | {args.prefill / pre:,.0f} ({pre * 1e3:.1f} ms) | "
                     f"{args.decode / dec:,.0f} ({dec / args.decode * 1e3:.2f} ms/tok) |")
    if hf_info:
        lines.append(f"| speed-up of `{rows[0][0]}` over HF | {h_pre / e_pre:.2f}x | {h_dec / e_dec:.2f}x |")
    table = "\n".join(lines)
    print(f"config: {cfg_line}")
    print(f"machine: {machine}")
    print(table)

    result = dict(config=cfg, machine=machine, prefill_tokens=args.prefill, decode_tokens=args.decode,
                  repeats=args.repeats, build=kn.build_info(), hf=hf_info,
                  engine=[dict(name=n, prefill_s=p, decode_s=d) for n, p, d in rows if not n.startswith("HF")])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if args.append_md:
        cmd = "python benchmarks/bench_cpu_model.py " + " ".join(sys.argv[1:])
        with open(args.append_md, "a") as f:
            f.write(f"\n## CPU target model: prefill / decode vs HF transformers\n\n"
                    f"Command: `{cmd.strip()}`  \n"
                    f"Machine: {machine}; kdtree-native {kn.__version__}, SGEMM {kn.build_info()['cpu_blas']}  \n"
                    f"Config: {cfg_line}; random weights, fp32, median of {args.repeats} runs after a warm-up.\n\n"
                    f"{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
