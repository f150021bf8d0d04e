"""Launch wrappers for the gated full-attention kernels (kernels/attention*.cu): KV cache, prepare, decode, prefill.

What sits between the fused q|k|v|gate projection and o_proj (ninfer_rt/reference/model.py GatedAttention):
  prepare  q/k RMSNorm (zero-centred) + partial NeoX RoPE; q -> fp32 buffer, k/v -> the KV cache (bf16 or int8)
  decode   causal GQA attention of B sequences × T new tokens against their cache slots, times sigmoid(gate)
  prefill  the same for one sequence and a long T, with q and p rounded to bf16 on the tensor-core path

Decode is split-KV (flash decoding) over the rows of one kv head, the (token, head-in-group) pairs, so K/V are read
once for all its query heads; partials go to `scratch` and a second kernel merges them and applies the gate. Either
way a graph captured for a bucket replays at any context below it. The tensor-core kernels take a split length
that depends only on (M, ctx_bucket) (blocks past the real length exit at once); the CUDA-core decode fixes the
number of splits instead (decode_splits: about _SPLIT_BLOCKS_PER_SM blocks per SM) and its kernels deal each
sequence's keys evenly over them at run time, so every split is busy and equally long wherever the context falls
in the bucket. Two kernel families compute the partials:
  few rows (T·(nH/nKV) <= _FAST_MAX_ROWS: decode, MTP verify)  kernels/attention_decode.cu, memory-bound: one block
      of 4 warps per (8 rows, split, sequence, kv head), each warp streaming its keys through a cp.async ring, plain
      fp32 FMAs on CUDA cores; merged by attn_combine_fast.
  more rows (prefill), or a GPU without the shared memory it needs  kernels/attention.cu: one warp per (16 rows,
      split, sequence, kv head) on tensor cores, operands split into three bf16 terms; merged by attn_combine.
Both match ops.gated_attention to fp32 accuracy and write the same scratch layout. prefill's tensor-core kernels
(attn_prefill_*, kernels/attention_prefill.cu) round q and the softmax weights p to one bf16 term instead, as
flash-attention kernels do (each output within 2^-8 of its Σ p|v| scale of the result on bf16 q), and run
several warps per block that share each K/V tile (an int8 tile converted to bf16 once per block). On an
H100/H200 running its sm_90a cubin, an int8 cache of head dim 64, 128 or 256 takes attn_prefill_wgmma_int8_d*
(kernels/attention_prefill_wgmma.cu) instead: the same numerics and scratch on warpgroup MMAs, 128 rows and 64 keys
a step per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ninfer_rt.gpu.driver import GpuError, f32, i32, ptr
from ninfer_rt.gpu.gemm import wgmma_available

HEAD_DIMS = (32, 64, 128, 256)   # head dims the kernels are built for
_ALIGN = 256                     # each part of a cache / scratch allocation starts on this boundary
_MIN_SPLIT = 64                  # keys per split, at least (a power of two times this)
_MAX_SPLITS = 512                # splits per sequence, at most
_SPLIT_ROWS = 4096               # n_splits · M stays below max(this, M): bounds the scratch
_SPLIT_BLOCKS_PER_SM = 2         # CUDA-core decode: splits for ~this many blocks per SM, dealt at run time (0: off)
_SPLIT_LONG_KEYS = 2048          # ... twice as many where a split would be longer than this (compute-bound)
_Q_ROWS = 16                     # query rows (token, head) pairs per decode warp
_FAST_ROWS = 8                   # query rows per block of the CUDA-core decode (attention_decode.cu kFastRows)
_FAST_THREADS = 128              # its block (kFastWarps = 4 warps)
_FAST_MAX_ROWS = 64              # T·(nH/nKV) up to this takes the CUDA-core decode; 0 forces the tensor-core one
_PREFILL_WGMMA = True            # prefill on an int8 cache takes the wgmma kernel where it runs (False: mma.sync)
# planner switch: the engine has the CUDA-core decode's combine write o_proj's x̂ records (one token), so o_proj
# copies them instead of coding o (perf-history.md v41); False: o_proj codes the fp32 o itself
COMBINE_OUT_RECORDS = True
_WG_ROWS, _WG_THREADS = 128, 256  # attn_prefill_wgmma_*: query rows and threads per block
_WG_HEAD_DIMS = (64, 128, 256)


def rope_inv_freq(spec) -> tuple[np.ndarray, float]:
    """numpy twin of ops.rope_inv_freq (plain or YaRN), fp32 with the same operation order (tested equal)."""
    rot, theta, yarn = spec.rotary_dim, spec.rope_theta, spec.yarn
    # θ^e rounded once from fp64: numpy's fp32 power (a SIMD routine in numpy 2.x) can be an ulp off torch's
    powers = (np.float64(np.float32(theta)) ** (np.arange(0, rot, 2, dtype=np.float32) / np.float32(rot))
              .astype(np.float64)).astype(np.float32)
    if yarn is None:
        return (np.float32(1.0) / powers).astype(np.float32), 1.0

    def ramp_point(rotations: float) -> float:
        L = yarn.original_max_position_embeddings
        return (rot * math.log(L / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = ramp_point(yarn.beta_fast), ramp_point(yarn.beta_slow)
    if yarn.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rot - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(rot // 2, dtype=np.float32) - np.float32(lo)) / np.float32(hi - lo), 0, 1)
    keep = np.float32(1) - ramp
    inv = np.float32(1.0) / (np.float32(yarn.factor) * powers) * (np.float32(1) - keep) + \
        np.float32(1.0) / powers * keep
    return inv.astype(np.float32), float(yarn.attention_factor)



def _round_up(n: int, m: int = _ALIGN) -> int:
    return (n + m - 1) // m * m


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise GpuError(what)


_ELEM = {"bf16": 2, "int8": 1}


@dataclass(frozen=True)
class KVCache:
    """One full-attention layer's KV cache on the device.

    k, v: [slots, max_ctx, nKV, d] bf16 bits (uint16) or int8 codes; k_scale, v_scale: fp32 [slots, max_ctx, nKV]
    (value = code · scale) for int8, 0 for bf16. A sequence owns one slot; position p of it holds token p.
    """

    k: int
    v: int
    k_scale: int
    v_scale: int
    slots: int
    max_ctx: int
    nKV: int
    d: int
    dtype: str

    @staticmethod
    def _parts(slots: int, max_ctx: int, nKV: int, d: int, dtype: str) -> tuple[int, int]:
        _need(dtype in _ELEM, f"KVCache: dtype {dtype!r} is not one of {', '.join(_ELEM)}")
        _need(slots >= 1 and max_ctx >= 1 and nKV >= 1 and d >= 1,
              f"KVCache: slots={slots}, max_ctx={max_ctx}, nKV={nKV}, d={d} must all be >= 1")
        rows = slots * max_ctx * nKV
        return _round_up(rows * d * _ELEM[dtype]), (_round_up(rows * 4) if dtype == "int8" else 0)

    @staticmethod
    def nbytes(slots: int, max_ctx: int, nKV: int, d: int, dtype: str) -> int:
        """Bytes of k, v (and k_scale, v_scale for int8), each part rounded up to 256 bytes."""
        data, scale = KVCache._parts(slots, max_ctx, nKV, d, dtype)
        return 2 * data + 2 * scale

    @classmethod
    def at(cls, base: int, slots: int, max_ctx: int, nKV: int, d: int, dtype: str) -> "KVCache":
        """The cache laid out from device address `base` (256-byte aligned): k, v, then k_scale, v_scale."""
        _need(base % _ALIGN == 0, f"KVCache: base address {base:#x} is not {_ALIGN}-byte aligned")
        data, scale = cls._parts(slots, max_ctx, nKV, d, dtype)
        k_scale = base + 2 * data if scale else 0
        v_scale = base + 2 * data + scale if scale else 0
        return cls(base, base + data, k_scale, v_scale, slots, max_ctx, nKV, d, dtype)

    def copy_positions(self, gpu, src: int, dst: int, n: int) -> None:
        """Positions [0, n) of slot src into slot dst (k, v and, for int8, their scales), on the default stream."""
        _need(0 <= src < self.slots and 0 <= dst < self.slots and 0 <= n <= self.max_ctx,
              f"KVCache.copy_positions: slots {src} -> {dst} of {self.slots}, {n} of {self.max_ctx} positions")
        planes = [(self.k, self.nKV * self.d * _ELEM[self.dtype]), (self.v, self.nKV * self.d * _ELEM[self.dtype])]
        if self.dtype == "int8":
            planes += [(self.k_scale, self.nKV * 4), (self.v_scale, self.nKV * 4)]
        for base, row in planes:  # each plane is [slots, max_ctx, ...]: a slot's first n positions are contiguous
            if n:
                gpu.copy(base + dst * self.max_ctx * row, base + src * self.max_ctx * row, n * row)


def _check_heads(name: str, nH: int, cache: KVCache) -> None:
    _need(cache.d in HEAD_DIMS, f"{name}: head dim {cache.d} is not one of {HEAD_DIMS}")
    _need(cache.dtype in _ELEM, f"{name}: cache dtype {cache.dtype!r} is not one of {', '.join(_ELEM)}")
    _need(nH >= 1 and nH % cache.nKV == 0, f"{name}: nH={nH} is not a positive multiple of nKV={cache.nKV}")


def _check_batch(name: str, B: int, T: int) -> None:
    _need(B >= 1 and T >= 1, f"{name}: B={B} and T={T} must be >= 1")
    _need(B * T < 2 ** 31, f"{name}: B·T={B * T} is out of range")


def _check_ptrs(name: str, **ptrs: int) -> None:
    for k, p in ptrs.items():
        _need(bool(p), f"{name}: {k} is a null pointer")


# ------------------------------------------------------------------------------------------ prepare

def prepare(k, *, qkvg: int, ld: int, q_norm: int, k_norm: int, inv_freq: int, rope_scale: float, rot: int,
            pos: int, slot: int, B: int, T: int, nH: int, eps: float, cache: KVCache, q_out: int,
            stream=None) -> None:
    """Norm + RoPE q and k of M = B·T tokens, write q to q_out and this step's k, v into the cache.

    qkvg fp32 [M, ld], row b·T + t = token t of sequence b, columns [q (nH·d) | k (nKV·d) | v (nKV·d) | gate].
    q_norm, k_norm fp32 [d] (zero-centred: gain 1 + w); inv_freq fp32 [rot/2] (rope_inv_freq above, YaRN included);
    pos, slot int32 [B] device arrays: token t of sequence b sits at position pos[b] + t of cache slot slot[b].
    q_out fp32 [M, nH, d] = rope(rms_norm_zc(q)); the cache gets rope(rms_norm_zc(k)) and v at those positions
    (bf16 round-to-nearest-even, or int8 with scale max|x|/127 per (position, kv head); a zero vector stores
    scale 0). RoPE: angle_j = float(pos) · inv_freq[j], cos/sin times rope_scale, rotate-half on the first rot dims.
    A slot outside [0, slots) or a position >= max_ctx writes nothing to the cache (q_out is still written).
    """
    name = "attention.prepare"
    _check_heads(name, nH, cache)
    _check_batch(name, B, T)
    d, nKV = cache.d, cache.nKV
    _need(rot % 2 == 0 and 0 <= rot <= d, f"{name}: rot={rot} must be even and in [0, d={d}]")
    _need(ld >= (2 * nH + 2 * nKV) * d, f"{name}: ld={ld} is smaller than the q|k|v|gate width "
                                        f"{(2 * nH + 2 * nKV) * d}")
    _check_ptrs(name, qkvg=qkvg, q_norm=q_norm, k_norm=k_norm, pos=pos, slot=slot, q_out=q_out,
                k_cache=cache.k, v_cache=cache.v)
    _need(rot == 0 or bool(inv_freq), f"{name}: inv_freq is a null pointer")
    int8 = cache.dtype == "int8"
    _need(not int8 or (cache.k_scale and cache.v_scale), f"{name}: int8 cache without scale arrays")
    M, units = B * T, nH + 2 * nKV
    args = [ptr(qkvg), i32(ld), ptr(q_norm), ptr(k_norm), ptr(inv_freq), f32(rope_scale), i32(rot), ptr(pos),
            ptr(slot), i32(T), i32(nH), i32(nKV), f32(eps), ptr(cache.k), ptr(cache.v), ptr(cache.k_scale),
            ptr(cache.v_scale), i32(cache.slots), i32(cache.max_ctx), i32(int(int8)), ptr(q_out)]
    k.launch(f"attn_prepare_d{d}", (M, (units + 3) // 4), 128, args, stream=stream)


# ------------------------------------------------------------------------------------------ decode

def decode_split(M: int, ctx_bucket: int) -> tuple[int, int]:
    """(keys per split, number of splits) that decode uses for M rows and a context bucket.

    The split is the smallest power-of-two multiple of 64 keys that needs at most
    min(512, max(1, 4096 // M)) splits to cover ctx_bucket.
    """
    _need(M >= 1 and ctx_bucket >= 1, f"attention: M={M} and ctx_bucket={ctx_bucket} must be >= 1")
    max_splits = max(1, min(_MAX_SPLITS, _SPLIT_ROWS // M))
    cs = _MIN_SPLIT
    while -(-ctx_bucket // cs) > max_splits:
        cs *= 2
    return cs, -(-ctx_bucket // cs)


def decode_splits(M: int, ctx_bucket: int, blocks: int, sm_count: int) -> int:
    """The CUDA-core decode's number of splits when its kernels deal the keys at run time (split_keys in
    kernels/attention.cuh: each sequence's n keys in n_splits even runs of whole 32-key steps, at least 64):
    about _SPLIT_BLOCKS_PER_SM blocks per SM for `blocks` blocks per split (row groups x sequences x kv heads),
    twice that where the splits would be longer than _SPLIT_LONG_KEYS keys, never more than decode_split gives
    (so decode_scratch_bytes still bounds the scratch). One wave of long, equal splits rather than several
    waves of short ones that each pay a q load, a ring fill and a merge, and the bucket's unused upper part
    costs nothing; but very long splits are bound by the fp32 dot products, and more blocks spread those more
    evenly over the SMs (H200, perf-history.md v13: the 27B at 262K context 73 -> 86 tok/s with 4 blocks per SM, the
    35B at 64K 411 -> 439 tok/s with 2)."""
    _need(blocks >= 1 and sm_count >= 1, f"attention: blocks={blocks} and sm_count={sm_count} must be >= 1")
    ns = max(1, _SPLIT_BLOCKS_PER_SM * sm_count // blocks)
    if -(-ctx_bucket // ns) > _SPLIT_LONG_KEYS:
        ns = max(1, 2 * _SPLIT_BLOCKS_PER_SM * sm_count // blocks)
    return min(decode_split(M, ctx_bucket)[1], ns)


def decode_scratch_bytes(M: int, nH: int, d: int, ctx_bucket: int) -> int:
    """Scratch bytes decode needs for up to M rows and any ctx_bucket up to this one.

    Layout (per call): acc fp32 [n_splits, M, nH, d], then (256-aligned) ml float2 [n_splits, M, nH]. The bound
    n_splits · M <= min(ceil(ctx_bucket / 64) · M, 512 · M, max(4096, M)) grows with both M and ctx_bucket.
    """
    _need(M >= 1 and nH >= 1 and d >= 1 and ctx_bucket >= 1,
          f"attention: M={M}, nH={nH}, d={d}, ctx_bucket={ctx_bucket} must be >= 1")
    rows = min(-(-ctx_bucket // _MIN_SPLIT) * M, _MAX_SPLITS * M, max(_SPLIT_ROWS, M))
    return _round_up(rows * nH * d * 4) + _round_up(rows * nH * 8)


def decode(k, *, q: int, gate: int, ld_gate: int, pos: int, slot: int, B: int, T: int, nH: int, cache: KVCache,
           out: int, scratch: int, ctx_bucket: int, stream=None, out_records: int = 0,
           records_order: int = 0, fold: tuple | None = None) -> bool:
    """Gated causal attention of M = B·T query tokens against their cache slots (keys written by prepare).

    q fp32 [M, nH, d] (prepare's q_out); gate fp32 rows of stride ld_gate (the gate columns of qkvg);
    pos, slot int32 [B] device arrays as in prepare. out fp32 [M, nH·d] = ops.gated_attention per sequence:
    query t of sequence b attends to positions 0 .. pos[b] + t of slot[b], head h reads kv head h // (nH/nKV),
    softmax fp32 with scale d^-0.5, times sigmoid(gate). ctx_bucket >= max_b(pos[b] + T) fixes the launch
    (clamped to max_ctx); keys at or past it are never read. scratch: decode_scratch_bytes(M, nH, d, ctx_bucket)
    bytes (or a bound for a larger M / bucket). Rows of a sequence with an invalid slot come out 0.
    out_records (with records_order 1 or 2, linear.records_order of o_proj; 16-byte aligned): where the CUDA-core
    path runs, its combine also writes out as o_proj's x̂, nH·d/32 int16 chunk records of all M rows
    (reference.ops.act_records16 of out [M, nH·d]) for linear.gemv's x_records. Returns whether it wrote them.
    fold (v72): (mt, ms, wt, gain, x, acc, ld, n, H), the router fold of the MoE after o_proj
    (router_fold's arrays in fold_blocks' layout, on the device; gain fp32 [H] = 1 + w_post of the MoE's norm, 16-byte
    aligned as x fp32 [M, H], the layer input): the combine also adds G·x_m + M·out_m into row m of acc int64
    [M, ld] (fixed point, 2^-32; n logits a row) on the CUDA-core path (fold_fits); every row since v87, with
    H % 4 == 0 at M > 1 (each row's 16 elements go by 16-byte cp.async).
    """
    if out_records:
        _need(records_order in (1, 2) and out_records % 16 == 0,
              f"attention.decode: out_records needs records_order 1 or 2 (got {records_order}) and a 16-byte "
              "aligned buffer")
    launches = _decode_launches(k, q=q, gate=gate, ld_gate=ld_gate, pos=pos, slot=slot, B=B, T=T, nH=nH,
                                cache=cache, out=out, scratch=scratch, ctx_bucket=ctx_bucket,
                                out_records=out_records, records_order=records_order, fold=fold)
    _launch(k, launches, stream)
    return bool(out_records) and launches[-1][0] == "attn_combine_fast"


def _launch(k, launches: list[tuple], stream) -> None:
    """Enqueue _decode_launches' (entry point, grid, block, args, smem) tuples in order."""
    for fn, grid, block, args, smem in launches:
        k.launch(fn, grid, block, args, smem=smem, stream=stream)


def _decode_launches(k, *, q: int, gate: int, ld_gate: int, pos: int, slot: int, B: int, T: int, nH: int,
                     cache: KVCache, out: int, scratch: int, ctx_bucket: int, exact: bool = True,
                     out_records: int = 0, records_order: int = 0, fold: tuple | None = None) -> list[tuple]:
    """decode()'s two launches, checked, as (entry point, grid, block, args, dynamic smem): the partials, then
    their merge (bench/attention_bench.py times them apart). exact=False: the tensor-core path rounds q and p to
    bf16 (attn_prefill_*). out_records, records_order: decode's, passed to attn_combine_fast (the other merges
    write no records)."""
    name = "attention.decode"
    _check_heads(name, nH, cache)
    _check_batch(name, B, T)
    d, nKV = cache.d, cache.nKV
    _need(ld_gate >= nH * d, f"{name}: ld_gate={ld_gate} is smaller than nH·d={nH * d}")
    _need(ctx_bucket >= 1, f"{name}: ctx_bucket={ctx_bucket} must be >= 1")
    _check_ptrs(name, q=q, gate=gate, pos=pos, slot=slot, out=out, scratch=scratch, k_cache=cache.k,
                v_cache=cache.v)
    int8 = cache.dtype == "int8"
    _need(not int8 or (cache.k_scale and cache.v_scale), f"{name}: int8 cache without scale arrays")
    M, G = B * T, nH // nKV
    smem = _fast_path(k, T * G, d, cache.dtype)
    bucket = min(ctx_bucket, cache.max_ctx)
    runtime = bool(smem) and _SPLIT_BLOCKS_PER_SM > 0
    if runtime:  # n_splits fixed, each sequence's split length dealt by the kernels (at least _MIN_SPLIT keys)
        cs, ns = _MIN_SPLIT, decode_splits(M, bucket, -(-(T * G) // _FAST_ROWS) * B * nKV, k.gpu.info.sm_count)
    else:
        cs, ns = decode_split(M, bucket)
    acc = scratch
    ml = scratch + _round_up(ns * M * nH * d * 4)
    _need(B * nKV <= 65535 and nH <= 65535, f"{name}: B={B}, nKV={nKV}, nH={nH} give too large a grid")
    sc = d ** -0.5 * math.log2(math.e)  # softmax in base 2
    args = [ptr(q), ptr(cache.k), ptr(cache.v), ptr(cache.k_scale), ptr(cache.v_scale), ptr(pos), ptr(slot),
            ptr(acc), ptr(ml), i32(T), i32(nH), i32(nKV), i32(M), i32(cache.slots), i32(cache.max_ctx), i32(cs),
            i32(ns), f32(sc)]
    comb = [ptr(acc), ptr(ml), ptr(gate), i32(ld_gate), ptr(pos), ptr(slot), ptr(out), i32(T), i32(M), i32(nH),
            i32(d), i32(cache.slots), i32(cache.max_ctx), i32(cs), i32(ns)]
    # combine: 4..32 splits read side by side per block (32 with the router fold: a thread a logit)
    lanes = min(32, max(4, 1 << (ns - 1).bit_length()))
    if fold is not None:
        _need(bool(smem) and fold[7] <= FOLD_THREADS + 1 and fold[7] <= fold[6] and fold[8] <= 16 * nH * d // 32
              and (M == 1 or fold[8] % 4 == 0),
              f"{name}: the router fold needs the CUDA-core path, at most {FOLD_THREADS + 1} logits, ld >= n, "
              f"H <= {16 * nH * d // 32} and, at M > 1, x's rows 16-byte aligned (H % 4 == 0) (got M={M}, "
              f"n={fold[7]}, ld={fold[6]}, H={fold[8]})")
        lanes = FOLD_THREADS // 8
    fm, fs, fw, fg, fx, fa, fld, fn, fh = fold or (0,) * 9
    if smem:
        rt = [i32(int(runtime))]
        return [(f"attn_decode_fast_{cache.dtype}_d{d}", (-(-(T * G) // _FAST_ROWS), ns, B * nKV), _FAST_THREADS,
                 args + rt, smem),
                ("attn_combine_fast", (M, nH, d // 32), 8 * lanes,
                 comb + rt + [ptr(out_records), i32(records_order), ptr(fm), ptr(fs), ptr(fw), ptr(fg), ptr(fx),
                              ptr(fa), i32(fld), i32(fn), i32(fh)], 0)]
    # with few splits one combine block covers all d columns
    combine = ("attn_combine", (M, nH, d // 32 if ns > 4 else 1), 8 * lanes, comb, 0)
    if exact:
        return [(f"attn_decode_{cache.dtype}_d{d}", (-(-(T * G) // _Q_ROWS), ns, B * nKV), 32, args, 0), combine]
    if prefill_wgmma(k, d, cache.dtype):  # one split (every long prompt chunk): merged and gated in the kernel
        name, smem = f"attn_prefill_wgmma_int8_d{d}", _prefill_wgmma_smem(d)
        k.opt_in_smem(name, smem)
        fused = [ptr(gate), i32(ld_gate), ptr(out)] if ns == 1 else [ptr(0), i32(0), ptr(0)]
        launch = (name, (-(-(T * G) // _WG_ROWS), ns, B * nKV), _WG_THREADS, args + fused, smem)
        return [launch] if ns == 1 else [launch, combine]
    name, smem, warps = f"attn_prefill_{cache.dtype}_d{d}", _prefill_smem(d, cache.dtype), _prefill_warps(cache.dtype)
    k.opt_in_smem(name, smem)
    return [(name, (-(-(T * G) // (_Q_ROWS * warps)), ns, B * nKV), 32 * warps, args, smem), combine]


# v72: the router fold on the attention layers (router_fold.py; deltanet.step's on the DeltaNet ones)
FOLD_THREADS = 256  # attn_combine_fast's block with a fold: thread e sums logit e, the last warp also logit 256


def fold_fits(k, cache: KVCache, *, nH: int, H: int, n: int, T: int = 1) -> bool:
    """Whether a decode of T tokens a sequence can add a router fold of n logits (decode's fold): the CUDA-core
    path, whose combine runs nH·d/32 blocks of FOLD_THREADS a row, each summing 32 values of out and at most 16
    elements of x."""
    return (bool(_fast_path(k, T * (nH // cache.nKV), cache.d, cache.dtype)) and n <= FOLD_THREADS + 1
            and H <= 16 * nH * cache.d // 32)


def prefill_wgmma(k, d: int, dtype: str) -> bool:
    """Whether prefill's tensor-core path takes attn_prefill_wgmma_int8_d{d}: an int8 cache, a head dim it is
    built for, and a GPU running the sm_90a cubin (the kernel exists only there)."""
    return _PREFILL_WGMMA and dtype == "int8" and d in _WG_HEAD_DIMS and wgmma_available(k)


def _prefill_wgmma_smem(d: int) -> int:
    """Dynamic shared memory of attn_prefill_wgmma_int8_d{d}: WgGeo<d>::SMEM of attention_prefill_wgmma.cu.

    1024 bytes of alignment slack | q (128 rows of bf16) | K (64 keys of bf16) | Vᵀ (d rows of 64 bf16 keys) | raw
    int8 K and V of two steps (64 rows of d bytes each) | their fp32 scales | the scales in use (2 × 64 fp32).
    """
    return 1024 + 128 * 2 * d + 64 * 2 * d + d * 128 + 2 * 2 * 64 * d + 2 * 2 * 64 * 4 + 2 * 64 * 4


def _prefill_warps(dtype: str) -> int:
    """Warps per attn_prefill block (PrefillGeo::PF_WARPS), 16 query rows each, sharing every K/V tile: 8 for an
    int8 cache, whose tiles the block converts to bf16, 4 for bf16 (8 would not fit ~99 KB at d = 256)."""
    return 8 if dtype == "int8" else 4


def _prefill_smem(d: int, dtype: str) -> int:
    """Dynamic shared memory of attn_prefill_{dtype}_d{d}: PrefillGeo<d, int8>::SMEM of attention_prefill.cu.

    q (warps x 16 rows of bf16, row stride 2d + 64 bytes) | K and V bf16 tiles (16 rows of 2d bytes; two stages for a
    bf16 cache) | int8: raw K and V tiles (16 rows of d bytes) and 64 fp32 scales.
    """
    q = _prefill_warps(dtype) * 16 * (2 * d + 64)
    if dtype == "int8":
        return q + 2 * 16 * 2 * d + 2 * 16 * d + 64 * 4
    return q + 2 * 2 * 16 * 2 * d


def _fast_smem(d: int, dtype: str) -> int:
    """Dynamic shared memory of attn_decode_fast_{dtype}_d{d}: FastGeo<d, int8>::SMEM of attention_decode.cu.

    q (8 rows fp32) | 4 warps x NS stages x (8 K rows + 8 V rows) | p (4 x 8 x 8 fp32) | scales (4 x NS x 16 fp32)
    | (max, sum) (4 x 8 float2), NS = clamp(20480 // (16 · row bytes), 2, 5).
    """
    rb = d * _ELEM[dtype]
    ns = min(5, max(2, 20480 // (16 * rb)))
    return 8 * d * 4 + 4 * ns * 16 * rb + 4 * 8 * 8 * 4 + 4 * ns * 16 * 4 + 4 * 8 * 8


def _fast_path(k, rows: int, d: int, dtype: str) -> int:
    """The CUDA-core decode's dynamic shared memory when it takes these `rows` query rows per kv head (opting its
    kernel in above 48 KiB once per Kernels object), or 0 for the tensor-core path."""
    if rows > _FAST_MAX_ROWS:
        return 0
    smem = _fast_smem(d, dtype)
    if smem > k.gpu.info.max_smem_per_block_optin:
        return 0
    k.opt_in_smem(f"attn_decode_fast_{dtype}_d{d}", smem)
    return smem


# ------------------------------------------------------------------------------------------ prefill

def prefill_scratch_bytes(T: int, nH: int, d: int, ctx_bucket: int) -> int:
    """Scratch bytes prefill needs for T tokens of one sequence (see decode_scratch_bytes)."""
    return decode_scratch_bytes(T, nH, d, ctx_bucket)


def prefill(k, *, q: int, gate: int, ld_gate: int, pos: int, slot: int, T: int, nH: int, cache: KVCache,
            out: int, scratch: int, ctx_bucket: int, stream=None) -> None:
    """decode() for one sequence (B = 1) of T tokens, e.g. a prompt chunk: same arguments, and the same result
    up to bf16 rounding.

    Where decode would take the tensor-core kernels (more than _FAST_MAX_ROWS rows per kv head), prefill takes
    attn_prefill_*: the same splits and fragments in blocks of _prefill_warps warps sharing each K/V tile, with q
    and the softmax weights p rounded to bf16 (one term, not three), as flash-attention kernels do; each output is
    then within 2^-8 (bf16's unit roundoff) of its Σ p|v| scale of the result on bf16 q.
    Fewer rows run decode's exact CUDA-core kernels.
    """
    _launch(k, _decode_launches(k, q=q, gate=gate, ld_gate=ld_gate, pos=pos, slot=slot, B=1, T=T, nH=nH,
                                cache=cache, out=out, scratch=scratch, ctx_bucket=ctx_bucket, exact=False), stream)
