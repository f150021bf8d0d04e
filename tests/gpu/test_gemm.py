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
    activation): only fp32 accumulation differs (~1e-6 if rounded to nearest; the tensor cores truncate, see
    TOL_BF16X). Bound 1e-4 in norm: a wrong scale, code, pairing or tile shows up here at the 1e-2 level. A bf16
    output is checked element by element: within half a bf16 ulp (2^-8 relative) plus 1e-4 of the rms.
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
# Bound of the second check (bf16 x, RN(W)): the products are exact (bf16 x bf16, or a nibble code x bf16, fits
# fp32), so only the fp32 sums differ from the float64 oracle. Round-to-nearest sums in random order would err by
# ~sqrt(K) u (u = 2^-24: ~1e-6 at K = 4096), but the tensor cores' fp32 accumulation aligns each MMA's addends to
# the largest exponent and truncates (not rounds) the rest, a bias of up to ~1 ulp of the running sum per k-step of
# 16-32, i.e. up to ~K/16 · 2^-23 ≈ 3e-5 of the largest partial sum at K = 4096; the nibble formats round once more
# per chunk where their fp32 scale multiplies the chunk's sum; the MoE down adds slots by float atomics in any
# order. 1e-4 covers that worst case with ~3x room and is still 100x below what a wrong code, scale, row or tile
# gives (>= 1e-2). Not tightened on the 1e-6 estimate: the checks print the measured error ("TOL_BF16X measured"),
# so a GPU run with pytest -s (or -rP) records how much room there is.
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
    err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    if err > tol:
        d = np.abs(got - want)
        m, n = np.unravel_index(np.argmax(d), d.shape)
        scale = 10 * tol * np.sqrt(np.mean(want ** 2))
        rows = np.flatnonzero(d.max(axis=1) > scale)[:8].tolist()
        cols = np.flatnonzero(d.max(axis=0) > scale)[:8].tolist()
        raise AssertionError(f"{what}: relative error {err:.3e} > {tol:.0e}; worst [{m}, {n}] got {got[m, n]:.6g} "
                             f"want {want[m, n]:.6g}; rows off {rows}, cols off {cols}")
    return err


def report_bf16x(got, want, what):
    """Print the measured error of a TOL_BF16X check: the relative norm error (what the bound applies to) and the
    largest element's error relative to rms(want)."""
    d = np.abs(got - want)
    rms = max(float(np.sqrt(np.mean(want ** 2))), 1e-30)
    err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    print(f"TOL_BF16X measured: {what}: relative norm error {err:.2e}, max element error / rms {d.max() / rms:.2e} "
          f"(bound {TOL_BF16X:g})")


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
    want = reference(kernel_weights(wv, fmt, kw.get("kernel")), bf16_round(x), mode, rs)
    if mode == "swiglu":  # rounded to bf16: element by element within half an ulp
        assert_bf16_close(res, want, what + " vs bf16 x and RN(W)")
    else:
        report_bf16x(res, want, what)
        assert_close(res, want, TOL_BF16X, what + " vs bf16 x and RN(W)")


# ------------------------------------------------------------------------------------------------ dense

@pytest.mark.parametrize("M", [1, 17, 128, 300])
@pytest.mark.parametrize("fmt", QFORMATS + ["bf16"])
def test_every_format(kernels, dev, rng, fmt, M, kernel):
    """N = 160: a full and a 32-row N tile; K = 224: 7 k-tiles, Kp = 256 (the last group straddles K)."""
    check_gemm(kernels, dev, rng, fmt, 160, 224, M, kernel=kernel)


def pipeline(fmt: str, kernel: str) -> tuple[int, int]:
    """(S, ks): the stages of `kernel`'s k pipeline for `fmt` and the k one stage holds, S read off gemm.py's mirror of
    the kernels' shared memory (smem_bytes / ss_smem_bytes = fixed bytes + S stages). A stage: mma (gemm.cu
    Traits) CH = 2 (q8) or 1 chunks of 32 k, each x [128][64 B] and 128 weight rows' planes; wgmma (gemm_wgmma.cu
    WT) 64 k: x [128][128 B] and 256 rows' planes of 2 chunks, padded to 1 KB; wgmma_ss x [128][128 B] and A
    [256][128 B]."""
    bits = 16 if fmt == "bf16" else int(fmt[1])
    planes = {16: 64, 8: 32}.get(bits, 16) + {5: 4, 6: 8}.get(bits, 0) + (0 if bits == 16 else 4)  # per row chunk
    if kernel == "mma":
        ch = 2 if bits == 8 else 1
        stage = ch * (gemm.BM * gemm.XS_STRIDE + gemm.BN * planes)
        fixed, smem, ks = gemm.RID_BYTES, gemm.smem_bytes(fmt), 32 * ch
    else:
        if kernel == "wgmma":
            stage, smem = -(-(gemm.BM * 128 + gemm.WG_BN * 2 * planes) // 1024) * 1024, gemm.smem_bytes(fmt, True)
        else:
            stage, smem = (gemm.BM + gemm.WG_BN) * 128, gemm.ss_smem_bytes()
        fixed, ks = gemm.WG_ALIGN + gemm.WG_BAR_BYTES + gemm.RID_BYTES, 64
    assert (smem - fixed) % stage == 0, (fmt, kernel, smem, stage)
    return (smem - fixed) // stage, ks


def test_pipeline_stages():
    """pipeline() against the stage counts worked out by hand from gemm.cu / gemm_wgmma.cu (no GPU): mma bf16 5
    stages of 32 k (16 KB each in 94.5 KB), q5g32 8 of 32 (11 KB), q8g128 3 of 64 (25 KB); wgmma bf16 4 stages of
    64 k (48 KB each in 197.4 KB), q5g32 7 (28 KB), q8g128 5 (34 KB); wgmma_ss 4 (48 KB)."""
    want = {("mma", "bf16"): (5, 32), ("mma", "q5g32"): (8, 32), ("mma", "q8g128"): (3, 64),
            ("wgmma", "bf16"): (4, 64), ("wgmma", "q5g32"): (7, 64), ("wgmma", "q8g128"): (5, 64),
            ("wgmma_ss", "q5g32"): (4, 64), ("wgmma_ss", "q8g128"): (4, 64)}
    assert {key: pipeline(key[1], key[0]) for key in want} == want


@pytest.mark.parametrize("fmt", ["q5g32", "q8g128", "bf16"])
def test_short_k(kernels, dev, rng, fmt, kernel):
    """K around the kernel's pipeline depth (pipeline: S stages of ks k; test_pipeline_stages lists them): KT =
    S - 1 k stages (all prefetched before the loop), S, S + 1 (the first slot refilled), and where ks = 64 also S
    and S + 1 with a half last stage (K = ks·S ∓ 32); and K = 32, 64 (far fewer stages than the pipeline)."""
    S, ks = pipeline(fmt, kernel)
    for K in sorted({32, 64, ks * (S - 1), ks * S - 32, ks * S, ks * S + 32, ks * (S + 1)}):
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
    32-row block is partial; K = 224: Kp = 256, so the chunks past K are not written; the 4 KB after the scratch
    (given exactly dequant_bytes) keep their poison."""
    if not gemm.wgmma_available(kernels):
        pytest.skip("the wgmma tiles need an H100/H200 running the sm_90a cubin")
    N, K, M = 200, 224, 130
    w, wv = dev.weight(fmt, (N, K), rng)
    n = gemm.dequant_bytes(w)
    guard = 4096  # poisoned bytes past the scratch gemm was given: must keep their poison
    scratch = dev.empty(n + guard)
    x = dev.put(f32_to_bf16_bits(rng.standard_normal((M, K)).astype(np.float32)))
    gemm.gemm(kernels, w, x=x, M=M, y=dev.empty(M * N * 4), kernel="wgmma_ss", scratch=scratch, scratch_bytes=n)
    tail = dev.get(scratch + n, (guard,), np.uint8)
    assert (tail == 0xFF).all(), f"{fmt}: wrote {int((tail != 0xFF).sum())} bytes past the {n}-byte scratch"
    got = bf16_bits_to_f32(dev.get(scratch, (n // (2 * K), K), np.uint16))
    p = np.arange(got.shape[0])
    want = np.zeros(got.shape, np.float32)
    want[p[dq_row(p) < N]] = bf16_round(wv)[dq_row(p[dq_row(p) < N])]
    bad = np.argwhere(got != want)
    assert not len(bad), f"{fmt}: {len(bad)} dequantized weights differ, first [row {bad[0][0]}, k {bad[0][1]}]"


def test_rejects_bad_calls(kernels):
    """Sizes and pointers are checked before anything is launched. The wgmma_ss cases match their own messages,
    and run only where the wgmma tiles do (elsewhere any wgmma kernel is refused for want of sm_90a first)."""
    w = DeviceWeight("w", "q4g64", (64, 128), 1 << 20)
    x, y = 1 << 21, 1 << 22
    short = 64 * 128 * 2 - 2  # dequant_bytes(w) - 2
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
    ]
    if gemm.wgmma_available(kernels):
        cases += [
            (dict(w=DeviceWeight("w", "bf16", (64, 128), 1 << 20), kernel="wgmma_ss"),
             r"'wgmma_ss' needs a quantized weight \(this one is bf16\)"),
            (dict(kernel="wgmma_ss", scratch=1 << 23, scratch_bytes=short),
             rf"'wgmma_ss' needs a quantized weight .* scratch of {short + 2} bytes \(given {short} "),
            (dict(kernel="wgmma_ss", scratch=(1 << 23) + 8, scratch_bytes=short + 2),
             rf"aligned scratch of {short + 2} bytes \(given {short + 2} at {(1 << 23) + 8:#x}\)"),
        ]
    else:
        cases += [(dict(kernel=kn), rf"kernel '{kn}' needs an H100/H200 \(sm_90a\)") for kn in ("wgmma", "wgmma_ss")]
    assert gemm.dequant_bytes(w) == short + 2
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
    Default path (gemm.moe_grouped: small where M·top_k / E <= MOE_SMALL_MAX_AVG and no bank is bf16): M = 1
    (4 slots) takes moe_small for integer banks, moe_gemm with a bf16 bank; M = 300 (150 slots per expert)
    moe_gemm."""
    assert 300 * 4 / 8 > gemm.MOE_SMALL_MAX_AVG >= 1 * 4 / 8
    took = check_moe(kernels, dev, rng, fmts, M, kernel=kernel)
    assert took == ("small" if M == 1 and "bf16" not in fmts else "large"), (fmts, M, took)


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
    slot_y, y also bit-exact against y0 + its stored slot rows summed in order. Returns the path it took."""
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
    report_bf16x(y, y_b, what + " y")
    assert_close(y, y_b, TOL_BF16X, what + " y vs the kernel's own act in bf16")
    return took
