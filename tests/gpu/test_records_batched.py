"""GPU test of a batched decode step's x̂ records: at the 35B-A3B's shapes, the DeltaNet step (for out_proj) and the
attention combine (for o_proj) write x̂ as chunk records of all B rows and the q8 GEMV copies them
(gemv_q8_s{B}r) instead of coding the fp32 output itself.

Oracle: the same steps with the records switched off. The codes are the same exact functions of the same fp32
values and the GEMV's sums run in the same order, so the logits must be the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_engine_layers import one_layer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layer,switch", [("linear_attention", "deltanet.STEP_OUT_RECORDS"),
                                          ("full_attention", "attention.COMBINE_OUT_RECORDS")])
def test_batched_records_give_the_same_logits(gpu, kernels, monkeypatch, layer, switch):
    """4 sequences × 4 decode steps (one layer + its MoE block, synthetic weights of recipe qwen3.6-35b-a3b): with
    the records (linear.RECORDS_ROWS holds 4) every step's out_proj / o_proj runs with x_records at M = 4; with
    `switch` off none does; the logits of all 4 rows agree to the bit."""
    from ninfer_rt.gpu import attention, deltanet, linear
    from ninfer_rt.gpu.engine import GpuModel
    from ninfer_rt.gpu.loader import synthetic_weights
    from ninfer_rt.recipe import load_recipe

    assert 4 in linear.RECORDS_ROWS
    spec = one_layer(layer)
    if kernels.gpu.info.major < 9:
        pytest.skip(f"no x̂ records on {kernels.gpu.info.arch} (linear.records_fit)")
    weights = synthetic_weights(gpu, spec, load_recipe("qwen3.6-35b-a3b"))
    toks = np.random.default_rng().integers(0, 1000, size=(4, 4)).astype(np.int32)
    plain, rows = linear.gemv, []

    def gemv(*args, **kw):
        if kw.get("x_records"):
            rows.append(kw["M"])
        plain(*args, **kw)

    def run() -> np.ndarray:
        model = GpuModel(gpu, kernels, spec, weights, slots=4, max_ctx=64, kv_dtype="int8")
        try:
            out = []
            for p in range(len(toks)):
                model.decode(toks[p], [p] * 4, [0, 1, 2, 3], graph=False)  # eager: every step's launches recorded
                out.append(model.logits(4))
            return np.stack(out)
        finally:
            model.free()

    try:
        monkeypatch.setattr(linear, "gemv", gemv)
        with_records = run()
        assert rows and set(rows) == {4}, f"the batched steps did not take x_records at M = 4: {rows}"
        rows.clear()
        module, name = switch.split(".")
        monkeypatch.setattr({"attention": attention, "deltanet": deltanet}[module], name, False)
        without = run()
        assert not rows
    finally:
        weights.free(gpu)
    assert np.isfinite(without).all()
    assert np.array_equal(with_records.view(np.uint32), without.view(np.uint32)), "the records changed the logits"
