"""Recipes: which weight format each checkpoint tensor gets, as data (recipes/*.toml).

A recipe is an ordered list of rules; each rule's `pattern` is a Python regex matched with re.fullmatch
against the canonical checkpoint tensor name, and the first matching rule gives the format. Every tensor
must be matched: there is no silent default, so a tensor a recipe never thought about stops the run.

    name = "qwen3.6-35b-a3b"
    description = "..."
    [[rules]]
    pattern = 'model\\.language_model\\.layers\\.\\d+\\.self_attn\\.[qkvo]_proj\\.weight'
    format = "q8g32"
    note = "why this format"        # optional
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from ninfer_rt.errors import NinferError, RecipeError
from ninfer_rt.formats import get_format
from ninfer_rt.layout import TensorPlan

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
_TOP_KEYS = {"name": True, "description": True, "rules": True}  # key -> required
_RULE_KEYS = {"pattern": True, "format": True, "note": False}


@dataclass(frozen=True)
class Rule:
    """One recipe rule: tensors whose name fully matches `pattern` get `format`; `number` is 1-based."""

    number: int
    pattern: str
    format: str
    note: str = ""

    @property
    def regex(self) -> re.Pattern:
        """The compiled pattern (re caches compilations)."""
        return re.compile(self.pattern)

    def describe(self) -> str:
        """`rule N ('pattern')` for messages."""
        return f"rule {self.number} ({self.pattern!r})"


@dataclass(frozen=True)
class Recipe:
    """A parsed, validated recipe: name, description and ordered rules; `source` is the file it came from."""

    name: str
    description: str
    rules: tuple[Rule, ...]
    source: str = ""

    def match(self, name: str) -> Rule | None:
        """The first rule whose pattern fully matches tensor `name`, or None."""
        for r in self.rules:
            if r.regex.fullmatch(name):
                return r
        return None

    def resolve(self, shapes: Mapping[str, Sequence[int]]) -> tuple[dict[str, str], list[str]]:
        """Format per tensor {name: format name}, and warnings (rules that matched no tensor).

        RecipeError naming the tensor if no rule matches it, or if its rule gives a quantized format to a
        tensor of fewer than 2 dims (or another shape the format cannot store).
        """
        out: dict[str, str] = {}
        used: set[int] = set()
        unmatched = []
        for name, shape in shapes.items():
            rule = self.match(name)
            if rule is None:
                unmatched.append(name)
                continue
            used.add(rule.number)
            _check_format_shape(rule.format, name, tuple(shape), rule.describe())
            out[name] = rule.format
        if unmatched:
            more = f" (and {len(unmatched) - 1} more)" if len(unmatched) > 1 else ""
            raise RecipeError(f"recipe {self.name}: tensor {unmatched[0]} matches no rule{more}")
        warnings = [f"recipe {self.name}: {r.describe()} matches no tensor" for r in self.rules if r.number not in used]
        return out, warnings

    def to_dict(self) -> dict:
        """JSON form for the artifact header."""
        return {"name": self.name, "description": self.description,
                "rules": [{"pattern": r.pattern, "format": r.format, "note": r.note} for r in self.rules]}


def _check_format_shape(fmt_name: str, tensor: str, shape: tuple, where: str) -> None:
    fmt = get_format(fmt_name)
    try:
        fmt.check_shape(shape)
    except NinferError as e:
        raise RecipeError(f"tensor {tensor} {list(shape)}: {where} gives {fmt_name}, which cannot store it ({e})") from None
    if fmt.is_quantized and len(shape) < 2:  # also enforced here in case a format's check is looser
        raise RecipeError(f"tensor {tensor} {list(shape)}: {where} gives quantized {fmt_name} to a <2-D tensor")


def known_recipes() -> list[str]:
    """Names of the recipes shipped in recipes/."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def _is_path(s: str) -> bool:
    return s.endswith(".toml") or "/" in s or "\\" in s or Path(s).is_file()


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Load a recipe: a bare NAME is recipes/NAME.toml in this repo, anything path-like is read as a file."""
    s = str(name_or_path)
    if isinstance(name_or_path, Path) or _is_path(s):
        path = Path(s)
        if path.exists() and not path.is_file():
            raise RecipeError(f"recipe {path} is not a regular file (a recipe is a TOML file, see recipes/README.md)")
        if not path.is_file():
            raise RecipeError(f"recipe file not found: {path}")
    else:
        path = RECIPES_DIR / f"{s}.toml"
        if not path.is_file():
            raise RecipeError(f"unknown recipe {s!r} (known: {', '.join(known_recipes()) or 'none'})")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: TOML syntax error: {e}") from None
    except RecursionError:
        raise RecipeError(f"{path}: nested too deeply (a recipe is a flat table of rules, see recipes/README.md)"
                          ) from None
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return parse_recipe(data, str(path))


def _check_keys(d: Mapping, spec: Mapping[str, bool], where: str) -> None:
    unknown = sorted(set(d) - set(spec))
    if unknown:
        raise RecipeError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(spec)})")
    missing = [k for k, required in spec.items() if required and k not in d]
    if missing:
        raise RecipeError(f"{where}: missing key {missing[0]!r}")
    for k, v in d.items():
        if k != "rules" and not isinstance(v, str):
            raise RecipeError(f"{where}: key {k!r} must be a string, got {type(v).__name__}")


def parse_recipe(data: Mapping, source: str = "<recipe>") -> Recipe:
    """Validate a recipe already parsed from TOML (a dict) and build the Recipe."""
    _check_keys(data, _TOP_KEYS, source)
    raw_rules = data["rules"]
    if not isinstance(raw_rules, list) or not raw_rules:
        raise RecipeError(f"{source}: 'rules' must be a non-empty array of tables ([[rules]])")
    rules = []
    for i, r in enumerate(raw_rules, start=1):
        where = f"{source}: rule {i}"
        if not isinstance(r, dict):
            raise RecipeError(f"{where}: must be a table ([[rules]])")
        _check_keys(r, _RULE_KEYS, where)
        try:
            re.compile(r["pattern"])
        except (re.error, OverflowError, RecursionError) as e:  # a huge repeat count overflows, deep nesting recurses
            raise RecipeError(f"{where}: invalid regex {r['pattern']!r}: {e}") from None
        try:
            fmt = get_format(r["format"]).name
        except NinferError:
            raise RecipeError(f"{where}: unknown format {r['format']!r}") from None
        rules.append(Rule(i, r["pattern"], fmt, r.get("note", "")))
    return Recipe(data["name"], data["description"], tuple(rules), source)


def _members(plan: TensorPlan) -> list[str]:
    """Short names of a fused plan's parts: the brace members (`q_proj`), or the full names otherwise."""
    m = re.search(r"\{([^{}]+)\}", plan.name)
    members = m[1].split(",") if m else []
    return members if len(members) == len(plan.parts) else list(plan.parts)


def resolve_plans(recipe: Recipe, plans: Sequence[TensorPlan],
                  shapes: Mapping[str, Sequence[int]]) -> tuple[dict[str, str], list[str]]:
    """Format per artifact tensor {plan name: format}, and the recipe's warnings.

    Every part of a fused plan must get the same format (RecipeError otherwise), and the format must be
    able to store the fused shape.
    """
    per_tensor, warnings = recipe.resolve(shapes)
    out: dict[str, str] = {}
    for plan in plans:
        fmts = [per_tensor[p] for p in plan.parts]
        if len(set(fmts)) > 1:
            mix = ", ".join(f"{m}={f}" for m, f in zip(_members(plan), fmts))
            raise RecipeError(f"fused tensor {plan.name} mixes formats: {mix}")
        _check_format_shape(fmts[0], plan.name, tuple(plan.shape), f"recipe {recipe.name}")
        out[plan.name] = fmts[0]
    return out, warnings
