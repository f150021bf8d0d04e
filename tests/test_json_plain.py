"""The plain-string shortcut: json_scalars.keeps_plain_string (a token's bytes) and SchemaPrefix.in_plain_string (the
state), which Batch._allows trusts to skip the copy and the feed. Oracle: the automaton itself (SchemaPrefix.feed)
and the state it leaves (each reading's key)."""

from __future__ import annotations

import itertools

import pytest

from ninfer_rt.json_automaton import SchemaPrefix
from ninfer_rt.json_scalars import keeps_plain_string
from ninfer_rt.json_schema import JSON_OBJECT, compile_schema

TEXT = {"type": "object", "properties": {"text": {"type": "string"}}}
# plain string states: (schema, bytes fed so far)
PLAIN = [(TEXT, b'{"text": "ab'), ({"type": "string"}, b'"'), ({"type": "array", "items": {"type": "string"}},
         b'["x", "\xc3\xa9'), (TEXT, b'{"text": "a\\n')]


def state(c: SchemaPrefix) -> tuple:
    return c.ws, tuple(p.key() for p in c.parses)


def prefix(schema, data: bytes) -> SchemaPrefix:
    """The automaton of schema (a dict, or an already compiled Node) after data."""
    c = SchemaPrefix(compile_schema(schema) if isinstance(schema, dict) else schema)
    assert c.feed(data)
    return c


def probes(rng) -> list[bytes]:
    """Every string of 1 and 2 bytes, then 20,000 random ones of 3-6 bytes drawn from ASCII, UTF-8 leads and
    continuation bytes (so whole and cut characters both come up)."""
    pool = list(range(0x20, 0x7F)) + [0x00, 0x0A, 0x1F, 0x7F] + list(range(0x80, 0x100))
    out = [bytes([a]) for a in range(256)] + [bytes(p) for p in itertools.product(range(256), repeat=2)]
    out += [bytes(rng.choice(pool, size=int(rng.integers(3, 7))).tolist()) for _ in range(20_000)]
    return out


@pytest.mark.parametrize("schema,data", PLAIN, ids=["object value", "top-level", "array item", "after an escape"])
def test_a_plain_token_leaves_the_state_as_it_was_and_only_those(schema, data, rng):
    """From a plain string state: a keeps_plain_string token is accepted and leaves the state equal; a token with
    no quote or backslash that the automaton accepts and leaves equal is one keeps_plain_string names (so the
    shortcut misses none that it could take)."""
    c = prefix(schema, data)
    assert c.in_plain_string
    before, taken = state(c), 0
    for d in probes(rng):
        after = c.copy()
        same = after.feed(d) and state(after) == before
        if keeps_plain_string(d):
            assert same, d
            taken += 1
        elif b'"' not in d and b"\\" not in d:
            assert not same, d
    assert taken > 9000  # printable ASCII pairs alone are 93² = 8,649


@pytest.mark.parametrize("data,plain", [
    (b"a", True), (b" ", True), (b"~", True), (b"\x7f", True), ("é".encode(), True), ("€".encode(), True),
    ("😀".encode(), True), (b"hello world", True), (b"", False), (b'"', False), (b"\\", False), (b"\n", False),
    (b"\x1f", False), (b"\xc3", False), (b"a\xc3", False), (b"\xa9", False), (b"\xc0\x80", False),
    (b"\xed\xa0\x80", False), (b"\xf4\x90\x80\x80", False), (b'ab"', False)])
def test_keeps_plain_string_by_hand(data, plain):
    assert keeps_plain_string(data) is plain


@pytest.mark.parametrize("schema,data,plain", [
    (TEXT, b'{"text": "', True),
    (TEXT, b'{"text": ', False),  # before the quote
    (TEXT, b'{"te', False),  # a key: its bytes are kept
    (TEXT, b'{"text": "a\\', False),  # an escape pending
    (TEXT, b'{"text": "a\xc3', False),  # a character's bytes pending
    ({"type": "string", "maxLength": 8}, b'"ab', False),  # a checked string counts characters
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, b'["ab', False),  # an item recorded
    ({"anyOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, b'"a', False),  # two readings
    (JSON_OBJECT, b'{"k": "v', True),
])
def test_in_plain_string_only_where_a_plain_token_changes_nothing(schema, data, plain):
    assert prefix(schema, data).in_plain_string is plain


def test_batch_allows_takes_the_shortcut_and_agrees_with_the_automaton(packed_model):
    """Every token of the tiny vocabulary from a plain string state: Batch._allows answers what copy + feed
    answers (the same state, or None), returning the state itself wherever the shortcut took the token."""
    batch, tok = packed_model.batch(), packed_model.tokenizer
    c = prefix(TEXT, b'{"text": "ab')
    before, shortcut = state(c), 0
    for t in range(packed_model.real_vocab_size):
        got = batch._allows(c, t)
        assert state(c) == before  # never changed in place
        if tok.is_stop(t) or tok.is_added(t):
            assert got is None, t  # the value is not complete
            continue
        ref = c.copy()
        ok = ref.feed(tok.token_bytes(t))
        assert (got is not None) == ok, t
        if ok:
            assert state(got) == state(ref), t
        shortcut += got is c
    assert shortcut > 0
