"""Fuzzing the KDTR readers: random truncations, byte flips and field rewrites of valid files.

Every case runs in a subprocess (batched: each worker process takes a range of cases, so a
crash -- segfault, abort, hang -- kills only that worker, and the parent names the first case
the worker did not report). Per case, both readers (Python kn.load_kdtr and C++
_native.kdtr_read) must either reject the file with a clean ValueError -- the same message from
both -- or load it, and then load exactly the same tensors and metadata. A mutation that the
checksum must catch (any flip or truncation of a file whose CRC is not recomputed, read with
verification on) must be rejected.

Cases are a pure function of (seed file, case index, FUZZ_SEED), so a failure is reproducible:
  python tests/python/test_kdtr_fuzz.py --replay <case index>   (prints the case and both outcomes)
Case count: KDTREE_KDTR_FUZZ_CASES (default 10000, about 10 s on 2 cores).
"""
import json
import os
import random
import re
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

FUZZ_SEED = 20260530
DEFAULT_CASES = 10000
WORKER_TIMEOUT_S = 600

# (kind, weight). "must reject" kinds leave the checksum stale and read with verification on.
KINDS = [("truncate", 12), ("flip", 14), ("flip_reseal", 18), ("flip_noverify", 8), ("field", 28),
         ("meta_byte", 8), ("payload_byte", 4), ("truncate_fix", 4), ("extend", 2), ("splice", 2),
         ("dup_name", 2)]
JSON_BYTES = b'{}[]",:\\ -+.0123456789eEtrufalsn\x00\x01\x7f\x80\xc0\xc3\xa9\xed\xef\xf0\xf4\xff\t\n'


# ------------------------------------------------------------------------------ seed files

def seed_arrays():
    """Small valid files: mutations should land in the structure, not only in payloads."""
    from kdtree_native.kdtr import Bf16

    rng = np.random.default_rng(FUZZ_SEED)
    return {
        "basic": ({"a": np.arange(16, dtype=np.float32).reshape(4, 4), "b": np.array([1, 2, 3], np.int32),
                   "flag": np.array([True, False, True]), "empty": np.zeros((0, 3), np.float32)},
                  {"kind": "basic", "list": [1, 2.5, None, True], "s": "h\u00e9"}),
        "dtypes": ({"f16": np.array([1.5, -2.0], np.float16), "bf16": Bf16.from_float32(np.array([1.0, 3.0], np.float32)),
                    "f64": np.array(0.25), "i8": np.array([-1, 2], np.int8), "u8": np.array([255], np.uint8),
                    "i16": np.array([-300], np.int16), "i64": np.array([[1], [2]], np.int64),
                    "u16": np.array([7], np.uint16), "u32": np.array([9], np.uint32), "u64": np.array([11], np.uint64),
                    "bools": rng.random((2, 5)) < 0.5},
                   {"dtypes": 11}),
        "empty": ({}, None),
        "many": ({f"t{i}": rng.integers(-9, 9, size=(i % 3,) * (i % 4)).astype(np.int16) for i in range(12)},
                 {"nested": {"deep": [[[{}]]]}, "n": -1.5e-7}),
    }


def write_seeds(directory):
    import kdtree_native as kn

    for name, (arrays, meta) in seed_arrays().items():
        kn.save_kdtr(os.path.join(directory, f"{name}.kdtr"), arrays, meta)


def load_seeds(directory):
    """{name: (bytes, fields)}: fields = (position, width) of every header/table field."""
    from kdtree_native import kdtr

    seeds = {}
    for name in sorted(seed_arrays()):
        with open(os.path.join(directory, f"{name}.kdtr"), "rb") as f:
            data = f.read()
        header, entries, _ = kdtr._parse(data, verify=True)
        fields = [(8, 4), (16, 8), (24, 8), (32, 8), (40, 8), (48, 8), (56, 8)]
        names, payloads = [], []
        offsets = [e.offset for e in entries]
        name_spans = [(e.pos + 24 + 8 * len(e.shape), len(e.name.encode())) for e in entries]
        for e in entries:
            p = e.pos
            fields += [(p, 4), (p + 4, 1), (p + 5, 1), (p + 6, 2), (p + 8, 8), (p + 16, 8)]
            fields += [(p + 24 + 8 * k, 8) for k in range(len(e.shape))]
            name_at = p + 24 + 8 * len(e.shape)
            names += range(name_at, name_at + len(e.name.encode()))
            payloads += range(e.offset, e.offset + e.nbytes)
        meta = list(range(header["metadata_offset"], header["metadata_offset"] + header["metadata_size"]))
        seeds[name] = dict(data=data, fields=fields, names=names, meta=meta, payloads=payloads,
                           offsets=offsets, name_spans=name_spans, struct_end=header["data_offset"])
    return seeds


# ------------------------------------------------------------------------------ cases

def _interesting(rng, width, orig, file_len, offsets):
    bits = 8 * width
    top = (1 << bits) - 1
    if offsets and width == 8 and rng.random() < 0.2:  # another tensor's payload: overlaps
        return rng.choice(offsets)
    v = rng.choice([0, 1, 2, 7, 8, 13, 14, 31, 32, 33, 63, 64, 65, 255, 1023, 1024, 1025,
                    orig - 1, orig + 1, orig - 8, orig + 8, orig - 64, orig + 64, orig * 2, orig // 2,
                    top, top - 63, 1 << (bits - 1), (1 << (bits - 1)) - 1, 1 << 31, 1 << 32, 1 << 40, 1 << 62,
                    file_len, file_len - orig, file_len + 64, rng.getrandbits(bits)])
    return v & top


def _reseal(buf):
    import zlib

    struct.pack_into("<I", buf, 12, zlib.crc32(memoryview(buf)[16:]) if len(buf) >= 16 else 0)


def make_case(seeds, i):
    """Case i: (file bytes, verify, must_reject, description). Pure function of i and FUZZ_SEED."""
    rng = random.Random(FUZZ_SEED * 1_000_003 + i)
    names = sorted(seeds)
    seed_name = names[i % len(names)]
    seed = seeds[seed_name]
    buf = bytearray(seed["data"])
    kind = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]
    if kind == "dup_name" and len(seed["name_spans"]) < 2:
        kind = "flip_reseal"
    verify, must_reject, reseal = True, False, True

    def some_positions():
        hot = seed["struct_end"] if rng.random() < 0.6 else len(buf)
        return sorted({rng.randrange(hot) for _ in range(rng.choice([1, 1, 1, 2, 3, 4]))})

    if kind == "truncate":
        limit = seed["struct_end"] + 64 if rng.random() < 0.5 else len(buf)
        n = rng.randrange(min(limit, len(buf)))
        del buf[n:]
        desc, must_reject, reseal, verify = f"truncate to {n} bytes", True, False, rng.random() < 0.8
    elif kind in ("flip", "flip_reseal", "flip_noverify"):
        flips = [(p, rng.randrange(1, 256)) for p in some_positions()]
        for p, x in flips:
            buf[p] ^= x
        desc = f"{kind} " + ", ".join(f"byte {p} ^= 0x{x:02x}" for p, x in flips)
        if kind == "flip":
            must_reject, reseal = True, False
        elif kind == "flip_noverify":
            verify, reseal = False, False
    elif kind == "field":
        pos, width = rng.choice(seed["fields"])
        orig = int.from_bytes(buf[pos:pos + width], "little")
        value = _interesting(rng, width, orig, len(buf), seed["offsets"])
        buf[pos:pos + width] = value.to_bytes(width, "little")
        desc = f"field at {pos} (u{8 * width}) {orig} -> {value}"
    elif kind == "dup_name":  # give one tensor the name of another (same length when possible)
        (dst, n), (src, m) = rng.sample(seed["name_spans"], 2)
        buf[dst:dst + min(n, m)] = buf[src:src + min(n, m)]
        desc = f"name at {dst} <- name at {src} ({min(n, m)} bytes)"
    elif kind == "meta_byte":
        pool = seed["meta"] + seed["names"]
        pos = rng.choice(pool)
        buf[pos] = rng.choice(JSON_BYTES)
        desc = f"metadata/name byte {pos} -> 0x{buf[pos]:02x}"
    elif kind == "payload_byte":
        pos = rng.choice(seed["payloads"]) if seed["payloads"] else rng.randrange(len(buf))
        buf[pos] = rng.randrange(256)
        desc = f"payload byte {pos} -> 0x{buf[pos]:02x}"
    elif kind == "truncate_fix":
        n = rng.randrange(64, len(buf)) if len(buf) > 64 else 64
        del buf[n:]
        struct.pack_into("<Q", buf, 16, n)
        desc = f"truncate to {n} bytes and fix file_size"
    elif kind == "extend":
        k = rng.randrange(1, 200)
        buf += bytes(rng.randrange(256) for _ in range(k))
        struct.pack_into("<Q", buf, 16, len(buf))
        desc = f"append {k} random bytes and fix file_size"
    else:  # splice
        n = rng.randrange(1, 64)
        src, dst = rng.randrange(len(buf)), rng.randrange(16, len(buf))
        chunk = buf[src:src + n]
        buf[dst:dst + len(chunk)] = chunk
        del buf[len(seed["data"]):]
        desc = f"copy {len(chunk)} bytes from {src} to {dst}"
    if reseal:
        _reseal(buf)
        desc += " (checksum recomputed)"
    return bytes(buf), verify, must_reject, f"case {i} [{seed_name}] {desc}, verify={verify}"


# ------------------------------------------------------------------------------ worker

def _same_problem(a, b):
    key = "metadata is not valid JSON"
    if key in a or key in b:
        return a[:a.find(key) + len(key)] == b[:b.find(key) + len(key)]
    return a == b


def run_case(path, data, verify, must_reject, use_mmap):
    """(status, message): status 'ok' (both loaded the same), 'rejected' (both, same message)
    or 'FAIL'."""
    import kdtree_native as kn
    from kdtree_native import _native
    from kdtree_native.kdtr import Bf16, KdtrError

    with open(path, "wb") as f:
        f.write(data)
    try:
        py = cpp = None
        try:
            arrays, meta = kn.load_kdtr(path, mmap=use_mmap, verify=verify)
            py = ({n: (v.bits if isinstance(v, Bf16) else v) for n, v in arrays.items()}, meta)
            py = ({n: (a.shape, a.dtype.str, a.tobytes()) for n, a in py[0].items()}, meta)
            del arrays
        except KdtrError as e:
            py_err = str(e)
        except Exception as e:  # noqa: BLE001 - anything but a clean KdtrError is the bug we hunt
            return "FAIL", f"Python reader raised {type(e).__name__}: {e}"
        try:
            c_arrays, c_meta = _native.kdtr_read(path, verify)
            cpp = ({n: (a.shape, a.dtype.str, a.tobytes()) for n, a in c_arrays.items()}, json.loads(c_meta))
            del c_arrays
        except ValueError as e:
            cpp_err = str(e)
        except Exception as e:  # noqa: BLE001
            return "FAIL", f"C++ reader raised {type(e).__name__}: {e}"
    finally:
        os.unlink(path)
    if py is None and cpp is None:
        if not _same_problem(py_err, cpp_err):
            return "FAIL", f"readers disagree: Python {py_err!r}, C++ {cpp_err!r}"
        return "rejected", py_err[len(path) + 2:]
    if py is None or cpp is None:
        return "FAIL", f"only one reader accepted: Python {py_err if py is None else 'ok'!r}, " \
                       f"C++ {cpp_err if cpp is None else 'ok'!r}"
    if py != cpp:
        return "FAIL", "both readers accepted but loaded different contents"
    if must_reject:
        return "FAIL", "a corrupt file was accepted (the checksum should have caught it)"
    return "ok", ""


def worker_main(seed_dir, work_dir, start, stop):
    seeds = load_seeds(seed_dir)
    crash_at = int(os.environ.get("KDTREE_KDTR_FUZZ_CRASH_AT", "-1"))  # harness self-test
    out = sys.stdout
    for i in range(start, stop):
        data, verify, must_reject, _ = make_case(seeds, i)
        if i == crash_at:
            os.abort()
        status, msg = run_case(os.path.join(work_dir, f"case{i}.kdtr"), data, verify, must_reject, use_mmap=i % 2 == 0)
        out.write(json.dumps({"i": i, "s": status, "m": msg}) + "\n")
        out.flush()
    return 0


# ------------------------------------------------------------------------------ parent

def run_fuzz(work_root, n_cases, n_workers=2, env_extra=None):
    """Runs cases 0..n_cases-1 in n_workers subprocesses. Returns (results {i: (status, msg)},
    crashes [description], elapsed seconds)."""
    seed_dir = os.path.join(work_root, "seeds")
    os.makedirs(seed_dir, exist_ok=True)
    write_seeds(seed_dir)
    env = dict(os.environ, **(env_extra or {}))
    bounds = [n_cases * k // n_workers for k in range(n_workers + 1)]
    t0 = time.perf_counter()
    procs = []
    for k in range(n_workers):
        wdir = os.path.join(work_root, f"w{k}")
        os.makedirs(wdir, exist_ok=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", seed_dir, wdir, str(bounds[k]), str(bounds[k + 1])]
        procs.append((bounds[k], bounds[k + 1], subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                                 stderr=subprocess.PIPE, text=True)))
    results, crashes = {}, []
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    for start, stop, p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            hung = False
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            hung = True
        for line in stdout.splitlines():
            r = json.loads(line)
            results[r["i"]] = (r["s"], r["m"])
        if p.returncode != 0 or hung:
            missing = next((i for i in range(start, stop) if i not in results), None)
            seeds = load_seeds(seed_dir)
            what = make_case(seeds, missing)[3] if missing is not None else "(after its last case)"
            how = "hung" if hung else (f"died from signal {-p.returncode}" if p.returncode < 0 else f"exited {p.returncode}")
            crashes.append(f"worker for cases {start}..{stop - 1} {how} at {what}; stderr: {stderr[-2000:]}")
    return results, crashes, time.perf_counter() - t0


def summarize(results):
    kinds = {}
    for s, m in results.values():
        if s == "rejected":
            key = re.sub(r"CRC-32 \w+, computed \w+", "CRC-32 H, computed H", re.sub(r"'[^']*'", "'X'", m))
            key = re.sub(r"\[[-0-9, ]*\]", "[..]", key)
            key = re.sub(r"\d+", "N", key)
            key = key.split(": ", 1)[0] if key.startswith("metadata is not valid JSON") else key[:70]
            kinds[key] = kinds.get(key, 0) + 1
    counts = {s: sum(1 for v in results.values() if v[0] == s) for s in ("ok", "rejected", "FAIL")}
    lines = [f"{len(results)} cases: {counts['ok']} loaded identically by both readers, "
             f"{counts['rejected']} rejected by both with the same message, {counts['FAIL']} failures"]
    lines += [f"  {n:6d}  {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])]
    return counts, "\n".join(lines)


def test_kdtr_fuzz_subprocess(tmp_path):
    n = int(os.environ.get("KDTREE_KDTR_FUZZ_CASES", DEFAULT_CASES))
    results, crashes, elapsed = run_fuzz(str(tmp_path), n)
    counts, report = summarize(results)
    print(f"\nKDTR fuzz, seed {FUZZ_SEED}, {elapsed:.1f} s\n{report}")
    assert not crashes, "\n".join(crashes)
    failures = [f"case {i}: {m}" for i, (s, m) in sorted(results.items()) if s == "FAIL"]
    assert not failures, f"{len(failures)} failing cases (replay with --replay <i>):\n" + "\n".join(failures[:20])
    assert len(results) == n
    # The mix must exercise both outcomes and many distinct checks.
    assert counts["ok"] > n // 50 and counts["rejected"] > n // 2
    assert len(report.splitlines()) > 20


def test_fuzz_harness_reports_a_crashing_case(tmp_path):
    """A worker that dies (here: abort() at case 7) is reported with the case it died on."""
    results, crashes, _ = run_fuzz(str(tmp_path), 12, n_workers=1, env_extra={"KDTREE_KDTR_FUZZ_CRASH_AT": "7"})
    assert sorted(results) == list(range(7))
    assert len(crashes) == 1 and "died from signal 6" in crashes[0] and "at case 7 [" in crashes[0], crashes


def _replay(i):
    with tempfile.TemporaryDirectory() as d:
        write_seeds(d)
        seeds = load_seeds(d)
        data, verify, must_reject, desc = make_case(seeds, i)
        print(desc)
        print(run_case(os.path.join(d, "case.kdtr"), data, verify, must_reject, use_mmap=i % 2 == 0))


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
    elif sys.argv[1] == "--replay":
        _replay(int(sys.argv[2]))
