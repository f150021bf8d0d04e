"""Liveness of the JSON constraint: a byte is taken only where some valid document still begins with the text.

A dead end (a prefix no byte continues to a valid document) fails the request mid-reply with "no token of the
vocabulary continues the JSON reply". Each case's oracle is read off the schema by hand (which values remain), and
jsonschema agrees on the whole documents; what the compiler can see is unsatisfiable it refuses instead.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction

import jsonschema
import pytest

from ninfer_rt.json_scalars import Bounds
from ninfer_rt.json_schema import (UNIQUE_INTEGER_TEXTS, SchemaError, _integers_within, compile_schema, integer_texts,
                                   value_key)
from test_json_schema import feed_all

BIG = {"type": "integer", "exclusiveMinimum": 2**53, "maximum": 2**53 + 1}  # one value, whose float is 2**53
LANGS = {"type": "object", "patternProperties": {"^(en|fr)$": {"type": "string"}}, "additionalProperties": False}
SMALL_INTS = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 3}, "uniqueItems": True}
TWELVE = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 12}, "uniqueItems": True}


def test_integers_within_bounds_are_counted_as_the_bounds_hold_them():
    """_integers_within (what refuses uniqueItems past the integers a range holds) against Bounds.holds over every
    integer of a window wider than the bounds, on random closed, strict and multipleOf bounds."""
    rng = random.Random()
    for _ in range(500):
        lo, hi = sorted(Fraction(rng.randint(-60, 60), rng.choice([1, 2, 3, 4])) for _ in range(2))
        step = rng.choice([None, Fraction(1), Fraction(3, 2), Fraction(2), Fraction(5, 3), Fraction(1, 4)])
        b = Bounds(lo, rng.random() < 0.5, hi, rng.random() < 0.5, step)
        assert _integers_within(b) == sum(b.holds(Fraction(v)) for v in range(-70, 71)), b
    assert _integers_within(Bounds(Fraction(0), False, None, False, None)) is None


def test_integer_texts_are_the_integers_the_bounds_hold():
    """integer_texts (the values a unique integer item is matched against) against Bounds.holds over every integer
    of a window wider than the bounds, in order, each as json.dumps writes it with its value_key; None past
    UNIQUE_INTEGER_TEXTS."""
    rng = random.Random()
    for _ in range(500):
        lo, hi = sorted(Fraction(rng.randint(-60, 60), rng.choice([1, 2, 3, 4])) for _ in range(2))
        step = rng.choice([None, Fraction(1), Fraction(3, 2), Fraction(2), Fraction(5, 3), Fraction(1, 4)])
        b = Bounds(lo, rng.random() < 0.5, hi, rng.random() < 0.5, step)
        held = [v for v in range(-70, 71) if b.holds(Fraction(v))]
        assert integer_texts(b) == tuple((json.dumps(v).encode(), value_key(v)) for v in held), b
    wide = Bounds(Fraction(0), False, Fraction(UNIQUE_INTEGER_TEXTS), False, None)  # one more than the cap
    assert integer_texts(wide) is None and integer_texts(Bounds(Fraction(1), False, None, False, None)) is None


@pytest.mark.parametrize("schema, text, taken", [
    ({"type": "string", "maxLength": 0}, '"\\', False),  # no character may follow: nor may an escape begin
    ({"type": "string", "maxLength": 1}, '"a\\', False),
    ({"type": "string", "maxLength": 1}, '"\\', True),
    ({"type": "string", "pattern": "^[a-c]*$"}, '"\\u006', True),  # U+0060..U+006F holds a, b, c
    ({"type": "string", "pattern": "^[a-c]*$"}, '"\\u007', False),  # U+0070..U+007F does not
    ({"type": "string", "pattern": "^[a-c]*$"}, '"\\uF', False),
    ({"type": "string", "pattern": "^[a-c]*$"}, '"\\u0063', True),
    ({"type": "string", "pattern": "^[😀-😂]$"}, '"\\uD83', True),  # a high surrogate whose pair can be 😀
    ({"type": "string", "pattern": "^[😀-😂]$"}, '"\\uD84', False),  # pairs from D840 are past U+1F602
    ({"type": "string", "pattern": "^[😀-😂]$"}, '"\\uD83D\\uDE0', True),
    # a pair's second half: its digits only where the astral character can still fit (U+1F610.. cannot), or the
    # high half alone where it fits by itself (the pattern holds no lone surrogate)
    ({"type": "string", "pattern": "^[😀-😂]$"}, '"\\uD83D\\uDE1', False),
    ({"type": "string", "pattern": "^[😀-😂]$"}, '"\\uD83D\\u0', False),
    ({"type": "string", "pattern": "^[😀-😂]$"}, '"\\uD83D\\uDE02', True),
    ({"type": "string", "maxLength": 1}, '"\\uD83D\\uD', True),  # DC00..DFFF pair: one character
    ({"type": "string", "maxLength": 1}, '"\\uD83D\\uDB', False),  # no pair: two characters
    ({"type": "string", "maxLength": 2}, '"\\uD83D\\u0', True),  # the lone high and U+0xxx
    # the pattern's fewest characters after the escape must fit the length left
    ({"type": "string", "maxLength": 3, "pattern": "z$"}, '"ab\\u1', False),  # the third character must be z
    ({"type": "string", "maxLength": 3, "pattern": "z$"}, '"ab\\u007', True),  # U+007A is z
    ({"type": "string", "maxLength": 1, "pattern": "^(ab)*$"}, '"\\', False),  # only "" fits
    ({"type": "string", "maxLength": 2, "pattern": "^(ab)*$"}, '"\\u0061', True),
])
def test_an_escape_is_taken_only_where_its_character_can_fit(schema, text, taken):
    """An escape and each \\u digit are taken only where some character they can still become fits the lengths
    and the pattern (a one-sequence dead end otherwise: the model could write a byte no token continues); the
    oracle is which code points the partial escape can name, read off the text by hand."""
    assert (feed_all(compile_schema(schema), text) is not None) == taken



def test_a_utf8_lead_byte_is_taken_only_where_its_character_can_fit():
    """maxLength 3 and a pattern ending in z: after "ab" the third character must be z, so no UTF-8 lead byte (a
    character of two to four bytes, never z) may begin it; with room for two more characters, one may."""
    from ninfer_rt.json_automaton import SchemaPrefix

    tight = SchemaPrefix(compile_schema({"type": "string", "maxLength": 3, "pattern": "z$"}))
    roomy = SchemaPrefix(compile_schema({"type": "string", "maxLength": 4, "pattern": "z$"}))
    assert tight.feed(b'"ab') and not tight.copy().feed(b"\xc3") and tight.copy().feed(b"z")
    assert roomy.feed(b'"ab\xc3\xa9z"') and roomy.complete  # "abéz"

@pytest.mark.parametrize("schema, text, taken", [
    # maxProperties 1 with "a" required: any other key leaves no way to close the object
    ({"type": "object", "required": ["a"], "maxProperties": 1}, '{"b', False),
    ({"type": "object", "required": ["a"], "maxProperties": 1}, '{"a":1}', True),
    ({"type": "object", "required": ["a", "é"], "maxProperties": 3}, '{"b":1,"c', False),
    ({"type": "object", "required": ["a", "é"], "maxProperties": 3}, '{"b":1,"é":2,"a":3}', True),
    ({"type": "object", "required": ["a"], "maxProperties": 2}, '{"b":1,"a":2}', True),
    # unique items of an enum: a duplicate is refused at its first byte, a comma once every value is in
    ({"type": "array", "items": {"enum": ["x", "y"]}, "uniqueItems": True}, '["x","x', False),
    ({"type": "array", "items": {"enum": ["x", "y"]}, "uniqueItems": True}, '["x","y",', False),
    ({"type": "array", "items": {"enum": ["x", "y"]}, "uniqueItems": True}, '["y", "x" ]', True),
    ({"type": "array", "items": {"enum": [1.0, 2]}, "uniqueItems": True}, "[1,1.0", False),  # 1.0 is 1
    ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True}, "[true,t", False),
    ({"type": "array", "items": {"type": ["boolean", "null"]}, "uniqueItems": True}, "[null, false,true]", True),
    ({"type": "array", "items": {"type": ["boolean", "null"]}, "uniqueItems": True}, "[null,false,true,", False),
    # unique integers between two bounds: as an enum's values (a duplicate refused at its first byte that no unused
    # value's text continues; a comma once every value is in)
    (SMALL_INTS, "[1,2,2", False),
    (SMALL_INTS, "[1,2,3,", False),
    (SMALL_INTS, "[3, 1,2]", True),
    (TWELVE, "[12,1", True),  # 10 and 11 remain
    (TWELVE, "[10,11,12,1", True),  # 1 remains
    (TWELVE, "[1,10,11,12,1", False),
    (TWELVE, "[1,-", False),  # -0 is 0's value, but not its compact text
    ({"items": {"type": ["integer", "null"], "exclusiveMinimum": 0, "maximum": 6, "multipleOf": 1.5},
      "uniqueItems": True}, "[6,null,3,", False),  # 3 and 6 are the multiples of 1.5 in (0, 6] that are integers
    ({"items": {"type": "integer", "minimum": 0, "maximum": 5000}, "uniqueItems": True}, "[7,7", True),  # 70..
    ({"prefixItems": [{"const": 1}, {"const": 1}], "uniqueItems": True}, "[1,", False),
    ({"prefixItems": [{"const": 1}, {"const": 1}], "uniqueItems": True}, "[1]", True),
    # a fraction reads as a float: at an exclusive bound, 17 nines past the point round onto it and no digit more
    # brings them back; 16 do not
    ({"type": "number", "exclusiveMaximum": 1}, "0.99999999999999999", False),
    ({"type": "number", "exclusiveMaximum": 1}, "0.9999999999999999", True),
    ({"type": "number", "exclusiveMaximum": 1}, "0.9999999999999999 ", True),
    ({"type": "number", "exclusiveMinimum": -1}, "-0.99999999999999999", False),
    ({"type": "number", "maximum": 1}, "0.99999999999999999 ", True),  # inclusive: 1.0 is in
    # keys from a short list of patterns or propertyNames (Node.finite_keys): a key only where an unused name can
    # complete it, a comma only while one is left
    (LANGS, '{"en":"a","e', False),
    (LANGS, '{"en":"a","fr":"b",', False),
    (LANGS, '{"fr":"b", "en":"a"}', True),
    ({"type": "object", "propertyNames": {"pattern": "^(en|fr)$"}}, '{"en":1,"e', False),
    ({"type": "object", "propertyNames": {"pattern": "^(en|fr)$"}}, '{"en":1,"fr":2}', True),
    ({"type": "object", "propertyNames": {"maxLength": 0}}, '{"":1,', False),
    ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, '{"en":1,"e', True),  # open: "ea", ...
    # an integer's text reads as an int (exact): 2**53 + 1 lies above 2**53, though its float does not
    (BIG, "9007199254740993 ", True),
    (BIG, "9007199254740992 ", False),
    # 1e999 reads as inf (a client's json.loads): unique items compare it as inf, and -inf apart
    ({"type": "array", "uniqueItems": True}, "[1e999,-1e999]", True),
    ({"type": "array", "uniqueItems": True}, "[1e999,2e999]", False),
])
def test_values_take_only_what_can_end_valid(schema, text, taken):
    """Each text taken, where whole also complete, exactly where some valid document begins with it (read off the
    schema by hand; jsonschema agrees on the whole ones)."""
    p = feed_all(compile_schema(schema), text)
    whole = text.endswith(("}", "]", " "))
    assert (p is not None and (p.complete if whole else True)) == taken
    if whole:
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)) == taken


def test_an_enum_counts_values_not_texts_toward_unique_items():
    """enum [1.0, 2.0] is read as the texts 1.0, 1, 2.0, 2 but holds two values: minItems 3 of unique items is
    refused when compiled (jsonschema: no such array validates), not left to fail mid-reply."""
    schema = {"items": {"enum": [1.0, 2.0]}, "uniqueItems": True, "minItems": 3}
    with pytest.raises(SchemaError, match="allows only 2 distinct values"):
        compile_schema(schema)
    assert not jsonschema.Draft202012Validator(schema).is_valid([1, 2, 1.0])


@pytest.mark.parametrize("pattern, min_len, max_len", [
    ("^(en|fr|de)$", 0, None), ("^[ab]{1,2}$", 0, None), ("^x?$", 0, None), ("^(a|ab|abc)$", 0, None),
    ("^[a-c](x|y)?$", 0, None), ("^[ab]{0,3}$", 2, 2), ("^a*$", 0, 3), ("^(b|a)+$", 1, 2),
])
def test_pattern_words_are_the_matches_a_search_finds(pattern, min_len, max_len):
    """Pattern.words (what lists a finite key set) against every string of up to 3 characters over the patterns'
    letters that Pattern.matches takes within the lengths, in code point order."""
    from itertools import product

    from ninfer_rt.json_regex import compile_pattern
    p = compile_pattern(pattern)
    want = sorted(w for n in range(4) for w in map("".join, product("abcdefnrxy", repeat=n))
                  if p.matches(w) and n >= min_len and (max_len is None or n <= max_len))
    assert p.words(min_len, max_len) == want


@pytest.mark.parametrize("pattern", ["^a+$", "en", "^[a-z]{3}$", "^[^a]$", "^(a|b)*c$"])
def test_pattern_words_are_none_where_the_language_is_open_or_long(pattern):
    """Unbounded matches, an unanchored pattern, more strings than the cap, a negated class: no list."""
    from ninfer_rt.json_regex import compile_pattern
    assert compile_pattern(pattern).words() is None


def test_finite_keys_fewer_than_min_properties_refuse_the_schema():
    """propertyNames of two names and minProperties 3: no object validates (jsonschema agrees on the one closest),
    refused when compiled instead of failing mid-reply."""
    schema = {"type": "object", "propertyNames": {"pattern": "^(a|b)$"}, "minProperties": 3}
    with pytest.raises(SchemaError, match="no object holds"):
        compile_schema(schema)
    assert not jsonschema.Draft202012Validator(schema).is_valid({"a": 1, "b": 2})
