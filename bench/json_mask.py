"""The device mask of a JSON row inside a string value (ninfer_rt.json_tokens.JsonTokens): the once-per-vocabulary
split, then mask() for a new state and for a cached one, against asking allows() token by token.

    python bench/json_mask.py [--vocab 248320] [--calls 200] [--json PATH]

The big vocabulary is synthetic (fixed seed), shaped like a multilingual byte-level BPE one: the 256 single bytes,
then distinct tokens (shares of the default 248,320, short ASCII words being the first to repeat): ~71% ASCII words
(most with a leading space, some code and punctuation), 24% whole non-ASCII characters and words (CJK mostly, some
Cyrillic, Greek, accented Latin), 3.3% cut mid-character (a character's lead bytes at the end, or continuation bytes
at the start), 2.1% with a quote or backslash, 1.3% with a control (newlines, tabs, indentation); its last 32 ids
added tokens, two of them stop ids. The tiny model's tokenizer (ninfer_pack.tiny_tokenizer, 497 ids) is
measured too. Construction: the median of 3; a new state's mask: the median of 5, each after clearing the cache; a
cached mask: the median of 5 rounds of --calls; allows: one pass over the vocabulary after a warming one. CPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STATES = [  # (label, schema, bytes fed so far): plain string states
    ("object value", {"type": "object", "properties": {"text": {"type": "string"}}}, b'{"text": "ab'),
    ("top-level string", {"type": "string"}, b'"'),
    ("array item", {"type": "array", "items": {"type": "string"}}, b'["x", "\xc3\xa9'),
    ("then an integer", {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
                                 "required": ["a", "b"], "additionalProperties": False}, b'{"a": "x'),
    ("any value", None, b'{"k": "v'),
]
QUOTED = ['"', '",', '":', '"}', '"]', '="', '("', '")', '"),', '">', '\'"', '");\n', '\\n', '\\"', '\\\\', '\\u',
          '\\t', '":"', '", "', '"},', '"];']  # tokens around a quote or backslash, besides ' "word' and 'word"'
CONTROLS = ["\n", "\n\n", "\r\n", "\t", "\t\t", ".\n", ":\n", ",\n", "{\n", ");\n", "\n\n\n"]


def synthetic(vocab: int, seed: int = 0):
    """A vocab-token byte-level BPE-like table (the module docstring's shares)."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", dtype=np.uint8)
    weights = np.linspace(2.0, 0.2, len(letters))
    weights /= weights.sum()

    def word() -> str:
        w = bytes(rng.choice(letters, size=int(rng.integers(1, 11)), p=weights).tolist()).decode()
        return w.capitalize() if rng.random() < 0.15 else w

    def chars(lo: int, hi: int, n: int) -> str:
        return "".join(chr(int(x)) for x in rng.integers(lo, hi, size=n))

    def cjk(n: int) -> bytes:
        return chars(0x4E00, 0xA000, n).encode()

    def token() -> bytes:
        u = rng.random()
        if u < 0.70:
            if rng.random() < 0.06:  # code and punctuation
                return rng.choice(["()", "->", "_id", ".get", "==", "::", "();", "[0]", "+=", "//"]).encode() + \
                    (word().encode() if rng.random() < 0.5 else b"")
            return (b" " if rng.random() < 0.75 else b"") + word().encode()
        if u < 0.90:
            if rng.random() < 0.8:
                return (b" " if rng.random() < 0.1 else b"") + cjk(int(rng.integers(1, 4)))
            lo, hi = [(0x430, 0x450), (0x3B1, 0x3CA), (0xE0, 0x100)][int(rng.integers(3))]
            return b" " + chars(lo, hi, int(rng.integers(2, 8))).encode()
        if u < 0.925:  # cut mid-character: a lead at the end, or a tail at the start
            whole, cut, k = cjk(int(rng.integers(1, 3))), cjk(1), int(rng.integers(1, 3))
            return whole + cut[:k] if rng.random() < 0.5 else cut[k:] + whole
        if u < 0.955:
            v = rng.random()
            if v < 0.4:
                return rng.choice(QUOTED).encode()
            return (b' "' + word().encode()) if v < 0.7 else (word().encode() + b'"')
        if rng.random() < 0.5:
            return rng.choice(CONTROLS).encode()
        return b"\n" + b" " * int(rng.integers(1, 17)) if rng.random() < 0.5 else word().encode() + b"\n"

    added = 32
    tokens, seen = [bytes([b]) for b in range(256)], set()
    seen.update(tokens)
    while len(tokens) < vocab - added:
        t = token()
        if t not in seen:
            seen.add(t)
            tokens.append(t)
    tokens += [f"<|special_{i}|>".encode() for i in range(added)]
    from ninfer_rt.json_tokens import ByteTokens

    return ByteTokens(tokens, stops={vocab - added, vocab - added + 1}, added=set(range(vocab - added, vocab)))


def median_s(fn, rounds: int, calls: int = 1, before=None) -> float:
    times = []
    for _ in range(rounds):
        if before is not None:
            before()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return float(np.median(times))


def measure(name: str, tok, vocab: int, calls: int) -> tuple[dict, list[dict]]:
    """The construction's row and one row per state of vocabulary `name`."""
    from ninfer_rt.json_automaton import SchemaPrefix
    from ninfer_rt.json_schema import JSON_OBJECT, compile_schema
    from ninfer_rt.json_tokens import JsonTokens

    build = median_s(lambda: JsonTokens(tok, vocab).prepare(), 3)
    jt, words = JsonTokens(tok, vocab), -(-vocab // 32)
    jt.prepare()
    head = {"vocabulary": name, "tokens": vocab, "build_s": build, "remainders": jt.remainders,
            "state_remainders": jt.state_remainders}
    rows = []
    for label, schema, data in STATES:
        c = SchemaPrefix(JSON_OBJECT if schema is None else compile_schema(schema))
        if not (c.feed(data) and c.in_plain_string):
            raise SystemExit(f"json_mask: {label} is not a plain string state")
        new = median_s(lambda: jt.mask(c, words), 5, before=jt._masks.clear)
        cached = median_s(lambda: jt.mask(c, words), 5, calls)
        each = [jt.allows(c, t) for t in range(vocab)]  # warms the plain cache
        t0 = time.perf_counter()
        each = [jt.allows(c, t) for t in range(vocab)]
        per_token = time.perf_counter() - t0
        allowed = int(np.unpackbits(jt.mask(c, words).astype("<u4").view(np.uint8)).sum())
        if allowed != sum(a is not None for a in each):
            raise SystemExit(f"json_mask: {name}, {label}: the mask disagrees with allows")
        rows.append({"vocabulary": name, "state": label, "new_ms": new * 1e3, "cached_us": cached * 1e6,
                     "allows_each_ms": per_token * 1e3, "allowed": allowed})
    return head, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=248_320, help="tokens of the synthetic vocabulary")
    ap.add_argument("--calls", type=int, default=200, help="cached masks a round")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args()
    from rich.console import Console
    from rich.table import Table as RichTable

    from ninfer_pack.tiny_tokenizer import tiny_tokenizer_files
    from ninfer_rt.tokenizer import Tokenizer

    tiny = Tokenizer.from_resources(tiny_tokenizer_files())
    heads, rows = [], []
    for name, tok, vocab in [("synthetic", synthetic(a.vocab), a.vocab), ("tiny", tiny, tiny.vocab_size)]:
        head, more = measure(name, tok, vocab, a.calls)
        heads.append(head)
        rows += more

    console = Console()
    table = RichTable(title="JsonTokens: the once-per-vocabulary split")
    for col in ("vocabulary", "tokens", "build s", "distinct R", "R fed per state"):
        table.add_column(col, justify="right")
    for h in heads:
        table.add_row(h["vocabulary"], f"{h['tokens']:,}", f"{h['build_s']:.3f}", f"{h['remainders']:,}",
                      f"{h['state_remainders']:,}")
    console.print(table)
    table = RichTable(title="JsonTokens.mask inside a string value")
    for col in ("vocabulary", "state", "new ms", "cached µs", "allows ×V ms", "allowed"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["vocabulary"], r["state"], f"{r['new_ms']:.2f}", f"{r['cached_us']:.1f}",
                      f"{r['allows_each_ms']:.1f}", f"{r['allowed']:,}")
    console.print(table)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"calls": a.calls, "vocabularies": heads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
