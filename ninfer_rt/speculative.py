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
once IDLE_HEAD_ROWS pairs wait, in one prefill-sized call).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ninfer_rt.generation import GenerationStats, emit
from ninfer_rt.sampling import Sampler

MAX_DRAFT_TOKENS = 7  # a verification feeds k + 1 tokens; the GPU's decode kernels take up to 8 a sequence
HEAD_ROWS = 8  # pending pairs a prompt leaves to the first step's head call (on the GPU: a decode-sized step)
# pending pairs steps without drafts leave waiting (8 KB each at H = 2048): a head that never agrees is probed every
# PROBE_MAX steps at most, so its pairs go in one prefill-sized call at the probe, not in 8-row calls every 8 steps
IDLE_HEAD_ROWS = 256


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
        # the residual over p's support only (a top-k/top-p row has a handful of ids of 248K): the same draw
        ids, probs = _support(p)
        residual = probs.copy()
        if q_rows is None:
            residual[ids == d] = 0.0
        else:
            residual = np.maximum(residual - np.asarray(q_rows[i], np.float64)[ids], 0.0)
        # p(d) < q(d) leaves mass in the residual; rounding could still empty it, and then p itself is the answer
        return i, sampler.draw_among(ids, residual if residual.sum() > 0 else probs)
    return len(drafts), sampler.draw_among(*_support(target(len(drafts))))


def _support(p) -> tuple[np.ndarray, np.ndarray]:
    """(ids, float64 probabilities) of a row's entries > 0, ids ascending; a row that lists them itself (the GPU's
    DeviceRow: a few hundred ids, not the 248K-entry row) gives them as they are."""
    if hasattr(p, "support"):
        return p.support()
    row = np.asarray(p)
    ids = np.flatnonzero(row > 0)
    return ids, row[ids].astype(np.float64)


def default_cost(n: int) -> float:
    """Milliseconds of a step of n drafts on an H100 at 8K context (35B shapes; bench/speculative_loop.py and
    bench/speculative_parts.py, v95-v98): n = 0 1.7, over the 1.63 its parts add up to (a verification of one token
    with its hidden row back, 1.615, and its share of the head's catch-up over IDLE_HEAD_ROWS = 256 pairs), since
    with 1.63 the planner drafted too little at acceptance 0.7 in the GPU loop (v98: -6%); n >= 1 the head's rows, a
    verification of n + 1 tokens and the host's waits (2.13 + 0.64 n, fit to every draft kept at n = 1..3). Only
    the ratios matter to the planner."""
    return 1.7 if n == 0 else 2.13 + 0.64 * n


class DraftPlanner:
    """How many drafts the next step takes, 0..max_drafts: the count whose expected tokens per unit of cost is
    highest.

    A draft is kept with probability `accept` given the ones before it were, so a step of n drafts emits
    E(n) = 1 + a + ... + a^n tokens, for cost(n) in plain decode steps (default_cost by default: a verification of
    n + 1 tokens plus the head's rows). `accept` is the drafts' mean from ACCEPT_PRIOR, held as PRIOR_DRAFTS drafts'
    worth, until it becomes a moving average of weight ACCEPT_WEIGHT a draft. The plan depends only on which drafts
    were kept, never on timings, so a seeded sampled run repeats. A count of 0 is one verified token with no head
    row (the head takes those rows when drafts resume or IDLE_HEAD_ROWS wait). Drafts seen stop while none are
    taken, so after PROBE_EVERY such steps one draft is tried: kept, `accept` is lifted to BREAK_EVEN_MARGIN above
    the break-even (the least at which some count beats none), so that drafting resumes and the estimate is tested
    again, not left where one unlucky stretch put it; refused, the wait doubles (up to PROBE_MAX steps: a head that
    never agrees costs a probe that much more rarely). fixed=True always takes max_drafts. Any count emits exactly
    the target's tokens: this trades only speed (bench/planner_sim.py: its throughput against the best fixed count
    at each acceptance)."""

    ACCEPT_PRIOR = 0.73       # NInfer's per-draft acceptance with Qwen3.x's MTP head
    PRIOR_DRAFTS = 8          # the prior's weight, in drafts
    ACCEPT_WEIGHT = 0.03      # the moving average's weight of one draft's outcome, once 1 / (drafts seen) is less
    PROBE_EVERY = 8           # steps without drafts before a probe of one draft
    PROBE_MAX = 128           # the most they become as probes are refused
    BREAK_EVEN_MARGIN = 0.02  # where a kept probe puts `accept`, above the break-even, at least

    def __init__(self, max_drafts: int, cost: Callable[[int], float] | None = None, fixed: bool = False):
        self.max_drafts, self.fixed = max_drafts, fixed
        self.cost = cost or default_cost
        self.accept, self.seen = self.ACCEPT_PRIOR, 0
        self.idle = 0  # steps in a row without drafts
        self.probe_every, self._probing = self.PROBE_EVERY, False
        self.break_even = self._break_even()

    def expected_tokens(self, n: int, accept: float | None = None) -> float:
        a = self.accept if accept is None else accept
        return sum(a ** i for i in range(n + 1))

    def best(self, top: int, accept: float | None = None) -> int:
        """The count of 0..top with the most expected tokens per unit of cost (the larger one on a tie)."""
        return max(range(top + 1), key=lambda n: (self.expected_tokens(n, accept) / self.cost(n), n))

    def _break_even(self) -> float:
        """The least acceptance at which some count of drafts beats none (bisection; 1.0 where none ever does)."""
        if self.max_drafts <= 0 or self.best(self.max_drafts, 1.0) == 0:
            return 1.0
        lo, hi = 0.0, 1.0
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if self.best(self.max_drafts, mid) else (mid, hi)
        return hi

    def choose(self, limit: int) -> int:
        """Drafts for the next step, at most limit (the tokens the budget still takes after the next one)."""
        top = min(self.max_drafts, limit)
        self._probing = False
        if self.fixed or top <= 0:
            return max(top, 0)
        if self.idle >= self.probe_every:
            self._probing = True
            return 1
        return self.best(top)

    def observe(self, n: int, kept: int) -> None:
        """A step of n drafts kept `kept` of them (the drafts after the first refused one are not seen)."""
        for i in range(kept + (kept < n)):
            self.seen += 1
            w = max(self.ACCEPT_WEIGHT, 1.0 / (self.PRIOR_DRAFTS + self.seen))
            self.accept += w * (float(i < kept) - self.accept)
        if self._probing:
            self.probe_every = self.PROBE_EVERY if kept else min(2 * self.probe_every, self.PROBE_MAX)
            if kept:
                self.accept = max(self.accept, min(1.0, self.break_even + self.BREAK_EVEN_MARGIN))
            self._probing = False
        self.idle = self.idle + 1 if n == 0 else 0


@dataclass
class HeadState:
    """What the MTP head holds of one sequence: its cache (the pairs (h_p, x_{p+1}) of positions p < head) and the
    pairs not fed yet, hidden rows `hid` (float32 [n, H] blocks) for positions head .. head + n - 1 and `nxt`, the
    token after each. The last one may be None: the token after the last fed position, until it is known."""

    cache: object
    head: int = 0
    hid: list[np.ndarray] = field(default_factory=list)
    nxt: list[int | None] = field(default_factory=list)

    @property
    def end(self) -> int:
        """Positions with a hidden row: the main cache's length when the state is whole."""
        return self.head + len(self.nxt)

    def add(self, hidden: np.ndarray, next_ids: Sequence[int | None]) -> None:
        """The hidden rows of the next positions and the token after each (the last may be None)."""
        if self.nxt and self.nxt[-1] is None:
            raise ValueError("add: the last pair's token is still unknown (set_next)")
        self.hid.append(np.asarray(hidden, np.float32))
        self.nxt += list(next_ids)

    def set_next(self, token: int) -> None:
        """The token after the last position (a prompt that extends the sequence, or a draw); nothing where no pair
        waits (an empty sequence: its first token follows no position)."""
        if self.nxt:
            self.nxt[-1] = token

    def copy(self, cache) -> HeadState:
        """A copy over another head cache (the backend's copy of this one's)."""
        return HeadState(cache, self.head, list(self.hid), list(self.nxt))


class Speculator:
    """Speculative decoding of one sequence, a step at a time: speculative.decode's loop, and Batch's for a
    sequence that decodes alone.

    backend: verify / rewind / draft / rewind_draft (ninfer_rt.reference.backend; the GPU backend's return only the
    last row where this loop reads no other); with top1=V verify and draft return each row's arg-max over ids < V
    instead of its logits (and draft(..., chain=c) c more rows after the last, each on the head's own output and
    pick: one call drafts a step), and with dist=(params, V) (a backend whose can_sample(params) holds) verify
    returns rows of final probabilities that index by id and convert to arrays. history: the prompt and the output
    so far (the caller appends each output token), for the sampler's penalties. real_vocab: ids past it (padding)
    are never drawn. state: the head's (HeadState), whole up to the main cache's end."""

    def __init__(self, backend, cache, state: HeadState, sampler: Sampler, *, real_vocab: int, history: list[int],
                 prompt_len: int, planner: DraftPlanner):
        self.backend, self.cache, self.state, self.sampler = backend, cache, state, sampler
        self.real_vocab, self.history, self.prompt_len, self.planner = real_vocab, history, prompt_len, planner
        params = sampler.params
        # how the target rows come back: arg-max ids (greedy), final distributions computed by the backend (sampling
        # a GPU can do itself), or logits the Sampler turns into distributions here (penalties, or the CPU)
        self.top1 = real_vocab if params.is_greedy and not params.penalised else None
        can = getattr(backend, "can_sample", None)
        self.dist = (params, real_vocab) if self.top1 is None and can is not None and can(params) else None

    def prefill(self, ids: Sequence[int], last: bool) -> int | None:
        """Feed prompt tokens ids (at the main cache's end), their hidden rows kept for the head; with last, draw
        the first output token and return it."""
        st = self.state
        st.set_next(int(ids[0]))
        rows, hidden, _ = self.backend.verify(np.asarray(ids, np.int64), self.cache, undoable=False, top1=self.top1,
                                              dist=self.dist)
        token = None
        if last:
            token = int(rows[-1]) if self.top1 is not None else self.sampler.draw_among(
                *_support(self._target(rows, len(rows) - 1, ())))
        st.add(hidden, list(ids[1:]) + [token])
        self.keep_up()
        return token

    def step(self, last: int, limit: int) -> tuple[list[int], int]:
        """One step from the token last (drawn, not fed): up to `limit` drafts (the planner's count), one
        verification -> (the tokens it emits: the drafts kept and the token after them, the drafts taken)."""
        st, be = self.state, self.backend
        st.set_next(last)
        n = self.planner.choose(limit)
        drafts = self._feed(len(st.nxt), n - 1) if n else []  # the pending pairs, then n - 1 chained rows
        tokens = np.asarray([last] + drafts, np.int64)
        rows, hidden, undo = be.verify(tokens, self.cache, top1=self.top1, dist=self.dist)
        j, nxt = self._judge(drafts, rows)
        be.rewind(self.cache, undo, tokens, j + 1)
        new = drafts[:j] + [nxt]
        st.add(hidden[:j + 1], new[:-1] + [None])
        self.keep_up(IDLE_HEAD_ROWS)
        self.planner.observe(n, j)
        return new, n

    # ------------------------------------------------------------------------------------------- internals

    def _feed(self, count: int, chain: int = 0) -> list[int]:
        """The first `count` pending pairs into the head (its chained rows dropped first) and `chain` more rows on
        its own output and picks -> the picks of the last pair and the chained rows."""
        st = self.state
        h = np.concatenate(st.hid) if len(st.hid) > 1 else st.hid[0]
        self.backend.rewind_draft(st.cache, st.head)
        picks, _ = self.backend.draft(h[:count], np.asarray(st.nxt[:count], np.int64), st.cache,
                                      top1=self.real_vocab, chain=chain)
        st.head += count
        st.hid, st.nxt = [h[count:]], st.nxt[count:]
        return [int(t) for t in picks[-(chain + 1):]]

    def took(self, token: int, hidden: np.ndarray, limit: int) -> None:
        """The sequence took `token` in a step of someone else's (Batch's batched step), which left its post-norm
        hidden row [1, H]: the pair waits for the head, fed once more than `limit` wait (keep_up)."""
        self.state.set_next(token)
        self.state.add(hidden, [None])
        self.keep_up(limit)

    def keep_up(self, limit: int = HEAD_ROWS) -> None:
        """Feed the head all pending pairs but the last (whose token the next step or prompt gives) once more than
        `limit` wait: a prompt's in one call, those of steps without drafts (IDLE_HEAD_ROWS) and of batched steps
        (Batch) a prefill-sized call at a time, so that the rows kept on the host stay bounded."""
        if len(self.state.nxt) > limit:
            self._feed(len(self.state.nxt) - 1)

    def _target(self, rows, i: int, drafts: Sequence[int]):
        """Row i's target distribution (given drafts before it), as rows came back from the backend."""
        if self.dist is not None:
            return rows[i]
        row = rows[i].copy()  # logits: the sampler's distribution after history + drafts, padding masked
        row[self.real_vocab:] = -np.inf
        return self.sampler.distribution(row, self.history + list(drafts), self.prompt_len)

    def _judge(self, drafts: list[int], rows) -> tuple[int, int]:
        """(drafts kept, the token after them) from the verification's rows."""
        if self.top1 is None:
            return accept(drafts, None, lambda i: self._target(rows, i, drafts[:i]), self.sampler)
        j = next((i for i, d in enumerate(drafts) if d != int(rows[i])), len(drafts))
        return j, int(rows[j])


def decode(backend, cache, ids: list[int], budget: int, sampler: Sampler, stats: GenerationStats, *, draft_tokens: int,
           real_vocab: int, is_stop: Callable[[int], bool], planner: DraftPlanner | None = None) -> Iterator[int]:
    """Prefill ids into cache, then speculative steps (Speculator); yields the output ids as plain decoding does
    (the stop id is counted in stats.generated_tokens, not yielded) and fills stats (timings, draft_tokens,
    accepted_tokens). budget: most tokens to output. draft_tokens: k, the most drafts a step (planner, default
    DraftPlanner(k), picks each step's count)."""
    history = list(ids)
    spec = Speculator(backend, cache, HeadState(backend.new_draft_cache(cache)), sampler, real_vocab=real_vocab,
                      history=history, prompt_len=len(ids),
                      planner=DraftPlanner(draft_tokens) if planner is None else planner)
    t0 = time.perf_counter()
    new = [spec.prefill(ids, last=True)]
    stats.prefill_s = time.perf_counter() - t0
    while not (yield from emit(new, stats, history, budget, is_stop)):
        t0 = time.perf_counter()
        new, n = spec.step(new[-1], budget - len(stats.token_ids) - 1)  # drafts whose tokens could be output
        stats.draft_tokens += n
        stats.accepted_tokens += len(new) - 1
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
