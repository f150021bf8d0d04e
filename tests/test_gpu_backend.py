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


def test_penalties_draw_on_the_device_only_with_device_penalties(monkeypatch):
    """GpuBackend.can_draw (what generate and Batch draw on the device): with DEVICE_PENALTIES (the default)
    can_sample's cases with penalties too, without it can_sample (which speculative decoding's device rows need,
    and which never takes penalties)."""
    from ninfer_rt.gpu import backend
    from ninfer_rt.sampling import SamplingParams as P

    pen = [P(greedy=True, repetition_penalty=1.1), P(temperature=0.7, top_k=20, presence_penalty=1.5)]
    never = [P(temperature=1.0, presence_penalty=1.5), P(greedy=True)]  # top-k off; no penalty
    assert backend.DEVICE_PENALTIES
    assert [backend.GpuBackend.can_draw(p) for p in pen + never] == [True, True, False, True]
    monkeypatch.setattr(backend, "DEVICE_PENALTIES", False)
    assert [backend.GpuBackend.can_draw(p) for p in pen + never] == [False, False, False, True]
    assert not any(backend.GpuBackend.can_sample(p) for p in pen)


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
    monkeypatch.setattr(backend, "load_artifact", lambda gpu, art, groups=("text",), progress=None: weights)
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


def test_speculative_contract_keeps_the_positions(monkeypatch):
    """GpuBackend's verify / rewind / draft (ninfer_rt.speculative's contract) on a recording GpuModel: a prompt
    runs as a prefill keeping every row's hidden state and returns the last logits row; a verification keeps each
    token's DeltaNet state (trail; not for a lone token) and returns every row; a rewind hands the kept count to
    GpuModel.rewind (its copies replayed as a graph) and moves the position back; drafts run at the draft cache's
    positions in the sequence's slot and return the last row; a head cache copies to the copied sequence's slot."""
    from types import SimpleNamespace

    import numpy as np

    from ninfer_rt.gpu import backend

    H, V, log = 4, 7, []

    class Model:
        def __init__(self, *a, **k):
            pass

        def reset_slot(self, slot):
            log.append(("reset", slot))

        def prefill(self, ids, slot, start=0, hidden=False):
            log.append(("prefill", len(ids), slot, start, hidden))
            return np.ones((len(ids), H), np.float32)

        def verify(self, ids, pos, slot, graph=True, trail=False, vocab=None):
            log.append(("verify", len(ids), pos, slot, trail, vocab))

        def argmax(self, rows):
            return np.full(rows, 5, np.int32)

        def rewind(self, slot, keep, T, graph=True):
            log.append(("rewind", slot, keep, T, graph))

        def draft(self, hidden, ids, pos, slot, graph=True):
            log.append(("draft", len(ids), pos, slot))
            return (len(ids) - 1) % 3 + 1  # the rows of its last chunk, in chunks of 3

        def logits(self, rows):
            return np.zeros((rows, V), np.float32)

        def hidden(self, rows):
            return np.arange(rows * H, dtype=np.float32).reshape(rows, H)

    monkeypatch.setattr(backend, "Gpu", lambda i: "gpu0")
    monkeypatch.setattr(backend, "Kernels", lambda gpu: None)
    monkeypatch.setattr(backend, "load_artifact", lambda gpu, art, groups=("text",), progress=None: groups)
    monkeypatch.setattr(backend, "GpuModel", Model)
    be = backend.GpuBackend(SimpleNamespace(spec=SimpleNamespace(max_position_embeddings=4096)), cache_slots=2,
                            groups=("text", "mtp"))
    assert be.weights == ("text", "mtp")
    cache = be.new_cache(1)
    logits, hidden, undo = be.verify(np.arange(10), cache, undoable=False)
    assert logits.shape == (1, V) and hidden.shape == (10, H) and undo is None and cache.pos == 10
    logits, hidden, undo = be.verify(np.arange(4), cache)
    assert logits.shape == (4, V) and hidden.shape == (4, H) and undo == 4 and cache.pos == 14
    be.rewind(cache, undo, np.arange(4), 2)
    assert cache.pos == 12
    ids, _, undo = be.verify(np.arange(1), cache, top1=V - 2)  # a lone token keeps itself: no trail
    assert ids.tolist() == [5] and ids.dtype == np.int64  # the arg-maxes of the step's own graph
    be.rewind(cache, undo, np.arange(1), 1)
    assert cache.pos == 13
    d = be.new_draft_cache(cache)
    d_logits, d_hidden = be.draft(np.zeros((10, H)), np.arange(10), d)  # chunks of 3: the last holds 1 row
    assert d_logits.shape == (1, V) and d_hidden.tolist() == [[0, 1, 2, 3]] and d.pos == 10 and d.slot == 1
    be.draft(np.zeros((2, H)), np.arange(2), d)
    be.rewind_draft(d, 11)
    assert d.pos == 11
    copy = be.copy_draft_cache(d, backend.GpuCache(pos=13, slot=0))  # copy_slot copied the head's KV rows
    assert (copy.pos, copy.slot, d.slot) == (11, 0, 1)
    assert log == [("reset", 1), ("prefill", 10, 1, 0, True), ("verify", 4, 10, 1, True, None),
                   ("rewind", 1, 2, 4, True), ("verify", 1, 12, 1, False, V - 2), ("rewind", 1, 1, 1, True),
                   ("draft", 10, 0, 1), ("draft", 2, 10, 1)]
