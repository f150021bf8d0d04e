"""v87: the router fold at B > 1 sequences of one token (router_fold.BATCH_FOLD). One DeltaNet or attention layer
of the 35B-A3B with its MoE (synthetic weights of recipe qwen3.6-35b-a3b): with the switch on, the DeltaNet step
(the attention combine) adds each sequence's raw router logits into its row of acc and gate_up_routed's _acc entry
routes on them, with no router GEMV; with it off the router GEMV writes the logits L. The bounds are
test_engine_layers.test_router_fold_routes_as_the_router_gemv's, row by row (its docstring derives them).
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_engine import prompt
from .test_engine_layers import fold_and_plain, one_layer, same_routing

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("B", [2, 4])
@pytest.mark.parametrize("layer, step", [("linear_attention", None), ("linear_attention", 1),
                                         ("linear_attention", 2), ("full_attention", None)])
def test_batch_fold_routes_as_the_router_gemv(gpu, kernels, monkeypatch, layer, step, B):
    """B sequences at different positions decode 8 steps together, the first steps recorded and captured, the rest
    replayed; each row's experts, weights and shared scale agree with the router GEMV's run where its k-th logit is
    clear; every gate_up_routed launch of the fold's run has acc (its _acc entry reads no logits) and none of the
    other run's does; acc is zero after the last step (moe.down clears the rows it routed). step: the DeltaNet
    step's blocks a head where forced (1: v88; 2: v89; what STEP_CLUSTER_WAVES may pick at B > 1), else its own."""
    from ninfer_rt.gpu import deltanet, moe, router_fold
    from ninfer_rt.gpu.engine import GpuModel
    from ninfer_rt.gpu.loader import synthetic_weights
    from ninfer_rt.recipe import load_recipe

    spec = one_layer(layer)
    E, k = spec.num_experts, spec.num_experts_per_tok
    weights = synthetic_weights(gpu, spec, load_recipe("qwen3.6-35b-a3b"))
    steps, start = 8, [3 * b for b in range(B)]
    ids = prompt(steps * B, 11, vocab=1000).reshape(steps, B)
    plain_routed, accs = moe.gate_up_routed, []

    def gate_up_routed(*args, **kw):
        accs.append(kw.get("acc", 0))
        plain_routed(*args, **kw)

    monkeypatch.setattr(moe, "gate_up_routed", gate_up_routed)
    monkeypatch.setattr(router_fold, "ROUTER_FOLD", True)
    if step == 2 and not kernels.clusters:
        pytest.skip(f"no thread-block clusters on {kernels.gpu.info.arch}")
    if step:
        monkeypatch.setattr(deltanet, "step_cluster", lambda k, **shape: step)

    def run(fold: bool):
        monkeypatch.setattr(router_fold, "BATCH_FOLD", fold)
        accs.clear()
        model = GpuModel(gpu, kernels, spec, weights, slots=B, max_ctx=64, kv_dtype="int8")
        try:
            if fold and model._fold_for(0, B, 1) is None:
                pytest.skip(f"no router fold of {B} rows for a {layer} layer on {kernels.gpu.info.arch}")
            rows = []
            for s in range(steps):
                model.decode(ids[s], [p + s for p in start], list(range(B)))
                b = model.buf
                rows.append((gpu.download(b.router, (B, E + 1), np.float32), gpu.download(b.ids, (B, k), np.int32),
                             gpu.download(b.wts, (B, k), np.float32), gpu.download(b.sscale, (B,), np.float32)))
            assert accs and all(bool(a) == fold for a in accs), (fold, accs)
            acc = [gpu.download(a, (B, router_fold.fold_ld(E)), np.int64) for _, a in model._folds.values()]
            return rows, acc
        finally:
            model.free()

    folded, plain = fold_and_plain(gpu, weights, run)
    # rows (logits [B, E + 1], ids, weights, shared scale), a sequence a row: the plain run's logits the GEMV's
    compared = sum(same_routing(pl[0][r], tuple(v[r] for v in fo[1:]), tuple(v[r] for v in pl[1:]), E, k)
                   for fo, pl in zip(folded, plain) for r in range(B))
    assert compared >= steps * B // 2, f"only {compared} of {steps * B} rows had a clear k-th expert"
