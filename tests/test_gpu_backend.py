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
    """GpuBackend: an out-of-memory while the sequence slots are allocated is one line naming the options that
    size them, and the weights already loaded are freed."""
    from types import SimpleNamespace

    from ninfer_rt.gpu import backend
    from ninfer_rt.gpu.driver import GpuError

    freed = []
    weights = SimpleNamespace(free=lambda gpu: freed.append(gpu))

    def no_room(*a, **k):
        raise GpuError("cuMemAlloc(2684354560 bytes) failed: CUDA_ERROR_OUT_OF_MEMORY")

    monkeypatch.setattr(backend, "Gpu", lambda i: "gpu0")
    monkeypatch.setattr(backend, "Kernels", lambda gpu: None)
    monkeypatch.setattr(backend, "load_artifact", lambda gpu, art, progress=None: weights)
    monkeypatch.setattr(backend, "GpuModel", no_room)
    art = SimpleNamespace(spec=SimpleNamespace(max_position_embeddings=262144))
    with pytest.raises(GpuError, match=r"^5 sequence slot\(s\) of 262,144 positions do not fit in GPU memory "
                                       r"beside the weights: lower --max-context, or serve's --parallel$"):
        backend.GpuBackend(art, max_ctx=262144, cache_slots=5)
    assert freed == ["gpu0"]
