"""A JSON row run ahead inside a plain string (batch_ahead.py), on a backend that draws on the device under each
slot's mask (slot_backend.DrawingSlotBackend with set_mask and redraw, as GpuBackend's): the tokens equal those of
the path without masks (json_ahead off: unmasked draws, refused ones redrawn on the host), the slot's history
(which every forward checks) holds exactly what was fed, steps ran ahead and the ones a state change left under a
stale mask were drawn again.

Oracle: the path without masks over the same rule (for the arg-max of a row, the masked draw and the host's
redraw of refused tokens pick the same allowed token), and the JSON automaton over the tokens' bytes."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.json_automaton import SchemaPrefix
from ninfer_rt.json_schema import compile_schema
from ninfer_rt.sampling import SamplingParams
from slot_backend import DrawingSlotBackend

SCHEMA = {"type": "array", "items": {"type": "string"}}


def table(t: int) -> bytes:
    """Token bytes: of every 16 tokens one closes the string, one closes it and opens the next item, one writes an
    escape (the state stays as it was), one opens the array, one the next item after a closed one; the rest are
    letters."""
    return {0: b'"', 1: b'", "', 2: b"\\n", 3: b'["', 4: b', "'}.get(t % 16, bytes([0x61 + t % 26]) * (1 + t % 3))


class MaskingBackend(DrawingSlotBackend):
    """DrawingSlotBackend whose draws read each slot's mask (set_mask: ids out of it drawn as -inf), with
    GpuBackend's redraw of the latest step's row 0 under the mask as it is now."""

    draws_constrained = json_ahead = True

    def __init__(self, vocab: int):
        super().__init__(vocab, set(), cache_slots=2)
        self.masks: dict[int, np.ndarray] = {}  # slot -> bool [vocab] of the ids it may draw
        self.mask_words = -(-vocab // 32)
        self.ahead = self.redraws = 0

    def set_mask(self, cache, bits) -> None:
        if bits is None:
            self.masks.pop(cache.slot, None)
        else:
            self.masks[cache.slot] = np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.vocab].astype(bool)

    def _arg(self, row, slot: int, vocab: int) -> int:
        if slot in self.masks:
            row = np.where(self.masks[slot], row[:self.vocab], -np.inf)
        return super()._arg(row, slot, vocab)

    def sample_ahead(self, cache, params, **kw):
        self.ahead += 1
        return super().sample_ahead(cache, params, **kw)

    def redraw(self, cache, params, *, vocab: int, seed: int, step: int) -> int:
        self.redraws += 1
        self.draw_slot = self._arg(self.rows[0], cache.slot, vocab)
        return self.draw_slot

    def last_logits(self, row: int) -> np.ndarray:
        return self.rows[row].copy()


@pytest.fixture
def json_model(packed_model, monkeypatch):
    """The tiny model with table's bytes, no stop or added ids, on a MaskingBackend."""
    tok = packed_model.tokenizer
    monkeypatch.setattr(tok, "token_bytes", table)
    monkeypatch.setattr(tok, "is_stop", lambda t: False)
    monkeypatch.setattr(tok, "is_added", lambda t: False)
    fake = MaskingBackend(packed_model.real_vocab_size)
    monkeypatch.setattr(packed_model, "_backend", fake)
    packed_model._kept.fresh()
    return packed_model, fake


def _run(model, prompt: list[int], n: int, beside: list[int] | None = None):
    """One JSON row of n tokens after prompt (with another plain row beside it where given): its tokens and
    error."""
    batch = model.batch(2)
    g = batch.add(prompt, max_new_tokens=n, sampling=SamplingParams(greedy=True), json_schema=SCHEMA)
    if beside is not None:
        batch.add(beside, max_new_tokens=n, sampling=SamplingParams(greedy=True))
    while batch.busy:
        batch.step()
    return g.stats.token_ids, g.error


@pytest.mark.parametrize("seed", range(4))
def test_a_json_row_runs_ahead_and_draws_what_the_unmasked_path_draws(json_model, seed):
    model, fake = json_model
    prompt = np.random.default_rng(seed).integers(0, model.real_vocab_size, 12).tolist()
    ahead, error = _run(model, prompt, 60)
    ran, redrawn = fake.ahead, fake.redraws
    fake.json_ahead = False
    assert _run(model, prompt, 60) == (ahead, error) and error is None and len(ahead) == 60
    assert fake.ahead == ran and fake.redraws == redrawn  # (the path without masks runs nothing ahead)
    assert ran > 20 and redrawn > 0
    assert SchemaPrefix(compile_schema(SCHEMA)).feed(b"".join(table(t) for t in ahead))


def test_beside_another_row_it_steps_under_its_masks(json_model):
    """Batched with a plain row, the JSON row runs nothing ahead but still draws under its mask: its tokens are
    those it draws alone, run ahead."""
    model, fake = json_model
    prompt = list(range(40, 52))
    alone, _ = _run(model, prompt, 40)
    fake.ahead = fake.redraws = 0
    batched, error = _run(model, prompt, 40, beside=list(range(60, 70)))
    assert batched == alone and error is None and fake.ahead == 0


def test_its_masks_are_cleared_when_it_ends(json_model):
    model, fake = json_model
    _run(model, list(range(12)), 30)
    assert fake.masks == {}
