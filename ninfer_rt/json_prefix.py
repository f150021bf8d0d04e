"""Whether a byte string begins a JSON object (RFC 8259), fed a token at a time: the constraint behind the server's
`response_format: {"type": "json_object"}`.

`JsonPrefix.feed(bytes)` advances over the bytes and says whether every one of them can continue a JSON text whose
top-level value is an object; `complete` says whether that object has closed (whitespace may follow, nothing
else). Strings take any byte but the controls (0x00-0x1f), so a token may carry part of a UTF-8 character; `"` ends
them and `\\` begins one of JSON's escapes (`\\uXXXX` with four hex digits). Numbers follow the JSON grammar (no
leading zeros, a digit after `.` and after the exponent). batching.Batch draws a constrained sequence's tokens
until one is allowed (`Batch._constrained`).
"""

from __future__ import annotations

WHITESPACE = b" \t\n\r"
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
_ESCAPES = frozenset(b'"\\/bfnrt')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = frozenset(b"0123456789")

# states
_VALUE, _OBJ_FIRST, _KEY, _COLON, _AFTER, _ARR_FIRST = range(6)   # between tokens of the structure
_STRING, _ESC, _HEX_DIGITS, _LITERAL = range(6, 10)               # inside a string or a literal
# inside a number: after "-", after a leading 0, in the integer digits, after ".", in the fraction, after "e",
# after the exponent's sign, in the exponent's digits
_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(10, 18)
_NUMBER_ENDS = frozenset((_N_ZERO, _N_INT, _N_FRAC, _N_EXP))  # a number may end in these


class JsonPrefix:
    """The state of a JSON object being written: a stack of open containers (`{` or `[`) and where in the grammar
    the next byte falls."""

    __slots__ = ("stack", "state", "key", "literal", "hex_left", "started")

    def __init__(self):
        self.stack: list[int] = []  # ord("{") / ord("[") of each open container
        self.state = _VALUE
        self.key = False      # the open string is an object's key
        self.literal = b""    # a literal's remaining bytes
        self.hex_left = 0     # a \u escape's remaining hex digits
        self.started = False  # the top-level object has opened

    def copy(self) -> JsonPrefix:
        c = JsonPrefix.__new__(JsonPrefix)
        c.stack, c.state, c.key, c.literal = list(self.stack), self.state, self.key, self.literal
        c.hex_left, c.started = self.hex_left, self.started
        return c

    @property
    def complete(self) -> bool:
        """The top-level object has closed."""
        return self.started and not self.stack and self.state == _AFTER

    closed = complete  # nothing but whitespace may follow (json_schema.SchemaPrefix's closed, for Batch)

    def feed(self, data: bytes) -> bool:
        """Advance over data; False as soon as a byte cannot continue a JSON object (the state is then
        undefined: feed a copy() to try a token)."""
        for b in data:
            if not self._byte(b):
                return False
        return True

    # ------------------------------------------------------------------------------------------------ bytes

    def _byte(self, b: int) -> bool:
        s = self.state
        if s == _STRING:
            if b == 0x22:  # "
                self.state = _COLON if self.key else _AFTER
            elif b == 0x5C:  # backslash
                self.state = _ESC
            return b >= 0x20
        if s == _ESC:
            if b == ord("u"):
                self.state, self.hex_left = _HEX_DIGITS, 4
                return True
            self.state = _STRING
            return b in _ESCAPES
        if s == _HEX_DIGITS:
            self.hex_left -= 1
            if self.hex_left == 0:
                self.state = _STRING
            return b in _HEX
        if s == _LITERAL:
            if b != self.literal[0]:
                return False
            self.literal = self.literal[1:]
            if not self.literal:
                self.state = _AFTER
            return True
        if s >= _N_MINUS:
            if self._number(b):
                return True
            if s not in _NUMBER_ENDS:
                return False
            self.state = _AFTER  # the number ended before b: b continues the structure
            return self._byte(b)
        if b in WHITESPACE:
            return self.started or s == _VALUE
        if s == _AFTER:
            if not self.stack:
                return False  # only whitespace after the top-level object
            top = self.stack[-1]
            if b == 0x2C:  # ,
                self.state = _KEY if top == 0x7B else _VALUE
                return True
            if b == (0x7D if top == 0x7B else 0x5D):  # } or ]
                self.stack.pop()
                self.state = _AFTER
                return True
            return False
        if s == _OBJ_FIRST and b == 0x7D:
            self.stack.pop()
            self.state = _AFTER
            return True
        if s in (_OBJ_FIRST, _KEY):
            if b != 0x22:
                return False
            self.state, self.key = _STRING, True
            return True
        if s == _COLON:
            if b != 0x3A:  # :
                return False
            self.state = _VALUE
            return True
        if s == _ARR_FIRST and b == 0x5D:
            self.stack.pop()
            self.state = _AFTER
            return True
        return self._value(b)  # _VALUE, or the first value of an array

    def _value(self, b: int) -> bool:
        """The first byte of a value."""
        if not self.started:  # the top-level value is an object
            if b != 0x7B:
                return False
            self.started = True
        if b in (0x7B, 0x5B):  # { [
            self.stack.append(b)
            self.state = _OBJ_FIRST if b == 0x7B else _ARR_FIRST
        elif b == 0x22:
            self.state, self.key = _STRING, False
        elif b in _LITERALS:
            self.state, self.literal = _LITERAL, _LITERALS[b]
        elif b == 0x2D:  # -
            self.state = _N_MINUS
        elif b == 0x30:
            self.state = _N_ZERO
        elif b in _DIGITS:
            self.state = _N_INT
        else:
            return False
        return True

    def _number(self, b: int) -> bool:
        """b continuing the number (the state advanced), or False (state unchanged)."""
        s, digit = self.state, b in _DIGITS
        if s == _N_MINUS and digit:
            self.state = _N_ZERO if b == 0x30 else _N_INT
        elif s in (_N_INT, _N_FRAC, _N_EXP) and digit:
            pass
        elif s in (_N_ZERO, _N_INT) and b == 0x2E:  # .
            self.state = _N_DOT
        elif s == _N_DOT and digit:
            self.state = _N_FRAC
        elif s in (_N_ZERO, _N_INT, _N_FRAC) and b in (0x65, 0x45):  # e E
            self.state = _N_E
        elif s == _N_E and b in (0x2B, 0x2D):  # + -
            self.state = _N_ESIGN
        elif s in (_N_E, _N_ESIGN) and digit:
            self.state = _N_EXP
        else:
            return False
        return True
