"""One decode step's CUDA graph under Nsight Compute, with the set-up (synthetic weights, capture, warm-up) not
profiled: the graph's launches run inside Gpu.profiled(), so ncu must start with profiling off.

    python bench/ncu_graph.py [--model qwen3.6-35b-a3b] [--context 8192] [--launches 1]

Whole-graph metrics (one result for the graph, its kernels overlapping as in a real step; perf.md v64):

    ncu --profile-from-start off --graph-profiling graph --metrics \\
        smsp__warp_issue_stalled_barrier_per_warp_active.pct,sm__cycles_elapsed.avg \\
        python bench/ncu_graph.py --launches 1

One kernel node, its stall samples per SASS instruction (run alone, so its waits on the predecessor are gone):

    ncu --profile-from-start off --graph-profiling node --kernel-name regex:gemv_q8_s1r --launch-skip 4 \\
        --launch-count 1 --section SourceCounters --section WarpStateStats -o k python bench/ncu_graph.py
    ncu -i k.ncu-rep --page source --csv --print-source sass > k.csv
    python bench/ncu_regions.py k.csv

Without --profile-from-start off, graph profiling also catches every launch of the set-up and runs for many
minutes (v63). Exits with a one-line message when there is no GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import open_gpu, synthetic_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3.6-35b-a3b", help="synthetic model shapes (ninfer_rt/configs), "
                    "recipe of the same name")
    ap.add_argument("--context", type=int, default=8192, help="context length of the decode step")
    ap.add_argument("--launches", type=int, default=1, help="graph launches inside the profiled range")
    ap.add_argument("--warmup", type=int, default=3, help="graph launches before it, not profiled")
    args = ap.parse_args()
    if args.context < 1 or args.launches < 1 or args.warmup < 0:
        sys.exit("ncu_graph: --context and --launches must be at least 1, --warmup at least 0")

    from ninfer_rt.gpu.bench import decode_step_graph
    from ninfer_rt.gpu.engine import context_bucket

    gpu, k, console = open_gpu("ncu_graph")
    with synthetic_model(gpu, k, args.model, context_bucket(args.context + 1)) as model:
        graph = decode_step_graph(model, args.context)
        for _ in range(args.warmup):
            graph.launch(gpu.stream)
        with gpu.profiled():
            for _ in range(args.launches):
                graph.launch(gpu.stream)
    console.print(f"{args.model} @ {args.context:,}: {args.launches} graph launch(es) profiled", highlight=False)


if __name__ == "__main__":
    main()
