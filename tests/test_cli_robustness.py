"""Bad inputs that once ended in a traceback, a zero exit or a half-written file (the 2026-12-05 audit): each now
ends in one line and a non-zero exit, and leaves no file behind."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from cli_runner import error_line, run_main
from ninfer_pack import cli as pack_cli
from ninfer_rt import cli as rt_cli
from ninfer_rt.format import MAGIC, PREFIX, Artifact


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here works on tiny tensors (see conftest.one_thread)."""


def pack(args, capsys):
    return run_main(pack_cli.main, "ninfer-pack", args, capsys)


def rt(args, capsys):
    return run_main(rt_cli.main, "ninfer-rt", args, capsys)


def _interrupt_at(monkeypatch, n: int, action) -> dict:
    """Run action() when quantize encodes its n-th tensor."""
    import ninfer_pack.pipeline as pipeline

    calls, real = {"n": 0}, pipeline.encode_tensor

    def hooked(*a, **k):
        calls["n"] += 1
        if calls["n"] == n:
            action()
        return real(*a, **k)

    monkeypatch.setattr(pipeline, "encode_tensor", hooked)
    return calls


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["TERM", "HUP"])
def test_signal_during_quantize_leaves_no_file(sig, tiny_moe, tmp_path, capsys, monkeypatch):
    before = signal.getsignal(sig)
    calls = _interrupt_at(monkeypatch, 20, lambda: os.kill(os.getpid(), sig))
    code, _, err = pack(["quantize", tiny_moe, "--recipe", "tiny", "--out", tmp_path / "x.ninfer"], capsys)
    assert code == 128 + sig and calls["n"] == 20 and "terminated" in err
    assert list(tmp_path.iterdir()) == []  # neither the output nor its temporary file
    assert signal.getsignal(sig) is before  # the process's own handler is back


def test_disk_full_during_quantize(tiny_moe, tmp_path, capsys, monkeypatch):
    real, writes = os.pwrite, {"n": 0}

    def full(fd, data, offset):
        writes["n"] += 1
        if writes["n"] == 30:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    out = tmp_path / "x.ninfer"
    code, _, err = pack(["quantize", tiny_moe, "--recipe", "tiny", "--out", out], capsys)
    assert code == 1 and error_line(err) == f"error: cannot write {out}: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_out_that_is_not_a_regular_file(tiny_moe, tmp_path, capsys):
    fifo = tmp_path / "pipe.ninfer"
    os.mkfifo(fifo)
    code, _, err = pack(["quantize", tiny_moe, "--recipe", "tiny", "--out", fifo, "--overwrite"], capsys)
    assert code == 1 and "exists and is not a regular file" in error_line(err)
    assert fifo.is_fifo() and [p.name for p in tmp_path.iterdir()] == ["pipe.ninfer"]


def test_revision_of_a_builtin(tmp_path, capsys):
    code, _, err = pack(["quantize", "builtin:tiny-moe", "--revision", "v1", "--recipe", "tiny",
                         "--out", tmp_path / "x.ninfer"], capsys)
    assert code == 1 and "--revision v1 applies to Hub repos, but builtin:tiny-moe is built in" in error_line(err)


def test_inspect_refuses_a_revision_that_does_not_apply(packed, tiny_moe, tmp_path, capsys):
    """inspect --revision only means something for a Hub repo: an artifact, a built-in config or a config.json
    given one is refused, not planned as if it had been read at that revision."""
    for args, why in (([packed], "not to an artifact"),
                      (["qwen3.6-35b-a3b", "--recipe", "qwen3.6-35b-a3b"], "qwen3.6-35b-a3b is a built-in config"),
                      ([tiny_moe / "config.json", "--recipe", "tiny"], "config.json is a local config.json")):
        code, _, err = pack(["inspect", *args, "--revision", "main"], capsys)
        assert code == 1 and "--revision main applies to" in error_line(err) and why in error_line(err)


@pytest.mark.parametrize("name, text, message", [
    ("tokenizer.json", "{broken", "tokenizer.json: malformed"),
    ("chat_template.jinja", "{% for m in messages %}{{ m.content }", "chat_template.jinja: syntax error"),
    ("generation_config.json", "[1, 2]", "generation_config.json"),
    ("generation_config.json", '{"temperature": "hot"}', "generation_config.json: temperature='hot' is not a number"),
    ("generation_config.json", '{"temperature": -1, "do_sample": true}', "generation_config.json: sampling"),
])
def test_checkpoint_resources_the_runtime_cannot_read(name, text, message, tiny_moe, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_moe, ck)
    (ck / name).write_text(text)
    code, _, err = pack(["quantize", ck, "--recipe", "tiny", "--out", tmp_path / "x.ninfer"], capsys)
    assert code == 1 and message in error_line(err)
    assert not (tmp_path / "x.ninfer").exists()


def test_a_weight_past_a_raw_formats_range_is_refused(tiny_moe, tmp_path, capsys):
    """f16 stores what it is given: a weight past its +-65504 would reach the model as inf. quantize names it, and
    verify against such a source fails that tensor (its JSON has no Infinity: the error is null where unbounded)."""
    from safetensors.torch import load_file, save_file

    ck = tmp_path / "ck"
    shutil.copytree(tiny_moe, ck)
    shard = next(p for p in sorted(ck.glob("*.safetensors")) if any(n.endswith("norm.weight") for n in load_file(p)))
    tensors = load_file(shard)
    name = next(n for n in tensors if n.endswith("norm.weight"))
    tensors[name][0] = 1e10
    save_file(tensors, shard, metadata={"format": "pt"})
    recipe = tmp_path / "f16.toml"
    recipe.write_text('name = "f16"\ndescription = "every tensor f16"\n[[rules]]\npattern = ".*"\nformat = "f16"\n')
    code, _, err = pack(["quantize", ck, "--recipe", recipe, "--out", tmp_path / "x.ninfer"], capsys)
    assert code == 1 and f"tensor {name}: weight row 0, column 0: " in error_line(err)
    assert "is outside f16 range" in error_line(err) and not (tmp_path / "x.ninfer").exists()
    art = tmp_path / "clean.ninfer"
    assert pack(["quantize", tiny_moe, "--recipe", recipe, "--out", art], capsys)[0] == 0
    code, out, _ = pack(["verify", art, "--source", ck, "--json"], capsys)
    failed = [t for t in json.loads(out)["tensors"] if not t["ok"]]
    assert code == 1 and [t["name"] for t in failed] == [name] and "is outside f16 range" in failed[0]["detail"]


def test_out_never_replaces_an_input(tiny_moe, tmp_path, capsys):
    """--overwrite replaces an earlier artifact, never the run's own inputs: a shard of the checkpoint (through a
    symlink too) or the recipe."""
    ck = tmp_path / "ck"
    shutil.copytree(tiny_moe, ck)
    shard = sorted(ck.glob("*.safetensors"))[0]
    recipe = tmp_path / "mine.toml"
    shutil.copy(Path(__file__).resolve().parents[1] / "recipes" / "tiny.toml", recipe)
    (tmp_path / "link").symlink_to(shard)
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (shard, recipe)}
    for out, what in ((shard, "a file of the source checkpoint"), (tmp_path / "link", "a file of the source "
                      "checkpoint"), (recipe, "the recipe")):
        code, _, err = pack(["quantize", ck, "--recipe", recipe, "--out", out, "--overwrite"], capsys)
        assert code == 1 and f"--out {out} is {what}: the artifact would replace its own input" in error_line(err)
    assert before == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (shard, recipe)}
    assert pack(["quantize", ck, "--recipe", recipe, "--out", ck / "beside.ninfer"], capsys)[0] == 0  # a new file


DEEP = "[" * 5000 + "]" * 5000  # past the JSON parser's recursion depth
HUGE = '{"a": 1' + "0" * 5000 + "}"  # past Python's 4,300-digit integer conversion


@pytest.mark.parametrize("name, text, message", [
    ("config.json", DEEP, "config.json: not valid JSON (nested too deeply)"),
    ("config.json", HUGE, "config.json: not valid JSON (an integer of more than 4300 digits)"),
    ("model.safetensors.index.json", DEEP, "model.safetensors.index.json: malformed index"),
    ("tokenizer_config.json", DEEP, "tokenizer_config.json: malformed JSON (nested too deeply)"),
    ("generation_config.json", HUGE, "generation_config.json: malformed JSON (an integer of more than 4300 digits)"),
], ids=["config-deep", "config-digits", "index-deep", "tokenizer-config-deep", "generation-config-digits"])
def test_json_past_the_parsers_limits(name, text, message, tiny_moe, tmp_path, capsys):
    """JSON that Python's parser refuses with a RecursionError or its integer limit (a traceback, before the third
    audit): one line naming the file, in our words."""
    ck = tmp_path / "ck"
    shutil.copytree(tiny_moe, ck)
    if name.endswith("index.json"):
        shard = next(ck.glob("*.safetensors"))
        shard.rename(ck / "model-00001-of-00001.safetensors")
    (ck / name).write_text(text)
    for args in (["quantize", ck, "--recipe", "tiny", "--out", tmp_path / "x.ninfer"], ["inspect", ck, "--recipe", "tiny"]):
        if args[0] == "inspect" and name != "config.json":
            continue
        code, _, err = pack(args, capsys)
        assert code == 1 and message in error_line(err) and "recursion" not in err, err
    assert not (tmp_path / "x.ninfer").exists()


def test_deep_recipe_and_numerics_report(packed, tiny_moe, tmp_path, capsys):
    recipe, report = tmp_path / "deep.toml", tmp_path / "deep.json"
    recipe.write_text('name = "x"\ndescription = "d"\nx = ' + "[" * 5000 + "]" * 5000 + "\n")
    report.write_text(DEEP)
    code, _, err = pack(["quantize", tiny_moe, "--recipe", recipe, "--out", tmp_path / "x.ninfer"], capsys)
    assert code == 1 and f"{recipe}: nested too deeply" in error_line(err)
    code, _, err = pack(["publish", packed, "--repo", "me/x", "--dry-run", tmp_path / "stage", "--base-model",
                         "Qwen/Qwen3.6-35B-A3B", "--numerics", report],
                        capsys)
    assert code == 1 and f"--numerics {report}: not a readable JSON report" in error_line(err)


def test_an_artifacts_deep_resource_at_run(packed, tmp_path, capsys):
    """A resource whose bytes were replaced (the default run does not hash them): one line naming it."""
    bad = tmp_path / "bad.ninfer"
    raw = bytearray(packed.read_bytes())
    with Artifact.open(packed) as art:
        r = art.resources["tokenizer_config.json"]
    k = r.nbytes // 2
    assert k > 1000  # deep enough to exceed the parser's recursion
    raw[r.offset:r.offset + r.nbytes] = b"[" * k + b"]" * k + b" " * (r.nbytes - 2 * k)
    bad.write_bytes(bytes(raw))
    code, out, err = rt(["run", bad, "--prompt", "hi", "--device", "cpu"], capsys)
    assert code == 1 and "tokenizer_config.json: malformed JSON (nested too deeply)" in error_line(err), err


def _resign(src, dst, edit) -> None:
    """Copy an artifact with its header JSON changed by edit(header) and its prefix checksum recomputed, so that
    only the meaning of the header is wrong."""
    raw = bytearray(src.read_bytes())
    with Artifact.open(src) as art:
        header = json.loads(json.dumps(art.header))
    edit(header)
    h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    assert PREFIX.size + len(h) <= header["payload_offset"]  # the payload stays where it is
    raw[:PREFIX.size] = PREFIX.pack(MAGIC, 1, 0, len(h), hashlib.sha256(h).digest())
    raw[PREFIX.size:header["payload_offset"]] = h + bytes(header["payload_offset"] - PREFIX.size - len(h))
    dst.write_bytes(bytes(raw))


def _tensor(header, suffix):
    return next(t for t in header["tensors"] if t["name"].endswith(suffix))


def _set_hidden(h):
    h["model"]["spec"]["hidden_size"] *= 2


def _bogus_params(h):
    _tensor(h, "conv1d.weight")["params"] = {"bogus": 1}


def _drop_embedding(h):
    h["tensors"] = [t for t in h["tensors"] if not t["name"].endswith("embed_tokens.weight")]


def _double_part(h):
    part = _tensor(h, "embed_tokens.weight")["parts"][0]
    part["shape"] = [2 * part["shape"][0], *part["shape"][1:]]


def _odd_group(h):
    _tensor(h, "A_log")["group"] = "weird"


@pytest.mark.parametrize("edit, message", [
    (_odd_group, r"A_log: group 'weird', the model implies 'text'"),
    (_set_hidden, r"embed_tokens\.weight: part_shapes \[\[\d+, 64\]\], the model implies \[\[\d+, 128\]\]"),
    (_bogus_params, r"conv1d\.weight: params \{'bogus': 1\}, the model implies \{\}"),
    (_drop_embedding, r"1 tensors of the text model are missing, first model\.language_model\.embed_tokens"),
    (_double_part, r"embed_tokens\.weight: part_shapes \[\[\d+, \d+\]\], the model implies"),
], ids=["group", "hidden", "params", "missing", "part-shape"])
def test_header_that_disagrees_with_its_model(edit, message, packed, tiny_moe, tmp_path, capsys):
    # oracle: the plan quantize makes from the model (layout.plan_tensors); verify and run both refuse
    bad = tmp_path / "bad.ninfer"
    _resign(packed, bad, edit)
    for args in (["verify", bad], ["verify", bad, "--source", tiny_moe]):
        code, _, err = pack(args, capsys)
        assert code == 1 and re.search(message, error_line(err)), err
    code, out, err = rt(["run", bad, "--prompt", "hi", "--device", "cpu"], capsys)
    assert code == 1 and out == "" and "Traceback" not in err and error_line(err)


def test_verify_passes_what_quantize_wrote(packed, capsys):
    code, out, err = pack(["verify", packed], capsys)
    assert code == 0 and "sound" in out + err


@pytest.mark.parametrize("license_", ["a\nb: c", "Apache 2.0", ""])
def test_publish_license_cannot_edit_the_card(license_, packed, tmp_path, capsys):
    code, _, err = pack(["publish", packed, "--repo", "me/x", "--base-model", "Qwen/Qwen3.6-35B-A3B",
                         "--license", license_, "--dry-run", tmp_path / "stage"], capsys)
    assert code == 1 and "is not a license id" in error_line(err)
    assert not (tmp_path / "stage").exists()


def test_publish_staging_failure_leaves_nothing(packed, tmp_path, capsys, monkeypatch):
    import ninfer_pack.publish as publish

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(publish.os, "link", no_space)
    monkeypatch.setattr(publish.shutil, "copyfile", no_space)
    stage = tmp_path / "stage"
    code, _, err = pack(["publish", packed, "--repo", "me/x", "--base-model", "Qwen/Qwen3.6-35B-A3B",
                         "--dry-run", stage], capsys)
    assert code == 1 and "cannot stage into" in error_line(err) and "No space left" in error_line(err)
    assert not stage.exists()  # staged in a temporary folder, renamed into place only when whole



def test_run_check_checksums_refuses_a_flipped_byte(packed, tmp_path, capsys):
    # without the option a payload byte is not read before use (as llama.cpp without --check-tensors)
    raw = bytearray(packed.read_bytes())
    with Artifact.open(packed) as art:
        e = next(iter(art.tensors.values()))
    raw[e.offset + e.nbytes // 2] ^= 0x01
    bad = tmp_path / "flipped.ninfer"
    bad.write_bytes(bytes(raw))
    args = ["run", bad, "--prompt", "hi", "--max-new-tokens", 2, "--device", "cpu"]
    code, out, err = rt(args + ["--check-checksums"], capsys)
    assert code == 1 and out == "" and f"checksum mismatch in {e.name} (1 in all)" in error_line(err)
    code, _, err = rt(["run", packed, "--prompt", "hi", "--max-new-tokens", 2, "--device", "cpu",
                       "--check-checksums"], capsys)
    assert code == 0 and err.startswith("prompt "), err  # no bar, nor the blank line one leaves, where no terminal


def test_click_abort_is_an_interrupt(tiny_moe, tmp_path, capsys, monkeypatch):
    # older click turns Ctrl-C into Abort before run_app sees it: the same exit 130 and cleanup as a KeyboardInterrupt
    import typer

    def abort():
        raise typer.Abort()

    _interrupt_at(monkeypatch, 5, abort)
    code, _, err = pack(["quantize", tiny_moe, "--recipe", "tiny", "--out", tmp_path / "x.ninfer"], capsys)
    assert code == 130 and "interrupted" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_nohup_ignore_is_kept(tiny_moe, tmp_path, capsys, monkeypatch):
    # a job under nohup (SIGHUP ignored) keeps ignoring it; SIGTERM is still turned into a clean exit
    from ninfer_rt import console

    seen = {}
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        _interrupt_at(monkeypatch, 5, lambda: seen.update(hup=signal.getsignal(signal.SIGHUP),
                                                          term=signal.getsignal(signal.SIGTERM)))
        code, _, err = pack(["quantize", tiny_moe, "--recipe", "tiny", "--out", tmp_path / "x.ninfer"], capsys)
        assert code == 0, err
        assert seen == {"hup": signal.SIG_IGN, "term": console._terminate}
    finally:
        signal.signal(signal.SIGHUP, old)


def test_sigterm_is_not_swallowed_by_except_exception(tiny_moe, tmp_path, capsys, monkeypatch):
    # code on the way up that catches Exception (a template render, a tokenizer) must not turn SIGTERM into a
    # user error or swallow it
    def swallowing():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):
                time.sleep(0.01)  # the handler runs here
        except Exception:
            pass

    _interrupt_at(monkeypatch, 5, swallowing)
    code, _, err = pack(["quantize", tiny_moe, "--recipe", "tiny", "--out", tmp_path / "x.ninfer"], capsys)
    assert code == 143 and "terminated" in err
    assert list(tmp_path.iterdir()) == []


def test_os_error_without_strerror_keeps_its_message(packed, capsys, monkeypatch):
    import ninfer_rt.format as fmt

    def broken(*a, **k):
        raise OSError("the mapping failed")

    monkeypatch.setattr(fmt.Artifact, "open", broken)
    code, _, err = rt(["info", packed], capsys)
    assert code == 1 and error_line(err) == "error: the mapping failed"


@pytest.mark.parametrize("case", ["empty_source", "recipe_dir", "text_dir", "calibrate_out_dir", "key_file_missing", "cors_path",
                                  "jobs_zero", "inspect_dir", "inspect_unknown_name"])
def test_second_audit_messages(case, packed, tiny_moe, tmp_path, capsys):
    """The 2026-12-06 audit's misleading lines: each bad option now gets a line that names it and what it takes
    (and a non-zero exit, before any work)."""
    folder, text = tmp_path / "adir", tmp_path / "t.txt"
    folder.mkdir()
    text.write_text("Some text to calibrate on. " * 20, encoding="utf-8")
    runs = {
        "empty_source": (pack, ["quantize", "", "--recipe", "tiny", "--out", tmp_path / "x.ninfer"],
                         "SOURCE is empty: give a checkpoint directory"),
        "recipe_dir": (pack, ["quantize", tiny_moe, "--recipe", folder, "--out", tmp_path / "x.ninfer"],
                       f"recipe {folder} is not a regular file"),
        "text_dir": (pack, ["verify", packed, "--source", tiny_moe, "--numerics", "--text", folder],
                     f"{folder} is a directory; --text takes UTF-8 text files"),
        "calibrate_out_dir": (pack, ["calibrate", tiny_moe, "--text", text, "--out", folder],
                              "--out takes a file path such as importance.safetensors"),
        "key_file_missing": (rt, ["serve", packed, "--device", "cpu", "--port", "0", "--api-key-file",
                                  tmp_path / "nope"], f"--api-key-file {tmp_path / 'nope'}: No such file"),
        "cors_path": (rt, ["serve", packed, "--device", "cpu", "--port", "0", "--cors-origin",
                           "https://app.example.com/page"], "--cors-origin 'https://app.example.com/page': give *"),
        "jobs_zero": (rt, ["build-kernels", "--jobs", "0"], "--jobs must be >= 1, got 0"),
        "inspect_dir": (pack, ["inspect", folder], "is a directory: to plan a checkpoint, add --recipe NAME"),
        "inspect_unknown_name": (pack, ["inspect", "qwen9", "--recipe", "tiny"],
                                 "(nor a built-in config: qwen3.6-27b, qwen3.6-35b-a3b"),
    }
    call, args, want = runs[case]
    code, _, err = call(args, capsys)
    assert code == 1 and want in error_line(err), err


def test_cors_origins_as_browsers_send_them():
    from ninfer_rt.errors import NinferError
    from ninfer_rt.serve.server import check_cors_origin

    for ok, want in (("*", "*"), ("https://App.Example.com", "https://app.example.com"),
                     ("http://localhost:5173", "http://localhost:5173"), ("http://[::1]:8000", "http://[::1]:8000")):
        assert check_cors_origin(ok) == want
    for bad in ("not a url", "https://a.com/", "ftp://a.com", "https://", "https://a.com:123456", "*.example.com"):
        with pytest.raises(NinferError, match="--cors-origin"):
            check_cors_origin(bad)


@pytest.mark.parametrize("argv", [["rt", "info", ""], ["rt", "run", "", "--prompt", "hi"], ["rt", "serve", ""],
                                  ["rt", "bench", ""], ["pack", "inspect", ""], ["pack", "verify", ""],
                                  ["pack", "publish", "", "--repo", "me/model"]])
def test_an_empty_artifact_path_is_named_as_empty(argv, capsys):
    """"" is not the current folder ('not a file: .', as a Path argument read it): every command says it is empty."""
    main, prog = (rt_cli.main, "ninfer-rt") if argv[0] == "rt" else (pack_cli.main, "ninfer-pack")
    code, _, err = run_main(main, prog, argv[1:], capsys)
    assert code == 1 and error_line(err) == "error: the artifact path is empty"
