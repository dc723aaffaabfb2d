"""Golden data for tests/cpp/test_cpu_model.cpp: tiny DeepSeek-V3 models (random weights) with
the NumPy reference's logits for a prefill, a tree verify, a compaction and a decode.

One KDTR file per config, model_<name>.kdtr. The C++ test has no JSON parser, so the config
travels as tensors: `cfg.<field>` int64 / float64 scalars (ModelConfig.to_native() numbers),
`cfg.rope_inv_freq` float32 [R/2]. Weights: `w.<HF name>` float32. The script, replayed by the
test in this order:
  1. prefill:  tokens `prefill.tokens` [P], positions 0..P-1, causal; commit all
               -> `prefill.logits` float32 [P, V]
  2. verify:   `tree.tokens` [n], `tree.positions` [n], `tree.visibility` uint8 [n, n]
               -> `tree.logits` [n, V];  commit `tree.keep` (a root-to-leaf path)
  3. decode:   `decode.token` [1] at position cache_len -> `decode.logits` [1, V]; commit
The metadata names the config and the fields for humans. Needs numpy only (no torch).
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

CONFIGS = ["ds3_base", "neox_many_groups"]


def _tree(n, rng):
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    depth = [0] * n
    vis = np.zeros((n, n), dtype=np.uint8)
    for i in range(n):
        j = i
        while j >= 0:
            vis[i, j] = 1
            j = parents[j]
        depth[i] = 0 if i == 0 else depth[parents[i]] + 1
    leaf = int(np.argmax(depth))
    path, j = [], leaf
    while j >= 0:
        path.append(j)
        j = parents[j]
    return np.array(depth, dtype=np.int64), vis, np.array(path[::-1], dtype=np.int32)


def generate(out_dir):
    import kdtree_native as kn
    from hf_models import config_dict, random_weights
    from kdtree_native.config import config_from_dict
    from kdtree_native.reference import ReferenceModel

    for k, name in enumerate(CONFIGS):
        cfg = config_from_dict(config_dict(name))
        weights = random_weights(cfg, seed=100 + k)
        rng = np.random.default_rng(200 + k)
        arrays = {}
        native = cfg.to_native()
        for key, v in native.items():
            if key == "rope_inv_freq":
                arrays["cfg.rope_inv_freq"] = np.asarray(v, dtype=np.float32)
            elif isinstance(v, bool) or isinstance(v, int):
                arrays[f"cfg.{key}"] = np.asarray(int(v), dtype=np.int64)
            else:
                arrays[f"cfg.{key}"] = np.asarray(float(v), dtype=np.float64)
        for wname, w in weights.items():
            arrays[f"w.{wname}"] = np.ascontiguousarray(w, dtype=np.float32)

        # Reference logits from the float32-rounded weights the engine will see.
        ref = ReferenceModel(cfg, {n: np.asarray(w, dtype=np.float32) for n, w in weights.items()})
        P = 13
        tokens = rng.integers(0, cfg.vocab_size, P)
        arrays["prefill.tokens"] = tokens.astype(np.int32)
        arrays["prefill.logits"] = ref.forward(tokens, np.arange(P)).astype(np.float32)
        n = 9
        depth, vis, keep = _tree(n, rng)
        ttoks = rng.integers(0, cfg.vocab_size, n)
        tpos = P + depth
        arrays["tree.tokens"] = ttoks.astype(np.int32)
        arrays["tree.positions"] = tpos.astype(np.int32)
        arrays["tree.visibility"] = vis
        arrays["tree.logits"] = ref.forward(ttoks, tpos, vis.astype(bool)).astype(np.float32)
        arrays["tree.keep"] = keep
        ref.compact(keep)
        dtok = rng.integers(0, cfg.vocab_size, 1)
        arrays["decode.token"] = dtok.astype(np.int32)
        arrays["decode.logits"] = ref.forward(dtok, [ref.cache_len]).astype(np.float32)
        kn.save_kdtr(os.path.join(out_dir, f"model_{name}.kdtr"), arrays,
                     metadata={"config": name, "hf_config": config_dict(name),
                               "fields": sorted(native), "generator": "tests/golden/golden_model.py"})
    with open(os.path.join(out_dir, "model_configs.txt"), "w") as f:
        f.write("\n".join(CONFIGS) + "\n")


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "golden"
    os.makedirs(out, exist_ok=True)
    generate(out)
