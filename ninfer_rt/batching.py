"""Continuous batching: sequences join and leave a running batch between decode steps.

    model = load("model.ninfer", "cuda", cache_slots=5)
    batch = Batch(model, parallel=4)                 # up to 4 sequences at once; a spare slot keeps prefixes
    g = batch.add(ids, max_new_tokens=256, sampling=SamplingParams(temperature=0.7), stop=["\\n\\n"])
    while batch.busy:
        batch.step()                                 # a prefill chunk for joiners, one decode step for the rest
        print("".join(g.take()), end="")             # text since the last take; g.done, g.stats, g.error

Each sequence runs in a cache slot of its own (on the GPU: its own KV cache and DeltaNet state). A step feeds every
decoding sequence's last token through one batched forward (the decode kernels take B sequences at once: a dense
weight is read once for all of them, the MoE's experts for each one's own choice) and draws each next token with
the sequence's own sampler. A joining
prompt is prefilled `prefill_chunk` tokens a step, so a long prompt delays the others by one chunk a step rather
than by its whole prefill (vLLM's chunked prefill, simplified: the chunk runs beside the decode, not in its launch).

Slots remember what their last sequence fed them. A new prompt that extends those ids exactly (an agent's next turn
after a tool call) takes that slot and prefills only the rest: multi-slot prefix reuse, as llama.cpp's server slots
do. With snapshot_at, a copy of the cache after the prompt's first snapshot_at tokens goes into an idle slot, from
which a chat's next turn (whose template re-renders this turn's reply) continues. Idle slots go least recently
used first. The recurrent state cannot rewind, so a slot serves only a prompt that extends its ids.

With a model loaded with speculative_tokens, a sequence that decodes alone takes speculative steps (the MTP head's
drafts verified together: ninfer_rt.speculative.Speculator), as llama.cpp's server drafts per slot. Its slot keeps
the head's state beside its cache, so a prompt that extends the slot's ids (or a snapshot's) drafts from the head's
whole history. A batched step keeps each such sequence's post-norm hidden row for its head (the pair waits, as a
step without drafts leaves it), so once the sequence decodes alone again it drafts on from its whole history.
Logprobs and JSON constraints decode plainly. A stop id among a step's kept drafts is in the cache, as verified: a
next prompt that does not carry it does not extend that slot.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from ninfer_rt.api import GenerationStats, Model, is_int_arg
from ninfer_rt.batch_ahead import AheadStep, RunAhead
from ninfer_rt.errors import NinferError
from ninfer_rt.json_automaton import SchemaPrefix
from ninfer_rt.json_tokens import JsonTokens
from ninfer_rt.json_schema import JSON_OBJECT, Node, SchemaError, compile_schema
from ninfer_rt.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprob
from ninfer_rt.sampling import Sampler, SamplingParams
from ninfer_rt.speculative import DraftPlanner, HeadState, Speculator
from ninfer_rt.stops import StopScanner, stop_strings

PREFILL_CHUNK = 2048  # prompt tokens a joining sequence feeds a step
PROMPT_LOGPROBS_CHUNK = 64  # ... where its prompt's logprobs are asked for (every row's logits come to the host)
JSON_DRAWS = 16  # draws a JSON-constrained token gets, refused ones masked out, before the likeliest allowed one
BATCHED_HEAD_ROWS = 1024  # a speculating sequence's head rows batched steps leave waiting (8 KB each at H = 2048)


@dataclass
class _Slot:
    """A backend cache slot: the cache in it and exactly the ids that cache holds (None: unknown, reset on use)."""

    index: int
    cache: object | None = None
    ids: list[int] | None = None
    ticket: int = 0      # the model's ownership ticket of the slot's last writer (api._KeptCaches.claim)
    used: int = 0        # when it was last taken, filled or left, for least-recently-used eviction
    busy: bool = False
    head: HeadState | None = None  # the MTP head's state of these ids (speculative models), None where unknown

    def forget(self) -> None:
        """The slot's contents are unknown (reset on next use)."""
        self.cache = self.ids = self.head = None


class Generation:
    """One sequence of a Batch: its text pieces as they come (take()), each output token's log-probability where
    asked (take_logprobs()), and when `done`, its stats (GenerationStats: finish_reason eos, length, stop or
    cancelled) or an `error` (an exception; finish_reason "error") instead."""

    def __init__(self, ids: list[int], budget: int, params: SamplingParams, stops: list[str], detok,
                 snapshot_at: int | None, logprobs: int | None = None, prompt_logprobs: int | None = None,
                 json_schema: Node | None = None):
        self.prompt, self.budget, self.snapshot_at = ids, budget, snapshot_at
        self.logprobs = logprobs  # None: none; n: each token's logprob and its n most likely alternatives'
        self.prompt_logprobs = prompt_logprobs  # the same for the prompt's tokens
        self._logprobs: list[TokenLogprob] = []
        # the first prompt token's logprob is NaN: nothing precedes it
        self._prompt_lp = [TokenLogprob(ids[0], math.nan)] if prompt_logprobs is not None else []
        self._drawn: TokenLogprob | None = None  # the last draw's, kept once the token is
        self.sampler = Sampler(params)
        self.constraint = SchemaPrefix(json_schema) if json_schema is not None else None  # the output is JSON
        self.stats = GenerationStats(prompt_tokens=len(ids))
        self.history = list(ids)  # prompt and output, for the sampler's penalties
        self._pen_synced = False  # the device's penalty state of its slot is history's (Batch._sync_penalties)
        self._mask = None  # the allowed-token mask its slot's draws have now (Batch._sync_mask; None: none)
        self._mask_of: SchemaPrefix | None = None  # the constraint state _mask was found for
        self.done = False
        self.error: BaseException | None = None
        self._pieces: list[str] = []
        self._scan, self._detok = StopScanner(stops), detok
        self._slot: _Slot | None = None
        self._fed = 0                  # prompt tokens in the cache
        self._next: int | None = None  # the token the next decode step feeds
        self._ahead: list[AheadStep] = []  # steps run ahead (Batch._run_ahead), oldest first: their draws unread,
                                        # each fed the draw of the one before it
        self._ahead_read = 0.0          # when the last of them was read
        self.spec: Speculator | None = None  # its speculative steps (Batch.add), while the head keeps up

    def take(self) -> list[str]:
        """The text pieces produced since the last take."""
        out, self._pieces = self._pieces, []
        return out

    def take_prompt_logprobs(self) -> list[TokenLogprob]:
        """The prompt tokens' log-probabilities computed since the last take (the first token's is NaN: nothing
        precedes it); all of them are in before the first output token."""
        out, self._prompt_lp = self._prompt_lp, []
        return out

    def take_logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities of the output tokens kept since the last take (every token of
        stats.token_ids, in order; none unless the generation asked for logprobs)."""
        out, self._logprobs = self._logprobs, []
        return out


def check_batch(model: Model, parallel: int | None, prefill_chunk: int | None) -> tuple[int, int]:
    """(parallel, prefill_chunk) with their defaults (every slot; PREFILL_CHUNK), or NinferError where the model's
    slots cannot hold them: what Batch takes, checked before any is made (serve, at its start)."""
    slots = getattr(model._backend, "cache_slots", 1)
    parallel = slots if parallel is None else parallel
    prefill_chunk = PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
    if not (type(parallel) is int and 1 <= parallel <= slots):  # type: True is not one generation
        raise NinferError(f"parallel={parallel!r}: must be in [1, {slots}] (the model's cache_slots)")
    if not (type(prefill_chunk) is int and prefill_chunk >= 1):
        raise NinferError(f"prefill_chunk={prefill_chunk!r}: must be an integer >= 1")
    return parallel, prefill_chunk


class Batch(RunAhead):
    """Runs up to `parallel` Generations of `model` at once over its cache slots (load's cache_slots: at least
    parallel; slots beyond it keep prefixes only). The batch owns every slot: a Model.generate or logits started
    meanwhile takes slot 0 from it, and the batch's sequence there fails at its next step."""

    def __init__(self, model: Model, parallel: int | None = None, prefill_chunk: int | None = None):
        """parallel: at most this many generations at once (default: every slot); prefill_chunk: prompt tokens a
        joining generation feeds a step (default PREFILL_CHUNK)."""
        slots = getattr(model._backend, "cache_slots", 1)
        parallel, prefill_chunk = check_batch(model, parallel, prefill_chunk)
        self.model, self.parallel, self.prefill_chunk = model, parallel, prefill_chunk
        self._kept = model._kept
        self._kept.resident = self._kept.snapshot = None  # what generate kept lives in slots the batch now owns
        self._slots = [_Slot(i) for i in range(slots)]
        self._running: list[Generation] = []
        self._clock = itertools.count(1)
        self._json: JsonTokens | None = None  # the vocabulary's JSON rules and masks, made for the first JSON row

    @property
    def backend(self):
        return self.model._backend  # read at each use: tests wrap it

    @property
    def busy(self) -> bool:
        """Whether any generation is still running."""
        return bool(self._running)

    @property
    def free(self) -> int:
        """How many more generations may join now."""
        return self.parallel - len(self._running)

    def add(self, ids: list[int], *, max_new_tokens: int = 256, sampling: SamplingParams | None = None,
            stop: str | list[str] | None = None, snapshot_at: int | None = None,
            logprobs: int | None = None, prompt_logprobs: int | None = None,
            json_object: bool = False, json_schema: Node | dict | None = None,
            skip_special_tokens: bool = False) -> Generation:
        """Start a generation of prompt ids (checked as Model.generate checks them); it runs from the next step.
        logprobs: report each output token's log-probability and its `logprobs` (0..20) most likely alternatives'
        (ninfer_rt.logprobs; on the GPU computed where its tokens are drawn, else its tokens are drawn on the host
        from their logits). prompt_logprobs: the same for every prompt
        token (the whole prompt is then prefilled, no cached prefix reused). max_new_tokens 0 only prefills the
        prompt (finish_reason "length"), leaving it in a slot for a later request to extend, as llama.cpp's
        n_predict 0 does. json_object: the output is a JSON object (json_schema.JSON_OBJECT; its tokens are then
        drawn on the host, each draw the constraint refuses masked out and drawn again, and a stop token only once
        the object has closed). json_schema (a schema dict, or json_schema.compile_schema's Node): the same
        against it, the stop token once the value it accepts is complete. skip_special_tokens: special tokens
        (<|im_start|>, ...; not <think> or <tool_call>) stay out of the text. NinferError when the batch is full or the
        request is bad."""
        ids = self.model.check_ids(ids)
        if not ids:
            raise NinferError("prompt is empty: there is nothing to continue from")
        if not (is_int_arg(max_new_tokens) and max_new_tokens >= 0):  # False and 0.0 are not 0
            raise NinferError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 0")
        prefill_only = max_new_tokens == 0  # the prompt fed (and scored where asked), nothing drawn
        params, budget = self.model._check_request(ids, 1 if prefill_only else max_new_tokens, sampling, True,
                                                   snapshot_at)
        budget = 0 if prefill_only else budget
        stops = stop_strings(stop)
        if json_schema is not None and not isinstance(json_schema, Node):  # a schema as a request carries it
            try:
                json_schema = compile_schema(json_schema)
            except SchemaError as e:
                raise NinferError(str(e)) from None
        for name, n in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if n is not None and not (is_int_arg(n) and 0 <= n <= MAX_TOP_LOGPROBS):
                raise NinferError(f"{name}={n!r}: must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.free <= 0:
            raise NinferError(f"the batch is full: {self.parallel} generations are running")
        g = Generation(ids, budget, params, stops, self.model.tokenizer.detokenizer(skip_special_tokens), snapshot_at,
                       logprobs, prompt_logprobs, JSON_OBJECT if json_object and json_schema is None else json_schema)
        g._slot = slot = self._take_slot(ids, reuse=prompt_logprobs is None)
        g._fed = g.stats.cached_tokens = len(slot.ids)
        self._speculate(g)
        self._running.append(g)
        self.model.last_stats = g.stats  # Model's: the stats of the generation started last
        return g

    def cancel(self, g: Generation) -> None:
        """End a running generation now (finish_reason "cancelled"); its slot keeps what it fed."""
        if not g.done:
            self._finish(g, "cancelled")

    def step(self) -> None:
        """Feed one prefill chunk of each joining generation, then one batched decode step of the others (a
        sequence whose step ran ahead takes that step's token instead)."""
        ahead = [g for g in self._running if g._ahead]
        if len(ahead) > 1:  # the rows of a batched step run ahead, read together
            self._guard(ahead, self._take_rows_ahead)
        elif ahead:
            self._guard(ahead, lambda gens: self._take_ahead(gens[0]))
        for g in [g for g in self._running if g._next is None]:
            self._guard([g], lambda gens: self._prefill_chunk(gens[0]))
        decoding = [g for g in self._running if g._next is not None and g not in ahead]
        if len(decoding) == 1 and decoding[0].spec is not None:
            self._guard(decoding, lambda gens: self._spec_decode(gens[0]))
        elif decoding:
            self._guard(decoding, self._decode)

    # ------------------------------------------------------------------------------------------- slots

    def _owns(self, slot: _Slot) -> bool:
        return self._kept.owns(slot.index, slot.ticket)

    def _take_slot(self, ids: list[int], reuse: bool = True) -> _Slot:
        """The idle slot whose ids ids extend the furthest (where reuse); else the least recently used idle one,
        emptied."""
        idle = [s for s in self._slots if not s.busy]
        fits = [s for s in idle if reuse and s.cache is not None and s.ids is not None and self._owns(s)
                and len(s.ids) < len(ids) and ids[:len(s.ids)] == s.ids]
        slot = max(fits, key=lambda s: len(s.ids), default=None)
        if slot is None:
            slot = min(idle, key=lambda s: s.used)
            slot.cache, slot.ids, slot.head = self.backend.new_cache(slot.index), [], None
        slot.busy, slot.used, slot.ticket = True, next(self._clock), self._kept.claim(slot.index)
        return slot

    def _snapshot(self, g: Generation) -> None:
        """Copy g's cache (its prompt's first snapshot_at tokens) into the least recently used idle slot."""
        idle = [s for s in self._slots if not s.busy]
        if not idle:
            return
        dst = min(idle, key=lambda s: s.used)
        src = g._slot
        dst.cache, dst.ids = self.backend.copy_cache(src.cache, dst.index), list(src.ids)
        dst.head = None if src.head is None else src.head.copy(self.backend.copy_draft_cache(src.head.cache,
                                                                                             dst.cache))
        dst.used, dst.ticket = next(self._clock), self._kept.claim(dst.index)

    # ------------------------------------------------------------------------------------------- steps

    def _guard(self, gens: list[Generation], run) -> None:
        """run(gens) for those whose slots are still theirs (a slot someone else took fails its generation first);
        if it raises, those generations fail with the exception and their slots' contents are unknown (reset on
        next use)."""
        lost = [g for g in gens if not self._owns(g._slot)]
        for g in lost:
            g._slot.forget()
            self._fail(g, NinferError("a later generation (or logits) took this generation's sequence slot"))
        gens = [g for g in gens if g not in lost]
        if not gens:
            return
        try:
            run(gens)
        except Exception as e:
            for g in gens:
                g._slot.forget()
                self._fail(g, e)

    def _prefill_chunk(self, g: Generation) -> None:
        """Feed the next chunk of g's prompt (up to its snapshot point first); on the last, draw its first token."""
        t0 = time.perf_counter()
        scored = g.prompt_logprobs is not None
        end = min(len(g.prompt), g._fed + (min(self.prefill_chunk, PROMPT_LOGPROBS_CHUNK) if scored
                                           else self.prefill_chunk))
        snap = g.snapshot_at if g.snapshot_at is not None and g._fed <= g.snapshot_at else None
        if snap is not None and end >= snap:
            end = snap
        last = end == len(g.prompt)
        token = None
        if end > g._fed:
            chunk = np.asarray(g.prompt[g._fed:end], np.int64)
            if scored:  # every row: row j is the distribution of prompt token fed + j + 1
                rows = self.backend.forward(chunk, g._slot.cache, last_only=False)
                vocab = self.model.real_vocab_size
                g._prompt_lp += [token_logprob(row, g.prompt[p], g.prompt_logprobs, vocab)
                                 for p, row in enumerate(rows[:end - g._fed - last], g._fed + 1)]
                token = self._draw(g, rows[-1]) if last and g.budget else None
            elif g.spec is not None:  # the rows' hidden states kept for the head
                token = g.spec.prefill(chunk, last and g.budget > 0)
                g._pen_synced = False
            elif last and g.budget and self._on_device(g) and g.logprobs is None and g.constraint is None:
                token = self._device_draw(g, chunk)
            else:
                logits = self.backend.forward(chunk, g._slot.cache, last_only=True)[-1]
                token = self._draw(g, logits) if last and g.budget else None
            g._slot.ids.extend(g.prompt[g._fed:end])
            g._fed = end
        if snap is not None and end == snap:
            g.snapshot_at = None
            if self.model.can_snapshot:
                self._snapshot(g)
        g.stats.prefill_s += time.perf_counter() - t0
        if last and not g.budget:
            self._finish(g, "length")  # the prompt (and its logprobs) were all it asked for
        elif last:
            self._emit(g, token)

    def _decode(self, gens: list[Generation]) -> None:
        """One batched forward of each generation's pending token, then each one's next token."""
        t0 = time.perf_counter()
        tokens = [g._next for g in gens]
        g, ahead = gens[0], False
        if len(gens) == 1 and self._on_device(g) and g.logprobs is None and g.constraint is None:  # alone: run ahead
            token = self._device_draw(g, np.asarray(tokens, np.int64))
            g._slot.ids.append(tokens[0])
            g.stats.decode_s += time.perf_counter() - t0
            self._run_ahead(g, token)
            self._emit(g, token)
            return
        else:
            caches = [g._slot.cache for g in gens]
            spec = any(g.spec is not None for g in gens)  # their post-norm rows kept for the MTP head
            on_device = [self._on_device(g) for g in gens]
            if any(on_device) and hasattr(self.backend, "sample_batch"):
                # rows drawn on the device send only their ids back (and a logprobs record where asked; a JSON
                # row's logits where its constraint refuses the draw); a row the device cannot draw gets its
                # logits, and the host draws it
                for g, ok in zip(gens, on_device):
                    if ok:
                        self._sync_penalties(g)
                        self._sync_mask(g)
                lps = [g.logprobs if ok else None for g, ok in zip(gens, on_device)]
                picks = self.backend.sample_batch(
                    tokens, caches, [g.sampler.params if ok else None for g, ok in zip(gens, on_device)],
                    vocab=self.model.real_vocab_size, seeds=[g.sampler.seed for g in gens],
                    steps=[len(g.stats.token_ids) for g in gens], hidden=spec,
                    **({"logprobs": lps} if any(n is not None for n in lps) else {}))
                if spec:
                    picks, hidden = picks
                drawn = [p.id if isinstance(p, TokenLogprob) else p for p in picks]
                picks = [self._device_pick(g, b, p) if ok else self._draw_or_error(g, p)
                         for b, (g, p, ok) in enumerate(zip(gens, picks, on_device))]
                # every row drawn on the device and kept (not one a JSON constraint refused): the draw slots hold
                # the tokens, so the next step can run ahead (a lone row here has logprobs or a JSON constraint)
                ahead = all(on_device) and drawn == picks
            else:
                if spec:
                    logits, hidden = self.backend.decode_batch(tokens, caches, hidden=True)  # [B, V], [B, H]
                else:
                    logits = self.backend.decode_batch(tokens, caches)
                picks = [self._draw_or_error(g, row) for g, row in zip(gens, logits)]
            for b, g in enumerate(gens):
                if g.spec is not None:  # the pair (h_p, x_{p+1}) waits for the head, its token for the next step
                    g.spec.took(tokens[b], hidden[b:b + 1], BATCHED_HEAD_ROWS)
        for g, t in zip(gens, tokens):
            g._slot.ids.append(t)
        dt = time.perf_counter() - t0
        if ahead and len(gens) == 1:
            self._run_ahead(gens[0], picks[0])
        elif ahead:
            self._run_rows_ahead(gens, picks)
        for g, token in zip(gens, picks):
            g.stats.decode_s += dt
            if isinstance(token, Exception):
                self._fail(g, token)  # its slot holds what it fed: only its own generation ends
            else:
                self._emit(g, token)

    def _draw_or_error(self, g: Generation, logits, token: int | None = None):
        """_draw, or the exception it raised (a JSON reply with no way on): one sequence's dead end must not fail
        the others of the step."""
        try:
            return self._draw(g, logits, token)
        except Exception as e:
            return e

    def _speculate(self, g: Generation) -> None:
        """Give g speculative steps where the model drafts and g asks for nothing they cannot give (logprobs, a JSON
        constraint, sampling that repeats by its seed: a speculative step draws from the seed's stream otherwise
        than a batched one, so the text would depend on what else runs): from its slot's head state where that
        covers the slot's ids, else from an empty head on an empty slot. Its slot's head state is then g's (None:
        g's steps keep none)."""
        slot, k = g._slot, self.model.speculative_tokens
        params = g.sampler.params
        seeded = params.seed is not None and not params.is_greedy
        if not k or g.logprobs is not None or g.prompt_logprobs is not None or g.constraint is not None or seeded:
            state = None
        elif not slot.ids:
            state = HeadState(self.backend.new_draft_cache(slot.cache))
        else:
            state = slot.head if slot.head is not None and slot.head.end == len(slot.ids) else None
        slot.head = state
        if state is not None:
            g.spec = Speculator(self.backend, slot.cache, state, g.sampler, real_vocab=self.model.real_vocab_size,
                                history=g.history, prompt_len=len(g.prompt), planner=DraftPlanner(k))

    def _spec_decode(self, g: Generation) -> None:
        """One speculative step of g, alone: its drafts and pending token verified together, the tokens it keeps
        emitted in order (a stop among them ends g there; the cache keeps what was verified)."""
        t0 = time.perf_counter()
        g._pen_synced = False  # its tokens are drawn on the host, or from device rows without penalties
        new, n = g.spec.step(g._next, g.budget - len(g.stats.token_ids) - 1)  # drafts whose tokens could be output
        g._slot.ids += [g._next] + new[:-1]
        g.stats.decode_s += time.perf_counter() - t0
        g.stats.draft_tokens += n
        g.stats.accepted_tokens += len(new) - 1
        for token in new:
            if g.done:
                break
            self._emit(g, token)

    def _on_device(self, g: Generation) -> bool:
        """Whether g's next token may be drawn on the device (only its id comes back, and its logprobs record where
        the backend computes them there: GpuBackend.draws_logprobs; a JSON-constrained row's logits come back only
        where the constraint refuses the draw: draws_constrained, without penalties, which change the row)."""
        return (self.model._draws_on_device(g.sampler.params)
                and (g.logprobs is None or getattr(self.backend, "draws_logprobs", False))
                and (g.constraint is None or (getattr(self.backend, "draws_constrained", False)
                                              and not g.sampler.params.penalised)))

    def _device_pick(self, g: Generation, row: int, pick):
        """A device row's token: its id, or (a row with logprobs) the TokenLogprob that carries it, kept for _emit.
        A JSON-constrained row whose draw its constraint refuses goes on as the host path would after that first
        draw (_constrained over the step's logits of the row, its logprobs then the host's); the exception where no
        token can continue."""
        token = pick.id if isinstance(pick, TokenLogprob) else pick
        g._drawn = pick if isinstance(pick, TokenLogprob) else None
        if g.constraint is None:
            return token
        if (after := self._allows(g.constraint, token)) is not None:
            g.constraint = after
            return token
        return self._draw_or_error(g, self.backend.last_logits(row), token)

    def _sync_penalties(self, g: Generation) -> None:
        """Before g's next draw on the device: where it has penalties and a token of its was drawn elsewhere (the
        host, a speculative step) or none yet, its slot's penalty state is set from its history again (the device
        keeps it from there, counting what it draws)."""
        if g.sampler.params.penalised and not g._pen_synced:
            self.backend.set_penalties(g._slot.cache, g.history, len(g.prompt), g.sampler.params)
        g._pen_synced = True

    def _device_draw(self, g: Generation, ids: np.ndarray) -> int:
        """Forward ids through g's cache and draw the next token on the device (its Philox stream: the sampler's
        seed, the step)."""
        self._sync_penalties(g)
        return self.backend.sample_next(ids, g._slot.cache, g.sampler.params, vocab=self.model.real_vocab_size,
                                        seed=g.sampler.seed, step=len(g.stats.token_ids))

    def _draw(self, g: Generation, logits: np.ndarray, token: int | None = None) -> int:
        """g's next token from its last logits row (overwritten where the vocabulary is padding), and its logprobs
        where g asked for them. token: the first draw, made elsewhere (the device's; else the host draws it)."""
        g._pen_synced = False
        if token is None:
            token = self.model._pick(logits, g.sampler, g.history, len(g.prompt))
        if g.constraint is not None:
            token = self._constrained(g, logits, token)
        if g.logprobs is not None:
            g._drawn = token_logprob(logits, token, g.logprobs, self.model.real_vocab_size)
        return token

    def _constrained(self, g: Generation, logits: np.ndarray, token: int) -> int:
        """The token g's JSON constraint allows: the one drawn, else a new draw with every refused token masked out
        (JSON_DRAWS in all), else the likeliest allowed token; the constraint then advances over it."""
        masked = logits
        for _ in range(JSON_DRAWS):
            if (after := self._allows(g.constraint, token)) is not None:
                g.constraint = after
                return token
            if masked is logits:
                masked = logits.copy()
            masked[token] = -np.inf
            if not np.isfinite(masked).any():
                break
            token = self.model._pick(masked, g.sampler, g.history, len(g.prompt))
        for token in np.argsort(-logits[:self.model.real_vocab_size], kind="stable").tolist():
            if (after := self._allows(g.constraint, token)) is not None:
                g.constraint = after
                return token
        raise NinferError("no token of the vocabulary continues the JSON reply")

    def _tokens(self) -> JsonTokens:
        if self._json is None:
            self._json = JsonTokens(self.model.tokenizer, self.model.real_vocab_size)
        return self._json

    def _allows(self, c: SchemaPrefix, token: int) -> SchemaPrefix | None:
        """c advanced over token's bytes (c itself where they keep a plain string plain), or None where token
        cannot continue the JSON (JsonTokens.allows)."""
        return self._tokens().allows(c, token)

    def _emit(self, g: Generation, token: int) -> None:
        """Take a drawn token: a stop id ends g, else its text goes out (up to a stop string) and it is fed next."""
        s = g.stats
        s.generated_tokens += 1
        if self.model.tokenizer.is_stop(token):
            self._finish(g, "eos")
            return
        s.token_ids.append(token)
        g.history.append(token)
        if g._drawn is not None:
            g._logprobs.append(g._drawn)
            g._drawn = None
        piece = g._scan.push(g._detok.push(token))
        if piece:
            g._pieces.append(piece)
        if g._scan.stop is not None:
            s.stop_string = g._scan.stop
            self._finish(g, "stop")
        elif len(s.token_ids) >= g.budget:
            self._finish(g, "length")
        else:
            g._next = token

    def _finish(self, g: Generation, reason: str) -> None:
        """g is done: the detokenizer's held bytes go out (unless a stop string ended it) and its slot goes idle
        with what it fed."""
        if reason != "stop":
            tail = g._scan.push(g._detok.finish())
            if g._scan.stop is None:
                tail += g._scan.finish()
            elif reason != "cancelled":  # the held bytes completed a stop string: it ended there, as generate says
                reason, g.stats.stop_string = "stop", g._scan.stop
            if tail:
                g._pieces.append(tail)
        g.stats.finish_reason = reason
        self._release(g)

    def _fail(self, g: Generation, error: BaseException) -> None:
        g.error, g.stats.finish_reason = error, "error"
        self._release(g)

    def _release(self, g: Generation) -> None:
        # a step run ahead is spent; its input is in the ids (between steps none has been fed an unread draw)
        g.done, g._next, g._ahead = True, None, []
        if g._mask is not None and g._slot.cache is not None:  # (a later sequence there draws unmasked; a lost
            # slot's cache is made anew, which clears it)
            self.backend.set_mask(g._slot.cache, None)
            g._mask = g._mask_of = None
        g._slot.busy, g._slot.used = False, next(self._clock)  # last used when its sequence left
        self._running.remove(g)
