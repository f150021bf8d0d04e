"""publish never harms the user's files, never stages or uploads what verify or ninfer-rt would refuse, and checks
its arguments before any progress bar (the publish audit)."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil

import pytest

from cli_runner import error_line, run_main
from ninfer_pack import cli as pack_cli
from ninfer_rt import cli as rt_cli
from test_artifact import _rewrite_header

BASE = ["--repo", "me/tiny", "--base-model", "Qwen/Qwen3.6-35B-A3B"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here works on tiny tensors (see conftest.one_thread)."""


def pack(args, capsys):
    return run_main(pack_cli.main, "ninfer-pack", args, capsys)


@pytest.fixture
def own_copy(packed, tmp_path):
    """A private copy of the packed artifact, so a test that could destroy it cannot harm the others."""
    return shutil.copyfile(packed, tmp_path / packed.name)


def _snapshot(folder):
    """Every entry under folder (hidden ones included) with its bytes: what a refused or failed run must not change."""
    return {p.relative_to(folder): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def _no_hashing(monkeypatch):
    import ninfer_pack.publish as publish

    monkeypatch.setattr(publish, "file_sha256", lambda *a, **k: pytest.fail("hashed before the check"))


# ---------------------------------------------------------------------------------------------------------
# 1. --dry-run into a folder of the user's: refused; a failed staging leaves nothing.

def test_dry_run_refuses_a_folder_that_holds_files(own_copy, tmp_path, capsys, monkeypatch):
    mine = tmp_path / "userdir"
    mine.mkdir()
    (mine / "README.md").write_text("my own notes\n")
    (mine / "other.txt").write_text("keep me\n")
    before = _snapshot(tmp_path)
    _no_hashing(monkeypatch)
    code, _, e = pack(["publish", own_copy, *BASE, "--dry-run", mine], capsys)
    assert code == 1 and error_line(e) == f"error: --dry-run {mine}: {mine} exists and is not empty; give a new folder"
    assert _snapshot(tmp_path) == before  # the README is the user's, no artifact linked in, no temporary left


def test_dry_run_into_an_empty_folder_stages_the_card_and_artifact(own_copy, tmp_path, capsys):
    folder = tmp_path / "empty"
    folder.mkdir()
    code, _, e = pack(["publish", own_copy, *BASE, "--dry-run", folder], capsys)
    assert code == 0, e
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", own_copy.name]
    assert (folder / own_copy.name).read_bytes() == own_copy.read_bytes()
    assert hashlib.sha256(own_copy.read_bytes()).hexdigest() in (folder / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", own_copy.name]  # no temporary sibling left


def _no_space(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("exists", [False, True], ids=["new-folder", "empty-folder"])
@pytest.mark.parametrize("where", ["copy", "last-rename"])
def test_staging_failure_leaves_nothing(where, exists, own_copy, tmp_path, capsys, monkeypatch):
    import ninfer_pack.publish as publish

    folder = tmp_path / "stage"
    if exists:
        folder.mkdir()
    before = _snapshot(tmp_path)
    if where == "copy":
        monkeypatch.setattr(publish.os, "link", _no_space)
        monkeypatch.setattr(publish.shutil, "copyfile", _no_space)
    else:  # the artifact is in place (an existing folder's is moved in first), the card's rename fails
        real_replace = os.replace
        monkeypatch.setattr(publish.os, "rename", _no_space)
        monkeypatch.setattr(publish.os, "replace", lambda a, b: _no_space() if str(b).endswith("README.md")
                            else real_replace(a, b))
    code, _, e = pack(["publish", own_copy, *BASE, "--dry-run", folder], capsys)
    assert code == 1 and f"cannot stage into {folder}: No space left on device" in error_line(e)
    assert _snapshot(tmp_path) == before  # no folder (or, given one, still empty), no hidden temporary


# ---------------------------------------------------------------------------------------------------------
# 2. An artifact verify or ninfer-rt refuses (checksums intact) is neither staged nor uploaded.

def _drop_final_norm(h):
    h["tensors"] = [t for t in h["tensors"] if t["name"] != "model.language_model.norm.weight"]


def _wrong_part_shape(h):
    part = next(t for t in h["tensors"] if t["name"].endswith("embed_tokens.weight"))["parts"][0]
    part["shape"] = [part["shape"][0] + 1, *part["shape"][1:]]


def _no_tokenizer(h):
    next(r for r in h["resources"] if r["name"] == "tokenizer.json")["name"] = "tokenizer.json.bak"


class _FakeHub:
    """HfApi that is logged in and records every write, so a refused upload can be seen to send nothing."""
    calls: list = []

    def __init__(self, *a, **k):
        pass

    def whoami(self):
        return {"name": "me"}

    def create_repo(self, *a, **k):
        self.calls.append("create_repo")

    def upload_folder(self, *a, **k):
        self.calls.append("upload_folder")


@pytest.mark.parametrize("edit", [_drop_final_norm, _wrong_part_shape], ids=["missing-tensor", "part-shape"])
def test_unsound_table_is_refused_with_verifys_reason(edit, packed, tmp_path, capsys, monkeypatch):
    import huggingface_hub

    bad = _rewrite_header(packed, tmp_path / "bad.ninfer", edit)  # re-hashed: only the table is wrong
    code, _, e = pack(["verify", bad], capsys)  # the oracle: verify's own one-line reason
    reason = error_line(e)
    assert code == 1 and reason.startswith(f"error: {bad} is not sound: ")
    code, out, e = run_main(rt_cli.main, "ninfer-rt", ["run", bad, "--prompt", "hi", "--device", "cpu"], capsys)
    assert code == 1 and out == "" and error_line(e)  # the runtime refuses it too
    stage = tmp_path / "stage"
    code, _, e = pack(["publish", bad, *BASE, "--dry-run", stage], capsys)
    assert code == 1 and error_line(e).startswith(reason + "; not published"), e
    assert not stage.exists()
    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeHub)
    _FakeHub.calls = []
    code, _, e = pack(["publish", bad, *BASE], capsys)
    assert code == 1 and error_line(e).startswith(reason) and _FakeHub.calls == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.ninfer"]  # the upload's staging folder is gone


def test_artifact_without_tokenizer_is_refused(packed, tmp_path, capsys, monkeypatch):
    bad = _rewrite_header(packed, tmp_path / "notok.ninfer", _no_tokenizer)
    code, out, e = run_main(rt_cli.main, "ninfer-rt", ["run", bad, "--prompt", "hi", "--device", "cpu"], capsys)
    assert code == 1 and out == "" and "tokenizer.json" in error_line(e)  # the oracle: ninfer-rt cannot run it
    _no_hashing(monkeypatch)
    stage = tmp_path / "stage"
    code, _, e = pack(["publish", bad, *BASE, "--dry-run", stage], capsys)
    assert code == 1 and e.strip() == (f"error: {bad} has no tokenizer.json: ninfer-rt needs it to run the model; "
                                       "not published")
    assert not stage.exists()


def test_sound_artifact_is_uploaded(own_copy, tmp_path, capsys, monkeypatch):
    """The control for the refusals above: the same fake Hub receives a sound artifact."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeHub)
    _FakeHub.calls = []
    code, _, e = pack(["publish", own_copy, *BASE], capsys)
    assert code == 0 and "published: https://huggingface.co/me/tiny" in e
    assert _FakeHub.calls == ["create_repo", "upload_folder"]


# ---------------------------------------------------------------------------------------------------------
# 3. A --dry-run that is not a usable folder: one line, and no progress bar before it.

@pytest.mark.parametrize("target, message", [
    ("text.txt", "--dry-run text.txt is an existing file; it takes a folder"),
    (".", "--dry-run . would replace {art} itself"),
    ("/dev/null", "--dry-run /dev/null exists and is not a folder; it takes a folder"),
    ("full", "--dry-run full: full exists and is not empty"),
    ("missing/stage", "--dry-run missing/stage: folder missing does not exist"),
])
def test_bad_dry_run_is_refused_before_any_progress_bar(target, message, own_copy, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text("hello\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    before = _snapshot(tmp_path)
    _no_hashing(monkeypatch)
    code, out, e = pack(["publish", own_copy.name, *BASE, "--dry-run", target], capsys)
    lines = e.strip().splitlines()  # the error alone: no bar, not even an empty one, before it
    assert code == 1 and out == "" and len(lines) == 1, e
    assert lines[0].startswith(f"error: {message.format(art=own_copy.name)}"), e
    assert _snapshot(tmp_path) == before
