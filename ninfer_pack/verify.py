"""verify: is an artifact sound, and does every tensor decode to its source within its format's error?

Structure (magic, header checksum and schema, bounds, alignment) is checked by Artifact.open; this module
adds the payload checksums, the tensor table against the model the header describes (layout.check_plans, as
the runtime's load does), the tokenizer and chat template the runtime will build, and, given the source
checkpoint, a tensor-by-tensor comparison in the
artifact's own layout: raw formats must match the re-encoded source bit for bit, quantized formats must
pass quant.check_decoded (every element within half a step of its group's scale, or clipped correctly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ninfer_rt.errors import NinferError
from ninfer_rt.format import Artifact
from ninfer_rt.formats import get_format
from ninfer_rt.layout import apply_forward
from ninfer_pack import pipeline
from ninfer_pack.pipeline import as_f32, encode_tensor, read_parts, text_resource_problems
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


def _rel_rmse(ref_rows: np.ndarray, got_rows: np.ndarray) -> float:
    """||got - ref|| / ||ref|| over [R, K] rows (ref as stored: bf16 bits or float), summed in float64 row
    chunks so no full-size float64 copy is made; an all-zero ref gives the absolute RMS error instead."""
    R, K = ref_rows.shape
    step = max(1, pipeline.ROW_CHUNK_ELEMS // K)
    ref2 = err2 = 0.0
    for r0 in range(0, R, step):
        ref = as_f32(ref_rows[r0:r0 + step]).astype(np.float64)
        diff = got_rows[r0:r0 + step].astype(np.float64) - ref
        ref2 += float(np.einsum("ij,ij->", ref, ref))
        err2 += float(np.einsum("ij,ij->", diff, diff))
    return math.sqrt(err2 / ref2) if ref2 else math.sqrt(err2 / max(1, R * K))


def _as_torch(a: np.ndarray) -> torch.Tensor:
    """A zero-copy torch view; bf16 bit patterns become torch.bfloat16 so a row slice widens exactly."""
    a = np.ascontiguousarray(a)
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == np.uint16 else torch.from_numpy(a)


def compare_tensor(art: Artifact, name: str, source_layout: np.ndarray) -> TensorCheck:
    """Compare one artifact tensor against its source, both in the artifact layout.

    Peak memory is the source plus one float32 decode of the tensor: every float64 quantity is taken in row
    chunks of pipeline.ROW_CHUNK_ELEMS.
    """
    e = art.tensors[name]
    fmt = get_format(e.format)
    raw = art.raw(name)
    K = e.shape[-1]
    src = source_layout.reshape(-1, K)
    got = fmt.decode(raw, tuple(e.shape)).reshape(-1, K)
    rel = _rel_rmse(src, got)
    if not fmt.is_quantized:
        try:
            same = np.array_equal(np.frombuffer(raw, dtype=np.uint8), encode_tensor(source_layout, e.format, name=name))
        except NinferError as err:  # the source holds a weight the format cannot store (inf, or past f16's range)
            return TensorCheck(name, e.format, rel, False, str(err))
        return TensorCheck(name, e.format, rel, same, "" if same else "bytes differ from the re-encoded source")
    scales = fmt.unpack(raw, tuple(e.shape))[1]  # the codes are dropped at once: only the scales are needed
    ok, detail = check_decoded(_as_torch(src), got, scales.reshape(-1, scales.shape[-1]), fmt.bits, fmt.group)
    return TensorCheck(name, e.format, rel, ok, detail)


def verify(path: str, source: str | Checkpoint | None = None, *, revision: str | None = None,
           on_bytes: Callable[[int], None] | None = None,
           on_tensor: Callable[[str], None] | None = None) -> VerifyReport:
    """Check an artifact; with `source` (a checkpoint to open, or one already open), also decode and compare every
    tensor. Never raises for a bad payload (it is reported); raises FormatError only when the file cannot be opened
    as an artifact."""
    with Artifact.open(path) as art:
        report = VerifyReport(str(path), len(art.tensors), art.size)
        report.bad_checksums = art.verify_checksums(on_bytes)
        plan_problems = art.plan_problems()
        resources = {n: art.resource(n) for n in art.resources}
        report.problems += plan_problems + text_resource_problems(resources, art.spec.vocab_size)
        report.problems += art.nonzero_gaps()  # after the table's problems: a dropped entry leaves bytes unlisted
        if source is None or plan_problems:  # a table that disagrees with its model cannot be laid out again
            return report
        ckpt = source if isinstance(source, Checkpoint) else Checkpoint.open(source, revision=revision)
        covered = {p["name"] for e in art.tensors.values() for p in e.parts}
        for missing in sorted(set(ckpt.names) - covered):
            report.problems.append(f"source tensor {missing} is not in the artifact")
        for extra in sorted(covered - set(ckpt.names)):
            report.problems.append(f"artifact tensor part {extra} is not in the source")
        for name, e in art.tensors.items():
            plan = e.plan()
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

