"""The .ninfer container: write/read round trip, alignment, atomicity, and every way a file can be bad."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest

from ninfer_rt.errors import FormatError
from ninfer_rt.format import MAGIC, PAYLOAD_ALIGN, PREFIX, TENSOR_ALIGN, Artifact, ArtifactWriter, TensorEntry
from ninfer_rt.formats import get_format
from ninfer_rt.config import ModelSpec
from ninfer_pack.tiny import tiny_config

META = {"model": {"config": tiny_config("moe"), "spec": ModelSpec.from_config(tiny_config("moe")).to_dict()},
        "recipe": {"name": "test"}, "provenance": {"source": "unit"}}


def _entries(rng):
    """Three tensors of different formats with their exact bytes."""
    shapes = {"a.weight": ("bf16", (3, 5)), "b.weight": ("fp32", (7,)), "c.weight": ("q4g32", (4, 200))}
    entries, data = [], {}
    for name, (fmt, shape) in shapes.items():
        n = get_format(fmt).nbytes(shape)
        entries.append(TensorEntry(name=name, shape=list(shape), format=fmt,
                                   parts=[{"name": name, "shape": list(shape)}], nbytes=n))
        data[name] = rng.integers(0, 256, n, dtype=np.uint8)
    return entries, data


def _write(path, rng, resources=None):
    entries, data = _entries(rng)
    with ArtifactWriter(path, META, entries, resources or {"tokenizer.json": b'{"x": 1}'}) as w:
        for name in reversed(list(data)):  # any order
            w.write_tensor(name, data[name])
    return data


def test_round_trip_and_alignment(tmp_path, rng):
    p = tmp_path / "m.ninfer"
    data = _write(p, rng, {"tokenizer.json": b"tok", "chat_template.jinja": "{{ x }}\u00e9".encode()})
    with Artifact.open(p) as art:
        assert art.size == p.stat().st_size == art.header["file_size"]
        assert art.header["payload_offset"] % PAYLOAD_ALIGN == 0
        for name, buf in data.items():
            e = art.tensors[name]
            assert e.offset % TENSOR_ALIGN == 0
            assert bytes(art.raw(name)) == buf.tobytes()
            assert e.sha256 == hashlib.sha256(buf.tobytes()).hexdigest()
        assert art.resource("chat_template.jinja") == "{{ x }}\u00e9".encode()
        hashed = []
        assert art.verify_checksums(hashed.append) == []
        # the checksums' progress covers the payload: every tensor and resource, not the header or the padding
        assert sum(hashed) == art.payload_bytes == sum(b.nbytes for b in data.values()) + 3 + 9 < art.size
        header_sha256 = art.header_sha256
    raw = p.read_bytes()
    magic, version, _f, hlen, hsum = PREFIX.unpack(raw[:PREFIX.size])
    assert magic == MAGIC and version == 1
    assert hashlib.sha256(raw[64:64 + hlen]).digest() == hsum and hsum.hex() == header_sha256
    assert set(raw[64 + hlen:json.loads(raw[64:64 + hlen])["payload_offset"]]) <= {0}


def test_same_content_same_bytes(tmp_path):
    rng1, rng2 = np.random.default_rng(7), np.random.default_rng(7)
    _write(tmp_path / "a.ninfer", rng1)
    _write(tmp_path / "b.ninfer", rng2)
    assert (tmp_path / "a.ninfer").read_bytes() == (tmp_path / "b.ninfer").read_bytes()


def test_interrupted_write_leaves_nothing(tmp_path, rng):
    entries, data = _entries(rng)
    p = tmp_path / "m.ninfer"
    with pytest.raises(KeyboardInterrupt):
        with ArtifactWriter(p, META, entries, {}) as w:
            w.write_tensor("a.weight", data["a.weight"])
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="never written"):
        with ArtifactWriter(p, META, entries, {}) as w:
            w.write_tensor("a.weight", data["a.weight"])
    assert list(tmp_path.iterdir()) == []


def test_wrong_size_write_is_refused(tmp_path, rng):
    entries, data = _entries(rng)
    with pytest.raises(ValueError, match="size formula"):
        with ArtifactWriter(tmp_path / "m.ninfer", META, entries, {}) as w:
            w.write_tensor("a.weight", data["a.weight"][:-1])
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def good(tmp_path, rng):
    p = tmp_path / "good.ninfer"
    _write(p, rng)
    return p


def _rewrite_header(src, dst, mutate):
    """Copy an artifact with a mutated header, re-hashed so only the mutation is wrong (it may grow into the
    zero padding before the payload, so every offset stays valid)."""
    raw = bytearray(src.read_bytes())
    _m, v, f, hlen, _h = PREFIX.unpack(raw[:PREFIX.size])
    h = json.loads(raw[64:64 + hlen])
    payload = h["payload_offset"]
    mutate(h)
    new = json.dumps(h, sort_keys=True, separators=(",", ":")).encode()
    assert PREFIX.size + len(new) <= payload
    raw[:PREFIX.size] = PREFIX.pack(MAGIC, v, f, len(new), hashlib.sha256(new).digest())
    raw[64:payload] = new + bytes(payload - 64 - len(new))
    dst.write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file"),
    ("empty", "not a ninfer artifact"),
    ("foreign", "bad magic"),
    ("version", "format version 9"),
    ("truncated_header", "truncated"),
    ("truncated_payload", "truncated"),
    ("trailing", "longer than its header says"),
    ("header_bit", "header checksum mismatch"),
    ("bad_offset", "misaligned or out of bounds"),
    ("bad_nbytes", "size formula|needs"),
    ("overlap", "overlap"),
    ("unknown_format", "unknown weight format"),
    ("recipe_name", "header field 'recipe.name' is not a string"),
    ("provenance_source", "header field 'provenance.source' is not a string"),
])
def test_bad_files_are_rejected_with_a_reason(good, tmp_path, case, message):
    p = tmp_path / f"{case}.ninfer"
    raw = good.read_bytes()
    hlen = PREFIX.unpack(raw[:PREFIX.size])[3]
    if case == "empty":
        p.write_bytes(b"")
    elif case == "foreign":
        p.write_bytes(b"PK\x03\x04" + raw[4:])
    elif case == "version":
        p.write_bytes(raw[:8] + struct.pack("<I", 9) + raw[12:])
    elif case == "truncated_header":
        p.write_bytes(raw[:100])
    elif case == "truncated_payload":
        p.write_bytes(raw[:-10])
    elif case == "trailing":
        p.write_bytes(raw + b"\0")
    elif case == "header_bit":
        b = bytearray(raw)
        b[64 + hlen // 2] ^= 0x01
        p.write_bytes(bytes(b))
    elif case == "bad_offset":
        _rewrite_header(good, p, lambda h: h["tensors"][0].update(offset=h["tensors"][0]["offset"] + 8))
    elif case == "bad_nbytes":
        _rewrite_header(good, p, lambda h: h["tensors"][0].update(nbytes=h["tensors"][0]["nbytes"] - 1))
    elif case == "overlap":
        _rewrite_header(good, p, lambda h: h["tensors"][1].update(offset=h["tensors"][0]["offset"]))
    elif case == "unknown_format":
        _rewrite_header(good, p, lambda h: h["tensors"][0].update(format="q3g7"))
    elif case == "recipe_name":  # info, bench and publish show it as text
        _rewrite_header(good, p, lambda h: h["recipe"].update(name=["x"]))
    elif case == "provenance_source":
        _rewrite_header(good, p, lambda h: h["provenance"].update(source={"a": 1}))
    with pytest.raises(FormatError, match=message) as ei:
        Artifact.open(p)
    assert "\n" not in str(ei.value)


def test_paths_that_are_not_files_say_what_they_are(tmp_path, monkeypatch):
    """An empty path is not "." (a directory), a symlink loop is not a missing file, a FIFO is not a file."""
    import errno
    import os

    with pytest.raises(FormatError, match="^the artifact path is empty$"):
        Artifact.open("")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(FormatError) as ei:
        Artifact.open(tmp_path / "a")
    assert str(ei.value) == f"{tmp_path / 'a'}: {os.strerror(errno.ELOOP)}"
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(FormatError, match="^not a file: "):
        Artifact.open(tmp_path / "fifo")


def test_payload_corruption_is_found_by_checksums(good, tmp_path):
    with Artifact.open(good) as art:
        off = art.tensors["c.weight"].offset
    b = bytearray(good.read_bytes())
    b[off + 3] ^= 0x10
    p = tmp_path / "flip.ninfer"
    p.write_bytes(bytes(b))
    with Artifact.open(p) as art:  # structure is intact...
        assert art.verify_checksums() == ["c.weight"]  # ...the payload is not


def test_padding_damage_is_found_though_no_checksum_covers_it(good, tmp_path):
    """Every gap (after the header, between objects) is zero as written; a flipped byte in one is named by its
    stretch, while every checksum still matches."""
    raw = good.read_bytes()
    header_end = PREFIX.size + PREFIX.unpack(raw[:PREFIX.size])[3]
    with Artifact.open(good) as art:
        assert art.nonzero_gaps() == []
        spans = sorted((o.offset, o.offset + o.nbytes) for o in [*art.tensors.values(), *art.resources.values()])
    gaps = [(header_end, spans[0][0])] + [(a[1], b[0]) for a, b in zip(spans, spans[1:]) if b[0] > a[1]]
    assert len(gaps) >= 2  # the header's and at least one object's padding
    for lo, hi in (gaps[0], gaps[1]):
        b = bytearray(raw)
        b[(lo + hi) // 2] ^= 0x04
        p = tmp_path / f"pad{lo}.ninfer"
        p.write_bytes(bytes(b))
        with Artifact.open(p) as art:
            assert art.verify_checksums() == [] and len(art.nonzero_gaps()) == 1
            assert f"bytes [{lo}, {hi}) between " in art.nonzero_gaps()[0]


def _with_raw_header(src, dst, header: bytes, flags: int = 0):
    """Copy an artifact with its header replaced by arbitrary bytes (re-hashed, so only the content is wrong)."""
    raw = bytearray(src.read_bytes())
    hlen = PREFIX.unpack(raw[:PREFIX.size])[3]
    header = header + b" " * max(0, hlen - len(header))
    raw[:PREFIX.size] = PREFIX.pack(MAGIC, 1, flags, len(header), hashlib.sha256(header).digest())
    dst.write_bytes(bytes(raw[:PREFIX.size]) + header + bytes(raw[PREFIX.size + hlen:]))
    return dst


@pytest.mark.parametrize("case, message", [
    ("list", "not a JSON object"),
    ("nested", "not valid UTF-8 JSON"),
    ("utf16", "not valid UTF-8 JSON"),
    ("flags", "reserved prefix bytes"),
    ("bool_version", "'version' is missing or not a int"),
    ("payload_zero", "inside the header"),
    ("negative_shape", "invalid shape"),
    ("bool_shape", "invalid shape"),
    ("parts_missing", "parts must be a list"),
    ("part_shape_str", "parts must be a list"),
    ("transform_unknown", "unknown layout transform"),
    ("transform_list", "unknown layout transform"),
    ("params_list", "params must be an object"),
    ("sha_not_hex", "malformed checksum"),
    ("extra_key", "malformed tensor entry"),
    ("bad_spec", "model description in the header is invalid"),
])
def test_adversarial_headers_give_one_line(good, tmp_path, case, message):
    p = tmp_path / f"{case}.ninfer"
    raw = good.read_bytes()
    hlen = PREFIX.unpack(raw[:PREFIX.size])[3]
    tensor_edits = {
        "negative_shape": {"shape": [-3, 5]},
        "bool_shape": {"shape": [True, 5]},
        "parts_missing": {"parts": []},
        "part_shape_str": {"parts": [{"name": "a.weight", "shape": "3x5"}]},
        "transform_unknown": {"transform": "rot13"},
        "transform_list": {"transform": ["identity"]},
        "params_list": {"params": [1]},
        "sha_not_hex": {"sha256": "z" * 64},
        "extra_key": {"colour": "red"},
    }
    header_edits = {
        "bool_version": lambda h: h.update(version=True),
        "payload_zero": lambda h: h.update(payload_offset=0),
        "bad_spec": lambda h: h["model"]["spec"].update(num_key_value_heads=0),
    }
    if case == "list":
        _with_raw_header(good, p, b"[1, 2]")
    elif case == "nested":
        _with_raw_header(good, p, b"[" * 200_000)
    elif case == "utf16":
        _with_raw_header(good, p, raw[64:64 + hlen].decode().encode("utf-16"))
    elif case == "flags":
        _with_raw_header(good, p, raw[64:64 + hlen], flags=1)
    elif case in tensor_edits:
        _rewrite_header(good, p, lambda h: h["tensors"][0].update(tensor_edits[case]))
    else:
        _rewrite_header(good, p, header_edits[case])
    with pytest.raises(FormatError, match=message) as ei:
        Artifact.open(p)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("mutation", [
    {"parts": [{"name": "a.weight", "shape": [3, 5]}, {"name": "a2.weight", "shape": [3, 5]}]},
    {"parts": [{"name": "a.weight", "shape": [5, 3]}]},
    {"transform": "fuse_qkvg", "params": {"num_heads": "1"}},
    {"transform": "interleave_gate_up", "params": {"tile": 0}},
])
def test_inconsistent_layout_records_fail_on_use_with_one_line(good, tmp_path, mutation):
    """Types pass at open; a table whose parts/transform/params disagree fails when inverted, with a reason."""
    p = _rewrite_header(good, tmp_path / "m.ninfer", lambda h: h["tensors"][0].update(mutation))
    with Artifact.open(p) as art:
        with pytest.raises(FormatError, match="a.weight") as ei:
            art.checkpoint_tensors("a.weight")
    assert "\n" not in str(ei.value)


def test_a_killed_writers_temporary_file_goes_at_the_next_write(tmp_path):
    """A write of m.ninfer removes the temporary files earlier writes of it left on this host whose process is gone
    (SIGKILL gives no chance to clean up); a live process's, another host's and other outputs' stay."""
    import errno
    import os
    import socket
    import subprocess
    import sys

    from ninfer_rt.format import temp_path

    p = tmp_path / "m.ninfer"
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".m.ninfer.tmp-{host}-{int(dead.stdout)}"  # a process that has exited
    kept = [tmp_path / f".m.ninfer.tmp-{host}-{os.getppid()}", tmp_path / f".m.ninfer.tmp-elsewhere-{int(dead.stdout)}",
            tmp_path / f".other.ninfer.tmp-{host}-{int(dead.stdout)}"]
    for f in [stale, *kept]:
        f.write_bytes(b"half an artifact")
    assert temp_path(p).name == f".m.ninfer.tmp-{host}-{os.getpid()}"
    _write(p, np.random.default_rng(1))
    assert not stale.exists() and all(f.exists() for f in kept)
    with Artifact.open(p) as art:
        assert art.verify_checksums() == []
