"""v90 (prepared): batched decode's shared expert on a side stream of the greatest priority
(moe.SHARED_STREAM_PRIORITY; driver.Gpu.new_stream(high_priority=True), end_capture(node_priority=True)).

Oracle: the same captured steps with the switch off. Priority only changes which waiting blocks the GPU places
first; every kernel, its inputs and its order of sums are the same, so the logits must be the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_engine_layers import one_layer

pytestmark = pytest.mark.gpu


def test_side_stream_priority_keeps_the_logits(gpu, kernels, monkeypatch):
    """2 sequences × 4 decode steps (one DeltaNet layer + its MoE block, synthetic weights of recipe
    qwen3.6-35b-a3b) captured and replayed as graphs: with the switch on the shared expert's GEMVs run on a stream
    of the context's greatest priority (cuStreamGetPriority), and the logits equal the switch-off run's to the bit."""
    from cuda.bindings import driver as cu

    from ninfer_rt.gpu import moe
    from ninfer_rt.gpu.engine import GpuModel
    from ninfer_rt.gpu.loader import synthetic_weights
    from ninfer_rt.recipe import load_recipe

    spec = one_layer("linear_attention")
    weights = synthetic_weights(gpu, spec, load_recipe("qwen3.6-35b-a3b"))
    toks = np.random.default_rng().integers(0, 1000, size=(4, 2)).astype(np.int32)

    def run(high: bool):
        monkeypatch.setattr(moe, "SHARED_STREAM_PRIORITY", high)
        model = GpuModel(gpu, kernels, spec, weights, slots=2, max_ctx=64, kv_dtype="int8")
        try:
            out = []
            for p in range(len(toks)):
                model.decode(toks[p], [p] * 2, [0, 1])
                out.append(model.logits(2))
            err, prio = cu.cuStreamGetPriority(model.side.handle)
            assert err == cu.CUresult.CUDA_SUCCESS
            return np.stack(out), prio
        finally:
            model.free()

    try:
        plain, p_plain = run(False)
        high, p_high = run(True)
    finally:
        weights.free(gpu)
    err, least, greatest = cu.cuCtxGetStreamPriorityRange()
    assert err == cu.CUresult.CUDA_SUCCESS and p_high == greatest and p_plain == 0
    assert np.isfinite(plain).all()
    assert np.array_equal(high.view(np.uint32), plain.view(np.uint32)), "the stream's priority changed the logits"
