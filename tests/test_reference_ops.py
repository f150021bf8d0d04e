"""Reference ops against transformers' own Qwen3.5 functions and modules, and against closed-form maths.

Tolerances. Where our op performs the same fp32 (or bf16) operations in the same order as HF, the check is
bit-exact. Elsewhere only the summation order differs: fp32 unit roundoff is u = 2^-24 ≈ 6e-8, and every
reduction here has n ≤ 128 terms, so the worst-case relative error n·u ≈ 8e-6 stays under rel = 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe

from hf_tiny import assert_close_rel, text_config_kwargs
from ninfer_rt.config import ModelSpec
from ninfer_rt.reference import ops

FP32_REL = 1e-5  # n·u for reductions of n ≤ 128 fp32 terms (module docstring)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here works on tiny tensors (see conftest.one_thread)."""


def gen(seed: int) -> torch.Generator:
    """A seeded CPU generator."""
    return torch.Generator().manual_seed(seed)


def rand(*shape, seed: int = 0, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    """Seeded N(0, scale²) values of `shape`, then cast to `dtype`."""
    return (scale * torch.randn(*shape, generator=gen(seed))).to(dtype)


def decay_inputs(T: int, nv: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """g ≤ 0 and β in (0, 1) distributed as the model makes them (A = U(0.01, 16), as hf_tiny)."""
    g_ = gen(seed)
    A = torch.empty(nv).uniform_(0.01, 16, generator=g_)
    a, dt, b = torch.randn(T, nv, generator=g_), 0.5 * torch.randn(nv, generator=g_), torch.randn(T, nv, generator=g_)
    return -A * F.softplus(a + dt), torch.sigmoid(b)


# ---------------------------------------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_zc_is_hf_bit_for_bit(dtype):
    norm = hf.Qwen3_5RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(rand(64, seed=1, scale=0.1))
    norm = norm.to(dtype)
    x = rand(5, 3, 64, seed=2, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(ops.rms_norm_zc(x, norm.weight, 1e-6), norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_is_hf_bit_for_bit(dtype):
    # bf16 exposes the cast order: normalise in fp32, cast, weight multiply in bf16, gate in fp32
    norm = hf.Qwen3_5RMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + rand(16, seed=1, scale=0.1))
    norm = norm.to(dtype)
    o, z = rand(7, 4, 16, seed=2, dtype=dtype), rand(7, 4, 16, seed=3, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(ops.gated_rms_norm(o, z, norm.weight, 1e-6), norm(o, z))


def test_l2norm_is_hf_and_unit_length():
    x = rand(9, 2, 16, seed=4)
    assert torch.equal(ops.l2norm(x), hf.l2norm(x, dim=-1, eps=1e-6))
    assert torch.allclose(ops.l2norm(x).norm(dim=-1), torch.ones(9, 2), atol=1e-5)


# ---------------------------------------------------------------------------------------------- rotary


def test_act_codes16_against_a_numpy_frexp_oracle(rng):
    """ops.act_codes16 (the decode GEMV's int16 x̂): per 32-element chunk d = 2^(p - 14) where amax = m · 2^p,
    m in [0.5, 1) (numpy frexp: the same power as 2^(E - 140) from the fp32 exponent field), q = rint(x / d)
    exactly, |q| <= 2^14, every |x - q d| <= d / 2 <= 2^-14 amax; chunks under 2^-113 give 0 and 0; an inf
    or NaN gives d = NaN. Chunk magnitudes span 1e-30 .. 1e30 (fresh random each run)."""
    import numpy as np

    x = rng.standard_normal((5, 40, 32)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-30, 30, (5, 40, 1))).astype(np.float32)
    x[0, 0] = 0
    x[0, 1] = 1e-36                     # under 2^-113: flushed
    x[0, 2, 5] = np.inf
    x[0, 3, 7] = np.nan
    q, d = ops.act_codes16(torch.from_numpy(x.reshape(5, 1280)))
    q, d = q.numpy().reshape(x.shape).astype(np.float64), d.numpy()
    amax = np.abs(x).max(-1).astype(np.float64)
    p = np.frexp(amax)[1]
    fine = np.isfinite(amax) & (amax >= 2.0 ** -113)
    want_d = np.where(fine, np.ldexp(1.0, p - 14), 0.0)
    assert np.array_equal(d[fine], want_d[fine].astype(np.float32))
    assert np.array_equal(q[fine], np.rint(x[fine] / want_d[fine][:, None]))
    assert np.abs(q).max() <= 2 ** 14
    err = np.abs(x[fine] - q[fine] * d[fine][:, None]).max(-1)
    assert (err <= d[fine] / 2).all() and (d[fine] / 2 <= 2.0 ** -14 * amax[fine]).all()
    assert (d[0, :2] == 0).all() and (q[0, :2] == 0).all()
    assert np.isnan(d[0, 2:4]).all()


def test_mrope_axis_split_of_the_real_checkpoints():
    # qwen36-architecture.md §3.3: rot 64, section [11, 11, 10] -> T {0,3,..,30}, H {1,4,..,31}, W {2,5,..,29}
    axis = ops.mrope_axis(64, [11, 11, 10])
    assert (axis == 0).nonzero().flatten().tolist() == list(range(0, 31, 3))
    assert (axis == 1).nonzero().flatten().tolist() == list(range(1, 32, 3))
    assert (axis == 2).nonzero().flatten().tolist() == list(range(2, 30, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_cos_sin_is_hf_for_three_distinct_position_rows(dtype):
    # real dims (head 256, partial 0.25 -> rot 64, section [11, 11, 10]); distinct T/H/W rows test the axis choice
    cfg = tf.Qwen3_5TextConfig(head_dim=256, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    rotary = hf.Qwen3_5TextRotaryEmbedding(cfg)
    pos = torch.stack([torch.arange(40) + 7, torch.arange(40) // 5 + 3, torch.arange(40) % 5 + 11])  # [3, T]
    want_cos, want_sin = rotary(torch.zeros(1, dtype=dtype), pos[:, None, :])
    cos, sin = ops.rope_cos_sin(pos, 64, 1e7, [11, 11, 10], dtype)
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    # text positions: one row means all three axes equal
    text_cos, _ = ops.rope_cos_sin(pos[0], 64, 1e7, [11, 11, 10], dtype)
    assert torch.equal(text_cos, ops.rope_cos_sin(pos[0].expand(3, -1), 64, 1e7, [11, 11, 10], dtype)[0])


@pytest.mark.parametrize("rope", [{"mrope_section": [1, 1, 1]}, {}, {"mrope_section": [2, 3, 3, 0]},
                                  {"mrope_section": [4, 2, 2], "mrope_interleaved": False}],
                         ids=["sum-below-rot/2", "absent-sum-above", "four-entries", "interleaved-false"])
def test_mrope_sections_of_any_sum_are_hf(rope):
    """config -> spec -> ops against HF's rotary embedding where mrope_section does not sum to rotary_dim/2 (HF
    clips its slices to the frequencies there are) or says mrope_interleaved false (HF interleaves anyway)."""
    kw = {**text_config_kwargs(moe=False), "head_dim": 64,
          "rope_parameters": {"rope_type": "default", "rope_theta": 3.0, "partial_rotary_factor": 0.25, **rope}}
    spec = ModelSpec.from_config({"model_type": "qwen3_5_text", **copy.deepcopy(kw)})
    rotary = hf.Qwen3_5TextRotaryEmbedding(tf.Qwen3_5TextConfig(**copy.deepcopy(kw)))
    pos = torch.stack([torch.arange(30) + 7, torch.arange(30) // 5 + 3, torch.arange(30) % 5 + 11])  # [3, T]
    want_cos, want_sin = rotary(torch.zeros(1), pos[:, None, :])
    cos, sin = ops.rope_cos_sin(pos, spec.rotary_dim, spec.rope_theta, spec.mrope_section)
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])


YARN_CARD = {"rope_type": "yarn", "rope_theta": 10000000, "partial_rotary_factor": 0.25, "factor": 4.0,
             "original_max_position_embeddings": 262144, "mrope_section": [11, 11, 10], "mrope_interleaved": True}


@pytest.mark.parametrize("extra", [{}, {"truncate": False}, {"truncate": None}, {"mscale": 0.7, "mscale_all_dim": 1.0},
                                   {"attention_factor": 1.25, "beta_fast": 8, "beta_slow": 2}],
                         ids=["card", "untruncated", "truncate-null", "mscale", "explicit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_cos_sin_yarn_is_hf(extra, dtype):
    # the model card's 1M-token YaRN on the real dims (head 256 -> rot 64); spec -> ops against HF's rotary
    # embedding, at positions past the 262144-token original context, three distinct T/H/W rows
    kw = {**text_config_kwargs(moe=False), "head_dim": 256, "max_position_embeddings": 1048576,
          "rope_parameters": {**YARN_CARD, **extra}}
    spec = ModelSpec.from_config({"model_type": "qwen3_5_text", **copy.deepcopy(kw)})
    rotary = hf.Qwen3_5TextRotaryEmbedding(tf.Qwen3_5TextConfig(**copy.deepcopy(kw)))
    inv_freq, scale = ops.rope_inv_freq(spec.rotary_dim, spec.rope_theta, spec.yarn)
    assert torch.equal(inv_freq, rotary.inv_freq) and scale == rotary.attention_scaling
    t = torch.arange(0, 1_000_000, 25_000)                                     # 40 positions up to ~1M
    pos = torch.stack([t, t // 7 + 3, t // 11 + 5])                            # [3, T]
    want_cos, want_sin = rotary(torch.zeros(1, dtype=dtype), pos[:, None, :])
    cos, sin = ops.rope_cos_sin(pos, spec.rotary_dim, spec.rope_theta, spec.mrope_section, dtype, spec.yarn)
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    # YaRN moves both the frequencies and the magnitude: plain RoPE differs
    plain_cos, _ = ops.rope_cos_sin(pos, spec.rotary_dim, spec.rope_theta, spec.mrope_section, dtype)
    assert not torch.allclose(plain_cos.float(), cos.float(), atol=1e-2)


def test_apply_rope_is_hf_bit_for_bit():
    cos, sin = ops.rope_cos_sin(torch.arange(100, 112), 8, 1e7, [2, 1, 1])
    q, k = rand(12, 4, 32, seed=5), rand(12, 2, 32, seed=6)
    want_q, want_k = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(ops.apply_rope(q, cos, sin), want_q[0].transpose(0, 1))
    assert torch.equal(ops.apply_rope(k, cos, sin), want_k[0].transpose(0, 1))
    assert torch.equal(ops.apply_rope(q, cos, sin)[..., 8:], q[..., 8:])  # dims past rot pass through


# ---------------------------------------------------------------------------------------------- attention


def test_gated_attention_against_sdpa_with_a_kv_cache():
    T, S, nH, nKV, d = 5, 12, 4, 2, 32  # 7 cached positions + 5 new queries
    q, gate = rand(T, nH, d, seed=7), rand(T, nH * d, seed=8)
    k, v = rand(S, nKV, d, seed=9), rand(S, nKV, d, seed=10)
    allowed = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)    # [T, S]
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
                                          v.repeat_interleave(2, 1).transpose(0, 1), attn_mask=allowed)
    want = want.transpose(0, 1).reshape(T, nH * d) * torch.sigmoid(gate)
    got = ops.gated_attention(q, gate, k, v)
    assert_close_rel(got, want, FP32_REL)
    # the last query alone (a decode step) gives the same row
    assert_close_rel(ops.gated_attention(q[-1:], gate[-1:], k, v), got[-1:], FP32_REL)


# ---------------------------------------------------------------------------------------------- conv


def test_causal_conv1d_against_hf_full_and_step():
    T, C, K = 11, 24, 4
    x, w = rand(T, C, seed=11), rand(C, K, seed=12, scale=0.5)
    want = hf.causal_conv1d_fn(x.T[None], w, None, activation="silu")[0].T
    y, state = ops.causal_conv1d(x, w)
    assert_close_rel(y, want, FP32_REL)
    assert torch.equal(state, x[-(K - 1):].T)  # the last K-1 pre-conv inputs, oldest first

    # split at 6: the state carries the history; then one-step decode against HF's update kernel
    y1, s1 = ops.causal_conv1d(x[:6], w)
    y2, s2 = ops.causal_conv1d(x[6:], w, s1)
    assert_close_rel(torch.cat([y1, y2]), want, FP32_REL)
    x_new = rand(C, seed=13)
    hf_state = torch.cat([torch.zeros(C, 1), s2], 1)[None].clone()  # HF keeps K columns, the oldest unused
    want_step = hf.causal_conv1d_update(x_new[None, :, None], hf_state, w, None, "silu")[0, :, 0]
    y_step, s3 = ops.causal_conv1d_step(x_new, w, s2)
    assert_close_rel(y_step, want_step, FP32_REL)
    assert torch.equal(s3, hf_state[0, :, 1:])


# ---------------------------------------------------------------------------------------------- DeltaNet


def delta_inputs(T: int, nk: int, nv: int, dk: int, dv: int, seed: int):
    """Random (q, k, v, g, beta) for the delta rule: q/k [T, nk, dk], v [T, nv, dv], g/beta [T, nv]."""
    q, k, v = rand(T, nk, dk, seed=seed), rand(T, nk, dk, seed=seed + 1), rand(T, nv, dv, seed=seed + 2)
    g, beta = decay_inputs(T, nv, seed + 3)
    return q, k, v, g, beta


def test_recurrent_step_is_the_closed_form_in_float64():
    # S_t = e^{g}(I − β k̂k̂ᵀ) S_{t−1} + β k̂ vᵀ, o_t = S_tᵀ q̂, one head, in float64 (no GVA, no HF)
    T, dk, dv = 6, 8, 5
    q, k, v, g, beta = delta_inputs(T, 1, 1, dk, dv, seed=20)
    S0 = rand(1, dk, dv, seed=30, scale=0.3)
    o, S = ops.gated_delta_rule_recurrent(q, k, v, g, beta, S0)
    Sd = S0[0].double()
    for t in range(T):
        kh = F.normalize(k[t, 0].double(), dim=0, eps=0)
        qh = F.normalize(q[t, 0].double(), dim=0, eps=0) * dk ** -0.5
        b = beta[t, 0].double()
        Sd = g[t, 0].double().exp() * (torch.eye(dk, dtype=torch.float64) - b * torch.outer(kh, kh)) @ Sd \
            + b * torch.outer(kh, v[t, 0].double())
        # the l2norm eps (1e-6 under the root) is the only difference: ~1e-6 / Σk² relative
        assert_close_rel(o[t, 0], Sd.T @ qh, 1e-5)
    assert_close_rel(S[0], Sd, 1e-5)


def test_recurrent_against_hf_with_gva():
    q, k, v, g, beta = delta_inputs(9, 2, 4, 16, 16, seed=40)
    S0 = rand(4, 16, 16, seed=41, scale=0.3)
    want_o, want_S = hf.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                         initial_state=S0[None], output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)
    o, S = ops.gated_delta_rule_recurrent(q, k, v, g, beta, S0)
    assert_close_rel(o, want_o[0], FP32_REL)
    assert_close_rel(S, want_S[0], FP32_REL)


def test_recurrent_trail_is_each_prefix_run():
    """trail=True: row t is the state a run over tokens 0..t alone leaves (bit for bit: the same per-token ops on the
    same rows), the last row the new state; the conv trail's row t is causal_conv1d's state after x[:t + 1]."""
    T = 5
    q, k, v, g, beta = delta_inputs(T, 2, 4, 16, 16, seed=45)
    S0 = rand(4, 16, 16, seed=46, scale=0.3)
    o, S, trail = ops.gated_delta_rule_recurrent(q, k, v, g, beta, S0, trail=True)
    assert trail.shape == (T, 4, 16, 16) and torch.equal(trail[-1], S)
    assert torch.equal(o, ops.gated_delta_rule_recurrent(q, k, v, g, beta, S0)[0])
    for t in range(T):
        assert torch.equal(trail[t], ops.gated_delta_rule_recurrent(q[:t + 1], k[:t + 1], v[:t + 1], g[:t + 1],
                                                                    beta[:t + 1], S0)[1])
    x, w, st = rand(T, 24, seed=47), rand(24, 4, seed=48), rand(24, 3, seed=49)
    conv = ops.conv_state_trail(x, st)
    assert conv.shape == (T, 24, 3)
    for t in range(T):
        assert torch.equal(conv[t], ops.causal_conv1d(x[:t + 1], w, st)[1])


@pytest.mark.parametrize("T", [1, 64, 150])
def test_chunked_equals_recurrent(T):
    # 150 = two full chunks and a zero-padded tail of 22; start from a non-zero state
    q, k, v, g, beta = delta_inputs(T, 2, 4, 16, 16, seed=50 + T)
    S0 = rand(4, 16, 16, seed=51, scale=0.3)
    o_r, S_r = ops.gated_delta_rule_recurrent(q, k, v, g, beta, S0)
    o_c, S_c = ops.gated_delta_rule_chunked(q, k, v, g, beta, S0)
    assert o_c.shape == (T, 4, 16) and S_c.shape == (4, 16, 16)
    assert_close_rel(o_c, o_r, FP32_REL)
    assert_close_rel(S_c, S_r, FP32_REL)


def test_chunked_against_hf_and_long_run_drift():
    # 512 steps (mlx-lm's drift check) with weak decay, so the state keeps a long memory
    T = 512
    q, k, v, _, beta = delta_inputs(T, 2, 4, 16, 16, seed=60)
    g = -0.05 * torch.rand(T, 4, generator=gen(61))
    want_o, want_S = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_c, S_c = ops.gated_delta_rule_chunked(q, k, v, g, beta)
    assert_close_rel(o_c, want_o[0], FP32_REL)
    assert_close_rel(S_c, want_S[0], FP32_REL)
    o_r, S_r = ops.gated_delta_rule_recurrent(q, k, v, g, beta)
    assert_close_rel(o_c, o_r, FP32_REL)
    assert_close_rel(S_c, S_r, FP32_REL)


# ---------------------------------------------------------------------------------------------- FFN


def test_swiglu_mlp_against_hf():
    cfg = tf.Qwen3_5TextConfig(**text_config_kwargs(moe=False))
    mlp = hf.Qwen3_5MLP(cfg, 96)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(rand(*p.shape, seed=p.numel(), scale=0.1))
    h = rand(6, 64, seed=70)
    with torch.no_grad():
        want = mlp(h)
    assert_close_rel(ops.swiglu_mlp(h, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight), want,
                     FP32_REL)


def test_moe_against_hf_sparse_block():
    cfg = tf.Qwen3_5MoeTextConfig(**text_config_kwargs(moe=True))
    block = hf_moe.Qwen3_5MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(block.named_parameters())):
            p.copy_(rand(*p.shape, seed=80 + i, scale=0.2))
    h = rand(13, 64, seed=90)
    with torch.no_grad():
        want = block(h[None])[0]
    s = block.shared_expert
    got = ops.moe(h, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, 2,
                  s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight, block.shared_expert_gate.weight)
    assert_close_rel(got.detach(), want, FP32_REL)
