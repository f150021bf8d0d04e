"""generate(reuse_cache=True, snapshot_at=...): what a generation leaves for the next (the resident cache and a
prefix snapshot, each in its own slot) and when it is reused.

Oracles: fresh runs of the same prompts (reuse_cache off), and a fake two-slot backend whose logits hash the
whole token history of the slot a cache names, so a run continued from a stale or overwritten slot decodes
something else and trips the slot's own bookkeeping.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from ninfer_rt import load
from ninfer_rt.sampling import SamplingParams

GREEDY = SamplingParams(greedy=True)


@pytest.fixture(scope="module")
def model(packed_model):
    return packed_model


@dataclass
class _SlotCache:
    slot: int
    pos: int = 0


class TwoSlots:
    """A backend with two sequence slots like the GPU's (cache_slots = 2): each slot holds a token history;
    a forward checks the cache's slot still holds what that cache fed (no one else reset or overwrote it) and
    answers logits that peak at a hash of the slot's whole history."""

    cache_slots, max_ctx, exclusive_slots = 2, 4096, True

    def __init__(self, vocab: int, stops: set[int]):
        self.vocab, self.stops = vocab, stops
        self.slots: list[list[int]] = [[], []]
        self.fed = 0  # tokens forwarded, for the reuse counts

    def new_cache(self, slot: int = 0) -> _SlotCache:
        self.slots[slot] = []
        return _SlotCache(slot)

    def copy_cache(self, cache: _SlotCache, slot: int) -> _SlotCache:
        assert slot != cache.slot and len(self.slots[cache.slot]) == cache.pos
        self.slots[slot] = list(self.slots[cache.slot])
        return _SlotCache(slot, cache.pos)

    def forward(self, ids, cache: _SlotCache, last_only: bool = False) -> np.ndarray:
        history = self.slots[cache.slot]
        assert len(history) == cache.pos, "the slot was reset or overwritten under a live cache"
        history.extend(int(i) for i in ids)
        cache.pos += len(ids)
        self.fed += len(ids)
        logits = np.zeros((1, self.vocab), np.float32)
        logits[0, self.pick(history)] = 1.0
        return logits

    def pick(self, history: list[int]) -> int:
        """The token forward answers after history (the oracle for any run, fresh or continued)."""
        pick = hash(tuple(history)) % self.vocab
        while pick in self.stops:
            pick = (pick + 1) % self.vocab
        return pick

    def decode_fresh(self, prompt: list[int], n: int) -> list[int]:
        """What greedy decoding of n tokens after prompt gives, by the rule alone (no slot touched)."""
        history, out = list(prompt), []
        for _ in range(n):
            out.append(self.pick(history))
            history.append(out[-1])
        return out


def test_kept_caches_never_serve_a_stale_slot(model, monkeypatch):
    """Random conversations of turns that extend the last run, share only a boundary prefix, or start over, with
    and without a snapshot: every run decodes what a fresh run decodes (computed from the fake's rule alone), and
    prefills only what its source lacks."""
    fake = TwoSlots(model.real_vocab_size, set(model.tokenizer.eos_ids))
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

    fake = TwoSlots(model.real_vocab_size, set(model.tokenizer.eos_ids))
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
    fake = TwoSlots(model.real_vocab_size, set(model.tokenizer.eos_ids))
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
        fake = TwoSlots(m.real_vocab_size, set(m.tokenizer.eos_ids))
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
    with pytest.raises(NinferError, match="cache_slots=3: must be 1 or 2"):
        load("nothing.ninfer", cache_slots=3)
