"""OpenAI logprobs over real loopback HTTP, on the built-in tiny MoE (CPU reference).

Oracles: the reference model's logits of the whole prompt + reply in one forward (log_softmax in float64; fp32
logits, so logprobs agree within 1e-4), the reply's own text (a token's bytes spell it), and the same request
without streaming (a stream's chunks carry the same entries).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from serve_client import sse_data

USER = [{"role": "user", "content": "Hello there"}]
PROMPT = "The assistant reads the question"


@pytest.fixture(scope="module")
def model(packed_model):
    return packed_model


def expected(model, prompt_ids: list[int], out: list[int]) -> np.ndarray:
    """log_softmax rows [len(out), vocab]: row t is the distribution token out[t] was drawn from."""
    logits = model.logits(prompt_ids + out[:-1])[len(prompt_ids) - 1:, :model.real_vocab_size]
    return torch.log_softmax(torch.from_numpy(logits.astype(np.float64)), -1).numpy()


def greedy(model, n: int, **prompt) -> list[int]:
    from ninfer_rt.sampling import SamplingParams

    return list(model.generate_ids(max_new_tokens=n, sampling=SamplingParams(greedy=True), **prompt))


def test_completion_logprobs_are_the_models_own(srv, model):
    out = greedy(model, 8, prompt=PROMPT)
    want = expected(model, model.tokenizer.encode(PROMPT), out)
    status, body = srv.json("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                "logprobs": 2})
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert status == 200 and len(lp["tokens"]) == len(out) == len(lp["text_offset"])
    np.testing.assert_allclose(lp["token_logprobs"], want[np.arange(len(out)), out], rtol=0, atol=1e-4)
    for row, top in zip(want, lp["top_logprobs"]):
        assert 1 <= len(top) <= 2  # two alternatives (fewer only if their texts coincide)
        assert max(top.values()) == pytest.approx(row.max(), abs=1e-4)
    text = choice["text"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["text_offset"][-1] <= len(text)
    status, _, data = srv.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8,
                                                              "temperature": 0, "logprobs": 2, "stream": True})
    chunks = [e["choices"][0]["logprobs"] for e in sse_data(data)[:-1] if e["choices"][0]["logprobs"]]
    assert status == 200 and {k: sum((c[k] for c in chunks), []) for k in lp} == lp


def test_chat_logprobs_spell_the_reply_and_match_the_model(srv, model):
    kwargs = {"enable_thinking": False}
    out = greedy(model, 10, messages=USER, **kwargs)
    want = expected(model, model.prompt_ids(messages=USER, **kwargs), out)
    request = {"messages": USER, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 3,
               "chat_template_kwargs": kwargs}
    status, body = srv.json("/v1/chat/completions", request)
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert status == 200 and len(content) == len(out) and choice["logprobs"]["refusal"] is None
    spelled = bytes(b for e in content for b in e["bytes"])
    assert spelled.decode("utf-8", "replace") == model.tokenizer.decode(out) == choice["message"]["content"]
    for e, row, i in zip(content, want, out):
        assert e["logprob"] == pytest.approx(row[i], abs=1e-4)
        assert [a["logprob"] for a in e["top_logprobs"]] == pytest.approx(np.sort(row)[::-1][:3], abs=1e-4)
    status, _, data = srv.request("POST", "/v1/chat/completions", {**request, "stream": True})
    streamed = [t for e in sse_data(data)[:-1] for t in (e["choices"][0]["logprobs"] or {}).get("content", [])]
    assert status == 200 and streamed == content


def test_echo_scores_a_prompt_as_lm_eval_asks(srv, model):
    """echo with max_tokens 0 and logprobs (lm-eval-harness's loglikelihood request): the prompt's text, every
    prompt token's logprob (the first null) as one forward gives them, and offsets into the prompt's text."""
    ids = model.tokenizer.encode(PROMPT)
    want = expected(model, ids[:1], ids[1:])  # row t: the distribution of prompt token t + 1
    status, body = srv.json("/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1})
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert status == 200 and choice["text"] == PROMPT and body["usage"]["completion_tokens"] == 0
    assert "".join(lp["tokens"]) == PROMPT and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:], want[np.arange(len(ids) - 1), ids[1:]], rtol=0, atol=1e-4)
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(ids))]  # ASCII: characters
    request = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True}  # ids, streamed
    events = sse_data(srv.request("POST", "/v1/completions", request)[2])
    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == PROMPT
    assert [t for e in events[:-1] for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])] == lp["tokens"]


def test_echo_without_logprobs_returns_the_prompt_unscored(srv, model, monkeypatch):
    """echo, max_tokens 0 and no logprobs: the prompt's text back, no logprobs, and the prompt fed without
    scoring (no forward asks for every row's logits)."""
    rows = []
    backend = model._backend
    real = backend.forward
    monkeypatch.setattr(backend, "forward", lambda ids, cache, last_only=True: rows.append(last_only)
                        or real(ids, cache, last_only=last_only))
    status, body = srv.json("/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True})
    choice = body["choices"][0]
    assert status == 200 and choice["text"] == PROMPT and choice["logprobs"] is None
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    assert rows and all(rows)


def test_echo_with_a_completion_carries_both(srv, model):
    """echo and max_tokens 4: the prompt then the completion, streamed or whole, and the logprobs of both."""
    alone = srv.json("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0})[1]
    request = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0, "echo": True}
    body = srv.json("/v1/completions", request)[1]
    choice, tail = body["choices"][0], alone["choices"][0]
    n = len(model.tokenizer.encode(PROMPT))
    assert choice["text"] == PROMPT + tail["text"]
    assert choice["logprobs"]["tokens"][n:] == tail["logprobs"]["tokens"]
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][n:], tail["logprobs"]["token_logprobs"],
                               rtol=0, atol=1e-4)
    assert [o - len(PROMPT) for o in choice["logprobs"]["text_offset"][n:]] == tail["logprobs"]["text_offset"]
    status, _, data = srv.request("POST", "/v1/completions", {**request, "stream": True})
    events = sse_data(data)[:-1]
    assert status == 200 and "".join(e["choices"][0]["text"] for e in events) == choice["text"]


def test_a_reply_without_logprobs_has_none(srv):
    body = srv.json("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})[1]
    assert body["choices"][0]["logprobs"] is None
    body = srv.json("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "logprobs": False})[1]
    assert body["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path, extra, field", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
])
def test_logprobs_fields_out_of_range_are_refused(srv, path, extra, field):
    body = {"messages": USER} if path == "/v1/chat/completions" else {"prompt": PROMPT}
    status, reply = srv.json(path, {**body, "max_tokens": 2, **extra})
    assert status == 400 and reply["error"]["param"] == field and field in reply["error"]["message"]


def test_a_special_tokens_logprob_spells_it_while_the_text_leaves_it_out(srv, model):
    """A special token in the reply (the text skips it, as vLLM's does by default) keeps its own text in the
    logprobs (vLLM's decode([id])) and adds nothing to the completion's text offsets."""
    out = greedy(model, 8, prompt=PROMPT)
    tok = model.tokenizer
    special = [k for k, i in enumerate(out) if tok.is_added(i) and not tok.decode([i], skip_special_tokens=True)]
    assert special  # the case is real: this prompt's greedy reply holds a special token
    body = srv.json("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1})[1]
    lp, text = body["choices"][0]["logprobs"], body["choices"][0]["text"]
    assert text == tok.decode(out, skip_special_tokens=True)
    for k in special:
        assert lp["tokens"][k] == tok.decode([out[k]])  # e.g. "<|im_end|>"
        assert k + 1 == len(out) or lp["text_offset"][k + 1] == lp["text_offset"][k]
    assert lp["text_offset"][-1] <= len(text)
