"""ModelSpec against transformers (tiny models, meta-device real shapes) and the published checkpoint figures."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import transformers as tf

import hf_tiny
from ninfer_rt.config import ModelSpec, TensorInfo
from ninfer_rt.errors import ConfigError, SourceError

CONFIGS = Path(__file__).resolve().parents[1] / "ninfer_rt" / "configs"


def _shapes(spec: ModelSpec, groups=("text", "mtp", "vision")) -> dict[str, tuple]:
    return {k: t.shape for k, t in spec.tensor_shapes().items() if t.group in groups}


@functools.lru_cache(maxsize=None)
def _vlm_json(moe: bool) -> str:
    return json.dumps(hf_tiny.make_vlm(moe, num_layers=4).config.to_dict())


def _vlm_config(moe: bool) -> dict:
    """A tiny VLM config.json as transformers writes it (a fresh copy)."""
    return json.loads(_vlm_json(moe))


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_vlm_names_and_shapes_match_transformers(moe):
    model = hf_tiny.make_vlm(moe)
    spec = ModelSpec.from_config(model.config.to_dict())
    # The VLM state_dict already uses canonical names and fused expert banks; HF has no MTP, so the
    # hand-made fused MTP tensors stand in for it.
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    mtp = hf_tiny.mtp_tensors(model.config.text_config, per_expert=False)
    expected.update({k: tuple(v.shape) for k, v in mtp.items()})
    assert _shapes(spec) == expected
    for name, info in spec.tensor_shapes().items():
        want = "vision" if name.startswith("model.visual.") else "mtp" if name.startswith("mtp.") else "text"
        assert info.group == want, name
    assert spec.is_moe == moe and spec.vision is not None
    assert spec.full_attention_layers == (3, 7) and spec.linear_attention_layers == (0, 1, 2, 4, 5, 6)


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_text_only_form_matches_causal_lm(moe):
    model = hf_tiny.make_causal_lm(moe, num_layers=4)
    cfg = model.config.to_dict()
    assert cfg["model_type"] == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    spec = ModelSpec.from_config(cfg)
    # *ForCausalLM names are `model.*`; the canonical spelling is `model.language_model.*`.
    expected = {("lm_head.weight" if k == "lm_head.weight" else "model.language_model." + k[len("model."):]):
                tuple(v.shape) for k, v in model.state_dict().items()}
    assert _shapes(spec, ("text",)) == expected
    assert spec.vision is None


@pytest.mark.parametrize("name,cls", [("qwen3.6-35b-a3b", "Qwen3_5Moe"), ("qwen3.6-27b", "Qwen3_5")])
def test_real_configs_match_transformers_on_meta(name, cls):
    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    spec = ModelSpec.from_file(CONFIGS / f"{name}.json")
    hf_cfg = getattr(tf, cls + "Config").from_dict(raw)
    with torch.device("meta"):  # real shapes, no memory
        model = getattr(tf, cls + "ForConditionalGeneration")(hf_cfg)
    assert _shapes(spec, ("text", "vision")) == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_real_parameter_counts():
    # Published totals (facts §2, from the real tensor dumps, incl. vision and MTP). Our count is exact
    # for both: 35,951,822,704 and 27,781,427,952 (0.0% off); the bound is the brief's 0.5%.
    for name, total, tensors in (("qwen3.6-35b-a3b", 35_951_822_704, 1811), ("qwen3.6-27b", 27_781_427_952, 1199)):
        spec = ModelSpec.from_file(CONFIGS / f"{name}.json")
        assert abs(spec.num_parameters() - total) <= 0.005 * total, name
        shapes = spec.tensor_shapes()
        assert sum(t.numel for t in shapes.values()) == spec.num_parameters()
        # Tensor counts of the dumps: the 35B's MTP experts are stored per expert (3 per expert instead of 2 banks).
        n = len(shapes) + (3 * spec.num_experts - 2) * spec.mtp_num_hidden_layers * spec.is_moe
        assert n == tensors, name
        assert sum(1 for k in shapes if k.startswith("model.visual.")) == 333


def test_real_derived_sizes():
    # Derived numbers of facts §2 and the per-token cache sizes of §3.8.
    a = ModelSpec.from_file(CONFIGS / "qwen3.6-35b-a3b.json")
    b = ModelSpec.from_file(CONFIGS / "qwen3.6-27b.json")
    assert (a.key_dim, a.value_dim, a.conv_dim, a.rotary_dim) == (2048, 4096, 8192, 64)
    assert (b.key_dim, b.value_dim, b.conv_dim, b.rotary_dim) == (2048, 6144, 10240, 64)
    assert len(a.full_attention_layers) == 10 and len(b.full_attention_layers) == 16
    assert a.full_attention_layers[:3] == (3, 7, 11) and b.full_attention_layers[-1] == 63
    assert a.is_moe and a.intermediate_size is None and (a.num_experts, a.num_experts_per_tok) == (256, 8)
    assert not b.is_moe and b.intermediate_size == 17408 and b.num_experts == 0
    assert a.rope_theta == 1e7 and a.mrope_section == (11, 11, 10) and a.mrope_interleaved
    assert a.rope_parameters == {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                                 "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"}
    assert b.bos_token_id == 248044 and b.eos_token_ids == (248044,) and a.bos_token_id is None
    assert a.vision.out_hidden_size == 2048 and b.vision.out_hidden_size == 5120 and b.vision.depth == 27
    assert a.max_position_embeddings == 262144 and not a.tie_word_embeddings and a.mtp_num_hidden_layers == 1


@pytest.mark.parametrize("layers,interval", [(8, None), (10, 3), (5, 1)])
def test_layer_types_from_interval_match_transformers(layers, interval):
    kw = hf_tiny.text_config_kwargs(moe=False, num_layers=layers)
    if interval is not None:
        kw["full_attention_interval"] = interval
    hf = tf.Qwen3_5TextConfig(**kw)
    cfg = {"model_type": "qwen3_5_text", **kw}
    assert ModelSpec.from_config(cfg).layer_types == tuple(hf.layer_types)


def test_fp8_quantization_config_is_kept():
    cfg = json.loads((CONFIGS / "qwen3.6-35b-a3b.json").read_text())
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
         "modules_to_not_convert": ["lm_head"]}
    cfg["quantization_config"] = q
    spec = ModelSpec.from_config(cfg)
    assert spec.quantization == q and spec.quantization is not q
    # Canonical names are the dequantized ones: FP8 changes no tensor.
    assert spec.tensor_shapes() == ModelSpec.from_file(CONFIGS / "qwen3.6-35b-a3b.json").tensor_shapes()


def test_rope_settings_from_older_spellings():
    base = {k: v for k, v in hf_tiny.text_config_kwargs(moe=True).items() if k != "rope_parameters"}
    cfg = {"model_type": "qwen3_5_moe_text", **base, "rope_theta": 5e6, "partial_rotary_factor": 0.5,
           "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2]}}
    spec = ModelSpec.from_config(cfg)
    assert spec.rope_parameters == cfg["rope_scaling"]  # kept as written (transformers edits it in place)
    hf = tf.Qwen3_5MoeTextConfig.from_dict(cfg).rope_parameters  # transformers merges them the same way
    assert (spec.rope_theta, spec.partial_rotary_factor) == (hf["rope_theta"], hf["partial_rotary_factor"])
    assert (spec.rotary_dim, spec.mrope_section) == (16, tuple(hf["mrope_section"]))
    yarn = {"mrope_interleaved": True, "mrope_section": [2, 1, 1], "rope_type": "yarn", "rope_theta": 1e7,
            "partial_rotary_factor": 0.25, "factor": 4.0, "original_max_position_embeddings": 4096}
    spec = ModelSpec.from_config({"model_type": "qwen3_5_moe_text", **base, "rope_parameters": yarn})
    assert spec.rope_parameters == yarn and spec.rope_theta == 1e7 and spec.rotary_dim == 8


def test_dict_round_trip_is_json_able():
    for raw in (_vlm_config(True), json.loads((CONFIGS / "qwen3.6-27b.json").read_text())):
        spec = ModelSpec.from_config(raw)
        back = ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
        assert back == spec and back.raw == raw == spec.raw
        assert back.tensor_shapes() == spec.tensor_shapes()
    d = spec.to_dict()
    del d["head_dim"]
    with pytest.raises(ConfigError, match="head_dim is missing"):
        ModelSpec.from_dict(d)


def test_optional_parts():
    cfg = _vlm_config(True)
    del cfg["vision_config"]
    cfg["tie_word_embeddings"] = True
    cfg["text_config"]["mtp_num_hidden_layers"] = 0
    spec = ModelSpec.from_config(cfg)
    shapes = spec.tensor_shapes()
    assert spec.vision is None and "lm_head.weight" not in shapes
    assert all(k.startswith("model.language_model.") for k in shapes)
    assert {t.group for t in shapes.values()} == {"text"} and isinstance(next(iter(shapes.values())), TensorInfo)


def _broken(edit, moe=True) -> str:
    cfg = _vlm_config(moe)
    edit(cfg, cfg["text_config"])
    with pytest.raises(ConfigError) as e:
        ModelSpec.from_config(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_errors_name_the_field(tmp_path):
    assert _broken(lambda c, t: c.update(model_type="llama")) == (
        "unsupported architecture 'llama': ninfer supports qwen3_5, qwen3_5_moe (Qwen3.5/Qwen3.6)")
    assert _broken(lambda c, t: t.pop("hidden_size")) == "config.json: text_config.hidden_size is missing"
    assert _broken(lambda c, t: c.pop("text_config")) == "config.json: text_config is missing"
    assert "text_config.layer_types has 3 entries but text_config.num_hidden_layers is 4" in _broken(
        lambda c, t: t.update(layer_types=t["layer_types"][:3]))
    assert "text_config.num_attention_heads (4) is not divisible by text_config.num_key_value_heads (3)" in _broken(
        lambda c, t: t.update(num_key_value_heads=3))
    assert "text_config.linear_num_value_heads (4) is not divisible" in _broken(
        lambda c, t: t.update(linear_num_key_heads=3))
    assert "mrope_section [2, 2, 1] sums to 5, but rotary_dim/2 is 4" in _broken(
        lambda c, t: t["rope_parameters"].update(mrope_section=[2, 2, 1]))
    assert _broken(lambda c, t: t.pop("num_experts")) == "config.json: text_config.num_experts is missing"
    assert _broken(lambda c, t: t.pop("intermediate_size"), moe=False) == (
        "config.json: text_config.intermediate_size is missing")
    assert "text_config.hidden_size must be an integer" in _broken(lambda c, t: t.update(hidden_size="64"))
    assert "vision_config.out_hidden_size is missing" in _broken(lambda c, t: c["vision_config"].pop("out_hidden_size"))
    assert "does not match model_type" in _broken(lambda c, t: t.update(model_type="qwen3_5_text"))
    # The flat form names fields without a prefix; from_file names the file.
    flat = {"model_type": "qwen3_5_text", **hf_tiny.text_config_kwargs(moe=False)}
    del flat["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(flat))
    with pytest.raises(ConfigError, match=r"^.*config\.json: vocab_size is missing$"):
        ModelSpec.from_file(tmp_path)
    with pytest.raises(SourceError, match="nope.json"):
        ModelSpec.from_file(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="bad.json: not valid JSON"):
        ModelSpec.from_file(tmp_path / "bad.json")
