"""ninfer-rt end to end on the built-in tiny MoE (tiny recipe, every weight format): run, info, bad inputs."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from cli_runner import error_line, run_main
from ninfer_rt import cli
from ninfer_rt.api import gpu_available
from ninfer_rt.chat import ChatTemplate
from ninfer_rt.format import Artifact
from ninfer_rt.tokenizer import Tokenizer

PROMPT = "The assistant reads the question"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here works on tiny tensors (see conftest.one_thread)."""


def run(args, capsys):
    """`ninfer-rt ARGS` in-process; returns (exit code, stdout, stderr)."""
    return run_main(cli.main, "ninfer-rt", args, capsys)


def prompt_tokens(err: str) -> int:
    m = re.search(r"prompt (\d+) tokens", err)
    assert m, err
    return int(m[1])


@pytest.fixture(scope="module")
def files(tiny_moe):
    """The checkpoint's tokenizer and template files: the oracle for how many tokens a prompt is."""
    return {p.name: p.read_bytes() for p in tiny_moe.iterdir() if p.suffix in (".json", ".jinja")}


def api_text(packed, max_new_tokens, seed, **request) -> str:
    """What the library generates for the request, with the checkpoint's sampling defaults and this seed: the
    text `run` must print (then a newline; special tokens left out, as run leaves them)."""
    from ninfer_rt import load
    from ninfer_rt.sampling import requested_sampling

    with load(packed) as m:
        params = requested_sampling(m.generation_config, seed=seed)
        return "".join(m.generate(max_new_tokens=max_new_tokens, sampling=params, skip_special_tokens=True, **request))


def test_run_plain(packed, files, capsys):
    code, out, err = run(["run", packed, "--prompt", PROMPT, "--max-new-tokens", 12, "--seed", 1], capsys)
    assert code == 0, err
    assert out == api_text(packed, 12, 1, prompt=PROMPT) + "\n"
    assert prompt_tokens(err) == len(Tokenizer.from_resources(files).encode(PROMPT))
    assert re.search(r"generated \d+ tokens, decode [\d.]+ tok/s", err) and "prefill" in err and "load" in err


@pytest.mark.parametrize("no_think", [False, True], ids=["think", "no-think"])
def test_run_chat(packed, files, capsys, no_think):
    args = ["run", packed, "--prompt", PROMPT, "--chat", "--max-new-tokens", 8, "--seed", 2]
    code, out, err = run(args + (["--no-think"] if no_think else []), capsys)
    assert code == 0, err
    assert "tok/s" in err
    assert out == api_text(packed, 8, 2, messages=[{"role": "user", "content": PROMPT}],
                           enable_thinking=False if no_think else None) + "\n"
    text = ChatTemplate.from_resources(files).render([{"role": "user", "content": PROMPT}],
                                                     add_generation_prompt=True,
                                                     enable_thinking=False if no_think else None)
    assert text.endswith("</think>\n\n" if no_think else "<think>\n")
    assert prompt_tokens(err) == len(Tokenizer.from_resources(files).encode(text))


def test_greedy_and_seeded_runs_repeat(packed, capsys):
    greedy = ["run", packed, "--prompt", PROMPT, "--max-new-tokens", 10, "--greedy"]
    first, second = run(greedy, capsys), run(greedy, capsys)
    assert first[0] == second[0] == 0 and first[1] == second[1] and first[1].strip()
    # the stream on stdout is exactly what the API generates for the same request
    from ninfer_rt import load
    from ninfer_rt.sampling import SamplingParams

    with load(packed) as m:
        expected = "".join(m.generate(PROMPT, max_new_tokens=10, sampling=SamplingParams(greedy=True),
                                      skip_special_tokens=True))  # run leaves them out
    assert first[1] == expected + "\n"
    seeded = ["run", packed, "--prompt", PROMPT, "--max-new-tokens", 10, "--temperature", 1.3, "--seed"]
    a, b, c = run(seeded + [5], capsys), run(seeded + [5], capsys), run(seeded + [6], capsys)
    assert a[0] == b[0] == c[0] == 0 and a[1] == b[1] != c[1]


def test_info(packed, capsys):
    code, out, err = run(["info", packed], capsys)
    assert code == 0, err
    rows = {m[1]: m[2] for m in re.finditer(r"^\W*(\w[\w ]*?)\s+\W\s(.+?)\s+\W$", out, re.M)}
    with Artifact.open(packed) as art:  # the widths as the shared expert's own tensor has them
        shared = next(t.parts[0]["shape"][1] for t in art.tensors.values()
                      if t.name.endswith("shared_expert.down_proj.weight"))  # [hidden, shared width]
        routed = art.spec.moe_intermediate_size
    assert shared != routed  # the tiny MoE's widths differ, so the row tells them apart
    want = {"family": "qwen3_5_moe", "layers": "8 (6 Gated DeltaNet, 2 attention)", "hidden": "64",
            "experts": f"8 routed (dim {routed}), top-2, + 1 shared (dim {shared})",
            "vocab": "500 (497 in the tokenizer)",
            "context": "4,096", "recipe": "tiny"}
    assert {k: rows.get(k) for k in want} == want, out
    assert rows["size"].endswith("MiB of weights)"), out


def test_a_stdout_that_cannot_encode_the_text_shows_question_marks(packed):
    """PYTHONIOENCODING=ascii (a C locale): the text's other characters print as "?" instead of a traceback."""
    import os
    import subprocess
    import sys

    args = [sys.executable, "-m", "ninfer_rt", "run", str(packed), "--prompt", PROMPT, "--device", "cpu",
            "--greedy", "--max-new-tokens", "24"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    utf8 = subprocess.run(args, env={**env, "PYTHONIOENCODING": "utf-8"}, capture_output=True, timeout=300)
    ascii_ = subprocess.run(args, env={**env, "PYTHONIOENCODING": "ascii"}, capture_output=True, timeout=300)
    text = utf8.stdout.decode("utf-8")
    assert utf8.returncode == 0 and not text.isascii(), (utf8.stderr, text)  # the random model's text is not ASCII
    assert ascii_.returncode == 0, ascii_.stderr
    assert ascii_.stdout.decode("ascii") == text.encode("ascii", "replace").decode("ascii")


def test_info_prints_names_as_written(packed, tmp_path, capsys):
    """A path is text, not rich markup: `[/red]` raised a MarkupError, `[b]` vanished, `:smile:` became an emoji."""
    where = tmp_path / "d[/red]"  # a folder "d[" holding "red]"
    where.mkdir(parents=True)
    path = where / "m[b]:smile:.ninfer"
    path.write_bytes(packed.read_bytes())
    code, out, err = run(["info", path], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert "m[b]:smile:.ninfer" in out.replace("\n", "").replace(" ", ""), out


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_clear_line(packed, capsys):
    code, out, err = run(["run", packed, "--prompt", PROMPT, "--device", "cuda"], capsys)
    line = error_line(err)
    assert code == 1 and out == "" and line.startswith("error: ") and "cuda" in line.lower()


@pytest.mark.parametrize("kind", ["missing", "foreign", "truncated"])
def test_bad_files(packed, tmp_path, capsys, kind):
    path = tmp_path / "bad.ninfer"
    if kind == "foreign":
        path.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 4)
    elif kind == "truncated":
        path.write_bytes(packed.read_bytes()[:100_000])
    want = {"missing": "no such file", "foreign": "not a ninfer artifact", "truncated": "truncated"}[kind]
    for args in (["run", path, "--prompt", PROMPT], ["info", path]):
        code, out, err = run(args, capsys)
        assert code == 1 and want in error_line(err)


def test_bad_options(packed, capsys):
    code, _, err = run(["run", packed, "--prompt", PROMPT, "--top-p", 2], capsys)
    assert code == 1 and "top_p" in error_line(err)
    code, _, err = run(["run", packed, "--prompt", PROMPT, "--no-think"], capsys)
    assert code == 1 and "--chat" in error_line(err)
    code, _, err = run(["run", packed, "--prompt", PROMPT, "--max-new-tokens", 0], capsys)
    assert code == 1 and "--max-new-tokens must be >= 1, got 0" in error_line(err)


@pytest.mark.parametrize("args, code, message", [
    (["--seed", -1], 1, r"seed=-1: must be an integer in \[0, 2\^64\)"),
    (["--seed", 2**64], 1, "seed="),
    (["--kv-cache", "fp8", "--device", "cpu"], 1, "kv cache dtype 'fp8': choose int8 or bf16"),
    (["--max-context", 0, "--device", "cpu"], 1, r"--max-context must be >= 2 \(a one-token prompt and one "
                                                  r"generated token\), got 0"),
    (["--max-new-tokens", "many"], 2, r"Invalid value for '--max-new-tokens'.*\(see --help\)"),
    (["--no-such-option"], 2, r"No such option: --no-such-option.*\(see --help\)"),
])
def test_bad_option_values_are_one_line(packed, capsys, args, code, message):
    # cache options are checked on every device, before any weight is read; usage errors exit 2 as click's do
    got, out, err = run(["run", packed, "--prompt", PROMPT, *args], capsys)
    assert got == code and out == "" and re.search(message, error_line(err)), err


def test_usage_errors_are_one_line(capsys):
    code, _, err = run(["no-such-command"], capsys)
    assert code == 2 and "No such command 'no-such-command'" in error_line(err)
    code, _, err = run(["run"], capsys)
    assert code == 2 and "Missing argument" in error_line(err)


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"ok \xed\xa0\x80"], ids=["not-utf8", "surrogate"])
@pytest.mark.parametrize("chat", [False, True], ids=["raw", "chat"])
def test_prompt_that_is_not_utf8(packed, capsys, raw, chat):
    # what a shell hands Python for bytes that are not UTF-8: lone surrogates (surrogateescape)
    prompt = raw.decode("utf-8", "surrogateescape")
    code, out, err = run(["run", packed, "--prompt", prompt, *(["--chat"] if chat else [])], capsys)
    assert code == 1 and out == "" and "text is not valid UTF-8" in error_line(err)


def test_name_too_long_is_one_line(tmp_path, capsys):
    code, _, err = run(["info", tmp_path / ("n" * 300 + ".ninfer")], capsys)
    assert code == 1 and "File name too long" in error_line(err)


def test_only_sampling_options_turn_a_greedy_config_into_sampling():
    # a do_sample-false generation_config (greedy by default, as in HF)
    model = SimpleNamespace(generation_config={"do_sample": False, "temperature": 0.6, "top_k": 20, "top_p": 0.95})
    names = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "seed")

    def params(greedy=False, **given):
        return cli._sampling(model.generation_config, greedy, {k: given.get(k) for k in names})

    assert params().is_greedy
    # penalties apply under greedy decoding too (HF's logits processors), and a seed is moot there
    p = params(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25, seed=3)
    assert p.is_greedy and (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.seed) == (1.3, 0.5, 0.25, 3)
    for name, value in (("temperature", 0.7), ("top_p", 0.9), ("top_k", 5), ("min_p", 0.1)):
        assert not params(**{name: value}).is_greedy, name
        assert params(greedy=True, **{name: value}).is_greedy, name
    # a do_sample-true config keeps sampling when only a penalty is given
    model.generation_config["do_sample"] = True
    assert not params(repetition_penalty=1.3).is_greedy


@pytest.mark.parametrize("option, field", [("--repetition-penalty", "repetition_penalty"),
                                           ("--frequency-penalty", "frequency_penalty")])
def test_greedy_run_with_a_penalty_is_the_penalised_argmax(packed, capsys, option, field):
    value = 1.5 if field == "repetition_penalty" else 2.0
    args = ["run", packed, "--prompt", PROMPT, "--max-new-tokens", 10, "--greedy", option, value]
    code, out, err = run(args, capsys)
    assert code == 0, err
    from ninfer_rt import load
    from ninfer_rt.sampling import SamplingParams

    with load(packed) as m:
        want = "".join(m.generate(PROMPT, max_new_tokens=10, sampling=SamplingParams(greedy=True, **{field: value}),
                                  skip_special_tokens=True))
        plain = "".join(m.generate(PROMPT, max_new_tokens=10, sampling=SamplingParams(greedy=True),
                                   skip_special_tokens=True))
    assert out == want + "\n" and want != plain


def test_cpu_reference_too_large_for_ram_is_one_line(packed, capsys, monkeypatch):
    """The CPU reference decodes every text weight to fp32: where that exceeds the free RAM, run says so in one
    line (the size summed from the artifact's own tensor table) before decoding anything."""
    import math

    from ninfer_rt import api
    from ninfer_rt.format import Artifact

    with Artifact.open(packed) as art:
        need = 4 * sum(math.prod(s) for e in art.tensors.values() if e.group == "text" for s in e.plan().part_shapes)
    monkeypatch.setattr(api, "available_memory", lambda: 1000)
    monkeypatch.setattr("ninfer_rt.reference.backend.ReferenceBackend", lambda *a, **k: pytest.fail("decoded"))
    code, out, err = run(["run", packed, "--prompt", PROMPT, "--device", "cpu"], capsys)
    assert code == 1 and out == ""
    assert error_line(err) == (f"error: the CPU reference holds the model in fp32 (run it on a GPU: --device cuda): "
                               f"needs ~{need / 1e9:.3g} GB, 1e-06 GB available")
