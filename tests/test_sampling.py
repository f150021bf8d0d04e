"""Host sampler against straightforward re-implementations written here from the definitions.

Allowed sets (top-k, top-p, min-p) and penalties are recomputed with plain Python loops; empirical frequencies are
checked against the softmax with a binomial 5-sigma bound.
"""

from __future__ import annotations

import json
import math
from re import escape as re_escape
from collections import Counter

import numpy as np
import pytest

from ninfer_pack.tiny_tokenizer import tiny_tokenizer_files
from ninfer_rt.errors import NinferError
from ninfer_rt.sampling import Sampler, SamplingParams, apply_penalties

V = 48


def _logits(seed: int, scale: float = 1.5, vocab: int = V) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


def _softmax_py(values: list[float]) -> list[float]:
    """Softmax in Python floats; -inf -> 0."""
    m = max(values)
    e = [math.exp(v - m) if v != -math.inf else 0.0 for v in values]
    s = sum(e)
    return [x / s for x in e]


def _draw(params: SamplingParams, logits: np.ndarray, n: int, history=(), prompt_len=0) -> Counter:
    s = Sampler(params)
    return Counter(s.sample(logits, list(history), prompt_len) for _ in range(n))


# --- independent allowed sets ---------------------------------------------------------------------------

def _allowed_top_k(logits: list[float], k: int) -> set[int]:
    return set(sorted(range(len(logits)), key=lambda i: -logits[i])[:k])


def _allowed_top_p(logits: list[float], p: float) -> set[int]:
    probs = _softmax_py(logits)
    out, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        out.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return out


def _allowed_min_p(logits: list[float], min_p: float) -> set[int]:
    probs = _softmax_py(logits)
    return {i for i, q in enumerate(probs) if q >= min_p * max(probs)}


def _masked(logits: list[float], keep: set[int]) -> list[float]:
    return [v if i in keep else -math.inf for i, v in enumerate(logits)]


def _top_p_margin(logits: list[float], p: float) -> float:
    """Distance from p to the nearest cumulative sum: the test needs it well above float64 rounding."""
    probs = sorted(_softmax_py(logits), reverse=True)
    cums = np.cumsum(probs)
    return float(np.min(np.abs(cums - p)))


def test_greedy_is_argmax():
    for seed in range(40):
        logits = _logits(seed)
        want = int(np.argmax(logits))
        assert Sampler(SamplingParams(greedy=True)).sample(logits, []) == want
        assert Sampler(SamplingParams(temperature=0.0)).sample(logits, []) == want


def test_top_k_one_is_greedy():
    for seed in range(40):
        logits = _logits(seed)
        assert Sampler(SamplingParams(top_k=1, seed=seed)).sample(logits, []) == int(np.argmax(logits))


@pytest.mark.parametrize("k", [1, 3, 7, 20])
def test_top_k_stays_in_allowed_set(k):
    logits = _logits(1, scale=0.7)
    allowed = _allowed_top_k(logits.tolist(), k)
    drawn = _draw(SamplingParams(top_k=k, seed=5), logits, 1500)
    assert set(drawn) == allowed  # nothing outside, and (with these flat logits) every member appears


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_top_p_stays_in_allowed_set(p):
    logits = _logits(2, scale=1.2)
    lst = logits.astype(np.float64).tolist()
    assert _top_p_margin(lst, p) > 1e-6
    allowed = _allowed_top_p(lst, p)
    drawn = _draw(SamplingParams(top_p=p, seed=6), logits, 2000)
    assert set(drawn) <= allowed
    assert set(np.flatnonzero(Sampler(SamplingParams(top_p=p)).distribution(logits))) == allowed


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.6])
def test_min_p_stays_in_allowed_set(min_p):
    logits = _logits(3, scale=1.2)
    allowed = _allowed_min_p(logits.astype(np.float64).tolist(), min_p)
    drawn = _draw(SamplingParams(min_p=min_p, seed=7), logits, 2000)
    assert set(drawn) <= allowed
    assert set(np.flatnonzero(Sampler(SamplingParams(min_p=min_p)).distribution(logits))) == allowed


def test_stages_compose_in_order():
    # penalties are off here; temperature -> top-k -> top-p -> min-p, each on what the previous left
    logits = _logits(4, scale=1.0)
    t, k, p, mp = 0.8, 12, 0.8, 0.15
    x = [v / t for v in logits.astype(np.float64).tolist()]
    x = _masked(x, _allowed_top_k(x, k))
    x = _masked(x, _allowed_top_p(x, p))
    x = _masked(x, _allowed_min_p(x, mp))
    want = _softmax_py(x)
    got = Sampler(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp)).distribution(logits)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)  # both float64


def test_temperature_to_zero_limit():
    logits = _logits(8)
    top = int(np.argmax(logits))
    gap = float(np.sort(logits)[-1] - np.sort(logits)[-2])
    for t in (1e-1, 1e-2, 1e-3):
        probs = Sampler(SamplingParams(temperature=t)).distribution(logits)
        # every other token is at most exp(-gap / t) times the top one
        assert 1.0 - probs[top] <= V * math.exp(-gap / t) + 1e-15
    assert set(_draw(SamplingParams(temperature=1e-3, seed=1), logits, 200)) == {top}


def test_seed_determinism():
    logits = _logits(9, scale=0.5)
    params = SamplingParams(temperature=1.1, top_k=30, top_p=0.97, seed=1234)

    def run(p):
        s = Sampler(p)
        return [s.sample(logits, []) for _ in range(300)]

    assert run(params) == run(params)
    assert run(params) != run(SamplingParams(temperature=1.1, top_k=30, top_p=0.97, seed=1235))


def _naive_penalties(logits: list[float], history: list[int], prompt_len: int, rep: float, presence: float,
                     frequency: float) -> list[float]:
    """The definitions, token by token: repetition over prompt+output, presence/frequency over output."""
    out = list(logits)
    for tok in set(history):
        out[tok] = out[tok] / rep if out[tok] > 0 else out[tok] * rep
    counts: dict[int, int] = {}
    for tok in history[prompt_len:]:
        counts[tok] = counts.get(tok, 0) + 1
    for tok, c in counts.items():
        out[tok] -= frequency * c + presence
    return out


@pytest.mark.parametrize("rep, presence, frequency", [(1.3, 0.0, 0.0), (1.0, 1.5, 0.0), (1.0, 0.0, 0.4),
                                                      (1.2, 0.7, 0.3), (0.8, -0.5, 0.2)])
def test_penalties_match_definitions(rep, presence, frequency):
    logits = _logits(10)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, V, 20).tolist()
    output = rng.integers(0, V, 15).tolist() + [prompt[0], prompt[0]]  # repeats, some also in the prompt
    history = prompt + output
    params = SamplingParams(repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency)
    want = _naive_penalties(logits.astype(np.float64).tolist(), history, len(prompt), rep, presence, frequency)
    np.testing.assert_allclose(apply_penalties(logits, history, len(prompt), params), want, rtol=1e-14)
    np.testing.assert_allclose(Sampler(params).distribution(logits, history, len(prompt)), _softmax_py(want),
                               rtol=1e-12, atol=1e-15)
    greedy = SamplingParams(greedy=True, repetition_penalty=rep, presence_penalty=presence,
                            frequency_penalty=frequency)
    assert Sampler(greedy).sample(logits, history, len(prompt)) == int(np.argmax(want))


def test_penalties_change_the_pick():
    logits = np.zeros(V, dtype=np.float32)
    logits[5], logits[6] = 3.0, 2.5
    greedy = SamplingParams(greedy=True, presence_penalty=1.0)
    assert Sampler(greedy).sample(logits, [5], prompt_len=1) == 5  # prompt tokens are not presence-penalised
    assert Sampler(greedy).sample(logits, [5], prompt_len=0) == 6


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, seed=21),
                                    SamplingParams(temperature=1.3, top_k=4, seed=22)])
def test_empirical_distribution_matches_softmax(params):
    logits = _logits(12, scale=1.0, vocab=8)
    x = [v / params.temperature for v in logits.astype(np.float64).tolist()]
    if params.top_k:
        x = _masked(x, _allowed_top_k(x, params.top_k))
    probs = _softmax_py(x)
    n = 20000
    counts = _draw(params, logits, n)
    for i, q in enumerate(probs):
        # binomial count: mean n q, sd sqrt(n q (1 - q)); 5 sigma keeps a false alarm below 1e-6 per token
        assert abs(counts.get(i, 0) - n * q) <= 5 * math.sqrt(n * q * (1 - q)) + 1e-9, (i, counts.get(i, 0), n * q)


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5),
                                          ("min_p", 1.1), ("repetition_penalty", 0.0),
                                          ("presence_penalty", math.nan)])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(NinferError, match=field):
        SamplingParams(**{field: value})


def test_top_k_minus_one_is_off():
    """-1 switches top-k off, as in vLLM and llama.cpp, the same as our 0."""
    assert SamplingParams(top_k=-1, temperature=0.8, seed=3) == SamplingParams(top_k=0, temperature=0.8, seed=3)


def test_an_infinite_temperature_is_refused_as_not_finite():
    with pytest.raises(NinferError, match=r"temperature=inf: must be finite and >= 0"):
        SamplingParams(temperature=math.inf)


@pytest.mark.parametrize("cfg, message", [
    ({"top_k": math.inf}, "generation_config.json: top_k=inf is not an integer"),  # int(inf) raised OverflowError
    # nothing coerced, as transformers' GenerationConfig refuses these
    ({"top_k": 20.7}, "generation_config.json: top_k=20.7 is not an integer"),
    ({"top_k": True}, "generation_config.json: top_k=True is not an integer"),
    ({"temperature": "0.7"}, "generation_config.json: temperature='0.7' is not a number"),
    ({"temperature": math.inf}, "generation_config.json: sampling temperature=inf: must be finite and >= 0"),
    ({"temperature": -1}, "generation_config.json: sampling temperature=-1.0: must be finite and >= 0"),
    ({"top_p": 0}, "generation_config.json: sampling top_p=0.0: must be in (0, 1]"),
    ({"top_k": -3}, "generation_config.json: sampling top_k=-3: must be"),
])
def test_a_bad_generation_config_value_is_blamed_on_the_file(cfg, message):
    with pytest.raises(NinferError) as e:
        SamplingParams.defaults_from_generation_config({**cfg, "do_sample": True})
    assert str(e.value).startswith(message), e.value
    key = next(iter(cfg))  # a value given replaces the file's bad one
    good = {"top_k": 5, "temperature": 0.5, "top_p": 0.5}[key]
    assert getattr(SamplingParams.defaults_from_generation_config(cfg, **{key: good}), key) == good


def test_do_sample_must_be_a_boolean():
    """"false" is a true value in Python: it turned sampling on."""
    with pytest.raises(NinferError, match=r"^generation_config.json: do_sample='false' is not true or false$"):
        SamplingParams.defaults_from_generation_config({"do_sample": "false"})
    assert SamplingParams.defaults_from_generation_config({"do_sample": "false"}, greedy=True).greedy


def test_no_finite_logit_names_the_model_not_the_penalties():
    nan = np.full(8, np.nan, np.float32)
    with pytest.raises(NinferError, match="the model gave no finite logit"):
        Sampler(SamplingParams(greedy=True)).distribution(nan)
    huge = SamplingParams(temperature=1.0, presence_penalty=1e308, frequency_penalty=1e308, seed=1)
    with pytest.raises(NinferError, match="the penalties left no token with a finite logit"):
        Sampler(huge).distribution(np.zeros(3, np.float32), history=[0, 1, 2, 0, 1, 2], prompt_len=0)


def test_defaults_from_generation_config():
    cfg = json.loads(tiny_tokenizer_files()["generation_config.json"])
    p = SamplingParams.defaults_from_generation_config(cfg)
    assert (p.greedy, p.temperature, p.top_k, p.top_p) == (not cfg["do_sample"], cfg["temperature"], cfg["top_k"],
                                                           cfg["top_p"])
    assert SamplingParams.defaults_from_generation_config({}).is_greedy  # HF: do_sample defaults to false
    assert SamplingParams.defaults_from_generation_config(cfg, seed=3, top_k=5).top_k == 5
    with pytest.raises(NinferError, match="generation_config.json: top_p"):
        SamplingParams.defaults_from_generation_config({"top_p": "high"})
    # a value given replaces the file's, even one the file got wrong (an artifact from before quantize checked it)
    assert SamplingParams.defaults_from_generation_config({"top_p": "high", "do_sample": True}, top_p=0.5).top_p == 0.5


def test_draw_among_a_support_is_the_draw_of_the_whole_row():
    """draw_among(ids, probs) consumes the stream as draw() of the vocabulary-sized row that is probs at ids (zeros
    among them included): the same ids, draw after draw, from the same seed."""
    rng = np.random.default_rng(5)
    whole, sparse = Sampler(SamplingParams(seed=11)), Sampler(SamplingParams(seed=11))
    for _ in range(200):
        row = np.zeros(5000)
        ids = np.sort(rng.choice(5000, size=int(rng.integers(1, 30)), replace=False))
        row[ids] = rng.random(ids.size) * (rng.random(ids.size) > 0.2)
        if not row.any():
            continue
        assert whole.draw(row) == sparse.draw_among(ids, row[ids])


def test_greedy_picks_agree_on_nan_logits():
    """NaN counts as -inf wherever a greedy pick is made: the Sampler and the CPU backend's arg-max (greedy
    speculative verification) choose the same token from the same row."""
    from ninfer_rt.reference.backend import _top1

    rows = np.array([[2.0, np.nan, 1.0, 0.0], [np.nan, np.nan, -1.0, 5.0], [1.0, 3.0, 3.0, np.nan]], np.float32)
    greedy = Sampler(SamplingParams(greedy=True))
    assert _top1(rows, 4).tolist() == [greedy.sample(row) for row in rows] == [0, 3, 1]


def _adversarial_rows(rng) -> list[tuple[np.ndarray, float]]:
    """(logits float32, temperature) pairs where the top-k path could differ from the whole row's: ties at the
    k-th value, neighbours one ulp apart, -inf and NaN entries, huge logits with tiny temperatures (overflow at
    the top), huge temperatures (quotients near the subnormal range), and plain rows."""
    rows = []
    for _ in range(300):
        v = (rng.standard_normal(64) * rng.choice([0.5, 3.0, 30.0])).astype(np.float32)
        kind = rng.integers(0, 6)
        if kind == 1:  # many exact ties
            v = np.round(v).astype(np.float32)
        elif kind == 2:  # neighbours a float32 ulp apart around one value
            base = np.float32(rng.standard_normal())
            v[:16] = [np.nextafter(base, np.float32(np.inf * (-1) ** j)) if j % 3 else base for j in range(16)]
        elif kind == 3:
            v[rng.integers(0, 64, 5)] = -np.inf
            v[rng.integers(0, 64)] = np.nan
        elif kind == 4:
            v[:3] = np.float32(3e38)
        T = float(rng.choice([1e-3, 0.3, 0.7, 1.0, 2.0, 1e5, 1e300]))
        rows.append((v, T))
    for _ in range(300):  # float64 rows (as penalties leave them): what float32 logits cannot reach
        x = rng.standard_normal(64)
        kind, T = rng.integers(0, 4), float(rng.uniform(1.1, 3.9))
        if kind == 0:  # the largest values a few float64 ulps apart: dividing by T merges some of them
            top = 5.0 + rng.random()
            x[:12] = [top - j * np.spacing(top) for j in range(12)]
        elif kind == 1:  # quotients past float64's range at the top (an extreme penalty): ties at +inf
            x[:4] = [1.7e308, 1.6e308, 1e308, 1.0]
            T = float(rng.choice([0.5, 1e-3]))
        elif kind == 3:  # the k-th value 0, with subnormal negatives that a large temperature rounds to -0
            x[:8] = [3.0, 2.0, 1.0, 0.0, -1e-320, -4e-321, 0.0, -2e-323]
            T = 1e10
        else:  # quotients in the subnormal range, where division merges values many ulps apart
            x = x * 1e-300
            top = 5e-300
            x[:12] = [top - j * 40 * np.spacing(top) for j in range(12)]
            T = 1e10
        rows.append((x, T))
    return rows


def test_the_top_k_path_equals_the_whole_rows_stages_exactly():
    """Sampler._survivors finds the top-k candidates before dividing by the temperature (two passes over the
    vocabulary fewer); ids and probabilities equal, bit for bit, those of every stage over the whole row
    (whole=True), with and without penalties, top-p and min-p, over adversarial rows."""
    rng = np.random.default_rng(3)
    cases = 0
    for v, T in _adversarial_rows(rng):
        for k in (1, 3, 20, 63):
            for extra in ({}, {"top_p": 0.8}, {"min_p": 0.05}, {"presence_penalty": 1.5, "repetition_penalty": 1.3}):
                s = Sampler(SamplingParams(temperature=T, top_k=k, seed=1, **extra))
                history = [int(i) for i in rng.integers(0, 64, 12)]
                try:
                    want = s._survivors(v, history, 4, whole=True)
                except NinferError as e:
                    with pytest.raises(NinferError, match=re_escape(str(e))):
                        s._survivors(v, history, 4)
                    continue
                got = s._survivors(v, history, 4)
                assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (T, k, extra)
                cases += 1
    assert cases > 8000


def test_the_nucleus_of_a_sorted_head_equals_the_whole_sorts():
    """sampling._nucleus sorts only the likeliest `head` tokens (growing 4x where the cut falls past them): its
    kept positions, in order, equal the whole row's stable sort cut where the mass before a token reaches top_p,
    on rows with many ties, flat rows (the head holds nothing sure), peaked and long-tailed ones."""
    from ninfer_rt.sampling import _nucleus

    def definition(probs, top_p):
        order = np.argsort(-probs, kind="stable")
        return order[np.cumsum(probs[order]) - probs[order] < top_p]

    rng = np.random.default_rng(9)
    grew = 0
    for _ in range(400):
        n = int(rng.choice([7, 64, 700, 3000]))
        kind = rng.integers(0, 4)
        if kind == 0:
            z = rng.standard_normal(n) * rng.choice([0.3, 3.0])
        elif kind == 1:  # few distinct values: ties everywhere, at the cut too
            z = rng.integers(0, 4, n).astype(np.float64)
        elif kind == 2:  # flat
            z = np.zeros(n)
        else:  # a peak and a long flat tail
            z = np.zeros(n)
            z[rng.integers(0, n, 3)] = 6.0
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        for top_p in (0.05, 0.5, 0.9, 0.999):
            for head in (1, 4, 50):
                got = _nucleus(probs, top_p, head=head)
                assert np.array_equal(got, definition(probs, top_p)), (n, kind, top_p, head)
                grew += got.size > head
    assert grew > 100  # the head had to grow, often


def test_top_p_without_top_k_equals_the_whole_rows_stages():
    """With top-k off (every token a candidate) the sampler's top-p takes the sorted head; ids and probabilities
    equal the whole-row definition's bit for bit on rows larger than the head."""
    rng = np.random.default_rng(4)
    for trial in range(40):
        v = (rng.standard_normal(5000) * rng.choice([0.5, 2.0, 6.0])).astype(np.float32)
        if trial % 4 == 1:
            v = np.round(v).astype(np.float32)  # ties
        for top_p, min_p in ((0.3, 0.0), (0.9, 0.0), (0.95, 0.01)):
            s = Sampler(SamplingParams(temperature=float(rng.choice([0.5, 1.0, 1.7])), top_p=top_p, min_p=min_p,
                                       seed=1))
            got, want = s._survivors(v, [], 0), s._survivors(v, [], 0, whole=True)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
