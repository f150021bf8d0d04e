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

    draws_constrained = json_ahead = batch_ahead = True

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

    def redraw(self, cache, params, *, vocab: int, seed: int, step: int, row: int = 0) -> int:
        self.redraws += 1
        token = self._arg(self.rows[row], cache.slot, vocab)
        if row < len(self.draw_rows):
            self.draw_rows[row] = token
        if row == 0:
            self.draw_slot = token
        return token

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


def _run(model, prompt: list[int], n: int, beside: list[int] | None = None, json_beside: bool = False):
    """One JSON row of n tokens after prompt (with another row beside it where given, JSON too where json_beside):
    each row's tokens and error."""
    batch = model.batch(2)
    gens = [batch.add(prompt, max_new_tokens=n, sampling=SamplingParams(greedy=True), json_schema=SCHEMA)]
    if beside is not None:
        gens.append(batch.add(beside, max_new_tokens=n, sampling=SamplingParams(greedy=True),
                              json_schema=SCHEMA if json_beside else None))
    while batch.busy:
        batch.step()
    out = [(g.stats.token_ids, g.error) for g in gens]
    return out[0] if beside is None else out


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


@pytest.mark.parametrize("json_beside", [False, True], ids=["beside a plain row", "beside a JSON row"])
def test_in_batched_steps_it_runs_ahead_as_it_runs_alone(json_model, json_beside):
    """Batched with another row (plain or JSON), the JSON row runs ahead in batched steps (sample_batch_ahead), a
    row's step left under a stale mask drawn again from its own row: each row's tokens are those it draws alone,
    and those of the unmasked path."""
    model, fake = json_model
    prompts = [list(range(40, 52)), list(range(60, 70))]
    alone = [_run(model, p, 40) if json_beside or i == 0 else None for i, p in enumerate(prompts)]
    fake.redraws, fake.ahead_steps = 0, []
    batched = _run(model, prompts[0], 40, beside=prompts[1], json_beside=json_beside)
    assert batched[0] == alone[0] and alone[0][1] is None and len(alone[0][0]) == 40
    if json_beside:
        assert batched[1] == alone[1]
    assert len(fake.ahead_steps) > 10 and fake.redraws > 0
    fake.json_ahead = False
    assert _run(model, prompts[0], 40, beside=prompts[1], json_beside=json_beside) == batched


def test_its_masks_are_cleared_when_it_ends(json_model):
    model, fake = json_model
    _run(model, list(range(12)), 30)
    assert fake.masks == {}
