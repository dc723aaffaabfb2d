"""KDTR container: the Python writer and reader (format: docs/kdtr.md).

    kn.save_kdtr(path, {name: ndarray | Bf16}, metadata=None)   # atomic: temp file + rename
    arrays, meta = kn.load_kdtr(path, mmap=True, verify=True)   # read-only views of an mmap

The C++ reader (cpp/kdtr.cpp) applies the same checks in the same order with the same messages;
tests/python/test_kdtr*.py compare the two. Corrupt input raises KdtrError (a ValueError)
whose message names the file and the problem.
"""
import errno
import json
import math
import mmap as _mmap
import os
import stat as _stat
import struct
import tempfile
import zlib
from collections.abc import Mapping

import numpy as np

MAGIC = b"\x89KDTR\r\n\x1a"
VERSION = 1
HEADER_SIZE = 64
ALIGN = 64
MAX_TENSORS = 1 << 20
MAX_NAME_LEN = 1024
MAX_NDIM = 32
MAX_METADATA = 64 << 20
MAX_JSON_DEPTH = 256
MAX_JSON_NUMBER_LEN = 4000
ENTRY_FIXED = 24  # name_len u32, dtype u8, ndim u8, reserved u16, data_offset u64, nbytes u64

_HEADER = struct.Struct("<8sIIQQQQQQ")  # magic version crc file_size count table meta data flags
_ENTRY = struct.Struct("<IBBHQQ")
assert _HEADER.size == HEADER_SIZE and _ENTRY.size == ENTRY_FIXED

# code -> (name, numpy dtype of the payload). bf16 is carried as little-endian uint16 bits.
DTYPES = {
    1: ("f32", np.dtype("<f4")),
    2: ("f16", np.dtype("<f2")),
    3: ("bf16", np.dtype("<u2")),
    4: ("f64", np.dtype("<f8")),
    5: ("i8", np.dtype("i1")),
    6: ("u8", np.dtype("u1")),
    7: ("i16", np.dtype("<i2")),
    8: ("i32", np.dtype("<i4")),
    9: ("i64", np.dtype("<i8")),
    10: ("bool", np.dtype("?")),
    11: ("u16", np.dtype("<u2")),
    12: ("u32", np.dtype("<u4")),
    13: ("u64", np.dtype("<u8")),
}
_BF16 = 3
_BOOL = 10
_CODE_OF_KIND = {  # (numpy kind, itemsize) -> code, for every dtype but bf16
    ("f", 4): 1, ("f", 2): 2, ("f", 8): 4,
    ("i", 1): 5, ("i", 2): 7, ("i", 4): 8, ("i", 8): 9,
    ("u", 1): 6, ("u", 2): 11, ("u", 4): 12, ("u", 8): 13,
    ("b", 1): 10,
}


class KdtrError(ValueError):
    """A KDTR file is corrupt or not a KDTR file; the message names the file and the problem."""


class Bf16:
    """A bfloat16 tensor carried as its raw bits (NumPy has no bfloat16).

    ``bits`` is a uint16 array of the same shape. ``np.asarray(x)`` / ``x.to_float32()`` widen
    exactly to float32; ``Bf16.from_float32(a)`` rounds to nearest even (NaN stays NaN).
    """

    __slots__ = ("bits",)

    def __init__(self, bits):
        bits = np.asarray(bits)
        if bits.dtype != np.uint16:
            raise TypeError(f"Bf16 wants the raw bits as a uint16 array, got {bits.dtype}")
        self.bits = bits

    @classmethod
    def from_float32(cls, values):
        u = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        nan = np.isnan(np.asarray(values, dtype=np.float32))
        bits = np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)
        return cls(bits)

    def to_float32(self):
        return (self.bits.astype(np.uint32) << 16).view(np.float32)

    def __array__(self, dtype=None, copy=None):
        f = self.to_float32()
        return f if dtype is None else f.astype(dtype)

    shape = property(lambda self: self.bits.shape)
    ndim = property(lambda self: self.bits.ndim)
    size = property(lambda self: self.bits.size)
    nbytes = property(lambda self: self.bits.nbytes)

    def __repr__(self):
        return f"Bf16(shape={self.shape}, values={self.to_float32()!r})"


# ----------------------------------------------------------------------------------- writer

def _round_up(n, a=ALIGN):
    return (n + a - 1) // a * a


def _payload(name, value):
    """(dtype code, C-contiguous little-endian ndarray of the payload) for one tensor."""
    if isinstance(value, Bf16):
        return _BF16, np.asarray(value.bits, dtype="<u2", order="C")
    if not isinstance(value, (np.ndarray, np.generic)):
        raise TypeError(f"tensor '{name}': expected a numpy array or kdtr.Bf16, got {type(value).__name__}")
    arr = np.asarray(value)
    if arr.dtype.name == "bfloat16":  # ml_dtypes.bfloat16
        return _BF16, np.asarray(arr, order="C").view(np.uint16).astype("<u2", copy=False)
    code = _CODE_OF_KIND.get((arr.dtype.kind, arr.dtype.itemsize))
    if code is None:
        supported = ", ".join(n for n, _ in DTYPES.values())
        raise TypeError(f"tensor '{name}': dtype {arr.dtype} is not supported by KDTR ({supported})")
    if code == _BOOL:  # a bool array made by .view() can hold bytes other than 0/1
        return code, np.asarray(arr.view(np.uint8) != 0, order="C")
    return code, np.asarray(arr, dtype=DTYPES[code][1], order="C")  # (ascontiguousarray makes 0-d 1-d)


def _encode_metadata(metadata):
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        text = json.dumps(dict(metadata), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except TypeError as e:
        raise TypeError(f"metadata is not JSON-serialisable: {e}") from None
    except ValueError as e:
        raise ValueError(f"metadata is not valid JSON: {e}") from None
    except RecursionError:  # (nested far deeper than the readers' limit: the encoder ran out of stack)
        raise KdtrError(f"cannot write KDTR: metadata JSON is nested deeper than {MAX_JSON_DEPTH} levels") from None
    try:
        blob = text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("metadata holds a string that is not valid Unicode (a lone surrogate)") from None
    if len(blob) > MAX_METADATA:
        raise ValueError(f"metadata too large: {len(blob)} bytes (limit {MAX_METADATA})")
    _decode_metadata(blob, "cannot write KDTR")  # the limits readers enforce (depth, number length)
    return blob


def save_kdtr(path, arrays, metadata=None):
    """Write ``arrays`` ({name: ndarray or Bf16}) and ``metadata`` (a JSON-able dict) to ``path``.

    The file is written to a temporary file next to ``path``, fsynced and renamed over it, so
    readers never see a half-written file. ``path`` is a str, bytes or os.PathLike, as for open().
    """
    path = os.fsdecode(os.fspath(path))
    if not path:  # (open("") fails the same way; refused before a temporary file is made)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    if path.endswith(os.sep) or (os.altsep and path.endswith(os.altsep)) or _is_dir_entry(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if not isinstance(arrays, Mapping):
        raise TypeError(f"arrays must be a dict of name -> array, got {type(arrays).__name__}")
    if len(arrays) > MAX_TENSORS:
        raise ValueError(f"too many tensors: {len(arrays)} (limit {MAX_TENSORS})")
    tensors = []  # (name bytes, code, ndarray)
    for name, value in arrays.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}: {name!r}")
        try:
            name_b = name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"tensor name {name!r} is not valid Unicode") from None
        if not 1 <= len(name_b) <= MAX_NAME_LEN:
            raise ValueError(f"tensor name {name[:40]!r}: length {len(name_b)} bytes is outside 1..{MAX_NAME_LEN}")
        code, arr = _payload(name, value)
        if arr.ndim > MAX_NDIM:
            raise ValueError(f"tensor '{name}': ndim {arr.ndim} exceeds the limit {MAX_NDIM}")
        tensors.append((name_b, code, arr))
    meta = _encode_metadata(metadata)

    table_size = sum(ENTRY_FIXED + 8 * a.ndim + _round_up(len(n), 8) for n, _, a in tensors)
    data_offset = _round_up(HEADER_SIZE + table_size + len(meta))
    offsets, cursor = [], data_offset
    for _, _, arr in tensors:
        offsets.append(cursor)
        cursor = _round_up(cursor + arr.nbytes)
    file_size = offsets[-1] + tensors[-1][2].nbytes if tensors else data_offset

    table = bytearray()
    for (name_b, code, arr), off in zip(tensors, offsets):
        table += _ENTRY.pack(len(name_b), code, arr.ndim, 0, off, arr.nbytes)
        table += struct.pack(f"<{arr.ndim}q", *arr.shape)
        table += name_b + bytes(_round_up(len(name_b), 8) - len(name_b))
    assert len(table) == table_size
    head = _HEADER.pack(MAGIC, VERSION, 0, file_size, len(tensors), table_size, len(meta), data_offset, 0)

    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    except OSError as e:  # (name the target, not the temporary file the caller never asked for)
        raise _retarget(e, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            crc = 0

            def put(chunk):
                nonlocal crc
                crc = zlib.crc32(chunk, crc)
                f.write(chunk)

            f.write(head[:16])
            put(head[16:])
            put(table)
            put(meta)
            put(bytes(data_offset - (HEADER_SIZE + table_size + len(meta))))
            pos = data_offset
            for (_, _, arr), off in zip(tensors, offsets):
                put(bytes(off - pos))
                put(arr.reshape(-1).view(np.uint8))
                pos = off + arr.nbytes
            assert pos == file_size == f.tell()
            f.seek(12)
            f.write(struct.pack("<I", crc))
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        try:
            os.replace(tmp, path)
        except OSError as e:
            raise _retarget(e, path) from None
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename durable; best effort (not every filesystem allows it)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _is_dir_entry(path):
    """Whether ``path`` itself is a directory (a symlink to one is replaced like any other entry)."""
    try:
        return _stat.S_ISDIR(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


def _retarget(error, path):
    """The same OSError, naming ``path`` (the target) instead of the writer's temporary file."""
    if error.errno is None:
        return error
    return type(error)(error.errno, error.strerror, path)


# ----------------------------------------------------------------------------------- reader

class _NumberTooLong(Exception):
    pass


class _BadConstant(Exception):
    pass


def _json_int(s):
    if len(s) > MAX_JSON_NUMBER_LEN:
        raise _NumberTooLong
    return int(s)


class _NumberOutOfRange(Exception):
    pass


def _json_float(s):
    if len(s) > MAX_JSON_NUMBER_LEN:
        raise _NumberTooLong
    value = float(s)
    if math.isinf(value):  # (e.g. 1e400: float() would make it inf, which JSON cannot express)
        raise _NumberOutOfRange
    return value


def _json_constant(s):
    raise _BadConstant(s)


def _json_depth_ok(value):
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                return False
            children = v.values() if isinstance(v, dict) else v
            stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return True


_JSON_TYPE = {dict: "object", list: "array", str: "string", int: "number", float: "number",
              bool: "boolean", type(None): "null"}


def _decode_metadata(blob, where):
    """Parse the metadata blob with the readers' rules; raises KdtrError("<where>: ...")."""
    try:
        text = bytes(blob).decode("utf-8")
    except UnicodeDecodeError:
        raise KdtrError(f"{where}: metadata is not valid UTF-8") from None
    try:
        value = json.loads(text, parse_int=_json_int, parse_float=_json_float, parse_constant=_json_constant)
    except json.JSONDecodeError as e:
        raise KdtrError(f"{where}: metadata is not valid JSON: {e}") from None
    except _BadConstant as e:
        raise KdtrError(f"{where}: metadata is not valid JSON: {e} is not allowed") from None
    except _NumberTooLong:
        raise KdtrError(f"{where}: metadata JSON has a number longer than {MAX_JSON_NUMBER_LEN} characters") from None
    except _NumberOutOfRange:
        raise KdtrError(f"{where}: metadata JSON has a number outside the float64 range") from None
    except RecursionError:
        raise KdtrError(f"{where}: metadata JSON is nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not _json_depth_ok(value):
        raise KdtrError(f"{where}: metadata JSON is nested deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(value, dict):
        raise KdtrError(f"{where}: metadata JSON must be an object, not {_JSON_TYPE[type(value)]}")
    return value


class _Entry:
    __slots__ = ("index", "pos", "name", "code", "shape", "offset", "nbytes")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)

    @property
    def dtype_name(self):
        return DTYPES[self.code][0]


def _first_bad_bool(buf, offset, nbytes):
    """(index, byte) of the first byte > 1 in buf[offset:offset+nbytes], or None. Keeps no view
    of ``buf`` alive afterwards (an exported view would stop the mmap from closing)."""
    raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=offset)
    bad = np.flatnonzero(raw > 1)
    return (int(bad[0]), int(raw[bad[0]])) if bad.size else None


def _quote(name):
    """A tensor name as messages show it: control characters, DEL, backslash and the apostrophe
    as \\xNN, everything else as is (the C++ reader quotes the same way)."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 0x20 or c in "\x7f\\'" else c for c in name)


def _shape_str(shape):
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _check_header(head, size, where):
    """Checks 1-5 of docs/kdtr.md "Validation", those that need only the file's ``size`` and its
    first 64 bytes ``head`` (read only when size >= 64). Returns (version, crc, file_size,
    tensor_count, table_size, metadata_size, data_offset)."""
    if size < HEADER_SIZE:
        raise KdtrError(f"{where}: truncated file: {size} bytes is smaller than the {HEADER_SIZE}-byte KDTR header")
    magic, version, crc, file_size, count, table_size, meta_size, data_offset, flags = _HEADER.unpack_from(head, 0)
    problem = None
    if magic != MAGIC:
        problem = "bad magic: not a KDTR file"
    elif version != VERSION:
        problem = f"unsupported KDTR format version {version} (this reader reads version {VERSION})"
    elif flags != 0:
        problem = f"unsupported header flags {flags} (must be 0 in version {VERSION})"
    elif file_size > size:
        problem = f"truncated file: the header says {file_size} bytes but the file has {size}"
    elif file_size < size:
        problem = f"trailing bytes: the header says {file_size} bytes but the file has {size}"
    if problem:
        raise KdtrError(f"{where}: {problem}")
    return version, crc, file_size, count, table_size, meta_size, data_offset


def _parse(buf, where="<buffer>", verify=True):
    """Validate a whole KDTR image (any buffer: bytes, mmap) without copying payloads.

    Returns (header dict, [_Entry], metadata dict); raises KdtrError naming the problem.
    The checks and their order are those of docs/kdtr.md and of cpp/kdtr.cpp.
    """
    def fail(msg):
        raise KdtrError(f"{where}: {msg}")

    size = len(buf)
    version, crc, file_size, count, table_size, meta_size, data_offset = _check_header(buf, size, where)
    if verify:
        with memoryview(buf) as mv:
            computed = zlib.crc32(mv[16:size])
        if computed != crc:
            fail(f"checksum mismatch: stored CRC-32 {crc:08x}, computed {computed:08x}")
    if count > MAX_TENSORS:
        fail(f"too many tensors: {count} (limit {MAX_TENSORS})")
    if table_size > size - HEADER_SIZE:
        fail(f"tensor table ({table_size} bytes) extends past the end of the file")
    meta_offset = HEADER_SIZE + table_size
    if meta_size > MAX_METADATA:
        fail(f"metadata too large: {meta_size} bytes (limit {MAX_METADATA})")
    if meta_size > size - meta_offset:
        fail(f"metadata ({meta_size} bytes at offset {meta_offset}) extends past the end of the file")
    expected = _round_up(meta_offset + meta_size)
    if data_offset != expected:
        fail(f"bad data offset {data_offset}: expected {expected} (metadata end rounded up to {ALIGN})")
    if data_offset > size:
        fail(f"data offset {data_offset} is past the end of the file ({size} bytes)")
    if count * ENTRY_FIXED > table_size:
        fail(f"tensor table too small: {table_size} bytes cannot hold {count} entries")

    entries, names = [], set()
    pos, table_end = HEADER_SIZE, HEADER_SIZE + table_size
    for i in range(count):
        if table_end - pos < ENTRY_FIXED:
            fail(f"tensor table truncated in entry #{i}")
        name_len, code, ndim, reserved, offset, nbytes = _ENTRY.unpack_from(buf, pos)
        if name_len == 0:
            fail(f"tensor #{i}: empty name")
        if name_len > MAX_NAME_LEN:
            fail(f"tensor #{i}: name length {name_len} exceeds the limit {MAX_NAME_LEN}")
        if ndim > MAX_NDIM:
            fail(f"tensor #{i}: ndim {ndim} exceeds the limit {MAX_NDIM}")
        if reserved != 0:
            fail(f"tensor #{i}: reserved field is {reserved} (must be 0)")
        entry_size = ENTRY_FIXED + 8 * ndim + _round_up(name_len, 8)
        if table_end - pos < entry_size:
            fail(f"tensor table truncated in entry #{i}")
        shape = struct.unpack_from(f"<{ndim}q", buf, pos + ENTRY_FIXED)
        name_at = pos + ENTRY_FIXED + 8 * ndim
        try:
            name = bytes(buf[name_at:name_at + name_len]).decode("utf-8")
        except UnicodeDecodeError:
            fail(f"tensor #{i}: name is not valid UTF-8")
        if name in names:
            fail(f"duplicate tensor name '{_quote(name)}'")
        names.add(name)
        tensor = f"tensor '{_quote(name)}'"
        if code not in DTYPES:
            fail(f"{tensor}: unknown dtype code {code}")
        if any(d < 0 for d in shape):
            fail(f"{tensor}: negative dimension in shape {_shape_str(shape)}")
        # NumPy's rule: itemsize * (product of the non-zero dims) must fit in int64, so even an
        # empty tensor cannot carry absurd dimensions.
        need = DTYPES[code][1].itemsize
        for d in shape:
            need *= max(d, 1)
        if need > (1 << 63) - 1:
            fail(f"{tensor}: shape {_shape_str(shape)} overflows a 64-bit byte count")
        if 0 in shape:
            need = 0
        if need != nbytes:
            fail(f"{tensor}: shape {_shape_str(shape)} of {DTYPES[code][0]} needs {need} bytes "
                 f"but the table says {nbytes}")
        if offset % ALIGN:
            fail(f"{tensor}: data offset {offset} is not a multiple of {ALIGN}")
        if offset < data_offset or offset > size or nbytes > size - offset:
            fail(f"{tensor}: {nbytes} bytes at offset {offset} lie outside the payload area "
                 f"[{data_offset}, {size})")
        entries.append(_Entry(index=i, pos=pos, name=name, code=code, shape=shape, offset=offset, nbytes=nbytes))
        pos += entry_size
    if pos != table_end:
        fail(f"tensor table has {table_end - pos} unused bytes after the last entry")

    spans = sorted((e for e in entries if e.nbytes), key=lambda e: (e.offset, e.index))
    for a, b in zip(spans, spans[1:]):
        if a.offset + a.nbytes > b.offset:
            fail(f"tensors '{_quote(a.name)}' and '{_quote(b.name)}' overlap")

    for e in entries:
        if e.code == _BOOL and e.nbytes:
            bad = _first_bad_bool(buf, e.offset, e.nbytes)
            if bad is not None:
                fail(f"tensor '{_quote(e.name)}': bool value {bad[1]} at element {bad[0]} (must be 0 or 1)")

    meta = _decode_metadata(buf[meta_offset:meta_offset + meta_size], where)
    header = dict(version=version, crc=crc, file_size=file_size, tensor_count=count, table_size=table_size,
                  metadata_offset=meta_offset, metadata_size=meta_size, data_offset=data_offset)
    return header, entries, meta


def _open_regular(path):
    """``open(path, "rb")`` for a regular file only: anything else (a FIFO, a device, a directory)
    raises KdtrError "<path>: not a regular file", as the C++ reader does. The open does not block
    (O_NONBLOCK: opening a FIFO would wait for a writer); the check is on the opened file itself."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            raise KdtrError(f"{path}: not a regular file")
        os.set_blocking(fd, True)
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def load_kdtr(path, mmap=True, verify=True):
    """Read a KDTR file: returns ``(arrays, metadata)``, ``arrays`` in file order.

    mmap=True: arrays are read-only zero-copy views of a memory map of the file (the mapping
    lives as long as any array does). mmap=False: the file is read into memory once and the
    arrays are writable views of that buffer. bf16 tensors come back as ``Bf16``.
    verify=True checks the CRC-32 of the whole file (one pass over it); the structural checks
    always run. Corrupt files raise KdtrError (a ValueError) naming the problem.
    """
    path = os.fsdecode(os.fspath(path))
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if mmap and size > 0:
            buf = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_READ)
        else:
            head = f.read(HEADER_SIZE)  # (a file that is no KDTR file is refused before a big read)
            if len(head) == HEADER_SIZE:
                _check_header(head, size, path)
            f.seek(0)
            buf = bytearray(size)
            del buf[f.readinto(buf):]
    try:
        _, entries, meta = _parse(buf, path, verify)
    except BaseException:
        if isinstance(buf, _mmap.mmap):
            _close_quietly(buf)
        raise
    arrays = {}
    for e in entries:
        dt = DTYPES[e.code][1]
        if e.nbytes:
            arr = np.frombuffer(buf, dtype=dt, count=e.nbytes // dt.itemsize, offset=e.offset).reshape(e.shape)
        else:
            arr = np.zeros(e.shape, dtype=dt)
            arr.flags.writeable = not mmap
        arrays[e.name] = Bf16(arr) if e.code == _BF16 else arr
    return arrays, meta


def kdtr_table(path, verify=True):
    """The tensor table of a KDTR file, without touching payloads (beyond the checksum):
    a list of dicts name, dtype, shape, offset, nbytes — the same as ``_native.kdtr_table``."""
    path = os.fsdecode(os.fspath(path))
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        buf = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_READ) if size else b""
    try:
        _, entries, _ = _parse(buf, path, verify)
        return [dict(name=e.name, dtype=e.dtype_name, shape=tuple(e.shape), offset=e.offset, nbytes=e.nbytes)
                for e in entries]
    finally:
        if isinstance(buf, _mmap.mmap):
            _close_quietly(buf)


def _close_quietly(mm):
    try:
        mm.close()
    except BufferError:  # a view is still alive somewhere; the GC unmaps it later
        pass


def _reseal(image):
    """Recompute the checksum of a KDTR image in place (bytearray). For tests that craft
    structurally corrupt files which must get past the checksum."""
    struct.pack_into("<I", image, 12, zlib.crc32(memoryview(image)[16:]))
    return image
