"""Split the text a Qwen3.6 model generates into reasoning, answer text and tool calls, incrementally.

With thinking on, the prompt ends with "<|im_start|>assistant\\n<think>\\n", so the reply starts inside the
reasoning; tools are called in the chat template's XML-like form:

    The user wants the weather, so I call the tool.
    </think>

    Let me look that up.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

parses to Event("reasoning", "The user wants ... the tool."), Event("text", "Let me look that up.") and
Event("tool_call", call=ToolCall("get_weather", {"city": "Paris", "days": 3})), values typed by the tool's schema.
Parsing is strict: a block that does not parse comes out as text, tags included, so nothing the model wrote is
lost. ReplyParser takes the reply in pieces and emits each event as soon as no later text can change it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"
_PARAM_CLOSE = "</parameter>"
_FUNCTION = re.compile(r"\s*<function=([^<>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^<>\n]+)>")
_END = re.compile(r"\s*</function>\s*\Z")
# JSON schema type -> test of a json.loads result; "string" is absent: it is the fallback, always last.
_KINDS = {
    "integer": lambda v: type(v) is int,
    "number": lambda v: type(v) in (int, float),
    "boolean": lambda v: type(v) is bool,
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class Event:
    """A piece of the reply: kind "reasoning" or "text" with `text`, or "tool_call" with `call`."""

    kind: str
    text: str = ""
    call: ToolCall | None = None


def tool_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """name -> JSON schema of its parameters, from tools in OpenAI form {"type": "function", "function": {"name",
    "description", "parameters"}} or bare {"name", "parameters"} (or Anthropic's "input_schema"). Missing
    parameters -> {}; entries without a name are skipped."""
    schemas = {}
    for tool in tools or ():
        if not isinstance(tool, dict):
            continue
        spec = tool["function"] if isinstance(tool.get("function"), dict) else tool
        name = spec.get("name")
        if isinstance(name, str) and name:
            params = spec.get("parameters") or spec.get("input_schema")
            schemas[name] = params if isinstance(params, dict) else {}
    return schemas


def _finite(literal: str) -> float:
    """json parse_float that refuses literals overflowing to infinity (1e999): JSON has no such numbers."""
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"non-finite number {literal}")
    return value


def _refuse(literal: str):
    """json parse_constant: NaN and Infinity are not JSON."""
    raise ValueError(f"not JSON: {literal}")


def _convert(raw: str, prop) -> object:
    """A parameter's raw text typed by its schema property: the first listed non-string kind the JSON text
    decodes to, else the raw string (also when the schema says nothing)."""
    types = prop.get("type") if isinstance(prop, dict) else None
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    kinds = [t for t in types if isinstance(t, str) and t in _KINDS]
    if not kinds:
        return raw
    try:
        value = json.loads(raw, parse_float=_finite, parse_constant=_refuse)
    except (ValueError, RecursionError):
        return raw
    return value if any(_KINDS[t](value) for t in kinds) else raw


def _parse_call(block: str, schemas: dict[str, dict]) -> ToolCall | None:
    """The call in the text between <tool_call> and </tool_call>, or None where it breaks any rule."""
    m = _FUNCTION.match(block)
    if not m or m.group(1) not in schemas:
        return None
    name = m.group(1)
    props = schemas[name].get("properties")
    props = props if isinstance(props, dict) else {}
    arguments, pos = {}, m.end()
    while m := _PARAMETER.match(block, pos):
        end = block.find(_PARAM_CLOSE, m.end())
        if end < 0 or m.group(1) in arguments:
            return None
        raw = block[m.end():end]
        raw = raw[1:] if raw.startswith("\n") else raw  # the template puts the value on lines of its own
        raw = raw[:-1] if raw.endswith("\n") else raw
        arguments[m.group(1)] = _convert(raw, props.get(m.group(1)))
        pos = end + len(_PARAM_CLOSE)
    return ToolCall(name, arguments) if _END.match(block, pos) else None


def _held(text: str, tag: str, chars: str | None) -> int:
    """How many trailing characters to hold back: a suffix that may start `tag`, and the run of `chars`
    (None: any whitespace) before it, which the tag would drop."""
    n = next((n for n in range(min(len(text), len(tag) - 1), 0, -1) if text.endswith(tag[:n])), 0)
    head = text[:len(text) - n]
    return len(text) - len(head.rstrip(chars))


class ReplyParser:
    """Incremental parser of one reply: push() the generated text piece by piece, then finish().

    The events of any split of a text, adjacent text pieces merged, are those of parse_reply on the whole."""

    def __init__(self, *, thinking: bool, tools: list[dict] | None = None):
        """thinking: the prompt opened the reasoning (the reply starts inside it); tools: those offered to the
        model (None or []: tool calls are plain text)."""
        self._schemas = tool_schemas(tools)
        self._state = "reasoning" if thinking else "text"  # or "block": inside <tool_call>
        self._at_start = thinking  # a <think> here is dropped: some models reopen it
        self._lstrip = False  # newlines after a think tag still to drop
        self._buf = ""  # text not yet emitted
        self._ws = ""  # whitespace before the open block: dropped only if the block parses
        self._after_call = False  # whitespace after the last call, at the end, is dropped
        self._scanned = 0  # how much of an open block was searched for its end already

    def push(self, piece: str) -> list[Event]:
        """Take the next piece of generated text; return the events it made certain."""
        self._buf += piece
        return self._advance(final=False)

    def finish(self) -> list[Event]:
        """End of generation: return everything still held back (an open block comes out as text)."""
        return self._advance(final=True)

    def _emit(self, out: list[Event], kind: str, text: str) -> None:
        """Append a reasoning/text event unless empty; answer text after a call ends the 'after call' run."""
        if text:
            out.append(Event(kind, text))
            self._after_call = False

    def _advance(self, final: bool) -> list[Event]:
        """Emit what the buffer makes certain (all of it when final)."""
        out: list[Event] = []
        while True:
            if self._lstrip:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    return out
                self._lstrip = False
            buf = self._buf
            if self._state == "reasoning":
                if self._at_start:
                    if not final and _THINK_OPEN.startswith(buf):
                        return out
                    self._at_start = False
                    if buf.startswith(_THINK_OPEN):
                        self._buf, self._lstrip = buf[len(_THINK_OPEN):], True
                        continue
                i = buf.find(_THINK_CLOSE)
                if i >= 0:
                    self._emit(out, "reasoning", buf[:i].rstrip("\n"))
                    self._buf, self._lstrip, self._state = buf[i + len(_THINK_CLOSE):], True, "text"
                    continue
                keep = 0 if final else _held(buf, _THINK_CLOSE, "\n")  # cut short: all of it is reasoning
                self._emit(out, "reasoning", buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return out
            if self._state == "text":
                i = buf.find(_CALL_OPEN) if self._schemas else -1
                if i >= 0:
                    head = buf[:i]
                    self._emit(out, "text", head.rstrip())
                    self._ws, self._buf = head[len(head.rstrip()):], buf[i + len(_CALL_OPEN):]
                    self._state, self._scanned = "block", 0
                    continue
                if final:
                    if not (self._after_call and buf.isspace()):
                        self._emit(out, "text", buf)
                    self._buf = ""
                    return out
                keep = _held(buf, _CALL_OPEN, None) if self._schemas else 0
                self._emit(out, "text", buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return out
            # inside a block: nothing is certain until it closes
            j = buf.find(_CALL_CLOSE, max(0, self._scanned - len(_CALL_CLOSE) + 1))
            if j < 0:
                if final:
                    self._emit(out, "text", self._ws + _CALL_OPEN + buf)
                    self._buf = self._ws = ""
                else:
                    self._scanned = len(buf)
                return out
            call = _parse_call(buf[:j], self._schemas)
            if call is None:
                self._emit(out, "text", self._ws + _CALL_OPEN + buf[:j + len(_CALL_CLOSE)])
            else:
                out.append(Event("tool_call", call=call))
                self._after_call = True
            self._buf, self._ws, self._state = buf[j + len(_CALL_CLOSE):], "", "text"


def parse_reply(text: str, *, thinking: bool, tools: list[dict] | None = None) -> list[Event]:
    """The events of a whole reply: push(text) + finish(), adjacent reasoning/text events merged."""
    parser = ReplyParser(thinking=thinking, tools=tools)
    merged: list[Event] = []
    for event in parser.push(text) + parser.finish():
        if merged and event.kind != "tool_call" and merged[-1].kind == event.kind:
            merged[-1] = Event(event.kind, merged[-1].text + event.text)
        else:
            merged.append(event)
    return merged
