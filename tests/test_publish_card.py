"""The model card says what verify and inspect say: a `verify --numerics --json` report is published as verify
wrote it (its nulls shown as n/a), a hand-edited NaN or Infinity is refused in one line, and the size table's
total row is the sum of its class rows, the weights as `inspect` counts them."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from cli_runner import error_line, run_main
from ninfer_pack import cli as pack_cli

BASE = ["--repo", "me/tiny", "--base-model", "Qwen/Qwen3.6-35B-A3B"]
# the figures of the card's quality table
FIGURES = ("kld_mean", "kld_mean_stderr", "kld_p99", "kld_p999", "same_top", "rms_dp", "ppl_ratio")
TOTAL_ROW = re.compile(r"^\| \*\*total\*\* \| (\d+) \| ([\d,]+) \| \| ([\d.]+) \| ([\d.]+) \|$", re.M)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here works on tiny tensors (see conftest.one_thread)."""


def pack(args, capsys):
    return run_main(pack_cli.main, "ninfer-pack", args, capsys)


def _verify_json(packed, source, capsys, *options) -> tuple[str, dict]:
    """verify's own `--numerics --json` output for `packed`: (its text, its numerics object)."""
    code, o, e = pack(["verify", packed, "--source", source, "--numerics", *options, "--json"], capsys)
    assert code == 0, e
    return o, json.loads(o)["numerics"]


@pytest.fixture
def one_position_report(packed, tiny_moe, tmp_path, capsys):
    """verify's report for one 4-token window: a single scored position, whose KLD standard error is undefined."""
    text = tmp_path / "small.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n", encoding="utf-8")
    return _verify_json(packed, tiny_moe, capsys, "--text", text, "--window", 4, "--max-tokens", 4)


def _publish_card(packed, report_text, folder, capsys):
    """Stage `packed` with a numerics report of that text; returns (exit code, stderr, the card or None)."""
    report = folder.parent / f"{folder.name}.json"
    report.write_text(report_text, encoding="utf-8")
    code, _, e = pack(["publish", packed, *BASE, "--dry-run", folder, "--numerics", report], capsys)
    card = (folder / "README.md").read_text(encoding="utf-8") if code == 0 else None
    return code, e, card


def _quality_row(card: str) -> str:
    """The figures row of the card's quality table (the line after its |---:| rule)."""
    lines = card[card.index("## Quality"):].splitlines()
    return lines[lines.index("|---:|---:|---:|---:|---:|---:|") + 1]


# ---------------------------------------------------------------------------------------------------------
# 1. Numerics: null where verify writes it is taken (and shown as n/a); NaN and Infinity, never written, are not.

def test_report_verify_wrote_with_a_null_is_published(packed, one_position_report, tmp_path, capsys):
    text, num = one_position_report
    assert num["scored"] == 1 and num["kld_mean_stderr"] is None  # verify itself writes the null
    code, e, card = _publish_card(packed, text, tmp_path / "stage", capsys)
    assert code == 0, e
    row = _quality_row(card)
    assert row == (f"| {num['kld_mean']:.6f} ± n/a | {num['kld_p99']:.6f} | {num['kld_p999']:.6f} | "
                   f"{100 * num['same_top']:.2f}% | {100 * num['rms_dp']:.3f}% | {num['ppl_ratio']:.4f} |")
    assert not re.search(r"\b(None|nan|inf)\b", card[card.index("## Quality"):card.index("## Run")])


def _nan_logits_report(num: dict) -> dict:
    """`num` with the statistics verify computes when the artifact's logits hold a NaN (a scale decoded to inf,
    say), written by NumericsReport.to_dict as verify writes it: the independent word on which figures can be
    null."""
    from ninfer_pack.numerics import NumericsReport, summarize_tokens, token_stats

    src = torch.randn(3, 16)
    art = src.clone()
    art[1, 0] = float("nan")
    stats = summarize_tokens(token_stats(src, art, torch.tensor([1, 2, 3])))
    return NumericsReport(**{**num, **stats}).to_dict()


def test_every_null_verify_can_write_is_published_as_na(packed, one_position_report, tmp_path, capsys):
    _, num = one_position_report
    report = _nan_logits_report(num)
    nulls = {k for k in FIGURES if report[k] is None}
    assert nulls == set(FIGURES) - {"same_top"} and math.isfinite(report["same_top"])  # a mean of 0/1: never null
    code, e, card = _publish_card(packed, json.dumps({"numerics": report}), tmp_path / "stage", capsys)
    assert code == 0, e
    assert _quality_row(card) == f"| n/a ± n/a | n/a | n/a | {100 * report['same_top']:.2f}% | n/a | n/a |"


def test_hand_edited_non_finite_values_are_refused(packed, tiny_moe, tmp_path, capsys, monkeypatch):
    """json.loads reads NaN, Infinity and an overflowing 1e999; verify writes none of them (nor null where a
    figure is always finite): each is refused in one line, before any hashing or staging."""
    import ninfer_pack.publish as publish

    text, num = _verify_json(packed, tiny_moe, capsys)  # the built-in prompts: every figure finite
    assert all(isinstance(num[k], (int, float)) and math.isfinite(num[k]) for k in FIGURES)
    code, e, _ = _publish_card(packed, text, tmp_path / "control", capsys)
    assert code == 0, e  # the report as verify wrote it is taken: only the edits below are refused
    monkeypatch.setattr(publish, "file_sha256", lambda *a, **k: pytest.fail("hashed before the check"))
    cases = [(k, v) for k in ("kld_mean", "kld_mean_stderr", "ppl_ratio", "same_top")
             for v in ("NaN", "Infinity", "-Infinity", "1e999")] + [("same_top", "null"), ("scored", "null")]
    for key, token in cases:
        text = json.dumps({"numerics": {**num, key: "@"}}).replace('"@"', token)
        value = json.loads(text)["numerics"][key]
        assert value is None or not math.isfinite(value)  # the edit reads back as what it says
        stage = tmp_path / "stage"
        code, e, _ = _publish_card(packed, text, stage, capsys)
        assert code == 1 and len(e.strip().splitlines()) == 1, (key, token, e)
        assert error_line(e).startswith(f"error: --numerics {tmp_path / 'stage.json'}: numerics.{key} must be a "), e
        assert not stage.exists()


# ---------------------------------------------------------------------------------------------------------
# 2. The size table: the total row sums the class rows and equals inspect's; the file size is stated apart.

def _class_rows(card: str) -> list[list[str]]:
    """Cells of the size table's class rows (between its |---| rule and the total row)."""
    lines = card.splitlines()
    start = lines.index("|---|---:|---:|---|---:|---:|") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("| **total**"))
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[start:end]]


def test_total_row_is_the_weights_as_inspect_counts_them(packed, tmp_path, capsys):
    from ninfer_rt.format import Artifact

    code, o, e = pack(["inspect", packed, "--json"], capsys)
    assert code == 0, e
    ins = json.loads(o)
    with Artifact.open(packed) as art:  # a second oracle: the tensor table's own byte counts
        assert sum(t.nbytes for t in art.tensors.values()) == ins["total_bytes"] < art.size
    stage = tmp_path / "stage"
    code, _, e = pack(["publish", packed, *BASE, "--dry-run", stage], capsys)
    assert code == 0, e
    card = (stage / "README.md").read_text(encoding="utf-8")
    rows = _class_rows(card)
    assert [r[0] for r in rows] == [c["class"] for c in ins["classes"]]
    assert [r[5] for r in rows] == [f"{c['bpw']:.2f}" for c in ins["classes"]]
    (tensors, params, gib, bpw), = TOTAL_ROW.findall(card)
    assert int(tensors) == sum(int(r[1]) for r in rows) == sum(c["tensors"] for c in ins["classes"])
    assert int(params.replace(",", "")) == sum(int(r[2].replace(",", "")) for r in rows) == ins["total_params"]
    assert gib == f"{ins['total_bytes'] / 2**30:.3f}"
    assert bpw == f"{ins['bits_per_param']:.3f}" == f"{8 * ins['total_bytes'] / ins['total_params']:.3f}"
    file_line = next(ln for ln in card.splitlines() if ln.startswith("- file:"))
    assert f"file size {packed.stat().st_size:,} bytes" in file_line  # the whole file, labelled as such
