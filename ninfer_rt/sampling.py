"""Token sampling on the host, in numpy: penalties, temperature, top-k, top-p, min-p, then a seeded draw.

The order is Hugging Face's (transformers' generate): penalties -> temperature -> top-k -> top-p -> min-p, and
greedy decoding is the arg-max of the penalised logits, as HF applies penalties in greedy search too. vLLM v1
differs: it applies min-p right after temperature, before top-k/top-p, so with min-p and top-k/top-p combined
the kept set can differ from vLLM's. The repetition penalty divides positive logits and multiplies negative ones
for every token seen in prompt + output (CTRL / HF); presence and frequency penalties subtract, OpenAI style,
`presence * [count > 0] + frequency * count` over output tokens only. The GPU runtime's host fallback uses this
module too, and `Sampler.distribution` exposes the final probabilities (for tests and speculative acceptance).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from ninfer_rt.errors import NinferError


GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample as the arg-max


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. top_k=0, top_p=1, min_p=0 and neutral penalties switch a stage off;
    temperature=0 (below GREEDY_TEMPERATURE) or greedy=True picks the arg-max (after penalties)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    greedy: bool = False

    def __post_init__(self) -> None:
        """Reject values no sampler can honour, naming the field."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise NinferError(f"sampling {name}={v!r}: must be a number")
            try:
                float(v)
            except OverflowError:
                raise NinferError(f"sampling {name}: {str(v)[:20]}... is too large for a float") from None
        if isinstance(self.top_k, (bool, np.bool_)):
            raise NinferError(f"sampling top_k={self.top_k!r}: must be an integer >= 0 (0 = off)")
        if not isinstance(self.greedy, (bool, np.bool_)):
            raise NinferError(f"sampling greedy={self.greedy!r}: must be True or False")
        checks = [
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, "finite and >= 0"),
            ("top_k", isinstance(self.top_k, (int, np.integer)) and self.top_k >= -1,
             "an integer >= 0 (0 or -1 = off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("presence_penalty", math.isfinite(self.presence_penalty), "finite"),
            ("frequency_penalty", math.isfinite(self.frequency_penalty), "finite"),
            ("repetition_penalty", math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "> 0"),
            # both samplers take it as 64 bits (numpy's stream, the device's Philox key)
            ("seed", self.seed is None or (isinstance(self.seed, (int, np.integer)) and not isinstance(self.seed, bool)
                                           and 0 <= self.seed < 2**64), "an integer in [0, 2^64), or absent"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise NinferError(f"sampling {name}={getattr(self, name)!r}: must be {want}")
        if self.top_k == -1:  # vLLM's and llama.cpp's "off" as well as ours
            object.__setattr__(self, "top_k", 0)

    @property
    def is_greedy(self) -> bool:
        """Whether sampling reduces to arg-max: greedy, or a temperature below GREEDY_TEMPERATURE (as vLLM does;
        the device sampler's fp32 logits / T would overflow long before T reaches 0)."""
        return bool(self.greedy) or self.temperature < GREEDY_TEMPERATURE

    @property
    def penalised(self) -> bool:
        """Whether any penalty is on (they read the history, so a pick needs the logits on the host)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @classmethod
    def defaults_from_generation_config(cls, cfg: dict, **overrides) -> SamplingParams:
        """The checkpoint's defaults from generation_config.json: do_sample false (or absent, as in HF) means
        greedy; temperature, top_k, top_p, min_p, repetition_penalty when present; then overrides. A bad value
        in the file is reported as the file's, so the user does not suspect their own options."""
        do_sample = cfg.get("do_sample", False)
        if "greedy" not in overrides and not isinstance(do_sample, bool):  # "false" is a true value in Python
            raise NinferError(f"generation_config.json: do_sample={do_sample!r} is not true or false")
        fields: dict = {"greedy": not do_sample}
        for key, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("min_p", float),
                          ("repetition_penalty", float)):
            value = cfg.get(key)
            if value is not None and key not in overrides:  # a value given replaces the file's, even a bad one
                # nothing is coerced, as transformers' GenerationConfig refuses "0.7" and a top_k of 20.7
                if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
                    what = "an integer" if kind is int else "a number"
                    raise NinferError(f"generation_config.json: {key}={value!r} is not {what}")
                fields[key] = kind(value)
                try:
                    cls(**{key: fields[key]})
                except NinferError as e:
                    raise NinferError(f"generation_config.json: {e}") from None
        fields.update(overrides)
        return cls(**fields)


# Options that only mean something when sampling; penalties and the seed leave greedy decoding greedy (HF applies
# penalties in greedy search as well).
SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "min_p")


def requested_sampling(generation_config: dict, *, greedy: bool = False, **given) -> SamplingParams:
    """What a caller asked for on top of the checkpoint's defaults (generation_config.json): the fields given (None
    = not given). A temperature/top-p/top-k/min-p asks for sampling (a do_sample-false config would otherwise
    ignore it) unless greedy; penalties and the seed do not. The CLI's options and the server's requests."""
    given = {k: v for k, v in given.items() if v is not None}
    wants_sampling = any(k in SAMPLING_OPTIONS for k in given)
    flag = {"greedy": True} if greedy else ({"greedy": False} if wants_sampling else {})
    return SamplingParams.defaults_from_generation_config(generation_config, **given, **flag)


def apply_penalties(logits: np.ndarray, history: Sequence[int], prompt_len: int,
                    params: SamplingParams) -> np.ndarray:
    """Penalised logits (float64 copy): repetition over history, presence/frequency over history[prompt_len:]."""
    x = np.array(logits, dtype=np.float64)  # x: [V], always a new array (one pass, not convert and then copy)
    hist = np.asarray(history, dtype=np.int64)
    with np.errstate(over="ignore", invalid="ignore"):  # extreme penalties overflow: Sampler takes the limit
        if params.repetition_penalty != 1.0 and hist.size:
            seen = np.unique(hist)
            v = x[seen]
            x[seen] = np.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
        if (params.presence_penalty or params.frequency_penalty) and hist.size > prompt_len:
            ids, counts = np.unique(hist[prompt_len:], return_counts=True)
            x[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return x


def _limit(x: np.ndarray, model_logits: np.ndarray | None = None) -> np.ndarray:
    """Logits whose extremes overflowed (an extreme penalty) as their limit, in place: where some are +inf the
    others get probability 0 and those share it equally (their order below the overflow is lost); NaN is taken as
    impossible (-inf). With none left, model_logits (before penalties) tells whose fault it was."""
    x[np.isnan(x)] = -np.inf
    top = np.isposinf(x)
    if top.any():
        x[top], x[~top] = 0.0, -np.inf
    if np.isneginf(x).all():
        if model_logits is not None and not np.isfinite(model_logits).any():
            raise NinferError("sampling: the model gave no finite logit (a corrupted artifact? `ninfer-pack verify` "
                              "checks it)")
        raise NinferError("sampling: the penalties left no token with a finite logit")
    return x


def _softmax(x: np.ndarray) -> np.ndarray:
    """Softmax of float64 logits; -inf entries get probability 0."""
    e = np.exp(x - x.max())
    return e / e.sum()


NUCLEUS_HEAD = 1024  # top-p's first guess of how many of the likeliest tokens hold its mass


def _nucleus(probs: np.ndarray, top_p: float, head: int = NUCLEUS_HEAD) -> np.ndarray:
    """Top-p's kept positions of probs, likeliest first (ties by position: a stable sort): the smallest head whose
    mass reaches top_p, a token kept while the mass strictly before it is < top_p. Sorting the whole row (248K
    entries, ~30 ms) is the definition; this sorts only the `head` largest, and only those strictly above the
    head's smallest value, whose order and running sums are the whole sort's own; where the cut falls past them
    the head grows 4x, up to the whole row."""
    n = probs.size
    while True:
        if head >= n:
            order = np.argsort(-probs, kind="stable")
        else:
            part = np.argpartition(-probs, head - 1)[:head]
            sure = part[probs[part] > probs[part].min()]  # a prefix of the whole order, as a set
            order = sure[np.lexsort((sure, -probs[sure]))]
        mass_before = np.cumsum(probs[order]) - probs[order]
        kept = int(np.count_nonzero(mass_before < top_p))  # a prefix: mass_before never decreases
        if head >= n or kept < order.size:
            return order[:kept]
        head *= 4


def _top_k_unscaled(x: np.ndarray, k: int, temperature: float) -> np.ndarray | None:
    """The ids (ascending) the top-k stage keeps of x / temperature, found from x itself, so that the division and
    _limit need not touch the whole vocabulary; None where that is not exact (top-k off, or a quotient at the top
    overflows, or the k-th's is not a normal number: take the whole path). Dividing by T > 0 keeps the order, but
    rounding can make x_i < kth tie with kth after it; such an x_i lies within a few ulps of kth, so the candidates are
    those of x >= kth less 8 ulps, then the ties are settled on the quotients."""
    vocab = x.shape[0]
    if not 0 < k < vocab:
        return None
    part = np.partition(x, vocab - k)
    kth, hi = part[vocab - k], part[vocab - k:].max()
    with np.errstate(over="ignore", under="ignore"):
        q_hi, q_kth = hi / temperature, kth / temperature
    # a subnormal or zero k-th quotient: values far more than 8 ulps from kth can round onto it (to 0 included)
    if not (np.isfinite(q_hi) and np.isfinite(q_kth) and abs(q_kth) >= np.finfo(np.float64).tiny):
        return None
    near = np.flatnonzero(x >= kth - 8 * np.spacing(abs(kth)))
    return near[x[near] / temperature >= q_kth]


class Sampler:
    """Draws tokens under fixed SamplingParams with its own random stream (same seed, same tokens)."""

    def __init__(self, params: SamplingParams):
        """Start the random stream from params.seed (fresh OS entropy when None). `seed` is the one used, which a
        device's own sampler (GpuBackend.sample_next) takes for its Philox stream."""
        self.params = params
        self.seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % 2**63)
        self._rng = np.random.default_rng(self.seed)

    def distribution(self, logits: np.ndarray, history: Sequence[int] = (), prompt_len: int = 0) -> np.ndarray:
        """Final probabilities over the vocabulary (float64 [V]) after every stage; one-hot when greedy.

        history is prompt + output so far; its first prompt_len ids are the prompt.
        """
        ids, probs = self._survivors(logits, history, prompt_len)
        out = np.zeros(np.shape(logits)[0])
        out[ids] = probs
        return out

    def _survivors(self, logits: np.ndarray, history: Sequence[int], prompt_len: int,
                   whole: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(ids, probabilities) of the tokens every stage keeps, ids ascending: `distribution` without the
        vocabulary-sized array (one id with probability 1 when greedy). whole: every stage over the whole
        vocabulary (the definition, which the top-k path below must equal exactly; tests compare them)."""
        p = self.params
        x = apply_penalties(logits, history, prompt_len, p)  # x: [V]
        if not np.isfinite(x).all():  # (one pass where _limit takes three, and it changes nothing then)
            x = _limit(x, logits)
        vocab = x.shape[0]
        if p.is_greedy:
            return np.array([int(np.argmax(x))]), np.ones(1)
        # HF's order from here: temperature, top-k, top-p, min-p (vLLM v1 would apply min-p first).
        # Work on the surviving candidates only: after top-k that is k entries instead of the vocabulary.
        cand = None if whole else _top_k_unscaled(x, p.top_k, p.temperature)
        if cand is not None:
            xc = x[cand] / p.temperature  # the same quotients as the whole row's, taken for the candidates only
        else:
            with np.errstate(over="ignore"):  # overflow to ±inf is taken as its limit just below
                x = _limit(x / p.temperature)
            cand = np.arange(vocab)
            if 0 < p.top_k < vocab:
                kth = np.partition(x, vocab - p.top_k)[vocab - p.top_k]
                cand = np.flatnonzero(x >= kth)  # ties with the k-th value stay, as in HF
            xc = x[cand]
        if p.top_p < 1.0:
            probs = _softmax(xc)
            keep = _nucleus(probs, p.top_p, head=probs.size if whole else NUCLEUS_HEAD)
            cand, xc = cand[keep], xc[keep]
        if p.min_p > 0.0:
            probs = _softmax(xc)
            keep = probs >= p.min_p * probs.max()
            cand, xc = cand[keep], xc[keep]
        probs = _softmax(xc)  # summed in the order the stages left (top-p: by probability)
        if p.top_p < 1.0:
            o = np.argsort(cand)
            cand, probs = cand[o], probs[o]
        return cand, probs

    def sample(self, logits: np.ndarray, history: Sequence[int] = (), prompt_len: int = 0) -> int:
        """Next token id for logits (float32 [V]); history is prompt + output so far, its first prompt_len
        ids being the prompt (repetition penalty sees all of it, presence/frequency only the output).

        The draw inverts the CDF of `distribution` in id order; it is built over the survivors only (the zeros
        between them add nothing, exactly), which spares two passes over the vocabulary."""
        ids, probs = self._survivors(logits, history, prompt_len)
        if self.params.is_greedy:
            return int(ids[0])
        return self._invert(ids, probs)

    def draw(self, probs: np.ndarray) -> int:
        """A draw from any distribution over the vocabulary (float [V], not necessarily normalized, some mass > 0)
        from this sampler's stream: speculative decoding's draft tokens and its corrections."""
        ids = np.flatnonzero(probs > 0)
        return self._invert(ids, probs[ids])

    def draw_among(self, ids: np.ndarray, probs: np.ndarray) -> int:
        """draw() of the distribution that is probs at ids (ascending) and 0 elsewhere: the same draw, without the
        vocabulary-sized array."""
        keep = probs > 0
        return self._invert(ids[keep], probs[keep])

    def uniform(self) -> float:
        """A uniform draw in [0, 1) from this sampler's stream (speculative decoding's acceptance test)."""
        return float(self._rng.random())

    def _invert(self, ids: np.ndarray, probs: np.ndarray) -> int:
        """Invert the CDF of probs (> 0 somewhere) over ids, in id order, with one uniform draw."""
        cdf = np.cumsum(probs)
        u = self._rng.random() * cdf[-1]
        i = int(np.searchsorted(cdf, u, side="right"))
        # u can round up to cdf[-1]; fall back to the last token that has probability.
        return int(ids[i]) if i < ids.size and probs[i] > 0 else int(ids[np.flatnonzero(probs)[-1]])
