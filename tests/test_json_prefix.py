"""json_schema.JSON_OBJECT (the json_object constraint) against Python's json parser (the oracle).

- Every prefix of a serialized JSON object (random nesting, strings with escapes and non-ASCII text, numbers of
  every form, literals; compact, spaced or indented) is accepted, fed whole or split into random pieces; the
  object is complete exactly at its last byte (and stays so through trailing whitespace).
- Random one-byte edits of those texts (ASCII bytes): whenever the automaton accepts the whole text and calls it
  complete, json.loads parses it to an object; whenever json.loads parses it to an object, the automaton accepts it
  and calls it complete. The text is decoded as the server decodes a reply (bytes that are not UTF-8 become
  U+FFFD), so an edit inside a multi-byte character still leaves valid JSON.
"""

from __future__ import annotations

import json
import random

import pytest

from ninfer_rt.json_automaton import SchemaPrefix
from ninfer_rt.json_schema import JSON_OBJECT


def json_object_prefix() -> SchemaPrefix:
    return SchemaPrefix(JSON_OBJECT)


def random_value(rng: random.Random, depth: int):
    kind = rng.choice(["obj", "arr", "str", "int", "float", "lit"] if depth < 4 else ["str", "int", "float", "lit"])
    if kind == "obj":
        return {random_string(rng): random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if kind == "arr":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "str":
        return random_string(rng)
    if kind == "int":
        return rng.choice([0, -0, 7, -42, 10**rng.randint(0, 30), -(2**63)])
    if kind == "float":
        return rng.choice([0.5, -1.25e-7, 3.0e21, 1e300, -0.0, rng.uniform(-1e6, 1e6)])
    return rng.choice([True, False, None])


def random_string(rng: random.Random) -> str:
    alphabet = 'ab "\\/\n\t\x01\x1f é漢😀'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))


def dumps(rng: random.Random, obj) -> bytes:
    style = rng.choice([dict(separators=(",", ":")), dict(indent=rng.randint(0, 3)), {}])
    text = json.dumps(obj, ensure_ascii=rng.random() < 0.5, **style)
    return (" " * rng.randint(0, 2) + text).encode()


def reject(name: str):
    raise ValueError(f"{name} is not JSON")  # Python's json takes NaN and Infinity; RFC 8259 does not


def feeds(data: bytes) -> tuple[bool, bool]:
    """(every byte accepted, and then the object complete)."""
    j = json_object_prefix()
    accepted = j.feed(data)
    return accepted, accepted and j.complete


def documents(seed: int, n: int):
    rng = random.Random(seed)
    for _ in range(n):
        obj = {random_string(rng): random_value(rng, 1) for _ in range(rng.randint(0, 4))}
        yield rng, dumps(rng, obj)


@pytest.mark.parametrize("seed", range(4))
def test_every_prefix_of_an_object_is_accepted_and_only_the_whole_is_complete(seed):
    for rng, data in documents(seed, 60):
        j = json_object_prefix()
        for i, b in enumerate(data):
            assert j.feed(bytes([b])), f"byte {i} of {data!r} refused"
            assert j.complete == (i == len(data) - 1), f"complete is wrong at byte {i} of {data!r}"
        assert j.feed(b" \n\t") and j.complete
        cuts = sorted(rng.sample(range(1, len(data)), min(3, len(data) - 1)))
        k = json_object_prefix()
        assert all(k.feed(piece) for piece in (data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])))
        assert k.complete


@pytest.mark.parametrize("seed", range(4))
def test_edited_texts_agree_with_json_loads(seed):
    for rng, data in documents(100 + seed, 60):
        for _ in range(10):
            i = rng.randrange(len(data))
            edited = data[:i] + bytes([rng.choice(b'{}[]:,"\\ 0123456789.eE+-tfnrulsax\x01')]) + data[i + 1:]
            try:  # bytes that are not UTF-8 are refused (the server would send them as U+FFFD)
                parsed = json.loads(edited.decode("utf-8"), parse_constant=reject)
            except ValueError:  # UnicodeDecodeError among them
                parsed = None
            accepted, complete = feeds(edited)
            is_object = isinstance(parsed, dict)
            assert (accepted and complete) == is_object, (edited, accepted, complete, parsed)


@pytest.mark.parametrize("text, accepted, complete", [
    (b'{"a": 1}', True, True),
    (b'{"a": 1', True, False),         # a prefix, still open
    (b'{"a": 1.5e-3, "b": -0}', True, True),
    (b'[1, 2]', False, False),         # the top level is an object
    (b'"a"', False, False),
    (b'{"a": 01}', False, False),      # no leading zero
    (b'{"a": 1.}', False, False),      # a digit after the point
    (b'{"a": 1e+}', False, False),     # a digit in the exponent
    (b'{"a": -}', False, False),
    (b'{"a": tru}', False, False),
    (b'{"a": "\x1f"}', False, False),  # raw control characters in a string
    (b'{"a": "\\q"}', False, False),   # an escape JSON does not have
    (b'{"a": "\\u12G4"}', False, False),
    (b'{"a": "\\u12aF"}', True, True),
    (b'{"a" 1}', False, False),        # the colon
    (b'{1: 2}', False, False),         # keys are strings
    (b'{"a": 1,}', False, False),      # no trailing comma
    (b'{"a": [1,]}', False, False),
    (b'{} {}', False, False),          # one value only
    (b'{"\xe6\xbc', True, False),      # part of a UTF-8 character in a string: a token may end there
])
def test_the_grammar_edges(text, accepted, complete):
    assert feeds(text) == (accepted, complete)


def test_a_copy_is_independent():
    j = json_object_prefix()
    assert j.feed(b'{"a": [')
    c = j.copy()
    assert not c.feed(b"}") and j.feed(b"1]}") and j.complete


def test_whitespace_runs_are_bounded_outside_strings():
    """At most MAX_WHITESPACE_RUN whitespace bytes in a row between the text's tokens (before the object, inside it,
    after it), however they are split into pieces and copies; a run restarts after any other byte, and spaces inside
    a string (a key or a value) are its characters, unbounded."""
    from ninfer_rt.json_automaton import MAX_WHITESPACE_RUN as N

    def accepts(*pieces: bytes) -> bool:
        p = json_object_prefix()
        for piece in pieces:
            q = p.copy()  # as Batch tries a token on a copy
            if not q.feed(piece):
                return False
            p = q
        return True

    run = b"\n" + b" " * (N - 1)
    assert accepts(run, b'{"a":', run, b"1", run, b"}", run)
    assert not accepts(run + b" ", b'{"a": 1}')
    assert not accepts(b'{"a":', run[:N // 2], run[N // 2:] + b"\t")  # split across pieces, still one run
    assert not accepts(b'{"a": 1}', run, b" ")
    assert accepts(b'{"' + b" " * 4 * N + b'": "' + b" " * 4 * N + b'"}')
    assert json.loads(b'{"a":' + run + b"1}") == {"a": 1}  # the longest run allowed is still JSON
