"""The byte-level automaton of a compiled JSON Schema (json_schema.compile_schema's Node): `SchemaPrefix`, which
`batching.Batch._constrained` draws against (`feed`, `complete`, `closed`, `copy`). `feed` says whether the bytes so
far can still continue a JSON text the schema accepts; one frame per open value (object, array, string, number,
literal, enum), each taking a byte at a time. Strings take well-formed UTF-8 but the controls (0x00-0x1f), a
character's bytes possibly split across tokens; numbers follow JSON's grammar (no leading zeros, a digit after `.` and
after the exponent)."""

from __future__ import annotations

import json
from fractions import Fraction

from ninfer_rt.json_schema import LITERALS, ANY, WHITESPACE, Bounds, Node, first_bytes, value_key

_ESCAPES = frozenset(b'"\\/bfnrt')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = frozenset(b"0123456789")

# what a frame's step says of a byte: refused; taken; taken and the value is complete; the value was complete
# before it (the byte goes to the frame below); a child value was pushed that takes this byte (from the top)
_REJECT, _OK, _DONE, _PASS, _AGAIN = range(5)
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
            if r == _OK:
                return [self]
            if r == _REJECT:
                return []
            if r == _AGAIN:
                continue
            self.stack.pop()
            if self.stack:
                if self.stack[-1].child_done(self, passed=r == _PASS) is False:
                    return []
            else:
                self.done = True
            if r == _DONE:
                return [self]  # _PASS: the same byte again, to the frame below


def _state(v):
    """A hashable picture of a frame's state (nodes by identity), so that equal readings are found."""
    if isinstance(v, _Frame):
        return type(v).__name__, tuple((k, _state(x)) for k, x in sorted(vars(v).items()))
    if isinstance(v, (Node, Bounds)):
        return id(v)
    if isinstance(v, (list, tuple)):
        return tuple(_state(x) for x in v)
    return v


class _Frame:
    def copy(self):
        c = object.__new__(type(self))
        c.__dict__.update(self.__dict__)
        return c

    def in_text(self) -> bool:
        """Whether the next byte is inside a string (where a space is content, not JSON's whitespace)."""
        return False

    def can_end(self) -> bool:
        return False

    def child_done(self, sp, passed: bool) -> bool | None:
        """The value this frame pushed is complete (passed: the byte that showed it is not part of it); False refuses
        that byte."""
        return None


class _Value(_Frame):
    """The start of a value: whitespace, then the first byte picks the frame that replaces this one."""

    def __init__(self, node: Node):
        self.node = node

    def step(self, b: int, sp: _Parse) -> int:
        if b in WHITESPACE:
            return _OK
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
            frame = _CheckedString(n) if checked else _String()
        elif (b == 0x2D or b in _DIGITS) and (allows("number") or allows("integer")):
            frame = _Number(integer=not allows("number"), bounds=n.bounds)
        elif b in LITERALS and allows(LITERALS[b][1]):
            frame = _Literal(LITERALS[b][0])
        else:
            return _REJECT
        sp.stack[-1] = frame
        return frame.step(b, sp)


class _Enum(_Frame):
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
                return _PASS if self.buf in self.options else _REJECT
        if any(o.startswith(nb) for o in self.options):
            self.buf = nb
            if self.in_str:  # the compact text's own string state, to tell its whitespace from JSON's
                self.in_str, self.escaped = (self.escaped or b != 0x22), not self.escaped and b == 0x5C
            else:
                self.in_str = b == 0x22
            return _DONE if nb in self.options and not any(len(o) > len(nb) and o.startswith(nb)
                                                          for o in self.options) else _OK
        if b in WHITESPACE and not self.in_str and self.buf:
            longer = [o for o in self.options if len(o) > len(self.buf) and o.startswith(self.buf)]
            if self.buf[-1] in b"{[,:" and longer:
                return _OK
            if any(o[len(self.buf)] in b"}],:" for o in longer):
                self.spaced = True
                return _OK
        return _PASS if self.buf in self.options else _REJECT

    def can_end(self) -> bool:
        return self.buf in self.options

    def in_text(self) -> bool:
        return self.in_str


class _Literal(_Frame):
    def __init__(self, text: bytes):
        self.text, self.at = text, 0

    def step(self, b: int, sp) -> int:
        if b != self.text[self.at]:
            return _REJECT
        self.at += 1
        return _DONE if self.at == len(self.text) else _OK


class _String(_Frame):
    """A string from its opening quote: any character but the controls, as well-formed UTF-8 (what json.loads
    decodes: no overlong forms, surrogates or code points past U+10FFFF), JSON's escapes; `raw` keeps the bytes between
    the quotes where asked (object keys)."""

    def __init__(self, keep: bool = False):
        self.state, self.hex_left, self.raw = 0, 0, b"" if keep else None  # 0 before the quote, 1 in, 2 escape, 3 hex
        self.need, self.next_lo, self.next_hi = 0, 0x80, 0xBF  # UTF-8 bytes still to come; the next one's range

    def in_text(self) -> bool:
        return self.state != 0

    def step(self, b: int, sp) -> int:
        s = self.state
        if s == 0:
            self.state = 1
            return _OK if b == 0x22 else _REJECT
        if self.raw is not None and not (s == 1 and b == 0x22):
            self.raw += bytes((b,))
        if s == 1:
            if self.need:
                if not self.next_lo <= b <= self.next_hi:
                    return _REJECT
                self.need, self.next_lo, self.next_hi = self.need - 1, 0x80, 0xBF
                return _OK
            if b == 0x22:
                return _DONE
            if b == 0x5C:
                self.state = 2
                return _OK
            if b < 0x80:
                return _OK if b >= 0x20 else _REJECT
            lead = _UTF8_SECOND.get(b)
            if lead is None:
                return _REJECT
            self.need, self.next_lo, self.next_hi = lead
            return _OK
        if s == 2:
            if b == ord("u"):
                self.state, self.hex_left = 3, 4
                return _OK
            self.state = 1
            return _OK if b in _ESCAPES else _REJECT
        self.hex_left -= 1
        if self.hex_left == 0:
            self.state = 1
        return _OK if b in _HEX else _REJECT


# a UTF-8 lead byte -> (continuation bytes, the range of the first of them): E0 and F0 exclude overlong forms, ED the
# surrogates, F4 what lies past U+10FFFF (RFC 3629's table)
_UTF8_SECOND = {**{b: (1, 0x80, 0xBF) for b in range(0xC2, 0xE0)}, 0xE0: (2, 0xA0, 0xBF),
                **{b: (2, 0x80, 0xBF) for b in range(0xE1, 0xED)}, 0xED: (2, 0x80, 0x9F), 0xEE: (2, 0x80, 0xBF),
                0xEF: (2, 0x80, 0xBF), 0xF0: (3, 0x90, 0xBF), 0xF1: (3, 0x80, 0xBF), 0xF2: (3, 0x80, 0xBF),
                0xF3: (3, 0x80, 0xBF), 0xF4: (3, 0x80, 0x8F)}


class _CheckedString(_Frame):
    """A string under minLength, maxLength or pattern: its bytes decoded into characters (UTF-8, JSON's escapes, a
    \\u surrogate pair as one, as json.loads decodes), each counted and stepped through the pattern's NFA. A byte is
    taken only where the characters so far still begin some string the pattern matches within the lengths (for a
    character still being written: where some character it can become fits the next step)."""

    def __init__(self, node: Node):
        self.node, self.state, self.count = node, 0, 0  # state: 0 before the quote, 1 in, 2 escape, 3 \u digits
        self.nfa = node.pattern.start() if node.pattern is not None else None
        self.code, self.need = 0, 0  # the character being decoded, and its UTF-8 bytes or hex digits still to come
        self.next_lo, self.next_hi = 0x80, 0xBF  # UTF-8: the next byte's range (_UTF8_SECOND's for the first)
        self.least = 0  # the least code point the UTF-8 sequence being read may encode
        self.high = None  # a \u high surrogate waiting for its low half

    def in_text(self) -> bool:
        return self.state != 0

    def _char(self, c: int) -> int:
        n, self.count = self.node, self.count + 1
        if n.max_length is not None and self.count > n.max_length:
            return _REJECT
        if self.nfa is None:
            return _OK
        self.nfa = n.pattern.step(self.nfa, c)
        fewest, most = n.pattern.lengths(self.nfa)
        if fewest is None or (n.max_length is not None and self.count + fewest > n.max_length):
            return _REJECT
        return _OK if most is None or self.count + most >= n.min_length else _REJECT

    def _may(self, lo: int, hi: int) -> bool:
        """Whether one more character, some code point in [lo, hi], can follow."""
        n = self.node
        return (lo <= hi and (n.max_length is None or self.count < n.max_length)
                and (self.nfa is None or n.pattern.admits(self.nfa, lo, hi)))

    def _flush(self) -> int:
        """The waiting high surrogate as a character of its own (json.loads keeps a lone one)."""
        h, self.high = self.high, None
        return _OK if h is None else self._char(h)

    def step(self, b: int, sp) -> int:
        s = self.state
        if s == 0:
            self.state = 1
            return _OK if b == 0x22 else _REJECT
        if s == 1 and self.need:  # a UTF-8 continuation byte
            if not self.next_lo <= b <= self.next_hi:
                return _REJECT
            self.code, self.need = (self.code << 6) | (b & 0x3F), self.need - 1
            self.next_lo, self.next_hi = 0x80, 0xBF
            return self._utf8_may() if self.need else self._char(self.code)
        if s == 1:
            if b < 0x20:
                return _REJECT
            if b == 0x5C:
                self.state = 2
                return _OK
            if self._flush() == _REJECT:
                return _REJECT
            if b == 0x22:
                n = self.node
                ok = self.count >= n.min_length and (self.nfa is None or n.pattern.accepts(self.nfa))
                return _DONE if ok else _REJECT
            if b < 0x80:
                return self._char(b)
            lead = _UTF8_SECOND.get(b)
            if lead is None:
                return _REJECT
            self.need, self.next_lo, self.next_hi = lead
            self.code, self.least = b & (0x3F >> self.need), _UTF8_LEAST[self.need]  # the lead's payload bits
            return self._utf8_may()
        if s == 2:
            if b == ord("u"):
                self.state, self.need, self.code = 3, 4, 0
                return _OK
            self.state = 1
            if b not in _ESCAPES or self._flush() == _REJECT:
                return _REJECT
            return self._char(_ESCAPED[b])
        if b not in _HEX:
            return _REJECT
        self.code, self.need = self.code * 16 + int(chr(b), 16), self.need - 1
        if self.need:
            return _OK
        self.state, c = 1, self.code
        if self.high is not None and 0xDC00 <= c <= 0xDFFF:  # the pair's second half: one character
            c, self.high = 0x10000 + ((self.high - 0xD800) << 10) + (c - 0xDC00), None
            return self._char(c)
        if self._flush() == _REJECT:
            return _REJECT
        if 0xD800 <= c <= 0xDBFF:  # a lone surrogate, or the first half of an astral character
            self.high, base = c, 0x10000 + ((c - 0xD800) << 10)
            return _OK if self._may(c, c) or self._may(base, base + 0x3FF) else _REJECT
        return self._char(c)

    def _utf8_may(self) -> int:
        lo = self.code << (6 * self.need)
        hi = min(lo | ((1 << (6 * self.need)) - 1), 0x10FFFF)
        return _OK if self._may(max(lo, self.least), hi) else _REJECT


_UTF8_LEAST = {1: 0x80, 2: 0x800, 3: 0x10000}  # the least code point of each length (shorter forms are overlong)
_ESCAPED = {ord('"'): 0x22, ord("\\"): 0x5C, ord("/"): 0x2F, ord("b"): 0x08, ord("f"): 0x0C, ord("n"): 0x0A,
            ord("r"): 0x0D, ord("t"): 0x09}


class _Number(_Frame):
    """A number from its first byte. Under bounds: no exponent, and each byte only where some in-range number
    still begins with the text so far (`_reachable`); it may end only in range."""

    # after "-", a leading 0, integer digits, ".", fraction digits, "e", the exponent's sign, exponent digits
    MINUS, ZERO, INT, DOT, FRAC, E, ESIGN, EXP = range(8)
    ENDS = (ZERO, INT, FRAC, EXP)

    def __init__(self, integer: bool, bounds: Bounds | None = None):
        self.integer, self.state, self.bounds, self.text = integer, None, bounds, ""

    def step(self, b: int, sp) -> int:
        r = self._grammar(b)
        if r != _OK or self.bounds is None:
            return r if r != _PASS or self.bounds is None or self.can_end() else _REJECT
        if self.state in (self.E, self.ESIGN, self.EXP):
            return _REJECT
        self.text += chr(b)
        return _OK if self._reachable() else _REJECT

    def _reachable(self) -> bool:
        """Whether some number within the bounds is written with self.text as its prefix (no exponent)."""
        neg = self.text.startswith("-")
        body, bounds = self.text[neg:], self.bounds.negated() if neg else self.bounds  # bounds of the magnitude
        if not body:  # "-": any magnitude
            return bounds.meets(Fraction(0), None, self.integer)
        whole, _, frac = body.partition(".")
        if "." in body:  # [whole.frac, whole.frac + 10^-len(frac))
            a = Fraction(int(whole + frac), 10 ** len(frac))
            return bounds.meets(a, a + Fraction(1, 10 ** len(frac)), False)
        if whole == "0":  # 0, or 0.xxx
            return bounds.meets(Fraction(0), Fraction(1), self.integer)
        d = int(whole)  # more digits to come: [d·10^k, (d + 1)·10^k) for some k >= 0
        k = 0
        while True:
            a, b = Fraction(d * 10 ** k), Fraction((d + 1) * 10 ** k)
            if bounds.meets(a, b, self.integer):
                return True
            if bounds.hi is not None and a > bounds.hi:
                return False
            if bounds.hi is None:  # unbounded above: a large enough k lands past any lower bound
                return True
            k += 1

    def can_end(self) -> bool:
        if self.state not in self.ENDS:
            return False
        # exact, and as the float a reader's json.loads makes of it (an exclusive bound could otherwise round away)
        return self.bounds is None or (self.bounds.holds(Fraction(self.text))
                                       and self.bounds.holds_float(float(self.text)))

    def _grammar(self, b: int) -> int:
        s, digit = self.state, b in _DIGITS
        if s is None:
            self.state = self.MINUS if b == 0x2D else self.ZERO if b == 0x30 else self.INT
        elif s == self.MINUS and digit:
            self.state = self.ZERO if b == 0x30 else self.INT
        elif s in (self.INT, self.FRAC, self.EXP) and digit:
            pass
        elif s in (self.ZERO, self.INT) and b == 0x2E and not self.integer:
            self.state = self.DOT
        elif s == self.DOT and digit:
            self.state = self.FRAC
        elif s in (self.ZERO, self.INT, self.FRAC) and b in (0x65, 0x45) and not self.integer:
            self.state = self.E
        elif s == self.E and b in (0x2B, 0x2D):
            self.state = self.ESIGN
        elif s in (self.E, self.ESIGN) and digit:
            self.state = self.EXP
        else:
            return _PASS if s in self.ENDS else _REJECT
        return _OK


class _Object(_Frame):
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
        false); else None."""
        if self.node.additional is not False:
            return None
        return [raw for k, raw in self.node.key_raw.items() if k not in self.used]

    def step(self, b: int, sp: _Parse) -> int:
        s = self.state
        if s == self.OPEN:
            self.state = self.FIRST
            return _OK if b == 0x7B else _REJECT
        if s == self.KEY:
            r = self.key.step(b, sp)
            if self.names is not None and self.names.step(b, sp) == _REJECT:
                return _REJECT
            steps = [(f, f.step(b, sp)) for f in self.pats]
            self.pats = [f for f, x in steps if x != _REJECT]
            matched = any(x == _DONE for _, x in steps)
            closed = self._closed_keys()
            listed = closed is None or any(k.startswith(self.key.raw) for k in closed)
            if r == _REJECT or not (listed or self.pats):
                return _REJECT
            if r == _DONE:
                self.state, n = self.COLON, self.node
                if not n.unique and not n.props:  # any key, any value: its name is not needed (nor UTF-8)
                    self.value = n.additional or ANY
                    return _OK
                try:
                    name = json.loads(b'"' + self.key.raw + b'"')
                except ValueError:  # not UTF-8
                    return _REJECT
                if (n.unique and name in self.used) or (closed is not None and self.key.raw not in closed
                                                        and not matched):
                    return _REJECT
                value = n.pattern_value if matched and name not in n.props else n.additional or ANY
                self.used, self.value = self.used | {name}, n.props.get(name, value)
            return _OK
        if b in WHITESPACE:
            return _OK
        if s == self.COLON:
            if b != 0x3A:
                return _REJECT
            self.state = self.VALUE
            sp.stack.append(_Value(self.value))
            return _OK
        n = self.node
        if b == 0x7D and (s == self.FIRST or s == self.AFTER):
            return _DONE if n.required <= self.used and len(self.used) >= n.min_props else _REJECT
        if n.max_props is not None and len(self.used) >= n.max_props and s in (self.FIRST, self.AFTER):
            return _REJECT  # no key more: only "}"
        if s == self.AFTER:
            if b != 0x2C:
                return _REJECT
            closed = self._closed_keys()
            if closed is not None and not closed and not n.key_patterns:
                return _REJECT  # every allowed key is in: nothing may follow a comma
            self.state = self.NEXT
            return _OK
        if b == 0x22 and s in (self.FIRST, self.NEXT):
            if self._closed_keys() == [] and not n.key_patterns:
                return _REJECT  # no key is left to write: a quote would lead nowhere
            self.state, self.key = self.KEY, _String(keep=True)
            self.names = _CheckedString(n.names) if n.names is not None else None
            self.pats = [_CheckedString(p) for p in n.key_patterns]
            for f in [self.names, *self.pats]:
                if f is not None:
                    f.step(b, sp)
            return self.key.step(b, sp)
        return _REJECT

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


class _Array(_Frame):
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
            return _OK if b == 0x5B else _REJECT
        if b in WHITESPACE:
            return _OK
        if b == 0x5D and s in (self.FIRST, self.AFTER):
            return _DONE if self.count >= n.min_items else _REJECT
        if s == self.AFTER:
            if b != 0x2C or (n.max_items is not None and self.count >= n.max_items):
                return _REJECT
            self.state = self.NEXT
            return _OK
        if n.max_items is not None and self.count >= n.max_items:
            return _REJECT  # maxItems 0: only "]"
        self.state = self.AFTER  # once the item is complete (child_done)
        item = n.prefix_items[self.count] if self.count < len(n.prefix_items) else n.items
        sp.stack.append(_Value(item or ANY))
        if n.unique_items:
            self.cur, sp.rec = bytes((b,)), sp.rec + 1
        return _AGAIN

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
