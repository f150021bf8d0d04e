"""Chat rendering with the checkpoint's own Jinja template, in the locked-down environment of ninfer_rt.sandbox.

Everything the template sees is rebuilt from plain JSON types first, and the messages' shape is checked before it
runs, so an error names the message at fault. Output matches `transformers`' apply_chat_template.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError

from ninfer_rt import sandbox
from ninfer_rt.errors import NinferError
from ninfer_rt.tokenizer import _load_json, _token_text

# Names under which callers pass a message's reasoning, first wins; templates read `reasoning_content` (gpt-oss:
# `thinking`).
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_MARK = "\ue000ninfer-end\ue001"  # private-use characters: no template trims or rewrites them
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _plain(value: Any) -> Any:
    """Deep copy of value in plain JSON types; anything else becomes an inert '<TypeName>' placeholder.

    Rich objects (arrays, images, enums) carry methods the sandbox cannot judge, and templates only test media
    keys for presence, so replacing them changes no rendering.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [_plain(v) for v in value]
        return out if isinstance(value, list) else tuple(out)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)  # pydantic models (messages, tool calls), as transformers takes them
    if callable(dump) and not isinstance(value, type):
        return _plain(dump())
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and getattr(value, "shape", None) == ():
        return _plain(item())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict) -> dict:
    """Fill `reasoning_content` (and `thinking`) from whichever reasoning key the caller used."""
    reasoning = next((message[k] for k in REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _one_line(e: BaseException) -> str:
    """First line of an exception's message, with the template line number when jinja knows it."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    lineno = getattr(e, "lineno", None)
    return f"{text} (template line {lineno})" if lineno else text


def _brief(value: Any) -> str:
    """A value for a one-line message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_messages(messages: Any) -> None:
    """The shape every template expects, checked before it runs so the message names the culprit: a list of dicts
    with a string role; content a string, None or a list of part dicts; tool_calls a list of dicts."""
    if not isinstance(messages, (list, tuple)):
        raise NinferError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise NinferError(f"messages[{i}] must be a dict with a role, got {_brief(m)}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise NinferError(f"messages[{i}].role must be a non-empty string, got {_brief(m.get('role'))}")
        content = m.get("content")
        if not (content is None or isinstance(content, str)
                or (isinstance(content, (list, tuple)) and all(isinstance(p, dict) for p in content))):
            raise NinferError(f"messages[{i}].content must be a string, None or a list of part dicts, got "
                              f"{_brief(content)}")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, (list, tuple)) and all(isinstance(c, dict) for c in calls)):
            raise NinferError(f"messages[{i}].tool_calls must be a list of dicts, got {_brief(calls)}")


def load_chat_template(resources: dict[str, bytes], name: str = "default") -> tuple[str, str]:
    """(template source, where it came from): chat_template.jinja, else tokenizer_config.json's chat_template
    (a string, or a list of {name, template} from which `name` is taken), else chat_template.json's."""
    return _select_template(resources, _load_json(resources, "tokenizer_config.json"), name)


def _select_template(resources: dict[str, bytes], config: dict, name: str) -> tuple[str, str]:
    """load_chat_template on an already parsed tokenizer_config.json."""
    if "chat_template.jinja" in resources and name == "default":
        try:
            return resources["chat_template.jinja"].decode("utf-8"), "chat_template.jinja"
        except UnicodeDecodeError as e:
            raise NinferError(f"chat_template.jinja: not UTF-8 text ({e})") from e
    entry = config.get("chat_template")
    origin = "tokenizer_config.json chat_template"
    if isinstance(entry, str) and name == "default":
        return entry, origin
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        if isinstance(named.get(name), str):
            return named[name], f"{origin}[{name!r}]"
        raise NinferError(f"{origin}: no template named {name!r} (have {sorted(map(str, named))})")
    if entry is not None and not isinstance(entry, str):
        raise NinferError(f"{origin}: expected a string or a list of named templates, got {type(entry).__name__}")
    if name != "default":
        raise NinferError(f"{origin}: no template named {name!r}")
    if "chat_template.json" in resources:  # the processors' older file, which transformers' processors still read
        legacy = _load_json(resources, "chat_template.json").get("chat_template")
        if not isinstance(legacy, str):
            raise NinferError(f"chat_template.json: expected a string chat_template, got {type(legacy).__name__}")
        return legacy, "chat_template.json"
    raise NinferError("chat template: missing (no chat_template.jinja, no chat_template in tokenizer_config.json, "
                      "no chat_template.json)")


class ChatTemplate:
    """A compiled, sandboxed chat template."""

    def __init__(self, source: str, origin: str = "chat template", special_tokens: dict[str, str] | None = None):
        """Compile source; `origin` names it in error messages; special_tokens (bos_token, ...) reach the
        template as variables, as in transformers."""
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = sandbox.environment().from_string(source)
        except TemplateSyntaxError as e:
            raise NinferError(f"{origin}: syntax error: {_one_line(e)}") from e
        except RecursionError:  # jinja's parser recurses once a nesting level
            raise NinferError(f"{origin}: nests too deeply to compile") from None

    @classmethod
    def from_resources(cls, resources: dict[str, bytes], name: str = "default") -> ChatTemplate:
        """The checkpoint's template (see `load_chat_template`) with its special tokens."""
        config = _load_json(resources, "tokenizer_config.json")
        source, origin = _select_template(resources, config, name)
        # bos/eos/unk/pad strings reach the template as variables, as in transformers
        tokens = {key: _token_text(config.get(key)) for key in _SPECIAL_TOKEN_KEYS}
        return cls(source, origin, {key: text for key, text in tokens.items() if text is not None})

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False,
               enable_thinking: bool | None = None, documents: list[dict] | None = None,
               continue_final_message: bool = False, **kwargs: Any) -> str:
        """The prompt text for messages. enable_thinking=None leaves the template's default; other keyword
        arguments (preserve_thinking, add_vision_id, ...) reach the template unchanged. continue_final_message:
        the text ends inside the final (assistant) message, so that generation continues it (a prefill)."""
        try:
            if isinstance(messages, (list, tuple)):
                messages = _plain(list(messages))  # dataclass and pydantic messages become dicts, as in transformers
            if continue_final_message:
                if add_generation_prompt:
                    raise NinferError("continue_final_message continues the last message: add_generation_prompt "
                                      "must be false")
                return self._open_final(messages, tools, enable_thinking, documents, kwargs)
            return self._render(messages, tools, add_generation_prompt, enable_thinking, documents, kwargs)
        except RecursionError:  # a message nested (or referring to itself) beyond any template's reach
            raise NinferError(f"{self.origin}: the messages or arguments nest too deeply") from None

    def _open_final(self, messages, tools, enable_thinking, documents, kwargs) -> str:
        """The render cut right after the final message's text (its last text part's), found by a mark written
        after it, as transformers does: the same words may stand in the template's closing tokens (a prefill "im"
        in "<|im_end|>"). The mark ends in a space: where the template trims it away, it trims the text too (Qwen's
        do), so the text's trailing whitespace goes."""
        _check_messages(messages)
        last = messages[-1] if messages else None
        content = last.get("content") if isinstance(last, dict) else None
        if not (isinstance(last, dict) and last.get("role") == "assistant"
                and (content.strip() if isinstance(content, str) else content)):
            raise NinferError("to continue the final message it must be an assistant message with text")
        mark = _MARK + " "
        if isinstance(content, str):
            marked = content + mark
        else:
            at = next((i for i in reversed(range(len(content)))
                       if isinstance(content[i], dict) and isinstance(content[i].get("text"), str)), None)
            if at is None:
                raise NinferError("to continue the final message it must have a text part")
            marked = [*content[:at], {**content[at], "text": content[at]["text"] + mark}, *content[at + 1:]]
        text = self._render([*messages[:-1], {**last, "content": marked}], tools, False, enable_thinking, documents,
                            dict(kwargs))
        at = text.rfind(_MARK)
        if at < 0:
            raise NinferError("the chat template does not show the final assistant message's text: it cannot be "
                              "continued")
        return text[:at] if text.startswith(mark, at) else text[:at].rstrip()

    def _render(self, messages, tools, add_generation_prompt, enable_thinking, documents, kwargs) -> str:
        """render, whose RecursionError the caller turns into one line."""
        _check_messages(messages)
        for name, value in (("tools", tools), ("documents", documents)):
            if value is not None and not (isinstance(value, (list, tuple)) and all(isinstance(t, dict) and t
                                                                                   for t in value)):
                raise NinferError(f"{name} must be a list of non-empty dicts (JSON schemas for tools), got "
                                  f"{_brief(value)}")
        if enable_thinking is not None and not isinstance(enable_thinking, bool):
            raise NinferError(f"enable_thinking must be True, False or None, got {enable_thinking!r}")
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        variables = {**self.special_tokens, **kwargs}
        chat = [_with_reasoning_aliases(m) for m in messages]
        try:
            return sandbox.render(self._template, messages=chat, tools=_plain(tools), documents=_plain(documents),
                                  add_generation_prompt=add_generation_prompt, **_plain(variables))
        except RecursionError:
            raise  # render's caller says it in one line, not as the template's own failure
        except SecurityError as e:
            raise NinferError(f"{self.origin}: blocked by the sandbox: {_one_line(e)}") from e
        except TemplateError as e:
            raise NinferError(f"{self.origin}: {_one_line(e)}") from e
        except Exception as e:  # the template is foreign code: any failure inside it is the checkpoint's fault
            raise NinferError(f"{self.origin}: {type(e).__name__}: {_one_line(e)}") from e

