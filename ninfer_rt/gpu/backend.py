"""The GPU backend of ninfer_rt.api.Model: the artifact in device memory, one sequence slot, CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer_rt.gpu.driver import Gpu
from ninfer_rt.gpu.engine import GpuModel
from ninfer_rt.gpu.kernels import Kernels
from ninfer_rt.gpu.loader import load_artifact
from ninfer_rt.gpu.misc import SAMPLE_MAX_CANDIDATES, sample_params
from ninfer_rt.sampling import SamplingParams


@dataclass
class GpuCache:
    """Where the one sequence stands: positions already in its slot."""

    pos: int = 0


class GpuBackend:
    """Same interface as the reference backend: new_cache() and forward(ids, cache, last_only); and, where
    can_sample(params), sample_next: the next token drawn on the device."""

    def __init__(self, artifact, *, max_ctx: int = 32768, kv_dtype: str = "int8", progress=None,
                 use_graphs: bool = True, prefill_chunk: int | None = None):
        self.gpu = Gpu(0)
        self.kernels = Kernels(self.gpu)
        spec = artifact.spec
        self.weights = load_artifact(self.gpu, artifact, progress=progress)
        self.max_ctx = min(max_ctx, spec.max_position_embeddings)  # positions a sequence may hold (Model reads it)
        self.model = GpuModel(self.gpu, self.kernels, spec, self.weights, slots=1, max_ctx=self.max_ctx,
                              kv_dtype=kv_dtype, prefill_chunk=prefill_chunk)
        self.use_graphs = use_graphs

    def new_cache(self) -> GpuCache:
        self.model.reset_slot(0)
        return GpuCache()

    def forward(self, ids: np.ndarray, cache: GpuCache, last_only: bool = False) -> np.ndarray:
        """ids [T] -> logits float32 [T, V] (or [1, V] of the last token when last_only); advances cache."""
        ids = np.asarray(ids, np.int32)
        if last_only or (ids.size == 1 and cache.pos > 0):
            self._run_last(ids, cache)
            return self.model.logits(1)
        out = self.model.prefill(ids, 0, start=cache.pos, all_logits=True)
        cache.pos += ids.size
        return out

    def _run_last(self, ids: np.ndarray, cache: GpuCache, draw: tuple | None = None) -> bool:
        """Enqueue ids through the cache, leaving the last token's logits in logits row 0. With draw = (vocab,
        record), a decode step also draws the next token inside its graph; returns whether it did."""
        decode = ids.size == 1 and cache.pos > 0
        if decode:
            self.model.decode(ids, [cache.pos], [0], graph=self.use_graphs, draw=draw)
        else:
            self.model.prefill(ids, 0, start=cache.pos)
        cache.pos += ids.size
        return decode and draw is not None

    @staticmethod
    def can_sample(params: SamplingParams) -> bool:
        """Whether sample_next draws exactly as Sampler would (same distribution, its own RNG): no penalties
        (they need the history on the host), and greedy or a top_k within the device's candidate cap."""
        neutral = (params.presence_penalty == 0 and params.frequency_penalty == 0
                   and params.repetition_penalty == 1)
        return neutral and (params.is_greedy or 1 <= params.top_k <= SAMPLE_MAX_CANDIDATES)

    def sample_next(self, ids: np.ndarray, cache: GpuCache, params: SamplingParams, *, vocab: int, seed: int,
                    step: int) -> int:
        """forward(ids, cache, last_only=True), then the next token drawn on the GPU over ids < vocab: the
        arg-max, or misc.sample under params with Philox stream (seed, step). Only the id crosses to the host
        (not 1 MB of logits, and no host softmax over the vocabulary). Needs can_sample(params)."""
        ids = np.asarray(ids, np.int32)
        record = None if params.is_greedy else sample_params(params.temperature, params.top_k, params.top_p,
                                                              params.min_p, seed=seed, step=step)
        if self._run_last(ids, cache, (vocab, record)):  # a decode step: the draw was part of its graph
            return self.model.drawn()
        return self.model.draw(vocab, record)

    def close(self) -> None:
        self.model.free()
        self.weights.free(self.gpu)
