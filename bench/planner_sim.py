"""The draft planner's throughput at each acceptance, simulated against the best fixed draft count (CPU only).

    python bench/planner_sim.py [--steps 3000] [--seeds 3] [--max-drafts 3] [--json PATH]

Each step asks speculative.DraftPlanner for a count n, keeps each draft with probability a until the first refused
one (as a head whose drafts are each right with probability a), and charges speculative.default_cost(n) ms for the
1 + kept tokens it emits. The oracle is the best fixed count at that acceptance, known in closed form: the n of
0..max drafts with the most E(n) / cost(n), E(n) = 1 + a + ... + a^n. What this measures is the planner's policy
under its own cost model (how much its noisy estimate of a loses against knowing a), not the GPU: the loop's
measured costs are bench/speculative_loop.py's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer_rt.speculative import DraftPlanner, default_cost  # noqa: E402

ACCEPTS = (0.0, 0.3, 0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)


def best_fixed(accept: float, max_drafts: int, cost=default_cost) -> tuple[int, float]:
    """(the fixed count with the most tokens a ms at this acceptance, those tokens a ms)."""
    rate = {n: sum(accept ** i for i in range(n + 1)) / cost(n) for n in range(max_drafts + 1)}
    n = max(rate, key=lambda k: (rate[k], k))
    return n, rate[n]


def simulate(accept: float, steps: int, seed: int, max_drafts: int = 3, planner_cls=DraftPlanner) -> float:
    """Tokens a ms of `steps` planned steps where each draft is kept with probability `accept`."""
    rng = np.random.default_rng(seed)
    planner = planner_cls(max_drafts)
    tokens = ms = 0.0
    for _ in range(steps):
        n = planner.choose(1 << 30)
        kept = 0
        while kept < n and rng.random() < accept:
            kept += 1
        tokens, ms = tokens + kept + 1, ms + planner.cost(n)
        planner.observe(n, kept)
    return tokens / ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3000, help="planned steps a run")
    ap.add_argument("--seeds", type=int, default=3, help="runs a row's mean is taken over")
    ap.add_argument("--max-drafts", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"DraftPlanner(max {a.max_drafts}) over {a.steps:,} steps, default_cost's ms: tok/s")
    for col in ("acceptance", "plain", "best fixed", "planner", "planner / best"):
        table.add_column(col, justify="right")
    rows = []
    for acc in ACCEPTS:
        n, best = best_fixed(acc, a.max_drafts)
        got = float(np.mean([simulate(acc, a.steps, s, a.max_drafts) for s in range(a.seeds)]))
        rows.append({"accept": acc, "plain_tok_s": 1e3 / default_cost(0), "best_fixed": n,
                     "best_tok_s": best * 1e3, "planner_tok_s": got * 1e3, "ratio": got / best})
        table.add_row(f"{acc:.2f}", f"{1e3 / default_cost(0):,.0f}", f"{best * 1e3:,.0f} (k = {n})",
                      f"{got * 1e3:,.0f}", f"{got / best:.3f}")
    Console().print(table)
    if a.json:
        a.json.write_text(json.dumps({"steps": a.steps, "seeds": a.seeds, "max_drafts": a.max_drafts,
                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
