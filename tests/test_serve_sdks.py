"""ninfer-rt serve through the official OpenAI and Anthropic Python SDKs: the clients people point at it parse
every reply, stream and error into their own typed objects (the oracle for wire compatibility), and what they
read equals what the model wrote (a scripted reply: reasoning, text, a tool call).
"""

from __future__ import annotations

import json

import pytest

from serve_client import Running, Scripted

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>")
REPLY = "Weather needs the tool.\n</think>\n\nChecking.\n\n" + CALL
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def model(packed_model):
    return packed_model


@pytest.fixture(scope="module")
def scripted(model):
    with Running(Scripted(model, REPLY), api_key="k") as r:
        yield r


def base(r: Running, path: str = "") -> str:
    host, port = r.server.address
    return f"http://{host}:{port}{path}"


def test_openai_sdk_chat_tools_and_stream(scripted):
    client = openai.OpenAI(base_url=base(scripted, "/v1"), api_key="k", max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
    done = client.chat.completions.create(model="tiny", messages=USER, tools=tools)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert getattr(choice.message, "reasoning_content", None) == "Weather needs the tool."  # an extra field
    assert done.usage.completion_tokens == scripted.server.model.last_stats.generated_tokens
    # the SDK's stream helper accumulates the chunks into the same message
    with client.chat.completions.stream(model="tiny", messages=USER, tools=tools,
                                        stream_options={"include_usage": True}) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Checking." and final.choices[0].finish_reason == "tool_calls"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.BadRequestError, match=r"'n' must be an integer in \[1, 16\]"):
        client.chat.completions.create(model="tiny", messages=USER, n=17)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base(scripted, "/v1"), api_key="wrong", max_retries=0).models.list()


def test_anthropic_sdk_messages_tools_stream_and_count(scripted, model):
    client = anthropic.Anthropic(base_url=base(scripted), api_key="k", max_retries=0, timeout=60)
    tools = [{"name": "get_weather", "description": "Weather for a city", "input_schema": PARAMS}]
    msg = client.messages.create(model="tiny", max_tokens=500, messages=USER, tools=tools,
                                 thinking={"type": "enabled", "budget_tokens": 1024})
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "Weather needs the tool." and msg.content[1].text == "Checking."
    assert msg.content[2].name == "get_weather" and msg.content[2].input == {"city": "Paris", "days": 3}
    with client.messages.stream(model="tiny", max_tokens=500, messages=USER, tools=tools,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Paris", "days": 3} and final.stop_reason == "tool_use"
    count = client.messages.count_tokens(model="tiny", messages=USER, tools=tools)
    openai_tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                      "parameters": PARAMS}}]
    assert count.input_tokens == len(model.prompt_ids(messages=USER, tools=openai_tools, enable_thinking=False))
    with pytest.raises(anthropic.BadRequestError, match="thinking.type must be"):
        client.messages.create(model="tiny", max_tokens=5, messages=USER, thinking={"type": "sometimes"})


def test_openai_sdk_reads_logprobs(srv):
    """The SDK's typed logprobs (chat: content entries with top alternatives; completions: the legacy lists)."""
    client = openai.OpenAI(base_url=base(srv, "/v1"), api_key="unused", max_retries=0, timeout=60)
    chat = client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens - (chat.choices[0].finish_reason == "stop")
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 and e.top_logprobs[0].logprob >= e.logprob
               for e in content)
    done = client.completions.create(model="tiny", prompt="The assistant", max_tokens=3, temperature=0, logprobs=1)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs) > 0
