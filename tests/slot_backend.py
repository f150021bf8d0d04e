"""A fake backend for tests of what generations keep in cache slots: logits that name a hash of the slot's whole
token history, so a sequence continued from a stale or overwritten slot decodes something else and trips the
slot's own bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer_rt.logprobs import token_logprob


@dataclass
class _SlotCache:
    slot: int
    pos: int = 0


class SlotBackend:
    """A backend with sequence slots like the GPU's (cache_slots, 2 unless told): each slot holds a token history;
    a forward checks the cache's slot still holds what that cache fed (no one else reset or overwrote it) and
    answers logits that peak at a hash of the slot's whole history."""

    max_ctx, exclusive_slots = 4096, True

    def __init__(self, vocab: int, stops: set[int], cache_slots: int = 2):
        self.vocab, self.stops, self.cache_slots = vocab, stops, cache_slots
        self.slots: list[list[int]] = [[] for _ in range(cache_slots)]
        self.fed = 0  # tokens forwarded, for the reuse counts
        self.batches: list[int] = []  # B of each decode_batch call

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

    def decode_batch(self, ids, caches) -> np.ndarray:
        """One token for each of B caches, in distinct slots -> logits [B, V]."""
        assert len({c.slot for c in caches}) == len(caches)
        self.batches.append(len(caches))
        return np.concatenate([self.forward([i], c) for i, c in zip(ids, caches)])


class _Pending:
    """A drawn token handed over later, as GpuBackend's PendingToken (it counts the reads for the tests), with its
    logprobs where the step drew them."""

    def __init__(self, backend: DrawingSlotBackend, token: int, lp=None, row: int = 0, step: int = 0):
        self.backend, self.token, self.lp, self.row, self.step = backend, token, lp, row, step

    def same_step(self, other: _Pending) -> bool:
        return other.backend is self.backend and other.step == self.step

    def result(self) -> int:
        self.backend.reads += 1
        return self.token

    def logprob(self):
        assert self.lp is not None, "logprob() of a step that drew none"
        return self.lp


class DrawingSlotBackend(SlotBackend):
    """SlotBackend with the GPU backend's draws on the device: sample_next (the arg-max over ids < vocab), sample_batch
    (the same for each of B sequences of a batched step), and sample_ahead, whose step is fed the token the latest draw
    left in the draw slot, which the host may not have read yet. forced: {history length: token} overrides pick (a stop
    id where a test wants one)."""

    draws_logprobs = False  # True: sample_batch answers a row's logprobs (token_logprob of its row), as the GPU's
    logprobs_ahead = False  # True: sample_ahead too
    batch_ahead = False  # True: sample_batch_ahead, a batched step fed from the draw slots
    device_penalties = False  # True: greedy rows with penalties draw here too (their state set by set_penalties)

    def __init__(self, vocab: int, stops: set[int], cache_slots: int = 2, forced: dict[int, int] | None = None):
        super().__init__(vocab, stops, cache_slots)
        self.forced = forced or {}
        self.penalty_sets: list[tuple[int, list[int], int]] = []  # set_penalties: (slot, history, prompt length)
        self.draw_slot: int | None = None
        self.steps: list[int] = []  # each draw's index in the seed's stream
        self.batch_steps: list[list[int]] = []  # each batched step's rows' draw indices (sample_batch)
        self.ahead_steps: list[list[int]] = []  # the same for sample_batch_ahead's
        self.draw_rows: list[int | None] = []  # the draw slots (row b: the latest batched draw's token of row b)
        self.rows: list[np.ndarray] = []  # the latest step's logits rows
        self.reads = 0

    def _arg(self, row: np.ndarray, slot: int, vocab: int) -> int:
        """The device's draw of a row of slot's sequence: its arg-max over ids < vocab."""
        return int(np.argmax(row[:vocab]))

    def pick(self, history: list[int]) -> int:
        return self.forced[len(history)] if len(history) in self.forced else super().pick(history)

    def can_sample(self, params) -> bool:
        return params.is_greedy and not params.penalised  # (the GPU's rule, greedy only)

    def can_draw(self, params) -> bool:
        return params.is_greedy and (self.device_penalties or not params.penalised)

    def set_penalties(self, cache, history, prompt_len: int, params) -> None:
        self.penalty_sets.append((cache.slot, list(history), prompt_len))

    def sample_next(self, ids, cache, params, *, vocab: int, seed: int, step: int) -> int:
        self.steps.append(step)
        self.rows = [self.forward(ids, cache)[-1]]
        self.draw_slot = self._arg(self.rows[0], cache.slot, vocab)
        return self.draw_slot

    def sample_batch_ahead(self, caches, params, *, vocab: int, seeds, steps) -> list[_Pending]:
        """sample_batch fed row by row from the draw slots (the latest batched draw's tokens, unread)."""
        assert self.batch_ahead and len(caches) <= len(self.draw_rows)
        fed = self.draw_rows[:len(caches)]
        assert None not in fed, "a row fed from a draw slot no device draw filled"
        self.ahead_steps.append(list(steps))
        self.rows = rows = list(self.decode_batch(fed, caches))
        self.draw_rows = [self._arg(row, c.slot, vocab) for row, c in zip(rows, caches)]
        self.draw_slot = self.draw_rows[0]
        return [_Pending(self, t, row=b, step=len(self.ahead_steps)) for b, t in enumerate(self.draw_rows)]

    def sample_ahead(self, cache, params, *, vocab: int, seed: int, step: int, logprobs=None) -> _Pending:
        assert self.draw_slot is not None, "sample_ahead before any draw"
        assert logprobs is None or self.logprobs_ahead
        token = self.draw_slot
        self.steps.append(step)
        row = self.forward([token], cache)[-1]
        self.rows = [row]
        self.draw_slot = self._arg(row, cache.slot, vocab)
        return _Pending(self, self.draw_slot, None if logprobs is None else
                        token_logprob(row, self.draw_slot, logprobs, vocab))

    def sample_batch(self, ids, caches, params, *, vocab: int, seeds, steps, hidden: bool = False, logprobs=None):
        """Rows whose params are None come back as their logits (the host draws them), as GpuBackend's; a row with
        a logprobs count as the TokenLogprob of its token."""
        assert not hidden and (logprobs is None or self.draws_logprobs)
        self.batch_steps.append([None if p is None else st for p, st in zip(params, steps)])
        self.rows = rows = list(self.decode_batch(ids, caches))
        out = [row.copy() if p is None else self._arg(row, c.slot, vocab) for p, row, c in zip(params, rows, caches)]
        if params[0] is not None:
            self.draw_slot = out[0]  # (the device's draw slot holds row 0's token)
        self.draw_rows = [None if p is None else t for p, t in zip(params, out)]
        for b, n in enumerate(logprobs or []):
            if n is not None and params[b] is not None:
                out[b] = token_logprob(rows[b], out[b], n, vocab)
        return out
