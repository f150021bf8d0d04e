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

import numpy as np

from ninfer_rt.errors import NinferError
from ninfer_rt.gpu import linear, misc

MTP = "mtp."
CHAIN_MAX = 7  # chained rows a call takes: a verification feeds at most 8 tokens, the last real one and 7 drafts


def alloc(m) -> None:
    """The head's own buffers on model m (a GpuModel): h in, fp32 [rows, H]; [e | g], fp32 or bf16 [rows, 2H];
    a chain's picks, int32 [CHAIN_MAX + 1]."""
    m.buf.hin = m._alloc(m.rows * m.H * 4)
    m.buf.cat = m._alloc(m.rows * 2 * m.H * 4)
    m.buf.picks = m._alloc(4 * (CHAIN_MAX + 1))


def chain(m, rows: int, pos: int, slot: int, count: int, vocab: int, *, graph: bool = True) -> np.ndarray:
    """After m.draft over `rows` rows (its last row's output in buf.h, its draft logits in logits row 0): that
    row's pick (arg-max over ids < vocab), then `count` more head rows at positions pos .. pos + count - 1, each
    pairing the head's previous output with the previous pick, all enqueued before one download: int32 [count + 1].
    The picks and hidden rows move by device copies, so the host waits once, not once a row."""
    if not 0 <= count <= CHAIN_MAX or not 1 <= vocab <= m.V or not 1 <= rows <= m.rows:
        raise NinferError(f"chain: {count} rows (at most {CHAIN_MAX}) of picks over {vocab} ids after {rows} rows")
    m._check([pos], max(count, 1), [slot])
    b, g = m.buf, m.gpu
    last = b.h + 4 * (rows - 1) * m.H
    misc.argmax(m.k, logits=b.logits, ld=m.V, M=1, V=vocab, out=b.picks, scratch=b.scratch)
    g.upload(m.slot, np.asarray([slot], np.int32), stream=g.stream)  # the rows' slot, once; positions go a row
    for i in range(count):
        g.copy(b.tokens, b.picks + 4 * i, 4, stream=g.stream)
        g.copy(b.hin, last, 4 * m.H, stream=g.stream)
        g.upload(m.pos, np.asarray([pos + i], np.int32), stream=g.stream)
        bucket = m.bucket(pos + i + 1)
        g.pdl = g.pdl_capable
        m._graphed(("mtp", 1, bucket), lambda: step(m, 1, bucket, prefill=False), graph)
        misc.argmax(m.k, logits=b.logits, ld=m.V, M=1, V=vocab, out=b.picks + 4 * (i + 1), scratch=b.scratch)
        last = b.h
    return g.download(b.picks, (count + 1,), np.int32)


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
    m._lm_head(x=b.h + 4 * (T - 1) * H, M=1, pick=(b.argmax, m.sample_vocab, b.scratch))
