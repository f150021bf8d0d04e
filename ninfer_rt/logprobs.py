"""Log-probabilities of generated tokens, as OpenAI's `logprobs` / `top_logprobs` report them.

They are the model's own distribution: log_softmax of the raw logits over the real vocabulary, before temperature,
penalties or truncation (vLLM's default, `raw_logprobs`), so the numbers do not depend on how the token was drawn.
token_logprob computes them from a row of logits on the host; the GPU computes the same record in the step that
draws the token (kernels/logprobs.cu, read back by ninfer_rt.gpu.misc.logprob_record).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20  # alternatives a token may list (OpenAI's and vLLM's cap)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id and log-probability, and the `top` most likely ids with theirs (most likely
    first, ties to the lower id; empty when none were asked for)."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token: int, top: int, vocab: int) -> TokenLogprob:
    """The log-probability of `token` under softmax(logits[:vocab]) and the `top` most likely ids' (0..20).

    logits: [V] float32 (V >= vocab; rows past vocab are padding and ignored). The exponentials are float32 (each
    within 1e-7 relative, and each term at most 1) summed in float64, so a logprob is within ~1e-6 of the exact
    log-softmax of the float32 logits.
    """
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    x = np.asarray(logits[:vocab], np.float32)  # x: [vocab]
    m = float(np.max(x))
    lse = m + float(np.log(np.exp(x - np.float32(m)).sum(dtype=np.float64)))
    best: tuple[tuple[int, float], ...] = ()
    if top:
        k = min(top, vocab)
        cand = np.argpartition(-x, k - 1)[:k]  # the k largest, unordered (ties at the edge: any of them)
        edge = x[cand].min()
        cand = np.flatnonzero(x >= edge)       # every id tied with the k-th, so the lower ids win below
        order = np.lexsort((cand, -x[cand]))[:k]
        best = tuple((int(cand[i]), float(x[cand[i]]) - lse) for i in order)
    return TokenLogprob(int(token), float(x[token]) - lse, best)
