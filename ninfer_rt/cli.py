"""ninfer-rt: a thin Typer CLI over ninfer_rt.api (run a prompt, serve it over HTTP, describe an artifact)."""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from ninfer_rt.console import human_bytes, plain_console, run_app
from ninfer_rt.errors import NinferError
from ninfer_rt.gpu import PREFILL_CHUNK

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run Qwen3.5/3.6 .ninfer artifacts.")
out = plain_console()
err = plain_console(stderr=True)


# Options of every command that loads a model (run, serve): one declaration each.
DeviceOption = Annotated[str, typer.Option("--device", help="auto (cuda when a GPU is present), cuda (our kernels) "
                                                             "or cpu (the PyTorch reference).")]
DEFAULT_CONTEXT = 32768
MaxContextOption = Annotated[Optional[int], typer.Option(
    "--max-context", help=f"Positions a sequence may hold, prompt and output together (on the GPU, the KV cache "
                          f"allocated for each); default {DEFAULT_CONTEXT}, or the model's positions where fewer.")]
KvCacheOption = Annotated[str, typer.Option("--kv-cache", help="KV cache dtype on the GPU: int8 or bf16.")]
PrefillChunkOption = Annotated[Optional[int], typer.Option(
    "--prefill-chunk", help=f"Prompt tokens per prefill step on the GPU (default {PREFILL_CHUNK}; smaller saves GPU "
                            "memory, larger reads the weights fewer times per prompt).")]
ChecksumsOption = Annotated[bool, typer.Option("--check-checksums", help="Hash every tensor against the artifact's "
                                                                         "checksums first (as ninfer-pack verify "
                                                                         "does).")]
SpeculativeOption = Annotated[int, typer.Option("--speculative-tokens", help="Draft up to N tokens a step with the "
                                                "checkpoint's MTP head and verify them in one forward (0 = off, at "
                                                "most 7). Same output distribution; greedy, the same text.")]


def _sampling(generation_config: dict, greedy: bool, overrides: dict):
    """The artifact's generation_config defaults, then the options given (sampling.requested_sampling); with {},
    the options alone, checked before the model loads."""
    from ninfer_rt.sampling import requested_sampling

    return requested_sampling(generation_config, greedy=greedy, **overrides)


def _note_context(model, max_context: int | None) -> None:
    """Say so where a --max-context given was past the model's positions (load holds it to them), as llama.cpp
    warns."""
    if max_context is not None and model.context_length < max_context:
        err.print(f"note: --max-context {max_context} is past the model's {model.context_length} positions: "
                  f"sequences hold {model.context_length}", highlight=False, soft_wrap=True)


def _write_text(text: str) -> None:
    """Generated text to stdout; on a stdout that cannot encode it (PYTHONIOENCODING=ascii, a C locale) each such
    character becomes "?", as a terminal would show it, instead of a UnicodeEncodeError ending the run."""
    try:
        sys.stdout.write(text)
    except UnicodeEncodeError:
        encoding = sys.stdout.encoding or "utf-8"
        sys.stdout.write(text.encode(encoding, "replace").decode(encoding))


@app.command()
def run(
    path: str = typer.Argument(..., help="The .ninfer artifact."),
    prompt: str = typer.Option(..., "--prompt", help="Prompt text (raw, or a user message with --chat)."),
    chat: bool = typer.Option(False, "--chat", help="Render the prompt as a user message with the artifact's "
                                                   "chat template and the generation prompt."),
    no_think: bool = typer.Option(False, "--no-think", help="Ask the chat template for the no-thinking prompt."),
    special: bool = typer.Option(False, "--special", help="Print special tokens (<|im_start|>, <|image_pad|>, ...) "
                                                          "as text; by default they are left out, as llama-cli and "
                                                          "vLLM do (<think> and <tool_call> are text either way)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Most tokens to generate."),
    greedy: bool = typer.Option(False, "--greedy", help="Arg-max decoding of the penalised logits (overrides "
                                                         "temperature, top-p, top-k and min-p)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Softmax temperature."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus threshold in (0, 1]."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Keep the k most likely tokens (0 or -1 = off)."),
    min_p: Optional[float] = typer.Option(None, "--min-p", help="Drop tokens below min_p x the top probability."),
    presence_penalty: Optional[float] = typer.Option(None, "--presence-penalty", help="Subtracted once per "
                                                                                      "token already generated."),
    frequency_penalty: Optional[float] = typer.Option(None, "--frequency-penalty", help="Subtracted per "
                                                      "occurrence of a token already generated."),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", help="CTRL-style penalty "
                                                                                          "over prompt + output."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed in [0, 2^64): same seed, same text "
                                                             "(omit it for a fresh one)."),
    device: DeviceOption = "auto",
    max_context: MaxContextOption = None,
    kv_cache: KvCacheOption = "int8",
    prefill_chunk: PrefillChunkOption = None,
    check_checksums: ChecksumsOption = False,
    speculative_tokens: SpeculativeOption = 0,
):
    """Generate a continuation of --prompt; text streams to stdout, timings go to stderr."""
    from ninfer_rt.api import load

    if no_think and not chat:
        raise NinferError("--no-think applies to the chat template: add --chat")
    if not prompt and not chat:  # a chat turn renders to tokens even when empty
        raise NinferError("prompt is empty: there is nothing to continue from")
    _check_chunk(prefill_chunk)
    context = _context(max_context)
    if max_new_tokens < 1:
        raise NinferError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    drawn_seed = seed is None  # drawn here and printed, so a run worth keeping can be repeated with --seed
    given = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, presence_penalty=presence_penalty,
                 frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                 seed=secrets.randbits(63) if drawn_seed else seed)
    _sampling({}, greedy, given)  # a bad option costs no loading
    t0 = time.perf_counter()
    model = load(path, device=device, max_ctx=context, kv_dtype=kv_cache, prefill_chunk=prefill_chunk,
                 progress=_loading_bar(), check_checksums=check_checksums, speculative_tokens=speculative_tokens)
    load_s = time.perf_counter() - t0
    _note_context(model, max_context)
    params = _sampling(model.generation_config, greedy, given)
    if chat:
        pieces = model.generate(messages=[{"role": "user", "content": prompt}], max_new_tokens=max_new_tokens,
                                sampling=params, enable_thinking=False if no_think else None,
                                skip_special_tokens=not special)
    else:
        pieces = model.generate(prompt, max_new_tokens=max_new_tokens, sampling=params, skip_special_tokens=not special)
    for piece in pieces:
        _write_text(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    s = model.last_stats
    err.print(f"prompt {s.prompt_tokens} tokens, prefill {s.prefill_s:.3f} s ({s.prefill_tok_s:.1f} tok/s); "
              f"generated {s.generated_tokens} tokens, decode {s.decode_tok_s:.1f} tok/s ({s.finish_reason}); "
              f"load {load_s:.2f} s on {model.device}"
              + (f"; seed {params.seed}" if drawn_seed and not params.is_greedy else ""),
              highlight=False, soft_wrap=True)
    if s.draft_tokens:
        err.print(f"speculative: {s.accepted_tokens} of {s.draft_tokens} drafted tokens accepted "
                  f"({100 * s.acceptance:.1f}%)", highlight=False, soft_wrap=True)


@app.command()
def serve(
    path: str = typer.Argument(..., help="The .ninfer artifact."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 or :: exposes the "
                                                         "server to the network: set --api-key-file then)."),
    port: int = typer.Option(8080, "--port", help="TCP port (0 lets the OS choose; the log says which)."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="The model id /v1/models lists and "
                                                                        "replies carry (default: the file's name "
                                                                        "without .ninfer). A request's own model "
                                                                        "field is not checked: one model is "
                                                                        "served, as llama-server does."),
    api_key_file: Optional[Path] = typer.Option(None, "--api-key-file", help="Require this file's key (its first "
                                                "line) as 'Authorization: Bearer KEY' or 'x-api-key: KEY'."),
    cors_origin: Optional[str] = typer.Option(None, "--cors-origin", help="Allow browser pages from this origin "
                                                                          "(or '*') to call the API."),
    parallel: int = typer.Option(4, "--parallel", help="Requests generating at once, decoded together in "
                                                       "one batch (on the GPU each holds its own KV cache of "
                                                       "--max-context positions and DeltaNet state)."),
    max_queue: int = typer.Option(32, "--max-queue", help="Requests that may wait while --parallel generate; "
                                                          "more are answered 503."),
    device: DeviceOption = "auto",
    max_context: MaxContextOption = None,
    kv_cache: KvCacheOption = "int8",
    prefill_chunk: Optional[int] = typer.Option(
        None, "--prefill-chunk", help="Prompt tokens a joining request feeds a step, beside the running ones' "
                                      "decoding (default 2048; larger prefills a long prompt in fewer steps, each a "
                                      "longer pause for the others)."),
    check_checksums: ChecksumsOption = False,
    prefix_snapshot: bool = typer.Option(True, "--prefix-snapshot/--no-prefix-snapshot", help="Keep a copy of "
                                         "a chat's history in a slot of its own, so its next turn prefills only "
                                         "the new messages (on the GPU: one more KV cache and DeltaNet state)."),
    speculative_tokens: SpeculativeOption = 0,
):
    """Serve the model over HTTP: OpenAI (/v1/chat/completions, /v1/completions, /v1/models) and Anthropic
    (/v1/messages, /v1/messages/count_tokens) APIs, streaming by server-sent events. Up to --parallel requests
    generate at once, decoded as one batch; with --speculative-tokens, a request that decodes alone drafts with the
    MTP head."""
    from ninfer_rt.api import MAX_CACHE_SLOTS, load
    from ninfer_rt.serve import Server
    from ninfer_rt.serve.server import authority, check_cors_origin, is_loopback

    _check_chunk(prefill_chunk)
    context = _context(max_context)
    if not 0 <= port <= 65535:
        raise NinferError(f"--port must be in [0, 65535], got {port}")
    if max_queue < 0:
        raise NinferError(f"--max-queue must be >= 0, got {max_queue}")
    if not 1 <= parallel <= MAX_CACHE_SLOTS - prefix_snapshot:
        raise NinferError(f"--parallel must be in [1, {MAX_CACHE_SLOTS - prefix_snapshot}], got {parallel}")
    api_key = _read_api_key(api_key_file) if api_key_file is not None else None
    cors_origin = check_cors_origin(cors_origin) if cors_origin is not None else None
    _probe_listen(host, port)  # a taken port is said before minutes of loading, not after
    if not is_loopback(host) and api_key is None:
        err.print(f"warning: listening on {host} (not this machine only) with no --api-key-file: anyone who can "
                  "reach the port can use the model", highlight=False, soft_wrap=True)
    model = load(path, device=device, max_ctx=context, kv_dtype=kv_cache, prefill_chunk=prefill_chunk,
                 progress=_loading_bar(), check_checksums=check_checksums, cache_slots=parallel + prefix_snapshot,
                 speculative_tokens=speculative_tokens)
    _note_context(model, max_context)
    try:
        # no tokenizer or no usable template fails here, as `run` does, not as a 400 to every request
        model.tokenizer
        model.chat_template
        server = Server(model, model_name=model_name or Path(path).name.removesuffix(".ninfer"), host=host, port=port,
                        api_key=api_key, cors_origin=cors_origin, max_queue=max_queue, parallel=parallel,
                        prefill_chunk=prefill_chunk,
                        log=lambda line: err.print(line, highlight=False, soft_wrap=True))
        bound_host, bound_port = server.address
        err.print(f"serving {server.model_name} on http://{authority(bound_host, bound_port)} ({model.device}, "
                  f"context {model.context_length:,}, {parallel} at once{', API key required' if api_key else ''}); "
                  "Ctrl-C stops",
                  highlight=False, soft_wrap=True)
        server.serve_forever()
    finally:
        model.close()


def _read_api_key(path: Path) -> str:
    """The key on the first line of path (a file keeps it out of the process list and the shell history): printable
    ASCII, as HTTP headers carry it."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise NinferError(f"--api-key-file {path}: not UTF-8 text") from None
    except OSError as e:
        raise NinferError(f"--api-key-file {path}: {e.strerror or e}") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise NinferError(f"--api-key-file {path}: the first line is empty")
    if not (key.isascii() and key.isprintable()):
        raise NinferError(f"--api-key-file {path}: the key must be printable ASCII (HTTP headers carry no other)")
    return key


def _probe_listen(host: str, port: int) -> None:
    """NinferError when host:port cannot be listened on (bound and released at once; the server binds again)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does
            probe.bind(address)
    except OSError as e:
        from ninfer_rt.serve.server import authority

        raise NinferError(f"cannot listen on {authority(host, port)}: {e.strerror or e}") from None


@app.command()
def info(path: str = typer.Argument(..., help="The .ninfer artifact.")):
    """Describe the model in an artifact: family, layers, widths, experts, vocabulary, context, recipe, size."""
    from ninfer_rt.format import Artifact

    with Artifact.open(path) as art:
        spec = art.spec
        recipe = art.header["recipe"].get("name", "?")
        real_vocab = _tokenizer_vocab(art)
        weights = sum(t.nbytes for t in art.tensors.values())
        size = art.size
    full = len(spec.full_attention_layers)
    table = Table(title=str(path), show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    rows = [
        ("family", spec.family),
        ("layers", f"{spec.num_hidden_layers} ({spec.num_hidden_layers - full} Gated DeltaNet, {full} attention)"),
        ("hidden", str(spec.hidden_size)),
        ("attention heads", f"{spec.num_attention_heads} q / {spec.num_key_value_heads} kv x {spec.head_dim}"),
        ("experts", f"{spec.num_experts} routed (dim {spec.moe_intermediate_size}), top-{spec.num_experts_per_tok}, "
                    f"+ 1 shared (dim {spec.shared_expert_intermediate_size})" if spec.is_moe
         else f"dense (intermediate {spec.intermediate_size})"),
        ("vocab", f"{spec.vocab_size}" + (f" ({real_vocab} in the tokenizer)" if real_vocab else "")),
        ("context", f"{spec.max_position_embeddings:,}"),
        ("MTP layers", str(spec.mtp_num_hidden_layers)),
        ("vision", "yes" if spec.vision is not None else "no"),
        ("recipe", recipe),
        ("size", f"{human_bytes(size)} ({human_bytes(weights)} of weights)"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    out.print(table)


def _loading_bar():
    """A progress(done, total) callback drawing a rich bar on stderr while weights load; None where stderr is no
    terminal (a log file would get only the blank line each finished bar leaves)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    if not err.is_terminal:
        return None

    state = {}

    def progress(done: int, total: int) -> None:
        if "bar" not in state:
            state["bar"] = Progress("loading", BarColumn(), DownloadColumn(), TransferSpeedColumn(), console=err,
                                    transient=True)
            state["bar"].start()
            state["task"] = state["bar"].add_task("load", total=total)
        state["bar"].update(state["task"], completed=done)
        if done >= total:
            state.pop("bar").stop()

    return progress


@app.command("build-kernels")
def build_kernels_cmd(
    arch: Optional[list[str]] = typer.Option(None, "--arch", help="Target to build (repeatable): sm_120a, "
                                                                   "sm_90a, sm_89, sm_86, sm_80. Default: all."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when the cache holds this build."),
    jobs: int = typer.Option(2, "--jobs", help="Sources compiled in parallel (nvcc only)."),
    nvrtc: bool = typer.Option(False, "--nvrtc", help="Compile with NVRTC (one --arch) even if nvcc is present."),
):
    """Compile kernels/*.cu into the kernel cache (nvcc for every target + PTX; NVRTC without nvcc)."""
    from ninfer_rt.gpu.build import TARGETS, build_kernels

    if jobs < 1:
        raise NinferError(f"--jobs must be >= 1, got {jobs}")
    targets = tuple(arch) if arch else TARGETS
    t0 = time.perf_counter()
    res = build_kernels(targets, force=force, use_nvcc=False if nvrtc else None, jobs=jobs,
                        progress=lambda name: err.print(f"compiling {name}", highlight=False))
    table = Table(title=f"kernels for {', '.join(res.targets)} ({res.compiler})")
    table.add_column("source")
    table.add_column("image")
    table.add_column("size", justify="right")
    for stem, p in sorted(res.images.items()):
        table.add_row(f"kernels/{stem}.cu", str(p), human_bytes(p.stat().st_size))
    out.print(table)
    err.print(f"{'cached' if res.cached else 'built'} in {time.perf_counter() - t0:.1f} s", highlight=False)


@app.command()
def bench(
    path: Optional[str] = typer.Argument(None, help="A .ninfer artifact (or use --synthetic)."),
    synthetic: Optional[str] = typer.Option(None, "--synthetic", help="Random weights of a shipped shape in GPU "
                                                                      "memory: qwen3.6-35b-a3b or qwen3.6-27b."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="Recipe for --synthetic (default: the model's)."),
    prefill: str = typer.Option("512,8192,65536", "--prefill", help="Prompt lengths to time, comma-separated."),
    decode_context: str = typer.Option("0,8192,65536,262144", "--decode-context",
                                       help="Contexts to time one-token decode at, comma-separated."),
    decode_batch: str = typer.Option("", "--decode-batch", help="Sequence counts (> 1) to also time a decode "
                                                                "step of, all at the same context, comma-separated "
                                                                "(each holds a KV cache of the largest context)."),
    decode_tokens: str = typer.Option("", "--decode-tokens", help="Token counts (2-8) to also time one sequence's "
                                                                  "step of, with every row's logits: what a "
                                                                  "speculative step's verification costs."),
    kv_cache: KvCacheOption = "int8",
    prefill_budget: float = typer.Option(60.0, "--prefill-budget", help="Skip a prefill size whose estimated "
                                                                        "time (two prompts: cold, then timed) "
                                                                        "exceeds this many seconds."),
    prefill_chunk: PrefillChunkOption = None,
    json_path: Optional[str] = typer.Option(None, "--json", help="Also write the result as JSON here "
                                                                 "(atomically)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --json file."),
):
    """Prefill and decode throughput, load time and GPU memory on this machine's GPU."""
    from ninfer_rt.api import check_kv_dtype
    from ninfer_rt.gpu.bench import check_json_path, run_bench, table, write_json

    # every option is checked here, before run_bench opens the GPU: a typo costs no minutes of loading
    if (path is None) == (synthetic is None):
        raise NinferError("give an artifact path or --synthetic NAME (one of them)")
    if recipe is not None and synthetic is None:
        raise NinferError("--recipe applies to --synthetic only (an artifact carries its own recipe)")
    _check_chunk(prefill_chunk)
    check_kv_dtype(kv_cache)
    if not prefill_budget >= 0:  # nan too: it would compare False and never skip
        raise NinferError(f"--prefill-budget must be a number of seconds >= 0, got {prefill_budget}")
    sizes, contexts = _ints(prefill, "--prefill"), _ints(decode_context, "--decode-context")
    if any(n < 1 for n in sizes):
        raise NinferError("--prefill: prompt lengths must be >= 1")
    if not sizes and not contexts:
        raise NinferError("nothing to time: --prefill and --decode-context are both empty")
    batches = _ints(decode_batch, "--decode-batch")
    if any(b < 2 for b in batches):
        raise NinferError("--decode-batch: sequence counts must be >= 2 (one sequence is the plain decode row)")
    tokens = _ints(decode_tokens, "--decode-tokens")
    if any(not 2 <= t <= 8 for t in tokens):
        raise NinferError("--decode-tokens: token counts must be 2 to 8 (one token is the plain decode row)")
    if (batches or tokens) and not contexts:
        raise NinferError("--decode-batch and --decode-tokens time steps at each --decode-context: give one")
    if json_path is not None:
        check_json_path(json_path, overwrite)
    res = run_bench(synthetic=synthetic, artifact_path=path, recipe=recipe,
                    prefill_sizes=sizes, decode_contexts=contexts,
                    kv_dtype=kv_cache, prefill_budget_s=prefill_budget, prefill_chunk=prefill_chunk,
                    decode_batches=batches, decode_tokens=tokens,
                    progress=_loading_bar(),
                    log=lambda line: err.print(line, highlight=False))
    out.print(table(res))
    if json_path is not None:
        write_json(res, json_path, overwrite)


def _ints(s: str, what: str) -> tuple[int, ...]:
    """A comma-separated list of integers >= 0 (empty: none)."""
    try:
        vals = tuple(int(v) for v in s.split(",") if v.strip())
    except ValueError:
        raise NinferError(f"{what}: expected comma-separated integers, got {s!r}") from None
    if any(v < 0 for v in vals):
        raise NinferError(f"{what}: values must be >= 0")
    return vals


def _check_chunk(prefill_chunk: int | None) -> None:
    if prefill_chunk is not None and prefill_chunk < 1:
        raise NinferError(f"--prefill-chunk must be >= 1, got {prefill_chunk}")


def _context(max_context: int | None) -> int:
    """The positions to ask load for: --max-context, checked, or DEFAULT_CONTEXT where it was not given."""
    if max_context is None:
        return DEFAULT_CONTEXT
    # the shortest prompt is one token (an empty one is refused) and the first generated token needs a position
    if max_context < 2:
        raise NinferError(f"--max-context must be >= 2 (a one-token prompt and one generated token), got "
                          f"{max_context}")
    return max_context


def _tokenizer_vocab(art) -> int | None:
    """Ids of the artifact's tokenizer, or None when it has none (or an unreadable one: info still works)."""
    if "tokenizer.json" not in art.resources:
        return None
    from ninfer_rt.tokenizer import Tokenizer

    try:
        return Tokenizer.from_resources({"tokenizer.json": art.resource("tokenizer.json")}).vocab_size
    except NinferError:
        return None


def main() -> None:
    """Entry point: user errors become one line on stderr and exit 1."""
    run_app(app, err)


if __name__ == "__main__":
    main()
