"""kernels/gemm.cu (gemm.gemm, gemm.moe_grouped) against float64 numpy on the exact decoded weights, for both
kernels (fixture `kernel`): the mma.sync tiles, and on an H100/H200 the wgmma tiles.

Oracle: y = x @ W.T in float64 with W the exact values of the stored weight (Dev.weight), then the mode's
epilogue (row scale, add, SwiGLU on the interleaved gate/up rows). The kernels read x in bf16 (given here as
x rounded to nearest even, what misc.cast_bf16 makes), multiply quantized weights as w = q · s rounded to bf16
for q8 (kernels/gemm.cuh "scaled weights": the exact value rounded once, RN(W); on mma.sync the nibble formats'
codes are exact and their scales apply in fp32, so RN(W) = W there, while wgmma takes every quantized format as
RN(W)) and write SwiGLU outputs in bf16.
Two checks on every output:
  * against the oracle on the exact x and W: x and W in bf16 (unit roundoff 2^-8) each carry an rms relative
    error of ~1.6e-3 with random mantissas, so a product's relative norm error is ~2.3e-3 (x alone measured
    1.7e-3, worst 2.7e-3 at M = 1 over 200 draws: worst ≈ 1.6 × rms). Bound 5e-3. SwiGLU multiplies two such
    results and rounds to bf16 (~1.6e-3 more): 8e-3. MoE rounds x, then the activation, to bf16, and both
    weights: 1.2e-2.
  * against the oracle on bf16-rounded x and RN(W) (and, for the MoE down projection, on the kernel's own bf16
    activation): only fp32 accumulation differs (~1e-6). Bound 1e-4 in
    norm: a wrong scale, code, pairing or tile shows up here at the 1e-2 level. A bf16 output is checked
    element by element: within half a bf16 ulp (2^-8 relative) plus 1e-4 of the rms.
Outputs start poisoned (NaN bytes), so an unwritten element fails as non-finite; elements outside y[:M, :cols]
(extra rows, columns up to ldy) must keep their bytes; x columns beyond K hold NaN and must not be read.
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.formats import bf16_bits_to_f32, f32_to_bf16_bits
from ninfer_rt.gpu import gemm
from ninfer_rt.gpu.driver import GpuError, i32, ptr
from ninfer_rt.gpu.weights import DeviceWeight
from .conftest import bf16_round

pytestmark = pytest.mark.gpu

QFORMATS = [f"q{b}g{g}" for b in (4, 5, 6, 8) for g in (32, 64, 128)]
TOL_EXACT = {"store": 5e-3, "add": 5e-3, "swiglu": 8e-3}
TOL_MOE = 1.2e-2
TOL_BF16X = 1e-4


# ------------------------------------------------------------------------------------------------ helpers

@pytest.fixture(params=["mma", "wgmma", "wgmma_ss"])
def kernel(request, kernels):
    """The GEMM kernel under test; wgmma and wgmma_ss (dequantized into a scratch) only where they run
    (gemm.wgmma_available)."""
    if request.param.startswith("wgmma") and not gemm.wgmma_available(kernels):
        pytest.skip("the wgmma tiles need an H100/H200 running the sm_90a cubin")
    return request.param


def dq_row(p):
    """gemm_wgmma.cu dq_row: the weight row held by scratch row p (bits 3 and 4 swapped)."""
    return (p & ~0x18) | ((p & 8) << 1) | ((p >> 1) & 8)


def silu(z):
    return z / (1.0 + np.exp(-z))


def swiglu_rows(n: int):
    """Row indices of the gate and up halves in the interleaved layout (tiles of 16 in 32-row blocks)."""
    idx = np.arange(n).reshape(-1, 32)
    return idx[:, :16].ravel(), idx[:, 16:].ravel()


def reference(w, x, mode="store", rs=None):
    """float64 y = epilogue(x @ w.T); w [N, K] exact values, x [M, K]."""
    o = x.astype(np.float64) @ w.astype(np.float64).T
    if mode == "swiglu":
        gi, ui = swiglu_rows(w.shape[0])
        return silu(o[:, gi]) * o[:, ui]
    return o if rs is None else o * rs.astype(np.float64)[:, None]


def assert_close(got, want, tol, what):
    """Relative norm error <= tol; on failure, name the worst element and the first bad rows / columns."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    bad = ~np.isfinite(got)
    if bad.any():
        m, n = np.argwhere(bad)[0]
        raise AssertionError(f"{what}: {bad.sum()} of {got.size} outputs non-finite (unwritten?), first [{m}, {n}]")
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    if err > tol:
        d = np.abs(got - want)
        m, n = np.unravel_index(np.argmax(d), d.shape)
        scale = 10 * tol * np.sqrt(np.mean(want ** 2))
        rows = np.flatnonzero(d.max(axis=1) > scale)[:8].tolist()
        cols = np.flatnonzero(d.max(axis=0) > scale)[:8].tolist()
        raise AssertionError(f"{what}: relative error {err:.3e} > {tol:.0e}; worst [{m}, {n}] got {got[m, n]:.6g} "
                             f"want {want[m, n]:.6g}; rows off {rows}, cols off {cols}")


def assert_bf16_close(got, want, what):
    """A bf16 output: |got - want| <= 2^-8 |want| (half an ulp) + TOL_BF16X · rms(want), element by element."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what}: {(~np.isfinite(got)).sum()} outputs non-finite (unwritten?)"
    excess = np.abs(got - want) - (2.0 ** -8 * np.abs(want) + TOL_BF16X * np.sqrt(np.mean(want ** 2)))
    m, n = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[m, n] <= 0, f"{what}: [{m}, {n}] got {got[m, n]:.6g} want {want[m, n]:.6g}, beyond bf16 rounding"


def untouched(got, before, M, cols, what):
    """Every element outside [:M, :cols] still has its initial bytes."""
    outside = np.ones(got.shape, bool)
    outside[:M, :cols] = False
    u = f"u{got.itemsize}"
    changed = np.argwhere(outside & (got.view(u) != before.view(u)))
    assert not len(changed), f"{what}: wrote {len(changed)} elements outside y[:{M}, :{cols}], first {changed[0]}"


def run_gemm(kernels, dev, rng, fmt, N, K, M, *, mode="store", ldx=None, ldy=None, row_scale=False, pad_rows=2,
             kernel="auto"):
    """One gemm.gemm call on fresh random data; returns (result rows [M, cols] minus y0 for add, w, x, rs)."""
    w, wv = dev.weight(fmt, (N, K), rng)
    lx = K if ldx is None else ldx
    x = np.full((M, lx), np.nan, np.float32)
    x[:, :K] = rng.standard_normal((M, K))
    cols = N // 2 if mode == "swiglu" else N
    ly = cols if ldy is None else ldy
    if mode == "add":
        y0 = rng.standard_normal((M + pad_rows, ly)).astype(np.float32)
        yp = dev.put(y0)
    else:  # the poison dev.empty writes; swiglu writes bf16
        y0 = np.full((M + pad_rows, ly), 0xFFFF, np.uint16) if mode == "swiglu" else \
            np.full((M + pad_rows, ly), 0xFFFFFFFF, np.uint32).view(np.float32)
        yp = dev.empty(y0.nbytes)
    rs = rng.uniform(-2, 2, M).astype(np.float32) if row_scale else None
    ss = {}
    if kernel == "wgmma_ss":
        if fmt == "bf16":
            pytest.skip("wgmma_ss dequantizes quantized weights; bf16 ones take the register path")
        ss = dict(scratch=dev.empty(gemm.dequant_bytes(w)), scratch_bytes=gemm.dequant_bytes(w))
    gemm.gemm(kernels, w, x=dev.put(f32_to_bf16_bits(x)), M=M, y=yp, ldx=ldx, ldy=ldy, mode=mode,
              row_scale=dev.put(rs) if rs is not None else 0, kernel=kernel, **ss)
    got = dev.get(yp, y0.shape, y0.dtype)
    what = f"{fmt} [{N}, {K}] M={M} {mode}{' row_scale' if row_scale else ''} ({kernel})"
    untouched(got, y0, M, cols, what)
    res = got[:M, :cols]
    res = (bf16_bits_to_f32(res) if mode == "swiglu" else res).astype(np.float64)
    if mode == "add":
        res -= y0[:M, :cols]
    return res, wv, x[:, :K], rs, what


def kernel_weights(wv, fmt, kernel):
    """The weights the MMAs take: RN(W) in bf16 for q8 (and every quantized format on wgmma), W itself for bf16
    and for the exact nibble codes of the mma.sync tiles."""
    return bf16_round(wv) if fmt.startswith("q8") or (kernel.startswith("wgmma") and fmt != "bf16") else wv


def check_gemm(kernels, dev, rng, fmt, N, K, M, **kw):
    res, wv, x, rs, what = run_gemm(kernels, dev, rng, fmt, N, K, M, **kw)
    mode = kw.get("mode", "store")
    assert_close(res, reference(wv, x, mode, rs), TOL_EXACT[mode], what + " vs exact x and W")
    check = assert_bf16_close if mode == "swiglu" else lambda g, w_, m: assert_close(g, w_, TOL_BF16X, m)
    check(res, reference(kernel_weights(wv, fmt, kw.get("kernel")), bf16_round(x), mode, rs),
          what + " vs bf16 x and RN(W)")


# ------------------------------------------------------------------------------------------------ dense

@pytest.mark.parametrize("M", [1, 17, 128, 300])
@pytest.mark.parametrize("fmt", QFORMATS + ["bf16"])
def test_every_format(kernels, dev, rng, fmt, M, kernel):
    """N = 160: a full and a 32-row N tile; K = 224: 7 k-tiles, Kp = 256 (the last group straddles K)."""
    check_gemm(kernels, dev, rng, fmt, 160, 224, M, kernel=kernel)


@pytest.mark.parametrize("K", [32, 64, 96, 128, 160, 224, 256, 288])
@pytest.mark.parametrize("fmt", ["q5g32", "q8g128", "bf16"])
def test_short_k(kernels, dev, rng, fmt, K, kernel):
    """k-tiles of 32 against the pipeline's stages (bf16 5, q8g128 7, q5g32 8): fewer, exactly as many (160,
    224, 256), and more."""
    check_gemm(kernels, dev, rng, fmt, 128, K, 17, kernel=kernel)


@pytest.mark.parametrize("fmt", ["q4g32", "q6g128", "q8g32", "bf16"])
def test_odd_n(kernels, dev, rng, fmt, kernel):
    """N = 257 (the MoE router + shared gate): a tile with one valid row; M = 130: an M tile of 2 rows."""
    check_gemm(kernels, dev, rng, fmt, 257, 64, 130, kernel=kernel)


@pytest.mark.parametrize("shape", [(9216, 2048), (2048, 4096)], ids=["qkvg", "down"])
@pytest.mark.parametrize("fmt", ["q8g32", "q4g64", "q5g64", "q6g64"])
def test_35b_shapes(kernels, dev, rng, fmt, shape, kernel):
    """Qwen3.6-35B-A3B attention [q|k|v|gate] and a 4096-wide K, at a prefill chunk of 512 rows."""
    check_gemm(kernels, dev, rng, fmt, shape[0], shape[1], 512, kernel=kernel)


@pytest.mark.parametrize("variant", ["store_rs", "add", "add_rs", "swiglu"])
@pytest.mark.parametrize("fmt", ["q4g32", "q5g128", "q6g64", "q8g64", "bf16"])
def test_modes(kernels, dev, rng, fmt, variant, kernel):
    """Every epilogue with ldx > K (NaN beyond K), ldy > cols, partial M and N tiles."""
    mode = variant.split("_")[0]
    N, K, M = 192, 256, 300
    cols = N // 2 if mode == "swiglu" else N
    check_gemm(kernels, dev, rng, fmt, N, K, M, mode=mode, ldx=K + 40, ldy=cols + 5,
               row_scale=variant.endswith("_rs"), kernel=kernel)


def test_swiglu_35b(kernels, dev, rng, kernel):
    """The 35B shared-expert gate/up shape [1024, 2048] (I = 512), 300 rows."""
    check_gemm(kernels, dev, rng, "q6g64", 1024, 2048, 300, mode="swiglu", kernel=kernel)


@pytest.mark.parametrize("fmt", QFORMATS)
def test_dequantized_weights(kernels, dev, rng, fmt):
    """gemm_wgmma_dequant_<fmt>'s scratch against the oracle, exactly: row p holds RN(W) of weight row dq_row(p)
    (one rounding of the exact q · s, what the register path's MMAs take), rows past N zero. N = 200: the last
    32-row block is partial; K = 224: Kp = 256, so the chunks past K are not written."""
    if not gemm.wgmma_available(kernels):
        pytest.skip("the wgmma tiles need an H100/H200 running the sm_90a cubin")
    N, K, M = 200, 224, 130
    w, wv = dev.weight(fmt, (N, K), rng)
    n = gemm.dequant_bytes(w)
    scratch = dev.empty(n)
    x = dev.put(f32_to_bf16_bits(rng.standard_normal((M, K)).astype(np.float32)))
    gemm.gemm(kernels, w, x=x, M=M, y=dev.empty(M * N * 4), kernel="wgmma_ss", scratch=scratch, scratch_bytes=n)
    got = bf16_bits_to_f32(dev.get(scratch, (n // (2 * K), K), np.uint16))
    p = np.arange(got.shape[0])
    want = np.zeros(got.shape, np.float32)
    want[p[dq_row(p) < N]] = bf16_round(wv)[dq_row(p[dq_row(p) < N])]
    bad = np.argwhere(got != want)
    assert not len(bad), f"{fmt}: {len(bad)} dequantized weights differ, first [row {bad[0][0]}, k {bad[0][1]}]"


def test_rejects_bad_calls(kernels):
    """Sizes and pointers are checked before anything is launched."""
    w = DeviceWeight("w", "q4g64", (64, 128), 1 << 20)
    x, y = 1 << 21, 1 << 22
    cases = [
        (dict(w=DeviceWeight("w", "bf16", (64, 48), 1 << 20)), "K=48"),
        (dict(w=DeviceWeight("w", "fp32", (64, 64), 1 << 20)), "fp32"),
        (dict(w=DeviceWeight("w", "q4g64", (2, 64, 128), 1 << 20)), "2-D"),
        (dict(w=DeviceWeight("w", "q4g64", (48, 128), 1 << 20), mode="swiglu"), "N % 32"),
        (dict(mode="gelu"), "mode"),
        (dict(ldx=124), "ldx"),
        (dict(ldx=130), "ldx"),
        (dict(x=x + 4), "aligned"),
        (dict(ldy=63), "ldy"),
        (dict(M=-1), "M=-1"),
        (dict(w=DeviceWeight("w", "bf16", (64, 128), 1 << 20), kernel="wgmma_ss"), "wgmma_ss"),
        (dict(kernel="wgmma_ss", scratch=1 << 23, scratch_bytes=64 * 128 * 2 - 2), "wgmma_ss"),
    ]
    for over, match in cases:
        args = dict(w=w, x=x, M=4, y=y) | over
        with pytest.raises(GpuError, match=match):
            gemm.gemm(kernels, args.pop("w"), **args)


# ------------------------------------------------------------------------------------------------ grouped MoE

def moe_reference(gu, dn, x, ids, wts, act_in=None):
    """float64 (act [M·top_k, I], y [M, H]); the down projection reads act_in when given, else act."""
    M, top_k = ids.shape
    I = dn.shape[2]
    gi, ui = swiglu_rows(2 * I)
    act = np.zeros((M * top_k, I))
    for s in range(M * top_k):
        o = gu[ids.flat[s]].astype(np.float64) @ x[s // top_k].astype(np.float64)
        act[s] = silu(o[gi]) * o[ui]
    a = act if act_in is None else act_in.astype(np.float64)
    y = np.zeros((M, dn.shape[1]))
    for s in range(M * top_k):
        y[s // top_k] += wts.flat[s] * (dn[ids.flat[s]].astype(np.float64) @ a[s])
    return act, y


@pytest.mark.parametrize("M", [1, 300])
@pytest.mark.parametrize("fmts", [("q4g64", "q6g64"), ("q8g32", "bf16"), ("q5g128", "q4g32")],
                         ids=lambda f: "-".join(f))
def test_moe_grouped(kernels, dev, rng, fmts, M, kernel):
    """E = 8 experts (expert 3 gets no token), top_k = 4, I = 96 (2I = 192: a partial N tile, down K = 3 tiles),
    H = 160 (Kp = 256, down N = a full and a partial tile); M = 300 gives experts 1-2 M tiles, the last partial.
    Default path: M = 1 takes moe_small for integer banks, M = 300 (150 slots per expert) moe_gemm."""
    check_moe(kernels, dev, rng, fmts, M, kernel=kernel)


@pytest.mark.parametrize("path", ["small", "large"])
@pytest.mark.parametrize("M", [1, 7, 37, 300])
@pytest.mark.parametrize("fmts", [("q4g64", "q5g64"), ("q6g32", "q8g128"), ("q8g64", "q4g128"),
                                  ("q5g32", "q6g128")], ids=lambda f: "-".join(f))
def test_moe_paths(kernels, dev, rng, fmts, M, path, kernel):
    """Both paths forced on every integer width: moe_small's token tiles of 32 (M = 37: experts get ~18 slots,
    M = 300 several full tiles and a partial one), its K split over 4 chunks of a 128-wide stage (H = 160: the
    second stage has one valid chunk; I = 96: one chunk idle) and ldx / ldy beyond H."""
    check_moe(kernels, dev, rng, fmts, M, path=path, ldx=160 + 16, ldy=160 + 3, kernel=kernel)


@pytest.mark.parametrize("path", ["small", "large"])
@pytest.mark.parametrize("M", [7, 300])
def test_moe_ordered(kernels, dev, rng, M, path, kernel):
    """slot_y: the down stores each slot's row and moe_sum_slots adds them into y in slot order; y is within the
    oracle's tolerances (check_moe) and, bit for bit, y0 plus the stored rows summed j = 0..k-1 in fp32 on the host,
    with ldy beyond H left alone."""
    check_moe(kernels, dev, rng, ("q4g64", "q5g64"), M, path=path, ldy=160 + 3, kernel=kernel, ordered=True)


def test_moe_sum_slots_skips_absent_experts(kernels, dev, rng):
    """moe_sum_slots alone: ids outside [0, E) (fewer candidates than top_k) add nothing, the others add their
    row in slot order; bit-exact against the host's sequential fp32 sum (the slot rows are random normals, no
    denormals for flush-to-zero to touch)."""
    M, k, H, E, ldy = 37, 8, 300, 16, 301
    ys = rng.standard_normal((M * k, H)).astype(np.float32)
    ids = rng.integers(0, E, (M, k)).astype(np.int32)
    ids[rng.random((M, k)) < 0.2] = -1
    ids[0, 3], ids[1] = E, -1  # past the bank; a row with no expert at all
    y0 = rng.standard_normal((M, ldy)).astype(np.float32)
    y_p = dev.put(y0)
    kernels.launch("moe_sum_slots", (-(-H // 256), M), 256, [ptr(dev.put(ys)), ptr(dev.put(ids)), i32(k), i32(H),
                                                            i32(E), ptr(y_p), i32(ldy)], 0, None)
    want = y0.copy()
    for m in range(M):
        for j in range(k):
            if 0 <= ids[m, j] < E:
                want[m, :H] = want[m, :H] + ys[m * k + j]
    assert np.array_equal(dev.get(y_p, (M, ldy)).view(np.uint32), want.view(np.uint32))


def test_moe_small_35b(kernels, dev, rng):
    """The 35B expert shapes (2I = 1024, H = 2048, q4g64 / q5g64) on E = 16 experts, top_k = 8, M = 64:
    ~32 slots per expert (one or two token tiles), 8 N tiles of gate_up, 16 of down, 16 / 4 k stages."""
    check_moe(kernels, dev, rng, ("q4g64", "q5g64"), 64, E=16, I=512, H=2048, top_k=8, path="small")


def test_moe_rejects_path(kernels, dev, rng):
    """An unknown path, and 'small' on a bf16 bank, raise before anything is launched."""
    with pytest.raises(GpuError, match="path"):
        check_moe(kernels, dev, rng, ("q4g64", "q5g64"), 3, path="tiny")
    with pytest.raises(GpuError, match="small"):
        check_moe(kernels, dev, rng, ("q8g32", "bf16"), 3, path="small")


def check_moe(kernels, dev, rng, fmts, M, *, E=8, I=96, H=160, top_k=4, path="auto", ldx=None, ldy=None,
              kernel="auto", ordered=False):
    """One moe_grouped call on random routing (expert 3 gets no token) against the float64 oracle; ordered: through
    slot_y, y also bit-exact against y0 + its stored slot rows summed in order."""
    gu, guv = dev.weight(fmts[0], (E, 2 * I, H), rng, "gate_up")
    dn, dnv = dev.weight(fmts[1], (E, H, I), rng, "down")
    lx, ly = ldx or H, ldy or H
    xf = np.full((M, lx), np.nan, np.float32)
    xf[:, :H] = rng.standard_normal((M, H))
    x = xf[:, :H]
    choices = np.array([e for e in range(E) if e != 3])
    ids = np.stack([rng.permutation(choices)[:top_k] for _ in range(M)]).astype(np.int32)
    wts = rng.uniform(0, 1, (M, top_k)).astype(np.float32)
    y0 = rng.standard_normal((M, ly)).astype(np.float32)
    act_p = dev.empty(M * top_k * I * 2)
    y_p = dev.put(y0)
    slot_y = dev.empty(M * top_k * H * 4) if ordered else 0
    took = gemm.moe_grouped(kernels, gu, dn, x=dev.put(f32_to_bf16_bits(xf)), M=M, ids=dev.put(ids),
                            weights=dev.put(wts), top_k=top_k, act=act_p, y=y_p,
                            scratch=dev.empty(gemm.moe_scratch_bytes(M, top_k, E)), ldx=ldx, ldy=ldy, path=path,
                            kernel=kernel, slot_y=slot_y)
    act = bf16_bits_to_f32(dev.get(act_p, (M * top_k, I), np.uint16))
    yall = dev.get(y_p, (M, ly))
    if ordered:
        rows, want = dev.get(slot_y, (M, top_k, H)), y0[:, :H].copy()
        for j in range(top_k):
            want = want + rows[:, j]
        assert np.array_equal(yall[:, :H].view(np.uint32), want.view(np.uint32)), "ordered sum of the slot rows"
    assert (yall[:, H:].view(np.uint32) == y0[:, H:].view(np.uint32)).all(), "moe wrote y beyond H"
    y = yall[:, :H].astype(np.float64) - y0[:, :H]
    what = f"moe {fmts[0]}/{fmts[1]} M={M} path={path} ({kernel})"
    act_x, y_x = moe_reference(guv, dnv, x, ids, wts)
    assert took in ("small", "large") and path in ("auto", took), (path, took)
    wgk = kernel if took == "large" else "mma"  # moe_small (mma.sync) takes nibble codes exactly either way
    gub, dnb = kernel_weights(guv, fmts[0], wgk), kernel_weights(dnv, fmts[1], wgk)
    act_b, _ = moe_reference(gub, dnb, bf16_round(x), ids, wts)
    _, y_b = moe_reference(gub, dnb, x, ids, wts, act_in=act)
    assert_close(act, act_x, TOL_EXACT["swiglu"], what + " act vs exact x and W")
    assert_bf16_close(act, act_b, what + " act vs bf16 x and RN(W)")
    assert_close(y, y_x, TOL_MOE, what + " y vs exact")
    assert_close(y, y_b, TOL_BF16X, what + " y vs the kernel's own act in bf16")
