"""The device's draws of each sequence's next token, for GpuModel's decode loops: so that only ids (and, where a
request asks, a small logprobs record) cross to the host, never a row of logits.

A draw reads logits rows 0..rows-1 and writes one id a row into the draw slots. Its op, the last element of a
decode Step's key, is ("argmax" | "sample", vocab, *flags): "sample" draws under each row's params record
(misc.sample_params, uploaded before the step); flags "logprobs": each row listed in the tops buffer gets its
record (misc.logprob_rows before anything changes the row, misc.logprob_finish after the draw); "penalized": each
row's slot's penalties first (misc.penalize from the per-slot state set_penalties left) and its drawn token
counted after (misc.penalty_count); "masked": each row drawn from a copy of its logits with the ids its slot's mask
(set_mask) leaves out at -inf (misc.mask_rows: a JSON row's allowed tokens), the logits themselves kept for the
host and the logprobs. The penalties', the masks' and the logprobs' buffers are made on first use, outside any
capture, so a step needing them is captured after.
"""

from __future__ import annotations

import numpy as np

from ninfer_rt.errors import NinferError
from ninfer_rt.gpu import misc
from ninfer_rt.logprobs import TokenLogprob


class Draws:
    """Params records, drawn ids and the sampler's scratch, a row a slot (the scratch is ~2 MB a row at a 248K
    vocabulary); the penalties' state (~1.2 MB a slot), the masks with their masked copies (~1 MB a slot) and the
    logprobs' buffers (~1 MB a slot) once used."""

    def __init__(self, gpu, alloc, slots: int, V: int):
        self.gpu, self._alloc, self.slots, self.V = gpu, alloc, slots, V
        self.params, self.out = alloc(slots * misc.SAMPLE_PARAMS.itemsize), alloc(4 * slots)
        self.scratch = alloc(max(misc.sample_scratch_bytes(slots, V), misc.argmax_scratch_bytes(slots)))
        self.pen: tuple[int, int, int] | None = None  # (params, counts, seen) a slot
        self.lp: tuple[int, int, int, int] | None = None  # (tops int32, parts, raw fp32 rows, records int32) a slot
        self.masks: tuple[int, int] | None = None  # (masks uint32 [slots, words], masked copies fp32 [slots, V])
        self.words = misc.mask_words(V)

    def op(self, vocab: int, record: np.ndarray | None, penalized: bool = False, tops=None,
           masked: bool = False) -> tuple:
        """The draw's op, with its params record (if any) and its rows' logprob counts (tops: int per row, None
        or -1 for a row that asks for none) queued for upload. masked: the rows' slots' masks apply (set_mask)."""
        if record is not None:
            self.gpu.upload(self.params, record, stream=self.gpu.stream)
        op = ("argmax" if record is None else "sample", int(vocab))
        if tops is not None:
            self.gpu.upload(self.logprob_buffers()[0], np.array([-1 if t is None else t for t in tops], np.int32),
                            stream=self.gpu.stream)
            op += ("logprobs",)
        op += ("penalized",) if penalized else ()
        return op + ("masked",) if masked else op  # (enqueue checks set_mask made the masks, as for penalties)

    def enqueue(self, k, logits: int, slot_ids: int, how: str, vocab: int, *flags: str, rows: int = 1,
                at: int = 0) -> None:
        """The next token of each of logits rows 0..rows-1 (row stride V) over ids < vocab into draw slots at,
        at + 1, ..., as op (how, vocab, *flags) says; slot_ids: the rows' slots (int32 device array), for the
        penalties and masks. k: the
        step's kernels (a dry run's recorder, so that its draws are recorded with the rest of the step)."""
        out = self.out + 4 * at  # the draw slots written: at, at + 1, ...
        lp = "logprobs" in flags
        penalized = "penalized" in flags
        if lp:
            if self.lp is None:
                raise NinferError("a draw with logprobs before their buffers exist")
            tops, parts, raw, _ = self.lp
            misc.logprob_rows(k, logits=logits, ld=self.V, M=rows, V=vocab, tops=tops, scratch=parts,
                              raw=raw if penalized else 0)
        if penalized:
            if self.pen is None:
                raise NinferError("a penalized draw before any set_penalties")
            params, counts, seen = self.pen
            misc.penalize(k, logits=logits, ld=self.V, M=rows, V=self.V, slots=slot_ids, params=params,
                          counts=counts, seen=seen)
        src = logits  # what the draw reads: the rows, or (masked) their copies after the penalties
        if "masked" in flags:
            if self.masks is None:
                raise NinferError("a masked draw before any set_mask")
            masks, src = self.masks
            misc.mask_rows(k, logits=logits, ld=self.V, M=rows, V=vocab, slots=slot_ids, masks=masks,
                           words=self.words, out=src, ldo=self.V)
        if how == "argmax":
            misc.argmax(k, logits=src, ld=self.V, M=rows, V=vocab, out=out, scratch=self.scratch)
        else:
            misc.sample(k, logits=src, ld=self.V, M=rows, V=vocab, params=self.params, out=out,
                        scratch=self.scratch)
        if lp:
            # the drawn ids' logits from before the penalties (the raw copy), as the host reports them
            misc.logprob_finish(k, tokens=out, src=raw if penalized else logits, ld=self.V, M=rows,
                                V=vocab, tops=tops, scratch=parts, out=self.lp[3])
        if penalized:
            misc.penalty_count(k, tokens=out, slots=slot_ids, M=rows, V=self.V, counts=counts, seen=seen)

    def penalty_buffers(self) -> tuple[int, int, int]:
        """(params PENALTY_PARAMS [slots], counts int32 [slots, V], seen uint8 [slots, V]), made and zeroed on first
        use: set_penalties's, before any graph that reads them is captured."""
        if self.pen is None:
            S, V = self.slots, self.V
            self.pen = (self._alloc(S * misc.PENALTY_PARAMS.itemsize), self._alloc(S * V * 4), self._alloc(S * V))
            self.gpu.upload(self.pen[0], np.concatenate([misc.penalty_params()] * S))
            self.gpu.memset(self.pen[1], 0, S * V * 4)
            self.gpu.memset(self.pen[2], 0, S * V)
        return self.pen

    def set_penalties(self, slot: int, record: np.ndarray, counts: np.ndarray | None = None,
                      seen: np.ndarray | None = None) -> None:
        """Slot's penalties (a misc.penalty_params record) and, where given, its sequence's state
        (misc.penalty_state: counts int32 [V], seen uint8 [V]), queued on the stream."""
        params, c, sn = self.penalty_buffers()
        self.gpu.upload(params + slot * misc.PENALTY_PARAMS.itemsize, record, stream=self.gpu.stream)
        if counts is not None:
            self.gpu.upload(c + slot * self.V * 4, np.ascontiguousarray(counts, np.int32), stream=self.gpu.stream)
            self.gpu.upload(sn + slot * self.V, np.ascontiguousarray(seen, np.uint8), stream=self.gpu.stream)

    def set_mask(self, slot: int, bits: np.ndarray | None) -> None:
        """Slot's mask (uint32 [words], bit i & 31 of word i >> 5: id i may be drawn), or None: every id; queued on
        the stream. The buffers are made, every slot's mask all ones, on first use: before any graph that reads
        them is captured."""
        if self.masks is None:
            S, W = self.slots, self.words
            self.masks = (self._alloc(S * W * 4), self._alloc(S * self.V * 4))
            self.gpu.memset(self.masks[0], 0xFF, S * W * 4)
        if bits is None:
            bits = np.full(self.words, 0xFFFFFFFF, np.uint32)
        elif bits.shape != (self.words,):
            raise NinferError(f"set_mask: a mask of {bits.shape} words, not ({self.words},)")
        self.gpu.upload(self.masks[0] + slot * self.words * 4, np.ascontiguousarray(bits, np.uint32),
                        stream=self.gpu.stream)

    def logprob_buffers(self) -> tuple[int, int, int, int]:
        """(tops int32 [slots], LpPart scratch, raw fp32 [slots, V], records int32 [slots, LP_INTS]), made on first
        use (a draw op with tops)."""
        if self.lp is None:
            S, V = self.slots, self.V
            self.lp = (self._alloc(4 * S), self._alloc(misc.logprob_scratch_bytes(S, V)), self._alloc(4 * S * V),
                       self._alloc(4 * S * misc.LP_INTS))
        return self.lp

    def logprobs(self, tokens, tops) -> list[TokenLogprob | None]:
        """The records of the latest draw with logprobs (after the stream finishes), row b's as a TokenLogprob of
        tokens[b], None where tops[b] is None."""
        recs = self.gpu.download(self.lp[3], (len(tops), misc.LP_INTS), np.int32)
        return [None if t is None else misc.logprob_record(r, tok) for r, tok, t in zip(recs, tokens, tops)]

    def drawn(self, at: int = 0) -> int:
        """The token in draw slot `at` (after the stream finishes)."""
        return int(self.gpu.download(self.out + 4 * at, (1,), np.int32)[0])

    def drawn_rows(self, B: int) -> np.ndarray:
        """The tokens in the first B draw slots, int32 [B] (after the stream finishes)."""
        return self.gpu.download(self.out, (B,), np.int32)
