"""kernels/deltanet.cu and deltanet_chunked.cu against the reference DeltaNet ops, over several consecutive
steps so the state carries.

Oracle: per sequence, exactly what ninfer_rt.reference.model.GatedDeltaNet does between its projections:
ops.causal_conv1d_step (T = 1) or ops.causal_conv1d, ops.gated_delta_rule_recurrent (the recurrent form is the
oracle for every T: the chunked form equals it, so the chunked prefill kernel must too), ops.gated_rms_norm; in
torch fp32 on the CPU, with the reference's own state tensors carried from step to step. The reference conv state
is [conv_dim, Kc-1]; the device one is a ring [slots, ring, conv_dim] holding position p in row p % ring
(positions < 0 read as zero). `deltanet.step` (one launch for T <= 8) also computes b|a from the layer input: its
oracle is ops.rms_norm_zc(x) @ W_baᵀ in torch fp32 on the exact bf16 weights, then the same chain.

Positions: check_steps puts one sequence where its conv window reaches below position 0 (pos < Kc - 1: those
taps must read zero while the ring rows they map to hold random values) and, at B > 1, another just past a whole
number of ring turns (pos = k·ring + r, r < Kc - 1: it reads the ring's last row, then writes from row r on).

Tolerance: both sides compute in fp32 (the kernels with fast-math exp/rsqrt/division), so per-element differences
are ~1e-6 relative and do not grow with steps (the decay is <= 1). We allow |got - ref| <= 1e-4 · (|ref| +
rms(ref)): the rms floor stops near-zero elements from failing on absolute noise. The chunked prefill sums in a
different order (dot products over a chunk, a forward substitution through (I + A)): emulated in fp32 against the
float64 recurrent form it stays below 3e-6 relative on these shapes, inside the same bound. Its state kernel forms
the products with S on tensor cores in 3xTF32 (each operand split into two tf32 terms, the lo·lo product dropped):
~2^-21 relative per product against fp32's 2^-24, so the sums stay within ~1e-6 relative, still far inside 1e-4.
The conv state holds copies of inputs, so it must match bit for bit, ring rows a step does not own must keep their
bits, and slots not in `slot` must be left bit-for-bit untouched. For `step`, b|a differ from the oracle's by the
order of a length-H fp32 dot (~sqrt(H)·2^-24 relative to the sum of its terms' magnitudes: < 1e-5), which moves β
and e^g by less than that and stays well inside the same 1e-4. x's rows are scaled by 10^U(-4, 1), so that eps_in
matters in the rows whose mean square falls near or below it (the relative bounds do not depend on the scale).
Why not 1e-5: the figures above are typical sizes, not worst cases with a margin. The chunked form's 3e-6 is
against the float64 recurrent form while the oracle here is the fp32 one (its own ~1e-6 adds: ~4e-6, a 2.5x
margin); rounding errors in S decay only by e^g, within 1% of 1 for some heads here (A_log down to log 0.05), so
the errors of many tokens add up over long T; and the step's b|a term is itself bounded only by "< 1e-5". None
leaves a 3x margin under 1e-5, so RTOL stays 1e-4; every check prints its measured worst relative error (pytest
-s or -rP shows it) so that the bound can be set from data.
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.gpu.deltanet import STEP_CLUSTER

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
STEP_DIMS = {**DIMS, "27b": dict(nk=16, nv=48, dk=128, dv=128, Kc=4)}  # the fused step's tests add the 27B's


def conv_dim(d):
    return 2 * d["nk"] * d["dk"] + d["nv"] * d["dv"]


def ring_window(ring: np.ndarray, pos: int, Kc: int) -> np.ndarray:
    """The reference conv state [conv_dim, Kc-1] (oldest first) held by a device ring [rows, conv_dim] before
    position pos: positions pos-Kc+1 .. pos-1, zero below 0."""
    rows = []
    for p in range(pos - Kc + 1, pos):
        rows.append(ring[p % ring.shape[0]] if p >= 0 else np.zeros(ring.shape[1], np.float32))
    return np.stack(rows, 1)


class Layer:
    """Random DeltaNet parameters and states on the host and device, plus the reference states per slot."""

    def __init__(self, dev, rng, d, slots: int, pad: int = 8, H: int = 256):
        from ninfer_rt.formats import bf16_bits_to_f32, f32_to_bf16_bits
        from ninfer_rt.gpu.deltanet import ring_rows
        self.d, self.dev, self.H = d, dev, H
        nv, dk, dv, Kc = d["nv"], d["dk"], d["dv"], d["Kc"]
        self.cd = conv_dim(d)
        self.ring = ring_rows(Kc)
        self.ld = self.cd + nv * dv + pad  # padding columns hold NaN: reading them would show
        self.conv_w = (rng.standard_normal((Kc, self.cd)) * 0.5).astype(np.float32)
        self.A_log = np.log(rng.uniform(0.05, 2.0, nv)).astype(np.float32)
        self.dt_bias = rng.normal(0.0, 0.5, nv).astype(np.float32)
        self.norm_w = (1.0 + 0.2 * rng.standard_normal(dv)).astype(np.float32)
        self.conv_state = rng.standard_normal((slots, self.ring, self.cd)).astype(np.float32)
        self.ssm_state = (rng.standard_normal((slots, nv, dk, dv)) * 0.3).astype(np.float32)
        # where each slot's sequence stands (edge_positions puts the used ones at the ring's edges)
        self.pos = [int(p) for p in rng.integers(0, 3 * self.ring, slots)]
        # the step's extras: the layer's input norm and the fused b|a projection (bf16 [2nv, H])
        self.in_norm_w = (0.1 * rng.standard_normal(H)).astype(np.float32)
        self.w_ba_bits = f32_to_bf16_bits((rng.standard_normal((2 * nv, H)) / np.sqrt(H)).astype(np.float32))
        self.w_ba = bf16_bits_to_f32(self.w_ba_bits)
        self.p = {name: dev.put(getattr(self, name)) for name in
                  ("conv_w", "A_log", "dt_bias", "norm_w", "conv_state", "ssm_state", "in_norm_w", "w_ba_bits")}

    def edge_positions(self, rng, slots) -> None:
        """Sequence slots[0] at pos in [0, Kc - 2], so its window reads Kc - 1 - pos positions < 0 (zeros, though
        their ring rows hold random values; Kc = 2 included); with two or more, slots[1] at k·ring + r (k in {1, 2},
        r in [0, Kc - 2]), whose window includes the ring's last row and whose new positions start at row r, after
        the wrap."""
        Kc = self.d["Kc"]
        self.pos[slots[0]] = int(rng.integers(0, Kc - 1))
        if len(slots) > 1:
            self.pos[slots[1]] = self.ring * int(rng.integers(1, 3)) + int(rng.integers(0, Kc - 1))

    def inputs(self, rng, M, fused: bool):
        """mixed [M, ld] and ba [M, 2nv]; for the fused step also x [M, H], with ba its oracle b|a."""
        import torch
        from ninfer_rt.reference import ops
        mixed = rng.standard_normal((M, self.ld)).astype(np.float32)
        mixed[:, self.cd + self.d["nv"] * self.d["dv"]:] = np.nan
        if not fused:
            return mixed, rng.standard_normal((M, 2 * self.d["nv"])).astype(np.float32), None
        # rows from tiny (mean x² far below eps_in: the eps matters) to large, as test_misc's test_rms_norm
        x = (rng.standard_normal((M, self.H)) * 10.0 ** rng.uniform(-4, 1, (M, 1))).astype(np.float32)
        h = ops.rms_norm_zc(torch.from_numpy(x), torch.from_numpy(self.in_norm_w), EPS)
        ba = (h @ torch.from_numpy(self.w_ba).T).numpy()
        return mixed, ba, x

    def run(self, kernels, mode, mixed, ba, x, slot, B, T, cluster=None, ba_early=None, records_order=0, trail=0):
        """One device step (mode: decode, prefill or step) of B sequences in `slot`; returns out [B·T, nv·dv].
        cluster, ba_early: the step's blocks per head and b|a position (None: deltanet.step's own choice);
        records_order (step): also out_proj's x̂ records of out in that order, kept in self.records; trail (step):
        the device buffer deltanet.step keeps each token's state in."""
        from ninfer_rt.gpu import deltanet
        from ninfer_rt.gpu.linear import x_chunk_bytes
        from ninfer_rt.gpu.weights import DeviceWeight
        d, dev = self.d, self.dev
        M = B * T
        out = dev.empty(M * d["nv"] * d["dv"] * 4)
        common = dict(mixed=dev.put(mixed), ld_mixed=self.ld, conv_w=self.p["conv_w"], A_log=self.p["A_log"],
                      dt_bias=self.p["dt_bias"], norm_w=self.p["norm_w"], conv_state=self.p["conv_state"],
                      ssm_state=self.p["ssm_state"], slot=dev.put(np.asarray(slot, np.int32)),
                      pos=dev.put(np.asarray([self.pos[s] for s in slot], np.int32)), B=B, T=T, nk=d["nk"],
                      nv=d["nv"], dk=d["dk"], dv=d["dv"], Kc=d["Kc"], eps=EPS, out=out)
        if mode == "step":
            w_ba = DeviceWeight("in_proj_b|a", "bf16", (2 * d["nv"], self.H), self.p["w_ba_bits"])
            n_rec, width = d["nv"] * d["dv"] // 32, x_chunk_bytes(M, True)  # a record holds all M rows
            rec = dev.empty(n_rec * width) if records_order else 0
            deltanet.step(kernels, x=dev.put(x), H=self.H, in_norm_w=self.p["in_norm_w"], eps_in=EPS, w_ba=w_ba,
                          cluster=cluster, ba_early=ba_early, out_records=rec, records_order=records_order,
                          trail=trail, **common)
            self.records = dev.get(rec, (n_rec, width), np.uint8) if records_order else None
        else:
            fn = deltanet.prefill if mode == "prefill" else deltanet.decode
            scratch = dev.empty(deltanet.chunked_scratch_bytes(B, T, self.cd, d["nv"], d["dk"]))  # >= decode's
            fn(kernels, ba=dev.put(ba), scratch=scratch, **common)
        return dev.get(out, (M, d["nv"] * d["dv"]))

    def device_states(self):
        return (self.dev.get(self.p["conv_state"], self.conv_state.shape),
                self.dev.get(self.p["ssm_state"], self.ssm_state.shape))


def ref_step(L: Layer, mixed, ba, conv_st, ssm, trail: bool = False):
    """The reference for one sequence: mixed [T, ld], ba [T, 2nv], conv_st [conv_dim, Kc-1], ssm [nv, dk, dv]
    (torch fp32) -> y [T, nv·dv], new conv_st, new ssm; with trail also S after each token [T, nv, dk, dv] and the
    conv state after each token [T, conv_dim, Kc-1] (ops.gated_delta_rule_recurrent / ops.conv_state_trail)."""
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
    conv_trail = ops.conv_state_trail(x, conv_st) if trail else None
    if T == 1:
        c, conv_st = ops.causal_conv1d_step(x[0], w, conv_st)
        c = c[None]
    else:
        c, conv_st = ops.causal_conv1d(x, w, conv_st)
    q, k, v = c.split([nk * dk, nk * dk, nv * dv], -1)
    res = ops.gated_delta_rule_recurrent(q.reshape(T, nk, dk), k.reshape(T, nk, dk), v.reshape(T, nv, dv),
                                         g, beta, ssm, trail=trail)
    o, ssm = res[0], res[1]
    y = ops.gated_rms_norm(o, z, torch.from_numpy(L.norm_w), EPS).reshape(T, nv * dv)
    if trail:
        return y.numpy(), conv_st, ssm, res[2], conv_trail
    return y.numpy(), conv_st, ssm


def assert_close(name, got, ref, rtol=RTOL) -> float:
    """got within rtol · (|ref| + rms(ref)) of ref, all finite; returns the worst relative error (for the record)."""
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
    return float(err.max())


def report_errors(what: str, worst: dict) -> None:
    """Print the measured worst relative errors of a run (pytest -s or -rP shows them), against RTOL."""
    print(f"deltanet max rel err [{what}]: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
          + f" (RTOL {RTOL:.0e})")


def check_steps(kernels, dev, rng, dims, B, Ts, modes=None, n_slots=None, H=256, cluster=None, ba_early=None,
                records_order=0):
    """Run len(Ts) consecutive steps (step i has Ts[i] tokens per sequence, through modes[i], default decode)
    and check every output and state against the reference carried alongside (cluster, ba_early, records_order:
    for mode step). The first sequence starts where its conv window reads positions < 0, the second (B > 1) just
    past a ring wrap (Layer.edge_positions). Prints the worst relative errors. Returns the outputs (with
    records_order: (out, records) pairs)."""
    import torch
    d = STEP_DIMS[dims]
    modes = modes or ["decode"] * len(Ts)
    n_slots = n_slots or B + 2
    slots = list(rng.permutation(n_slots)[:B])  # distinct, usually neither ordered nor contiguous
    L = Layer(dev, rng, d, n_slots, H=H)
    L.edge_positions(rng, slots)
    Kc = d["Kc"]
    ref_conv = {s: torch.from_numpy(ring_window(L.conv_state[s], L.pos[s], Kc)) for s in slots}
    ref_ssm = {s: torch.from_numpy(L.ssm_state[s].copy()) for s in slots}
    conv_before = L.conv_state
    outs, worst = [], {"out": 0.0, "ssm_state": 0.0}
    for step, (T, mode) in enumerate(zip(Ts, modes)):
        mixed, ba, x = L.inputs(rng, B * T, fused=mode == "step")
        out = L.run(kernels, mode, mixed, ba, x, slots, B, T, cluster, ba_early, records_order)
        outs.append((out, L.records) if records_order else out)
        conv_dev, ssm_dev = L.device_states()
        for b, s in enumerate(slots):
            rows = slice(b * T, (b + 1) * T)
            y, ref_conv[s], ref_ssm[s] = ref_step(L, mixed[rows], ba[rows], ref_conv[s], ref_ssm[s])
            where = f"{dims} B={B} step {step} ({mode}, T={T}) seq {b} slot {s} pos {L.pos[s]}"
            worst["out"] = max(worst["out"], assert_close(f"out [{where}]", out[rows], y))
            old, L.pos[s] = L.pos[s], L.pos[s] + T
            ref_c, got_c = ref_conv[s].numpy(), ring_window(conv_dev[s], L.pos[s], Kc)
            if not np.array_equal(got_c, ref_c):
                diff = np.argwhere(got_c != ref_c)[0]
                pytest.fail(f"conv_state [{where}]: differs at (channel, tap) {tuple(int(i) for i in diff)}: "
                            f"got {got_c[tuple(diff)]}, ref {ref_c[tuple(diff)]}")
            owned = {p % L.ring for p in range(max(old, L.pos[s] - Kc + 1), L.pos[s])}
            kept = [r for r in range(L.ring) if r not in owned]
            assert np.array_equal(conv_dev[s][kept], conv_before[s][kept]), \
                f"conv_state [{where}]: a ring row outside the step's last positions changed"
            worst["ssm_state"] = max(worst["ssm_state"],
                                     assert_close(f"ssm_state [{where}]", ssm_dev[s], ref_ssm[s].numpy()))
        for s in sorted(set(range(n_slots)) - set(slots)):
            assert np.array_equal(conv_dev[s], L.conv_state[s]), f"conv_state slot {s} (not in use) was written"
            assert np.array_equal(ssm_dev[s], L.ssm_state[s]), f"ssm_state slot {s} (not in use) was written"
        conv_before = conv_dev
    report_errors(f"{dims} B={B} T={'-'.join(map(str, Ts))} {'/'.join(modes)}"
                  + (f" C={cluster}" if cluster is not None else ""), worst)
    return outs


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


@pytest.mark.parametrize("T", [9, 32, 64, 130])
@pytest.mark.parametrize("dims", ["35b", "27b", "gva3", "tiny", "odd"])
def test_prefill(kernels, dev, rng, recorder, dims, T):
    """prefill of one sequence (one partial chunk of 32, exactly one, two, several with a partial last one),
    then a decode step from its state. dv % 32 == 0 (35b, gva3) runs the chunked delta rule, the others the
    recurrent one; the test checks which ran (at the 27B's 192 blocks, more than an H200's 132 SMs, the state
    kernel's one-stage variant)."""
    from ninfer_rt.gpu import deltanet
    rec = recorder
    check_steps(rec, dev, rng, dims, 1, (T, 1), modes=["prefill", "decode"], n_slots=3)
    d = STEP_DIMS[dims]
    chunked = d["dv"] % 32 == 0
    assert chunked == deltanet.chunked_supported(kernels, dk=d["dk"], dv=d["dv"])
    rule = rule_kernels(kernels, d, chunked)
    assert rec.names[:len(rule) + 2] == ["deltanet_conv", *rule, "deltanet_gated_norm"], rec.names


def two_stage_smem(dk: int) -> int:
    """Shared memory of the two-stage chunked state kernel, from the layout deltanet.state_smem_bytes documents
    (StateGeo in deltanet_chunked.cu; C = 32 tokens a chunk, 32 columns a block, rows padded by 8): S [dk][40] and
    V' [32][40], then per stage WQ [dk][72], KD [32][dk + 8], QKT [32][40], 4 floats, U [32][40]."""
    C, sp = 32, 32 + 8
    stage = dk * (2 * C + 8) + C * (dk + 8) + C * (C + 8) + 4 + C * sp
    return 4 * ((dk + C) * sp + 2 * stage)


def rule_kernels(kernels, d, chunked, stages=None):
    """The delta-rule launches of a decode/prefill call of one sequence: the recurrent kernel, or the chunked
    prep and state kernels. stages None: the rule documented at deltanet.state_stages, derived here from its
    constants, not by calling it: 2 stages where the two-stage kernel's shared memory (two_stage_smem: 154,656
    bytes at dk = 128, the figure state_smem_bytes' docstring gives) fits max_smem_per_block_optin and its blocks,
    dv / 32 column blocks × nv heads, fit one wave at one a SM (<= sm_count); else the one-stage _s1."""
    if not chunked:
        return [f"deltanet_recurrent_dk{d['dk']}"]
    if stages is None:
        assert two_stage_smem(128) == 154_656, "two_stage_smem disagrees with the documented 154,656 bytes"
        info = kernels.gpu.info
        blocks = d["dv"] // 32 * d["nv"]
        stages = 2 if two_stage_smem(d["dk"]) <= info.max_smem_per_block_optin and blocks <= info.sm_count else 1
    return [f"deltanet_chunk_prep_dk{d['dk']}", f"deltanet_chunk_state_dk{d['dk']}" + ("" if stages == 2 else "_s1")]


@pytest.mark.parametrize("dims", ["35b", "gva3"])
def test_prefill_one_stage(kernels, dev, rng, recorder, monkeypatch, dims):
    """The chunked state kernel with one record stage (_s1, what GPUs of ~100 KB shared memory per block run),
    on this GPU: prefill over several chunks, the last partial, then decode."""
    from ninfer_rt.gpu import deltanet
    monkeypatch.setattr(deltanet, "state_stages", lambda k, *, dk, blocks: 1)
    check_steps(recorder, dev, rng, dims, 1, (70, 1), modes=["prefill", "decode"], n_slots=2)
    assert recorder.names[1:3] == rule_kernels(kernels, DIMS[dims], True, stages=1), recorder.names


@pytest.mark.parametrize("dims", ["35b", "gva3"])
def test_prefill_in_pieces(kernels, dev, rng, dims):
    """A prompt in several prefill calls (the engine's chunks), each starting from the state the last one left,
    then decode: the chunked rule reads and writes the state slice of its columns only."""
    check_steps(kernels, dev, rng, dims, 1, (45, 33, 100, 1, 2), modes=["prefill"] * 3 + ["decode"] * 2,
                n_slots=4)


def step_clusters(kernels, dims):
    """The step's blocks per head to test on this GPU: 1, and where deltanet.step_cluster takes clusters, those
    and the pairs B > 1 may take (v89) where dv splits over them."""
    from ninfer_rt.gpu import deltanet
    dv = STEP_DIMS[dims]["dv"]
    C = deltanet.step_cluster(kernels, dv=dv)
    pair = [deltanet.STEP_PAIR] if C > 1 and deltanet.cluster_fits(dv, deltanet.STEP_PAIR) else []
    return [1] + pair + ([C] if C > 1 else [])


def step_kernel(dims, C):
    return f"deltanet_step_dk{STEP_DIMS[dims]['dk']}" + (f"_c{C}" if C > 1 else "")


@pytest.mark.parametrize("Ts", [(1, 1, 1), (8, 2), (3, 1)], ids=lambda t: "T" + "-".join(map(str, t)))
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("dims", list(STEP_DIMS))
def test_step(kernels, recorder, dev, rng, dims, B, Ts):
    """The fused one-launch step (b|a from the layer input) on fresh states, as one block per head and, on sm_90+,
    as a cluster of deltanet.STEP_CLUSTER blocks per head where dv splits over it (all but odd and narrow).
    H: the models' own at the 35B and 27B head shapes (2048, 5120); elsewhere 256, or 1001 at B = 3 (odd, no
    multiple of 4, and mostly more elements than a thread's weights loaded before its wait: the rest after)."""
    H = {"35b": 2048, "27b": 5120}.get(dims, 256 if B == 1 else 1001)
    for C in step_clusters(kernels, dims):
        recorder.names.clear()
        check_steps(recorder, dev, rng, dims, B, Ts, modes=["step"] * len(Ts), H=H, cluster=C)
        assert recorder.names == [step_kernel(dims, C)] * len(Ts), recorder.names


@pytest.mark.parametrize("dims", ["35b", "27b"])
def test_step_ba_before_or_after_the_wait(kernels, dev, rng, dims):
    """The clustered step's b|a dots before its wait or after it (ba_early): both match the reference, and
    their outputs agree bit for bit (the same operations in the same order), at the 35B's and 27B's H, T = 1
    and T = 3 (tokens past the first pair: x loaded in the loop)."""
    if STEP_CLUSTER not in step_clusters(kernels, dims):
        pytest.skip(f"no thread-block clusters on {kernels.gpu.info.arch}")
    H = {"35b": 2048, "27b": 5120}[dims]
    seed = int(rng.integers(2**32))  # both runs replay the same layer and inputs
    got = [check_steps(kernels, dev, np.random.default_rng(seed), dims, 2, (1, 3), modes=["step"] * 2, H=H,
                       cluster=STEP_CLUSTER, ba_early=early) for early in (False, True)]
    for a, b in zip(*got):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{dims}: b|a before the wait changed y"


@pytest.mark.parametrize("dims", ["35b", "27b", "gva3"])
def test_step_writes_out_proj_records(kernels, dev, rng, dims):
    """out_records: the step also writes y as out_proj's x̂, whose record bytes (codes, d, Σq of all B·T rows)
    equal reference.ops.act_records16 of the step's own y [B·T, nv·dv] in both orders (the codes are exact
    functions of y), at 2 sequences × 1 token and × 3 tokens, where a block holds whole 32-column chunks (dv = 128
    in one block, on clusters of 2 (v89) and 4; dv = 32 in one block); y is the same bits as without records."""
    import torch

    from ninfer_rt.gpu import deltanet
    from ninfer_rt.reference.ops import act_records16
    dv = STEP_DIMS[dims]["dv"]
    Cs = [C for C in step_clusters(kernels, dims) if deltanet.records_fit(kernels, dv=dv, cluster=C)]
    if not Cs:
        pytest.skip(f"no block of 32 columns at dv = {dv} on {kernels.gpu.info.arch}")
    H = {"35b": 2048, "27b": 5120}.get(dims, 256)
    for C in Cs:
        seed = int(rng.integers(2**32))  # the three runs replay the same layer and inputs
        plain = check_steps(kernels, dev, np.random.default_rng(seed), dims, 2, (1, 3), modes=["step"] * 2, H=H,
                            cluster=C)
        for order in (1, 2):
            got = check_steps(kernels, dev, np.random.default_rng(seed), dims, 2, (1, 3), modes=["step"] * 2, H=H,
                              cluster=C, records_order=order)
            for t, ((out, rec), ref_out) in enumerate(zip(got, plain)):
                assert np.array_equal(out.view(np.uint32), ref_out.view(np.uint32)), f"{dims} C={C}: y changed"
                want = act_records16(torch.from_numpy(out), order).numpy()  # out [B·T, nv·dv]: B·T-row records
                bad = np.argwhere(rec[:, :72 * len(out)] != want[:, :72 * len(out)])
                assert bad.size == 0, (f"{dims} C={C} order {order} step {t}: record {bad[0][0]} byte {bad[0][1]}: "
                                       f"got {rec[tuple(bad[0])]}, want {want[tuple(bad[0])]}")


@pytest.mark.parametrize("dims", ["35b", "gva3", "odd"])
def test_step_keeps_each_tokens_state(kernels, dev, rng, dims):
    """trail: a step of T = 5 tokens of 2 sequences also writes S after each token t < T - 1 into trail row (t, b)
    ([T - 1, B, nv, dk, dv]). Oracles: the reference, ops.gated_delta_rule_recurrent(..., trail=True) through the
    same conv and norm chain as ref_step, for every trail row, y and the final state (RTOL), and
    ops.conv_state_trail for the ring after each prefix (bit for bit: copies of inputs); the same kernel on the
    first t + 1 tokens of each sequence from the same states leaves, bit for bit, that state in the slot (the same
    per-token operations on the same values); and the trail's step leaves y and the final state bit for bit as the
    step without one, and its conv ring holds the inputs a step after any prefix reads (the same prefix run's ring
    rows). The sequences start below Kc - 1 and past a ring wrap (Layer.edge_positions). Every kernel a trail runs
    on: one block a head and, on sm_90+, the cluster of 4 (NaN-poisoned trail: a row left unwritten would show)."""
    import torch
    d, B, T, slots = STEP_DIMS[dims], 2, 5, [2, 0]
    H = 2048 if dims == "35b" else 256
    shape = (T - 1, B, d["nv"], d["dk"], d["dv"])
    Kc = d["Kc"]
    seed = int(rng.integers(2**32))  # every run below replays the same layer, positions and inputs

    def layer():  # the same parameters, states and positions every time
        L = Layer(dev, np.random.default_rng(seed), d, 3, H=H)
        L.edge_positions(np.random.default_rng(seed + 1), slots)
        return L

    for C in [c for c in step_clusters(kernels, dims) if c != 2]:
        L = layer()
        mixed, ba, x = L.inputs(np.random.default_rng(seed + 2), B * T, fused=True)
        trail = dev.empty(int(np.prod(shape)) * 4)
        out = L.run(kernels, "step", mixed, ba, x, slots, B, T, C, trail=trail)
        got = dev.get(trail, shape)
        plain = layer()
        out0 = plain.run(kernels, "step", mixed, ba, x, slots, B, T, C)
        assert np.array_equal(out.view(np.uint32), out0.view(np.uint32)), f"{dims} C={C}: the trail changed y"
        rings, states = L.device_states()
        assert np.array_equal(states.view(np.uint32), plain.device_states()[1].view(np.uint32))
        worst = {"out": 0.0, "ssm_state": 0.0, "trail": 0.0}
        for b, sl in enumerate(slots):  # the reference, from the same initial states
            rows = slice(b * T, (b + 1) * T)
            where = f"{dims} C={C} sequence {b} slot {sl} pos {L.pos[sl]}"
            y, _, ssm, ref_trail, conv_trail = ref_step(
                L, mixed[rows], ba[rows], torch.from_numpy(ring_window(L.conv_state[sl], L.pos[sl], Kc)),
                torch.from_numpy(L.ssm_state[sl].copy()), trail=True)
            worst["out"] = max(worst["out"], assert_close(f"out [{where}]", out[rows], y))
            worst["ssm_state"] = max(worst["ssm_state"], assert_close(f"ssm_state [{where}]", states[sl], ssm.numpy()))
            for t in range(T - 1):
                worst["trail"] = max(worst["trail"], assert_close(f"trail row {t} [{where}]", got[t, b],
                                                                  ref_trail[t].numpy()))
                after = L.pos[sl] + t + 1
                assert np.array_equal(ring_window(rings[sl], after, Kc), conv_trail[t].numpy()), \
                    f"{where}: the ring before position {after} is not ops.conv_state_trail's row {t}"
        report_errors(f"trail {dims} C={C}", worst)
        for t in range(T - 1):
            rows = np.concatenate([np.arange(b * T, b * T + t + 1) for b in range(B)])
            P = layer()
            P.run(kernels, "step", mixed[rows], ba[rows], x[rows], slots, B, t + 1, C)
            ring, want = P.device_states()
            for b, sl in enumerate(slots):
                assert np.array_equal(got[t, b].view(np.uint32), want[sl].view(np.uint32)), \
                    f"{dims} C={C}: trail row (token {t}, sequence {b}) is not the state of its first {t + 1} tokens"
                # the conv inputs a step after that prefix reads: the trail's step wrote every new position
                after = L.pos[sl] + t + 1
                assert np.array_equal(ring_window(rings[sl], after, Kc), ring_window(ring[sl], after, Kc)), \
                    f"{dims} C={C}: the ring before position {after} (sequence {b}) is not its first {t + 1} tokens'"


@pytest.mark.parametrize("B", [1, 2, 4])
def test_step_picks_the_cluster(kernels, recorder, dev, rng, B):
    """Without `cluster`, step takes the cluster kernel on sm_90+ at dv = 128; with STEP_CLUSTER_WAVES, at B > 1
    sequences the one of 4, 2 (STEP_PAIRS) and 1 blocks a head whose launch takes the fewest waves (by the
    driver's occupancy counts), the most blocks a head among equals."""
    from ninfer_rt.gpu import deltanet
    check_steps(recorder, dev, rng, "35b", B, (1, 2), modes=["step"] * 2, H=2048)
    d, C, gpu = STEP_DIMS["35b"], deltanet.STEP_CLUSTER, kernels.gpu
    if kernels.clusters and B > 1 and deltanet.STEP_CLUSTER_WAVES:
        n = d["nv"] * B

        def waves(c):
            fn, threads = kernels.fn(step_kernel("35b", c)), deltanet.STEP_LANES[c] * d["dv"] // c
            if c == 1:
                return -(-n // (gpu.max_active_blocks(fn, threads, 0) * gpu.info.sm_count))
            return -(-n // gpu.max_active_clusters(fn, (c * d["nv"], B), threads, 0, (c, 1, 1)))

        sizes = [4, 2, 1] if deltanet.STEP_PAIRS else [4, 1]
        C = min(sizes, key=lambda c: (waves(c), -c))
    elif not kernels.clusters:
        C = 1
    assert recorder.names == [step_kernel("35b", C)] * 2


def test_max_active_clusters_of_the_step(kernels):
    """driver.max_active_clusters of the clustered step lies between 1 and what its per-SM occupancy allows
    (blocks an SM × SMs / C: a cluster's blocks sit on SMs of one GPC, so fragmentation can only lower it)."""
    from ninfer_rt.gpu import deltanet
    if not kernels.clusters:
        pytest.skip(f"no thread-block clusters on {kernels.gpu.info.arch}")
    C, dv = deltanet.STEP_CLUSTER, 128
    fn, threads = kernels.fn(step_kernel("35b", C)), deltanet.STEP_LANES[C] * dv // C
    gpu = kernels.gpu
    bound = gpu.max_active_blocks(fn, threads, 0) * gpu.info.sm_count // C
    n = gpu.max_active_clusters(fn, (C * 32, 1), threads, 0, (C, 1, 1))
    assert 1 <= n <= bound, f"{n} clusters of {C}, per-SM occupancy allows {bound}"


@pytest.mark.parametrize("C", [1, 2, STEP_CLUSTER], ids=["C1", "C2", f"C{STEP_CLUSTER}"])
def test_step_after_decode(kernels, dev, rng, C):
    """The fused step and the three-kernel path share the states: prefill, then step, decode, step."""
    if C not in step_clusters(kernels, "35b"):
        pytest.skip(f"no thread-block clusters on {kernels.gpu.info.arch}")
    check_steps(kernels, dev, rng, "35b", 1, (20, 1, 2, 1), modes=["prefill", "step", "decode", "step"],
                n_slots=2, H=2048, cluster=C)


def test_bad_arguments(kernels):
    """Each invalid call raises GpuError with its own message (match: the check that fired, not an earlier one)."""
    import re

    from ninfer_rt.gpu import deltanet
    from ninfer_rt.gpu.driver import GpuError
    from ninfer_rt.gpu.weights import DeviceWeight
    good = dict(mixed=1, ld_mixed=2 * 2 * 16 + 2 * 4 * 16, ba=1, conv_w=1, A_log=1, dt_bias=1, norm_w=1,
                conv_state=1, ssm_state=1, slot=1, pos=1, B=1, T=1, nk=2, nv=4, dk=16, dv=16, Kc=4, eps=EPS, out=1,
                scratch=1)
    bad = [(dict(dk=48), "dk=48 unsupported"), (dict(dk=256), "dk=256 unsupported"),
           (dict(nv=5), "nv=5 must be a positive multiple of nk=2"),
           (dict(dv=12), "dv=12 must be a positive multiple of 8"),
           (dict(Kc=1), "conv width Kc=1 must be in [2, 8]"), (dict(Kc=9), "conv width Kc=9 must be in [2, 8]"),
           (dict(B=0), "B=0 and T=1 must be >= 1"), (dict(T=0), "B=1 and T=0 must be >= 1"),
           (dict(ld_mixed=good["ld_mixed"] - 1), "ld_mixed=191 < conv_dim + nv*dv = 192"),
           (dict(out=0), "out is a null pointer")]
    for change, msg in bad:
        with pytest.raises(GpuError, match=re.escape(msg)):
            deltanet.decode(kernels, **{**good, **change})
    with pytest.raises(GpuError, match=re.escape("B=2, prefill takes one sequence")):
        deltanet.prefill(kernels, **{**good, "B": 2})
    with pytest.raises(GpuError, match="chunked"):  # dv = 24: not whole blocks of 32 columns
        deltanet.decode(kernels, **{**good, "dv": 24, "ld_mixed": 2 * 2 * 16 + 2 * 4 * 24, "chunked": True})
    step = {k: v for k, v in good.items() if k not in ("ba", "scratch")}
    step.update(x=1, H=64, in_norm_w=1, eps_in=EPS, w_ba=DeviceWeight("ba", "bf16", (8, 64), 1))
    # without clusters every cluster > 1 fails on that first (its message names the cluster too)
    cl = kernels.clusters
    for change, msg in [(dict(T=9), "T <= 8 (got 9)"),
                        (dict(w_ba=DeviceWeight("ba", "q8g32", (8, 64), 1)), "needs bf16 b|a (got q8g32)"),
                        (dict(w_ba=DeviceWeight("ba", "bf16", (8, 32), 1)), "is [8, 32], expected [8, 64]"),
                        (dict(x=0), "x is a null pointer"), (dict(pos=0), "pos is a null pointer"),
                        (dict(cluster=3), "cluster=3, must be 1, 2 or 4"),
                        (dict(cluster=4, dv=8, ld_mixed=2 * 2 * 16 + 2 * 4 * 8),
                         "dv=8 does not split into whole warps over cluster=4" if cl else "cluster=4 needs"),
                        (dict(cluster=2, trail=256),
                         "a trail runs on one block or 4 a head, got cluster=2" if cl else "cluster=2 needs")]:
        with pytest.raises(GpuError, match=re.escape(msg)):
            deltanet.step(kernels, **{**step, **change})
