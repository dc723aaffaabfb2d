#!/usr/bin/env python3
"""Audit the built CUDA kernels for loads (and stores, exits) that can run before their PDL wait.

Every kernel of the CUDA backend is launched with Programmatic Dependent Launch (cuda/launch.h):
its blocks may start while the previous kernel still runs, and only `griddepcontrol.wait` (SASS
`ACQBULK`) makes that kernel's writes visible. A load placed before the wait may only read data
that no kernel of the step writes (weights; the cache rows committed before the step). Which
loads run before the wait is decided by the compiler, not by the source order alone: ptxas hoisted
an `ld.global.nc` above a `griddepcontrol.wait` that sat behind a run-time branch (docs/BENCHMARKS.md,
seventeenth session). So this script reads the machine code itself:

1. extracts the sm_90 cubins from the built module (`cuobjdump -xelf`),
2. disassembles them with line information, inlined call sites included (`nvdisasm -c -gi`),
3. builds each kernel's control-flow graph and finds the global loads (LDG*, LDGSTS*, generic LD,
   bulk / tensor copies) that some path from the kernel's entry reaches without an unpredicated
   ACQBULK,
4. accepts such a load only when a line of its inline chain in this repository carries the marker
   comment `pdl: pre-wait` (the call sites that load immutable data on purpose), and reports every
   other one with its source location; and reports every marker comment in cuda/ that accepted no
   load (the compiler moved that load below the wait: the overlap the source asks for is lost);
5. reports every global store or atomic that a path reaches before the wait (the contract allows
   none: the previous kernel may still read what it would overwrite), and every exit that a path
   reaches without a wait (a grid whose blocks all waited cannot complete before its predecessor;
   the kernels that read what a kernel two or more launches back wrote rely on that).

Exit status: 0 clean, 1 unmarked pre-wait loads, pre-wait stores or exits, or markers whose load runs after the wait found, 2 the tools or an sm_90 cubin are missing
(the test suite skips then). The tools come with the CUDA toolkit or from PyPI
(`pip install nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump`).

Usage: python scripts/check_pdl_loads.py [module.so]   (default: the installed kdtree_native._native)
"""
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

MARKER = "pdl: pre-wait"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LOAD_OPS = ("LDG", "LD.", "LD ", "UTMALDG", "UBLKCP")
_STORE_OPS = ("STG", "ST.", "ST ", "RED", "ATOMG", "ATOM.", "ATOM ", "UTMASTG", "UBLKRED")
_INS = re.compile(r'/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);')
_FILE = re.compile(r'//## File "([^"]+)", line (\d+)')
_LABEL = re.compile(r'\s*(\.L_x_\d+):')


def find_tool(name):
    """A CUDA tool on PATH, next to nvcc / in the toolkit, or from a pip wheel (nvidia/cu*/bin)."""
    hit = shutil.which(name)
    if hit:
        return hit
    cands = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), name))
    cands += glob.glob(f"/usr/local/cuda*/bin/{name}")
    for sp in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        cands += glob.glob(os.path.join(sp, "nvidia", "cu*", "bin", name))
    for c in cands:
        if os.path.isfile(c):
            if not os.access(c, os.X_OK):  # wheels unpacked without the executable bit
                try:
                    os.chmod(c, 0o755)
                except OSError:
                    continue
            return c
    return None


def kernels(nvdisasm, cubin):
    """{kernel name: disassembly lines} of one cubin (with inlined line information)."""
    out = subprocess.run([nvdisasm, "-c", "-gi", cubin], capture_output=True, text=True, check=True).stdout
    ks = collections.OrderedDict()
    cur = None
    for line in out.splitlines():
        m = re.match(r'\s*\.text\.(\S+):', line)
        if m:
            cur = m.group(1)
            ks[cur] = []
        elif cur:
            ks[cur].append(line)
    return ks


def pre_wait_accesses(lines):
    """[(kind, opcode, frames)] of the global loads (kind "load") and stores / atomics ("store")
    that a path from the entry reaches without an unpredicated ACQBULK; frames = the inline chain
    [(path, line)], innermost first."""
    ins, labels, pending, frames = [], {}, [], ()
    for line in lines:
        m = _FILE.search(line)
        if m:
            pending.append((m.group(1), int(m.group(2))))
            continue
        lm = _LABEL.match(line)
        if lm:
            labels[lm.group(1)] = len(ins)
            continue
        m = _INS.search(line)
        if m:
            if pending:
                frames, pending = tuple(pending), []
            ins.append(((m.group(2) or "").strip(), m.group(3), m.group(4), frames))
    n = len(ins)
    if n == 0:
        return []
    leaders = {0} | {v for v in labels.values() if v < n}
    for i, (pred, op, args, _) in enumerate(ins):
        if op.startswith(("BRA", "BRX", "JMP", "JMX", "EXIT", "RET")) and i + 1 < n:
            leaders.add(i + 1)
    leaders = sorted(leaders)
    index = {s: k for k, s in enumerate(leaders)}
    blocks = [(s, leaders[k + 1] if k + 1 < len(leaders) else n) for k, s in enumerate(leaders)]
    succ = [[] for _ in blocks]
    for k, (s, e) in enumerate(blocks):
        pred, op, args, _ = ins[e - 1]
        falls = k + 1 < len(blocks)
        if op.startswith(("BRA", "JMP")):
            t = re.search(r'(\.L_x_\d+)', args)
            if t and labels.get(t.group(1)) in index:
                succ[k].append(index[labels[t.group(1)]])
            else:  # an indirect or unknown target: every block (conservative)
                succ[k].extend(range(len(blocks)))
            if pred and falls:
                succ[k].append(k + 1)
        elif op.startswith(("BRX", "JMX")):
            succ[k].extend(range(len(blocks)))
        elif op.startswith(("EXIT", "RET")):
            if pred and falls:
                succ[k].append(k + 1)
        elif falls:
            succ[k].append(k + 1)
    preds = [[] for _ in blocks]
    for k, ss in enumerate(succ):
        for j in ss:
            preds[j].append(k)
    waits = [any(ins[i][1].startswith("ACQBULK") and not ins[i][0] for i in range(s, e)) for s, e in blocks]
    # must-analysis: waited on entry to block k = every predecessor waited on exit
    waited = [k != 0 for k in range(len(blocks))]
    changed = True
    while changed:
        changed = False
        for k in range(1, len(blocks)):
            v = all(waited[j] or waits[j] for j in preds[k]) if preds[k] else True
            if v != waited[k]:
                waited[k] = v
                changed = True
    found = []
    for k, (s, e) in enumerate(blocks):
        w = waited[k]
        for i in range(s, e):
            pred, op, args, frames = ins[i]
            if op.startswith("ACQBULK") and not pred:
                w = True
            elif not w and op.startswith(_LOAD_OPS) and not op.startswith("LDGDEPBAR"):
                found.append(("load", op, frames))
            elif not w and op.startswith(_STORE_OPS):
                found.append(("store", op, frames))
            elif not w and op.startswith("EXIT"):
                found.append(("exit", op, frames))
    return found


def repo_path(path):
    """A source path of the build as its path in a repository (its part from cuda/ or cpp/ on: paths
    from another checkout map too), or None when it lies in neither."""
    norm = path.replace("\\", "/")
    for root in ("/cuda/", "/cpp/"):
        j = norm.rfind(root)
        if j >= 0:
            return norm[j + 1:]
    return None


def source_line(path, line, repo=REPO):
    """The text of a source line of this repository (repo_path), or None."""
    rel = repo_path(path)
    cand = os.path.join(repo, rel) if rel else path.replace("\\", "/")
    try:
        with open(cand, encoding="utf-8") as f:
            lines = f.read().splitlines()
        return lines[line - 1] if 0 < line <= len(lines) else None
    except OSError:
        return None


def marker_site(path, line, repo=REPO):
    """(repository path, line) of the marker that accepts a load at path:line: the source line itself
    or a comment line right above it carries `pdl: pre-wait`; None when neither does."""
    site = repo_path(path) or path.replace("\\", "/")
    if MARKER in (source_line(path, line, repo) or ""):
        return site, line
    above = (source_line(path, line - 1, repo) or "").strip() if line > 1 else ""
    if above.startswith("//") and MARKER in above:
        return site, line - 1
    return None


_MARK_LINE = re.compile(r'//\s*' + re.escape(MARKER))


def marker_lines(repo=REPO):
    """{(repository path, line)} of every `// pdl: pre-wait` marker comment in cuda/."""
    out = set()
    for f in sorted(glob.glob(os.path.join(repo, "cuda", "**", "*"), recursive=True)):
        if not f.endswith((".cu", ".cuh", ".h")):
            continue
        with open(f, encoding="utf-8") as fh:
            for i, text in enumerate(fh.read().splitlines(), 1):
                if _MARK_LINE.search(text):
                    out.add((os.path.relpath(f, repo).replace(os.sep, "/"), i))
    return out


def audit_cubin(nvdisasm, cubin, repo=REPO, used=None):
    """(number of kernels, [(kernel, opcode, frames)] of the unmarked pre-wait loads and all the
    pre-wait stores) of one cubin. used (a set, optional) collects the marker sites that accepted a
    pre-wait load."""
    bad = []
    ks = kernels(nvdisasm, cubin)
    for name, lines in ks.items():
        for kind, op, frames in pre_wait_accesses(lines):
            sites = [marker_site(p, l, repo) for p, l in frames] if kind == "load" else []
            if not any(sites):
                bad.append((name, op, frames))
            elif used is not None:
                used.update(x for x in sites if x)
    return len(ks), bad


def main(argv):
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if len(argv) > 1:
        module = argv[1]
    else:
        try:
            import kdtree_native._native as nat
        except ImportError as e:
            print(f"check_pdl_loads: cannot import kdtree_native._native ({e})")
            return 2
        module = nat.__file__
    if not cuobjdump or not nvdisasm:
        print("check_pdl_loads: cuobjdump / nvdisasm not found (pip install nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        listing = subprocess.run([cuobjdump, "-lelf", module], capture_output=True, text=True).stdout
        names = re.findall(r'ELF file\s+\d+:\s+(\S+\.sm_90\.cubin)', listing)
        if not names:
            print(f"check_pdl_loads: {module} holds no sm_90 cubin (a build without CUDA or without sm_90)")
            return 2
        subprocess.run([cuobjdump, "-xelf", "all", os.path.abspath(module)], cwd=tmp, capture_output=True, check=True)
        total = 0
        report = collections.defaultdict(set)
        used = set()
        for cubin in sorted(glob.glob(os.path.join(tmp, "*.sm_90.cubin"))):
            ks, bad = audit_cubin(nvdisasm, cubin, used=used)
            total += ks
            for name, op, frames in bad:
                site = frames[-1] if frames else ("?", 0)
                report[(site[0], site[1], op.split(".")[0])].add(name)
        print(f"check_pdl_loads: {len(names)} cubins, {total} kernels")
        for (f, l, op), ks in sorted(report.items()):
            text = (source_line(f, l) or "").strip()
            what = "store" if op.startswith(_STORE_OPS) else "exit" if op.startswith("EXIT") else "unmarked load"
            print(f"  pre-wait {what} {op} at {os.path.basename(f)}:{l} in {len(ks)} kernel(s), e.g. "
                  f"{sorted(ks)[0][:90]}\n    {text}")
        # The other direction: a load marked to run before the wait whose instructions the compiler
        # moved below it (a plain __ldg may be sunk to its first use: the forty-first session found
        # uv_combine's W_UV loads after the wait), so the overlap the source asks for is not there.
        sunk = sorted(marker_lines() - used)
        for f, l in sunk:
            print(f"  marked pre-wait load issued only after the wait at {f}:{l}\n    {(source_line(f, l) or '').strip()}")
        return 1 if report or sunk else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
