"""GPU tests of attention.decode's out_records (kernels/attention_decode.cu attn_combine_fast with xrec): the
combine also hands o_proj its input as x̂ chunk records, which linear.gemv takes with x_records.

Oracle: reference.ops.act_records16 of the decode's own fp32 output. The codes, d and Σq are exact functions of
those values (powers of two and round-half-even), so the record bytes must match to the bit; the output itself must
be the same bits as a decode without records.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ninfer_rt.gpu.linear import x_chunk_bytes
from ninfer_rt.reference.ops import act_records16

from .test_attention import DIMS, _fill_cache, _new_cache

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.parametrize("dims,pos", [("35b", (8191,)), ("35b", (8191, 100, 3000)), ("27b", (300,)),
                                      ("tiny", (5, 40))])
def test_decode_writes_o_proj_records(kernels, gpu, dev, rng, dims, pos, dtype):
    """One token per sequence on the CUDA-core path (its combine block holds 32 columns of a head): the records of
    all M rows equal act_records16 of out [M, nH·d] in both orders (q8 and nibble weights), and out is the same bits
    as without them; decode says it wrote them."""
    from ninfer_rt.gpu import attention
    nH, nKV, d = DIMS[dims][:3]
    B, T = len(pos), 1
    M, slots = B * T, B + 1
    slot = [int(s) for s in rng.permutation(slots)[:B]]
    cache = _new_cache(dev, slots, 8192, nKV, d, dtype)
    _fill_cache(gpu, rng, cache, slot, [p + T for p in pos])
    q = (rng.standard_normal((M, nH, d)) * 1.5).astype(np.float32)
    gate = rng.standard_normal((M, nH * d)).astype(np.float32)
    kw = dict(q=dev.put(q), gate=dev.put(gate), ld_gate=nH * d, pos=dev.put(np.array(pos, np.int32)),
              slot=dev.put(np.array(slot, np.int32)), T=T, nH=nH, cache=cache, ctx_bucket=8192)
    scratch = dev.empty(attention.decode_scratch_bytes(M, nH, d, 8192))
    plain = dev.empty(M * nH * d * 4)
    assert attention.decode(kernels, B=B, out=plain, scratch=scratch, **kw) is False
    want_out = dev.get(plain, (M, nH * d))
    n_rec, width = nH * d // 32, x_chunk_bytes(M, True)  # a record holds all M rows
    for order in (1, 2):
        out, rec = dev.empty(M * nH * d * 4), dev.empty(n_rec * width)
        assert attention.decode(kernels, B=B, out=out, scratch=scratch, out_records=rec, records_order=order, **kw)
        got = dev.get(out, (M, nH * d))
        assert np.isfinite(got).all() and np.array_equal(got.view(np.uint32), want_out.view(np.uint32)), \
            f"{dims} {dtype}: records changed out"
        have = dev.get(rec, (n_rec, width), np.uint8)[:, :72 * M]
        want = act_records16(torch.from_numpy(got), order).numpy()[:, :72 * M]
        bad = np.argwhere(have != want)
        assert bad.size == 0, (f"{dims} {dtype} order {order}: record {bad[0][0]} byte {bad[0][1]}: got "
                               f"{have[tuple(bad[0])]}, want {want[tuple(bad[0])]}")
