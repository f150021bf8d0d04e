"""quantize: checkpoint -> plan -> (layout transform, choose codes, pack) per tensor -> one artifact file.

Memory stays bounded by one artifact tensor: its checkpoint parts are read, transformed while still in
their 16-bit source form, then encoded in row chunks converted to float32 on the fly.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ninfer_rt import __version__
from ninfer_rt.chat import ChatTemplate
from ninfer_rt.errors import NinferError, SourceError
from ninfer_rt.format import ArtifactWriter, TensorEntry, check_output_path
from ninfer_rt.formats import bf16_bits_to_f32, get_format
from ninfer_rt.layout import apply_forward
from ninfer_pack.plan import PlannedTensor, plan_artifact
from ninfer_pack.quant import quantize_rows
from ninfer_rt.recipe import Recipe, load_recipe
from ninfer_rt.sampling import SamplingParams
from ninfer_pack.source import Checkpoint
from ninfer_rt.tokenizer import Tokenizer

ROW_CHUNK_ELEMS = 1 << 24  # 16 M weights per encode chunk: ~64 MB of float32 plus search temporaries


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A checkpoint tensor as numpy: bf16 as uint16 bit patterns (exact), other dtypes as they are."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.contiguous().numpy()


def as_f32(a: np.ndarray) -> np.ndarray:
    """float32 view of a uint16-bf16 or float array (exact for bf16/f16/f32)."""
    return bf16_bits_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32, copy=False)


def read_parts(ckpt: Checkpoint, parts: tuple[str, ...]) -> list[np.ndarray]:
    """Read a plan's parts; keep 16-bit bf16 bits when every part is bf16, else widen all to float32."""
    arrays = [to_numpy(ckpt.read(p)) for p in parts]
    if len({a.dtype for a in arrays}) > 1:
        arrays = [as_f32(a) for a in arrays]
    return arrays


# |x| at or past which rounding to the format gives inf: half an ulp above its largest finite value
_OVERFLOW = {"f16": 65520.0, "bf16": 2.0 ** 128 * (1 - 2.0 ** -9), "fp32": math.inf}


def _check_representable(arr: np.ndarray, fmt_name: str, name: str | None) -> None:
    """NinferError naming the first weight that is not finite or that the 16-bit format would round to inf (a raw
    format stores what it is given: such a weight would reach the model as inf)."""
    flat = arr.reshape(-1)
    for i in range(0, flat.size, ROW_CHUNK_ELEMS):  # chunks: the temporaries of a whole embedding are GBs
        chunk = flat[i:i + ROW_CHUNK_ELEMS]
        if chunk.dtype == np.uint16 and fmt_name == "bf16":  # bf16 bits kept as they are: inf and NaN are out
            bad = np.flatnonzero((chunk & 0x7F80) == 0x7F80)
        else:
            bad = np.flatnonzero(~(np.abs(as_f32(chunk)) < _OVERFLOW[fmt_name]))  # NaN compares false
        if bad.size:
            first, K = i + int(bad[0]), arr.shape[-1]
            value = float(as_f32(flat[first:first + 1])[0])
            raise NinferError(f"tensor {name or '?'}: weight row {first // K}, column {first % K}: {value:g} "
                              f"{'is not finite' if not math.isfinite(value) else f'is outside {fmt_name} range'}")


def encode_tensor(arr: np.ndarray, fmt_name: str, importance: torch.Tensor | None = None,
                  name: str | None = None) -> np.ndarray:
    """Encode one artifact-layout array into its format's bytes (np.uint8 of exactly nbytes).

    A weight the format cannot encode (non-finite, or a group whose scale overflows fp16) raises
    NinferError naming `name` and the row/col in the artifact layout.
    """
    fmt = get_format(fmt_name)
    if not fmt.is_quantized:
        _check_representable(arr, fmt.name, name)
        if fmt.name == "bf16" and arr.dtype == np.uint16:
            return fmt.encode(arr)
        return fmt.encode(as_f32(arr))
    K = arr.shape[-1]
    rows = arr.reshape(-1, K)
    R = rows.shape[0]
    buf = np.zeros(fmt.nbytes(arr.shape), dtype=np.uint8)
    step = max(1, ROW_CHUNK_ELEMS // K)
    for r0 in range(0, R, step):  # encode and pack chunk by chunk straight into the final buffer
        w = torch.from_numpy(as_f32(rows[r0:r0 + step]))
        try:
            q, scales = quantize_rows(w, fmt.bits, fmt.group, importance=importance, first_row=r0)
        except NinferError as e:
            raise NinferError(f"tensor {name}: {e}" if name else str(e)) from None
        fmt.pack_rows(buf, R, r0, q.numpy(), scales.numpy())
    return buf


def load_importance(path: str | Path | None) -> dict[str, torch.Tensor]:
    """Per-input-channel importance (e.g. mean squared activations): a safetensors file of name -> [K].

    Checks the file alone (readable, 1-D, finite, >= 0); match_importance checks it against the plan.
    """
    if path is None:
        return {}
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise SourceError(f"--importance {p} is a directory: give the .safetensors file calibrate wrote" if p.is_dir()
                          else f"no such importance file: {p}")
    try:
        tensors = load_file(str(p))
    except (SafetensorError, OSError, ValueError) as e:
        raise SourceError(f"{p} is not a readable safetensors file: {e}") from None
    out = {}
    for name, t in tensors.items():
        if t.dim() != 1:
            raise SourceError(f"{p}: importance for {name} must be 1-D [K], got {list(t.shape)}")
        if t.dtype.is_complex or t.dtype == torch.bool:  # any other float or integer type reads as its values
            raise SourceError(f"{p}: importance for {name} is {str(t.dtype).removeprefix('torch.')}: it must be "
                              "real numbers")
        t = t.float()
        if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            bad = int((~torch.isfinite(t) | (t < 0)).nonzero()[0])
            raise SourceError(f"{p}: importance for {name} has {t[bad].item()} at channel {bad}; "
                              "every value must be finite and >= 0")
        out[name] = t
    return out


def importance_calibration(path: str | Path | None) -> dict | None:
    """How an importance file was measured, where `ninfer-pack calibrate` wrote it (its ninfer.calibration
    metadata: source, windows, tokens, statistic); None for a file from elsewhere or no file."""
    if path is None:
        return None
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get("ninfer.calibration")
    try:
        info = json.loads(raw) if raw else None
    except (ValueError, RecursionError):  # metadata from elsewhere: not ours to describe
        return None
    return info if isinstance(info, dict) else None


def match_importance(importance: dict[str, torch.Tensor], planned: list[PlannedTensor],
                     path: str | Path = "importance") -> dict[str, torch.Tensor]:
    """Importance per artifact tensor {artifact name: [K]}; every entry must name a planned checkpoint
    tensor and have K = the tensor's input size in the artifact layout (SourceError naming both otherwise).

    All parts of a fused tensor read the same input, so the first part that has an entry supplies it.
    """
    owner = {part: t for t in planned for part in t.plan.parts}
    for name in importance:
        if name not in owner:
            raise SourceError(f"{path}: importance entry {name} is not a tensor of the checkpoint")
    out: dict[str, torch.Tensor] = {}
    for name, imp in importance.items():
        t = owner[name]
        K = t.plan.shape[-1]
        if imp.numel() != K:
            raise SourceError(f"{path}: importance for {name} has {imp.numel()} channels, the tensor has {K} "
                              "inputs")
        out.setdefault(t.name, imp)
    return out


def text_resource_problems(resources: dict[str, bytes], vocab_size: int) -> list[str]:
    """What the runtime would refuse among the text resources: no tokenizer.json, or a tokenizer.json,
    tokenizer_config.json or generation_config.json it cannot read, a tokenizer with ids past the model's
    vocab_size rows, a chat template that does not compile."""
    problems = [] if "tokenizer.json" in resources else ["tokenizer.json: missing (ninfer-rt needs it to run the model)"]
    if "tokenizer.json" in resources:
        try:
            tokenizer = Tokenizer.from_resources(resources)
        except NinferError as e:
            problems.append(str(e))
        else:
            if tokenizer.id_bound > vocab_size:
                problems.append(f"tokenizer.json: its ids reach {tokenizer.id_bound - 1}, past the model's "
                                f"vocab_size {vocab_size} (the embedding has no row for them)")
            try:  # every run starts from its sampling defaults
                SamplingParams.defaults_from_generation_config(tokenizer.generation_config)
            except NinferError as e:  # its message names generation_config.json
                problems.append(str(e))
    if any(n in resources for n in ("chat_template.jinja", "tokenizer_config.json", "chat_template.json")):
        try:
            ChatTemplate.from_resources(resources)
        except NinferError as e:
            if "chat template: missing" not in str(e):  # a checkpoint without a template is a base model
                problems.append(str(e))
    return problems


def require_tokenizer(ckpt: Checkpoint, source: str) -> None:
    """ninfer-rt reads the tokenizer (and the template) from the artifact, so a checkpoint without one, or with
    one the runtime cannot read, cannot become a model."""
    if "tokenizer.json" not in ckpt.resources:
        raise SourceError(f"{source} has no tokenizer.json: ninfer-rt needs it to run the model")
    problems = text_resource_problems(dict(ckpt.resources), ckpt.spec.vocab_size)
    if problems:
        raise SourceError(f"{source}: {problems[0]}")


@dataclass
class QuantizeJob:
    """A quantization checked and planned, with nothing read but headers: what write_artifact executes."""

    source: str
    out: Path
    ckpt: Checkpoint
    recipe: Recipe
    planned: list[PlannedTensor]      # in the checkpoint's read order
    warnings: list[str]
    importance: dict[str, torch.Tensor]  # artifact tensor name -> [K]
    importance_path: str | None
    calibration: dict | None = None      # how the importance was measured (importance_calibration)


@dataclass
class QuantizeResult:
    """What write_artifact wrote: the plan, recipe warnings, source bytes read and the file size."""

    path: Path
    planned: list[PlannedTensor]
    warnings: list[str]
    source_bytes: int
    file_size: int


def prepare(source: str, recipe: str | Recipe, out: str | Path, *, revision: str | None = None,
            importance: str | Path | None = None, ckpt: Checkpoint | None = None,
            overwrite: bool = True) -> QuantizeJob:
    """Every check that reads no weight, cheapest first: the output path, the recipe and importance files,
    then (opening, for a Hub repo downloading, the checkpoint) the tokenizer, the plan, importance vs plan.

    overwrite=False refuses an existing `out` (the CLI's default); the write itself is atomic either way.
    """
    check_output_path(out, overwrite)  # as given: a trailing / is lost in a Path
    out = Path(out)
    _check_not_an_input(out, [("the recipe", recipe if not isinstance(recipe, Recipe) else None),
                              ("the importance file", importance)])
    rec = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    imp = load_importance(importance)
    ckpt = ckpt or Checkpoint.open(source, revision=revision)
    _check_not_an_input(out, [("a file of the source checkpoint", f) for f in ckpt.path.iterdir()])
    require_tokenizer(ckpt, source)
    shapes = ckpt.shapes()
    planned, warnings = plan_artifact(ckpt.spec, shapes, rec)
    order = {n: i for i, n in enumerate(ckpt.names)}
    planned.sort(key=lambda t: min(order[p] for p in t.plan.parts))  # stream the shards in order
    return QuantizeJob(source, out, ckpt, rec, planned, warnings, match_importance(imp, planned, importance),
                       str(importance) if importance else None, importance_calibration(importance))


def _check_not_an_input(out: Path, inputs: list[tuple[str, object]]) -> None:
    """An existing --out that is one of the run's own inputs (a shard, the recipe) would be replaced by the artifact
    it feeds: refused in one line, whatever --overwrite says."""
    if not out.is_file():
        return
    for what, p in inputs:
        if isinstance(p, (str, os.PathLike)) and Path(p).is_file() and os.path.samefile(out, p):
            raise SourceError(f"--out {out} is {what}: the artifact would replace its own input; choose another path")


def write_artifact(job: QuantizeJob, progress: Callable[[int, str], None] | None = None) -> QuantizeResult:
    """Read, transform, encode and write every planned tensor; the file appears only when all are written.

    progress(n, name) is called after each tensor with the number of source bytes consumed.
    """
    ckpt, planned = job.ckpt, job.planned
    entries = [TensorEntry.from_plan(t.plan, t.format, t.group, t.nbytes) for t in planned]
    meta = {
        "model": {"config": ckpt.config, "spec": ckpt.spec.to_dict(), "missing_groups": sorted(ckpt.missing_groups)},
        "recipe": {**job.recipe.to_dict(), "resolved": {t.name: t.format for t in planned},
                   "importance": job.importance_path, "calibration": job.calibration},
        "provenance": {**ckpt.provenance, "ninfer_version": __version__},
    }
    with ArtifactWriter(job.out, meta, entries, dict(ckpt.resources)) as writer:
        for t in planned:
            arrays = read_parts(ckpt, t.plan.parts)
            arr = apply_forward(t.plan, arrays)
            del arrays
            writer.write_tensor(t.name, encode_tensor(arr, t.format, job.importance.get(t.name), name=t.name))
            if progress:
                progress(sum(ckpt.source_nbytes(p) for p in t.plan.parts), t.name)
    return QuantizeResult(job.out, planned, job.warnings, ckpt.total_source_bytes, writer.file_size)


def quantize(source: str, recipe: str | Recipe, out: str | Path, *, revision: str | None = None,
             importance: str | Path | None = None, progress: Callable[[int, str], None] | None = None,
             ckpt: Checkpoint | None = None) -> QuantizeResult:
    """Quantize `source` with `recipe` into the artifact `out` (written atomically): prepare, then write."""
    return write_artifact(prepare(source, recipe, out, revision=revision, importance=importance, ckpt=ckpt),
                          progress)


def params_total(planned: list[PlannedTensor]) -> int:
    """Checkpoint parameters the plan covers."""
    return sum(t.params for t in planned)


def bits_per_param(planned: list[PlannedTensor]) -> float:
    """Weight bytes per checkpoint parameter, in bits."""
    return 8 * sum(t.nbytes for t in planned) / max(1, params_total(planned))


__all__ = ["quantize", "prepare", "write_artifact", "QuantizeJob", "QuantizeResult", "encode_tensor", "read_parts",
           "as_f32", "to_numpy", "load_importance", "match_importance", "require_tokenizer", "params_total",
           "bits_per_param"]
