"""JsonTokens (ninfer_rt.json_tokens): allows and the plain-string bitmask against the automaton itself, token by
token (copy + feed, written out here), over the tiny model's vocabulary and a synthetic one of random bytes (quotes,
backslashes, controls, cut and malformed UTF-8, JSON punctuation, stop, added and empty tokens). Bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.json_automaton import SchemaPrefix
from ninfer_rt.json_scalars import keeps_plain_string
from ninfer_rt.json_schema import JSON_OBJECT, compile_schema
from ninfer_rt.json_tokens import MASK_CACHE, ByteTokens, JsonTokens, plain_length

TEXT = {"type": "object", "properties": {"text": {"type": "string"}}}
PAIR = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a", "b"],
        "additionalProperties": False}
STRINGS = {"type": "array", "items": {"type": "string"}}
# plain string states: (schema, bytes fed so far)
PLAIN = [(TEXT, b'{"text": "ab'), ({"type": "string"}, b'"'), (STRINGS, b'["x", "\xc3\xa9'),
         (TEXT, b'{"text": "a\\n'), (PAIR, b'{"a": "x'), (JSON_OBJECT, b'{"k": "v'),
         ({"type": "array", "items": PAIR}, b'[{"a": "')]
PLAIN_IDS = ["object value", "top-level", "array item", "after an escape", "then an integer", "any value",
             "object in an array"]
# pieces of the synthetic tokens: JSON punctuation around a string's end, escapes good and bad, controls, whole, cut
# and malformed UTF-8 (overlong, surrogate, past U+10FFFF), plain text
PIECES = [b'"', b"\\", b'"}', b'",', b'": "', b'", "b": ', b'", "b": 12}', b'"]', b'"}]', b'", "', b"\\n", b'\\"',
          b"\\u00e9", b"\\u12g", b"\\ud83d", b"\\x", b"\n", b"\t", b"\x00", b"\x1f", b"\x7f", b"\xc3", b"\xa9",
          b"\xe4\xb8", b"\xe4\xb8\xad", b"\xf0\x9f\x98\x80", b"\xf0\x9f", b"\xc0\x80", b"\xed\xa0\x80",
          b"\xf4\x90\x80\x80", " é".encode(), "中文".encode(), b" word", b"ab", b"1", b"}", b",", b" ", b"{", b"[",
          b'"b', b":", b"  "]


def synthetic(rng, n: int = 3000) -> Tokens:
    """n tokens: one of each piece, then 1-4 pieces joined, random bytes (any of 256) and plain ASCII words; a few
    empty ones; 5 stop ids, 5 added, one of them both."""
    table = list(PIECES) + [b"", b"", b'"}'] + [bytes(range(0x20, 0x7f))]
    while len(table) < n:
        kind = rng.integers(3)
        if kind == 0:
            table.append(b"".join(PIECES[i] for i in rng.integers(len(PIECES), size=int(rng.integers(1, 5)))))
        elif kind == 1:
            table.append(bytes(rng.integers(256, size=int(rng.integers(1, 5))).tolist()))
        else:
            table.append(b" " + bytes(rng.integers(0x61, 0x7b, size=int(rng.integers(1, 8))).tolist()))
    ids = rng.permutation(n)[:9].tolist()
    return ByteTokens(table, stops=set(ids[:5]), added=set(ids[4:]))


def prefix(schema, data: bytes) -> SchemaPrefix:
    """The automaton of schema (a dict, or an already compiled Node) after data."""
    c = SchemaPrefix(compile_schema(schema) if isinstance(schema, dict) else schema)
    assert c.feed(data)
    return c


def state(c: SchemaPrefix) -> tuple:
    return c.ws, tuple(p.key() for p in c.parses)


def oracle(tok, vocab: int, c: SchemaPrefix) -> tuple[np.ndarray, list]:
    """Each token by the rule itself: stop ids where c is complete; no added id, nothing once closed; else copy +
    feed of its bytes. The allowed ids as bools, and the state each leaves (None: refused)."""
    ok, after = np.zeros(vocab, dtype=bool), []
    for t in range(vocab):
        if tok.is_stop(t):
            a = c if c.complete else None
        elif c.closed or tok.is_added(t):
            a = None
        else:
            a = c.copy()
            a = a if a.feed(tok.token_bytes(t)) else None
        ok[t] = a is not None
        after.append(a)
    return ok, after


def unpack(mask: np.ndarray) -> np.ndarray:
    """The mask's bits as bools, bit t & 31 of word t >> 5 at index t."""
    return np.unpackbits(mask.astype("<u4").view(np.uint8), bitorder="little").astype(bool)


def check_against_oracle(tok, vocab: int, c: SchemaPrefix) -> None:
    """mask equals the oracle bit for bit (with a spare word of zeros), and allows agrees token by token."""
    ok, after = oracle(tok, vocab, c)
    jt, words, before = JsonTokens(tok, vocab), -(-vocab // 32) + 1, state(c)
    mask = jt.mask(c, words)
    assert mask.dtype == np.uint32 and mask.shape == (words,)
    bits = unpack(mask)
    assert not bits[vocab:].any()
    wrong = np.flatnonzero(bits[:vocab] != ok)
    assert wrong.size == 0, [(int(t), tok.token_bytes(int(t)), bool(ok[t])) for t in wrong[:8]]
    for t in range(vocab):
        got = jt.allows(c, t)
        assert (got is None) == (after[t] is None), (t, tok.token_bytes(t))
        if got is not None:
            assert state(got) == state(after[t]), (t, tok.token_bytes(t))
    assert state(c) == before  # neither changed c


@pytest.mark.parametrize("schema,data", PLAIN, ids=PLAIN_IDS)
def test_tiny_vocabulary_against_the_automaton(packed_model, schema, data):
    c = prefix(schema, data)
    assert c.in_plain_string
    check_against_oracle(packed_model.tokenizer, packed_model.real_vocab_size, c)


@pytest.mark.parametrize("schema,data", PLAIN, ids=PLAIN_IDS)
def test_synthetic_vocabulary_against_the_automaton(schema, data, rng):
    c = prefix(schema, data)
    assert c.in_plain_string
    check_against_oracle(synthetic(rng), 3000, c)


def test_plain_length_is_keeps_plain_strings_longest_prefix(rng):
    """The split's prefix is plain (or empty) and no longer one is; a token is plain iff non-empty and all prefix."""
    for d in synthetic(rng).tokens:
        k = plain_length(d)
        assert keeps_plain_string(d) == (bool(d) and k == len(d)), d
        assert k == 0 or keeps_plain_string(d[:k]), d
        assert not any(keeps_plain_string(d[:k + j]) for j in range(1, min(4, len(d) - k) + 1)), d


@pytest.mark.parametrize("schema,data", [
    (TEXT, b'{"text": '),  # before the quote
    (TEXT, b'{"te'),  # a key
    (TEXT, b'{"text": "a\\'),  # an escape pending
    (TEXT, b'{"text": "a\\u00'),  # \u digits pending
    (TEXT, b'{"text": "a\xc3'),  # a character's bytes pending
    ({"type": "string", "maxLength": 8}, b'"ab'),  # a checked string
    ({"type": "string"}, b'"ab"'),  # closed
    (PAIR, b'{"a": "x", "b": 1'),  # a number
], ids=["before the quote", "key", "escape", "hex digits", "mid-character", "checked string", "closed", "number"])
def test_no_mask_outside_a_plain_string(rng, schema, data):
    c = prefix(schema, data)
    assert not c.in_plain_string
    assert JsonTokens(synthetic(rng, 200), 200).mask(c, 7) is None


def test_too_few_words_raise(rng):
    jt = JsonTokens(synthetic(rng, 200), 200)
    assert jt.mask(prefix(TEXT, b'{"text": "'), 7) is not None  # 224 bits
    for c in (prefix(TEXT, b'{"text": "'), prefix(TEXT, b'{"text": ')):  # checked before the state
        with pytest.raises(ValueError, match="fewer than"):
            jt.mask(c, 6)


def test_stop_ids_follow_complete(rng):
    """No plain string is complete (an open string cannot end the value), so stop ids are never in the mask; where a
    state says it is complete, every stop id is, an added one too (stop first, as allows decides)."""
    tok = synthetic(rng, 500)
    jt, stops = JsonTokens(tok, 500), sorted(tok.stops)
    for schema, data in PLAIN:
        c = prefix(schema, data)
        assert not c.complete
        assert not unpack(jt.mask(c, 16))[stops].any()
        assert all(jt.allows(c, t) is None for t in stops)

    class Complete(SchemaPrefix):
        complete = True

    d = Complete.__new__(Complete)
    d.parses, d.ws = prefix(TEXT, b'{"text": "').parses, 0
    bits = unpack(JsonTokens(tok, 500).mask(d, 16))
    assert bits[stops].all() and not bits[sorted(tok.added - tok.stops)].any()
    assert all(jt.allows(d, t) is d for t in stops)


def test_empty_bytes_token_is_allowed_in_a_string():
    """allows feeds an empty token (keeps_plain_string(b"") is False), and feeding nothing succeeds: a copy of c."""
    tok = ByteTokens([b"", b"a", b'"'], stops=set(), added=set())
    jt, c = JsonTokens(tok, 3), prefix(TEXT, b'{"text": "')
    got = jt.allows(c, 0)
    assert got is not None and got is not c and state(got) == state(c)
    assert jt.allows(c, 1) is c
    assert unpack(jt.mask(c, 1))[:3].tolist() == [True, True, True]
    assert unpack(jt.mask(prefix({"type": "string"}, b'"'), 1))[:3].tolist() == [True, True, True]


def test_masks_are_cached_read_only_per_state(rng):
    """Equal states of one compiled schema share one mask object, whatever bytes led there (the key names nodes by
    identity: another compile of the same schema is another state); it cannot be written; a different word count is
    its own entry; at most MASK_CACHE entries are kept."""
    jt, text = JsonTokens(synthetic(rng, 300), 300), compile_schema(TEXT)
    a = jt.mask(prefix(text, b'{"text": "ab'), 10)
    assert jt.mask(prefix(text, b'{"text": "xyz \xc3\xa9'), 10) is a
    assert not a.flags.writeable
    with pytest.raises(ValueError):
        a[0] = 0
    b = jt.mask(prefix(text, b'{"text": "ab'), 12)
    assert b.shape == (12,) and (b[:10] == a).all() and not b[10:].any()
    node = compile_schema(STRINGS)
    for n in range(MASK_CACHE + 5):  # distinct states: the array counts its items
        jt.mask(prefix(node, b"[" + b'"", ' * n + b'"'), 10)
    assert len(jt._masks) == MASK_CACHE
