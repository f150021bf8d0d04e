"""ninfer-rt serve: tool_choice that forces a call (OpenAI "required" or a named function, Anthropic "any" or
"tool"). The prompt ends inside the call (its reasoning closed empty, as the template writes thinking off), and
the model's continuation completes it.

Oracles: the chat template's own prompt with thinking off, followed by the call's opening (the scripted model
records the prompt ids it was given), and the tool call the reply parser makes of the opening plus the scripted
continuation.
"""

from __future__ import annotations

import json

import pytest

from serve_client import Running, Scripted

USER = [{"role": "user", "content": "Weather in Paris?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ARGS = "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def model(packed_model):
    return packed_model


def no_think_prompt(model, tools) -> str:
    return model.chat_template.render(USER, tools=tools, add_generation_prompt=True, enable_thinking=False)


@pytest.mark.parametrize("choice, opening, continuation", [
    ({"type": "function", "function": {"name": "get_weather"}}, "<tool_call>\n<function=get_weather>\n", ARGS),
    ("required", "<tool_call>\n<function=", "get_weather>\n" + ARGS),
])
def test_openai_forced_call(model, choice, opening, continuation):
    """Thinking on by default: the forced prompt is the no-thinking one plus the opening, and the reply is the call."""
    tools = [WEATHER, TIME]
    with Running(Scripted(model, continuation)) as r:
        status, body = r.json("/v1/chat/completions", {"messages": USER, "tools": tools, "tool_choice": choice})
        prompt = model.tokenizer.decode(r.server.model.prompts[-1])
    assert status == 200 and prompt == no_think_prompt(model, tools) + opening
    choice0 = body["choices"][0]
    (call,) = choice0["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert choice0["finish_reason"] == "tool_calls" and choice0["message"]["content"] is None


def test_anthropic_forced_call(model):
    tools = [{"name": "get_weather", "input_schema": PARAMS}, {"name": "get_time", "input_schema": {}}]
    with Running(Scripted(model, ARGS)) as r:
        status, body = r.json("/v1/messages", {"messages": USER, "tools": tools, "max_tokens": 100,
                                               "tool_choice": {"type": "tool", "name": "get_weather"}})
        prompt = model.tokenizer.decode(r.server.model.prompts[-1])
    assert status == 200 and body["stop_reason"] == "tool_use"
    (block,) = body["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {"city": "Paris",
                                                                                                 "days": 3}
    assert prompt.endswith("</think>\n\n<tool_call>\n<function=get_weather>\n")


def test_a_forced_call_that_does_not_parse_comes_back_as_text(model):
    """Nothing is lost: a continuation that never closes the call returns as text, the opening included."""
    with Running(Scripted(model, "oops")) as r:
        body = r.json("/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "tool_choice": "required"})[1]
    message = body["choices"][0]["message"]
    assert message["content"] == "<tool_call>\n<function=oops" and "tool_calls" not in message


@pytest.mark.parametrize("path, body, message", [
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice forces a tool call: give tools"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice names 'x', which is not among the tools (get_weather)"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice must be"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required", "continue_final_message": True,
                              "add_generation_prompt": False,
                              "messages": USER + [{"role": "assistant", "content": "Sure"}]},
     "a forced tool call starts the reply"),
    ("/v1/messages", {"tool_choice": {"type": "any"}, "max_tokens": 5}, "tool_choice forces a tool call: give tools"),
    ("/v1/messages", {"tools": [{"name": "get_weather"}], "tool_choice": {"type": "tool"}, "max_tokens": 5},
     "tool_choice of type tool needs the tool's name"),
])
def test_forced_calls_that_cannot_be_made_are_refused(srv, path, body, message):
    status, reply = srv.json(path, {"messages": USER, **body})
    text = reply["error"]["message"]
    assert status == 400 and text.startswith(message), text
