"""HF checkpoint loading: safetensors (single file or sharded) -> {HF name: float32 ndarray}.

Where it sits: `Engine.from_pretrained` calls `iter_weights(dir, cfg)` (one tensor at a time, so
loading never holds the whole model as float32 in Python), `kn.reference` `load_weights(dir, cfg)`
(the same tensors as one dict).
No torch needed: the safetensors header (8-byte little-endian length + JSON) is parsed here and
each file is memory-mapped once. F32 tensors come back as zero-copy read-only views of the
map; BF16 / F16 are converted to float32 once (BF16 exactly, by a 16-bit shift; F16 exactly,
by numpy), or, asked for (`iter_weights(..., bf16_bits=True)`, what a CPU engine loads through), a
BF16 tensor comes as its bits, a zero-copy uint16 view. Every tensor is read at most once. With a quantization_config (quantization.py) a
quantized Linear's packed parts (`.weight_packed`, `.weight_scale`, ...) stand for its `.weight`,
which comes back dequantized to float32 exactly as compressed-tensors computes it for HF.

Names are the HF hub layout (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, ...), see
`expected_weight_shapes`. The MTP layers stored after the main ones
(`model.layers.{num_hidden_layers}.*` and up) are ignored, as HF does. Missing, unexpected or
mis-shaped tensors are reported together in one ValueError; a damaged file (truncated, bad
JSON header: not JSON, too deeply nested, a name listed twice; a dtype, shape or offsets of the
wrong type; offsets outside the file or overlapping another tensor's) raises ValueError naming
the file, the tensor and the problem. A directory holding both `model.safetensors` and an index
loads the single file, as transformers does.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import struct
from typing import Callable, Iterator, NamedTuple, Optional, Tuple

import numpy as np

from .config import ModelConfig
from .quantization import dequantize_fp8, dequantize_packed, int4_packable, packed_int4

__all__ = ["expected_weight_shapes", "iter_weights", "load_weights", "read_safetensors_header", "SafetensorsFile"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype -> (numpy dtype of the stored bytes, bytes per element)
_ST_DTYPES = {
    "F64": (np.dtype("<f8"), 8),
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),   # raw bits; widened to f32 below
    "I64": (np.dtype("<i8"), 8),
    "I32": (np.dtype("<i4"), 4),
    "I16": (np.dtype("<i2"), 2),
    "I8": (np.dtype("i1"), 1),
    "U8": (np.dtype("u1"), 1),
    "BOOL": (np.dtype("?"), 1),
    "F8_E4M3": (np.dtype("u1"), 1),  # raw bytes; only an FP8 checkpoint's weights (quantization.py)
}
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_MAX_HEADER = 100 * 1024 * 1024   # safetensors' own limit on the JSON header
# "model.layers.{i}." with i in plain ASCII decimal, no leading zero, at most 9 digits: any other
# spelling ("03", a non-ASCII digit, a 5000-digit number) is no layer of this model, so it is
# reported as an unexpected tensor instead of being skipped as an MTP layer (or overflowing int()).
_LAYER_RE = re.compile(r"^model\.layers\.(0|[1-9][0-9]{0,8})\.")
_EXPERT_RE = re.compile(r"^model\.layers\.(?:0|[1-9][0-9]{0,8})\.mlp\.experts\.(0|[1-9][0-9]{0,8})\.")


def _show(name: str) -> str:
    """A tensor name for a message: as is when printable, else its repr (a lone surrogate in a
    name would otherwise make the message itself unprintable)."""
    return name if name.isprintable() else repr(name)


def _no_duplicate_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} appears twice in one object")
        out[k] = v
    return out


def _parse_json(text, what: str):
    """json.loads(text) refusing duplicate keys; any failure (not UTF-8 / not JSON / nested
    past Python's recursion limit / a number past its 4300-digit limit / a duplicate key) is a
    ValueError starting with `what`."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except RecursionError:
        raise ValueError(f"{what}: not valid JSON (nested too deeply)") from None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError, the int digit limit, duplicates
        raise ValueError(f"{what}: not valid JSON ({e})") from None


def expected_weight_shapes(cfg: ModelConfig) -> dict:
    """Every tensor the forward reads: {HF hub name (without cfg.weight_prefix): shape}."""
    h = cfg.hidden_size
    H = cfg.num_attention_heads
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        a = p + "self_attn."
        if cfg.q_lora_rank:
            shapes[a + "q_a_proj.weight"] = (cfg.q_lora_rank, h)
            shapes[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            shapes[a + "q_b_proj.weight"] = (H * cfg.qk_head_dim, cfg.q_lora_rank)
        else:
            shapes[a + "q_proj.weight"] = (H * cfg.qk_head_dim, h)
        shapes[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)
        shapes[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        shapes[a + "kv_b_proj.weight"] = (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        shapes[a + "o_proj.weight"] = (h, H * cfg.v_head_dim)
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            shapes[m + "gate.weight"] = (cfg.n_routed_experts, h)
            shapes[m + "gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
            inter = cfg.moe_intermediate_size
            for e in range(cfg.n_routed_experts):
                x = f"{m}experts.{e}."
                shapes[x + "gate_proj.weight"] = (inter, h)
                shapes[x + "up_proj.weight"] = (inter, h)
                shapes[x + "down_proj.weight"] = (h, inter)
            if cfg.n_shared_experts:
                si = inter * cfg.n_shared_experts
                shapes[m + "shared_experts.gate_proj.weight"] = (si, h)
                shapes[m + "shared_experts.up_proj.weight"] = (si, h)
                shapes[m + "shared_experts.down_proj.weight"] = (h, si)
        else:
            shapes[m + "gate_proj.weight"] = (cfg.intermediate_size, h)
            shapes[m + "up_proj.weight"] = (cfg.intermediate_size, h)
            shapes[m + "down_proj.weight"] = (h, cfg.intermediate_size)
    return shapes


# ---- safetensors files ------------------------------------------------------------------

def read_safetensors_header(path: str, file_size: Optional[int] = None) -> tuple[dict, int]:
    """(tensor entries {name: {dtype, shape, data_offsets}}, payload start) of one file,
    checked: every entry's dtype known, shape non-negative ints, offsets inside the file and
    equal to shape * element size."""
    if file_size is None:
        file_size = os.path.getsize(path)
    if file_size < 8:
        raise ValueError(f"{path}: truncated safetensors file ({file_size} bytes, no header length)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER:
            raise ValueError(f"{path}: bad safetensors header: claims a {n}-byte JSON header")
        if 8 + n > file_size:
            raise ValueError(f"{path}: truncated safetensors file: the header length field says {n} bytes of JSON, "
                             f"but only {file_size - 8} bytes follow it")
        raw = f.read(n)
    header = _parse_json(raw, f"{path}: bad safetensors header")
    if not isinstance(header, dict):
        raise ValueError(f"{path}: bad safetensors header: not a JSON object")
    header.pop("__metadata__", None)
    start = 8 + n
    payload = file_size - start
    for name, e in header.items():
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
            raise ValueError(f"{path}: bad safetensors header: entry {name!r} lacks dtype/shape/data_offsets")
        if not isinstance(e["dtype"], str) or e["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {e['dtype']!r} "
                             f"(supported: {', '.join(_ST_DTYPES)})")
        shape, offs = e["shape"], e["data_offsets"]
        if (not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
            raise ValueError(f"{path}: bad safetensors header: tensor {name!r} has shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise ValueError(f"{path}: bad safetensors header: tensor {name!r} has data_offsets {offs!r}")
        begin, end = offs
        if not 0 <= begin <= end:
            raise ValueError(f"{path}: bad safetensors header: tensor {name!r} has data_offsets {offs}")
        if end > payload:
            raise ValueError(f"{path}: truncated or corrupt: tensor {name!r} ends at byte {start + end} "
                             f"but the file has {file_size} bytes")
        count = 1
        for s in shape:
            count *= s
        if count * _ST_DTYPES[e["dtype"]][1] != end - begin:
            raise ValueError(f"{path}: bad safetensors header: tensor {name!r} of shape {shape} {e['dtype']} "
                             f"needs {count * _ST_DTYPES[e['dtype']][1]} bytes, offsets give {end - begin}")
    # Two tensors sharing bytes would load the same (or shifted) data under two names: the
    # safetensors format forbids it (its reader requires the payloads to be packed in order).
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], name) for name, e in header.items()
                   if e["data_offsets"][1] > e["data_offsets"][0])
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ValueError(f"{path}: bad safetensors header: tensors {n0!r} (bytes {b0}..{e0}) and {n1!r} "
                             f"(bytes {b1}..{e1}) overlap")
    return header, start


class SafetensorsFile:
    """One memory-mapped safetensors file. `raw(name)` is a zero-copy view of its bytes."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        self.header, self.start = read_safetensors_header(path, size)
        self._map = None
        if size > 0:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = np.frombuffer(self._map, dtype=np.uint8) if self._map is not None else np.zeros(0, np.uint8)

    def names(self):
        return self.header.keys()

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple:
        return tuple(self.header[name]["shape"])

    def raw(self, name: str) -> np.ndarray:
        e = self.header[name]
        begin, end = e["data_offsets"]
        np_dtype, _ = _ST_DTYPES[e["dtype"]]
        data = self._buf[self.start + begin:self.start + end]
        return data.view(np_dtype).reshape(e["shape"])   # read-only (ACCESS_READ)


def _to_float(raw: np.ndarray, st_dtype: str, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if st_dtype == "BF16":
        wide = (raw.astype(np.uint32) << 16).view(np.float32)   # exact
        return wide if dtype == np.float32 else wide.astype(dtype)
    if raw.dtype == dtype:
        return raw                                              # zero-copy view of the map
    return raw.astype(dtype)


_MAX_INDEX = 256 * 1024 * 1024   # a 1T-parameter model's index is ~10 MB


def _checkpoint_files(model_dir: str) -> tuple[list, Optional[dict]]:
    """(file paths, weight_map from the index or None). model.safetensors first, then the
    index, in transformers' order (`modeling_utils._get_resolved_checkpoint_files`)."""
    index = os.path.join(model_dir, INDEX_FILE)
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single], None
    if os.path.isfile(index):
        size = os.path.getsize(index)
        if size > _MAX_INDEX:
            raise ValueError(f"{index}: bad index file: {size} bytes (more than {_MAX_INDEX})")
        with open(index, "rb") as f:
            doc = _parse_json(f.read(), f"{index}: bad index file")
        if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
            raise ValueError(f"{index}: bad index file: it must be a JSON object whose `weight_map` is an object "
                             "{tensor name: shard file name}")
        weight_map = doc["weight_map"]
        for name, fn in weight_map.items():
            if not isinstance(fn, str):
                raise ValueError(f"{index}: bad index file: weight_map[{name!r}] is {fn!r}, not a shard file name")
        files = sorted(set(weight_map.values()))
        for fn in files:
            if os.path.basename(fn) != fn or fn in ("", ".", "..") or "\0" in fn:
                raise ValueError(f"{index}: bad shard file name {fn!r} (a file name in {model_dir} is expected)")
            p = os.path.join(model_dir, fn)
            if not os.path.isfile(p):
                raise ValueError(f"{index}: shard {fn!r} is " + (
                    "not a regular file" if os.path.lexists(p) else f"missing from {model_dir}"))
        return [os.path.join(model_dir, fn) for fn in files], weight_map
    odd = [p for p in (single, index) if os.path.lexists(p)]
    if odd:
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}: {odd[0]} is not a regular file "
                                "(a directory, FIFO, device or broken link)")
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")


def _owned_here(weight_map: Optional[dict], name: str, path: str) -> bool:
    """Whether the tensor `name` of the shard at `path` counts: the index (if any) does not place it in another shard."""
    return weight_map is None or weight_map.get(name) in (None, os.path.basename(path))


def _quant_part(name: str, suffixes):
    """(module, suffix) when `name` is one of a quantized Linear's tensors, else (None, None)."""
    for suffix in suffixes:
        if name.endswith(suffix):
            return name[:-len(suffix)], suffix
    return None, None


def _quant_parts_problem(parts: dict, scheme, shape: tuple) -> Optional[str]:
    """Why a quantized Linear's stored tensors cannot be read (None when they can)."""
    if scheme is None:
        return "stored quantized, but no quantization_config group covers it (or `ignore` names it)"
    if ".weight_packed" not in parts:
        return f"quantized parts {sorted(parts)} without .weight_packed"
    if ".weight_scale" not in parts:
        return "no .weight_scale"
    if ".weight_g_idx" in parts:
        return "activation-ordered groups (.weight_g_idx) are not supported"
    if not scheme.symmetric and ".weight_zero_point" not in parts:
        return f"asymmetric scheme ({scheme.describe()}) but no .weight_zero_point"
    if scheme.symmetric and ".weight_zero_point" in parts:
        return f"a .weight_zero_point for a symmetric scheme ({scheme.describe()})"
    st, full = parts[".weight_packed"]
    if st.dtype(full) != "I32":
        return f".weight_packed has dtype {st.dtype(full)}, expected I32"
    st, full = parts[".weight_scale"]
    if st.dtype(full) not in ("F32", "F16", "BF16"):
        return f".weight_scale has dtype {st.dtype(full)}, expected BF16, F16 or F32"
    if ".weight_shape" in parts:
        st, full = parts[".weight_shape"]
        if st.dtype(full) not in ("I32", "I64") or st.shape(full) != (2,):
            return f".weight_shape must be 2 integers, got dtype {st.dtype(full)} shape {list(st.shape(full))}"
        stored = tuple(int(x) for x in st.raw(full))
        if stored != shape:
            return f".weight_shape says {list(stored)}, expected {list(shape)}"
    if ".weight_zero_point" in parts:
        st, full = parts[".weight_zero_point"]
        if st.dtype(full) not in ("I32", "I8", "I64"):
            return f".weight_zero_point has dtype {st.dtype(full)}, expected an integer type"
    return None


class PackedInt4(NamedTuple):
    """A 4-bit group-quantized weight as `CpuModel.set_weight_int4` takes it (quantization.packed_int4)."""
    packed: np.ndarray   # uint8 [out, in / 2]
    scales: np.ndarray   # float32 [out, in / group]
    group: int


def _packed_int4(module: str, shape, scheme, parts: dict) -> Optional[PackedInt4]:
    """The weight in the packed form the CPU model holds, when its scheme allows (else None)."""
    if ".weight_scale_inv" in parts or ".weight_packed" not in parts:
        return None
    st, full = parts[".weight_scale"]
    sdt = st.dtype(full)
    zp = parts.get(".weight_zero_point")
    if not int4_packable(scheme, shape, sdt, zp is not None):
        return None  # (dequantized instead: nothing read twice)
    got = packed_int4(module, scheme, shape, parts[".weight_packed"][0].raw(parts[".weight_packed"][1]),
                      _to_float(st.raw(full), sdt, np.float32), sdt, None if zp is None else zp[0].raw(zp[1]))
    return None if got is None else PackedInt4(*got)


def _dequantize(module: str, shape, scheme, parts: dict) -> np.ndarray:
    if ".weight_scale_inv" in parts:   # FP8
        st, full = parts[".weight_scale_inv"]
        scale = _to_float(st.raw(full), st.dtype(full), np.float32)
        st, full = parts[".weight"]
        return dequantize_fp8(module, shape, st.raw(full), scale, scheme.weight_block_size)
    st, full = parts[".weight_scale"]
    sdt = st.dtype(full)
    scale = _to_float(st.raw(full), sdt, np.float32)
    packed = parts[".weight_packed"][0].raw(parts[".weight_packed"][1])
    zp = None
    if ".weight_zero_point" in parts:
        zst, zfull = parts[".weight_zero_point"]
        zp = zst.raw(zfull)
    return dequantize_packed(module, scheme, shape, packed, scale, sdt, zp)


def _header_entries(model_dir) -> dict:
    """{full tensor name: its safetensors header entry} over the checkpoint's shards (headers only)."""
    files, weight_map = _checkpoint_files(os.fspath(model_dir))
    entries = {}
    for path in files:
        header, _ = read_safetensors_header(path)
        entries.update((full, e) for full, e in header.items() if _owned_here(weight_map, full, path))
    return entries


def matrices_not_bf16(model_dir, cfg: ModelConfig, int4_experts: bool = False) -> list:
    """The weight matrices the model takes (2-D, the embedding included) that the checkpoint does not store as
    BF16 (F32, F16, quantized), in the model's order (headers only). What a CUDA model's bf16_weights="only"
    holds as FP32 all the same (its fp32_matrices); every other matrix's values are exactly BF16. int4_experts:
    the routed experts' matrices are held as 4-bit integers (int4_experts_group) and left out."""
    dtypes = {full: e["dtype"] for full, e in _header_entries(model_dir).items()}
    prefix = cfg.weight_prefix or ""
    return [name for name, shape in expected_weight_shapes(cfg).items()
            if len(shape) >= 2 and dtypes.get(prefix + name) != "BF16" and not (int4_experts and _EXPERT_RE.match(name))]


def matrices_stored_as_bf16(model_dir, cfg: ModelConfig, int4_experts: bool = False) -> bool:
    """Whether every weight matrix the model takes (2-D, the embedding aside) is stored as BF16 in the
    checkpoint (headers only). int4_experts: the routed experts (held as 4-bit integers) left out, so a
    quantized checkpoint whose other matrices are BF16 (Kimi K2-Thinking's) qualifies."""
    return all(n == "model.embed_tokens.weight" for n in matrices_not_bf16(model_dir, cfg, int4_experts))


def int4_experts_group(model_dir, cfg: ModelConfig) -> Optional[int]:
    """The group size when every routed expert's matrix is stored as a 4-bit symmetric group-quantized Linear
    with BF16 scales that the packed form takes (quantization.int4_packable: Kimi K2-Thinking's experts), one
    group size for them all; else None. Headers only. What a CUDA model's int4_experts_group is set from."""
    quant = cfg.quantization
    if quant is None or quant.method == "fp8" or cfg.n_routed_experts <= 0:
        return None
    entries = _header_entries(model_dir)
    prefix = cfg.weight_prefix or ""
    groups = set()
    for name, shape in expected_weight_shapes(cfg).items():
        if not _EXPERT_RE.match(name):
            continue
        base = prefix + name[:-len(".weight")]
        scale = entries.get(base + ".weight_scale")
        if base + ".weight_packed" not in entries or scale is None or base + ".weight_scale_inv" in entries:
            return None
        scheme = quant.scheme_for(base)
        if scheme is None or not int4_packable(scheme, shape, scale["dtype"], base + ".weight_zero_point" in entries):
            return None
        groups.add(scheme.group_size)
    return groups.pop() if len(groups) == 1 else None


def load_weights(model_dir, cfg: ModelConfig, dtype=np.float32,
                 progress: Optional[Callable[[int, int], None]] = None) -> dict:
    """Load every tensor of `expected_weight_shapes(cfg)` as `dtype` (float32 by default): a dict
    holding the whole model at once (`iter_weights` hands them out one at a time instead).

    progress(done, total), if given, is called after each tensor. The MTP layers
    (model.layers.{num_hidden_layers}+) and, for Kimi K2.5, tensors outside the text model's
    `cfg.weight_prefix` (vision tower, projector) are skipped without being read.
    """
    return dict(iter_weights(model_dir, cfg, dtype, progress))


def iter_weights(model_dir, cfg: ModelConfig, dtype=np.float32,
                 progress: Optional[Callable[[int, int], None]] = None,
                 bf16_bits: bool = False, int4_packed: bool = False) -> Iterator[Tuple[str, np.ndarray]]:
    """`load_weights` one tensor at a time: checks the whole checkpoint against the config first
    (the same errors, raised by this call, before any tensor is read), then returns an iterator of
    (name, array) that reads, widens or dequantizes each tensor when it is asked for. A consumer that
    drops each array before asking for the next (Engine.from_pretrained) holds one tensor at a time,
    never the whole model as float32. bf16_bits: a tensor stored as BF16 comes as its bits instead, a
    read-only uint16 view of the memory map (no copy; `CpuModel.set_weight_bf16` takes it), every
    other one as `dtype`. int4_packed: a symmetric 4-bit group-quantized weight with BF16 scales comes
    as a `PackedInt4` (its integers and scales, checked as the dequantization checks them;
    `CpuModel.set_weight_int4` takes it) instead of dequantized."""
    model_dir = os.fspath(model_dir)
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise ValueError(f"load_weights: dtype must be a float type, got {dtype}")
    prefix = cfg.weight_prefix
    files, weight_map = _checkpoint_files(model_dir)

    opened = [SafetensorsFile(p) for p in files]
    # A config naming more layers or experts than the checkpoint holds is a mismatch to report
    # before the table of expected names is built: that table grows with num_hidden_layers *
    # n_routed_experts (a corrupt value such as 10**9 would take minutes and gigabytes to list
    # what is missing).
    n_layers = n_experts = 0
    for st in opened:
        for full in st.names():
            name = full[len(prefix):] if prefix and full.startswith(prefix) else full
            m = _LAYER_RE.match(name)
            if m:
                n_layers = max(n_layers, int(m.group(1)) + 1)
                m = _EXPERT_RE.match(name)
                if m:
                    n_experts = max(n_experts, int(m.group(1)) + 1)
    if cfg.num_hidden_layers > n_layers:
        raise ValueError(f"config.json says num_hidden_layers = {cfg.num_hidden_layers}, but the checkpoint in "
                         f"{model_dir} holds tensors of " + (f"model.layers.0 .. {n_layers - 1} only"
                                                             if n_layers else "no model.layers.* at all"))
    if cfg.first_k_dense_replace < cfg.num_hidden_layers and cfg.n_routed_experts > n_experts:
        raise ValueError(f"config.json says n_routed_experts = {cfg.n_routed_experts}, but the checkpoint in "
                         f"{model_dir} holds tensors of " + (f"mlp.experts.0 .. {n_experts - 1} only"
                                                             if n_experts else "no mlp.experts.* at all"))
    expected = expected_weight_shapes(cfg)
    quant = cfg.quantization
    qparts = {}                       # quantized Linear (name without prefix) -> {suffix: (st, full)}
    where = {}                        # name (without prefix) -> SafetensorsFile
    unexpected, mismatched = [], []
    for st in opened:
        for full in st.names():
            if not _owned_here(weight_map, full, st.path):
                continue              # the index says this name lives in another shard
            if prefix:
                if not full.startswith(prefix):
                    continue          # K2.5: vision tower / projector
                name = full[len(prefix):]
            else:
                name = full
            m = _LAYER_RE.match(name)
            if m and int(m.group(1)) >= cfg.num_hidden_layers:
                continue              # MTP layer(s): ignored as HF does
            if name not in expected:
                if cfg.tie_word_embeddings and name == "lm_head.weight":
                    continue          # tied: HF uses the embedding
                if (cfg.n_shared_experts == 0 and ".mlp.shared_experts." in name
                        and 0 in st.shape(full)):
                    continue          # HF saves zero-sized shared experts when n_shared_experts == 0
                base, suffix = _quant_part(name, quant.suffixes) if quant is not None else (None, None)
                if base is not None and base + ".weight" in expected:
                    parts = qparts.setdefault(base, {})
                    if suffix in parts:
                        unexpected.append(f"{_show(full)} (duplicate, also in {os.path.basename(parts[suffix][0].path)})")
                    else:
                        parts[suffix] = (st, full)
                    continue          # a part of a quantized Linear (quantization.py)
                unexpected.append(f"{_show(full)} {list(st.shape(full))}")
                continue
            if name in where:
                unexpected.append(f"{_show(full)} (duplicate, also in {os.path.basename(where[name][0].path)})")
                continue
            where[name] = (st, full)
    quantized = {}                    # weight name -> (scheme, {suffix: (st, full)})
    if quant is not None and quant.method == "fp8":
        for base, parts in sorted(qparts.items()):   # a .weight_scale_inv: its F8_E4M3 .weight
            wname = base + ".weight"
            if wname not in where:
                continue                  # reported as missing below
            st, full = where[wname]
            if st.dtype(full) != "F8_E4M3":
                mismatched.append(f"{full}: dtype {st.dtype(full)} with a .weight_scale_inv (FP8 weights are F8_E4M3)")
                continue
            if st.shape(full) != tuple(expected[wname]):
                mismatched.append(f"{full}: shape {list(st.shape(full))}, expected {list(expected[wname])}")
                continue
            sst, sfull = parts[".weight_scale_inv"]
            if sst.dtype(sfull) not in ("F32", "BF16", "F16"):
                mismatched.append(f"{sfull}: dtype {sst.dtype(sfull)}, expected F32, BF16 or F16")
                continue
            quantized[wname] = (quant, dict(parts, **{".weight": where.pop(wname)}))
        qparts = {}
    for base, parts in sorted(qparts.items()):
        wname = base + ".weight"
        full_base = prefix + base
        if wname in where:
            unexpected.append(f"{_show(full_base)}: quantized parts {sorted(parts)} beside a float weight")
            continue
        scheme = quant.scheme_for(full_base)
        why = _quant_parts_problem(parts, scheme, tuple(expected[wname]))
        if why:
            mismatched.append(f"{_show(full_base)}: {why}")
            continue
        quantized[wname] = (scheme, parts)
    missing = sorted(n for n in expected if n not in where and n not in quantized)
    for name, (st, full) in where.items():
        if st.shape(full) != tuple(expected[name]):
            mismatched.append(f"{full}: shape {list(st.shape(full))}, expected {list(expected[name])}")
        elif st.dtype(full) == "F8_E4M3" and quant is not None and quant.method == "fp8":
            mismatched.append(f"{full}: an F8_E4M3 weight without its .weight_scale_inv")
        elif st.dtype(full) not in _FLOAT_DTYPES:
            mismatched.append(f"{full}: dtype {st.dtype(full)} is not a float type")
    if missing or unexpected or mismatched:
        lines = [f"checkpoint {model_dir} does not match the config:"]
        if missing:
            lines.append(f"  missing ({len(missing)}): " + ", ".join(prefix + n for n in missing[:50])
                         + (" ..." if len(missing) > 50 else ""))
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): " + ", ".join(sorted(unexpected)[:50])
                         + (" ..." if len(unexpected) > 50 else ""))
        if mismatched:
            lines.append(f"  mis-shaped ({len(mismatched)}): " + "; ".join(sorted(mismatched)[:50])
                         + (" ..." if len(mismatched) > 50 else ""))
        raise ValueError("\n".join(lines))

    def tensors():
        total = len(expected)
        for k, name in enumerate(expected):      # each tensor read exactly once
            if name in quantized:
                module = prefix + name[:-len(".weight")]
                w = _packed_int4(module, expected[name], *quantized[name]) if int4_packed else None
                if w is None:
                    w = _dequantize(module, expected[name], *quantized[name])
                    w = w if dtype == np.float32 else w.astype(dtype)
            else:
                st, full = where[name]
                raw = st.raw(full)
                w = raw if bf16_bits and st.dtype(full) == "BF16" else _to_float(raw, st.dtype(full), dtype)
                del raw
            if progress is not None:
                progress(k + 1, total)
            yield name, w
            del w

    return tensors()
