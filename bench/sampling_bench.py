"""Time the device draws at decode shape (V = 248,320): arg-max, the sampler and the logprobs record, at 1 and 4 rows.

    python bench/sampling_bench.py [--rows 1,4] [--json PATH]

Each op is timed two ways: as a CUDA graph of that op alone replayed back to back (what a decode step's graph
pays for it, launch gaps included), and each of its kernels as a graph of that launch alone (where its time goes;
what is left of the op's time is the launch gaps and the memset). Logits are "flat" (normal, σ 2.5: thousands of ids within a few logits of the
top, the sampler's worst case) or "peaked" (the same with 40 ids raised by 12, as a trained model's rows look).
Sampling: Qwen3.6's non-thinking setting (T 0.7, top-k 20, top-p 0.8), and T 0.8 with top-k off (top-p 0.95).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer_rt.errors import NinferError  # noqa: E402

V = 248_320
REPS = 200


def _replay_us(gpu, graph) -> float:
    """µs a replay of graph over REPS back to back (then freed)."""
    from ninfer_rt.gpu.driver import Event

    a, b = Event(), Event()
    a.record(gpu.stream)
    for _ in range(REPS):
        graph.launch(gpu.stream)
    b.record(gpu.stream)
    b.synchronize()
    graph.destroy()
    return a.elapsed_ms(b) * 1e3 / REPS


class _PerKernel:
    """A Kernels stand-in that captures each launch into a graph of its own and times its replays (µs a launch),
    kept per entry point: a kernel's own time, without the event pairs' overhead an eager timing would add. The
    launches run in order (each graph replayed REPS times), so each reads what the one before it wrote; every other
    kernel of the draws writes its outputs whole, so its replays leave them as one launch does."""

    def __init__(self, k):
        self.k, self.us = k, {}

    def launch(self, name, grid, block, args, smem=0, stream=None, cluster=None):
        gpu = self.k.gpu
        gpu.begin_capture(gpu.stream)
        if name == "sample_hist":  # it adds into its histogram (args[4], [M, 2048] int32): zeroed each replay
            gpu.memset(args[4].value, 0, grid[1] * 2048 * 4, gpu.stream)
        self.k.launch(name, grid, block, args, smem, stream, cluster)
        graph = gpu.end_capture(gpu.stream)
        graph.launch(gpu.stream)
        self.us[name] = self.us.get(name, 0.0) + _replay_us(gpu, graph)

    def __getattr__(self, attr):
        return getattr(self.k, attr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4", help="rows a call (comma-separated)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    from ninfer_rt.gpu import misc
    from ninfer_rt.gpu.driver import Gpu
    from ninfer_rt.gpu.kernels import Kernels

    gpu = Gpu(0)
    k = Kernels(gpu)
    out_rows = []
    for M in [int(r) for r in a.rows.split(",")]:
        rng = np.random.default_rng(0)
        flat = (rng.standard_normal((M, V)) * 2.5).astype(np.float32)
        peaked = flat.copy()
        for m in range(M):
            peaked[m, rng.choice(V, 40, replace=False)] += 12
        lp, out = gpu.alloc(flat.nbytes), gpu.alloc(4 * M)
        am, sm = gpu.alloc(misc.argmax_scratch_bytes(M)), gpu.alloc(misc.sample_scratch_bytes(M, V))
        tops, lps = gpu.alloc(4 * M), gpu.alloc(misc.logprob_scratch_bytes(M, V))
        recs = gpu.alloc(4 * M * misc.LP_INTS)
        gpu.upload(tops, np.full(M, 5, np.int32))
        params = {"top-k 20": misc.sample_params(0.7, 20, 0.8, 0.0, 3, 4),
                  "top-k off": misc.sample_params(0.8, 0, 0.95, 0.0, 3, 4)}
        pp = {name: gpu.alloc(r.nbytes * M) for name, r in params.items()}
        for name, r in params.items():
            gpu.upload(pp[name], np.concatenate([r] * M))
        ops = {"argmax": lambda kk: misc.argmax(kk, logits=lp, ld=V, M=M, V=V, out=out, scratch=am)}
        for name in params:
            ops[f"sample {name}"] = (lambda p: lambda kk: misc.sample(kk, logits=lp, ld=V, M=M, V=V, params=p,
                                                                      out=out, scratch=sm))(pp[name])
        ops["logprobs 5"] = lambda kk: (
            misc.logprob_rows(kk, logits=lp, ld=V, M=M, V=V, tops=tops, scratch=lps),
            misc.logprob_finish(kk, tokens=out, src=lp, ld=V, M=M, V=V, tops=tops, scratch=lps, out=recs))
        for dist, logits in (("flat", flat), ("peaked", peaked)):
            gpu.upload(lp, logits)
            for name, fn in ops.items():
                fn(k)
                gpu.begin_capture(gpu.stream)
                fn(k)
                graph_us = _replay_us(gpu, gpu.end_capture(gpu.stream))
                t = _PerKernel(k)
                fn(t)
                out_rows.append({"rows": M, "logits": dist, "op": name, "graph_us": graph_us, "kernels_us": t.us})
        for p in [lp, out, am, sm, tops, lps, recs, *pp.values()]:
            gpu.free(p)
    table = Table(title=f"draws on {gpu.info.name}, V = {V}: µs a call")
    for col in ("rows", "logits", "op", "graph µs", "each kernel alone (µs)"):
        table.add_column(col, justify="right" if col in ("rows", "graph µs") else "left")
    for r in out_rows:
        table.add_row(str(r["rows"]), r["logits"], r["op"], f"{r['graph_us']:.1f}",
                      ", ".join(f"{n} {v:.1f}" for n, v in r["kernels_us"].items()))
    Console().print(table)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"device": gpu.info.name, "V": V, "rows": out_rows}, indent=1))


if __name__ == "__main__":
    try:
        main()
    except NinferError as e:
        sys.exit(f"sampling_bench: {e}")
