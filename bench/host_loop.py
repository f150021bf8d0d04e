"""What one sequence's decode loop costs beyond its graph: the host's share of a token as Model.generate makes it.

    python bench/host_loop.py [--model qwen3.6-35b-a3b] [--context 8192] [--steps 200] [--batch 2,4] [--penalties]
                              [--logprobs 5] [--json-string] [--json PATH]

Each row times --steps tokens of one loop, the median of 5 rounds after a first that captures the graph, against
`ninfer-rt bench`'s back-to-back replay of the same graph: the difference is what the host adds to a token.
- "wait": GpuBackend.sample_next back to back; each enqueues the step's graph with the draw inside, then waits
  for the one id it reads back (launch, the wait, the id's copy and Python follow the step: the loop before
  run-ahead).
- "ahead": GpuBackend.sample_ahead as Model.generate runs it now (Model._run_ahead): each step is fed its token on
  the device and enqueued before the host reads the token before it, one step in flight beyond the one read.
- "B=n host" / "B=n device" / "B=n ahead" (--batch): a batched step of n sequences as Batch makes it, each row's
  token drawn by the host's Sampler from the step's [n, V] logits (Batch before v106; still a row with a JSON
  constraint), on the device (GpuBackend.sample_batch: only the ids come back), or on the device a step run ahead
  (sample_batch_ahead: Batch where GpuBackend.batch_ahead is on); against the n-row step's replay (for sampled
  device rows, the step that draws each row under ninfer_rt.gpu.bench.SAMPLED's record). Tokens/s
  count every sequence's token.
- "host" / "device wait" / "device ahead" (--penalties): Qwen3.6's non-thinking setting (presence 1.5), drawn on
  the host from the step's downloaded logits (what generate does while DEVICE_PENALTIES is off), or on the device
  with the slot's penalty state (DEVICE_PENALTIES on), against the sampled step's replay.
- "host" / "device" / "device ahead" (--logprobs N): greedy with each token's logprob and N alternatives, as Batch
  takes them for a sequence alone: token_logprob over the step's downloaded logits after the host's draw (before
  v109), the device's record (GpuBackend.sample_batch with logprobs), or the record through the pinned ring a step
  run ahead (sample_ahead with logprobs; Batch where GpuBackend.logprobs_ahead is on), against the greedy step's
  replay.
- "host" / "device" / "device ahead" (--json-string; "B=n device" / "B=n device ahead" with --batch, each row in
  its own string): greedy inside a JSON string value (`{"text": "` already written), each token checked as Batch
  checks it (JsonTokens.allows) against a synthetic byte table (token t: 1 + t % 4 letters, so every draw is taken,
  as a trained model's first choice mostly is): drawn on the host from the downloaded logits (Batch before v112), on
  the device with only the id back (v112), or on the device under the string's mask a step ahead (Batch where
  GpuBackend.json_ahead is on, v118-v119), against the greedy step's replay.
Greedy and top-k sampling (its draw record uploaded each step). The detokenizer and the stop checks of generate
come on top (under "ahead" they overlap the GPU's step). Synthetic weights, no file. Exits with a one-line message
when there is no GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import open_gpu, step_rows_out, synthetic_model  # noqa: E402

ROUNDS = 6  # the first captures the context bucket's graph and is not counted


PROMPT_IDS = 64  # the history a penalised loop starts from (its penalty state): this many ids, all prompt


def _chain(enqueue, read, steps: int) -> None:
    """Draws 1..steps run ahead as the decode loops run them: enqueue(i) queues the step drawing i, fed on the
    device by the draw before it, while read() takes the one before it, so one step stays in flight beyond the one
    being read."""
    nxt = enqueue(1)
    for i in range(2, steps + 2):
        after = enqueue(i) if i <= steps else None
        read(nxt)
        nxt = after


def loop_s(backend, model, ctx: int, steps: int, params, ahead: bool) -> float:
    """Median seconds a token over rounds of `steps` tokens that end at position ctx (one graph bucket), each
    step fed the id the one before drew: from the host (sample_next) or on the device (sample_ahead). Penalised
    params: the slot's penalty state is set each round from PROMPT_IDS prompt ids (backend.DEVICE_PENALTIES on)."""
    from ninfer_rt.gpu.backend import GpuCache

    times = []
    for _ in range(ROUNDS):
        cache = GpuCache(pos=ctx - steps - 1, slot=0)
        if params.penalised:
            backend.set_penalties(cache, list(range(PROMPT_IDS)), PROMPT_IDS, params)
        token = backend.sample_next(np.array([17], np.int32), cache, params, vocab=model.sample_vocab, seed=1,
                                    step=0)  # the draw the first fed step reads (outside the timing)
        t0 = time.perf_counter()
        if ahead:
            _chain(lambda i: backend.sample_ahead(cache, params, vocab=model.sample_vocab, seed=1, step=i),
                   lambda pending: pending.result(), steps)
        else:
            for i in range(1, steps + 1):
                token = backend.sample_next(np.array([token], np.int32), cache, params, vocab=model.sample_vocab,
                                            seed=1, step=i)
        times.append((time.perf_counter() - t0) / steps)
    return float(np.median(times[1:]))


def host_loop_s(backend, model, ctx: int, steps: int, params) -> float:
    """loop_s with each token drawn on the host, as generate does where the device cannot draw (penalties without
    DEVICE_PENALTIES, logprobs, JSON): the step's logits row downloaded, the padded ids masked, Sampler over the
    history (PROMPT_IDS prompt ids, then the output)."""
    from ninfer_rt.gpu.backend import GpuCache
    from ninfer_rt.sampling import Sampler

    V = model.sample_vocab
    times = []
    for _ in range(ROUNDS):
        cache, sampler = GpuCache(pos=ctx - steps, slot=0), Sampler(params)
        history, token = list(range(PROMPT_IDS)), 17
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = backend.forward(np.array([token], np.int32), cache, last_only=True)[-1]
            logits[V:] = -np.inf
            token = sampler.sample(logits, history, PROMPT_IDS)
            history.append(token)
        times.append((time.perf_counter() - t0) / steps)
    return float(np.median(times[1:]))


def batch_loop_s(backend, model, ctx: int, steps: int, params, B: int, draws: str) -> float:
    """Median seconds a batched step of B sequences (slots 0..B-1, positions ctx - steps .. ctx - 1) over rounds of
    `steps` steps, each row fed the token drawn for it the step before: draws "host", by a host Sampler per row from
    the step's logits (the padded vocabulary masked, as Model._pick does); "device", by sample_batch; "ahead", by
    sample_batch_ahead, each step fed on the device and queued before the host reads the one before it (as Batch
    runs them where GpuBackend.batch_ahead is on)."""
    from ninfer_rt.gpu.backend import GpuCache
    from ninfer_rt.sampling import Sampler

    V = model.sample_vocab
    times = []
    for _ in range(ROUNDS):
        caches = [GpuCache(pos=ctx - steps - (draws == "ahead"), slot=i) for i in range(B)]
        samplers = [Sampler(params) for _ in range(B)]
        seeds = [s.seed for s in samplers]
        tokens = [(17 + 1009 * i) % V for i in range(B)]
        if draws == "ahead":  # the batched draw the chain starts from (outside the timing)
            tokens = backend.sample_batch(tokens, caches, [params] * B, vocab=V, seeds=seeds, steps=[0] * B)
        t0 = time.perf_counter()
        if draws == "ahead":
            _chain(lambda i: backend.sample_batch_ahead(caches, [params] * B, vocab=V, seeds=seeds, steps=[i] * B),
                   lambda rows: [p.result() for p in rows], steps)
        else:
            for i in range(steps):
                if draws == "device":
                    tokens = backend.sample_batch(tokens, caches, [params] * B, vocab=V, seeds=seeds,
                                                  steps=[i] * B)
                else:
                    logits = backend.decode_batch(tokens, caches)
                    logits[:, V:] = -np.inf
                    tokens = [s.sample(row, [], 0) for s, row in zip(samplers, logits)]
        times.append((time.perf_counter() - t0) / steps)
    return float(np.median(times[1:]))


def logprob_loop_s(backend, model, ctx: int, steps: int, top: int, loop: str) -> float:
    """Median seconds a greedy token with its logprobs (top alternatives) over rounds of `steps`: "host", from the
    downloaded logits (the host's draw and token_logprob); "device", the device's record (sample_batch);
    "device ahead", the record with its token through the pinned ring, a step run ahead (sample_ahead)."""
    from ninfer_rt.gpu.backend import GpuCache
    from ninfer_rt.logprobs import token_logprob
    from ninfer_rt.sampling import Sampler, SamplingParams

    V, params = model.sample_vocab, SamplingParams(greedy=True)
    times = []
    for _ in range(ROUNDS):
        cache, sampler, token = GpuCache(pos=ctx - steps - 1, slot=0), Sampler(params), 17
        first = backend.sample_batch([token], [cache], [params], vocab=V, seeds=[0], steps=[0], logprobs=[top])[0]
        token = first.id  # (outside the timing: the draw the first fed step reads)
        t0 = time.perf_counter()
        if loop == "device ahead":
            _chain(lambda i: backend.sample_ahead(cache, params, vocab=V, seed=0, step=i, logprobs=top),
                   lambda pending: pending.logprob(), steps)
        else:
            for i in range(1, steps + 1):
                if loop == "device":
                    lp = backend.sample_batch([token], [cache], [params], vocab=V, seeds=[0], steps=[i],
                                              logprobs=[top])[0]
                else:
                    logits = backend.forward(np.array([token], np.int32), cache, last_only=True)[-1]
                    logits[V:] = -np.inf
                    lp = token_logprob(logits, sampler.sample(logits, [], 0), top, V)
                token = lp.id
        times.append((time.perf_counter() - t0) / steps)
    return float(np.median(times[1:]))


def json_loop_s(backend, model, ctx: int, steps: int, loop: str, B: int = 1) -> float:
    """Median seconds a step of B greedy rows inside JSON string values (slots 0..B-1) over rounds of `steps`, each
    token checked as Batch checks it (JsonTokens.allows; token t's bytes are 1 + t % 4 letters, so every one keeps
    the string plain, as a trained model's first choice there mostly does): "host" (B = 1), drawn from the
    downloaded logits; "device", drawn on the device (sample_batch), logits read only where the constraint refuses
    the id; "device ahead", drawn under each string's mask (JsonTokens.mask, set_mask) a step ahead (sample_ahead
    alone, sample_batch_ahead for B > 1), as Batch runs JSON rows inside a plain string where GpuBackend.json_ahead
    is on."""
    from ninfer_rt.gpu.backend import GpuCache
    from ninfer_rt.json_automaton import SchemaPrefix
    from ninfer_rt.json_schema import compile_schema
    from ninfer_rt.json_tokens import ByteTokens, JsonTokens
    from ninfer_rt.sampling import Sampler, SamplingParams

    V, params, ahead = model.sample_vocab, SamplingParams(greedy=True), loop == "device ahead"
    schema = compile_schema({"type": "object", "properties": {"text": {"type": "string"}}})
    rules = JsonTokens(ByteTokens([bytes([0x61 + t % 26]) * (1 + t % 4) for t in range(V)]), V)
    times = []
    for _ in range(ROUNDS):
        caches = [GpuCache(pos=ctx - steps - ahead, slot=b) for b in range(B)]
        sampler, tokens, states = Sampler(params), [(17 + 1009 * b) % V for b in range(B)], []
        for _ in range(B):
            states.append(SchemaPrefix(schema))
            if not states[-1].feed(b'{"text": "'):
                raise RuntimeError("json_loop_s: the constraint refused its own prefix")

        def take(b: int, t: int) -> None:
            if (after := rules.allows(states[b], t)) is None:  # never here: every token continues the string
                raise RuntimeError(f"json_loop_s: the table's token {t} was refused")
            states[b] = after

        def draw_all(i: int) -> list[int]:
            return backend.sample_batch(tokens, caches, [params] * B, vocab=V, seeds=[0] * B, steps=[i] * B)

        if ahead:  # the masked draws the chain starts from (outside the timing)
            for b, cache in enumerate(caches):
                backend.set_mask(cache, rules.mask(states[b], backend.mask_words))
            for b, t in enumerate(draw_all(0)):
                take(b, t)
        t0 = time.perf_counter()
        if ahead and B == 1:
            _chain(lambda i: backend.sample_ahead(caches[0], params, vocab=V, seed=0, step=i),
                   lambda pending: take(0, pending.result()), steps)
        elif ahead:
            _chain(lambda i: backend.sample_batch_ahead(caches, [params] * B, vocab=V, seeds=[0] * B, steps=[i] * B),
                   lambda rows: [take(b, p.result()) for b, p in enumerate(rows)], steps)
        else:
            for i in range(steps):
                if loop == "device":
                    tokens = draw_all(i)
                else:
                    logits = backend.forward(np.array(tokens, np.int32), caches[0], last_only=True)[-1]
                    logits[V:] = -np.inf
                    tokens = [sampler.sample(logits, [], 0)]
                for b, t in enumerate(tokens):
                    take(b, t)
        times.append((time.perf_counter() - t0) / steps)
        for cache in caches if ahead else []:
            backend.set_mask(cache, None)
    return float(np.median(times[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3.6-35b-a3b", help="synthetic shapes and recipe")
    ap.add_argument("--context", type=int, default=8192, help="the position the timed steps end at")
    ap.add_argument("--steps", type=int, default=200, help="calls a round (they stay in one graph bucket)")
    ap.add_argument("--batch", default="2,4", help="batched steps of these many sequences (comma-separated; "
                    "empty: none)")
    ap.add_argument("--penalties", action="store_true", help="also Qwen3.6's non-thinking setting (presence 1.5): "
                    "drawn on the host, and on the device (DEVICE_PENALTIES on for those rows)")
    ap.add_argument("--logprobs", type=int, default=None, help="also greedy with each token's logprob and this many "
                    "alternatives (0..20): the host's token_logprob over downloaded logits, and the device's record")
    ap.add_argument("--json-string", action="store_true", help="also greedy inside a JSON string value, each "
                    "token's bytes fed to the constraint: drawn on the host, and on the device with the id checked")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args()
    try:
        batches = [int(b) for b in a.batch.split(",") if b.strip()]
    except ValueError:
        sys.exit(f"host_loop: --batch {a.batch!r}: want comma-separated integers")
    if any(not 2 <= b <= 8 for b in batches):
        sys.exit(f"host_loop: --batch {a.batch!r}: each must be in [2, 8]")
    if a.logprobs is not None and not 0 <= a.logprobs <= 20:
        sys.exit(f"host_loop: --logprobs must be in [0, 20], got {a.logprobs}")
    if not 1 <= a.steps < a.context - 1:
        sys.exit(f"host_loop: --steps must be in [1, --context - 1), got {a.steps}")

    from ninfer_rt.gpu.backend import GpuBackend
    from ninfer_rt.gpu.bench import _time_decode
    from ninfer_rt.sampling import SamplingParams

    gpu, k, console = open_gpu("host_loop")
    rows = []
    with synthetic_model(gpu, k, a.model, max_ctx=a.context + 1024, slots=max(batches, default=1)) as model:
        backend = GpuBackend.of_model(model)
        if model.bucket(a.context - a.steps) != model.bucket(a.context):
            sys.exit(f"host_loop: positions {a.context - a.steps - 1}..{a.context} span two graph buckets; fewer "
                     "--steps")
        for label, params in (("greedy", SamplingParams(greedy=True)),
                              ("top-k 20", SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=1))):
            replay = _time_decode(model, a.context - 1, sampled=label != "greedy")
            for loop_kind in ("wait", "ahead"):
                loop = loop_s(backend, model, a.context, a.steps, params, ahead=loop_kind == "ahead")
                rows.append({"model": a.model, "context": a.context, "sampling": label, "loop": loop_kind,
                             "loop_ms": loop * 1e3, "replay_ms": replay * 1e3, "host_us": (loop - replay) * 1e6,
                             "loop_tok_s": 1 / loop, "replay_tok_s": 1 / replay})
            for B in batches:
                for draws in ("host", "device", "ahead"):  # against the step that draws as the loop does
                    replay = _time_decode(model, a.context - 1, batch=B,
                                          sampled=draws != "host" and label != "greedy")
                    loop = batch_loop_s(backend, model, a.context, a.steps, params, B, draws)
                    rows.append({"model": a.model, "context": a.context, "sampling": label, "loop": f"B={B} {draws}",
                                 "loop_ms": loop * 1e3, "replay_ms": replay * 1e3, "host_us": (loop - replay) * 1e6,
                                 "loop_tok_s": B / loop, "replay_tok_s": B / replay})
        if a.penalties:
            from ninfer_rt.gpu import backend as backend_mod

            params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, presence_penalty=1.5, seed=1)
            replay = _time_decode(model, a.context - 1, sampled=True)
            was = backend_mod.DEVICE_PENALTIES
            for loop_kind in ("host", "device wait", "device ahead"):
                backend_mod.DEVICE_PENALTIES = loop_kind != "host"
                try:
                    loop = host_loop_s(backend, model, a.context, a.steps, params) if loop_kind == "host" else \
                        loop_s(backend, model, a.context, a.steps, params, ahead=loop_kind == "device ahead")
                finally:
                    backend_mod.DEVICE_PENALTIES = was
                rows.append({"model": a.model, "context": a.context, "sampling": "non-thinking", "loop": loop_kind,
                             "loop_ms": loop * 1e3, "replay_ms": replay * 1e3, "host_us": (loop - replay) * 1e6,
                             "loop_tok_s": 1 / loop, "replay_tok_s": 1 / replay})
        if a.logprobs is not None:
            replay = _time_decode(model, a.context - 1)
            for draws in ("host", "device", "device ahead"):
                loop = logprob_loop_s(backend, model, a.context, a.steps, a.logprobs, draws)
                rows.append({"model": a.model, "context": a.context, "sampling": f"logprobs {a.logprobs}",
                             "loop": draws, "loop_ms": loop * 1e3, "replay_ms": replay * 1e3,
                             "host_us": (loop - replay) * 1e6, "loop_tok_s": 1 / loop, "replay_tok_s": 1 / replay})
        if a.json_string:
            for B in [1] + batches:  # (each JSON row of a batched step in its own string)
                replay = _time_decode(model, a.context - 1, batch=B)
                for draws in ("host", "device", "device ahead")[B > 1:]:
                    loop = json_loop_s(backend, model, a.context, a.steps, draws, B)
                    rows.append({"model": a.model, "context": a.context, "sampling": "JSON string",
                                 "loop": draws if B == 1 else f"B={B} {draws}", "loop_ms": loop * 1e3,
                                 "replay_ms": replay * 1e3, "host_us": (loop - replay) * 1e6, "loop_tok_s": B / loop,
                                 "replay_tok_s": B / replay})
    step_rows_out(console, gpu, f"{a.model} @ {a.context}: the decode loop against graph replay",
                  [("sampling", True), ("loop", True), ("loop ms", False), ("replay ms", False), ("host µs", False),
                   ("loop tok/s", False), ("replay tok/s", False)],
                  lambda r: (r["sampling"], r["loop"], f"{r['loop_ms']:.4f}", f"{r['replay_ms']:.4f}",
                             f"{r['host_us']:.1f}", f"{r['loop_tok_s']:.1f}", f"{r['replay_tok_s']:.1f}"),
                  rows, a.json)


if __name__ == "__main__":
    main()
