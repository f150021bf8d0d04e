"""chain.Chain (kernels/chain.cu chain_gemv_q8) against its own launches and float64 numpy.

Oracles: (1) chain.sequential, one gemv_q8_s1 launch per op at the chain's blocks and register-tile depths: the
same body, row split and summation order, so the outputs must be equal to the bit; that kernel is test_linear's,
checked there against float64 with x copied and the plan overridden. (2) Ops whose inputs the chain does not write,
against test_linear.reference, whose tolerance (1e-5 relative) test_linear derives. A dependent chain (each op
reading what the op before wrote, out_proj adding into the residual the next in_proj normalises) is the case a
missing or early wait breaks: op i's blocks would stage x before op i - 1's last blocks wrote it.
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.gpu import chain
from ninfer_rt.gpu.driver import GpuError
from tests.gpu.test_linear import EPS, check_close, reference

pytestmark = pytest.mark.gpu

# (in_proj [N1, H], out_proj [H, K2]) per layer: a small shape, and the 35B's DeltaNet in_proj_qkv|z and out_proj
SHAPES = {"small": (768, 256, 512), "35b": (12288, 2048, 4096)}


def layer_chain(dev, rng, fmt: str, shape: str, layers: int):
    """The GEMVs of `layers` DeltaNet-like layers: y = in_proj(rmsnorm(x)) (store), x += out_proj(y[:K2]) (add).
    Returns (ops, x0, x pointer, y pointer)."""
    n1, h, k2 = SHAPES[shape]
    x0 = rng.standard_normal(h).astype(np.float32)
    xp, yp = dev.put(x0), dev.empty(4 * n1)
    ops = []
    for i in range(layers):
        w1, _ = dev.weight(fmt, (n1, h), rng, f"layers.{i}.linear_attn.in_proj_qkvz.weight")
        w2, _ = dev.weight(fmt, (h, k2), rng, f"layers.{i}.linear_attn.out_proj.weight")
        nw = dev.put((rng.standard_normal(h) * 0.2).astype(np.float32))
        ops += [chain.ChainOp(w1, xp, yp, "store", nw, EPS), chain.ChainOp(w2, yp, xp, "add")]
    return ops, x0, xp, yp


@pytest.mark.parametrize("fmt,shape,layers,blocks,how", [
    ("q8g32", "small", 4, None, 0), ("q8g32", "small", 4, None, 1), ("q8g32", "small", 4, None, 2),
    ("q8g64", "small", 3, 7, 2), ("q8g128", "small", 3, 1, 0), ("q8g32", "35b", 3, None, 0),
    ("q8g32", "35b", 3, None, 2)])
def test_a_dependent_chain_equals_its_launches_to_the_bit(kernels, dev, rng, fmt, shape, layers, blocks, how):
    """Every layer's output and the residual after them equal the sequential launches' bit for bit, at the resident
    grid, a grid of 7 blocks (uneven row ranges) and of one block (every op in one block: no waits met late), with
    each way of waiting."""
    ops, x0, xp, yp = layer_chain(dev, rng, fmt, shape, layers)
    c = chain.Chain(kernels, ops, blocks, how)
    try:
        c.launch()
        got_x, got_y = dev.get(xp, x0.shape), dev.get(yp, (SHAPES[shape][0],))
        kernels.gpu.upload(xp, x0)
        chain.sequential(kernels, ops, c.plan)
        want_x, want_y = dev.get(xp, x0.shape), dev.get(yp, (SHAPES[shape][0],))
    finally:
        c.free()
    assert np.isfinite(want_x).all() and not np.array_equal(want_x, x0)
    for what, got, want in (("residual", got_x, want_x), ("last in_proj", got_y, want_y)):
        diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        assert not len(diff), (f"{what}: {len(diff)} of {got.size} differ from the launches, first at {diff[0]}: "
                               f"{got[diff[0]]!r} vs {want[diff[0]]!r}")


@pytest.mark.parametrize("how", [0, chain.NO_WAIT])
def test_independent_ops_match_float64(kernels, dev, rng, how):
    """Ops of several K, N and groups, with and without the norm, store and add, each reading an x the chain does
    not write: each y within test_linear's tolerance of float64 on the exact weights and codes, waiting or not."""
    cases = [("q8g32", 96, 256, "store", True), ("q8g64", 300, 512, "add", False), ("q8g128", 64, 4096, "add", True),
             ("q8g32", 2048, 2048, "store", False)]
    ops, refs = [], []
    for fmt, n, k, mode, norm in cases:
        w, wv = dev.weight(fmt, (n, k), rng)
        x = rng.standard_normal((1, k)).astype(np.float32)
        nw = (rng.standard_normal(k) * 0.2).astype(np.float32) if norm else None
        y0 = rng.standard_normal((1, n)).astype(np.float32)
        yp = dev.put(y0) if mode == "add" else dev.empty(4 * n)
        ops.append(chain.ChainOp(w, dev.put(x), yp, mode, dev.put(nw) if norm else 0, EPS))
        refs.append(reference(wv, x, mode=mode, norm_w=nw, row_scale=None, y0=y0, codes=True))
    c = chain.Chain(kernels, ops, how=how)
    try:
        c.launch()
        for op, ref, case in zip(ops, refs, cases):
            check_close(dev.get(op.y, ref.shape), ref, f"chain op {case}")
    finally:
        c.free()


@pytest.mark.parametrize("how", [0, 2])
def test_a_captured_chain_replays_from_zeroed_counters(kernels, dev, rng, how):
    """Two replays of a captured chain (its counters' and flags' memset and the launch) equal two rounds of the
    launches: the second replay's waits start from zero, not from the first replay's full counters or set flags."""
    ops, x0, xp, _ = layer_chain(dev, rng, "q8g32", "small", 2)
    c = chain.Chain(kernels, ops, how=how)
    gpu = kernels.gpu
    try:
        gpu.begin_capture(gpu.stream)
        try:
            c.launch(gpu.stream)
        finally:
            graph = gpu.end_capture(gpu.stream)
        try:
            graph.launch(gpu.stream)
            graph.launch(gpu.stream)
            gpu.synchronize()
        finally:
            graph.destroy()
        got = dev.get(xp, x0.shape)
        gpu.upload(xp, x0)
        chain.sequential(kernels, ops, c.plan)
        chain.sequential(kernels, ops, c.plan)
        want = dev.get(xp, x0.shape)
    finally:
        c.free()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_grid_that_cannot_be_resident_is_refused(kernels, dev, rng):
    """Blocks past what the GPU holds at once would wait forever for blocks that never start: a one-line error."""
    ops, *_ = layer_chain(dev, rng, "q8g32", "small", 1)
    resident = chain.plan_chain(kernels, ops).blocks
    with pytest.raises(GpuError, match="resident"):
        chain.plan_chain(kernels, ops, blocks=resident + 1)
    with pytest.raises(GpuError, match="wait is one of"):
        chain.Chain(kernels, ops, how=len(chain.WAITS))
