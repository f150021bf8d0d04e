"""What the OpenAI and Anthropic front ends share: the request error, field readers, and the Job both reduce to.

A request becomes a Job (messages for the chat template, or a raw prompt; tools; sampling; limits), the Job becomes
token ids in the handler's thread (so a bad request fails before it queues), and the generation worker turns
those into text. Field readers name the field at fault, as the CLIs do, in one line.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from ninfer_rt.errors import NinferError
from ninfer_rt.json_schema import Node
from ninfer_rt.sampling import SamplingParams, requested_sampling

MAX_STOPS = 16          # stop strings a request may give (OpenAI allows 4, vLLM any number)
MAX_STOP_CHARS = 1024   # characters in one stop string


class RequestError(Exception):
    """A request the server refuses: HTTP status, a one-line message, and the field at fault (or None).

    kind is the error's type in the OpenAI/Anthropic vocabulary: invalid_request_error, authentication_error,
    not_found_error, request_too_large, overloaded_error, api_error."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code


def bad(message: str, param: str | None = None) -> RequestError:
    """A 400 invalid_request_error."""
    return RequestError(400, message, param)


def _kind(v: Any) -> str:
    """A JSON value's type, as a client would name it."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number" if isinstance(v, (int, float)) else type(v).__name__)


def get(body: dict, key: str, kinds: tuple[type, ...], what: str, default: Any = None, where: str = "") -> Any:
    """body[key] when present and not null, checked against kinds (bool is never a number), else default; where
    names the object that holds the field (e.g. messages[2]) in the error."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise bad(f"'{where + '.' if where else ''}{key}' must be {what}, got {_kind(v)}", key)
    return v


def get_int(body: dict, key: str, lo: int, hi: int | None = None, default: int | None = None) -> int | None:
    """An integer field in [lo, hi] (hi None: no upper bound)."""
    v = get(body, key, (int,), "an integer", default)
    if v is not None and not (v >= lo and (hi is None or v <= hi)):
        want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(f"'{key}' must be an integer {want}, got {v}", key)
    return v


def get_float(body: dict, key: str, lo: float, hi: float, default: float | None = None,
              open_lo: bool = False) -> float | None:
    """A finite number field in [lo, hi] ((lo, hi] with open_lo)."""
    v = get(body, key, (int, float), "a number", default)
    if v is None:
        return None
    try:
        v = float(v)
    except OverflowError:  # an integer past fp64's range: out of every range asked for here
        raise bad(f"'{key}' must be a number in {'(' if open_lo else '['}{lo:g}, {hi:g}], got an integer of "
                  f"{len(str(abs(v)))} digits", key) from None
    if not (math.isfinite(v) and (v > lo if open_lo else v >= lo) and v <= hi):
        raise bad(f"'{key}' must be a number in {'(' if open_lo else '['}{lo:g}, {hi:g}], got {v:g}", key)
    return v


def get_stops(body: dict, key: str) -> list[str]:
    """Stop strings: one string or a list of them, each non-empty."""
    v = body.get(key)
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"'{key}' must be a non-empty string or a list of them", key)
    try:
        "".join(stops).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800") can never match text, which is valid UTF-8
        raise bad(f"'{key}' holds a lone surrogate: not text", key) from None
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(f"'{key}': at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters", key)
    return stops


def check_parts(parts: list, where: str, allowed: tuple[str, ...]) -> list[dict]:
    """Content parts (OpenAI) or blocks (Anthropic): objects of an allowed type, a text one with its text a string.
    Vision is not served: an image, video, audio or document part is refused by name, not silently dropped."""
    for i, part in enumerate(parts):
        if not isinstance(part, dict):
            raise bad(f"{where}[{i}] must be an object", where)
        if not isinstance(part.get("type", "text"), str):
            raise bad(f"{where}[{i}].type must be a string", where)
        kind = parts[i]["type"] = part.get("type", "text")  # a part without a type is text, as before
        if kind in ("image", "image_url", "input_image", "video", "video_url", "input_audio", "document"):
            raise bad(f"{where}[{i}]: '{kind}' content is not supported (this server runs the text model)", where)
        if kind not in allowed:
            raise bad(f"{where}[{i}]: part type {kind!r} is not supported here (expected {', '.join(allowed)})", where)
        if kind == "text" and not isinstance(part.get("text"), str):
            raise bad(f"{where}[{i}].text must be a string", where)
    return parts


@dataclass
class Job:
    """One generation, whichever API asked for it.

    messages (OpenAI chat form, for the chat template) or prompt (text or token ids, used as is); tools in OpenAI
    form [{"type": "function", "function": {name, description, parameters}}], offered to the template and parsed
    out of the reply; template_kwargs reach the template (enable_thinking, preserve_thinking); sampling holds the
    fields the request gave (None: the checkpoint's default); max_tokens None runs to the context's end.
    """

    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    # completions: a batch of two or more prompts, each generated as its own request would be (prompt is the first)
    prompts: list | None = None
    tools: list[dict] | None = None
    template_kwargs: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # OpenAI streams: a last chunk with the token counts
    continue_final: bool = False  # the last (assistant) message is continued, not closed: a prefill
    logprobs: int | None = None  # OpenAI: each output token's logprob and this many alternatives' (None: off)
    echo: bool = False  # completions: the reply starts with the prompt (and its tokens' logprobs, where asked)
    forced_call: str | None = None  # tool_choice forcing a call: "" any of the tools, else that tool's name
    n: int = 1  # OpenAI: choices of the prompt, each its own sequence of the batch
    # OpenAI response_format json_schema (compiled) or json_object (json_schema.JSON_OBJECT): the reply is JSON it
    # accepts, from its first token
    json_schema: Node | None = None
    # special tokens (<|im_start|>, <|image_pad|>, ...) left out of the text, as vLLM does by default; <think> and
    # <tool_call> are not special (the checkpoint's tokenizer says so) and stay for the reply parser
    skip_special_tokens: bool = True


@dataclass
class Prepared:
    """A Job made concrete against the model: token ids, SamplingParams, the token budget, and how to read the
    reply (thinking: the prompt ends inside a <think> block, so the reply starts with reasoning)."""

    ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: list[str]
    thinking: bool
    tools: list[dict] | None
    snapshot_at: int | None = None  # where the chat's history ends (api.generate's snapshot_at)
    logprobs: int | None = None     # Job.logprobs
    echo: str | None = None         # the prompt's text, where the Job echoes it
    prompt_logprobs: int | None = None  # Batch.add's: the prompt's logprobs (echo with logprobs)
    reply_prefix: str = ""  # the reply's start written into the prompt (a forced tool call's opening)
    json_schema: Node | None = None  # Batch.add's: the reply is constrained to JSON this schema accepts
    skip_special_tokens: bool = True  # Job's


def each_prompt(job: Job) -> list[Job]:
    """The Job of each prompt of a batched completion (the Job itself where it has one prompt)."""
    if not job.prompts:
        return [job]
    return [dataclasses.replace(job, prompt=p, prompts=None) for p in job.prompts]


def choice_prepared(prepared: Prepared, i: int) -> Prepared:
    """Choice i of a request's n: its own random stream, seed + i where the request gave a seed (choice 0 is the
    request alone; without a seed every choice's sampler draws fresh entropy)."""
    seed = prepared.sampling.seed
    if i == 0 or seed is None:
        return prepared
    return dataclasses.replace(prepared, sampling=dataclasses.replace(prepared.sampling, seed=(seed + i) % 2**64))


class Reply(Protocol):
    """What a front end builds from a generation (openai.ChatReply, openai.CompletionReply,
    anthropic.MessagesReply), constructed as Reply(model_name, prepared, job). Each method returns the stream's
    frames (bytes of server-sent events) and keeps what it saw for body()."""

    def start(self) -> list[bytes]:
        """The stream's opening frames, sent as the stream opens (before the request has joined the batch)."""

    def admitted(self, cached_tokens: int) -> list[bytes]:
        """Frames once the generation has joined the batch, when it is known how many prompt tokens came from a
        cache (before any text)."""

    def events(self, events: list) -> list[bytes]:
        """Frames for replies.Event items as they come (reasoning, text, tool calls)."""

    def add_logprobs(self, entries: list, token_bytes, text_bytes) -> None:
        """Output tokens' logprobs.TokenLogprob entries (only where the Job asked for logprobs), to go out with
        the next frame and in body(); token_bytes(id) -> the bytes a token stands for (a special one's text too),
        text_bytes(id) -> what it adds to the reply's text (b"" for a special one the text skips)."""

    def finish(self, stats) -> list[bytes]:
        """The stream's closing frames, from the run's GenerationStats (finish reason, usage)."""

    def body(self, stats) -> dict:
        """The whole reply as one JSON object (a request without stream)."""


def forced_call(tools: list[dict] | None, name: str, field: str) -> str:
    """A tool_choice that forces a call ("" any tool, else one by name), checked against the tools offered."""
    names = [t["function"]["name"] for t in tools or ()]
    if not names:
        raise bad(f"{field} forces a tool call: give tools", field)
    if name and name not in names:
        raise bad(f"{field} names {name!r}, which is not among the tools ({', '.join(names)})", field)
    return name


def call_opening(name: str) -> str:
    """The start of a Qwen3.6 tool call the model is made to continue: the block and, for a named tool, its
    function tag (the model writes the parameters); for any tool, up to the name (the model picks one)."""
    return "<tool_call>\n<function=" + (f"{name}>\n" if name else "")


def prompt_text(model, job: Job, generation_prompt: bool = True) -> str | None:
    """The rendered chat prompt of a messages job (None for a raw prompt); NinferError from the template becomes
    a 400 naming it. generation_prompt False: the history alone, without the assistant turn's opening. A forced
    tool call ends the prompt inside the call (call_opening), its reasoning closed empty, as the template writes
    it with thinking off: a call made to come first has nothing to think before it. A JSON reply (json_object,
    json_schema) closes the reasoning the same way: the JSON starts at the reply's first token."""
    if job.messages is None:
        return None
    prefill = job.continue_final and generation_prompt  # the text ends inside the final assistant message
    try:
        text = model.chat_template.render(job.messages, tools=job.tools, continue_final_message=prefill,
                                          add_generation_prompt=generation_prompt and not prefill,
                                          **job.template_kwargs)
    except NinferError as e:
        raise bad(f"messages: {e}", "messages") from None
    if prefill:
        return text
    if generation_prompt and (job.forced_call is not None or job.json_schema is not None):
        if text.rstrip("\n").endswith("<think>"):  # the reply is the call or the object from its first token
            text = text.rstrip("\n") + "\n\n</think>\n\n"
        if job.forced_call is not None:
            text += call_opening(job.forced_call)
    return text


def too_long(tokens: int, context: int, param: str, at_least: bool = False) -> RequestError:
    """A prompt past the context, in the words clients match: Anthropic's "prompt is too long", OpenAI's code."""
    return RequestError(400, f"prompt is too long: {'at least ' if at_least else ''}{tokens} tokens > {context - 1} "
                             f"maximum (the context holds {context}, prompt and output together)", param,
                        code="context_length_exceeded")


def prompt_ids(model, job: Job, context: int | None = None) -> tuple[str | None, list[int]]:
    """(the rendered chat prompt or None, its token ids): whatever its length (count_tokens), or with context a
    text too long to fit refused before it is tokenized; 400 for what cannot be rendered or tokenized."""
    text = prompt_text(model, job)
    whole = text if text is not None else job.prompt
    if context is not None and isinstance(whole, str):
        least = model.tokenizer.least_tokens(whole)
        if least >= context:
            raise too_long(least, context, "messages" if text is not None else "prompt", at_least=True)
    elif context is not None and isinstance(whole, list) and len(whole) >= context:  # token ids, as many tokens
        raise too_long(len(whole), context, "prompt")
    try:
        return text, model.prompt_ids(whole)  # token ids are checked there
    except NinferError as e:
        raise bad(str(e), "messages" if text is not None else "prompt") from None


def history_length(model, job: Job, ids: list[int]) -> int | None:
    """Tokens of the chat's history (the prompt without the generation prompt) when they begin ids: where the
    next turn's prompt, which re-renders this turn's reply without its reasoning, stops sharing this one."""
    text = prompt_text(model, job, generation_prompt=False) if not job.continue_final else None
    if text is None:
        return None
    history = model.tokenizer.encode(text)
    return len(history) if 0 < len(history) < len(ids) and ids[:len(history)] == history else None


def prepare(model, job: Job) -> Prepared:
    """Render and tokenize a Job, check it against the context, and fix its sampling (400 on any problem)."""
    context = model.context_length
    text, ids = prompt_ids(model, job, context)
    try:
        sampling = requested_sampling(model.generation_config, **job.sampling)
    except NinferError as e:
        raise bad(str(e)) from None
    if len(ids) >= context:
        raise too_long(len(ids), context, "messages" if text is not None else "prompt")
    budget = context - len(ids)
    if job.max_tokens == 0 and not job.echo:
        raise bad("max_tokens 0 generates nothing: it needs echo (the prompt's logprobs)", "max_tokens")
    thinking = text is not None and text.rstrip("\n").endswith("<think>")
    echo = (job.prompt if isinstance(job.prompt, str) else model.tokenizer.decode(ids)) if job.echo else None
    scored = job.echo and job.logprobs is not None
    # a JSON reply holds no tool call: its text is not searched for one
    return Prepared(ids, sampling, budget if job.max_tokens is None else min(job.max_tokens, budget), job.stop,
                    thinking, None if job.json_schema is not None else job.tools,
                    history_length(model, job, ids) if model.can_snapshot else None,
                    job.logprobs, echo, (job.logprobs or 0) if scored else None,
                    call_opening(job.forced_call) if job.forced_call is not None else "", job.json_schema,
                    job.skip_special_tokens)
