"""GPU test of attention.decode's router fold (v72; kernels/attention_combine.cu attn_combine_fast with
fold_acc): for one token the combine also adds its blocks' shares of the next MoE's raw router logits into an int64
accumulator (router_fold.py).

Oracle: the same sums in float64 over the decode's own fp32 output and the fold's exact fp16 / bf16 values. A block
sums 32 + 16 products in fp32 (|error| <= 50·2^-24 of the sum of their magnitudes) and rounds once to 2^-32, so the
accumulator holds Σ_b v_b within 2^-18·Σ|terms| + nb·2^-33; integer sums are exact, so a second launch doubles it
bit for bit, and out is the same bits as without the fold.
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.formats import bf16_bits_to_f32, f32_to_bf16_bits

from .test_attention import DIMS, _fill_cache, _new_cache

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dims,E,H", [("35b", 256, 2048), ("d128", 40, 102), ("d128", 8, 99)])
def test_combine_adds_the_router_fold(kernels, gpu, dev, rng, dims, E, H):
    """35b: 128 blocks of 16 x elements and 257 logits (the last warp takes the shared gate's); d128: 32 blocks,
    H = 102 or 99 (block 6 holds 6 or 3 elements: chunks of 8 or 12 bytes, zero-filled; blocks past it none), 41 or
    9 logits (a thread each)."""
    from ninfer_rt.gpu import attention, router_fold
    nH, nKV, d = DIMS[dims][:3]
    pos, slot = 300, 1
    cache = _new_cache(dev, 2, 1024, nKV, d, "int8")
    _fill_cache(gpu, rng, cache, [slot], [pos + 1])
    if not attention.fold_fits(kernels, cache, nH=nH, H=H, n=E + 1):
        pytest.skip(f"no CUDA-core decode for {dims} on {kernels.gpu.info.arch}")
    D, nb = nH * d, nH * d // 32
    router = bf16_bits_to_f32(f32_to_bf16_bits((rng.standard_normal((E + 1, H)) * 0.05).astype(np.float32)))
    w_post = (rng.standard_normal(H) * 0.1).astype(np.float32)
    w_out = (rng.integers(-127, 128, (H, D)) * 2.0 ** -9).astype(np.float32)
    mt, ms, wt = router_fold.router_fold(router, w_post, w_out)
    mb, wb = router_fold.fold_blocks(mt, wt, nb)
    x = (rng.standard_normal(H) * 3.0).astype(np.float32)
    ld = router_fold.fold_ld(E)
    acc = dev.put(np.zeros(ld, np.int64))
    g1 = (np.float32(1.0) + w_post).astype(np.float32)                           # the gain 1 + w_post, fp32
    fold = (dev.put(mb), dev.put(ms), dev.put(wb), dev.put(g1), dev.put(x), acc, ld, E + 1, H)

    q = (rng.standard_normal((1, nH, d)) * 1.5).astype(np.float32)
    gate = rng.standard_normal((1, D)).astype(np.float32)
    kw = dict(q=dev.put(q), gate=dev.put(gate), ld_gate=D, pos=dev.put(np.array([pos], np.int32)),
              slot=dev.put(np.array([slot], np.int32)), B=1, T=1, nH=nH, cache=cache, ctx_bucket=1024,
              scratch=dev.empty(attention.decode_scratch_bytes(1, nH, d, 1024)))
    plain, out = dev.empty(D * 4), dev.empty(D * 4)
    attention.decode(kernels, out=plain, **kw)
    attention.decode(kernels, out=out, fold=fold, **kw)
    want_out, y = dev.get(plain, (D,)), dev.get(out, (D,))
    assert np.isfinite(y).all() and np.array_equal(y.view(np.uint32), want_out.view(np.uint32)), "the fold changed out"
    once = dev.get(acc, (ld,), np.int64)
    attention.decode(kernels, out=out, fold=fold, **kw)
    twice = dev.get(acc, (ld,), np.int64)
    assert not once[E + 1:].any() and np.array_equal(twice, 2 * once), "the sums are not exact integers"

    # the oracle, block by block on the fold's exact values
    m16 = mb[:, :E + 1].view(np.float16).astype(np.float64)                     # m16: [nb, E+1, 32]
    w16 = bf16_bits_to_f32(wb[:, :E + 1]).astype(np.float64)                    # w16: [nb, E+1, 16]
    gx = np.zeros(16 * nb)
    gx[:H] = g1 * x                                                               # fp32, as the kernel forms it
    yb, gb = y.astype(np.float64).reshape(nb, 32), gx.reshape(nb, 16)
    terms_m = m16 * yb[:, None, :] * ms[:E + 1].astype(np.float64)[None, :, None]
    terms_w = w16 * gb[:, None, :]
    want = terms_m.sum((0, 2)) + terms_w.sum((0, 2))                              # want: [E+1]
    mag = np.abs(terms_m).sum((0, 2)) + np.abs(terms_w).sum((0, 2))
    got = once[:E + 1].astype(np.float64) * 2.0 ** -32
    bad = np.abs(got - want) > 2.0 ** -18 * mag + nb * 2.0 ** -33
    assert not bad.any(), f"{dims}: logit {np.argmax(bad)} got {got[bad][0]}, want {want[bad][0]}"
    # and what it stands for: the router's raw logits on x + Ŵ·out (M's fp32 forming and fp16 rounding: 2^-10
    # relative covers 2^-11 + H·2^-24; gx's fp32 product 2^-20)
    G = router.astype(np.float64) * (1.0 + w_post.astype(np.float64))[None, :]
    exact = G @ (x.astype(np.float64) + w_out.astype(np.float64) @ y.astype(np.float64))
    bound = 2.0 ** -10 * (np.abs(G) @ np.abs(w_out.astype(np.float64)) @ np.abs(y.astype(np.float64))) \
        + 2.0 ** -20 * (np.abs(G) @ np.abs(x.astype(np.float64))) + 2.0 ** -18 * mag + nb * 2.0 ** -33 \
        + 2.0 ** -24 * ms[:E + 1] * np.abs(y).sum()  # fp16's subnormals: 2^-25 absolute in the scaled units
    assert (np.abs(got - exact) <= bound).all()
