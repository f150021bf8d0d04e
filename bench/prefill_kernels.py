"""Where a prefill step's time goes: milliseconds per kernel of one prompt chunk of a synthetic model.

    python bench/prefill_kernels.py [--model qwen3.6-35b-a3b] [--tokens 8191] [--top 25] [--json PATH]

Builds the model's exact shapes and recipe with random weights (as `ninfer-rt bench --synthetic`), prefills
--tokens tokens once to warm up, then again with a CUDA event recorded before and after every launch. The step
runs eagerly (the chunk is one token longer than the prompt, so no graph is captured) and the events serialize
the launches: each kernel's time is its own, without the overlap programmatic dependent launch gives. The 35B's
8K step sums to 348 ms against the 363 ms `ninfer-rt bench` measures for the whole prompt (perf-history.md v18). The
table sums each entry point over its launches. Exits with a one-line message when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import open_gpu  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3.6-35b-a3b", help="synthetic model shape (ninfer_rt/configs), "
                                                               "recipe of the same name")
    ap.add_argument("--tokens", type=int, default=8191, help="prompt tokens: one eager prefill step")
    ap.add_argument("--top", type=int, default=25, help="rows of the table (the most expensive entry points)")
    ap.add_argument("--json", type=Path, help="also write every entry point's total as JSON here")
    args = ap.parse_args()
    if args.tokens < 9:
        sys.exit(f"prefill_kernels: --tokens must be >= 9 (a prefill, not a decode step), got {args.tokens}")
    from ninfer_rt.errors import NinferError
    from ninfer_rt.gpu.bench import builtin_spec
    try:
        spec = builtin_spec(args.model)
    except NinferError as e:
        sys.exit(f"prefill_kernels: {e}")

    gpu, k, console = open_gpu("prefill_kernels")
    from rich.table import Table

    from ninfer_rt.gpu.driver import Event
    from ninfer_rt.gpu.engine import GpuModel
    from ninfer_rt.gpu.loader import synthetic_weights
    from ninfer_rt.recipe import load_recipe

    weights = synthetic_weights(gpu, spec, load_recipe(args.model))
    n = args.tokens
    model = GpuModel(gpu, k, spec, weights, slots=1, max_ctx=n + 16, kv_dtype="int8", prefill_chunk=n + 1)
    try:
        ids = np.random.default_rng(0).integers(0, 1000, n).astype(np.int32)
        model.prefill(ids, 0)  # warm-up: kernel lookups, shared-memory opt-ins, clocks
        gpu.synchronize()
        launch, log = k.launch, []

        def timed(name, *a, **kw):
            e0, e1 = Event(), Event()
            e0.record(gpu.stream)
            launch(name, *a, **kw)
            e1.record(gpu.stream)
            log.append((name, e0, e1))

        k.launch = timed
        try:
            model.reset_slot(0)
            model.prefill(ids, 0)
            gpu.synchronize()
        finally:
            k.launch = launch
    finally:
        model.free()
        weights.free(gpu)

    ms, count = defaultdict(float), defaultdict(int)
    for name, e0, e1 in log:
        ms[name] += e0.elapsed_ms(e1)
        count[name] += 1
    total = sum(ms.values())
    rows = sorted(ms, key=ms.get, reverse=True)
    table = Table(title=f"{args.model}: one prefill step of {n} tokens, {total:.1f} ms over {len(log)} launches "
                        "(eager, serialized)")
    for col in ("kernel", "ms", "share", "launches"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for name in rows[:args.top]:
        table.add_row(name, f"{ms[name]:.2f}", f"{100 * ms[name] / total:.1f}%", str(count[name]))
    console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": gpu.info.name, "arch": gpu.info.arch, "model": args.model,
                                         "tokens": n, "total_ms": total, "launches": len(log),
                                         "kernels": [{"name": r, "ms": ms[r], "launches": count[r]} for r in rows]},
                                        indent=1))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
