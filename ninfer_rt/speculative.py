"""Speculative decoding with the checkpoint's MTP head: draft k tokens, verify them in one forward of k + 1.

Every Qwen3.5/3.6 checkpoint carries a multi-token-prediction block (`mtp.*`, qwen36-architecture.md §5). Row p of
it pairs the main model's post-norm hidden state h_p with the token x_{p+1} and predicts x_{p+2}; fed its own
output hidden state and its draft, it chains further. One step of a generation here:

    drafts d_1..d_n         the MTP head's arg-maxes, chained from its last real row      (n <= k, n MTP rows)
    [last, d_1..d_n]        through the main model in one forward -> target rows p_1..p_{n+1}
    accept d_i while u < p_i(d_i)  (u uniform; for greedy p_i is one-hot: d_i is kept when it is p_i's arg-max)
    the first rejected d_i is replaced by a draw from p_i without d_i; all accepted: a bonus draw from p_{n+1}

This is speculative sampling (Leviathan et al. 2023, Chen et al. 2023) with a deterministic draft, q_i one-hot
at d_i (as vLLM's MTP and EAGLE proposers draft): min(1, p/q) is p_i(d_i), and max(p_i - q_i, 0) is p_i with d_i
removed. So each step emits between 1 and n + 1 tokens, and every emitted token follows the target distribution
exactly: greedy output is the plain greedy text up to the rounding of a forward over several tokens, and sampled
output follows the same distribution (not the same draws: the random stream is consumed differently). p is the
Sampler's final distribution (penalties, temperature, top-k/p, min-p) over the history the token would extend.

Where the picks need no history (no penalties) the backend does the work: for greedy it returns the rows'
arg-maxes (top1), and a GPU computes sampled rows' final distributions itself (dist), so that only the few
probabilities the test reads cross to the host, and a whole row only for a correction or the bonus draw.

The backend rewinds the main cache to the accepted prefix (`verify` / `rewind`). The MTP head's cache holds the real
pairs (h_p, x_{p+1}) only: before it drafts, its chained draft rows are dropped (`rewind_draft`) and the real pairs
since it last ran are fed in the call that drafts, so steps that take no drafts skip the head (it catches up
HEAD_ROWS pairs at a time).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ninfer_rt.generation import GenerationStats, emit
from ninfer_rt.sampling import Sampler

MAX_DRAFT_TOKENS = 7  # a verification feeds k + 1 tokens; the GPU's decode kernels take up to 8 a sequence
HEAD_ROWS = 8  # most pending pairs a head call takes (on the GPU: a captured decode-sized step, not a prefill)


def accept(drafts: Sequence[int], q_rows: Sequence[np.ndarray] | None, target: Callable[[int], np.ndarray],
           sampler: Sampler) -> tuple[int, int]:
    """Speculative sampling's acceptance: (drafts accepted, the token that follows them).

    drafts[i] was drawn from q_rows[i] (float [V]), or with q_rows None picked deterministically (q one-hot at the
    draft); target(i) is the target distribution at draft i, given the drafts before it (called only while they
    are accepted; any row that indexes by id and converts to an array). Draft i is kept with probability
    min(1, p_i(d_i) / q_i(d_i)); the first one refused is replaced by a draw from max(p_i - q_i, 0), and when every
    draft is kept one more token comes from target(len(drafts))."""
    for i, d in enumerate(drafts):
        p = target(i)
        q_d = 1.0 if q_rows is None else q_rows[i][d]
        if sampler.uniform() * q_d < p[d]:
            continue
        p = np.array(p, dtype=np.float64)
        if q_rows is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - q_rows[i], 0.0)
        # p(d) < q(d) leaves mass in the residual; rounding could still empty it, and then p itself is the answer
        return i, sampler.draw(residual if residual.sum() > 0 else p)
    return len(drafts), sampler.draw(np.asarray(target(len(drafts)), dtype=np.float64))


def default_cost(n: int) -> float:
    """A step of n drafts in plain decode steps: on an H100 at 8K (35B shapes, v94) a plain step took 1.62 ms, a
    step of n >= 1 drafts 2.19 + 0.65 n ms (a verification of n + 1 tokens, the head's rows, the host's waits);
    a step of 0 drafts is a plain step with the post-norm hidden state kept for the head."""
    return 1.0 if n == 0 else 1.35 + 0.40 * n


class DraftPlanner:
    """How many drafts the next step takes, 0..max_drafts: the count whose expected tokens per unit of cost is
    highest.

    A draft is kept with probability `accept` given the ones before it were (a moving average over drafts, from
    ACCEPT_PRIOR), so a step of n drafts emits E(n) = 1 + a + ... + a^n tokens, for cost(n) in plain decode
    steps (default_cost by default: a verification of n + 1 tokens plus the head's rows). The plan depends only
    on which drafts were kept, never on timings, so a seeded sampled run repeats. A count of 0 is one verified
    token with no head row (decode feeds the head those rows when drafts resume), and every PROBE_EVERY such
    steps one draft is tried again, so a head that starts to agree is seen. fixed=True always takes max_drafts.
    Any count emits exactly the target's tokens: this trades only speed."""

    ACCEPT_PRIOR = 0.73   # NInfer's per-draft acceptance with Qwen3.x's MTP head
    ACCEPT_WEIGHT = 0.1   # the moving average's weight of one draft's outcome
    PROBE_EVERY = 16

    def __init__(self, max_drafts: int, cost: Callable[[int], float] | None = None, fixed: bool = False):
        self.max_drafts, self.fixed = max_drafts, fixed
        self.cost = cost or default_cost
        self.accept = self.ACCEPT_PRIOR
        self.idle = 0  # steps in a row without drafts

    def expected_tokens(self, n: int) -> float:
        return sum(self.accept ** i for i in range(n + 1))

    def choose(self, limit: int) -> int:
        """Drafts for the next step, at most limit (the tokens the budget still takes after the next one)."""
        top = min(self.max_drafts, limit)
        if self.fixed or top <= 0:
            return max(top, 0)
        if self.idle >= self.PROBE_EVERY:
            return 1
        return max(range(top + 1), key=lambda n: (self.expected_tokens(n) / self.cost(n), n))

    def observe(self, n: int, kept: int) -> None:
        """A step of n drafts kept `kept` of them."""
        w = self.ACCEPT_WEIGHT
        for _ in range(kept):
            self.accept += w * (1.0 - self.accept)
        if kept < n:
            self.accept -= w * self.accept
        self.idle = self.idle + 1 if n == 0 else 0


def decode(backend, cache, ids: list[int], budget: int, sampler: Sampler, stats: GenerationStats, *, draft_tokens: int,
           real_vocab: int, is_stop: Callable[[int], bool], planner: DraftPlanner | None = None) -> Iterator[int]:
    """Prefill ids into cache, then speculative steps; yields the output ids as plain decoding does (the stop id
    is counted in stats.generated_tokens, not yielded) and fills stats (timings, draft_tokens, accepted_tokens).

    backend: verify / rewind / new_draft_cache / draft / rewind_draft (ninfer_rt.reference.backend; the GPU
    backend's return only the last row where this loop reads no other); with top1=V verify and draft return each
    row's arg-max over ids < V instead of its logits (and draft(..., chain=c) c more rows after the last, each on
    the head's own output and pick: one call drafts a step), and with dist=(params, V) (a backend whose can_sample(params)
    holds) verify returns rows of final probabilities that index by id and convert to arrays. budget: most tokens
    to output. draft_tokens: k, the most drafts a step (planner, default DraftPlanner(k), picks each step's count).
    real_vocab: ids past it (padding) never drawn."""
    prompt_len, history = len(ids), list(ids)
    params = sampler.params
    planner = DraftPlanner(draft_tokens) if planner is None else planner
    # how the target rows come back: arg-max ids (greedy), final distributions computed by the backend (sampling
    # a GPU can do itself), or logits the Sampler turns into distributions here (penalties, or the CPU)
    top1 = real_vocab if params.is_greedy and not params.penalised else None
    can = getattr(backend, "can_sample", None)
    dist = (params, real_vocab) if top1 is None and can is not None and can(params) else None

    def final(row: np.ndarray, drafts: Sequence[int]) -> np.ndarray:
        """The sampler's distribution for one row of logits, after history + drafts, padding masked."""
        row = row.copy()
        row[real_vocab:] = -np.inf
        return sampler.distribution(row, history + list(drafts), prompt_len)

    def target(rows, i: int, drafts: Sequence[int]):
        """Row i's target distribution (given drafts before it), as rows came back from the backend."""
        return rows[i] if dist is not None else final(rows[i], drafts)

    def judge(drafts: list[int], rows) -> tuple[int, int]:
        """(drafts kept, the token after them) from the verification's rows."""
        if top1 is None:
            return accept(drafts, None, lambda i: target(rows, i, drafts[:i]), sampler)
        j = next((i for i, d in enumerate(drafts) if d != int(rows[i])), len(drafts))
        return j, int(rows[j])

    t0 = time.perf_counter()
    rows, hidden, _ = backend.verify(np.asarray(ids, np.int64), cache, undoable=False, top1=top1, dist=dist)
    last = int(rows[-1]) if top1 is not None else sampler.draw(np.asarray(target(rows, len(rows) - 1, ()),
                                                                          dtype=np.float64))
    draft_cache = backend.new_draft_cache(cache)
    # the MTP head takes the pairs (h_p, x_{p+1}) of real tokens: the prompt's now (its prefill), the last one and
    # each step's when a step drafts (a step of 0 drafts runs no head row), at most HEAD_ROWS a call
    pend_h, pend_t = [hidden], ids[1:] + [last]
    head = 0  # real rows in the head's cache (positions 0..head-1)

    def feed(count: int, chain: int = 0) -> list[int]:
        """The first `count` pending pairs into the head (its chained rows dropped first) and `chain` more rows on
        its own output and picks -> the picks of the last pair and the chained rows."""
        nonlocal head, pend_h, pend_t
        h = np.concatenate(pend_h) if len(pend_h) > 1 else pend_h[0]
        backend.rewind_draft(draft_cache, head)
        picks, _ = backend.draft(h[:count], np.asarray(pend_t[:count], np.int64), draft_cache, top1=real_vocab,
                                 chain=chain)
        head += count
        pend_h, pend_t = [h[count:]], pend_t[count:]
        return [int(t) for t in picks[-(chain + 1):]]

    if len(pend_t) > 1:
        feed(len(pend_t) - 1)  # the last pair waits: the first drafting step chains on from its output
    stats.prefill_s = time.perf_counter() - t0
    new = [last]
    while not (yield from emit(new, stats, history, budget, is_stop)):
        t0 = time.perf_counter()
        last = new[-1]
        n = planner.choose(budget - len(stats.token_ids) - 1)  # drafts whose tokens could still be output
        drafts = feed(len(pend_t), n - 1) if n else []  # the pending pairs, then n - 1 chained rows
        tokens = np.asarray([last] + drafts, np.int64)
        rows, hidden, undo = backend.verify(tokens, cache, top1=top1, dist=dist)
        j, nxt = judge(drafts, rows)
        backend.rewind(cache, undo, tokens, j + 1)
        new = drafts[:j] + [nxt]
        pend_h.append(hidden[:j + 1])
        pend_t += new
        while len(pend_t) > HEAD_ROWS:  # steps without drafts: the head keeps up in calls of HEAD_ROWS
            feed(HEAD_ROWS)
        stats.draft_tokens += n
        stats.accepted_tokens += j
        planner.observe(n, j)
        stats.decode_s += time.perf_counter() - t0


class SteeredDrafts:
    """A backend whose MTP head drafts a known continuation: after the head runs (same kernels, caches and
    transfers), each returned row's pick becomes sequence[target], or another id where wrong(target) (target: the
    position the row drafts). For tests and benchmarks that need a known acceptance (a random head drafts nothing
    a verification keeps); counts verifications."""

    def __init__(self, backend, sequence: Sequence[int], wrong: Callable[[int], bool] = lambda pos: False):
        self.inner, self.sequence, self.wrong, self.verifies = backend, list(sequence), wrong, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def verify(self, ids, cache, undoable: bool = True, top1: int | None = None, dist=None):
        self.verifies += 1
        return self.inner.verify(ids, cache, undoable, top1=top1, dist=dist)

    def draft(self, hidden, next_ids, draft_cache, top1: int | None = None, chain: int = 0):
        start, n = draft_cache.pos, len(next_ids) + chain
        rows, out = self.inner.draft(hidden, next_ids, draft_cache, top1=top1, chain=chain)
        V = top1 if top1 is not None else rows.shape[1]  # a wrong pick stays a real id
        picks = []
        for r in range(n - len(rows), n):  # the returned rows are the last ones (chained rows last of all)
            target = start + r + 2  # row p pairs (h_p, x_{p+1}) and drafts x_{p+2}
            tok = self.sequence[target] if target < len(self.sequence) else 0
            picks.append((tok + 1) % V if self.wrong(target) else tok)
        if top1 is not None:
            return np.asarray(picks, np.int64), out
        logits = np.zeros_like(rows)
        logits[np.arange(len(picks)), picks] = 30.0
        return logits, out
