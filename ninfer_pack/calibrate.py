"""calibrate: per-input-channel importance for `ninfer-pack quantize --importance`, measured on text.

For every weight W [N, K] that multiplies activations (an expert bank [E, N, K] counts as one weight) the
importance of input channel k is the mean of x_k² over the activation rows x that meet W: llama.cpp's imatrix
statistic. The quantizer's clipping search then weighs each column's error by it (ninfer_pack.quant). A bank's rows
are every (token, routed expert) pair; the router and bf16 weights are measured too and simply unused by the
search.

The activations come from the fp32 PyTorch reference run one decoder layer at a time (reference.stream: only that
layer's weights in memory, ~3.4 GB in fp32 for a Qwen3.6-35B-A3B layer), so a checkpoint of any size calibrates
on a machine that could never hold it whole. Each window starts from an empty cache at position 0. The rows a
weight meets are seen by intercepting the reference's matrix products (`x @ W.T`) whose right operand lives in
that weight's storage, so the model code itself carries no hooks. The MTP head is measured on the pairs
(h_p, x_{p+1}) of each window, as decoding feeds it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from ninfer_rt.errors import NinferError
from ninfer_rt.format import atomic_output, check_output_path
from ninfer_rt.reference import ops
from ninfer_rt.reference.model import LM, MTP, Cache, MTPHead, _Reader
from ninfer_rt.reference.stream import run_layers
from ninfer_rt.reference.weights import LazyCheckpointWeights
from ninfer_pack.source import Checkpoint

# `x @ W` reaches a function mode as TensorBase.matmul; torch.matmul and Tensor.__matmul__ where called so
_MATMULS = (torch.Tensor.matmul, torch.Tensor.__matmul__, torch.matmul)


class _Recorder(TorchFunctionMode):
    """Adds Σ x² over the rows of x, per input channel, for every `x @ W.T` whose W (or a slice of a bank) is one
    of `weights` {name: tensor}."""

    def __init__(self, weights: Mapping[str, torch.Tensor], sums: dict[str, torch.Tensor], rows: dict[str, int]):
        super().__init__()
        self.names = {t.untyped_storage().data_ptr(): n for n, t in weights.items()}
        self.sums, self.rows = sums, rows
        self._last = None  # a SwiGLU's gate and up rows are one x: its second product is not counted again

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _MATMULS and len(args) == 2 and isinstance(args[1], torch.Tensor):
            name = self.names.get(args[1].untyped_storage().data_ptr())
            seen = (name, args[0].data_ptr(), tuple(args[0].shape))
            if name is not None and seen != self._last:
                self._last = seen
                x = args[0].reshape(-1, args[0].shape[-1]).double()             # x: [rows, K]
                s = (x * x).sum(0)
                self.sums[name] = self.sums[name] + s if name in self.sums else s
                self.rows[name] = self.rows.get(name, 0) + x.shape[0]
        return func(*args, **(kwargs or {}))


@dataclass
class Calibration:
    """importance {checkpoint name: mean x_k² [K] float32}, rows {name: activation rows measured}, windows and
    tokens the text gave."""

    importance: dict[str, torch.Tensor]
    rows: dict[str, int]
    windows: int
    tokens: int


def calibrate(ckpt: Checkpoint, windows: Sequence[Sequence[int]], *, mtp: bool = True,
              progress: Callable[[int, int], None] | None = None) -> Calibration:
    """Measure every weight's input-channel mean squares over `windows` of token ids (see the module doc).

    mtp: also the MTP head's weights, where the checkpoint has them. progress(done, total) after each stage
    (the embedding, each decoder layer, the final norm, the head)."""
    spec = ckpt.spec
    if not windows:
        raise NinferError("calibration needs at least one window of 2 or more tokens")
    V = spec.vocab_size
    for w in windows:
        bad = [i for i in w if not 0 <= int(i) < V]
        if bad:
            raise NinferError(f"token id {bad[0]} is outside the vocabulary [0, {V})")
    weights = LazyCheckpointWeights(ckpt, ("text", "mtp"))
    sums: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}
    has_mtp = mtp and spec.mtp_num_hidden_layers >= 1 and MTP + "fc.weight" in weights
    L = spec.num_hidden_layers
    total = L + 2 + has_mtp
    run = run_layers(spec, weights, windows, observe=lambda: _Recorder(weights.live, sums, rows),
                     progress=None if progress is None else lambda d, _n: progress(d, total))
    head = "lm_head.weight"
    if head in weights:  # the lm_head's input is the post-norm stream (a tied head is the embedding: not measured)
        for h in run.hidden:
            sums[head] = sums.get(head, 0) + (h.double() ** 2).sum(0)
            rows[head] = rows.get(head, 0) + h.shape[0]
    if has_mtp:
        read = _Reader(weights, torch.float32)
        embed = read(LM + "embed_tokens.weight", (V, spec.hidden_size))
        nexts = [embed[torch.tensor(list(w[1:]), dtype=torch.long)] for w in windows]  # embed(x_{p+1}): [T-1, H]
        del embed
        weights.release()
        mtp_head = MTPHead(spec, read)
        with torch.no_grad(), _Recorder(weights.live, sums, rows):
            for h, e in zip(run.hidden, nexts):
                T = e.shape[0]
                cos, sin = ops.rope_cos_sin(torch.arange(T), spec.rotary_dim, spec.rope_theta, spec.mrope_section,
                                            torch.float32, spec.yarn)
                mtp_head(e, h[:T], cos, sin, Cache(spec, torch.float32, ("full_attention",)).layers[0])
        del mtp_head
        weights.release()
        if progress:
            progress(total, total)
    importance = {n: (s / rows[n]).float() for n, s in sums.items()}
    return Calibration(importance, rows, len(windows), sum(len(w) for w in windows))


def save(cal: Calibration, path: str | Path, source: str) -> None:
    """Write the importance as safetensors {checkpoint name: [K] float32} (what `quantize --importance` reads),
    with how it was measured in the metadata; atomically: a temporary file renamed over `path`."""
    from safetensors.torch import save_file

    check_output_path(path, example="importance.safetensors")
    for name, t in sorted(cal.importance.items()):  # quantize refuses such a file: write none
        bad = (~torch.isfinite(t)).nonzero()
        if len(bad):
            raise NinferError(f"the importance of {name} is {t[bad[0, 0]].item()} at channel {bad[0, 0].item()}: the "
                              "checkpoint's weights or activations are not finite there; nothing written")
    meta = {"ninfer.calibration": json.dumps({"source": source, "windows": cal.windows, "tokens": cal.tokens,
                                              "statistic": "mean of x_k^2 over the rows that meet the weight"})}
    with atomic_output(path) as tmp:
        save_file({n: t.contiguous() for n, t in sorted(cal.importance.items())}, str(tmp), metadata=meta)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # safetensors creates 0600; an output file gets the user's umask, as artifacts do
