"""verify: is an artifact sound, and does every tensor decode to its source within its format's error?

Structure (magic, header checksum and schema, bounds, alignment) is checked by Artifact.open; this module
adds the payload checksums and, given the source checkpoint, a tensor-by-tensor comparison in the
artifact's own layout: raw formats must match the re-encoded source bit for bit, quantized formats must
pass quant.check_decoded (every element within half a step of its group's scale, or clipped correctly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ninfer_rt.format import Artifact
from ninfer_rt.formats import get_format
from ninfer_rt.layout import TensorPlan, apply_forward
from ninfer_pack.pipeline import as_f32, encode_tensor, read_parts
from ninfer_pack.quant import check_decoded
from ninfer_pack.source import Checkpoint


@dataclass
class TensorCheck:
    name: str
    format: str
    rel_rmse: float
    ok: bool
    detail: str = ""


@dataclass
class VerifyReport:
    path: str
    tensors: int
    bytes: int
    bad_checksums: list[str] = field(default_factory=list)
    checks: list[TensorCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad_checksums and not self.problems and all(c.ok for c in self.checks)


def _plan_of(entry) -> TensorPlan:
    return TensorPlan(name=entry.name, parts=tuple(p["name"] for p in entry.parts),
                      part_shapes=tuple(tuple(p["shape"]) for p in entry.parts), transform=entry.transform,
                      params=dict(entry.params), shape=tuple(entry.shape))


def compare_tensor(art: Artifact, name: str, source_layout: np.ndarray) -> TensorCheck:
    """Compare one artifact tensor against its source, both in the artifact layout."""
    e = art.tensors[name]
    fmt = get_format(e.format)
    raw = art.raw(name)
    ref = as_f32(source_layout)
    got = fmt.decode(raw, tuple(e.shape))
    denom = float(np.sqrt(np.mean(ref.astype(np.float64) ** 2))) or 1.0
    rel = float(np.sqrt(np.mean((got.astype(np.float64) - ref) ** 2))) / denom
    if not fmt.is_quantized:
        same = bytes(raw) == encode_tensor(source_layout, e.format).tobytes()
        return TensorCheck(name, e.format, rel, same, "" if same else "bytes differ from the re-encoded source")
    _q, scales = fmt.unpack(raw, tuple(e.shape))
    K = e.shape[-1]
    ok, detail = check_decoded(ref.reshape(-1, K), got.reshape(-1, K), scales.reshape(-1, scales.shape[-1]),
                               fmt.bits, fmt.group)
    return TensorCheck(name, e.format, rel, ok, detail)


def verify(path: str, source: str | None = None, *, revision: str | None = None,
           on_bytes: Callable[[int], None] | None = None,
           on_tensor: Callable[[str], None] | None = None) -> VerifyReport:
    """Check an artifact; with `source`, also decode and compare every tensor. Never raises for a bad
    payload (it is reported); raises FormatError only when the file cannot be opened as an artifact."""
    with Artifact.open(path) as art:
        report = VerifyReport(str(path), len(art.tensors), art.size)
        report.bad_checksums = art.verify_checksums(on_bytes)
        if source is None:
            return report
        ckpt = Checkpoint.open(source, revision=revision)
        covered = {p["name"] for e in art.tensors.values() for p in e.parts}
        for missing in sorted(set(ckpt.names) - covered):
            report.problems.append(f"source tensor {missing} is not in the artifact")
        for extra in sorted(covered - set(ckpt.names)):
            report.problems.append(f"artifact tensor part {extra} is not in the source")
        for name, e in art.tensors.items():
            plan = _plan_of(e)
            if not set(plan.parts) <= set(ckpt.names):
                continue
            arr = apply_forward(plan, read_parts(ckpt, plan.parts))
            if tuple(arr.shape) != tuple(e.shape):
                report.problems.append(f"{name}: source gives shape {list(arr.shape)}, artifact has {e.shape}")
                continue
            report.checks.append(compare_tensor(art, name, arr))
            if on_tensor:
                on_tensor(name)
        return report

