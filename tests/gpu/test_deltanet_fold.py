"""GPU test of deltanet.step's router fold (v71/v73; kernels/deltanet_step.cu with fold_acc): for one
token the clustered step also adds its blocks' shares of the next MoE's raw router logits into an int64 accumulator
(router_fold.py).

Oracle: the same sums in float64 over the step's own fp32 output y and the fold's exact fp16 / bf16 values. A block
sums 32 + 16 products in fp32 (|error| <= 50·2^-24 of the sum of their magnitudes) and rounds once to 2^-32, so the
accumulator holds Σ_b v_b within 2^-18·Σ|terms| + nb·2^-33; y is the same bits as the step's without the fold
(the states restored in between), so the fold reads the step's real output and changes nothing else.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from ninfer_rt.formats import bf16_bits_to_f32, f32_to_bf16_bits

from .test_deltanet import STEP_DIMS, Layer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("E,H", [(256, 2048), (40, 2043)])
def test_step_adds_the_router_fold(kernels, dev, rng, monkeypatch, E, H):
    """The 35B's DeltaNet shapes (128 blocks of 32 columns; H = 2048: 16 elements of x a block) with 257 logits (the
    last warp takes the shared gate's); and with 41 (a thread each) at H = 2043, whose last block holds 11 elements
    (chunks of 16, 16 and 12 bytes, one zeroed)."""
    from ninfer_rt.gpu import deltanet, router_fold
    d = STEP_DIMS["35b"]
    C = deltanet.step_cluster(kernels, dv=d["dv"])
    if C == 1 or not deltanet.records_fit(kernels, dv=d["dv"], cluster=C):
        pytest.skip(f"no clustered step of 32 columns a block on {kernels.gpu.info.arch}")
    L = Layer(dev, rng, d, 2, H=H)
    mixed, _, x = L.inputs(rng, 1, fused=True)
    D, nb = d["nv"] * d["dv"], d["nv"] * d["dv"] // 32
    router = bf16_bits_to_f32(f32_to_bf16_bits((rng.standard_normal((E + 1, H)) * 0.05).astype(np.float32)))
    w_post = (rng.standard_normal(H) * 0.1).astype(np.float32)
    w_out = (rng.integers(-127, 128, (H, D)) * 2.0 ** -9).astype(np.float32)
    mt, ms, wt = router_fold.router_fold(router, w_post, w_out)
    mb, wb = router_fold.fold_blocks(mt, wt, nb)
    g1 = (np.float32(1.0) + w_post).astype(np.float32)                           # the gain 1 + w_post, fp32
    ld = router_fold.fold_ld(E)
    acc = dev.put(np.zeros(ld, np.int64))
    fold = (dev.put(mb), dev.put(ms), dev.put(wb), dev.put(g1), acc, ld, E + 1)
    plain_step = deltanet.step

    def one_step(with_fold: bool) -> np.ndarray:
        """One token of sequence slot 1 from the layer's initial states (restored first)."""
        dev.gpu.upload(L.p["conv_state"], L.conv_state)
        dev.gpu.upload(L.p["ssm_state"], L.ssm_state)
        monkeypatch.setattr(deltanet, "step", functools.partial(plain_step, fold=fold if with_fold else None))
        return L.run(kernels, "step", mixed, None, x, [1], 1, 1, cluster=C)[0]

    want_y = one_step(False)
    y = one_step(True)
    assert np.isfinite(y).all() and np.array_equal(y.view(np.uint32), want_y.view(np.uint32)), "the fold changed y"
    got_acc = dev.get(acc, (ld,), np.int64)
    assert not got_acc[E + 1:].any()

    m16 = mb[:, :E + 1].view(np.float16).astype(np.float64)                     # m16: [nb, E+1, 32]
    w16 = bf16_bits_to_f32(wb[:, :E + 1]).astype(np.float64)                    # w16: [nb, E+1, 16]
    gx = np.zeros(16 * nb)
    gx[:H] = g1 * x[0]                                                            # fp32, as the kernel forms it
    yb, gb = y.astype(np.float64).reshape(nb, 32), gx.reshape(nb, 16)
    terms_m = m16 * yb[:, None, :] * ms[:E + 1].astype(np.float64)[None, :, None]
    terms_w = w16 * gb[:, None, :]
    want = terms_m.sum((0, 2)) + terms_w.sum((0, 2))                              # want: [E+1]
    mag = np.abs(terms_m).sum((0, 2)) + np.abs(terms_w).sum((0, 2))
    got = got_acc[:E + 1].astype(np.float64) * 2.0 ** -32
    bad = np.abs(got - want) > 2.0 ** -18 * mag + nb * 2.0 ** -33
    assert not bad.any(), f"logit {np.argmax(bad)} got {got[bad][0]}, want {want[bad][0]}"
