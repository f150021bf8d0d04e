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
    # Published totals (facts §2, from the real tensor dumps, incl. vision and MTP): a count from the
    # config must equal them exactly, as one missing family (a norm, a bias) is a few thousand elements.
    for name, total, tensors in (("qwen3.6-35b-a3b", 35_951_822_704, 1811), ("qwen3.6-27b", 27_781_427_952, 1199)):
        spec = ModelSpec.from_file(CONFIGS / f"{name}.json")
        assert spec.num_parameters() == total, name
        shapes = spec.tensor_shapes()
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
        d = spec.to_dict()
        assert "raw" not in d and spec.raw == raw  # the header keeps config.json itself under model.config
        back = ModelSpec.from_dict(json.loads(json.dumps(d)))
        assert back == spec and back.raw == {}
        assert back.tensor_shapes() == spec.tensor_shapes()
        assert ModelSpec.from_dict({**d, "raw": raw}) == spec  # headers written before raw was dropped
    d = spec.to_dict()
    del d["head_dim"]
    with pytest.raises(ConfigError, match="head_dim is missing"):
        ModelSpec.from_dict(d)


# ---------------------------------------------------------------------------------------------- rope type


MODEL_CARD_YARN = {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "yarn",
                   "rope_theta": 10000000, "partial_rotary_factor": 0.25, "factor": 4.0,
                   "original_max_position_embeddings": 262144}


@pytest.mark.parametrize("extra", [{}, {"mscale": 0.7, "mscale_all_dim": 1.0}, {"attention_factor": 1.5},
                                   {"beta_fast": 16, "beta_slow": 2, "truncate": False}],
                         ids=["card", "mscale", "attention_factor", "betas"])
def test_yarn_parameters_match_transformers(extra):
    # The model card's 1M-token setting on the real 35B config; attention factor against transformers' own.
    cfg = json.loads((CONFIGS / "qwen3.6-35b-a3b.json").read_text())
    cfg["text_config"]["rope_parameters"] = {**MODEL_CARD_YARN, **extra}
    spec = ModelSpec.from_config(cfg)
    hf_cfg = tf.Qwen3_5MoeConfig.from_dict(json.loads(json.dumps(cfg))).text_config
    _, hf_attention = tf.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    y = spec.yarn
    assert spec.rope_type == "yarn" and spec.rotary_dim == 64
    assert (y.factor, y.original_max_position_embeddings) == (4.0, 262144)
    assert y.attention_factor == hf_attention
    assert (y.beta_fast, y.beta_slow, y.truncate) == (extra.get("beta_fast", 32), extra.get("beta_slow", 1),
                                                      extra.get("truncate", True))
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))).yarn == y
    plain = ModelSpec.from_file(CONFIGS / "qwen3.6-35b-a3b.json")
    assert plain.rope_type == "default" and plain.yarn is None


def test_yarn_original_context_defaults_like_transformers():
    # without original_max_position_embeddings transformers takes max_position_embeddings; a text-config-level
    # original_max_position_embeddings takes priority over rope_parameters' (its Phi-3 rule)
    kw = hf_tiny.text_config_kwargs(moe=False)
    kw["rope_parameters"] = {**kw["rope_parameters"], "rope_type": "yarn", "factor": 2.0}
    for extra in ({}, {"original_max_position_embeddings": 64}):
        cfg = {"model_type": "qwen3_5_text", **json.loads(json.dumps(kw)), **extra}
        hf_cfg = tf.Qwen3_5TextConfig(**json.loads(json.dumps({**kw, **extra})))
        hf_cfg.standardize_rope_params()
        want = hf_cfg.rope_parameters["original_max_position_embeddings"]
        assert ModelSpec.from_config(cfg).yarn.original_max_position_embeddings == want == (extra or kw)[
            "original_max_position_embeddings" if extra else "max_position_embeddings"]


def test_unsupported_rope_type_is_named():
    for rope_type in ("dynamic", "linear", "longrope", 3):
        msg = _broken(lambda c, t: t["rope_parameters"].update(rope_type=rope_type))
        assert msg == (f"config.json: text_config.rope_parameters.rope_type {rope_type!r} is not supported "
                       "(ninfer supports default, yarn)")
    # the older spelling `type` is read too, and from_dict checks the stored rope_parameters the same way
    assert "rope_parameters.type 'dynamic' is not supported" in _broken(
        lambda c, t: t["rope_parameters"].pop("rope_type") and t["rope_parameters"].update(type="dynamic"))
    d = ModelSpec.from_config(_vlm_config(False)).to_dict()
    d["rope_parameters"]["rope_type"] = "dynamic"
    with pytest.raises(ConfigError, match=r"^model spec: rope_parameters\.rope_type 'dynamic' is not supported"):
        ModelSpec.from_dict(d)


def test_malformed_yarn_parameters_are_named():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    for key, value, what in (("factor", None, "must be a number, got None"), ("factor", 0.5, "must be >= 1.0"),
                             ("factor", "4", "must be a finite number"),
                             ("original_max_position_embeddings", 0, "must be >= 1"),
                             ("attention_factor", -1.0, "must be > 0.0"), ("truncate", 1, "must be true or false"),
                             ("beta_fast", 0.5, "(0.5) and beta_slow (1.0) must satisfy")):
        msg = _broken(lambda c, t: t["rope_parameters"].update({**yarn, key: value}))
        assert msg.startswith(f"config.json: text_config.rope_parameters.{key} {what}"), msg


# ---------------------------------------------------------------------------------------------- from_dict checks


def _spec_dict(moe: bool = True) -> dict:
    """to_dict() of the tiny VLM spec with YaRN rope, as an artifact header stores it."""
    cfg = _vlm_config(moe)
    cfg["text_config"]["rope_parameters"].update(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)
    return json.loads(json.dumps(ModelSpec.from_config(cfg).to_dict()))


def _from_dict_error(d: dict) -> str:
    with pytest.raises(ConfigError) as e:
        ModelSpec.from_dict(d)
    assert "\n" not in str(e.value) and str(e.value).startswith("model spec: ")
    return str(e.value)


def test_from_dict_rejects_the_reviewed_corruptions():
    # each of these crashed later (ZeroDivisionError, TypeError, ValueError) or was accepted
    for field, value in (("num_key_value_heads", 0), ("layer_types", 5), ("mrope_section", None),
                         ("partial_rotary_factor", "a"), ("hidden_size", "x"), ("hidden_size", True),
                         ("tie_word_embeddings", 1), ("rope_parameters", None), ("vision", {"depth": 2}),
                         ("eos_token_ids", 5), ("rms_norm_eps", float("nan")), ("rope_theta", float("inf"))):
        assert field in _from_dict_error({**_spec_dict(), field: value}), (field, value)
    d = _spec_dict()
    d["rope_parameters"]["factor"] = "a"
    assert _from_dict_error(d) == "model spec: rope_parameters.factor must be a finite number, got 'a'"


JUNK = (None, True, False, 0, -1, 1, 3, 4096, 0.5, -2.5, float("nan"), float("inf"), "", "x", [], [5], {}, {"a": 1})


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_from_dict_fails_only_with_config_error(moe):
    # Every field (and every vision / rope_parameters key) set to every junk value: from_dict either returns a
    # spec that works or raises a one-line ConfigError naming the field; never any other exception.
    base = _spec_dict(moe)
    edits = [((k,), v) for k in base for v in JUNK]
    edits += [(("vision", k), v) for k in base["vision"] for v in JUNK]
    edits += [(("rope_parameters", k), v) for k in list(base["rope_parameters"]) + ["attention_factor", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "truncate", "type"] for v in JUNK]
    failed = 0
    for path, value in edits:
        d = json.loads(json.dumps(base))
        target = d if len(path) == 1 else d[path[0]]
        target[path[-1]] = value
        try:
            spec = ModelSpec.from_dict(d)
        except ConfigError as e:
            failed += 1
            assert "\n" not in str(e) and path[-1] in str(e), (path, value, str(e))
            continue
        # accepted: then everything derived from it works
        spec.tensor_shapes(), spec.rope_type, spec.yarn, spec.full_attention_layers, spec.num_parameters()
    assert failed > len(edits) // 2  # the junk is mostly rejected; the accepted rest still builds


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


def test_what_transformers_would_honour_but_ninfer_does_not_implement():
    """hidden_act and attention_bias change transformers' model (ACT2FN, bias=True); a value other than the
    family's is refused by name, not run as if it were SiLU without biases. attn_output_gate is ignored by
    transformers' qwen3_5 classes (the gate is always on), so it is ignored here too."""
    assert _broken(lambda c, t: t.update(hidden_act="gelu")).endswith(
        "text_config.hidden_act is 'gelu': ninfer implements the family's SiLU (its MLPs, experts and DeltaNet "
        "convolution) only")
    assert _broken(lambda c, t: t.update(attention_bias=True), moe=False).endswith(
        "text_config.attention_bias is true: ninfer's attention projections have no bias terms")
    for value in ("silu", "swish"):
        cfg = _vlm_config(True)
        cfg["text_config"].update(hidden_act=value, attention_bias=False, attn_output_gate=False)
        assert ModelSpec.from_config(cfg).hidden_size == cfg["text_config"]["hidden_size"]


def test_errors_name_the_field(tmp_path):
    assert _broken(lambda c, t: c.update(model_type="llama")) == (
        "unsupported architecture 'llama': ninfer supports qwen3_5, qwen3_5_moe (Qwen3.5/Qwen3.6)")
    assert _broken(lambda c, t: t.pop("hidden_size")) == "config.json: text_config.hidden_size is missing"
    assert _broken(lambda c, t: c.pop("text_config")) == "config.json: text_config is missing"
    assert "text_config.layer_types has 3 entries but text_config.num_hidden_layers is 4" in _broken(
        lambda c, t: t.update(layer_types=t["layer_types"][:3]))
    assert "text_config.num_attention_heads (4) is not divisible by text_config.num_key_value_heads (3)" in _broken(
        lambda c, t: t.update(num_key_value_heads=3))
    # a typo'd layer count is refused at once, not enumerated (10**9 layers took 22 GB and minutes)
    assert _broken(lambda c, t: (t.pop("layer_types"), t.update(num_hidden_layers=10 ** 9))) == (
        "config.json: text_config.num_hidden_layers must be <= 1,024, got 1,000,000,000")
    assert "text_config.mtp_num_hidden_layers must be <= 1,024" in _broken(
        lambda c, t: t.update(mtp_num_hidden_layers=10 ** 6))
    assert "text_config.linear_num_value_heads (4) is not divisible" in _broken(
        lambda c, t: t.update(linear_num_key_heads=3))
    assert "rope_parameters.mrope_section [3, 1] needs 3 entries (T, H, W)" in _broken(
        lambda c, t: t["rope_parameters"].update(mrope_section=[3, 1]))
    # Qwen3-style YaRN keys beside the config's own rope_parameters: transformers would drop the latter's theta
    assert "text_config.rope_scaling and rope_parameters differ: transformers would take rope_scaling alone" in _broken(
        lambda c, t: t.update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}))
    assert _broken(lambda c, t: c.update(tie_word_embeddings=1)) == (  # named where it was read
        "config.json: tie_word_embeddings must be true or false, got 1")
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
