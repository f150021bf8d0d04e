"""Reference ops of the Qwen3.5/3.6 text path, naive on purpose.

Each op is plain torch over one sequence (no batch dimension), written to read like the equation in its
docstring rather than to be fast; every CUDA kernel is tested against the op of the same name. Dtype rules
follow transformers 5.23 (docs: qwen36-architecture.md §3): norms, softmaxes and the DeltaNet core compute in
fp32 and cast back to the activation dtype at the same points HF does.

Shapes use T tokens, S cached + new keys, H hidden, nH/nKV attention heads of dim d, nk/nv DeltaNet key/value
heads of dims dk/dv, C channels, K conv taps, E experts, I intermediate size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DELTA_CHUNK = 64  # chunk length of the chunked DeltaNet form (HF and FLA use 64)
L2NORM_EPS = 1e-6  # fixed in HF/FLA, independent of rms_norm_eps


# ---------------------------------------------------------------------------------------------- norms


def rms_norm_zc(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim: y = (x / sqrt(mean(x²) + eps) · (1 + w)).to(x.dtype).

    Computed in fp32; `w` is stored centred at 0, so the effective gain is 1 + w.
    Shapes: x [..., D], w [D] -> [..., D].
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + w.float())).to(x.dtype)


def act_codes16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int16 codes of an fp32 activation per 32-element chunk, as the decode GEMV stages x̂ for quantized
    weights (kernels/gemv.cuh chunk_scale): x ≈ q · d chunk by chunk.

    d = 2^(E - 140) for the biased fp32 exponent E of the chunk's largest |x| (so |x| / d < 2^14), and
    q = round-half-even(x / d), exact scaling by a power of two; E < 14 gives q = 0, d = 0; an inf or NaN
    in the chunk gives d = NaN. Every element errs by at most d / 2 <= 2^-14 of the chunk's largest |x|.
    Shapes: x [..., K] fp32, K % 32 == 0 -> q int32 [..., K] (|q| <= 2^14), d fp32 [..., K / 32].
    """
    xc = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)                 # xc: [..., K/32, 32]
    amax = xc.abs().amax(-1)
    bad = ~torch.isfinite(xc).all(-1)
    E = (amax.view(torch.int32) >> 23) & 0xFF
    tiny = E < 14
    e = torch.where(tiny | bad, torch.zeros_like(E), E - 140)
    q = torch.round(torch.ldexp(xc, -e[..., None]))
    q = torch.where((tiny | bad)[..., None], torch.zeros_like(q), q)
    d = torch.where(tiny, torch.zeros_like(amax), torch.ldexp(torch.ones_like(amax), e))
    d = torch.where(bad, torch.full_like(d, float("nan")), d)
    return q.to(torch.int32).reshape(x.shape), d


def act_records16(x: torch.Tensor, order: int) -> torch.Tensor:
    """x as the decode GEMVs stage x̂ for quantized weights, one chunk record per 32 elements of all M rows
    (kernels/xcodes.cuh qchunk_bytes(M): 72·M bytes padded to an odd number of 16-byte units, 80 at M = 1): row
    m's 32 int16 codes of act_codes16 at +64m (order 1: natural, for q8 weights; 2: each 8-block's even then odd
    elements, the nibble formats' order), then row m's d (fp32) and Σq (int32) at +64M+8m, then padding that no
    kernel reads (zero here). Little-endian. x [K] or [M, K] fp32, K % 32 == 0 -> uint8 [K/32, qchunk_bytes(M)].
    """
    rows = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)  # rows: [M, K]
    M, K = rows.shape
    units = (72 * M + 15) // 16
    rec = torch.zeros(K // 32, 16 * (units if units % 2 else units + 1), dtype=torch.uint8)
    if order not in (1, 2):
        raise ValueError(f"act_records16: order must be 1 or 2, got {order}")
    for m in range(M):
        q, d = act_codes16(rows[m])
        qc = q.reshape(-1, 32)                                                   # qc: [K/32, 32]
        if order == 2:
            qc = qc.reshape(-1, 4, 8)[:, :, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1, 32)
        rec[:, 64 * m:64 * m + 64] = qc.to(torch.int16).contiguous().view(torch.uint8)
        at = 64 * M + 8 * m
        rec[:, at:at + 4] = d.float().reshape(-1, 1).contiguous().view(torch.uint8)
        rec[:, at + 4:at + 8] = qc.sum(-1, dtype=torch.int32).reshape(-1, 1).contiguous().view(torch.uint8)
    return rec


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """DeltaNet output norm, not centred, SiLU-gated: y = ((w · n.to(dt)) · SiLU(z.float())).to(dt).

    n = o / sqrt(mean(o²) + eps) in fp32, dt = o.dtype. The normalised value is cast to dt before the
    weight multiply and the gate is applied in fp32, the cast order of HF's Qwen3_5RMSNormGated.
    Shapes: o [..., dv], z [..., dv], w [dv] -> [..., dv].
    """
    dt = o.dtype
    of = o.float()
    n = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    return ((w.to(dt) * n) * F.silu(z.float())).to(dt)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """L2-normalise the last dim: x̂ = x / sqrt(Σ x² + eps) (eps inside the root, as FLA). Shapes: [..., D]."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------- rotary


def mrope_axis(rotary_dim: int, mrope_section: tuple[int, ...] | list[int]) -> torch.Tensor:
    """Which position axis (0 = T, 1 = H, 2 = W) each rotary frequency j reads, interleaved mRoPE.

    Start with T for every j; j % 3 == 1 and j < 3·section[1] takes H; j % 3 == 2 and j < 3·section[2]
    takes W. Shape: [rotary_dim // 2] int64.
    """
    half = rotary_dim // 2
    axis = torch.zeros(half, dtype=torch.long)
    for a in (1, 2):
        for j in range(a, min(half, 3 * mrope_section[a]), 3):
            axis[j] = a
    return axis


def rope_inv_freq(rotary_dim: int, theta: float, yarn=None) -> tuple[torch.Tensor, float]:
    """Rotary frequencies and the factor that scales cos/sin, plain or YaRN (transformers' formulas, fp32).

    Plain: inv_freq[j] = 1 / θ^(2j/rot), factor 1. YaRN (`yarn` a config.Yarn; s = yarn.factor, L = the original
    context): frequencies that turn fewer than beta_slow times over L are interpolated (divided by s), those
    turning more than beta_fast times are kept, and a linear ramp over j in [lo, hi] blends the two, where
    j*(β) = rot · ln(L / (2πβ)) / (2 ln θ), lo = j*(beta_fast), hi = j*(beta_slow) (floor/ceil when truncate,
    clipped to [0, rot-1]); factor = yarn.attention_factor.
    Shape: [rot/2] fp32.
    """
    powers = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)  # θ^(2j/rot): [rot/2]
    if yarn is None:
        return 1.0 / powers, 1.0

    def ramp_point(rotations: float) -> float:
        L = yarn.original_max_position_embeddings
        return (rotary_dim * math.log(L / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = ramp_point(yarn.beta_fast), ramp_point(yarn.beta_slow)
    if yarn.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
    if lo == hi:
        hi += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)  # [rot/2]
    # same operation order as transformers, so the fp32 result is bit-identical
    keep = 1 - ramp                                                                # weight of the unscaled freq
    inv_freq = 1.0 / (yarn.factor * powers) * (1 - keep) + 1.0 / powers * keep
    return inv_freq, yarn.attention_factor


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float,
                 mrope_section: tuple[int, ...] | list[int], dtype: torch.dtype = torch.float32, yarn=None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of partial interleaved mRoPE, plain or YaRN-scaled.

    (inv_freq, a) = rope_inv_freq(rot, θ, yarn); angle[t, j] = pos[axis(j), t] · inv_freq[j] (fp32);
    cos = cat(a·cos(angle), a·cos(angle)), sin likewise, then cast to `dtype` (HF casts to the model dtype).
    Text positions are one row [T] (all three axes equal); [3, T] gives the T/H/W rows of multimodal input.
    Shapes: positions [T] or [3, T] -> cos, sin [T, rot].
    """
    if positions.dim() == 1:
        positions = positions.unsqueeze(0).expand(3, -1)
    inv_freq, scale = rope_inv_freq(rotary_dim, theta, yarn)                       # inv_freq: [rot/2]
    axis = mrope_axis(rotary_dim, mrope_section)                                   # [rot/2]
    pos = positions.float()[axis].transpose(0, 1)                                  # pos: [T, rot/2]
    angle = pos * inv_freq                                                         # angle: [T, rot/2]
    cos, sin = angle.cos() * scale, angle.sin() * scale
    return torch.cat([cos, cos], -1).to(dtype), torch.cat([sin, sin], -1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half on the first rot dims of every head; the remaining dims pass through.

    x_rot' = x_rot · cos + cat(-x_rot[rot/2:], x_rot[:rot/2]) · sin.
    Shapes: x [T, n, d], cos/sin [T, rot] -> [T, n, d].
    """
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    rotated = torch.cat([-xr[..., rot // 2:], xr[..., :rot // 2]], -1)
    xr = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([xr, xp], -1)


# ---------------------------------------------------------------------------------------------- attention


def gated_attention(q: torch.Tensor, gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA softmax attention against a KV cache, then the sigmoid output gate.

    The T queries are the last T of the S positions in k/v. Query head h reads KV head h // (nH/nKV).
    p = softmax_fp32(q·kᵀ · d^-0.5 + causal mask); o = (p · v).reshape(T, nH·d) · sigmoid(gate).
    Shapes: q [T, nH, d], gate [T, nH·d], k/v [S, nKV, d] -> [T, nH·d].
    """
    T, nH, d = q.shape
    S, nKV, _ = k.shape
    k = k.repeat_interleave(nH // nKV, dim=1)                                   # k: [S, nH, d]
    v = v.repeat_interleave(nH // nKV, dim=1)                                   # v: [S, nH, d]
    scores = torch.einsum("thd,shd->hts", q, k) * d ** -0.5                     # scores: [nH, T, S]
    # query t sits at absolute position S - T + t and sees keys 0 .. S - T + t
    future = torch.ones(T, S, dtype=torch.bool).triu(S - T + 1)
    scores = scores.masked_fill(future, float("-inf"))
    p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    o = torch.einsum("hts,shd->thd", p, v).reshape(T, nH * d)                   # o: [T, nH·d]
    return o * torch.sigmoid(gate)


# ---------------------------------------------------------------------------------------------- DeltaNet


def causal_conv1d(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time, then SiLU; returns the output and the new conv state.

    y[t, c] = SiLU(Σ_{i<K} w[c, i] · x[t-K+1+i, c]); inputs before t = 0 come from `state` (the previous K-1
    pre-conv inputs, oldest first), zeros if None. w[:, K-1] multiplies the current token.
    Shapes: x [T, C], w [C, K], state [C, K-1] -> y [T, C], new state [C, K-1].
    """
    T, C = x.shape
    K = w.shape[1]
    if state is None:
        state = torch.zeros(C, K - 1, dtype=x.dtype)
    xs = torch.cat([state.to(x.dtype), x.transpose(0, 1)], 1)                   # xs: [C, K-1+T]
    y = torch.empty_like(x)
    for t in range(T):
        y[t] = (xs[:, t:t + K] * w).sum(-1)
    return F.silu(y), xs[:, T:].clone()


def causal_conv1d_step(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of `causal_conv1d`: y = SiLU(Σ_{i<K-1} w[:, i]·state[:, i] + w[:, K-1]·x).

    Shapes: x [C], w [C, K], state [C, K-1] -> y [C], new state [C, K-1] (oldest column dropped).
    """
    window = torch.cat([state.to(x.dtype), x[:, None]], 1)                      # window: [C, K]
    return F.silu((window * w).sum(-1)), window[:, 1:].clone()


def _prepare_delta_inputs(q, k, v, g, beta):
    """fp32, L2-normalised q/k with q scaled by dk^-0.5, q/k heads repeated to the value heads (GVA)."""
    r = v.shape[1] // k.shape[1]
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k = l2norm(k.float())
    # value head j reads q/k head j // r ("grouped by key head")
    return (q.repeat_interleave(r, 1), k.repeat_interleave(r, 1), v.float(), g.float(), beta.float())


def gated_delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None = None, *, trail: bool = False
                               ) -> tuple[torch.Tensor, ...]:
    """Gated delta rule, one token at a time (the decode form), fp32 state.

    q̂ = l2norm(q)·dk^-0.5, k̂ = l2norm(k), per value head (GVA) and token t:
        S ← e^{g_t} S;  Δ = β_t (v_t − Sᵀk̂_t);  S ← S + k̂_t Δᵀ;  o_t = Sᵀ q̂_t
    Shapes: q/k [T, nk, dk], v [T, nv, dv], g/beta [T, nv], state [nv, dk, dv] fp32
    -> o [T, nv, dv] in q.dtype, new state [nv, dk, dv] fp32; with trail, also the state after each token
    [T, nv, dk, dv] (its last row is the new state): a verification keeps any prefix of its tokens from it.
    """
    dtype = q.dtype
    q, k, v, g, beta = _prepare_delta_inputs(q, k, v, g, beta)
    T, nv, dv = v.shape
    S = torch.zeros(nv, k.shape[-1], dv) if state is None else state.float().clone()
    o = torch.empty(T, nv, dv)
    states = []
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        u = torch.einsum("hkv,hk->hv", S, k[t])                                 # u: [nv, dv] = Sᵀ k̂
        delta = beta[t][:, None] * (v[t] - u)
        S = S + k[t][:, :, None] * delta[:, None, :]
        o[t] = torch.einsum("hkv,hk->hv", S, q[t])
        if trail:
            states.append(S)
    return (o.to(dtype), S, torch.stack(states)) if trail else (o.to(dtype), S)


def conv_state_trail(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The conv state `causal_conv1d` would leave after each of x's tokens: x [T, C], state [C, K-1] ->
    [T, C, K-1], row t the K-1 pre-conv inputs ending at token t (oldest first)."""
    K1 = state.shape[1]
    xs = torch.cat([state.to(x.dtype), x.transpose(0, 1)], 1)                   # xs: [C, K-1+T]
    return torch.stack([xs[:, t + 1:t + 1 + K1] for t in range(x.shape[0])])


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor | None = None, chunk: int = DELTA_CHUNK
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over chunks of C tokens (the prefill form); same result as the recurrent form.

    T is right-padded to a multiple of C with q = k = v = β = g = 0. Per value head and chunk, rows r, s < C:
        γ_r = Σ_{u≤r} g_u;  A_rs = β_r (k̂_r·k̂_s) e^{γ_r−γ_s} for s < r, else 0;  Tinv = (I + A)^-1
        U = Tinv (β ⊙ V);  W = Tinv (β e^γ ⊙ K);  V' = U − W S_in
        O = (q̂ ⊙ e^γ) S_in + [(q̂ k̂ᵀ) ⊙ D] V'    with D_rs = e^{γ_r−γ_s} for s ≤ r, else 0
        S_out = e^{γ_{C−1}} S_in + (k̂ ⊙ e^{γ_{C−1}−γ})ᵀ V'
    Shapes and dtypes as `gated_delta_rule_recurrent`.
    """
    dtype = q.dtype
    q, k, v, g, beta = _prepare_delta_inputs(q, k, v, g, beta)
    T, nv, dv = v.shape
    dk = k.shape[-1]
    pad = (-T) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    # head-major for batched matmuls: q/k [nv, T', dk], v [nv, T', dv], g/beta [nv, T']
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)

    S = torch.zeros(nv, dk, dv) if state is None else state.float().clone()
    eye = torch.eye(chunk)
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril()                   # s ≤ r
    o = torch.empty(nv, T + pad, dv)
    for c0 in range(0, T + pad, chunk):
        qc, kc, vc = q[:, c0:c0 + chunk], k[:, c0:c0 + chunk], v[:, c0:c0 + chunk]
        bc = beta[:, c0:c0 + chunk, None]                                       # bc: [nv, C, 1]
        gam = g[:, c0:c0 + chunk].cumsum(-1)                                    # γ: [nv, C]
        # mask before exp: for s > r, γ_r − γ_s ≥ 0 and may overflow
        D = (gam[:, :, None] - gam[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # D: [nv, C, C]
        A = bc * (kc @ kc.transpose(1, 2)) * D * (1 - eye)                      # A: strictly lower
        U = torch.linalg.solve_triangular(eye + A, bc * vc, upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(eye + A, bc * gam.exp()[..., None] * kc, upper=False,
                                          unitriangular=True)
        Vp = U - W @ S                                                          # V': [nv, C, dv]
        o[:, c0:c0 + chunk] = (qc * gam.exp()[..., None]) @ S + ((qc @ kc.transpose(1, 2)) * D) @ Vp
        g_last = gam[:, -1:]                                                    # γ_{C−1}: [nv, 1]
        S = g_last.exp()[..., None] * S + (kc * (g_last - gam).exp()[..., None]).transpose(1, 2) @ Vp
    return o[:, :T].transpose(0, 1).to(dtype), S


# ---------------------------------------------------------------------------------------------- FFN


def swiglu_mlp(h: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """Dense SwiGLU: y = (SiLU(h Wgᵀ) ⊙ (h Wuᵀ)) Wdᵀ. Shapes: h [T, H], Wg/Wu [I, H], Wd [H, I] -> [T, H]."""
    return (F.silu(h @ gate_w.T) * (h @ up_w.T)) @ down_w.T


def moe(h: torch.Tensor, router_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
        shared_gate_w: torch.Tensor, shared_up_w: torch.Tensor, shared_down_w: torch.Tensor,
        shared_expert_gate_w: torch.Tensor) -> torch.Tensor:
    """Sparse MoE with one sigmoid-gated shared expert.

    p = softmax_fp32(h Wrᵀ); (w, e) = topk(p, k); w = (w / Σw).to(dtype)   (always renormalised)
    routed = Σ_j w_j · SwiGLU_{e_j}(h), expert e's gate rows are gate_up[e, :I], up rows gate_up[e, I:]
    (each token's terms added in expert-id order)
    y = routed + sigmoid(h Wsgᵀ) · SwiGLU_shared(h)
    Shapes: h [T, H], Wr [E, H], gate_up [E, 2I, H], down [E, H, I], shared Wg/Wu [Is, H], Wd [H, Is],
    Wsg [1, H] -> [T, H].
    """
    logits = h @ router_w.T                                                     # logits: [T, E]
    probs = torch.softmax(logits.float(), dim=-1)
    w, e = torch.topk(probs, top_k, dim=-1)                                     # w, e: [T, k]
    w = (w / w.sum(-1, keepdim=True)).to(h.dtype)
    I = down.shape[2]
    routed = torch.zeros_like(h)
    for ex in e.unique().tolist():  # each routed expert once over its tokens, in id order (as transformers does)
        t, j = torch.where(e == ex)                                             # t: its tokens, j: their slots
        y = swiglu_mlp(h[t], gate_up[ex, :I], gate_up[ex, I:], down[ex])       # y: [n, H]
        routed.index_add_(0, t, w[t, j, None] * y)
    shared = swiglu_mlp(h, shared_gate_w, shared_up_w, shared_down_w)
    return routed + torch.sigmoid(h @ shared_expert_gate_w.T) * shared
