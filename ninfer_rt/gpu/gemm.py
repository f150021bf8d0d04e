"""Launch wrappers of kernels/gemm.cu: the tensor-core GEMM for prefill (many rows), every weight format.

`gemm` has the semantics of `linear.gemv` (the decode path, M <= 8), so the engine switches between them by M:

    store   y[m, n]  = s_m · Σ_k W[n, k] x[m, k]
    add     y[m, n] += s_m · Σ_k W[n, k] x[m, k]
    swiglu  y[m, j]  = silu(gate_j · x_m) · (up_j · x_m),  j < N/2, on W's rows interleaved in tiles of 16
            (rows 32t..32t+15 gate rows 16t.., rows 32t+16..32t+31 up rows 16t..; row_scale ignored)

with s_m = row_scale[m] (fp32 [M]) when given, else 1. W is a DeviceWeight [N, K] in one of the 12 integer
formats or bf16; x bf16 [M, ldx] (only its first K columns are read; misc.rms_norm(out="bf16") and
misc.cast_bf16 make it), y fp32 [M, ldy], except swiglu: y bf16 [M, ldy], the input of the down projection.

Numerics: x arrives in bf16 (the decode GEMV reads fp32: unit roundoff 2^-8); q8 weights meet the tensor cores
as w = q · s rounded once to bf16 (kernels/gemm.cuh "scaled weights"), as a dequantizing GEMM stores them; the
nibble formats' codes are exact in bf16 and each fp16 group scale multiplies, in fp32, the partial sum of its
32-wide chunk. Sums are fp32; swiglu rounds its output to bf16.

Two kernels compute this (`kernel`, KERNELS): "mma" (kernels/gemm.cu: mma.sync tiles, every GPU), numerics as
above, and "wgmma" (kernels/gemm_wgmma.cu: Hopper's warpgroup MMA fed by TMA copies, sm_90a cubins only), which
takes every quantized format as RN(q · s) in bf16: the nibble formats too, since its MMA accumulates straight into
the registers it keeps. Its A operand comes two ways: decoded into registers each stage ("wgmma"), or, given a
scratch ("wgmma_ss"), dequantized by one pass into a bf16 copy that TMA stages beside x, so the MMAs read both
operands from shared memory and a stage costs each thread a handful of instructions (2x the rate at 8K rows).
"auto" picks wgmma where `wgmma_available`, M >= WGMMA_MIN_ROWS and its tiles fill every SM at least once (14-36%
less time than mma at the 35B's 8K-prefill shapes, perf-history.md v19), and the scratch form from
WGMMA_SS_MIN_ROWS when the caller gave room; below, a tile is mostly empty or SMs idle (the wgmma tile has twice
the weight rows, one block per SM), and mma keeps the nibble codes exact for decode batches.
`moe_grouped` runs the same tiles over expert banks for prefill MoE (below), or, with few tokens per expert,
kernels/moe_gemm.cu's tiles of 32 slots.
"""

from __future__ import annotations

from ninfer_rt.formats import FORMATS, round_up
from ninfer_rt.gpu.driver import GpuError, i32, ptr, tensor_map_2d

# tile constants of kernels/gemm.cu (BN, BM, BK, XS_STRIDE, RID_BYTES, Traits): keep in step
BN = BM = 128
BK = 32
THREADS = 256
XS_STRIDE = BK * 2          # bytes of one staged bf16 x row per k-tile
RID_BYTES = BM * 12
STAGE_BUDGET = 96 * 1024    # Traits::STAGES: as many stages as fit this, at most MAX_STAGES
MAX_STAGES = 8
MODES = {"store": 0, "add": 1, "swiglu": 2}
MODE_ATOMIC_ADD = 3
GRID_Y_MAX = 65535
SUPPORTED = tuple(f for f, v in FORMATS.items() if v.is_quantized) + ("bf16",)
KERNELS = ("auto", "mma", "wgmma", "wgmma_ss")
WGMMA_MIN_ROWS = 128  # "auto" takes wgmma from one full tile of x rows (tokens) up
# "auto" dequantizes a quantized weight into the caller's scratch and runs gemm_wgmma_ss from this many x rows up
# (perf-history.md v23: 1.3-2.0x faster than the register path at 512 rows, the pass included, where wgmma runs)
WGMMA_SS_MIN_ROWS = 512
# gemm_wgmma.cu WT<BITS>: tiles of 256 weight rows × 128 x rows, 512 threads, one block per H100/H200 SM; stages of
# 64 k (x 128 rows × 128 B, then the planes), 1024-byte aligned, as many as fit 200 KB; then mbarriers and row ids
WG_BN, WG_THREADS, WG_STAGE_BUDGET, WG_ALIGN, WG_BAR_BYTES, WG_KSTAGE = 256, 512, 200 * 1024, 1024, 64, 64


def _bits(fmt: str) -> int:
    return 16 if fmt == "bf16" else FORMATS[fmt].bits


def smem_bytes(fmt: str, wgmma: bool = False) -> int:
    """Dynamic shared memory of gemm_<fmt> / moe_gemm_<fmt> (gemm.cu Traits<BITS>::SMEM), or with wgmma of
    gemm_wgmma_<fmt> / moe_gemm_wgmma_<fmt> (gemm_wgmma.cu WT<BITS>::SMEM)."""
    bits = _bits(fmt)
    qs = 64 if bits == 16 else (32 if bits == 8 else 16)   # bytes of a row's 32-wide chunk
    qh = {5: 4, 6: 8}.get(bits, 0)
    scales = 0 if bits == 16 else 4
    if wgmma:
        raw = BM * 2 * WG_KSTAGE + WG_BN * 2 * (qs + qh + scales)
        stage = -(-raw // WG_ALIGN) * WG_ALIGN
        fixed = WG_ALIGN + WG_BAR_BYTES + RID_BYTES
        return fixed + min(MAX_STAGES, (WG_STAGE_BUDGET - fixed) // stage) * stage
    chunks = 2 if bits == 8 else 1  # 32-wide chunks per pipeline stage (Traits::CH)
    stage = chunks * (BM * XS_STRIDE + BN * (qs + qh + scales))
    return RID_BYTES + min(MAX_STAGES, (STAGE_BUDGET - RID_BYTES) // stage) * stage


def ss_smem_bytes() -> int:
    """Dynamic shared memory of gemm_wgmma_ss (gemm_wgmma.cu SS_SMEM): stages of x [128][128 B] + A [256][128 B]."""
    stage = (BM + WG_BN) * 2 * WG_KSTAGE
    fixed = WG_ALIGN + WG_BAR_BYTES + RID_BYTES
    return fixed + (WG_STAGE_BUDGET - fixed) // stage * stage


def _dequant_rows(N: int) -> int:
    """Rows of a dequantized copy: N padded to whole 32-row blocks (gemm_wgmma.cu dq_row permutes within them)."""
    return round_up(int(N), 32)


def dequant_bytes(w) -> int:
    """Scratch bytes `gemm` needs to dequantize the 2-D weight w for gemm_wgmma_ss: bf16 [round_up(N, 32), K]."""
    return _dequant_rows(w.shape[0]) * int(w.shape[1]) * 2


def wgmma_available(k) -> bool:
    """Whether the wgmma tiles run here: a compute capability 9.0 GPU running its own sm_90a cubin."""
    info = k.gpu.info
    return (info.major, info.minor) == (9, 0) and "sm_90a" in k.build.targets


def _use_wgmma(k, kernel: str, M: int, N: int, what: str) -> bool:
    """Whether a launch of M x rows against N weight rows takes the wgmma tiles (kernel: one of KERNELS)."""
    if kernel not in KERNELS:
        raise GpuError(f"{what}: kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    if kernel.startswith("wgmma") and not wgmma_available(k):
        raise GpuError(f"{what}: kernel {kernel!r} needs an H100/H200 (sm_90a); this GPU is {k.gpu.info.arch}")
    if kernel != "auto":
        return kernel.startswith("wgmma")
    tiles = -(-int(N) // WG_BN) * -(-int(M) // BM)
    return M >= WGMMA_MIN_ROWS and wgmma_available(k) and tiles >= k.gpu.info.sm_count


_MAPS: dict[tuple, object] = {}  # TMA descriptors by their encoding arguments (the same arguments, the same bytes)


def _tensor_map(base: int, **kw):
    key = (base, *sorted(kw.items()))
    m = _MAPS.get(key)
    if m is None:
        if len(_MAPS) > 4096:
            _MAPS.clear()
        m = _MAPS[key] = tensor_map_2d(base, **kw)
    return m


def _qs_map(w):
    """TMA descriptor of w's qs plane (bf16 data for bf16 weights) as uint8 [rows, row bytes], box 256 rows × 64 k:
    what gemm_wgmma.cu stages per step. Rows: every row of the plane (all experts of a bank)."""
    rows = w.shape[0] if len(w.shape) == 2 else w.shape[0] * w.shape[1]
    per_k = {16: 2.0, 8: 1.0}.get(_bits(w.fmt), 0.5)  # qs bytes per element: bf16, q8, nibble formats (low 4 bits)
    row_bytes = 2 * w.shape[-1] if w.fmt == "bf16" else int(w.kp * per_k)
    return _tensor_map(w.planes()[0], dtype="u8", inner=row_bytes, rows=rows, row_bytes=row_bytes,
                       box_inner=int(WG_KSTAGE * per_k), box_rows=WG_BN)


def _x_map(x: int, K: int, M: int, ldx: int):
    """TMA descriptor of x as bf16 [M, K], rows ldx apart, box 128 rows × 64 k, 128-byte swizzle (gemm_wgmma.cu)."""
    return _tensor_map(x, dtype="bf16", inner=K, rows=M, row_bytes=2 * ldx, box_inner=WG_KSTAGE, box_rows=BM,
                       swizzle_128b=True)


def _check_weight(w, what: str) -> None:
    if w.fmt not in SUPPORTED:
        raise GpuError(f"{what}: weight {w.name!r} is {w.fmt}; the GEMM reads {', '.join(SUPPORTED)}")
    if w.k < BK or w.k % BK:
        raise GpuError(f"{what}: weight {w.name!r} has K={w.k}; the GEMM needs a positive multiple of {BK}")
    if not w.base or w.base % 16:
        raise GpuError(f"{what}: weight {w.name!r} base {w.base:#x} is not 16-byte aligned")


def _check_x(x: int, ldx: int, K: int, what: str) -> None:
    """x is bf16 [rows, ldx]: 16-byte aligned rows."""
    if not x or x % 16:
        raise GpuError(f"{what}: x={x:#x} must be a 16-byte aligned device pointer")
    if ldx < K or ldx % 8:
        raise GpuError(f"{what}: ldx={ldx} must be >= K={K} and a multiple of 8 (16-byte bf16 rows)")


def _prepare(k, name: str, fmt: str, smem: int | None = None) -> int:
    """The kernel's dynamic smem (smem_bytes(fmt) unless given), opted in on this Kernels."""
    smem = smem_bytes(fmt) if smem is None else smem
    k.opt_in_smem(name, smem)
    return smem


def gemm(k, w, *, x: int, M: int, y: int, ldx: int | None = None, ldy: int | None = None,
         mode: str = "store", row_scale: int = 0, stream=None, kernel: str = "auto", scratch: int = 0,
         scratch_bytes: int = 0) -> None:
    """y (=, +=, swiglu) W·x for M rows of x; see the module docstring. Sizes are checked (GpuError).

    Pointers are device addresses: x (bf16) 16-byte aligned with ldx a multiple of 8; row_scale 0 for none.
    ldx defaults to K, ldy to N (N/2 for swiglu, which needs N % 32 == 0). kernel: one of KERNELS.
    scratch (16-byte aligned, scratch_bytes long): where "wgmma_ss" dequantizes a quantized weight, bf16 in the
    row order of gemm_wgmma.cu dq_row (dequant_bytes(w)); "auto" takes that path when it fits and M >=
    WGMMA_SS_MIN_ROWS. Same numerics as "wgmma": the MMAs take RN(q · s).
    """
    what = f"gemm({w.name})"
    _check_weight(w, what)
    if len(w.shape) != 2:
        raise GpuError(f"{what}: weight shape {w.shape} is not 2-D [N, K]")
    wg = _use_wgmma(k, kernel, int(M), w.shape[0], what)
    if mode not in MODES:
        raise GpuError(f"{what}: mode {mode!r} is not one of {', '.join(MODES)}")
    N, K = w.shape
    M = int(M)
    if M < 0:
        raise GpuError(f"{what}: M={M} < 0")
    if mode == "swiglu" and N % 32:
        raise GpuError(f"{what}: swiglu needs N % 32 == 0 (interleaved gate/up tiles of 16), N={N}")
    out_cols = N // 2 if mode == "swiglu" else N
    ldx = K if ldx is None else int(ldx)
    ldy = out_cols if ldy is None else int(ldy)
    _check_x(x, ldx, K, what)
    if not y:
        raise GpuError(f"{what}: y is a null pointer")
    if ldy < out_cols:
        raise GpuError(f"{what}: ldy={ldy} < {out_cols} output columns")
    grid = (-(-N // (WG_BN if wg else BN)), -(-M // BM))
    if grid[1] > GRID_Y_MAX:
        raise GpuError(f"{what}: M={M} exceeds {GRID_Y_MAX * BM} rows per launch")
    if M == 0:
        return
    ss = wg and _use_ss(kernel, w, M, scratch, scratch_bytes, what)
    if ss:
        _gemm_ss(k, w, x=x, M=M, y=y, ldx=ldx, ldy=ldy, mode=MODES[mode], row_scale=row_scale, grid=grid,
                 scratch=scratch, stream=stream)
        return
    name = f"gemm_{'wgmma_' if wg else ''}{w.fmt}"
    smem = _prepare(k, name, w.fmt, smem_bytes(w.fmt, wg))
    qs, qh, sc = w.planes()
    args = [ptr(qs), ptr(qh), ptr(sc), i32(w.kp), i32(N), i32(K), ptr(x), i32(ldx), ptr(y), i32(ldy),
            ptr(row_scale), i32(M), i32(MODES[mode])]
    if wg:
        args += [_qs_map(w), _x_map(x, K, M, ldx)]
    k.launch(name, grid, WG_THREADS if wg else THREADS, args, smem, stream)


def _use_ss(kernel: str, w, M: int, scratch: int, scratch_bytes: int, what: str) -> bool:
    """Whether a wgmma launch dequantizes w into scratch and runs gemm_wgmma_ss (kernel "wgmma_ss", or "auto"
    where it fits and pays)."""
    fits = w.fmt != "bf16" and scratch and scratch % 16 == 0 and scratch_bytes >= dequant_bytes(w)
    if kernel == "wgmma_ss" and not fits:
        raise GpuError(f"{what}: kernel 'wgmma_ss' needs a quantized weight (this one is {w.fmt}) and a 16-byte "
                       f"aligned scratch of {dequant_bytes(w)} bytes (given {scratch_bytes} at {scratch:#x})")
    return bool(fits) and (kernel == "wgmma_ss" or (kernel == "auto" and M >= WGMMA_SS_MIN_ROWS))


def _gemm_ss(k, w, *, x: int, M: int, y: int, ldx: int, ldy: int, mode: int, row_scale: int, grid, scratch: int,
             stream) -> None:
    """gemm_wgmma_dequant_<fmt> into scratch, then gemm_wgmma_ss on it (both operands by TMA, A from smem)."""
    N, K = w.shape
    rows = _dequant_rows(N)
    qs, qh, sc = w.planes()
    k.launch(f"gemm_wgmma_dequant_{w.fmt}", -(-rows * K // 8 // 256), 256,
             [ptr(qs), ptr(qh), ptr(sc), i32(w.kp), i32(N), i32(K), i32(rows), ptr(scratch)], 0, stream)
    smem = ss_smem_bytes()
    k.opt_in_smem("gemm_wgmma_ss", smem)
    tmw = _tensor_map(scratch, dtype="bf16", inner=K, rows=rows, row_bytes=2 * K, box_inner=WG_KSTAGE,
                      box_rows=WG_BN, swizzle_128b=True)
    args = [i32(N), i32(K), ptr(y), i32(ldy), ptr(row_scale), i32(M), i32(mode), tmw, _x_map(x, K, M, ldx)]
    k.launch("gemm_wgmma_ss", grid, WG_THREADS, args, smem, stream)


# ------------------------------------------------------------------------------------------------ grouped MoE

SORT_THREADS = 1024

# moe_small_<fmt> (kernels/moe_gemm.cu): tile SMALL_BN weight rows × SMALL_TM routed slots, k stages of 128
SMALL_BN, SMALL_TM, SMALL_STAGES = 128, 32, 3
SMALL_XSTRIDE = 32 * 2      # bytes of one staged bf16 x row per 32-wide chunk
# moe_grouped runs moe_small when the average routed slots per expert, M·top_k / E, is at most this: the H200
# crossover of the 35B banks lies between 32 (small 0.74 ms, large 0.82) and 40 (0.93, 0.89) (perf-history.md v10)
MOE_SMALL_MAX_AVG = 36
MOE_PATHS = ("auto", "small", "large")


def small_smem_bytes(fmt: str) -> int:
    """Dynamic shared memory of moe_small_<fmt> (moe_gemm.cu STraits<BITS>::SMEM); integer formats only."""
    bits = _bits(fmt)
    qs = 32 if bits == 8 else 16
    qh = {5: 4, 6: 8}.get(bits, 0)
    stage = 4 * SMALL_TM * SMALL_XSTRIDE + 4 * SMALL_BN * (qs + qh + 4)
    red = 4 * SMALL_TM * (SMALL_BN + 4) * 4
    return SMALL_TM * 12 + max(SMALL_STAGES * stage, red)


def _small_ok(k, *ws) -> bool:
    """moe_small handles every bank in ws: integer formats whose tile fits this GPU's shared memory."""
    limit = k.gpu.info.max_smem_per_block_optin
    return all(w.fmt != "bf16" and small_smem_bytes(w.fmt) <= limit for w in ws)


def moe_scratch_bytes(M: int, top_k: int, E: int) -> int:
    """Bytes of the int32 workspace `moe_grouped` needs: order [M·top_k], offsets [E+1], tile_start [E+1]."""
    return 4 * (int(M) * int(top_k) + 2 * (int(E) + 1))


def moe_grouped(k, gate_up, down, *, x: int, M: int, ids: int, weights: int, top_k: int, act: int, y: int,
                scratch: int, ldx: int | None = None, ldy: int | None = None, stream=None,
                path: str = "auto", kernel: str = "auto", slot_y: int = 0) -> str | None:
    """Routed experts for prefill: y[m] += Σ_j weights[m, j] · down_e (silu(g_e·x_m) · (u_e·x_m)), e = ids[m, j].

    gate_up: bank [E, 2I, H] with each expert's gate/up rows interleaved in tiles of 16 (as `gemm` swiglu);
    down: bank [E, H, I]. x bf16 [M, ldx >= H]; ids int32 [M, top_k] (ids outside [0, E) are skipped);
    weights fp32 [M, top_k]; y fp32 [M, ldy >= H], added into. act bf16 [M·top_k, I] receives the SwiGLU
    activation of each slot s = m·top_k + j; scratch is an int32 workspace of moe_scratch_bytes(M, top_k, E).

    Three launches: moe_sort groups the slots by expert; moe_gemm (swiglu) fills act; moe_gemm (down) adds
    into y with float atomics, so y's last bits may differ from run to run (the top_k terms of a row are
    summed in whatever order the blocks finish). With slot_y (fp32 [M·top_k, H] scratch) the down stores each
    slot's row there instead and a fourth launch, moe_sum_slots, adds them into y in slot order: the same bits
    every run, for M·top_k·H·8 more bytes of traffic.

    path: "large" runs moe_gemm_<fmt> (tiles of 128 slots per expert); "small" runs moe_small_<fmt>
    (kernels/moe_gemm.cu: tiles of 32 slots, integer formats only, GpuError otherwise); "auto" (default) takes
    small when M·top_k / E <= MOE_SMALL_MAX_AVG and both banks allow it. Same results up to fp32 summation order.
    kernel (KERNELS) picks the large path's tiles as for `gemm`. Returns the path taken ("small" or "large"; None
    when M = 0 launches nothing).
    """
    what = f"moe_grouped({gate_up.name}, {down.name})"
    for w in (gate_up, down):
        _check_weight(w, what)
        if len(w.shape) != 3:
            raise GpuError(f"{what}: bank {w.name!r} shape {w.shape} is not 3-D [E, N, K]")
    E, I2, H = gate_up.shape
    if down.shape != (E, H, I2 // 2):
        raise GpuError(f"{what}: down shape {down.shape} does not match gate_up {gate_up.shape} "
                       f"(expected {(E, H, I2 // 2)})")
    I = I2 // 2
    if I2 % 32:
        raise GpuError(f"{what}: 2I={I2} must be a multiple of 32 (interleaved tiles of 16)")
    M, top_k = int(M), int(top_k)
    # the grouped tiles: at least M·top_k / 128 rows of tiles (more where experts' counts round up)
    wg = _use_wgmma(k, kernel, M * top_k, min(I2, H), what)
    if M < 0 or top_k < 1:
        raise GpuError(f"{what}: M={M} must be >= 0 and top_k={top_k} >= 1")
    ldx = H if ldx is None else int(ldx)
    ldy = H if ldy is None else int(ldy)
    _check_x(x, ldx, H, what)
    _check_x(act, I, I, what + " act")
    for nm, p in (("ids", ids), ("weights", weights), ("y", y), ("scratch", scratch)):
        if not p:
            raise GpuError(f"{what}: {nm} is a null pointer")
    if ldy < H:
        raise GpuError(f"{what}: ldy={ldy} < H={H}")
    slots = M * top_k
    grid_y = -(-slots // BM) + E
    if grid_y > GRID_Y_MAX or slots >= 2**31:
        raise GpuError(f"{what}: M·top_k={slots} is too many slots for one launch")
    if slot_y and M > GRID_Y_MAX:
        raise GpuError(f"{what}: M={M} rows are too many for moe_sum_slots' grid (at most {GRID_Y_MAX})")
    if 8 * E > 48 * 1024:
        raise GpuError(f"{what}: E={E} experts exceed the sort's shared memory")
    if path not in MOE_PATHS:
        raise GpuError(f"{what}: path {path!r} is not one of {', '.join(MOE_PATHS)}")
    if M == 0:
        return None
    if path == "small" and not _small_ok(k, gate_up, down):
        raise GpuError(f"{what}: path 'small' needs integer formats that fit shared memory "
                       f"({gate_up.fmt}, {down.fmt})")
    small = path == "small" or (path == "auto" and slots <= MOE_SMALL_MAX_AVG * E and _small_ok(k, gate_up, down))
    wg = wg and not small  # moe_small has mma.sync tiles only
    order = scratch
    offsets = scratch + 4 * slots
    tile_start = offsets + 4 * (E + 1)
    if small:
        k.launch("moe_sort_bm", 1, SORT_THREADS,
                 [ptr(ids), i32(slots), i32(E), ptr(order), ptr(offsets), ptr(tile_start), i32(SMALL_TM)], 8 * E,
                 stream)
    else:
        k.launch("moe_sort", 1, SORT_THREADS,
                 [ptr(ids), i32(slots), i32(E), ptr(order), ptr(offsets), ptr(tile_start)], 8 * E, stream)
    # small: token tiles (<= slots, and <= ceil(slots / TM) + E) along x, fastest, so the tiles of one expert
    # run together and share its weight tile through L2; surplus blocks exit
    small_tiles = min(slots, -(-slots // SMALL_TM) + E)

    def run(w, N, K, xp, ldx_, yp, ldy_, row_scale, xdiv, ydiv, mode):
        qs, qh, sc = w.planes()
        if small:
            name = f"moe_small_{w.fmt}"
            smem = _prepare(k, name, w.fmt, small_smem_bytes(w.fmt))
            grid = (small_tiles, -(-N // SMALL_BN))
        else:
            name = f"moe_gemm_{'wgmma_' if wg else ''}{w.fmt}"
            smem = _prepare(k, name, w.fmt, smem_bytes(w.fmt, wg))
            grid = (-(-N // (WG_BN if wg else BN)), grid_y)
        args = [ptr(qs), ptr(qh), ptr(sc), i32(w.kp), i32(N), i32(K), ptr(xp), i32(ldx_), ptr(yp), i32(ldy_),
                ptr(row_scale), ptr(order), ptr(offsets), ptr(tile_start), i32(E), i32(xdiv), i32(ydiv), i32(mode)]
        if wg:
            args.append(_qs_map(w))
        k.launch(name, grid, WG_THREADS if wg else THREADS, args, smem, stream)

    run(gate_up, I2, H, x, ldx, act, I, 0, top_k, 1, MODES["swiglu"])
    if slot_y:
        run(down, H, I, act, I, slot_y, H, weights, 1, 1, MODES["store"])
        k.launch("moe_sum_slots", (-(-H // 256), M), 256, [ptr(slot_y), ptr(ids), i32(top_k), i32(H), i32(E),
                                                          ptr(y), i32(ldy)], 0, stream)
    else:
        run(down, H, I, act, I, y, ldy, weights, 1, top_k, MODE_ATOMIC_ADD)
    return "small" if small else "large"
