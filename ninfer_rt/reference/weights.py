"""Checkpoint-named torch weights for the reference model, from an artifact or a checkpoint reader.

An artifact stores kernel layouts; decoding each tensor and inverting its layout transform
(Artifact.checkpoint_tensors) gives back the Hugging Face tensors the reference model reads by name.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ninfer_rt.format import Artifact


def artifact_weights(art: Artifact, groups: Iterable[str] = ("text", "mtp"),
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Decode every artifact tensor of `groups` to {checkpoint name: tensor in dtype}."""
    wanted = set(groups)
    out: dict[str, torch.Tensor] = {}
    for name, entry in art.tensors.items():
        if entry.group not in wanted:
            continue
        for part, arr in art.checkpoint_tensors(name).items():
            # own the memory: raw fp32 decodes are read-only views of the file mapping
            own = arr if arr.flags.owndata and arr.flags.writeable else arr.copy()
            out[part] = torch.from_numpy(own).to(dtype)
    return out


def checkpoint_weights(ckpt, groups: Iterable[str] = ("text", "mtp"),
                       dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The same dict straight from a source checkpoint (ninfer_pack.source.Checkpoint or alike)."""
    info = ckpt.spec.tensor_shapes()
    wanted = set(groups)
    return {n: ckpt.read(n).to(dtype) for n in ckpt.names if info[n].group in wanted}
