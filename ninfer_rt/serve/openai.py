"""The OpenAI-compatible front end: /v1/chat/completions and /v1/completions requests into Jobs, replies out.

Chat replies carry the model's reasoning as `reasoning_content` (as vLLM's qwen3 reasoning parser and llama.cpp
do) and its Qwen XML tool calls as `tool_calls`; streams are server-sent events of `chat.completion.chunk`s
ending in `data: [DONE]`. Extensions clients already send to vLLM: top_k, min_p, repetition_penalty,
chat_template_kwargs (enable_thinking, preserve_thinking).
"""

from __future__ import annotations

import codecs
import json
import math
import time
import uuid

from ninfer_rt.api import GenerationStats
from ninfer_rt.chat import REASONING_KEYS
from ninfer_rt.errors import NinferError
from ninfer_rt.json_schema import JSON_OBJECT, Node, SchemaError, compile_schema
from ninfer_rt.logprobs import MAX_TOP_LOGPROBS
from ninfer_rt.sandbox import TEMPLATE_HELPERS
from ninfer_rt.serve.common import (Job, Prepared, RequestError, bad, check_parts, forced_call, get, get_float, get_int,
                                    get_stops, prompt_ids)
from ninfer_rt.serve.replies import Event

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_RESERVED_KWARGS = ("self", "messages", "tools", "add_generation_prompt", "documents")  # render()'s own
MAX_CHOICES = 16  # n: choices of one request, each a sequence of the batch


def sampling_fields(body: dict) -> dict:
    """The sampling fields both endpoints take; absent ones stay None (the checkpoint's default). logit_bias is
    refused rather than ignored (an empty one is no bias)."""
    if get(body, "logit_bias", (dict,), "an object"):
        raise bad("logit_bias is not supported", "logit_bias")
    return {
        "temperature": get_float(body, "temperature", 0.0, 2.0),
        "top_p": get_float(body, "top_p", 0.0, 1.0, open_lo=True),
        "top_k": get_int(body, "top_k", -1),  # -1 (vLLM) and 0 both mean off (SamplingParams)
        "min_p": get_float(body, "min_p", 0.0, 1.0),
        "presence_penalty": get_float(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": get_float(body, "frequency_penalty", -2.0, 2.0),
        "repetition_penalty": get_float(body, "repetition_penalty", 0.0, 10.0, open_lo=True),
        "seed": get_int(body, "seed", 0, 2**64 - 1),
    }


def _chat_logprobs(body: dict) -> int | None:
    """Chat's logprobs (a boolean) and top_logprobs (0..20 alternatives, only with logprobs true)."""
    top = get_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if not get(body, "logprobs", (bool,), "a boolean", False):
        if top:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def _choices(body: dict) -> int:
    """n: how many choices to generate for each prompt (1..MAX_CHOICES)."""
    return get_int(body, "n", 1, MAX_CHOICES, 1)


def _response_format(body: dict) -> Node | None:
    """response_format: text (the default: None), json_object (the reply is one JSON object: JSON_OBJECT) or
    json_schema (the reply is JSON its json_schema.schema accepts, within json_schema.py's subset: a schema outside
    it is refused, not loosened; its compiled root)."""
    fmt = get(body, "response_format", (dict,), "an object", {})
    kind = fmt.get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise bad(f"response_format {kind!r} is not supported: use text, json_object or json_schema",
                  "response_format")
    if kind != "json_schema":
        return JSON_OBJECT if kind == "json_object" else None
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad("response_format json_schema needs json_schema.schema, a JSON Schema object", "response_format")
    try:
        return compile_schema(spec["schema"])
    except SchemaError as e:
        raise bad(str(e), "response_format") from None


def _content(value, where: str):
    """Message content: a string, null, or a list of text parts (images are refused)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"{where} must be a string, null or a list of content parts", where)
    return [{"type": "text", "text": part["text"]} for part in check_parts(value, where, ("text",))]


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls with their JSON-string arguments as objects (the template's form)."""
    if not isinstance(calls, list):
        raise bad(f"{where} must be a list", where)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{where}[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                      where)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except (ValueError, RecursionError):  # RecursionError: nesting past the parser's depth
                raise bad(f"{where}[{i}].function.arguments is not valid JSON", where) from None
        if not isinstance(args, dict):
            raise bad(f"{where}[{i}].function.arguments must be a JSON object", where)
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def chat_messages(messages) -> list[dict]:
    """OpenAI chat messages in the form the chat template reads (checked, with 'developer' as 'system')."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", "messages")
        role = _ROLES.get(m["role"]) if isinstance(m.get("role"), str) else None
        if role is None:
            raise bad(f"{where}.role must be one of {', '.join(_ROLES)}, got {m.get('role')!r}", "messages")
        msg = {"role": role, "content": _content(m.get("content"), f"{where}.content")}
        if role == "assistant":
            key = next((k for k in REASONING_KEYS if m.get(k) is not None), None)  # the first given, as HF reads
            if key is not None:
                msg["reasoning_content"] = get(m, key, (str,), "a string", where=where)
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = get(m, "tool_call_id", (str,), "a string", where=where)
        out.append(msg)
    return out


def tools_field(body: dict) -> list[dict] | None:
    """tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}], checked."""
    tools = get(body, "tools", (list,), "a list")
    if not tools:
        return None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    return tools


def parse_chat(body: dict) -> Job:
    """A /v1/chat/completions request as a Job."""
    tools = tools_field(body)
    choice = body.get("tool_choice") or "auto"
    forced = None
    if choice == "required":
        forced = forced_call(tools, "", "tool_choice")
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad("tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}}", "tool_choice")
        forced = forced_call(tools, fn["name"], "tool_choice")
    elif choice not in ("auto", "none"):
        raise bad("tool_choice must be 'auto', 'none', 'required' or a function", "tool_choice")
    kwargs = get(body, "chat_template_kwargs", (dict,), "an object", {})
    clash = [k for k in kwargs if k in _RESERVED_KWARGS or k in TEMPLATE_HELPERS or not k.isidentifier()
             or k.startswith("_")]
    if clash:
        raise bad(f"chat_template_kwargs may not set {clash[0]!r}", "chat_template_kwargs")
    if not isinstance(kwargs.get("enable_thinking", False), (bool, type(None))):
        raise bad("chat_template_kwargs.enable_thinking must be true, false or null", "chat_template_kwargs")
    max_tokens = get_int(body, "max_completion_tokens", 1)
    stream_options = get(body, "stream_options", (dict,), "an object", {})
    messages = chat_messages(body.get("messages"))
    continue_final = get(body, "continue_final_message", (bool,), "a boolean", False)  # vLLM's prefill
    if continue_final and body.get("add_generation_prompt") is True:
        raise bad("continue_final_message continues the last message: add_generation_prompt must be false",
                  "continue_final_message")
    if forced is not None and continue_final:
        raise bad("a forced tool call starts the reply: it cannot continue the final message", "tool_choice")
    json_schema = _response_format(body)
    if forced is not None and json_schema is not None:
        raise bad("a forced tool call and a JSON response_format each ask for the whole reply", "response_format")
    job = Job(messages=messages, tools=None if choice == "none" else tools, continue_final=continue_final,
              forced_call=forced,
              template_kwargs=dict(kwargs), sampling=sampling_fields(body), logprobs=_chat_logprobs(body),
              max_tokens=max_tokens if max_tokens is not None else get_int(body, "max_tokens", 1),
              stop=get_stops(body, "stop"), stream=get(body, "stream", (bool,), "a boolean", False),
              include_usage=get(stream_options, "include_usage", (bool,), "a boolean", False), n=_choices(body),
              json_schema=json_schema, skip_special_tokens=_skip_special(body))
    return job


def _skip_special(body: dict) -> bool:
    """vLLM's skip_special_tokens (default true): special tokens left out of the reply's text."""
    return get(body, "skip_special_tokens", (bool,), "a boolean", True)


def _is_ids(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(i, int) and not isinstance(i, bool)
                                                             for i in prompt)


def _prompts(prompt) -> list:
    """A completion's prompt in OpenAI's four forms (a string, token ids, a list of strings, a list of token-id
    lists) as its list of prompts, each a non-empty string or token ids."""
    if (isinstance(prompt, str) and prompt) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) and p for p in prompt)
                                                or all(_is_ids(p) for p in prompt)):
        return list(prompt)
    raise bad("'prompt' must be a non-empty string, a list of token ids, a list of non-empty strings or a list of "
              "token-id lists", "prompt")


def parse_completion(body: dict) -> Job:
    """A /v1/completions request as a Job (the prompt is used as is: no template, no reply parsing)."""
    if body.get("suffix") is not None or get_int(body, "best_of", 1, None, 1) != 1:
        raise bad("suffix and best_of are not supported", "suffix")
    prompts = _prompts(body.get("prompt"))
    stream_options = get(body, "stream_options", (dict,), "an object", {})
    job = Job(prompt=prompts[0], prompts=prompts if len(prompts) > 1 else None, sampling=sampling_fields(body),
              max_tokens=get_int(body, "max_tokens", 0, None, 16),
              logprobs=get_int(body, "logprobs", 0, MAX_TOP_LOGPROBS),
              echo=get(body, "echo", (bool,), "a boolean", False),
              stop=get_stops(body, "stop"), stream=get(body, "stream", (bool,), "a boolean", False),
              include_usage=get(stream_options, "include_usage", (bool,), "a boolean", False), n=_choices(body),
              skip_special_tokens=_skip_special(body))
    job.json_schema = _response_format(body)
    return job


def error_body(e: RequestError) -> dict:
    """OpenAI's error object (its code is a string, context_length_exceeded where the prompt does not fit, or null;
    the status is the HTTP one)."""
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


def _usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


def _finish(stats, calls: bool) -> str:
    """OpenAI's finish_reason from GenerationStats."""
    return "length" if stats.finish_reason == "length" else ("tool_calls" if calls else "stop")


def _stream_end(reply, obj: str, stats) -> list[bytes]:
    """A stream's last frames: the usage chunk (object obj, no choices) where include_usage asks, then [DONE]."""
    frames = []
    if reply.include_usage:
        frames.append(sse({"id": reply.id, "object": obj, "created": reply.created, "model": reply.model,
                           "choices": [], "usage": _usage(stats)}))
    return frames + [b"data: [DONE]\n\n"]


def sse(obj) -> bytes:
    """One server-sent event carrying obj as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace") + b"\n\n"


def _lp(value: float) -> float:
    """A logprob as JSON can carry it: OpenAI's -9999.0 for an impossible token (JSON has no -Infinity)."""
    return value if math.isfinite(value) else -9999.0


def _token_fields(token_bytes, i: int, logprob: float) -> dict:
    """Chat's form of one token: its text (U+FFFD for part of a character), logprob and exact UTF-8 bytes."""
    raw = token_bytes(i)
    return {"token": raw.decode("utf-8", "replace"), "logprob": _lp(logprob), "bytes": list(raw)}


class _Logprobs:
    """Output tokens' logprobs as they come: the ones not yet sent (for the next chunk) and all of them."""

    def __init__(self, job: Job):
        self.on = job.logprobs is not None
        self.pending, self.all = [], []

    def add(self, entries: list) -> None:
        self.pending += entries
        self.all += entries

    def take(self) -> list:
        out, self.pending = self.pending, []
        return out


class ChatReply:
    """Builds a chat completion from reply Events: chunks while streaming (events() returns the frames to send),
    and the whole object at the end (body())."""

    def __init__(self, model_name: str, prepared: Prepared, job: Job):
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model_name
        self.index = 0  # the choice's index (n > 1: choices() sets it, and one id for all)
        self.include_usage = job.include_usage
        self.reasoning, self.text, self.calls = [], [], []
        self.lp = _Logprobs(job)

    def add_logprobs(self, entries: list, token_bytes, text_bytes) -> None:
        self.lp.add([{**_token_fields(token_bytes, e.id, e.logprob),
                      "top_logprobs": [_token_fields(token_bytes, i, lp) for i, lp in e.top]} for e in entries])

    def _logprobs(self, entries: list) -> dict | None:
        return {"content": entries, "refusal": None} if self.lp.on else None

    def _chunk(self, delta: dict, finish: str | None = None) -> bytes:
        pending = self.lp.take()  # the tokens since the last chunk (their text may have been held back)
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": [{"index": self.index, "delta": delta,
                              "logprobs": self._logprobs(pending) if pending else None, "finish_reason": finish}]}
        if self.include_usage:
            chunk["usage"] = None  # every chunk but the last carries a null usage
        return sse(chunk)

    def start(self) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def admitted(self, cached_tokens: int) -> list[bytes]:
        return []  # the usage, cached tokens included, comes in the last chunk

    def events(self, events: list[Event]) -> list[bytes]:
        frames = []
        for ev in events:
            if ev.kind == "reasoning":
                self.reasoning.append(ev.text)
                frames.append(self._chunk({"reasoning_content": ev.text}))
            elif ev.kind == "text":
                self.text.append(ev.text)
                frames.append(self._chunk({"content": ev.text}))
            else:
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": ev.call.name, "arguments": json.dumps(ev.call.arguments,
                                                                                   ensure_ascii=False)}}
                frames.append(self._chunk({"tool_calls": [{"index": len(self.calls), **call}]}))
                self.calls.append(call)
        return frames

    def finish(self, stats) -> list[bytes]:
        return self.close(stats) + self.end(stats)

    def close(self, stats) -> list[bytes]:
        """The choice's last chunk (its finish_reason)."""
        return [self._chunk({}, _finish(stats, bool(self.calls)))]

    def end(self, stats) -> list[bytes]:
        """The stream's end after every choice closed: the usage chunk where asked, then [DONE]."""
        return _stream_end(self, "chat.completion.chunk", stats)

    def body(self, stats) -> dict:
        message = {"role": "assistant", "content": "".join(self.text) if self.text or not self.calls else None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = self.calls
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": self.index, "message": message, "logprobs": self._logprobs(self.lp.all),
                             "finish_reason": _finish(stats, bool(self.calls))}],
                "usage": _usage(stats)}


class CompletionReply:
    """A text completion, streamed or whole (the same interface as ChatReply)."""

    def __init__(self, model_name: str, prepared: Prepared, job: Job):
        self.id, self.created, self.model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model_name
        self.index = 0  # the choice's index (n > 1: choices() sets it, and one id for all)
        self.include_usage = job.include_usage
        self.echo = self._unsent = prepared.echo or ""  # the prompt's text, sent first
        self.text = []
        self.lp = _Logprobs(job)
        self._top = job.logprobs
        self._chars = codecs.getincrementaldecoder("utf-8")("replace")
        self._offset = 0  # characters of the completion before the next token

    def add_logprobs(self, entries: list, token_bytes, text_bytes) -> None:
        """The legacy form, token by token: its text, logprob, alternatives (text -> logprob) and character
        offset in the completion (a skipped special token adds no characters to it)."""
        for e in entries:
            raw = token_bytes(e.id)
            top = {}
            for i, lp in e.top:
                top.setdefault(token_bytes(i).decode("utf-8", "replace"), _lp(lp))
            first = math.isnan(e.logprob)  # an echoed prompt's first token: nothing precedes it
            self.lp.add([(raw.decode("utf-8", "replace"), None if first else _lp(e.logprob), None if first else top,
                          self._offset)])
            self._offset += len(self._chars.decode(text_bytes(e.id)))

    def _logprobs(self, entries: list) -> dict | None:
        if not self.lp.on:
            return None
        return {"tokens": [t for t, _, _, _ in entries], "token_logprobs": [lp for _, lp, _, _ in entries],
                "top_logprobs": [top for _, _, top, _ in entries] if self._top else None,
                "text_offset": [at for _, _, _, at in entries]}

    def _chunk(self, text: str, finish: str | None = None) -> bytes:
        pending = self.lp.take()
        text, self._unsent = self._unsent + text, ""
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": [{"index": self.index, "text": text,
                              "logprobs": self._logprobs(pending) if pending else None, "finish_reason": finish}]}
        if self.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def start(self) -> list[bytes]:
        return []

    def admitted(self, cached_tokens: int) -> list[bytes]:
        return []

    def events(self, events: list[Event]) -> list[bytes]:
        self.text.extend(ev.text for ev in events)
        return [self._chunk(ev.text) for ev in events]

    def finish(self, stats) -> list[bytes]:
        return self.close(stats) + self.end(stats)

    def close(self, stats) -> list[bytes]:
        """The choice's last chunk (its finish_reason)."""
        return [self._chunk("", _finish(stats, False))]

    def end(self, stats) -> list[bytes]:
        """The stream's end after every choice closed: the usage chunk where asked, then [DONE]."""
        return _stream_end(self, "text_completion", stats)

    def body(self, stats) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": self.index, "text": self.echo + "".join(self.text),
                             "logprobs": self._logprobs(self.lp.all),
                             "finish_reason": _finish(stats, False)}],
                "usage": _usage(stats)}


def choices(replies: list) -> list:
    """The replies of one request's choices (n of each prompt, prompt by prompt) as one reply: their indexes
    0..len-1 and the first one's id."""
    for i, r in enumerate(replies):
        r.index, r.id, r.created = i, replies[0].id, replies[0].created
    return replies


def combined_stats(stats: list, n: int) -> GenerationStats:
    """The usage of a request's choices, n of each prompt in turn: each prompt (and its cached tokens) once, every
    choice's tokens."""
    firsts = stats[::n]
    return GenerationStats(prompt_tokens=sum(s.prompt_tokens for s in firsts),
                           cached_tokens=sum(s.cached_tokens for s in firsts),
                           generated_tokens=sum(s.generated_tokens for s in stats),
                           prefill_s=max(s.prefill_s for s in stats), decode_s=max(s.decode_s for s in stats),
                           finish_reason=stats[0].finish_reason)


def choices_body(replies: list, stats: list, n: int) -> dict:
    """The whole object of a request's choices: each reply's choice in index order, the combined usage."""
    body = replies[0].body(stats[0])
    body["choices"] = [r.body(s)["choices"][0] for r, s in zip(replies, stats)]
    body["usage"] = _usage(combined_stats(stats, n))
    return body


def stream_error(e: RequestError) -> bytes:
    """An error after the stream began (headers sent): one event with the error object, then [DONE]."""
    return sse(error_body(e)) + b"data: [DONE]\n\n"


def tokens_reply(model, action: str, body: dict) -> dict:
    """vLLM's /tokenize (a completion's "prompt" text, or a chat's "messages" rendered as /v1/chat/completions
    renders them) -> {count, max_model_len, tokens}; /detokenize ({"tokens": [ids]}) -> {prompt}."""
    if action == "detokenize":
        ids = body.get("tokens")
        if not isinstance(ids, list):
            raise bad("'tokens' must be a list of token ids", "tokens")
        try:
            return {"prompt": model.tokenizer.decode(model.check_ids(ids))}
        except NinferError as e:
            raise bad(str(e), "tokens") from None
    if "messages" in body:
        job = parse_chat(body)
    elif isinstance(body.get("prompt"), str) and body["prompt"]:
        job = Job(prompt=body["prompt"])
    else:
        raise bad("give 'prompt' (a non-empty string) or 'messages'", "prompt")
    _, ids = prompt_ids(model, job)
    return {"count": len(ids), "max_model_len": model.context_length, "tokens": ids}


def tokenizer_info(model) -> dict:
    """vLLM's /tokenizer_info: the special tokens' texts, the chat template (null where the artifact's cannot be
    read) and the context, all lm-evaluation-harness's remote tokenizer needs beside /tokenize and /detokenize."""
    tok = model.tokenizer
    try:
        template = model.chat_template.source
    except NinferError:
        template = None
    return {"tokenizer_class": tok.tokenizer_config.get("tokenizer_class"),
            **{f"{kind}_token": tok.special_text(kind) for kind in ("bos", "eos", "pad", "unk")},
            "chat_template": template, "model_max_length": model.context_length}
