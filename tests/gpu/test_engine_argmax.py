"""v115: the decode step's arg-max taken by the lm_head GEMV's own launch (engine.ARGMAX_IN_LM_HEAD): one layer of
the 35B-A3B (synthetic weights of recipe qwen3.6-35b-a3b, its 248,320-row lm_head) decoding in captured graphs.

Oracle: the arg-max of the logits buffer the same step wrote (numpy, ties to the lowest id, over ids < the draw's
vocab), and the step's launches: no argmax_rows where the lm_head takes the draw, argmax_rows where it cannot
(several rows on the stream kernel) or where the switch is off. The ids must be equal: both read the same logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import Recorder
from .test_engine import prompt
from .test_engine_layers import one_layer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fold", [True, False])
def test_lm_head_takes_the_argmax_draw(gpu, kernels, monkeypatch, fold):
    """B = 1 decodes 4 steps with the plain arg-max (into buf.argmax, over sample_vocab), then 4 fed from the draw
    slot with draw (vocab, None), vocab below V (into the draw slots); B = 3 (the lm_head's stream kernel, which
    has no epilogue) 3 steps with draws. Each step's ids are its logits' arg-max; the launches say who took it."""
    from ninfer_rt.gpu import engine
    from ninfer_rt.gpu.engine import GpuModel
    from ninfer_rt.gpu.loader import synthetic_weights
    from ninfer_rt.recipe import load_recipe

    monkeypatch.setattr(engine, "ARGMAX_IN_LM_HEAD", fold)
    spec = one_layer("linear_attention")
    weights = synthetic_weights(gpu, spec, load_recipe("qwen3.6-35b-a3b"))
    rec = Recorder(kernels)
    model = GpuModel(gpu, rec, spec, weights, slots=3, max_ctx=64, kv_dtype="int8")
    try:
        V, vocab = model.V, model.V - 1000
        ids = prompt(4, 3, vocab=1000)
        for p in range(4):
            model.decode(ids[p:p + 1], [p], [0])
            logits = model.logits(1)[0, :model.sample_vocab]
            assert model.argmax(1)[0] == int(np.argmax(logits)), p
        lone = set(rec.names)
        rec.names.clear()
        model.decode(ids[3:4], [4], [0], draw=(vocab, None))
        for p in range(5, 9):
            want = int(np.argmax(model.logits(1)[0, :vocab]))
            assert model.drawn() == want, p
            model.decode(None, [p], [0], draw=(vocab, None))
        drawn = set(rec.names)
        rec.names.clear()
        model.decode(np.array([1, 2, 3], np.int32), [9, 0, 0], [0, 1, 2], draw=(vocab, None))
        for p in range(10, 13):
            want = np.argmax(model.logits(3)[:, :vocab], axis=1)
            assert np.array_equal(model.drawn_rows(3), want), p
            model.decode(None, [p, p - 9, p - 9], [0, 1, 2], draw=(vocab, None))
        batched = set(rec.names)
    finally:
        model.free()
        weights.free(gpu)
    assert V == 248320 and ("argmax_rows" in lone) != fold and ("argmax_rows" in drawn) != fold, (lone, drawn)
    assert "argmax_rows" in batched, batched
