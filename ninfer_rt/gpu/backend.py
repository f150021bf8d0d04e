"""The GPU backend of ninfer_rt.api.Model: the artifact in device memory, cache_slots sequence slots, CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer_rt.errors import NinferError
from ninfer_rt.gpu.driver import Event, Gpu, GpuError, PinnedBuffer
from ninfer_rt.gpu.engine import GEMV_MAX_ROWS, GpuModel
from ninfer_rt.gpu.kernels import Kernels
from ninfer_rt.gpu.loader import load_artifact
from ninfer_rt.gpu import misc, mtp
from ninfer_rt.gpu.misc import SAMPLE_MAX_CANDIDATES, sample_params
from ninfer_rt.logprobs import TokenLogprob
from ninfer_rt.sampling import SamplingParams


# Penalties drawn on the device (misc.penalize in the draw's graph, each slot's state kept by the draws) instead of
# on the host from downloaded logits: 1.73x on the 35B at 8K (perf.md v108). The benches turn it off to time the
# host path; tests/gpu/test_penalties.py holds both to the same tokens.
DEVICE_PENALTIES = True


def _draw_record(params: SamplingParams | None, seed: int = 0, step: int = 0) -> np.ndarray | None:
    """The device sampler's params record of one draw: None for the arg-max (greedy; or None: a row the host
    draws)."""
    if params is None or params.is_greedy:
        return None
    return sample_params(params.temperature, params.top_k, params.top_p, params.min_p, seed=seed, step=step)


def _penalty_record(params: SamplingParams | None) -> np.ndarray:
    """misc.penalty_params of params' penalties (none for None: a row the host draws)."""
    if params is None:
        return misc.penalty_params()
    return misc.penalty_params(params.repetition_penalty, params.presence_penalty, params.frequency_penalty)


@dataclass
class GpuCache:
    """Where a sequence stands: its slot, and the positions already in it."""

    pos: int = 0
    slot: int = 0


class GpuBackend:
    """Same interface as the reference backend: new_cache(slot), copy_cache(cache, slot), forward(ids, cache,
    last_only), decode_batch(ids, caches); and, where can_sample(params), sample_next: the next token drawn on the
    device. cache_slots sequences (each its own KV cache and DeltaNet state) live on the device at once."""

    def __init__(self, artifact, *, max_ctx: int = 32768, kv_dtype: str = "int8", progress=None,
                 use_graphs: bool = True, prefill_chunk: int | None = None, cache_slots: int = 1,
                 groups: tuple[str, ...] = ("text",)):
        """groups: the artifact's tensor groups to load; ("text", "mtp") adds the MTP head, for the speculative
        decoding contract (verify, rewind, new_draft_cache, draft, rewind_draft)."""
        self.gpu = Gpu(0)
        self.kernels = Kernels(self.gpu)
        spec = artifact.spec
        self.weights = load_artifact(self.gpu, artifact, groups=groups, progress=progress)
        self.max_ctx = min(max_ctx, spec.max_position_embeddings)  # positions a sequence may hold (Model reads it)
        self.cache_slots = cache_slots
        self.exclusive_slots = True  # a slot is device memory: one sequence at a time (api._KeptCaches)
        try:
            self.model = GpuModel(self.gpu, self.kernels, spec, self.weights, slots=cache_slots,
                                  max_ctx=self.max_ctx, kv_dtype=kv_dtype, prefill_chunk=prefill_chunk)
        except GpuError as e:
            self.weights.free(self.gpu)
            if not e.out_of_memory:
                raise
            raise GpuError(f"{cache_slots} sequence slot(s) of {self.max_ctx:,} positions do not fit in GPU memory "
                           "beside the weights: lower --max-context, or serve's --parallel") from None
        self.use_graphs = use_graphs
        self._probs: tuple[int, int, int, int] | None = None  # _probs_of's buffers
        self._ring: _DrawRing | None = None  # sample_ahead's pinned ids, made on first use
        self._masked: set[int] = set()  # slots whose draws are masked (set_mask)

    @classmethod
    def of_model(cls, model: GpuModel, use_graphs: bool = True) -> GpuBackend:
        """The backend over a GpuModel built elsewhere (bench/: synthetic weights, no artifact); freeing the model
        and its weights stays with whoever built them."""
        self = cls.__new__(cls)
        self.gpu, self.kernels, self.weights, self.model = model.gpu, model.k, model.w, model
        self.max_ctx, self.cache_slots, self.exclusive_slots = model.max_ctx, model.slots, True
        self.use_graphs, self._probs, self._ring, self._masked = use_graphs, None, None, set()
        return self

    def new_cache(self, slot: int = 0) -> GpuCache:
        """An empty sequence in `slot` (whatever it held is forgotten, its mask too)."""
        self.model.reset_slot(slot)
        if slot in self._masked:
            self.set_mask(GpuCache(slot=slot), None)
        return GpuCache(slot=slot)

    def copy_cache(self, cache: GpuCache, slot: int) -> GpuCache:
        """A copy of cache's sequence in another slot, which later steps can continue independently (unmasked)."""
        self.model.copy_slot(cache.slot, slot, cache.pos)
        if slot in self._masked:
            self.set_mask(GpuCache(slot=slot), None)
        return GpuCache(pos=cache.pos, slot=slot)

    def forward(self, ids: np.ndarray, cache: GpuCache, last_only: bool = False) -> np.ndarray:
        """ids [T] -> logits float32 [T, V] (or [1, V] of the last token when last_only); advances cache."""
        ids = np.asarray(ids, np.int32)
        if last_only or (ids.size == 1 and cache.pos > 0):
            self._run_last(ids, cache)
            return self.model.logits(1)
        out = self.model.prefill(ids, cache.slot, start=cache.pos, all_logits=True)
        cache.pos += ids.size
        return out

    def decode_batch(self, ids: list[int], caches: list[GpuCache], hidden: bool = False):
        """One token for each of B sequences (each in its own slot, past its prompt) in one decode step -> their
        logits float32 [B, V] (with hidden, and their post-norm hidden states float32 [B, H]: the MTP head's
        input); advances each cache."""
        if len({c.slot for c in caches}) != len(caches) or any(c.pos == 0 for c in caches):
            raise NinferError("decode_batch: each sequence needs its own slot and a prefilled prompt")
        self.model.decode(np.asarray(ids, np.int32), [c.pos for c in caches], [c.slot for c in caches],
                          graph=self.use_graphs, hidden=hidden)
        for c in caches:
            c.pos += 1
        logits = self.model.logits(len(caches))
        return (logits, self.model.hidden(len(caches))) if hidden else logits

    def _run_last(self, ids: np.ndarray, cache: GpuCache, draw: tuple | None = None) -> bool:
        """Enqueue ids through the cache, leaving the last token's logits in logits row 0. With draw = (vocab,
        record), a decode step also draws the next token inside its graph; returns whether it did."""
        decode = ids.size == 1 and cache.pos > 0
        if decode:
            self.model.decode(ids, [cache.pos], [cache.slot], graph=self.use_graphs, draw=draw)
        else:
            self.model.prefill(ids, cache.slot, start=cache.pos)
        cache.pos += ids.size
        return decode and draw is not None

    # sample_batch computes logprobs on the device (only a record a row comes back); Batch asks it where this is
    # True (the benches turn it off to time the host path)
    draws_logprobs = True
    # sample_ahead also brings a row's logprobs record back through the ring, so a lone sequence with logprobs runs
    # a step ahead too (greedy with 5 alternatives, the 35B at 8K on an H100: 577.5 -> 640.9 tok/s, perf.md v112)
    logprobs_ahead = True
    # Batch runs its batched steps a step ahead (sample_batch_ahead: each row fed from its draw slot on the device).
    # B = 4 top-k, the 35B at 8K on an H100: 1,269 -> 1,336 tok/s (perf.md v112); its GPU tests, the path under test
    # run first on a fresh model, passed with the draws' dry-run mend (perf.md v113)
    batch_ahead = True
    # Batch draws a JSON-constrained row on the device too, and reads its logits (last_logits) only where the
    # constraint refuses the token drawn (tests/gpu/test_logprobs.py holds it to the host path's tokens, perf.md v112)
    draws_constrained = True
    # Batch masks a JSON row's device draws to the tokens its constraint allows while it writes a plain string
    # (set_mask), so that JSON rows run a step ahead there, alone or batched (batch_ahead.py; perf.md v118-v119)
    json_ahead = True

    @property
    def mask_words(self) -> int:
        """uint32 words of a slot's mask (set_mask)."""
        return self.model.draws.words

    def set_mask(self, cache: GpuCache, bits: np.ndarray | None) -> None:
        """From the next draw on, cache's sequence draws only ids whose bit is set in bits (uint32 [mask_words],
        bit i & 31 of word i >> 5; None: every id), whatever else draws beside it. Its logits (last_logits) and
        logprobs stay the unmasked ones."""
        self.model.set_mask(cache.slot, bits)
        (self._masked.add if bits is not None else self._masked.discard)(cache.slot)

    def _masks(self, caches: list[GpuCache]) -> bool:
        return any(c.slot in self._masked for c in caches)

    def redraw(self, cache: GpuCache, params: SamplingParams, *, vocab: int, seed: int, step: int,
               row: int = 0) -> int:
        """The latest decode step's draw of cache's sequence (its row `row`) again, from its logits under cache's
        mask as it is now: the token that step would have drawn had set_mask been called before it. Draw slot
        `row` then holds it, the others what the step drew. Not for penalised params (that step counted its own
        draw)."""
        if params.penalised:
            raise NinferError("redraw: a penalised draw counted its token already")
        return self.model.draw(vocab, _draw_record(params, seed, step), slot=cache.slot,
                               masked=cache.slot in self._masked, row=row)

    def last_logits(self, row: int) -> np.ndarray:
        """Row `row`'s logits of the latest decode step (float32 [V], raw: the draws read them, and only a row with
        penalties is changed; valid until the next step)."""
        return self.model.logits_row(row)

    @staticmethod
    def can_sample(params: SamplingParams) -> bool:
        """Whether the device's distributions are Sampler's (same distribution, its own RNG): no penalties, and
        greedy or a top_k within the device's candidate cap. Speculative decoding's device rows need this."""
        return not params.penalised and GpuBackend._top_k_fits(params)

    @staticmethod
    def can_draw(params: SamplingParams) -> bool:
        """Whether sample_next / sample_ahead / sample_batch draw as Sampler would: can_sample, or the same with
        penalties applied on the device (DEVICE_PENALTIES; the caller sets each sequence's state first,
        set_penalties), in fp32 where the host takes float64."""
        return (DEVICE_PENALTIES or not params.penalised) and GpuBackend._top_k_fits(params)

    @staticmethod
    def _top_k_fits(params: SamplingParams) -> bool:
        """Greedy, or a top_k within the device's candidate cap (the device refuses top-k off)."""
        return params.is_greedy or 1 <= params.top_k <= SAMPLE_MAX_CANDIDATES

    def set_penalties(self, cache: GpuCache, history, prompt_len: int, params: SamplingParams) -> None:
        """The penalties of params, and the state of the sequence in cache's slot (history: prompt + output so
        far, its first prompt_len ids the prompt), for its draws to apply and keep from now on."""
        self.model.set_penalties(cache.slot, _penalty_record(params),
                                 *misc.penalty_state(history, prompt_len, self.model.V))

    def sample_next(self, ids: np.ndarray, cache: GpuCache, params: SamplingParams, *, vocab: int, seed: int,
                    step: int) -> int:
        """forward(ids, cache, last_only=True), then the next token drawn on the GPU over ids < vocab: the
        arg-max, or misc.sample under params with Philox stream (seed, step). Only the id crosses to the host
        (not 1 MB of logits, and no host softmax over the vocabulary). Needs can_sample(params)."""
        ids = np.asarray(ids, np.int32)
        record, masked = _draw_record(params, seed, step), self._masks([cache])
        if self._run_last(ids, cache, (vocab, record, params.penalised, None, masked)):  # drawn in its graph
            return self.model.drawn()
        return self.model.draw(vocab, record, slot=cache.slot, penalized=params.penalised, masked=masked)

    def sample_batch(self, ids: list[int], caches: list[GpuCache], params: list[SamplingParams | None], *,
                     vocab: int, seeds: list[int], steps: list[int], hidden: bool = False,
                     logprobs: list[int | None] | None = None):
        """decode_batch with each sequence's next token drawn on the device (as sample_next draws a lone one: the
        arg-max, or a draw under its params with Philox stream (seed, step), whatever row it sits in), only the
        ids coming back: list[int] of B (with hidden, and their post-norm hidden states float32 [B, H]). Needs
        can_draw for every params but None: such a row is the host's to draw, and its place in the list holds
        its logits (float32 [V]) instead of an id. logprobs: a row's count of alternatives (0..20; None: none)
        makes its place a TokenLogprob of its token instead (computed on the device, misc.logprob_record)."""
        records, penalized = self._batch_draw(caches, params, seeds, steps, "sample_batch")
        if logprobs is not None:  # (a host row's logprobs are the host's)
            logprobs = [None if p is None else n for p, n in zip(params, logprobs)]
            logprobs = None if all(n is None for n in logprobs) else logprobs
        self.model.decode(np.asarray(ids, np.int32), [c.pos for c in caches], [c.slot for c in caches],
                          graph=self.use_graphs, hidden=hidden,
                          draw=(vocab, records, penalized, logprobs, self._masks(caches)))
        for c in caches:
            c.pos += 1
        out: list = self.model.drawn_rows(len(caches)).tolist()
        if logprobs is not None:
            out = [lp or t for t, lp in zip(out, self.model.draws.logprobs(out, logprobs))]
        for b, p in enumerate(params):
            if p is None:
                out[b] = self.model.logits_row(b)
        return (out, self.model.hidden(len(caches))) if hidden else out

    def _batch_draw(self, caches: list[GpuCache], params: list, seeds: list[int], steps: list[int], name: str):
        """A batched draw's params records (None: every row's arg-max) and whether it penalizes (each row's slot
        then gets its penalties' params: another's, an earlier sequence's, may be stale)."""
        if len({c.slot for c in caches}) != len(caches) or any(c.pos == 0 for c in caches):
            raise NinferError(f"{name}: each sequence needs its own slot and a prefilled prompt")
        records = [_draw_record(p, sd, st) for p, sd, st in zip(params, seeds, steps)]
        if all(r is None for r in records):
            records = None  # every row's arg-max
        else:  # greedy and host rows draw at temperature 0: the arg-max, lowest id first
            records = np.concatenate([sample_params(0.0) if r is None else r for r in records])
        penalized = any(p is not None and p.penalised for p in params)
        if penalized:
            for p, c in zip(params, caches):
                self.model.set_penalties(c.slot, _penalty_record(p))
        return records, penalized

    def sample_batch_ahead(self, caches: list[GpuCache], params: list[SamplingParams], *, vocab: int,
                           seeds: list[int], steps: list[int]) -> list[PendingToken]:
        """sample_batch fed on the device: row b's token is the one the latest batched draw left in draw slot b
        (sample_batch's or an earlier sample_batch_ahead's over the same sequences in the same rows), before the
        host has read them. The step is enqueued and this returns at once, advancing each cache by one, with a
        PendingToken a row (each waits for this step only). Every params must draw on the device (can_draw)."""
        if self._ring is None:
            self._ring = _DrawRing(self.model.slots)
        records, penalized = self._batch_draw(caches, params, seeds, steps, "sample_batch_ahead")
        self.model.decode(None, [c.pos for c in caches], [c.slot for c in caches], graph=self.use_graphs,
                          draw=(vocab, records, penalized, None, self._masks(caches)))
        for c in caches:
            c.pos += 1
        return self._ring.pend_rows(self.model, len(caches))

    def sample_ahead(self, cache: GpuCache, params: SamplingParams, *, vocab: int, seed: int, step: int,
                     logprobs: int | None = None) -> PendingToken:
        """sample_next fed by the token the latest draw on this cache left on the device (sample_next's or an
        earlier sample_ahead's), before the host has read it: the step is enqueued and this returns at once,
        advancing cache by one. The token it draws comes back through PendingToken.result(), which waits for
        that step only, so the host reads one token while the GPU already runs the step after it. logprobs (0..20
        alternatives): its logprobs record comes back with it (PendingToken.logprob())."""
        record = _draw_record(params, seed, step)
        if cache.pos == 0:
            raise NinferError("sample_ahead: the cache has no drawn token to feed (sample_next its prompt first)")
        self.model.decode(None, [cache.pos], [cache.slot], graph=self.use_graphs,
                          draw=(vocab, record, params.penalised, None if logprobs is None else [logprobs],
                                self._masks([cache])))
        cache.pos += 1
        if self._ring is None:
            self._ring = _DrawRing(self.model.slots)
        return self._ring.pend(self.model, logprobs is not None)

    # ------------------------------------------------------------------------------------ speculative decoding
    # The reference backend's contract (ninfer_rt.speculative), with the logits and hidden states of the last row
    # only where the loop reads no other: a prompt's verification and every draft.

    def verify(self, ids: np.ndarray, cache: GpuCache, undoable: bool = True, top1: int | None = None,
               dist: tuple[SamplingParams, int] | None = None):
        """ids [T] -> (logits float32, post-norm hidden float32 [T, H], undo); advances cache by T. A prompt
        (undoable False) returns its last row's logits [1, V]; a verification (T <= 8) every row's [T, V], each
        token's DeltaNet state kept (GpuModel.verify trail) so that `rewind` keeps any prefix; undo is then T.
        top1=V: each of those rows' arg-max over ids < V (int64) instead of its logits, only the ids downloaded.
        dist=(params, V) (can_sample(params)): DeviceRows of those rows' final probabilities over ids < V under
        params, computed on the device (_probs_of); a probability or a whole row crosses to the host when read."""
        ids = np.asarray(ids, np.int32)
        if not undoable:
            hidden = self.model.prefill(ids, cache.slot, start=cache.pos, hidden=True)
            out = self._probs_of(1, *dist) if dist is not None else self._rows(1, top1)
        else:
            # one token keeps itself: no trail (the trail kernels cost a lone token's step more than the plain one);
            # the rows' arg-maxes over ids < top1 come from the step's own graph
            self.model.verify(ids, cache.pos, cache.slot, graph=self.use_graphs, trail=ids.size > 1,
                              vocab=None if dist is not None else top1)
            if dist is not None:
                out = self._probs_of(ids.size, *dist)
            else:
                out = self.model.logits(ids.size) if top1 is None else self.model.argmax(ids.size).astype(np.int64)
            # after the ids (their download waited for the step): one wait on the GPU a verification, not two
            hidden = self.model.hidden(ids.size)
        cache.pos += ids.size
        return out, hidden, ids.size if undoable else None

    def _probs_of(self, rows: int, params: SamplingParams, vocab: int) -> DeviceRows:
        """The final probabilities under params of the logits buffer's first rows over ids < vocab, computed on
        the device (misc.sample_probs into fp32 [rows, vocab]; its buffers allocated on first use)."""
        m = self.model
        if not 1 <= rows <= GEMV_MAX_ROWS or not 1 <= vocab <= m.V:
            raise NinferError(f"probs: {rows} rows of ids < {vocab} (at most {GEMV_MAX_ROWS} rows of {m.V})")
        if self._probs is None:  # (out, params, scratch, support) for the most rows a step has
            n = GEMV_MAX_ROWS
            self._probs = (m._alloc(n * m.V * 4), m._alloc(n * misc.SAMPLE_PARAMS.itemsize),
                           m._alloc(misc.sample_scratch_bytes(n, m.V)), m._alloc(n * misc.SUPPORT_INTS * 4))
        out, records, scratch, support = self._probs
        record = sample_params(params.temperature, params.top_k, params.top_p, params.min_p)
        self.gpu.upload(records, np.concatenate([record] * rows), stream=self.gpu.stream)
        misc.sample_probs(self.kernels, logits=m.buf.logits, ld=m.V, M=rows, V=vocab, params=records, out=out,
                          scratch=scratch, support=support)
        return DeviceRows(self.gpu, out, rows, vocab, support)

    def _rows(self, rows: int, top1: int | None) -> np.ndarray:
        """The logits buffer's first rows, or with top1 = V their arg-maxes over ids < V."""
        return self.model.logits(rows) if top1 is None else self.model.top1(rows, top1).astype(np.int64)

    def rewind(self, cache: GpuCache, undo: int, ids: np.ndarray, keep: int) -> None:
        """After verify(ids, cache) -> undo: leave cache as if only ids[:keep] had been fed (keep >= 1)."""
        self.model.rewind(cache.slot, keep, undo, graph=self.use_graphs)
        cache.pos -= undo - keep

    def new_draft_cache(self, cache: GpuCache) -> GpuCache:
        """The MTP head's KV cache of cache's sequence (in its slot), empty."""
        return GpuCache(slot=cache.slot)

    def copy_draft_cache(self, draft_cache: GpuCache, copy: GpuCache) -> GpuCache:
        """The head's cache of a sequence copied by copy_cache into `copy` (copy_slot copied the head's KV rows too,
        those below the main cache's length, which the head's never passes)."""
        return GpuCache(pos=draft_cache.pos, slot=copy.slot)

    def draft(self, hidden: np.ndarray, next_ids: np.ndarray, draft_cache: GpuCache, top1: int | None = None,
              chain: int = 0):
        """MTP rows at the draft cache's next positions: hidden [T, H], next_ids [T] -> (the last row's draft
        logits float32 [1, V], or with top1 = V its arg-max [1] over ids < V; its hidden float32 [1, H] to chain
        the next row from). chain = c (with top1): c more rows, each the head's own output and pick (mtp.chain,
        on the device) -> (the picks int64 [1 + c], None)."""
        rows = self.model.draft(hidden, next_ids, draft_cache.pos, draft_cache.slot, graph=self.use_graphs)
        draft_cache.pos += len(next_ids)
        if chain:
            if top1 is None:
                raise NinferError("draft: a chain picks arg-maxes (top1)")
            picks = mtp.chain(self.model, rows, draft_cache.pos, draft_cache.slot, chain, top1,
                              graph=self.use_graphs)
            draft_cache.pos += chain
            return picks.astype(np.int64), None
        return self._rows(1, top1), self.model.hidden(rows)[-1:]

    def rewind_draft(self, draft_cache: GpuCache, pos: int) -> None:
        """Drop the MTP head's rows from position pos on (later rows overwrite them; attention reads below pos)."""
        draft_cache.pos = pos

    def close(self) -> None:
        if self._ring is not None:
            self.gpu.synchronize()  # no copy into the ring may be in flight when it is freed
            self._ring.free()
            self._ring = None
        self.model.free()
        self.weights.free(self.gpu)


class _DrawRing:
    """Pinned slots the draws of enqueued steps are copied into (up to `rows` int32 ids each: a batched step's),
    each with the event that says they are there; reused in turn, so a PendingToken is good until SLOTS later
    steps (the run-ahead loops hold two)."""

    SLOTS = 4

    def __init__(self, rows: int = 1):
        self.rows = rows
        self.ids = PinnedBuffer(4 * rows * self.SLOTS)
        self.recs = PinnedBuffer(4 * misc.LP_INTS * self.SLOTS)  # each slot's logprobs record, where asked
        self.events = [Event(timing=False) for _ in range(self.SLOTS)]
        self.serial = [0] * self.SLOTS  # per slot: the number of the latest PendingToken that owns it
        self.count = 0

    def pend(self, model: GpuModel, logprobs: bool = False) -> PendingToken:
        """The draw slot's token (once the enqueued step is done) copied into the next slot, with the step's
        logprobs record (row 0's) where it drew one: its handle."""
        return self.pend_rows(model, 1, logprobs)[0]

    def pend_rows(self, model: GpuModel, B: int, logprobs: bool = False) -> list[PendingToken]:
        """The first B draw slots' tokens (a batched step's) copied into the next slot (with row 0's logprobs
        record, where asked): a handle a row."""
        i = self.count % self.SLOTS
        self.count += 1
        self.serial[i] = self.count
        model.gpu.download_async(self.ids, 4 * self.rows * i, model.draws.out, 4 * B)
        if logprobs:
            n = 4 * misc.LP_INTS
            model.gpu.download_async(self.recs, n * i, model.draws.logprob_buffers()[3], n)
        self.events[i].record(model.gpu.stream)
        return [PendingToken(self, i, self.count, logprobs, row=b) for b in range(B)]

    def free(self) -> None:
        self.ids.free()
        self.recs.free()
        for e in self.events:
            e.destroy()
        self.serial = [-1] * self.SLOTS  # no PendingToken reads freed memory


class PendingToken:
    """The token an enqueued decode step draws: result() waits for that step's copy (not for the stream, where
    later steps may be queued) and returns the id."""

    def __init__(self, ring: _DrawRing, index: int, serial: int, logprobs: bool = False, row: int = 0):
        self._ring, self._index, self._serial, self._logprobs = ring, index, serial, logprobs
        self.row = row  # its row of the step, whose draw slot holds it until the next draw

    def same_step(self, other: PendingToken) -> bool:
        """Whether other is a row of the same enqueued step."""
        return other._ring is self._ring and other._serial == self._serial

    def result(self) -> int:
        ring = self._ring
        if ring.serial[self._index] != self._serial:
            raise NinferError("a pending token was read after the model was closed" if ring.serial[0] < 0 else
                              f"a pending token was read after {_DrawRing.SLOTS} later ones reused its slot")
        ring.events[self._index].synchronize()
        at = 4 * (ring.rows * self._index + self.row)
        return int(ring.ids.array[at:at + 4].view(np.int32)[0])

    def logprob(self) -> TokenLogprob:
        """The token's logprobs record (sample_ahead with logprobs), as a TokenLogprob."""
        if not self._logprobs:
            raise NinferError("this pending token's step drew no logprobs")
        token, n = self.result(), 4 * misc.LP_INTS
        rec = self._ring.recs.array[n * self._index:n * (self._index + 1)].view(np.int32)
        return misc.logprob_record(rec, token)


class DeviceRows:
    """Final probabilities of a step's rows, fp32 [rows, vocab] at device address `out` (GpuBackend._probs_of),
    with each row's kept tokens alone at `support` (int32 [rows, misc.SUPPORT_INTS]), read lazily: rows[i][d]
    downloads one probability, rows[i].support() the kept tokens (8 KB), np.asarray(rows[i]) the whole row
    (speculative decoding reads p_i(d_i) for each draft and the support only to draw a correction or the bonus)."""

    def __init__(self, gpu, out: int, rows: int, vocab: int, support: int):
        self.gpu, self.out, self.n, self.vocab, self.support = gpu, out, rows, vocab, support

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> DeviceRow:
        if not -self.n <= i < self.n:
            raise IndexError(f"row {i} of {self.n}")
        i %= self.n
        return DeviceRow(self.gpu, self.out + 4 * i * self.vocab, self.vocab,
                         self.support + 4 * i * misc.SUPPORT_INTS)


class DeviceRow:
    """One row of DeviceRows at device address `at` (its support row at `sup`): row[d] is one probability (0 past
    the vocabulary), row.support() the kept tokens as (ids ascending, float64 probabilities), np.asarray(row) all
    of them."""

    def __init__(self, gpu, at: int, vocab: int, sup: int):
        self.gpu, self.at, self.vocab, self.sup = gpu, at, vocab, sup

    def support(self) -> tuple[np.ndarray, np.ndarray]:
        return misc.split_support(self.gpu.download(self.sup, (misc.SUPPORT_INTS,), np.int32))

    def __getitem__(self, d: int) -> float:
        d = int(d)
        return float(self.gpu.download(self.at + 4 * d, (1,), np.float32)[0]) if 0 <= d < self.vocab else 0.0

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        row = self.gpu.download(self.at, (self.vocab,), np.float32)
        return row if dtype is None else row.astype(dtype)
