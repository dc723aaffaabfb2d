"""Golden KDTR files for tests/cpp/test_kdtr.cpp, and the catalogue of corrupt files.

generate(out_dir) writes
  kdtr_golden_all.kdtr    every dtype with values the C++ test recomputes, 0-d / 0-size / big
                          tensors, a Unicode name, known metadata (GOLDEN_METADATA_JSON)
  kdtr_golden_many.kdtr   300 small i32 tensors "t/000".."t/299" (some empty)
  kdtr_golden_empty.kdtr  no tensors, no metadata
  kdtr_corrupt_<case>.kdtr + kdtr_corrupt.tsv   one file per CORRUPTIONS case and its expected
                          message fragment; the C++ test checks that each is rejected with it.

CORRUPTIONS is also used by tests/python/test_kdtr.py, so Python and C++ are held to one list.
"""
import os
import struct

import numpy as np

from kdtree_native import kdtr

GOLDEN_METADATA = {"name": "golden_kdtr", "count": 3, "pi": 3.25,
                   "nested": {"list": [1, 2, None, True, False]}, "text": "h\u00e9llo \u2713"}
# What the writer stores for GOLDEN_METADATA (compact, non-ASCII kept): the C++ test compares it.
GOLDEN_METADATA_JSON = ('{"name":"golden_kdtr","count":3,"pi":3.25,"nested":{"list":[1,2,null,true,false]},'
                        '"text":"h\u00e9llo \u2713"}')

F16_VALUES = [0.0, 1.0, -2.5, 65504.0, 2.0 ** -14, 2.0 ** -24, float("inf"), float("-inf"), float("nan"), -0.0]
# bf16 inputs and the bits round-to-nearest-even must give (checked in Python and C++).
BF16_INPUTS = [1.0, -3.140625, 0.5, 65536.0, 1.00390625, 1.01171875, float("inf")]
BF16_BITS = [0x3F80, 0xC049, 0x3F00, 0x4780, 0x3F80, 0x3F82, 0x7F80]


def golden_arrays():
    """The tensors of kdtr_golden_all.kdtr; test_kdtr.cpp recomputes each from its formula."""
    i64 = np.iinfo(np.int64)
    i32 = np.iinfo(np.int32)
    return {
        "f32": ((np.arange(24, dtype=np.float32) - 7) * np.float32(0.25)).reshape(2, 3, 4),
        "f16": np.array(F16_VALUES, dtype=np.float16),
        "bf16": kdtr.Bf16.from_float32(np.array(BF16_INPUTS, dtype=np.float32)),
        "f64": np.arange(7, dtype=np.float64) / 3.0,
        "i8": np.arange(-128, 128, dtype=np.int8),
        "u8": np.arange(256, dtype=np.uint8),
        "i16": np.array([-32768, 0, 32767], dtype=np.int16),
        "i32": np.array([[i32.min, -1], [0, i32.max]], dtype=np.int32),
        "i64": np.array([i64.min, 0, i64.max], dtype=np.int64),
        "bool": np.arange(7) % 3 == 0,
        "u16": np.array([0, 65535], dtype=np.uint16),
        "u32": np.array([0, 2 ** 32 - 1], dtype=np.uint32),
        "u64": np.array([0, 2 ** 64 - 1], dtype=np.uint64),
        "scalar_f32": np.float32(42.5),
        "empty_f32": np.zeros((0,), np.float32),
        "empty_3d_i64": np.zeros((3, 0, 2), np.int64),
        "big_f32": ((np.arange(257 * 63) % 1000) * 0.5).astype(np.float32).reshape(257, 63),
        "unicode/\u00f1ame\u2713": np.array([7], dtype=np.uint8),
    }


def many_arrays(n=300):
    return {f"t/{i:03d}": (i * 100 + np.arange(i % 5)).astype(np.int32) for i in range(n)}


# ------------------------------------------------------------------------- corruptions

def corrupt_base_arrays():
    return {
        "a": np.arange(16, dtype=np.float32).reshape(4, 4),
        "b": np.array([1, 2, 3], dtype=np.int32),
        "flag": np.array([True, False, True, True, False]),
        "empty": np.zeros((0, 3), np.float32),
    }


# Long enough that replacement metadata texts (padded with spaces) fit in its place.
CORRUPT_BASE_METADATA = {"kind": "corrupt-base", "pad": "x" * 4200}

_HDR = {"version": ("<I", 8), "crc": ("<I", 12), "file_size": ("<Q", 16), "count": ("<Q", 24),
        "table_size": ("<Q", 32), "meta_size": ("<Q", 40), "data_offset": ("<Q", 48), "flags": ("<Q", 56)}
_ENT = {"name_len": ("<I", 0), "dtype": ("<B", 4), "ndim": ("<B", 5), "reserved": ("<H", 6),
        "offset": ("<Q", 8), "nbytes": ("<Q", 16)}


class Image:
    """A valid KDTR image being corrupted: header/entry field setters over a bytearray."""

    def __init__(self, data):
        self.buf = bytearray(data)
        self.header, entries, _ = kdtr._parse(bytes(data), verify=False)
        self.ent = {e.name: e for e in entries}

    def get(self, field):
        fmt, off = _HDR[field]
        return struct.unpack_from(fmt, self.buf, off)[0]

    def set(self, field, value):
        fmt, off = _HDR[field]
        struct.pack_into(fmt, self.buf, off, value)

    def set_entry(self, name, field, value):
        fmt, off = _ENT[field]
        struct.pack_into(fmt, self.buf, self.ent[name].pos + off, value)

    def set_dim(self, name, k, value):
        struct.pack_into("<q", self.buf, self.ent[name].pos + 24 + 8 * k, value)

    def name_at(self, name):
        e = self.ent[name]
        return e.pos + 24 + 8 * len(e.shape)

    def payload(self, name):
        return self.ent[name].offset

    def set_metadata(self, text):
        """Replace the metadata blob by ``text`` (bytes), padded with spaces to its length."""
        off, size = self.header["metadata_offset"], self.header["metadata_size"]
        assert len(text) <= size
        self.buf[off:off + size] = text + b" " * (size - len(text))


def _meta(text):
    return lambda im: im.set_metadata(text)


def _flip(pos_fn):
    def f(im):
        im.buf[pos_fn(im)] ^= 0x10
    return f


def _seq(*fns):
    def f(im):
        for fn in fns:
            fn(im)
    return f


TB = 1 << 40
# (case, mutation(Image), expected message fragment, reseal the checksum afterwards?)
CORRUPTIONS = [
    ("empty_file", lambda im: im.buf.__delitem__(slice(0, None)), "truncated file: 0 bytes is smaller than the 64-byte", False),
    ("truncated_header", lambda im: im.buf.__delitem__(slice(40, None)), "truncated file: 40 bytes is smaller than the 64-byte", False),
    ("truncated_payload", lambda im: im.buf.__delitem__(slice(-10, None)), "truncated file: the header says", False),
    ("trailing_bytes", lambda im: im.buf.extend(bytes(64)), "trailing bytes: the header says", False),
    ("bad_magic", lambda im: im.buf.__setitem__(slice(0, 4), b"PK\x03\x04"), "bad magic: not a KDTR file", False),
    ("text_mode_magic", lambda im: im.buf.__setitem__(slice(5, 7), b"\n\x00"), "bad magic: not a KDTR file", False),
    ("bad_version", lambda im: im.set("version", 2), "unsupported KDTR format version 2 (this reader reads version 1)", False),
    ("bad_flags", lambda im: im.set("flags", 1), "unsupported header flags 1 (must be 0 in version 1)", True),
    ("terabyte_file_size", lambda im: im.set("file_size", 4 * TB), "truncated file: the header says 4398046511104 bytes", True),
    ("checksum_payload", _flip(lambda im: im.payload("a") + 5), "checksum mismatch: stored CRC-32", False),
    ("checksum_table", _flip(lambda im: im.name_at("b")), "checksum mismatch: stored CRC-32", False),
    ("checksum_metadata", _flip(lambda im: im.header["metadata_offset"] + 3), "checksum mismatch: stored CRC-32", False),
    ("checksum_stored", _flip(lambda im: 13), "checksum mismatch: stored CRC-32", False),
    ("too_many_tensors", lambda im: im.set("count", TB), "too many tensors: 1099511627776 (limit 1048576)", True),
    ("terabyte_table", lambda im: im.set("table_size", TB), "tensor table (1099511627776 bytes) extends past the end of the file", True),
    ("metadata_too_large", lambda im: im.set("meta_size", 16 * TB), "metadata too large: 17592186044416 bytes (limit 67108864)", True),
    ("metadata_outside", lambda im: im.set("meta_size", len(im.buf) - im.header["metadata_offset"] + 1), "extends past the end of the file", True),
    ("bad_data_offset", lambda im: im.set("data_offset", im.get("data_offset") + 64), "bad data offset", True),
    ("table_too_small", lambda im: im.set("count", im.get("table_size") // 24 + 1), "tensor table too small", True),
    ("table_truncated_entry", lambda im: im.set("count", im.get("count") + 1), "tensor table truncated in entry #4", True),
    ("table_unused_bytes", lambda im: im.set("count", im.get("count") - 1), "tensor table has 48 unused bytes after the last entry", True),
    ("empty_name", lambda im: im.set_entry("a", "name_len", 0), "tensor #0: empty name", True),
    ("long_name", lambda im: im.set_entry("a", "name_len", 5000), "tensor #0: name length 5000 exceeds the limit 1024", True),
    ("ndim_limit", lambda im: im.set_entry("b", "ndim", 33), "tensor #1: ndim 33 exceeds the limit 32", True),
    ("reserved_field", lambda im: im.set_entry("a", "reserved", 7), "tensor #0: reserved field is 7 (must be 0)", True),
    ("name_bad_utf8", lambda im: im.buf.__setitem__(im.name_at("a"), 0xFF), "tensor #0: name is not valid UTF-8", True),
    ("duplicate_name", lambda im: im.buf.__setitem__(im.name_at("b"), ord("a")), "duplicate tensor name 'a'", True),
    ("unknown_dtype", lambda im: im.set_entry("b", "dtype", 99), "tensor 'b': unknown dtype code 99", True),
    ("zero_dtype", lambda im: im.set_entry("b", "dtype", 0), "tensor 'b': unknown dtype code 0", True),
    ("negative_dim", lambda im: im.set_dim("a", 0, -4), "tensor 'a': negative dimension in shape [-4, 4]", True),
    ("shape_overflow", _seq(lambda im: im.set_dim("a", 0, 1 << 62), lambda im: im.set_dim("a", 1, 1 << 62)),
     "tensor 'a': shape [4611686018427387904, 4611686018427387904] overflows a 64-bit byte count", True),
    ("shape_mismatch", lambda im: im.set_dim("a", 0, 5), "tensor 'a': shape [5, 4] of f32 needs 80 bytes but the table says 64", True),
    ("terabyte_tensor", _seq(lambda im: im.set_dim("a", 0, TB // 16), lambda im: im.set_entry("a", "nbytes", TB)),
     "tensor 'a': 1099511627776 bytes at offset", True),
    ("misaligned_offset", lambda im: im.set_entry("b", "offset", im.payload("b") + 8), "is not a multiple of 64", True),
    ("offset_outside", lambda im: im.set_entry("b", "offset", (len(im.buf) + 63) // 64 * 64 + 6400), "lie outside the payload area", True),
    ("offset_in_header", lambda im: im.set_entry("b", "offset", 0), "tensor 'b': 12 bytes at offset 0 lie outside the payload area", True),
    ("offset_wraps", lambda im: im.set_entry("b", "offset", 2 ** 64 - 64), "lie outside the payload area", True),
    ("overlap", lambda im: im.set_entry("b", "offset", im.payload("a") + 0), "tensors 'a' and 'b' overlap", True),
    ("overlap_tail", lambda im: im.set_entry("flag", "offset", im.payload("a") + 0),
     "tensors 'a' and 'flag' overlap", True),
    ("bad_bool", lambda im: im.buf.__setitem__(im.payload("flag") + 3, 7), "tensor 'flag': bool value 7 at element 3 (must be 0 or 1)", True),
    ("metadata_bad_utf8", lambda im: im.buf.__setitem__(im.header["metadata_offset"] + 10, 0xC0), "metadata is not valid UTF-8", True),
    ("metadata_surrogate", _meta(b'{"s":"\xed\xa0\x80"}'), "metadata is not valid UTF-8", True),
    ("metadata_bad_json", _meta(b'{"kind":]'), "metadata is not valid JSON", True),
    ("metadata_trailing_comma", _meta(b'{"a":1,}'), "metadata is not valid JSON", True),
    ("metadata_nan", _meta(b'{"x":NaN}'), "metadata is not valid JSON", True),
    ("metadata_control_char", _meta(b'{"x":"a\x01b"}'), "metadata is not valid JSON", True),
    ("metadata_bom", _meta(b'\xef\xbb\xbf{}'), "metadata is not valid JSON", True),
    ("metadata_empty_text", _meta(b''), "metadata is not valid JSON", True),
    ("metadata_not_object", _meta(b'[1, 2, 3]'), "metadata JSON must be an object, not array", True),
    ("metadata_string", _meta(b'"just text"'), "metadata JSON must be an object, not string", True),
    ("metadata_too_deep", _meta(b'{"a":' + b"[" * 256 + b"]" * 256 + b"}"), "metadata JSON is nested deeper than 256 levels", True),
    ("metadata_long_number", _meta(b'{"n":' + b"1" * 4001 + b"}"), "metadata JSON has a number longer than 4000 characters", True),
]


def corrupt_base_image(tmp_dir):
    path = os.path.join(tmp_dir, "kdtr_corrupt_base.kdtr")
    kdtr.save_kdtr(path, corrupt_base_arrays(), CORRUPT_BASE_METADATA)
    with open(path, "rb") as f:
        return f.read()


def make_corrupt(base, mutate, reseal):
    """The bytes of one corrupt file: ``base`` mutated, checksum recomputed if ``reseal``."""
    im = Image(base)
    mutate(im)
    if reseal:
        kdtr._reseal(im.buf)
    return bytes(im.buf)


def generate(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    kdtr.save_kdtr(os.path.join(out_dir, "kdtr_golden_all.kdtr"), golden_arrays(), GOLDEN_METADATA)
    kdtr.save_kdtr(os.path.join(out_dir, "kdtr_golden_many.kdtr"), many_arrays(), {"n": 300})
    kdtr.save_kdtr(os.path.join(out_dir, "kdtr_golden_empty.kdtr"), {})
    base = corrupt_base_image(out_dir)
    lines = []
    for case, mutate, expected, reseal in CORRUPTIONS:
        with open(os.path.join(out_dir, f"kdtr_corrupt_{case}.kdtr"), "wb") as f:
            f.write(make_corrupt(base, mutate, reseal))
        lines.append(f"{case}\t{expected}\n")
    with open(os.path.join(out_dir, "kdtr_corrupt.tsv"), "w", encoding="utf-8") as f:
        f.writelines(lines)


if __name__ == "__main__":
    import sys

    generate(sys.argv[1] if len(sys.argv) > 1 else "golden")
