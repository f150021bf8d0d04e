"""Which tokens may continue a JSON-constrained reply: `JsonTokens(tokenizer, vocab)`, one per tokenizer.

    jt = JsonTokens(model.tokenizer, model.real_vocab_size)
    after = jt.allows(c, token)            # c (a SchemaPrefix) advanced over token, or None: what Batch draws against
    bits = jt.mask(c, words)               # inside a plain string: A(c) = {t : allows(c, t) is not None} as bits

Inside a plain string value a row's draws can run ahead on the GPU, each masked on the device to A(c): a drawn token
that keeps the string plain leaves c exactly as it was (json_scalars.keeps_plain_string), so the same mask serves the
next step too. Checking a 248,320-token vocabulary by copy and feed would take over a second a state, so a
once-per-vocabulary pass splits each token's bytes into P + R: P the longest prefix of whole, well-formed UTF-8
characters with no control, quote or backslash (from a plain state it changes nothing, by keeps_plain_string's
contract), R the rest. A token is then taken iff its R is, fed from c:
- R empty (non-empty bytes): a plain token, always taken;
- R not starting with a quote or backslash (a control, a malformed or cut character, or empty bytes): only the plain
  String frame reads it (refused at a byte, or a cut character it waits on), the same in every plain state, so these
  are decided once at construction from a reference plain state;
- R starting with a quote or backslash: the string may close and what follows is the schema's, so these are fed per
  state, once per distinct R, sharing common prefixes (a byte trie walk: a refused prefix refuses its whole subtree).
Masks are cached per state (repeated array items and fields cost a key lookup).
"""

from __future__ import annotations

import itertools
import re
from collections import OrderedDict

import numpy as np

from ninfer_rt.json_automaton import SchemaPrefix
from ninfer_rt.json_scalars import keeps_plain_string
from ninfer_rt.json_schema import compile_schema

MASK_CACHE = 64  # states whose masks are kept, least recently used out first

_SPECIAL = re.compile(r'[\x00-\x1f"\\]')  # the characters a plain string cannot take as they are


def plain_length(data: bytes) -> int:
    """Bytes in data's longest prefix of whole, well-formed UTF-8 characters with no control, quote or backslash:
    keeps_plain_string's characters, by the same strict decoder (so data is plain iff non-empty and all of it)."""
    try:
        text, n = data.decode("utf-8"), len(data)
    except UnicodeDecodeError as e:  # everything before e.start decodes
        text, n = data[:e.start].decode("utf-8"), e.start
    m = _SPECIAL.search(text)
    if m is None:
        return n
    return m.start() if text.isascii() else len(text[:m.start()].encode("utf-8"))


def _walk(c: SchemaPrefix, items: list[tuple[bytes, int]], depth: int, out: np.ndarray) -> None:
    """Set out[g] for each (remainder, g) of items (sorted, distinct, sharing remainder[:depth], which c has taken)
    that c takes whole: remainders sharing a next byte are fed it once, and none of a refused byte's subtree more."""
    for head, group in itertools.groupby(items, key=lambda item: item[0][depth:depth + 1]):
        group = list(group)
        if not head:  # the remainder ends here: c took it all (sorted first of its siblings)
            out[group[0][1]] = True
        elif len(group) == 1:
            r, g = group[0]
            out[g] = c.copy().feed(r[depth:])
        else:
            after = c.copy()
            if after.feed(head):
                _walk(after, group, depth + 1, out)


class ByteTokens:
    """A tokenizer over a list of byte strings (token t's bytes are tokens[t]) with the given stop and added ids:
    what JsonTokens reads of a tokenizer, for a vocabulary known only as bytes (the benches' and tests' tables)."""

    def __init__(self, tokens: list[bytes], stops: frozenset[int] | set[int] = frozenset(),
                 added: frozenset[int] | set[int] = frozenset()):
        self.tokens, self.stops, self.added = tokens, stops, added

    def token_bytes(self, t: int) -> bytes:
        return self.tokens[t]

    def is_stop(self, t: int) -> bool:
        return t in self.stops

    def is_added(self, t: int) -> bool:
        return t in self.added


class JsonTokens:
    """The tokens of a tokenizer's first `vocab` ids that continue a JSON constraint's state: one at a time
    (allows) or, inside a plain string, all at once as a bitmask (mask). tokenizer: token_bytes, is_added and
    is_stop (ninfer_rt.tokenizer.Tokenizer's)."""

    def __init__(self, tokenizer, vocab: int):
        self.tokenizer, self.vocab = tokenizer, vocab
        self._plain: dict[int, bool] = {}  # token id -> keeps_plain_string of its bytes (allows)
        self._masks: OrderedDict[tuple, tuple[SchemaPrefix, np.ndarray]] = OrderedDict()
        self._always: np.ndarray | None = None  # prepare()'s, made by the first mask (a host that masks nothing
        # never pays for the pass: ~0.7 s over a 248K vocabulary)

    def prepare(self) -> None:
        """The once-per-vocabulary pass mask() needs (the module docstring's P + R split); idempotent."""
        if self._always is not None:
            return
        tokenizer, vocab = self.tokenizer, self.vocab
        stops, by_rest = [], {}  # by_rest: remainder R -> its token ids
        always = np.zeros(vocab, dtype=bool)  # taken from every plain state: plain tokens, then the fixed Rs
        for t in range(vocab):
            if tokenizer.is_stop(t):  # before is_added, as allows decides
                stops.append(t)
            elif not tokenizer.is_added(t):
                data = tokenizer.token_bytes(t)
                r = data[plain_length(data):]
                if data and not r:
                    always[t] = True
                else:
                    by_rest.setdefault(r, []).append(t)
        self._stops = np.array(stops, dtype=np.int64)

        fixed = sorted(r for r in by_rest if r[:1] not in (b'"', b"\\"))
        taken = np.zeros(len(fixed), dtype=bool)
        ref = SchemaPrefix(compile_schema({"type": "string"}))  # a plain String frame, as any plain state's
        ref.feed(b'"')
        _walk(ref, [(r, g) for g, r in enumerate(fixed)], 0, taken)
        for r, ok in zip(fixed, taken):
            if ok:
                always[by_rest[r]] = True
        self._always = always

        opened = sorted(r for r in by_rest if r[:1] in (b'"', b"\\"))
        self._open = [(r, g) for g, r in enumerate(opened)]
        self._open_ids = np.array([t for r in opened for t in by_rest[r]], dtype=np.int64)
        self._open_of = np.repeat(np.arange(len(opened)), [len(by_rest[r]) for r in opened])  # each id's R
        self.remainders, self.state_remainders = len(by_rest), len(opened)  # distinct Rs; those a new state feeds

    def allows(self, c: SchemaPrefix, token: int) -> SchemaPrefix | None:
        """c advanced over token's bytes (c itself where they leave it as it is), or None where token cannot continue
        the JSON: an added token, or a stop token before the value is complete (and nothing but a stop token once it
        has closed). c is never changed."""
        tok = self.tokenizer
        if tok.is_stop(token):
            return c if c.complete else None
        if c.closed or tok.is_added(token):
            return None
        if c.in_plain_string:  # most of a string value's tokens leave c as it is: no copy, no feed
            if (plain := self._plain.get(token)) is None:
                plain = self._plain[token] = keeps_plain_string(tok.token_bytes(token))
            if plain:
                return c
        after = c.copy()
        return after if after.feed(tok.token_bytes(token)) else None

    def mask(self, c: SchemaPrefix, words: int) -> np.ndarray | None:
        """A(c) as `words` uint32 words (read-only, cached), bit t & 31 of word t >> 5 set iff t < vocab and
        allows(c, t) is not None; None unless c.in_plain_string (where one mask holds while the string stays plain).
        words * 32 must cover the vocabulary."""
        if words * 32 < self.vocab:
            raise ValueError(f"mask: {words} words hold {words * 32} bits, fewer than the vocabulary's {self.vocab}")
        if not c.in_plain_string:
            return None
        self.prepare()
        key = (words, c.ws, tuple(p.key() for p in c.parses))  # the state (in_plain_string: no item recorded)
        if (hit := self._masks.get(key)) is not None:
            self._masks.move_to_end(key)
            return hit[1]
        bits = np.zeros(words * 32, dtype=bool)
        bits[:self.vocab] = self._always
        taken = np.zeros(len(self._open), dtype=bool)
        _walk(c, self._open, 0, taken)
        bits[self._open_ids[taken[self._open_of]]] = True
        if c.complete:  # allows' rule for stop ids; a plain string is never complete today, nor closed
            bits[self._stops] = True
        out = np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32)
        out.flags.writeable = False
        # the key names schema nodes by id(): the entry holds a copy of c, so they live (and keep their ids) as long
        self._masks[key] = (c.copy(), out)
        if len(self._masks) > MASK_CACHE:
            self._masks.popitem(last=False)
        return out
