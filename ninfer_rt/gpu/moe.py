"""Launch wrappers of kernels/moe.cu: the routed part of the sparse MoE block at decode.

One decode step has M = B*T rows of fp32 activations. The router logits (and the shared-expert gate logit in
column E) come from the plain GEMV over the fused [E+1, H] router; then

    route    -> ids [M, k], weights [M, k], shared_scale [M]
    gate_up  -> act [M, k, I] = SwiGLU of each chosen expert
    down     -> y [M, H] += Σ_j weights · down_j(act_j)      (y is the residual stream)

gate_up_routed does route and gate_up in one launch, on the residual stream x with the post-attention RMSNorm
applied in the kernel (the router GEMV fuses the same norm), so a decode layer needs no separate norm either.
The shared expert is computed apart with the plain GEMV. One token (M = 1) can instead take `fused`
(kernels/moe_fused.cu): after the router GEMV, routing, both gate/ups, a grid-wide barrier and both downs in one
launch. Reference: ninfer_rt.reference.ops.moe. The fast paths (q banks at decode shapes) take x̂ and act as
int16 codes per 32 elements (ninfer_rt.reference.ops.act_codes16) and exact integer dot products, as the decode
GEMVs do; the general paths fp32.
"""

from __future__ import annotations

from ninfer_rt.gpu.driver import GpuError, f32, i32, ptr
from ninfer_rt.gpu.linear import x_chunk_bytes
from ninfer_rt.gpu.weights import DeviceWeight

MAX_EXPERTS = 512  # route keeps one row's logits in shared memory
MAX_TOP_K = 16
ROUTE_WARPS = 4  # rows per route block (one warp each)
THREADS = 256  # gate_up and down blocks
GATE_UP_TILE = 32  # bank rows per gate_up block: 16 gate + 16 up (the interleave tile of 16)
DOWN_ROWS = 8  # rows of y per down block
XPAD = 33  # floats of shared memory per 32 activations (padded against bank conflicts)
QCHUNK = x_chunk_bytes(1, True)  # shared-memory bytes per 32 activations as int16 codes in the fast paths
FAST_T = (1, 2)  # fast paths (q formats): gate_up at H = 1024·T, down at I = 512·T, x / act 16-byte aligned
SMEM_STATIC = 4096  # upper bound of the kernels' static shared memory (moe_fused: 3.6 KB)
# Planner constant: gate_up_routed of several rows at 3 blocks an SM (moe_gate_up_routed_b3_t2_<fmt>: B = 2's 512
# blocks in 1.3 waves on a 132-SM card, not two); 2 keeps the one-row kernel (perf.md v83: -0.8% at B = 2, -2.3% at 4).
GATE_UP_BLOCKS_PER_SM = 3
GATE_UP_B3_FORMATS = ("q4g64", "q5g64")  # the formats with that entry
# Planner constant: down of several rows at 3 blocks an SM (moe_down_b3_t1_<fmt>, the same grid (M, H/8)); 2 keeps the
# one-row build (perf.md v84).
DOWN_BLOCKS_PER_SM = 3
DOWN_B3_FORMATS = ("q5g64", "q6g64")
# Planner switch (v90): batched decode's shared expert runs on a side stream of the greatest priority, so that its
# blocks are placed before the routed gate/up's second wave (v89's timelines: the routed down waited for the side
# stream, which started 5.8 µs after out_proj at B = 2 and 14.3 at B = 4). B = 2 -2.2%, B = 4 -1.5% (H100, perf.md)
SHARED_STREAM_PRIORITY = True
ACC_FORMATS = ("q4g64", "q5g64")  # the routed gate/up formats with _acc entries (routing on a router fold, v87)


def _check_ptrs(op: str, **ptrs: int) -> None:
    for name, p in ptrs.items():
        if not p:
            raise GpuError(f"moe.{op}: {name} is a null pointer")


def _kernel_name(op: str, w: DeviceWeight) -> str:
    if not (w.quantized or w.fmt == "bf16"):
        raise GpuError(f"moe.{op}: weight {w.name} is {w.fmt}; the MoE kernels read q{{4,5,6,8}}g{{32,64,128}} "
                       "or bf16")
    return f"moe_{op}_{w.fmt}"


def _bank(op: str, w: DeviceWeight) -> tuple[int, int, int]:
    """(E, N, K) of a [E, N, K] expert bank."""
    if len(w.shape) != 3:
        raise GpuError(f"moe.{op}: weight {w.name} must be an expert bank [E, N, K], got shape {list(w.shape)}")
    return w.shape


def _check_rows(op: str, M: int, top_k: int) -> None:
    if M < 0:
        raise GpuError(f"moe.{op}: M={M} must be >= 0")
    if not 1 <= top_k <= MAX_TOP_K:
        raise GpuError(f"moe.{op}: top_k={top_k} outside 1..{MAX_TOP_K}")


def _smem(k, op: str, name: str, nbytes: int) -> int:
    """Dynamic shared memory of one launch, opted in above the 48 KiB default when the GPU allows."""
    limit = k.gpu.info.max_smem_per_block_optin - SMEM_STATIC
    if nbytes > limit:
        raise GpuError(f"moe.{op}: needs {nbytes} bytes of shared memory, this GPU allows {limit}")
    k.opt_in_smem(name, nbytes)
    return nbytes


def _fast_t(w: DeviceWeight, n: int, unit: int) -> int:
    """T of the fast path for a q bank whose H (gate/up, unit 1024) or I (down, unit 512) is n = unit·T with T in
    FAST_T; 0 where there is none (the caller still checks its inputs' alignment)."""
    t = n // unit
    return t if w.quantized and n == unit * t and t in FAST_T else 0


def _check_logits(op: str, E: int, top_k: int, ld: int) -> None:
    if not 1 <= E <= MAX_EXPERTS:
        raise GpuError(f"moe.{op}: E={E} outside 1..{MAX_EXPERTS}")
    if top_k > E:
        raise GpuError(f"moe.{op}: top_k={top_k} exceeds E={E}")
    if ld < E + 1:
        raise GpuError(f"moe.{op}: ld={ld} must be >= E + 1 = {E + 1} (column E is the shared-expert gate)")


def route(k, *, logits: int, ld: int, M: int, E: int, top_k: int, ids: int, weights: int, shared_scale: int,
          stream=None) -> None:
    """Top-k softmax routing of M rows, plus the shared-expert gate.

    logits fp32 [M, ld]: columns 0..E-1 router logits, column E the shared-expert-gate logit.
    p = softmax(logits[m, :E]) in fp32; (w, e) = the top_k largest p, descending, equal p by lower index;
    ids int32 [M, top_k] = e; weights fp32 [M, top_k] = w / Σw; shared_scale fp32 [M] = sigmoid(logits[m, E]).
    """
    _check_rows("route", M, top_k)
    _check_logits("route", E, top_k, ld)
    _check_ptrs("route", logits=logits, ids=ids, weights=weights, shared_scale=shared_scale)
    grid = (M + ROUTE_WARPS - 1) // ROUTE_WARPS
    args = [ptr(logits), i32(ld), i32(M), i32(E), i32(top_k), ptr(ids), ptr(weights), ptr(shared_scale)]
    k.launch("moe_route", grid, 32 * ROUTE_WARPS, args, 0, stream)


def _gate_up_kernel(k, op: str, w: DeviceWeight, M: int, top_k: int, vec: bool, experts: int | None = None):
    """Checks gate_up and gate_up_routed share, and their kernel: the fast path moe_<op>_t{T}_<fmt> for q banks
    at H = 1024·T (T in FAST_T) when `vec` (the fp32 inputs it reads by 16 bytes are aligned), else
    moe_<op>_<fmt>. `experts`: the E the bank must have. Returns (name, E, H, I, grid, dynamic smem bytes)."""
    name = _kernel_name(op, w)
    E, two_i, H = _bank(op, w)
    if experts is not None and E != experts:
        raise GpuError(f"moe.{op}: E={experts} router columns but bank {w.name} holds {E} experts")
    _check_rows(op, M, top_k)
    if two_i % 64 or H % 32:
        raise GpuError(f"moe.{op}: bank {w.name} {list(w.shape)}: I and H must be multiples of 32")
    if two_i // GATE_UP_TILE > 65535:
        raise GpuError(f"moe.{op}: I={two_i // 2} is too large for the grid (at most {65535 * 16})")
    t = _fast_t(w, H, 1024)
    if t and vec:
        name = f"moe_{op}_t{t}_{w.fmt}"
        smem = _smem(k, op, name, H // 32 * QCHUNK)
    else:
        smem = _smem(k, op, name, H // 32 * XPAD * 4)
    return name, E, H, two_i // 2, (M * top_k, two_i // GATE_UP_TILE), smem


def gate_up(k, w: DeviceWeight, *, x: int, M: int, ids: int, top_k: int, act: int, stream=None) -> None:
    """SwiGLU of each row's chosen experts: act[m, j, i] = silu(g_i · x_m) · (u_i · x_m), expert ids[m, j].

    w: the routed gate/up bank [E, 2I, H], rows interleaved in tiles of 16 (layout.interleave_gate_up).
    x fp32 [M, H]; ids int32 [M, top_k] (an id outside [0, E) gives NaN); act fp32 [M, top_k, I].
    Grid (M·top_k, 2I/32): each block reads 32 bank rows of one expert for one row of x.
    """
    _check_ptrs("gate_up", x=x, ids=ids, act=act)
    name, E, H, I, grid, smem = _gate_up_kernel(k, "gate_up", w, M, top_k, x % 16 == 0)
    qs, qh, sc = w.planes()
    args = [ptr(qs), ptr(qh), ptr(sc), i32(w.kp), i32(E), i32(H), i32(I), ptr(x), ptr(ids), i32(top_k), ptr(act)]
    k.launch(name, grid, THREADS, args, smem, stream)


def acc_fits(gate_up: DeviceWeight, E: int, down: DeviceWeight | None = None) -> bool:
    """Whether gate_up_routed can route this bank's rows on a router fold's acc (its _acc entries, v87): a
    q4g64 or q5g64 bank at H = 1024·T (T in FAST_T) and E <= THREADS (one logit a thread); with `down`, also
    whether moe.down takes its fast path there (a q bank at I = 512·T), which zeroes acc's rows."""
    if not (len(gate_up.shape) == 3 and gate_up.fmt in ACC_FORMATS and gate_up.shape[0] == E and E <= THREADS
            and _fast_t(gate_up, gate_up.shape[2], 1024)):
        return False
    return down is None or (len(down.shape) == 3 and bool(_fast_t(down, down.shape[2], 512)))


def gate_up_routed(k, w: DeviceWeight, *, x: int, norm_w: int, eps: float, logits: int, ld: int, M: int, E: int,
                   top_k: int, ids: int, weights: int, shared_scale: int, act: int, acc: int = 0,
                   stream=None) -> None:
    """rms_norm_zc, route and gate_up of M rows in one launch (the decode MoE block before down).

    h = rms_norm_zc(x, norm_w, eps): h_m = (x_m · rsqrt(mean(x_m²) + eps)) · (1 + norm_w) in fp32 with the
    roundings of misc.rms_norm (correctly rounded divide, add and rsqrt, then (x · r) · (1 + w)); Σ x² is added
    in another order, so h may differ from misc.rms_norm's in the last bits;
    (ids, weights, shared_scale) = route(logits) as `route` computes them, to the bit (the same device code);
    act[m, j, i] = silu(g_i · h_m) · (u_i · h_m) of expert ids[m, j], as `gate_up` on h.
    x fp32 [M, H] (the residual stream, not normalised); norm_w fp32 [H]; logits fp32 [M, ld] (column E the
    shared-expert gate); ids int32 / weights fp32 [M, top_k], shared_scale fp32 [M], act fp32 [M, top_k, I]
    (outputs). w: the gate/up bank [E, 2I, H] as in `gate_up`. Same grid as `gate_up`: every block routes and
    normalises its own row, block (m·top_k, 0) writes row m's ids, weights and shared_scale. Several rows of a q4g64
    or q5g64 bank at H = 2048 take the build of the same kernel at three blocks an SM (GATE_UP_BLOCKS_PER_SM).
    acc (v87; acc_fits): int64 [M, ld], each row the raw logits G·x_m of a router fold (router_fold.py) in
    2^-32 fixed point, complete before this launch begins; the kernel routes on it before its wait and scales
    the logits by rsqrt(mean x_m² + eps) for the weights and the shared gate (logits is then not read). moe.down
    with the same acc zeroes its rows for the next step's fold.
    """
    op = "gate_up_routed"
    _check_logits(op, E, top_k, ld)
    logits = logits or acc
    _check_ptrs(op, x=x, norm_w=norm_w, logits=logits, ids=ids, weights=weights, shared_scale=shared_scale,
                act=act)
    name, E, H, I, grid, smem = _gate_up_kernel(k, op, w, M, top_k, x % 16 == 0 and norm_w % 16 == 0, E)
    fast = name == f"moe_{op}_t{H // 1024}_{w.fmt}"
    if acc and not (fast and acc_fits(w, E)):
        raise GpuError(f"moe.{op}: routing on a router fold needs a {' or '.join(ACC_FORMATS)} bank at H = 1024·T "
                       f"(T in {FAST_T}) with E <= {THREADS}, 16-byte aligned x and norm_w (got {w.fmt} "
                       f"{list(w.shape)})")
    if GATE_UP_BLOCKS_PER_SM == 3 and M > 1 and name == f"moe_{op}_t2_{w.fmt}" and w.fmt in GATE_UP_B3_FORMATS:
        name = f"moe_{op}_b3_t2_{w.fmt}"
    if acc:
        name = name.replace(f"moe_{op}_", f"moe_{op}_acc_", 1)
    _smem(k, op, name, smem)  # the same bytes as the one-row build's, opted in for this entry too
    qs, qh, sc = w.planes()
    args = [ptr(qs), ptr(qh), ptr(sc), i32(w.kp), i32(E), i32(H), i32(I), ptr(x), ptr(norm_w), f32(eps),
            ptr(logits), i32(ld), i32(top_k), ptr(ids), ptr(weights), ptr(shared_scale), ptr(act)]
    k.launch(name, grid, THREADS, args + ([ptr(acc)] if acc else []), smem, stream)


def down(k, w: DeviceWeight, *, act: int, ids: int, weights: int, M: int, top_k: int, y: int, extra: int = 0,
         extra_scale: int = 0, acc: int = 0, acc_ld: int = 0, stream=None) -> None:
    """Down projections of the chosen experts, weighted and added to the residual stream.

    y[m, n] += Σ_j weights[m, j] · (W_{ids[m, j]}[n, :] · act[m, j, :]), the k terms summed in order
    j = 0..k-1 by one thread per element (deterministic, no atomics). w: the down bank [E, H, I];
    act fp32 [M, top_k, I]; ids int32 / weights fp32 [M, top_k]; y fp32 [M, H].
    extra fp32 [M, H] with extra_scale fp32 [M] (both or neither): then y[m, n] = fma(extra_scale[m],
    extra[m, n], y[m, n] + routed sum), the shared expert's output and gate added in the same pass.
    Grid (M, H/8): each block reads 8 rows of each of the row's top_k experts. Several rows of a q5g64 or q6g64
    bank at I = 512 take the build of the same kernel at three blocks an SM (DOWN_BLOCKS_PER_SM), the same bits.
    acc int64 [M, acc_ld] (v87, the fast paths): the router fold gate_up_routed routed on, zeroed after the wait.
    """
    name = _kernel_name("down", w)
    E, H, I = _bank("down", w)
    _check_rows("down", M, top_k)
    if I % 32 or H % 32:
        raise GpuError(f"moe.down: bank {w.name} {list(w.shape)}: I and H must be multiples of 32")
    if H // DOWN_ROWS > 65535:
        raise GpuError(f"moe.down: H={H} is too large for the grid (at most {65535 * DOWN_ROWS})")
    _check_ptrs("down", act=act, ids=ids, weights=weights, y=y)
    if bool(extra) != bool(extra_scale):
        raise GpuError("moe.down: extra and extra_scale come together (both device pointers, or neither)")
    t = _fast_t(w, I, 512)
    if t and act % 16 == 0:
        name = f"moe_down_t{t}_{w.fmt}"
        if DOWN_BLOCKS_PER_SM == 3 and M > 1 and t == 1 and w.fmt in DOWN_B3_FORMATS:
            name = f"moe_down_b3_t1_{w.fmt}"
        smem = _smem(k, "down", name, top_k * (I // 32) * QCHUNK)
        tail = [ptr(acc), i32(acc_ld)]
    else:
        if acc:
            raise GpuError(f"moe.down: zeroing a router fold's acc needs the fast path (a q bank at I = 512·T, "
                           f"16-byte aligned act; got {w.fmt} {list(w.shape)})")
        smem = _smem(k, "down", name, top_k * (I // 32) * XPAD * 4)
        tail = []
    if acc and acc_ld < 1:
        raise GpuError(f"moe.down: acc_ld={acc_ld} must be >= 1")
    qs, qh, sc = w.planes()
    args = [ptr(qs), ptr(qh), ptr(sc), i32(w.kp), i32(E), i32(H), i32(I), ptr(act), ptr(ids), ptr(weights),
            i32(top_k), ptr(y), ptr(extra), ptr(extra_scale)] + tail
    k.launch(name, (M, H // DOWN_ROWS), THREADS, args, smem, stream)


# ------------------------------------------------------------------------------------------ one launch

# Planner switch: decode a token's MoE block in one moe_fused launch where it applies (fused_kernel); False
# keeps the router GEMV + gate_up_routed + down with the shared expert on a side stream (bench/planner_ab.py).
FUSED_DECODE = True
FUSED_I = 512  # the routed and shared intermediate sizes moe_fused.cu is written for
FUSED_DOWN_ROWS = 16  # x rows per block of moe_fused's down phase (MOE_FUSED_DR)


def fused_kernel(k, gate_up: DeviceWeight, down: DeviceWeight, shared_gate_up: DeviceWeight,
                 shared_down: DeviceWeight, top_k: int, acc: bool = False) -> tuple[str, int, int] | None:
    """The moe_fused entry point for these weights on this GPU, with its grid and dynamic shared memory, or None
    when the MoE block must take the separate launches: FUSED_DECODE off, shapes or formats moe_fused.cu has no
    entry for, or a grid the GPU cannot hold at once (its blocks meet at a grid-wide barrier). acc: the entry that
    routes on the DeltaNet step's router fold (moe_fused_acc_t*: E <= THREADS) instead of logits."""
    if not FUSED_DECODE or not 1 <= top_k <= MAX_TOP_K or len(gate_up.shape) != 3:
        return None
    E, two_i, H = gate_up.shape
    if (tuple(down.shape) != (E, H, FUSED_I) or two_i != 2 * FUSED_I or top_k > E or E > MAX_EXPERTS
            or shared_down.fmt != shared_gate_up.fmt or tuple(shared_gate_up.shape) != (2 * FUSED_I, H)
            or tuple(shared_down.shape) != (H, FUSED_I) or H % 1024 or H // 1024 not in FAST_T):
        return None
    if acc and E > THREADS:  # route_keys_block: one logit a thread
        return None
    name = f"moe_fused{'_acc' if acc else ''}_t{H // 1024}_{gate_up.fmt}_{down.fmt}_{shared_gate_up.fmt}"
    try:
        fn = k.fn(name)
    except GpuError:
        return None  # no entry for this format triple
    grid = max(top_k * FUSED_I // 16, FUSED_I // 2, H // FUSED_DOWN_ROWS)
    smem = max(2 * H // 32, (top_k + 1) * FUSED_I // 32) * QCHUNK  # phase 2's records reuse phase 1's bytes
    if smem > k.gpu.info.max_smem_per_block_optin - SMEM_STATIC:
        return None
    k.opt_in_smem(name, smem)
    if k.gpu.max_active_blocks(fn, THREADS, smem) * k.gpu.info.sm_count < grid:
        return None
    return name, grid, smem


def fused(k, plan: tuple[str, int, int], gate_up: DeviceWeight, down: DeviceWeight, shared_gate_up: DeviceWeight,
          shared_down: DeviceWeight, *, x: int, norm_w: int, eps: float, logits: int, E: int, top_k: int, ids: int,
          weights: int, shared_scale: int, act: int, act_s: int, barrier: int, stream=None, acc: int = 0) -> None:
    """The sparse MoE block of one token after the router GEMV, in one launch (kernels/moe_fused.cu), x updated in
    place:

        h = rms_norm_zc(x, norm_w, eps); (ids, weights, shared_scale) = route(logits)
        act[j] = SwiGLU_{ids[j]}(h), act_s = SwiGLU_shared(h)
        x = fma(shared_scale, down_s(act_s), x + Σ_j weights[j] · down_{ids[j]}(act[j]))   (j = 0..k-1 in order)

    as gate_up_routed, the shared expert's GEMVs and down with extra compute it (int16 codes of h, act, act_s).
    plan: fused_kernel's answer for these weights. x, norm_w fp32 [H] (16-byte aligned); logits fp32 [E + 1]
    (column E the shared-expert gate); ids / weights [top_k], shared_scale [1], act [top_k, I], act_s [I]
    (outputs; act and act_s 16-byte aligned); barrier: a device u32, zero before the first launch, that no other
    kernel touches while this one runs (each launch flips its top bit and leaves the rest as it found it).
    """
    name, grid, smem = plan
    if name.startswith("moe_fused_acc") != bool(acc):
        raise GpuError(f"moe.fused: plan {name} with acc={acc:#x}: the _acc entries route on acc, the others on logits")
    if E != gate_up.shape[0]:
        raise GpuError(f"moe.fused: E={E} router columns but bank {gate_up.name} holds {gate_up.shape[0]} experts")
    _check_rows("fused", 1, top_k)
    _check_logits("fused", E, top_k, E + 1)
    _check_ptrs("fused", x=x, norm_w=norm_w, logits=logits, ids=ids, weights=weights, shared_scale=shared_scale,
                act=act, act_s=act_s, barrier=barrier)
    if (x | norm_w | act | act_s) % 16:
        raise GpuError("moe.fused: x, norm_w, act and act_s must be 16-byte aligned")
    args = []
    for w in (gate_up, down, shared_gate_up, shared_down):
        qs, qh, sc = w.planes()
        args += [ptr(qs), ptr(qh), ptr(sc), i32(w.kp)]
    args += [i32(E), i32(top_k), ptr(norm_w), f32(eps), ptr(logits), ptr(ids), ptr(weights), ptr(shared_scale),
             ptr(act), ptr(act_s), ptr(x), ptr(barrier)] + ([ptr(acc)] if acc else [])
    k.launch(name, grid, THREADS, args, smem, stream)
