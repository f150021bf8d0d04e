"""The artifact plan: which artifact tensors a checkpoint becomes, in which format, at what size.

Computed from shapes alone (config.json, safetensors headers), so `ninfer-pack inspect SOURCE --recipe R`
can print sizes for a 67 GB checkpoint without reading a weight; `quantize` executes the same plan.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from ninfer_rt.formats import get_format
from ninfer_rt.layout import TensorPlan, plan_tensors
from ninfer_rt.recipe import Recipe, resolve_plans

# Tensor classes for the size tables: first matching pattern wins (searched in the artifact tensor name).
TENSOR_CLASSES: list[tuple[str, str]] = [
    ("vision", r"^model\.visual\."),
    ("mtp", r"^mtp\."),
    ("embedding", r"embed_tokens"),
    ("lm_head", r"^lm_head\."),
    ("routed experts gate/up", r"mlp\.experts\.gate_up_proj"),
    ("routed experts down", r"mlp\.experts\.down_proj"),
    ("router + shared gate", r"mlp\.\{gate,shared_expert_gate\}|mlp\.gate\.weight"),
    ("shared expert", r"mlp\.shared_expert\."),
    ("dense MLP", r"mlp\.(\{gate_proj,up_proj\}|gate_proj|up_proj|down_proj)"),
    ("attention", r"self_attn\.(?!(q_norm|k_norm))"),
    ("DeltaNet projections", r"linear_attn\.(\{in_proj_qkv|in_proj_qkv|in_proj_z|out_proj)"),
    ("DeltaNet a/b, conv", r"linear_attn\.(\{in_proj_b|in_proj_b|in_proj_a|conv1d)"),
    ("DeltaNet A_log, dt_bias", r"linear_attn\.(A_log|dt_bias)"),
    ("norms", r"norm"),
]
_CLASS_RE = [(c, re.compile(p)) for c, p in TENSOR_CLASSES]


def tensor_class(name: str) -> str:
    """The size-table class of an artifact tensor name."""
    for cls, rx in _CLASS_RE:
        if rx.search(name):
            return cls
    return "other"


CONFIGS_DIR = Path(__file__).resolve().parents[1] / "ninfer_rt" / "configs"


def builtin_configs() -> list[str]:
    """The names builtin_config_path knows."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def builtin_config_path(name: str) -> Path | None:
    """config.json of a known shape (e.g. qwen3.6-35b-a3b) shipped for planning and benchmarks, or None."""
    p = CONFIGS_DIR / f"{name}.json"
    return p if p.is_file() else None


@dataclass
class PlannedTensor:
    """One artifact tensor: its layout plan, resolved format, exact size and checkpoint parameter count."""

    plan: TensorPlan
    format: str
    nbytes: int
    params: int
    group: str

    @property
    def name(self) -> str:
        return self.plan.name


def plan_artifact(spec, shapes: dict[str, tuple], recipe: Recipe) -> tuple[list[PlannedTensor], list[str]]:
    """Plan every artifact tensor for checkpoint tensors `shapes` (canonical names); returns (plan, warnings)."""
    plans = plan_tensors(spec, list(shapes))  # raises for a name config.json does not imply
    formats, warnings = resolve_plans(recipe, plans, shapes)  # also checks each format can store its shape
    info = spec.tensor_shapes()
    out = []
    for p in plans:
        fmt = get_format(formats[p.name])
        params = sum(math.prod(s) for s in p.part_shapes)
        out.append(PlannedTensor(p, fmt.name, fmt.nbytes(tuple(p.shape)), params, info[p.parts[0]].group))
    return out, warnings


def planned_from_artifact(art) -> list[PlannedTensor]:
    """The plan an artifact (ninfer_rt.format.Artifact) records, from its tensor table alone."""
    return [PlannedTensor(e.plan(), e.format, e.nbytes, sum(math.prod(p["shape"]) for p in e.parts), e.group)
            for e in art.tensors.values()]


def summarize(planned: list[PlannedTensor]) -> list[dict]:
    """Rows per tensor class: tensors, parameters, formats, bytes, bits per weight; in TENSOR_CLASSES order."""
    rows: dict[str, dict] = {}
    for t in planned:
        cls = tensor_class(t.name)
        r = rows.setdefault(cls, {"class": cls, "tensors": 0, "params": 0, "nbytes": 0, "formats": set()})
        r["tensors"] += 1
        r["params"] += t.params
        r["nbytes"] += t.nbytes
        r["formats"].add(t.format)
    order = [c for c, _ in TENSOR_CLASSES] + ["other"]
    result = []
    for cls in order:
        if cls in rows:
            r = rows[cls]
            r["formats"] = ", ".join(sorted(r["formats"]))
            r["bpw"] = 8 * r["nbytes"] / r["params"] if r["params"] else 0.0
            result.append(r)
    return result
