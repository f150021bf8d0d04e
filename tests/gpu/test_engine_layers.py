"""One decode layer at a bench model's shapes with synthetic weights of its recipe: the fused MoE, the x̂ records
and the router fold each give the logits of the launches they replace (same model, the planner switch off).
Bounds are stated in each test; `decode_each` runs one token a step with an int8 KV cache.
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_engine import prompt

pytestmark = pytest.mark.gpu


def one_layer(layer: str, model: str = "qwen3.6-35b-a3b"):
    """A bench model's spec cut to one layer of `layer` (+ its MLP or MoE block), for synthetic weights of its
    recipe."""
    import json

    from ninfer_rt.config import ModelSpec
    from ninfer_rt.gpu.bench import CONFIGS

    cfg = json.loads((CONFIGS / f"{model}.json").read_text())
    text = cfg["text_config"]
    text["num_hidden_layers"], text["layer_types"] = 1, [layer]
    return ModelSpec.from_config(cfg, f"{model}, 1 {layer} layer")


def decode_each(gpu, kernels, spec, weights, ids) -> np.ndarray:
    """Logits [len(ids), V] of decoding ids one token a step in a fresh model (int8 KV, one slot)."""
    from ninfer_rt.gpu.engine import GpuModel

    model = GpuModel(gpu, kernels, spec, weights, slots=1, max_ctx=64, kv_dtype="int8")
    try:
        out = []
        for p in range(len(ids)):
            model.decode(ids[p:p + 1], [p], [0])
            out.append(model.logits(1)[0])
        return np.stack(out)
    finally:
        model.free()


def test_fused_moe_decode_gives_the_separate_launches_logits(gpu, kernels, monkeypatch):
    """At the 35B-A3B's shapes (one attention + MoE layer, synthetic weights of recipe qwen3.6-35b-a3b), a one-token
    decode runs the MoE block after the router GEMV as moe.fused (one launch, a grid barrier inside); the same 6
    steps with moe.FUSED_DECODE off take gate_up_routed, the shared expert's GEMVs on the side stream and moe.down.
    The two differ only where the shared expert's gate|up meets its input: int16 codes of h (fused) or of
    x · (1 + w) rescaled after the dot (GEMV), each within 2^-14 of a chunk's largest value, so by ~2^-13 of the
    shared expert's output, and through the final norm and lm_head by the same order relative to the logits. We
    allow 2^-10 of the largest logit; a wrong pointer, row, gate or a missed barrier moves them by O(1). Both runs
    take the router GEMV (router_fold off: the fold's logits have their own test, which allows for near ties)."""
    from ninfer_rt.gpu import moe, router_fold
    from ninfer_rt.gpu.loader import synthetic_weights
    from ninfer_rt.recipe import load_recipe

    spec = one_layer("full_attention")
    weights = synthetic_weights(gpu, spec, load_recipe("qwen3.6-35b-a3b"))
    ids = prompt(6, 5, vocab=1000)
    plain = moe.fused
    calls = []
    monkeypatch.setattr(router_fold, "ROUTER_FOLD", False)

    def fused(*args, **kw):
        calls.append(1)
        plain(*args, **kw)

    try:
        monkeypatch.setattr(moe, "fused", fused)
        one = decode_each(gpu, kernels, spec, weights, ids)
        assert calls, "decode did not take moe.fused at the 35B-A3B's shapes"
        calls.clear()
        monkeypatch.setattr(moe, "FUSED_DECODE", False)
        separate = decode_each(gpu, kernels, spec, weights, ids)
        assert not calls
    finally:
        weights.free(gpu)
    assert np.isfinite(one).all() and np.isfinite(separate).all()
    np.testing.assert_allclose(one, separate, rtol=0, atol=2.0 ** -10 * np.abs(separate).max())


@pytest.mark.parametrize("model,layer,switch", [
    ("qwen3.6-35b-a3b", "linear_attention", "deltanet.STEP_OUT_RECORDS"),
    ("qwen3.6-35b-a3b", "full_attention", "attention.COMBINE_OUT_RECORDS"),
    ("qwen3.6-27b", "linear_attention", "linear.SWIGLU_OUT_RECORDS"),
])
def test_out_records_give_the_same_logits(gpu, kernels, monkeypatch, model, layer, switch):
    """At a bench model's shapes (one layer + its MLP or MoE block, synthetic weights of its recipe), a one-token
    decode has a producer write its consumer's x̂ as chunk records and the consumer copy them (x_records): the
    DeltaNet step for out_proj where a block holds 32 columns (a cluster of 4 per head, sm_90+), the attention
    combine for o_proj on its CUDA-core path, the dense MLP's gate/up for its down (y_records). With the switch
    off the consumer codes the fp32 output itself. The codes are the same, so the 6 steps' logits are the same
    bits."""
    from ninfer_rt.gpu import attention, deltanet, linear
    from ninfer_rt.gpu.loader import synthetic_weights
    from ninfer_rt.recipe import load_recipe

    spec = one_layer(layer, model)
    if kernels.gpu.info.major < 9 or (layer == "linear_attention"
                                      and not deltanet.records_fit(kernels, dv=spec.linear_value_head_dim)):
        pytest.skip(f"no x̂ records on {kernels.gpu.info.arch} (linear.records_fit, deltanet.records_fit)")
    module, name = switch.split(".")
    weights = synthetic_weights(gpu, spec, load_recipe(model))
    ids = prompt(6, 5, vocab=1000)
    plain, calls = linear.gemv, []
    probe = "y_records" if name == "SWIGLU_OUT_RECORDS" else "x_records"  # the switch's own launches

    def gemv(*args, **kw):
        calls.append(bool(kw.get(probe)))
        plain(*args, **kw)

    try:
        monkeypatch.setattr(linear, "gemv", gemv)
        with_records = decode_each(gpu, kernels, spec, weights, ids)
        assert any(calls), f"decode did not run the {switch} records"
        calls.clear()
        monkeypatch.setattr({"attention": attention, "deltanet": deltanet, "linear": linear}[module], name, False)
        without = decode_each(gpu, kernels, spec, weights, ids)
        assert not any(calls)
    finally:
        weights.free(gpu)
    assert np.isfinite(without).all()
    assert np.array_equal(with_records.view(np.uint32), without.view(np.uint32)), "the records changed the logits"


@pytest.mark.parametrize("layer", ["linear_attention", "full_attention"])
def test_router_fold_routes_as_the_router_gemv(gpu, kernels, monkeypatch, layer):
    """v71/v72: at the 35B-A3B's shapes (one DeltaNet or attention layer + its MoE, synthetic weights of
    recipe qwen3.6-35b-a3b), a one-token decode with router_fold.ROUTER_FOLD has the DeltaNet step (the attention
    decode's combine) add the router's raw logits G·x + M·y into acc and moe_fused_acc_* route on them before its
    wait, with no router GEMV; with it off the router GEMV writes the logits L. Both choose by the same keys, so each
    step's experts, weights and shared-expert scale agree up to the logits' difference: M = G·Ŵ_o in fp16 (2^-11
    relative, random-signed, so ~2^-11 of L's scale; the GEMV's int16 codes add 2^-14), against which
    τ = 2^-9 · max|L| is a ~20x margin (an estimate that relies on the roundings' random signs: the worst case,
    2^-11 Σ_j |M_ej y_j|, is far larger; the weights and ids are seeded, so the test is deterministic). Steps whose
    k-th and (k+1)-th logits are closer than 2τ are not compared (either choice is right); the weights may differ
    by 2τ relative, the scale by τ/4. Every fused launch of the fold's run (recorded and captured; the other steps
    replay the graph) reads acc and none of the other's; after the last step acc is zero (the fused MoE clears it
    once every block has routed)."""
    from ninfer_rt.gpu import moe, router_fold
    from ninfer_rt.gpu.engine import GpuModel
    from ninfer_rt.gpu.loader import synthetic_weights
    from ninfer_rt.recipe import load_recipe

    spec = one_layer(layer)
    E, k = spec.num_experts, spec.num_experts_per_tok
    weights = synthetic_weights(gpu, spec, load_recipe("qwen3.6-35b-a3b"))
    ids = prompt(12, 7, vocab=1000)
    plain_fused, accs = moe.fused, []

    def fused(*args, **kw):
        accs.append(kw.get("acc", 0))
        plain_fused(*args, **kw)

    monkeypatch.setattr(moe, "fused", fused)

    def run(fold: bool):
        monkeypatch.setattr(router_fold, "ROUTER_FOLD", fold)
        accs.clear()
        model = GpuModel(gpu, kernels, spec, weights, slots=1, max_ctx=64, kv_dtype="int8")
        try:
            if fold and not model._folds:
                pytest.skip(f"no router fold for a {layer} layer on {kernels.gpu.info.arch}")
            rows = []
            for p in range(len(ids)):
                model.decode(ids[p:p + 1], [p], [0])
                b = model.buf
                rows.append((gpu.download(b.router, (E + 1,), np.float32), gpu.download(b.ids, (k,), np.int32),
                             gpu.download(b.wts, (k,), np.float32), gpu.download(b.sscale, (1,), np.float32)[0]))
            # the launches recorded and captured (the other steps replay the graph): all with acc, or none
            assert accs and all(bool(a) == fold for a in accs), (fold, accs)
            acc = [gpu.download(a, (E + 1,), np.int64) for _, a in model._folds.values()]
            return rows, acc
        finally:
            model.free()

    folded, plain = fold_and_plain(gpu, weights, run)
    # rows (logits, ids, weights, shared scale): the plain run's logits are the router GEMV's
    compared = sum(same_routing(pl[0], fo[1:], pl[1:], E, k) for fo, pl in zip(folded, plain))
    assert compared >= len(ids) // 2, f"only {compared} of {len(ids)} steps had a clear k-th expert"


def fold_and_plain(gpu, weights, run) -> tuple[list, list]:
    """run(True) (the fold) then run(False) (the router GEMV), each giving (rows, acc after its last step); the
    weights freed either way. Asserts the folded run left every acc zero (the MoE clears what it routed on)."""
    try:
        folded, acc = run(True)
        plain, _ = run(False)
    finally:
        weights.free(gpu)
    assert acc and all(not a.any() for a in acc), "acc was not cleared after the MoE read it"
    return folded, plain


def same_routing(L: np.ndarray, folded: tuple, plain: tuple, E: int, k: int) -> bool:
    """One row's routing on the fold, folded = (ids, weights, shared scale), against the router GEMV's, plain, on
    its logits L [E + 1] (test_router_fold_routes_as_the_router_gemv's bounds, τ = 2^-9·max|L|). False (nothing
    compared) where the k-th and (k+1)-th logits are within 2τ: either choice is right there."""
    (f_ids, f_w, f_s), (p_ids, p_w, p_s) = folded, plain
    assert np.isfinite(L).all() and np.isfinite(f_w).all()
    tau = 2.0 ** -9 * np.abs(L).max()
    top = np.sort(L[:E])[::-1]
    if top[k - 1] - top[k] <= 2 * tau:
        return False
    assert sorted(f_ids) == sorted(p_ids) == sorted(np.argsort(-L[:E], kind="stable")[:k])
    fw, pw = dict(zip(f_ids, f_w)), dict(zip(p_ids, p_w))
    for e in p_ids:
        assert abs(fw[e] - pw[e]) <= 2 * tau * pw[e] + 1e-7, (e, fw[e], pw[e])
    assert abs(f_s - p_s) <= tau / 4 + 1e-7
    return True
