"""ReferenceModel against transformers on tiny random Qwen3.5 models (MoE and dense), all in fp32.

Tolerances. Both sides compute in fp32 with the same equations; only summation orders differ (BLAS blocking,
SDPA against a naive softmax, HF's triangular solve against ours), each contributing relative errors of
order n·u with u = 2^-24 ≈ 6e-8 and n ≤ 128 terms per reduction. Through 8 layers (+ MTP) these stay around
1e-6 (facts file §0: ≤ 3e-6 observed), so rel = 1e-4 leaves a wide margin while any real mistake (a wrong cast,
mask, gate or order) moves logits by 1e-2 or more. Comparisons of the reference with itself (prefill + decode
against one forward) only reorder the same fp32 work: rel = 1e-5.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import transformers as tf
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe

import hf_tiny
from hf_tiny import assert_close_rel
from ninfer_rt.config import ModelSpec
from ninfer_rt.errors import ConfigError, SourceError
from ninfer_rt.reference import ReferenceModel

HF_REL = 1e-4    # reference against transformers (module docstring)
SELF_REL = 1e-5  # reference against itself, reordered fp32 work
PROMPT = 80      # crosses the 64-token DeltaNet chunk boundary


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here works on tiny tensors (see conftest.one_thread)."""


def canonical(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF *ForCausalLM names -> canonical names (`model.` -> `model.language_model.`)."""
    return {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
            for k, v in state_dict.items()}


@pytest.fixture(scope="module", params=[True, False], ids=["moe", "dense"])
def tiny(request):
    """(HF model, its canonical weights, ReferenceModel with the MTP tensors, prompt ids [80])."""
    moe = request.param
    model = hf_tiny.make_causal_lm(moe)
    spec = ModelSpec.from_config(model.config.to_dict())
    assert spec.layer_types.count("full_attention") == 2 and spec.vocab_size % 64 != 0
    weights = canonical(model.state_dict())
    weights.update(hf_tiny.mtp_tensors(model.config, per_expert=False))
    ids = torch.randint(0, spec.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(7))
    return model, weights, ReferenceModel(spec, weights), ids


@pytest.fixture(scope="module")
def full_forward(tiny):
    """(logits, post-norm hidden) of one uncached forward over the prompt."""
    _, _, ref, ids = tiny
    return ref.forward_with_hidden(ids)


@torch.no_grad()
def test_logits_match_transformers(tiny, full_forward):
    model, _, _, ids = tiny
    out = model(ids[None], output_hidden_states=True)
    assert_close_rel(full_forward[0], out.logits[0], HF_REL)
    # hidden_states[-1] is after the final norm: the state that feeds MTP
    assert_close_rel(full_forward[1], out.hidden_states[-1][0], HF_REL)


def test_prefill_then_decode_equals_full_forward(tiny, full_forward):
    # two multi-token prefills (the second continues conv, recurrent and KV state), then 12 decode steps
    _, _, ref, ids = tiny
    cache = ref.new_cache()
    parts = [ref(ids[:50], cache), ref(ids[50:68], cache)]
    parts += [ref(ids[t:t + 1], cache) for t in range(68, PROMPT)]
    assert cache.pos == PROMPT
    assert_close_rel(torch.cat(parts), full_forward[0], SELF_REL)


@torch.no_grad()
def test_greedy_generation_matches_transformers(tiny):
    model, _, ref, ids = tiny
    # no early stop (a random model may well emit its eos id); an explicit mask, or generate would take
    # prompt tokens equal to pad_token_id for padding
    out = model.generate(ids[None], attention_mask=torch.ones(1, PROMPT, dtype=torch.long), do_sample=False,
                         max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    want = out[0, PROMPT:].tolist()
    assert len(want) == 16
    assert ref.greedy(ids, 16) == want


class HFMtp(torch.nn.Module):
    """The MTP head assembled from transformers parts (facts file §8, pitfall 8), wired as in §5."""

    def __init__(self, model, tensors: dict[str, torch.Tensor]):
        super().__init__()
        cfg, H = model.config, model.config.hidden_size
        moe = bool(getattr(cfg, "num_experts", 0))
        layer_cls = hf_moe.Qwen3_5MoeDecoderLayer if moe else hf.Qwen3_5DecoderLayer
        norm_cls = hf_moe.Qwen3_5MoeRMSNorm if moe else hf.Qwen3_5RMSNorm
        self.model = model
        self.layer = layer_cls(cfg, cfg.layer_types.index("full_attention"))
        self.norm_e, self.norm_h, self.norm = (norm_cls(H, eps=cfg.rms_norm_eps) for _ in range(3))
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        p = "mtp.layers.0."
        self.layer.load_state_dict({k[len(p):]: v for k, v in tensors.items() if k.startswith(p)}, strict=True)
        with torch.no_grad():
            self.fc.weight.copy_(tensors["mtp.fc.weight"])
            self.norm_e.weight.copy_(tensors["mtp.pre_fc_norm_embedding.weight"])
            self.norm_h.weight.copy_(tensors["mtp.pre_fc_norm_hidden.weight"])
            self.norm.weight.copy_(tensors["mtp.norm.weight"])

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], next_ids [T], positions [T] -> draft logits [T, V]."""
        T = hidden.shape[0]
        e = self.norm_e(self.model.model.embed_tokens(next_ids))
        u = self.fc(torch.cat([e, self.norm_h(hidden)], -1))[None]              # embedding first
        rope = self.model.model.rotary_emb(u, positions[None])
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]            # causal, additive
        u = self.layer(u, position_embeddings=rope, attention_mask=mask)
        return self.model.lm_head(self.norm(u))[0]


def test_mtp_matches_transformers_parts(tiny, full_forward):
    model, weights, ref, ids = tiny
    hidden = full_forward[1]
    # row p pairs hidden h_p with token x_{p+1} at position p; the last row gets a "sampled" token
    next_ids = torch.cat([ids[1:], full_forward[0][-1:].argmax(-1)])
    positions = torch.arange(PROMPT)
    want = HFMtp(model, {k: v for k, v in weights.items() if k.startswith("mtp.")})(hidden, next_ids, positions)
    got = ref.mtp_logits(hidden, next_ids, positions)
    assert_close_rel(got, want, HF_REL)

    # the MTP layer's own KV cache: prefill window, then one row at a time
    cache = ref.new_mtp_cache()
    parts = [ref.mtp_logits(hidden[:70], next_ids[:70], positions[:70], cache)]
    parts += [ref.mtp_logits(hidden[t:t + 1], next_ids[t:t + 1], positions[t:t + 1], cache)
              for t in range(70, PROMPT)]
    assert_close_rel(torch.cat(parts), got, SELF_REL)


YARN = {"rope_type": "yarn", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "factor": 4.0,
        "original_max_position_embeddings": 32, "mrope_section": [2, 1, 1], "mrope_interleaved": True}


@torch.no_grad()
def test_yarn_logits_match_transformers():
    # a tiny dense model with YaRN and a 32-token original context: the 80-token prompt runs past it
    kw = {**hf_tiny.text_config_kwargs(moe=False), "max_position_embeddings": 128, "rope_parameters": dict(YARN)}
    model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**copy.deepcopy(kw))).float().eval()
    hf_tiny.rerandomize(model, 3)
    spec = ModelSpec.from_config({"model_type": "qwen3_5_text", **copy.deepcopy(kw)})
    assert spec.rope_type == "yarn" and spec.yarn.original_max_position_embeddings < PROMPT
    weights = canonical(model.state_dict())
    ids = torch.randint(0, spec.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(11))
    ref = ReferenceModel(spec, weights)
    got = ref(ids)
    assert_close_rel(got, model(ids[None]).logits[0], HF_REL)
    # decode steps past the original context take the same YaRN tables
    cache = ref.new_cache()
    parts = [ref(ids[:70], cache)] + [ref(ids[t:t + 1], cache) for t in range(70, PROMPT)]
    assert_close_rel(torch.cat(parts), got, SELF_REL)
    # the same weights under plain RoPE give clearly different logits, so the match above is YaRN's
    plain = dataclasses.replace(spec, rope_parameters={k: v for k, v in YARN.items() if k not in
                                                       ("rope_type", "factor", "original_max_position_embeddings")})
    assert plain.rope_type == "default"
    assert (ReferenceModel(plain, weights)(ids) - got).norm() > 100 * HF_REL * got.norm()


def test_missing_or_misshapen_tensor_is_named(tiny):
    model, weights, _, _ = tiny
    spec = ModelSpec.from_config(model.config.to_dict())
    name = "model.language_model.layers.3.self_attn.k_norm.weight"
    with pytest.raises(SourceError, match=name.replace(".", r"\.")):
        ReferenceModel(spec, {k: v for k, v in weights.items() if k != name})
    bad = dict(weights)
    bad["model.language_model.layers.0.linear_attn.A_log"] = torch.zeros(3)
    with pytest.raises(ConfigError, match=r"layers\.0\.linear_attn\.A_log"):
        ReferenceModel(spec, bad)
    # the MTP tensors are read on first use only
    lm_only = ReferenceModel(spec, {k: v for k, v in weights.items() if not k.startswith("mtp.")})
    with pytest.raises(SourceError, match=r"mtp\.fc\.weight"):
        lm_only.mtp_logits(torch.zeros(1, spec.hidden_size), torch.zeros(1, dtype=torch.long), torch.zeros(1))
