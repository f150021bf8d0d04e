"""The Python API's argument checks (the 2026-12-05 audit): every bad argument is a one-line NinferError that names
it, nothing is coerced (1.5, True, "1", bytes), and overflowing sampling settings take their limit instead of a NaN
that would draw a masked padding id."""

from __future__ import annotations

import array
import collections

import numpy as np
import pytest

from cli_runner import one_line
from ninfer_rt import load
from ninfer_rt.errors import NinferError
from ninfer_rt.sampling import GREEDY_TEMPERATURE, Sampler, SamplingParams

GREEDY = SamplingParams(greedy=True)
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here works on tiny tensors (see conftest.one_thread)."""


@pytest.fixture(scope="module")
def model(packed):
    with load(packed, device="cpu") as m:
        yield m


@pytest.mark.parametrize("ids, message", [
    ("abc", "expected a list of integers, got str"),
    (b"\x01\x02", "expected a list of integers, got bytes"),
    ({1: 2}, "expected a list of integers, got dict"),
    ({1, 2}, "expected a list of integers, got set"),
    (None, "expected a list of integers, got NoneType"),
    (np.array([[1, 2]]), "expected a 1-D integer array, got int64 of shape [1, 2]"),
    (np.array([1.7, 2.0]), "expected a 1-D integer array, got float64"),
    ([1.5], "token id 1.5 at position 0 is not an integer"),
    ([3, True], "token id True at position 1 is not an integer"),
    (["1"], "token id '1' at position 0 is not an integer"),
    ([float("nan")], "token id nan at position 0 is not an integer"),
    ([-1], "token id -1 at position 0 is outside the vocabulary [0, 497)"),
])
def test_logits_token_ids(model, ids, message):
    with pytest.raises(NinferError) as e:
        model.logits(ids)
    assert message in one_line(e)


def test_padding_rows_are_no_token(model, tiny_moe):
    """The embedding pads 497 tokens to 500 rows: an id in the padding is refused (as vLLM refuses an id past its
    tokenizer), not run on a row no token has. The bound is the tokenizer file's own count of tokens."""
    import json

    tok = json.loads((tiny_moe / "tokenizer.json").read_text())
    n = len({*tok["model"]["vocab"].values(), *(t["id"] for t in tok["added_tokens"])})
    assert n < model.spec.vocab_size  # there are padding rows to refuse
    model.logits([1, n - 1])
    for bad in (n, model.spec.vocab_size - 1):
        with pytest.raises(NinferError) as e:
            model.logits([1, bad])
        assert f"token id {bad} at position 1 is outside the vocabulary [0, {n})" in one_line(e)
        with pytest.raises(NinferError, match="outside the vocabulary"):
            model.batch().add([1, bad], max_new_tokens=1)


def test_logits_accepts_integer_sequences_and_stops_at_the_context(model):
    # the same ids as a list, a tuple, a range and an int32 array give the same logits
    outs = [model.logits(ids) for ids in ([5, 6, 7], (5, 6, 7), range(5, 8), np.array([5, 6, 7], np.int32),
                                          collections.deque([5, 6, 7]), array.array("i", [5, 6, 7]))]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    n = model.spec.max_position_embeddings
    with pytest.raises(NinferError, match=f"{n + 1} token ids; the context holds {n}"):
        model.logits([1] * (n + 1))


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": b"hi"}, "prompt is bytes; decode it to str"),
    ({"prompt": 123}, "expected a list of integers, got int"),
    ({"prompt": "hi", "sampling": {"temperature": 0}}, "sampling: expected a SamplingParams, got dict"),
    ({"prompt": "hi", "max_new_tokens": True}, "max_new_tokens=True: must be an integer >= 1"),
    ({"prompt": "hi", "enable_thinking": False}, "tools and enable_thinking reach the chat template"),
    ({"messages": USER, "enable_thinking": "no"}, "enable_thinking must be True, False or None, got 'no'"),
    ({"messages": [{"content": "x"}]}, "messages[0].role must be a non-empty string, got None"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content must be a string, None or a list"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": "oops"}]},
     "messages[0].tool_calls must be a list of dicts, got 'oops'"),
    ({"messages": USER, "tools": ""}, "tools must be a list of non-empty dicts"),
    ({"messages": USER, "tools": [{}]}, "tools must be a list of non-empty dicts"),
])
def test_generate_arguments(model, kwargs, message):
    with pytest.raises(NinferError) as e:
        model.generate(**{"max_new_tokens": 2, "sampling": GREEDY, **kwargs})
    assert message in one_line(e)


def test_stop_as_one_string_is_one_stop_string(model):
    full = "".join(model.generate("hi", max_new_tokens=8, sampling=GREEDY))
    stop = full[2:4]
    assert len(stop) == 2 and full.find(stop) == 2  # oracle: the greedy text itself
    for given in (stop, [stop], (stop,)):
        assert "".join(model.generate("hi", max_new_tokens=8, sampling=GREEDY, stop=given)) == full[:2]
        assert model.last_stats.finish_reason == "stop"


def test_interleaved_generations_keep_their_own_stats(model):
    full = "".join(model.generate("hello", max_new_tokens=8, sampling=GREEDY))
    a = model.generate("hello", max_new_tokens=8, sampling=GREEDY, stop=[full[3:5]])
    first = next(a)
    b = list(model.generate("zzz", max_new_tokens=4, sampling=GREEDY))
    stats_b = model.last_stats
    assert stats_b.finish_reason == "length" and len(stats_b.token_ids) == 4 and b
    assert first + "".join(a) == full[:3]
    assert stats_b.finish_reason == "length"  # a's stop string is a's, not written into b's stats


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": "1"}, "temperature='1': must be a number"),
    ({"top_p": None}, "top_p=None: must be a number"),
    ({"min_p": True}, "min_p=True: must be a number"),
    ({"repetition_penalty": 2**1100}, "repetition_penalty: "),
    ({"top_k": True}, "top_k=True: must be an integer >= 0"),
    ({"greedy": "false"}, "greedy='false': must be True or False"),
])
def test_sampling_params_types(kwargs, message):
    with pytest.raises(NinferError) as e:
        SamplingParams(**kwargs)
    assert message in one_line(e)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 1e-310},  # logits / T would overflow: below GREEDY_TEMPERATURE it is the arg-max
    {"temperature": GREEDY_TEMPERATURE / 2},
    {"repetition_penalty": 1e-320, "temperature": 0.7},  # positive logits / penalty overflow
    {"presence_penalty": -1e308, "frequency_penalty": -1e308, "temperature": 0.5},  # -(-inf): +inf
])
def test_overflowing_sampling_takes_its_limit(kwargs):
    # oracle: the limit by hand. Logits with a padded tail (-inf) and a clear maximum; history holds ids 3 and 5
    logits = np.array([0.5, 2.0, -1.0, 1.5, 0.0, 1.0, -np.inf, -np.inf], np.float32)
    history, prompt_len = [3, 5], 0
    # a tiny temperature: the argmax (id 1); a penalty that overflows to +inf on ids 3 and 5 (both positive, so
    # repetition divides them): those two share the mass
    penalised = kwargs.get("repetition_penalty", 1.0) != 1.0 or "presence_penalty" in kwargs
    want = {3, 5} if penalised else {1}
    sampler = Sampler(SamplingParams(seed=0, **kwargs))
    with np.errstate(all="raise"):  # no overflow or NaN warning escapes either
        draws = {sampler.sample(logits, history, prompt_len) for _ in range(64)}
        dist = sampler.distribution(logits, history, prompt_len)
    assert draws == want
    assert np.all(np.isfinite(dist)) and dist[6:].sum() == 0 and abs(dist.sum() - 1) < 1e-12
    assert set(np.flatnonzero(dist)) == want


@pytest.mark.parametrize("kwargs, message", [
    ({"path": None}, "path must be a str or os.PathLike, got NoneType"),
    ({"path": b"x.ninfer"}, "path must be a str or os.PathLike, got bytes"),
    ({"progress": 5}, "progress must be a callable(done, total) or None, got int"),
    ({"check_checksums": "no"}, "check_checksums must be True or False, got 'no'"),
    ({"prefill_chunk": -5}, "prefill chunk -5: must be a number of tokens >= 1"),
])
def test_load_arguments(packed, kwargs, message):
    args = {"path": packed, "device": "cpu", **kwargs}
    with pytest.raises(NinferError) as e:
        load(args.pop("path"), **args)
    assert message in one_line(e)


@pytest.mark.parametrize("call, message", [
    (lambda t: t.encode(None), "encode: expected text (str), got NoneType"),
    (lambda t: t.decode([-1]), "decode: token id -1 is not an integer in [0, "),
    (lambda t: t.decode([10**6]), "decode: token id 1000000 is not an integer in [0, "),
    (lambda t: t.decode(["a"]), "decode: token id 'a' is not an integer"),
    (lambda t: t.decode(None), "decode: expected token ids, got NoneType"),
    (lambda t: t.token_to_id(5), "token_to_id: expected a token string, got int"),
])
def test_tokenizer_arguments(model, call, message):
    with pytest.raises(NinferError) as e:
        call(model.tokenizer)
    assert message in one_line(e)


def test_load_takes_numpy_integers_and_reports_hashing_to_its_end(packed):
    calls = []
    with load(packed, device="cpu", max_ctx=np.int64(256), prefill_chunk=np.int32(64), check_checksums=True,
              progress=lambda done, total: calls.append((done, total))) as m:
        assert m.logits([1, 2]).shape[0] == 2
        sizes = [o.nbytes for o in [*m.artifact.tensors.values(), *m.artifact.resources.values()]]
    # oracle: the table's byte counts; the bar ends (done == total), so it is not left live over the generated text
    assert calls and calls[-1] == (sum(sizes), sum(sizes)) and all(t == sum(sizes) for _, t in calls)


def test_max_ctx_bounds_a_sequence_on_the_cpu_too(packed):
    """load(..., "cpu", max_ctx=n): the reference grows its cache as it goes, but a sequence still holds at most n
    positions, as on the GPU: a prompt of n tokens is refused in one line, a shorter one generates up to n."""
    with load(packed, device="cpu", max_ctx=16) as m:
        assert m.context_length == 16
        with pytest.raises(NinferError, match="the context holds 16"):
            list(m.generate_ids(list(range(3, 19)), max_new_tokens=4))
        out = list(m.generate_ids(list(range(3, 13)), max_new_tokens=50, sampling=SamplingParams(greedy=True)))
        s = m.last_stats
        assert len(out) <= s.generated_tokens <= 16 - 10 and (s.finish_reason == "length") == (s.generated_tokens == 6)
    with load(packed, device="cpu") as m:  # unbounded: the same greedy ids, cut where the 16 positions end
        assert out == list(m.generate_ids(list(range(3, 13)), max_new_tokens=6, sampling=SamplingParams(greedy=True)))


def test_a_prompt_encoded_past_the_vocabulary_is_one_line(model, monkeypatch):
    """An artifact whose tokenizer gives ids its embedding lacks (packed before quantize checked that): a prompt
    that encodes to one is refused in one line, not an IndexError inside the forward."""
    ids = model.prompt_ids(messages=USER)
    top = max(ids)  # <|im_start|> and friends sit at the end of the tiny vocabulary
    monkeypatch.setattr(type(model), "real_vocab_size", property(lambda self: top))
    with pytest.raises(NinferError) as e:
        model.prompt_ids(messages=USER)
    assert one_line(e) == (f"the prompt encodes to token id {top}, past the model's vocabulary of {top}: its "
                           "tokenizer and weights disagree")
    with pytest.raises(NinferError, match="past the model's vocabulary"):
        list(model.generate(messages=USER, max_new_tokens=1))
