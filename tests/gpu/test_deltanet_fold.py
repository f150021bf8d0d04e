"""GPU test of deltanet.step's router fold (v71/v73; kernels/deltanet_step.cu with fold_acc): for one
token a sequence the step also adds its blocks' shares of the next MoE's raw router logits into an int64
accumulator, a row a sequence (router_fold.py; B > 1 since v87), on clusters of 4 and 2 (v89) and in one block a
head (v88).

Oracles: the step itself against test_deltanet's reference (ref_step: y and the SSM state within its RTOL, the conv
ring bit for bit, the slot not in use untouched); fold_oracle.check_fold_sums over the step's own fp32 output y for
what the fold added (the accumulator starts from random int64 values: the kernel must add, not store); and the step
without the fold from the same states (restored in between) leaves the same bits in y, the conv ring and S, so the
fold reads the step's real output and changes nothing else. The accumulator's padding columns and its row past the
B sequences keep their initial bits.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from .fold_oracle import check_fold_sums, random_fold
from .test_deltanet import STEP_DIMS, Layer, assert_close, ref_step, report_errors, ring_window

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("C", ["clusters", 2, 1])
@pytest.mark.parametrize("E,H,B", [(256, 2048, 1), (40, 2043, 1), (256, 2048, 2), (40, 2036, 4)])
def test_step_adds_the_router_fold(kernels, dev, rng, monkeypatch, E, H, B, C):
    """The 35B's DeltaNet shapes (128 blocks of 32 columns a sequence; H = 2048: 16 elements of x a block) with 257
    logits (the last warp takes the shared gate's); and with 41 (a thread each) at H = 2043, whose last block holds
    11 elements (chunks of 16, 16 and 12 bytes, one zeroed). B sequences: sequence b's sums in row b (v87), the row
    past them untouched; H = 2036 there (x's rows 16-byte aligned, as the fold needs at B > 1; the last block
    holds 4 elements). C: the clustered step (a block of 32 columns, a thread a logit) or the one-block step (v88:
    512 threads over 4 fold blocks, a pair a logit; its last fold block holds H's last 4 or 11 elements), or a
    cluster of 2 (v89: 256 threads over 2 fold blocks, a logit each)."""
    from ninfer_rt.gpu import deltanet, router_fold
    d = STEP_DIMS["35b"]
    if C == "clusters":
        C = deltanet.step_cluster(kernels, dv=d["dv"])
        if C == 1:
            pytest.skip(f"no clustered step on {kernels.gpu.info.arch}")
    elif C > 1 and not kernels.clusters:
        pytest.skip(f"no thread-block clusters on {kernels.gpu.info.arch}")
    assert deltanet.fold_fits(dv=d["dv"], C=C, n=E + 1, H=H, nv=d["nv"])
    import torch
    L = Layer(dev, rng, d, B + 1, H=H)
    slots = list(range(B, 0, -1))  # slot 0 is not in use
    L.edge_positions(rng, slots)   # the first below Kc - 1, the second (B > 1) past a ring wrap
    mixed, ba, x = L.inputs(rng, B, fused=True)
    D = d["nv"] * d["dv"]
    _, _, _, mb, ms, wb, g1 = random_fold(rng, E, H, D)
    ld = router_fold.fold_ld(E)
    # |init| < 2^60 and |Σ| far below 2^62 (logits of |.| < 2^30 in 2^-32 units): init + Σ cannot wrap
    init = rng.integers(-2**60, 2**60, (B + 1, ld), dtype=np.int64)
    acc = dev.put(init)
    fold = (dev.put(mb), dev.put(ms), dev.put(wb), dev.put(g1), acc, ld, E + 1)
    plain_step = deltanet.step

    def one_step(with_fold: bool):
        """One token of each sequence (slots B .. 1, not in order) from the layer's initial states (restored
        first) -> y, conv ring, S."""
        dev.gpu.upload(L.p["conv_state"], L.conv_state)
        dev.gpu.upload(L.p["ssm_state"], L.ssm_state)
        monkeypatch.setattr(deltanet, "step", functools.partial(plain_step, fold=fold if with_fold else None))
        y = L.run(kernels, "step", mixed, None, x, slots, B, 1, cluster=C)
        return (y, *L.device_states())

    plain = one_step(False)
    y, conv, ssm = one_step(True)
    for what, a, b in zip(("y", "conv ring", "ssm state"), (y, conv, ssm), plain):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"the fold changed {what}"

    Kc, worst = d["Kc"], {"out": 0.0, "ssm_state": 0.0}
    for b, s in enumerate(slots):  # the step against the reference (x went into b|a: L.inputs' oracle ba)
        where = f"E={E} H={H} B={B} C={C} sequence {b} slot {s} pos {L.pos[s]}"
        ref_y, ref_conv, ref_ssm = ref_step(L, mixed[b:b + 1], ba[b:b + 1],
                                            torch.from_numpy(ring_window(L.conv_state[s], L.pos[s], Kc)),
                                            torch.from_numpy(L.ssm_state[s].copy()))
        worst["out"] = max(worst["out"], assert_close(f"y [{where}]", y[b:b + 1], ref_y))
        worst["ssm_state"] = max(worst["ssm_state"], assert_close(f"ssm_state [{where}]", ssm[s], ref_ssm.numpy()))
        assert np.array_equal(ring_window(conv[s], L.pos[s] + 1, Kc), ref_conv.numpy()), f"conv window [{where}]"
        kept = [r for r in range(L.ring) if r != L.pos[s] % L.ring]  # one token: only its own row is written
        assert np.array_equal(conv[s][kept], L.conv_state[s][kept]), f"conv ring rows [{where}]: others changed"
    assert np.array_equal(conv[0], L.conv_state[0]) and np.array_equal(ssm[0], L.ssm_state[0]), "slot 0 was written"
    report_errors(f"fold E={E} H={H} B={B} C={C}", worst)

    got_acc = dev.get(acc, (B + 1, ld), np.int64)
    assert np.array_equal(got_acc[:, E + 1:], init[:, E + 1:]), "the fold wrote the accumulator's padding columns"
    assert np.array_equal(got_acc[B], init[B]), "the fold wrote the row past the B sequences"
    for b in range(B):
        check_fold_sums(got_acc[b] - init[b], mb, ms, wb, g1, x[b], y[b], E, H, label=f"sequence {b}: ")
