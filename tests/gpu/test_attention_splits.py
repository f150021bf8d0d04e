"""GPU tests of attention.decode's split-KV bookkeeping (kernels/attention.cu, attention_decode.cu, attention.cuh
split_keys): causal limits on split boundaries, long splits whose cp.async ring wraps, the CUDA-core decode's splits
dealt at run time; and the host-side split rules (decode_split, decode_splits, decode_scratch_bytes).

Oracle and bound as test_attention.py's decode tests (_run_decode: ops.gated_attention on what the cache holds,
_check_attention). Where a test targets a boundary, the key at the targeted causal limit is planted with a softmax
weight >= 0.1 for one query row per kv head (_plant_keys), so a split or step that stops one key short, or reads one
key too many, moves that row by ~its whole value rather than by the ~1/S a random key carries at long contexts.
"""

from __future__ import annotations

import pytest

from .test_attention import DIMS, _run_decode

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.parametrize("dims", ["35b", "tiny"])
def test_decode_split_boundary(kernels, gpu, dev, rng, monkeypatch, dims, dtype):
    """Causal limits that land exactly on split boundaries: 64-key splits (M = 8, bucket 4096), where the last
    token of one sequence alone sees split 1 (its key 64 planted) and another sequence's first token ends exactly at
    a split's end (key 127 planted, and key 128, the next token's, which opens split 2), then 128-key splits (M = 1,
    bucket 32800) with the context ending at a split's end (key 639 planted). The splits are the row-count rule's
    alone (not dealt at run time: test_decode_runtime_splits covers that)."""
    from ninfer_rt.gpu import attention
    monkeypatch.setattr(attention, "_SPLIT_BLOCKS_PER_SM", 0)
    assert attention.decode_split(8, 4096)[0] == 64 and attention.decode_split(1, 32800)[0] == 128
    T = 4
    _run_decode(kernels, gpu, dev, rng, dims, dtype, [64 - T + 1, 127], T, [4096], 4096,
                plant=[(0, T - 1), (1, 0), (1, 1)])
    _run_decode(kernels, gpu, dev, rng, dims, dtype, [128 * 5 - 1], 1, [32800], 32800, plant=[(0, 0)])


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_decode_long_splits(kernels, gpu, dev, rng, monkeypatch, dtype):
    """Splits of 256 keys: each warp of the CUDA-core decode walks 8 steps, so its cp.async ring (5 int8 / 2 bf16
    stages) wraps around; once with 2 tokens of one sequence (16 query rows: 2 row groups of 8) at ~70K context, once
    with 8 row groups (8 tokens) in each of 4 sequences (the row-count rule's splits, not dealt at run time). Every
    token's own key (its causal limit) is planted in the first call, the last token's in the second."""
    from ninfer_rt.gpu import attention
    monkeypatch.setattr(attention, "_SPLIT_BLOCKS_PER_SM", 0)
    assert attention.decode_split(2, 70003)[0] == 256 and attention.decode_split(32, 32768)[0] == 256
    _run_decode(kernels, gpu, dev, rng, "35b", dtype, [70001], 2, [70003], 70006, plant=[(0, 0), (0, 1)])
    _run_decode(kernels, gpu, dev, rng, "35b", dtype, [20000, 3, 9000, 32700], 8, [32768], 32768,
                plant=[(b, 7) for b in range(4)])


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.parametrize("dims", ["35b", "27b"])
def test_decode_runtime_splits(kernels, gpu, dev, rng, dims, dtype):
    """The CUDA-core decode's splits dealt at run time (split_keys): at a 16384 bucket on this GPU one
    sequence gets fewer splits than the row-count rule (about 2 blocks per SM), each of ceil(n / splits) keys
    in whole 32-key steps; contexts just past the bucket's half, where an even split ends exactly on a 32-key
    step (n = 32 · splits · 3) and one key past it, and a full bucket, each with its last key (the end of the last
    split) planted. Then 4 sequences x 2 tokens of very different lengths in one launch, each sequence's last key
    planted: each sequence's split length is its own."""
    from ninfer_rt.gpu import attention
    nH, nKV = DIMS[dims][:2]
    ns = attention.decode_splits(1, 16384, -(-(nH // nKV) // 8) * nKV, kernels.gpu.info.sm_count)
    assert 1 <= ns < attention.decode_split(1, 16384)[1]
    for end in (8193, 32 * ns * 3, 32 * ns * 3 + 1, 16384):
        _run_decode(kernels, gpu, dev, rng, dims, dtype, [end - 1], 1, [16384], 16384, plant=[(0, 0)])
    _run_decode(kernels, gpu, dev, rng, dims, dtype, [8000, 3, 12000, 16381], 2, [16384], 16384,
                plant=[(b, 1) for b in range(4)])


def _most(f: int, sms: int, blocks: int) -> int:
    """The most splits whose blocks fit f per SM (n · blocks <= f · sms), at least 1: found by counting up."""
    n = 1
    while (n + 1) * blocks <= f * sms:
        n += 1
    return n


def test_decode_splits_rule():
    """Properties of the runtime split count ns = decode_splits(M, bucket, blocks, sms), checked without its
    formula; cap = decode_split(M, bucket)[1] (the row-count rule), lo = _SPLIT_BLOCKS_PER_SM, L = _SPLIT_LONG_KEYS,
    n(f) = the most splits whose blocks fit f per SM (at least 1):
      - 1 <= ns <= cap, and decode_scratch_bytes(M, nH, d, bucket) holds ns splits of M rows;
      - where the cap does not bind (ns < cap), ns is n(lo) or n(2·lo); n(lo) exactly when splits of n(lo) would
        be at most L keys long (ceil(bucket / n(lo)) <= L), so: splits longer than L keys only at n(2·lo), and
        n(2·lo) != n(lo) only where n(lo)'s splits would pass L keys;
      - ns never drops as the bucket grows, except to the cap (which itself drops where the row-count rule's split
        doubles: M = 1 from bucket 32768, 512 splits of 64, to 32769, 257 of 128).
    The H200 cases measured in perf-history.md v13: the 35B (2 blocks per split) keeps 132 splits up to a 262144
    bucket; the 27B (4 blocks) takes 66 up to 131072 and 132 at 262144."""
    from ninfer_rt.gpu import attention
    lo, L = attention._SPLIT_BLOCKS_PER_SM, attention._SPLIT_LONG_KEYS
    nH, d = 16, 256
    buckets = (1, 64, 1000, 2048, 4096, 16384, 32768, 32769, 131072, 262144, 300000, 1 << 20)
    for sms in (1, 46, 78, 132, 170):
        for blocks in (1, 2, 3, 4, 8, 18, 64, 1000):
            n1, n2 = _most(lo, sms, blocks), _most(2 * lo, sms, blocks)
            for M in (1, 2, 8, 9, 64):
                prev = 0
                for bucket in buckets:
                    ns = attention.decode_splits(M, bucket, blocks, sms)
                    cap = attention.decode_split(M, bucket)[1]
                    what = f"sms={sms} blocks={blocks} M={M} bucket={bucket}: ns={ns} cap={cap} n(lo)={n1} n(2lo)={n2}"
                    assert 1 <= ns <= cap, what
                    need = attention._round_up(ns * M * nH * d * 4) + attention._round_up(ns * M * nH * 8)
                    assert need <= attention.decode_scratch_bytes(M, nH, d, bucket), what
                    if ns < cap:
                        assert ns in (n1, n2), what
                        if -(-bucket // ns) > L:
                            assert ns == n2, what
                        if ns != n2:
                            assert ns == n1 and -(-bucket // ns) <= L, what
                        if ns != n1:
                            assert -(-bucket // n1) > L, what
                    assert ns >= prev or ns == cap, what
                    prev = ns
    assert [attention.decode_splits(1, b, 2, 132) for b in (16384, 131072, 262144)] == [132, 132, 132]
    assert [attention.decode_splits(1, b, 4, 132) for b in (16384, 131072, 262144)] == [66, 66, 132]


def test_decode_scratch_bound():
    """decode_scratch_bytes(rows, nH, d, max_ctx) covers every call with M <= rows and a bucket <= max_ctx (the
    engine allocates it once), and stays bounded at the engine's largest setting."""
    from ninfer_rt.gpu import attention
    nH, d = 16, 256
    for rows in (1, 2, 3, 8, 24, 64, 100, 512):
        for max_ctx in (1, 100, 1024, 8192, 65536, 262160):
            bound = attention.decode_scratch_bytes(rows, nH, d, max_ctx)
            for M in sorted({1, 2, 3, 8, 24, 64, 100, 512, rows} & set(range(1, rows + 1))):
                for bucket in sorted({1, 63, 64, 65, 1024, 5000, 8192, 65536, 262144, max_ctx}):
                    if bucket > max_ctx:
                        continue
                    cs, ns = attention.decode_split(M, bucket)
                    assert ns * cs >= bucket and cs % 64 == 0
                    need = attention._round_up(ns * M * nH * d * 4) + attention._round_up(ns * M * nH * 8)
                    assert need <= bound, (rows, max_ctx, M, bucket, need, bound)
    assert attention.decode_scratch_bytes(512, nH, d, 262160) <= 100 * 2 ** 20
