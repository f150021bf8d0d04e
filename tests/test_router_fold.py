"""router_fold (v71/v72): the router fold of the DeltaNet step and the attention combine, on the host,
against the router on the residual it stands for. Exact where the maths is (the layout, the powers of two, W_routerᵀ);
M within fp32 accumulation and one fp16 rounding; the logits by linearity within the sum of those bounds term by
term."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.formats import bf16_bits_to_f32, f32_to_bf16_bits
from ninfer_rt.gpu import router_fold
from ninfer_rt.gpu.driver import GpuError


def bf16(a: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(a.astype(np.float32)))


def test_router_fold_layout_and_logits():
    """mt [Dy, ld] fp16 holds Mᵀ (M = G·Ŵ, G = router·diag(1 + w_post)), each logit's column scaled by 2^s so that
    its largest |value| is in [2^14, 2^15] (2^15 where rounding carries); ms [ld] = 2^-s; wt [H, ld] = routerᵀ bit
    for bit; padding zero; ld = E + 1 rounded up to 8. mt·ms is M within e32 (fp32 accumulation over H terms:
    H·2^-24 Σ|g||w|) and one fp16 rounding (2^-11 relative, 2^-24 absolute in the scaled units below fp16's
    normals); so wtᵀ(gain·x) + (mt·ms)ᵀy is G·(x + Ŵy) within 2^-11 Σ_j|M_ej y_j| plus those fp32 terms, and the
    top k agree wherever the k-th logit clears the next by twice that."""
    rng = np.random.default_rng(3)
    E, H, Dy, k = 64, 96, 160, 8
    router = bf16(rng.standard_normal((E + 1, H)) * 0.05)
    router[5] = 0.0                                                               # a zero column of Mᵀ: ms = 1
    w_post = rng.standard_normal(H).astype(np.float32) * 0.1
    w_out = (rng.integers(-127, 128, (H, Dy)) * 2.0 ** -9).astype(np.float32)   # q8 codes times a scale
    mt, ms, wt = router_fold.router_fold(router, w_post, w_out)
    ld = router_fold.fold_ld(E)
    assert ld == 72 and mt.shape == (Dy, ld) and wt.shape == (H, ld) and ms.shape == (ld,)
    assert mt.dtype == wt.dtype == np.uint16 and ms.dtype == np.float32
    assert not mt[:, E + 1:].any() and not wt[:, E + 1:].any() and (ms[E + 1:] == 1).all()
    assert np.array_equal(wt[:, :E + 1], f32_to_bf16_bits(router.T))
    m16 = mt[:, :E + 1].view(np.float16).astype(np.float64)                     # m16: [Dy, E+1], scaled
    assert np.array_equal(np.frexp(ms[:E + 1])[0], np.full(E + 1, 0.5))          # powers of two
    amax = np.abs(m16).max(0)
    assert amax[5] == 0 and ms[5] == 1
    live = np.arange(E + 1) != 5
    assert ((amax[live] >= 2.0 ** 14) & (amax[live] <= 2.0 ** 15)).all()
    G = router.astype(np.float64) * (1.0 + w_post.astype(np.float64))[None, :]
    M = G @ w_out.astype(np.float64)                                              # M: [E+1, Dy]
    e32 = H * 2.0 ** -24 * (np.abs(G) @ np.abs(w_out.astype(np.float64)))
    got_m = m16 * ms[:E + 1].astype(np.float64)[None, :]
    tol = (2.0 ** -11 * (np.abs(M) + e32) + e32).T + 2.0 ** -24 * ms[:E + 1][None, :]
    assert (np.abs(got_m - M.T) <= tol).all()
    for seed in range(5):
        r = np.random.default_rng(seed)
        x, y = r.standard_normal(H) * 3.0, r.standard_normal(Dy)
        want = G @ (x + w_out.astype(np.float64) @ y)                               # want: [E+1]
        got = bf16_bits_to_f32(wt[:, :E + 1]).astype(np.float64).T @ ((1.0 + w_post.astype(np.float64)) * x) \
            + got_m.T @ y
        bound = (2.0 ** -11 * (np.abs(M) + e32) + e32 + 2.0 ** -24 * ms[:E + 1][:, None]) @ np.abs(y) \
            + 2.0 ** -20 * (np.abs(G) @ np.abs(x))
        assert (np.abs(got - want) <= bound).all()
        order = np.sort(want[:E])[::-1]
        if order[k - 1] - order[k] > 2 * bound.max():
            assert set(np.argsort(-got[:E])[:k]) == set(np.argsort(-want[:E])[:k])


@pytest.mark.parametrize("nb, H", [(128, 2048), (4, 50), (2, 17)])
def test_fold_blocks_round_trip(nb, H):
    """fold_blocks puts block b's rows of mt (32) and wt (16, zero past H) column-major, column e's values
    contiguous, where attn_combine_fast's thread e reads them; fold_unblocks restores both bit for bit."""
    rng = np.random.default_rng(nb)
    ld = 24
    mt = rng.integers(0, 1 << 16, (32 * nb, ld), dtype=np.uint16)
    wt = rng.integers(0, 1 << 16, (H, ld), dtype=np.uint16)
    mb, wb = router_fold.fold_blocks(mt, wt, nb)
    assert mb.shape == (nb, ld, 32) and wb.shape == (nb, ld, 16) and mb.flags.c_contiguous and wb.flags.c_contiguous
    b, e = nb - 1, ld - 3
    assert np.array_equal(mb[b, e], mt[32 * b:32 * b + 32, e])
    rows = wt[16 * b:16 * b + 16, e]
    assert np.array_equal(wb[b, e, :len(rows)], rows) and not wb[b, e, len(rows):].any()
    um, uw = router_fold.fold_unblocks(mb, wb, H)
    assert np.array_equal(um, mt) and np.array_equal(uw, wt)


def test_fold_blocks_rejects_shapes_that_do_not_fit():
    """Rows of mt other than 32 a block, or more than 16 rows of wt a block, are a reason, not a wrong layout."""
    mt, wt = np.zeros((64, 8), np.uint16), np.zeros((33, 8), np.uint16)
    with pytest.raises(GpuError, match="do not fit"):
        router_fold.fold_blocks(mt, wt, 2)
    with pytest.raises(GpuError, match="do not fit"):
        router_fold.fold_blocks(mt[:48], wt[:16], 2)
