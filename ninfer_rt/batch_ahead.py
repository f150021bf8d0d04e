"""Batch's run-ahead (ninfer_rt.batching): a decode step enqueued before the host reads the token it is fed, which
the device copies from its draw slot, so the worker's hand-off, the next step's planning and its launch overlap the
GPU's step. A sequence alone runs ahead through GpuBackend.sample_ahead (a step and one more queued behind the one
being read); the rows of a batched step through sample_batch_ahead while the running sequences stay the last step's
rows in its order. A stop id, a stop string or a cancel leaves a step in flight spent, its input in the cache: the
slot's ids say so.

A JSON row runs ahead (alone or as a batched step's row) while it writes a plain string (no length or pattern): its
draws are masked on the device to the tokens its constraint allows there (JsonTokens.mask, GpuBackend.set_mask), so
the token a step is fed is always one the constraint takes. A token that keeps the string plain leaves the allowed
set as it was, so the step queued behind it drew under the right mask. One that changes it (the closing quote, a new
item) leaves that step's draw made under the old mask: _settle draws it again from the step's logits under the new
one (the draw the step would have made, had it not run ahead), and that row's chain ends there."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ninfer_rt.errors import NinferError

if TYPE_CHECKING:
    from ninfer_rt.batching import Generation


@dataclass
class AheadStep:
    """A decode step run ahead (GpuBackend.sample_ahead): its draw, not yet read; `at`: when it was enqueued."""

    pending: object
    at: float


class RunAhead:
    """Batch's run-ahead steps (a mixin: it reads Batch's _running, backend, model, _on_device and _emit)."""

    def _run_ahead(self, g: Generation, token: int | None = None) -> None:
        """Where g decodes alone on the device and will need another token, enqueue the next step now
        (GpuBackend.sample_ahead: the draw slot copied on the device), before the token it is fed goes out: the
        worker's hand-off, the next step's planning and its launch then overlap the GPU's step. It is fed `token`
        (just drawn, not yet out), or (None) the draw of g's latest step run ahead, still unread: so a step is
        queued while the host waits for the one before it. A joiner meanwhile is prefilled after them; a stop id,
        a stop string or a cancel leaves the step in flight spent, its input in the cache: the slot's ids say
        so."""
        drawn = len(g.stats.token_ids) + len(g._ahead) + (token is not None)  # the new step's draw's index
        if token is None and g._ahead[-1].pending.row != 0:
            return  # (its unread draw is a batched step's: not in the slot a lone step is fed from)
        if g.constraint is not None:  # a JSON row: only inside a plain string, under that state's mask
            self._sync_mask(g)
            if g._mask is None or g.logprobs is not None:
                return
        if not (len(self._running) == 1 and g.spec is None
                and (g.logprobs is None or getattr(self.backend, "logprobs_ahead", False))
                and hasattr(self.backend, "sample_ahead")
                and drawn < g.budget and (token is None or not self.model.tokenizer.is_stop(token))):
            return
        pending = self.backend.sample_ahead(g._slot.cache, g.sampler.params, vocab=self.model.real_vocab_size,
                                            seed=g.sampler.seed, step=drawn,
                                            **({} if g.logprobs is None else {"logprobs": g.logprobs}))
        if token is not None:  # (else the draw it is fed goes into the ids when read: _take_ahead)
            g._slot.ids.append(token)
        g._ahead.append(AheadStep(pending, time.perf_counter()))

    def _run_rows_ahead(self, gens: list[Generation], tokens: list[int] | None = None) -> None:
        """_run_ahead for a batched step: where the running sequences are the rows of the last batched step, in
        its order, each drawn on the device with nothing the host must see (no logprobs or speculation; JSON only
        inside a plain string, under its mask) and each with a token to go, enqueue the next batched step now
        (GpuBackend.sample_batch_ahead: row b fed from draw slot b on the device, where the backend's batch_ahead
        is on). Fed `tokens` (just drawn, not yet out) or the rows' draws of the step run ahead last, still unread.
        A joiner, a sequence that ends or a cancel ends the chain: the rows in flight are read, and the next step is
        fed from the host."""
        n = len(gens)
        if not (n > 1 and len(self._running) == n and getattr(self.backend, "batch_ahead", False)):
            return
        last = None if tokens is not None else [g._ahead[-1].pending if g._ahead else None for g in gens]
        steps = [len(g.stats.token_ids) + len(g._ahead) + (tokens is not None) for g in gens]  # the draws' indices
        for b, (g, drawn) in enumerate(zip(gens, steps)):
            if not (g.spec is None and g.logprobs is None and self._on_device(g) and drawn < g.budget
                    and (g.constraint is None or self._sync_mask(g) is not None)):  # JSON: in a plain string
                return
            if tokens is not None and self.model.tokenizer.is_stop(tokens[b]):
                return
            if last is not None and (last[b] is None or last[b].row != b or not last[b].same_step(last[0])):
                return  # (the draw slots no longer hold these rows' tokens in this order)
        pending = self.backend.sample_batch_ahead(
            [g._slot.cache for g in gens], [g.sampler.params for g in gens], vocab=self.model.real_vocab_size,
            seeds=[g.sampler.seed for g in gens], steps=steps)
        now = time.perf_counter()
        for b, g in enumerate(gens):
            if tokens is not None:  # (else the draw it is fed goes into the ids when read)
                g._slot.ids.append(tokens[b])
            g._ahead.append(AheadStep(pending[b], now))

    def _take_rows_ahead(self, gens: list[Generation]) -> None:
        """_take_ahead for the rows of a batched step run ahead: the next one queued behind it first (where the
        batch is as it was), then each row's token read and given out."""
        self._run_rows_ahead(gens)
        for g in gens:
            self._read_ahead(g)

    def _take_ahead(self, g: Generation) -> None:
        """g's decode this step: the token of its oldest step run ahead (that step's input is fed already), read
        once the next step is queued behind it."""
        self._run_ahead(g)
        self._read_ahead(g)

    def _read_ahead(self, g: Generation) -> None:
        """The token of g's oldest step run ahead (with its logprobs record where g asked), given out."""
        first = g._ahead.pop(0)
        token = first.pending.result()
        if g.logprobs is not None:
            g._drawn = first.pending.logprob()
        g.stats.decode_s += time.perf_counter() - max(first.at, g._ahead_read)  # one step's time, overlap too
        g._ahead_read = time.perf_counter()
        if g._ahead:  # the step queued behind it was fed this token
            g._slot.ids.append(token)
        stale = False
        if g.constraint is not None:  # drawn under the mask of g's state: always allowed
            mask, g.constraint = g._mask, self._allows(g.constraint, token)
            if g.constraint is None:
                raise NinferError(f"token {token}, drawn under the JSON mask, was refused by the constraint")
            stale = self._sync_mask(g) is not mask
        self._emit(g, token)
        if stale and g._ahead and not g.done:
            self._settle(g)

    def _sync_mask(self, g: Generation):
        """Set g's slot's mask to its constraint's allowed tokens where it writes a plain string and the backend
        masks JSON rows (GpuBackend.json_ahead), else to none, where it is not so already; returns it. An equal
        state gives the same (cached) array, so a token that leaves the state as it was uploads nothing."""
        if g._mask_of is g.constraint:  # (a token that keeps a plain string plain leaves the very same state)
            return g._mask
        g._mask_of, want = g.constraint, None
        if g.constraint is not None and getattr(self.backend, "json_ahead", False):
            want = self._tokens().mask(g.constraint, self.backend.mask_words)
        if want is not g._mask:
            self.backend.set_mask(g._slot.cache, want)
            g._mask = want
        return want

    def _settle(self, g: Generation) -> None:
        """g's step run ahead behind a token that changed its JSON state (so its draw was masked for the state
        before): once it is done, its token (its row of a batched step) drawn again from its logits under the new
        state's mask (or none, then checked by the constraint as _device_pick checks a device draw), given out; g
        then goes on from the host. (Nothing is queued behind that step: the run-ahead queues one step beyond the
        one read.)"""
        t0 = time.perf_counter()
        pending = g._ahead.pop(0).pending
        pending.result()  # the step is done: its logits are the latest
        token = self.backend.redraw(g._slot.cache, g.sampler.params, vocab=self.model.real_vocab_size,
                                    seed=g.sampler.seed, step=len(g.stats.token_ids), row=pending.row)
        token = self._device_pick(g, pending.row, token)
        g.stats.decode_s += time.perf_counter() - t0
        if isinstance(token, Exception):
            self._fail(g, token)
        else:
            self._emit(g, token)
