"""The reference model run one decoder layer at a time over a few token windows.

For tools that need a checkpoint's activations but not its decoding (ninfer-pack calibrate, verify --numerics):
every window's residual stream is carried from layer to layer, and only the layer being run has its weights in
memory (`LazyWeights` from reference.weights, released after each stage), so a model of any size runs in about
one layer's fp32 weights: ~3.4 GB for a Qwen3.6-35B-A3B MoE layer, 2 GB for its embedding. Each window starts
from an empty cache at position 0. The ops and their order are ReferenceModel.forward_with_hidden's, so the
results are the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from . import ops
from .model import LM, Cache, DecoderLayer, _Reader


@dataclass
class LayerRun:
    """hidden: per window, the post-norm hidden states [T, H]; stream: per stage (embedding, then each decoder
    layer's output), every window's residual stream concatenated [Σ T, H] (None unless kept)."""

    hidden: list[torch.Tensor]
    stream: list[torch.Tensor] | None


def release(weights: Mapping) -> None:
    """Let the tensors used so far go, where the mapping can (a plain dict keeps them)."""
    if hasattr(weights, "release"):
        weights.release()


def run_layers(spec, weights: Mapping[str, torch.Tensor], windows: Sequence[Sequence[int]], *,
               keep_stream: bool = False, observe: Callable[[], object] | None = None,
               progress: Callable[[int, int], None] | None = None) -> LayerRun:
    """Embed every window, run each decoder layer over all of them, apply the final norm.

    observe(): a context manager entered around each decoder layer's work, once its weights are loaded (calibrate
    watches the layer's matrix products). progress(done, total) after the embedding, each layer and the norm."""
    read = _Reader(weights, torch.float32)
    H, total = spec.hidden_size, spec.num_hidden_layers + 2
    ids = [torch.tensor(list(w), dtype=torch.long) for w in windows]
    embed = read(LM + "embed_tokens.weight", (spec.vocab_size, H))
    xs = [embed[i] for i in ids]                                                 # xs[w]: [T, H]
    del embed
    release(weights)
    stream = [torch.cat(xs)] if keep_stream else None
    if progress:
        progress(1, total)
    ropes = {n: ops.rope_cos_sin(torch.arange(n), spec.rotary_dim, spec.rope_theta, spec.mrope_section,
                                 torch.float32, spec.yarn) for n in {len(i) for i in ids}}
    with torch.no_grad():
        for li, kind in enumerate(spec.layer_types):
            layer = DecoderLayer(spec, read, f"{LM}layers.{li}.", kind)
            with observe() if observe else nullcontext():
                for w, x in enumerate(xs):
                    xs[w] = layer(x, *ropes[x.shape[0]], Cache(spec, torch.float32, (kind,)).layers[0])
            del layer
            release(weights)
            if keep_stream:
                stream.append(torch.cat(xs))
            if progress:
                progress(li + 2, total)
        norm = read(LM + "norm.weight", (H,))
        hidden = [ops.rms_norm_zc(x, norm, spec.rms_norm_eps) for x in xs]
    release(weights)
    if progress:
        progress(total, total)
    return LayerRun(hidden, stream)


def lm_head(spec, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The output projection [V, H] as the reference model takes it: lm_head.weight, else the tied embedding."""
    read = _Reader(weights, torch.float32)
    name = "lm_head.weight" if "lm_head.weight" in weights else LM + "embed_tokens.weight"
    return read(name, (spec.vocab_size, spec.hidden_size))
