"""x̂ chunk records between kernels (linear.gemv x_records / y_records; kernels/gemv_stream.cu _s1r, _s1bw).

Oracles: y from records is compared to the bit with y from x itself (the same codes, plan and sums, so the same
bits); records a kernel writes are compared byte for byte with reference.ops.act_records16 of that kernel's own
fp32 output (the coding is exact integer and power-of-two arithmetic, so bit-exact), and that output to the bit
with the plain launch's.
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.gpu import linear
from ninfer_rt.gpu.driver import GpuError
from ninfer_rt.gpu.weights import DeviceWeight
from .test_linear import FakeKernels, check_close, reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt,shape,M", [("q8g32", (2048, 4096), 1), ("q6g64", (5120, 6144), 1),
                                         ("q5g64", (203, 2080), 1), ("q4g128", (96, 352), 1),
                                         ("q8g32", (2048, 4096), 2), ("q8g32", (5120, 6144), 3),
                                         ("q8g32", (203, 2080), 4)])
def test_gemv_x_records(kernels, dev, rng, fmt, shape, M):
    """x_records: x [M, K] given as its chunk records of M rows (reference.ops.act_records16, as the DeltaNet step
    writes them for out_proj) gives y to the bit of x itself (the same codes and the same plan, so the same sums in
    the same order), store and add, at the 35B's and 27B's out_proj shapes and two small ones (N past a block's
    rows, K with a padded last group); one row in every format, 2-4 rows of q8 weights (gemv_q8_s{M}r). The plain
    launch's y is itself checked against test_linear's float64 oracle on the exact weights (its TOL), and store
    mode starts from poisoned y, so an unwritten element fails as NaN."""
    import torch

    from ninfer_rt.reference.ops import act_records16
    w, wv = dev.weight(fmt, shape, rng)
    n, k = shape
    x = rng.standard_normal((M, k)).astype(np.float32)
    rec = act_records16(torch.from_numpy(x), linear.records_order(w)).numpy()
    assert rec.shape == (k // 32, linear.x_chunk_bytes(M, True))
    if not linear.records_fit(kernels, w, M):
        pytest.skip(f"x_records runs on sm_90+ (this GPU: {kernels.gpu.info.arch})")
    y0 = rng.standard_normal((M, n)).astype(np.float32)
    for mode in ("store", "add"):
        ys = [dev.put(y0) if mode == "add" else dev.empty(M * n * 4) for _ in range(2)]
        linear.gemv(kernels, w, x=dev.put(x), M=M, y=ys[0], mode=mode)
        linear.gemv(kernels, w, x=dev.put(rec), M=M, y=ys[1], mode=mode, x_records=True)
        a, b = (dev.get(p, (M, n)) for p in ys)
        check_close(a, reference(wv, x, mode=mode, norm_w=None, row_scale=None, y0=y0, codes=True),
                    f"plain gemv {fmt} {shape} M={M} {mode}")
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
            f"{fmt} {shape} M={M} {mode}: x_records changed y (first at {np.argwhere(a != b)[:1].tolist()})"


def test_gemv_x_records_errors():
    """x_records takes 1 row of a quantized weight (2-4 of a q8 one) with a stream plan, no norm, a 16-byte aligned
    x, on sm_90+."""
    k = FakeKernels()
    w = DeviceWeight("w", "q8g32", (64, 256), 1 << 20)
    w4 = DeviceWeight("w", "q4g64", (64, 256), 1 << 20)
    for bad in (dict(M=5), dict(M=2, w=w4), dict(norm_w=1 << 12), dict(x=4100),
                dict(w=DeviceWeight("w", "bf16", (64, 256), 1 << 20))):
        kw = {**dict(x=4096, M=1, y=8192), **bad}
        with pytest.raises(GpuError, match="x_records"):
            linear.gemv(k, kw.pop("w", w), x_records=True, **kw)
    k.gpu.info.major = 8  # the cp.async copy of the records is untested: not taken
    with pytest.raises(GpuError, match="sm_90"):
        linear.gemv(k, w, x=4096, M=1, y=8192, x_records=True)
    k.gpu.info.major = 9
    assert not k.calls
    linear.gemv(k, w, x=4096, M=1, y=8192, x_records=True)
    linear.gemv(k, w, x=4096, M=3, y=8192, x_records=True)
    (name, _, _, args, smem), (name3, _, _, args3, smem3) = k.calls
    assert name == "gemv_q8_s1r" and args[17] == 2 and smem == linear.plan_gemv(w, 1, 132).smem + 16
    assert name3 == "gemv_q8_s3r" and args3[17] == 2 and smem3 == 256 // 32 * linear.x_chunk_bytes(3, True) + 16


# 27B gate|up (a slice of 34816 rows, and all of it), the shapes past and below one chunk per block
@pytest.mark.parametrize("fmt,shape", [("q4g64", (34816, 5120)), ("q4g64", (4096, 5120)), ("q8g32", (128, 256)),
                                       ("q5g64", (1984, 2080)), ("q6g128", (640, 352))])
def test_gemv_y_records(kernels, dev, rng, fmt, shape):
    """y_records: a swiglu gemv writes its output as chunk records instead of y, each coded by a block that finds
    the chunk's 32 (value, 1) pairs published (its 16 row groups span blocks wherever a block holds fewer). They
    equal act_records16 of the plain launch's y (the same sums, so the same bits) in both orders, y is left as it
    was, the pairs are zero again, and every later launch on new x writes new records. Which block codes a chunk
    shared by blocks depends on timing, so the 27B's whole gate|up runs 16 launches. The down then takes the
    records as x_records."""
    import torch

    from ninfer_rt.reference.ops import act_records16
    w, _ = dev.weight(fmt, shape, rng)
    if not linear.y_records_fit(kernels, w):
        pytest.skip(f"y_records runs on sm_90+ (this GPU: {kernels.gpu.info.arch})")
    n, k = shape
    norm = dev.put((0.1 * rng.standard_normal(k)).astype(np.float32))
    pairs = dev.put(np.zeros(n // 2, np.uint64))
    cnt = dev.put(np.zeros(2 * (n // 64), np.uint32))
    for i, order in enumerate((1, 2) * 8 if shape == (34816, 5120) else (1, 2, 2)):
        x = dev.put(rng.standard_normal(k).astype(np.float32))
        y1 = rng.standard_normal(n // 2).astype(np.float32)
        ys = [dev.put(rng.standard_normal(n // 2).astype(np.float32)), dev.put(y1)]
        rec = dev.put(np.full((n // 64, 80), 0xA5, np.uint8))
        linear.gemv(kernels, w, x=x, M=1, y=ys[0], mode="swiglu", norm_w=norm)
        linear.gemv(kernels, w, x=x, M=1, y=ys[1], mode="swiglu", norm_w=norm,
                    y_records=(rec, pairs, cnt, order, i & 1))
        a, b = (dev.get(p, (n // 2,)) for p in ys)
        assert np.isfinite(a).all() and np.array_equal(b, y1), f"{fmt} {shape}: y_records wrote y"
        got = dev.get(rec, (n // 64, 80), np.uint8)
        want = act_records16(torch.from_numpy(a), order).numpy()
        bad = np.flatnonzero((got[:, :72] != want[:, :72]).any(1))
        assert bad.size == 0, \
            f"{fmt} {shape} order {order}: {bad.size} of {n // 64} records differ, first chunk {bad[0]}"
        assert not dev.get(pairs, (n // 2,), np.uint64).any(), "the pairs were not left at zero"
    # the records as the down's x̂ (K = n/2), against the down from y itself
    down, _ = dev.weight("q5g64", (256, n // 2), rng)
    if linear.records_fit(kernels, down):
        zs = [dev.empty(256 * 4) for _ in range(2)]  # poisoned: an unwritten output is NaN
        linear.gemv(kernels, down, x=ys[0], M=1, y=zs[0])
        linear.gemv(kernels, down, x=rec, M=1, y=zs[1], x_records=True)
        c, d = (dev.get(p, (256,)) for p in zs)
        assert np.isfinite(c).all(), f"{fmt} {shape}: the down from y left {(~np.isfinite(c)).sum()} outputs unwritten"
        assert np.array_equal(c.view(np.uint32), d.view(np.uint32)), f"{fmt} {shape}: the down from the records"


def test_gemv_y_records_errors():
    """y_records takes a swiglu of one row, a quantized weight with N % 64 == 0 and a stream plan on sm_90+,
    16-byte aligned records, 8-byte aligned pairs, aligned counters, order 1 or 2, parity 0 or 1; the launch is
    gemv_*_s1bw with the four extra arguments."""
    k = FakeKernels()
    w = DeviceWeight("w", "q4g64", (128, 256), 1 << 20)
    ok = dict(x=4096, M=1, y=8192, mode="swiglu", y_records=(1 << 16, 1 << 18, 1 << 17, 2, 1))
    for bad in (dict(M=2), dict(mode="store"), dict(w=DeviceWeight("w", "q4g64", (96, 256), 1 << 20)),
                dict(w=DeviceWeight("w", "bf16", (128, 256), 1 << 20)),
                dict(y_records=((1 << 16) + 8, 1 << 18, 1 << 17, 2, 1)),
                dict(y_records=(1 << 16, (1 << 18) + 4, 1 << 17, 2, 1)),
                dict(y_records=(1 << 16, 1 << 18, (1 << 17) + 2, 2, 1)),
                dict(y_records=(1 << 16, 1 << 18, 1 << 17, 3, 1)), dict(y_records=(1 << 16, 1 << 18, 1 << 17, 2, 2))):
        kw = {**ok, **bad}
        with pytest.raises(GpuError, match="y_records"):
            linear.gemv(k, kw.pop("w", w), **kw)
    k.gpu.info.major = 8
    with pytest.raises(GpuError, match="sm_90"):
        linear.gemv(k, w, **ok)
    k.gpu.info.major = 9
    assert not k.calls
    linear.gemv(k, w, **ok)
    name, _, _, args, smem = k.calls[0]
    plan = linear.plan_gemv(w, 1, 132)
    # the counters' parity rides in the order argument's bit 2
    assert name == "gemv_q4_s1bw" and args[-4:] == [1 << 16, 1 << 18, 1 << 17, 2 | 1 << 2] and args[18] == plan.d
    assert smem == k.smem_opt_in[name] >= plan.smem
    # x copied the only way _s1bw copies it, by a bulk copy with its mbarrier, though K <= _STREAM_X_ASYNC_UPTO
    assert args[17] == 2 and smem == plan.smem + 4 * 256 + 16
