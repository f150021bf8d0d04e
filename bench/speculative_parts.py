"""What each part of a speculative step costs on the GPU, host waits included, against a plain decode step.

    python bench/speculative_parts.py [--model qwen3.6-35b-a3b] [--context 8192] [--calls 100] [--json PATH]

Each row is the mean wall time of one call as speculative.Speculator makes it (GpuBackend over a synthetic model
after a prompt of --context tokens), so a row includes the host's launches, copies and waits, not only the GPU's
work: a plain step (sample_next, the draw inside the step's graph), a verification of one token (the step of 0
drafts: every row's hidden state and arg-max back), the same step's graph alone, the head over 1, 8, 128 or 256
real rows (a decode-sized call up to 8; the pairs steps of 0 drafts leave, IDLE_HEAD_ROWS, in one prefill-sized
call), a chain of 2 more rows on the device, and a rewind of a
verification of 4 to 1 token, by a captured graph and by 30 host copies; and Batch's batched step of two sequences
with and without their rows' hidden states (kept for a sequence's MTP head).
Exits with a one-line message when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import open_gpu, synthetic_model  # noqa: E402


def mean_ms(gpu, call, n: int) -> float:
    """Mean wall milliseconds of call() over n calls after 3 untimed ones, the stream drained before the clock
    starts and after it stops."""
    for _ in range(3):
        call()
    gpu.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    gpu.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.6-35b-a3b")
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens before the timed calls")
    ap.add_argument("--calls", type=int, default=100, help="calls a row's mean is taken over")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from rich.table import Table

    from ninfer_rt.gpu.backend import GpuBackend
    from ninfer_rt.sampling import SamplingParams

    gpu, k, console = open_gpu("speculative_parts")
    greedy = SamplingParams(greedy=True)
    n = a.calls
    with synthetic_model(gpu, k, a.model, a.context + 20 * n + 256, slots=2, groups=("text", "mtp")) as model:
        be = GpuBackend.of_model(model)
        V, H = model.spec.vocab_size, model.H
        ids = np.random.default_rng(0).integers(0, V, a.context)
        cache = be.new_cache(0)
        _, hidden, _ = be.verify(ids, cache, undoable=False, top1=V)
        head = be.new_draft_cache(cache)
        be.draft(hidden[:-1], ids[1:], head, top1=V)
        one, tok = np.asarray([7]), np.asarray([7], np.int64)

        def draft(rows: int, chain: int = 0):
            h = np.random.default_rng(rows).standard_normal((rows, H)).astype(np.float32)

            def call():
                be.draft(h, np.full(rows, 7, np.int64), head, top1=V, chain=chain)
                head.pos -= rows + chain  # the same positions again
            return call

        other = be.new_cache(1)  # a second sequence for Batch's batched steps
        be.verify(ids, other, undoable=False, top1=V)

        def batched(hidden: bool):
            def call():
                be.decode_batch([7, 7], [cache, other], hidden=hidden)
            return call

        def rewind(graph: bool):
            def call():
                _, _, undo = be.verify(np.asarray([7, 8, 9, 10]), cache, top1=V)
                model.rewind(cache.slot, 1, undo, graph=graph)
                cache.pos -= undo - 1
            return call

        rows = [
            ("plain step (sample_next, greedy)",
             lambda: be.sample_next(one, cache, greedy, vocab=V, seed=1, step=0)),
            ("verification of 1 token (top1, hidden row)", lambda: be.verify(tok, cache, top1=V)),
            ("  its step's graph alone", lambda: (model.verify(one.astype(np.int32), cache.pos, cache.slot, vocab=V),
                                                  setattr(cache, "pos", cache.pos + 1))),
            ("head over 1 row (top1)", draft(1)),
            ("head over 8 rows (top1)", draft(8)),
            ("head over 128 rows (top1, prefill-sized)", draft(128)),
            ("head over 256 rows (top1, prefill-sized)", draft(256)),
            ("head over 1 row and a chain of 2", draft(1, 2)),
            ("verification of 4, rewind to 1 (graph)", rewind(True)),
            ("verification of 4, rewind to 1 (30 copies)", rewind(False)),
            ("batched step of 2 (decode_batch)", batched(False)),
            ("  with both rows' hidden states (a head waits)", batched(True)),
        ]
        results = []
        for name, call in rows:
            results.append({"part": name, "ms": mean_ms(gpu, call, n)})
        table = Table(title=f"{a.model} at {a.context:,} context, {gpu.info.name}: ms a call, host waits included")
        table.add_column("part")
        table.add_column("ms", justify="right")
        for r in results:
            table.add_row(r["part"], f"{r['ms']:.3f}")
        console.print(table)
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "gpu": gpu.info.name, "context": a.context, "calls": n,
                                      "rows": results}, indent=1))


if __name__ == "__main__":
    main()
