"""ninfer-rt serve over real loopback HTTP, on the built-in tiny MoE (CPU reference).

Oracles: the Python API on the same model (greedy tokens, their text, the token counts, the chat template's
prompt), and scripted replies (known reasoning, text and tool calls) for what the random weights cannot produce.
Every server here listens on 127.0.0.1 with an OS-chosen port; each request is bounded by a socket timeout.
"""

from __future__ import annotations

import json

import pytest

from ninfer_rt.serve import anthropic as anthropic_api
from ninfer_rt.serve.common import prompt_text
from serve_client import sse_data, sse_events

USER = [{"role": "user", "content": "Hello there"}]
NO_THINK = {"enable_thinking": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def model(packed_model):
    return packed_model


def greedy_oracle(model, max_tokens: int, skip_special_tokens: bool = True, **prompt):
    """(text, stats) of greedy decoding through the API: what the server must answer (special tokens left out of
    the text unless the request says skip_special_tokens false, as in vLLM)."""
    from ninfer_rt.sampling import SamplingParams

    text = "".join(model.generate(max_new_tokens=max_tokens, sampling=SamplingParams(greedy=True),
                                  skip_special_tokens=skip_special_tokens, **prompt))
    return text, model.last_stats


# ----------------------------------------------------------------------------------------------- OpenAI


def test_chat_equals_greedy_generation_through_the_api(srv, model):
    want, stats = greedy_oracle(model, 10, messages=USER, enable_thinking=False)
    status, body = srv.json("/v1/chat/completions", {"model": "anything", "messages": USER, "max_tokens": 10,
                                                     "temperature": 0, "chat_template_kwargs": NO_THINK})
    assert status == 200 and body["object"] == "chat.completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": want}
    assert choice["finish_reason"] == ("length" if stats.finish_reason == "length" else "stop")
    assert body["usage"] == {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
                             "total_tokens": stats.prompt_tokens + stats.generated_tokens,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_stream_carries_the_same_text_and_usage(srv, model):
    want, stats = greedy_oracle(model, 10, messages=USER, enable_thinking=False)
    status, headers, data = srv.request("POST", "/v1/chat/completions", {
        "messages": USER, "max_tokens": 10, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "chat_template_kwargs": NO_THINK})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_data(data)
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == ("length" if stats.finish_reason == "length" else "stop")
    assert events[-2]["usage"]["completion_tokens"] == stats.generated_tokens and events[-2]["choices"] == []
    assert len({e["id"] for e in events[:-1]}) == 1


def test_thinking_by_default_comes_back_as_reasoning(srv, model):
    want, _ = greedy_oracle(model, 8, messages=USER)  # the template's default: the reply starts inside <think>
    status, body = srv.json("/v1/chat/completions", {"messages": USER, "max_tokens": 8, "temperature": 0})
    message = body["choices"][0]["message"]
    assert status == 200 and "think>" not in want  # random weights: the reasoning never closes
    assert message["reasoning_content"] == want and message["content"] == ""


def test_completions_from_text_and_from_token_ids(srv, model):
    prompt = "The assistant reads the question"
    want, stats = greedy_oracle(model, 16, prompt=prompt)
    status, body = srv.json("/v1/completions", {"prompt": prompt, "temperature": 0})  # max_tokens: 16 by default
    assert status == 200 and body["choices"][0]["text"] == want
    assert body["usage"]["completion_tokens"] == stats.generated_tokens <= 16
    ids = model.tokenizer.encode(prompt)
    status, by_ids = srv.json("/v1/completions", {"prompt": ids, "temperature": 0, "max_tokens": 16})
    assert status == 200 and by_ids["choices"][0]["text"] == want
    status, _, data = srv.request("POST", "/v1/completions", {"prompt": [prompt], "temperature": 0, "stream": True})
    events = sse_data(data)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want and events[-1] == "[DONE]"
    # this prompt's greedy reply holds special tokens: left out by default, kept where the request asks (vLLM's field)
    tok = model.tokenizer
    assert any(tok.decode([i]) and not tok.decode([i], skip_special_tokens=True) for i in stats.token_ids)
    assert want == tok.decode(stats.token_ids, skip_special_tokens=True)
    kept, _ = greedy_oracle(model, 16, skip_special_tokens=False, prompt=prompt)
    assert kept == tok.decode(stats.token_ids) != want
    status, body = srv.json("/v1/completions", {"prompt": prompt, "temperature": 0, "skip_special_tokens": False})
    assert status == 200 and body["choices"][0]["text"] == kept
    status, body = srv.json("/v1/completions", {"prompt": prompt, "skip_special_tokens": "no"})
    assert status == 400 and "skip_special_tokens" in body["error"]["message"]


def test_a_request_that_extends_the_last_one_reuses_its_cache(srv, model):
    """The next turn of a conversation (the last prompt, its reply, then more) prefills only what is new."""
    from ninfer_rt.sampling import SamplingParams

    first = model.tokenizer.encode("The assistant reads the question")
    out = list(model.generate_ids(first, max_new_tokens=4, sampling=SamplingParams(greedy=True)))
    assert len(out) == 4  # the oracle's reply; the server's greedy reply is the same tokens
    turn = first + out + model.tokenizer.encode(" and then")
    want, _ = greedy_oracle(model, 6, prompt=turn)  # (a run without reuse: it resets the cache the server keeps)
    body = srv.json("/v1/completions", {"prompt": first, "max_tokens": 4, "temperature": 0})[1]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    body = srv.json("/v1/completions", {"prompt": turn, "max_tokens": 6, "temperature": 0})[1]
    # the 4th reply token was sampled, not fed: everything before it came from the cache
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(first) + 3
    assert body["choices"][0]["text"] == want


def test_a_chats_next_turn_starts_from_its_history(srv, model):
    """Turn 2 re-renders turn 1's reply (without its reasoning), so it shares turn 1's prompt only up to the end of
    the history: the snapshot kept there serves it, and the reply equals a fresh run's."""
    turn1 = [{"role": "user", "content": "Tell me about the garden."}]
    history = model.tokenizer.encode(model.chat_template.render(turn1))
    body = srv.json("/v1/chat/completions", {"messages": turn1, "max_tokens": 5, "temperature": 0})[1]
    reply = body["choices"][0]["message"]
    turn2 = turn1 + [{"role": "assistant", "content": reply["content"], "reasoning_content":
                      reply["reasoning_content"]}, {"role": "user", "content": "And the house?"}]
    want, _ = greedy_oracle(model, 5, messages=turn2)  # (drops what the server kept: ask turn 1 again)
    srv.json("/v1/chat/completions", {"messages": turn1, "max_tokens": 5, "temperature": 0})
    body = srv.json("/v1/chat/completions", {"messages": turn2, "max_tokens": 5, "temperature": 0})[1]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history)
    assert body["choices"][0]["message"]["reasoning_content"] == want


def test_stop_strings_end_the_reply(srv, model):
    full, _ = greedy_oracle(model, 16, messages=USER, enable_thinking=False)
    stop = full[5:8]
    assert len(full) > 8 and full.find(stop) >= 0
    status, body = srv.json("/v1/chat/completions", {"messages": USER, "max_tokens": 16, "temperature": 0,
                                                     "stop": ["\x00never", stop], "chat_template_kwargs": NO_THINK})
    assert body["choices"][0]["message"]["content"] == full[:full.find(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"
    status, body = srv.json("/v1/messages", {"messages": USER, "max_tokens": 16, "temperature": 0,
                                             "stop_sequences": [stop], "thinking": {"type": "disabled"}})
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == stop
    assert body["content"] == [{"type": "text", "text": full[:full.find(stop)]}]


def test_models_and_health(srv, model):
    assert srv.json("/health", method="GET") == (200, {"status": "ok"})
    status, body = srv.json("/v1/models", method="GET")
    assert status == 200 and body["data"][0]["id"] == "tiny"
    assert body["data"][0]["max_model_len"] == model.context_length
    assert srv.json("/v1/models/tiny", method="GET")[1]["id"] == "tiny"
    assert srv.json("/v1/models/other", method="GET")[0] == 404


# ----------------------------------------------------------------------------------------------- Anthropic


def test_messages_equal_greedy_generation(srv, model):
    system = "Answer briefly."
    chat = [{"role": "system", "content": system}, *USER]
    want, stats = greedy_oracle(model, 9, messages=chat, enable_thinking=False)
    status, body = srv.json("/v1/messages", {"model": "x", "system": system, "messages": USER, "max_tokens": 9,
                                             "temperature": 0, "thinking": {"type": "disabled"}})
    assert status == 200 and body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == ([{"type": "text", "text": want}] if want else [])
    assert body["stop_reason"] == ("max_tokens" if stats.finish_reason == "length" else "end_turn")
    assert body["usage"] == {"input_tokens": stats.prompt_tokens, "output_tokens": stats.generated_tokens,
                             "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}


def test_messages_stream_follows_the_event_grammar(srv, model):
    want, stats = greedy_oracle(model, 9, messages=USER)
    status, _, data = srv.request("POST", "/v1/messages", {"messages": USER, "max_tokens": 9, "temperature": 0,
                                                           "stream": True, "thinking": {"type": "enabled"}})
    events = sse_events(data)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert all(n == "content_block_delta" for n in names[2:-3])
    assert events[1][1]["content_block"]["type"] == "thinking"
    assert "think>" not in want and "".join(d["delta"]["thinking"] for n, d in events[2:-3]) == want
    assert events[-2][1]["usage"] == {"input_tokens": stats.prompt_tokens, "cache_read_input_tokens": 0,
                                      "cache_creation_input_tokens": 0, "output_tokens": stats.generated_tokens}
    assert events[0][1]["message"]["usage"]["input_tokens"] == stats.prompt_tokens


def test_messages_stream_start_counts_the_cached_input(srv, model):
    """message_start's usage splits the input as the final message_delta does: a chat's next turn reads its history
    from the snapshot the first turn kept (cache_read_input_tokens), and input_tokens is the rest."""
    turn1 = [{"role": "user", "content": "Tell me about the garden."}]
    history = model.tokenizer.encode(model.chat_template.render(turn1, enable_thinking=False))
    ask = {"max_tokens": 5, "temperature": 0, "thinking": {"type": "disabled"}}
    body = srv.json("/v1/messages", {"messages": turn1, **ask})[1]
    turn2 = turn1 + [{"role": "assistant", "content": body["content"]}, {"role": "user", "content": "And the house?"}]
    events = sse_events(srv.request("POST", "/v1/messages", {"messages": turn2, "stream": True, **ask})[2])
    start, final = events[0][1]["message"]["usage"], events[-2][1]["usage"]
    assert events[0][0] == "message_start" and final["cache_read_input_tokens"] == len(history)
    assert start == {**final, "output_tokens": 0} and final["output_tokens"] > 0
    whole = srv.json("/v1/messages/count_tokens", {"messages": turn2, "thinking": {"type": "disabled"}})[1]
    assert start["input_tokens"] + start["cache_read_input_tokens"] == whole["input_tokens"]


def test_count_tokens_equals_the_rendered_prompt(srv, model):
    """Anthropic blocks (tool_use, tool_result, thinking) render as the equivalent OpenAI-form chat does."""
    anthropic = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris", "days": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]},
    ]
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
             "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
            {"role": "tool", "content": "Sunny"}]
    want = len(model.prompt_ids(messages=chat, tools=[WEATHER], enable_thinking=False))  # no thinking field: off
    # the text itself, not only its length: the tool's keys in OpenAI's order
    job = anthropic_api.parse_messages({"system": "Be brief.", "messages": anthropic, "tools": tools}, count_only=True)
    assert prompt_text(model, job) == model.chat_template.render(chat, tools=[WEATHER], add_generation_prompt=True,
                                                                 enable_thinking=False)
    status, body = srv.json("/v1/messages/count_tokens", {"system": "Be brief.", "messages": anthropic,
                                                          "tools": tools})
    assert status == 200 and body == {"input_tokens": want}
    # the OpenAI form of the same conversation (arguments as a JSON string) gives the same prompt
    openai_chat = [dict(m) for m in chat]
    openai_chat[2]["tool_calls"] = [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]
    status, body = srv.json("/v1/chat/completions", {"messages": openai_chat, "tools": [WEATHER], "max_tokens": 1,
                                                     "temperature": 0, "chat_template_kwargs": NO_THINK})
    assert status == 200 and body["usage"]["prompt_tokens"] == want


def test_tokenize_and_detokenize(srv, model):
    """vLLM's /tokenize: a prompt's ids are the tokenizer's, a chat's are the rendered prompt's (what the chat
    endpoint counts); /detokenize gives the text back. Bad bodies are a 400 naming the field."""
    status, body = srv.json("/tokenize", {"prompt": "Hello there, tiny model"})
    ids = model.tokenizer.encode("Hello there, tiny model")
    assert status == 200 and body == {"count": len(ids), "max_model_len": model.context_length, "tokens": ids}
    status, body = srv.json("/tokenize", {"messages": USER, "tools": [WEATHER],
                                          "chat_template_kwargs": NO_THINK})
    want = model.prompt_ids(messages=USER, tools=[WEATHER], enable_thinking=False)
    assert status == 200 and body["tokens"] == want and body["count"] == len(want)
    status, body = srv.json("/detokenize", {"tokens": ids})
    assert status == 200 and body == {"prompt": "Hello there, tiny model"}
    for path, bad_body, param in (("/tokenize", {"prompt": ""}, "prompt"), ("/detokenize", {"tokens": "12"}, "tokens"),
                                  ("/detokenize", {"tokens": [model.spec.vocab_size]}, "tokens")):
        status, body = srv.json(path, bad_body)
        assert status == 400 and body["error"]["param"] == param, body


def test_tokenizer_info_is_what_transformers_reads(srv, model, tiny_moe):
    """vLLM's GET /tokenizer_info (lm-evaluation-harness takes the server's tokenizer from it, /tokenize and
    /detokenize, with no download): the special tokens and chat template transformers reads from the source
    checkpoint, the context; the eos text tokenizes to transformers' eos id, which ends a generation here."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_moe)
    status, info = srv.json("/tokenizer_info", method="GET")
    assert status == 200
    assert [info[f"{k}_token"] for k in ("bos", "eos", "pad", "unk")] == [hf.bos_token, hf.eos_token, hf.pad_token,
                                                                           hf.unk_token]
    assert info["chat_template"] == hf.chat_template and info["model_max_length"] == model.context_length
    status, body = srv.json("/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert status == 200 and body["tokens"] == [hf.eos_token_id] and hf.eos_token_id in model.tokenizer.eos_ids


def test_metrics_count_what_the_replies_reported(model):
    """GET /metrics (Prometheus text): the finished generations and their prompt / cached / generated tokens are
    the sums of what the replies' usage said; nothing runs or waits once they are answered."""
    from serve_client import Running

    def metrics(r) -> dict[str, float]:
        status, headers, data = r.request("GET", "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
        lines = data.decode().splitlines()
        assert all(ln.startswith(("# HELP ", "# TYPE ")) for ln in lines if ln.startswith("#"))
        return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in lines if not ln.startswith("#"))}

    with Running(model) as r:
        before = metrics(r)
        assert before['ninfer_requests_total{outcome="done"}'] == 0 and before["ninfer_generation_tokens_total"] == 0
        usages = []
        for path, body in (("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "temperature": 0}),
                           ("/v1/completions", {"prompt": "Once upon", "max_tokens": 5, "temperature": 0}),
                           ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "temperature": 0})):
            status, reply = r.json(path, body)
            assert status == 200, reply
            usages.append(reply["usage"])
        got = metrics(r)
    assert got['ninfer_requests_total{outcome="done"}'] == 3
    assert got['ninfer_requests_total{outcome="error"}'] == got['ninfer_requests_total{outcome="cancelled"}'] == 0
    assert got["ninfer_prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert got["ninfer_prompt_tokens_cached_total"] == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert got["ninfer_generation_tokens_total"] == sum(u["completion_tokens"] for u in usages)
    assert got["ninfer_requests_running"] == got["ninfer_requests_waiting"] == 0
    assert got["ninfer_draft_tokens_total"] == got["ninfer_draft_tokens_accepted_total"] == 0  # no speculation


@pytest.mark.parametrize("given", [{"reasoning_content": "RC", "reasoning": "R"}, {"thinking": "RC"},
                                   {"reasoning": "RC", "thinking": None}])
def test_a_turns_reasoning_under_any_of_its_names_renders_as_transformers_reads_it(model, given):
    """An assistant turn's reasoning as reasoning_content, thinking or reasoning (first given wins, as
    transformers' aliases read them) reaches the template as reasoning_content: the text kept with
    preserve_thinking is the template's own rendering of that reasoning."""
    from ninfer_rt.serve import openai as openai_api

    turns = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "A1", **given},
             {"role": "user", "content": "second"}]
    job = openai_api.parse_chat({"messages": turns, "chat_template_kwargs": {"preserve_thinking": True}})
    want = model.chat_template.render([*turns[:1], {"role": "assistant", "content": "A1", "reasoning_content": "RC"},
                                       *turns[2:]], add_generation_prompt=True, preserve_thinking=True)
    assert "RC" in want and prompt_text(model, job) == want
