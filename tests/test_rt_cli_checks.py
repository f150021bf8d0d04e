"""ninfer-rt's start-up checks. bench: bad options and a bad --json are one line before the GPU is opened
(run_bench, which opens it, is replaced by a recorder), and the JSON is written atomically. serve: refuses what
run refuses (no tokenizer, a context no prompt fits) and prints an IPv6 address as a URL writes it.
Oracles: the recorder's calls, the folder's listing, json.loads of the file against the result written, run's
own error on the same file, urllib (parse and fetch the printed URL), the tokenizer (a one-token prompt)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import socket
import threading
import urllib.request
from dataclasses import asdict
from urllib.parse import urlsplit

import pytest

from cli_runner import error_line, run_main
from ninfer_rt import cli
from ninfer_rt.format import MAGIC, PREFIX, Artifact
from ninfer_rt.gpu import bench
from ninfer_rt.serve import Server
from ninfer_rt.tokenizer import Tokenizer


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny tensors only (see conftest.one_thread)."""


def rt(args, capsys):
    return run_main(cli.main, "ninfer-rt", args, capsys)


RESULT = bench.BenchResult("tiny", "FakeGPU", "tiny", "int8", 1000.0, 123, 0.5, 456, 8192,
                           prefill=[{"tokens": 512, "seconds": 0.1, "tok_s": 5120.0, "cold_seconds": 0.2}])


@pytest.fixture
def gpu_work(monkeypatch):
    """run_bench (where the GPU is opened) replaced: records its keyword arguments and returns RESULT."""
    calls = []

    def fake(**kw):
        calls.append(kw)
        return RESULT

    monkeypatch.setattr(bench, "run_bench", fake)
    return calls


def listing(folder):
    return sorted((p.name, p.read_bytes() if p.is_file() else None) for p in folder.iterdir())


# ----------------------------------------------------------------------------------------------- bench


@pytest.mark.parametrize("kind, message", [
    ("directory", "is a directory; --json takes a file path such as bench.json"),
    ("no-folder", "output directory does not exist"),
    ("exists", "exists; pass --overwrite to replace it"),
])
def test_bench_bad_json_is_refused_before_the_gpu(packed, tmp_path, capsys, gpu_work, kind, message):
    (tmp_path / "sub").mkdir()
    (tmp_path / "old.json").write_text("keep me")
    target = {"directory": tmp_path / "sub", "no-folder": tmp_path / "none" / "b.json",
              "exists": tmp_path / "old.json"}[kind]
    before = listing(tmp_path)
    code, out, err = rt(["bench", packed, "--json", target], capsys)
    assert code == 1 and out == "" and message in error_line(err)
    assert gpu_work == [] and listing(tmp_path) == before  # no temp file, no folder made, the old file kept


def test_bench_json_is_written_and_replaced_only_with_overwrite(packed, tmp_path, capsys, gpu_work):
    target = tmp_path / "b.json"
    code, out, err = rt(["bench", packed, "--json", target], capsys)
    assert code == 0, err
    assert json.loads(target.read_text()) == asdict(RESULT) and os.listdir(tmp_path) == ["b.json"]
    target.write_text("old")
    code, _, err = rt(["bench", packed, "--json", target], capsys)
    assert code == 1 and "pass --overwrite" in error_line(err) and len(gpu_work) == 1
    code, _, err = rt(["bench", packed, "--json", target, "--overwrite"], capsys)
    assert code == 0, err
    assert json.loads(target.read_text()) == asdict(RESULT) and os.listdir(tmp_path) == ["b.json"]


def test_bench_json_write_failure_leaves_the_old_file(packed, tmp_path, capsys, gpu_work, monkeypatch):
    target = tmp_path / "b.json"
    target.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    code, _, err = rt(["bench", packed, "--json", target, "--overwrite"], capsys)
    assert code == 1 and "No space left on device" in error_line(err)
    assert listing(tmp_path) == [("b.json", b"old")]  # the temporary file is gone


def test_bench_json_folder_gone_during_the_run_is_not_recreated(packed, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "out"
    folder.mkdir()

    def run_then_remove(**kw):
        folder.rmdir()
        return RESULT

    monkeypatch.setattr(bench, "run_bench", run_then_remove)
    code, _, err = rt(["bench", packed, "--json", folder / "b.json"], capsys)
    assert code == 1 and f"output directory does not exist: {folder}" in error_line(err)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args, message", [
    (["--prefill-budget", "-1"], "--prefill-budget must be a number of seconds >= 0, got -1.0"),
    (["--prefill-budget", "nan"], "--prefill-budget must be a number of seconds >= 0, got nan"),
    (["--kv-cache", "fp8"], "kv cache dtype 'fp8': choose int8 or bf16"),
    (["--prefill", "0"], "--prefill: prompt lengths must be >= 1"),
    (["--prefill", "512,x"], "--prefill: expected comma-separated integers"),
    (["--decode-context", "-5"], "--decode-context: values must be >= 0"),
    (["--prefill", "", "--decode-context", ""], "nothing to time"),
    (["--decode-tokens", "2", "--decode-context", ""], "at each --decode-context: give one"),
    (["--decode-batch", "1"], "--decode-batch: sequence counts must be >= 2"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1, got 0"),
])
def test_bench_bad_options_are_one_line_before_the_gpu(packed, tmp_path, capsys, gpu_work, args, message):
    code, out, err = rt(["bench", packed, *args, "--json", tmp_path / "b.json"], capsys)
    assert code == 1 and out == "" and message in error_line(err)
    assert gpu_work == [] and os.listdir(tmp_path) == []


@pytest.mark.parametrize("args, want", [
    (["--prefill-budget", "0"], {"prefill_budget_s": 0.0}),
    (["--prefill-budget", "inf"], {"prefill_budget_s": float("inf")}),  # no budget: every size runs
    (["--prefill", "", "--decode-context", "0,7"], {"prefill_sizes": (), "decode_contexts": (0, 7)}),
    (["--prefill", "5", "--decode-context", ""], {"prefill_sizes": (5,), "decode_contexts": ()}),
    (["--kv-cache", "bf16"], {"kv_dtype": "bf16"}),
])
def test_bench_good_options_reach_the_gpu(packed, capsys, gpu_work, args, want):
    code, _, err = rt(["bench", packed, *args], capsys)
    assert code == 0, err
    assert len(gpu_work) == 1 and {k: gpu_work[0][k] for k in want} == want


# ----------------------------------------------------------------------------------------------- serve


@pytest.fixture
def no_serving(monkeypatch):
    """Server.serve_forever replaced: records the bound address and closes the socket (returns at once)."""
    seen = []

    def fake(self):
        seen.append(self.address)
        self.httpd.server_close()

    monkeypatch.setattr(Server, "serve_forever", fake)
    return seen


def _drop_resource(src, dst, name):
    """Copy an artifact without resource `name` in its header, the header re-hashed (as test_artifact's
    _rewrite_header does): only the missing resource is wrong."""
    raw = bytearray(src.read_bytes())
    with Artifact.open(src) as art:
        header = json.loads(json.dumps(art.header))
    header["resources"] = [r for r in header["resources"] if r["name"] != name]
    h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    _m, version, flags, _n, _h = PREFIX.unpack(raw[:PREFIX.size])
    raw[:PREFIX.size] = PREFIX.pack(MAGIC, version, flags, len(h), hashlib.sha256(h).digest())
    raw[PREFIX.size:header["payload_offset"]] = h + bytes(header["payload_offset"] - PREFIX.size - len(h))
    dst.write_bytes(bytes(raw))
    return dst


def test_serve_without_a_tokenizer_fails_at_start_up_as_run_does(packed, tmp_path, capsys, no_serving):
    bad = _drop_resource(packed, tmp_path / "notok.ninfer", "tokenizer.json")
    with Artifact.open(bad) as art:
        assert "tokenizer.json" not in art.resources and "chat_template.jinja" in art.resources
    code, _, err = rt(["run", bad, "--prompt", "Hi", "--device", "cpu"], capsys)
    assert code == 1
    said_by_run = error_line(err)
    code, out, err = rt(["serve", bad, "--device", "cpu", "--port", 0], capsys)
    assert code == 1 and out == "" and error_line(err) == said_by_run
    assert "tokenizer.json: missing" in said_by_run and no_serving == [] and "serving" not in err


def _can_bind(host):
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_serve_prints_a_url_that_reaches_it(packed, capsys, monkeypatch, host):
    if not _can_bind(host):
        pytest.skip(f"cannot bind {host} here")
    fetched = []

    def fetch_printed_url(self):
        url = re.search(r"serving \S+ on (http://\S+) \(", capsys.readouterr().err)[1]
        thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        thread.start()
        try:
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy for loopback
            with opener.open(url + "/v1/models", timeout=30) as reply:
                fetched.append((url, self.address[1], json.loads(reply.read())))
        finally:
            self.httpd.shutdown()
            self.httpd.server_close()

    monkeypatch.setattr(Server, "serve_forever", fetch_printed_url)
    code, _, err = rt(["serve", packed, "--device", "cpu", "--host", host, "--port", 0], capsys)
    assert code == 0, err
    [(url, port, models)] = fetched
    assert urlsplit(url).hostname == host and urlsplit(url).port == port
    assert [m["id"] for m in models["data"]] == [packed.name.removesuffix(".ninfer")]


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize("context", [1, 0, -3])
def test_a_context_no_prompt_fits_is_refused_before_loading(packed, capsys, monkeypatch, command, context):
    loads = []
    monkeypatch.setattr("ninfer_rt.api.load", lambda *a, **k: loads.append(a))
    args = ["--prompt", "Hi"] if command == "run" else ["--port", 0]
    code, out, err = rt([command, packed, "--device", "cpu", "--max-context", context, *args], capsys)
    assert code == 1 and out == "" and loads == []
    assert error_line(err) == (f"error: --max-context must be >= 2 (a one-token prompt and one generated token), "
                               f"got {context}")


def test_two_positions_hold_a_one_token_prompt_and_its_token(packed, tiny_moe, capsys, no_serving):
    # the bound is tight: an empty prompt is refused, and 2 positions generate one token after a 1-token prompt
    tok = Tokenizer.from_resources({p.name: p.read_bytes() for p in tiny_moe.iterdir() if p.suffix == ".json"})
    prompt = next(w for w in ("a", "x", "The", "Hi", " ") if len(tok.encode(w)) == 1)
    code, _, err = rt(["run", packed, "--prompt", "", "--device", "cpu"], capsys)
    assert code == 1 and "prompt is empty" in error_line(err)
    code, out, err = rt(["run", packed, "--prompt", prompt, "--device", "cpu", "--max-context", 2, "--greedy"],
                        capsys)
    assert code == 0, err
    assert re.search(r"prompt 1 tokens, .*generated 1 tokens", err), err
    code, _, err = rt(["serve", packed, "--device", "cpu", "--max-context", 2, "--port", 0], capsys)
    assert code == 0 and len(no_serving) == 1 and "context 2," in err, err


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "sampling temperature=-1.0: must be finite and >= 0"),
    (["--prompt", ""], "prompt is empty"),  # the last --prompt wins
    (["--top-p", "0"], "top_p"),
    (["--seed", "-1"], "seed"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
])
def test_run_options_are_checked_before_loading(packed, capsys, monkeypatch, args, message):
    """A typo costs no loading (minutes for a 35B artifact): refused before load is called."""
    loads = []
    monkeypatch.setattr("ninfer_rt.api.load", lambda *a, **k: loads.append(a))
    code, out, err = rt(["run", packed, "--device", "cpu", "--prompt", "Hi", *args], capsys)
    assert code == 1 and out == "" and loads == [] and message in error_line(err), err


def test_a_drawn_seed_is_printed_and_repeats_the_run(packed, capsys):
    """Without --seed a sampled run prints the seed it drew (as llama.cpp does); --seed with it gives the same text.
    A greedy run prints none."""
    base = ["run", packed, "--device", "cpu", "--prompt", "Hi", "--max-new-tokens", 12, "--temperature", 0.9]
    code, first, err = rt(base, capsys)
    seed = re.search(r"; seed (\d+)$", err.strip())
    assert code == 0 and seed, err
    code, again, _ = rt([*base, "--seed", seed.group(1)], capsys)
    assert code == 0 and again == first
    code, _, err = rt(["run", packed, "--device", "cpu", "--prompt", "Hi", "--max-new-tokens", 2, "--greedy"], capsys)
    assert code == 0 and "seed" not in err


def test_a_context_past_the_models_is_noted(packed, capsys):
    with Artifact.open(packed) as art:
        positions = art.spec.max_position_embeddings
    code, _, err = rt(["run", packed, "--device", "cpu", "--prompt", "Hi", "--max-new-tokens", 1,
                       "--max-context", positions + 5], capsys)
    assert code == 0 and (f"note: --max-context {positions + 5} is past the model's {positions} positions: "
                          f"sequences hold {positions}") in err.replace("\n", " "), err
