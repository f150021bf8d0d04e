"""OpenAI's n (several choices of one prompt) over real loopback HTTP, on the built-in tiny MoE (CPU reference).

Oracle: the same request with n = 1 and seed s + i gives choice i (each choice is its own sequence of the batch,
choice i sampling with seed + i), so a choice's text, finish reason and logprobs must equal that lone request's;
usage counts the prompt once and every choice's tokens.
"""

from __future__ import annotations

import pytest

from serve_client import Running, sse_data

USER = [{"role": "user", "content": "Name a colour"}]
PROMPT = "Colours of the rainbow:"
SAMPLED = {"temperature": 1.0, "top_k": 50, "max_tokens": 12}


@pytest.fixture(scope="module")
def srv(packed_model):
    with Running(packed_model, parallel=2) as r:
        yield r


def alone(srv, path: str, body: dict, seed: int) -> dict:
    status, out = srv.json(path, {**body, "seed": seed})
    assert status == 200, out
    return out


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 2}, "message"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 2}, "text"),
])
def test_each_choice_is_the_request_alone_with_its_seed(srv, path, body, field):
    """n = 3 with seed 7: choice i is the lone request with seed 7 + i (text, finish reason, logprobs); the choices
    differ from one another (sampled at temperature 1), come in index order under one id, and the usage counts
    the prompt once."""
    request = {**body, **SAMPLED}
    status, out = srv.json(path, {**request, "n": 3, "seed": 7})
    assert status == 200, out
    want = [alone(srv, path, request, 7 + i) for i in range(3)]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for got, w in zip(out["choices"], want):
        assert got[field] == w["choices"][0][field]
        assert got["finish_reason"] == w["choices"][0]["finish_reason"]
        assert got["logprobs"] == w["choices"][0]["logprobs"]
    texts = [str(c[field]) for c in out["choices"]]
    assert len(set(texts)) > 1, "three sampled choices came out identical"
    usage, lone = out["usage"], [w["usage"] for w in want]
    assert usage["prompt_tokens"] == lone[0]["prompt_tokens"]
    assert usage["completion_tokens"] == sum(u["completion_tokens"] for u in lone)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_stream_of_choices_tags_each_chunk_with_its_index(srv):
    """Streamed, n = 2: one id, each choice's role chunk, its text in chunks of its own index and one final chunk
    with its finish reason; then one usage chunk (include_usage) and one [DONE]. Each index's text is the whole
    reply's choice."""
    request = {"messages": USER, **SAMPLED, "n": 2, "seed": 3}
    whole = srv.json("/v1/chat/completions", request)[1]
    status, _, data = srv.request("POST", "/v1/chat/completions",
                                  {**request, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_data(data)
    assert status == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and all(len(c["choices"]) == 1 for c in chunks)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [m["finish_reason"] for m in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] == whole["choices"][i]["finish_reason"]
        text = "".join(m["delta"].get("content") or "" for m in mine)
        reasoning = "".join(m["delta"].get("reasoning_content") or "" for m in mine)
        assert text == (whole["choices"][i]["message"]["content"] or "")
        assert reasoning == whole["choices"][i]["message"].get("reasoning_content", "")


def test_more_choices_than_the_server_can_hold_are_refused(packed_model):
    """n past --parallel + --max-queue could never all queue: a 400 naming both options, not a 503 to retry."""
    with Running(packed_model, parallel=2, max_queue=1) as r:
        status, out = r.json("/v1/completions", {"prompt": PROMPT, "n": 4, "max_tokens": 2})
        assert status == 400 and out["error"]["param"] == "n"
        assert out["error"]["message"] == ("n=4 exceeds the 3 generations this server runs or queues at once "
                                           "(--parallel + --max-queue)")
        assert r.json("/v1/completions", {"prompt": PROMPT, "n": 3, "max_tokens": 2})[0] == 200


PROMPTS = ["Colours of the rainbow:", "The capital of France is", "One, two, three,"]


def test_a_batch_of_prompts_is_each_prompt_alone(srv):
    """prompt as a list of three strings with n = 2 and seed 5: choice 2p + i is prompt p alone with seed 5 + i
    (OpenAI orders a batch's choices prompt by prompt, then choice), logprobs and echo included; usage counts each
    prompt once and every choice's tokens."""
    request = {"logprobs": 1, "echo": True, **SAMPLED}
    status, out = srv.json("/v1/completions", {**request, "prompt": PROMPTS, "n": 2, "seed": 5})
    assert status == 200, out
    want = [alone(srv, "/v1/completions", {**request, "prompt": p}, 5 + i) for p in PROMPTS for i in range(2)]
    assert [c["index"] for c in out["choices"]] == list(range(6))
    for got, w in zip(out["choices"], want):
        assert {k: got[k] for k in ("text", "finish_reason", "logprobs")} == \
               {k: w["choices"][0][k] for k in ("text", "finish_reason", "logprobs")}
    assert [c["text"].startswith(p) for c, p in zip(out["choices"], [p for p in PROMPTS for _ in "ab"])] == [True] * 6
    usage = out["usage"]
    assert usage["prompt_tokens"] == sum(w["usage"]["prompt_tokens"] for w in want[::2])
    assert usage["completion_tokens"] == sum(w["usage"]["completion_tokens"] for w in want)


def test_a_batch_of_token_id_prompts_streams_each_by_index(srv):
    """prompt as two token-id lists (lm-eval's batched requests), streamed: each index's chunks join into that
    prompt's whole reply, greedy, so the same text as the request without streaming."""
    ids = [srv.json("/tokenize", {"prompt": p})[1]["tokens"] for p in PROMPTS[:2]]
    request = {"prompt": ids, "max_tokens": 6, "temperature": 0}
    whole = srv.json("/v1/completions", request)[1]
    assert [c["text"] for c in whole["choices"]] == \
           [srv.json("/v1/completions", {**request, "prompt": one})[1]["choices"][0]["text"] for one in ids]
    status, _, data = srv.request("POST", "/v1/completions", {**request, "stream": True})
    chunks = sse_data(data)[:-1]
    assert status == 200 and {c["id"] for c in chunks} == {chunks[0]["id"]}
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(m["text"] for m in mine) == whole["choices"][i]["text"]
        assert mine[-1]["finish_reason"] == whole["choices"][i]["finish_reason"]


@pytest.mark.parametrize("prompt, reason", [
    (["a", [1, 2]], "'prompt' must be"), (["a", ""], "'prompt' must be"), ([[1], []], "'prompt' must be"),
    ([], "'prompt' must be"), (["a", 3], "'prompt' must be"),
    ([[1, 2], [10**9]], "prompt 1: "),
])
def test_a_bad_batch_is_refused_naming_the_prompt(srv, prompt, reason):
    """Mixed forms, an empty prompt, an empty batch: the form's one line; a token id past the vocabulary in the
    second prompt: that prompt named."""
    status, out = srv.json("/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert status == 400 and out["error"]["message"].startswith(reason), out


def test_a_batch_larger_than_the_server_can_hold_is_refused(packed_model):
    """prompts x n past --parallel + --max-queue: a 400 naming the product, before any prompt is prepared."""
    with Running(packed_model, parallel=2, max_queue=1) as r:
        status, out = r.json("/v1/completions", {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 2})
        assert status == 400 and out["error"]["param"] == "prompt"
        assert out["error"]["message"] == ("2 prompts x n=2 exceeds the 3 generations this server runs or queues "
                                           "at once (--parallel + --max-queue)")
        assert r.json("/v1/completions", {"prompt": PROMPTS, "max_tokens": 2})[0] == 200


def test_a_seeded_message_is_the_chat_endpoints_reply_with_that_seed(srv):
    """/v1/messages takes seed as the OpenAI endpoints do (an extension of the Messages API): a sampled message
    with seed s is the chat endpoint's reply to the same turn with seed s and thinking off (one prompt, one stream
    of draws), and seeds s and s + 1 differ."""
    ask = {"temperature": 1.0, "top_k": 50, "max_tokens": 12}
    chat = [alone(srv, "/v1/chat/completions", {"messages": USER, **ask,
                                                "chat_template_kwargs": {"enable_thinking": False}}, s)
            for s in (11, 12)]
    msgs = [alone(srv, "/v1/messages", {"messages": USER, **ask}, s) for s in (11, 12)]
    for c, m in zip(chat, msgs):
        assert [b["type"] for b in m["content"]] == ["text"]
        assert m["content"][0]["text"] == c["choices"][0]["message"]["content"]
        assert m["usage"]["output_tokens"] == c["usage"]["completion_tokens"]
    assert msgs[0]["content"] != msgs[1]["content"], "seeds 11 and 12 sampled the same twelve tokens"
