"""What summing a prompt chunk's routed experts in slot order costs against float atomics, and whether each repeats.

    python bench/prefill_moe_sum.py [--model qwen3.6-35b-a3b] [--tokens 8192] [--rounds 5] [--json PATH]

Two GpuModels over one set of synthetic weights (exact shapes and recipe): one with ordered_moe (the routed down
stores a row a slot, moe_sum_slots adds them in order: the default), one with the down adding by float atomics.
Each prefills the same --tokens-token prompt (one chunk); rounds alternate between them and each round times one
prefill between two events. Then each prefills the prompt twice more into a reset slot and the table says whether
the last row's hidden state came out the same bits both times. Exits with a one-line message when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import eager_ms, open_gpu  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3.6-35b-a3b", help="synthetic MoE shape (ninfer_rt/configs)")
    ap.add_argument("--tokens", type=int, default=8192, help="prompt tokens (one prefill chunk at most 8192)")
    ap.add_argument("--rounds", type=int, default=5, help="timed prefills of each model, alternating")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from ninfer_rt.errors import NinferError
    from ninfer_rt.gpu.bench import builtin_spec
    try:
        spec = builtin_spec(a.model)
    except NinferError as e:
        sys.exit(f"prefill_moe_sum: {e}")
    if not spec.is_moe or not 9 <= a.tokens <= 8192:
        sys.exit(f"prefill_moe_sum: needs an MoE model and 9..8192 tokens, got {a.model}, {a.tokens}")

    gpu, k, console = open_gpu("prefill_moe_sum")
    from rich.table import Table

    from ninfer_rt.gpu.engine import GpuModel
    from ninfer_rt.gpu.loader import synthetic_weights
    from ninfer_rt.recipe import load_recipe

    weights = synthetic_weights(gpu, spec, load_recipe(a.model))
    ids = np.random.default_rng(0).integers(0, 1000, a.tokens).astype(np.int32)
    models = {}
    try:
        for ordered in (True, False):
            models[ordered] = GpuModel(gpu, k, spec, weights, slots=1, max_ctx=a.tokens + 16, kv_dtype="int8",
                                       ordered_moe=ordered)
        times = {True: [], False: []}
        for m in models.values():
            m.prefill(ids, 0)  # warm-up: kernel lookups, the chunk's graph
        for _ in range(a.rounds):
            for ordered, m in models.items():
                times[ordered] += eager_ms(gpu, lambda m=m: m.prefill(ids, 0), rounds=1, reps=1, warmup=0)
        same = {}
        for ordered, m in models.items():
            runs = []
            for _ in range(2):
                m.reset_slot(0)  # a fresh sequence: prefill from 0 continues the slot's DeltaNet state otherwise
                runs.append(m.prefill(ids, 0, hidden=True)[-1])
            same[ordered] = bool(np.array_equal(runs[0].view(np.uint32), runs[1].view(np.uint32)))
    finally:
        for m in models.values():
            m.free()
        weights.free(gpu)

    rows = []
    for ordered in (True, False):
        ms = statistics.median(times[ordered])
        rows.append({"sum": "slot order" if ordered else "float atomics", "ms": ms, "tok_s": a.tokens / ms * 1e3,
                     "rounds_ms": times[ordered], "same_bits_twice": same[ordered]})
    table = Table(title=f"{a.model}: prefill of {a.tokens:,} tokens, {gpu.info.name} (median of {a.rounds})")
    for col in ("routed experts summed by", "ms", "tok/s", "last row's hidden state, same bits twice"):
        table.add_column(col, justify="left" if col.startswith("routed") else "right")
    for r in rows:
        table.add_row(r["sum"], f"{r['ms']:.2f}", f"{r['tok_s']:,.0f}", "yes" if r["same_bits_twice"] else "no")
    console.print(table)
    cost = rows[0]["ms"] / rows[1]["ms"] - 1
    console.print(f"slot order costs {cost:+.2%} of the prompt's time", highlight=False)
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "gpu": gpu.info.name, "tokens": a.tokens, "rows": rows,
                                      "cost": cost}, indent=1))


if __name__ == "__main__":
    main()
