"""Speculative decoding with the checkpoint's MTP head: draft k tokens, verify them in one forward of k + 1.

Every Qwen3.5/3.6 checkpoint carries a multi-token-prediction block (`mtp.*`, qwen36-architecture.md §5). Row p of
it pairs the main model's post-norm hidden state h_p with the token x_{p+1} and predicts x_{p+2}; fed its own
output hidden state and its draft, it chains further. One step of a generation here:

    drafts d_1..d_n ~ q_i   from the MTP head, chained from its last real row        (n <= k, n MTP rows)
    [last, d_1..d_n]        through the main model in one forward -> target rows p_1..p_{n+1}
    accept d_i while u * q_i(d_i) < p_i(d_i)  (u uniform; always, for greedy, when d_i is p_i's arg-max)
    the first rejected d_i is replaced by a draw from max(p_i - q_i, 0); all accepted: a bonus draw from p_{n+1}

so each step emits between 1 and n + 1 tokens, and every emitted token follows the target distribution exactly
(Leviathan et al. 2023, Chen et al. 2023): greedy output is the plain greedy text up to the rounding of a forward
over several tokens, and sampled output follows the same distribution (not the same draws: the random stream is
consumed differently). q and p are the Sampler's final distributions (penalties, temperature, top-k/p, min-p), each
over the history the token would extend.

The backend rewinds the main cache to the accepted prefix (`verify` / `rewind`) and drops the MTP head's draft rows
(`rewind_draft`) before feeding it the real pairs (h_p, x_{p+1}) of the accepted tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ninfer_rt.generation import GenerationStats, emit
from ninfer_rt.sampling import Sampler

MAX_DRAFT_TOKENS = 7  # a verification feeds k + 1 tokens; the GPU's decode kernels take up to 8 a sequence


def accept(drafts: Sequence[int], q_rows: Sequence[np.ndarray], target: Callable[[int], np.ndarray],
           sampler: Sampler) -> tuple[int, int]:
    """Speculative sampling's acceptance: (drafts accepted, the token that follows them).

    drafts[i] was drawn from q_rows[i] (float [V]); target(i) is the target distribution at draft i, given the
    drafts before it (called only while they are accepted). Draft i is kept with probability
    min(1, p_i(d_i) / q_i(d_i)); the first one refused is replaced by a draw from max(p_i - q_i, 0), and when every
    draft is kept one more token comes from target(len(drafts))."""
    for i, (d, q) in enumerate(zip(drafts, q_rows)):
        p = target(i)
        if sampler.uniform() * q[d] < p[d]:
            continue
        residual = np.maximum(p - q, 0.0)
        # p(d) < q(d) leaves mass in the residual; rounding could still empty it, and then p itself is the answer
        return i, sampler.draw(residual if residual.sum() > 0 else p)
    return len(drafts), sampler.draw(target(len(drafts)))


def decode(backend, cache, ids: list[int], budget: int, sampler: Sampler, stats: GenerationStats, *, draft_tokens: int,
           real_vocab: int, is_stop: Callable[[int], bool]) -> Iterator[int]:
    """Prefill ids into cache, then speculative steps; yields the output ids as plain decoding does (the stop id
    is counted in stats.generated_tokens, not yielded) and fills stats (timings, draft_tokens, accepted_tokens).

    backend: verify / rewind / new_draft_cache / draft / rewind_draft (ninfer_rt.reference.backend; the GPU
    backend's return only the last row where this loop reads no other). budget: most tokens to output. draft_tokens: k, the most drafts a step. real_vocab: ids past it (padding) never drawn."""
    prompt_len, history = len(ids), list(ids)

    def final(row: np.ndarray, drafts: Sequence[int]) -> np.ndarray:
        """The sampler's distribution for one row of logits, after history + drafts, padding masked."""
        row = row.copy()
        row[real_vocab:] = -np.inf
        return sampler.distribution(row, history + list(drafts), prompt_len)

    t0 = time.perf_counter()
    logits, hidden, _ = backend.verify(np.asarray(ids, np.int64), cache, undoable=False)
    last = sampler.draw(final(logits[-1], ()))
    draft_cache = backend.new_draft_cache(cache)
    # the MTP head's rows for the prompt: pairs (h_p, x_{p+1}), the last one with the token just drawn
    d_logits, d_hidden = backend.draft(hidden, np.asarray(ids[1:] + [last], np.int64), draft_cache)
    row = (d_logits[-1], d_hidden[-1])
    fed = len(ids)  # positions in the main cache; `last` goes in at position fed
    stats.prefill_s = time.perf_counter() - t0
    new = [last]
    while not (yield from emit(new, stats, history, budget, is_stop)):
        t0 = time.perf_counter()
        last = new[-1]
        n = min(draft_tokens, budget - len(stats.token_ids) - 1)  # drafts whose tokens could still be output
        drafts, q_rows = [], []
        for i in range(n):
            q = final(row[0], drafts)
            drafts.append(sampler.draw(q))
            q_rows.append(q)
            if i + 1 < n:
                r_logits, r_hidden = backend.draft(row[1][None], np.asarray(drafts[-1:], np.int64), draft_cache)
                row = (r_logits[0], r_hidden[0])
        feed = np.asarray([last] + drafts, np.int64)
        logits, hidden, undo = backend.verify(feed, cache)
        j, nxt = accept(drafts, q_rows, lambda i: final(logits[i], drafts[:i]), sampler)
        backend.rewind(cache, undo, feed, j + 1)
        new = drafts[:j] + [nxt]
        backend.rewind_draft(draft_cache, fed)  # the chained rows were drafts; the real pairs replace them
        d_logits, d_hidden = backend.draft(hidden[:j + 1], np.asarray(new, np.int64), draft_cache)
        row = (d_logits[-1], d_hidden[-1])
        fed += j + 1
        stats.draft_tokens += n
        stats.accepted_tokens += j
        stats.decode_s += time.perf_counter() - t0
