"""Penalties on the device (backend.DEVICE_PENALTIES): misc.penalize against its host twin penalize_reference (bit
for bit: the kernel rounds each step alone, as numpy's fp32 does) and misc.penalty_count against a count by hand;
then generate and a Batch with penalties drawing on the device give the host path's greedy tokens (the device
penalizes in fp32 where the host takes float64: ~1e-7 of a logit apart, so a path through a top-2 gap that small
would flip a token; a failure there is the first thing to check)."""

from __future__ import annotations

import numpy as np
import pytest

from .test_engine import prompt

pytestmark = pytest.mark.gpu


def test_penalize_rows_is_its_host_twin(gpu, kernels, dev):
    from ninfer_rt.gpu import misc

    rng = np.random.default_rng()
    M, V, ld = 3, 1000, 1024
    logits = (rng.standard_normal((M, ld)) * 4).astype(np.float32)
    logits[0, :4] = [0.0, -0.0, np.nan, 5.0]
    slots = np.array([2, 0, 3], np.int32)
    params = np.concatenate([misc.penalty_params(1.3, 1.5, 0.4), misc.penalty_params(),
                             misc.penalty_params(0.7, 0.0, 0.0), misc.penalty_params(1.0, -0.5, 2.0)])
    state = [misc.penalty_state(rng.integers(0, V, n).tolist(), n // 2, V) for n in (50, 3, 200, 80)]
    counts, seen = np.stack([c for c, _ in state]), np.stack([s for _, s in state])
    d_logits = dev.put(logits)
    misc.penalize(kernels, logits=d_logits, ld=ld, M=M, V=V, slots=dev.put(slots), params=dev.put(params),
                  counts=dev.put(counts), seen=dev.put(seen))
    got = dev.get(d_logits, (M, ld), np.float32)
    want = misc.penalize_reference(logits, V, slots, params, counts, seen)
    assert np.array_equal(got, want, equal_nan=True)
    assert not np.array_equal(got[0], logits[0], equal_nan=True)  # the penalties did something


def test_penalty_count_counts_each_rows_token_in_its_slot(gpu, kernels, dev):
    from ninfer_rt.gpu import misc

    S, V = 3, 50
    counts, seen = np.zeros((S, V), np.int32), np.zeros((S, V), np.uint8)
    counts[1, 7], seen[2, 9] = 4, 1
    d_counts, d_seen = dev.put(counts), dev.put(seen)
    misc.penalty_count(kernels, tokens=dev.put(np.array([7, 9], np.int32)), slots=dev.put(np.array([1, 0], np.int32)),
                       M=2, V=V, counts=d_counts, seen=d_seen)
    counts[1, 7] += 1
    counts[0, 9] += 1
    seen[1, 7] = seen[0, 9] = 1
    assert np.array_equal(dev.get(d_counts, (S, V), np.int32), counts)
    assert np.array_equal(dev.get(d_seen, (S, V), np.uint8), seen)


def switched_runs(monkeypatch, switch: tuple, run, owner, method: str) -> tuple:
    """run() with the switch (owner, attribute) on, then off, each call of owner's `method` counted: (the off
    run's result, the on run's, the off run's calls, the on run's). The path under test runs first, on the fresh
    model, where each step shape runs for the first time (its carveout's dry run, its graph's capture): run
    second, it hid a first-step bug of the device penalties (perf.md v112)."""
    calls = {"n": 0}
    real = getattr(owner, method)
    monkeypatch.setattr(owner, method, lambda *a, **kw: calls.__setitem__("n", calls["n"] + 1) or real(*a, **kw))
    monkeypatch.setattr(*switch, True)
    on, n_on = run(), calls["n"]
    monkeypatch.setattr(*switch, False)
    off = run()
    return off, on, calls["n"] - n_on, n_on


@pytest.mark.parametrize("pen", [dict(repetition_penalty=1.3), dict(presence_penalty=1.5),
                                 dict(frequency_penalty=0.8, presence_penalty=0.3)])
def test_penalised_generation_draws_on_the_device_as_the_host_does(gpu, artifact, monkeypatch, pen):
    """generate (run ahead) and two sequences of a Batch (batched steps) with penalties: the device's greedy
    tokens equal the host path's (DEVICE_PENALTIES off: the host penalizes downloaded logits), and the device path
    draws without downloading a logits row."""
    from ninfer_rt.api import load
    from ninfer_rt.gpu import backend as backend_mod
    from ninfer_rt.sampling import SamplingParams

    params = SamplingParams(greedy=True, **pen)
    m = load(artifact, device="cuda", max_ctx=256, cache_slots=3)
    try:
        monkeypatch.setattr(m.tokenizer, "is_stop", lambda token: False)
        v = m.real_vocab_size
        prompts = [prompt(30, seed=40 + i, vocab=v).tolist() for i in range(2)]

        def run():
            alone = list(m.generate_ids(prompts[0], max_new_tokens=24, sampling=params))
            batch = m.batch(2)
            gens = [batch.add(p, max_new_tokens=16, sampling=params) for p in prompts]
            while batch.busy:
                batch.step()
            return alone, [g.stats.token_ids for g in gens]

        host, device, _, downloads = switched_runs(monkeypatch, (backend_mod, "DEVICE_PENALTIES"), run,
                                                   m._backend.model, "logits")
    finally:
        m.close()
    assert device == host and downloads == 0
    assert len(set(host[0])) > 4  # the penalties kept the path from one repeated token
