"""kernels/deltanet.cu against the reference DeltaNet ops, over several consecutive steps so the state carries.

Oracle: per sequence, exactly what ninfer_rt.reference.model.GatedDeltaNet does between its projections:
ops.causal_conv1d_step (T = 1) or ops.causal_conv1d, ops.gated_delta_rule_recurrent (the recurrent form is
the oracle for every T: the chunked form equals it and the kernels are recurrent), ops.gated_rms_norm; in
torch fp32 on the CPU, with the reference's own state tensors carried from step to step. The reference conv
state is [conv_dim, Kc-1]; the device one is [slots, Kc-1, conv_dim].

Tolerance: both sides compute in fp32 (the kernels with fast-math exp/rsqrt/division), so per-element
differences are ~1e-6 relative and do not grow with steps (the decay is <= 1). We allow
|got - ref| <= 1e-4 · (|ref| + rms(ref)): the rms floor stops near-zero elements from failing on absolute
noise. The conv state holds copies of inputs, so it must match bit for bit, and slots not in `slot` must be
left bit-for-bit untouched.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

RTOL = 1e-4
EPS = 1e-6  # rms_norm_eps of the family

DIMS = {
    "35b": dict(nk=16, nv=32, dk=128, dv=128, Kc=4),
    "tiny": dict(nk=2, nv=4, dk=16, dv=16, Kc=4),
    "gva3": dict(nk=2, nv=6, dk=32, dv=32, Kc=4),   # 3 value heads per key head, as the 27B
    "odd": dict(nk=1, nv=3, dk=64, dv=24, Kc=3),    # dv = 24: one warp per recurrent block; another conv width
    "narrow": dict(nk=1, nv=2, dk=128, dv=8, Kc=2),  # dv = 8: one warp per head; the smallest conv width
}


def conv_dim(d):
    return 2 * d["nk"] * d["dk"] + d["nv"] * d["dv"]


class Layer:
    """Random DeltaNet parameters and states on the host and device, plus the reference states per slot."""

    def __init__(self, dev, rng, d, slots: int, pad: int = 8):
        self.d, self.dev = d, dev
        nv, dk, dv, Kc = d["nv"], d["dk"], d["dv"], d["Kc"]
        self.cd = conv_dim(d)
        self.ld = self.cd + nv * dv + pad  # padding columns hold NaN: reading them would show
        self.conv_w = (rng.standard_normal((Kc, self.cd)) * 0.5).astype(np.float32)
        self.A_log = np.log(rng.uniform(0.05, 2.0, nv)).astype(np.float32)
        self.dt_bias = rng.normal(0.0, 0.5, nv).astype(np.float32)
        self.norm_w = (1.0 + 0.2 * rng.standard_normal(dv)).astype(np.float32)
        self.conv_state = rng.standard_normal((slots, Kc - 1, self.cd)).astype(np.float32)
        self.ssm_state = (rng.standard_normal((slots, nv, dk, dv)) * 0.3).astype(np.float32)
        self.p = {name: dev.put(getattr(self, name)) for name in
                  ("conv_w", "A_log", "dt_bias", "norm_w", "conv_state", "ssm_state")}

    def inputs(self, rng, M):
        mixed = rng.standard_normal((M, self.ld)).astype(np.float32)
        mixed[:, self.cd + self.d["nv"] * self.d["dv"]:] = np.nan
        ba = rng.standard_normal((M, 2 * self.d["nv"])).astype(np.float32)
        return mixed, ba

    def run(self, kernels, fn, mixed, ba, slot, B, T):
        """One device step; returns out [B·T, nv·dv]."""
        from ninfer_rt.gpu import deltanet
        d, dev = self.d, self.dev
        M = B * T
        out = dev.empty(M * d["nv"] * d["dv"] * 4)
        scratch = dev.empty(max(deltanet.decode_scratch_bytes(M, self.cd), 4))
        fn(kernels, mixed=dev.put(mixed), ld_mixed=self.ld, ba=dev.put(ba), conv_w=self.p["conv_w"],
           A_log=self.p["A_log"], dt_bias=self.p["dt_bias"], norm_w=self.p["norm_w"],
           conv_state=self.p["conv_state"], ssm_state=self.p["ssm_state"], slot=dev.put(np.asarray(slot, np.int32)),
           B=B, T=T, nk=d["nk"], nv=d["nv"], dk=d["dk"], dv=d["dv"], Kc=d["Kc"], eps=EPS, out=out,
           scratch=scratch)
        return dev.get(out, (M, d["nv"] * d["dv"]))

    def device_states(self):
        return (self.dev.get(self.p["conv_state"], self.conv_state.shape),
                self.dev.get(self.p["ssm_state"], self.ssm_state.shape))


def ref_step(L: Layer, mixed, ba, conv_st, ssm):
    """The reference for one sequence: mixed [T, ld], ba [T, 2nv], conv_st [conv_dim, Kc-1], ssm [nv, dk, dv]
    (torch fp32) -> y [T, nv·dv], new conv_st, new ssm."""
    import torch
    import torch.nn.functional as F
    from ninfer_rt.reference import ops
    d = L.d
    nk, nv, dk, dv = d["nk"], d["nv"], d["dk"], d["dv"]
    T = mixed.shape[0]
    x = torch.from_numpy(mixed[:, :L.cd].copy())
    z = torch.from_numpy(mixed[:, L.cd:L.cd + nv * dv].copy()).view(T, nv, dv)
    b, a = torch.from_numpy(ba[:, :nv].copy()), torch.from_numpy(ba[:, nv:].copy())
    beta = torch.sigmoid(b)
    g = -torch.from_numpy(L.A_log).exp() * F.softplus(a + torch.from_numpy(L.dt_bias))
    w = torch.from_numpy(L.conv_w.T.copy())                                     # w: [conv_dim, Kc]
    if T == 1:
        c, conv_st = ops.causal_conv1d_step(x[0], w, conv_st)
        c = c[None]
    else:
        c, conv_st = ops.causal_conv1d(x, w, conv_st)
    q, k, v = c.split([nk * dk, nk * dk, nv * dv], -1)
    o, ssm = ops.gated_delta_rule_recurrent(q.reshape(T, nk, dk), k.reshape(T, nk, dk), v.reshape(T, nv, dv),
                                            g, beta, ssm)
    y = ops.gated_rms_norm(o, z, torch.from_numpy(L.norm_w), EPS).reshape(T, nv * dv)
    return y.numpy(), conv_st, ssm


def assert_close(name, got, ref, rtol=RTOL):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    bad = ~np.isfinite(got)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        pytest.fail(f"{name}: {int(bad.sum())} non-finite values (unwritten or read padding?), first at {first}")
    floor = np.sqrt(np.mean(ref * ref)) + 1e-30
    err = np.abs(got - ref) / (np.abs(ref) + floor)
    if err.max() > rtol:
        w = np.unravel_index(int(np.argmax(err)), err.shape)
        pytest.fail(f"{name}: rel err {err.max():.2e} > {rtol:.0e} at {tuple(int(i) for i in w)}: "
                    f"got {got[w]:.7g}, ref {ref[w]:.7g}; {int((err > rtol).sum())} of {err.size} elements over")


def check_steps(kernels, dev, rng, dims, B, Ts, first=None, n_slots=None):
    """Run len(Ts) consecutive steps (step i has Ts[i] tokens per sequence) and check every output and state.
    Step 0 calls `first` (default deltanet.decode), later steps deltanet.decode."""
    import torch
    from ninfer_rt.gpu import deltanet
    d = DIMS[dims]
    n_slots = n_slots or B + 2
    slots = list(rng.permutation(n_slots)[:B])  # distinct, usually neither ordered nor contiguous
    L = Layer(dev, rng, d, n_slots)
    ref_conv = {s: torch.from_numpy(L.conv_state[s].T.copy()) for s in slots}   # reference layout [conv_dim, Kc-1]
    ref_ssm = {s: torch.from_numpy(L.ssm_state[s].copy()) for s in slots}
    for step, T in enumerate(Ts):
        mixed, ba = L.inputs(rng, B * T)
        fn = first if step == 0 and first is not None else deltanet.decode
        out = L.run(kernels, fn, mixed, ba, slots, B, T)
        conv_dev, ssm_dev = L.device_states()
        for b, s in enumerate(slots):
            rows = slice(b * T, (b + 1) * T)
            y, ref_conv[s], ref_ssm[s] = ref_step(L, mixed[rows], ba[rows], ref_conv[s], ref_ssm[s])
            where = f"{dims} B={B} step {step} (T={T}) seq {b} slot {s}"
            assert_close(f"out [{where}]", out[rows], y)
            ref_c = ref_conv[s].numpy().T
            if not np.array_equal(conv_dev[s], ref_c):
                diff = np.argwhere(conv_dev[s] != ref_c)[0]
                pytest.fail(f"conv_state [{where}]: differs at (row, channel) {tuple(int(i) for i in diff)}: "
                            f"got {conv_dev[s][tuple(diff)]}, ref {ref_c[tuple(diff)]}")
            assert_close(f"ssm_state [{where}]", ssm_dev[s], ref_ssm[s].numpy())
        for s in sorted(set(range(n_slots)) - set(slots)):
            assert np.array_equal(conv_dev[s], L.conv_state[s]), f"conv_state slot {s} (not in use) was written"
            assert np.array_equal(ssm_dev[s], L.ssm_state[s]), f"ssm_state slot {s} (not in use) was written"


@pytest.mark.parametrize("Ts", [(1, 1, 1), (4, 4), (8, 8), (1, 8, 3)], ids=lambda t: "T" + "-".join(map(str, t)))
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("dims", list(DIMS))
def test_decode(kernels, dev, rng, dims, B, Ts):
    check_steps(kernels, dev, rng, dims, B, Ts)


@pytest.mark.parametrize("B,Ts", [(1, (100, 1)), (3, (37, 2))], ids=["B1-T100", "B3-T37"])
@pytest.mark.parametrize("dims", ["35b", "tiny", "odd", "narrow"])
def test_decode_long(kernels, dev, rng, dims, B, Ts):
    """Long T through decode (the engine's prefill fallback): several double-buffered passes of 16 tokens, the
    last one partial, and the conv spread over chunks of 8 tokens."""
    check_steps(kernels, dev, rng, dims, B, Ts)


@pytest.mark.parametrize("T", [64, 130])
@pytest.mark.parametrize("dims", ["35b", "tiny"])
def test_prefill(kernels, dev, rng, dims, T):
    """prefill of one sequence across 64-token chunk boundaries, then a decode step from its state."""
    from ninfer_rt.gpu import deltanet
    check_steps(kernels, dev, rng, dims, 1, (T, 1), first=deltanet.prefill, n_slots=3)


def test_bad_arguments(kernels):
    from ninfer_rt.gpu import deltanet
    from ninfer_rt.gpu.driver import GpuError
    good = dict(mixed=1, ld_mixed=2 * 2 * 16 + 2 * 4 * 16, ba=1, conv_w=1, A_log=1, dt_bias=1, norm_w=1,
                conv_state=1, ssm_state=1, slot=1, B=1, T=1, nk=2, nv=4, dk=16, dv=16, Kc=4, eps=EPS, out=1,
                scratch=1)
    bad = [dict(dk=48), dict(dk=256), dict(nv=5), dict(dv=12), dict(Kc=1), dict(Kc=9), dict(B=0), dict(T=0),
           dict(ld_mixed=good["ld_mixed"] - 1), dict(out=0)]
    for change in bad:
        with pytest.raises(GpuError):
            deltanet.decode(kernels, **{**good, **change})
    with pytest.raises(GpuError):
        deltanet.prefill(kernels, **{**good, "B": 2})
