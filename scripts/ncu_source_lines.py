#!/usr/bin/env python3
"""Nsight Compute's warp-stall samples of one kernel, per source line.

`ncu --page source --print-source sass --csv` lists the samples per SASS instruction (one table per
profiled launch) but not the source line of each instruction. This script sums the tables per
instruction offset, takes the line table from the same machine code (`nvdisasm -g -c` on the cubin;
`--so` extracts the cubins of a built module with `cuobjdump -xelf`), checks that every opcode
matches, and prints the lines (or address ranges) that hold the samples, with their top stall
reasons. Run it where the module was built (the H200 for a device profile): the cubin must be the
one that was profiled.

Typical use on the device (docs/CUDA.md, "Profiling"):

    ncu --section SourceCounters --section WarpStateStats --warp-sampling-interval 0 \\
        --import-source yes -k regex:tree_build_kernel -s 4 -c 6 -o /tmp/rep python3 script.py
    ncu -i /tmp/rep.ncu-rep --page source --csv --print-source sass > /tmp/sass.csv
    python3 scripts/ncu_source_lines.py --csv /tmp/sass.csv \\
        --so python/kdtree_native/_native*.so --kernel tree_build_kernel --top 40

Output columns: share of all samples, samples, then the three largest stall reasons (share of all
samples). Barrier samples count the warps that wait: a stretch of serial work shows up as the
barrier after it (its share / the waiting warps' fraction = its share of the kernel's time).
"""
from __future__ import annotations

import argparse
import collections
import csv
import glob
import gzip
import io
import os
import re
import subprocess
import sys
import tempfile

_LINE_RE = re.compile(r'//## File "([^"]+)", line (\d+)')
_INST_RE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);?\s*(/\*.*)?$")


def read_text(path: str) -> str:
    if path.endswith(".gz"):
        with gzip.open(path, "rt", newline="") as f:
            return f.read()
    with open(path, newline="") as f:
        return f.read()


def parse_sass_csv(text: str) -> tuple[list[str], list[list[str]]]:
    """Sum ncu's per-instruction tables (one per profiled launch) by offset from each table's
    first instruction. Returns (header, rows) with the numeric columns summed; the address
    column holds the offset in hex."""
    header: list[str] | None = None
    base: int | None = None
    sums: "collections.OrderedDict[int, list[str]]" = collections.OrderedDict()
    for row in csv.reader(io.StringIO(text)):
        if row and row[0] == "Address" and "Source" in row:
            header, base = row, None
            continue
        if header is None or len(row) != len(header):
            continue
        try:
            addr = int(row[0], 16)
        except ValueError:
            continue
        if base is None:
            base = addr
        off = addr - base
        if off not in sums:
            sums[off] = [hex(off)] + row[1:]
            continue
        acc = sums[off]
        for i in range(2, len(row)):
            try:
                acc[i] = repr(float(acc[i]) + float(row[i]))
            except ValueError:
                pass
    if header is None:
        raise SystemExit("no 'Address,Source,...' table in the CSV (ncu --page source --print-source sass --csv)")
    return header, list(sums.values())


def parse_disasm(text: str, kernel: str) -> list[tuple[int, str, tuple[str, int] | None]]:
    """(offset, instruction, (file, line)) for the functions of `nvdisasm -g -c` output whose
    section name contains `kernel` (the first such function)."""
    insts: list[tuple[int, str, tuple[str, int] | None]] = []
    inside = False
    seen = False
    loc: tuple[str, int] | None = None
    for line in text.splitlines():
        if line.startswith(".text."):
            if seen and inside:
                break
            inside = kernel in line
            seen = seen or inside
            loc = None
            continue
        if not inside:
            continue
        m = _LINE_RE.search(line)
        if m:
            loc = (os.path.basename(m.group(1)), int(m.group(2)))
            continue
        m = _INST_RE.match(line)
        if m:
            insts.append((int(m.group(1), 16), m.group(2).strip(), loc))
    return insts


def tool(name: str) -> str:
    """The CUDA tool by check_pdl_loads.find_tool (PATH, next to nvcc, the toolkit, PyPI's wheels)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    from check_pdl_loads import find_tool

    path = find_tool(name)
    if not path:
        raise SystemExit(f"{name} not found (the CUDA toolkit's, or PyPI's nvidia-cuda-{name} wheel)")
    return path


def disasm_for(kernel: str, cubin: str | None, so: str | None, arch: str) -> str:
    nvdisasm = tool("nvdisasm")
    if cubin:
        return subprocess.run([nvdisasm, "-g", "-c", cubin], check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([tool("cuobjdump"), "-xelf", "all", os.path.abspath(so)], cwd=tmp, check=True,
                       capture_output=True)
        for path in sorted(glob.glob(os.path.join(tmp, f"*.{arch}.cubin"))):
            text = subprocess.run([nvdisasm, "-g", "-c", path], check=True, capture_output=True, text=True).stdout
            if any(line.startswith(".text.") and kernel in line for line in text.splitlines()):
                return text
    raise SystemExit(f"no {arch} cubin in {so} holds a function matching {kernel!r}")


def attribute(header, rows, insts):
    """Per-instruction records: (offset, sass, (file, line) | None, samples, {reason: samples})."""
    col = {h: i for i, h in enumerate(header)}
    i_all = col.get("Warp Stall Sampling (All Samples)")
    if i_all is None:
        raise SystemExit("the CSV has no 'Warp Stall Sampling (All Samples)' column (profile with --section SourceCounters)")
    reasons = [h for h in header if h.startswith("stall_") and "(Not" not in h]
    by_off = {off: (text, loc) for off, text, loc in insts}
    recs, mismatched = [], 0
    for row in rows:
        off = int(row[0], 16)
        sass = row[col["Source"]].strip().rstrip(";")
        text, loc = by_off.get(off, ("", None))
        if not text or text.split()[0] != sass.split()[0]:
            mismatched += 1
        recs.append((off, sass, loc, float(row[i_all]), {r[6:]: float(row[col[r]]) for r in reasons}))
    return recs, mismatched


def report(recs, top: int, out=sys.stdout) -> None:
    total = sum(r[3] for r in recs) or 1.0
    by_line: "collections.Counter[tuple]" = collections.Counter()
    why: "dict[tuple, collections.Counter]" = collections.defaultdict(collections.Counter)
    stalls: "collections.Counter[str]" = collections.Counter()
    for _, _, loc, s, st in recs:
        key = loc or ("?", 0)
        by_line[key] += s
        why[key].update(st)
        stalls.update(st)
    print(f"{len(recs)} instructions, {total:.0f} samples; stall reasons: " +
          ", ".join(f"{k} {v / total * 100:.1f}%" for k, v in stalls.most_common(8) if v), file=out)
    print("| share | samples | file:line | top reasons |", file=out)
    print("|---:|---:|---|---|", file=out)
    for (f, line), s in by_line.most_common(top):
        top3 = ", ".join(f"{k} {v / total * 100:.1f}" for k, v in why[(f, line)].most_common(3) if v)
        print(f"| {s / total * 100:.1f}% | {s:.0f} | {f}:{line} | {top3} |", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", required=True, help="ncu --page source --print-source sass --csv output (.gz ok)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--cubin", help="the profiled machine code (one cubin)")
    src.add_argument("--so", help="a built module: its cubins are extracted with cuobjdump -xelf")
    src.add_argument("--disasm", help="nvdisasm -g -c output already made")
    ap.add_argument("--kernel", required=True, help="a substring of the kernel's mangled name")
    ap.add_argument("--arch", default="sm_90", help="the cubin architecture to take from --so (default sm_90)")
    ap.add_argument("--top", type=int, default=40, help="source lines to print (default 40)")
    args = ap.parse_args(argv)
    header, rows = parse_sass_csv(read_text(args.csv))
    dis = read_text(args.disasm) if args.disasm else disasm_for(args.kernel, args.cubin, args.so, args.arch)
    insts = parse_disasm(dis, args.kernel)
    if not insts:
        raise SystemExit(f"no function matching {args.kernel!r} in the disassembly")
    recs, mismatched = attribute(header, rows, insts)
    if mismatched:
        print(f"warning: {mismatched} of {len(recs)} opcodes differ from the disassembly: "
              "the cubin is not the profiled code, the lines are not trustworthy", file=sys.stderr)
    report(recs, args.top)
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
