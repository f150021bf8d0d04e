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
from ninfer_rt.format import Artifact
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


def model_card(art: Artifact, repo: str, sha256: str, *, base_model: str | None = None,
               license_: str = DEFAULT_LICENSE) -> str:
    """The README.md of the published repo: YAML front matter, recipe summary, size, checksum, how to run."""
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


def stage(path: Path, folder: Path, repo: str, on_bytes=None, **card_kw) -> Path:
    """Write the folder that would be uploaded: README.md plus the artifact (hard link, else copy)."""
    check_stage_folder(path, folder)
    with Artifact.open(path) as art:
        base = base_model_of(art, card_kw.pop("base_model", None))  # fail before hashing the whole file
        card = model_card(art, repo, file_sha256(path, on_bytes), base_model=base, **card_kw)
    # both files under temporary names first, then renamed: a full disk leaves the folder as it was
    target, readme = folder / path.name, folder / "README.md"
    temps = [f.with_name(f".{f.name}.tmp-{os.getpid()}") for f in (target, readme)]
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
            on_bytes=None, base_model: str | None = None, license_: str = DEFAULT_LICENSE) -> str:
    """Upload (or with dry_run_dir, only stage) the artifact and its card; returns the repo URL or folder."""
    card_kw = {"base_model": base_model, "license_": license_}
    path = Path(path)
    _check_repo_id(repo, "--repo")  # before hashing a 20 GB file or asking the Hub
    check_license(license_)
    if dry_run_dir is not None:
        return str(stage(path, Path(dry_run_dir), repo, on_bytes, **card_kw))
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
        folder = stage(path, Path(tmp) / "upload", repo, on_bytes, **card_kw)
        try:
            api.create_repo(repo, private=private, exist_ok=True)
            api.upload_folder(repo_id=repo, folder_path=str(folder),
                              commit_message=f"Upload {path.name} (ninfer {__version__})")
        except (HfHubHTTPError, OSError) as e:
            raise PublishError(f"upload to {repo} failed: {str(e).splitlines()[0]}") from None
    return f"https://huggingface.co/{repo}"
