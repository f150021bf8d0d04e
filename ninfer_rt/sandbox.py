"""The locked-down Jinja environment chat templates run in (ninfer_rt.chat renders with it).

A chat template is code downloaded with the checkpoint, so it runs in jinja2's ImmutableSandboxedEnvironment with
these changes:
- an unsafe attribute (`__class__`, `__mro__`, `__subclasses__`, ...) raises instead of quietly rendering as
  undefined;
- an operation that would build something huge from a short expression (`'a' * 10**9`, `10 ** (10**8)`,
  `'%999999999s' % ''`, `''.ljust(10**9)`, `''|center(10**9)`) is refused before it runs;
- a render has a budget (`render`): loop iterations and calls, what `~`, `+`, `join` and the list-building filters
  build, and the text written (to the output or into a block); any value turned into text (output, `~`, `join`, a
  filter's input, `%` and `format` arguments, `tojson`) and the growing str methods (replace, join, translate) are
  sized first, containers walked, so a list holding one long string many times cannot be printed; and, as a
  backstop, a render stops after 10 s or 2 GiB of resident growth. Nested loops, recursion or a string doubled in
  a loop end in an error instead of a hang or an out-of-memory kill.
The helpers and settings are those Hugging Face templates are written against (trim_blocks, lstrip_blocks,
loopcontrols, `raise_exception`, `tojson` without ASCII escaping, `strftime_now`, `namespace`, `dict`), so output
matches `transformers`' apply_chat_template.
"""

from __future__ import annotations

import collections.abc
import contextvars
import functools
import json
import os
import re
import string
import time
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.runtime
import jinja2.utils
import jinja2.visitor
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from markupsafe import soft_str

# What one template operation may build. Real chat templates stay orders of magnitude below both: a prompt is
# assembled by concatenation, which these limits leave alone.
_MAX_ITEMS = 1_000_000  # characters or list items added by one repetition, padding width or fill count
_MAX_INT_BITS = 1 << 16  # ~19,700 decimal digits, far past anything a template computes
# What one render may do in all. A Qwen3.6 prompt of a full 262,144-token context is ~1 M characters and its
# template loops a few times per message and content part: these are far above that and far below a hang.
_MAX_LOOP_STEPS = 1_000_000  # iterations of every {% for %} and calls (macros, methods, recursive loops) together
_MAX_TEXT = 1 << 26          # characters of any one string built by ~, + or join, or written by one {{ }}
_ITEM = 8                    # a list item against a per-value cap in characters: the pointer a copy moves
_MAX_SECONDS = 10.0          # a render's wall time (a long conversation renders in well under a second)
_MAX_RSS_GROWTH = 2 << 30    # what a render may add to the process's resident memory
_MAX_EMITTED = 1 << 27       # characters written in all, to the output and into blocks: bounds the memory
# A printf conversion: optional (key), flags, width, .precision, length modifier, type.
_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?[a-zA-Z%]")
_DIGITS = re.compile(r"\d+")
# Names every template sees (jinja's own and transformers' helpers): a caller's variable must not replace one.
TEMPLATE_HELPERS = frozenset({"range", "dict", "lipsum", "cycler", "joiner", "namespace", "raise_exception",
                              "strftime_now"})


def _refuse_over(items: Any, what: str) -> None:
    """SecurityError when an operation would add more than _MAX_ITEMS items (non-ints are not sizes: skip)."""
    if isinstance(items, int) and items > _MAX_ITEMS:
        raise SecurityError(f"{what} would build more than {_MAX_ITEMS:,} items")


def _refuse_wide(digits: str, what: str) -> None:
    """SecurityError for a width or precision written in a format string beyond _MAX_ITEMS."""
    if digits.isdigit() and (len(digits) > len(str(_MAX_ITEMS)) or int(digits) > _MAX_ITEMS):
        raise SecurityError(f"{what} width {digits[:12]} exceeds {_MAX_ITEMS:,}")


def _text_size(value: Any, limit: int = _MAX_TEXT) -> int:
    """An upper estimate of len(str(value)), containers walked (a string held many times counted each time),
    stopping once it passes limit: every node visited adds at least 2, so a walk takes at most limit / 2 steps."""
    total, todo = 0, [value]
    while todo and total <= limit:
        v = todo.pop()
        if isinstance(v, str):
            total += len(v) + 4  # its quotes and a separator in a container's repr
        elif isinstance(v, collections.abc.Mapping):
            total += 2 + 2 * len(v)
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (bytes, bytearray)):
            total += 4 * len(v) + 3
        elif isinstance(v, collections.abc.Collection):  # lists, tuples, sets, ranges, dict views
            total += 2 + len(v)
            todo.extend(v)
        elif isinstance(v, jinja2.utils.Namespace):
            total += 16
            todo.append(dict(object.__getattribute__(v, "_Namespace__attrs")))  # what its repr prints
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2  # its decimal digits, at most
        else:
            total += 32  # a float, None, a bool: a few characters
    return total


def _refuse_text(value: Any, what: str) -> None:
    """SecurityError when value, turned into text, would pass _MAX_TEXT characters (strings are measured directly)."""
    size = len(value) if isinstance(value, str) else _text_size(value)
    if size > _MAX_TEXT:
        raise SecurityError(f"{what} would write more than {_MAX_TEXT:,} characters")


class _Budget:
    """What is left of one render's budget (_MAX_LOOP_STEPS, _MAX_EMITTED) and its time and memory backstops."""

    def __init__(self) -> None:
        self.steps, self.emitted = _MAX_LOOP_STEPS, _MAX_EMITTED
        self.deadline, self.rss0 = time.monotonic() + _MAX_SECONDS, _rss()

    def guard(self) -> None:
        """The render's wall time and what it added to resident memory, checked every 256 steps and large values."""
        if time.monotonic() > self.deadline:
            raise SecurityError(f"the render ran longer than {_MAX_SECONDS:.0f} s")
        if _rss() - self.rss0 > _MAX_RSS_GROWTH:
            raise SecurityError(f"the render grew the process by more than {_MAX_RSS_GROWTH >> 30} GiB")

    def step(self, what: str) -> None:
        """Charge one loop iteration or call."""
        self.steps -= 1
        if self.steps < 0:
            raise SecurityError(f"the render ran more than {_MAX_LOOP_STEPS:,} loop iterations and calls ({what})")
        if self.steps % 256 == 0:
            self.guard()

    def build(self, size: int, what: str, cap: int = _MAX_TEXT) -> None:
        """A value of `size` characters (lists: _ITEM a item) about to be built: refused past cap; a large one
        is also a moment to check the time and memory (copies add up quadratically, their sum is not capped)."""
        if size > cap:
            raise SecurityError(f"{what} would build a value of more than {cap:,} items")
        if size >= 1 << 16:
            self.guard()

    def emit(self, size: int) -> None:
        """Charge text written to the output or to a block ({% set %}, a macro, a call block)."""
        if size > _MAX_TEXT:
            raise SecurityError(f"one output value is longer than {_MAX_TEXT:,} characters")
        self.emitted -= size
        if self.emitted < 0:
            raise SecurityError(f"the render wrote more than {_MAX_EMITTED:,} characters in all")


def _rss() -> int:
    """The process's resident memory in bytes (Linux /proc; elsewhere its peak, from getrusage; else 0)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        except (ImportError, OSError):
            return 0


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("ninfer_chat_budget")


def _budget() -> _Budget:
    """The running render's budget (ChatTemplate.render sets one); a fresh one, not kept, outside a render."""
    return _BUDGET.get(None) or _Budget()


# The budget's filters take the context, so jinja never runs them at compile time (it folds constant expressions
# through filters that take the eval context or nothing, and the literal text would then go uncharged).
@jinja2.pass_context
def _loop_steps(_ctx: Any, iterable: Any) -> Any:
    """Filter around every for loop's iterable (and a recursive loop's `loop(...)`): each iteration is charged."""
    b = _budget()
    for item in iterable:
        b.step("a loop")
        yield item


@jinja2.pass_context
def _concat(_ctx: Any, parts: list) -> str:
    """`a ~ b ~ ...` (jinja's Concat), its length charged before the join."""
    for p in parts:
        if not isinstance(p, str):
            _refuse_text(p, "'~'")
    strs = [soft_str(p) for p in parts]
    _budget().build(sum(map(len, strs)), "'~'")
    return "".join(strs)


@jinja2.pass_context
def _emit(_ctx: Any, value: Any) -> Any:
    """Filter around every piece of output, literal text included: its length is charged."""
    if not isinstance(value, str):
        _refuse_text(value, "'{{ }}'")
    _budget().emit(len(value if isinstance(value, str) else soft_str(value)))
    return value


class _Budgeted(jinja2.visitor.NodeTransformer):
    """Rewrites a parsed template so that loops, `~` and every piece of output pass through the budget."""

    @staticmethod
    def _filter(node: jinja2.nodes.Expr, name: str, lineno: int) -> jinja2.nodes.Filter:
        return jinja2.nodes.Filter(node, name, [], [], None, None, lineno=lineno)

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.iter = self._filter(node.iter, "_ninfer_loop_steps", node.lineno)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        self.generic_visit(node)
        return self._filter(jinja2.nodes.List(node.nodes, lineno=node.lineno), "_ninfer_concat", node.lineno)

    def visit_Output(self, node: jinja2.nodes.Output) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.nodes = [self._filter(n, "_ninfer_emit", node.lineno) for n in node.nodes]
        return node


def _check_binop(op: str, left: Any, right: Any) -> None:
    """Refuse `*`, `**` and `%` whose result would be huge, before Python allocates (or computes) it."""
    if op == "*":
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                raise SecurityError(f"'*' would build an integer over {_MAX_INT_BITS} bits")
            return
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                _refuse_over(len(seq) * n, "'*' repetition")
                _budget().build(max(0, len(seq) * n) * (1 if isinstance(seq, str) else _ITEM), "'*'", 1 << 62)
    elif op == "**":
        # |a ** b| >= 2 ** ((bits(a) - 1) * b): cheap to evaluate even when b is astronomically large
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 \
                and (abs(left).bit_length() - 1) * right >= _MAX_INT_BITS:
            raise SecurityError(f"'**' would build an integer over {_MAX_INT_BITS} bits")
    elif op == "%" and isinstance(left, str):
        _check_printf(left, right)
        _budget().build(_printf_size(left, right), "'%'")
    elif op == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        # a list item is charged as _ITEM characters, at most _MAX_ITEMS of them in one list
        n = len(left) + len(right)
        if isinstance(left, str):
            _budget().build(n, "'+'")
        else:
            _budget().build(_ITEM * n, "'+'", _ITEM * _MAX_ITEMS)


def _printf_size(fmt: str, args: Any) -> int:
    """An upper estimate of len(fmt % args): each conversion writes at most its width or the largest argument."""
    values = list(args.values()) if isinstance(args, collections.abc.Mapping) else \
        list(args) if isinstance(args, tuple) else [args]
    widest = max([_text_size(v) for v in values] + [0])
    widths = [int(d) for m in _PRINTF.finditer(fmt) for d in m.groups() if d and d.isdigit()]
    return len(fmt) + len(_PRINTF.findall(fmt)) * max([widest, *widths])


def _format_size(fmt: str, args: tuple, kwargs: dict) -> int:
    """An upper estimate of len(fmt.format(*args, **kwargs)): each field writes at most its width or the
    largest argument."""
    widest = max([_text_size(v) for v in (*args, *kwargs.values())] + [0])
    fields = [spec for _, name, spec, _ in string.Formatter().parse(fmt) if name is not None]
    widths = [int(d) for spec in fields for d in _DIGITS.findall(spec or "")]
    return len(fmt) + len(fields) * max([widest, *widths])


def _check_printf(fmt: str, args: Any) -> None:
    """Refuse a printf-style format whose width or precision (written, or taken by `*` from args) is huge."""
    values = args if isinstance(args, tuple) else (args,)
    for m in _PRINTF.finditer(fmt):
        for spec in m.groups():
            if spec == "*":
                for v in values:
                    _refuse_over(abs(v) if isinstance(v, int) else 0, "'%' with a '*' width")
            elif spec:
                _refuse_wide(spec, "'%' format")


def _check_format_spec(fmt: str) -> None:
    """Refuse a str.format template with a huge field width; a nested `{}` width cannot be checked, so is refused."""
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is not None and spec:
            if "{" in spec:
                raise SecurityError("str.format: a replacement field inside a format spec is not allowed")
            for digits in _DIGITS.findall(spec):
                _refuse_wide(digits, "str.format")


def _lines(s: Any) -> int:
    return s.count("\n") + 1 if isinstance(s, str) else 1


def _pad_growth(s: Any, width: Any = 0, *_: Any) -> Any:
    """ljust / rjust / center / zfill (methods and the center filter): up to `width` characters."""
    return width


def _tabs_growth(s: Any, tabsize: Any = 8) -> Any:
    """expandtabs: up to `tabsize` characters per tab."""
    return tabsize * s.count("\t") if isinstance(tabsize, int) else 0


def _indent_growth(s: Any, width: Any = 4, *_: Any, **__: Any) -> Any:
    """indent filter: the indent (a count or a string) on every line."""
    return (len(width) if isinstance(width, str) else width) * _lines(s) if isinstance(width, (str, int)) else 0


def _fill_growth(value: Any, count: Any = 0, *_: Any, **kwargs: Any) -> Any:
    """batch / slice filters: `linecount` / `slices` lists, padded with fill_with up to that many items."""
    return kwargs.get("linecount", kwargs.get("slices", count))


# Items each sizing call adds, from its arguments (methods get the string, filters the filtered value, first).
_STR_METHOD_GROWTH = {"ljust": _pad_growth, "rjust": _pad_growth, "center": _pad_growth, "zfill": _pad_growth,
                      "expandtabs": _tabs_growth}
_FILTER_GROWTH = {"center": _pad_growth, "indent": _indent_growth, "batch": _fill_growth, "slice": _fill_growth}


def _check_growth(grow: Any, what: str, *args: Any, **kwargs: Any) -> None:
    """Run a growth estimate and refuse a huge one; arguments the estimate cannot bind are left to the call."""
    try:
        items = grow(*args, **kwargs)
    except TypeError:
        return
    _refuse_over(items, what)


# Filters that build a list from any iterable (a range, a generator): each item is charged as _ITEM characters.
_LIST_FILTERS = ("list", "sort", "unique", "reverse", "dictsort", "groupby")


# Filters that turn their input into text: a container input is sized first (_refuse_text).
_TEXT_FILTERS = ("capitalize", "e", "escape", "forceescape", "lower", "pprint", "safe", "string",
                 "striptags", "title", "trim", "truncate", "upper", "urlencode", "urlize", "wordcount", "wordwrap")


def _sized_filter(name: str, f: Any) -> Any:
    """jinja's filter `name`, refusing a container input whose text would pass _MAX_TEXT (a string passes as is)."""

    @functools.wraps(f)
    def sized(*args: Any, **kwargs: Any) -> Any:
        value = args[1] if getattr(f, "jinja_pass_arg", None) is not None else args[0]
        if not isinstance(value, str):
            _refuse_text(value, f"filter {name}")
        return f(*args, **kwargs)

    return sized


def _charged_filter(name: str, f: Any) -> Any:
    """jinja's filter `name` with the list it built charged to the render's budget (after: its input is bounded)."""

    @functools.wraps(f)
    def charged(*args: Any, **kwargs: Any) -> Any:
        out = f(*args, **kwargs)
        if isinstance(out, (list, tuple)):
            _budget().build(_ITEM * len(out), f"filter {name}", _ITEM * _MAX_ITEMS)
        return out

    return charged


def _guarded_filter(name: str, f: Any) -> Any:
    """jinja's filter `name` with a size check in front (filters are called directly, not through env.call)."""
    grow = _FILTER_GROWTH.get(name)

    @functools.wraps(f)
    def checked(value: Any, *args: Any, **kwargs: Any) -> Any:
        if name == "format":  # `format` is printf: value % args
            _check_printf(soft_str(value), kwargs or args)
            _budget().build(_printf_size(soft_str(value), kwargs or args), "filter format")
        elif name == "replace":  # s.replace(old, new[, count]) sized as the method is (after the eval context)
            if len(args) >= 3:
                _check_str_call(soft_str(args[0]), "replace", (soft_str(args[1]), soft_str(args[2]), *args[3:4]), {})
        elif name == "sum":  # start: a number (a list start joins the lists, quadratically); sum takes the
            start = args[2] if len(args) > 2 else kwargs.get("start", 0)  # environment, iterable, attribute first
            if not isinstance(start, (int, float)):
                raise SecurityError(f"filter sum: start must be a number, got {type(start).__name__}")
        elif name == "join":  # the joined length, before joining (join takes the eval context first)
            ctx, items, rest = value, args[0], list(args[1:])
            sep = rest[0] if rest else kwargs.get("d", "")
            attribute = rest[1] if len(rest) > 1 else kwargs.pop("attribute", None)
            items = list(items)  # a generator (map, select) sized like a list
            if attribute is not None:
                items = [jinja2.filters.make_attrgetter(ctx.environment, attribute)(v) for v in items]
                rest = rest[:1]
            for v in items:
                if not isinstance(v, str):
                    _refuse_text(v, "filter join")
            strs = [soft_str(v) for v in items]
            _budget().build(sum(map(len, strs)) + len(soft_str(sep)) * max(0, len(strs) - 1), "filter join")
            return f(ctx, strs, *rest, **kwargs)
        else:
            _check_growth(grow, f"filter {name}", value, *args, **kwargs)
        return f(value, *args, **kwargs)

    return checked


def _check_str_call(owner: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """str.replace / join / translate sized before they run (args returned, join's iterable as a list)."""
    if name == "join" and args:
        items = list(args[0])
        size = sum(len(v) if isinstance(v, str) else 0 for v in items) + len(owner) * max(0, len(items) - 1)
        args = (items, *args[1:])
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        n = owner.count(args[0]) if args[0] else len(owner) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            n = min(n, args[2])
        size = len(owner) + n * max(0, len(args[1]) - len(args[0]))
    elif name == "translate" and args and isinstance(args[0], collections.abc.Mapping):
        longest = max([len(v) for v in args[0].values() if isinstance(v, str)] + [1])
        size = len(owner) * longest
    else:
        return args
    _budget().build(size, f"str.{name}")
    return args


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment where touching an unsafe attribute is an error, not a silent undefined, and
    operations that could build something huge are size-checked first."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        """Refuse the access outright, so an escape attempt stops the render with a SecurityError."""
        raise SecurityError(f"access to attribute {attribute!r} on {type(obj).__name__} is not allowed")

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        """Parse, then route every loop and `~` through the render's budget (_Budgeted)."""
        return _Budgeted().visit(super()._parse(source, name, filename))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """`*`, `**`, `%`, `+`: refused when the result would be huge or the render's budget is spent (see
        _check_binop), else computed as usual."""
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Every call from the template is charged a step; str padding methods (ljust, center, zfill, ...) are
        size-checked first; a recursive loop's `loop(...)` iterates through the budget too."""
        _budget().step("a call")
        if isinstance(obj, jinja2.runtime.LoopContext) and args:  # `loop(children)` of a recursive loop
            args = (_loop_steps(None, args[0]), *args[1:])
        owner = getattr(obj, "__self__", None)
        name = getattr(obj, "__name__", "")
        grow = _STR_METHOD_GROWTH.get(name) if isinstance(owner, str) else None
        if grow is not None:
            _check_growth(grow, f"str.{name}", owner, *args, **kwargs)
        if isinstance(owner, str) and name in ("replace", "join", "translate"):
            args = _check_str_call(owner, name, args, kwargs)
        out = super().call(context, obj, *args, **kwargs)
        if isinstance(out, (str, list, tuple)):  # what a call built (split, strip, ...) is charged after
            _budget().build(len(out) * (1 if isinstance(out, str) else _ITEM), f"{name or 'a call'}", 1 << 62)
        return out

    def wrap_str_format(self, value: Any) -> Any:
        """Sandboxed str.format / format_map, with field widths checked before formatting."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        @functools.wraps(wrapped)
        def checked(*args: Any, **kwargs: Any) -> str:
            _check_format_spec(fmt)
            _budget().build(_format_size(fmt, args, kwargs), "str.format")
            return wrapped(*args, **kwargs)

        return checked


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
    _refuse_text(value, "filter tojson")
    if indent is not None and len(indent if isinstance(indent, str) else " " * max(0, int(indent))) > 16:
        raise SecurityError(f"filter tojson: indent {indent!r} is wider than 16")
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


def environment() -> _StrictSandbox:
    """The sandbox with the settings and helpers Hugging Face chat templates expect."""
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    for name in (*_FILTER_GROWTH, "format", "join", "replace", "sum"):
        env.filters[name] = _guarded_filter(name, env.filters[name])
    for name in _LIST_FILTERS:
        env.filters[name] = _charged_filter(name, env.filters[name])
    for name in _TEXT_FILTERS:
        env.filters[name] = _sized_filter(name, env.filters[name])
    env.filters.update(_ninfer_loop_steps=_loop_steps, _ninfer_concat=_concat, _ninfer_emit=_emit)
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                       dict=_DictHelper())
    return env


def render(template: jinja2.Template, /, **variables: Any) -> str:
    """The template's text under a fresh budget, the output capped at _MAX_TEXT characters; SecurityError or
    TemplateError (and whatever the template's code raises) propagate."""
    token = _BUDGET.set(_Budget())
    try:
        pieces, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > _MAX_TEXT:
                raise SecurityError(f"the output is longer than {_MAX_TEXT:,} characters")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _BUDGET.reset(token)
