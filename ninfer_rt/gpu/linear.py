"""Decode GEMV and embedding gather (kernels/gemv.cu): launch shapes, argument checks, the M > 8 chunk loop.

`gemv` computes y = W x̂ for up to 8 activation rows per launch, reading the weights once for all rows, with an
optional fused zero-centred RMSNorm on x, a per-row output scale, a residual add or a SwiGLU epilogue. Up to 4
rows (the decode of one sequence, or a batched step of up to 4) with all of x̂ in one slab run the persistent
stream kernels (plan_stream), all else the block kernels (plan_gemv). `embed` gathers decoded weight rows.
Weights stay in the artifact's byte layout (a DeviceWeight); activations are fp32 in memory. Quantized weights
meet x̂ as int16 codes per 32-element chunk (kernels/gemv.cu "Arithmetic"; reference:
ninfer_rt.reference.ops.act_codes16), bf16 weights fp32 x̂.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ninfer_rt.formats import round_up
from ninfer_rt.gpu.driver import GpuError, f32, i32, ptr
from ninfer_rt.gpu.weights import DeviceWeight

MODES = {"store": 0, "add": 1, "swiglu": 2}
MAX_M = 8  # activation rows per launch; more are done in chunks of 8
ARGMAX_BYTES = 9 * 8  # a block GEMV's arg-max epilogue: a uint64 key a row, then its ticket (gemv.cu argmax_publish)

_THREADS = 256  # 8 warps per block
_WARPS = 8
_ROWS = 4  # weight rows per warp
# bytes of x̂ slab per block: under the 48 KB default with the kernels' static shared memory (1.25 KB; the block
# kernels' 1.33 KB with the arg-max epilogue's keys)
_X_SMEM = 46 * 1024
_BLOCKS_PER_SM = {1: 4}  # the kernels' launch bounds (registers); 2 for M >= 2
_STREAM_BLOCKS_PER_SM = 2  # the M = 1 stream kernels' launch bounds (128 registers: two register tiles)
_STREAM_STEPS_FOR_2 = 2  # steps per warp at which a stream GEMV takes the second block per SM (perf-history.md v13)
_STREAM_DEPTH = {4: 2, 5: 1, 6: 1, 8: 2, 16: 2}  # kernels/gemv_stream.cu StreamDepth at M = 1: most units per lane
# and row (M > 1: 1)
_STREAM_MAX_M = 4  # the stream kernels for several rows: gemv_*_s2 .. _s4 (a batched decode step)
# their x̂ slab may take more shared memory (opted in), two blocks an SM still fitting: the 27B's down (K = 17408)
# at M = 2 is 78 KB of records
_STREAM_ROWS_SMEM = 100 * 1024
# x̂ records of 2-4 rows (gemv_q8_s{2,3,4}r, out_proj and o_proj of a batched step) are built for q8 weights only
_RECORDS_ROWS_BITS = (8,)
RECORDS_MAX_M = _STREAM_MAX_M  # the most rows x_records takes (engine.py sizes its records buffer by it)
# Planner constants: the row counts at which the engine has the DeltaNet step and the attention combine write x̂
# records for out_proj / o_proj, in a step of B sequences of one token (ROWS) and in one sequence's verification of T
# tokens (TOKENS). Batched: 2 and 3 rows gain 3.5% and 4.1% since v88-v89's steps of clusters of 1-2 (v91; in v83c,
# over clusters of 4, 2 rows lost 3.4%). Verification (clusters of 4): 2 tokens lose 4.5%, 3 gain 0.4%, 4 gain 4.6%.
RECORDS_ROWS = (1, 2, 3, 4)
RECORDS_TOKENS = (3, 4)
# at M = 1, weights of at least this many rows (lm_head) take the block kernel (perf-history.md v11); several rows
# stream at any N (the 35B's B = 2 / 4 steps -0.3% / -0.9%, the 27B's B = 2 -0.25%: perf.md v83)
_STREAM_BLOCK_ROWS = 65536
# at M = 1, longer K takes the block kernel; no limit below the slab's (perf-history.md v11 A/B)
_STREAM_K_MAX = 1 << 30
# at M = 1, K past this (one pass of the register staging) copies x (and norm_w) into shared memory by cp.async, one
# L2 round trip, where it fits beside the plan's blocks per SM; shorter K stages from registers (perf-history.md v26)
_STREAM_X_COPY_ABOVE = 4096
# on sm_90+ the copies are bulk copies by the copy engine instead (gemv_*_s1b), at K past this: their requests do not
# wait behind the weight loads in flight for the SM's miss slots, so they pay at every K (perf-history.md v33)
_STREAM_X_BULK = True
_STREAM_X_BULK_ABOVE = 0
# ... except at K up to this, where sm_90+ copies x by cp.async (the 35B -1.1 to -1.6% at 0-262K; past it the 27B
# loses 8.6% by cp.async), once the kernels stopped asking L2 for x before their wait (perf-history.md v60)
_STREAM_X_ASYNC_UPTO = 4096
# at M = 1, a dense SwiGLU's gate/up writes the down's x̂ chunk records as its blocks finish them (y_records), so
# the down copies them instead of coding K = intermediate elements in every block (perf-history.md v42)
SWIGLU_OUT_RECORDS = True
_EMBED_THREADS = 128
_MAX_GRID_Y = 65535


@dataclass(frozen=True)
class GemvPlan:
    """One launch of a gemv kernel: entry point, grid, K split across warps, x̂ slab and its shared memory.

    The block kernels gemv_*_m{M} launch `grid` blocks, one per block tile (8 >> kw_log2 groups of 4 rows).
    The stream kernels gemv_*_s{m} (d > 0; m = 1.._STREAM_MAX_M rows) launch `blocks` <= grid persistent blocks
    that share the `grid` row groups of 4 rows out in contiguous ranges, streaming d units per lane and row per
    register tile."""

    name: str
    grid: int  # block kernel: block tiles (8 >> kw_log2 row groups of 4 rows each); stream kernel: row groups
    kw_log2: int  # block kernel: 1 << kw_log2 warps of a block share one group of 4 rows, splitting K (stream: 0)
    ks: int  # x̂ slab length (elements of K per shared-memory stage)
    smem: int  # dynamic shared memory bytes
    gshift: int  # log2 of the quantization group (5 for bf16, unused)
    d: int = 0  # stream kernel: 16-byte units per lane and row in one register tile; 0: a block kernel
    blocks: int = 0  # blocks launched: `grid` for a block kernel, at most `grid` for a stream kernel
    m: int = 1  # activation rows of the launch

    @property
    def stream(self) -> bool:
        return self.d > 0

    @property
    def launch_blocks(self) -> int:
        return self.blocks or self.grid


def _code(w: DeviceWeight) -> tuple[str, int, int]:
    """(entry prefix, bits, elements per 16-byte unit) of a weight the GEMV kernels read."""
    if w.fmt == "bf16":
        return "bf16", 16, 8
    if w.quantized and w.bits in (4, 5, 6, 8):
        return f"q{w.bits}", w.bits, 16 if w.bits == 8 else 32
    raise GpuError(f"{w.name}: format {w.fmt} has no GEMV kernel (quantized q*g* or bf16 only)")


def x_chunk_bytes(m: int, quantized: bool) -> int:
    """Shared-memory bytes per 32-element chunk of the staged x̂ for m rows: int16 codes plus (d, Σq) per row,
    padded to an odd number of 16-byte units (kernels/xcodes.cuh qchunk_bytes; the MoE fast paths stage m = 1
    records too), or 36 fp32 per row (kernels/gemv.cuh chunk_stride)."""
    if quantized:
        units = (72 * m + 15) // 16
        return 16 * (units if units % 2 else units + 1)
    return 4 * (36 * m + (4 if m % 2 == 0 else 0))


def _check_matrix(w: DeviceWeight, what: str) -> tuple[int, int]:
    if not isinstance(w, DeviceWeight):
        raise GpuError(f"{what}: expected a DeviceWeight, got {type(w).__name__}")
    if len(w.shape) != 2:
        raise GpuError(f"{w.name}: {what} needs a 2-D weight [N, K], got shape {list(w.shape)}")
    n, k = w.shape
    if n < 1 or k < 32 or k % 32:
        raise GpuError(f"{w.name}: {what} needs N >= 1 and K a multiple of 32, got [{n}, {k}]")
    return n, k


def plan_gemv(w: DeviceWeight, m: int, sm_count: int, *, kw_log2: int | None = None,
              ks: int | None = None, stream: bool | None = None, d: int | None = None,
              blocks: int | None = None) -> GemvPlan:
    """The launch for M = m (1..8) rows: rows in groups of 4 per warp, warps per group (KW) chosen so the grid
    fills one wave of resident blocks (a short N with a long K splits K instead), x̂ slabs under 46 KB of equal
    length, in whole warp sweeps where possible. kw_log2 / ks override the choice (tests cover every split).

    At m <= _STREAM_MAX_M with all of x̂ in one slab (K <= _stream_k_cap), fewer than _STREAM_BLOCK_ROWS rows at m = 1
    and no ks given, the plan is a stream kernel's instead (plan_stream; on the int16-x̂ kernels the block kernel is
    faster only on the lm_head at m = 1, perf-history.md v11; at m = 2 the block kernels ran at half the stream kernel's
    rate, v81, and the lm_head too streams faster, v83); stream=False keeps the block kernel, stream=True insists on the
    stream kernel; d and blocks override the stream plan's choices (tests and the benchmark's sweep)."""
    prefix, bits, eu = _code(w)
    n, k = w.shape
    if not 1 <= m <= MAX_M:
        raise GpuError(f"gemv plans 1..{MAX_M} rows per launch, got {m}")
    if stream is None:
        stream = (m <= _STREAM_MAX_M and ks is None and kw_log2 is None and k <= min(_STREAM_K_MAX, _stream_k_cap(w, m))
                  and (n < _STREAM_BLOCK_ROWS or m > 1))
    if stream:
        if m > _STREAM_MAX_M or ks is not None or kw_log2 is not None or k > _stream_k_cap(w, m):
            raise GpuError(f"{w.name}: the stream gemv needs M <= {_STREAM_MAX_M}, no slab or K-split override and "
                           f"K <= {_stream_k_cap(w, min(m, _STREAM_MAX_M))}, got M = {m}, K = {k}, ks = {ks}, "
                           f"kw_log2 = {kw_log2}")
        return plan_stream(w, sm_count, m=m, d=d, blocks=blocks)
    if d is not None or blocks is not None:
        raise GpuError(f"{w.name}: d and blocks are stream-plan overrides (M <= {_STREAM_MAX_M}, K <= "
                       f"{_stream_k_cap(w, min(m, _STREAM_MAX_M))})")
    cs4 = x_chunk_bytes(m, w.quantized)
    ks_max = (_X_SMEM // cs4) * 32 // 256 * 256
    if ks is None:
        ks = k
        if k > ks_max:
            want = math.ceil(k / math.ceil(k / ks_max))  # equal slabs
            sweep = 32 * eu  # elements one warp covers per step
            ks = round_up(want, sweep)
            if ks > ks_max:
                ks = round_up(want, 256)
    elif ks % 32 or not 32 <= ks <= ks_max:
        raise GpuError(f"gemv slab length must be a multiple of 32 in [32, {ks_max}] at M = {m}, got {ks}")
    ks = min(ks, k)
    groups = math.ceil(n / _ROWS)
    if kw_log2 is None:
        units = k // eu  # 16-byte units along one row
        slots = max(1, sm_count) * _BLOCKS_PER_SM.get(m, 2)
        kw = 1
        while kw < _WARPS and math.ceil(groups * kw / _WARPS) < slots and units >= 32 * 2 * kw:
            kw *= 2
        kw_log2 = kw.bit_length() - 1
    elif not 0 <= kw_log2 <= 3:
        raise GpuError(f"gemv kw_log2 must be 0..3, got {kw_log2}")
    return GemvPlan(name=f"gemv_{prefix}_m{m}", grid=math.ceil(groups * (1 << kw_log2) / _WARPS), kw_log2=kw_log2,
                    ks=ks, smem=(ks // 32) * cs4, gshift=int(math.log2(w.group)) if w.quantized else 5)


def _stream_k_cap(w: DeviceWeight, m: int = 1) -> int:
    """The longest K a stream kernel of m rows can take: all of x̂ in its slab, 46 KB at m = 1 (10240 for bf16
    weights' fp32 x̂, 18688 for quantized ones' int16 codes), _STREAM_ROWS_SMEM for more rows."""
    slab = _X_SMEM if m == 1 else _STREAM_ROWS_SMEM
    return (slab // x_chunk_bytes(m, w.quantized)) * 32 // 256 * 256


def plan_stream(w: DeviceWeight, sm_count: int, *, m: int = 1, d: int | None = None,
                blocks: int | None = None) -> GemvPlan:
    """The stream kernel's launch for m rows (kernels/gemv_stream.cu gemv_*_s{m}). Each block takes a contiguous range
    of row groups whose steps (d units per lane and row) its 8 warps split evenly, so the split is balanced to
    a step whatever the shape. d = the format's deepest register tile (most bytes in flight per warp) unless
    one step of it would leave lanes without a unit on every row (K < 32·d units), then 1.
    Blocks: every block stages all of x̂, and two blocks on one SM stage it twice there, so the second block
    per SM is taken only when it still leaves each warp _STREAM_STEPS_FOR_2 steps; else at most one block per
    SM, and no more blocks than give every warp one step (the H200 sweep, perf-history.md v13: the 35B o_proj 5.5 ->
    4.5 µs at one block per SM, its q|k|v|gate 10.6 -> 8.2 µs at two)."""
    prefix, bits, eu = _code(w)
    n, k = w.shape
    if not 1 <= m <= _STREAM_MAX_M:
        raise GpuError(f"{w.name}: the stream gemv takes 1..{_STREAM_MAX_M} rows, got {m}")
    if k > _stream_k_cap(w, m):
        raise GpuError(f"{w.name}: the stream gemv stages all of K in shared memory, K <= {_stream_k_cap(w, m)} "
                       f"at M = {m}")
    nu = k // eu  # 16-byte units along a row that hold the K elements
    groups = math.ceil(n / _ROWS)
    dmax = _STREAM_DEPTH[bits] if m == 1 else 1
    if d is None:
        d = dmax if 32 * dmax <= nu else 1
    elif not 1 <= d <= dmax:
        raise GpuError(f"{w.name}: stream gemv d must be 1..{dmax} for {w.fmt}, got {d}")
    if blocks is None:
        sms = max(1, sm_count)
        steps = groups * -(-nu // (32 * d))  # in all: row groups x steps per group
        per_sm = _STREAM_BLOCKS_PER_SM if steps >= _STREAM_STEPS_FOR_2 * _WARPS * _STREAM_BLOCKS_PER_SM * sms else 1
        blocks = max(1, min(per_sm * sms, -(-steps // _WARPS)))
    elif blocks < 1:
        raise GpuError(f"stream gemv blocks must be >= 1, got {blocks}")
    return GemvPlan(name=f"gemv_{prefix}_s{m}", grid=groups, kw_log2=0, ks=k,
                    smem=(k // 32) * x_chunk_bytes(m, w.quantized),
                    gshift=int(math.log2(w.group)) if w.quantized else 5, d=d, blocks=min(blocks, groups), m=m)


def argmax_fits(k, w: DeviceWeight, M: int) -> bool:
    """Whether gemv of M rows on w runs one block-kernel launch, which can also take its rows' arg-max
    (gemv's argmax; the lm_head at one row: the stream kernels have no such epilogue)."""
    return 1 <= M <= MAX_M and not plan_gemv(w, M, k.gpu.info.sm_count).stream


def records_order(w: DeviceWeight) -> int:
    """The order of x̂'s codes in a chunk record for this quantized weight (kernels/xcodes.cuh XQ): 1 natural
    (q8), 2 each 8-block's even then odd elements (the nibble formats' low and high nibbles)."""
    return 1 if w.bits == 8 else 2


def records_rows(B: int, T: int) -> bool:
    """Whether the planner has a step of B sequences of T tokens write x̂ records for out_proj / o_proj
    (RECORDS_ROWS at one token a sequence, else RECORDS_TOKENS); records_fit says whether the kernels can."""
    return B * T in (RECORDS_ROWS if T == 1 else RECORDS_TOKENS)


def records_fit(k, w: DeviceWeight, m: int = 1) -> bool:
    """Whether `gemv` takes this weight's x as chunk records of m rows (x_records) on this GPU: quantized codes, a
    stream plan of m rows (K in one slab; at m = 1 fewer than _STREAM_BLOCK_ROWS rows) and the bulk-copy kernel
    (sm_90+; the tested one: gemv_*_s{m}r built for older GPUs copies by cp.async, and no test reaches that path on
    the H200); m > 1 only for the formats with such kernels (_RECORDS_ROWS_BITS)."""
    return (k.gpu.info.major >= 9 and w.quantized and (m == 1 or w.bits in _RECORDS_ROWS_BITS)
            and 1 <= m <= RECORDS_MAX_M and plan_gemv(w, m, k.gpu.info.sm_count).stream)


def y_records_fit(k, w: DeviceWeight) -> bool:
    """Whether a swiglu `gemv` of this gate/up weight at M = 1 can also write its output as chunk records
    (y_records): a quantized weight with a stream plan on sm_90+ (where records are read), N % 64 == 0 (whole
    chunks of 32 outputs) and the bulk-copy staging that gemv_*_s1bw is built on."""
    return records_fit(k, w) and w.shape[0] % 64 == 0 and _STREAM_X_BULK


def gemv(k, w: DeviceWeight, *, x: int, M: int, y: int, ldx: int | None = None, ldy: int | None = None,
         mode: str = "store", norm_w: int = 0, norm_eps: float = 1e-6, row_scale: int = 0, stream=None,
         x_records: bool = False, y_records: tuple[int, int, int, int, int] | None = None,
         argmax: tuple[int, int, int] | None = None) -> None:
    """y = s_m · W x̂ for M activation rows (device pointers; fp32 row-major).

    w: [N, K] weight, q{4,5,6,8}g{32,64,128} or bf16, K % 32 == 0. x: fp32 [M, ldx] (K columns read; ldx
    defaults to K). norm_w != 0 (fp32 [K]) applies x̂ = x · rsqrt(mean(x²) + norm_eps) · (1 + norm_w), else x̂ = x.
    row_scale != 0 (fp32 [M]) scales output row m by row_scale[m]. mode "store": y[m, :N] = ...; "add":
    y[m, :N] += ...; "swiglu": W's rows are gate/up tiles of 16 and y[m, j] = silu(gate_j·x̂)·(up_j·x̂) for
    j < N/2 (row_scale ignored). ldy defaults to N (N/2 for swiglu). y must not overlap x. M > 8 runs in chunks
    of 8 rows (weights re-read per chunk).
    x_records: x is x̂ itself, K/32 int16 chunk records of all M rows in this weight's order
    (reference.ops.act_records16 of x [M, K], 16-byte aligned), as a producer kernel wrote them (the DeltaNet step
    for out_proj, the attention combine for o_proj): no norm, and a weight records_fit takes at M; the kernel
    copies them instead of coding x (gemv_*_s{M}r), the same y to the bit.
    y_records (records, pairs, counters, order, parity), swiglu only: y's N/64 chunks as chunk records instead of y
    (y is not written), in XQ order `order` (the down projection's records_order) at `records` (16-byte aligned,
    N/64 · 80 bytes), each coded by a block that finds the chunk's values published as (value, 1) pairs in `pairs`
    (uint64 [N/2], 8-byte aligned, zero before the launch and left zero: zero them once); `counters` (uint32
    [2, N/64], zero once) settle which block codes a chunk whose pairs none found complete at first; consecutive
    launches on the same buffers alternate `parity` (0, 1): each zeroes the other's counters. M = 1, a weight
    y_records_fit takes (gemv_*_s1bw). The down then reads the records with x_records, the same y to the bit.
    argmax (amax, out, V), mode store where argmax_fits: also out int32 [M] = misc.argmax of y's rows over columns
    < V, by the launch itself (amax: ARGMAX_BYTES of device memory, zero before the first launch and left zero).
    """
    n, kk = _check_matrix(w, "gemv")
    eu = _code(w)[2]  # the format has a kernel
    if mode not in MODES:
        raise GpuError(f"{w.name}: gemv mode must be one of {', '.join(MODES)}, got {mode!r}")
    n_out = n // 2 if mode == "swiglu" else n
    if mode == "swiglu" and n % 32:
        raise GpuError(f"{w.name}: swiglu needs gate/up tiles of 16 (N % 32 == 0), got N = {n}")
    ldx = kk if ldx is None else int(ldx)
    ldy = n_out if ldy is None else int(ldy)
    M = int(M)
    if M < 0:
        raise GpuError(f"{w.name}: gemv needs M >= 0, got {M}")
    if ldx < kk or ldy < n_out:
        raise GpuError(f"{w.name}: gemv needs ldx >= K = {kk} and ldy >= {n_out}, got ldx {ldx}, ldy {ldy}")
    if ldx >= 2**31 or ldy >= 2**31:
        raise GpuError(f"{w.name}: gemv row strides must be < 2^31 elements, got ldx {ldx}, ldy {ldy}")
    if not x or not y:
        raise GpuError(f"{w.name}: gemv needs device pointers x and y, got x={x:#x}, y={y:#x}")
    if n * (w.kp // eu) >= 2**31:
        raise GpuError(f"{w.name}: {n} rows of {w.kp} are too many for the kernel's 32-bit unit offsets")
    if M == 0:
        return
    sm_count = k.gpu.info.sm_count
    if x_records:
        if norm_w or x % 16 or not records_fit(k, w, M):
            raise GpuError(f"{w.name}: gemv x_records needs M = 1 (2-{_STREAM_MAX_M} for q8 weights), no norm, a "
                           f"16-byte aligned x and a quantized weight with a stream plan on sm_90+; got M = {M}, "
                           f"norm_w={norm_w:#x}, x={x:#x}, {w.fmt}, compute capability {k.gpu.info.major}.x")
        _launch_gemv(k, w, plan_gemv(w, M, sm_count), x=x, y=y, ldx=kk, ldy=ldy, mode=mode, norm_w=0,
                     norm_eps=norm_eps, row_scale=row_scale, stream=stream, x_records=True)
        return
    if y_records is not None:
        rec, pairs, cnt, order, parity = y_records
        if (mode != "swiglu" or M != 1 or not y_records_fit(k, w) or rec % 16 or pairs % 8 or cnt % 4
                or order not in (1, 2) or parity not in (0, 1)):
            raise GpuError(f"{w.name}: gemv y_records needs mode swiglu, M = 1, a quantized weight with N % 64 == 0 "
                           f"and a stream plan on sm_90+, 16-byte aligned records, 8-byte aligned pairs, aligned "
                           f"counters, order 1 or 2, parity 0 or 1; got {mode}, M = {M}, N = {n}, {w.fmt}, "
                           f"compute capability {k.gpu.info.major}.x, records={rec:#x}, pairs={pairs:#x}, "
                           f"counters={cnt:#x}, order {order}, parity {parity}")
        _launch_gemv(k, w, plan_gemv(w, 1, sm_count), x=x, y=y, ldx=ldx, ldy=ldy, mode=mode, norm_w=norm_w,
                     norm_eps=norm_eps, row_scale=0, stream=stream, x_bulk=True, y_records=y_records)
        return
    if argmax is not None:
        amax, out, vocab = argmax
        if mode != "store" or not argmax_fits(k, w, M) or not amax or amax % 8 or not out or not 1 <= vocab <= n:
            raise GpuError(f"{w.name}: gemv argmax needs mode store, 1..{MAX_M} rows on a block plan (argmax_fits), "
                           f"an 8-byte aligned key buffer, an out pointer and 1 <= V <= N = {n}; got {mode}, M = {M}, "
                           f"amax={amax:#x}, out={out:#x}, V = {vocab}")
        _launch_gemv(k, w, plan_gemv(w, M, sm_count), x=x, y=y, ldx=ldx, ldy=ldy, mode=mode, norm_w=norm_w,
                     norm_eps=norm_eps, row_scale=row_scale, stream=stream, argmax=argmax)
        return
    for m0 in range(0, M, MAX_M):
        mc = min(MAX_M, M - m0)
        _launch_gemv(k, w, plan_gemv(w, mc, sm_count), x=x + 4 * m0 * ldx, y=y + 4 * m0 * ldy, ldx=ldx,
                     ldy=ldy, mode=mode, norm_w=norm_w, norm_eps=norm_eps,
                     row_scale=row_scale + 4 * m0 if row_scale else 0, stream=stream)


def _launch_gemv(k, w: DeviceWeight, plan: GemvPlan, *, x: int, y: int, ldx: int, ldy: int, mode: str,
                 norm_w: int, norm_eps: float, row_scale: int, stream=None, x_copy: bool | None = None,
                 x_bulk: bool | None = None, x_records: bool = False,
                 y_records: tuple[int, int, int, int, int] | None = None,
                 argmax: tuple[int, int, int] | None = None) -> None:
    """One launch of an already checked plan (tests call it with a forced kw_log2 to cover every K split, and
    with x_copy True / False to force a stream kernel's copy of x on / off where it would fit, and x_bulk to
    force that copy's kind: bulk copies (sm_90+ only) or cp.async; None: _STREAM_X_BULK past K =
    _STREAM_X_ASYNC_UPTO, cp.async up to it). x_records: x is the K/32 chunk records gemv checked, copied into the
    slab by gemv_*_s{m}r. y_records: gemv's checked (records, pairs, counters, order, parity), written by
    gemv_*_s1bw (the _s1b body: its xvec picks the staging)."""
    n, kk = w.shape
    qs, qh, sc = w.planes()
    # float4 staging of x needs 16-byte aligned rows (and norm weight); otherwise the kernel reads scalars
    xvec = 1 if x % 16 == 0 and ldx % 4 == 0 and norm_w % 16 == 0 else 0
    smem, name = plan.smem, plan.name
    one = plan.stream and plan.m == 1  # the M = 1 stream kernels' own ways of staging x (many rows: registers)
    bulk = one and (_STREAM_X_BULK if x_bulk is None else x_bulk) and k.gpu.info.major >= 9
    above = _STREAM_X_BULK_ABOVE if bulk else _STREAM_X_COPY_ABOVE
    if bulk and x_bulk is None and kk <= _STREAM_X_ASYNC_UPTO:
        bulk, above = False, 0  # a short K on sm_90+: the cp.async copy (y_records asks for bulk: _s1bw has no other)
    if x_records:  # the records' copy completes on an mbarrier after the slab
        xvec, smem, name = 2, smem + 16, name + "r"
    elif one and xvec and (kk > above if x_copy is None else x_copy):
        extra = _stream_x_copy_bytes(k.gpu.info, plan, kk, bool(norm_w), bulk)
        if extra:  # x (and norm_w) through shared memory by cp.async or bulk copies (gemv_stream.cu stage_m1_smem)
            xvec, smem, name = 2, smem + extra, name + ("b" if bulk else "")
    if y_records is not None:
        name = plan.name + "bw"
    elif one and mode == "swiglu" and not x_records:
        name += "s"  # swiglu at M = 1 streams through a kernel of its own, _s1s / _s1bs (perf-history.md v59)
    if smem != plan.smem or name != plan.name or smem > _X_SMEM:
        k.opt_in_smem(name, smem)
    args = [ptr(qs), ptr(qh), ptr(sc), ptr(x), ptr(y), ptr(norm_w), ptr(row_scale), i32(n), i32(kk), i32(w.kp),
            i32(plan.gshift), i32(ldx), i32(ldy), i32(MODES[mode]), f32(norm_eps), i32(plan.kw_log2),
            i32(plan.ks), i32(xvec)]
    if plan.stream:
        args.append(i32(plan.d))
    else:  # the block kernels' arg-max epilogue (gemv's argmax), off with a null key buffer
        amax, out, vocab = argmax or (0, 0, 0)
        args += [ptr(amax), ptr(out), i32(vocab)]
    if y_records is not None:
        rec, pairs, cnt, order, parity = y_records
        args += [ptr(rec), ptr(pairs), ptr(cnt), i32(order | parity << 2)]
    k.launch(name, (plan.launch_blocks,), (_THREADS,), args, smem, stream)


def _stream_x_copy_bytes(info, plan: GemvPlan, k: int, norm: bool, bulk: bool = False) -> int:
    """Shared memory for a stream GEMV's fp32 copies of x (and norm_w), K floats each (bulk: and their 16-byte
    mbarrier), when they fit beside the slab without costing the plan its blocks per SM (the SM's shared memory
    less 1 KiB reserved and 1 KiB of static per block); else 0, and the kernel stages x̂ from registers."""
    extra = 4 * k * (2 if norm else 1) + (16 if bulk else 0)
    per_sm = -(-plan.blocks // max(1, info.sm_count))
    budget = min(info.max_smem_per_block_optin, info.max_smem_per_sm // per_sm - 2048)  # 0 when unknown
    return extra if plan.smem + extra <= budget else 0


def embed(k, w: DeviceWeight, *, ids: int, M: int, out: int, stream=None) -> None:
    """out[m, :] = row ids[m] of w [V, K], decoded exactly to fp32 (ids: int32 [M] device array; out: fp32
    [M, K]). Any quantized format or bf16, K % 32 == 0. An id outside [0, V) gives a row of NaN."""
    v, kk = _check_matrix(w, "embed")
    if not (w.fmt == "bf16" or (w.quantized and w.bits in (4, 5, 6, 8))):
        raise GpuError(f"{w.name}: format {w.fmt} has no embed kernel (quantized q*g* or bf16 only)")
    M = int(M)
    if M < 0:
        raise GpuError(f"{w.name}: embed needs M >= 0, got {M}")
    if not ids or not out:
        raise GpuError(f"{w.name}: embed needs device pointers ids and out, got ids={ids:#x}, out={out:#x}")
    qs, qh, sc = w.planes()
    gx = math.ceil(kk // 32 / _EMBED_THREADS)
    for m0 in range(0, M, _MAX_GRID_Y):
        mc = min(_MAX_GRID_Y, M - m0)
        args = [ptr(qs), ptr(qh), ptr(sc), ptr(ids + 4 * m0), ptr(out + 4 * m0 * kk), i32(v), i32(kk), i32(w.kp)]
        k.launch(f"embed_{w.fmt}", (gx, mc), (_EMBED_THREADS,), args, 0, stream)
