"""The host's check of one drawn token of a JSON-constrained row (Batch._allows, which is JsonTokens.allows) inside a
string value: the plain-string shortcut (v117) against the copy and feed of the automaton that every token took
before it.

    python bench/json_check.py [--bytes 1,2,4,8] [--calls 2000] [--json PATH]

Tokens are synthetic: token t is --bytes letters (a trained model's string tokens are mostly whole words). Each row is
the median of 5 rounds of --calls checks, in µs a token, from `{"text": "ab` (a string with no length or pattern),
over a json_tokens.ByteTokens table (no stop or added ids). CPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 1000


def time_us(fn, calls: int) -> float:
    fn(0)
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i % VOCAB)
        rounds.append((time.perf_counter() - t0) / calls)
    return float(np.median(rounds)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", default="1,2,4,8", help="token lengths in bytes, comma-separated")
    ap.add_argument("--calls", type=int, default=2000, help="checks a round")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    from ninfer_rt.json_automaton import SchemaPrefix
    from ninfer_rt.json_schema import compile_schema
    from ninfer_rt.json_tokens import ByteTokens, JsonTokens

    c = SchemaPrefix(compile_schema({"type": "object", "properties": {"text": {"type": "string"}}}))
    if not (c.feed(b'{"text": "ab') and c.in_plain_string):
        raise SystemExit("json_check: the prefix is not a plain string state")
    rows = []
    for n in (int(x) for x in a.bytes.split(",")):
        tok = ByteTokens([bytes(0x61 + (t + i) % 26 for i in range(n)) for t in range(VOCAB)])  # n letters from t
        rules = JsonTokens(tok, VOCAB)
        shortcut = time_us(lambda t: rules.allows(c, t), a.calls)
        walk = time_us(lambda t: c.copy().feed(tok.token_bytes(t)), a.calls)
        rows.append({"bytes": n, "allows_us": shortcut, "copy_feed_us": walk})
    table = Table(title="a JSON row's check of one token inside a string value, µs")
    for col in ("token bytes", "Batch._allows (v117)", "copy + feed (before v117)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["bytes"]), f"{r['allows_us']:.2f}", f"{r['copy_feed_us']:.2f}")
    Console().print(table)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"calls": a.calls, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
