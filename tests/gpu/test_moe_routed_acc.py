"""kernels/moe.cu moe_gate_up_routed_acc_* (moe.gate_up_routed with acc, v87): the routed gate/up of several rows
routed on a router fold's int64 rows (router_fold.py: raw logits G·x_m in 2^-32 fixed point) instead of fp32 logits,
and moe.down with the same acc, which zeroes the rows it was given.

Oracle: the routing of the logits the rows stand for, L_m = a_m · r_m, a_m = fp32(acc_m) · 2^-32 exactly (what the
kernel converts) and r_m = rsqrt(mean x_m² + eps) in float64; the kernel's r is within NORM of it (test_moe_routed's
docstring; the product r·a in fp32 adds one rounding, u << NORM). ids: a stable arg-sort of a_m (distinct values,
and r > 0 keeps the order). weights: w_j = exp(L_j - L_top) / Σ; r's error moves each exponent by
<= NORM·|L_j - L_top|, so each weight by at most twice the largest such move relative, plus ROUTE_REL for the
kernel's own exp and sum. shared_scale s = sigmoid(L_E): L_E is off by <= NORM·|L_E|, which moves s by
<= s(1 - s)·NORM·|L_E| (first order; |sigmoid''| <= 0.1 makes the second order ~1e-11), and the kernel's exp and
division add ROUTE_REL·s (relative, as moe_route's test): tol = 2·(NORM·|L_E|·s(1 - s) + ROUTE_REL·s), a 2x margin.
act: test_moe_routed's oracle on h = rms_norm_zc(x).
x rows are N(0, 1) scaled by 10^U(-3, 1), row 0 by 10^-3 (mean x² ~ eps: a kernel without eps is off by ~√2 in r
there); acc's raw logits are the wanted logits L divided by the row's r (the fold holds G·x, unnormalised, and the
kernel multiplies by r), so L keeps the range of a permutation 0.05 apart plus an offset in [-3, 3] and a shared gate
logit in [-4, 4] at every scale of x.
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_moe import DIMS, DOT, ROUTE_REL, act_oracle, assert_close, bank, codes, put
from .test_moe_routed import EPS, NORM, norm_ref

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def acc_rows(rng, M: int, E: int, ld: int, r: np.ndarray) -> np.ndarray:
    """acc int64 [M + 1, ld]: rows 0..M-1 the raw logits L / r_m (r: [M], the rows' rsqrt(mean x² + eps)) of
    distinct experts (L a permutation 0.05 apart, offset) and the shared gate (L in [-4, 4]) in column E, scaled by
    2^32; row M a sentinel no kernel may touch."""
    L = np.stack([rng.permutation(E) * 0.05 + rng.uniform(-3, 3) for _ in range(M)])
    a = np.zeros((M + 1, ld), np.int64)
    a[:M, :E] = np.rint(L / r[:, None] * 2.0 ** 32).astype(np.int64)
    a[:M, E] = np.rint(rng.uniform(-4, 4, M) / r * 2.0 ** 32).astype(np.int64)
    a[M] = np.arange(1, ld + 1)
    return a


@pytest.mark.parametrize("blocks_per_sm", [2, 3])
@pytest.mark.parametrize("fmt,M", [("q4g64", 2), ("q4g64", 4), ("q5g64", 8), ("q4g64", 1)])
def test_routed_on_acc(kernels, dev, rng, monkeypatch, fmt, M, blocks_per_sm):
    """35B shapes (E = 256, k = 8, I = 512, H = 2048): ids, weights, shared_scale and act of each row against the
    oracle; then moe.down on them with and without acc: the same y bits, acc's rows 0..M-1 zero after it and the
    sentinel row as it was."""
    from ninfer_rt import layout
    from ninfer_rt.gpu import moe, router_fold
    E, k, I, H = DIMS["35b"]
    ld = router_fold.fold_ld(E)
    scale = 10.0 ** rng.uniform(-3, 1, size=(M, 1))
    scale[0] = 1e-3  # mean x² ~ eps
    x = (rng.standard_normal((M, H)) * scale).astype(np.float32)
    norm_w = (rng.standard_normal(H) * 0.2).astype(np.float32)
    r = 1.0 / np.sqrt((x.astype(np.float64) ** 2).mean(-1) + EPS)                 # r: [M]
    a = acc_rows(rng, M, E, ld, r)
    raw = a[:M, :E + 1].astype(np.float32).astype(np.float64) * 2.0 ** -32      # what the kernel converts
    want_ids = np.argsort(-raw[:, :E], axis=-1, kind="stable")[:, :k]            # distinct values
    gu, gu_vals = bank(dev, fmt, E, 2 * I, H, want_ids.ravel(), rng)
    gate = {e: layout.deinterleave_gate_up(v[None])[0][0] for e, v in gu_vals.items()}
    launched = []
    monkeypatch.setattr(kernels, "launch", lambda name, *args, _l=kernels.launch, **kw: (launched.append(name),
                                                                                           _l(name, *args, **kw)))
    monkeypatch.setattr(moe, "GATE_UP_BLOCKS_PER_SM", blocks_per_sm)

    acc = put(dev, a)
    ids, w, ss, act = dev.empty(M * k * 4), dev.empty(M * k * 4), dev.empty(M * 4), dev.empty(M * k * I * 4)
    moe.gate_up_routed(kernels, gu, x=put(dev, x), norm_w=put(dev, norm_w), eps=EPS, logits=0, ld=ld, M=M, E=E,
                       top_k=k, ids=ids, weights=w, shared_scale=ss, act=act, acc=acc)
    b3 = blocks_per_sm == 3 and M > 1
    assert launched == [f"moe_gate_up_routed_acc_{'b3_' if b3 else ''}t2_{fmt}"]
    got_ids, got_w, got_ss = dev.get(ids, (M, k), np.int32), dev.get(w, (M, k)), dev.get(ss, (M,))
    np.testing.assert_array_equal(got_ids, want_ids, err_msg="ids differ from a stable arg-sort of acc's rows")

    L = raw * r[:, None]
    sel = np.take_along_axis(L[:, :E], want_ids, -1)
    want_w = np.exp(sel - sel[:, :1])
    want_w /= want_w.sum(-1, keepdims=True)
    spread = np.abs(sel - sel[:, :1]).max(-1, keepdims=True)
    assert_close("weights", got_w, want_w, (ROUTE_REL + 2 * NORM * spread) * want_w)
    want_ss = 1.0 / (1.0 + np.exp(-L[:, E]))
    assert_close("shared_scale", got_ss, want_ss,
                 2 * (NORM * np.abs(L[:, E]) * want_ss * (1 - want_ss) + ROUTE_REL * want_ss))
    h = norm_ref(x, norm_w)
    want_act, tol_act = act_oracle(h, gate, want_ids, I, DOT + NORM, codes(h.numpy())[1])
    assert_close(f"act [M, k, I] ({fmt})", dev.get(act, (M, k, I)), want_act, tol_act)
    assert np.array_equal(dev.get(acc, a.shape, np.int64), a), "gate_up_routed wrote to acc"

    dn, _ = bank(dev, "q5g64", E, H, I, want_ids.ravel(), rng)
    y0 = rng.standard_normal((M, H)).astype(np.float32)
    ys = []
    for zero in (0, acc):
        y = put(dev, y0)
        moe.down(kernels, dn, act=act, ids=ids, weights=w, M=M, top_k=k, y=y, acc=zero, acc_ld=ld if zero else 0)
        ys.append(dev.get(y, (M, H)))
    assert np.isfinite(ys[0]).all() and np.array_equal(ys[0].view(np.uint32), ys[1].view(np.uint32))
    after = dev.get(acc, a.shape, np.int64)
    assert not after[:M].any(), "moe.down left a row of acc unzeroed"
    assert np.array_equal(after[M], a[M]), "moe.down zeroed past its rows"


def test_acc_misuse_raises(kernels):
    """What the _acc entries cannot run is refused in one line, never launched."""
    from ninfer_rt.gpu import moe
    from ninfer_rt.gpu.driver import GpuError
    from ninfer_rt.gpu.weights import DeviceWeight
    ok = dict(x=16, norm_w=16, eps=1e-6, logits=0, ld=264, M=2, E=256, top_k=8, ids=1, weights=1, shared_scale=1,
              act=16, acc=8)
    for w in (DeviceWeight("b", "q6g64", (256, 1024, 2048), 1), DeviceWeight("b", "q4g64", (256, 1024, 64), 1)):
        assert not moe.acc_fits(w, 256)
        with pytest.raises(GpuError, match="routing on a router fold"):
            moe.gate_up_routed(kernels, w, **ok)
    with pytest.raises(GpuError, match="zeroing a router fold's acc"):
        moe.down(kernels, DeviceWeight("d", "bf16", (256, 2048, 512), 1), act=16, ids=1, weights=1, M=2, top_k=8,
                 y=1, acc=8, acc_ld=264)
