"""The JSON scalar frames of json_automaton's byte-level reader: a literal (true, false, null), a string (well-formed
UTF-8 but the controls; with minLength, maxLength or a pattern, decoded into characters and stepped through the
pattern's NFA) and a number (JSON's grammar; under bounds, only bytes some in-range number can still follow). Each
frame takes one byte at a time and answers with one of the step codes below; the object, array, enum and any-value
frames, which push these, are in json_automaton. `Bounds` is a number's range in exact rationals (json_schema
compiles it from minimum, maximum, their exclusive forms and multipleOf)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # json_schema imports Bounds from here: Node only for the annotations
    from ninfer_rt.json_schema import Node

@dataclass(frozen=True)
class Bounds:
    """lo <= v <= hi, each side strict (<) where its flag says, None: unbounded; v a multiple of step where given
    (multipleOf); exact rationals."""

    lo: Fraction | None = None
    lo_strict: bool = False
    hi: Fraction | None = None
    hi_strict: bool = False
    step: Fraction | None = None

    def holds(self, v: Fraction) -> bool:
        return self._within(v, self.lo, self.hi) and (self.step is None or (v / self.step).denominator == 1)

    def holds_float(self, v: float) -> bool:
        """The range as a reader's json.loads float of the value compares it (0.99999999999999999 reads as 1.0)."""
        return self._within(v, *(None if x is None else float(x) for x in (self.lo, self.hi)))

    def _within(self, v, lo, hi) -> bool:
        return ((lo is None or v > lo or (v == lo and not self.lo_strict))
                and (hi is None or v < hi or (v == hi and not self.hi_strict)))

    def grid(self, integer: bool) -> Fraction | None:
        """The spacing of the allowed values: the step, and for integers the step's multiples that are integers
        (k·p/q is one iff q divides k, p/q in lowest terms); None: any value."""
        if self.step is None:
            return Fraction(1) if integer else None
        return Fraction(self.step.numerator) if integer else self.step

    def integers(self) -> tuple[int, int, int] | None:
        """(the least, the spacing, how many) of the integers the bounds hold, on grid(integer=True); None where a
        side is open."""
        if self.lo is None or self.hi is None:
            return None
        lo = math.floor(self.lo) + 1 if self.lo_strict else math.ceil(self.lo)
        hi = math.ceil(self.hi) - 1 if self.hi_strict else math.floor(self.hi)
        m = int(self.grid(True))
        first = -(-lo // m) * m  # the least multiple of m at or above lo
        return first, m, max(0, hi // m - first // m + 1)

    def meets(self, a: Fraction | None, b: Fraction | None, integer: bool) -> bool:
        """Some allowed value (an integer where asked) lies in [a, b); None: unbounded on that side."""
        lower, lower_in = a, True  # the intersection's ends, each included or not
        if self.lo is not None and (a is None or self.lo > a or (self.lo == a and self.lo_strict)):
            lower, lower_in = self.lo, not self.lo_strict
        upper, upper_in = b, False
        if self.hi is not None and (b is None or self.hi < b):
            upper, upper_in = self.hi, not self.hi_strict
        if lower is None or upper is None:
            return True
        grid = self.grid(integer)
        if grid is None:
            return lower < upper or (lower == upper and lower_in and upper_in)
        k0, k1 = math.ceil(lower / grid), math.floor(upper / grid)  # the grid points within, by index
        k0 += not lower_in and k0 * grid == lower
        k1 -= not upper_in and k1 * grid == upper
        return k0 <= k1

    def negated(self) -> Bounds:
        """The bounds of -v."""
        return Bounds(None if self.hi is None else -self.hi, self.hi_strict,
                      None if self.lo is None else -self.lo, self.lo_strict, self.step)


_ESCAPES = frozenset(b'"\\/bfnrt')
_HEX = frozenset(b"0123456789abcdefABCDEF")
DIGITS = frozenset(b"0123456789")

# what a frame's step says of a byte: refused; taken; taken and the value is complete; the value was complete
# before it (the byte goes to the frame below); a child value was pushed that takes this byte (from the top)
REJECT, OK, DONE, PASS, AGAIN = range(5)


class Frame:
    """One open value's reader: `step(b, sp)` takes a byte and answers with a step code; `copy` for a fork."""

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


class Literal(Frame):
    def __init__(self, text: bytes):
        self.text, self.at = text, 0

    def step(self, b: int, sp) -> int:
        if b != self.text[self.at]:
            return REJECT
        self.at += 1
        return DONE if self.at == len(self.text) else OK


class String(Frame):
    """A string from its opening quote: any character but the controls, as well-formed UTF-8 (what json.loads
    decodes: no overlong forms, surrogates or code points past U+10FFFF), JSON's escapes; `raw` keeps the bytes between
    the quotes where asked (object keys)."""

    def __init__(self, keep: bool = False):
        self.state, self.hex_left, self.raw = 0, 0, b"" if keep else None  # 0 before the quote, 1 in, 2 escape, 3 hex
        self.need, self.next_lo, self.next_hi = 0, 0x80, 0xBF  # UTF-8 bytes still to come; the next one's range

    def in_text(self) -> bool:
        return self.state != 0

    def plain(self) -> bool:
        """In the text with no escape or character's bytes pending and no bytes kept: keeps_plain_string's state."""
        return self.state == 1 and not self.need and self.raw is None

    def step(self, b: int, sp) -> int:
        s = self.state
        if s == 0:
            self.state = 1
            return OK if b == 0x22 else REJECT
        if self.raw is not None and not (s == 1 and b == 0x22):
            self.raw += bytes((b,))
        if s == 1:
            if self.need:
                if not self.next_lo <= b <= self.next_hi:
                    return REJECT
                self.need, self.next_lo, self.next_hi = self.need - 1, 0x80, 0xBF
                return OK
            if b == 0x22:
                return DONE
            if b == 0x5C:
                self.state = 2
                return OK
            if b < 0x80:
                return OK if b >= 0x20 else REJECT
            lead = _UTF8_SECOND.get(b)
            if lead is None:
                return REJECT
            self.need, self.next_lo, self.next_hi = lead
            return OK
        if s == 2:
            if b == ord("u"):
                self.state, self.hex_left = 3, 4
                return OK
            self.state = 1
            return OK if b in _ESCAPES else REJECT
        self.hex_left -= 1
        if self.hex_left == 0:
            self.state = 1
        return OK if b in _HEX else REJECT


def keeps_plain_string(data: bytes) -> bool:
    """Whether data, fed to a String that is plain() (in its text, nothing pending), leaves it exactly so: whole
    well-formed UTF-8 characters (Python's strict decoder refuses what _UTF8_SECOND refuses: overlong forms,
    surrogates, past U+10FFFF, a character cut short) with no control, quote or backslash."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return bool(text) and not any(ch < " " or ch == '"' or ch == "\\" for ch in text)


# a UTF-8 lead byte -> (continuation bytes, the range of the first of them): E0 and F0 exclude overlong forms, ED the
# surrogates, F4 what lies past U+10FFFF (RFC 3629's table)
_UTF8_SECOND = {**{b: (1, 0x80, 0xBF) for b in range(0xC2, 0xE0)}, 0xE0: (2, 0xA0, 0xBF),
                **{b: (2, 0x80, 0xBF) for b in range(0xE1, 0xED)}, 0xED: (2, 0x80, 0x9F), 0xEE: (2, 0x80, 0xBF),
                0xEF: (2, 0x80, 0xBF), 0xF0: (3, 0x90, 0xBF), 0xF1: (3, 0x80, 0xBF), 0xF2: (3, 0x80, 0xBF),
                0xF3: (3, 0x80, 0xBF), 0xF4: (3, 0x80, 0x8F)}


class CheckedString(Frame):
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
            return REJECT
        if self.nfa is None:
            return OK
        self.nfa = n.pattern.step(self.nfa, c)
        fewest, most = n.pattern.lengths(self.nfa)
        if fewest is None or (n.max_length is not None and self.count + fewest > n.max_length):
            return REJECT
        return OK if most is None or self.count + most >= n.min_length else REJECT

    def _may(self, lo: int, hi: int) -> bool:
        """Whether one more character, some code point in [lo, hi], can follow."""
        n = self.node
        left = None if n.max_length is None else n.max_length - self.count - 1  # characters after this one
        return (lo <= hi and (left is None or left >= 0)
                and (self.nfa is None or n.pattern.admits(self.nfa, lo, hi, left)))

    def _flush(self) -> int:
        """The waiting high surrogate as a character of its own (json.loads keeps a lone one)."""
        h, self.high = self.high, None
        return OK if h is None else self._char(h)

    def step(self, b: int, sp) -> int:
        s = self.state
        if s == 0:
            self.state = 1
            return OK if b == 0x22 else REJECT
        if s == 1 and self.need:  # a UTF-8 continuation byte
            if not self.next_lo <= b <= self.next_hi:
                return REJECT
            self.code, self.need = (self.code << 6) | (b & 0x3F), self.need - 1
            self.next_lo, self.next_hi = 0x80, 0xBF
            return self._utf8_may() if self.need else self._char(self.code)
        if s == 1:
            if b < 0x20:
                return REJECT
            if b == 0x5C:  # an escape writes one more character (a pair's second half: none of its own)
                self.state = 2
                return OK if self.high is not None or self._may(0, 0x10FFFF) else REJECT
            if self._flush() == REJECT:
                return REJECT
            if b == 0x22:
                n = self.node
                ok = self.count >= n.min_length and (self.nfa is None or n.pattern.accepts(self.nfa))
                return DONE if ok else REJECT
            if b < 0x80:
                return self._char(b)
            lead = _UTF8_SECOND.get(b)
            if lead is None:
                return REJECT
            self.need, self.next_lo, self.next_hi = lead
            self.code, self.least = b & (0x3F >> self.need), _UTF8_LEAST[self.need]  # the lead's payload bits
            return self._utf8_may()
        if s == 2:
            if b == ord("u"):
                self.state, self.need, self.code = 3, 4, 0
                return OK
            self.state = 1
            if b not in _ESCAPES or self._flush() == REJECT:
                return REJECT
            return self._char(_ESCAPED[b])
        if b not in _HEX:
            return REJECT
        self.code, self.need = self.code * 16 + int(chr(b), 16), self.need - 1
        if self.need:
            return OK if (self._second_may() if self.high is not None else self._hex_may()) else REJECT
        self.state, c = 1, self.code
        if self.high is not None and 0xDC00 <= c <= 0xDFFF:  # the pair's second half: one character
            c, self.high = 0x10000 + ((self.high - 0xD800) << 10) + (c - 0xDC00), None
            return self._char(c)
        if self._flush() == REJECT:
            return REJECT
        if 0xD800 <= c <= 0xDBFF:  # a lone surrogate, or the first half of an astral character
            self.high, base = c, 0x10000 + ((c - 0xD800) << 10)
            return OK if self._may(c, c) or self._may(base, base + 0x3FF) else REJECT
        return self._char(c)

    def _digits(self) -> tuple[int, int]:
        """The code units the \\u digits so far can still end as."""
        span = 16 ** self.need
        return self.code * span, self.code * span + span - 1

    def _hex_may(self, lo: int | None = None, hi: int | None = None) -> bool:
        """Whether the \\u digits so far (their code units within [lo, hi] where given) can still end in a
        character that fits: itself, or a high surrogate's astral pair."""
        d_lo, d_hi = self._digits()
        lo, hi = d_lo if lo is None else max(lo, d_lo), d_hi if hi is None else min(hi, d_hi)
        hs_lo, hs_hi = max(lo, 0xD800), min(hi, 0xDBFF)
        return self._may(lo, hi) or (hs_lo <= hs_hi and self._may(0x10000 + ((hs_lo - 0xD800) << 10),
                                                                  0x10000 + ((hs_hi - 0xD800) << 10) + 0x3FF))

    def _second_may(self) -> bool:
        """With a high surrogate waiting: whether the \\u digits so far can still end as its pair's second half
        (the astral character fits), or, the high kept alone (json.loads keeps a lone one), as a code unit of their
        own that fits after it (a low half would pair, so not those)."""
        lo, hi = self._digits()
        low_lo, low_hi = max(lo, 0xDC00), min(hi, 0xDFFF)
        base = 0x10000 + ((self.high - 0xD800) << 10)
        if low_lo <= low_hi and self._may(base + low_lo - 0xDC00, base + low_hi - 0xDC00):
            return True
        alone = self.copy()
        h, alone.high = alone.high, None
        return alone._char(h) == OK and (alone._hex_may(hi=0xDBFF) or alone._hex_may(lo=0xE000))

    def _utf8_may(self) -> int:
        lo = self.code << (6 * self.need)
        hi = min(lo | ((1 << (6 * self.need)) - 1), 0x10FFFF)
        return OK if self._may(max(lo, self.least), hi) else REJECT


def _float(x: Fraction) -> float:
    """x as json.loads reads its decimal text: correctly rounded, past the largest float an infinity."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _floats_meet(a: Fraction, b: Fraction, bounds: Bounds) -> bool:
    """Whether a fraction in [a, b) within the bounds can still read (json.loads' float) as a float within them too:
    past 17 digits at an exclusive bound every value left rounds onto it (0.99999999999999999 under
    exclusiveMaximum 1 reads as 1.0), and no digit more brings it back."""
    lower = a if bounds.lo is None else max(a, bounds.lo)
    upper = b if bounds.hi is None else min(b, bounds.hi)
    f_lo, f_hi = _float(lower), _float(upper)  # every float between is some value's of [lower, upper], rounded
    if bounds.lo is not None:
        lo = _float(bounds.lo)
        f_lo = max(f_lo, math.nextafter(lo, math.inf) if bounds.lo_strict else lo)
    if bounds.hi is not None:
        hi = _float(bounds.hi)
        f_hi = min(f_hi, math.nextafter(hi, -math.inf) if bounds.hi_strict else hi)
    return f_lo <= f_hi


_UTF8_LEAST = {1: 0x80, 2: 0x800, 3: 0x10000}  # the least code point of each length (shorter forms are overlong)
_ESCAPED = {ord('"'): 0x22, ord("\\"): 0x5C, ord("/"): 0x2F, ord("b"): 0x08, ord("f"): 0x0C, ord("n"): 0x0A,
            ord("r"): 0x0D, ord("t"): 0x09}


class Number(Frame):
    """A number from its first byte. Under bounds: no exponent, and each byte only where some in-range number
    still begins with the text so far (`_reachable`); it may end only in range."""

    # after "-", a leading 0, integer digits, ".", fraction digits, "e", the exponent's sign, exponent digits
    MINUS, ZERO, INT, DOT, FRAC, E, ESIGN, EXP = range(8)
    ENDS = (ZERO, INT, FRAC, EXP)

    def __init__(self, integer: bool, bounds: Bounds | None = None):
        self.integer, self.state, self.bounds, self.text = integer, None, bounds, ""

    def step(self, b: int, sp) -> int:
        r = self._grammar(b)
        if r != OK or self.bounds is None:
            return r if r != PASS or self.bounds is None or self.can_end() else REJECT
        if self.state in (self.E, self.ESIGN, self.EXP):
            return REJECT
        self.text += chr(b)
        return OK if self._reachable() else REJECT

    def _reachable(self) -> bool:
        """Whether some number within the bounds is written with self.text as its prefix (no exponent)."""
        neg = self.text.startswith("-")
        body, bounds = self.text[neg:], self.bounds.negated() if neg else self.bounds  # bounds of the magnitude
        if not body:  # "-": any magnitude
            return bounds.meets(Fraction(0), None, self.integer)
        whole, _, frac = body.partition(".")
        if "." in body:  # [whole.frac, whole.frac + 10^-len(frac))
            a = Fraction(int(whole + frac), 10 ** len(frac))
            b = a + Fraction(1, 10 ** len(frac))
            return bounds.meets(a, b, False) and _floats_meet(a, b, bounds)
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
        # exact, and where json.loads reads it as a float (a fraction), as that float too: an exclusive bound could
        # otherwise round away (an integer's text it reads exactly, as an int)
        floats = any(c in self.text for c in ".eE")
        return self.bounds is None or (self.bounds.holds(Fraction(self.text))
                                       and (not floats or self.bounds.holds_float(float(self.text))))

    def _grammar(self, b: int) -> int:
        s, digit = self.state, b in DIGITS
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
            return PASS if s in self.ENDS else REJECT
        return OK
