"""generate(reuse_cache=True, snapshot_at=...): what a generation leaves for the next (the resident cache and a
prefix snapshot, each in its own slot) and when it is reused.

Oracles: fresh runs of the same prompts (reuse_cache off), and slot_backend.SlotBackend, whose logits hash the
whole token history of the slot a cache names, so a run continued from a stale or overwritten slot decodes
something else and trips the slot's own bookkeeping.
"""

from __future__ import annotations

import random

import pytest

from ninfer_rt import load
from ninfer_rt.sampling import SamplingParams
from slot_backend import SlotBackend

GREEDY = SamplingParams(greedy=True)


@pytest.fixture(scope="module")
def model(packed_model):
    return packed_model


def test_kept_caches_never_serve_a_stale_slot(model, monkeypatch):
    """Random conversations of turns that extend the last run, share only a boundary prefix, or start over, with
    and without a snapshot: every run decodes what a fresh run decodes (computed from the fake's rule alone), and
    prefills only what its source lacks."""
    fake = SlotBackend(model.real_vocab_size, set(model.tokenizer.eos_ids))
    monkeypatch.setattr(model, "_backend", fake)
    model._kept.fresh()
    rng = random.Random(11)
    toks = lambda n: [rng.randrange(100, model.real_vocab_size) for _ in range(n)]  # noqa: E731
    prompt, reused = toks(12), {"resident": 0, "snapshot": 0}
    snapshot_ids = None
    for _ in range(300):
        want = fake.decode_fresh(prompt, 4)
        boundary = rng.choice([None, rng.randrange(1, len(prompt))])
        fed = fake.fed
        got = list(model.generate_ids(prompt, max_new_tokens=4, sampling=GREEDY, reuse_cache=True,
                                      snapshot_at=boundary))
        cached = model.last_stats.cached_tokens
        assert got == want
        assert fake.fed - fed == len(prompt) - cached + 3  # the prompt's rest, then the outputs but the last
        if cached:
            reused["snapshot" if snapshot_ids is not None and cached == len(snapshot_ids) else "resident"] += 1
        if boundary is not None and cached < boundary:
            snapshot_ids = prompt[:boundary]
        kind = rng.choice(["extend", "boundary", "new"])
        if kind == "extend":   # an agent's next turn: everything so far, then a tool result
            prompt = prompt + got + toks(rng.randrange(1, 5))
        elif kind == "boundary" and snapshot_ids is not None:  # a chat's next turn: the reply re-rendered
            prompt = snapshot_ids + toks(rng.randrange(2, 6))
        else:
            prompt = toks(rng.randrange(3, 12))
    assert min(reused.values()) > 30  # the conversation exercised both kinds of reuse


def test_interleaved_generations_never_share_a_slot(model, monkeypatch):
    """A generation left suspended while another (or logits) takes its slot stops with an error when resumed, and
    closing it leaves nothing behind: the next reuse continues the later run's cache, as a fresh run decodes."""
    from ninfer_rt.errors import NinferError

    fake = SlotBackend(model.real_vocab_size, set(model.tokenizer.eos_ids))
    monkeypatch.setattr(model, "_backend", fake)
    model._kept.fresh()
    a_ids, b_ids = list(range(100, 120)), list(range(200, 215))
    a = model.generate_ids(a_ids, max_new_tokens=6, sampling=GREEDY, reuse_cache=True)
    a_out = [next(a), next(a)]
    b_out = list(model.generate_ids(b_ids, max_new_tokens=4, sampling=GREEDY, reuse_cache=True))
    with pytest.raises(NinferError, match="took this generation's sequence slot"):
        next(a)
    a.close()
    turn = b_ids + b_out + [300, 301]
    assert list(model.generate_ids(turn, max_new_tokens=4, sampling=GREEDY, reuse_cache=True)) == \
        fake.decode_fresh(turn, 4)
    assert model.last_stats.cached_tokens == len(b_ids) + 3 and a_out == fake.decode_fresh(a_ids, 2)
    # logits() resets slot 0 under a suspended run in it
    c = model.generate_ids(a_ids, max_new_tokens=6, sampling=GREEDY, reuse_cache=True)
    next(c)
    model.logits([1, 2, 3])
    with pytest.raises(NinferError, match="took this generation's sequence slot"):
        next(c)


def test_a_regenerated_turn_keeps_its_snapshot(model, monkeypatch):
    """Asking the same turn again starts from the snapshot at its history and keeps it for the turn after."""
    fake = SlotBackend(model.real_vocab_size, set(model.tokenizer.eos_ids))
    monkeypatch.setattr(model, "_backend", fake)
    model._kept.fresh()
    ids = list(range(100, 140))
    cached = []
    for _ in range(4):
        got = list(model.generate_ids(ids, max_new_tokens=4, sampling=GREEDY, reuse_cache=True, snapshot_at=30))
        assert got == fake.decode_fresh(ids, 4)
        cached.append(model.last_stats.cached_tokens)
    assert cached == [0, 30, 30, 30]


def test_a_chat_turn_continues_from_the_snapshot(model, monkeypatch):
    """The next turn of a chat, whose template drops this turn's reasoning, shares the history up to the
    boundary: it prefills from the snapshot, not from scratch, and decodes what a fresh run decodes."""
    chat = [{"role": "user", "content": "Tell me about the garden."}]
    history = model.tokenizer.encode(model.chat_template.render(chat))
    ids = model.prompt_ids(messages=chat)
    assert ids[:len(history)] == history and len(ids) > len(history)
    first = "".join(model.generate(ids, max_new_tokens=6, sampling=GREEDY, reuse_cache=True,
                                   snapshot_at=len(history)))
    turn = chat + [{"role": "assistant", "content": first}, {"role": "user", "content": "And the house?"}]
    ids2 = model.prompt_ids(messages=turn)
    assert ids2[:len(ids)] != ids  # the reply's turn re-renders differently: the resident cannot serve it
    fresh = list(model.generate_ids(ids2, max_new_tokens=6, sampling=GREEDY))
    list(model.generate_ids(ids, max_new_tokens=6, sampling=GREEDY, reuse_cache=True, snapshot_at=len(history)))
    again = list(model.generate_ids(ids2, max_new_tokens=6, sampling=GREEDY, reuse_cache=True))
    assert again == fresh and model.last_stats.cached_tokens == len(history)


def test_one_cache_slot_keeps_no_snapshot(packed, monkeypatch):
    """load(cache_slots=1) (serve --no-prefix-snapshot): snapshot_at is ignored, and the prompt goes in whole."""
    m = load(packed, "cpu", cache_slots=1)
    try:
        fake = SlotBackend(m.real_vocab_size, set(m.tokenizer.eos_ids))
        fake.cache_slots = 1
        monkeypatch.setattr(m, "_backend", fake)
        calls = []
        forward = fake.forward
        monkeypatch.setattr(fake, "forward", lambda ids, cache, last_only=False: calls.append(len(ids)) or
                            forward(ids, cache, last_only))
        ids = list(range(100, 140))
        list(m.generate_ids(ids, max_new_tokens=2, sampling=GREEDY, reuse_cache=True, snapshot_at=30))
        assert not m.can_snapshot and m._kept.snapshot is None and calls == [40, 1]
        list(m.generate_ids(ids[:30] + [7, 8], max_new_tokens=2, sampling=GREEDY, reuse_cache=True))
        assert m.last_stats.cached_tokens == 0
    finally:
        m.close()


def test_snapshot_at_is_checked(model):
    from ninfer_rt.errors import NinferError

    for bad in (0, 5, -1, 2.0, True):
        with pytest.raises(NinferError, match="snapshot_at"):
            model.generate_ids([1, 2, 3, 4, 5], reuse_cache=True, snapshot_at=bad)
    with pytest.raises(NinferError, match="needs reuse_cache"):
        model.generate_ids([1, 2, 3, 4, 5], snapshot_at=2)
    for bad in (0, 65, 2.0, True):
        with pytest.raises(NinferError, match=rf"cache_slots={bad!r}: must be an integer in \[1, 64\]"):
            load("nothing.ninfer", cache_slots=bad)
