"""bench/sass_waits.py: the scoreboards decoded from a real `cuobjdump -sass` excerpt (moe_fused_t2_q4g64_q5g64_q8g32 at
3901c4c, sm_90a, nvcc 13.0), words of a cubin named as cuobjdump names them, a cubin's functions, one-line misuse.

Oracles, independent of the decoder: a consumer of a load's register must wait on the scoreboard the load sets (ptxas
emits correct code); fixed-latency arithmetic sets no scoreboard, a global load does; cuobjdump's text for the same
words; the PTX's entry names for the same source."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import sass_waits  # noqa: E402

# the gain's load before the PDL wait (ACQBULK), x's load after it (R32..R35), the routing's division call, and Σ x²'s
# first multiply of R33 (cuobjdump's lines, padding cut)
EXCERPT = """\
    Function : moe_fused_t2_q4g64_q5g64_q8g32
    /*0050*/ LDG.E.128.CONSTANT R36, desc[UR8][R2.64] ; /* 0x0000000802247981 */
    /* 0x000168000c1e9d00 */
    /*0400*/ ACQBULK ; /* 0x000000000000782e */
    /* 0x000fe20000000000 */
    /*0480*/ LDG.E.128.STRONG.GPU R32, desc[UR8][R16.64] ; /* 0x0000000810207981 */
    /* 0x000568000c1efd00 */
    /*2da0*/ CALL.REL.NOINC 0x12000 ; /* 0x000000f000947944 */
    /* 0x021fea0003c00000 */
    /*4640*/ FMUL.FTZ R13, R33, R33 ; /* 0x00000021210d7220 */
    /* 0x021fe20000410000 */
"""


def test_consumer_waits_on_its_load_s_scoreboard():
    gain, acq, ld, call, fmul = sass_waits.parse(EXCERPT)
    assert (ld.addr, call.addr, fmul.addr) == (0x480, 0x2DA0, 0x4640)
    assert fmul.text == "FMUL.FTZ R13, R33, R33"
    assert ld.write_sb is not None and ld.write_sb in fmul.wait  # R33 comes from the load
    assert fmul.write_sb is None  # fixed latency
    assert ld.write_sb in call.wait  # the call waits for the same loads (perf-history.md v57)


def test_misuse_is_one_line(tmp_path, capsys):
    junk = tmp_path / "k.sass"
    junk.write_text("not a listing\n")
    assert sass_waits.main([str(junk)]) == 2
    assert sass_waits.main([str(tmp_path / "missing.sass")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("sass_waits: ") for line in err)


def test_listing_filters_to_scoreboard_users(tmp_path, capsys):
    f = tmp_path / "k.sass"
    f.write_text(EXCERPT)
    assert sass_waits.main([str(f), "--start", "0x2000"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["02da0", "04640"]


def test_pdl_lists_waits_on_loads_from_before_the_wait():
    """The call waits on the gain's scoreboard after ACQBULK: reported with the gain's address. It always runs (no
    branch here), so the multiply after it waits on x's load alone and is not reported."""
    instrs = sass_waits.parse(EXCERPT)
    assert instrs[0].write_sb == instrs[2].write_sb  # the gain and x share a scoreboard, as ptxas chose
    found = sass_waits.pdl_waits(instrs)
    rows = [(ins.addr, k, early, cond) for ins, k, early, cond in found]
    assert rows == [(0x2DA0, instrs[0].write_sb, [0x50], False)]


# Words as cuobjdump prints them (address, its text, first and second word): a backward and a forward branch from
# deltanet_step_dk128_c4, the PDL wait, a predicated load, and a never-executed shared load from moe_fused.
WORDS = [
    (0x2380, "@!P3 BRA 0x1e30", 0xFFFFFFF800A8B947, 0x004FEA000383FFFF),
    (0x04D0, "@!P0 BRA 0x2360", 0x0000001C00A08947, 0x004FEA0003800000),
    (0x0400, "ACQBULK", 0x000000000000782E, 0x000FE20000000000),
    (0x0050, "LDG", 0x0000000802247981, 0x000168000C1E9D00),
    (0x1A60, "@!PT LDS", 0x00000000FFFFF984, 0x000FE20000000800),
    # attn_decode_fast_int8_d256 (v69): the int8 and bf16 mmas, a PRMT with its constant as the immediate, and the
    # fp16 variant's HADD2 with two immediates
    (0x46A0, "IMMA", 0x0000005058587237, 0x010FE20000405CFF),
    (0x59F0, "HMMA", 0x0000006D501C723C, 0x080FE2000004101C),
    (0x57A0, "PRMT", 0x4B00000052567416, 0x000FE40000000057),
    (0x45E0, "HADD2", 0xE480E48055517430, 0x000FE20000000000),
]


@pytest.mark.parametrize("addr,text,lo,hi", WORDS)
def test_decode_word_names_as_cuobjdump(addr, text, lo, hi):
    """The opcode's name, its predicate and a branch's target as cuobjdump prints them (the oracle), the control
    bits as the text parser decodes them from the same second word."""
    ins = sass_waits.decode_word("f", addr, lo, hi)
    assert ins.text == text
    assert (ins.stall, ins.write_sb, ins.read_sb, ins.wait) == sass_waits.decode_control(hi)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_cubin_functions_are_the_ptx_entries(tmp_path):
    """An sm_90a cubin of kernels/norm.cu: one function per .entry of the same source's PTX (the oracle), each with
    contiguous 16-byte instructions, an EXIT, and every branch target inside the function."""
    from ninfer_rt.gpu.build import NVCC_FLAGS, kernels_dir

    src, cubin, ptx = kernels_dir() / "norm.cu", tmp_path / "norm.cubin", tmp_path / "norm.ptx"
    for kind, out in (("-cubin", cubin), ("-ptx", ptx)):
        subprocess.run(["nvcc", kind, *NVCC_FLAGS, "-arch=sm_90a", f"-I{kernels_dir()}", "-o", str(out), str(src)],
                       check=True, capture_output=True)
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx.read_text()))
    instrs = sass_waits.parse_cubin(cubin.read_bytes())
    assert {i.function for i in instrs} == entries
    for fn in entries:
        body = [i for i in instrs if i.function == fn]
        assert [i.addr for i in body] == list(range(0, 16 * len(body), 16))
        assert any(i.text.endswith("EXIT") for i in body)
        for i in body:
            m = re.match(r"^(@!?P\d )?BRA (0x[0-9a-f]+)$", i.text)
            if m:
                assert 0 <= int(m.group(2), 16) < 16 * len(body)


# moe_fused_t2_q4g64_q5g64_q8g32's words (sm_90a, nvcc 13.0) around its grid barrier: at 6d90a77 a phase-2 weight load,
# the barrier's poll and the invalidate after it, a parameter load, and act's first load inside stage_codes' loop;
# at 17992aa the same kernel's first three act loads at compile-time counts (perf-history.md v58)
BARRIER_OLD = [(0x7F70, 0x0000000842117981, 0x000364000C1E9500), (0x8060, 0x00000008403D7981, 0x002EE8000C1EF900),
               (0x8070, 0x00000000FF00798F, 0x008FE20002000000), (0x81C0, 0x0000B200FF528B82, 0x01FEF00000000A00),
               (0x8210, 0x0000000852448981, 0x020762000C1EFD00)]
ACT_NEW = [(0x9DE0, 0x0000000858387981, 0x001EE2000C1EFD00), (0x9E00, 0x00100008583C7981, 0x000F22000C1EFD00),
           (0x9E30, 0x0030000858487981, 0x004F6C000C1EFD00)]


def test_held_loads_are_loads_waiting_on_earlier_loads():
    """A load is held exactly when its wait mask names a scoreboard an earlier load still counts: act's load in the
    loop waits on the weights' scoreboard 5 (reported with the weight load), the poll's and the parameter load's
    waits are not loads' issue waits on loads; at compile-time counts act's loads wait on nothing a load set."""
    old = [sass_waits.decode_word("f", a, lo, hi) for a, lo, hi in BARRIER_OLD]
    assert [i.text for i in old] == ["LDG", "LDG", "CCTL", "@!P0 LDC", "@!P0 LDG"]
    weight, act = old[0], old[-1]
    assert weight.write_sb in act.wait  # ptxas's control bits, the oracle
    rows = [(ins.addr, k, early, cond) for ins, k, early, cond in sass_waits.held_loads(old)]
    assert rows == [(0x8210, weight.write_sb, [0x7F70], False)]
    new = [weight] + [sass_waits.decode_word("f", a, lo, hi) for a, lo, hi in ACT_NEW]
    assert all(weight.write_sb not in i.wait for i in new[1:])
    assert sass_waits.held_loads(new) == []


def _ins(addr, text, write_sb=None, wait=()):
    """An instruction of function f with the given scoreboards (the loop tests' listings)."""
    return sass_waits.Instr("f", addr, text, 0, write_sb, None, frozenset(wait))


def test_loop_drains_are_waits_on_loads_of_the_same_pass():
    """A loop from 0x10 to the backward branch at 0x50: a wait on a scoreboard that a load of the same pass set is a
    drain (reported with how many such loads); the load before the loop, a wait on a scoreboard no load of the pass
    set, and a second wait after the first cleared it are not."""
    body = [_ins(0x00, "LDG", 4), _ins(0x10, "LDG", 5), _ins(0x20, "LDG", 5), _ins(0x30, "IDP", wait=(4, 5)),
            _ins(0x40, "FADD", wait=(5,)), _ins(0x50, "@P0 BRA 0x10")]
    rows = [(i.addr, lo, hi, k, n) for i, lo, hi, k, n in sass_waits.loop_drains(body)]
    assert rows == [(0x30, 0x10, 0x50, 5, 2)]


def test_loop_drains_name_the_innermost_loop():
    """A drain inside two loops (0x10-0x40 within 0x00-0x50) is reported once, for the inner loop."""
    body = [_ins(0x00, "NOP"), _ins(0x10, "LDG", 5), _ins(0x20, "IDP", wait=(5,)), _ins(0x30, "NOP"),
            _ins(0x40, "@P0 BRA 0x10"), _ins(0x50, "@P1 BRA 0x0")]
    rows = [(i.addr, lo, hi, k, n) for i, lo, hi, k, n in sass_waits.loop_drains(body)]
    assert rows == [(0x20, 0x10, 0x40, 5, 1)]


def test_dot_loops_count_each_loop_and_name_its_drains():
    """Two copies of a loop: the first (0x10-0x60) waits on its own refill, the second (0x70-0xc0) on a load of
    the previous pass only. Each is listed with its dots and loads, and only the first with a drain; a loop with
    fewer dots than asked for (0xd0-0xe0) is left out."""
    body = [_ins(0x10, "IDP"), _ins(0x20, "IDP"), _ins(0x30, "LDG", 5), _ins(0x40, "IMAD", wait=(5,)),
            _ins(0x50, "IDP"), _ins(0x60, "@P0 BRA 0x10"),
            _ins(0x70, "IDP", wait=(5,)), _ins(0x80, "IDP"), _ins(0x90, "FFMA"), _ins(0xa0, "LDG", 5),
            _ins(0xb0, "NOP"), _ins(0xc0, "@P0 BRA 0x70"),
            _ins(0xd0, "IDP"), _ins(0xe0, "@P1 BRA 0xd0")]
    rows = [(lo, hi, dots, loads, [(d[0].addr, d[3], d[4]) for d in mine])
            for _, lo, hi, dots, loads, mine in sass_waits.dot_loops(body, min_dots=3)]
    assert rows == [(0x10, 0x60, 3, 1, [(0x40, 5, 1)]), (0x70, 0xc0, 3, 1, [])]


def test_loop_mix_counts_each_long_loop_by_opcode():
    """Counted by hand: the outer loop 0x10-0x90 holds 9 instructions (its inner loop's included), the inner
    0x30-0x60 holds 4, below the minimum of 5; opcodes lose their predicate and modifiers."""
    body = [_ins(0x0, "MOV"), _ins(0x10, "IMMA.16832.S8.S8"), _ins(0x20, "IMMA.16832.S8.S8"),
            _ins(0x30, "PRMT"), _ins(0x40, "HMMA.1688.F32.BF16"), _ins(0x50, "PRMT"), _ins(0x60, "@P1 BRA 0x30"),
            _ins(0x70, "LDS.128"), _ins(0x80, "@!P0 LDS.64"), _ins(0x90, "@P0 BRA 0x10"), _ins(0xa0, "EXIT")]
    rows = sass_waits.loop_mix(body, min_len=5)
    assert [(lo, hi) for _, lo, hi, _ in rows] == [(0x10, 0x90)]
    assert dict(rows[0][3]) == {"IMMA": 2, "PRMT": 2, "HMMA": 1, "BRA": 2, "LDS": 2}


def test_dot_loops_count_dots_of_a_cuobjdump_listing():
    """A listing's text carries modifiers and operands ('IDP.4A.S8.S8 R1, ...'): still a dot, as in a cubin's."""
    body = [_ins(0x10, "IDP.4A.S8.S8 R1, R2, R3, R1"), _ins(0x20, "@P1 FFMA R4, R5, R6, R4"),
            _ins(0x30, "HFMA2.MMA R7, R8, R9, R7"), _ins(0x40, "FMUL R1, R1, R2"), _ins(0x50, "@P0 BRA 0x10")]
    assert [(lo, hi, dots) for _, lo, hi, dots, _, _ in sass_waits.dot_loops(body, min_dots=3)] == [(0x10, 0x50, 3)]
