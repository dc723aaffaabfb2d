"""Fuzzing the HF checkpoint / config.json loading path (checkpoint.py, config.py): a mutated
tiny checkpoint raises a clear ValueError / FileNotFoundError naming the file, the tensor or
the config field, never a bare TypeError / RecursionError / OverflowError, a hang, a
multi-gigabyte table, or weights that differ silently from what transformers loads."""
import json
import os
import struct
import threading
import time

import numpy as np
import pytest

import kdtree_native as kn
from kdtree_native.checkpoint import load_weights
from kdtree_native.config import config_from_dict, load_config

from hf_models import config_dict, random_weights
from test_engine_load import NAME, make_dir

NORM = "model.norm.weight"
IDX = "model.safetensors.index.json"


def read_st(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_st(path, header, payload):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + payload)


def load(root):
    return kn.Engine.from_pretrained(root, device="cpu", max_seq_len=16)


@pytest.fixture
def one(tmp_path):
    root, cfg, w = make_dir(str(tmp_path / "m"))
    return root, os.path.join(root, "model.safetensors"), cfg, w


# ---- safetensors header -------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["deep_array", "deep_object", "duplicate_name", "5000_digits"])
def test_bad_header_json_names_the_file(one, kind):
    """Nesting past Python's recursion limit (was RecursionError), a 5000-digit number (was
    int()'s digit-limit ValueError without the file), a tensor listed twice (the second entry
    silently won) are ValueErrors naming the file."""
    root, path, _, _ = one
    header, payload = read_st(path)
    if kind == "deep_array":
        raw = b"[" * 100000 + b"]" * 100000
    elif kind == "deep_object":
        raw = b'{"a":' * 100000 + b"1" + b"}" * 100000
    elif kind == "duplicate_name":   # a second NORM over the embedding's first bytes
        b = header["model.embed_tokens.weight"]["data_offsets"][0]
        dup = {"dtype": "F32", "shape": [48], "data_offsets": [b, b + 192]}
        raw = json.dumps(header).encode()[:-1] + b", " + json.dumps({NORM: dup})[1:-1].encode() + b"}"
    else:
        raw = json.dumps(header).encode().replace(b'"shape": [48]', b'"shape": [' + b"9" * 5000 + b"]", 1)
    write_st(path, raw, payload)
    match = {"duplicate_name": "'model.norm.weight' appears twice", "5000_digits": "4300 digits"}.get(kind, "nested")
    with pytest.raises(ValueError, match=rf"model\.safetensors: bad safetensors header: not valid JSON.*{match}"):
        load(root)
    assert load(make_dir(os.path.join(os.path.dirname(root), "ok"))[0]).prefill([1, 2]).shape == (2, 160)


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}, None, 7])
def test_dtype_of_the_wrong_type(one, dtype):
    """An unhashable dtype was a bare TypeError ('unhashable type: list') naming nothing."""
    root, path, _, _ = one
    header, payload = read_st(path)
    header[NORM]["dtype"] = dtype
    write_st(path, header, payload)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has unsupported dtype "
                                         r".*\(supported: F64, F32, F16, BF16"):
        load(root)


def test_overlapping_tensors_are_refused(one):
    """Two tensors over the same bytes used to load, one of them silently holding the other's
    data (the safetensors format forbids overlaps)."""
    root, path, _, _ = one
    header, payload = read_st(path)
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    write_st(path, header, payload)
    with pytest.raises(ValueError, match=rf"model\.safetensors: bad safetensors header: tensors '{a}' .* and '{b}' "
                                         r".* overlap"):
        load(root)
    # partial overlap with a bigger tensor; zero-sized tensors overlap nothing
    header, payload = read_st(path)
    header[b]["data_offsets"] = [header[a]["data_offsets"][0] + 4, header[a]["data_offsets"][1] + 4]
    write_st(path, header, payload)
    with pytest.raises(ValueError, match="overlap"):
        load(root)


def test_header_length_past_the_end_says_what_follows(one):
    root, path, _, _ = one
    data = open(path, "rb").read()
    open(path, "wb").write(struct.pack("<Q", len(data)) + data[8:])
    with pytest.raises(ValueError, match=rf"model\.safetensors: truncated safetensors file: the header length field "
                                         rf"says {len(data)} bytes of JSON, but only {len(data) - 8} bytes follow it"):
        load(root)


def add_tensor(path, name):
    header, payload = read_st(path)
    header[name] = {"dtype": "F32", "shape": [1], "data_offsets": [len(payload), len(payload) + 4]}
    write_st(path, header, payload + b"\0" * 4)


@pytest.mark.parametrize("name", ["model.layers.03.x", "model.layers.\u0663.x", "model.layers." + "9" * 5000 + ".x"])
def test_odd_layer_numbers_are_unexpected_tensors(one, name):
    """'03' and a non-ASCII digit were read as layer 3 and skipped silently as an MTP layer;
    a 5000-digit layer number raised int()'s digit-limit ValueError naming nothing."""
    root, path, _, _ = one
    add_tensor(path, name)
    with pytest.raises(ValueError, match=r"does not match the config:\n  unexpected \(1\): model\.layers\."):
        load(root)


def test_unprintable_tensor_name_in_a_message(one):
    """A lone surrogate in a name made the mismatch message unprintable (UnicodeEncodeError
    when the CLI or a log wrote it); it is shown as its repr."""
    root, path, _, _ = one
    raw_header, payload = read_st(path)
    raw = json.dumps(raw_header).encode()[:-1]
    raw += b', "\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [%d, %d]}}' % (len(payload), len(payload) + 4)
    write_st(path, raw, payload + b"\0" * 4)
    with pytest.raises(ValueError, match=r"unexpected \(1\): '\\ud800' \[1\]") as e:
        load(root)
    str(e.value).encode("utf-8")


def test_expert_count_past_the_checkpoint_is_reported_before_the_table(tmp_path):
    """n_routed_experts = 10**5 against an 8-expert checkpoint built the whole table of expected
    names first (10**8 took gigabytes and minutes, then MemoryError)."""
    root, _, _ = make_dir(str(tmp_path / "e"), cfg_overrides={"n_routed_experts": 10**5})
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"config\.json says n_routed_experts = 100000, but the checkpoint in .* holds "
                                         r"tensors of mlp\.experts\.0 \.\. 7 only"):
        load(root)
    assert time.perf_counter() - t < 5


# ---- which files ---------------------------------------------------------------------------

def test_single_file_wins_over_an_index_as_in_transformers(tmp_path):
    """transformers loads model.safetensors when a directory has it and an index
    (modeling_utils._get_resolved_checkpoint_files); the index used to win here, so the two
    loaded different weights from one directory."""
    cfg = config_from_dict(config_dict(NAME))
    root, _, shard_w = make_dir(str(tmp_path / "d"), shards=3, seed=1)
    single_root, _, single_w = make_dir(str(tmp_path / "s"), seed=2)
    os.replace(os.path.join(single_root, "model.safetensors"), os.path.join(root, "model.safetensors"))
    out = load_weights(root, cfg)
    for n, w in single_w.items():
        np.testing.assert_array_equal(out[n], np.float32(w))
    ids = np.arange(7) * 3 % cfg.vocab_size
    np.testing.assert_array_equal(load(root).prefill(ids),
                                  kn.Engine.from_weights(cfg, single_w, max_seq_len=16).prefill(ids))


@pytest.mark.parametrize("value, what", [(5, "5"), (None, "None"), (["a"], r"\['a'\]")])
def test_index_values_of_the_wrong_type(tmp_path, value, what):
    """A weight_map value that is no string was a bare TypeError from sorted() / set()."""
    root, _, _ = make_dir(str(tmp_path / "i"), shards=2)
    index = os.path.join(root, IDX)
    doc = json.load(open(index))
    doc["weight_map"][NORM] = value
    json.dump(doc, open(index, "w"))
    with pytest.raises(ValueError, match=rf"{IDX}: bad index file: weight_map\['model\.norm\.weight'\] is {what}, "
                                         "not a shard file name"):
        load(root)


@pytest.mark.parametrize("content, match", [
    (b'{"weight_map":' + b"[" * 100000 + b"]" * 100000 + b"}", r"not valid JSON \(nested too deeply\)"),
    (bytes(range(128, 256)), r"not valid JSON \('utf-8' codec"),
    (b'{"metadata": {}}', "it must be a JSON object whose `weight_map` is an object"),
    (b"[1]", "it must be a JSON object whose `weight_map` is an object"),
])
def test_bad_index_file_names_the_index(tmp_path, content, match):
    """A deeply nested index was a RecursionError, a non-UTF-8 one a UnicodeDecodeError without
    the file; no weight_map said `bad index file ('weight_map')`."""
    root, _, _ = make_dir(str(tmp_path / "i"), shards=2)
    open(os.path.join(root, IDX), "wb").write(content)
    with pytest.raises(ValueError, match=rf"{IDX}: bad index file: {match}"):
        load(root)


def test_checkpoint_paths_that_are_not_regular_files(tmp_path):
    """A directory (or FIFO, device, broken link) named model.safetensors was reported as no
    model.safetensors at all; a shard that is a directory as a missing shard."""
    root, _, _ = make_dir(str(tmp_path / "d"))
    path = os.path.join(root, "model.safetensors")
    os.remove(path)
    os.mkdir(path)
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors is not a regular file"):
        load(root)
    root, _, _ = make_dir(str(tmp_path / "s"), shards=2)
    shard = os.path.join(root, "model-00002-of-00002.safetensors")
    os.remove(shard)
    os.mkdir(shard)
    with pytest.raises(ValueError, match=r"shard 'model-00002-of-00002\.safetensors' is not a regular file"):
        load(root)


# ---- config.json ---------------------------------------------------------------------------

def test_config_json_fifo_is_refused_without_blocking(tmp_path):
    """config.json as a FIFO blocked the open() forever (a device such as /dev/zero was read
    until MemoryError). A helper thread feeds the FIFO if anything opens it for reading, so the
    old behaviour fails this test instead of hanging it."""
    root, _, _ = make_dir(str(tmp_path / "f"))
    cfg_path = os.path.join(root, "config.json")
    os.remove(cfg_path)
    os.mkfifo(cfg_path)
    stop = threading.Event()

    def feeder():
        while not stop.is_set():
            try:
                fd = os.open(cfg_path, os.O_WRONLY | os.O_NONBLOCK)   # ENXIO while no reader
            except OSError:
                time.sleep(0.02)
                continue
            os.write(fd, json.dumps(config_dict(NAME)).encode())
            os.close(fd)
            return

    th = threading.Thread(target=feeder, daemon=True)
    th.start()
    try:
        with pytest.raises(ValueError, match=r"config\.json: not a regular file"):
            load_config(root)
    finally:
        stop.set()
        th.join(5)


def test_config_json_directory_deep_or_oversized(tmp_path):
    root, _, _ = make_dir(str(tmp_path / "c"))
    cfg_path = os.path.join(root, "config.json")
    os.remove(cfg_path)
    os.mkdir(cfg_path)   # was IsADirectoryError, not the documented ValueError
    with pytest.raises(ValueError, match=r"config\.json: not a regular file"):
        load(root)
    os.rmdir(cfg_path)
    open(cfg_path, "w").write("[" * 100000 + "]" * 100000)   # was RecursionError
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON: nested too deeply"):
        load(root)
    with open(cfg_path, "w") as f:   # 17 MiB: refused before reading
        f.write(json.dumps(config_dict(NAME)) + " " * (17 << 20))
    with pytest.raises(ValueError, match=r"config\.json: \d+ bytes, more than the 16777216"):
        load(root)
    os.remove(cfg_path)
    os.symlink("config.json", cfg_path)   # a loop: was a bare OSError
    with pytest.raises(ValueError, match=r"config\.json: cannot read the config"):
        load(root)


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


@pytest.mark.parametrize("overrides, match", [
    # not an object: ValueError / TypeError from dict() ("dictionary update sequence ...")
    ({"rope_scaling": "yarn"}, r"`rope_scaling`/`rope_parameters` must be an object"),
    ({"rope_scaling": [1, 2]}, r"`rope_scaling`/`rope_parameters` must be an object"),
    ({"rope_scaling": 5}, r"`rope_scaling`/`rope_parameters` must be an object"),
    ({"rope_scaling": True}, r"`rope_scaling`/`rope_parameters` must be an object"),
    # loaded: every inverse frequency 0, no rotation at all
    ({"rope_theta": float("inf")}, r"`rope_theta` must be a finite positive number, got inf"),
    # float32 underflow: the native model's "rope_inv_freq has a non-finite entry" naming no field
    ({"rope_theta": 1e-300}, r"`rope_theta` = 1e-300: gives non-finite RoPE"),
    # ZeroDivisionError (log(1) in YaRN's correction range)
    ({"rope_theta": 1.0, "rope_scaling": YARN}, r"`rope_theta` = 1.0: YaRN needs rope_theta > 1"),
    # the native model's "rope_attention_factor must be finite"
    ({"rope_scaling": dict(YARN, factor=float("inf"))}, r"`rope_scaling\.factor` = inf"),
    # loaded, with a float32 overflow warning (factor inf in float32)
    ({"rope_scaling": dict(YARN, factor=1e308)}, r"`rope_scaling\.factor` = 1e\+308"),
    # OverflowError: cannot convert float infinity to integer
    ({"rope_scaling": dict(YARN, original_max_position_embeddings=float("inf"))},
     r"`rope_scaling\.original_max_position_embeddings` = inf"),
    # ValueError: math domain error
    ({"rope_scaling": dict(YARN, beta_fast=-1, beta_slow=-5)}, r"`rope_scaling\.beta_fast` = -1"),
    # loaded, "no" taken as true
    ({"rope_scaling": dict(YARN, truncate="no")}, r"`rope_scaling\.truncate` = 'no': must be true/false"),
    # the native model's "softmax_scale must be a finite number > 0"
    ({"rope_scaling": dict(YARN, mscale=1e308, mscale_all_dim=1e308)}, r"`rope_scaling\.mscale_all_dim` = 1e\+308"),
    # int() of these: ValueError / OverflowError / TypeError naming nothing; -3 and 1.5 (-> 1) taken
    ({"num_nextn_predict_layers": "x"}, r"`num_nextn_predict_layers` must be an integer, got 'x'"),
    ({"num_nextn_predict_layers": float("inf")}, r"`num_nextn_predict_layers` must be an integer, got inf"),
    ({"num_nextn_predict_layers": [1]}, r"`num_nextn_predict_layers` must be an integer, got \[1\]"),
    ({"num_nextn_predict_layers": 1.5}, r"`num_nextn_predict_layers` must be an integer, got 1.5"),
    ({"num_nextn_predict_layers": -3}, r"`num_nextn_predict_layers` must be >= 0, got -3"),
    # taken as they are (the CLI's --eos then stops at "x")
    ({"bos_token_id": "0"}, r"`bos_token_id` must be an integer or null, got '0'"),
    ({"eos_token_id": [1, "x"]}, r"`eos_token_id` must be an integer, a list of integers or null"),
    ({"eos_token_id": True}, r"`eos_token_id` must be an integer"),
    # taken as the default false; transformers refuses it (bool, not Optional)
    ({"tie_word_embeddings": None}, r"`tie_word_embeddings` must be true/false, got None"),
    # past int64 / int32: pybind's "Unable to cast Python instance" or std::bad_alloc in from_weights
    ({"vocab_size": 10**400}, r"`vocab_size` must be <= 2\*\*31 - 1, got a 401-digit number"),
    ({"vocab_size": 10**12}, r"`vocab_size` must be <= 2\*\*31 - 1, got 1000000000000"),
    ({"hidden_size": 2**62}, r"`hidden_size` must be <= 2\*\*31 - 1"),
    ({"max_position_embeddings": 10**18}, r"`max_position_embeddings` must be <= 2\*\*31 - 1"),
])
def test_config_values_are_checked(tmp_path, overrides, match):
    d = config_dict(NAME)
    d.update(overrides)
    with pytest.raises(ValueError, match=match):
        config_from_dict(d)
    root, _, _ = make_dir(str(tmp_path / "c"), cfg_overrides=overrides)
    with pytest.raises(ValueError, match=match):
        load(root)


def test_config_int_fields_accept_up_to_int32_and_exact_floats():
    d = config_dict(NAME)
    d.update(max_position_embeddings=2**31 - 1, vocab_size=160.0, num_nextn_predict_layers=None)
    cfg = config_from_dict(d)
    assert cfg.max_position_embeddings == 2**31 - 1 and cfg.vocab_size == 160 and cfg.num_nextn_predict_layers == 0


def test_null_switches_are_false_as_in_transformers(tmp_path):
    """HF annotates norm_topk_prob / rope_interleave `bool | None` and tests them by truth
    (`if self.norm_topk_prob:`), so null means false; it was read as the default true here, and
    the logits differed from transformers' for the same directory."""
    over = {"norm_topk_prob": None, "rope_interleave": None}
    cfg = config_from_dict(dict(config_dict(NAME), **over))
    assert cfg.norm_topk_prob is False and cfg.rope_interleave is False
    w = random_weights(cfg, 3)
    root, _, _ = make_dir(str(tmp_path / "n"), weights=w, cfg_overrides=over)
    ids = np.arange(12) * 11 % cfg.vocab_size
    got = load(root).prefill(ids)
    false = config_from_dict(dict(config_dict(NAME), norm_topk_prob=False, rope_interleave=False))
    true = config_from_dict(config_dict(NAME))
    np.testing.assert_array_equal(got, kn.Engine.from_weights(false, w, max_seq_len=16).prefill(ids))
    assert not np.allclose(got, kn.Engine.from_weights(true, w, max_seq_len=16).prefill(ids))


@pytest.mark.hf
def test_null_switches_match_transformers_logits():
    from hf_models import cached_checkpoint, hf_logits, require_hf
    require_hf()
    path = cached_checkpoint({"norm_topk_prob": None, "rope_interleave": None}, seed=4)
    assert json.load(open(os.path.join(path, "config.json")))["norm_topk_prob"] is None
    ids = np.arange(10) * 13 % 160
    np.testing.assert_allclose(load(path).prefill(ids), hf_logits(path, ids), rtol=1e-4, atol=1e-4)
