"""JSON Schema's `pattern` as an automaton over a string's characters, for json_automaton's string frames.

`compile_pattern(pattern)` parses the subset of ECMA-262 regular expressions that schemas use and builds a Thompson
NFA over Unicode code points; `Pattern.start()` is the state set before any character, `step(states, c)` the set
after character c (empty: no match can continue), `accepts(states)` whether the characters so far match
(`matches(text)`: of a whole string). JSON Schema patterns are not anchored (a match anywhere in the string, as
`re.search`): a pattern without `^` begins with `.*` in effect, one without `$` ends with it. `lengths(states)`
gives the fewest and the most characters (None: unbounded) that can still complete a match, so a string frame can
also keep minLength and maxLength reachable.

The subset: literals and escaped punctuation, `.` (any character but a line terminator), classes `[...]` / `[^...]`
with ranges (a `]` first in a class is a literal, as Python reads it), `\\d \\w \\s` and their negations (ASCII
digits and word characters, ECMA-262's whitespace), `\\n \\r \\t \\f \\v \\0 \\xHH \\uHHHH`, groups `(...)` and
`(?:...)`, alternation, the quantifiers `* + ? {n} {n,} {n,m}` (lazy forms match the same strings), and `^` / `$` at
the pattern's ends. Anything else (backreferences, lookaround, `\\b`, flags) is a PatternError with a one-line
reason.
"""

from __future__ import annotations

from collections import deque

from ninfer_rt.errors import NinferError

MAX_STATES = 4000  # an NFA larger than this (a {n,m} of thousands) is refused
WORDS_STEPS = 20000  # Pattern.words: states visited before a language counts as too large to list
_LINE_TERMINATORS = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
_CLASS_ESCAPES = {"d": (_DIGIT, False), "D": (_DIGIT, True), "w": (_WORD, False), "W": (_WORD, True),
                  "s": (_SPACE, False), "S": (_SPACE, True)}
_CHAR_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00}
_ANY = (((0, 0x10FFFF),), False)


class PatternError(NinferError):
    """A pattern outside the supported subset of ECMA-262 regular expressions, or a malformed one."""


class Pattern:
    """A Thompson NFA: state i has epsilon moves eps[i] and character moves edges[i] of (ranges, negated, target)."""

    def __init__(self):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple]] = []
        self.accept = -1

    def new(self) -> int:
        if len(self.eps) >= MAX_STATES:
            raise PatternError(f"pattern: more than {MAX_STATES} states (a repetition count too large)")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def closure(self, states) -> frozenset:
        seen, todo = set(states), list(states)
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)

    def start(self) -> frozenset:
        return self._start

    def step(self, states: frozenset, c: int) -> frozenset:
        nxt = [t for s in states for ranges, neg, t in self.edges[s] if _in(c, ranges) != neg]
        return self.closure(nxt) if nxt else frozenset()

    def accepts(self, states: frozenset) -> bool:
        return self.accept in states

    def matches(self, text: str) -> bool:
        """Whether the pattern matches the whole string as JSON Schema reads it (a match anywhere, unless anchored)."""
        states = self._start
        for ch in text:
            states = self.step(states, ord(ch))
        return self.accepts(states)

    def admits(self, states: frozenset, lo: int, hi: int, within: int | None = None) -> bool:
        """Some character in [lo, hi] has a move from these states (to one from which a match needs at most
        `within` more characters, where given)."""
        def fits(t: int) -> bool:
            return within is None or (self._min[t] is not None and self._min[t] <= within)

        return any(_meets(ranges, neg, lo, hi) and fits(t) for s in states for ranges, neg, t in self.edges[s])

    def words(self, min_len: int = 0, max_len: int | None = None, cap: int = 256) -> list[str] | None:
        """Every string the pattern matches with min_len..max_len characters, in code point order, where they are
        at most cap and found within WORDS_STEPS steps (a finite key set: json_schema's finite_keys); else None."""
        out, budget = [], [WORDS_STEPS]

        def walk(states: frozenset, prefix: str) -> bool:
            budget[0] -= 1
            fewest, most = self.lengths(states)
            if budget[0] < 0 or (most is None and max_len is None):
                return False  # too many steps, or unboundedly long matches
            if self.accepts(states) and len(prefix) >= min_len:
                out.append(prefix)
            if len(out) > cap or fewest is None or (max_len is not None and len(prefix) >= max_len):
                return len(out) <= cap
            points: set[int] = set()
            for s in states:
                for ranges, negated, _ in self.edges[s]:
                    if negated or sum(b - a + 1 for a, b in ranges) > cap:
                        return False  # a class of more characters than the cap allows strings
                    points.update(c for a, b in ranges for c in range(a, b + 1))
            return all(walk(nxt, prefix + chr(c)) for c in sorted(points) if (nxt := self.step(states, c)))

        return out if walk(self._start, "") else None

    def lengths(self, states: frozenset) -> tuple[int | None, int | None]:
        """(fewest, most) characters that complete a match from these states; most None: unbounded. (None, 0) where
        none can."""
        lo = [self._min[s] for s in states if self._min[s] is not None]
        hi = [self._max[s] for s in states if self._min[s] is not None]
        if not lo:
            return None, 0
        return min(lo), None if any(h is None for h in hi) else max(hi)

    def _distances(self) -> None:
        """Per state, the fewest and the most characters to the accept state (None: it cannot / without bound):
        a 0-1 BFS backwards for the fewest; for the most, the strongly connected components (Kosaraju) of the
        states that can reach accept, unbounded where a component holds a character move or reaches one that does."""
        n = len(self.eps)
        succ = [[(t, 0) for t in self.eps[s]] + [(t, 1) for r, neg, t in self.edges[s] if _meets(r, neg, 0, 0x10FFFF)]
                for s in range(n)]
        pred: list[list] = [[] for _ in range(n)]
        for s in range(n):
            for t, w in succ[s]:
                pred[t].append((s, w))
        low: list = [None] * n
        low[self.accept] = 0
        dq = deque([self.accept])
        while dq:
            t = dq.popleft()
            for s, w in pred[t]:
                if low[s] is None or low[t] + w < low[s]:
                    low[s] = low[t] + w
                    (dq.append if w else dq.appendleft)(s)
        comp = _components(n, succ, pred, [x is not None for x in low])
        m = max(comp) + 1
        cyclic, out = [False] * m, [set() for _ in range(m)]
        for s in range(n):
            for t, w in succ[s]:
                if comp[s] < 0 or comp[t] < 0:
                    continue
                if comp[s] == comp[t]:
                    cyclic[comp[s]] |= bool(w)
                else:
                    out[comp[s]].add((comp[t], w))
        high, unbounded = [0] * m, cyclic[:]
        for c in reversed(range(m)):  # Kosaraju numbers the components in topological order: successors later
            for d, w in out[c]:
                unbounded[c] |= unbounded[d]
                high[c] = max(high[c], high[d] + w)
        self._min = low
        self._max = [None if comp[s] < 0 or unbounded[comp[s]] else high[comp[s]] for s in range(n)]


def _components(n: int, succ, pred, useful) -> list[int]:
    """Kosaraju's strongly connected components of the useful states (others -1), numbered so that every edge
    between two components goes to a larger number."""
    order, seen = [], [False] * n
    for root in range(n):
        if seen[root] or not useful[root]:
            continue
        seen[root] = True
        stack = [(root, iter(succ[root]))]
        while stack:
            s, it = stack[-1]
            for t, _ in it:
                if useful[t] and not seen[t]:
                    seen[t] = True
                    stack.append((t, iter(succ[t])))
                    break
            else:
                stack.pop()
                order.append(s)
    comp, m = [-1] * n, 0
    for root in reversed(order):
        if comp[root] >= 0:
            continue
        comp[root], todo = m, [root]
        while todo:
            t = todo.pop()
            for s, _ in pred[t]:
                if useful[s] and comp[s] < 0:
                    comp[s] = m
                    todo.append(s)
        m += 1
    return comp


def _in(c: int, ranges) -> bool:
    return any(lo <= c <= hi for lo, hi in ranges)


def _meets(ranges, negated: bool, lo: int, hi: int) -> bool:
    """Some c in [lo, hi] with _in(c, ranges) != negated."""
    if not negated:
        return any(a <= hi and lo <= b for a, b in ranges)
    at = lo  # negated: [lo, hi] not wholly covered by the ranges
    for a, b in sorted(ranges):
        if a > at:
            break
        at = max(at, b + 1)
    return at <= hi


def compile_pattern(pattern: str) -> Pattern:
    """The NFA of a JSON Schema `pattern` (unanchored unless it starts with ^ / ends with $); PatternError outside
    the subset."""
    if not isinstance(pattern, str):
        raise PatternError("pattern must be a string")
    body, head, tail = pattern, True, True
    if body.startswith("^"):
        body, head = body[1:], False
    if body.endswith("$") and (len(body) - 1 - len(body[:-1].rstrip("\\"))) % 2 == 0:  # not an escaped $
        body, tail = body[:-1], False
    parser = _Parser(body)
    try:
        tree = parser.alternation()
    except RecursionError:
        raise PatternError("pattern: nested too deeply") from None
    if parser.i != len(body):
        raise PatternError(f"pattern: unexpected {body[parser.i]!r} at {parser.i + (not head)}")
    if tree[0] == "alt" and not (head and tail):
        raise PatternError("pattern: ^ or $ beside a top-level | is not supported (group the alternatives)")
    dot_star = ("rep", ("set", *_ANY), 0, None)
    tree = ("cat", [dot_star] * head + [tree] + [dot_star] * tail)
    p = Pattern()
    try:
        start, end = _build(p, tree)
    except RecursionError:
        raise PatternError("pattern: nested too deeply") from None
    p.accept = end
    p._start = p.closure([start])
    p._distances()
    return p


class _Parser:
    """Recursive descent over the pattern: alternation of sequences of quantified atoms; trees of ("set", ranges,
    negated), ("cat", parts), ("alt", options), ("rep", tree, min, max or None)."""

    def __init__(self, text: str):
        self.t, self.i = text, 0

    def peek(self) -> str | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self) -> str:
        if self.i >= len(self.t):
            raise PatternError("pattern: ends inside a construct")
        self.i += 1
        return self.t[self.i - 1]

    def alternation(self):
        options = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self):
        parts = []
        while self.peek() not in (None, "|", ")"):
            parts.append(self.quantified())
        return ("cat", parts)

    def quantified(self):
        atom = self.atom()
        while self.peek() in ("*", "+", "?", "{"):
            c = self.peek()
            if c == "{":
                bounds = self.braces()
                if bounds is None:
                    break
                lo, hi = bounds
            else:
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            if self.peek() == "?":  # lazy: the same strings match
                self.i += 1
            atom = ("rep", atom, lo, hi)
            if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self._counted()):
                raise PatternError(f"pattern: nothing to repeat at {self.i} (a quantifier after a quantifier)")
        return atom

    def _counted(self) -> bool:
        """Whether a { at self.i opens {n}, {n,} or {n,m}."""
        i = self.i
        try:
            return self.braces() is not None
        finally:
            self.i = i

    def braces(self):
        """{n}, {n,}, {n,m} at self.i, or None where the brace is a literal (as ECMA-262's Annex B reads it)."""
        j = self.t.find("}", self.i)
        inner = self.t[self.i + 1:j] if j > 0 else ""
        a, comma, b = inner.partition(",")
        if not (a.isascii() and a.isdigit()) or (b and not (b.isascii() and b.isdigit())):
            return None
        self.i = j + 1
        lo, hi = int(a), (int(b) if b else None) if comma else int(a)
        if hi is not None and hi < lo:
            raise PatternError(f"pattern: {{{inner}}}: the maximum is below the minimum")
        return lo, hi

    def atom(self):
        c = self.take()
        if c == "(":
            if self.peek() == "?":
                if self.t[self.i:self.i + 2] != "?:":
                    raise PatternError("pattern: lookaround and named groups are not supported")
                self.i += 2
            tree = self.alternation()
            if self.take() != ")":
                raise PatternError("pattern: unbalanced parenthesis")
            return tree
        if c == "[":
            return self.klass()
        if c == ".":
            return ("set", _LINE_TERMINATORS, True)
        if c == "\\":
            return self.escape(in_class=False)
        if c in "*+?":
            raise PatternError(f"pattern: nothing to repeat at {self.i - 1}")
        if c in "^$":
            raise PatternError(f"pattern: {c!r} is supported only at the pattern's start or end")
        if c == ")":
            raise PatternError("pattern: unbalanced parenthesis")
        return ("set", ((ord(c), ord(c)),), False)

    def escape(self, in_class: bool):
        c = self.take()
        if c in _CLASS_ESCAPES:
            return ("set", *_CLASS_ESCAPES[c])
        if c in _CHAR_ESCAPES and not (c == "0" and (self.peek() or "").isdigit()):
            v = _CHAR_ESCAPES[c]
        elif c in "xu":
            n = 2 if c == "x" else 4
            digits = self.t[self.i:self.i + n]
            if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise PatternError(f"pattern: \\{c} needs {n} hex digits")
            self.i += n
            v = int(digits, 16)
        elif c == "b" and in_class:
            v = 0x08
        elif c.isalnum():
            raise PatternError(f"pattern: \\{c} is not supported (backreferences, \\b, \\p, ...)")
        else:
            v = ord(c)  # escaped punctuation stands for itself
        return ("set", ((v, v),), False)

    def klass(self):
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges, first = [], True
        while True:
            c = self.take()
            if c == "]" and not first:
                break
            first = False
            if c == "\\":
                _, r, neg = self.escape(in_class=True)
                if neg:  # [\D] etc.: its complement's ranges
                    r = _complement(r)
                if len(r) > 1 or neg or r[0][0] != r[0][1] or self.peek() != "-":
                    ranges += list(r)
                    continue
                lo = r[0][0]
            else:
                lo = ord(c)
            if self.peek() == "-" and self.t[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                h = self.take()
                if h == "\\":
                    _, r, neg = self.escape(in_class=True)
                    if neg or len(r) > 1 or r[0][0] != r[0][1]:  # [a-\w]: a, "-" and the class (Annex B)
                        ranges += [(lo, lo), (0x2D, 0x2D)] + list(_complement(r) if neg else r)
                        continue
                    hi = r[0][0]
                else:
                    hi = ord(h)
                if hi < lo:
                    raise PatternError("pattern: a class range out of order")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        return ("set", tuple(ranges), negated)


def _complement(ranges) -> tuple:
    out, at = [], 0
    for lo, hi in sorted(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = max(at, hi + 1)
    if at <= 0x10FFFF:
        out.append((at, 0x10FFFF))
    return tuple(out)


def _build(p: Pattern, tree) -> tuple[int, int]:
    """Thompson's construction: the (start, end) states of tree's fragment."""
    kind = tree[0]
    if kind == "set":
        s, e = p.new(), p.new()
        p.edges[s].append((tree[1], tree[2], e))
        return s, e
    if kind == "cat":
        s = e = p.new()
        for part in tree[1]:
            a, b = _build(p, part)
            p.eps[e].append(a)
            e = b
        return s, e
    if kind == "alt":
        s, e = p.new(), p.new()
        for option in tree[1]:
            a, b = _build(p, option)
            p.eps[s].append(a)
            p.eps[b].append(e)
        return s, e
    _, sub, lo, hi = tree  # rep: lo copies, then hi - lo optional ones, or a loop where hi is None
    s = e = p.new()
    for _ in range(lo):
        a, b = _build(p, sub)
        p.eps[e].append(a)
        e = b
    if hi is None:
        a, b = _build(p, sub)
        p.eps[e].append(a)
        p.eps[b].append(a)
        end = p.new()
        p.eps[e].append(end)
        p.eps[b].append(end)
        return s, end
    end = p.new()
    for _ in range(hi - lo):
        a, b = _build(p, sub)
        p.eps[e].append(a)
        p.eps[e].append(end)
        e = b
    p.eps[e].append(end)
    return s, end
