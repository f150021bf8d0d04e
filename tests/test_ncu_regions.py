"""bench/ncu_regions.py: an ncu source-view CSV cut into regions and summed by opcode and stall reason.

Oracle: a hand-made export whose sums are worked out below from its rows (independent of the parser): regions are
maximal runs of one nonzero execution count in address order, a "(Not Issued)" column is not a reason, and a file
that is not such an export exits with one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import ncu_regions  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_long_sb", "stall_selected", "stall_short_sb", "stall_wait", "stall_barrier",
          "stall_short_sb (Not Issued)"]
# address, source, samples, executed, long_sb, selected, short_sb, wait, barrier, short_sb (Not Issued);
# listed out of address order on purpose
ROWS = [
    ("0x7f0000000120", "IDP.2A.LO.S16.S8 R1, R2, R3, RZ", 4, 20, 0, 0, 0, 4, 0, 0),
    ("0x7f0000000100", "LDC R1, c[0x0][0x28]", 3, 10, 0, 1, 0, 2, 0, 0),
    ("0x7f0000000110", "@!P0  LDG.E.128.CONSTANT R4, desc[UR4][R2.64]", 5, 10, 5, 0, 0, 0, 0, 0),
    ("0x7f0000000130", "IDP.2A.HI.S16.S8 R1, R2, R3, R1", 6, 20, 0, 0, 6, 0, 0, 9),
    ("0x7f0000000140", "@P1 BRA 0x7f0000000100", 0, 0, 0, 0, 0, 0, 0, 0),
    ("0x7f0000000150", "EXIT", 1, 10, 0, 0, 0, 0, 1, 0),
]


def _write(tmp_path: Path) -> Path:
    lines = ['"Kernel Name","gemv_q8_s1r",', ",".join(f'"{h}"' for h in HEADER)]
    for a, src, s, e, *st in ROWS:
        lines.append(",".join(f'"{v}"' for v in (a, src, s, s, e, *st)))
    p = tmp_path / "k.csv"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_regions_are_runs_of_one_execution_count(tmp_path):
    name, instrs = ncu_regions.load(str(_write(tmp_path)))
    assert name == "gemv_q8_s1r"
    assert [i.address & 0xFFF for i in instrs] == [0x100, 0x110, 0x120, 0x130, 0x140, 0x150]
    got = [(g.first & 0xFFF, g.last & 0xFFF, g.executed, len(g.instrs), g.samples) for g in ncu_regions.regions(instrs)]
    # LDC + LDG (10 each: 3 + 5 samples), the two IDPs (20 each: 4 + 6), the never-run BRA dropped, EXIT alone
    assert got == [(0x100, 0x110, 10, 2, 8), (0x120, 0x130, 20, 2, 10), (0x150, 0x150, 10, 1, 1)]
    # the IDP region's reasons: wait 4, short_sb 6; the "(Not Issued)" column's 9 is not a reason
    assert dict(ncu_regions.regions(instrs)[1].stalls()) == {"wait": 4, "short_sb": 6}


def test_opcodes_drop_predicates_and_modifiers(tmp_path):
    _, instrs = ncu_regions.load(str(_write(tmp_path)))
    ex, sa = ncu_regions.by_opcode(instrs)
    assert dict(ex) == {"LDC": 10, "LDG": 10, "IDP": 40, "BRA": 0, "EXIT": 10}
    assert dict(sa) == {"LDC": 3, "LDG": 5, "IDP": 10, "BRA": 0, "EXIT": 1}


def test_cli_prints_the_summary(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "ncu_regions.py"), str(_write(tmp_path))],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "gemv_q8_s1r: 19 samples, 70 warp instructions executed" in r.stdout
    assert "n=   2 exec=     20 samples=  10" in r.stdout


def test_foreign_or_missing_file_is_one_line(tmp_path):
    foreign = tmp_path / "x.csv"
    foreign.write_text("a,b\n1,2\n")
    binary = tmp_path / "y.csv"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    for p in (foreign, binary, tmp_path / "missing.csv"):
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "ncu_regions.py"), str(p)],
                           capture_output=True, text=True)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and r.stderr.startswith("ncu_regions: "), r.stderr
