"""Checkpoint-named torch weights for the reference model, from an artifact or a checkpoint reader.

An artifact stores kernel layouts; decoding each tensor and inverting its layout transform
(Artifact.checkpoint_tensors) gives back the Hugging Face tensors the reference model reads by name.
`artifact_weights` / `checkpoint_weights` decode everything at once; `LazyArtifactWeights` /
`LazyCheckpointWeights` decode a tensor when it is first asked for and forget it on `release`, for a model run
one layer at a time (`reference.stream`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

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
            out[part] = _own(arr).to(dtype)
    return out


def checkpoint_weights(ckpt, groups: Iterable[str] = ("text", "mtp"),
                       dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The same dict straight from a source checkpoint (ninfer_pack.source.Checkpoint or alike)."""
    info = ckpt.spec.tensor_shapes()
    wanted = set(groups)
    return {n: ckpt.read(n).to(dtype) for n in ckpt.names if info[n].group in wanted}


def _own(arr) -> torch.Tensor:
    """fp32 torch tensor with storage of its own: raw fp32 decodes are read-only views of the file mapping, and a
    fused tensor's parts are views of one array."""
    return torch.from_numpy(arr if arr.flags.owndata and arr.flags.writeable else arr.copy()).float()


class LazyWeights(Mapping):
    """{checkpoint name: fp32 tensor} decoded on first access, each into storage of its own, kept in `live` until
    `release`; `reads` counts the decodes."""

    def __init__(self, names: Iterable[str]):
        self.names, self.live, self.reads = frozenset(names), {}, 0

    def _load(self, name: str) -> dict[str, torch.Tensor]:
        """Decode the tensor(s) that hold `name`: {checkpoint name: tensor}."""
        raise NotImplementedError

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.live:
            if name not in self.names:
                raise KeyError(name)
            self.live.update(self._load(name))
            self.reads += 1
        return self.live[name]

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def release(self) -> None:
        """Forget every tensor decoded so far (the layer that used them is done)."""
        self.live.clear()


class LazyCheckpointWeights(LazyWeights):
    """A source checkpoint's tensors of `groups` (ninfer_pack.source.Checkpoint or alike), read when asked for."""

    def __init__(self, ckpt, groups: Iterable[str] = ("text", "mtp")):
        info, wanted = ckpt.spec.tensor_shapes(), set(groups)
        super().__init__(n for n in ckpt.names if info[n].group in wanted)
        self.ckpt = ckpt

    def _load(self, name: str) -> dict[str, torch.Tensor]:
        t = self.ckpt.read(name)  # a fresh tensor: read() allocates
        return {name: t.float() if t.dtype != torch.float32 else t}


class LazyArtifactWeights(LazyWeights):
    """An artifact's tensors of `groups` back in checkpoint names; a fused artifact tensor decodes all its parts
    at once."""

    def __init__(self, art: Artifact, groups: Iterable[str] = ("text", "mtp")):
        wanted = set(groups)
        self.owner = {part: name for name, e in art.tensors.items() if e.group in wanted for part in e.plan().parts}
        super().__init__(self.owner)
        self.art = art

    def _load(self, name: str) -> dict[str, torch.Tensor]:
        return {part: _own(arr) for part, arr in self.art.checkpoint_tensors(self.owner[name]).items()}
