"""The checkpoint reader against transformers: every on-disk form, FP8 dequantization, bad inputs, streaming
(the Hub: test_source_hub.py).

Oracles: the tiny HF models' own parameters (bit-exact, cast as stored), transformers' FP8 block dequantization
(`_dequantize_fp8_weight`, exact in float32), transformers' own `save_pretrained` output, the safetensors files'
sizes (bytes on disk), and the process's peak resident memory for streaming.
"""

from __future__ import annotations

import copy
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoints as ckpts
from cli_runner import one_line
import hf_tiny
from ninfer_pack.source import Checkpoint
from ninfer_rt.config import ModelSpec
from ninfer_rt.errors import ConfigError, SourceError

_TORCH_DTYPE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _data_bytes(path: Path) -> int:
    """Tensor bytes over all shards, from the files themselves: size - 8 - header length."""
    total = 0
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        total += f.stat().st_size - 8 - n
    return total


def _check_matches(ck: Checkpoint, expected: dict[str, torch.Tensor], model, fp8: bool = False) -> None:
    """Names, shapes, dtypes and values: bit-exact against the expectation and the HF parameters."""
    assert sorted(ck.names) == sorted(expected)
    assert ck.total_source_bytes == _data_bytes(ck.path)
    hf = ckpts.canonical_params(model)
    for name in ck.names:
        t = ck.read(name)
        want = expected[name]
        assert tuple(t.shape) == ck.shape(name) == tuple(want.shape), name
        src = ck.source_dtype(name)
        if src == "F8_E4M3":
            assert fp8 and ckpts.FP8_ELIGIBLE.search(name), name
            assert t.dtype == torch.float32
        else:
            assert t.dtype == _TORCH_DTYPE[src], name
            if name in hf:  # the HF parameter itself, cast the way the checkpoint stores it
                assert torch.equal(t, hf[name].to(t.dtype)), name
        assert torch.equal(t.float(), want), name


FORMS = {
    "vlm-fused": ("vlm_moe", dict()),
    "vlm-per-expert-mtp-fused-3-shards": ("vlm_moe", dict(experts="per_expert", mtp="fused", shards=3)),
    "vlm-one-file-no-fp32": ("vlm_moe", dict(experts="per_expert", fp32_fields=False, shards=1)),
    "vlm-odd-shard-names-fp32": ("vlm_moe", dict(dtype=torch.float32,
                                                 shard_name="model.safetensors-{i:05d}-of-{n:05d}.safetensors")),
    "causal-per-expert": ("causal_moe", dict(prefix="causal", experts="per_expert", mtp="per_expert", shards=4)),
    "causal-fused-no-mtp": ("causal_moe", dict(prefix="causal", mtp=False)),
    "causal-from-vlm": ("vlm_moe", dict(prefix="causal", experts="per_expert")),
    "dense-causal": ("causal_dense", dict(prefix="causal")),
    "dense-vlm-f16": ("vlm_dense", dict(dtype=torch.float16, mtp=False)),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_reads_back_exactly(models, tmp_path, form):
    key, kw = FORMS[form]
    path, expected = ckpts.write_checkpoint(tmp_path / "ck", models[key], **kw)
    with Checkpoint.open(str(path)) as ck:
        _check_matches(ck, expected, models[key])
        want_missing = {"mtp"} if kw.get("mtp", True) is False else set()
        assert ck.missing_groups == want_missing
        if kw.get("fp32_fields", True) and "moe" in key:
            assert ck.source_dtype("model.language_model.layers.0.linear_attn.A_log") == "F32"
        assert ck.provenance == {"source": str(path), "path": str(path.resolve())}


@pytest.mark.parametrize("key", ["vlm_moe", "causal_moe"])
def test_reads_what_transformers_save_pretrained_writes(models, tmp_path, key):
    model = copy.deepcopy(models[key]).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in weight_map)  # HF writes per-expert tensors
    ck = Checkpoint.open(tmp_path)
    hf = ckpts.canonical_params(model)
    assert sorted(ck.names) == sorted(hf)
    for name in ck.names:
        assert torch.equal(ck.read(name), hf[name].to(torch.bfloat16)), name
    assert ck.missing_groups == {"mtp"}
    assert ck.total_source_bytes == _data_bytes(tmp_path)


def test_a_stored_head_is_used_where_the_config_ties_it(models, tmp_path):
    """transformers 5 loads a checkpoint's lm_head.weight even where config.json says tie_word_embeddings: the
    reader takes that head too (it refused it as an unexpected tensor)."""
    model = copy.deepcopy(models["causal_dense"])
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    loaded = type(model).from_pretrained(tmp_path, dtype=torch.float32)
    assert not torch.equal(loaded.lm_head.weight, loaded.get_input_embeddings().weight)  # the oracle: untied
    ck = Checkpoint.open(tmp_path)
    assert not ck.spec.tie_word_embeddings and "lm_head.weight" in ck.names
    assert torch.equal(ck.read("lm_head.weight").float(), loaded.lm_head.weight)


def test_read_order_streams_shard_by_shard(models, tmp_path):
    path, _ = ckpts.write_checkpoint(tmp_path, models["vlm_moe"], shards=3, mtp="fused")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shards = [weight_map[n] for n in Checkpoint.open(path).names]  # canonical == stored names in this form
    assert shards == sorted(shards)


FP8_FORMS = {
    "per-expert-bf16-scales": ("vlm_moe", dict(experts="per_expert")),
    "fused-fp32-scales": ("vlm_moe", dict(fp8_scale_dtype=torch.float32, mtp="fused")),
    "odd-blocks-16x24": ("vlm_moe", dict(experts="per_expert", fp8_block=(16, 24), fp8_scale_dtype=torch.float32)),
    "no-block-size-key": ("causal_moe", dict(prefix="causal", experts="per_expert", fp8_block=None, shards=3)),
    "dense": ("causal_dense", dict(prefix="causal", fp8_block=(32, 48))),
}


@pytest.mark.parametrize("form", list(FP8_FORMS))
def test_fp8_dequantizes_like_transformers(models, tmp_path, form):
    key, kw = FP8_FORMS[form]
    path, expected = ckpts.write_checkpoint(tmp_path, models[key], fp8=True, **kw)
    ck = Checkpoint.open(path)
    # expected FP8 values are transformers' _dequantize_fp8_weight output; equality is exact in float32
    _check_matches(ck, expected, models[key], fp8=True)
    hf = ckpts.canonical_params(models[key])
    fp8 = [n for n in ck.names if ck.source_dtype(n) == "F8_E4M3"]
    assert len(fp8) == len([n for n in ck.names if ckpts.FP8_ELIGIBLE.search(n)]) > 0
    for name in fp8:
        if name in hf:
            # e4m3 keeps 3 mantissa bits: rounding error <= 2^-4 relative per normal element, so also in norm
            hf_tiny.assert_close_rel(ck.read(name), hf[name], 2.0 ** -4)
            assert not torch.equal(ck.read(name), hf[name])  # it really went through FP8


def test_fp8_scale_grid_must_match_config_block(models, tmp_path):
    path, _ = ckpts.write_checkpoint(tmp_path, models["vlm_moe"], fp8=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]  # e.g. q_proj [256, 64] would need [4, 1] scales
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        Checkpoint.open(path)
    m = re.search(r"_scale_inv has shape \[(\d+), (\d+)\], but \[(\d+), (\d+)\] in 64x64 blocks .*needs "
                  r"\[(\d+), (\d+)\]", one_line(e))
    has_n, has_k, n, k, need_n, need_k = map(int, m.groups())
    assert (has_n, has_k, need_n, need_k) == (-(-n // 128), -(-k // 128), -(-n // 64), -(-k // 64))


def test_builtin_tiny_checkpoints_open():
    for source in ("builtin:tiny-moe", "builtin:tiny-dense"):
        ck = Checkpoint.open(source)
        shapes = ck.spec.tensor_shapes()
        assert set(ck.names) == {n for n, t in shapes.items() if t.group not in ck.missing_groups}
        for name in ck.names:
            assert tuple(ck.read(name).shape) == shapes[name].shape
        assert ck.provenance["source"] == source
    with pytest.raises(SourceError, match="builtin:nope"):
        Checkpoint.open("builtin:nope")


def test_resources_are_copied_byte_for_byte(models, tmp_path):
    path, _ = ckpts.write_checkpoint(tmp_path, models["causal_dense"], prefix="causal")
    blobs = {"tokenizer.json": b'{"v": 1}\r\n', "chat_template.jinja": "{{ x }} \u00e9\n".encode(),
             "merges.txt": bytes(range(256)), "generation_config.json": b"{}"}
    for n, b in blobs.items():
        (path / n).write_bytes(b)
    (path / "README.md").write_text("not a resource")
    assert Checkpoint.open(path).resources == blobs


# ---- bad inputs ----

def _rewrite(path: Path, edit) -> None:
    """Load every shard, let edit(tensors) change the dict, write it back (new names into the first shard)."""
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wm = index["weight_map"]
    tensors = {}
    for f in sorted(set(wm.values())):
        tensors.update(load_file(path / f))
    edit(tensors)
    files = sorted(set(wm.values()))
    wm = {n: wm.get(n, files[0]) for n in tensors}
    for f in files:
        save_file({n: t for n, t in tensors.items() if wm[n] == f}, path / f)
    index["weight_map"] = wm
    index_path.write_text(json.dumps(index))


@pytest.fixture()
def vlm_dir(models, tmp_path):
    return ckpts.write_checkpoint(tmp_path / "ck", models["vlm_moe"], experts="per_expert")[0]


def test_missing_paths_and_files(tmp_path):
    with pytest.raises(SourceError) as e:
        Checkpoint.open(str(tmp_path / "nope" / "deeper"))
    assert one_line(e) == f"no such directory: {tmp_path / 'nope' / 'deeper'}"
    (tmp_path / "file").write_text("x")
    with pytest.raises(SourceError, match="not a directory"):
        Checkpoint.open(str(tmp_path / "file"))
    with pytest.raises(SourceError) as e:
        Checkpoint.open(str(tmp_path))
    assert one_line(e) == f"{tmp_path} has no config.json"
    (tmp_path / "config.json").write_text(json.dumps(hf_tiny.make_causal_lm(False, num_layers=4).config.to_dict()))
    with pytest.raises(SourceError) as e:
        Checkpoint.open(str(tmp_path))
    assert one_line(e) == f"{tmp_path} has no *.safetensors files"


def test_revision_with_local_directory_is_refused(vlm_dir):
    with pytest.raises(SourceError, match="revision"):
        Checkpoint.open(str(vlm_dir), revision="main")


def test_index_naming_a_missing_shard(vlm_dir):
    (vlm_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SourceError, match="model-00002-of-00002.safetensors") as e:
        Checkpoint.open(vlm_dir)
    one_line(e)


def test_index_disagreeing_with_shards(vlm_dir):
    index = json.loads((vlm_dir / "model.safetensors.index.json").read_text())
    name = "model.language_model.norm.weight"
    other = {"model-00001-of-00002.safetensors": "model-00002-of-00002.safetensors"}
    index["weight_map"][name] = other.get(index["weight_map"][name], "model-00001-of-00002.safetensors")
    (vlm_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=name):
        Checkpoint.open(vlm_dir)


@pytest.mark.parametrize("cut", ["length", "header", "data"])
def test_truncated_shard_names_the_file(vlm_dir, cut):
    shard = vlm_dir / "model-00001-of-00002.safetensors"
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    keep = {"length": 5, "header": 8 + n // 2, "data": len(raw) - 3}[cut]
    shard.write_bytes(raw[:keep])
    with pytest.raises(SourceError, match=str(shard)) as e:
        Checkpoint.open(vlm_dir)
    assert {"length": "truncated", "header": "truncated", "data": "beyond the end"}[cut] in one_line(e)


def test_malformed_header_names_the_file(vlm_dir):
    shard = vlm_dir / "model-00002-of-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[8:12] = b"\xff{[:"
    shard.write_bytes(bytes(raw))
    with pytest.raises(SourceError, match=f"{shard}: malformed safetensors header") as e:
        Checkpoint.open(vlm_dir)
    one_line(e)


def test_a_header_past_the_parsers_depth_names_the_file(vlm_dir):
    shard = vlm_dir / "model-00002-of-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    assert n // 2 > 1000  # deep enough to exceed the JSON parser's recursion
    raw[8:8 + n] = b"[" * (n // 2) + b"]" * (n // 2) + b" " * (n % 2)
    shard.write_bytes(bytes(raw))
    with pytest.raises(SourceError, match=f"{shard}: malformed safetensors header \\(nested too deeply\\)") as e:
        Checkpoint.open(vlm_dir)
    one_line(e)


def test_offsets_past_the_end_name_the_file(vlm_dir):
    shard = vlm_dir / "model-00001-of-00002.safetensors"
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    size = len(raw) - 8 - n

    def past_the_end(entry):
        begin, end = entry["data_offsets"]
        return {**entry, "data_offsets": [size - (end - begin) + 2, size + 2]}  # right length, 2 bytes past the end

    name = _edit_header(shard, past_the_end)
    with pytest.raises(SourceError, match=f"{shard}: tensor {name} has data offsets.*beyond the end"):
        Checkpoint.open(vlm_dir)


def _edit_header(shard: Path, edit) -> str:
    """Let edit(entry) change the first tensor's header entry in place; returns that tensor's name."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name] = edit(header[name])
    text = json.dumps(header).encode()  # offsets are relative to the data, so the header may change length
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    return name


@pytest.mark.parametrize("case", ["overlap", "trailing"])
def test_tensors_must_tile_the_data_as_safetensors_requires(vlm_dir, case):
    """A tensor on another's bytes (it would read the other's values) or bytes after the last tensor: the
    safetensors library refuses both files, and so does the reader, naming the file."""
    from safetensors import safe_open

    shard = vlm_dir / "model-00001-of-00002.safetensors"
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    if case == "overlap":  # the last tensor moved 2 bytes back, onto the end of the one before it
        last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
        begin, end = header[last]["data_offsets"]
        header[last] = {**header[last], "data_offsets": [begin - 2, end - 2]}
        text = json.dumps(header).encode()
        shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
        want = "overlaps"
    else:
        shard.write_bytes(raw + bytes(6))
        want = "6 bytes after the last tensor"
    with pytest.raises(Exception):
        safe_open(str(shard), "pt")  # the oracle: the library itself refuses the file
    with pytest.raises(SourceError) as e:
        Checkpoint.open(vlm_dir)
    assert one_line(e).startswith(f"{shard}: malformed safetensors file: ") and want in one_line(e)


BAD_ENTRIES = {  # case -> (key, bad value); key None replaces the whole entry
    "dtype-list": ("dtype", ["BF16"]), "dtype-int": ("dtype", 16), "shape-bool": ("shape", [True]),
    "shape-negative": ("shape", [-1, 4]), "shape-float": ("shape", [2.0]), "shape-string": ("shape", "64"),
    "shape-object": ("shape", {"64": 64}), "offsets-one": ("data_offsets", [0]),
    "offsets-three": ("data_offsets", [0, 2, 4]), "offsets-string": ("data_offsets", "01"),
    "offsets-null": ("data_offsets", [0, None]), "entry-list": (None, ["BF16", [1], [0, 2]]),
    "no-dtype": (None, {"shape": [1], "data_offsets": [0, 2]}),
}


@pytest.mark.parametrize("case", list(BAD_ENTRIES))
def test_malformed_header_entry_names_file_and_tensor(vlm_dir, case):
    shard = vlm_dir / "model-00001-of-00002.safetensors"
    key, bad = BAD_ENTRIES[case]
    name = _edit_header(shard, lambda e: bad if key is None else {**e, key: bad})
    with pytest.raises(SourceError) as e:
        Checkpoint.open(vlm_dir)
    assert one_line(e).startswith(f"{shard}: malformed safetensors header entry for tensor {name} ")


def test_oversized_header_length_is_refused_before_reading(vlm_dir):
    """A corrupt length prefix within a big file: refused by the 100 MB cap, not read into memory."""
    shard = vlm_dir / "model-00001-of-00002.safetensors"
    limit = 100_000_000  # the safetensors library's MAX_HEADER_SIZE
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", limit + 1) + b"{}")
        f.truncate(limit + 4096)  # sparse: the announced header fits in the file, so only the cap catches it
    with pytest.raises(SourceError) as e:
        Checkpoint.open(vlm_dir)
    msg = one_line(e)
    assert msg.startswith(f"{shard}: ") and f"header length {limit + 1} bytes exceeds the {limit}-byte limit" in msg


@pytest.mark.parametrize("where", ["parent", "absolute", "subdir"])
def test_index_shard_names_must_be_plain_file_names(vlm_dir, tmp_path, where):
    """An untrusted index must not make the reader open a file outside the checkpoint directory."""
    shard = "model-00002-of-00002.safetensors"
    outside = {"parent": tmp_path, "absolute": tmp_path, "subdir": vlm_dir / "sub"}[where]
    outside.mkdir(exist_ok=True)
    (vlm_dir / shard).rename(outside / shard)  # a real shard: without the check the open would succeed
    fname = {"parent": f"../{shard}", "absolute": str(tmp_path / shard), "subdir": f"sub/{shard}"}[where]
    index_path = vlm_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {n: fname if f == shard else f for n, f in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    first = next(n for n, f in index["weight_map"].items() if f == fname)
    with pytest.raises(SourceError) as e:
        Checkpoint.open(vlm_dir)
    msg = one_line(e)
    assert msg.startswith(f"model.safetensors.index.json maps tensor {first!r} to {fname!r}, "), msg
    assert "not a plain file name" in msg


def test_unsupported_dtype_names_tensor_and_dtype(vlm_dir):
    name = "model.language_model.layers.1.linear_attn.A_log"
    _rewrite(vlm_dir, lambda t: t.update({name: t[name].double()}))
    with pytest.raises(SourceError, match=f"tensor {name} in .* unsupported dtype F64") as e:
        Checkpoint.open(vlm_dir)
    one_line(e)


@pytest.mark.parametrize("name,pattern", [
    ("model.language_model.norm.weight", "lacks tensor model.language_model.norm.weight"),
    ("model.language_model.layers.2.mlp.experts.5.up_proj.weight",
     "lacks tensor model.language_model.layers.2.mlp.experts.5.up_proj.weight"),
    ("mtp.norm.weight", "part of the mtp tensors but lacks mtp.norm.weight"),
    ("model.visual.blocks.1.attn.qkv.bias", "part of the vision tensors but lacks model.visual.blocks.1.attn.qkv.bias"),
])
def test_missing_tensor_is_named(vlm_dir, name, pattern):
    _rewrite(vlm_dir, lambda t: t.pop(name))
    with pytest.raises(SourceError, match=pattern) as e:
        Checkpoint.open(vlm_dir)
    one_line(e)


def test_whole_optional_groups_may_be_absent(vlm_dir):
    _rewrite(vlm_dir, lambda t: [t.pop(n) for n in list(t) if n.startswith(("mtp.", "model.visual."))])
    ck = Checkpoint.open(vlm_dir)
    assert ck.missing_groups == {"mtp", "vision"}
    assert not any(n.startswith(("mtp.", "model.visual.")) for n in ck.names)


@pytest.mark.parametrize("name", ["model.language_model.layers.0.mlp.bogus.weight", "model.extra.weight",
                                  "model.language_model.layers.1.mlp.experts.8.down_proj.weight"])
def test_unexpected_tensor_is_named(vlm_dir, name):
    _rewrite(vlm_dir, lambda t: t.update({name: torch.zeros(64, 32, dtype=torch.bfloat16)}))
    canonical = name.replace("model.extra", "model.language_model.extra")
    with pytest.raises(SourceError, match=f"unexpected tensor {canonical}") as e:
        Checkpoint.open(vlm_dir)
    one_line(e)


def test_shape_disagreeing_with_config_is_a_config_error(vlm_dir):
    name = "model.language_model.norm.weight"
    _rewrite(vlm_dir, lambda t: t.update({name: torch.zeros(65, dtype=torch.bfloat16)}))
    with pytest.raises(ConfigError, match=rf"{name} has shape \[65\].*implies \[64\]") as e:
        Checkpoint.open(vlm_dir)
    one_line(e)


def test_fp8_weight_without_scales_and_stray_scales(models, tmp_path):
    path, _ = ckpts.write_checkpoint(tmp_path, models["vlm_moe"], fp8=True, experts="per_expert")
    name = "model.language_model.layers.3.self_attn.k_proj.weight"
    _rewrite(path, lambda t: t.pop(name + "_scale_inv"))
    with pytest.raises(SourceError, match=f"FP8 tensor {name} has no {name}_scale_inv"):
        Checkpoint.open(path)
    _rewrite(path, lambda t: t.pop(name))
    _rewrite(path, lambda t: t.update({name + "_scale_inv": torch.ones(1, 1)}))
    with pytest.raises(SourceError, match=f"unexpected tensor {name}_scale_inv"):
        Checkpoint.open(path)


# ---- streaming ----

_MEASURE = textwrap.dedent("""
    import json, mmap, sys
    from ninfer_pack.source import Checkpoint

    def kib(key):
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":"))

    def peak_growth(fn):
        base = kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (peak RSS) to the current RSS
        fn()
        return (kib("VmHWM") - base) * 1024

    ck = Checkpoint.open(sys.argv[1])
    ck.read(ck.names[-1])  # warm up lazy imports and the allocator

    def read_all():
        for n in ck.names:
            t = ck.read(n)
            del t

    def mmap_shard():
        with open(shard, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            sum(m[i] for i in range(0, len(m), 4096))  # touch every page

    good = peak_growth(read_all)
    # the two ways not to read a checkpoint, to show the measure sees them
    shard = sorted(ck.path.glob("*.safetensors"))[0]
    whole = peak_growth(lambda: len(shard.read_bytes()))
    mapped = peak_growth(mmap_shard)
    print(json.dumps({"good": good, "whole_shard": whole, "mmap": mapped}))
""")


def test_reading_streams_with_memory_bounded_by_the_largest_tensor(tmp_path):
    """Peak RSS growth (VmHWM, reset just before) of a fresh process reading every tensor in turn.

    Why this measure: VmHWM counts every resident page, torch's allocator and file mappings included, where
    tracemalloc sees neither torch tensors nor mmap; a fresh process with malloc's mmap threshold pinned
    returns freed tensors to the OS at once, so the peak reflects live memory rather than allocator caching.
    """
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    kw = hf_tiny.text_config_kwargs(moe=False, num_layers=16)
    kw.update(vocab_size=4096, hidden_size=256, intermediate_size=4096)  # every big tensor is 1M bf16 = 2 MiB
    import transformers as tf

    cfg = json.loads(tf.Qwen3_5TextConfig(**kw).to_json_string(use_diff=False))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shapes = ModelSpec.from_config(cfg).tensor_shapes()
    names = [n for n, t in shapes.items() if t.group == "text"]
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        save_file({n: torch.zeros(shapes[n].shape, dtype=torch.bfloat16) for n in part},
                  tmp_path / f"model-{i + 1:05d}-of-00002.safetensors")
    largest = max(shapes[n].numel for n in names) * 2
    total = sum(shapes[n].numel for n in names) * 2
    assert total > 40 * largest

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    # one tensor alive at a time (plus page-granular slack); a whole-shard load is ~total/2 = 20+ x largest
    assert got["good"] <= 3 * largest, got
    assert got["whole_shard"] > 10 * largest and got["mmap"] > 10 * largest, got
