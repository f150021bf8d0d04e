"""Tokens per second a user's loop gets on an artifact: Model.generate and one sequence alone in a Batch (what serve
steps), each with the run-ahead decode (GpuBackend.sample_ahead) and without it (the step's token read before the
next step is enqueued, as before v105).

    python bench/generate_loop.py ARTIFACT [--tokens 1500] [--host-penalties] [--json PATH]

Stop ids are ignored, so every run yields --tokens tokens from the same prompt; greedy, top-k 20 sampling, and
Qwen3.6's non-thinking card setting (presence_penalty 1.5: drawn on the device, or on the host with
--host-penalties); the median of 3 runs of each after one that captures every context bucket's graph. Wall time
from the first step to the last token, Python and the detokenizer's bookkeeping included (the Batch loop takes
each step's text). Both modes must give the same tokens (the same graphs on the same inputs); the table says
whether they did. Exits with a one-line message when there is no GPU or the artifact cannot be loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RUNS = 3
PROMPT = "The assistant reads the question and then writes a long and careful answer about the history of lighthouses"


def generate_s(m, ids, n, params) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    out = list(m.generate_ids(ids, max_new_tokens=n, sampling=params))
    return (time.perf_counter() - t0) / len(out), out


def batch_s(m, ids, n, params) -> tuple[float, list[int]]:
    b = m.batch(1)
    g = b.add(ids, max_new_tokens=n, sampling=params)
    t0 = time.perf_counter()
    while b.busy:
        b.step()
        g.take()
    return (time.perf_counter() - t0) / len(g.stats.token_ids), list(g.stats.token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path, help="a .ninfer file")
    ap.add_argument("--tokens", type=int, default=1500, help="tokens a run")
    ap.add_argument("--host-penalties", action="store_true", help="draw penalised rows on the host from "
                    "downloaded logits (backend.DEVICE_PENALTIES off), as before v108")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args()
    if a.tokens < 2:
        sys.exit(f"generate_loop: --tokens must be at least 2, got {a.tokens}")

    from rich.console import Console
    from rich.table import Table

    from ninfer_rt.api import load
    from ninfer_rt.errors import NinferError
    from ninfer_rt.gpu import backend as backend_mod
    from ninfer_rt.gpu.backend import GpuBackend
    from ninfer_rt.sampling import SamplingParams

    backend_mod.DEVICE_PENALTIES = not a.host_penalties

    try:
        m = load(a.artifact, device="cuda", max_ctx=a.tokens + 512)
    except NinferError as e:
        sys.exit(f"generate_loop: {e}")
    m.tokenizer.is_stop = lambda token: False  # every run decodes --tokens tokens
    ids = m.tokenizer.encode(PROMPT)
    rows, outs, ahead = [], {}, GpuBackend.sample_ahead
    try:
        for mode in ("ahead", "wait"):
            if mode == "wait":
                del GpuBackend.sample_ahead  # both loops then read each token before the next step is enqueued
            for loop, fn in (("generate", generate_s), ("batch", batch_s)):
                for label, params in (("greedy", SamplingParams(greedy=True)),
                                      ("top-k 20", SamplingParams(temperature=0.8, top_k=20, seed=1)),
                                      ("non-thinking", SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=1,
                                                                      presence_penalty=1.5))):
                    fn(m, ids, a.tokens, params)  # captures the graphs
                    runs = [fn(m, ids, a.tokens, params) for _ in range(RUNS)]
                    s = float(np.median([t for t, _ in runs]))
                    outs[mode, loop, label] = runs[0][1]
                    rows.append({"loop": loop, "sampling": label, "mode": mode, "ms_per_token": s * 1e3,
                                 "tok_s": 1 / s, "tokens": a.tokens})
    finally:
        GpuBackend.sample_ahead = ahead
        device = m._backend.gpu.info.name
        m.close()
    for r in rows:
        r["same_tokens"] = outs["ahead", r["loop"], r["sampling"]] == outs["wait", r["loop"], r["sampling"]]
    table = Table(title=f"{a.artifact.name}: {a.tokens} tokens a run on {device}")
    for col in ("loop", "sampling", "mode", "ms a token", "tok/s", "same tokens"):
        table.add_column(col, justify="left" if col in ("loop", "sampling", "mode") else "right")
    for r in sorted(rows, key=lambda r: (r["loop"], r["sampling"], r["mode"])):
        table.add_row(r["loop"], r["sampling"], r["mode"], f"{r['ms_per_token']:.4f}", f"{r['tok_s']:.1f}",
                      "yes" if r["same_tokens"] else "NO")
    Console().print(table)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"device": device, "timing": "wall clock, first step to last token",
                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
