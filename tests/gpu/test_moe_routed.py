"""kernels/moe.cu moe_gate_up_routed_* (ninfer_rt.gpu.moe.gate_up_routed): RMSNorm + route + gate_up, one launch.

Inputs are the residual stream x (not normalised), the norm weight and the router logits; helpers, oracles and
tolerances are test_moe.py's. Each call is checked against:
  routing  moe_route on the same logits: ids equal, weights and shared_scale equal to the bit (both run one device
           function, route_row); and the independent oracle: ids equal torch.topk's (logits drawn without
           near-ties) or a stable arg-sort's (ties, NaN, -inf), weights and shared_scale within ROUTE_REL
  act      torch fp32 silu(h·g)·(h·u) with h = ops.rms_norm_zc(x, norm_w, eps) computed in torch
  chain    gate_up_routed, then moe.down on its ids and weights, against ops.moe on h (routed part)
Norm tolerance: the kernel's h is within 13u of the exact norm (u = 2^-24): Σ x² passes through <= 16 roundings
(<= 8 serial terms per thread at H <= 2048, then 8 tree levels), <= 16u on a sum of positive terms, halved by the
square root; the divide, the add of eps, the rsqrt, 1 + w and the two multiplies add one rounding each. torch's fp32
rms_norm_zc is off by the same order; test_misc checks misc.rms_norm (same roundings, another summation order)
within 5e-6 of it, and we allow NORM = 5e-6 relative per element of h. A dot is linear in h, so g·h moves by at
most NORM·Σ|g·h|: act is checked with act_bound at a dot tolerance of DOT + NORM, and the chain with chain_tol on
that act bound. x rows are scaled by 10^U(-3, 1) (at 1e-3, mean x² ~ eps) and norm_w ~ 0.2·N(0, 1), so a kernel
that skipped the norm, eps or the gain 1 + w would be off by orders of magnitude more.
The fast path (H = 1024·T) multiplies int16 codes of its own h (test_moe.codes): each element within d / 2 of
that h, and, since that h is within NORM of torch's, within d of torch's h (d the chunk scale of torch's h: the
kernel's can be twice it only when the chunk's largest value sits within NORM below a power of two). The act
bound gets that absolute error per element (act_bound's ex).
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_moe import (CASES, DIMS, DOT, INVALID, ROUTE_CASES, ROUTE_REL, act_oracle, assert_close, bank, chain_tol,
                       codes, fast_down, fast_gate_up, put, ref_routing, routed_case, routed_oracle, stable_topk_ids)

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

NORM = 5e-6  # relative error of h allowed between the kernel and ops.rms_norm_zc, see the module docstring
EPS = 1e-6
# "generic": moe_gate_up_routed_<f> (H = 64); "fast": moe_gate_up_routed_t1_<f> (H = 1024); "unaligned": H = 1024
# with norm_w not 16-byte aligned, which must fall back to the generic kernel (the entry each must launch: below)
PATHS = {"generic": 64, "fast": 1024, "unaligned": 1024}
PATH_KERNEL = {"generic": "moe_gate_up_routed_{}", "fast": "moe_gate_up_routed_t1_{}",
               "unaligned": "moe_gate_up_routed_{}"}


# ------------------------------------------------------------------------------------------ helpers

def residual(rng, M: int, H: int) -> tuple[np.ndarray, np.ndarray]:
    """x [M, H]: rows of N(0, 1) scaled by 10^U(-3, 1); norm_w [H] ~ 0.2·N(0, 1) (gain 1 + w)."""
    x = rng.standard_normal((M, H)) * 10.0 ** rng.uniform(-3, 1, size=(M, 1))
    return x.astype(np.float32), (rng.standard_normal(H) * 0.2).astype(np.float32)


def norm_ref(x: np.ndarray, norm_w: np.ndarray) -> "torch.Tensor":
    from ninfer_rt.reference import ops
    return ops.rms_norm_zc(torch.from_numpy(x), torch.from_numpy(norm_w), EPS)


def put_at(dev, a: np.ndarray, offset: int) -> int:
    """Upload `a` `offset` bytes past an allocation's (aligned) start: offset 4 breaks 16-byte alignment."""
    pad = np.full(offset // 4, np.nan, np.float32)
    return put(dev, np.concatenate([pad, np.asarray(a, np.float32).ravel()])) + offset


def run_routed(kernels, dev, gu, x, norm_w, logits, E: int, top_k: int, w_offset: int = 0):
    """gate_up_routed into poisoned outputs, and moe_route on the same logits. Returns the device pointers
    (ids, weights, act) for moe.down, then numpy (ids, weights, shared_scale, act) and moe_route's
    (ids, weights, shared_scale)."""
    from ninfer_rt.gpu import moe
    M, ld = logits.shape
    I = gu.shape[1] // 2
    lp = put(dev, logits)
    ids, w, ss, act = dev.empty(M * top_k * 4), dev.empty(M * top_k * 4), dev.empty(M * 4), dev.empty(M * top_k * I * 4)
    moe.gate_up_routed(kernels, gu, x=put(dev, x), norm_w=put_at(dev, norm_w, w_offset), eps=EPS, logits=lp, ld=ld,
                       M=M, E=E, top_k=top_k, ids=ids, weights=w, shared_scale=ss, act=act)
    r_ids, r_w, r_ss = dev.empty(M * top_k * 4), dev.empty(M * top_k * 4), dev.empty(M * 4)
    moe.route(kernels, logits=lp, ld=ld, M=M, E=E, top_k=top_k, ids=r_ids, weights=r_w, shared_scale=r_ss)
    got = (dev.get(ids, (M, top_k), np.int32), dev.get(w, (M, top_k)), dev.get(ss, (M,)),
           dev.get(act, (M, top_k, I)))
    ref = dev.get(r_ids, (M, top_k), np.int32), dev.get(r_w, (M, top_k)), dev.get(r_ss, (M,))
    return (ids, w, act), got, ref


def assert_same_routing(got, ref) -> None:
    """ids, weights and shared_scale of gate_up_routed equal moe_route's to the bit (NaN payloads included)."""
    np.testing.assert_array_equal(got[0], ref[0], err_msg="gate_up_routed ids differ from moe_route's")
    np.testing.assert_array_equal(got[1].view(np.uint32), ref[1].view(np.uint32),
                                  err_msg="gate_up_routed weights differ from moe_route's bits")
    np.testing.assert_array_equal(got[2].view(np.uint32), ref[2].view(np.uint32),
                                  err_msg="gate_up_routed shared_scale differs from moe_route's bits")


def sigmoid64(v) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(v, np.float64)))


def routed_kernels(fmt_gu: str, H: int, fmt_down: str, I: int, M: int) -> tuple[str, str]:
    """The entry points moe.gate_up_routed and moe.down must launch for these banks (16-byte aligned inputs):
    the fast paths moe_gate_up_routed_t{H/1024}_<f> / moe_down_t{I/512}_<f> for q banks at H = 1024·T /
    I = 512·T, their three-blocks-an-SM builds at several rows where the planner constants ask (gate/up at T = 2,
    down at T = 1), else the general moe_gate_up_routed_<f> / moe_down_<f>."""
    from ninfer_rt.gpu import moe
    if fast_gate_up(fmt_gu, H):
        t = H // 1024
        b3 = moe.GATE_UP_BLOCKS_PER_SM == 3 and M > 1 and t == 2 and fmt_gu in moe.GATE_UP_B3_FORMATS
        gu = f"moe_gate_up_routed_{'b3_' if b3 else ''}t{t}_{fmt_gu}"
    else:
        gu = f"moe_gate_up_routed_{fmt_gu}"
    if fast_down(fmt_down, I):
        t = I // 512
        b3 = moe.DOWN_BLOCKS_PER_SM == 3 and M > 1 and t == 1 and fmt_down in moe.DOWN_B3_FORMATS
        dn = f"moe_down_{'b3_' if b3 else ''}t{t}_{fmt_down}"
    else:
        dn = f"moe_down_{fmt_down}"
    return gu, dn


# ------------------------------------------------------------------------------------------ routing + act

@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("E,top_k,M", ROUTE_CASES)
def test_routed_routing_and_act(kernels, recorder, dev, rng, E, top_k, M, path):
    """Distinct logits with padding columns and a shared gate above every router logit on even rows (ranking
    column E or the padding would pick the wrong experts): routing as moe_route and torch; act as the oracle;
    the path's entry point (PATH_KERNEL) is the one launched."""
    from ninfer_rt import layout
    H, I = PATHS[path], 32
    ld = E + 1 + 3
    logits = np.empty((M, ld), np.float32)
    logits[:, :E] = np.stack([rng.permutation(E) * 0.05 + rng.uniform(-20, 20) for _ in range(M)])
    row_max = logits[:, :E].max(-1)
    logits[:, E] = np.where(np.arange(M) % 2 == 0, row_max + rng.uniform(0.5, 3, M), rng.uniform(-8, 8, M))
    logits[:, E + 1:] = 1e30
    want_ids, want_w = ref_routing(torch.from_numpy(logits[:, :E]), top_k)
    x, norm_w = residual(rng, M, H)
    gu, gu_vals = bank(dev, "q4g64", E, 2 * I, H, want_ids.ravel(), rng)
    gate = {e: layout.deinterleave_gate_up(v[None])[0][0] for e, v in gu_vals.items()}

    _, got, ref = run_routed(recorder, dev, gu, x, norm_w, logits, E, top_k,
                             w_offset=4 if path == "unaligned" else 0)
    assert recorder.names == [PATH_KERNEL[path].format("q4g64"), "moe_route"], recorder.names
    assert_same_routing(got, ref)
    np.testing.assert_array_equal(got[0], want_ids, err_msg="gate_up_routed ids differ from torch.topk")
    assert_close("weights vs torch", got[1], want_w, ROUTE_REL * np.abs(want_w))
    want_ss = sigmoid64(logits[:, E])
    assert_close("shared_scale vs sigmoid", got[2], want_ss, ROUTE_REL * want_ss)
    h = norm_ref(x, norm_w)
    ex = codes(h.numpy())[1] if path == "fast" else None  # the fast path's code error, see the module docstring
    want_act, tol_act = act_oracle(h, gate, want_ids, I, DOT + NORM, ex)
    assert_close(f"act [M, k, I] ({path})", got[3], want_act, tol_act)


@pytest.mark.parametrize("path", ["generic", "fast"])
def test_routed_ties_nan_inf(kernels, dev, rng, path):
    """Exact ties (larger first, then lower index), NaN logits (never picked: a row with fewer than top_k
    candidates gets id 0x7fffffff and NaN act for the missing ones) and -inf (picked last, weight 0), routed as
    moe_route routes them; every block reads the id of its own j."""
    from ninfer_rt import layout
    E, k, H, I = 64, 8, PATHS[path], 32
    logits = np.zeros((7, E + 1), np.float32)  # row 0: all zero
    logits[1, :E] = rng.integers(0, 3, E)
    logits[2, :E] = 50.0
    logits[3, :E] = rng.integers(-2, 2, E) * 0.5 - 30.0
    logits[4, :E] = np.nan
    logits[4, rng.choice(E, 3, replace=False)] = [1.5, -2.0, 0.25]  # 3 candidates for k = 8
    logits[5, :E] = np.nan
    logits[6, :E] = -np.inf
    logits[6, rng.choice(E, 2, replace=False)] = [3.0, 7.0]
    logits[:, E] = rng.uniform(-8, 8, len(logits))
    M = len(logits)
    want_ids = stable_topk_ids(logits[:, :E], k)
    x, norm_w = residual(rng, M, H)
    gu, gu_vals = bank(dev, "q6g64", E, 2 * I, H, range(E), rng)
    gate = {e: layout.deinterleave_gate_up(v[None])[0][0] for e, v in gu_vals.items()}

    _, got, ref = run_routed(kernels, dev, gu, x, norm_w, logits, E, k)
    assert_same_routing(got, ref)
    np.testing.assert_array_equal(got[0], want_ids, err_msg="tie / NaN / -inf order")
    valid = want_ids != INVALID
    sel = np.where(valid, np.take_along_axis(logits[:, :E].astype(np.float64), np.where(valid, want_ids, 0), -1),
                   -np.inf)
    ok = valid[:, 0]  # rows with at least one candidate; row 5 has none (its weights are NaN, as moe_route's)
    want_w = np.exp(sel[ok] - sel[ok, :1])
    want_w /= want_w.sum(-1, keepdims=True)
    assert_close("weights (ties, NaN, -inf)", got[1][ok], want_w, ROUTE_REL * want_w)
    assert np.isnan(got[1][~ok]).all(), "a row without candidates must get NaN weights, as moe_route's"
    want_ss = sigmoid64(logits[:, E])
    assert_close("shared_scale", got[2], want_ss, ROUTE_REL * want_ss)

    h = norm_ref(x, norm_w)
    ex = codes(h.numpy())[1] if path == "fast" else None
    want_act, tol_act = act_oracle(h, gate, np.where(valid, want_ids, 0), I, DOT + NORM, ex)
    assert np.isnan(got[3][~valid]).all(), "an invalid id must give NaN act"
    assert_close(f"act of valid ids ({path})", got[3][valid], want_act[valid], tol_act[valid])


# ------------------------------------------------------------------------------------------ the chain

CHAIN = list(dict.fromkeys((dims, fg, fd) for dims, _, fg, fd in CASES))  # test_moe's shapes and formats


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("dims,fmt_gu,fmt_down", CHAIN)
def test_routed_chain(kernels, recorder, dev, rng, dims, M, fmt_gu, fmt_down):
    """gate_up_routed + moe.down against ops.moe on h = rms_norm_zc(x), the logits of the same torch expression
    ops.moe evaluates; routing and act checked on the way, and the entry points launched (routed_kernels)."""
    from ninfer_rt.gpu import moe
    E, k, I, H = DIMS[dims]

    def draw():
        x, norm_w = residual(rng, M, H)
        return norm_ref(x, norm_w), (x, norm_w)  # rms ~ 1: logits ~ N(0, 4) as in test_moe

    c = routed_case(dev, rng, dims, fmt_gu, fmt_down, draw, router_scale=2 / np.sqrt(H))
    (x, norm_w), h, fused = c["extra"], c["h"], c["fused"]
    router_w, sg_w, want_ids, want_w, gu, dn, dn_vals, gate = (c[n] for n in ("router_w", "sg_w", "ids", "w", "gu",
                                                                               "dn", "dn_vals", "gate"))
    (ids, w, act), got, ref = run_routed(recorder, dev, gu, x, norm_w, fused, E, k)
    want_gu, want_dn = routed_kernels(fmt_gu, H, fmt_down, I, M)
    assert recorder.names == [want_gu, "moe_route"], recorder.names
    assert_same_routing(got, ref)
    np.testing.assert_array_equal(got[0], want_ids, err_msg="gate_up_routed ids differ from torch.topk")
    assert_close("weights vs torch", got[1], want_w, ROUTE_REL * np.abs(want_w))
    want_ss = torch.sigmoid(h @ sg_w.T).numpy()[:, 0]
    assert_close("shared_scale vs torch", got[2], want_ss, ROUTE_REL * np.abs(want_ss))
    ex = codes(h.numpy())[1] if fast_gate_up(fmt_gu, H) else None
    want_act, tol_act = act_oracle(h, gate, want_ids, I, DOT + NORM, ex)
    assert_close(f"act [M, k, I] ({fmt_gu})", got[3], want_act, tol_act)

    y0 = rng.standard_normal((M, H)).astype(np.float32)
    y = put(dev, y0)
    moe.down(recorder, dn, act=act, ids=ids, weights=w, M=M, top_k=k, y=y)
    assert recorder.names[2:] == [want_dn], recorder.names
    y1 = dev.get(y, (M, H))
    routed = routed_oracle(h, router_w, sg_w, gate, dn_vals, k)
    assert_close(f"routed MoE from x vs ops.moe(rms_norm_zc(x)) ({fmt_gu}/{fmt_down})", y1.astype(np.float64) - y0,
                 routed, chain_tol(y1, want_ids, want_w, want_act, tol_act, dn_vals,
                                   codes(got[3])[1] / 2 if fast_down(fmt_down, I) else None))


@pytest.mark.parametrize("fmt", ["q4g64", "q5g64"])
def test_routed_three_blocks_per_sm(kernels, dev, rng, monkeypatch, fmt):
    """moe_gate_up_routed_b3_t2 (several rows, 35B shapes) against the oracle, and to the bit against the
    one-row build (same source, another register budget: the arithmetic is the same instructions)."""
    from ninfer_rt import layout
    from ninfer_rt.gpu import moe
    E, k, I, H = DIMS["35b"]
    M = 2
    logits = np.stack([rng.permutation(E) * 0.05 + rng.uniform(-5, 5) for _ in range(M)])
    logits = np.concatenate([logits, rng.uniform(-8, 8, (M, 1))], 1).astype(np.float32)
    want_ids, _ = ref_routing(torch.from_numpy(logits[:, :E]), k)
    x, norm_w = residual(rng, M, H)
    gu, gu_vals = bank(dev, fmt, E, 2 * I, H, want_ids.ravel(), rng)
    gate = {e: layout.deinterleave_gate_up(v[None])[0][0] for e, v in gu_vals.items()}
    launched = []
    monkeypatch.setattr(kernels, "launch", lambda name, *a, _l=kernels.launch, **kw: (launched.append(name),
                                                                                        _l(name, *a, **kw)))
    monkeypatch.setattr(moe, "GATE_UP_BLOCKS_PER_SM", 2)
    _, base, _ = run_routed(kernels, dev, gu, x, norm_w, logits, E, k)
    monkeypatch.setattr(moe, "GATE_UP_BLOCKS_PER_SM", 3)
    _, got, ref = run_routed(kernels, dev, gu, x, norm_w, logits, E, k)
    assert launched[0] == f"moe_gate_up_routed_t2_{fmt}"
    assert launched[2] == f"moe_gate_up_routed_b3_t2_{fmt}"
    assert_same_routing(got, ref)
    np.testing.assert_array_equal(got[0], want_ids, err_msg="ids differ from torch.topk")
    h = norm_ref(x, norm_w)
    want_act, tol_act = act_oracle(h, gate, want_ids, I, DOT + NORM, codes(h.numpy())[1])
    assert_close(f"act [M, k, I] (b3, {fmt})", got[3], want_act, tol_act)
    np.testing.assert_array_equal(got[3].view(np.uint32), base[3].view(np.uint32),
                                  err_msg="the b3 build's act differs from the one-row kernel's bits")


# ------------------------------------------------------------------------------------------ misuse

def test_routed_misuse_raises(kernels):
    from ninfer_rt.gpu import moe
    from ninfer_rt.gpu.driver import GpuError
    from ninfer_rt.gpu.weights import DeviceWeight
    bank8 = DeviceWeight("b", "q4g64", (8, 64, 64), 1)
    ok = dict(x=1, norm_w=1, eps=1e-6, logits=1, ld=9, M=1, E=8, top_k=2, ids=1, weights=1, shared_scale=1, act=1)
    cases = [
        (bank8, dict(E=16, ld=17), "holds 8 experts"),
        (bank8, dict(ld=8), "ld=8 must be >= E"),
        (bank8, dict(top_k=9), "exceeds E"),
        (DeviceWeight("b", "q4g64", (32, 64, 64), 1), dict(top_k=17, E=32, ld=33), "top_k=17 outside"),
        (bank8, dict(norm_w=0), "norm_w is a null pointer"),
        (bank8, dict(shared_scale=0), "shared_scale is a null pointer"),
        (DeviceWeight("b", "fp32", (8, 64, 64), 1), {}, "fp32"),
        (DeviceWeight("b", "q4g64", (64, 64), 1), {}, "expert bank"),
        (DeviceWeight("b", "q4g64", (8, 64, 48), 1), {}, "multiples of 32"),
    ]
    for w, change, what in cases:
        with pytest.raises(GpuError, match=what):
            moe.gate_up_routed(kernels, w, **{**ok, **change})
