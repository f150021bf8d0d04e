"""linear.gemv / linear.embed (kernels/gemv.cu) against float64 numpy on the exact decoded weights.

Oracle: W from Dev.weight (the packer's exact values), the product in float64, SwiGLU with
torch.nn.functional.silu in float64. x̂ as the kernels take it: bf16 weights multiply fp32 x̂ =
ninfer_rt.reference.ops.rms_norm_zc(x); quantized weights multiply the int16 codes of x·(1 + norm_w)
(ninfer_rt.reference.ops.act_codes16: x̂ = q · d per 32-element chunk), and the norm's rsqrt(mean x² + eps)
scales the sum (kernels/gemv.cu "Arithmetic").

Tolerance (GEMV): relative norm error ‖y - y_ref‖ / ‖y_ref‖ <= 1e-5. The products of codes are exact (int32);
what is left is fp32 (unit roundoff u = 6e-8): one int -> float conversion and one scale product per unit,
a K/1024-term running sum per lane, a 5-level shuffle tree and up to 8 warp partials, so with K <= 17408 each
output carries ~sqrt(60) u ~ 5e-7 relative error; fast-math rsqrtf/__expf add ~1e-7. 1e-5 leaves a 10x margin
and still catches any wrong element, code, scale or index (each is an O(1) relative error on its output).
Embedding rows must be bit-exact (no arithmetic besides an exact fp16-scale x code product).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from ninfer_rt.gpu import linear
from ninfer_rt.gpu.driver import GpuError
from ninfer_rt.gpu.weights import DeviceWeight

pytestmark = pytest.mark.gpu

QFORMATS = [f"q{b}g{g}" for b in (4, 5, 6, 8) for g in (32, 64, 128)]
FORMATS = QFORMATS + ["bf16"]
TOL = 1e-5
EPS = 1e-6
GUARD_ROWS = 2  # rows of y past M that run_gemv allocates and checks are left alone


# ------------------------------------------------------------------------------------------------ oracle

def swiglu_rows(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of gate_j and up_j in a [2I, K] weight interleaved in tiles of 16 (docs/format.md)."""
    j = np.arange(n // 2)
    gate = 32 * (j // 16) + j % 16
    return gate, gate + 16


def reference(wv: np.ndarray, x: np.ndarray, *, mode: str, norm_w, row_scale, y0, codes: bool) -> np.ndarray:
    """Float64 y for x [M, K] (fp32) and the exact weight values wv [N, K]; codes: x̂ as int16 codes (quantized
    weights), else fp32."""
    import torch
    import torch.nn.functional as F

    from ninfer_rt.reference.ops import act_codes16, rms_norm_zc

    if codes:
        h = x if norm_w is None else x * (np.float32(1) + norm_w)  # fp32, as staged
        q, d = act_codes16(torch.from_numpy(h))
        m, k = x.shape
        xh = (q.double().reshape(m, k // 32, 32) * d.double()[..., None]).reshape(m, k).numpy()
        if norm_w is not None:
            xd = x.astype(np.float64)
            xh = xh / np.sqrt((xd * xd).mean(-1, keepdims=True) + EPS)
    else:
        xh = x if norm_w is None else rms_norm_zc(torch.from_numpy(x), torch.from_numpy(norm_w), EPS).numpy()
    z = xh.astype(np.float64) @ wv.astype(np.float64).T  # [M, N]
    if mode == "swiglu":
        g, u = swiglu_rows(wv.shape[0])
        return (F.silu(torch.from_numpy(z[:, g])) * torch.from_numpy(z[:, u])).numpy()
    if row_scale is not None:
        z = z * row_scale.astype(np.float64)[:, None]
    return z + y0 if mode == "add" else z


def check_close(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    """Relative norm error <= TOL; a failure names the worst element, its index and both values."""
    bad = ~np.isfinite(got)
    if bad.any():
        i = np.unravel_index(np.argmax(bad), got.shape)
        raise AssertionError(f"{what}: {int(bad.sum())} non-finite outputs (unwritten?), first at {i}: "
                             f"got {got[i]}, want {ref[i]:.6g}")
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    if err > TOL:
        i = np.unravel_index(np.argmax(np.abs(got - ref)), got.shape)
        raise AssertionError(f"{what}: relative error {err:.3e} > {TOL:g}; worst at {i}: got {got[i]:.6g}, "
                             f"want {ref[i]:.6g}")


# ------------------------------------------------------------------------------------------------ one case

def run_gemv(kernels, dev, rng, w, wv, *, M: int, mode: str, norm: bool, scale: bool, ldx_pad: int = 0,
             ldy_pad: int = 0, plan: dict | None = None, what: str = "", x_copy: bool | None = None,
             x_bulk: bool | None = None) -> None:
    """Launch one gemv (or, with plan overrides, one forced _launch_gemv) and compare with the oracle, including
    that no byte outside y[:M, :N_out] is touched (columns up to ldy and GUARD_ROWS rows past M keep their poison,
    or y0 in add mode) and x's columns past K are never read (they hold NaN)."""
    n, k = w.shape
    n_out = n // 2 if mode == "swiglu" else n
    ldx, ldy = k + ldx_pad, n_out + ldy_pad
    x = rng.standard_normal((M, ldx)).astype(np.float32)
    x[:, k:] = np.nan
    norm_w = (rng.standard_normal(k) * 0.2).astype(np.float32) if norm else None
    rs = rng.uniform(0.5, 2.0, M).astype(np.float32) if scale else None
    rows = M + GUARD_ROWS
    y0 = rng.standard_normal((rows, ldy)).astype(np.float32)
    xp = dev.put(x)
    yp = dev.put(y0) if mode == "add" else dev.empty(rows * ldy * 4)
    before = y0.view(np.uint32) if mode == "add" else np.full((rows, ldy), 0xFFFFFFFF, np.uint32)
    nwp = dev.put(norm_w) if norm else 0
    rsp = dev.put(rs) if scale else 0
    if plan is None:
        linear.gemv(kernels, w, x=xp, M=M, y=yp, ldx=ldx, ldy=ldy, mode=mode, norm_w=nwp, norm_eps=EPS,
                    row_scale=rsp)
    else:
        p = linear.plan_gemv(w, M, kernels.gpu.info.sm_count, **plan)
        linear._launch_gemv(kernels, w, p, x=xp, y=yp, ldx=ldx, ldy=ldy, mode=mode, norm_w=nwp, norm_eps=EPS,
                            row_scale=rsp, x_copy=x_copy, x_bulk=x_bulk)
    got = dev.get(yp, (rows, ldy))
    label = (f"{what} {w.fmt} {list(w.shape)} M={M} mode={mode} norm={norm} row_scale={scale} "
             f"ldx={ldx} ldy={ldy}{' plan=' + str(plan) if plan else ''}"
             f"{f' x_copy={x_copy}' if x_copy is not None else ''}{f' x_bulk={x_bulk}' if x_bulk else ''}")
    ref = reference(wv, x[:, :k], mode=mode, norm_w=norm_w, row_scale=rs, y0=y0[:M, :n_out],
                    codes=w.quantized)
    check_close(got[:M, :n_out], ref, label)
    outside = np.ones((rows, ldy), bool)
    outside[:M, :n_out] = False
    changed = np.argwhere(outside & (got.view(np.uint32) != before))
    assert not len(changed), (f"{label}: {len(changed)} elements outside y[:{M}, :{n_out}] changed (columns past "
                              f"N or the {GUARD_ROWS} guard rows), first [row, col] {changed[0].tolist()}")


# ------------------------------------------------------------------------------------------------ gemv

# (M, norm, row_scale, ldx padding, plan overrides): every (format, mode) sees all four (norm, row_scale)
# combinations; ldx padding picks the float4 (ldx % 4 == 0) or the scalar staging path. The default plans at K = 352
# (test_gemv_formats checks the launches): M = 1 and 3 the stream kernels _s1 / _s3, M = 6, 7, 8 the block kernels
# _m6 / _m7 / _m8, M = 11 and 14 the chunk loop (8 + 3 rows: _m8 then _s3; 8 + 6 rows: _m8 then _m6); M = 2 forced
# onto the block kernel _m2 (its default is the stream kernel _s2, test_gemv_stream_plans_of_several_rows).
CASES = [(1, True, True, 4, None), (2, False, True, 4, {"stream": False}), (3, False, False, 5, None),
         (6, True, True, 1, None), (7, False, True, 4, None), (8, True, False, 4, None), (11, False, True, 1, None),
         (14, True, False, 5, None)]


@pytest.mark.parametrize("mode", ["store", "add", "swiglu"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_formats(recorder, dev, rng, fmt, mode):
    """Every format and mode at a small shape: N not a multiple of 4 or of a block's rows, K = 352 (Kp = 384:
    a padded last group), M in CASES (the stream kernels of 1 and 3 rows, the block kernels of 2, 6, 7 and 8 rows,
    the chunk loop at 11 and 14), ldx > K, ldy > N, two guard rows past M; the launches include every kernel
    CASES names."""
    n = 96 if mode == "swiglu" else 203
    w, wv = dev.weight(fmt, (n, 352), rng)
    for M, norm, scale, ldx_pad, plan in CASES:
        run_gemv(recorder, dev, rng, w, wv, M=M, mode=mode, norm=norm, scale=scale, ldx_pad=ldx_pad, ldy_pad=3,
                 plan=plan)
    code = "bf16" if fmt == "bf16" else fmt[:2]
    want = {f"gemv_{code}_{kind}" for kind in ("m2", "m6", "m7", "m8", "s3")}
    assert want <= set(recorder.names), f"{fmt} {mode}: launches {sorted(set(recorder.names))} miss " \
                                        f"{sorted(want - set(recorder.names))}"


@pytest.mark.parametrize("fmt", ["q4g64", "q5g32", "q6g128", "q8g32", "bf16"])
def test_gemv_k_split_and_slabs(kernels, dev, rng, fmt):
    """Every K split (1, 2, 4, 8 warps per row group) and multi-slab staging (ks = 1024 over K = 2080: slabs
    of 1024, 1024 and 32), at M = 1 and 5, store and swiglu, with the norm (its Σx² spans the slabs)."""
    w, wv = dev.weight(fmt, (96, 2080), rng)
    for kw_log2 in range(4):
        for M in (1, 5):
            for mode in ("store", "swiglu"):
                run_gemv(kernels, dev, rng, w, wv, M=M, mode=mode, norm=True, scale=mode == "store",
                         plan={"kw_log2": kw_log2, "ks": 1024})


@pytest.mark.parametrize("M,ks", [(1, None), (2, None), (4, None), (8, None), (1, 4352), (2, 4352)],
                         ids=["M1", "M2", "M4", "M8", "M1-ks4352", "M2-ks4352"])
def test_gemv_long_k(kernels, dev, rng, M, ks):
    """The 27B's down_proj K = 17408 (q5g64), add with row scales. Default plans: at M = 1, 2 the stream kernel
    (all of K in its one slab), at M = 4, 8 the block kernel over several slabs (4 of 4352, 8 of 2304); and the
    block kernel at M = 1, 2 forced to slabs of 4352 (4 slabs), so several slabs are covered at every M."""
    w, wv = dev.weight("q5g64", (256, 17408), rng)
    plan = None if ks is None else {"ks": ks}
    p = linear.plan_gemv(w, M, kernels.gpu.info.sm_count, **(plan or {}))
    assert p.stream == (M <= 2 and ks is None) and (p.stream or p.ks < 17408), p
    run_gemv(kernels, dev, rng, w, wv, M=M, mode="add", norm=False, scale=True, plan=plan)


SHAPES = [
    ("q8g32", (12288, 2048), "store", True),  # DeltaNet in_proj_qkv|z, fused input norm
    ("q8g32", (2048, 4096), "add", False),  # out_proj / o_proj + residual
    ("q8g32", (9216, 2048), "store", True),  # attention q|k|v|gate
    ("q8g32", (1024, 2048), "swiglu", True),  # shared expert gate|up
    ("q6g64", (16384, 2048), "store", True),  # lm_head rows (a slice of 248320)
    ("q6g64", (65536, 2048), "store", True),  # lm_head rows past _STREAM_BLOCK_ROWS: the stream kernel at M = 2-4
    ("q4g64", (4096, 5120), "swiglu", True),  # 27B gate|up rows (a slice of 34816)
    ("q5g64", (5120, 17408), "add", False),  # 27B down_proj
    ("q8g32", (5120, 6144), "add", False),  # 27B out_proj / o_proj + residual
    ("q8g32", (4096, 5120), "store", True),  # 27B in_proj_qkv|z rows (a slice of 16384), fused input norm
]


@pytest.mark.parametrize("fmt,shape,mode,norm", SHAPES, ids=[f"{s[0]}-{s[1][0]}x{s[1][1]}-{s[2]}" for s in SHAPES])
def test_gemv_model_shapes(kernels, dev, rng, fmt, shape, mode, norm):
    """The 35B-A3B / 27B decode shapes (default plans) at M = 1, 3 and 4 (a batched step's stream kernels where K
    fits: the 27B's gate|up at M = 4 needs 47.5 KB of slab, past the default's 48 KB less the static 1.25 KB, so it
    must opt in) and 8."""
    w, wv = dev.weight(fmt, shape, rng)
    for M in (1, 3, 4, 8):
        run_gemv(kernels, dev, rng, w, wv, M=M, mode=mode, norm=norm, scale=False)


STREAM_FORMATS = ["q4g64", "q5g32", "q6g128", "q8g32", "bf16"]  # one per stream kernel (code width)


# the stream kernel's ways of staging x: from registers, copied by cp.async, copied by bulk copies (sm_90+)
X_STAGINGS = ((False, False), (True, False), (True, True))


@pytest.mark.parametrize("fmt", STREAM_FORMATS)
def test_gemv_stream_plans(kernels, dev, rng, fmt):
    """The M = 1 stream kernel under forced plans, d in {1, most}, in every mode, with the float4 and the scalar
    staging of x. K = 2080 leaves the last step of each row group ragged. The block counts make every kind of
    warp range: 2 blocks (~25 row groups each: ranges cut groups, both register tiles in turn), 7, 37 (1-2
    groups per block, where a group is cut across several warps; the swiglu weight's 24 groups: one per block)
    and the default (13-51 blocks for the 51 row groups of N = 203, whatever the SM count: 1-4 groups and 5-10
    steps per block, so groups are cut across warps and, below 8 steps, some warps get none; one group per block
    only for bf16 at d = 1). Each case with
    ldx % 4 == 0 runs with x staged from registers and with x (and norm_w) copied into shared memory by cp.async
    (x_copy, xvec = 2) and by bulk copies (x_bulk: gemv_*_s1b on sm_90+)."""
    ws = {mode: dev.weight(fmt, (96 if mode == "swiglu" else 203, 2080), rng) for mode in ("store", "swiglu")}
    dmax = linear._STREAM_DEPTH[16 if fmt == "bf16" else int(fmt[1])]
    for d in sorted({1, dmax}):
        for blocks, mode, norm, scale, ldx_pad in [(2, "store", True, True, 4), (7, "add", False, True, 1),
                                                   (2, "swiglu", True, False, 4), (37, "swiglu", False, False, 0),
                                                   (37, "store", False, True, 0), (None, "add", True, False, 0)]:
            w, wv = ws["swiglu" if mode == "swiglu" else "store"]
            for x_copy, x_bulk in X_STAGINGS if ldx_pad % 4 == 0 else X_STAGINGS[:1]:
                run_gemv(kernels, dev, rng, w, wv, M=1, mode=mode, norm=norm, scale=scale, ldx_pad=ldx_pad,
                         ldy_pad=2, what="stream", plan={"stream": True, "d": d, "blocks": blocks}, x_copy=x_copy,
                         x_bulk=x_bulk)


@pytest.mark.parametrize("fmt", STREAM_FORMATS)
def test_gemv_stream_plans_of_several_rows(kernels, dev, rng, fmt):
    """The stream kernels of M = 2, 3, 4 rows (gemv_*_s{M}) under the block counts test_gemv_stream_plans uses
    (ranges that cut row groups, groups cut across several warps, the default), in every mode, with and without
    the norm and row scales, x staged by float4 (ldx % 4 == 0) and scalar loads; K = 2080 leaves each group's
    last step ragged. Each output row m must be row m's own product: rows are drawn independently."""
    ws = {mode: dev.weight(fmt, (96 if mode == "swiglu" else 203, 2080), rng) for mode in ("store", "swiglu")}
    for M in (2, 3, 4):
        for blocks, mode, norm, scale, ldx_pad in [(2, "store", True, True, 4), (7, "add", False, True, 1),
                                                   (2, "swiglu", True, False, 4), (37, "swiglu", False, False, 1),
                                                   (37, "store", False, True, 0), (None, "add", True, False, 0)]:
            w, wv = ws["swiglu" if mode == "swiglu" else "store"]
            run_gemv(kernels, dev, rng, w, wv, M=M, mode=mode, norm=norm, scale=scale, ldx_pad=ldx_pad, ldy_pad=2,
                     what="stream rows", plan={"stream": True, "blocks": blocks})


@pytest.mark.parametrize("fmt,shape", [("q4g128", (41, 5120)), ("q5g32", (37, 10240)), ("q8g64", (300, 4096)),
                                       ("q8g64", (300, 6144))])
def test_gemv_stream_long_k(kernels, dev, rng, fmt, shape):
    """The stream kernel's x̂ staging over more than one pass of 4096 elements, up to the longest K it takes
    (10240 here), with the norm (its Σx² spans the passes), default plans: at K = 4096 four elements a thread,
    past it one chunk a thread (gemv_stream.cu kChunkCoderMinK), for both code orders (q8, nibble formats)."""
    w, wv = dev.weight(fmt, shape, rng)
    assert linear.plan_gemv(w, 1, kernels.gpu.info.sm_count).stream
    for mode, ldx_pad in [("store", 0), ("add", 1)]:
        run_gemv(kernels, dev, rng, w, wv, M=1, mode=mode, norm=True, scale=True, ldx_pad=ldx_pad)


def test_gemv_stream_at_its_int16_cap(kernels, dev, rng):
    """The stream kernel on the 27B down_proj's K = 17408 (q5g64: 43.5 KB of int16 x̂ codes) and on the longest K
    its slab holds (18688), store and add, with and without the norm, x staged from registers and copied by
    cp.async or bulk copies. At [544, 17408] (136 row groups) the default plan launches one block per SM and
    sm_count + 1 blocks need two on some SM, so the copy must fit beside two slabs (on the H100 / H200 it does
    except with the norm, which then stages from registers). At [12, 18688] (3 row groups) both launches are 3
    blocks of one group each (blocks never exceed the groups): the longest slab, one block per SM."""
    for shape in ((544, 17408), (12, 18688)):
        w, wv = dev.weight("q5g64", shape, rng)
        for mode, norm in (("store", True), ("add", False)):
            for blocks in (None, kernels.gpu.info.sm_count + 1):
                for x_copy, x_bulk in X_STAGINGS:
                    run_gemv(kernels, dev, rng, w, wv, M=1, mode=mode, norm=norm, scale=True, what="stream cap",
                             plan={"stream": True, "blocks": blocks}, x_copy=x_copy, x_bulk=x_bulk)


# ------------------------------------------------------------------------------------------------ embed

@pytest.mark.parametrize("fmt", FORMATS)
def test_embed(kernels, dev, rng, fmt):
    """Rows ids[m] bit-exact (first and last row included, a repeat, an aligned and a 4-byte-offset output);
    an id outside [0, V) (V, -1, INT32_MIN, INT32_MAX) gives a row of the kernel's quiet NaN 0x7FC00000 (gemv.cu
    embed_body), written over an output that starts at zero, beside a valid id's exact row; the bytes around the
    output region keep theirs."""
    v, k = 300, 352
    w, wv = dev.weight(fmt, (v, k), rng)
    ids = np.concatenate([[0, v - 1, 7, 0], rng.integers(0, v, 7)]).astype(np.int32)
    m = len(ids)
    idp = dev.put(ids)
    for offset in (0, 4):
        base = dev.empty(m * k * 4 + 16)
        linear.embed(kernels, w, ids=idp, M=m, out=base + offset)
        got = dev.get(base + offset, (m, k))
        want = wv[ids]
        if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            r, c = np.argwhere(got.view(np.uint32) != want.view(np.uint32))[0]
            raise AssertionError(f"embed {fmt} out+{offset}: row {r} (id {ids[r]}) col {c}: got {got[r, c]!r}, "
                                 f"want {want[r, c]!r}")
        raw = dev.get(base, (m * k * 4 + 16,), np.uint8)
        margin = np.r_[raw[:offset], raw[offset + m * k * 4:]]
        assert (margin == 0xFF).all(), f"embed {fmt} out+{offset}: wrote outside out[:{m}, :{k}]"
    bad_ids = np.array([v, 3, -1, -2**31, 2**31 - 1], np.int32)
    nb = len(bad_ids)
    bad = dev.put(bad_ids)
    for lead in (4, 1):  # out 16-byte aligned (float4 stores) and 4 bytes past it (scalar stores)
        buf = dev.put(np.zeros(nb * k + 8, np.float32))  # finite: an unwritten NaN row would show
        linear.embed(kernels, w, ids=bad, M=nb, out=buf + 4 * lead)
        got = dev.get(buf, (nb * k + 8,)).view(np.uint32)
        rows = got[lead:lead + nb * k].reshape(nb, k)
        for r, i in enumerate(bad_ids):
            want = wv[i].view(np.uint32) if 0 <= i < v else np.full(k, 0x7FC00000, np.uint32)
            assert np.array_equal(rows[r], want), \
                f"embed {fmt} out+{4 * lead}: row {r} (id {i}) is not {'the exact row' if 0 <= i < v else 'NaN'}: " \
                f"first words {[hex(u) for u in rows[r, :4]]}"
        assert not np.r_[got[:lead], got[lead + nb * k:]].any(), f"embed {fmt}: wrote outside out[:{nb}, :{k}]"


# ------------------------------------------------------------------------------------------------ checks (no GPU)

class FakeKernels:
    """Records launches instead of running them: the argument checks and the chunk loop need no GPU."""

    def __init__(self):
        # the H200's shared memory: 228 KiB per SM, 227 KiB per block
        self.gpu = SimpleNamespace(info=SimpleNamespace(sm_count=132, max_smem_per_sm=233472,
                                                        max_smem_per_block_optin=232448, major=9))
        self.calls = []
        self.smem_opt_in = {}

    def opt_in_smem(self, name, nbytes):
        self.smem_opt_in[name] = max(nbytes, self.smem_opt_in.get(name, 0))

    def launch(self, name, grid, block, args, smem=0, stream=None):
        self.calls.append((name, grid, block, [a.value for a in args], smem))


def test_gemv_argument_errors():
    k = FakeKernels()
    w = DeviceWeight("w", "q4g64", (64, 256), 1 << 20)
    ok = dict(x=4096, M=1, y=8192)
    for bad, msg in [
        (dict(w=DeviceWeight("w", "q4g64", (64, 100), 1 << 20)), "multiple of 32"),
        (dict(w=DeviceWeight("w", "q4g64", (2, 64, 256), 1 << 20)), "2-D"),
        (dict(w=DeviceWeight("w", "fp32", (64, 256), 1 << 20)), "no GEMV kernel"),
        (dict(mode="mul"), "mode"),
        (dict(w=DeviceWeight("w", "q4g64", (48, 256), 1 << 20), mode="swiglu"), "N % 32"),
        (dict(ldx=255), "ldx"),
        (dict(ldy=63), "ldy"),
        (dict(M=-1), "M >= 0"),
        (dict(x=0), "device pointers"),
    ]:
        kw = {**ok, **bad}
        ww = kw.pop("w", w)
        with pytest.raises(GpuError, match=msg):
            linear.gemv(k, ww, **kw)
    assert not k.calls
    linear.gemv(k, w, x=4096, M=0, y=8192)
    assert not k.calls


def test_gemv_chunk_loop_offsets():
    """M = 19 runs as 8 + 8 + 3 rows with x, y and row_scale advanced by whole rows (the last 3 on the stream
    kernel of 3 rows)."""
    k = FakeKernels()
    w = DeviceWeight("w", "q8g32", (64, 256), 1 << 20)
    linear.gemv(k, w, x=1 << 24, M=19, y=1 << 26, ldx=260, ldy=70, row_scale=1 << 28, mode="add")
    assert [c[0] for c in k.calls] == ["gemv_q8_m8", "gemv_q8_m8", "gemv_q8_s3"]
    for i, (name, grid, block, a, smem) in enumerate(k.calls):
        assert a[3] == (1 << 24) + 4 * 8 * i * 260 and a[4] == (1 << 26) + 4 * 8 * i * 70
        assert a[6] == (1 << 28) + 4 * 8 * i and a[13] == 1 and block == (256,) and smem <= 46 * 1024


def test_embed_argument_errors():
    k = FakeKernels()
    with pytest.raises(GpuError, match="multiple of 32"):
        linear.embed(k, DeviceWeight("e", "q8g32", (10, 40), 1 << 20), ids=64, M=1, out=128)
    with pytest.raises(GpuError, match="no embed kernel"):
        linear.embed(k, DeviceWeight("e", "f16", (10, 64), 1 << 20), ids=64, M=1, out=128)
    linear.embed(k, DeviceWeight("e", "q6g64", (10, 64), 1 << 20), ids=64, M=3, out=128)
    assert k.calls[0][0] == "embed_q6g64" and k.calls[0][1] == (1, 3)


def test_plan_fits_shared_memory():
    """Every M's x̂ slab stays under the 48 KB default with the kernel's 1.25 KB of static shared memory, but for the
    stream kernels of several rows, whose slab opts in up to 100 KB (two blocks an SM still fit). The grid, as
    GemvPlan documents it: a stream plan's grid is its row groups (ceil(N / 4)), of which it launches `blocks` in
    [1, grid], with all of K in one slab; a block plan launches `grid` = ceil(groups / (8 >> kw_log2)) block tiles
    (8 warps, 1 << kw_log2 of them on each group)."""
    for fmt in ("q4g32", "q8g64", "bf16"):
        for n, k_ in itertools.product((4096, 203), (256, 2048, 5120, 17408)):
            w = DeviceWeight("w", fmt, (n, k_), 0)
            code = "bf16" if fmt == "bf16" else fmt[:2]
            groups = -(-n // 4)  # row groups of 4 rows
            for m in range(1, 9):
                p = linear.plan_gemv(w, m, 132)
                cap = 100 * 1024 if p.stream and m > 1 else 48 * 1024 - 1280  # several-row stream slabs opt in
                assert p.smem <= cap and p.ks % 32 == 0 and p.ks <= k_
                if p.stream:  # grid: the row groups, shared out by `blocks` persistent blocks
                    assert p.name == f"gemv_{code}_s{m}" and p.m == m and p.kw_log2 == 0 and p.ks == k_
                    assert p.grid == groups and 1 <= p.launch_blocks == p.blocks <= groups
                else:  # grid: block tiles of 8 >> kw_log2 row groups, all launched
                    assert p.name == f"gemv_{code}_m{m}" and 0 <= p.kw_log2 <= 3 and p.blocks == 0
                    assert p.grid == -(-groups // (8 >> p.kw_log2)) == p.launch_blocks
    # M = 1 int16 x̂ (80 bytes per chunk): the 27B down_proj's K = 17408 is one slab
    assert linear.plan_gemv(DeviceWeight("w", "q5g64", (5120, 17408), 0), 1, 132).ks == 17408


def test_stream_plans():
    """M = 1 with all of K in one slab takes the stream kernel: d the format's deepest register tile unless K
    is shorter than one step of it; 2 blocks per SM when each warp still gets 2 steps, else at most one per SM
    and one step per warp; M > 4, a slab or K-split override, K past the slab or N >= _STREAM_BLOCK_ROWS
    (65536, the lm_head) keeps the block kernel (M = 2..4: test_stream_plans_of_several_rows)."""
    for fmt in ("q4g64", "q5g32", "q6g64", "q8g32", "bf16"):
        bits = 16 if fmt == "bf16" else int(fmt[1])
        eu = {16: 8, 8: 16}.get(bits, 32)
        dmax = linear._STREAM_DEPTH[bits]
        for n in (65536, 248320):
            assert not linear.plan_gemv(DeviceWeight("w", fmt, (n, 2048), 0), 1, 132).stream
        for n in (1, 5, 64, 203, 1024, 2048, 9216, 12288, 34816, 65535):
            for k_ in (32, 352, 512, 2048, 4096, 10240):
                w = DeviceWeight("w", fmt, (n, k_), 0)
                p = linear.plan_gemv(w, 1, 132)
                groups = -(-n // 4)
                assert p.stream and p.name == f"gemv_{fmt[:2] if bits != 16 else 'bf16'}_s1"
                assert p.d == (dmax if 32 * dmax <= k_ // eu else 1) and p.ks == k_ and p.kw_log2 == 0
                steps = groups * -(-(k_ // eu) // (32 * p.d))
                assert p.grid == groups and p.launch_blocks == p.blocks <= groups
                if steps >= 2 * 8 * 264:
                    assert p.blocks == min(264, groups)
                else:
                    assert p.blocks == min(132, -(-steps // 8), groups)
                # per 32-element chunk: int16 codes (64 B) + (d, Σq) (8 B) padded to 5 16-byte units for
                # quantized weights, 36 fp32 for bf16 (kernels/gemv.cuh qchunk_bytes / chunk_stride)
                assert p.smem == k_ // 32 * (144 if bits == 16 else 80) and p.smem + 1280 <= 48 * 1024
        w = DeviceWeight("w", fmt, (4096, 2048), 0)
        assert not linear.plan_gemv(w, 5, 132).stream
        assert not linear.plan_gemv(w, 1, 132, ks=1024).stream
        assert not linear.plan_gemv(w, 1, 132, kw_log2=1).stream
        assert not linear.plan_gemv(w, 1, 132, stream=False).stream
        for bad in (dict(stream=True, ks=1024), dict(stream=True, kw_log2=0), dict(d=dmax + 1), dict(d=0),
                    dict(blocks=0), dict(stream=False, d=1), dict(ks=1024, blocks=4)):
            with pytest.raises(GpuError):
                linear.plan_gemv(w, 1, 132, **bad)
        cap = 10240 if bits == 16 else 18688  # 46 KB of x̂: 36 fp32 or 80 bytes of int16 codes per 32 elements
        assert linear.plan_gemv(DeviceWeight("w", fmt, (64, cap), 0), 1, 132).stream
        assert not linear.plan_gemv(DeviceWeight("w", fmt, (64, cap + 256), 0), 1, 132).stream
        with pytest.raises(GpuError, match="K <="):
            linear.plan_gemv(DeviceWeight("w", fmt, (64, cap + 256), 0), 1, 132, stream=True)
        p = linear.plan_gemv(w, 1, 132, stream=True, d=1, blocks=5)
        assert (p.d, p.kw_log2, p.blocks, p.grid) == (1, 0, 5, 1024)
        assert linear.plan_gemv(w, 1, 132, blocks=5000).blocks == 1024  # never more blocks than row groups
    # the H200 sweep's shapes (perf-history.md v13): two blocks per SM for the 35B q|k|v|gate, one for its o_proj,
    # and 64 for the shared expert's gate|up (one step of 2 units per warp)
    for shape, blocks in [((9216, 2048), 264), ((2048, 4096), 132), ((1024, 2048), 64)]:
        assert linear.plan_gemv(DeviceWeight("w", "q8g32", shape, 0), 1, 132).blocks == blocks


def test_stream_plans_of_several_rows():
    """M = 2..4 with all of K in one slab of M-row chunk records takes the stream kernel of M rows (gemv_*_s{M}):
    one unit per lane and row, the M = 1 plan's blocks; the slab is K/32 chunks of x_chunk_bytes(M) (int16 codes
    and (d, Σq) of every row, padded to an odd number of 16-byte units; fp32 rows of 36 plus 4 at even M for
    bf16) within 100 KB (opted in past 46 KB), so the longest K shrinks with M; at any N. Launches stage x from
    registers (no copy, no swiglu kernel of its own), with d appended."""
    for fmt in ("q4g64", "q5g32", "q6g64", "q8g32", "bf16"):
        bits = 16 if fmt == "bf16" else int(fmt[1])
        code = "bf16" if bits == 16 else fmt[:2]
        for m in (2, 3, 4):
            per_chunk = 4 * (36 * m + (4 if m % 2 == 0 else 0)) if bits == 16 else 16 * ((72 * m + 15) // 16 | 1)
            assert per_chunk == linear.x_chunk_bytes(m, bits != 16)
            for n, k_ in ((203, 352), (2048, 4096), (12288, 2048)):
                w = DeviceWeight("w", fmt, (n, k_), 0)
                if k_ // 32 * per_chunk > 100 * 1024:
                    assert not linear.plan_gemv(w, m, 132).stream
                    continue
                p, p1 = linear.plan_gemv(w, m, 132), linear.plan_gemv(w, 1, 132, d=1)
                assert p.stream and p.name == f"gemv_{code}_s{m}" and p.m == m and p.d == 1
                assert (p.grid, p.blocks, p.ks) == (p1.grid, p1.blocks, k_) and p.smem == k_ // 32 * per_chunk
            cap = 100 * 1024 // per_chunk * 32 // 256 * 256
            assert linear.plan_gemv(DeviceWeight("w", fmt, (64, cap), 0), m, 132).stream
            # the lm_head's rows, past _STREAM_BLOCK_ROWS: the block kernel at M = 1 (test_stream_plans) only
            assert linear.plan_gemv(DeviceWeight("w", fmt, (248320, 2048), 0), m, 132).stream
            assert not linear.plan_gemv(DeviceWeight("w", fmt, (64, cap + 256), 0), m, 132).stream
            with pytest.raises(GpuError, match="d must be 1..1"):
                linear.plan_gemv(DeviceWeight("w", fmt, (64, 2048), 0), m, 132, d=2)
    with pytest.raises(GpuError, match="M <= 4"):
        linear.plan_gemv(DeviceWeight("w", "q8g32", (64, 2048), 0), 5, 132, stream=True)
    for major in (9, 8):
        k = FakeKernels()
        k.gpu.info.major = major
        w = DeviceWeight("w", "q8g32", (1024, 2048), 1 << 20)
        linear.gemv(k, w, x=1 << 24, M=3, y=1 << 26, mode="swiglu", norm_w=1 << 28)
        (name, grid, block, a, smem), = k.calls
        p = linear.plan_gemv(w, 3, 132)
        assert name == "gemv_q8_s3" and grid == (p.blocks,) and smem == p.smem and a[17] == 1 and a[18] == 1
        assert a[13] == 2 and k.smem_opt_in == {}
    # the 27B's down at M = 2: 78 KB of records (144 bytes a chunk), opted in (two blocks an SM still fit)
    k = FakeKernels()
    down = DeviceWeight("d", "q5g64", (5120, 17408), 1 << 20)
    linear.gemv(k, down, x=1 << 24, M=2, y=1 << 26, mode="add")
    (name, _, _, _, smem), = k.calls
    assert name == "gemv_q5_s2" and smem == 17408 // 32 * 144 and k.smem_opt_in == {name: smem}
    assert not linear.plan_gemv(down, 3, 132).stream  # 130 KB at M = 3


def test_stream_launch_arguments():
    """A stream plan launches `blocks` blocks with the block kernel's arguments and d appended (on an sm_80 GPU, so
    x is staged from registers: no copy, test_stream_x_copy_launch)."""
    k = FakeKernels()
    k.gpu.info.major = 8
    w = DeviceWeight("w", "q8g32", (12288, 2048), 1 << 20)
    linear.gemv(k, w, x=1 << 24, M=1, y=1 << 26, mode="add", norm_w=1 << 28)
    (name, grid, block, a, smem), = k.calls
    p = linear.plan_gemv(w, 1, 132)
    assert name == "gemv_q8_s1" == p.name and grid == (p.blocks,) and block == (256,) and smem == p.smem
    assert len(a) == 19 and a[18] == p.d and a[15] == 0 and a[13] == 1 and a[17] == 1
    assert k.smem_opt_in == {}


def test_stream_x_copy_launch():
    """A stream plan copies x (and norm_w) after its slab (xvec = 2, K floats each, the kernel opted in to the larger
    shared memory) where that fits beside the plan's blocks per SM: on sm_90+ at every K, by cp.async up to
    _STREAM_X_ASYNC_UPTO (4096) and by bulk copies past it (gemv_*_s1b, 16 bytes more for the mbarrier); before
    sm_90 by cp.async from K > _STREAM_X_COPY_ABOVE (4096)."""
    assert linear._STREAM_X_COPY_ABOVE == 4096 and linear._STREAM_X_BULK and linear._STREAM_X_BULK_ABOVE == 0
    assert linear._STREAM_X_ASYNC_UPTO == 4096
    short, long = DeviceWeight("w", "q8g32", (9216, 2048), 1 << 20), DeviceWeight("d", "q5g64", (5120, 17408), 1 << 20)
    p0, p1 = linear.plan_gemv(short, 1, 132), linear.plan_gemv(long, 1, 132)
    assert p1.blocks == 264
    for major in (9, 8):
        k = FakeKernels()
        k.gpu.info.major = major
        linear.gemv(k, short, x=1 << 24, M=1, y=1 << 26, norm_w=1 << 28)
        linear.gemv(k, long, x=1 << 24, M=1, y=1 << 26, mode="add")
        linear.gemv(k, long, x=1 << 24, M=1, y=1 << 26, norm_w=1 << 28)
        (n0, _, _, a0, s0), (n1, _, _, a1, s1), (n2, _, _, a2, s2) = k.calls
        b, mbar = ("b", 16) if major >= 9 else ("", 0)
        if major >= 9:  # K <= 4096 too, by cp.async: 8 + 8 KB
            assert n0 == p0.name and a0[17] == 2 and s0 == p0.smem + 8 * 2048
        else:  # K <= 4096: registers
            assert n0 == p0.name and a0[17] == 1 and s0 == p0.smem
        assert n1 == p1.name + b and a1[17] == 2 and s1 == p1.smem + 4 * 17408 + mbar  # 43.5 + 68 KB, twice per SM
        assert k.smem_opt_in[n1] == s1
        assert n2 == p1.name and a2[17] == 1 and s2 == p1.smem  # with norm_w: 43.5 + 136 KB does not fit twice
