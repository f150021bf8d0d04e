"""The checkpoint reader and the Hub: failures as one line, offline mode for real, download arguments and
provenance, fetching a config. Oracles: huggingface_hub's own exception types and a subprocess with
HF_HUB_OFFLINE=1; the tiny HF models' files for what a download must hold."""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx2
import huggingface_hub
import pytest
from huggingface_hub import errors as hfe

import checkpoints as ckpts
from cli_runner import one_line
from ninfer_pack.source import HUB_PATTERNS, RESOURCE_FILES, Checkpoint, fetch_config
from ninfer_rt.errors import ConfigError, SourceError

REPO = "ninfer-test/no-such-model"
_RESP = {code: httpx2.Response(code, request=httpx2.Request("GET", f"https://huggingface.co/api/models/{REPO}"))
         for code in (401, 403, 404, 500)}


def _offline_error() -> Exception:
    """What snapshot_download raises when the library's offline mode is on and the repo is not cached."""
    e = hfe.LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder\nset HF_HUB_OFFLINE=0")
    e.__cause__ = hfe.OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is enabled.")
    return e


HUB_FAILURES = {
    "not-found": (hfe.RepositoryNotFoundError("404 Client Error.\nRepository Not Found", response=_RESP[404]),
                  "repository not found"),
    "gated": (hfe.GatedRepoError("403 Client Error.\nCannot access gated repo", response=_RESP[403]), "gated"),
    "revision": (hfe.RevisionNotFoundError("404 Client Error.\nRevision Not Found", response=_RESP[404]),
                 "revision 'v9' not found"),
    "unauthorised": (hfe.HfHubHTTPError("401 Client Error.\nUnauthorized", response=_RESP[401]), "not authorised"),
    "unreachable": (hfe.LocalEntryNotFoundError("Got: ConnectError\nAn error happened"), "unreachable"),
    "offline": (_offline_error(), "offline mode (HF_HUB_OFFLINE)"),
    "server": (hfe.HfHubHTTPError("500 Server Error", response=_RESP[500]), "HTTP error 500"),
    "disk": (OSError(28, "No space left on device"), "No space left on device"),
}


@pytest.mark.parametrize("case", list(HUB_FAILURES))
def test_hub_failures_areone_line(monkeypatch, case):
    exc, reason = HUB_FAILURES[case]

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(SourceError) as e:
        Checkpoint.open(REPO, revision="v9", progress=False)
    msg = one_line(e)
    assert msg.startswith(f"cannot download '{REPO}' from the Hugging Face Hub: ") and reason in msg


def test_hub_offline_mode_for_real(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE set in the environment: no network is tried and the error is one line."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SourceError) as e:
        Checkpoint.open(REPO)
    assert "offline mode (HF_HUB_OFFLINE)" in one_line(e)
    with pytest.raises(SourceError) as e:
        fetch_config(REPO)
    assert "offline mode (HF_HUB_OFFLINE)" in one_line(e)
    # and set before huggingface_hub is imported, where the library itself reads it
    code = ("from ninfer_pack.source import Checkpoint\n"
            "try:\n Checkpoint.open(%r)\nexcept Exception as e:\n print(repr(e))")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code % REPO], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.startswith("SourceError(\"cannot download 'ninfer-test/no-such-model'"), out.stdout + out.stderr


def test_hub_download_arguments_and_provenance(models, tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap, _ = ckpts.write_checkpoint(tmp_path / "snapshots" / commit, models["causal_dense"], prefix="causal")
    (snap / "tokenizer.json").write_bytes(b"{}")
    calls = []

    def fake(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    ck = Checkpoint.open("owner/name", revision="v1")
    assert ck.provenance == {"source": "owner/name", "revision": commit}
    assert ck.resources == {"tokenizer.json": b"{}"}
    (repo, kw), = calls
    assert repo == "owner/name" and kw["revision"] == "v1"
    wanted = ["model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json", *RESOURCE_FILES]
    for f in wanted:
        assert any(fnmatch.fnmatch(f, p) for p in kw["allow_patterns"]), f
    assert not any(fnmatch.fnmatch("pytorch_model.bin", p) for p in HUB_PATTERNS)


def test_fetch_config(models, tmp_path, monkeypatch):
    path, _ = ckpts.write_checkpoint(tmp_path / "ck", models["causal_moe"], prefix="causal")
    want = json.loads((path / "config.json").read_text())
    assert fetch_config(str(path)) == want
    asked = []

    def fake(repo, **kw):  # one snapshot_download of config.json alone (hf_hub_download retries ~25 s offline)
        asked.append((repo, kw["allow_patterns"]))
        return str(path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert fetch_config("owner/name") == want and asked == [("owner/name", ["config.json"])]
    with pytest.raises(SourceError, match="no such directory"):
        fetch_config(str(tmp_path / "a" / "b" / "c"))
    assert Checkpoint.open(path).config == want


def test_fetch_config_refuses_a_file(models, tmp_path, monkeypatch):
    """`inspect x.safetensors --recipe R`: the file exists, so neither "no such directory" nor a Hub download."""
    path, _ = ckpts.write_checkpoint(tmp_path / "ck", models["causal_dense"], prefix="causal")

    def no_hub(*args, **kwargs):
        raise AssertionError("fetch_config went to the Hub for a local file")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    monkeypatch.chdir(tmp_path)
    shard = "ck/model-00001-of-00002.safetensors"  # relative, so it also looks like a repo id "owner/name"
    for source in (shard, str(tmp_path / shard)):
        with pytest.raises(SourceError) as e:
            fetch_config(source)
        assert one_line(e) == f"{source} is not a checkpoint directory, config.json or Hub repo id"


def test_config_json_that_is_not_json(models, tmp_path, monkeypatch):
    path, _ = ckpts.write_checkpoint(tmp_path / "ck", models["causal_dense"], prefix="causal")
    cfg = path / "config.json"
    cfg.write_text('{"model_type": "qwen3_5_text",')
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: str(path))
    for call in (lambda: Checkpoint.open(path), lambda: fetch_config(str(path)), lambda: fetch_config("owner/name")):
        with pytest.raises(ConfigError) as e:
            call()
        assert one_line(e).startswith(f"{cfg}: not valid JSON (")
