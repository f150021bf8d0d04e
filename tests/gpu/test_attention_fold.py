"""GPU test of attention.decode's router fold (v72; kernels/attention_combine.cu attn_combine_fast with
fold_acc): for one token the combine also adds its blocks' shares of the next MoE's raw router logits into an int64
accumulator (router_fold.py).

Oracle: fold_oracle.check_fold_sums over the decode's own fp32 output; integer sums are exact, so a second launch
doubles the accumulator bit for bit, and out is the same bits as without the fold.
"""

from __future__ import annotations

import numpy as np
import pytest

from .fold_oracle import check_fold_sums, random_fold
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
    router, w_post, w_out, mb, ms, wb, g1 = random_fold(rng, E, H, D)
    x = (rng.standard_normal(H) * 3.0).astype(np.float32)
    ld = router_fold.fold_ld(E)
    acc = dev.put(np.zeros(ld, np.int64))
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

    got, mag = check_fold_sums(once, mb, ms, wb, g1, x, y, E, H, f"{dims}: ")
    # and what it stands for: the router's raw logits on x + Ŵ·out (M's fp32 forming and fp16 rounding: 2^-10
    # relative covers 2^-11 + H·2^-24; gx's fp32 product 2^-20)
    G = router.astype(np.float64) * (1.0 + w_post.astype(np.float64))[None, :]
    exact = G @ (x.astype(np.float64) + w_out.astype(np.float64) @ y.astype(np.float64))
    bound = 2.0 ** -10 * (np.abs(G) @ np.abs(w_out.astype(np.float64)) @ np.abs(y.astype(np.float64))) \
        + 2.0 ** -20 * (np.abs(G) @ np.abs(x.astype(np.float64))) + 2.0 ** -18 * mag + nb * 2.0 ** -33 \
        + 2.0 ** -24 * ms[:E + 1] * np.abs(y).sum()  # fp16's subnormals: 2^-25 absolute in the scaled units
    assert (np.abs(got - exact) <= bound).all()
