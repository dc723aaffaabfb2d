"""Quantized checkpoints: compressed-tensors `pack-quantized` integer weights (W4A16 and kin) and
block-scaled FP8 (the format of DeepSeek-V3's and Kimi K2's releases).

FP8 (`quant_method` "fp8", `fmt` "e4m3", `weight_block_size` [rows, cols], activation scheme
"dynamic"): a quantized Linear stores its `.weight` as F8_E4M3 bytes and a float32 (or BF16 / F16)
`.weight_scale_inv` [ceil(out / rows), ceil(in / cols)]; `dequantize_fp8` gives each weight the
e4m3 value times its block's scale, rounded to float32, which is what HF transformers'
Fp8Dequantize gives a float32 model (HF derives the block from the scale grid and so refuses
widths that are not a multiple of the block; the edge blocks here are partial, as in DeepSeek's
own dequantization). The activations stay FP32 (HF's dequantized model does the same).

Integer weights (compressed-tensors):

Where it sits: `config.config_from_dict` parses a config.json `quantization_config` into a
`QuantizationSpec` (`ModelConfig.quantization`), and `checkpoint.load_weights` turns each stored
quantized Linear (`<module>.weight_packed`, `.weight_scale`, `.weight_shape`, and
`.weight_zero_point` when asymmetric) back into a float32 weight with `dequantize_packed`.

This is the format of Kimi K2-Thinking's INT4 release (`quant_method` "compressed-tensors",
`format` "pack-quantized", 4-bit symmetric integers in groups of 32 along the input dimension,
BF16 scales, attention / shared experts / dense MLP / lm_head left in BF16 by `ignore`).

What the loader computes, element for element, is what compressed-tensors' decompressor hands
HF transformers (`PackedQuantizationCompressor.decompress` -> `_dequantize`): the stored unsigned
field minus 2**(bits-1) is the integer q; the weight is (q - zero_point) * scale evaluated in the
scale's dtype. For BF16 / F16 scales the product of two such numbers is exact in float32, so
the result is that product rounded once to the scale's dtype (round to nearest even); for F32
scales it is the float32 product. The weights therefore come out exactly representable in the
scale's dtype (BF16 for Kimi), so the CPU model holds them as BF16 and the GPU model's BF16
weight copies apply to them, as to any BF16 checkpoint. The engine computes in float32 on the
dequantized weights (W4A16 semantics with FP32 activations). A symmetric 4-bit group scheme with
BF16 scales is handed to a CPU model packed instead (`packed_int4`, `CpuModel.set_weight_int4`: it
dequantizes rows to these same values inside its GEMMs); the GPU model gets the dequantized weights
(memory: FP32 plus copies there).

Accepted: config groups whose weights are `type` "int", `num_bits` 1, 2, 4 or 8 (the widths for
which every compressed-tensors release packs the same way: 32 / bits fields per int32, field j
of word w holding input column w * 32 / bits + j at bit j * bits), `strategy` "group" (any
`group_size` dividing the input width), "channel" or "tensor", symmetric or not, static; no
activation quantization, no `actorder` "group" (g_idx), no KV-cache scheme, no transforms.
Targets and `ignore` entries are matched as compressed-tensors does: "re:<pattern>" by
`re.match` on the module name, "Linear" for every Linear module, any other string as an exact
module name. Anything else raises ValueError naming the field.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["WeightQuantization", "QuantizationSpec", "parse_quantization_config", "dequantize_packed",
           "dequantize_fp8", "e4m3_values", "QUANT_SUFFIXES", "FP8_SUFFIXES", "BITS_SUPPORTED"]

# Tensors a quantized Linear `<module>` stores instead of `<module>.weight` (compressed-tensors),
# or beside its F8_E4M3 `.weight` (fp8).
QUANT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx")
FP8_SUFFIXES = (".weight_scale_inv",)
BITS_SUPPORTED = (1, 2, 4, 8)
_STRATEGIES = ("group", "channel", "tensor")
_FORMATS = ("pack-quantized",)


def _refuse(field_name: str, value, why: str):
    raise ValueError(f"unsupported config: `quantization_config.{field_name}` = {value!r}: {why}")


@dataclass(frozen=True)
class WeightQuantization:
    """How one config group's weights are stored."""

    num_bits: int
    strategy: str                   # "group" | "channel" | "tensor"
    group_size: Optional[int]       # for "group"
    symmetric: bool

    def describe(self) -> str:
        g = f" group {self.group_size}" if self.strategy == "group" else f" per {self.strategy}"
        return f"int{self.num_bits}{g}, {'symmetric' if self.symmetric else 'asymmetric'}"


@dataclass(frozen=True)
class QuantizationSpec:
    """A parsed `quantization_config` (compressed-tensors, pack-quantized)."""

    method: str                                           # "compressed-tensors" | "fp8"
    format: str                                           # "pack-quantized" | "e4m3"
    groups: tuple                                         # ((name, targets tuple, WeightQuantization), ...)
    ignore: tuple                                         # target strings (fp8: modules_to_not_convert)
    weight_block_size: Optional[tuple] = None             # fp8: (rows, columns) of one scale's block

    def scheme_for(self, module: str) -> Optional[WeightQuantization]:
        """The weight scheme of the Linear module `module` (its full name in the checkpoint, e.g.
        `model.layers.3.mlp.experts.7.up_proj`), or None when no group covers it or it is ignored."""
        if any(_matches(module, t) for t in self.ignore):
            return None
        for _, targets, scheme in self.groups:
            if any(_matches(module, t) for t in targets):
                return scheme
        return None

    @property
    def suffixes(self) -> tuple:
        """The tensors a quantized Linear `<module>` stores besides (fp8) or instead of its `.weight`."""
        return FP8_SUFFIXES if self.method == "fp8" else QUANT_SUFFIXES

    def describe(self) -> str:
        if self.method == "fp8":
            return f"FP8 e4m3 weights, one scale per {self.weight_block_size[0]}x{self.weight_block_size[1]} block"
        return "compressed-tensors " + "; ".join(s.describe() for _, t, s in self.groups) + " weights"


def _matches(module: str, target: str) -> bool:
    # every module the loader asks about is a Linear (the *_proj projections and lm_head)
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or target == module


def _check_regex(where: str, target: str):
    if target.startswith("re:"):
        try:
            re.compile(target[3:])
        except re.error as e:
            _refuse(where, target, f"not a valid regular expression ({e})")


def parse_quantization_config(qc) -> QuantizationSpec:
    """Parse and check a config.json `quantization_config` (raises ValueError naming the field)."""
    if not isinstance(qc, dict):
        raise ValueError(f"unsupported config: `quantization_config` = {qc!r}: must be a JSON object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _parse_fp8(qc)
    if method != "compressed-tensors":
        _refuse("quant_method", method, "supported: 'fp8' (block-scaled FP8, DeepSeek-V3 / Kimi K2) and "
                                        "'compressed-tensors' pack-quantized integer weights (Kimi K2-Thinking INT4)")
    fmt = qc.get("format")
    if fmt not in _FORMATS:
        _refuse("format", fmt, f"supported: {list(_FORMATS)}")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        _refuse("quantization_status", status, "only checkpoints saved compressed are read")
    for key in ("kv_cache_scheme", "transform_config"):
        if qc.get(key) not in (None, {}):
            _refuse(key, qc.get(key), "not supported")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        _refuse("ignore", ignore, "must be a list of strings")
    for t in ignore:
        _check_regex("ignore", t)
    cg = qc.get("config_groups")
    if not isinstance(cg, dict) or not cg:
        _refuse("config_groups", cg, "must be a non-empty object {group name: scheme}")
    groups = []
    for gname, g in cg.items():
        where = f"config_groups.{gname}"
        if not isinstance(g, dict):
            _refuse(where, g, "must be an object")
        gfmt = g.get("format")
        if gfmt is not None and gfmt not in _FORMATS:
            _refuse(f"{where}.format", gfmt, f"supported: {list(_FORMATS)}")
        for key in ("input_activations", "output_activations"):
            if g.get(key) is not None:
                _refuse(f"{where}.{key}", g.get(key), "activation quantization is not supported (weight-only "
                                                      "schemes such as W4A16 are)")
        targets = g.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            _refuse(f"{where}.targets", targets, "must be a non-empty list of strings")
        for t in targets:
            _check_regex(f"{where}.targets", t)
        groups.append((str(gname), tuple(targets), _parse_weights(f"{where}.weights", g.get("weights"))))
    return QuantizationSpec(method=method, format=fmt, groups=tuple(groups), ignore=tuple(ignore))


def _parse_fp8(qc: dict) -> QuantizationSpec:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        _refuse("fmt", fmt, "only e4m3 FP8 weights are read")
    act = qc.get("activation_scheme", "dynamic")
    if act != "dynamic":
        _refuse("activation_scheme", act, "only 'dynamic' (no stored activation scales; the engine's activations "
                                          "stay FP32)")
    bs = qc.get("weight_block_size")
    if (not isinstance(bs, list) or len(bs) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 2**31 - 1 for b in bs)):
        _refuse("weight_block_size", bs, "must be two positive integers [rows, columns] (per-tensor FP8 is not read)")
    skip = qc.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(t, str) for t in skip):
        _refuse("modules_to_not_convert", skip, "must be a list of strings")
    return QuantizationSpec(method="fp8", format="e4m3", groups=(), ignore=tuple(skip),
                            weight_block_size=(bs[0], bs[1]))


def _parse_weights(where: str, w) -> WeightQuantization:
    if not isinstance(w, dict):
        _refuse(where, w, "must be an object (a weight scheme)")
    if w.get("type", "int") != "int":
        _refuse(f"{where}.type", w.get("type"), "only integer weights are supported")
    bits = w.get("num_bits")
    if isinstance(bits, bool) or bits not in BITS_SUPPORTED:
        _refuse(f"{where}.num_bits", bits, f"supported: {list(BITS_SUPPORTED)} (widths that pack whole fields "
                                           "into int32 words the same way in every compressed-tensors release)")
    strategy = w.get("strategy")
    if strategy not in _STRATEGIES:
        _refuse(f"{where}.strategy", strategy, f"supported: {list(_STRATEGIES)}")
    gs = w.get("group_size")
    if strategy == "group":
        if isinstance(gs, bool) or not isinstance(gs, int) or gs < 1:
            _refuse(f"{where}.group_size", gs, "must be an integer >= 1 for strategy 'group'")
    else:
        gs = None
    sym = w.get("symmetric", True)
    if not isinstance(sym, bool):
        _refuse(f"{where}.symmetric", sym, "must be true or false")
    if w.get("dynamic", False) not in (False, None):
        _refuse(f"{where}.dynamic", w.get("dynamic"), "only static weight scales are supported")
    if w.get("actorder") not in (None, "weight", "static"):
        _refuse(f"{where}.actorder", w.get("actorder"), "activation-ordered groups (g_idx) are not supported")
    if w.get("block_structure") is not None:
        _refuse(f"{where}.block_structure", w.get("block_structure"), "block strategies are not supported")
    return WeightQuantization(num_bits=bits, strategy=strategy, group_size=gs, symmetric=sym)


# ---- dequantization ------------------------------------------------------------------------

def unpack_fields(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """int32 [rows, W] -> int16 [rows, cols]: the unsigned `bits`-wide fields (32 / bits a word,
    the first at the lowest bits), minus 2**(bits-1)."""
    per = 32 // bits
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    fields = (words[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    fields = fields.reshape(words.shape[0], -1)[:, :cols]
    return fields.astype(np.int16) - np.int16(1 << (bits - 1))


def _round_to(x32: np.ndarray, st_dtype: str) -> np.ndarray:
    """float32 values rounded (to nearest even) to the scale's dtype, back as float32."""
    if st_dtype == "F32":
        return x32
    if st_dtype == "F16":
        with np.errstate(over="ignore"):
            return x32.astype(np.float16).astype(np.float32)
    bits = x32.view(np.uint32)             # BF16 (values finite here: checked by the caller)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def _check_packed(module: str, scheme: WeightQuantization, shape, packed: np.ndarray, scale: np.ndarray):
    """dequantize_packed's checks of the packed integers' and the scales' shapes and of the scales'
    values (ValueError naming `module`); returns (scales as float32 in their strategy's shape, groups a row)."""
    out, cols = int(shape[0]), int(shape[1])
    bits = scheme.num_bits
    want_packed = (out, -(-cols // (32 // bits)))
    if tuple(packed.shape) != want_packed:
        raise ValueError(f"{module}.weight_packed: shape {list(packed.shape)}, expected {list(want_packed)} "
                         f"({bits}-bit fields of a [{out}, {cols}] weight)")
    if scheme.strategy == "group":
        if cols % scheme.group_size:
            raise ValueError(f"{module}: input width {cols} is not a multiple of group_size {scheme.group_size}")
        ngroups = cols // scheme.group_size
        want_scale = (out, ngroups)
    elif scheme.strategy == "channel":
        ngroups = 1
        want_scale = (out, 1)
    else:
        ngroups = 1
        want_scale = (1,)
    s = np.asarray(scale, dtype=np.float32)
    if scheme.strategy == "tensor" and s.shape in ((), (1, 1)):
        s = s.reshape(1)
    if tuple(s.shape) != want_scale:
        raise ValueError(f"{module}.weight_scale: shape {list(s.shape)}, expected {list(want_scale)} "
                         f"(strategy {scheme.strategy!r})")
    if not np.isfinite(s).all():
        raise ValueError(f"{module}.weight_scale contains NaN or inf")
    return s, ngroups


def int4_packable(scheme: WeightQuantization, shape, scale_dtype: str, zero_point: bool) -> bool:
    """Whether packed_int4 takes a Linear of this scheme (decided before any of its tensors is read)."""
    return (scheme.num_bits == 4 and scheme.strategy == "group" and scheme.symmetric and not zero_point
            and scale_dtype == "BF16" and scheme.group_size % 2 == 0 and int(shape[1]) % 8 == 0)


def packed_int4(module: str, scheme: WeightQuantization, shape, packed: np.ndarray, scale: np.ndarray,
                scale_dtype: str, zero_point: Optional[np.ndarray] = None):
    """The form `CpuModel.set_weight_int4` holds a quantized Linear in, (packed uint8 [out, in / 2],
    scales float32 [out, in / group], group), for a symmetric 4-bit group scheme with BF16 scales (Kimi
    K2-Thinking's experts) and an input width that fills whole int32 words: the checkpoint's int32 words
    read as bytes (little-endian: element 2j in the low nibble of byte j), after the checks of
    dequantize_packed (the same errors). None for any other scheme (then the weight is dequantized)."""
    out, cols = int(shape[0]), int(shape[1])
    if not int4_packable(scheme, shape, scale_dtype, zero_point is not None):
        return None
    s, ngroups = _check_packed(module, scheme, shape, packed, scale)
    words = np.ascontiguousarray(packed).view("<u4")
    return words.view(np.uint8).reshape(out, cols // 2), np.ascontiguousarray(s, dtype=np.float32), scheme.group_size


def dequantize_packed(module: str, scheme: WeightQuantization, shape, packed: np.ndarray, scale: np.ndarray,
                      scale_dtype: str, zero_point: Optional[np.ndarray] = None) -> np.ndarray:
    """One quantized Linear's weight as float32 [out, in].

    packed      int32 [out, in * bits / 32]
    scale       float32 values of the stored scales (BF16 / F16 widened exactly), shape by strategy:
                group [out, in / group_size], channel [out, 1], tensor [1]
    scale_dtype the stored scale dtype ("BF16", "F16", "F32"): the dtype the product is rounded to
    zero_point  asymmetric schemes: int32 packed [ceil(out * bits / 32), groups] (group / channel,
                packed along the output dimension) or integer [1] (tensor)
    Raises ValueError naming `module` on a shape that does not fit or a non-finite scale / result.
    """
    out, cols = int(shape[0]), int(shape[1])
    bits = scheme.num_bits
    per = 32 // bits
    s, ngroups = _check_packed(module, scheme, shape, packed, scale)
    q = unpack_fields(packed, bits, cols).astype(np.float32)              # exact small integers
    if not scheme.symmetric:
        if zero_point is None:
            raise ValueError(f"{module}: asymmetric scheme but no weight_zero_point in the checkpoint")
        zp = np.asarray(zero_point)
        if scheme.strategy == "tensor":
            if zp.size != 1 or zp.dtype.kind not in "iu":
                raise ValueError(f"{module}.weight_zero_point: expected one integer for strategy 'tensor', "
                                 f"got shape {list(zp.shape)} dtype {zp.dtype}")
            z = zp.reshape(1).astype(np.float32)
        else:
            want_zp = (-(-out // per), ngroups)
            if tuple(zp.shape) != want_zp or zp.dtype != np.int32:
                raise ValueError(f"{module}.weight_zero_point: shape {list(zp.shape)} dtype {zp.dtype}, expected "
                                 f"int32 {list(want_zp)} ({bits}-bit fields packed along the output dimension)")
            z = unpack_fields(np.ascontiguousarray(zp.T), bits, out).T.astype(np.float32)   # [out, ngroups]
        if scheme.strategy == "group":
            q = (q.reshape(out, ngroups, -1) - z[:, :, None]).reshape(out, cols)
        else:
            q = q - z.reshape(-1, 1) if scheme.strategy == "channel" else q - z[0]
    # (q - zero_point) * scale in float32: exact for BF16 / F16 scales (few-bit integers times an
    # 8- or 11-bit significand), then one rounding to the scale's dtype, as torch does in it.
    if scheme.strategy == "group":
        prod = (q.reshape(out, ngroups, -1) * s[:, :, None]).reshape(out, cols)
    elif scheme.strategy == "channel":
        prod = q * s
    else:
        prod = q * s[0]
    w = _round_to(np.ascontiguousarray(prod, dtype=np.float32), scale_dtype)
    if not np.isfinite(w).all():
        raise ValueError(f"{module}: dequantized weight overflows {scale_dtype} (scale too large)")
    return w


# ---- FP8 (block-scaled e4m3, DeepSeek-V3 / Kimi K2 releases) ---------------------------------

def e4m3_values() -> np.ndarray:
    """float32 [256]: the value of each FP8 e4m3fn byte (1 sign, 4 exponent bits with bias 7, 3
    mantissa bits; exponent 0 subnormal; no infinities; S.1111.111 is NaN)."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0)) * sign
    v[(b & 0x7F) == 0x7F] = np.nan
    return v.astype(np.float32)


_E4M3 = None


def dequantize_fp8(module: str, shape, raw: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """One FP8 Linear's weight as float32 [out, in]: each e4m3 value times the float32 scale of its
    block (`weight_scale_inv` [ceil(out / rows), ceil(in / cols)], the last block row / column
    partial where the width is not a multiple, as DeepSeek's own dequantization does), the product
    rounded to float32: what HF transformers' Fp8Dequantize gives a float32 model.
    raw: uint8 [out, in] (the stored bytes). Raises ValueError naming `module` on a wrong scale
    shape, a NaN weight byte or a non-finite scale."""
    global _E4M3
    if _E4M3 is None:
        _E4M3 = e4m3_values()
    out, cols = int(shape[0]), int(shape[1])
    bm, bn = block
    want = (-(-out // bm), -(-cols // bn))
    s = np.asarray(scale, dtype=np.float32)
    if tuple(s.shape) != want:
        raise ValueError(f"{module}.weight_scale_inv: shape {list(s.shape)}, expected {list(want)} "
                         f"(a [{out}, {cols}] weight in {bm}x{bn} blocks)")
    if not np.isfinite(s).all():
        raise ValueError(f"{module}.weight_scale_inv contains NaN or inf")
    w = _E4M3[np.asarray(raw)]
    if np.isnan(w).any():
        raise ValueError(f"{module}.weight: an FP8 byte is NaN")
    s_full = np.repeat(np.repeat(s, bm, axis=0)[:out], bn, axis=1)[:, :cols]
    w *= s_full
    if not np.isfinite(w).all():
        raise ValueError(f"{module}: dequantized weight overflows float32 (scale too large)")
    return w
