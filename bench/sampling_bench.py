"""Time the device draws at decode shape (V = 248,320): arg-max, the sampler and the logprobs record, at 1 and 4 rows.

    python bench/sampling_bench.py [--rows 1,4] [--json PATH]

Each op is timed two ways: as a CUDA graph of that op alone replayed back to back (what a decode step's graph
pays for it, launch gaps included), and launched eagerly with an event pair around each of its launches (where
its time goes, one line a kernel). Logits are "flat" (normal, σ 2.5: thousands of ids within a few logits of the
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


class _Timed:
    """A Kernels stand-in that puts an event pair around each launch and keeps them per entry point."""

    def __init__(self, k):
        self.k, self.pairs = k, []

    def launch(self, name, grid, block, args, smem=0, stream=None, cluster=None):
        from ninfer_rt.gpu.driver import Event

        a, b = Event(), Event()
        a.record(self.k.gpu.stream)
        self.k.launch(name, grid, block, args, smem, stream, cluster)
        b.record(self.k.gpu.stream)
        self.pairs.append((name, a, b))

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
    from ninfer_rt.gpu.driver import Event, Gpu
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
                graph = gpu.end_capture(gpu.stream)
                e0, e1 = Event(), Event()
                e0.record(gpu.stream)
                for _ in range(REPS):
                    graph.launch(gpu.stream)
                e1.record(gpu.stream)
                e1.synchronize()
                graph.destroy()
                t = _Timed(k)
                for _ in range(20):
                    fn(t)
                gpu.synchronize()
                parts: dict[str, float] = {}
                for kn, ea, eb in t.pairs:
                    parts[kn] = parts.get(kn, 0.0) + ea.elapsed_ms(eb) * 1e3 / 20
                out_rows.append({"rows": M, "logits": dist, "op": name, "graph_us": e0.elapsed_ms(e1) * 1e3 / REPS,
                                 "kernels_us": parts})
        for p in [lp, out, am, sm, tops, lps, recs, *pp.values()]:
            gpu.free(p)
    table = Table(title=f"draws on {gpu.info.name}, V = {V}: µs a call")
    for col in ("rows", "logits", "op", "graph µs", "each kernel (eager, µs)"):
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
