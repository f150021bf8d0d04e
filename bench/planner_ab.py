"""In-graph A/B of the GEMV planner's constants: the decode step of a synthetic model, timed by graph replay.

    python bench/planner_ab.py [--model qwen3.6-35b-a3b qwen3.6-27b] [--context 8192] [--json PATH]

A kernel timed alone (bench/gemv_bench.py) is a poor guide to the step: in a decode graph, programmatic dependent
launch overlaps each kernel's start with its predecessor's tail, which rewards early weight loads and punishes
work done after the wait (perf.md v6). So each variant here sets linear's planner constants, recaptures the
model's decode graph and times one step at a fixed context (median of 5 rounds of 20 replays, best of 3);
"default" runs first and last to show the drift. Exits with a one-line message when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import open_gpu  # noqa: E402

from ninfer_rt.gpu import linear  # noqa: E402

KNOBS = ("_STREAM_BLOCK_ROWS", "_STREAM_K_MAX", "_STREAM_BLOCKS_PER_SM")
# (label, planner constants to set)
VARIANTS = [
    ("default", {}),
    ("stream kernel at any N", {"_STREAM_BLOCK_ROWS": 1 << 30}),
    ("stream kernel below 16384 rows (v5 rule)", {"_STREAM_BLOCK_ROWS": 16384}),
    ("stream kernel, 1 block per SM", {"_STREAM_BLOCKS_PER_SM": 1}),
    ("block kernel only", {"_STREAM_K_MAX": 0}),
    ("stream kernel up to K 10240 (v6 rule)", {"_STREAM_K_MAX": 10240}),
    ("default again", {}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["qwen3.6-35b-a3b", "qwen3.6-27b"],
                    help="synthetic model shapes (ninfer_rt/configs), recipe of the same name")
    ap.add_argument("--context", type=int, default=8192, help="context length of the timed decode step")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args()

    gpu, k, console = open_gpu("planner_ab")
    from rich.table import Table

    from ninfer_rt.gpu.bench import _time_decode, builtin_spec
    from ninfer_rt.gpu.engine import GpuModel
    from ninfer_rt.gpu.loader import synthetic_weights
    from ninfer_rt.recipe import load_recipe

    saved = {name: getattr(linear, name) for name in KNOBS}
    rows = []
    for name in args.model:
        spec = builtin_spec(name)
        weights = synthetic_weights(gpu, spec, load_recipe(name))
        model = GpuModel(gpu, k, spec, weights, slots=1, max_ctx=args.context + 16, kv_dtype="int8")
        try:
            for label, over in VARIANTS:
                for key, value in saved.items():
                    setattr(linear, key, value)
                for key, value in over.items():
                    setattr(linear, key, value)
                for g in model.graphs.values():
                    g.destroy()
                model.graphs.clear()
                s = min(_time_decode(model, args.context) for _ in range(3))
                rows.append({"model": name, "variant": label, "set": {kk: v for kk, v in over.items()},
                             "context": args.context, "ms": 1e3 * s, "tok_s": 1 / s})
                console.print(f"{name} {label}: {1e3 * s:.3f} ms/step", highlight=False)
        finally:
            for key, value in saved.items():
                setattr(linear, key, value)
            model.free()
            weights.free(gpu)

    table = Table(title=f"decode step at {args.context} context, graph replay (best of 3 medians)")
    for col in ("model", "variant", "ms / step", "tok/s", "vs default"):
        table.add_column(col, justify="left" if col in ("model", "variant") else "right")
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["variant"] == "default")
        table.add_row(r["model"], r["variant"], f"{r['ms']:.3f}", f"{r['tok_s']:.1f}",
                      f"{100 * (base['ms'] / r['ms'] - 1):+.1f}%")
    console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": gpu.info.name, "arch": gpu.info.arch, "timing": "cuda-graph replay",
                                         "rows": rows}, indent=1))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
