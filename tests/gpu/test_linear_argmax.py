"""The block GEMV's arg-max epilogue (linear.gemv argmax=..., kernels/gemv.cu argmax_publish): the lm_head launch
that also leaves its rows' arg-max, in place of misc.argmax's two launches after it.

Oracle: torch.argmax over the logits the same launch wrote (downloaded), columns < V, NaN ranked as -inf (what
misc.argmax promises, tests/gpu/test_misc.py). The ids must be equal, not close: both see the same fp32 values.
The logits themselves must be bit-identical to the launch without the epilogue (it only reads them).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ninfer_rt.gpu import linear
from ninfer_rt.gpu.driver import GpuError
from ninfer_rt.gpu.weights import DeviceWeight

from .test_linear import FakeKernels

pytestmark = pytest.mark.gpu


def oracle(logits: np.ndarray, vocab: int) -> np.ndarray:
    """torch.argmax of each row over columns < vocab, NaN as -inf (ties -> the lowest index)."""
    t = torch.from_numpy(logits[:, :vocab].copy())
    return torch.argmax(torch.nan_to_num(t, nan=-float("inf")), dim=1).numpy().astype(np.int32)


class Launch:
    """One weight's launches: the plain GEMV and the one with the epilogue, on fresh x each time."""

    def __init__(self, kernels, dev, w, M: int):
        self.k, self.dev, self.w, self.M = kernels, dev, w, M
        n, kk = w.shape
        self.x, self.norm = dev.empty(M * kk * 4), dev.put(np.zeros(kk, np.float32))
        self.y_plain, self.y = dev.empty(M * n * 4), dev.empty(M * n * 4)
        self.amax, self.out = dev.empty(linear.ARGMAX_BYTES, poison=False), dev.empty(4 * M)

    def run(self, x: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray]:
        """(logits [M, N], ids [M]) of one launch with the epilogue; the logits checked against the plain launch."""
        self.dev.gpu.upload(self.x, np.ascontiguousarray(x, np.float32))
        kw = dict(x=self.x, M=self.M, norm_w=self.norm)
        linear.gemv(self.k, self.w, y=self.y_plain, **kw)
        linear.gemv(self.k, self.w, y=self.y, argmax=(self.amax, self.out, vocab), **kw)
        n = self.w.shape[0]
        plain, got = self.dev.get(self.y_plain, (self.M, n)), self.dev.get(self.y, (self.M, n))
        assert np.array_equal(plain.view(np.uint32), got.view(np.uint32)), "the epilogue changed the logits"
        left = self.dev.get(self.amax, (linear.ARGMAX_BYTES // 8,), np.uint64)
        assert not left.any(), f"the launch left its keys or ticket nonzero: {left.tolist()}"
        return got, self.dev.get(self.out, (self.M,), np.int32)


@pytest.mark.parametrize("fmt,M,n", [("q6g64", 1, 65536 + 37), ("q4g32", 5, 2003), ("q5g64", 6, 4099),
                                     ("q8g32", 8, 2011), ("bf16", 7, 1501)])
def test_argmax_epilogue(recorder, dev, rng, fmt, M, n):
    """Every code width on the block kernels (M = 1 at the lm_head's block-plan size, 5-8 at any N): three
    launches in a row on fresh x (the keys and the ticket left zero each time), the vocabulary cut below the
    row's best (so the best must be skipped), and a row whose every logit is NaN (id 0)."""
    k = 256
    w, _ = dev.weight(fmt, (n, k), rng)
    assert linear.argmax_fits(recorder, w, M)
    run = Launch(recorder, dev, w, M)
    for _ in range(3):
        x = rng.standard_normal((M, k)).astype(np.float32)
        logits, ids = run.run(x, n)
        np.testing.assert_array_equal(ids, oracle(logits, n))
    best = int(oracle(logits, n)[0])
    vocab = max(best, 1)  # columns < best: the row's largest value is out of reach
    logits, ids = run.run(x, vocab)
    np.testing.assert_array_equal(ids, oracle(logits, vocab))
    x[0, 3] = np.nan  # row 0's logits all NaN: it ranks every one as -inf, ties to id 0
    logits, ids = run.run(x, n)
    assert np.isnan(logits[0]).all() and ids[0] == 0
    np.testing.assert_array_equal(ids, oracle(logits, n))
    code = "bf16" if fmt == "bf16" else fmt[:2]
    assert set(recorder.names) == {f"gemv_{code}_m{M}"}, recorder.names


def test_argmax_ties_and_nan_rows(kernels, dev, rng):
    """Rows copied from the best row tie with it bit for bit: the lowest index wins (one copy below it, one above);
    a row with a NaN scale (its logit NaN) at index 0 never wins; x = 0 makes every other logit zero, a tie of the
    whole row but NaN's index 0: id 1. The weight is drawn twice from one seed, the second time with those edits,
    so the first draw's best row is the second's too."""
    n, k, M = 65536 + 5, 256, 1
    x = rng.standard_normal((M, k)).astype(np.float32)
    for seed in rng.integers(0, 2**31, 8):  # a best row past the edited rows 0 .. 3 (all but certain at once)
        w, _ = dev.weight("q6g64", (n, k), np.random.default_rng(seed))
        logits, _ = Launch(kernels, dev, w, M).run(x, n)
        best = int(oracle(logits, n)[0])
        if best > 3:
            break
    lo, hi = (best + 1) // 2 + 1, (best + n) // 2

    def edit(q, sc):
        q[lo], sc[lo], q[hi], sc[hi] = q[best], sc[best], q[best], sc[best]
        sc[0, 0] = np.float16("nan")

    w2, _ = dev.weight("q6g64", (n, k), np.random.default_rng(seed), edit=edit)
    run = Launch(kernels, dev, w2, M)
    logits, ids = run.run(x, n)
    top = np.flatnonzero(logits[0] == np.nanmax(logits[0]))
    assert top.tolist() == sorted({lo, best, hi}) and np.isnan(logits[0, 0]), (top, best, lo, hi, logits[0, :2])
    assert ids[0] == lo == oracle(logits, n)[0]
    logits, ids = run.run(np.zeros((M, k), np.float32), n)
    assert (logits[0, 1:] == 0).all() and ids[0] == oracle(logits, n)[0] == 1  # row 0 is NaN: the tie is 1's


def test_argmax_refused_where_it_cannot_ride():
    """The stream kernels (M = 1 below 65,536 rows, M = 2-4 at the lm_head) and modes other than store have no
    epilogue: gemv refuses the request in one line instead of ignoring it; where it fits, the launch carries the
    key buffer, out and V after the block kernel's arguments (no GPU: the launches are recorded)."""
    k = FakeKernels()
    w, head = DeviceWeight("w", "q8g32", (2003, 256), 1 << 20), DeviceWeight("h", "q6g64", (248320, 2048), 1 << 30)
    assert not linear.argmax_fits(k, w, 1) and linear.argmax_fits(k, w, 5) and linear.argmax_fits(k, head, 1)
    assert not any(linear.argmax_fits(k, head, m) for m in (2, 3, 4))
    ok = dict(x=1 << 24, y=1 << 26, argmax=(1 << 28, 1 << 29, 2003))
    for bad in (dict(M=1), dict(M=5, mode="add"), dict(M=5, argmax=(1 << 28, 1 << 29, 2004)),
                dict(M=5, argmax=(1 << 28, 1 << 29, 0)), dict(M=5, argmax=((1 << 28) + 4, 1 << 29, 7))):
        with pytest.raises(GpuError, match="argmax"):
            linear.gemv(k, w, **{**ok, **bad})
    assert not k.calls
    linear.gemv(k, w, M=5, **ok)
    linear.gemv(k, head, x=1 << 24, y=1 << 26, M=1, argmax=(1 << 28, 1 << 29, 248077))
    assert [c[0] for c in k.calls] == ["gemv_q8_m5", "gemv_q6_m1"]
    assert k.calls[0][3][-3:] == [1 << 28, 1 << 29, 2003] and k.calls[1][3][-3:] == [1 << 28, 1 << 29, 248077]
