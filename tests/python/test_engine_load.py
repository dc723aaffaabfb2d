"""kn.Engine.from_pretrained on checkpoint directories written here with a tiny safetensors
writer (no torch): good ones (F32, BF16, sharded) load and match the in-memory engine; bad
ones (missing / unexpected / mis-shaped tensor, truncated file, bad JSON header, unsupported
or broken config, wrong arguments) raise clear exceptions."""
import json
import os
import struct

import numpy as np
import pytest

import kdtree_native as kn
from kdtree_native.config import config_from_dict

from hf_models import config_dict, random_weights, to_bf16

NAME = "ds3_base"


def write_safetensors(path, tensors, dtype="F32"):
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        a = np.ascontiguousarray(arr, dtype=np.float32)
        raw = (a.view(np.uint32) >> 16).astype("<u2") if dtype == "BF16" else a.astype("<f4")
        b = raw.tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def make_dir(root, name=NAME, weights=None, cfg_overrides=None, dtype="F32", shards=1, seed=0):
    d = config_dict(name)
    d.update(cfg_overrides or {})
    cfg = config_from_dict(config_dict(name))
    w = random_weights(cfg, seed) if weights is None else weights
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(d, f)
    if shards == 1:
        write_safetensors(os.path.join(root, "model.safetensors"), w, dtype)
    else:
        names = list(w)
        weight_map = {}
        for s in range(shards):
            fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: w[n] for n in names[s::shards]}
            write_safetensors(os.path.join(root, fn), part, dtype)
            weight_map.update({n: fn for n in part})
        with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return root, cfg, w


def test_good_checkpoint_loads_and_matches_in_memory_engine(tmp_path):
    root, cfg, w = make_dir(str(tmp_path / "ok"))
    seen = []
    eng = kn.Engine.from_pretrained(root, device="cpu", max_seq_len=64, progress=lambda d, t: seen.append((d, t)))
    assert eng.device == "cpu" and eng.max_seq_len == 64 and eng.config.hidden_size == cfg.hidden_size
    assert seen and seen[-1][0] == seen[-1][1] == len(w)
    ids = np.arange(11) * 7 % cfg.vocab_size
    logits = eng.prefill(ids)
    assert logits.dtype == np.float32 and logits.shape == (11, cfg.vocab_size)
    assert np.isfinite(logits).all() and eng.cache_len == 11
    ref = kn.Engine.from_weights(cfg, w, max_seq_len=64).prefill(ids)
    np.testing.assert_array_equal(logits, ref)
    assert "cache_len=11" in repr(eng)
    auto = kn.Engine.from_pretrained(root, device="auto", max_seq_len=64)
    assert auto.device in ("cpu", "cuda")


def test_bf16_and_sharded_checkpoints(tmp_path):
    cfg = config_from_dict(config_dict(NAME))
    w = random_weights(cfg, 1)
    ids = np.arange(9) * 5 % cfg.vocab_size
    root, _, _ = make_dir(str(tmp_path / "bf16"), weights=w, dtype="BF16")
    bf = kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32).prefill(ids)
    w_bf = {n: ((np.asarray(a, np.float32).view(np.uint32) >> 16) << 16).view(np.float32) for n, a in w.items()}
    np.testing.assert_array_equal(bf, kn.Engine.from_weights(cfg, w_bf, max_seq_len=32).prefill(ids))
    root, _, _ = make_dir(str(tmp_path / "sharded"), weights=w, shards=3)
    sh = kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32).prefill(ids)
    np.testing.assert_array_equal(sh, kn.Engine.from_weights(cfg, w, max_seq_len=32).prefill(ids))


def test_missing_tensor(tmp_path):
    cfg = config_from_dict(config_dict(NAME))
    w = random_weights(cfg, 0)
    del w["model.layers.1.mlp.experts.5.down_proj.weight"]
    root, _, _ = make_dir(str(tmp_path / "m"), weights=w)
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight"):
        kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)
    with pytest.raises(ValueError, match=r"missing.*experts\.5\.down_proj"):
        kn.Engine.from_weights(cfg, w, max_seq_len=32)
    # checked before the model is built: a config whose buffers are huge (the embedding alone
    # 2**31 - 1 rows here, ~1 TB) with no weights is a missing-weights error, not an allocation
    big = config_from_dict({**config_dict(NAME), "vocab_size": 2**31 - 1})
    with pytest.raises(ValueError, match=r"weight tensor\(s\) missing"):
        kn.Engine.from_weights(big, {}, max_seq_len=32)


def test_config_layers_past_the_checkpoint_and_broken_config_values(tmp_path):
    """A config naming more layers than the checkpoint has is reported at once (10**9 layers used
    to build a table of every expected name first: minutes and gigabytes); non-finite or binary
    config values are ValueErrors naming the field or the file."""
    cfg = config_from_dict(config_dict(NAME))
    root, _, _ = make_dir(str(tmp_path / "l"), cfg_overrides={"num_hidden_layers": 10**9})
    with pytest.raises(ValueError, match=r"num_hidden_layers = 1000000000, but the checkpoint .* holds tensors of "
                                         rf"model\.layers\.0 \.\. {cfg.num_hidden_layers - 1} only"):
        kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)
    root, _, _ = make_dir(str(tmp_path / "l1"), cfg_overrides={"num_hidden_layers": cfg.num_hidden_layers + 1})
    with pytest.raises(ValueError, match=rf"num_hidden_layers = {cfg.num_hidden_layers + 1}, but"):
        kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)
    for key, val in (("vocab_size", float("inf")), ("hidden_size", float("nan"))):
        d = config_dict(NAME)
        d[key] = val
        with open(tmp_path / "l" / "config.json", "w") as f:
            f.write(json.dumps(d))  # (Infinity / NaN: Python's json writes and reads them)
        with pytest.raises(ValueError, match=rf"config field `{key}` must be an integer"):
            kn.Engine.from_pretrained(str(tmp_path / "l"), device="cpu", max_seq_len=32)
    with open(tmp_path / "l" / "config.json", "wb") as f:
        f.write(bytes(range(128, 256)))
    with pytest.raises(ValueError, match="not valid JSON"):
        kn.Engine.from_pretrained(str(tmp_path / "l"), device="cpu", max_seq_len=32)


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_non_finite_weight_in_a_checkpoint(tmp_path, dtype):
    cfg = config_from_dict(config_dict(NAME))
    w = random_weights(cfg, 0)
    w["model.norm.weight"] = np.asarray(w["model.norm.weight"], np.float32).copy()
    w["model.norm.weight"][7] = np.inf
    root, _, _ = make_dir(str(tmp_path / "n"), weights=w, dtype=dtype)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' holds an infinity at flat index 7"):
        kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)
    eng = kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32, check_finite=False)
    assert not np.isfinite(eng.prefill([1, 2, 3])).all()


def test_wrong_shape_and_unexpected_tensor(tmp_path):
    cfg = config_from_dict(config_dict(NAME))
    w = random_weights(cfg, 0)
    w["model.layers.0.self_attn.kv_b_proj.weight"] = w["model.layers.0.self_attn.kv_b_proj.weight"][:-1]
    root, _, _ = make_dir(str(tmp_path / "s"), weights=w)
    with pytest.raises(ValueError, match=r"kv_b_proj\.weight.*shape"):
        kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)
    with pytest.raises(ValueError, match=r"kv_b_proj\.weight.*shape"):
        kn.Engine.from_weights(cfg, w, max_seq_len=32)
    w = random_weights(cfg, 0)
    w["model.layers.0.mlp.experts.0.up_proj.weight"] = np.zeros((24, 48))
    root, _, _ = make_dir(str(tmp_path / "u"), weights=w)
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.mlp\.experts\.0\.up_proj\.weight"):
        kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)


def test_truncated_safetensors(tmp_path):
    root, _, _ = make_dir(str(tmp_path / "t"))
    path = os.path.join(root, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError, match="truncated"):
        kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)
    with open(path, "r+b") as f:
        f.truncate(5)
    with pytest.raises(ValueError, match="truncated"):
        kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)


def test_bad_json_header(tmp_path):
    root, _, _ = make_dir(str(tmp_path / "j"))
    path = os.path.join(root, "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"{not json")
    with pytest.raises(ValueError, match="JSON"):
        kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))   # absurd header length
    with pytest.raises(ValueError, match="header"):
        kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)


@pytest.mark.parametrize("overrides, field", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, "quantization_config"),
    ({"model_type": "llama"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"n_group": 3}, "n_group"),
    ({"hidden_size": "big"}, "hidden_size"),
])
def test_unsupported_config(tmp_path, overrides, field):
    root, _, _ = make_dir(str(tmp_path / "c"), cfg_overrides=overrides)
    with pytest.raises(ValueError, match=field):
        kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)


def test_missing_or_broken_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        kn.Engine.from_pretrained(str(tmp_path / "nope"), device="cpu")
    root, _, _ = make_dir(str(tmp_path / "x"))
    os.remove(os.path.join(root, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)
    with open(os.path.join(root, "config.json"), "w") as f:
        f.write("{broken")
    with pytest.raises(ValueError, match="JSON"):
        kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)
    os.remove(os.path.join(root, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)


def test_bad_arguments(tmp_path):
    root, cfg, _ = make_dir(str(tmp_path / "a"))
    for bad in (0, -5, 2.5, "4096", True):
        with pytest.raises(ValueError, match="max_seq_len"):
            kn.Engine.from_pretrained(root, device="cpu", max_seq_len=bad)
    with pytest.raises(ValueError, match="device"):
        kn.Engine.from_pretrained(root, device="tpu")
    if not (hasattr(kn._native, "CudaModel") and kn.cuda_available()):
        with pytest.raises((NotImplementedError, RuntimeError), match="cuda|CUDA"):
            kn.Engine.from_pretrained(root, device="cuda")
    eng = kn.Engine.from_pretrained(root, device="cpu", max_seq_len=16)
    with pytest.raises(ValueError, match="empty"):
        eng.prefill([])
    with pytest.raises(ValueError, match="1-D"):
        eng.prefill(np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match="integers"):
        eng.prefill(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.prefill(np.zeros(17, np.int64))
    with pytest.raises(ValueError, match="vocab|outside"):
        eng.prefill([cfg.vocab_size])
    assert eng.prefill([1, 2, 3]).shape == (3, cfg.vocab_size)


def check_bad_options(root, cfg, w, kwarg, a_name):
    """An unknown name and a non-dict under `kwarg` are ValueErrors in both constructors."""
    for bad, what in (({"threads": 4}, f"unknown {kwarg}"), ([(a_name, False)], "dict")):
        with pytest.raises(ValueError, match=what):
            kn.Engine.from_pretrained(root, device="cpu", **{kwarg: bad})
        with pytest.raises(ValueError, match=what):
            kn.Engine.from_weights(cfg, w, device="cpu", **{kwarg: bad})


def test_cuda_options_are_checked_and_ignored_on_the_cpu(tmp_path):
    root, cfg, w = make_dir(str(tmp_path / "o"))
    check_bad_options(root, cfg, w, "cuda_options", "graphs")
    opts = {"graphs": False, "skinny_max_tokens": 0, "max_tokens": 17, "device": 0, "attention_kernel": "splitkv",
            "side_stream": False, "skinny_big_max_tokens": 4, "tile_max_tokens": 0}
    eng = kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32, cuda_options=opts)
    assert eng.device == "cpu"
    ref = kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=32, cuda_options=None)
    ids = np.arange(9) * 5 % cfg.vocab_size
    np.testing.assert_array_equal(eng.prefill(ids), ref.prefill(ids))


def test_cuda_options_name_the_gpu_models_keyword_arguments():
    """Every name the engine passes through (engine._CUDA_OPTIONS) is a keyword argument of
    _native.CudaModel (its pybind11 signature), so a documented option never fails at load."""
    from kdtree_native import _native
    from kdtree_native.engine import _CUDA_OPTIONS
    if not hasattr(_native, "CudaModel"):
        pytest.skip("GPU model not built")
    sig = _native.CudaModel.__init__.__doc__
    for name in _CUDA_OPTIONS:
        assert f" {name}: " in sig, name


def test_cpu_options_are_checked_and_reach_the_cpu_model(tmp_path):
    """cpu_options: unknown names / non-dicts are a ValueError; bf16_weight_copies=False reaches
    _native.CpuModel before finalize (no copies are made, the logits are the same), as does each
    bf16_weights mode (a name outside them or a non-string is a ValueError); every name
    the engine passes through is a keyword argument of _native.CpuModel."""
    from kdtree_native import _native
    from kdtree_native.engine import _CPU_OPTIONS
    root, cfg, w = make_dir(str(tmp_path / "c"))
    check_bad_options(root, cfg, w, "cpu_options", "bf16_weight_copies")
    bf = {k: to_bf16(v) for k, v in w.items()}
    on = kn.Engine.from_weights(cfg, bf, device="cpu", max_seq_len=32)
    off = kn.Engine.from_weights(cfg, bf, device="cpu", max_seq_len=32, cpu_options={"bf16_weight_copies": False})
    assert on.model.bf16_weight_bytes > 0 and off.model.bf16_weight_bytes == 0
    ids = np.arange(9) * 5 % cfg.vocab_size
    np.testing.assert_array_equal(on.prefill(ids), off.prefill(ids))
    sig = _native.CpuModel.__init__.__doc__
    for name in _CPU_OPTIONS:
        assert f" {name}: " in sig, name
    for bad in ("no", 3.5, [1], 1):  # a value of the wrong type: named, not pybind's signature dump (or taken)
        with pytest.raises(ValueError, match=r"cpu_options: bf16_weight_copies must be True or False"):
            kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=32, cpu_options={"bf16_weight_copies": bad})
    for mode in ("only", "copies", "off"):
        m = kn.Engine.from_weights(cfg, bf, device="cpu", max_seq_len=32, cpu_options={"bf16_weights": mode}).model
        assert m.bf16_weights == mode
    with pytest.raises(ValueError, match=r"bf16_weights must be 'only', 'copies' or 'off', got 'half'"):
        kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=32, cpu_options={"bf16_weights": "half"})
    with pytest.raises(ValueError, match=r"cpu_options: a value of the wrong type"):
        kn.Engine.from_weights(cfg, w, device="cpu", max_seq_len=32, cpu_options={"bf16_weights": 3})


def test_from_pretrained_holds_one_tensor_at_a_time(tmp_path, monkeypatch):
    """from_pretrained streams the checkpoint: each float32 tensor the loader hands out is gone (no
    reference left in Python) before the next one is read, so loading never holds the whole model as
    float32 beside the native one; the engine equals one built from the whole dict. A BF16 checkpoint
    ends up held as BF16 by the CPU model."""
    import gc
    import weakref

    from kdtree_native import checkpoint, engine

    root, cfg, w = make_dir(str(tmp_path / "bf"), dtype="BF16")
    alive, most = [], [0]

    def tracked(*args, **kwargs):
        it = checkpoint.iter_weights(*args, **kwargs)

        def gen():
            for name, arr in it:
                gc.collect()
                live = [r for r in alive if r() is not None]
                most[0] = max(most[0], len(live))
                alive.append(weakref.ref(arr))
                yield name, arr
                del arr

        return gen()

    monkeypatch.setattr(engine, "iter_weights", tracked)
    eng = kn.Engine.from_pretrained(root, device="cpu", max_seq_len=32)
    assert len(alive) == len(checkpoint.expected_weight_shapes(cfg))
    assert most[0] == 0, f"{most[0]} earlier tensors still alive when the next one was read"
    assert eng.model.bf16_weights == "only" and eng.model.fp32_weight_bytes == 0
    ref = kn.Engine.from_weights(cfg, checkpoint.load_weights(root, cfg), device="cpu", max_seq_len=32,
                                 cpu_options={"bf16_weights": "off"})
    ids = np.arange(9) * 7 % cfg.vocab_size
    np.testing.assert_array_equal(eng.prefill(ids), ref.prefill(ids))


def test_iter_weights_checks_the_checkpoint_before_reading(tmp_path):
    """iter_weights raises a bad checkpoint's ValueError at the call, before any tensor is read; the
    iterator it returns gives the tensors of load_weights, in the same order (with bf16_bits, a BF16
    tensor as its bits)."""
    from kdtree_native.checkpoint import iter_weights, load_weights

    root, cfg, w = make_dir(str(tmp_path / "ok"))
    got = list(iter_weights(root, cfg))
    ref = load_weights(root, cfg)
    assert [n for n, _ in got] == list(ref)
    for n, a in got:
        np.testing.assert_array_equal(a, ref[n])
    # bf16_bits: a BF16 tensor comes as its bits (a read-only view of the map), the same values widened
    broot, bcfg, _ = make_dir(str(tmp_path / "bf"), dtype="BF16")
    bref = load_weights(broot, bcfg)
    for n, a in iter_weights(broot, bcfg, bf16_bits=True):
        assert a.dtype == np.uint16 and not a.flags.writeable, n
        np.testing.assert_array_equal((a.astype(np.uint32) << 16).view(np.float32), bref[n])
    part = dict(w)
    part.pop("model.norm.weight")
    bad, cfg2, _ = make_dir(str(tmp_path / "bad"), weights=part)
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        iter_weights(bad, cfg2)
