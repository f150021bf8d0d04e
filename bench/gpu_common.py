"""What every GPU micro-benchmark shares: the context, the built kernels, a console and a header line (open_gpu),
timing direct launches (eager_ms, from ninfer_rt.gpu.bench) and a captured CUDA graph's replays (replay_ms); for
the decode-step benches, a synthetic model (synthetic_model), module attributes set for a while (patched), one step
timed on a fresh graph (time_fresh_step) and their table and JSON (step_rows_out)."""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from ninfer_rt.gpu.bench import eager_ms  # noqa: F401  (the micro-benchmarks' eager timer, shared with ninfer-rt bench)


def open_gpu(prog: str):
    """(gpu, kernels, console) on GPU 0; exits with one line naming `prog` when there is no usable GPU."""
    from ninfer_rt.gpu.driver import GpuError

    try:
        from ninfer_rt.gpu.driver import Gpu
        from ninfer_rt.gpu.kernels import Kernels

        gpu = Gpu(0)
    except GpuError as e:
        sys.exit(f"{prog}: no GPU ({e})")
    from rich.console import Console

    console = Console()
    t0 = time.time()
    k = Kernels(gpu)
    console.print(f"{gpu.info.name} ({gpu.info.arch}, {gpu.info.sm_count} SMs, L2 {gpu.info.l2_bytes >> 20} MiB); "
                  f"kernels ready in {time.time() - t0:.1f} s", highlight=False)
    return gpu, k, console


def replay_ms(gpu, capture, *, rounds: int, replays: int, warmup: int = 3, eager: bool = True) -> list[float]:
    """Milliseconds per replay of a CUDA graph of what capture() enqueues, one value per timed round.

    capture() runs once eagerly first (kernel lookups and shared-memory attributes happen outside the capture;
    eager=False skips it), once into the graph; `warmup` untimed replays follow (clocks up, buffers touched),
    then `rounds` rounds of `replays` back-to-back replays, each round timed between two events.
    """
    if eager:
        capture()
        gpu.synchronize()
    gpu.begin_capture(gpu.stream)
    try:
        capture()
    finally:
        graph = gpu.end_capture(gpu.stream)
    try:
        return eager_ms(gpu, lambda: graph.launch(gpu.stream), rounds=rounds, reps=replays, warmup=warmup)
    finally:
        graph.destroy()


@contextmanager
def synthetic_model(gpu, k, name: str, max_ctx: int, slots: int = 1, groups: tuple[str, ...] = ("text",)):
    """A GpuModel of the synthetic weights of `name` (exact shapes, recipe of the same name; groups ("text",
    "mtp") adds the MTP head), `slots` sequence slots, INT8 KV; weights and buffers freed on exit."""
    from ninfer_rt.gpu.bench import builtin_spec
    from ninfer_rt.gpu.engine import GpuModel
    from ninfer_rt.gpu.loader import synthetic_weights
    from ninfer_rt.recipe import load_recipe

    spec = builtin_spec(name)
    weights = synthetic_weights(gpu, spec, load_recipe(name), groups=groups)
    model = GpuModel(gpu, k, spec, weights, slots=slots, max_ctx=max_ctx, kv_dtype="int8")
    try:
        yield model
    finally:
        model.free()
        weights.free(gpu)


def planner_modules() -> dict:
    """The modules whose planner constants the decode-step tools set, by the name "module.attr" uses."""
    from ninfer_rt.gpu import attention, deltanet, engine, kernels, linear, moe, router_fold
    return {"linear": linear, "attention": attention, "deltanet": deltanet, "kernels": kernels, "moe": moe,
            "router_fold": router_fold, "engine": engine}


def parse_settings(items: list[str], modules: dict) -> dict:
    """"module.attr=value" strings (value a Python literal) as patched() takes them: {"module.attr": value}.
    A module not in `modules`, an attribute it lacks or a value that is no literal is a ValueError of one line."""
    import ast

    settings = {}
    for item in items:
        key, eq, text = item.partition("=")
        module, _, attr = key.strip().partition(".")
        if not eq or module not in modules or not attr or not hasattr(modules[module], attr):
            raise ValueError(f"--set {item!r}: want module.ATTR=value with module one of {', '.join(modules)} "
                             f"and ATTR one of its planner constants")
        try:
            settings[f"{module}.{attr}"] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"--set {item!r}: {text.strip()!r} is not a Python literal") from None
    return settings


@contextmanager
def patched(modules: dict, settings: dict):
    """Set module attributes named "module.attr" (module looked up in `modules`) to the values in `settings` for
    the with-block; the old values are back afterwards, also when the body raises."""
    def target(key: str):
        module, attr = key.split(".")
        return modules[module], attr

    saved = {key: getattr(*target(key)) for key in settings}
    try:
        for key, value in settings.items():
            setattr(*target(key), value)
        yield
    finally:
        for key, value in saved.items():
            setattr(*target(key), value)


def time_fresh_step(model, ctx: int, batch: int = 1, tokens: int = 1) -> float:
    """Seconds per decode step of `batch` sequences (slots 0..batch-1) at context ctx, or of one sequence's
    verification of `tokens` tokens, on a freshly captured graph (planner constants and left-out launches only act
    at capture): the model's graphs destroyed and its shared carveout planned again, then the best of 3 medians of
    ninfer-rt bench's timer."""
    from ninfer_rt.gpu.bench import _time_decode

    for g in model.graphs.values():
        g.destroy()
    model.graphs.clear()
    model.forget_carveout()
    return min(_time_decode(model, ctx, batch=batch, tokens=tokens) for _ in range(3))


def step_rows_out(console, gpu, title: str, columns: list[tuple[str, bool]], cells, rows: list[dict],
                  path: Path | None) -> None:
    """Print a rich table of decode-step rows (columns: (name, left-justified); cells(row) -> strings), and write
    the rows as JSON to `path` when given."""
    from rich.table import Table

    table = Table(title=title)
    for col, left in columns:
        table.add_column(col, justify="left" if left else "right")
    for r in rows:
        table.add_row(*cells(r))
    console.print(table)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"device": gpu.info.name, "arch": gpu.info.arch, "timing": "cuda-graph replay",
                                    "rows": rows}, indent=1))
        console.print(f"wrote {path}")
