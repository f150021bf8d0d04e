"""Launch wrappers of kernels/deltanet.cu, deltanet_step.cu: the Gated DeltaNet mixer between its projections.

`decode` runs, for B sequences of T tokens each, exactly ninfer_rt.reference.model.GatedDeltaNet.__call__ from
the projection outputs (mixed, z, b, a) to the gated-norm output y (before out_proj): causal conv + SiLU,
L2-normalised q/k, the gated delta rule on the fp32 state, and the SiLU-gated RMSNorm. Both states are
updated in place. `step` does the same for decode steps of T <= 8 in one launch, computing b|a itself from
the layer input (kernels/deltanet_step.cu; a cluster of STEP_CLUSTER blocks per head on sm_90+, see
`step_cluster`); `prefill` runs the delta rule in chunks (kernels/deltanet_chunked.cu). Layouts are in the
header of kernels/deltanet.cu.

The conv state is a ring of pre-conv inputs, position p of a sequence in row p % ring (ring_rows(Kc) rows), so
that a fused step's writes never land on rows another block of the same step still reads.
"""

from __future__ import annotations

from ninfer_rt.formats import round_up
from ninfer_rt.gpu.driver import GpuError, f32, i32, ptr
from ninfer_rt.gpu.weights import DeviceWeight

DK_SUPPORTED = (16, 32, 64, 128)  # one recurrent kernel instantiation each (state rows in registers)
KC_MAX = 8                        # DN_KMAX in deltanet.cu
CONV_TOKENS = 8                   # DN_CONV_TOKENS in deltanet.cu: tokens per conv thread
CONV_THREADS = 256
NORM_WARPS = 4
STEP_T = 8                        # DN_STEP_T in deltanet_step.cu: most tokens per sequence of one fused step
STEP_COLS = 128                   # DN_STEP_COLS: largest dv of the fused step
# planner switch: the engine has a one-token step write out_proj's x̂ records (records_fit), so out_proj copies
# them instead of coding y (perf-history.md v41); False: out_proj codes the fp32 y itself
STEP_OUT_RECORDS = True
STEP_CLUSTER = 4                  # DN_STEP_CLUSTER: blocks per (value head, sequence) of the clustered step
STEP_PAIR = 2                     # DN_STEP_PAIR: the clusters of 2 that B > 1 may take (v89)
# threads per column of S in the step's block (the kernel's P), by cluster
STEP_LANES = {1: 4, STEP_PAIR: 4, STEP_CLUSTER: 8}
# the router fold's 32-column blocks in one step block and threads a logit (FNB, FTL in deltanet_step.cu), by
# cluster: a block of 4 is one fold block; of 2, two; the one-block step (v88) holds 4 (dv = 128), a pair a logit
STEP_FOLD = {1: (4, 2), STEP_PAIR: (2, 1), STEP_CLUSTER: (1, 1)}
# planner switch: B > 1 sequences take the step's shape whose launch runs in the fewest waves (step_cluster);
# False: clusters of 4 at any B. On since v88, whose one-block step folds the router too (perf.md, H100, 8K:
# B = 4 -3.0%, B = 2 -0.4%; v89's clusters of 2 another -1.5% and -2.8%)
STEP_CLUSTER_WAVES = True
# planner switch (v89): that rule may also take clusters of 2 (fewest waves first, then the most blocks a head);
# False: clusters of 4 or one block
STEP_PAIRS = True
# the clustered step computes its b|a dots before its wait on the in_proj GEMV up to this H, after it above
# (H200: v36 found before 0.3% faster a decode step at the 35B-A3B's H = 2048; on v49's kernels after is faster
# there, perf-history.md v50, as it was at the 27B's 5120)
STEP_BA_EARLY_MAX_H = 0
CHUNK = 32                        # DN_CHUNK in deltanet_chunked.cu: tokens per chunk of the prefill delta rule
CHUNK_COLS = 32                   # DN_COLS: columns of S per chunked block
CHUNK_THREADS = 256               # threads of a chunked prep or state block


def ring_rows(Kc: int) -> int:
    """Rows of the conv-state ring per slot: the Kc - 1 positions a step reads plus up to STEP_T it writes."""
    return Kc - 1 + STEP_T


def conv_state_bytes(Kc: int, conv_dim: int) -> int:
    """Bytes of one slot's conv state: fp32 [ring_rows(Kc), conv_dim]."""
    return ring_rows(Kc) * conv_dim * 4


def conv_dim_of(nk: int, nv: int, dk: int, dv: int) -> int:
    """Channels that go through the conv: [q (nk·dk) | k (nk·dk) | v (nv·dv)]."""
    return 2 * nk * dk + nv * dv


def decode_scratch_bytes(M: int, conv_dim: int) -> int:
    """Device scratch `decode` needs for M = B·T rows: the conv output, fp32 [M, conv_dim]."""
    return int(M) * int(conv_dim) * 4


def _recurrent_warps(dv: int) -> int:
    """Warps per recurrent block (8 columns of S each): as many as divide dv/8, at most 4."""
    for w in (4, 2, 1):
        if (dv // 8) % w == 0:
            return w
    return 1


def _check(*, mixed, ld_mixed, conv_w, A_log, dt_bias, norm_w, conv_state, ssm_state, slot, pos, B, T, nk, nv,
           dk, dv, Kc, out, **ptrs) -> int:
    """Validate a decode/prefill/step call (ptrs: the call's other device pointers); returns conv_dim."""
    ptrs.update(mixed=mixed, conv_w=conv_w, A_log=A_log, dt_bias=dt_bias, norm_w=norm_w, conv_state=conv_state,
                ssm_state=ssm_state, slot=slot, pos=pos, out=out)
    for name, p in ptrs.items():
        if not p:
            raise GpuError(f"deltanet: {name} is a null pointer")
    if B < 1 or T < 1:
        raise GpuError(f"deltanet: B={B} and T={T} must be >= 1")
    if B > 65535:
        raise GpuError(f"deltanet: B={B} exceeds the grid limit 65535")
    if nk < 1 or nv < 1 or nv % nk:
        raise GpuError(f"deltanet: nv={nv} must be a positive multiple of nk={nk}")
    if dk not in DK_SUPPORTED:
        raise GpuError(f"deltanet: dk={dk} unsupported (one of {DK_SUPPORTED})")
    if dv < 8 or dv % 8:
        raise GpuError(f"deltanet: dv={dv} must be a positive multiple of 8")
    if not 2 <= Kc <= KC_MAX:
        raise GpuError(f"deltanet: conv width Kc={Kc} must be in [2, {KC_MAX}]")
    conv_dim = conv_dim_of(nk, nv, dk, dv)
    if ld_mixed < conv_dim + nv * dv:
        raise GpuError(f"deltanet: ld_mixed={ld_mixed} < conv_dim + nv*dv = {conv_dim + nv * dv}")
    if -(-T // CONV_TOKENS) > 65535:
        raise GpuError(f"deltanet: T={T} exceeds the conv grid limit {65535 * CONV_TOKENS}")
    if B * T * nv >= 2**31:  # the gated-norm grid counts (row, head) pairs in int32
        raise GpuError(f"deltanet: B*T*nv={B * T * nv} is too many for one launch")
    return conv_dim


def chunk_record_floats(dk: int) -> int:
    """Floats of one chunk record (Rec in deltanet_chunked.cu): W and e^γ q̂ k-major [dk][2C]; e^{γ_L−γ} k̂
    [C][dk]; QKᵀ [C][C]; e^{γ_L} and 3 pad."""
    return CHUNK * (3 * dk + CHUNK) + 4


def _records_offset(M: int, conv_dim: int) -> int:
    """Where the chunk records start in the scratch: after the conv output, 256-byte aligned."""
    return round_up(decode_scratch_bytes(M, conv_dim), 256)


def chunked_scratch_bytes(B: int, T: int, conv_dim: int, nv: int, dk: int) -> int:
    """Device scratch the chunked delta rule needs for B sequences of T tokens: the conv output
    (decode_scratch_bytes), then one record per (sequence, chunk of CHUNK tokens, value head)."""
    return _records_offset(B * T, conv_dim) + B * -(-T // CHUNK) * nv * chunk_record_floats(dk) * 4


def prep_smem_bytes(dk: int, dv: int) -> int:
    """Dynamic shared memory of deltanet_chunk_prep_dk{dk}: q, k, w [C][dk + 4]; v [C][dv + 4]; A, QK [C][C + 4];
    γ, β, e^γ, e^{γ_L−γ} [C]; e^{γ_L} (padded to 4)."""
    C = CHUNK
    return 4 * (3 * C * (dk + 4) + C * (dv + 4) + 2 * C * (C + 4) + 4 * C + 4)


def state_smem_bytes(dk: int, stages: int) -> int:
    """Dynamic shared memory of deltanet_chunk_state_dk{dk} (stages 2) or _s1 (StateGeo in deltanet_chunked.cu): S
    [dk][CHUNK_COLS + 8] and V' [C][CHUNK_COLS + 8], then per stage a chunk record re-laid into padded rows (WQ
    [dk][2C + 8], KD [C][dk + 8], QKT [C][C + 8], e^{γ_L} + 3 pads) and its U columns [C][CHUNK_COLS + 8]. At dk = 128:
    154,656 bytes with 2 stages, 90,128 with 1."""
    C, sp = CHUNK, CHUNK_COLS + 8
    stage = dk * (2 * C + 8) + C * (dk + 8) + C * (C + 8) + 4 + C * sp
    return 4 * ((dk + C) * sp + stages * stage)


def state_stages(k, *, dk: int, blocks: int) -> int:
    """Record stages of the state kernel: 2 (the next chunk copied while this one computes) where a block's shared
    memory holds them (151 KB at dk = 128: sm_80, sm_90) and the blocks fit one wave at one per SM; else 1 (88 KB,
    two blocks per SM on sm_80/90) with an L2 prefetch. Measured on v18's fp32 kernel: H200, T = 4096: 35B (128
    blocks) 0.66 ms with 2 stages, 0.79 with 1; 27B (192 blocks) 1.29 with 2 (two waves), 1.21 with 1 (perf.md
    v18)."""
    fits = state_smem_bytes(dk, 2) <= k.gpu.info.max_smem_per_block_optin
    return 2 if fits and blocks <= k.gpu.info.sm_count else 1


def chunked_supported(k, *, dk: int, dv: int) -> bool:
    """Whether the chunked delta rule can run: dv in whole blocks of 32 columns, and both kernels' shared memory
    within what this GPU gives one block (77 KB for the prep and 88 KB for a one-stage state kernel at
    dk = dv = 128)."""
    optin = k.gpu.info.max_smem_per_block_optin
    return (dk in DK_SUPPORTED and dv % CHUNK_COLS == 0 and prep_smem_bytes(dk, dv) <= optin
            and state_smem_bytes(dk, 1) <= optin)


def decode(k, *, mixed: int, ld_mixed: int, ba: int, conv_w: int, A_log: int, dt_bias: int, norm_w: int,
           conv_state: int, ssm_state: int, slot: int, pos: int, B: int, T: int, nk: int, nv: int, dk: int, dv: int,
           Kc: int, eps: float, out: int, scratch: int, stream=None, chunked: bool = False) -> None:
    """The DeltaNet mixer for B sequences × T tokens (any T; fast for T = 1..8), token by token in order.

    mixed fp32 [B·T, ld_mixed]: [q | k | v | z] (the fused in_proj_qkv|in_proj_z output; row b·T + t);
    ba fp32 [B·T, 2·nv]: [b | a]; conv_w fp32 [Kc, conv_dim] tap-major; A_log, dt_bias fp32 [nv];
    norm_w fp32 [dv] (applied as w, not 1 + w); conv_state fp32 [slots, ring_rows(Kc), conv_dim] (the ring);
    ssm_state fp32 [slots, nv, dk, dv]; slot, pos int32 [B] (sequence b's first new token is at position pos[b]).
    Both states are updated in place.
    out fp32 [B·T, nv·dv] = gated_rms_norm(o, z, norm_w, eps); scratch: decode_scratch_bytes(B·T, conv_dim), or
    chunked_scratch_bytes(B, T, conv_dim, nv, dk) with chunked=True.
    Launches on `stream`: conv, the delta rule, gated norm. The delta rule is token by token, or with chunked=True
    (for long T, where chunked_supported) in chunks of CHUNK tokens: a prep launch for all chunks in parallel,
    then the state launch that walks them in order.
    """
    conv_dim = _check(mixed=mixed, ld_mixed=ld_mixed, ba=ba, conv_w=conv_w, A_log=A_log, dt_bias=dt_bias,
                      norm_w=norm_w, conv_state=conv_state, ssm_state=ssm_state, slot=slot, pos=pos, B=B, T=T,
                      nk=nk, nv=nv, dk=dk, dv=dv, Kc=Kc, out=out, scratch=scratch)
    if chunked and not chunked_supported(k, dk=dk, dv=dv):  # before any launch
        raise GpuError(f"deltanet: the chunked delta rule needs dv % {CHUNK_COLS} == 0 and "
                       f"{max(prep_smem_bytes(dk, dv), state_smem_bytes(dk, 1))} B of shared memory per block "
                       f"(dv={dv}, dk={dk})")
    M = B * T
    conv_grid = ((conv_dim + CONV_THREADS - 1) // CONV_THREADS, B, -(-T // CONV_TOKENS))
    k.launch("deltanet_conv", conv_grid, CONV_THREADS,
             [ptr(mixed), i32(ld_mixed), ptr(conv_w), ptr(conv_state), ptr(slot), ptr(pos), i32(ring_rows(Kc)),
              ptr(scratch), i32(T), i32(conv_dim), i32(Kc)], 0, stream)
    if chunked:
        chunks, rec = -(-T // CHUNK), scratch + _records_offset(M, conv_dim)
        name, smem = f"deltanet_chunk_prep_dk{dk}", prep_smem_bytes(dk, dv)
        k.opt_in_smem(name, smem)
        k.launch(name, (chunks, nv, B), CHUNK_THREADS,
                 [ptr(scratch), ptr(ba), ptr(A_log), ptr(dt_bias), ptr(rec), i32(T), i32(nk), i32(nv), i32(dv)],
                 smem, stream)
        stages = state_stages(k, dk=dk, blocks=(dv // CHUNK_COLS) * nv * B)
        name, smem = f"deltanet_chunk_state_dk{dk}" + ("" if stages == 2 else "_s1"), state_smem_bytes(dk, stages)
        k.opt_in_smem(name, smem)
        k.launch(name, (dv // CHUNK_COLS, nv, B), CHUNK_THREADS,
                 [ptr(scratch), ptr(rec), ptr(ssm_state), ptr(slot), ptr(out), i32(T), i32(nk), i32(nv), i32(dv)],
                 smem, stream)
    else:
        warps = _recurrent_warps(dv)
        k.launch(f"deltanet_recurrent_dk{dk}", (dv // (8 * warps), nv, B), 32 * warps,
                 [ptr(scratch), ptr(ba), ptr(A_log), ptr(dt_bias), ptr(ssm_state), ptr(slot), ptr(out), i32(T),
                  i32(nk), i32(nv), i32(dv)], 0, stream)
    k.launch("deltanet_gated_norm", ((M * nv + NORM_WARPS - 1) // NORM_WARPS,), 32 * NORM_WARPS,
             [ptr(out), ptr(mixed), i32(ld_mixed), i32(conv_dim), ptr(norm_w), i32(M), i32(nv), i32(dv),
              f32(eps)], 0, stream)


def prefill_scratch_bytes(T: int, conv_dim: int, nv: int, dk: int) -> int:
    """Device scratch `prefill` needs for one sequence of T tokens, either delta rule (>= decode's for B·T <= T)."""
    return chunked_scratch_bytes(1, T, conv_dim, nv, dk)


def prefill(k, *, mixed: int, ld_mixed: int, ba: int, conv_w: int, A_log: int, dt_bias: int, norm_w: int,
            conv_state: int, ssm_state: int, slot: int, pos: int, B: int, T: int, nk: int, nv: int, dk: int,
            dv: int, Kc: int, eps: float, out: int, scratch: int, stream=None) -> None:
    """Prefill of one sequence (B = 1, long T); same arguments and result as `decode`.

    The delta rule runs in chunks of CHUNK tokens (ops.gated_delta_rule_chunked) where chunked_supported, else
    token by token as decode does; the conv and the norm are parallel over tokens either way. On the H200 at
    T = 4096 the mixer takes 1.14 ms per layer chunked against 3.00 token by token at the 35B's heads, 2.33
    against 3.05 at the 27B's (perf-history.md v18).
    """
    if B != 1:
        raise GpuError(f"deltanet.prefill: B={B}, prefill takes one sequence (B=1)")
    decode(k, mixed=mixed, ld_mixed=ld_mixed, ba=ba, conv_w=conv_w, A_log=A_log, dt_bias=dt_bias, norm_w=norm_w,
           conv_state=conv_state, ssm_state=ssm_state, slot=slot, pos=pos, B=B, T=T, nk=nk, nv=nv, dk=dk, dv=dv,
           Kc=Kc, eps=eps, out=out, scratch=scratch, stream=stream, chunked=chunked_supported(k, dk=dk, dv=dv))


def step_supported(w_ba: DeviceWeight, *, T: int, dk: int, dv: int, Kc: int) -> bool:
    """Whether `step` takes these shapes: b|a stored bf16, T <= STEP_T, dv <= STEP_COLS (what one block of 4·dv
    threads holds, the C = 1 kernel, which runs every dv % 8 == 0 on every GPU)."""
    return (w_ba.fmt == "bf16" and 1 <= T <= STEP_T and dk in DK_SUPPORTED and 8 <= dv <= STEP_COLS
            and dv % 8 == 0 and 2 <= Kc <= KC_MAX)


def cluster_fits(dv: int, C: int) -> bool:
    """Whether `step` can split a head's dv columns over C blocks: whole warps of 32 / STEP_LANES[C] columns each
    (C = 1: any dv step_supported takes)."""
    return C in STEP_LANES and dv % (C * 32 // STEP_LANES[C]) == 0


def step_cluster(k, *, dv: int, dk: int = 0, nv: int = 0, B: int = 1) -> int:
    """Blocks per (value head, sequence) that `step` uses by default: STEP_CLUSTER where the GPU has thread-block
    clusters (`k.clusters`: compute capability 9.0+ running its own cubin) and dv splits into whole warps over
    them (cluster_fits: dv % 16 == 0); else 1, one block per head.

    Every phase is split C ways (the b|a dots over H, the conv channels, the columns of S, the gated norm's
    columns), so the chain of dependent latencies that bounds the step shortens, and 4·nv blocks of 256 threads
    fill the SMs that nv blocks of 512 left mostly idle (the 27B's 48 heads: 192 blocks, two per SM, one wave).
    With STEP_CLUSTER_WAVES and the launch's shape (dk, nv heads, B sequences), at B > 1: of 4, 2 (STEP_PAIRS,
    v89) and 1 blocks a head, the one whose launch takes the fewest waves (Kernels.waves: the clusters or blocks
    the GPU holds at once), the most blocks a head among equals (the shortest chain).
    """
    if not (k.clusters and cluster_fits(dv, STEP_CLUSTER)):
        return 1
    if STEP_CLUSTER_WAVES and B > 1 and dk and nv:
        sizes = [C for C in (STEP_CLUSTER, STEP_PAIR, 1) if (C != STEP_PAIR or STEP_PAIRS) and cluster_fits(dv, C)]
        return min(sizes, key=lambda C: (k.waves(step_kernel(dk, C), (C * nv, B), STEP_LANES[C] * dv // C,
                                                 cluster=(C, 1, 1) if C > 1 else None), -C))
    return STEP_CLUSTER


def step_kernel(dk: int, C: int, trail: bool = False) -> str:
    """The step's entry point on C blocks a head: deltanet_step[_trail]_dk{dk}[_c{C}] (deltanet_step.cu)."""
    return f"deltanet_step{'_trail' if trail else ''}_dk{dk}" + (f"_c{C}" if C > 1 else "")


def records_fit(k, *, dv: int, cluster: int | None = None, dk: int = 0, nv: int = 0, B: int = 1) -> bool:
    """Whether `step` can write out_records for this dv: each block holds whole 32-column chunks (dv / C a
    multiple of 32: the family's dv = 128 in one block or on clusters of 2 or 4; v89, 32 only before). cluster
    None: step_cluster's choice for the launch's shape (dk, nv, B)."""
    C = step_cluster(k, dv=dv, dk=dk, nv=nv, B=B) if cluster is None else cluster
    return dv % C == 0 and dv // C % 32 == 0


def fold_fits(*, dv: int, C: int, n: int, H: int, nv: int, ld: int | None = None) -> bool:
    """Whether `step` on C blocks a head can add the router fold of n logits (ld columns a row): each block holds
    whole fold blocks of 32 columns (STEP_FOLD[C]: dv = 128, one a block of 4, two of 2, four in one), its threads
    cover n - 1 logits (the last warp takes one more), and the fold's nv·dv / 32 blocks of 16 elements cover x
    (H <= nv·dv / 2)."""
    if C not in STEP_FOLD:
        return False
    nb, tl = STEP_FOLD[C]
    return (dv % C == 0 and dv // C == 32 * nb and n <= STEP_LANES[C] * dv // C // tl + 1 and H <= 16 * nb * C * nv
            and (ld is None or ld >= n))


def step(k, *, x: int, H: int, in_norm_w: int, eps_in: float, w_ba: DeviceWeight, mixed: int, ld_mixed: int,
         conv_w: int, A_log: int, dt_bias: int, norm_w: int, conv_state: int, ssm_state: int, slot: int, pos: int,
         B: int, T: int, nk: int, nv: int, dk: int, dv: int, Kc: int, eps: float, out: int, stream=None,
         cluster: int | None = None, ba_early: bool | None = None, out_records: int = 0,
         records_order: int = 0, fold: tuple[int, int, int, int, int, int, int] | None = None,
         trail: int = 0) -> None:
    """One decode step of B sequences × T <= 8 tokens in one launch: `decode` with b|a computed here.

    x fp32 [B·T, H]: the layer input (the residual stream, not normalised); in_norm_w fp32 [H] its RMSNorm
    weight (gain 1 + w, eps_in); w_ba bf16 [2·nv, H]: the fused in_proj_b|in_proj_a. Then
    [b|a] = rms_norm_zc(x) W_baᵀ and everything else as `decode` (same layouts, same result within fp32
    rounding).

    cluster: blocks per (value head, sequence), C. None picks step_cluster(k, dv=dv, dk=dk, nv=nv, B=B):
    STEP_CLUSTER on sm_90+ where dv allows (with STEP_CLUSTER_WAVES, at B > 1 the size whose launch takes the
    fewest waves), else 1; tests pass 1, STEP_PAIR or STEP_CLUSTER to run each kernel. C = 1 is
    deltanet_step_dk{dk}, grid (nv, B), one block of 4·dv threads per head; C > 1 is deltanet_step_dk{dk}_c{C},
    grid (C·nv, B) in clusters of (C, 1, 1), each block dv/C columns with STEP_LANES[C]·dv/C threads.
    ba_early: whether the clustered kernel computes its b|a dots before its wait on the previous kernel (x is
    written two kernels back) or after issuing the loads of mixed and z; None: H <= STEP_BA_EARLY_MAX_H. Timing
    only: the same operations in the same order either way.
    out_records (with records_order 1 or 2, linear.records_order of out_proj): also write out as out_proj's x̂,
    nv·dv/32 int16 chunk records of all B·T rows (reference.ops.act_records16 of out [B·T, nv·dv], 16-byte
    aligned; B·T <= 8), for linear.gemv's x_records; only where a block holds whole 32-column chunks
    (records_fit).
    fold (v71/v73): (mt, ms, wt, gain, acc, ld, n), router_fold's arrays on the device (fold_blocks'
    layout; gain fp32 [H] = 1 + w_post of the MoE's norm): the step also adds the next router's raw logits
    G·x_b + M·out_b of sequence b into row b of acc int64 [B, ld] (fixed point, 2^-32; n logits a row); T = 1,
    dv = 128 (32 columns a block of 4, 64 of 2 (v89), 128 in one block (v88)), H <= nv·dv / 2 (fold_fits).
    B > 1 since v87, with H % 4 == 0 (the kernel copies each row's elements of x by 16-byte cp.async).
    trail (a verification's, speculative decoding): fp32 [T - 1, B, nv, dk, dv], receives S after each token
    t < T - 1 of sequence b in row (t, b) (reference: gated_delta_rule_recurrent(..., trail=True)), so that a
    partial acceptance can keep any prefix's state; deltanet_step_trail_dk{dk}[_c{STEP_CLUSTER}], the same step
    with those stores (one block or STEP_CLUSTER a head, as one sequence takes).
    """
    _check(mixed=mixed, ld_mixed=ld_mixed, conv_w=conv_w, A_log=A_log, dt_bias=dt_bias, norm_w=norm_w,
           conv_state=conv_state, ssm_state=ssm_state, slot=slot, pos=pos, B=B, T=T, nk=nk, nv=nv, dk=dk, dv=dv, Kc=Kc,
           out=out, x=x, in_norm_w=in_norm_w, w_ba=w_ba.base)
    if not step_supported(w_ba, T=T, dk=dk, dv=dv, Kc=Kc):
        raise GpuError(f"deltanet.step: needs bf16 b|a (got {w_ba.fmt}), T <= {STEP_T} (got {T}) and "
                       f"dv <= {STEP_COLS} (got {dv}); use decode")
    if tuple(w_ba.shape) != (2 * nv, H):
        raise GpuError(f"deltanet.step: b|a weight {w_ba.name} is {list(w_ba.shape)}, expected [{2 * nv}, {H}]")
    C = step_cluster(k, dv=dv, dk=dk, nv=nv, B=B) if cluster is None else cluster
    if C not in STEP_LANES:
        raise GpuError(f"deltanet.step: cluster={C}, must be 1, {STEP_PAIR} or {STEP_CLUSTER}")
    if C > 1 and not k.clusters:
        raise GpuError(f"deltanet.step: cluster={C} needs thread-block clusters (compute capability 9.0+ with its "
                       f"own cubin); this GPU is {k.gpu.info.arch}")
    if not cluster_fits(dv, C):
        raise GpuError(f"deltanet.step: dv={dv} does not split into whole warps over cluster={C} blocks")
    if out_records and (records_order not in (1, 2) or not records_fit(k, dv=dv, cluster=C) or out_records % 16
                        or B * T > STEP_T):
        raise GpuError(f"deltanet.step: out_records needs records_order 1 or 2 (got {records_order}), whole "
                       f"32-column chunks a block (dv / cluster = {dv} / {C}), a 16-byte aligned buffer and "
                       f"B·T <= {STEP_T} rows (got {B * T})")
    if fold is not None and (T != 1 or not fold_fits(dv=dv, C=C, n=fold[6], H=H, nv=nv, ld=fold[5])
                             or (B > 1 and H % 4)):
        raise GpuError(f"deltanet.step: the router fold needs T = 1, dv = 128, at most "
                       f"{STEP_LANES[C] * dv // C // STEP_FOLD[C][1] + 1} logits, "
                       f"H <= nv·dv / 2 and, at B > 1, x's rows 16-byte aligned (H % 4 == 0) (got B={B}, T={T}, "
                       f"C={C}, dv={dv}, n={fold[6]}, H={H})")
    if trail and C not in (1, STEP_CLUSTER):
        raise GpuError(f"deltanet.step: a trail runs on one block or {STEP_CLUSTER} a head, got cluster={C}")
    fm, fs, fw, fg, fa, fld, fn = fold or (0, 0, 0, 0, 0, 0, 0)
    k.launch(step_kernel(dk, C, bool(trail)), (C * nv, B), STEP_LANES[C] * dv // C,
             [ptr(x), i32(H), ptr(in_norm_w), f32(eps_in), ptr(w_ba.base), ptr(mixed), i32(ld_mixed), ptr(conv_w),
              ptr(conv_state), i32(ring_rows(Kc)), ptr(A_log), ptr(dt_bias), ptr(norm_w), f32(eps),
              ptr(ssm_state), ptr(slot), ptr(pos), ptr(out), ptr(out_records), i32(records_order), i32(T), i32(nk),
              i32(nv), i32(dv), i32(Kc),
              i32(H <= STEP_BA_EARLY_MAX_H if ba_early is None else ba_early),
              ptr(fm), ptr(fs), ptr(fw), ptr(fg), ptr(fa), i32(fld), i32(fn)] + ([ptr(trail)] if trail else []),
             0, stream, cluster=(C, 1, 1) if C > 1 else None)
