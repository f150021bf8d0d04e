"""The model described from config.json, for the whole qwen3_5 / qwen3_5_moe (Qwen3.5 / Qwen3.6) family.

`ModelSpec.from_config` reads the three shapes config.json comes in: the VLM form (top-level `model_type`
qwen3_5 / qwen3_5_moe with a nested `text_config` and usually a `vision_config`), the flat text-only form
(`qwen3_5_text` / `qwen3_5_moe_text`), and FP8 releases (a top-level `quantization_config`). Nothing is
specific to one checkpoint: every dimension comes from the file, defaults are transformers' own.

`ModelSpec.tensor_shapes()` lists every tensor the model implies under its canonical name
(docs/architecture.md): language model under `model.language_model.`, `lm_head`, `mtp.*` with fused expert
banks, `model.visual.*`. numpy-free and torch-free: this module is plain Python.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ninfer_rt.config_fields import Fields, token_ids
from ninfer_rt.errors import ConfigError, SourceError, json_reason

FAMILIES = ("qwen3_5", "qwen3_5_moe")
LINEAR, FULL = "linear_attention", "full_attention"
MAX_LAYERS = 1024  # a sanity bound (the family has 24-64): a config past it is a typo, not a model to enumerate
GROUPS = ("text", "mtp", "vision")
ROPE_TYPES = ("default", "yarn")
# transformers' rotary embedding falls back to this split when rope_parameters has no mrope_section.
_HF_MROPE_SECTION = (11, 11, 10)
_VISION_FIELDS = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                  "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings")
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
_COUNT_FIELDS = _MOE_FIELDS + ("mtp_num_hidden_layers",)  # spec integers that may be 0


@dataclass(frozen=True)
class TensorInfo:
    """One canonical tensor: its shape and the part of the model it belongs to ("text", "mtp" or "vision")."""

    shape: tuple[int, ...]
    group: str

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class VisionSpec:
    """The vision tower (ViT + 2x2 patch merger) of a Qwen3.5/3.6 VLM checkpoint."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def merged_size(self) -> int:
        """Width of one merged token: spatial_merge_size² patches concatenated."""
        return self.hidden_size * self.spatial_merge_size ** 2


@dataclass(frozen=True)
class Yarn:
    """YaRN rope scaling (rope_type "yarn") with transformers' defaults filled in.

    `attention_factor` multiplies cos and sin: as given, else 0.1·ln(factor) + 1 (or the mscale /
    mscale_all_dim ratio of the same form when both are set), as transformers' _compute_yarn_parameters.
    """

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float
    beta_slow: float
    truncate: bool


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_scaling(r: Fields, max_position_embeddings: int) -> tuple[str, Yarn | None]:
    """The rope type of a rope_parameters object and, for "yarn", its parameters; errors name the key."""
    # "type" is the older spelling transformers still reads
    key = "type" if r.obj.get("rope_type") is None and r.has("type") else "rope_type"
    rope_type = r.obj.get(key)
    rope_type = "default" if rope_type is None else rope_type
    if rope_type not in ROPE_TYPES:
        raise r.error(key, f"{rope_type!r} is not supported (ninfer supports {', '.join(ROPE_TYPES)})")
    if rope_type == "default":
        return rope_type, None
    factor = r.get_float("factor", minimum=1.0)
    original = r.get_int("original_max_position_embeddings", default=max_position_embeddings)
    mscale, mscale_all_dim = r.get_float("mscale", 0.0), r.get_float("mscale_all_dim", 0.0)
    if r.has("attention_factor"):
        attention = r.get_float("attention_factor", above=0.0)
    elif mscale and mscale_all_dim:
        attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    else:
        attention = _yarn_mscale(factor)
    # transformers reads `beta_fast or 32`, `beta_slow or 1`: a 0 means the default too
    beta_fast = r.get_float("beta_fast", 0.0) or 32.0
    beta_slow = r.get_float("beta_slow", 0.0) or 1.0
    if not 0 < beta_slow <= beta_fast:
        raise r.error("beta_fast", f"({beta_fast}) and beta_slow ({beta_slow}) must satisfy 0 < beta_slow <= beta_fast")
    # transformers reads rope_parameters.get("truncate", True): a null given is falsy (no truncation)
    truncate = True if "truncate" not in r.obj else r.obj["truncate"] is not None and r.get_bool("truncate")
    return rope_type, Yarn(factor, original, attention, beta_fast, beta_slow, truncate)


@dataclass(frozen=True)
class ModelSpec:
    """A Qwen3.5/3.6 model as config.json describes it: the text model, the MTP head and the vision tower.

    Dense members (family "qwen3_5") have `intermediate_size` and `num_experts == 0`; MoE members have
    `intermediate_size is None` and the four MoE sizes. `rope_parameters` is the rope object as written;
    `rope_type` and `yarn` are read from it. `raw` is the config.json object it was read from (from_config
    only: to_dict leaves it out, the artifact header keeps config.json itself).
    """

    family: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int | None
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool  # as written; the family always interleaves (transformers reads no other way)
    rope_parameters: dict
    max_position_embeddings: int
    tie_word_embeddings: bool
    mtp_num_hidden_layers: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    vision: VisionSpec | None
    quantization: dict | None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes ----
    @property
    def is_moe(self) -> bool:
        """True for the qwen3_5_moe family (routed experts + shared expert in every layer)."""
        return self.family == "qwen3_5_moe"

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each attention head that get (m)RoPE; the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_type(self) -> str:
        """"default" (plain RoPE) or "yarn"."""
        return _rope_scaling(Fields(self.rope_parameters, "model spec", "rope_parameters."),
                             self.max_position_embeddings)[0]

    @property
    def yarn(self) -> Yarn | None:
        """The YaRN parameters when rope_type is "yarn", else None."""
        return _rope_scaling(Fields(self.rope_parameters, "model spec", "rope_parameters."),
                             self.max_position_embeddings)[1]

    @property
    def key_dim(self) -> int:
        """Gated DeltaNet q (and k) width: key heads × key head dim."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        """Gated DeltaNet v (and z, output) width: value heads × value head dim."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the DeltaNet causal conv: [q | k | v]."""
        return 2 * self.key_dim + self.value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Indices of the gated softmax-attention layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    # ---- reading ----
    @classmethod
    def from_file(cls, path: str | Path) -> ModelSpec:
        """Read a config.json file (or the config.json inside a checkpoint directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise SourceError(f"{path}: no such file")
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as e:  # ValueError: bad UTF-8, bad JSON, a 4,301-digit integer
            raise ConfigError(f"{path}: not valid JSON ({json_reason(e)})") from None
        return cls.from_config(cfg, source=str(path))

    @classmethod
    def from_config(cls, cfg: dict, source: str = "config.json") -> ModelSpec:
        """Describe the model of a parsed config.json (VLM, text-only or FP8 form); `source` names it in errors."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
        top = Fields(cfg, source, "")
        model_type = cfg.get("model_type")
        if model_type is None:
            raise top.error("model_type", "is missing")
        if model_type in FAMILIES:  # VLM form: the language model lives under text_config
            family = model_type
            text_cfg = top.get_dict("text_config")
            if text_cfg is None:
                raise top.error("text_config", "is missing")
            text = Fields(text_cfg, source, "text_config.")
            inner = text_cfg.get("model_type")
            if inner is not None and inner != family + "_text":
                raise text.error("model_type", f"is {inner!r}, which does not match model_type {family!r}")
            vision_cfg = top.get_dict("vision_config")
            tie_at = "" if "tie_word_embeddings" in cfg else "text_config."  # where it is read, for its error
            tie = cfg.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", False))
        elif model_type in tuple(f + "_text" for f in FAMILIES):
            family, text, vision_cfg = model_type[: -len("_text")], top, None
            tie, tie_at = cfg.get("tie_word_embeddings", False), ""
        else:
            raise ConfigError(f"unsupported architecture {model_type!r}: ninfer supports "
                              f"{', '.join(FAMILIES)} (Qwen3.5/Qwen3.6)")
        t = text.obj
        # transformers would honour other values of these two; the reference and the kernels implement the family's
        act = t.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise text.error("hidden_act", f"is {act!r}: ninfer implements the family's SiLU (its MLPs, experts and "
                                           f"DeltaNet convolution) only")
        if text.get_bool("attention_bias", False):
            raise text.error("attention_bias", "is true: ninfer's attention projections have no bias terms")

        num_layers = text.get_int("num_hidden_layers", maximum=MAX_LAYERS)
        if t.get("layer_types") is not None:
            if not isinstance(t["layer_types"], list):
                raise text.error("layer_types", "must be a list")
            layer_types = tuple(t["layer_types"])
        else:  # transformers' rule: every interval-th layer (1-based) is full attention
            interval = text.get_int("full_attention_interval", default=4)
            layer_types = tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))

        # Rope settings: rope_parameters (or the older rope_scaling) first, then text-config top level.
        params, scaling = text.get_dict("rope_parameters"), text.get_dict("rope_scaling")
        if params and scaling and params != scaling:  # Qwen3-style YaRN keys added beside a Qwen3.5 config's own
            raise text.error("rope_scaling", "and rope_parameters differ: transformers would take rope_scaling alone, "
                                             "dropping rope_parameters' rope_theta and mrope_section; put the scaling "
                                             "keys (rope_type, factor, ...) into rope_parameters, as the model card "
                                             "does")
        rope = params or scaling or {}
        rp = Fields(rope, source, text.prefix + ("rope_parameters." if t.get("rope_parameters") else
                                                  "rope_scaling." if t.get("rope_scaling") else ""))
        rope_theta = rp.get_float("rope_theta", text.get_float("rope_theta", 10000.0))
        partial = rp.get_float("partial_rotary_factor", text.get_float("partial_rotary_factor", 0.25))
        # transformers reads mrope_section from the rope object only (a text-config-level one is not used)
        section = rp.get_int_list("mrope_section") if rope.get("mrope_section") is not None else _HF_MROPE_SECTION
        rope_params = copy.deepcopy(rope)
        # transformers lets a text-config-level original_max_position_embeddings override rope_parameters' own
        if text.has("original_max_position_embeddings") and rope.get("rope_type", rope.get("type")) == "yarn":
            rope_params["original_max_position_embeddings"] = t["original_max_position_embeddings"]

        if family == "qwen3_5_moe":
            moe = {k: text.get_int(k) for k in _MOE_FIELDS}
            intermediate = None
        else:
            moe = dict.fromkeys(_MOE_FIELDS, 0)
            intermediate = text.get_int("intermediate_size")

        bos = t.get("bos_token_id", cfg.get("bos_token_id"))
        if bos is not None and (type(bos) is not int or bos < 0):
            raise text.error("bos_token_id", f"must be a token id, got {bos!r}")
        eos_raw = t.get("eos_token_id", cfg.get("eos_token_id"))
        quant = top.get_dict("quantization_config") or text.get_dict("quantization_config")

        spec = cls(
            family=family,
            hidden_size=text.get_int("hidden_size"),
            num_hidden_layers=num_layers,
            vocab_size=text.get_int("vocab_size"),
            num_attention_heads=text.get_int("num_attention_heads"),
            num_key_value_heads=text.get_int("num_key_value_heads"),
            head_dim=text.get_int("head_dim"),
            layer_types=layer_types,
            linear_num_key_heads=text.get_int("linear_num_key_heads"),
            linear_num_value_heads=text.get_int("linear_num_value_heads"),
            linear_key_head_dim=text.get_int("linear_key_head_dim"),
            linear_value_head_dim=text.get_int("linear_value_head_dim"),
            linear_conv_kernel_dim=text.get_int("linear_conv_kernel_dim", default=4),
            intermediate_size=intermediate,
            **moe,
            rms_norm_eps=text.get_float("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            mrope_section=tuple(section),
            mrope_interleaved=rp.get_bool("mrope_interleaved", True),
            rope_parameters=rope_params,
            max_position_embeddings=text.get_int("max_position_embeddings", default=32768),
            tie_word_embeddings=Fields({"tie_word_embeddings": tie}, source, tie_at).get_bool(
                "tie_word_embeddings", False),
            mtp_num_hidden_layers=text.get_int("mtp_num_hidden_layers", default=0, minimum=0, maximum=MAX_LAYERS),
            bos_token_id=bos,
            eos_token_ids=token_ids(eos_raw, f"{source}: {text.prefix}eos_token_id"),
            vision=_vision(vision_cfg, source) if vision_cfg is not None else None,
            quantization=copy.deepcopy(quant),
            raw=copy.deepcopy(cfg),
        )
        spec._validate(source, text.prefix, rp.prefix, rp.prefix)
        return spec

    def _validate(self, source: str, prefix: str, rope_prefix: str, rope_dict_prefix: str) -> None:
        """Ranges and cross-field consistency; each failure names the fields that disagree.

        `rope_prefix` names where rope_theta / partial_rotary_factor / mrope_section were read, and
        `rope_dict_prefix` the rope_parameters object (its rope_type and YaRN keys).
        """
        p = prefix

        def fail(msg: str) -> ConfigError:
            return ConfigError(f"{source}: {msg}")

        if self.family not in FAMILIES:
            raise fail(f"family {self.family!r} is not one of {', '.join(FAMILIES)}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise fail(f"{p}layer_types has {len(self.layer_types)} entries but {p}num_hidden_layers is "
                       f"{self.num_hidden_layers}")
        for i, lt in enumerate(self.layer_types):
            if lt not in (LINEAR, FULL):
                raise fail(f"{p}layer_types[{i}] is {lt!r}; expected {LINEAR!r} or {FULL!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise fail(f"{p}num_attention_heads ({self.num_attention_heads}) is not divisible by "
                       f"{p}num_key_value_heads ({self.num_key_value_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise fail(f"{p}linear_num_value_heads ({self.linear_num_value_heads}) is not divisible by "
                       f"{p}linear_num_key_heads ({self.linear_num_key_heads})")
        if not self.rms_norm_eps >= 0:
            raise fail(f"{p}rms_norm_eps must be >= 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 1:
            raise fail(f"{rope_prefix}rope_theta must be > 1, got {self.rope_theta}")
        _rope_scaling(Fields(self.rope_parameters, source, rope_dict_prefix), self.max_position_embeddings)
        rot = self.rotary_dim
        if rot <= 0 or rot % 2 or rot > self.head_dim:
            raise fail(f"{rope_prefix}partial_rotary_factor {self.partial_rotary_factor} gives rotary dim {rot} "
                       f"for head_dim {self.head_dim}; it must be even and in 2..head_dim")
        # interleaved mRoPE gives H the frequencies j = 1, 4, ... below 3·section[1] and W j = 2, 5, ... below
        # 3·section[2] (T the rest), clipped to rotary_dim/2 as transformers' slices are: any sum runs
        if len(self.mrope_section) < 3:
            raise fail(f"{rope_prefix}mrope_section {list(self.mrope_section)} needs 3 entries (T, H, W)")
        if self.is_moe:
            if self.intermediate_size is not None:
                raise fail(f"{p}intermediate_size must be unset for the qwen3_5_moe family")
            for name in _MOE_FIELDS:
                if getattr(self, name) < 1:
                    raise fail(f"{p}{name} must be >= 1 for the qwen3_5_moe family, got {getattr(self, name)}")
            if self.num_experts_per_tok > self.num_experts:
                raise fail(f"{p}num_experts_per_tok ({self.num_experts_per_tok}) exceeds {p}num_experts "
                           f"({self.num_experts})")
        elif self.intermediate_size is None or any(getattr(self, name) for name in _MOE_FIELDS):
            raise fail(f"{p}intermediate_size must be set and {', '.join(_MOE_FIELDS)} 0 for the dense qwen3_5 "
                       f"family")
        v = self.vision
        if v is not None and v.hidden_size % v.num_heads:
            raise fail(f"vision_config.hidden_size ({v.hidden_size}) is not divisible by "
                       f"vision_config.num_heads ({v.num_heads})")

    # ---- tensors ----
    def tensor_shapes(self) -> dict[str, TensorInfo]:
        """Every tensor of the model under its canonical name, in checkpoint order: text, then mtp, then vision.

        Routed experts are fused banks `experts.gate_up_proj [E, 2I, H]` and `experts.down_proj [E, H, I]`,
        FP8 pairs are one dequantized `weight`, and lm_head is absent when tied to the embedding.
        """
        out: dict[str, TensorInfo] = {}
        H, V = self.hidden_size, self.vocab_size
        lm = "model.language_model."
        out[lm + "embed_tokens.weight"] = TensorInfo((V, H), "text")
        for i, lt in enumerate(self.layer_types):
            self._add_decoder_layer(out, f"{lm}layers.{i}.", lt, "text")
        out[lm + "norm.weight"] = TensorInfo((H,), "text")
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = TensorInfo((V, H), "text")
        if self.mtp_num_hidden_layers:
            out["mtp.fc.weight"] = TensorInfo((H, 2 * H), "mtp")  # input: concat(embedding, hidden)
            for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
                out[f"mtp.{n}.weight"] = TensorInfo((H,), "mtp")
            for i in range(self.mtp_num_hidden_layers):
                self._add_decoder_layer(out, f"mtp.layers.{i}.", FULL, "mtp")
            out["mtp.norm.weight"] = TensorInfo((H,), "mtp")
        if self.vision is not None:
            self._add_vision(out)
        return out

    def _add_decoder_layer(self, out: dict[str, TensorInfo], p: str, layer_type: str, group: str) -> None:
        H = self.hidden_size

        def add(name: str, *shape: int) -> None:
            out[p + name] = TensorInfo(tuple(shape), group)

        add("input_layernorm.weight", H)
        if layer_type == LINEAR:
            nv, dv = self.linear_num_value_heads, self.linear_value_head_dim
            add("linear_attn.in_proj_qkv.weight", self.conv_dim, H)
            add("linear_attn.in_proj_z.weight", self.value_dim, H)
            add("linear_attn.in_proj_b.weight", nv, H)
            add("linear_attn.in_proj_a.weight", nv, H)
            add("linear_attn.conv1d.weight", self.conv_dim, 1, self.linear_conv_kernel_dim)
            add("linear_attn.A_log", nv)
            add("linear_attn.dt_bias", nv)
            add("linear_attn.norm.weight", dv)
            add("linear_attn.out_proj.weight", H, self.value_dim)
        else:
            d, nh, nkv = self.head_dim, self.num_attention_heads, self.num_key_value_heads
            add("self_attn.q_proj.weight", 2 * nh * d, H)  # per head: d query rows, then d gate rows
            add("self_attn.k_proj.weight", nkv * d, H)
            add("self_attn.v_proj.weight", nkv * d, H)
            add("self_attn.o_proj.weight", H, nh * d)
            add("self_attn.q_norm.weight", d)
            add("self_attn.k_norm.weight", d)
        add("post_attention_layernorm.weight", H)
        if self.is_moe:
            E, I, Is = self.num_experts, self.moe_intermediate_size, self.shared_expert_intermediate_size
            add("mlp.gate.weight", E, H)
            add("mlp.experts.gate_up_proj", E, 2 * I, H)  # gate rows, then up rows, per expert
            add("mlp.experts.down_proj", E, H, I)
            add("mlp.shared_expert.gate_proj.weight", Is, H)
            add("mlp.shared_expert.up_proj.weight", Is, H)
            add("mlp.shared_expert.down_proj.weight", H, Is)
            add("mlp.shared_expert_gate.weight", 1, H)
        else:
            I = self.intermediate_size
            add("mlp.gate_proj.weight", I, H)
            add("mlp.up_proj.weight", I, H)
            add("mlp.down_proj.weight", H, I)

    def _add_vision(self, out: dict[str, TensorInfo]) -> None:
        v = self.vision
        hid, M = v.hidden_size, v.merged_size

        def add(name: str, *shape: int) -> None:
            out["model.visual." + name] = TensorInfo(tuple(shape), "vision")

        add("patch_embed.proj.weight", hid, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        add("patch_embed.proj.bias", hid)
        add("pos_embed.weight", v.num_position_embeddings, hid)
        for b in range(v.depth):
            p = f"blocks.{b}."
            for n in ("norm1", "norm2"):
                add(p + n + ".weight", hid)
                add(p + n + ".bias", hid)
            for n, rows, cols in (("attn.qkv", 3 * hid, hid), ("attn.proj", hid, hid),
                                  ("mlp.linear_fc1", v.intermediate_size, hid),
                                  ("mlp.linear_fc2", hid, v.intermediate_size)):
                add(p + n + ".weight", rows, cols)
                add(p + n + ".bias", rows)
        add("merger.norm.weight", hid)
        add("merger.norm.bias", hid)
        add("merger.linear_fc1.weight", M, M)
        add("merger.linear_fc1.bias", M)
        add("merger.linear_fc2.weight", v.out_hidden_size, M)
        add("merger.linear_fc2.bias", v.out_hidden_size)

    def num_parameters(self, groups: tuple[str, ...] = GROUPS) -> int:
        """Total elements over tensor_shapes() in the given groups."""
        return sum(t.numel for t in self.tensor_shapes().values() if t.group in groups)

    # ---- serialisation (the artifact header carries the spec) ----
    def to_dict(self) -> dict:
        """A JSON-able dict of every field but `raw` (tuples become lists, `vision` a dict); inverse of from_dict."""
        d: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "raw":
                continue
            if isinstance(value, VisionSpec):
                value = {k: getattr(value, k) for k in _VISION_FIELDS}
            elif isinstance(value, tuple):
                value = list(value)
            d[f.name] = copy.deepcopy(value)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        """Rebuild a spec from to_dict() output (e.g. an artifact header), checking every field's type and range
        and then the model as from_config does; any malformed field gives a one-line ConfigError naming it.
        Unknown keys (such as `raw`, written by older versions) are ignored."""
        if not isinstance(d, dict):
            raise ConfigError(f"model spec: expected an object, got {type(d).__name__}")
        for f in fields(cls):
            if f.name != "raw" and f.name not in d:
                raise ConfigError(f"model spec: field {f.name} is missing")
        r = Fields(d, "model spec", "")

        def nullable(name: str, read):
            return None if d[name] is None else read(name)

        kw: dict[str, Any] = {f.name: r.get_int(f.name, minimum=0 if f.name in _COUNT_FIELDS else 1)
                              for f in fields(cls) if f.type == "int"}
        if not isinstance(d["family"], str):
            raise r.error("family", f"must be a string, got {d['family']!r}")
        if not isinstance(d["layer_types"], list):
            raise r.error("layer_types", f"must be a list, got {d['layer_types']!r}")
        if not isinstance(d["eos_token_ids"], list):
            raise r.error("eos_token_ids", f"must be a list of token ids, got {d['eos_token_ids']!r}")
        if d["rope_parameters"] is None:
            raise r.error("rope_parameters", "must be an object, got None")
        kw.update(
            family=d["family"],
            layer_types=tuple(d["layer_types"]),
            intermediate_size=nullable("intermediate_size", r.get_int),
            rms_norm_eps=r.get_float("rms_norm_eps"),
            rope_theta=r.get_float("rope_theta"),
            partial_rotary_factor=r.get_float("partial_rotary_factor"),
            mrope_section=r.get_int_list("mrope_section"),
            mrope_interleaved=r.get_bool("mrope_interleaved"),
            rope_parameters=copy.deepcopy(r.get_dict("rope_parameters")),
            tie_word_embeddings=r.get_bool("tie_word_embeddings"),
            bos_token_id=nullable("bos_token_id", lambda k: r.get_int(k, minimum=0)),
            eos_token_ids=token_ids(d["eos_token_ids"], "model spec: eos_token_ids"),
            vision=nullable("vision", lambda k: _vision(r.get_dict(k), "model spec", "vision.", strict=True)),
            quantization=copy.deepcopy(r.get_dict("quantization")),
        )
        spec = cls(**kw)
        spec._validate("model spec", "", "", "rope_parameters.")
        return spec


def _vision(cfg: dict, source: str, prefix: str = "vision_config.", strict: bool = False) -> VisionSpec:
    """Read vision_config (or a spec's `vision`); every size is required except in_channels (3, RGB) unless strict."""
    r = Fields(cfg, source, prefix)
    return VisionSpec(**{k: r.get_int(k, default=3 if k == "in_channels" and not strict else None)
                         for k in _VISION_FIELDS})
