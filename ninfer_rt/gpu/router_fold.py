"""The router fold (v71/v72): each MoE layer's router logits by linearity, two launches before its fused
MoE, so that moe_fused_acc_* routes and issues its routed tile before its wait (docs/perf.md v70-v72).

With G = W_router·diag(1 + w_post) and x_new = x + Ŵ_o·y (out_proj or o_proj adds into the residual x),
G·x_new = G·x + M·y, M = G·Ŵ_o; top-k of G·x_new is top-k of the router's logits G·x_new·rsqrt(mean x_new² + eps)
(the rsqrt is positive). The mixer's last kernel before that projection adds both terms into an int64 accumulator
per layer (2^-32 fixed point: exact in any order): on a DeltaNet layer the step (deltanet.step's fold), on an
attention layer the decode's combine (attention.decode's fold). M and W_routerᵀ are computed here, at model
construction, from the weights on the device; the artifact format does not change.
"""

from __future__ import annotations

import numpy as np

from ninfer_rt.formats import bf16_bits_to_f32, f32_to_bf16_bits, get_format, round_up
from ninfer_rt.gpu import attention, deltanet, moe
from ninfer_rt.gpu.driver import GpuError

ROUTER_FOLD = True  # planner switch: False keeps the router GEMV on every layer
# Planner switch (v87): a decode step of B > 1 sequences, one token each, folds too; its MoE routes on acc's rows
# in moe.gate_up_routed's _acc entries instead of after a router GEMV. False keeps the GEMV there.
BATCH_FOLD = True


def fold_ld(E: int) -> int:
    """Columns of the fold matrices: E + 1 (the router and the shared-expert gate) rounded up to 8 (16-byte rows)."""
    return round_up(E + 1, 8)


def router_fold(router: np.ndarray, w_post: np.ndarray, w_out: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                                  np.ndarray]:
    """The fold of one layer, transposed so that a block's rows are contiguous, ld = fold_ld(E) columns
    (the padding zero):
      mt fp16 bits [Dy, ld]: Mᵀ, M = G·Ŵ_out, G = W_router·diag(1 + w_post), each column e (one logit) scaled by
         2^s_e so that its largest |value| lies in [2^14, 2^15] (far below fp16's 65504): one fp16 rounding,
         2^-11 relative (bf16 would be 2^-8, and near ties that flips experts);
      ms fp32 [ld]: 2^-s_e, which the step multiplies its column sum by (1 where the column is zero);
      wt bf16 bits [H, ld]: W_routerᵀ, exact (the gain is applied by the kernel).
    The kernels read mt and wt in fold_blocks' layout.
    router fp32 [E + 1, H] (the bf16 weights' values), w_post fp32 [H] (centred: the gain is 1 + w), w_out fp32
    [H, Dy] (out_proj or o_proj as the GEMV reads it: codes times scales). M is formed in fp32."""
    E1, H = router.shape
    if w_post.shape != (H,) or w_out.shape[0] != H:
        raise GpuError(f"router_fold: router {list(router.shape)}, w_post {list(w_post.shape)}, "
                       f"out_proj {list(w_out.shape)} do not chain")
    ld = fold_ld(E1 - 1)
    g = router.astype(np.float32) * (1.0 + w_post.astype(np.float32))[None, :]   # g: [E+1, H]
    m = g @ w_out.astype(np.float32)                                               # m: [E+1, Dy]
    amax = np.abs(m).max(axis=1)
    s = np.where(amax > 0, 14 - np.floor(np.log2(np.where(amax > 0, amax, 1.0))), 0.0)
    ms = np.ones(ld, np.float32)
    ms[:E1] = np.ldexp(np.float32(1.0), -s.astype(np.int32))
    mt = np.zeros((w_out.shape[1], ld), np.uint16)
    mt[:, :E1] = np.ldexp(m, s.astype(np.int32)[:, None]).T.astype(np.float16).view(np.uint16)
    wt = np.zeros((H, ld), np.uint16)
    wt[:, :E1] = f32_to_bf16_bits(np.ascontiguousarray(router.T.astype(np.float32)))
    return mt, ms, wt


def fold_blocks(mt: np.ndarray, wt: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """router_fold's mt [Dy, ld] and wt [H, ld] (16-bit codes) in the folding kernels' block-major layout:
      mt [Dy, ld] -> [nb, ld, 32]: block b's rows 32b .. 32b + 31 with each column's 32 values contiguous;
      wt [H, ld]  -> [nb, ld, 16]: block b's rows 16b .. 16b + 15 the same way (rows past H zero).
    Why: thread e of a block (attn_combine_fast's, deltanet_step's) sums column e over the block's rows, so its
    values become 64 and 32 contiguous bytes (six 16-byte loads), not 48 loads a row apart with their address
    arithmetic (v73: the step's row-major reads held its tail for several round trips). Dy = 32·nb, H <= 16·nb.
    Inverse: fold_unblocks."""
    Dy, ld = mt.shape
    H = wt.shape[0]
    if Dy != 32 * nb or H > 16 * nb or wt.shape[1] != ld:
        raise GpuError(f"fold_blocks: mt {list(mt.shape)} and wt {list(wt.shape)} do not fit {nb} blocks")
    mb = np.ascontiguousarray(mt.reshape(nb, 32, ld).transpose(0, 2, 1))   # mb: [nb, ld, 32]
    wp = np.zeros((16 * nb, ld), wt.dtype)
    wp[:H] = wt
    wb = np.ascontiguousarray(wp.reshape(nb, 16, ld).transpose(0, 2, 1))   # wb: [nb, ld, 16]
    return mb, wb


def fold_unblocks(mb: np.ndarray, wb: np.ndarray, H: int) -> tuple[np.ndarray, np.ndarray]:
    """fold_blocks' inverse: mt [32·nb, ld] and wt [H, ld]."""
    nb, ld, _ = mb.shape
    return (np.ascontiguousarray(mb.transpose(0, 2, 1).reshape(32 * nb, ld)),
            np.ascontiguousarray(wb.transpose(0, 2, 1).reshape(16 * nb, ld)[:H]))


def fused_plan(k, spec, matrix, prefix: str, i: int):
    """moe.fused_kernel's moe_fused_acc plan for layer i's MoE block of one token (None where there is none)."""
    m = f"{prefix}layers.{i}.mlp."
    return moe.fused_kernel(k, matrix(m + "experts.gate_up_proj"), matrix(m + "experts.down_proj"),
                            matrix(m + "shared_expert.{gate_proj,up_proj}.weight"),
                            matrix(m + "shared_expert.down_proj.weight"), spec.num_experts_per_tok, acc=True)


def batch_reads(spec, matrix, prefix: str, i: int) -> bool:
    """Whether layer i's MoE of several rows can route on a fold (v87): gate_up_routed's _acc entries and the down's
    fast path, which zeroes acc's rows (moe.acc_fits)."""
    m = f"{prefix}layers.{i}.mlp."
    return moe.acc_fits(matrix(m + "experts.gate_up_proj"), spec.num_experts, matrix(m + "experts.down_proj"))


def fold_for(k, spec, matrix, prefix: str, folds: dict, i: int, B: int, T: int, max_rows: int) -> tuple | None:
    """The mixer's fold arguments (layer_folds') for layer i at B sequences of T tokens, when its MoE will route on
    them (ROUTER_FOLD on): one token, where the moe_fused_acc entry is planned (moe.FUSED_DECODE, the GPU);
    B <= max_rows sequences of one token each with BATCH_FOLD (v87), where gate_up_routed has its _acc entry; and
    where the mixer's kernel at B has its fold (mixer_folds). Else None: the router GEMV runs."""
    if T != 1 or not ROUTER_FOLD or i not in folds:
        return None
    ok = (fused_plan(k, spec, matrix, prefix, i) is not None if B == 1 else
          BATCH_FOLD and B <= max_rows and batch_reads(spec, matrix, prefix, i))
    return folds[i][0] if ok and mixer_folds(k, spec, i, B) else None


def mixer_folds(k, spec, i: int, B: int) -> bool:
    """Whether layer i's mixer adds a fold at B sequences of one token: an attention layer's combine wherever
    layer_folds took the layer (attention.fold_fits); a DeltaNet layer's step where the kernel it takes at B
    (deltanet.step_cluster: STEP_CLUSTER_WAVES may pick the one-block step at B > 1) has one (deltanet.fold_fits);
    at B > 1 with x's rows 16-byte aligned (H % 4 == 0)."""
    s = spec
    if B > 1 and s.hidden_size % 4:
        return False  # x's rows by 16-byte copies
    if s.layer_types[i] == "full_attention":
        return True
    dv, nv = s.linear_value_head_dim, s.linear_num_value_heads
    C = deltanet.step_cluster(k, dv=dv, dk=s.linear_key_head_dim, nv=nv, B=B)
    return deltanet.fold_fits(dv=dv, C=C, n=s.num_experts + 1, H=s.hidden_size, nv=nv)


def layer_folds(gpu, k, spec, matrix, param, kv: dict, x: int, alloc, prefix: str,
                rows: int = 1) -> dict[int, tuple[tuple, int]]:
    """For each layer whose MoE can route on a fold (ROUTER_FOLD; a kernel that reads it: the moe_fused_acc entry
    (fused_plan) or moe.gate_up_routed's _acc entries (batch_reads); a DeltaNet layer's step that folds
    (deltanet.fold_fits), an attention layer's CUDA-core decode): router_fold's arrays uploaded (alloc) and an acc int64
    [rows, fold_ld(E)] (a row a sequence) zeroed once, which the MoE zeroes again once it has routed (the fused
    kernel after its grid barrier, moe.down after its wait). matrix, param: the weights by name (prefix the text
    model's); kv: the layers' KV caches; x the residual stream. Layer -> (deltanet.step's or attention.decode's
    fold arguments, acc)."""
    s = spec
    if not (ROUTER_FOLD and s.is_moe):
        return {}
    E, dv, H = s.num_experts, s.linear_value_head_dim, s.hidden_size
    ld = fold_ld(E)
    # the step's kernel at one sequence (step_cluster), or the one-block one that B > 1 may take (v86, v88)
    step_fits = any(deltanet.fold_fits(dv=dv, C=C, n=E + 1, H=H, nv=s.linear_num_value_heads)
                    for C in {deltanet.step_cluster(k, dv=dv), 1})
    folds = {}
    for i in range(s.num_hidden_layers):
        attn = s.layer_types[i] == "full_attention"
        if not (attention.fold_fits(k, kv[i], nH=s.num_attention_heads, H=H, n=E + 1) if attn else step_fits):
            continue
        p = f"{prefix}layers.{i}."
        router = matrix(p + "mlp.{gate,shared_expert_gate}.weight")
        out_w = matrix(p + ("self_attn.o_proj.weight" if attn else "linear_attn.out_proj.weight"))
        post = param(p + "post_attention_layernorm.weight")
        reads = fused_plan(k, spec, matrix, prefix, i) is not None or batch_reads(spec, matrix, prefix, i)
        if not reads or router.fmt != "bf16" or tuple(router.shape) != (E + 1, H) or post % 16:
            continue
        r = bf16_bits_to_f32(gpu.download(router.base, (E + 1, H), np.uint16))
        w_post = gpu.download(post, (H,), np.float32)
        w_out = get_format(out_w.fmt).decode(gpu.download(out_w.base, (out_w.nbytes,), np.uint8), tuple(out_w.shape))
        mt, ms, wt = router_fold(r, w_post, w_out)
        # the kernels' block b (the combine's h·D/32 + z, the step's h·C + c) sums rows 32b.. of y and 16b.. of x;
        # the gain 1 + w_post in fp32, as the router GEMV's norm forms it
        mb, wb = fold_blocks(mt, wt, mt.shape[0] // 32)
        arrays = [mb, ms, wb, (np.float32(1.0) + w_post).astype(np.float32)]
        dev = [alloc(a.nbytes) for a in arrays]
        for dst, a in zip(dev, arrays):
            gpu.upload(dst, a)
        acc = alloc(8 * ld * rows)
        gpu.memset(acc, 0, 8 * ld * rows)
        folds[i] = ((*dev, x, acc, ld, E + 1, H) if attn else (*dev, acc, ld, E + 1), acc)
    gpu.stream.synchronize()
    return folds
