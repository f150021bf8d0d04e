"""Fixtures of the GPU tests: a context, the built kernels, and device arrays that are freed after each test.

Every test here is marked `gpu` and skipped when no CUDA GPU (or no cuda-python) is present. Inputs are
random and fresh each run; outputs are poisoned (0xFF bytes: NaN in fp32) before a launch, so an element a
kernel fails to write shows up as NaN.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ninfer_rt.formats import f32_to_bf16_bits, get_format, round_up, K_ALIGN
from ninfer_rt.gpu.weights import DeviceWeight

POISON = 0xFF


@pytest.fixture(scope="session")
def gpu():
    from ninfer_rt.gpu.driver import Gpu, GpuError
    try:
        return Gpu(0)
    except GpuError as e:
        pytest.skip(f"no GPU: {e}")


@pytest.fixture(scope="session")
def kernels(gpu):
    from ninfer_rt.gpu.kernels import Kernels
    return Kernels(gpu)


class Dev:
    """Device arrays for one test: put/empty/get, and random weights in any format with their exact values."""

    def __init__(self, gpu):
        self.gpu, self.ptrs = gpu, []

    def put(self, array: np.ndarray) -> int:
        a = np.ascontiguousarray(array)
        p = self.gpu.alloc(a.nbytes)
        self.ptrs.append(p)
        self.gpu.upload(p, a)
        return p

    def empty(self, nbytes: int, poison: bool = True) -> int:
        p = self.gpu.alloc(nbytes)
        self.ptrs.append(p)
        self.gpu.memset(p, POISON if poison else 0, nbytes)
        return p

    def get(self, p: int, shape, dtype=np.float32) -> np.ndarray:
        return self.gpu.download(p, shape, dtype)

    def weight(self, fmt: str, shape, rng: np.random.Generator, name: str = "w",
               edit=None) -> tuple[DeviceWeight, np.ndarray]:
        """A random tensor stored in `fmt` on the device and its exact float32 values (logical shape). edit(q, sc),
        quantized formats only: changes the codes int8 [rows, Kp] and fp16 scales [rows, Kp / group] before packing."""
        f = get_format(fmt)
        shape = tuple(shape)
        if f.is_quantized:
            rows, k = math.prod(shape[:-1]), shape[-1]
            kp = round_up(k, K_ALIGN)
            q = np.zeros((rows, kp), np.int8)
            q[:, :k] = rng.integers(f.qmin, f.qmax + 1, size=(rows, k), dtype=np.int8)
            sc = (rng.uniform(0.5, 1.5, size=(rows, kp // f.group)) / f.offset).astype(np.float16)
            sc[:, (k + f.group - 1) // f.group:] = 0  # groups wholly in the padding
            if edit is not None:
                edit(q, sc)
            buf = f.pack(q, sc)
        else:
            assert edit is None, "edit takes a quantized format's codes and scales"
            vals = rng.standard_normal(shape).astype(np.float32) * 0.5
            buf = f.encode(vals)
        assert buf.size == f.nbytes(shape)
        p = self.put(buf)
        return DeviceWeight(name, fmt, shape, p), f.decode(buf, shape)

    def free_all(self) -> None:
        for p in self.ptrs:
            self.gpu.free(p)
        self.ptrs.clear()


class Recorder:
    """A Kernels stand-in that runs every launch and records its entry point, so a test can check which
    kernels a wrapper chose."""

    def __init__(self, kernels):
        self.k, self.gpu, self.names = kernels, kernels.gpu, []

    def fn(self, name):
        return self.k.fn(name)

    def opt_in_smem(self, name, nbytes):
        self.k.opt_in_smem(name, nbytes)

    def launch(self, name, *args, **kw):
        self.names.append(name)
        self.k.launch(name, *args, **kw)

    def __getattr__(self, attr):  # the rest (clusters, build, ...) as the wrapped Kernels has it
        return getattr(self.k, attr)


@pytest.fixture
def recorder(kernels):
    return Recorder(kernels)


@pytest.fixture
def dev(gpu):
    d = Dev(gpu)
    yield d
    d.free_all()


def bf16_round(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 and back (the values a bf16 store keeps)."""
    from ninfer_rt.formats import bf16_bits_to_f32
    return bf16_bits_to_f32(f32_to_bf16_bits(x.astype(np.float32)))


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-dense"])
def artifact(request, tmp_path_factory):
    """A tiny built-in checkpoint (MoE and dense) packed with the tiny recipe (every format family)."""
    from ninfer_pack.pipeline import quantize
    from ninfer_pack.tiny import materialize_builtin

    src = materialize_builtin(f"builtin:{request.param}", cache_dir=tmp_path_factory.mktemp("builtin"))
    out = tmp_path_factory.mktemp("art") / f"{request.param}.ninfer"
    quantize(str(src), "tiny", out)
    return out
