"""The token-mixing half of a layer on the GPU: which launches run gated attention or the Gated DeltaNet.

Both read the layer input x: [M, H] fp32 (M = B·T rows), normalised by input_layernorm (src: h in bf16 for a prompt
chunk; at decode x itself, each projection normalising as it stages it, norm_w), and add their output projection
into x:

    attention:  [q|k|v|gate] = W h;  q̂, k̂ = rope(norm(q), norm(k)) (k, v into the cache);  o = attend(q̂, cache) ⊙ σ(gate)
                x += W_o o
    DeltaNet:   [qkv|z] = W h;  [b|a] = W h;  o = gated_norm(delta_rule(conv(qkv), b, a), z);  x += W_out o

A decode step (M <= 8) runs attention as q|k|v|gate GEMV, prepare, split-KV decode, combine, o_proj, and the DeltaNet
as in_proj GEMV, the one-launch step (deltanet.step: b|a, conv, delta rule, norm) and out_proj. Where it fits,
the combine or the step also writes o as o_proj's / out_proj's x̂ records (linear.records_rows), and adds the next
router's logits into the fold accumulator (router_fold), so that the MoE after them needs no router GEMV: each
function returns whether it did.
"""

from __future__ import annotations

from ninfer_rt.gpu import attention as attention_ops
from ninfer_rt.gpu import deltanet as deltanet_ops
from ninfer_rt.gpu import linear
from ninfer_rt.gpu.weights import k_view


def attention(m, i: int, prefix: str, B: int, T: int, ctx_bucket: int, *, src: int, norm_w: int,
              prefill: bool) -> bool:
    """Layer i's gated attention (weights under `prefix`, "…self_attn.") on model m (a GpuModel), its KV cache
    m.kv[i]; prefill: more rows than the GEMVs take (the projections on the GEMM). Returns whether the combine
    folded the next router's logits."""
    s, b, W, P, K = m.spec, m.buf, m.w.matrix, m.w.param, m.k
    M = B * T
    m._linear(W(prefix + "{q_proj,k_proj,v_proj}.weight"), x=src, M=M, y=b.mixed, ldy=m.qkvg_cols, norm_w=norm_w)
    attention_ops.prepare(K, qkvg=b.mixed, ld=m.qkvg_cols, q_norm=P(prefix + "q_norm.weight"),
                          k_norm=P(prefix + "k_norm.weight"), inv_freq=m.inv_freq, rope_scale=m.rope_scale,
                          rot=s.rotary_dim, pos=m.pos, slot=m.slot, B=B, T=T, nH=s.num_attention_heads,
                          eps=s.rms_norm_eps, cache=m.kv[i], q_out=b.q)
    gate = b.mixed + 4 * (s.num_attention_heads + 2 * s.num_key_value_heads) * s.head_dim
    attend = dict(q=b.q, gate=gate, ld_gate=m.qkvg_cols, pos=m.pos, slot=m.slot, T=T, nH=s.num_attention_heads,
                  cache=m.kv[i], out=b.o, scratch=b.scratch, ctx_bucket=ctx_bucket)
    o_w, rec = k_view(W(prefix + "o_proj.weight")), False
    fold = m._fold_for(i, B, T)  # None unless one token a sequence: never a prompt chunk's
    if B == 1 and prefill:  # a prompt chunk: bf16 q and p, as its GEMMs' bf16 inputs
        attention_ops.prefill(K, **attend)
    elif linear.records_rows(B, T) and attention_ops.COMBINE_OUT_RECORDS and linear.records_fit(K, o_w, M):
        # a decode step: o also as o_proj's x̂ records where the combine can write them
        rec = attention_ops.decode(K, B=B, **attend, out_records=b.o_rec, records_order=linear.records_order(o_w),
                                   fold=fold)
    else:
        attention_ops.decode(K, B=B, **attend, fold=fold)
    if rec:
        linear.gemv(K, o_w, x=b.o_rec, M=M, y=b.x, mode="add", x_records=True)
    else:
        m._linear(o_w, x=m._o_input(M, s.num_attention_heads * s.head_dim), M=M, y=b.x, mode="add")
    return fold is not None


def deltanet(m, i: int, prefix: str, B: int, T: int, *, src: int, norm_w: int, prefill: bool,
             trail: bool = False) -> bool:
    """Layer i's Gated DeltaNet (weights under `prefix`, "…linear_attn.") on model m, its states m.conv_state[i]
    and m.ssm_state[i]; prefill as `attention`'s; trail: a verification's (GpuModel.verify), each token's state
    kept. Returns whether the step folded the next router's logits."""
    s, b, W, P, K = m.spec, m.buf, m.w.matrix, m.w.param, m.k
    M = B * T
    cols = s.conv_dim + s.value_dim
    w_ba = W(prefix + "{in_proj_b,in_proj_a}.weight")
    m._linear(W(prefix + "{in_proj_qkv,in_proj_z}.weight"), x=src, M=M, y=b.mixed, ldy=cols, norm_w=norm_w)
    dims = dict(nk=s.linear_num_key_heads, nv=s.linear_num_value_heads, dk=s.linear_key_head_dim,
                dv=s.linear_value_head_dim, Kc=s.linear_conv_kernel_dim)
    mix = dict(mixed=b.mixed, ld_mixed=cols, conv_w=P(prefix + "conv1d.weight"), A_log=P(prefix + "A_log"),
               dt_bias=P(prefix + "dt_bias"), norm_w=P(prefix + "norm.weight"), conv_state=m.conv_state[i],
               ssm_state=m.ssm_state[i], slot=m.slot, pos=m.pos, B=B, T=T, eps=s.rms_norm_eps, out=b.o, **dims)
    out_w, rec, fold = k_view(W(prefix + "out_proj.weight")), 0, None
    if not prefill and deltanet_ops.step_supported(w_ba, T=T, dk=dims["dk"], dv=dims["dv"], Kc=dims["Kc"]):
        # one launch from x to y: b|a (input norm folded in), conv, delta rule, gated norm; y also as out_proj's x̂
        # records (linear.records_rows) where both kernels can (out_proj then skips coding)
        if (linear.records_rows(B, T) and deltanet_ops.STEP_OUT_RECORDS
                and deltanet_ops.records_fit(K, dv=dims["dv"], dk=dims["dk"], nv=dims["nv"], B=B)
                and linear.records_fit(K, out_w, M)):
            rec = b.o_rec
        fold = m._fold_for(i, B, T)
        deltanet_ops.step(K, x=b.x, H=m.H, in_norm_w=norm_w, eps_in=s.rms_norm_eps, w_ba=w_ba, **mix,
                          out_records=rec, records_order=linear.records_order(out_w) if rec else 0, fold=fold,
                          trail=m._trails[i] if trail else 0)
    else:
        m._linear(w_ba, x=src, M=M, y=b.ba, norm_w=norm_w)
        # one sequence's prompt chunk: the delta rule in chunks, not token by token
        run = deltanet_ops.prefill if B == 1 and T > deltanet_ops.STEP_T else deltanet_ops.decode
        run(K, ba=b.ba, scratch=b.scratch, **mix)
    if rec:
        linear.gemv(K, out_w, x=rec, M=M, y=b.x, mode="add", x_records=True)
    else:
        m._linear(out_w, x=m._o_input(M, s.value_dim), M=M, y=b.x, mode="add")
    return fold is not None
