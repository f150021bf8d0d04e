"""kernels/moe_fused.cu (ninfer_rt.gpu.moe.fused): a decode token's MoE block after the router GEMV, in one
launch, against ninfer_rt.reference.ops.moe with the shared expert.

Inputs as test_moe_routed.py's chain: the residual x (not normalised), its norm weight, the router logits of the
torch expression ops.moe evaluates (no near-ties), banks holding exactly the chosen experts (the others 0xFF:
NaN scales), and a shared expert whose gate|up is interleaved as one expert of a bank. Each launch is checked
against:
  routing  moe_route on the same logits: ids, weights and shared_scale equal to the bit (route_row_block and
           route_row end in the same device function), and ids equal to torch.topk's; on rows of ties, ±0, NaN
           and -inf, ids equal to a stable arg-sort's
  act      the routed act and the shared act_s against silu(h·g)·(h·u) in torch fp32 (test_moe.act_oracle), with
           the int16 code error of the kernel's h per element added (test_moe_routed's module docstring)
  x        x_after - x_before against ops.moe(rms_norm_zc(x)): the routed part within test_moe.chain_tol, the
           shared part within the same propagation (shared_tol), both on the kernel's act codes
  barrier  each launch flips the barrier word's top bit and leaves its low bits as it found them, and the launch
           from the flipped word gives the same bits
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.gpu.weights import DeviceWeight

from .test_moe import (DIMS, DOT, INVALID, ROUTE_REL, U, act_bound, act_oracle, assert_close, bank, chain_tol, codes,
                       put, routed_case, routed_oracle, stable_topk_ids)
from .test_moe_routed import EPS, NORM, norm_ref, residual

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

I = 512  # routed and shared intermediate size (moe.FUSED_I)
# test_moe.DIMS shapes with I = 512 (T = 2 and T = 1); formats (routed gate/up, routed down); the shared expert
# is q8g32, as the recipes store it
CASES = [("35b", "q4g64", "q5g64"), ("35b", "q4g64", "q6g64"), ("35b", "q8g32", "q8g32"),
         ("fused1", "q4g64", "q4g64")]


def shared_expert(dev, rng, H: int, fmt: str = "q8g32"):
    """The shared gate|up [2I, H] (interleaved in tiles of 16) and down [H, I]: DeviceWeights and exact values
    (gate [I, H], up [I, H], down [H, I])."""
    from ninfer_rt import layout
    gu, gu_vals = bank(dev, fmt, 1, 2 * I, H, [0], rng)
    dn, dn_vals = bank(dev, fmt, 1, H, I, [0], rng)
    gate, up = layout.deinterleave_gate_up(gu_vals[0], pair=True)
    return (DeviceWeight("shared_gate_up", fmt, (2 * I, H), gu.base), DeviceWeight("shared_down", fmt, (H, I), dn.base),
            gate, up, dn_vals[0])


def shared_tol(y1, scale, a_s, tol_a, D, act_err) -> np.ndarray:
    """Bound on the shared term's error in x_after - x_before: act_s's error (tol_a, plus act_err, the code error of
    the kernel's act_s) through |D|, the down dot's own DOT, shared_scale's ROUTE_REL, and the final fma's rounding."""
    D = D.astype(np.float64)
    a = a_s.astype(np.float64)
    return abs(scale) * (DOT * (np.abs(D) @ np.abs(a)) + np.abs(D) @ (tol_a + act_err)
                         + 2 * ROUTE_REL * np.abs(D @ a)) + 2 * U * np.abs(y1)


def launch(kernels, dev, plan, weights, x, norm_w, logits, E, k, barrier):
    """One moe.fused launch on device copies of x and the logits; weights: (gate_up, down, shared gate|up, shared
    down). Returns numpy (x_after, ids, weights, shared_scale, act, act_s)."""
    from ninfer_rt.gpu import moe
    H = x.shape[-1]
    xp = put(dev, x)
    ids, w, ss = dev.empty(k * 4), dev.empty(k * 4), dev.empty(4)
    act, act_s = dev.empty(k * I * 4), dev.empty(I * 4)
    moe.fused(kernels, plan, *weights, x=xp, norm_w=put(dev, norm_w), eps=EPS, logits=put(dev, logits), E=E,
              top_k=k, ids=ids, weights=w, shared_scale=ss, act=act, act_s=act_s, barrier=barrier)
    return (dev.get(xp, (H,)), dev.get(ids, (k,), np.int32), dev.get(w, (k,)), dev.get(ss, (1,)),
            dev.get(act, (k, I)), dev.get(act_s, (I,)))


@pytest.mark.parametrize("dims,fmt_gu,fmt_down", CASES)
def test_fused_moe_matches_ops_moe(kernels, dev, rng, dims, fmt_gu, fmt_down):
    from ninfer_rt.gpu import moe
    from ninfer_rt.reference import ops
    E, k, _, H = DIMS[dims]

    def draw():
        x, norm_w = residual(rng, 1, H)
        return norm_ref(x, norm_w), (x, norm_w)

    c = routed_case(dev, rng, dims, fmt_gu, fmt_down, draw, router_scale=2 / np.sqrt(H))
    (x, norm_w), h, logits = c["extra"], c["h"], c["fused"]
    sgu, sdn, s_gate, s_up, s_down = shared_expert(dev, rng, H)
    weights = (c["gu"], c["dn"], sgu, sdn)
    plan = moe.fused_kernel(kernels, *weights, k)
    assert plan is not None, f"no moe_fused entry for {dims} {fmt_gu}/{fmt_down}/q8g32"
    barrier = dev.empty(4, poison=False)
    x1, ids, w, ss, act, act_s = launch(kernels, dev, plan, weights, x[0], norm_w, logits[0], E, k, barrier)

    # routing: moe_route's bits, and torch's ids
    r_ids, r_w, r_ss = dev.empty(k * 4), dev.empty(k * 4), dev.empty(4)
    moe.route(kernels, logits=put(dev, logits), ld=E + 1, M=1, E=E, top_k=k, ids=r_ids, weights=r_w, shared_scale=r_ss)
    np.testing.assert_array_equal(ids, dev.get(r_ids, (k,), np.int32), err_msg="ids differ from moe_route's")
    np.testing.assert_array_equal(w.view(np.uint32), dev.get(r_w, (k,)).view(np.uint32), err_msg="weights' bits")
    np.testing.assert_array_equal(ss.view(np.uint32), dev.get(r_ss, (1,)).view(np.uint32), err_msg="shared_scale")
    np.testing.assert_array_equal(ids, c["ids"][0], err_msg="ids differ from torch.topk")

    # act and act_s on the kernel's h codes (within d of torch's h per element)
    ex = codes(h.numpy())[1]
    want_act, tol_act = act_oracle(h, c["gate"], c["ids"], I, DOT + NORM, ex)
    assert_close(f"act [k, I] ({fmt_gu})", act, want_act[0], tol_act[0])
    hx = h.numpy()[0].astype(np.float64)
    want_s = (torch.nn.functional.silu(h @ torch.from_numpy(s_gate).T) * (h @ torch.from_numpy(s_up).T))[0].numpy()
    tol_s = act_bound(hx, s_gate, s_up, DOT + NORM, ex[0])
    assert_close("act_s [I] (q8g32)", act_s, want_s, tol_s)

    # x: ops.moe with the shared expert, split into its routed and shared terms for the bounds
    diff = x1.astype(np.float64) - x[0]
    a_d, s_d = codes(act)[1], codes(act_s)[1]
    routed = routed_oracle(h, c["router_w"], c["sg_w"], c["gate"], c["dn_vals"], k)[0]
    tol = chain_tol(x1[None], c["ids"], c["w"], want_act, tol_act, c["dn_vals"], a_d[None] / 2)[0]
    tol += shared_tol(x1, float(ss[0]), want_s, tol_s, s_down, s_d / 2)
    tol += 2 * U * (np.abs(x[0]) + np.abs(routed))  # x + routed is rounded before the shared term's fma
    shared = ops.moe(h, c["router_w"], torch.zeros(E, 2 * I, H), torch.zeros(E, H, I), k, torch.from_numpy(s_gate),
                     torch.from_numpy(s_up), torch.from_numpy(s_down), c["sg_w"]).numpy()[0]  # routed part zero
    assert_close(f"x_after - x_before vs ops.moe ({fmt_gu}/{fmt_down}/q8g32)", diff, routed + shared, tol)

    # the barrier word: top bit flipped, low bits back; a launch from the flipped word gives the same bits
    word = int(dev.get(barrier, (1,), np.uint32)[0])
    assert word == 0x80000000, f"the barrier word after one launch is {word:#x}, want 0x80000000"
    x2 = launch(kernels, dev, plan, weights, x[0], norm_w, logits[0], E, k, barrier)[0]
    np.testing.assert_array_equal(x2.view(np.uint32), x1.view(np.uint32), err_msg="a second launch differs")
    assert int(dev.get(barrier, (1,), np.uint32)[0]) == 0, "the barrier word after two launches must be 0"


def tie_rows(rng, E: int) -> np.ndarray:
    """Router logit rows [8, E + 1] that make routing orders hard: all equal, few distinct values (exact ties),
    ±0 and subnormals (one key), NaN (never picked; fewer than k candidates), -inf (picked last), and distinct
    values; column E, the shared-expert gate, from -8 to 8."""
    rows = np.zeros((8, E + 1), np.float32)
    rows[1, :E] = rng.integers(0, 3, E)
    rows[2, :E] = 50.0
    rows[3, :E] = rng.choice(np.array([0.0, -0.0, 1e-40, -1e-40, 1.0], np.float32), E)
    rows[4, :E] = np.nan
    rows[4, rng.choice(E, 3, replace=False)] = [1.5, -2.0, 0.25]
    rows[5, :E] = np.where(rng.random(E) < 0.5, np.nan, rng.integers(-2, 2, E) * 0.5)
    rows[6, :E] = -np.inf
    rows[6, rng.choice(E, 2, replace=False)] = [3.0, 7.0]
    rows[7, :E] = rng.standard_normal(E)
    rows[:, E] = rng.uniform(-8, 8, len(rows))
    return rows


@pytest.mark.parametrize("E,k", [(256, 8), (256, 3), (200, 8), (16, 8), (512, 8)])
def test_fused_moe_routing_ties_nan_inf(kernels, dev, rng, E, k):
    """The fused kernel's routing (the whole block's two rank passes where E <= 256, warp 0's rounds above) gives
    moe_route's ids, weights and shared_scale to the bit on rows of ties, ±0, NaN and -inf, and its ids are a
    stable arg-sort's (larger first, equal values by lower index, NaN never)."""
    from ninfer_rt.gpu import moe
    H = 1024
    gu, _ = bank(dev, "q4g64", E, 2 * I, H, [0], rng)  # only the routing is compared: the other experts are NaN
    dn, _ = bank(dev, "q4g64", E, H, I, [0], rng)
    sgu, sdn, *_ = shared_expert(dev, rng, H)
    weights = (gu, dn, sgu, sdn)
    plan = moe.fused_kernel(kernels, *weights, k)
    assert plan is not None, f"no moe_fused launch for E = {E}, k = {k}"
    barrier = dev.empty(4, poison=False)
    x, norm_w = residual(rng, 1, H)
    for i, row in enumerate(tie_rows(rng, E)):
        _, ids, w, ss, _, _ = launch(kernels, dev, plan, weights, x[0], norm_w, row, E, k, barrier)
        r_ids, r_w, r_ss = dev.empty(k * 4), dev.empty(k * 4), dev.empty(4)
        moe.route(kernels, logits=put(dev, row[None]), ld=E + 1, M=1, E=E, top_k=k, ids=r_ids, weights=r_w,
                  shared_scale=r_ss)
        np.testing.assert_array_equal(ids, dev.get(r_ids, (k,), np.int32), err_msg=f"row {i}: ids vs moe_route")
        np.testing.assert_array_equal(w.view(np.uint32), dev.get(r_w, (k,)).view(np.uint32),
                                      err_msg=f"row {i}: weights' bits vs moe_route")
        np.testing.assert_array_equal(ss.view(np.uint32), dev.get(r_ss, (1,)).view(np.uint32),
                                      err_msg=f"row {i}: shared_scale's bits vs moe_route")
        np.testing.assert_array_equal(ids, stable_topk_ids(row[None, :E], k)[0],
                                      err_msg=f"row {i}: ids vs a stable arg-sort")


def test_fused_moe_bad_ids_give_nan(kernels, dev, rng):
    """NaN router logits leave 3 candidates for top_k = 8: ids are the live experts in logit order (1.5 > 0.25 >
    -2.0), then 0x7fffffff; their weights a float64 softmax of those three logits within ROUTE_REL, the missing
    ones' weights 0 (exp(-inf)); the missing experts' act is NaN, act_s finite, and all of x NaN, as moe.down
    makes it."""
    from ninfer_rt.gpu import moe
    E, k, H = 16, 8, 1024
    gu, _ = bank(dev, "q4g64", E, 2 * I, H, range(E), rng)
    dn, _ = bank(dev, "q4g64", E, H, I, range(E), rng)
    sgu, sdn, *_ = shared_expert(dev, rng, H)
    weights = (gu, dn, sgu, sdn)
    plan = moe.fused_kernel(kernels, *weights, k)
    assert plan is not None, "no moe_fused entry for E = 16, q4g64/q4g64/q8g32 at H = 1024"
    logits = np.full(E + 1, np.nan, np.float32)
    live = rng.choice(E, 3, replace=False)
    logits[live] = [1.5, -2.0, 0.25]
    logits[E] = 0.5
    x, norm_w = residual(rng, 1, H)
    x1, ids, w, _, act, act_s = launch(kernels, dev, plan, weights, x[0], norm_w, logits, E, k,
                                       dev.empty(4, poison=False))
    want_ids = np.array([live[0], live[2], live[1]] + [INVALID] * (k - 3))
    np.testing.assert_array_equal(ids, want_ids, err_msg="ids: the live experts by logit, then 0x7fffffff")
    sel = logits[want_ids[:3]].astype(np.float64)
    want_w = np.exp(sel - sel[0])
    want_w /= want_w.sum()
    assert_close("weights of the live experts", w[:3], want_w, ROUTE_REL * want_w)
    assert (w[3:] == 0).all(), f"the missing experts' weights must be 0, got {w[3:]}"
    assert np.isfinite(act[:3]).all() and np.isnan(act[3:]).all() and np.isfinite(act_s).all() and np.isnan(x1).all()


def test_fused_kernel_declines_what_it_cannot_run(kernels, monkeypatch):
    """fused_kernel answers None (the separate launches) for shapes and formats moe_fused.cu has no entry for,
    and when the planner switch is off; it answers an entry for the recipes' 35B-A3B formats."""
    from ninfer_rt.gpu import moe
    W = DeviceWeight

    def ws(fmt_gu="q4g64", fmt_dn="q5g64", fmt_s="q8g32", E=256, H=2048, Ir=I, Is=I):
        return (W("gu", fmt_gu, (E, 2 * Ir, H), 256), W("dn", fmt_dn, (E, H, Ir), 256),
                W("sgu", fmt_s, (2 * Is, H), 256), W("sdn", fmt_s, (H, Is), 256))

    plan = moe.fused_kernel(kernels, *ws(), 8)
    assert plan is not None and plan[0] == "moe_fused_t2_q4g64_q5g64_q8g32" and plan[1] == 256
    assert moe.fused_kernel(kernels, *ws(fmt_gu="q5g128"), 8) is None  # no entry
    assert moe.fused_kernel(kernels, *ws(Ir=1024), 8) is None
    assert moe.fused_kernel(kernels, *ws(Is=256), 8) is None
    assert moe.fused_kernel(kernels, *ws(H=3072), 8) is None
    assert moe.fused_kernel(kernels, *ws(fmt_s="bf16"), 8) is None
    assert moe.fused_kernel(kernels, *ws(), 64) is None  # top_k above 16
    cap = kernels.gpu.max_active_blocks(kernels.fn(plan[0]), moe.THREADS, plan[2]) * kernels.gpu.info.sm_count
    # a grid larger than the GPU holds at once: top_k 16 needs 512 blocks
    assert (moe.fused_kernel(kernels, *ws(), 16) is None) == (cap < 512)
    monkeypatch.setattr(moe, "FUSED_DECODE", False)
    assert moe.fused_kernel(kernels, *ws(), 8) is None
