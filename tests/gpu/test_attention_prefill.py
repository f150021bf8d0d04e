"""GPU tests of attention.prefill (kernels/attention_prefill*.cu, and decode's kernels below _FAST_MAX_ROWS rows per
kv head): one sequence's prompt chunk after a history, q and p rounded to bf16 on the tensor-core paths.

Oracle and bounds as test_attention.py's decode tests (ops.gated_attention on what the cache holds, dequantised),
with q as the kernels round it where they do (_run_decode's p_bf16 bound).
"""

from __future__ import annotations

import pytest

from .test_attention import DIMS, _run_decode

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.parametrize("dims", ["35b", "tiny", "d128", "d64"])
def test_prefill(kernels, gpu, dev, rng, recorder, dims, dtype):
    """prefill (one sequence, T = 90) after a history of 37, buckets 127 and 300, at every head dim: 720 / 180 / 360
    / 540 query rows per kv head (35b / tiny / d128 / d64), so the tensor-core prefill runs (bf16 q and p):
    attn_prefill_{dtype}_d{d}, or for an int8 cache of head dim 64, 128 or 256 on an H100/H200 running the sm_90a
    cubin attn_prefill_wgmma_int8_d{d} (the launches are checked; combines aside). And T = 8 on "tiny" (16 rows),
    where prefill runs decode's exact CUDA-core kernels."""
    from ninfer_rt.gpu import attention
    d = DIMS[dims][2]
    _run_decode(recorder, gpu, dev, rng, dims, dtype, [37], 90, [127, 300], 300, fn="prefill")
    wg = attention.prefill_wgmma(recorder, d, dtype)
    want = f"attn_prefill_wgmma_int8_d{d}" if wg else f"attn_prefill_{dtype}_d{d}"
    assert [n for n in recorder.names if n != "attn_combine"] == [want] * 2, recorder.names
    if dims == "tiny":
        _run_decode(kernels, gpu, dev, rng, dims, dtype, [37], 8, [64], 64, fn="prefill")


@pytest.mark.parametrize("wgmma", [True, False])
@pytest.mark.parametrize("dims", ["35b", "27b", "d128", "d64"])
def test_prefill_int8_steps(kernels, gpu, dev, rng, monkeypatch, dims, wgmma):
    """prefill on an int8 cache over many keys: 600 tokens after 301 of history, so each split of 256 keys (M = 600
    allows 6) is several steps long and the causal limit cuts through blocks and steps; then a bucket of 8 splits of
    64 keys. wgmma=True: attn_prefill_wgmma_int8_d{d} (skipped where it does not run: it needs the sm_90a cubin, an
    H100/H200); wgmma=False: the mma.sync kernel attn_prefill_int8_d{d}, on every GPU. Then one split of all 901
    keys (the row bound _SPLIT_ROWS lowered), which the wgmma kernel merges and gates itself. Same oracle and bound
    as test_prefill: q and p in bf16."""
    from ninfer_rt.gpu import attention
    monkeypatch.setattr(attention, "_PREFILL_WGMMA", wgmma)
    if wgmma and not attention.prefill_wgmma(kernels, DIMS[dims][2], "int8"):
        pytest.skip("attn_prefill_wgmma_* runs on an H100/H200 with its sm_90a cubin only")
    _run_decode(kernels, gpu, dev, rng, dims, "int8", [301], 600, [901], 901, fn="prefill")
    _run_decode(kernels, gpu, dev, rng, dims, "int8", [37], 90, [512], 512, fn="prefill")
    monkeypatch.setattr(attention, "_SPLIT_ROWS", 64)
    assert attention.decode_split(600, 901)[1] == 1
    _run_decode(kernels, gpu, dev, rng, dims, "int8", [301], 600, [901], 901, fn="prefill")


def test_prefill_kernels(kernels, gpu, dev, rng, recorder):
    """Which kernels prefill launches: attn_prefill_* above _FAST_MAX_ROWS rows per kv head, decode's below; an int8
    cache of head dim 256 on an H100/H200 (the sm_90a cubin) the wgmma kernel."""
    from ninfer_rt.gpu import attention
    rec = recorder
    _run_decode(rec, gpu, dev, rng, "tiny", "int8", [5], 40, [64], 64, fn="prefill")  # 80 rows per kv head
    assert rec.names == ["attn_prefill_int8_d32", "attn_combine"], rec.names
    rec.names.clear()
    _run_decode(rec, gpu, dev, rng, "tiny", "bf16", [5], 9, [64], 64, fn="prefill")   # 18 rows
    assert rec.names == ["attn_decode_fast_bf16_d32", "attn_combine_fast"], rec.names
    rec.names.clear()
    _run_decode(rec, gpu, dev, rng, "35b", "int8", [5], 40, [64], 64, fn="prefill")  # 320 rows, d = 256
    wg = attention.prefill_wgmma(rec, 256, "int8")  # one split: no combine after the wgmma kernel
    assert rec.names == (["attn_prefill_wgmma_int8_d256"] if wg else ["attn_prefill_int8_d256", "attn_combine"])
