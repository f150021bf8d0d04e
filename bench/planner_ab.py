"""In-graph A/B of the decode planners' constants (GEMV, attention splits, DeltaNet step): a synthetic model's step.

    python bench/planner_ab.py [--model qwen3.6-35b-a3b qwen3.6-27b] [--context 8192 ...] [--batch B | --tokens T]
                               [--only TEXT ...] [--json PATH]

A kernel timed alone (bench/gemv_bench.py) is a poor guide to the step: in a decode graph, programmatic dependent
launch overlaps each kernel's start with its predecessor's tail, which rewards early weight loads and punishes
work done after the wait (perf-history.md v6). So each variant here sets planner constants of linear / attention /
deltanet, recaptures the model's decode graph and times one step at each context (median of 5 rounds of 20
replays, best of 3; the graph's context bucket as `ninfer-rt bench` has it); "default" runs first and last to
show the drift. Exits with a one-line message when there is no GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import (open_gpu, patched, planner_modules, step_rows_out, synthetic_model,  # noqa: E402
                        time_fresh_step)

MODULES = planner_modules()
# (label, planner constants to set, as module.name)
VARIANTS = [
    ("default", {}),
    ("stream kernel at any N", {"linear._STREAM_BLOCK_ROWS": 1 << 30}),
    ("stream kernel, 1 block per SM", {"linear._STREAM_BLOCKS_PER_SM": 1}),
    ("stream kernel, 2 blocks per SM from 1 step per warp", {"linear._STREAM_STEPS_FOR_2": 1}),
    ("stream kernel, 2 blocks per SM from 3 steps per warp", {"linear._STREAM_STEPS_FOR_2": 3}),
    ("stream kernel, 2 blocks per SM from 4 steps per warp", {"linear._STREAM_STEPS_FOR_2": 4}),
    ("stream kernel, 2 blocks per SM from 6 steps per warp", {"linear._STREAM_STEPS_FOR_2": 6}),
    ("block kernel only", {"linear._STREAM_K_MAX": 0}),
    ("block kernels for several rows (v81): stream kernels at M = 1 only", {"linear._STREAM_MAX_M": 1}),
    ("stream kernels for up to 2 rows", {"linear._STREAM_MAX_M": 2}),
    ("stream kernels of several rows within a 46 KB slab", {"linear._STREAM_ROWS_SMEM": 46 * 1024}),
    ("stream kernel at one unit per lane and row (d = 1) for q4",
     {"linear._STREAM_DEPTH": {4: 1, 5: 1, 6: 1, 8: 2, 16: 2}}),
    ("stream kernel at one unit per lane and row (d = 1) for every format",
     {"linear._STREAM_DEPTH": {4: 1, 5: 1, 6: 1, 8: 1, 16: 1}}),
    ("stream kernel copies x by cp.async at every K",
     {"linear._STREAM_X_BULK": False, "linear._STREAM_X_COPY_ABOVE": 0}),
    ("stream kernel stages x from registers at every K",
     {"linear._STREAM_X_BULK": False, "linear._STREAM_X_COPY_ABOVE": 1 << 30}),
    ("stream kernel stages x as v32: registers to K = 4096, cp.async past it", {"linear._STREAM_X_BULK": False}),
    ("stream kernel copies x by bulk copies past K = 4096 only, registers up to it",
     {"linear._STREAM_X_BULK_ABOVE": 4096, "linear._STREAM_X_ASYNC_UPTO": 0}),
    ("stream kernel copies x by bulk copies at every K on sm_90+ (v33-v59)", {"linear._STREAM_X_ASYNC_UPTO": 0}),
    ("stream kernel copies x by cp.async at every K, the gate|up's records kept",
     {"linear._STREAM_X_ASYNC_UPTO": 1 << 30}),
    ("attention splits by the row-count rule (v12)", {"attention._SPLIT_BLOCKS_PER_SM": 0}),
    ("attention splits dealt at run time, ~1 block per SM", {"attention._SPLIT_BLOCKS_PER_SM": 1}),
    ("attention splits dealt at run time, ~4 blocks per SM", {"attention._SPLIT_BLOCKS_PER_SM": 4}),
    ("attention splits dealt at run time, ~2 blocks per SM at any length",
     {"attention._SPLIT_LONG_KEYS": 1 << 30}),
    ("DeltaNet step: one block per head (no cluster)",
     {"deltanet.STEP_CLUSTER": 1, "deltanet.STEP_CLUSTER_WAVES": False}),
    ("DeltaNet step: the one-wave rule without clusters of 2 (v88)", {"deltanet.STEP_PAIRS": False}),
    ("DeltaNet step: the one-wave rule at B > 1 (v86; the default since v88, whose one-block step folds too)",
     {"deltanet.STEP_CLUSTER_WAVES": True}),
    ("DeltaNet step: clusters of 4 at any B (v85)", {"deltanet.STEP_CLUSTER_WAVES": False}),
    ("DeltaNet step: b|a dots before the wait at every H", {"deltanet.STEP_BA_EARLY_MAX_H": 1 << 30}),
    ("DeltaNet step: b|a dots after the wait at every H", {"deltanet.STEP_BA_EARLY_MAX_H": 0}),
    ("DeltaNet step: out_proj codes y itself (no x̂ records from the step)", {"deltanet.STEP_OUT_RECORDS": False}),
    ("attention: o_proj codes o itself (no x̂ records from the combine)", {"attention.COMBINE_OUT_RECORDS": False}),
    ("dense MLP: the down codes act itself (no x̂ records from the gate/up)", {"linear.SWIGLU_OUT_RECORDS": False}),
    ("every kernel prefers the largest shared-memory carveout", {"kernels.SMEM_CARVEOUT": 100}),
    ("the GEMVs share one carveout (v43-v49)", {"kernels.SHARED_CARVEOUT": ("gemv_",)}),
    ("shared carveout for every decode-step kernel but those needing more than half an SM",
     {"kernels.SHARED_CARVEOUT": ("",)}),
    ("one shared carveout for every decode-step kernel, the attention decode's included",
     {"kernels.SHARED_CARVEOUT": ("",), "kernels.SHARED_CARVEOUT_MAX": 1.0}),
    ("one shared carveout for the GEMVs and the attention decode",
     {"kernels.SHARED_CARVEOUT": ("gemv_", "attn_decode"), "kernels.SHARED_CARVEOUT_MAX": 1.0}),
    ("one shared carveout for the GEMVs and every attention kernel",
     {"kernels.SHARED_CARVEOUT": ("gemv_", "attn_"), "kernels.SHARED_CARVEOUT_MAX": 1.0}),
    ("MoE after the router in separate launches, shared expert on a side stream (v30)",
     {"moe.FUSED_DECODE": False}),
    ("routed gate/up of several rows at 2 blocks an SM (v82)", {"moe.GATE_UP_BLOCKS_PER_SM": 2}),
    ("the shared expert's side stream at the default priority (before v90)", {"moe.SHARED_STREAM_PRIORITY": False}),
    ("router fold at one token only, the router GEMV at B > 1 (v86)", {"router_fold.BATCH_FOLD": False}),
    ("routed down of several rows at 2 blocks an SM (v83)", {"moe.DOWN_BLOCKS_PER_SM": 2}),
    ("x̂ records at one row only (v82)", {"linear.RECORDS_ROWS": (1,)}),
    ("x̂ records at 1 and 4 rows (v83c-v90)", {"linear.RECORDS_ROWS": (1, 4)}),
    ("x̂ records at a verification of 2-4 tokens (v91's first cut)", {"linear.RECORDS_TOKENS": (2, 3, 4)}),
    ("x̂ records at no verification", {"linear.RECORDS_TOKENS": ()}),
    ("the arg-max in launches of its own after the lm_head (before v115)", {"engine.ARGMAX_IN_LM_HEAD": False}),
    ("default again", {}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["qwen3.6-35b-a3b", "qwen3.6-27b"],
                    help="synthetic model shapes (ninfer_rt/configs), recipe of the same name")
    ap.add_argument("--context", type=int, nargs="+", default=[8192], help="context lengths of the timed steps")
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences in the timed step (each its own slot at the same context; B > 1 takes the "
                         "multi-row GEMVs and the MoE's separate launches)")
    ap.add_argument("--tokens", type=int, default=1,
                    help="instead, one sequence's verification step of T tokens (GpuModel.verify, every row's logits)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--only", nargs="+", default=[],
                    help="run only the variants whose label contains one of these texts (the defaults always run)")
    args = ap.parse_args()
    if args.batch > 1 and args.tokens > 1:
        ap.error("--batch and --tokens are two kinds of step: give one")
    variants = [(label, over) for label, over in VARIANTS
                if not args.only or not over or any(t in label for t in args.only)]

    gpu, k, console = open_gpu("planner_ab")
    from ninfer_rt.gpu.engine import context_bucket

    rows = []
    for name in args.model:
        with synthetic_model(gpu, k, name, context_bucket(max(args.context) + 1), slots=args.batch) as model:
            for ctx in args.context:
                for label, over in variants:
                    with patched(MODULES, over):
                        s = time_fresh_step(model, ctx, args.batch, args.tokens)
                    rows.append({"model": name, "variant": label, "set": {kk: v for kk, v in over.items()},
                                 "context": ctx, "batch": args.batch, "tokens": args.tokens, "ms": 1e3 * s,
                                 "tok_s": args.batch * args.tokens / s})
                    # one line each, whatever the terminal width (logs are grepped for "ms/step")
                    console.print(f"{name} @{ctx} {label}: {1e3 * s:.3f} ms/step", highlight=False, soft_wrap=True)

    def cells(r):
        base = next(b for b in rows
                    if (b["model"], b["context"], b["variant"]) == (r["model"], r["context"], "default"))
        return (r["model"], f"{r['context']:,}", r["variant"], f"{r['ms']:.3f}", f"{r['tok_s']:.1f}",
                f"{100 * (base['ms'] / r['ms'] - 1):+.1f}%")
    kind = (f"verification step of {args.tokens} tokens" if args.tokens > 1 else
            f"decode step of {args.batch} sequence(s)")
    step_rows_out(console, gpu, f"{kind}, graph replay (best of 3 medians; tok/s of all together)",
                  [("model", True), ("context", False), ("variant", True), ("ms / step", False), ("tok/s", False),
                   ("vs default", False)], cells, rows, args.json)


if __name__ == "__main__":
    main()
