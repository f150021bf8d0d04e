"""The built-in tiny checkpoint: loads in transformers, matches ModelSpec and hf_tiny, same bytes every time."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors import safe_open

import hf_tiny
from ninfer_pack.tiny import BUILTIN_SOURCES, materialize_builtin, write_tiny_checkpoint
from ninfer_pack.tiny_tokenizer import TINY_SPECIAL_IDS
from ninfer_rt.config import ModelSpec
from ninfer_rt.errors import SourceError

KINDS = ["moe", "dense"]
_PER_EXPERT = re.compile(r"^(mtp\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {k: write_tiny_checkpoint(root / k, k) for k in KINDS}


def _read(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint, through its index."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(path / shard, "pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == shard, k
                out[k] = f.get_tensor(k)
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


def _fuse_mtp_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack per-expert MTP tensors into the canonical banks: gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""
    out, parts = {}, {}
    for k, t in tensors.items():
        m = _PER_EXPERT.match(k)
        if m:
            parts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        else:
            out[k] = t
    for base, p in parts.items():
        E = len(p["down_proj"])
        out[base + "gate_up_proj"] = torch.stack([torch.cat([p["gate_proj"][e], p["up_proj"][e]]) for e in range(E)])
        out[base + "down_proj"] = torch.stack([p["down_proj"][e] for e in range(E)])
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_layout_dtypes_and_config(ckpts, kind):
    path = ckpts[kind]
    moe = kind == "moe"
    cfg = json.loads((path / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    for key, want in hf_tiny.text_config_kwargs(moe).items():
        if key != "eos_token_id":  # ids follow the tiny tokenizer instead
            assert text[key] == want, key
    assert vision | hf_tiny.vision_config_kwargs(out_hidden_size=text["hidden_size"]) == vision
    assert cfg["architectures"] == [f"Qwen3_5{'Moe' if moe else ''}ForConditionalGeneration"]
    # Token ids agree with the tokenizer: eos/bos/pad as in Qwen3.6's config and generation_config.
    gen = json.loads((path / "generation_config.json").read_text())
    eot, im_end = TINY_SPECIAL_IDS["<|endoftext|>"], TINY_SPECIAL_IDS["<|im_end|>"]
    assert text["eos_token_id"] == eot and text["bos_token_id"] == gen["bos_token_id"] == eot
    assert set(gen["eos_token_id"]) == {im_end, eot}
    assert cfg["image_token_id"] == TINY_SPECIAL_IDS["<|image_pad|>"]
    assert max(TINY_SPECIAL_IDS.values()) < text["vocab_size"] == 500
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (path / f).stat().st_size > 0

    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    tensors = _read(path)
    for k, t in tensors.items():
        fp32 = k.endswith(("linear_attn.A_log", "linear_attn.norm.weight"))
        assert t.dtype == (torch.float32 if fp32 else torch.bfloat16), k
        assert t.float().std() > 0.01, k  # randomised: no constant (HF-init) tensors
        if k.endswith("A_log"):
            assert 0.01 <= t.exp().min() and t.exp().max() <= 16, k
    # Main layers fused, MTP per expert, 333-style vision tower, as the official releases.
    per_expert = [k for k in tensors if _PER_EXPERT.match(k)]
    assert len(per_expert) == (8 * 3 if moe else 0)
    assert ("model.language_model.layers.0.mlp.experts.gate_up_proj" in tensors) == moe
    assert sum(k.startswith("model.visual.") for k in tensors) == 3 + 12 * vision["depth"] + 6
    # hf_tiny's hand-made MTP (per expert) has exactly these names and shapes.
    hf_cfg = tf.AutoConfig.from_pretrained(path).text_config
    mtp = {k: tuple(v.shape) for k, v in hf_tiny.mtp_tensors(hf_cfg, per_expert=True).items()}
    assert {k: tuple(t.shape) for k, t in tensors.items() if k.startswith("mtp.")} == mtp
    # ModelSpec's canonical tensor list is what the checkpoint holds, once MTP experts are stacked.
    spec = ModelSpec.from_file(path / "config.json")
    assert {k: tuple(t.shape) for k, t in _fuse_mtp_experts(tensors).items()} == \
        {k: i.shape for k, i in spec.tensor_shapes().items()}


@pytest.mark.parametrize("kind", KINDS)
def test_loads_and_runs_in_transformers(ckpts, kind):
    path = ckpts[kind]
    cls = tf.Qwen3_5MoeForConditionalGeneration if kind == "moe" else tf.Qwen3_5ForConditionalGeneration
    model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"])
    # Every HF parameter is the stored value (bf16 -> fp32 is exact), so no layout was reinterpreted.
    stored = _read(path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, stored[k].float()), k

    # A forward pass with a 4x4-patch image (one frame, 2x2 merged tokens) between text tokens.
    S = TINY_SPECIAL_IDS
    ids = torch.tensor([[10, 20, 30, S["<|vision_start|>"]] + [S["<|image_pad|>"]] * 4 + [S["<|vision_end|>"], 40, 50]])
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=g)

    def logits(px):
        model.model.rope_deltas = None  # recompute mRoPE positions for each new prompt
        with torch.no_grad():
            return model(input_ids=ids, pixel_values=px, image_grid_thw=torch.tensor([[1, 4, 4]]),
                         mm_token_type_ids=(ids == S["<|image_pad|>"]).long()).logits[0]

    a, b = logits(pixels), logits(pixels + 1.0)
    assert a.shape == (ids.shape[1], 500) and torch.isfinite(a).all()
    # Causal: tokens before the image ignore it (fp32 noise only); the image tokens and later ones see it.
    assert (a[:4] - b[:4]).abs().max() < 1e-5
    assert (a[4:] - b[4:]).abs().amax(-1).min() > 1e-3


def test_text_only_class_reads_the_same_checkpoint(ckpts):
    # transformers maps model.language_model.* onto Qwen3_5MoeForCausalLM; logits must equal the VLM's.
    path = ckpts["moe"]
    ids = torch.tensor([[1, 5, 9, 200, 300, 17, 42, 8]])
    with torch.no_grad():
        vlm = tf.Qwen3_5MoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32)(input_ids=ids).logits
        lm = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(input_ids=ids).logits
    hf_tiny.assert_close_rel(lm, vlm, 1e-6)  # same fp32 maths, same weights: only summation-order noise


def test_generation_is_deterministic(ckpts, tmp_path):
    for kind in KINDS:
        again = write_tiny_checkpoint(tmp_path / kind, kind)
        names = sorted(p.name for p in ckpts[kind].iterdir())
        assert names == sorted(p.name for p in again.iterdir())
        for n in names:
            assert (again / n).read_bytes() == (ckpts[kind] / n).read_bytes(), (kind, n)
    other = write_tiny_checkpoint(tmp_path / "seed1", "moe", seed=1)
    first = "model-00001-of-00002.safetensors"
    assert (other / first).read_bytes() != (ckpts["moe"] / first).read_bytes()


def test_materialize_builtin_caches_atomically(ckpts, tmp_path, monkeypatch):
    assert set(BUILTIN_SOURCES) == {"builtin:tiny-moe", "builtin:tiny-dense"}
    path = materialize_builtin("builtin:tiny-moe", cache_dir=tmp_path)
    assert path.parent == tmp_path and re.fullmatch(r"tiny-moe-v\d+-[0-9a-f]{12}", path.name)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary directory left behind
    for f in ckpts["moe"].iterdir():
        assert (path / f.name).read_bytes() == f.read_bytes(), f.name

    def fail(*a, **k):
        raise AssertionError("regenerated although cached")

    monkeypatch.setattr("ninfer_pack.tiny.write_tiny_checkpoint", fail)
    assert materialize_builtin("builtin:tiny-moe", cache_dir=tmp_path) == path
    with pytest.raises(AssertionError):  # a missing entry is generated, and a failure leaves nothing behind
        materialize_builtin("builtin:tiny-dense", cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    with pytest.raises(SourceError, match="builtin:tiny-huge"):
        materialize_builtin("builtin:tiny-huge", cache_dir=tmp_path)
