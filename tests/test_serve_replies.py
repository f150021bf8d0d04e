"""ninfer_rt.serve.replies: splitting a generated reply into reasoning, text and tool calls.

Oracles: the real chat template (what it renders for an assistant turn must parse back to that turn exactly),
parse_reply on the whole text (any split into streamed pieces must give the same events), and the rules of the
format written out case by case.
"""

from __future__ import annotations

import json
import random

import pytest

from ninfer_pack.tiny_tokenizer import CHAT_TEMPLATE
from ninfer_rt.chat import ChatTemplate
from ninfer_rt.serve.replies import Event, ReplyParser, ToolCall, parse_reply, tool_schemas

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                        "units": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "run", "description": "Run code",
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string"}, "timeout": {"type": "number"}, "verbose": {"type": "boolean"},
            "env": {"type": "object"}, "args": {"type": "array"}, "cwd": {"type": ["string", "null"]},
            "limit": {"type": ["string", "integer"]}, "nothing": {"type": "null"}, "count": {"type": "integer"},
            "free": {}}}}},
    {"name": "note"},  # bare form, no parameters
    {"name": "search", "input_schema": {"type": "object", "properties": {"query": {"type": "string"},
                                                                         "top_k": {"type": "integer"}}}},
]


def call_text(name: str, **params: str) -> str:
    """A block as the template writes it, the values given as raw text."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def merged(events: list[Event]) -> list[Event]:
    """Adjacent reasoning/text events joined, as parse_reply returns them."""
    out: list[Event] = []
    for e in events:
        if out and e.kind != "tool_call" and out[-1].kind == e.kind:
            out[-1] = Event(e.kind, out[-1].text + e.text)
        else:
            out.append(e)
    return out


def streamed(pieces: list[str], thinking: bool, tools) -> list[Event]:
    parser = ReplyParser(thinking=thinking, tools=tools)
    events = [e for piece in pieces for e in parser.push(piece)] + parser.finish()
    assert all(e.kind == "tool_call" or e.text for e in events), "empty text events"
    return merged(events)


def typed(value):
    """JSON text, so that 1, 1.0 and True differ (== alone would not tell them apart)."""
    return json.dumps(value)


# --- round trip through the real template -------------------------------------------------------------------

ROUND_TRIPS = [
    dict(reasoning_content="The user wants weather.\nCall get_weather.", content="Let me check.",
         tool_calls=[{"function": {"name": "get_weather", "arguments": {"city": "São Paulo", "days": 3}}}]),
    dict(reasoning_content="Two calls.", content=None,
         tool_calls=[{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": -2}}},
                     {"function": {"name": "search", "arguments": {"query": "a < b && c > d", "top_k": 10}}}]),
    dict(reasoning_content="", content="",
         tool_calls=[{"function": {"name": "run", "arguments": {
             "code": "def f(x):\n    return x < 3\n\nprint(f(2))", "timeout": 2.5, "verbose": False,
             "env": {"A": "1", "nested": {"k": [1, 2.0, None, True, "s"]}}, "args": ["-v", 3, {"x": None}],
             "cwd": None, "limit": 7, "nothing": None}}}]),
    dict(reasoning_content="Strings that look like JSON stay strings.", content="Multi\nline\n\ncontent.",
         tool_calls=[{"function": {"name": "run", "arguments": {
             "code": '{"a": 1}', "cwd": "nil", "limit": "seven", "timeout": 1e-3, "verbose": True,
             "free": "42", "args": []}}},
                     {"type": "function", "function": {"name": "note", "arguments": {}}},
                     {"function": {"name": "get_weather", "arguments": {"city": "\nindented\n", "units": "°C"}}}]),
    dict(reasoning_content="No call this time.", content="Just an answer, mentioning <tool_call> in prose."),
    dict(reasoning_content="Line one\n\nline two", content="Answer with inner spaces   and a tab\tbefore the end.",
         tool_calls=[{"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 0}}}]),
]


def generated_turn(message: dict) -> str:
    """The assistant turn of [user, message] as the model generates it: after '<think>\\n', up to <|im_end|>."""
    rendered = ChatTemplate(CHAT_TEMPLATE).render([{"role": "user", "content": "hi"}, message], tools=TOOLS)
    turn = rendered.split("<|im_start|>assistant\n")[-1]
    assert turn.startswith("<think>\n") and turn.endswith("<|im_end|>\n")
    return turn[len("<think>\n"):-len("<|im_end|>\n")]


@pytest.mark.parametrize("fields", ROUND_TRIPS)
def test_round_trip_through_the_template(fields):
    message = {"role": "assistant", **fields}
    text = generated_turn(message)
    expected = []
    if fields["reasoning_content"]:
        expected.append(Event("reasoning", fields["reasoning_content"]))
    if fields["content"]:
        expected.append(Event("text", fields["content"]))
    for call in fields.get("tool_calls", []):
        expected.append(Event("tool_call", call=ToolCall(call["function"]["name"], call["function"]["arguments"])))
    events = parse_reply(text, thinking=True, tools=TOOLS)
    assert events == expected
    assert [typed(e.call.arguments) for e in events if e.call] == [typed(e.call.arguments) for e in expected
                                                                   if e.call]
    assert streamed(list(text), True, TOOLS) == events


def test_round_trip_keeps_python_types():
    fields = ROUND_TRIPS[2]
    [event] = parse_reply(generated_turn({"role": "assistant", **fields}), thinking=True, tools=TOOLS)
    args = event.call.arguments
    assert type(args["timeout"]) is float and type(args["verbose"]) is bool and type(args["limit"]) is int
    assert args["cwd"] is None and args["nothing"] is None and "\n" in args["code"]
    assert type(args["env"]["nested"]["k"][1]) is float and args["args"][2] == {"x": None}


# --- streaming equivalence ------------------------------------------------------------------------------------

WEATHER = call_text("get_weather", city="Paris", days="3")
CORPUS = [
    (True, TOOLS, "Plan.\n</think>\n\nChecking.\n\n" + WEATHER + "\n" + call_text("note") + "\n\n"),
    (True, TOOLS, "<think>\n\nreopened\n\n</think>\n\n" + WEATHER + " trailing words\n"),
    (True, TOOLS, "reasoning mentions " + WEATHER + " inside\n</think>\nanswer"),
    (True, TOOLS, "cut off reasoning with a partial tag </thi"),
    (True, TOOLS, "<thi"),
    (True, None, "r\n</think>\n\ntext " + WEATHER + " stays text"),
    (False, TOOLS, "Sure.\n\n" + call_text("unknown_fn", x="1") + "\n\n" + WEATHER),
    (False, TOOLS, "Dup:\n" + call_text("get_weather", city="a", days="1").replace("<parameter=days>",
                                                                                  "<parameter=city>")),
    (False, TOOLS, "Open block\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
    (False, TOOLS, "a < b, a <tool b, <tool_cal <tool_call <<tool_call>>\n" + WEATHER + "</tool_call> \n x"),
    (False, TOOLS, "</think> stray <think> tags in text\n\n" + WEATHER + "  \n\t"),
    (False, TOOLS, WEATHER + WEATHER + "\n \n" + call_text("search", query="q", top_k="abc")),
    (False, TOOLS, "<tool_call>\n<function=note>\njunk</function>\n</tool_call>\n<tool_call></tool_call><"),
    (False, [], "no tools " + WEATHER + "\n\n"),
    (True, TOOLS, "\n\nleading newlines kept\n\n\n</think>\n\n\n\n\n"),
]


@pytest.mark.parametrize("thinking,tools,text", CORPUS)
def test_every_split_gives_the_same_events(thinking, tools, text):
    """Streaming is split-invariant: any cut of the text gives the one-piece parse (the events themselves are
    checked against hand-written ones by the round trips above and the rules below)."""
    whole = parse_reply(text, thinking=thinking, tools=tools)
    assert streamed(list(text), thinking, tools) == whole
    for cut in range(len(text) + 1):  # one cut anywhere, inside tags included
        assert streamed([text[:cut], text[cut:]], thinking, tools) == whole, cut
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed(pieces, thinking, tools) == whole, pieces


def test_random_fragment_soup_streams_like_the_whole():
    fragments = ["<think>", "</think>", "\n", "\n\n", " ", "<tool_call>", "</tool_call>", "<function=get_weather>",
                 "<function=nope>", "<parameter=city>", "<parameter=days>", "</parameter>", "</function>", "Paris",
                 "3", "<", "<tool", "</thi", "x", WEATHER]
    rng = random.Random(1234)
    for _ in range(300):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 14)))
        thinking, tools = rng.random() < 0.5, rng.choice([TOOLS, None])
        whole = parse_reply(text, thinking=thinking, tools=tools)
        assert streamed(list(text), thinking, tools) == whole, text
        cut = rng.randint(0, len(text))
        assert streamed([text[:cut], text[cut:]], thinking, tools) == whole, text


# --- the rules --------------------------------------------------------------------------------------------------

def test_tool_schemas_reads_every_form():
    schemas = tool_schemas(TOOLS)
    assert list(schemas) == ["get_weather", "run", "note", "search"]
    assert schemas["note"] == {} and schemas["search"]["properties"]["top_k"] == {"type": "integer"}
    assert schemas["get_weather"] is TOOLS[0]["function"]["parameters"]
    assert tool_schemas(None) == {} and tool_schemas([]) == {}


@pytest.mark.parametrize("tools", [None, []])
def test_without_tools_a_call_is_text(tools):
    text = "Here:\n\n" + WEATHER + "\n"
    assert parse_reply(text, thinking=False, tools=tools) == [Event("text", text)]


def test_a_call_parses_with_its_types():
    events = parse_reply(WEATHER, thinking=False, tools=TOOLS)
    assert events == [Event("tool_call", call=ToolCall("get_weather", {"city": "Paris", "days": 3}))]
    assert typed(events[0].call.arguments) == '{"city": "Paris", "days": 3}'


@pytest.mark.parametrize("block", [
    call_text("unknown_fn", city="Paris"),  # not an offered tool
    call_text("get_weather", city="a").replace("</parameter>\n", "</parameter>\n<parameter=city>\nb\n</parameter>"),
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",  # no </parameter>
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # no </function>
    "<tool_call>\nhello <function=get_weather>\n</function>\n</tool_call>",  # text before the function
    "<tool_call>\n<function=get_weather>\nhi\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n</function>\nafter\n</tool_call>",  # text after the function
    "<tool_call>\n<function=get_weather>\n</function>\n<function=note>\n</function>\n</tool_call>",
    "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # no function
    "<tool_call></tool_call>",
])
def test_a_broken_block_is_text_with_the_whitespace_before_it(block):
    text = "Answer.\n\n" + block + "\n\nMore."
    assert parse_reply(text, thinking=False, tools=TOOLS) == [Event("text", text)]


def test_an_unclosed_block_at_the_end_is_text():
    text = "Calling:\n\n" + WEATHER[:-len("</tool_call>")] + "</tool_ca"
    parser = ReplyParser(thinking=False, tools=TOOLS)
    assert merged(parser.push(text)) == [Event("text", "Calling:")]
    assert parser.finish() == [Event("text", text[len("Calling:"):])]


def test_whitespace_around_calls():
    note = call_text("note")
    call = Event("tool_call", call=ToolCall("note", {}))
    assert parse_reply("Text.\n\n" + note + "\n \n" + note + "\n\n", thinking=False, tools=TOOLS) == [
        Event("text", "Text."), call, call]
    assert parse_reply(note + "\n\nAfter.\n", thinking=False, tools=TOOLS) == [call, Event("text", "\n\nAfter.\n")]
    assert parse_reply("Text.  \n", thinking=False, tools=TOOLS) == [Event("text", "Text.  \n")]  # no call: kept
    assert parse_reply("Text.  \t" + note, thinking=False, tools=TOOLS) == [Event("text", "Text."), call]
    assert parse_reply("  \t<tool_call>\n<function=note>\n  </function>  </tool_call>", thinking=False,
                       tools=TOOLS) == [call]


@pytest.mark.parametrize("prop,raw,value", [
    ("count", "abc", "abc"), ("count", "3.5", "3.5"), ("count", "true", "true"), ("count", "1e3", "1e3"),
    ("count", "-12", -12), ("count", "12345678901234567890", 12345678901234567890), ("count", " 4 ", 4),
    ("timeout", "1e3", 1000.0), ("timeout", "5", 5), ("timeout", "false", "false"), ("timeout", "NaN", "NaN"),
    ("timeout", "Infinity", "Infinity"), ("timeout", "-Infinity", "-Infinity"), ("timeout", "1e999", "1e999"),
    ("verbose", "true", True), ("verbose", "True", "True"), ("verbose", "1", "1"),
    ("nothing", "null", None), ("nothing", "None", "None"),
    ("env", '{"a": [1, 2]}', {"a": [1, 2]}), ("env", "[1]", "[1]"), ("env", '{"a": NaN}', '{"a": NaN}'),
    ("env", '{"a": 1e999}', '{"a": 1e999}'), ("args", "[1, \"x\"]", [1, "x"]), ("args", "[1,", "[1,"),
    ("cwd", "null", None), ("cwd", "/tmp", "/tmp"), ("limit", "7", 7), ("limit", "7.5", "7.5"),
    ("free", "42", "42"), ("undeclared", "42", "42"), ("code", "42", "42"), ("code", "", ""),
    ("code", "\nx\n", "\nx\n"),
])
def test_values_follow_the_schema_type(prop, raw, value):
    [event] = parse_reply(call_text("run", **{prop: raw}), thinking=False, tools=TOOLS)
    assert typed(event.call.arguments) == typed({prop: value})


def test_exactly_one_newline_is_stripped_from_each_side_of_a_value():
    block = "<tool_call><function=run><parameter=code>\n\n x \n\n</parameter><parameter=count>7</parameter>" \
            "</function></tool_call>"
    [event] = parse_reply(block, thinking=False, tools=TOOLS)
    assert typed(event.call.arguments) == typed({"code": "\n x \n", "count": 7})


def test_tool_without_parameters_keeps_strings():
    [event] = parse_reply(call_text("note", n="5", flag="true"), thinking=False, tools=TOOLS)
    assert event.call == ToolCall("note", {"n": "5", "flag": "true"})


def test_list_of_types_tries_non_string_kinds_first():
    tools = [{"name": "f", "parameters": {"properties": {"a": {"type": ["string", "integer", "boolean"]},
                                                         "b": {"type": ["number", "bogus"]}}}}]
    [event] = parse_reply(call_text("f", a="7", b="x"), thinking=False, tools=tools)
    assert typed(event.call.arguments) == '{"a": 7, "b": "x"}'
    [event] = parse_reply(call_text("f", a="false", b="2.5"), thinking=False, tools=tools)
    assert typed(event.call.arguments) == '{"a": false, "b": 2.5}'
    [event] = parse_reply(call_text("f", a="7x", b="null"), thinking=False, tools=tools)
    assert typed(event.call.arguments) == '{"a": "7x", "b": "null"}'


def test_reasoning_split_and_newlines():
    assert parse_reply("a \n\n</think>\n\n\nb\n", thinking=True) == [Event("reasoning", "a "), Event("text", "b\n")]
    assert parse_reply("a</think> b", thinking=True) == [Event("reasoning", "a"), Event("text", " b")]
    assert parse_reply("a\n</think>\nb</think>c", thinking=True) == [Event("reasoning", "a"),
                                                                   Event("text", "b</think>c")]
    assert parse_reply("\n</think>\n", thinking=True) == []


def test_reasoning_without_end_is_all_reasoning():
    text = "still thinking\n" + WEATHER + "\n"
    assert parse_reply(text, thinking=True, tools=TOOLS) == [Event("reasoning", text)]


def test_leading_think_tag_is_dropped():
    assert parse_reply("<think>\n\nhmm\n</think>\n\nhi", thinking=True) == [Event("reasoning", "hmm"),
                                                                             Event("text", "hi")]
    assert parse_reply("<think>\n", thinking=True) == []
    assert parse_reply("x<think>y</think>z", thinking=True) == [Event("reasoning", "x<think>y"), Event("text", "z")]
    assert parse_reply(" <think>y", thinking=True) == [Event("reasoning", " <think>y")]


def test_without_thinking_tags_are_text():
    text = "<think>\nnot reasoning\n</think>\n\nanswer"
    assert parse_reply(text, thinking=False, tools=TOOLS) == [Event("text", text)]


# --- promptness ------------------------------------------------------------------------------------------------

def test_text_that_cannot_start_a_tag_comes_out_at_once():
    parser = ReplyParser(thinking=False, tools=TOOLS)
    assert parser.push("Hello wor") == [Event("text", "Hello wor")]
    assert parser.push("ld <") == [Event("text", "ld")]  # " <" may yet be dropped before a call
    assert parser.push("b>") == [Event("text", " <b>")]
    assert parser.push("\n\n") == []
    assert parser.finish() == [Event("text", "\n\n")]


def test_a_possible_call_is_held_until_its_block_closes():
    parser = ReplyParser(thinking=False, tools=TOOLS)
    assert parser.push("abc <tool") == [Event("text", "abc")]
    assert parser.push(WEATHER[len("<tool"):-1]) == []
    assert parser.push(WEATHER[-1]) == [Event("tool_call", call=ToolCall("get_weather", {"city": "Paris",
                                                                                           "days": 3}))]
    assert parser.push("\n") == []
    assert parser.finish() == []


def test_without_tools_nothing_is_held():
    parser = ReplyParser(thinking=False, tools=None)
    assert parser.push("abc <tool") == [Event("text", "abc <tool")]
    assert parser.push("\n\n") == [Event("text", "\n\n")]


def test_reasoning_holds_only_a_possible_end_tag():
    parser = ReplyParser(thinking=True, tools=TOOLS)
    assert parser.push("<thi") == []  # may be a reopened <think>
    assert parser.push("nk>\n") == []
    assert parser.push("step one\n</thi") == [Event("reasoning", "step one")]
    assert parser.push("s is not it\n") == [Event("reasoning", "\n</this is not it")]
    assert parser.push("</think>\n\nAns") == [Event("text", "Ans")]
    assert parser.finish() == []
