"""Write tiny checkpoints in every on-disk form the source reader accepts, with the oracle of what it must read.

`write_checkpoint` takes a tiny transformers model (tests/hf_tiny.py) and writes config.json plus sharded
safetensors in one chosen spelling: VLM or *ForCausalLM prefixes, fused or per-expert experts, fp32 fields
among bf16, FP8 e4m3 block weights with bf16/fp32 scales, MTP per-expert/fused/absent. The expected tensors
come from the model's own parameters (cast as stored) and, for FP8, from transformers' own dequantization.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

import hf_tiny

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Linears the FP8 releases quantize (facts §4.4); embeddings, norms, routers, in_proj_a/b, conv1d, mtp.fc and
# the vision tower stay in the base dtype.
FP8_ELIGIBLE = re.compile(
    r"^(model\.language_model|mtp)\..*(self_attn\.[qkvo]_proj\.weight|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
    r"\.weight|mlp\.(shared_expert\.)?(gate|up|down)_proj\.weight|mlp\.experts\.(\d+\.(gate|up|down)_proj\.weight"
    r"|gate_up_proj|down_proj))$")
FP32_FIELDS = re.compile(r"linear_attn\.(A_log|norm\.weight)$")  # float32 in the Qwen3.5-35B release
_BANK = re.compile(r"^(?P<stem>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def text_config(model):
    """The text config of a tiny VLM or causal LM."""
    return getattr(model.config, "text_config", model.config)


def canonical_params(model) -> dict[str, torch.Tensor]:
    """The model's parameters (fp32) under canonical names: `model.*` of a causal LM moves under language_model."""
    out = {}
    for k, v in model.state_dict().items():
        if k.startswith("model.") and not k.startswith(("model.language_model.", "model.visual.")):
            k = "model.language_model." + k[len("model."):]
        out[k] = v.detach().float().clone()
    return out


def fused_mtp(model, per_expert: bool, seed: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """hf_tiny.mtp_tensors in the given form, and the same tensors with per-expert parts stacked into banks."""
    raw = hf_tiny.mtp_tensors(text_config(model), seed=seed, per_expert=per_expert)
    fused, parts = {}, {}
    for k, v in raw.items():
        m = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", k)
        if m:
            parts.setdefault(m[1], {})[(int(m[2]), m[3])] = v
        else:
            fused[k] = v
    for stem, p in parts.items():
        n = 1 + max(e for e, _ in p)
        fused[stem + ".gate_up_proj"] = torch.stack([torch.cat([p[(e, "gate_proj")], p[(e, "up_proj")]])
                                                     for e in range(n)])
        fused[stem + ".down_proj"] = torch.stack([p[(e, "down_proj")] for e in range(n)])
    return raw, fused


def quantize_fp8(w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype):
    """Block-FP8 e4m3: per (bn x bk) block scale = amax / 448 (stored in scale_dtype); edge blocks are partial.

    w: [..., N, K] float32 -> (q float8_e4m3fn [..., N, K], scale_inv [..., ceil(N/bn), ceil(K/bk)]).
    """
    bn, bk = block
    *lead, n, k = w.shape
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(*lead, nb * bn, kb * bk)
    padded[..., :n, :k] = w.abs()
    amax = padded.reshape(*lead, nb, bn, kb, bk).amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    # quantize against the scale as stored, so dequantization undoes exactly what was applied
    full = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def hf_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """transformers' own FP8 block dequantization, in float32: the oracle for the reader's."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    return _dequantize_fp8_weight(q, scale, list(block), torch.float32)


def write_checkpoint(dest, model=None, *, prefix: str = "vlm", experts: str = "fused", fp8: bool = False,
                     fp8_scale_dtype: torch.dtype = torch.bfloat16, fp32_fields: bool = True,
                     mtp: bool | str = True, shards: int = 2, dtype: torch.dtype = torch.bfloat16,
                     fp8_block: tuple[int, int] | None = (128, 128),
                     shard_name: str = "model-{i:05d}-of-{n:05d}.safetensors") -> tuple[Path, dict[str, torch.Tensor]]:
    """Write `model` as a checkpoint in `dest`; return (dest, expected canonical tensors in float32).

    prefix "vlm" writes `model.language_model.*` + `model.visual.*`; "causal" writes `model.*`, no vision, and
    the text config. experts "fused" | "per_expert" sets the main layers' expert form; mtp True/"per_expert",
    "fused" or False sets the MTP layer's. fp8_block None omits weight_block_size from quantization_config
    (the reader's default, 128 x 128, applies). Tensors are dealt round-robin over `shards` files, so per-expert
    parts and FP8 scales land in other shards than their neighbours; shards=1 writes model.safetensors alone.
    """
    assert prefix in ("vlm", "causal") and experts in ("fused", "per_expert")
    assert mtp in (True, False, "per_expert", "fused")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = hf_tiny.make_vlm(moe=True) if prefix == "vlm" else hf_tiny.make_causal_lm(moe=True)
    is_vlm = hasattr(model.config, "text_config")
    assert is_vlm or prefix == "causal", "a causal LM has no vision tower to write in VLM form"

    canon = {k: v for k, v in canonical_params(model).items() if prefix == "vlm" or not k.startswith("model.visual.")}
    mtp_form = {}
    if mtp:
        per_expert = mtp != "fused"
        _, fused = fused_mtp(model, per_expert)
        canon.update(fused)
        mtp_form = {k: ("per_expert" if per_expert else "fused") for k in fused}

    block = fp8_block or (128, 128)
    stored: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for name, value in canon.items():
        target = "model." + name[len("model.language_model."):] if (
            prefix == "causal" and name.startswith("model.language_model.")) else name
        store_dtype = torch.float32 if fp32_fields and FP32_FIELDS.search(name) else dtype
        m = _BANK.match(name)
        form = mtp_form.get(name, experts)
        if m and form == "per_expert":  # split the bank: gate rows first, then up, per expert
            tstem = _BANK.match(target)["stem"]
            rows = value.shape[1] // 2
            pieces = []
            for e in range(value.shape[0]):
                if m["kind"] == "gate_up_proj":
                    pieces += [(f"{tstem}.{e}.gate_proj.weight", value[e, :rows]),
                               (f"{tstem}.{e}.up_proj.weight", value[e, rows:])]
                else:
                    pieces.append((f"{tstem}.{e}.down_proj.weight", value[e]))
        else:
            pieces = [(target, value)]
        quantize = fp8 and FP8_ELIGIBLE.search(name) is not None
        read_back = []
        for pname, pv in pieces:
            if quantize:
                q, scale = quantize_fp8(pv, block, fp8_scale_dtype)
                stored[pname] = q
                stored[pname + "_scale_inv"] = scale
                read_back.append(hf_dequantize(q, scale, block))
            else:
                stored[pname] = pv.to(store_dtype).contiguous().clone()
                read_back.append(stored[pname].float())
        if len(read_back) == 1:
            expected[name] = read_back[0].reshape(value.shape)
        elif m["kind"] == "gate_up_proj":
            expected[name] = torch.stack([torch.cat(read_back[2 * e:2 * e + 2]) for e in range(value.shape[0])])
        else:
            expected[name] = torch.stack(read_back)

    cfg_obj = model.config if prefix == "vlm" or not is_vlm else model.config.text_config
    cfg = json.loads(cfg_obj.to_json_string(use_diff=False))
    cfg["architectures"] = [type(model).__name__.replace("ForConditionalGeneration", "ForCausalLM")
                            if prefix == "causal" else type(model).__name__]
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if fp8_block is not None:
            cfg["quantization_config"]["weight_block_size"] = list(fp8_block)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))

    names = list(stored)
    if shards == 1:
        save_file(stored, dest / "model.safetensors", metadata={"format": "pt"})
        return dest, expected
    files = [shard_name.format(i=i + 1, n=shards) for i in range(shards)]
    weight_map = {n: files[i % shards] for i, n in enumerate(names)}
    for f in files:
        save_file({n: stored[n] for n in names if weight_map[n] == f}, dest / f, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in stored.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dest, expected


def write_tied_checkpoint(dest: Path, kind: str = "dense") -> Path:
    """The built-in tiny checkpoint of `kind` with its head tied to the embedding, as Qwen3.5's small members ship:
    config.json says tie_word_embeddings and no lm_head.weight is stored."""
    from safetensors.torch import load_file

    from ninfer_pack.tiny import write_tiny_checkpoint

    src = write_tiny_checkpoint(Path(dest), kind)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop("lm_head.weight")
    tensors = load_file(src / shard)
    head = tensors.pop("lm_head.weight")
    save_file(tensors, src / shard, metadata={"format": "pt"})
    index["metadata"]["total_size"] -= head.numel() * head.element_size()
    index_path.write_text(json.dumps(index))
    return src
