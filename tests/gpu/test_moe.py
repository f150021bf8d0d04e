"""kernels/moe.cu (ninfer_rt.gpu.moe) against ninfer_rt.reference.ops.moe, the routed part only.

Oracle: ops.moe with the shared expert's weights zero (so it returns the routed sum), torch fp32 on the CPU, on
the exact decoded values of random banks. The router logits fed to the device are computed by the same torch
expression ops.moe uses, so route ranks exactly the logits the oracle ranks. Each stage is also checked alone:
  route    ids equal torch.topk's exactly (inputs drawn without near-ties); weights and shared_scale within
           1e-6 relative: both sides are fp32 with exp to ~2 ulp, a division and short sums (< 8 ulp ~ 5e-7)
  gate_up  act against silu(x·g)·(x·u) in torch fp32, g/u from the de-interleaved bank
  down     y_after - y_before against Σ_j w_j · (W_j act_j) in float64 from the kernel's own act and weights;
           a second run from the same y must give the same bits (fixed summation order, no atomics)
  chain    y_after - y_before against ops.moe
Tolerance of a length-n dot product: two fp32 summation orders differ by ~sqrt(n)·u·Σ|w·x| in practice (45u at
n = 2048, u = 2^-24). We allow DOT·Σ|w·x| with DOT = 2^-15 (512u); one wrong element alone moves a dot by about
Σ|w·x|/n >= 2^-11·Σ|w·x|, 16x more. The fast paths (q banks at decode shapes, fast_gate_up / fast_down) take
x and act as int16 codes per 32 elements (ops.act_codes16): gate_up and down are checked against the oracle on
those codes (exact in fp32: the products are exact integers there), and the chain against ops.moe on exact
inputs with each element's code error (<= d / 2, d its chunk's scale) added to the bounds. These bounds are propagated through SwiGLU and the down projection in
float64 (act_bound, the chain bound). Experts not routed to hold 0xFF bytes (NaN scales), so reading the wrong
expert shows up as NaN. The helpers and oracles here are shared with test_moe_routed.py (the fused gate_up).
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.formats import K_ALIGN, get_format, round_up
from ninfer_rt.gpu.weights import DeviceWeight

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

U = 2.0 ** -24  # fp32 unit roundoff
DOT = 2.0 ** -15  # relative to Σ|w·x|, see the module docstring
SILU = 2.0 ** -17  # relative error of fast-math silu: __expf (<= 2 + 1.2|x| ulp for |x| < 40) and a division
ROUTE_REL = 1e-6
QFORMATS = [f"q{b}g{g}" for b in (4, 5, 6, 8) for g in (32, 64, 128)]


# ------------------------------------------------------------------------------------------ helpers

def put(dev, a: np.ndarray) -> int:
    """Upload on the test stream (ordered with the launches; dev.put's synchronous copy is not)."""
    a = np.ascontiguousarray(a)
    p = dev.empty(a.nbytes, poison=False)
    dev.gpu.upload(p, a, stream=dev.gpu.stream)
    return p


def bank(dev, fmt: str, E: int, N: int, K: int, experts, rng) -> tuple[DeviceWeight, dict[int, np.ndarray]]:
    """An [E, N, K] bank in `fmt` whose experts `experts` hold random values; every other expert's bytes are
    0xFF (NaN scales / NaN bf16). Returns the DeviceWeight and {e: exact float32 values [N, K]}."""
    f = get_format(fmt)
    experts = sorted(set(int(e) for e in experts))
    rows = len(experts) * N
    if f.is_quantized:
        kp = round_up(K, K_ALIGN)
        q = np.zeros((rows, kp), np.int8)
        q[:, :K] = rng.integers(f.qmin, f.qmax + 1, size=(rows, K), dtype=np.int8)
        sc = rng.uniform(0.5, 1.5, size=(rows, kp // f.group)) * rng.choice([-1.0, 1.0], size=(rows, kp // f.group))
        sc = (sc / f.offset).astype(np.float16)
        sc[:, (K + f.group - 1) // f.group:] = 0  # groups wholly in the padding
        buf = f.pack(q, sc)
    else:
        buf = f.encode((rng.standard_normal((rows, K)) * 0.5).astype(np.float32))
    vals = f.decode(buf, (rows, K))
    full = (E, N, K)
    base = dev.empty(f.nbytes(full))  # poisoned, on the same stream as the uploads below
    for ps, pf in zip(f.planes((rows, K)), f.planes(full)):
        assert ps.name == pf.name
        row_bytes = ps.nbytes // rows
        src = buf[ps.offset:ps.offset + ps.nbytes].reshape(rows, row_bytes)
        for i, e in enumerate(experts):
            dev.gpu.upload(base + pf.offset + e * N * row_bytes, src[i * N:(i + 1) * N], stream=dev.gpu.stream)
    return DeviceWeight(f"bank{list(full)}", fmt, full, base), {e: vals[i * N:(i + 1) * N] for i, e in
                                                                 enumerate(experts)}


def assert_close(what: str, got, want, tol) -> None:
    """|got - want| <= tol elementwise (NaN fails); the message names the worst element and how many failed."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tol = np.broadcast_to(np.asarray(tol, np.float64), got.shape)
    err = np.abs(got - want)
    bad = ~(err <= tol)
    if bad.any():
        score = np.where(np.isnan(err), np.inf, err / np.maximum(tol, 1e-300))
        i = tuple(int(v) for v in np.unravel_index(int(np.argmax(score)), got.shape))
        pytest.fail(f"{what}: {int(bad.sum())} of {bad.size} elements out of tolerance "
                    f"({int(np.isnan(got).sum())} NaN); worst at {list(i)}: got {float(got[i]):.8g}, "
                    f"want {float(want[i]):.8g}, |diff| {float(err[i]):.3g} > tol {float(tol[i]):.3g}")


def ref_routing(logits: "torch.Tensor", top_k: int):
    """ops.moe's routing on fp32 logits [M, E]: (ids [M, k] int64, weights [M, k] float32)."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, e = torch.topk(probs, top_k, dim=-1)
    return e.numpy(), (w / w.sum(-1, keepdim=True)).numpy()


INVALID = 0x7FFFFFFF  # route_row's id when no candidate is left (all remaining logits NaN)


def stable_topk_ids(logits: np.ndarray, top_k: int) -> np.ndarray:
    """The routing's ids as a stable arg-sort gives them, for logits [M, E] (int64 [M, top_k]): larger first,
    equal values by lower index, ±0 and subnormals as one value (the kernels flush them), NaN never picked
    (INVALID in the slots left without a candidate)."""
    flushed = np.where(np.abs(logits) < np.finfo(np.float32).tiny, 0, logits)
    order = np.argsort(-flushed, axis=-1, kind="stable")[:, :top_k]  # NaN sorts last
    return np.where(np.isnan(np.take_along_axis(flushed, order, -1)), INVALID, order)


def well_separated(logits: np.ndarray, top_k: int, rel: float = 1e-4) -> bool:
    """True when the top k+1 softmax probabilities of every row differ pairwise by more than `rel`, so the
    device's and torch's rounding cannot order them differently."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    s = -np.sort(-p, axis=-1)[:, :min(top_k + 1, p.shape[1])]
    return bool(np.all(s[:, :-1] - s[:, 1:] > rel * s[:, :-1]))


def routed_case(dev, rng, dims: str, fmt_gu: str, fmt_down: str, draw, router_scale: float = 1.0) -> dict:
    """A routing problem and its banks: router and shared-gate weights (N(0, router_scale²)), inputs from draw()
    -> (h, extra), redrawn until no two of the top k+1 logits nearly tie, the torch routing of those logits (the
    expression ops.moe evaluates), and gate/up and down banks holding exactly the chosen experts."""
    from ninfer_rt import layout
    E, k, I, H = DIMS[dims]
    router_w = torch.from_numpy((rng.standard_normal((E, H)) * router_scale).astype(np.float32))
    sg_w = torch.from_numpy((rng.standard_normal((1, H)) * router_scale).astype(np.float32))
    for _ in range(50):
        h, extra = draw()
        logits = h @ router_w.T
        if well_separated(logits.numpy(), k):
            break
    else:
        pytest.fail("could not draw router inputs without near-ties")
    ids, w = ref_routing(logits, k)
    gu, gu_vals = bank(dev, fmt_gu, E, 2 * I, H, ids.ravel(), rng)
    dn, dn_vals = bank(dev, fmt_down, E, H, I, ids.ravel(), rng)
    return dict(h=h, extra=extra, router_w=router_w, sg_w=sg_w, ids=ids, w=w, gu=gu, dn=dn, dn_vals=dn_vals,
                gate={e: layout.deinterleave_gate_up(v[None])[0][0] for e, v in gu_vals.items()},  # [2I, H]
                fused=np.concatenate([logits.numpy(), (h @ sg_w.T).numpy()], axis=1))  # [M, E+1]


def fast_gate_up(fmt: str, H: int) -> bool:
    """Whether moe.gate_up[_routed] takes its fast path (int16 x codes) for this bank (moe.py FAST_T; aligned x)."""
    from ninfer_rt.gpu.moe import FAST_T
    return fmt != "bf16" and H % 1024 == 0 and H // 1024 in FAST_T


def fast_down(fmt: str, I: int) -> bool:
    """Whether moe.down takes its fast path (int16 act codes) for this bank (moe.py FAST_T; aligned act)."""
    from ninfer_rt.gpu.moe import FAST_T
    return fmt != "bf16" and I % 512 == 0 and I // 512 in FAST_T


def codes(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """a (fp32 [..., n], n % 32 == 0) as the fast paths multiply it: its int16 codes times their chunk scale d
    (ops.act_codes16; exact in fp32), and d per element (float64): every element is within d / 2 of a."""
    from ninfer_rt.reference.ops import act_codes16
    q, d = act_codes16(torch.from_numpy(np.ascontiguousarray(a, np.float32)))
    dd = np.repeat(d.numpy().astype(np.float64), 32, axis=-1)
    return (q.numpy() * dd).astype(np.float32), dd


def act_bound(x, g, u, dot: float = DOT, ex=None):
    """float64 bound on |act_device - act_ref| for act = silu(g·x)·(u·x), g, u [I, H], x [H], when each dot may
    be off by dot·Σ|w·x| and each element of x by ex [H] (absolute; None: 0)."""
    gx, ux = g.astype(np.float64) @ x, u.astype(np.float64) @ x
    dg, du = dot * (np.abs(g) @ np.abs(x)), dot * (np.abs(u) @ np.abs(x))
    if ex is not None:
        dg, du = dg + np.abs(g) @ ex, du + np.abs(u) @ ex
    sg = gx / (1 + np.exp(-gx))
    # |silu'| <= 1.1 everywhere
    return 1.1 * np.abs(ux) * dg + np.abs(sg) * du + SILU * np.abs(sg * ux) + dg * du


def act_oracle(h: "torch.Tensor", gate: dict, ids: np.ndarray, I: int, dot: float = DOT, ex=None):
    """torch fp32 act [M, k, I] = silu(h_m·g)·(h_m·u) of experts ids[m, j] (gate: {e: de-interleaved [2I, H]})
    and its act_bound [M, k, I] (ex: [M, H] absolute error of the kernel's h, or None)."""
    M, k = ids.shape
    x = h.numpy().astype(np.float64)
    want, tol = np.empty((M, k, I), np.float32), np.empty((M, k, I))
    for m in range(M):
        for j in range(k):
            g, u = gate[int(ids[m, j])][:I], gate[int(ids[m, j])][I:]
            gt, ut = torch.from_numpy(g), torch.from_numpy(u)
            want[m, j] = (torch.nn.functional.silu(h[m:m + 1] @ gt.T) * (h[m:m + 1] @ ut.T))[0].numpy()
            tol[m, j] = act_bound(x[m], g, u, dot, None if ex is None else ex[m])
    return want, tol


def routed_oracle(h, router_w, sg_w, gate: dict, dn_vals: dict, top_k: int) -> np.ndarray:
    """ops.moe(h, ...) with the shared expert's weights zero: the routed sum [M, H]. Only the experts in `gate`
    hold values; ops.moe reads no other (the callers check its routing equal to theirs)."""
    from ninfer_rt.reference import ops
    E, H = router_w.shape
    two_i, I = next(iter(gate.values())).shape[0], next(iter(dn_vals.values())).shape[1]
    # torch.empty leaves the pages of the experts not routed to untouched instead of writing 3 GB of zeros
    gate_up_full, down_full = torch.empty(E, two_i, H), torch.empty(E, H, I)
    for e in gate:
        gate_up_full[e] = torch.from_numpy(gate[e])
        down_full[e] = torch.from_numpy(dn_vals[e])
    Is = 32
    return ops.moe(h, router_w, gate_up_full, down_full, top_k, torch.zeros(Is, H), torch.zeros(Is, H),
                   torch.zeros(H, Is), sg_w).numpy()


def chain_tol(y1, ids, w, act, tol_act, dn_vals: dict, act_err=None) -> np.ndarray:
    """Bound on |(y_after - y_before) - routed_oracle| [M, H]: the act error propagated through |W|, the down
    dots' own error (and act_err [M, k, I], the fast down's code error), the weights' ROUTE_REL and the
    rounding of y += total."""
    tol = 2 * U * np.abs(y1)
    M, k = ids.shape
    for m in range(M):
        for j in range(k):
            D = dn_vals[int(ids[m, j])].astype(np.float64)
            a = act[m, j].astype(np.float64)
            err = tol_act[m, j] if act_err is None else tol_act[m, j] + act_err[m, j]
            tol[m] += abs(float(w[m, j])) * (DOT * (np.abs(D) @ np.abs(a)) + np.abs(D) @ err
                                             + 2 * ROUTE_REL * np.abs(D @ a))
    return tol


# ------------------------------------------------------------------------------------------ route

ROUTE_CASES = [(8, 2, 1), (16, 4, 13), (256, 8, 1), (256, 8, 64), (512, 16, 5), (512, 1, 3), (3, 3, 2)]


@pytest.mark.parametrize("E,top_k,M", ROUTE_CASES)
def test_route(kernels, dev, rng, E, top_k, M):
    from ninfer_rt.gpu import moe
    pad = 3
    ld = E + 1 + pad
    logits = np.empty((M, ld), np.float32)
    # distinct logits 0.05 apart (no near-ties), shifted per row to exercise the max subtraction
    logits[:, :E] = np.stack([rng.permutation(E) * 0.05 + rng.uniform(-20, 20) for _ in range(M)])
    row_max = logits[:, :E].max(-1)
    # shared gate above every router logit on even rows: a kernel that ranked column E would pick it
    logits[:, E] = np.where(np.arange(M) % 2 == 0, row_max + rng.uniform(0.5, 3, M), rng.uniform(-8, 8, M))
    logits[:, E + 1:] = 1e30  # padding columns: must never be read as logits
    ids, w, ss = dev.empty(M * top_k * 4), dev.empty(M * top_k * 4), dev.empty(M * 4)
    moe.route(kernels, logits=put(dev, logits), ld=ld, M=M, E=E, top_k=top_k, ids=ids, weights=w, shared_scale=ss)
    want_ids, want_w = ref_routing(torch.from_numpy(logits[:, :E]), top_k)
    got_ids = dev.get(ids, (M, top_k), np.int32)
    np.testing.assert_array_equal(got_ids, want_ids, err_msg="route ids differ from torch.topk")
    assert_close("route weights", dev.get(w, (M, top_k)), want_w, ROUTE_REL * np.abs(want_w))
    want_ss = torch.sigmoid(torch.from_numpy(logits[:, E])).numpy()
    assert_close("shared_scale", dev.get(ss, (M,)), want_ss, ROUTE_REL * np.abs(want_ss))


def test_route_ties(kernels, dev, rng):
    """Equal logits: larger first, then lower index; weights = softmax over the chosen ones."""
    from ninfer_rt.gpu import moe
    E, top_k = 64, 8
    logits = np.zeros((4, E + 1), np.float32)
    logits[1, :E] = rng.integers(0, 3, E)  # many exact ties
    logits[2, :E] = 50.0
    logits[3, :E] = rng.integers(-2, 2, E) * 0.5 - 30.0
    M = logits.shape[0]
    ids, w, ss = dev.empty(M * top_k * 4), dev.empty(M * top_k * 4), dev.empty(M * 4)
    moe.route(kernels, logits=put(dev, logits), ld=E + 1, M=M, E=E, top_k=top_k, ids=ids, weights=w, shared_scale=ss)
    want_ids = stable_topk_ids(logits[:, :E], top_k)
    sel = np.take_along_axis(logits[:, :E].astype(np.float64), want_ids, -1)
    want_w = np.exp(sel - sel[:, :1])
    want_w /= want_w.sum(-1, keepdims=True)
    np.testing.assert_array_equal(dev.get(ids, (M, top_k), np.int32), want_ids, err_msg="tie order")
    assert_close("route weights (ties)", dev.get(w, (M, top_k)), want_w, ROUTE_REL * want_w)
    assert_close("shared_scale sigmoid(0)", dev.get(ss, (M,)), 0.5, 0.5 * ROUTE_REL)


# ------------------------------------------------------------------------------------------ the whole routed MoE

DIMS = {  # E, top_k, I, H
    "35b": (256, 8, 512, 2048),
    "tiny": (8, 2, 32, 64),
    "tiny4": (16, 4, 64, 64),
    "odd": (12, 3, 96, 160),  # 3 and 5 chunks of 32: lane groups of 4 and 8 with idle lanes
    "mid": (16, 4, 1024, 1024),  # fast paths at T = 1 (gate_up, H = 1024) and T = 2 (down, I = 1024)
    "fused1": (64, 4, 512, 1024),  # test_moe_fused: moe_fused at T = 1
}
# "35b" and "mid" take the fast paths of q formats (gate_up H = 1024·T, down I = 512·T); the rest the general ones
CASES = ([("35b", 1, "q4g64", "q5g64"), ("35b", 4, "q4g64", "q6g64"), ("35b", 4, "q4g32", "q5g64"),
          ("35b", 1, "q8g32", "q8g32"), ("35b", 8, "q5g128", "q4g128"), ("35b", 2, "q6g32", "q8g64"),
          ("mid", 3, "q4g64", "q5g64"), ("mid", 8, "q8g128", "q6g128"), ("mid", 1, "q6g64", "q8g32")]
         + [(dims, M, fmt, fmt) for fmt in QFORMATS + ["bf16"]
            for dims, M in (("tiny", 1), ("tiny4", 8), ("odd", 13))])


@pytest.mark.parametrize("dims,M,fmt_gu,fmt_down", CASES)
def test_moe(kernels, dev, rng, dims, M, fmt_gu, fmt_down):
    from ninfer_rt.gpu import moe
    E, k, I, H = DIMS[dims]
    c = routed_case(dev, rng, dims, fmt_gu, fmt_down, lambda: (
        torch.from_numpy((rng.standard_normal((M, H)) * (2 / np.sqrt(H))).astype(np.float32)), None))
    h, router_w, sg_w, want_ids, want_w, gu, dn, dn_vals, gate = (
        c[n] for n in ("h", "router_w", "sg_w", "ids", "w", "gu", "dn", "dn_vals", "gate"))
    # route
    ids, w, ss = dev.empty(M * k * 4), dev.empty(M * k * 4), dev.empty(M * 4)
    moe.route(kernels, logits=put(dev, c["fused"]), ld=E + 1, M=M, E=E, top_k=k, ids=ids, weights=w, shared_scale=ss)
    got_ids = dev.get(ids, (M, k), np.int32)
    np.testing.assert_array_equal(got_ids, want_ids, err_msg="route ids differ from torch.topk")
    got_w = dev.get(w, (M, k))
    assert_close("route weights", got_w, want_w, ROUTE_REL * np.abs(want_w))
    want_ss = torch.sigmoid(h @ sg_w.T).numpy()[:, 0]
    assert_close("shared_scale", dev.get(ss, (M,)), want_ss, ROUTE_REL * np.abs(want_ss))

    # gate_up (the fast path on the int16 codes of h, exactly as it multiplies them)
    act = dev.empty(M * k * I * 4)
    moe.gate_up(kernels, gu, x=put(dev, h.numpy()), M=M, ids=ids, top_k=k, act=act)
    got_act = dev.get(act, (M, k, I))
    fast_gu, fast_dn = fast_gate_up(fmt_gu, H), fast_down(fmt_down, I)
    h_codes, h_d = codes(h.numpy())
    want_act, tol_act = act_oracle(torch.from_numpy(h_codes) if fast_gu else h, gate, want_ids, I)
    assert_close(f"gate_up act [M, k, I] ({fmt_gu})", got_act, want_act, tol_act)
    a_codes, a_d = codes(got_act)

    # down: on the kernel's own act and weights, then the chain against ops.moe
    y0 = rng.standard_normal((M, H)).astype(np.float32)
    y = put(dev, y0)
    moe.down(kernels, dn, act=act, ids=ids, weights=w, M=M, top_k=k, y=y)
    y1 = dev.get(y, (M, H))
    diff = y1.astype(np.float64) - y0  # exact in float64
    want_down = np.zeros((M, H))
    scale_down = np.zeros((M, H))
    for m in range(M):
        for j in range(k):
            D = dn_vals[int(want_ids[m, j])].astype(np.float64)
            a = (a_codes if fast_dn else got_act)[m, j].astype(np.float64)
            want_down[m] += got_w[m, j] * (D @ a)
            scale_down[m] += abs(got_w[m, j]) * (np.abs(D) @ np.abs(a))
    # one fp32 rounding of y += total, |δ| <= u·|y_after|
    assert_close(f"down y_after - y_before ({fmt_down})", diff, want_down, DOT * scale_down + 2 * U * np.abs(y1))

    y_again = put(dev, y0)
    moe.down(kernels, dn, act=act, ids=ids, weights=w, M=M, top_k=k, y=y_again)
    np.testing.assert_array_equal(dev.get(y_again, (M, H)), y1, err_msg="down is not deterministic")

    # with the shared expert's output added in the same pass: fma(scale_m, extra, y + routed), where y + routed
    # is the bits above (same kernel, same order), so one fp32 rounding: |δ| <= u·|result|
    extra = rng.standard_normal((M, H)).astype(np.float32)
    escale = rng.uniform(0, 1, M).astype(np.float32)
    y_ex = put(dev, y0)
    moe.down(kernels, dn, act=act, ids=ids, weights=w, M=M, top_k=k, y=y_ex, extra=put(dev, extra),
             extra_scale=put(dev, escale))
    got_ex = dev.get(y_ex, (M, H))
    want_ex = y1.astype(np.float64) + escale[:, None].astype(np.float64) * extra
    assert_close(f"down + extra ({fmt_down})", got_ex, want_ex, U * np.abs(want_ex) * (1 + 2.0 ** -20))

    # ops.moe reads only the experts it routes to (checked equal to ours above)
    routed = routed_oracle(h, router_w, sg_w, gate, dn_vals, k)
    exact_act, exact_tol = act_oracle(h, gate, want_ids, I, ex=h_d / 2 if fast_gu else None)
    assert_close(f"routed MoE vs ops.moe ({fmt_gu}/{fmt_down})", diff, routed,
                 chain_tol(y1, want_ids, want_w, exact_act, exact_tol, dn_vals, a_d / 2 if fast_dn else None))


@pytest.mark.parametrize("fmt, M, extra", [("q5g64", 2, True), ("q6g64", 3, False)])
def test_down_three_blocks_per_sm(kernels, dev, rng, monkeypatch, fmt, M, extra):
    """moe_down_b3_t1 (several rows: the same source at three blocks an SM) gives moe_down_t1's bits on the 35B's
    down bank, the shared expert's extra term included; row 1 holds an expert id out of range, which makes exactly
    that row NaN. (test_moe checks moe_down_t1 against the oracle.)"""
    from ninfer_rt.gpu import moe
    E, k, I, H = DIMS["35b"]
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(M)]).astype(np.int32)
    dn, _ = bank(dev, fmt, E, H, I, ids.ravel(), rng)
    ids[1, 3] = E
    ids_d, w = put(dev, ids), put(dev, rng.uniform(0, 1, (M, k)).astype(np.float32))
    act = put(dev, (rng.standard_normal((M, k, I)) * 0.1).astype(np.float32))
    y0 = rng.standard_normal((M, H)).astype(np.float32)
    ex = dict(extra=put(dev, rng.standard_normal((M, H)).astype(np.float32)),
              extra_scale=put(dev, rng.uniform(0, 1, M).astype(np.float32))) if extra else {}
    launched = []
    monkeypatch.setattr(kernels, "launch", lambda name, *a, _l=kernels.launch, **kw: (launched.append(name),
                                                                                        _l(name, *a, **kw)))
    out = []
    for blocks_per_sm in (2, 3):
        monkeypatch.setattr(moe, "DOWN_BLOCKS_PER_SM", blocks_per_sm)
        y = put(dev, y0)
        moe.down(kernels, dn, act=act, ids=ids_d, weights=w, M=M, top_k=k, y=y, **ex)
        out.append(dev.get(y, (M, H)))
    assert launched == [f"moe_down_t1_{fmt}", f"moe_down_b3_t1_{fmt}"]
    assert np.isnan(out[1][1]).all() and np.isfinite(np.delete(out[1], 1, 0)).all()
    np.testing.assert_array_equal(out[1].view(np.uint32), out[0].view(np.uint32),
                                  err_msg="moe_down_b3_t1 differs from moe_down_t1's bits")


# ------------------------------------------------------------------------------------------ misuse

@pytest.mark.parametrize("I,H", [(32, 64), (512, 1024)])  # general paths; fast paths (q formats, T = 1)
def test_bad_ids_give_nan(kernels, dev, rng, I, H):
    """An expert id outside [0, E) (-1 and E; experts 4..E-1 hold 0xFF bytes) poisons exactly its outputs: gate_up's
    act rows of the bad ids, and down's rows holding one. Down is checked twice: on gate_up's act (whose bad rows
    are NaN already) and alone on finite act, weights and y0, where only its own id check can make rows 1 and 2
    NaN; its good row 0 must then be y0 + Σ_j w_j·(D_{e_j} @ a_j) within test_moe's down bound (a: the int16
    codes of act on the fast path, I = 512)."""
    from ninfer_rt.gpu import moe
    E, k, M = 8, 2, 3
    gu, _ = bank(dev, "q4g32", E, 2 * I, H, range(4), rng)
    dn, dn_vals = bank(dev, "q5g64", E, H, I, range(4), rng)
    ids_np = np.array([[0, 1], [-1, 2], [3, E]], np.int32)
    ids = put(dev, ids_np)
    act = dev.empty(M * k * I * 4)
    moe.gate_up(kernels, gu, x=put(dev, rng.standard_normal((M, H)).astype(np.float32)), M=M, ids=ids, top_k=k,
                act=act)
    a = dev.get(act, (M, k, I))
    bad = np.array([[False, False], [True, False], [False, True]])
    assert np.isnan(a[bad]).all() and np.isfinite(a[~bad]).all()
    y = put(dev, np.zeros((M, H), np.float32))
    moe.down(kernels, dn, act=act, ids=ids, weights=put(dev, np.full((M, k), 0.5, np.float32)), M=M, top_k=k, y=y)
    got = dev.get(y, (M, H))
    assert np.isfinite(got[0]).all() and np.isnan(got[1:]).all()

    # down alone on finite inputs: rows 1 and 2 NaN from its own id check, row 0 the exact-value oracle
    act2 = rng.standard_normal((M, k, I)).astype(np.float32)
    w2 = rng.uniform(0.1, 1, (M, k)).astype(np.float32)
    y0 = rng.standard_normal((M, H)).astype(np.float32)
    y2 = put(dev, y0)
    moe.down(kernels, dn, act=put(dev, act2), ids=ids, weights=put(dev, w2), M=M, top_k=k, y=y2)
    got2 = dev.get(y2, (M, H))
    assert np.isnan(got2[1:]).all(), "down did not poison the rows of bad ids (finite act)"
    a = (codes(act2)[0] if fast_down(dn.fmt, I) else act2).astype(np.float64)
    want, scale = np.zeros(H), np.zeros(H)
    for j in range(k):
        D = dn_vals[int(ids_np[0, j])].astype(np.float64)
        want += float(w2[0, j]) * (D @ a[0, j])
        scale += abs(float(w2[0, j])) * (np.abs(D) @ np.abs(a[0, j]))
    # as test_moe's down: DOT relative to Σ|w·D·a|, plus one fp32 rounding of y += total
    assert_close(f"down row 0 beside bad ids (I = {I})", got2[0].astype(np.float64) - y0[0], want,
                 DOT * scale + 2 * U * np.abs(got2[0]))


def test_misuse_raises(kernels):
    from ninfer_rt.gpu import moe
    from ninfer_rt.gpu.driver import GpuError
    bank3 = DeviceWeight("b", "q4g64", (8, 64, 64), 1)
    with pytest.raises(GpuError, match="expert bank"):
        moe.gate_up(kernels, DeviceWeight("b", "q4g64", (64, 64), 1), x=1, M=1, ids=1, top_k=2, act=1)
    with pytest.raises(GpuError, match="top_k"):
        moe.gate_up(kernels, bank3, x=1, M=1, ids=1, top_k=17, act=1)
    with pytest.raises(GpuError, match="fp32"):
        moe.down(kernels, DeviceWeight("b", "fp32", (8, 64, 64), 1), act=1, ids=1, weights=1, M=1, top_k=2, y=1)
    with pytest.raises(GpuError, match="multiples of 32"):
        moe.down(kernels, DeviceWeight("b", "q4g64", (8, 64, 48), 1), act=1, ids=1, weights=1, M=1, top_k=2, y=1)
    with pytest.raises(GpuError, match="extra"):
        moe.down(kernels, DeviceWeight("b", "q4g64", (8, 64, 64), 1), act=1, ids=1, weights=1, M=1, top_k=2, y=1,
                 extra=1)
    with pytest.raises(GpuError, match="ld"):
        moe.route(kernels, logits=1, ld=8, M=1, E=8, top_k=2, ids=1, weights=1, shared_scale=1)
    with pytest.raises(GpuError, match="null"):
        moe.route(kernels, logits=0, ld=9, M=1, E=8, top_k=2, ids=1, weights=1, shared_scale=1)
