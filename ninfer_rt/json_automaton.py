"""The byte-level automaton of a compiled JSON Schema (json_schema.compile_schema's Node): `SchemaPrefix`, which
`batching.Batch._constrained` draws against (`feed`, `complete`, `closed`, `copy`). `feed` says whether the bytes so
far can still continue a JSON text the schema accepts; one frame per open value (object, array, string, number,
literal, enum), each taking a byte at a time. Strings take well-formed UTF-8 but the controls (0x00-0x1f), a
character's bytes possibly split across tokens; numbers follow JSON's grammar (no leading zeros, a digit after `.` and
after the exponent)."""

from __future__ import annotations

import functools
import json

from ninfer_rt.json_schema import (LITERALS, ANY, WHITESPACE, Node, first_bytes, integer_texts, key_text,
                                   value_key)
from ninfer_rt.json_scalars import (AGAIN, DIGITS, DONE, OK, PASS, REJECT, Bounds, CheckedString, Frame, Literal,
                                   Number, String)

MAX_PARSES = 64  # readings kept at once: past it the latest forks are dropped (stricter, never looser)
# whitespace bytes in a row between tokens of the JSON text (not inside a string): enough for pretty-printing 16
# levels deep, and a bound on a constrained model that would write whitespace instead of a value (llama.cpp's JSON
# grammar allows a newline and 20 more)
MAX_WHITESPACE_RUN = 32


class SchemaPrefix:
    """The state of a JSON text being written against a compiled schema: the ways of reading it so far (one, but
    where an anyOf's branches both still fit), each a stack of frames, one per open value."""

    __slots__ = ("parses", "ws")

    def __init__(self, root: Node):
        self.parses = [_Parse([_Value(root)], False)]
        self.ws = 0  # whitespace bytes in a row outside strings, at most MAX_WHITESPACE_RUN

    def copy(self) -> SchemaPrefix:
        c = SchemaPrefix.__new__(SchemaPrefix)
        c.parses, c.ws = [p.copy() for p in self.parses], self.ws
        return c

    @property
    def complete(self) -> bool:
        """The top-level value is complete in some reading (a number or an enum value could also stop where it
        stands)."""
        return any(p.done or (len(p.stack) == 1 and p.stack[0].can_end()) for p in self.parses)

    @property
    def in_plain_string(self) -> bool:
        """One reading, its open value a plain() String and no uniqueItems item recording bytes: a token whose bytes
        keeps_plain_string leaves this state exactly as it is (Batch then skips the copy and the feed)."""
        if len(self.parses) != 1:
            return False
        p = self.parses[0]
        return bool(p.stack) and not p.rec and type(p.stack[-1]) is String and p.stack[-1].plain()

    @property
    def closed(self) -> bool:
        """The top-level value has ended in every reading: nothing but whitespace may follow."""
        return all(p.done for p in self.parses)

    def feed(self, data: bytes) -> bool:
        """Advance over data; False as soon as a byte cannot continue a text the schema accepts (the state is then
        undefined: feed a copy() to try a token)."""
        for b in data:
            if b in WHITESPACE and not any(p.stack and p.stack[-1].in_text() for p in self.parses):
                self.ws += 1
                if self.ws > MAX_WHITESPACE_RUN:
                    return False
            else:
                self.ws = 0
            nxt = [q for p in self.parses for q in p.advance(b)]
            if len(nxt) > 1:  # readings that have come to the same state are one
                nxt = list({q.key(): q for q in nxt}.values())[:MAX_PARSES]
            self.parses = nxt
            if not nxt:
                return False
        return True


class _Parse:
    """One reading of the text so far: its open values' frames, whether the top-level value has ended, and how many
    uniqueItems arrays are recording an item's bytes."""

    __slots__ = ("stack", "done", "rec")

    def __init__(self, stack: list, done: bool, rec: int = 0):
        self.stack, self.done, self.rec = stack, done, rec

    def copy(self) -> _Parse:
        return _Parse([f.copy() for f in self.stack], self.done, self.rec)

    def key(self) -> tuple:
        return self.done, tuple(_state(f) for f in self.stack)

    def advance(self, b: int, entered: frozenset = frozenset()) -> list:
        """This reading after byte b: none (refused), itself, or one per anyOf branch the byte can begin (`entered`:
        the anyOfs this byte has already forked at, so one that contains itself through a $ref forks once)."""
        if self.rec and not entered:  # once a byte: into every item a uniqueItems array is recording
            for f in self.stack:
                if type(f) is _Array and f.cur is not None:
                    f.cur += bytes((b,))
        while True:
            if not self.stack:
                return [self] if self.done and b in WHITESPACE else []
            top = self.stack[-1]
            if type(top) is _Value and top.node.any_of is not None and b not in WHITESPACE:
                inside = entered | {id(top.node)}
                branches = [n for n in top.node.any_of if id(n) not in inside and b in first_bytes(n)]
                readings = [self.copy() for _ in branches[1:]] + [self] if branches else []
                out = []
                for c, n in zip(readings, branches):
                    c.stack[-1] = _Value(n)
                    out += c.advance(b, inside)
                return out
            r = top.step(b, self)
            if r == OK:
                return [self]
            if r == REJECT:
                return []
            if r == AGAIN:
                continue
            self.stack.pop()
            if self.stack:
                if self.stack[-1].child_done(self, passed=r == PASS) is False:
                    return []
            else:
                self.done = True
            if r == DONE:
                return [self]  # PASS: the same byte again, to the frame below


def _state(v):
    """A hashable picture of a frame's state (nodes by identity), so that equal readings are found."""
    if isinstance(v, Frame):
        return type(v).__name__, tuple((k, _state(x)) for k, x in sorted(vars(v).items()))
    if isinstance(v, (Node, Bounds)):
        return id(v)
    if isinstance(v, (list, tuple)):
        return tuple(_state(x) for x in v)
    return v


class _Value(Frame):
    """The start of a value: whitespace, then the first byte picks the frame that replaces this one."""

    def __init__(self, node: Node):
        self.node = node

    def step(self, b: int, sp: _Parse) -> int:
        if b in WHITESPACE:
            return OK
        n, types = self.node, self.node.types
        allows = (lambda t: True) if types is None else (lambda t: t in types)
        if n.enum is not None:
            frame = _Enum(n.enum)
        elif b == 0x7B and allows("object"):
            frame = _Object(n)
        elif b == 0x5B and allows("array"):
            frame = _Array(n)
        elif b == 0x22 and allows("string"):
            checked = n.min_length or n.max_length is not None or n.pattern is not None
            frame = CheckedString(n) if checked else String()
        elif (b == 0x2D or b in DIGITS) and (allows("number") or allows("integer")):
            frame = Number(integer=not allows("number"), bounds=n.bounds)
        elif b in LITERALS and allows(LITERALS[b][1]):
            frame = Literal(LITERALS[b][0])
        else:
            return REJECT
        sp.stack[-1] = frame
        return frame.step(b, sp)


class _Enum(Frame):
    """One of the enum's values, matched against their compact texts; whitespace is skipped where JSON allows it
    inside an object or array value (after `{ [ , :` and before `} ] , :`), outside its strings."""

    def __init__(self, options: tuple):
        self.options, self.buf, self.in_str, self.escaped = options, b"", False, False
        self.spaced = False  # whitespace was skipped after a value: only } ] , : may come next

    def step(self, b: int, sp) -> int:
        nb = self.buf + bytes((b,))
        if self.spaced and b not in WHITESPACE:
            self.spaced = False
            if self.buf[-1] not in b"{[,:" and b not in b"}],:":
                return PASS if self.buf in self.options else REJECT
        if any(o.startswith(nb) for o in self.options):
            self.buf = nb
            if self.in_str:  # the compact text's own string state, to tell its whitespace from JSON's
                self.in_str, self.escaped = (self.escaped or b != 0x22), not self.escaped and b == 0x5C
            else:
                self.in_str = b == 0x22
            return DONE if nb in self.options and not any(len(o) > len(nb) and o.startswith(nb)
                                                          for o in self.options) else OK
        if b in WHITESPACE and not self.in_str and self.buf:
            longer = [o for o in self.options if len(o) > len(self.buf) and o.startswith(self.buf)]
            if self.buf[-1] in b"{[,:" and longer:
                return OK
            if any(o[len(self.buf)] in b"}],:" for o in longer):
                self.spaced = True
                return OK
        return PASS if self.buf in self.options else REJECT

    def can_end(self) -> bool:
        return self.buf in self.options

    def in_text(self) -> bool:
        return self.in_str


class _Object(Frame):
    """An object from its `{`: keys the schema allows, each once, at most maxProperties of them, and `}` only once every
    required key is in and minProperties are."""

    OPEN, FIRST, KEY, COLON, VALUE, AFTER, NEXT = range(7)

    def __init__(self, node: Node):
        self.node, self.state, self.used, self.key = node, self.OPEN, frozenset(), None
        self.names = None  # propertyNames' check of the key being written (Node.names)
        self.pats = []  # patternProperties' patterns the key being written can still match (string frames)

    def in_text(self) -> bool:
        return self.state == self.KEY  # a key's string, written by this frame

    def _closed_keys(self) -> list[bytes] | None:
        """The keys still allowed, as their JSON string contents, where no other key is (additionalProperties
        false, or the short list patterns or propertyNames leave: Node.finite_keys); else None."""
        n = self.node
        keys = n.finite_keys if n.finite_keys is not None else n.key_raw if n.additional is False else None
        return None if keys is None else [raw for k, raw in keys.items() if k not in self.used]

    def _open_patterns(self) -> bool:
        """Whether patternProperties may still take a key the closed list does not hold."""
        return bool(self.node.key_patterns) and self.node.finite_keys is None

    def _must_keys(self) -> list[bytes] | None:
        """The required keys still missing, as their JSON string contents, where maxProperties leaves room for
        them alone (another key would leave no way to close the object); else None."""
        n = self.node
        if n.max_props is None:
            return None
        missing = [k for k in n.required if k not in self.used]
        if not missing or len(self.used) + len(missing) < n.max_props:
            return None
        return [key_text(k).encode() for k in missing]

    def step(self, b: int, sp: _Parse) -> int:
        s = self.state
        if s == self.OPEN:
            self.state = self.FIRST
            return OK if b == 0x7B else REJECT
        if s == self.KEY:
            r = self.key.step(b, sp)
            if self.names is not None and self.names.step(b, sp) == REJECT:
                return REJECT
            steps = [(f, f.step(b, sp)) for f in self.pats]
            self.pats = [f for f, x in steps if x != REJECT]
            matched = any(x == DONE for _, x in steps)
            closed, must = self._closed_keys(), self._must_keys()
            listed = closed is None or any(k.startswith(self.key.raw) for k in closed)
            if r == REJECT or not (listed or (self.pats and self._open_patterns())):
                return REJECT
            if must is not None and (not any(k.startswith(self.key.raw) for k in must)
                                     or (r == DONE and self.key.raw not in must)):
                return REJECT  # maxProperties leaves room for the required keys alone
            if r == DONE:
                self.state, n = self.COLON, self.node
                if not n.unique and not n.props:  # any key, any value: its name is not needed (nor UTF-8)
                    self.value = n.additional or ANY
                    return OK
                try:
                    name = json.loads(b'"' + self.key.raw + b'"')
                except ValueError:  # not UTF-8
                    return REJECT
                if (n.unique and name in self.used) or (closed is not None and self.key.raw not in closed
                                                        and not matched):
                    return REJECT
                value = n.pattern_value if matched and name not in n.props else n.additional or ANY
                self.used, self.value = self.used | {name}, n.props.get(name, value)
            return OK
        if b in WHITESPACE:
            return OK
        if s == self.COLON:
            if b != 0x3A:
                return REJECT
            self.state = self.VALUE
            sp.stack.append(_Value(self.value))
            return OK
        n = self.node
        if b == 0x7D and (s == self.FIRST or s == self.AFTER):
            return DONE if n.required <= self.used and len(self.used) >= n.min_props else REJECT
        if n.max_props is not None and len(self.used) >= n.max_props and s in (self.FIRST, self.AFTER):
            return REJECT  # no key more: only "}"
        if s == self.AFTER:
            if b != 0x2C:
                return REJECT
            closed = self._closed_keys()
            if closed is not None and not closed and not self._open_patterns():
                return REJECT  # every allowed key is in: nothing may follow a comma
            self.state = self.NEXT
            return OK
        if b == 0x22 and s in (self.FIRST, self.NEXT):
            if self._closed_keys() == [] and not self._open_patterns():
                return REJECT  # no key is left to write: a quote would lead nowhere
            self.state, self.key = self.KEY, String(keep=True)
            self.names = CheckedString(n.names) if n.names is not None else None
            self.pats = [CheckedString(p) for p in n.key_patterns]
            for f in [self.names, *self.pats]:
                if f is not None:
                    f.step(b, sp)
            return self.key.step(b, sp)
        return REJECT

    def copy(self):
        c = super().copy()
        if self.key is not None:
            c.key = self.key.copy()
        if self.names is not None:
            c.names = self.names.copy()
        c.pats = [f.copy() for f in self.pats]
        return c

    def child_done(self, sp, passed: bool) -> None:
        self.state = self.AFTER


@functools.lru_cache(maxsize=256)
def _free_integers(bounds: Bounds, seen: frozenset) -> tuple:
    """integer_texts' texts whose values are not in seen: memoised, as every token tried at an item's start asks
    again for the same array state (a frozenset keeps its hash)."""
    return tuple(t for t, key in integer_texts(bounds) if key not in seen)


class _Array(Frame):
    """An array from its `[`: item i of prefixItems[i], past them of the item schema; `]` only at minItems or more,
    no `,` at maxItems (the compiler caps it at the tuple's length where items is false)."""

    OPEN, FIRST, AFTER, NEXT = range(4)

    def __init__(self, node: Node):
        self.node, self.state, self.count = node, self.OPEN, 0
        self.cur, self.seen = None, frozenset()  # uniqueItems: the item's bytes so far; the earlier items' values

    def step(self, b: int, sp: _Parse) -> int:
        s, n = self.state, self.node
        if s == self.OPEN:
            self.state = self.FIRST
            return OK if b == 0x5B else REJECT
        if b in WHITESPACE:
            return OK
        if b == 0x5D and s in (self.FIRST, self.AFTER):
            return DONE if self.count >= n.min_items else REJECT
        if s == self.AFTER:
            if b != 0x2C or (n.max_items is not None and self.count >= n.max_items) or self._unseen() == ():
                return REJECT  # no item more (maxItems, or every value of a unique enum item is in)
            self.state = self.NEXT
            return OK
        if n.max_items is not None and self.count >= n.max_items:
            return REJECT  # maxItems 0: only "]"
        self.state = self.AFTER  # once the item is complete (child_done)
        item, unseen = self._item(), self._unseen()
        sp.stack.append(_Value(item or ANY) if unseen is None else _Enum(unseen))
        if n.unique_items:
            self.cur, sp.rec = bytes((b,)), sp.rec + 1
        return AGAIN

    def _item(self) -> Node | None:
        """The schema of the next item."""
        n = self.node
        return n.prefix_items[self.count] if self.count < len(n.prefix_items) else n.items

    def _unseen(self) -> tuple | None:
        """Under uniqueItems, the texts of an enum (or boolean / null / bounded integer) item whose values no earlier
        item holds (a duplicate is refused from its first byte, not at its last, where nothing could replace it);
        else None."""
        item = self._item()
        if not self.node.unique_items or item is None:
            return None
        texts, types = item.enum, item.types
        if texts is None and types is not None and item.any_of is None and types <= {"boolean", "null", "integer"}:
            ints = integer_texts(item.bounds) if "integer" in types else ()
            if ints is None:  # an open range (or a wide one): a Number frame
                return None
            texts = (b"true", b"false") * ("boolean" in types) + (b"null",) * ("null" in types)
            return tuple(t for t in texts if value_key(json.loads(t)) not in self.seen) + (
                _free_integers(item.bounds, self.seen) if ints else ())
        if texts is None:
            return None
        return tuple(t for t in texts if value_key(json.loads(t)) not in self.seen)

    def child_done(self, sp, passed: bool) -> bool:
        self.count += 1
        self.state = self.AFTER
        if self.cur is None:
            return True
        text, self.cur, sp.rec = self.cur[:-1] if passed else self.cur, None, sp.rec - 1
        key = value_key(json.loads(text))
        if key in self.seen:
            return False
        self.seen = self.seen | {key}
        return True
