"""Continuous batching on the GPU (ninfer_rt.batching over GpuBackend.decode_batch, and sample_batch where every
row draws on the device): sequences in their own slots decode together as each decodes alone.

Bounds: a batched step's logits equal each sequence's lone step within fp32 reassociation (rel <= 1e-4 of the
row's largest logit, test_engine's bound for batching), so greedy tokens agree over 24 steps on paths whose top-2
gaps stay >= BATCH_MARGIN; where a prompt is only fed in other chunks, the logits are held to KL <= 1e-3 and
against a negative control.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.test_engine import kld

pytestmark = pytest.mark.gpu


def ids(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


# least top-2 logit gap on a greedy path that a batched decode must reproduce: a batched step moves each logit by
# at most 1e-4 of the row's largest (test_decode_batch_equals_lone_steps; |logit| < 2 on the tiny models), a gap by
# at most 4e-4, and 2e-3 leaves 5 times that for the states' drift over 24 steps
BATCH_MARGIN = 2e-3


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
    """Two prompts start together, a third joins two steps later; each decodes what generate gives it alone, and
    the batch's steps took all three at once. Prompts are prefilled whole (prefill_chunk 64), as generate does: a
    prompt cut into other chunks runs other kernels (the decode GEMVs, not the prefill GEMMs), whose rounding
    may flip a near-tied greedy pick or expert choice of the random tiny model (the next test bounds that). The
    prompts are the first three seeds' whose greedy paths keep every top-2 gap >= BATCH_MARGIN
    (test_mtp.clear_prompt)."""
    from ninfer_rt.api import load
    from ninfer_rt.sampling import SamplingParams

    from .test_mtp import clear_prompt

    greedy = SamplingParams(greedy=True)
    m = load(artifact, device="cuda", max_ctx=128, cache_slots=3)
    try:
        monkeypatch.setattr(m.tokenizer, "is_stop", lambda token: False)
        v = m.real_vocab_size
        seeds = iter(range(10, 310))  # shared: three distinct prompts, each from its own seed
        prompts = [clear_prompt(m._backend, 24, v, seeds, length=n, margin=BATCH_MARGIN)[0] for n in (20, 33, 7)]
        alone = [list(m.generate_ids(p, max_new_tokens=24, sampling=greedy)) for p in prompts]
        batch = m.batch(3, prefill_chunk=64)
        rows = []  # the batched steps' sizes: greedy rows are drawn on the device (sample_batch)
        real = m._backend.sample_batch
        monkeypatch.setattr(m._backend, "sample_batch", lambda t, c, *a, **kw: rows.append(len(t)) or real(t, c, *a,
                                                                                                        **kw))
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


def test_prompts_fed_in_chunks_beside_decode_steps(gpu, artifact, monkeypatch):
    """A 33-token prompt joins a decoding sequence and is fed 8 tokens a step: the logits its first token is drawn
    from match the whole prompt's (KL <= 1e-3, test_engine's bound where only the chunking moves), and both run to
    their budget. Negative control: the whole prompt with its token 24 (the first of the fourth chunk) replaced
    moves the last logits by 9e-4 (dense) to 3e-3 (MoE) nats on the CPU reference, under the bound, so the fed
    prompt's logits must also be at least 4 times closer to the whole prompt's than the control's are (the decode
    GEMVs against the prefill GEMM: ~1e-6 nats)."""
    from ninfer_rt.api import load
    from ninfer_rt.sampling import SamplingParams

    greedy = SamplingParams(greedy=True)
    m = load(artifact, device="cuda", max_ctx=128, cache_slots=3)
    try:
        monkeypatch.setattr(m.tokenizer, "is_stop", lambda token: False)
        monkeypatch.setattr(m, "_draws_on_device", lambda params: False)  # drawn on the host, from logits
        be = m._backend
        long = ids(33, 43, m.real_vocab_size)
        whole = be.forward(np.asarray(long), be.new_cache(2), last_only=True)[-1]
        bad = list(long)
        bad[24] = (bad[24] + 101) % m.real_vocab_size
        control = be.forward(np.asarray(bad), be.new_cache(2), last_only=True)[-1]
        fed, drawn_from = [], []
        forward, pick = be.forward, m._pick

        def counted(x, cache, last_only=False):
            fed.append((len(x), cache.slot))
            return forward(x, cache, last_only=last_only)

        def kept(row, sampler, history, prompt_len):
            if prompt_len == len(long) and not drawn_from:
                drawn_from.append(row.copy())
            return pick(row, sampler, history, prompt_len)

        monkeypatch.setattr(be, "forward", counted)
        monkeypatch.setattr(m, "_pick", kept)
        batch = m.batch(2, prefill_chunk=8)
        first = batch.add(ids(12, 3, m.real_vocab_size), max_new_tokens=12, sampling=greedy)
        batch.step()
        late = batch.add(long, max_new_tokens=6, sampling=greedy)
        while batch.busy:
            batch.step()
    finally:
        m.close()
    assert [g.error for g in (first, late)] == [None, None]
    assert [len(g.stats.token_ids) for g in (first, late)] == [12, 6]
    assert [n for n, slot in fed if slot == late._slot.index] == [8, 8, 8, 8, 1]
    k, k_ctrl = kld(whole[None], drawn_from[0][None]).item(), kld(whole[None], control[None]).item()
    print(f"KLD {k:.1e}, with token 24 replaced {k_ctrl:.1e}")
    assert np.isfinite(drawn_from[0]).all() and k_ctrl > 0
    assert k <= 1e-3 and k < k_ctrl / 4


def test_a_batch_scores_a_prompt_and_reports_logprobs(gpu, artifact, monkeypatch):
    """The logprob paths on the GPU: a prompt scored (max_new_tokens 0, one 64-token chunk of all rows' logits) is
    the same forward as another whole forward of it from an empty cache (the same 16-row chunks through the same
    kernels, no float atomics: the same bits), so it reports exactly what token_logprob gives on those rows; and
    those are the float64 log-softmax of the rows (within 1e-6: token_logprob's float32 exponentials, summed in
    float64), with the top 3 ids in order. A greedy generation with logprobs reports, for each token, the row it was
    drawn from (its own logprob is that row's largest)."""
    from ninfer_rt.api import load
    from ninfer_rt.logprobs import token_logprob
    from ninfer_rt.sampling import SamplingParams

    m = load(artifact, device="cuda", max_ctx=128, cache_slots=2)
    try:
        monkeypatch.setattr(m.tokenizer, "is_stop", lambda token: False)
        v, be = m.real_vocab_size, m._backend
        prompt = ids(50, 7, v)
        rows = be.forward(np.asarray(prompt), be.new_cache(0), last_only=False)
        batch = m.batch(2)
        scored = batch.add(prompt, max_new_tokens=0, prompt_logprobs=3)
        greedy = batch.add(ids(20, 8, v), max_new_tokens=6, sampling=SamplingParams(greedy=True), logprobs=2)
        got, out = [], []
        while batch.busy:
            batch.step()
            got += scored.take_prompt_logprobs()
            out += greedy.take_logprobs()
    finally:
        m.close()
    assert scored.error is None and greedy.error is None
    assert [e.id for e in got] == prompt and np.isnan(got[0].logprob)
    assert got[1:] == [token_logprob(rows[p - 1], prompt[p], 3, v) for p in range(1, len(prompt))]
    x = rows[:len(prompt) - 1, :v].astype(np.float64)
    lp = x - x.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))  # lp: [49, v], row p - 1 the distribution of token p
    np.testing.assert_allclose([e.logprob for e in got[1:]], lp[np.arange(len(prompt) - 1), prompt[1:]], rtol=0,
                               atol=1e-6)
    top = np.argsort(-lp, -1, kind="stable")[:, :3]  # ties to the lower id, as token_logprob
    assert [[i for i, _ in e.top] for e in got[1:]] == top.tolist()
    np.testing.assert_allclose([[lp_ for _, lp_ in e.top] for e in got[1:]], np.take_along_axis(lp, top, -1),
                               rtol=0, atol=1e-6)
    assert [e.id for e in out] == greedy.stats.token_ids and len(out) == 6
    assert all(e.top[0] == (e.id, e.logprob) for e in out)
