"""The speculative loop end to end on the GPU (ninfer_rt.speculative.decode over GpuBackend) at set acceptance rates.

    python bench/speculative_loop.py [--model qwen3.6-35b-a3b] [--context 8192] [--draft-tokens 1 2 3]
                                     [--accept 0 0.6 0.8 1] [--tokens 64] [--sampled] [--idle-head-rows N ...]
                                     [--no-draft-ms MS ...] [--json PATH]

Synthetic weights draft nothing a verification keeps, so the head's drafts are steered (speculative.SteeredDrafts):
the head runs as it would (same kernels, caches and host transfers), then its pick is replaced by plain greedy
decoding's token at that position, wrong with probability 1 - accept (a fixed hash of the position). The prompt
is one whose greedy path has no near-tie (clear_prompt), so that every run's output can be plain greedy's (with
only acceptance 0 asked, any prompt: no draft can be kept, so a near-tie changes no step's cost).
What this measures is the loop's cost (verifications with trails, rewinds, draft steps, the host's sampling and
transfers) at a given acceptance; what acceptance a real head reaches is the checkpoint's, not measured here.
Plain rows: the same tokens by GpuBackend.sample_next (the api's path, the draw inside the step's graph). Each
count runs fixed, then the planner (speculative.DraftPlanner, the api's default) choosing up to the most.
Exits with a one-line message when there is no GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import open_gpu, synthetic_model  # noqa: E402


def wrong_at(accept: float):
    """wrong(position) for SteeredDrafts: a fixed hash of the position falls above `accept`."""
    def wrong(p: int) -> bool:
        u = int.from_bytes(hashlib.blake2b(p.to_bytes(8, "little"), digest_size=8).digest(), "little") / 2**64
        return u >= accept
    return wrong


MARGIN = 2e-3  # least gap between a greedy path's two best logits, in standard deviations of the step's logits


def clear_prompt(be, vocab: int, context: int, tokens: int, console) -> list[int]:
    """A random prompt whose greedy continuation of `tokens` meets no near-tie: at every step the two best logits
    differ by >= MARGIN standard deviations of the row. Why: a verification of several rows rounds differently
    from a one-token step, and at a near-tie that flips the token; from there the steered drafts (plain's tokens)
    are all wrong and the row measures a different loop (seen: k = 3, every draft steered right, 2 of 177 kept)."""
    for seed in range(32):
        ids = np.random.default_rng(seed).integers(0, vocab, context).tolist()
        c, feed, least = be.new_cache(0), ids, np.inf
        for _ in range(tokens):
            row = be.forward(np.asarray(feed, np.int32), c, last_only=True)[0, :vocab]
            a, b = np.partition(row, -2)[-2:]
            least = min(least, abs(a - b) / row.std())
            feed = [int(row.argmax())]
        if least >= MARGIN:
            console.print(f"prompt seed {seed}: greedy path's least top-2 gap {least:.1e} standard deviations",
                          highlight=False)
            return ids
    raise SystemExit(f"no prompt seed of 32 gives a greedy path without near-ties (>= {MARGIN} std)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.6-35b-a3b")
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens before the generated ones")
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--accept", type=float, nargs="+", default=[0.0, 0.6, 0.8, 1.0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    ap.add_argument("--sampled", action="store_true", help="also sample (ninfer-rt bench's temperature 0.6, "
                    "top_k 20, top_p 0.95): the target rows' distributions on the device")
    ap.add_argument("--idle-head-rows", type=int, nargs="+", default=None,
                    help="run the planner rows at each of these speculative.IDLE_HEAD_ROWS (pairs steps without "
                    "drafts leave waiting for one head call); default: the module's")
    ap.add_argument("--no-draft-ms", type=float, nargs="+", default=None,
                    help="run the planner rows with each of these costs of a step of 0 drafts (ms; the others "
                    "speculative.default_cost's); default: default_cost's")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from ninfer_rt import speculative
    from ninfer_rt.generation import GenerationStats
    from ninfer_rt.gpu.backend import GpuBackend
    from ninfer_rt.gpu.bench import SAMPLED
    from ninfer_rt.sampling import Sampler, SamplingParams

    gpu, k, console = open_gpu("speculative_loop")
    modes = {"greedy": SamplingParams(greedy=True)}
    if a.sampled:
        modes["sampled"] = SamplingParams(**SAMPLED, seed=1)
    rows = []
    with synthetic_model(gpu, k, a.model, a.context + a.tokens + 16, slots=1, groups=("text", "mtp")) as model:
        be = GpuBackend.of_model(model)
        vocab = model.spec.vocab_size
        if a.sampled or any(acc > 0 for acc in a.accept):
            ids = clear_prompt(be, vocab, a.context, a.tokens, console)
        else:
            ids = np.random.default_rng(0).integers(0, vocab, a.context).tolist()
        idle_rows = a.idle_head_rows or [speculative.IDLE_HEAD_ROWS]
        zero_ms = a.no_draft_ms or [speculative.default_cost(0)]
        for mode, params in modes.items():
            for rep in range(2):  # the first run captures the graphs
                c = be.new_cache(0)
                plain = [be.sample_next(np.asarray(ids, np.int32), c, params, vocab=vocab, seed=1, step=0)]
                gpu.synchronize()
                t0 = time.perf_counter()
                while len(plain) < a.tokens:
                    plain.append(be.sample_next(np.asarray(plain[-1:], np.int32), c, params, vocab=vocab, seed=1,
                                                step=len(plain)))
                dt = time.perf_counter() - t0
            rows.append({"mode": mode, "draft_tokens": 0, "accept": None, "tok_s": (a.tokens - 1) / dt})
            console.print(f"plain {mode} (sample_next): {(a.tokens - 1) / dt:,.1f} tok/s", highlight=False)
            # sampled runs leave plain's stream at the first draw, so their drafts are rarely right
            # each count fixed, then the planner choosing up to the most (DraftPlanner, the api's default)
            runs = [(n, False, idle_rows[0], zero_ms[0]) for n in a.draft_tokens]
            runs += [(max(a.draft_tokens), True, r, z) for r in idle_rows for z in zero_ms]
            for n, adaptive, idle, zero in runs:
                speculative.IDLE_HEAD_ROWS = idle

                def cost(k: int, zero: float = zero) -> float:
                    return zero if k == 0 else speculative.default_cost(k)
                for acc in a.accept if mode == "greedy" else [1.0]:
                    for rep in range(2):
                        stats = GenerationStats(prompt_tokens=len(ids))
                        steered = speculative.SteeredDrafts(be, ids + plain, wrong_at(acc))
                        out = list(speculative.decode(steered, be.new_cache(0), ids, a.tokens, Sampler(params),
                                                      stats, draft_tokens=n, real_vocab=vocab,
                                                      is_stop=lambda t: False,
                                                      planner=speculative.DraftPlanner(n, cost, fixed=not adaptive)))
                    tok_s = (len(out) - 1) / stats.decode_s
                    kept = stats.accepted_tokens / max(stats.draft_tokens, 1)
                    rows.append({"mode": mode, "draft_tokens": n, "adaptive": adaptive, "idle_head_rows": idle,
                                 "no_draft_ms": zero, "accept": acc, "tok_s": tok_s, "kept": kept,
                                 "drafted": stats.draft_tokens, "match": out == plain})
                    k = f"k <= {n} (planner, idle head rows {idle}, 0 drafts {zero} ms)" if adaptive else f"k = {n}"
                    console.print(f"{mode}, {k}, steered acceptance {acc:.1f}: {tok_s:,.1f} tok/s, "
                                  f"{stats.accepted_tokens} of {stats.draft_tokens} drafts kept, output "
                                  f"{'=' if out == plain else '!='} plain", highlight=False)
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "gpu": gpu.info.name, "context": a.context,
                                      "tokens": a.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
