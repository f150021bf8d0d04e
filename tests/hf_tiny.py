"""Tiny random Qwen3.5/3.6 models built with transformers: the independent oracle for every test.

Dims follow qwen36-architecture.md §8: big enough to exercise GQA, GVA (2 value heads per key head),
two full-attention layers, top-k routing and DeltaNet chunk boundaries; every parameter is re-randomised
because HF's init (norms at 0, gated norm at 1, dt_bias at 1) hides bugs.
"""

from __future__ import annotations

import math

import torch

VOCAB = 500  # deliberately not a multiple of 64


def text_config_kwargs(moe: bool, num_layers: int = 8) -> dict:
    """Keyword arguments of Qwen3_5{Moe}TextConfig for a tiny model with layers [lin, lin, lin, full] * n."""
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        # sum(mrope_section) = head_dim * partial_rotary_factor / 2 = 4
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        mtp_num_hidden_layers=1,
        eos_token_id=VOCAB - 2,
    )
    if moe:
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    else:
        kw.update(intermediate_size=96)
    return kw


def vision_config_kwargs(out_hidden_size: int = 64) -> dict:
    """A tiny vision tower: 2 blocks of width 32."""
    return dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=4,
                spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=out_hidden_size,
                num_position_embeddings=16)


@torch.no_grad()
def rerandomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter a non-trivial value (see module docstring), deterministically."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.empty(p.shape).uniform_(0.01, 16, generator=g)))
        elif name.endswith("dt_bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        elif p.dim() == 1:
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.05 * torch.randn(p.shape, generator=g))


def make_causal_lm(moe: bool, seed: int = 0, num_layers: int = 8) -> torch.nn.Module:
    """A tiny fp32 Qwen3_5{Moe}ForCausalLM (names `model.layers.*`), eval mode, randomised."""
    import transformers as tf

    cfg_cls = tf.Qwen3_5MoeTextConfig if moe else tf.Qwen3_5TextConfig
    model_cls = tf.Qwen3_5MoeForCausalLM if moe else tf.Qwen3_5ForCausalLM
    cfg = cfg_cls(**text_config_kwargs(moe, num_layers))
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    rerandomize(model, seed)
    return model


def make_vlm(moe: bool, seed: int = 0, num_layers: int = 8) -> torch.nn.Module:
    """A tiny fp32 Qwen3_5{Moe}ForConditionalGeneration (names `model.language_model.*`, `model.visual.*`)."""
    import transformers as tf

    text_cls = tf.Qwen3_5MoeTextConfig if moe else tf.Qwen3_5TextConfig
    vis_cls = tf.Qwen3_5MoeVisionConfig if moe else tf.Qwen3_5VisionConfig
    cfg_cls = tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config
    model_cls = tf.Qwen3_5MoeForConditionalGeneration if moe else tf.Qwen3_5ForConditionalGeneration
    cfg = cfg_cls(text_config=text_cls(**text_config_kwargs(moe, num_layers)).to_dict(),
                  vision_config=vis_cls(**vision_config_kwargs()).to_dict(), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    rerandomize(model, seed)
    return model


def mtp_tensors(text_cfg, seed: int = 1, per_expert: bool = True) -> dict[str, torch.Tensor]:
    """Hand-made `mtp.*` tensors (HF has no MTP module): fc, three norms, one full-attention decoder layer."""
    g = torch.Generator().manual_seed(seed)
    H, d = text_cfg.hidden_size, text_cfg.head_dim
    nh, nkv = text_cfg.num_attention_heads, text_cfg.num_key_value_heads

    def w(*shape):
        return (0.1 if len(shape) == 1 else 0.05) * torch.randn(*shape, generator=g)

    p = "mtp.layers.0."
    t = {"mtp.fc.weight": w(H, 2 * H), "mtp.pre_fc_norm_embedding.weight": w(H),
         "mtp.pre_fc_norm_hidden.weight": w(H), "mtp.norm.weight": w(H),
         p + "input_layernorm.weight": w(H), p + "post_attention_layernorm.weight": w(H),
         p + "self_attn.q_proj.weight": w(nh * 2 * d, H), p + "self_attn.k_proj.weight": w(nkv * d, H),
         p + "self_attn.v_proj.weight": w(nkv * d, H), p + "self_attn.o_proj.weight": w(H, nh * d),
         p + "self_attn.q_norm.weight": w(d), p + "self_attn.k_norm.weight": w(d)}
    if getattr(text_cfg, "num_experts", None):
        E, I, Is = text_cfg.num_experts, text_cfg.moe_intermediate_size, text_cfg.shared_expert_intermediate_size
        t[p + "mlp.gate.weight"] = w(E, H)
        t[p + "mlp.shared_expert_gate.weight"] = w(1, H)
        t[p + "mlp.shared_expert.gate_proj.weight"] = w(Is, H)
        t[p + "mlp.shared_expert.up_proj.weight"] = w(Is, H)
        t[p + "mlp.shared_expert.down_proj.weight"] = w(H, Is)
        if per_expert:
            for e in range(E):
                for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                    t[f"{p}mlp.experts.{e}.{n}.weight"] = w(*shape)
        else:
            t[p + "mlp.experts.gate_up_proj"] = w(E, 2 * I, H)
            t[p + "mlp.experts.down_proj"] = w(E, H, I)
    else:
        I = text_cfg.intermediate_size
        t[p + "mlp.gate_proj.weight"] = w(I, H)
        t[p + "mlp.up_proj.weight"] = w(I, H)
        t[p + "mlp.down_proj.weight"] = w(H, I)
    return t


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """‖actual − expected‖ / ‖expected‖ ≤ rel, with the worst element printed on failure."""
    a, e = actual.double(), expected.double()
    err = (a - e).norm().item() / max(e.norm().item(), 1e-30)
    if not err <= rel:
        i = int((a - e).abs().argmax())
        raise AssertionError(f"relative error {err:.3e} > {rel:.1e}; worst at flat index {i}: "
                             f"{a.flatten()[i].item():.6g} vs {e.flatten()[i].item():.6g}")
    assert math.isfinite(err)
