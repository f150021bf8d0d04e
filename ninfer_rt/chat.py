"""Chat rendering with the checkpoint's own Jinja template, inside a locked-down sandbox.

The template is code downloaded with the checkpoint, so it runs in jinja2's ImmutableSandboxedEnvironment with
one change: an unsafe attribute (`__class__`, `__mro__`, `__subclasses__`, ...) raises instead of quietly
rendering as undefined, and everything the template sees is rebuilt from plain JSON types first. The helpers and
settings are those Hugging Face templates are written against (trim_blocks, lstrip_blocks, loopcontrols,
`raise_exception`, `tojson` without ASCII escaping, `strftime_now`, `namespace`, `dict`), so output matches
`transformers`' apply_chat_template.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer_rt.errors import NinferError

# Names under which callers pass a message's reasoning; templates read `reasoning_content` (gpt-oss: `thinking`).
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment where touching an unsafe attribute is an error, not a silent undefined."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        """Refuse the access outright, so an escape attempt stops the render with a SecurityError."""
        raise SecurityError(f"access to attribute {attribute!r} on {type(obj).__name__} is not allowed")


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, so templates cannot plant dunders on it."""

    def __init__(*args: Any, **kwargs: Any):  # noqa: N805 - jinja's signature trick keeps `self=` usable as a key
        """Create with initial attributes, each checked."""
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for key in attrs:
            _Namespace._check(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, key: str, value: Any) -> None:
        """`{% set ns.key = value %}`, checked."""
        _Namespace._check(key)
        jinja2.utils.Namespace.__setitem__(self, key, value)

    @staticmethod
    def _check(key: Any) -> None:
        if isinstance(key, str) and key.startswith("_"):
            raise SecurityError(f"namespace attribute {key!r} starts with an underscore")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        """Parse the block and call `_body` on it."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    """Template helper: abort the render with the template's own message."""
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """Template filter: JSON text without HTML escaping or ASCII escaping (jinja's own tojson does both)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """Template helper: the current local time formatted with strftime."""
    return datetime.now().strftime(fmt)


class _DictHelper:
    """Template global `dict`: builds plain dicts without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        """dict(...)"""
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        """dict.fromkeys(...)"""
        return dict.fromkeys(*args)


def _environment() -> _StrictSandbox:
    """The sandbox with the settings and helpers Hugging Face chat templates expect."""
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                       dict=_DictHelper())
    return env


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
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [_plain(v) for v in value]
        return out if isinstance(value, list) else tuple(out)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and getattr(value, "shape", None) == ():
        return _plain(item())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict) -> dict:
    """Fill `reasoning_content` (and `thinking`) from whichever reasoning key the caller used."""
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _one_line(e: BaseException) -> str:
    """First line of an exception's message, with the template line number when jinja knows it."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    lineno = getattr(e, "lineno", None)
    return f"{text} (template line {lineno})" if lineno else text


def load_chat_template(resources: dict[str, bytes], name: str = "default") -> tuple[str, str]:
    """(template source, where it came from): chat_template.jinja, else tokenizer_config.json's chat_template
    (a string, or a list of {name, template} from which `name` is taken)."""
    if "chat_template.jinja" in resources and name == "default":
        try:
            return resources["chat_template.jinja"].decode("utf-8"), "chat_template.jinja"
        except UnicodeDecodeError as e:
            raise NinferError(f"chat_template.jinja: not UTF-8 text ({e})") from e
    raw = resources.get("tokenizer_config.json")
    entry = None
    if raw is not None:
        try:
            config = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise NinferError(f"tokenizer_config.json: malformed JSON ({e})") from e
        entry = config.get("chat_template") if isinstance(config, dict) else None
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
    raise NinferError("chat template: missing (no chat_template.jinja and no chat_template in tokenizer_config.json)")


def _special_tokens(resources: dict[str, bytes]) -> dict[str, str]:
    """bos/eos/unk/pad token strings from tokenizer_config.json, passed to the template as HF does."""
    try:
        config = json.loads(resources.get("tokenizer_config.json", b"{}"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NinferError(f"tokenizer_config.json: malformed JSON ({e})") from e
    out = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


class ChatTemplate:
    """A compiled, sandboxed chat template."""

    def __init__(self, source: str, origin: str = "chat template", special_tokens: dict[str, str] | None = None):
        """Compile source; `origin` names it in error messages; special_tokens (bos_token, ...) reach the
        template as variables, as in transformers."""
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except TemplateSyntaxError as e:
            raise NinferError(f"{origin}: syntax error: {_one_line(e)}") from e

    @classmethod
    def from_resources(cls, resources: dict[str, bytes], name: str = "default") -> ChatTemplate:
        """The checkpoint's template (see `load_chat_template`) with its special tokens."""
        source, origin = load_chat_template(resources, name)
        return cls(source, origin, _special_tokens(resources))

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False,
               enable_thinking: bool | None = None, documents: list[dict] | None = None, **kwargs: Any) -> str:
        """The prompt text for messages. enable_thinking=None leaves the template's default; other keyword
        arguments (preserve_thinking, add_vision_id, ...) reach the template unchanged."""
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
            raise NinferError(f"{self.origin}: messages must be a list of dicts")
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise NinferError(f"{self.origin}: tools must be a list of JSON-schema dicts")
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        variables = {**self.special_tokens, **kwargs}
        chat = [_with_reasoning_aliases(m) for m in _plain(list(messages))]
        try:
            return self._template.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                         add_generation_prompt=add_generation_prompt, **_plain(variables))
        except SecurityError as e:
            raise NinferError(f"{self.origin}: blocked by the sandbox: {_one_line(e)}") from e
        except TemplateError as e:
            raise NinferError(f"{self.origin}: {_one_line(e)}") from e
        except Exception as e:  # the template is foreign code: any failure inside it is the checkpoint's fault
            raise NinferError(f"{self.origin}: {type(e).__name__}: {_one_line(e)}") from e


def render_chat(resources: dict[str, bytes], messages: list[dict], **kwargs: Any) -> str:
    """One-shot: load the checkpoint's template from resources and render messages (kwargs as `render`)."""
    return ChatTemplate.from_resources(resources).render(messages, **kwargs)
