"""The router fold's random layer and its block-by-block oracle, shared by the two kernels' fold tests
(test_deltanet_fold.py: the DeltaNet step; test_attention_fold.py: the attention combine).

Oracle: the same sums in float64 over the kernel's own fp32 output y and the fold's exact fp16 / bf16 values. A
block sums 32 + 16 products in fp32 (|error| <= 50·2^-24 of the sum of their magnitudes) and rounds once to 2^-32,
so the accumulator holds Σ_b v_b within 2^-18·Σ|terms| + nb·2^-33.
"""

from __future__ import annotations

import numpy as np

from ninfer_rt.formats import bf16_bits_to_f32, f32_to_bf16_bits


def random_fold(rng, E: int, H: int, D: int):
    """One layer's fold at random: the router (bf16 values [E + 1, H]), w_post fp32 [H] and w_out fp32 [H, D] (q8
    codes times 2^-9), then router_fold's arrays in fold_blocks' layout for D / 32 blocks and the gain 1 + w_post in
    fp32 (as the router GEMV's norm forms it). Returns router, w_post, w_out, mb, ms, wb, g1."""
    from ninfer_rt.gpu import router_fold
    router = bf16_bits_to_f32(f32_to_bf16_bits((rng.standard_normal((E + 1, H)) * 0.05).astype(np.float32)))
    w_post = (rng.standard_normal(H) * 0.1).astype(np.float32)
    w_out = (rng.integers(-127, 128, (H, D)) * 2.0 ** -9).astype(np.float32)
    mt, ms, wt = router_fold.router_fold(router, w_post, w_out)
    mb, wb = router_fold.fold_blocks(mt, wt, D // 32)
    g1 = (np.float32(1.0) + w_post).astype(np.float32)
    return router, w_post, w_out, mb, ms, wb, g1


def check_fold_sums(acc: np.ndarray, mb: np.ndarray, ms: np.ndarray, wb: np.ndarray, g1: np.ndarray,
                    x: np.ndarray, y: np.ndarray, E: int, H: int, label: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Asserts acc int64 [>= E + 1] (one launch's sums) against the oracle, block by block on the fold's exact values,
    for the layer input x fp32 [H] and the kernel's output y fp32 [32·nb]. Returns the logits it holds (float64) and
    each one's Σ|terms|, for the caller's own bounds."""
    nb = mb.shape[0]
    m16 = mb[:, :E + 1].view(np.float16).astype(np.float64)                     # m16: [nb, E+1, 32]
    w16 = bf16_bits_to_f32(wb[:, :E + 1]).astype(np.float64)                    # w16: [nb, E+1, 16]
    gx = np.zeros(16 * nb)
    gx[:H] = g1 * x                                                               # fp32, as the kernel forms it
    yb, gb = y.astype(np.float64).reshape(nb, 32), gx.reshape(nb, 16)
    terms_m = m16 * yb[:, None, :] * ms[:E + 1].astype(np.float64)[None, :, None]
    terms_w = w16 * gb[:, None, :]
    want = terms_m.sum((0, 2)) + terms_w.sum((0, 2))                              # want: [E+1]
    mag = np.abs(terms_m).sum((0, 2)) + np.abs(terms_w).sum((0, 2))
    got = acc[:E + 1].astype(np.float64) * 2.0 ** -32
    bad = np.abs(got - want) > 2.0 ** -18 * mag + nb * 2.0 ** -33
    assert not bad.any(), f"{label}logit {np.argmax(bad)} got {got[bad][0]}, want {want[bad][0]}"
    return got, mag
