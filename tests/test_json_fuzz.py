"""json_schema / json_automaton on random schemas, against json.loads and jsonschema.

Random schemas from the supported keywords (objects and their sizes, arrays, tuples and sets, anyOf, oneOf told apart by type or by a
const property, strings with lengths, patterns and formats, numbers with bounds and multipleOf, enums, a recursive
$ref), random documents that loosely follow them, and random byte edits of those. Sound: whatever the automaton takes
as complete parses (strict UTF-8) and validates. Complete: every valid document is taken byte by byte, written
without \\u escapes (an enum's strings and a closed object's keys are matched raw, which is stricter). The oracle
reads JSON Schema as the automaton does where Python's reading differs: multipleOf in exact decimals (jsonschema
divides floats), a pattern's final `$` as `\\Z` (Python's `$` also matches before a final newline), a format as the
pattern it is held to (Draft 2020-12 leaves formats unchecked).
"""

from __future__ import annotations

import json
import random
from fractions import Fraction

import jsonschema
import pytest

from ninfer_rt.json_automaton import SchemaPrefix
from ninfer_rt.json_schema import FORMATS, SchemaError, compile_schema

PATTERNS = ["^a+$", "^[a-c]{1,3}$", "b", "^\\d{2}-\\w*$", "^(?:x|yz)*$", "^[^a]?$", "\\s", "^.$", "c$"]
KEYS = ["a", "b", "é", "k"]
CHARS = "abcxyz09-é \n\"\\😀"


def _multiple_of(validator, step, instance, schema):
    if validator.is_type(instance, "number"):
        exact = Fraction(repr(step)) if isinstance(step, float) else Fraction(step)
        if (Fraction(repr(instance)) / exact).denominator != 1:
            yield jsonschema.ValidationError(f"{instance} is not a multiple of {step}")


Oracle = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"multipleOf": _multiple_of})


def oracle_schema(s):
    """s with each pattern's final $ as \\Z, and a format the automaton holds as its pattern (FORMATS) as that
    pattern, for Python's re to match."""
    if isinstance(s, dict):
        out = {k: oracle_schema(v) for k, v in s.items()}
        if "pattern" not in s and s.get("format") in FORMATS:
            out["pattern"] = FORMATS[s["format"]]
        if isinstance(out.get("pattern"), str) and out["pattern"].endswith("$"):
            out["pattern"] = out["pattern"][:-1] + "\\Z"
        return out
    return [oracle_schema(v) for v in s] if isinstance(s, list) else s


class Gen:
    def __init__(self, seed: int):
        self.r = random.Random(seed)

    def scalar(self) -> dict:
        r = self.r
        t = r.choice(["string", "integer", "number", "boolean", "null", "string", "integer", "number"])
        s = {"type": t}
        if t == "string":
            if r.random() < 0.4:
                s["minLength"] = r.randint(0, 3)
            if r.random() < 0.4:
                s["maxLength"] = s.get("minLength", 0) + r.randint(0, 3)
            if r.random() < 0.4:
                s["pattern"] = r.choice(PATTERNS)
            elif r.random() < 0.1:
                s["format"] = r.choice(["date", "uuid", "ipv4", "time"])
        if t in ("integer", "number"):
            for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if r.random() < 0.25:
                    s[k] = r.choice([0, 1, -1, 2, 5, 10, -3, 0.5, 0.25, -2.5, 100])
            if r.random() < 0.25:
                s["multipleOf"] = r.choice([1, 2, 3, 0.5, 0.25, 1.5, 0.1])
        return s

    def schema(self, depth: int = 0) -> dict:
        r, t = self.r, self.r.random()
        if depth > 2 or t < 0.35:
            return self.scalar()
        if t < 0.5:
            s = {"type": "array", "items": self.schema(depth + 1)}
            if r.random() < 0.3:
                s["prefixItems"] = [self.schema(depth + 1) for _ in range(r.randint(1, 2))]
            for k in ("minItems", "maxItems"):
                if r.random() < 0.3:
                    s[k] = s.get("minItems", 0) + r.randint(0, 2)
            if r.random() < 0.2:
                s["uniqueItems"] = True
            return s
        if t < 0.7:
            props = {k: self.schema(depth + 1) for k in r.sample(KEYS, r.randint(0, 3))}
            s = {"type": "object", "properties": props}
            if props and r.random() < 0.5:
                s["required"] = r.sample(list(props), r.randint(1, len(props)))
            if r.random() < 0.4:
                s["additionalProperties"] = False
            for k in ("minProperties", "maxProperties"):
                if r.random() < 0.15:
                    s[k] = s.get("minProperties", 0) + r.randint(0, 2)
            return s
        if t < 0.8:  # oneOf told apart by a const property, or by type
            if r.random() < 0.5:
                return {"oneOf": [{"type": "object", "required": ["k"], "properties": {"k": {"const": v}}}
                                  for v in r.sample(["x", "y", 1, None], 2)]}
            return {"oneOf": [{"type": t} for t in r.sample(["string", "integer", "null", "array", "object"], 2)]}
        if t < 0.9:
            return {"anyOf": [self.schema(depth + 1) for _ in range(r.randint(1, 3))]}
        return {"enum": [self.value(None, 1) for _ in range(r.randint(1, 3))]}

    def value(self, s, depth: int = 0):
        """A value that often follows s (a schema dict or None)."""
        r = self.r
        if isinstance(s, dict):
            for key in ("enum", "anyOf", "oneOf"):
                if key in s:
                    return r.choice(s[key]) if key == "enum" else self.value(r.choice(s[key]), depth)
            if "const" in s:
                return s["const"]
            t = s.get("type") if r.random() < 0.9 else None
            if t == "object":
                o = {k: self.value(v, depth + 1) for k, v in s.get("properties", {}).items() if r.random() < 0.7}
                if r.random() < 0.2:
                    o[r.choice(KEYS)] = self.value(None, depth + 1)
                return o
            if t == "array":
                pre = s.get("prefixItems", [])
                return [self.value(pre[i] if i < len(pre) else s.get("items"), depth + 1)
                        for i in range(r.randint(0, 4))]
            if t == "string":
                if "pattern" in s and r.random() < 0.5:
                    return r.choice(["a", "aa", "abc", "12-x", "xyz", "", "b", " ", "c", "x", "ca"])
                if "format" in s and r.random() < 0.5:
                    return {"date": "2020-02-29", "uuid": "12345678-1234-1234-1234-1234567890ab", "ipv4": "10.0.0.255",
                            "time": "23:59:60.5+01:00"}[s["format"]]
                return "".join(r.choice(CHARS) for _ in range(r.randint(0, 4)))
            if t in ("integer", "number"):
                return r.randint(-12, 12) if t == "integer" or r.random() < 0.5 else r.randint(-100, 100) / 4
            if t in ("boolean", "null"):
                return r.random() < 0.5 if t == "boolean" else None
        if depth > 2:
            return r.choice([None, True, 1, "x"])
        return r.choice([None, True, r.randint(-5, 5), r.randint(-20, 20) / 4, "".join(r.sample(CHARS, 2)),
                         [self.value(None, depth + 1)], {r.choice(KEYS): self.value(None, depth + 1)}])


def ints(v):
    """v with its integral floats as ints: an integer is written without a fraction (the automaton's one rule
    stricter than JSON Schema, which counts 4.0 as an integer)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        return [ints(x) for x in v]
    return {k: ints(x) for k, x in v.items()} if isinstance(v, dict) else v


def valid(text: bytes, oracle) -> bool:
    try:
        return oracle.is_valid(json.loads(text.decode("utf-8")))
    except ValueError:  # not JSON, or not UTF-8
        return False


def whole(root, text: bytes) -> tuple[bool, int]:
    """(taken as complete, bytes taken) for text fed one byte at a time."""
    p = SchemaPrefix(root)
    for i in range(len(text)):
        if not p.feed(text[i:i + 1]):
            return False, i
    return p.complete, len(text)


@pytest.mark.parametrize("seed", range(3))
def test_random_schemas_against_jsonschema(seed):
    gen, compiled, checked = Gen(seed), 0, 0
    for _ in range(120):
        schema = gen.schema()
        if gen.r.random() < 0.3:  # through a $ref
            schema = {"$defs": {"D": schema}, "type": "array", "items": {"$ref": "#/$defs/D"}}
        try:
            root = compile_schema(schema)
        except SchemaError as e:
            assert "\n" not in str(e)
            continue
        compiled += 1
        oracle = Oracle(oracle_schema(schema))
        for _ in range(6):
            doc = ints(gen.value(schema.get("items") if "$defs" in schema else schema))
            if "$defs" in schema:
                doc = [doc]
            for text, exact in ((json.dumps(doc, ensure_ascii=False).encode(), True),
                                (json.dumps(doc, ensure_ascii=False, indent=1).encode(), True),
                                (json.dumps(doc).encode(), False)):
                ok, taken = whole(root, text)
                # an enum's strings and the keys of a closed object are matched as written raw: their \u escapes are
                # refused (stricter, never looser), so the escaped form is checked for soundness only
                assert ok == valid(text, oracle) if exact else not ok or valid(text, oracle), (schema, text, taken)
                checked += ok
                for _ in range(4):  # edits: never a complete invalid text
                    i = gen.r.randrange(len(text) + 1)
                    edited = text[:i] + bytes([gen.r.choice(b'{}[],:"0123456789.-eE\\ axn\xc3\xff')]) + text[i + 1:]
                    if whole(root, edited)[0]:
                        assert valid(edited, oracle), (schema, edited)
    assert compiled > 80 and checked > 100
