"""generate on a backend that draws on the device and feeds each draw to the next step before the host reads it
(GpuBackend.sample_ahead): the same tokens and draw indices as the plain loop, and a cache whose kept ids say
exactly what it holds however the run ends (a stop id drawn ahead, the budget, the caller closing it).

Oracles: slot_backend.DrawingSlotBackend's rule (decode_fresh: what greedy decoding gives, no slot touched), the
plain loop on the same rule (SlotBackend, the host picking), and the slot's own history, which a forward checks
against the cache's position.
"""

from __future__ import annotations

import random

import pytest

from ninfer_rt.sampling import SamplingParams
from slot_backend import DrawingSlotBackend, SlotBackend

GREEDY = SamplingParams(greedy=True)


@pytest.fixture(scope="module")
def model(packed_model):
    return packed_model


def _use(model, monkeypatch, fake):
    monkeypatch.setattr(model, "_backend", fake)
    model._kept.fresh()
    return fake


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 9])
def test_tokens_and_draw_indices_equal_the_plain_loop(model, monkeypatch, budget):
    """One sample_next for the prompt, then one sample_ahead a token, each with the index the plain loop gives
    its draw; no step past the budget; every pending token read."""
    ids = list(range(100, 130))
    fake = _use(model, monkeypatch, DrawingSlotBackend(model.real_vocab_size, set(model.tokenizer.eos_ids)))
    got = list(model.generate_ids(ids, max_new_tokens=budget, sampling=GREEDY))
    assert got == fake.decode_fresh(ids, budget) and model.last_stats.finish_reason == "length"
    assert fake.steps == list(range(budget)) and fake.reads == budget - 1
    assert fake.fed == len(ids) + budget - 1  # the last token is drawn, not fed, as in the plain loop


@pytest.mark.parametrize("at", [0, 1, 3, 5])
def test_a_stop_drawn_ahead_is_in_the_kept_cache(model, monkeypatch, at):
    """A stop id as output token `at` ends the run there; the step already fed with it (at >= 1, tokens left in
    the budget) was spent, so the kept cache holds the stop id too, and the next turn that extends it (a chat's
    next turn renders the stop id after the reply) reuses it and decodes what a fresh run decodes."""
    ids, stop, budget = list(range(100, 130)), model.tokenizer.eos_ids[0], 8
    fake = _use(model, monkeypatch, DrawingSlotBackend(model.real_vocab_size, set(model.tokenizer.eos_ids),
                                                       forced={30 + at: stop}))
    got = list(model.generate_ids(ids, max_new_tokens=budget, sampling=GREEDY, reuse_cache=True))
    s = model.last_stats
    assert got == fake.decode_fresh(ids, at) and s.finish_reason == "eos" and s.generated_tokens == at + 1
    ahead = at >= 1  # the stop's own step was fed by the token before it; one more was fed by the stop
    assert fake.steps == list(range(at + 1 + ahead)) and fake.fed == len(ids) + at + ahead
    turn = ids + got + [stop, 300, 301]
    again = list(model.generate_ids(turn, max_new_tokens=3, sampling=GREEDY, reuse_cache=True))
    assert again == fake.decode_fresh(turn, 3)
    assert model.last_stats.cached_tokens == len(ids) + at + ahead  # the stop id too where it was fed


def test_a_run_closed_early_keeps_the_token_fed_ahead(model, monkeypatch):
    """Closed after 3 tokens, the run had fed the third and the fourth (drawn, not yet read): the kept ids name
    both, so a turn extending all four reuses them, and one extending only three starts afresh."""
    ids = list(range(100, 130))
    fake = _use(model, monkeypatch, DrawingSlotBackend(model.real_vocab_size, set(model.tokenizer.eos_ids)))
    want = fake.decode_fresh(ids, 4)
    run = model.generate_ids(ids, max_new_tokens=10, sampling=GREEDY, reuse_cache=True)
    assert [next(run) for _ in range(3)] == want[:3]
    run.close()
    assert model.last_stats.finish_reason == "cancelled"
    for kept, cached in ((4, len(ids) + 4), (3, 0)):
        turn = ids + want[:kept] + [300, 301]
        assert list(model.generate_ids(turn, max_new_tokens=3, sampling=GREEDY, reuse_cache=True)) == \
            fake.decode_fresh(turn, 3)
        assert model.last_stats.cached_tokens == cached
        list(model.generate_ids(ids, max_new_tokens=10, sampling=GREEDY, reuse_cache=True))  # as before
        run = model.generate_ids(ids, max_new_tokens=10, sampling=GREEDY, reuse_cache=True)
        [next(run) for _ in range(3)]
        run.close()


def test_random_conversations_decode_and_reuse_as_the_plain_loop(model, monkeypatch):
    """The same random conversation (extend, branch at a snapshot, start over; early closes) on the host-picking
    backend and on the drawing one: the same tokens at every turn, equal to fresh runs, and the same prefix reuse
    wherever the plain loop's kept ids and the run-ahead's agree (they differ only after an early close, where
    run-ahead fed one token more)."""

    def converse(fake) -> list[tuple[list[int], int]]:
        _use(model, monkeypatch, fake)
        rng = random.Random(5)
        toks = lambda n: [rng.randrange(100, model.real_vocab_size) for _ in range(n)]  # noqa: E731
        prompt, turns = toks(12), []
        for _ in range(120):
            close_at = rng.choice([None, None, 1, 2])
            run = model.generate_ids(prompt, max_new_tokens=4, sampling=GREEDY, reuse_cache=True,
                                     snapshot_at=rng.choice([None, rng.randrange(1, len(prompt))]))
            got = [next(run) for _ in range(close_at)] if close_at else list(run)
            run.close()
            assert got == fake.decode_fresh(prompt, len(got))
            turns.append((got, model.last_stats.cached_tokens, close_at))
            kind = rng.choice(["extend", "new"])
            prompt = prompt + got + toks(rng.randrange(1, 5)) if kind == "extend" else toks(rng.randrange(3, 12))
        return turns

    plain = converse(SlotBackend(model.real_vocab_size, set(model.tokenizer.eos_ids)))
    ahead = converse(DrawingSlotBackend(model.real_vocab_size, set(model.tokenizer.eos_ids)))
    assert [t[0] for t in plain] == [t[0] for t in ahead]
    same = [(p[1], a[1]) for i, (p, a) in enumerate(zip(plain, ahead)) if i == 0 or not plain[i - 1][2]]
    assert all(p == a for p, a in same) and sum(1 for p, _ in same if p) > 20


# ------------------------------------------------------------------------------------------------ Batch (serve)


@pytest.fixture
def batch_model(packed):
    from ninfer_rt import load

    m = load(packed, "cpu", cache_slots=3)
    yield m
    m.close()


def _drain(batch, gens) -> None:
    while batch.busy:
        batch.step()
        for g in gens:
            g.take()


def test_a_lone_batch_sequence_runs_ahead_and_decodes_as_alone(batch_model, monkeypatch):
    """A sequence alone in a Batch runs ahead after its first decode step (one sample_next for the prompt, one for
    the first step, then sample_ahead), with the plain loop's draw indices; a second one joining meanwhile takes
    the step in flight as the first one's token and the two then decode batched; both decode what the rule gives
    them alone, and the first one's slot then serves a prompt extending what it fed."""
    m = batch_model
    fake = _use(m, monkeypatch, DrawingSlotBackend(m.real_vocab_size, set(m.tokenizer.eos_ids), cache_slots=4))
    batch = m.batch(2)
    a = batch.add(list(range(100, 120)), max_new_tokens=9, sampling=GREEDY)
    for _ in range(4):
        batch.step()
    # step 1 prefills and decodes (draws 0 and 1, the step fed by 1 enqueued ahead), steps 2-4 take one each
    assert fake.steps == [0, 1, 2, 3, 4, 5] and fake.reads == 3
    b = batch.add(list(range(200, 210)), max_new_tokens=5, sampling=GREEDY)
    _drain(batch, [a, b])
    for g in (a, b):
        assert g.stats.token_ids == fake.decode_fresh(g.prompt, g.budget) and g.stats.finish_reason == "length"
    assert fake.batches  # they decoded together while both ran
    turn = a.prompt + a.stats.token_ids + [300]
    c = batch.add(turn, max_new_tokens=3, sampling=GREEDY)
    _drain(batch, [c])
    assert c.stats.token_ids == fake.decode_fresh(turn, 3) and c.stats.cached_tokens == len(turn) - 2


@pytest.mark.parametrize("end", ["stop id", "cancel"])
def test_a_batch_sequence_leaves_its_slot_what_it_fed_ahead(batch_model, monkeypatch, end):
    """Between steps one step is in flight, fed by the last token out; while a step reads its token a second one
    is queued, fed by that unread draw. So a stop id is fed before it is seen (the slot then holds it too, as
    generate's), and a cancel leaves the last token out in the cache (one more than the plain loop's): the slot's
    ids say so, and the next prompt extending them reuses every fed token and decodes as fresh."""
    m, stop = batch_model, batch_model.tokenizer.eos_ids[0]
    ids = list(range(100, 120))
    forced = {len(ids) + 5: stop} if end == "stop id" else {}
    fake = _use(m, monkeypatch, DrawingSlotBackend(m.real_vocab_size, set(m.tokenizer.eos_ids), cache_slots=4,
                                                   forced=forced))
    batch = m.batch(1)
    a = batch.add(ids, max_new_tokens=20, sampling=GREEDY)
    if end == "cancel":
        for _ in range(4):  # the first step prefills and decodes: 5 tokens out
            batch.step()
        batch.cancel(a)
    _drain(batch, [a])
    out = a.stats.token_ids
    assert out == fake.decode_fresh(ids, 5) and a.stats.finish_reason == ("eos" if end == "stop id" else "cancelled")
    fed = ids + out + ([stop] if end == "stop id" else [])
    assert batch._slots[0].ids == fed and fake.fed == len(fed)
    turn = fed + [300, 301]
    c = batch.add(turn, max_new_tokens=3, sampling=GREEDY)
    _drain(batch, [c])
    assert c.stats.token_ids == fake.decode_fresh(turn, 3) and c.stats.cached_tokens == len(fed)


@pytest.mark.parametrize("joiner", [True, False])
def test_batched_rows_run_ahead_and_decode_as_alone(batch_model, monkeypatch, joiner):
    """Three sequences decoding together run ahead as one batched step (GpuBackend.sample_batch_ahead: each row
    fed from its draw slot) once a batched step has drawn them all on the device; one ending on a stop id (the
    other two then in rows 0 and 2 of the steps in flight, not 0 and 1), a budget ending first and a joiner each
    end the chain (the rows in flight read, the next step fed from the host) and it starts again. Every sequence
    decodes what the rule gives it alone (the plain loop's tokens and ends), and each slot's ids are exactly what
    it fed: a prompt extending them reuses every one and decodes as fresh."""
    m, stop = batch_model, batch_model.tokenizer.eos_ids[0]
    prompts = [list(range(100, 110)), list(range(200, 230)), list(range(300, 312))]

    def run(batch_ahead: bool):
        fake = _use(m, monkeypatch, DrawingSlotBackend(m.real_vocab_size, set(m.tokenizer.eos_ids), cache_slots=4,
                                                       forced={len(prompts[1]) + 5: stop}))  # the second's 6th
        fake.batch_ahead = batch_ahead
        batch = m.batch(3)
        gens = [batch.add(p, max_new_tokens=n, sampling=GREEDY) for p, n in zip(prompts, (14, 20, 9))]
        while not gens[1].done:
            batch.step()
        if joiner:
            gens.append(batch.add(list(range(400, 406)), max_new_tokens=6, sampling=GREEDY))  # the second's slot
        _drain(batch, gens)
        return fake, batch, gens

    plain_fake, _, plain = run(False)
    fake, batch, gens = run(True)  # (last: the continuations below run on its backend and slots)
    assert [g.stats.token_ids for g in gens] == [g.stats.token_ids for g in plain]
    assert [g.stats.finish_reason for g in gens] == ["length", "eos", "length", "length"][:len(gens)]
    for g in gens:
        assert g.stats.token_ids == fake.decode_fresh(g.prompt, len(g.stats.token_ids))
    # after the batched step that draws each row's index 1, the chain: rows fed on the device, the plain loop's
    # draw indices (each row's read through its pending token)
    assert fake.batch_steps[0] == [1, 1, 1] and fake.ahead_steps[:5] == [[i] * 3 for i in range(2, 7)]
    assert fake.reads >= sum(map(len, fake.ahead_steps)) and not plain_fake.ahead_steps
    for g in gens:
        fed = list(next(s.ids for s in batch._slots if s.ids[:len(g.prompt)] == g.prompt))
        assert fed[:len(g.prompt) + len(g.stats.token_ids) - 1] == g.prompt + g.stats.token_ids[:-1]
        turn = fed + [50, 51]
        c = batch.add(turn, max_new_tokens=2, sampling=GREEDY)
        _drain(batch, [c])
        assert c.stats.token_ids == fake.decode_fresh(turn, 2) and c.stats.cached_tokens == len(fed)


def test_the_row_left_alone_by_a_stop_is_fed_from_the_host(batch_model, monkeypatch):
    """Two sequences run ahead together; the one in row 0 stops. The other's unread draws sit in draw slot 1,
    which a lone step's run-ahead does not read, so its next step is fed from the host, then it runs ahead alone;
    it decodes what the rule gives it alone, and its slot's ids are what it fed."""
    m, stop = batch_model, batch_model.tokenizer.eos_ids[0]
    a_ids, b_ids = list(range(100, 130)), list(range(200, 210))
    fake = _use(m, monkeypatch, DrawingSlotBackend(m.real_vocab_size, set(m.tokenizer.eos_ids), cache_slots=4,
                                                   forced={len(a_ids) + 4: stop}))
    fake.batch_ahead = True
    batch = m.batch(2)
    a = batch.add(a_ids, max_new_tokens=12, sampling=GREEDY)
    b = batch.add(b_ids, max_new_tokens=12, sampling=GREEDY)
    _drain(batch, [a, b])
    assert a.stats.finish_reason == "eos" and b.stats.token_ids == fake.decode_fresh(b_ids, 12)
    assert fake.ahead_steps and fake.steps  # both chains ran: the batched one, then b's alone
    fed = list(next(s.ids for s in batch._slots if s.ids[:len(b_ids)] == b_ids))
    turn = fed + [50, 51]
    c = batch.add(turn, max_new_tokens=2, sampling=GREEDY)
    _drain(batch, [c])
    assert c.stats.token_ids == fake.decode_fresh(turn, 2) and c.stats.cached_tokens == len(fed)
