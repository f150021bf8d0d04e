"""GPU test of attention.decode's router fold (v72; kernels/attention_combine.cu attn_combine_fast with
fold_acc): for one token a sequence the combine also adds its blocks' shares of the next MoE's raw router logits into
an int64 accumulator, a row a token (router_fold.py; several rows since v87).

Oracle: fold_oracle.check_fold_sums over the decode's own fp32 output; integer sums are exact, so a second launch
doubles the accumulator bit for bit, and out is the same bits as without the fold.
"""

from __future__ import annotations

import numpy as np
import pytest

from .fold_oracle import check_fold_sums, random_fold
from .test_attention import DIMS, _fill_cache, _new_cache

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dims,E,H,B", [("35b", 256, 2048, 1), ("d128", 40, 102, 1), ("d128", 8, 99, 1),
                                          ("35b", 256, 2048, 2), ("d128", 40, 100, 4)])
def test_combine_adds_the_router_fold(kernels, gpu, dev, rng, dims, E, H, B):
    """35b: 128 blocks of 16 x elements and 257 logits (the last warp takes the shared gate's); d128: 32 blocks,
    H = 102 or 99 (block 6 holds 6 or 3 elements: chunks of 8 or 12 bytes, zero-filled; blocks past it none), 41 or
    9 logits (a thread each). B sequences of one token: row b's sums in acc's row b (v87), the row past them
    untouched; H = 100 there (x's rows 16-byte aligned, as the fold needs at M > 1; block 6 holds 4 elements)."""
    from ninfer_rt.gpu import attention, router_fold
    nH, nKV, d = DIMS[dims][:3]
    pos, slots = [300 + 37 * b for b in range(B)], list(range(B, 0, -1))
    cache = _new_cache(dev, B + 1, 1024, nKV, d, "int8")
    _fill_cache(gpu, rng, cache, slots, [p + 1 for p in pos])
    if not attention.fold_fits(kernels, cache, nH=nH, H=H, n=E + 1):
        pytest.skip(f"no CUDA-core decode for {dims} on {kernels.gpu.info.arch}")
    D, nb = nH * d, nH * d // 32
    router, w_post, w_out, mb, ms, wb, g1 = random_fold(rng, E, H, D)
    x = (rng.standard_normal((B, H)) * 3.0).astype(np.float32)
    ld = router_fold.fold_ld(E)
    acc = dev.put(np.zeros((B + 1) * ld, np.int64))
    fold = (dev.put(mb), dev.put(ms), dev.put(wb), dev.put(g1), dev.put(x), acc, ld, E + 1, H)

    q = (rng.standard_normal((B, nH, d)) * 1.5).astype(np.float32)
    gate = rng.standard_normal((B, D)).astype(np.float32)
    kw = dict(q=dev.put(q), gate=dev.put(gate), ld_gate=D, pos=dev.put(np.array(pos, np.int32)),
              slot=dev.put(np.array(slots, np.int32)), B=B, T=1, nH=nH, cache=cache, ctx_bucket=1024,
              scratch=dev.empty(attention.decode_scratch_bytes(B, nH, d, 1024)))
    plain, out = dev.empty(B * D * 4), dev.empty(B * D * 4)
    attention.decode(kernels, out=plain, **kw)
    attention.decode(kernels, out=out, fold=fold, **kw)
    want_out, y = dev.get(plain, (B, D)), dev.get(out, (B, D))
    assert np.isfinite(y).all() and np.array_equal(y.view(np.uint32), want_out.view(np.uint32)), "the fold changed out"
    once = dev.get(acc, (B + 1, ld), np.int64)
    attention.decode(kernels, out=out, fold=fold, **kw)
    twice = dev.get(acc, (B + 1, ld), np.int64)
    assert not once[:, E + 1:].any() and not once[B].any(), "a sum landed outside its row's logits"
    assert np.array_equal(twice, 2 * once), "the sums are not exact integers"

    for b in range(B - 1):
        check_fold_sums(once[b], mb, ms, wb, g1, x[b], y[b], E, H, f"{dims} row {b}: ")
    x, y = x[B - 1], y[B - 1]  # the last row also against what it stands for
    got, mag = check_fold_sums(once[B - 1], mb, ms, wb, g1, x, y, E, H, f"{dims}: ")
    # and what it stands for: the router's raw logits on x + Ŵ·out (M's fp32 forming and fp16 rounding: 2^-10
    # relative covers 2^-11 + H·2^-24; gx's fp32 product 2^-20)
    G = router.astype(np.float64) * (1.0 + w_post.astype(np.float64))[None, :]
    exact = G @ (x.astype(np.float64) + w_out.astype(np.float64) @ y.astype(np.float64))
    bound = 2.0 ** -10 * (np.abs(G) @ np.abs(w_out.astype(np.float64)) @ np.abs(y.astype(np.float64))) \
        + 2.0 ** -20 * (np.abs(G) @ np.abs(x.astype(np.float64))) + 2.0 ** -18 * mag + nb * 2.0 ** -33 \
        + 2.0 ** -24 * ms[:E + 1] * np.abs(y).sum()  # fp16's subnormals: 2^-25 absolute in the scaled units
    assert (np.abs(got - exact) <= bound).all()
