"""GpuBackend's host side, without a GPU: which draws it takes on the device, and what it says when the sequence
slots do not fit."""

from __future__ import annotations

import pytest


def test_the_device_draws_only_what_the_host_sampler_would():
    """GpuBackend.can_sample: greedy, or top-k within the device sampler's candidate cap (misc.sample treats
    top_k = 0 as 1024), and no penalty, since penalties need the history on the host."""
    from ninfer_rt.gpu.backend import GpuBackend
    from ninfer_rt.gpu.misc import SAMPLE_MAX_CANDIDATES
    from ninfer_rt.sampling import SamplingParams as P

    yes = [P(greedy=True), P(temperature=0.0, top_k=0), P(temperature=0.7, top_k=20, top_p=0.8),
           P(temperature=1.0, top_k=SAMPLE_MAX_CANDIDATES, min_p=0.1)]
    no = [P(temperature=1.0), P(temperature=0.7, top_k=SAMPLE_MAX_CANDIDATES + 1),
          P(greedy=True, repetition_penalty=1.1), P(top_k=20, presence_penalty=0.5),
          P(top_k=20, frequency_penalty=0.1)]
    assert [GpuBackend.can_sample(p) for p in yes] == [True] * len(yes)
    assert [GpuBackend.can_sample(p) for p in no] == [False] * len(no)


def test_cache_slots_that_do_not_fit_say_what_to_lower(monkeypatch):
    """GpuBackend: an out-of-memory (the driver's result code) while the sequence slots are allocated is one line
    naming the options that size them, and the weights already loaded are freed; any other driver error passes
    through as it was."""
    from types import SimpleNamespace

    from ninfer_rt.gpu import backend
    from ninfer_rt.gpu.driver import GpuError

    freed = []
    weights = SimpleNamespace(free=lambda gpu: freed.append(gpu))

    def no_room(*a, **k):
        raise GpuError("cuMemAlloc(2684354560 bytes) failed: CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_OUT_OF_MEMORY")

    def bad_launch(*a, **k):
        raise GpuError("cuLaunchKernel(x) failed: CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(backend, "Gpu", lambda i: "gpu0")
    monkeypatch.setattr(backend, "Kernels", lambda gpu: None)
    monkeypatch.setattr(backend, "load_artifact", lambda gpu, art, progress=None: weights)
    monkeypatch.setattr(backend, "GpuModel", no_room)
    art = SimpleNamespace(spec=SimpleNamespace(max_position_embeddings=262144))
    with pytest.raises(GpuError, match=r"^5 sequence slot\(s\) of 262,144 positions do not fit in GPU memory "
                                       r"beside the weights: lower --max-context, or serve's --parallel$"):
        backend.GpuBackend(art, max_ctx=262144, cache_slots=5)
    assert freed == ["gpu0"]
    monkeypatch.setattr(backend, "GpuModel", bad_launch)
    with pytest.raises(GpuError, match=r"^cuLaunchKernel\(x\) failed: CUDA_ERROR_INVALID_VALUE$") as e:
        backend.GpuBackend(art, max_ctx=262144, cache_slots=5)
    assert e.value.code == "CUDA_ERROR_INVALID_VALUE" and freed == ["gpu0", "gpu0"]


def test_a_failed_driver_call_names_its_result_code(monkeypatch):
    """driver._check: a CUresult other than success raises a GpuError whose message and code carry the driver's
    name for it (cuGetErrorName), so callers test the code and not the text; success returns the values."""
    from enum import Enum
    from types import SimpleNamespace

    from ninfer_rt.gpu import driver

    class CUresult(Enum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_OUT_OF_MEMORY = 2

    fake = SimpleNamespace(CUresult=CUresult, cuGetErrorName=lambda err: (CUresult.CUDA_SUCCESS, err.name.encode()))
    monkeypatch.setattr(driver, "_driver", lambda: fake)
    assert driver._check((CUresult.CUDA_SUCCESS, 7), "cuX") == 7
    with pytest.raises(driver.GpuError, match=r"^cuMemAlloc\(64\) failed: CUDA_ERROR_OUT_OF_MEMORY$") as e:
        driver._check((CUresult.CUDA_ERROR_OUT_OF_MEMORY,), "cuMemAlloc(64)")
    assert e.value.out_of_memory and e.value.code == "CUDA_ERROR_OUT_OF_MEMORY"
