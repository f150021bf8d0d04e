"""GPU test of deltanet.step's router fold (v71/v73; kernels/deltanet_step.cu with fold_acc): for one
token a sequence the step also adds its blocks' shares of the next MoE's raw router logits into an int64
accumulator, a row a sequence (router_fold.py; B > 1 since v87), on clusters of 4 and 2 (v89) and in one block a
head (v88).

Oracle: fold_oracle.check_fold_sums over the step's own fp32 output y; y is the same bits as the step's without the
fold (the states restored in between), so the fold reads the step's real output and changes nothing else.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from .fold_oracle import check_fold_sums, random_fold
from .test_deltanet import STEP_DIMS, Layer

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
    L = Layer(dev, rng, d, B + 1, H=H)
    mixed, _, x = L.inputs(rng, B, fused=True)
    D = d["nv"] * d["dv"]
    _, _, _, mb, ms, wb, g1 = random_fold(rng, E, H, D)
    ld = router_fold.fold_ld(E)
    acc = dev.put(np.zeros((B + 1) * ld, np.int64))
    fold = (dev.put(mb), dev.put(ms), dev.put(wb), dev.put(g1), acc, ld, E + 1)
    plain_step = deltanet.step

    def one_step(with_fold: bool) -> np.ndarray:
        """One token of each sequence (slots B .. 1, not in order) from the layer's initial states (restored
        first)."""
        dev.gpu.upload(L.p["conv_state"], L.conv_state)
        dev.gpu.upload(L.p["ssm_state"], L.ssm_state)
        monkeypatch.setattr(deltanet, "step", functools.partial(plain_step, fold=fold if with_fold else None))
        return L.run(kernels, "step", mixed, None, x, list(range(B, 0, -1)), B, 1, cluster=C)

    want_y = one_step(False)
    y = one_step(True)
    assert np.isfinite(y).all() and np.array_equal(y.view(np.uint32), want_y.view(np.uint32)), "the fold changed y"
    got_acc = dev.get(acc, (B + 1, ld), np.int64)
    assert not got_acc[:, E + 1:].any() and not got_acc[B].any()
    for b in range(B):
        check_fold_sums(got_acc[b], mb, ms, wb, g1, x[b], y[b], E, H, label=f"sequence {b}: ")
