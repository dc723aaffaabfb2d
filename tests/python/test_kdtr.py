"""KDTR container: Python writer/reader round trips, C++ reader == Python reader, and every
corruption class rejected by both with the same message (docs/kdtr.md)."""
import importlib.util
import json
import os
import pathlib
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

import kdtree_native as kn
from kdtree_native import _native, kdtr
from kdtree_native.kdtr import Bf16, KdtrError

_spec = importlib.util.spec_from_file_location(
    "golden_kdtr", pathlib.Path(__file__).resolve().parents[1] / "golden" / "golden_kdtr.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)

SHAPES = [(), (0,), (1,), (17,), (3, 0, 5), (3, 17), (2, 3, 1, 4)]
NUMPY_OF = {"f32": np.float32, "f16": np.float16, "f64": np.float64, "i8": np.int8, "u8": np.uint8,
            "i16": np.int16, "i32": np.int32, "i64": np.int64, "bool": np.bool_, "u16": np.uint16,
            "u32": np.uint32, "u64": np.uint64}
ALL_DTYPES = sorted(NUMPY_OF) + ["bf16"]


def random_tensor(dtype, shape, rng):
    if dtype == "bf16":
        return Bf16(rng.integers(0, 1 << 16, size=shape, dtype=np.uint16))
    t = NUMPY_OF[dtype]
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if np.issubdtype(t, np.integer):
        info = np.iinfo(t)
        return rng.integers(info.min, info.max, size=shape, dtype=t, endpoint=True)
    # Raw bit patterns: every float value incl. NaN payloads, inf, subnormals, -0.
    bits = rng.integers(0, 1 << (8 * np.dtype(t).itemsize), size=shape, dtype=f"u{np.dtype(t).itemsize}")
    return bits.view(t)


def raw(value):
    """(dtype name, shape, payload bytes) of a loaded tensor, for bitwise comparison."""
    if isinstance(value, Bf16):
        return "bf16", value.shape, value.bits.tobytes()
    return value.dtype.str, value.shape, value.tobytes()


def cpp_read(path, verify=True):
    """The C++ reader's view: ({name: (dtype name, shape, bytes)}, metadata dict)."""
    arrays, meta_json = _native.kdtr_read(str(path), verify)
    table = {e["name"]: e for e in _native.kdtr_table(str(path), verify)}
    assert list(table) == list(arrays)
    out = {}
    for name, a in arrays.items():
        assert not a.flags.writeable
        assert a.shape == table[name]["shape"]
        out[name] = (table[name]["dtype"], a.shape, a.tobytes())
    return out, json.loads(meta_json)


def assert_cpp_equals_python(path, py_arrays, py_meta, verify=True):
    cpp_arrays, cpp_meta = cpp_read(path, verify)
    assert list(cpp_arrays) == list(py_arrays)
    for name, value in py_arrays.items():
        dt, shape, data = raw(value)
        cdt, cshape, cdata = cpp_arrays[name]
        assert cshape == shape, name
        assert cdata == data, name
        expect = "bf16" if dt == "bf16" else kdtr.DTYPES[kdtr._CODE_OF_KIND[(np.dtype(dt).kind, np.dtype(dt).itemsize)]][0]
        assert cdt == expect, name
    assert cpp_meta == py_meta


def save_load(tmp_path, arrays, metadata=None, mmap=True, name="t.kdtr"):
    path = tmp_path / name
    kn.save_kdtr(path, arrays, metadata)
    loaded, meta = kn.load_kdtr(path, mmap=mmap)
    return path, loaded, meta


# ------------------------------------------------------------------------------ round trips

@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_roundtrip_every_dtype_and_shape(tmp_path, dtype, mmap):
    rng = np.random.default_rng(ALL_DTYPES.index(dtype))
    arrays = {f"{dtype}/{'x'.join(map(str, s)) or 'scalar'}": random_tensor(dtype, s, rng) for s in SHAPES}
    path, loaded, meta = save_load(tmp_path, arrays, {"dtype": dtype}, mmap=mmap)
    assert meta == {"dtype": dtype}
    assert list(loaded) == list(arrays)
    for name, value in arrays.items():
        got = loaded[name]
        if dtype == "bf16":
            assert isinstance(got, Bf16) and got.bits.dtype == np.uint16
        else:
            assert isinstance(got, np.ndarray) and got.dtype == np.dtype(NUMPY_OF[dtype])
        assert raw(got) == raw(value if dtype == "bf16" else np.asarray(value)), name
        bits = got.bits if dtype == "bf16" else got
        assert bits.flags.writeable == (not mmap)
    assert_cpp_equals_python(path, loaded, meta)


def test_golden_arrays_roundtrip(tmp_path):
    arrays = golden.golden_arrays()
    path, loaded, meta = save_load(tmp_path, arrays, golden.GOLDEN_METADATA)
    assert meta == golden.GOLDEN_METADATA
    assert loaded["bf16"].bits.tolist() == golden.BF16_BITS
    assert loaded["scalar_f32"].shape == () and loaded["scalar_f32"] == np.float32(42.5)
    assert loaded["empty_3d_i64"].shape == (3, 0, 2)
    with open(path, "rb") as f:
        data = f.read()
    meta_at = 64 + struct.unpack_from("<Q", data, 32)[0]
    assert data[meta_at:meta_at + len(golden.GOLDEN_METADATA_JSON.encode())] == golden.GOLDEN_METADATA_JSON.encode()
    assert_cpp_equals_python(path, loaded, meta)


def test_empty_dict_and_no_metadata(tmp_path):
    path, loaded, meta = save_load(tmp_path, {})
    assert loaded == {} and meta == {}
    assert os.path.getsize(path) == 128  # header + "{}" rounded up to 64
    assert _native.kdtr_read(str(path)) == ({}, "{}")


def test_many_tensors_and_big_shapes(tmp_path):
    rng = np.random.default_rng(7)
    arrays = {f"layer.{i}.w": rng.standard_normal((i % 7, 3)).astype(np.float32) for i in range(1000)}
    arrays["big"] = rng.standard_normal((1031, 1027)).astype(np.float32)  # ~4 MB
    arrays["big_i64"] = rng.integers(-(2 ** 62), 2 ** 62, size=(257, 129, 3))
    path, loaded, meta = save_load(tmp_path, arrays)
    assert list(loaded) == list(arrays)
    for name in arrays:
        np.testing.assert_array_equal(loaded[name], arrays[name])
    assert_cpp_equals_python(path, loaded, meta)


def test_metadata_roundtrip(tmp_path):
    meta = {"model": "K2-mini", "layers": 3, "big": 2 ** 70, "neg": -1.5e-300, "ok": True, "none": None,
            "nested": {"list": [1, [2, [3, {}]]], "empty": []}, "unicode": "h\u00e9llo \u2713 \U0001f600",
            "quotes": 'a"b\\c\n\t\u0001', "": "empty key"}
    path, loaded, got = save_load(tmp_path, {"x": np.zeros(2)}, meta)
    assert got == meta
    arrays, text = _native.kdtr_read(str(path))
    assert json.loads(text) == meta
    assert "\u2713" in text  # stored as UTF-8, not \u-escaped


def test_layout_alignment_and_views(tmp_path):
    rng = np.random.default_rng(1)
    arrays = {n: rng.standard_normal(k).astype(np.float32) for n, k in [("a", 1), ("b", 63), ("c", 65), ("d", 0), ("e", 7)]}
    path, loaded, _ = save_load(tmp_path, arrays)
    table = kdtr.kdtr_table(path)
    assert table == _native.kdtr_table(str(path))
    ends = []
    for e, a in zip(table, loaded.values()):
        assert e["offset"] % 64 == 0
        assert a.ctypes.data % 64 == 0 or a.size == 0  # zero-copy view of a page-aligned mapping
        ends.append(e["offset"] + e["nbytes"])
    assert os.path.getsize(path) == max(ends)


def test_64bit_offsets_sparse_file(tmp_path):
    """A payload ending past 4 GiB, in a sparse file (no 4 GiB of I/O): offsets, sizes and
    shapes are 64-bit in both readers. Built by hand; read without the checksum pass."""
    big_n = (1 << 32) + 3 * 64 + 5
    meta = b"{}"
    table_size = 2 * (24 + 8 + 8)
    data_offset = 64 * ((64 + table_size + len(meta) + 63) // 64)
    big_off = data_offset
    tail_off = 64 * ((big_off + big_n + 63) // 64)
    tail = np.arange(4, dtype="<i8")
    file_size = tail_off + tail.nbytes
    head = struct.pack("<8sIIQQQQQQ", kdtr.MAGIC, 1, 0, file_size, 2, table_size, len(meta), data_offset, 0)
    table = (struct.pack("<IBBHQQq", 3, 6, 1, 0, big_off, big_n, big_n) + b"big".ljust(8, b"\0")
             + struct.pack("<IBBHQQq", 4, 9, 1, 0, tail_off, tail.nbytes, 4) + b"tail".ljust(8, b"\0"))
    path = tmp_path / "sparse.kdtr"
    with open(path, "wb") as f:
        f.truncate(file_size)
        f.write(head + table + meta)
        f.seek(big_off + big_n - 5)
        f.write(b"HELLO")
        f.seek(tail_off)
        f.write(tail.tobytes())
    arrays, meta_out = kn.load_kdtr(path, verify=False)
    assert meta_out == {} and arrays["big"].shape == (big_n,)
    assert arrays["big"][-5:].tobytes() == b"HELLO" and arrays["big"][-6] == 0
    np.testing.assert_array_equal(arrays["tail"], tail)
    c_arrays, _ = _native.kdtr_read(str(path), False)
    assert c_arrays["big"].shape == (big_n,) and c_arrays["big"][-5:].tobytes() == b"HELLO"
    np.testing.assert_array_equal(c_arrays["tail"], tail)
    assert [e["offset"] for e in _native.kdtr_table(str(path), False)] == [big_off, tail_off]
    assert tail_off > 1 << 32


def test_mmap_views_are_read_only_and_copies_are_independent(tmp_path):
    path, loaded, _ = save_load(tmp_path, {"x": np.arange(5, dtype=np.int32)})
    with pytest.raises(ValueError):
        loaded["x"][0] = 9
    copy, _ = kn.load_kdtr(path, mmap=False)
    copy["x"][0] = 9
    again, _ = kn.load_kdtr(path)
    assert again["x"][0] == 0


def test_writer_normalises_inputs(tmp_path):
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    arrays = {
        "strided": base[:, ::2],
        "fortran": np.asfortranarray(base),
        "big_endian": base.astype(">f8"),
        "be_i32": np.arange(5, dtype=">i4"),
        "np_scalar": np.int16(-3),
        "transposed": base.T,
        "bool_bytes": np.frombuffer(b"\x00\x02\xff\x01", dtype=np.bool_),  # non-0/1 bytes: stored as 0/1
    }
    path, loaded, _ = save_load(tmp_path, arrays)
    for name, value in arrays.items():
        np.testing.assert_array_equal(loaded[name], value)
        assert loaded[name].dtype.byteorder in "=<|"
    assert loaded["np_scalar"].shape == ()
    assert_cpp_equals_python(path, loaded, {})


def test_pathlike_and_missing_file(tmp_path):
    p = tmp_path / "p.kdtr"
    kn.save_kdtr(p, {"x": np.ones(3, np.uint8)})
    assert kn.load_kdtr(p)[0]["x"].tolist() == [1, 1, 1]
    assert _native.kdtr_read(p)[0]["x"].tolist() == [1, 1, 1]
    with pytest.raises(FileNotFoundError):
        kn.load_kdtr(tmp_path / "missing.kdtr")
    with pytest.raises(ValueError, match="cannot open"):
        _native.kdtr_read(str(tmp_path / "missing.kdtr"))


def test_atomic_overwrite_and_failed_write_leaves_old_file(tmp_path, monkeypatch):
    p = tmp_path / "a.kdtr"
    kn.save_kdtr(p, {"x": np.array([1.0])})
    kn.save_kdtr(p, {"x": np.array([2.0])})
    assert kn.load_kdtr(p)[0]["x"].tolist() == [2.0]
    with pytest.raises(TypeError):
        kn.save_kdtr(p, {"y": np.array([3.0]), "bad": np.array([1j])})

    def broken_fsync(fd):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(kdtr.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        kn.save_kdtr(p, {"z": np.arange(1000)})
    monkeypatch.undo()
    assert kn.load_kdtr(p)[0]["x"].tolist() == [2.0]
    assert sorted(os.listdir(tmp_path)) == ["a.kdtr"]  # no temp file left behind
    assert (os.stat(p).st_mode & 0o777) == (0o666 & ~_umask())


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


@pytest.mark.parametrize("arrays, metadata, error, match", [
    ({"c": np.array([1j])}, None, TypeError, "dtype complex128 is not supported"),
    ({"o": np.array([object()])}, None, TypeError, "dtype object is not supported"),
    ({"s": np.array(["abc"])}, None, TypeError, "is not supported"),
    ({"t": np.array(["2020-01-01"], dtype="datetime64[D]")}, None, TypeError, "is not supported"),
    ({"l": [1, 2, 3]}, None, TypeError, "expected a numpy array or kdtr.Bf16, got list"),
    ({1: np.zeros(1)}, None, TypeError, "tensor names must be str"),
    ({"": np.zeros(1)}, None, ValueError, r"length 0 bytes is outside 1..1024"),
    ({"n" * 1025: np.zeros(1)}, None, ValueError, r"length 1025 bytes is outside 1..1024"),
    ({"\ud800": np.zeros(1)}, None, ValueError, "is not valid Unicode"),
    ({"x": np.zeros(1)}, [1, 2], TypeError, "metadata must be a dict"),
    ({"x": np.zeros(1)}, {"f": object()}, TypeError, "metadata is not JSON-serialisable"),
    ({"x": np.zeros(1)}, {"f": float("nan")}, ValueError, "metadata is not valid JSON"),
    ({"x": np.zeros(1)}, {"s": "\ud800"}, ValueError, "lone surrogate"),
    ({"x": np.zeros(1)}, {"deep": json.loads("[" * 300 + "]" * 300)}, ValueError, "nested deeper than 256"),
    ({"x": np.zeros(1)}, {"n": 10 ** 4000}, ValueError, "number longer than 4000"),
])
def test_writer_rejects(tmp_path, arrays, metadata, error, match):
    with pytest.raises(error, match=match):
        kn.save_kdtr(tmp_path / "w.kdtr", arrays, metadata)
    assert os.listdir(tmp_path) == []


def test_writer_rejects_non_dict_and_high_ndim(tmp_path):
    with pytest.raises(TypeError, match="arrays must be a dict"):
        kn.save_kdtr(tmp_path / "w.kdtr", [np.zeros(1)])
    if np.zeros((1,) * 33).ndim == 33:  # NumPy >= 2 allows 64 dims
        with pytest.raises(ValueError, match="ndim 33 exceeds the limit 32"):
            kn.save_kdtr(tmp_path / "w.kdtr", {"x": np.zeros((1,) * 33)})
    path, loaded, _ = save_load(tmp_path, {"x": np.zeros((1,) * 32, np.int8)})
    assert loaded["x"].ndim == 32
    assert_cpp_equals_python(path, loaded, {})


# ------------------------------------------------------------------------------ bf16

def test_bf16_conversion():
    x = np.array(golden.BF16_INPUTS, dtype=np.float32)
    b = Bf16.from_float32(x)
    assert b.bits.tolist() == golden.BF16_BITS
    assert np.asarray(b).dtype == np.float32
    np.testing.assert_array_equal(np.asarray(Bf16.from_float32(np.asarray(b))).view(np.uint32),
                                  np.asarray(b).view(np.uint32))  # bf16 values are fixed points
    specials = Bf16.from_float32(np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38], np.float32))
    f = specials.to_float32()
    assert np.isnan(f[:2]).all() and f[2] == np.inf and f[3] == -np.inf
    assert specials.bits[4] == 0 and specials.bits[5] == 0x8000
    assert f[6] == np.inf  # above the largest bf16 (3.39e38) rounds to inf
    # Round to nearest, ties to even, checked against float64 arithmetic on random inputs.
    rng = np.random.default_rng(3)
    v = rng.standard_normal(20000).astype(np.float32) * np.float32(1e3)
    bits = Bf16.from_float32(v).bits.astype(np.uint32)
    lo = ((v.view(np.uint32) >> 16) << 16).view(np.float32).astype(np.float64)
    got = (bits << 16).view(np.float32).astype(np.float64)
    hi = (((v.view(np.uint32) >> 16) + 1) << 16).view(np.float32).astype(np.float64)
    err = np.abs(got - v.astype(np.float64))
    assert np.all(err <= np.minimum(np.abs(v - lo), np.abs(hi - v)))
    with pytest.raises(TypeError, match="uint16"):
        Bf16(np.zeros(3, np.float32))


def test_ml_dtypes_bfloat16_input(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.array([1.0, -2.0, 0.5], dtype=ml_dtypes.bfloat16)
    _, loaded, _ = save_load(tmp_path, {"x": x})
    assert isinstance(loaded["x"], Bf16)
    np.testing.assert_array_equal(loaded["x"].to_float32(), [1.0, -2.0, 0.5])


# ------------------------------------------------------------------------------ checksum

def test_cpp_crc32_equals_zlib():
    rng = np.random.default_rng(5)
    assert _native.kdtr_crc32(b"123456789") == 0xCBF43926 == zlib.crc32(b"123456789")
    for n in list(range(0, 70)) + [1000, 4096, 1 << 20]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert _native.kdtr_crc32(data) == zlib.crc32(data), n
        assert _native.kdtr_crc32(data[n // 3:], _native.kdtr_crc32(data[:n // 3])) == zlib.crc32(data), n


# ------------------------------------------------------------------------------ corruption

@pytest.fixture(scope="module")
def corrupt_base(tmp_path_factory):
    return golden.corrupt_base_image(str(tmp_path_factory.mktemp("kdtr_base")))


def _same_problem(a, b):
    """Messages are identical except the free-form detail of a JSON syntax error."""
    key = "metadata is not valid JSON"
    if key in a or key in b:
        return a[:a.find(key) + len(key)] == b[:b.find(key) + len(key)]
    return a == b


def read_both(path, verify=True):
    """(python error or None, cpp error or None) for one file."""
    errors = []
    for reader in (lambda: kn.load_kdtr(path, verify=verify), lambda: _native.kdtr_read(str(path), verify)):
        try:
            reader()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


@pytest.mark.parametrize("case, mutate, expected, reseal", golden.CORRUPTIONS, ids=[c[0] for c in golden.CORRUPTIONS])
def test_corruption_rejected_by_both_readers(tmp_path, corrupt_base, case, mutate, expected, reseal):
    path = tmp_path / f"{case}.kdtr"
    path.write_bytes(golden.make_corrupt(corrupt_base, mutate, reseal))
    with pytest.raises(KdtrError) as py_err:
        kn.load_kdtr(path)
    with pytest.raises(ValueError) as cpp_err:
        _native.kdtr_read(str(path))
    py_msg, cpp_msg = str(py_err.value), str(cpp_err.value)
    assert py_msg.startswith(f"{path}: ") and expected in py_msg, py_msg
    assert cpp_msg.startswith(f"{path}: ") and expected in cpp_msg, cpp_msg
    assert _same_problem(py_msg, cpp_msg), (py_msg, cpp_msg)
    # The same with mmap=False (Python) and without the checksum (both): a structural problem is
    # still found; a damaged payload alone is not (only the CRC can see it).
    with pytest.raises(KdtrError):
        kn.load_kdtr(path, mmap=False)
    py_nv, cpp_nv = read_both(path, verify=False)
    if "checksum mismatch" in expected:
        assert (py_nv is None) == (cpp_nv is None)
    else:
        assert py_nv == py_msg and _same_problem(cpp_nv, cpp_msg)


def test_payload_flip_loads_without_verify(tmp_path, corrupt_base):
    path = tmp_path / "flip.kdtr"
    mutate = dict((c[0], c[1]) for c in golden.CORRUPTIONS)["checksum_payload"]
    path.write_bytes(golden.make_corrupt(corrupt_base, mutate, False))
    arrays, meta = kn.load_kdtr(path, verify=False)
    assert not np.array_equal(arrays["a"], golden.corrupt_base_arrays()["a"])
    np.testing.assert_array_equal(arrays["b"], golden.corrupt_base_arrays()["b"])
    assert_cpp_equals_python(path, arrays, meta, verify=False)


def test_validation_message_for_not_a_kdtr_file(tmp_path):
    p = tmp_path / "x.kdtr"
    p.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match=r"x\.kdtr: bad magic: not a KDTR file"):
        kn.load_kdtr(p)
    with pytest.raises(ValueError, match=r"x\.kdtr: bad magic: not a KDTR file"):
        _native.kdtr_read(str(p))


# Metadata texts at the edges of the JSON rules: both readers must agree on each.
JSON_CASES = [
    (b'{}', True), (b' \t\r\n{ }\n', True), (b'{"a":1,"a":2}', True), (b'{"":0}', True),
    (b'{"e":"\\u00e9\\ud83d\\ude00\\ud800\\/\\b\\f\\n\\r\\t\\"\\\\"}', True), (b'{"del":"\x7f"}', True),
    (b'{"n":[-0,0.5,1e5,1E+5,-2.5e-3,123456789012345678901234567890]}', True),
    (b'{"n":1.}', False), (b'{"n":01}', False), (b'{"n":-}', False), (b'{"n":.5}', False), (b'{"n":1e}', False),
    (b'{"n":+1}', False), (b'{"n":0x10}', False), (b'{"t":tru}', False), (b'{"t":nul}', False),
    (b'{"t":True}', False), (b'{"x":Infinity}', False), (b'{"x":-Infinity}', False), (b"{'a':1}", False),
    (b'{"a":"\\x41"}', False), (b'{"a":"\\u12"}', False), (b'{"a":"\\u12G4"}', False), (b'{"a":"tab\there"}', False),
    (b'{"a":1}}', False), (b'{"a":1} x', False), (b'{"a" 1}', False), (b'{"a":[1 2]}', False), (b'{a:1}', False),
    (b'{"a":[1,]}', False), (b'{,}', False), (b'{"a":"unterminated}', False), (b'\x0c{}', False),
    (b'{"a":' + b"[" * 255 + b"]" * 255 + b"}", True), (b'{"a":' + b"[" * 256 + b"]" * 256 + b"}", False),
    (b'{"a":' + b'{"b":' * 255 + b"0" + b"}" * 255 + b"}", True),
    (b'{"a":' + b'{"b":' * 256 + b"0" + b"}" * 256 + b"}", False),
    (b'{"n":' + b"7" * 4000 + b"}", True), (b'{"n":' + b"7" * 4001 + b"}", False),
    (b'{"n":-' + b"7" * 3999 + b"}", True), (b'{"n":1.' + b"5" * 3998 + b"}", True), (b'{"n":1.' + b"5" * 3999 + b"}", False),
    (b'{"n":' + b"7" * 4001 + b".}", False), (b'true', False), (b'null', False), (b'12', False), (b'[{}]', False),
    # numbers that overflow a float64 (Python's float() makes them inf) are refused; integers of any
    # length (up to 4000 characters) and underflow to 0 are fine
    (b'{"x":1e400}', False), (b'{"x":-1e400}', False), (b'{"x":1E+309}', False), (b'{"x":1.7976931348623159e308}', False),
    (b'{"x":' + b"9" * 400 + b'.0}', False), (b'{"x":0.0000001e316}', False), (b'{"x":[1,2,1e99999999999999999999]}', False),
    (b'{"x":1.7976931348623158e308}', True), (b'{"x":0.0000001e315}', True), (b'{"x":' + b"9" * 400 + b'}', True),
    (b'{"x":1e-400}', True), (b'{"x":-1e-99999999999999999999}', True), (b'{"x":0e99999}', True),
]


@pytest.mark.parametrize("text, valid", JSON_CASES, ids=[str(i) for i in range(len(JSON_CASES))])
def test_metadata_json_rules_agree(tmp_path, corrupt_base, text, valid):
    path = tmp_path / "m.kdtr"
    path.write_bytes(golden.make_corrupt(corrupt_base, golden._meta(text), True))
    py_err, cpp_err = read_both(path)
    assert (py_err is None) == valid, py_err
    assert (cpp_err is None) == valid, cpp_err
    if valid:
        assert kn.load_kdtr(path)[1] == json.loads(_native.kdtr_read(str(path))[1])
    else:
        assert _same_problem(py_err, cpp_err) or ("metadata" in py_err and "metadata" in cpp_err), (py_err, cpp_err)


def test_metadata_number_overflowing_a_double_is_refused(tmp_path, corrupt_base):
    """1e400 used to load as inf in Python (the C++ reader passed it on as text): JSON has no
    infinity, so both readers refuse it with the same message, and so does the writer's check."""
    path = tmp_path / "inf.kdtr"
    path.write_bytes(golden.make_corrupt(corrupt_base, golden._meta(b'{"ok":1.5,"x":1e400}'), True))
    py_err, cpp_err = read_both(path)
    assert py_err == cpp_err == f"{path}: metadata JSON has a number outside the float64 range"
    with pytest.raises(KdtrError, match="cannot write KDTR: metadata JSON has a number outside the float64 range"):
        kdtr._decode_metadata(b'{"x":1e400}', "cannot write KDTR")


# ------------------------------------------------------------------------------ paths

def test_readers_refuse_a_fifo_without_blocking(tmp_path):
    """Opening a FIFO for reading waits for a writer: both readers used to hang forever on one.
    They now refuse it (and any non-regular file) at once, with the same message. Run in a
    subprocess so that a regression fails on the timeout instead of hanging the suite."""
    fifo = tmp_path / "fifo.kdtr"
    os.mkfifo(fifo)
    code = textwrap.dedent(f"""
        import kdtree_native as kn
        from kdtree_native import _native, kdtr
        path = {str(fifo)!r}
        for name, read in [("load_kdtr", kn.load_kdtr), ("load_kdtr_nomm", lambda p: kn.load_kdtr(p, mmap=False)),
                           ("kdtr_table", kdtr.kdtr_table), ("kdtr_read", _native.kdtr_read),
                           ("_native.kdtr_table", _native.kdtr_table)]:
            try:
                read(path)
                print(name, "loaded")
            except ValueError as e:
                print(name, type(e).__name__, e)
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines == [f"load_kdtr KdtrError {fifo}: not a regular file",
                     f"load_kdtr_nomm KdtrError {fifo}: not a regular file",
                     f"kdtr_table KdtrError {fifo}: not a regular file",
                     f"kdtr_read ValueError {fifo}: not a regular file",
                     f"_native.kdtr_table ValueError {fifo}: not a regular file"], r.stdout


@pytest.mark.parametrize("target", ["directory", "/dev/zero", "/dev/null"])
def test_readers_agree_on_non_regular_files(tmp_path, target):
    """A directory or a device: both readers say "not a regular file" (Python used to raise
    IsADirectoryError, or read /dev/zero as a 0-byte "truncated file")."""
    path = str(tmp_path) if target == "directory" else target
    if not os.path.exists(path):
        pytest.skip(f"no {path}")
    for mmap in (True, False):
        with pytest.raises(KdtrError, match="not a regular file") as e:
            kn.load_kdtr(path, mmap=mmap)
        assert str(e.value) == f"{path}: not a regular file"
    with pytest.raises(KdtrError, match="not a regular file"):
        kdtr.kdtr_table(path)
    with pytest.raises(ValueError) as e:
        _native.kdtr_read(path)
    assert str(e.value) == f"{path}: not a regular file"


def test_readers_refuse_an_embedded_nul(tmp_path):
    """The C++ reader used to open the path cut at the NUL (here: a valid file); both readers
    now raise ValueError as Python's open() does."""
    p = tmp_path / "ok.kdtr"
    kn.save_kdtr(p, {"a": np.arange(3, dtype=np.float32)})
    bad = str(p) + "\0.bak"
    for read in (kn.load_kdtr, kdtr.kdtr_table, _native.kdtr_read, _native.kdtr_table):
        with pytest.raises(ValueError, match="embedded null byte"):
            read(bad)
    with pytest.raises(ValueError, match="embedded null byte"):
        _native.kdtr_read(os.fsencode(bad))


def test_save_kdtr_takes_bytes_and_pathlike_paths(tmp_path):
    """save_kdtr(b"...") used to raise TypeError (str and bytes mixed in the temp file name);
    it takes what open() takes, as load_kdtr does."""
    p = os.fsencode(tmp_path / "b.kdtr")
    kn.save_kdtr(p, {"a": np.arange(3, dtype=np.int16)}, {"k": 1})
    for path in (p, os.fsdecode(p), pathlib.Path(os.fsdecode(p))):
        arrays, meta = kn.load_kdtr(path)
        assert arrays["a"].tolist() == [0, 1, 2] and meta == {"k": 1}
        assert _native.kdtr_read(path)[0]["a"].tolist() == [0, 1, 2]
    assert sorted(os.listdir(tmp_path)) == ["b.kdtr"]


@pytest.mark.skipif(sys.getfilesystemencoding().lower().replace("-", "") != "utf8",
                    reason="needs a UTF-8 filesystem encoding (surrogate escapes)")
def test_readers_take_a_path_that_is_not_utf8(tmp_path):
    """A file name with a byte that is not UTF-8: the C++ reader used to fail with a pybind11
    cast error for it (bytes or the os.fsdecode str). Both readers read it and name it alike."""
    raw = os.fsencode(tmp_path) + b"/n\xffame.kdtr"
    kn.save_kdtr(raw, {"a": np.arange(4, dtype=np.uint8)})
    for path in (raw, os.fsdecode(raw)):
        assert kn.load_kdtr(path)[0]["a"].tolist() == [0, 1, 2, 3]
        assert _native.kdtr_read(path)[0]["a"].tolist() == [0, 1, 2, 3]
        assert [e["name"] for e in _native.kdtr_table(path)] == ["a"]
    bad = raw[:-5] + b"-bad.kdtr"
    with open(bad, "wb") as f:
        f.write(b"PK\x03\x04" + bytes(100))
    py_err, cpp_err = read_both(os.fsdecode(bad))
    assert py_err == cpp_err == os.fsdecode(bad) + ": bad magic: not a KDTR file"
    with pytest.raises(ValueError, match="cannot open") as e:
        _native.kdtr_read(raw + b".missing")
    assert str(e.value).startswith(os.fsdecode(raw + b".missing") + ": cannot open")


def test_writer_path_errors_name_the_target(tmp_path, monkeypatch):
    """An empty path used to create (and remove) a temporary file in the current directory; a
    directory or a missing parent gave an error naming that temporary file. They are refused
    naming the path, as open() would, and leave nothing behind."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    arrays = {"a": np.ones(2)}
    with pytest.raises(FileNotFoundError) as e:
        kn.save_kdtr("", arrays)
    assert e.value.filename == ""
    target = tmp_path / "dir.kdtr"
    target.mkdir()
    for path in (target, str(target) + os.sep, str(tmp_path / "no_such_dir") + os.sep):
        with pytest.raises(IsADirectoryError) as e:
            kn.save_kdtr(path, arrays)
        assert e.value.filename == os.fspath(path) and ".tmp" not in str(e.value)
    missing = tmp_path / "no_such_dir" / "x.kdtr"
    with pytest.raises(FileNotFoundError) as e:
        kn.save_kdtr(missing, arrays)
    assert e.value.filename == str(missing) and ".tmp" not in str(e.value)
    assert os.listdir(work) == [] and os.listdir(target) == []
    assert sorted(os.listdir(tmp_path)) == ["cwd", "dir.kdtr"]


def test_writer_refuses_a_directory_that_appears_before_the_rename(tmp_path, monkeypatch):
    """If the target becomes a directory while the file is written, the error of the final rename
    names the target (not the temporary file), and the temporary file is removed."""
    target = tmp_path / "t.kdtr"
    real_fsync = os.fsync

    def fsync_then_mkdir(fd):
        real_fsync(fd)
        if not target.exists():
            target.mkdir()

    monkeypatch.setattr(kdtr.os, "fsync", fsync_then_mkdir)
    with pytest.raises(IsADirectoryError) as e:
        kn.save_kdtr(target, {"a": np.ones(2)})
    assert e.value.filename == str(target) and ".tmp" not in str(e.value)
    assert os.listdir(tmp_path) == ["t.kdtr"] and os.listdir(target) == []


def test_load_without_mmap_checks_the_header_before_reading(tmp_path, monkeypatch):
    """mmap=False used to allocate (and read) the whole file before looking at the magic: a huge
    file that is not a KDTR file raised MemoryError. Checks 1-5 now run on the header first.
    (A sparse 8 GiB file; the reader's bytearray allocations are watched.)"""
    big = 8 << 30
    allocations = []

    def watched_bytearray(*args):
        if args and isinstance(args[0], int):
            allocations.append(args[0])
            if args[0] > 1 << 30:
                raise MemoryError(f"bytearray({args[0]}) (test: a reader must not allocate this)")
        return bytearray(*args)

    monkeypatch.setattr(kdtr, "bytearray", watched_bytearray, raising=False)
    junk = tmp_path / "junk.bin"
    with open(junk, "wb") as f:
        f.write(b"PK\x03\x04" + bytes(60))
        f.truncate(big)
    with pytest.raises(KdtrError, match=r"junk\.bin: bad magic: not a KDTR file"):
        kn.load_kdtr(junk, mmap=False)
    lying = tmp_path / "lying.kdtr"  # a KDTR header that says 4096 bytes, on an 8 GiB file
    with open(lying, "wb") as f:
        f.write(struct.pack("<8sIIQQQQQQ", kdtr.MAGIC, 1, 0, 4096, 0, 0, 2, 128, 0))
        f.truncate(big)
    with pytest.raises(KdtrError, match=f"trailing bytes: the header says 4096 bytes but the file has {big}"):
        kn.load_kdtr(lying, mmap=False)
    assert all(n <= 1 << 30 for n in allocations), allocations
    p, loaded, _ = save_load(tmp_path, {"x": np.arange(5, dtype=np.int32)}, mmap=False)  # still reads
    assert loaded["x"].tolist() == [0, 1, 2, 3, 4] and loaded["x"].flags.writeable


def test_metadata_nested_far_too_deep_is_a_kdtr_error(tmp_path):
    """100,000 levels of nesting: the writer used to raise RecursionError from json.dumps; it now
    raises the container's own error, as both readers do for such a file."""
    deep = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(KdtrError, match="cannot write KDTR: metadata JSON is nested deeper than 256 levels"):
        kn.save_kdtr(tmp_path / "w.kdtr", {"x": np.zeros(1)}, {"deep": deep})
    assert os.listdir(tmp_path) == []
    path = tmp_path / "deep.kdtr"
    meta = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # (a file without tensors, by hand)
    data_offset = (64 + len(meta) + 63) // 64 * 64
    head = struct.pack("<8sIIQQQQQQ", kdtr.MAGIC, 1, 0, data_offset, 0, 0, len(meta), data_offset, 0)
    path.write_bytes(kdtr._reseal(bytearray(head + meta + bytes(data_offset - 64 - len(meta)))))
    with pytest.raises(KdtrError):
        kn.load_kdtr(path)
    py_err, cpp_err = read_both(path)
    assert py_err == cpp_err == f"{path}: metadata JSON is nested deeper than 256 levels"
