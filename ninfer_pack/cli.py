"""ninfer-pack: a thin Typer CLI over the ninfer_pack library (quantize, calibrate, inspect, verify, publish)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Optional

import typer
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn, TransferSpeedColumn)
from rich.table import Table

from ninfer_rt.console import human_bytes, human_count, labelled, plain_console, run_app
from ninfer_rt.errors import NinferError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Quantize Qwen3.5/3.6 checkpoints into one verified, kernel-ready .ninfer artifact.")
out = plain_console()
err = plain_console(stderr=True)


def _bytes_progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=False)


def _size_table(title: str, rows: list[dict], total_params: int, total_bytes: int) -> Table:
    t = Table(title=title)
    for col, just in (("tensor class", "left"), ("tensors", "right"), ("parameters", "right"),
                      ("formats", "left"), ("size", "right"), ("bits/weight", "right")):
        t.add_column(col, justify=just)
    for r in rows:
        t.add_row(r["class"], str(r["tensors"]), human_count(r["params"]), r["formats"], human_bytes(r["nbytes"]),
                  f"{r['bpw']:.2f}")
    t.add_section()
    t.add_row("total", str(sum(r["tensors"] for r in rows)), human_count(total_params), "",
              human_bytes(total_bytes), f"{8 * total_bytes / max(total_params, 1):.3f}", style="bold")
    return t


@app.command()
def quantize(
    source: str = typer.Argument(..., help="Checkpoint: a local directory, a Hub repo id (owner/name), "
                                           "or builtin:tiny-moe / builtin:tiny-dense."),
    recipe: str = typer.Option(..., "--recipe", help="Recipe name (recipes/NAME.toml) or path to a .toml."),
    out_path: str = typer.Option(..., "--out", help="Output artifact, e.g. model.ninfer (written atomically)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit)."),
    importance: Optional[Path] = typer.Option(None, "--importance",
                                              help="safetensors of per-input-channel importance [K] per tensor."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
):
    """Quantize SOURCE with a recipe into one .ninfer artifact."""
    from ninfer_pack.pipeline import bits_per_param, params_total, prepare, write_artifact
    from ninfer_pack.plan import summarize

    # every check that reads no weight (output path, recipe, importance, tokenizer, plan) before the work
    job = prepare(source, recipe, out_path, revision=revision, importance=importance, overwrite=overwrite)
    t0 = time.perf_counter()
    with _bytes_progress() as prog:
        task = prog.add_task("quantize", total=job.ckpt.total_source_bytes)
        res = write_artifact(job, progress=lambda n, name: prog.advance(task, n))
    dt = time.perf_counter() - t0
    for w in res.warnings:
        err.print(labelled("warning:", "yellow", w))
    payload = sum(t.nbytes for t in res.planned)
    out.print(_size_table(f"{out_path}", summarize(res.planned), params_total(res.planned), payload))
    err.print(f"wrote {out_path}: {human_bytes(res.file_size)} ({human_bytes(res.file_size - payload)} of header, "
              f"resources and alignment), {bits_per_param(res.planned):.3f} bits per parameter; "
              f"{res.source_bytes / 1e9 / dt:.3f} GB/s of source in {dt:.1f} s", soft_wrap=True)


def _plan_source(source: str, revision: str | None):
    """Shapes for plan mode: from safetensors headers (local dir), else from config.json alone."""
    from ninfer_rt.config import ModelSpec
    from ninfer_pack.plan import builtin_config_path
    from ninfer_pack.source import Checkpoint, fetch_config

    p = Path(source)
    if p.is_dir() or source.startswith("builtin:"):
        ckpt = Checkpoint.open(source, revision=revision)
        return ckpt.spec, ckpt.shapes()
    local = "a local config.json" if p.is_file() and p.suffix == ".json" else (
        "a built-in config" if builtin_config_path(source) is not None else None)
    if local is not None and revision is not None:
        raise NinferError(f"--revision {revision} applies to Hub repos, but {source} is {local}")
    if p.is_file() and p.suffix == ".json":
        spec = ModelSpec.from_file(p)
    elif builtin_config_path(source) is not None:
        spec = ModelSpec.from_file(builtin_config_path(source))
    else:
        spec = ModelSpec.from_config(fetch_config(source, revision=revision))
    return spec, {n: info.shape for n, info in spec.tensor_shapes().items()}


@app.command()
def inspect(
    path: str = typer.Argument(..., help="An artifact, or (with --recipe) a checkpoint dir, Hub repo id, "
                                         "config.json, or a built-in config name such as qwen3.6-35b-a3b."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="Plan mode: print the sizes this recipe would "
                                                                 "give, from the size formulas; writes nothing."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision for plan mode."),
    tensors: bool = typer.Option(False, "--tensors", help="Also list every tensor."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
):
    """Formats, sizes and bits per weight per tensor class and in total."""
    from ninfer_pack.plan import plan_artifact, planned_from_artifact, summarize
    from ninfer_rt.recipe import load_recipe
    from ninfer_rt.format import Artifact

    if recipe is not None:
        spec, shapes = _plan_source(path, revision)
        planned, warnings = plan_artifact(spec, shapes, load_recipe(recipe))
        title = f"plan: {path} with recipe {recipe} (weights only; the file adds header, tokenizer, alignment)"
    else:
        if revision is not None:
            raise NinferError(f"--revision {revision} applies to planning a Hub repo (with --recipe), not to an "
                              "artifact")
        if path and Path(path).is_dir():
            raise NinferError(f"{path} is a directory: to plan a checkpoint, add --recipe NAME; inspect alone reads "
                              "a .ninfer artifact")
        if path and not path.endswith(".ninfer") and not os.path.lexists(path):  # a Hub id or built-in config
            raise NinferError(f"no such file: {path}; to plan a checkpoint (a directory, Hub repo id or built-in "
                              "config), add --recipe NAME")
        with Artifact.open(path) as art:
            planned, warnings = planned_from_artifact(art), []
            title = f"{path} (recipe {art.header['recipe'].get('name', '?')}; {human_bytes(art.size)} file)"
    rows = summarize(planned)
    params = sum(t.params for t in planned)
    total = sum(t.nbytes for t in planned)
    if as_json:
        print(json.dumps({"title": title, "classes": rows, "total_params": params, "total_bytes": total,
                          "bits_per_param": 8 * total / max(params, 1), "warnings": warnings,
                          "tensors": [{"name": t.name, "format": t.format, "shape": list(t.plan.shape),
                                       "nbytes": t.nbytes} for t in planned] if tensors else None}, indent=1))
        return
    for w in warnings:
        err.print(labelled("warning:", "yellow", w))
    if tensors:
        tt = Table(title="tensors")
        for col in ("name", "format", "shape", "bytes"):
            tt.add_column(col)
        for t in planned:
            tt.add_row(t.name, t.format, "x".join(map(str, t.plan.shape)), f"{t.nbytes:,}")
        out.print(tt)
    out.print(_size_table(title, rows, params, total))


VERIFY_SHOWN = 10  # problems verify prints; --json holds them all


@app.command()
def verify(
    path: str = typer.Argument(..., help="The artifact to check."),
    source: Optional[str] = typer.Option(None, "--source", help="Also decode every tensor and compare it with "
                                                                "this checkpoint (dir, Hub id or builtin:...)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision of --source."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report."),
    numerics: bool = typer.Option(False, "--numerics", help="Also measure what quantization cost: KL divergence, "
                                                            "top-token agreement, PPL and per-layer hidden-state "
                                                            "differences against --source (fp32 reference, CPU)."),
    text: Optional[list[Path]] = typer.Option(None, "--text", help="With --numerics: score windows of these UTF-8 "
                                                                   "files (repeatable) instead of the built-in "
                                                                   "prompts, as llama-perplexity does."),
    window: int = typer.Option(512, "--window", help="Tokens a --text window (its second half is scored)."),
    max_tokens: int = typer.Option(4096, "--max-tokens", help="Most --text tokens to use, in all."),
):
    """Check magic, header, bounds, alignment and checksums (and, with --source, every tensor's error)."""
    from ninfer_pack.verify import verify as run_verify
    from ninfer_rt.format import Artifact

    if numerics and source is None:
        raise NinferError("--numerics needs --source: the checkpoint the artifact was made from")
    if text and not numerics:
        raise NinferError("--text is what --numerics scores: add --numerics")
    if not text and (window, max_tokens) != (512, 4096):
        raise NinferError("--window and --max-tokens shape --text's windows: add --text")
    if source is None and revision is not None:
        raise NinferError("--revision is --source's Hub revision: add --source")
    windows = ckpt = None
    with Artifact.open(path) as art:  # structural problems end here with one line (before a Hub --source downloads)
        payload = art.payload_bytes  # what the checksums hash
        if numerics:
            from ninfer_pack.numerics import WINDOW_MIN, check_memory

            if text:
                from ninfer_pack.windows import read_texts, text_windows
                from ninfer_rt.tokenizer import Tokenizer

                tok = Tokenizer.from_resources({n: art.resource(n) for n in art.resources})
                ids = text_windows(tok, read_texts(text), window, max_tokens, WINDOW_MIN)
                if not ids:
                    raise NinferError(f"--text gives no window of {WINDOW_MIN} or more tokens to score")
                windows = [(f"{text[0].name}[{i}]" if len(text) == 1 else f"text[{i}]", w) for i, w in enumerate(ids)]
            # before the long tensor-by-tensor comparison (measure checks again with the built-in prompts' lengths)
            check_memory(art.spec, [len(w) for _, w in windows or ()])
    if source is not None:  # a mistyped --source ends here, not after the artifact's whole checksum pass
        from ninfer_pack.source import Checkpoint

        ckpt = Checkpoint.open(source, revision=revision)
    with _bytes_progress() as prog:
        task = prog.add_task("checksums", total=payload)
        rep = run_verify(path, ckpt, on_bytes=lambda n: prog.advance(task, n))
    num = None
    if numerics and rep.ok:  # numerics of an unsound file would measure the damage, not the quantization
        from ninfer_pack.numerics import measure

        num = measure(path, source, revision=revision, windows=windows,
                      progress=lambda m: err.print(f"numerics: {m}"))
    if as_json:
        report = {"ok": rep.ok, "path": rep.path, "bad_checksums": rep.bad_checksums, "problems": rep.problems,
                  "tensors": [{**c.__dict__, "rel_rmse": c.rel_rmse if math.isfinite(c.rel_rmse) else None}
                              for c in rep.checks]}  # JSON has no inf: a weight stored as inf errs without bound
        if numerics:
            report["numerics"] = num.to_dict() if num is not None else None
        print(json.dumps(report, indent=1))
    else:
        if rep.checks:
            t = Table(title=f"{path} against {source}")
            for col in ("tensor", "format", "rel. RMS error", "status"):
                t.add_column(col)
            for c in rep.checks:
                t.add_row(c.name, c.format, f"{c.rel_rmse:.2e}", "ok" if c.ok else labelled("FAIL", "red", c.detail))
            out.print(t)
        for name in rep.bad_checksums:
            err.print(labelled("checksum mismatch:", "red", name))
        for p in rep.problems[:VERIFY_SHOWN]:  # a wrong --source differs everywhere: the first few say enough
            err.print(labelled("problem:", "red", p), soft_wrap=True)
        if len(rep.problems) > VERIFY_SHOWN:
            more = len(rep.problems) - VERIFY_SHOWN
            err.print(labelled("problem:", "red", f"... and {more} more (--json lists every one)"))
        if num is not None:
            from ninfer_pack.numerics import report_tables

            for table in report_tables(num):
                out.print(table)
    if not rep.ok:
        first = (rep.bad_checksums and f"checksum mismatch in {rep.bad_checksums[0]}") or \
                (rep.problems and rep.problems[0]) or next(f"{c.name}: {c.detail}" for c in rep.checks if not c.ok)
        raise NinferError(f"{path} is not sound: {first}")
    err.print(f"{path}: sound ({rep.tensors} tensors, {rep.bytes:,} bytes"
              f"{', every tensor within its format error' if rep.checks else ''})", soft_wrap=True)


@app.command()
def calibrate(
    source: str = typer.Argument(..., help="Checkpoint: a local directory, a Hub repo id (owner/name), "
                                           "or builtin:tiny-moe / builtin:tiny-dense."),
    text: list[Path] = typer.Option(..., "--text", help="UTF-8 calibration text (repeatable; read in order, encoded "
                                                         "with the checkpoint's tokenizer)."),
    out_path: str = typer.Option(..., "--out", help="Importance file to write (safetensors, atomically): pass it "
                                                     "to quantize --importance."),
    window: int = typer.Option(512, "--window", help="Tokens a window; each starts from an empty cache."),
    max_tokens: int = typer.Option(8192, "--max-tokens", help="Most tokens of text to use, in all."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
):
    """Measure per-input-channel importance (mean squared activations) on text, one decoder layer at a time."""
    import torch

    from ninfer_pack import calibrate as cal
    from ninfer_pack.source import Checkpoint
    from ninfer_pack.numerics import check_memory
    from ninfer_pack.windows import check_window, read_texts, text_windows
    from ninfer_rt.format import check_output_path
    from ninfer_rt.tokenizer import Tokenizer

    # before the checkpoint is opened (a Hub repo: downloaded)
    check_output_path(out_path, overwrite, example="importance.safetensors")
    check_window(window, max_tokens)
    texts = read_texts(text)
    ckpt = Checkpoint.open(source, revision=revision)
    if "tokenizer.json" not in ckpt.resources:
        raise NinferError(f"{source} has no tokenizer.json to encode the calibration text with")
    windows = text_windows(Tokenizer.from_resources(dict(ckpt.resources)), texts, window, max_tokens)
    if not windows:
        raise NinferError("the text gives fewer than 2 tokens: nothing to calibrate on")
    check_memory(ckpt.spec, [len(w) for w in windows], logits=False,
                 what="calibrate runs the fp32 reference on the CPU")  # before any weight is read
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=err) as prog:
        task = prog.add_task("calibrate (layers)", total=None)
        res = cal.calibrate(ckpt, windows, progress=lambda d, n: prog.update(task, completed=d, total=n))
    cal.save(res, out_path, source)
    t = Table(title=f"{out_path}: importance of {len(res.importance)} weights")
    for col in ("weights", "tensors", "rows measured", "mean importance"):
        t.add_column(col, justify="left" if col == "weights" else "right")
    groups: dict[str, list[str]] = {}
    for name in res.importance:
        groups.setdefault(name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1], []).append(name)
    for kind, names in sorted(groups.items()):
        mean = torch.stack([res.importance[n].mean() for n in names]).mean().item()
        t.add_row(kind, str(len(names)), human_count(sum(res.rows[n] for n in names)), f"{mean:.4g}")
    out.print(t)
    err.print(f"wrote {out_path}: {res.tokens:,} tokens in {res.windows} windows, {time.perf_counter() - t0:.1f} s",
              soft_wrap=True)


@app.command()
def publish(
    path: str = typer.Argument(..., help="The artifact to upload."),
    repo: str = typer.Option(..., "--repo", help="Target Hub repo, OWNER/NAME (created if missing)."),
    private: bool = typer.Option(False, "--private", help="Create the repo as private."),
    dry_run: Optional[Path] = typer.Option(None, "--dry-run", help="Write the folder that would be uploaded "
                                                                   "here (a new or empty folder) instead of "
                                                                   "uploading."),
    base_model: Optional[str] = typer.Option(None, "--base-model", help="Hub id of the source model for the card "
                                                                        "(default: the Hub repo it was packed from)."),
    license_: str = typer.Option("apache-2.0", "--license", help="License in the card's front matter."),
    numerics: Optional[Path] = typer.Option(None, "--numerics", help="Put the quality measured by `verify "
                                                                      "--numerics --json` (its output file) in "
                                                                      "the card."),
):
    """Upload the artifact with a generated model card (token from `hf auth login` or HF_TOKEN)."""
    from ninfer_pack.publish import check_args
    from ninfer_pack.publish import publish as run_publish
    from ninfer_rt.format import Artifact

    check_args(path, repo, base_model=base_model, license_=license_, numerics=numerics,
               dry_run_dir=dry_run)  # every option, the --dry-run folder included, before any bar
    with Artifact.open(path) as art:
        size, payload = art.size, art.payload_bytes
    with _bytes_progress() as prog:
        checked, hashed = prog.add_task("checksums", total=payload), prog.add_task("sha256", total=size)
        where = run_publish(path, repo, private=private, dry_run_dir=dry_run, base_model=base_model,
                            license_=license_, numerics=numerics, on_bytes=lambda n: prog.advance(hashed, n),
                            on_checked=lambda n: prog.advance(checked, n))
    err.print(f"{'staged' if dry_run else 'published'}: {where}")


def main() -> None:
    """Entry point: user errors become one line on stderr and exit 1."""
    run_app(app, err)


if __name__ == "__main__":
    main()
