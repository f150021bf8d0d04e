"""The CPU backend of `ninfer_rt.load`: the ReferenceModel in fp32 on weights decoded from the artifact.

Besides the plain contract every backend keeps (new_cache, copy_cache, max_ctx, forward, decode_batch) it has the
one speculative decoding needs (`ninfer_rt.speculative`): `verify` returns the hidden states with the logits and
can be undone down to a prefix of its tokens (`rewind`); `draft` runs the checkpoint's MTP head over its own KV
cache (`new_draft_cache`, `rewind_draft`).
"""

from __future__ import annotations

import numpy as np
import torch

from ninfer_rt.errors import NinferError
from ninfer_rt.format import Artifact
from ninfer_rt.reference.model import Cache, ReferenceModel
from ninfer_rt.reference.weights import artifact_weights


class ReferenceBackend:
    """The CPU path: ReferenceModel in fp32 on weights decoded from the artifact."""

    def __init__(self, artifact: Artifact, cache_slots: int = 1, groups: tuple[str, ...] = ("text",),
                 max_ctx: int | None = None):
        """Decode the weights of `groups` (plain decoding never reads the mtp.* tensors; drafting does) and build
        the reference model. cache_slots: how many sequences Model may keep at once (load's; host caches are
        objects, so this only mirrors the GPU's); max_ctx: positions a sequence may hold (default: the model's)."""
        self.model = ReferenceModel(artifact.spec, artifact_weights(artifact, groups=groups))
        self.cache_slots = cache_slots
        whole = artifact.spec.max_position_embeddings
        self._max_ctx = whole if max_ctx is None else min(int(max_ctx), whole)

    def new_cache(self, slot: int = 0) -> Cache:
        """Empty decode state for one sequence (slot: the GPU's; host caches need none)."""
        return self.model.new_cache()

    def copy_cache(self, cache: Cache, slot: int) -> Cache:
        """An independent copy of a sequence's state."""
        return cache.clone()

    @property
    def max_ctx(self) -> int:
        """Positions one sequence may hold: load's max_ctx within the model's context (the reference's cache grows
        as it goes, so this is a limit, not an allocation)."""
        return self._max_ctx

    def forward(self, ids: np.ndarray, cache: Cache, last_only: bool = False) -> np.ndarray:
        """ids int64 [T] -> logits float32 [T, V] ([1, V] of the last token when last_only); advances cache."""
        logits = self.model.forward(ids, cache).numpy()
        return logits[-1:] if last_only else logits

    def decode_batch(self, ids: list[int], caches: list, hidden: bool = False):
        """One token for each of B sequences -> their logits float32 [B, V] (with hidden, and their post-norm
        hidden states float32 [B, H]: the MTP head's input); advances each cache."""
        rows = [self.model.forward_with_hidden(np.asarray([i], np.int64), c) for i, c in zip(ids, caches)]
        logits = np.concatenate([r[0].numpy() for r in rows])
        return (logits, np.concatenate([r[1].float().numpy() for r in rows])) if hidden else logits

    # ------------------------------------------------------------------------------------ speculative decoding

    def verify(self, ids: np.ndarray, cache: Cache, undoable: bool = True, top1: int | None = None, dist=None):
        """ids int64 [T] -> (logits float32 [T, V], post-norm hidden float32 [T, H], undo); advances cache by T.
        undoable: the DeltaNet layers run the T tokens one by one and keep each one's state (Cache.track), so that
        `rewind` keeps any prefix of ids without a second forward; undo is then T (else None). top1=V: each row's
        arg-max over ids < V (int64 [T]) instead of its logits. dist: not here (no can_sample: the loop's Sampler
        turns these logits into distributions)."""
        if dist is not None:
            raise NinferError("verify: the reference backend returns logits, not distributions (dist)")
        if undoable:
            cache.track()
        logits, hidden = self.model.forward_with_hidden(np.asarray(ids, np.int64), cache)
        return _top1(logits.numpy(), top1), hidden.float().numpy(), len(ids) if undoable else None

    def rewind(self, cache: Cache, undo: int, ids: np.ndarray, keep: int) -> None:
        """After verify(ids, cache) -> undo: leave cache as if only ids[:keep] had been fed (keep >= 1): the
        states the verification kept after token keep - 1, the KV caches cut there."""
        cache.rewind(undo - keep)

    def new_draft_cache(self, cache: Cache | None = None) -> Cache:
        """Empty state of the MTP head (its one attention layer's KV cache), for cache's sequence (host caches are
        objects of their own: cache is not needed here, as it is on the GPU)."""
        return self.model.new_mtp_cache()

    def copy_draft_cache(self, draft_cache: Cache, copy: Cache | None = None) -> Cache:
        """An independent copy of the MTP head's cache (for a sequence copied by copy_cache)."""
        return draft_cache.clone()

    def draft(self, hidden: np.ndarray, next_ids: np.ndarray, draft_cache: Cache, top1: int | None = None,
              chain: int = 0):
        """MTP rows at the draft cache's next positions p: hidden [T, H] (h_p), next_ids [T] (x_{p+1}) -> (draft
        logits float32 [T, V] for x_{p+2}, or with top1 = V their arg-maxes over ids < V; the head's hidden float32
        [T, H] to chain a further row from). chain = c (with top1): c more rows, each pairing the head's last output
        with its pick -> (the picks int64 [T + c], the head's hidden [T + c, H])."""
        if chain and top1 is None:
            raise NinferError("draft: a chain picks arg-maxes (top1)")
        picks, outs = [], []
        h, ids = np.ascontiguousarray(hidden, np.float32), np.asarray(next_ids, np.int64)
        for _ in range(chain + 1):
            positions = torch.arange(draft_cache.pos, draft_cache.pos + len(ids))
            logits, out = self.model.mtp_forward(torch.from_numpy(h), ids, positions, draft_cache)
            picks.append(_top1(logits.numpy(), top1))
            outs.append(out.float().numpy())
            h, ids = outs[-1][-1:], picks[-1][-1:]
        return np.concatenate(picks), np.concatenate(outs)

    def rewind_draft(self, draft_cache: Cache, pos: int) -> None:
        """Drop the MTP head's rows from position pos on."""
        draft_cache.truncate(pos)


def _top1(logits: np.ndarray, vocab: int | None) -> np.ndarray:
    """logits [T, V] unchanged, or with vocab their rows' arg-max over ids < vocab (int64 [T]; ties to the lowest;
    NaN counts as -inf, as the Sampler and the device's arg-max take it)."""
    if vocab is None:
        return logits
    rows = logits[:, :vocab]
    return np.where(np.isnan(rows), -np.inf, rows).argmax(-1).astype(np.int64)
