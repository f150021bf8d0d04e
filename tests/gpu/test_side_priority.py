"""v90 (prepared): batched decode's shared expert on a side stream of the greatest priority
(moe.SHARED_STREAM_PRIORITY; driver.Gpu.new_stream(high_priority=True), end_capture(node_priority=True)).

What the switch must do, checked at the launches: every launch is recorded with the stream it was given (a
conftest.Recorder that also keeps the stream and the first argument, the weight's qs plane for a GEMV), so the
test knows which launches read the shared expert's gate|up and down weights and on which stream they ran; and
the decode graph's instantiation is spied on for node_priority. Priority only changes which waiting blocks the
GPU places first, so the two runs' logits are compared bit for bit as a sanity check; the logits' correctness
against the reference is checked elsewhere (test_engine_layers, test_engine_batch_fold, test_records_batched).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from .conftest import Recorder
from .test_engine_layers import one_layer

pytestmark = pytest.mark.gpu


class StreamRecorder(Recorder):
    """Recorder that also keeps, per launch, (entry point, the stream it ran on, its first argument's value)."""

    def __init__(self, kernels):
        super().__init__(kernels)
        self.calls: list[tuple[str, object, int | None]] = []

    def launch(self, name, grid, block, args, smem=0, stream=None, cluster=None):
        first = args[0].value if args and isinstance(args[0], ctypes.c_uint64) else None
        self.calls.append((name, self.gpu.stream if stream is None else stream, first))
        super().launch(name, grid, block, args, smem, stream, cluster)


def _priority(stream) -> int:
    from cuda.bindings import driver as cu

    err, prio = cu.cuStreamGetPriority(stream.handle)
    assert err == cu.CUresult.CUDA_SUCCESS
    return prio


def test_side_stream_priority_keeps_the_logits(gpu, kernels, rng, monkeypatch):
    """2 sequences × 4 decode steps (one DeltaNet layer + its MoE block, synthetic weights of recipe
    qwen3.6-35b-a3b, fresh seed and tokens) captured and replayed as graphs. Switch on: the launches reading the
    shared expert's gate|up and down weights (one each: one capture, M = 2 is one GEMV chunk) ran on model.side,
    whose cuStreamGetPriority is the context's greatest, every other launch on the main stream (not of the
    greatest priority), and the graph was instantiated with node_priority=True. Switch off: the same two launches
    on a side stream (not the main one) of a priority other than the greatest, node_priority=False. The logits of
    the two runs are finite and the same bits (priority changes no sum)."""
    from cuda.bindings import driver as cu

    from ninfer_rt.gpu import moe
    from ninfer_rt.gpu.engine import LM, GpuModel
    from ninfer_rt.gpu.loader import synthetic_weights
    from ninfer_rt.gpu.weights import k_view
    from ninfer_rt.recipe import load_recipe

    err, least, greatest = cu.cuCtxGetStreamPriorityRange()
    assert err == cu.CUresult.CUDA_SUCCESS
    assert greatest < least, f"the context has one stream priority ({least}): nothing to check"  # H100: 0, -5
    assert _priority(gpu.stream) != greatest

    spec = one_layer("linear_attention")
    weights = synthetic_weights(gpu, spec, load_recipe("qwen3.6-35b-a3b"), seed=int(rng.integers(2**31)))
    toks = rng.integers(0, spec.vocab_size, size=(4, 2)).astype(np.int32)
    mlp = LM + "layers.0.mlp."
    shared = {k_view(weights.matrix(mlp + n)).planes()[0]: n
              for n in ("shared_expert.{gate_proj,up_proj}.weight", "shared_expert.down_proj.weight")}
    assert len(shared) == 2

    real_end = gpu.end_capture
    captures: list[bool] = []

    def end_capture(stream=None, node_priority=False):
        captures.append(node_priority)
        return real_end(stream, node_priority=node_priority)

    monkeypatch.setattr(gpu, "end_capture", end_capture)

    def run(high: bool):
        monkeypatch.setattr(moe, "SHARED_STREAM_PRIORITY", high)
        captures.clear()
        rec = StreamRecorder(kernels)
        model = GpuModel(gpu, rec, spec, weights, slots=2, max_ctx=64, kv_dtype="int8")
        try:
            out = []
            for p in range(len(toks)):
                model.decode(toks[p], [p] * 2, [0, 1])
                out.append(model.logits(2))
            side = model.side
        finally:
            model.free()
        assert captures == [high], f"switch {high}: end_capture's node_priority per capture {captures}"
        on_shared = [(n, s, shared[f]) for n, s, f in rec.calls if f in shared]
        others = [(n, s) for n, s, f in rec.calls if f not in shared]
        assert sorted(w for _, _, w in on_shared) == sorted(shared.values()), \
            f"switch {high}: the shared expert's launches {[(n, w) for n, _, w in on_shared]}"
        assert side is not gpu.stream
        for n, s, w in on_shared:
            assert s is side, f"switch {high}: {n} ({w}) did not run on the side stream"
            assert (_priority(s) == greatest) == high, \
                f"switch {high}: {n} ({w}) ran at priority {_priority(s)} (greatest {greatest})"
        assert others, "no other launch was recorded"
        for n, s in others:
            assert s is gpu.stream and _priority(s) != greatest, f"switch {high}: {n} ran off the main stream"
        return np.stack(out)

    try:
        plain = run(False)
        high = run(True)
    finally:
        weights.free(gpu)
    assert np.isfinite(plain).all()
    assert np.array_equal(high.view(np.uint32), plain.view(np.uint32)), "the stream's priority changed the logits"
