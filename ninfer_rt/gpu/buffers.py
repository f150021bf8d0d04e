"""A GpuModel's activation buffers: what one step of up to `rows` rows (M = B·T at decode, a prompt chunk at
prefill) reads and writes besides the caches and the weights. Device addresses; fp32 unless named 16 (bf16)."""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_rt.formats import round_up
from ninfer_rt.gpu import attention, deltanet, gemm, linear, misc
from ninfer_rt.gpu.weights import k_view


@dataclass
class Buffers:
    """Activation buffers for up to `rows` rows (device addresses)."""

    rows: int
    x: int = 0
    h: int = 0
    h16: int = 0      # bf16 copies of h, o and act_s: the prefill GEMMs' inputs (the decode GEMVs read fp32)
    o16: int = 0
    act_s16: int = 0
    shared_y: int = 0  # decode: the shared expert's output, before its gate (moe.down adds it)
    mixed: int = 0
    ba: int = 0
    q: int = 0
    o: int = 0
    router: int = 0
    ids: int = 0
    wts: int = 0
    sscale: int = 0
    act: int = 0
    act_s: int = 0
    slot_y: int = 0     # prefill MoE (ordered_moe): the routed outputs, one fp32 row a slot (over `mixed`)
    act_rec: int = 0    # decode: the dense SwiGLU output as the down's x̂ records, as (value, 1) pairs, and
    act_pairs: int = 0  # the gate/up's chunk counters of two parities
    act_cnt: int = 0
    tokens: int = 0
    logits: int = 0
    argmax: int = 0
    amax: int = 0       # the lm_head GEMV's arg-max keys and ticket (linear.ARGMAX_BYTES, zero between launches)
    scratch: int = 0
    wscratch: int = 0        # gemm "wgmma_ss": a quantized layer matrix dequantized to bf16 (0: none)
    wscratch_bytes: int = 0


def alloc(m, rows: int, *, decode_rows: int, layer_prefix: str) -> Buffers:
    """The buffers of GpuModel m for `rows` rows (decode steps take up to decode_rows; the layers' matrices are
    named from layer_prefix); also sets m.o_cols and m.ffn_cols (the mixer output's and the SwiGLU's widths) and,
    for an MoE model, m._moe_barrier (moe.fused's grid barrier)."""
    s = m.spec
    b = Buffers(rows)
    f = 4
    b.x, b.h = m._alloc(rows * m.H * f), m._alloc(rows * m.H * f)
    # the mixer's projections; dead once the mixer has added its output, so a prompt chunk's MoE block keeps its
    # routed rows there (ordered_moe, gemm.moe_grouped's slot_y: fp32 [rows · top_k, H])
    slot_bytes = rows * s.num_experts_per_tok * m.H * f if m.ordered_moe else 0
    b.mixed = m._alloc(max(rows * m.mixed_cols * f, slot_bytes))
    b.slot_y = b.mixed if m.ordered_moe else 0
    b.ba = m._alloc(rows * 2 * max(s.linear_num_value_heads, 1) * f)
    b.q = m._alloc(rows * s.num_attention_heads * s.head_dim * f)
    m.o_cols = max(s.num_attention_heads * s.head_dim, s.value_dim)
    b.o = m._alloc(rows * m.o_cols * f)
    b.h16, b.o16 = m._alloc(rows * m.H * 2), m._alloc(rows * m.o_cols * 2)
    # a decode step's mixer output as out_proj's / o_proj's x̂ chunk records of its rows (deltanet.step,
    # attention.decode; linear.records_rows)
    b.o_rec = m._alloc(max(m.o_cols // 32, 1) * linear.x_chunk_bytes(linear.RECORDS_MAX_M, True))
    if s.is_moe:
        E, k = s.num_experts, s.num_experts_per_tok
        b.router = m._alloc(rows * (E + 1) * f)
        b.ids, b.wts, b.sscale = m._alloc(rows * k * 4), m._alloc(rows * k * f), m._alloc(rows * f)
        b.act = m._alloc(rows * k * s.moe_intermediate_size * f)  # fp32 (decode) or bf16 (prefill)
        b.shared_y = m._alloc(decode_rows * m.H * f)
        m._moe_barrier = m._alloc(4)  # moe.fused's grid barrier: zero once, each launch leaves it ready
        m.gpu.memset(m._moe_barrier, 0, 4)
        m.ffn_cols = round_up(s.shared_expert_intermediate_size, 32)
    else:
        m.ffn_cols = round_up(s.intermediate_size, 32)
        # one token's SwiGLU output as the down's x̂ records, as the gate/up's (value, 1) pairs and its two
        # parities of chunk counters (zero once; the launches keep them so)
        b.act_rec = m._alloc(m.ffn_cols // 32 * linear.x_chunk_bytes(1, True))
        pair_bytes, cnt_bytes = m.ffn_cols * 8, 2 * (m.ffn_cols // 32) * 4  # uint64 [F], uint32 [2, F/32]
        b.act_pairs = m._alloc(pair_bytes + cnt_bytes)
        b.act_cnt = b.act_pairs + pair_bytes
        m.gpu.memset(b.act_pairs, 0, pair_bytes + cnt_bytes)
    # SwiGLU output, its row padded to a multiple of 32 with zeros that no kernel writes (see k_view)
    b.act_s, b.act_s16 = m._alloc(rows * m.ffn_cols * f), m._alloc(rows * m.ffn_cols * 2)
    m.gpu.memset(b.act_s, 0, rows * m.ffn_cols * f)
    m.gpu.memset(b.act_s16, 0, rows * m.ffn_cols * 2)
    b.tokens = m._alloc(rows * 4)
    b.logits = m._alloc(m.logit_rows * m.V * f)
    b.argmax = m._alloc(m.logit_rows * 4)
    b.amax = m._alloc(linear.ARGMAX_BYTES)
    m.gpu.memset(b.amax, 0, linear.ARGMAX_BYTES)
    scratch = max(
        attention.decode_scratch_bytes(rows, s.num_attention_heads, s.head_dim, m.max_ctx),
        deltanet.prefill_scratch_bytes(rows, s.conv_dim, s.linear_num_value_heads, s.linear_key_head_dim),
        misc.argmax_scratch_bytes(m.logit_rows),
        gemm.moe_scratch_bytes(rows, s.num_experts_per_tok, s.num_experts) if s.is_moe else 0)
    b.scratch = m._alloc(scratch)
    # the prefill GEMMs' dequantized weights (gemm "wgmma_ss", H100/H200): room for the largest layer matrix
    ss = m.gemm_kernel == "wgmma_ss" or (m.gemm_kernel == "auto" and rows >= gemm.WGMMA_SS_MIN_ROWS)
    if ss and gemm.wgmma_available(m.k):
        b.wscratch_bytes = max((gemm.dequant_bytes(k_view(w)) for name, w in m.w.matrices.items()
                                if name.startswith(layer_prefix) and w.quantized and len(w.shape) == 2),
                               default=0)
        b.wscratch = m._alloc(b.wscratch_bytes) if b.wscratch_bytes else 0
    return b
