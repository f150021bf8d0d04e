"""The GPU backend of ninfer_rt.api.Model: the artifact in device memory, one sequence slot, CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer_rt.gpu.driver import Gpu
from ninfer_rt.gpu.engine import GpuModel
from ninfer_rt.gpu.kernels import Kernels
from ninfer_rt.gpu.loader import load_artifact


@dataclass
class GpuCache:
    """Where the one sequence stands: positions already in its slot."""

    pos: int = 0


class GpuBackend:
    """Same interface as the reference backend: new_cache() and forward(ids, cache, last_only)."""

    def __init__(self, artifact, *, max_ctx: int = 32768, kv_dtype: str = "int8", progress=None,
                 use_graphs: bool = True, prefill_chunk: int | None = None):
        self.gpu = Gpu(0)
        self.kernels = Kernels(self.gpu)
        spec = artifact.spec
        self.weights = load_artifact(self.gpu, artifact, progress=progress)
        max_ctx = min(max_ctx, spec.max_position_embeddings)
        self.model = GpuModel(self.gpu, self.kernels, spec, self.weights, slots=1, max_ctx=max_ctx,
                              kv_dtype=kv_dtype, prefill_chunk=prefill_chunk)
        self.use_graphs = use_graphs

    def new_cache(self) -> GpuCache:
        self.model.reset_slot(0)
        return GpuCache()

    def forward(self, ids: np.ndarray, cache: GpuCache, last_only: bool = False) -> np.ndarray:
        """ids [T] -> logits float32 [T, V] (or [1, V] of the last token when last_only); advances cache."""
        ids = np.asarray(ids, np.int32)
        T = ids.size
        if T == 1 and cache.pos > 0:
            self.model.decode(ids, [cache.pos], [0], graph=self.use_graphs)
            out = self.model.logits(1)
        elif last_only:
            self.model.prefill(ids, 0, start=cache.pos)
            out = self.model.logits(1)
        else:
            out = self.model.prefill(ids, 0, start=cache.pos, all_logits=True)
        cache.pos += T
        return out

    def close(self) -> None:
        self.model.free()
        self.weights.free(self.gpu)
