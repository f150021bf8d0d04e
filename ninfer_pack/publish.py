"""publish: upload an artifact to the Hugging Face Hub with a generated model card.

The token comes from huggingface_hub's usual sources (a prior `hf auth login`, or HF_TOKEN) and is never
printed. `--dry-run` writes the folder that would be uploaded (the card, and a hard link to or copy of the
artifact) so the card can be read before anything leaves the machine.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from ninfer_rt import __version__
from ninfer_rt.errors import NinferError
from ninfer_rt.format import Artifact, temp_path
from ninfer_pack.plan import planned_from_artifact, summarize


class PublishError(NinferError):
    """The Hub refused or could not be reached."""


def file_sha256(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """SHA-256 of a whole file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(64 << 20):
            h.update(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    return h.hexdigest()


DEFAULT_LICENSE = "apache-2.0"  # the Qwen3.5/3.6 releases' license


def base_model_of(art: Artifact, base_model: str | None = None) -> str:
    """The card's base_model: `base_model` if given, else the Hub repo the artifact was packed from."""
    if base_model:
        _check_repo_id(base_model, "--base-model")
        return base_model
    prov = art.header["provenance"]
    # only a Hub source (recorded with its commit) names a model; a local dir or builtin: does not
    if "revision" in prov and prov.get("source"):
        return prov["source"]
    raise PublishError(f"{art.path} was packed from {prov.get('source', 'an unknown source')}, not a Hub repo: "
                       "pass --base-model OWNER/NAME")


def _check_repo_id(repo: str, option: str) -> None:
    """OWNER/NAME as the Hub accepts it, checked before any hashing or network."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if repo.count("/") != 1:
        raise PublishError(f"{option} must be OWNER/NAME, got {repo!r}")
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise PublishError(f"{option} {repo!r} is not a valid Hub repo id: {str(e).splitlines()[0]}") from None


def check_license(license_: str) -> None:
    """A Hub license id (apache-2.0, mit, other, ...): one token, so it cannot add lines to the card's front matter."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9.+_-]{0,63}", license_):
        raise PublishError(f"--license {license_!r} is not a license id such as apache-2.0, mit or other")


NUMERICS_KEYS = ("artifact_sha256", "recipe", "scored", "prompts", "kld_mean", "kld_mean_stderr", "kld_p99",
                 "kld_p999", "same_top", "rms_dp", "ppl_ratio")


def _is_number(x) -> bool:
    """An int or a finite float: json.loads also reads NaN and Infinity, which verify never writes."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _number_or_null(x) -> bool:
    """A finite number, or null: NumericsReport.to_dict writes a non-finite statistic (the standard error of one
    scored position, any figure of NaN logits) as null."""
    return x is None or _is_number(x)


# Figures computed from the logits may be non-finite, hence null; same_top, a mean of 0/1 over scored > 0
# positions, never is.
_NULLABLE = ("kld_mean", "kld_mean_stderr", "kld_p99", "kld_p999", "rms_dp", "ppl_ratio")

_NUMERICS_TYPES = (  # what the card's table formats: a hand-edited report is refused before anything is hashed
    ("artifact_sha256", lambda x: isinstance(x, str), "a string"),
    ("recipe", lambda x: isinstance(x, str), "a string"),
    ("scored", lambda x: type(x) is int and x > 0, "a positive integer"),
    ("prompts", lambda x: isinstance(x, list) and all(isinstance(p, dict) for p in x), "a list of objects"),
    ("same_top", _is_number, "a finite number"),
    *((k, _number_or_null, "a finite number or null") for k in _NULLABLE),
)


def read_numerics(path: str | Path, art: Artifact) -> dict:
    """The `numerics` report inside a `ninfer-pack verify --numerics --json` output, checked to be this artifact's
    (its header SHA-256, which names every tensor's: another quantization of the same recipe is refused);
    PublishError naming what is wrong."""
    import json

    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise PublishError(f"--numerics {path}: not a readable JSON report ({type(e).__name__})") from None
    num = report.get("numerics") if isinstance(report, dict) else None
    if not isinstance(num, dict) or any(k not in num for k in NUMERICS_KEYS):
        raise PublishError(f"--numerics {path}: not the output of `ninfer-pack verify --numerics --json` "
                           f"(needs numerics.{{{','.join(NUMERICS_KEYS)}}})")
    for key, ok, what in _NUMERICS_TYPES:
        if not ok(num[key]):
            raise PublishError(f"--numerics {path}: numerics.{key} must be {what}, not {num[key]!r:.40}")
    if num["artifact_sha256"] != art.header_sha256:
        raise PublishError(f"--numerics {path}: measured on another artifact ({num.get('artifact', '?')}, recipe "
                           f"{num['recipe']!r}); run `ninfer-pack verify {art.path} --numerics --json` on this one")
    return num


def _fig(x: float | None, spec: str, scale: float = 1, unit: str = "") -> str:
    """One figure of the quality table; n/a for a null (a value verify found non-finite)."""
    return "n/a" if x is None else f"{scale * x:{spec}}{unit}"


def _quality(num: dict | None, recipe: dict) -> list[str]:
    """The card's Quality section: the numerics report (when given) and how the scale search was weighted."""
    lines = []
    cal = recipe.get("calibration")
    if recipe.get("importance"):
        tokens = cal.get("tokens") if isinstance(cal, dict) else None
        how = (f"measured by `ninfer-pack calibrate` on {tokens:,} tokens in {cal.get('windows', '?')} windows"
               if isinstance(tokens, int) else "from an importance file")
        lines += [f"Each group's scale was chosen by a clipping search weighted by per-input-channel importance "
                  f"(mean squared activations, {how}).", ""]
    if num is not None:
        names = ", ".join(str(p.get("name", "?")) for p in num["prompts"][:8])
        lines += [f"Against the source checkpoint on the fp32 reference model (`ninfer-pack verify --numerics`), "
                  f"{num['scored']:,} scored positions ({names}{', ...' if len(num['prompts']) > 8 else ''}):", "",
                  "| mean KLD | 99% KLD | 99.9% KLD | same top token | RMS Δp | PPL ratio |",
                  "|---:|---:|---:|---:|---:|---:|",
                  f"| {_fig(num['kld_mean'], '.6f')} ± {_fig(num['kld_mean_stderr'], '.6f')} | "
                  f"{_fig(num['kld_p99'], '.6f')} | {_fig(num['kld_p999'], '.6f')} | "
                  f"{_fig(num['same_top'], '.2f', 100, '%')} | {_fig(num['rms_dp'], '.3f', 100, '%')} | "
                  f"{_fig(num['ppl_ratio'], '.4f')} |", ""]
    return ["## Quality", "", *lines] if lines else []


def model_card(art: Artifact, repo: str, sha256: str, *, base_model: str | None = None,
               license_: str = DEFAULT_LICENSE, numerics: dict | None = None) -> str:
    """The README.md of the published repo: YAML front matter, recipe summary, size, checksum, the quality
    measured (numerics, a `verify --numerics` report) and how the search was weighted, how to run."""
    check_license(license_)
    prov = art.header["provenance"]
    base = base_model_of(art, base_model)
    rows = summarize(planned_from_artifact(art))
    # the total is of the weights, as the class rows and `inspect` count them; the file size is stated apart
    params, weights = sum(r["params"] for r in rows), sum(r["nbytes"] for r in rows)
    fname = art.path.name
    lines = [
        "---",
        f"base_model: {base}",
        "base_model_relation: quantized",
        f"license: {license_}",
        "library_name: ninfer",
        "tags:",
        "  - ninfer",
        "  - quantized",
        f"  - {art.spec.family}",
        "---",
        "",
        f"# {repo.split('/')[-1]}",
        "",
        f"`{base}` quantized with [ninfer](https://github.com/ninfer) recipe "
        f"`{art.header['recipe'].get('name', '?')}` into one `.ninfer` artifact that ninfer-rt loads with "
        "no repacking.",
        "",
        "| tensor class | tensors | parameters | formats | GiB | bits/weight |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['class']} | {r['tensors']} | {r['params']:,} | {r['formats']} | "
                     f"{r['nbytes'] / 2**30:.3f} | {r['bpw']:.2f} |")
    lines += [
        f"| **total** | {sum(r['tensors'] for r in rows)} | {params:,} | | {weights / 2**30:.3f} | "
        f"{8 * weights / max(params, 1):.3f} |",
        "",
        f"- file: `{fname}`, file size {art.size:,} bytes ({weights:,} bytes of weights; the rest is the header, "
        "resources such as the tokenizer, and alignment)",
        f"- SHA-256: `{sha256}`",
        f"- source revision: `{prov.get('revision', 'local')}`; written by ninfer {prov.get('ninfer_version', '?')}",
        "",
        *_quality(numerics, art.header["recipe"]),
        "## Run",
        "",
        "```bash",
        "pip install ninfer",
        f"hf download {repo} {fname} --local-dir .",
        f"ninfer-pack verify {fname}",
        f"ninfer-rt run {fname} --chat --prompt 'Hello'",
        "```",
        "",
    ]
    return "\n".join(lines)


def check_stage_folder(path: Path, folder: Path) -> None:
    """Refuse a --dry-run folder that is not a folder, would replace the artifact itself, or already holds files
    (staging would overwrite the user's README.md), before any progress bar or hashing."""
    if folder.exists() and not folder.is_dir():
        what = "is an existing file" if folder.is_file() else "exists and is not a folder"
        raise PublishError(f"--dry-run {folder} {what}; it takes a folder to write the upload into")
    if (folder / path.name).resolve() == path.resolve():  # resolve() follows a symlink to the artifact too
        raise PublishError(f"--dry-run {folder} would replace {path} itself; choose another folder")
    if (folder / "README.md").resolve() == path.resolve():
        raise PublishError(f"--dry-run {folder}: its README.md would overwrite {path}; choose another folder")
    if folder.is_dir():
        try:
            full = any(folder.iterdir())
        except OSError as e:
            raise PublishError(f"--dry-run {folder}: cannot read it ({e.strerror or e})") from None
        if full:
            raise PublishError(f"--dry-run {folder}: {folder} exists and is not empty; give a new folder")
    elif not folder.parent.is_dir():
        raise PublishError(f"--dry-run {folder}: folder {folder.parent} does not exist")


def check_args(path: str | Path, repo: str, *, base_model: str | None = None, license_: str = DEFAULT_LICENSE,
               numerics: str | Path | None = None, dry_run_dir: str | Path | None = None) -> None:
    """Every check that reads no payload (the repo id, the license, the --dry-run folder, the base model, the
    tokenizer, the numerics report against this artifact), so that bad options are refused before a 20 GB file is
    hashed."""
    _check_repo_id(repo, "--repo")
    check_license(license_)
    if dry_run_dir is not None:
        check_stage_folder(Path(path), Path(dry_run_dir))
    with Artifact.open(path) as art:
        base_model_of(art, base_model)
        # ninfer-rt cannot run it: said before the file is hashed (verify says it after the checksums)
        if "tokenizer.json" not in art.resources:
            raise PublishError(f"{path} has no tokenizer.json: ninfer-rt needs it to run the model; not published")
        if numerics is not None:
            read_numerics(numerics, art)


def _check_sound(path: Path, on_checked=None) -> None:
    """What `ninfer-pack verify` (without --source) checks: every checksum, the tensor table against the model,
    the text resources; PublishError with verify's reason, so an unsound file is never staged or uploaded."""
    from ninfer_pack.verify import verify

    rep = verify(str(path), on_bytes=on_checked)
    if rep.bad_checksums:
        bad = rep.bad_checksums
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise PublishError(f"{path} is corrupted (checksum mismatch in {bad[0]}{more}): not published; "
                           "`ninfer-pack verify` names every damaged tensor")
    if rep.problems:
        raise PublishError(f"{path} is not sound: {rep.problems[0]}; not published "
                           "(`ninfer-pack verify` lists every problem)")


def _write_folder(path: Path, folder: Path, card: str) -> None:
    """The artifact (hard link, else copy) and README.md, written into a hidden temporary folder and then renamed
    into place, so a failure (a full disk, ^C) leaves no folder or file behind."""
    fresh = not folder.exists()
    # an existing empty folder (perhaps a mount point) is kept and takes the files; a new one is renamed in whole
    tmp = temp_path(folder) if fresh else temp_path(folder / "upload")
    try:
        tmp.mkdir()
        try:
            os.link(path, tmp / path.name)
        except OSError:
            shutil.copyfile(path, tmp / path.name)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        if fresh:
            os.rename(tmp, folder)  # refused if a non-empty folder appeared there meanwhile
        else:
            os.replace(tmp / path.name, folder / path.name)
            try:
                os.replace(tmp / "README.md", folder / "README.md")
            except OSError:
                (folder / path.name).unlink()
                raise
    except OSError as e:
        raise PublishError(f"cannot stage into {folder}: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def stage(path: Path, folder: Path, repo: str, on_bytes=None, on_checked=None, **card_kw) -> Path:
    """Write the folder that would be uploaded: README.md plus the artifact, once `verify`'s checks pass (a
    corrupted or unsound file is never staged, so never uploaded). on_checked / on_bytes: bytes checked, bytes
    hashed for the card's SHA-256."""
    check_stage_folder(path, folder)
    with Artifact.open(path) as art:
        base = base_model_of(art, card_kw.pop("base_model", None))  # fail before hashing the whole file
        report = card_kw.pop("numerics", None)
        num = read_numerics(report, art) if report is not None else None
        _check_sound(path, on_checked)
        card = model_card(art, repo, file_sha256(path, on_bytes), base_model=base, numerics=num, **card_kw)
    _write_folder(path, folder, card)
    return folder


def publish(path: str | Path, repo: str, *, private: bool = False, dry_run_dir: str | Path | None = None,
            on_bytes=None, on_checked=None, base_model: str | None = None, license_: str = DEFAULT_LICENSE,
            numerics: str | Path | None = None) -> str:
    """Upload (or with dry_run_dir, only stage) the artifact and its card; returns the repo URL or folder.
    numerics: a `verify --numerics --json` report of this artifact whose quality figures go into the card."""
    card_kw = {"base_model": base_model, "license_": license_, "numerics": numerics}
    path = Path(path)
    check_args(path, repo, dry_run_dir=dry_run_dir, **card_kw)  # before hashing a 20 GB file or asking the Hub
    if dry_run_dir is not None:
        return str(stage(path, Path(dry_run_dir), repo, on_bytes, on_checked, **card_kw))
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    api = HfApi(library_name="ninfer", library_version=__version__)
    try:
        api.whoami()
    except (LocalTokenNotFoundError, OSError, HfHubHTTPError) as e:
        raise PublishError("not logged in to the Hugging Face Hub: run `hf auth login` or set HF_TOKEN "
                           f"({type(e).__name__})") from None
    import tempfile

    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        folder = stage(path, Path(tmp) / "upload", repo, on_bytes, on_checked, **card_kw)
        try:
            api.create_repo(repo, private=private, exist_ok=True)
            api.upload_folder(repo_id=repo, folder_path=str(folder),
                              commit_message=f"Upload {path.name} (ninfer {__version__})")
        except (HfHubHTTPError, OSError) as e:
            raise PublishError(f"upload to {repo} failed: {str(e).splitlines()[0]}") from None
    return f"https://huggingface.co/{repo}"
