"""The host sampler's time a token at Qwen3.6's vocabulary: what a row costs where the GPU cannot draw it
(logprobs, a JSON constraint, penalties: Qwen's non-thinking card setting has presence_penalty 1.5).

    python bench/host_sampler.py [--vocab 248320] [--history 4096] [--calls 50] [--json PATH]

Each row times Sampler.sample on one fp32 logits row (standard normal × 3, fixed seed) with a history of --history
ids (half prompt, half output), the median of 5 rounds of --calls calls; "whole" runs every stage over the whole
vocabulary (Sampler._survivors(whole=True), the definition), "top-k first" the path sample takes. CPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [  # (label, SamplingParams fields)
    ("greedy", {"greedy": True}),
    ("thinking: T 1.0, top-k 20, top-p 0.95", {"temperature": 1.0, "top_k": 20, "top_p": 0.95}),
    ("non-thinking: T 0.7, top-k 20, top-p 0.8, presence 1.5",
     {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "presence_penalty": 1.5}),
    ("T 0.7, top-k off, top-p 0.9", {"temperature": 0.7, "top_p": 0.9}),
]


def time_us(fn, calls: int) -> float:
    fn()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls)
    return float(np.median(rounds)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=248320, help="logits a row")
    ap.add_argument("--history", type=int, default=4096, help="prompt + output ids the penalties read")
    ap.add_argument("--calls", type=int, default=50, help="calls a round")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args()
    if a.vocab < 64 or a.history < 2 or a.calls < 1:
        sys.exit("host_sampler: --vocab >= 64, --history >= 2 and --calls >= 1")

    from rich.console import Console
    from rich.table import Table

    from ninfer_rt.sampling import Sampler, SamplingParams

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(a.vocab) * 3).astype(np.float32)
    history = rng.integers(0, a.vocab, a.history).tolist()
    prompt_len = a.history // 2
    rows = []
    for label, fields in CASES:
        s = Sampler(SamplingParams(seed=1, **fields))
        row = {"sampling": label, "vocab": a.vocab, "history": a.history}
        row["whole_us"] = time_us(lambda: s._survivors(logits, history, prompt_len, whole=True), a.calls)
        row["sample_us"] = time_us(lambda: s.sample(logits, history, prompt_len), a.calls)
        rows.append(row)
    table = Table(title=f"host sampler, V = {a.vocab:,}, history {a.history:,}")
    for col in ("sampling", "whole stages µs", "sample µs", "speed-up"):
        table.add_column(col, justify="left" if col == "sampling" else "right")
    for r in rows:
        table.add_row(r["sampling"], f"{r['whole_us']:.0f}", f"{r['sample_us']:.0f}",
                      f"{r['whole_us'] / r['sample_us']:.2f}x")
    Console().print(table)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
