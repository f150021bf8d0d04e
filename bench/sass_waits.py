"""Which scoreboard each SASS instruction sets and waits on, from `cuobjdump -sass` output (sm_70 and later).

    cuobjdump -sass -fun moe_fused_t2_q4g64_q5g64_q8g32 kernels.cubin > k.sass
    python bench/sass_waits.py k.sass [--function NAME] [--start 0x2000] [--end 0x4000] [--all]
    python bench/sass_waits.py k.sass --pdl    # waits after the PDL wait on loads issued before it
    python bench/sass_waits.py k.sass --held-loads   # loads whose issue waits for earlier loads
    python bench/sass_waits.py k.sass --loop-drains  # waits in a loop on the loads of the same pass
    python bench/sass_waits.py k.sass --dot-loops 64  # each loop with 64+ dots: its loads and its drains
    python bench/sass_waits.py k.sass --loop-mix 200  # each loop of 200+ instructions: its opcodes by count
    nvcc -cubin -arch=sm_90a ... -o k.cubin; python bench/sass_waits.py k.cubin --pdl   # no cuobjdump needed

A variable-latency instruction (a global or shared load, a shuffle, MUFU) names a write scoreboard (0-5), counted
up at issue and down when its result lands; a later instruction names a wait mask and stalls until every scoreboard
in it is back to zero. So a wait on a scoreboard waits for every load ptxas put on it, however early
(perf-history.md v57: a call's wait on the pre-wait loads' scoreboard held the fused MoE's routing ~1.3 µs). The
fields sit in the control bits of each instruction's second 64-bit word, in the layout public reverse engineering
gives for Volta and later (not documented by NVIDIA): stall 41-44, yield 45, write scoreboard 46-48, read
scoreboard 49-51, wait mask 52-57 (7 = none for the two scoreboards). Without --all only instructions that set a
scoreboard or wait on one are listed.
--pdl lists, per function, the instructions after the PDL wait (griddepcontrol.wait: ACQBULK) whose wait still counts
loads issued before it, in address order; a wait that a forward branch can jump over is marked and clears nothing.
A triage list, to read against the code (a scoreboard also counts instructions that name it as their read scoreboard).
--held-loads lists the loads and cp.async copies whose own issue waits on a scoreboard that still counts earlier
loads: their request leaves only once those land (v58: a loop over a run-time count did this to act's staging).
--loop-drains lists, per loop (a backward branch), the waits on loads issued earlier in the same pass: those loads
are not in flight across the wait (v58: the stream GEMVs' ping-pong drains the tile it has just refilled).
--dot-loops lists each loop holding at least MIN_DOTS dot instructions, with its loads and its drains, so the copies
of one loop in a kernel read apart (v59: a whole-steps copy that drains nothing beside a tested copy that does).
A cubin (ELF) is read directly: each instruction's control bits, a branch's target, and the opcode names cuobjdump
13.0 gives on sm_90a for the opcodes seen in v57's listings (`op<code>` for others), so the triage runs where nvcc is
and cuobjdump is not (the device's cuobjdump listing of moe_fused and this decoding of the same source's cubin
agreed on all 4,624 instructions).
"""

from __future__ import annotations

import argparse
import re
import struct
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_FIRST = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;?\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
_SECOND = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_LOAD = re.compile(r"^(@!?P[0-9T]\s+)?(LDG|LD|ATOMG|ATOM|RED)\b")  # memory, not the constant or shared loads
_ISSUE = re.compile(r"^(@!?P[0-9T]\s+)?(LDG|LD|LDGSTS)\b")  # requests whose issue a wait can hold up


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
    """Addresses a forward branch of one function can jump over (the body of an if, either arm): waits there may
    not run. Instructions are 16 bytes apart."""
    out: set[int] = set()
    for ins in instrs:
        m = re.match(r"^(@!?P\d+\s+)?BRA\s+(0x[0-9a-f]+)", ins.text)
        if m and int(m.group(2), 16) > ins.addr:
            out.update(range(ins.addr + 16, int(m.group(2), 16), 16))
    return out


# sm_90a opcodes (an instruction's low 12 bits) and the names cuobjdump 13.0 gives them: every opcode in the
# listings of moe_fused and deltanet_step (v57) and of the attention kernels (v69, against cuobjdump 13.5's
# listings of the same cubins). Others show as op<code>.
OPCODES = {
    0x20F: "VIMNMX3", 0x237: "IMMA", 0x23C: "HMMA", 0x23E: "F2FP", 0x287: "USEL", 0x28C: "UISETP", 0x292: "ULOP3",
    0x2A5: "UIMAD", 0x3C6: "FENCE", 0x416: "PRMT", 0x430: "HADD2", 0x446: "VIADDMNMX", 0x806: "VOTE",
    0x809: "FMNMX", 0x846: "VIADDMNMX", 0x8A5: "UIMAD", 0x9C5: "WARPGROUP", 0x9F0: "HGMMA", 0xC0F: "VIMNMX3",
    0xC13: "IABS", 0xC20: "FMUL", 0xC27: "IMAD", 0xC48: "VIMNMX", 0xDF0: "HGMMA", 0xE46: "VIADDMNMX",
    0x202: "MOV", 0x207: "SEL", 0x208: "FSEL", 0x209: "FMNMX", 0x20B: "FSETP", 0x20C: "ISETP", 0x210: "IADD3",
    0x211: "LEA", 0x212: "LOP3", 0x213: "IABS", 0x219: "SHF", 0x220: "FMUL", 0x221: "FADD", 0x223: "FFMA",
    0x224: "IMAD", 0x225: "IMAD", 0x226: "IDP", 0x227: "IMAD", 0x230: "HADD2", 0x245: "I2FP", 0x246: "VIADDMNMX",
    0x248: "VIMNMX", 0x290: "UIADD3", 0x291: "ULEA", 0x2A4: "UIMAD", 0x2CA: "R2UR", 0x302: "FCHK", 0x305: "F2I",
    0x306: "I2F", 0x308: "MUFU", 0x309: "POPC", 0x348: "WARPSYNC", 0x388: "STS", 0x389: "SHFL", 0x3A1: "MATCH",
    0x3C4: "REDUX", 0x421: "FADD", 0x423: "FFMA", 0x424: "IMAD", 0x435: "HFMA2", 0x589: "SHFL", 0x5A7: "SYNCS",
    0x5AB: "CGAERRBAR", 0x5B2: "SYNCS", 0x802: "MOV", 0x803: "P2R", 0x804: "R2P", 0x805: "CS2R", 0x807: "SEL",
    0x808: "FSEL", 0x80B: "FSETP", 0x80C: "ISETP", 0x810: "IADD3", 0x811: "LEA", 0x812: "LOP3", 0x816: "PRMT",
    0x819: "SHF", 0x81C: "PLOP3", 0x820: "FMUL", 0x823: "FFMA", 0x824: "IMAD", 0x825: "IMAD", 0x82D: "PREEXIT",
    0x82E: "ACQBULK", 0x836: "VIADD", 0x848: "VIMNMX", 0x882: "UMOV", 0x886: "VOTEU", 0x887: "USEL",
    0x88C: "UISETP", 0x890: "UIADD3", 0x891: "ULEA", 0x892: "ULOP3", 0x899: "USHF", 0x8A4: "UIMAD", 0x902: "FCHK",
    0x908: "MUFU", 0x918: "NOP", 0x919: "S2R", 0x91A: "DEPBAR", 0x91B: "ENDCOLLECTIVE", 0x941: "BSYNC",
    0x942: "BREAK", 0x944: "CALL", 0x945: "BSSY", 0x946: "YIELD", 0x947: "BRA", 0x948: "WARPSYNC", 0x94D: "EXIT",
    0x950: "RET", 0x95C: "BPT", 0x981: "LDG", 0x984: "LDS", 0x985: "ST", 0x986: "STG", 0x988: "STS", 0x98F: "CCTL",
    0x992: "MEMBAR", 0x9A7: "SYNCS", 0x9A8: "ATOMG", 0x9AB: "ERRBAR", 0x9AF: "LDGDEPBAR", 0x9C3: "S2UR",
    0x9C7: "UCGABAR_ARV", 0xAB9: "ULDC", 0xB1D: "BAR", 0xB82: "LDC", 0xC02: "MOV", 0xC07: "SEL", 0xC0C: "ISETP",
    0xC10: "IADD3", 0xC11: "LEA", 0xC12: "LOP3", 0xC19: "SHF", 0xC24: "IMAD", 0xC25: "IMAD", 0xC26: "IDP",
    0xC36: "VIADD", 0xC45: "I2FP", 0xC46: "VIADDMNMX", 0xC82: "UMOV", 0xD00: "FLO", 0xD06: "I2F", 0xD09: "POPC",
    0xDBD: "STAS", 0xDC7: "UCGABAR_WAIT", 0xE21: "FADD", 0xE23: "FFMA", 0xE24: "IMAD", 0xE25: "IMAD",
    0xF89: "SHFL", 0xFAE: "LDGSTS",
}


def decode_word(function: str, addr: int, lo: int, hi: int) -> Instr:
    """One 128-bit sm_90 instruction: its control bits, and a name for the opcodes in OPCODES (a branch with its
    target: a signed word offset from the next instruction, 8 bits at 16 and the rest from bit 34)."""
    code, pred = lo & 0xFFF, (lo >> 12) & 15
    text = OPCODES.get(code, f"op{code:03x}")
    if code == 0x947:
        high = lo >> 34
        high -= (high >> 29 & 1) << 30  # 30-bit two's complement
        text += f" {addr + 16 + 4 * ((high << 8) | (lo >> 16 & 0xFF)):#x}"
    if pred != 7:  # 7: PT (always), 15: !PT (never)
        text = f"@{'!' if pred & 8 else ''}P{'T' if pred & 7 == 7 else pred & 7} {text}"
    return Instr(function, addr, text, *decode_control(hi))


def parse_cubin(data: bytes) -> list[Instr]:
    """Every instruction of every `.text.<function>` section of an ELF64 cubin, in section order."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]
    out = []
    for name_off, _type, _flags, _addr, off, size in sections:
        name = data[names_at + name_off:data.index(b"\0", names_at + name_off)].decode()
        if name.startswith(".text."):
            for a in range(0, size - size % 16, 16):
                lo, hi = struct.unpack_from("<QQ", data, off + a)
                out.append(decode_word(name[len(".text."):], a, lo, hi))
    return out


def _waits(instrs: list[Instr]):
    """Per function, in address order: (instruction, scoreboard, the loads still counted on it as (address, issued
    after the PDL wait), whether a forward branch can skip the instruction, whether it is after the PDL wait) for each
    scoreboard an instruction waits on. A load adds itself to its scoreboard; a wait that always runs clears it."""
    for fn in dict.fromkeys(i.function for i in instrs):
        body = [i for i in instrs if i.function == fn]
        skip = _skippable(body)
        pending: dict[int, list[tuple[int, bool]]] = {k: [] for k in range(6)}
        after = False
        for ins in body:
            for k in sorted(ins.wait):
                if pending[k]:
                    yield ins, k, pending[k], ins.addr in skip, after
                if ins.addr not in skip:
                    pending[k] = []
            if _opcode(ins.text) == "ACQBULK":
                after = True
            if ins.write_sb is not None and _LOAD.match(ins.text):
                pending[ins.write_sb] = [*pending[ins.write_sb], (ins.addr, after)]


def pdl_waits(instrs: list[Instr]) -> list[tuple[Instr, int, list[int], bool]]:
    """(instruction, scoreboard, addresses of the loads before the PDL wait it waits for, may be skipped), after
    that wait, in address order."""
    out = []
    for ins, k, pend, cond, after in _waits(instrs):
        early = [a for a, late in pend if not late]
        if after and early:
            out.append((ins, k, early, cond))
    return out


def held_loads(instrs: list[Instr]) -> list[tuple[Instr, int, list[int], bool]]:
    """(load, scoreboard, addresses of the earlier loads it waits for, may be skipped): memory loads and cp.async
    copies whose issue waits on a scoreboard that still counts other loads, so their request goes out only once those
    land (perf-history.md v58: a loop's first load of act waited for phase 2's weights)."""
    return [(ins, k, [a for a, _ in pend], cond) for ins, k, pend, cond, _ in _waits(instrs) if _ISSUE.match(ins.text)]


def _back_edges(body: list[Instr]):
    """(loop start, the backward branch) for each branch of one function to an earlier address."""
    for br in body:
        m = re.search(r"BRA (0x[0-9a-f]+)$", br.text)
        if m and int(m.group(1), 16) < br.addr:
            yield int(m.group(1), 16), br


def loop_drains(instrs: list[Instr]) -> list[tuple[Instr, int, int, int, int]]:
    """(instruction, loop start, loop end, scoreboard, loads issued before it in the same pass) for each wait inside
    a loop (a backward branch's target up to the branch) on a scoreboard that loads issued earlier in the same pass
    still count: the wait drains the requests the loop just made, so they are not in flight across it
    (perf-history.md v58: the stream GEMVs' ping-pong waits for the tile it has just refilled). An instruction inside
    nested loops is reported for the innermost one that finds the drain."""
    out = []
    for fn in dict.fromkeys(i.function for i in instrs):
        body = [i for i in instrs if i.function == fn]
        found: dict[tuple[int, int], tuple[Instr, int, int, int, int]] = {}
        for lo, br in _back_edges(body):
            issued = {k: 0 for k in range(6)}
            for ins in body:
                if not lo <= ins.addr <= br.addr:
                    continue
                for k in sorted(ins.wait):
                    old = found.get((ins.addr, k))
                    if issued[k] and (old is None or br.addr - lo < old[2] - old[1]):
                        found[(ins.addr, k)] = (ins, lo, br.addr, k, issued[k])
                    issued[k] = 0
                if ins.write_sb is not None and _LOAD.match(ins.text):
                    issued[ins.write_sb] += 1
        out += [found[key] for key in sorted(found)]
    return out


def dot_loops(instrs: list[Instr], min_dots: int = 16) -> list[tuple[str, int, int, int, int, list]]:
    """(function, loop start, loop end, dots, loads, drains) for each loop whose body holds at least min_dots dot
    instructions (IDP, HFMA2, FFMA): a GEMV's main loops. drains: loop_drains' rows that name this loop. It tells
    apart the copies of one loop in a kernel (perf-history.md v59: the whole-steps copy drains nothing, the tested
    one does)."""
    drains = loop_drains(instrs)
    out = []
    for fn, lo, hi, inside in _loop_bodies(instrs):
        dots = sum(_opcode(i.text) in ("IDP", "HFMA2", "FFMA") for i in inside)
        if dots < min_dots:
            continue
        loads = sum(i.write_sb is not None and bool(_LOAD.match(i.text)) for i in inside)
        mine = [d for d in drains if d[0].function == fn and (d[1], d[2]) == (lo, hi)]
        out.append((fn, lo, hi, dots, loads, mine))
    return out


def loop_mix(instrs: list[Instr], min_len: int = 64) -> list[tuple[str, int, int, Counter]]:
    """(function, loop start, loop end, opcodes) for each loop of at least min_len instructions, opcodes counted by
    their first name part (IMMA.16832.S8.S8 -> IMMA): where a loop's issue slots go, read without a device
    (perf.md v69: the int8 decode's 32-key loop, 723 instructions a warp on sm_90a, 537 after v69a)."""
    out = []
    for fn, lo, hi, inside in _loop_bodies(instrs):
        if len(inside) >= min_len:
            out.append((fn, lo, hi, Counter(_opcode(i.text) for i in inside)))
    return out


def _loop_bodies(instrs: list[Instr]):
    """(function, loop start, loop end, the instructions from start to end) for each backward branch."""
    for fn in dict.fromkeys(i.function for i in instrs):
        body = [i for i in instrs if i.function == fn]
        for lo, br in _back_edges(body):
            yield fn, lo, br.addr, [i for i in body if lo <= i.addr <= br.addr]


def _opcode(text: str) -> str:
    """An instruction's opcode without its guard predicate, modifiers and operands (a cuobjdump line's text or a
    decoded word's): '@!P0 BRA 0x10' -> 'BRA', 'IDP.4A.S8.S8 R1, R2, R3, R1' -> 'IDP'."""
    words = text.split()
    return (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]


def describe(ins: Instr) -> str:
    wait = "".join(str(i) for i in sorted(ins.wait)) or "-"
    sets = "-" if ins.write_sb is None else str(ins.write_sb)
    return f"{ins.addr:05x}  wait {wait:<6} sets {sets}  {ins.text}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sass", type=Path, help="cuobjdump -sass output, or an sm_90a cubin")
    ap.add_argument("--start", type=lambda s: int(s, 0), default=0, help="first address (e.g. 0x2000)")
    ap.add_argument("--end", type=lambda s: int(s, 0), default=1 << 40, help="last address")
    ap.add_argument("--function", help="only the functions whose name contains this")
    ap.add_argument("--all", action="store_true", help="every instruction, not only those that set or wait")
    ap.add_argument("--pdl", action="store_true",
                    help="only the waits after the PDL wait that still count loads issued before it")
    ap.add_argument("--held-loads", action="store_true",
                    help="only the loads and cp.async copies whose issue waits for earlier loads")
    ap.add_argument("--loop-drains", action="store_true",
                    help="only the waits in a loop on loads issued earlier in the same pass")
    ap.add_argument("--dot-loops", type=int, metavar="MIN_DOTS", default=None,
                    help="each loop with at least MIN_DOTS dot instructions: its dots, loads and drains")
    ap.add_argument("--loop-mix", type=int, metavar="MIN_INSTRS", default=None,
                    help="each loop of at least MIN_INSTRS instructions: its size and its opcodes by count")
    args = ap.parse_args(argv)
    try:
        data = args.sass.read_bytes()
        instrs = parse_cubin(data) if data[:4] == b"\x7fELF" else parse(data.decode())
    except (OSError, UnicodeDecodeError, ValueError, struct.error) as e:
        print(f"sass_waits: cannot read {args.sass}: {e}", file=sys.stderr)
        return 2
    if not instrs:
        print(f"sass_waits: {args.sass} holds no instructions (cuobjdump -sass output or a cubin)", file=sys.stderr)
        return 2
    if args.function:
        instrs = [i for i in instrs if args.function in i.function]
    if args.dot_loops is not None:
        for fn, lo, hi, dots, loads, mine in dot_loops(instrs, args.dot_loops):
            what = ", ".join(f"{d[0].addr:05x} {_opcode(d[0].text)} on {d[3]} ({d[4]} loads)" for d in mine)
            print(f"{fn}  loop {lo:05x}-{hi:05x}  dots {dots:4d}  loads {loads:3d}  drains: {what or 'none'}")
        return 0
    if args.loop_mix is not None:
        for fn, lo, hi, ops in loop_mix(instrs, args.loop_mix):
            mix = " ".join(f"{op} {n}" for op, n in ops.most_common())
            print(f"{fn}  loop {lo:05x}-{hi:05x}  {sum(ops.values())} instructions: {mix}")
        return 0
    if args.loop_drains:
        for ins, lo, hi, k, n in loop_drains(instrs):
            print(f"{ins.function}  loop {lo:05x}-{hi:05x}  {describe(ins)}   <- scoreboard {k}: {n} loads of this pass")
        return 0
    if args.pdl or args.held_loads:
        what = "loads before the wait" if args.pdl else "earlier loads"
        for ins, k, early, cond in (pdl_waits if args.pdl else held_loads)(instrs):
            if args.pdl:  # the first loads issued; the held load's: the last (the latest ones hold it up longest)
                loads = ", ".join(f"{a:05x}" for a in early[:4]) + (f" (+{len(early) - 4})" if len(early) > 4 else "")
            else:
                loads = (f"(+{len(early) - 4}) " if len(early) > 4 else "") + ", ".join(f"{a:05x}" for a in early[-4:])
            tag = " (in a branch)" if cond else ""
            print(f"{ins.function}  {describe(ins)}{tag}   <- scoreboard {k}: {what} at {loads}")
        return 0
    for ins in instrs:
        if args.start <= ins.addr <= args.end and (args.all or ins.wait or ins.write_sb is not None):
            print(describe(ins))
    return 0


if __name__ == "__main__":
    sys.exit(main())
