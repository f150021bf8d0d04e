"""quantize: checkpoint -> plan -> (layout transform, choose codes, pack) per tensor -> one artifact file.

Memory stays bounded by one artifact tensor: its checkpoint parts are read, transformed while still in
their 16-bit source form, then encoded in row chunks converted to float32 on the fly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ninfer_rt import __version__
from ninfer_rt.errors import SourceError
from ninfer_rt.format import ArtifactWriter, TensorEntry
from ninfer_rt.formats import bf16_bits_to_f32, get_format
from ninfer_rt.layout import apply_forward
from ninfer_pack.plan import PlannedTensor, plan_artifact
from ninfer_pack.quant import quantize_rows
from ninfer_pack.recipe import Recipe, load_recipe
from ninfer_pack.source import Checkpoint

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


def encode_tensor(arr: np.ndarray, fmt_name: str, importance: torch.Tensor | None = None) -> np.ndarray:
    """Encode one artifact-layout array into its format's bytes (np.uint8 of exactly nbytes)."""
    fmt = get_format(fmt_name)
    if not fmt.is_quantized:
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
        q, scales = quantize_rows(w, fmt.bits, fmt.group, importance=importance)
        fmt.pack_rows(buf, R, r0, q.numpy(), scales.numpy())
    return buf


def load_importance(path: str | Path | None) -> dict[str, torch.Tensor]:
    """Per-input-channel importance (e.g. mean squared activations): a safetensors file of name -> [K]."""
    if path is None:
        return {}
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise SourceError(f"no such importance file: {p}")
    try:
        tensors = load_file(str(p))
    except (SafetensorError, OSError, ValueError) as e:
        raise SourceError(f"{p} is not a readable safetensors file: {e}") from None
    for name, t in tensors.items():
        if t.dim() != 1:
            raise SourceError(f"{p}: importance for {name} must be 1-D [K], got {list(t.shape)}")
    return {n: t.float() for n, t in tensors.items()}


def _importance_for(planned: PlannedTensor, importance: dict[str, torch.Tensor]) -> torch.Tensor | None:
    # All parts of a fused tensor read the same input, so any part's importance applies to all of them.
    for part in planned.plan.parts:
        if part in importance:
            imp = importance[part]
            if imp.numel() != planned.plan.shape[-1]:
                raise SourceError(f"importance for {part} has {imp.numel()} channels, the tensor has "
                                  f"{planned.plan.shape[-1]} inputs")
            return imp
    return None


@dataclass
class QuantizeResult:
    path: Path
    planned: list[PlannedTensor]
    warnings: list[str]
    source_bytes: int
    file_size: int


def quantize(source: str, recipe: str | Recipe, out: str | Path, *, revision: str | None = None,
             importance: str | Path | None = None, progress: Callable[[int, str], None] | None = None,
             ckpt: Checkpoint | None = None) -> QuantizeResult:
    """Quantize `source` with `recipe` into the artifact `out` (written atomically).

    progress(n, name) is called after each tensor with the number of source bytes consumed.
    """
    ckpt = ckpt or Checkpoint.open(source, revision=revision)
    rec = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    imp = load_importance(importance)
    shapes = {n: tuple(ckpt.shape(n)) for n in ckpt.names}
    planned, warnings = plan_artifact(ckpt.spec, shapes, rec)
    order = {n: i for i, n in enumerate(ckpt.names)}
    planned.sort(key=lambda t: min(order[p] for p in t.plan.parts))  # stream the shards in order

    entries = [TensorEntry(name=t.name, shape=list(t.plan.shape), format=t.format,
                           parts=[{"name": n, "shape": list(s)} for n, s in zip(t.plan.parts, t.plan.part_shapes)],
                           transform=t.plan.transform, params=dict(t.plan.params), group=t.group, nbytes=t.nbytes)
               for t in planned]
    meta = {
        "model": {"config": ckpt.config, "spec": ckpt.spec.to_dict(), "missing_groups": sorted(ckpt.missing_groups)},
        "recipe": {**rec.to_dict(), "resolved": {t.name: t.format for t in planned},
                   "importance": str(importance) if importance else None},
        "provenance": {**ckpt.provenance, "ninfer_version": __version__},
    }
    out = Path(out)
    with ArtifactWriter(out, meta, entries, dict(ckpt.resources)) as writer:
        for t in planned:
            arrays = read_parts(ckpt, t.plan.parts)
            arr = apply_forward(t.plan, arrays)
            del arrays
            writer.write_tensor(t.name, encode_tensor(arr, t.format, _importance_for(t, imp)))
            if progress:
                progress(sum(ckpt.source_nbytes(p) for p in t.plan.parts), t.name)
    return QuantizeResult(out, planned, warnings, ckpt.total_source_bytes, writer.file_size)


def params_total(planned: list[PlannedTensor]) -> int:
    return sum(t.params for t in planned)


def bits_per_param(planned: list[PlannedTensor]) -> float:
    return 8 * sum(t.nbytes for t in planned) / max(1, params_total(planned))


__all__ = ["quantize", "encode_tensor", "read_parts", "as_f32", "to_numpy", "load_importance",
           "QuantizeResult", "params_total", "bits_per_param"]
