"""The feed-forward half of a layer on the GPU: which launches run the sparse MoE block or the dense MLP.

Both read the residual stream after the mixer and add their output into it (x: [M, H] fp32, M = B·T rows):

    MoE:  logits = [W_router | w_shared_gate] h          # [M, E + 1], none where the mixer folded them (router_fold)
          ids, weights = top-k softmax(logits[:, :E])   # [M, k]
          x += Σ_j weights[:, j] · down_ids(SwiGLU(gate_up_ids h)) + σ(logits[:, E]) · shared(h)
    MLP:  x += down(SwiGLU(gate_up h))

h = rms_norm(x, post_attention_layernorm) is materialised only for a prompt chunk (src, bf16); at decode every
consumer normalises x itself (norm_w). The shapes of each path:
- a prompt chunk (prefill): the router GEMM and moe.route, the experts grouped by id (gemm.moe_grouped), the shared
  expert as two GEMMs, its gate a row scale of the down;
- one token (M = 1): the MoE block in one launch after the router (moe.fused, a grid barrier inside);
- several rows (B sequences, or a verification's T tokens): the routed gate/up (routing inside) and down on the main
  stream, the shared expert's two GEMVs on a side stream of the greatest priority (v90), joined at the down, which
  adds the shared output times its gate.
"""

from __future__ import annotations

from ninfer_rt.gpu import gemm, linear, moe, router_fold
from ninfer_rt.gpu.weights import k_view


def moe_block(m, i: int, prefix: str, M: int, *, src: int, norm_w: int, post: int, folded: bool,
              prefill: bool) -> None:
    """Layer i's MoE block (weights under `prefix`, "…layers.{i}.mlp.") on model m (a GpuModel) for M rows: src
    is h (bf16, prefill) or x (decode, normalised by norm_w = post); `folded` says the mixer's launch added the
    router's logits into layer i's fold accumulator (router_fold), so no router GEMV runs."""
    s, b, W, K = m.spec, m.buf, m.w.matrix, m.k
    E, k = s.num_experts, s.num_experts_per_tok
    routing = dict(ids=b.ids, weights=b.wts, shared_scale=b.sscale)
    router = W(prefix + "{gate,shared_expert_gate}.weight")
    shared_gate_up = W(prefix + "shared_expert.{gate_proj,up_proj}.weight")
    shared_down = W(prefix + "shared_expert.down_proj.weight")
    gate_up, down = W(prefix + "experts.gate_up_proj"), W(prefix + "experts.down_proj")
    if prefill:  # tokens grouped by expert, each expert's weights read once per tile
        m._linear(router, x=src, M=M, y=b.router)
        moe.route(K, logits=b.router, ld=E + 1, M=M, E=E, top_k=k, **routing)
        gemm.moe_grouped(K, gate_up, down, x=src, M=M, ids=b.ids, weights=b.wts, top_k=k, act=b.act, y=b.x,
                         scratch=b.scratch, kernel=m.gemm_kernel, slot_y=b.slot_y)
        m._linear(shared_gate_up, x=src, M=M, y=b.act_s16, mode="swiglu", ldy=m.ffn_cols)
        m._linear(shared_down, x=b.act_s16, M=M, y=b.x, mode="add", row_scale=b.sscale)
        return
    # one token: the router GEMV (none where the mixer folded it), then the rest of the block in one launch
    plan = moe.fused_kernel(K, gate_up, down, shared_gate_up, shared_down, k, acc=folded) \
        if M == 1 and post % 16 == 0 else None
    # _fold_for planned this same entry (same arguments) before the step folded, so it exists; at M > 1 it
    # checked gate_up_routed's _acc entry (v87)
    assert plan is not None or not folded or M > 1, f"layer {i}: the step folded but no MoE reads acc"
    acc = m._folds[i][1] if folded else 0
    if plan is None:
        # the shared expert needs only x, so it runs on the side stream beside the router and the routed gate/up
        # (which normalise x themselves); moe.down adds its output times its gate
        m._fork.record(m.gpu.stream)
        m.side.wait(m._fork)
        m._linear(shared_gate_up, x=b.x, M=M, y=b.act_s, mode="swiglu", ldy=m.ffn_cols, norm_w=post,
                  stream=m.side)
        m._linear(shared_down, x=b.act_s, M=M, y=b.shared_y, stream=m.side)
        m._join.record(m.side)
    if not acc:  # with the fold the step (combine) two launches back computed the router's logits
        m._linear(router, x=src, M=M, y=b.router, norm_w=norm_w)
    if plan is not None:
        moe.fused(K, plan, gate_up, down, shared_gate_up, shared_down, x=b.x, norm_w=post, eps=s.rms_norm_eps,
                  logits=b.router, E=E, top_k=k, act=b.act, act_s=b.act_s, barrier=m._moe_barrier, acc=acc,
                  **routing)
        return
    # with the fold (v87) every row routes on acc before the kernel's wait; the down zeroes acc
    ld = router_fold.fold_ld(E) if acc else E + 1
    moe.gate_up_routed(K, gate_up, x=b.x, norm_w=post, eps=s.rms_norm_eps, logits=0 if acc else b.router, ld=ld,
                       M=M, E=E, top_k=k, act=b.act, acc=acc, **routing)
    m.gpu.stream.wait(m._join)
    moe.down(K, down, act=b.act, ids=b.ids, weights=b.wts, M=M, top_k=k, y=b.x, extra=b.shared_y,
             extra_scale=b.sscale, acc=acc, acc_ld=ld if acc else 0)


def dense_mlp(m, i: int, prefix: str, M: int, *, src: int, norm_w: int, prefill: bool) -> None:
    """Layer i's dense SwiGLU MLP on model m for M rows (src and norm_w as moe_block's)."""
    s, b, W, K = m.spec, m.buf, m.w.matrix, m.k
    act = b.act_s16 if prefill else b.act_s
    gate_up, down = k_view(W(prefix + "{gate_proj,up_proj}.weight")), k_view(W(prefix + "down_proj.weight"))
    if M == 1 and linear.SWIGLU_OUT_RECORDS and linear.y_records_fit(K, gate_up) and linear.records_fit(K, down):
        # the gate/up's blocks code act straight into the down's x̂ records (act is not written); consecutive
        # layers alternate the counters' parity (an odd layer count only costs a wait now and then)
        rec = (b.act_rec, b.act_pairs, b.act_cnt, linear.records_order(down), i & 1)
        linear.gemv(K, gate_up, x=src, M=1, y=act, mode="swiglu", ldy=m.ffn_cols, norm_w=norm_w,
                    norm_eps=s.rms_norm_eps, y_records=rec)
        linear.gemv(K, down, x=b.act_rec, M=1, y=b.x, mode="add", x_records=True)
    else:
        m._linear(gate_up, x=src, M=M, y=act, mode="swiglu", ldy=m.ffn_cols, norm_w=norm_w)
        m._linear(down, x=act, M=M, y=b.x, mode="add")
