"""GPU tests of kernels/norm.cu (RMSNorm, the bf16 cast) and kernels/sampling.cu (arg-max, sampling) through
ninfer_rt.gpu.misc.

RMSNorm is checked against the exact (fp64) definition and ops.rms_norm_zc, its bf16 output and the cast bit for
bit against ninfer_rt.formats.f32_to_bf16_bits; arg-max against numpy with NaN read as -inf; the sampler's final
probabilities against ninfer_rt.sampling.Sampler.distribution (with top_k = 1024 where the kernel's candidate cap
applies), its draws against the host twin of the RNG (misc.sample_uniform) put through the inverse CDF, and its
frequencies against a Bernstein bound. Inputs are fresh random data; outputs start poisoned (NaN bytes), and
logits rows carry +inf padding past V, which would win if a kernel read it.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from ninfer_rt.formats import f32_to_bf16_bits
from ninfer_rt.gpu import misc
from ninfer_rt.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.gpu

V_BIG = 248320  # the Qwen3.5/3.6 vocabulary


def _where(bad: np.ndarray) -> str:
    """The first few bad positions, for a failure message."""
    idx = np.argwhere(bad)[:5]
    return ", ".join(str(tuple(int(v) for v in i)) for i in idx)


def _put_rows(dev, rows: np.ndarray, ld: int, offset: int = 0) -> int:
    """rows [M, V] fp32 in a device buffer of row stride ld, starting `offset` floats in; the padding past V
    (and before the first row) is +inf. Returns the address of row 0."""
    M, V = rows.shape
    buf = np.full(offset + M * ld, np.inf, np.float32)
    buf[offset:].reshape(M, ld)[:, :V] = rows
    return dev.put(buf) + 4 * offset


# ------------------------------------------------------------------------------------------ RMSNorm

@pytest.mark.parametrize("D", [64, 2048, 5120])
@pytest.mark.parametrize("layout", ["dense", "strided", "unaligned", "inplace"])
def test_rms_norm(kernels, dev, rng, D, layout):
    """Tolerance from the rounding count: the sum of squares is <= 20 serial fp32 steps per thread then a
    10-level tree (<= 30 × 2^-24 = 1.8e-6 relative, halved by the square root), then one rounding each for the
    divide, add, rsqrt, 1 + w and two multiplies (6 × 2^-24): |y - exact| <= 1.3e-6·|exact|. We allow 2e-6
    against the fp64 definition and 5e-6 against ops.rms_norm_zc, whose fp32 error is of the same size."""
    M, eps = 7, 1e-6
    ldx, ldy = {"dense": (D, D), "strided": (D + 4, D + 8), "unaligned": (D + 1, D + 3),
                "inplace": (D + 4, D + 4)}[layout]
    scale = 10.0 ** rng.uniform(-3, 3, size=(M, 1))  # rows from tiny (eps matters) to large
    x = np.full((M, ldx), np.nan, np.float32)         # NaN padding: reading it would poison the row
    x[:, :D] = rng.standard_normal((M, D)) * scale
    w = (rng.standard_normal(D) * 0.2).astype(np.float32)
    xp, wp = dev.put(x), dev.put(w)
    yp = xp if layout == "inplace" else dev.empty(M * ldy * 4)
    misc.rms_norm(kernels, x=xp, y=yp, M=M, D=D, w=wp, eps=eps, ldx=ldx, ldy=ldy)
    y = dev.get(yp, (M, ldy))

    x64 = x[:, :D].astype(np.float64)
    exact = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * (1.0 + w.astype(np.float64))
    got = y[:, :D].astype(np.float64)
    rel = np.abs(got - exact) / np.abs(exact)
    bad = ~(rel <= 2e-6)
    assert not bad.any(), (f"rms_norm D={D} {layout}: {bad.sum()} elements off, first at {_where(bad)}; "
                           f"worst rel {np.nanmax(rel):.3g}")
    assert np.isnan(y[:, D:]).all(), f"rms_norm wrote past D (padding changed at {_where(~np.isnan(y[:, D:]))})"

    torch = pytest.importorskip("torch")
    from ninfer_rt.reference import ops
    ref = ops.rms_norm_zc(torch.from_numpy(x[:, :D].copy()), torch.from_numpy(w), eps).numpy().astype(np.float64)
    rel_t = np.abs(got - ref) / np.abs(ref)
    assert rel_t.max() <= 5e-6, f"rms_norm vs ops.rms_norm_zc: worst rel {rel_t.max():.3g} at {np.argmax(rel_t)}"


@pytest.mark.parametrize("D", [64, 2048])
@pytest.mark.parametrize("layout", ["dense", "strided", "unaligned"])
def test_rms_norm_bf16(kernels, dev, rng, D, layout):
    """out="bf16" rounds the fp32 result to nearest even: bit for bit f32_to_bf16_bits of rms_norm's fp32 output,
    which is itself checked against the fp64 definition within test_rms_norm's 2e-6 (same derivation: this input
    has the same scales and D <= 2048), on the same input and layouts; the padding past D keeps its bytes."""
    M, eps = 5, 1e-6
    ldx, ldy = {"dense": (D, D), "strided": (D + 4, D + 8), "unaligned": (D + 1, D + 3)}[layout]
    x = np.full((M, ldx), np.nan, np.float32)
    x[:, :D] = rng.standard_normal((M, D)) * 10.0 ** rng.uniform(-3, 3, size=(M, 1))
    w = (rng.standard_normal(D) * 0.2).astype(np.float32)
    xp, wp = dev.put(x), dev.put(w)
    y32, y16 = dev.empty(M * D * 4), dev.empty(M * ldy * 2)
    misc.rms_norm(kernels, x=xp, y=y32, M=M, D=D, w=wp, eps=eps, ldx=ldx)
    misc.rms_norm(kernels, x=xp, y=y16, M=M, D=D, w=wp, eps=eps, ldx=ldx, ldy=ldy, out="bf16")
    got = dev.get(y16, (M, ldy), np.uint16)
    y = dev.get(y32, (M, D))
    x64 = x[:, :D].astype(np.float64)
    exact = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * (1.0 + w.astype(np.float64))
    rel = np.abs(y.astype(np.float64) - exact) / np.abs(exact)
    assert (rel <= 2e-6).all(), f"rms_norm fp32 D={D} {layout}: worst rel {np.nanmax(rel):.3g} against fp64"
    want = f32_to_bf16_bits(y)
    bad = got[:, :D] != want
    assert not bad.any(), f"rms_norm bf16 D={D} {layout}: {bad.sum()} elements differ, first at {_where(bad)}"
    assert (got[:, D:] == 0xFFFF).all(), "rms_norm bf16 wrote past D"


@pytest.mark.parametrize("layout", ["dense", "strided", "unaligned"])
def test_cast_bf16(kernels, dev, rng, layout):
    """Bit for bit f32_to_bf16_bits (torch's .to(bfloat16); NaN -> 0x7FC0) on normals of every scale, exact ties
    (even and odd), subnormals, ±inf, NaN and values that round up to inf; the padding keeps its bytes."""
    M, D = 6, 1000
    ldx, ldy = {"dense": (D, D), "strided": (D + 4, D + 8), "unaligned": (D + 1, D + 3)}[layout]
    v = (rng.standard_normal((M, D)) * 10.0 ** rng.uniform(-30, 30, (M, D))).astype(np.float32)
    bits = v.view(np.uint32)
    bits[0, :200] = (bits[0, :200] & 0xFFFF0000) | 0x8000  # ties: the kept lsb decides
    bits[1, :100] = rng.integers(1, 0x800000, 100, dtype=np.uint32)  # subnormals
    v[2, :6] = [np.inf, -np.inf, np.nan, 3.4e38, -3.39e38, 0.0]
    x = np.full((M, ldx), np.nan, np.float32)
    x[:, :D] = v
    yp = dev.empty(M * ldy * 2)
    misc.cast_bf16(kernels, x=dev.put(x), y=yp, M=M, D=D, ldx=ldx, ldy=ldy)
    got = dev.get(yp, (M, ldy), np.uint16)
    bad = got[:, :D] != f32_to_bf16_bits(v)
    assert not bad.any(), f"cast_bf16 {layout}: {bad.sum()} elements differ, first at {_where(bad)}"
    assert (got[:, D:] == 0xFFFF).all(), "cast_bf16 wrote past D"


# ------------------------------------------------------------------------------------------ arg-max

def _argmax_rows(rng, M: int, V: int, seam: int) -> np.ndarray:
    """Rows that probe the rules: random, planted ties far apart and across a block seam (seam - 1 | seam), NaN,
    -inf, all -inf, all NaN, a constant row, the maximum at the last index."""
    x = rng.standard_normal((M, V)).astype(np.float32)
    top = float(x.max()) + 1.0
    a, b, c = sorted(rng.choice(V, size=3, replace=False))
    x[1, [c, a, b]] = top                                  # ties far apart: a wins
    s = min(V - 2, seam - 1)                               # the seam of the first two split blocks
    x[2, [s + 1, s]] = top
    x[3, [0, V // 2]] = np.nan                             # NaN never wins
    x[3, int(rng.integers(V))] = top
    x[4, rng.choice(V, size=V // 10, replace=False)] = -np.inf
    x[5] = -np.inf
    x[6] = np.nan
    x[7] = 1.5
    x[8, V - 1] = top
    x[8, rng.choice(V - 1, size=5, replace=False)] = np.nan
    return x


@pytest.mark.parametrize("V", [V_BIG, 5001, 500])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("layout", ["dense", "padded", "unaligned"])
def test_argmax(kernels, recorder, dev, rng, V, split, layout):
    """With scratch, rows longer than one block's 2048 entries are split over blocks (V_BIG: 122 slices; 5001:
    3, the last partial) and argmax_finish reduces the slices (checked: it ran); V = 500 is one block either way.
    The planted seam tie sits at the first two slices' boundary (misc._argmax_split's chunk: data placement only,
    the expected token comes from numpy)."""
    M = 9
    chunk, nsplit = misc._argmax_split(V) if split else (V, 1)
    x = _argmax_rows(rng, M, V, chunk if nsplit > 1 else V // 2)
    ld, offset = {"dense": (V, 0), "padded": (V + 12, 0), "unaligned": (V + 1, 1)}[layout]
    lp = _put_rows(dev, x, ld, offset)
    out = dev.empty(M * 4)
    scratch = dev.empty(misc.argmax_scratch_bytes(M)) if split else 0
    misc.argmax(recorder, logits=lp, ld=ld, M=M, V=V, out=out, scratch=scratch)
    assert recorder.names == (["argmax_rows", "argmax_finish"] if split and V > 2048 else ["argmax_rows"]), \
        f"split={split} V={V}: launched {recorder.names}"
    got = dev.get(out, (M,), np.int32)
    want = np.argmax(np.where(np.isnan(x), -np.inf, x), axis=1)  # first index of the max, NaN as -inf
    bad = got != want
    assert not bad.any(), (f"argmax rows {np.flatnonzero(bad).tolist()}: got {got[bad].tolist()}, "
                           f"want {want[bad].tolist()}")


# ------------------------------------------------------------------------------------------ sampling helpers

def _u64(rng) -> int:
    """A seed or step over all of [0, 2^64) (bit 63 set half the time: the Philox key's and counter's high words
    must be taken unsigned), as a Python int (sample_params and sample_uniform take ints)."""
    return int(rng.integers(2**64, dtype=np.uint64))


def _params(rows) -> np.ndarray:
    """SAMPLE_PARAMS records from (temperature, top_k, top_p, min_p, seed, step) tuples."""
    return np.concatenate([misc.sample_params(*r) for r in rows])


def _run_sampler(kernels, dev, x: np.ndarray, params: np.ndarray, ld: int | None = None, probs: bool = False):
    """tokens int32 [M] (or probabilities fp32 [M, V] with probs=True, their support rows checked against them) for
    logits x [M, V]."""
    M, V = x.shape
    ld = V if ld is None else ld
    lp, pp = _put_rows(dev, x, ld), dev.put(params)
    scratch = dev.empty(misc.sample_scratch_bytes(M, V))
    if probs:
        out, sup = dev.empty(M * V * 4), dev.empty(M * misc.SUPPORT_INTS * 4)
        misc.sample_probs(kernels, logits=lp, ld=ld, M=M, V=V, params=pp, out=out, scratch=scratch, support=sup)
        got, rows = dev.get(out, (M, V)), dev.get(sup, (M, misc.SUPPORT_INTS), np.int32)
        for r in range(M):  # each row's support lists its entries > 0, bit for bit (the same fp32 values)
            ids, p = misc.split_support(rows[r])
            assert np.array_equal(ids, np.flatnonzero(got[r] > 0)), f"row {r}: support ids"
            assert np.array_equal(p, got[r, ids].astype(np.float64)), f"row {r}: support values"
        return got
    out = dev.empty(M * 4)
    misc.sample(kernels, logits=lp, ld=ld, M=M, V=V, params=pp, out=out, scratch=scratch)
    return dev.get(out, (M,), np.int32)


def _reference(x_row: np.ndarray, rec) -> np.ndarray:
    """Sampler.distribution (float64 [V]) under the record's (fp32-rounded) values and the kernel's cap."""
    top_k = int(rec["top_k"])
    cap = misc.SAMPLE_MAX_CANDIDATES
    sp = SamplingParams(temperature=float(rec["temperature"]), top_k=cap if top_k == 0 or top_k > cap else top_k,
                        top_p=float(rec["top_p"]), min_p=float(rec["min_p"]))
    return Sampler(sp).distribution(x_row)


def _check_probs(got: np.ndarray, want: np.ndarray, x: np.ndarray, what: str) -> None:
    """Same kept set; each kept probability within 1e-6 relative. The kernel computes in fp64 like the
    reference and rounds once to fp32 (6e-8), so 1e-6 is far above its error and far below any real bug."""
    assert not np.isnan(got).any(), f"{what}: NaN (unwritten) at {_where(np.isnan(got))}"
    g, w = got > 0, want > 0
    if (g != w).any():
        extra, miss = np.flatnonzero(g & ~w)[:5], np.flatnonzero(w & ~g)[:5]
        raise AssertionError(f"{what}: kept sets differ ({g.sum()} vs {w.sum()} kept): kept but dropped by the "
                             f"reference {extra.tolist()} (logits {x[extra].tolist()}), dropped but kept "
                             f"{miss.tolist()} (logits {x[miss].tolist()}, p {want[miss].tolist()})")
    rel = np.abs(got[w] - want[w]) / want[w]
    j = int(np.argmax(rel))
    assert rel[j] <= 1e-6, (f"{what}: worst rel {rel[j]:.3g} at token {np.flatnonzero(w)[j]}: "
                            f"got {got[w][j]!r}, want {want[w][j]!r}")


def _host_draw(x_row: np.ndarray, dist: np.ndarray, seed: int, step: int) -> int | None:
    """The token the kernel must draw: u = sample_uniform(seed, step) through the inverse CDF of the kept tokens
    in (logit desc, index asc) order. None when u·total lies within 1e-12 of a CDF step (rounding may go
    either way there)."""
    kept = np.flatnonzero(dist > 0)
    kept = kept[np.lexsort((kept, -x_row[kept].astype(np.float64)))]
    cdf = np.cumsum(dist[kept])
    r = misc.sample_uniform(seed, step) * cdf[-1]
    if np.min(np.abs(cdf - r)) < 1e-12:
        return None
    return int(kept[min(int(np.searchsorted(cdf, r, side="right")), kept.size - 1)])


# ------------------------------------------------------------------------------------------ sampling

BIG_SETS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0),       # the cap alone: top-1024
    (0.7, 50, 0.9, 0.0),
    (1.3, 0, 0.95, 0.05),
    (0.5, 2000, 0.8, 0.0),    # top_k past the cap
    (1.0, 1024, 1.0, 0.1),
    (2.0, 7, 1.0, 0.0),
    (0.9, 1, 1.0, 0.0),
    (0.0, 0, 1.0, 0.0),       # greedy
]

SMALL_SETS = [
    (1.0, 0, 1.0, 0.0),       # every finite token
    (0.8, 5, 1.0, 0.0),       # with ties at the 5th value (planted below)
    (1.2, 0, 0.5, 0.0),
    (1.0, 0, 1.0, 0.2),
    (0.6, 40, 0.9, 0.02),
    (1.0, 600, 1.0, 0.0),     # top_k > V
    (3.0, 0, 0.99, 0.0),
    (0.0, 0, 1.0, 0.0),       # greedy, with the maximum tied (planted below)
]


def _small_logits(rng, M: int, V: int) -> np.ndarray:
    x = (rng.standard_normal((M, V)) * 2.0).astype(np.float32)
    for r in range(M):
        x[r, rng.choice(V, size=60, replace=False)] = -np.inf
    order = np.argsort(-x[1], kind="stable")
    x[1, order[5:7]] = x[1, order[4]]                      # the 5th, 6th and 7th values tie
    x[7, rng.choice(V, size=2, replace=False)] = x[7].max() + 1.0  # two maxima: greedy takes the lower index
    return x


@pytest.mark.parametrize("V", [V_BIG, 500])
@pytest.mark.parametrize("unaligned", [False, True])
def test_sample_probs_match_sampler(kernels, dev, rng, V, unaligned):
    sets = BIG_SETS if V == V_BIG else SMALL_SETS
    M = len(sets)
    x = (rng.standard_normal((M, V)) * 2.5).astype(np.float32) if V == V_BIG else _small_logits(rng, M, V)
    params = _params([(*s, _u64(rng), _u64(rng)) for s in sets])
    got = _run_sampler(kernels, dev, x, params, ld=V + 1 if unaligned else V, probs=True)
    for r in range(M):
        _check_probs(got[r], _reference(x[r], params[r]), x[r], f"row {r} params {sets[r]}")
    if V == 500:
        assert (got[1] > 0).sum() == 7, "top_k=5 must keep the 5th value's two ties too"


def _capped_expected(x_row: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """The kernel's rule when ties overflow the cap: the first min(#(x >= t), 1024) tokens in (logit desc,
    index asc) order, t the K-th largest logit; then the softmax over them."""
    cap, V = misc.SAMPLE_MAX_CANDIDATES, x_row.size
    K = min(cap if top_k == 0 or top_k > cap else top_k, V)
    order = np.lexsort((np.arange(V), -x_row.astype(np.float64)))
    t = x_row[order[K - 1]]
    kept = order[:min(int((x_row >= t).sum()), cap)]
    z = x_row[kept].astype(np.float64) / temperature
    out = np.zeros(V)
    out[kept] = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    return out


def test_sample_tie_overflow(kernels, dev, rng):
    """More ties with the K-th logit than the cap holds: the lowest indices fill it (misc.py / sampling.cu: the keys
    == t in index order, at most 1024 candidates in all; -0.0 ties with +0.0). V = 3·8192 + 123: four compaction
    segments of misc._HIST_CHUNK = 8192 entries (the last of 123), the ties scattered over all of them (some in
    the last) and gathered in index order across segments. Row 0: two planted maxima (1.0), ~2000 zeros (half
    -0.0), random negative logits elsewhere: the maxima and the 1022 lowest-index zeros, which end past the first
    segment; row 1: the same at top_k = 10 (its ties overflow the cap too); row 2: all ±0: tokens 0 .. 1023."""
    seg = misc._HIST_CHUNK
    assert seg == 8192, "the segment size this test was laid out for"
    V = 3 * seg + 123
    x = np.zeros((3, V), np.float32)
    zeros = np.concatenate([rng.choice(3 * seg, size=1990, replace=False),  # some in every segment
                            3 * seg + rng.choice(123, size=10, replace=False)])
    others = np.setdiff1d(np.arange(V), zeros)
    x[0, others] = -rng.uniform(0.1, 8.0, others.size)
    x[0, zeros[rng.random(zeros.size) < 0.5]] = -0.0
    top = rng.choice(others, size=2, replace=False)
    x[0, top] = 1.0                                        # 2 above t = 0, then 1022 of the 2000 zeros
    x[1] = x[0]
    x[2, rng.choice(V, size=V // 2, replace=False)] = -0.0
    sets = [(1.0, 0, 1.0, 0.0), (0.5, 10, 1.0, 0.0), (1.0, 0, 1.0, 0.0)]
    params = _params([(*s, _u64(rng), _u64(rng)) for s in sets])
    got = _run_sampler(kernels, dev, x, params, probs=True)
    for r, (temp, top_k, _, _) in enumerate(sets):
        _check_probs(got[r], _capped_expected(x[r], temp, top_k), x[r], f"tie overflow row {r}")
    kept_zeros = np.sort(zeros)[:misc.SAMPLE_MAX_CANDIDATES - 2]
    assert kept_zeros[-1] >= seg, "precondition: the kept ties span more than one segment"
    for r in (0, 1):  # the rule stated directly, besides _capped_expected's
        assert np.array_equal(np.flatnonzero(got[r]), np.sort(np.concatenate([top, kept_zeros]))), f"row {r}"
    assert np.array_equal(np.flatnonzero(got[2]), np.arange(misc.SAMPLE_MAX_CANDIDATES))


def test_sample_draws(kernels, dev, rng):
    """Tokens equal the host twin's draw; a second launch repeats them; other steps draw other tokens."""
    V, M = V_BIG, len(BIG_SETS)
    x = (rng.standard_normal((M, V)) * 2.5).astype(np.float32)
    seeds = [_u64(rng) for _ in range(M)]
    params = _params([(*s, seeds[r], _u64(rng)) for r, s in enumerate(BIG_SETS)])
    tokens = _run_sampler(kernels, dev, x, params)
    again = _run_sampler(kernels, dev, x, params)
    assert np.array_equal(tokens, again), f"same (seed, step), different tokens: {tokens} vs {again}"
    for r in range(M):
        want = _host_draw(x[r], _reference(x[r], params[r]), seeds[r], int(params[r]["step"]))
        assert want is None or tokens[r] == want, f"row {r} {BIG_SETS[r]}: drew {tokens[r]}, host twin {want}"

    # One row, 64 steps: under (1.0, top_k 20) no token has p > 0.5, so 64 equal draws has p < 1e-19.
    xs = np.repeat(x[:1], 64, axis=0)
    steps = _params([(1.0, 20, 1.0, 0.0, seeds[0], s) for s in range(64)])
    drawn = _run_sampler(kernels, dev, xs, steps)
    dist = _reference(x[0], steps[0])
    if dist.max() <= 0.5:
        assert len(set(drawn.tolist())) > 1, "every step drew the same token"
    for s in range(64):
        want = _host_draw(x[0], dist, seeds[0], s)
        assert want is None or drawn[s] == want, f"step {s}: drew {drawn[s]}, host twin {want}"


def test_sample_frequencies(kernels, dev, rng):
    """65536 draws of a small distribution. Bernstein: P(|f - p| >= e) <= 2 exp(-n e² / (2p(1-p) + 2e/3)); with
    the failure budget 1e-6 split over the V tokens, e = (L/3 + sqrt(L²/9 + 2 n L p(1-p))) / n, L = ln(2V/1e-6).
    Tokens outside the kept set must never be drawn. Both filters matter here (asserted with Sampler): top-k 5 alone
    drops token 3, top-p 0.9 alone drops token 3 as well, but top-p over top-k's five drops token 1 too (the mass
    above it is 0.906 of those five, 0.84 of all six), so a kernel that skips either stage, or runs top-p first,
    keeps token 1 (p ~ 0.09 there: thousands of draws)."""
    V, rows, launches = 6, 1024, 64
    x = np.array([[0.3, -0.2, 1.1, -0.4, 0.6, 0.0]], np.float32)
    temp, top_k, top_p = 0.9, 5, 0.9
    seed = _u64(rng)
    rec = _params([(temp, top_k, top_p, 0.0, 0, 0)])[0]
    p = _reference(x[0], rec)

    def kept(k, q):  # Sampler's support under the record's fp32 values
        sp = SamplingParams(temperature=float(rec["temperature"]), top_k=k, top_p=q)
        return set(np.flatnonzero(Sampler(sp).distribution(x[0]) > 0).tolist())

    both, k_only, p_only = set(np.flatnonzero(p > 0).tolist()), kept(top_k, 1.0), kept(0, float(rec["top_p"]))
    assert both < k_only < set(range(V)) and both < p_only < set(range(V)), \
        f"precondition: top-k and top-p must each matter (both {both}, top-k {k_only}, top-p {p_only})"
    counts = np.zeros(V, np.int64)
    xs = np.repeat(x, rows, axis=0)
    for i in range(launches):
        params = _params([(temp, top_k, top_p, 0.0, seed, i * rows + r) for r in range(rows)])
        counts += np.bincount(_run_sampler(kernels, dev, xs, params), minlength=V)[:V]
    n = rows * launches
    assert counts.sum() == n, f"tokens out of range: {counts.sum()} of {n} counted"
    assert (counts[p == 0] == 0).all(), f"dropped tokens drawn: counts {counts.tolist()}, p {p.tolist()}"
    L = math.log(2 * V / 1e-6)
    eps = (L / 3 + np.sqrt(L * L / 9 + 2 * n * L * p * (1 - p))) / n
    f = counts / n
    assert (np.abs(f - p) <= eps).all(), (f"frequencies {f.round(5).tolist()} vs p {p.round(5).tolist()} "
                                          f"(bound {eps.round(5).tolist()})")


def test_top1_is_argmax(kernels, dev, rng):
    """top_k = 1 (any temperature, top-p, min-p) and temperature 0 pick the arg-max kernel's token."""
    V, M = V_BIG, 8
    x = (rng.standard_normal((M, V)) * 3.0).astype(np.float32)
    rows = [(float(rng.choice([0.3, 1.0, 5.0])), 1, float(rng.uniform(0.1, 1.0)), float(rng.uniform(0, 0.5)),
             _u64(rng), _u64(rng)) for _ in range(M - 2)]
    rows += [(0.0, 0, 1.0, 0.0, 7, 9), (0.0, 300, 0.5, 0.3, 7, 9)]
    tokens = _run_sampler(kernels, dev, x, _params(rows))
    lp, out = _put_rows(dev, x, V), dev.empty(M * 4)
    misc.argmax(kernels, logits=lp, ld=V, M=M, V=V, out=out, scratch=dev.empty(misc.argmax_scratch_bytes(M)))
    am = dev.get(out, (M,), np.int32)
    assert np.array_equal(am, np.argmax(x, axis=1))
    assert np.array_equal(tokens, am), f"top-1 draws {tokens.tolist()} vs argmax {am.tolist()}"
