"""The Anthropic-compatible front end: /v1/messages (and /v1/messages/count_tokens) requests into Jobs, replies out.

Content blocks map onto the chat template's messages: text, `thinking` (an assistant's reasoning_content),
`tool_use` (tool_calls with their input object) and `tool_result` (a tool message). The reply's reasoning comes
back as a thinking block (its signature empty: nothing signs it here), its Qwen XML tool calls as tool_use blocks.
`thinking: {"type": "enabled" | "adaptive"}` asks for the thinking prompt; without it, or with "disabled", the
template's no-thinking prompt, so a reply holds thinking blocks only where they were asked for, as in the Messages
API (budget_tokens is not enforced). A final assistant message is a prefill:
the reply continues it (and comes back without it), as the Messages API does.
"""

from __future__ import annotations

import json
import uuid

from ninfer_rt.serve.common import (Job, Prepared, RequestError, bad, check_parts, forced_call, get, get_float,
                                    get_int, get_stops)
from ninfer_rt.serve.replies import Event


def _text_blocks(content, where: str, allowed: tuple[str, ...]) -> list[dict]:
    """Content as a list of blocks (a string is one text block), each an object of an allowed type."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of content blocks", where)
    return check_parts(content, where, allowed)


def _plain_text(blocks: list[dict]) -> str:
    return "".join(b["text"] for b in blocks if b.get("type") == "text")


def _user(blocks: list[dict], where: str) -> list[dict]:
    """A user turn: runs of text blocks become user messages, each tool_result a tool message, in order."""
    out, texts = [], []
    for i, b in enumerate(blocks):
        if b["type"] == "text":
            texts.append({"type": "text", "text": b["text"]})
            continue
        if texts:
            out.append({"role": "user", "content": texts})
            texts = []
        result = b.get("content", "")
        body = result if isinstance(result, str) else _plain_text(
            _text_blocks(result, f"{where}[{i}].content", ("text",)))
        if b.get("is_error"):
            body = f"Error: {body}"
        out.append({"role": "tool", "content": body,
                    "tool_call_id": get(b, "tool_use_id", (str,), "a string", where=f"{where}[{i}]")})
    if texts:
        out.append({"role": "user", "content": texts})
    return out


def _assistant(blocks: list[dict], where: str) -> dict:
    """An assistant turn: text joined, thinking as reasoning_content, tool_use blocks as tool_calls."""
    msg: dict = {"role": "assistant", "content": _plain_text(blocks)}
    thinking = [b.get("thinking") for b in blocks if b["type"] == "thinking"]
    if any(not isinstance(t, str) for t in thinking):
        raise bad(f"{where}: a thinking block's 'thinking' must be a string", where)
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    calls = []
    for i, b in enumerate(blocks):
        if b["type"] != "tool_use":
            continue
        if not isinstance(b.get("name"), str) or not b["name"] or not isinstance(b.get("input", {}), dict):
            raise bad(f"{where}[{i}]: a tool_use block needs a name and an input object", where)
        calls.append({"id": get(b, "id", (str,), "a string", where=f"{where}[{i}]"), "type": "function",
                      "function": {"name": b["name"], "arguments": b.get("input", {})}})
    if calls:
        msg["tool_calls"] = calls
    return msg


def chat_messages(body: dict) -> list[dict]:
    """system + messages as the chat template's messages."""
    out = []
    system = body.get("system")
    if system is not None:
        text = system if isinstance(system, str) else _plain_text(_text_blocks(system, "system", ("text",)))
        out.append({"role": "system", "content": text})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"messages[{i}] must be an object with role 'user' or 'assistant'", "messages")
        if m.get("content") == []:  # a turn says something (Anthropic refuses empty content too)
            raise bad(f"{where} must not be empty", where)
        if m["role"] == "user":
            out.extend(_user(_text_blocks(m.get("content"), where, ("text", "tool_result")), where))
        else:
            out.append(_assistant(_text_blocks(m.get("content"), where,
                                               ("text", "thinking", "redacted_thinking", "tool_use")), where))
    return out


def _tools(body: dict) -> list[dict] | None:
    """Anthropic tools ({name, description, input_schema}) in the OpenAI form the template and parser read."""
    tools = get(body, "tools", (list,), "a list")
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise bad(f"tools[{i}] must be an object with a name", "tools")
        if t.get("type") not in (None, "custom"):  # bash_*, web_search_*, ...: tools Anthropic defines and trains
            raise bad(f"tools[{i}]: Anthropic-defined tool {t['type']!r} is not supported: give a custom tool (a "
                      f"name, a description and an input_schema)", "tools")
        schema = t.get("input_schema", {})
        if not isinstance(schema, dict):
            raise bad(f"tools[{i}].input_schema must be a JSON schema object", "tools")
        fn = {"name": t["name"]}  # OpenAI's order: the same tool renders the same text from either API
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": {**fn, "parameters": schema}})
    return out


def parse_messages(body: dict, count_only: bool = False) -> Job:
    """A /v1/messages request as a Job (count_only: /v1/messages/count_tokens, which has no max_tokens)."""
    max_tokens = get_int(body, "max_tokens", 1)
    if max_tokens is None and not count_only:
        raise bad("'max_tokens' is required", "max_tokens")
    tools = _tools(body)
    choice = get(body, "tool_choice", (dict,), "an object", {"type": "auto"})
    forced = None
    if choice.get("type") == "any":
        forced = forced_call(tools, "", "tool_choice")
    elif choice.get("type") == "tool":
        if not isinstance(choice.get("name"), str) or not choice["name"]:
            raise bad("tool_choice of type tool needs the tool's name", "tool_choice")
        forced = forced_call(tools, choice["name"], "tool_choice")
    elif choice.get("type") not in ("auto", "none"):
        raise bad("tool_choice.type must be auto, any, tool or none", "tool_choice")
    thinking = get(body, "thinking", (dict,), "an object", {"type": "disabled"})
    if thinking.get("type") not in ("enabled", "adaptive", "disabled"):
        raise bad("thinking.type must be 'enabled', 'adaptive' or 'disabled'", "thinking")
    kwargs = {"enable_thinking": thinking["type"] != "disabled"}
    top_k = get_int(body, "top_k", 0)
    # seed is not the Messages API's: an extension, as on the OpenAI endpoints (llama.cpp's server takes it on every
    # endpoint), so that a sampled reply can be reproduced from either API
    sampling = {"temperature": get_float(body, "temperature", 0.0, 1.0),
                "top_p": get_float(body, "top_p", 0.0, 1.0, open_lo=True), "top_k": top_k,
                "seed": get_int(body, "seed", 0, 2**64 - 1)}
    messages = chat_messages(body)
    if forced is not None and messages[-1]["role"] == "assistant":
        raise bad("a forced tool call starts the reply: it cannot continue a prefilled assistant message",
                  "tool_choice")
    return Job(messages=messages, tools=None if choice["type"] == "none" else tools, forced_call=forced,
               template_kwargs=kwargs, sampling=sampling, max_tokens=max_tokens,
               stop=get_stops(body, "stop_sequences"), stream=get(body, "stream", (bool,), "a boolean", False),
               continue_final=messages[-1]["role"] == "assistant")  # a prefill: the reply continues it


def error_body(e: RequestError) -> dict:
    """Anthropic's error object."""
    return {"type": "error", "error": {"type": e.kind, "message": e.message}}


def _event(name: str, obj: dict) -> bytes:
    """One server-sent event of the Messages stream."""
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace")
    return f"event: {name}\ndata: ".encode() + data + b"\n\n"


class MessagesReply:
    """Builds a Message from reply Events: the stream's events while they come (events() returns the frames), and
    the whole object at the end (body()); the interface of openai.ChatReply."""

    _START = {"reasoning": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}
    _DELTA = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}

    def __init__(self, model_name: str, prepared: Prepared, job: Job):
        self.id, self.model, self.prompt_tokens = f"msg_{uuid.uuid4().hex[:24]}", model_name, len(prepared.ids)
        self.blocks: list[dict] = []
        self.open: str | None = None  # the kind of the block being streamed

    def add_logprobs(self, entries: list, token_bytes, text_bytes) -> None:
        """The Messages API has no logprobs, so no Job of it asks for them: nothing to add."""

    def start(self) -> list[bytes]:
        return []  # message_start waits for admitted(): its usage splits the input by what a cache held

    def admitted(self, cached_tokens: int) -> list[bytes]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens - cached_tokens,
                             "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0,
                             "output_tokens": 0}}
        return [_event("message_start", {"type": "message_start", "message": message})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def events(self, events: list[Event]) -> list[bytes]:
        frames = []
        for ev in events:
            if ev.kind == "tool_call":
                frames += self._close()
                block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": ev.call.name,
                         "input": ev.call.arguments}
                self.blocks.append(block)
                index = len(self.blocks) - 1
                frames.append(_event("content_block_start", {"type": "content_block_start", "index": index,
                                                             "content_block": {**block, "input": {}}}))
                frames.append(_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(ev.call.arguments, ensure_ascii=False)}}))
                frames.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
                continue
            if self.open != ev.kind:
                frames += self._close()
                self.blocks.append(dict(self._START[ev.kind]))
                self.open = ev.kind
                frames.append(_event("content_block_start", {"type": "content_block_start",
                                                             "index": len(self.blocks) - 1,
                                                             "content_block": self._START[ev.kind]}))
            kind, key = self._DELTA[ev.kind]
            self.blocks[-1][key] += ev.text
            frames.append(_event("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                         "delta": {"type": kind, key: ev.text}}))
        return frames

    def _stop(self, stats) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) from GenerationStats and the blocks."""
        if stats.finish_reason == "length":
            return "max_tokens", None
        if any(b["type"] == "tool_use" for b in self.blocks):
            return "tool_use", None
        if stats.finish_reason == "stop":
            return "stop_sequence", stats.stop_string
        return "end_turn", None

    def finish(self, stats) -> list[bytes]:
        reason, sequence = self._stop(stats)
        return self._close() + [
            _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                     "usage": _usage(stats)}),
            _event("message_stop", {"type": "message_stop"})]

    def body(self, stats) -> dict:
        reason, sequence = self._stop(stats)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.blocks,
                "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(stats)}


def _usage(stats) -> dict:
    """The Messages API's usage: input_tokens are the prompt's tokens not read from a cache (the three input fields
    add up to the prompt), as Anthropic counts them; the stream's message_delta carries the same final counts."""
    return {"input_tokens": stats.prompt_tokens - stats.cached_tokens, "cache_read_input_tokens": stats.cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": stats.generated_tokens}


def stream_error(e: RequestError) -> bytes:
    """An error after the stream began: Anthropic's error event."""
    return _event("error", error_body(e))
