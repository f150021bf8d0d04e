"""The checkpoint's multi-token-prediction head on the GPU: one step of its draft forward (speculative decoding).

Row t of a step pairs h_t, the main model's post-norm hidden state at position p + t (or the head's own output when a
draft chains on), with ids[t], the token after it (qwen36-architecture.md §5; reference: ReferenceModel.mtp_forward):

    e = rms_norm(embed(ids), pre_fc_norm_embedding);  g = rms_norm(h, pre_fc_norm_hidden)    # e, g: [T, H]
    u = fc [e | g]                                                                            # u: [T, H]
    u = decoder layer mtp.layers.0 (gated attention over its own KV cache + the MoE block)
    out = rms_norm(u, mtp.norm);  logits = lm_head(out[T - 1])                                # the next draft's

The decoder layer is GpuModel._layer at index num_hidden_layers (its prefix `mtp.layers.0.`, its KV cache kv[L]); the
rest reuses the main model's kernels and buffers: ids in buf.tokens, h uploaded into buf.hin, out left in buf.h.
"""

from __future__ import annotations

from ninfer_rt.gpu import linear, misc

MTP = "mtp."


def alloc(m) -> None:
    """The head's own buffers on model m (a GpuModel): h in, fp32 [rows, H]; [e | g], fp32 or bf16 [rows, 2H]."""
    m.buf.hin = m._alloc(m.rows * m.H * 4)
    m.buf.cat = m._alloc(m.rows * 2 * m.H * 4)


def step(m, T: int, ctx_bucket: int, *, prefill: bool) -> None:
    """Enqueue the head over T rows of one sequence whose ids, pos and slot are on the device and whose h is in
    buf.hin; prefill: more rows than the GEMVs take (bf16 [e | g] for the GEMM)."""
    s, b, P = m.spec, m.buf, m.w.param
    H, eps = m.H, s.rms_norm_eps
    out, size = ("bf16", 2) if prefill else ("f32", 4)
    linear.embed(m.k, m.embed_w, ids=b.tokens, M=T, out=b.x)
    misc.rms_norm(m.k, x=b.x, y=b.cat, M=T, D=H, w=P(MTP + "pre_fc_norm_embedding.weight"), eps=eps, ldy=2 * H,
                  out=out)
    misc.rms_norm(m.k, x=b.hin, y=b.cat + size * H, M=T, D=H, w=P(MTP + "pre_fc_norm_hidden.weight"), eps=eps,
                  ldy=2 * H, out=out)
    m._linear(m.w.matrix(MTP + "fc.weight"), x=b.cat, M=T, y=b.x)
    m._layer(s.num_hidden_layers, 1, T, ctx_bucket)
    misc.rms_norm(m.k, x=b.x, y=b.h, M=T, D=H, w=P(MTP + "norm.weight"), eps=eps, out="f32")
    m._linear(m.lm_head, x=b.h + 4 * (T - 1) * H, M=1, y=b.logits)
    misc.argmax(m.k, logits=b.logits, ld=m.V, M=1, V=m.sample_vocab, out=b.argmax, scratch=b.scratch)
