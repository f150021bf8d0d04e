"""`ninfer-rt bench`: prefill and decode throughput, load time and GPU memory, on an artifact or synthetic weights.

Decode is timed as replays of the captured step graph at a fixed context (the KV cache filled with valid
random values up to that length), one sequence, no speculation: events around many replays, median of
several rounds. Prefill is timed end to end on a random prompt, twice: the second run is reported (graphs
captured, first-use costs paid, as llama-bench warms up) and the first beside it as the cold time. Bytes per
decoded token count every weight byte the step reads (routed experts at top_k / E of their banks), the KV cache
up to the context and the DeltaNet states read and written; divided by the step time and the copy bandwidth
measured on the same GPU at the start, they give the fraction of the bandwidth ceiling reached. Decode steps
take the arg-max; one more row times the step that draws its token on the device (SAMPLED: top-k, top-p), as
the chat loop runs it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ninfer_rt.errors import NinferError
from ninfer_rt.format import atomic_output, check_output_path
from ninfer_rt.gpu.driver import Event, Gpu

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@dataclass
class BenchResult:
    model: str
    device: str
    recipe: str
    kv_dtype: str
    copy_bandwidth_gbs: float
    weight_bytes: int
    load_s: float
    peak_gpu_bytes: int
    prefill_chunk: int = 0  # prompt tokens per prefill step (engine.GpuModel prefill_chunk)
    # {tokens, seconds, tok_s, cold_seconds} or {tokens, skipped}: seconds is a prompt run after one of the same
    # length (graphs captured, first-use costs paid, as llama-bench warms up); cold_seconds is that first run
    prefill: list[dict] = field(default_factory=list)
    decode: list[dict] = field(default_factory=list)    # {context, ms_per_token, tok_s, bytes_per_token, ...}
    decode_sampled: dict | None = None                   # {context, sampling, ms_per_token, tok_s}
    # {context, batch, ms_per_step, tok_s}: B sequences a step, each in its own slot at the same context; tok_s is
    # all of them together (the server's continuous batching decodes this way)
    decode_batched: list[dict] = field(default_factory=list)
    # {context, tokens, ms_per_step, vs_one_token, trail_ms_per_step, rewind_ms}: one sequence fed T tokens with
    # every row's logits (what a speculative step's verification costs against a one-token step at that context)
    decode_tokens: list[dict] = field(default_factory=list)
    draft: list[dict] = field(default_factory=list)  # {context, ms_per_step}: the MTP head's step over one row


def builtin_spec(name: str):
    """ModelSpec of a shipped config (ninfer_rt/configs/NAME.json)."""
    from ninfer_rt.config import ModelSpec

    path = CONFIGS / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.json")))
        raise NinferError(f"--synthetic {name}: unknown model shape (known: {known})")
    return ModelSpec.from_config(json.loads(path.read_text()), str(path))


def copy_bandwidth(gpu: Gpu, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median)."""
    a, b = gpu.alloc(nbytes), gpu.alloc(nbytes)
    try:
        gpu.memset(a, 0x5A, nbytes)
        start, stop = Event(), Event()
        times = []
        for i in range(reps + 2):
            start.record(gpu.stream)
            gpu.copy(b, a, nbytes)
            stop.record(gpu.stream)
            stop.synchronize()
            if i >= 2:
                times.append(start.elapsed_ms(stop) / 1e3)
        return 2 * nbytes / statistics.median(times)
    finally:
        gpu.free(a)
        gpu.free(b)


def decode_bytes(spec, weights, ctx: int, kv_dtype: str) -> int:
    """Bytes one decode step of one token reads or writes at context `ctx` (weights, KV cache, states)."""
    total = 0
    E, k = max(spec.num_experts, 1), spec.num_experts_per_tok
    for name, w in weights.matrices.items():
        if name.startswith("mtp."):  # the MTP head: drafting reads it, a decode step does not
            continue
        if name.endswith("embed_tokens.weight"):
            total += w.nbytes // w.shape[0]  # one gathered row
        elif ".mlp.experts." in name:
            total += w.nbytes * k // E
        else:
            total += w.nbytes
    if "lm_head.weight" not in weights.matrices:  # tied: the embedding is read whole as the lm_head
        total += weights.matrix("model.language_model.embed_tokens.weight").nbytes
    n_attn = len(spec.full_attention_layers)
    per_pos = spec.num_key_value_heads * spec.head_dim * (1 if kv_dtype == "int8" else 2) + \
        (spec.num_key_value_heads * 4 if kv_dtype == "int8" else 0)
    total += n_attn * 2 * (ctx + 1) * per_pos
    state = (spec.linear_num_value_heads * spec.linear_key_head_dim * spec.linear_value_head_dim +
             (spec.linear_conv_kernel_dim - 1) * spec.conv_dim) * 4
    total += len(spec.linear_attention_layers) * 2 * state
    return total


def eager_ms(gpu, enqueue, *, rounds: int, reps: int, warmup: int = 1) -> list[float]:
    """Milliseconds per call of enqueue() launched directly (no graph), one value per timed round: `warmup`
    untimed calls, then `rounds` rounds of `reps` back-to-back calls, each round timed between two events.
    (bench/gpu_common re-exports it for the micro-benchmarks.)"""
    from ninfer_rt.gpu import driver  # looked up per call: the CPU tests stand a fake clock in for Event

    for _ in range(warmup):
        enqueue()
    gpu.synchronize()
    start, stop = driver.Event(), driver.Event()
    times = []
    for _ in range(rounds):
        start.record(gpu.stream)
        for _ in range(reps):
            enqueue()
        stop.record(gpu.stream)
        stop.synchronize()
        times.append(start.elapsed_ms(stop) / reps)
    return times


# The sampled decode row: Qwen3's recommended thinking-mode sampling (generation_config.json)
SAMPLED = dict(temperature=0.6, top_k=20, top_p=0.95)


def decode_step_graph(model, ctx: int, sampled: bool = False, batch: int = 1, tokens: int = 1, trail: bool = False):
    """The captured graph of one decode step at context ctx (one step runs first, capturing the bucket's graph);
    sampled: the step draws its token on the device under SAMPLED (the decode loop's graph), else it takes the
    arg-max. batch: sequences in the step (slots 0..batch-1, each at ctx; sampled: each row under the record),
    each fed its own token, so that each routes to its own experts. tokens > 1: one sequence fed that many tokens with the logits
    of every row (GpuModel.verify: speculative decoding's verification; trail: keeping each token's DeltaNet state)."""
    from ninfer_rt.gpu import misc
    from ninfer_rt.gpu.engine import Step

    tok = (17 + 1009 * np.arange(max(batch, tokens), dtype=np.int32)) % model.sample_vocab
    if tokens > 1:
        model.verify(tok, ctx, 0, trail=trail)
        return model.step_graph(Step(1, tokens, model.bucket(ctx + tokens), "all", trail=trail))
    draw = (model.sample_vocab, np.concatenate([misc.sample_params(**SAMPLED, seed=1, step=ctx)] * batch)) \
        if sampled else None
    model.decode(tok, [ctx] * batch, list(range(batch)), draw=draw)
    return model.step_graph(Step(batch, 1, model.bucket(ctx + 1), "last",
                                 draw=("sample", model.sample_vocab) if sampled else None))


def _time_decode(model, ctx: int, rounds: int = 5, reps: int = 20, sampled: bool = False,
                 batch: int = 1, tokens: int = 1, trail: bool = False) -> float:
    """Median seconds per decode step (graph replay) at context ctx; sampled, batch, tokens, trail: as
    decode_step_graph."""
    return _replay_s(model, decode_step_graph(model, ctx, sampled, batch, tokens, trail), rounds, reps)


def _time_draft(model, ctx: int, rounds: int = 5, reps: int = 20) -> float:
    """Median seconds of the MTP head's step over one row at context ctx (its graph replayed; GpuModel.draft)."""
    model.draft(np.zeros((1, model.H), np.float32), np.asarray([17], np.int32), ctx, 0)
    return _replay_s(model, model.draft_graph(1, model.bucket(ctx + 1)), rounds, reps)


def _replay_s(model, graph, rounds: int, reps: int) -> float:
    """Median seconds of one replay of a captured graph on the model's stream."""
    times = eager_ms(model.gpu, lambda: graph.launch(model.gpu.stream), rounds=rounds, reps=reps, warmup=0)
    return statistics.median(times) / 1e3


def _trail_text(row: dict) -> str:
    """A verify row's trail and rewind, as the log line and the table put them ("" where none was timed)."""
    if row.get("rewind_ms") is None:
        return ""
    return (f"; keeping each token's DeltaNet state {row['trail_ms_per_step']:.3f} ms, a rewind "
            f"{row['rewind_ms']:.3f} ms")


def run_bench(*, synthetic: str | None = None, artifact_path: str | None = None, recipe: str | None = None,
              prefill_sizes=(512, 8192, 65536), decode_contexts=(0, 8192, 65536, 262144),
              kv_dtype: str = "int8", prefill_budget_s: float = 60.0, prefill_chunk: int | None = None,
              decode_batches=(), decode_tokens=(), progress=None, log=print) -> BenchResult:
    """Run the benchmark; `log` receives one line per measurement as it lands. prefill_chunk: prompt tokens per
    prefill step (default: the engine's). decode_batches: sequence counts (> 1) to time a decode step of at each
    decode context too (each sequence a slot with its own KV cache of the largest context: memory grows with it).
    decode_tokens: token counts (2-8) to time one sequence's verification step of at each decode context; with
    them the MTP head is loaded too (where the model has one) and its draft step timed."""
    from ninfer_rt.gpu.engine import GpuModel
    from ninfer_rt.gpu.kernels import Kernels
    from ninfer_rt.gpu.loader import fill_random, load_artifact, synthetic_weights

    # an unknown shape or recipe, or a file that is no artifact, fails before the GPU is touched
    if synthetic:
        from ninfer_rt.recipe import load_recipe

        spec = builtin_spec(synthetic)
        rec = load_recipe(recipe or synthetic)
    else:
        from ninfer_rt.format import Artifact

        art = Artifact.open(artifact_path)
        spec = art.spec
    gpu = Gpu(0)
    kernels = Kernels(gpu)
    bw = copy_bandwidth(gpu)
    log(f"{gpu.info.name}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    if synthetic:
        groups = ("text", "mtp") if decode_tokens and spec.mtp_num_hidden_layers else ("text",)
        weights = synthetic_weights(gpu, spec, rec, progress=progress, groups=groups)
        model_name, recipe_name = synthetic, rec.name
    else:
        mtp = decode_tokens and "mtp" in art.groups
        weights = load_artifact(gpu, art, groups=("text", "mtp") if mtp else ("text",), progress=progress)
        model_name, recipe_name = str(artifact_path), art.header["recipe"].get("name", "?")
    log(f"weights: {weights.arena_bytes / 2**30:.2f} GiB in {weights.load_s:.1f} s")
    # the longest context decodes its last position: 262144 means 262143 cached tokens plus the new one
    decode_contexts = [min(c, spec.max_position_embeddings - 1) for c in decode_contexts]
    max_ctx = min(spec.max_position_embeddings, max(list(decode_contexts) + list(prefill_sizes)) + 16)
    model = GpuModel(gpu, kernels, spec, weights, slots=max([1, *decode_batches]), max_ctx=max_ctx,
                     kv_dtype=kv_dtype, prefill_chunk=prefill_chunk)
    for i, kv in model.kv.items():  # valid random cache contents: timing never runs on zeros
        values = kv.slots * kv.max_ctx * kv.nKV * kv.d * (1 if kv_dtype == "int8" else 2)
        kind = "bytes" if kv_dtype == "int8" else "bf16"
        fill_random(gpu, kv.k, values, kind, seed=i)
        fill_random(gpu, kv.v, values, kind, seed=i + 100)
        if kv_dtype == "int8":
            scales = kv.slots * kv.max_ctx * kv.nKV * 4
            fill_random(gpu, kv.k_scale, scales, "f32", seed=i + 200)
            fill_random(gpu, kv.v_scale, scales, "f32", seed=i + 300)
    res = BenchResult(model_name, gpu.info.name, recipe_name, kv_dtype, bw / 1e9, weights.arena_bytes,
                      weights.load_s, 0, model.prefill_chunk)
    rng = np.random.default_rng(0)
    per_token = None
    for n in prefill_sizes:
        if n > max_ctx:
            continue
        if per_token is not None and 2 * per_token * n > prefill_budget_s:  # two prompts of n
            res.prefill.append({"tokens": n, "skipped": f"estimated {2 * per_token * n:.0f} s > budget"})
            log(f"prefill {n}: skipped (estimated {2 * per_token * n:.0f} s)")
            continue
        ids = rng.integers(0, spec.vocab_size, n).astype(np.int32)
        times = []
        for _ in range(2):  # cold, then warm: the second prompt finds the chunk's graph captured
            model.reset_slot(0)
            gpu.synchronize()
            t0 = time.perf_counter()
            model.prefill(ids, 0)
            gpu.synchronize()
            times.append(time.perf_counter() - t0)
        cold, dt = times
        per_token = dt / n
        res.prefill.append({"tokens": n, "seconds": dt, "tok_s": n / dt, "cold_seconds": cold})
        log(f"prefill {n}: {n / dt:,.0f} tok/s ({dt:.2f} s; first prompt {cold:.2f} s)")
    for ctx in decode_contexts:
        if ctx + 1 > max_ctx:
            continue
        step = _time_decode(model, ctx)
        nbytes = decode_bytes(spec, weights, ctx, kv_dtype)
        row = {"context": ctx, "ms_per_token": step * 1e3, "tok_s": 1 / step, "bytes_per_token": nbytes,
               "achieved_gbs": nbytes / step / 1e9, "fraction_of_copy_bw": nbytes / step / bw,
               "ceiling_tok_s": bw / nbytes}
        res.decode.append(row)
        log(f"decode @ {ctx}: {1 / step:,.1f} tok/s, {nbytes / 1e9:.2f} GB/token, "
            f"{100 * nbytes / step / bw:.0f}% of copy bandwidth (ceiling {bw / nbytes:,.0f} tok/s)")
        for b in decode_batches:
            many = _time_decode(model, ctx, batch=b)
            res.decode_batched.append({"context": ctx, "batch": b, "ms_per_step": many * 1e3, "tok_s": b / many})
            log(f"decode @ {ctx}, {b} sequences: {b / many:,.1f} tok/s together ({many * 1e3:.3f} ms a step)")
        for t in decode_tokens:
            if ctx + t > max_ctx:  # the model's last positions hold fewer than t more tokens
                log(f"verify @ {ctx}, {t} tokens: skipped (past the {max_ctx}-position context)")
                continue
            verify = _time_decode(model, ctx, tokens=t)
            row = {"context": ctx, "tokens": t, "ms_per_step": verify * 1e3, "vs_one_token": verify / step,
                   "trail_ms_per_step": None, "rewind_ms": None}
            try:  # what speculative decoding pays to keep any prefix: each token's DeltaNet state, a rewind
                row["trail_ms_per_step"] = 1e3 * _time_decode(model, ctx, tokens=t, trail=True)
                row["rewind_ms"] = statistics.median(eager_ms(gpu, lambda: model.rewind(0, 1, t), rounds=5,
                                                              reps=20))
            except NinferError as e:
                log(f"verify @ {ctx}, {t} tokens: no trail ({e})")
            res.decode_tokens.append(row)
            log(f"verify @ {ctx}, {t} tokens: {verify * 1e3:.3f} ms a step ({verify / step:.2f}x one token's)"
                f"{_trail_text(row)}")
        if decode_tokens and model.has_mtp and ctx + 1 <= max_ctx:
            d = _time_draft(model, ctx)
            res.draft.append({"context": ctx, "ms_per_step": d * 1e3})
            log(f"draft @ {ctx}: {d * 1e3:.3f} ms a step (the MTP head over one row)")
    if res.decode:  # the same step drawing its token (top-k / top-p on the device), at the middle context
        ctx = res.decode[len(res.decode) // 2]["context"]
        step = _time_decode(model, ctx, sampled=True)
        res.decode_sampled = {"context": ctx, "sampling": SAMPLED, "ms_per_token": step * 1e3, "tok_s": 1 / step}
        log(f"decode @ {ctx}, sampled: {1 / step:,.1f} tok/s")
    free, total = gpu.mem_info()
    res.peak_gpu_bytes = total - free
    model.free()
    weights.free(gpu)
    return res


def check_json_path(path: str | os.PathLike, overwrite: bool = False) -> None:
    """FormatError (one line) when --json cannot be written, as quantize checks --out: before the GPU work."""
    check_output_path(path, overwrite, example="bench.json", option="--json")


def write_json(res: BenchResult, path: str | os.PathLike, overwrite: bool = False) -> None:
    """The result as JSON, atomically (format.atomic_output)."""
    check_json_path(path, overwrite)  # again: the folder or the file may have changed during the run
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(asdict(res), indent=1))
        f.flush()
        os.fsync(f.fileno())


def table(res: BenchResult):
    """A rich table of the result."""
    from rich.table import Table

    t = Table(title=f"{res.model} on {res.device} ({res.recipe}, KV {res.kv_dtype})")
    for c in ("measure", "value", "detail"):
        t.add_column(c)
    t.add_row("copy bandwidth", f"{res.copy_bandwidth_gbs:,.0f} GB/s", "device-to-device, read + write")
    t.add_row("weights", f"{res.weight_bytes / 2**30:.2f} GiB", f"loaded in {res.load_s:.1f} s")
    t.add_row("GPU memory in use", f"{res.peak_gpu_bytes / 2**30:.2f} GiB", "at the end, whole device")
    for p in res.prefill:
        if "skipped" in p:
            t.add_row(f"prefill {p['tokens']:,}", "skipped", p["skipped"])
        else:
            t.add_row(f"prefill {p['tokens']:,}", f"{p['tok_s']:,.0f} tok/s",
                      f"{p['seconds']:.2f} s, chunks of {res.prefill_chunk:,}; first prompt "
                      f"{p['cold_seconds']:.2f} s")
    for d in res.decode:
        t.add_row(f"decode @ {d['context']:,}", f"{d['tok_s']:,.1f} tok/s",
                  f"{d['bytes_per_token'] / 1e9:.2f} GB/token, {100 * d['fraction_of_copy_bw']:.0f}% of copy "
                  f"bandwidth, ceiling {d['ceiling_tok_s']:,.0f} tok/s")
    for d in res.decode_tokens:
        t.add_row(f"verify @ {d['context']:,}, {d['tokens']} tokens", f"{d['ms_per_step']:.3f} ms a step",
                  f"{d['vs_one_token']:.2f}x a one-token step{_trail_text(d)}")
    for d in res.draft:
        t.add_row(f"draft @ {d['context']:,}", f"{d['ms_per_step']:.3f} ms a step", "the MTP head over one row")
    for d in res.decode_batched:
        t.add_row(f"decode @ {d['context']:,}, {d['batch']} sequences", f"{d['tok_s']:,.1f} tok/s",
                  f"together: {d['ms_per_step']:.3f} ms a step, {d['tok_s'] / d['batch']:,.1f} tok/s each")
    if res.decode_sampled:
        d = res.decode_sampled
        t.add_row(f"decode @ {d['context']:,}, sampled", f"{d['tok_s']:,.1f} tok/s",
                  "drawn on the device: " + ", ".join(f"{k} {v}" for k, v in d["sampling"].items()))
    return t

