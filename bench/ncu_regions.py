"""Where one kernel's warps stall, from Nsight Compute's source view exported as CSV (SASS):

    ncu -i k.ncu-rep --page source --csv --print-source sass > k.csv
    python bench/ncu_regions.py k.csv [--top 12]

Prints the stall reasons over all samples, the executed instructions and the samples by opcode, and the kernel cut
into regions: runs of consecutive instructions with one execution count (a straight-line stretch that every warp
through it runs once: a routing pass, a step's dots, a staging loop), each with its instruction count, executions,
samples and main stall reasons. Instructions never executed are left out of the regions. The samples are ncu's
"Warp Stall Sampling (All Samples)"; a region's reasons sum its instructions' per-reason columns (stall_*).
A region's samples over its executions compare regions' cost per warp pass (perf.md v64 read the fused MoE's
routing and a GEMV's steps this way). Exits with one line on a missing file or a CSV that is not such an export.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Instr:
    address: int
    source: str
    samples: int
    executed: int
    stalls: dict[str, int] = field(default_factory=dict)  # reason (without "stall_") -> samples

    @property
    def opcode(self) -> str:
        """The mnemonic without its predicate and modifiers: `@!P0 LDG.E.128` -> LDG."""
        words = [w for w in self.source.split() if not w.startswith("@")]
        return words[0].split(".")[0] if words else "?"


def stall_totals(instrs: list[Instr]) -> Counter:
    """Samples per stall reason over instrs."""
    c: Counter = Counter()
    for i in instrs:
        c.update(i.stalls)
    return c


@dataclass
class Region:
    executed: int
    instrs: list[Instr]

    @property
    def first(self) -> int:
        return self.instrs[0].address

    @property
    def last(self) -> int:
        return self.instrs[-1].address

    @property
    def samples(self) -> int:
        return sum(i.samples for i in self.instrs)

    def stalls(self) -> Counter:
        return stall_totals(self.instrs)


def _int(v: str) -> int:
    v = v.replace(",", "").strip()
    return int(v) if v not in ("", "-") else 0


def load(path: str) -> tuple[str, list[Instr]]:
    """(kernel name, instructions in address order) of an `ncu --page source --csv --print-source sass` export."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except (UnicodeDecodeError, csv.Error):
        raise ValueError(f"{path}: not a text CSV") from None
    head = next((n for n, r in enumerate(rows) if "Address" in r and "Source" in r), None)
    if head is None or not {SAMPLES, EXECUTED} <= set(rows[head]):
        raise ValueError(f"{path}: not an ncu source-view CSV (no Address, Source, '{SAMPLES}' and "
                         f"'{EXECUTED}' columns)")
    name = next((r[1] for r in rows[:head] if len(r) > 1 and r[0] == "Kernel Name"), "?")
    hdr = rows[head]
    ix = {h: n for n, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]
    out = []
    for r in rows[head + 1:]:
        if len(r) != len(hdr):
            continue
        try:
            addr = int(r[ix["Address"]], 16)
            stalls = {h[len("stall_"):]: _int(r[ix[h]]) for h in reasons}
            out.append(Instr(addr, r[ix["Source"]].strip(), _int(r[ix[SAMPLES]]), _int(r[ix[EXECUTED]]),
                             {k: v for k, v in stalls.items() if v}))
        except ValueError:
            raise ValueError(f"{path}: a row that is not an instruction: {r[:2]}") from None
    if not out:
        raise ValueError(f"{path}: no instructions")
    out.sort(key=lambda i: i.address)
    return name, out


def regions(instrs: list[Instr]) -> list[Region]:
    """Maximal runs of consecutive instructions with one nonzero execution count."""
    out: list[Region] = []
    for i in instrs:
        if out and out[-1].executed == i.executed:
            out[-1].instrs.append(i)
        else:
            out.append(Region(i.executed, [i]))
    return [g for g in out if g.executed > 0]


def by_opcode(instrs: list[Instr]) -> tuple[Counter, Counter]:
    """(executions, samples) per opcode."""
    ex: Counter = Counter()
    sa: Counter = Counter()
    for i in instrs:
        ex[i.opcode] += i.executed
        sa[i.opcode] += i.samples
    return ex, sa


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu -i REP --page source --csv --print-source sass > FILE")
    ap.add_argument("--top", type=int, default=12, help="opcodes and reasons listed")
    args = ap.parse_args()
    try:
        name, instrs = load(args.csv)
    except ValueError as e:
        sys.exit(f"ncu_regions: {e}")
    base = instrs[0].address
    ex, sa = by_opcode(instrs)
    n, ne = sum(sa.values()), sum(ex.values())
    print(f"{name}: {n} samples, {ne} warp instructions executed")
    print("stall reasons, % of samples:", ", ".join(f"{k} {100 * v / max(n, 1):.1f}"
                                                    for k, v in stall_totals(instrs).most_common(args.top)))
    print("executed by opcode, %:", ", ".join(f"{k} {100 * v / max(ne, 1):.1f}" for k, v in ex.most_common(args.top)))
    print("samples by opcode:", ", ".join(f"{k} {v}" for k, v in sa.most_common(args.top)))
    print("regions (offsets from the first instruction; runs of one execution count):")
    for g in regions(instrs):
        ops = Counter(i.opcode for i in g.instrs).most_common(4)
        top = [(k, v) for k, v in g.stalls().most_common(4) if v]
        print(f"  {g.first - base:05x}-{g.last - base:05x} n={len(g.instrs):4d} exec={g.executed:7d} "
              f"samples={g.samples:4d}  ops {dict(ops)}  stalls {dict(top)}")


if __name__ == "__main__":
    main()
