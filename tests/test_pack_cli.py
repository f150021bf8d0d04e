"""ninfer-pack end to end: quantize, inspect, verify, publish, and every bad input's message and exit code."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest

from cli_runner import error_line, run_main
from ninfer_pack import cli
from ninfer_pack.tiny_tokenizer import tiny_tokenizer_files
from ninfer_rt.format import Artifact
from test_recipe import planned_bytes


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here works on tiny tensors (see conftest.one_thread)."""


def run(args, capsys):
    """`ninfer-pack ARGS` in-process; returns (exit code, stdout, stderr)."""
    return run_main(cli.main, "ninfer-pack", args, capsys)


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


@pytest.mark.parametrize("source", ["builtin:tiny-moe", "qwen3.6-35b-a3b", "Qwen/Qwen3.6-35B-A3B"])
def test_inspect_of_a_plan_source_without_recipe_says_to_add_one(source, capsys, monkeypatch):
    monkeypatch.setattr("ninfer_pack.source.Checkpoint.open", lambda *a, **k: pytest.fail("opened"))
    code, _, e = run(["inspect", source], capsys)
    assert code == 1 and error_line(e) == (f"error: no such file: {source}; to plan a checkpoint (a directory, Hub "
                                           "repo id or built-in config), add --recipe NAME")


def test_verify_prints_names_as_written(packed, tmp_path, capsys):
    """Paths in verify's lines are text, not rich markup (a `[/red]` raised, `[b]` vanished)."""
    (tmp_path / "x[").mkdir()
    path = tmp_path / "x[/red][b].ninfer"  # "red][b].ninfer" in a folder "x["
    path.write_bytes(packed.read_bytes())
    code, _, e = run(["verify", path], capsys)
    assert code == 0 and f"{path}: sound" in e.replace("\n", ""), e
    bad = _corrupt_copy(packed, tmp_path / "x[/red][i].ninfer", "payload")
    code, _, e = run(["verify", bad], capsys)
    assert code == 1 and str(bad) in error_line(e)


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
    assert plan["total_bytes"] == planned_bytes("qwen3.6-35b-a3b")  # the stated mix's size formulas
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
    for name, data in tiny_tokenizer_files().items():  # ninfer-rt needs a tokenizer; write_checkpoint has none
        (src / name).write_bytes(data)
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


# ---------------------------------------------------------------------------------------------------------
# Checks made before any work, and errors during it.

def _write_recipe(path, rules):
    """A recipe file from (pattern, format) pairs, tried in order."""
    text = 'name = "t"\ndescription = "test"\n'
    text += "".join(f"[[rules]]\npattern = '{p}'\nformat = \"{f}\"\n" for p, f in rules)
    path.write_text(text)
    return path


def _edited_copy(src, dst, name, edit):
    """A copy of checkpoint `src` in which tensor `name` is replaced by edit(tensor) in its shard."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    shard = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(dst / shard))
    tensors[name] = edit(tensors[name].clone())
    save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    return dst


O_PROJ = "model.language_model.layers.3.self_attn.o_proj.weight"  # layer 3 is a full-attention layer


def _o_proj_recipe(path, fmt="q8g32"):
    return _write_recipe(path, [(O_PROJ.replace(".", r"\."), fmt), (".*", "bf16")])


@pytest.mark.parametrize("case, message", [
    ("out_is_dir", "is a directory"),
    ("out_parent_missing", "output directory does not exist"),
    ("no_importance_file", "no such importance file"),
])
def test_files_checked_before_the_checkpoint_is_opened(case, message, tmp_path, capsys):
    out = {"out_is_dir": tmp_path, "out_parent_missing": tmp_path / "no" / "m.ninfer"}.get(case, tmp_path / "m")
    # the source does not exist: these errors must come first, before any (Hub) download
    code, _, e = run(["quantize", tmp_path / "nowhere", "--recipe", "tiny", "--out", out,
                      "--importance", tmp_path / "imp.safetensors"], capsys)
    assert code == 1 and message in error_line(e), e


def test_checkpoint_without_tokenizer_is_refused(tiny_moe, tmp_path, capsys, monkeypatch):
    import ninfer_pack.pipeline as pipeline

    src = shutil.copytree(tiny_moe, tmp_path / "ck")
    (src / "tokenizer.json").unlink()
    monkeypatch.setattr(pipeline, "encode_tensor", lambda *a, **k: pytest.fail("encoded before the check"))
    code, _, e = run(["quantize", src, "--recipe", "tiny", "--out", tmp_path / "m.ninfer"], capsys)
    assert code == 1 and error_line(e) == (f"error: {src} has no tokenizer.json: ninfer-rt needs it to run "
                                           "the model")
    assert not (tmp_path / "m.ninfer").exists()


def _importance(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("case, message", [
    ("unknown_entry", r"importance entry model\.language_model\.layers\.3\.self_attn\.nope\.weight is not a "
                      r"tensor of the checkpoint"),
    ("wrong_k", rf"importance for {re.escape(O_PROJ)} has {{k1}} channels, the tensor has {{k}} inputs"),
    ("nan", rf"importance for {re.escape(O_PROJ)} has nan at channel 5; every value must be finite and >= 0"),
    ("negative", rf"importance for {re.escape(O_PROJ)} has -1\.0 at channel 5"),
    ("2d", rf"importance for {re.escape(O_PROJ)} must be 1-D"),
    ("complex", rf"importance for {re.escape(O_PROJ)} is complex64: it must be real numbers"),
    ("bool", rf"importance for {re.escape(O_PROJ)} is bool: it must be real numbers"),
])
def test_bad_importance(case, message, tiny_moe, tmp_path, capsys, monkeypatch):
    import torch

    import ninfer_pack.pipeline as pipeline
    from ninfer_pack.source import Checkpoint

    k = Checkpoint.open(str(tiny_moe)).shape(O_PROJ)[-1]  # o_proj is [H, nH * d]: K, its input size, is last
    message = message.format(k=k, k1=k + 1)
    good = torch.ones(k)
    imp = {"unknown_entry": {O_PROJ: good, O_PROJ.replace("o_proj", "nope"): good.clone()},
           "wrong_k": {O_PROJ: torch.ones(k + 1)},
           "nan": {O_PROJ: torch.cat([good[:5], torch.tensor([float("nan")]), good[6:]])},
           "negative": {O_PROJ: torch.cat([good[:5], torch.tensor([-1.0]), good[6:]])},
           "2d": {O_PROJ: torch.ones(1, k)},
           "complex": {O_PROJ: torch.ones(k, dtype=torch.complex64)},
           "bool": {O_PROJ: torch.ones(k, dtype=torch.bool)}}[case]
    path = _importance(tmp_path / "imp.safetensors", imp)
    monkeypatch.setattr(pipeline, "encode_tensor", lambda *a, **k: pytest.fail("encoded before the check"))
    code, _, e = run(["quantize", tiny_moe, "--recipe", _o_proj_recipe(tmp_path / "r.toml"), "--out",
                      tmp_path / "m.ninfer", "--importance", path], capsys)
    line = error_line(e)
    assert code == 1 and re.search(message, line) and str(path) in line, line


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64", "int64", "bfloat16", "float8_e4m3fn"])
def test_importance_of_any_real_dtype_reads_as_its_values(dtype, tmp_path):
    """Counts or low-precision floats from another tool: every real dtype is read as float32 of the same values
    (small integers, exact in all of them)."""
    import torch

    from ninfer_pack.pipeline import load_importance

    values = torch.tensor([0.0, 1.0, 2.0, 7.0, 12.0])
    path = _importance(tmp_path / "imp.safetensors", {O_PROJ: values.to(getattr(torch, dtype))})
    got = load_importance(path)[O_PROJ]
    assert got.dtype == torch.float32 and torch.equal(got, values)


def test_importance_reaches_its_tensor(tiny_moe, tmp_path, capsys):
    """o_proj's codes and scales are those quant.quantize_rows gives with its importance, and not without it."""
    import numpy as np
    import torch

    from ninfer_pack.quant import quantize_rows
    from ninfer_pack.source import Checkpoint
    from ninfer_rt.formats import get_format

    w = Checkpoint.open(str(tiny_moe)).read(O_PROJ).float()  # identity layout: artifact rows are its rows
    imp = torch.linspace(0.0, 4.0, w.shape[-1]) ** 4  # strongly uneven, so the chosen scales must move
    path = _importance(tmp_path / "imp.safetensors", {O_PROJ: imp})
    out = tmp_path / "m.ninfer"
    code, _, e = run(["quantize", tiny_moe, "--recipe", _o_proj_recipe(tmp_path / "r.toml"), "--out", out,
                      "--importance", path], capsys)
    assert code == 0, e
    fmt = get_format("q8g32")
    with Artifact.open(out) as art:
        assert art.header["recipe"]["importance"] == str(path)
        q, s = fmt.unpack(art.raw(O_PROJ), tuple(art.tensors[O_PROJ].shape))
    q_ref, s_ref = quantize_rows(w, 8, 32, importance=imp)
    np.testing.assert_array_equal(s, s_ref.numpy())
    np.testing.assert_array_equal(q, q_ref.numpy())
    assert not np.array_equal(s, quantize_rows(w, 8, 32)[1].numpy())


EMBED = "model.language_model.embed_tokens.weight"  # [500, 64], identity layout, the first quantized tensor


@pytest.mark.parametrize("value, message", [
    (float("nan"), "weight row 321 col 17 is nan: only finite values can be quantized"),
    (float("inf"), "weight row 321 col 17 is inf"),
    (1e9, "weight row 321: a group's scale overflows fp16"),  # even clipped to half, 1e9 / 127 > 65504 (fp16 max)
])
def test_unencodable_weight_names_tensor_and_row(value, message, tiny_moe, tmp_path, capsys, monkeypatch):
    import ninfer_pack.pipeline as pipeline

    def put(t):
        t[321, 17] = value
        return t

    src = _edited_copy(tiny_moe, tmp_path / "ck", EMBED, put)
    # 100 rows per chunk: row 321 lies in the fourth chunk, so a chunk-relative row number would read 21
    monkeypatch.setattr(pipeline, "ROW_CHUNK_ELEMS", 100 * 64)
    recipe = _write_recipe(tmp_path / "r.toml", [(EMBED.replace(".", r"\."), "q8g32"), (".*", "bf16")])
    code, _, e = run(["quantize", src, "--recipe", recipe, "--out", tmp_path / "m.ninfer"], capsys)
    assert code == 1 and error_line(e).startswith(f"error: tensor {EMBED}: {message}"), e
    assert not (tmp_path / "m.ninfer").exists()


# ---------------------------------------------------------------------------------------------------------
# publish: refusals before any hashing or file change.

@pytest.fixture
def own_copy(packed, tmp_path):
    """A private copy of the packed artifact, so a test that could destroy it cannot harm the others."""
    return shutil.copyfile(packed, tmp_path / packed.name)


@pytest.mark.parametrize("case, message", [
    ("own_folder", "would replace {art} itself"),
    ("symlink_to_it", "would replace {art} itself"),
    ("folder_is_file", "--dry-run {art} is an existing file"),
    ("bad_repo", "--repo 'me/tiny..ninfer' is not a valid Hub repo id"),
    ("three_parts", "--repo must be OWNER/NAME, got 'a/b/c'"),
    ("bad_base_model", "--base-model 'Qwen/-x' is not a valid Hub repo id"),
])
def test_publish_refusals(case, message, own_copy, tmp_path, capsys, monkeypatch):
    import ninfer_pack.publish as publish

    before = own_copy.read_bytes()
    repo, folder, base = "me/tiny-ninfer", tmp_path / "stage", "Qwen/Qwen3.6-35B-A3B"
    if case == "own_folder":
        folder = own_copy.parent
    elif case == "symlink_to_it":
        folder.mkdir()
        (folder / own_copy.name).symlink_to(own_copy)
    elif case == "folder_is_file":
        folder = own_copy
    elif case == "bad_repo":
        repo = "me/tiny..ninfer"
    elif case == "three_parts":
        repo = "a/b/c"
    else:
        base = "Qwen/-x"
    monkeypatch.setattr(publish, "file_sha256", lambda *a, **k: pytest.fail("hashed before the check"))
    code, _, e = run(["publish", own_copy, "--repo", repo, "--dry-run", folder, "--base-model", base], capsys)
    assert code == 1 and message.format(art=own_copy) in error_line(e), e
    assert own_copy.read_bytes() == before


def test_publish_refuses_a_corrupted_artifact(own_copy, tmp_path, capsys):
    """One payload byte flipped (the header still valid): publish checks every tensor's checksum before it hashes the
    file for the card, names the damaged tensor in one line, and stages nothing."""
    from ninfer_rt.format import Artifact

    with Artifact.open(own_copy) as art:
        victim = max(art.tensors.values(), key=lambda t: t.nbytes)
    with open(own_copy, "r+b") as f:
        f.seek(victim.offset + victim.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    folder = tmp_path / "stage"
    code, _, e = run(["publish", own_copy, "--repo", "me/tiny", "--dry-run", folder, "--base-model",
                      "Qwen/Qwen3.6-35B-A3B"], capsys)
    assert code == 1 and f"is corrupted (checksum mismatch in {victim.name})" in error_line(e), e
    assert not folder.exists()


def test_publish_builtin_source_needs_base_model(tiny_moe, tmp_path, capsys, monkeypatch):
    """builtin: names no Hub model, so the card's base_model must come from --base-model."""
    import ninfer_pack.tiny as tiny

    monkeypatch.setattr(tiny, "materialize_builtin", lambda name, cache_dir=None: tiny_moe)  # no ~/.cache write
    art = tmp_path / "b.ninfer"
    code, _, e = run(["quantize", "builtin:tiny-moe", "--recipe", "bf16", "--out", art], capsys)
    assert code == 0, e
    code, _, e = run(["publish", art, "--repo", "me/b", "--dry-run", tmp_path / "s"], capsys)
    assert code == 1 and error_line(e) == (f"error: {art} was packed from builtin:tiny-moe, not a Hub repo: "
                                           "pass --base-model OWNER/NAME")
    assert not (tmp_path / "s").exists()
    code, _, e = run(["publish", art, "--repo", "me/b", "--dry-run", tmp_path / "s", "--base-model", "Qwen/X"],
                     capsys)
    assert code == 0 and "base_model: Qwen/X\n" in (tmp_path / "s" / "README.md").read_text()


# ---------------------------------------------------------------------------------------------------------
# inspect: the plan from shapes and the artifact's own table agree; warnings reach --json.

def test_inspect_plan_matches_artifact_and_reports_warnings(packed, tiny_moe, tmp_path, capsys):
    code, o, e = run(["inspect", packed, "--json", "--tensors"], capsys)
    assert code == 0, e
    from_artifact = json.loads(o)
    assert from_artifact["warnings"] == []
    tiny = (cli.Path(__file__).resolve().parents[1] / "recipes" / "tiny.toml").read_text()
    recipe = tmp_path / "extra.toml"
    recipe.write_text(tiny + "\n[[rules]]\npattern = 'never\\.matches'\nformat = \"bf16\"\nnote = \"unused\"\n")
    code, o, e = run(["inspect", tiny_moe, "--recipe", recipe, "--json", "--tensors"], capsys)
    assert code == 0, e
    planned = json.loads(o)
    n_rules = tiny.count("[[rules]]") + 1
    assert planned["warnings"] == [f"recipe tiny: rule {n_rules} ('never\\\\.matches') matches no tensor"]
    for key in ("classes", "total_params", "total_bytes"):
        assert planned[key] == from_artifact[key], key
    assert sorted(map(json.dumps, planned["tensors"])) == sorted(map(json.dumps, from_artifact["tensors"]))


# ---------------------------------------------------------------------------------------------------------
# verify's per-tensor comparison: chunked, and no larger than decoding the tensor.

def test_compare_tensor_is_chunked_and_exact(packed, tiny_moe, monkeypatch):
    import tracemalloc

    import numpy as np

    import ninfer_pack.pipeline as pipeline
    from ninfer_pack.source import Checkpoint
    from ninfer_pack.verify import compare_tensor
    from ninfer_rt.formats import bf16_bits_to_f32, get_format
    from ninfer_rt.layout import apply_forward

    chunk = 4096
    monkeypatch.setattr(pipeline, "ROW_CHUNK_ELEMS", chunk)  # 64 rows of K = 64: several chunks per tensor
    ckpt = Checkpoint.open(str(tiny_moe))
    with Artifact.open(packed) as art:
        for name, e in art.tensors.items():
            src = apply_forward(e.plan(), pipeline.read_parts(ckpt, e.plan().parts))
            fmt = get_format(e.format)
            tracemalloc.start()
            got = fmt.decode(art.raw(name), tuple(e.shape))
            decode_peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            tracemalloc.start()
            check = compare_tensor(art, name, src)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            # beyond the decode itself, only a few float64 row chunks (ref, decoded, difference) and change
            assert peak <= decode_peak + 4 * 8 * chunk + 4096, (name, peak, decode_peak)
            assert check.ok, (name, check.detail)
            ref = bf16_bits_to_f32(src) if src.dtype == np.uint16 else src
            ref, got = ref.astype(np.float64), got.astype(np.float64)
            want = np.sqrt(np.mean((got - ref) ** 2)) / (np.sqrt(np.mean(ref ** 2)) or 1.0)
            # float64 sums in another order: agreement to ~1e-15 relative, 1e-12 leaves room
            assert abs(check.rel_rmse - want) <= 1e-12 * max(want, 1e-300), (name, check.rel_rmse, want)
