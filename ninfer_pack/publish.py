"""publish: upload an artifact to the Hugging Face Hub with a generated model card.

The token comes from huggingface_hub's usual sources (a prior `hf auth login`, or HF_TOKEN) and is never
printed. `--dry-run` writes the folder that would be uploaded (the card, and a hard link to or copy of the
artifact) so the card can be read before anything leaves the machine.
"""

from __future__ import annotations

import hashlib
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


def read_numerics(path: str | Path, art: Artifact) -> dict:
    """The `numerics` report inside a `ninfer-pack verify --numerics --json` output, checked to be this artifact's
    (its header SHA-256, which names every tensor's: another quantization of the same recipe is refused);
    PublishError naming what is wrong."""
    import json

    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PublishError(f"--numerics {path}: not a readable JSON report ({type(e).__name__})") from None
    num = report.get("numerics") if isinstance(report, dict) else None
    if not isinstance(num, dict) or any(k not in num for k in NUMERICS_KEYS):
        raise PublishError(f"--numerics {path}: not the output of `ninfer-pack verify --numerics --json` "
                           f"(needs numerics.{{{','.join(NUMERICS_KEYS)}}})")
    if num["artifact_sha256"] != art.header_sha256:
        raise PublishError(f"--numerics {path}: measured on another artifact ({num.get('artifact', '?')}, recipe "
                           f"{num['recipe']!r}); run `ninfer-pack verify {art.path} --numerics --json` on this one")
    return num


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
                  f"| {num['kld_mean']:.6f} ± {num['kld_mean_stderr']:.6f} | {num['kld_p99']:.6f} | "
                  f"{num['kld_p999']:.6f} | {100 * num['same_top']:.2f}% | {100 * num['rms_dp']:.3f}% | "
                  f"{num['ppl_ratio']:.4f} |", ""]
    return ["## Quality", "", *lines] if lines else []


def model_card(art: Artifact, repo: str, sha256: str, *, base_model: str | None = None,
               license_: str = DEFAULT_LICENSE, numerics: dict | None = None) -> str:
    """The README.md of the published repo: YAML front matter, recipe summary, size, checksum, the quality
    measured (numerics, a `verify --numerics` report) and how the search was weighted, how to run."""
    check_license(license_)
    prov = art.header["provenance"]
    base = base_model_of(art, base_model)
    rows = summarize(planned_from_artifact(art))
    params = sum(r["params"] for r in rows)
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
        f"| **total** | {sum(r['tensors'] for r in rows)} | {params:,} | | {art.size / 2**30:.3f} | "
        f"{8 * art.size / max(params, 1):.2f} |",
        "",
        f"- file: `{fname}`, {art.size:,} bytes",
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
    """Refuse a --dry-run folder that is a file, or where staging would replace the artifact itself."""
    if folder.exists() and not folder.is_dir():
        raise PublishError(f"--dry-run {folder} is an existing file; it takes a folder to write the upload into")
    if (folder / path.name).resolve() == path.resolve():  # resolve() follows a symlink to the artifact too
        raise PublishError(f"--dry-run {folder} would replace {path} itself; choose another folder")
    if (folder / "README.md").resolve() == path.resolve():
        raise PublishError(f"--dry-run {folder}: its README.md would overwrite {path}; choose another folder")


def check_args(path: str | Path, repo: str, *, base_model: str | None = None, license_: str = DEFAULT_LICENSE,
               numerics: str | Path | None = None) -> None:
    """Every check that reads no payload (the repo id, the license, the base model, the numerics report against
    this artifact), so that bad options are refused before a 20 GB file is hashed."""
    _check_repo_id(repo, "--repo")
    check_license(license_)
    with Artifact.open(path) as art:
        base_model_of(art, base_model)
        if numerics is not None:
            read_numerics(numerics, art)


def stage(path: Path, folder: Path, repo: str, on_bytes=None, on_checked=None, **card_kw) -> Path:
    """Write the folder that would be uploaded: README.md plus the artifact (hard link, else copy), once every
    tensor's checksum holds (a corrupted file is never staged, so never uploaded). on_checked / on_bytes: bytes
    checked, bytes hashed for the card's SHA-256."""
    check_stage_folder(path, folder)
    with Artifact.open(path) as art:
        base = base_model_of(art, card_kw.pop("base_model", None))  # fail before hashing the whole file
        report = card_kw.pop("numerics", None)
        num = read_numerics(report, art) if report is not None else None
        bad = art.verify_checksums(on_checked)
        if bad:
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            raise PublishError(f"{path} is corrupted (checksum mismatch in {bad[0]}{more}): not published; "
                               "`ninfer-pack verify` names every damaged tensor")
        card = model_card(art, repo, file_sha256(path, on_bytes), base_model=base, numerics=num, **card_kw)
    # both files under temporary names first, then renamed: a full disk leaves the folder as it was
    target, readme = folder / path.name, folder / "README.md"
    temps = [temp_path(f) for f in (target, readme)]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, temps[0])
        except OSError:
            shutil.copyfile(path, temps[0])
        temps[1].write_text(card, encoding="utf-8")
        os.replace(temps[0], target)
        os.replace(temps[1], readme)
    except OSError as e:
        raise PublishError(f"cannot stage into {folder}: {e.strerror or e}") from None
    finally:
        for t in temps:
            if t.exists() or t.is_symlink():
                t.unlink()
    return folder


def publish(path: str | Path, repo: str, *, private: bool = False, dry_run_dir: str | Path | None = None,
            on_bytes=None, on_checked=None, base_model: str | None = None, license_: str = DEFAULT_LICENSE,
            numerics: str | Path | None = None) -> str:
    """Upload (or with dry_run_dir, only stage) the artifact and its card; returns the repo URL or folder.
    numerics: a `verify --numerics --json` report of this artifact whose quality figures go into the card."""
    card_kw = {"base_model": base_model, "license_": license_, "numerics": numerics}
    path = Path(path)
    check_args(path, repo, **card_kw)  # before hashing a 20 GB file or asking the Hub
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
