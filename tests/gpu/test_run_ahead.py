"""GpuBackend.sample_ahead on the tiny artifact: a step fed on the device by the token the step before it drew,
enqueued before the host reads that token, draws what sample_next fed the same token from the host draws, bit
for bit (the same graph on the same inputs), greedy and seeded top-k, replayed and launched directly; and
Model.generate, which runs ahead this way, gives the host path's greedy tokens.

Oracle: the sample_next chain on the same backend and cache slot (itself tested against the step's own logits in
test_engine.test_decode_draws_the_token_in_its_graph)."""

from __future__ import annotations

import numpy as np
import pytest

from .test_engine import prompt
from .test_penalties import switched_runs

pytestmark = pytest.mark.gpu

STEPS = 24


@pytest.fixture(scope="module")
def model(gpu, artifact):  # gpu: skipped without one
    from ninfer_rt.api import load

    m = load(artifact, device="cuda", max_ctx=256)
    yield m
    m.close()


def _chain(b, ids, params, vocab, ahead: bool) -> tuple[list[int], int]:
    """The prompt's draw, then STEPS more: each fed from the host (sample_next), or from the device with one step
    in flight beyond the token being read (sample_ahead, as Model._run_ahead); with the cache's end position."""
    c = b.new_cache(0)
    out = [b.sample_next(ids, c, params, vocab=vocab, seed=3, step=0)]
    if not ahead:
        for i in range(1, STEPS + 1):
            out.append(b.sample_next(np.array([out[-1]], np.int32), c, params, vocab=vocab, seed=3, step=i))
        return out, c.pos
    nxt = b.sample_ahead(c, params, vocab=vocab, seed=3, step=1)
    for i in range(2, STEPS + 2):
        after = b.sample_ahead(c, params, vocab=vocab, seed=3, step=i) if i <= STEPS else None
        out.append(nxt.result())
        nxt = after
    return out, c.pos


@pytest.mark.parametrize("graphs", [True, False])
def test_sample_ahead_draws_what_sample_next_draws(model, graphs):
    from ninfer_rt.sampling import SamplingParams

    b = model._backend
    ids = prompt(40, seed=9, vocab=model.real_vocab_size)
    b.use_graphs = graphs
    try:
        for params in (SamplingParams(greedy=True), SamplingParams(temperature=1.3, top_k=40, top_p=0.9, seed=3)):
            plain, end = _chain(b, ids, params, model.real_vocab_size, ahead=False)
            ahead, end_ahead = _chain(b, ids, params, model.real_vocab_size, ahead=True)
            assert ahead == plain and end_ahead == end == len(ids) + STEPS
            assert len(set(plain)) > 1  # a chain that repeats one id could hide a token fed twice
    finally:
        b.use_graphs = True


def test_a_pending_token_outlived_by_its_ring_slot_is_refused(model):
    from ninfer_rt.errors import NinferError
    from ninfer_rt.gpu.backend import _DrawRing
    from ninfer_rt.sampling import SamplingParams

    b, greedy = model._backend, SamplingParams(greedy=True)
    c = b.new_cache(0)
    b.sample_next(prompt(10, seed=2, vocab=model.real_vocab_size), c, greedy, vocab=model.real_vocab_size, seed=0,
                  step=0)
    first = b.sample_ahead(c, greedy, vocab=model.real_vocab_size, seed=0, step=1)
    later = [b.sample_ahead(c, greedy, vocab=model.real_vocab_size, seed=0, step=i)
             for i in range(2, _DrawRing.SLOTS + 2)]
    with pytest.raises(NinferError, match="reused its slot"):
        first.result()
    assert 0 <= later[-1].result() < model.real_vocab_size
    ring = b._ring
    pending = b.sample_ahead(c, greedy, vocab=model.real_vocab_size, seed=0, step=_DrawRing.SLOTS + 2)
    b.gpu.synchronize()
    ring.free()  # as close() does
    with pytest.raises(NinferError, match="after the model was closed"):
        pending.result()
    b._ring = None  # a fresh ring for the tests after this one
    with pytest.raises(NinferError, match="no drawn token"):
        b.sample_ahead(b.new_cache(0), greedy, vocab=model.real_vocab_size, seed=0, step=1)


def test_generate_runs_ahead_and_gives_the_host_paths_tokens(model, monkeypatch):
    """generate on the GPU: one sample_next (the prompt), then sample_ahead for every later token (one more
    where a stop id ended the run: the step fed by it was already queued); its greedy tokens equal the host
    path's (can_sample False: the host picks from downloaded logits)."""
    from ninfer_rt.gpu.backend import GpuBackend
    from ninfer_rt.sampling import SamplingParams

    ids = prompt(40, seed=3, vocab=model.real_vocab_size).tolist()
    calls = {"next": 0, "ahead": 0}
    for name in calls:
        real = getattr(GpuBackend, f"sample_{name}")

        def counted(self, *a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(GpuBackend, f"sample_{name}", counted)
    greedy = list(model.generate_ids(ids, max_new_tokens=20, sampling=SamplingParams(greedy=True)))
    s = model.last_stats
    wasted = s.finish_reason == "eos" and 2 <= s.generated_tokens < 20
    assert calls == {"next": 1, "ahead": s.generated_tokens - 1 + wasted}
    monkeypatch.setattr(GpuBackend, "can_sample", staticmethod(lambda params: False))
    host = list(model.generate_ids(ids, max_new_tokens=20, sampling=SamplingParams(greedy=True)))
    assert greedy == host and len(greedy) >= 1


def test_sample_batch_draws_each_rows_token_on_the_device(gpu, artifact):
    """GpuBackend.sample_batch (a batched step of Batch whose sequences all draw on the device): a greedy row's
    token is the arg-max of its own logits row in that step, a top-k row's one of its k largest, and the same
    states, params and (seed, step) draw the same tokens again; all-greedy rows take the arg-max kernel and equal
    decode_batch's logits' arg-maxes from the same states; a row left to the host (params None) comes back as its
    logits, decode_batch's own, while the others draw as before."""
    from ninfer_rt.api import load
    from ninfer_rt.sampling import SamplingParams

    m = load(artifact, device="cuda", max_ctx=256, cache_slots=3)
    b, V = m._backend, m.real_vocab_size
    greedy, topk = SamplingParams(greedy=True), SamplingParams(temperature=1.4, top_k=40, top_p=0.95, seed=1)
    prompts = [prompt(30 + 7 * i, seed=20 + i, vocab=V) for i in range(3)]

    def caches():
        out = []
        for i, p in enumerate(prompts):
            out.append(b.new_cache(i))
            b.forward(p, out[-1], last_only=True)
        return out

    try:
        runs = []
        for _ in range(2):
            ids = b.sample_batch([5, 9, 13], caches(), [greedy, topk, topk], vocab=V, seeds=[1, 2, 3],
                                 steps=[4, 4, 9])
            runs.append((ids, m._backend.model.logits(3)[:, :V]))
        plain = b.sample_batch([5, 9, 13], caches(), [greedy] * 3, vocab=V, seeds=[0] * 3, steps=[0] * 3)
        mixed = b.sample_batch([5, 9, 13], caches(), [greedy, None, topk], vocab=V, seeds=[1, 2, 3], steps=[4, 4, 9])
        host = b.decode_batch([5, 9, 13], caches())
    finally:
        m.close()
    (ids, logits), (again, _) = runs
    assert ids == again and ids[0] == int(np.argmax(logits[0]))
    for r in (1, 2):
        assert ids[r] in set(np.argsort(-logits[r])[:40].tolist())
    assert plain == [int(np.argmax(row[:V])) for row in host] and plain[0] == ids[0]
    # a row the host draws comes back as its logits: the same bits as decode_batch's row from the same state
    assert mixed[0] == ids[0] and mixed[2] == ids[2] and np.array_equal(mixed[1], host[1])


@pytest.mark.parametrize("sampling", [dict(greedy=True), dict(temperature=0.8, top_k=20, seed=11),
                                      dict(greedy=True, presence_penalty=1.5)])
def test_batched_steps_run_ahead_as_they_wait(gpu, artifact, monkeypatch, sampling):
    """Three sequences of a Batch (budgets 20, 14, 17, one joining after the others): with batch_ahead each batched
    step after the first is fed on the device from the draw slots (sample_batch_ahead) while the host reads the
    one before; they decode exactly what the batch decodes waiting for each step (the same graphs on the same
    tokens; seeded draws from the same Philox streams; penalties kept on the device), and run ahead at all."""
    from ninfer_rt.api import load
    from ninfer_rt.gpu.backend import GpuBackend
    from ninfer_rt.sampling import SamplingParams

    params = SamplingParams(**sampling)
    m = load(artifact, device="cuda", max_ctx=256, cache_slots=3)
    try:
        monkeypatch.setattr(m.tokenizer, "is_stop", lambda token: False)
        v = m.real_vocab_size
        prompts = [prompt(20 + 3 * i, seed=70 + i, vocab=v).tolist() for i in range(3)]
        def run():
            batch = m.batch(3)
            gens = [batch.add(p, max_new_tokens=n, sampling=params) for p, n in zip(prompts[:2], (20, 14))]
            for _ in range(4):
                batch.step()
            gens.append(batch.add(prompts[2], max_new_tokens=17, sampling=params))
            while batch.busy:
                batch.step()
            return [g.stats.token_ids for g in gens]

        waiting, ahead, calls_off, calls = switched_runs(monkeypatch, (GpuBackend, "batch_ahead"), run, GpuBackend,
                                                         "sample_batch_ahead")
    finally:
        m.close()
    assert calls_off == 0
    assert ahead == waiting and [len(t) for t in ahead] == [20, 14, 17]
    # Batch's schedule, whatever the backend: draws 2-5 of the first two, 7-13 of all three from the joiner's second
    # draw, 15-19 of the two left after the budget of 14 (the same loop on the CPU fake runs these 16 steps ahead)
    assert calls == 16
