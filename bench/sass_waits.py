"""Which scoreboard each SASS instruction sets and waits on, from `cuobjdump -sass` output (sm_70 and later).

    cuobjdump -sass -fun moe_fused_t2_q4g64_q5g64_q8g32 kernels.cubin > k.sass
    python bench/sass_waits.py k.sass [--start 0x2000] [--end 0x4000] [--all]
    python bench/sass_waits.py k.sass --pdl    # waits after the PDL wait on loads issued before it

A variable-latency instruction (a global or shared load, a shuffle, MUFU) names a write scoreboard (0-5), counted
up at issue and down when its result lands; a later instruction names a wait mask and stalls until every scoreboard
in it is back to zero. So a wait on a scoreboard waits for every load ptxas put on it, however early (perf.md v57:
a call's wait on the pre-wait loads' scoreboard held the fused MoE's routing ~1.3 µs). The fields sit in the control
bits of each instruction's second 64-bit word, in the layout public reverse engineering gives for Volta and later
(not documented by NVIDIA): stall 41-44, yield 45, write scoreboard 46-48, read scoreboard 49-51, wait mask 52-57
(7 = none for the two scoreboards). Without --all only instructions that set a scoreboard or wait on one are listed.
--pdl lists, per function, the instructions after the PDL wait (griddepcontrol.wait: ACQBULK) whose wait still counts
loads issued before it, in address order, ignoring branches: a triage list, to read against the code.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

_FIRST = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;?\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
_SECOND = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_LOAD = re.compile(r"^(@!?P\d+\s+)?(LDG|LD|ATOMG|ATOM|RED)\b")  # memory, not the constant or shared loads


@dataclass(frozen=True)
class Instr:
    function: str
    addr: int
    text: str
    stall: int
    write_sb: int | None  # scoreboard its result counts on
    read_sb: int | None   # scoreboard guarding its source registers
    wait: frozenset[int]  # scoreboards it waits on before issue


def decode_control(hi: int) -> tuple[int, int | None, int | None, frozenset[int]]:
    """(stall, write scoreboard, read scoreboard, wait set) from an instruction's second 64-bit word."""
    wb, rb, mask = (hi >> 46) & 7, (hi >> 49) & 7, (hi >> 52) & 63
    wait = frozenset(i for i in range(6) if mask >> i & 1)
    return (hi >> 41) & 15, None if wb == 7 else wb, None if rb == 7 else rb, wait


def parse(text: str) -> list[Instr]:
    """Every instruction of a cuobjdump listing: a line with its address, text and first word, then its second."""
    lines = text.splitlines()
    out, function = [], ""
    for i, line in enumerate(lines[:-1]):
        f = _FUNCTION.match(line)
        if f:
            function = f.group(1)
            continue
        m, m2 = _FIRST.match(line), _SECOND.match(lines[i + 1])
        if m and m2:
            out.append(Instr(function, int(m.group(1), 16), m.group(2), *decode_control(int(m2.group(1), 16))))
    return out


def _skippable(instrs: list[Instr]) -> set[int]:
    """Addresses a forward branch can jump over (the body of an if, either arm): waits there may not run."""
    out: set[int] = set()
    for ins in instrs:
        m = re.match(r"^(@!?P\d+\s+)?BRA\s+(0x[0-9a-f]+)", ins.text)
        if m and int(m.group(2), 16) > ins.addr:
            out.update(i.addr for i in instrs if ins.addr < i.addr < int(m.group(2), 16) and i.function == ins.function)
    return out


def pdl_waits(instrs: list[Instr]) -> list[tuple[Instr, int, list[int], bool]]:
    """(instruction, scoreboard, addresses of the loads before the PDL wait it waits for, may be skipped), after
    that wait, in address order: a load adds itself to its scoreboard, a wait that always runs clears it."""
    out: list[tuple[Instr, int, list[int], bool]] = []
    pending: dict[int, list[tuple[int, bool]]] = {}
    for fn in dict.fromkeys(i.function for i in instrs):
        body = [i for i in instrs if i.function == fn]
        skip = _skippable(body)
        pending, after = {k: [] for k in range(6)}, False
        for ins in body:
            for k in sorted(ins.wait):
                early = [a for a, late in pending[k] if not late]
                if after and early:
                    out.append((ins, k, early, ins.addr in skip))
                if ins.addr not in skip:
                    pending[k] = []
            if ins.text.split()[0] == "ACQBULK":
                after = True
            if ins.write_sb is not None and _LOAD.match(ins.text):
                pending[ins.write_sb].append((ins.addr, after))
    return out


def describe(ins: Instr) -> str:
    wait = "".join(str(i) for i in sorted(ins.wait)) or "-"
    sets = "-" if ins.write_sb is None else str(ins.write_sb)
    return f"{ins.addr:05x}  wait {wait:<6} sets {sets}  {ins.text}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sass", type=Path, help="cuobjdump -sass output")
    ap.add_argument("--start", type=lambda s: int(s, 0), default=0, help="first address (e.g. 0x2000)")
    ap.add_argument("--end", type=lambda s: int(s, 0), default=1 << 40, help="last address")
    ap.add_argument("--all", action="store_true", help="every instruction, not only those that set or wait")
    ap.add_argument("--pdl", action="store_true",
                    help="only the waits after the PDL wait that still count loads issued before it")
    args = ap.parse_args(argv)
    try:
        text = args.sass.read_text()
    except (OSError, UnicodeDecodeError) as e:
        print(f"sass_waits: cannot read {args.sass}: {e}", file=sys.stderr)
        return 2
    instrs = parse(text)
    if not instrs:
        print(f"sass_waits: {args.sass} holds no cuobjdump -sass instructions", file=sys.stderr)
        return 2
    if args.pdl:
        for ins, k, early, cond in pdl_waits(instrs):
            loads = ", ".join(f"{a:05x}" for a in early[:4]) + (f" (+{len(early) - 4})" if len(early) > 4 else "")
            tag = " (in a branch)" if cond else ""
            print(f"{ins.function}  {describe(ins)}{tag}   <- scoreboard {k}: loads before the wait at {loads}")
        return 0
    for ins in instrs:
        if args.start <= ins.addr <= args.end and (args.all or ins.wait or ins.write_sb is not None):
            print(describe(ins))
    return 0


if __name__ == "__main__":
    sys.exit(main())
