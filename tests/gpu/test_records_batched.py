"""GPU test of a multi-row decode step's x̂ records: at the 35B-A3B's shapes, the DeltaNet step (for out_proj) and
the attention combine (for o_proj) write x̂ as chunk records of all M rows and the q8 GEMV copies them
(gemv_q8_s{M}r) instead of coding the fp32 output itself; B sequences of one token, or one sequence's verification
of T tokens, each where the planner takes records (linear.records_rows).

Oracle: the same steps with the records switched off. The codes are the same exact functions of the same fp32
values and the GEMV's sums run in the same order, so the logits must be the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_engine_layers import one_layer

pytestmark = pytest.mark.gpu

SWITCHES = [("linear_attention", "deltanet.STEP_OUT_RECORDS"), ("full_attention", "attention.COMBINE_OUT_RECORDS")]


def _records_against_plain(gpu, kernels, monkeypatch, rng, layer, switch, B, T):
    """(logits with the planner's records, logits with `switch` off, the M of every x_records GEMV of the first
    run): 4 eager steps of B sequences × T tokens (one layer + its MoE block, synthetic weights of recipe
    qwen3.6-35b-a3b seeded from `rng`, tokens drawn from it: the printed seed replays a failure); the second run
    must take no records."""
    from ninfer_rt.gpu import attention, deltanet, linear
    from ninfer_rt.gpu.engine import GpuModel
    from ninfer_rt.gpu.loader import synthetic_weights
    from ninfer_rt.recipe import load_recipe

    if kernels.gpu.info.major < 9:
        pytest.skip(f"no x̂ records on {kernels.gpu.info.arch} (linear.records_fit)")
    spec = one_layer(layer)
    weights = synthetic_weights(gpu, spec, load_recipe("qwen3.6-35b-a3b"), seed=int(rng.integers(2**31)))
    toks = rng.integers(0, 1000, size=(4, B * T)).astype(np.int32)
    plain, rows = linear.gemv, []

    def gemv(*args, **kw):
        if kw.get("x_records"):
            rows.append(kw["M"])
        plain(*args, **kw)

    def run() -> np.ndarray:
        model = GpuModel(gpu, kernels, spec, weights, slots=B, max_ctx=64, kv_dtype="int8")
        try:
            out = []
            for s in range(len(toks)):  # eager: every launch recorded
                if T == 1:
                    model.decode(toks[s], [s] * B, list(range(B)), graph=False)
                else:
                    model.verify(toks[s], s * T, 0, graph=False)
                out.append(model.logits(B * T))
            return np.stack(out)
        finally:
            model.free()

    try:
        monkeypatch.setattr(linear, "gemv", gemv)
        with_records = run()
        taken = list(rows)
        rows.clear()
        module, name = switch.split(".")
        monkeypatch.setattr({"attention": attention, "deltanet": deltanet}[module], name, False)
        without = run()
        assert not rows, f"records with {switch} off: {rows}"
    finally:
        weights.free(gpu)
    assert np.isfinite(without).all()
    return with_records, without, taken


@pytest.mark.parametrize("B", [2, 3, 4])
@pytest.mark.parametrize("layer,switch", SWITCHES)
def test_batched_records_give_the_same_logits(gpu, kernels, monkeypatch, rng, layer, switch, B):
    """B sequences × 4 decode steps: with the records (linear.RECORDS_ROWS holds B) every step's out_proj / o_proj
    runs with x_records at M = B; with `switch` off none does; the logits of all B rows agree to the bit."""
    from ninfer_rt.gpu import linear

    assert B in linear.RECORDS_ROWS
    with_records, without, taken = _records_against_plain(gpu, kernels, monkeypatch, rng, layer, switch, B, 1)
    assert taken and set(taken) == {B}, f"the batched steps did not take x_records at M = {B}: {taken}"
    assert np.array_equal(with_records.view(np.uint32), without.view(np.uint32)), "the records changed the logits"


@pytest.mark.parametrize("T", [2, 3])
@pytest.mark.parametrize("layer,switch", SWITCHES)
def test_verification_records_follow_the_planner(gpu, kernels, monkeypatch, rng, layer, switch, T):
    """One sequence's verification of T tokens, 4 steps: x_records at M = T exactly where linear.RECORDS_TOKENS
    holds T (3: yes, 2: no, v91), and every row's logits agree to the bit with `switch` off. At T = 2 neither run
    takes records, so only the planner assertion (no x_records at all) is meaningful there: the bit comparison is
    then of two plain runs (a determinism check, not a test of the records)."""
    from ninfer_rt.gpu import linear

    with_records, without, taken = _records_against_plain(gpu, kernels, monkeypatch, rng, layer, switch, 1, T)
    want = {T} if T in linear.RECORDS_TOKENS else set()
    assert set(taken) == want, f"a verification of {T} tokens took x_records at {taken}, the planner says {want}"
    assert np.array_equal(with_records.view(np.uint32), without.view(np.uint32)), "the records changed the logits"
