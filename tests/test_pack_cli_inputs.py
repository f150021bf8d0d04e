"""ninfer-pack's refusals of inputs a user mistypes, each in one line and before any work: a local path taken for a
Hub id, --out meant as a folder or too long for its temporary name, a wrong --source to verify (checked before the
checksum pass, its differences listed a few at a time), options that need another; and an importance file that
would hold NaN is never written."""

from __future__ import annotations

import json
import os

import pytest
import torch

from cli_runner import error_line, run_main
from ninfer_pack import calibrate as cal
from ninfer_pack import cli
from ninfer_rt.errors import NinferError


def run(args, capsys):
    return run_main(cli.main, "ninfer-pack", args, capsys)


def test_a_mistyped_local_path_is_named_as_one(tmp_path, capsys, monkeypatch):
    """ck/typo beside an existing ck/ reads as a Hub repo id too; offline, the Hub fails, and the message leads
    with the missing directory. A *.json argument to inspect that does not exist is a missing file."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()
    code, _, e = run(["quantize", "ck/typo", "--recipe", "tiny", "--out", "x.ninfer"], capsys)
    assert code == 1 and error_line(e).startswith("error: no such directory: ck/typo (as a Hub repo id: ")
    code, _, e = run(["inspect", "ck/none.json", "--recipe", "tiny"], capsys)
    assert code == 1 and error_line(e) == "error: no such file: ck/none.json"
    code, _, e = run(["inspect", "nobody/none", "--recipe", "tiny"], capsys)  # no such folder: a Hub id
    assert code == 1 and error_line(e).startswith("error: cannot download 'nobody/none'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize("command", [["quantize", "builtin:tiny-moe", "--recipe", "tiny"],
                                     ["calibrate", "builtin:tiny-moe", "--text", "t.txt"]])
def test_out_must_name_a_file(tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("some text " * 50)
    code, _, e = run(command + ["--out", "newdir/"], capsys)
    assert code == 1 and "ends in a folder separator; --out takes a file path" in error_line(e)
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    long = "m" * (name_max - 7) + ".ninfer"  # a legal name, but its hidden temporary name is not
    code, _, e = run(command + ["--out", long], capsys)
    assert code == 1 and "leaves no room for the temporary name" in error_line(e)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]


def test_an_importance_that_is_not_finite_is_not_written(tmp_path):
    """What quantize --importance would refuse, calibrate does not write (a NaN weight in the checkpoint)."""
    good = torch.ones(8)
    nan = torch.ones(8)
    nan[3] = float("nan")
    res = cal.Calibration({"a.weight": good, "b.weight": nan}, {"a.weight": 4, "b.weight": 4}, 1, 5)
    with pytest.raises(NinferError, match=r"^the importance of b\.weight is nan at channel 3: .*nothing written$"):
        cal.save(res, tmp_path / "imp.safetensors", "src")
    assert list(tmp_path.iterdir()) == []


def test_verify_checks_its_source_first_and_lists_a_few_problems(packed, capsys):
    code, _, e = run(["verify", packed, "--source", "/nonexistent/ckpt"], capsys)
    assert code == 1 and error_line(e) == "error: no such directory: /nonexistent/ckpt"
    assert "checksums" not in e  # refused before the artifact's checksum pass
    code, o, e = run(["verify", packed, "--source", "builtin:tiny-dense"], capsys)  # not its checkpoint
    shown = [ln for ln in e.splitlines() if ln.startswith("problem:")]
    assert code == 1 and len(shown) == cli.VERIFY_SHOWN + 1 and shown[-1].endswith("more (--json lists every one)")
    code, o, e = run(["verify", packed, "--source", "builtin:tiny-dense", "--json"], capsys)
    problems = json.loads(o)["problems"]
    assert len(problems) == int(shown[-1].split()[3]) + cli.VERIFY_SHOWN and problems[:10] == [
        ln[len("problem: "):] for ln in shown[:-1]]


@pytest.mark.parametrize("args, why", [
    (["--revision", "main"], "--revision is --source's Hub revision: add --source"),
    (["--window", "64"], "--window and --max-tokens shape --text's windows: add --text"),
])
def test_verify_options_that_need_another(packed, capsys, args, why):
    code, _, e = run(["verify", packed, *args], capsys)
    assert code == 1 and error_line(e) == f"error: {why}"


def test_importance_given_a_directory(tmp_path, capsys):
    code, _, e = run(["quantize", "builtin:tiny-moe", "--recipe", "tiny", "--out", tmp_path / "m.ninfer",
                      "--importance", tmp_path], capsys)
    assert code == 1 and error_line(e) == (f"error: --importance {tmp_path} is a directory: give the .safetensors "
                                           "file calibrate wrote")
    assert list(tmp_path.iterdir()) == []


def test_an_importance_file_gets_the_umask_mode(tmp_path):
    """safetensors creates its file 0600; the importance file, like an artifact, is readable as the umask says."""
    mask = os.umask(0o027)
    try:
        cal.save(cal.Calibration({"a.weight": torch.ones(8)}, {"a.weight": 4}, 1, 5), tmp_path / "i.st", "src")
    finally:
        os.umask(mask)
    assert (tmp_path / "i.st").stat().st_mode & 0o777 == 0o640


def test_a_tokenizer_with_ids_past_the_embedding_is_refused(tiny_moe, tmp_path, capsys):
    """Added tokens until the tokenizer's ids reach the model's 500 embedding rows: quantize refuses in one line
    (a run would index past the embedding), and no artifact is written."""
    import shutil

    from tokenizers import Tokenizer

    src = tmp_path / "ck"
    shutil.copytree(tiny_moe, src)
    vocab = json.loads((src / "config.json").read_text())["text_config"]["vocab_size"]
    tok = json.loads((src / "tokenizer.json").read_text())
    for i in range(vocab + 1 - Tokenizer.from_str(json.dumps(tok)).get_vocab_size(True)):  # ids are given in order
        tok["added_tokens"].append({"id": vocab + i, "content": f"<|extra_{i}|>", "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    top = max(Tokenizer.from_str(json.dumps(tok)).get_vocab(True).values())  # the tokenizers library's own ids
    assert top == vocab
    (src / "tokenizer.json").write_text(json.dumps(tok))
    out = tmp_path / "m.ninfer"
    code, _, e = run(["quantize", src, "--recipe", "tiny", "--out", out], capsys)
    assert code == 1 and error_line(e).endswith(f"tokenizer.json: its ids reach {top}, past the model's "
                                                f"vocab_size {vocab} (the embedding has no row for them)"), e
    assert not out.exists()
