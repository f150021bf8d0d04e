"""ninfer-pack end to end: quantize, inspect, verify, publish, and every bad input's message and exit code."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest

from cli_runner import error_line, run_main
from ninfer_pack import cli
from ninfer_pack.tiny import materialize_builtin
from ninfer_rt.format import Artifact


def run(args, capsys):
    """`ninfer-pack ARGS` in-process; returns (exit code, stdout, stderr)."""
    return run_main(cli.main, "ninfer-pack", args, capsys)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return materialize_builtin("builtin:tiny-moe", cache_dir=tmp_path_factory.mktemp("builtin"))


@pytest.fixture(scope="module")
def packed(tiny_moe, tmp_path_factory):
    """The tiny MoE quantized with the tiny recipe (every format family), via the library."""
    from ninfer_pack.pipeline import quantize

    out = tmp_path_factory.mktemp("art") / "tiny.ninfer"
    quantize(str(tiny_moe), "tiny", out)
    return out


def test_quantize_inspect_verify(tiny_moe, tmp_path, capsys):
    out = tmp_path / "m.ninfer"
    code, o, e = run(["quantize", tiny_moe, "--recipe", "tiny", "--out", out], capsys)
    assert code == 0, e
    assert out.is_file() and [p.name for p in tmp_path.iterdir()] == ["m.ninfer"]
    code, o, e = run(["inspect", out], capsys)
    assert code == 0 and "total" in o and "routed" in o and "attention" in o
    code, o, e = run(["inspect", out, "--json", "--tensors"], capsys)
    report = json.loads(o)
    with Artifact.open(out) as art:
        assert report["total_bytes"] == sum(t.nbytes for t in art.tensors.values())
        assert len(report["tensors"]) == len(art.tensors)
        assert art.header["provenance"]["source"] and art.header["recipe"]["name"] == "tiny"
        # resources are copied byte for byte
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert art.resource(name) == (tiny_moe / name).read_bytes()
    code, o, e = run(["verify", out], capsys)
    assert code == 0 and "sound" in e
    code, o, e = run(["verify", out, "--source", tiny_moe, "--json"], capsys)
    rep = json.loads(o)
    assert code == 0 and rep["ok"] and len(rep["tensors"]) == len(report["tensors"])
    assert all(t["ok"] for t in rep["tensors"])


def test_existing_output_is_not_overwritten(packed, tiny_moe, capsys):
    before = packed.read_bytes()
    code, _, e = run(["quantize", tiny_moe, "--recipe", "tiny", "--out", packed], capsys)
    assert code == 1 and "exists" in error_line(e) and packed.read_bytes() == before


def test_interrupted_quantize_leaves_no_file(tiny_moe, tmp_path, capsys, monkeypatch):
    import ninfer_pack.pipeline as pipeline

    calls = {"n": 0}
    real = pipeline.encode_tensor

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(pipeline, "encode_tensor", flaky)
    code, _, e = run(["quantize", tiny_moe, "--recipe", "tiny", "--out", tmp_path / "x.ninfer"], capsys)
    assert code == 130 and calls["n"] == 20
    assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary file


def _corrupt_copy(src, dst, how):
    raw = bytearray(src.read_bytes())
    if how == "truncated":
        raw = raw[: len(raw) // 2]
    elif how == "foreign":
        raw = bytearray(b"GGUF" + bytes(raw[4:]))
    elif how == "payload":
        with Artifact.open(src) as art:
            e = next(iter(art.tensors.values()))
        raw[e.offset + e.nbytes // 2] ^= 0xFF
    dst.write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize("how, message", [("truncated", "truncated"), ("foreign", "not a ninfer artifact"),
                                          ("payload", "checksum mismatch")])
def test_verify_rejects_bad_files(packed, tmp_path, capsys, how, message):
    bad = _corrupt_copy(packed, tmp_path / "bad.ninfer", how)
    code, _, e = run(["verify", bad], capsys)
    assert code == 1 and message in error_line(e)
    code, _, e = run(["inspect", bad], capsys)
    assert code == (0 if how == "payload" else 1)  # inspect reads only the (intact) header for a payload flip


def test_verify_source_catches_a_wrong_tensor(packed, tiny_moe, tmp_path, capsys):
    """A payload changed and re-checksummed passes the checksums but not the comparison with the source."""
    from ninfer_rt.format import MAGIC, PREFIX
    from ninfer_rt.formats import get_format

    raw = bytearray(packed.read_bytes())
    with Artifact.open(packed) as art:
        e = next(t for t in art.tensors.values() if t.format.startswith("q4"))
        fmt = get_format(e.format)
        q, s = fmt.unpack(art.raw(e.name), tuple(e.shape))
        q = q.copy()
        first = (0,) * q.ndim
        q[first] = q[first] + 1 if q[first] < fmt.qmax else q[first] - 1  # one code off by one
        new = fmt.pack(q, s)
        header = dict(art.header)
    raw[e.offset:e.offset + e.nbytes] = new.tobytes()
    for t in header["tensors"]:
        if t["name"] == e.name:
            t["sha256"] = hashlib.sha256(new.tobytes()).hexdigest()
    h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    hlen = PREFIX.unpack(bytes(raw[:PREFIX.size]))[3]
    assert len(h) == hlen
    raw[:PREFIX.size] = PREFIX.pack(MAGIC, 1, 0, hlen, hashlib.sha256(h).digest())
    raw[64:64 + hlen] = h
    bad = tmp_path / "recoded.ninfer"
    bad.write_bytes(bytes(raw))
    assert run(["verify", bad], capsys)[0] == 0  # structurally sound
    code, _, err = run(["verify", bad, "--source", tiny_moe], capsys)
    assert code == 1 and e.name in error_line(err)


def _write_config(d, cfg):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("case, message", [
    ("no_dir", "no such directory"),
    ("no_config", "has no config.json"),
    ("llama", "unsupported architecture 'llama'"),
    ("missing_field", "hidden_size"),
    ("shape", r"embed_tokens\.weight has shape \[500, 64\] .* implies \[500, 96\]"),
    ("offline", "cannot download"),
    ("unknown_recipe", "unknown recipe"),
    ("recipe_gap", "matches no rule|no rule matches|not matched"),
    ("recipe_syntax", "line"),
])
def test_bad_inputs(case, message, tiny_moe, tmp_path, capsys, monkeypatch):
    src, recipe = str(tiny_moe), "tiny"
    if case == "no_dir":
        src = str(tmp_path / "nowhere" / "x")
    elif case == "no_config":
        src = str(_write_config(tmp_path / "c", {}).parent / "c")
        (tmp_path / "c" / "config.json").unlink()
    elif case in ("llama", "missing_field", "shape"):
        d = tmp_path / "ck"
        shutil.copytree(tiny_moe, d)
        cfg = json.loads((d / "config.json").read_text())
        if case == "llama":
            cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64}
        elif case == "missing_field":
            del cfg["text_config"]["hidden_size"]
        else:
            cfg["text_config"]["hidden_size"] = 96  # every [H] tensor now disagrees with the config
        _write_config(d, cfg)
        src = str(d)
    elif case == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        src = "nobody-here/no-such-model"
    elif case == "unknown_recipe":
        recipe = "no-such-recipe"
    elif case == "recipe_gap":
        recipe = tmp_path / "gap.toml"
        recipe.write_text('name = "gap"\ndescription = "norms only"\n[[rules]]\npattern = \'.*norm.*\'\nformat = "bf16"\n')
    elif case == "recipe_syntax":
        recipe = tmp_path / "bad.toml"
        recipe.write_text('name = "bad"\n[[rules]\npattern = "x"\n')
    code, _, e = run(["quantize", src, "--recipe", recipe, "--out", tmp_path / "o.ninfer"], capsys)
    assert code == 1
    assert re.search(message, error_line(e)), e
    assert not (tmp_path / "o.ninfer").exists()


def test_plan_35b_and_27b(capsys):
    code, o, e = run(["inspect", "qwen3.6-35b-a3b", "--recipe", "qwen3.6-35b-a3b", "--json"], capsys)
    assert code == 0, e
    plan = json.loads(o)
    gib = plan["total_bytes"] / 2**30
    assert 20.3 <= gib <= 21.3, gib  # the target band around NInfer's 20.84 GiB
    assert plan["total_params"] == 35_951_822_704  # every checkpoint parameter, MTP and vision included
    code, o, e = run(["inspect", "qwen3.6-27b", "--recipe", "qwen3.6-27b"], capsys)
    assert code == 0 and "total" in o and "27.78 B" in o


def test_publish_dry_run_and_no_token(packed, tmp_path, capsys, monkeypatch):
    stage = tmp_path / "stage"
    code, _, e = run(["publish", packed, "--repo", "me/tiny-ninfer", "--dry-run", stage], capsys)
    assert code == 1 and "--base-model" in error_line(e)  # packed from a local dir: the card needs a base model
    code, _, e = run(["publish", packed, "--repo", "me/tiny-ninfer", "--dry-run", stage,
                      "--base-model", "Qwen/Qwen3.6-35B-A3B"], capsys)
    assert code == 0, e
    card = (stage / "README.md").read_text()
    front = card.split("---\n")[1]
    assert card.startswith("---\n") and "base_model: Qwen/Qwen3.6-35B-A3B\n" in front
    assert "base_model_relation: quantized" in front and "license: apache-2.0" in front and "tags:" in front
    assert hashlib.sha256(packed.read_bytes()).hexdigest() in card
    assert (stage / packed.name).read_bytes() == packed.read_bytes()
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, e = run(["publish", packed, "--repo", "me/tiny-ninfer", "--base-model", "Qwen/Qwen3.6-35B-A3B"],
                     capsys)
    assert code == 1 and "not logged in" in error_line(e)
    code, _, e = run(["publish", packed, "--repo", "not-a-repo-id"], capsys)
    assert code == 1 and "OWNER/NAME" in error_line(e)


@pytest.mark.parametrize("form", ["fp8", "causal_per_expert"])
def test_other_on_disk_forms_quantize_and_verify(form, tmp_path, capsys):
    """FP8 block checkpoints and save_pretrained-style per-expert text-only checkpoints pack and verify."""
    import checkpoints
    import hf_tiny

    model = hf_tiny.make_causal_lm(moe=True, seed=3)
    kw = dict(prefix="causal", experts="per_expert") if form == "causal_per_expert" else \
        dict(prefix="causal", experts="fused", fp8=True)
    src, _expected = checkpoints.write_checkpoint(tmp_path / "src", model, **kw)
    out = tmp_path / "m.ninfer"
    code, _, e = run(["quantize", src, "--recipe", "tiny", "--out", out], capsys)
    assert code == 0, e
    code, o, e = run(["verify", out, "--source", src, "--json"], capsys)
    assert code == 0 and json.loads(o)["ok"], e


def test_bf16_recipe_is_lossless(tiny_moe, tmp_path):
    """bf16 recipe: decoding the artifact and inverting every layout transform gives the checkpoint back."""
    import numpy as np

    from ninfer_pack.pipeline import quantize
    from ninfer_pack.source import Checkpoint

    out = tmp_path / "bf16.ninfer"
    quantize(str(tiny_moe), "bf16", out)
    ckpt = Checkpoint.open(str(tiny_moe))
    seen = set()
    with Artifact.open(out) as art:
        for name in art.tensors:
            for part, arr in art.checkpoint_tensors(name).items():
                ref = ckpt.read(part).float().numpy()
                np.testing.assert_array_equal(arr, ref, err_msg=part)  # bit-exact: bf16 and fp32 are stored as is
                seen.add(part)
    assert seen == set(ckpt.names)
