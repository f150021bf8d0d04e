"""GPU tests of kernels/attention.cu, attention_decode.cu and attention_prepare.cu through ninfer_rt.gpu.attention:
prepare (q/k norm + RoPE, KV cache write), prepare and decode back to back as the layer runs them, and decode
(split-KV gated attention: the CUDA-core path for few rows per kv head and the tensor-core path, each forced where
the other would run). Prefill (q and p in bf16 on the tensor-core path) is in test_attention_prefill.py, the split
rules and split boundaries in test_attention_splits.py, the combine's x̂ records in test_attention_records.py, all
on these helpers.

Oracles (torch fp32 on the CPU, same inputs): ops.rms_norm_zc, ops.rope_inv_freq / rope_cos_sin / apply_rope and
ops.gated_attention. Cache rows are checked element by element: bf16 against f32_to_bf16_bits of the oracle's
values (v exact; k within one bf16 ulp, since the kernel's fp32 norm and rope round differently from torch's, and
>= 99% bit-exact), int8 codes and scales against the numpy formula on the same values (v exact; k within one code,
scale to 1e-6). Decode is checked against gated_attention on what the cache actually holds (dequantised); history
is written directly, positions past each sequence's end are poisoned (NaN bf16 / NaN int8 scales), outputs and
scratch start as NaN bytes, and gate rows carry NaN padding, so any read out of bounds shows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ninfer_rt.config import Yarn
from ninfer_rt.formats import bf16_bits_to_f32, f32_to_bf16_bits
from ninfer_rt.reference import ops

pytestmark = pytest.mark.gpu

EPS = 1e-6
DIMS = {  # nH, nKV, d, rot, theta, mRoPE section (irrelevant for text positions, but must fit rot)
    "35b": (16, 2, 256, 64, 1e7, (11, 11, 10)),
    "27b": (24, 4, 256, 64, 1e7, (11, 11, 10)),   # 6 query heads per kv head: tiles mix tokens unevenly
    "tiny": (4, 2, 32, 8, 1e4, (2, 1, 1)),
    "d128": (8, 2, 128, 32, 1e6, (6, 5, 5)),      # the other head dims the kernels are built for
    "d64": (6, 1, 64, 16, 1e4, (4, 2, 2)),
    "g5": (10, 2, 64, 16, 1e4, (4, 2, 2)),        # nH + 2 nKV = 14 head units: prepare's last block has 2 idle warps
}


def _yarn() -> Yarn:
    """The 1M-context YaRN setting of the Qwen3.6 model card."""
    return Yarn(factor=4.0, original_max_position_embeddings=262144, attention_factor=0.1 * math.log(4.0) + 1.0,
                beta_fast=32.0, beta_slow=1.0, truncate=True)


def _where(bad: np.ndarray) -> str:
    idx = np.argwhere(bad)[:5]
    return ", ".join(str(tuple(int(v) for v in i)) for i in idx)


def _new_cache(dev, slots, max_ctx, nKV, d, dtype):
    from ninfer_rt.gpu import attention
    n = attention.KVCache.nbytes(slots, max_ctx, nKV, d, dtype)
    return attention.KVCache.at(dev.empty(n), slots, max_ctx, nKV, d, dtype)  # 0xFF: NaN bf16 / NaN scales


def _fill_cache(gpu, rng, cache, slot, ends):
    """Random valid history at positions [0, ends[b]) of slot[b]; every other position poisoned.
    Returns the dequantised float32 cache [slots, max_ctx, nKV, d] for k and v."""
    shape = (cache.slots, cache.max_ctx, cache.nKV, cache.d)
    out = []
    for dst, sdst in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        if cache.dtype == "bf16":
            bits = np.full(shape, 0xFFFF, np.uint16)
            for s, e in zip(slot, ends):
                bits[s, :e] = f32_to_bf16_bits(rng.standard_normal((e,) + shape[2:], dtype=np.float32))
            gpu.upload(dst, bits)
            out.append(bf16_bits_to_f32(bits))
        else:
            codes = np.full(shape, -1, np.int8)
            scales = np.full(shape[:3], np.nan, np.float32)
            for s, e in zip(slot, ends):
                codes[s, :e] = rng.integers(-127, 128, size=(e,) + shape[2:], dtype=np.int8)
                scales[s, :e] = rng.uniform(0.004, 0.02, size=(e,) + shape[2:3])
            gpu.upload(dst, codes)
            gpu.upload(sdst, scales)
            out.append(codes.astype(np.float32) * scales[..., None])
    return out


def _quant_int8(x: np.ndarray):
    """The int8 cache formula: scale = max|x| / 127 per vector, code = rint(x / scale) clamped to +-127."""
    x = x.astype(np.float32)
    scale = (np.abs(x).max(-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(scale[..., None] > 0, np.rint(x / scale[..., None]), 0)
    return np.clip(codes, -127, 127).astype(np.int8), scale


def _plant_keys(gpu, rng, cache, K, q, slot, pos, T, plants):
    """For each (b, t) in plants, key pos[b] + t of slot[b] (token t's causal limit: the last key it sees), in every
    kv head h, is replaced by one along a q row r of that token (a random head of h's group):
    k = (ln S + 4)·√d·q_r/|q_r|², so q_r·k/√d = ln S + 4 against the S = pos[b] + t + 1 keys r sees, whose other
    scores (random keys, |k_i| ~ 1) are ~N(0, ~1.5²) with Σ exp ~ 3·S: p ~ 0.95, asserted >= 0.1 (fp64, on the value
    the cache holds, bf16 or int8 codes times their scale). A kernel that loses that key (a split, step or causal
    limit one key short) then moves row r's output by ~|v_key - o|, far outside _check_attention's bound, where a
    random key's weight (~1/S) would not show at long contexts. Updates K (the dequantised cache) in place."""
    nKV, d, G = cache.nKV, cache.d, q.shape[1] // cache.nKV
    for b, t in sorted(plants):  # a sequence's tokens in order: each weight is checked against the keys planted before
        s, p = slot[b], pos[b] + t
        for h in range(nKV):
            qr = q[b * T + t, h * G + int(rng.integers(G))].astype(np.float64)
            k = (((math.log(p + 1) + 4) * math.sqrt(d) / (qr @ qr)) * qr).astype(np.float32)[None]   # [1, d]
            row = (s * cache.max_ctx + p) * nKV + h
            if cache.dtype == "bf16":
                bits = f32_to_bf16_bits(k)
                gpu.upload(cache.k + row * d * 2, bits)
                K[s, p, h] = bf16_bits_to_f32(bits)[0]
            else:
                codes, scale = _quant_int8(k)
                gpu.upload(cache.k + row * d, codes)
                gpu.upload(cache.k_scale + row * 4, scale.astype(np.float32))
                K[s, p, h] = codes[0].astype(np.float32) * scale[0]
            sc = K[s, :p + 1, h].astype(np.float64) @ qr * d ** -0.5
            w = np.exp(sc - sc.max())
            assert w[p] / w.sum() >= 0.1, f"planted key {p} of sequence {b} has weight {w[p] / w.sum():.3f}"


def _oracle_attention(q, gate, K, V, pos, slot, T):
    """ops.gated_attention per sequence on the dequantised cache, and the error scale sigmoid(g)·sum_j p_j|v_j|
    (fp64) that bounds what fp32 rounding can do to each output element."""
    M, nH, d = q.shape
    ref, scale = np.empty((M, nH * d), np.float32), np.empty((M, nH * d))
    for b, (p0, s) in enumerate(zip(pos, slot)):
        S, rows = p0 + T, slice(b * T, (b + 1) * T)
        k, v = K[s, :S], V[s, :S]                                            # [S, nKV, d]
        g = gate[rows]
        ref[rows] = ops.gated_attention(torch.from_numpy(q[rows]), torch.from_numpy(g), torch.from_numpy(k),
                                        torch.from_numpy(v)).numpy()
        G = nH // k.shape[1]
        future = np.triu(np.ones((T, S), bool), S - T + 1)
        mag = np.empty((T, nH, d))
        for h in range(k.shape[1]):                                          # the G query heads of kv head h
            qh = q[rows, h * G:(h + 1) * G].astype(np.float64)               # [T, G, d]
            sc = (qh.reshape(T * G, d) @ k[:, h].T.astype(np.float64)).reshape(T, G, S) * d ** -0.5
            sc[np.broadcast_to(future[:, None, :], sc.shape)] = -np.inf
            p = np.exp(sc - sc.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            mag[:, h * G:(h + 1) * G] = p @ np.abs(v[:, h].astype(np.float64))
        scale[rows] = mag.reshape(T, nH * d) / (1 + np.exp(-g.astype(np.float64)))
    return ref, scale


def _check_attention(got, ref, scale, what, p_bf16=False):
    """Tolerance: the kernel's products are exact (bf16 K/V times q and p split into three bf16 terms, which
    carry 24 bits) and it rounds only in fp32 accumulation (16-key mma steps, per-split running sums, the merge),
    like the fp32 oracle: both sit near 1e-7·scale. 1e-5·scale (+1e-6 of the row's largest scale) keeps a wide
    margin. A missing or extra key j moves an output by about p_j·|v_j - o|, which shows where p_j is well above
    1e-5: not guaranteed for a random key at long contexts (p_j ~ 1/S), so the split-boundary tests plant a key of
    weight >= 0.1 at the limits they target (_plant_keys).
    The CUDA-core decode on an int8 cache (attn_decode_fast_int8_*) multiplies K by three int8 code planes of q
    (each element within max|q_row|·6.1e-8 of q) in exact int32 sums, and V by p times the value scale split into
    bf16 hi + lo (within 2^-18 of it, relative): |δo| <= 2^-18·scale + the scores' ~1e-7, inside the same bound.
    p_bf16 (attn_prefill_*, against the oracle on bf16 q): each weight p_j (times the int8 value scale) is rounded
    to bf16 before the mma (unit roundoff 2^-8: |δp_j| <= 2^-8 p_j) while the normaliser sums the fp32 p_j, so
    |δo| <= 2^-8·scale more."""
    tol = (1e-5 + (2.0 ** -8 if p_bf16 else 0.0)) * scale + 1e-6 * scale.max(-1, keepdims=True)
    bad = ~(np.abs(got.astype(np.float64) - ref) <= tol)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        pytest.fail(f"{what}: {bad.sum()} bad elements (row, col) e.g. {_where(bad)}; first: got {got[i]!r} "
                    f"ref {ref[i]!r} tol {tol[i]:.3g}")


def _run_decode(kernels, gpu, dev, rng, dims, dtype, pos, T, buckets, max_ctx, fn="decode", plant=()):
    """Random history for sequences at `pos` (distinct slots), then decode (or prefill) once per bucket; plant:
    (sequence, token) pairs whose causal-limit key gets a dominant weight (_plant_keys)."""
    from ninfer_rt.gpu import attention
    nH, nKV, d = DIMS[dims][:3]
    B, M = len(pos), len(pos) * T
    slots = B + 1
    slot = [int(s) for s in rng.permutation(slots)[:B]]
    cache = _new_cache(dev, slots, max_ctx, nKV, d, dtype)
    K, V = _fill_cache(gpu, rng, cache, slot, [p + T for p in pos])
    q = (rng.standard_normal((M, nH, d)) * 1.5).astype(np.float32)
    _plant_keys(gpu, rng, cache, K, q, slot, pos, T, plant)
    ld_gate = nH * d + 24
    gate = np.full((M, ld_gate), np.nan, np.float32)                        # NaN padding past nH·d
    gate[:, :nH * d] = rng.standard_normal((M, nH * d))
    qp, gp = dev.put(q), dev.put(gate)
    pp, sp = dev.put(np.array(pos, np.int32)), dev.put(np.array(slot, np.int32))
    # prefill's tensor-core kernels round q (and p) to bf16: their oracle takes q as the kernel rounds it
    rounded = fn == "prefill" and _rows(dims, T) > attention._FAST_MAX_ROWS
    q_in = bf16_bits_to_f32(f32_to_bf16_bits(q)) if rounded else q
    ref, scale = _oracle_attention(q_in, gate[:, :nH * d], K, V, pos, slot, T)
    for bucket in buckets:
        out = dev.empty(M * nH * d * 4)
        scratch = dev.empty(attention.decode_scratch_bytes(M, nH, d, bucket))  # fresh NaNs: no stale partials
        kw = dict(q=qp, gate=gp, ld_gate=ld_gate, pos=pp, slot=sp, T=T, nH=nH, cache=cache, out=out,
                  scratch=scratch, ctx_bucket=bucket)
        if fn == "decode":
            attention.decode(kernels, B=B, **kw)
        else:
            attention.prefill(kernels, **kw)
        got = dev.get(out, (M, nH * d))
        _check_attention(got, ref, scale, f"{fn} {dims} {dtype} pos={pos} T={T} bucket={bucket}",
                         p_bf16=rounded)


# ------------------------------------------------------------------------------------------ prepare

def _oracle_prepare(qkvg, qn, kn, pos, T, dims, yarn):
    """q, k (normed + roped, fp32) and v of every row, from the reference ops."""
    nH, nKV, d, rot, theta, section = DIMS[dims]
    M = qkvg.shape[0]
    x = torch.from_numpy(qkvg)
    q = x[:, :nH * d].reshape(M, nH, d)
    k = x[:, nH * d:(nH + nKV) * d].reshape(M, nKV, d)
    v = x[:, (nH + nKV) * d:(nH + 2 * nKV) * d].reshape(M, nKV, d)
    qs, ks = [], []
    for b, p0 in enumerate(pos):
        rows = slice(b * T, (b + 1) * T)
        cos, sin = ops.rope_cos_sin(torch.arange(p0, p0 + T), rot, theta, section, torch.float32, yarn)
        qs.append(ops.apply_rope(ops.rms_norm_zc(q[rows], torch.from_numpy(qn), EPS), cos, sin))
        ks.append(ops.apply_rope(ops.rms_norm_zc(k[rows], torch.from_numpy(kn), EPS), cos, sin))
    return torch.cat(qs).numpy(), torch.cat(ks).numpy(), v.numpy().copy()


def _prepare_args(dev, rng, dims, pos, T, slot, cache, gate=False):
    """Random qkvg rows (q|k|v of mixed magnitudes; the gate columns random with gate=True, else NaN like the
    padding: prepare never reads them) and norm weights on the device, as attention.prepare's keyword arguments
    (q_out poisoned); also the host qkvg and the oracle's q, k, v (_oracle_prepare)."""
    nH, nKV, d, rot, theta, section = DIMS[dims]
    B, M = len(pos), len(pos) * T
    yarn = _yarn() if dims == "35b" else None
    inv_freq, rope_scale = ops.rope_inv_freq(rot, theta, yarn)
    ld = (2 * nH + 2 * nKV) * d + 8
    qkvg = np.full((M, ld), np.nan, np.float32)                             # padding unread
    qkvg[:, :(nH + 2 * nKV) * d] = rng.standard_normal((M, (nH + 2 * nKV) * d)) * rng.uniform(0.2, 5, (M, 1))
    if gate:
        qkvg[:, (nH + 2 * nKV) * d:(2 * nH + 2 * nKV) * d] = rng.standard_normal((M, nH * d))
    qn, kn = (rng.standard_normal(d) * 0.3).astype(np.float32), (rng.standard_normal(d) * 0.3).astype(np.float32)
    kw = dict(qkvg=dev.put(qkvg), ld=ld, q_norm=dev.put(qn), k_norm=dev.put(kn), inv_freq=dev.put(inv_freq.numpy()),
              rope_scale=rope_scale, rot=rot, pos=dev.put(np.array(pos, np.int32)),
              slot=dev.put(np.array(slot, np.int32)), B=B, T=T, nH=nH, eps=EPS, cache=cache,
              q_out=dev.empty(M * nH * d * 4))
    return (kw, qkvg) + _oracle_prepare(qkvg, qn, kn, pos, T, dims, yarn)


def _prepare(kernels, dev, rng, dims, dtype, pos, T, max_ctx, slots):
    """Run prepare on random qkvg; returns (cache, slot, q_out, oracle q, k, v, qkvg)."""
    from ninfer_rt.gpu import attention
    nH, nKV, d = DIMS[dims][:3]
    slot = [int(s) for s in rng.permutation(slots)[:len(pos)]]
    cache = _new_cache(dev, slots, max_ctx, nKV, d, dtype)
    kw, qkvg, q_ref, k_ref, v_ref = _prepare_args(dev, rng, dims, pos, T, slot, cache)
    attention.prepare(kernels, **kw)
    return cache, slot, dev.get(kw["q_out"], (len(pos) * T, nH, d)), q_ref, k_ref, v_ref, qkvg


def _read_rows(dev, cache, s, p0, T):
    """Cache rows [p0, p0 + T) of slot s: (k, v, k_scale, v_scale) raw, scales None for bf16."""
    esize = 2 if cache.dtype == "bf16" else 1
    dt = np.uint16 if cache.dtype == "bf16" else np.int8
    row = (s * cache.max_ctx + p0) * cache.nKV
    shape = (T, cache.nKV, cache.d)
    k = dev.get(cache.k + row * cache.d * esize, shape, dt)
    v = dev.get(cache.v + row * cache.d * esize, shape, dt)
    if cache.dtype == "bf16":
        return k, v, None, None
    return k, v, dev.get(cache.k_scale + row * 4, shape[:2]), dev.get(cache.v_scale + row * 4, shape[:2])


def _check_bf16(got, want, what):
    """<= 1 bf16 ulp apart, and at least 99% bit-exact (a systematic rounding error would miss most)."""
    g, w = bf16_bits_to_f32(got).astype(np.float64), bf16_bits_to_f32(want).astype(np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(g), np.abs(w)) + 1e-38)) - 7)
    bad = ~(np.abs(g - w) <= ulp)
    assert not bad.any(), f"{what}: {bad.sum()} values off by > 1 bf16 ulp at {_where(bad)}"
    exact = (got == want).mean()
    assert exact >= 0.99, f"{what}: only {exact:.3f} of the values are bit-exact"


def _check_q(q_got, q_ref):
    """q: fp32 norm + rope, a few roundings from torch's: 2e-6 of the head's largest value."""
    tol = 2e-6 * np.abs(q_ref).max(-1, keepdims=True)
    bad = ~(np.abs(q_got - q_ref) <= tol)
    assert not bad.any(), f"q_out: {bad.sum()} bad at {_where(bad)}"


def _check_rows(dev, cache, s, p0, k_ref, v_ref, what):
    """Cache rows p0 .. p0 + len(k_ref) - 1 of slot s against the oracle's k, v of those tokens (module docstring)."""
    k, v, ks, vs = _read_rows(dev, cache, s, p0, len(k_ref))
    if cache.dtype == "bf16":
        _check_bf16(k, f32_to_bf16_bits(k_ref), f"k cache of {what}")
        assert np.array_equal(v, f32_to_bf16_bits(v_ref)), f"v cache of {what} not exact"
    else:
        vc, vsc = _quant_int8(v_ref)
        assert np.array_equal(v, vc) and np.array_equal(vs, vsc), f"int8 v cache of {what} not exact"
        kc, ksc = _quant_int8(k_ref)
        assert np.allclose(ks, ksc, rtol=1e-6, atol=0), f"k scales of {what}: {ks} vs {ksc}"
        diff = np.abs(k.astype(np.int32) - kc)
        assert diff.max() <= 1 and (diff == 0).mean() >= 0.99, \
            f"int8 k codes of {what}: max diff {diff.max()}, exact {(diff == 0).mean():.3f}"


def _check_prepare(dev, cache, slot, pos, T, q_got, q_ref, k_ref, v_ref):
    _check_q(q_got, q_ref)
    for b, (s, p0) in enumerate(zip(slot, pos)):
        rows = slice(b * T, (b + 1) * T)
        _check_rows(dev, cache, s, p0, k_ref[rows], v_ref[rows], f"sequence {b}")


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.parametrize("dims,pos,T", [("35b", (0,), 1), ("35b", (5, 0, 1000), 8), ("27b", (9, 2), 2),
                                        ("tiny", (3, 17, 0), 3), ("tiny", (40,), 70), ("d128", (5, 0, 300), 4),
                                        ("d64", (2, 77), 3), ("g5", (1, 40, 0), 5)])
def test_prepare(kernels, dev, rng, dims, pos, T, dtype):
    """q_out and the cache rows written, at every head dim; every other byte of the cache is left as it was. "g5"
    (14 head units in blocks of 4 warps): the last block's 2 warps past the units must exit, not write v heads 2, 3
    (the next position's heads 0, 1: each sequence's position after its last token is one of the unwritten rows)."""
    nKV, d = DIMS[dims][1], DIMS[dims][2]
    max_ctx, slots = max(pos) + T + 3, len(pos) + 1
    cache, slot, q_got, q_ref, k_ref, v_ref, _ = _prepare(kernels, dev, rng, dims, dtype, pos, T, max_ctx, slots)
    _check_prepare(dev, cache, slot, pos, T, q_got, q_ref, k_ref, v_ref)
    written = np.zeros((slots, max_ctx), bool)
    for s, p0 in zip(slot, pos):
        written[s, p0:p0 + T] = True
    esize = 2 if dtype == "bf16" else 1
    for name, base, per in (("k", cache.k, d * esize), ("v", cache.v, d * esize), ("k_scale", cache.k_scale, 4),
                            ("v_scale", cache.v_scale, 4)):
        if base:
            raw = dev.get(base, (slots, max_ctx, nKV * per), np.uint8)
            assert (raw[~written] == 0xFF).all(), f"{name}: bytes outside the written rows changed"


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_prepare_out_of_range(kernels, dev, rng, dtype):
    """attention.prepare's contract: a slot outside [0, slots) or a position >= max_ctx writes nothing to the cache,
    and q_out is still written (all rows against the oracle). Sequences of 5 tokens: slot -1; slot == slots; one at
    position 37 of max_ctx 40 (3 rows written, 2 past the end); a plain one. The cache sits between two poisoned
    guards of two slots' bytes each, and every byte of the whole buffer but the rows in range must still be 0xFF, so
    a write at a negative slot or past the last one shows too."""
    from ninfer_rt.gpu import attention
    dims, T, slots, max_ctx = "d128", 5, 2, 40
    nH, nKV, d = DIMS[dims][:3]
    pos, slot = [3, 37, 0, 10], [-1, 1, 2, 0]
    guard = attention.KVCache.nbytes(2, max_ctx, nKV, d, dtype)             # a multiple of 256
    n = attention.KVCache.nbytes(slots, max_ctx, nKV, d, dtype)
    base = dev.empty(guard + n + guard)
    cache = attention.KVCache.at(base + guard, slots, max_ctx, nKV, d, dtype)
    kw, _, q_ref, k_ref, v_ref = _prepare_args(dev, rng, dims, pos, T, slot, cache)
    attention.prepare(kernels, **kw)
    _check_q(dev.get(kw["q_out"], (len(pos) * T, nH, d)), q_ref)
    keep = np.ones(guard + n + guard, bool)                                 # bytes that must still be 0xFF
    row = nKV * d * (2 if dtype == "bf16" else 1)
    for b, (s, p0) in enumerate(zip(slot, pos)):
        if not 0 <= s < slots:
            continue
        m = min(T, max_ctx - p0)                                            # rows in range
        _check_rows(dev, cache, s, p0, k_ref[b * T:b * T + m], v_ref[b * T:b * T + m], f"sequence {b}")
        for plane, per in ((cache.k, row), (cache.v, row), (cache.k_scale, nKV * 4), (cache.v_scale, nKV * 4)):
            if plane:
                off = plane - base + (s * max_ctx + p0) * per
                keep[off:off + m * per] = False
    raw = dev.get(base, (guard + n + guard,), np.uint8)
    bad = np.flatnonzero(keep & (raw != 0xFF))
    assert bad.size == 0, f"{bad.size} bytes out of range written, e.g. at {bad[:5] - guard} (cache: 0 .. {n})"


def test_prepare_far_positions(kernels, dev, rng):
    """Positions near 262144 with YaRN (angles up to ~2.6e5 rad): accurate cos/sin, cache rows at the end."""
    for dtype in ("bf16", "int8"):
        pos, T = (262140, 261000), 4
        cache, slot, q_got, q_ref, k_ref, v_ref, _ = _prepare(kernels, dev, rng, "35b", dtype, pos, T, 262144, 2)
        _check_prepare(dev, cache, slot, pos, T, q_got, q_ref, k_ref, v_ref)


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_prepare_then_decode(kernels, gpu, dev, rng, dtype):
    """The layer path (gpu/mixer.py attention): prepare, then decode with prepare's q_out as q and the gate columns
    of the same qkvg (ld_gate = its row stride), launched back to back on one stream with nothing between them, as
    a graph replays them (with PDL, decode's ring loads the keys before p0 while prepare still runs, and must wait
    for q and keys p0 ..). History at positions < pos is uploaded first; prepare's rows (and all later ones) start
    poisoned, as does q_out, so a decode that reads either before prepare wrote it gives NaN. Then: q_out and the
    rows prepare wrote against the prepare oracle (_check_prepare), and out against gated_attention on q_out and
    the cache as read back, with _check_attention's bound (whose derivation takes q as decode reads it)."""
    from ninfer_rt.gpu import attention
    dims, pos, T = "35b", [0, 700, 33], 3
    nH, nKV, d = DIMS[dims][:3]
    B, M, max_ctx, bucket = len(pos), len(pos) * T, 800, 1024
    slot = [int(s) for s in rng.permutation(B)]
    cache = _new_cache(dev, B, max_ctx, nKV, d, dtype)
    for s, p0 in zip(slot, pos):                                            # history: positions [0, p0)
        if p0 == 0:
            continue
        hist = (rng.standard_normal((2, p0, nKV, d)) * 1.3).astype(np.float32)
        row = s * max_ctx * nKV
        for j, (dst, sdst) in enumerate(((cache.k, cache.k_scale), (cache.v, cache.v_scale))):
            if dtype == "bf16":
                gpu.upload(dst + row * d * 2, f32_to_bf16_bits(hist[j]))
            else:
                codes, scales = _quant_int8(hist[j])
                gpu.upload(dst + row * d, codes)
                gpu.upload(sdst + row * 4, scales)
    kw, qkvg, q_ref, k_ref, v_ref = _prepare_args(dev, rng, dims, pos, T, slot, cache, gate=True)
    out = dev.empty(M * nH * d * 4)                                         # every buffer before the first launch
    scratch = dev.empty(attention.decode_scratch_bytes(M, nH, d, bucket))
    attention.prepare(kernels, **kw)
    attention.decode(kernels, q=kw["q_out"], gate=kw["qkvg"] + 4 * (nH + 2 * nKV) * d, ld_gate=kw["ld"],
                     pos=kw["pos"], slot=kw["slot"], B=B, T=T, nH=nH, cache=cache, out=out, scratch=scratch,
                     ctx_bucket=bucket)
    got = dev.get(out, (M, nH * d))                                         # the first host sync
    q_got = dev.get(kw["q_out"], (M, nH, d))
    _check_prepare(dev, cache, slot, pos, T, q_got, q_ref, k_ref, v_ref)
    Kc = np.zeros((B, max_ctx, nKV, d), np.float32)
    Vc = np.zeros_like(Kc)
    for b, (s, p0) in enumerate(zip(slot, pos)):
        k, v, ks, vs = _read_rows(dev, cache, s, 0, p0 + T)
        if dtype == "bf16":
            Kc[b, :p0 + T], Vc[b, :p0 + T] = bf16_bits_to_f32(k), bf16_bits_to_f32(v)
        else:
            Kc[b, :p0 + T], Vc[b, :p0 + T] = k.astype(np.float32) * ks[..., None], v.astype(np.float32) * vs[..., None]
    gate = np.ascontiguousarray(qkvg[:, (nH + 2 * nKV) * d:(2 * nH + 2 * nKV) * d])
    ref, scale = _oracle_attention(q_got, gate, Kc, Vc, pos, list(range(B)), T)
    _check_attention(got, ref, scale, f"prepare + decode {dtype}")


def test_bad_arguments(kernels):
    from ninfer_rt.gpu import attention
    from ninfer_rt.gpu.driver import GpuError
    cache = attention.KVCache(k=256, v=512, k_scale=0, v_scale=0, slots=2, max_ctx=64, nKV=2, d=32, dtype="bf16")
    prep = dict(qkvg=1, ld=(2 * 4 + 2 * 2) * 32, q_norm=1, k_norm=1, inv_freq=1, rope_scale=1.0, rot=8, pos=1,
                slot=1, B=1, T=1, nH=4, eps=EPS, cache=cache, q_out=1)
    for change in (dict(rot=7), dict(rot=34), dict(ld=prep["ld"] - 1), dict(nH=3), dict(B=0), dict(T=0),
                   dict(q_out=0), dict(cache=cache.__class__(**{**cache.__dict__, "d": 48})),
                   dict(cache=cache.__class__(**{**cache.__dict__, "dtype": "int8"}))):
        with pytest.raises(GpuError):
            attention.prepare(kernels, **{**prep, **change})
    dec = dict(q=1, gate=1, ld_gate=4 * 32, pos=1, slot=1, B=1, T=1, nH=4, cache=cache, out=1, scratch=1,
               ctx_bucket=64)
    for change in (dict(ld_gate=4 * 32 - 1), dict(ctx_bucket=0), dict(nH=5), dict(scratch=0), dict(T=0)):
        with pytest.raises(GpuError):
            attention.decode(kernels, **{**dec, **change})
    with pytest.raises(GpuError):
        attention.KVCache.nbytes(1, 8, 2, 32, "fp8")
    with pytest.raises(GpuError):
        attention.KVCache.at(256 + 16, 1, 8, 2, 32, "bf16")


def test_cache_layout():
    """nbytes/at: parts in order k, v, k_scale, v_scale, each 256-aligned and large enough (no device needed)."""
    from ninfer_rt.gpu import attention
    for dtype, esize in (("bf16", 2), ("int8", 1)):
        slots, ctx, nKV, d = 3, 1001, 2, 256
        n = attention.KVCache.nbytes(slots, ctx, nKV, d, dtype)
        c = attention.KVCache.at(1 << 20, slots, ctx, nKV, d, dtype)
        data, rows = slots * ctx * nKV * d * esize, slots * ctx * nKV
        assert c.k == 1 << 20 and c.v - c.k >= data and c.v % 256 == 0
        if dtype == "int8":
            assert c.k_scale - c.v >= data and c.k_scale % 256 == 0
            assert c.v_scale - c.k_scale >= 4 * rows and c.v_scale % 256 == 0
            assert c.v_scale + 4 * rows <= c.k + n
        else:
            assert c.k_scale == c.v_scale == 0 and c.v + data <= c.k + n


# ------------------------------------------------------------------------------------------ decode

DECODE_CASES = [  # dims, dtype, pos per sequence, T, extra context in the buckets (1e6: past max_ctx, clamped)
    ("tiny", "bf16", (0,), 1, (0, 5)),
    ("tiny", "int8", (0,), 1, (0,)),
    ("tiny", "bf16", (1, 1000, 0), 3, (0, 100)),
    ("tiny", "int8", (5000, 17, 62), 8, (0, 3, 10 ** 6)),
    ("tiny", "bf16", (30, 500), 70, (0,)),
    ("35b", "bf16", (0,), 1, (0, 1)),
    ("35b", "int8", (1,), 1, (0,)),
    ("35b", "bf16", (1000, 5000, 1), 1, (0, 3000)),
    ("35b", "int8", (1000, 5000, 1), 1, (0, 3000, 10 ** 6)),
    ("35b", "bf16", (1, 1000, 0), 3, (0,)),
    ("35b", "int8", (0, 5000, 999), 3, (7,)),
    ("35b", "bf16", (5000,), 8, (0, 200)),
    ("35b", "int8", (62, 127, 4090), 8, (1,)),
    ("35b", "bf16", (100,), 70, (0,)),
    ("35b", "int8", (0,), 70, (5,)),
    ("27b", "bf16", (3, 300), 3, (0, 64)),
    ("27b", "int8", (150,), 8, (0,)),
]


def _ids(cases):
    return [f"{c[0]}-{c[1]}-B{len(c[2])}-T{c[3]}-ctx{max(c[2])}" for c in cases]


def _max_ctx(pos, T, extras):
    return max(pos) + T + max(e for e in extras if e < 10 ** 6) + 3


@pytest.mark.parametrize("dims,dtype,pos,T,extras", DECODE_CASES, ids=_ids(DECODE_CASES))
def test_decode(kernels, gpu, dev, rng, dims, dtype, pos, T, extras):
    end = max(pos) + T
    _run_decode(kernels, gpu, dev, rng, dims, dtype, list(pos), T, [end + e for e in extras],
                _max_ctx(pos, T, extras))


# ------------------------------------------------------------------------------------------ decode paths

def _rows(dims: str, T: int) -> int:
    nH, nKV = DIMS[dims][:2]
    return T * (nH // nKV)


def test_decode_path_choice(kernels, gpu, dev, rng, monkeypatch, recorder):
    """T·(nH/nKV) <= _FAST_MAX_ROWS runs attention_decode.cu's kernels, more rows (or _FAST_MAX_ROWS = 0) the
    tensor-core ones of attention.cu; both give the oracle's result."""
    from ninfer_rt.gpu import attention
    rec = recorder
    _run_decode(rec, gpu, dev, rng, "tiny", "int8", [5, 40], 8, [64], 64)
    assert rec.names == ["attn_decode_fast_int8_d32", "attn_combine_fast"], rec.names
    rec.names.clear()
    _run_decode(rec, gpu, dev, rng, "tiny", "bf16", [5], 33, [64], 64)               # 66 rows per kv head
    assert rec.names == ["attn_decode_bf16_d32", "attn_combine"], rec.names
    rec.names.clear()
    monkeypatch.setattr(attention, "_FAST_MAX_ROWS", 0)
    _run_decode(rec, gpu, dev, rng, "35b", "bf16", [30], 1, [64], 64)
    assert rec.names == ["attn_decode_bf16_d256", "attn_combine"], rec.names


FAST_CASES = [  # the CUDA-core path at every head dim; rows T·G from 4 to 60: 1, 2, 3, 4, 6 and 8 row groups of 8
    ("d128", "bf16", (0, 300), 1, (0, 70)),
    ("d128", "int8", (77, 2000), 4, (0,)),
    ("d128", "int8", (1,), 8, (5, 10 ** 6)),
    ("d64", "bf16", (5, 1234), 8, (0, 9)),
    ("d64", "int8", (100,), 3, (0,)),
    ("d64", "int8", (0, 31, 32), 1, (0,)),
    ("27b", "bf16", (700,), 1, (0,)),
    ("27b", "int8", (33, 4100), 5, (0, 1)),
    ("27b", "int8", (50, 3), 10, (0, 7)),  # 60 rows: 8 row groups, the last half full
    ("35b", "int8", (9000,), 1, (0,)),  # ~2 splits per SM: the combine's threads fold 4 or 5 (two load batches)
    ("tiny", "bf16", (0, 7, 8, 9), 2, (0,)),
]
# every case within _FAST_MAX_ROWS (64) rows per kv head, forced through the tensor-core kernels: head dims 32 to 256,
# so attn_decode_{bf16,int8}_d{64,128} run too, and the 128-byte rows (bf16 d64, int8 d128) of its K/V tile swizzle
MMA_CASES = [c for c in DECODE_CASES + FAST_CASES if _rows(c[0], c[3]) <= 64]


@pytest.mark.parametrize("dims,dtype,pos,T,extras", MMA_CASES, ids=_ids(MMA_CASES))
def test_decode_tensor_core_path(kernels, gpu, dev, rng, monkeypatch, recorder, dims, dtype, pos, T, extras):
    """The cases that take the CUDA-core path, forced through the tensor-core kernels (the fallback): the launches
    are attn_decode_{dtype}_d{d} + attn_combine per bucket, and the result the oracle's."""
    from ninfer_rt.gpu import attention
    monkeypatch.setattr(attention, "_FAST_MAX_ROWS", 0)
    end = max(pos) + T
    _run_decode(recorder, gpu, dev, rng, dims, dtype, list(pos), T, [end + e for e in extras],
                _max_ctx(pos, T, extras))
    want = [f"attn_decode_{dtype}_d{DIMS[dims][2]}", "attn_combine"] * len(extras)
    assert recorder.names == want, recorder.names


@pytest.mark.parametrize("dims,dtype,pos,T,extras", FAST_CASES, ids=_ids(FAST_CASES))
def test_decode_fast(kernels, gpu, dev, rng, recorder, dims, dtype, pos, T, extras):
    """The CUDA-core path at every head dim: it runs (attention._fast_path falls back to the tensor-core kernels
    where its shared memory does not fit, so the launches are checked: attn_decode_fast_{dtype}_d{d} +
    attn_combine_fast per bucket), and gives the oracle's result."""
    assert _rows(dims, T) <= 64
    end = max(pos) + T
    _run_decode(recorder, gpu, dev, rng, dims, dtype, list(pos), T, [end + e for e in extras],
                _max_ctx(pos, T, extras))
    want = [f"attn_decode_fast_{dtype}_d{DIMS[dims][2]}", "attn_combine_fast"] * len(extras)
    assert recorder.names == want, recorder.names


@pytest.mark.parametrize("fast", [True, False])
def test_decode_invalid_slot(kernels, gpu, dev, rng, monkeypatch, fast):
    """A sequence whose slot is outside [0, slots) reads no cache and comes out 0; the others are unaffected."""
    from ninfer_rt.gpu import attention
    if not fast:
        monkeypatch.setattr(attention, "_FAST_MAX_ROWS", 0)
    nH, nKV, d = DIMS["35b"][:3]
    pos, T, max_ctx = [300, 40, 700], 2, 710
    B, M = len(pos), len(pos) * T
    cache = _new_cache(dev, 2, max_ctx, nKV, d, "int8")
    slot = [1, -1, 2]                                                         # 2 == slots: out of range too
    K, V = _fill_cache(gpu, rng, cache, [1], [pos[0] + T])
    q = (rng.standard_normal((M, nH, d)) * 1.5).astype(np.float32)
    gate = rng.standard_normal((M, nH * d)).astype(np.float32)
    out = dev.empty(M * nH * d * 4)
    attention.decode(kernels, q=dev.put(q), gate=dev.put(gate), ld_gate=nH * d, pos=dev.put(np.array(pos, np.int32)),
                     slot=dev.put(np.array(slot, np.int32)), B=B, T=T, nH=nH, cache=cache, out=out,
                     scratch=dev.empty(attention.decode_scratch_bytes(M, nH, d, 1024)), ctx_bucket=1024)
    got = dev.get(out, (M, nH * d))
    assert (got[T:] == 0).all(), "rows of sequences with an invalid slot are not 0"
    ref, scale = _oracle_attention(q[:T], gate[:T], K, V, pos[:1], [1], T)
    _check_attention(got[:T], ref, scale, f"decode next to invalid slots (fast={fast})")
