"""scripts/ncu_source_lines.py: Nsight Compute's per-instruction stall samples summed over the
profiled launches and mapped to source lines through nvdisasm's line table. Synthetic inputs in
the two tools' formats (no GPU, no CUDA tools needed)."""
import gzip
import importlib.util
import io
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("ncu_source_lines", os.path.join(ROOT, "scripts", "ncu_source_lines.py"))
nsl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nsl)

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"stall_barrier","stall_wait","stall_barrier (Not Issued)"')


def table(base, samples):
    """One launch's table: instructions at base, base + 0x10, ... with (all, barrier, wait) samples."""
    ops = ["LDS R1, [R2]", "IADD3 R1, R1, 0x1, RZ", "BAR.SYNC.DEFER_BLOCKING 0x0", "EXIT"]
    lines = ['"Kernel Name","k"', HEADER]
    for i, (a, b, w) in enumerate(samples):
        lines.append(f'"{hex(base + 16 * i)}","      {ops[i]}","{a}","{a}","{b}","{w}","0"')
    return "\n".join(lines) + "\n"


DISASM = """.text.other_kernel:
        /*0000*/                   NOP ;
.text._Z15tree_build_kernelv:
\t//## File "/src/cuda/tree_build_impl.h", line 10
        /*0000*/                   LDS R1, [R2] ;
        /*0010*/                   IADD3 R1, R1, 0x1, RZ ;
\t//## File "/src/cuda/tree_kernels.cu", line 26 inlined at "/src/cuda/tree_build_impl.h", line 20
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
\t//## File "/src/cuda/tree_build_impl.h", line 30
        /*0030*/                   EXIT ;
.text.after:
        /*0000*/                   NOP ;
"""


def test_tables_summed_by_offset_and_lines_attributed(tmp_path):
    # two launches at different load addresses: summed per offset
    text = table(0x7F0000000000, [(2, 0, 2), (1, 0, 1), (10, 9, 1), (0, 0, 0)]) + \
        table(0x7F0000100000, [(4, 0, 4), (0, 0, 0), (6, 6, 0), (1, 0, 0)])
    header, rows = nsl.parse_sass_csv(text)
    assert [r[0] for r in rows] == ["0x0", "0x10", "0x20", "0x30"]
    assert [float(r[2]) for r in rows] == [6.0, 1.0, 16.0, 1.0]
    insts = nsl.parse_disasm(DISASM, "tree_build_kernel")
    assert [(o, loc) for o, _, loc in insts] == [
        (0x0, ("tree_build_impl.h", 10)), (0x10, ("tree_build_impl.h", 10)),
        (0x20, ("tree_kernels.cu", 26)), (0x30, ("tree_build_impl.h", 30))]
    recs, mismatched = nsl.attribute(header, rows, insts)
    assert mismatched == 0
    out = io.StringIO()
    nsl.report(recs, 10, out)
    lines = out.getvalue().splitlines()
    assert "24 samples" in lines[0] and "barrier 62.5%" in lines[0]
    # the barrier line first (16 of 24 samples), then line 10 (7), then line 30 (1)
    assert lines[3].startswith("| 66.7% | 16 | tree_kernels.cu:26 | barrier 62.5, wait 4.2")
    assert lines[4].startswith("| 29.2% | 7 | tree_build_impl.h:10 |")
    assert lines[5].startswith("| 4.2% | 1 | tree_build_impl.h:30 |")
    # the command line, gzip input and a disassembly file: rc 0
    csv_path, dis_path = tmp_path / "s.csv.gz", tmp_path / "d.txt"
    with gzip.open(csv_path, "wt") as f:
        f.write(text)
    dis_path.write_text(DISASM)
    assert nsl.main(["--csv", str(csv_path), "--disasm", str(dis_path), "--kernel", "tree_build_kernel"]) == 0


def test_other_machine_code_is_flagged(tmp_path, capsys):
    text = table(0x1000, [(1, 0, 1), (1, 0, 1), (1, 1, 0), (1, 0, 0)])
    csv_path, dis_path = tmp_path / "s.csv", tmp_path / "d.txt"
    csv_path.write_text(text)
    dis_path.write_text(DISASM.replace("IADD3 R1, R1, 0x1, RZ", "IMAD R1, R1, 0x2, RZ"))
    assert nsl.main(["--csv", str(csv_path), "--disasm", str(dis_path), "--kernel", "tree_build_kernel"]) == 1
    assert "1 of 4 opcodes differ" in capsys.readouterr().err


def test_missing_pieces_are_clear_errors(tmp_path):
    with pytest.raises(SystemExit, match="no 'Address,Source"):
        nsl.parse_sass_csv('"a","b"\n1,2\n')
    csv_path, dis_path = tmp_path / "s.csv", tmp_path / "d.txt"
    csv_path.write_text(table(0x0, [(1, 0, 1)]))
    dis_path.write_text(DISASM)
    with pytest.raises(SystemExit, match="no function matching"):
        nsl.main(["--csv", str(csv_path), "--disasm", str(dis_path), "--kernel", "no_such_kernel"])
