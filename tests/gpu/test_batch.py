"""Continuous batching on the GPU (ninfer_rt.batching over GpuBackend.decode_batch): sequences in their own slots
decode together as each decodes alone.

Bounds: a batched step's logits equal each sequence's lone step within fp32 reassociation (rel ≤ 1e-4 of the
row's largest logit, test_engine's bound for batching), and greedy tokens agree over 24 steps.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def ids(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def test_decode_batch_equals_lone_steps(gpu, artifact):
    from ninfer_rt.api import load

    m = load(artifact, device="cuda", max_ctx=128, cache_slots=4)
    try:
        be, v = m._backend, m.real_vocab_size
        a, b = be.new_cache(0), be.new_cache(1)
        be.forward(np.asarray(ids(21, 1, v)), a)
        be.forward(np.asarray(ids(9, 2, v)), b)
        a2, b2 = be.copy_cache(a, 2), be.copy_cache(b, 3)
        batched = be.decode_batch([5, 6], [a, b])
        lone = np.concatenate([be.forward(np.asarray([5]), a2, last_only=True),
                               be.forward(np.asarray([6]), b2, last_only=True)])
        assert (a.pos, b.pos) == (22, 10)
    finally:
        m.close()
    assert np.isfinite(batched).all()
    np.testing.assert_allclose(batched, lone, rtol=0, atol=1e-4 * np.abs(lone).max())


def test_a_batch_decodes_as_each_prompt_alone(gpu, artifact, monkeypatch):
    """Two prompts start together, a third joins two steps later (prefilled in chunks of 8 beside their decode
    steps); each decodes what generate gives it alone, and the batch's steps took all three at once."""
    from ninfer_rt.api import load
    from ninfer_rt.sampling import SamplingParams

    greedy = SamplingParams(greedy=True)
    m = load(artifact, device="cuda", max_ctx=128, cache_slots=3)
    try:
        monkeypatch.setattr(m.tokenizer, "is_stop", lambda token: False)
        prompts = [ids(n, 10 + n, m.real_vocab_size) for n in (20, 33, 7)]
        alone = [list(m.generate_ids(p, max_new_tokens=24, sampling=greedy)) for p in prompts]
        batch = m.batch(3, prefill_chunk=8)
        rows = []
        real = m._backend.decode_batch
        monkeypatch.setattr(m._backend, "decode_batch", lambda t, c: rows.append(len(t)) or real(t, c))
        gens = [batch.add(p, max_new_tokens=24, sampling=greedy) for p in prompts[:2]]
        batch.step()
        batch.step()
        gens.append(batch.add(prompts[2], max_new_tokens=24, sampling=greedy))
        while batch.busy:
            batch.step()
    finally:
        m.close()
    assert [g.error for g in gens] == [None] * 3
    assert [g.stats.token_ids for g in gens] == alone and max(rows) == 3
