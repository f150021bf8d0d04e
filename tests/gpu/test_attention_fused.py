"""GPU tests of attention.decode(prep=...) where fused_prepare holds (one token per sequence, int8 cache, the
CUDA-core path): attn_decode_fast_prep_int8_d* does attn_prepare_d*'s work in the decode kernel.

Oracle: prepare's own launch, then attn_decode_fast_int8_d* (both tested against the torch reference in
test_attention.py), on the same inputs and the same history. The fused kernel runs prepare's per-head code
(attention_prep.cuh) and the decode's, so every cache byte (the new k and v codes and scales, and nothing else
written) and the output must be the same bits; the q buffer, prepare's output, is neither read nor written.
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.reference import ops

from .conftest import POISON
from .test_attention import DIMS, EPS, _fill_cache, _new_cache, _yarn

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dims,pos", [("35b", (8191, 0)), ("27b", (300, 4095)), ("tiny", (5, 40)),
                                      ("d128", (63, 64)), ("d64", (1, 200))])
def test_fused_prepare_is_prepare_then_decode(kernels, gpu, dev, rng, monkeypatch, dims, pos):
    """Positions at a split's first and last key, 0, and the end of the cache (8191 of 8192)."""
    from ninfer_rt.gpu import attention
    nH, nKV, d, rot, theta, _ = DIMS[dims]
    B, T, max_ctx = len(pos), 1, 8192
    M, slots = B * T, B + 1
    slot = [int(s) for s in rng.permutation(slots)[:B]]
    inv_freq, rope_scale = ops.rope_inv_freq(rot, theta, _yarn() if dims == "35b" else None)
    ld = (2 * nH + 2 * nKV) * d + 8
    qkvg = (rng.standard_normal((M, ld)) * rng.uniform(0.2, 5, (M, 1))).astype(np.float32)
    qkvg[:, (2 * nH + 2 * nKV) * d:] = np.nan  # padding: never read
    qkvg_p = dev.put(qkvg)
    prep = dict(qkvg=qkvg_p, ld=ld, q_norm=dev.put((rng.standard_normal(d) * 0.3).astype(np.float32)),
                k_norm=dev.put((rng.standard_normal(d) * 0.3).astype(np.float32)),
                inv_freq=dev.put(inv_freq.numpy()), rope_scale=rope_scale, rot=rot, eps=EPS)
    kw = dict(gate=qkvg_p + (nH + 2 * nKV) * d * 4, ld_gate=ld, pos=dev.put(np.array(pos, np.int32)),
              slot=dev.put(np.array(slot, np.int32)), B=B, T=T, nH=nH, ctx_bucket=max_ctx,
              scratch=dev.empty(attention.decode_scratch_bytes(M, nH, d, max_ctx)))
    caches = [_new_cache(dev, slots, max_ctx, nKV, d, "int8") for _ in range(2)]
    nbytes = attention.KVCache.nbytes(slots, max_ctx, nKV, d, "int8")
    _fill_cache(gpu, rng, caches[0], slot, list(pos))  # history before each position; the rest poisoned
    gpu.upload(caches[1].k, dev.get(caches[0].k, (nbytes,), np.uint8))  # k, v and scales: one allocation
    assert caches[1].v - caches[1].k == caches[0].v - caches[0].k

    outs, qs = [], []
    for fused, cache in zip((False, True), caches):
        monkeypatch.setattr(attention, "FUSED_PREPARE", fused)
        assert attention.fused_prepare(kernels, T=T, nH=nH, cache=cache) is fused
        q, out = dev.empty(M * nH * d * 4), dev.empty(M * nH * d * 4)
        attention.decode(kernels, q=q, cache=cache, out=out, prep=prep, **kw)
        outs.append(dev.get(out, (M, nH * d)))
        qs.append(dev.get(q, (M * nH * d * 4,), np.uint8))
    assert np.isfinite(outs[0]).all()
    assert np.array_equal(outs[1].view(np.uint32), outs[0].view(np.uint32)), f"{dims}: out differs"
    got, want = (dev.get(c.k, (nbytes,), np.uint8) for c in reversed(caches))
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{dims}: {bad.size} cache bytes differ, the first at byte {bad[0]}"
    assert (qs[1] == POISON).all(), "the fused decode touched q"
    assert not (qs[0] == POISON).all(), "prepare did not write q (the oracle did not run)"
